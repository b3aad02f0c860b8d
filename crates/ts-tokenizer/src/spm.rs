//! SentencePiece-style tokenization as llama.cpp does it
//! (`llm_tokenizer_spm_session`): start from single characters, repeatedly
//! merge the adjacent pair whose concatenation is the highest-scoring token,
//! and spell what is left over as byte tokens.

use crate::special::Fragment;
use crate::{Tokenizer, TokenizerError};
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Encodes the fragments of `text`. A space is put before a text fragment that
/// starts the input or follows a special token when the vocabulary asks for
/// it (`add_space_prefix`); spaces become U+2581.
pub(crate) fn encode_fragments(
    tok: &Tokenizer,
    text: &str,
    fragments: &[Fragment],
    out: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    let mut after_special = true;
    for fragment in fragments {
        match fragment {
            Fragment::Token(id) => {
                out.push(*id);
                after_special = true;
            }
            Fragment::Text(range) => {
                let mut piece = String::with_capacity(range.len() * 3 + 3);
                if tok.add_space_prefix && after_special {
                    piece.push('\u{2581}');
                }
                for c in text[range.clone()].chars() {
                    piece.push(if c == ' ' { '\u{2581}' } else { c });
                }
                encode_piece(tok, &piece, out)?;
                after_special = false;
            }
        }
    }
    Ok(())
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    end: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge: higher score first, then the leftmost.
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        // Scores are sanitized at load (no NaN, no -0.0), so this matches
        // llama.cpp's `<` on floats.
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

fn encode_piece(tok: &Tokenizer, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let index = symbols.len();
        let end = start + c.len_utf8();
        symbols.push(Symbol { start, end, prev: index.checked_sub(1), next: (end < text.len()).then_some(index + 1) });
    }
    let mut queue = BinaryHeap::new();
    let try_pair =
        |queue: &mut BinaryHeap<Candidate>, symbols: &[Symbol], left: Option<usize>, right: Option<usize>| {
            let (Some(left), Some(right)) = (left, right) else { return };
            let span = symbols[left].start..symbols[right].end;
            if let Some(id) = tok.token_id(&text[span.clone()]) {
                queue.push(Candidate { score: tok.scores[id as usize], left, right, len: span.len() });
            }
        };
    for i in 1..symbols.len() {
        try_pair(&mut queue, &symbols, Some(i - 1), Some(i));
    }
    while let Some(best) = queue.pop() {
        let (l, r) = (symbols[best.left], symbols[best.right]);
        let (l_len, r_len) = (l.end - l.start, r.end - r.start);
        // Skip candidates whose symbols have changed since they were queued.
        if l_len == 0 || r_len == 0 || l_len + r_len != best.len {
            continue;
        }
        symbols[best.left].end = r.end;
        symbols[best.left].next = r.next;
        symbols[best.right].start = r.end;
        if let Some(next) = r.next {
            symbols[next].prev = Some(best.left);
        }
        try_pair(&mut queue, &symbols, l.prev, Some(best.left));
        try_pair(&mut queue, &symbols, Some(best.left), r.next);
    }
    // Merged symbols are tokens by construction; a leftover single character
    // that is not becomes its UTF-8 bytes.
    for s in symbols.iter().filter(|s| s.end > s.start) {
        let piece = &text[s.start..s.end];
        match tok.token_id(piece) {
            Some(id) => out.push(id),
            None => {
                for &b in piece.as_bytes() {
                    out.push(tok.byte_token(b).ok_or(TokenizerError::MissingByteToken(b))?);
                }
            }
        }
    }
    Ok(())
}
