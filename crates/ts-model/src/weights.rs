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
        }
    }

    /// An f32 tensor built in memory.
    pub fn from_f32(name: &str, dims: Vec<usize>, values: &[f32]) -> Weight {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Weight { name: name.into(), ty: GgmlType::F32, dims, data: WeightData::Owned(bytes.into()) }
    }

    /// A tensor of any type from bytes in memory (tests, converted tables).
    pub fn from_bytes(name: &str, ty: GgmlType, dims: Vec<usize>, bytes: Vec<u8>) -> Weight {
        Weight { name: name.into(), ty, dims, data: WeightData::Owned(bytes.into()) }
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
        let size = self.row_bytes() * self.n_rows();
        &self.bytes()[index * size..(index + 1) * size]
    }

    /// A new matrix of rows `rows` of this one, in that order (bytes copied).
    pub fn select_rows(&self, name: &str, rows: &[usize]) -> Weight {
        let rb = self.row_bytes();
        let bytes = rows.iter().flat_map(|&r| self.bytes()[r * rb..(r + 1) * rb].iter().copied()).collect();
        Weight::from_bytes(name, self.ty, vec![self.row_len(), rows.len()], bytes)
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
