//! How much memory there is, and where routed experts should live given it.

use std::path::Path;
use ts_model::{ExpertPlacement, StreamOptions};

/// Bytes this process may still use: the smaller of the kernel's MemAvailable
/// and what the memory cgroup (v1 or v2) leaves under its limit.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = |key: &str| -> Option<u64> {
        let line = meminfo.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|k| k * 1024)
    };
    let mut avail = kb("MemAvailable:")?;
    if let Some(left) = cgroup_headroom() {
        avail = avail.min(left);
    }
    Some(avail)
}

/// The cgroup's limit minus its usage, if the process is in a limited memory cgroup.
fn cgroup_headroom() -> Option<u64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let read = |p: String| std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.split(',').any(|c| c == "memory") {
            let dir = format!("/sys/fs/cgroup/memory{path}");
            let (limit, usage) =
                (read(format!("{dir}/memory.limit_in_bytes"))?, read(format!("{dir}/memory.usage_in_bytes"))?);
            // An unlimited v1 group reports a huge number.
            return (limit < 1 << 60).then(|| limit.saturating_sub(usage));
        }
        if controllers.is_empty() {
            let dir = format!("/sys/fs/cgroup{path}");
            let limit = read(format!("{dir}/memory.max"));
            let usage = read(format!("{dir}/memory.current"));
            if let (Some(l), Some(u)) = (limit, usage) {
                return Some(l.saturating_sub(u));
            }
        }
    }
    None
}

/// Expert tensors' bytes and everything else's, from a GGUF's tensor table.
pub fn expert_and_dense_bytes(path: &Path) -> Result<(u64, u64), ts_gguf::GgufError> {
    let file = ts_gguf::GgufFile::open(path)?;
    let experts: u64 = file.tensors().iter().filter(|t| t.name.ends_with("_exps.weight")).map(|t| t.n_bytes).sum();
    Ok((experts, file.header.tensor_bytes_total() - experts))
}

/// Room kept for activations, scratch, thread stacks and the allocator.
pub const OVERHEAD_BYTES: u64 = 512 << 20;

/// `resident` when the whole model, the KV cache and some room fit in
/// `available`; else `stream` with a cache of what is left after the dense
/// weights, the KV cache and that room. Returns the choice and a line saying why.
pub fn auto_placement(
    experts: u64,
    dense: u64,
    kv_bytes: u64,
    available: u64,
    base: &StreamOptions,
) -> (ExpertPlacement, String) {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    if experts == 0 || experts + dense + kv_bytes + OVERHEAD_BYTES <= available {
        let why = format!(
            "experts resident: model {:.0} MiB + KV {:.0} MiB fits in {:.0} MiB available",
            mib(experts + dense),
            mib(kv_bytes),
            mib(available)
        );
        return (ExpertPlacement::Resident, why);
    }
    let cache = available.saturating_sub(dense + kv_bytes + OVERHEAD_BYTES);
    let why = format!(
        "experts streamed: model {:.0} MiB does not fit in {:.0} MiB available; expert cache {:.0} MiB (dense {:.0} MiB, KV {:.0} MiB)",
        mib(experts + dense),
        mib(available),
        mib(cache),
        mib(dense),
        mib(kv_bytes)
    );
    (ExpertPlacement::Stream(StreamOptions { cache_bytes: cache, ..base.clone() }), why)
}

/// Parses a size such as `6GiB`, `512MiB`, `1.5G`, `800M`, or plain bytes.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.trim().parse().ok()?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    (n >= 0.0 && n.is_finite()).then_some((n * mult as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("6GiB"), Some(6 << 30));
        assert_eq!(parse_size("512MiB"), Some(512 << 20));
        assert_eq!(parse_size("1.5g"), Some(3 << 29));
        assert_eq!(parse_size("1000"), Some(1000));
        assert_eq!(parse_size("12 parsecs"), None);
        assert_eq!(parse_size("-1G"), None);
    }

    #[test]
    fn auto_streams_only_when_the_model_does_not_fit() {
        let base = StreamOptions::default();
        let (p, _) = auto_placement(4 << 30, 1 << 30, 1 << 28, 16 << 30, &base);
        assert_eq!(p, ExpertPlacement::Resident);
        let (p, why) = auto_placement(10 << 30, 2 << 30, 1 << 28, 5 << 30, &base);
        match p {
            ExpertPlacement::Stream(o) => {
                assert_eq!(o.cache_bytes, (5u64 << 30) - (2 << 30) - (1 << 28) - OVERHEAD_BYTES)
            }
            other => panic!("{other:?}: {why}"),
        }
    }

    #[test]
    fn available_memory_is_known_here() {
        assert!(available_memory().is_some_and(|a| a > 0));
    }
}
