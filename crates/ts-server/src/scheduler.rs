//! The batching loop: one thread owns the sequences. Each iteration admits
//! waiting requests into free slots, then runs one [`Engine::step`] holding a
//! token for every sequence that is generating and, up to a budget of rows,
//! the next pieces of prompts still being read, so each weight (and each
//! expert) a step needs is read once for all of them and a new prompt does
//! not stall the replies already streaming. Each sequence's tokens and text
//! come from a [`Decoding`], as in `run` and `chat`.

use crate::metrics::Metrics;
use rayon::prelude::*;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use ts_engine::constraint::Constraint;
use ts_engine::decode::{Decoding, Logits, Piece};
use ts_engine::reuse::CachedSequence;
use ts_engine::sampler::SamplerConfig;
use ts_engine::session::{Engine, StopReason};
use ts_engine::speculative::{
    DraftLength, Drafter, ModelDrafter, MtpDrafter, NgramDrafter, SpecOptions, catch_up_after_plain,
};
use ts_model::{Backend, SeqState, Snapshot};

/// Why a generation ended, as OpenAI names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token or a stop sequence.
    Stop,
    /// `max_tokens`, or the slot's context is full.
    Length,
    /// The client went away: nobody to tell.
    Gone,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Gone => "gone",
        }
    }
}

/// A token, its bytes and its log-probability under the model at one step
/// (the log-softmax of the logits, before temperature, top-p and penalties).
#[derive(Clone, Debug)]
pub struct TokenChoice {
    pub id: u32,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// A generated token and the most likely tokens at its step, most likely first.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub chosen: TokenChoice,
    pub top: Vec<TokenChoice>,
}

/// What the scheduler tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// More generated text, and the log-probabilities of the tokens that made
    /// it when they were asked for (a token's text can come in a later event
    /// than the token: an incomplete character or a possible stop sequence is
    /// held back).
    Text {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// Log-probabilities of prompt tokens after the first, in order, when the
    /// request scores its prompt (sent as the prompt is read, before any text).
    Prompt(Vec<TokenLogprob>),
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Error(String),
}

/// One of a request's choices: its sampler and where its events go.
pub struct Choice {
    pub id: String,
    pub sampler: SamplerConfig,
    pub events: UnboundedSender<Event>,
}

/// A request, validated and tokenized by its handler. Its choices share the
/// prompt, which is read once and copied to each choice's sequence.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Decode control tokens as text (gpt-oss's harmony markers).
    pub special: bool,
    /// Report each generated token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Report the prompt tokens' log-probabilities too (with `logprobs`
    /// alternatives, to the first choice): every prompt row is run with
    /// logits, none reused.
    pub score_prompt: bool,
    /// A prompt position to keep a snapshot at, with `--prompt-cache`, for a
    /// model with recurrent layers: where a chat's conversation ends and its
    /// generation prompt starts.
    pub checkpoint: Option<usize>,
    pub choices: Vec<Choice>,
    /// The grammar the replies are held to, in its start state (each choice steps a copy).
    pub constraint: Option<Constraint>,
    pub received: Instant,
    /// Prompt lookup's guess lengths, when this job guesses.
    pub spec: Option<SpecOptions>,
}

impl Job {
    fn all_gone(&self) -> bool {
        self.choices.iter().all(|c| c.events.is_closed())
    }
}

/// A generating sequence's prompt lookup: its lengths, how many guesses pay, the guesses
/// of the step being run, and where a model with recurrent layers was before them.
struct Guessing<R> {
    opts: SpecOptions,
    length: DraftLength,
    guesses: Vec<u32>,
    /// How many of `guesses` the model kept.
    kept: usize,
    snapshot: Option<Snapshot<R>>,
    /// Whether the drafter has read this request's prompt (its first catching up: prompt
    /// time, not a step's).
    read_prompt: bool,
}

impl<R> Guessing<R> {
    /// Starts from `learnt`: what the requests before learnt about how many guesses pay
    /// ([`ts_engine::session::Engine::learnt_draft_length`]).
    fn new(opts: &SpecOptions, learnt: &DraftLength) -> Guessing<R> {
        let length = learnt.clone();
        Guessing { opts: opts.clone(), length, guesses: Vec::new(), kept: 0, snapshot: None, read_prompt: false }
    }
}

/// `drafter`'s guesses after `history` (the sequence's tokens) and `next` (the token
/// about to run): as many as pay ([`DraftLength`]), fit the context and stay within the
/// `left` tokens the reply may still have; none when fewer than `draft_min`. After a plain
/// step the drafter first catches up on its tokens (part of the step's time); the time it
/// spent reading the request's prompt, the first time, is handed back (not the step's).
fn guesses<R, S>(
    g: &mut Guessing<R>,
    drafter: &mut dyn Drafter,
    history: &[u32],
    next: u32,
    seq: &SeqState<S>,
    left: usize,
) -> (Vec<u32>, Duration) {
    let room = (seq.n_ctx.saturating_sub(seq.n_past + 1)).min(left);
    if room == 0 {
        return (Vec::new(), Duration::ZERO);
    }
    let prompt_time = match std::mem::replace(&mut g.read_prompt, true) {
        true => Duration::ZERO,
        false => {
            let started = Instant::now();
            if let Err(e) = drafter.catch_up(history) {
                tracing::warn!("the drafter could not read the prompt: {e}");
            }
            started.elapsed()
        }
    };
    let mut context = Vec::with_capacity(history.len() + 1);
    context.extend_from_slice(history);
    context.push(next);
    g.length.learn_costs(&*drafter);
    let limit = g.opts.limit(&g.length, room);
    let drafted = catch_up_after_plain(drafter, &context, limit, g.guesses.is_empty())
        .and_then(|()| drafter.draft(&context, limit));
    let mut out = drafted.unwrap_or_else(|e| {
        tracing::warn!("guessing failed, going on without guesses: {e}");
        Vec::new()
    });
    out.truncate(room);
    if out.len() < g.opts.draft_min.max(1) {
        out.clear();
    }
    (out, prompt_time)
}

/// One choice being generated, in a slot.
struct Active<'a, R> {
    job: Arc<Job>,
    /// Index into `job.choices`.
    choice: usize,
    slot: usize,
    decoding: Decoding<'a>,
    /// Prompt tokens already in the cache; generation starts once all are.
    prompt_done: usize,
    /// Slots reserved for the job's other choices: they get a copy of this
    /// sequence once its prompt is read.
    siblings: Vec<(usize, usize)>,
    /// The token to run next (once generating).
    next: u32,
    /// Log-probabilities of tokens whose text has not been sent yet.
    pending: Vec<TokenLogprob>,
    prefill_time: Duration,
    started: Instant,
    /// Prompt lookup, when the job guesses.
    guessing: Option<Guessing<R>>,
}

impl<R> Active<'_, R> {
    fn events(&self) -> &UnboundedSender<Event> {
        &self.job.choices[self.choice].events
    }

    fn generating(&self) -> bool {
        self.prompt_done == self.job.prompt.len()
    }
}

/// Rows one forward step takes at most (decode rows first, then prompt pieces);
/// also the chunk the sequences' sliding-window rings are sized for.
const STEP_ROWS: usize = 512;

/// Prompt rows per step of a request that scores its prompt (each row's logits
/// are a vocabulary of floats: 64 rows of Gemma's 262k are 67 MB).
const SCORED_ROWS: usize = 64;

/// Runs until the job channel closes.
/// With `prompt_cache`, a request whose prompt starts like what a free slot
/// holds reuses those positions instead of reading them again: an attention
/// layer rewinds to any position; a model with recurrent layers goes back to
/// the end of the slot's last prompt (kept as a snapshot), or continues the
/// slot's state when the prompt extends everything it holds.
///
/// With `spec_mtp`, each slot has the model's MTP head ([`MtpDrafter`]), which every step
/// hands the slot's hidden states (from the slot's first prompt on, so that a reused prefix
/// was seen too); a lone request guesses with its slot's head.
#[allow(clippy::too_many_arguments)]
pub fn run<B: Backend>(
    engine: &Engine<B>,
    draft: Option<(&Engine<B>, f32)>,
    spec_mtp: bool,
    jobs: Receiver<Job>,
    n_slots: usize,
    n_ctx: usize,
    prompt_cache: bool,
    metrics: Arc<Metrics>,
) {
    let mut slots: Vec<CachedSequence<B>> = Vec::with_capacity(n_slots);
    for _ in 0..n_slots {
        match engine.new_sequence(n_ctx) {
            Ok(seq) => slots.push(CachedSequence::new(seq)),
            Err(e) => {
                tracing::error!("cannot allocate the state of slot {}: {e}", slots.len());
                break;
            }
        }
    }
    let mut free: Vec<usize> = (0..slots.len()).rev().collect();
    let max_guesses = if draft.is_some() { SpecOptions::default().draft_max } else { 0 };
    if let Some(slot) = slots.first_mut()
        && let Err(e) = engine.warm_up_steps(&mut slot.seq, max_guesses)
    {
        tracing::warn!("recording the decode steps ahead failed ({e}); their first runs are slower");
    }
    // One drafter serves every request: only a request alone in the server guesses.
    let mut drafter: Box<dyn Drafter + '_> = match draft {
        None => Box::new(NgramDrafter::default()),
        Some((d, p_min)) => match engine.tokenizer().and_then(|t| ModelDrafter::new(d, t, n_ctx, p_min)) {
            Ok(m) => Box::new(m),
            Err(e) => {
                tracing::error!("the draft model cannot guess ({e}); prompt lookup guesses instead");
                Box::new(NgramDrafter::default())
            }
        },
    };
    // Per slot, the MTP head's state (its cache and the hidden states it has seen).
    let mut mtp: Vec<Option<MtpDrafter<'_, B>>> = (0..slots.len())
        .map(|i| match spec_mtp.then(|| MtpDrafter::new(engine, n_ctx)).transpose() {
            Ok(m) => m,
            Err(e) => {
                tracing::error!("slot {i}: the MTP head cannot guess ({e})");
                None
            }
        })
        .collect();
    let observing = mtp.iter().any(Option::is_some);
    let model = &engine.model;
    let mut active: Vec<Active<'_, B::Recurrent>> = Vec::new();
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut scratch = engine.scratch();
    // Steps that check guesses give each row what a one-row step gives.
    let mut checking = engine.scratch();
    model.backend.rows_alone(&mut checking);
    let tokenizer = match engine.tokenizer() {
        Ok(t) => t,
        Err(e) => {
            tracing::error!("{e}");
            return;
        }
    };
    loop {
        // Take in new jobs; block only when there is nothing else to do.
        loop {
            let job = if active.is_empty() && waiting.is_empty() {
                match jobs.recv() {
                    Ok(j) => j,
                    Err(_) => return,
                }
            } else {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) if active.is_empty() && waiting.is_empty() => return,
                    Err(TryRecvError::Disconnected) => break,
                }
            };
            waiting.push_back(job);
        }
        // Admit waiting jobs while slots are free: as many of a job's choices as fit
        // now (its other choices wait and read the prompt again).
        while !free.is_empty()
            && let Some(mut job) = waiting.pop_front()
        {
            metrics.queued.fetch_sub(1, Relaxed);
            if job.all_gone() {
                metrics.cancelled.fetch_add(1, Relaxed);
                tracing::info!(id = %job.choices[0].id, "client went away before its turn");
                continue;
            }
            if job.choices.len() > free.len() {
                let rest = job.choices.split_off(free.len());
                waiting.push_front(Job {
                    prompt: job.prompt.clone(),
                    stop: job.stop.clone(),
                    spec: job.spec.clone(),
                    constraint: job.constraint.clone(),
                    choices: rest,
                    score_prompt: false,
                    ..job
                });
                metrics.queued.fetch_add(1, Relaxed);
            }
            let job = Arc::new(job);
            // The free slot whose state serves the longest start of this prompt.
            let cacheable = prompt_cache && !job.score_prompt;
            let (pick, _) = free
                .iter()
                .enumerate()
                .map(|(i, &s)| (i, if cacheable { slots[s].reusable(model, &job.prompt) } else { 0 }))
                .max_by_key(|&(i, n)| (n, i))
                .expect("a free slot");
            let slot = free.remove(pick);
            let reuse = match cacheable {
                true => slots[slot].prepare(model, &job.prompt).unwrap_or_else(|e| {
                    tracing::warn!("slot {slot}: going back to its snapshot failed, reading the whole prompt: {e}");
                    0
                }),
                false => {
                    slots[slot].forget();
                    0
                }
            };
            metrics.prompt_tokens_cached.fetch_add(reuse as u64, Relaxed);
            let siblings: Vec<(usize, usize)> =
                (1..job.choices.len()).map(|c| (c, free.pop().expect("counted"))).collect();
            metrics.busy.fetch_add(job.choices.len() as u64, Relaxed);
            match start(&job, 0, tokenizer, &job.prompt) {
                Ok(decoding) => active.push(Active {
                    job: job.clone(),
                    choice: 0,
                    slot,
                    decoding,
                    prompt_done: reuse,
                    siblings,
                    next: 0,
                    pending: Vec::new(),
                    prefill_time: Duration::ZERO,
                    started: Instant::now(),
                    guessing: job.spec.as_ref().map(|o| Guessing::new(o, &engine.learnt_draft_length())),
                }),
                Err(e) => {
                    for c in &job.choices {
                        let _ = c.events.send(Event::Error(e.to_string()));
                    }
                    free.push(slot);
                    free.extend(siblings.iter().map(|&(_, s)| s));
                    metrics.busy.fetch_sub(job.choices.len() as u64, Relaxed);
                }
            }
        }
        active.retain_mut(|a| {
            let keep = !a.events().is_closed();
            if !keep {
                metrics.cancelled.fetch_add(1, Relaxed);
                metrics.busy.fetch_sub(1 + a.siblings.len() as u64, Relaxed);
                tracing::info!(id = %a.job.choices[a.choice].id, generated = a.decoding.generated(), "client went away; slot freed");
                free.push(a.slot);
                free.extend(a.siblings.iter().map(|&(_, s)| s));
            }
            keep
        });
        if active.is_empty() {
            continue;
        }

        // One step: a token for each generating sequence, then prompt pieces up to the budget.
        let t = Instant::now();
        let mut pieces: Vec<(usize, Vec<u32>, Logits)> = Vec::new();
        let mut guessed = 0;
        // Guesses pay only for a sequence alone in the step: several already share each weight
        // read, and a step with guesses runs on the one-row kernels, prompt rows included
        // (measured: two requests guessing together, or one beside another's prompt, were
        // slower than without guesses).
        let alone = active.len() == 1 && active[0].generating();
        // Steps run to be recorded so far: a step that adds to them gives its guesses no time.
        let warm_ups = || model.backend.warm_ups() + draft.map_or(0, |(d, _)| d.model.backend.warm_ups());
        let warm_before = warm_ups();
        // The drafter's reading of a request's prompt, within the step but not its guesses'.
        let mut untimed = Duration::ZERO;
        for (i, a) in active.iter_mut().enumerate() {
            if !a.generating() {
                continue;
            }
            let mut piece = vec![a.next];
            if let Some(g) = &mut a.guessing {
                let slot = &slots[a.slot];
                let left = a.job.max_tokens.saturating_sub(a.decoding.generated());
                let d: &mut dyn Drafter = match mtp[a.slot].as_mut() {
                    Some(m) => m,
                    None => drafter.as_mut(),
                };
                g.guesses = match alone {
                    true => {
                        let (out, prompt_time) = guesses(g, d, &slot.history, a.next, &slot.seq, left);
                        untimed = prompt_time;
                        out
                    }
                    false => Vec::new(),
                };
                if !g.guesses.is_empty() {
                    if model.is_recurrent() {
                        match model.snapshot(&slot.seq) {
                            Ok(snap) => g.snapshot = Some(snap),
                            Err(e) => {
                                tracing::warn!("slot {}: no snapshot to guess from: {e}", a.slot);
                                g.guesses.clear();
                            }
                        }
                    }
                    piece.extend_from_slice(&g.guesses);
                    guessed += g.guesses.len();
                }
            }
            let logits = if piece.len() > 1 { Logits::All } else { Logits::Last };
            pieces.push((i, piece, logits));
        }
        let decode_rows = pieces.len() + guessed;
        let mut budget = STEP_ROWS.saturating_sub(decode_rows).max(1);
        let mut prompt_rows = 0;
        for (i, a) in active.iter().enumerate() {
            let left = a.job.prompt.len() - a.prompt_done;
            if left == 0 || budget == 0 {
                continue;
            }
            // A request scoring its prompt gets logits for every row: fewer rows per step.
            let mut n = left.min(budget).min(if a.job.score_prompt { SCORED_ROWS } else { usize::MAX });
            if prompt_cache && let Some(at) = a.job.checkpoint.filter(|&at| at > a.prompt_done) {
                // A step ends at the checkpoint, for its snapshot.
                n = n.min(at - a.prompt_done);
            }
            let tokens = a.job.prompt[a.prompt_done..a.prompt_done + n].to_vec();
            let logits = match (a.job.score_prompt, n == left) {
                (true, _) => Logits::All,
                (false, true) => Logits::Last,
                (false, false) => Logits::None,
            };
            pieces.push((i, tokens, logits));
            budget -= n;
            prompt_rows += n;
        }
        // Where each piece starts in its sequence (for the MTP heads' hidden states).
        let firsts: Vec<usize> = pieces.iter().map(|(i, _, _)| slots[active[*i].slot].seq.n_past).collect();
        let result = {
            let mut by_slot: Vec<Option<&mut SeqState<B::State>>> =
                slots.iter_mut().map(|s| Some(&mut s.seq)).collect();
            let mut seqs: Vec<&mut SeqState<B::State>> = pieces
                .iter()
                .map(|(i, _, _)| by_slot[active[*i].slot].take().expect("one sequence per slot"))
                .collect();
            let step: Vec<Piece> = pieces.iter().map(|(_, tokens, logits)| Piece { tokens, logits: *logits }).collect();
            let s = if guessed > 0 { &mut checking } else { &mut scratch };
            // A panic in a step (a bug) ends the requests in it, not the server.
            let run = || match observing {
                true => engine.step_hidden(&mut seqs, &step, s).map(|(l, h)| (l, Some(h))),
                false => engine.step(&mut seqs, &step, s).map(|l| (l, None)),
            };
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|p| {
                let msg =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                Err(ts_model::ModelError::Compute(format!("internal error: {}", msg.unwrap_or_default())).into())
            })
        };
        let logits = match result {
            Ok((l, hidden)) => {
                for (((i, tokens, _), &first), h) in pieces.iter().zip(&firsts).zip(hidden.iter().flatten()) {
                    if let Some(m) = mtp[active[*i].slot].as_mut() {
                        m.observe(first, tokens, h);
                    }
                }
                l
            }
            Err(e) => {
                // A failed step leaves the states suspect: end every request in it.
                for a in active.drain(..) {
                    let _ = a.events().send(Event::Error(format!("generation failed: {e}")));
                    slots[a.slot].forget();
                    free.push(a.slot);
                    free.extend(a.siblings.iter().map(|&(_, s)| s));
                    metrics.busy.fetch_sub(1 + a.siblings.len() as u64, Relaxed);
                }
                metrics.errors.fetch_add(1, Relaxed);
                continue;
            }
        };
        metrics.prompt_tokens.fetch_add(prompt_rows as u64, Relaxed);
        let step_secs = t.elapsed();
        if decode_rows > 0 {
            metrics.record_step(decode_rows, step_secs);
        }
        metrics.spec_drafted.fetch_add(guessed as u64, Relaxed);
        // A step of one sequence alone times its guesses (or their absence) for its DraftLength,
        // the drafter's catching up on plain steps included (what returning to guessing costs),
        // its reading of the prompt not; a warm-up gives no time.
        let warmed = warm_ups() != warm_before;
        let timed = (alone && prompt_rows == 0).then(|| (!warmed).then(|| step_secs.saturating_sub(untimed)));
        // Per active: the logits rows to sample from in turn, once its prompt is read.
        let mut row_of: Vec<Option<&[Vec<f32>]>> = vec![None; active.len()];
        for ((i, tokens, _), rows) in pieces.iter().zip(&logits) {
            let a = &mut active[*i];
            slots[a.slot].ran(tokens);
            if !a.generating() {
                a.prompt_done += tokens.len();
                if prompt_cache
                    && (a.job.checkpoint == Some(a.prompt_done) || a.generating())
                    && let Err(e) = slots[a.slot].remember(model)
                {
                    tracing::warn!("slot {}: no snapshot at position {}: {e}", a.slot, a.prompt_done);
                }
                if a.job.score_prompt {
                    // Prompt rows scored: the log-probability of the token after each.
                    let start = a.prompt_done - tokens.len();
                    let upto = rows.len() - usize::from(a.generating());
                    let prompt = &a.job.prompt;
                    let top = a.job.logprobs.unwrap_or(0);
                    let entries: Vec<TokenLogprob> = engine.install(|| {
                        (0..upto)
                            .into_par_iter()
                            .map(|j| {
                                // Prompt pieces show control tokens, as the prompt's text holds their markers.
                                token_logprob(&rows[j], prompt[start + j + 1], top, |id| {
                                    token_bytes(tokenizer, id, true)
                                })
                            })
                            .collect()
                    });
                    let _ = a.events().send(Event::Prompt(entries));
                }
                if a.generating() {
                    a.prefill_time = a.started.elapsed();
                    row_of[*i] = rows.len().checked_sub(1).map(|l| &rows[l..]);
                }
            } else {
                row_of[*i] = Some(&rows[..]);
            }
        }
        // Choices sharing a prompt just read: each gets a copy of the sequence.
        let mut spawned = Vec::new();
        for (i, a) in active.iter_mut().enumerate() {
            if row_of[i].is_none() || a.siblings.is_empty() {
                continue;
            }
            for (choice, slot) in std::mem::take(&mut a.siblings) {
                let copied = {
                    let (src, dst) = two_mut(&mut slots, a.slot, slot);
                    dst.copy_from(model, src)
                };
                let decoding = copied.and_then(|()| start(&a.job, choice, tokenizer, &a.job.prompt));
                match decoding {
                    Ok(decoding) => spawned.push((
                        i,
                        Active {
                            job: a.job.clone(),
                            choice,
                            slot,
                            decoding,
                            prompt_done: a.job.prompt.len(),
                            siblings: Vec::new(),
                            next: 0,
                            pending: Vec::new(),
                            prefill_time: a.prefill_time,
                            started: a.started,
                            guessing: a.job.spec.as_ref().map(|o| Guessing::new(o, &engine.learnt_draft_length())),
                        },
                    )),
                    Err(e) => {
                        let _ = a.job.choices[choice].events.send(Event::Error(format!("generation failed: {e}")));
                        free.push(slot);
                        metrics.busy.fetch_sub(1, Relaxed);
                    }
                }
            }
        }
        for (i, s) in spawned {
            row_of.push(row_of[i]);
            active.push(s);
        }
        // Sample every sequence that has logits, in parallel (each touches only its own state).
        let slots_ref = &slots;
        let metrics_ref = &metrics;
        let mut finished: Vec<(usize, Finish)> = engine.install(|| {
            active
                .par_iter_mut()
                .zip(row_of.par_iter())
                .enumerate()
                .filter_map(|(i, (a, rows))| {
                    let seq = &slots_ref[a.slot].seq;
                    step_rows(a, (*rows)?, tokenizer, seq, timed, metrics_ref).map(|f| (i, f))
                })
                .collect()
        });
        // Guesses the model did not keep leave the sequences (with recurrent layers: back to
        // the snapshot and the kept tokens run again).
        for (i, a) in active.iter_mut().enumerate() {
            let Some(g) = &mut a.guessing else { continue };
            let snapshot = g.snapshot.take();
            if g.guesses.is_empty() {
                continue;
            }
            let slot = &mut slots[a.slot];
            let held = slot.seq.n_past - (g.guesses.len() - g.kept);
            slot.history.truncate(held);
            if let Err(e) = engine.rewind(&mut slot.seq, held, &slot.history, snapshot, &mut checking) {
                let _ = a.events().send(Event::Error(format!("generation failed: {e}")));
                slot.forget();
                if !finished.iter().any(|&(f, _)| f == i) {
                    finished.push((i, Finish::Stop));
                }
            }
        }
        // Highest index first, so the indices still to remove stay valid.
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, finish) in finished {
            let a = active.remove(i);
            if let Some(g) = &a.guessing {
                engine.remember_draft_length(&g.length);
            }
            finish_job(&a, finish, &metrics);
            free.push(a.slot);
            metrics.busy.fetch_sub(1, Relaxed);
        }
    }
}

/// A [`Decoding`] for choice `choice` of `job`.
fn start<'t>(
    job: &Job,
    choice: usize,
    tokenizer: &'t ts_tokenizer::Tokenizer,
    prompt: &[u32],
) -> Result<Decoding<'t>, ts_engine::session::EngineError> {
    let c = &job.choices[choice];
    Ok(Decoding::new(tokenizer, &c.sampler, prompt, job.max_tokens, job.special, job.stop.clone())?
        .constrained(job.constraint.clone()))
}

/// Mutable references to two different slots.
fn two_mut<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    assert_ne!(a, b, "two different slots");
    if a < b {
        let (lo, hi) = v.split_at_mut(b);
        (&mut lo[a], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(a);
        (&mut hi[0], &mut lo[b])
    }
}

/// Samples `a`'s tokens from its step's `rows` in turn: the first row's, then, while the
/// token sampled is the guess the step ran after it, the next row's; `secs`, the step's
/// time where it ran this sequence alone (`Some(None)`: alone, but a warm-up); `Some` when
/// the request is finished.
fn step_rows<R, S>(
    a: &mut Active<'_, R>,
    rows: &[Vec<f32>],
    tokenizer: &ts_tokenizer::Tokenizer,
    seq: &SeqState<S>,
    secs: Option<Option<Duration>>,
    metrics: &Metrics,
) -> Option<Finish> {
    // The position of the token the first row follows (it ran in this step, the guesses after it).
    let first = seq.n_past - rows.len();
    let mut kept = 0;
    let mut finish = None;
    for (i, row) in rows.iter().enumerate() {
        finish = step_one(a, row, tokenizer, seq.n_ctx - (first + 1 + i), metrics);
        let guessed = a.guessing.as_ref().and_then(|g| g.guesses.get(i)) == Some(&a.next);
        if finish.is_some() || !guessed {
            break;
        }
        kept += 1;
    }
    if let Some(g) = &mut a.guessing {
        g.kept = kept;
        metrics.spec_accepted.fetch_add(kept as u64, Relaxed);
        match (g.guesses.len(), secs) {
            (_, None) => {}
            (0, Some(t)) => g.length.plain(t.map(|t| t.as_secs_f64())),
            (n, Some(t)) => g.length.checked(t.map(|t| t.as_secs_f64()), n, kept),
        }
    }
    finish
}

/// Samples `a`'s next token from `logits` and sends its text; `Some` when the
/// request is finished.
fn step_one<R>(
    a: &mut Active<'_, R>,
    logits: &[f32],
    tokenizer: &ts_tokenizer::Tokenizer,
    room: usize,
    metrics: &Metrics,
) -> Option<Finish> {
    let next = match a.decoding.next(logits, room) {
        Ok(n) => n,
        Err(e) => {
            let _ = a.events().send(Event::Error(e.to_string()));
            return Some(Finish::Stop);
        }
    };
    if let Some(token) = next.token
        && next.stop != Some(StopReason::EndOfGeneration)
    {
        metrics.completion_tokens.fetch_add(1, Relaxed);
        if let Some(top) = a.job.logprobs {
            // Rendered as the reply's text renders them, so that offsets line up.
            let special = a.job.special;
            a.pending.push(token_logprob(logits, token, top, |id| token_bytes(tokenizer, id, special)));
        }
        a.next = token;
    }
    let finish = next.stop.map(|s| match s {
        StopReason::EndOfGeneration | StopReason::Stop | StopReason::Caller => Finish::Stop,
        StopReason::Length | StopReason::ContextFull => Finish::Length,
    });
    if !next.text.is_empty() || (finish.is_some() && !a.pending.is_empty()) {
        let event = Event::Text { text: next.text, logprobs: std::mem::take(&mut a.pending) };
        if a.events().send(event).is_err() {
            return Some(Finish::Gone);
        }
    }
    finish
}

/// A token's bytes; control tokens' text only with `special`.
pub fn token_bytes(tokenizer: &ts_tokenizer::Tokenizer, id: u32, special: bool) -> Vec<u8> {
    tokenizer.token_to_piece(id, special).map(|p| p.into_owned()).unwrap_or_default()
}

/// `token`'s log-softmax in `logits` and the `top` largest, most likely first
/// (ties to the lower id); `piece` gives a token's bytes.
fn token_logprob(logits: &[f32], token: u32, top: usize, piece: impl Fn(u32) -> Vec<u8>) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let choice = |id: u32| TokenChoice { id, bytes: piece(id), logprob: (logits[id as usize] as f64 - log_z) as f32 };
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let top = top.min(logits.len());
    // Ranking the vocabulary only when alternatives are asked for.
    let mut ids: Vec<u32> = if top == 0 { Vec::new() } else { (0..logits.len() as u32).collect() };
    if top > 0 && top < ids.len() {
        ids.select_nth_unstable_by(top - 1, by_logit);
    }
    ids.truncate(top);
    ids.sort_unstable_by(by_logit);
    TokenLogprob { chosen: choice(token), top: ids.into_iter().map(choice).collect() }
}

fn finish_job<R>(a: &Active<'_, R>, finish: Finish, metrics: &Metrics) {
    let (job, id, generated) = (&a.job, &a.job.choices[a.choice].id, a.decoding.generated());
    if finish == Finish::Gone {
        metrics.cancelled.fetch_add(1, Relaxed);
        tracing::info!(id = %id, generated, "client went away; slot freed");
        return;
    }
    let decode = a.started.elapsed().saturating_sub(a.prefill_time);
    let queue = a.started.duration_since(job.received);
    tracing::info!(
        id = %id,
        prompt_tokens = job.prompt.len(),
        completion_tokens = generated,
        queue_ms = queue.as_millis() as u64,
        prefill_ms = a.prefill_time.as_millis() as u64,
        decode_tps = format!("{:.1}", generated as f64 / decode.as_secs_f64().max(1e-9)),
        finish = finish.as_str(),
        "request done"
    );
    metrics.requests_done.fetch_add(1, Relaxed);
    let done = Event::Done { finish, prompt_tokens: job.prompt.len(), completion_tokens: generated };
    let _ = a.events().send(done);
}

#[cfg(test)]
mod tests {
    use super::token_logprob;

    #[test]
    fn logprobs_are_a_log_softmax() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let piece = |id: u32| vec![b'a' + id as u8];
        let t = token_logprob(&logits, 4, 3, piece);
        assert!((t.chosen.logprob as f64 - (0.5 - z.ln())).abs() < 1e-6);
        assert_eq!(t.chosen.bytes, b"e");
        let ids: Vec<u32> = t.top.iter().map(|c| c.id).collect();
        assert_eq!(ids, [1, 3, 0], "most likely first, ties to the lower id");
        assert!((t.top[0].logprob as f64 - (3.0 - z.ln())).abs() < 1e-6);
        assert_eq!(token_logprob(&logits, 0, 0, piece).top.len(), 0);
        assert_eq!(token_logprob(&logits, 0, 9, piece).top.len(), 5);
    }
}
