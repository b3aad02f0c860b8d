//! The sampler against llama.cpp's semantics on hand-made logits: greedy,
//! top-k/top-p/min-p keep sets, temperature, penalties, seeded draws whose
//! frequencies follow the distribution, and robustness.

use ts_engine::sampler::{Sampler, SamplerConfig, SamplerError, TokenProb};

/// Sampling that draws from the full distribution at temperature 1.
fn plain() -> SamplerConfig {
    SamplerConfig { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, ..SamplerConfig::default() }
}

fn ln_probs(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

/// A reproducible pseudo-random vector in [-scale, scale).
fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn kept(sampler: &mut Sampler, logits: &[f32]) -> Vec<u32> {
    let mut tokens: Vec<u32> = sampler.distribution(logits).unwrap().iter().map(|t| t.token).collect();
    tokens.sort();
    tokens
}

/// Pearson's chi-square statistic of `draws` tokens from `sampler` against `expected` probabilities.
fn chi_square(sampler: &mut Sampler, logits: &[f32], expected: &[f64], draws: usize) -> f64 {
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..draws {
        counts[sampler.sample(logits) as usize] += 1;
    }
    counts
        .iter()
        .zip(expected)
        .map(|(&observed, &p)| {
            let e = p * draws as f64;
            if e == 0.0 {
                assert_eq!(observed, 0, "a token with probability 0 was drawn");
                0.0
            } else {
                (observed as f64 - e).powi(2) / e
            }
        })
        .sum()
}

#[test]
fn defaults_are_llama_cpp_defaults() {
    let cfg = SamplerConfig::default();
    assert_eq!((cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p), (0.8, 40, 0.95, 0.05));
    assert_eq!(
        (cfg.repeat_penalty, cfg.repeat_last_n, cfg.presence_penalty, cfg.frequency_penalty),
        (1.0, 64, 0.0, 0.0)
    );
}

#[test]
fn invalid_settings_are_errors_naming_the_field() {
    let cases: Vec<(&str, SamplerConfig)> = vec![
        ("temperature", SamplerConfig { temperature: -0.1, ..plain() }),
        ("temperature", SamplerConfig { temperature: f32::NAN, ..plain() }),
        ("temperature", SamplerConfig { temperature: f32::INFINITY, ..plain() }),
        ("top_p", SamplerConfig { top_p: 1.5, ..plain() }),
        ("top_p", SamplerConfig { top_p: -0.01, ..plain() }),
        ("top_p", SamplerConfig { top_p: f32::NAN, ..plain() }),
        ("min_p", SamplerConfig { min_p: 1.01, ..plain() }),
        ("min_p", SamplerConfig { min_p: -1.0, ..plain() }),
        ("repeat_penalty", SamplerConfig { repeat_penalty: 0.0, ..plain() }),
        ("repeat_penalty", SamplerConfig { repeat_penalty: -1.1, ..plain() }),
        ("repeat_penalty", SamplerConfig { repeat_penalty: f32::INFINITY, ..plain() }),
        ("repeat_penalty", SamplerConfig { repeat_penalty: 1e-40, ..plain() }),
        ("presence_penalty", SamplerConfig { presence_penalty: f32::NAN, ..plain() }),
        ("frequency_penalty", SamplerConfig { frequency_penalty: f32::NEG_INFINITY, ..plain() }),
        ("logit_bias", SamplerConfig { logit_bias: vec![(1, f32::NAN)], ..plain() }),
        ("logit_bias", SamplerConfig { logit_bias: vec![(1, f32::INFINITY)], ..plain() }),
    ];
    for (field, cfg) in cases {
        match Sampler::new(cfg.clone()) {
            Err(e @ SamplerError::InvalidSetting { field: named, .. }) => {
                assert_eq!(named, field, "{cfg:?}");
                assert!(e.to_string().contains(field), "{e}");
            }
            other => panic!("{cfg:?}: expected an error naming {field}, got {other:?}"),
        }
    }
    for ok in [
        SamplerConfig::default(),
        SamplerConfig::greedy(),
        SamplerConfig { top_p: 0.0, min_p: 1.0, repeat_penalty: 0.5, presence_penalty: -2.0, ..plain() },
    ] {
        assert!(Sampler::new(ok).is_ok());
    }
}

#[test]
fn greedy_is_argmax() {
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    for seed in 0..20 {
        let logits = noise(5000, seed, 10.0);
        assert_eq!(sampler.sample(&logits), argmax(&logits));
    }
    // A vocabulary's worth with NaNs among the logits (read as -inf): the same token as the
    // whole chain's candidates give (`distribution`), and as a plain loop.
    for seed in 0..4 {
        let mut logits = noise(151_936, seed, 12.0);
        for i in (seed as usize..logits.len()).step_by(997) {
            logits[i] = f32::NAN;
        }
        let want = argmax(&logits.iter().map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l }).collect::<Vec<_>>());
        assert_eq!(sampler.sample(&logits), want);
        assert_eq!(sampler.distribution(&logits).unwrap()[0].token, want);
        // The best banned and another raised: the biased copy's argmax, as the chain's.
        let bias = vec![(want, f32::NEG_INFINITY), (7, 30.0)];
        let mut biased = Sampler::new(SamplerConfig { logit_bias: bias, ..SamplerConfig::greedy() }).unwrap();
        let got = biased.sample(&logits);
        assert_eq!(got, biased.distribution(&logits).unwrap()[0].token);
        assert!(got != want && (got == 7 || logits[7].is_nan()), "{got}");
    }
    // Ties go to the lowest id.
    assert_eq!(sampler.sample(&[1.0, 3.0, 3.0, 2.0]), 1);
    assert_eq!(sampler.distribution(&[1.0, 3.0, 0.0]).unwrap(), [TokenProb { token: 1, prob: 1.0 }]);
}

#[test]
fn top_k_one_is_greedy_at_any_temperature() {
    for temperature in [0.5, 1.0, 5.0] {
        let mut sampler =
            Sampler::new(SamplerConfig { temperature, top_k: 1, top_p: 1.0, min_p: 0.0, ..SamplerConfig::default() })
                .unwrap();
        for seed in 0..20 {
            let logits = noise(3000, seed, 4.0);
            assert_eq!(sampler.sample(&logits), argmax(&logits));
        }
    }
}

#[test]
fn same_seed_same_tokens() {
    let steps: Vec<Vec<f32>> = (0..200).map(|i| noise(4096, i, 3.0)).collect();
    let run = |seed: u64| {
        let mut sampler =
            Sampler::new(SamplerConfig { seed, repeat_penalty: 1.1, ..SamplerConfig::default() }).unwrap();
        steps
            .iter()
            .map(|logits| {
                let token = sampler.sample(logits);
                sampler.accept(token);
                token
            })
            .collect::<Vec<u32>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));

    // reset() restarts the sequence and forgets the history.
    let mut sampler = Sampler::new(SamplerConfig { seed: 7, ..plain() }).unwrap();
    let first: Vec<u32> = (0..50).map(|i| sampler.sample(&steps[i])).collect();
    sampler.accept(3);
    sampler.reset();
    let again: Vec<u32> = (0..50).map(|i| sampler.sample(&steps[i])).collect();
    assert_eq!(first, again);
}

// 99.9th percentiles of the chi-square distribution, by degrees of freedom.
const CHI2_999: [f64; 6] = [0.0, 10.83, 13.82, 16.27, 18.47, 20.52];

#[test]
fn draws_follow_the_distribution() {
    let probs = [0.4, 0.3, 0.15, 0.1, 0.05];
    let logits = ln_probs(&probs);
    let mut sampler = Sampler::new(SamplerConfig { seed: 1, ..plain() }).unwrap();
    let stat = chi_square(&mut sampler, &logits, &probs, 50_000);
    assert!(stat < CHI2_999[4], "chi-square {stat}");
}

#[test]
fn temperature_flattens_or_sharpens() {
    let probs: [f64; 4] = [0.6, 0.25, 0.1, 0.05];
    let logits = ln_probs(&probs);
    for (temperature, seed) in [(2.0f32, 2u64), (0.5, 3)] {
        let weights: Vec<f64> = probs.iter().map(|p| p.powf(1.0 / temperature as f64)).collect();
        let total: f64 = weights.iter().sum();
        let expected: Vec<f64> = weights.iter().map(|w| w / total).collect();
        let mut sampler = Sampler::new(SamplerConfig { temperature, seed, ..plain() }).unwrap();
        let dist = sampler.distribution(&logits).unwrap();
        for TokenProb { token, prob } in &dist {
            assert!((*prob as f64 - expected[*token as usize]).abs() < 1e-5, "T={temperature}: {dist:?}");
        }
        let stat = chi_square(&mut sampler, &logits, &expected, 40_000);
        assert!(stat < CHI2_999[3], "T={temperature}: chi-square {stat}");
    }
}

#[test]
fn top_k_renormalizes_over_the_kept_tokens() {
    let probs = [0.1, 0.4, 0.05, 0.3, 0.15];
    let logits = ln_probs(&probs);
    let mut sampler = Sampler::new(SamplerConfig { top_k: 2, seed: 4, ..plain() }).unwrap();
    assert_eq!(kept(&mut sampler, &logits), [1, 3]);
    let expected = [0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7, 0.0];
    let stat = chi_square(&mut sampler, &logits, &expected, 30_000);
    assert!(stat < CHI2_999[1], "chi-square {stat}");
}

#[test]
fn top_p_keeps_the_smallest_prefix_reaching_p() {
    // Sorted probabilities 0.5, 0.25, 0.15, 0.1 (cumulative 0.5, 0.75, 0.9, 1.0), shuffled.
    let logits = ln_probs(&[0.15, 0.5, 0.1, 0.25]);
    let keep = |top_p: f32| {
        let mut sampler = Sampler::new(SamplerConfig { top_p, ..plain() }).unwrap();
        kept(&mut sampler, &logits)
    };
    assert_eq!(keep(0.0), [1]);
    assert_eq!(keep(0.4), [1]);
    assert_eq!(keep(0.6), [1, 3]);
    assert_eq!(keep(0.8), [0, 1, 3]);
    assert_eq!(keep(0.95), [0, 1, 2, 3]);
    assert_eq!(keep(1.0), [0, 1, 2, 3]);

    let mut sampler = Sampler::new(SamplerConfig { top_p: 0.8, ..plain() }).unwrap();
    let dist = sampler.distribution(&logits).unwrap();
    let expected = [(1, 0.5 / 0.9), (3, 0.25 / 0.9), (0, 0.15 / 0.9)];
    for (got, (token, prob)) in dist.iter().zip(expected) {
        assert_eq!(got.token, token);
        assert!((got.prob as f64 - prob).abs() < 1e-6, "{dist:?}");
    }
}

#[test]
fn min_p_keeps_tokens_near_the_best() {
    let logits = ln_probs(&[0.15, 0.5, 0.1, 0.25]);
    let keep = |min_p: f32| {
        let mut sampler = Sampler::new(SamplerConfig { min_p, ..plain() }).unwrap();
        kept(&mut sampler, &logits)
    };
    // Kept: p >= min_p * 0.5.
    assert_eq!(keep(0.0), [0, 1, 2, 3]);
    assert_eq!(keep(0.1), [0, 1, 2, 3]);
    assert_eq!(keep(0.25), [0, 1, 3]);
    assert_eq!(keep(0.4), [1, 3]);
    assert_eq!(keep(0.9), [1]);
    assert_eq!(keep(1.0), [1]);
}

#[test]
fn chain_order_is_top_k_top_p_min_p_then_temperature() {
    let logits = ln_probs(&[0.05, 0.4, 0.3, 0.15, 0.1]);
    // top-k 4 drops token 0; top-p sees 0.4/0.95, 0.3/0.95, ... and keeps three
    // (cumulative 0.42, 0.74, 0.89 >= 0.8); min-p 0.5 then keeps p >= 0.2: tokens 1, 2.
    let cfg = SamplerConfig { temperature: 0.7, top_k: 4, top_p: 0.8, min_p: 0.5, ..SamplerConfig::default() };
    let mut sampler = Sampler::new(cfg).unwrap();
    let dist = sampler.distribution(&logits).unwrap();
    let w1 = 0.4f64.powf(1.0 / 0.7);
    let w2 = 0.3f64.powf(1.0 / 0.7);
    assert_eq!(dist.iter().map(|t| t.token).collect::<Vec<_>>(), [1, 2]);
    assert!((dist[0].prob as f64 - w1 / (w1 + w2)).abs() < 1e-5, "{dist:?}");
    // Temperature comes last: it does not change which tokens top-p and min-p keep.
    for temperature in [0.1, 3.0] {
        let mut hot = Sampler::new(SamplerConfig { temperature, ..sampler.config().clone() }).unwrap();
        assert_eq!(kept(&mut hot, &logits), [1, 2]);
    }
}

#[test]
fn top_p_on_a_full_vocabulary_matches_a_full_sort() {
    let logits = noise(262_144, 11, 8.0);
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    for top_p in [0.5f32, 0.9, 0.99] {
        let mut cumulative = 0.0;
        let mut expected = Vec::new();
        for &token in &order {
            cumulative += ((logits[token as usize] - max) as f64).exp() / total;
            expected.push(token);
            if cumulative >= top_p as f64 {
                break;
            }
        }
        expected.sort();
        let mut sampler = Sampler::new(SamplerConfig { top_p, ..plain() }).unwrap();
        assert_eq!(kept(&mut sampler, &logits), expected, "top_p {top_p}");
    }
}

#[test]
fn default_chain_on_a_large_vocabulary() {
    let mut sampler = Sampler::new(SamplerConfig { seed: 5, ..SamplerConfig::default() }).unwrap();
    let logits = noise(262_144, 12, 6.0);
    let dist = sampler.distribution(&logits).unwrap();
    assert!(!dist.is_empty() && dist.len() <= 40);
    let total: f32 = dist.iter().map(|t| t.prob).sum();
    assert!((total - 1.0).abs() < 1e-4);
    assert_eq!(dist[0].token, argmax(&logits));
    for _ in 0..20 {
        let token = sampler.sample(&logits);
        assert!(dist.iter().any(|t| t.token == token));
    }
}

#[test]
fn repeat_penalty_divides_positive_and_multiplies_negative_logits() {
    let cfg = SamplerConfig { repeat_penalty: 2.0, repeat_last_n: 8, ..plain() };
    let mut sampler = Sampler::new(cfg).unwrap();
    sampler.accept(0);
    sampler.accept(1);
    // [2, -1, 0.5] becomes [1, -2, 0.5].
    let dist = sampler.distribution(&[2.0, -1.0, 0.5]).unwrap();
    let weights = [1.0f64.exp(), (-2.0f64).exp(), 0.5f64.exp()];
    let total: f64 = weights.iter().sum();
    for t in &dist {
        assert!((t.prob as f64 - weights[t.token as usize] / total).abs() < 1e-6, "{dist:?}");
    }

    let mut greedy = Sampler::new(SamplerConfig { repeat_penalty: 1.5, ..SamplerConfig::greedy() }).unwrap();
    assert_eq!(greedy.sample(&[1.0, 0.9]), 0);
    greedy.accept(0);
    assert_eq!(greedy.sample(&[1.0, 0.9]), 1, "1.0 / 1.5 < 0.9");
    assert_eq!(greedy.sample(&[-1.0, -1.2]), 1, "-1.0 * 1.5 < -1.2");
}

#[test]
fn penalties_only_see_the_last_n_tokens() {
    let mut sampler =
        Sampler::new(SamplerConfig { repeat_penalty: 1.5, repeat_last_n: 2, ..SamplerConfig::greedy() }).unwrap();
    sampler.accept(0);
    assert_eq!(sampler.sample(&[1.0, 0.9]), 1);
    sampler.accept(5);
    assert_eq!(sampler.sample(&[1.0, 0.9]), 1);
    sampler.accept(6);
    assert_eq!(sampler.sample(&[1.0, 0.9]), 0, "token 0 left the window");

    let mut off =
        Sampler::new(SamplerConfig { repeat_penalty: 1.5, repeat_last_n: 0, ..SamplerConfig::greedy() }).unwrap();
    off.accept(0);
    assert_eq!(off.sample(&[1.0, 0.9]), 0, "repeat_last_n 0 turns penalties off");
}

#[test]
fn frequency_and_presence_penalties_subtract() {
    let penalized = |frequency_penalty: f32, presence_penalty: f32| {
        let cfg = SamplerConfig { frequency_penalty, presence_penalty, ..SamplerConfig::greedy() };
        let mut sampler = Sampler::new(cfg).unwrap();
        for _ in 0..3 {
            sampler.accept(0);
        }
        sampler.sample(&[1.0, 0.0])
    };
    assert_eq!(penalized(0.1, 0.5), 0, "1 - 3*0.1 - 0.5 = 0.2 > 0");
    assert_eq!(penalized(0.2, 0.5), 1, "1 - 3*0.2 - 0.5 = -0.1 < 0");
    assert_eq!(penalized(0.0, 1.5), 1, "1 - 1.5 < 0");
    assert_eq!(penalized(-1.0, 0.0), 0);

    let mut sampler =
        Sampler::new(SamplerConfig { frequency_penalty: 0.25, presence_penalty: 0.5, ..plain() }).unwrap();
    sampler.accept(1);
    sampler.accept(1);
    // Token 1: 0 - 2*0.25 - 0.5 = -1.
    let dist = sampler.distribution(&[0.0, 0.0]).unwrap();
    let p1 = dist.iter().find(|t| t.token == 1).unwrap().prob as f64;
    assert!((p1 - (-1.0f64).exp() / (1.0 + (-1.0f64).exp())).abs() < 1e-6, "{dist:?}");
}

#[test]
fn nan_and_infinite_logits() {
    let mut sampler = Sampler::new(SamplerConfig { seed: 9, ..plain() }).unwrap();
    let logits = [f32::NAN, 0.0, f32::NAN, 1.0];
    for _ in 0..200 {
        let token = sampler.sample(&logits);
        assert!(token == 1 || token == 3, "NaN token {token} drawn");
    }
    let mut greedy = Sampler::new(SamplerConfig::greedy()).unwrap();
    assert_eq!(greedy.sample(&[f32::NAN, -5.0, f32::NAN]), 1);

    // +inf wins outright; two of them share the mass.
    assert_eq!(sampler.sample(&[0.0, f32::INFINITY, 3.0]), 1);
    let dist = sampler.distribution(&[f32::INFINITY, 0.0, f32::INFINITY]).unwrap();
    assert_eq!(dist, [TokenProb { token: 0, prob: 0.5 }, TokenProb { token: 2, prob: 0.5 }]);

    // Nothing to choose: an error from try_sample, token 0 from sample.
    for hopeless in [vec![f32::NAN; 4], vec![f32::NEG_INFINITY, f32::NAN]] {
        assert_eq!(sampler.try_sample(&hopeless), Err(SamplerError::NoFiniteLogit));
        assert_eq!(sampler.sample(&hopeless), 0);
        assert_eq!(greedy.try_sample(&hopeless), Err(SamplerError::NoFiniteLogit));
    }
    assert_eq!(sampler.try_sample(&[]), Err(SamplerError::EmptyLogits));
    assert_eq!(sampler.sample(&[]), 0);
}

#[test]
fn a_single_candidate_is_always_chosen() {
    let mut sampler = Sampler::new(SamplerConfig { seed: 3, ..plain() }).unwrap();
    let logits = [f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY];
    for _ in 0..100 {
        assert_eq!(sampler.sample(&logits), 1);
    }
}

#[test]
fn logit_bias_shifts_logits_and_minus_infinity_bans() {
    let logits = [1.0f32, 3.0, 2.0, 0.5];
    let greedy = |bias: Vec<(u32, f32)>| {
        Sampler::new(SamplerConfig { logit_bias: bias, ..SamplerConfig::greedy() })
            .unwrap()
            .try_sample(&logits)
            .unwrap()
    };
    assert_eq!(greedy(vec![]), 1);
    assert_eq!(greedy(vec![(3, 2.6)]), 3, "0.5 + 2.6 passes 3.0");
    assert_eq!(greedy(vec![(1, f32::NEG_INFINITY)]), 2);
    assert_eq!(greedy(vec![(99, 100.0), (1, -1.5)]), 2, "ids past the vocabulary are ignored");
    // The biased distribution: the same as sampling from the shifted logits.
    let mut a = Sampler::new(SamplerConfig { logit_bias: vec![(0, 1.0)], ..plain() }).unwrap();
    let mut b = Sampler::new(plain()).unwrap();
    let shifted = [2.0f32, 3.0, 2.0, 0.5];
    assert_eq!(a.distribution(&logits).unwrap(), b.distribution(&shifted).unwrap());
}
