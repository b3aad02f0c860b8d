//! Times one matmul per weight type and instruction set on this machine, single-threaded:
//! `cargo run --release -p ts-cpu --example kernels -- [M] [N_OUT] [K] [TYPE...]` (defaults 128
//! 1024 2048, every type).
//! Random weights and activations; prints GMAC/s (the best of 20 runs) per type and ISA, and
//! of the direct kernels alone (this CPU's best ISA, no batch panels) and of the packed layout
//! where this CPU has one, for comparing kernels without a whole model's noise.

use std::time::Instant;

use ts_cpu::{GgmlType, Isa, QuantizedRows, matmul_rows_alone, matmul_with_isa};

fn main() {
    let all: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<usize> = all.iter().take(3).map(|a| a.parse().expect("numbers: M N_OUT K")).collect();
    let types: Vec<&String> = all.iter().skip(3).collect();
    let (m, n_out, k) = (
        args.first().copied().unwrap_or(128),
        args.get(1).copied().unwrap_or(1024),
        args.get(2).copied().unwrap_or(2048),
    );
    rayon::ThreadPoolBuilder::new().num_threads(1).build_global().unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    use GgmlType as T;
    for ty in [T::Q4_0, T::Q4_1, T::Q5_0, T::Q5_1, T::Q8_0, T::MXFP4, T::Q4_K, T::Q5_K, T::Q6_K] {
        let block = ty.block_size() as usize;
        if k % block != 0 || !(types.is_empty() || types.iter().any(|t| t.eq_ignore_ascii_case(ty.name()))) {
            continue;
        }
        // Random bytes with small f16 scales: the speed does not depend on the values.
        let row_bytes = k / block * ty.type_size() as usize;
        let mut w: Vec<u8> = (0..n_out * row_bytes).map(|_| next() as u8).collect();
        let scale_at: &[usize] = match ty {
            T::Q4_K | T::Q5_K => &[0, 2],
            T::Q6_K => &[208],
            T::MXFP4 => &[],
            _ => &[0],
        };
        for blk in w.chunks_mut(ty.type_size() as usize) {
            for &at in scale_at {
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            }
            if ty == T::MXFP4 {
                blk[0] = 120;
            }
        }
        let xf: Vec<f32> = (0..m * k).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
        let mut x = QuantizedRows::new();
        x.quantize(ty, &xf, k).unwrap();
        let mut out = vec![0.0f32; m * n_out];
        let mut time = |f: &mut dyn FnMut(&mut [f32])| {
            let best = (0..20)
                .map(|_| {
                    let t = Instant::now();
                    f(&mut out);
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            (m * n_out * k) as f64 / best / 1e9
        };
        let mut line = format!("{:>6}", ty.name());
        for isa in [Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.is_available()) {
            let g = time(&mut |out| matmul_with_isa(isa, ty, &w, n_out, k, &x, out, n_out).unwrap());
            line += &format!("  {isa} {g:.2}");
        }
        let g = time(&mut |out| matmul_rows_alone(ty, &w, n_out, k, &x, out).unwrap());
        line += &format!("  direct {g:.2}");
        if ts_cpu::packs(ty, n_out) {
            let mut packed = w.clone();
            let t = Instant::now();
            ts_cpu::pack_rows(ty, &mut packed, n_out, k).unwrap();
            let pack_gbs = w.len() as f64 / t.elapsed().as_secs_f64() / 1e9;
            let g = time(&mut |out| ts_cpu::matmul_packed(ty, &packed, n_out, k, &x, out, n_out).unwrap());
            line += &format!("  packed {g:.2} (repacked at {pack_gbs:.2} GB/s)");
        }
        println!("{line} GMAC/s");
    }
}
