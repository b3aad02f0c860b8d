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
    /// Copy the tokenizer (every `tokenizer.*` key, chat template included) from this GGUF, so
    /// that the file can generate text (`bench` with a drafter, `run`): its tokens must fit
    /// the imitated model's vocabulary (Qwen2.5's GGUFs for the Qwen3 families, for example).
    #[arg(long = "tokenizer-from", value_name = "GGUF")]
    tokenizer_from: Option<PathBuf>,
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
        threads: (!global.threads.is_empty()).then(|| global.threads()).transpose()?,
    };
    let mut plan = ts_synth::Plan::new(&spec, &opts)?;
    if let Some(source) = &args.tokenizer_from {
        take_tokenizer(&mut plan, source)?;
    }
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

/// Replaces the plan's tokenizer-less vocabulary with `source`'s tokenizer.
fn take_tokenizer(plan: &mut ts_synth::Plan, source: &std::path::Path) -> Result<()> {
    let file = ts_gguf::GgufFile::open(source)?;
    let md = file.metadata();
    let n_tokens = md
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .map(|a| a.len())
        .ok_or_else(|| anyhow::anyhow!("{} has no tokenizer (no tokenizer.ggml.tokens)", source.display()))?;
    anyhow::ensure!(
        n_tokens <= plan.spec.n_vocab,
        "{} has {n_tokens} tokens; {} has a vocabulary of {}",
        source.display(),
        plan.spec.name,
        plan.spec.n_vocab
    );
    plan.metadata.retain(|(k, _)| !k.starts_with("tokenizer."));
    plan.metadata
        .extend(md.iter().filter(|(k, _)| k.starts_with("tokenizer.")).map(|(k, v)| (k.to_string(), v.clone())));
    Ok(())
}
