//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

#[allow(unused_imports)]
pub use ts_testkit::models_dir;

/// Committed test data.
pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

use ts_gguf::{Array, Metadata, Value};

pub fn metadata(entries: Vec<(&str, Value)>) -> Metadata {
    let mut md = Metadata::default();
    for (key, value) in entries {
        md.insert(key.to_string(), value);
    }
    md
}

pub fn strings(items: &[&str]) -> Value {
    Value::Array(Array::String(items.iter().map(|s| s.to_string()).collect()))
}

pub fn string(s: &str) -> Value {
    Value::String(s.to_string())
}

/// A small SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte
/// tokens, then `extra` as (text, score, token type).
pub fn spm_metadata(extra: &[(&str, f32, i32)]) -> Metadata {
    let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    let mut scores = vec![0.0f32; 3];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    for &(text, score, ty) in extra {
        tokens.push(text.to_string());
        scores.push(score);
        types.push(ty);
    }
    metadata(vec![
        ("tokenizer.ggml.model", string("llama")),
        ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))),
        ("tokenizer.ggml.scores", Value::Array(Array::F32(scores))),
        ("tokenizer.ggml.token_type", Value::Array(Array::I32(types))),
    ])
}

/// A small byte-level BPE vocabulary with the gpt-2 pre-tokenizer.
pub fn bpe_metadata(tokens: &[&str], merges: &[&str]) -> Metadata {
    metadata(vec![
        ("tokenizer.ggml.model", string("gpt2")),
        ("tokenizer.ggml.pre", string("gpt-2")),
        ("tokenizer.ggml.tokens", strings(tokens)),
        ("tokenizer.ggml.merges", strings(merges)),
    ])
}
