//! Test support: synthetic files in the temporary directory, and routing traces taken
//! from the engine's forward pass.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use ts_experts::{ExpertError, ExpertSet, ExpertStore, MappedExperts};
use ts_gguf::GgufFile;
use ts_model::tensors::ModelWeights;
use ts_model::{ArchConfig, Model, Row, Scratch, SeqState};
use ts_synth::{Plan, RoutingStats, SynthOptions};

/// A file removed when dropped.
pub struct TempFile(pub PathBuf);

impl TempFile {
    pub fn new(name: &str) -> TempFile {
        TempFile(std::env::temp_dir().join(format!("ts-synth-{}-{name}.gguf", std::process::id())))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes `name` with `opts` to a temporary file.
pub fn synth(name: &str, opts: &SynthOptions, tag: &str) -> (Plan, TempFile) {
    let spec = ts_synth::spec(name).unwrap();
    let plan = Plan::new(&spec, opts).unwrap();
    let file = TempFile::new(&format!("{name}-{tag}"));
    plan.write(&file.0, &mut ()).unwrap();
    (plan, file)
}

/// (layer, experts) of every request, in order.
type Trace = Arc<Mutex<Vec<(usize, Vec<usize>)>>>;

/// Passes every request to the mapped store and keeps the experts each layer asked for.
struct Recorder {
    inner: MappedExperts,
    trace: Trace,
}

impl ExpertStore for Recorder {
    fn ensure(&self, layer: usize, ids: &[usize]) -> Result<ExpertSet<'_>, ExpertError> {
        self.trace.lock().unwrap().push((layer, ids.to_vec()));
        self.inner.ensure(layer, ids)
    }

    fn kind(&self) -> &'static str {
        "recorder"
    }
}

/// Runs `tokens` one at a time (as generation does) and returns, per layer, the experts
/// each step selected, and the logits of the last step.
pub fn route_tokens(path: &Path, tokens: &[u32]) -> (Vec<Vec<Vec<usize>>>, Vec<f32>) {
    let file = Arc::new(GgufFile::open(path).unwrap());
    let n_vocab = file.tensor("token_embd.weight").unwrap().dims[1] as usize;
    let cfg = ArchConfig::from_metadata(file.metadata(), n_vocab).unwrap();
    let weights = ModelWeights::load(&file, &cfg).unwrap();
    let layout = ts_model::expert_layout(&file, &weights);
    let trace: Trace = Arc::default();
    let store = Recorder { inner: MappedExperts::new(file.clone(), layout), trace: trace.clone() };
    let model = Model::new(cfg, weights, Box::new(store));
    let mut seq = SeqState::new(&model.cfg, tokens.len(), 1);
    let mut scratch = Scratch::default();
    let mut logits = Vec::new();
    for (pos, &token) in tokens.iter().enumerate() {
        let row = Row { token, pos, seq: 0, logits: pos + 1 == tokens.len() };
        logits = model.forward(&[row], &mut [&mut seq], &mut scratch).unwrap();
    }
    let mut per_layer = vec![Vec::new(); model.cfg.n_layer];
    for (layer, ids) in trace.lock().unwrap().drain(..) {
        per_layer[layer].push(ids);
    }
    (per_layer, logits.pop().unwrap_or_default())
}

/// Random token ids, the same for a given seed.
pub fn random_tokens(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % n_vocab as u64) as u32
        })
        .collect()
}

/// The LRU cache size the statistics use: a quarter of the experts, at least two tokens' worth.
pub fn cache_size(n_expert: usize, n_expert_used: usize) -> usize {
    (n_expert / 4).max(2 * n_expert_used)
}

/// Routing statistics of each layer, with an LRU cache of [`cache_size`] experts.
pub fn layer_stats(per_layer: &[Vec<Vec<usize>>], n_expert: usize) -> Vec<RoutingStats> {
    let used = per_layer.first().and_then(|s| s.first()).map_or(1, Vec::len);
    per_layer.iter().map(|steps| RoutingStats::of_layer(n_expert, steps, cache_size(n_expert, used))).collect()
}

/// The last logits of a prompt of 4 tokens read in one step, then 2 tokens one at a time.
pub fn prompt_then_decode(model: &Model) -> Vec<f32> {
    let mut seq = SeqState::new(&model.cfg, 16, 4);
    let mut scratch = Scratch::default();
    let prompt: Vec<Row> = [11u32, 22, 33, 44]
        .iter()
        .enumerate()
        .map(|(pos, &token)| Row { token, pos, seq: 0, logits: pos == 3 })
        .collect();
    let mut logits = model.forward(&prompt, &mut [&mut seq], &mut scratch).unwrap();
    for (pos, token) in [(4, 55u32), (5, 66)] {
        logits = model.forward(&[Row { token, pos, seq: 0, logits: true }], &mut [&mut seq], &mut scratch).unwrap();
    }
    logits.remove(0)
}
