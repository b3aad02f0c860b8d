//! Golden logits written by `tools/fixtures` (transformers, float32, eager attention).
//!
//! File format, little-endian: magic `TSGOLD1\0`; u32 n_tokens; u32 n_vocab;
//! n_tokens u32 token ids; n_tokens u32 argmax per row; n_tokens x n_vocab f32
//! logits, one row per position.

use std::path::Path;

const MAGIC: &[u8; 8] = b"TSGOLD1\0";

/// Reference logits at every position of a token sequence.
#[derive(Clone, Debug)]
pub struct Golden {
    pub tokens: Vec<u32>,
    pub argmax: Vec<u32>,
    pub n_vocab: usize,
    /// `[n_tokens][n_vocab]`, row-major.
    pub logits: Vec<f32>,
}

/// How a computed set of rows compares with a golden.
#[derive(Clone, Debug)]
pub struct Comparison {
    /// Per row: max |computed - ref| / max |ref|.
    pub row_rel_err: Vec<f32>,
    /// Per row: whether its argmax equals the golden's.
    pub row_argmax_agrees: Vec<bool>,
    /// Rows whose argmax equals the golden's.
    pub argmax_agree: usize,
    pub rows: usize,
}

impl Comparison {
    pub fn max_rel_err(&self) -> f32 {
        self.row_rel_err.iter().copied().fold(0.0, f32::max)
    }

    pub fn argmax_agreement(&self) -> f64 {
        self.argmax_agree as f64 / self.rows.max(1) as f64
    }

    /// The median over rows of max |Δ| / max |ref|.
    pub fn median_rel_err(&self) -> f32 {
        let mut v = self.row_rel_err.clone();
        v.sort_by(f32::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    }
}

impl std::fmt::Display for Comparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "max |Δ|/max|ref| {:.3e}, argmax {}/{} ({:.1}%)",
            self.max_rel_err(),
            self.argmax_agree,
            self.rows,
            100.0 * self.argmax_agreement()
        )
    }
}

/// Index of the largest value; `u32::MAX` (matching no golden) if any value is not finite.
fn argmax(row: &[f32]) -> u32 {
    if row.iter().any(|v| !v.is_finite()) {
        return u32::MAX;
    }
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

impl Golden {
    pub fn read(path: &Path) -> Result<Golden, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(bytes: &[u8]) -> Result<Golden, String> {
        if bytes.len() < 16 || &bytes[..8] != MAGIC {
            return Err("not a golden-logits file (magic TSGOLD1)".into());
        }
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap());
        let (n_tokens, n_vocab) = (u32_at(8) as usize, u32_at(12) as usize);
        let expected =
            n_tokens.checked_mul(n_vocab).and_then(|n| n.checked_mul(4)).and_then(|n| n.checked_add(16 + 8 * n_tokens));
        if expected != Some(bytes.len()) {
            return Err(format!("{} bytes, but {n_tokens} tokens x {n_vocab} vocab need {expected:?}", bytes.len()));
        }
        let words = |start: usize, n: usize| (0..n).map(|i| u32_at(start + 4 * i)).collect::<Vec<u32>>();
        let tokens = words(16, n_tokens);
        let argmax = words(16 + 4 * n_tokens, n_tokens);
        let logits =
            bytes[16 + 8 * n_tokens..].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        Ok(Golden { tokens, argmax, n_vocab, logits })
    }

    pub fn row(&self, position: usize) -> &[f32] {
        &self.logits[position * self.n_vocab..(position + 1) * self.n_vocab]
    }

    /// Compares computed rows (one per position, from the first) with the golden.
    pub fn compare(&self, rows: &[Vec<f32>]) -> Comparison {
        assert!(rows.len() <= self.tokens.len(), "more rows than golden positions");
        let mut row_rel_err = Vec::with_capacity(rows.len());
        let mut row_argmax_agrees = Vec::with_capacity(rows.len());
        for (p, row) in rows.iter().enumerate() {
            let reference = self.row(p);
            assert_eq!(row.len(), reference.len(), "row {p}: vocab size differs");
            let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
            let diff = row.iter().zip(reference).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            row_rel_err.push(if diff.is_nan() || row.iter().any(|v| !v.is_finite()) {
                f32::INFINITY
            } else {
                diff / scale
            });
            row_argmax_agrees.push(argmax(row) == self.argmax[p]);
        }
        let argmax_agree = row_argmax_agrees.iter().filter(|&&a| a).count();
        Comparison { row_rel_err, row_argmax_agrees, argmax_agree, rows: rows.len() }
    }

    /// Gap between the largest and second-largest logit of a row, relative to its max |logit|.
    pub fn top2_rel_gap(&self, position: usize) -> f32 {
        let row = self.row(position);
        let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for &v in row {
            if v > a {
                b = a;
                a = v;
            } else if v > b {
                b = v;
            }
        }
        let scale = row.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
        (a - b) / scale
    }

    /// Argmax agreement of `c` over the rows whose relative top-2 gap exceeds
    /// `min_gap` (closer rows are ties within the arithmetic's error).
    pub fn argmax_agreement_where_gap_exceeds(&self, c: &Comparison, min_gap: f32) -> f64 {
        let decisive: Vec<bool> =
            (0..c.rows).filter(|&p| self.top2_rel_gap(p) > min_gap).map(|p| c.row_argmax_agrees[p]).collect();
        if decisive.is_empty() {
            return 1.0;
        }
        decisive.iter().filter(|&&a| a).count() as f64 / decisive.len() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(tokens: &[u32], argmax: &[u32], logits: &[f32], vocab: u32) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend((tokens.len() as u32).to_le_bytes());
        b.extend(vocab.to_le_bytes());
        tokens.iter().chain(argmax).for_each(|t| b.extend(t.to_le_bytes()));
        logits.iter().for_each(|l| b.extend(l.to_le_bytes()));
        b
    }

    #[test]
    fn parses_and_compares() {
        let g = Golden::parse(&file(&[5, 6], &[1, 0], &[0.0, 2.0, 4.0, -1.0], 2)).unwrap();
        assert_eq!(g.row(1), &[4.0, -1.0]);
        let c = g.compare(&[vec![0.0, 2.0], vec![4.4, -1.0]]);
        assert_eq!(c.argmax_agree, 2);
        assert!((c.row_rel_err[1] - 0.1).abs() < 1e-6);
        let c = g.compare(&[vec![3.0, 2.0], vec![f32::NAN, 0.0]]);
        assert_eq!(c.argmax_agree, 0);
        assert_eq!(c.max_rel_err(), f32::INFINITY);
    }

    #[test]
    fn refuses_bad_files() {
        assert!(Golden::parse(b"nope").is_err());
        let mut f = file(&[1], &[0], &[1.0, 2.0], 2);
        f.pop();
        assert!(Golden::parse(&f).is_err());
    }
}
