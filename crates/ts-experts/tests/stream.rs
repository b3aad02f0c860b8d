//! The streaming store returns exactly the file's bytes, whatever is cached,
//! never evicts an expert in use, and turns a failed read into an error that
//! names the file and offset (and recovers afterwards).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use ts_experts::*;

/// A file of pseudo-random bytes and a layout of 3 layers x 8 experts whose
/// matrices start at unaligned offsets and have different sizes.
fn fixture(name: &str) -> (PathBuf, Vec<u8>, ExpertLayout) {
    let mut bytes = vec![0u8; 3 << 20];
    let mut x = 0x1234_5678_9abc_def0u64;
    for b in bytes.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let path = std::env::temp_dir().join(format!("ts-experts-{name}-{}.bin", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let mut at = 100u64;
    let mut proj = |size: usize| {
        let p = ProjLayout { file_offset: at, expert_bytes: size };
        at += (size * 8) as u64 + 36;
        p
    };
    let layers = (0..3)
        .map(|l| Some(LayerLayout { n_expert: 8, proj: [proj(9000 + l * 17), proj(9000 + l * 17), proj(7001)] }))
        .collect();
    (path.clone(), bytes, ExpertLayout { path, layers })
}

fn expected<'a>(bytes: &'a [u8], layout: &ExpertLayout, layer: usize, e: usize) -> [&'a [u8]; 3] {
    layout.layers[layer].unwrap().proj.map(|p| &bytes[p.offset(e) as usize..p.offset(e) as usize + p.expert_bytes])
}

fn opts(slots_bytes: u64, policy: EvictionPolicy) -> StreamOptions {
    StreamOptions { cache_bytes: slots_bytes, policy, readers: 3, direct_io: true }
}

#[test]
fn streamed_bytes_equal_the_file_under_every_policy() {
    let (path, bytes, layout) = fixture("equal");
    for policy in [EvictionPolicy::Lru, EvictionPolicy::Lfu, EvictionPolicy::DecayedFrequency { half_life: 8.0 }] {
        let store = StreamingExperts::open(layout.clone(), &opts(14 * 40_000, policy)).unwrap();
        assert!(store.slots() >= 4, "{} slots", store.slots());
        let mut x = 7u64;
        for step in 0..300 {
            let layer = step % 3;
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let ids: Vec<usize> = (0..3)
                .map(|i| ((x >> (20 + 3 * i)) % 8) as usize)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            let set = store.ensure(layer, &ids).unwrap();
            for (i, &e) in ids.iter().enumerate() {
                let got = set.get(i).unwrap();
                let want = expected(&bytes, &layout, layer, e);
                assert!(
                    got.gate == want[0] && got.up == want[1] && got.down == want[2],
                    "{policy:?} layer {layer} expert {e}"
                );
            }
        }
        let s = store.stats().unwrap().total();
        assert!(s.hits > 0 && s.misses > 0, "{s:?}");
    }
    std::fs::remove_file(path).ok();
}

#[test]
fn experts_in_use_are_never_evicted() {
    let (path, bytes, layout) = fixture("pins");
    let store = StreamingExperts::open(layout.clone(), &opts(4 * 40_000, EvictionPolicy::Lru)).unwrap();
    let n = store.slots();
    let held: Vec<usize> = (0..n - 1).collect();
    let a = store.ensure(0, &held).unwrap();
    // One slot is free: asking for two new experts at once must fail, not evict a held one.
    let err = store.ensure(1, &[0, 1]).err().expect("only one slot is free");
    assert!(err.to_string().contains("expert cache holds"), "{err}");
    let b = store.ensure(1, &[5]).unwrap();
    for (i, &e) in held.iter().enumerate() {
        assert_eq!(a.get(i).unwrap().gate, expected(&bytes, &layout, 0, e)[0]);
    }
    assert_eq!(b.get(0).unwrap().down, expected(&bytes, &layout, 1, 5)[2]);
    drop((a, b));
    std::fs::remove_file(path).ok();
}

/// Reads a file, failing the reads that cover one offset while armed.
struct Flaky {
    file: std::fs::File,
    path: PathBuf,
    fail_at: AtomicU64,
}

impl ReadSource for Flaky {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let bad = self.fail_at.load(Ordering::SeqCst);
        if (offset..offset + buf.len() as u64).contains(&bad) {
            return Err(io::Error::other("injected media error"));
        }
        std::os::unix::fs::FileExt::read_exact_at(&self.file, buf, offset)
    }
    fn alignment(&self) -> usize {
        1
    }
    fn direct(&self) -> bool {
        false
    }
    fn path(&self) -> &Path {
        &self.path
    }
}

#[test]
fn a_failed_read_is_an_error_naming_file_and_offset_then_recovers() {
    let (path, bytes, layout) = fixture("flaky");
    let target = layout.layers[2].unwrap().proj[1].offset(3) + 10;
    let source =
        Flaky { file: std::fs::File::open(&path).unwrap(), path: path.clone(), fail_at: AtomicU64::new(target) };
    let store = StreamingExperts::with_source(layout.clone(), &opts(6 * 40_000, EvictionPolicy::Lru), Box::new(source))
        .unwrap();
    {
        let set = store.ensure(2, &[1, 3]).unwrap();
        assert_eq!(set.get(0).unwrap().up, expected(&bytes, &layout, 2, 1)[1]);
        let err = set.get(1).err().expect("the read of expert 3 fails");
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains("expert 3 of layer 2") && msg.contains("offset"),
            "{msg}"
        );
        assert!(msg.contains("injected media error"), "{msg}");
    }
    // Asking again retries the read rather than serving what the failed read left.
    let set = store.ensure(2, &[3]).unwrap();
    assert!(set.get(0).is_err(), "still failing while the fault is armed");
    drop(set);
    if let Some(s) = store.stats() {
        assert!(s.total().misses >= 3);
    }
    std::fs::remove_file(path).ok();
}

#[test]
fn out_of_range_and_dense_layers_are_errors() {
    let (path, _, mut layout) = fixture("range");
    layout.layers.push(None);
    let store = StreamingExperts::open(layout, &opts(4 * 40_000, EvictionPolicy::Lru)).unwrap();
    assert!(store.ensure(0, &[8]).err().unwrap().to_string().contains("out of range"));
    assert!(store.ensure(3, &[0]).err().unwrap().to_string().contains("no routed experts"));
    std::fs::remove_file(path).ok();
}
