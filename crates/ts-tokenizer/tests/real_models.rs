//! The three real models against ids recorded with llama.cpp's llama-tokenize
//! (tools/tokenizer-reference/gen.sh), plus round trips and streaming decode.

mod common;

use std::fs;
use std::time::Instant;
use ts_tokenizer::Tokenizer;

const MODELS: &[&str] = &["smollm2-135m-instruct-q4_1", "gemma-3-270m-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"];
const TEXTS: &[&str] = &["multilingual", "specials"];

/// Loads a model's tokenizer (tools/fetch-models.sh, which tools/test.sh runs: absent is a failure).
fn load(model: &str) -> Tokenizer {
    let path = common::models_dir().join(format!("{model}.gguf"));
    assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
    let file = ts_gguf::GgufFile::open(&path).unwrap();
    let start = Instant::now();
    let tok = Tokenizer::from_metadata(file.metadata()).unwrap();
    println!("{model}: {} tokens loaded in {:.1?}", tok.vocab_size(), start.elapsed());
    tok
}

fn text(name: &str) -> String {
    fs::read_to_string(common::data_dir().join(format!("{name}.txt"))).unwrap()
}

/// llama-tokenize's `--ids` output: `[1, 2, 3]`.
fn expected(model: &str, text: &str, variant: &str) -> Vec<u32> {
    let path = common::data_dir().join(format!("expected/{model}.{text}.{variant}.ids"));
    let raw = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let list = raw.trim().trim_start_matches('[').trim_end_matches(']');
    list.split(',').filter(|s| !s.trim().is_empty()).map(|s| s.trim().parse().unwrap()).collect()
}

#[test]
fn ids_match_llama_tokenize() {
    let mut mismatches = Vec::new();
    for model in MODELS {
        let tok = load(model);
        for name in TEXTS {
            let input = text(name);
            // llama-tokenize adds specials only as BOS, and only when the model asks for it.
            let variants =
                [("plain", false, false), ("add-special", tok.add_bos(), false), ("parse-special", false, true)];
            for (variant, add_special, parse_special) in variants {
                let want = expected(model, name, variant);
                let start = Instant::now();
                let got = tok.encode(&input, add_special, parse_special).unwrap();
                let elapsed = start.elapsed();
                if got == want {
                    println!("  {name}.{variant}: {} ids identical ({elapsed:.1?})", got.len());
                } else {
                    let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
                    mismatches.push(format!(
                        "{model} {name}.{variant}: first difference at {at}: got {:?}, want {:?}",
                        &got[at..(at + 8).min(got.len())],
                        &want[at..(at + 8).min(want.len())]
                    ));
                }
            }
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

#[test]
fn decode_round_trips_and_streams() {
    for model in MODELS {
        let tok = load(model);
        let input = text("multilingual");
        let ids = tok.encode(&input, false, false).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), input, "{model}: decode(encode(text))");

        let mut decoder = tok.stream_decoder(false);
        let mut streamed = String::new();
        let mut held_back = 0;
        for &id in &ids {
            let chunk = decoder.push(id).unwrap();
            if decoder.has_pending() {
                held_back += 1;
            }
            streamed.push_str(&chunk);
        }
        streamed.push_str(&decoder.finish());
        assert_eq!(streamed, input, "{model}: streamed decode");
        println!("{model}: {} ids streamed, a character was incomplete after {held_back} of them", ids.len());
    }
}

#[test]
fn special_tokens_of_the_real_models() {
    {
        let tok = load("qwen2.5-coder-0.5b-instruct-q4_k_m");
        let im_end = tok.token_id("<|im_end|>").unwrap();
        let endoftext = tok.token_id("<|endoftext|>").unwrap();
        assert_eq!(tok.eos(), Some(im_end));
        assert_eq!(tok.bos(), Some(endoftext));
        assert_eq!(tok.eot(), Some(im_end));
        assert!(!tok.add_bos());
        // llama.cpp's EOG set for this model (its load log).
        assert_eq!(tok.eog_tokens(), &[128247, 151643, 151645, 151662, 151663, 151664]);
        assert_eq!(tok.special_tokens().newline, Some(198));
        assert_eq!(tok.token_to_piece(im_end, false).unwrap().as_ref(), b"");
        assert_eq!(tok.token_to_piece(im_end, true).unwrap().as_ref(), b"<|im_end|>");
    }
    {
        let tok = load("gemma-3-270m-q4_k_m");
        assert_eq!(tok.bos(), Some(2));
        assert_eq!(tok.eos(), Some(1));
        assert_eq!(tok.eot(), Some(106));
        assert!(tok.add_bos());
        assert_eq!(tok.eog_tokens(), &[1, 106, 212]);
        assert_eq!(tok.special_tokens().newline, Some(248));
        assert_eq!(tok.encode("", true, false).unwrap(), [2]);
    }
    {
        let tok = load("smollm2-135m-instruct-q4_1");
        assert_eq!(tok.bos(), Some(1));
        assert_eq!(tok.eos(), Some(2));
        assert_eq!(tok.eog_tokens(), &[0, 2, 4]);
        // The file names no EOT. llama.cpp takes the first end-like token its
        // hash map yields (here `<|endoftext|>` with libstdc++); the fixed
        // preference order used instead picks `<|im_end|>`. Both end generation.
        assert_eq!(tok.eot(), tok.token_id("<|im_end|>"));
        assert!(tok.is_eog(2) && !tok.is_eog(1));
    }
}
