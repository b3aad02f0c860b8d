//! Experts held in memory and repacked for the CPU's kernels (`Model::pack_experts`): the
//! fixtures whose experts pack (MXFP4, Q4_K) against their transformers goldens, within
//! the default mode's bound (tests/fixtures.rs), and against the same model with its experts
//! in the GGUF layout, prompt and decode; streamed experts, repacked as their slots fill,
//! give the resident packed model's logits.

use ts_model::{ExpertPlacement, Model, Row, Scratch, SeqState, StreamOptions};

/// Logits of every golden position, `chunk` rows per step.
fn run(model: &Model, tokens: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let mut seq = SeqState::new(&model.cfg, tokens.len(), chunk);
    let mut scratch = Scratch::default();
    let mut out = Vec::new();
    for (c, toks) in tokens.chunks(chunk).enumerate() {
        let rows: Vec<Row> =
            toks.iter().enumerate().map(|(i, &t)| Row { token: t, pos: c * chunk + i, seq: 0, logits: true }).collect();
        out.extend(model.forward(&rows, &mut [&mut seq], &mut scratch).unwrap());
    }
    out
}

#[test]
fn packed_experts_match_transformers_and_the_gguf_layout() {
    use ts_gguf::GgmlType;
    assert!(
        ts_cpu::packs(GgmlType::MXFP4, 16),
        "experts are packed with AVX2 or AVX-512 VNNI: this machine has neither"
    );
    let mut packed_fixtures = 0;
    let mut streamed_packed = 0;
    for f in ts_testkit::fixtures() {
        let mut packed = Model::open(&f.model, ExpertPlacement::Resident).unwrap();
        let matrices = packed.pack_experts();
        if matrices == 0 {
            continue;
        }
        // A second call finds them packed and leaves them be.
        assert_eq!(packed.pack_experts(), matrices, "{}/{}", f.family, f.variant);
        let plain = Model::open(&f.model, ExpertPlacement::Resident).unwrap();
        let name = format!("{}/{}", f.family, f.variant);
        for chunk in [16, 1] {
            let (got, want) = (run(&packed, &f.golden.tokens, chunk), run(&plain, &f.golden.tokens, chunk));
            let c = f.golden.compare(&got);
            println!("{name} packed ({matrices} matrices), chunk {chunk}: {c}, median {:.3e}", c.median_rel_err());
            assert!(c.median_rel_err() <= 6e-2, "{name} chunk {chunk}: {c}");
            // Against the GGUF layout: the batch kernels give the same floats; the one-row
            // kernels sum in another order (Q4_K's in floats per sub-block), a few 1e-3 of the
            // largest logit after the layers compound it.
            let mut worst = 0f32;
            for (p, (g, w)) in got.iter().zip(&want).enumerate() {
                let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
                let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                worst = worst.max(diff / scale);
                assert!(diff <= 1e-2 * scale, "{name} chunk {chunk} row {p}: max |Δ| {diff} of {scale}");
            }
            println!("{name} chunk {chunk}: packed vs GGUF layout, worst row {worst:.2e} of its largest logit");
            // Streamed through a cache of a token's experts and one more: most asks miss, and
            // each matrix read is repacked by its reader where one row gains from it (MXFP4).
            let moe = plain.cfg.moe.clone().unwrap();
            let roomy = StreamOptions { cache_bytes: 1 << 30, ..StreamOptions::default() };
            let probe = Model::open(&f.model, ExpertPlacement::Stream(roomy.clone())).unwrap();
            let slot = probe.experts.resident_bytes() / probe.experts.capacity() as u64;
            let opts = StreamOptions { cache_bytes: slot * (moe.n_expert_used as u64 + 1), ..roomy };
            for prefetch in [false, true] {
                let mut streamed = Model::open(&f.model, ExpertPlacement::Stream(opts.clone())).unwrap();
                streamed.prefetch_experts = prefetch;
                let n = streamed.pack_experts();
                let got_streamed = run(&streamed, &f.golden.tokens, chunk);
                if n == matrices {
                    assert!(got_streamed == got, "{name} chunk {chunk} prefetch {prefetch}: streamed packed");
                    streamed_packed += 1;
                } else {
                    // Some types stay in the GGUF layout when streamed: within the bound above.
                    assert!(n < matrices, "{name}: streamed packs {n} of {matrices}");
                    for (g, w) in got_streamed.iter().zip(&want) {
                        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
                        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                        assert!(diff <= 1e-2 * scale, "{name} chunk {chunk} streamed ({n} packed)");
                    }
                }
                let stats = streamed.experts.stats().unwrap().total();
                assert!(stats.misses > stats.hits / 4, "{name}: the cache should miss often: {stats:?}");
            }
        }
        packed_fixtures += 1;
    }
    if ts_cpu::packed_row_is_faster(GgmlType::MXFP4) {
        assert!(streamed_packed >= 4, "the MXFP4 fixture streamed and repacked on fill, chunks 16 and 1");
    }
    assert!(
        packed_fixtures >= 2,
        "fixtures with experts the CPU packs (gpt_oss mxfp4, the q4_k_m MoE files) are missing"
    );
}
