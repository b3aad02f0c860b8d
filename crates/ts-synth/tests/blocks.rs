//! Random blocks written without quantizing, checked by dequantizing them as llama.cpp does.

use ts_gguf::GgmlType;
use ts_synth::{EMBEDDING_TYPES, EmbeddingCodec, WEIGHT_TYPES, WeightCodec};

fn dequantize(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() as u64 / ty.type_size() * ty.block_size();
    let mut out = vec![0f32; n as usize];
    ts_quant::dequantize(ty, bytes, &mut out).unwrap();
    out
}

fn mean_sd(x: &[f32]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    (mean, (x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt())
}

#[test]
fn weights_have_the_wanted_spread_and_no_mean() {
    let elements = 1u64 << 20;
    for ty in WEIGHT_TYPES {
        for row in [768usize, 2880, 14336] {
            if !(row as u64).is_multiple_of(ty.block_size()) {
                continue;
            }
            let std = 1.0 / (row as f64).sqrt();
            let mut bytes = vec![0u8; ty.bytes_for(elements).unwrap() as usize];
            WeightCodec::new(ty, std).unwrap().fill(ty, 3, &mut bytes);
            let (mean, sd) = mean_sd(&dequantize(ty, &bytes));
            assert!((sd / std - 1.0).abs() < 0.02, "{ty} k={row}: sd {sd}, wanted {std}");
            assert!(mean.abs() < 0.01 * std, "{ty} k={row}: mean {mean}");
        }
    }
}

#[test]
fn embeddings_have_the_wanted_mean_per_group() {
    let (n_embd, rows) = (2048usize, 512usize);
    let level: Vec<f64> = (0..n_embd / 32).map(|g| if g % 3 == 0 { 9.6 } else { -9.6 }).collect();
    for ty in EMBEDDING_TYPES {
        let codec = EmbeddingCodec::new(ty, n_embd, 12.8, &level).unwrap();
        let mut bytes = vec![0u8; ty.bytes_for((n_embd * rows) as u64).unwrap() as usize];
        codec.fill(ty, 5, &mut bytes);
        let x = dequantize(ty, &bytes);
        for j in (0..n_embd).step_by(97) {
            let column: Vec<f32> = (0..rows).map(|r| x[r * n_embd + j]).collect();
            let (mean, sd) = mean_sd(&column);
            // The codec reports the mean its fields give; it is near the level asked for.
            assert!((mean - codec.mean[j] as f64).abs() < 4.0 * sd / (rows as f64).sqrt(), "{ty} element {j}");
            assert!((codec.mean[j] as f64 - level[j / 32]).abs() < 0.05 * 9.6, "{ty} element {j}");
            assert!((sd / 12.8 - 1.0).abs() < 0.1, "{ty} element {j}: sd {sd}");
        }
    }
}
