//! Weights as the model sees them: a typed, shaped view of bytes that live in
//! the mapped GGUF file (or in memory the process owns).

use std::sync::Arc;
use ts_gguf::{GgmlType, GgufFile, TensorInfo};

/// A tensor of the model, in its GGUF type and ggml-order shape.
#[derive(Clone)]
pub struct Weight {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<usize>,
    data: WeightData,
    /// Bytes from one matrix of a stacked tensor to the next, where they are not
    /// packed (gate and up as halves of one fused expert tensor).
    stride: Option<usize>,
    /// The bytes are in the CPU's packed layout ([`pack_for_cpu`]), which only
    /// ts-cpu's packed kernels read.
    packed: bool,
}

#[derive(Clone)]
enum WeightData {
    /// Bytes `start..start + len` of the mapped file.
    Mapped { file: Arc<GgufFile>, start: usize, len: usize },
    /// Bytes the process owns (f32 tables built at open, resident copies).
    Owned(Arc<[u8]>),
    /// Bytes `start..start + len` of a region the process owns, shared with other matrices
    /// ([`pack_for_cpu`]: packed matrices laid end to end in 2 MiB pages).
    InRegion { region: Arc<ts_experts::HugeBytes>, start: usize, len: usize },
}

impl Weight {
    pub fn mapped(file: &Arc<GgufFile>, info: &TensorInfo) -> Weight {
        Weight {
            name: info.name.clone(),
            ty: info.ggml_type,
            dims: info.dims.iter().map(|&d| d as usize).collect(),
            data: WeightData::Mapped {
                file: file.clone(),
                start: file.tensor_file_offset(info) as usize,
                len: info.n_bytes as usize,
            },
            stride: None,
            packed: false,
        }
    }

    /// An f32 tensor built in memory.
    pub fn from_f32(name: &str, dims: Vec<usize>, values: &[f32]) -> Weight {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Weight {
            name: name.into(),
            ty: GgmlType::F32,
            dims,
            data: WeightData::Owned(bytes.into()),
            stride: None,
            packed: false,
        }
    }

    /// A tensor of any type from bytes in memory (tests, converted tables).
    pub fn from_bytes(name: &str, ty: GgmlType, dims: Vec<usize>, bytes: Vec<u8>) -> Weight {
        Weight { name: name.into(), ty, dims, data: WeightData::Owned(bytes.into()), stride: None, packed: false }
    }

    /// Absolute file offset of the first byte, for a tensor read from the file.
    pub fn file_offset(&self) -> Option<u64> {
        match &self.data {
            WeightData::Mapped { start, .. } => Some(*start as u64),
            WeightData::Owned(_) | WeightData::InRegion { .. } => None,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            WeightData::Mapped { file, start, len } => &file.mapped()[*start..*start + *len],
            WeightData::Owned(b) => b,
            WeightData::InRegion { region, start, len } => &region[*start..*start + *len],
        }
    }

    /// Whether the bytes are in the CPU's packed layout ([`pack_for_cpu`]).
    pub fn is_packed(&self) -> bool {
        self.packed
    }

    /// Whether [`pack_for_cpu`] would pack this matrix.
    pub fn packs_for_cpu(&self) -> bool {
        let (ty, n_rows) = (self.ty, self.n_rows());
        !self.packed && self.dims.len() == 2 && ts_cpu::dense_packed_is_faster(ty) && ts_cpu::packs(ty, n_rows)
    }

    /// Copies this matrix into `dst` (its size) and repacks it there into the layout of the
    /// CPU's packed kernels ([`ts_cpu::pack_rows`]); false where the kernels take it as it is.
    /// Pieces of whole 16-row panels (about 8 MiB) are copied and packed on rayon's threads (the
    /// kernel zeroes the 2 MiB pages a copy first touches, at about 1 GB/s a thread in a VM), and
    /// the mapped bytes each was copied from are released as it is done
    /// ([`ts_gguf::GgufFile::release`]): the bytes are never resident twice over (a Gemma 3
    /// head is 170 MiB).
    fn pack_into(&self, dst: &mut [u8]) -> Result<bool, String> {
        use rayon::prelude::*;
        const PIECE: usize = 8 << 20;
        let src = self.bytes();
        if src.is_empty() {
            return Ok(false);
        }
        let row_bytes = self.row_bytes().max(1);
        let rows = (PIECE / row_bytes / 16).max(1) * 16;
        let release = |range: std::ops::Range<usize>| {
            if let WeightData::Mapped { file, start, .. } = &self.data {
                file.release(start + range.start..start + range.end);
            }
        };
        let packed: Vec<bool> = dst
            .par_chunks_mut(rows * row_bytes)
            .zip(src.par_chunks(rows * row_bytes))
            .enumerate()
            .map(|(i, (out, from))| {
                out.copy_from_slice(from);
                let at = i * rows * row_bytes;
                release(at..at + from.len());
                ts_cpu::pack_rows(self.ty, out, from.len() / row_bytes, self.row_len())
                    .map_err(|e| format!("{}: {e}", self.name))
            })
            .collect::<Result<_, String>>()?;
        // The pages pieces shared at their ends too.
        release(0..src.len());
        if packed.iter().all(|&p| p) {
            Ok(true)
        } else if packed.iter().any(|&p| p) {
            Err(format!("{}: some of its rows were packed and some not", self.name))
        } else {
            Ok(false)
        }
    }

    /// Elements per row (`dims[0]`).
    pub fn row_len(&self) -> usize {
        self.dims[0]
    }

    /// Rows in one matrix (`dims[1]`, or 1 for a vector).
    pub fn n_rows(&self) -> usize {
        self.dims.get(1).copied().unwrap_or(1)
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_len() / self.ty.block_size() as usize * self.ty.type_size() as usize
    }

    /// The bytes of matrix `index` of a stacked 3-D tensor (an expert).
    pub fn matrix_bytes(&self, index: usize) -> &[u8] {
        let (size, stride) = (self.row_bytes() * self.n_rows(), self.matrix_stride());
        &self.bytes()[index * stride..index * stride + size]
    }

    /// Bytes from one matrix of a stacked tensor to the next.
    pub fn matrix_stride(&self) -> usize {
        self.stride.unwrap_or(self.row_bytes() * self.n_rows())
    }

    /// Rows `first..first + n` of every matrix of this stacked tensor, as a
    /// stacked tensor of its own over the same bytes (the gate or the up half
    /// of a fused `ffn_gate_up_exps`).
    pub fn matrix_rows(&self, name: &str, first: usize, n: usize) -> Weight {
        let (rb, stride, count) = (self.row_bytes(), self.matrix_stride(), self.dims.get(2).copied().unwrap_or(1));
        let span = (count - 1) * stride + n * rb;
        let data = match &self.data {
            WeightData::Mapped { file, start, .. } => {
                WeightData::Mapped { file: file.clone(), start: start + first * rb, len: span }
            }
            WeightData::Owned(b) => WeightData::Owned(b[first * rb..first * rb + span].into()),
            WeightData::InRegion { region, start, .. } => {
                WeightData::InRegion { region: region.clone(), start: start + first * rb, len: span }
            }
        };
        Weight {
            name: name.into(),
            ty: self.ty,
            dims: vec![self.row_len(), n, count],
            data,
            stride: Some(stride),
            packed: self.packed,
        }
    }

    /// The bytes from the start of `self` to the end of `other` where both lie
    /// in one mapped file, `self` first: the two halves of a fused tensor, to be
    /// put on a device as one.
    pub fn span_through(&self, other: &Weight) -> Option<&[u8]> {
        match (&self.data, &other.data) {
            (WeightData::Mapped { file, start, .. }, WeightData::Mapped { file: f2, start: s2, len: l2 })
                if Arc::ptr_eq(file, f2) && s2 + l2 >= *start =>
            {
                Some(&file.mapped()[*start..s2 + l2])
            }
            _ => None,
        }
    }

    /// A new matrix of rows `rows` of this one, in that order (bytes copied).
    pub fn select_rows(&self, name: &str, rows: &[usize]) -> Weight {
        let rb = self.row_bytes();
        let bytes = rows.iter().flat_map(|&r| self.bytes()[r * rb..(r + 1) * rb].iter().copied()).collect();
        Weight::from_bytes(name, self.ty, vec![self.row_len(), rows.len()], bytes)
    }

    /// Columns `first..first + n` of every row, as a new matrix `[n, n_rows]` (bytes copied):
    /// one half of the MTP head's `eh_proj`. `first` and `n` must fall on the type's blocks.
    pub fn select_columns(&self, name: &str, first: usize, n: usize) -> Result<Weight, String> {
        let (k, block) = (self.row_len(), self.ty.block_size() as usize);
        if !first.is_multiple_of(block) || !n.is_multiple_of(block) || first + n > k {
            return Err(format!(
                "{}: columns {first}..{} of rows of {k} do not fall on its {block}-element blocks",
                self.name,
                first + n
            ));
        }
        let (rb, per_block) = (self.row_bytes(), self.ty.type_size() as usize);
        let (start, len) = (first / block * per_block, n / block * per_block);
        let bytes = (0..self.n_rows())
            .flat_map(|r| self.bytes()[r * rb + start..r * rb + start + len].iter().copied())
            .collect();
        Ok(Weight::from_bytes(name, self.ty, vec![n, self.n_rows()], bytes))
    }

    /// The whole tensor as f32 (norm weights, biases, small tables).
    pub fn to_f32(&self) -> Vec<f32> {
        let n: usize = self.dims.iter().product();
        let mut out = vec![0f32; n];
        ts_quant::dequantize(self.ty, self.bytes(), &mut out).expect("type checked at open");
        out
    }
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.ty, self.dims)
    }
}

/// Repacks `matrices` (those [`Weight::packs_for_cpu`] names) into one region the process owns,
/// laid end to end on 64-byte boundaries in 2 MiB pages ([`ts_experts::HugeBytes`]: the layers'
/// packed products read 4-8% faster so on Zen 4 than each matrix in its own allocation), in the
/// layout of the CPU's packed kernels, where that makes their one-row products faster
/// ([`ts_cpu::dense_packed_is_faster`]: decode reads them at the memory's speed, not the
/// kernel's); the others are left as they are. Returns how many were packed (a matrix the
/// kernels take as it is stays in its GGUF blocks in the region).
pub fn pack_for_cpu(matrices: &mut [&mut Weight]) -> Result<usize, String> {
    let place = |len: usize| len.next_multiple_of(64);
    let total = matrices.iter().filter(|m| m.packs_for_cpu()).map(|m| place(m.bytes().len())).sum();
    if total == 0 {
        return Ok(0);
    }
    let mut region =
        ts_experts::HugeBytes::new(total).map_err(|e| format!("{total} bytes for packed matrices: {e}"))?;
    // Each copied matrix reads its region bytes from now on, packed or not: its mapped pages
    // were released as they were copied.
    let mut placed = Vec::new();
    let mut at = 0;
    for (i, m) in matrices.iter().enumerate().filter(|(_, m)| m.packs_for_cpu()) {
        let len = m.bytes().len();
        placed.push((i, at, len, m.pack_into(&mut region[at..at + len])?));
        at += place(len);
    }
    let region = Arc::new(region);
    for &(i, start, len, packed) in &placed {
        let m = &mut matrices[i];
        m.data = WeightData::InRegion { region: region.clone(), start, len };
        m.packed = packed;
    }
    Ok(placed.iter().filter(|p| p.3).count())
}
