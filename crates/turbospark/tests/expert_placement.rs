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
    // gemma4_moe's fused gate/up experts are read one expert at a time (strided halves).
    for family in ["mixtral", "qwen3_moe", "gpt_oss", "gemma4_moe"] {
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
        (&["--expert-misses", "cpu"][..], "--expert-misses applies to a GPU --expert-cache, not --device cpu"),
        (&["--expert-misses", "gpu"][..], "invalid value 'gpu' for '--expert-misses"),
        (
            &["--no-repack", "--decode-prefetch", "on"][..],
            "--decode-prefetch applies to repacked weights, which --no-repack",
        ),
        (&["--exact-activations", "--decode-prefetch", "off"][..], "which --exact-activations leaves out"),
        (&["--decode-prefetch", "sometimes"][..], "invalid value 'sometimes' for '--decode-prefetch"),
    ] {
        let mut args = vec!["run", "-m", model, "-p", "hi", "-n", "1"];
        args.extend_from_slice(flags);
        let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(expected), "{flags:?}: {stderr}");
    }
}

/// A 2-layer gpt-oss-shaped synthetic model written to a directory of test `tag`'s own.
fn synthetic_gpt_oss(tag: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("ts-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("gpt-oss-2layers.gguf").to_str().unwrap().to_string();
    let status = Command::new(env!("CARGO_BIN_EXE_turbospark"))
        .args(["synth", "--like", "gpt-oss-20b", "--layers", "2", "-o", &model])
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    (dir, model)
}

/// `logits --all` of a fixed prompt under the `experts` flags, as JSON bytes; `repacked`: whether
/// the run must say that it repacked experts for the CPU's kernels.
fn logits(model: &str, experts: &[&str], repacked: bool) -> Vec<u8> {
    let mut args = vec!["logits", "-m", model, "--all", "--tokens", "11,2048,77,90000,5,6,7,8"];
    args.extend_from_slice(experts);
    let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).args(&args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{experts:?}: {stderr}");
    let experts_repacked = stderr.lines().any(|l| l.starts_with("experts:") && l.contains("repacked"));
    assert_eq!(experts_repacked, repacked, "{experts:?}: {stderr}");
    out.stdout
}

/// Experts in the GGUF layout, resident, mapped or streamed through four slots (every step
/// evicts), with and without prefetch: the same floats.
#[test]
fn a_synthetic_model_gives_identical_logits_across_placements() {
    let (dir, m) = synthetic_gpt_oss("placement");
    let plain = |flags: &[&str]| logits(&m, &[flags, &["--no-repack"]].concat(), false);
    let resident = plain(&["--experts", "resident"]);
    assert_eq!(resident, logits(&m, &["--experts", "mapped"], false));
    let stream = ["--experts", "stream", "--expert-cache", "52MiB"];
    assert_eq!(resident, plain(&stream));
    assert_eq!(resident, plain(&[&stream[..], &["--expert-prefetch", "on"]].concat()));
    std::fs::remove_dir_all(&dir).ok();
}

/// Experts repacked for the CPU's kernels (the default where the CPU packs MXFP4: AVX2 or
/// AVX-512 VNNI; `tools/test.sh` skips this test by name elsewhere): within 8-bit rounding of the GGUF
/// layout, as rows of fewer than 4 per expert are summed in another order; streamed experts,
/// repacked as they are read where that pays, give the resident packed ones' floats.
#[test]
fn packed_experts_match_the_gguf_layout_across_placements() {
    assert!(
        ts_cpu::packs(ts_gguf::GgmlType::MXFP4, 2880),
        "experts are packed with AVX2 or AVX-512 VNNI: this machine has neither"
    );
    let (dir, m) = synthetic_gpt_oss("packed-placement");
    let rows = |bytes: &[u8]| -> Vec<Vec<f32>> {
        let v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
        serde_json::from_value(v["logits"].clone()).unwrap()
    };
    let plain_bytes = logits(&m, &["--experts", "resident", "--no-repack"], false);
    let plain = rows(&plain_bytes);
    let packed_bytes = logits(&m, &["--experts", "resident"], true);
    let packed = rows(&packed_bytes);
    assert_eq!(plain.len(), packed.len());
    for (p, (a, b)) in plain.iter().zip(&packed).enumerate() {
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 1e-2 * scale, "packed experts, row {p}: max |Δ| {diff} of {scale}");
    }
    // Streamed experts are repacked as they are read only where that pays (AVX-512 VNNI); else
    // they stay in the GGUF layout and give its floats.
    let on_read = ts_cpu::repacks_as_read(ts_gguf::GgmlType::MXFP4);
    let want = if on_read { &packed_bytes } else { &plain_bytes };
    let stream = ["--experts", "stream", "--expert-cache", "52MiB"];
    assert_eq!(*want, logits(&m, &stream, on_read));
    assert_eq!(*want, logits(&m, &[&stream[..], &["--expert-prefetch", "on"]].concat(), on_read));
    std::fs::remove_dir_all(&dir).ok();
}

/// Decode steps' experts as parallel tasks, or their products and the attention's q/k/v as one
/// region's (`TURBOSPARK_DECODE_PRODUCTS=tasks|flat`, flat the default), and a one-row step's
/// regions handed to threads kept spinning (`TURBOSPARK_CPU_TEAM=1`), compute every product as a
/// region per product (`split`) does: the same logits, bit for bit, on the MoE fixture families
/// here and two dense ones (qwen2 with its projection biases), one row and four at a time,
/// experts mapped and streamed.
#[test]
fn decode_product_modes_give_the_same_logits() {
    for family in ["mixtral", "qwen3_moe", "gpt_oss", "qwen2", "llama"] {
        let model = ts_testkit::fixtures_dir().join(format!("{family}/model-q8_0.gguf"));
        for tokens in ["11", "11,204,77,90"] {
            let run_with = |knob: &str, extra: &[&str], team: bool| {
                let mut cmd = Command::new(env!("CARGO_BIN_EXE_turbospark"));
                cmd.args(["logits", "-m", model.to_str().unwrap(), "--all", "--tokens", tokens, "-t", "2"])
                    .args(extra)
                    .env("TURBOSPARK_DECODE_PRODUCTS", knob);
                cmd.env("TURBOSPARK_CPU_TEAM", if team { "1" } else { "0" });
                let out = cmd.output().unwrap();
                assert!(out.status.success(), "{family}: {}", String::from_utf8_lossy(&out.stderr));
                out.stdout
            };
            let run = |knob: &str, extra: &[&str]| run_with(knob, extra, false);
            let plain = run("split", &[]);
            assert!(plain == run_with("flat", &[], true), "{family} {tokens}: logits differ with a team of threads");
            assert!(!plain.is_empty(), "{family}: no logits");
            for mode in ["tasks", "flat"] {
                assert!(plain == run(mode, &[]), "{family} {tokens}: logits differ with the products as {mode}");
            }
            // Streamed experts (the flat products read a group's slots).
            if !["qwen2", "llama"].contains(&family) {
                let stream = ["--experts", "stream"];
                assert!(run("split", &stream) == run("flat", &stream), "{family} {tokens}: streamed, flat differs");
            }
        }
    }
}

/// Asking for the weights ahead of a one-token product's reads (`--decode-prefetch`) changes
/// when they arrive, not the floats: the same logits with it on, off and left to the processor,
/// one token and four, on the Q8_0 fixtures (dense and MoE, whose Q8_0 matrices are repacked on
/// AVX-512 VNNI) and a gpt-oss-shaped MXFP4 model.
#[test]
fn decode_prefetch_gives_the_same_logits() {
    let (dir, synthetic) = synthetic_gpt_oss("decode-prefetch");
    let fixtures = ["qwen2", "qwen3_moe"].map(|f| ts_testkit::fixtures_dir().join(format!("{f}/model-q8_0.gguf")));
    for model in fixtures.iter().map(|m| m.to_str().unwrap()).chain([synthetic.as_str()]) {
        for tokens in ["11", "11,204,77,90"] {
            let run = |when: &str| {
                let out = Command::new(env!("CARGO_BIN_EXE_turbospark"))
                    .args(["logits", "-m", model, "--all", "--tokens", tokens, "-t", "2", "--decode-prefetch", when])
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{model}: {}", String::from_utf8_lossy(&out.stderr));
                out.stdout
            };
            let auto = run("auto");
            assert!(auto.len() > 100, "{model}: no logits");
            assert!(auto == run("on"), "{model} {tokens}: logits differ with --decode-prefetch on");
            assert!(auto == run("off"), "{model} {tokens}: logits differ with --decode-prefetch off");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A prompt's experts give the same logits, bit for bit, however the MoE layer runs them: gate/up
/// and down as one task an expert or as two regions (`TURBOSPARK_FUSED_EXPERTS`), whole experts a
/// thread or rayon tasks that split further (`TURBOSPARK_WHOLE_EXPERTS`), in a team of threads or
/// not, resident or streamed.
#[test]
fn prompt_expert_modes_give_the_same_logits() {
    // 20 rows: past the 16 from which a step's experts run as parallel tasks.
    let tokens = (0..20).map(|i| (11 + 37 * i) % 200).map(|t: u32| t.to_string()).collect::<Vec<_>>().join(",");
    for family in ["mixtral", "qwen3_moe", "gpt_oss"] {
        let model = ts_testkit::fixtures_dir().join(format!("{family}/model-q8_0.gguf"));
        let run = |knobs: &[(&str, &str)], extra: &[&str]| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_turbospark"));
            cmd.args(["logits", "-m", model.to_str().unwrap(), "--all", "--tokens", &tokens, "-t", "2"]).args(extra);
            cmd.envs(knobs.iter().copied());
            let out = cmd.output().unwrap();
            assert!(out.status.success(), "{family}: {}", String::from_utf8_lossy(&out.stderr));
            assert!(!out.stdout.is_empty(), "{family}: no logits");
            out.stdout
        };
        let plain = run(&[("TURBOSPARK_FUSED_EXPERTS", "0"), ("TURBOSPARK_WHOLE_EXPERTS", "0")], &[]);
        for (fused, whole, team) in [("1", "1", "1"), ("1", "0", "0"), ("0", "1", "1"), ("1", "1", "0")] {
            let knobs = [
                ("TURBOSPARK_FUSED_EXPERTS", fused),
                ("TURBOSPARK_WHOLE_EXPERTS", whole),
                ("TURBOSPARK_CPU_TEAM", team),
            ];
            assert!(
                plain == run(&knobs, &[]),
                "{family}: logits differ with fused {fused}, whole {whole}, team {team}"
            );
        }
        let stream = ["--experts", "stream"];
        assert!(
            plain == run(&[("TURBOSPARK_FUSED_EXPERTS", "1")], &stream),
            "{family}: logits differ with streamed experts, fused"
        );
    }
}
