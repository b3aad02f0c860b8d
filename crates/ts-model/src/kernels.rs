//! Stand-in for `ts_cpu`'s matmul API while it is being written: the same
//! signatures over ts-quant's scalar reference, parallel over output rows.

use rayon::prelude::*;
use ts_gguf::GgmlType;

#[derive(Debug)]
pub struct CpuError(String);

impl std::fmt::Display for CpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Default)]
pub struct QuantizedRows {
    ty: Option<GgmlType>,
    k: usize,
    m: usize,
    bytes: Vec<u8>,
    f32s: Vec<f32>,
}

fn act_type(ty: GgmlType) -> GgmlType {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => GgmlType::F32,
        t => ts_quant::vec_dot_type(t),
    }
}

impl QuantizedRows {
    pub fn quantize(&mut self, weight_ty: GgmlType, x: &[f32], k: usize) -> Result<(), CpuError> {
        let at = act_type(weight_ty);
        self.ty = Some(at);
        self.k = k;
        self.m = x.len() / k;
        if at == GgmlType::F32 {
            self.f32s = x.to_vec();
            return Ok(());
        }
        let rb = at.bytes_for(k as u64).ok_or_else(|| CpuError(format!("k={k} not a multiple of {at}")))? as usize;
        self.bytes.resize(rb * self.m, 0);
        for (i, row) in x.chunks_exact(k).enumerate() {
            ts_quant::quantize(at, row, &mut self.bytes[i * rb..(i + 1) * rb]).map_err(|e| CpuError(e.to_string()))?;
        }
        Ok(())
    }
}

pub fn matmul(
    ty: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &QuantizedRows,
    out: &mut [f32],
) -> Result<(), CpuError> {
    let wrb = ty.bytes_for(k as u64).unwrap() as usize;
    let at = x.ty.unwrap();
    if at == GgmlType::F32 {
        let mut wf = vec![0f32; k * n_out];
        ts_quant::dequantize(ty, &w[..wrb * n_out], &mut wf).map_err(|e| CpuError(e.to_string()))?;
        out.par_chunks_mut(n_out).enumerate().for_each(|(i, o)| {
            let xr = &x.f32s[i * k..(i + 1) * k];
            for (j, v) in o.iter_mut().enumerate() {
                *v = wf[j * k..(j + 1) * k].iter().zip(xr).map(|(a, b)| a * b).sum();
            }
        });
        return Ok(());
    }
    let arb = at.bytes_for(k as u64).unwrap() as usize;
    for i in 0..x.m {
        let a = &x.bytes[i * arb..(i + 1) * arb];
        out[i * n_out..(i + 1) * n_out].par_iter_mut().enumerate().for_each(|(j, o)| {
            *o = ts_quant::vec_dot(ty, &w[j * wrb..(j + 1) * wrb], a).unwrap();
        });
    }
    Ok(())
}
