//! The batching loop: one thread owns the sequences. Each iteration admits
//! waiting requests into free slots, then runs one forward step holding a row
//! for every sequence that is generating and, up to a budget of rows, the
//! next pieces of prompts still being read, so each weight (and each expert)
//! a step needs is read once for all of them and a new prompt does not stall
//! the replies already streaming.

use crate::metrics::Metrics;
use rayon::prelude::*;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use ts_engine::sampler::{Sampler, SamplerConfig};
use ts_engine::session::Engine;
use ts_model::{Backend, Row, SeqState};

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

/// A request, validated and tokenized by its handler.
pub struct Job {
    pub id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// Decode control tokens as text (gpt-oss's harmony markers).
    pub special: bool,
    /// Report each generated token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Report the prompt tokens' log-probabilities too (with `logprobs`
    /// alternatives): every prompt row is run with logits, none reused.
    pub score_prompt: bool,
    pub events: UnboundedSender<Event>,
    pub received: Instant,
}

/// A request being generated.
struct Active<'a> {
    job: Job,
    slot: usize,
    sampler: Sampler,
    decoder: ts_tokenizer::StreamDecoder<'a>,
    /// Prompt tokens already in the cache; generation starts once all are.
    prompt_done: usize,
    /// The token to run next (once generating).
    next: u32,
    generated: usize,
    /// Text decoded but held back: it could be the start of a stop sequence.
    held: String,
    /// Log-probabilities of tokens whose text has not been sent yet.
    pending: Vec<TokenLogprob>,
    prefill_time: Duration,
    started: Instant,
}

/// Rows one forward step takes at most (decode rows first, then prompt pieces);
/// also the chunk the sequences' sliding-window rings are sized for.
const STEP_ROWS: usize = 512;

/// Prompt rows per step of a request that scores its prompt (each row's logits
/// are a vocabulary of floats: 64 rows of Gemma's 262k are 67 MB).
const SCORED_ROWS: usize = 64;

/// Runs until the job channel closes.
/// With `prompt_cache`, a request whose prompt starts like what a free slot's
/// cache holds reuses those positions instead of reading them again.
pub fn run<B: Backend>(
    engine: &Engine<B>,
    jobs: Receiver<Job>,
    slots: usize,
    n_ctx: usize,
    prompt_cache: bool,
    metrics: Arc<Metrics>,
) {
    let mut seqs: Vec<SeqState<B::Kv>> = Vec::with_capacity(slots);
    for _ in 0..slots {
        match engine.new_sequence(n_ctx) {
            Ok(s) => seqs.push(s),
            Err(e) => {
                tracing::error!("cannot allocate the KV cache of slot {}: {e}", seqs.len());
                break;
            }
        }
    }
    let slots = seqs.len();
    let mut free: Vec<usize> = (0..slots).rev().collect();
    // Per slot, the tokens whose keys and values its cache holds (positions 0..n_past): with
    // --prompt-cache a request whose prompt starts the same way reuses them (a chat's earlier
    // turns, a shared system prompt). Off by default: 8-bit activations make the reused
    // positions' numbers depend on how they were batched, so the same seed could sample
    // differently depending on what a slot held.
    let mut history: Vec<Vec<u32>> = vec![Vec::new(); slots];
    // A sliding-window layer's ring keeps only the last window + 511 positions: rewinding further
    // than that past its newest could leave old positions overwritten, so such models reuse less.
    let sliding = engine.model.cfg.layers.iter().any(|l| l.sliding_window.is_some());
    let mut active: Vec<Active<'_>> = Vec::new();
    let mut scratch = engine.scratch();
    let tokenizer = match engine.tokenizer() {
        Ok(t) => t,
        Err(e) => {
            tracing::error!("{e}");
            return;
        }
    };
    loop {
        // Admit waiting jobs while slots are free; block only when idle.
        while !free.is_empty() {
            let job = if active.is_empty() {
                match jobs.recv() {
                    Ok(j) => j,
                    Err(_) => return,
                }
            } else {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            };
            metrics.queued.fetch_sub(1, Relaxed);
            if job.events.is_closed() {
                metrics.cancelled.fetch_add(1, Relaxed);
                tracing::info!(id = %job.id, "client went away before its turn");
                continue;
            }
            let mut sampler = match Sampler::new(job.sampler.clone()) {
                Ok(s) => s,
                Err(e) => {
                    let _ = job.events.send(Event::Error(e.to_string()));
                    continue;
                }
            };
            for &t in &job.prompt {
                sampler.accept(t);
            }
            // The free slot whose cache shares the longest start with this prompt (at least
            // one prompt token is run, for its logits).
            let (pick, reuse) = free
                .iter()
                .enumerate()
                .map(|(i, &s)| {
                    let h = &history[s];
                    let mut n = h.iter().zip(&job.prompt).take_while(|(a, b)| a == b).count();
                    n = n.min(job.prompt.len() - 1);
                    if !prompt_cache || job.score_prompt || (sliding && h.len() - n > 256) {
                        n = 0;
                    }
                    (i, n)
                })
                .max_by_key(|&(i, n)| (n, i))
                .expect("a free slot");
            let slot = free.remove(pick);
            history[slot].truncate(reuse);
            seqs[slot].clear();
            seqs[slot].n_past = reuse;
            metrics.prompt_tokens_cached.fetch_add(reuse as u64, Relaxed);
            metrics.busy.fetch_add(1, Relaxed);
            active.push(Active {
                decoder: tokenizer.stream_decoder(job.special),
                job,
                slot,
                sampler,
                prompt_done: reuse,
                next: 0,
                generated: 0,
                held: String::new(),
                pending: Vec::new(),
                prefill_time: Duration::ZERO,
                started: Instant::now(),
            });
        }
        active.retain_mut(|a| {
            let keep = !a.job.events.is_closed();
            if !keep {
                metrics.cancelled.fetch_add(1, Relaxed);
                metrics.busy.fetch_sub(1, Relaxed);
                tracing::info!(id = %a.job.id, generated = a.generated, "client went away; slot freed");
                free.push(a.slot);
            }
            keep
        });
        if active.is_empty() {
            continue;
        }

        // One step: a row for each generating sequence, then prompt pieces up to the budget.
        let t = Instant::now();
        let mut rows: Vec<Row> = Vec::new();
        // Per row with logits: its request, and the prompt position it scores (a prompt row
        // before the last, for a request scoring its prompt) or None (the row to sample from).
        let mut wants: Vec<(usize, Option<usize>)> = Vec::new();
        for (i, a) in active.iter().enumerate() {
            if a.prompt_done == a.job.prompt.len() {
                rows.push(Row { token: a.next, pos: seqs[a.slot].n_past, seq: i, logits: true });
                wants.push((i, None));
            }
        }
        let decode_rows = rows.len();
        let mut budget = STEP_ROWS.saturating_sub(rows.len()).max(1);
        let mut prompt_rows = 0;
        for (i, a) in active.iter_mut().enumerate() {
            let left = a.job.prompt.len() - a.prompt_done;
            if left == 0 || budget == 0 {
                continue;
            }
            // A request scoring its prompt gets logits for every row: fewer rows per step.
            let n = left.min(budget).min(if a.job.score_prompt { SCORED_ROWS } else { usize::MAX });
            for j in 0..n {
                let last = j + 1 == n && n == left;
                let pos = a.prompt_done + j;
                let score = a.job.score_prompt && !last;
                rows.push(Row { token: a.job.prompt[pos], pos, seq: i, logits: last || score });
                if last {
                    wants.push((i, None));
                } else if score {
                    wants.push((i, Some(pos)));
                }
            }
            a.prompt_done += n;
            budget -= n;
            prompt_rows += n;
        }
        let result = {
            let mut by_slot: Vec<Option<&mut SeqState<B::Kv>>> = seqs.iter_mut().map(Some).collect();
            let mut step: Vec<&mut SeqState<B::Kv>> =
                active.iter().map(|a| by_slot[a.slot].take().expect("one sequence per slot")).collect();
            // A panic in a step (a bug) ends the requests in it, not the server.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                engine.install(|| engine.model.forward(&rows, &mut step, &mut scratch))
            }))
            .unwrap_or_else(|p| {
                let msg =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                Err(ts_model::ModelError::Compute(format!("internal error: {}", msg.unwrap_or_default())))
            })
        };
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                // A failed step leaves the caches suspect: end every request in it.
                for a in active.drain(..) {
                    let _ = a.job.events.send(Event::Error(format!("generation failed: {e}")));
                    history[a.slot].clear();
                    free.push(a.slot);
                    metrics.busy.fetch_sub(1, Relaxed);
                }
                metrics.errors.fetch_add(1, Relaxed);
                continue;
            }
        };
        for r in &rows {
            history[active[r.seq].slot].push(r.token);
        }
        metrics.prompt_tokens.fetch_add(prompt_rows as u64, Relaxed);
        if decode_rows > 0 {
            metrics.record_step(decode_rows, t.elapsed());
        }
        // Prompt rows scored: the log-probability of the token after each, sent in order.
        let scored: Vec<(usize, TokenLogprob)> = engine.install(|| {
            wants
                .par_iter()
                .zip(&logits)
                .filter_map(|(&(i, pos), l)| {
                    let (job, pos) = (&active[i].job, pos?);
                    // Prompt pieces show control tokens, as the prompt's text holds their markers.
                    let piece = |id| token_bytes(tokenizer, id, true);
                    Some((i, token_logprob(l, job.prompt[pos + 1], job.logprobs.unwrap_or(0), piece)))
                })
                .collect()
        });
        for group in scored.chunk_by(|a, b| a.0 == b.0) {
            let entries = group.iter().map(|(_, t)| t.clone()).collect();
            let _ = active[group[0].0].job.events.send(Event::Prompt(entries));
        }
        // Sample every row that has logits, in parallel (each touches only its own sequence).
        let mut row_of: Vec<Option<&Vec<f32>>> = vec![None; active.len()];
        for (&(i, pos), l) in wants.iter().zip(&logits) {
            if pos.is_none() {
                row_of[i] = Some(l);
            }
        }
        let seqs_ref = &seqs;
        let metrics_ref = &metrics;
        let mut finished: Vec<(usize, Finish)> = engine.install(|| {
            active
                .par_iter_mut()
                .zip(row_of.par_iter())
                .enumerate()
                .filter_map(|(i, (a, l))| {
                    let l = (*l)?;
                    if a.generated == 0 && a.prefill_time.is_zero() {
                        a.prefill_time = a.started.elapsed();
                    }
                    step_one(a, l, tokenizer, &seqs_ref[a.slot], metrics_ref).map(|f| (i, f))
                })
                .collect()
        });
        // Highest index first, so the indices still to remove stay valid.
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, finish) in finished {
            let a = active.remove(i);
            finish_job(a.job, finish, a.generated, a.prefill_time, a.started, &metrics);
            free.push(a.slot);
            metrics.busy.fetch_sub(1, Relaxed);
        }
    }
}

/// Samples `a`'s next token from `logits` and sends its text; `Some` when the
/// request is finished.
fn step_one(
    a: &mut Active<'_>,
    logits: &[f32],
    tokenizer: &ts_tokenizer::Tokenizer,
    seq: &SeqState<impl Send + Sync>,
    metrics: &Metrics,
) -> Option<Finish> {
    if a.job.max_tokens == 0 {
        // A prompt scored, nothing to generate.
        return Some(Finish::Length);
    }
    let token = match a.sampler.try_sample(logits) {
        Ok(t) => t,
        Err(e) => {
            let _ = a.job.events.send(Event::Error(e.to_string()));
            return Some(Finish::Stop);
        }
    };
    a.sampler.accept(token);
    if tokenizer.is_eog(token) {
        flush(a);
        return Some(Finish::Stop);
    }
    if let Some(top) = a.job.logprobs {
        // Rendered as the reply's text renders them, so that offsets line up.
        let special = a.job.special;
        a.pending.push(token_logprob(logits, token, top, |id| token_bytes(tokenizer, id, special)));
    }
    a.generated += 1;
    metrics.completion_tokens.fetch_add(1, Relaxed);
    a.next = token;
    let text = a.decoder.push(token).unwrap_or_default();
    a.held.push_str(&text);
    // A stop sequence ends the text before it.
    if let Some(cut) = a.job.stop.iter().filter_map(|s| a.held.find(s.as_str())).min() {
        a.held.truncate(cut);
        flush(a);
        return Some(Finish::Stop);
    }
    // Hold back a tail that could still grow into a stop sequence.
    let keep = a.job.stop.iter().map(|s| longest_prefix_suffix(&a.held, s)).max().unwrap_or(0);
    let cut = a.held.len() - keep;
    if cut > 0 {
        let text: String = a.held.drain(..cut).collect();
        if a.job.events.send(Event::Text { text, logprobs: std::mem::take(&mut a.pending) }).is_err() {
            return Some(Finish::Gone);
        }
    }
    if a.generated >= a.job.max_tokens || seq.n_past + 1 >= seq.n_ctx {
        a.held.push_str(&a.decoder.finish());
        flush(a);
        return Some(Finish::Length);
    }
    None
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`, on a char boundary.
fn longest_prefix_suffix(text: &str, stop: &str) -> usize {
    let max = stop.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && stop.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

fn flush(a: &mut Active<'_>) {
    if !a.held.is_empty() || !a.pending.is_empty() {
        let (text, logprobs) = (std::mem::take(&mut a.held), std::mem::take(&mut a.pending));
        let _ = a.job.events.send(Event::Text { text, logprobs });
    }
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

fn finish_job(job: Job, finish: Finish, generated: usize, prefill: Duration, started: Instant, metrics: &Metrics) {
    if finish == Finish::Gone {
        metrics.cancelled.fetch_add(1, Relaxed);
        tracing::info!(id = %job.id, generated, "client went away; slot freed");
        return;
    }
    let decode = started.elapsed().saturating_sub(prefill);
    let queue = started.duration_since(job.received);
    tracing::info!(
        id = %job.id,
        prompt_tokens = job.prompt.len(),
        completion_tokens = generated,
        queue_ms = queue.as_millis() as u64,
        prefill_ms = prefill.as_millis() as u64,
        decode_tps = format!("{:.1}", generated as f64 / decode.as_secs_f64().max(1e-9)),
        finish = finish.as_str(),
        "request done"
    );
    metrics.requests_done.fetch_add(1, Relaxed);
    let _ = job.events.send(Event::Done { finish, prompt_tokens: job.prompt.len(), completion_tokens: generated });
}

#[cfg(test)]
mod tests {
    use super::{longest_prefix_suffix, token_logprob};

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

    #[test]
    fn held_back_tail() {
        assert_eq!(longest_prefix_suffix("hello wor", "world"), 3);
        assert_eq!(longest_prefix_suffix("hello", "xyz"), 0);
        assert_eq!(longest_prefix_suffix("ab", "abc"), 2);
        assert_eq!(longest_prefix_suffix("abc", "abc"), 0);
        assert_eq!(longest_prefix_suffix("xaba", "abab"), 3);
    }
}
