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

pub mod arc;
pub mod layer_lfu;
pub mod layer_lru;
pub mod lecar;
pub mod lfu;
pub mod lists;
pub mod lrfu;
pub mod lru;
pub mod s3fifo;
pub mod sieve;
pub mod two_q;

pub use arc::AdaptiveReplacement;
pub use layer_lfu::LayerLfu;
pub use layer_lru::LayerLru;
pub use lecar::LeCar;
pub use lfu::Lfu;
pub use lrfu::Lrfu;
pub use lru::Lru;
pub use s3fifo::S3Fifo;
pub use sieve::Sieve;
pub use two_q::TwoQ;

use crate::layout::ExpertLayout;

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

    /// The key to evict next among those `is_evictable` accepts.
    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32>;
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
