//! Block layouts, field for field as ggml's `ggml-common.h` declares them.
//!
//! Every block is `#[repr(C)]` without padding, so a tensor's bytes (little-endian, as GGUF
//! stores them) can be viewed in place as a slice of blocks with [`view_blocks`].

use std::mem::{align_of, size_of};

use bytemuck::{Pod, PodCastError, Zeroable};
use half::f16;
use ts_gguf::GgmlType;

use crate::QuantError;

#[cfg(target_endian = "big")]
compile_error!("ts-quant views little-endian GGUF data in place and needs a little-endian target");

/// Super-block size of the k-quants.
pub const QK_K: usize = 256;

/// A quantized block: a fixed number of elements stored in a fixed number of bytes.
pub trait Block: Pod {
    /// The ggml type whose tensors are made of this block.
    const TYPE: GgmlType;
    /// Elements one block decodes to.
    const ELEMENTS: usize;
}

/// Views `bytes` as blocks without copying.
///
/// Fails when the length is not a whole number of blocks or when `bytes` is not aligned for
/// the block (2 bytes for blocks holding an `f16`, 4 for [`BlockQ8K`]); tensor data in a GGUF
/// file is aligned far beyond that.
pub fn view_blocks<B: Block>(bytes: &[u8]) -> Result<&[B], QuantError> {
    if bytes.is_empty() {
        return Ok(&[]);
    }
    bytemuck::try_cast_slice(bytes).map_err(|e| cast_error::<B>(e, bytes.len()))
}

/// Mutable form of [`view_blocks`].
pub fn view_blocks_mut<B: Block>(bytes: &mut [u8]) -> Result<&mut [B], QuantError> {
    if bytes.is_empty() {
        return Ok(&mut []);
    }
    let len = bytes.len();
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| cast_error::<B>(e, len))
}

fn cast_error<B: Block>(error: PodCastError, len: usize) -> QuantError {
    match error {
        PodCastError::TargetAlignmentGreaterAndInputNotAligned => {
            QuantError::Misaligned { ty: B::TYPE, align: align_of::<B>() }
        }
        _ => QuantError::PartialBlockBytes { ty: B::TYPE, bytes: len, block_bytes: size_of::<B>() },
    }
}

macro_rules! block {
    ($name:ident, $ty:ident, $elements:expr, $bytes:expr) => {
        const _: () = assert!(size_of::<$name>() == $bytes);
        impl Block for $name {
            const TYPE: GgmlType = GgmlType::$ty;
            const ELEMENTS: usize = $elements;
        }
    };
}

/// Q4_0: 32 weights as 4-bit unsigned `q` with one scale; `x = d * (q - 8)`.
/// Byte `j` of `qs` holds element `j` in its low nibble and element `j + 16` in its high nibble.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; 16],
}
block!(BlockQ4_0, Q4_0, 32, 18);

/// Q4_1: 32 weights as 4-bit `q` with a scale and an offset; `x = d * q + m`.
/// Nibbles are packed as in [`BlockQ4_0`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; 16],
}
block!(BlockQ4_1, Q4_1, 32, 20);

/// Q5_0: 32 weights as 5-bit `q` with one scale; `x = d * (q - 16)`.
/// Low 4 bits are packed as in [`BlockQ4_0`]; bit `j` of the little-endian `qh` is bit 4 of element `j`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}
block!(BlockQ5_0, Q5_0, 32, 22);

/// Q5_1: 32 weights as 5-bit `q` with a scale and an offset; `x = d * q + m`.
/// Bits are packed as in [`BlockQ5_0`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}
block!(BlockQ5_1, Q5_1, 32, 24);

/// Q8_0: 32 values as `i8` with one scale; `x = d * q`. Also the activation format for
/// Q4_0, Q5_0, Q8_0 and MXFP4 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; 32],
}
block!(BlockQ8_0, Q8_0, 32, 34);

/// Q8_1: Q8_0 plus `s = d * sum(qs)`, the activation format for Q4_1 and Q5_1 weights,
/// whose offset term needs the sum of the activations; `x = d * q`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; 32],
}
block!(BlockQ8_1, Q8_1, 32, 36);

/// Q2_K: 256 weights in 16 groups of 16, 2-bit `q`.
/// Byte `g` of `scales` holds group `g`'s 4-bit scale (low nibble) and 4-bit min (high nibble);
/// `x = d * scale * q - dmin * min`. In each half of 128 weights, byte `l` of that half's
/// 32 `qs` bytes holds elements `l`, `l + 32`, `l + 64`, `l + 96` in bits 0-1, 2-3, 4-5, 6-7.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ2K {
    pub scales: [u8; 16],
    pub qs: [u8; 64],
    pub d: f16,
    pub dmin: f16,
}
block!(BlockQ2K, Q2_K, QK_K, 84);

/// Q3_K: 256 weights in 16 groups of 16, 3-bit `q` stored as 2 low bits (packed as in
/// [`BlockQ2K`]) plus a high bit in `hmask` (element `i`: byte `i % 32`, bit `i / 32`).
/// Groups have 6-bit scales packed into 12 bytes; `x = d * (scale - 32) * (q - 4)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ3K {
    pub hmask: [u8; 32],
    pub qs: [u8; 64],
    pub scales: [u8; 12],
    pub d: f16,
}
block!(BlockQ3K, Q3_K, QK_K, 110);

/// Q4_K: 256 weights in 8 groups of 32, 4-bit `q`, with a 6-bit scale and a 6-bit min per
/// group packed into 12 bytes; `x = d * scale * q - dmin * min`. Each 32 `qs` bytes hold two
/// groups: the earlier in the low nibbles, the later in the high nibbles.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}
block!(BlockQ4K, Q4_K, QK_K, 144);

/// Q5_K: Q4_K with a fifth bit per weight in `qh` (element `i`: byte `i % 32`, bit `i / 32`);
/// `x = d * scale * q - dmin * min`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}
block!(BlockQ5K, Q5_K, QK_K, 176);

/// Q6_K: 256 weights in 16 groups of 16, 6-bit `q` as 4 low bits in `ql` and 2 high bits in
/// `qh`, with an `i8` scale per group; `x = d * scale * (q - 32)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    pub scales: [i8; 16],
    pub d: f16,
}
block!(BlockQ6K, Q6_K, QK_K, 210);

/// Q8_K: 256 activations as `i8` with an `f32` scale, `x = d * q`, plus the sum of each group
/// of 16 quants so that k-quant dot products get their min terms cheaply. Activation format
/// of all k-quants; 4-byte aligned.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; 16],
}
block!(BlockQ8K, Q8_K, QK_K, 292);

/// MXFP4 (OCP microscaling): 32 weights as 4-bit E2M1 codes with a shared power-of-two
/// scale `e` (E8M0); `x = 2^(e - 127) * fp4(q)`. Nibbles are packed as in [`BlockQ4_0`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockMxfp4 {
    pub e: u8,
    pub qs: [u8; 16],
}
block!(BlockMxfp4, MXFP4, 32, 17);

#[cfg(test)]
mod tests {
    use super::*;

    fn check<B: Block>() {
        assert_eq!(size_of::<B>() as u64, B::TYPE.type_size(), "{}", B::TYPE);
        assert_eq!(B::ELEMENTS as u64, B::TYPE.block_size(), "{}", B::TYPE);
    }

    #[test]
    fn sizes_match_ggml_type_table() {
        check::<BlockQ4_0>();
        check::<BlockQ4_1>();
        check::<BlockQ5_0>();
        check::<BlockQ5_1>();
        check::<BlockQ8_0>();
        check::<BlockQ8_1>();
        check::<BlockQ2K>();
        check::<BlockQ3K>();
        check::<BlockQ4K>();
        check::<BlockQ5K>();
        check::<BlockQ6K>();
        check::<BlockQ8K>();
        check::<BlockMxfp4>();
    }

    #[test]
    fn views_reject_bad_lengths_and_misalignment() {
        let storage = [0u32; 32];
        let bytes: &[u8] = bytemuck::cast_slice(&storage);
        assert_eq!(view_blocks::<BlockQ4_0>(&bytes[..36]).unwrap().len(), 2);
        assert!(matches!(view_blocks::<BlockQ4_0>(&bytes[..35]), Err(QuantError::PartialBlockBytes { .. })));
        assert!(matches!(view_blocks::<BlockQ4_0>(&bytes[1..37]), Err(QuantError::Misaligned { align: 2, .. })));
        assert_eq!(view_blocks::<BlockMxfp4>(&bytes[1..35]).unwrap().len(), 2);
        assert!(view_blocks::<BlockQ8K>(&[]).unwrap().is_empty());
    }
}
