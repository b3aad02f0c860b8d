//! Matmul throughput per weight type: decode (m = 1) in GB/s of weights against a plain read of
//! the same bytes, and prefill (m = 128) in GFLOP/s, on 1 and 2 threads.
//!
//! `cargo run --release -p ts-cpu --example matmul_bench [-- [--types q4_0,q4_k] [--no-head]
//! [--head N_OUT,K] [--isa avx2|avx512|scalar] [--prefill-m N] [--threads 1,2] [--packed] [--mapped]]`
//!
//! `--mapped`: the output head's bytes read through a mapping of a file (written to the
//! system's temporary directory and read once before timing), as a model's dense weights are,
//! beside the same bytes in the process's own memory.
//!
//! `--packed`: weights repacked first (`pack_rows`) where the type and shape allow it, and
//! multiplied by `matmul_packed` (the detected instruction set).
//!
//! Shapes: 4864x896 and 896x4864 (Qwen2.5-0.5B's MLP), which stay in the L3 cache between runs,
//! and a 151936x896 output head, read from memory (caches are flushed before each run; `--head`
//! gives another shape, e.g. 262144,640 for Gemma 3 270M's). K-quants need k to be a multiple of
//! 256, so they use 1024 in place of 896.

use std::hint::black_box;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use ts_cpu::{GgmlType, Isa, QuantizedRows, matmul_with_isa};

const TYPES: [GgmlType; 14] = {
    use GgmlType::*;
    [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K]
};

struct Options {
    types: Vec<GgmlType>,
    head: bool,
    head_shape: Option<(usize, usize)>,
    isa: Isa,
    prefill_m: usize,
    threads: Vec<usize>,
    packed: bool,
    mapped: bool,
}

fn options() -> Options {
    let mut o = Options {
        types: TYPES.to_vec(),
        head: true,
        head_shape: None,
        isa: Isa::detect(),
        prefill_m: 128,
        threads: vec![1, 2],
        packed: false,
        mapped: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--types" => {
                o.types =
                    value.split(',').map(|t| GgmlType::from_name(t).unwrap_or_else(|| panic!("type {t}"))).collect();
                i += 1;
            }
            "--no-head" => o.head = false,
            "--head" => {
                let (n, k) = value.split_once(',').expect("--head N_OUT,K");
                o.head_shape = Some((n.parse().expect("--head N_OUT,K"), k.parse().expect("--head N_OUT,K")));
                i += 1;
            }
            "--packed" => o.packed = true,
            "--mapped" => o.mapped = true,
            "--isa" => {
                o.isa = match value.as_str() {
                    "avx2" => Isa::Avx2,
                    "avx512" => Isa::Avx512,
                    _ => Isa::Scalar,
                };
                i += 1;
            }
            "--prefill-m" => {
                o.prefill_m = value.parse().expect("--prefill-m N");
                i += 1;
            }
            "--threads" => {
                o.threads = value.split(',').map(|t| t.parse().expect("--threads 1,2")).collect();
                i += 1;
            }
            other => panic!("unknown option {other}"),
        }
        i += 1;
    }
    o
}

/// SplitMix64 bytes: speed does not depend on the values, as long as the scales are sane.
fn random_weights(ty: GgmlType, n_out: usize, k: usize, seed: u64) -> Vec<u8> {
    let bytes = ty.bytes_for((n_out * k) as u64).unwrap() as usize;
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut w = vec![0u8; bytes];
    for c in w.chunks_mut(8) {
        let r = next().to_le_bytes();
        c.copy_from_slice(&r[..c.len()]);
    }
    let small_f16 = 0x2c00u16.to_le_bytes(); // 0.0625
    let block = ty.type_size() as usize;
    let scale_at: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    };
    match ty {
        GgmlType::F32 => w.chunks_exact_mut(4).for_each(|c| c.copy_from_slice(&0.5f32.to_le_bytes())),
        GgmlType::F16 | GgmlType::BF16 => w.chunks_exact_mut(2).for_each(|c| c[1] &= 0x3f),
        GgmlType::MXFP4 => w.chunks_exact_mut(block).for_each(|b| b[0] = 120 + b[0] % 10),
        _ => w
            .chunks_exact_mut(block)
            .for_each(|b| scale_at.iter().for_each(|&at| b[at..at + 2].copy_from_slice(&small_f16))),
    }
    w
}

/// Best time of `f` over repeated runs (at least 5, at least ~0.3 s): the machine is shared, and
/// the minimum is the figure least disturbed by other work. With `evict`, a read of that buffer
/// (untimed) precedes each run, so that `f` finds nothing of its data in the caches.
fn time(evict: Option<&[u8]>, mut f: impl FnMut()) -> Duration {
    f();
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 5 || (start.elapsed() < Duration::from_millis(300) && times.len() < 1000) {
        if let Some(evict) = evict {
            black_box(read_all(evict));
        }
        let t = Instant::now();
        f();
        times.push(t.elapsed());
    }
    times.into_iter().min().unwrap()
}

fn read_all(bytes: &[u8]) -> u64 {
    let (head, words, tail) = unsafe_free_words(bytes);
    let chunk = (words.len() / (4 * rayon::current_num_threads())).max(4096);
    let sum: u64 = words
        .par_chunks(chunk)
        .map(|c| {
            let mut acc = [0u64; 8];
            for w in c.chunks_exact(8) {
                for i in 0..8 {
                    acc[i] = acc[i].wrapping_add(w[i]);
                }
            }
            acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
        })
        .reduce(|| 0, |a, b| a.wrapping_add(b));
    sum.wrapping_add(head.len() as u64 + tail.len() as u64)
}

fn unsafe_free_words(bytes: &[u8]) -> (&[u8], &[u64], &[u8]) {
    let start = bytes.as_ptr().align_offset(8).min(bytes.len());
    let (head, rest) = bytes.split_at(start);
    let n = rest.len() / 8 * 8;
    (head, bytemuck::cast_slice(&rest[..n]), &rest[n..])
}

fn main() {
    let o = options();
    println!("kernels: {}; threads {:?}; prefill m = {}", o.isa, o.threads, o.prefill_m);
    println!(
        "{:<6} {:>13} {:>4} | {:>9} {:>8} {:>8} {:>5} | {:>8} {:>9} {:>9}",
        "type", "n_out x k", "thr", "decode us", "GB/s", "read", "%", "quantize", "prefill", "GFLOP/s"
    );
    // Four times the L3 cache of the machine these figures were taken on.
    let evict = vec![1u8; 128 << 20];
    let pools: Vec<rayon::ThreadPool> =
        o.threads.iter().map(|&t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap()).collect();
    for &ty in &o.types {
        let narrow = if ty.block_size() == 256 { 1024 } else { 896 };
        let mut shapes = vec![(4864, narrow, true), (narrow, 4864, true)];
        if o.head {
            let (n_out, k) = o.head_shape.unwrap_or((151_936, narrow));
            shapes.push((n_out, k, false));
        }
        for (n_out, k, prefill) in shapes {
            let mut w = random_weights(ty, n_out, k, 7);
            let packed = o.packed && ts_cpu::pack_rows(ty, &mut w, n_out, k).unwrap();
            // The head through a file mapping (its pages in the page cache), where asked.
            let map = (o.mapped && !prefill).then(|| map_copy(&w));
            let w: &[u8] = map.as_deref().unwrap_or(&w);
            let mm = |x: &QuantizedRows, out: &mut [f32]| match packed {
                true => ts_cpu::matmul_packed(ty, w, n_out, k, x, out, n_out).unwrap(),
                false => matmul_with_isa(o.isa, ty, w, n_out, k, x, out, n_out).unwrap(),
            };
            let m = o.prefill_m;
            let xf: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
            let mut x1 = QuantizedRows::new();
            x1.quantize(ty, &xf[..k], k).unwrap();
            let mut xm = QuantizedRows::new();
            // The small matrices stay in cache between runs, as in a loop over one layer; the
            // output head is read cold, from memory, as in a real forward pass.
            let cold = (!prefill).then_some(evict.as_slice());
            for (pool, &threads) in pools.iter().zip(&o.threads) {
                pool.install(|| {
                    let mut out = vec![0.0f32; m * n_out];
                    let decode = time(cold, || {
                        mm(&x1, &mut out[..n_out]);
                        black_box(&out);
                    });
                    let read = time(cold, || {
                        black_box(read_all(w));
                    });
                    let gbs = w.len() as f64 / decode.as_secs_f64() / 1e9;
                    let read_gbs = w.len() as f64 / read.as_secs_f64() / 1e9;
                    let mut line = format!(
                        "{:<6} {:>13} {:>4} | {:>9.1} {:>8.2} {:>8.2} {:>4.0}% |",
                        format!(
                            "{}{}{}",
                            ty.name(),
                            if packed { "p" } else { "" },
                            if map.is_some() { "m" } else { "" }
                        ),
                        format!("{n_out}x{k}"),
                        threads,
                        decode.as_secs_f64() * 1e6,
                        gbs,
                        read_gbs,
                        100.0 * gbs / read_gbs
                    );
                    if prefill {
                        let q = time(None, || {
                            xm.quantize(ty, &xf, k).unwrap();
                        });
                        line += &format!(" {:>6.0}us", q.as_secs_f64() * 1e6);
                        let t = time(None, || {
                            mm(&xm, &mut out);
                            black_box(&out);
                        });
                        let flops = 2.0 * (m * n_out * k) as f64;
                        line += &format!(" {:>7.2}ms {:>9.1}", t.as_secs_f64() * 1e3, flops / t.as_secs_f64() / 1e9);
                    }
                    println!("{line}");
                });
            }
        }
    }
}

/// `bytes` written to a new file in the temporary directory (removed again) and mapped, its
/// pages read once so that the page cache holds them.
fn map_copy(bytes: &[u8]) -> memmap2::Mmap {
    let path = std::env::temp_dir().join(format!("matmul_bench_{}.bin", std::process::id()));
    std::fs::write(&path, bytes).expect("write the mapped copy");
    let file = std::fs::File::open(&path).expect("open the mapped copy");
    // Safety: the file is this process's own and nothing writes it while mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }.expect("map the copy");
    std::fs::remove_file(&path).expect("remove the mapped copy");
    black_box(read_all(&map));
    map
}
