//! CPU matrix multiplication of GGUF weights by batches of activations.
//!
//! Weights stay in their GGUF layout: `n_out` rows of `k` elements each, one after another.
//! Activations are f32 rows, quantized once per batch into [`QuantizedRows`] of the type the
//! weights pair with ([`ts_quant::vec_dot_type`]: Q8_0, Q8_1 or Q8_K), so each dot product is
//! an integer sum per block scaled once per block, as in llama.cpp. F32, F16 and BF16 weights
//! are multiplied by the f32 activations themselves; llama.cpp rounds those activations to the
//! weight type first, so results here are slightly more accurate than its.
//!
//! Kernels are picked at run time ([`Isa`]): AVX-512 VNNI, AVX2 with FMA and F16C, or a
//! portable fallback built on ts-quant's scalar reference. Results agree with
//! [`ts_quant::vec_dot`] up to float summation order. Work is spread over the current rayon
//! pool by runs of weight rows; for batches, each run of weight rows is multiplied by every
//! activation row while it is in cache.
//!
//! ```
//! use ts_cpu::{GgmlType, QuantizedRows, matmul};
//!
//! let (n_out, k) = (3, 64);
//! let w = vec![0u8; n_out * 2 * 18]; // 3 rows of two Q4_0 blocks (scales 0)
//! let x = vec![0.5f32; 2 * k]; // 2 activation rows
//! let mut q = QuantizedRows::new(); // reuse across calls
//! q.quantize(GgmlType::Q4_0, &x, k)?;
//! let mut out = vec![0.0f32; 2 * n_out];
//! matmul(GgmlType::Q4_0, &w, n_out, k, &q, &mut out)?;
//! assert_eq!(out, [0.0; 6]);
//! # Ok::<(), ts_cpu::CpuError>(())
//! ```

mod activations;
pub mod delta_net;
mod dispatch;
mod floats;
mod kquants;
mod legacy;
mod mxfp4;
pub mod ops;
#[cfg(target_arch = "x86_64")]
mod panel;
#[cfg(target_arch = "x86_64")]
mod panel_avx2;
#[cfg(target_arch = "x86_64")]
mod simd;
pub mod team;
pub mod topology;
pub mod work_time;

pub use activations::{QuantizedRows, quantize_q8_runtime};
use dispatch::Layout;
pub use dispatch::{FinishHidden, GatedMatvec, Isa, Matvec, decode_prefetch_text, set_decode_prefetch};
pub use ts_gguf::GgmlType;

/// Why a quantization or multiplication was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CpuError {
    #[error("tensor type {0} has no CPU matmul")]
    Unsupported(GgmlType),
    #[error("k = {k} is not a whole, non-zero number of {ty} blocks of {block_size}")]
    PartialBlock { ty: GgmlType, k: usize, block_size: usize },
    #[error("{what} holds {actual}, but {expected} are needed")]
    WrongLength { what: &'static str, expected: usize, actual: usize },
    #[error(
        "activations were quantized as {actual} rows of {actual_k}, but {weight_ty} weights with k = {k} need {expected}"
    )]
    Activations { weight_ty: GgmlType, k: usize, expected: GgmlType, actual: GgmlType, actual_k: usize },
    #[error("output stride {stride} is smaller than n_out = {n_out}")]
    Stride { stride: usize, n_out: usize },
    #[error("row {row} is out of range for {m} activation rows")]
    RowOutOfRange { row: usize, m: usize },
    #[error("instruction set {0} is not available on this CPU")]
    IsaUnavailable(Isa),
    #[error("{n_out} rows of {ty} are not in a packed layout on {isa}")]
    NotPacked { ty: GgmlType, n_out: usize, isa: Isa },
    #[error(transparent)]
    Quant(#[from] ts_quant::QuantError),
}

/// `out[i * n_out + j] = dot(weight row j, activation row i)` for every activation row `i` of
/// `x` and weight row `j < n_out`. `w` holds exactly `n_out` rows of `k` elements of
/// `weight_ty`; `x` must have been quantized for a weight type that pairs with the same
/// activation format (see [`QuantizedRows::quantize`]). Runs on the current rayon pool.
pub fn matmul(
    weight_ty: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &QuantizedRows,
    out: &mut [f32],
) -> Result<(), CpuError> {
    matmul_strided(weight_ty, w, n_out, k, x, out, n_out)
}

/// [`matmul`] writing activation row `i`'s results to `out[i * out_stride..][..n_out]`, so that
/// several weight matrices (or a range of one matrix's rows, or one expert of a stacked MoE
/// tensor) can fill columns of one output. Elements of `out` between those runs are left as
/// they are; `out` may end right after the last run.
pub fn matmul_strided(
    weight_ty: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &QuantizedRows,
    out: &mut [f32],
    out_stride: usize,
) -> Result<(), CpuError> {
    dispatch::matmul(Isa::detect(), weight_ty, w, n_out, k, x, out, out_stride, true, Layout::Gguf)
}

/// Whether [`pack_rows`] repacks `n_out` rows of `weight_ty` on this CPU (whole multiples of 16
/// rows: MXFP4, Q4_K, Q4_0, Q4_1, Q5_0 and Q8_0, and on AVX-512 VNNI Q6_K).
pub fn packs(weight_ty: GgmlType, n_out: usize) -> bool {
    dispatch::packs(Isa::detect(), weight_ty, n_out)
}

/// Whether a matrix's one-row products are faster repacked: worth repacking an output head
/// and a layer's dense matrices at load. MXFP4, Q4_0, Q4_1, Q5_0 and Q8_0. On AVX-512 VNNI
/// (`matmul_bench --packed`, one thread, Zen 4: MXFP4 222 -> 66-87 us; 4864x896 in cache
/// Q4_0 82 -> 31, Q4_1 100 -> 35, Q5_0 118 -> 44, Q8_0 85 -> 52; a 49152x576 Q4_1 matrix from
/// memory 783 -> 446 us; a 151936x896 head from memory Q5_0 24 -> 33-36 GB/s, Q8_0 28-31
/// -> 35-36, at or above a plain read). On AVX2 (a 151936x1024 matrix from memory, one thread
/// on a 2-vCPU AMD EPYC without AVX-512, two runs: Q4_0 9.9 / 13.5 -> 16.9 / 20.3 GB/s, Q4_1
/// 9.5 / 12.9 -> 17.6 / 16.1, Q5_0 7.8 / 10.9 -> 18.7 / 18.1, Q8_0 13.7 / 12.8 -> 16.0 / 17.2,
/// MXFP4 9.3 -> 14.5, against a plain read's 17-20). Q4_K's and Q6_K's one-row kernels are as
/// fast on their blocks (memory-bound), so repacking them pays only for batches.
pub fn packed_row_is_faster(weight_ty: GgmlType) -> bool {
    matches!(weight_ty, GgmlType::MXFP4 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0)
        && matches!(Isa::detect(), Isa::Avx512 | Isa::Avx2)
}

/// Whether streamed experts are repacked as each is read ([`packed_row_is_faster`]'s types on
/// AVX-512 VNNI): they serve mostly decode, and on AVX2 the readers' repacking cost more than
/// MXFP4's faster decode gained (gpt-oss 6 layers streamed under 2 GiB, 2 cores: 8.0 / 9.8
/// tok/s repacked, 10.6 / 10.3 not).
pub fn repacks_as_read(weight_ty: GgmlType) -> bool {
    packed_row_is_faster(weight_ty) && Isa::detect() == Isa::Avx512
}

/// Whether a layer's dense matrices (projections, dense FFNs) are worth repacking at load:
/// [`packed_row_is_faster`]'s types, and Q4_K and Q6_K on AVX-512 VNNI, whose packed one-row
/// pass reads a layer-sized matrix from memory faster than their GGUF blocks' kernel
/// (`matmul_bench --packed --head 640,1024`, Zen 4, 2 threads: Q4_K 29.9 -> 14.0 us). Decode,
/// one thread on a 2-vCPU Zen 4, alternating runs: the qwen3-30b-a3b cut's Q4_K and Q6_K attention
/// packed 41.4 / 40.0 / 42.0 -> 44.3 / 43.1 / 44.4 tok/s, Qwen2.5-0.5B's K-quant matrices
/// 50.4 / 48.2 / 49.7 / 47.8 / 52.0 -> 52.8 / 50.2 / 55.8 / 48.9 / 52.7; two threads level
/// within the machine's noise, as were 128-token prompts. A large K-quant matrix read one row at
/// a time is not faster packed (the same cut with its 151936x2048 Q6_K head packed too: 40.2 /
/// 38.7 / 39.0), so output heads keep [`packed_row_is_faster`]'s rule.
pub fn dense_packed_is_faster(weight_ty: GgmlType) -> bool {
    packed_row_is_faster(weight_ty)
        || (matches!(weight_ty, GgmlType::Q4_K | GgmlType::Q6_K) && Isa::detect() == Isa::Avx512)
}

/// Repacks `n_out` rows of `k` elements of `weight_ty` in place, at the same size, into the
/// layout [`matmul_packed`] reads (the batch kernels' panels, built once instead of per
/// call), where [`packs`] says so; returns whether it did. The bytes are then no longer GGUF
/// blocks: only [`matmul_packed`] reads them.
pub fn pack_rows(weight_ty: GgmlType, w: &mut [u8], n_out: usize, k: usize) -> Result<bool, CpuError> {
    dispatch::pack(Isa::detect(), weight_ty, w, n_out, k)
}

/// Row `r` of `n_out` rows of `k` elements of `weight_ty` repacked by [`pack_rows`], back in
/// its GGUF blocks, into `out` (resized): for reading single rows of a packed matrix (an
/// embedding table that is also the packed output head). Q4_0, Q4_1, Q5_0, Q8_0 and MXFP4,
/// the types whose dense matrices are packed.
pub fn packed_row(
    weight_ty: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    r: usize,
    out: &mut Vec<u8>,
) -> Result<(), CpuError> {
    let row_bytes = dispatch::checked_row_bytes(weight_ty, w.len(), n_out, k)?;
    let block_bytes = weight_ty.type_size() as usize;
    if r >= n_out {
        return Err(CpuError::RowOutOfRange { row: r, m: n_out });
    }
    let not_packed = CpuError::NotPacked { ty: weight_ty, n_out, isa: Isa::detect() };
    if !packs(weight_ty, n_out) {
        return Err(not_packed);
    }
    let Some((rows, read)) = dispatch::packed_row_reader(Isa::detect()) else { return Err(not_packed) };
    let panel_block = rows * block_bytes;
    let panel = &w[r / rows * rows * row_bytes..][..rows * row_bytes];
    out.resize(row_bytes, 0);
    for (b, dst) in out.chunks_exact_mut(block_bytes).enumerate() {
        if !read(weight_ty, &panel[b * panel_block..][..panel_block], r % rows, dst) {
            return Err(not_packed);
        }
    }
    Ok(())
}

/// [`matmul_strided`] for rows repacked by [`pack_rows`]: the same products, for any number
/// of activation rows (every row as a one-row call would compute it, bit for bit).
pub fn matmul_packed(
    weight_ty: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &QuantizedRows,
    out: &mut [f32],
    out_stride: usize,
) -> Result<(), CpuError> {
    dispatch::matmul(Isa::detect(), weight_ty, w, n_out, k, x, out, out_stride, false, Layout::Packed)
}

/// [`matmul`] computing every activation row as a one-row call would, bit for bit: no
/// batch (panel) kernels, whose block sums run in another order. For steps whose rows
/// must equal their one-row results (speculative decoding's checking steps).
pub fn matmul_rows_alone(
    weight_ty: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &QuantizedRows,
    out: &mut [f32],
) -> Result<(), CpuError> {
    dispatch::matmul(Isa::detect(), weight_ty, w, n_out, k, x, out, n_out, false, Layout::Gguf)
}

/// Several one-row products (decode's routed experts, a layer's q/k/v) in one parallel region,
/// each product's rows in one contiguous run per thread, the runs taken product by product by
/// the free threads: each output as [`matmul`] (or [`matmul_packed`] for a packed product)
/// computes it, with one wake-up of the threads for all of them.
pub fn matvecs(products: &mut [Matvec<'_>]) -> Result<(), CpuError> {
    dispatch::matvecs(Isa::detect(), products)
}

/// Gate and up products of one row for several gated FFNs (decode's dense FFN or its routed
/// experts) in one parallel region, each task finishing its rows into the hidden and
/// quantizing them for down ([`GatedMatvec`]): each float as [`matvecs`], the activation and
/// [`QuantizedRows::quantize`] one after the other give it.
pub fn gated_matvecs(pairs: &mut [GatedMatvec<'_>], finish: &FinishHidden<'_>) -> Result<(), CpuError> {
    dispatch::gated_matvecs(Isa::detect(), pairs, finish)
}

/// [`matmul_strided`] with kernels for a given instruction set, for tests and benchmarks.
#[allow(clippy::too_many_arguments)]
pub fn matmul_with_isa(
    isa: Isa,
    weight_ty: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &QuantizedRows,
    out: &mut [f32],
    out_stride: usize,
) -> Result<(), CpuError> {
    dispatch::matmul(isa, weight_ty, w, n_out, k, x, out, out_stride, true, Layout::Gguf)
}

/// The activation format weights of `weight_ty` are multiplied with, or `Unsupported`.
pub fn activation_type(weight_ty: GgmlType) -> Result<GgmlType, CpuError> {
    use GgmlType as T;
    match weight_ty {
        T::F32 | T::F16 | T::BF16 => Ok(T::F32),
        T::Q4_0 | T::Q4_1 | T::Q5_0 | T::Q5_1 | T::Q8_0 | T::MXFP4 => Ok(ts_quant::vec_dot_type(weight_ty)),
        T::Q2_K | T::Q3_K | T::Q4_K | T::Q5_K | T::Q6_K => Ok(T::Q8_K),
        other => Err(CpuError::Unsupported(other)),
    }
}
