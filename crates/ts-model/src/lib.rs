//! Models: `ArchConfig` from GGUF metadata, the one tensor-name table, weights
//! validated at open, where routed experts live, and the forward pass written
//! once for every family.

pub mod backend;
pub mod config;
pub mod cpu;
mod cpu_timing;
pub mod delta_net;
pub mod family;
pub mod forward;
pub mod moe;
pub mod state;
pub mod tensors;
pub mod weights;

pub use backend::{AttnShape, Backend, StepStart};
pub use config::{Arch, ArchConfig};
pub use cpu::Cpu;
pub use forward::{Model, MtpOutput, Row, Scratch};
pub use state::{CpuState, SeqState, Snapshot};
pub use ts_experts::{
    EvictionPolicy, ExpertLayout, ExpertStore, LayerLayout, MappedExperts, ProjLayout, ResidentExperts, StatsSnapshot,
    StreamOptions, StreamingExperts,
};

use std::path::Path;
use std::sync::Arc;
use ts_gguf::GgufFile;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] ts_gguf::GgufError),
    #[error("unknown architecture '{name}' (supported: {known})")]
    UnknownArchitecture { name: String, known: String },
    #[error("metadata '{0}' is missing")]
    MissingKey(String),
    #[error("metadata '{key}': {problem}")]
    BadKey { key: String, problem: String },
    #[error("tensor '{0}' is missing")]
    MissingTensor(String),
    #[error("tensor '{name}': {problem}")]
    BadTensor { name: String, problem: String },
    #[error("position {pos} is past the context size {n_ctx}")]
    ContextFull { pos: usize, n_ctx: usize },
    #[error("token id {token} is out of range (vocabulary size {n_vocab})")]
    TokenOutOfRange { token: u32, n_vocab: usize },
    #[error("{0}")]
    Compute(String),
    #[error(transparent)]
    Experts(#[from] ts_experts::ExpertError),
}

/// Where routed experts are kept.
#[derive(Clone, Debug, PartialEq)]
pub enum ExpertPlacement {
    /// Read through the memory map; the OS pages them in.
    Mapped,
    /// Copied into memory at open.
    Resident,
    /// Read from disk into a bounded cache of slots.
    Stream(StreamOptions),
}

impl Model {
    /// Opens a GGUF model: reads its configuration, validates every tensor the
    /// family needs, and places routed experts as asked.
    pub fn open(path: impl AsRef<Path>, experts: ExpertPlacement) -> Result<Model, ModelError> {
        let file = Arc::new(GgufFile::open(path)?);
        let embd = file.tensor(&tensors::Role::TokenEmbd.name(None, "weight"))?;
        let n_vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
        let cfg = ArchConfig::from_metadata(file.metadata(), n_vocab)?;
        let weights = tensors::ModelWeights::load(&file, &cfg)?;
        let layout = expert_layout(&file, &weights);
        let store: Box<dyn ExpertStore> = match experts {
            ExpertPlacement::Mapped => Box::new(MappedExperts::new(file.clone(), layout)),
            ExpertPlacement::Resident => Box::new(ResidentExperts::new(&file, layout)?),
            ExpertPlacement::Stream(opts) => {
                let store = StreamingExperts::open(layout, &opts)?;
                if let Some(moe) = &cfg.moe
                    && store.slots() < moe.n_expert_used
                {
                    return Err(ModelError::Experts(ts_experts::ExpertError::Setup(format!(
                        "--expert-cache {} bytes holds {} experts; one token needs {} ({} bytes)",
                        opts.cache_bytes,
                        store.slots(),
                        moe.n_expert_used,
                        moe.n_expert_used * store.slot_bytes()
                    ))));
                }
                Box::new(store)
            }
        };
        Ok(Model::new(cfg, weights, store))
    }
}

/// Where each layer's routed experts are in the file.
pub fn expert_layout(file: &GgufFile, weights: &tensors::ModelWeights) -> ExpertLayout {
    let proj = |w: &weights::Weight| ProjLayout {
        file_offset: w.file_offset().expect("expert tensors are mapped from the file"),
        expert_bytes: w.row_bytes() * w.n_rows(),
        stride: w.matrix_stride(),
    };
    // The MTP head's layer, where there is one, is layer `n_layer` of the store.
    let layers = weights
        .layers
        .iter()
        .chain(weights.mtp.iter().map(|m| &m.layer))
        .map(|l| match &l.ffn {
            tensors::Ffn::Moe(m) => Some(LayerLayout {
                n_expert: m.gate_exps.dims[2],
                proj: [proj(&m.gate_exps), proj(&m.up_exps), proj(&m.down_exps)],
            }),
            tensors::Ffn::Dense { .. } => None,
        })
        .collect();
    ExpertLayout { path: file.path.clone(), layers }
}
