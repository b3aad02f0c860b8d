//! Random O_DIRECT read bandwidth of a file in chunks of a given size, with
//! several threads: the disk-bound limit the expert streamer is measured against.
//!
//! usage: read_bandwidth FILE [CHUNK_BYTES=4194304] [THREADS=4] [SECONDS=10]

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: read_bandwidth FILE [CHUNK_BYTES] [THREADS] [SECONDS]");
    let chunk: usize = args.get(2).map_or(4 << 20, |s| s.parse().unwrap());
    let threads: usize = args.get(3).map_or(4, |s| s.parse().unwrap());
    let secs: f64 = args.get(4).map_or(10.0, |s| s.parse().unwrap());
    let file = std::fs::File::options().read(true).custom_flags(libc::O_DIRECT).open(path).expect("open with O_DIRECT");
    let len = file.metadata().unwrap().len();
    let chunk = chunk.div_ceil(4096) * 4096;
    let blocks = (len / chunk as u64).max(1);
    let total = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (file, total) = (&file, &total);
            s.spawn(move || {
                let layout = std::alloc::Layout::from_size_align(chunk, 4096).unwrap();
                // SAFETY: non-zero size; freed below.
                let ptr = unsafe { std::alloc::alloc(layout) };
                // SAFETY: `ptr` holds `chunk` bytes owned by this thread.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr, chunk) };
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t as u64;
                while start.elapsed() < Duration::from_secs_f64(secs) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let off = (x % blocks) * chunk as u64;
                    if let Ok(n) = file.read_at(buf, off) {
                        total.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
                // SAFETY: allocated above with this layout.
                unsafe { std::alloc::dealloc(ptr, layout) };
            });
        }
    });
    let gbps = total.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64() / 1e9;
    println!("O_DIRECT random reads of {} KiB with {threads} threads: {gbps:.3} GB/s", chunk / 1024);
}
