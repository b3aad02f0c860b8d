//! Models: `ArchConfig` from GGUF metadata, the one tensor-name table, weights
//! validated at open, where routed experts live, and the forward pass written
//! once for every family.

pub mod config;
pub mod experts;
pub mod forward;
pub mod kv;
pub mod moe;
pub mod tensors;
pub mod weights;

pub use config::{Arch, ArchConfig};
pub use experts::{ExpertStore, MappedExperts, ResidentExperts};
pub use forward::{Model, Row, Scratch};
pub use kv::SeqState;

use std::path::Path;
use std::sync::Arc;
use ts_gguf::GgufFile;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
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
}

/// Where routed experts are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPlacement {
    /// Read through the memory map; the OS pages them in.
    Mapped,
    /// Copied into memory at open.
    Resident,
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
        let store: Box<dyn ExpertStore> = match experts {
            ExpertPlacement::Mapped => Box::new(MappedExperts::new(&weights)),
            ExpertPlacement::Resident => Box::new(ResidentExperts::new(&weights)),
        };
        Ok(Model::new(cfg, weights, store))
    }
}
