//! Matvecs of quantized weights with the activations quantized to 8 bits once
//! per call (kernels/matvec_q8.cu, kernels/vdot.cuh): integer dot products per
//! block instead of decoding every weight to f32, as llama.cpp's MMVQ does.
//! Steps of few rows take them unless exact (f32) activations are asked for.

use crate::device::Arg;
use crate::{Act, Cuda, Matmul};
use ts_gguf::GgmlType;
use ts_model::ModelError;

/// The kernel-name suffix of a type with integer dot products (vdot.cuh's `TS_Q8_TYPES`).
/// `TURBOSPARK_Q8_0_F32` (a measurement knob) gives Q8_0 f32 activations again.
pub fn q8_suffix(ty: GgmlType) -> Option<&'static str> {
    use GgmlType::*;
    static Q8_0_F32: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let q8 = match ty {
        Q8_0 => !*Q8_0_F32.get_or_init(|| std::env::var_os("TURBOSPARK_Q8_0_F32").is_some()),
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4_K | Q5_K | Q6_K | MXFP4 => true,
        _ => false,
    };
    q8.then(|| crate::type_suffix(ty)).flatten()
}

/// `m` rows of `k` activations quantized on the device (vdot.cuh's `TsQ8`): int8
/// `[m][k]`, then per block of 32 the f32 pair (d, d·Σq) `[m][k / 32]`; `ptr` is
/// the start of a buffer held by [`Q8Cached`].
#[derive(Clone, Copy)]
pub(crate) struct Q8Act {
    ptr: u64,
    m: usize,
    k: usize,
}

/// The last 8-bit copy made (by an 8-bit matvec's quantization or by a norm): of the
/// activations at `src`, in `buf`, valid while the backend's write count is still `writes`.
pub(crate) struct Q8Cached {
    src: u64,
    writes: u64,
    q: Q8Act,
    _buf: Act,
}

impl Q8Act {
    /// The quants of row `r` on.
    pub(crate) fn q(&self, r: usize) -> u64 {
        self.ptr + (r * self.k) as u64
    }

    /// The (d, sum) pairs of row `r` on.
    pub(crate) fn ds(&self, r: usize) -> u64 {
        self.ptr + (self.m * self.k + 8 * r * (self.k / 32)) as u64
    }
}

/// matvec_q8.cu's `MatvecQ8`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MatvecQ8 {
    w: u64,
    xq: u64,
    xds: u64,
    y: u64,
    bias: u64,
    n_out: i32,
    k: i32,
    m: i32,
    lanes: i32,
}

/// The types of [`q8_suffix`] in the order of vdot.cuh's `TS_Q8_TYPES` (matvec_q8.cu's
/// `TsQ8Id` numbers them so).
const Q8_TYPES: [&str; 9] = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mxfp4"];

/// Weights [`Cuda::matvec_q8_multi`] takes in one launch (matvec_q8.cu's `MULTI_PARTS`).
const MULTI_PARTS: usize = 4;

/// matvec_q8.cu's `MatvecQ8Part`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MatvecQ8Part {
    w: u64,
    y: u64,
    bias: u64,
    n_out: i32,
    ty: i32,
    lanes: i32,
    first_block: i32,
}

/// matvec_q8.cu's `MatvecQ8Multi`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MatvecQ8Multi {
    part: [MatvecQ8Part; MULTI_PARTS],
    xq: u64,
    xds: u64,
    parts: i32,
    k: i32,
    m: i32,
}

/// Whether a layer's projections of one input go in one launch (`matvec_q8_multi`);
/// `TURBOSPARK_NO_MULTI_MATVEC` (a measurement knob) spreads them over streams again.
fn multi_matvec() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TURBOSPARK_NO_MULTI_MATVEC").is_none())
}

/// matvec_q8.cu's `MoeMatvecQ8`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeMatvecQ8 {
    w: u64,
    index: u64,
    xq: u64,
    xds: u64,
    y: u64,
    bias: u64,
    ids: u64,
    expert_stride: i64,
    x_group: i32,
    n_out: i32,
    k: i32,
    lanes: i32,
}

/// matvec_q8.cu's `MoeGateUpQ8`: [`Cuda::gate_up_q8`] fills the activations and lanes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MoeGateUpQ8 {
    pub w_gate: u64,
    pub w_up: u64,
    pub index: u64,
    pub ids: u64,
    pub xq: u64,
    pub xds: u64,
    pub h: u64,
    pub gate_bias: u64,
    pub up_bias: u64,
    pub expert_stride: i64,
    pub x_group: i32,
    pub n_out: i32,
    pub k: i32,
    pub lanes: i32,
    pub kind: i32,
    pub alpha: f32,
    pub limit: f32,
}

/// matvec_q8.cu's `MoeChunkQ8`: [`Cuda::chunk_matvec_q8`] fills the activations and lanes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MoeChunkQ8 {
    pub w: u64,
    pub chunks: u64,
    pub count: u64,
    pub xq: u64,
    pub xds: u64,
    pub y: u64,
    pub bias: u64,
    pub expert_stride: i64,
    pub n_out: i32,
    pub k: i32,
    pub lanes: i32,
}

/// matvec_q8.cu's `MoeChunkGateUpQ8`: [`Cuda::chunk_gate_up_q8`] fills the activations and lanes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MoeChunkGateUpQ8 {
    pub w_gate: u64,
    pub w_up: u64,
    pub chunks: u64,
    pub count: u64,
    pub xq: u64,
    pub xds: u64,
    pub h: u64,
    pub gate_bias: u64,
    pub up_bias: u64,
    pub expert_stride: i64,
    pub n_out: i32,
    pub k: i32,
    pub lanes: i32,
    pub kind: i32,
    pub alpha: f32,
    pub limit: f32,
}

/// One expert-indexed matvec over `slots` slots: slot s multiplies expert
/// (or cache slot) `index[s]` of `w` (`expert_stride` bytes apart) by
/// activation row `s / x_group` into row s of `y` `[slots][n_out]`, plus row
/// `ids[s]` of `bias` `[n_expert][n_out]` where `bias` is not 0.
pub(crate) struct IndexedMatvec {
    pub ty: GgmlType,
    pub w: u64,
    pub expert_stride: usize,
    pub index: u64,
    pub x_group: usize,
    pub y: u64,
    pub bias: u64,
    pub ids: u64,
    pub n_out: usize,
    pub k: usize,
    pub slots: usize,
}

/// Lanes per weight row (4 to 32): about four units (32 weights) each, and more
/// lanes when there are too few rows to fill the GPU with threads (64 Ki threads: 128 Ki
/// and 256 Ki measured no faster on the H200, docs/BENCHMARKS.md). The measurement knob
/// `TURBOSPARK_Q8_LANES=UNITS,THREADS` sets both (default `4,65536`).
pub(crate) fn lanes_for(k: usize, rows: usize) -> i32 {
    let (units_per_lane, threads) = lanes_rule();
    let mut lanes = (k / 32).div_ceil(units_per_lane).next_power_of_two().clamp(4, 32);
    while lanes < 32 && rows * lanes < threads {
        lanes *= 2;
    }
    lanes as i32
}

/// Units a lane takes and threads wanted in a launch: [`lanes_for`]'s rule.
fn lanes_rule() -> (usize, usize) {
    static RULE: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *RULE.get_or_init(|| {
        let knob = std::env::var("TURBOSPARK_Q8_LANES").ok();
        let parsed = knob.as_deref().and_then(|v| {
            let (u, t) = v.split_once(',')?;
            Some((u.trim().parse().ok().filter(|&u| u > 0)?, t.trim().parse().ok()?))
        });
        parsed.unwrap_or((4, 64 * 1024))
    })
}

/// Steps of this many rows and more take `matvec_q8_wide_<t>` (passes of up to eight rows).
pub(crate) const WIDE_MIN_ROWS: usize = 3;

/// Rows of W a (32, 4) block takes with `lanes` lanes per row.
pub(crate) fn rows_per_block(lanes: i32) -> usize {
    4 * 32 / lanes as usize
}

impl Cuda {
    /// A buffer for `m` rows of `k` activations quantized to 8 bits.
    pub(crate) fn q8_buffer(&self, m: usize, k: usize) -> Result<(Q8Act, Act), ModelError> {
        let buf = self.act((m * k + 8 * m * (k / 32)).div_ceil(4))?;
        Ok((Q8Act { ptr: buf.ptr, m, k }, buf))
    }

    /// Records `q` (held in `buf`) as the 8-bit copy of the activations at `src`, as they are
    /// now (the launch that wrote both is the last write).
    pub(crate) fn remember_quantized(&self, src: u64, q: Q8Act, buf: Act) {
        let writes = self.writes.load(std::sync::atomic::Ordering::Relaxed);
        *self.q8_last.lock().expect("q8 lock") = Some(Q8Cached { src, writes, q, _buf: buf });
    }

    /// `x` `[m][k]` (device address) quantized to 8 bits: the copy made last (by an 8-bit
    /// matvec, or by the norm that wrote x) when it is of the same activations and nothing
    /// has written to the device since (q, k and v of one input), else quantized anew.
    pub(crate) fn quantized(&self, x: u64, m: usize, k: usize) -> Result<Q8Act, ModelError> {
        use std::sync::atomic::Ordering::Relaxed;
        if let Some(c) = self.q8_last.lock().expect("q8 lock").as_ref()
            && c.src == x
            && c.q.m == m
            && c.q.k == k
            && c.writes == self.writes.load(Relaxed)
        {
            return Ok(c.q);
        }
        let (q, buf) = self.q8_buffer(m, k)?;
        self.quantize_rows(x, q, m)?;
        self.remember_quantized(x, q, buf);
        Ok(q)
    }

    /// Quantizes the first `rows` rows of `q.k` activations at `x` into `q` (`quantize_q8_1`).
    pub(crate) fn quantize_rows(&self, x: u64, q: Q8Act, rows: usize) -> Result<(), ModelError> {
        let n = rows * q.k;
        self.launch_1d("quantize_q8_1", n, &[Arg::Ptr(x), Arg::Ptr(q.q(0)), Arg::Ptr(q.ds(0)), Arg::I64(n as i64)])
    }

    /// Runs `launches`, which write only the device bytes `writes` (start, length), keeping
    /// the cached 8-bit copy valid if it was before and its activations are not among them.
    pub(crate) fn keeping_quantized<T>(
        &self,
        writes: &[(u64, usize)],
        launches: impl FnOnce() -> Result<T, ModelError>,
    ) -> Result<T, ModelError> {
        use std::sync::atomic::Ordering::Relaxed;
        let keep = self.q8_last.lock().expect("q8 lock").as_ref().is_some_and(|c| {
            let src = (c.src, (4 * c.q.m * c.q.k) as u64);
            c.writes == self.writes.load(Relaxed)
                && writes.iter().all(|&(at, len)| at + len as u64 <= src.0 || src.0 + src.1 <= at)
        });
        let out = launches()?;
        if keep && let Some(c) = self.q8_last.lock().expect("q8 lock").as_mut() {
            c.writes = self.writes.load(Relaxed);
        }
        Ok(out)
    }

    /// `mm`, of a type with integer dot products (kernel suffix `sfx`), with the
    /// activations quantized to 8 bits.
    pub(crate) fn matmul_q8(&self, sfx: &str, mm: &Matmul) -> Result<(), ModelError> {
        let xq = self.quantized(mm.x, mm.m, mm.k)?;
        self.keeping_quantized(&[(mm.y, 4 * mm.m * mm.n_out)], || self.matvecs_q8(sfx, &xq, mm))
    }

    /// The launches of [`Cuda::matmul_q8`], `xq` standing for `mm.x`: `matvec_q8_<t>` for one
    /// or two rows, `matvec_q8_wide_<t>` from [`Cuda::q8_wide_rows`] rows (up to
    /// [`Cuda::q8_launch_rows`] a launch).
    fn matvecs_q8(&self, sfx: &str, xq: &Q8Act, mm: &Matmul) -> Result<(), ModelError> {
        let Matmul { w, n_out, k, m, y, bias, .. } = *mm;
        let lanes = lanes_for(k, n_out);
        let grid = (n_out.div_ceil(rows_per_block(lanes)) as u32, 1, 1);
        let kernel = if m >= self.q8_wide_rows { format!("matvec_q8_wide_{sfx}") } else { format!("matvec_q8_{sfx}") };
        for r0 in (0..m).step_by(self.q8_launch_rows) {
            let p = MatvecQ8 {
                w,
                xq: xq.q(r0),
                xds: xq.ds(r0),
                y: y + (4 * r0 * n_out) as u64,
                bias,
                n_out: n_out as i32,
                k: k as i32,
                m: (m - r0).min(self.q8_launch_rows) as i32,
                lanes,
            };
            self.launch_with(&kernel, grid, (32, 4, 1), &p)?;
        }
        Ok(())
    }

    /// The matvecs `mms` of one input (same `x`, `k` and `m`) in one `matvec_q8_multi` launch,
    /// each as [`Cuda::matmul_q8`] would compute it; false (nothing launched) where that kernel
    /// does not apply: more than [`MULTI_PARTS`] of them, a type without integer dot products,
    /// rows for the wide kernel, or the knob off.
    pub(crate) fn matvec_q8_multi(&self, mms: &[Matmul]) -> Result<bool, ModelError> {
        let Some(first) = mms.first() else { return Ok(false) };
        let (x, k, m) = (first.x, first.k, first.m);
        let same_input = k.is_multiple_of(32) && mms.iter().all(|mm| mm.x == x && mm.k == k && mm.m == m);
        if !multi_matvec()
            || mms.len() > MULTI_PARTS
            || !same_input
            || m >= self.q8_wide_rows
            || m > self.q8_launch_rows
        {
            return Ok(false);
        }
        let ids: Option<Vec<i32>> = mms
            .iter()
            .map(|mm| {
                let sfx = q8_suffix(mm.ty)?;
                Q8_TYPES.iter().position(|t| *t == sfx).map(|i| i as i32)
            })
            .collect();
        let Some(ids) = ids else { return Ok(false) };
        let xq = self.quantized(x, m, k)?;
        let mut part = [MatvecQ8Part::default(); MULTI_PARTS];
        let mut blocks = 0;
        for ((p, mm), ty) in part.iter_mut().zip(mms).zip(ids) {
            let lanes = lanes_for(k, mm.n_out);
            *p = MatvecQ8Part {
                w: mm.w,
                y: mm.y,
                bias: mm.bias,
                n_out: mm.n_out as i32,
                ty,
                lanes,
                first_block: blocks as i32,
            };
            blocks += mm.n_out.div_ceil(rows_per_block(lanes));
        }
        let p = MatvecQ8Multi { part, xq: xq.q(0), xds: xq.ds(0), parts: mms.len() as i32, k: k as i32, m: m as i32 };
        let outs: Vec<(u64, usize)> = mms.iter().map(|mm| (mm.y, 4 * m * mm.n_out)).collect();
        self.keeping_quantized(&outs, || self.launch_with("matvec_q8_multi", (blocks as u32, 1, 1), (32, 4, 1), &p))?;
        Ok(true)
    }

    /// [`IndexedMatvec`] with `x` `[slots / x_group][k]` quantized to 8 bits.
    pub(crate) fn indexed_matvec_q8(&self, sfx: &str, mv: &IndexedMatvec, x: &Act) -> Result<(), ModelError> {
        let xq = self.quantized(x.ptr, mv.slots / mv.x_group, mv.k)?;
        let lanes = lanes_for(mv.k, mv.n_out * mv.slots);
        let p = MoeMatvecQ8 {
            w: mv.w,
            index: mv.index,
            xq: xq.q(0),
            xds: xq.ds(0),
            y: mv.y,
            bias: mv.bias,
            ids: mv.ids,
            expert_stride: mv.expert_stride as i64,
            x_group: mv.x_group as i32,
            n_out: mv.n_out as i32,
            k: mv.k as i32,
            lanes,
        };
        let grid = (mv.n_out.div_ceil(rows_per_block(lanes)) as u32, mv.slots as u32, 1);
        let out = (mv.y, 4 * mv.slots * mv.n_out);
        self.keeping_quantized(&[out], || self.launch_with(&format!("moe_matvec_q8_{sfx}"), grid, (32, 4, 1), &p))
    }

    /// Gate and up of `slots` slots, their biases and the activation in one
    /// kernel, with `x` `[slots / x_group][k]` quantized to 8 bits; `p`'s
    /// activation fields are filled here.
    pub(crate) fn gate_up_q8(&self, sfx: &str, p: MoeGateUpQ8, x: &Act, slots: usize) -> Result<(), ModelError> {
        let k = p.k as usize;
        let xq = self.quantized(x.ptr, slots / p.x_group as usize, k)?;
        let lanes = lanes_for(k, p.n_out as usize * slots);
        let p = MoeGateUpQ8 { xq: xq.q(0), xds: xq.ds(0), lanes, ..p };
        let grid = ((p.n_out as usize).div_ceil(rows_per_block(lanes)) as u32, slots as u32, 1);
        let out = (p.h, 4 * slots * p.n_out as usize);
        self.keeping_quantized(&[out], || self.launch_with(&format!("moe_gate_up_q8_{sfx}"), grid, (32, 4, 1), &p))
    }

    /// One projection of every chunk of `max_chunks` (kernel suffix `sfx`), `xq` the
    /// activations in the grouped order; `p`'s activations and lanes are filled here.
    pub(crate) fn chunk_matvec_q8(
        &self,
        sfx: &str,
        p: MoeChunkQ8,
        max_chunks: usize,
        xq: &Q8Act,
    ) -> Result<(), ModelError> {
        let (n_out, k) = (p.n_out as usize, p.k as usize);
        self.launch_chunks(&format!("moe_chunk_q8_{sfx}"), n_out, k, max_chunks, |lanes| MoeChunkQ8 {
            xq: xq.q(0),
            xds: xq.ds(0),
            lanes,
            ..p
        })
    }

    /// Gate, up, their biases and the activation of every chunk (see
    /// [`Cuda::chunk_matvec_q8`]).
    pub(crate) fn chunk_gate_up_q8(
        &self,
        sfx: &str,
        p: MoeChunkGateUpQ8,
        max_chunks: usize,
        xq: &Q8Act,
    ) -> Result<(), ModelError> {
        let (n_out, k) = (p.n_out as usize, p.k as usize);
        self.launch_chunks(&format!("moe_chunk_gate_up_q8_{sfx}"), n_out, k, max_chunks, |lanes| MoeChunkGateUpQ8 {
            xq: xq.q(0),
            xds: xq.ds(0),
            lanes,
            ..p
        })
    }

    /// Kernel `name` over `max_chunks` chunks of `n_out` outputs of `k` inputs, in (32, 4)
    /// blocks; `params(lanes)` gives its parameters for the lanes chosen here.
    fn launch_chunks<P: Copy>(
        &self,
        name: &str,
        n_out: usize,
        k: usize,
        max_chunks: usize,
        params: impl FnOnce(i32) -> P,
    ) -> Result<(), ModelError> {
        let lanes = lanes_for(k, n_out * max_chunks);
        let grid = (n_out.div_ceil(rows_per_block(lanes)) as u32, max_chunks as u32, 1);
        self.launch_with(name, grid, (32, 4, 1), &params(lanes))
    }
}

#[cfg(test)]
mod tests {
    /// `Q8_TYPES` numbers the types as matvec_q8.cu's `TsQ8Id` does: in the order of
    /// vdot.cuh's `TS_Q8_TYPES` list.
    #[test]
    fn q8_type_ids_follow_the_kernels_list() {
        let src = include_str!("../kernels/vdot.cuh");
        let list = &src[src.find("#define TS_Q8_TYPES(X)").expect("TS_Q8_TYPES in vdot.cuh")..];
        let listed: Vec<&str> =
            list.lines().skip(1).map_while(|l| l.trim().strip_prefix("X(").and_then(|r| r.split(')').next())).collect();
        assert_eq!(listed, super::Q8_TYPES);
    }
}
