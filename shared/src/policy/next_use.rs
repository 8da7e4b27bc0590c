//! `next-use`: evict the expert whose next use is expected farthest away, reading the distance
//! off the MoE layer cycle (this project's own policy, issue 36).
//!
//! A decode step visits the MoE layers in a fixed order, once each, and an expert can only be
//! used when its own layer comes round. So at MoE layer `c` of `n`, expert `(l, e)` gets its
//! next chance `τ = ((l − c − 1) mod n) + 1` layers from now (the next layer is 1 away, the
//! current layer's own experts a full cycle, `n`), and each chance is taken with some
//! probability `p`: the expected distance to its next use is `τ + n·(1 − p)/p` layers (a
//! geometric number of missed cycles). The victim is the resident, unpinned expert with the
//! largest such distance — Belady's rule with the future replaced by that expectation.
//!
//! `p` is a per-expert estimate of "routed when its layer comes round", an exponentially
//! decayed average kept in fixed point (`Q` = 2^16 is 1): when layer `l` begins, each of its
//! experts' `p` loses `p >> SHIFT` (a visit), and each expert the layer's routing looks up gains
//! `Q >> SHIFT` (a visit where it was routed). `SHIFT` = 2: the last visit weighs 1/4, the
//! memory is a few tokens. Integer arithmetic throughout, so the simulator, the engine and
//! `scripts/sim-check.py` take the same decisions:
//!
//! `E = τ·Q + n·⌊(Q − p)·Q / p⌋` (`p = 0`: farthest of all), ties to the expert looked up least
//! recently, then to the lower key index.
//!
//! What LRU misses and this sees: right after layer `c` ran, LRU's oldest entries are the
//! experts of layer `c + 1` (used one token ago) — exactly what is about to be needed, the
//! cycle cliff. Here those are 1 layer away and the current layer's unrouted experts a whole
//! cycle, so the cliff is gone; and among experts of one layer the rarely routed go first.
//!
//! Router weights were tried as the routed-visit increment (the weight's share of `1/k`
//! instead of 1) and cross-layer co-activation as a sharper `p` for the next layer; neither
//! beat the plain count on the shipped traces (docs/policies.md, "next-use"), so the rule
//! above uses neither.

use super::{AccessContext, EvictionPolicy};
use crate::layout::ExpertLayout;

/// 1.0 in the fixed point of `p`.
pub const Q: u64 = 1 << 16;
/// `p` moves `1/2^SHIFT` of the way towards each visit's outcome.
pub const SHIFT: u32 = 2;

const NIL: u32 = u32::MAX;

/// The `next-use` policy.
#[derive(Clone, Debug, Default)]
pub struct NextUse {
    n_layers: u32,
    /// Per MoE layer: its first key index and expert count.
    layer_base: Vec<u32>,
    layer_experts: Vec<u32>,
    /// Per key: its MoE layer.
    key_layer: Vec<u16>,
    /// Per key: routed-per-visit estimate in `Q` fixed point (≤ `Q`).
    p: Vec<u32>,
    /// Per key: the tick of its last lookup (0: never).
    last: Vec<u64>,
    tick: u64,
    /// The current MoE layer (0 before the first `on_layer_begin`).
    current: u32,
    resident: ResidentSet,
}

/// The resident keys, unordered (a scanning victim rule breaks every tie itself), with O(1)
/// insert and remove: what `next-use` and `next-use-hazard` scan at each eviction.
#[derive(Clone, Debug, Default)]
pub(crate) struct ResidentSet {
    keys: Vec<u32>,
    /// Per key: its place in `keys`, or `NIL`.
    pos: Vec<u32>,
}

impl ResidentSet {
    /// Empty, for `n_keys` keys.
    pub(crate) fn init(&mut self, n_keys: usize) {
        self.keys.clear();
        self.pos = vec![NIL; n_keys];
    }

    /// Add `index` (nothing for a resident or out-of-range key).
    pub(crate) fn insert(&mut self, index: u32) {
        if let Some(p) = self.pos.get_mut(index as usize) {
            if *p == NIL {
                *p = self.keys.len() as u32;
                self.keys.push(index);
            }
        }
    }

    /// Remove `index` (nothing for an absent or out-of-range key).
    pub(crate) fn remove(&mut self, index: u32) {
        let Some(&at) = self.pos.get(index as usize) else {
            return;
        };
        if at == NIL {
            return;
        }
        self.keys.swap_remove(at as usize);
        if let Some(&moved) = self.keys.get(at as usize) {
            self.pos[moved as usize] = at;
        }
        self.pos[index as usize] = NIL;
    }

    /// The resident keys, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.keys.iter().copied()
    }
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "next-use",
    help: "the expert whose expected next use is farthest: its layer's distance round the layer cycle plus the cycles its decayed routing rate predicts",
    make: || Box::new(NextUse::new()),
};

impl NextUse {
    /// An empty policy; `init` sizes it.
    pub fn new() -> Self {
        NextUse::default()
    }

    /// The routed-per-visit estimate of `index` (`Q` = 1), for tests and reports.
    pub fn rate(&self, index: u32) -> u32 {
        self.p.get(index as usize).copied().unwrap_or(0)
    }

    /// The expected distance to the next use of `index`, in layers × `Q`.
    pub fn expected_distance(&self, index: u32) -> u64 {
        let i = index as usize;
        let (Some(&l), Some(&p)) = (self.key_layer.get(i), self.p.get(i)) else {
            return u64::MAX;
        };
        if p == 0 {
            return u64::MAX;
        }
        let n = u64::from(self.n_layers.max(1));
        let (l, c) = (u64::from(l), u64::from(self.current));
        let tau = (l + n - c % n - 1) % n + 1;
        let p = u64::from(p);
        tau * Q + n * ((Q - p.min(Q)) * Q / p)
    }
}

impl EvictionPolicy for NextUse {
    fn name(&self) -> &'static str {
        "next-use"
    }

    fn init(&mut self, layout: &ExpertLayout) {
        let n = layout.n_keys() as usize;
        self.n_layers = u32::from(layout.n_moe_layers());
        self.layer_base.clear();
        self.layer_experts.clear();
        self.key_layer.clear();
        for (m, l) in layout.layers().iter().enumerate() {
            self.layer_base.push(self.key_layer.len() as u32);
            self.layer_experts.push(l.n_expert);
            self.key_layer
                .extend(std::iter::repeat_n(m as u16, l.n_expert as usize));
        }
        self.p = vec![0; n];
        self.last = vec![0; n];
        self.tick = 0;
        self.current = 0;
        self.resident.init(n);
    }

    fn on_insert(&mut self, index: u32) {
        self.resident.insert(index);
    }

    fn on_hit(&mut self, _index: u32) {}

    fn on_remove(&mut self, index: u32) {
        self.resident.remove(index);
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        // Largest expected distance; ties to the least recently looked up, then the lower index.
        let rank = |i: u32| {
            (
                self.expected_distance(i),
                std::cmp::Reverse(self.last[i as usize]),
                std::cmp::Reverse(i),
            )
        };
        self.resident
            .iter()
            .filter(|&i| is_evictable(i))
            .max_by_key(|&i| rank(i))
    }

    fn on_layer_begin(&mut self, moe_layer: u16) {
        let m = moe_layer as usize;
        let (Some(&base), Some(&count)) = (self.layer_base.get(m), self.layer_experts.get(m))
        else {
            return;
        };
        self.current = u32::from(moe_layer);
        for p in &mut self.p[base as usize..(base + count) as usize] {
            *p -= *p >> SHIFT;
        }
    }

    fn on_access(&mut self, index: u32, _resident: bool, _access: &AccessContext) {
        let i = index as usize;
        if i >= self.p.len() {
            return;
        }
        self.p[i] = (u64::from(self.p[i]) + (Q >> SHIFT)).min(Q) as u32;
        self.tick += 1;
        self.last[i] = self.tick;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn the_next_layer_is_kept_and_the_current_layers_unrouted_go_first() {
        // 4 MoE layers of 4 experts; keys are layer * 4 + expert.
        let mut p = NextUse::new();
        p.init(&layout(4, 4));
        let a = AccessContext::NONE;
        // One token: every layer routes experts 0 and 1.
        for l in 0..4u16 {
            p.on_layer_begin(l);
            for e in 0..2 {
                let k = u32::from(l) * 4 + e;
                p.on_access(k, false, &a);
                p.on_insert(k);
            }
        }
        assert_eq!(p.rate(0), (Q >> SHIFT) as u32);
        // Layer 0 of the next token begins: layer 1's experts are 1 layer away, layer 0's own a
        // cycle (4), layer 3's 3. Same rate everywhere: the farthest is layer 0's.
        p.on_layer_begin(0);
        assert!(p.expected_distance(4) < p.expected_distance(12));
        assert!(p.expected_distance(12) < p.expected_distance(0));
        // Layer 0's visit decayed its experts' rates: they are farther still. Of the two, the
        // one looked up least recently (0 before 1) goes first.
        assert_eq!(p.victim(&|_| true), Some(0));
        assert_eq!(p.victim(&|i| i != 0), Some(1));
        // An expert never routed is the farthest of all.
        p.on_insert(15);
        assert_eq!(p.expected_distance(15), u64::MAX);
        assert_eq!(p.victim(&|_| true), Some(15));
        p.on_remove(15);
        p.on_remove(0);
        p.on_remove(0);
        assert_eq!(p.victim(&|_| true), Some(1));
        assert_eq!(p.victim(&|_| false), None);
        // Out-of-range keys and layers are ignored.
        p.on_access(99, false, &a);
        p.on_insert(99);
        p.on_remove(99);
        p.on_layer_begin(9);
        assert_eq!(p.victim(&|_| true), Some(1));
    }

    #[test]
    fn the_rate_stays_within_one() {
        let mut p = NextUse::new();
        p.init(&layout(1, 2));
        for _ in 0..100 {
            p.on_layer_begin(0);
            p.on_access(0, true, &AccessContext::NONE);
        }
        assert!(p.rate(0) <= Q as u32);
        assert!(p.rate(0) > (Q as u32) * 9 / 10);
        // Routed at every visit: one layer away... a full cycle (n = 1) plus a sliver.
        assert!(p.expected_distance(0) < 2 * Q);
    }
}
