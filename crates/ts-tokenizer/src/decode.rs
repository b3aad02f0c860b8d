//! Token ids back to bytes and text.

use crate::unicode::ByteMap;
use crate::{TokenAttr, Tokenizer, TokenizerError};
use std::borrow::Cow;

/// A token's bytes as llama.cpp's `token_to_piece` renders it with
/// `special = true`.
pub(crate) fn render_piece(tok: &Tokenizer, id: usize) -> Cow<'_, [u8]> {
    let text: &str = &tok.texts[id];
    let attr = tok.attrs[id];
    if attr.any(TokenAttr::UNKNOWN | TokenAttr::CONTROL | TokenAttr::USER_DEFINED) {
        Cow::Borrowed(text.as_bytes())
    } else if attr.any(TokenAttr::NORMAL) {
        let spaces_escaped = tok.bpe.as_ref().is_none_or(|bpe| bpe.flavor.escape_whitespaces);
        if spaces_escaped {
            if text.contains('\u{2581}') {
                Cow::Owned(text.replace('\u{2581}', " ").into_bytes())
            } else {
                Cow::Borrowed(text.as_bytes())
            }
        } else {
            Cow::Owned(decode_byte_level(text))
        }
    } else if attr.any(TokenAttr::BYTE) {
        Cow::Owned(vec![parse_byte_token(text)])
    } else {
        Cow::Borrowed(&[])
    }
}

/// Reverses GPT-2's byte-to-character mapping. A character outside the
/// mapping is spelled out the way llama.cpp's `llama_decode_text` does,
/// except that for tokens longer than 256 bytes the token text is not
/// repeated inside each placeholder (that repetition is quadratic).
fn decode_byte_level(text: &str) -> Vec<u8> {
    let map = ByteMap::get();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match map.byte_of(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut utf8 = [0u8; 4];
                for b in c.encode_utf8(&mut utf8).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                if text.len() <= 256 {
                    out.extend_from_slice(text.as_bytes());
                }
                out.push(b']');
            }
        }
    }
    out
}

/// The byte of a `<0xXX>` token: the hex digits at offsets 3..5, parsed as
/// far as they go (llama.cpp: `strtol(text.substr(3, 2), 16)`).
fn parse_byte_token(text: &str) -> u8 {
    let digits = text.as_bytes().get(3..text.len().min(5)).unwrap_or_default();
    let mut value = 0u8;
    for &d in digits {
        match (d as char).to_digit(16) {
            Some(v) => value = value.wrapping_mul(16).wrapping_add(v as u8),
            None => break,
        }
    }
    value
}

pub(crate) fn detokenize(
    tok: &Tokenizer,
    ids: &[u32],
    remove_special: bool,
    unparse_special: bool,
) -> Result<Vec<u8>, TokenizerError> {
    for &id in ids {
        tok.check_id(id)?;
    }
    let mut ids = ids;
    // The space SentencePiece puts before the text is dropped from the first piece.
    let mut strip_space = tok.add_space_prefix;
    if remove_special && tok.add_bos && !ids.is_empty() && Some(ids[0]) == tok.specials.bos {
        strip_space = false;
        ids = &ids[1..];
    }
    if remove_special && tok.add_eos && ids.last().is_some_and(|&id| Some(id) == tok.specials.eos) {
        ids = &ids[..ids.len() - 1];
    }
    let mut text = Vec::with_capacity(ids.len() * 4);
    for &id in ids {
        let piece = tok.token_to_piece(id, unparse_special)?;
        let piece = match piece.split_first() {
            Some((b' ', rest)) if strip_space => rest,
            _ => &piece[..],
        };
        strip_space = false;
        text.extend_from_slice(piece);
    }
    if tok.clean_spaces {
        clean_up_spaces(&mut text);
    }
    Ok(text)
}

/// HF's `clean_up_tokenization_spaces`, in llama.cpp's three passes: drop the
/// space before `?!.,`, around a lone `'`, and before `'s`, `'m`, `'re`, `'ve`.
fn clean_up_spaces(text: &mut Vec<u8>) {
    // Each pass compacts in place; the reads at `i - 1` and `i + 1` see the
    // buffer as the pass has left it so far, as in llama.cpp.
    let mut n = text.len();

    let mut kept = n.min(1);
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            kept -= 1;
        }
        text[kept] = x;
        kept += 1;
    }
    n = kept;

    kept = n.min(1);
    let mut i = 1;
    while i < n {
        let x = text[i];
        if x == b'\'' && i + 1 < n && text[i - 1] == b' ' && text[i + 1] == b' ' {
            kept -= 1;
            i += 1;
            text[i] = 0;
        }
        text[kept] = x;
        kept += 1;
        i += 1;
    }
    n = kept;

    kept = n.min(1);
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && x == b'\'' && i + 1 < n {
            let x1 = text[i + 1];
            let drop_space = match x1 {
                b't' | b'd' => false,
                b's' | b'm' => true,
                _ => i + 2 < n && matches!((x1, text[i + 2]), (b'r', b'e') | (b'v', b'e')),
            };
            if drop_space {
                kept -= 1;
            }
        }
        text[kept] = x;
        kept += 1;
    }
    text.truncate(kept);
}

/// Turns generated token ids into text as they arrive. Each [`push`] returns
/// the text that is complete so far; bytes of a UTF-8 character split across
/// tokens are held back until the character is whole. Bytes that can never
/// form UTF-8 come out as U+FFFD.
///
/// Pieces are joined as they are, without the clean-up [`Tokenizer::decode`]
/// applies to a whole sequence.
///
/// [`push`]: StreamDecoder::push
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    special: bool,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    /// With `special`, control tokens are rendered as their text.
    pub fn new(tokenizer: &'a Tokenizer, special: bool) -> StreamDecoder<'a> {
        StreamDecoder { tokenizer, special, pending: Vec::new() }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let piece = self.tokenizer.token_to_piece(id, self.special)?;
        self.pending.extend_from_slice(&piece);
        Ok(self.take_complete())
    }

    /// Returns whatever is held back, with incomplete characters as U+FFFD,
    /// and resets the decoder.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }

    /// Whether bytes of an incomplete character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn take_complete(&mut self) -> String {
        let mut text = String::new();
        let mut consumed = 0;
        loop {
            match std::str::from_utf8(&self.pending[consumed..]) {
                Ok(s) => {
                    text.push_str(s);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = consumed + e.valid_up_to();
                    text.push_str(std::str::from_utf8(&self.pending[consumed..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            consumed = valid + bad;
                        }
                        None => {
                            consumed = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clean(s: &str) -> String {
        let mut v = s.as_bytes().to_vec();
        clean_up_spaces(&mut v);
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn clean_up() {
        assert_eq!(clean("Hello , world !"), "Hello, world!");
        assert_eq!(clean("it ' s"), "it's");
        assert_eq!(clean("he 's here , they 're"), "he's here, they're");
        assert_eq!(clean("don 't"), "don 't");
        assert_eq!(clean(""), "");
    }

    #[test]
    fn byte_tokens() {
        assert_eq!(parse_byte_token("<0x0A>"), 10);
        assert_eq!(parse_byte_token("<0xFF>"), 255);
        assert_eq!(parse_byte_token("<0x"), 0);
        assert_eq!(parse_byte_token("x"), 0);
    }
}
