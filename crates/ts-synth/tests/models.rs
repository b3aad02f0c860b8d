//! Every model: the layout follows the public GGUF's recipe and size, and a cut-down file
//! opens in the engine (which validates every tensor) and runs. The hybrid families
//! (qwen35moe, qwen3next) have their own checks in `hybrids.rs`.

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use ts_gguf::{GgmlType, GgufFile};
use ts_model::{ExpertPlacement, Model, Row, Scratch, SeqState};
use ts_synth::{Family, NAMES, Plan, SynthError, SynthOptions};

fn plan(name: &str, opts: &SynthOptions) -> Plan {
    Plan::new(&ts_synth::spec(name).unwrap(), opts).unwrap()
}

/// How many of the layers' tensors named `base` have each type.
fn types_of(plan: &Plan, base: &str) -> BTreeMap<GgmlType, usize> {
    let mut count = BTreeMap::new();
    for t in plan.tensors.iter().filter(|t| t.name.starts_with("blk.") && t.name.ends_with(base)) {
        *count.entry(t.ty).or_insert(0) += 1;
    }
    count
}

#[test]
fn full_files_have_the_public_sizes() {
    for name in NAMES {
        let plan = plan(name, &SynthOptions::default());
        let size = plan.file_size().unwrap() as f64;
        let reference = plan.spec.reference.bytes as f64;
        let off = size / reference - 1.0;
        eprintln!(
            "{name}: {:.2} GB ({:.2} GiB) planned, {:.2} GB published ({:+.2}%)",
            size / 1e9,
            size / (1u64 << 30) as f64,
            reference / 1e9,
            off * 100.0
        );
        assert!(off.abs() < 0.03, "{name}: {size} bytes against {reference} ({})", plan.spec.reference.source);
    }
}

/// The names whose every layer is the same attention (the hybrids are checked in
/// `hybrids.rs`, gemma4 in `gemma4.rs`).
fn attention_only() -> impl Iterator<Item = &'static str> {
    NAMES.into_iter().filter(|n| {
        let family = ts_synth::spec(n).unwrap().family;
        !family.is_hybrid() && family != Family::Gemma4
    })
}

#[test]
fn layers_follow_the_public_recipes() {
    let per_layer = |family| match family {
        Family::GptOss => 19,
        Family::Qwen3Moe => 12,
        Family::Mixtral => 10,
        Family::Qwen35Moe | Family::Qwen3Next | Family::Gemma4 => unreachable!(),
    };
    for name in attention_only() {
        let plan = plan(name, &SynthOptions::default());
        let (s, n) = (&plan.spec, plan.n_layer);
        assert_eq!(plan.tensors.len(), 3 + n * per_layer(s.family), "{name}");
        for il in 0..n {
            let prefix = format!("blk.{il}.");
            assert_eq!(plan.tensors.iter().filter(|t| t.name.starts_with(&prefix)).count(), per_layer(s.family));
        }
        let dims = |t: &str| plan.tensors.iter().find(|x| x.name == t).unwrap().dims.clone();
        let (e, f, x) = (s.n_embd as u64, s.n_ff_exp as u64, s.n_expert as u64);
        assert_eq!(dims("token_embd.weight"), [e, s.n_vocab as u64]);
        assert_eq!(dims("output.weight"), [e, s.n_vocab as u64]);
        assert_eq!(dims("blk.0.attn_q.weight"), [e, (s.n_head * s.head_dim) as u64]);
        assert_eq!(dims("blk.0.attn_k.weight"), [e, (s.n_head_kv * s.head_dim) as u64]);
        assert_eq!(dims("blk.0.attn_output.weight"), [(s.n_head * s.head_dim) as u64, e]);
        assert_eq!(dims("blk.0.ffn_gate_inp.weight"), [e, x]);
        assert_eq!(dims("blk.0.ffn_gate_exps.weight"), [e, f, x]);
        assert_eq!(dims("blk.0.ffn_down_exps.weight"), [f, e, x]);
        assert!(types_of(&plan, "_norm.weight").keys().all(|&t| t == GgmlType::F32));
        assert_eq!(types_of(&plan, "ffn_gate_inp.weight"), BTreeMap::from([(GgmlType::F32, n)]));
        // Layers use_more_bits picks: half of 32 and 48, 46 of 94.
        let more_bits = if n == 94 { 46 } else { n / 2 };
        match s.family {
            Family::GptOss => {
                for base in ["ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"] {
                    assert_eq!(types_of(&plan, base), BTreeMap::from([(GgmlType::MXFP4, n)]), "{name} {base}");
                }
                for base in ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"] {
                    assert_eq!(types_of(&plan, base), BTreeMap::from([(GgmlType::Q8_0, n)]), "{name} {base}");
                }
                assert_eq!(types_of(&plan, ".bias").keys().copied().collect::<Vec<_>>(), [GgmlType::F32]);
            }
            Family::Qwen3Moe => {
                let more = BTreeMap::from([(GgmlType::Q4_K, n - more_bits), (GgmlType::Q6_K, more_bits)]);
                assert_eq!(types_of(&plan, "ffn_down_exps.weight"), more, "{name}");
                assert_eq!(types_of(&plan, "attn_v.weight"), more, "{name}");
                assert_eq!(types_of(&plan, "ffn_up_exps.weight"), BTreeMap::from([(GgmlType::Q4_K, n)]));
                assert_eq!(types_of(&plan, "attn_k.weight"), BTreeMap::from([(GgmlType::Q4_K, n)]));
            }
            Family::Mixtral => {
                let more = BTreeMap::from([(GgmlType::Q4_K, n - more_bits), (GgmlType::Q6_K, more_bits)]);
                assert_eq!(types_of(&plan, "ffn_down_exps.weight"), more);
                assert_eq!(types_of(&plan, "attn_k.weight"), BTreeMap::from([(GgmlType::Q8_0, n)]));
                assert_eq!(types_of(&plan, "attn_v.weight"), BTreeMap::from([(GgmlType::Q8_0, n)]));
                assert_eq!(types_of(&plan, "attn_output.weight"), BTreeMap::from([(GgmlType::Q5_K, n)]));
            }
            Family::Qwen35Moe | Family::Qwen3Next | Family::Gemma4 => unreachable!(),
        }
    }
}

#[test]
fn options_are_checked() {
    let spec = ts_synth::spec("qwen3-30b-a3b").unwrap();
    let opts = SynthOptions { expert_type: Some(ts_synth::parse_quant("q4_0").unwrap()), ..Default::default() };
    let p = Plan::new(&spec, &opts).unwrap();
    assert_eq!(types_of(&p, "_exps.weight"), BTreeMap::from([(GgmlType::Q4_0, 3 * 48)]));
    let gpt = ts_synth::spec("gpt-oss-20b").unwrap();
    let opts = SynthOptions { expert_type: Some(GgmlType::Q4_K), ..Default::default() };
    assert!(matches!(Plan::new(&gpt, &opts), Err(SynthError::Incompatible { row: 2880, .. })));
    for layers in [0, 49] {
        let opts = SynthOptions { layers: Some(layers), ..Default::default() };
        assert!(matches!(Plan::new(&spec, &opts), Err(SynthError::Layers { max: 48, .. })));
    }
    let e = ts_synth::spec("llama-7b").unwrap_err().to_string();
    assert!(e.contains("gpt-oss-20b, gpt-oss-120b, qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b"), "{e}");
    assert!(e.contains("qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b, qwen3-next-80b-a3b"), "{e}");
    let e = ts_synth::parse_quant("q3_k").unwrap_err().to_string();
    assert!(e.contains("q4_0, q4_k, q5_k, q6_k, q8_0, mxfp4"), "{e}");
    assert!(ts_synth::Routing::parse("zipf").unwrap_err().to_string().contains("skewed, uniform"));
}

#[test]
fn cut_down_files_open_and_run_in_the_engine() {
    for name in attention_only() {
        // gpt-oss-20b with two layers: one sliding-window layer and one full.
        let layers = if name == "gpt-oss-20b" { 2 } else { 1 };
        let plan = plan(name, &SynthOptions { layers: Some(layers), ..Default::default() });
        let file = common::TempFile::new(name);
        plan.write_into(File::create(&file.0).unwrap(), &mut ()).unwrap();
        assert_eq!(std::fs::metadata(&file.0).unwrap().len(), plan.file_size().unwrap(), "{name}");

        let gguf = GgufFile::open(&file.0).unwrap();
        let written: Vec<_> = gguf.tensors().iter().map(|t| (t.name.clone(), t.ggml_type, t.dims.clone())).collect();
        let planned: Vec<_> = plan.tensors.iter().map(|t| (t.name.clone(), t.ty, t.dims.clone())).collect();
        assert_eq!(written, planned, "{name}");
        assert_eq!(gguf.metadata().str("tokenizer.ggml.model").unwrap(), Some("none"));

        let model = Model::open(&file.0, ExpertPlacement::Mapped).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (cfg, s) = (&model.cfg, &plan.spec);
        assert_eq!(cfg.arch.gguf_name(), s.family.gguf_arch());
        assert_eq!((cfg.n_layer, cfg.n_embd, cfg.n_vocab), (layers, s.n_embd, s.n_vocab), "{name}");
        assert_eq!((cfg.n_head, cfg.n_head_kv, cfg.head_dim), (s.n_head, s.n_head_kv, s.head_dim), "{name}");
        let moe = cfg.moe.as_ref().unwrap();
        assert_eq!((moe.n_expert, moe.n_expert_used, moe.n_ff_exp), (s.n_expert, s.n_expert_used, s.n_ff_exp));
        let windows: Vec<_> = cfg.layers.iter().map(|l| l.sliding_window()).collect();
        match s.family {
            Family::GptOss => assert_eq!(windows, [Some(128), None][..layers]),
            _ => assert!(windows.iter().all(Option::is_none)),
        }

        let mut seq = SeqState::new(cfg, 8, 3);
        let rows: Vec<Row> =
            [1u32, 2, 3].iter().enumerate().map(|(pos, &token)| Row { token, pos, seq: 0, logits: pos == 2 }).collect();
        let logits = model.forward(&rows, &mut [&mut seq], &mut Scratch::default()).unwrap();
        let last = &logits[0];
        assert_eq!(last.len(), s.n_vocab);
        assert!(last.iter().all(|x| x.is_finite()), "{name}");
        let sd = (last.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / last.len() as f64).sqrt();
        assert!((0.5..2.0).contains(&sd), "{name}: logits spread {sd}");
    }
}
