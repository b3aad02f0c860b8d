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
    /// The bytes are in the CPU's packed layout ([`Weight::packed_for_cpu`]), which only
    /// ts-cpu's packed kernels read.
    packed: bool,
}

#[derive(Clone)]
enum WeightData {
    /// Bytes `start..start + len` of the mapped file.
    Mapped { file: Arc<GgufFile>, start: usize, len: usize },
    /// Bytes the process owns (f32 tables built at open, resident copies).
    Owned(Arc<[u8]>),
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
            WeightData::Owned(_) => None,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            WeightData::Mapped { file, start, len } => &file.mapped()[*start..*start + *len],
            WeightData::Owned(b) => b,
        }
    }

    /// Whether the bytes are in the CPU's packed layout ([`Weight::packed_for_cpu`]).
    pub fn is_packed(&self) -> bool {
        self.packed
    }

    /// Whether [`Weight::packed_for_cpu`] would pack this matrix.
    pub fn packs_for_cpu(&self) -> bool {
        let (ty, n_rows) = (self.ty, self.n_rows());
        !self.packed && self.dims.len() == 2 && ts_cpu::dense_packed_is_faster(ty) && ts_cpu::packs(ty, n_rows)
    }

    /// This matrix repacked in memory the process owns into the layout of the CPU's packed
    /// kernels ([`ts_cpu::pack_rows`]), where that makes its one-row products faster
    /// ([`ts_cpu::dense_packed_is_faster`]: decode reads it at the memory's speed, not the
    /// kernel's) and its rows fill whole panels; None otherwise. The mapped bytes it was
    /// copied from are released ([`ts_gguf::GgufFile::release`]): the copy replaces them.
    pub fn packed_for_cpu(&self) -> Result<Option<Weight>, String> {
        let (ty, n_rows) = (self.ty, self.n_rows());
        if !self.packs_for_cpu() {
            return Ok(None);
        }
        // One allocation (a Vec turned into an Arc would be a second copy), in 2 MiB pages
        // where the kernel gives them, filled a piece at a time with each piece's mapped pages
        // released once copied: the bytes are never resident twice over (a Gemma 3 head is 170 MiB).
        const PIECE: usize = 8 << 20;
        let src = self.bytes();
        let mut owned = Arc::<[u8]>::new_uninit_slice(src.len());
        let uninit = Arc::get_mut(&mut owned).expect("a new Arc has one owner");
        ts_experts::ask_for_huge_pages(uninit);
        let mut at = 0;
        while at < src.len() {
            let end = match &self.data {
                // Pieces end on the map's PIECE boundaries, so that every page is released.
                WeightData::Mapped { start, .. } => ((start + at) / PIECE + 1) * PIECE - start,
                WeightData::Owned(_) => at + PIECE,
            }
            .min(src.len());
            // SAFETY: `at..end` lies inside both; the pieces cover every byte once.
            unsafe {
                std::ptr::copy_nonoverlapping(src[at..end].as_ptr(), uninit[at..end].as_mut_ptr().cast(), end - at)
            };
            if let WeightData::Mapped { file, start, .. } = &self.data {
                file.release(start + at..start + end);
            }
            at = end;
        }
        // SAFETY: every byte was written above.
        let mut owned = unsafe { owned.assume_init() };
        let bytes = Arc::get_mut(&mut owned).expect("a new Arc has one owner");
        match ts_cpu::pack_rows(ty, bytes, n_rows, self.row_len()) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", self.name)),
        }
        Ok(Some(Weight { data: WeightData::Owned(owned), packed: true, ..self.clone() }))
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
