//! Shared by the test binaries: a plain reference of the kernels' 8-bit activations.

/// `x` `[rows][k]` quantized as kernels/vdot.cuh defines it, written here from that definition
/// alone: per block of 32, `d = max|x| / 127`, `q = round(x / d)` (halves away from zero; 0 where d
/// is 0) and `(d, d * sum(q))`.
pub fn quantize_q8(x: &[f32]) -> (Vec<i8>, Vec<[f32; 2]>) {
    assert_eq!(x.len() % 32, 0);
    let mut q = Vec::with_capacity(x.len());
    let mut ds = Vec::with_capacity(x.len() / 32);
    for block in x.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let qs: Vec<i8> = block.iter().map(|&v| if d == 0.0 { 0 } else { (v / d).round() as i8 }).collect();
        let sum: i32 = qs.iter().map(|&v| v as i32).sum();
        ds.push([d, d * sum as f32]);
        q.extend(qs);
    }
    (q, ds)
}

/// The activations `quantize_q8` stands for: `d * q`.
pub fn dequantize_q8(q: &[i8], ds: &[[f32; 2]]) -> Vec<f32> {
    q.iter().enumerate().map(|(i, &v)| ds[i / 32][0] * v as f32).collect()
}

/// `x[m][k] · Wᵀ` in f64, and per output `Σ |w x|` (the scale of its rounding error).
pub fn reference_matmul(w: &[f32], x: &[f32], n_out: usize, k: usize, m: usize) -> (Vec<f32>, Vec<f64>) {
    let mut y = vec![0f32; m * n_out];
    let mut mag = vec![0f64; m * n_out];
    for r in 0..m {
        for o in 0..n_out {
            let (wr, xr) = (&w[o * k..(o + 1) * k], &x[r * k..(r + 1) * k]);
            y[r * n_out + o] = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
            mag[r * n_out + o] = wr.iter().zip(xr).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
        }
    }
    (y, mag)
}
