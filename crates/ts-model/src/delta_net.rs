//! The Gated DeltaNet mixer (qwen35moe, qwen3next), over backend ops:
//! projections, causal convolution, the gated delta rule on each sequence's
//! recurrent state, a gated RMS norm per head, the output projection
//! (`src/models/qwen3next.cpp: build_layer_attn_linear`; docs/FAMILIES.md §6.3).

use crate::ModelError;
use crate::backend::{Backend, DeltaNetParams};
use crate::config::GatedActivation;
use crate::forward::{Model, Row};
use crate::state::SeqState;
use crate::tensors::DeltaNetWeights;

impl<B: Backend> Model<B> {
    /// Layer `il`'s linear attention of every row, through its output projection; `[m][n_embd]`.
    pub(crate) fn delta_net(
        &self,
        il: usize,
        w: &DeltaNetWeights,
        rows: &[Row],
        seqs: &mut [&mut SeqState<B::State>],
        normed: &B::Act,
        scratch: &mut B::Scratch,
    ) -> Result<B::Act, ModelError> {
        let be = &self.backend;
        let d = self.cfg.delta_net.as_ref().expect("a delta-net layer has its config");
        let m = rows.len();
        let qkv = be.linear(&w.qkv, None, normed, m, scratch)?;
        let mut z = be.linear(&w.gate, None, normed, m, scratch)?;
        let beta = be.linear(&w.beta, None, normed, m, scratch)?;
        let alpha = be.linear(&w.alpha, None, normed, m, scratch)?;
        let qkv = be.conv_silu(il, &w.conv, d.conv_kernel, &qkv, rows, seqs)?;
        let params = DeltaNetParams { shape: d, a: &w.a, dt_bias: &w.dt_bias, eps: self.cfg.rms_eps };
        let mut o = be.delta_net(il, &params, &qkv, &beta, &alpha, rows, seqs)?;
        // Per head RMSNorm(o) * ssm_norm * silu(z).
        be.rms_norm(&mut o, d.d_v, Some(&w.norm), self.cfg.rms_eps)?;
        be.gated(GatedActivation::SwiGlu, &mut z, &o)?;
        be.linear(&w.out, None, &z, m, scratch)
    }
}
