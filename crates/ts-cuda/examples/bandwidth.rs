//! Device-to-device copy and pinned host-to-device bandwidth: the ceilings the
//! decode and expert-tier figures are measured against.
use cudarc::driver::CudaContext;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let n = 1usize << 30; // 1 GiB
    let src = stream.alloc_zeros::<u8>(n)?;
    let mut dst = stream.alloc_zeros::<u8>(n)?;
    stream.memcpy_dtod(&src, &mut dst)?;
    stream.synchronize()?;
    let reps = 20;
    let t = Instant::now();
    for _ in 0..reps {
        stream.memcpy_dtod(&src, &mut dst)?;
    }
    stream.synchronize()?;
    let dtod = 2.0 * (n * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
    let mut pinned = unsafe { ctx.alloc_pinned::<u8>(n)? };
    pinned.as_mut_slice()?.fill(1);
    stream.memcpy_htod(&pinned, &mut dst)?;
    stream.synchronize()?;
    let t = Instant::now();
    for _ in 0..5 {
        stream.memcpy_htod(&pinned, &mut dst)?;
    }
    stream.synchronize()?;
    let htod = (n * 5) as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("device copy {dtod:.0} GB/s (read + write), pinned host-to-device {htod:.1} GB/s");
    Ok(())
}
