//! `next-use-hazard`: `next-use` with the next chance's probability learned from the router's
//! confidence in each expert's last routing and the layer visits it has missed since (this
//! project's own policy, issue 36).
//!
//! `next-use` (`next_use.rs`) evicts the largest expected distance to the next use over the MoE
//! layer cycle, `τ + n·(1 − p)/p` layers: every chance of an expert, the next one included, is
//! taken with its decayed routed-per-visit rate `p`. But routing is sticky and its stickiness
//! fades: an expert routed at the last visit of its layer — strongly, by the router's weight —
//! is routed again at the next visit far more often than one routed with a small weight, or
//! several tokens ago (Mixtral: 54 % after a weight ≥ 0.9, 32 % under 0.1). So the next chance
//! gets its own probability `h`, read off a **hazard table** learned online from every decode
//! visit: `h(b, g)` = the share of visits at which an expert whose last routing fell in
//! confidence bucket `b` and which has missed `g` visits of its layer since was routed. The
//! chances after it keep the rate `p`:
//!
//! `E = τ + (1 − h)·n/p` layers (with `h = p` this is `next-use`'s expectation).
//!
//! - **Bucket** `b` of a routing: its largest applied router weight `w` (`AccessContext::
//!   weight_max`) as `min(3, ⌊4w⌋)`; a routing whose weight is unknown (`NaN`, the DeepSeek
//!   trace; or no routing) goes to bucket 4, so a model without weights learns the hazard by
//!   missed visits alone.
//! - **Gap** `g`: visits of its layer since it was last routed, 0 when routed at the last one,
//!   saturating at `MAX_GAP`.
//! - **Table**: per `(b, g)` the visits seen and the visits routed, counted when a decode step's
//!   layer visit ends (the next `on_layer_begin`) for every expert of that layer routed before;
//!   a prefill visit (one union over the prompt's rows) updates the states, not the table.
//!   `h = ⌊(4·routed + 1)·Q / (4·(seen + 1))⌋`, a quarter of a visit of prior.
//!
//! Integer arithmetic throughout (`Q` = 2^16 is 1), so the simulator, the engine and
//! `scripts/sim-check.py` take the same decisions: `E = τ·Q + n·⌊(Q − h)·Q / p⌋` (`p = 0`, never
//! routed: farthest of all), ties to the expert looked up least recently, then the lower key
//! index. `p`, `τ` and the ties are exactly `next-use`'s.
//!
//! Cross-layer co-activation was tried for the layers still ahead in the current token
//! (`h` blended with the learned `P(e′ at l′ | the current layer's routing)`) and added nothing
//! on top of the table (docs/policies.md, "next-use-hazard").

use super::next_use::{Q, SHIFT};
use super::{AccessContext, EvictionPolicy, StepContext};
use crate::layout::ExpertLayout;
use crate::records::Phase;

/// Missed visits are counted up to this; more count as this many.
pub const MAX_GAP: u8 = 8;
/// Confidence buckets: four of router weight, one for an unknown weight.
pub const BUCKETS: usize = 5;
const GAPS: usize = MAX_GAP as usize + 1;
/// `gap` of a key never routed.
const NEVER: u8 = u8::MAX;
const NIL: u32 = u32::MAX;

/// The confidence bucket of a routing whose largest applied weight is `weight_max`.
pub fn bucket(access: &AccessContext) -> u8 {
    let w = f64::from(access.weight_max);
    if access.uses == 0 || w.is_nan() {
        4
    } else if w <= 0.0 {
        0
    } else {
        ((w * 4.0) as u64).min(3) as u8
    }
}

/// The `next-use-hazard` policy.
#[derive(Clone, Debug, Default)]
pub struct NextUseHazard {
    n_layers: u32,
    /// Per MoE layer: its first key index and expert count.
    layer_base: Vec<u32>,
    layer_experts: Vec<u32>,
    /// Per key: its MoE layer.
    key_layer: Vec<u16>,
    /// Per key: routed-per-visit estimate in `Q` fixed point (≤ `Q`), as `next-use`'s.
    p: Vec<u32>,
    /// Per key: the tick of its last lookup (0: never).
    last: Vec<u64>,
    tick: u64,
    /// Per key: visits of its layer missed since its last routing (`NEVER`: not routed yet).
    gap: Vec<u8>,
    /// Per key: the confidence bucket of its last routing.
    bucket: Vec<u8>,
    /// Hazard table: visits seen and visits routed, per (bucket, gap).
    seen: [[u64; GAPS]; BUCKETS],
    routed: [[u64; GAPS]; BUCKETS],
    /// The layer visit being observed (`NIL`: none, or a prefill visit), each of its experts'
    /// (bucket, gap) before the visit (gap `NEVER`: not counted) and whether it was routed.
    open_layer: u32,
    open_state: Vec<(u8, u8)>,
    open_routed: Vec<bool>,
    /// Whether the current step is a decode step (the table learns only from those).
    decode: bool,
    /// The current MoE layer (0 before the first `on_layer_begin`).
    current: u32,
    resident: super::next_use::ResidentSet,
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "next-use-hazard",
    help: "next-use with the next chance's probability learned online from the router weight of each expert's last routing and the layer visits it has missed since",
    make: || Box::new(NextUseHazard::new()),
};

impl NextUseHazard {
    /// An empty policy; `init` sizes it.
    pub fn new() -> Self {
        NextUseHazard {
            open_layer: NIL,
            decode: true,
            ..NextUseHazard::default()
        }
    }

    /// The routed-per-visit estimate of `index` (`Q` = 1).
    pub fn rate(&self, index: u32) -> u32 {
        self.p.get(index as usize).copied().unwrap_or(0)
    }

    /// The learned probability (`Q` = 1) that a key in `bucket` which has missed `gap` visits
    /// is routed at its layer's next visit.
    pub fn hazard(&self, bucket: u8, gap: u8) -> u64 {
        let b = usize::from(bucket).min(BUCKETS - 1);
        let g = usize::from(gap.min(MAX_GAP));
        (4 * self.routed[b][g] + 1) * Q / (4 * (self.seen[b][g] + 1))
    }

    /// The expected distance to the next use of `index`, in layers × `Q`.
    pub fn expected_distance(&self, index: u32) -> u64 {
        let i = index as usize;
        let (Some(&l), Some(&p), Some(&gap), Some(&b)) = (
            self.key_layer.get(i),
            self.p.get(i),
            self.gap.get(i),
            self.bucket.get(i),
        ) else {
            return u64::MAX;
        };
        if p == 0 || gap == NEVER {
            return u64::MAX;
        }
        let n = u64::from(self.n_layers.max(1));
        let (l, c) = (u64::from(l), u64::from(self.current));
        let tau = (l + n - c % n - 1) % n + 1;
        let h = self.hazard(b, gap).min(Q);
        tau * Q + n * ((Q - h) * Q / u64::from(p))
    }

    /// Count the open visit's outcomes into the table and close it.
    fn close_visit(&mut self) {
        if self.open_layer == NIL {
            return;
        }
        for (&(b, g), &routed) in self.open_state.iter().zip(&self.open_routed) {
            if g != NEVER {
                let (b, g) = (usize::from(b), usize::from(g));
                self.seen[b][g] += 1;
                self.routed[b][g] += u64::from(routed);
            }
        }
        self.open_layer = NIL;
    }
}

impl EvictionPolicy for NextUseHazard {
    fn name(&self) -> &'static str {
        "next-use-hazard"
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
        self.gap = vec![NEVER; n];
        self.bucket = vec![0; n];
        self.seen = [[0; GAPS]; BUCKETS];
        self.routed = [[0; GAPS]; BUCKETS];
        self.open_layer = NIL;
        self.open_state.clear();
        self.open_routed.clear();
        self.decode = true;
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

    fn on_step_begin(&mut self, step: &StepContext) {
        self.close_visit();
        self.decode = step.phase == Phase::Decode;
    }

    fn on_layer_begin(&mut self, moe_layer: u16) {
        self.close_visit();
        let m = moe_layer as usize;
        let (Some(&base), Some(&count)) = (self.layer_base.get(m), self.layer_experts.get(m))
        else {
            return;
        };
        self.current = u32::from(moe_layer);
        let keys = base as usize..(base + count) as usize;
        for p in &mut self.p[keys.clone()] {
            *p -= *p >> SHIFT;
        }
        if self.decode {
            self.open_layer = u32::from(moe_layer);
            self.open_state.clear();
            self.open_state.extend(
                self.bucket[keys.clone()]
                    .iter()
                    .zip(&self.gap[keys.clone()])
                    .map(|(&b, &g)| (b, g)),
            );
            self.open_routed.clear();
            self.open_routed.resize(count as usize, false);
        }
        // Every expert misses this visit until a lookup says otherwise.
        for g in &mut self.gap[keys] {
            if *g != NEVER {
                *g = (*g + 1).min(MAX_GAP);
            }
        }
    }

    fn on_access(&mut self, index: u32, _resident: bool, access: &AccessContext) {
        let i = index as usize;
        if i >= self.p.len() {
            return;
        }
        self.p[i] = (u64::from(self.p[i]) + (Q >> SHIFT)).min(Q) as u32;
        self.tick += 1;
        self.last[i] = self.tick;
        self.gap[i] = 0;
        self.bucket[i] = bucket(access);
        let l = u32::from(self.key_layer[i]);
        if l == self.open_layer {
            let e = (index - self.layer_base[l as usize]) as usize;
            if let Some(r) = self.open_routed.get_mut(e) {
                *r = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    fn routed(weight: f32) -> AccessContext {
        let mut a = AccessContext::NONE;
        a.add_use(0, weight);
        a
    }

    fn decode() -> StepContext {
        StepContext {
            turn: 0,
            phase: Phase::Decode,
            n_rows: 1,
        }
    }

    #[test]
    fn buckets_read_the_weight_and_fall_back_when_it_is_unknown() {
        assert_eq!(bucket(&routed(0.1)), 0);
        assert_eq!(bucket(&routed(0.25)), 1);
        assert_eq!(bucket(&routed(0.74)), 2);
        assert_eq!(bucket(&routed(0.75)), 3);
        assert_eq!(bucket(&routed(1.5)), 3);
        assert_eq!(bucket(&routed(-1.0)), 0);
        assert_eq!(bucket(&routed(f32::NAN)), 4);
        assert_eq!(bucket(&AccessContext::NONE), 4);
    }

    #[test]
    fn the_table_learns_that_a_confident_routing_comes_back() {
        // 2 MoE layers of 4 experts; keys are layer * 4 + expert. Layer 0 routes expert 0
        // (weight 0.9) at every token and expert 1 (weight 0.1) at every other token.
        let mut p = NextUseHazard::new();
        p.init(&layout(2, 4));
        for t in 0..40u32 {
            p.on_step_begin(&decode());
            p.on_layer_begin(0);
            p.on_access(0, false, &routed(0.9));
            if t % 2 == 0 {
                p.on_access(1, false, &routed(0.1));
            }
            p.on_layer_begin(1);
            p.on_access(4, false, &routed(f32::NAN));
        }
        // Bucket 3 routed at the last visit: always back; bucket 0: never right after, always
        // after missing one; unknown weights (bucket 4): learned by the gap alone.
        assert!(p.hazard(3, 0) > Q * 9 / 10, "{}", p.hazard(3, 0));
        assert!(p.hazard(0, 0) < Q / 10, "{}", p.hazard(0, 0));
        assert!(p.hazard(0, 1) > Q * 9 / 10, "{}", p.hazard(0, 1));
        assert!(p.hazard(4, 0) > Q * 9 / 10, "{}", p.hazard(4, 0));
        // Nothing learned yet anywhere else: the prior's quarter.
        assert_eq!(p.hazard(2, 5), Q / 4);
        for k in [0, 1, 4] {
            p.on_insert(k);
        }
        // The next token's layer 0 begins: layer 1's expert is 1 layer away and comes back
        // for sure; layer 0's own are a cycle away, so farther.
        p.on_step_begin(&decode());
        p.on_layer_begin(0);
        assert!(p.expected_distance(4) < p.expected_distance(0));
        // A never-routed expert is the farthest of all.
        p.on_insert(2);
        assert_eq!(p.expected_distance(2), u64::MAX);
        assert_eq!(p.victim(&|_| true), Some(2));
        p.on_remove(2);
        assert_ne!(p.victim(&|_| true), Some(2));
        assert_eq!(p.victim(&|_| false), None);
    }

    #[test]
    fn a_confident_routing_outlives_an_equally_frequent_weak_one() {
        // One layer of 4 experts. Experts 2 (weight 0.9, every visit) and 3 (weight 0.1, every
        // other visit) teach the table that a confident routing repeats and a weak one does
        // not. Then experts 0 (0.9) and 1 (0.1) are routed once, 0 first: the same rate, so
        // next-use evicts the one looked up least recently, 0; the table keeps it and evicts 1.
        let mut p = NextUseHazard::new();
        let mut plain = super::super::NextUse::new();
        p.init(&layout(1, 4));
        plain.init(&layout(1, 4));
        for t in 0..20 {
            p.on_step_begin(&decode());
            p.on_layer_begin(0);
            plain.on_layer_begin(0);
            let mut route = |k: u32, w: f32| {
                p.on_access(k, false, &routed(w));
                plain.on_access(k, false, &routed(w));
            };
            if t < 19 {
                route(2, 0.9);
                if t % 2 == 0 {
                    route(3, 0.1);
                }
            } else {
                route(0, 0.9);
                route(1, 0.1);
            }
        }
        for k in [0, 1] {
            p.on_insert(k);
            plain.on_insert(k);
        }
        assert_eq!(p.rate(0), p.rate(1));
        assert_eq!(plain.victim(&|_| true), Some(0));
        assert_eq!(p.victim(&|_| true), Some(1));
    }

    #[test]
    fn prefill_visits_do_not_teach_the_table_and_bad_input_is_ignored() {
        let mut p = NextUseHazard::new();
        p.init(&layout(1, 2));
        let prefill = StepContext {
            turn: 0,
            phase: Phase::Prefill,
            n_rows: 8,
        };
        for _ in 0..4 {
            p.on_step_begin(&prefill);
            p.on_layer_begin(0);
            p.on_access(0, false, &routed(0.5));
        }
        p.on_step_begin(&decode());
        assert_eq!(p.hazard(2, 0), Q / 4, "nothing learned in prefill");
        // Out-of-range keys and layers change nothing and do not panic.
        p.on_access(99, false, &routed(0.5));
        p.on_insert(99);
        p.on_remove(99);
        p.on_layer_begin(9);
        assert_eq!(p.expected_distance(99), u64::MAX);
        assert_eq!(p.victim(&|_| true), None);
    }
}
