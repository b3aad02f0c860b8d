//! Grouped expert matmuls for steps of many rows (kernels/moe_mm_q8.cu): the
//! pairs grouped by expert on the host are cut into tiles of at most
//! [`MM_TILE`] pairs of one expert, and one launch per projection multiplies
//! every tile with 8-bit activations on the int8 tensor cores, instead of a
//! launch (and an f16 copy of the expert for cuBLAS) per expert.

use crate::device::Arg;
use crate::matvec_q8::Q8Act;
use crate::moe::GpuRoutes;
use crate::{Act, Cuda, err};
use cudarc::driver::CudaSlice;
use ts_model::ModelError;

/// Pairs per tile (moe_mm_q8.cu's kernels `_32`: four mma columns of 8). Measured on the H200,
/// pp512 with tiles of 16 and 32 pairs: gpt-oss-20b 6,913 and 8,426 tok/s, qwen3-30b-a3b 3,624
/// and 4,051 (every expert through these kernels; with experts of 64 pairs or more on cuBLAS
/// as before, 7,851 / 8,066 and 3,338 / 3,224).
pub(crate) const MM_TILE: usize = 32;

/// Output rows per block of the grouped kernels (moe_mm_q8.cu: 16 per warp, `TS_MMA_WARPS` warps).
const MMA_ROWS_PER_BLOCK: usize = 64;

/// moe_mm_q8.cu's `MoeMmQ8`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MoeMmQ8 {
    pub w: u64,
    pub tiles: u64,
    pub xq: u64,
    pub xds: u64,
    pub y: u64,
    pub bias: u64,
    pub expert_stride: i64,
    pub n_out: i32,
    pub k: i32,
}

/// moe_mm_q8.cu's `MoeMmGateUpQ8`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MoeMmGateUpQ8 {
    pub w_gate: u64,
    pub w_up: u64,
    pub tiles: u64,
    pub xq: u64,
    pub xds: u64,
    pub h: u64,
    pub gate_bias: u64,
    pub up_bias: u64,
    pub expert_stride: i64,
    pub n_out: i32,
    pub k: i32,
    pub kind: i32,
    pub alpha: f32,
    pub limit: f32,
}

/// One group of experts' pairs in tiles, on the device: per tile (the expert's
/// index among the weights, the expert, its first pair in the grouped order,
/// its pair count), `[n][4]` i32; kept with the routes for the group's experts, so
/// that gate/up and down upload it once.
pub(crate) struct Tiles {
    experts: Vec<(usize, usize)>,
    device: CudaSlice<i32>,
    n: usize,
}

/// A [`Tiles`]' device address and tile count, valid while its routes hold it.
#[derive(Clone, Copy)]
pub(crate) struct TileTable {
    ptr: u64,
    n: usize,
}

/// The tiles of at most `tile` pairs of `experts` (expert, index among the weights),
/// whose pairs are `offsets[e]..offsets[e + 1]` in the grouped order.
fn tile_table(offsets: &[usize], experts: &[(usize, usize)], tile: usize) -> Vec<i32> {
    let mut t = Vec::new();
    for &(e, index) in experts {
        for start in (offsets[e]..offsets[e + 1]).step_by(tile) {
            let rows = (offsets[e + 1] - start).min(tile);
            t.extend([index as i32, e as i32, start as i32, rows as i32]);
        }
    }
    t
}

impl Cuda {
    /// The tiles of `experts` (see [`tile_table`]) in `r`'s grouped order: the ones `r`
    /// holds when they are of the same experts, else uploaded and held by `r`.
    pub(crate) fn tiles(
        &self,
        r: &GpuRoutes,
        offsets: &[usize],
        experts: &[(usize, usize)],
    ) -> Result<TileTable, ModelError> {
        let mut held = r.tiles.lock().expect("tiles lock");
        if held.as_ref().is_none_or(|t| t.experts != experts) {
            let table = tile_table(offsets, experts, MM_TILE);
            let device = self.gpu.upload(&table).map_err(err)?;
            *held = Some(Tiles { experts: experts.to_vec(), device, n: table.len() / 4 });
        }
        let t = held.as_ref().expect("tiles just held");
        Ok(TileTable { ptr: self.gpu.ptr(&t.device), n: t.n })
    }

    /// `out[p] = x[rows[p]]` (`rows` a device address) quantized to 8 bits for
    /// `pairs` pairs of width `k`, with [`MM_TILE`] rows after them for the last tile.
    pub(crate) fn gather_quantized(
        &self,
        x: &Act,
        rows: u64,
        pairs: usize,
        k: usize,
    ) -> Result<(Q8Act, Act), ModelError> {
        let (q, buf) = self.q8_buffer(pairs + MM_TILE, k)?;
        self.launch_1d(
            "gather_quantize_q8_1",
            pairs * k,
            &[
                Arg::Ptr(self.p(x)),
                Arg::Ptr(rows),
                Arg::Ptr(q.q(0)),
                Arg::Ptr(q.ds(0)),
                Arg::I32(k as i32),
                Arg::I64((pairs * k) as i64),
            ],
        )?;
        Ok((q, buf))
    }

    /// `pairs` rows of `k` activations at `x` (grouped order) quantized to 8 bits, with
    /// [`MM_TILE`] rows after them for the last tile.
    pub(crate) fn quantized_padded(&self, x: u64, pairs: usize, k: usize) -> Result<(Q8Act, Act), ModelError> {
        let (q, buf) = self.q8_buffer(pairs + MM_TILE, k)?;
        self.quantize_rows(x, q, pairs)?;
        Ok((q, buf))
    }

    /// Gate, up, their biases and the activation of every tile (kernel suffix `sfx`);
    /// `p`'s tiles, activations and lanes are filled here.
    pub(crate) fn moe_mm_gate_up_q8(
        &self,
        sfx: &str,
        p: MoeMmGateUpQ8,
        tiles: TileTable,
        xq: &Q8Act,
    ) -> Result<(), ModelError> {
        let p = MoeMmGateUpQ8 { tiles: tiles.ptr, xq: xq.q(0), xds: xq.ds(0), ..p };
        let grid = ((p.n_out as usize).div_ceil(MMA_ROWS_PER_BLOCK) as u32, tiles.n as u32, 1);
        self.launch_with(&format!("moe_mm_gate_up_q8_{sfx}_{MM_TILE}"), grid, (128, 1, 1), &p)
    }

    /// One projection (and its bias) of every tile (kernel suffix `sfx`); `p`'s
    /// tiles, activations and lanes are filled here.
    pub(crate) fn moe_mm_q8(&self, sfx: &str, p: MoeMmQ8, tiles: TileTable, xq: &Q8Act) -> Result<(), ModelError> {
        let p = MoeMmQ8 { tiles: tiles.ptr, xq: xq.q(0), xds: xq.ds(0), ..p };
        let grid = ((p.n_out as usize).div_ceil(MMA_ROWS_PER_BLOCK) as u32, tiles.n as u32, 1);
        self.launch_with(&format!("moe_mm_q8_{sfx}_{MM_TILE}"), grid, (128, 1, 1), &p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_each_experts_pairs_once() {
        // Expert 0: 0 pairs, 1: 3, 2: 17, 3: 8.
        let offsets = [0, 0, 3, 20, 28];
        let t = tile_table(&offsets, &[(1, 5), (2, 0), (3, 9)], 8);
        let tiles: Vec<[i32; 4]> = t.chunks(4).map(|c| [c[0], c[1], c[2], c[3]]).collect();
        assert_eq!(tiles, vec![[5, 1, 0, 3], [0, 2, 3, 8], [0, 2, 11, 8], [0, 2, 19, 1], [9, 3, 20, 8]]);
    }
}
