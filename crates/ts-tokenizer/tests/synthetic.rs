//! Behaviour on small hand-made vocabularies: merges, byte fallback, special
//! tokens, BOS/EOS, decoding and streaming.

mod common;

use common::{bpe_metadata, spm_metadata};
use ts_tokenizer::{TokenType, Tokenizer, TokenizerError, TokenizerKind};

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// Ids: 0 `<unk>`, 1 `<s>`, 2 `</s>`, 3..=258 bytes, then these from 259.
fn spm() -> Tokenizer {
    let extra = [
        ("▁", -1.0, NORMAL),           // 259
        ("h", -2.0, NORMAL),           // 260
        ("e", -2.0, NORMAL),           // 261
        ("l", -2.0, NORMAL),           // 262
        ("o", -2.0, NORMAL),           // 263
        ("▁h", -1.5, NORMAL),          // 264
        ("▁he", -1.2, NORMAL),         // 265
        ("ll", -1.3, NORMAL),          // 266
        ("llo", -1.1, NORMAL),         // 267
        ("▁hello", -0.5, NORMAL),      // 268
        ("<tool>", 0.0, USER_DEFINED), // 269
        ("<|ctrl|>", 0.0, CONTROL),    // 270
        ("w", -2.0, NORMAL),           // 271
    ];
    Tokenizer::from_metadata(&spm_metadata(&extra)).unwrap()
}

fn byte(b: u8) -> u32 {
    3 + b as u32
}

#[test]
fn spm_merges_by_score() {
    let tok = spm();
    assert_eq!(tok.kind(), TokenizerKind::Spm);
    assert_eq!(tok.encode("hello", false, false).unwrap(), [268]);
    assert_eq!(tok.encode("hello hello", false, false).unwrap(), [268, 268]);
    assert_eq!(tok.encode("hello", true, false).unwrap(), [1, 268]);
    assert_eq!(tok.encode("", true, false).unwrap(), [1]);
    assert_eq!(tok.encode("", false, false).unwrap(), Vec::<u32>::new());
}

#[test]
fn spm_falls_back_to_bytes() {
    let tok = spm();
    // "▁é": no token for "é", so its two UTF-8 bytes.
    assert_eq!(tok.encode("é", false, false).unwrap(), [259, byte(0xC3), byte(0xA9)]);
    assert_eq!(tok.decode(&[259, byte(0xC3), byte(0xA9)]).unwrap(), "é");
    assert_eq!(tok.token_type(byte(0x41)).unwrap(), TokenType::Byte);
}

#[test]
fn special_tokens_are_cut_out() {
    let tok = spm();
    // User-defined tokens always; the space prefix is added after a special token.
    assert_eq!(tok.encode("hello<tool>hello", false, false).unwrap(), [268, 269, 268]);
    // Control tokens only when parsing specials.
    let plain = tok.encode("<|ctrl|>", false, false).unwrap();
    assert!(!plain.contains(&270));
    assert_eq!(tok.encode("<|ctrl|>hello", false, true).unwrap(), [270, 268]);
    assert_eq!(tok.token_type(270).unwrap(), TokenType::Control);
    assert_eq!(tok.token_type(269).unwrap(), TokenType::UserDefined);
}

#[test]
fn decoding() {
    let tok = spm();
    // The leading space SentencePiece adds is dropped, control tokens are hidden.
    assert_eq!(tok.decode(&[268, 268]).unwrap(), "hello hello");
    assert_eq!(tok.decode(&[1, 268, 2]).unwrap(), " hello");
    // As in llama.cpp, removing BOS also keeps the space.
    assert_eq!(tok.detokenize(&[1, 268, 2], true, false).unwrap(), b" hello");
    assert_eq!(tok.detokenize(&[268], true, false).unwrap(), b"hello");
    assert_eq!(tok.detokenize(&[270, 268], false, true).unwrap(), b"<|ctrl|> hello");
    assert_eq!(tok.token_to_piece(270, false).unwrap().as_ref(), b"");
    assert_eq!(tok.token_to_piece(270, true).unwrap().as_ref(), b"<|ctrl|>");
    assert_eq!(tok.token_to_piece(269, false).unwrap().as_ref(), b"<tool>");
    assert_eq!(tok.token_to_piece(268, false).unwrap().as_ref(), b" hello");
    assert_eq!(tok.token_to_piece(byte(b'\n'), false).unwrap().as_ref(), b"\n");
}

#[test]
fn out_of_range_ids_are_errors() {
    let tok = spm();
    let n = tok.vocab_size() as u32;
    for result in
        [tok.decode(&[268, n]).map(|_| ()), tok.token_to_piece(n, true).map(|_| ()), tok.token_text(n).map(|_| ())]
    {
        let err = result.unwrap_err();
        assert!(matches!(err, TokenizerError::TokenOutOfRange { id, .. } if id == n));
        assert!(err.to_string().contains(&n.to_string()), "{err}");
    }
    assert!(tok.stream_decoder(false).push(u32::MAX).is_err());
    assert!(!tok.is_eog(u32::MAX));
}

#[test]
fn stream_decoder_holds_back_split_characters() {
    let tok = spm();
    let mut d = tok.stream_decoder(false);
    // "é" = C3 A9 and "😀" = F0 9F 98 80, one byte per token.
    assert_eq!(d.push(268).unwrap(), " hello");
    assert_eq!(d.push(byte(0xC3)).unwrap(), "");
    assert!(d.has_pending());
    assert_eq!(d.push(byte(0xA9)).unwrap(), "é");
    for b in [0xF0, 0x9F, 0x98] {
        assert_eq!(d.push(byte(b)).unwrap(), "");
    }
    assert_eq!(d.push(byte(0x80)).unwrap(), "😀");
    // A byte that can never start a character comes out as U+FFFD right away.
    assert_eq!(d.push(byte(0xFF)).unwrap(), "\u{FFFD}");
    // An unfinished character is flushed as U+FFFD at the end.
    assert_eq!(d.push(byte(0xE4)).unwrap(), "");
    assert_eq!(d.push(byte(0xB8)).unwrap(), "");
    assert_eq!(d.finish(), "\u{FFFD}");
    assert!(!d.has_pending());
    // A broken sequence followed by valid text: the valid text is not held back.
    assert_eq!(d.push(byte(0xC3)).unwrap(), "");
    assert_eq!(d.push(byte(b'h')).unwrap(), "\u{FFFD}h");
    // Control tokens render only when asked for.
    assert_eq!(d.push(270).unwrap(), "");
    assert_eq!(tok.stream_decoder(true).push(270).unwrap(), "<|ctrl|>");
}

/// "Ġ" is GPT-2's stand-in for the space byte.
fn bpe() -> Tokenizer {
    let tokens = ["a", "b", "c", "Ġ", "ab", "abc", "Ġa", "Ġab", "!", "<|endoftext|>"];
    let merges = ["a b", "ab c", "Ġ a", "Ġa b"];
    Tokenizer::from_metadata(&bpe_metadata(&tokens, &merges)).unwrap()
}

#[test]
fn bpe_merges_by_rank() {
    let tok = bpe();
    assert_eq!(tok.kind(), TokenizerKind::Bpe);
    assert_eq!(tok.pre(), "gpt-2");
    assert_eq!(tok.encode("abc a", false, false).unwrap(), [5, 6]);
    // "a b" outranks "Ġ a", and no merge joins "Ġ" and "ab".
    assert_eq!(tok.encode("abc ab", false, false).unwrap(), [5, 3, 4]);
    assert_eq!(tok.encode("cab!", false, false).unwrap(), [2, 4, 8]);
    // "d" has no token and no byte token: dropped, as llama.cpp does.
    assert_eq!(tok.encode("ad", false, false).unwrap(), [0]);
    assert_eq!(tok.decode(&[5, 7]).unwrap(), "abc ab");
    assert_eq!(tok.token_to_piece(3, false).unwrap().as_ref(), b" ");
    // `<|endoftext|>` is detected as an end-of-generation control token.
    assert!(tok.is_eog(9));
    assert_eq!(tok.eot(), Some(9));
    assert_eq!(tok.encode("<|endoftext|>", false, true).unwrap(), [9]);
}

#[test]
fn tokenizer_is_shareable() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
}
