//! `turbospark inspect --json` on the three real models: architecture, tensor
//! count and tensor types as llama.cpp's gguf-py reports them for these files.

use serde_json::Value;
use std::process::Command;

/// A model's file, architecture, tensor count, [(type, count)] and tokenizer model.
type Expected = (&'static str, &'static str, u64, &'static [(&'static str, u64)], &'static str);

const EXPECTED: &[Expected] = &[
    ("smollm2-135m-instruct-q4_1.gguf", "llama", 272, &[("F32", 61), ("Q4_1", 210), ("Q8_0", 1)], "\"gpt2\""),
    (
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3",
        236,
        &[("F32", 109), ("Q5_0", 81), ("Q8_0", 10), ("Q4_K", 27), ("Q6_K", 9)],
        "\"llama\"",
    ),
    (
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "qwen2",
        291,
        &[("F32", 121), ("Q5_0", 133), ("Q8_0", 13), ("Q4_K", 12), ("Q6_K", 12)],
        "\"gpt2\"",
    ),
];

#[test]
fn inspect_reports_the_real_models() {
    for &(file, arch, count, types, tokenizer) in EXPECTED {
        let path = ts_testkit::models_dir().join(file);
        assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
        let out =
            Command::new(env!("CARGO_BIN_EXE_turbospark")).args(["inspect", "--json"]).arg(&path).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let j: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["architecture"], arch, "{file}");
        assert_eq!(j["tensor_count"], count, "{file}");
        assert_eq!(j["tensors"].as_array().unwrap().len() as u64, count, "{file}");
        let found: Vec<(String, u64)> = j["tensor_types"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v["tensors"].as_u64().unwrap()))
            .collect();
        for &(ty, n) in types {
            assert!(found.contains(&(ty.to_string(), n)), "{file}: expected {n} {ty} tensors, found {found:?}");
        }
        assert_eq!(found.len(), types.len(), "{file}: {found:?}");
        assert_eq!(j["tokenizer"]["model"], tokenizer, "{file}");
        // Tensor bytes sum to what the data section holds, less alignment padding.
        let bytes: u64 = j["tensors"].as_array().unwrap().iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
        let data = j["file_size"].as_u64().unwrap() - j["data_offset"].as_u64().unwrap();
        assert!(bytes <= data && data - bytes < 32 * count, "{file}: {bytes} tensor bytes in {data}");
    }
}
