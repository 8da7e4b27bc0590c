//! Eviction policies for the expert cache.
//!
//! The cache (`cache.rs`) owns residency, pinning, byte accounting and counters; a policy only
//! orders the resident keys and names a victim. Keeping that interface this small is what lets
//! a new policy (LFU, hybrid, layer-aware) be one short file, tried in the simulator on recorded
//! traces and then run on device unchanged.
//!
//! **Adding a policy** (docs/policies.md, "Add a policy in one file"): write `my_policy.rs`
//! implementing `EvictionPolicy` with a `pub const INFO: PolicyInfo`, add `pub mod my_policy;`
//! and `my_policy::INFO` to `POLICIES` below. That is all: `--eviction`, the CSV preamble,
//! `bmoe-sim replay`/`sweep`, the fuzzer and the policy gates all read `POLICIES`.
//!
//! **Context and admission** (issue 36). Beyond the four events every policy handles, the
//! cache passes on what it knows of its own size (`on_capacity`), of where the decode step is
//! (`on_step_begin`, `on_layer_begin`) and of the routing behind each lookup (`on_access`, with
//! the key's router weights in an `AccessContext`), and asks a policy that says it
//! `filters_admission` whether to `admit` each demand miss at all: a miss it refuses is
//! *bypassed* — read and computed from a transient buffer, never inserted, nothing evicted for
//! it. Every one of those methods has a default that does nothing (and admits), so a policy
//! that ignores them behaves exactly as before they existed.

pub mod arc;
pub mod layer_lfu;
pub mod layer_lru;
pub mod lecar;
pub mod lfu;
pub mod lists;
pub mod lrfu;
pub mod lru;
pub mod next_use;
pub mod next_use_hazard;
pub mod s3fifo;
pub mod sieve;
pub mod tinylfu;
pub mod two_q;

pub use arc::AdaptiveReplacement;
pub use layer_lfu::LayerLfu;
pub use layer_lru::LayerLru;
pub use lecar::LeCar;
pub use lfu::Lfu;
pub use lrfu::Lrfu;
pub use lru::Lru;
pub use next_use::NextUse;
pub use next_use_hazard::NextUseHazard;
pub use s3fifo::S3Fifo;
pub use sieve::Sieve;
pub use tinylfu::TinyLfu;
pub use two_q::TwoQ;

use crate::layout::ExpertLayout;
use crate::records::Phase;

/// The cache's size as a policy may want it (`EvictionPolicy::on_capacity`): a policy that
/// sizes its state by the cache (TinyLFU's sample) needs it in entries, which the byte budget
/// only gives when every expert has one size.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CacheCapacity {
    /// The byte budget (never 0: a cache that is off tells its policy nothing).
    pub budget_bytes: u64,
    /// `budget_bytes / expert bytes` when every MoE layer's experts have one size; `None` when
    /// they differ.
    pub experts: Option<u32>,
    /// The fewest experts the budget holds whatever mix is resident: `budget_bytes` over the
    /// largest expert's bytes (equal to `experts` when that is known).
    pub min_experts: u32,
}

/// Where a decode step begins (`EvictionPolicy::on_step_begin`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct StepContext {
    /// The session turn (0 in a one-shot run).
    pub turn: u32,
    /// Prefill (the whole prompt in one step) or decode.
    pub phase: Phase,
    /// Rows of the step's batch: the prompt's tokens, 1 in a plain decode step.
    pub n_rows: u32,
}

/// What the current routing says about the key being looked up (`on_access`) or admitted
/// (`admit`): the rows of this step that route it at this layer, in row order.
///
/// Weights are the routing's final applied weights (after any top-k override and the
/// architecture's normalisation), as the route trace records them; `NaN` means the backend or
/// the trace did not know them. The sum widens each `f32` to `f64` and adds in row order, so
/// it is the same number wherever it is recomputed from the same weights.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct AccessContext {
    /// Rows routing this expert (0: read for `--load-all` only, or a caller with no routing).
    pub uses: u32,
    /// Its best router rank among them (0 = a row's top choice); `u16::MAX` with no uses.
    pub top_rank: u16,
    /// Σ of its weights over those rows (0 with no uses; `NaN` when any weight is unknown).
    pub weight_sum: f64,
    /// The largest of its weights (0 with no uses; `NaN` when any weight is unknown).
    pub weight_max: f32,
}

impl AccessContext {
    /// Nothing known of a routing: what the plain `ExpertCache::lookup` passes.
    pub const NONE: AccessContext = AccessContext {
        uses: 0,
        top_rank: u16::MAX,
        weight_sum: 0.0,
        weight_max: 0.0,
    };

    /// Count one more routing row (rows in order) at `rank` with `weight`.
    pub fn add_use(&mut self, rank: u16, weight: f32) {
        self.weight_max = if self.weight_max.is_nan() || weight.is_nan() {
            f32::NAN
        } else if self.uses == 0 {
            weight
        } else {
            self.weight_max.max(weight)
        };
        self.weight_sum += f64::from(weight);
        self.top_rank = self.top_rank.min(rank);
        self.uses += 1;
    }
}

/// Orders the cache's resident keys and picks what to evict.
///
/// Keys are the layout's dense indices (`ExpertLayout::key_index`, `layer_base + expert`).
/// The cache calls, for every key, `on_insert` when it becomes resident, `on_hit` on each hit,
/// and `on_remove` when it is evicted or discarded; it never calls `on_hit`/`on_remove` for a
/// key that is not resident. `victim` must return a resident key for which `is_evictable`
/// holds (pinned keys are not evictable), or `None` when there is none. Policies must be
/// deterministic: no randomness without an explicit seed, no `HashMap` iteration order.
pub trait EvictionPolicy: Send {
    /// Short name for reports and preambles (`lru`).
    fn name(&self) -> &'static str;

    /// Size internal state for `layout`; every key starts absent. Called once by the cache.
    fn init(&mut self, layout: &ExpertLayout);

    /// `index` became resident.
    fn on_insert(&mut self, index: u32);

    /// `index` was looked up and found resident.
    fn on_hit(&mut self, index: u32);

    /// `index` left the cache.
    fn on_remove(&mut self, index: u32);

    /// The key to evict next among those `is_evictable` accepts. A query: the cache may ask
    /// and not evict (a filtering policy's `admit` is told the would-be victim), so whatever a
    /// policy changes on eviction it changes in `on_remove` of the key it named.
    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32>;

    /// The cache's size: once after `init` and again when the budget changes. Default: ignored.
    fn on_capacity(&mut self, _capacity: &CacheCapacity) {}

    /// A decode step (prefill batch or decode token) begins, before any of its lookups.
    /// Default: ignored.
    fn on_step_begin(&mut self, _step: &StepContext) {}

    /// MoE layer `moe_layer` of the current step begins, before any lookup, admission or
    /// speculation of that layer. Default: ignored.
    fn on_layer_begin(&mut self, _moe_layer: u16) {}

    /// `index` was looked up with the routing `access`: called on every lookup, resident or
    /// not, before `on_hit` (for a resident key). Default: ignored.
    fn on_access(&mut self, _index: u32, _resident: bool, _access: &AccessContext) {}

    /// Whether this policy may refuse a demand miss (`admit`). Default: no — the cache then
    /// never asks, and admits every miss, as it always has.
    fn filters_admission(&self) -> bool {
        false
    }

    /// Asked (only when `filters_admission`) for each demand miss that fits beside the pinned
    /// entries, before anything is evicted for it: `victim` is the key `victim` names first
    /// (`None` when the miss fits without evicting). `false` bypasses the miss: it is read and
    /// computed from a transient buffer, never inserted, and nothing is evicted for it (no
    /// other event follows). `true`: evictions and `on_insert` follow as for any admission.
    /// Speculative reads (`--prefetch`) are admitted without asking. Default: admit.
    fn admit(&mut self, _index: u32, _victim: Option<u32>, _access: &AccessContext) -> bool {
        true
    }
}

/// A registered policy: its flag name, one line of `--help`, and a constructor.
#[derive(Copy, Clone, Debug)]
pub struct PolicyInfo {
    /// The `--eviction` value, the preamble's `eviction=`, and `EvictionPolicy::name`.
    pub name: &'static str,
    /// The victim rule in one line (`--help`).
    pub help: &'static str,
    /// A fresh policy (`init` sizes it).
    pub make: fn() -> Box<dyn EvictionPolicy>,
}

/// Every policy the engine and the simulator can run, in the order help and sweeps list them.
pub const POLICIES: &[PolicyInfo] = &[
    lru::INFO,
    lfu::INFO,
    lrfu::INFO,
    layer_lfu::INFO,
    layer_lru::INFO,
    two_q::INFO,
    lecar::INFO,
    arc::INFO,
    s3fifo::INFO,
    sieve::INFO,
    tinylfu::INFO,
    tinylfu::INFO_S3FIFO,
    next_use::INFO,
    next_use_hazard::INFO,
];

/// The policy called `name`, or `None` for an unknown name.
pub fn by_name(name: &str) -> Option<Box<dyn EvictionPolicy>> {
    POLICIES.iter().find(|p| p.name == name).map(|p| (p.make)())
}

/// Names `by_name` accepts, in registry order.
pub const POLICY_NAMES: [&str; POLICIES.len()] = {
    let mut names = [""; POLICIES.len()];
    let mut i = 0;
    while i < POLICIES.len() {
        names[i] = POLICIES[i].name;
        i += 1;
    }
    names
};

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::layout::{MoeLayerLayout, ProjExtent};

    /// `n_layers` MoE layers of `n_expert` one-byte experts.
    pub(crate) fn layout(n_layers: u32, n_expert: u32) -> ExpertLayout {
        let layers = (0..n_layers)
            .map(|l| MoeLayerLayout {
                model_layer: l,
                n_expert,
                projections: vec![ProjExtent {
                    shard: 0,
                    base_offset: u64::from(l * n_expert),
                    stride_bytes: 1,
                }],
                dense_bytes: 0,
            })
            .collect();
        ExpertLayout::new(n_layers, layers, 1).expect("test layout")
    }

    #[test]
    fn every_name_builds_a_policy_that_reports_it() {
        for name in POLICY_NAMES.iter() {
            let p = by_name(name).expect("known name");
            assert_eq!(p.name(), *name);
            let parsed: crate::config::EvictionPolicy = name.parse().expect("config parses it");
            assert_eq!(parsed.name(), *name);
        }
        assert!(by_name("fifo").is_none());
        let mut names = POLICY_NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), POLICIES.len(), "names are unique");
        assert!("fifo".parse::<crate::config::EvictionPolicy>().is_err());
    }
}
