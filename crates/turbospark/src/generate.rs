//! `run`, `chat`, `logits` and `perplexity`: the commands that compute.

use crate::GlobalOptions;
use anyhow::{Context, Result, bail};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use ts_engine::chat::harmony::{Channel, HarmonyEvent, HarmonyParser};
use ts_engine::chat::{ChatMessage, ChatTemplate, TemplateKwargs};
use ts_engine::memory::{auto_placement, available_memory, expert_and_dense_bytes, parse_size};
use ts_engine::reuse::{CachedSequence, conversation_end};
use ts_engine::sampler::{SamplerConfig, random_seed};
use ts_engine::session::{Engine, GenerationStats, LoadOptions, peak_rss_bytes};
use ts_engine::speculative::{DEFAULT_P_MIN, Drafter, ModelDrafter, MtpDrafter, NgramDrafter, SpecOptions};
use ts_model::state::KvType;
use ts_model::{Backend, EvictionPolicy, ExpertPlacement, StreamOptions};

/// When to fetch ahead: the next layer's guessed experts (`--expert-prefetch`), or the weights a
/// one-token product reads next (`--decode-prefetch`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefetch {
    Auto,
    On,
    Off,
}

/// Where a decode step computes the experts missing from the GPU's `--expert-cache`
/// (`--expert-misses`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertMisses {
    /// Copy them into VRAM over PCIe (with the next layer's guesses copied ahead).
    Copy,
    /// Compute them on the CPU from the pinned host copy while the GPU computes the cached
    /// ones; about half of the next layer's guesses are still copied ahead.
    Cpu,
    /// `cpu` where experts are large (8 MiB and more, e.g. gpt-oss's) and the pinned copy
    /// exists, else `copy`.
    Auto,
}

/// The element type of the CPU's key or value cache (`-ctk`, `-ctv`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheType {
    F32,
    F16,
}

/// Options of every command that loads a model.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// Context size in tokens (default: the model's, capped at 4096).
    #[arg(short = 'c', long = "ctx-size")]
    ctx: Option<usize>,
    /// Rows per forward step during prompt processing.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    batch: usize,
    /// Where routed experts live: `auto` (resident when the model fits in memory, else
    /// streamed), `resident` (read into memory at open), `mapped` (pages of the file; the OS
    /// decides), `stream` (read from disk into a cache of --expert-cache bytes).
    #[arg(long, default_value = "auto", env = "TURBOSPARK_EXPERTS")]
    experts: String,
    /// Size of the expert cache for streamed experts, e.g. `6GiB` (default: what memory allows).
    #[arg(long, env = "TURBOSPARK_EXPERT_CACHE")]
    expert_cache: Option<String>,
    /// Eviction policy of the expert cache: `decay` (frequency with decay), `lru` or `lfu`.
    #[arg(long, default_value = "decay")]
    expert_policy: String,
    /// Threads reading streamed experts (8 measured best on this project's disks: docs/BENCHMARKS.md).
    #[arg(long, default_value_t = 8)]
    expert_readers: usize,
    /// Read streamed experts through the page cache instead of with O_DIRECT.
    #[arg(long)]
    no_direct_io: bool,
    /// Guess the next MoE layer's experts from this layer's input and fetch them early: `on`,
    /// `off`, or `auto`: on wherever experts come through a cache (the GPU's --expert-cache, or
    /// streamed from disk: their reads then overlap compute), else off
    #[arg(long, value_name = "WHEN", value_enum, num_args = 0..=1, default_value = "auto", default_missing_value = "on")]
    expert_prefetch: Prefetch,
    /// Where a decode step computes experts missing from the GPU's --expert-cache: `copy` them
    /// into VRAM, compute them on the `cpu` (threads: -t) beside the GPU, or `auto`: on the
    /// CPU where experts are large (8 MiB and more) and host RAM holds a pinned copy of them
    #[arg(long, value_name = "WHERE", value_enum, default_value = "auto")]
    expert_misses: ExpertMisses,
    /// Element type of the CPU's key cache, `f16` or `f32` (default: f16, as llama.cpp's; f32
    /// with --exact-activations). Keys and values take one type. Also `-ctk`.
    #[arg(long = "cache-type-k", visible_alias = "ctk", value_name = "TYPE", value_enum)]
    cache_type_k: Option<CacheType>,
    /// Element type of the CPU's value cache (as --cache-type-k). Also `-ctv`.
    #[arg(long = "cache-type-v", visible_alias = "ctv", value_name = "TYPE", value_enum)]
    cache_type_v: Option<CacheType>,
    /// Keep activations in f32 for quantized weights instead of quantizing them to 8 bits
    /// (as llama.cpp does): slower, and equal to a float32 run on the dequantized weights.
    #[arg(long)]
    exact_activations: bool,
    /// Keep weights in their GGUF layout on the CPU, rather than repacked into the layout the
    /// CPU's kernels read directly (as llama.cpp's and ik_llama.cpp's repacking, which
    /// llama.cpp's `--no-repack` turns off): experts held in memory (at load, or streamed MXFP4,
    /// Q4_0, Q4_1, Q5_0 and Q8_0 ones as they are read; MXFP4, Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q8_0
    /// on AVX-512 VNNI, MXFP4 and Q4_K on AVX2), and dense Q4_0, Q4_1, Q5_0, Q8_0 and MXFP4
    /// matrices on AVX-512 VNNI, the layers' Q4_K and Q6_K ones too (copied into memory the
    /// process owns).
    #[arg(long)]
    no_repack: bool,
    /// Whether the CPU's one-token products over repacked weights ask for the weights ahead of
    /// their reads (software prefetch): `on`, `off`, or `auto`: on for Intel processors and
    /// CPUs without AVX-512, and on others for MXFP4 and the 32-element block formats only
    /// (their K-quant and Q8_0 passes measured faster without on an AMD Zen 4, 1.2-1.4x slower
    /// without on a Xeon)
    #[arg(long, value_name = "WHEN", value_enum, default_value = "auto", env = "TURBOSPARK_DECODE_PREFETCH")]
    decode_prefetch: Prefetch,
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
            logit_bias: Vec::new(),
            seed: self.seed.unwrap_or_else(random_seed),
        }
    }
}

/// Speculative decoding, with llama.cpp's flags: guesses checked by the model in one step.
#[derive(clap::Args, Clone, Debug)]
pub struct SpecArgs {
    /// A small model with the same vocabulary that guesses the next tokens (`--md` too).
    #[arg(long = "draft-model", visible_alias = "md", value_name = "PATH", conflicts_with = "spec_ngram")]
    draft_model: Option<PathBuf>,
    /// Guess by copying what followed the latest earlier occurrence of the last few tokens
    /// (prompt lookup): no second model.
    #[arg(long)]
    spec_ngram: bool,
    /// Guess with the model's own multi-token-prediction head (a GGUF `nextn` layer, as
    /// Qwen3.5/3.6 MoE files converted with it carry): no second model.
    #[arg(long, conflicts_with_all = ["spec_ngram", "draft_model"])]
    pub(crate) spec_mtp: bool,
    /// Most guesses per step [default: 16].
    #[arg(long, value_name = "N")]
    draft_max: Option<usize>,
    /// Fewer guesses than this are not checked [default: 0].
    #[arg(long, value_name = "N")]
    draft_min: Option<usize>,
    /// The draft model stops guessing at a token it gives less than this probability [default: 0.75].
    #[arg(long, value_name = "P")]
    draft_p_min: Option<f32>,
    /// Guess up to --draft-max every step, as llama.cpp does, even where guesses do not pay
    /// (by default the number follows what guesses cost and how many are kept, none where
    /// they cannot pay).
    #[arg(long)]
    draft_fixed: bool,
}

impl SpecArgs {
    /// The guessing options, or None without a drafter (its options then refused by name).
    pub fn options(&self) -> Result<Option<SpecOptions>> {
        let d = SpecOptions::default();
        let opts = SpecOptions {
            draft_max: self.draft_max.unwrap_or(d.draft_max),
            draft_min: self.draft_min.unwrap_or(d.draft_min),
            adapt: !self.draft_fixed,
        };
        if self.draft_model.is_none() && !self.spec_ngram && !self.spec_mtp {
            for (set, flag) in [
                (self.draft_max.is_some(), "--draft-max"),
                (self.draft_min.is_some(), "--draft-min"),
                (self.draft_p_min.is_some(), "--draft-p-min"),
                (self.draft_fixed, "--draft-fixed"),
            ] {
                if set {
                    bail!("{flag} needs a drafter: --draft-model PATH, --spec-ngram or --spec-mtp");
                }
            }
            return Ok(None);
        }
        if self.spec_ngram && self.draft_p_min.is_some() {
            bail!("--draft-p-min applies to a --draft-model, not to --spec-ngram");
        }
        if self.spec_mtp && self.draft_p_min.is_some() {
            bail!("--draft-p-min applies to a --draft-model, not to --spec-mtp (the MTP head guesses greedily)");
        }
        if !(0.0..=1.0).contains(&self.p_min()) {
            bail!("--draft-p-min must be between 0 and 1");
        }
        Ok(Some(opts))
    }

    /// The draft model's `--draft-p-min`.
    pub(crate) fn p_min(&self) -> f32 {
        self.draft_p_min.unwrap_or(DEFAULT_P_MIN)
    }

    /// What [`load`] keeps of the model's MTP head: all of it with `--spec-mtp` (refused by
    /// name where the model has no nextn layer), else nothing.
    pub fn mtp(&self) -> MtpHead {
        if self.spec_mtp { MtpHead::Keep } else { MtpHead::Drop }
    }

    /// The draft model, loaded for the CPU on `target`'s threads (every weight resident).
    pub fn load_draft(&self, args: &ModelArgs, target: &Engine) -> Result<Option<Engine>> {
        let Some(path) = &self.draft_model else { return Ok(None) };
        let mut draft = Engine::load_beside(path, ExpertPlacement::Mapped, target).context("--draft-model")?;
        draft.n_batch = args.batch;
        draft.exact_activations = args.exact_activations;
        draft.model.kv_type = args.kv_type()?;
        Ok(Some(draft))
    }
}

/// The drafter `spec` asks for: the draft model `draft` (checked against `engine`'s
/// vocabulary), prompt lookup, or none, for `seq`'s context. First the generation's steps are
/// recorded at the start of the empty `seq` where the backend records steps
/// ([`Engine::warm_up_steps`]: the one-row step, and with a drafter the checking steps; load
/// time, not a generation's; not for an MTP head, whose steps are never recorded). A failed
/// warm-up only costs the steps' first runs: a warning.
pub(crate) fn drafter<'d, B: Backend>(
    spec: &SpecArgs,
    engine: &'d Engine<B>,
    draft: Option<&'d Engine<B>>,
    seq: &mut ts_model::SeqState<B::State>,
) -> Result<Option<Box<dyn Drafter + 'd>>> {
    let n_ctx = seq.n_ctx;
    let drafter: Option<Box<dyn Drafter + 'd>> = match draft {
        Some(d) => Some(Box::new(ModelDrafter::new(d, engine.tokenizer()?, n_ctx, spec.p_min())?)),
        None if spec.spec_ngram => Some(Box::new(NgramDrafter::default())),
        None if spec.spec_mtp => Some(Box::new(MtpDrafter::new(engine, n_ctx)?)),
        None => None,
    };
    let max_guesses = match (&drafter, spec.options()?) {
        (Some(_), Some(opts)) => opts.draft_max,
        _ => 0,
    };
    if !drafter.as_ref().is_some_and(|d| d.wants_hidden())
        && let Err(e) = engine.warm_up_steps(seq, max_guesses)
    {
        eprintln!("warning: recording the decode steps ahead failed ({e}); their first runs are slower");
    }
    Ok(drafter)
}

/// Speculation's line on stderr: guesses kept and tokens per checking step.
fn report_spec(stats: &GenerationStats) {
    if let (0, Some((floor, plain))) = (stats.spec_steps, stats.guessing_off) {
        eprintln!(
            "speculative: off: a guess costs at least {:.2} ms (the draft's step and a checked row), a plain step {:.2} ms",
            floor * 1e3,
            plain * 1e3
        );
    } else if stats.spec_steps > 0 || stats.drafted > 0 {
        eprintln!("speculative: {}", spec_summary(stats));
    }
}

/// Guesses kept, checking steps and tokens per checking step.
pub(crate) fn spec_summary(stats: &GenerationStats) -> String {
    format!(
        "{} of {} guesses kept ({:.1}%), {} checking steps, {:.2} tokens per checking step, {:.2} ms a check guessing and {:.2} checking, {} warm-up steps",
        stats.accepted,
        stats.drafted,
        100.0 * stats.acceptance(),
        stats.spec_steps,
        (stats.accepted + stats.spec_steps) as f64 / stats.spec_steps.max(1) as f64,
        1e3 * stats.draft_time.as_secs_f64() / stats.spec_steps.max(1) as f64,
        1e3 * stats.check_time.as_secs_f64() / stats.spec_steps.max(1) as f64,
        stats.warm_ups,
    )
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
    /// Print the expert cache's counters per layer at the end.
    #[arg(long)]
    stats: bool,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    spec: SpecArgs,
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
    #[command(flatten)]
    spec: SpecArgs,
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

/// The eviction policy `--expert-policy` names.
fn policy(name: &str) -> Result<EvictionPolicy> {
    Ok(match name {
        "decay" => EvictionPolicy::DecayedFrequency { half_life: 256.0 },
        "lru" => EvictionPolicy::Lru,
        "lfu" => EvictionPolicy::Lfu,
        other => bail!("--expert-policy {other}: expected `decay`, `lru` or `lfu`"),
    })
}

/// Where routed experts go, from the flags (and, for `auto`, from the memory available).
fn placement(args: &ModelArgs, model: &std::path::Path, n_ctx: Option<usize>) -> Result<ExpertPlacement> {
    let policy = policy(&args.expert_policy)?;
    if args.expert_readers == 0 {
        bail!("--expert-readers must be at least 1");
    }
    let cache = match &args.expert_cache {
        None => None,
        Some(s) => {
            Some(parse_size(s).with_context(|| format!("--expert-cache {s}: expected a size such as 6GiB or 512MiB"))?)
        }
    };
    let base = StreamOptions {
        cache_bytes: cache.unwrap_or(0),
        policy,
        readers: args.expert_readers,
        direct_io: !args.no_direct_io,
    };
    let stream_only = |flag: &str| -> Result<()> {
        bail!("{flag} applies to streamed experts only (--experts stream or auto), not --experts {}", args.experts)
    };
    match args.experts.as_str() {
        "mapped" | "resident" if cache.is_some() => stream_only("--expert-cache")?,
        "mapped" | "resident" if args.expert_policy != "decay" => stream_only("--expert-policy")?,
        "mapped" | "resident" if args.no_direct_io => stream_only("--no-direct-io")?,
        "mapped" => return Ok(ExpertPlacement::Mapped),
        "resident" => return Ok(ExpertPlacement::Resident),
        "stream" | "auto" => {}
        other => bail!("--experts {other}: expected `auto`, `resident`, `mapped` or `stream`"),
    }
    let (experts, dense) = expert_and_dense_bytes(model)?;
    if let Some(bytes) = cache {
        return Ok(ExpertPlacement::Stream(StreamOptions { cache_bytes: bytes, ..base }));
    }
    let available = available_memory().context("cannot tell how much memory is available; pass --expert-cache")?;
    let kv = kv_bytes_estimate(model, n_ctx, args.kv_type()?)?;
    let (choice, why) = auto_placement(experts, dense, kv, available, &base);
    let choice = match (args.experts.as_str(), choice) {
        ("stream", ExpertPlacement::Resident) => {
            // Asked to stream though everything fits: a cache that holds every expert.
            ExpertPlacement::Stream(StreamOptions { cache_bytes: experts + experts / 16, ..base })
        }
        (_, c) => {
            if experts > 0 {
                eprintln!("{why}");
            }
            c
        }
    };
    Ok(choice)
}

/// The KV cache a context of `n_ctx` (or the default) takes, for sizing the expert cache.
fn kv_bytes_estimate(model: &std::path::Path, n_ctx: Option<usize>, kv: KvType) -> Result<u64> {
    let file = ts_gguf::GgufFile::open(model)?;
    let n_vocab = file.tensor("token_embd.weight")?.dims.get(1).copied().unwrap_or(0) as usize;
    let cfg = ts_model::ArchConfig::from_metadata(file.metadata(), n_vocab)?;
    let n_ctx = n_ctx.unwrap_or(if cfg.n_ctx_train == 0 { 4096 } else { cfg.n_ctx_train.min(4096) });
    Ok(ts_model::SeqState::bytes_for(&cfg, n_ctx, 512, kv) as u64)
}

impl ModelArgs {
    /// The CPU's cache type from `-ctk`/`-ctv`: f16 unless `--exact-activations` (f32); keys
    /// and values of two types are refused (one cache type a model here).
    pub fn kv_type(&self) -> Result<KvType> {
        let chosen = match (self.cache_type_k, self.cache_type_v) {
            (Some(k), Some(v)) if k != v => {
                bail!("--cache-type-k {k:?} with --cache-type-v {v:?}: keys and values take one type here")
            }
            (k, v) => k.or(v),
        };
        Ok(match chosen {
            Some(CacheType::F32) => KvType::F32,
            Some(CacheType::F16) => KvType::F16,
            None if self.exact_activations => KvType::F32,
            None => KvType::F16,
        })
    }

    /// Whether `-c` was given.
    pub fn ctx_given(&self) -> bool {
        self.ctx.is_some()
    }
}

/// GPU placement from the flags: `--expert-cache` is the VRAM for experts, over a
/// pinned copy of every expert in host RAM when that fits in available memory,
/// else over the mapped file (the OS reads it from disk).
fn cuda_options(args: &ModelArgs, model: &std::path::Path) -> Result<ts_cuda::CudaOptions> {
    let mut opts = ts_cuda::CudaOptions { policy: policy(&args.expert_policy)?, ..Default::default() };
    if let Some(size) = &args.expert_cache {
        let bytes = parse_size(size).with_context(|| format!("--expert-cache {size}"))?;
        let (experts, dense) = expert_and_dense_bytes(model)?;
        opts.expert_cache = Some(bytes);
        opts.pinned_host = available_memory().is_some_and(|a| experts + dense < a);
        // Without the pinned copy the expert tier refuses `cpu` by name.
        opts.misses = match args.expert_misses {
            ExpertMisses::Cpu => ts_cuda::tier::MissPath::Cpu { share: None },
            ExpertMisses::Copy => ts_cuda::tier::MissPath::Copy,
            ExpertMisses::Auto => ts_cuda::tier::MissPath::Auto,
        };
        // A measurement knob until a lease compares the two layouts (docs/BENCHMARKS.md).
        opts.packed_host = std::env::var("TURBOSPARK_TIER_PACKED_HOST").is_ok_and(|v| v.trim() != "0");
        eprintln!(
            "experts: {:.1} GiB of VRAM cache over {}",
            bytes as f64 / (1u64 << 30) as f64,
            if opts.pinned_host {
                "a pinned copy in host RAM"
            } else {
                "the CPU's expert store (host RAM is short: streamed from disk into a RAM cache)"
            }
        );
    } else if args.expert_misses != ExpertMisses::Auto {
        bail!("--expert-misses applies to a GPU --expert-cache");
    }
    Ok(opts)
}

/// Whether [`load`] keeps the model's multi-token-prediction head (`--spec-mtp`) or leaves it
/// out before anything is packed or placed, so that no backend holds it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum MtpHead {
    Keep,
    Drop,
}

/// The engine on the CPU, its context size, and how to place it on a GPU if `--device` asks.
pub fn load(global: &GlobalOptions, args: &ModelArgs, mtp: MtpHead) -> Result<(Engine, usize, ts_cuda::CudaOptions)> {
    let model = global.model(None)?;
    if args.batch == 0 {
        bail!("--batch-size must be at least 1");
    }
    let cuda = match global.device()? {
        crate::Device::Cuda(_) if args.cache_type_k.is_some() || args.cache_type_v.is_some() => {
            bail!("--cache-type-k/--cache-type-v set the CPU's cache; the GPU keeps keys and values in its own")
        }
        crate::Device::Cuda(_) => cuda_options(args, &model)?,
        crate::Device::Cpu if args.expert_misses != ExpertMisses::Auto => {
            bail!("--expert-misses applies to a GPU --expert-cache, not --device cpu")
        }
        crate::Device::Cpu => ts_cuda::CudaOptions::default(),
    };
    let experts = match global.device()? {
        crate::Device::Cpu => placement(args, &model, args.ctx)?,
        crate::Device::Cuda(_) => {
            if cuda.expert_cache.is_some() && !cuda.pinned_host {
                // Host RAM is short: the VRAM cache sits over the CPU's own expert placement
                // (streamed from disk into a RAM cache, by default).
                placement(args, &model, args.ctx)?
            } else {
                // Weights go to the GPU; the host keeps the mapped file to upload (or copy experts) from.
                if args.experts != "auto" && args.experts != "mapped" {
                    bail!(
                        "--experts {} is not available with --device cuda here: experts live in VRAM, or in a \
                         VRAM cache of --expert-cache bytes over a pinned copy in host RAM",
                        args.experts
                    );
                }
                for (set, flag) in
                    [(args.no_direct_io, "--no-direct-io"), (args.expert_readers != 8, "--expert-readers")]
                {
                    if set {
                        bail!("{flag} applies to experts streamed by the CPU, not to --device cuda here");
                    }
                }
                ExpertPlacement::Mapped
            }
        }
    };
    let opts = LoadOptions { threads: global.threads()?, experts };
    let mut engine = Engine::load(&model, &opts).with_context(|| format!("loading {}", model.display()))?;
    engine.n_batch = args.batch;
    engine.exact_activations = args.exact_activations;
    engine.model.kv_type = args.kv_type()?;
    match mtp {
        MtpHead::Keep => ts_engine::speculative::check_mtp(&engine)?,
        MtpHead::Drop => engine.model.weights.mtp = None,
    }
    if args.decode_prefetch != Prefetch::Auto && (args.no_repack || args.exact_activations) {
        let why = if args.no_repack { "--no-repack" } else { "--exact-activations" };
        bail!("--decode-prefetch applies to repacked weights, which {why} leaves out");
    }
    ts_cpu::set_decode_prefetch(match args.decode_prefetch {
        Prefetch::Auto => None,
        Prefetch::On => Some(true),
        Prefetch::Off => Some(false),
    });
    if global.device()? == crate::Device::Cpu && !args.exact_activations && !args.no_repack {
        let n_experts = engine.model.pack_experts();
        if n_experts > 0 {
            let when = if engine.model.experts.kind() == "stream" { " as they are read" } else { "" };
            eprintln!(
                "experts: {n_experts} matrices repacked for the CPU's kernels{when} (--no-repack keeps the GGUF layout)"
            );
        }
        // Within the memory the process may still take: the copies replace mapped pages.
        let budget = available_memory().map_or(u64::MAX, |a| a.saturating_sub(ts_engine::memory::OVERHEAD_BYTES));
        let (n, left) = engine.model.pack_dense(budget)?;
        if n > 0 {
            eprintln!("dense: {n} matrices repacked for the CPU's one-row kernels (--no-repack keeps the GGUF layout)");
        }
        if left > 0 {
            eprintln!("dense: {left} matrices left in the file's layout: not enough memory to copy them");
        }
        if n_experts + n > 0 {
            eprintln!("decode: {}", ts_cpu::decode_prefetch_text());
        }
    } else if args.no_repack && global.device()? != crate::Device::Cpu {
        bail!("--no-repack applies to weights the CPU computes with, not to --device cuda");
    }
    // On the GPU the VRAM expert cache prefetches (from pinned RAM, or through the store).
    let gpu_cache = cuda.expert_cache.is_some();
    engine.model.prefetch_experts = match args.expert_prefetch {
        Prefetch::On if !gpu_cache && engine.model.experts.kind() != "stream" => bail!(
            "--expert-prefetch applies to streamed experts or a GPU --expert-cache, not --experts {}",
            engine.model.experts.kind()
        ),
        Prefetch::On => true,
        // Streamed, 2 threads (docs/BENCHMARKS.md): gpt-oss-120b in 12 GiB 1.74 -> 1.99 tok/s,
        // qwen3.5-35b-a3b in 6 GiB 4.22 -> 4.72.
        Prefetch::Auto => gpu_cache || engine.model.experts.kind() == "stream",
        Prefetch::Off => false,
    };
    let n_ctx = args.ctx.unwrap_or_else(|| engine.default_context());
    if n_ctx == 0 {
        bail!("--ctx-size must be at least 1");
    }
    Ok((engine, n_ctx, cuda))
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
    let spec = args.spec.options()?;
    let (engine, n_ctx, cuda) = load(global, &args.model, args.spec.mtp())?;
    let draft = args.spec.load_draft(&args.model, &engine)?;
    crate::on_device!(global, engine, draft, cuda, |engine, draft| run_on(
        &engine,
        draft.as_ref(),
        n_ctx,
        args,
        spec.as_ref(),
        prompt
    ))
}

fn run_on<B: Backend>(
    engine: &Engine<B>,
    draft: Option<&Engine<B>>,
    n_ctx: usize,
    args: &RunArgs,
    spec: Option<&SpecOptions>,
    prompt: String,
) -> Result<()> {
    let sampler = args.sampling.config();
    let tokens = engine.tokenizer()?.encode(&prompt, true, true)?;
    let mut seq = engine.new_sequence(n_ctx)?;
    let mut drafter = drafter(&args.spec, engine, draft, &mut seq)?;
    let mut out = std::io::stdout().lock();
    let mut closed = false;
    let guessing = drafter.as_deref_mut().zip(spec);
    let (_, stats) = engine.generate(&mut seq, &tokens, args.n_predict, &sampler, false, guessing, |text| {
        closed = out.write_all(text.as_bytes()).and_then(|()| out.flush()).is_err();
        !closed
    })?;
    drop(out);
    report(&stats);
    report_spec(&stats);
    eprintln!("seed {}", sampler.seed);
    if args.stats {
        match engine.model.backend.expert_stats().or_else(|| engine.model.experts.stats()) {
            Some(s) => eprint!("{}", crate::stats::table(&s, stats.prompt_tokens + stats.generated_tokens)),
            None => {
                eprintln!("experts {}: no cache counters (they count only when streamed)", engine.model.experts.kind())
            }
        }
    }
    Ok(())
}

pub fn chat(global: &GlobalOptions, args: &ChatArgs) -> Result<()> {
    let spec = args.spec.options()?;
    let (engine, n_ctx, cuda) = load(global, &args.model, args.spec.mtp())?;
    let draft = args.spec.load_draft(&args.model, &engine)?;
    crate::on_device!(global, engine, draft, cuda, |engine, draft| chat_on(
        &engine,
        draft.as_ref(),
        n_ctx,
        args,
        spec.as_ref()
    ))
}

fn chat_on<B: Backend>(
    engine: &Engine<B>,
    draft: Option<&Engine<B>>,
    n_ctx: usize,
    args: &ChatArgs,
    spec: Option<&SpecOptions>,
) -> Result<()> {
    // Each turn reads only what is new: the conversation so far stays in the
    // sequence (a recurrent model goes back to where the last prompt ended).
    let mut cached = CachedSequence::new(engine.new_sequence(n_ctx)?);
    let mut drafter = drafter(&args.spec, engine, draft, &mut cached.seq)?;
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
        messages.push(ChatMessage::system(s.clone()));
    }
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
        messages.push(ChatMessage::user(line));
        let rendered = template.render(&messages, true)?;
        // The template emits BOS itself where the model wants one.
        let tokens = engine.tokenizer()?.encode(&rendered, false, true)?;
        let t0 = std::time::Instant::now();
        let common = cached.prepare(&engine.model, &tokens)?;
        // Read up to where the conversation ends (remembered for the next turn), then the rest.
        let tokenizer = engine.tokenizer()?;
        let split =
            conversation_end(template, &messages, &TemplateKwargs::new(), tokenizer, &tokens).filter(|&at| at > common);
        // An MTP head reads the target's hidden states of every position the prompt adds.
        if let Some(at) = split {
            let observer = drafter.as_deref_mut().map(|d| d as &mut dyn Drafter);
            engine.prefill_observed(&mut cached.seq, &tokens[common..at], false, observer)?;
            cached.ran(&tokens[common..at]);
            cached.remember(&engine.model)?;
        }
        let from = split.unwrap_or(common);
        let observer = drafter.as_deref_mut().map(|d| d as &mut dyn Drafter);
        let logits = engine
            .prefill_observed(&mut cached.seq, &tokens[from..], false, observer)?
            .pop()
            .expect("one prompt token is run");
        let prompt_time = t0.elapsed();
        cached.ran(&tokens[from..]);
        cached.remember(&engine.model)?;
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
        let guessing = drafter.as_deref_mut().zip(spec);
        let (generated, mut stats) =
            engine.decode(&mut cached.seq, logits, &tokens, args.n_predict, &sampler, harmony, guessing, |t| {
                emit(t, &mut out);
                true
            })?;
        stats.prompt_tokens = tokens.len() - common;
        stats.prompt_time += prompt_time;
        writeln!(out)?;
        drop(out);
        // The last generated token was sampled, not run: the sequence holds the ones before it.
        let ran = generated.len().min(cached.seq.n_past - cached.history.len());
        cached.ran(&generated[..ran]);
        if interactive {
            report(&stats);
            report_spec(&stats);
        }
        messages.push(ChatMessage::assistant(reply));
    }
}

pub fn logits(global: &GlobalOptions, args: &LogitsArgs) -> Result<()> {
    let (engine, n_ctx, cuda) = load(global, &args.model, MtpHead::Drop)?;
    crate::on_device!(global, engine, cuda, |engine| logits_on(&engine, n_ctx, args))
}

fn logits_on<B: Backend>(engine: &Engine<B>, n_ctx: usize, args: &LogitsArgs) -> Result<()> {
    let n_vocab = engine.model.cfg.n_vocab;
    if let Some(&bad) = args.tokens.iter().find(|&&t| t as usize >= n_vocab) {
        bail!("token id {bad} is out of range (vocabulary size {n_vocab})");
    }
    let mut seq = engine.new_sequence(n_ctx.max(args.tokens.len()))?;
    let rows = engine.prefill(&mut seq, &args.tokens, args.all)?;
    let json = serde_json::json!({ "tokens": args.tokens, "logits": rows });
    crate::write_stdout(format!("{json}\n").as_bytes())
}

pub fn perplexity(global: &GlobalOptions, args: &PerplexityArgs) -> Result<()> {
    let (engine, n_ctx, cuda) = load(global, &args.model, MtpHead::Drop)?;
    crate::on_device!(global, engine, cuda, |engine| perplexity_on(&engine, n_ctx, args))
}

fn perplexity_on<B: Backend>(engine: &Engine<B>, n_ctx: usize, args: &PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let ppl = engine.perplexity(&text, n_ctx, |chunk, ppl| eprint!("[{chunk}]{ppl:.4},"))?;
    eprintln!();
    println!("chunks {} (n_ctx {n_ctx}), {} tokens scored, +/- {:.5}", ppl.chunks, ppl.scored, ppl.ppl_error);
    println!("PPL = {:.4}", ppl.ppl);
    Ok(())
}
