//! `run`, `chat`, `logits` and `perplexity`: the commands that compute.

use crate::GlobalOptions;
use anyhow::{Context, Result, bail};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use ts_engine::chat::harmony::{Channel, HarmonyEvent, HarmonyParser};
use ts_engine::chat::{ChatMessage, ChatTemplate};
use ts_engine::sampler::{SamplerConfig, random_seed};
use ts_engine::session::{Engine, GenerationStats, LoadOptions, peak_rss_bytes};
use ts_model::ExpertPlacement;

/// Options of every command that loads a model.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// Context size in tokens (default: the model's, capped at 4096).
    #[arg(short = 'c', long = "ctx-size")]
    ctx: Option<usize>,
    /// Rows per forward step during prompt processing.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    batch: usize,
    /// Where routed experts live: `mapped` (pages of the file, the OS decides) or `resident` (read into memory at open).
    #[arg(long, default_value = "mapped")]
    experts: String,
    /// Keep activations in f32 for quantized weights instead of quantizing them to 8 bits
    /// (as llama.cpp does): slower, and equal to a float32 run on the dequantized weights.
    #[arg(long)]
    exact_activations: bool,
}

/// Sampling options, with llama.cpp's defaults.
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Random seed (default: a new one each run, printed to stderr).
    #[arg(short = 's', long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    fn config(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed.unwrap_or_else(random_seed),
        }
    }
}

#[derive(clap::Args)]
pub struct RunArgs {
    /// The prompt, continued as plain text (no chat template).
    #[arg(short = 'p', long = "prompt")]
    prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long = "file", conflicts_with = "prompt")]
    file: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    n_predict: usize,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
}

#[derive(clap::Args)]
pub struct ChatArgs {
    /// A system message to start the conversation with.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 1024)]
    n_predict: usize,
    /// Show a reasoning model's thinking (gpt-oss's analysis channel) on stderr.
    #[arg(long)]
    show_thinking: bool,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
}

#[derive(clap::Args)]
pub struct LogitsArgs {
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// One row per position instead of the last position's only.
    #[arg(long)]
    all: bool,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(clap::Args)]
pub struct PerplexityArgs {
    /// The text to score.
    #[arg(short = 'f', long = "file")]
    file: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn load(global: &GlobalOptions, args: &ModelArgs) -> Result<(Engine, usize)> {
    let model = global.model(None)?;
    let experts = match args.experts.as_str() {
        "mapped" => ExpertPlacement::Mapped,
        "resident" => ExpertPlacement::Resident,
        other => bail!("--experts {other}: expected `mapped` or `resident`"),
    };
    if args.batch == 0 {
        bail!("--batch-size must be at least 1");
    }
    let opts = LoadOptions { threads: global.threads()?, experts };
    let mut engine = Engine::load(&model, &opts).with_context(|| format!("loading {}", model.display()))?;
    engine.n_batch = args.batch;
    engine.exact_activations = args.exact_activations;
    let n_ctx = args.ctx.unwrap_or_else(|| engine.default_context());
    if n_ctx == 0 {
        bail!("--ctx-size must be at least 1");
    }
    Ok((engine, n_ctx))
}

fn report(stats: &GenerationStats) {
    let rss =
        peak_rss_bytes().map(|b| format!(", peak RSS {:.1} MiB", b as f64 / (1 << 20) as f64)).unwrap_or_default();
    eprintln!(
        "\nprompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s{rss}",
        stats.prompt_tokens,
        stats.prompt_tps(),
        stats.generated_tokens,
        stats.generation_tps()
    );
}

pub fn run(global: &GlobalOptions, args: &RunArgs) -> Result<()> {
    let prompt = match (&args.prompt, &args.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
        (None, None) => bail!("no prompt given: pass -p TEXT or -f FILE"),
    };
    let (engine, n_ctx) = load(global, &args.model)?;
    let sampler = args.sampling.config();
    let tokens = engine.tokenizer.encode(&prompt, true, true)?;
    let mut seq = engine.new_sequence(n_ctx);
    let mut out = std::io::stdout().lock();
    let mut closed = false;
    let (_, stats) = engine.generate(&mut seq, &tokens, args.n_predict, &sampler, false, |text| {
        closed = out.write_all(text.as_bytes()).and_then(|()| out.flush()).is_err();
        !closed
    })?;
    drop(out);
    report(&stats);
    eprintln!("seed {}", sampler.seed);
    Ok(())
}

pub fn chat(global: &GlobalOptions, args: &ChatArgs) -> Result<()> {
    let (engine, n_ctx) = load(global, &args.model)?;
    let chatml;
    let template = match &engine.template {
        Some(t) => t,
        None => {
            eprintln!("the model has no chat template; using ChatML");
            chatml = ChatTemplate::chatml();
            &chatml
        }
    };
    let harmony = engine.model.cfg.arch == ts_model::Arch::GptOss;
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage { role: "system".into(), content: s.clone() });
    }
    let mut seq = engine.new_sequence(n_ctx);
    let mut cached: Vec<u32> = Vec::new();
    let stdin = std::io::stdin();
    let interactive = std::io::IsTerminal::is_terminal(&stdin);
    loop {
        if interactive {
            eprint!("> ");
        }
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            return Ok(());
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            continue;
        }
        messages.push(ChatMessage { role: "user".into(), content: line.to_string() });
        let rendered = template.render(&messages, true)?;
        // The template emits BOS itself where the model wants one.
        let tokens = engine.tokenizer.encode(&rendered, false, true)?;
        // Reuse the cache for the common prefix of the last turn's tokens.
        let common = cached.iter().zip(&tokens).take_while(|(a, b)| a == b).count().min(tokens.len() - 1);
        if common < seq.n_past {
            seq.clear();
            engine.prefill(&mut seq, &tokens[..common], false)?;
        }
        let mut reply = String::new();
        let mut parser = HarmonyParser::new();
        let mut channel = Channel::Unspecified;
        let mut out = std::io::stdout().lock();
        let show_thinking = args.show_thinking;
        let mut emit = |text: &str, out: &mut std::io::StdoutLock| {
            if !harmony {
                reply.push_str(text);
                let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
                return;
            }
            for ev in parser.feed(text) {
                match ev {
                    HarmonyEvent::MessageStart(h) => channel = h.channel,
                    HarmonyEvent::Content(text) if channel == Channel::Final => {
                        reply.push_str(&text);
                        let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
                    }
                    HarmonyEvent::Content(text) if show_thinking => eprint!("{text}"),
                    _ => {}
                }
            }
        };
        let sampler = args.sampling.config();
        let (generated, stats) =
            engine.generate(&mut seq, &tokens[common..], args.n_predict, &sampler, harmony, |t| {
                emit(t, &mut out);
                true
            })?;
        writeln!(out)?;
        drop(out);
        cached = tokens;
        cached.extend_from_slice(&generated);
        if interactive {
            report(&stats);
        }
        messages.push(ChatMessage { role: "assistant".into(), content: reply });
    }
}

pub fn logits(global: &GlobalOptions, args: &LogitsArgs) -> Result<()> {
    let (engine, n_ctx) = load(global, &args.model)?;
    let n_vocab = engine.model.cfg.n_vocab;
    if let Some(&bad) = args.tokens.iter().find(|&&t| t as usize >= n_vocab) {
        bail!("token id {bad} is out of range (vocabulary size {n_vocab})");
    }
    let mut seq = engine.new_sequence(n_ctx.max(args.tokens.len()));
    let rows = engine.prefill(&mut seq, &args.tokens, args.all)?;
    let json = serde_json::json!({ "tokens": args.tokens, "logits": rows });
    crate::write_stdout(format!("{json}\n").as_bytes())
}

pub fn perplexity(global: &GlobalOptions, args: &PerplexityArgs) -> Result<()> {
    let (engine, n_ctx) = load(global, &args.model)?;
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let ppl = engine.perplexity(&text, n_ctx, |chunk, ppl| eprint!("[{chunk}]{ppl:.4},"))?;
    eprintln!();
    println!("chunks {} (n_ctx {n_ctx}), {} tokens scored, +/- {:.5}", ppl.chunks, ppl.scored, ppl.ppl_error);
    println!("PPL = {:.4}", ppl.ppl);
    Ok(())
}
