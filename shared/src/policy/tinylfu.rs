//! TinyLFU admission (Einziger, Friedman & Manes, "TinyLFU: A Highly Efficient Cache Admission
//! Policy", ACM ToS 2017) in front of any eviction policy: `tinylfu` over LRU, `tinylfu-s3fifo`
//! over S3-FIFO.
//!
//! Every lookup (hit or miss) is recorded in a small frequency sketch with periodic aging. When
//! a miss would have to evict, the eviction policy underneath names its victim as usual, and the
//! miss is admitted only if its estimated frequency is *higher* than the victim's; otherwise it
//! is bypassed — read and computed from a transient buffer, never inserted, nothing evicted.
//! A miss that fits without evicting is always admitted. That is the paper's admission rule as
//! W-TinyLFU applies it between its window's and its main cache's victims, with the window left
//! out: the eviction policy underneath plays the main cache.
//!
//! The sketch, exactly (docs/policies.md, "tinylfu"; `scripts/sim-check.py` recounts it):
//! - a count-min sketch of `DEPTH` = 4 rows × `width` 4-bit counters (saturating at 15), `width`
//!   the smallest power of two ≥ max(16, capacity), capacity = the experts the budget holds
//!   (`CacheCapacity::experts`, or `min_experts` when sizes differ);
//! - row `r`'s counter for key index `i` is column `mix64((i + 1)·φ + r·ψ) mod width` (wrapping
//!   64-bit arithmetic; φ = 0x9E3779B97F4A7C15, ψ = 0xD6E8FEB86659FD93; `mix64` the SplitMix64
//!   finaliser);
//! - a doorkeeper: one bit per counter (`DEPTH × width`), read at the same positions. A key
//!   whose 4 doorkeeper bits are not all set gets them set and nothing else; one whose bits are
//!   all set increments its counters conservatively (only those equal to its current minimum,
//!   and only while that minimum is below 15: the paper's "minimal increment");
//! - estimate = the minimum of the key's 4 counters, plus 1 when its 4 doorkeeper bits are set;
//! - aging (the paper's reset): every recorded access counts one addition; when the additions
//!   reach the sample size `W = 10 × capacity`, every counter is halved (rounding down), the
//!   doorkeeper cleared, and the additions halved too.
//!
//! Deterministic: no random admission (Caffeine adds some against hash flooding; a cache keyed
//! by expert indices has no adversary), and the hash is fixed.

use super::{AccessContext, CacheCapacity, EvictionPolicy, StepContext};
use crate::layout::ExpertLayout;

/// Rows of the count-min sketch.
pub const DEPTH: usize = 4;
/// A counter's ceiling (4 bits).
pub const COUNTER_MAX: u8 = 15;
/// The sample size in accesses per expert of capacity.
pub const SAMPLE_PER_ENTRY: u64 = 10;
const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
const PSI: u64 = 0xD6E8_FEB8_6659_FD93;

/// SplitMix64's finaliser.
pub fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The frequency sketch with its doorkeeper and aging.
#[derive(Clone, Debug, Default)]
pub struct Sketch {
    width: usize,
    /// `DEPTH × width` counters, row-major.
    counters: Vec<u8>,
    /// `DEPTH × width` doorkeeper bits, one per counter.
    door: Vec<bool>,
    additions: u64,
    sample: u64,
}

impl Sketch {
    /// An empty sketch for a cache of `capacity` experts.
    pub fn new(capacity: u32) -> Sketch {
        let capacity = capacity.max(1);
        let width = (capacity as usize).max(16).next_power_of_two();
        Sketch {
            width,
            counters: vec![0; DEPTH * width],
            door: vec![false; DEPTH * width],
            additions: 0,
            sample: SAMPLE_PER_ENTRY * u64::from(capacity),
        }
    }

    /// Counters per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The positions of key `index` in the row-major tables.
    fn slots(&self, index: u32) -> [usize; DEPTH] {
        let mut out = [0usize; DEPTH];
        for (r, o) in out.iter_mut().enumerate() {
            let h = mix64(
                (u64::from(index) + 1)
                    .wrapping_mul(PHI)
                    .wrapping_add((r as u64).wrapping_mul(PSI)),
            );
            *o = r * self.width + (h as usize & (self.width - 1));
        }
        out
    }

    /// The estimated frequency of `index` since the last aging (about half of it before that).
    pub fn estimate(&self, index: u32) -> u32 {
        if self.width == 0 {
            return 0;
        }
        let slots = self.slots(index);
        let min = slots.iter().map(|&s| self.counters[s]).min().unwrap_or(0);
        let door = slots.iter().all(|&s| self.door[s]);
        u32::from(min) + u32::from(door)
    }

    /// Record one access of `index`.
    pub fn record(&mut self, index: u32) {
        if self.width == 0 {
            return;
        }
        let slots = self.slots(index);
        if slots.iter().all(|&s| self.door[s]) {
            let min = slots.iter().map(|&s| self.counters[s]).min().unwrap_or(0);
            if min < COUNTER_MAX {
                for &s in &slots {
                    if self.counters[s] == min {
                        self.counters[s] += 1;
                    }
                }
            }
        } else {
            for &s in &slots {
                self.door[s] = true;
            }
        }
        self.additions += 1;
        if self.additions >= self.sample {
            self.counters.iter_mut().for_each(|c| *c >>= 1);
            self.door.fill(false);
            self.additions /= 2;
        }
    }
}

/// TinyLFU admission over an eviction policy.
pub struct TinyLfu {
    name: &'static str,
    inner: Box<dyn EvictionPolicy>,
    sketch: Sketch,
    /// The capacity the sketch was sized for.
    capacity: u32,
}

impl std::fmt::Debug for TinyLfu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TinyLfu")
            .field("name", &self.name)
            .field("inner", &self.inner.name())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl TinyLfu {
    /// TinyLFU admission in front of `inner`, reported as `name`.
    pub fn new(name: &'static str, inner: Box<dyn EvictionPolicy>) -> TinyLfu {
        TinyLfu {
            name,
            inner,
            sketch: Sketch::default(),
            capacity: 0,
        }
    }

    /// The sketch (for tests and reports).
    pub fn sketch(&self) -> &Sketch {
        &self.sketch
    }

    fn resize(&mut self, capacity: u32) {
        if capacity != self.capacity {
            self.capacity = capacity;
            self.sketch = Sketch::new(capacity);
        }
    }
}

/// The registry entry `tinylfu`: TinyLFU admission over global LRU.
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "tinylfu",
    help: "LRU's victim, but a miss that would evict it is admitted only if a frequency sketch (TinyLFU) counts it more often; else it is read, computed and bypassed",
    make: || Box::new(TinyLfu::new("tinylfu", Box::new(super::Lru::new()))),
};

/// The registry entry `tinylfu-s3fifo`: TinyLFU admission over S3-FIFO.
pub const INFO_S3FIFO: super::PolicyInfo = super::PolicyInfo {
    name: "tinylfu-s3fifo",
    help: "S3-FIFO's victim, behind tinylfu's admission filter",
    make: || {
        Box::new(TinyLfu::new(
            "tinylfu-s3fifo",
            Box::new(super::S3Fifo::new()),
        ))
    },
};

impl EvictionPolicy for TinyLfu {
    fn name(&self) -> &'static str {
        self.name
    }

    fn init(&mut self, layout: &ExpertLayout) {
        self.inner.init(layout);
        // Until the cache says its size: as if it could hold every expert.
        self.capacity = 0;
        self.resize(layout.n_keys().max(1));
    }

    fn on_insert(&mut self, index: u32) {
        self.inner.on_insert(index);
    }

    fn on_hit(&mut self, index: u32) {
        self.inner.on_hit(index);
    }

    fn on_remove(&mut self, index: u32) {
        self.inner.on_remove(index);
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        self.inner.victim(is_evictable)
    }

    fn on_capacity(&mut self, capacity: &CacheCapacity) {
        self.resize(capacity.experts.unwrap_or(capacity.min_experts).max(1));
        self.inner.on_capacity(capacity);
    }

    fn on_step_begin(&mut self, step: &StepContext) {
        self.inner.on_step_begin(step);
    }

    fn on_layer_begin(&mut self, moe_layer: u16) {
        self.inner.on_layer_begin(moe_layer);
    }

    fn on_access(&mut self, index: u32, resident: bool, access: &AccessContext) {
        self.sketch.record(index);
        self.inner.on_access(index, resident, access);
    }

    fn filters_admission(&self) -> bool {
        true
    }

    fn admit(&mut self, index: u32, victim: Option<u32>, access: &AccessContext) -> bool {
        let ours = match victim {
            None => true,
            Some(v) => self.sketch.estimate(index) > self.sketch.estimate(v),
        };
        ours && (!self.inner.filters_admission() || self.inner.admit(index, victim, access))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn the_hash_is_splitmix64s_finaliser() {
        // Reference values of the finaliser (the first SplitMix64 output for seed 0 is
        // mix64(0x9E3779B97F4A7C15)).
        assert_eq!(mix64(0), 0);
        assert_eq!(mix64(PHI), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn the_doorkeeper_takes_the_first_access_and_the_sketch_the_rest() {
        let mut s = Sketch::new(64);
        assert_eq!(s.width(), 64);
        assert_eq!(s.estimate(7), 0);
        s.record(7);
        assert_eq!(s.estimate(7), 1, "doorkeeper only");
        s.record(7);
        s.record(7);
        assert_eq!(s.estimate(7), 3);
        for _ in 0..20 {
            s.record(7);
        }
        assert_eq!(s.estimate(7), 16, "15 in the counters, 1 in the doorkeeper");
    }

    #[test]
    fn aging_halves_the_counters_and_clears_the_doorkeeper() {
        // Capacity 2: sample 20 accesses, width 16.
        let mut s = Sketch::new(2);
        for _ in 0..9 {
            s.record(1);
        }
        assert_eq!(s.estimate(1), 9);
        for _ in 0..10 {
            s.record(2);
        }
        assert_eq!(s.estimate(2), 10);
        // The 20th addition ages: 8 -> 4 (counters), doorkeeper gone.
        s.record(1);
        assert_eq!(s.estimate(1), 4);
        assert_eq!(s.estimate(2), 4);
        assert_eq!(s.additions, 10);
    }

    #[test]
    fn a_miss_is_admitted_only_over_a_rarer_victim() {
        let mut p = TinyLfu::new("tinylfu", Box::new(crate::policy::Lru::new()));
        p.init(&layout(1, 8));
        p.on_capacity(&CacheCapacity {
            budget_bytes: 2,
            experts: Some(2),
            min_experts: 2,
        });
        let a = AccessContext::NONE;
        for k in [0, 1] {
            p.on_access(k, false, &a);
            assert!(p.admit(k, None, &a), "room: always admitted");
            p.on_insert(k);
        }
        // 0 is hit twice more: its estimate beats a newcomer's.
        for _ in 0..2 {
            p.on_access(0, true, &a);
            p.on_hit(0);
        }
        assert_eq!(p.victim(&|_| true), Some(1));
        p.on_access(5, false, &a);
        assert!(!p.admit(5, Some(0), &a), "1 access vs 3");
        assert!(!p.admit(5, Some(1), &a), "a tie is not enough");
        p.on_access(5, false, &a);
        assert!(p.admit(5, Some(1), &a), "2 accesses vs 1");
        assert!(p.filters_admission());
        assert_eq!(p.name(), "tinylfu");
    }
}
