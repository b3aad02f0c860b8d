//! Progress of a write: a trait the library reports to, and a terminal bar.

/// Receives the byte count of a write as it goes.
pub trait Progress {
    fn start(&mut self, _total_bytes: u64) {}
    fn advance(&mut self, _bytes: u64) {}
    fn finish(&mut self) {}
}

/// No progress display.
impl Progress for () {}

/// A bar on stderr with bytes written, rate and time left; hidden when stderr is not a terminal.
pub struct TerminalProgress {
    bar: indicatif::ProgressBar,
}

impl TerminalProgress {
    pub fn new() -> TerminalProgress {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40.cyan/blue} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        TerminalProgress { bar }
    }
}

impl Default for TerminalProgress {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress for TerminalProgress {
    fn start(&mut self, total_bytes: u64) {
        self.bar.set_length(total_bytes);
    }

    fn advance(&mut self, bytes: u64) {
        self.bar.inc(bytes);
        if self.bar.position() == self.bar.length().unwrap_or(0) {
            self.bar.set_message("syncing to disk");
        }
    }

    fn finish(&mut self) {
        self.bar.finish_and_clear();
    }
}
