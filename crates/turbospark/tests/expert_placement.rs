//! The same tokens whether experts are resident, mapped or streamed through a
//! cache too small to hold one layer's experts; and options a placement cannot
//! honour are refused by name.

use std::process::Command;

fn run(model: &str, experts: &[&str]) -> (String, String) {
    let mut args =
        vec!["run", "-m", model, "-p", "The quick brown fox", "-n", "24", "--temp", "0.9", "--seed", "7", "--stats"];
    args.extend_from_slice(experts);
    let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).args(&args).output().unwrap();
    assert!(out.status.success(), "{experts:?}: {}", String::from_utf8_lossy(&out.stderr));
    (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

#[test]
fn generated_tokens_are_identical_across_placements() {
    for family in ["mixtral", "qwen3_moe", "gpt_oss"] {
        let model = ts_testkit::fixtures_dir().join(format!("{family}/model-q8_0.gguf"));
        let model = model.to_str().unwrap();
        let (resident, _) = run(model, &["--experts", "resident"]);
        let (mapped, _) = run(model, &["--experts", "mapped"]);
        // Room for a handful of experts only: most steps read from disk.
        let (streamed, stats) = run(model, &["--experts", "stream", "--expert-cache", "512KiB"]);
        assert!(!resident.is_empty(), "{family}");
        assert_eq!(resident, mapped, "{family}: mapped");
        assert_eq!(resident, streamed, "{family}: streamed");
        assert!(stats.contains("expert cache:") && stats.contains("misses"), "{stats}");
    }
}

#[test]
fn options_a_placement_cannot_honour_are_refused() {
    let model = ts_testkit::fixtures_dir().join("mixtral/model-q8_0.gguf");
    let model = model.to_str().unwrap();
    for (flags, expected) in [
        (&["--experts", "mapped", "--expert-cache", "1GiB"][..], "--expert-cache applies to streamed experts only"),
        (&["--experts", "resident", "--expert-policy", "lru"][..], "--expert-policy applies to streamed experts only"),
        (&["--experts", "stream", "--expert-cache", "10KiB"][..], "holds 0 experts; one token needs 2"),
        (&["--experts", "stream", "--expert-cache", "lots"][..], "--expert-cache lots"),
        (&["--experts", "disk"][..], "--experts disk"),
    ] {
        let mut args = vec!["run", "-m", model, "-p", "hi", "-n", "1"];
        args.extend_from_slice(flags);
        let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(expected), "{flags:?}: {stderr}");
    }
}

#[test]
fn a_synthetic_model_gives_identical_logits_across_placements() {
    let dir = std::env::temp_dir().join(format!("ts-placement-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("gpt-oss-1layer.gguf");
    let m = model.to_str().unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_turbospark"))
        .args(["synth", "--like", "gpt-oss-20b", "--layers", "2", "-o", m])
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    // The CPU packs MXFP4 experts (2,880 rows) only where its kernels read the packed layout.
    let packs = ts_cpu::packs(ts_gguf::GgmlType::MXFP4, 2880);
    if !packs {
        println!("skipped: the packed experts' comparisons (this CPU's kernels do not repack MXFP4)");
    }
    let logits = |experts: &[&str]| {
        let mut args = vec!["logits", "-m", m, "--all", "--tokens", "11,2048,77,90000,5,6,7,8"];
        args.extend_from_slice(experts);
        let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{experts:?}: {stderr}");
        // Experts in memory (resident, or streamed into slots) are repacked unless told not to.
        let repacked = packs && !experts.contains(&"--no-repack") && !experts.contains(&"mapped");
        assert_eq!(stderr.contains("repacked"), repacked, "{experts:?}: {stderr}");
        out.stdout
    };
    // The GGUF layout in memory: the same floats as the other placements.
    let resident = logits(&["--experts", "resident", "--no-repack"]);
    assert_eq!(resident, logits(&["--experts", "mapped"]));
    // Repacked for the CPU's kernels (the default): within 8-bit rounding of the others, as
    // rows of fewer than 4 per expert are summed in another order.
    let rows = |bytes: &[u8]| -> Vec<Vec<f32>> {
        let v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
        serde_json::from_value(v["logits"].clone()).unwrap()
    };
    let packed_bytes = logits(&["--experts", "resident"]);
    let (plain, packed) = (rows(&resident), rows(&packed_bytes));
    assert_eq!(plain.len(), packed.len());
    for (p, (a, b)) in plain.iter().zip(&packed).enumerate() {
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 1e-2 * scale, "packed experts, row {p}: max |Δ| {diff} of {scale}");
    }
    // Four slots: every step evicts. In the GGUF layout the same floats as resident ones; repacked
    // as they are read, the resident packed ones.
    let stream = ["--experts", "stream", "--expert-cache", "52MiB"];
    assert_eq!(resident, logits(&[&stream[..], &["--no-repack"]].concat()));
    assert_eq!(resident, logits(&[&stream[..], &["--expert-prefetch", "on", "--no-repack"]].concat()));
    assert_eq!(packed_bytes, logits(&stream));
    assert_eq!(packed_bytes, logits(&[&stream[..], &["--expert-prefetch", "on"]].concat()));
    std::fs::remove_dir_all(&dir).ok();
}
