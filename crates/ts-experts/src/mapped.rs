//! Experts read through the memory map, or copied into memory at open.

use crate::{ExpertBytes, ExpertError, ExpertLayout, ExpertSet, ExpertStore, Packer};
use std::sync::Arc;
use ts_gguf::GgufFile;

/// Pages of the mapped file; the operating system decides what stays (llama.cpp's default).
pub struct MappedExperts {
    file: Arc<GgufFile>,
    layout: ExpertLayout,
}

impl MappedExperts {
    pub fn new(file: Arc<GgufFile>, layout: ExpertLayout) -> MappedExperts {
        MappedExperts { file, layout }
    }
}

impl ExpertStore for MappedExperts {
    fn ensure(&self, layer: usize, ids: &[usize]) -> Result<ExpertSet<'_>, ExpertError> {
        let l = self.layout.check(layer, ids)?;
        let map = self.file.mapped();
        let slice = |p: usize, e: usize| {
            let pr = l.proj[p];
            let start = pr.offset(e) as usize;
            &map[start..start + pr.expert_bytes]
        };
        Ok(ExpertSet::ready(
            ids.iter()
                .map(|&e| ExpertBytes { gate: slice(0, e), up: slice(1, e), down: slice(2, e), packed: [false; 3] })
                .collect(),
        ))
    }

    fn kind(&self) -> &'static str {
        "mapped"
    }
}

/// Every expert copied at open into u64-aligned memory the process owns.
pub struct ResidentExperts {
    layout: ExpertLayout,
    /// Per layer, per projection: all experts' matrices back to back.
    data: Vec<Option<[Vec<u64>; 3]>>,
    /// Per layer, per projection: repacked by [`ExpertStore::pack`].
    packed: Vec<[bool; 3]>,
}

/// Bytes a positioned read of [`ResidentExperts::new`] takes at most: reads run in parallel, so
/// that the kernel's zeroing of the pages they first touch (2 MiB pages, where
/// [`crate::ask_for_huge_pages`] got them) runs on every thread.
const READ_PIECE: usize = 32 << 20;

impl ResidentExperts {
    /// Reads every expert with positioned reads (not through the map, so the
    /// copies are the only place the bytes count towards this process's memory), in pieces of
    /// at most [`READ_PIECE`] bytes on rayon's threads. In a VM a first touch of fresh memory
    /// is slow: the qwen3-30b-a3b cut's 3 GB of experts took 3.4 s of page zeroing on one
    /// thread (docs/BENCHMARKS.md).
    pub fn new(file: &GgufFile, layout: ExpertLayout) -> Result<ResidentExperts, ExpertError> {
        use rayon::prelude::*;
        use std::os::unix::fs::FileExt;
        // Every buffer first, asked for 2 MiB pages before anything touches it.
        let mut data: Vec<Option<[Vec<u64>; 3]>> = layout
            .layers
            .iter()
            .map(|l| {
                l.as_ref().map(|l| {
                    l.proj.map(|p| {
                        let words = vec![0u64; (p.expert_bytes * l.n_expert).div_ceil(8)];
                        crate::ask_for_huge_pages(&words);
                        words
                    })
                })
            })
            .collect();
        // (layer, the expert the piece begins in, file offset, its bytes)
        let mut pieces: Vec<(usize, usize, u64, &mut [u8])> = Vec::new();
        for (layer, (l, projs)) in layout.layers.iter().zip(&mut data).enumerate() {
            let (Some(l), Some(projs)) = (l, projs) else { continue };
            for (words, p) in projs.iter_mut().zip(l.proj) {
                let len = p.expert_bytes * l.n_expert;
                let mut rest = &mut bytemuck::cast_slice_mut::<u64, u8>(words)[..len];
                // Packed experts in one run; strided ones (halves of a fused tensor) one at a time.
                let runs: Vec<(usize, u64, usize)> = if p.stride == p.expert_bytes {
                    vec![(0, p.file_offset, len)]
                } else {
                    (0..l.n_expert).map(|e| (e * p.expert_bytes, p.offset(e), p.expert_bytes)).collect()
                };
                for (at, offset, n) in runs {
                    for start in (0..n).step_by(READ_PIECE) {
                        let (piece, tail) = std::mem::take(&mut rest).split_at_mut(READ_PIECE.min(n - start));
                        pieces.push((layer, (at + start) / p.expert_bytes.max(1), offset + start as u64, piece));
                        rest = tail;
                    }
                }
            }
        }
        pieces.into_par_iter().try_for_each(|(layer, expert, offset, piece)| {
            let len = piece.len();
            file.file().read_exact_at(piece, offset).map_err(|error| ExpertError::Read {
                path: layout.path.clone(),
                layer,
                expert,
                offset,
                len,
                error,
            })
        })?;
        let packed = vec![[false; 3]; data.len()];
        Ok(ResidentExperts { layout, data, packed })
    }
}

impl ExpertStore for ResidentExperts {
    fn ensure(&self, layer: usize, ids: &[usize]) -> Result<ExpertSet<'_>, ExpertError> {
        let l = self.layout.check(layer, ids)?;
        let d = self.data[layer].as_ref().ok_or(ExpertError::NoExperts(layer))?;
        let slice = |p: usize, e: usize| {
            let size = l.proj[p].expert_bytes;
            &bytemuck::cast_slice::<u64, u8>(&d[p])[e * size..(e + 1) * size]
        };
        let packed = self.packed[layer];
        Ok(ExpertSet::ready(
            ids.iter()
                .map(|&e| ExpertBytes { gate: slice(0, e), up: slice(1, e), down: slice(2, e), packed })
                .collect(),
        ))
    }

    fn pack(&mut self, pack: Packer) -> usize {
        use rayon::prelude::*;
        let mut count = 0;
        for (layer, (data, packed)) in self.data.iter_mut().zip(&mut self.packed).enumerate() {
            let (Some(data), Some(l)) = (data, self.layout.layers[layer].as_ref()) else { continue };
            for (p, words) in data.iter_mut().enumerate() {
                // Repacking twice would scramble them.
                if packed[p] || !pack.packs(layer, p, false) {
                    continue;
                }
                let size = l.proj[p].expert_bytes;
                let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(words)[..size * l.n_expert];
                bytes.par_chunks_mut(size.max(1)).for_each(|m| pack.pack(layer, p, m));
                packed[p] = true;
                count += l.n_expert;
            }
        }
        count
    }

    fn kind(&self) -> &'static str {
        "resident"
    }

    fn resident_bytes(&self) -> u64 {
        self.layout.total_bytes()
    }
}
