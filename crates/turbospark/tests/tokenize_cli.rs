//! `turbospark tokenize` prints the ids llama.cpp's `llama-tokenize --ids`
//! printed for the same model, text and flags (committed by
//! tools/tokenizer-reference/gen.sh), and refuses bad input with one line.

use std::path::{Path, PathBuf};
use std::process::Command;

fn tokenizer_data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ts-tokenizer/tests/data")
}

fn turbospark(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_turbospark")).args(args).output().unwrap()
}

#[test]
fn ids_match_llama_tokenize() {
    let models = ["smollm2-135m-instruct-q4_1", "gemma-3-270m-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"];
    // variant name and our flags, as gen.sh ran llama-tokenize
    let variants: [(&str, &[&str]); 3] = [
        ("plain", &["--no-bos", "--no-parse-special"]),
        ("add-special", &["--no-parse-special"]),
        ("parse-special", &["--no-bos"]),
    ];
    let mut checked = 0;
    for model in models {
        let path = ts_testkit::models_dir().join(format!("{model}.gguf"));
        assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
        for text in ["multilingual", "specials"] {
            for (variant, flags) in variants {
                let expected_file = tokenizer_data().join(format!("expected/{model}.{text}.{variant}.ids"));
                let expected = std::fs::read_to_string(&expected_file).unwrap();
                let text_file = tokenizer_data().join(format!("{text}.txt"));
                let mut args = vec!["tokenize", "-m", path.to_str().unwrap(), "-f", text_file.to_str().unwrap()];
                args.extend_from_slice(flags);
                let out = turbospark(&args);
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
                assert_eq!(String::from_utf8(out.stdout).unwrap().trim(), expected.trim(), "{model} {text} {variant}");
                checked += 1;
            }
        }
    }
    println!("{checked} model/text/flag combinations match llama-tokenize");
}

#[test]
fn bad_input_gets_one_line_errors() {
    let cases: [(&[&str], &str); 3] = [
        (&["tokenize", "-m", "/nonexistent.gguf", "-p", "hi"], "/nonexistent.gguf"),
        (&["tokenize", "-m", "/dev/null", "-p", "hi"], "not a regular file"),
        (&["inspect"], "no model given"),
    ];
    for (args, expected) in cases {
        let out = turbospark(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: ") && stderr.contains(expected), "{args:?}: {stderr}");
        // Said once: an OS error is part of the message, not repeated as its cause.
        assert_eq!(ts_testkit::repeated_part(&stderr), None, "{args:?}: {stderr}");
    }
    let out = turbospark(&["--device", "tpu", "inspect", "x.gguf"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--device tpu: expected `cpu`, `cuda` or `cuda:N`"));
    // Without a CUDA driver (CI), asking a computing command for the GPU is one line naming what is missing.
    let model = ts_testkit::models_dir().join("smollm2-135m-instruct-q4_1.gguf");
    assert!(model.exists(), "{} is absent: run tools/fetch-models.sh", model.display());
    let out = turbospark(&["--device", "cuda:0", "run", "-m", model.to_str().unwrap(), "-p", "hi", "-n", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.starts_with("error: --device cuda:0: ") && stderr.contains("CUDA"), "{stderr}");
    }
}
