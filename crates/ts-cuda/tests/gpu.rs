//! The CUDA backend against the CPU reference, op by op on random inputs of
//! real shapes, and every reference fixture on the GPU against its golden
//! (transformers) logits. Every test is ignored (CI has no GPU); on the GPU
//! machine tools/gpu-run.sh runs them with `--include-ignored`, and there a
//! missing device is a failure.

mod common;

use ts_cpu::ops::{self, AttentionParams, Rope};
use ts_cuda::Cuda;
use ts_gguf::GgmlType;
use ts_model::backend::{AttnShape, HeadNorm};
use ts_model::config::GatedActivation;
use ts_model::config::{Gating, MoeConfig};
use ts_model::weights::Weight;
use ts_model::{Backend, ExpertPlacement, Model, Row, SeqState};
use ts_testkit::{Golden, Rng, fixtures_dir};

/// Device 0; without one the test fails (it runs only when asked for, on the GPU machine).
fn gpu() -> Cuda {
    Cuda::open(0).unwrap_or_else(|e| panic!("no CUDA device ({e}): this test needs an NVIDIA GPU"))
}

/// max |a - b| / max |b|; NaN where `a` holds a value that is not finite.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    if a.iter().any(|v| !v.is_finite()) {
        return f32::NAN;
    }
    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let s = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    if d == 0.0 { 0.0 } else { d / s.max(1e-30) }
}

/// Random weights of type `ty`, `[n_out][k]`, and their f32 values.
fn random_weight(rng: &mut Rng, ty: GgmlType, n_out: usize, k: usize) -> (Weight, Vec<f32>) {
    random_tensor(rng, ty, vec![k, n_out])
}

/// Random weights of type `ty` with GGUF dims `dims` (rows of `dims[0]`), and their f32 values.
fn random_tensor(rng: &mut Rng, ty: GgmlType, dims: Vec<usize>) -> (Weight, Vec<f32>) {
    let k = dims[0];
    let n_out: usize = dims[1..].iter().product();
    let values = rng.normals(n_out * k, 0.05, 0.0);
    let row_bytes = k / ty.block_size() as usize * ty.type_size() as usize;
    let mut bytes = vec![0u8; n_out * row_bytes];
    if ts_quant::quantize(ty, &values, &mut bytes).is_err() {
        // Types without a quantizer here (MXFP4): random codes under a sane scale.
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = if i % 17 == 0 { 118 + (rng.next_u64() % 8) as u8 } else { rng.next_u64() as u8 };
        }
    }
    let mut deq = vec![0f32; n_out * k];
    ts_quant::dequantize(ty, &bytes, &mut deq).unwrap();
    (Weight::from_bytes("w", ty, dims, bytes), deq)
}

#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn matmul_every_type_matches_the_cpu() {
    let mut cuda = gpu();
    let mut rng = Rng::new(7);
    // (type, n_out, k) from the real models' and synthetic models' shapes.
    let cases = [
        (GgmlType::F32, 576, 576),
        (GgmlType::F16, 640, 1024),
        (GgmlType::BF16, 640, 1024),
        (GgmlType::Q8_0, 1536, 896),
        (GgmlType::Q4_0, 1536, 576),
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q5_0, 896, 4864),
        (GgmlType::Q5_1, 896, 1024),
        (GgmlType::Q2_K, 768, 2048),
        (GgmlType::Q3_K, 768, 2048),
        (GgmlType::Q4_K, 1536, 2048),
        (GgmlType::Q5_K, 1024, 2048),
        (GgmlType::Q6_K, 1152, 2048),
        (GgmlType::MXFP4, 2880, 2880),
    ];
    let mut failures = Vec::new();
    // The device copies are found by host address: keep every weight alive.
    let mut alive = Vec::new();
    // Every case but m = 8 and the exact ones adds a bias (m = 48: the f16 tensor cores).
    // Below 32 rows the types with integer dot products take 8-bit activations unless exact:
    // their reference is the product with those activations (common::quantize_q8, written
    // from the format's definition), so a quant off by one shows.
    println!(
        "{:<6} {:>5} {:>5}  m=1      m=3      m=5      m=7      m=8      m=13     m=1 exact m=48 f16 m=48 exact",
        "type", "n_out", "k"
    );
    for (ty, n_out, k) in cases {
        let (w, wf) = random_weight(&mut rng, ty, n_out, k);
        cuda.upload_weight(&w).unwrap();
        let bias = rng.normals(n_out, 1.0, 0.0);
        cuda.upload_vec(&bias).unwrap();
        let mut line = format!("{:<6} {n_out:>5} {k:>5}", ty.to_string());
        let q8 = ts_cuda::q8_suffix(ty).is_some();
        for (m, exact) in [
            (1, false),
            (3, false),
            (5, false),
            (7, false),
            (8, false),
            (13, false),
            (1, true),
            (48, false),
            (48, true),
        ] {
            let x = rng.normals(m * k, 1.0, 0.0);
            let xd = cuda.act_from_host(&x).unwrap();
            // Every other case with a bias, so both kernel paths run with and without one.
            let with_bias = m != 8 && !exact;
            let b = with_bias.then_some(bias.as_slice());
            let y = cuda.linear(&w, b, &xd, m, &mut cuda.scratch(exact)).unwrap();
            let x_used = if q8 && m < 32 && !exact {
                let (q, ds) = common::quantize_q8(&x);
                common::dequantize_q8(&q, &ds)
            } else {
                x.clone()
            };
            let (mut want, _) = common::reference_matmul(&wf, &x_used, n_out, k, m);
            if with_bias {
                want.iter_mut().enumerate().for_each(|(i, v)| *v += bias[i % n_out]);
            }
            let got = cuda.to_host(&y).unwrap();
            let err = rel_err(&got, &want);
            if (2..32).contains(&m) && !exact {
                // Each row of a step of several rows is what a one-row step gives it, bit for
                // bit (a check of guessed tokens must sample what plain decoding would).
                for r in 0..m {
                    let xr = cuda.act_from_host(&x[r * k..(r + 1) * k]).unwrap();
                    let alone = cuda.to_host(&cuda.linear(&w, b, &xr, 1, &mut cuda.scratch(false)).unwrap()).unwrap();
                    let row = &got[r * n_out..(r + 1) * n_out];
                    if let Some(o) = (0..n_out).find(|&o| row[o].to_bits() != alone[o].to_bits()) {
                        failures.push(format!(
                            "{ty} {n_out}x{k} m={m}: row {r} output {o} is {:e}, alone {:e}",
                            row[o], alone[o]
                        ));
                        break;
                    }
                }
            }
            // f32 accumulation of dequantized weights (exact integer sums per block on the
            // 8-bit path): summation order only. The tensor-core path rounds weights and
            // activations to f16 (2^-11 relative).
            let bound = if m >= 32 && !exact { 4e-3 } else { 2e-5 };
            line += &format!(" {err:8.1e}");
            if err.is_nan() || err > bound {
                failures.push(format!("{ty} {n_out}x{k} m={m} exact={exact}: {err:e} > {bound:e}"));
            }
        }
        println!("{line}");
        alive.push((w, bias));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A step's projections of one input (`linears`: one `matvec_q8_multi` launch where every
/// weight has an 8-bit kernel) give each output what its own launch gives (`linear`), bit for
/// bit, and the product with the 8-bit activations within the same bound as a launch alone.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn projections_of_one_input_match_their_own_launches() {
    let mut cuda = gpu();
    let mut rng = Rng::new(11);
    // (k, [(type, n_out, with a bias)]): qwen3's q, k, v; gpt-oss's; mixed 32-element types.
    type Parts = &'static [(GgmlType, usize, bool)];
    let cases: [(usize, Parts); 3] = [
        (2048, &[(GgmlType::Q4_K, 4096, false), (GgmlType::Q4_K, 512, false), (GgmlType::Q6_K, 512, false)]),
        (2880, &[(GgmlType::Q8_0, 4096, true), (GgmlType::Q8_0, 512, true), (GgmlType::Q8_0, 512, true)]),
        (896, &[(GgmlType::Q5_0, 896, true), (GgmlType::MXFP4, 128, false), (GgmlType::Q4_0, 128, true)]),
    ];
    let mut failures = Vec::new();
    let mut alive = Vec::new();
    for (k, parts) in cases {
        let ws: Vec<(Weight, Vec<f32>, Vec<f32>, bool)> = parts
            .iter()
            .map(|&(ty, n_out, with_bias)| {
                let (w, wf) = random_weight(&mut rng, ty, n_out, k);
                cuda.upload_weight(&w).unwrap();
                let bias = rng.normals(n_out, 1.0, 0.0);
                cuda.upload_vec(&bias).unwrap();
                (w, wf, bias, with_bias)
            })
            .collect();
        for m in [1, 2] {
            let x = rng.normals(m * k, 1.0, 0.0);
            let xd = cuda.act_from_host(&x).unwrap();
            let list: Vec<(&Weight, Option<&[f32]>)> =
                ws.iter().map(|(w, _, bias, with)| (w, with.then_some(bias.as_slice()))).collect();
            let together = cuda.linears(&list, &xd, m, &mut cuda.scratch(false)).unwrap();
            let (q, ds) = common::quantize_q8(&x);
            let x_used = common::dequantize_q8(&q, &ds);
            for (((w, wf, bias, with), &(ty, n_out, _)), got) in ws.iter().zip(parts).zip(&together) {
                let got = cuda.to_host(got).unwrap();
                let b = with.then_some(bias.as_slice());
                let alone = cuda.to_host(&cuda.linear(w, b, &xd, m, &mut cuda.scratch(false)).unwrap()).unwrap();
                if let Some(o) = (0..got.len()).find(|&o| got[o].to_bits() != alone[o].to_bits()) {
                    failures.push(format!("{ty} {n_out}x{k} m={m}: output {o} {:e}, alone {:e}", got[o], alone[o]));
                }
                let (mut want, _) = common::reference_matmul(wf, &x_used, n_out, k, m);
                if *with {
                    want.iter_mut().enumerate().for_each(|(i, v)| *v += bias[i % n_out]);
                }
                let err = rel_err(&got, &want);
                println!("{ty} {n_out}x{k} m={m}: {err:.1e}");
                if err.is_nan() || err > 2e-5 {
                    failures.push(format!("{ty} {n_out}x{k} m={m}: {err:e} > 2e-5"));
                }
            }
        }
        alive.push(ws);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn embedding_rows_match_the_cpu() {
    let mut cuda = gpu();
    let mut rng = Rng::new(8);
    let mut alive = Vec::new();
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q5_0] {
        let (w, _) = random_weight(&mut rng, ty, 300, 512);
        cuda.upload_weight(&w).unwrap();
        let tokens = [0u32, 299, 17, 17, 150];
        let got = cuda.to_host(&cuda.embed(&w, &tokens).unwrap()).unwrap();
        let want = ts_model::Cpu.embed(&w, &tokens).unwrap();
        assert_eq!(got, want, "{ty}");
        alive.push(w);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn elementwise_ops_match_the_cpu() {
    let mut cuda = gpu();
    let cpu = ts_model::Cpu;
    let mut rng = Rng::new(9);
    let (m, e) = (5, 2880);
    let x = rng.normals(m * e, 2.0, 0.1);
    let y = rng.normals(m * e, 1.0, 0.0);
    let w = rng.normals(e, 0.5, 1.0);
    let head_w = rng.normals(64, 0.5, 1.0);
    cuda.upload_vec(&w).unwrap();
    cuda.upload_vec(&head_w).unwrap();
    let up = |v: &[f32]| cuda.act_from_host(v).unwrap();
    let check = |name: &str, got: Vec<f32>, want: &[f32], bound: f32| {
        let err = rel_err(&got, want);
        println!("{name:<28} {err:.2e}");
        assert!(err <= bound, "{name}: {err:e} > {bound:e}");
    };

    let want = cpu.rms_norm_to(&x, &w, 1e-6).unwrap();
    check("rms_norm", cuda.to_host(&cuda.rms_norm_to(&up(&x), &w, 1e-6).unwrap()).unwrap(), &want, 1e-6);
    for (piece, wt) in [(64, Some(&head_w[..])), (e, None)] {
        let (mut a, mut b) = (x.clone(), up(&x));
        cpu.rms_norm(&mut a, piece, wt, 1e-5).unwrap();
        cuda.rms_norm(&mut b, piece, wt, 1e-5).unwrap();
        check(&format!("rms_norm pieces of {piece}"), cuda.to_host(&b).unwrap(), &a, 1e-6);
    }
    let (mut a, mut b) = (x.clone(), up(&x));
    cpu.add(&mut a, &y).unwrap();
    cuda.add(&mut b, &up(&y)).unwrap();
    check("add", cuda.to_host(&b).unwrap(), &a, 0.0);
    // The fused residual add and norm: the sum left in x, the norm of it returned.
    let (mut a, mut b) = (x.clone(), up(&x));
    let want = cpu.add_rms_norm_to(&mut a, &y, &w, 1e-6).unwrap();
    let got = cuda.add_rms_norm_to(&mut b, &up(&y), &w, 1e-6).unwrap();
    check("add_rms_norm (sum)", cuda.to_host(&b).unwrap(), &a, 0.0);
    check("add_rms_norm (norm)", cuda.to_host(&got).unwrap(), &want, 1e-6);
    let (mut a, mut b) = (x.clone(), up(&x));
    cpu.scale(&mut a, 0.125).unwrap();
    cuda.scale(&mut b, 0.125).unwrap();
    check("scale", cuda.to_host(&b).unwrap(), &a, 0.0);
    let (mut a, mut b) = (x.clone(), up(&x));
    cpu.softcap(&mut a, 3.0).unwrap();
    cuda.softcap(&mut b, 3.0).unwrap();
    check("softcap", cuda.to_host(&b).unwrap(), &a, 1e-6);
    for act in
        [GatedActivation::SwiGlu, GatedActivation::GeGlu, GatedActivation::SwiGluClamped { alpha: 1.702, limit: 7.0 }]
    {
        let (mut a, mut b) = (x.clone(), up(&x));
        cpu.gated(act, &mut a, &y).unwrap();
        cuda.gated(act, &mut b, &up(&y)).unwrap();
        check(&format!("{act:?}"), cuda.to_host(&b).unwrap(), &a, 1e-5);
    }
}

/// A norm feeding few rows writes the 8-bit copy its next matmul reads (instead of a quantize
/// kernel): the matmul on it equals, bit for bit, the same matmul on the same floats uploaded
/// anew (quantized by `quantize_q8_1`); with the residual add too, and for q, k and v alike.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn norm_quantized_copy_equals_the_quantize_kernel() {
    let mut cuda = gpu();
    let mut rng = Rng::new(11);
    let (m, e, n_out) = (3, 2048, 512);
    let x = rng.normals(m * e, 2.0, 0.1);
    let y = rng.normals(m * e, 1.0, 0.0);
    let w = rng.normals(e, 0.5, 1.0);
    cuda.upload_vec(&w).unwrap();
    let weights: Vec<_> = [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::MXFP4]
        .into_iter()
        .map(|ty| random_weight(&mut rng, ty, n_out, e).0)
        .collect();
    for wt in &weights {
        cuda.upload_weight(wt).unwrap();
    }
    let mut s = cuda.scratch(false);
    for add in [false, true] {
        let mut xd = cuda.act_from_host(&x).unwrap();
        let normed = if add {
            cuda.add_rms_norm_to(&mut xd, &cuda.act_from_host(&y).unwrap(), &w, 1e-6).unwrap()
        } else {
            cuda.rms_norm_to(&xd, &w, 1e-6).unwrap()
        };
        let fused: Vec<Vec<f32>> = weights
            .iter()
            .map(|wt| cuda.to_host(&cuda.linear(wt, None, &normed, m, &mut s).unwrap()).unwrap())
            .collect();
        let again = cuda.act_from_host(&cuda.to_host(&normed).unwrap()).unwrap();
        for (wt, want) in weights.iter().zip(&fused) {
            let got = cuda.to_host(&cuda.linear(wt, None, &again, m, &mut s).unwrap()).unwrap();
            assert!(got == *want, "{} (add {add}): the norm's 8-bit copy differs from quantize_q8_1's", wt.ty);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn rope_matches_the_cpu() {
    let cuda = gpu();
    let mut rng = Rng::new(10);
    let rows: Vec<Row> = [0usize, 1, 7, 300, 4095]
        .iter()
        .enumerate()
        .map(|(i, &pos)| Row { token: 0, pos, seq: i % 2, logits: false })
        .collect();
    // Two sequences so begin_step has caches to point at.
    let mut kv: Vec<SeqState<ts_cuda::GpuState>> = (0..2)
        .map(|_| SeqState {
            state: cuda.kv_for(&[None], 64, 64, 4096, 8).unwrap(),
            n_past: 0,
            n_ctx: 4096,
            max_chunk: 8,
        })
        .collect();
    let mut seqs: Vec<&mut SeqState<ts_cuda::GpuState>> = kv.iter_mut().collect();
    for (interleaved, hd, n_rot, mscale) in [(false, 64, 64, 1.0), (true, 128, 128, 1.0), (false, 128, 32, 1.35)] {
        let inv_freq: Vec<f32> = (0..n_rot / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / n_rot as f32)).collect();
        let rope = Rope { interleaved, n_rot, inv_freq, mscale };
        let mut c = Cuda::open(0).unwrap();
        c.push_rope(&rope.inv_freq, None).unwrap();
        c.begin_step(&rows, &mut seqs, &c.scratch(true)).unwrap();
        let x = rng.normals(rows.len() * 4 * hd, 1.0, 0.0);
        let mut a = x.clone();
        ts_model::Cpu.rope(0, &rope, &mut a, hd, &rows).unwrap();
        let mut b = c.act_from_host(&x).unwrap();
        c.rope(0, &rope, &mut b, hd, &rows).unwrap();
        let err = rel_err(&c.to_host(&b).unwrap(), &a);
        println!("rope interleaved {interleaved} hd {hd} n_rot {n_rot} mscale {mscale}: {err:.2e}");
        assert!(err < 2e-5, "{err:e}");
    }
}

/// Attention of `n_head` query heads over `n_head_kv` KV heads, scaled by 1/sqrt(hd), no
/// softcap or sinks.
fn plain_attention(n_head: usize, n_head_kv: usize, hd: usize, hdv: usize) -> AttnShape<'static> {
    AttnShape {
        n_head,
        n_head_kv,
        head_dim: hd,
        head_dim_v: hdv,
        scale: 1.0 / (hd as f32).sqrt(),
        softcap: None,
        sinks: None,
    }
}

/// A device with one attention layer's rotation (`n_rot` of `hd`, mscale 1.1) and random
/// per-head q and k norm scales on it: (device, rope, q scales, k scales).
fn rope_layer(rng: &mut Rng, hd: usize, n_rot: usize, interleaved: bool) -> (Cuda, Rope, Vec<f32>, Vec<f32>) {
    let inv_freq: Vec<f32> = (0..n_rot / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / n_rot as f32)).collect();
    let rope = Rope { interleaved, n_rot, inv_freq, mscale: 1.1 };
    let (q_scale, k_scale) = (rng.normals(hd, 0.5, 1.0), rng.normals(hd, 0.5, 1.0));
    let mut c = Cuda::open(0).unwrap();
    c.push_rope(&rope.inv_freq, None).unwrap();
    c.upload_vec(&q_scale).unwrap();
    c.upload_vec(&k_scale).unwrap();
    (c, rope, q_scale, k_scale)
}

/// `rope_store` (per-head norms, rotations and the cache store in one kernel) against the
/// CPU's ops one by one: the rotated q and k, and what attention then reads from the cache.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn rope_store_matches_the_cpu() {
    let cuda = gpu();
    let mut rng = Rng::new(13);
    // (n_head, n_head_kv, hd, hdv, n_rot, interleaved, norm: 0 none, 1 unscaled, 2 scaled)
    for (n_head, n_head_kv, hd, hdv, n_rot, interleaved, norm) in [
        (8, 2, 64, 64, 64, false, 2),
        (32, 4, 128, 128, 128, false, 2),
        (4, 4, 128, 128, 32, true, 0),
        (8, 1, 256, 256, 256, false, 1),
        (4, 2, 512, 512, 128, false, 2),
        (6, 2, 96, 64, 96, true, 2),
    ] {
        let m = 6;
        let (q_dim, kv_dim, v_dim) = (n_head * hd, n_head_kv * hd, n_head_kv * hdv);
        let (c, rope, q_scale, k_scale) = rope_layer(&mut rng, hd, n_rot, interleaved);
        let kv = cuda.kv_for(&[None], kv_dim, v_dim, 16, m).unwrap();
        let mut seq = SeqState { state: kv, n_past: 0, n_ctx: 16, max_chunk: m };
        // Positions 0.. so that attention reads back only what rope_store stored.
        let rows: Vec<Row> = (0..m).map(|pos| Row { token: 0, pos, seq: 0, logits: false }).collect();
        let (q, k, v) =
            (rng.normals(m * q_dim, 1.0, 0.0), rng.normals(m * kv_dim, 1.0, 0.0), rng.normals(m * v_dim, 1.0, 0.0));
        let head_norm = match norm {
            0 => None,
            1 => Some(HeadNorm { q: None, k: None, eps: 1e-6 }),
            _ => Some(HeadNorm { q: Some(&q_scale), k: Some(&k_scale), eps: 1e-6 }),
        };
        let (mut want_q, mut want_k) = (q.clone(), k.clone());
        for (x, w) in [(&mut want_q, head_norm.and_then(|n| n.q)), (&mut want_k, head_norm.and_then(|n| n.k))] {
            if head_norm.is_some() {
                ops::rms_norm_pieces(x, hd, w, 1e-6);
            }
            ts_model::Cpu.rope(0, &rope, x, hd, &rows).unwrap();
        }
        c.begin_step(&rows, &mut [&mut seq], &c.scratch(true)).unwrap();
        let (mut gq, mut gk, gv) =
            (c.act_from_host(&q).unwrap(), c.act_from_host(&k).unwrap(), c.act_from_host(&v).unwrap());
        c.rope_store(0, &rope, &mut gq, Some((&mut gk, &gv)), head_norm, hd, &rows, &mut [&mut seq]).unwrap();
        let (err_q, err_k) = (rel_err(&c.to_host(&gq).unwrap(), &want_q), rel_err(&c.to_host(&gk).unwrap(), &want_k));
        // What attention reads back: the stored keys and values of every row so far.
        let shape = plain_attention(n_head, n_head_kv, hd, hdv);
        let got = c.to_host(&c.attention(0, &shape, &gq, &rows, &mut [&mut seq], &c.scratch(true)).unwrap()).unwrap();
        let mut err_attn = 0f32;
        for i in 0..m {
            for h in 0..n_head {
                let kvh = h / (n_head / n_head_kv);
                let p = AttentionParams { scale: shape.scale, softcap: None, sink: None };
                let mut o = vec![0f32; hdv];
                ops::attend(
                    &want_q[i * q_dim + h * hd..i * q_dim + (h + 1) * hd],
                    (0..=i).map(|j| &want_k[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd]),
                    (0..=i).map(|j| &v[j * v_dim + kvh * hdv..j * v_dim + (kvh + 1) * hdv]),
                    &p,
                    &mut Vec::new(),
                    &mut o,
                );
                err_attn = err_attn.max(rel_err(&got[(i * n_head + h) * hdv..(i * n_head + h + 1) * hdv], &o));
            }
        }
        println!(
            "rope_store heads {n_head}/{n_head_kv} hd {hd}/{hdv} n_rot {n_rot} interleaved {interleaved} norm {norm}: q {err_q:.2e} k {err_k:.2e} attention {err_attn:.2e}"
        );
        assert!(err_q < 2e-5 && err_k < 2e-5 && err_attn < 1e-5, "{err_q:e} {err_k:e} {err_attn:e}");
        // A layer sharing another's cache: only the queries.
        let mut gq = c.act_from_host(&q).unwrap();
        c.rope_store(0, &rope, &mut gq, None, head_norm, hd, &rows, &mut [&mut seq]).unwrap();
        assert!(rel_err(&c.to_host(&gq).unwrap(), &want_q) < 2e-5);
    }
}

/// Decode rows of distinct sequences through `rope_store_attention`, where the attention
/// kernel makes the queries and new keys ready and stores them itself: its output against the
/// CPU's norms, rotations and attention over each sequence's earlier keys (stored by
/// `rope_store`) plus the new one, and what it stored, read back by plain attention.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn rope_store_in_decode_attention_matches_the_cpu() {
    let mut rng = Rng::new(17);
    // (n_head, n_head_kv, hd, hdv, n_rot, interleaved, norm, each sequence's earlier positions)
    for (n_head, n_head_kv, hd, hdv, n_rot, interleaved, norm, past) in [
        (32, 4, 128, 128, 128, false, true, [5, 0, 9]),
        (8, 2, 64, 64, 32, true, false, [3, 1, 2]),
        // Caches long enough for split runs.
        (16, 2, 128, 128, 128, false, true, [700, 1030, 40]),
        (6, 2, 96, 64, 96, true, true, [4, 7, 0]),
        (8, 1, 256, 256, 256, false, true, [600, 2, 1]),
        // A cache of more than 64 tiles: runs of two tiles (8,900 positions), one run of two
        // tiles, and a row whose one tile leaves every other run idle.
        (8, 2, 64, 64, 64, false, false, [8900, 130, 0]),
        // Two blocks of 8 query heads a KV head, each making the KV head's new key ready.
        (32, 2, 64, 64, 64, true, true, [300, 5, 1]),
    ] {
        let n_ctx = (past.iter().max().unwrap() + 70).max(1100);
        let (q_dim, kv_dim, v_dim) = (n_head * hd, n_head_kv * hd, n_head_kv * hdv);
        let (mut c, rope, q_scale, k_scale) = rope_layer(&mut rng, hd, n_rot, interleaved);
        let head_norm = norm.then_some(HeadNorm { q: Some(&q_scale), k: Some(&k_scale), eps: 1e-6 });
        // The CPU's ready heads: normed where asked, rotated at each row's position.
        let ready = |x: &[f32], w: &[f32], rows: &[Row]| {
            let mut x = x.to_vec();
            if norm {
                ops::rms_norm_pieces(&mut x, hd, Some(w), 1e-6);
            }
            ts_model::Cpu.rope(0, &rope, &mut x, hd, rows).unwrap();
            x
        };
        let shape = plain_attention(n_head, n_head_kv, hd, hdv);
        let mut states: Vec<SeqState<_>> = (0..past.len())
            .map(|_| SeqState {
                state: c.kv_for(&[None], kv_dim, v_dim, n_ctx, n_ctx).unwrap(),
                n_past: 0,
                n_ctx,
                max_chunk: n_ctx,
            })
            .collect();
        // Each sequence's earlier keys and values, stored by rope_store in a step of its own
        // (direct steps: a recorded one would run only at its end).
        let mut cached: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
        for (s, &n) in past.iter().enumerate() {
            let rows: Vec<Row> = (0..n).map(|pos| Row { token: 0, pos, seq: 0, logits: false }).collect();
            let (q, k, v) =
                (rng.normals(n * q_dim, 1.0, 0.0), rng.normals(n * kv_dim, 1.0, 0.0), rng.normals(n * v_dim, 1.0, 0.0));
            if n == 0 {
                cached.push((Vec::new(), Vec::new()));
                continue;
            }
            let seq = &mut states[s];
            c.begin_direct_step(&rows, &mut [seq], &c.scratch(true)).unwrap();
            let (mut gq, mut gk, gv) =
                (c.act_from_host(&q).unwrap(), c.act_from_host(&k).unwrap(), c.act_from_host(&v).unwrap());
            c.rope_store(0, &rope, &mut gq, Some((&mut gk, &gv)), head_norm, hd, &rows, &mut [seq]).unwrap();
            cached.push((ready(&k, &k_scale, &rows), v));
        }
        // One decode row per sequence, at its next position.
        let rows: Vec<Row> =
            past.iter().enumerate().map(|(s, &n)| Row { token: 0, pos: n, seq: s, logits: false }).collect();
        let m = rows.len();
        let (q, k, v) =
            (rng.normals(m * q_dim, 1.0, 0.0), rng.normals(m * kv_dim, 1.0, 0.0), rng.normals(m * v_dim, 1.0, 0.0));
        let (want_q, want_k) = (ready(&q, &q_scale, &rows), ready(&k, &k_scale, &rows));
        let mut want = vec![0f32; m * n_head * hdv];
        for (i, row) in rows.iter().enumerate() {
            let (keys, values) = &cached[row.seq];
            for h in 0..n_head {
                let kvh = h / (n_head / n_head_kv);
                let key = |j: usize| match j < row.pos {
                    true => &keys[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd],
                    false => &want_k[i * kv_dim + kvh * hd..i * kv_dim + (kvh + 1) * hd],
                };
                let value = |j: usize| match j < row.pos {
                    true => &values[j * v_dim + kvh * hdv..j * v_dim + (kvh + 1) * hdv],
                    false => &v[i * v_dim + kvh * hdv..i * v_dim + (kvh + 1) * hdv],
                };
                let p = AttentionParams { scale: shape.scale, softcap: None, sink: None };
                let o = &mut want[(i * n_head + h) * hdv..(i * n_head + h + 1) * hdv];
                let qh = &want_q[i * q_dim + h * hd..i * q_dim + (h + 1) * hd];
                ops::attend(qh, (0..=row.pos).map(key), (0..=row.pos).map(value), &p, &mut Vec::new(), o);
            }
        }
        // Decode blocks of one query head, then of several (the new key made ready by each).
        for grouped in [false, true] {
            c.set_attention_group_from(if grouped { 0 } else { usize::MAX });
            let mut seqs: Vec<&mut SeqState<_>> = states.iter_mut().collect();
            c.begin_direct_step(&rows, &mut seqs, &c.scratch(true)).unwrap();
            let (mut gq, mut gk, gv) =
                (c.act_from_host(&q).unwrap(), c.act_from_host(&k).unwrap(), c.act_from_host(&v).unwrap());
            let out = c
                .rope_store_attention(
                    0,
                    &rope,
                    &mut gq,
                    Some((&mut gk, &gv)),
                    head_norm,
                    &shape,
                    &rows,
                    &mut seqs,
                    &c.scratch(true),
                )
                .unwrap();
            // The fused kernel leaves q as the projection wrote it (the ops one by one rotate it).
            assert_eq!(c.to_host(&gq).unwrap(), q, "the attention kernel did not take rope_store's work");
            let err_fused = rel_err(&c.to_host(&out).unwrap(), &want);
            // What it stored: plain attention of the ready queries reads the new keys from the cache.
            let gq = c.act_from_host(&want_q).unwrap();
            let err_stored = rel_err(
                &c.to_host(&c.attention(0, &shape, &gq, &rows, &mut seqs, &c.scratch(true)).unwrap()).unwrap(),
                &want,
            );
            println!(
                "rope_store in attention: heads {n_head}/{n_head_kv} hd {hd}/{hdv} n_rot {n_rot} past {past:?} grouped {grouped}: fused {err_fused:.2e}, stored {err_stored:.2e}"
            );
            assert!(err_fused < 1e-5 && err_stored < 1e-5, "{err_fused:e} {err_stored:e}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn router_matches_the_cpu() {
    let cuda = gpu();
    let mut rng = Rng::new(11);
    for (n_expert, k, gating, renormalize) in [
        (32, 4, Gating::SoftmaxOverTopK, false),
        (128, 8, Gating::Softmax, true),
        (60, 4, Gating::Softmax, false),
        (8, 2, Gating::Softmax, true),
    ] {
        let moe = MoeConfig { n_expert, n_expert_used: k, n_ff_exp: 8, gating, renormalize, shared: None };
        let m = 40;
        let mut logits = rng.normals(m * n_expert, 2.0, 0.0);
        logits[3] = logits[5]; // a tie: the lower index wins
        // Every other case with per-expert output scales (Gemma 4).
        let scale: Vec<f32> = (0..n_expert).map(|e| 0.5 + e as f32 / n_expert as f32).collect();
        let scale = renormalize.then_some(scale.as_slice());
        let (ids, wts) = cuda.route_rows(&cuda.act_from_host(&logits).unwrap(), m, &moe, scale).unwrap();
        for r in 0..m {
            let want = ts_model::moe::route(&moe, &logits[r * n_expert..(r + 1) * n_expert], scale);
            let got_ids: Vec<usize> = ids[r * k..(r + 1) * k].iter().map(|&i| i as usize).collect();
            assert_eq!(got_ids, want.experts, "row {r} {gating:?}");
            let err = rel_err(&wts[r * k..(r + 1) * k], &want.weights);
            assert!(err < 1e-5, "row {r}: weights {err:e}");
        }
    }
}

/// The router and the routing of few rows in one launch (`router_route`) against the CPU's
/// router matmul and routing; twice, as its per-row counters must be back at zero.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn router_route_matches_the_cpu() {
    let _ = gpu();
    let mut rng = Rng::new(14);
    for (n_expert, k, n_embd, gating, renormalize, biased) in [
        (128, 8, 2048, Gating::Softmax, true, false),
        (32, 4, 2880, Gating::SoftmaxOverTopK, false, true),
        (60, 4, 64, Gating::Softmax, false, true),
        // 256 experts: the most the register path takes; 512 (Qwen3-Next): the shared-memory one.
        (256, 8, 1024, Gating::Softmax, true, false),
        (512, 10, 256, Gating::Softmax, true, true),
    ] {
        let moe = MoeConfig { n_expert, n_expert_used: k, n_ff_exp: 8, gating, renormalize, shared: None };
        let (router, wf) = random_weight(&mut rng, GgmlType::F32, n_expert, n_embd);
        let bias = rng.normals(n_expert, 0.5, 0.0);
        let bias = biased.then_some(bias.as_slice());
        let scale: Vec<f32> = (0..n_expert).map(|e| 0.5 + e as f32 / n_expert as f32).collect();
        let scale = renormalize.then_some(scale.as_slice());
        let mut c = Cuda::open(0).unwrap();
        c.upload_weight(&router).unwrap();
        for v in [bias, scale].into_iter().flatten() {
            c.upload_vec(v).unwrap();
        }
        for m in [1, 3, 8, 8] {
            let x = rng.normals(m * n_embd, 1.0, 0.0);
            let routes = c
                .route_input(&router, bias, &c.act_from_host(&x).unwrap(), m, &moe, scale, &mut c.scratch(false))
                .unwrap();
            // The i32 ids as the bits of the f32s to_host reads (this Cuda has no model to check them by).
            let ids: Vec<usize> = c.to_host(routes.ids()).unwrap().iter().map(|v| v.to_bits() as usize).collect();
            let wts = c.to_host(routes.weights()).unwrap();
            for r in 0..m {
                let logits: Vec<f32> = (0..n_expert)
                    .map(|e| {
                        let d: f64 = (0..n_embd).map(|i| wf[e * n_embd + i] as f64 * x[r * n_embd + i] as f64).sum();
                        d as f32 + bias.map_or(0.0, |b| b[e])
                    })
                    .collect();
                let want = ts_model::moe::route(&moe, &logits, scale);
                assert_eq!(&ids[r * k..(r + 1) * k], &want.experts[..], "row {r} of {m}, {gating:?}");
                let err = rel_err(&wts[r * k..(r + 1) * k], &want.weights);
                assert!(err < 1e-5, "row {r} of {m}: weights {err:e}");
            }
        }
        println!("router_route {n_expert} experts top {k}, n_embd {n_embd}, {gating:?}: ok");
    }
}

/// The FFN's residual add and norm with the router in one launch (`add_rms_norm_route`,
/// `norm_router_route` for up to 8 rows, the ops one by one past that) against the CPU's add,
/// norm and routing; and the next norm summing the experts' rows as it adds them
/// (`add_combined_rms_norm_to`) bit for bit against `combine` then `add_rms_norm_to`.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn norm_router_route_matches_the_cpu() {
    let _ = gpu();
    let cpu = ts_model::Cpu;
    let mut rng = Rng::new(15);
    for (n_expert, k, n_embd, gating, renormalize, biased) in [
        (128, 8, 2048, Gating::Softmax, true, false),
        (32, 4, 2880, Gating::SoftmaxOverTopK, false, true),
        (60, 4, 64, Gating::Softmax, false, true),
        (512, 10, 256, Gating::Softmax, true, true),
    ] {
        let moe = MoeConfig { n_expert, n_expert_used: k, n_ff_exp: 8, gating, renormalize, shared: None };
        let (router, wf) = random_weight(&mut rng, GgmlType::F32, n_expert, n_embd);
        let expert = |rng: &mut Rng| random_tensor(rng, GgmlType::F32, vec![n_embd, 8, 1]).0;
        let w = ts_model::tensors::MoeWeights {
            router,
            router_bias: biased.then(|| rng.normals(n_expert, 0.5, 0.0)),
            gate_exps: expert(&mut rng),
            up_exps: expert(&mut rng),
            down_exps: expert(&mut rng),
            gate_bias: None,
            up_bias: None,
            down_bias: None,
            expert_scale: renormalize.then(|| (0..n_expert).map(|e| 0.5 + e as f32 / n_expert as f32).collect()),
            input_norm: None,
            router_norm: None,
            output_norm: None,
            shared: None,
        };
        let norm = rng.normals(n_embd, 0.5, 1.0);
        let mut c = Cuda::open(0).unwrap();
        c.upload_weight(&w.router).unwrap();
        for v in [&w.router_bias, &w.expert_scale].into_iter().flatten() {
            c.upload_vec(v).unwrap();
        }
        c.upload_vec(&norm).unwrap();
        let up = |v: &[f32]| c.act_from_host(v).unwrap();
        for m in [1, 3, 8, 9] {
            let (x, y) = (rng.normals(m * n_embd, 2.0, 0.1), rng.normals(m * n_embd, 1.0, 0.0));
            let mut sum = x.clone();
            let want = cpu.add_rms_norm_to(&mut sum, &y, &norm, 1e-6).unwrap();
            let mut xd = up(&x);
            let (normed, routes) =
                c.add_rms_norm_route(&mut xd, &up(&y), &norm, 1e-6, &w, m, &moe, &mut c.scratch(false)).unwrap();
            assert_eq!(c.to_host(&xd).unwrap(), sum, "x + y, {m} rows of {n_embd}");
            let normed = c.to_host(&normed).unwrap();
            let err = rel_err(&normed, &want);
            assert!(err <= 1e-6, "normed, {m} rows of {n_embd}: {err:e}");
            let ids: Vec<usize> = c.to_host(routes.ids()).unwrap().iter().map(|v| v.to_bits() as usize).collect();
            let wts = c.to_host(routes.weights()).unwrap();
            for r in 0..m {
                let logits: Vec<f32> = (0..n_expert)
                    .map(|e| {
                        let d: f64 =
                            (0..n_embd).map(|i| wf[e * n_embd + i] as f64 * normed[r * n_embd + i] as f64).sum();
                        d as f32 + w.router_bias.as_ref().map_or(0.0, |b| b[e])
                    })
                    .collect();
                let want = ts_model::moe::route(&moe, &logits, w.expert_scale.as_deref());
                assert_eq!(&ids[r * k..(r + 1) * k], &want.experts[..], "row {r} of {m}, {gating:?}");
                let err = rel_err(&wts[r * k..(r + 1) * k], &want.weights);
                assert!(err < 1e-5, "row {r} of {m}: weights {err:e}");
            }
            // The experts' rows summed by the next norm, against combine and the add.
            let pairs = rng.normals(m * k * n_embd, 1.0, 0.0);
            let (mut a, mut b) = (up(&x), up(&x));
            let fused = c.add_combined_rms_norm_to(&mut a, &up(&pairs), &routes, &norm, 1e-6).unwrap();
            let combined = c.combine(&up(&pairs), &routes, n_embd).unwrap();
            let apart = c.add_rms_norm_to(&mut b, &combined, &norm, 1e-6).unwrap();
            assert_eq!(c.to_host(&a).unwrap(), c.to_host(&b).unwrap(), "combined sum, {m} rows");
            assert_eq!(c.to_host(&fused).unwrap(), c.to_host(&apart).unwrap(), "combined norm, {m} rows");
        }
        println!("norm_router_route {n_expert} experts top {k}, n_embd {n_embd}, {gating:?}: ok");
    }
}

/// What the kernels' 8-bit activations stand for (common::quantize_q8), for the types that
/// take them; `x` itself for the others.
fn as_multiplied(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    if ts_cuda::q8_suffix(ty).is_none() {
        return x.to_vec();
    }
    let (q, ds) = common::quantize_q8(x);
    common::dequantize_q8(&q, &ds)
}

#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn routed_experts_match_the_reference() {
    let mut cuda = gpu();
    let mut rng = Rng::new(13);
    let (n_expert, k_used, e, f) = (16, 4, 512, 256);
    let clamped = GatedActivation::SwiGluClamped { alpha: 1.702, limit: 7.0 };
    // (gate and up type, down type, activation, biases): qwen3-30b-a3b's, gpt-oss's, and
    // two 32-element legacy types.
    let cases = [
        (GgmlType::Q4_K, GgmlType::Q6_K, GatedActivation::SwiGlu, false),
        (GgmlType::MXFP4, GgmlType::MXFP4, clamped, true),
        (GgmlType::Q5_0, GgmlType::Q8_0, GatedActivation::SwiGlu, false),
    ];
    let moe = MoeConfig {
        n_expert,
        n_expert_used: k_used,
        n_ff_exp: f,
        gating: Gating::SoftmaxOverTopK,
        renormalize: false,
        shared: None,
    };
    let mut failures = Vec::new();
    // The device copies are found by host address: keep every weight alive.
    let mut alive = Vec::new();
    for (gu_ty, down_ty, act, biased) in cases {
        let (gate, gate_f) = random_tensor(&mut rng, gu_ty, vec![e, f, n_expert]);
        let (up, up_f) = random_tensor(&mut rng, gu_ty, vec![e, f, n_expert]);
        let (down, down_f) = random_tensor(&mut rng, down_ty, vec![f, e, n_expert]);
        let bias = |rng: &mut Rng, n: usize| biased.then(|| rng.normals(n, 0.5, 0.0));
        let w = ts_model::tensors::MoeWeights {
            router: random_weight(&mut rng, GgmlType::F32, n_expert, e).0,
            router_bias: None,
            gate_exps: gate,
            up_exps: up,
            down_exps: down,
            gate_bias: bias(&mut rng, n_expert * f),
            up_bias: bias(&mut rng, n_expert * f),
            down_bias: bias(&mut rng, n_expert * e),
            expert_scale: None,
            input_norm: None,
            router_norm: None,
            output_norm: None,
            shared: None,
        };
        for t in [&w.gate_exps, &w.up_exps, &w.down_exps] {
            cuda.upload_weight(t).unwrap();
        }
        for b in [&w.gate_bias, &w.up_bias, &w.down_bias].into_iter().flatten() {
            cuda.upload_vec(b).unwrap();
        }
        // 5 rows: the expert-indexed matvecs; 16 and 27: the chunked matvecs (pairs grouped
        // on the device; the favoured expert's in several chunks); 40 and 200: the grouped
        // kernels, one expert favoured so that it gets full tiles and the others short ones.
        for m in [5, 16, 27, 40, 200] {
            let x = rng.normals(m * e, 1.0, 0.0);
            let mut logits = rng.normals(m * n_expert, 1.0, 0.0);
            logits.iter_mut().step_by(n_expert).for_each(|l| *l += 1.5);
            let s = &mut Backend::scratch(&cuda, false);
            let routes = Backend::route(&cuda, &cuda.act_from_host(&logits).unwrap(), m, &moe, None).unwrap();
            let xd = cuda.act_from_host(&x).unwrap();
            let at = ts_model::backend::ExpertsAt::Stacked;
            let h = Backend::expert_gate_up(&cuda, &w, act, &xd, &routes, &at, s).unwrap();
            let mut y = Backend::uninit(&cuda, m * k_used * e).unwrap();
            Backend::expert_down(&cuda, &w, &h, &routes, &at, &mut y, s).unwrap();
            let got = cuda.to_host(&Backend::combine(&cuda, &y, &routes, e).unwrap()).unwrap();
            let routes: Vec<_> =
                (0..m).map(|r| ts_model::moe::route(&moe, &logits[r * n_expert..(r + 1) * n_expert], None)).collect();
            // Every projection with 8-bit kernels takes 8-bit activations (above 8 rows on the
            // int8 tensor cores); a type without them (Q8_0) above 8 rows, the f16 tensor cores.
            let mut pairs_of = vec![0usize; n_expert];
            routes.iter().flat_map(|r| &r.experts).for_each(|&ex| pairs_of[ex] += 1);
            let mut want = vec![0f32; m * e];
            for (r, route) in routes.iter().enumerate() {
                for (&ex, &wt) in route.experts.iter().zip(&route.weights) {
                    let xr = as_multiplied(gu_ty, &x[r * e..(r + 1) * e]);
                    let rows = |t: &[f32], n: usize, k: usize| t[ex * n * k..(ex + 1) * n * k].to_vec();
                    let (mut g, _) = common::reference_matmul(&rows(&gate_f, f, e), &xr, f, e, 1);
                    let (u, _) = common::reference_matmul(&rows(&up_f, f, e), &xr, f, e, 1);
                    if let (Some(gb), Some(ub)) = (&w.gate_bias, &w.up_bias) {
                        g.iter_mut().zip(&gb[ex * f..]).for_each(|(v, b)| *v += b);
                        let u: Vec<f32> = u.iter().zip(&ub[ex * f..]).map(|(v, b)| v + b).collect();
                        ts_model::cpu::gated_activation(act, &mut g, &u);
                    } else {
                        ts_model::cpu::gated_activation(act, &mut g, &u);
                    }
                    let hq = as_multiplied(down_ty, &g);
                    let (mut d, _) = common::reference_matmul(&rows(&down_f, e, f), &hq, e, f, 1);
                    if let Some(db) = &w.down_bias {
                        d.iter_mut().zip(&db[ex * e..]).for_each(|(v, b)| *v += b);
                    }
                    want[r * e..(r + 1) * e].iter_mut().zip(&d).for_each(|(o, v)| *o += wt * v);
                }
            }
            let err = rel_err(&got, &want);
            println!("{gu_ty}/{down_ty} {act:?} m={m}: {err:.2e}");
            // Summation order, and now and then an activation of h a quant step apart; f16
            // rounding where an expert of 32 pairs or more went through the tensor cores.
            let f16 = (0..n_expert).any(|ex| ts_cuda::q8_suffix(down_ty).is_none() && pairs_of[ex] >= 32);
            let bound = if m > 8 && f16 { 4e-3 } else { 2e-3 };
            if err.is_nan() || err > bound {
                failures.push(format!("{gu_ty}/{down_ty} m={m}: {err:e}"));
            }
        }
        alive.push(w);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn attention_matches_the_cpu() {
    let cuda = gpu();
    let mut rng = Rng::new(12);
    // (n_head, n_head_kv, hd, window, sinks, softcap)
    for (n_head, n_head_kv, hd, window, sinks, softcap) in [
        (8, 2, 64, None, false, None),
        (8, 2, 64, Some(5), true, None),
        (4, 1, 256, None, false, Some(50.0)),
        (16, 8, 128, Some(128), true, None),
        (4, 2, 512, None, false, None),
        (32, 4, 128, None, false, None),
        (12, 4, 64, Some(7), true, Some(30.0)),
        (6, 6, 96, Some(40), false, None),
        (4, 2, 66, Some(200), true, None),
        // 16 query heads to a KV head: two decode blocks of 8 share each key and value.
        (32, 2, 128, None, true, None),
    ] {
        // Chunks of 4 rows take the per-row kernel; of 20, `attention_prompt` where the shape allows,
        // and without `exact` `attention_prompt_mma` (f16 tensor cores) for heads of 64 and 128:
        // chunks of 20 and 60 cover its 64-row blocks partly and its 64-position tiles across
        // chunk edges. 300 positions: the per-row kernel's tiles of 128 (three, the last
        // partial), windows wrapping their ring of slots; a head size not a multiple of 4 reads
        // keys one by one. A cache of 2048 positions splits the per-row kernel's positions
        // over 4 blocks.
        // Decode rows run with blocks of one query head and of several (`grouped`).
        for (chunk, n_ctx, exact, grouped) in [
            (4, 300, true, false),
            (4, 300, true, true),
            (4, 2048, true, false),
            (4, 2048, true, true),
            (20, 300, true, false),
            (20, 300, false, false),
            (60, 300, false, false),
        ] {
            let n = 300;
            let (kv_dim, q_dim) = (n_head_kv * hd, n_head * hd);
            let kv = cuda.kv_for(&[window], kv_dim, kv_dim, n_ctx, chunk).unwrap();
            let mut seq = SeqState { state: kv, n_past: 0, n_ctx, max_chunk: chunk };
            let sink_v = rng.normals(n_head, 1.0, 0.0);
            let mut c = Cuda::open(0).unwrap();
            c.upload_vec(&sink_v).unwrap();
            c.push_rope(&[1.0], window).unwrap();
            c.set_attention_group_from(if grouped { 0 } else { usize::MAX });
            let shape = AttnShape {
                n_head,
                n_head_kv,
                head_dim: hd,
                head_dim_v: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                softcap,
                sinks: sinks.then_some(&sink_v[..]),
            };
            let (keys, values) = (rng.normals(n * kv_dim, 1.0, 0.0), rng.normals(n * kv_dim, 1.0, 0.0));
            let q = rng.normals(n * q_dim, 1.0, 0.0);
            let mut worst = 0f32;
            for c0 in (0..n).step_by(chunk) {
                let rows: Vec<Row> = (c0..c0 + chunk).map(|pos| Row { token: 0, pos, seq: 0, logits: false }).collect();
                let slice = |v: &[f32], w: usize| v[c0 * w..(c0 + chunk) * w].to_vec();
                let scratch = c.scratch(exact);
                c.begin_step(&rows, &mut [&mut seq], &scratch).unwrap();
                let (k, v) = (
                    c.act_from_host(&slice(&keys, kv_dim)).unwrap(),
                    c.act_from_host(&slice(&values, kv_dim)).unwrap(),
                );
                c.store_kv(0, &k, &v, &rows, &mut [&mut seq]).unwrap();
                let out = c
                    .attention(
                        0,
                        &shape,
                        &c.act_from_host(&slice(&q, q_dim)).unwrap(),
                        &rows,
                        &mut [&mut seq],
                        &scratch,
                    )
                    .unwrap();
                let got = c.to_host(&out).unwrap();
                for (i, r) in rows.iter().enumerate() {
                    for h in 0..n_head {
                        let kvh = h / (n_head / n_head_kv);
                        let first = window.map_or(0, |w| (r.pos + 1).saturating_sub(w));
                        let p = AttentionParams { scale: shape.scale, softcap, sink: shape.sinks.map(|s| s[h]) };
                        let mut o = vec![0f32; hd];
                        ops::attend(
                            &q[r.pos * q_dim + h * hd..r.pos * q_dim + (h + 1) * hd],
                            (first..=r.pos).map(|p| &keys[p * kv_dim + kvh * hd..p * kv_dim + (kvh + 1) * hd]),
                            (first..=r.pos).map(|p| &values[p * kv_dim + kvh * hd..p * kv_dim + (kvh + 1) * hd]),
                            &p,
                            &mut Vec::new(),
                            &mut o,
                        );
                        // f32::max would drop a NaN: a non-finite output fails here.
                        let err = rel_err(&got[i * q_dim + h * hd..i * q_dim + (h + 1) * hd], &o);
                        assert!(!err.is_nan(), "non-finite attention output");
                        worst = worst.max(err);
                    }
                }
            }
            println!(
                "attention heads {n_head}/{n_head_kv} hd {hd} window {window:?} sinks {sinks} softcap {softcap:?} chunk {chunk} cache {n_ctx} exact {exact} grouped {grouped}: {worst:.2e}"
            );
            // f16 keys, values, queries and weights where the tensor cores took the prompt.
            let f16 = !exact && chunk >= 16 && matches!(hd, 64 | 128);
            assert!(worst < if f16 { 4e-3 } else { 1e-5 }, "{worst:e}");
        }
    }
}

/// The median row error a fixture's logits may show against its reference with 8-bit
/// activations: the CPU's default path's bounds (ts-model's tests/fixtures.rs), the 8-layer
/// hybrids' Q8_0 files 1.25x llama.cpp's own figure on them.
fn eight_bit_bound(family: &str, variant: &str) -> f32 {
    match (family, variant) {
        ("qwen3_5_moe", "q8_0") => 1.45e-1,
        ("qwen3_next", "q8_0") => 2.3e-1,
        _ => 6e-2,
    }
}

/// Every fixture on the GPU: one token at a time (matvec kernels, routing on
/// the device), in chunks of 16 (8-bit matvecs, experts chunked on the device) and
/// of 64 (tensor cores, experts grouped), each with `exact` (f32 throughout) and
/// without (8-bit activations below 32 rows, f16 tensor cores for prompts).
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn fixtures_match_transformers_on_the_gpu() {
    drop(gpu()); // a clear failure first when there is no device
    let mut failures = Vec::new();
    let mut checked = 0;
    for f in ts_testkit::fixtures() {
        let (path, golden, family, variant) = (&f.model, &f.golden, &f.family, &f.variant);
        {
            let model = Model::open(path, ExpertPlacement::Mapped)
                .unwrap()
                .into_backend(|m| Cuda::new(0, m))
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            for (chunk, exact) in [(1, true), (1, false), (16, false), (64, true), (64, false)] {
                let n = golden.tokens.len();
                let mut seq = model.new_sequence(n, chunk).unwrap();
                let mut scratch = model.backend.scratch(exact);
                let mut rows_out = Vec::new();
                for (c, toks) in golden.tokens.chunks(chunk).enumerate() {
                    let rows: Vec<Row> = toks
                        .iter()
                        .enumerate()
                        .map(|(i, &t)| Row { token: t, pos: c * chunk + i, seq: 0, logits: true })
                        .collect();
                    rows_out.extend(model.forward(&rows, &mut [&mut seq], &mut scratch).unwrap());
                }
                let cmp = golden.compare(&rows_out);
                let name = format!("{family}/{variant} chunk {chunk}{}", if exact { " exact" } else { "" });
                let moe = model.cfg.moe.is_some();
                if exact {
                    // f32 throughout: the golden's arithmetic up to summation order.
                    println!("{name:<34} {cmp}");
                    if cmp.max_rel_err() > 1e-4 || cmp.argmax_agreement() < 0.99 {
                        failures.push(format!("{name}: {cmp} (bound 1e-4, argmax >= 99%)"));
                    }
                } else if chunk < 32 || moe {
                    // 8-bit activations (steps of fewer than 32 rows; and in prompts the experts'
                    // groups of fewer than 32 rows): the CPU's default path's bounds (ts-model's
                    // tests/fixtures.rs), with the same reasons: the median row within 6e-2
                    // (the 8-layer hybrids: 1.25x llama.cpp's own figure on their Q8_0 files),
                    // argmax on decisive rows for the dense families' F32 and Q8_0.
                    let median = cmp.median_rel_err();
                    let decisive = golden.argmax_agreement_where_gap_exceeds(&cmp, 2.0 * median);
                    println!("{name:<34} {cmp}, median {median:.2e}, decisive argmax {:.1}%", 100.0 * decisive);
                    let bound = eight_bit_bound(family, variant);
                    let needs_argmax = (variant == "f32" || variant == "q8_0") && !moe;
                    if median > bound || (needs_argmax && decisive < 0.99) {
                        failures.push(format!(
                            "{name}: median {median:.2e} (bound {bound:.1e}), decisive argmax {decisive:.3}"
                        ));
                    }
                } else {
                    // The dense families' prompts on the tensor cores, f16-rounded operands
                    // (2^-11 relative): the median row within 1e-2, argmax on the rows with a
                    // clear top-2 gap.
                    let median = cmp.median_rel_err();
                    let decisive = golden.argmax_agreement_where_gap_exceeds(&cmp, 2.0 * median);
                    println!("{name:<34} {cmp}, median {median:.2e}, decisive argmax {:.1}%", 100.0 * decisive);
                    if median > 1e-2 || decisive < 0.99 {
                        failures
                            .push(format!("{name}: median {median:.2e} (bound 1.0e-2), decisive argmax {decisive:.3}"));
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "no fixtures in {}", fixtures_dir().display());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!("{checked} fixture runs on the GPU within bounds");
}

/// Logits of every row of `steps` (rows of `n_seqs` sequences), f32 activations.
fn run_steps<B: Backend>(model: &Model<B>, steps: &[Vec<Row>], n_seqs: usize) -> Vec<Vec<f32>> {
    let mut seqs: Vec<_> = (0..n_seqs).map(|_| model.new_sequence(256, 256).unwrap()).collect();
    let mut scratch = model.backend.scratch(true);
    let mut out = Vec::new();
    for rows in steps {
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        out.extend(model.forward(rows, &mut refs, &mut scratch).unwrap());
    }
    out
}

/// The chunked delta rule and the row-parallel convolution (runs of 16 rows
/// and more) against the CPU's f32 forward: a sequence of 150 rows in one step
/// (chunks of 64, 64 and 22) after 5 rows read one at a time (a state carried
/// in), and one step of three sequences of 100, 20 and 1 rows.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn chunked_delta_rule_matches_the_cpu() {
    drop(gpu());
    let rows = |seq: usize, tokens: &[u32], first: usize| -> Vec<Row> {
        tokens.iter().enumerate().map(|(i, &token)| Row { token, pos: first + i, seq, logits: true }).collect()
    };
    for family in ["qwen3_5_moe", "qwen3_next"] {
        let path = fixtures_dir().join(family).join("model-f32.gguf");
        let cpu = Model::open(&path, ExpertPlacement::Mapped).unwrap();
        let cuda = Model::open(&path, ExpertPlacement::Mapped).unwrap().into_backend(|m| Cuda::new(0, m)).unwrap();
        let n_vocab = cpu.cfg.n_vocab as u32;
        let tokens: Vec<u32> = (0..155u32).map(|i| (i * 37 + 11) % n_vocab).collect();
        let mut carried: Vec<Vec<Row>> = (0..5).map(|i| rows(0, &tokens[i..i + 1], i)).collect();
        carried.push(rows(0, &tokens[5..], 5));
        let mut batch = rows(0, &tokens[..100], 0);
        batch.extend(rows(1, &tokens[100..120], 0));
        batch.extend(rows(2, &tokens[120..121], 0));
        for (name, steps, n_seqs) in [("5 + 150 rows", carried, 1), ("100, 20 and 1 rows", vec![batch], 3)] {
            let want = run_steps(&cpu, &steps, n_seqs);
            let got = run_steps(&cuda, &steps, n_seqs);
            assert_eq!(got.len(), want.len());
            let worst = got.iter().zip(&want).map(|(g, w)| rel_err(g, w)).fold(0f32, f32::max);
            println!("{family} {name}: max |Δ|/max|cpu| over {} rows {worst:.2e}", got.len());
            assert!(worst < 1e-4, "{family} {name}: {worst:e}");
        }
    }
}

/// Logits of the golden tokens, one at a time then in one chunk of 64.
fn run_tokens<B: Backend>(model: &Model<B>, tokens: &[u32]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut decode = Vec::new();
    let mut seq = model.new_sequence(tokens.len(), 64).unwrap();
    let mut scratch = model.backend.scratch(false);
    for (pos, &t) in tokens.iter().enumerate() {
        let row = Row { token: t, pos, seq: 0, logits: true };
        decode.extend(model.forward(&[row], &mut [&mut seq], &mut scratch).unwrap());
    }
    let mut seq = model.new_sequence(tokens.len(), 64).unwrap();
    let rows: Vec<Row> =
        tokens.iter().enumerate().map(|(pos, &t)| Row { token: t, pos, seq: 0, logits: true }).collect();
    let prefill = model.forward(&rows, &mut [&mut seq], &mut scratch).unwrap();
    (decode, prefill)
}

/// A VRAM cache far smaller than the experts (misses every few tokens), over
/// pinned RAM and over the CPU's streamed store (disk -> RAM cache -> VRAM),
/// with and without prefetch: the same logits, bit for bit, as with every
/// expert on the device.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn expert_cache_gives_identical_logits() {
    drop(gpu()); // a clear failure first when there is no device
    for (family, variant) in [
        ("mixtral", "q8_0"),
        ("qwen2_moe", "q8_0"),
        ("qwen3_moe", "q4_k_m"),
        ("olmoe", "q4_k_m"),
        ("gpt_oss", "mxfp4"),
        ("qwen3_5_moe", "q8_0"),
        ("qwen3_next", "q8_0"),
        ("gemma4_moe", "q8_0"),
    ] {
        let dir = fixtures_dir().join(family);
        let path = dir.join(format!("model-{variant}.gguf"));
        let golden = Golden::read(&dir.join(format!("golden-{variant}.bin"))).unwrap();
        let open = |opts: Option<ts_cuda::CudaOptions>, host: ExpertPlacement| {
            Model::open(&path, host)
                .unwrap()
                .into_backend(|m| match &opts {
                    None => Cuda::new(0, m),
                    Some(o) => Cuda::with_options(0, m, o),
                })
                .unwrap()
        };
        let resident = open(None, ExpertPlacement::Mapped);
        let (want_decode, want_prefill) = run_tokens(&resident, &golden.tokens);
        let moe = resident.cfg.moe.clone().unwrap();
        // Slots fit each projection's largest (Q4_K_M mixes types between layers).
        let moe_layers: Vec<&ts_model::tensors::MoeWeights> = resident
            .weights
            .layers
            .iter()
            .filter_map(|l| match &l.ffn {
                ts_model::tensors::Ffn::Moe(m) => Some(m),
                _ => None,
            })
            .collect();
        let expert_bytes: usize = (0..3)
            .map(|p| {
                let t = |m: &ts_model::tensors::MoeWeights| {
                    let t = [&m.gate_exps, &m.up_exps, &m.down_exps][p];
                    t.row_bytes() * t.n_rows()
                };
                moe_layers.iter().map(|m| t(m)).max().unwrap().div_ceil(256) * 256
            })
            .sum();
        let n_moe_layers = moe_layers.len();
        drop(resident);
        for (pinned_host, prefetch) in [(true, false), (true, true), (false, false), (false, true)] {
            // Prefetch gets room for a guessed layer beside the current one. A deep model (the
            // 8-layer hybrids) cycles through more experts per token than that over its layers,
            // which no policy can keep: it gets room for one token's experts and a few more.
            let n_slots = if prefetch { 2 * moe.n_expert_used + 1 } else { moe.n_expert_used + 1 };
            let n_slots = if n_moe_layers > 2 { n_moe_layers * moe.n_expert_used + 4 } else { n_slots };
            let opts = ts_cuda::CudaOptions {
                expert_cache: Some((n_slots * expert_bytes) as u64),
                pinned_host,
                ..Default::default()
            };
            // Without the pinned copy the VRAM cache sits over the CPU's streamed store: a
            // RAM cache of its own (a few slots) filled from disk.
            let host = if pinned_host {
                ExpertPlacement::Mapped
            } else {
                // Its slots round each projection up to 4096-byte reads: tiny experts take more.
                ExpertPlacement::Stream(ts_model::StreamOptions {
                    cache_bytes: (3 * moe.n_expert_used * expert_bytes.max(6 * 4096)) as u64,
                    ..Default::default()
                })
            };
            let mut tiered = open(Some(opts), host);
            tiered.prefetch_experts = prefetch;
            let (decode, prefill) = run_tokens(&tiered, &golden.tokens);
            let st = tiered.backend.expert_stats().unwrap().total();
            println!(
                "{family}/{variant} pinned {pinned_host} prefetch {prefetch}: {n_slots} slots, hits {} misses {} \
                 ({:.1}% hit), prefetched {}, {:.1} MiB copied",
                st.hits,
                st.misses,
                100.0 * st.hit_rate(),
                st.prefetched,
                st.bytes_read as f64 / (1 << 20) as f64
            );
            assert!(decode == want_decode, "{family}: decode logits differ with the expert cache");
            assert!(prefill == want_prefill, "{family}: prefill logits differ with the expert cache");
            assert!(st.misses > 0 && st.hits > 0, "{family}: the cache was not exercised");
            assert_eq!(st.prefetched > 0, prefetch, "{family}: prefetch {prefetch} but {} prefetched", st.prefetched);
        }
    }
}

/// Decode steps' cache misses computed on the host's CPU (`MissPath::Cpu`) beside the GPU's
/// cached experts, with and without prefetch, in f32 throughout and with 8-bit activations:
/// the logits within the bounds every fixture meets against transformers' on the GPU alone,
/// the CPU having computed some experts.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn cpu_computed_misses_match_transformers() {
    drop(gpu()); // a clear failure first when there is no device
    let mut failures = Vec::new();
    for f in ts_testkit::fixtures() {
        let (path, golden, family, variant) = (&f.model, &f.golden, &f.family, &f.variant);
        let cpu_model = Model::open(path, ExpertPlacement::Mapped).unwrap();
        let Some(moe) = cpu_model.cfg.moe.clone() else { continue };
        let slot_bytes: usize = cpu_model
            .weights
            .layers
            .iter()
            .filter_map(|l| match &l.ffn {
                ts_model::tensors::Ffn::Moe(m) => Some(
                    [&m.gate_exps, &m.up_exps, &m.down_exps].map(|t| (t.row_bytes() * t.n_rows()).div_ceil(256) * 256),
                ),
                _ => None,
            })
            .fold([0; 3], |a, b| [a[0].max(b[0]), a[1].max(b[1]), a[2].max(b[2])])
            .iter()
            .sum();
        drop(cpu_model);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        for prefetch in [false, true] {
            let opts = ts_cuda::CudaOptions {
                expert_cache: Some(((moe.n_expert_used + 1) * slot_bytes) as u64),
                misses: ts_cuda::tier::MissPath::Cpu { share: Some(0.5) },
                ..Default::default()
            };
            let mut model = Model::open(path, ExpertPlacement::Mapped)
                .unwrap()
                .into_backend(|m| Cuda::with_options(0, m, &opts))
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            model.prefetch_experts = prefetch;
            for exact in [true, false] {
                let mut seq = model.new_sequence(golden.tokens.len(), 1).unwrap();
                let mut scratch = model.backend.scratch(exact);
                let mut rows_out = Vec::new();
                for (pos, &t) in golden.tokens.iter().enumerate() {
                    let row = Row { token: t, pos, seq: 0, logits: true };
                    // As the engine runs a step: in its pool, through the backend's `run_step`
                    // (a team of spinning threads for the host's experts).
                    let step = || model.backend.run_step(1, || model.forward(&[row], &mut [&mut seq], &mut scratch));
                    rows_out.extend(pool.install(step).unwrap());
                }
                let cmp = golden.compare(&rows_out);
                let name = format!("{family}/{variant} prefetch {prefetch}{}", if exact { " exact" } else { "" });
                let median = cmp.median_rel_err();
                println!("{name:<40} {cmp}, median {median:.2e}");
                if exact && (cmp.max_rel_err() > 1e-4 || cmp.argmax_agreement() < 0.99) {
                    failures.push(format!("{name}: {cmp} (bound 1e-4, argmax >= 99%)"));
                }
                if !exact && median > eight_bit_bound(family, variant) {
                    failures.push(format!("{name}: median {median:.2e}"));
                }
            }
            let st = model.backend.expert_stats().unwrap().total();
            println!("  hits {} misses {} on the CPU {} prefetched {}", st.hits, st.misses, st.on_host, st.prefetched);
            // Misses are not copied in: only prefetches fill the cache.
            assert!(st.on_host > 0, "{family}/{variant}: no expert computed on the CPU");
            assert_eq!(st.hits > 0, prefetch, "{family}/{variant}: prefetch {prefetch} but {} hits", st.hits);
            assert_eq!(st.on_host, st.misses, "{family}/{variant}: decode misses are all the CPU's");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The pinned host copy's MXFP4 experts held in the CPU's packed layout
/// (`CudaOptions::packed_host`): prompts, whose every expert is copied into a slot and put back
/// into GGUF rows on the device, give the same logits bit for bit as the GGUF copy's; decode,
/// whose misses the CPU computes with its packed kernels, stays within the 8-bit bound against
/// transformers. Where this CPU lacks AVX-512 VNNI (whose 16-row panels the device unpacks) the
/// test fails by name.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn packed_host_copy_matches_the_gguf_copy() {
    drop(gpu()); // a clear failure first when there is no device
    assert!(
        ts_cpu::Isa::detect() == ts_cpu::Isa::Avx512 && ts_cpu::packs(GgmlType::MXFP4, 16),
        "this CPU does not pack MXFP4 in the 16-row panels the device unpacks (AVX-512 VNNI)"
    );
    let f = ts_testkit::fixtures().into_iter().find(|f| f.family == "gpt_oss" && f.variant == "mxfp4").unwrap();
    let cpu_model = Model::open(&f.model, ExpertPlacement::Mapped).unwrap();
    let moe = cpu_model.cfg.moe.clone().unwrap();
    let slot_bytes: usize = match &cpu_model.weights.layers[0].ffn {
        ts_model::tensors::Ffn::Moe(m) => [&m.gate_exps, &m.up_exps, &m.down_exps]
            .iter()
            .map(|t| (t.row_bytes() * t.n_rows()).div_ceil(256) * 256)
            .sum(),
        _ => unreachable!("gpt-oss layers are MoE"),
    };
    drop(cpu_model);
    let open = |packed_host: bool| {
        let opts = ts_cuda::CudaOptions {
            expert_cache: Some(((moe.n_expert_used + 1) * slot_bytes) as u64),
            misses: ts_cuda::tier::MissPath::Cpu { share: Some(0.5) },
            packed_host,
            ..Default::default()
        };
        let mut model = Model::open(&f.model, ExpertPlacement::Mapped)
            .unwrap()
            .into_backend(|m| Cuda::with_options(0, m, &opts))
            .unwrap();
        model.prefetch_experts = true;
        model
    };
    let (gguf, packed) = (open(false), open(true));
    let source = |m: &Model<Cuda>| m.backend.expert_stats().unwrap().source;
    assert!(source(&packed).contains("packed layout"), "the host copy was not packed: {}", source(&packed));
    assert!(!source(&gguf).contains("packed layout"));
    // A prompt of 64 rows: every expert through the copies, none on the CPU.
    let prompt = |m: &Model<Cuda>| {
        let mut seq = m.new_sequence(f.golden.tokens.len(), 64).unwrap();
        let rows: Vec<Row> =
            f.golden.tokens.iter().enumerate().map(|(pos, &t)| Row { token: t, pos, seq: 0, logits: true }).collect();
        m.forward(&rows, &mut [&mut seq], &mut m.backend.scratch(false)).unwrap()
    };
    assert!(prompt(&packed) == prompt(&gguf), "prompt logits differ with the host copy packed");
    // Decode as the engine runs a step (in its pool, through `run_step`): misses on the CPU.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
    let mut seq = packed.new_sequence(f.golden.tokens.len(), 1).unwrap();
    let mut scratch = packed.backend.scratch(false);
    let mut decode = Vec::new();
    for (pos, &t) in f.golden.tokens.iter().enumerate() {
        let row = Row { token: t, pos, seq: 0, logits: true };
        let step = || packed.backend.run_step(1, || packed.forward(&[row], &mut [&mut seq], &mut scratch));
        decode.extend(pool.install(step).unwrap());
    }
    let st = packed.backend.expert_stats().unwrap().total();
    assert!(st.on_host > 0 && st.bytes_read > 0, "no expert computed on the CPU or copied: {st:?}");
    let cmp = f.golden.compare(&decode);
    let median = cmp.median_rel_err();
    println!("gpt_oss/mxfp4, host copy packed: decode {cmp}, median {median:.2e}; on the CPU {}", st.on_host);
    assert!(median <= eight_bit_bound("gpt_oss", "mxfp4"), "decode: median {median:.2e}");
}

/// Most likely token and its margin over the second.
fn top2(logits: &[f32]) -> (u32, f32) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.select_nth_unstable_by(1, |&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let (a, b) = if logits[order[0]] >= logits[order[1]] { (order[0], order[1]) } else { (order[1], order[0]) };
    (a as u32, logits[a] - logits[b])
}

/// Greedy continuation of `prompt` for `n` tokens, with the CPU's top-2 margin at each step.
fn greedy<B: Backend>(
    engine: &ts_engine::session::Engine<B>,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<f32>, std::time::Duration) {
    let mut seq = engine.new_sequence(512).unwrap();
    let mut logits = engine.prefill(&mut seq, prompt, false).unwrap().pop().unwrap();
    let (mut toks, mut margins) = (Vec::new(), Vec::new());
    let t = std::time::Instant::now();
    for _ in 0..n {
        let (tok, margin) = top2(&logits);
        toks.push(tok);
        margins.push(margin);
        logits = engine.prefill(&mut seq, &[tok], false).unwrap().pop().unwrap();
    }
    (toks, margins, t.elapsed())
}

/// The three real models (tools/fetch-models.sh; on the GPU machine staged by
/// tools/gpu-stage.sh and found through TURBOSPARK_MODELS): the same 64 greedy
/// tokens on the GPU as on the CPU for the five prompts of
/// tests/data/llama-cpp/greedy.json, both in f32 activations (the CPU with
/// --exact-activations, the GPU without tensor-core prefill), so only
/// summation order differs: identical, or parting only where the CPU's top-2
/// margin is below 1e-3. Prints decode tok/s of both.
#[test]
#[ignore = "needs an NVIDIA GPU and the staged real models (run by tools/gpu-run.sh real)"]
fn real_models_greedy_same_as_cpu() {
    drop(gpu()); // a clear failure first when there is no device
    let path = ts_testkit::repo_root().join("tests/data/llama-cpp/greedy.json");
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut failures = Vec::new();
    let mut absent = std::collections::BTreeSet::new();
    let mut compared = 0;
    let mut current: Option<(String, ts_engine::session::Engine, ts_engine::session::Engine<Cuda>)> = None;
    for run in reference["runs"].as_array().unwrap() {
        let file = run["model"].as_str().unwrap();
        let path = ts_testkit::models_dir().join(file);
        // A lease may stage only some of the models: the others are counted and said.
        if !path.exists() {
            absent.insert(file);
            continue;
        }
        compared += 1;
        if current.as_ref().is_none_or(|(f, _, _)| f != file) {
            // The CPU side (f32 activations) is the slow half: every core.
            let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
            let opts = ts_engine::session::LoadOptions { threads, experts: ExpertPlacement::Mapped };
            let mut cpu = ts_engine::session::Engine::load(&path, &opts).unwrap();
            cpu.exact_activations = true;
            let mut gpu =
                ts_engine::session::Engine::load(&path, &opts).unwrap().into_backend(|m| Cuda::new(0, m)).unwrap();
            gpu.exact_activations = true;
            current = Some((file.to_string(), cpu, gpu));
        }
        let (_, cpu, gpu) = current.as_ref().unwrap();
        let prompt = cpu.tokenizer().unwrap().encode(run["prompt"].as_str().unwrap(), true, false).unwrap();
        let (want, margins, t_cpu) = greedy(cpu, &prompt, 64);
        let (got, _, t_gpu) = greedy(gpu, &prompt, 64);
        let parted = want.iter().zip(&got).position(|(a, b)| a != b);
        let line = format!(
            "{file:<42} {:<32} cpu {:6.1} tok/s, gpu {:6.1} tok/s, {}",
            run["prompt"].as_str().unwrap().chars().take(30).collect::<String>(),
            64.0 / t_cpu.as_secs_f64(),
            64.0 / t_gpu.as_secs_f64(),
            match parted {
                None => "identical".to_string(),
                Some(i) => format!("parts at step {i} (cpu margin {:.2e})", margins[i]),
            }
        );
        println!("{line}");
        if let Some(i) = parted
            && margins[i] >= 1e-3
        {
            failures.push(line);
        }
    }
    if !absent.is_empty() {
        println!("skipped, not staged (tools/gpu-stage.sh): {absent:?}");
    }
    assert!(compared > 0, "none of the models is staged in {}", ts_testkit::models_dir().display());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Guesses of the plain run's own tokens with every third one wrong (each checking step
/// keeps two and rejects the next, so the cache, and the hybrids' recurrent state, is
/// rolled back and run again).
struct ScriptedGuesses {
    truth: Vec<u32>,
    prompt_len: usize,
}

impl ts_engine::speculative::Drafter for ScriptedGuesses {
    fn draft(&mut self, context: &[u32], max: usize) -> Result<Vec<u32>, ts_engine::session::EngineError> {
        let right = &self.truth[(context.len() - self.prompt_len).min(self.truth.len())..];
        Ok(right.iter().take(max).enumerate().map(|(i, &t)| if i % 3 == 2 { t ^ 1 } else { t }).collect())
    }
}

/// Speculative decoding on the GPU: on every fixture family, greedy generation with guesses
/// (prompt lookup, and scripted guesses with rejections) gives the same tokens as without;
/// the checking steps are steps of several rows of one sequence. Where checks are recorded
/// (families without recurrent layers), `warm_up_steps` records them first: the scripted
/// run's checks then run no warm-up.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn speculation_keeps_greedy_output_on_the_gpu() {
    use ts_engine::sampler::SamplerConfig;
    use ts_engine::speculative::{Drafter, NgramDrafter, SpecOptions};
    drop(gpu()); // a clear failure first when there is no device
    let fixtures = ts_testkit::fixtures();
    let mut families: Vec<&str> = fixtures.iter().map(|f| f.family.as_str()).collect();
    families.dedup();
    let (mut failures, mut rejected) = (Vec::new(), 0);
    for family in families {
        let variants: Vec<_> = fixtures.iter().filter(|f| f.family == family).collect();
        let fx = variants.iter().find(|f| f.variant == "q8_0").unwrap_or(&variants[0]);
        let opts = ts_engine::session::LoadOptions { threads: 2, experts: ExpertPlacement::Mapped };
        let engine =
            ts_engine::session::Engine::load(&fx.model, &opts).unwrap().into_backend(|m| Cuda::new(0, m)).unwrap();
        let prompt = engine.tokenizer().unwrap().encode("one two three four, one two three four, one two", true, false);
        let prompt = prompt.unwrap();
        let spec_opts = SpecOptions { draft_max: 5, draft_min: 0, adapt: false };
        let run = |drafter: Option<&mut dyn Drafter>| {
            let mut seq = engine.new_sequence(256).unwrap();
            engine.forget_draft_length();
            let spec = drafter.map(|d| (d, &spec_opts));
            engine.generate(&mut seq, &prompt, 32, &SamplerConfig::greedy(), false, spec, |_| true).unwrap()
        };
        let recorded = engine.warm_up_steps(&mut engine.new_sequence(256).unwrap(), spec_opts.draft_max).unwrap();
        let (plain, _) = run(None);
        let (lookup, s1) = run(Some(&mut NgramDrafter::default()));
        let mut scripted = ScriptedGuesses { truth: plain.clone(), prompt_len: prompt.len() };
        let warm_before = engine.model.backend.warm_ups();
        let (guessed, s2) = run(Some(&mut scripted));
        let warm_ups = engine.model.backend.warm_ups() - warm_before;
        println!(
            "{family}/{}: prompt lookup {}/{} guesses kept in {} steps, scripted {}/{} in {}; {recorded} warm-ups \
             ahead, {warm_ups} in the scripted run",
            fx.variant, s1.accepted, s1.drafted, s1.spec_steps, s2.accepted, s2.drafted, s2.spec_steps
        );
        if !engine.model.is_recurrent() && (recorded == 0 || warm_ups > 0) {
            failures.push(format!("{family}: {recorded} warm-ups ahead, {warm_ups} in the scripted run"));
        }
        rejected += s2.drafted - s2.accepted;
        for (what, got) in [("prompt lookup", &lookup), ("scripted guesses", &guessed)] {
            if got != &plain {
                failures.push(format!("{family}/{}: {what} changed the greedy output", fx.variant));
            }
        }
        if plain.len() >= 3 && s2.drafted <= s2.accepted {
            failures.push(format!("{family}: no scripted guess was rejected"));
        }
    }
    assert!(rejected > 0, "no guess was rejected: the rollback did not run");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A draft model on the GPU (the llama fixture's q4_k_m guessing for its q8_0): one that
/// skipped 40 plain steps' tokens catches up on them in recorded steps of
/// `ModelDrafter::CATCH_UP_ROWS` rows and then guesses what a draft that read them one or two
/// at a time guesses (rows of recorded steps are computed as one-row steps are), with no
/// step run for the first time after the drafter was made; greedy output with its guesses is
/// the plain run's.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn a_draft_model_catches_up_in_recorded_steps_on_the_gpu() {
    use ts_engine::sampler::SamplerConfig;
    use ts_engine::session::Engine;
    use ts_engine::speculative::{Drafter, ModelDrafter, SpecOptions, catch_up_after_plain};
    drop(gpu()); // a clear failure first when there is no device
    let dir = fixtures_dir().join("llama");
    let opts = ts_engine::session::LoadOptions { threads: 2, experts: ExpertPlacement::Mapped };
    let target = Engine::load(dir.join("model-q8_0.gguf"), &opts).unwrap().into_backend(|m| Cuda::new(0, m)).unwrap();
    let draft = Engine::load(dir.join("model-q4_k_m.gguf"), &opts).unwrap().into_backend(|m| Cuda::new(0, m)).unwrap();
    let tok = target.tokenizer().unwrap();
    let prompt = tok.encode("one two three four, one two three four, one two", true, false).unwrap();
    let greedy = SamplerConfig::greedy();
    let mut seq = target.new_sequence(256).unwrap();
    let (plain, _) = target.generate(&mut seq, &prompt, 48, &greedy, false, None, |_| true).unwrap();
    assert!(plain.len() >= 41, "{} tokens", plain.len());
    let context: Vec<u32> = prompt.iter().chain(&plain[..40]).copied().collect();

    let mut lapsed = ModelDrafter::new(&draft, tok, 256, 0.0).unwrap();
    lapsed.catch_up(&prompt).unwrap();
    let warm_before = draft.model.backend.warm_ups();
    catch_up_after_plain(&mut lapsed, &context, 4, true).unwrap();
    let caught_up = lapsed.draft(&context, 4).unwrap();
    let warm_ups = draft.model.backend.warm_ups() - warm_before;
    let mut stepwise = ModelDrafter::new(&draft, tok, 256, 0.0).unwrap();
    stepwise.catch_up(&prompt).unwrap();
    for end in prompt.len() + 1..context.len() {
        stepwise.draft(&context[..end], 1).unwrap();
    }
    let one_by_one = stepwise.draft(&context, 4).unwrap();
    println!("caught up on 40 tokens: guesses {caught_up:?}, one at a time {one_by_one:?}, {warm_ups} warm-ups");
    assert_eq!(caught_up.len(), 4);
    assert_eq!(caught_up, one_by_one, "catching up in recorded steps changed the guesses");
    assert_eq!(warm_ups, 0, "the draft's catching up or guessing ran a step for the first time");

    let spec_opts = SpecOptions { draft_max: 4, draft_min: 0, adapt: false };
    target.forget_draft_length();
    let mut guesser = ModelDrafter::new(&draft, tok, 256, 0.0).unwrap();
    let mut seq = target.new_sequence(256).unwrap();
    let spec = Some((&mut guesser as &mut dyn Drafter, &spec_opts));
    let (guessed, _) = target.generate(&mut seq, &prompt, 48, &greedy, false, spec, |_| true).unwrap();
    assert_eq!(guessed, plain, "the draft model's guesses changed the greedy output");
}

/// The MTP head on the GPU (`--spec-mtp`): on the fixtures with a nextn layer (qwen3_5_moe,
/// qwen3_next; F32 and Q8_0), the head's logits for the trunk's hidden states equal the CPU's
/// (exact activations, within 1e-3 of each row's largest), and greedy generation with its
/// guesses gives the plain run's tokens, on the GPU and on the CPU alike.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn mtp_head_keeps_greedy_output_on_the_gpu() {
    use ts_engine::sampler::SamplerConfig;
    use ts_engine::speculative::{MtpDrafter, SpecOptions};
    use ts_model::Row;
    drop(gpu()); // a clear failure first when there is no device
    let opts = ts_engine::session::LoadOptions { threads: 2, experts: ExpertPlacement::Mapped };
    let mut checked = 0;
    for fx in ts_testkit::fixtures() {
        let mut cpu = ts_engine::session::Engine::load(&fx.model, &opts).unwrap();
        if cpu.model.weights.mtp.is_none() {
            continue;
        }
        checked += 1;
        cpu.exact_activations = true;
        let mut gpu =
            ts_engine::session::Engine::load(&fx.model, &opts).unwrap().into_backend(|m| Cuda::new(0, m)).unwrap();
        gpu.exact_activations = true;
        let prompt = cpu.tokenizer().unwrap().encode("one two three four, one two three four, one two", true, false);
        let prompt = prompt.unwrap();
        // The head over the CPU trunk's hidden states, one step on each backend.
        let n = prompt.len() - 1;
        let rows: Vec<Row> = (0..n).map(|p| Row { token: prompt[p + 1], pos: p, seq: 0, logits: true }).collect();
        let trunk: Vec<Row> = (0..n).map(|p| Row { token: prompt[p], pos: p, seq: 0, logits: false }).collect();
        let mut seq = cpu.new_sequence(64).unwrap();
        let (_, hidden) = cpu.model.forward_hidden(&trunk, &mut [&mut seq], &mut cpu.scratch()).unwrap();
        let mut cpu_mtp = cpu.model.new_mtp_sequence(64).unwrap();
        let want = cpu.model.mtp_forward(&rows, &hidden, &mut [&mut cpu_mtp], &mut cpu.scratch()).unwrap();
        let mut gpu_mtp = gpu.model.new_mtp_sequence(64).unwrap();
        let got = gpu.model.mtp_forward(&rows, &hidden, &mut [&mut gpu_mtp], &mut gpu.scratch()).unwrap();
        for (p, (a, b)) in got.logits.iter().zip(&want.logits).enumerate() {
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(d <= 1e-3 * scale, "{}/{} row {p}: MTP logits off by {d} of {scale}", fx.family, fx.variant);
        }
        // Greedy generation with and without the head's guesses.
        let spec_opts = SpecOptions { draft_max: 4, draft_min: 0, adapt: false };
        let mut outputs = Vec::new();
        for with_mtp in [false, true] {
            let mut seq = gpu.new_sequence(256).unwrap();
            gpu.forget_draft_length();
            let mut mtp = MtpDrafter::new(&gpu, 256).unwrap();
            let spec = with_mtp.then_some((&mut mtp as &mut dyn ts_engine::speculative::Drafter, &spec_opts));
            let (out, s) =
                gpu.generate(&mut seq, &prompt, 32, &SamplerConfig::greedy(), false, spec, |_| true).unwrap();
            println!(
                "{}/{} mtp {with_mtp}: {}/{} guesses kept in {} steps",
                fx.family, fx.variant, s.accepted, s.drafted, s.spec_steps
            );
            if with_mtp {
                assert!(s.spec_steps > 0, "{}/{}: the head guessed nothing", fx.family, fx.variant);
            }
            outputs.push(out);
        }
        assert_eq!(outputs[0], outputs[1], "{}/{}: the MTP head changed the greedy output", fx.family, fx.variant);
    }
    assert!(checked >= 2, "no fixture with an MTP layer");
}

/// Steps of consecutive rows of one sequence where only the last wants logits (a short
/// prompt, a draft model reading a check's tokens) run as padded steps computing every row's
/// logits, so that they are recorded: 3 rows a step (padded to 4), then a one-row step
/// between them, as a draft model alternates. Each step hands back the last row's logits
/// only, within 1e-3 of the sequence run one row at a time, and replays happen.
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn last_row_pieces_are_recorded() {
    drop(gpu()); // a clear failure first when there is no device
    let mut failures = Vec::new();
    for (family, variant) in [("llama", "q4_k_m"), ("qwen3_moe", "q4_k_m")] {
        let dir = fixtures_dir().join(family);
        let path = dir.join(format!("model-{variant}.gguf"));
        let golden = Golden::read(&dir.join(format!("golden-{variant}.bin"))).unwrap();
        let model = Model::open(&path, ExpertPlacement::Mapped).unwrap().into_backend(|m| Cuda::new(0, m)).unwrap();
        let tokens: Vec<u32> = (0..24).map(|i| golden.tokens[i % golden.tokens.len()]).collect();
        let mut scratch = model.backend.scratch(false);
        let mut alone = Vec::new();
        let mut seq = model.new_sequence(64, 1).unwrap();
        for (pos, &token) in tokens.iter().enumerate() {
            let row = Row { token, pos, seq: 0, logits: true };
            alone.extend(model.forward(&[row], &mut [&mut seq], &mut scratch).unwrap());
        }
        let before = model.backend.graph_replays();
        let warm_before = model.backend.warm_ups();
        let mut seq = model.new_sequence(64, 4).unwrap();
        let (mut pos, mut worst) = (0, 0f32);
        while pos < tokens.len() {
            let take = if (pos / 4) % 2 == 0 { 3 } else { 1 };
            let rows: Vec<Row> = (pos..pos + take)
                .map(|p| Row { token: tokens[p], pos: p, seq: 0, logits: p == pos + take - 1 })
                .collect();
            let out = model.forward(&rows, &mut [&mut seq], &mut scratch).unwrap();
            if out.len() != 1 {
                failures.push(format!("{family}: {} rows of logits for one asked", out.len()));
                break;
            }
            let e = rel_err(&out[0], &alone[pos + take - 1]);
            worst = if e.is_nan() { f32::NAN } else { worst.max(e) };
            pos += take;
        }
        let replays = model.backend.graph_replays() - before;
        // The one-row step was recorded above; the three-row pieces' kind (four rows, every
        // one's logits) runs measured once, then recorded: two warm-ups, then replays.
        let warm_ups = model.backend.warm_ups() - warm_before;
        println!(
            "{family}/{variant}: pieces of 3 and 1 rows, last row's logits: {replays} replayed, {warm_ups} warm-ups, {worst:.2e}"
        );
        if worst.is_nan() || worst > 1e-3 || replays < 8 || warm_ups != 2 {
            failures.push(format!("{family}/{variant}: {replays} replays, {warm_ups} warm-ups, {worst:e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Steps of several rows recorded as graphs: the first step of a kind runs directly, the
/// second is recorded, later ones replay it. Several sequences stepped together, one row each
/// (batched decode: 4 rows take the per-pair expert matvecs, 12 the chunked ones), and rows of
/// one sequence (a draft's verification: 4 at a time), in caches of 1100 slots (decode
/// attention split in three). Each step's logits equal, bit for bit, the same steps run with
/// graphs off, and are within 1e-3 of each sequence stepped one row at a time; replays must
/// have happened (except where the experts take the host grouping: Q8_0 experts at 12 rows).
#[test]
#[ignore = "needs an NVIDIA GPU (run by tools/gpu-run.sh)"]
fn recorded_multi_row_steps_match() {
    drop(gpu()); // a clear failure first when there is no device
    let mut failures = Vec::new();
    let n_ctx = 1100;
    for (family, variant) in
        [("llama", "q4_k_m"), ("qwen3_moe", "q4_k_m"), ("gpt_oss", "mxfp4"), ("qwen3_5_moe", "q8_0")]
    {
        let dir = fixtures_dir().join(family);
        let path = dir.join(format!("model-{variant}.gguf"));
        let golden = Golden::read(&dir.join(format!("golden-{variant}.bin"))).unwrap();
        let mut model = Model::open(&path, ExpertPlacement::Mapped).unwrap().into_backend(|m| Cuda::new(0, m)).unwrap();
        let tokens = &golden.tokens;
        let n_steps = 6;
        // (sequences, rows per sequence and step)
        for (n_seq, per) in [(4, 1), (12, 1), (1, 4)] {
            // Sequence s reads the golden tokens from 7 s on.
            let token = |s: usize, pos: usize| tokens[(7 * s + pos) % tokens.len()];
            // Each step's rows: `per` consecutive positions of every sequence.
            let step_rows = |step: usize| -> Vec<Row> {
                (0..n_seq)
                    .flat_map(|s| (0..per).map(move |j| (s, step * per + j)))
                    .map(|(s, pos)| Row { token: token(s, pos), pos, seq: s, logits: true })
                    .collect()
            };
            let batched = |graphs: bool, model: &mut Model<Cuda>| {
                model.backend.use_graphs = graphs;
                let mut scratch = model.backend.scratch(false);
                let mut seqs: Vec<_> = (0..n_seq).map(|_| model.new_sequence(n_ctx, per).unwrap()).collect();
                let before = model.backend.graph_replays();
                let mut out = Vec::new();
                for step in 0..n_steps {
                    let mut refs: Vec<_> = seqs.iter_mut().collect();
                    out.push(model.forward(&step_rows(step), &mut refs, &mut scratch).unwrap());
                }
                (out, model.backend.graph_replays() - before)
            };
            let (direct, _) = batched(false, &mut model);
            let (recorded, replays) = batched(true, &mut model);
            // Every sequence alone, one row at a time (graphs on: the one-row recordings).
            let mut alone = vec![Vec::new(); n_seq];
            let mut scratch = model.backend.scratch(false);
            for (s, out) in alone.iter_mut().enumerate() {
                let mut seq = model.new_sequence(n_ctx, 1).unwrap();
                for pos in 0..n_steps * per {
                    let row = Row { token: token(s, pos), pos, seq: 0, logits: true };
                    out.extend(model.forward(&[row], &mut [&mut seq], &mut scratch).unwrap());
                }
            }
            let (mut worst, mut differ) = (0f32, 0);
            for (step, (rec, dir)) in recorded.iter().zip(&direct).enumerate() {
                assert_eq!(rec.len(), n_seq * per, "{family}: rows of logits");
                differ += rec.iter().zip(dir).filter(|(a, b)| a != b).count();
                for (i, row) in rec.iter().enumerate() {
                    let (s, j) = (i / per, i % per);
                    let e = rel_err(row, &alone[s][step * per + j]);
                    worst = if e.is_nan() { f32::NAN } else { worst.max(e) };
                }
            }
            println!(
                "{family}/{variant} {n_seq} x {per} rows x {n_steps} steps: {replays} replayed, \
                 {differ} rows differ from direct, {worst:.2e} from one row at a time"
            );
            // The same 8-bit activations; 12 rows take the chunked expert kernels and the
            // dense matvecs two rows at a time (summation order). An 8-bit copy made after a
            // sum in another order can round one step apart; the 8-layer hybrid's Q8_0 file
            // carries that through its layers as far as 8-bit activations alone move it from
            // the reference ([`eight_bit_bound`]).
            let bound = if family == "qwen3_5_moe" { eight_bit_bound(family, variant) } else { 1e-3 };
            if worst.is_nan() || worst > bound || differ > 0 || replays == 0 {
                failures
                    .push(format!("{family}/{variant} {n_seq} x {per}: {replays} replays, {differ} differ, {worst:e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
