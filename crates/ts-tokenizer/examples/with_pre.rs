//! Copies the metadata of a tensor-less (vocabulary-only) GGUF file with
//! `tokenizer.ggml.pre` replaced, so that llama.cpp can be asked how it splits
//! text for pre-tokenizers no shipped vocabulary uses.
//!
//! cargo run -p ts-tokenizer --example with_pre -- IN.gguf PRE OUT.gguf

use std::process::ExitCode;
use ts_gguf::{GgufFile, GgufWriter, Value};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, pre, output] = args.as_slice() else {
        eprintln!("usage: with_pre IN.gguf PRE OUT.gguf");
        return ExitCode::FAILURE;
    };
    let file = match GgufFile::open(input) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{input}: {e}");
            return ExitCode::FAILURE;
        }
    };
    if !file.tensors().is_empty() {
        eprintln!("{input}: has tensors; only vocabulary-only files are copied");
        return ExitCode::FAILURE;
    }
    let mut writer = GgufWriter::new();
    let mut result = Ok(());
    for (key, value) in file.metadata().iter() {
        result = result.and_then(|_| writer.set(key, value.clone()));
    }
    let written = result
        .and_then(|_| writer.set("tokenizer.ggml.pre", Value::String(pre.clone())))
        .and_then(|_| writer.to_bytes(&[]))
        .and_then(|bytes| std::fs::write(output, bytes));
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{output}: {e}");
            ExitCode::FAILURE
        }
    }
}
