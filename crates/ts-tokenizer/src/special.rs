//! Cutting special tokens out of the text before tokenizing the rest
//! (llama.cpp's `tokenizer_st_partition`).

use crate::{TokenAttr, Tokenizer};
use std::ops::Range;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

/// `isspace` in the C locale, which is what llama.cpp strips around tokens
/// with the lstrip/rstrip attributes.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// Splits `text` into plain-text ranges and special tokens. Tokens are tried
/// longest first, each over every text range left by the ones before.
/// Control and unknown tokens count only with `parse_special`; user-defined
/// tokens always do.
pub(crate) fn partition(tok: &Tokenizer, text: &str, parse_special: bool) -> Vec<Fragment> {
    let mut fragments = Vec::new();
    if text.is_empty() {
        return fragments;
    }
    fragments.push(Fragment::Text(0..text.len()));
    let bytes = text.as_bytes();
    let pairs = BytePairs::of(bytes);
    let mut next = Vec::new();
    for &id in &tok.special_order {
        let attr = tok.attrs[id as usize];
        if !parse_special && attr.any(TokenAttr::CONTROL | TokenAttr::UNKNOWN) {
            continue;
        }
        let needle: &str = &tok.texts[id as usize];
        if !pairs.may_contain(needle.as_bytes()) {
            continue;
        }
        let found = fragments.iter().any(|f| matches!(f, Fragment::Text(r) if text[r.clone()].contains(needle)));
        if !found {
            continue;
        }
        next.clear();
        for fragment in fragments.drain(..) {
            let Fragment::Text(range) = fragment else {
                next.push(fragment);
                continue;
            };
            let (mut start, end) = (range.start, range.end);
            while start < end {
                let Some(offset) = text[start..end].find(needle) else {
                    next.push(Fragment::Text(start..end));
                    break;
                };
                let at = start + offset;
                let mut left_end = at;
                if attr.any(TokenAttr::LSTRIP) {
                    while left_end > start && is_c_space(bytes[left_end - 1]) {
                        left_end -= 1;
                    }
                }
                if left_end > start {
                    next.push(Fragment::Text(start..left_end));
                }
                next.push(Fragment::Token(id));
                start = at + needle.len();
                if attr.any(TokenAttr::RSTRIP) {
                    while start < end && is_c_space(bytes[start]) {
                        start += 1;
                    }
                }
            }
        }
        std::mem::swap(&mut fragments, &mut next);
    }
    fragments
}

/// Which pairs of adjacent bytes occur in a text: a quick way to rule out
/// most special tokens (a vocabulary can have thousands) before searching.
struct BytePairs {
    bits: Vec<u64>,
    first: [bool; 256],
}

impl BytePairs {
    fn of(bytes: &[u8]) -> BytePairs {
        let mut pairs = BytePairs { bits: vec![0; 65536 / 64], first: [false; 256] };
        for &b in bytes {
            pairs.first[b as usize] = true;
        }
        for w in bytes.windows(2) {
            let i = (w[0] as usize) << 8 | w[1] as usize;
            pairs.bits[i / 64] |= 1 << (i % 64);
        }
        pairs
    }

    fn may_contain(&self, needle: &[u8]) -> bool {
        match needle {
            [] => true,
            [b] => self.first[*b as usize],
            _ => needle.windows(2).all(|w| {
                let i = (w[0] as usize) << 8 | w[1] as usize;
                self.bits[i / 64] & (1 << (i % 64)) != 0
            }),
        }
    }
}
