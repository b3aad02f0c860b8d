//! Properties that need no external reference: round-trip error bounds, dot products against
//! dequantize-then-dot in f64, refusal of unsupported types, and errors for malformed input.

mod common;

use common::{
    AlignedBytes, Rng, TYPES, bulk_random_blocks, dequantized, dot_magnitude, dot_tolerance, exact_dot, weight_types,
};
use ts_quant::{GgmlType, QuantError, dequantize, quantize, vec_dot, vec_dot_type};

fn quantized(ty: GgmlType, x: &[f32]) -> AlignedBytes {
    let mut out = AlignedBytes::zeroed(ty.bytes_for(x.len() as u64).unwrap() as usize);
    quantize(ty, x, out.as_mut()).unwrap_or_else(|e| panic!("{ty}: {e}"));
    out
}

/// Test data: rows of Gaussian values whose scale and offset change every 512 elements.
/// Scales keep every format's block scale in f16's normal range, where its rounding is
/// relative; subnormal scales are covered bit for bit by the reference vectors.
fn gaussian_rows(rng: &mut Rng, n: usize) -> Vec<f32> {
    const SCALES: [f32; 4] = [1.0, 30.0, 0.25, 4.0];
    const OFFSETS: [f32; 3] = [0.0, 0.5, -2.0];
    (0..n).map(|i| rng.normal() * SCALES[i / 512 % 4] + OFFSETS[i / 1536 % 3] * SCALES[i / 512 % 4]).collect()
}

/// Round-trip bounds per block: largest error over the block's largest magnitude, and RMS error
/// over the block's RMS. Derived from the format where it is simple (`d` rounding to f16 adds
/// 2^-11 relative), otherwise the worst value seen on this data with a margin of about 1.2.
fn round_trip_bounds(ty: GgmlType) -> (f64, f64) {
    let f16_rounding = 2f64.powi(-11);
    use GgmlType::*;
    match ty {
        F32 => (0.0, 0.0),
        F16 => (f16_rounding, f16_rounding),
        BF16 => (2f64.powi(-8), 2f64.powi(-8)),
        // d = amax / 127, so |error| <= d / 2, plus 127 * d * (f16 rounding of d).
        Q8_0 | Q8_1 => (0.5 / 127.0 + f16_rounding, 0.011),
        // d is an f32: only the rounding to the nearest level.
        Q8_K => (0.5 / 127.0 + 1e-6, 0.011),
        // d = max / -8: levels cover [-8d, 7d], so the extreme of the other sign is off by d.
        Q4_0 => (1.0 / 8.0 + 8.0 * f16_rounding, 0.16),
        Q5_0 => (1.0 / 16.0 + 16.0 * f16_rounding, 0.085),
        // d = (max - min) / 15 <= 2 amax / 15; error <= d / 2 plus f16 rounding of d and min.
        Q4_1 => (1.0 / 15.0 + 0.02, 0.14),
        Q5_1 => (1.0 / 31.0 + 0.02, 0.065),
        // Largest gap between E2M1 values is 2 scale units, and values above 6 units clip.
        MXFP4 => (0.5, 0.23),
        Q2_K => (0.41, 0.41),
        Q3_K => (0.2, 0.21),
        Q4_K => (0.082, 0.095),
        Q5_K => (0.049, 0.051),
        Q6_K => (0.02, 0.025),
        other => panic!("no bounds for {other}"),
    }
}

#[test]
fn round_trip_error_is_bounded_for_every_quantizer() {
    for ty in TYPES {
        let mut rng = Rng::new(7);
        let n = 64 * 256;
        let x = gaussian_rows(&mut rng, n);
        let y = dequantized(ty, &quantized(ty, &x), n);
        let (max_bound, rms_bound) = round_trip_bounds(ty);
        let block = (ty.block_size() as usize).max(32);
        for (b, (xb, yb)) in x.chunks(block).zip(y.chunks(block)).enumerate() {
            let amax = xb.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
            let rms = (xb.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / block as f64).sqrt();
            let errors: Vec<f64> = xb.iter().zip(yb).map(|(&a, &b)| (a as f64 - b as f64).abs()).collect();
            let max_error = errors.iter().cloned().fold(0.0, f64::max);
            let rms_error = (errors.iter().map(|e| e * e).sum::<f64>() / block as f64).sqrt();
            assert!(max_error <= max_bound * amax, "{ty} block {b}: max error {max_error:e} > {max_bound} * {amax:e}");
            assert!(rms_error <= rms_bound * rms, "{ty} block {b}: rms error {rms_error:e} > {rms_bound} * {rms:e}");
        }
    }
}

#[test]
fn float_types_round_each_value_to_nearest() {
    let mut rng = Rng::new(3);
    let x: Vec<f32> = (0..4096).map(|i| rng.normal() * 10f32.powi(i % 9 - 4)).collect();
    for (ty, relative) in [(GgmlType::F16, 2f64.powi(-11)), (GgmlType::BF16, 2f64.powi(-8))] {
        let y = dequantized(ty, &quantized(ty, &x), x.len());
        for (&a, &b) in x.iter().zip(&y) {
            let bound = (a as f64).abs() * relative + if ty == GgmlType::F16 { 2f64.powi(-25) } else { 0.0 };
            assert!((a as f64 - b as f64).abs() <= bound, "{ty}: {a:e} came back as {b:e}");
        }
    }
    let y = dequantized(GgmlType::F32, &quantized(GgmlType::F32, &x), x.len());
    assert!(x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// The scalar dot products against the exact dot product of the dequantized rows.
///
/// Besides summation order, Q4_1 and Q5_1 differ by design: their offset term uses the
/// activations' `s = d * sum(q)` stored as f16, as llama.cpp does, which adds up to
/// 2^-11 * |m| * sum|a| per block; `|m|` is at most the block's largest weight magnitude for
/// quantized data, hence the extra 2^-10 * magnitude.
#[test]
fn vec_dot_matches_dequantized_f64_dot() {
    for ty in weight_types() {
        let act_ty = vec_dot_type(ty);
        let mut rng = Rng::new(11 + ty.id() as u64);
        let n = 1024;
        let mut rows: Vec<AlignedBytes> = (0..12).map(|_| quantized(ty, &gaussian_rows(&mut rng, n))).collect();
        let has_min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::Q5_K);
        if ty.is_quantized() && !has_min {
            // Arbitrary blocks too; with min offsets the tolerance above would not hold for them.
            for seed in 0..4 {
                rows.push(bulk_random_blocks(seed, ty, ty.bytes_for(n as u64).unwrap() as usize));
            }
        }
        let mut checked = 0;
        for (r, w) in rows.iter().enumerate() {
            let a = quantized(act_ty, &rng.normals(n, [1.0, 0.01, 50.0][r % 3], 0.0));
            let got = vec_dot(ty, w, &a).unwrap();
            let (wf, af) = (dequantized(ty, w, n), dequantized(act_ty, &a, n));
            if !wf.iter().all(|v| v.is_finite()) {
                continue; // random scales can overflow (MXFP4 exponents near 255)
            }
            checked += 1;
            let mut tolerance = dot_tolerance(ty, &wf, &af);
            if act_ty == GgmlType::Q8_1 {
                tolerance += 2f64.powi(-10) * dot_magnitude(ty, &wf, &af);
            }
            let exact = exact_dot(&wf, &af);
            assert!(
                (got as f64 - exact).abs() <= tolerance,
                "{ty} row {r}: {got} vs exact {exact}, diff {:e} > {tolerance:e}",
                (got as f64 - exact).abs()
            );
        }
        // Every quantized row, and at least one random row where there are some.
        let needed = if rows.len() > 12 { 13 } else { 12 };
        assert!(checked >= needed, "{ty}: only {checked} rows checked");
    }
}

#[test]
fn quantizers_are_deterministic_and_handle_special_inputs() {
    let specials = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX, f32::MIN_POSITIVE, 1e-40, -1e30];
    for ty in TYPES {
        let block = (ty.block_size() as usize).max(32);
        for (i, &special) in specials.iter().enumerate() {
            let mut rng = Rng::new(i as u64);
            let mut x = rng.normals(2 * 256, 1.0, 0.0);
            x[i * 37 % block] = special;
            x[256..].fill(special);
            let first = quantized(ty, &x);
            assert_eq!(*first, *quantized(ty, &x), "{ty}");
            let _ = dequantized(ty, &first, x.len());
        }
    }
}

#[test]
fn arbitrary_bytes_never_panic() {
    for ty in TYPES {
        let n = 4 * 256;
        let mut rng = Rng::new(5);
        let bytes: Vec<u8> = (0..ty.bytes_for(n as u64).unwrap()).map(|_| rng.next_u64() as u8).collect();
        let bytes = AlignedBytes::new(&bytes);
        let values = dequantized(ty, &bytes, n);
        assert_eq!(values.len(), n);
        if !matches!(ty, GgmlType::Q8_1 | GgmlType::Q8_K) {
            let act_ty = vec_dot_type(ty);
            let act: Vec<u8> = (0..act_ty.bytes_for(n as u64).unwrap()).map(|_| rng.next_u64() as u8).collect();
            vec_dot(ty, &bytes, &AlignedBytes::new(&act)).unwrap();
        }
    }
}

#[test]
fn unsupported_types_are_refused_by_name() {
    let unsupported: Vec<GgmlType> = GgmlType::all().filter(|t| !TYPES.contains(t)).collect();
    assert!(unsupported.contains(&GgmlType::IQ2_XXS) && unsupported.contains(&GgmlType::NVFP4));
    for ty in unsupported {
        let message = format!("tensor type {} is not supported", ty.name());
        let n = ty.block_size() as usize;
        let bytes = vec![0u8; ty.type_size() as usize];
        let err = dequantize(ty, &bytes, &mut vec![0.0; n]).unwrap_err();
        assert_eq!(err, QuantError::Unsupported(ty));
        assert_eq!(err.to_string(), message);
        assert_eq!(quantize(ty, &vec![0.0; n], &mut vec![0u8; bytes.len()]).unwrap_err().to_string(), message);
        assert_eq!(vec_dot(ty, &bytes, &bytes).unwrap_err().to_string(), message);
    }
    assert_eq!(
        dequantize(GgmlType::IQ2_XXS, &[], &mut []).unwrap_err().to_string(),
        "tensor type IQ2_XXS is not supported"
    );
    for ty in [GgmlType::Q8_1, GgmlType::Q8_K] {
        assert_eq!(
            vec_dot(ty, &[], &[]).unwrap_err().to_string(),
            format!("tensor type {ty} is an activation format and has no dot product as weights")
        );
    }
}

#[test]
fn malformed_lengths_are_errors() {
    use GgmlType::*;
    let buf = AlignedBytes::zeroed(4096);
    let mut out = vec![0.0f32; 1024];

    let err = dequantize(Q4_0, &buf[..18], &mut out[..33]).unwrap_err();
    assert_eq!(err, QuantError::PartialBlock { ty: Q4_0, len: 33, block_size: 32 });
    assert_eq!(err.to_string(), "33 elements is not a whole number of Q4_0 blocks of 32");

    let err = dequantize(Q4_0, &buf[..17], &mut out[..32]).unwrap_err();
    assert_eq!(err.to_string(), "source holds 17 bytes, but 32 elements of Q4_0 take 18");
    assert!(matches!(dequantize(F16, &buf[..3], &mut out[..2]), Err(QuantError::WrongLength { .. })));
    assert!(matches!(dequantize(F32, &buf[..8], &mut out[..3]), Err(QuantError::WrongLength { .. })));

    assert!(matches!(quantize(Q4_K, &out[..300], &mut [0u8; 144]), Err(QuantError::PartialBlock { .. })));
    let err = quantize(Q8_0, &out[..32], &mut [0u8; 33]).unwrap_err();
    assert_eq!(err.to_string(), "destination holds 33 bytes, but 32 elements of Q8_0 take 34");

    let err = vec_dot(Q4_0, &buf[..35], &buf[..34]).unwrap_err();
    assert_eq!(err.to_string(), "35 bytes is not a whole number of Q4_0 blocks of 18 bytes");
    let err = vec_dot(Q4_0, &buf[..36], &buf[..34]).unwrap_err();
    assert_eq!(err.to_string(), "activations holds 34 bytes, but 64 elements of Q8_0 take 68");
    assert!(matches!(vec_dot(Q4_K, &buf[..144], &buf[..144]), Err(QuantError::WrongLength { .. })));
    assert!(matches!(vec_dot(F16, &buf[..6], &buf[..4]), Err(QuantError::WrongLength { .. })));

    assert_eq!(dequantize(Q4_0, &[], &mut []), Ok(()));
    assert_eq!(vec_dot(Q6_K, &[], &[]), Ok(0.0));
}

#[test]
fn misaligned_blocks_are_errors() {
    use GgmlType::*;
    let buf = AlignedBytes::zeroed(1024);
    let mut out = vec![0.0f32; 256];
    let err = dequantize(Q4_K, &buf[1..145], &mut out).unwrap_err();
    assert_eq!(err, QuantError::Misaligned { ty: Q4_K, align: 2 });
    assert_eq!(err.to_string(), "Q4_K data must be aligned to 2 bytes to be viewed as blocks");
    let mut dst = AlignedBytes::zeroed(300);
    assert_eq!(quantize(Q8_K, &out, &mut dst.as_mut()[2..294]), Err(QuantError::Misaligned { ty: Q8_K, align: 4 }));
    // Byte-aligned blocks and the float types work at any offset.
    assert_eq!(dequantize(MXFP4, &buf[1..18], &mut out[..32]), Ok(()));
    assert_eq!(dequantize(F32, &buf[1..9], &mut out[..2]), Ok(()));
}
