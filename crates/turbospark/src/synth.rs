//! `turbospark synth`: a GGUF with a real model's architecture, shapes, tensor types and
//! metadata, a tokenizer-less vocabulary of the right size, and random weights, for
//! benchmarking expert streaming on models of any size (docs/SYNTH.md).

use crate::GlobalOptions;
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct SynthArgs {
    /// Model to imitate: gpt-oss-20b, gpt-oss-120b, qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b,
    /// qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b, qwen3-next-80b-a3b.
    #[arg(long = "like", value_name = "NAME")]
    like: String,
    /// Type of the routed-expert tensors (default: the public GGUF's): q4_0, q4_k, q5_k, q6_k, q8_0, mxfp4.
    #[arg(long = "quant", value_name = "TYPE")]
    quant: Option<String>,
    /// Keep only the first N layers (same per-layer shapes).
    #[arg(long = "layers", value_name = "N")]
    layers: Option<usize>,
    /// Expert selection: `skewed` (a few popular experts, as trained models) or `uniform`.
    #[arg(long = "routing", default_value = "skewed")]
    routing: String,
    /// Seed of the random weights; the same seed gives the same file.
    #[arg(long = "seed", default_value_t = 0)]
    seed: u64,
    /// Print the planned size and exit without writing.
    #[arg(long = "dry-run")]
    dry_run: bool,
    /// The GGUF file to write.
    #[arg(short = 'o', long = "output", value_name = "FILE", required_unless_present = "dry_run")]
    output: Option<PathBuf>,
}

pub fn run(global: &GlobalOptions, args: &SynthArgs) -> Result<()> {
    let spec = ts_synth::spec(&args.like)?;
    let opts = ts_synth::SynthOptions {
        expert_type: args.quant.as_deref().map(ts_synth::parse_quant).transpose()?,
        layers: args.layers,
        routing: ts_synth::Routing::parse(&args.routing)?,
        seed: args.seed,
        threads: global.threads.map(|_| global.threads()).transpose()?,
    };
    let plan = ts_synth::Plan::new(&spec, &opts)?;
    let size = plan.file_size()?;
    let describe = format!(
        "{} like {}: {} layer{}, {} experts (top {}), {} tensors, {:.2} GiB",
        opts.routing.name(),
        spec.name,
        plan.n_layer,
        if plan.n_layer == 1 { "" } else { "s" },
        spec.n_expert,
        spec.n_expert_used,
        plan.tensors.len(),
        size as f64 / (1u64 << 30) as f64
    );
    let path = match (&args.output, args.dry_run) {
        (Some(path), false) => path,
        _ => return crate::write_stdout(format!("{describe} (not written)\n").as_bytes()),
    };
    let summary = plan.write(path, &mut ts_synth::TerminalProgress::new())?;
    crate::write_stdout(
        format!(
            "wrote {}: {describe} in {:.1} s ({:.0} MB/s)\n",
            path.display(),
            summary.seconds,
            summary.bytes as f64 / summary.seconds / 1e6
        )
        .as_bytes(),
    )
}
