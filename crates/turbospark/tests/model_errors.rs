//! Bad models and bad requests get one-line errors that name the problem.

use std::path::{Path, PathBuf};
use std::process::Command;
use ts_gguf::{GgmlType, Value};

fn turbospark(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn fixture() -> PathBuf {
    ts_testkit::fixtures_dir().join("qwen2/model-f32.gguf")
}

/// Runs `args`, which must fail with one line `error: ...` containing `expected`, each part
/// of it said once.
fn expect_error(args: &[&str], expected: &str) {
    let (ok, stderr) = turbospark(args);
    assert!(!ok, "{args:?} succeeded");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{args:?}: {stderr}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(expected),
        "{args:?}: expected {expected:?} in {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(ts_testkit::repeated_part(lines[0]), None, "said twice in {stderr}");
}

fn variant(name: &str, edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<ts_testkit::TensorEntry>)) -> PathBuf {
    variant_of(&fixture(), name, edit)
}

/// A copy of `fixture` edited by `edit`, in the temporary directory.
fn variant_of(
    fixture: &Path,
    name: &str,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<ts_testkit::TensorEntry>),
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ts-model-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.gguf"));
    ts_testkit::rewrite_gguf(fixture, &path, edit).unwrap();
    path
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn unknown_architecture() {
    let p = variant("arch", |md, _| {
        let arch = md.iter_mut().find(|(k, _)| k == "general.architecture").unwrap();
        arch.1 = Value::String("mamba9".into());
    });
    expect_error(&["logits", "-m", s(&p), "--tokens", "1,2"], "unknown architecture 'mamba9'");
}

#[test]
fn missing_tensor() {
    let p = variant("missing", |_, t| t.retain(|t| t.0 != "blk.1.ffn_up.weight"));
    expect_error(&["logits", "-m", s(&p), "--tokens", "1,2"], "tensor 'blk.1.ffn_up.weight' is missing");
}

#[test]
fn unsupported_tensor_type_for_a_role() {
    // I32 has F32's size, so the file stays well formed; a matrix cannot be I32.
    let p = variant("type", |_, t| t.iter_mut().find(|t| t.0 == "blk.0.attn_q.weight").unwrap().1 = GgmlType::I32);
    expect_error(
        &["logits", "-m", s(&p), "--tokens", "1,2"],
        "tensor 'blk.0.attn_q.weight': type I32 is not supported",
    );
}

#[test]
fn wrong_shape() {
    let p = variant("shape", |_, t| {
        let w = t.iter_mut().find(|t| t.0 == "blk.0.ffn_down.weight").unwrap();
        w.2.swap(0, 1);
    });
    expect_error(&["logits", "-m", s(&p), "--tokens", "1,2"], "tensor 'blk.0.ffn_down.weight': shape");
}

#[test]
fn inconsistent_gemma4_layer_settings() {
    // The gemma4 fixture: 6 layers (sliding, sliding, global) x 2, 4 heads, the last 3 KV-shared.
    let gemma4 = ts_testkit::fixtures_dir().join("gemma4/model-f32.gguf");
    let set = |key: &'static str, value: Value| {
        move |md: &mut Vec<(String, Value)>, _: &mut Vec<ts_testkit::TensorEntry>| {
            md.iter_mut().find(|(k, _)| k == key).unwrap().1 = value;
        }
    };
    // The two layers before a KV-shared tail must be sliding, then global: with 5 shared, there is one.
    let p = variant_of(&gemma4, "g4-shared", set("gemma4.attention.shared_kv_layers", Value::U32(5)));
    expect_error(&["logits", "-m", s(&p), "--tokens", "1,2"], "gemma4.attention.shared_kv_layers");
    // 3 kv heads for every layer (a scalar is read as every layer's).
    let p = variant_of(&gemma4, "g4-kv", set("gemma4.attention.head_count_kv", Value::U32(3)));
    expect_error(&["logits", "-m", s(&p), "--tokens", "1,2"], "gemma4.attention.head_count_kv");
    let p =
        variant_of(&gemma4, "g4-pattern", |md, _| md.retain(|(k, _)| k != "gemma4.attention.sliding_window_pattern"));
    expect_error(&["logits", "-m", s(&p), "--tokens", "1,2"], "gemma4.attention.sliding_window_pattern");
}

#[test]
fn token_id_out_of_range() {
    expect_error(
        &["logits", "-m", s(&fixture()), "--tokens", "1,512"],
        "token id 512 is out of range (vocabulary size 512)",
    );
}

#[test]
fn prompt_longer_than_the_context() {
    let prompt = "one two three four five six seven eight nine ten eleven twelve";
    expect_error(&["run", "-m", s(&fixture()), "-c", "4", "-p", prompt, "-n", "2"], "more than the context of 4");
}

/// The f32 fixture's logits: with f32 caches within f32 summation order of transformers';
/// with the default f16 caches within their rounding (2^-11 of each cached element).
#[test]
fn logits_of_the_fixture_match_the_golden() {
    let golden = ts_testkit::Golden::read(&ts_testkit::fixtures_dir().join("qwen2/golden-f32.bin")).unwrap();
    let tokens: Vec<String> = golden.tokens[..8].iter().map(u32::to_string).collect();
    let (model, tokens) = (fixture(), tokens.join(","));
    for (flags, bound) in [(&["-ctk", "f32"][..], 1e-4), (&[][..], 1e-3)] {
        let mut args = vec!["logits", "-m", s(&model), "--all", "--tokens", &tokens];
        args.extend_from_slice(flags);
        let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).args(&args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let rows: Vec<Vec<f32>> = j["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect())
            .collect();
        assert_eq!(rows.len(), 8);
        let c = golden.compare(&rows);
        assert!(c.max_rel_err() < bound, "{flags:?}: {c} (bound {bound:e})");
    }
}

/// Errors of every layer (the OS, the GGUF parser, the model, the expert store, argument
/// parsing) are one line, each cause said once.
#[test]
fn errors_are_one_line_said_once() {
    let dir = std::env::temp_dir().join(format!("ts-model-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Cut inside the metadata, and inside the tensor data.
    let bytes = std::fs::read(fixture()).unwrap();
    let (header_cut, data_cut) = (dir.join("header-cut.gguf"), dir.join("data-cut.gguf"));
    std::fs::write(&header_cut, &bytes[..5000]).unwrap();
    std::fs::write(&data_cut, &bytes[..bytes.len() / 3]).unwrap();
    let arch = variant("arch-run", |md, _| {
        md.iter_mut().find(|(k, _)| k == "general.architecture").unwrap().1 = Value::String("mamba9".into());
    });
    let mixtral = ts_testkit::fixtures_dir().join("mixtral/model-q8_0.gguf");
    let qwen2 = fixture();
    let q = s(&qwen2);
    let cases: [(&[&str], &str); 13] = [
        (&["run", "-m", "/nonexistent.gguf", "-p", "hi"], "/nonexistent.gguf: No such file or directory"),
        (&["tokenize", "-m", "/nonexistent.gguf", "-p", "hi"], "/nonexistent.gguf: No such file or directory"),
        (
            &["run", "-m", q, "--draft-model", "/nonexistent.gguf", "-p", "hi", "-n", "1"],
            "--draft-model: /nonexistent.gguf: No such file or directory",
        ),
        (&["run", "-m", q, "-f", "/nonexistent.txt"], "reading /nonexistent.txt: No such file or directory"),
        (
            &["run", "-m", s(&mixtral), "--experts", "stream", "--expert-cache", "10KiB", "-p", "hi", "-n", "1"],
            "--expert-cache 10240 bytes holds 0 experts",
        ),
        (&["run", "-m", s(&header_cut), "-p", "hi"], "(file truncated or corrupt)"),
        (&["tokenize", "-m", s(&header_cut), "-p", "hi"], "(file truncated or corrupt)"),
        (&["run", "-m", s(&data_cut), "-p", "hi"], "lies past the end of the file"),
        (&["run", "-m", s(&arch), "-p", "hi"], "unknown architecture 'mamba9'"),
        (&["run", "-m", q, "-c", "0", "-p", "hi"], "--ctx-size must be at least 1"),
        (&["run", "-m", q, "-c", "abc", "-p", "hi"], "invalid value 'abc' for '--ctx-size <CTX>'"),
        (&["run", "-m", q, "--tmep", "1", "-p", "hi"], "unexpected argument '--tmep' found; tip:"),
        (&["logits", "-m", q], "required arguments were not provided: --tokens"),
    ];
    for (args, expected) in cases {
        expect_error(args, expected);
    }
}
