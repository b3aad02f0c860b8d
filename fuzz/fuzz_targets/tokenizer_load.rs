//! The tokenizer loader on arbitrary GGUF metadata: loading returns Ok or Err,
//! never panics; a loaded tokenizer encodes and decodes a mixed text without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;

const TEXT: &str = "Hello  world\n\n\tfn main() { 42 }  你好 🦀 <|im_start|>user<s></s><start_of_turn> ÿ\u{200d}";

fuzz_target!(|data: &[u8]| {
    let Ok(gguf) = ts_gguf::parse(data) else { return };
    let Ok(tok) = ts_tokenizer::Tokenizer::from_metadata(&gguf.metadata) else { return };
    for (add, special) in [(false, false), (true, true)] {
        if let Ok(ids) = tok.encode(TEXT, add, special) {
            let _ = tok.decode(&ids);
            let mut stream = tok.stream_decoder(true);
            for &id in &ids {
                let _ = stream.push(id);
            }
            let _ = stream.finish();
        }
    }
    let n = tok.vocab_size() as u32;
    for id in [0, 1, n.saturating_sub(1), n, u32::MAX] {
        let _ = tok.token_to_piece(id, true);
    }
});
