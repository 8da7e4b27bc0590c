//! LRFU (Lee et al., 2001), the frequency+recency hybrid, under the flag name `lfru`.
//!
//! Every access adds 1 to a key's *combined recency and frequency* value, and the value decays
//! by half every `half_life` accesses: `crf(t) = Σ 2^(−(t − t_i)/half_life)`. A small half-life
//! makes it LRU, an infinite one LFU. We use one half-life of `n_keys` accesses — about as many
//! tokens as the model has experts per layer (at qwen3moe's k = 8 of 128, 16 tokens) — so an
//! expert's popularity counts but fades within a paragraph.
//!
//! The victim is the resident key with the lowest current `crf`. Because every value decays
//! by the same factor, that order never changes between accesses, so each key is stored at
//! the time-invariant `log2 crf(t_last) + t_last / half_life` in a `BTreeSet`: O(log n) per
//! event. The value survives eviction, as LFU's count does.

use super::EvictionPolicy;
use crate::layout::ExpertLayout;
use std::collections::BTreeSet;

/// The LRFU policy.
#[derive(Clone, Debug, Default)]
pub struct Lrfu {
    /// log2 of the key's crf at its last access.
    log_crf: Vec<f64>,
    last: Vec<u64>,
    resident: Vec<bool>,
    tick: u64,
    half_life: f64,
    /// (time-invariant priority as ordered bits, index).
    order: BTreeSet<(u64, u32)>,
}

/// Map an f64 to a u64 with the same total order (IEEE total order trick).
fn ordered_bits(x: f64) -> u64 {
    let b = x.to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | (1 << 63)
    }
}

impl Lrfu {
    /// An empty LRFU; `init` sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    fn priority(&self, i: u32) -> (u64, u32) {
        let p = self.log_crf[i as usize] + self.last[i as usize] as f64 / self.half_life;
        (ordered_bits(p), i)
    }

    fn is_resident(&self, i: u32) -> bool {
        self.resident.get(i as usize).copied().unwrap_or(false)
    }

    fn access(&mut self, i: u32) {
        let Some(&was) = self.resident.get(i as usize) else {
            return;
        };
        if was {
            self.order.remove(&self.priority(i));
        }
        self.tick += 1;
        let k = i as usize;
        // crf(now) = 1 + crf(last) · 2^(−Δ/h), in log2: log2(1 + 2^(old − Δ/h)).
        let decayed = if self.last[k] == 0 {
            f64::NEG_INFINITY
        } else {
            self.log_crf[k] - (self.tick - self.last[k]) as f64 / self.half_life
        };
        // libm: f64 `exp2`/`log2` are the platform's otherwise (glibc's and musl's may differ),
        // and the scores order evictions.
        self.log_crf[k] = libm::log2(1.0 + libm::exp2(decayed));
        self.last[k] = self.tick;
        self.resident[k] = true;
        self.order.insert(self.priority(i));
    }

    /// Resident keys from the next victim onwards (for tests and reports).
    pub fn order(&self) -> Vec<u32> {
        self.order.iter().map(|&(_, i)| i).collect()
    }
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "lfru",
    help: "LRFU: the lowest decayed access count (half-life = the expert count, in accesses)",
    make: || Box::new(Lrfu::new()),
};

impl EvictionPolicy for Lrfu {
    fn name(&self) -> &'static str {
        "lfru"
    }

    fn init(&mut self, layout: &ExpertLayout) {
        let n = layout.n_keys() as usize;
        self.log_crf = vec![0.0; n];
        self.last = vec![0; n];
        self.resident = vec![false; n];
        self.tick = 0;
        self.half_life = n.max(1) as f64;
        self.order.clear();
    }

    fn on_insert(&mut self, index: u32) {
        self.access(index);
    }

    fn on_hit(&mut self, index: u32) {
        if self.is_resident(index) {
            self.access(index);
        }
    }

    fn on_remove(&mut self, index: u32) {
        if self.is_resident(index) {
            self.order.remove(&self.priority(index));
            self.resident[index as usize] = false;
        }
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        self.order
            .iter()
            .map(|&(_, i)| i)
            .find(|&i| is_evictable(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn orders_bits_like_floats() {
        let xs = [f64::NEG_INFINITY, -3.5, -0.0, 0.0, 1e-9, 2.0, 1e300];
        for w in xs.windows(2) {
            assert!(ordered_bits(w[0]) <= ordered_bits(w[1]), "{w:?}");
        }
    }

    #[test]
    fn frequency_counts_but_recency_wins_eventually() {
        let mut p = Lrfu::new();
        p.init(&layout(1, 4)); // half-life of 4 accesses
        p.on_insert(0);
        p.on_hit(0);
        p.on_hit(0);
        p.on_insert(1);
        // 0 has three recent accesses, 1 one newer: 1 goes first.
        assert_eq!(p.victim(&|_| true), Some(1));
        // Many accesses to 1 later and 0's value has decayed below 1's.
        for _ in 0..6 {
            p.on_hit(1);
        }
        assert_eq!(p.victim(&|_| true), Some(0));
        assert_eq!(p.victim(&|i| i != 0), Some(1));
        p.on_remove(0);
        assert_eq!(p.order(), vec![1]);
        p.on_hit(0);
        p.on_insert(9);
        assert_eq!(p.order(), vec![1]);
    }
}
