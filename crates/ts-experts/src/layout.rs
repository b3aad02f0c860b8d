//! Where each routed expert's bytes are in the file.

use std::path::PathBuf;

/// One stacked expert tensor (`[k, n, n_expert]` in ggml order): where its data
/// starts in the file, how many bytes one expert's matrix takes, and how far
/// apart two experts' matrices are (more than a matrix where gate and up are
/// halves of one fused tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProjLayout {
    /// Absolute file offset of expert 0.
    pub file_offset: u64,
    pub expert_bytes: usize,
    pub stride: usize,
}

impl ProjLayout {
    /// Experts stored one after another.
    pub fn packed(file_offset: u64, expert_bytes: usize) -> ProjLayout {
        ProjLayout { file_offset, expert_bytes, stride: expert_bytes }
    }

    /// File offset of `expert`'s matrix.
    pub fn offset(&self, expert: usize) -> u64 {
        self.file_offset + (expert * self.stride) as u64
    }
}

/// A MoE layer's gate, up and down expert tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerLayout {
    pub n_expert: usize,
    /// Gate, up, down.
    pub proj: [ProjLayout; 3],
}

impl LayerLayout {
    /// Bytes of one expert's three matrices.
    pub fn expert_bytes(&self) -> usize {
        self.proj.iter().map(|p| p.expert_bytes).sum()
    }
}

/// The routed experts of a model file, layer by layer (`None` for dense layers).
#[derive(Clone, Debug)]
pub struct ExpertLayout {
    pub path: PathBuf,
    pub layers: Vec<Option<LayerLayout>>,
}

impl ExpertLayout {
    pub fn layer(&self, layer: usize) -> Result<&LayerLayout, crate::ExpertError> {
        self.layers.get(layer).and_then(Option::as_ref).ok_or(crate::ExpertError::NoExperts(layer))
    }

    /// The largest one expert takes, over all layers.
    pub fn max_expert_bytes(&self) -> usize {
        self.layers.iter().flatten().map(LayerLayout::expert_bytes).max().unwrap_or(0)
    }

    /// All routed experts' bytes.
    pub fn total_bytes(&self) -> u64 {
        self.layers.iter().flatten().map(|l| (l.expert_bytes() * l.n_expert) as u64).sum()
    }

    pub(crate) fn check(&self, layer: usize, ids: &[usize]) -> Result<&LayerLayout, crate::ExpertError> {
        let l = self.layer(layer)?;
        if let Some(&e) = ids.iter().find(|&&e| e >= l.n_expert) {
            return Err(crate::ExpertError::OutOfRange { layer, expert: e, n_expert: l.n_expert });
        }
        Ok(l)
    }
}
