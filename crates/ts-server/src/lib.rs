//! An OpenAI-compatible HTTP server over one model: `POST /v1/chat/completions`,
//! `POST /v1/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`, and a chat
//! page at `GET /`.
//!
//! Handlers (tokio, axum) validate requests, render and tokenize prompts, and
//! queue jobs; one scheduler thread owns the model's sequences and decodes up
//! to `parallel` of them together in each forward step.

pub mod api;
pub mod metrics;
pub mod request;
pub mod scheduler;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use metrics::Metrics;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use ts_engine::session::Engine;
use ts_model::Backend;

#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The name `/v1/models` lists and requests must use (if they name one).
    pub model_id: String,
    /// Sequences decoded together at most; more requests wait in a queue.
    pub parallel: usize,
    /// Context of each sequence, prompt and reply together.
    pub slot_ctx: usize,
    /// Largest request body accepted, bytes.
    pub max_body: usize,
    /// Reuse a free slot's cached prompt prefix (see `scheduler::run`).
    pub prompt_cache: bool,
    /// Speculative decoding for every request: guesses (prompt lookup, or the draft model
    /// given to [`spawn_with_draft`]) checked in the step that runs the sequence's next
    /// token. A request may change the lengths (`speculative.n_max`, `speculative.n_min`, as
    /// llama-server names them).
    pub spec: Option<ts_engine::speculative::SpecOptions>,
    /// The draft model's `--draft-p-min`.
    pub draft_p_min: f32,
    /// `--spec-mtp`: each slot's guesses come from the model's own MTP head (with `spec`).
    pub spec_mtp: bool,
}

/// What every handler shares.
pub struct AppState<B: Backend> {
    pub engine: Arc<Engine<B>>,
    pub opts: ServeOptions,
    pub metrics: Arc<Metrics>,
    jobs: Mutex<std::sync::mpsc::Sender<scheduler::Job>>,
    next_id: AtomicU64,
    started: u64,
}

/// A server that is listening.
pub struct Running {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Running {
    /// Blocks until the server stops (an error, or [`Running::stop`] from elsewhere).
    pub fn wait(mut self) -> Result<(), String> {
        self.thread.take().map_or(Ok(()), |t| t.join().unwrap_or_else(|_| Err("the server thread panicked".into())))
    }

    /// Stops accepting, lets requests in flight end, and waits.
    pub fn stop(mut self) -> Result<(), String> {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        self.wait()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
    }
}

/// The routes over `state`.
pub fn router<B: Backend + 'static>(state: Arc<AppState<B>>) -> Router {
    let limit = state.opts.max_body;
    Router::new()
        .route("/", get(api::page))
        .route("/v1/chat/completions", post(api::chat::<B>))
        .route("/v1/completions", post(api::completions::<B>))
        .route("/v1/models", get(api::models::<B>))
        .route("/tokenize", post(api::tokenize::<B>))
        .route("/detokenize", post(api::detokenize::<B>))
        .route("/health", get(api::health))
        .route("/metrics", get(api::metrics::<B>))
        .fallback(api::not_found)
        .method_not_allowed_fallback(api::method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Binds `addr` (port 0 picks a free one) and serves `engine` on threads of its own.
pub fn spawn<B: Backend + 'static>(engine: Engine<B>, opts: ServeOptions, addr: SocketAddr) -> Result<Running, String> {
    spawn_with_draft(engine, None, opts, addr)
}

/// [`spawn`], with `draft` guessing for the requests when `opts.spec` is given (else prompt
/// lookup guesses); its vocabulary must be `engine`'s.
pub fn spawn_with_draft<B: Backend + 'static>(
    engine: Engine<B>,
    draft: Option<Engine<B>>,
    opts: ServeOptions,
    addr: SocketAddr,
) -> Result<Running, String> {
    if opts.parallel == 0 {
        return Err("--parallel must be at least 1".into());
    }
    let engine = Arc::new(engine);
    let metrics = Arc::new(Metrics::default());
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let (engine, metrics) = (engine.clone(), metrics.clone());
        let (slots, ctx, cache, p_min) = (opts.parallel, opts.slot_ctx, opts.prompt_cache, opts.draft_p_min);
        let mtp = opts.spec_mtp && opts.spec.is_some();
        if mtp {
            ts_engine::speculative::check_mtp(&engine).map_err(|e| e.to_string())?;
        }
        // The draft model checked before the server listens.
        if let Some(d) = &draft {
            let target = engine.tokenizer().map_err(|e| e.to_string())?;
            ts_engine::speculative::check_draft(d, target).map_err(|e| e.to_string())?;
        }
        std::thread::Builder::new()
            .name("scheduler".into())
            .spawn(move || {
                let drafter = draft.as_ref().map(|d| (d, p_min));
                scheduler::run(&engine, drafter, mtp, rx, slots, ctx, cache, metrics)
            })
            .map_err(|e| format!("starting the scheduler: {e}"))?;
    }
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let state = Arc::new(AppState { engine, opts, metrics, jobs: Mutex::new(tx), next_id: AtomicU64::new(0), started });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the async runtime: {e}"))?;
    let listener =
        runtime.block_on(tokio::net::TcpListener::bind(addr)).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let app = router(state);
    let thread = std::thread::Builder::new()
        .name("http".into())
        .spawn(move || {
            runtime.block_on(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stop_rx.await;
                    })
                    .await
                    .map_err(|e| format!("server: {e}"))
            })
        })
        .map_err(|e| format!("starting the HTTP thread: {e}"))?;
    Ok(Running { addr, shutdown: Some(stop_tx), thread: Some(thread) })
}
