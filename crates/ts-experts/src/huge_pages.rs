//! Weights the process owns in 2 MiB pages.

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
        const HUGE: usize = 2 << 20;
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
