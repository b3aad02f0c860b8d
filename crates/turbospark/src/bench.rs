//! `turbospark bench`: prompt processing and generation speed, measured the
//! way llama-bench does (random tokens from an empty context; pp = one
//! prefill of N tokens, tg = N single-token steps), as mean ± sd over runs;
//! with `--parallel`, generation of several sequences at once, as
//! llama-batched-bench's `-npl` (each step one row per sequence); with a drafter
//! (`--spec-ngram`, `--draft-model`), greedy generation after a random prompt
//! with and without it.

use crate::GlobalOptions;
use crate::generate::{ModelArgs, SpecArgs, drafter, load};
use anyhow::{Context, Result, bail};
use serde_json::json;
use std::time::Instant;
use ts_engine::decode::{Logits, Piece};
use ts_engine::sampler::SamplerConfig;
use ts_engine::session::{Engine, peak_rss_bytes};
use ts_engine::speculative::SpecOptions;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Prompt tokens to process (0 skips the test).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    n_prompt: usize,
    /// Tokens to generate (0 skips the test).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    n_gen: usize,
    /// Tokens already in the sequence before each prompt and generation test, e.g. `0,4096`
    /// (llama-bench's `-d`): written untimed first, each test reported as `pp512 @ d4096`.
    /// Each test's sequence holds its depth and its own tokens, as llama-bench's context, or
    /// `-c` positions where given; the --parallel and drafter tests hold only their prompts
    /// of -p tokens.
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', default_value = "0")]
    n_depth: Vec<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    repetitions: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Skip the untimed run of each test that comes first (as llama-bench's --no-warmup);
    /// with streamed experts the warm-up also fills the cache.
    #[arg(long)]
    no_warmup: bool,
    /// Also generate with this many sequences at once, e.g. `1,4,16` (llama-batched-bench's
    /// `-npl`): each sequence first holds a prompt of `-p` tokens (untimed), then `-n` steps of
    /// one row per sequence; reported as `tgN xS`, tokens of all sequences per second.
    #[arg(long = "parallel", alias = "npl", value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=256))]
    parallel: Vec<u32>,
    /// With a drafter: `gN greedy` and `gN greedy+spec`, greedy generation of up to `-n`
    /// tokens after a random prompt of `-p` tokens (at least 1), without and with guesses.
    #[command(flatten)]
    spec: SpecArgs,
    #[command(flatten)]
    model: ModelArgs,
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 { v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

pub fn run(global: &GlobalOptions, args: &BenchArgs) -> Result<()> {
    if args.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    // `-t 1,4,8`: the model loads once, with the first count, and each count runs every test.
    let counts = global.thread_counts()?;
    let mut first = global.clone();
    first.threads = counts[..1].to_vec();
    let global = &first;
    let spec = args.spec.options()?;
    let (engine, n_ctx, cuda) = load(global, &args.model, args.spec.mtp())?;
    // `-c`: every pp and tg test in a sequence of that many positions (a user's cache size);
    // without it each test's sequence holds just its depth and tokens, as llama-bench's.
    let ctx = args.model.ctx_given().then_some(n_ctx);
    let draft = args.spec.load_draft(&args.model, &engine)?;
    let path = global.model(None)?;
    crate::on_device!(global, engine, draft, cuda, |engine, draft| run_counts(
        engine,
        draft,
        spec.as_ref(),
        &counts,
        args,
        ctx,
        &path
    ))
}

/// Every test at each thread count, then one report.
fn run_counts<B: ts_model::Backend>(
    mut engine: Engine<B>,
    mut draft: Option<Engine<B>>,
    spec: Option<&SpecOptions>,
    counts: &[usize],
    args: &BenchArgs,
    ctx: Option<usize>,
    path: &std::path::Path,
) -> Result<()> {
    let mut runs = Vec::with_capacity(counts.len());
    for (i, &threads) in counts.iter().enumerate() {
        if i > 0 {
            engine.set_threads(threads)?;
            if let Some(d) = draft.as_mut() {
                d.share_threads(&engine);
            }
        }
        runs.push(measure(&engine, draft.as_ref(), spec, threads, args, ctx)?);
    }
    report(&engine, &runs, args, path)
}

/// One thread count's figures: (test, (mean tok/s, deviation)), the expert cache's counters
/// per test (with the tokens they cover) and the drafter's per `+spec` test.
struct Measured {
    threads: usize,
    results: Vec<(String, (f64, f64))>,
    cache_lines: Vec<(String, ts_model::StatsSnapshot, usize)>,
    spec_lines: Vec<(String, ts_engine::session::GenerationStats, usize)>,
}

/// Whether the generation tests copy each step's logits out of where the backend leaves them on
/// the host (`TURBOSPARK_BENCH_COPY_LOGITS`, a measurement knob); by default they are left there (a
/// GPU's page-locked memory), as llama-bench and llama-batched-bench leave llama.cpp's.
fn copy_logits() -> bool {
    std::env::var_os("TURBOSPARK_BENCH_COPY_LOGITS").is_some()
}

fn measure<B: ts_model::Backend>(
    engine: &Engine<B>,
    draft: Option<&Engine<B>>,
    spec: Option<&SpecOptions>,
    threads: usize,
    args: &BenchArgs,
    ctx: Option<usize>,
) -> Result<Measured> {
    let n_vocab = engine.model.cfg.n_vocab as u64;
    let mut rng = ts_synth::Rng::new(42);
    let mut tokens = |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % n_vocab) as u32).collect() };

    let warm = usize::from(!args.no_warmup);

    let mut results = Vec::new();
    let mut cache_lines = Vec::new();
    let snapshot = || engine.model.backend.expert_stats().or_else(|| engine.model.experts.stats());
    // Each depth's prompt test (pp: the tokens in one prefill) and generation test (tg: one
    // token a step), each after `depth` untimed tokens in a cleared sequence of its own with
    // room for `depth + n` positions, as llama-bench sizes each test's context, or `ctx` (a
    // longer cache is slower to attend to on some paths: GPU decode attention splits by it).
    for &depth in &args.n_depth {
        for (name, n, step) in [("pp", args.n_prompt, args.n_prompt), ("tg", args.n_gen, 1)] {
            if n == 0 {
                continue;
            }
            let test = if depth == 0 { format!("{name}{n}") } else { format!("{name}{n} @ d{depth}") };
            let n_ctx = match ctx {
                Some(c) if c < depth + n => {
                    bail!("bench: {test} needs {} positions, more than --ctx-size {c}", depth + n)
                }
                Some(c) => c,
                None => depth + n,
            };
            let mut seq = engine.new_sequence(n_ctx)?;
            let mut tps = Vec::new();
            let mut before = snapshot();
            for rep in 0..warm + args.repetitions {
                let (context, input) = (tokens(depth), tokens(n));
                seq.clear();
                if !context.is_empty() {
                    engine.prefill(&mut seq, &context, false)?;
                }
                if rep == warm {
                    before = snapshot();
                }
                let t = Instant::now();
                let mut scratch = engine.scratch();
                let mut run = || match name {
                    // One token a step, its logits left where the backend puts them on the host.
                    "tg" if !copy_logits() => input.iter().try_for_each(|token| {
                        let piece = Piece { tokens: std::slice::from_ref(token), logits: Logits::Last };
                        engine.step_read(&mut [&mut seq], &[piece], &mut scratch, &mut |_, _| {})
                    }),
                    _ => input.chunks(step).try_for_each(|piece| engine.prefill(&mut seq, piece, false).map(drop)),
                };
                // A measurement knob: the timed loop on the engine's pool, each step's own hand-over to it then
                // running in place.
                if std::env::var_os("TURBOSPARK_BENCH_ON_POOL").is_some() {
                    engine.install(run)?;
                } else {
                    run()?;
                }
                if rep >= warm {
                    tps.push(n as f64 / t.elapsed().as_secs_f64());
                }
            }
            results.push((test.clone(), mean_sd(&tps)));
            if let (Some(a), Some(b)) = (snapshot(), before) {
                cache_lines.push((test, a.since(&b), n * args.repetitions));
            }
        }
    }

    for &n_seq in &args.parallel {
        let n_seq = n_seq as usize;
        let mut tps = Vec::new();
        let mut scratch = engine.scratch();
        for rep in 0..warm + args.repetitions.max(1) {
            let mut seqs = (0..n_seq)
                .map(|_| engine.new_sequence(args.n_prompt + args.n_gen.max(1)))
                .collect::<Result<Vec<_>, _>>()?;
            for seq in &mut seqs {
                if args.n_prompt > 0 {
                    engine.prefill(seq, &tokens(args.n_prompt), false)?;
                }
            }
            let steps: Vec<Vec<u32>> = (0..args.n_gen).map(|_| tokens(n_seq)).collect();
            let t = Instant::now();
            for step in &steps {
                let pieces: Vec<Piece> =
                    step.iter().map(|tok| Piece { tokens: std::slice::from_ref(tok), logits: Logits::Last }).collect();
                let mut refs: Vec<_> = seqs.iter_mut().collect();
                match copy_logits() {
                    true => drop(engine.step(&mut refs, &pieces, &mut scratch)?),
                    false => engine.step_read(&mut refs, &pieces, &mut scratch, &mut |_, _| {})?,
                }
            }
            if rep >= warm {
                tps.push((n_seq * args.n_gen) as f64 / t.elapsed().as_secs_f64());
            }
        }
        results.push((format!("tg{} x{n_seq}", args.n_gen), mean_sd(&tps)));
    }

    let mut spec_lines = Vec::new();
    if let Some(opts) = spec {
        // Greedy, the end-of-generation tokens banned (llama.cpp's --ignore-eos): every run
        // generates -n tokens.
        let eog = engine.tokenizer().context("bench with a drafter generates text: it needs the model's tokenizer")?;
        let sampler = SamplerConfig {
            logit_bias: eog.eog_tokens().iter().map(|&t| (t, f32::NEG_INFINITY)).collect(),
            ..SamplerConfig::greedy()
        };
        let n_ctx = args.n_prompt.max(1) + args.n_gen + 1;
        let prompts: Vec<Vec<u32>> = (0..warm + args.repetitions).map(|_| tokens(args.n_prompt.max(1))).collect();
        for with_spec in [false, true] {
            let mut tps = Vec::new();
            let (mut generated, mut stats_sum) = (0, ts_engine::session::GenerationStats::default());
            let mut before = snapshot();
            for (rep, prompt) in prompts.iter().enumerate() {
                let mut seq = engine.new_sequence(n_ctx)?;
                let mut guesser = if with_spec { drafter(&args.spec, engine, draft, &mut seq)? } else { None };
                let guessing = guesser.as_deref_mut().map(|d| (d, opts));
                if rep == warm {
                    before = snapshot();
                }
                let (_, st) = engine.generate(&mut seq, prompt, args.n_gen, &sampler, false, guessing, |_| true)?;
                if rep >= warm {
                    tps.push(st.generated_tokens as f64 / st.generation_time.as_secs_f64());
                    generated += st.generated_tokens;
                    stats_sum.spec_steps += st.spec_steps;
                    stats_sum.drafted += st.drafted;
                    stats_sum.accepted += st.accepted;
                    stats_sum.draft_time += st.draft_time;
                    stats_sum.check_time += st.check_time;
                    stats_sum.warm_ups += st.warm_ups;
                }
            }
            let test = format!("g{} greedy{}", args.n_gen, if with_spec { "+spec" } else { "" });
            results.push((test.clone(), mean_sd(&tps)));
            if let (Some(a), Some(b)) = (snapshot(), before) {
                cache_lines.push((test.clone(), a.since(&b), generated.max(1)));
            }
            if with_spec {
                spec_lines.push((test, stats_sum, generated));
            }
        }
    }

    Ok(Measured { threads, results, cache_lines, spec_lines })
}

/// The table (or JSON: one object per thread count) of every run, peak RSS, the weights a
/// token reads, and the cache's and drafter's lines.
fn report<B: ts_model::Backend>(
    engine: &Engine<B>,
    runs: &[Measured],
    args: &BenchArgs,
    path: &std::path::Path,
) -> Result<()> {
    let cfg = &engine.model.cfg;
    let file_size = ts_gguf::GgufFile::open(path)?.header.tensor_bytes_total();
    let rss = peak_rss_bytes().unwrap_or(0);
    let per_token = engine.model.weights.bytes_per_token(cfg.moe.as_ref().map_or(0, |m| m.n_expert_used));
    let model_name = path.file_name().map(|f| f.to_string_lossy().to_string()).unwrap_or_default();
    if args.json {
        let mut lines = String::new();
        for Measured { threads, results, cache_lines, spec_lines } in runs {
            let tests: Vec<_> = results
                .iter()
                .map(|(t, (m, s))| {
                    let cache = cache_lines.iter().find(|c| &c.0 == t).map(|(_, st, n)| {
                        let total = st.total();
                        json!({
                            "hits": total.hits, "misses": total.misses, "hit_rate": total.hit_rate(),
                            "bytes_read": total.bytes_read, "bytes_read_per_token": total.bytes_read as f64 / *n as f64,
                            "read_seconds": total.read_time.as_secs_f64(), "wait_seconds": total.wait_time.as_secs_f64(),
                            "slots": st.slots, "slot_bytes": st.slot_bytes, "source": st.source, "measures_wait": st.measures_wait, "policy": st.policy,
                        })
                    });
                    let spec = spec_lines.iter().find(|l| &l.0 == t).map(|(_, st, n)| {
                        json!({"steps": st.spec_steps, "drafted": st.drafted, "accepted": st.accepted, "generated": n,
                               "acceptance": st.acceptance(), "speed_up": speed_up(results, t),
                               "tokens_per_step": (st.accepted + st.spec_steps) as f64 / st.spec_steps.max(1) as f64})
                    });
                    json!({"test": t, "tokens_per_second": m, "stddev": s, "expert_cache": cache, "speculative": spec})
                })
                .collect();
            let out = json!({
                "model": model_name, "architecture": cfg.arch.gguf_name(), "file_bytes": file_size,
                "backend": engine.model.backend.name(), "threads": threads, "experts": engine.model.experts.kind(), "repetitions": args.repetitions,
                "tests": tests, "peak_rss_bytes": rss,
                "weight_bytes_per_token": per_token,
            });
            lines += &format!("{out}\n");
        }
        return crate::write_stdout(lines.as_bytes());
    }
    let mut s = String::new();
    s += "| model | arch | size | backend | threads | experts | test | t/s |\n";
    s += "| --- | --- | ---: | --- | ---: | --- | ---: | ---: |\n";
    for Measured { threads, results, .. } in runs {
        for (test, (mean, sd)) in results {
            s += &format!(
                "| {model_name} | {} | {:.2} MiB | {} | {threads} | {} | {test} | {mean:.2} ± {sd:.2} |\n",
                cfg.arch.gguf_name(),
                file_size as f64 / (1 << 20) as f64,
                engine.model.backend.name(),
                engine.model.experts.kind()
            );
        }
    }
    s += &format!("\npeak RSS {:.1} MiB\n", rss as f64 / (1 << 20) as f64);
    s += &format!("weights read per generated token: {:.1} MiB\n", per_token as f64 / (1 << 20) as f64);
    for Measured { threads, results, cache_lines, spec_lines } in runs {
        // With several thread counts each line names its count.
        let at = if runs.len() > 1 { format!("-t {threads}, ") } else { String::new() };
        for (test, st, n) in cache_lines {
            s += &format!("{at}{test}: {}\n", crate::stats::summary(st, *n));
        }
        for (test, st, generated) in spec_lines {
            let speedup = speed_up(results, test).map_or(String::new(), |x| format!(", speed-up {x:.2}x"));
            s += &format!("{at}{test}: {}, {generated} tokens{speedup}\n", crate::generate::spec_summary(st));
        }
    }
    crate::write_stdout(s.as_bytes())
}

/// Test `test`'s speed (a `...+spec` generation) over the same greedy generations without
/// guesses, from `results` (test, (mean tok/s, deviation)).
fn speed_up(results: &[(String, (f64, f64))], test: &str) -> Option<f64> {
    let speed = |name: &str| results.iter().find(|r| r.0 == name).map(|r| r.1.0);
    let plain = speed(test.strip_suffix("+spec")?)?;
    (plain > 0.0).then(|| speed(test)).flatten().map(|s| s / plain)
}
