//! `run` and `chat` end to end on a real model.

use std::io::Write;
use std::process::{Command, Stdio};

/// A real model from tools/fetch-models.sh (tools/test.sh runs it): absent is a failure.
fn model(file: &str) -> std::path::PathBuf {
    let path = ts_testkit::models_dir().join(file);
    assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
    path
}

#[test]
fn run_streams_a_greedy_continuation_and_reports_speed() {
    let model = model("smollm2-135m-instruct-q4_1.gguf");
    let out = Command::new(env!("CARGO_BIN_EXE_turbospark"))
        .args(["run", "-m", model.to_str().unwrap(), "-p", "The capital of France is", "-n", "8", "--temp", "0"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // llama.cpp's greedy continuation starts " Paris." (tests/data/llama-cpp/greedy.json).
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(" Paris."), "{}", String::from_utf8_lossy(&out.stdout));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tok/s") && stderr.contains("peak RSS"), "{stderr}");
}

#[test]
fn chat_answers_two_turns_through_the_template() {
    let model = model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let mut child = Command::new(env!("CARGO_BIN_EXE_turbospark"))
        .args(["chat", "-m", model.to_str().unwrap(), "--temp", "0", "-n", "48", "-c", "1024"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"What is 2+2? Answer with one number.\nAnd 3+3?\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let replies: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(replies.len() >= 2, "{text}");
    assert!(text.contains('4') && text.contains('6'), "{text}");
    assert!(!text.contains("<|im_end|>") && !text.contains("<|im_start|>"), "{text}");
}

/// `bench` with a drafter generates -n greedy tokens per run without and with prompt lookup
/// (end-of-generation banned), and reports the guesses kept; on a model without a tokenizer
/// it says what is missing. 64 tokens: SmolLM2's greedy text after the seeded random prompt
/// repeats itself within them on both AVX2 and AVX-512 kernels (24 did not on AVX2), so
/// prompt lookup has guesses to make.
#[test]
fn bench_with_a_drafter_reports_both_runs_and_the_guesses() {
    let model = model("smollm2-135m-instruct-q4_1.gguf");
    let out = Command::new(env!("CARGO_BIN_EXE_turbospark"))
        .args([
            "bench",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "16",
            "-n",
            "64",
            "-r",
            "2",
            "--no-warmup",
            "--spec-ngram",
        ])
        .args(["--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tests = v["tests"].as_array().unwrap();
    let find = |name: &str| tests.iter().find(|t| t["test"] == name).unwrap_or_else(|| panic!("no {name}: {v}"));
    assert!(find("g64 greedy")["tokens_per_second"].as_f64().unwrap() > 0.0, "{v}");
    let spec = &find("g64 greedy+spec")["speculative"];
    assert_eq!(spec["generated"], 128, "{v}");
    let (drafted, accepted) = (spec["drafted"].as_u64().unwrap(), spec["accepted"].as_u64().unwrap());
    assert!(accepted <= drafted && spec["steps"].as_u64().unwrap() > 0, "{v}");

    // A drafter option without a drafter is refused by name, before the model loads.
    let out = Command::new(env!("CARGO_BIN_EXE_turbospark"))
        .args(["bench", "-m", model.to_str().unwrap(), "--draft-max", "4"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--draft-max needs a drafter"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
