//! Test support shared by the crates' test suites: where the real models and
//! the reference fixtures live, and golden-logit files with their comparison.

mod golden;

pub use golden::{Comparison, Golden};

use std::path::{Path, PathBuf};

/// The repository root: `$TURBOSPARK_ROOT` (test binaries run on another
/// machine, e.g. the GPU machine), else where this crate was built.
pub fn repo_root() -> PathBuf {
    std::env::var_os("TURBOSPARK_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// Where `tools/fetch-models.sh` puts the real models: `$TURBOSPARK_MODELS`, else `models/`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("TURBOSPARK_MODELS").map(PathBuf::from).unwrap_or_else(|| repo_root().join("models"))
}

/// The real model `file` in [`models_dir`]; its absence is a failure (tools/test.sh fetches it).
pub fn real_model(file: &str) -> PathBuf {
    let path = models_dir().join(file);
    assert!(path.exists(), "{} is absent: run tools/fetch-models.sh (tools/test.sh does)", path.display());
    path
}

/// A part of the one-line error `line` (`error: ` then parts between ": ", an error and its
/// causes) that equals or lies inside another part: a cause printed again, or a path named twice.
pub fn repeated_part(line: &str) -> Option<&str> {
    let parts: Vec<&str> = line.trim().trim_start_matches("error: ").split(": ").map(str::trim).collect();
    let inside = |(i, a): (usize, &&str)| parts.iter().enumerate().any(|(j, b)| i != j && b.contains(*a));
    parts.iter().enumerate().find(|p| inside(*p)).map(|(_, a)| *a)
}

/// The committed reference fixtures (`tests/fixtures/<family>/`).
pub fn fixtures_dir() -> PathBuf {
    repo_root().join("tests/fixtures")
}

/// One committed fixture model: its family, type variant, GGUF and golden logits.
pub struct Fixture {
    pub family: String,
    pub variant: String,
    pub model: PathBuf,
    pub golden: Golden,
}

impl Fixture {
    /// The bound on the median row's max |Δ| / max |ref| of the default mode (8-bit
    /// activations) against the golden logits. The 8-layer hybrids carry 8-bit rounding through
    /// their recurrent state: llama.cpp itself lands at median 1.16e-1 (qwen3_5_moe) and 1.83e-1
    /// (qwen3_next) on their Q8_0 files (tests/fixtures/README.md); their bound is 1.25 times
    /// that.
    pub fn default_mode_bound(&self) -> f32 {
        match (self.family.as_str(), self.variant.as_str()) {
            ("qwen3_5_moe", "q8_0") => 1.45e-1,
            ("qwen3_next", "q8_0") => 2.3e-1,
            _ => 6e-2,
        }
    }
}

/// The largest difference of two runs' logits, each row's relative to its largest logit in
/// `want`.
pub fn worst_row_rel_diff(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
        })
        .fold(0f32, f32::max)
}

/// Every fixture under [`fixtures_dir`], sorted by family then variant (empty,
/// after printing why, when the directory is missing).
pub fn fixtures() -> Vec<Fixture> {
    let dir = fixtures_dir();
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("the fixtures in {}: {e}", dir.display()));
    let mut families: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir()).collect();
    families.sort();
    let mut out = Vec::new();
    for fam in families {
        let mut models: Vec<PathBuf> =
            std::fs::read_dir(&fam).map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
        models.retain(|p| p.extension().is_some_and(|x| x == "gguf"));
        models.sort();
        for model in models {
            let variant = model.file_stem().unwrap().to_string_lossy().trim_start_matches("model-").to_string();
            let golden_path = fam.join(format!("golden-{variant}.bin"));
            let golden = Golden::read(&golden_path).unwrap_or_else(|e| panic!("{}: {e}", golden_path.display()));
            let family = fam.file_name().unwrap().to_string_lossy().to_string();
            out.push(Fixture { family, variant, model, golden });
        }
    }
    out
}

/// A tensor to write with [`rewrite_gguf`]: name, type, ggml-order dims, bytes.
pub type TensorEntry = (String, ts_gguf::GgmlType, Vec<u64>, Vec<u8>);

/// Copies the GGUF at `src` to `dst`, letting `edit` change the metadata and
/// the tensor list first (for tests that need a subtly wrong model).
pub fn rewrite_gguf(
    src: &Path,
    dst: &Path,
    edit: impl FnOnce(&mut Vec<(String, ts_gguf::Value)>, &mut Vec<TensorEntry>),
) -> std::io::Result<()> {
    let file = ts_gguf::GgufFile::open(src).map_err(std::io::Error::other)?;
    let mut metadata: Vec<(String, ts_gguf::Value)> =
        file.metadata().iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    let mut tensors: Vec<TensorEntry> = file
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.ggml_type, t.dims.clone(), file.tensor_data(t).to_vec()))
        .collect();
    edit(&mut metadata, &mut tensors);
    let mut w = ts_gguf::GgufWriter::new();
    for (k, v) in metadata {
        w.set(&k, v)?;
    }
    for (name, ty, dims, _) in &tensors {
        w.add_tensor(name, *ty, dims)?;
    }
    let data: Vec<&[u8]> = tensors.iter().map(|t| t.3.as_slice()).collect();
    std::fs::write(dst, w.to_bytes(&data)?)
}

/// SplitMix64: reproducible test data without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    /// `n` normals times `scale` plus `offset`.
    pub fn normals(&mut self, n: usize, scale: f32, offset: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale + offset).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::repeated_part;

    #[test]
    fn repeated_parts_are_found() {
        let os = "error: /x.gguf: No such file or directory (os error 2): No such file or directory (os error 2)";
        assert_eq!(repeated_part(os), Some("No such file or directory (os error 2)"));
        assert_eq!(repeated_part("error: loading the tokenizer of /x.gguf: /x.gguf: gone"), Some("/x.gguf"));
        assert_eq!(repeated_part("error: --draft-model: /x.gguf: No such file or directory (os error 2)"), None);
        assert_eq!(repeated_part("error: --ctx-size must be at least 1"), None);
    }
}
