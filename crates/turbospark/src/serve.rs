//! `serve`: the OpenAI-compatible HTTP server.

use crate::GlobalOptions;
use crate::generate::{ModelArgs, SpecArgs, load};
use anyhow::{Result, bail};

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", env = "TURBOSPARK_HOST")]
    host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080, env = "TURBOSPARK_PORT")]
    port: u16,
    /// Requests decoded together at most; more wait in a queue. `-c` is split
    /// between them, as llama-server does.
    #[arg(long, default_value_t = 4, env = "TURBOSPARK_PARALLEL")]
    parallel: usize,
    /// Name the model is served under (default: the file name without `.gguf`).
    #[arg(long)]
    alias: Option<String>,
    /// Largest request body accepted, e.g. `1MiB`.
    #[arg(long, default_value = "1MiB")]
    max_body: String,
    /// Reuse the cached start of a previous prompt (a chat's earlier turns, a shared system
    /// prompt) instead of reading it again. Off by default: with 8-bit activations the reused
    /// positions' values depend on how they were batched, so a seed's sample can change.
    #[arg(long)]
    prompt_cache: bool,
    /// Speculative decoding for every request (`--spec-ngram` or `--draft-model`, with
    /// `--draft-max`, `--draft-min`, `--draft-p-min`); a request may set its own lengths
    /// (`speculative.n_max`, `speculative.n_min`).
    #[command(flatten)]
    spec: SpecArgs,
}

pub fn run(global: &GlobalOptions, args: &ServeArgs) -> Result<()> {
    tracing_subscriber::fmt().with_target(false).with_writer(std::io::stderr).init();
    if args.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    let Some(max_body) = ts_engine::memory::parse_size(&args.max_body) else {
        bail!("--max-body {}: expected a size such as 1MiB", args.max_body)
    };
    let spec = args.spec.options()?;
    let path = global.model(None)?;
    let model_id = args.alias.clone().unwrap_or_else(|| {
        path.file_name().map(|f| f.to_string_lossy().trim_end_matches(".gguf").to_string()).unwrap_or_default()
    });
    let (engine, n_ctx, cuda) = load(global, &args.model, args.spec.mtp())?;
    let draft = args.spec.load_draft(&args.model, &engine)?;
    // -c is the total, split between the slots; without it each slot gets the model's default.
    let slot_ctx = if args.model.ctx_given() { n_ctx / args.parallel } else { n_ctx };
    if slot_ctx < 16 {
        bail!("-c {n_ctx} split between {} slots leaves {slot_ctx} tokens each; raise -c", args.parallel);
    }
    let addr: std::net::SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .map_err(|e| anyhow::anyhow!("--host {} --port {}: {e}", args.host, args.port))?;
    let opts = ts_server::ServeOptions {
        model_id,
        parallel: args.parallel,
        slot_ctx,
        max_body: max_body as usize,
        prompt_cache: args.prompt_cache,
        spec,
        draft_p_min: args.spec.p_min(),
        spec_mtp: args.spec.spec_mtp,
    };
    crate::on_device!(global, engine, draft, cuda, |engine, draft| {
        let running = ts_server::spawn_with_draft(engine, draft, opts.clone(), addr).map_err(anyhow::Error::msg)?;
        eprintln!(
            "serving {} on http://{} ({} slots x {} tokens of context)",
            opts.model_id, running.addr, opts.parallel, opts.slot_ctx
        );
        running.wait().map_err(anyhow::Error::msg)
    })
}
