//! Tokenizers built from GGUF metadata, producing the same token ids as
//! llama.cpp: byte-level BPE (`tokenizer.ggml.model = gpt2`, with the
//! pre-tokenizer named by `tokenizer.ggml.pre`; also `gemma4`) and
//! SentencePiece-style (`llama`: Llama 2, Gemma).
//!
//! The HF `tokenizers` crate is not used. llama.cpp is the reference, and it
//! departs from the HF tokenizers in ways that change ids: its SPM merges by
//! token score without a normalizer, its pre-tokenizer regexes are rewritten
//! (case-insensitive groups spelled out, `\p{..}` classes collapsed to stand-in
//! characters over its own Unicode 15.1 tables, hand-written splitters for the
//! common patterns), and special tokens are cut out of the text before
//! anything else. Reproducing those details directly is smaller than bending
//! `tokenizers` to them, and keeps the build light: the only regex engine is
//! `fancy-regex` (pure Rust, with the lookaheads some patterns need).
//!
//! Where a fact comes from llama.cpp, the comment names the place in its
//! sources (`src/llama-vocab.cpp`, `src/unicode.cpp`).

mod bpe;
mod decode;
mod error;
mod load;
mod pretokenize;
mod special;
mod spm;
mod unicode;
mod unicode_table;

use std::borrow::Cow;
use std::collections::HashMap;

pub use decode::StreamDecoder;
pub use error::TokenizerError;

/// Which algorithm turns text into tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// SentencePiece-style: symbol merges by token score, byte fallback.
    Spm,
    /// Byte-pair encoding with ranked merges after a pre-tokenizer.
    Bpe,
}

/// The token type stored in `tokenizer.ggml.token_type`, as llama.cpp
/// effectively uses it (after its load-time corrections).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

/// Token attributes, as llama.cpp's `llama_token_attr` bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TokenAttr(u16);

impl TokenAttr {
    pub const UNKNOWN: TokenAttr = TokenAttr(1 << 0);
    pub const UNUSED: TokenAttr = TokenAttr(1 << 1);
    pub const NORMAL: TokenAttr = TokenAttr(1 << 2);
    pub const CONTROL: TokenAttr = TokenAttr(1 << 3);
    pub const USER_DEFINED: TokenAttr = TokenAttr(1 << 4);
    pub const BYTE: TokenAttr = TokenAttr(1 << 5);
    /// Whitespace before the token is dropped when it is cut out of the text.
    pub const LSTRIP: TokenAttr = TokenAttr(1 << 7);
    /// Whitespace after the token is dropped when it is cut out of the text.
    pub const RSTRIP: TokenAttr = TokenAttr(1 << 8);

    pub fn bits(self) -> u16 {
        self.0
    }

    pub fn contains(self, other: TokenAttr) -> bool {
        self.0 & other.0 == other.0
    }

    fn any(self, other: TokenAttr) -> bool {
        self.0 & other.0 != 0
    }
}

impl std::ops::BitOr for TokenAttr {
    type Output = TokenAttr;
    fn bitor(self, rhs: TokenAttr) -> TokenAttr {
        TokenAttr(self.0 | rhs.0)
    }
}

/// The special token ids a vocabulary defines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End of turn.
    pub eot: Option<u32>,
    /// End of message (tool call follows).
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub sep: Option<u32>,
    pub pad: Option<u32>,
    pub mask: Option<u32>,
    pub fim_pre: Option<u32>,
    pub fim_suf: Option<u32>,
    pub fim_mid: Option<u32>,
    pub fim_pad: Option<u32>,
    pub fim_rep: Option<u32>,
    pub fim_sep: Option<u32>,
    /// The token for "\n" (llama.cpp's `linefeed_id`).
    pub newline: Option<u32>,
}

/// A tokenizer: encodes text to token ids and decodes them back.
pub struct Tokenizer {
    model: String,
    pre: String,
    kind: TokenizerKind,
    bpe: Option<bpe::Bpe>,
    /// Token text by id.
    texts: Vec<Box<str>>,
    scores: Vec<f32>,
    attrs: Vec<TokenAttr>,
    /// Text to id for every token, plus (BPE) merge pieces that are not
    /// tokens, with ids from `texts.len()` on.
    ids: HashMap<Box<str>, u32>,
    /// `<0xXX>` tokens by byte.
    hex_byte_tokens: [Option<u32>; 256],
    /// Single-character tokens for ASCII bytes.
    ascii_tokens: [Option<u32>; 128],
    specials: SpecialTokens,
    eog: Vec<u32>,
    /// Control, user-defined and unknown tokens, longest text first: the
    /// order in which they are cut out of the text.
    special_order: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.model)
            .field("pre", &self.pre)
            .field("vocab_size", &self.texts.len())
            .field("specials", &self.specials)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.
    pub fn from_metadata(metadata: &ts_gguf::Metadata) -> Result<Tokenizer, TokenizerError> {
        load::from_metadata(metadata)
    }

    /// Opens a GGUF file and builds its tokenizer.
    pub fn from_gguf(path: impl AsRef<std::path::Path>) -> Result<Tokenizer, TokenizerError> {
        let file = ts_gguf::GgufFile::open(path)?;
        Tokenizer::from_metadata(file.metadata())
    }

    /// Text to token ids, as llama.cpp's `llama_tokenize`: with `add_special`
    /// the BOS/EOS tokens the model asks for are added; with `parse_special`
    /// control tokens written in the text become those tokens (user-defined
    /// tokens always do).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let fragments = special::partition(self, text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.push(self.specials.bos.ok_or(TokenizerError::MissingSpecialToken("BOS"))?);
        }
        match &self.bpe {
            None => spm::encode_fragments(self, text, &fragments, &mut out)?,
            Some(bpe) => {
                for fragment in &fragments {
                    match fragment {
                        special::Fragment::Token(id) => out.push(*id),
                        special::Fragment::Text(range) => bpe.encode(self, &text[range.clone()], &mut out)?,
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.push(self.specials.eos.ok_or(TokenizerError::MissingSpecialToken("EOS"))?);
        }
        Ok(out)
    }

    /// The bytes a token stands for. Control and unknown tokens give nothing
    /// unless `special` is set, then their text.
    pub fn token_to_piece(&self, id: u32, special: bool) -> Result<Cow<'_, [u8]>, TokenizerError> {
        let i = self.check_id(id)?;
        if !special && self.attrs[i].any(TokenAttr::CONTROL | TokenAttr::UNKNOWN) {
            return Ok(Cow::Borrowed(&[]));
        }
        Ok(decode::render_piece(self, i))
    }

    /// Token ids to bytes, as llama.cpp's `llama_detokenize`: `remove_special`
    /// drops a leading BOS / trailing EOS the model adds, `unparse_special`
    /// renders control tokens as their text.
    pub fn detokenize(
        &self,
        ids: &[u32],
        remove_special: bool,
        unparse_special: bool,
    ) -> Result<Vec<u8>, TokenizerError> {
        decode::detokenize(self, ids, remove_special, unparse_special)
    }

    /// Token ids to text, with control tokens left out; bytes that do not
    /// form UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let bytes = self.detokenize(ids, false, false)?;
        Ok(String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
    }

    /// A decoder for generated tokens, fed one id at a time; see [`StreamDecoder`].
    pub fn stream_decoder(&self, special: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, special)
    }

    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// `tokenizer.ggml.model`.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The pre-tokenizer in use (BPE); "default" when the file names none.
    pub fn pre(&self) -> &str {
        &self.pre
    }

    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.specials
    }

    pub fn bos(&self) -> Option<u32> {
        self.specials.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.specials.eos
    }

    pub fn eot(&self) -> Option<u32> {
        self.specials.eot
    }

    /// Whether generation should stop at this token (llama.cpp's EOG set:
    /// EOS, EOT, EOM, FIM pad/repo/file-separator and end-like control tokens).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The end-of-generation tokens, ascending.
    pub fn eog_tokens(&self) -> &[u32] {
        &self.eog
    }

    /// Whether `encode` with `add_special` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode` with `add_special` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// The token's text as stored in the vocabulary.
    pub fn token_text(&self, id: u32) -> Result<&str, TokenizerError> {
        Ok(&self.texts[self.check_id(id)?])
    }

    /// The id of the token with exactly this vocabulary text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied().filter(|&id| (id as usize) < self.texts.len())
    }

    pub fn token_score(&self, id: u32) -> Result<f32, TokenizerError> {
        Ok(self.scores[self.check_id(id)?])
    }

    pub fn token_attr(&self, id: u32) -> Result<TokenAttr, TokenizerError> {
        Ok(self.attrs[self.check_id(id)?])
    }

    /// The token's main type, derived from its attributes.
    pub fn token_type(&self, id: u32) -> Result<TokenType, TokenizerError> {
        let attr = self.token_attr(id)?;
        Ok(if attr.any(TokenAttr::CONTROL) {
            TokenType::Control
        } else if attr.any(TokenAttr::USER_DEFINED) {
            TokenType::UserDefined
        } else if attr.any(TokenAttr::UNKNOWN) {
            TokenType::Unknown
        } else if attr.any(TokenAttr::BYTE) {
            TokenType::Byte
        } else if attr.any(TokenAttr::NORMAL) {
            TokenType::Normal
        } else if attr.any(TokenAttr::UNUSED) {
            TokenType::Unused
        } else {
            TokenType::Undefined
        })
    }

    fn check_id(&self, id: u32) -> Result<usize, TokenizerError> {
        let i = id as usize;
        if i < self.texts.len() {
            Ok(i)
        } else {
            Err(TokenizerError::TokenOutOfRange { id, n_tokens: self.texts.len() })
        }
    }

    /// The token for one byte in SentencePiece fallback: `<0xXX>`, else the
    /// byte as a one-character token (llama.cpp's `byte_to_token`).
    fn byte_token(&self, byte: u8) -> Option<u32> {
        self.hex_byte_tokens[byte as usize].or_else(|| self.ascii_tokens.get(byte as usize).copied().flatten())
    }
}
