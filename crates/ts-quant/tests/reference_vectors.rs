//! ts-quant against independent references: vectors made by tools/quant-vectors/gen.py with
//! the PyPI `gguf` package and llama.cpp (see that README).

mod common;

use common::{
    AlignedBytes, TYPES, Vectors, bulk_input, bulk_random_blocks, dequantized, dot_tolerance, fnv1a64, weight_types,
};
use ts_quant::{GgmlType, dequantize, quantize, vec_dot, vec_dot_type};

fn elements(ty: GgmlType, bytes: usize) -> usize {
    bytes / ty.type_size() as usize * ty.block_size() as usize
}

#[test]
fn dequantize_is_bit_identical_to_reference() {
    for ty in TYPES {
        let v = Vectors::load(ty);
        let blocks = v.bytes("blocks");
        let expected = v.f32s("dequantized");
        assert_eq!(expected.len(), elements(ty, blocks.len()), "{ty}");
        let mut out = vec![0.0f32; expected.len()];
        dequantize(ty, &blocks, &mut out).unwrap();
        let mismatches: Vec<usize> = (0..out.len()).filter(|&i| out[i].to_bits() != expected[i].to_bits()).collect();
        assert!(
            mismatches.is_empty(),
            "{ty}: {} of {} values differ from {}; first at {}: {:e} ({:#010x}) vs {:e} ({:#010x})",
            mismatches.len(),
            out.len(),
            v.text("dequantize_source"),
            mismatches[0],
            out[mismatches[0]],
            out[mismatches[0]].to_bits(),
            expected[mismatches[0]],
            expected[mismatches[0]].to_bits(),
        );
    }
}

#[test]
fn quantize_is_bit_identical_to_llama_cpp_reference() {
    for ty in TYPES {
        let v = Vectors::load(ty);
        let input = v.f32s("quantize_input");
        let expected = v.bytes("quantize_output");
        let mut out = AlignedBytes::zeroed(expected.len());
        quantize(ty, &input, out.as_mut()).unwrap();
        let block_bytes = if ty.is_quantized() { ty.type_size() as usize } else { 4 * ty.type_size() as usize };
        let bad_blocks: Vec<usize> = (0..expected.len() / block_bytes)
            .filter(|&b| out.chunks(block_bytes).nth(b) != expected.chunks(block_bytes).nth(b))
            .collect();
        assert!(
            bad_blocks.is_empty(),
            "{ty}: {} of {} blocks differ from llama.cpp's reference quantizer, first is block {}",
            bad_blocks.len(),
            expected.len() / block_bytes,
            bad_blocks[0]
        );
    }
}

#[test]
fn vec_dot_matches_llama_cpp_within_summation_error() {
    for ty in weight_types() {
        let v = Vectors::load(ty);
        let n = v.u32("dot_row_len") as usize;
        let act_ty = vec_dot_type(ty);
        let w_row = ty.bytes_for(n as u64).unwrap() as usize;
        let a_row = act_ty.bytes_for(n as u64).unwrap() as usize;
        let weights = v.bytes("dot_weights");
        let activations = v.bytes("dot_activations");
        let expected = v.f32s("dot_results");
        assert_eq!(weights.len(), w_row * expected.len(), "{ty}");
        assert_eq!(activations.len(), a_row * expected.len(), "{ty}");
        for (row, &want) in expected.iter().enumerate() {
            let w = AlignedBytes::new(&weights[row * w_row..][..w_row]);
            let a = AlignedBytes::new(&activations[row * a_row..][..a_row]);
            let got = vec_dot(ty, &w, &a).unwrap();
            let tolerance = dot_tolerance(ty, &dequantized(ty, &w, n), &dequantized(act_ty, &a, n));
            let diff = (got as f64 - want as f64).abs();
            assert!(diff <= tolerance, "{ty} row {row}: {got} vs llama.cpp {want}, diff {diff:e} > {tolerance:e}");
        }
    }
}

/// Indices of the chunks whose FNV-1a hash differs from the stored one.
fn bad_chunks(data: &[u8], chunk_bytes: usize, hashes: &[u8]) -> Vec<usize> {
    assert_eq!(data.len() / chunk_bytes, hashes.len() / 8);
    data.chunks(chunk_bytes)
        .zip(hashes.chunks(8))
        .enumerate()
        .filter(|(_, (chunk, hash))| fnv1a64(chunk).to_le_bytes() != **hash)
        .map(|(i, _)| i)
        .collect()
}

#[test]
fn bulk_quantize_and_dequantize_match_reference_hashes() {
    for ty in TYPES {
        let v = Vectors::load(ty);
        let seed = u64::from_le_bytes(v.bytes("bulk_seed")[..8].try_into().unwrap());
        let n = v.u32("bulk_elements") as usize;
        let chunk_elements = v.u32("bulk_chunk_elements") as usize;
        let block_size = ty.block_size() as usize;
        let n_bytes = ty.bytes_for(n as u64).unwrap() as usize;
        let chunk_bytes = ty.bytes_for(chunk_elements as u64).unwrap() as usize;

        let input = bulk_input(seed, n, block_size.max(32));
        let mut quantized = AlignedBytes::zeroed(n_bytes);
        quantize(ty, &input, quantized.as_mut()).unwrap();
        let bad = bad_chunks(&quantized, chunk_bytes, &v.bytes("bulk_quantize_hashes"));
        assert!(bad.is_empty(), "{ty}: quantized chunks {bad:?} of {chunk_elements} values differ from llama.cpp");

        let random = bulk_random_blocks(seed + 1, ty, n_bytes);
        let values = dequantized(ty, &random, n);
        let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        let bad = bad_chunks(&bytes, chunk_elements * 4, &v.bytes("bulk_dequantize_hashes"));
        assert!(bad.is_empty(), "{ty}: dequantized chunks {bad:?} differ from {}", v.text("dequantize_source"));
    }
}
