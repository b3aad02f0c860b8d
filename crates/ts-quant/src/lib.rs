//! ggml's tensor block formats: reference dequantization, quantization and dot products.
//!
//! Block layouts follow ggml's `ggml-common.h`. Dequantization is bit-identical to
//! llama.cpp's `dequantize_row_*` and to the `gguf` Python package; quantizers reproduce
//! llama.cpp's reference quantizers (`quantize_row_*_ref`, no importance matrix) byte for
//! byte. Dot products take activations already quantized to [`vec_dot_type`] and work like
//! ggml-cpu's scalar code: an integer sum per block, scaled once per block.
//!
//! Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
//! Q8_K and MXFP4. Q8_1 and Q8_K are activation formats and have no dot product as weights.
//! Every other type is refused with an error naming it.

mod blocks;
mod convert;
mod float;
mod kquants;
mod legacy;
mod mxfp4;

pub use blocks::{
    Block, BlockMxfp4, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K,
    BlockQ8_0, BlockQ8_1, BlockQ8K, QK_K, view_blocks, view_blocks_mut,
};
pub use ts_gguf::GgmlType;

use GgmlType as T;

/// Why a conversion or dot product was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("tensor type {0} is not supported")]
    Unsupported(GgmlType),
    #[error("tensor type {0} is an activation format and has no dot product as weights")]
    NoDotProduct(GgmlType),
    #[error("{len} elements is not a whole number of {ty} blocks of {block_size}")]
    PartialBlock { ty: GgmlType, len: usize, block_size: usize },
    #[error("{bytes} bytes is not a whole number of {ty} blocks of {block_bytes} bytes")]
    PartialBlockBytes { ty: GgmlType, bytes: usize, block_bytes: usize },
    #[error("{what} holds {actual} bytes, but {elements} elements of {ty} take {expected}")]
    WrongLength { what: &'static str, ty: GgmlType, elements: usize, expected: usize, actual: usize },
    #[error("{ty} data must be aligned to {align} bytes to be viewed as blocks")]
    Misaligned { ty: GgmlType, align: usize },
}

/// Decoding and encoding of one block.
trait Codec: Block {
    /// Writes the block's `ELEMENTS` values to `out`.
    fn dequantize(&self, out: &mut [f32]);
    /// Encodes `ELEMENTS` values from `x`.
    fn quantize(x: &[f32]) -> Self;
}

/// The dot product of one weight block with the matching activation block.
trait Dot<A: Block>: Block {
    fn dot(&self, activations: &A) -> f32;
}

/// Whether `dequantize` and `quantize` handle `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    matches!(
        ty,
        T::F32
            | T::F16
            | T::BF16
            | T::Q4_0
            | T::Q4_1
            | T::Q5_0
            | T::Q5_1
            | T::Q8_0
            | T::Q8_1
            | T::Q2_K
            | T::Q3_K
            | T::Q4_K
            | T::Q5_K
            | T::Q6_K
            | T::Q8_K
            | T::MXFP4
    )
}

/// Bytes taken by `elements` elements of `ty`, or why that is not a whole number of blocks.
fn row_bytes(ty: GgmlType, elements: usize) -> Result<usize, QuantError> {
    let block_size = ty.block_size() as usize;
    if !elements.is_multiple_of(block_size) {
        return Err(QuantError::PartialBlock { ty, len: elements, block_size });
    }
    Ok(elements / block_size * ty.type_size() as usize)
}

fn check_bytes(what: &'static str, ty: GgmlType, elements: usize, actual: usize) -> Result<(), QuantError> {
    let expected = row_bytes(ty, elements)?;
    if actual != expected {
        return Err(QuantError::WrongLength { what, ty, elements, expected, actual });
    }
    Ok(())
}

/// Decodes `dst.len()` elements of type `ty` from `src` (scalar reference code).
///
/// `src` must hold exactly that many elements; for block types it must also be aligned for
/// the block (see [`view_blocks`]).
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !is_supported(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    check_bytes("source", ty, dst.len(), src.len())?;
    match ty {
        T::F32 => {
            float::dequantize(float::f32_at(src), dst);
            Ok(())
        }
        T::F16 => {
            float::dequantize(float::f16_at(src), dst);
            Ok(())
        }
        T::BF16 => {
            float::dequantize(float::bf16_at(src), dst);
            Ok(())
        }
        T::Q4_0 => dequantize_blocks::<BlockQ4_0>(src, dst),
        T::Q4_1 => dequantize_blocks::<BlockQ4_1>(src, dst),
        T::Q5_0 => dequantize_blocks::<BlockQ5_0>(src, dst),
        T::Q5_1 => dequantize_blocks::<BlockQ5_1>(src, dst),
        T::Q8_0 => dequantize_blocks::<BlockQ8_0>(src, dst),
        T::Q8_1 => dequantize_blocks::<BlockQ8_1>(src, dst),
        T::Q2_K => dequantize_blocks::<BlockQ2K>(src, dst),
        T::Q3_K => dequantize_blocks::<BlockQ3K>(src, dst),
        T::Q4_K => dequantize_blocks::<BlockQ4K>(src, dst),
        T::Q5_K => dequantize_blocks::<BlockQ5K>(src, dst),
        T::Q6_K => dequantize_blocks::<BlockQ6K>(src, dst),
        T::Q8_K => dequantize_blocks::<BlockQ8K>(src, dst),
        T::MXFP4 => dequantize_blocks::<BlockMxfp4>(src, dst),
        _ => Err(QuantError::Unsupported(ty)),
    }
}

/// Encodes `src` as type `ty` into `dst`, which must hold exactly `src.len()` elements of it.
///
/// Block types use llama.cpp's reference quantizers (no importance matrix) and give the same
/// bytes. F16 and BF16 round to nearest even.
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    if !is_supported(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    check_bytes("destination", ty, src.len(), dst.len())?;
    match ty {
        T::F32 => {
            float::quantize_f32(src, dst);
            Ok(())
        }
        T::F16 => {
            float::quantize_f16(src, dst);
            Ok(())
        }
        T::BF16 => {
            float::quantize_bf16(src, dst);
            Ok(())
        }
        T::Q4_0 => quantize_blocks::<BlockQ4_0>(src, dst),
        T::Q4_1 => quantize_blocks::<BlockQ4_1>(src, dst),
        T::Q5_0 => quantize_blocks::<BlockQ5_0>(src, dst),
        T::Q5_1 => quantize_blocks::<BlockQ5_1>(src, dst),
        T::Q8_0 => quantize_blocks::<BlockQ8_0>(src, dst),
        T::Q8_1 => quantize_blocks::<BlockQ8_1>(src, dst),
        T::Q2_K => quantize_blocks::<BlockQ2K>(src, dst),
        T::Q3_K => quantize_blocks::<BlockQ3K>(src, dst),
        T::Q4_K => quantize_blocks::<BlockQ4K>(src, dst),
        T::Q5_K => quantize_blocks::<BlockQ5K>(src, dst),
        T::Q6_K => quantize_blocks::<BlockQ6K>(src, dst),
        T::Q8_K => quantize_blocks::<BlockQ8K>(src, dst),
        T::MXFP4 => quantize_blocks::<BlockMxfp4>(src, dst),
        _ => Err(QuantError::Unsupported(ty)),
    }
}

/// The type activations are quantized to before a dot product with weights of type `ty`,
/// as llama.cpp's CPU backend chooses (ggml-cpu.c `type_traits_cpu`).
///
/// Types without a dot product in llama.cpp (Q8_1, Q8_K, the integer types, F64) map to
/// themselves; [`vec_dot`] refuses them.
pub fn vec_dot_type(ty: GgmlType) -> GgmlType {
    match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::MXFP4 | T::NVFP4 | T::IQ4_NL | T::Q1_0 | T::Q2_0 => T::Q8_0,
        T::Q4_1 | T::Q5_1 => T::Q8_1,
        T::Q2_K
        | T::Q3_K
        | T::Q4_K
        | T::Q5_K
        | T::Q6_K
        | T::IQ2_XXS
        | T::IQ2_XS
        | T::IQ2_S
        | T::IQ3_XXS
        | T::IQ3_S
        | T::IQ1_S
        | T::IQ1_M
        | T::IQ4_XS
        | T::TQ1_0
        | T::TQ2_0 => T::Q8_K,
        other => other,
    }
}

/// Dot product of one row of weights of type `ty` with one row of activations already
/// quantized to [`vec_dot_type`]`(ty)`, both holding the same number of elements.
///
/// Block types sum integer products per block and scale each block's sum once, accumulating
/// in f32; float types sum exact products in f64.
pub fn vec_dot(ty: GgmlType, weights_row: &[u8], activations_row: &[u8]) -> Result<f32, QuantError> {
    if matches!(ty, T::Q8_1 | T::Q8_K) {
        return Err(QuantError::NoDotProduct(ty));
    }
    if !is_supported(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    let block_bytes = ty.type_size() as usize;
    if !weights_row.len().is_multiple_of(block_bytes) {
        return Err(QuantError::PartialBlockBytes { ty, bytes: weights_row.len(), block_bytes });
    }
    let elements = weights_row.len() / block_bytes * ty.block_size() as usize;
    let act_ty = vec_dot_type(ty);
    check_bytes("activations", act_ty, elements, activations_row.len())?;
    let (w, a) = (weights_row, activations_row);
    match ty {
        T::F32 => Ok(float::dot(float::f32_at(w), float::f32_at(a))),
        T::F16 => Ok(float::dot(float::f16_at(w), float::f16_at(a))),
        T::BF16 => Ok(float::dot(float::bf16_at(w), float::bf16_at(a))),
        T::Q4_0 => dot_blocks::<BlockQ4_0, BlockQ8_0>(w, a),
        T::Q4_1 => dot_blocks::<BlockQ4_1, BlockQ8_1>(w, a),
        T::Q5_0 => dot_blocks::<BlockQ5_0, BlockQ8_0>(w, a),
        T::Q5_1 => dot_blocks::<BlockQ5_1, BlockQ8_1>(w, a),
        T::Q8_0 => dot_blocks::<BlockQ8_0, BlockQ8_0>(w, a),
        T::Q2_K => dot_blocks::<BlockQ2K, BlockQ8K>(w, a),
        T::Q3_K => dot_blocks::<BlockQ3K, BlockQ8K>(w, a),
        T::Q4_K => dot_blocks::<BlockQ4K, BlockQ8K>(w, a),
        T::Q5_K => dot_blocks::<BlockQ5K, BlockQ8K>(w, a),
        T::Q6_K => dot_blocks::<BlockQ6K, BlockQ8K>(w, a),
        T::MXFP4 => dot_blocks::<BlockMxfp4, BlockQ8_0>(w, a),
        _ => Err(QuantError::Unsupported(ty)),
    }
}

fn dequantize_blocks<B: Codec>(src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    for (block, out) in view_blocks::<B>(src)?.iter().zip(dst.chunks_exact_mut(B::ELEMENTS)) {
        block.dequantize(out);
    }
    Ok(())
}

fn quantize_blocks<B: Codec>(src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    for (block, x) in view_blocks_mut::<B>(dst)?.iter_mut().zip(src.chunks_exact(B::ELEMENTS)) {
        *block = B::quantize(x);
    }
    Ok(())
}

fn dot_blocks<W: Dot<A>, A: Block>(weights: &[u8], activations: &[u8]) -> Result<f32, QuantError> {
    let weights = view_blocks::<W>(weights)?;
    let activations = view_blocks::<A>(activations)?;
    // A plain running sum from +0.0, like ggml's `float sumf = 0`.
    Ok(weights.iter().zip(activations).map(|(w, a)| w.dot(a)).fold(0.0f32, |sum, x| sum + x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vec_dot_types_follow_llama_cpp() {
        assert_eq!(vec_dot_type(T::Q4_0), T::Q8_0);
        assert_eq!(vec_dot_type(T::Q5_1), T::Q8_1);
        assert_eq!(vec_dot_type(T::MXFP4), T::Q8_0);
        assert_eq!(vec_dot_type(T::Q6_K), T::Q8_K);
        assert_eq!(vec_dot_type(T::BF16), T::BF16);
    }
}
