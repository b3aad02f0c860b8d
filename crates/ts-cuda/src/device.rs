//! One CUDA device: context, stream, the kernels compiled once per process by
//! NVRTC for the device's architecture, launches and copies.

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// Kernel sources, compiled together as one: `matmul.cu` includes `launch.cuh` (every
/// kernel's prologue), `activation.cuh` and `quant.cuh`; `matvec_q8.cu` (with `vdot.cuh`),
/// `moe_mm_q8.cu` (which uses it) and the files by op follow it, `ops.cu` (with the helpers the
/// others use) first.
const LAUNCH_CUH: &str = include_str!("../kernels/launch.cuh");
const ACTIVATION_CUH: &str = include_str!("../kernels/activation.cuh");
const QUANT_CUH: &str = include_str!("../kernels/quant.cuh");
const MATMUL_CU: &str = include_str!("../kernels/matmul.cu");
const VDOT_CUH: &str = include_str!("../kernels/vdot.cuh");
const MATVEC_Q8_CU: &str = include_str!("../kernels/matvec_q8.cu");
const MOE_MM_Q8_CU: &str = include_str!("../kernels/moe_mm_q8.cu");
const OPS_CU: &str = include_str!("../kernels/ops.cu");
const ATTENTION_CU: &str = include_str!("../kernels/attention.cu");
const MOE_CU: &str = include_str!("../kernels/moe.cu");
const DELTA_NET_CU: &str = include_str!("../kernels/delta_net.cu");

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    #[error("CUDA: {0}")]
    Driver(String),
    #[error("CUDA kernel compilation failed: {0}")]
    Compile(String),
}

/// Where and how wide one kernel launch runs.
struct LaunchShape<'a> {
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    /// Dynamic shared memory, bytes.
    smem: u32,
    stream: &'a CudaStream,
    /// Programmatic dependent launch on the stream's previous kernel (launch.cuh).
    dependent: bool,
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device pointer.
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// Runs `f`, turning a panic of cudarc's dynamic loader (library missing) into
/// an error naming what is missing; the panic message is kept quiet.
pub fn guard<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, CudaError> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    result.map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        let lib = msg.split('"').nth(1).unwrap_or("a CUDA library");
        CudaError::Unavailable(format!("{what}: the {lib} library was not found (is an NVIDIA driver installed?)"))
    })
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    funcs: Arc<HashMap<String, CudaFunction>>,
    pub name: String,
    pub arch: (i32, i32),
    /// Launch with programmatic stream serialization (launch.cuh): compute capability 9.0 and later.
    dependent_launch: bool,
    /// Streams beside `stream` for launches that may overlap, and which stream launches go
    /// to now: 0 `stream`, i `side[i - 1]`.
    side: Vec<Arc<CudaStream>>,
    on: std::sync::atomic::AtomicUsize,
    /// How many of the streams launches are spread over: `BRANCHES`, or 1 with
    /// `TURBOSPARK_NO_BRANCHES` (a measurement knob).
    pub branches: usize,
    /// Host transfers and waits so far (uploads, syncs): a step with any cannot be recorded.
    pub transfers: std::sync::atomic::AtomicU64,
}

/// Streams that launches may be spread over ([`Gpu::launch_on`]), `stream` included.
pub const BRANCHES: usize = 3;

impl Gpu {
    /// Opens device `ordinal` and compiles the kernels for it.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        let count = guard("loading the CUDA driver", || {
            cudarc::driver::result::init().and_then(|()| cudarc::driver::result::device::get_count())
        })?
        .map_err(|e| CudaError::Unavailable(format!("no usable CUDA device or driver: {e}")))?;
        if ordinal as i32 >= count {
            return Err(CudaError::Unavailable(format!(
                "device cuda:{ordinal} does not exist ({count} CUDA device{} found)",
                if count == 1 { "" } else { "s" }
            )));
        }
        let (ctx, funcs) = loaded(ordinal)?;
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream()?;
        let arch = ctx.compute_capability()?;
        let name = ctx.name()?;
        let side = (1..BRANCHES).map(|_| ctx.new_stream()).collect::<Result<_, _>>()?;
        // TURBOSPARK_NO_PDL: a measurement knob (launches without programmatic dependence).
        let dependent_launch = arch.0 >= 9 && std::env::var_os("TURBOSPARK_NO_PDL").is_none();
        let branches = if std::env::var_os("TURBOSPARK_NO_BRANCHES").is_some() { 1 } else { BRANCHES };
        Ok(Gpu {
            ctx,
            stream,
            funcs,
            name,
            arch,
            dependent_launch,
            side,
            on: Default::default(),
            branches,
            transfers: Default::default(),
        })
    }

    /// Makes side stream `i` (1 to `BRANCHES - 1`) wait for what `stream` has queued.
    pub fn fork(&self, i: usize) -> Result<(), CudaError> {
        Ok(self.side[i - 1].join(&self.stream)?)
    }

    /// Makes `stream` wait for what side stream `i` has queued.
    pub fn join(&self, i: usize) -> Result<(), CudaError> {
        Ok(self.stream.join(&self.side[i - 1])?)
    }

    /// Sends the launches that follow to stream `i`: 0 `stream`, else side stream i.
    pub fn launch_on(&self, i: usize) {
        self.on.store(i, std::sync::atomic::Ordering::Relaxed);
    }

    /// The stream launches go to now.
    fn launch_stream(&self) -> &CudaStream {
        match self.on.load(std::sync::atomic::Ordering::Relaxed) {
            0 => &self.stream,
            i => &self.side[i - 1],
        }
    }

    pub fn func(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.funcs.get(name).ok_or_else(|| CudaError::Driver(format!("no kernel named {name}")))
    }

    /// Launches kernel `name` on the stream.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        let f = self.func(name)?;
        let mut vals: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) => p,
                Arg::I32(v) => v as u32 as u64,
                Arg::I64(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        // Each parameter is read from the start of its 8-byte cell (little-endian).
        let mut params: Vec<*mut c_void> = vals.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        self.launch_raw(name, f, grid, block, smem, &mut params)
    }

    /// Launches kernel `name`, whose one parameter is the `#[repr(C)]` struct `params`, on
    /// `stream` (one of this context's, not a launch stream: the expert tier's copy stream),
    /// in stream order, without programmatic dependence.
    pub fn launch_on_stream<P: Copy>(
        &self,
        stream: &CudaStream,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        params: &P,
    ) -> Result<(), CudaError> {
        self.launch_struct(name, &LaunchShape { grid, block, smem, stream, dependent: false }, params)
    }

    /// Launches kernel `name`, whose one parameter is the `#[repr(C)]` struct `params`
    /// (laid out as the kernel's C struct).
    pub fn launch_with<P: Copy>(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        params: &P,
    ) -> Result<(), CudaError> {
        self.launch_struct(name, &self.on_launch_stream(grid, block, 0), params)
    }

    /// Launches kernel `name` with the one struct parameter `params` as `launch` says.
    fn launch_struct<P: Copy>(&self, name: &str, launch: &LaunchShape<'_>, params: &P) -> Result<(), CudaError> {
        let f = self.func(name)?;
        let mut value = *params;
        let mut args = [&mut value as *mut P as *mut c_void];
        self.launch_shaped(name, f, launch, &mut args)
    }

    /// Launches `f` with `params` (pointers to each parameter's value) on the launch stream;
    /// where the device allows, the kernel may be scheduled before the previous one on the
    /// stream ends (every kernel begins with launch.cuh's `ts_grid_begin`, which waits for it).
    fn launch_raw(
        &self,
        name: &str,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        self.launch_shaped(name, f, &self.on_launch_stream(grid, block, smem), params)
    }

    /// A launch on the launch stream, dependent on its previous kernel where the device allows.
    fn on_launch_stream(&self, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32) -> LaunchShape<'_> {
        LaunchShape { grid, block, smem, stream: self.launch_stream(), dependent: self.dependent_launch }
    }

    /// Launches `f` with `params` as `launch` says.
    fn launch_shaped(
        &self,
        name: &str,
        f: &CudaFunction,
        launch: &LaunchShape<'_>,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: launch.grid.0,
            gridDimY: launch.grid.1,
            gridDimZ: launch.grid.2,
            blockDimX: launch.block.0,
            blockDimY: launch.block.1,
            blockDimZ: launch.block.2,
            sharedMemBytes: launch.smem,
            hStream: launch.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: launch.dependent as u32,
        };
        // SAFETY: `params` holds one pointer per kernel parameter, alive for the call.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| CudaError::Driver(format!("launching {name}: {e}")))
    }

    /// A 1-D grid-stride launch over `n` elements.
    pub fn launch_1d(&self, name: &str, n: usize, args: &[Arg]) -> Result<(), CudaError> {
        let blocks = n.div_ceil(256).clamp(1, 65_535) as u32;
        self.launch(name, (blocks, 1, 1), (256, 1, 1), 0, args)
    }

    pub fn alloc<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        Ok(unsafe { self.stream.alloc::<T>(n.max(1)) }?)
    }

    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }

    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.transfers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if data.is_empty() {
            return self.alloc(1);
        }
        Ok(self.stream.clone_htod(data)?)
    }

    pub fn sync(&self) -> Result<(), CudaError> {
        self.transfers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.stream.synchronize()?)
    }

    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    pub fn ptr_mut<T>(&self, s: &mut CudaSlice<T>) -> u64 {
        s.device_ptr_mut(&self.stream).0
    }

    /// Free and total device memory, bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        Ok(self.ctx.mem_get_info()?)
    }
}

/// The device's primary context with every kernel loaded: compiled once per
/// process and device, shared by every `Gpu` opened on it.
type Loaded = (Arc<CudaContext>, Arc<HashMap<String, CudaFunction>>);

/// Keeps memory freed back to the device's default pool mapped for the next allocation. Steps
/// of several rows allocate their activations from that pool (stream-ordered), and with the
/// driver's default threshold of 0 each synchronization (a step's logits download) hands the
/// freed memory back to the driver, so the next step maps it again.
fn keep_freed_memory(ctx: &CudaContext) -> Result<(), CudaError> {
    use cudarc::driver::{result, sys};
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let mut threshold = u64::MAX;
    // SAFETY: the device is the context's; the attribute takes a u64.
    unsafe {
        let pool = result::device::get_default_mem_pool(ctx.cu_device())?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )?;
    }
    Ok(())
}

fn loaded(ordinal: usize) -> Result<Loaded, CudaError> {
    static LOADED: std::sync::Mutex<Vec<(usize, Loaded)>> = std::sync::Mutex::new(Vec::new());
    let mut all = LOADED.lock().expect("kernel cache lock");
    if let Some((_, l)) = all.iter().find(|(o, _)| *o == ordinal) {
        return Ok(l.clone());
    }
    let ctx = CudaContext::new(ordinal)?;
    // One stream, ordered: no per-buffer events needed.
    unsafe { ctx.disable_event_tracking() };
    keep_freed_memory(&ctx)?;
    let ptx = compile(ctx.compute_capability()?)?;
    let names = ptx_entries(&ptx.to_src());
    let module = ctx.load_module(ptx)?;
    let mut funcs = HashMap::new();
    for entry in names {
        funcs.insert(entry.clone(), module.load_function(&entry)?);
    }
    let l = (ctx, Arc::new(funcs));
    all.push((ordinal, l.clone()));
    Ok(l)
}

/// The whole kernel source: the headers inlined where matmul.cu includes them.
pub fn kernel_source() -> String {
    let matmul = MATMUL_CU
        .replace("#include \"launch.cuh\"", LAUNCH_CUH)
        .replace("#include \"activation.cuh\"", ACTIVATION_CUH)
        .replace("#include \"quant.cuh\"", QUANT_CUH);
    let matvec_q8 = MATVEC_Q8_CU.replace("#include \"vdot.cuh\"", &VDOT_CUH.replace("#include \"quant.cuh\"", ""));
    format!("{matmul}\n{matvec_q8}\n{MOE_MM_Q8_CU}\n{OPS_CU}\n{ATTENTION_CU}\n{MOE_CU}\n{DELTA_NET_CU}\n")
}

/// NVRTC for the device's architecture (`sm_XY`).
fn compile(arch: (i32, i32)) -> Result<cudarc::nvrtc::Ptx, CudaError> {
    let arch_name: &'static str = Box::leak(format!("sm_{}{}", arch.0, arch.1).into_boxed_str());
    compile_for(arch_name)
}

/// Compiles every kernel for `arch` (e.g. `sm_90`).
pub fn compile_for(arch: &'static str) -> Result<cudarc::nvrtc::Ptx, CudaError> {
    let src = kernel_source();
    let mut options = vec!["--std=c++17".to_string()];
    options.extend(kernel_defines());
    let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), options, ..Default::default() };
    guard("loading NVRTC", || cudarc::nvrtc::compile_ptx_with_opts(src, opts))?
        .map_err(|e| CudaError::Compile(e.to_string()))
}

/// The kernels' `-D` options: the measurement knobs' variants (`TURBOSPARK_NVRTC_DEFINES`, e.g.
/// "TS_WORD_NO_L1 TS_Q8_UNROLL=4") and decode attention's tile.
pub fn kernel_defines() -> Vec<String> {
    let mut options: Vec<String> = std::env::var("TURBOSPARK_NVRTC_DEFINES")
        .map(|d| d.split_whitespace().map(|d| format!("-D{d}")).collect())
        .unwrap_or_default();
    // A tile named among the defines stays theirs (a second -D would redefine it).
    if !options.iter().any(|d| d.starts_with("-DATTN_TILE")) {
        options.push(format!("-DATTN_TILE={}", attention_tile()));
    }
    if !options.iter().any(|d| d.starts_with("-DATTN_WARPS")) {
        options.push(format!("-DATTN_WARPS={}", attention_warps()));
    }
    options
}

/// The N of `{name}=N` among `TURBOSPARK_NVRTC_DEFINES`, which the kernels are compiled
/// with: the launches then follow it.
fn defined(name: &str) -> Option<usize> {
    let defines = std::env::var("TURBOSPARK_NVRTC_DEFINES").ok()?;
    defines.split_whitespace().find_map(|d| d.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
}

/// A measurement knob: the number in environment variable `name` where it is one of `allowed`
/// (any where `allowed` is empty), else `default`.
fn knob(name: &str, allowed: &[usize], default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|v| allowed.is_empty() || allowed.contains(v))
        .unwrap_or(default)
}

/// Positions decode attention scores at once, and a run's share of a split cache (attention.cu's
/// ATTN_TILE): 128, or `TURBOSPARK_ATTN_TILE` (32, 64, 128 or 256), a measurement knob (an
/// ATTN_TILE among `TURBOSPARK_NVRTC_DEFINES` wins).
pub fn attention_tile() -> usize {
    static TILE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *TILE.get_or_init(|| defined("ATTN_TILE").unwrap_or_else(|| knob("TURBOSPARK_ATTN_TILE", &[32, 64, 128, 256], 128)))
}

/// Warps of a decode attention block (attention.cu's ATTN_WARPS): 16, or `TURBOSPARK_ATTN_WARPS`
/// (2, 4, 8 or 16), a measurement knob (an ATTN_WARPS among `TURBOSPARK_NVRTC_DEFINES` wins).
pub fn attention_warps() -> usize {
    static WARPS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *WARPS.get_or_init(|| defined("ATTN_WARPS").unwrap_or_else(|| knob("TURBOSPARK_ATTN_WARPS", &[2, 4, 8, 16], 16)))
}

/// Threads of a `norm_router_route` block (and of `router_route`'s) for a router of
/// `n_expert` rows: 256 for at most 64 experts (each block a longer share of the row), else
/// 128; or `TURBOSPARK_ROUTER_THREADS` (64, 128, 256 or 512), a measurement knob. (H100,
/// 2026-12-06: gpt-oss-20b's 32 experts decoded 1.2% faster with 256, qwen3-30b-a3b's 128
/// 2.4% slower; docs/BENCHMARKS.md.)
pub fn router_threads(n_expert: usize) -> u32 {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let set = *THREADS.get_or_init(|| knob("TURBOSPARK_ROUTER_THREADS", &[64, 128, 256, 512], 0));
    match set {
        0 if n_expert <= 64 => 256,
        0 => 128,
        n => n as u32,
    }
}

/// Elements an `rms_norm` thread takes (its block has `width / this` threads, 32 to 1,024): 2,
/// or `TURBOSPARK_NORM_ELEMENTS` (1, 2 or 4), a measurement knob (ops.cu holds at most 4 in
/// registers). (H100, 2026-12-06: qwen3-30b-a3b decoded 1.1% faster with 2 than with 4,
/// gpt-oss-20b level; docs/BENCHMARKS.md.)
pub fn norm_elements() -> usize {
    static ELEMENTS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ELEMENTS.get_or_init(|| knob("TURBOSPARK_NORM_ELEMENTS", &[1, 2, 4], 2))
}

/// Runs a split decode attention takes at most: `most` (attention.rs's MAX_SPLIT), or fewer
/// with `TURBOSPARK_ATTN_MAX_SPLIT` (1 to `most`), a measurement knob.
pub fn attention_max_split(most: usize) -> usize {
    static SPLIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    (*SPLIT.get_or_init(|| knob("TURBOSPARK_ATTN_MAX_SPLIT", &[], most))).clamp(1, most)
}

/// Query heads of one KV head a decode attention block takes at most (each key and value read
/// once for them): 8, or `TURBOSPARK_ATTN_HEADS` (1, 2, 4 or 8), a measurement knob.
pub fn attention_heads() -> usize {
    static HEADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *HEADS.get_or_init(|| knob("TURBOSPARK_ATTN_HEADS", &[1, 2, 4, 8], 8))
}

/// Positions a row sees from which a decode attention block takes several query heads of one
/// KV head (below them, one block a head: more blocks at work on short rows): 1,024, or
/// `TURBOSPARK_ATTN_GROUP_FROM`, a measurement knob.
pub fn attention_group_from() -> usize {
    static FROM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *FROM.get_or_init(|| knob("TURBOSPARK_ATTN_GROUP_FROM", &[], 1024))
}

/// Names of the kernels (`.entry NAME(`) in PTX text.
pub fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let rest = &l[l.find(".entry ")? + ".entry ".len()..];
            let name = rest.split(['(', ' ']).next()?.trim();
            (!name.is_empty()).then(|| name.to_string())
        })
        .collect()
}
