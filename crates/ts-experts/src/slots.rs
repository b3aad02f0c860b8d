//! The bookkeeping of every expert cache, whatever memory its slots are in
//! (host RAM filled from disk here, VRAM filled by copies in ts-cuda): which
//! expert each slot holds, which slots are pinned by a set in use, and which
//! slot the eviction policy gives up for a miss.

use std::collections::HashMap;

/// Which cached expert to evict when a miss needs a slot.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum EvictionPolicy {
    /// Least recently used.
    Lru,
    /// Least frequently used (ties: least recently used).
    Lfu,
    /// Frequency with exponential decay: each use adds 1 to a score that halves
    /// every `half_life` ensure calls; the lowest score goes.
    DecayedFrequency { half_life: f64 },
}

impl EvictionPolicy {
    pub fn name(&self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Lfu => "lfu",
            EvictionPolicy::DecayedFrequency { .. } => "decay",
        }
    }
}

/// Use counts and recency of a cache's slots, and the victim the policy picks.
#[derive(Clone, Debug)]
struct SlotScores {
    policy: EvictionPolicy,
    last_use: Vec<u64>,
    uses: Vec<u64>,
    score: Vec<f64>,
    /// Each slot's [`SlotScores::rank`] primary, kept as its fields change (it depends on
    /// them alone), so that a victim search compares numbers instead of taking logarithms.
    primary: Vec<f64>,
    /// Advanced once per `ensure`.
    clock: u64,
}

impl SlotScores {
    fn new(policy: EvictionPolicy, n_slots: usize) -> SlotScores {
        let mut scores = SlotScores {
            policy,
            last_use: vec![0; n_slots],
            uses: vec![0; n_slots],
            score: vec![0.0; n_slots],
            primary: vec![0.0; n_slots],
            clock: 0,
        };
        (0..n_slots).for_each(|s| scores.primary[s] = scores.primary_of(s));
        scores
    }

    /// A slot was given to a new expert: its history starts over.
    fn reset(&mut self, s: usize) {
        self.score[s] = 0.0;
        self.uses[s] = 0;
        self.last_use[s] = self.clock;
        self.primary[s] = self.primary_of(s);
    }

    /// Slot `s` was used now.
    fn touch(&mut self, s: usize) {
        if let EvictionPolicy::DecayedFrequency { half_life } = self.policy {
            self.score[s] = self.score[s] * 0.5f64.powf((self.clock - self.last_use[s]) as f64 / half_life) + 1.0;
        }
        self.uses[s] += 1;
        self.last_use[s] = self.clock;
        self.primary[s] = self.primary_of(s);
    }

    /// Slot `s`'s rank for eviction, lowest first: (primary, recency).
    fn rank(&self, s: usize) -> (f64, u64) {
        (self.primary[s], self.last_use[s])
    }

    /// The first half of slot `s`'s rank, from its fields. For `decay`,
    /// `score · 2^(-(clock - last_use) / half_life)` ranks as its log plus
    /// `last_use / half_life` (the clock is common to every slot), so no power is taken.
    fn primary_of(&self, s: usize) -> f64 {
        match self.policy {
            EvictionPolicy::Lru => self.last_use[s] as f64,
            EvictionPolicy::Lfu => self.uses[s] as f64,
            EvictionPolicy::DecayedFrequency { half_life } => {
                self.score[s].log2() + self.last_use[s] as f64 / half_life
            }
        }
    }
}

/// Which expert of which layer each of `n` slots holds, the slots pinned by
/// sets in use (the protect set), and the policy's scores.
#[derive(Clone, Debug)]
pub struct SlotCache {
    /// (layer, expert) -> slot.
    table: HashMap<(usize, usize), usize>,
    owner: Vec<Option<(usize, usize)>>,
    pins: Vec<u32>,
    scores: SlotScores,
}

impl SlotCache {
    pub fn new(policy: EvictionPolicy, n_slots: usize) -> SlotCache {
        SlotCache {
            table: HashMap::new(),
            owner: vec![None; n_slots],
            pins: vec![0; n_slots],
            scores: SlotScores::new(policy, n_slots),
        }
    }

    pub fn n_slots(&self) -> usize {
        self.owner.len()
    }

    pub fn policy(&self) -> EvictionPolicy {
        self.scores.policy
    }

    /// One more `ensure`: the clock the policies age by.
    pub fn tick(&mut self) {
        self.scores.clock += 1;
    }

    /// The slot holding expert `e` of `layer`.
    pub fn lookup(&self, layer: usize, e: usize) -> Option<usize> {
        self.table.get(&(layer, e)).copied()
    }

    /// A slot for expert `e` of `layer`: a free one, else the policy's victim
    /// among slots neither pinned nor refused by `evictable`. The slot is
    /// entered in the table (what it held is forgotten) with a fresh score.
    pub fn claim(&mut self, layer: usize, e: usize, evictable: impl Fn(usize) -> bool) -> Option<usize> {
        // One pass: the first free slot, else the lowest-ranked open one.
        let mut victim: Option<(usize, (f64, u64))> = None;
        let mut free = None;
        for s in 0..self.n_slots() {
            if self.pins[s] > 0 || !evictable(s) {
                continue;
            }
            if self.owner[s].is_none() {
                free = Some(s);
                break;
            }
            let rank = self.scores.rank(s);
            if victim.is_none_or(|(_, best)| rank.0 < best.0 || (rank.0 == best.0 && rank.1 < best.1)) {
                victim = Some((s, rank));
            }
        }
        let s = free.or(victim.map(|(s, _)| s))?;
        self.assign(s, layer, e);
        Some(s)
    }

    /// Gives slot `s` to expert `e` of `layer` (what it held is forgotten).
    pub fn assign(&mut self, s: usize, layer: usize, e: usize) {
        if let Some(old) = self.owner[s].take() {
            self.table.remove(&old);
        }
        self.owner[s] = Some((layer, e));
        self.table.insert((layer, e), s);
        self.scores.reset(s);
    }

    /// Slot `s` holds nothing usable any more.
    pub fn forget(&mut self, s: usize) {
        if let Some(key) = self.owner[s].take() {
            self.table.remove(&key);
        }
    }

    /// Slot `s` was used now.
    pub fn touch(&mut self, s: usize) {
        self.scores.touch(s);
    }

    pub fn pin(&mut self, s: usize) {
        self.pins[s] += 1;
    }

    pub fn unpin(&mut self, s: usize) {
        self.pins[s] -= 1;
    }

    pub fn pinned(&self, s: usize) -> bool {
        self.pins[s] > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_slots_first_then_the_policy_skipping_pinned_and_refused() {
        let mut c = SlotCache::new(EvictionPolicy::Lru, 3);
        for e in 0..3 {
            c.tick();
            let s = c.claim(0, e, |_| true).unwrap();
            c.touch(s);
            assert_eq!(s, e);
        }
        c.tick();
        c.touch(0);
        c.pin(1);
        // Slot 1 is pinned, slot 2 refused: slot 0 goes although it was used last.
        assert_eq!(c.claim(0, 7, |s| s != 2), Some(0));
        assert_eq!((c.lookup(0, 0), c.lookup(0, 7)), (None, Some(0)));
        c.pin(0);
        assert_eq!(c.claim(0, 8, |s| s != 2), None);
        c.unpin(1);
        // Slot 1 was last used at clock 2, slot 2 at clock 3.
        assert_eq!(c.claim(0, 8, |_| true), Some(1), "the least recently used of the open slots");
        c.forget(1);
        assert_eq!(c.lookup(0, 8), None);
        assert_eq!(c.claim(0, 9, |_| true), Some(1), "a forgotten slot is free again");
    }

    /// `decay` evicts the slot of the lowest decayed score, `score · 2^(-age / half_life)`,
    /// ties to the least recently used, as computed from the definition.
    #[test]
    fn decay_evicts_the_lowest_decayed_score() {
        let half_life = 8.0;
        let n = 40;
        let mut c = SlotCache::new(EvictionPolicy::DecayedFrequency { half_life }, n);
        let mut x = 12345u64;
        let mut next = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) as usize
        };
        for e in 0..n {
            c.tick();
            let s = c.claim(0, e, |_| true).unwrap();
            c.touch(s);
        }
        for round in 0..300 {
            c.tick();
            for _ in 0..3 {
                let e = next() % n;
                if let Some(s) = c.lookup(0, e) {
                    c.touch(s);
                }
            }
            let sc = &c.scores;
            let decayed = |s: usize| sc.score[s] * 0.5f64.powf((sc.clock - sc.last_use[s]) as f64 / half_life);
            let want = (0..n)
                .min_by(|&a, &b| decayed(a).total_cmp(&decayed(b)).then(sc.last_use[a].cmp(&sc.last_use[b])))
                .unwrap();
            let owner = c.owner[want].unwrap();
            let got = c.claim(1, round, |_| true).unwrap();
            assert_eq!(got, want, "round {round}");
            // Give the slot back to what it held, so the cache stays full of layer 0.
            c.assign(got, owner.0, owner.1);
            c.touch(got);
        }
    }
}
