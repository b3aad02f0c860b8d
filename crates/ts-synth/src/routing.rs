//! How synthetic routers pick experts (docs/SYNTH.md). Every token embedding is a common
//! vector c plus its own random part; the router row of expert e is
//! `r_e = μ_e·c/(|c|²·a) + g_e/b`, with `μ_e = −θ·ln(rank_e)` (rank a random permutation
//! per layer), `a` and `b` the shares of c and of the random part in a normalized hidden
//! state, and `g_e` random and orthogonal to c. A hidden state `f ≈ a·ĉ + b·z` then gets
//! the logits `μ_e + N(0, 1)`: a static Zipf-like preference plus per-token variety.

use crate::SynthError;
use crate::rng::Rng;

/// Router statistics to imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Routing {
    /// A few experts are chosen often, as in trained models.
    #[default]
    Skewed,
    /// Every expert equally likely.
    Uniform,
}

impl Routing {
    pub const NAMES: [&str; 2] = ["skewed", "uniform"];

    pub fn parse(name: &str) -> Result<Routing, SynthError> {
        match name {
            "skewed" => Ok(Routing::Skewed),
            "uniform" => Ok(Routing::Uniform),
            _ => Err(SynthError::UnknownRouting { name: name.into(), choices: Routing::NAMES.join(", ") }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Routing::Skewed => "skewed",
            Routing::Uniform => "uniform",
        }
    }
}

/// Root mean square of a token embedding. Large beside what one layer adds to the residual
/// stream (about 1), so the common part of the embedding still steers the router in the
/// last layer.
pub const EMBEDDING_RMS: f64 = 16.0;
/// Fraction of an embedding's norm along the common vector (skewed routing).
pub const COMMON_SHARE: f64 = 0.6;

/// The common vector's level on each group of 32 embedding elements (±1 at random, times
/// its share of [`EMBEDDING_RMS`]), and the spread of the random part.
pub fn embedding_levels(n_embd: usize, routing: Routing, seed: u64) -> (Vec<f64>, f64) {
    let share = match routing {
        Routing::Skewed => COMMON_SHARE,
        Routing::Uniform => 0.0,
    };
    let mut rng = Rng::new(seed);
    let level =
        (0..n_embd / 32).map(|_| if rng.next_u64() & 1 == 0 { share } else { -share } * EMBEDDING_RMS).collect();
    (level, (1.0 - share * share).sqrt() * EMBEDDING_RMS)
}

/// Router rows `[n_expert][n_embd]` for one layer, given the embeddings' common vector
/// `mean` and the spread `std` of their random part.
pub fn router_rows(routing: Routing, mean: &[f32], std: f64, n_expert: usize, skew: f64, seed: u64) -> Vec<f32> {
    let n = mean.len();
    let mut rng = Rng::new(seed);
    let mut rows = vec![0f32; n_expert * n];
    let random_row = |rng: &mut Rng, row: &mut [f32]| {
        let s = 1.0 / (n as f64).sqrt();
        row.iter_mut().for_each(|x| *x = (rng.normal() * s) as f32);
    };
    if routing == Routing::Uniform {
        rows.chunks_exact_mut(n).for_each(|row| random_row(&mut rng, row));
        return rows;
    }
    // ĉ: the common vector scaled to unit root mean square (|ĉ|² = n).
    let rms_c = (mean.iter().map(|&m| (m as f64).powi(2)).sum::<f64>() / n as f64).sqrt();
    let unit: Vec<f64> = mean.iter().map(|&m| m as f64 / rms_c).collect();
    let norm = (rms_c * rms_c + std * std).sqrt();
    let (a, b) = (rms_c / norm, std / norm);

    let mut rank: Vec<usize> = (1..=n_expert).collect();
    for i in (1..n_expert).rev() {
        rank.swap(i, rng.below(i + 1));
    }
    let mu: Vec<f64> = rank.iter().map(|&r| -skew * (r as f64).ln()).collect();
    let mu_mean = mu.iter().sum::<f64>() / n_expert as f64;

    for (e, row) in rows.chunks_exact_mut(n).enumerate() {
        random_row(&mut rng, row);
        let along = row.iter().zip(&unit).map(|(&g, &u)| g as f64 * u).sum::<f64>() / n as f64;
        let static_part = (mu[e] - mu_mean) / (n as f64 * a);
        for (x, &u) in row.iter_mut().zip(&unit) {
            *x = (((*x as f64) - along * u) / b + static_part * u) as f32;
        }
    }
    rows
}
