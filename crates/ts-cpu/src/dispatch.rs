//! Instruction set detection, kernel choice per weight type, and the split of a matmul into
//! rayon tasks over runs of weight rows.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

use ts_gguf::GgmlType;

use crate::CpuError;
use crate::activations::{ActView, QuantizedRows};

/// The kernels' instruction set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// ts-quant's scalar reference code; works everywhere.
    Scalar,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX2 kernels plus AVX-512 (F, BW, VL) with VNNI: `vpdpbusd` dot products and
    /// interleaved weight panels for batches.
    Avx512,
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "AVX2",
            Isa::Avx512 => "AVX-512 VNNI",
        })
    }
}

impl Isa {
    /// The best instruction set this CPU has (detected once).
    pub fn detect() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| [Isa::Avx512, Isa::Avx2].into_iter().find(|isa| isa.is_available()).unwrap_or(Isa::Scalar))
    }

    /// Whether this CPU can run the kernels of `self`.
    pub fn is_available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2,
                Isa::Avx512 => {
                    avx2 && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512vnni")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }
}

/// `--decode-prefetch`: whether a one-row product's packed passes ask for the weights ahead of
/// their reads (software prefetch). 0: by processor and format ([`decode_asks_ahead`]), 1: every
/// pass asks, 2: none does.
static DECODE_PREFETCH: AtomicU8 = AtomicU8::new(0);

/// Sets `--decode-prefetch` for the process: `Some(true)` every packed pass asks for the weights
/// ahead in decode, `Some(false)` none does, `None` the processor and the format decide.
pub fn set_decode_prefetch(ask: Option<bool>) {
    DECODE_PREFETCH.store(
        match ask {
            None => 0,
            Some(true) => 1,
            Some(false) => 2,
        },
        Ordering::Relaxed,
    );
}

/// What [`decode_asks_ahead`] does now, in words (for the load's report).
pub fn decode_prefetch_text() -> &'static str {
    match DECODE_PREFETCH.load(Ordering::Relaxed) {
        1 => "every packed format asks for its weights ahead (--decode-prefetch on)",
        2 => "no packed format asks for its weights ahead (--decode-prefetch off)",
        _ if intel_processor() => {
            "every packed format asks for its weights ahead (an Intel processor; --decode-prefetch)"
        }
        _ if Isa::detect() == Isa::Avx2 => {
            "every packed format asks for its weights ahead (the AVX2 passes; --decode-prefetch)"
        }
        _ => {
            "MXFP4 and the 32-element formats ask for their weights ahead, K-quants and Q8_0 do not (not an Intel processor; --decode-prefetch)"
        }
    }
}

/// Whether a one-row product's pass asks for the weights ahead, for a format whose own choice
/// is `format_asks` (the tile macros' `decode_ahead`), unless `--decode-prefetch` says. Intel
/// processors ask in every format: on a 16-core Xeon (read 12 GB/s on one thread) qwen3-30b-a3b's
/// K-quant decode ran 1.43x faster at one thread and 1.18x at 16 with it; on an AMD Zen 4 the
/// K-quant and Q8_0 passes were level or 3-12% faster without, and MXFP4 and the legacy formats
/// faster with (docs/BENCHMARKS.md, 2026-12-07). The AVX2 passes (no AVX-512) all ask by their
/// own choice (their Q8_0 without was level in the models, 2026-12-08).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn decode_asks_ahead(format_asks: bool) -> bool {
    match DECODE_PREFETCH.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => format_asks || intel_processor(),
    }
}

/// Whether this is an Intel processor (CPUID's vendor string), read once.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn intel_processor() -> bool {
    static INTEL: OnceLock<bool> = OnceLock::new();
    *INTEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: CPUID leaf 0 exists on every x86-64 processor.
            #[allow(unused_unsafe)]
            let id = unsafe { std::arch::x86_64::__cpuid(0) };
            // The vendor string is in ebx, edx, ecx: "Genu", "ineI", "ntel".
            [id.ebx, id.edx, id.ecx] == [0x756e_6547, 0x4965_6e69, 0x6c65_746e]
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// A kernel: dot products of the weight rows in `w` (`row_bytes` each) with every activation
/// row, `out[c][r]` for activation row `c` and weight row `r`. The caller guarantees
/// `out.len() == x.m`, equal lengths `rows` of the `out` slices, `w.len() >= rows * row_bytes`,
/// and that the CPU has the kernel's instruction set.
pub(crate) type TileFn = unsafe fn(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]);

/// SIMD kernels for one weight type.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Kernels {
    /// Weight rows straight from their blocks; for decoding and small batches.
    direct: TileFn,
    /// Weight rows unpacked into interleaved panels first, and the smallest batch to use them for.
    panel: Option<(TileFn, usize)>,
    /// Weight rows repacked once by the first ([`pack`]), and the kernel for them, for any batch.
    packed: Option<(PackFn, TileFn)>,
}

/// Repacks whole panels of weight rows of `row_bytes` in place for a packed kernel. The caller
/// guarantees the kernel's instruction set and whole panels.
pub(crate) type PackFn = unsafe fn(w: &mut [u8], row_bytes: usize);

/// How weight rows are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// As in the GGUF file.
    Gguf,
    /// Repacked by [`pack`].
    Packed,
}

/// Whether [`pack`] repacks `n_out` rows of `ty` for `isa`: MXFP4, Q4_K, Q4_0, Q4_1, Q5_0 and
/// Q8_0 on AVX2 and AVX-512 VNNI, and Q6_K on AVX-512 VNNI, in whole multiples of 16 rows.
pub(crate) fn packs(isa: Isa, ty: GgmlType, n_out: usize) -> bool {
    packer(isa, ty, n_out).is_some()
}

/// The repacking of `ty` for `isa`'s packed kernel, where the CPU has that instruction set and
/// `n_out` rows fill whole panels.
fn packer(isa: Isa, ty: GgmlType, n_out: usize) -> Option<PackFn> {
    let packed = kernels(isa, ty)?.packed?;
    (isa.is_available() && n_out.is_multiple_of(PANEL_ROWS)).then_some(packed.0)
}

/// Reads one row's GGUF block back from a packed block: `(ty, packed block, row, out)`, false
/// for a type whose packing it does not read back.
pub(crate) type PackedRowFn = fn(GgmlType, &[u8], usize, &mut [u8]) -> bool;

/// The rows per packed panel of `isa` and the reader of single rows from its packed blocks
/// (Q4_0, Q4_1, Q5_0, Q8_0 and MXFP4), where `isa` packs.
pub(crate) fn packed_row_reader(isa: Isa) -> Option<(usize, PackedRowFn)> {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::{panel, panel_avx2};
        match isa {
            Isa::Avx512 => Some((panel::ROWS, panel::gguf_block_of_packed as PackedRowFn)),
            Isa::Avx2 => Some((panel_avx2::ROWS, panel_avx2::gguf_block_of_packed as PackedRowFn)),
            Isa::Scalar => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        None
    }
}

/// Repacks `w` (`n_out` rows of `ty`, `k` elements each) in place for the `Packed` layout, if
/// [`packs`] says so; returns whether it did.
pub(crate) fn pack(isa: Isa, ty: GgmlType, w: &mut [u8], n_out: usize, k: usize) -> Result<bool, CpuError> {
    let row_bytes = checked_row_bytes(ty, w.len(), n_out, k)?;
    let Some(pack) = packer(isa, ty, n_out) else { return Ok(false) };
    // SAFETY: `packer` checked that the instruction set is available and the rows are whole
    // panels of `ty`, whose blocks `row_bytes` holds.
    unsafe { pack(w, row_bytes) };
    Ok(true)
}

/// Bytes of a row of `k` elements of `ty`, where `k` is whole blocks and `w_len` bytes hold
/// exactly `n_out` such rows.
pub(crate) fn checked_row_bytes(ty: GgmlType, w_len: usize, n_out: usize, k: usize) -> Result<usize, CpuError> {
    let block = ty.block_size() as usize;
    if k == 0 || !k.is_multiple_of(block) {
        return Err(CpuError::PartialBlock { ty, k, block_size: block });
    }
    let row_bytes = k / block * ty.type_size() as usize;
    if w_len != n_out.saturating_mul(row_bytes) {
        return Err(CpuError::WrongLength { what: "weights (bytes)", expected: n_out * row_bytes, actual: w_len });
    }
    Ok(row_bytes)
}

/// Rows per panel-kernel tile; tiles hold whole panels.
#[cfg(target_arch = "x86_64")]
const PANEL_ROWS: usize = crate::panel::ROWS;
#[cfg(not(target_arch = "x86_64"))]
const PANEL_ROWS: usize = 8;

/// A matmul checked and split into tasks of `rows_per_task` weight rows (the last may be
/// shorter), each run by [`Plan::run`].
struct Plan<'a> {
    tile: Option<TileFn>,
    weight_ty: GgmlType,
    w: &'a [u8],
    row_bytes: usize,
    n_out: usize,
    rows_per_task: usize,
    view: ActView<'a>,
}

impl Plan<'_> {
    fn tasks(&self) -> usize {
        self.n_out.div_ceil(self.rows_per_task)
    }

    /// Task `task`'s rows of every activation row: `outs[c]` holds that task's outputs of row c.
    fn run(&self, task: usize, outs: &mut [&mut [f32]]) {
        let w = &self.w[task * self.rows_per_task * self.row_bytes..];
        match self.tile {
            // SAFETY: `plan` only hands out kernels of an instruction set it checked to be
            // available, and callers give one output slice per activation row, all of the
            // task's length, with at least that many weight rows left in `w`.
            Some(tile) => unsafe { tile(w, self.row_bytes, &self.view, outs) },
            None => scalar_tile(self.weight_ty, w, self.row_bytes, &self.view, outs),
        }
    }
}

/// Checks a matmul's operands and chooses its kernel and split; None when it has no work.
#[allow(clippy::too_many_arguments)]
fn plan<'a>(
    isa: Isa,
    weight_ty: GgmlType,
    w: &'a [u8],
    n_out: usize,
    k: usize,
    x: &'a QuantizedRows,
    out_len: usize,
    out_stride: usize,
    panels: bool,
    layout: Layout,
) -> Result<Option<Plan<'a>>, CpuError> {
    if !isa.is_available() {
        return Err(CpuError::IsaUnavailable(isa));
    }
    if layout == Layout::Packed && !packs(isa, weight_ty, n_out) {
        return Err(CpuError::NotPacked { ty: weight_ty, n_out, isa });
    }
    let act_ty = crate::activation_type(weight_ty)?;
    let block = weight_ty.block_size() as usize;
    if k == 0 || !k.is_multiple_of(block) {
        return Err(CpuError::PartialBlock { ty: weight_ty, k, block_size: block });
    }
    if x.ty() != act_ty || x.k() != k {
        return Err(CpuError::Activations { weight_ty, k, expected: act_ty, actual: x.ty(), actual_k: x.k() });
    }
    let row_bytes = k / block * weight_ty.type_size() as usize;
    let w_bytes = n_out.saturating_mul(row_bytes);
    if w.len() != w_bytes {
        return Err(CpuError::WrongLength { what: "weights (bytes)", expected: w_bytes, actual: w.len() });
    }
    if out_stride < n_out {
        return Err(CpuError::Stride { stride: out_stride, n_out });
    }
    let m = x.m();
    let needed = if m == 0 { Some(0) } else { (m - 1).checked_mul(out_stride).and_then(|v| v.checked_add(n_out)) };
    let needed = needed.unwrap_or(usize::MAX);
    if out_len < needed {
        return Err(CpuError::WrongLength { what: "output (floats)", expected: needed, actual: out_len });
    }
    if m == 0 || n_out == 0 {
        return Ok(None);
    }
    let (tile, rows_per_task) = match kernels(isa, weight_ty) {
        Some(Kernels { packed: Some((_, packed)), .. }) if layout == Layout::Packed => {
            let rows =
                if m == 1 { direct_rows_per_task(n_out, row_bytes, m) } else { panel_rows_per_task(n_out, m, k) };
            (Some(packed), rows.next_multiple_of(PANEL_ROWS))
        }
        Some(Kernels { panel: Some((panel, min_batch)), .. }) if panels && m >= min_batch => {
            (Some(panel), panel_rows_per_task(n_out, m, k))
        }
        Some(kernels) => (Some(kernels.direct), direct_rows_per_task(n_out, row_bytes, m)),
        None => (None, direct_rows_per_task(n_out, row_bytes, m)),
    };
    Ok(Some(Plan { tile, weight_ty, w, row_bytes, n_out, rows_per_task, view: x.view() }))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    isa: Isa,
    weight_ty: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &QuantizedRows,
    out: &mut [f32],
    out_stride: usize,
    panels: bool,
    layout: Layout,
) -> Result<(), CpuError> {
    let Some(plan) = plan(isa, weight_ty, w, n_out, k, x, out.len(), out_stride, panels, layout)? else {
        return Ok(());
    };
    let rows_per_task = plan.rows_per_task;
    if x.m() == 1 {
        crate::team::for_each_chunk(&mut out[..n_out], rows_per_task, &|task, out| {
            crate::work_time::task(|| plan.run(task, &mut [out]))
        });
    } else {
        // Each task makes its own pieces of the output rows (columns `start..start + rows` of
        // each), so that no thread lays them all out first.
        let (m, base) = (x.m(), OutPtr(out.as_mut_ptr()));
        let base = &base;
        crate::team::for_each(plan.tasks(), &|task| {
            let start = task * rows_per_task;
            let rows = rows_per_task.min(n_out - start);
            // SAFETY: `out` holds `(m - 1) * out_stride + n_out` floats (checked by `plan`) and
            // is borrowed mutably for this call; task `task` alone takes these columns of each row.
            let mut outs: Vec<&mut [f32]> = (0..m)
                .map(|c| unsafe { std::slice::from_raw_parts_mut(base.0.add(c * out_stride + start), rows) })
                .collect();
            crate::work_time::task(|| plan.run(task, &mut outs))
        });
    }
    Ok(())
}

/// One product of [`matvecs`]: `out = w · x` for the single activation row of `x`.
pub struct Matvec<'a> {
    pub weight_ty: GgmlType,
    /// `n_out` rows of `k` elements, in the GGUF layout or (with `packed`) repacked by
    /// [`crate::pack_rows`].
    pub w: &'a [u8],
    pub n_out: usize,
    pub k: usize,
    pub packed: bool,
    /// One row, quantized for `weight_ty`.
    pub x: &'a QuantizedRows,
    /// `[n_out]`.
    pub out: &'a mut [f32],
}

/// A product's output, handed across threads: its tasks write disjoint runs of it.
struct OutPtr(*mut f32);
// SAFETY: each task writes only its own runs (see `matvecs` and `matmul`).
unsafe impl Sync for OutPtr {}

/// Several one-row products in one parallel region instead of one region each: each product's
/// tasks (runs of weight rows, as [`matmul`] splits them) in one contiguous run per thread,
/// each thread's runs of all the products in its share of the region. Each output row equals
/// what [`matmul`] gives for that product.
pub(crate) fn matvecs(isa: Isa, products: &mut [Matvec<'_>]) -> Result<(), CpuError> {
    let mut plans = Vec::with_capacity(products.len());
    let mut outs = Vec::with_capacity(products.len());
    for p in products.iter_mut() {
        if p.x.m() != 1 {
            return Err(CpuError::WrongLength { what: "activation rows of a matvec", expected: 1, actual: p.x.m() });
        }
        let layout = if p.packed { Layout::Packed } else { Layout::Gguf };
        let plan = plan(isa, p.weight_ty, p.w, p.n_out, p.k, p.x, p.out.len(), p.n_out, false, layout)?;
        if let Some(plan) = plan {
            plans.push(plan);
            outs.push(OutPtr(p.out.as_mut_ptr()));
        }
    }
    let runs = runs_by_thread(plans.len(), |i| plans[i].tasks(), 1);
    crate::team::for_each(runs.len(), &|run| {
        let (i, tasks) = &runs[run];
        let plan = &plans[*i];
        crate::work_time::task(|| {
            for task in tasks.clone() {
                let start = task * plan.rows_per_task;
                let rows = plan.rows_per_task.min(plan.n_out - start);
                // SAFETY: `outs[i]` points at product i's `n_out` floats, borrowed mutably for
                // this call; task `task` alone writes `start..start + rows` of them.
                let out = unsafe { std::slice::from_raw_parts_mut(outs[*i].0.add(start), rows) };
                plan.run(task, &mut [out]);
            }
        })
    });
    Ok(())
}

/// The gate and up products of one row for one gated FFN (a dense one, or one routed expert)
/// in [`gated_matvecs`].
pub struct GatedMatvec<'a> {
    /// `gate.out` receives the hidden `[n_ff]`.
    pub gate: Matvec<'a>,
    /// `up.out` `[n_ff]` holds up's rows after the call.
    pub up: Matvec<'a>,
    /// Down's weight type and its activations: the hidden quantized for it.
    pub down: Option<(GgmlType, &'a mut QuantizedRows)>,
}

/// What a [`gated_matvecs`] task does with its rows of one pair's gate and up products:
/// `finish(pair, start, gate_rows, up_rows)` leaves the hidden of rows `start..` in `gate_rows`.
pub type FinishHidden<'f> = dyn Fn(usize, usize, &mut [f32], &mut [f32]) + Sync + 'f;

/// Gate and up products of one row for several gated FFNs in one parallel region, each task
/// taking the same rows of a pair's gate and up, finishing them into the hidden (`finish`) and,
/// where down's activations come in blocks of 32, quantizing them for down on the same
/// thread: no pass of the caller's thread over the outputs that the region's threads wrote
/// (at 16 threads each of their lines comes back from the core that wrote it). Down's
/// activations in blocks of 256 (Q8_K) are quantized after the region (tasks of 256 rows would
/// leave threads idle). Each float as [`matvecs`] and the activation one after the other give it.
pub(crate) fn gated_matvecs(
    isa: Isa,
    pairs: &mut [GatedMatvec<'_>],
    finish: &FinishHidden<'_>,
) -> Result<(), CpuError> {
    struct Pair<'a> {
        /// Its place in `pairs`, for `finish`.
        index: usize,
        gate: Plan<'a>,
        up: Plan<'a>,
        g: OutPtr,
        u: OutPtr,
        down: Option<crate::activations::RowRuns<'a>>,
    }
    let mut planned = Vec::with_capacity(pairs.len());
    let mut after = Vec::new();
    for (i, p) in pairs.iter_mut().enumerate() {
        let (gate, up) = (&mut p.gate, &mut p.up);
        if gate.x.m() != 1 || up.x.m() != 1 {
            return Err(CpuError::WrongLength {
                what: "activation rows of a matvec",
                expected: 1,
                actual: gate.x.m().max(up.x.m()),
            });
        }
        if gate.n_out != up.n_out {
            return Err(CpuError::WrongLength {
                what: "up's rows beside gate's",
                expected: gate.n_out,
                actual: up.n_out,
            });
        }
        let layout = |packed| if packed { Layout::Packed } else { Layout::Gguf };
        let g = plan(
            isa,
            gate.weight_ty,
            gate.w,
            gate.n_out,
            gate.k,
            gate.x,
            gate.out.len(),
            gate.n_out,
            false,
            layout(gate.packed),
        )?;
        let u = plan(isa, up.weight_ty, up.w, up.n_out, up.k, up.x, up.out.len(), up.n_out, false, layout(up.packed))?;
        let (Some(mut g), Some(mut u)) = (g, u) else { continue };
        let down = match p.down.as_mut() {
            Some((ty, q)) => {
                let runs = q.row_runs(isa, *ty, gate.n_out)?;
                if runs.is_none() {
                    after.push(i);
                }
                runs
            }
            None => None,
        };
        // One split for both (rows a multiple of each kernel's, and of down's blocks).
        let granule = |packed: bool| if packed { PANEL_ROWS } else { 4 };
        let mut rows =
            g.rows_per_task.max(u.rows_per_task).next_multiple_of(granule(gate.packed).max(granule(up.packed)));
        if down.is_some() {
            rows = rows.next_multiple_of(crate::activations::RowRuns::BLOCK);
        }
        (g.rows_per_task, u.rows_per_task) = (rows, rows);
        planned.push(Pair {
            index: i,
            gate: g,
            up: u,
            g: OutPtr(gate.out.as_mut_ptr()),
            u: OutPtr(up.out.as_mut_ptr()),
            down,
        });
    }
    // Each thread's run of a pair in two items: it is the work of two products' runs in
    // `matvecs`, and a thread done early takes half of one.
    let runs = runs_by_thread(planned.len(), |i| planned[i].gate.tasks(), 2);
    let failed = std::sync::Mutex::new(None);
    crate::team::for_each(runs.len(), &|run| {
        let (i, tasks) = &runs[run];
        let pair = &planned[*i];
        crate::work_time::task(|| {
            for task in tasks.clone() {
                let start = task * pair.gate.rows_per_task;
                let rows = pair.gate.rows_per_task.min(pair.gate.n_out - start);
                // SAFETY: `g` and `u` point at the pair's `n_out` floats each, borrowed mutably
                // for this call; task `task` alone writes `start..start + rows` of them.
                let (g, u) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(pair.g.0.add(start), rows),
                        std::slice::from_raw_parts_mut(pair.u.0.add(start), rows),
                    )
                };
                pair.gate.run(task, &mut [&mut *g]);
                pair.up.run(task, &mut [&mut *u]);
                finish(pair.index, start, g, u);
                if let Some(down) = &pair.down {
                    // SAFETY: this task alone takes these rows, whole blocks of them (rows
                    // per task a multiple of the block; the last task ends the row).
                    if let Err(e) = unsafe { down.quantize(start, g) } {
                        failed.lock().expect("gated_matvecs lock").get_or_insert(e);
                    }
                }
            }
        })
    });
    if let Some(e) = failed.into_inner().expect("gated_matvecs lock") {
        return Err(e);
    }
    drop(planned);
    for i in after {
        let p = &mut pairs[i];
        if let Some((ty, q)) = p.down.as_mut() {
            q.quantize_with_isa(isa, *ty, p.gate.out, p.gate.n_out)?;
        }
    }
    Ok(())
}

/// The items of a region over `products` products (`tasks(i)` tasks of product i): each product's
/// tasks in one contiguous run per thread, cut into `pieces` items, `(product, tasks)`. The
/// items are ordered by thread, so that the team's contiguous shares give each thread its run of
/// every product (its own part of each matrix, as one region per product would), and a thread
/// done early takes others' items from the backs of their shares: no counter that every thread
/// takes items from.
fn runs_by_thread(
    products: usize,
    tasks: impl Fn(usize) -> usize,
    pieces: usize,
) -> Vec<(usize, std::ops::Range<usize>)> {
    let threads = rayon::current_num_threads();
    let mut runs = Vec::new();
    for r in 0..threads {
        for i in 0..products {
            let t = tasks(i);
            let n = threads.min(t);
            if r >= n {
                continue;
            }
            let (start, end) = (r * t / n, (r + 1) * t / n);
            let piece = (end - start).div_ceil(pieces).max(1);
            runs.extend((start..end).step_by(piece).map(|s| (i, s..(s + piece).min(end))));
        }
    }
    runs
}

/// Rows per task for the direct kernels: about 32 KiB of weights (a multiple of 4 rows), but
/// at least 4 tasks per thread, and a little less for batches (each row is reused `m` times).
fn direct_rows_per_task(n_out: usize, row_bytes: usize, m: usize) -> usize {
    let threads = rayon::current_num_threads();
    let by_bytes = (32 * 1024 / (row_bytes * m.min(4))).max(4);
    let by_balance = n_out.div_ceil(4 * threads);
    by_bytes.min(by_balance).max(4).next_multiple_of(4)
}

/// Rows per task for the panel kernels: whole panels, enough work per task to hide rayon's
/// overhead, and at least 4 tasks per thread where the matrix allows it.
fn panel_rows_per_task(n_out: usize, m: usize, k: usize) -> usize {
    let threads = rayon::current_num_threads();
    let by_work = (4 * 1024 * 1024 / (m * k).max(1)).max(PANEL_ROWS);
    let by_balance = n_out.div_ceil(4 * threads);
    by_work.min(by_balance).max(PANEL_ROWS).next_multiple_of(PANEL_ROWS)
}

fn kernels(isa: Isa, ty: GgmlType) -> Option<Kernels> {
    #[cfg(target_arch = "x86_64")]
    return x86::kernels(isa, ty);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, ty);
        None
    }
}

/// The portable kernel: ts-quant's reference dot product per pair of rows (float weights
/// against f32 activations in f64).
fn scalar_tile(ty: GgmlType, w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
    let rows = out.first().map_or(0, |o| o.len());
    let float = matches!(ty, GgmlType::F16 | GgmlType::BF16);
    let mut aligned: Vec<u64> = Vec::new();
    let mut dequantized = Vec::new();
    for r in 0..rows {
        let mut row = &w[r * row_bytes..(r + 1) * row_bytes];
        // ts-quant views blocks in place and needs their alignment (2 bytes at most here).
        if !(row.as_ptr() as usize).is_multiple_of(2) {
            aligned.resize(row_bytes.div_ceil(8), 0);
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut aligned);
            bytes[..row_bytes].copy_from_slice(row);
            row = &bytemuck::cast_slice::<u64, u8>(&aligned)[..row_bytes];
        }
        if !float {
            for (c, out) in out.iter_mut().enumerate() {
                let a = &x.bytes[c * x.row_bytes..(c + 1) * x.row_bytes];
                out[r] = ts_quant::vec_dot(ty, row, a).unwrap_or(f32::NAN);
            }
        } else {
            dequantized.resize(x.nb, 0.0);
            if ts_quant::dequantize(ty, row, &mut dequantized).is_err() {
                dequantized.fill(f32::NAN);
            }
            for (c, out) in out.iter_mut().enumerate() {
                let a = &x.bytes[c * x.row_bytes..(c + 1) * x.row_bytes];
                let a = a.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                out[r] = dequantized.iter().zip(a).map(|(&w, a)| w as f64 * a as f64).sum::<f64>() as f32;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Isa, Kernels, TileFn};
    use crate::activations::{ARow, ActView};
    use crate::floats::{Bf16, F16, F32, Floats};
    use crate::kquants::{KQuant, Q2K, Q3K, Q4K, Q5K, Q6K};
    use crate::legacy::{Legacy, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
    use crate::mxfp4::Mxfp4;
    use crate::simd::{Avx2, Vnni};
    use crate::{panel, panel_avx2};
    use ts_gguf::GgmlType as T;

    /// Dot products of `R` weight rows with `C` activation rows, for one format and
    /// instruction set.
    pub(crate) trait RowsDot {
        /// # Safety
        /// The kernel's instruction set is available; `w` holds `R` rows `row_bytes` apart and
        /// each `a` row holds a row of activations with its side data; `n` is the number of
        /// blocks per row (elements for float weights).
        unsafe fn dot<const R: usize, const C: usize>(
            w: *const u8,
            row_bytes: usize,
            a: &[ARow; C],
            n: usize,
        ) -> [[f32; C]; R];
    }

    /// Runs `K` over a tile. One activation row (decode) takes weight rows in adjacent pairs,
    /// sharing the activation loads (with the weights prefetched into L2, on a Zen 4 EPYC:
    /// Q8_0 25-30 -> 39-40 GB/s in cache, Qwen2.5-0.5B's decode +10-15%; each row's sum is the
    /// one-row kernel's, bit for bit); two or three take one weight row at a time, so that
    /// weights are read in one sequential stream (hardware prefetchers lose track of several
    /// interleaved short rows, which halved DRAM bandwidth); larger ones two rows by up to 4
    /// activation rows.
    ///
    /// # Safety
    /// As [`TileFn`].
    #[inline(always)]
    unsafe fn direct_tile<K: RowsDot>(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
        let rows = out.first().map_or(0, |o| o.len());
        let wp = w.as_ptr();
        unsafe {
            if let [out] = out {
                let a = [x.arow(0)];
                let mut r = 0;
                while r + 2 <= rows {
                    let d = K::dot::<2, 1>(wp.add(r * row_bytes), row_bytes, &a, x.nb);
                    out[r] = d[0][0];
                    out[r + 1] = d[1][0];
                    r += 2;
                }
                while r < rows {
                    out[r] = K::dot::<1, 1>(wp.add(r * row_bytes), row_bytes, &a, x.nb)[0][0];
                    r += 1;
                }
                return;
            }
            let a: Vec<ARow> = (0..out.len()).map(|c| x.arow(c)).collect();
            let mut r = 0;
            if out.len() >= 4 {
                while r + 2 <= rows {
                    cols::<K, 2>(wp.add(r * row_bytes), row_bytes, &a, x.nb, out, r);
                    r += 2;
                }
            }
            while r < rows {
                cols::<K, 1>(wp.add(r * row_bytes), row_bytes, &a, x.nb, out, r);
                r += 1;
            }
        }
    }

    /// `R` weight rows at `w` against every activation row in `a`, 4 at a time.
    ///
    /// # Safety
    /// As [`TileFn`] for the rows at `w`; `a` points at the activation rows of `out`.
    #[inline(always)]
    unsafe fn cols<K: RowsDot, const R: usize>(
        w: *const u8,
        row_bytes: usize,
        a: &[ARow],
        n: usize,
        out: &mut [&mut [f32]],
        r0: usize,
    ) {
        let mut c = 0;
        unsafe {
            while c + 4 <= a.len() {
                store(K::dot::<R, 4>(w, row_bytes, &[a[c], a[c + 1], a[c + 2], a[c + 3]], n), out, r0, c);
                c += 4;
            }
            match a.len() - c {
                3 => store(K::dot::<R, 3>(w, row_bytes, &[a[c], a[c + 1], a[c + 2]], n), out, r0, c),
                2 => store(K::dot::<R, 2>(w, row_bytes, &[a[c], a[c + 1]], n), out, r0, c),
                1 => store(K::dot::<R, 1>(w, row_bytes, &[a[c]], n), out, r0, c),
                _ => {}
            }
        }
    }

    #[inline(always)]
    fn store<const R: usize, const C: usize>(v: [[f32; C]; R], out: &mut [&mut [f32]], r0: usize, c0: usize) {
        for (r, v) in v.iter().enumerate() {
            for (c, &v) in v.iter().enumerate() {
                out[c0 + c][r0 + r] = v;
            }
        }
    }

    /// Entry points compiled with each instruction set's target features.
    macro_rules! entries {
        ($($avx2:ident, $avx512:ident => $kernel:ty, $kernel512:ty;)*) => {$(
            /// # Safety
            /// As [`TileFn`]; needs AVX2, FMA and F16C.
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $avx2(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
                unsafe { direct_tile::<$kernel>(w, row_bytes, x, out) }
            }
            /// # Safety
            /// As [`TileFn`]; needs AVX2, FMA, F16C and AVX-512 F, BW, VL and VNNI.
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn $avx512(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
                unsafe { direct_tile::<$kernel512>(w, row_bytes, x, out) }
            }
        )*};
    }

    entries! {
        f32_avx2, f32_avx512 => Floats<F32>, Floats<F32>;
        f16_avx2, f16_avx512 => Floats<F16>, Floats<F16>;
        bf16_avx2, bf16_avx512 => Floats<Bf16>, Floats<Bf16>;
        q4_0_avx2, q4_0_avx512 => Legacy<Q4_0, Avx2>, Legacy<Q4_0, Vnni>;
        q4_1_avx2, q4_1_avx512 => Legacy<Q4_1, Avx2>, Legacy<Q4_1, Vnni>;
        q5_0_avx2, q5_0_avx512 => Legacy<Q5_0, Avx2>, Legacy<Q5_0, Vnni>;
        q5_1_avx2, q5_1_avx512 => Legacy<Q5_1, Avx2>, Legacy<Q5_1, Vnni>;
        q8_0_avx2, q8_0_avx512 => Legacy<Q8_0, Avx2>, Legacy<Q8_0, Vnni>;
        mxfp4_avx2, mxfp4_avx512 => Legacy<Mxfp4, Avx2>, Legacy<Mxfp4, Vnni>;
        q2_k_avx2, q2_k_avx512 => KQuant<Q2K, Avx2>, KQuant<Q2K, Vnni>;
        q3_k_avx2, q3_k_avx512 => KQuant<Q3K, Avx2>, KQuant<Q3K, Vnni>;
        q4_k_avx2, q4_k_avx512 => KQuant<Q4K, Avx2>, KQuant<Q4K, Vnni>;
        q5_k_avx2, q5_k_avx512 => KQuant<Q5K, Avx2>, KQuant<Q5K, Vnni>;
        q6_k_avx2, q6_k_avx512 => KQuant<Q6K, Avx2>, KQuant<Q6K, Vnni>;
    }

    pub(super) fn kernels(isa: Isa, ty: T) -> Option<Kernels> {
        let (avx2, avx512): (TileFn, TileFn) = match ty {
            T::F32 => (f32_avx2, f32_avx512),
            T::F16 => (f16_avx2, f16_avx512),
            T::BF16 => (bf16_avx2, bf16_avx512),
            T::Q4_0 => (q4_0_avx2, q4_0_avx512),
            T::Q4_1 => (q4_1_avx2, q4_1_avx512),
            T::Q5_0 => (q5_0_avx2, q5_0_avx512),
            T::Q5_1 => (q5_1_avx2, q5_1_avx512),
            T::Q8_0 => (q8_0_avx2, q8_0_avx512),
            T::MXFP4 => (mxfp4_avx2, mxfp4_avx512),
            T::Q2_K => (q2_k_avx2, q2_k_avx512),
            T::Q3_K => (q3_k_avx2, q3_k_avx512),
            T::Q4_K => (q4_k_avx2, q4_k_avx512),
            T::Q5_K => (q5_k_avx2, q5_k_avx512),
            T::Q6_K => (q6_k_avx2, q6_k_avx512),
            _ => return None,
        };
        match isa {
            Isa::Scalar => None,
            Isa::Avx2 => Some(Kernels {
                direct: avx2,
                panel: panel_avx2::kernel(ty).map(|p| (p, panel_avx2::min_batch(ty))),
                packed: panel_avx2::packed(ty),
            }),
            Isa::Avx512 => Some(Kernels {
                direct: avx512,
                panel: panel::kernel(ty).map(|p| (p, panel::min_batch(ty))),
                packed: panel::packed(ty),
            }),
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::RowsDot;

#[cfg(test)]
mod tests {
    use super::{decode_asks_ahead, intel_processor, set_decode_prefetch};

    /// `--decode-prefetch on` and `off` override a format's own choice; `auto` keeps it, and on
    /// an Intel processor every format asks.
    #[test]
    fn decode_prefetch_overrides_the_format() {
        set_decode_prefetch(Some(true));
        assert!(decode_asks_ahead(false));
        set_decode_prefetch(Some(false));
        assert!(!decode_asks_ahead(true));
        set_decode_prefetch(None);
        assert!(decode_asks_ahead(true));
        assert_eq!(decode_asks_ahead(false), intel_processor());
    }
}
