//! The hybrid families (qwen35moe, qwen3next; docs/FAMILIES.md §6): every tensor's shape
//! and type against the Q4_K_M recipe and §6.7's table, the metadata the converter writes,
//! the values of the linear-attention tensors, and cut-down files that the engine opens
//! (validating every tensor) and runs.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use ts_gguf::{Array, GgmlType, GgufFile, Value};
use ts_model::config::{KeyHeadOf, Mixer};
use ts_model::{ExpertPlacement, Model};
use ts_synth::{Plan, RoutingStats, SynthOptions};

/// A released model (docs/FAMILIES.md §6.7), written out here apart from `spec.rs`.
#[derive(Clone, Copy)]
struct Real {
    name: &'static str,
    arch: &'static str,
    layers: usize,
    n_embd: u64,
    n_head: u64,
    n_v_heads: u64,
    n_expert: u64,
    n_expert_used: usize,
    n_ff_exp: u64,
    n_vocab: u64,
}

const REAL: [Real; 4] = [
    Real {
        name: "qwen3.5-35b-a3b",
        arch: "qwen35moe",
        layers: 40,
        n_embd: 2048,
        n_head: 16,
        n_v_heads: 32,
        n_expert: 256,
        n_expert_used: 8,
        n_ff_exp: 512,
        n_vocab: 248_320,
    },
    Real {
        name: "qwen3.5-122b-a10b",
        arch: "qwen35moe",
        layers: 48,
        n_embd: 3072,
        n_head: 32,
        n_v_heads: 64,
        n_expert: 256,
        n_expert_used: 8,
        n_ff_exp: 1024,
        n_vocab: 248_320,
    },
    Real {
        name: "qwen3.5-397b-a17b",
        arch: "qwen35moe",
        layers: 60,
        n_embd: 4096,
        n_head: 32,
        n_v_heads: 64,
        n_expert: 512,
        n_expert_used: 10,
        n_ff_exp: 1024,
        n_vocab: 248_320,
    },
    Real {
        name: "qwen3-next-80b-a3b",
        arch: "qwen3next",
        layers: 48,
        n_embd: 2048,
        n_head: 16,
        n_v_heads: 32,
        n_expert: 512,
        n_expert_used: 10,
        n_ff_exp: 512,
        n_vocab: 151_936,
    },
];

/// Shared by every release: attention head size and kv heads, linear-attention key heads,
/// their size (= value head size), conv taps.
const HD: u64 = 256;
const N_KV: u64 = 2;
const NK: u64 = 16;
const DK: u64 = 128;
const TAPS: u64 = 4;

fn real(name: &str) -> &'static Real {
    REAL.iter().find(|r| r.name == name).unwrap()
}

fn plan(name: &str, opts: &SynthOptions) -> Plan {
    Plan::new(&ts_synth::spec(name).unwrap(), opts).unwrap()
}

/// A layer is linear attention unless it is every fourth.
fn linear(il: usize) -> bool {
    !(il + 1).is_multiple_of(4)
}

/// Shape and type of every tensor of the public Q4_K_M file (§6.2, §6.7), given the
/// layers whose attn_v-like and ffn_down tensors are Q6_K.
fn expected(r: &Real, q6k_layers: &[usize]) -> BTreeMap<String, (Vec<u64>, GgmlType)> {
    use GgmlType::{F32, Q4_K, Q6_K};
    let (e, nv, x, ff) = (r.n_embd, r.n_v_heads, r.n_expert, r.n_ff_exp);
    let conv = 2 * NK * DK + nv * DK;
    let mut t = BTreeMap::new();
    let mut put = |name: String, dims: &[u64], ty| assert!(t.insert(name, (dims.to_vec(), ty)).is_none());
    put("token_embd.weight".into(), &[e, r.n_vocab], Q4_K);
    put("output_norm.weight".into(), &[e], F32);
    put("output.weight".into(), &[e, r.n_vocab], Q6_K);
    for il in 0..r.layers {
        let more = if q6k_layers.contains(&il) { Q6_K } else { Q4_K };
        let mut layer = |base: &str, dims: &[u64], ty| put(format!("blk.{il}.{base}"), dims, ty);
        layer("attn_norm.weight", &[e], F32);
        layer("post_attention_norm.weight", &[e], F32);
        if linear(il) {
            layer("attn_qkv.weight", &[e, conv], more);
            layer("attn_gate.weight", &[e, nv * DK], Q4_K);
            layer("ssm_conv1d.weight", &[TAPS, conv], F32);
            layer("ssm_dt.bias", &[nv], F32);
            layer("ssm_a", &[nv], F32);
            if r.arch == "qwen3next" {
                layer("ssm_ba.weight", &[e, 2 * nv], Q4_K);
            } else {
                layer("ssm_beta.weight", &[e, nv], Q4_K);
                layer("ssm_alpha.weight", &[e, nv], Q4_K);
            }
            layer("ssm_norm.weight", &[DK], F32);
            layer("ssm_out.weight", &[nv * DK, e], Q4_K);
        } else {
            layer("attn_q.weight", &[e, 2 * r.n_head * HD], Q4_K);
            layer("attn_k.weight", &[e, N_KV * HD], Q4_K);
            layer("attn_v.weight", &[e, N_KV * HD], more);
            layer("attn_output.weight", &[r.n_head * HD, e], Q4_K);
            layer("attn_q_norm.weight", &[HD], F32);
            layer("attn_k_norm.weight", &[HD], F32);
        }
        layer("ffn_gate_inp.weight", &[e, x], F32);
        layer("ffn_gate_exps.weight", &[e, ff, x], Q4_K);
        layer("ffn_up_exps.weight", &[e, ff, x], Q4_K);
        layer("ffn_down_exps.weight", &[ff, e, x], more);
        layer("ffn_gate_inp_shexp.weight", &[e, 1], F32);
        layer("ffn_gate_shexp.weight", &[e, ff], Q4_K);
        layer("ffn_up_shexp.weight", &[e, ff], Q4_K);
        layer("ffn_down_shexp.weight", &[ff, e], more);
    }
    t
}

/// §6.7's table (no MTP layers): tensors, F32, Q4_K, Q6_K, the Q6_K layers, GiB. The
/// 122B is not in it; its row is computed by the same rules.
struct Row67 {
    name: &'static str,
    tensors: usize,
    f32: usize,
    q4k: usize,
    q6k: usize,
    q6k_layers: Vec<usize>,
    gib: f64,
}

fn table() -> Vec<Row67> {
    let layers = |first: usize, step_from: usize, step_to: usize, last: std::ops::Range<usize>| -> Vec<usize> {
        (0..first).chain((step_from..=step_to).step_by(3)).chain(last).collect()
    };
    vec![
        Row67 {
            name: "qwen3.5-35b-a3b",
            tensors: 733,
            f32: 301,
            q4k: 371,
            q6k: 61,
            q6k_layers: layers(5, 7, 34, 35..40),
            gib: 19.70,
        },
        Row67 {
            name: "qwen3.5-397b-a17b",
            tensors: 1098,
            f32: 451,
            q4k: 556,
            q6k: 91,
            q6k_layers: layers(7, 9, 51, 52..60),
            gib: 224.07,
        },
        Row67 {
            name: "qwen3-next-80b-a3b",
            tensors: 843,
            f32: 361,
            q4k: 409,
            q6k: 73,
            q6k_layers: layers(6, 8, 41, 42..48),
            gib: 45.15,
        },
        Row67 {
            name: "qwen3.5-122b-a10b",
            tensors: 879,
            f32: 361,
            q4k: 445,
            q6k: 73,
            q6k_layers: layers(6, 8, 41, 42..48),
            gib: 69.11,
        },
    ]
}

#[test]
fn full_layouts_follow_the_q4_k_m_recipe_and_sizes() {
    for row in table() {
        let r = real(row.name);
        let plan = plan(row.name, &SynthOptions::default());
        assert_eq!(plan.n_layer, r.layers);
        assert_eq!(row.q6k_layers.len(), if r.layers == 40 { 20 } else { r.layers / 2 });
        let want = expected(r, &row.q6k_layers);
        let got: BTreeMap<String, (Vec<u64>, GgmlType)> =
            plan.tensors.iter().map(|t| (t.name.clone(), (t.dims.clone(), t.ty))).collect();
        assert_eq!(got.len(), plan.tensors.len(), "{}: duplicate names", row.name);
        let (gk, wk): (BTreeSet<_>, BTreeSet<_>) = (got.keys().collect(), want.keys().collect());
        assert_eq!(gk.difference(&wk).collect::<Vec<_>>(), Vec::<&&String>::new(), "{}: extra tensors", row.name);
        assert_eq!(wk.difference(&gk).collect::<Vec<_>>(), Vec::<&&String>::new(), "{}: missing tensors", row.name);
        for (name, w) in &want {
            assert_eq!(&got[name], w, "{}: {name}", row.name);
        }
        // Each layer's tensors together, token_embd first, the output last.
        assert_eq!(plan.tensors[0].name, "token_embd.weight");
        let layer_of = |t: &ts_synth::PlannedTensor| {
            t.name.strip_prefix("blk.").map(|r| r.split('.').next().unwrap().parse::<usize>().unwrap())
        };
        let order: Vec<usize> = plan.tensors.iter().filter_map(layer_of).collect();
        assert!(order.windows(2).all(|w| w[0] <= w[1]), "{}", row.name);

        let count = |ty| plan.tensors.iter().filter(|t| t.ty == ty).count();
        assert_eq!(
            (plan.tensors.len(), count(GgmlType::F32), count(GgmlType::Q4_K), count(GgmlType::Q6_K)),
            (row.tensors, row.f32, row.q4k, row.q6k),
            "{}",
            row.name
        );
        let gib = plan.file_size().unwrap() as f64 / (1u64 << 30) as f64;
        eprintln!("{}: {gib:.3} GiB planned, §6.7: {:.2} GiB", row.name, row.gib);
        assert!((gib - row.gib).abs() < 0.006, "{}: {gib} GiB", row.name);
    }
}

#[test]
fn cut_down_layouts_take_types_as_for_that_many_layers() {
    // llama-quantize on a 4-layer file: n/8 = 0, 7n/8 = 3, (i - 0) % 3 == 2: layers 2 and 3.
    for r in &REAL {
        let plan = plan(r.name, &SynthOptions { layers: Some(4), ..Default::default() });
        let want = expected(&Real { layers: 4, ..*r }, &[2, 3]);
        let got: BTreeMap<String, (Vec<u64>, GgmlType)> =
            plan.tensors.iter().map(|t| (t.name.clone(), (t.dims.clone(), t.ty))).collect();
        assert_eq!(got, want, "{}", r.name);
    }
    // --quant changes the routed experts only.
    let opts = SynthOptions { layers: Some(4), expert_type: Some(GgmlType::Q8_0), ..Default::default() };
    let plan = plan("qwen3-next-80b-a3b", &opts);
    for t in &plan.tensors {
        let exps = t.name.ends_with("_exps.weight");
        assert_eq!(t.ty == GgmlType::Q8_0, exps, "{}", t.name);
    }
    let md: BTreeMap<_, _> = plan.metadata.iter().cloned().collect();
    assert_eq!(md["general.file_type"], Value::U32(7));
}

/// The keys and values llama.cpp's converter writes for the model (docs/FAMILIES.md §6.1),
/// cut to `layers`, with the tokenizer-less vocabulary every synthetic file has.
fn expected_metadata(r: &Real, layers: usize) -> BTreeMap<String, Value> {
    let a = r.arch;
    let u = |x: u64| Value::U32(x as u32);
    let mut m = BTreeMap::new();
    let mut put = |k: &str, v: Value| assert!(m.insert(k.replace("{a}", a), v).is_none());
    put("general.architecture", Value::String(a.into()));
    put("{a}.block_count", u(layers as u64));
    put("{a}.context_length", u(262_144));
    put("{a}.embedding_length", u(r.n_embd));
    if a == "qwen3next" {
        put("{a}.feed_forward_length", u(5120));
    } else {
        put("{a}.rope.dimension_sections", Value::Array(Array::I32(vec![11, 11, 10, 0])));
    }
    put("{a}.attention.head_count", u(r.n_head));
    put("{a}.attention.head_count_kv", u(N_KV));
    put("{a}.attention.key_length", u(HD));
    put("{a}.attention.value_length", u(HD));
    put("{a}.rope.freq_base", Value::F32(1e7));
    put("{a}.rope.dimension_count", u(64));
    put("{a}.attention.layer_norm_rms_epsilon", Value::F32(1e-6));
    put("{a}.expert_count", u(r.n_expert));
    put("{a}.expert_used_count", u(r.n_expert_used as u64));
    put("{a}.expert_feed_forward_length", u(r.n_ff_exp));
    put("{a}.expert_shared_feed_forward_length", u(r.n_ff_exp));
    put("{a}.ssm.conv_kernel", u(TAPS));
    put("{a}.ssm.state_size", u(DK));
    put("{a}.ssm.group_count", u(NK));
    put("{a}.ssm.time_step_rank", u(r.n_v_heads));
    put("{a}.ssm.inner_size", u(r.n_v_heads * DK));
    put("{a}.attention.recurrent_layers", Value::Array(Array::Bool((0..layers).map(linear).collect())));
    put("{a}.full_attention_interval", u(4));
    put("{a}.vocab_size", u(r.n_vocab));
    put("general.file_type", u(15));
    put("general.quantization_version", u(2));
    put("tokenizer.ggml.model", Value::String("none".into()));
    put("tokenizer.ggml.pre", Value::String(if a == "qwen3next" { "qwen2" } else { "qwen35" }.into()));
    m
}

#[test]
fn metadata_is_the_converters() {
    for r in &REAL {
        for layers in [None, Some(5)] {
            let plan = plan(r.name, &SynthOptions { layers, ..Default::default() });
            let md: BTreeMap<String, Value> = plan.metadata.iter().cloned().collect();
            assert_eq!(md.len(), plan.metadata.len(), "{}: a key twice", r.name);
            let mut rest = md.clone();
            for (k, v) in expected_metadata(r, layers.unwrap_or(r.layers)) {
                assert_eq!(rest.remove(&k).as_ref(), Some(&v), "{}: {k}", r.name);
            }
            // What is left: the name and type, and where the file came from.
            let left: Vec<&str> = rest.keys().map(String::as_str).collect();
            assert_eq!(
                left,
                [
                    "general.name",
                    "general.type",
                    "turbospark.synth.like",
                    "turbospark.synth.routing",
                    "turbospark.synth.seed"
                ],
                "{}",
                r.name
            );
        }
    }
}

/// The values of one tensor of `plan`, dequantized.
fn values(plan: &Plan, name: &str) -> Vec<f32> {
    let t = plan.tensors.iter().find(|t| t.name == name).unwrap();
    let mut buf = vec![0u8; t.n_bytes() as usize];
    plan.fill(t, &mut buf).unwrap();
    let mut out = vec![0f32; t.n_elements() as usize];
    ts_quant::dequantize(t.ty, &buf, &mut out).unwrap();
    out
}

fn mean_rms(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    (mean, (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / n).sqrt())
}

#[test]
fn linear_attention_values_are_realistic() {
    let plan = plan("qwen3.5-397b-a17b", &SynthOptions { layers: Some(4), ..Default::default() });
    let mut a_all = Vec::new();
    let mut dt_all = Vec::new();
    for il in 0..3 {
        // ssm_a = -exp(A_log), A in [1, 16].
        let a = values(&plan, &format!("blk.{il}.ssm_a"));
        assert!(a.iter().all(|&x| (-16.0..=-1.0).contains(&x)), "{a:?}");
        a_all.extend(a);
        // dt_bias = softplus⁻¹(dt), dt in [0.001, 0.1].
        let dt = values(&plan, &format!("blk.{il}.ssm_dt.bias"));
        assert!(dt.iter().all(|&x| (-6.91..=-2.25).contains(&x)), "{dt:?}");
        dt_all.extend(dt);
        // Conv taps N(0, 1/4): the convolution keeps its input's spread.
        let (mean, rms) = mean_rms(&values(&plan, &format!("blk.{il}.ssm_conv1d.weight")));
        assert!(mean.abs() < 0.01 && (rms - 0.5).abs() < 0.01, "{mean} {rms}");
        let (mean, rms) = mean_rms(&values(&plan, &format!("blk.{il}.ssm_norm.weight")));
        assert!((mean - 1.0).abs() < 0.01 && (rms - 1.0).abs() < 0.01, "{mean} {rms}");
        // Projections give outputs of spread about 1 for normed inputs.
        for base in ["ssm_alpha.weight", "ssm_beta.weight", "attn_qkv.weight", "ssm_out.weight"] {
            let t = plan.tensors.iter().find(|t| t.name == format!("blk.{il}.{base}")).unwrap();
            let (mean, rms) = mean_rms(&values(&plan, &t.name));
            let want = 1.0 / (t.dims[0] as f64).sqrt();
            assert!(mean.abs() < 0.02 * want && (rms / want - 1.0).abs() < 0.03, "{base}: {mean} {rms} vs {want}");
        }
    }
    // Spread over the range, not bunched.
    let (lo, hi) = a_all.iter().fold((0f32, -100f32), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    assert!(lo < -12.0 && hi > -5.0, "{lo} {hi}");
    let (lo, hi) = dt_all.iter().fold((0f32, -100f32), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    assert!(lo < -5.5 && hi > -3.5, "{lo} {hi}");
    // The shared expert's gate: logits of spread about 1.
    let (_, rms) = mean_rms(&values(&plan, "blk.0.ffn_gate_inp_shexp.weight"));
    assert!((rms * 64.0 - 1.0).abs() < 0.05, "{rms}");
    for name in ["blk.3.attn_q_norm.weight", "blk.3.attn_k_norm.weight", "blk.3.post_attention_norm.weight"] {
        let (mean, _) = mean_rms(&values(&plan, name));
        assert!((mean - 1.0).abs() < 0.01, "{name}: {mean}");
    }
}

/// Writes `plan`, opens it in the engine and checks the configuration it reads; runs a
/// prompt of 4 tokens in one step, then 2 tokens one at a time; returns the file and the
/// last logits' root mean square.
fn run_in_engine(plan: &Plan, tag: &str) -> (common::TempFile, f64) {
    let s = &plan.spec;
    let file = common::TempFile::new(&format!("{}-{tag}", s.name));
    plan.write_into(File::create(&file.0).unwrap(), &mut ()).unwrap();
    assert_eq!(std::fs::metadata(&file.0).unwrap().len(), plan.file_size().unwrap(), "{}", s.name);
    let gguf = GgufFile::open(&file.0).unwrap();
    let written: Vec<_> = gguf.tensors().iter().map(|t| (t.name.clone(), t.ggml_type, t.dims.clone())).collect();
    let planned: Vec<_> = plan.tensors.iter().map(|t| (t.name.clone(), t.ty, t.dims.clone())).collect();
    assert_eq!(written, planned, "{}", s.name);
    let md: BTreeMap<String, Value> = gguf.metadata().iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    let planned_md: BTreeMap<String, Value> = plan.metadata.iter().cloned().collect();
    assert_eq!(md, planned_md, "{}", s.name);

    let model = Model::open(&file.0, ExpertPlacement::Mapped).unwrap_or_else(|e| panic!("{}: {e}", s.name));
    let cfg = &model.cfg;
    let lin = s.linear.unwrap();
    assert_eq!(cfg.arch.gguf_name(), s.family.gguf_arch());
    assert_eq!((cfg.n_layer, cfg.n_embd, cfg.n_vocab, cfg.n_nextn), (plan.n_layer, s.n_embd, s.n_vocab, 0));
    assert_eq!((cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v), (s.n_head, 2, 256, 256), "{}", s.name);
    assert!(cfg.attn_output_gate);
    let d = cfg.delta_net.as_ref().unwrap();
    assert_eq!((d.n_k_heads, d.n_v_heads, d.d_k, d.d_v, d.conv_kernel), (16, lin.n_v_heads, 128, 128, 4));
    let tiled = s.family == ts_synth::Family::Qwen35Moe;
    assert_eq!(d.key_head_of, if tiled { KeyHeadOf::Tiled } else { KeyHeadOf::Grouped });
    for (il, l) in cfg.layers.iter().enumerate() {
        assert!(l.moe);
        match &l.mixer {
            Mixer::DeltaNet => assert!(linear(il), "layer {il}"),
            Mixer::Attention(a) => {
                assert!(!linear(il), "layer {il}");
                assert_eq!((a.rope.n_rot, a.rope.freq_base, a.sliding_window), (64, 1e7, None));
            }
        }
    }
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!((moe.n_expert, moe.n_expert_used, moe.n_ff_exp), (s.n_expert, s.n_expert_used, s.n_ff_exp));
    let shared = moe.shared.unwrap();
    assert_eq!((shared.n_ff, shared.sigmoid_gated), (s.n_ff_shexp, true));

    let last = &common::prompt_then_decode(&model);
    assert_eq!(last.len(), s.n_vocab);
    assert!(last.iter().all(|x| x.is_finite()), "{}", s.name);
    let (_, rms) = mean_rms(last);
    eprintln!("{} ({} layers, {} experts): logits rms {rms:.3}", s.name, plan.n_layer, s.n_expert);
    drop(model);
    (file, rms)
}

#[test]
fn cut_down_hybrids_open_and_run_in_the_engine() {
    // As published, 4 layers (three linear, one attention): 2.56 and 4.13 GiB.
    for name in ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b"] {
        let plan = plan(name, &SynthOptions { layers: Some(4), ..Default::default() });
        let (file, rms) = run_in_engine(&plan, "4l");
        assert!((0.5..2.0).contains(&rms), "{name}: logits rms {rms}");
        // The routers' skew, through the engine (docs/SYNTH.md).
        let tokens = common::random_tokens(96, plan.spec.n_vocab, 5);
        let (per_layer, _) = common::route_tokens(&file.0, &tokens);
        let stats = RoutingStats::mean(&common::layer_stats(&per_layer, plan.spec.n_expert));
        eprintln!("{name}: {stats:?}");
        assert!((0.15..0.4).contains(&stats.overlap), "{name}: {stats:?}");
        assert!(stats.top_share > 0.35, "{name}: {stats:?}");
    }
    // The bigger two with 16 experts a layer (1.5 and 2.0 GiB; with all their experts 6.66
    // and 16.15 GiB: `published_hybrids_open_and_run_in_the_engine`); every other shape as
    // published.
    for name in ["qwen3.5-122b-a10b", "qwen3.5-397b-a17b"] {
        let mut spec = ts_synth::spec(name).unwrap();
        spec.n_expert = 16;
        let plan = Plan::new(&spec, &SynthOptions { layers: Some(4), ..Default::default() }).unwrap();
        let (_, rms) = run_in_engine(&plan, "4l-16x");
        assert!((0.5..2.0).contains(&rms), "{name}: logits rms {rms}");
    }
}

#[test]
#[ignore = "writes files of 6.66 and 16.15 GiB to the temporary directory"]
fn published_hybrids_open_and_run_in_the_engine() {
    for name in ["qwen3.5-122b-a10b", "qwen3.5-397b-a17b"] {
        let plan = plan(name, &SynthOptions { layers: Some(4), ..Default::default() });
        let (_, rms) = run_in_engine(&plan, "4l");
        assert!((0.5..2.0).contains(&rms), "{name}: logits rms {rms}");
    }
}

#[test]
fn activations_stay_sane_through_every_layer() {
    // All 40 layers of the 35B with 16 experts a layer (2.6 GiB instead of 19.7): the
    // residual stream neither explodes nor vanishes through 30 linear and 10 attention layers.
    let mut spec = ts_synth::spec("qwen3.5-35b-a3b").unwrap();
    spec.n_expert = 16;
    let plan = Plan::new(&spec, &SynthOptions::default()).unwrap();
    assert_eq!(plan.n_layer, 40);
    let (_, rms) = run_in_engine(&plan, "40l-16x");
    assert!((0.5..2.0).contains(&rms), "logits rms {rms}");
}
