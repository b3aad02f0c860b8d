//! Writes fuzz seed corpora from real GGUF files: each model shrunk to a few
//! KB (arrays cut, tensors cut to a block) for the parser, and its tokenizer
//! metadata cut to a self-consistent small vocabulary for the tokenizer loader.
//!
//! usage: make_seeds OUT_DIR MODEL.gguf...   (writes OUT_DIR/gguf_parse, OUT_DIR/tokenizer_load)

use std::collections::HashSet;
use std::path::Path;
use ts_gguf::{Array, GgufFile, GgufWriter, Value};

const ARRAY_KEEP: usize = 16;
const VOCAB_KEEP: usize = 400;
const TENSORS_KEEP: usize = 6;

fn cut_array(a: &Array, n: usize) -> Array {
    macro_rules! cut {
        ($v:expr, $variant:ident) => {
            Array::$variant($v.iter().take(n).cloned().collect())
        };
    }
    match a {
        Array::U8(v) => cut!(v, U8),
        Array::I8(v) => cut!(v, I8),
        Array::U16(v) => cut!(v, U16),
        Array::I16(v) => cut!(v, I16),
        Array::U32(v) => cut!(v, U32),
        Array::I32(v) => cut!(v, I32),
        Array::F32(v) => cut!(v, F32),
        Array::Bool(v) => cut!(v, Bool),
        Array::String(v) => cut!(v, String),
        Array::Array(v) => Array::Array(v.iter().take(n).map(|x| cut_array(x, n)).collect()),
        Array::U64(v) => cut!(v, U64),
        Array::I64(v) => cut!(v, I64),
        Array::F64(v) => cut!(v, F64),
    }
}

/// The model with every array cut to a few entries and a few tensors of one block each.
fn shrunk_model(file: &GgufFile) -> Vec<u8> {
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata().iter() {
        let v = match v {
            Value::Array(a) => Value::Array(cut_array(a, ARRAY_KEEP)),
            other => other.clone(),
        };
        w.set(k, v).expect("metadata from a valid file");
    }
    let mut data = Vec::new();
    for t in file.tensors().iter().take(TENSORS_KEEP) {
        let mut dims = t.dims.clone();
        dims[0] = t.ggml_type.block_size().max(dims[0].min(8));
        for d in dims.iter_mut().skip(1) {
            *d = (*d).min(2);
        }
        let info = w.add_tensor(&t.name, t.ggml_type, &dims).expect("valid shape");
        let src = file.tensor_data(t);
        data.push(src[..(info.n_bytes as usize).min(src.len())].to_vec());
    }
    let parts: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_bytes(&parts).expect("in-memory write")
}

/// Tokenizer metadata cut to the first tokens, with the merges among them and
/// special ids clamped into range, so the loader gets a coherent vocabulary.
fn shrunk_tokenizer(file: &GgufFile) -> Option<Vec<u8>> {
    let md = file.metadata();
    let tokens = md.req_strings("tokenizer.ggml.tokens").ok()?;
    let n = tokens.len().min(VOCAB_KEEP);
    let kept: HashSet<&str> = tokens[..n].iter().map(String::as_str).collect();
    let mut w = GgufWriter::new();
    for (k, v) in md.iter() {
        if !(k.starts_with("tokenizer.") || k == "general.architecture") {
            continue;
        }
        let v = match (k, v) {
            ("tokenizer.ggml.merges", Value::Array(Array::String(merges))) => {
                let ok = |m: &&String| {
                    m.split_once(' ').is_some_and(|(a, b)| {
                        kept.contains(a) && kept.contains(b) && kept.contains(format!("{a}{b}").as_str())
                    })
                };
                Value::Array(Array::String(merges.iter().filter(ok).cloned().collect()))
            }
            (_, Value::Array(a)) if a.len() == tokens.len() => Value::Array(cut_array(a, n)),
            (k, v) if k.ends_with("_token_id") => Value::U32(v.as_u64().unwrap_or(0).min(n as u64 - 1) as u32),
            (_, other) => other.clone(),
        };
        w.set(k, v).ok()?;
    }
    w.to_bytes(&[]).ok()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: make_seeds OUT_DIR MODEL.gguf...");
        std::process::exit(2);
    }
    let out = Path::new(&args[1]);
    let (parse_dir, tok_dir) = (out.join("gguf_parse"), out.join("tokenizer_load"));
    std::fs::create_dir_all(&parse_dir).unwrap();
    std::fs::create_dir_all(&tok_dir).unwrap();
    for path in &args[2..] {
        let stem = Path::new(path).file_stem().unwrap().to_string_lossy().to_string();
        let file = match GgufFile::open(path) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("skip {path}: {e}");
                continue;
            }
        };
        let model = shrunk_model(&file);
        std::fs::write(parse_dir.join(format!("{stem}.gguf")), &model).unwrap();
        // A real header prefix too: truncated files are the commonest corruption.
        std::fs::write(parse_dir.join(format!("{stem}.head")), &file.mapped()[..model.len().min(4096)]).unwrap();
        if let Some(tok) = shrunk_tokenizer(&file) {
            std::fs::write(tok_dir.join(format!("{stem}.gguf")), &tok).unwrap();
            std::fs::write(parse_dir.join(format!("{stem}.tok.gguf")), &tok).unwrap();
        }
        println!("seeded from {stem}: model {} bytes", model.len());
    }
}
