//! Experts computed by the host's CPU beside the GPU (`--expert-misses cpu`): a decode
//! step's cache misses are computed where they already are, in the pinned host copy, while
//! the GPU computes the cached experts and the copy stream brings in part of the next
//! layer's guesses (tier.rs); their outputs are then uploaded into their pairs' rows of y.
//! PCIe and the CPU's memory then share the bytes not in VRAM, as llama.cpp and
//! ik_llama.cpp share a layer's experts between GPU and CPU (`-ncmoe`), but chosen per token.

use crate::host_timing::Phase;
use crate::moe::{GpuExpertGroup, GpuRoutes};
use crate::{Act, Cuda, err};
use cudarc::driver::{CudaEvent, CudaStream, PinnedHostSlice, sys};
use rayon::prelude::*;
use std::sync::Arc;
use ts_model::backend::ExpertsAt;
use ts_model::config::GatedActivation;
use ts_model::cpu::{expert_hidden, expert_output, experts_of_one_row};
use ts_model::tensors::MoeWeights;
use ts_model::{ModelError, Scratch};

/// Host buffers of [`Cuda::host_experts`]: page-locked, so that copies run at PCIe speed.
pub(crate) struct HostExperts {
    /// Downloads the layer's input without waiting for the expert kernels queued after it.
    stream: Arc<CudaStream>,
    /// The layer's input rows, `[m][n_embd]`.
    x: PinnedHostSlice<f32>,
    /// The host experts' output rows, `[m * k][n_embd]` (rows of the GPU's pairs unused).
    y: PinnedHostSlice<f32>,
    /// Recorded after the last uploads from `y`: `y` is rewritten only once it completes.
    uploaded: Option<CudaEvent>,
}

/// `n` page-locked floats (cached, not write-combined: the host reads and writes them).
fn pinned(cuda: &Cuda, n: usize) -> Result<PinnedHostSlice<f32>, ModelError> {
    // SAFETY: every float is written before it is read (downloads, then the CPU's outputs).
    unsafe { cuda.gpu.ctx.alloc_pinned_with_flags::<f32>(n.max(1), 0) }.map_err(|e| err(e.into()))
}

impl Cuda {
    /// [`ts_model::Backend::host_experts`] for a group that left experts to the host: the pairs
    /// of `at` whose experts `ensure_experts` left there, computed on the CPU (8-bit activations as the CPU backend's, or
    /// f32 with `exact`) and uploaded into their rows of `y` on the compute stream.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn compute_host_experts(
        &self,
        w: &MoeWeights,
        act: GatedActivation,
        x: &Act,
        r: &GpuRoutes,
        at: &ExpertsAt<'_, GpuExpertGroup>,
        y: &Act,
        exact: bool,
    ) -> Result<(), ModelError> {
        let ExpertsAt::Group { ids, group, routes } = at else { return Ok(()) };
        let host: Vec<usize> = ids.iter().zip(&group.slots).filter(|(_, s)| s.is_none()).map(|(&e, _)| e).collect();
        let Some(x_ready) = &group.x_ready else {
            return Err(ModelError::Compute("cuda: experts left to the host without the layer's input marked".into()));
        };
        let tier = self.tier.as_ref().ok_or_else(|| ModelError::Compute("cuda: no expert cache".into()))?;
        let tier = tier.lock().expect("expert tier lock");
        let e = w.gate_exps.row_len();
        let (m, k) = (r.m, r.k);
        let mut guard = self.host_experts.lock().expect("host experts lock");
        if guard.as_ref().is_none_or(|h| h.x.len() < m * e || h.y.len() < m * k * e) {
            // Larger buffers: the old ones are freed only once their last uploads are done.
            if let Some(old) = guard.take()
                && let Some(done) = &old.uploaded
            {
                done.synchronize().map_err(|e| err(e.into()))?;
            }
            let stream = self.gpu.ctx.new_stream().map_err(|e| err(e.into()))?;
            let (x, y) = (pinned(self, m * e)?, pinned(self, m * k * e)?);
            *guard = Some(HostExperts { stream, x, y, uploaded: None });
        }
        let h = guard.as_mut().expect("host expert buffers");
        let cerr = |e: cudarc::driver::DriverError| ModelError::Compute(format!("cuda: {e}"));
        self.host_timing.time(Phase::HostInput, || {
            h.stream.wait(x_ready).map_err(cerr)?;
            let xs = &mut h.x.as_mut_slice().map_err(cerr)?[..m * e];
            // SAFETY: `xs` is page-locked and holds `m * e` floats; the stream is synchronised below.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(xs, x.ptr, h.stream.cu_stream()) }.map_err(cerr)?;
            h.stream.synchronize().map_err(cerr)?;
            if let Some(done) = h.uploaded.take() {
                done.synchronize().map_err(cerr)?;
            }
            Ok::<(), ModelError>(())
        })?;
        let xs = &h.x.as_slice().map_err(cerr)?[..m * e];
        let pairs_of = |ex: usize| (0..routes.len()).filter(|&p| routes[p] == ex).collect::<Vec<usize>>();
        let outputs = if m == 1 && !exact {
            // One row: every expert's gate and up products in one parallel region, their down
            // products in another (the CPU backend's decode products).
            let experts = host
                .iter()
                .map(|&ex| Ok((ex, tier.host_expert(group.il, ex)?)))
                .collect::<Result<Vec<_>, ModelError>>()?;
            let y = experts_of_one_row(w, act, xs, &experts)?;
            host.iter().zip(y.chunks(e)).map(|(&ex, out)| (pairs_of(ex), out.to_vec())).collect()
        } else {
            // Each expert on its own task (its products split further over idle threads).
            host.par_iter()
                .map(|&ex| {
                    let pairs = pairs_of(ex);
                    let input: Vec<f32> =
                        pairs.iter().flat_map(|&p| &xs[p / k * e..(p / k + 1) * e]).copied().collect();
                    let bytes = tier.host_expert(group.il, ex)?;
                    let mut s = if exact { Scratch::exact() } else { Scratch::default() };
                    let hidden = expert_hidden(w, act, ex, &bytes, &input, pairs.len(), &mut s)?;
                    let out = expert_output(w, ex, &bytes, &hidden, pairs.len(), &mut s)?;
                    Ok((pairs, out))
                })
                .collect::<Result<Vec<_>, ModelError>>()?
        };
        let ys = h.y.as_mut_slice().map_err(cerr)?;
        let mut rows = Vec::new();
        for (pairs, out) in outputs {
            for (j, &p) in pairs.iter().enumerate() {
                ys[p * e..(p + 1) * e].copy_from_slice(&out[j * e..(j + 1) * e]);
                rows.push(p);
            }
        }
        let ys = h.y.as_slice().map_err(cerr)?;
        for p in rows {
            let dst = y.ptr + (4 * p * e) as u64;
            // SAFETY: row p of y holds `e` floats; `ys` is page-locked and stays unwritten until
            // `uploaded` completes.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dst, &ys[p * e..(p + 1) * e], self.gpu.stream.cu_stream())
            }
            .map_err(cerr)?;
        }
        h.uploaded =
            Some(self.gpu.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(cerr)?);
        self.wrote();
        Ok(())
    }
}
