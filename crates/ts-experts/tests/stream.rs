//! The streaming store returns exactly the file's bytes, whatever is cached,
//! never evicts an expert in use, and turns a failed read into an error that
//! names the file and offset (and recovers afterwards).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
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
        let p = ProjLayout::packed(at, size);
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

/// Where a [`flaky`] source fails, shared with the test so it can clear the fault.
struct Fault {
    /// The offset whose reads fail; [`Fault::CLEAR`] for none.
    at: AtomicU64,
    /// Reads failed so far.
    injected: AtomicU64,
}

impl Fault {
    const CLEAR: u64 = u64::MAX;

    fn armed(at: u64) -> Arc<Fault> {
        Arc::new(Fault { at: AtomicU64::new(at), injected: AtomicU64::new(0) })
    }

    fn clear(&self) {
        self.at.store(Self::CLEAR, Ordering::SeqCst);
    }

    fn injected(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }
}

/// Reads a file, after `before(offset, len)` has let each read through (or failed it).
struct Hooked {
    file: std::fs::File,
    path: PathBuf,
    before: Box<dyn Fn(u64, usize) -> io::Result<()> + Send + Sync>,
}

impl Hooked {
    fn new(path: &Path, before: impl Fn(u64, usize) -> io::Result<()> + Send + Sync + 'static) -> Hooked {
        Hooked { file: std::fs::File::open(path).unwrap(), path: path.to_path_buf(), before: Box::new(before) }
    }
}

impl ReadSource for Hooked {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (self.before)(offset, buf.len())?;
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

/// Fails the reads that cover the fault's offset while it is armed.
fn flaky(path: &Path, fault: Arc<Fault>) -> Hooked {
    Hooked::new(path, move |offset, len| {
        let bad = fault.at.load(Ordering::SeqCst);
        if (offset..offset + len as u64).contains(&bad) {
            fault.injected.fetch_add(1, Ordering::SeqCst);
            return Err(io::Error::other("injected media error"));
        }
        Ok(())
    })
}

/// A store over the fixture whose reads of expert 3's up matrix in layer 2 fail while armed.
fn flaky_store(name: &str) -> (PathBuf, Vec<u8>, ExpertLayout, Arc<Fault>, StreamingExperts) {
    let (path, bytes, layout) = fixture(name);
    let fault = Fault::armed(layout.layers[2].unwrap().proj[1].offset(3) + 10);
    let source = flaky(&path, fault.clone());
    let store = StreamingExperts::with_source(layout.clone(), &opts(6 * 40_000, EvictionPolicy::Lru), Box::new(source))
        .unwrap();
    assert!(store.slots() >= 4, "{} slots", store.slots());
    (path, bytes, layout, fault, store)
}

/// Layer 2's counters now.
fn layer2(store: &StreamingExperts) -> LayerStats {
    store.stats().expect("a streaming store keeps statistics").layers[2]
}

#[test]
fn a_failed_read_is_an_error_naming_file_and_offset_then_recovers() {
    let (path, bytes, layout, fault, store) = flaky_store("flaky");
    let want = |e| expected(&bytes, &layout, 2, e);
    // One expert's bytes in layer 2; each matrix is read as the aligned range covering it, so
    // a whole expert's reads come to a little more (under 128 bytes of padding per matrix).
    let expert_bytes = layout.layers[2].unwrap().expert_bytes() as u64;
    let whole_expert = expert_bytes..expert_bytes + 3 * 128;
    {
        let set = store.ensure(2, &[1, 3]).unwrap();
        assert_eq!(set.get(0).unwrap().up, want(1)[1]);
        let err = set.get(1).err().expect("the read of expert 3 fails");
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains("expert 3 of layer 2") && msg.contains("offset"),
            "{msg}"
        );
        assert!(msg.contains("injected media error"), "{msg}");
    }
    let s = layer2(&store);
    assert_eq!((s.hits, s.misses), (0, 2), "{s:?}");
    assert_eq!(fault.injected(), 1);
    // Expert 1 and two matrices of expert 3 were read; the failed one is not counted.
    assert!(s.bytes_read >= expert_bytes && s.bytes_read < 2 * expert_bytes, "{s:?}");

    // Asking again while the fault is armed reads again (a miss, not a hit on what the failed
    // read left) and fails again.
    let before = s;
    let set = store.ensure(2, &[3]).unwrap();
    assert!(set.get(0).is_err(), "still failing while the fault is armed");
    drop(set);
    let s = layer2(&store);
    assert_eq!((s.hits, s.misses), (0, 3), "{s:?}");
    assert_eq!(fault.injected(), 2);
    assert!(s.bytes_read - before.bytes_read < expert_bytes, "the failed matrix is not counted: {s:?}");

    // The fault cleared, the same experts: expert 1 is still cached, expert 3 is read again,
    // and both hold the file's bytes.
    fault.clear();
    let before = s;
    {
        let set = store.ensure(2, &[1, 3]).unwrap();
        for (i, e) in [1, 3].into_iter().enumerate() {
            let got = set.get(i).unwrap_or_else(|err| panic!("expert {e} after the fault cleared: {err}"));
            assert!(got.gate == want(e)[0] && got.up == want(e)[1] && got.down == want(e)[2], "expert {e}");
        }
    }
    let s = layer2(&store);
    assert_eq!((s.hits - before.hits, s.misses - before.misses), (1, 1), "{s:?}");
    assert!(whole_expert.contains(&(s.bytes_read - before.bytes_read)), "one whole expert read: {s:?}");

    // Now it stays cached: a hit, nothing read.
    let before = s;
    {
        let set = store.ensure(2, &[3]).unwrap();
        assert_eq!(set.get(0).unwrap().up, want(3)[1]);
    }
    let s = layer2(&store);
    assert_eq!((s.hits - before.hits, s.misses - before.misses, s.bytes_read), (1, 0, before.bytes_read), "{s:?}");
    assert_eq!(fault.injected(), 2, "no read failed once the fault was cleared");
    std::fs::remove_file(path).ok();
}

/// A prefetch whose read fails leaves nothing usable behind: once the fault is cleared, the
/// first ask for that expert reads it again (a miss) instead of serving the old error.
#[test]
fn a_failed_prefetch_is_read_again_once_the_fault_clears() {
    let (path, bytes, layout, fault, store) = flaky_store("flaky-prefetch");
    store.prefetch(2, &[3]);
    let t = std::time::Instant::now();
    while fault.injected() == 0 {
        assert!(t.elapsed().as_secs() < 30, "the prefetch's reads never ran");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(layer2(&store).prefetched, 1);
    fault.clear();
    {
        let set = store.ensure(2, &[3]).unwrap();
        let got = set.get(0).unwrap_or_else(|err| panic!("expert 3 after the fault cleared: {err}"));
        assert_eq!(got.up, expected(&bytes, &layout, 2, 3)[1]);
    }
    assert_eq!(fault.injected(), 1);
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

#[test]
fn a_set_waits_for_prefetches_in_flight_rather_than_refusing() {
    let (path, bytes, layout) = fixture("inflight");
    // Reads wait until the gate opens: those queued before stay in flight.
    let open = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let gate = open.clone();
    let source = Hooked::new(&path, move |_, _| {
        let (lock, cv) = &*gate;
        let _open = cv.wait_while(lock.lock().unwrap(), |open| !*open).unwrap();
        Ok(())
    });
    let store = StreamingExperts::with_source(layout.clone(), &opts(4 * 40_000, EvictionPolicy::Lru), Box::new(source))
        .unwrap();
    let n = store.slots();
    assert!((2..8).contains(&n), "{n} slots");
    // Every slot taken by a guess whose reads cannot finish yet.
    store.prefetch(1, &(0..n).collect::<Vec<_>>());
    assert_eq!(store.stats().unwrap().layers[1].prefetched, n as u64);
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let (lock, cv) = &*open;
        *lock.lock().unwrap() = true;
        cv.notify_all();
    });
    // A whole cache of other experts: granted once the guesses land, not refused.
    let ids: Vec<usize> = (0..n).collect();
    let set = store.ensure(0, &ids).unwrap();
    for (i, &e) in ids.iter().enumerate() {
        let got = set.get(i).unwrap();
        let want = expected(&bytes, &layout, 0, e);
        assert!(got.gate == want[0] && got.up == want[1] && got.down == want[2], "expert {e}");
    }
    let s = store.stats().unwrap().layers[0];
    assert_eq!((s.hits, s.misses), (0, n as u64), "each miss counted once: {s:?}");
    opener.join().unwrap();
    drop(set);
    std::fs::remove_file(path).ok();
}
