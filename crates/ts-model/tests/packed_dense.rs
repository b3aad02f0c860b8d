//! Dense matrices repacked for the CPU's one-row kernels (`Model::pack_dense`: Q4_0, Q4_1, Q5_0,
//! Q8_0 and MXFP4 on AVX-512 VNNI, and the layers' Q4_K and Q6_K ones, which the `q4_k_m`
//! fixtures have; no fixture has Q4_0 or Q4_1 matrices, SmolLM2's Q4_1 ones go through the real
//! models' greedy test): the fixtures with such matrices against their transformers goldens,
//! within the default mode's bound (`Fixture::default_mode_bound`), and against the same model in the GGUF
//! layout, prompt and decode. A packed model refuses another backend and exact activations.

use ts_model::{ExpertPlacement, Model, Row, Scratch, SeqState};

/// Logits of every golden position, `chunk` rows per step.
fn run(model: &Model, tokens: &[u32], chunk: usize, scratch: &mut Scratch) -> Result<Vec<Vec<f32>>, String> {
    let mut seq = SeqState::new(&model.cfg, tokens.len(), chunk);
    let mut out = Vec::new();
    for (c, toks) in tokens.chunks(chunk).enumerate() {
        let rows: Vec<Row> =
            toks.iter().enumerate().map(|(i, &t)| Row { token: t, pos: c * chunk + i, seq: 0, logits: true }).collect();
        out.extend(model.forward(&rows, &mut [&mut seq], scratch).map_err(|e| e.to_string())?);
    }
    Ok(out)
}

#[test]
fn packed_dense_matrices_match_transformers_and_the_gguf_layout() {
    use ts_gguf::GgmlType;
    // tools/test.sh skips this test by name, and says so, on a CPU without AVX2.
    assert!(
        ts_cpu::packed_row_is_faster(GgmlType::Q8_0),
        "dense matrices are packed on AVX2 and AVX-512 VNNI, which this machine lacks"
    );
    let (mut packed_fixtures, mut tied_packed) = (0, 0);
    for f in ts_testkit::fixtures() {
        let mut packed = Model::open(&f.model, ExpertPlacement::Resident).unwrap();
        // No memory to copy into: every matrix stays mapped, and says so.
        let (none, left) = packed.pack_dense(0).unwrap();
        assert_eq!(none, 0);
        let (matrices, _) = packed.pack_dense(u64::MAX).unwrap();
        assert_eq!(left, matrices, "{}/{}: every packable matrix counted as left", f.family, f.variant);
        if matrices == 0 {
            continue;
        }
        let name = format!("{}/{}", f.family, f.variant);
        // A tied head's embedding lookups read the packed copy (`ts_cpu::packed_row`): the
        // prompt's floats below, equal to the GGUF layout's, check them.
        tied_packed += usize::from(packed.weights.token_embd.is_packed());
        // A second call finds them packed and leaves them be.
        assert_eq!(packed.pack_dense(u64::MAX).unwrap(), (0, 0), "{name}");
        let plain = Model::open(&f.model, ExpertPlacement::Resident).unwrap();
        // How far the GGUF layout's own one-row kernels are from its batch kernels: the scale
        // of a change of summation order after the layers compound it.
        let (one, batch) = (
            run(&plain, &f.golden.tokens, 1, &mut Scratch::default()).unwrap(),
            run(&plain, &f.golden.tokens, 16, &mut Scratch::default()).unwrap(),
        );
        let order = ts_testkit::worst_row_rel_diff(&one, &batch);
        println!("{name}: GGUF layout, one-row vs batch kernels, worst row {order:.2e} of its largest logit");
        for chunk in [16, 1] {
            let got = run(&packed, &f.golden.tokens, chunk, &mut Scratch::default()).unwrap();
            let want = run(&plain, &f.golden.tokens, chunk, &mut Scratch::default()).unwrap();
            let c = f.golden.compare(&got);
            println!(
                "{name} packed ({matrices} dense matrices), chunk {chunk}: {c}, median {:.3e}",
                c.median_rel_err()
            );
            assert!(c.median_rel_err() <= f.default_mode_bound(), "{name} chunk {chunk}: {c}");
            // Against the GGUF layout: batches give the same floats; the one-row kernels sum
            // in another order (each product within 3e-7 of the GGUF one-row kernel's), which
            // the layers compound: within twice what the GGUF layout's own two kernels differ
            // by, or 1e-2 of the largest logit where a near tie of a MoE router flips (gpt_oss).
            let worst = ts_testkit::worst_row_rel_diff(&got, &want);
            println!("{name} chunk {chunk}: packed vs GGUF layout, worst row {worst:.2e} of its largest logit");
            match chunk {
                1 => assert!(worst <= (2.0 * order).max(1e-2), "{name}: {worst} against {order}"),
                _ => assert!(got == want, "{name} chunk {chunk}: the batch kernels' floats differ"),
            }
        }
        // Exact activations cannot read packed bytes: a clear error, not garbage.
        let mut exact = Scratch::exact();
        let err = run(&packed, &f.golden.tokens[..2], 1, &mut exact).unwrap_err();
        assert!(err.contains("packed"), "{name}: {err}");
        // Nor can another backend: the model says so by name.
        let err = packed.into_backend(|_| Ok(ts_model::Cpu)).err().expect("a packed model stays on the CPU");
        assert!(err.to_string().contains("packed for the CPU"), "{name}: {err}");
        packed_fixtures += 1;
    }
    assert!(packed_fixtures >= 1, "no fixture has Q5_0, Q8_0 or MXFP4 dense matrices");
    println!("{packed_fixtures} fixtures packed, {tied_packed} with a tied head");
    assert!(tied_packed >= 1, "no fixture's packed head is its embedding table");
}
