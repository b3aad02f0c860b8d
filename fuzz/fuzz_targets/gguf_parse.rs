//! The GGUF header parser on arbitrary bytes: it must return Ok or Err, never
//! panic, and never allocate more than the input can justify.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = ts_gguf::parse(data) {
        // Whatever parsed must be self-consistent: every tensor inside the data.
        for t in &g.tensors {
            assert!(t.offset + t.n_bytes <= g.data_len);
        }
        let _ = g.metadata.architecture();
    }
});
