//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// Where the models live: `$TURBOSPARK_MODELS`, else `models/` at the repository root.
pub fn models_dir() -> PathBuf {
    match std::env::var_os("TURBOSPARK_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models"),
    }
}

/// Committed test data.
pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}
