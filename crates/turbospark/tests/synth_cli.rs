//! `synth` end to end: a cut-down file the engine runs (`logits`, `bench`) and llama.cpp's
//! llama-bench runs too (ignored unless asked for: CI has no llama.cpp); bad names are
//! refused with the choices.

use std::path::PathBuf;
use std::process::{Command, Output};

fn turbospark(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_turbospark")).args(args).output().unwrap()
}

/// A file in the temporary directory, removed when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// llama.cpp's llama-bench: `$LLAMA_BENCH`, `$LLAMA_CPP_DIR/build/bin/llama-bench`, or on the PATH.
fn llama_bench() -> Option<PathBuf> {
    let from_env = std::env::var_os("LLAMA_BENCH").map(PathBuf::from);
    let from_dir = std::env::var_os("LLAMA_CPP_DIR").map(|d| PathBuf::from(d).join("build/bin/llama-bench"));
    let on_path = std::env::var_os("PATH")
        .and_then(|p| std::env::split_paths(&p).map(|d| d.join("llama-bench")).find(|f| f.is_file()));
    from_env.into_iter().chain(from_dir).chain(on_path).find(|f| f.is_file())
}

/// One layer of qwen3-30b-a3b, written by `synth` to a temporary file.
fn cut_down_model(tag: &str) -> TempFile {
    let file = TempFile(std::env::temp_dir().join(format!("synth-cli-{tag}-{}.gguf", std::process::id())));
    let path = file.0.to_str().unwrap();
    let out = turbospark(&["synth", "--like", "qwen3-30b-a3b", "--layers", "1", "--seed", "3", "-o", path]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("wrote") && stdout.contains("qwen3-30b-a3b: 1 layer,"), "{stdout}");
    file
}

#[test]
fn writes_a_cut_down_model_the_engine_runs() {
    let file = cut_down_model("engine");
    let path = file.0.to_str().unwrap();

    let out = turbospark(&["logits", "-m", path, "--tokens", "1,2,3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let logits = json["logits"][0].as_array().unwrap();
    assert_eq!(logits.len(), 151_936);
    assert!(logits.iter().all(|x| x.as_f64().is_some_and(f64::is_finite)));

    let out = turbospark(&["bench", "-m", path, "-p", "4", "-n", "2", "-r", "1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("| qwen3moe |"));

    // Several sequences generating at once (llama-batched-bench's -npl).
    let out = turbospark(&["bench", "-m", path, "-p", "4", "-n", "2", "-r", "1", "--parallel", "1,3", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tests: Vec<&str> = json["tests"].as_array().unwrap().iter().map(|t| t["test"].as_str().unwrap()).collect();
    assert_eq!(tests, ["pp4", "tg2", "tg2 x1", "tg2 x3"]);
    for t in json["tests"].as_array().unwrap() {
        let tps = t["tokens_per_second"].as_f64().unwrap();
        assert!(tps.is_finite() && tps > 0.0, "{t}");
    }
    let out = turbospark(&["bench", "-m", path, "-p", "0", "-n", "2", "--parallel", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--parallel"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
#[ignore = "needs llama.cpp's llama-bench (LLAMA_BENCH, LLAMA_CPP_DIR or the PATH)"]
fn llama_bench_runs_the_cut_down_model() {
    let bench = llama_bench().expect("llama-bench not found: set LLAMA_BENCH or LLAMA_CPP_DIR, or put it on the PATH");
    let file = cut_down_model("llama-bench");
    let path = file.0.to_str().unwrap();
    let out = Command::new(&bench).args(["-m", path, "-p", "16", "-n", "8", "-t", "2"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("qwen3moe") && stdout.contains("tg8"), "{stdout}");
    eprintln!("{}", stdout.lines().filter(|l| l.contains("qwen3moe")).collect::<Vec<_>>().join("\n"));
}

#[test]
fn dry_run_prints_the_full_size() {
    let out = turbospark(&["synth", "--like", "gpt-oss-20b", "--dry-run"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("24 layers, 32 experts (top 4), 459 tensors, 11.27 GiB"), "{stdout}");
    // With an output named too, nothing is written.
    let path = std::env::temp_dir().join(format!("ts-dry-run-{}.gguf", std::process::id()));
    let out = turbospark(&["synth", "--like", "gemma4-26b-a4b", "--dry-run", "-o", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("658 tensors, 15.63 GiB (not written)"));
    assert!(!path.exists(), "--dry-run wrote {}", path.display());
}

#[test]
fn unknown_choices_are_refused_in_one_line() {
    for (args, choices) in [
        (
            ["--like", "llama-70b", "--seed=1"],
            "gpt-oss-20b, gpt-oss-120b, qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b",
        ),
        (["--like", "mixtral-8x7b", "--quant=iq2_xs"], "q4_0, q4_k, q5_k, q6_k, q8_0, mxfp4"),
        (["--like", "mixtral-8x7b", "--routing=zipf"], "skewed, uniform"),
    ] {
        let out = turbospark(&[&["synth"][..], &args, &["--dry-run"]].concat());
        assert_eq!(out.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.starts_with("error: ") && stderr.contains(choices), "{stderr}");
    }
}
