//! Where routed experts live. The forward pass asks a store for one layer's
//! selected experts and gets their bytes; whether that was a hit, a read from
//! disk or a page of the map is the store's business, and it counts it.
//!
//! - [`MappedExperts`]: pages of the memory-mapped file; the OS decides what stays.
//! - [`ResidentExperts`]: every expert copied into memory at open.
//! - [`StreamingExperts`]: a cache of a fixed number of slots filled by positioned
//!   reads (O_DIRECT where the filesystem allows), a protect set for experts in
//!   use, a reader pool, and an eviction policy.

mod huge_pages;
mod layout;
mod mapped;
mod slots;
mod stats;
mod stream;

pub use huge_pages::{HugeBytes, ask_for_huge_pages};
pub use layout::{ExpertLayout, LayerLayout, ProjLayout};
pub use mapped::{MappedExperts, ResidentExperts};
pub use slots::{EvictionPolicy, SlotCache};
pub use stats::{LayerStats, StatsSnapshot};
pub use stream::{ReadSource, StreamOptions, StreamingExperts};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ExpertError {
    #[error("layer {0} has no routed experts")]
    NoExperts(usize),
    #[error("expert {expert} of layer {layer} is out of range ({n_expert} experts)")]
    OutOfRange { layer: usize, expert: usize, n_expert: usize },
    // The OS error is part of the message, not a `source`: a caller printing the chain would say it twice.
    #[error("{path}: reading expert {expert} of layer {layer} ({len} bytes at offset {offset}) failed: {error}")]
    Read { path: PathBuf, layer: usize, expert: usize, offset: u64, len: usize, error: std::io::Error },
    #[error(
        "the expert cache holds {slots} experts, but layer {layer} needs {needed} at once; give --expert-cache at least {min_bytes} bytes"
    )]
    CacheTooSmall { layer: usize, needed: usize, slots: usize, min_bytes: u64 },
    #[error("{0}")]
    Setup(String),
}

/// The bytes of one expert's three projections, in the tensors' own types.
#[derive(Clone, Copy)]
pub struct ExpertBytes<'a> {
    /// `[n_embd, n_ff_exp]`, `[n_embd, n_ff_exp]`, `[n_ff_exp, n_embd]` (one expert's slice).
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
    /// Per projection (gate, up, down): repacked by [`ExpertStore::pack`] (the CPU's packed
    /// layout), not GGUF blocks.
    pub packed: [bool; 3],
}

/// Repacks expert matrices, at the same size, for a backend that reads them in another
/// layout ([`ExpertStore::pack`]).
pub trait Repack: Send + Sync {
    /// Whether the matrices of projection `proj` (0 gate, 1 up, 2 down) of `layer` are repacked:
    /// once, or (`on_every_read`, a streaming store's) each time they are read.
    fn packs(&self, layer: usize, proj: usize, on_every_read: bool) -> bool;
    /// Repacks one expert's matrix of that projection in place.
    fn pack(&self, layer: usize, proj: usize, bytes: &mut [u8]);
}

/// A [`Repack`] a store may keep (a streaming one repacks each matrix as it is read).
pub type Packer = std::sync::Arc<dyn Repack>;

/// Experts made available for one layer, in the order asked for. They stay
/// valid (and, when streamed, protected from eviction) while this lives.
pub struct ExpertSet<'a> {
    inner: SetInner<'a>,
}

enum SetInner<'a> {
    Ready(Vec<ExpertBytes<'a>>),
    Streamed(stream::PendingSet<'a>),
}

impl<'a> ExpertSet<'a> {
    pub fn ready(experts: Vec<ExpertBytes<'a>>) -> ExpertSet<'a> {
        ExpertSet { inner: SetInner::Ready(experts) }
    }

    pub fn len(&self) -> usize {
        match &self.inner {
            SetInner::Ready(v) => v.len(),
            SetInner::Streamed(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether expert `i` can be used without waiting.
    pub fn is_ready(&self, i: usize) -> bool {
        match &self.inner {
            SetInner::Ready(_) => true,
            SetInner::Streamed(p) => p.is_ready(i),
        }
    }

    /// Expert `i`'s bytes, waiting for its read if it is still in flight.
    pub fn get(&self, i: usize) -> Result<ExpertBytes<'_>, ExpertError> {
        match &self.inner {
            SetInner::Ready(v) => Ok(v[i]),
            SetInner::Streamed(p) => p.get(i),
        }
    }
}

pub trait ExpertStore: Send + Sync {
    /// Makes experts `ids` of `layer` available (reads start at once; `get` waits).
    fn ensure(&self, layer: usize, ids: &[usize]) -> Result<ExpertSet<'_>, ExpertError>;
    /// Starts reading experts likely needed soon, without pinning them; a no-op
    /// for stores that hold everything.
    fn prefetch(&self, _layer: usize, _ids: &[usize]) {}
    /// A short name for logs and benchmarks (`mapped`, `resident`, `stream`).
    fn kind(&self) -> &'static str;
    /// The most experts one `ensure` may ask for (unbounded unless the store has slots).
    fn capacity(&self) -> usize {
        usize::MAX
    }
    /// Hits, misses, bytes read and wait times so far, where the store counts them.
    fn stats(&self) -> Option<StatsSnapshot> {
        None
    }
    /// Bytes of expert data the store holds in memory it owns.
    fn resident_bytes(&self) -> u64 {
        0
    }
    /// Repacks the experts the store holds in memory it owns with `pack`, for a backend that
    /// reads them in another layout; [`ExpertBytes::packed`] then says which are. Returns how
    /// many matrices were repacked, or will be as they are read (a streaming store's); a store
    /// that maps its experts repacks none (the mapping must stay the file's, pageable).
    fn pack(&mut self, pack: Packer) -> usize {
        let _ = pack;
        0
    }
}
