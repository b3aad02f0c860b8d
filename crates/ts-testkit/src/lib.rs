//! Test support shared by the crates' test suites: where the real models and
//! the reference fixtures live, and golden-logit files with their comparison.

mod golden;

pub use golden::{Comparison, Golden};

use std::path::{Path, PathBuf};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Where `tools/fetch-models.sh` puts the real models: `$TURBOSPARK_MODELS`, else `models/`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("TURBOSPARK_MODELS").map(PathBuf::from).unwrap_or_else(|| repo_root().join("models"))
}

/// The real model `file` in [`models_dir`], or `None` after printing why the caller skips.
pub fn real_model(file: &str) -> Option<PathBuf> {
    let path = models_dir().join(file);
    if path.exists() {
        Some(path)
    } else {
        eprintln!("skipped: {} is absent (run tools/fetch-models.sh)", path.display());
        None
    }
}

/// The committed reference fixtures (`tests/fixtures/<family>/`).
pub fn fixtures_dir() -> PathBuf {
    repo_root().join("tests/fixtures")
}
