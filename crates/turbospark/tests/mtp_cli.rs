//! `--spec-mtp` end to end: on the fixtures whose GGUF carries an MTP layer, `run`, `chat`
//! and `bench` give the same greedy text with the head's guesses as without, and report
//! them; a model without a nextn layer (every other fixture family and the real models) is
//! refused by name, and so is `--spec-mtp` with another drafter.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn turbospark(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_turbospark")).args(args).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// How many dense matrices the run said it packed for the CPU ("dense: N matrices ..."), if any.
fn dense_packed(o: &Output) -> Option<usize> {
    let text = stderr(o);
    let line = text.lines().find_map(|l| l.strip_prefix("dense: "))?;
    line.split_whitespace().next()?.parse().ok()
}

const MTP_FIXTURES: [&str; 4] = [
    "qwen3_5_moe/model-f32.gguf",
    "qwen3_5_moe/model-q8_0.gguf",
    "qwen3_next/model-f32.gguf",
    "qwen3_next/model-q8_0.gguf",
];

#[test]
fn run_and_chat_keep_greedy_output_with_the_mtp_head() {
    for file in MTP_FIXTURES {
        let path = ts_testkit::fixtures_dir().join(file);
        let m = path.to_str().unwrap();
        let run = |extra: &[&str]| {
            let mut args = vec!["run", "-m", m, "-p", "one two three four, one two three", "-n", "32", "--temp", "0"];
            args.extend_from_slice(extra);
            let o = turbospark(&args);
            assert!(o.status.success(), "{file}: {}", stderr(&o));
            o
        };
        let (plain, mtp) = (run(&[]), run(&["--spec-mtp", "--draft-max", "3"]));
        assert_eq!(mtp.stdout, plain.stdout, "{file}: run --spec-mtp changed the text");
        assert!(stderr(&mtp).contains("speculative:") && stderr(&mtp).contains("guesses kept"), "{}", stderr(&mtp));
        // The head is held, and packed with the dense matrices, only with --spec-mtp.
        match (dense_packed(&plain), dense_packed(&mtp)) {
            (Some(without), Some(with)) => {
                assert!(without < with, "{file}: packed {without} without the head, {with} with")
            }
            (None, None) => println!(
                "{file}: no dense matrix packed (float weights, or no AVX-512 VNNI); the head's packing not checked"
            ),
            other => panic!("{file}: dense matrices packed without / with --spec-mtp: {other:?}"),
        }
        // Two chat turns (the second reuses the first's cached prompt, which the head saw).
        let chat = |extra: &[&str]| {
            let mut args = vec!["chat", "-m", m, "--temp", "0", "-n", "16", "-c", "512"];
            args.extend_from_slice(extra);
            let mut child = Command::new(env!("CARGO_BIN_EXE_turbospark"))
                .args(&args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            child.stdin.take().unwrap().write_all(b"Tell me about the sea.\nAnd the mountains?\n").unwrap();
            let o = child.wait_with_output().unwrap();
            assert!(o.status.success(), "{file}: {}", stderr(&o));
            o.stdout
        };
        assert_eq!(chat(&["--spec-mtp"]), chat(&[]), "{file}: chat --spec-mtp changed the replies");
    }
}

#[test]
fn bench_reports_the_mtp_heads_guesses() {
    let path = ts_testkit::fixtures_dir().join("qwen3_5_moe/model-q8_0.gguf");
    let args = ["bench", "-m", path.to_str().unwrap(), "-p", "16", "-n", "24", "-r", "2", "--no-warmup", "--spec-mtp"];
    let o = turbospark(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    let line = text.lines().find(|l| l.starts_with("g24 greedy+spec:")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("guesses kept") && line.contains("tokens per checking step"), "{line}");
    assert!(line.contains("48 tokens") && line.contains("speed-up"), "{line}");
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let o = turbospark(&json_args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let spec = v["tests"].as_array().unwrap().iter().find(|t| t["test"] == "g24 greedy+spec").unwrap();
    let spec = &spec["speculative"];
    assert_eq!(spec["generated"], 48, "{v}");
    assert!(spec["speed_up"].as_f64().unwrap() > 0.0 && spec["tokens_per_step"].as_f64().unwrap() >= 1.0, "{v}");
    assert!(spec["acceptance"].as_f64().unwrap() <= 1.0, "{v}");
}

#[test]
fn spec_mtp_is_refused_without_a_nextn_layer_or_with_another_drafter() {
    // One file of every fixture family without an MTP layer.
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    for f in ts_testkit::fixtures() {
        let has_mtp = f.family == "qwen3_5_moe" || f.family == "qwen3_next";
        if !has_mtp && !files.iter().any(|p| p.parent() == f.model.parent()) {
            files.push(f.model.clone());
        }
    }
    files.extend(
        ["smollm2-135m-instruct-q4_1.gguf", "gemma-3-270m-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]
            .iter()
            .map(|f| ts_testkit::models_dir().join(f)),
    );
    assert!(files.len() >= 10, "{files:?}");
    for path in &files {
        assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
        let o = turbospark(&["run", "-m", path.to_str().unwrap(), "-p", "hi", "-n", "2", "--spec-mtp"]);
        assert!(!o.status.success(), "{}", path.display());
        let e = stderr(&o);
        assert!(e.contains("--spec-mtp") && e.contains("nextn_predict_layers is 0"), "{}: {e}", path.display());
    }
    let mtp = ts_testkit::fixtures_dir().join("qwen3_5_moe/model-q8_0.gguf");
    for other in [&["--spec-ngram"][..], &["--draft-model", mtp.to_str().unwrap()][..]] {
        let mut args = vec!["run", "-m", mtp.to_str().unwrap(), "-p", "hi", "-n", "2", "--spec-mtp"];
        args.extend_from_slice(other);
        let o = turbospark(&args);
        assert!(!o.status.success());
        assert!(stderr(&o).contains("'--spec-mtp' cannot be used with"), "{}", stderr(&o));
    }
}
