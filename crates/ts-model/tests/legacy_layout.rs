//! Qwen3-Next GGUFs from older converters hold one fused `ssm_in` per linear
//! layer (Hugging Face's `in_proj_qkvz`, rows grouped by key head) where newer
//! ones hold `attn_qkv` and `attn_gate`; llama.cpp reads both. The qwen3_next
//! fixtures rewritten in the old layout (the rows put back in the grouped
//! order docs/FAMILIES.md §6.2 gives) give the same logits, bit for bit.

use ts_gguf::{GgufFile, GgufWriter};
use ts_model::{ExpertPlacement, Model, Row, Scratch, SeqState};

fn logits(path: &std::path::Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let model = Model::open(path, ExpertPlacement::Mapped).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut seq = SeqState::new(&model.cfg, tokens.len(), tokens.len());
    let rows: Vec<Row> =
        tokens.iter().enumerate().map(|(pos, &token)| Row { token, pos, seq: 0, logits: true }).collect();
    model.forward(&rows, &mut [&mut seq], &mut Scratch::default()).unwrap()
}

/// The file at `path` with each layer's `attn_qkv` and `attn_gate` fused into `ssm_in`.
fn old_layout(path: &std::path::Path, out: &std::path::Path) {
    let f = GgufFile::open(path).unwrap();
    let md = f.metadata();
    let key = |k: &str| md.u64(&format!("qwen3next.{k}")).unwrap().unwrap() as usize;
    let (nk, nv, dk) = (key("ssm.group_count"), key("ssm.time_step_rank"), key("ssm.state_size"));
    let (dv, r) = (dk, nv / nk);
    let mut w = GgufWriter::new();
    for (k, v) in md.iter() {
        w.set(k, v.clone()).unwrap();
    }
    let mut data: Vec<Vec<u8>> = Vec::new();
    for t in f.tensors() {
        if t.name.ends_with("attn_gate.weight") {
            continue;
        }
        let Some(layer) = t.name.strip_suffix(".attn_qkv.weight") else {
            w.add_tensor(&t.name, t.ggml_type, &t.dims).unwrap();
            data.push(f.tensor_data(t).to_vec());
            continue;
        };
        let z = f.tensor(&format!("{layer}.attn_gate.weight")).unwrap();
        let (qkv, z) = (f.tensor_data(t), f.tensor_data(z));
        let row = qkv.len() / t.dims[1] as usize;
        let rows = |b: &[u8], first: usize, n: usize| b[first * row..(first + n) * row].to_vec();
        let mut fused = Vec::new();
        for g in 0..nk {
            fused.extend(rows(qkv, g * dk, dk)); // q of key head g
            fused.extend(rows(qkv, nk * dk + g * dk, dk)); // k
            fused.extend(rows(qkv, 2 * nk * dk + g * r * dv, r * dv)); // its value heads
            fused.extend(rows(z, g * r * dv, r * dv)); // their z
        }
        let dims = [t.dims[0], (2 * nk * dk + 2 * nv * dv) as u64];
        w.add_tensor(&format!("{layer}.ssm_in.weight"), t.ggml_type, &dims).unwrap();
        data.push(fused);
    }
    let mut tw = w.write_header(std::io::BufWriter::new(std::fs::File::create(out).unwrap())).unwrap();
    for d in &data {
        tw.write_tensor(d).unwrap();
    }
    tw.finish().unwrap();
}

#[test]
fn fused_ssm_in_reads_as_attn_qkv_and_attn_gate() {
    let fixtures = ts_testkit::fixtures();
    let files: Vec<_> = fixtures.iter().filter(|f| f.family == "qwen3_next").collect();
    assert!(files.len() >= 2, "the qwen3_next fixtures are missing");
    for f in files {
        let old = std::env::temp_dir().join(format!("ts-legacy-{}-{}.gguf", f.variant, std::process::id()));
        old_layout(&f.model, &old);
        let has_fused = GgufFile::open(&old).unwrap().tensors().iter().any(|t| t.name.ends_with("ssm_in.weight"));
        assert!(has_fused);
        let tokens = &f.golden.tokens[..32];
        assert!(logits(&old, tokens) == logits(&f.model, tokens), "{}: the fused layout gives other logits", f.variant);
        std::fs::remove_file(old).ok();
    }
}
