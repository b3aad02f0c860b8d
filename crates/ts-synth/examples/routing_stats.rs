//! Measures a synthetic model's routing with the engine's forward pass: writes the file
//! (or takes an existing one), runs random tokens one at a time, and prints per-layer
//! statistics. `cargo run --release -p ts-synth --example routing_stats -- NAME LAYERS TOKENS [uniform] [FILE]`

#[path = "../tests/common/mod.rs"]
mod common;

use ts_synth::{Routing, RoutingStats, SynthOptions};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map(String::as_str).unwrap_or("qwen3-30b-a3b");
    let layers: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4);
    let n_tokens: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(256);
    let routing = Routing::parse(args.get(3).map(String::as_str).unwrap_or("skewed")).unwrap();
    let spec = ts_synth::spec(name).unwrap();
    let opts = SynthOptions { layers: Some(layers), routing, ..Default::default() };
    let (existing, _temp);
    let path = match args.get(4) {
        Some(p) => {
            existing = std::path::PathBuf::from(p);
            existing.as_path()
        }
        None => {
            let (_, file) = common::synth(name, &opts, routing.name());
            _temp = file;
            _temp.0.as_path()
        }
    };
    let tokens = common::random_tokens(n_tokens, spec.n_vocab, 1);
    let (per_layer, logits) = common::route_tokens(path, &tokens);
    let stats = common::layer_stats(&per_layer, spec.n_expert);
    println!(
        "{name}, {} layers, {n_tokens} random tokens, {} routing, LRU cache of {} experts",
        per_layer.len(),
        routing.name(),
        common::cache_size(spec.n_expert, spec.n_expert_used)
    );
    println!("layer  top10%-selections  overlap  lru-hits  top10%-of-hits");
    for (l, s) in stats.iter().enumerate() {
        println!("{l:5}  {:17.3}  {:7.3}  {:8.3}  {:14.3}", s.top_share, s.overlap, s.hit_rate, s.hit_top_share);
    }
    let m = RoutingStats::mean(&stats);
    println!(" mean  {:17.3}  {:7.3}  {:8.3}  {:14.3}", m.top_share, m.overlap, m.hit_rate, m.hit_top_share);
    let n = logits.len() as f64;
    let mean = logits.iter().map(|&x| x as f64).sum::<f64>() / n;
    let sd = (logits.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    println!(
        "last logits: {} values, all finite: {}, mean {mean:.3}, sd {sd:.3}",
        logits.len(),
        logits.iter().all(|x| x.is_finite())
    );
}
