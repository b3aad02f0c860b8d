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
    /// Advanced once per `ensure`.
    clock: u64,
}

impl SlotScores {
    fn new(policy: EvictionPolicy, n_slots: usize) -> SlotScores {
        SlotScores { policy, last_use: vec![0; n_slots], uses: vec![0; n_slots], score: vec![0.0; n_slots], clock: 0 }
    }

    /// A slot was given to a new expert: its history starts over.
    fn reset(&mut self, s: usize) {
        self.score[s] = 0.0;
        self.uses[s] = 0;
        self.last_use[s] = self.clock;
    }

    /// Slot `s` was used now.
    fn touch(&mut self, s: usize) {
        if let EvictionPolicy::DecayedFrequency { half_life } = self.policy {
            self.score[s] = self.score[s] * 0.5f64.powf((self.clock - self.last_use[s]) as f64 / half_life) + 1.0;
        }
        self.uses[s] += 1;
        self.last_use[s] = self.clock;
    }

    /// The policy's victim among `candidates` (occupied, evictable slots).
    fn victim(&self, candidates: impl Iterator<Item = usize>) -> Option<usize> {
        match self.policy {
            EvictionPolicy::Lru => candidates.min_by_key(|&s| self.last_use[s]),
            EvictionPolicy::Lfu => candidates.min_by_key(|&s| (self.uses[s], self.last_use[s])),
            EvictionPolicy::DecayedFrequency { half_life } => candidates.min_by(|&a, &b| {
                let decayed =
                    |s: usize| self.score[s] * 0.5f64.powf((self.clock - self.last_use[s]) as f64 / half_life);
                decayed(a).total_cmp(&decayed(b)).then(self.last_use[a].cmp(&self.last_use[b]))
            }),
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
        let open = |s: &usize| self.pins[*s] == 0 && evictable(*s);
        let s = match (0..self.n_slots()).filter(open).find(|&s| self.owner[s].is_none()) {
            Some(s) => s,
            None => self.scores.victim((0..self.n_slots()).filter(open))?,
        };
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
}
