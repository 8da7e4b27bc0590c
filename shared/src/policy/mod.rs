//! Eviction policies for the expert cache.
//!
//! The cache (`cache.rs`) owns residency, pinning, byte accounting and counters; a policy only
//! orders the resident keys and names a victim. Keeping that interface this small is what lets
//! a new policy (LFU, hybrid, layer-aware) be one short file, tried in the simulator on recorded
//! traces and then run on device unchanged.

pub mod lru;

pub use lru::Lru;

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

/// The policy called `name`, or `None` for an unknown name.
pub fn by_name(name: &str) -> Option<Box<dyn EvictionPolicy>> {
    match name {
        "lru" => Some(Box::new(Lru::new())),
        _ => None,
    }
}

/// Names `by_name` accepts.
pub const POLICY_NAMES: &[&str] = &["lru"];
