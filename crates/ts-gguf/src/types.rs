//! ggml tensor type ids as GGUF stores them, with their block geometry.
//!
//! Ids, names and sizes follow `ggml.h` / `ggml.c` and gguf-py's `GGML_QUANT_SIZES`.
//! Every id ggml has ever assigned is listed so that a file using a type this
//! engine cannot compute is still described by name; ids ggml removed are
//! refused with their old name.

/// A tensor element type known to ggml.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
    Q2_0,
}

/// Super-block size of the k-quants and i-quants.
pub const QK_K: u64 = 256;

/// (type, id, name, elements per block, bytes per block)
const TABLE: &[(GgmlType, u32, &str, u64, u64)] = {
    use GgmlType::*;
    &[
        (F32, 0, "F32", 1, 4),
        (F16, 1, "F16", 1, 2),
        (Q4_0, 2, "Q4_0", 32, 2 + 16),
        (Q4_1, 3, "Q4_1", 32, 2 + 2 + 16),
        (Q5_0, 6, "Q5_0", 32, 2 + 4 + 16),
        (Q5_1, 7, "Q5_1", 32, 2 + 2 + 4 + 16),
        (Q8_0, 8, "Q8_0", 32, 2 + 32),
        (Q8_1, 9, "Q8_1", 32, 2 + 2 + 32),
        (Q2_K, 10, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
        (Q3_K, 11, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
        (Q4_K, 12, "Q4_K", QK_K, 2 + 2 + QK_K / 2 + 12),
        (Q5_K, 13, "Q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
        (Q6_K, 14, "Q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
        (Q8_K, 15, "Q8_K", QK_K, 4 + QK_K + QK_K / 8),
        (IQ2_XXS, 16, "IQ2_XXS", QK_K, 2 + QK_K / 4),
        (IQ2_XS, 17, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32),
        (IQ3_XXS, 18, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8),
        (IQ1_S, 19, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16),
        (IQ4_NL, 20, "IQ4_NL", 32, 2 + 16),
        (IQ3_S, 21, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
        (IQ2_S, 22, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16),
        (IQ4_XS, 23, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
        (I8, 24, "I8", 1, 1),
        (I16, 25, "I16", 1, 2),
        (I32, 26, "I32", 1, 4),
        (I64, 27, "I64", 1, 8),
        (F64, 28, "F64", 1, 8),
        (IQ1_M, 29, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
        (BF16, 30, "BF16", 1, 2),
        (TQ1_0, 34, "TQ1_0", QK_K, 2 + 4 * 13),
        (TQ2_0, 35, "TQ2_0", QK_K, 2 + 64),
        (MXFP4, 39, "MXFP4", 32, 1 + 16),
        (NVFP4, 40, "NVFP4", 64, 4 + 32),
        (Q1_0, 41, "Q1_0", 128, 2 + 16),
        (Q2_0, 42, "Q2_0", 64, 2 + 16),
    ]
};

/// Ids ggml assigned once and later removed from GGUF, with their old names.
const REMOVED: &[(u32, &str)] = &[
    (4, "Q4_2"),
    (5, "Q4_3"),
    (31, "Q4_0_4_4"),
    (32, "Q4_0_4_8"),
    (33, "Q4_0_8_8"),
    (36, "IQ4_NL_4_4"),
    (37, "IQ4_NL_4_8"),
    (38, "IQ4_NL_8_8"),
];

/// Why a type id read from a file cannot be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TypeIdError {
    /// ggml once used this id, then removed the type from GGUF.
    Removed { id: u32, name: &'static str },
    /// No ggml type has ever had this id.
    Unknown { id: u32 },
}

impl std::fmt::Display for TypeIdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TypeIdError::Removed { id, name } => {
                write!(f, "ggml type {name} (id {id}) was removed from GGUF; re-quantize the model")
            }
            TypeIdError::Unknown { id } => write!(f, "unknown ggml type id {id}"),
        }
    }
}

impl GgmlType {
    fn entry(self) -> &'static (GgmlType, u32, &'static str, u64, u64) {
        TABLE.iter().find(|e| e.0 == self).expect("every GgmlType is in TABLE")
    }

    /// Every type ggml currently defines, in id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|e| e.0)
    }

    /// The type stored under `id`, or why there is none.
    pub fn from_id(id: u32) -> Result<GgmlType, TypeIdError> {
        if let Some(e) = TABLE.iter().find(|e| e.1 == id) {
            return Ok(e.0);
        }
        match REMOVED.iter().find(|r| r.0 == id) {
            Some(&(id, name)) => Err(TypeIdError::Removed { id, name }),
            None => Err(TypeIdError::Unknown { id }),
        }
    }

    /// The type whose name is `name` (case-insensitive), e.g. "q4_k".
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TABLE.iter().find(|e| e.2.eq_ignore_ascii_case(name)).map(|e| e.0)
    }

    pub fn id(self) -> u32 {
        self.entry().1
    }

    pub fn name(self) -> &'static str {
        self.entry().2
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> u64 {
        self.entry().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.entry().4
    }

    /// Whether the type is quantized in blocks (not a plain scalar type).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes taken by `n_elements` elements, or `None` when `n_elements` is
    /// not a whole number of blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size();
        if !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for t in GgmlType::all() {
            assert_eq!(GgmlType::from_id(t.id()), Ok(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        let mut ids: Vec<u32> = TABLE.iter().map(|e| e.1).collect();
        ids.extend(REMOVED.iter().map(|r| r.0));
        let n = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), n);
    }

    #[test]
    fn removed_and_unknown_ids_are_named() {
        assert_eq!(
            GgmlType::from_id(31).unwrap_err().to_string(),
            "ggml type Q4_0_4_4 (id 31) was removed from GGUF; re-quantize the model"
        );
        assert_eq!(GgmlType::from_id(999).unwrap_err().to_string(), "unknown ggml type id 999");
    }

    #[test]
    fn sizes_match_ggml() {
        assert_eq!(GgmlType::Q4_K.type_size(), 144);
        assert_eq!(GgmlType::Q6_K.type_size(), 210);
        assert_eq!(GgmlType::Q8_K.type_size(), 292);
        assert_eq!(GgmlType::MXFP4.type_size(), 17);
        assert_eq!(GgmlType::Q4_0.bytes_for(64), Some(36));
        assert_eq!(GgmlType::Q4_0.bytes_for(33), None);
    }
}
