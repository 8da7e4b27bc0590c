//! Least-frequently-used eviction, ties broken by recency: the victim is the resident key
//! with the fewest accesses, and among equals the least recently used.
//!
//! Frequencies persist across evictions (an expert's popularity is a property of the model
//! and the text, not of one residency), so an expert the router keeps coming back to wins
//! its slot back quickly. This is also what breaks LRU's cycle cliff: under a budget below
//! one token's cycle, LFU keeps the popular experts and lets the rare ones churn.
//!
//! Ordered in a `BTreeSet` of `(count, last_tick, index)`: O(log n) per event, no allocation
//! beyond the set's nodes, deterministic.

use super::EvictionPolicy;
use crate::layout::ExpertLayout;
use std::collections::BTreeSet;

/// Access counts, last-access ticks and the ordered set of resident keys: the part LFU and
/// layer-LFU share.
#[derive(Clone, Debug, Default)]
pub(crate) struct FreqOrder {
    count: Vec<u64>,
    last: Vec<u64>,
    resident: Vec<bool>,
    tick: u64,
    order: BTreeSet<(u64, u64, u32)>,
}

impl FreqOrder {
    pub(crate) fn init(&mut self, n_keys: usize) {
        self.count = vec![0; n_keys];
        self.last = vec![0; n_keys];
        self.resident = vec![false; n_keys];
        self.tick = 0;
        self.order.clear();
    }

    fn entry(&self, i: u32) -> (u64, u64, u32) {
        (self.count[i as usize], self.last[i as usize], i)
    }

    /// Count an access of `i` and make it resident. Returns false for an unknown index.
    pub(crate) fn access(&mut self, i: u32) -> bool {
        let Some(&was) = self.resident.get(i as usize) else {
            return false;
        };
        if was {
            self.order.remove(&self.entry(i));
        }
        self.tick += 1;
        self.count[i as usize] += 1;
        self.last[i as usize] = self.tick;
        self.resident[i as usize] = true;
        self.order.insert(self.entry(i));
        true
    }

    /// A hit on a resident `i` (ignored otherwise).
    pub(crate) fn hit(&mut self, i: u32) -> bool {
        if self.is_resident(i) {
            self.access(i)
        } else {
            false
        }
    }

    pub(crate) fn remove(&mut self, i: u32) -> bool {
        if !self.is_resident(i) {
            return false;
        }
        self.order.remove(&self.entry(i));
        self.resident[i as usize] = false;
        true
    }

    pub(crate) fn is_resident(&self, i: u32) -> bool {
        self.resident.get(i as usize).copied().unwrap_or(false)
    }

    /// Resident keys, least frequently (then least recently) used first.
    pub(crate) fn coldest_first(&self) -> impl Iterator<Item = u32> + '_ {
        self.order.iter().map(|&(_, _, i)| i)
    }

    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}

/// Global LFU with recency tie-break.
#[derive(Clone, Debug, Default)]
pub struct Lfu {
    freq: FreqOrder,
}

impl Lfu {
    /// An empty LFU; `init` sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Resident keys from the next victim onwards (for tests and reports).
    pub fn order(&self) -> Vec<u32> {
        self.freq.coldest_first().collect()
    }
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "lfu",
    help: "the fewest accesses, ties to the least recent; counts survive eviction",
    make: || Box::new(Lfu::new()),
};

impl EvictionPolicy for Lfu {
    fn name(&self) -> &'static str {
        "lfu"
    }

    fn init(&mut self, layout: &ExpertLayout) {
        self.freq.init(layout.n_keys() as usize);
    }

    fn on_insert(&mut self, index: u32) {
        self.freq.access(index);
    }

    fn on_hit(&mut self, index: u32) {
        self.freq.hit(index);
    }

    fn on_remove(&mut self, index: u32) {
        self.freq.remove(index);
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        self.freq.coldest_first().find(|&i| is_evictable(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn fewest_accesses_go_first_then_least_recent() {
        let mut p = Lfu::new();
        p.init(&layout(1, 8));
        for i in [3, 1, 4, 5] {
            p.on_insert(i);
        }
        p.on_hit(3);
        p.on_hit(3);
        p.on_hit(4);
        // counts: 1→1, 5→1 (1 older), 4→2, 3→3.
        assert_eq!(p.order(), vec![1, 5, 4, 3]);
        assert_eq!(p.victim(&|_| true), Some(1));
        assert_eq!(p.victim(&|i| i != 1), Some(5));
        assert_eq!(p.victim(&|_| false), None);
        // Frequency survives eviction: 3 comes back above the others.
        p.on_remove(3);
        assert_eq!(p.order(), vec![1, 5, 4]);
        p.on_insert(3);
        assert_eq!(p.order(), vec![1, 5, 4, 3]);
        // Unknown and non-resident indices are ignored.
        p.on_hit(99);
        p.on_remove(7);
        p.on_hit(7);
        assert_eq!(p.order().len(), 4);
    }
}
