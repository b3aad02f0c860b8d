//! Weights the process owns in 2 MiB pages.

/// 2 MiB: the pages [`ask_for_huge_pages`] asks for.
const HUGE: usize = 2 << 20;

/// Asks the kernel to back `bytes` (memory this process owns, best not yet touched: pages
/// already there stay small until `khugepaged` merges them) with 2 MiB pages where it can:
/// `madvise(MADV_HUGEPAGE)` on the whole 2 MiB pages inside it, which matters where
/// transparent huge pages are `madvise` only (a common default). A matrix read end to end then
/// crosses a page boundary every 2 MiB, not every 4 KiB: Qwen2.5-0.5B's packed Q8_0 output head
/// (145 MB) took 6.1-6.4 ms a one-thread step in 2 MiB pages against 7.8-8.5 in 4 KiB ones on
/// Zen 4. Nothing changes where the kernel has them off or refuses. `TURBOSPARK_NO_HUGE_PAGES=1`,
/// a measurement knob, skips the advice.
pub fn ask_for_huge_pages<T>(bytes: &[T]) {
    #[cfg(target_os = "linux")]
    {
        if std::env::var_os("TURBOSPARK_NO_HUGE_PAGES").is_some() {
            return;
        }
        let start = (bytes.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (bytes.as_ptr() as usize + std::mem::size_of_val(bytes)) / HUGE * HUGE;
        if end > start {
            // SAFETY: advice only (no contents change), on whole pages inside `bytes`.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

/// `len` zeroed bytes the process owns, starting on a 2 MiB boundary and asked for 2 MiB pages
/// before anything touches them ([`ask_for_huge_pages`]): many matrices laid end to end in one
/// such region sit in 2 MiB pages but the last one, where each in an allocation of its own
/// would keep its unaligned ends (most of a 0.5-3 MB matrix) in 4 KiB pages.
pub struct HugeBytes {
    base: *mut u8,
    /// Bytes mapped from `base`: `len` and the room to align its start.
    mapped: usize,
    start: *mut u8,
    len: usize,
}

// SAFETY: plain memory, shared as `&[u8]` or written through `&mut`.
unsafe impl Send for HugeBytes {}
unsafe impl Sync for HugeBytes {}

impl HugeBytes {
    /// Fails where the system has no room for `len` bytes.
    pub fn new(len: usize) -> std::io::Result<HugeBytes> {
        let mapped = len.max(1) + HUGE;
        // SAFETY: a new private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = base.cast::<u8>();
        // SAFETY: the aligned start and `len` bytes after it lie inside the mapping.
        let start = unsafe { base.add((base as usize).next_multiple_of(HUGE) - base as usize) };
        let bytes = HugeBytes { base, mapped, start, len };
        ask_for_huge_pages(&bytes[..]);
        Ok(bytes)
    }
}

impl std::ops::Deref for HugeBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` mapped (zero-filled) bytes from `start`.
        unsafe { std::slice::from_raw_parts(self.start, self.len) }
    }
}

impl std::ops::DerefMut for HugeBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, borrowed exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.start, self.len) }
    }
}

impl Drop for HugeBytes {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.mapped) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_bytes_start_on_a_huge_page_and_hold_zeros_until_written() {
        for len in [0, 1, 3 << 20] {
            let mut b = HugeBytes::new(len).unwrap();
            assert_eq!(b.len(), len);
            assert!((b.as_ptr() as usize).is_multiple_of(HUGE));
            assert!(b.iter().all(|&x| x == 0));
            if len > 0 {
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
            }
        }
    }
}
