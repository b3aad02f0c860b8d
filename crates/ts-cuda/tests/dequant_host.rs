//! The CUDA kernels' block decoding (kernels/quant.cuh), compiled as host C++ and checked
//! element for element against ts-quant's reference dequantization, which is bit-identical to
//! llama.cpp's; their integer dot products with 8-bit activations (kernels/vdot.cuh) against
//! the dequantized weights times those activations in f64; and every kernel compiled with
//! NVRTC (ignored here: CI has no CUDA toolkit; tools/gpu-run.sh runs it on the GPU machine).

mod common;

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::process::Command;

use ts_gguf::GgmlType;
use ts_testkit::Rng;

/// Every type the kernels decode: ggml type, kernel suffix, alignment its rows need.
const TYPES: [(GgmlType, &str, usize); 14] = [
    (GgmlType::F32, "f32", 1),
    (GgmlType::F16, "f16", 1),
    (GgmlType::BF16, "bf16", 1),
    (GgmlType::Q8_0, "q8_0", 2),
    (GgmlType::Q4_0, "q4_0", 2),
    (GgmlType::Q4_1, "q4_1", 2),
    (GgmlType::Q5_0, "q5_0", 2),
    (GgmlType::Q5_1, "q5_1", 2),
    (GgmlType::Q2_K, "q2_k", 2),
    (GgmlType::Q3_K, "q3_k", 2),
    (GgmlType::Q4_K, "q4_k", 2),
    (GgmlType::Q5_K, "q5_k", 2),
    (GgmlType::Q6_K, "q6_k", 2),
    (GgmlType::MXFP4, "mxfp4", 1),
];

const KERNELS: [&str; 5] = ["matvec", "moe_matvec", "moe_gate_up", "dequant_f16", "get_rows"];

/// This crate's directory: found through `$TURBOSPARK_ROOT` where the test binary runs on
/// another machine (tools/gpu-run.sh).
fn crate_dir() -> PathBuf {
    ts_testkit::repo_root().join("crates/ts-cuda")
}

fn kernels_dir() -> PathBuf {
    crate_dir().join("kernels")
}

/// The compiled harness in a temporary directory, removed on drop.
struct Harness {
    dir: PathBuf,
    exe: PathBuf,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Harness {
    /// Compiles tests/`name`.cpp; a missing `c++` is a failure (CI has one).
    fn build(name: &str) -> Harness {
        if let Err(e) = Command::new("c++").arg("--version").output() {
            panic!("no c++ on PATH ({e}): this test compiles the kernels' headers as host C++");
        }
        let dir = std::env::temp_dir().join(format!("ts-cuda-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let harness = Harness { exe: dir.join(name), dir };
        let out = Command::new("c++")
            .args(["-O1", "-std=c++17", "-Wall", "-Wextra", "-I"])
            .arg(kernels_dir())
            .arg(crate_dir().join(format!("tests/{name}.cpp")))
            .arg("-o")
            .arg(&harness.exe)
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "compiling the harness failed:\n{log}");
        assert!(log.trim().is_empty(), "the harness compiles with warnings:\n{log}");
        harness
    }

    /// Decodes `rows` rows of `k` elements of type `name` placed `offset` bytes past a 16-byte
    /// boundary; `half` asks for the elements' f16 bits instead of f32.
    fn run(&self, name: &str, k: usize, rows: usize, data: &[u8], half: bool, offset: usize) -> Vec<u8> {
        let tag = format!("{name}-{k}-{}-{offset}", half as u8);
        let input = self.dir.join(format!("{tag}.in"));
        let output = self.dir.join(format!("{tag}.out"));
        std::fs::write(&input, data).unwrap();
        let status = Command::new(&self.exe)
            .args([name, &k.to_string(), &rows.to_string()])
            .arg(&input)
            .arg(&output)
            .args([if half { "f16" } else { "f32" }, &offset.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "harness failed for {tag}");
        std::fs::read(&output).unwrap()
    }
}

fn row_bytes(ty: GgmlType, k: usize) -> usize {
    k / ty.block_size() as usize * ty.type_size() as usize
}

/// Values with spread: per-row scales from 1e-3 to 1e3, an offset, a few spikes, and the start
/// of the first row zero (blocks of zeros).
fn values(rng: &mut Rng, k: usize, rows: usize) -> Vec<f32> {
    let scales = [1e-3, 0.05, 1.0, 40.0, 1e3];
    let mut x = Vec::with_capacity(k * rows);
    for r in 0..rows {
        let scale = scales[r % scales.len()];
        let mut row = rng.normals(k, scale, scale * 0.1 * (r as f32 - 1.0));
        for _ in 0..k / 64 {
            let i = (rng.next_u64() % k as u64) as usize;
            row[i] *= 8.0;
        }
        if r == 0 {
            row[..k / 2].fill(0.0);
        }
        x.extend(row);
    }
    x
}

/// The first few differences between ts-quant's elements and the harness's, bit for bit; NaNs
/// count as equal when `nan_equal` (random bit patterns, where NaN payloads are not the point).
fn mismatches(expected: &[f32], got: &[f32], k: usize, nan_equal: bool) -> Vec<String> {
    assert_eq!(expected.len(), got.len());
    expected
        .iter()
        .zip(got)
        .enumerate()
        .filter(|(_, (e, g))| e.to_bits() != g.to_bits() && !(nan_equal && e.is_nan() && g.is_nan()))
        .take(8)
        .map(|(i, (e, g))| {
            format!(
                "row {} element {}: expected {e:e} ({:#010x}), got {g:e} ({:#010x})",
                i / k,
                i % k,
                e.to_bits(),
                g.to_bits()
            )
        })
        .collect()
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Runs the harness on `data` at every allowed row offset, in f32 and f16 modes, and compares.
fn check(h: &Harness, ty: GgmlType, name: &str, align: usize, k: usize, data: &[u8], random: bool) {
    let rows = data.len() / row_bytes(ty, k);
    let mut expected = vec![0f32; rows * k];
    ts_quant::dequantize(ty, data, &mut expected).unwrap();
    for offset in [0, 1, 2, 3, 8].into_iter().filter(|o| o % align == 0) {
        let got = floats(&h.run(name, k, rows, data, false, offset));
        let bad = mismatches(&expected, &got, k, random);
        assert!(bad.is_empty(), "{name}, k = {k}, offset {offset}, random = {random}:\n{}", bad.join("\n"));
    }
    // The host half conversion the f16 output path mirrors: round to nearest even.
    let got = h.run(name, k, rows, data, true, 0);
    for (i, (e, g)) in expected.iter().zip(got.chunks_exact(2)).enumerate() {
        let g = u16::from_le_bytes([g[0], g[1]]);
        let want = half::f16::from_f32(*e);
        let ok = if e.is_nan() { half::f16::from_bits(g).is_nan() } else { g == want.to_bits() };
        assert!(ok, "{name} as f16, element {i}: {e:e} gave {g:#06x}, expected {:#06x}", want.to_bits());
    }
}

#[test]
fn dequant32_matches_ts_quant() {
    let h = Harness::build("dequant_host");
    let mut rng = Rng::new(0x5eed_c0da);
    for (ty, name, align) in TYPES {
        assert!(ts_quant::is_supported(ty), "{ty}");
        let ks: &[usize] = if ty.block_size() == 256 { &[768, 2816] } else { &[288, 2880] };
        for &k in ks {
            // Quantized data, as real models hold.
            let rows = 5;
            let x = values(&mut rng, k, rows);
            let mut data = vec![0u8; rows * row_bytes(ty, k)];
            ts_quant::quantize(ty, &x, &mut data).unwrap();
            check(&h, ty, name, align, k, &data, false);

            // Every bit pattern: random bytes are valid blocks of every type.
            let rows = 3;
            let data: Vec<u8> = (0..rows * row_bytes(ty, k)).map(|_| rng.next_u64() as u8).collect();
            check(&h, ty, name, align, k, &data, true);
        }
    }
}

/// The types with integer dot products (kernels/vdot.cuh's TS_Q8_TYPES), as [`TYPES`] lists them.
fn q8_types() -> impl Iterator<Item = (GgmlType, &'static str, usize)> {
    TYPES.into_iter().filter(|t| ts_cuda::q8_suffix(t.0).is_some())
}

/// Rows of type `ty` as models hold them: `values` quantized, or for a type ts-quant cannot
/// quantize (MXFP4) random codes under exponents near 1.
fn quantized_rows(rng: &mut Rng, ty: GgmlType, values: &[f32]) -> Vec<u8> {
    let mut data = vec![0u8; values.len() / ty.block_size() as usize * ty.type_size() as usize];
    if ts_quant::quantize(ty, values, &mut data).is_err() {
        for (i, b) in data.iter_mut().enumerate() {
            *b = if i % 17 == 0 { 118 + (rng.next_u64() % 8) as u8 } else { rng.next_u64() as u8 };
        }
    }
    data
}

#[test]
fn vdot_matches_the_dequantized_product() {
    let h = Harness::build("vdot_host");
    let mut rng = Rng::new(0x00d0_7a11);
    for (ty, name, align) in q8_types() {
        let ks: &[usize] = if ty.block_size() == 256 { &[768, 2816] } else { &[288, 2880] };
        for &k in ks {
            let rows = 5;
            let v = values(&mut rng, k, rows);
            let data = quantized_rows(&mut rng, ty, &v);
            let mut w = vec![0f32; rows * k];
            ts_quant::dequantize(ty, &data, &mut w).unwrap();
            // Eight activation rows: one with a spread of magnitudes, one with a zero block.
            let n_x = 8;
            let mut x = rng.normals(n_x * k, 1.0, 0.1);
            x[k..k + 32].fill(0.0);
            x[7] = 30.0;
            let (q, ds) = common::quantize_q8(&x);
            let (want, mag) = common::reference_matmul(&w, &common::dequantize_q8(&q, &ds), rows, k, n_x);
            let xq: Vec<u8> = q.iter().map(|&v| v as u8).collect();
            let xds: Vec<u8> = ds.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
            for offset in [0, 1, 2, 3, 8].into_iter().filter(|o| o % align == 0) {
                let tag = format!("{name}-{k}-{offset}");
                let path = |s: &str| h.dir.join(format!("{tag}.{s}"));
                std::fs::write(path("w"), &data).unwrap();
                std::fs::write(path("xq"), &xq).unwrap();
                std::fs::write(path("xds"), &xds).unwrap();
                let status = Command::new(&h.exe)
                    .args([name, &k.to_string(), &rows.to_string()])
                    .args([path("w"), path("xq"), path("xds"), path("out")])
                    .arg(offset.to_string())
                    .arg(path("frags"))
                    .status()
                    .unwrap();
                assert!(status.success(), "harness failed for {tag}");
                // The tensor-core fragments give the dequantized weights (signed zeros aside).
                let frags = floats(&std::fs::read(path("frags")).unwrap());
                for (i, (e, g)) in w.iter().zip(&frags).enumerate() {
                    assert!(
                        e == g || (e.is_nan() && g.is_nan()),
                        "{tag} fragment element {i}: expected {e:e}, got {g:e}"
                    );
                }
                let got = floats(&std::fs::read(path("out")).unwrap());
                let per_row = got.len() / rows;
                for o in 0..rows {
                    // dot<1>, dot<2>, dot<4>, dot<8> over the same activation rows.
                    let passes: Vec<&[f32]> = got[per_row * o..per_row * (o + 1)].chunks(n_x).collect();
                    for (m, pass) in [2, 4, 8].iter().zip(&passes[1..]) {
                        for r in 0..n_x {
                            let (alone, with) = (passes[0][r], pass[r]);
                            assert_eq!(
                                alone.to_bits(),
                                with.to_bits(),
                                "{tag} row {o}: dot<1> and dot<{m}> differ on row {r}"
                            );
                        }
                    }
                    for r in 0..n_x {
                        let (e, g) = (want[r * rows + o], passes[0][r]);
                        // f32 products of exact integer sums, summed in f32.
                        let bound = 1e-5 * mag[r * rows + o];
                        assert!(
                            ((e - g).abs() as f64) <= bound,
                            "{tag} weight row {o}, activation row {r}: expected {e:e}, got {g:e} (bound {bound:e})"
                        );
                    }
                }
            }
        }
    }
}

/// Makes a library at `path` the one cudarc finds: once loaded, opening it by its soname
/// returns the same object.
#[cfg(target_os = "linux")]
fn preload(path: &std::ffi::OsStr) {
    unsafe extern "C" {
        fn dlopen(filename: *const std::ffi::c_char, flags: std::ffi::c_int) -> *mut std::ffi::c_void;
    }
    const RTLD_NOW: std::ffi::c_int = 2;
    const RTLD_GLOBAL: std::ffi::c_int = 0x100;
    let c = CString::new(path.as_encoded_bytes()).unwrap();
    // SAFETY: dlopen with a valid C string; the handle is kept for the life of the process.
    let handle = unsafe { dlopen(c.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
    assert!(!handle.is_null(), "TS_NVRTC_LIB={}: cannot load it", path.to_string_lossy());
}

#[cfg(not(target_os = "linux"))]
fn preload(_path: &std::ffi::OsStr) {}

/// Compiles `src` for sm_90 with the kernels directory on the include path: (PTX, log).
fn nvrtc_compile(src: &str) -> Result<(String, String), String> {
    use cudarc::nvrtc::result;
    let src = CString::new(src).unwrap();
    let prog = result::create_program(&src, Some(c"matmul.cu")).map_err(|e| format!("{e:?}"))?;
    let mut options =
        vec!["--gpu-architecture=sm_90".to_string(), format!("--include-path={}", kernels_dir().display())];
    // The backend's defines (its kernel-variant knobs), so that a variant is checked before a lease.
    options.extend(ts_cuda::device::kernel_defines());
    // SAFETY: `prog` comes from create_program and is destroyed once, last.
    unsafe {
        let compiled = result::compile_program(prog, &options);
        let log = result::get_program_log(prog).map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned());
        let ptx = compiled.and_then(|()| result::get_ptx(prog));
        let ptx = ptx.map(|p| CStr::from_ptr(p.as_ptr()).to_string_lossy().into_owned());
        result::destroy_program(prog).map_err(|e| format!("{e:?}"))?;
        let log = log.map_err(|e| format!("{e:?}"))?;
        ptx.map(|p| (p, log.clone())).map_err(|e| format!("{e:?}:\n{log}"))
    }
}

/// Set `TS_PTX_OUT` to a path to keep the PTX, `TS_NVRTC_LIB` to the library to use.
#[test]
#[ignore = "needs NVRTC, the CUDA toolkit (run by tools/gpu-run.sh)"]
fn nvrtc_compiles() {
    let forced = std::env::var_os("TS_NVRTC_LIB");
    if let Some(path) = &forced {
        preload(path);
    }
    // SAFETY: only tries to open the library.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    assert!(present, "no NVRTC library found (set TS_NVRTC_LIB or install the CUDA toolkit)");
    // Every kernel file, as the backend compiles them at run time.
    let src = ts_cuda::device::kernel_source();
    let (ptx, log) = nvrtc_compile(&src).unwrap_or_else(|e| panic!("the kernels do not compile: {e}"));
    if let Some(path) = std::env::var_os("TS_PTX_OUT") {
        std::fs::write(path, &ptx).unwrap();
    }
    assert!(!log.contains("warning"), "NVRTC warnings:\n{log}");
    for (_, name, _) in TYPES {
        for kernel in KERNELS {
            let entry = format!(".entry {kernel}_{name}(");
            assert!(ptx.contains(&entry), "no {entry} in the PTX");
        }
    }
    for (_, name, _) in q8_types() {
        for kernel in ["matvec_q8", "matvec_q8_wide", "moe_matvec_q8", "moe_gate_up_q8"] {
            let entry = format!(".entry {kernel}_{name}(");
            assert!(ptx.contains(&entry), "no {entry} in the PTX");
        }
        for kernel in ["moe_mm_q8_", "moe_mm_gate_up_q8_"] {
            let entry = format!(".entry {kernel}{name}_32(");
            assert!(ptx.contains(&entry), "no {entry} in the PTX");
        }
    }
    for kernel in [
        "quantize_q8_1",
        "gather_quantize_q8_1",
        "rms_norm",
        "norm_router_route",
        "rope_store",
        "attention",
        "attention_256",
        "attention_wide",
        "route",
        "columns",
        "mul_sigmoid",
        "conv_silu",
        "l2_norm_heads",
        "delta_rule",
    ] {
        assert!(ptx.contains(&format!(".entry {kernel}(")), "no .entry {kernel}( in the PTX");
    }
    // Register arrays that spill to local memory would cost a round trip per element
    // (the rotations' sincosf keeps its rare large-argument reduction there: allowed, also in
    // the decode attention kernels that rotate their heads themselves).
    let mut kernel = "";
    for line in ptx.lines() {
        if let Some(rest) = line.split(".entry ").nth(1) {
            kernel = rest.split('(').next().unwrap_or("").trim();
        }
        assert!(
            !line.contains(".local")
                || ["rope", "rope_store", "attention", "attention_256", "attention_wide"].contains(&kernel),
            "local memory in {kernel}"
        );
    }
}
