//! Constrained decoding (structured output): a grammar, compiled by llguidance
//! over the model's vocabulary, allows only the tokens that keep the reply a
//! prefix of a sentence of the grammar. Each step the allowed set is computed
//! on the CPU and every other logit set to -inf before sampling; the sampled
//! token is then committed to the grammar's parser. A sequence without a
//! constraint does none of this.

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use std::sync::Arc;
use ts_tokenizer::{TokenAttr, Tokenizer};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConstraintError {
    /// The grammar or schema cannot be compiled (llguidance's reason).
    #[error("{0}")]
    Compile(String),
    /// The parser failed while generating.
    #[error("constrained decoding failed: {0}")]
    Step(String),
    #[error("constrained decoding needs a vocabulary with an end-of-generation token")]
    NoEndToken,
}

/// What a reply must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// Any JSON object.
    JsonObject,
    /// JSON valid under this schema.
    JsonSchema(Value),
    /// A grammar in llguidance's Lark syntax (which may embed `%json{...}` schemas).
    Lark(String),
}

/// `schema` with llguidance's JSON layout: one line, `", "` between items and `": "` after
/// keys (as Python's json.dumps and the chat templates' `tojson` write it), unless the schema
/// sets its own `x-guidance`. Free whitespace lets a small model put off a required `,` with
/// newlines until its token limit (seen on Qwen2.5-Coder 0.5B), so there is none.
pub fn with_json_options(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(map) = schema.as_object_mut() {
        map.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

impl Grammar {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(with_json_options(&json!({"type": "object"}))),
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_json_options(schema)),
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        }
    }
}

/// The compiler of grammars for one vocabulary: its token trie (each token's
/// bytes; control tokens behind llguidance's 0xFF marker, so that no text
/// spells them) and llguidance's parser factory. Built once per model.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    pub fn new(tokenizer: &Tokenizer) -> Result<Grammars, ConstraintError> {
        let n = tokenizer.vocab_size() as u32;
        let words: Vec<Vec<u8>> = (0..n).map(|id| token_bytes(tokenizer, id)).collect();
        let eog = tokenizer.eog_tokens();
        let first = *eog.first().ok_or(ConstraintError::NoEndToken)?;
        let info = TokRxInfo { tok_bos: tokenizer.bos(), ..TokRxInfo::new(n, first) };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eog);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Compile(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// `grammar` compiled into a fresh [`Constraint`], or llguidance's reason it cannot be.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, ConstraintError> {
        let parser =
            self.factory.create_parser(grammar.top_level()).map_err(|e| ConstraintError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Compile(e));
        }
        Ok(Constraint { matcher })
    }
}

/// A token's bytes for the trie: what it decodes to, or for control and unknown
/// tokens 0xFF and their text (llguidance's convention for special tokens).
fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    let attr = tokenizer.token_attr(id).unwrap_or_default();
    if attr.contains(TokenAttr::CONTROL) || attr.contains(TokenAttr::UNKNOWN) {
        let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        marked.extend_from_slice(tokenizer.token_text(id).unwrap_or_default().as_bytes());
        marked
    } else {
        tokenizer.token_to_piece(id, true).map(|p| p.into_owned()).unwrap_or_default()
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
}

/// A copy with its own lexer caches, so that copies step in parallel without sharing a lock.
impl Clone for Constraint {
    fn clone(&self) -> Constraint {
        Constraint { matcher: self.matcher.deep_clone() }
    }
}

impl Constraint {
    /// Sets the logit of every token the grammar does not allow next to -inf
    /// (end-of-generation tokens are allowed once the grammar may end).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(|e| ConstraintError::Step(e.to_string()))?;
        // 32 tokens per word of the bit set: whole words allowed or banned at once.
        let words = allowed.as_slice();
        for (chunk, &bits) in logits.chunks_mut(32).zip(words) {
            match bits {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                _ => {
                    for (j, l) in chunk.iter_mut().enumerate() {
                        if bits >> j & 1 == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        let covered = (words.len() * 32).min(logits.len());
        logits[covered..].fill(f32::NEG_INFINITY);
        Ok(())
    }

    /// Records the sampled token.
    pub fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.matcher.consume_token(token).map_err(|e| ConstraintError::Step(e.to_string()))
    }

    /// Whether what was generated is a whole sentence of the grammar (more may follow).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether the grammar is complete: nothing may follow what was generated.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}
