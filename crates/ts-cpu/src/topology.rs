//! How many threads suit the CPU kernels by default: one per physical core the process may run
//! on. Two hyperthreads of a core share its load units, and decode is bound by memory: as
//! llama.cpp's default (`cpu_get_num_math`, physical cores), not the logical CPU count.

use std::collections::HashSet;

/// One thread per physical core among the CPUs this process may run on, at most what the OS
/// grants it ([`std::thread::available_parallelism`]: affinity and cgroup quota); that count
/// where the topology cannot be read (not Linux, no sysfs).
pub fn default_threads() -> usize {
    let granted = std::thread::available_parallelism().map_or(1, |n| n.get());
    physical_cores().map_or(granted, |cores| cores.clamp(1, granted))
}

/// Distinct physical cores (sets of hyperthread siblings) among the CPUs in this process's
/// affinity list, from Linux's `/proc/self/status` and sysfs.
fn physical_cores() -> Option<usize> {
    let mut cores = HashSet::new();
    for cpu in allowed_cpus()? {
        let path = format!("/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list");
        cores.insert(std::fs::read_to_string(path).ok()?.trim().to_string());
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// The CPUs in this process's affinity list (Linux's `/proc/self/status`).
fn allowed_cpus() -> Option<Vec<usize>> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_cpu_list(status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?.trim())
}

/// The CPUs of a Linux CPU list such as `0-3,8,10-11`; None if it is malformed.
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.trim().parse::<usize>().ok()?, b.trim().parse::<usize>().ok()?);
                if b < a {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    Some(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a-b"), None);
    }

    #[test]
    fn default_is_between_one_and_what_the_os_grants() {
        let granted = std::thread::available_parallelism().map_or(1, |n| n.get());
        let t = default_threads();
        assert!((1..=granted).contains(&t), "{t} of {granted}");
        // Where sysfs is there, each core is counted once: at least one, at most one per
        // allowed CPU (a machine with hyperthreads has fewer).
        if let Some(cores) = physical_cores() {
            let allowed = allowed_cpus().unwrap().len();
            assert!((1..=allowed).contains(&cores), "{cores} cores of {allowed} allowed CPUs");
        }
    }
}
