//! matmul against ts-quant's scalar reference and against exact dot products of the
//! dequantized rows, for every type, several shapes and every available instruction set.

mod common;

use common::{Aligned, Rng, TYPES, dequantized, exact_dot, magnitude, tolerance, weights};
use ts_cpu::{CpuError, GgmlType, Isa, QuantizedRows, activation_type, matmul, matmul_strided, matmul_with_isa};

/// Values of `k` for a type: one block, a few blocks, and real models' widths that fit.
fn ks(ty: GgmlType) -> Vec<usize> {
    let block = (ty.block_size() as usize).max(32);
    let mut ks = vec![block, 3 * block];
    ks.extend([896, 4864, 2048].into_iter().filter(|k| k % block == 0));
    if !ty.is_quantized() {
        ks.push(37); // float rows of any length
    }
    ks
}

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.is_available()).collect()
}

fn run(isa: Isa, ty: GgmlType, w: &[u8], n_out: usize, k: usize, x: &QuantizedRows) -> Vec<f32> {
    let mut out = vec![f32::NAN; x.m() * n_out];
    matmul_with_isa(isa, ty, w, n_out, k, x, &mut out, n_out).unwrap_or_else(|e| panic!("{ty} {isa}: {e}"));
    out
}

/// A product to check: weights, their shape, and the activations before and after quantization.
struct Case<'a> {
    ty: GgmlType,
    w: &'a [u8],
    n_out: usize,
    k: usize,
    xf: &'a [f32],
    x: &'a QuantizedRows,
}

/// Checks `got` (m x n_out) against ts-quant's `vec_dot` and against the exact dot product.
fn check(case: &Case, got: &[f32], what: &str) {
    let Case { ty, w, n_out, k, xf, x } = *case;
    let m = x.m();
    let act_ty = x.ty();
    let row_bytes = w.len() / n_out;
    let w_rows: Vec<Vec<f32>> =
        (0..n_out).map(|j| dequantized(ty, &w[j * row_bytes..(j + 1) * row_bytes], k)).collect();
    for i in 0..m {
        let a =
            if act_ty == GgmlType::F32 { xf[i * k..(i + 1) * k].to_vec() } else { dequantized(act_ty, x.row(i), k) };
        for (j, wf) in w_rows.iter().enumerate() {
            let got = got[i * n_out + j];
            let mut tol = tolerance(ty, wf, &a);
            if ty.is_quantized() {
                let w_row = Aligned::new(&w[j * row_bytes..(j + 1) * row_bytes], 0);
                let reference = ts_quant::vec_dot(ty, w_row.bytes(), x.row(i)).unwrap();
                assert!(
                    (got as f64 - reference as f64).abs() <= 2.0 * tol,
                    "{what}: ({i}, {j}) = {got} but vec_dot gives {reference}, tolerance {:e}",
                    2.0 * tol
                );
            }
            if act_ty == GgmlType::Q8_1 {
                // `s` is stored as f16 (see ts-quant's property tests).
                tol += 2f64.powi(-10) * magnitude(ty, wf, &a);
            }
            let exact = exact_dot(wf, &a);
            assert!(
                (got as f64 - exact).abs() <= tol,
                "{what}: ({i}, {j}) = {got} but exactly {exact}, difference {:e} > {tol:e}",
                (got as f64 - exact).abs()
            );
        }
    }
}

#[test]
fn every_type_and_shape_matches_the_references() {
    for ty in TYPES {
        let mut rng = Rng::new(ty.id() as u64);
        for k in ks(ty) {
            // Batches of 5-7 leave the panel kernels' last 1-3 activation rows to narrower passes.
            for (n_out, m) in [(1, 1), (7, 1), (13, 2), (5, 5), (9, 6), (11, 7), (3, 16), (21, 64)] {
                let has_min =
                    matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::Q5_K);
                // Arbitrary blocks only for formats without mins (see `tolerance`).
                let random = !has_min && n_out % 2 == 1 && m < 64;
                if m == 64 && k > 2048 {
                    continue;
                }
                let w = weights(&mut rng, ty, n_out, k, random);
                let xf = common::rows(&mut rng, m * k);
                let mut x = QuantizedRows::new();
                x.quantize(ty, &xf, k).unwrap();
                for isa in isas() {
                    let got = run(isa, ty, &w, n_out, k, &x);
                    let what = format!("{ty} {isa} k={k} n_out={n_out} m={m} random={random}");
                    check(&Case { ty, w: &w, n_out, k, xf: &xf, x: &x }, &got, &what);
                }
            }
        }
    }
}

#[test]
fn instruction_sets_agree() {
    let isas = isas();
    for ty in TYPES {
        let mut rng = Rng::new(100 + ty.id() as u64);
        let k = if ty.block_size() == 256 { 2048 } else { 896 };
        for m in [1, 3, 8, 33] {
            let n_out = 19;
            let w = weights(&mut rng, ty, n_out, k, false);
            let xf = common::rows(&mut rng, m * k);
            let mut x = QuantizedRows::new();
            x.quantize(ty, &xf, k).unwrap();
            let results: Vec<Vec<f32>> = isas.iter().map(|&isa| run(isa, ty, &w, n_out, k, &x)).collect();
            let w_rows: Vec<Vec<f32>> =
                (0..n_out).map(|j| dequantized(ty, &w[j * w.len() / n_out..][..w.len() / n_out], k)).collect();
            for i in 0..m {
                let a = if x.ty() == GgmlType::F32 {
                    xf[i * k..(i + 1) * k].to_vec()
                } else {
                    dequantized(x.ty(), x.row(i), k)
                };
                for (j, wf) in w_rows.iter().enumerate() {
                    let tol = 2.0 * tolerance(ty, wf, &a);
                    for (isa, r) in isas.iter().zip(&results).skip(1) {
                        let (a, b) = (results[0][i * n_out + j], r[i * n_out + j]);
                        assert!((a - b).abs() as f64 <= tol, "{ty} m={m}: {} gives {a}, {isa} {b}", isas[0]);
                    }
                }
            }
        }
    }
}

#[test]
fn thread_count_does_not_change_results() {
    for ty in TYPES {
        let mut rng = Rng::new(200 + ty.id() as u64);
        let k = if ty.block_size() == 256 { 1024 } else { 896 };
        let n_out = 301;
        let w = weights(&mut rng, ty, n_out, k, false);
        for m in [1, 2, 9, 16] {
            let xf = common::rows(&mut rng, m * k);
            let results: Vec<Vec<f32>> = [1, 2, 3]
                .into_iter()
                .map(|threads| {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    pool.install(|| {
                        let mut x = QuantizedRows::new();
                        x.quantize(ty, &xf, k).unwrap();
                        let mut out = vec![0.0; m * n_out];
                        matmul(ty, &w, n_out, k, &x, &mut out).unwrap();
                        out
                    })
                })
                .collect();
            assert!(
                results.iter().all(|r| r.iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits())),
                "{ty} m={m}"
            );
        }
    }
}

#[test]
fn strided_output_and_unaligned_weights() {
    for ty in TYPES {
        let mut rng = Rng::new(300 + ty.id() as u64);
        let k = (ty.block_size() as usize).max(32) * 2;
        let (n_out, m, stride) = (11, 6, 29);
        let w = weights(&mut rng, ty, n_out, k, false);
        let xf = common::rows(&mut rng, m * k);
        let mut x = QuantizedRows::new();
        x.quantize(ty, &xf, k).unwrap();
        let mut dense = vec![0.0; m * n_out];
        matmul(ty, &w, n_out, k, &x, &mut dense).unwrap();
        for offset in [1, 3] {
            // Like one expert's slice of a stacked tensor, at an odd address.
            let shifted = Aligned::new(&w, offset);
            for isa in isas() {
                let mut out = vec![-7.0f32; (m - 1) * stride + n_out];
                matmul_with_isa(isa, ty, shifted.bytes(), n_out, k, &x, &mut out, stride).unwrap();
                for i in 0..m {
                    let row = &out[i * stride..];
                    for j in 0..n_out {
                        let want = dense[i * n_out + j];
                        assert!(
                            (row[j] - want).abs() <= 1e-3 * want.abs().max(1.0),
                            "{ty} {isa}: {} vs {want}",
                            row[j]
                        );
                    }
                    if i + 1 < m {
                        assert!(row[n_out..stride].iter().all(|&v| v == -7.0), "{ty} {isa}: gap written");
                    }
                }
            }
        }
    }
}

/// `matmul_rows_alone` gives every row of quantized weights the bits a one-row call gives it
/// (speculative decoding's checking steps rely on it), at batch sizes of each direct tile
/// shape. Float weights do not yet: their batch kernel sums in another order.
#[test]
fn rows_alone_match_one_row_calls_bit_for_bit() {
    for ty in TYPES.into_iter().filter(|t| t.is_quantized()) {
        let mut rng = Rng::new(500 + ty.id() as u64);
        let k = (ty.block_size() as usize).max(32) * 9;
        let n_out = 11;
        let w = weights(&mut rng, ty, n_out, k, false);
        for m in [2, 3, 4, 7] {
            let xf = common::rows(&mut rng, m * k);
            let mut x = QuantizedRows::new();
            x.quantize(ty, &xf, k).unwrap();
            let mut batch = vec![0.0; m * n_out];
            ts_cpu::matmul_rows_alone(ty, &w, n_out, k, &x, &mut batch).unwrap();
            for i in 0..m {
                let mut one = QuantizedRows::new();
                one.gather(&x, &[i]).unwrap();
                let mut alone = vec![0.0; n_out];
                ts_cpu::matmul_rows_alone(ty, &w, n_out, k, &one, &mut alone).unwrap();
                let got = &batch[i * n_out..(i + 1) * n_out];
                assert!(
                    got.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty} m={m} row {i}: {got:?} vs {alone:?}"
                );
            }
        }
    }
}

/// A one-row product takes weight rows in pairs, quantized and float types alike; each row's
/// result must be the bits it gets multiplied alone (an odd row count leaves one row single,
/// and where a thread's share ends depends on the thread count).
#[test]
fn paired_weight_rows_match_rows_alone_bit_for_bit() {
    for ty in TYPES {
        let mut rng = Rng::new(700 + ty.id() as u64);
        let k = (ty.block_size() as usize).max(32) * 9;
        let n_out = 7;
        let w = weights(&mut rng, ty, n_out, k, false);
        let row_bytes = w.len() / n_out;
        let xf = common::rows(&mut rng, k);
        let mut x = QuantizedRows::new();
        x.quantize(ty, &xf, k).unwrap();
        for isa in isas() {
            let all = run(isa, ty, &w, n_out, k, &x);
            for r in 0..n_out {
                let alone = run(isa, ty, &w[r * row_bytes..(r + 1) * row_bytes], 1, k, &x);
                assert_eq!(all[r].to_bits(), alone[0].to_bits(), "{ty} {isa} row {r}: {} vs {}", all[r], alone[0]);
            }
        }
    }
}

#[test]
fn gathered_rows_multiply_like_the_batch_they_come_from() {
    for ty in TYPES {
        let mut rng = Rng::new(400 + ty.id() as u64);
        let k = (ty.block_size() as usize).max(32) * 3;
        let (n_out, m) = (9, 14);
        let w = weights(&mut rng, ty, n_out, k, false);
        let xf = common::rows(&mut rng, m * k);
        let mut x = QuantizedRows::new();
        x.quantize(ty, &xf, k).unwrap();
        let mut full = vec![0.0; m * n_out];
        matmul(ty, &w, n_out, k, &x, &mut full).unwrap();
        // Batches big enough for the panel kernels and small enough for the direct ones.
        for rows in [vec![13, 2, 2, 7, 0, 5, 11, 9, 4, 3, 1, 12, 6], vec![4, 1, 1, 5]] {
            let mut expert = QuantizedRows::new();
            expert.gather(&x, &rows).unwrap();
            assert_eq!((expert.ty(), expert.k(), expert.m()), (x.ty(), k, rows.len()));
            let mut out = vec![0.0; rows.len() * n_out];
            matmul(ty, &w, n_out, k, &expert, &mut out).unwrap();
            for (i, &r) in rows.iter().enumerate() {
                assert_eq!(expert.row(i), x.row(r), "{ty}");
                let got = &out[i * n_out..(i + 1) * n_out];
                let want = &full[r * n_out..(r + 1) * n_out];
                for (g, w) in got.iter().zip(want) {
                    assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{ty} row {r}: {g} vs {w}");
                }
            }
        }
    }
    let mut x = QuantizedRows::new();
    x.quantize(GgmlType::Q4_0, &[0.0; 64], 32).unwrap();
    let err = QuantizedRows::new().gather(&x, &[0, 2]).unwrap_err();
    assert_eq!(err.to_string(), "row 2 is out of range for 2 activation rows");
}

#[test]
fn errors_name_the_problem() {
    use GgmlType::*;
    let mut x = QuantizedRows::new();
    let xf = vec![0.5f32; 512];

    for ty in [IQ2_XXS, Q8_K, Q8_1, I8, NVFP4] {
        let err = x.quantize(ty, &xf, 256).unwrap_err();
        assert_eq!(err, CpuError::Unsupported(ty));
        assert_eq!(err.to_string(), format!("tensor type {} has no CPU matmul", ty.name()));
        assert_eq!(matmul(ty, &[], 0, 256, &x, &mut []).unwrap_err(), CpuError::Unsupported(ty));
    }
    assert_eq!(activation_type(Q5_1), Ok(Q8_1));
    assert_eq!(activation_type(BF16), Ok(F32));

    assert!(matches!(x.quantize(Q4_K, &xf, 128), Err(CpuError::PartialBlock { k: 128, block_size: 256, .. })));
    assert!(matches!(x.quantize(Q4_0, &xf, 0), Err(CpuError::PartialBlock { .. })));
    assert!(matches!(x.quantize(Q4_0, &xf[..100], 64), Err(CpuError::WrongLength { .. })));

    x.quantize(Q4_0, &xf, 256).unwrap();
    assert_eq!(x.m(), 2);
    let w = vec![0u8; 3 * 8 * 18];
    let mut out = vec![0.0f32; 6];
    matmul(Q4_0, &w, 3, 256, &x, &mut out).unwrap();
    // Q8_0 weights pair with the same activations; Q4_1 and Q4_K do not.
    matmul(Q8_0, &vec![0u8; 3 * 8 * 34], 3, 256, &x, &mut out).unwrap();
    let err = matmul(Q4_1, &vec![0u8; 3 * 8 * 20], 3, 256, &x, &mut out).unwrap_err();
    assert_eq!(
        err.to_string(),
        "activations were quantized as Q8_0 rows of 256, but Q4_1 weights with k = 256 need Q8_1"
    );
    assert!(matches!(matmul(Q4_0, &w, 3, 224, &x, &mut out), Err(CpuError::Activations { .. })));
    assert!(matches!(matmul(Q4_0, &w, 3, 250, &x, &mut out), Err(CpuError::PartialBlock { k: 250, .. })));
    let err = matmul(Q4_0, &w[1..], 3, 256, &x, &mut out).unwrap_err();
    assert_eq!(err.to_string(), "weights (bytes) holds 431, but 432 are needed");
    assert!(matches!(matmul(Q4_0, &w, 3, 256, &x, &mut out[..5]), Err(CpuError::WrongLength { .. })));
    assert_eq!(
        matmul_strided(Q4_0, &w, 3, 256, &x, &mut out, 2).unwrap_err(),
        CpuError::Stride { stride: 2, n_out: 3 }
    );
    let mut long = vec![0.0f32; 7];
    matmul_strided(Q4_0, &w, 3, 256, &x, &mut long, 4).unwrap();
    assert!(matches!(matmul_strided(Q4_0, &w, 3, 256, &x, &mut long[..6], 4), Err(CpuError::WrongLength { .. })));
    assert!(matches!(matmul(Q4_0, &w, usize::MAX / 2, 256, &x, &mut out), Err(CpuError::WrongLength { .. })));

    // Empty batches and empty outputs are fine.
    x.quantize(Q4_0, &[], 256).unwrap();
    assert_eq!(x.m(), 0);
    matmul(Q4_0, &w, 3, 256, &x, &mut []).unwrap();
    x.quantize(Q4_0, &xf, 256).unwrap();
    matmul(Q4_0, &[], 0, 256, &x, &mut []).unwrap();
}

#[test]
fn arbitrary_weight_bytes_never_panic() {
    let mut rng = Rng::new(9);
    for ty in TYPES {
        let k = (ty.block_size() as usize).max(32) * 2;
        let bytes: Vec<u8> = (0..ty.bytes_for(5 * k as u64).unwrap()).map(|_| rng.next_u64() as u8).collect();
        let xf = common::rows(&mut rng, 3 * k);
        let mut x = QuantizedRows::new();
        x.quantize(ty, &xf, k).unwrap();
        for isa in isas() {
            let mut out = vec![0.0; 15];
            matmul_with_isa(isa, ty, &bytes, 5, k, &x, &mut out, 5).unwrap();
        }
    }
}

/// Rows repacked in place (MXFP4, Q4_K, Q4_0, Q4_1, Q5_0 and Q8_0, and on AVX-512 VNNI Q6_K): the same
/// products as the GGUF rows, against both references (`check`) and bit for bit against the
/// batch (panel) kernel; every row as a one-row call computes it; shapes the packing does not
/// take are refused by name.
#[test]
fn packed_rows_match_the_gguf_rows() {
    let isa = Isa::detect();
    assert!(
        ts_cpu::packs(GgmlType::Q4_K, 16),
        "the packed layout needs AVX2 or AVX-512 VNNI: this machine has neither"
    );
    let mut rng = Rng::new(500);
    let shapes = [
        (GgmlType::MXFP4, 16, 32),
        (GgmlType::MXFP4, 48, 320),
        (GgmlType::MXFP4, 32, 2880),
        (GgmlType::Q4_K, 16, 256),
        (GgmlType::Q4_K, 48, 768),
        (GgmlType::Q4_K, 32, 2048),
        (GgmlType::Q6_K, 16, 256),
        (GgmlType::Q6_K, 48, 768),
        (GgmlType::Q6_K, 32, 2048),
        (GgmlType::Q5_0, 16, 32),
        (GgmlType::Q5_0, 64, 128),
        (GgmlType::Q8_0, 64, 128),
        (GgmlType::Q5_0, 48, 896),
        (GgmlType::Q5_0, 32, 4864),
        (GgmlType::Q8_0, 16, 32),
        (GgmlType::Q8_0, 48, 896),
        (GgmlType::Q8_0, 32, 4864),
        (GgmlType::Q4_0, 16, 32),
        (GgmlType::Q4_0, 48, 896),
        (GgmlType::Q4_0, 32, 4864),
        (GgmlType::Q4_1, 16, 32),
        (GgmlType::Q4_1, 64, 128),
        (GgmlType::Q4_1, 48, 576),
        (GgmlType::Q4_1, 32, 4864),
    ];
    for (ty, n_out, k) in shapes.into_iter().filter(|&(ty, n_out, _)| ts_cpu::packs(ty, n_out)) {
        let w = weights(&mut rng, ty, n_out, k, true);
        let mut packed = w.clone();
        assert!(ts_cpu::pack_rows(ty, &mut packed, n_out, k).unwrap());
        assert_ne!(packed, w, "packing changed nothing");
        for m in [1, 3, 4, 5, 8, 12, 16, 33, 40] {
            let xf = common::rows(&mut rng, m * k);
            let mut x = QuantizedRows::new();
            x.quantize(ty, &xf, k).unwrap();
            let mut got = vec![f32::NAN; m * n_out];
            ts_cpu::matmul_packed(ty, &packed, n_out, k, &x, &mut got, n_out).unwrap();
            check(
                &Case { ty, w: &w, n_out, k, xf: &xf, x: &x },
                &got,
                &format!("packed {ty} n_out={n_out} k={k} m={m}"),
            );
            if m >= 4 {
                let panel = run(isa, ty, &w, n_out, k, &x);
                assert!(
                    got.iter().zip(&panel).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty} n_out={n_out} k={k} m={m}"
                );
            }
            // Row by row, as one-row calls.
            for i in 0..m {
                let mut one = QuantizedRows::new();
                one.gather(&x, &[i]).unwrap();
                let mut row = vec![0.0; n_out];
                ts_cpu::matmul_packed(ty, &packed, n_out, k, &one, &mut row, n_out).unwrap();
                assert!(row.iter().zip(&got[i * n_out..]).all(|(a, b)| a.to_bits() == b.to_bits()), "row {i} of {m}");
            }
        }
    }
    // Rows that do not fill the last panel stay as they are, and are not read as packed.
    let (ty, n_out, k) = (GgmlType::MXFP4, 24, 64);
    let mut w = weights(&mut rng, ty, n_out, k, true);
    let before = w.clone();
    assert!(!ts_cpu::packs(ty, n_out));
    assert!(!ts_cpu::pack_rows(ty, &mut w, n_out, k).unwrap());
    assert_eq!(w, before);
    let mut x = QuantizedRows::new();
    x.quantize(ty, &common::rows(&mut rng, k), k).unwrap();
    let err = ts_cpu::matmul_packed(ty, &w, n_out, k, &x, &mut vec![0.0; n_out], n_out).unwrap_err();
    assert!(matches!(err, CpuError::NotPacked { .. }), "{err}");
    // Other types are not packed.
    assert!(!ts_cpu::packs(GgmlType::Q5_K, 64));
}

/// Single rows of a packed matrix read back in their GGUF blocks (`packed_row`: the 16-row
/// layouts of AVX-512 VNNI, the 8-row ones of AVX2; tools/test.sh skips this test by name, and
/// says so, on a CPU with neither); a row past the matrix and a type it does not read back are
/// refused by name.
#[test]
fn packed_rows_read_back_as_gguf_blocks() {
    assert!(
        ts_cpu::packs(GgmlType::Q8_0, 16),
        "the packed layouts need AVX2 or AVX-512 VNNI: this machine has neither"
    );
    let mut rng = Rng::new(501);
    let shapes = [
        (GgmlType::Q4_0, 32, 896),
        (GgmlType::Q4_1, 48, 576),
        (GgmlType::Q5_0, 48, 896),
        (GgmlType::Q8_0, 32, 4864),
        (GgmlType::MXFP4, 48, 320),
    ];
    for (ty, n_out, k) in shapes {
        let w = weights(&mut rng, ty, n_out, k, true);
        let mut packed = w.clone();
        assert!(ts_cpu::pack_rows(ty, &mut packed, n_out, k).unwrap());
        let row_bytes = w.len() / n_out;
        let mut row = Vec::new();
        for r in 0..n_out {
            ts_cpu::packed_row(ty, &packed, n_out, k, r, &mut row).unwrap();
            assert_eq!(row, w[r * row_bytes..(r + 1) * row_bytes], "{ty} row {r}");
        }
        let err = ts_cpu::packed_row(ty, &packed, n_out, k, n_out, &mut row).unwrap_err();
        assert!(matches!(err, CpuError::RowOutOfRange { .. }), "{err}");
    }
    let mut row = Vec::new();
    let q4k = weights(&mut rng, GgmlType::Q4_K, 16, 256, true);
    let err = ts_cpu::packed_row(GgmlType::Q4_K, &q4k, 16, 256, 0, &mut row).unwrap_err();
    assert!(matches!(err, CpuError::NotPacked { .. }), "{err}");
}

/// `matvecs` (several one-row products in one region) gives each product what its own
/// `matmul` (or `matmul_packed`) call gives, bit for bit, checked against the references too;
/// a product of several rows is refused.
#[test]
fn matvecs_match_one_matmul_per_product() {
    let mut rng = Rng::new(600);
    // (type, n_out, k, packed): the shapes of routed experts, with packed ones where this CPU packs.
    let shapes = [
        (GgmlType::Q4_K, 768, 2048, false),
        (GgmlType::Q4_K, 768, 2048, true),
        (GgmlType::Q6_K, 2048, 768, false),
        (GgmlType::MXFP4, 64, 2880, true),
        (GgmlType::Q8_0, 37 * 4, 256, false),
        (GgmlType::F16, 5, 64, false),
    ];
    let mut cases = Vec::new();
    for (ty, n_out, k, packed) in shapes {
        let packed = packed && ts_cpu::packs(ty, n_out);
        let w = weights(&mut rng, ty, n_out, k, true);
        let mut stored = w.clone();
        if packed {
            assert!(ts_cpu::pack_rows(ty, &mut stored, n_out, k).unwrap());
        }
        let xf = common::rows(&mut rng, k);
        let mut x = QuantizedRows::new();
        x.quantize(ty, &xf, k).unwrap();
        let mut alone = vec![f32::NAN; n_out];
        if packed {
            ts_cpu::matmul_packed(ty, &stored, n_out, k, &x, &mut alone, n_out).unwrap();
        } else {
            matmul(ty, &stored, n_out, k, &x, &mut alone).unwrap();
        }
        cases.push((ty, n_out, k, packed, w, stored, xf, x, alone));
    }
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let mut outs: Vec<Vec<f32>> = cases.iter().map(|c| vec![f32::NAN; c.1]).collect();
        let mut products: Vec<ts_cpu::Matvec<'_>> = cases
            .iter()
            .zip(outs.iter_mut())
            .map(|((ty, n_out, k, packed, _, stored, _, x, _), out)| ts_cpu::Matvec {
                weight_ty: *ty,
                w: stored,
                n_out: *n_out,
                k: *k,
                packed: *packed,
                x,
                out,
            })
            .collect();
        pool.install(|| ts_cpu::matvecs(&mut products)).unwrap();
        for ((ty, n_out, k, packed, w, _, xf, x, alone), got) in cases.iter().zip(&outs) {
            let what = format!("{ty} n_out={n_out} k={k} packed={packed} threads={threads}");
            assert!(got.iter().zip(alone).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: differs from matmul");
            check(&Case { ty: *ty, w, n_out: *n_out, k: *k, xf, x }, got, &what);
        }
    }
    let (ty, n_out, k) = (GgmlType::Q8_0, 8, 64);
    let w = weights(&mut rng, ty, n_out, k, true);
    let mut x = QuantizedRows::new();
    x.quantize(ty, &common::rows(&mut rng, 2 * k), k).unwrap();
    let mut out = vec![0.0; 2 * n_out];
    let mut products = [ts_cpu::Matvec { weight_ty: ty, w: &w, n_out, k, packed: false, x: &x, out: &mut out }];
    let err = ts_cpu::matvecs(&mut products).unwrap_err();
    assert!(matches!(err, CpuError::WrongLength { .. }), "{err}");
}

/// `gated_matvecs` gives each pair's hidden as `matvecs` and then the finishing function over
/// the whole row give it, bit for bit, and down's activations as quantizing that hidden at
/// once: 32-element blocks quantized run by run in the region (Q4_1 and MXFP4 downs), Q8_K's
/// after it (Q6_K); up of another type than gate; mismatched rows refused.
#[test]
fn gated_matvecs_match_matvecs_then_the_activation() {
    let mut rng = Rng::new(601);
    // (gate type, up type, down type, n_ff, k, packed): a dense FFN's and routed experts' shapes.
    let shapes = [
        (GgmlType::Q4_1, GgmlType::Q4_1, GgmlType::Q4_1, 1536, 576, true),
        (GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K, 768, 2048, true),
        (GgmlType::MXFP4, GgmlType::MXFP4, GgmlType::MXFP4, 2880, 2880, true),
        (GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q8_0, 37 * 32, 256, false),
    ];
    // Any function of a row's position and both outputs (rows finished in runs must not see
    // their neighbours).
    let finish = |pair: usize, start: usize, g: &mut [f32], u: &mut [f32]| {
        for (i, (g, u)) in g.iter_mut().zip(u.iter()).enumerate() {
            *g = *g * 0.5 - u * ((start + i) % 7) as f32 + pair as f32;
        }
    };
    struct Pair {
        tys: [GgmlType; 3],
        n_ff: usize,
        k: usize,
        packed: [bool; 2],
        stored: [Vec<u8>; 2],
        x: [QuantizedRows; 2],
        hidden: Vec<f32>,
        down_x: QuantizedRows,
    }
    impl Pair {
        /// Product `j` (0 gate, 1 up) over the pair's first `rows` rows (packed only whole).
        fn product<'a>(&'a self, j: usize, rows: usize, out: &'a mut [f32]) -> ts_cpu::Matvec<'a> {
            ts_cpu::Matvec {
                weight_ty: self.tys[j],
                w: &self.stored[j][..rows * self.stored[j].len() / self.n_ff],
                n_out: rows,
                k: self.k,
                packed: self.packed[j] && rows == self.n_ff,
                x: &self.x[j],
                out,
            }
        }
    }
    let mut pairs = Vec::new();
    for (pair, (gty, uty, dty, n_ff, k, packed)) in shapes.into_iter().enumerate() {
        let xf = common::rows(&mut rng, k);
        let (mut stored, mut x, mut outs, mut packs) = (Vec::new(), Vec::new(), Vec::new(), [false; 2]);
        for (j, ty) in [gty, uty].into_iter().enumerate() {
            let mut w = weights(&mut rng, ty, n_ff, k, true);
            packs[j] = packed && ts_cpu::packs(ty, n_ff);
            if packs[j] {
                assert!(ts_cpu::pack_rows(ty, &mut w, n_ff, k).unwrap());
            }
            let mut q = QuantizedRows::new();
            q.quantize(ty, &xf, k).unwrap();
            outs.push(vec![f32::NAN; n_ff]);
            stored.push(w);
            x.push(q);
        }
        let mut products: Vec<ts_cpu::Matvec<'_>> = (0..2)
            .zip(outs.iter_mut())
            .map(|(j, out)| ts_cpu::Matvec {
                weight_ty: [gty, uty][j],
                w: &stored[j],
                n_out: n_ff,
                k,
                packed: packs[j],
                x: &x[j],
                out,
            })
            .collect();
        ts_cpu::matvecs(&mut products).unwrap();
        let (mut g, mut u) = (outs.remove(0), outs.remove(0));
        // Pair 0 of the calls below is an empty one.
        finish(pair + 1, 0, &mut g, &mut u);
        let mut down_x = QuantizedRows::new();
        down_x.quantize(dty, &g, n_ff).unwrap();
        let [xg, xu]: [QuantizedRows; 2] = x.try_into().ok().unwrap();
        let [sg, su]: [Vec<u8>; 2] = stored.try_into().unwrap();
        pairs.push(Pair {
            tys: [gty, uty, dty],
            n_ff,
            k,
            packed: packs,
            stored: [sg, su],
            x: [xg, xu],
            hidden: g,
            down_x,
        });
    }
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let mut hidden: Vec<Vec<f32>> = pairs.iter().map(|p| vec![f32::NAN; p.n_ff]).collect();
        let mut ups: Vec<Vec<f32>> = pairs.iter().map(|p| vec![f32::NAN; p.n_ff]).collect();
        let mut down_x: Vec<QuantizedRows> = pairs.iter().map(|_| QuantizedRows::new()).collect();
        // A pair without rows first: nothing to run, and the others keep their places.
        let p0 = &pairs[0];
        let (mut no_h, mut no_u, mut no_q) = (Vec::new(), Vec::new(), QuantizedRows::new());
        let empty = ts_cpu::GatedMatvec {
            gate: p0.product(0, 0, &mut no_h),
            up: p0.product(1, 0, &mut no_u),
            down: Some((p0.tys[2], &mut no_q)),
        };
        let mut gated: Vec<ts_cpu::GatedMatvec<'_>> = std::iter::once(empty)
            .chain(pairs.iter().zip(hidden.iter_mut().zip(ups.iter_mut()).zip(down_x.iter_mut())).map(
                |(p, ((h, u), q))| ts_cpu::GatedMatvec {
                    gate: p.product(0, p.n_ff, h),
                    up: p.product(1, p.n_ff, u),
                    down: Some((p.tys[2], q)),
                },
            ))
            .collect();
        pool.install(|| ts_cpu::gated_matvecs(&mut gated, &finish)).unwrap();
        drop(gated);
        for ((p, h), q) in pairs.iter().zip(&hidden).zip(&down_x) {
            let what = format!("{:?} threads={threads}", p.tys);
            assert!(h.iter().zip(&p.hidden).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: hidden differs");
            assert_eq!((q.ty(), q.k(), q.m()), (p.down_x.ty(), p.down_x.k(), 1), "{what}");
            assert_eq!(q.row(0), p.down_x.row(0), "{what}: down's activations differ");
            // Their side data too: down's products from both are the same floats.
            let (n_out, dty) = (64, p.tys[2]);
            let w = weights(&mut rng, dty, n_out, p.n_ff, true);
            let (mut a, mut b) = (vec![0.0; n_out], vec![0.0; n_out]);
            matmul(dty, &w, n_out, p.n_ff, q, &mut a).unwrap();
            matmul(dty, &w, n_out, p.n_ff, &p.down_x, &mut b).unwrap();
            assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: down's products differ");
        }
    }
    // Up's rows must be gate's.
    let p = &pairs[0];
    let (mut h, mut u) = (vec![0.0; p.n_ff], vec![0.0; p.n_ff - 16]);
    let mut bad =
        [ts_cpu::GatedMatvec { gate: p.product(0, p.n_ff, &mut h), up: p.product(1, p.n_ff - 16, &mut u), down: None }];
    let err = ts_cpu::gated_matvecs(&mut bad, &finish).unwrap_err();
    assert!(matches!(err, CpuError::WrongLength { .. }), "{err}");
}
