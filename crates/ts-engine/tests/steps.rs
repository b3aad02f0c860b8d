//! `Engine::step_read` hands each logits row where the backend leaves it, with its piece's
//! index: the same rows `Engine::step` returns as copies, for pieces that want every row, the
//! last or none, and bad pieces refused the same way.

use ts_engine::decode::{Logits, Piece};
use ts_engine::session::{Engine, EngineError, LoadOptions};
use ts_model::ExpertPlacement;

fn engine(family: &str) -> Engine {
    let path = ts_testkit::fixtures_dir().join(format!("{family}/model-q8_0.gguf"));
    Engine::load(path, &LoadOptions { threads: 2, experts: ExpertPlacement::Mapped }).unwrap()
}

#[test]
fn step_read_hands_the_rows_step_returns() {
    for family in ["llama", "qwen3_moe"] {
        let engine = engine(family);
        let prompts: [&[u32]; 3] = [&[5, 9, 2], &[7, 1], &[3, 3, 8, 4]];
        let pieces = [
            Piece { tokens: prompts[0], logits: Logits::All },
            Piece { tokens: prompts[1], logits: Logits::None },
            Piece { tokens: prompts[2], logits: Logits::Last },
        ];
        let fresh = || (0..3).map(|_| engine.new_sequence(32).unwrap()).collect::<Vec<_>>();

        let mut seqs = fresh();
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        let copied = engine.step(&mut refs, &pieces, &mut engine.scratch()).unwrap();

        let mut seqs = fresh();
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        let mut read = vec![Vec::new(); 3];
        engine.step_read(&mut refs, &pieces, &mut engine.scratch(), &mut |i, row| read[i].push(row.to_vec())).unwrap();

        assert_eq!([copied[0].len(), copied[1].len(), copied[2].len()], [3, 0, 1], "{family}");
        assert_eq!(read, copied, "{family}: the rows read in place are the rows step copies");
        assert!(seqs.iter().zip(prompts).all(|(s, p)| s.n_past == p.len()), "{family}: each sequence moved on");

        // A piece past its sequence's context is refused before anything runs.
        let mut short = engine.new_sequence(2).unwrap();
        let err = engine
            .step_read(&mut [&mut short], &[pieces[0]], &mut engine.scratch(), &mut |_, _| {
                panic!("no row is read from a refused step")
            })
            .unwrap_err();
        assert!(matches!(err, EngineError::PromptTooLong { tokens: 3, n_ctx: 2 }), "{family}: {err}");
        assert_eq!(short.n_past, 0);
    }
}
