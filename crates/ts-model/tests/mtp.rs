//! The MTP ("nextn") head of the qwen3_5_moe fixture (GGUF block 8) against the float64
//! numpy reference tools/fixtures/mtp_ref.py, written from docs/MTP.md §3 and
//! transformers' Qwen3.5-MoE modules (tests/fixtures/qwen3_5_moe/mtp-<variant>.bin).
//!
//! With exact activations (f32 throughout; the reference ran on the same dequantized
//! weights) both sides compute the same math, so every bound is f32 rounding, as max |Δ| /
//! max |ref| per row: the trunk's final-normed hidden states (what the head reads) within
//! 1e-4; the head's logits and its normed output within 1e-4, for eleven rows run in one
//! step and for three guesses chained one row at a time from the head's own output (whose
//! greedy tokens must be the reference's). A file that declares a nextn layer but lacks a
//! tensor of it fails to open, naming the tensor.

use ts_model::{ExpertPlacement, Model, Row, Scratch, SeqState};

const BOUND: f32 = 1e-4;

struct Reference {
    rows: usize,
    chain: Vec<u32>,
    tokens: Vec<u32>,
    n_embd: usize,
    n_vocab: usize,
    trunk_hidden: Vec<f32>,
    head_hidden: Vec<f32>,
    logits: Vec<f32>,
}

fn read_reference(path: &std::path::Path) -> Reference {
    let b =
        std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e} (tools/fixtures/mtp_ref.py makes it)", path.display()));
    assert_eq!(&b[..8], b"TSMTP1\0\0", "{}", path.display());
    let mut at = 8;
    let mut u32s = |n: usize| -> Vec<u32> {
        let v = b[at..at + 4 * n].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        at += 4 * n;
        v
    };
    let h = u32s(4);
    let (rows, n_chain, n_embd, n_vocab) = (h[0] as usize, h[1] as usize, h[2] as usize, h[3] as usize);
    let tokens = u32s(rows + 1);
    let chain = u32s(n_chain);
    let floats: Vec<f32> = b[at..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let all = rows + n_chain;
    assert_eq!(floats.len(), rows * n_embd + all * n_embd + all * n_vocab, "{}", path.display());
    let (trunk_hidden, rest) = floats.split_at(rows * n_embd);
    let (head_hidden, logits) = rest.split_at(all * n_embd);
    Reference {
        rows,
        chain,
        tokens,
        n_embd,
        n_vocab,
        trunk_hidden: trunk_hidden.to_vec(),
        head_hidden: head_hidden.to_vec(),
        logits: logits.to_vec(),
    }
}

/// max |got - want| / max |want| of one row.
fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let d = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    d / want.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold(0, |b, (i, &x)| if x > v[b] { i } else { b }) as u32
}

#[test]
fn mtp_head_matches_the_numpy_reference() {
    let dir = ts_testkit::fixtures_dir().join("qwen3_5_moe");
    for variant in ["f32", "q8_0"] {
        let r = read_reference(&dir.join(format!("mtp-{variant}.bin")));
        let model = Model::open(dir.join(format!("model-{variant}.gguf")), ExpertPlacement::Mapped).unwrap();
        assert_eq!((model.cfg.n_embd, model.cfg.n_vocab, model.cfg.n_nextn), (r.n_embd, r.n_vocab, 1));
        let e = r.n_embd;
        let mut scratch = Scratch::exact();

        // The trunk hands back its final-normed hidden states h_0..h_{rows-1}.
        let mut seq = SeqState::new(&model.cfg, 64, 64);
        let rows: Vec<Row> =
            (0..r.rows + 1).map(|p| Row { token: r.tokens[p], pos: p, seq: 0, logits: p == r.rows }).collect();
        let (logits, hidden) = model.forward_hidden(&rows, &mut [&mut seq], &mut scratch).unwrap();
        assert_eq!((logits.len(), hidden.len()), (1, (r.rows + 1) * e));
        let mut worst = 0f32;
        for p in 0..r.rows {
            worst = worst.max(rel(&hidden[p * e..(p + 1) * e], &r.trunk_hidden[p * e..(p + 1) * e]));
        }
        println!("{variant}: trunk hidden states, max row rel {worst:.2e}");
        assert!(worst <= BOUND, "{variant}: trunk hidden states off by {worst:.2e}");
        // The same step without hidden states gives the same logits.
        let mut again = SeqState::new(&model.cfg, 64, 64);
        assert_eq!(model.forward(&rows, &mut [&mut again], &mut scratch).unwrap(), logits);

        // The head over the reference's hidden states: rows (x_{p+1}, h_p) at positions p, one step.
        let mut mtp = model.new_mtp_sequence(64).unwrap();
        let rows: Vec<Row> =
            (0..r.rows).map(|p| Row { token: r.tokens[p + 1], pos: p, seq: 0, logits: true }).collect();
        let out = model.mtp_forward(&rows, &r.trunk_hidden, &mut [&mut mtp], &mut scratch).unwrap();
        let (mut worst_logits, mut worst_hidden) = (0f32, 0f32);
        for p in 0..r.rows {
            worst_logits = worst_logits.max(rel(&out.logits[p], &r.logits[p * r.n_vocab..(p + 1) * r.n_vocab]));
            worst_hidden = worst_hidden.max(rel(&out.hidden[p * e..(p + 1) * e], &r.head_hidden[p * e..(p + 1) * e]));
        }
        // Chained guesses, one row at a time: the argmax token and the head's own output.
        let mut last_logits = out.logits[r.rows - 1].clone();
        let mut last_hidden = out.hidden[(r.rows - 1) * e..].to_vec();
        for (j, &want) in r.chain.iter().enumerate() {
            let token = argmax(&last_logits);
            assert_eq!(token, want, "{variant}: chained guess {j}");
            let row = Row { token, pos: r.rows + j, seq: 0, logits: true };
            let out = model.mtp_forward(&[row], &last_hidden, &mut [&mut mtp], &mut scratch).unwrap();
            let i = r.rows + j;
            worst_logits = worst_logits.max(rel(&out.logits[0], &r.logits[i * r.n_vocab..(i + 1) * r.n_vocab]));
            worst_hidden = worst_hidden.max(rel(&out.hidden, &r.head_hidden[i * e..(i + 1) * e]));
            (last_logits, last_hidden) = (out.logits[0].clone(), out.hidden);
        }
        println!(
            "{variant}: MTP head, {} rows + {} chained: logits max row rel {worst_logits:.2e}, output {worst_hidden:.2e}",
            r.rows,
            r.chain.len()
        );
        assert!(worst_logits <= BOUND, "{variant}: MTP logits off by {worst_logits:.2e}");
        assert!(worst_hidden <= BOUND, "{variant}: MTP output off by {worst_hidden:.2e}");
    }
}

#[test]
fn a_nextn_layer_missing_a_tensor_is_refused_by_name() {
    let src = ts_testkit::fixtures_dir().join("qwen3_5_moe/model-f32.gguf");
    let dir = std::env::temp_dir().join(format!("ts-mtp-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dst = dir.join("no-hnorm.gguf");
    // Rename the tensor in place (same length), so the file stays valid but lacks it.
    let mut bytes = std::fs::read(&src).unwrap();
    let (from, to) = (b"blk.8.nextn.hnorm.weight".as_slice(), b"blk.8.nextn.hnorX.weight".as_slice());
    let at = bytes.windows(from.len()).position(|w| w == from).expect("the fixture names its nextn hnorm");
    bytes[at..at + to.len()].copy_from_slice(to);
    std::fs::write(&dst, &bytes).unwrap();
    let err = Model::open(&dst, ExpertPlacement::Mapped).err().expect("refused");
    assert!(err.to_string().contains("blk.8.nextn.hnorm.weight"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
