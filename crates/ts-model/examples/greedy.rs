//! Greedy continuation of a prompt, for quick checks: `greedy MODEL PROMPT N`.
use ts_model::{ExpertPlacement, Model, Row, Scratch, SeqState};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let model = Model::open(&a[1], ExpertPlacement::Mapped).unwrap();
    let tok = ts_tokenizer::Tokenizer::from_gguf(&a[1]).unwrap();
    let n: usize = a[3].parse().unwrap();
    let ids = tok.encode(&a[2], true, true).unwrap();
    let mut seq = SeqState::new(&model.cfg, 512, 512);
    let mut scratch = Scratch::default();
    let t0 = std::time::Instant::now();
    let rows: Vec<Row> =
        ids.iter().enumerate().map(|(i, &t)| Row { token: t, pos: i, seq: 0, logits: i + 1 == ids.len() }).collect();
    let mut logits = model.forward(&rows, &mut [&mut seq], &mut scratch).unwrap().pop().unwrap();
    let t1 = std::time::Instant::now();
    let mut out = Vec::new();
    for i in 0..n {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        if std::env::var_os("TOP2").is_some() {
            eprintln!("step {i}: {} {:.4} | {} {:.4}", idx[0], logits[idx[0]], idx[1], logits[idx[1]]);
        }
        let next = idx[0] as u32;
        out.push(next);
        if tok.is_eog(next) {
            break;
        }
        let r = Row { token: next, pos: ids.len() + i, seq: 0, logits: true };
        logits = model.forward(&[r], &mut [&mut seq], &mut scratch).unwrap().pop().unwrap();
    }
    let t2 = std::time::Instant::now();
    println!("{}", tok.decode(&out).unwrap());
    eprintln!(
        "prompt {} tok in {:?}, gen {} tok in {:?} ({:.1} tok/s); ids {:?}",
        ids.len(),
        t1 - t0,
        out.len(),
        t2 - t1,
        out.len() as f64 / (t2 - t1).as_secs_f64(),
        out
    );
}
