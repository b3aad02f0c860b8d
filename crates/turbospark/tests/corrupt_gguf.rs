//! Corruptions of a real GGUF file: each must make `turbospark inspect` exit
//! non-zero with a one-line error naming the problem, and never panic.
//!
//! Field positions are found by a small header walker written here, separate
//! from the reader under test.

use std::process::Command;

/// Byte positions of the fields the corruptions patch.
struct Layout {
    /// (key, offset of its length prefix, offset of its type id, offset of its value)
    kvs: Vec<(String, usize, usize, usize)>,
    /// (name, offset of name length, offset of n_dims, offset of dims, offset of type id, offset of data offset)
    tensors: Vec<(String, usize, usize, usize, usize, usize)>,
    header_end: usize,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Size in bytes of a value of type `ty` at `at` (for a valid file).
fn value_size(b: &[u8], ty: u32, at: usize) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => 8 + u64_at(b, at) as usize,
        9 => {
            let et = u32_at(b, at);
            let n = u64_at(b, at + 4) as usize;
            let mut pos = at + 12;
            for _ in 0..n {
                pos += value_size(b, et, pos);
            }
            pos - at
        }
        _ => panic!("fixture has unknown value type {ty}"),
    }
}

fn layout(b: &[u8]) -> Layout {
    let n_tensors = u64_at(b, 8) as usize;
    let n_kv = u64_at(b, 16) as usize;
    let mut pos = 24;
    let mut kvs = Vec::new();
    for _ in 0..n_kv {
        let len = u64_at(b, pos) as usize;
        let key = String::from_utf8(b[pos + 8..pos + 8 + len].to_vec()).unwrap();
        let ty_at = pos + 8 + len;
        let ty = u32_at(b, ty_at);
        kvs.push((key, pos, ty_at, ty_at + 4));
        pos = ty_at + 4 + value_size(b, ty, ty_at + 4);
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let len = u64_at(b, pos) as usize;
        let name = String::from_utf8(b[pos + 8..pos + 8 + len].to_vec()).unwrap();
        let nd_at = pos + 8 + len;
        let nd = u32_at(b, nd_at) as usize;
        let dims_at = nd_at + 4;
        let ty_at = dims_at + 8 * nd;
        tensors.push((name, pos, nd_at, dims_at, ty_at, ty_at + 4));
        pos = ty_at + 12;
    }
    Layout { kvs, tensors, header_end: pos }
}

impl Layout {
    fn kv(&self, key: &str) -> (usize, usize, usize) {
        let k = self.kvs.iter().find(|k| k.0 == key).unwrap_or_else(|| panic!("fixture lacks {key}"));
        (k.1, k.2, k.3)
    }

    fn tensor(&self, name: &str) -> (usize, usize, usize, usize, usize) {
        let t = self.tensors.iter().find(|t| t.0 == name).unwrap_or_else(|| panic!("fixture lacks {name}"));
        (t.1, t.2, t.3, t.4, t.5)
    }
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

type Corruption = (&'static str, Box<dyn Fn(&mut Vec<u8>, &Layout)>, &'static str);

fn corruptions() -> Vec<Corruption> {
    let first_tensor = "token_embd.weight";
    vec![
        ("empty file", Box::new(|b, _| b.truncate(0)), "file truncated at byte 0"),
        ("truncated in magic", Box::new(|b, _| b.truncate(3)), "file truncated at byte 0: magic"),
        ("truncated in counts", Box::new(|b, _| b.truncate(20)), "file truncated or corrupt"),
        (
            "truncated in metadata",
            Box::new(|b, l| b.truncate(l.kv("general.architecture").2 + 3)),
            "file truncated or corrupt",
        ),
        (
            "truncated in the vocabulary",
            Box::new(|b, l| b.truncate(l.kv("tokenizer.ggml.tokens").2 + 5000)),
            "file truncated or corrupt",
        ),
        ("truncated in tensor infos", Box::new(|b, l| b.truncate(l.tensor(first_tensor).2 + 2)), "token_embd.weight"),
        ("truncated in the data", Box::new(|b, l| b.truncate(l.header_end + 4096)), "lies past the end of the file"),
        ("truncated by one byte", Box::new(|b, _| b.truncate(b.len() - 1)), "lies past the end of the file"),
        ("bad magic", Box::new(|b, _| b[0..4].copy_from_slice(b"GGML")), "not a GGUF file"),
        ("bad version", Box::new(|b, _| put_u32(b, 4, 99)), "GGUF version 99 is not supported"),
        ("version 1", Box::new(|b, _| put_u32(b, 4, 1)), "GGUF version 1 is not supported"),
        ("huge tensor count", Box::new(|b, _| put_u64(b, 8, u64::MAX)), "tensor count"),
        ("huge metadata count", Box::new(|b, _| put_u64(b, 16, 1 << 40)), "metadata count"),
        ("lying key length", Box::new(|b, l| put_u64(b, l.kvs[0].1, 1 << 50)), "metadata key #0"),
        (
            "lying string value length",
            Box::new(|b, l| put_u64(b, l.kv("general.architecture").2, 1 << 40)),
            "value of metadata 'general.architecture'",
        ),
        (
            "lying array length",
            Box::new(|b, l| put_u64(b, l.kv("tokenizer.ggml.tokens").2 + 4, 1 << 60)),
            "length of array 'tokenizer.ggml.tokens'",
        ),
        (
            "string in array longer than the file",
            Box::new(|b, l| put_u64(b, l.kv("tokenizer.ggml.tokens").2 + 12, u64::MAX)),
            "element 0 of array 'tokenizer.ggml.tokens'",
        ),
        (
            "unknown value type",
            Box::new(|b, l| put_u32(b, l.kv("general.architecture").1, 13)),
            "unknown value type id 13",
        ),
        (
            "unknown array element type",
            Box::new(|b, l| put_u32(b, l.kv("tokenizer.ggml.tokens").2, 77)),
            "unknown value type id 77",
        ),
        ("duplicate metadata key", Box::new(|b, l| dup_key(b, l)), "appears twice"),
        ("key not UTF-8", Box::new(|b, l| b[l.kvs[0].1 + 8] = 0xff), "not valid UTF-8"),
        ("bool byte not 0 or 1", Box::new(|b, l| b[l.kv("tokenizer.ggml.add_bos_token").2] = 7), "bool byte 7"),
        ("too many dimensions", Box::new(|b, l| put_u32(b, l.tensor(first_tensor).1, 9)), "9 dimensions"),
        (
            "dimensions overflow",
            Box::new(|b, l| {
                let d = l.tensor(first_tensor).2;
                put_u64(b, d, 1 << 40);
                put_u64(b, d + 8, 1 << 40);
            }),
            "overflow the element count",
        ),
        (
            "negative dimension",
            Box::new(|b, l| put_u64(b, l.tensor(first_tensor).2 + 8, u64::MAX)),
            "negative or too large",
        ),
        (
            "row not a multiple of the block",
            Box::new(|b, l| put_u64(b, l.tensor(first_tensor).2, 33)),
            "not a multiple of the Q8_0 block size 32",
        ),
        ("unknown tensor type", Box::new(|b, l| put_u32(b, l.tensor(first_tensor).3, 99)), "unknown ggml type id 99"),
        (
            "removed tensor type",
            Box::new(|b, l| put_u32(b, l.tensor(first_tensor).3, 31)),
            "Q4_0_4_4 (id 31) was removed",
        ),
        (
            "tensor offset past the end",
            Box::new(|b, l| put_u64(b, l.tensor(first_tensor).4, 1 << 40)),
            "lies past the end of the file",
        ),
        (
            "misaligned tensor offset",
            Box::new(|b, l| {
                let at = l.tensor("output_norm.weight").4;
                let v = u64_at(b, at);
                put_u64(b, at, v + 4)
            }),
            "not a multiple of the alignment 32",
        ),
        ("duplicate tensor name", Box::new(|b, l| dup_tensor(b, l)), "appears twice"),
        ("overlapping tensors", Box::new(|b, l| overlap(b, l)), "overlap"),
    ]
}

/// Renames the second metadata key to the first one's name when they have the same length.
fn dup_key(b: &mut [u8], l: &Layout) {
    let (a, c) = l
        .kvs
        .iter()
        .enumerate()
        .flat_map(|(i, x)| l.kvs[i + 1..].iter().map(move |y| (x, y)))
        .find(|(x, y)| x.0.len() == y.0.len())
        .expect("two keys of one length");
    let name = a.0.as_bytes().to_vec();
    b[c.1 + 8..c.1 + 8 + name.len()].copy_from_slice(&name);
}

fn dup_tensor(b: &mut [u8], l: &Layout) {
    let (k_at, ..) = l.tensor("blk.0.attn_k.weight");
    b[k_at + 8..k_at + 8 + 19].copy_from_slice(b"blk.0.attn_q.weight");
}

fn overlap(b: &mut [u8], l: &Layout) {
    let q_off = u64_at(b, l.tensor("blk.0.attn_q.weight").4);
    put_u64(b, l.tensor("blk.0.attn_k.weight").4, q_off);
}

#[test]
fn every_corruption_gets_a_one_line_error() {
    let path = ts_testkit::models_dir().join("smollm2-135m-instruct-q4_1.gguf");
    assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
    let original = std::fs::read(&path).unwrap();
    let layout = layout(&original);
    let dir = std::env::temp_dir().join(format!("ts-corrupt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let corruptions = corruptions();
    assert!(corruptions.len() >= 20);
    let mut failures = Vec::new();
    for (what, corrupt, expected) in &corruptions {
        let mut bytes = original.clone();
        corrupt(&mut bytes, &layout);
        let file = dir.join("corrupt.gguf");
        std::fs::write(&file, &bytes).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).arg("inspect").arg(&file).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        let ok = !out.status.success()
            && out.status.code().is_some()
            && lines.len() == 1
            && lines[0].starts_with("error: ")
            && lines[0].contains(expected)
            && ts_testkit::repeated_part(lines[0]).is_none()
            && !stderr.contains("panicked");
        println!("{what:<40} -> {}", stderr.trim());
        if !ok {
            failures.push(format!(
                "{what}: expected one line containing {expected:?}, each part said once, got status {} and {stderr:?}",
                out.status
            ));
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_uncorrupted_file_inspects_cleanly() {
    let path = ts_testkit::models_dir().join("smollm2-135m-instruct-q4_1.gguf");
    assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
    let out = Command::new(env!("CARGO_BIN_EXE_turbospark")).arg("inspect").arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
