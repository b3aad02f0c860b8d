//! `run` and `chat` end to end on a real model.

use std::io::Write;
use std::process::{Command, Stdio};

/// Held by every test here (each process runs two threads of model work): run side by side on
/// a 2-core machine, the others' threads distorted the step timer's figures against bench's.
static BUSY: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The lock of [`BUSY`], also after another holder's test failed.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    BUSY.lock().unwrap_or_else(|e| e.into_inner())
}

/// A real model from tools/fetch-models.sh (tools/test.sh runs it): absent is a failure.
fn model(file: &str) -> std::path::PathBuf {
    let path = ts_testkit::models_dir().join(file);
    assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
    path
}

#[test]
fn run_streams_a_greedy_continuation_and_reports_speed() {
    let _alone = alone();
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

/// `-ctk`/`-ctv` as llama.cpp spells them: f16 caches (the default) and f32 ones both give
/// llama.cpp's greedy start; keys and values of two types, a type this engine does not have,
/// and either flag on the GPU (before anything loads) are refused by name.
#[test]
fn cache_types_take_llama_cpp_flags() {
    let _alone = alone();
    let model = model("smollm2-135m-instruct-q4_1.gguf");
    let run = |flags: &[&str]| {
        let mut args = vec!["run", "-m", model.to_str().unwrap(), "-p", "The capital of France is", "-n", "4"];
        args.extend_from_slice(&["--temp", "0"]);
        args.extend_from_slice(flags);
        Command::new(env!("CARGO_BIN_EXE_turbospark")).args(&args).output().unwrap()
    };
    for flags in [&[][..], &["-ctk", "f32", "-ctv", "f32"][..], &["--cache-type-k", "f16"][..]] {
        let out = run(flags);
        assert!(out.status.success(), "{flags:?}: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.starts_with(" Paris"), "{flags:?}: {text:?}");
    }
    for (flags, expected) in [
        (&["-ctk", "f16", "-ctv", "f32"][..], "keys and values take one type here"),
        (&["-ctk", "q8_0"][..], "invalid value 'q8_0'"),
        (&["--device", "cuda", "-ctk", "f32"][..], "the GPU keeps keys and values in its own"),
    ] {
        let out = run(flags);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(expected), "{flags:?}: {stderr}");
    }
}

#[test]
fn chat_answers_two_turns_through_the_template() {
    let _alone = alone();
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
    let _alone = alone();
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

/// `bench -t 1,2` (llama-bench's thread lists) loads the model once and runs every test at each
/// count, one JSON object per count; the table has a row per count and test. Other commands
/// refuse a list by name, and every command a count of 0.
#[test]
fn bench_runs_each_thread_count_of_a_list() {
    let _alone = alone();
    let model = model("smollm2-135m-instruct-q4_1.gguf");
    let bench = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_turbospark"))
            .args(["bench", "-m", model.to_str().unwrap(), "-t", "1,2", "-p", "8", "-n", "4", "-r", "1"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = bench(&["--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let runs: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(runs.iter().map(|r| r["threads"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2]);
    for r in &runs {
        let tests: Vec<&str> = r["tests"].as_array().unwrap().iter().map(|t| t["test"].as_str().unwrap()).collect();
        assert_eq!(tests, ["pp8", "tg4"], "{r}");
        assert!(r["tests"][1]["tokens_per_second"].as_f64().unwrap() > 0.0, "{r}");
    }
    // `-d` (llama-bench's depth): each test again after that many tokens, named so.
    let out = bench(&["--json", "-d", "0,16"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let first: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    let tests: Vec<&str> = first["tests"].as_array().unwrap().iter().map(|t| t["test"].as_str().unwrap()).collect();
    assert_eq!(tests, ["pp8", "tg4", "pp8 @ d16", "tg4 @ d16"], "{first}");
    assert!(
        first["tests"].as_array().unwrap().iter().all(|t| t["tokens_per_second"].as_f64().unwrap() > 0.0),
        "{first}"
    );
    let out = bench(&[]);
    let table = String::from_utf8_lossy(&out.stdout);
    for (threads, test) in [(1, "pp8"), (1, "tg4"), (2, "pp8"), (2, "tg4")] {
        assert!(table.contains(&format!("| cpu | {threads} | resident | {test} |")), "{table}");
    }
    let refused = |args: &[&str], says: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{args:?}: {err}");
    };
    let m = model.to_str().unwrap();
    refused(&["run", "-m", m, "-t", "1,2", "-p", "hi", "-n", "1"], "a list of thread counts is for `bench`");
    refused(&["tokenize", "-m", m, "-t", "2,4", "-p", "hi"], "a list of thread counts is for `bench`");
    refused(&["bench", "-m", m, "-t", "2,0"], "each count must be at least 1");
    // -c sizes every test's sequence; a test that needs more positions is refused by name.
    refused(&["bench", "-m", m, "-p", "16", "-n", "4", "-r", "1", "-c", "12"], "pp16 needs 16 positions");
}

/// `TURBOSPARK_CPU_TIMING=1` (a measurement knob) prints where decode steps' time goes every 64
/// steps: the phases and the rest add up to the step's wall time, the step's wall time agrees
/// with the tok/s `bench` reports (the mean of 64 steps against all of them, within 30%), and
/// the threads' idle shares (in all and by phase) are fractions; a prompt's batches are reported
/// apart, every 8.
#[test]
fn cpu_timing_accounts_for_a_decode_step() {
    let _alone = alone();
    let model = model("smollm2-135m-instruct-q4_1.gguf");
    // `bench` at 2 threads with the knob on: its stdout and its last timing line.
    let timed = |tests: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_turbospark"))
            .args(["bench", "-m", model.to_str().unwrap(), "-t", "2"])
            .args(tests)
            .env("TURBOSPARK_CPU_TIMING", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        let line =
            stderr.lines().rfind(|l| l.starts_with("cpu timing:")).unwrap_or_else(|| panic!("no report: {stderr}"));
        (out.stdout, line.to_string())
    };
    let (stdout, line) = timed(&["-p", "0", "-n", "128", "-r", "1", "--json"]);
    let wall = check_cpu_timing_line(&line, &[]);
    let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    let tps = v["tests"][0]["tokens_per_second"].as_f64().unwrap();
    let step_ms = 1000.0 / tps;
    assert!((wall - step_ms).abs() < 0.3 * step_ms, "a step of {wall} ms against {step_ms} ms from bench: {line}");
    // A prompt's batches are counted apart (a report every 8).
    let (_, line) = timed(&["-p", "32", "-n", "0", "-r", "8"]);
    assert!(line.starts_with("cpu timing: 8 steps of 32 rows,"), "{line}");
    check_cpu_timing_line(&line, &[32.0]);
}

/// Checks a `TURBOSPARK_CPU_TIMING` line of a 2-thread run (`rows`: the batch's row count
/// where the line names one) and returns its wall time a step: the phases add up to it, and
/// the idle shares are shares.
fn check_cpu_timing_line(line: &str, rows: &[f64]) -> f64 {
    // Every number of the line, in order: steps, [rows], wall, regions, the thirteen phases and the
    // rest, threads, idle, thread-ms, percent, the percent of each of the six phases with
    // products, then the team's ten (its regions' wall time, that of the products', head's and
    // attention's, the leader's wait at their ends, a follower's lag behind a region's start and
    // the regions it saw, teams formed, a follower's delay joining one and the last's).
    let numbers: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|s| !s.is_empty() && *s != ".")
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(numbers.len(), 37 + rows.len(), "{line}");
    assert_eq!(&numbers[1..1 + rows.len()], rows, "{line}");
    let numbers = [&numbers[..1], &numbers[1 + rows.len()..]].concat();
    let (wall, regions, phases) = (numbers[1], numbers[2], &numbers[3..17]);
    // SmolLM2's 30 layers run each of their products in a region of its own.
    assert!(regions >= 30.0, "{regions} regions a step: {line}");
    let sum: f64 = phases.iter().sum();
    assert!((sum - wall).abs() < 0.01 * wall + 0.002, "phases {sum} against a step of {wall}: {line}");
    assert!(phases[0] > 0.0 && phases[1] > 0.0, "no products or head time: {line}");
    // One-row steps quantize their products' inputs on the step's thread.
    assert!(!rows.is_empty() || phases[11] > 0.0, "no quantizing in one-row steps: {line}");
    assert_eq!(numbers[17], 2.0, "{line}");
    assert!(numbers[18] <= numbers[19] && numbers[20] <= 100.0, "{line}");
    assert!(numbers[21..27].iter().all(|&p| (0.0..=100.0).contains(&p)), "{line}");
    let team = &numbers[27..];
    // The team's regions within the step, the products' within their phase, the leader's wait within the regions.
    assert!(team[0] <= wall * 1.01 && team[1] <= phases[0] * 1.01 && team[4] <= team[0], "{line}");
    assert!(team[6] >= 30.0, "a follower saw {} regions a step: {line}", team[6]);
    wall
}
