//! RMS norms on the device (ops.cu's `rms_norm`): a residual add and the routed experts'
//! weighted sum folded in where asked, and the output's 8-bit copy for the matvecs after it.

use crate::{Cuda, matmul, matvec_q8};
use ts_model::ModelError;

/// One `rms_norm` launch over the `len / piece` pieces at `x` (device addresses): `x += y`
/// first unless `y` is 0 (with `pairs`, y holds the routed experts' rows, summed first as
/// `moe_combine` does), then `out = norm(x) * w` (`w` 0: no scale).
pub(crate) struct NormRows {
    pub(crate) x: u64,
    pub(crate) y: u64,
    pub(crate) w: u64,
    pub(crate) out: u64,
    pub(crate) len: usize,
    pub(crate) piece: usize,
    pub(crate) eps: f32,
    pub(crate) pairs: Option<PairSum>,
}

/// y's rows as (row, slot) pairs of the routed experts, `k` a row: their weights `[rows][k]`
/// and each pair's row of y (`index`, 0: pair r * k + j).
#[derive(Clone, Copy)]
pub(crate) struct PairSum {
    pub(crate) weights: u64,
    pub(crate) index: u64,
    pub(crate) k: usize,
}

/// ops.cu's `RmsNorm`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RmsNorm {
    x: u64,
    y: u64,
    w: u64,
    out: u64,
    q: u64,
    ds: u64,
    pair_w: u64,
    pair_index: u64,
    k: i32,
    width: i32,
    eps: f32,
}

impl Cuda {
    /// `n`, with `out` also quantized to 8 bits into `q8` where given.
    pub(crate) fn norm_rows(&self, n: &NormRows, q8: Option<&matvec_q8::Q8Act>) -> Result<(), ModelError> {
        let (q, ds) = q8.map_or((0, 0), |q| (q.q(0), q.ds(0)));
        let pairs = n.pairs.unwrap_or(PairSum { weights: 0, index: 0, k: 0 });
        let p = RmsNorm {
            x: n.x,
            y: n.y,
            w: n.w,
            out: n.out,
            q,
            ds,
            pair_w: pairs.weights,
            pair_index: pairs.index,
            k: pairs.k as i32,
            width: n.piece as i32,
            eps: n.eps,
        };
        self.launch_with("rms_norm", ((n.len / n.piece) as u32, 1, 1), (norm_threads(n.piece), 1, 1), &p)
    }

    /// A norm whose output feeds matmuls: for few rows (the 8-bit matvecs' steps) it also
    /// writes the output's 8-bit copy, which the next 8-bit matvec on it then reuses.
    pub(crate) fn norm_rows_quantized(&self, n: &NormRows) -> Result<(), ModelError> {
        let rows = n.len / n.piece;
        if rows >= matmul::GEMM_MIN_ROWS || !n.piece.is_multiple_of(32) {
            return self.norm_rows(n, None);
        }
        let (q, buf) = self.q8_buffer(rows, n.piece)?;
        self.norm_rows(n, Some(&q))?;
        self.remember_quantized(n.out, q, buf);
        Ok(())
    }
}

/// Threads of an `rms_norm` block for pieces of `width`: enough that each holds its 4
/// elements in registers (ops.cu's RMS_HELD; fewer with `device::norm_elements`), 32 to 1024.
fn norm_threads(width: usize) -> u32 {
    width.div_ceil(crate::device::norm_elements()).next_power_of_two().clamp(32, 1024) as u32
}
