//! LeCaR (Vietri et al., HotStorage 2018), a learned mix of LRU and LFU, made deterministic.
//!
//! Two experts propose a victim: LRU (least recently used) and LFU (fewest accesses, ties to
//! the least recent; counts survive eviction as in `lfu`). Each eviction is remembered in the
//! history of the expert that chose it (keys only, each history at most `N` = resident entries
//! long, oldest forgotten first). When a remembered key is admitted again, the expert that
//! evicted it was wrong: the *other* expert's weight is multiplied by `e^(λ·r)`, with
//! `r = d^(age)`, `d = 0.005^(1/N)` (a regret that fades with the time since the eviction, in
//! accesses) and learning rate `λ = 0.45`, the paper's values; the weights are renormalised.
//!
//! The paper draws the acting expert at random with the weights as probabilities. Here the
//! heavier expert acts (ties to LRU): no random stream, so the engine, the simulator and the
//! independent Python recount (`scripts/sim-check.py`) take the very same decisions.

use super::EvictionPolicy;
use crate::layout::ExpertLayout;
use std::cell::Cell;
use std::collections::{BTreeSet, VecDeque};

const LAMBDA: f64 = 0.45;
const BY_LRU: u8 = 1;
const BY_LFU: u8 = 2;

/// The LeCaR policy.
#[derive(Clone, Debug, Default)]
pub struct LeCar {
    tick: u64,
    last: Vec<u64>,
    freq: Vec<u64>,
    resident: Vec<bool>,
    n_resident: u64,
    lru: BTreeSet<(u64, u32)>,
    lfu: BTreeSet<(u64, u64, u32)>,
    w_lru: f64,
    w_lfu: f64,
    /// Per key: which history remembers it (0 none), since when, and its FIFO stamp.
    hist_of: Vec<u8>,
    hist_time: Vec<u64>,
    hist_stamp: Vec<u64>,
    /// Per history (LRU's, LFU's): FIFO of (key, stamp) and live length.
    hist: [VecDeque<(u32, u64)>; 2],
    hist_len: [usize; 2],
    stamp: u64,
    /// The victim `victim` named and the expert that chose it, for `on_remove`.
    pending: Cell<Option<(u32, u8)>>,
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "lecar",
    help: "LeCaR: LRU's or LFU's victim, whichever has the higher weight, learned from the regret of past evictions",
    make: || Box::new(LeCar::new()),
};

impl LeCar {
    /// An empty LeCaR; `init` sizes it.
    pub fn new() -> Self {
        LeCar {
            w_lru: 0.5,
            w_lfu: 0.5,
            ..Default::default()
        }
    }

    /// The current (LRU, LFU) weights.
    pub fn weights(&self) -> (f64, f64) {
        (self.w_lru, self.w_lfu)
    }

    fn is_resident(&self, i: u32) -> bool {
        self.resident.get(i as usize).copied().unwrap_or(false)
    }

    fn unorder(&mut self, i: u32) {
        let k = i as usize;
        self.lru.remove(&(self.last[k], i));
        self.lfu.remove(&(self.freq[k], self.last[k], i));
    }

    fn touch(&mut self, i: u32) {
        let k = i as usize;
        self.tick += 1;
        self.freq[k] += 1;
        self.last[k] = self.tick;
        self.lru.insert((self.last[k], i));
        self.lfu.insert((self.freq[k], self.last[k], i));
    }

    fn forget(&mut self, i: u32) {
        let k = i as usize;
        let h = self.hist_of[k];
        if h != 0 {
            self.hist_of[k] = 0;
            self.hist_len[usize::from(h - 1)] -= 1;
        }
    }

    fn remember(&mut self, i: u32, by: u8) {
        let k = i as usize;
        let h = usize::from(by - 1);
        self.stamp += 1;
        self.hist_of[k] = by;
        self.hist_time[k] = self.tick;
        self.hist_stamp[k] = self.stamp;
        self.hist[h].push_back((i, self.stamp));
        self.hist_len[h] += 1;
        let cap = (self.n_resident as usize).max(1);
        while self.hist_len[h] > cap {
            let Some((j, s)) = self.hist[h].pop_front() else {
                break;
            };
            let j = j as usize;
            if self.hist_of[j] == by && self.hist_stamp[j] == s {
                self.hist_of[j] = 0;
                self.hist_len[h] -= 1;
            }
        }
    }
}

impl EvictionPolicy for LeCar {
    fn name(&self) -> &'static str {
        INFO.name
    }

    fn init(&mut self, layout: &ExpertLayout) {
        let n = layout.n_keys() as usize;
        *self = LeCar::new();
        self.last = vec![0; n];
        self.freq = vec![0; n];
        self.resident = vec![false; n];
        self.hist_of = vec![0; n];
        self.hist_time = vec![0; n];
        self.hist_stamp = vec![0; n];
    }

    fn on_insert(&mut self, index: u32) {
        let k = index as usize;
        if k >= self.resident.len() {
            return;
        }
        if self.resident[k] {
            self.unorder(index);
        } else {
            let by = self.hist_of[k];
            if by != 0 {
                // The expert that evicted it was wrong: reward the other one.
                let n = (self.n_resident.max(1)) as f64;
                // libm: f64 `powf`/`exp` differ between glibc and musl, and the weights decide
                // evictions, so every target must compute them alike.
                let d = libm::pow(0.005, 1.0 / n);
                let r = libm::pow(d, (self.tick + 1 - self.hist_time[k]) as f64);
                if by == BY_LRU {
                    self.w_lfu *= libm::exp(LAMBDA * r);
                } else {
                    self.w_lru *= libm::exp(LAMBDA * r);
                }
                let s = self.w_lru + self.w_lfu;
                self.w_lru /= s;
                self.w_lfu /= s;
                self.forget(index);
            }
            self.resident[k] = true;
            self.n_resident += 1;
        }
        self.touch(index);
    }

    fn on_hit(&mut self, index: u32) {
        if self.is_resident(index) {
            self.unorder(index);
            self.touch(index);
        }
    }

    fn on_remove(&mut self, index: u32) {
        if !self.is_resident(index) {
            return;
        }
        self.unorder(index);
        self.resident[index as usize] = false;
        self.n_resident -= 1;
        match self.pending.take() {
            Some((v, by)) if v == index => self.remember(index, by),
            _ => {}
        }
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        let by_lru = self.lru.iter().map(|&(_, i)| i).find(|&i| is_evictable(i));
        let by_lfu = self
            .lfu
            .iter()
            .map(|&(_, _, i)| i)
            .find(|&i| is_evictable(i));
        let chosen = if self.w_lru >= self.w_lfu {
            by_lru.map(|i| (i, BY_LRU)).or(by_lfu.map(|i| (i, BY_LFU)))
        } else {
            by_lfu.map(|i| (i, BY_LFU)).or(by_lru.map(|i| (i, BY_LRU)))
        };
        self.pending.set(chosen);
        chosen.map(|(i, _)| i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn regret_moves_the_weight_to_the_other_expert() {
        let mut p = LeCar::new();
        p.init(&layout(1, 8));
        for i in 0..4 {
            p.on_insert(i);
        }
        p.on_hit(0);
        p.on_hit(0);
        // LRU's victim is 1, LFU's is 1 too (one access, oldest): equal weights act as LRU.
        assert_eq!(p.victim(&|_| true), Some(1));
        p.on_remove(1);
        // 1 comes back: LRU evicted it wrongly, LFU gains weight.
        p.on_insert(1);
        let (wl, wf) = p.weights();
        assert!(wf > wl && (wl + wf - 1.0).abs() < 1e-12, "{wl} {wf}");
        // Now LFU acts: 2 and 3 have one access each; 2 is older. LRU would say 2 too, so make
        // them disagree: hit 2 once -> LRU's victim is 3? No: LRU's oldest is now 3.
        p.on_hit(2);
        // LRU order: 3 (oldest), 0, 1, 2. LFU: 3 (1 access), 1 (2 accesses, survived), 2, 0.
        assert_eq!(p.victim(&|_| true), Some(3));
        assert_eq!(p.victim(&|i| i != 3), Some(1), "LFU's pick, not LRU's 0");
        // A discard (no victim pending for it) is not remembered.
        p.on_remove(2);
        p.on_insert(2);
        assert_eq!(p.weights(), (wl, wf));
        p.on_hit(99);
        assert_eq!(p.victim(&|_| false), None);
    }
}
