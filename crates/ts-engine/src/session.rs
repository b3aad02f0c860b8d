//! An engine: a model with its tokenizer and chat template, a thread pool,
//! and the loops built on the forward pass: chunked prefill, generation,
//! logits and perplexity.

use crate::chat::ChatTemplate;
use crate::constraint::{ConstraintError, Grammars};
use crate::decode::{Decoding, Logits, Piece};
use crate::sampler::SamplerConfig;
use crate::speculative::{DraftLength, Drafter, SpecOptions, catch_up_after_plain};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use ts_model::{Backend, Cpu, ExpertPlacement, Model, ModelError, SeqState, Snapshot};
use ts_tokenizer::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] ts_tokenizer::TokenizerError),
    #[error(transparent)]
    Gguf(#[from] ts_gguf::GgufError),
    #[error(transparent)]
    Sampler(#[from] crate::sampler::SamplerError),
    #[error("the prompt has {tokens} tokens, more than the context of {n_ctx} (raise -c)")]
    PromptTooLong { tokens: usize, n_ctx: usize },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Constraint(#[from] crate::constraint::ConstraintError),
    #[error(
        "this model has no tokenizer (tokenizer.ggml.model is '{0}'): give token ids, e.g. with `logits` or `bench`"
    )]
    NoTokenizer(String),
}

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub threads: usize,
    pub experts: ExpertPlacement,
}

pub struct Engine<B: Backend = Cpu> {
    pub model: Model<B>,
    /// `None` for tokenizer-less files (`tokenizer.ggml.model = none`, e.g. synthetic models).
    tokenizer: Option<Tokenizer>,
    /// The file's chat template, if it has one.
    pub template: Option<ChatTemplate>,
    /// Shared with a draft model's engine ([`Engine::share_threads`]).
    pool: Arc<rayon::ThreadPool>,
    /// Rows per forward step during prefill.
    pub n_batch: usize,
    /// Keep activations in f32 for quantized weights (see `Scratch::exact`).
    pub exact_activations: bool,
    /// The grammar compiler over the vocabulary, built at the first constrained request.
    grammars: OnceLock<Result<Grammars, ConstraintError>>,
    /// How many guesses paid in the generations so far: where the next one starts, so that
    /// short generations do not each pay for learning it again.
    draft_length: Mutex<DraftLength>,
}

/// Timings of one generation.
#[derive(Clone, Debug, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub generated_tokens: usize,
    pub generation_time: Duration,
    /// Why generation stopped.
    pub stop: StopReason,
    /// Speculative decoding: steps that checked guesses, guesses checked, guesses kept.
    pub spec_steps: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// Time spent guessing (the drafter's calls, its catching up on plain steps' tokens
    /// included), and in checking steps (their forward pass).
    pub draft_time: Duration,
    pub check_time: Duration,
    /// Steps of the generation (the target's and a draft model's) that ran to be recorded
    /// ([`ts_model::Backend::warm_ups`]): none once every kind of step was recorded before.
    pub warm_ups: u64,
    /// Where guessing was off because even kept guesses cannot pay
    /// ([`DraftLength::never_pays`]): the least a guess costs and a plain step's time, seconds.
    pub guessing_off: Option<(f64, f64)>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StopReason {
    /// An end-of-generation token.
    #[default]
    EndOfGeneration,
    /// A stop sequence.
    Stop,
    /// The token limit.
    Length,
    /// The context is full.
    ContextFull,
    /// The caller asked to stop.
    Caller,
}

impl GenerationStats {
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }

    pub fn generation_tps(&self) -> f64 {
        self.generated_tokens as f64 / self.generation_time.as_secs_f64().max(1e-9)
    }

    /// The fraction of checked guesses kept.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// A rayon pool of `threads` threads for an engine's steps.
fn thread_pool(threads: usize) -> Result<Arc<rayon::ThreadPool>, EngineError> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| EngineError::Invalid(format!("thread pool: {e}")))?;
    Ok(Arc::new(pool))
}

impl Engine {
    pub fn load(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<Engine, EngineError> {
        Self::load_on(path.as_ref(), opts.experts.clone(), thread_pool(opts.threads)?)
    }

    /// [`Engine::load`] on `with`'s threads (a draft model beside its target, as
    /// [`Engine::share_threads`] says why).
    pub fn load_beside<C: Backend>(
        path: impl AsRef<Path>,
        experts: ExpertPlacement,
        with: &Engine<C>,
    ) -> Result<Engine, EngineError> {
        Self::load_on(path.as_ref(), experts, with.pool.clone())
    }

    fn load_on(path: &Path, experts: ExpertPlacement, pool: Arc<rayon::ThreadPool>) -> Result<Engine, EngineError> {
        let model = Model::open(path, experts)?;
        let file = ts_gguf::GgufFile::open(path)?;
        let (tokenizer, template) = match file.metadata().str("tokenizer.ggml.model")? {
            None | Some("none") | Some("no_vocab") => (None, None),
            Some(_) => {
                let tokenizer = Tokenizer::from_metadata(file.metadata())?;
                if tokenizer.vocab_size() != model.cfg.n_vocab {
                    return Err(EngineError::Invalid(format!(
                        "the tokenizer has {} tokens but the embedding table {} rows",
                        tokenizer.vocab_size(),
                        model.cfg.n_vocab
                    )));
                }
                let template = ChatTemplate::from_metadata(file.metadata(), &tokenizer)
                    .map_err(|e| EngineError::Invalid(format!("chat template: {e}")))?;
                (Some(tokenizer), template)
            }
        };
        Ok(Engine {
            model,
            tokenizer,
            template,
            pool,
            n_batch: 512,
            exact_activations: false,
            grammars: OnceLock::new(),
            draft_length: Mutex::default(),
        })
    }

    /// The same engine with its model on another backend, built by `make`.
    pub fn into_backend<B: Backend>(
        self,
        make: impl FnOnce(&Model) -> Result<B, ModelError>,
    ) -> Result<Engine<B>, EngineError> {
        let Engine { model, tokenizer, template, pool, n_batch, exact_activations, grammars, draft_length } = self;
        let model = model.into_backend(make)?;
        Ok(Engine { model, tokenizer, template, pool, n_batch, exact_activations, grammars, draft_length })
    }
}

impl<B: Backend> Engine<B> {
    /// How many guesses paid in the generations so far (of this engine, or of the server's
    /// requests): where the next generation starts.
    pub fn learnt_draft_length(&self) -> DraftLength {
        self.draft_length.lock().expect("draft length lock").clone()
    }

    /// Records what a finished generation learnt, for the next one.
    pub fn remember_draft_length(&self, length: &DraftLength) {
        *self.draft_length.lock().expect("draft length lock") = length.for_next_generation();
    }

    /// Starts the next generation's draft length from the prior again, as if it were the
    /// first (keeping the costs measured at load: the kinds of check): the learnt one is
    /// carried from generation to generation otherwise.
    pub fn forget_draft_length(&self) {
        let mut length = self.draft_length.lock().expect("draft length lock");
        *length = length.forget();
    }

    /// The tokenizer, or an error for a tokenizer-less model.
    pub fn tokenizer(&self) -> Result<&Tokenizer, EngineError> {
        self.tokenizer.as_ref().ok_or_else(|| EngineError::NoTokenizer("none".into()))
    }

    /// The grammar compiler for this model's vocabulary (built on first use).
    pub fn grammars(&self) -> Result<&Grammars, EngineError> {
        let tokenizer = self.tokenizer()?;
        Ok(self.grammars.get_or_init(|| Grammars::new(tokenizer)).as_ref().map_err(Clone::clone)?)
    }

    /// A new pool of `threads` threads for this engine's steps (a draft sharing the old one
    /// keeps it until given this one again).
    pub fn set_threads(&mut self, threads: usize) -> Result<(), EngineError> {
        self.pool = thread_pool(threads)?;
        Ok(())
    }

    /// Runs this engine's steps on `with`'s threads: a draft model and its target take turns,
    /// and two pools would leave one pool's threads waking and spinning beside the other's on
    /// the same cores.
    pub fn share_threads<C: Backend>(&mut self, with: &Engine<C>) {
        self.pool = with.pool.clone();
    }

    /// Runs `f` on the engine's thread pool (the forward pass's threads).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Fresh per-step buffers for [`Model::forward`].
    pub fn scratch(&self) -> B::Scratch {
        self.model.backend.scratch(self.exact_activations)
    }

    /// The context size to use when the user gives none: the training context, capped at 4096.
    pub fn default_context(&self) -> usize {
        match self.model.cfg.n_ctx_train {
            0 => 4096,
            n => n.min(4096),
        }
    }

    pub fn new_sequence(&self, n_ctx: usize) -> Result<SeqState<B::State>, EngineError> {
        Ok(self.model.new_sequence(n_ctx, self.n_batch)?)
    }

    /// Runs `tokens` after what `seq` holds, `n_batch` at a time. Returns the
    /// logits of every position when `all`, else of the last one only.
    pub fn prefill(
        &self,
        seq: &mut SeqState<B::State>,
        tokens: &[u32],
        all: bool,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        self.prefill_observed(seq, tokens, all, None)
    }

    /// [`Engine::prefill`], handing each chunk's final-normed hidden states to `observer`
    /// where it reads them ([`Drafter::wants_hidden`]: an MTP head).
    pub fn prefill_observed(
        &self,
        seq: &mut SeqState<B::State>,
        tokens: &[u32],
        all: bool,
        mut observer: Option<&mut dyn Drafter>,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        if seq.n_past + tokens.len() > seq.n_ctx {
            return Err(EngineError::PromptTooLong { tokens: seq.n_past + tokens.len(), n_ctx: seq.n_ctx });
        }
        let mut scratch = self.scratch();
        let mut out = Vec::new();
        let n_chunks = tokens.len().div_ceil(self.n_batch.max(1));
        for (c, chunk) in tokens.chunks(self.n_batch.max(1)).enumerate() {
            let logits = match (all, c + 1 == n_chunks) {
                (true, _) => Logits::All,
                (false, true) => Logits::Last,
                (false, false) => Logits::None,
            };
            let piece = Piece { tokens: chunk, logits };
            out.extend(self.step_observed(seq, piece, &mut scratch, observer.as_deref_mut())?);
        }
        Ok(out)
    }

    /// Generates up to `max_tokens` after `prompt`, calling `on_text` with each
    /// piece of text as soon as it is whole UTF-8; `on_text` returns false to
    /// stop. With `special`, control tokens appear as their text (harmony's
    /// markers, for one); with `spec`, a drafter guesses ahead ([`Engine::decode`]).
    #[allow(clippy::too_many_arguments)]
    pub fn generate<'d>(
        &self,
        seq: &mut SeqState<B::State>,
        prompt: &[u32],
        max_tokens: usize,
        sampler: &SamplerConfig,
        special: bool,
        spec: Option<(&mut (dyn Drafter + 'd), &SpecOptions)>,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<(Vec<u32>, GenerationStats), EngineError> {
        let t0 = Instant::now();
        let mut spec = spec;
        let observer = spec.as_mut().map(|(d, _)| &mut **d as &mut dyn Drafter);
        let logits = self
            .prefill_observed(seq, prompt, false, observer)?
            .pop()
            .ok_or_else(|| EngineError::Invalid("empty prompt".into()))?;
        let prompt_time = t0.elapsed();
        let (generated, mut stats) = self.decode(seq, logits, prompt, max_tokens, sampler, special, spec, on_text)?;
        stats.prompt_tokens = prompt.len();
        stats.prompt_time += prompt_time;
        Ok((generated, stats))
    }

    /// Generates after a sequence whose last logits are `logits` (`history`: the tokens it
    /// holds, for the sampler's penalties), as [`Engine::generate`]. With `spec`, each step
    /// runs the next token and the drafter's guesses after it as rows of one forward pass,
    /// samples every row in turn as a one-token step would, and keeps the guesses up to the
    /// first that differs from the sample; the sequence is rewound past the others (a model
    /// with recurrent layers goes back to a snapshot and runs the kept tokens again).
    #[allow(clippy::too_many_arguments)]
    pub fn decode<'d>(
        &self,
        seq: &mut SeqState<B::State>,
        logits: Vec<f32>,
        history: &[u32],
        max_tokens: usize,
        sampler: &SamplerConfig,
        special: bool,
        mut spec: Option<(&mut (dyn Drafter + 'd), &SpecOptions)>,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<(Vec<u32>, GenerationStats), EngineError> {
        let warm_ups = |spec: &Option<(&mut (dyn Drafter + 'd), &SpecOptions)>| {
            self.model.backend.warm_ups() + spec.as_ref().map_or(0, |(d, _)| d.warm_ups())
        };
        // A draft model reads the prompt first: prompt time, not a check's.
        let t_catch_up = Instant::now();
        if let Some((drafter, _)) = spec.as_mut() {
            drafter.catch_up(history)?;
        }
        let catch_up_time = t_catch_up.elapsed();
        let mut length = self.learnt_draft_length();
        if let Some((drafter, _)) = spec.as_ref() {
            length.learn_costs(&**drafter);
        }
        let warm_at_start = warm_ups(&spec);
        let t1 = Instant::now();
        let mut decoding = Decoding::new(self.tokenizer()?, sampler, history, max_tokens, special, Vec::new())?;
        let mut scratch = self.scratch();
        // Checking steps give each row what a one-row step gives (the same output as without guesses).
        let mut checking = self.scratch();
        self.model.backend.rows_alone(&mut checking);
        let mut generated = Vec::new();
        let mut stats = GenerationStats { prompt_time: catch_up_time, ..GenerationStats::default() };
        // The text so far, for the drafter, and the positions of the sequence that hold it
        // (past them: rows of guesses the target did not keep).
        let mut context = history.to_vec();
        let mut held = seq.n_past;
        // Rows to sample in turn; the guesses the rows after the first were run on; where a
        // model with recurrent layers was before them.
        let mut rows = vec![logits];
        let mut guesses: Vec<u32> = Vec::new();
        let mut snapshot = None;
        // How many guesses pay, and the last step's time (measured once its guesses are judged;
        // None for a warm-up).
        let mut last_step: Option<Option<f64>> = None;
        // `TURBOSPARK_SPEC_TRACE`, a measurement knob: each step's guesses and times on stderr
        // (plain decoding's too, to compare).
        let trace = std::env::var_os("TURBOSPARK_SPEC_TRACE").is_some();
        let (mut last_limit, mut last_guessing) = (0, Duration::ZERO);
        if trace {
            eprintln!("spec start: {:.2} ms in, {length:?}", t1.elapsed().as_secs_f64() * 1e3);
        }
        let mut steps_time = Duration::ZERO;
        'generation: loop {
            let accepted_before = stats.accepted;
            let mut next_token = None;
            for (i, row) in rows.iter().enumerate() {
                let next = decoding.next(row, seq.n_ctx - held)?;
                let keep_going = next.text.is_empty() || on_text(&next.text);
                if let Some(stop) = next.stop {
                    stats.stop = stop;
                    if stop != StopReason::EndOfGeneration {
                        generated.extend(next.token);
                    }
                    break 'generation;
                }
                let token = next.token.expect("a token when generation goes on");
                generated.push(token);
                if !keep_going {
                    stats.stop = StopReason::Caller;
                    break 'generation;
                }
                if guesses.get(i) == Some(&token) {
                    // Already run: the next row is its logits.
                    stats.accepted += 1;
                    context.push(token);
                    held += 1;
                    continue;
                }
                next_token = Some(token);
                break;
            }
            if let Some(secs) = last_step.take() {
                if trace {
                    let ms = |d: Option<f64>| d.map_or("warm-up".into(), |s| format!("{:.2} ms", s * 1e3));
                    eprintln!(
                        "spec step: {} guesses, {} kept, limit {last_limit}, guessing {:.2} ms, step {}",
                        guesses.len(),
                        stats.accepted - accepted_before,
                        last_guessing.as_secs_f64() * 1e3,
                        ms(secs)
                    );
                }
                match guesses.len() {
                    0 => length.plain(secs),
                    n => length.checked(secs, n, stats.accepted - accepted_before),
                }
            }
            self.rewind(seq, held, &context, snapshot.take(), &mut checking)?;
            let token = next_token.expect("the last row gives a token to run");
            context.push(token);
            held += 1;
            // Guesses must fit the context and the token limit. A step's time includes
            // guessing (a draft model's passes cost as much as the checked rows save).
            let room = (seq.n_ctx - held).min(max_tokens.saturating_sub(decoding.generated()));
            let limit = spec.as_ref().map_or(0, |(_, o)| o.limit(&length, room));
            last_limit = limit;
            // A check's time includes the drafter's catching up on the plain steps before it
            // (what returning to guessing costs), unless that ran a warm-up.
            let (started, warm_before) = (Instant::now(), warm_ups(&spec));
            if let Some((drafter, _)) = spec.as_mut() {
                catch_up_after_plain(&mut **drafter, &context, limit, guesses.is_empty())?;
            }
            guesses = match spec.as_mut() {
                Some((drafter, o)) if room > 0 => {
                    let mut g = drafter.draft(&context, limit)?;
                    last_guessing = started.elapsed();
                    stats.draft_time += last_guessing;
                    g.truncate(room);
                    if g.len() < o.draft_min.max(1) {
                        g.clear();
                    }
                    g
                }
                _ => Vec::new(),
            };
            let mut piece = vec![token];
            piece.extend_from_slice(&guesses);
            let (logits, s) = if guesses.is_empty() {
                (Logits::Last, &mut scratch)
            } else {
                stats.spec_steps += 1;
                stats.drafted += guesses.len();
                snapshot = self.model.is_recurrent().then(|| self.model.snapshot(seq)).transpose()?;
                (Logits::All, &mut checking)
            };
            let observer = spec.as_mut().map(|(d, _)| &mut **d);
            let stepped = Instant::now();
            rows = self.step_observed(seq, Piece { tokens: &piece, logits }, s, observer)?;
            if !guesses.is_empty() {
                stats.check_time += stepped.elapsed();
            }
            let step_time = started.elapsed();
            last_step = Some((warm_ups(&spec) == warm_before).then_some(step_time.as_secs_f64()));
            steps_time += step_time;
        }
        if trace {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            eprintln!("spec end: {:.2} ms in, {:.2} of it in steps", ms(t1.elapsed()), ms(steps_time));
        }
        self.rewind(seq, held, &context, snapshot.take(), &mut checking)?;
        self.remember_draft_length(&length);
        stats.guessing_off = spec.as_ref().filter(|(_, o)| o.adapt).and(length.never_pays());
        stats.warm_ups = warm_ups(&spec) - warm_at_start;
        stats.generated_tokens = generated.len();
        stats.generation_time = t1.elapsed();
        Ok((generated, stats))
    }

    /// Records, ahead of a generation of `n_ctx` positions, the steps it takes where the backend
    /// records steps of a few row counts ([`Backend::padded_rows`]): the one-row step and the
    /// kinds of checking step that up to `max_guesses` guesses take (none without a drafter),
    /// each run until it replays (measured, then recorded) at the start of `seq` (a sequence of
    /// the generation's size, left empty), so that no step of the generation is a warm-up (on
    /// the H200 a 1.5B model's first steps of a kind ran directly, about 10 ms against 2 ms
    /// replayed, and recording took 30; llama.cpp's tools run a warm-up step at load too).
    /// Checks of models with recurrent layers are not padded (and checks whose hidden states an
    /// MTP head reads are never recorded: the caller skips those). Returns the warm-ups run.
    pub fn warm_up_steps(&self, seq: &mut SeqState<B::State>, max_guesses: usize) -> Result<u64, EngineError> {
        let backend = &self.model.backend;
        if backend.padded_rows(2).is_none() {
            return Ok(0);
        }
        let mut kinds: Vec<usize> = (2..=max_guesses + 1).filter_map(|m| backend.padded_rows(m)).collect();
        kinds.dedup();
        if self.model.is_recurrent() {
            kinds.clear();
        }
        let (mut plain, mut checking) = (self.scratch(), self.scratch());
        backend.rows_alone(&mut checking);
        let before = backend.warm_ups();
        let n_ctx = seq.n_ctx;
        let steps = std::iter::once((1, Logits::Last)).chain(kinds.into_iter().map(|rows| (rows, Logits::All)));
        // Each kind's replayed time, for the smallest check's cost beyond a plain step's.
        let mut replayed = Vec::new();
        for (rows, logits) in steps.filter(|&(rows, _)| rows <= n_ctx) {
            let scratch = if rows == 1 { &mut plain } else { &mut checking };
            replayed.extend(self.time_step_at_start(seq, rows, logits, scratch)?.map(|secs| (rows, secs)));
        }
        if let [(1, plain_secs), ref checks @ ..] = replayed[..]
            && !checks.is_empty()
        {
            self.draft_length.lock().expect("draft length lock").set_checks(plain_secs, checks, max_guesses);
        }
        Ok(backend.warm_ups() - before)
    }

    /// Runs a step of `rows` tokens at the start of `seq` (left empty) until it replays
    /// ([`replayed_secs`]): its replayed time, None where it never stopped warming up.
    pub(crate) fn time_step_at_start(
        &self,
        seq: &mut SeqState<B::State>,
        rows: usize,
        logits: Logits,
        scratch: &mut B::Scratch,
    ) -> Result<Option<f64>, EngineError> {
        let tokens = vec![0; rows];
        replayed_secs(&self.model.backend, || {
            seq.n_past = 0;
            let run = self.step(&mut [&mut *seq], &[Piece { tokens: &tokens, logits }], scratch);
            seq.n_past = 0;
            run.map(drop)
        })
    }

    /// Takes `seq` back to its first `held` positions (those of `context`'s end it
    /// keeps): attention layers only forget the rest; with recurrent layers, back to
    /// `snapshot` (taken before the guesses) and the kept tokens run again.
    pub fn rewind(
        &self,
        seq: &mut SeqState<B::State>,
        held: usize,
        context: &[u32],
        snapshot: Option<Snapshot<B::Recurrent>>,
        scratch: &mut B::Scratch,
    ) -> Result<(), EngineError> {
        if seq.n_past <= held {
            return Ok(());
        }
        match snapshot {
            Some(snap) => {
                self.model.restore(seq, &snap)?;
                let again = &context[context.len() - (held - snap.n_past)..];
                if !again.is_empty() {
                    self.step(&mut [&mut *seq], &[Piece { tokens: again, logits: Logits::None }], scratch)?;
                }
            }
            None => seq.n_past = held,
        }
        Ok(())
    }

    /// llama.cpp's perplexity: the text split into chunks of `n_ctx` tokens (BOS
    /// replacing each chunk's first token when the model adds one), each run
    /// from an empty cache, scoring the second half of every chunk.
    pub fn perplexity(
        &self,
        text: &str,
        n_ctx: usize,
        mut on_chunk: impl FnMut(usize, f64),
    ) -> Result<Perplexity, EngineError> {
        let tokenizer = self.tokenizer()?;
        let tokens = tokenizer.encode(text, true, false)?;
        if n_ctx < 4 || tokens.len() < 2 * n_ctx {
            return Err(EngineError::Invalid(format!(
                "perplexity needs at least 2 x n_ctx = {} tokens, the text has {}",
                2 * n_ctx,
                tokens.len()
            )));
        }
        let n_chunk = tokens.len() / n_ctx;
        let first = n_ctx / 2;
        let mut seq = self.new_sequence(n_ctx)?;
        let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
        for c in 0..n_chunk {
            let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
            if tokenizer.add_bos()
                && let Some(bos) = tokenizer.bos()
            {
                chunk[0] = bos;
            }
            seq.clear();
            let logits = self.prefill(&mut seq, &chunk, true)?;
            for i in first..n_ctx - 1 {
                let v = -log_softmax_at(&logits[i], chunk[i + 1] as usize);
                nll += v;
                nll2 += v * v;
                count += 1;
            }
            on_chunk(c + 1, (nll / count as f64).exp());
        }
        let mean = nll / count as f64;
        let var = (nll2 / count as f64 - mean * mean).max(0.0);
        let ppl = mean.exp();
        Ok(Perplexity { ppl, ppl_error: (var / (count as f64 - 1.0)).sqrt() * ppl, chunks: n_chunk, scored: count })
    }
}

/// Result of [`Engine::perplexity`].
#[derive(Clone, Debug)]
pub struct Perplexity {
    pub ppl: f64,
    /// Standard error of the estimate, as llama.cpp reports it.
    pub ppl_error: f64,
    pub chunks: usize,
    pub scored: usize,
}

/// `log softmax(logits)[target]`, in f64.
pub fn log_softmax_at(logits: &[f32], target: usize) -> f64 {
    let (_, max) = ts_cpu::ops::argmax(logits);
    logits[target] as f64 - max as f64 - ts_cpu::ops::sum_exp_shifted(logits, max).ln()
}

/// Peak resident memory of this process so far (VmHWM), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Runs a step (`run`) until it no longer adds to `backend`'s warm-ups (at most three runs:
/// the GPU measures, then records), then once more: the faster of the last two runs' seconds,
/// or None when it never stopped warming up.
pub(crate) fn replayed_secs<B: Backend>(
    backend: &B,
    mut run: impl FnMut() -> Result<(), EngineError>,
) -> Result<Option<f64>, EngineError> {
    let mut timed = || -> Result<(f64, bool), EngineError> {
        let (warm, started) = (backend.warm_ups(), Instant::now());
        run()?;
        Ok((started.elapsed().as_secs_f64(), backend.warm_ups() == warm))
    };
    for _ in 0..3 {
        let (secs, replayed) = timed()?;
        if replayed {
            let (again, _) = timed()?;
            return Ok(Some(secs.min(again)));
        }
    }
    Ok(None)
}
