//! Routed experts streamed from disk through a cache of a few slots (every
//! step evicts; a prompt chunk's experts come in groups the cache holds; the
//! next layer's experts guessed and read early, or not) give the same logits,
//! bit for bit, as experts read through the map: on every MoE fixture, the
//! hybrid families included. (The GPU's VRAM cache has the same test in
//! ts-cuda's gpu.rs.)

use ts_model::{ExpertPlacement, Model, Row, Scratch, SeqState, StreamOptions};

/// Logits of the fixture's first 48 tokens: two prompt chunks of 16, then one at a time.
fn logits(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut seq = SeqState::new(&model.cfg, 64, 16);
    let mut scratch = Scratch::default();
    let mut out = Vec::new();
    let pieces: Vec<std::ops::Range<usize>> =
        vec![0..16, 16..32].into_iter().chain((32..48).map(|i| i..i + 1)).collect();
    for r in pieces {
        let rows: Vec<Row> = r.map(|pos| Row { token: tokens[pos], pos, seq: 0, logits: true }).collect();
        out.extend(model.forward(&rows, &mut [&mut seq], &mut scratch).unwrap());
    }
    out
}

#[test]
fn streamed_experts_give_the_mapped_logits() {
    let mut checked = Vec::new();
    for f in ts_testkit::fixtures() {
        let mapped = Model::open(&f.model, ExpertPlacement::Mapped).unwrap();
        let Some(moe) = mapped.cfg.moe.clone() else { continue };
        let want = logits(&mapped, &f.golden.tokens);
        // The size of one slot, from a store with room for every expert.
        let roomy = StreamOptions { cache_bytes: 1 << 30, ..StreamOptions::default() };
        let probe = Model::open(&f.model, ExpertPlacement::Stream(roomy.clone())).unwrap();
        let slot = probe.experts.resident_bytes() / probe.experts.capacity() as u64;
        // One slot more than a token needs: a 16-row chunk uses more experts than that.
        let opts = StreamOptions { cache_bytes: slot * (moe.n_expert_used as u64 + 1), ..roomy };
        for prefetch in [false, true] {
            let mut model = Model::open(&f.model, ExpertPlacement::Stream(opts.clone())).unwrap();
            model.prefetch_experts = prefetch;
            let got = logits(&model, &f.golden.tokens);
            let name = format!("{}/{} prefetch {prefetch}", f.family, f.variant);
            assert!(got == want, "{name}: streamed logits differ from mapped ones");
            let stats = model.experts.stats().unwrap().total();
            assert!(stats.misses > stats.hits / 4, "{name}: the cache should miss often: {stats:?}");
            checked.push(name);
        }
    }
    println!("{} runs identical: {}", checked.len(), checked.join(", "));
    for family in ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "qwen3_5_moe", "qwen3_next", "gemma4_moe"] {
        assert!(checked.iter().any(|c| c.starts_with(family)), "no {family} fixture checked");
    }
}
