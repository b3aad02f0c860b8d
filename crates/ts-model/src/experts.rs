//! Where routed experts live. The forward pass asks the store for a layer's
//! selected experts and gets their bytes; whether that was a hit, a read
//! from disk or a page of the map is the store's business.

use crate::ModelError;
use crate::tensors::{Ffn, ModelWeights};

/// The bytes of one expert's three projections, in the tensors' own types.
pub struct ExpertBytes<'a> {
    /// `[n_embd, n_ff_exp]`, `[n_embd, n_ff_exp]`, `[n_ff_exp, n_embd]`.
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
}

/// Experts made available for one layer; they stay valid while this lives.
pub struct ExpertSet<'a> {
    /// In the order they were asked for.
    pub experts: Vec<ExpertBytes<'a>>,
}

pub trait ExpertStore: Send + Sync {
    /// Makes experts `ids` of `layer` available.
    fn ensure(&self, layer: usize, ids: &[usize]) -> Result<ExpertSet<'_>, ModelError>;
    /// A short name for logs (`mapped`, `resident`, ...).
    fn kind(&self) -> &'static str;
}

/// Expert matrices of one layer: the stacked tensors' bytes and one expert's size in each.
struct LayerExperts<B> {
    gate: B,
    up: B,
    down: B,
    gate_size: usize,
    up_size: usize,
    down_size: usize,
}

impl<B: AsRef<[u8]>> LayerExperts<B> {
    fn expert(&self, e: usize) -> ExpertBytes<'_> {
        fn slice<B: AsRef<[u8]>>(b: &B, e: usize, size: usize) -> &[u8] {
            &b.as_ref()[e * size..(e + 1) * size]
        }
        ExpertBytes {
            gate: slice(&self.gate, e, self.gate_size),
            up: slice(&self.up, e, self.up_size),
            down: slice(&self.down, e, self.down_size),
        }
    }
}

fn layer_tensors(weights: &ModelWeights) -> impl Iterator<Item = Option<LayerExperts<&crate::weights::Weight>>> {
    weights.layers.iter().map(|l| match &l.ffn {
        Ffn::Moe(m) => Some(LayerExperts {
            gate_size: m.gate_exps.row_bytes() * m.gate_exps.n_rows(),
            up_size: m.up_exps.row_bytes() * m.up_exps.n_rows(),
            down_size: m.down_exps.row_bytes() * m.down_exps.n_rows(),
            gate: &m.gate_exps,
            up: &m.up_exps,
            down: &m.down_exps,
        }),
        Ffn::Dense { .. } => None,
    })
}

fn select<'a, B: AsRef<[u8]>>(
    layers: &'a [Option<LayerExperts<B>>],
    layer: usize,
    ids: &[usize],
) -> Result<ExpertSet<'a>, ModelError> {
    let l = layers
        .get(layer)
        .and_then(Option::as_ref)
        .ok_or_else(|| ModelError::Compute(format!("layer {layer} has no routed experts")))?;
    Ok(ExpertSet { experts: ids.iter().map(|&e| l.expert(e)).collect() })
}

/// Bytes of the mapped file; the operating system pages them in (llama.cpp's default).
pub struct MappedExperts {
    layers: Vec<Option<LayerExperts<MappedBytes>>>,
}

/// A weight's bytes, held through its mapped file.
struct MappedBytes(crate::weights::Weight);

impl AsRef<[u8]> for MappedBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl MappedExperts {
    pub fn new(weights: &ModelWeights) -> MappedExperts {
        let layers = layer_tensors(weights)
            .map(|l| {
                l.map(|l| LayerExperts {
                    gate: MappedBytes(l.gate.clone()),
                    up: MappedBytes(l.up.clone()),
                    down: MappedBytes(l.down.clone()),
                    gate_size: l.gate_size,
                    up_size: l.up_size,
                    down_size: l.down_size,
                })
            })
            .collect();
        MappedExperts { layers }
    }
}

impl ExpertStore for MappedExperts {
    fn ensure(&self, layer: usize, ids: &[usize]) -> Result<ExpertSet<'_>, ModelError> {
        select(&self.layers, layer, ids)
    }

    fn kind(&self) -> &'static str {
        "mapped"
    }
}

/// Every expert copied into memory the process owns at open.
pub struct ResidentExperts {
    layers: Vec<Option<LayerExperts<AlignedBytes>>>,
}

/// Bytes in a u64-aligned allocation, so block views of any type are aligned.
struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    fn copy_of(src: &[u8]) -> AlignedBytes {
        let mut words = vec![0u64; src.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..src.len()].copy_from_slice(src);
        AlignedBytes { words, len: src.len() }
    }
}

impl AsRef<[u8]> for AlignedBytes {
    fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }
}

impl ResidentExperts {
    pub fn new(weights: &ModelWeights) -> ResidentExperts {
        let layers = layer_tensors(weights)
            .map(|l| {
                l.map(|l| LayerExperts {
                    gate: AlignedBytes::copy_of(l.gate.bytes()),
                    up: AlignedBytes::copy_of(l.up.bytes()),
                    down: AlignedBytes::copy_of(l.down.bytes()),
                    gate_size: l.gate_size,
                    up_size: l.up_size,
                    down_size: l.down_size,
                })
            })
            .collect();
        ResidentExperts { layers }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(|l| l.gate.len + l.up.len + l.down.len).sum()
    }
}

impl ExpertStore for ResidentExperts {
    fn ensure(&self, layer: usize, ids: &[usize]) -> Result<ExpertSet<'_>, ModelError> {
        select(&self.layers, layer, ids)
    }

    fn kind(&self) -> &'static str {
        "resident"
    }
}
