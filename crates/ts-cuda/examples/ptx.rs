//! Compiles every kernel with NVRTC for an architecture and lists them: a
//! check that needs NVRTC but no GPU. `cargo run -p ts-cuda --example ptx -- sm_90`
fn main() {
    let arch: &'static str = Box::leak(std::env::args().nth(1).unwrap_or_else(|| "sm_90".into()).into_boxed_str());
    match ts_cuda::device::compile_for(arch) {
        Ok(ptx) => {
            let src = ptx.to_src();
            let names = ts_cuda::device::ptx_entries(&src);
            println!("{} kernels, {} bytes of PTX for {arch}", names.len(), src.len());
            for n in names {
                println!("{n}");
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
