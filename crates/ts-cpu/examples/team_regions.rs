//! What one parallel region of a step's team costs: regions of a few items each (the shape of a
//! small model's decode, where a layer's products are a few rows a thread) run back to back
//! inside one `team::scope`, timed per region, at each thread count.
//!
//! `cargo run --release -p ts-cpu --example team_regions [-- THREADS [ITEMS_PER_THREAD [WORK]]]`
//! (defaults `1,2`, `4` and `200`: each item sums WORK floats of its own).

use std::hint::black_box;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads: Vec<usize> =
        args.first().map_or("1,2", String::as_str).split(',').map(|t| t.parse().expect("threads")).collect();
    let per_thread: usize = args.get(1).map_or(4, |v| v.parse().expect("items a thread"));
    let work: usize = args.get(2).map_or(200, |v| v.parse().expect("floats an item"));
    println!("| threads | items | floats an item | µs a region (best of 5 runs of 20,000) |");
    println!("| ---: | ---: | ---: | ---: |");
    for &t in &threads {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().expect("pool");
        let n = t * per_thread;
        let data: Vec<Vec<f32>> = (0..n).map(|i| vec![i as f32; work]).collect();
        let sums: Vec<std::sync::atomic::AtomicU32> = (0..n).map(|_| Default::default()).collect();
        let region = |i: usize| {
            let s: f32 = data[i].iter().sum();
            sums[i].store(black_box(s).to_bits(), std::sync::atomic::Ordering::Relaxed);
        };
        let mut best = f64::MAX;
        for _ in 0..5 {
            let regions = 20_000;
            let secs = pool.install(|| {
                ts_cpu::team::scope(|| {
                    let start = Instant::now();
                    for _ in 0..regions {
                        ts_cpu::team::for_each(n, &region);
                    }
                    start.elapsed().as_secs_f64()
                })
            });
            best = best.min(secs / regions as f64 * 1e6);
        }
        println!("| {t} | {n} | {work} | {best:.2} |");
    }
}
