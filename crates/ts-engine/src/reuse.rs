//! A sequence that remembers the tokens it holds, so that a new prompt that
//! starts the same way (a chat's next turn, a shared system prompt) reads only
//! what is new. An attention layer rewinds to any position; a recurrent layer
//! cannot, so the sequence keeps snapshots of where it may want to return:
//! the end of the conversation before the generation prompt (where the next
//! turn's prompt leaves the last one: templates re-render the previous reply,
//! often without its reasoning) and the end of the last prompt; otherwise it
//! continues only when the new prompt extends everything it holds. llama.cpp
//! re-reads the whole conversation of a hybrid model instead (its issues
//! #20225, #22746).

use crate::chat::{ChatMessage, ChatTemplate, TemplateKwargs};
use crate::session::EngineError;
use ts_model::{Backend, Model, SeqState, Snapshot};
use ts_tokenizer::Tokenizer;

/// Snapshots a sequence keeps at most (each is every recurrent layer's state:
/// 63 MiB for Qwen3.5-35B-A3B).
const SNAPSHOTS: usize = 2;

pub struct CachedSequence<B: Backend> {
    pub seq: SeqState<B::State>,
    /// The tokens of positions `0..seq.n_past`.
    pub history: Vec<u32>,
    /// Recurrent models: where the sequence may go back to, newest first.
    snapshots: Vec<Snapshot<B::Recurrent>>,
}

/// The length of `prompt`'s conversation before its generation prompt (the
/// messages rendered without it), when those tokens start `prompt`: where the
/// next turn's prompt is likely to part from this one.
pub fn conversation_end(
    template: &ChatTemplate,
    messages: &[ChatMessage],
    kwargs: &TemplateKwargs,
    tokenizer: &Tokenizer,
    prompt: &[u32],
) -> Option<usize> {
    let text = template.render_with(messages, false, kwargs).ok()?;
    let tokens = tokenizer.encode(&text, false, true).ok()?;
    (tokens.len() < prompt.len() && prompt.starts_with(&tokens)).then_some(tokens.len())
}

impl<B: Backend> CachedSequence<B> {
    pub fn new(seq: SeqState<B::State>) -> CachedSequence<B> {
        CachedSequence { seq, history: Vec::new(), snapshots: Vec::new() }
    }

    /// How many leading tokens of `prompt` this sequence can keep (at least
    /// one prompt token is left to run, for its logits).
    pub fn reusable(&self, model: &Model<B>, prompt: &[u32]) -> usize {
        self.plan(model, prompt).0
    }

    /// Positions kept, and whether the snapshot must be restored for them.
    fn plan(&self, model: &Model<B>, prompt: &[u32]) -> (usize, bool) {
        let common =
            self.history.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len().saturating_sub(1));
        if !model.is_recurrent() {
            // A sliding-window layer's ring keeps only its window and one chunk: rewinding
            // further than that past its newest position could find it overwritten.
            let sliding = model.cfg.layers.iter().any(|l| l.sliding_window().is_some());
            return if sliding && self.history.len() - common > 256 { (0, false) } else { (common, false) };
        }
        let here = (self.history.len() <= common).then_some(self.history.len());
        let saved = self.saved_within(common).map(|s| s.n_past);
        match (here, saved) {
            (Some(h), Some(s)) if s > h => (s, true),
            (Some(h), _) => (h, false),
            (None, Some(s)) => (s, true),
            (None, None) => (0, false),
        }
    }

    /// The snapshot holding the most positions, at most `n`.
    fn saved_within(&self, n: usize) -> Option<&Snapshot<B::Recurrent>> {
        self.snapshots.iter().filter(|s| s.n_past <= n).max_by_key(|s| s.n_past)
    }

    /// Makes the sequence hold the longest start of `prompt` it can (or
    /// nothing); returns how many tokens that is.
    pub fn prepare(&mut self, model: &Model<B>, prompt: &[u32]) -> Result<usize, EngineError> {
        let (keep, restore) = self.plan(model, prompt);
        if restore {
            let at = self.snapshots.iter().position(|s| s.n_past == keep).expect("planned from a snapshot");
            if let Err(e) = model.restore(&mut self.seq, &self.snapshots[at]) {
                self.forget();
                return Err(e.into());
            }
        }
        self.seq.n_past = keep;
        self.history.truncate(keep);
        Ok(keep)
    }

    /// Notes that `tokens` were run after what the sequence held.
    pub fn ran(&mut self, tokens: &[u32]) {
        self.history.extend_from_slice(tokens);
    }

    /// Marks the current position as one to come back to (the end of a
    /// conversation or of a prompt): a recurrent model keeps a snapshot here.
    pub fn remember(&mut self, model: &Model<B>) -> Result<(), EngineError> {
        if model.is_recurrent() && self.snapshots.first().is_none_or(|s| s.n_past != self.seq.n_past) {
            let snap = model.snapshot(&self.seq)?;
            // The oldest goes; snapshots past the current position are of another branch.
            self.snapshots.retain(|s| s.n_past < snap.n_past);
            self.snapshots.truncate(SNAPSHOTS - 1);
            self.snapshots.insert(0, snap);
        }
        Ok(())
    }

    /// Becomes a copy of `src` (the choices of one prompt).
    pub fn copy_from(&mut self, model: &Model<B>, src: &CachedSequence<B>) -> Result<(), EngineError> {
        self.snapshots.clear();
        model.copy_sequence(&src.seq, &mut self.seq)?;
        self.history.clone_from(&src.history);
        Ok(())
    }

    /// Forgets what the sequence holds (after a failed step, say).
    pub fn forget(&mut self) {
        self.history.clear();
        self.snapshots.clear();
        self.seq.clear();
    }
}
