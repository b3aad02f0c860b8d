//! Speculative decoding's guessers. A [`Drafter`] guesses the tokens after a
//! context; [`crate::session::Engine::decode`] checks every guess in one
//! forward step of the target (one row per guess) and keeps the run the target
//! itself samples. Both drafters here guess deterministically (text copied from
//! the context, or a draft model's most likely token), so keeping a guess only
//! when the target's own sample equals it leaves the output distribution the
//! target's: Leviathan et al.'s acceptance rule with a one-hot draft distribution.

use crate::decode::{Logits, Piece};
use crate::session::{Engine, EngineError};
use ts_model::{Backend, Row, SeqState};
use ts_tokenizer::Tokenizer;

/// How many tokens to guess per step (llama.cpp's `--draft-max`, `--draft-min`; a draft
/// model's `--draft-p-min` is its own, [`ModelDrafter::new`]).
#[derive(Clone, Debug)]
pub struct SpecOptions {
    /// Most guesses per step.
    pub draft_max: usize,
    /// Fewer guesses than this are not checked (a plain one-token step instead).
    pub draft_min: usize,
    /// Whether how many guesses a step checks follows what they cost and how many are kept
    /// ([`DraftLength`]: none where guessing does not pay); else up to `draft_max` every step,
    /// as llama.cpp does (`--draft-fixed`).
    pub adapt: bool,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions { draft_max: 16, draft_min: 0, adapt: true }
    }
}

impl SpecOptions {
    /// How many of up to `max` guesses to check now, after what `length` learnt.
    pub fn limit(&self, length: &DraftLength, max: usize) -> usize {
        let max = max.min(self.draft_max);
        if self.adapt { length.limit(max) } else { max }
    }
}

/// llama.cpp's default `--draft-p-min`.
pub const DEFAULT_P_MIN: f32 = 0.75;

/// The number of guesses worth checking, learnt as the generation goes: a plain step's time
/// `t` (from the second timed plain step: the first warms the model up), the extra time per
/// checked guess and the fraction `a` kept (moving averages) give `(1 - a^(n+1)) / (1 - a)`
/// tokens in `t + c n` seconds for n guesses; the best n is used, 0 when guessing does not pay.
/// Then a generation checks at its start (where a draft model has nothing to catch up on) and
/// probes after [`DraftLength::PROBE`] plain steps where its catching up can pay
/// ([`DraftLength::set_read_secs`]), each failed probe waiting at least twice as long (up to
/// [`DraftLength::MAX_PROBE`]), at most [`DraftLength::GIVE_UP`] a generation. Steps that ran
/// to be recorded ([`ts_model::Backend::warm_ups`]) give no time. The tokens and seconds the
/// checks really gave are kept too, since a draft model's checks pay a fixed part the per-guess
/// price misses (the step reading the last check's tokens, the step that fell below
/// `--draft-p-min`): guessing stops while they give fewer tokens a second than plain steps.
#[derive(Clone, Debug)]
pub struct DraftLength {
    plain_secs: Option<f64>,
    plain_samples: usize,
    secs_per_guess: f64,
    kept: f64,
    /// What a guess costs at least, measured ahead of the generation: a draft model's one-row
    /// step ([`Drafter::step_secs`]; 0 where unknown), and each recorded kind of checking step
    /// (the most guesses it holds, its replayed time beyond a replayed plain step's:
    /// [`DraftLength::set_checks`], from [`crate::session::Engine::warm_up_steps`]; empty where
    /// steps are not recorded).
    draft_step_secs: f64,
    check_extra: Vec<(usize, f64)>,
    /// Moving averages over timed checks of the tokens each gave (guesses kept and the
    /// target's own) and of its seconds; `timed_checks` of them so far.
    check_tokens: f64,
    check_secs: f64,
    timed_checks: usize,
    plain_since_check: usize,
    /// Plain steps before the next check while guessing does not pay.
    probe_every: usize,
    /// Probes in a row of this generation that found guessing still does not pay: after
    /// [`DraftLength::GIVE_UP`] no more (each costs a check and the draft's catching up).
    failed_probes: usize,
    /// Whether this generation has yet to check once: a check at its start costs no catching
    /// up (a draft model has just read the prompt), so it is made even where the prior says
    /// guessing does not pay, to learn how many guesses are kept.
    start_probe: bool,
    /// What a draft model pays a token to catch up ([`Drafter::read_secs`]; 0 where unknown or
    /// nothing is read): a probe after w plain steps costs w times this, so where it exceeds
    /// [`DraftLength::PROBE_SHARE`] of a plain step no wait amortizes a probe.
    read_secs: f64,
}

impl Default for DraftLength {
    fn default() -> Self {
        // Optimistic once a plain step is measured: guesses cost nothing and half are kept.
        DraftLength {
            plain_secs: None,
            plain_samples: 0,
            secs_per_guess: 0.0,
            kept: 0.5,
            draft_step_secs: 0.0,
            check_extra: Vec::new(),
            check_tokens: 0.0,
            check_secs: 0.0,
            timed_checks: 0,
            plain_since_check: 0,
            probe_every: Self::PROBE,
            failed_probes: 0,
            start_probe: true,
            read_secs: 0.0,
        }
    }
}

impl DraftLength {
    /// Plain steps before the first check once guessing does not pay.
    pub const PROBE: usize = 16;
    /// The most plain steps between two checks.
    pub const MAX_PROBE: usize = 1024;
    /// A probe that finds no change waits at least its loss over this share of a plain step
    /// (aiming at probes losing no more than this share of the plain steps' time between
    /// them; a probe's loss includes catching up on those steps' tokens, so a long wait can
    /// still lose more, and the wait then grows to [`DraftLength::MAX_PROBE`]).
    const PROBE_SHARE: f64 = 0.02;
    /// Probes in a row that find no change before a generation stops probing.
    pub const GIVE_UP: usize = 3;
    /// The fraction of guesses kept from which a probe that does not pay is the last.
    const KEPT_ENOUGH: f64 = 0.9;
    /// Timed checks before their own rate is weighed against plain steps'.
    const JUDGED_AFTER: usize = 2;
    /// How much faster than plain steps checks must give tokens to go on.
    const MARGIN: f64 = 0.05;
    const WEIGHT: f64 = 0.25;

    /// How many of up to `max` guesses to check now.
    pub fn limit(&self, max: usize) -> usize {
        // Without a plain step's time no guess can be weighed (a drafter that always
        // guesses would never give one); the first is a warm-up.
        let Some(t) = self.plain_secs.filter(|_| self.plain_samples >= 2) else { return 0 };
        if self.never_pays().is_some() {
            return 0;
        }
        let best = (0..=max).max_by(|&x, &y| self.rate(t, x).total_cmp(&self.rate(t, y))).unwrap_or(0);
        let now = if self.checks_pay(t) { best } else { 0 };
        let waited = self.plain_since_check >= self.probe_every && self.read_secs <= Self::PROBE_SHARE * t;
        let probe = (self.start_probe || waited) && self.failed_probes < Self::GIVE_UP;
        if now == 0 && probe { best.max(max.min(2)) } else { now }
    }

    /// Whether the timed checks so far gave at least [`DraftLength::MARGIN`] more tokens a
    /// second than plain steps of `t` seconds (true until [`DraftLength::JUDGED_AFTER`] of
    /// them): checks that only break even are noise's to win or lose, and each return to
    /// guessing after plain steps costs the draft's catching up.
    fn checks_pay(&self, t: f64) -> bool {
        self.timed_checks < Self::JUDGED_AFTER || self.check_tokens * t > self.check_secs * (1.0 + Self::MARGIN)
    }

    /// Where even guesses that are all kept cannot pay by [`DraftLength::MARGIN`]: n guesses give
    /// n + 1 tokens in n draft steps and a check of n + 1 rows, against n + 1 plain steps of `t`.
    /// With each kind of check's measured time, every kind is weighed (its most guesses);
    /// without (the CPU), a guess costs at least a draft step and a checked row. Gives the
    /// least a guess costs and the plain step's time; then no check runs, not even a probe.
    pub fn never_pays(&self) -> Option<(f64, f64)> {
        let t = self.plain_secs.filter(|_| self.plain_samples >= 2)?;
        let d = self.draft_step_secs;
        if d <= 0.0 {
            return None;
        }
        if self.check_extra.is_empty() {
            // n guesses in t + n d pay for some n only while d (1 + MARGIN) < t.
            return (d * (1.0 + Self::MARGIN) >= t).then_some((d, t));
        }
        let pays = |n: f64, cost: f64| (n + 1.0) * t > (1.0 + Self::MARGIN) * cost;
        let kinds = self.check_extra.iter().map(|&(n, extra)| (n as f64, extra));
        if kinds.clone().any(|(n, extra)| pays(n, n * d + t + extra)) {
            return None;
        }
        let floor = kinds.map(|(n, extra)| d + extra / n).fold(f64::INFINITY, f64::min);
        Some((floor, t))
    }

    /// A draft model's one-row step takes `secs` (measured where it replays).
    pub fn set_draft_step(&mut self, secs: f64) {
        self.draft_step_secs = secs;
    }

    /// A draft model reads `secs` a token when it catches up ([`Drafter::read_secs`]).
    pub fn set_read_secs(&mut self, secs: f64) {
        self.read_secs = secs;
    }

    /// What `drafter` measured of its costs so far ([`Drafter::step_secs`], [`Drafter::read_secs`]).
    pub fn learn_costs(&mut self, drafter: &dyn Drafter) {
        drafter.step_secs().inspect(|&secs| self.set_draft_step(secs));
        drafter.read_secs().inspect(|&secs| self.set_read_secs(secs));
    }

    /// A replayed plain step took `plain` seconds and each recorded kind of checking step
    /// `(rows, secs)` (rows > 1, fewest first) for up to `max_guesses` guesses: what a checked
    /// row costs beyond a plain step. A kind holds at most `rows - 1` guesses, and no more
    /// than `max_guesses` (a padded kind may have more rows).
    pub fn set_checks(&mut self, plain: f64, checks: &[(usize, f64)], max_guesses: usize) {
        let guesses = |rows: usize| (rows - 1).min(max_guesses).max(1);
        self.check_extra =
            checks.iter().filter(|c| c.0 > 1).map(|&(rows, secs)| (guesses(rows), (secs - plain).max(0.0))).collect();
    }

    /// A checked row's time beyond a plain step's, from the smallest kind of check (0 unknown).
    fn row_secs(&self) -> f64 {
        self.check_extra.first().map_or(0.0, |&(n, extra)| extra / n as f64)
    }

    /// What a finished generation hands the next: all it measured (the plain steps since the
    /// last check too, so that short requests still reach a probe), its probes' count reset.
    pub fn for_next_generation(&self) -> DraftLength {
        DraftLength { failed_probes: 0, start_probe: true, ..self.clone() }
    }

    /// The prior again, keeping only what was measured ahead of any generation (the draft's
    /// step, the kinds of check).
    pub fn forget(&self) -> DraftLength {
        DraftLength {
            draft_step_secs: self.draft_step_secs,
            check_extra: self.check_extra.clone(),
            read_secs: self.read_secs,
            ..DraftLength::default()
        }
    }

    /// Expected tokens per second with `n` guesses a step, a plain step taking `t`.
    fn rate(&self, t: f64, n: usize) -> f64 {
        let a = self.kept.clamp(0.0, 0.999);
        let per_guess = self.secs_per_guess.max(self.draft_step_secs + self.row_secs());
        (1.0 - a.powi(n as i32 + 1)) / (1.0 - a) / (t + per_guess * n as f64)
    }

    /// A plain step took `secs` (None: a warm-up, not timed).
    pub fn plain(&mut self, secs: Option<f64>) {
        // A plain step once `t` was known: the start's check was asked for and the drafter
        // had no guess (below its p-min); the next chance is a probe.
        if self.plain_samples >= 2 {
            self.start_probe = false;
        }
        self.plain_since_check += 1;
        let Some(secs) = secs else { return };
        self.plain_secs = match self.plain_secs {
            Some(t) if self.plain_samples >= 2 => Some(t + Self::WEIGHT * (secs - t)),
            _ => Some(secs),
        };
        self.plain_samples += 1;
    }

    /// A checking step of `guesses` guesses took `secs` (None: a warm-up, not timed) and kept
    /// `kept`.
    pub fn checked(&mut self, secs: Option<f64>, guesses: usize, kept: usize) {
        // A check after a long run of plain steps or the generation's first (a probe, or a
        // drafter that had nothing).
        let probed = self.start_probe || self.plain_since_check >= self.probe_every;
        self.plain_since_check = 0;
        self.start_probe = false;
        if guesses == 0 {
            return;
        }
        let frac = kept as f64 / guesses as f64;
        self.kept += Self::WEIGHT * (frac - self.kept);
        if let Some(secs) = secs {
            let tokens = (kept + 1) as f64;
            if self.timed_checks == 0 {
                (self.check_tokens, self.check_secs) = (tokens, secs);
            } else {
                self.check_tokens += Self::WEIGHT * (tokens - self.check_tokens);
                self.check_secs += Self::WEIGHT * (secs - self.check_secs);
            }
            self.timed_checks += 1;
        }
        if let Some(t) = self.plain_secs {
            if let Some(secs) = secs {
                let per = ((secs - t) / guesses as f64).max(0.0);
                self.secs_per_guess += Self::WEIGHT * (per - self.secs_per_guess);
            }
            let pays = self.checks_pay(t) && (1..=2).any(|n| self.rate(t, n) > self.rate(t, 0));
            if pays {
                self.probe_every = Self::PROBE;
                self.failed_probes = 0;
            } else if probed {
                // What the probe lost against plain steps for its tokens.
                let lost = secs.map_or(0.0, |secs| secs - (kept + 1) as f64 * t).max(0.0);
                let earned = (lost / (Self::PROBE_SHARE * t)).ceil() as usize;
                self.probe_every = (2 * self.probe_every).max(earned).min(Self::MAX_PROBE);
                // A probe looks for more guesses kept; where nearly all already are and checks
                // still lose, what they cost is the cause, which no probe changes.
                self.failed_probes =
                    if self.kept >= Self::KEPT_ENOUGH { Self::GIVE_UP } else { self.failed_probes + 1 };
            }
        }
    }
}

/// Guesses the tokens that follow a context.
pub trait Drafter {
    /// Up to `max` guesses of the tokens after `context` (every token of the text so far).
    fn draft(&mut self, context: &[u32], max: usize) -> Result<Vec<u32>, EngineError>;

    /// Reads `context` ahead of guessing after it: the prompt before generation starts (a
    /// draft model's prompt is part of the prompt's time), and the tokens of plain steps
    /// before a check (no check's guesses pay for them).
    fn catch_up(&mut self, context: &[u32]) -> Result<(), EngineError> {
        let _ = context;
        Ok(())
    }

    /// Steps of the drafter's own model so far that ran to be recorded
    /// ([`ts_model::Backend::warm_ups`]).
    fn warm_ups(&self) -> u64 {
        0
    }

    /// A draft model's one-row step time, measured where it replays (none before its
    /// [`Drafter::catch_up`] on a prompt; none for drafters without a model).
    fn step_secs(&self) -> Option<f64> {
        None
    }

    /// What a draft model pays a token to catch up on plain steps: as its last catching up did,
    /// else at least a prompt token's time and, where steps are recorded, a recorded catching-up
    /// step's row (none before its [`Drafter::catch_up`] on a prompt; none for drafters that
    /// read nothing).
    fn read_secs(&self) -> Option<f64> {
        None
    }

    /// Whether the drafter reads the target's final-normed hidden states (an MTP head): the
    /// target's steps then hand them to [`Drafter::observe`] (they cost nothing otherwise).
    fn wants_hidden(&self) -> bool {
        false
    }

    /// The target ran `tokens` at positions `first..` of the sequence, with final-normed
    /// hidden states `hidden` `[tokens.len()][n_embd]`: positions from `first` on that an
    /// earlier call gave are replaced (rows of guesses not kept, run again).
    fn observe(&mut self, first: usize, tokens: &[u32], hidden: &[f32]) {
        let _ = (first, tokens, hidden);
    }
}

/// Before guessing up to `max` tokens after `context` (ending with the token about to run)
/// in a step that follows a plain one (`after_plain`), a drafter that skipped the plain steps'
/// tokens reads them ([`Drafter::catch_up`]): part of the check's time, the price of
/// returning to guessing.
pub fn catch_up_after_plain(
    drafter: &mut dyn Drafter,
    context: &[u32],
    max: usize,
    after_plain: bool,
) -> Result<(), EngineError> {
    if !after_plain || max == 0 || context.len() < 2 {
        return Ok(());
    }
    drafter.catch_up(&context[..context.len() - 1])
}

/// Prompt lookup: the tokens that followed the latest earlier occurrence of the
/// context's last `n` tokens, for the longest `n` from `max_n` down to `min_n`
/// that occurs (llama.cpp's `--spec-type ngram-simple` and prompt lookup decoding).
#[derive(Clone, Debug)]
pub struct NgramDrafter {
    pub min_n: usize,
    pub max_n: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter { min_n: 2, max_n: 4 }
    }
}

impl Drafter for NgramDrafter {
    fn draft(&mut self, context: &[u32], max: usize) -> Result<Vec<u32>, EngineError> {
        let len = context.len();
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if n >= len {
                continue;
            }
            let tail = &context[len - n..];
            // The latest earlier occurrence (it must end before the tail itself starts to end).
            if let Some(start) = (0..len - n).rev().find(|&i| &context[i..i + n] == tail) {
                let from = start + n;
                return Ok(context[from..(from + max).min(len)].to_vec());
            }
        }
        Ok(Vec::new())
    }
}

/// A small model with the target's vocabulary guesses greedily, one token at a
/// time, keeping its own sequence in step with the context (what it has run
/// and the context share a prefix; the rest is rewound and run again).
pub struct ModelDrafter<'e, B: Backend> {
    engine: &'e Engine<B>,
    seq: SeqState<B::State>,
    /// The tokens `seq` holds.
    fed: Vec<u32>,
    p_min: f32,
    /// Its one-row step's time, replayed ([`Drafter::step_secs`]).
    step_secs: Option<f64>,
    /// What it pays a token to catch up ([`Drafter::read_secs`]).
    read_secs: Option<f64>,
    /// Its recorded step of [`ModelDrafter::CATCH_UP_ROWS`] rows, replayed, a row (where the
    /// backend records steps).
    chunk_secs: Option<f64>,
}

impl<'e, B: Backend> ModelDrafter<'e, B> {
    /// A drafter of `engine`'s model for contexts of up to `n_ctx` tokens, after
    /// checking that its vocabulary is the target's (`target`); it stops guessing at a
    /// token it gives less than `p_min` probability.
    /// Where the backend records steps, the draft's steps of 1 to [`ModelDrafter::CATCH_UP_ROWS`]
    /// rows are recorded first ([`Engine::warm_up_steps`]), so that neither its guesses nor its
    /// catching up run a step for the first time.
    pub fn new(engine: &'e Engine<B>, target: &Tokenizer, n_ctx: usize, p_min: f32) -> Result<Self, EngineError> {
        check_draft(engine, target)?;
        let mut seq = engine.new_sequence(n_ctx)?;
        engine.warm_up_steps(&mut seq, Self::CATCH_UP_ROWS - 1)?;
        let rows = Self::CATCH_UP_ROWS;
        let chunk_secs = match engine.model.backend.padded_rows(rows) == Some(rows) && rows <= n_ctx {
            true => engine.time_step_at_start(&mut seq, rows, Logits::Last, &mut engine.scratch())?,
            false => None,
        }
        .map(|secs| secs / rows as f64);
        Ok(ModelDrafter { engine, seq, fed: Vec::new(), p_min, step_secs: None, read_secs: None, chunk_secs })
    }

    /// The most rows of a step catching up on plain steps' tokens where the backend records
    /// steps of a few row counts: longer runs go in recorded steps of this many (on the H200
    /// the 0.5B draft's unrecorded steps of 16 to 64 rows took 9-19 ms, a third of the
    /// plain steps they followed).
    pub const CATCH_UP_ROWS: usize = 16;
    /// Recorded steps at most in one catching up; more tokens go in one prompt step.
    const CATCH_UP_CHUNKS: usize = 4;
}

/// Whether `engine`'s model has an MTP head to guess with (`--spec-mtp`), else an error naming the flag.
pub fn check_mtp<B: Backend>(engine: &Engine<B>) -> Result<(), EngineError> {
    if engine.model.weights.mtp.is_none() {
        return Err(EngineError::Invalid(format!(
            "--spec-mtp: this model has no multi-token-prediction layer ({}.nextn_predict_layers is {})",
            engine.model.cfg.arch.gguf_name(),
            engine.model.cfg.n_nextn
        )));
    }
    Ok(())
}

/// Whether `draft` can guess for a target of vocabulary `target`: no recurrent layers
/// (their state cannot be rewound) and the same vocabulary.
pub fn check_draft<B: Backend>(draft: &Engine<B>, target: &Tokenizer) -> Result<(), EngineError> {
    if draft.model.is_recurrent() {
        return Err(EngineError::Invalid(
            "--draft-model: a draft model with recurrent layers is not supported (its state cannot be rewound)".into(),
        ));
    }
    check_same_vocab(target, draft.tokenizer()?)
}

impl<B: Backend> ModelDrafter<'_, B> {
    /// Runs what the draft sequence lacks of `context` (the last token always, for its
    /// logits) and gives the last token's logits `[n_vocab]`.
    fn feed(&mut self, context: &[u32]) -> Result<Vec<f32>, EngineError> {
        // What the draft sequence holds that the context still has.
        let common = self.fed.iter().zip(context).take_while(|(a, b)| a == b).count().min(context.len() - 1);
        self.seq.n_past = common;
        self.fed.truncate(common);
        let logits = self.engine.prefill(&mut self.seq, &context[common..], false)?.pop().expect("one row of logits");
        self.fed.extend_from_slice(&context[common..]);
        Ok(logits)
    }
}

impl<B: Backend> Drafter for ModelDrafter<'_, B> {
    fn warm_ups(&self) -> u64 {
        self.engine.model.backend.warm_ups()
    }

    fn step_secs(&self) -> Option<f64> {
        self.step_secs
    }

    fn read_secs(&self) -> Option<f64> {
        self.read_secs
    }

    fn catch_up(&mut self, context: &[u32]) -> Result<(), EngineError> {
        if context.len() < 2 || context.len() >= self.seq.n_ctx {
            return Ok(());
        }
        let held = self.fed.iter().zip(context).take_while(|(a, b)| a == b).count();
        if held + 1 >= context.len() {
            // At most one token behind: the next guess reads it with the token after it.
            return Ok(());
        }
        if !self.fed.is_empty() {
            // Tokens of plain steps, in recorded steps where the backend records them; what
            // that cost a token is what the next probe's catching up will cost.
            let started = std::time::Instant::now();
            let rows = Self::CATCH_UP_ROWS;
            // A long run (a new prompt of a chat turn, a reused drafter's next request) reads
            // better as one prompt step.
            let long = context.len() - held > Self::CATCH_UP_CHUNKS * rows;
            if !long && self.engine.model.backend.padded_rows(rows) == Some(rows) {
                let mut at = held;
                while at + rows < context.len() {
                    self.feed(&context[..at + rows])?;
                    at += rows;
                }
            }
            self.feed(context)?;
            self.read_secs = Some(started.elapsed().as_secs_f64() / (context.len() - held) as f64);
            return Ok(());
        }
        // All but the last token as a prompt, the last as the one-row step every guess takes
        // with the pick of its guess, timed where it replays: what a guess costs at least. A
        // token caught up costs at least what a prompt's token did, and where the backend
        // records steps at least a recorded catching-up step's row.
        let (head, last) = context.split_at(context.len() - 1);
        let n = head.len();
        let read = std::time::Instant::now();
        self.feed(head)?;
        let prompt_secs = read.elapsed().as_secs_f64() / n as f64;
        self.read_secs = Some(prompt_secs.max(self.chunk_secs.unwrap_or(0.0)));
        let piece = Piece { tokens: last, logits: Logits::Last };
        let (engine, seq, mut scratch) = (self.engine, &mut self.seq, self.engine.scratch());
        self.step_secs = crate::session::replayed_secs(&engine.model.backend, || {
            seq.n_past = n;
            let rows = engine.step(&mut [&mut *seq], &[piece], &mut scratch)?;
            std::hint::black_box(top_probability(&rows[0][0]));
            Ok(())
        })?;
        self.fed.extend_from_slice(last);
        Ok(())
    }

    fn draft(&mut self, context: &[u32], max: usize) -> Result<Vec<u32>, EngineError> {
        let room = self.seq.n_ctx.saturating_sub(context.len());
        let max = max.min(room);
        if max == 0 || context.is_empty() {
            return Ok(Vec::new());
        }
        let mut logits = self.feed(context)?;
        let mut scratch = self.engine.scratch();
        let mut drafts = Vec::new();
        loop {
            let (token, p) = top_probability(&logits);
            if p < self.p_min {
                break;
            }
            drafts.push(token);
            if drafts.len() == max {
                break;
            }
            let piece = Piece { tokens: &[token], logits: Logits::Last };
            logits = self.engine.step(&mut [&mut self.seq], &[piece], &mut scratch)?.remove(0).remove(0);
            self.fed.push(token);
        }
        Ok(drafts)
    }
}

/// The target's own multi-token-prediction head guesses (`--spec-mtp`; docs/MTP.md): MTP row
/// p pairs the token at p + 1 with the target's final-normed hidden state at p, at position p
/// of the head's own cache. Each guess round first runs the rows the cache lacks up to the
/// newest (the kept tokens of the last check and the token about to run, with the target's
/// hidden states of that check), then chains greedy guesses one row at a time, each reading
/// the head's own normed output of the row before. Chained rows stay in the cache only until
/// the next round writes those positions again from the target's hidden states, so rows of
/// guesses the target rejected never remain. The target's hidden states come through
/// [`Drafter::observe`]; a position it never reported (a prompt read without them) leaves
/// the round without guesses.
pub struct MtpDrafter<'e, B: Backend> {
    engine: &'e Engine<B>,
    /// The head's cache ([`ts_model::Model::new_mtp_sequence`]).
    seq: SeqState<B::State>,
    scratch: B::Scratch,
    /// The token the target ran at each position `0..seen.len()`, and its hidden state there,
    /// `[seen.len()][n_embd]` (`u32::MAX` where none was reported).
    seen: Vec<u32>,
    hidden: Vec<f32>,
    /// The context whose rows the cache holds: row p for each p + 1 < `fed.len()`.
    fed: Vec<u32>,
    /// The logits the last guess was taken from, `[n_vocab]`.
    last_logits: Vec<f32>,
}

impl<'e, B: Backend> MtpDrafter<'e, B> {
    /// A drafter of `engine`'s MTP head for contexts of up to `n_ctx` tokens; an error naming
    /// `--spec-mtp` for a model without one.
    pub fn new(engine: &'e Engine<B>, n_ctx: usize) -> Result<Self, EngineError> {
        check_mtp(engine)?;
        let seq = engine.model.new_mtp_sequence(n_ctx)?;
        let (seen, hidden, fed, last_logits) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        Ok(MtpDrafter { engine, seq, scratch: engine.scratch(), seen, hidden, fed, last_logits })
    }

    /// The head's logits of the last guess it made, `[n_vocab]` (empty before any).
    pub fn last_logits(&self) -> &[f32] {
        &self.last_logits
    }

    /// One step of the head over `rows` with hidden inputs `hidden`.
    fn run(&mut self, rows: &[Row], hidden: &[f32]) -> Result<ts_model::MtpOutput, EngineError> {
        let (model, seq, scratch) = (&self.engine.model, &mut self.seq, &mut self.scratch);
        let mut go = || model.mtp_forward(rows, hidden, &mut [&mut *seq], scratch);
        let out = if model.backend.uses_thread_pool() { self.engine.install(go) } else { go() };
        Ok(out?)
    }
}

impl<B: Backend> Drafter for MtpDrafter<'_, B> {
    fn wants_hidden(&self) -> bool {
        true
    }

    fn observe(&mut self, first: usize, tokens: &[u32], hidden: &[f32]) {
        let e = self.engine.model.cfg.n_embd;
        if hidden.len() != tokens.len() * e {
            return;
        }
        // Later positions are replaced; positions never reported stay unusable.
        self.seen.resize(first, u32::MAX);
        self.hidden.resize(first * e, 0.0);
        self.seen.extend_from_slice(tokens);
        self.hidden.extend_from_slice(hidden);
    }

    fn draft(&mut self, context: &[u32], max: usize) -> Result<Vec<u32>, EngineError> {
        let len = context.len();
        if max == 0 || len < 2 {
            return Ok(Vec::new());
        }
        let e = self.engine.model.cfg.n_embd;
        // The newest row pairs the token about to run with the target's state before it.
        let newest = len - 2;
        let common = self.fed.iter().zip(context).take_while(|(a, b)| a == b).count();
        let from = common.saturating_sub(1).min(newest);
        if self.seen.len() <= newest || self.seen[from..=newest] != context[from..=newest] {
            return Ok(Vec::new());
        }
        // Guesses must fit the head's cache: row p is at position p.
        let max = max.min(self.seq.n_ctx.saturating_sub(newest + 1));
        if max == 0 {
            return Ok(Vec::new());
        }
        let chunk = self.engine.n_batch.max(1);
        let mut last = None;
        let mut p = from;
        while p <= newest {
            let end = (p + chunk).min(newest + 1);
            let rows: Vec<Row> =
                (p..end).map(|q| Row { token: context[q + 1], pos: q, seq: 0, logits: q == newest }).collect();
            let hidden = self.hidden[p * e..end * e].to_vec();
            last = Some(self.run(&rows, &hidden)?);
            p = end;
        }
        self.fed = context.to_vec();
        self.seq.n_past = newest + 1;
        let out = last.expect("at least the newest row ran");
        let mut logits = out.logits.into_iter().next().expect("the newest row's logits");
        let mut hidden = out.hidden[out.hidden.len() - e..].to_vec();
        let mut drafts = Vec::with_capacity(max);
        loop {
            let token = argmax(&logits);
            drafts.push(token);
            if drafts.len() == max {
                break;
            }
            let row = Row { token, pos: newest + drafts.len(), seq: 0, logits: true };
            let out = self.run(&[row], &hidden)?;
            logits = out.logits.into_iter().next().expect("the chained row's logits");
            hidden = out.hidden;
        }
        self.last_logits = logits;
        Ok(drafts)
    }
}

/// The most likely token of `logits` (the first of ties).
fn argmax(logits: &[f32]) -> u32 {
    ts_cpu::ops::argmax(logits).0 as u32
}

/// The most likely token of `logits` (the first of ties) and its softmax probability: 1 over
/// the sum of `e^(l - max)` (a draft model's every guess; 1.4 ms a 152k vocabulary term by term
/// in f64, 0.12 ms so).
fn top_probability(logits: &[f32]) -> (u32, f32) {
    let (best, max) = ts_cpu::ops::argmax(logits);
    (best as u32, (1.0 / ts_cpu::ops::sum_exp_shifted(logits, max)) as f32)
}

/// A draft model must give every token id the target's text (llama.cpp allows the two
/// vocabularies' sizes to differ by padding; ids past the shorter must not be guessed).
fn check_same_vocab(target: &Tokenizer, draft: &Tokenizer) -> Result<(), EngineError> {
    let (nt, nd) = (target.vocab_size(), draft.vocab_size());
    const PADDING: usize = 128;
    if nt.abs_diff(nd) > PADDING {
        return Err(EngineError::Invalid(format!(
            "--draft-model: its vocabulary has {nd} tokens, the target's {nt}: not the same vocabulary"
        )));
    }
    if target.model() != draft.model() || target.bos() != draft.bos() || target.eos() != draft.eos() {
        return Err(EngineError::Invalid(format!(
            "--draft-model: its tokenizer ({} , BOS {:?}, EOS {:?}) is not the target's ({}, BOS {:?}, EOS {:?})",
            draft.model(),
            draft.bos(),
            draft.eos(),
            target.model(),
            target.bos(),
            target.eos()
        )));
    }
    for id in 0..nt.min(nd) as u32 {
        if target.token_text(id)? != draft.token_text(id)? {
            return Err(EngineError::Invalid(format!(
                "--draft-model: token {id} is {:?} in the draft model and {:?} in the target: not the same vocabulary",
                draft.token_text(id)?,
                target.token_text(id)?
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_copies_what_followed_the_latest_match() {
        let mut d = NgramDrafter { min_n: 1, max_n: 3 };
        // "5 6 7" occurred twice; the later occurrence is followed by 9 1.
        let ctx = [5, 6, 7, 8, 1, 5, 6, 7, 9, 1, 2, 5, 6, 7];
        assert_eq!(d.draft(&ctx, 2).unwrap(), vec![9, 1]);
        assert_eq!(d.draft(&ctx, 10).unwrap(), vec![9, 1, 2, 5, 6, 7]);
        // Only the last token matches an earlier one: the 1-gram.
        assert_eq!(d.draft(&[4, 2, 3, 4], 2).unwrap(), vec![2, 3]);
        // No earlier occurrence at all.
        assert!(d.draft(&[1, 2, 3], 4).unwrap().is_empty());
        assert!(NgramDrafter { min_n: 2, max_n: 2 }.draft(&[4, 2, 3, 4], 2).unwrap().is_empty());
    }

    #[test]
    fn draft_length_follows_cost_and_acceptance() {
        let mut d = DraftLength::default();
        assert_eq!(d.limit(8), 0, "plain steps first, to measure them");
        d.plain(Some(0.300));
        assert_eq!(d.limit(8), 0, "the first one-row step is a warm-up");
        d.plain(Some(0.010));
        assert_eq!(d.limit(8), 8, "optimistic once it is measured");
        // Cheap guesses, nearly all kept: the longest.
        for _ in 0..20 {
            d.checked(Some(0.011), 8, 8);
        }
        assert_eq!(d.limit(8), 8);
        // Guesses that cost a plain step each and are never kept: none, then a probe.
        for _ in 0..20 {
            d.checked(Some(0.010 + 8.0 * 0.010), 8, 0);
        }
        assert_eq!(d.limit(8), 0);
        // A check after PROBE plain steps; each that finds no change at least doubles the
        // wait, and waits long enough that it lost at most 2% of the plain steps' time (this
        // one loses 20 ms, 2 plain steps: 100 steps); after GIVE_UP of them the generation
        // stops probing.
        let mut wait = DraftLength::PROBE;
        for _ in 0..DraftLength::GIVE_UP {
            for _ in 1..wait {
                d.plain(Some(0.010));
            }
            assert_eq!(d.limit(8), 0, "{wait} plain steps before the next check");
            d.plain(Some(0.010));
            assert_eq!(d.limit(8), 2, "a check after {wait}");
            d.checked(Some(0.010 + 2.0 * 0.010), 2, 0);
            wait = (2 * wait).clamp(100, DraftLength::MAX_PROBE);
        }
        for _ in 0..2 * DraftLength::MAX_PROBE {
            d.plain(Some(0.010));
            assert_eq!(d.limit(8), 0, "no probe after giving up");
        }
        // The next generation probes again: its plain steps since the last check carried over
        // (2 MAX_PROBE of them), at once; the wait learnt stays.
        let mut d = d.for_next_generation();
        assert_eq!(d.limit(8), 2, "the next generation's probe");
        let mut f = d.forget();
        f.plain(Some(0.010));
        f.plain(Some(0.010));
        assert_eq!(f.limit(8), 8, "forgotten: the prior again");
        // A check where guessing pays again: back to the longest, and to short waits.
        for _ in 0..20 {
            d.checked(Some(0.011), 2, 2);
        }
        assert_eq!(d.limit(8), 8);
    }

    #[test]
    fn a_draft_step_as_dear_as_a_plain_one_never_guesses() {
        // The H200 pair: the 0.5B draft's one-row step 1.7 ms, a checked row 0.4 ms beyond a
        // plain step, the 1.5B's plain step 1.8 ms: no check at all, not even probes.
        let mut d = DraftLength::default();
        d.set_draft_step(0.0017);
        d.set_checks(0.0018, &[(2, 0.0022)], 16);
        for _ in 0..4 * DraftLength::MAX_PROBE {
            d.plain(Some(0.0018));
            assert_eq!(d.limit(16), 0);
        }
        let (floor, t) = d.never_pays().expect("off");
        assert!((floor - 0.0021).abs() < 1e-9 && (t - 0.0018).abs() < 1e-9);
        // A draft a fifth of the target's step, rows nearly free: guessing from the start.
        let mut d = DraftLength::default();
        d.set_draft_step(0.0004);
        d.set_checks(0.0018, &[(2, 0.0019)], 16);
        d.plain(Some(0.0019));
        d.plain(Some(0.0018));
        assert!(d.never_pays().is_none());
        assert!(d.limit(16) > 0);
        // The H200 pair measured at 46b18d3 (--draft-fixed): the 0.5B's step 1.56 ms, the
        // 1.5B's plain step 2.1, a check of 17 rows (padded to 24) 17 ms: the long checks
        // cannot pay; a 2-row check of 2.3 ms would let one guess pay (2 tokens in 3.96 ms),
        // one of 2.5 ms would not.
        let mut d = DraftLength::default();
        d.set_draft_step(0.00156);
        d.set_checks(0.0021, &[(2, 0.0023), (4, 0.0045), (8, 0.0085), (16, 0.016), (24, 0.017)], 16);
        d.plain(Some(0.0021));
        d.plain(Some(0.0021));
        assert!(d.never_pays().is_none(), "one guess and a 2-row check of 2.3 ms could pay");
        d.set_checks(0.0021, &[(2, 0.0025), (4, 0.0045), (8, 0.0085), (16, 0.016), (24, 0.017)], 16);
        assert!(d.never_pays().is_some());
        assert_eq!(d.limit(16), 0);
    }

    #[test]
    fn a_slow_first_step_does_not_make_guesses_look_cheap() {
        // The H200 pair of 2026-12-03: plain steps 2.2 ms after a first that recorded the
        // step's graph, checks of 7 guesses 29 ms with 96% kept: plain steps pay more.
        let mut d = DraftLength::default();
        d.plain(Some(0.030));
        d.plain(Some(0.0022));
        for _ in 0..8 {
            d.checked(Some(0.029), 7, 7);
        }
        assert_eq!(d.limit(16), 0);
    }

    #[test]
    fn checks_that_give_less_than_plain_steps_stop() {
        // The H200 pair of 2026-12-03 (fifth session): plain steps 2.2 ms; a check's guesses
        // stop early at the draft's p-min (1 or 2 a check, all kept) and each costs the draft's
        // catching-up step and the step that stopped it: 6.6 ms for one guess, 8.5 for two,
        // while 16 guesses in 34 ms priced alone (about 2 ms a guess) look like they pay.
        let mut d = DraftLength::default();
        d.plain(Some(0.0023));
        d.plain(Some(0.0022));
        d.checked(Some(0.034), 16, 16);
        assert!(d.limit(16) > 0, "one check is not judged");
        for i in 0..4 {
            let (secs, n) = if i % 2 == 0 { (0.0066, 1) } else { (0.0085, 2) };
            d.checked(Some(secs), n, n);
        }
        assert_eq!(d.limit(16), 0, "checks gave fewer tokens a second than plain steps");
        // The probe after PROBE plain steps guesses as far as the model says, and a probe
        // that gives no more does not turn guessing on.
        for _ in 0..DraftLength::PROBE {
            d.plain(Some(0.0022));
        }
        assert!(d.limit(16) >= 2, "a probe");
        d.checked(Some(0.0066), 1, 1);
        assert_eq!(d.limit(16), 0);
        // Every guess was kept and checks still lose: no more probes this generation.
        for _ in 0..2 * DraftLength::MAX_PROBE {
            d.plain(Some(0.0022));
            assert_eq!(d.limit(16), 0, "a probe after checks that kept every guess");
        }
        // The next generation probes again (at once: its plain steps since the last check
        // carried over), and checks that give more (long runs of kept guesses) turn guessing
        // on again.
        let mut d = d.for_next_generation();
        assert!(d.limit(16) >= 2, "the next generation's probe");
        for _ in 0..12 {
            d.checked(Some(0.020), 10, 10);
        }
        assert!(d.limit(16) >= 8, "long runs kept: {}", d.limit(16));
    }

    /// The H200 pair at 6c6be3a after its first two plain steps: plain steps 2.05 ms, the 0.5B
    /// draft's step 1.1 ms, reading a token about 0.09 ms (its probes after 16 and 149 plain
    /// steps lost 6.1 and 16.6 ms, nearly all of it catching up: 5.5% of the generation).
    fn dear_reading_pair() -> DraftLength {
        let mut d = DraftLength::default();
        d.set_draft_step(0.0011);
        d.set_read_secs(0.00009);
        d.plain(Some(0.0021));
        d.plain(Some(0.00205));
        d
    }

    #[test]
    fn a_draft_that_reads_dearly_probes_only_at_the_start() {
        let mut d = dear_reading_pair();
        assert_eq!(d.limit(16), 2, "the generation's first check, with nothing to catch up on");
        d.checked(Some(0.0065), 2, 2);
        assert_eq!(d.limit(16), 1, "one check is not judged");
        d.checked(Some(0.0044), 1, 1);
        for _ in 0..2 * DraftLength::MAX_PROBE {
            d.plain(Some(0.00205));
            assert_eq!(d.limit(16), 0, "a probe that would catch up on every plain step before it");
        }
        let mut next = d.for_next_generation();
        assert_eq!(next.limit(16), 2, "the next generation's first check");
        next.checked(Some(0.0065), 2, 2);
        assert_eq!(next.limit(16), 0, "checks judged in the generation before");
        // A draft that reads a token in 1% of a plain step probes after plain steps again.
        d.set_read_secs(0.00002);
        assert_eq!(d.limit(16), 2);
    }

    #[test]
    fn a_start_check_the_drafter_had_no_guess_for_is_not_asked_again() {
        // The draft's first guess fell below its p-min: the step ran plain, and the following
        // steps do not ask for the start's check again (each would cost a draft step).
        let mut d = dear_reading_pair();
        assert_eq!(d.limit(16), 2);
        d.plain(Some(0.0021));
        assert_eq!(d.limit(16), 0);
    }

    #[test]
    fn warm_ups_do_not_make_guesses_look_dear() {
        // A step recorded at its first runs (a plain one, then each new check shape, the
        // draft's too) costs many plain steps; untimed, it leaves guessing on where the
        // steady checks pay (2.2 ms plain steps, checks of 3 guesses at 5 ms, all kept).
        let mut d = DraftLength::default();
        d.plain(None);
        d.plain(Some(0.0023));
        d.plain(Some(0.0022));
        assert_eq!(d.limit(16), 16);
        for _ in 0..4 {
            d.checked(None, 3, 3);
            assert!(d.limit(16) > 0, "a warm-up stopped guessing");
        }
        for _ in 0..8 {
            d.checked(Some(0.005), 3, 3);
        }
        assert!(d.limit(16) >= 3, "steady checks that pay keep guessing: {}", d.limit(16));
        // Timed, the same warm-ups (35 ms checks) would have turned guessing off.
        let mut timed = DraftLength::default();
        timed.plain(Some(0.030));
        timed.plain(Some(0.0022));
        timed.checked(Some(0.035), 3, 3);
        assert_eq!(timed.limit(16), 0);
    }

    #[test]
    fn top_probability_is_the_softmax_of_the_best() {
        let (t, p) = top_probability(&[0.0, 2.0_f32.ln(), 0.0]);
        assert_eq!(t, 1);
        assert!((p - 0.5).abs() < 1e-6);
    }
}
