//! `turbospark`: the command-line program.

mod bench;
mod generate;
mod inspect;
mod serve;
mod stats;
mod synth;
mod tokenize;

use anyhow::{Context, Result, bail};
use clap::error::ErrorKind;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "turbospark", version, about = "Mixture-of-Experts LLM inference from GGUF files")]
struct Cli {
    #[command(flatten)]
    global: GlobalOptions,
    #[command(subcommand)]
    command: Command,
}

/// Options every command shares.
#[derive(clap::Args, Clone)]
struct GlobalOptions {
    /// Path to a GGUF model file.
    #[arg(short = 'm', long = "model", global = true, env = "TURBOSPARK_MODEL")]
    model: Option<PathBuf>,
    /// Worker threads (default: one per physical core this process may use, as llama.cpp);
    /// `bench` also takes a list, e.g. `1,4,8,16`, as llama-bench does.
    #[arg(short = 't', long = "threads", global = true, env = "TURBOSPARK_THREADS", value_delimiter = ',')]
    threads: Vec<usize>,
    /// Compute device: `cpu` or `cuda[:N]`.
    #[arg(long = "device", global = true, default_value = "cpu", env = "TURBOSPARK_DEVICE")]
    device: String,
}

#[derive(Subcommand)]
enum Command {
    /// Describe a GGUF file: architecture, hyperparameters, tokenizer, tensors.
    Inspect {
        /// The GGUF file (or give it with -m).
        file: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Print every metadata key, including long arrays in summary.
        #[arg(long)]
        all_metadata: bool,
    },
    /// Tokenize text with the model's tokenizer; prints the ids as a JSON array.
    Tokenize(tokenize::Args),
    /// Continue a prompt: text streams to stdout, speed and memory to stderr.
    Run(generate::RunArgs),
    /// Talk with the model, turn by turn, through its chat template.
    Chat(generate::ChatArgs),
    /// Logits of a token sequence as JSON: the last position's, or every position's with --all.
    Logits(generate::LogitsArgs),
    /// Perplexity of a text file, as llama-perplexity computes it.
    Perplexity(generate::PerplexityArgs),
    /// An OpenAI-compatible HTTP server (chat and text completions, batched decoding).
    Serve(serve::ServeArgs),
    /// Prompt-processing and generation speed, llama-bench style, with peak memory.
    Bench(bench::BenchArgs),
    /// Write a GGUF with a real model's shapes, types and metadata and random weights, for benchmarks.
    Synth(synth::SynthArgs),
}

/// Runs `$body` with `$engine` (an `Engine` loaded for the CPU) moved to the
/// device `--device` names: the body is compiled once per backend. The form with
/// `$draft` (an `Option<Engine>`) moves a draft model along with it.
#[macro_export]
macro_rules! on_device {
    ($global:expr, $loaded:expr, $draft:expr, $cuda:expr, |$engine:ident, $d:ident| $body:expr) => {{
        match $global.device()? {
            $crate::Device::Cpu => {
                let $engine = $loaded;
                let $d = $draft;
                $body
            }
            $crate::Device::Cuda(ordinal) => {
                let $engine = $loaded
                    .into_backend(|m| {
                        let cuda = ts_cuda::Cuda::with_options(ordinal, m, &$cuda)?;
                        eprintln!("cuda:{ordinal}: {}", cuda.describe());
                        Ok(cuda)
                    })
                    .map_err(|e| anyhow::anyhow!("--device cuda:{ordinal}: {e}"))?;
                let $d = match $draft {
                    Some(d) => Some(
                        d.into_backend(|m| ts_cuda::Cuda::new(ordinal, m))
                            .map_err(|e| anyhow::anyhow!("--draft-model on cuda:{ordinal}: {e}"))?,
                    ),
                    None => None,
                };
                $body
            }
        }
    }};
    ($global:expr, $loaded:expr, $cuda:expr, |$engine:ident| $body:expr) => {{ $crate::on_device!($global, $loaded, None::<ts_engine::session::Engine>, $cuda, |$engine, _draft| $body) }};
}

/// Where computation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl GlobalOptions {
    fn model(&self, positional: Option<PathBuf>) -> Result<PathBuf> {
        positional.or_else(|| self.model.clone()).context("no model given: pass a GGUF path (or -m MODEL)")
    }

    /// The device asked for, refused by name while this build has no such backend.
    fn device(&self) -> Result<Device> {
        let d = self.device.trim();
        let device = match d {
            "cpu" => Device::Cpu,
            "cuda" => Device::Cuda(0),
            _ => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Device::Cuda(n),
                _ => bail!("--device {d}: expected `cpu`, `cuda` or `cuda:N`"),
            },
        };
        Ok(device)
    }

    /// The thread count; a list is refused by name (only `bench` runs several).
    fn threads(&self) -> Result<usize> {
        match self.thread_counts()?[..] {
            [n] => Ok(n),
            _ => bail!("--threads {}: a list of thread counts is for `bench`; give one", self.threads_text()),
        }
    }

    /// Every thread count given (the default where none is), each at least 1.
    fn thread_counts(&self) -> Result<Vec<usize>> {
        if self.threads.contains(&0) {
            bail!("--threads {}: each count must be at least 1", self.threads_text());
        }
        Ok(if self.threads.is_empty() { vec![ts_cpu::topology::default_threads()] } else { self.threads.clone() })
    }

    fn threads_text(&self) -> String {
        self.threads.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
    }
}

fn run(cli: Cli) -> Result<()> {
    let global = &cli.global;
    global.device()?;
    if !matches!(cli.command, Command::Bench(_)) {
        global.threads()?;
    }
    match cli.command {
        Command::Inspect { file, json, all_metadata } => inspect::run(&global.model(file)?, json, all_metadata),
        Command::Tokenize(args) => tokenize::run(&global.model(None)?, &args),
        Command::Run(args) => generate::run(global, &args),
        Command::Chat(args) => generate::chat(global, &args),
        Command::Logits(args) => generate::logits(global, &args),
        Command::Perplexity(args) => generate::perplexity(global, &args),
        Command::Serve(args) => serve::run(global, &args),
        Command::Bench(args) => bench::run(global, &args),
        Command::Synth(args) => synth::run(global, &args),
    }
}

/// Has glibc keep freed blocks of up to 32 MiB in the heap instead of unmapping them, and trim
/// the heap's top only past 512 MiB free. Its adaptive defaults depend on what ran first: a
/// decode with no prompt before it had its step's buffers of a few hundred KiB mapped, faulted
/// in and zeroed again every step (the qwen3 8-layer cut on the CPU: 1.5-3.7 ms of an 18-21 ms
/// step outside the ops, 0.4-0.5 with these or after a prompt; docs/BENCHMARKS.md). Peak RSS
/// is unchanged: the blocks are reused, not added to.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: called first in main, before any other thread exists or allocates.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

/// llama.cpp's one-dash flags of several letters that clap cannot take as short ones, as
/// their long forms here (`-ctk f16` is `--ctk f16`).
fn llama_spelling(arg: std::ffi::OsString) -> std::ffi::OsString {
    match arg.to_str() {
        Some("-ctk") => "--ctk".into(),
        Some("-ctv") => "--ctv".into(),
        _ => arg,
    }
}

fn main() -> ExitCode {
    // CUDA loads every kernel when the module loads, not each at its first launch (its lazy
    // default): where lazily loaded code lands depends on which path ran first, and on the
    // H200 gpt-oss-20b decode after a prompt ran at 236 tok/s lazily, 271 eagerly (the same
    // kernels, the same time per kernel under Nsight Compute). A value the user set stays.
    if std::env::var_os("CUDA_MODULE_LOADING").is_none() {
        // SAFETY: the first thing the process does, before any other thread exists.
        unsafe { std::env::set_var("CUDA_MODULE_LOADING", "EAGER") };
    }
    keep_freed_memory();
    let cli = match Cli::try_parse_from(std::env::args_os().map(llama_spelling)) {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() && e.kind() != ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            eprintln!("error: {}", usage_error(&e.to_string()));
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error and its causes, outermost first.
            let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("error: {}", chain.join(": "));
            ExitCode::FAILURE
        }
    }
}

/// clap's report of bad arguments as one line: its lines up to the usage, joined ("tip:"
/// lines after a "; ", a list after its colon).
fn usage_error(report: &str) -> String {
    let mut line = String::new();
    for part in report.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if part.starts_with("Usage:") || part.starts_with("For more information") {
            break;
        }
        if !line.is_empty() {
            line += if line.ends_with(':') { " " } else { "; " };
        }
        line += part.strip_prefix("error: ").unwrap_or(part);
    }
    line
}

/// Writes to stdout; a closed pipe (`| head`) ends the output quietly instead of panicking.
fn write_stdout(bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}
