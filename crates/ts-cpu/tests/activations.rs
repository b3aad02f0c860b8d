//! Activation quantization is bit-identical to what llama.cpp's CPU backend makes at run time
//! (vectors from tools/quant-vectors/activations.py): for Q8_K that is ts-quant's reference
//! quantizer; for Q8_0 and Q8_1 llama.cpp's runtime rounds half to even with id = 127/amax.

mod common;

use common::Rng;
use ts_cpu::{GgmlType, QuantizedRows};

fn reference(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let n = ty.bytes_for(x.len() as u64).unwrap() as usize;
    if ty != GgmlType::Q8_K {
        let mut out = vec![0u8; n];
        ts_cpu::quantize_q8_runtime(ty, x, &mut out);
        return out;
    }
    // Aligned storage for ts-quant's in-place block views.
    let mut buf = vec![0u32; n.div_ceil(4)];
    ts_quant::quantize(ty, x, &mut bytemuck::cast_slice_mut::<u32, u8>(&mut buf)[..n]).unwrap();
    bytemuck::cast_slice::<u32, u8>(&buf)[..n].to_vec()
}

#[test]
fn activations_are_bit_identical_to_llama_cpp_runtime() {
    let bytes = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/activations-llama-cpp.bin")).unwrap();
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let (mut at, mut checked) = (4, 0);
    for _ in 0..u32_at(0) {
        let (ty, k) = (GgmlType::from_id(u32_at(at)).unwrap(), u32_at(at + 4) as usize);
        at += 8;
        let x: Vec<f32> =
            bytes[at..at + 4 * k].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        at += 4 * k;
        let n = ty.bytes_for(k as u64).unwrap() as usize;
        let want = &bytes[at..at + n];
        at += n;
        // A weight type that pairs with this activation type.
        let weight_ty = match ty {
            GgmlType::Q8_0 => GgmlType::Q4_0,
            GgmlType::Q8_1 => GgmlType::Q4_1,
            _ => GgmlType::Q4_K,
        };
        let mut q = QuantizedRows::new();
        q.quantize(weight_ty, &x, k).unwrap();
        assert_eq!(q.row(0), want, "{ty} k={k}");
        assert_eq!(reference(ty, &x), want, "{ty} k={k} (scalar path)");
        checked += 1;
    }
    assert!(checked > 50);
}

/// Inputs that stress rounding and the fallbacks: ties, huge and tiny magnitudes, zeros,
/// repeated extremes of both signs, and non-finite values.
fn special_rows(rng: &mut Rng, k: usize) -> Vec<Vec<f32>> {
    let mut rows = Vec::new();
    rows.push(vec![0.0; k]);
    rows.push((0..k).map(|i| if i % 2 == 0 { -0.0 } else { 0.0 }).collect());
    rows.push((0..k).map(|i| (i % 255) as f32 - 127.0).collect());
    rows.push((0..k).map(|i| ((i % 64) as f32 - 32.0) * 0.5).collect());
    // Scale exactly 1 (amax 127): every other value is a tie to round.
    rows.push((0..k).map(|i| if i % 16 == 0 { 127.0 } else { (i % 64) as f32 - 31.5 }).collect());
    rows.push((0..k).map(|i| ((i % 7) as f32 - 3.0) * 1e-40).collect());
    rows.push((0..k).map(|i| ((i % 7) as f32 - 3.0) * 1e-37).collect());
    rows.push((0..k).map(|i| ((i % 7) as f32 - 3.0) * 3e37).collect());
    rows.push(
        (0..k)
            .map(|i| {
                if i % 5 == 0 {
                    -4.0
                } else if i % 5 == 1 {
                    4.0
                } else {
                    rng.normal()
                }
            })
            .collect(),
    );
    rows.push(
        (0..k)
            .map(|i| {
                if i % 9 == 3 {
                    4.0
                } else if i % 9 == 4 {
                    -4.0
                } else {
                    rng.normal()
                }
            })
            .collect(),
    );
    for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE] {
        let mut row: Vec<f32> = (0..k).map(|_| rng.normal()).collect();
        row[k / 3] = special;
        row[k - 1] = special;
        rows.push(row);
    }
    for scale in [1.0, 1e-3, 1e6, 127.0] {
        rows.push((0..k).map(|_| rng.normal() * scale).collect());
    }
    rows
}

#[test]
fn simd_rows_are_bit_identical_to_the_scalar_quantizers() {
    let mut rng = Rng::new(1);
    for (weight_ty, act_ty) in
        [(GgmlType::Q4_0, GgmlType::Q8_0), (GgmlType::Q4_1, GgmlType::Q8_1), (GgmlType::Q4_K, GgmlType::Q8_K)]
    {
        let ks: &[usize] = if act_ty == GgmlType::Q8_K { &[256, 768, 4864] } else { &[32, 96, 352, 4864] };
        for &k in ks {
            let rows = special_rows(&mut rng, k);
            let flat: Vec<f32> = rows.concat();
            let mut x = QuantizedRows::new();
            x.quantize(weight_ty, &flat, k).unwrap();
            assert_eq!((x.ty(), x.k(), x.m()), (act_ty, k, rows.len()));
            for (i, row) in rows.iter().enumerate() {
                let want = reference(act_ty, row);
                if x.row(i) != want.as_slice() {
                    let at = x.row(i).iter().zip(&want).position(|(a, b)| a != b).unwrap();
                    panic!("{act_ty} k={k} row {i}: first difference at byte {at}");
                }
            }
        }
    }
}

#[test]
fn float_weights_keep_f32_activations_and_the_buffer_is_reused() {
    let mut rng = Rng::new(2);
    let x1: Vec<f32> = (0..3 * 40).map(|_| rng.normal()).collect();
    let mut x = QuantizedRows::new();
    x.quantize(GgmlType::BF16, &x1, 40).unwrap();
    assert_eq!((x.ty(), x.m()), (GgmlType::F32, 3));
    assert_eq!(x.row(2), bytemuck::cast_slice::<f32, u8>(&x1[80..]));
    // Smaller and larger batches of another format in the same buffer.
    let x2: Vec<f32> = (0..256).map(|_| rng.normal()).collect();
    x.quantize(GgmlType::Q6_K, &x2, 256).unwrap();
    assert_eq!(x.row(0), reference(GgmlType::Q8_K, &x2).as_slice());
    let x3: Vec<f32> = (0..64 * 512).map(|_| rng.normal()).collect();
    x.quantize(GgmlType::Q8_0, &x3, 512).unwrap();
    assert_eq!(x.m(), 64);
    assert_eq!(x.row(63), reference(GgmlType::Q8_0, &x3[63 * 512..]).as_slice());
}
