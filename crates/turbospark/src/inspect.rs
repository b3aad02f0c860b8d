//! `turbospark inspect`: what a GGUF file holds.

use anyhow::Result;
use serde_json::{Value as Json, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use ts_gguf::{Array, GgmlType, GgufFile, Metadata, Value};

/// Arrays longer than this are summarised (count and first items) unless asked for in full.
const ARRAY_PREVIEW: usize = 8;

pub fn run(path: &Path, as_json: bool, all_metadata: bool) -> Result<()> {
    let file = GgufFile::open(path)?;
    let out = if as_json {
        serde_json::to_string_pretty(&to_json(&file, all_metadata))? + "\n"
    } else {
        table(&file, all_metadata)
    };
    crate::write_stdout(out.as_bytes())
}

/// Tensor count and bytes per type, in type order.
fn type_totals(file: &GgufFile) -> BTreeMap<GgmlType, (usize, u64)> {
    let mut totals = BTreeMap::new();
    for t in file.tensors() {
        let e = totals.entry(t.ggml_type).or_insert((0, 0));
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    totals
}

/// Keys shown under "tokenizer" rather than among the hyperparameters.
fn is_tokenizer_key(key: &str) -> bool {
    key.starts_with("tokenizer.")
}

fn token_text(md: &Metadata, id: u64) -> Option<&str> {
    md.array("tokenizer.ggml.tokens").ok().flatten()?.as_strings()?.get(id as usize).map(String::as_str)
}

/// The tokenizer summary both output forms share: (label, value) pairs.
fn tokenizer_summary(md: &Metadata) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    let Some(model) = md.get("tokenizer.ggml.model") else {
        return rows;
    };
    rows.push(("model".into(), model.summary(1)));
    if let Some(pre) = md.get("tokenizer.ggml.pre") {
        rows.push(("pre-tokenizer".into(), pre.summary(1)));
    }
    for (label, key) in [("vocab size", "tokenizer.ggml.tokens"), ("merges", "tokenizer.ggml.merges")] {
        if let Some(Value::Array(a)) = md.get(key) {
            rows.push((label.into(), a.len().to_string()));
        }
    }
    for (label, key) in [
        ("bos", "tokenizer.ggml.bos_token_id"),
        ("eos", "tokenizer.ggml.eos_token_id"),
        ("eot", "tokenizer.ggml.eot_token_id"),
        ("pad", "tokenizer.ggml.padding_token_id"),
        ("unknown", "tokenizer.ggml.unknown_token_id"),
    ] {
        if let Some(id) = md.get(key).and_then(Value::as_u64) {
            let text = token_text(md, id).map(|t| format!(" {t:?}")).unwrap_or_default();
            rows.push((format!("{label} id"), format!("{id}{text}")));
        }
    }
    for (label, key) in [
        ("add bos", "tokenizer.ggml.add_bos_token"),
        ("add eos", "tokenizer.ggml.add_eos_token"),
        ("add space prefix", "tokenizer.ggml.add_space_prefix"),
    ] {
        if let Some(v) = md.get(key) {
            rows.push((label.into(), v.summary(1)));
        }
    }
    if let Some(Value::String(t)) = md.get("tokenizer.chat_template") {
        rows.push(("chat template".into(), format!("{} chars", t.len())));
    }
    rows
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

fn table(file: &GgufFile, all_metadata: bool) -> String {
    let h = &file.header;
    let md = &h.metadata;
    let mut s = String::new();
    let arch = md.str("general.architecture").ok().flatten().unwrap_or("(none)");
    let _ = writeln!(s, "file:          {}", file.path.display());
    let _ = writeln!(s, "size:          {} ({} bytes)", human_bytes(file.mapped().len() as u64), file.mapped().len());
    let _ = writeln!(s, "gguf version:  {}, alignment {}, data at byte {}", h.version, h.alignment, h.data_offset);
    let _ = writeln!(s, "architecture:  {arch}");
    if let Ok(Some(name)) = md.str("general.name") {
        let _ = writeln!(s, "name:          {name}");
    }

    let _ = writeln!(s, "\nmetadata ({} keys):", md.len());
    for (k, v) in md.iter() {
        let long_array = matches!(v, Value::Array(a) if a.len() > ARRAY_PREVIEW);
        if (is_tokenizer_key(k) || k == "general.alignment") && !all_metadata {
            continue;
        }
        let shown = if long_array && !all_metadata { v.summary(ARRAY_PREVIEW) } else { v.summary(usize::MAX) };
        let _ = writeln!(s, "  {k:<44} {shown}");
    }

    let tok = tokenizer_summary(md);
    if !tok.is_empty() {
        let _ = writeln!(s, "\ntokenizer:");
        for (label, value) in tok {
            let _ = writeln!(s, "  {label:<18} {value}");
        }
    }

    let tensors = file.tensors();
    let _ = writeln!(s, "\ntensors ({}), shape in ggml order (row length first):", tensors.len());
    let name_w = tensors.iter().map(|t| t.name.len()).max().unwrap_or(4).max(4);
    let _ = writeln!(s, "  {:<name_w$}  {:<7}  {:<24}  {:>12}", "name", "type", "shape", "bytes");
    for t in tensors {
        let shape = format!("{:?}", t.dims);
        let _ = writeln!(s, "  {:<name_w$}  {:<7}  {:<24}  {:>12}", t.name, t.ggml_type.name(), shape, t.n_bytes);
    }
    let _ = writeln!(s, "\ntensor types:");
    for (ty, (count, bytes)) in type_totals(file) {
        let _ = writeln!(s, "  {:<7} {count:>5} tensors  {:>12}", ty.name(), human_bytes(bytes));
    }
    let total = h.tensor_bytes_total();
    let _ = writeln!(s, "  total   {:>5} tensors  {:>12}", tensors.len(), human_bytes(total));
    s
}

fn array_json(a: &Array, full: bool) -> Json {
    if !full && a.len() > ARRAY_PREVIEW {
        return json!({"element_type": a.element_type().name(), "len": a.len()});
    }
    match a {
        Array::String(v) => json!(v),
        Array::F32(v) => Json::Array(v.iter().map(|&x| f32_json(x)).collect()),
        Array::F64(v) => json!(v),
        Array::Bool(v) => json!(v),
        Array::Array(v) => Json::Array(v.iter().map(|x| array_json(x, full)).collect()),
        other => json!(other.to_i64s().unwrap_or_default()),
    }
}

/// Through the f32's shortest decimal form, so 1e-6f32 prints as 1e-6, not 9.99e-7.
fn f32_json(x: f32) -> Json {
    json!(x.to_string().parse::<f64>().ok())
}

fn value_json(v: &Value, full: bool) -> Json {
    match v {
        Value::String(s) => json!(s),
        Value::Bool(b) => json!(b),
        Value::F32(x) => f32_json(*x),
        Value::F64(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::Array(a) => array_json(a, full),
        other => json!(other.as_i64()),
    }
}

fn to_json(file: &GgufFile, all_metadata: bool) -> Json {
    let h = &file.header;
    let md = &h.metadata;
    let metadata: serde_json::Map<String, Json> =
        md.iter().map(|(k, v)| (k.to_string(), value_json(v, all_metadata))).collect();
    let tokenizer: serde_json::Map<String, Json> =
        tokenizer_summary(md).into_iter().map(|(k, v)| (k, Json::String(v))).collect();
    let tensors: Vec<Json> = file
        .tensors()
        .iter()
        .map(|t| json!({"name": t.name, "type": t.ggml_type.name(), "shape": t.dims, "offset": t.offset, "bytes": t.n_bytes}))
        .collect();
    let types: serde_json::Map<String, Json> = type_totals(file)
        .into_iter()
        .map(|(ty, (count, bytes))| (ty.name().to_string(), json!({"tensors": count, "bytes": bytes})))
        .collect();
    json!({
        "path": file.path.display().to_string(),
        "file_size": file.mapped().len(),
        "gguf_version": h.version,
        "alignment": h.alignment,
        "data_offset": h.data_offset,
        "architecture": md.str("general.architecture").ok().flatten(),
        "name": md.str("general.name").ok().flatten(),
        "metadata": metadata,
        "tokenizer": tokenizer,
        "tensor_count": file.tensors().len(),
        "tensor_bytes": h.tensor_bytes_total(),
        "tensor_types": types,
        "tensors": tensors,
    })
}
