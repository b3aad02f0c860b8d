//! The gemma4 synthetic file (docs/FAMILIES.md §7.5): the tensor types and sizes of the
//! public 26B-A4B Q4_K_M as its published load log counts them, the metadata the gemma4
//! converter writes, and a cut-down file the engine opens (validating every tensor) and runs.

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use ts_gguf::{GgmlType, GgufFile};
use ts_model::config::Mixer;
use ts_model::{ExpertPlacement, Model};
use ts_synth::{Plan, RoutingStats, SynthOptions};

#[test]
fn full_layout_has_the_public_files_types_and_bytes() {
    let plan = Plan::new(&ts_synth::spec("gemma4-26b-a4b").unwrap(), &SynthOptions::default()).unwrap();
    let mut types: BTreeMap<GgmlType, usize> = BTreeMap::new();
    for t in &plan.tensors {
        *types.entry(t.ty).or_default() += 1;
    }
    // lmstudio-community's gemma-4-26B-A4B-it-Q4_K_M.gguf as llama.cpp loads it.
    let public = BTreeMap::from([
        (GgmlType::F32, 392),
        (GgmlType::Q5_0, 32),
        (GgmlType::Q8_0, 28),
        (GgmlType::Q4_K, 192),
        (GgmlType::Q6_K, 14),
    ]);
    assert_eq!(types, public);
    assert_eq!(plan.tensors.len(), 658);
    let data: u64 = plan.tensors.iter().map(|t| t.n_bytes()).sum();
    assert_eq!(data, 16_780_192_888, "tensor data of the recipe (15.628 GiB)");

    let find = |name: &str| plan.tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("{name}"));
    // Layer 5 is global: head 512, 2 kv heads, no attn_v; layer 0 sliding: head 256, 8 kv heads.
    assert_eq!(find("blk.0.attn_q.weight").dims, [2816, 4096]);
    assert_eq!(find("blk.0.attn_k.weight").dims, [2816, 2048]);
    assert_eq!(find("blk.0.attn_v.weight").dims, [2816, 2048]);
    assert_eq!(find("blk.5.attn_q.weight").dims, [2816, 8192]);
    assert_eq!(find("blk.5.attn_k.weight").dims, [2816, 1024]);
    assert!(!plan.tensors.iter().any(|t| t.name == "blk.5.attn_v.weight"));
    assert_eq!(find("blk.0.ffn_gate_up_exps.weight").dims, [2816, 1408, 128]);
    assert_eq!(find("blk.0.ffn_down_exps.weight").dims, [704, 2816, 128]);
    assert_eq!(find("blk.0.ffn_down.weight").dims, [2112, 2816]);
    assert_eq!(find("rope_freqs.weight").dims, [256]);
    assert!(!plan.tensors.iter().any(|t| t.name == "output.weight"), "tied");
    // use_more_bits over 30 layers: the down projections of layers 0-2, 5, 8, ..., 26-29.
    for (il, ty) in [(0, GgmlType::Q8_0), (3, GgmlType::Q5_0), (5, GgmlType::Q8_0), (25, GgmlType::Q5_0)] {
        assert_eq!(find(&format!("blk.{il}.ffn_down_exps.weight")).ty, ty, "layer {il}");
        assert_eq!(find(&format!("blk.{il}.ffn_down.weight")).ty, ty, "layer {il}");
    }
    // attn_v counted over the 25 sliding layers: the 4th (layer 3) Q4_K, the 6th (layer 6) Q6_K.
    assert_eq!(find("blk.3.attn_v.weight").ty, GgmlType::Q4_K);
    assert_eq!(find("blk.6.attn_v.weight").ty, GgmlType::Q6_K);
}

#[test]
fn cut_down_file_opens_and_runs_in_the_engine() {
    // Six layers (five sliding, one global) with 16 experts a layer instead of 128 (1.3 GiB).
    let mut spec = ts_synth::spec("gemma4-26b-a4b").unwrap();
    spec.n_expert = 16;
    let plan = Plan::new(&spec, &SynthOptions { layers: Some(6), ..Default::default() }).unwrap();
    let file = common::TempFile::new("gemma4-26b-a4b-6l");
    plan.write_into(File::create(&file.0).unwrap(), &mut ()).unwrap();
    assert_eq!(std::fs::metadata(&file.0).unwrap().len(), plan.file_size().unwrap());
    let gguf = GgufFile::open(&file.0).unwrap();
    let written: Vec<_> = gguf.tensors().iter().map(|t| (t.name.clone(), t.ggml_type, t.dims.clone())).collect();
    let planned: Vec<_> = plan.tensors.iter().map(|t| (t.name.clone(), t.ty, t.dims.clone())).collect();
    assert_eq!(written, planned);
    drop(gguf);

    let model = Model::open(&file.0, ExpertPlacement::Mapped).unwrap();
    let cfg = &model.cfg;
    assert_eq!(cfg.arch.gguf_name(), "gemma4");
    assert_eq!((cfg.n_layer, cfg.n_embd, cfg.n_vocab, cfg.attn_scale), (6, 2816, 262_144, 1.0));
    assert_eq!(cfg.final_softcap, Some(30.0));
    for (il, l) in cfg.layers.iter().enumerate() {
        let Mixer::Attention(a) = &l.mixer else { panic!("layer {il} is attention") };
        let global = il == 5;
        assert_eq!(a.sliding_window, (!global).then_some(1024), "layer {il}");
        assert_eq!((a.head_dim, a.n_head_kv), if global { (512, 2) } else { (256, 8) }, "layer {il}");
        assert_eq!((a.rope.n_rot, a.rope.freq_base), if global { (512, 1e6) } else { (256, 1e4) });
        assert_eq!(a.rope_freq_factors, global);
        assert!(a.kv_from.is_none());
        assert_eq!(l.n_ff, 2112);
    }
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!((moe.n_expert, moe.n_expert_used, moe.n_ff_exp), (16, 8, 704));

    let last = &common::prompt_then_decode(&model);
    assert!(last.iter().all(|x| x.is_finite()));
    // The tied table's common vector shifts every logit of a row alike; the spread is what
    // a softmax sees.
    let n = last.len() as f64;
    let mean = last.iter().map(|&x| x as f64).sum::<f64>() / n;
    let sd = (last.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    eprintln!("gemma4-26b-a4b (6 layers, 16 experts): logits mean {mean:.3}, sd {sd:.3}");
    assert!((0.5..4.0).contains(&sd), "logits sd {sd}");
    drop(model);

    // The routers are skewed as for the other families (docs/SYNTH.md), through gemma4's
    // own router input (rms-normed, scaled): uniform routing of 8 of 16 experts would give
    // the top 2 experts 12.5% of the picks and consecutive tokens an overlap of 50%.
    let tokens = common::random_tokens(96, spec.n_vocab, 5);
    let (per_layer, _) = common::route_tokens(&file.0, &tokens);
    let stats = RoutingStats::mean(&common::layer_stats(&per_layer, spec.n_expert));
    eprintln!("gemma4-26b-a4b routing: {stats:?}");
    assert!(stats.top_share > 0.16 && stats.overlap > 0.53, "{stats:?}");
}
