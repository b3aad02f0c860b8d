//! `turbospark serve` as a user starts it: flags, the address it prints, a
//! request, and refusals of bad flags.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

/// A real model from tools/fetch-models.sh (tools/test.sh runs it): absent is a failure.
fn model(file: &str) -> std::path::PathBuf {
    let path = ts_testkit::models_dir().join(file);
    assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
    path
}

#[test]
fn serve_starts_prints_its_address_and_answers() {
    let model = model("smollm2-135m-instruct-q4_1.gguf");
    let mut child = Command::new(env!("CARGO_BIN_EXE_turbospark"))
        .args(["serve", "-m", model.to_str().unwrap(), "--port", "0", "--parallel", "2", "-c", "1024", "-t", "2"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    // Load-time notes (weights repacked for the CPU) may come first.
    let line = lines.by_ref().map(|l| l.unwrap()).find(|l| l.starts_with("serving")).expect("a serving line");
    // "serving smollm2-135m-instruct-q4_1 on http://127.0.0.1:PORT (2 slots x 512 tokens of context)"
    assert!(line.contains("2 slots x 512 tokens"), "{line}");
    let addr = line.split("http://").nth(1).unwrap().split_whitespace().next().unwrap().to_string();
    let body = r#"{"model": "smollm2-135m-instruct-q4_1", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}"#;
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(s, "POST /v1/completions HTTP/1.0\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(reply.starts_with("HTTP/1.0 200"), "{reply}");
    assert!(reply.contains(r#""text":" Paris."#), "{reply}");
    // One log line per request.
    std::thread::spawn(move || lines.for_each(drop));
}

#[test]
fn serve_refuses_bad_flags_by_name() {
    let model = model("smollm2-135m-instruct-q4_1.gguf");
    let path = model.to_str().unwrap();
    for (args, expected) in [
        (vec!["--parallel", "0"], "--parallel must be at least 1"),
        (vec!["--max-body", "lots"], "--max-body lots"),
        (vec!["--host", "not an address"], "--host not an address"),
        (vec!["--parallel", "64", "-c", "512"], "raise -c"),
        (vec!["--draft-model", "/nonexistent/draft.gguf"], "--draft-model: /nonexistent/draft.gguf: No such file"),
        (vec!["--draft-max", "4"], "--draft-max needs a drafter"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_turbospark"))
            .args(["serve", "-m", path, "--port", "0"])
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr.lines().last().unwrap_or_default().contains(expected), "{args:?}: {stderr}");
    }
}
