//! Byte-pair encoding with ranked merges (llama.cpp's `llm_tokenizer_bpe_session`).

use crate::pretokenize::{BpeFlavor, PreTokenizer};
use crate::{Tokenizer, TokenizerError};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// The id of a symbol whose text is neither a token nor a merge piece.
const NO_ID: u32 = u32::MAX;

/// No neighbouring symbol.
const NONE: u32 = u32::MAX;

pub(crate) struct Bpe {
    pub pre: PreTokenizer,
    pub flavor: BpeFlavor,
    /// Rank of each merge, keyed by the ids (in `Tokenizer::ids`) of its two pieces.
    pub ranks: HashMap<(u32, u32), u32>,
}

/// A run of the word's bytes; merged-away symbols have `start == end`.
#[derive(Clone, Copy)]
struct Symbol {
    start: u32,
    end: u32,
    prev: u32,
    next: u32,
    id: u32,
}

impl Bpe {
    /// Tokenizes one text fragment (no special tokens in it) onto `out`.
    pub fn encode(&self, tok: &Tokenizer, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let escaped;
        let text = if self.flavor.escape_whitespaces {
            escaped = text.replace(' ', "\u{2581}");
            escaped.as_str()
        } else {
            text
        };
        for word in self.pre.split(text)? {
            let whole = self.flavor.ignore_merges
                || (self.flavor.gemma4 && !word.is_empty() && word.bytes().all(|b| b == b'\n'));
            let whole_id = if whole { tok.token_id(&word) } else { None };
            if let Some(id) = whole_id {
                out.push(id);
                continue;
            }
            self.merge_word(tok, &word, out);
        }
        Ok(())
    }

    /// Merges the characters of `word`, always taking the lowest-ranked pair
    /// (leftmost on ties), then emits the resulting symbols.
    fn merge_word(&self, tok: &Tokenizer, word: &str, out: &mut Vec<u32>) {
        let lookup = |s: &str| tok.ids.get(s).copied().unwrap_or(NO_ID);
        let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
        for (start, c) in word.char_indices() {
            let end = start + c.len_utf8();
            let index = symbols.len() as u32;
            symbols.push(Symbol {
                start: start as u32,
                end: end as u32,
                prev: if index == 0 { NONE } else { index - 1 },
                next: if end == word.len() { NONE } else { index + 1 },
                id: lookup(&word[start..end]),
            });
        }
        // (rank, left, right, left id, right id), smallest first.
        let mut queue = BinaryHeap::new();
        let push_pair = |queue: &mut BinaryHeap<_>, symbols: &[Symbol], left: u32, right: u32| {
            if left == NONE || right == NONE {
                return;
            }
            let (l, r) = (symbols[left as usize], symbols[right as usize]);
            if l.id == NO_ID || r.id == NO_ID {
                return;
            }
            if let Some(&rank) = self.ranks.get(&(l.id, r.id)) {
                queue.push(Reverse((rank, left, right, l.id, r.id)));
            }
        };
        for i in 1..symbols.len() as u32 {
            push_pair(&mut queue, &symbols, i - 1, i);
        }
        while let Some(Reverse((_, left, right, left_id, right_id))) = queue.pop() {
            let (l, r) = (symbols[left as usize], symbols[right as usize]);
            // Skip pairs whose symbols have merged with something else since.
            if l.start == l.end || r.start == r.end || l.id != left_id || r.id != right_id {
                continue;
            }
            let merged = &mut symbols[left as usize];
            merged.end = r.end;
            merged.next = r.next;
            merged.id = lookup(&word[l.start as usize..r.end as usize]);
            let prev = merged.prev;
            let next = merged.next;
            let gone = &mut symbols[right as usize];
            gone.start = gone.end;
            if next != NONE {
                symbols[next as usize].prev = left;
            }
            push_pair(&mut queue, &symbols, prev, left);
            push_pair(&mut queue, &symbols, left, next);
        }
        let n_tokens = tok.texts.len() as u32;
        for s in symbols.iter().filter(|s| s.start != s.end) {
            if s.id < n_tokens {
                out.push(s.id);
                continue;
            }
            // Not a token: fall back to one token per byte where there is one.
            for &b in &word.as_bytes()[s.start as usize..s.end as usize] {
                let id = if self.flavor.byte_encode {
                    tok.ascii_tokens.get(b as usize).copied().flatten()
                } else {
                    tok.hex_byte_tokens[b as usize]
                };
                out.extend(id);
            }
        }
    }
}
