//! The one loop every caller steps sequences through: [`Engine::step`] runs
//! pieces of several sequences in one forward pass, and a [`Decoding`] turns
//! one sequence's logits into its next token and its text (sampling, end of
//! generation, stop sequences, the token limit, a full context). `run`, `chat`,
//! `perplexity` and the server's scheduler all go through these two.

use crate::constraint::Constraint;
use crate::sampler::{Sampler, SamplerConfig};
use crate::session::{Engine, EngineError, StopReason};
use crate::speculative::Drafter;
use ts_model::{Backend, Row, SeqState};
use ts_tokenizer::{StreamDecoder, Tokenizer};

/// Which rows of a piece of a sequence give logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    /// The piece's last token.
    Last,
    /// Every token of the piece.
    All,
}

/// Tokens to run after what a sequence holds, in one step.
#[derive(Clone, Copy, Debug)]
pub struct Piece<'a> {
    pub tokens: &'a [u32],
    pub logits: Logits,
}

impl<B: Backend> Engine<B> {
    /// One forward pass over a piece of each sequence (`pieces[i]` continues
    /// `seqs[i]` at its `n_past`); every weight is read once for all of them.
    /// Returns, per sequence, the logits rows its piece asked for.
    pub fn step(
        &self,
        seqs: &mut [&mut SeqState<B::State>],
        pieces: &[Piece],
        scratch: &mut B::Scratch,
    ) -> Result<Vec<Vec<Vec<f32>>>, EngineError> {
        Ok(self.run_step(seqs, pieces, scratch, false)?.0)
    }

    /// [`Engine::step`], also handing back each piece's final-normed hidden states,
    /// `[tokens][n_embd]` per piece (what an MTP head reads: [`ts_model::Model::forward_hidden`]).
    #[allow(clippy::type_complexity)]
    pub fn step_hidden(
        &self,
        seqs: &mut [&mut SeqState<B::State>],
        pieces: &[Piece],
        scratch: &mut B::Scratch,
    ) -> Result<(Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>), EngineError> {
        let (logits, hidden) = self.run_step(seqs, pieces, scratch, true)?;
        let hidden = hidden.expect("asked for the hidden states");
        let e = self.model.cfg.n_embd;
        let mut at = 0;
        let per_piece = pieces
            .iter()
            .map(|p| {
                let h = hidden[at * e..(at + p.tokens.len()) * e].to_vec();
                at += p.tokens.len();
                h
            })
            .collect();
        Ok((logits, per_piece))
    }

    /// [`Engine::step`] of one sequence's `piece`, handing its final-normed hidden states to
    /// `observer` where it reads them ([`Drafter::wants_hidden`]: an MTP head).
    pub fn step_observed<'d>(
        &self,
        seq: &mut SeqState<B::State>,
        piece: Piece,
        scratch: &mut B::Scratch,
        observer: Option<&mut (dyn Drafter + 'd)>,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        match observer.filter(|d| d.wants_hidden()) {
            Some(d) => {
                let first = seq.n_past;
                let (mut logits, hidden) = self.step_hidden(&mut [seq], &[piece], scratch)?;
                d.observe(first, piece.tokens, &hidden[0]);
                Ok(logits.remove(0))
            }
            None => Ok(self.step(&mut [seq], &[piece], scratch)?.remove(0)),
        }
    }

    /// [`Engine::step`], handing `read` each logits row (with its piece's index) where the
    /// backend leaves it on the host, instead of a copy of each ([`Model::forward_read`]): a
    /// GPU's rows in the page-locked memory they land in, as llama.cpp leaves its logits.
    pub fn step_read(
        &self,
        seqs: &mut [&mut SeqState<B::State>],
        pieces: &[Piece],
        scratch: &mut B::Scratch,
        read: &mut (dyn FnMut(usize, &[f32]) + Send),
    ) -> Result<(), EngineError> {
        let rows = rows_of(seqs, pieces)?;
        let owners: Vec<usize> = rows.iter().filter(|r| r.logits).map(|r| r.seq).collect();
        let model = &self.model;
        self.on_pool(|| {
            let mut owner = owners.iter();
            let mut read_row = |row: &[f32]| read(owner.next().copied().unwrap_or(0), row);
            model.backend.run_step(rows.len(), || model.forward_read(&rows, seqs, scratch, &mut read_row))
        })?;
        Ok(())
    }

    #[allow(clippy::type_complexity)]
    fn run_step(
        &self,
        seqs: &mut [&mut SeqState<B::State>],
        pieces: &[Piece],
        scratch: &mut B::Scratch,
        hidden: bool,
    ) -> Result<(Vec<Vec<Vec<f32>>>, Option<Vec<f32>>), EngineError> {
        let rows = rows_of(seqs, pieces)?;
        let model = &self.model;
        let (logits, hidden) = self.on_pool(|| {
            model.backend.run_step(rows.len(), || match hidden {
                false => model.forward(&rows, seqs, scratch).map(|l| (l, None)),
                true => model.forward_hidden(&rows, seqs, scratch).map(|(l, h)| (l, Some(h))),
            })
        })?;
        let mut logits = logits.into_iter();
        let logits = pieces
            .iter()
            .map(|p| {
                let n = match p.logits {
                    Logits::None => 0,
                    Logits::Last => p.tokens.len().min(1),
                    Logits::All => p.tokens.len(),
                };
                logits.by_ref().take(n).collect()
            })
            .collect();
        Ok((logits, hidden))
    }

    /// `forward` on the engine's thread pool where the backend computes on it.
    fn on_pool<R: Send>(&self, forward: impl FnOnce() -> R + Send) -> R {
        if self.model.backend.uses_thread_pool() { self.install(forward) } else { forward() }
    }
}

/// The rows of a step over `pieces[i]` continuing `seqs[i]`, or why they do not fit.
fn rows_of<S>(seqs: &[&mut SeqState<S>], pieces: &[Piece]) -> Result<Vec<Row>, EngineError> {
    if seqs.len() != pieces.len() {
        return Err(EngineError::Invalid(format!("{} pieces for {} sequences", pieces.len(), seqs.len())));
    }
    let mut rows = Vec::with_capacity(pieces.iter().map(|p| p.tokens.len()).sum());
    for (i, (seq, piece)) in seqs.iter().zip(pieces).enumerate() {
        if seq.n_past + piece.tokens.len() > seq.n_ctx {
            return Err(EngineError::PromptTooLong { tokens: seq.n_past + piece.tokens.len(), n_ctx: seq.n_ctx });
        }
        let last = piece.tokens.len().saturating_sub(1);
        rows.extend(piece.tokens.iter().enumerate().map(|(j, &token)| Row {
            token,
            pos: seq.n_past + j,
            seq: i,
            logits: match piece.logits {
                Logits::None => false,
                Logits::Last => j == last,
                Logits::All => true,
            },
        }));
    }
    Ok(rows)
}

/// What one [`Decoding::next`] produced.
#[derive(Clone, Debug, Default)]
pub struct Next {
    /// The sampled token (also when it ends the generation).
    pub token: Option<u32>,
    /// Text to show now: whole UTF-8, with any tail that could still become a
    /// stop sequence held back.
    pub text: String,
    /// Why the generation is over, if it is; else `token` is to be run next.
    pub stop: Option<StopReason>,
}

/// One sequence's generation: its sampler, its text so far, and the rules
/// that end it.
pub struct Decoding<'t> {
    sampler: Sampler,
    tokenizer: &'t Tokenizer,
    decoder: StreamDecoder<'t>,
    stop: Vec<String>,
    max_tokens: usize,
    generated: usize,
    /// Decoded text held back: it could be the start of a stop sequence.
    held: String,
    /// The grammar the reply must follow, if any.
    constraint: Option<Constraint>,
    /// The logits under the constraint's mask (kept to reuse its allocation).
    masked: Vec<f32>,
}

impl<'t> Decoding<'t> {
    /// A generation of at most `max_tokens` after `history` (the tokens the
    /// sequence holds, for the sampler's penalties); with `special`, control
    /// tokens appear as their text; it stops before any of `stop`.
    pub fn new(
        tokenizer: &'t Tokenizer,
        sampler: &SamplerConfig,
        history: &[u32],
        max_tokens: usize,
        special: bool,
        stop: Vec<String>,
    ) -> Result<Decoding<'t>, EngineError> {
        let mut sampler = Sampler::new(sampler.clone())?;
        for &t in history {
            sampler.accept(t);
        }
        Ok(Decoding {
            sampler,
            tokenizer,
            decoder: tokenizer.stream_decoder(special),
            stop,
            max_tokens,
            generated: 0,
            held: String::new(),
            constraint: None,
            masked: Vec::new(),
        })
    }

    /// The same generation held to a grammar: it samples only tokens the
    /// grammar allows and ends (as at a stop sequence) when the grammar is complete.
    pub fn constrained(mut self, constraint: Option<Constraint>) -> Decoding<'t> {
        self.constraint = constraint;
        self
    }

    /// Tokens generated so far (an end-of-generation token not counted).
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Samples from `logits` (the sequence's last row, with `room` positions
    /// left in its context) and says what to show and whether to go on.
    pub fn next(&mut self, logits: &[f32], room: usize) -> Result<Next, EngineError> {
        if self.max_tokens == 0 {
            return Ok(Next { stop: Some(StopReason::Length), ..Next::default() });
        }
        let token = match &mut self.constraint {
            None => self.sampler.try_sample(logits)?,
            Some(c) => {
                self.masked.clear();
                self.masked.extend_from_slice(logits);
                c.mask(&mut self.masked)?;
                self.sampler.try_sample(&self.masked)?
            }
        };
        self.sampler.accept(token);
        if self.tokenizer.is_eog(token) {
            return Ok(Next { token: Some(token), text: self.finish(), stop: Some(StopReason::EndOfGeneration) });
        }
        if let Some(c) = &mut self.constraint {
            c.commit(token)?;
        }
        self.generated += 1;
        self.held.push_str(&self.decoder.push(token)?);
        // A stop sequence ends the text before it.
        if let Some(cut) = self.stop.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.held.truncate(cut);
            return Ok(Next { token: Some(token), text: std::mem::take(&mut self.held), stop: Some(StopReason::Stop) });
        }
        let stop = if self.constraint.as_ref().is_some_and(Constraint::is_done) {
            Some(StopReason::Stop)
        } else if self.generated >= self.max_tokens {
            Some(StopReason::Length)
        } else if room == 0 {
            Some(StopReason::ContextFull)
        } else {
            None
        };
        if stop.is_some() {
            return Ok(Next { token: Some(token), text: self.finish(), stop });
        }
        // Hold back a tail that could still grow into a stop sequence.
        let keep = self.stop.iter().map(|s| longest_prefix_suffix(&self.held, s)).max().unwrap_or(0);
        let text = self.held.drain(..self.held.len() - keep).collect();
        Ok(Next { token: Some(token), text, stop: None })
    }

    /// Everything held back, and the decoder's incomplete tail.
    fn finish(&mut self) -> String {
        let tail = self.decoder.finish();
        self.held.push_str(&tail);
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`, on a char boundary.
pub fn longest_prefix_suffix(text: &str, stop: &str) -> usize {
    let max = stop.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && stop.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::longest_prefix_suffix;

    #[test]
    fn held_back_tail() {
        assert_eq!(longest_prefix_suffix("hello wor", "world"), 3);
        assert_eq!(longest_prefix_suffix("hello", "xyz"), 0);
        assert_eq!(longest_prefix_suffix("ab", "abc"), 2);
        assert_eq!(longest_prefix_suffix("abc", "abc"), 0);
        assert_eq!(longest_prefix_suffix("xaba", "abab"), 3);
    }
}
