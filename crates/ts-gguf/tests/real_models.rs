//! Positioned reads and the mmap agree on real files; bad ranges are errors.

use std::path::PathBuf;
use ts_gguf::{GgufError, GgufFile};

fn models() -> Vec<PathBuf> {
    let dir = ts_testkit::models_dir();
    let found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "gguf")).collect()
        })
        .unwrap_or_default();
    assert!(!found.is_empty(), "no models in {}: run tools/fetch-models.sh", dir.display());
    found
}

#[test]
fn positioned_reads_match_the_map() {
    for path in models() {
        let f = GgufFile::open(&path).unwrap();
        for t in f.tensors().iter().step_by(17) {
            let mapped = f.tensor_data(t);
            let mid = t.n_bytes / 3;
            let mut buf = vec![0u8; (t.n_bytes - mid) as usize];
            f.read_tensor_range(t, mid..t.n_bytes, &mut buf).unwrap();
            assert_eq!(&buf[..], &mapped[mid as usize..], "{}: {}", path.display(), t.name);
        }
        let t = &f.tensors()[0];
        let mut buf = vec![0u8; 16];
        let err = f.read_tensor_range(t, t.n_bytes - 8..t.n_bytes + 8, &mut buf).unwrap_err();
        assert!(matches!(err, GgufError::BadRange { .. }), "{err}");
        assert!(f.tensor("no.such.tensor").is_err());
    }
}

#[test]
fn missing_file_names_the_path() {
    let err = GgufFile::open("/nonexistent/model.gguf").err().unwrap();
    assert!(err.to_string().starts_with("/nonexistent/model.gguf: "), "{err}");
    let err = GgufFile::open("/").err().unwrap();
    assert!(err.to_string().contains("not a regular file"), "{err}");
}
