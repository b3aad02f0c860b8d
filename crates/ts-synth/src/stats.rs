//! Statistics of a routing trace: how concentrated selections and cache hits are, and
//! how many experts consecutive tokens share.

/// One layer's routing over a sequence of single-token steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RoutingStats {
    /// Fraction of all selections that went to the most-chosen 10% of experts (rounded up).
    pub top_share: f64,
    /// Mean of `|S_t ∩ S_{t−1}| / k` over consecutive steps.
    pub overlap: f64,
    /// Hit rate of an LRU cache of `cache` experts.
    pub hit_rate: f64,
    /// Fraction of that cache's hits that went to the 10% of experts with the most hits.
    pub hit_top_share: f64,
}

impl RoutingStats {
    /// `steps[t]` holds the experts step t selected (each step the same number).
    pub fn of_layer(n_expert: usize, steps: &[Vec<usize>], cache: usize) -> RoutingStats {
        let top = n_expert.div_ceil(10);
        let share_of_top = |counts: &[usize]| {
            let mut sorted = counts.to_vec();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            let total: usize = sorted.iter().sum();
            sorted[..top].iter().sum::<usize>() as f64 / total.max(1) as f64
        };
        let mut chosen = vec![0usize; n_expert];
        let mut hits = vec![0usize; n_expert];
        let mut lru: Vec<usize> = Vec::new();
        let (mut shared, mut pairs, mut selections) = (0usize, 0usize, 0usize);
        for (t, step) in steps.iter().enumerate() {
            // A step's experts are all needed at once: hits move to the front, then misses
            // come in and push out the least recently used experts the step does not need.
            for &e in step {
                chosen[e] += 1;
                selections += 1;
                if let Some(i) = lru.iter().position(|&x| x == e) {
                    hits[e] += 1;
                    lru.remove(i);
                    lru.push(e);
                }
            }
            for &e in step {
                if !lru.contains(&e) {
                    lru.push(e);
                }
            }
            while lru.len() > cache.max(step.len()) {
                let i = lru.iter().position(|x| !step.contains(x)).expect("more entries than the step holds");
                lru.remove(i);
            }
            if t > 0 {
                shared += step.iter().filter(|e| steps[t - 1].contains(e)).count();
                pairs += step.len();
            }
        }
        RoutingStats {
            top_share: share_of_top(&chosen),
            overlap: shared as f64 / pairs.max(1) as f64,
            hit_rate: hits.iter().sum::<usize>() as f64 / selections.max(1) as f64,
            hit_top_share: share_of_top(&hits),
        }
    }

    /// The mean over layers.
    pub fn mean(layers: &[RoutingStats]) -> RoutingStats {
        let n = layers.len().max(1) as f64;
        let sum = |f: fn(&RoutingStats) -> f64| layers.iter().map(f).sum::<f64>() / n;
        RoutingStats {
            top_share: sum(|s| s.top_share),
            overlap: sum(|s| s.overlap),
            hit_rate: sum(|s| s.hit_rate),
            hit_top_share: sum(|s| s.hit_top_share),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_overlap_and_concentration() {
        let steps = vec![vec![0, 1], vec![1, 2], vec![1, 3], vec![0, 1]];
        let s = RoutingStats::of_layer(10, &steps, 2);
        assert!((s.overlap - 3.0 / 6.0).abs() < 1e-12);
        // expert 1: 4 of 8 selections; the top 10% of 10 experts is one expert.
        assert!((s.top_share - 0.5).abs() < 1e-12);
        // LRU of 2: hits are expert 1 at steps 1, 2, 3.
        assert!((s.hit_rate - 3.0 / 8.0).abs() < 1e-12);
        assert!((s.hit_top_share - 1.0).abs() < 1e-12);
    }
}
