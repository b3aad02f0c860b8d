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
        // How far the GGUF layout's own one-row kernels are from its batch kernels: the scale
        // of a change of summation order after the layers compound it.
        let order =
            ts_testkit::worst_row_rel_diff(&run(&plain, &f.golden.tokens, 1), &run(&plain, &f.golden.tokens, 16));
        for chunk in [16, 1] {
            let (got, want) = (run(&packed, &f.golden.tokens, chunk), run(&plain, &f.golden.tokens, chunk));
            let c = f.golden.compare(&got);
            println!("{name} packed ({matrices} matrices), chunk {chunk}: {c}, median {:.3e}", c.median_rel_err());
            assert!(c.median_rel_err() <= f.default_mode_bound(), "{name} chunk {chunk}: {c}");
            // Against the GGUF layout: the batch kernels give the same floats; the one-row
            // kernels sum in another order (Q4_K's in floats per sub-block), which the layers
            // compound: within twice what the GGUF layout's own two kernels differ by, or 1e-2
            // of the largest logit (a near tie of the router can flip an expert).
            let bound = (2.0 * order).max(1e-2);
            let worst = ts_testkit::worst_row_rel_diff(&got, &want);
            println!("{name} chunk {chunk}: packed vs GGUF layout, worst row {worst:.2e} of its largest logit");
            assert!(worst <= bound, "{name} chunk {chunk}: {worst:.2e} (bound {bound:.2e})");
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
                    let worst = ts_testkit::worst_row_rel_diff(&got_streamed, &want);
                    assert!(worst <= bound, "{name} chunk {chunk} streamed ({n} packed): {worst:.2e}");
                }
                let stats = streamed.experts.stats().unwrap().total();
                assert!(stats.misses > stats.hits / 4, "{name}: the cache should miss often: {stats:?}");
            }
        }
        packed_fixtures += 1;
    }
    if ts_cpu::repacks_as_read(GgmlType::MXFP4) {
        assert!(streamed_packed >= 4, "the MXFP4 fixture streamed and repacked on fill, chunks 16 and 1");
    }
    assert!(
        packed_fixtures >= 2,
        "fixtures with experts the CPU packs (gpt_oss mxfp4, the q4_k_m MoE files) are missing"
    );
}
