//! Synthetic GGUF models for benchmarks: a real MoE model's architecture, metadata keys,
//! tensor names, shapes and types, a vocabulary of the right size without a tokenizer,
//! and random weights whose routers pick experts with realistic skew (docs/SYNTH.md).
//!
//! ```no_run
//! let spec = ts_synth::spec("gpt-oss-20b")?;
//! let opts = ts_synth::SynthOptions { layers: Some(2), ..Default::default() };
//! ts_synth::write(&spec, &opts, "/tmp/gpt-oss-20b-2l.gguf".as_ref(), &mut ())?;
//! # Ok::<(), ts_synth::SynthError>(())
//! ```

mod fill;
mod plan;
mod progress;
mod rng;
mod routing;
mod spec;
mod stats;

pub use fill::{EMBEDDING_TYPES, EmbeddingCodec, WEIGHT_TYPES, WeightCodec, pack_scale_min_k4};
pub use plan::{EXPERT_TYPES, Fill, Plan, PlannedTensor, parse_quant};
pub use progress::{Progress, TerminalProgress};
pub use rng::Rng;
pub use routing::{COMMON_SHARE, EMBEDDING_RMS, Routing};
pub use spec::{Family, ModelSpec, NAMES, Recipe, Reference, spec};
pub use stats::RoutingStats;
pub use ts_gguf::GgmlType;

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown model '{name}' (choices: {choices})")]
    UnknownModel { name: String, choices: String },
    #[error("unknown expert type '{name}' (choices: {choices})")]
    UnknownType { name: String, choices: String },
    #[error("unknown routing '{name}' (choices: {choices})")]
    UnknownRouting { name: String, choices: String },
    #[error("--layers {asked}: must be between 1 and {max}")]
    Layers { asked: usize, max: usize },
    #[error("--quant {ty}: {model} has rows of {row} elements, not a multiple of the {block}-element block")]
    Incompatible { ty: String, model: String, row: usize, block: u64 },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("writing the file: {0}")]
    Write(io::Error),
    #[error("{0}")]
    Internal(String),
}

impl SynthError {
    fn internal(e: impl std::fmt::Display) -> SynthError {
        SynthError::Internal(e.to_string())
    }
}

/// What to write, beyond the model it imitates.
#[derive(Clone, Debug, Default)]
pub struct SynthOptions {
    /// Type of the routed-expert tensors; `None` keeps the real file's recipe.
    pub expert_type: Option<GgmlType>,
    /// Keep the first N layers (same per-layer shapes; types chosen as for an N-layer model).
    pub layers: Option<usize>,
    pub routing: Routing,
    pub seed: u64,
    /// Threads generating data (default: all cores); the output does not depend on it.
    pub threads: Option<usize>,
}

/// What [`write`] did.
#[derive(Clone, Copy, Debug)]
pub struct WriteSummary {
    pub bytes: u64,
    pub tensors: usize,
    pub seconds: f64,
}

/// Lays out the file `spec` and `opts` describe, then writes it to `path`.
pub fn write(
    spec: &ModelSpec,
    opts: &SynthOptions,
    path: &Path,
    progress: &mut dyn Progress,
) -> Result<WriteSummary, SynthError> {
    Plan::new(spec, opts)?.write(path, progress)
}

/// Counts bytes into the progress display, a few MiB at a time.
struct CountingWriter<'a, W: Write> {
    inner: W,
    progress: &'a mut dyn Progress,
}

impl<W: Write> Write for CountingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(&buf[..buf.len().min(4 << 20)])?;
        self.progress.advance(n as u64);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Plan {
    /// Writes the file to `path`, then fsyncs it, so that a benchmark started next does not
    /// compete with write-back. A file left half-written by an error is removed.
    pub fn write(&self, path: &Path, progress: &mut dyn Progress) -> Result<WriteSummary, SynthError> {
        let start = Instant::now();
        let io_err = |source| SynthError::Io { path: path.to_path_buf(), source };
        let result = File::create(path).map_err(io_err).and_then(|file| {
            let file = self.write_into(file, &mut *progress).map_err(|e| match e {
                SynthError::Write(source) => io_err(source),
                other => other,
            })?;
            file.sync_all().map_err(io_err)
        });
        progress.finish();
        if result.is_err() {
            let _ = std::fs::remove_file(path);
        }
        result?;
        Ok(WriteSummary {
            bytes: self.file_size()?,
            tensors: self.tensors.len(),
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// Streams the file into `out`: the header, then each tensor as it is generated (the
    /// next tensor is generated while the previous one is written). Returns `out` flushed.
    pub fn write_into<W: Write>(&self, out: W, progress: &mut dyn Progress) -> Result<W, SynthError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(self.opts.threads.unwrap_or(0))
            .build()
            .map_err(SynthError::internal)?;
        progress.start(self.file_size()?);
        let out = BufWriter::with_capacity(8 << 20, CountingWriter { inner: out, progress: &mut *progress });
        let mut data = self.gguf_writer()?.write_header(out).map_err(SynthError::Write)?;

        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<Vec<u8>, SynthError>>(0);
        let (spare_tx, spare_rx) = mpsc::channel::<Vec<u8>>();
        std::thread::scope(|s| {
            s.spawn(move || {
                for t in &self.tensors {
                    let mut buf = spare_rx.try_recv().unwrap_or_default();
                    buf.resize(t.n_bytes() as usize, 0);
                    let filled = pool.install(|| self.fill(t, &mut buf)).map(|()| buf);
                    if ready_tx.send(filled).is_err() {
                        return;
                    }
                }
            });
            for buf in ready_rx {
                let buf = buf?;
                data.write_tensor(&buf).map_err(SynthError::Write)?;
                let _ = spare_tx.send(buf);
            }
            Ok::<(), SynthError>(())
        })?;
        let out = data.finish().map_err(SynthError::Write)?;
        Ok(out.into_inner().map_err(|e| SynthError::Write(e.into_error()))?.inner)
    }
}
