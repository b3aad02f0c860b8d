//! Invalid metadata gives errors that name the problem; nothing panics, on
//! bad metadata or on random input.

mod common;

use common::{bpe_metadata, metadata, spm_metadata, string, strings};
use ts_gguf::{Array, Metadata, Value};
use ts_tokenizer::Tokenizer;

fn error_of(md: &Metadata) -> String {
    Tokenizer::from_metadata(md).unwrap_err().to_string()
}

fn assert_mentions(md: &Metadata, needle: &str) {
    let message = error_of(md);
    assert!(message.contains(needle), "error {message:?} does not mention {needle:?}");
}

#[test]
fn unsupported_models_and_pre_tokenizers_are_named() {
    let mut md = bpe_metadata(&["a"], &[]);
    md.insert("tokenizer.ggml.model".into(), string("bert"));
    assert_eq!(error_of(&md), "tokenizer model 'bert' is not supported");
    md.insert("tokenizer.ggml.model".into(), string("gpt2"));
    md.insert("tokenizer.ggml.pre".into(), string("xyz"));
    assert_eq!(error_of(&md), "pre-tokenizer 'xyz' is not supported");
    md.insert("tokenizer.ggml.pre".into(), string("kimi-k2"));
    assert_eq!(error_of(&md), "pre-tokenizer 'kimi-k2' is not supported");
}

#[test]
fn missing_and_mistyped_keys_are_named() {
    assert_mentions(&Metadata::default(), "tokenizer.ggml.model");
    assert_mentions(&metadata(vec![("tokenizer.ggml.model", string("llama"))]), "tokenizer.ggml.tokens");
    let md = metadata(vec![("tokenizer.ggml.model", string("gpt2")), ("tokenizer.ggml.tokens", strings(&["a"]))]);
    assert_mentions(&md, "tokenizer.ggml.merges");
    let md = metadata(vec![("tokenizer.ggml.model", string("llama")), ("tokenizer.ggml.tokens", Value::U32(3))]);
    assert_mentions(&md, "tokenizer.ggml.tokens");
    let md = metadata(vec![("tokenizer.ggml.model", Value::Bool(true))]);
    assert_mentions(&md, "tokenizer.ggml.model");
    let mut md = spm_metadata(&[]);
    md.insert("tokenizer.ggml.add_bos_token".into(), Value::U8(1));
    assert_mentions(&md, "tokenizer.ggml.add_bos_token");
    md = spm_metadata(&[]);
    md.insert("tokenizer.ggml.scores".into(), Value::Array(Array::String(vec!["x".into(); 259])));
    assert_mentions(&md, "tokenizer.ggml.scores");
    md = spm_metadata(&[]);
    md.insert("tokenizer.ggml.token_type".into(), Value::Array(Array::F32(vec![1.0; 259])));
    assert_mentions(&md, "tokenizer.ggml.token_type");
}

#[test]
fn length_mismatches_are_named() {
    let mut md = spm_metadata(&[]);
    md.insert("tokenizer.ggml.scores".into(), Value::Array(Array::F32(vec![0.0; 3])));
    assert_mentions(&md, "tokenizer.ggml.scores");
    let mut md = spm_metadata(&[]);
    md.insert("tokenizer.ggml.token_type".into(), Value::Array(Array::I32(vec![1; 1000])));
    assert_mentions(&md, "tokenizer.ggml.token_type");
    assert_mentions(&bpe_metadata(&[], &[]), "tokenizer.ggml.tokens");
}

#[test]
fn bad_token_ids_are_named() {
    for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"] {
        let mut md = spm_metadata(&[]);
        md.insert(key.into(), Value::U32(259));
        assert_mentions(&md, key);
        md.insert(key.into(), Value::I32(-1));
        assert_mentions(&md, key);
    }
}

#[test]
fn malformed_merges_and_duplicates_are_errors() {
    assert_mentions(&bpe_metadata(&["a", "b", "ab"], &["a b", "ab"]), "tokenizer.ggml.merges");
    assert_mentions(&bpe_metadata(&["a", "b", "ab"], &[""]), "tokenizer.ggml.merges");
    assert_mentions(&bpe_metadata(&["a", "b", "a"], &[]), "tokenizer.ggml.tokens");
}

#[test]
fn missing_bos_is_an_error_only_when_it_is_added() {
    let mut md = bpe_metadata(&["a"], &[]);
    md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
    let tok = Tokenizer::from_metadata(&md).unwrap();
    assert_eq!(tok.encode("a", false, false).unwrap(), [0]);
    assert!(tok.encode("a", true, false).unwrap_err().to_string().contains("BOS"));
}

/// xorshift64*: reproducible randomness without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn text(&mut self, max_chars: usize) -> String {
        const PIECES: &[&str] = &[
            "a",
            "b",
            "ab",
            " ",
            "  ",
            "\n",
            "\r\n",
            "\t",
            "Ġ",
            "▁",
            "é",
            "中",
            "😀",
            "\u{301}",
            "1",
            "23",
            "'s",
            "<",
            ">",
            "<s>",
            "</s>",
            "<|im_end|>",
            "<0x41>",
            "!",
            "\u{a0}",
            "\u{3000}",
            "\u{200d}",
            "\u{10ffff}",
            "",
        ];
        (0..self.below(max_chars + 1)).map(|_| PIECES[self.below(PIECES.len())]).collect()
    }
}

/// Random vocabularies and inputs: loading either fails with an error or
/// gives a tokenizer whose encode and decode never panic.
#[test]
fn random_metadata_never_panics() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let models = ["llama", "gpt2", "gemma4", "bert", ""];
    let pres =
        ["default", "gpt-2", "llama-bpe", "qwen2", "qwen35", "smollm", "gpt-4o", "deepseek-llm", "tekken", "poro-chat"];
    let mut loaded = 0;
    for _ in 0..3000 {
        let n_tokens = rng.below(40);
        let mut tokens: Vec<String> = Vec::new();
        for i in 0..n_tokens {
            let text = rng.text(3);
            // Mostly distinct texts, so that most vocabularies load.
            tokens.push(if tokens.contains(&text) && rng.below(8) > 0 { format!("{text}{i}") } else { text });
        }
        let mut md = metadata(vec![
            ("tokenizer.ggml.model", string(models[rng.below(models.len())])),
            ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens.clone()))),
        ]);
        if rng.below(2) == 0 {
            md.insert("tokenizer.ggml.pre".into(), string(pres[rng.below(pres.len())]));
        }
        if rng.below(3) > 0 {
            let merges = (0..rng.below(60)).map(|_| format!("{} {}", rng.text(2), rng.text(2))).collect();
            md.insert("tokenizer.ggml.merges".into(), Value::Array(Array::String(merges)));
        }
        if rng.below(2) == 0 {
            let scores =
                (0..n_tokens + usize::from(rng.below(8) == 0)).map(|_| (rng.next() % 1000) as f32 / -100.0).collect();
            md.insert("tokenizer.ggml.scores".into(), Value::Array(Array::F32(scores)));
        }
        if rng.below(2) == 0 {
            let types = (0..n_tokens).map(|_| rng.below(9) as i32 - 1).collect();
            md.insert("tokenizer.ggml.token_type".into(), Value::Array(Array::I32(types)));
        }
        for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if rng.below(2) == 0 {
                md.insert(key.into(), Value::U32(rng.below(n_tokens + 1) as u32));
            }
        }
        for key in ["tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix"] {
            if rng.below(2) == 0 {
                md.insert(key.into(), Value::Bool(rng.below(2) == 0));
            }
        }
        let Ok(tok) = Tokenizer::from_metadata(&md) else { continue };
        loaded += 1;
        for _ in 0..10 {
            let text = rng.text(30);
            let add_special = rng.below(2) == 0;
            if let Ok(ids) = tok.encode(&text, add_special, rng.below(2) == 0) {
                assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
                tok.decode(&ids).unwrap();
            }
            let ids: Vec<u32> = (0..rng.below(8)).map(|_| rng.below(n_tokens + 3) as u32).collect();
            let _ = tok.detokenize(&ids, rng.below(2) == 0, rng.below(2) == 0);
            let mut stream = tok.stream_decoder(rng.below(2) == 0);
            for id in ids {
                let _ = stream.push(id);
            }
            stream.finish();
        }
    }
    println!("{loaded} of 3000 random vocabularies loaded");
    assert!(loaded > 400, "only {loaded} random vocabularies loaded");
}
