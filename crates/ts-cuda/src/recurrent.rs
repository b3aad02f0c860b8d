//! The recurrent (Gated DeltaNet) layers' ops on the device: the causal
//! convolution and the delta rule, token by token for short runs and in chunks
//! of 64 rows for runs of 16 rows and more (delta_net.cu).

use crate::device::Arg;
use crate::{Act, Cuda};
use ts_model::{ModelError, Row};

/// Warps per block of the delta_rule kernel (delta_net.cu's DN_WARPS).
const DELTA_RULE_WARPS: usize = 4;
/// Rows per chunk of the chunked delta rule (delta_net.cu's DN_CHUNK).
pub(crate) const DELTA_CHUNK: usize = 64;
/// Columns of S per warp and warps per block of delta_chunk_scan.
const DELTA_SCAN_COLS: usize = 2;
const DELTA_SCAN_WARPS: usize = 8;
/// Runs from this many rows on take the chunked delta rule and the row-parallel
/// convolution; shorter ones the token-by-token kernels.
const CHUNKED_MIN_ROWS: usize = 16;

impl Cuda {
    /// [`ts_model::Backend::conv_silu`].
    pub(crate) fn run_conv_silu(
        &self,
        il: usize,
        taps: &[f32],
        kernel: usize,
        x: &Act,
        rows: &[Row],
    ) -> Result<Act, ModelError> {
        if !(2..=8).contains(&kernel) {
            return Err(ModelError::Compute(format!("cuda: a convolution of {kernel} taps (the kernel takes 2 to 8)")));
        }
        let channels = taps.len() / kernel;
        let out = self.act(x.len)?;
        let r = self.runs_of(il, rows)?;
        let blocks = channels.div_ceil(256) as u32;
        let args = [
            Arg::Ptr(self.p(x)),
            Arg::Ptr(self.p(&out)),
            Arg::Ptr(self.vptr(taps)?),
            Arg::I32(channels as i32),
            Arg::I32(kernel as i32),
            Arg::Ptr(r.rows),
            Arg::Ptr(r.runs),
            Arg::Ptr(r.info),
        ];
        if r.longest < CHUNKED_MIN_ROWS {
            self.launch("conv_silu", (blocks, r.n as u32, 1), (256, 1, 1), &args)?;
            return Ok(out);
        }
        // A thread per (row, channel), then the windows advanced (the same arguments but the
        // output and the taps).
        self.launch("conv_silu_rows", (blocks, r.n as u32, r.longest.div_ceil(64) as u32), (256, 1, 1), &args)?;
        self.launch("conv_window", (blocks, r.n as u32, 1), (256, 1, 1), &[&args[..1], &args[3..]].concat())?;
        Ok(out)
    }

    /// [`ts_model::Backend::delta_net`].
    pub(crate) fn run_delta_net(
        &self,
        il: usize,
        p: &ts_model::backend::DeltaNetParams,
        qkv: &Act,
        beta: &Act,
        alpha: &Act,
        rows: &[Row],
    ) -> Result<Act, ModelError> {
        let d = p.shape;
        let (nk, nv, dk, dv) = (d.n_k_heads, d.n_v_heads, d.d_k, d.d_v);
        if dk > 256 {
            return Err(ModelError::Compute(format!("cuda: key heads of {dk} (the kernel holds 256)")));
        }
        let m = rows.len();
        let r = self.runs_of(il, rows)?;
        let qk = self.act(m * 2 * nk * dk)?;
        self.launch(
            "l2_norm_heads",
            (m as u32, (2 * nk) as u32, 1),
            (32, 1, 1),
            &[
                Arg::Ptr(self.p(qkv)),
                Arg::Ptr(self.p(&qk)),
                Arg::I32(d.conv_dim() as i32),
                Arg::I32(nk as i32),
                Arg::I32(dk as i32),
                Arg::F32(p.eps),
                Arg::F32(1.0 / (dk as f32).sqrt()),
            ],
        )?;
        let out = self.act(m * nv * dv)?;
        let tiled = (d.key_head_of == ts_model::config::KeyHeadOf::Tiled) as i32;
        // delta_rule's and delta_chunk_prep's inputs, then (after their output) the shapes.
        let inputs = [
            Arg::Ptr(self.p(&qk)),
            Arg::Ptr(self.p(qkv)),
            Arg::Ptr(self.p(beta)),
            Arg::Ptr(self.p(alpha)),
            Arg::Ptr(self.vptr(p.a)?),
            Arg::Ptr(self.vptr(p.dt_bias)?),
        ];
        let shape = [nk, nv, dk, dv].map(|x| Arg::I32(x as i32));
        let shape = [&[Arg::I32(d.conv_dim() as i32)][..], &shape, &[Arg::I32(tiled)]].concat();
        if r.longest >= CHUNKED_MIN_ROWS && dv.is_multiple_of(DELTA_SCAN_COLS) {
            // Every chunk's W, U, M at once, then the chunks of each run in order.
            let per_chunk = DELTA_CHUNK + DELTA_CHUNK * (2 * dk + dv) + DELTA_CHUNK * DELTA_CHUNK;
            let prep = self.act(r.n_chunks * nv * per_chunk)?;
            self.launch(
                "delta_chunk_prep",
                (nv as u32, r.n as u32, r.longest.div_ceil(DELTA_CHUNK) as u32),
                (256, 1, 1),
                &[&inputs[..], &[Arg::Ptr(self.p(&prep))], &shape, &[Arg::Ptr(r.rows), Arg::Ptr(r.runs)]].concat(),
            )?;
            self.launch(
                "delta_chunk_scan",
                (nv as u32, r.n as u32, dv.div_ceil(DELTA_SCAN_COLS * DELTA_SCAN_WARPS) as u32),
                (32 * DELTA_SCAN_WARPS as u32, 1, 1),
                &[
                    Arg::Ptr(self.p(&qk)),
                    Arg::Ptr(self.p(&prep)),
                    Arg::Ptr(self.p(&out)),
                    Arg::I32(nk as i32),
                    Arg::I32(nv as i32),
                    Arg::I32(dk as i32),
                    Arg::I32(dv as i32),
                    Arg::I32(tiled),
                    Arg::Ptr(r.rows),
                    Arg::Ptr(r.runs),
                    Arg::Ptr(r.info),
                ],
            )?;
            return Ok(out);
        }
        self.launch(
            "delta_rule",
            (nv as u32, r.n as u32, dv.div_ceil(DELTA_RULE_WARPS) as u32),
            (32 * DELTA_RULE_WARPS as u32, 1, 1),
            &[&inputs[..], &[Arg::Ptr(self.p(&out))], &shape, &[Arg::Ptr(r.rows), Arg::Ptr(r.runs), Arg::Ptr(r.info)]]
                .concat(),
        )?;
        Ok(out)
    }
}
