//! With streamed experts, peak RSS stays within the dense weights + the
//! expert cache + the KV cache + a small fixed overhead, on a model whose
//! experts are larger than that budget.

use std::process::Command;

/// Room for the program, thread stacks, scratch activations and the allocator.
const OVERHEAD: u64 = 96 << 20;

fn turbospark(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

#[test]
fn peak_rss_is_bounded_by_the_expert_cache() {
    let dir = std::env::temp_dir().join(format!("ts-memory-bound-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("qwen3-30b-a3b-2layers.gguf");
    let m = model.to_str().unwrap();
    // Two layers of qwen3-30b-a3b: 128 experts of 2.9 MiB each per layer, ~700 MiB of experts.
    turbospark(&["synth", "--like", "qwen3-30b-a3b", "--layers", "2", "-o", m]);

    let inspect: serde_json::Value = serde_json::from_slice(&turbospark(&["inspect", "--json", m]).stdout).unwrap();
    let tensors = inspect["tensors"].as_array().unwrap();
    let bytes = |f: &dyn Fn(&str) -> bool| -> u64 {
        tensors.iter().filter(|t| f(t["name"].as_str().unwrap())).map(|t| t["bytes"].as_u64().unwrap()).sum()
    };
    let experts = bytes(&|n| n.ends_with("_exps.weight"));
    let dense = bytes(&|n| !n.ends_with("_exps.weight"));

    let cache: u64 = 64 << 20;
    let n_ctx = 1024u64;
    let out = turbospark(&[
        "bench",
        "-m",
        m,
        "-p",
        "128",
        "-n",
        "32",
        "-r",
        "1",
        "-c",
        "1024",
        "--experts",
        "stream",
        "--expert-cache",
        "64MiB",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let peak = j["peak_rss_bytes"].as_u64().unwrap();
    // KV: 2 layers x n_ctx x (4 kv heads x 128) x (k + v) x f32.
    let kv = 2 * n_ctx * 512 * 2 * 4;
    let bound = dense + cache + kv + OVERHEAD;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "peak RSS {:.0} MiB <= dense {:.0} + cache {:.0} + KV {:.0} + overhead {:.0} = {:.0} MiB (experts {:.0} MiB)",
        mib(peak),
        mib(dense),
        mib(cache),
        mib(kv),
        mib(OVERHEAD),
        mib(bound),
        mib(experts)
    );
    assert!(experts > cache * 8, "the experts must not fit in the cache");
    assert!(peak <= bound, "peak RSS {} MiB over the bound {} MiB", mib(peak), mib(bound));
    let tg = &j["tests"][1]["expert_cache"];
    assert!(tg["misses"].as_u64().unwrap() > 0 && tg["bytes_read"].as_u64().unwrap() > 0, "{tg}");
    std::fs::remove_dir_all(&dir).ok();
}
