//! Dense matmuls `y = x · Wᵀ` on the device, by the rows of the step: matvec
//! kernels below 32 rows (8-bit activations where the type has integer dot
//! products, `matvec_q8.rs`), the f16 tensor cores through cuBLAS from 32 rows.

use crate::device::Arg;
use crate::{Cuda, err, q8_suffix, type_suffix};
use cudarc::cublas::{CudaBlas, sys as blas};
use ts_gguf::GgmlType;
use ts_model::ModelError;

/// Rows below this go through the matvec kernels; from it on, cuBLAS.
pub(crate) const GEMM_MIN_ROWS: usize = 32;

/// Activation rows one f32 matvec launch serves (the padding of recorded steps' row counts too).
pub(crate) const MATVEC_ROWS: usize = 8;

/// One `y[m][n_out] = x[m][k] · Wᵀ (+ bias)`: `n_out` rows of type `ty` at device
/// address `w`, activations at `x`, output at `y`, `bias` the address of `[n_out]`
/// floats or 0 for none.
#[derive(Clone, Copy, Debug)]
pub struct Matmul {
    pub ty: GgmlType,
    pub w: u64,
    pub n_out: usize,
    pub k: usize,
    pub x: u64,
    pub m: usize,
    pub y: u64,
    pub bias: u64,
}

impl Cuda {
    /// `mm` ([`Matmul`]). Unless `exact`, 32 rows and more take the f16 tensor cores and
    /// fewer 8-bit activations where the type has integer dot products ([`q8_suffix`]);
    /// else f32 activations.
    pub fn matmul(&self, mm: &Matmul, exact: bool) -> Result<(), ModelError> {
        let Matmul { ty, w, n_out, k, x, m, y, bias } = *mm;
        let sfx = type_suffix(ty).ok_or_else(|| ModelError::Compute(format!("cuda: type {ty} unsupported")))?;
        if m >= GEMM_MIN_ROWS
            && !exact
            && let Some(blas) = &self.blas
        {
            self.gemm_f16(blas, sfx, mm)?;
            if bias != 0 {
                self.launch_1d(
                    "add_bias",
                    m * n_out,
                    &[Arg::Ptr(y), Arg::Ptr(bias), Arg::I32(n_out as i32), Arg::I64((m * n_out) as i64)],
                )?;
            }
            return Ok(());
        }
        if !exact && let Some(sfx) = q8_suffix(ty) {
            return self.matmul_q8(sfx, mm);
        }
        // These write only y: an 8-bit copy of other activations stays valid (a MoE layer's
        // f32 router between its norm and its experts).
        self.keeping_quantized(&[(y, 4 * m * n_out)], || {
            let grid = (n_out.div_ceil(4) as u32, 1, 1);
            for r0 in (0..m).step_by(MATVEC_ROWS) {
                let mc = (m - r0).min(MATVEC_ROWS);
                self.launch(
                    &format!("matvec_{sfx}"),
                    grid,
                    (32, 4, 1),
                    &[
                        Arg::Ptr(w),
                        Arg::Ptr(x + (r0 * k * 4) as u64),
                        Arg::Ptr(y + (r0 * n_out * 4) as u64),
                        Arg::I32(n_out as i32),
                        Arg::I32(k as i32),
                        Arg::I32(mc as i32),
                        Arg::Ptr(bias),
                    ],
                )?;
            }
            Ok(())
        })
    }

    /// The weight dequantized to f16, the activations rounded to f16, one cuBLAS
    /// GemmEx with f32 accumulation (the bias is left to the caller). Row-major
    /// `y = x · Wᵀ` is column-major `yᵀ = W · xᵀ`: W is `k × n_out` column-major, transposed.
    pub(crate) fn gemm_f16(&self, blas: &CudaBlas, sfx: &str, mm: &Matmul) -> Result<(), ModelError> {
        let Matmul { w, n_out, k, x, m, y, .. } = *mm;
        let mut half = self.half.lock().expect("f16 staging lock");
        if half.0.len() < n_out * k {
            half.0 = self.gpu.alloc(n_out * k).map_err(err)?;
        }
        if half.1.len() < m * k {
            half.1 = self.gpu.alloc(m * k).map_err(err)?;
        }
        let (wh, xh) = (self.gpu.ptr(&half.0), self.gpu.ptr(&half.1));
        self.launch_1d(
            &format!("dequant_f16_{sfx}"),
            n_out * k / 32,
            &[Arg::Ptr(w), Arg::Ptr(wh), Arg::I32(n_out as i32), Arg::I32(k as i32)],
        )?;
        self.launch_1d("f32_to_f16", m * k, &[Arg::Ptr(x), Arg::Ptr(xh), Arg::I64((m * k) as i64)])?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                blas::cublasOperation_t::CUBLAS_OP_T,
                blas::cublasOperation_t::CUBLAS_OP_N,
                n_out as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                wh as *const _,
                blas::cudaDataType_t::CUDA_R_16F,
                k as i32,
                xh as *const _,
                blas::cudaDataType_t::CUDA_R_16F,
                k as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                blas::cudaDataType_t::CUDA_R_32F,
                n_out as i32,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| ModelError::Compute(format!("cuda: cuBLAS GemmEx: {e:?}")))
    }
}
