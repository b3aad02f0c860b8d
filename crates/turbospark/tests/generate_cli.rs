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
