//! The expert cache: which (layer, expert) pairs are resident, within a byte budget.
//!
//! One implementation serves the engine and the simulator, which is what makes a replayed
//! trace reproduce the engine's hits, misses, evictions and bytes exactly. The hot path is
//! dense arrays indexed by the layout's key index (`layer_base + expert`) and a policy with an
//! intrusive list: no hashing, no allocation after construction.

use crate::layout::{ExpertKey, ExpertLayout};
use crate::policy::{AccessContext, CacheCapacity, EvictionPolicy, StepContext};
pub use crate::vocab::CacheError;

/// Cumulative cache counters. `hits + misses` = lookups.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Lookups that found the expert resident.
    pub hits: u64,
    /// Lookups that did not (each is read exactly once by the streamer).
    pub misses: u64,
    /// Experts evicted to make room.
    pub evictions: u64,
    /// Misses on an expert the cache had held before (churn: bytes read twice).
    pub rereads: u64,
    /// Experts admitted.
    pub inserts: u64,
    /// Misses the policy refused to admit (`EvictionPolicy::admit`): read and computed from a
    /// transient buffer, never inserted. Always 0 for a policy that does not filter admission.
    pub bypasses: u64,
}

impl CacheCounters {
    /// `self - earlier`, field by field (saturating).
    pub fn since(self, earlier: CacheCounters) -> CacheCounters {
        CacheCounters {
            hits: self.hits.saturating_sub(earlier.hits),
            misses: self.misses.saturating_sub(earlier.misses),
            evictions: self.evictions.saturating_sub(earlier.evictions),
            rereads: self.rereads.saturating_sub(earlier.rereads),
            inserts: self.inserts.saturating_sub(earlier.inserts),
            bypasses: self.bypasses.saturating_sub(earlier.bypasses),
        }
    }
}

/// Outcome of `ExpertCache::lookup`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Resident; now pinned (one more pin).
    Hit,
    /// Not resident. `reread` when the cache had held it before.
    Miss { reread: bool },
}

/// Outcome of `ExpertCache::admit` and `ExpertCache::admit_with`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Resident and pinned; the caller must fill it with a read before anyone computes on it.
    Admitted,
    /// The policy refused it (`admit_with` only): not resident, not pinned, nothing evicted.
    /// The caller reads it into a transient buffer of its own, computes from there, and
    /// forgets it.
    Bypassed,
    /// Even after evicting every unpinned entry it would not fit: the pinned entries fill the
    /// budget. Nothing was evicted. The caller finishes and unpins its current work first.
    NoRoom,
}

const RESIDENT: u8 = 1;
const EVER_HELD: u8 = 2;

/// The expert cache.
///
/// Guarantees (tested with proptest in `tests/core.rs`):
/// - **never over budget**: `resident_bytes() <= budget_bytes()` after every call;
/// - **a pinned entry is never evicted** (nor discarded by a resize);
/// - counters: `hits + misses` equals the number of `lookup` calls; `inserts` the number of
///   successful `admit` calls; `bypasses` the number of misses the policy refused
///   (`admit_with`); `evictions` the number of entries removed to make room.
///
/// **Admission rule.** For one layer's set of routed experts, the streamer calls `lookup` on
/// every one of them *before* it `admit`s any miss: each hit is found and pinned first, so a
/// routing's misses can never evict that same routing's hits (which would turn a hit into a
/// second read in the same step). A miss that does not fit beside the pinned entries gets
/// `NoRoom` without evicting anything; the streamer then computes and unpins what it holds and
/// admits the rest in a further wave (only a prefill batch whose union of experts exceeds the
/// budget can need this; a budget at or above `layer_demand` never needs it in decode).
/// A policy that filters admission is asked for each miss that fits beside the pinned entries,
/// before anything is evicted for it, and may bypass it (`Admission::Bypassed`): the miss is
/// still read and computed, from a transient buffer, and leaves the cache as it was.
///
/// **Floor.** A budget greater than 0 but below `ExpertLayout::layer_demand_bytes(k)` is
/// refused: the cache could not stage one token's routed experts of the widest layer. Budget 0
/// means the cache is off: `lookup` always misses (and counts it), `admit` is refused, and the
/// streamer reads every routed expert into `Staging` slots.
pub struct ExpertCache {
    budget_bytes: u64,
    k: u16,
    layer_demand_bytes: u64,
    // Invariant: resident_bytes = Σ entry bytes over RESIDENT keys <= budget_bytes.
    resident_bytes: u64,
    // Invariant: pinned_bytes = Σ entry bytes over RESIDENT keys with pins > 0.
    pinned_bytes: u64,
    resident_count: u32,
    // Per MoE layer.
    key_base: Vec<u32>,
    n_expert: Vec<u32>,
    entry_bytes: Vec<u64>,
    // Per dense key index.
    key_layer: Vec<u16>,
    flags: Vec<u8>,
    // Invariant: pins[i] > 0 only if RESIDENT.
    pins: Vec<u32>,
    policy: Box<dyn EvictionPolicy>,
    /// `policy.filters_admission()`, asked once: the hot path of a policy that does not filter
    /// never asks for a victim it will not evict.
    filters: bool,
    counters: CacheCounters,
}

/// The capacity `budget_bytes` gives over experts of `entry_bytes` (one per MoE layer;
/// `EvictionPolicy::on_capacity`).
fn capacity(entry_bytes: &[u64], budget_bytes: u64) -> CacheCapacity {
    let (lo, hi) = entry_bytes
        .iter()
        .fold((u64::MAX, 0u64), |(lo, hi), &b| (lo.min(b), hi.max(b)));
    let count = |bytes: u64| u32::try_from(budget_bytes / bytes.max(1)).unwrap_or(u32::MAX);
    CacheCapacity {
        budget_bytes,
        experts: (lo == hi).then(|| count(hi)),
        min_experts: count(hi),
    }
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("budget_bytes", &self.budget_bytes)
            .field("resident_bytes", &self.resident_bytes)
            .field("pinned_bytes", &self.pinned_bytes)
            .field("policy", &self.policy.name())
            .field("counters", &self.counters)
            .finish()
    }
}

impl ExpertCache {
    /// A cache over `layout` holding at most `budget_bytes` (0 = off), sized for an applied
    /// top-k of `k` (the `--n-expert-used` override, or the model's), evicting by `policy`.
    pub fn new(
        layout: &ExpertLayout,
        budget_bytes: u64,
        k: u16,
        mut policy: Box<dyn EvictionPolicy>,
    ) -> Result<Self, CacheError> {
        let layer_demand_bytes = layout.layer_demand_bytes(k.max(1));
        if budget_bytes > 0 && budget_bytes < layer_demand_bytes {
            return Err(CacheError::BudgetBelowLayerDemand {
                budget_bytes,
                layer_demand_bytes,
                k,
            });
        }
        let n_keys = layout.n_keys() as usize;
        let mut key_base = Vec::with_capacity(layout.layers().len());
        let mut key_layer = Vec::with_capacity(n_keys);
        for (m, l) in layout.layers().iter().enumerate() {
            key_base.push(key_layer.len() as u32);
            key_layer.extend(std::iter::repeat_n(m as u16, l.n_expert as usize));
        }
        policy.init(layout);
        let entry_bytes: Vec<u64> = (0..layout.n_moe_layers())
            .map(|m| layout.expert_bytes(m))
            .collect();
        if budget_bytes > 0 {
            policy.on_capacity(&capacity(&entry_bytes, budget_bytes));
        }
        Ok(ExpertCache {
            budget_bytes,
            k,
            layer_demand_bytes,
            resident_bytes: 0,
            pinned_bytes: 0,
            resident_count: 0,
            key_base,
            n_expert: layout.layers().iter().map(|l| l.n_expert).collect(),
            entry_bytes,
            filters: policy.filters_admission(),
            key_layer,
            flags: vec![0; n_keys],
            pins: vec![0; n_keys],
            policy,
            counters: CacheCounters::default(),
        })
    }

    /// True when the budget is 0 (every routed expert streams every step).
    pub fn is_off(&self) -> bool {
        self.budget_bytes == 0
    }

    /// The budget in bytes (0 = off).
    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// The top-k the budget was checked against.
    pub fn k(&self) -> u16 {
        self.k
    }

    /// The floor the budget was checked against (`layer_demand_bytes(k)`).
    pub fn layer_demand_bytes(&self) -> u64 {
        self.layer_demand_bytes
    }

    /// Bytes of all resident entries.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    /// Bytes of resident entries that are pinned.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes
    }

    /// Keys the cache was built for (the layout's `n_keys`).
    pub fn n_keys(&self) -> u32 {
        self.flags.len() as u32
    }

    /// Resident entries.
    pub fn resident_count(&self) -> u32 {
        self.resident_count
    }

    /// Cumulative counters.
    pub fn counters(&self) -> CacheCounters {
        self.counters
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Whether the policy may bypass a miss (`EvictionPolicy::filters_admission`): what makes
    /// the reports carry `bypasses`.
    pub fn filters_admission(&self) -> bool {
        self.filters
    }

    /// A decode step begins (`EvictionPolicy::on_step_begin`); nothing when the cache is off.
    pub fn begin_step(&mut self, step: &StepContext) {
        if !self.is_off() {
            self.policy.on_step_begin(step);
        }
    }

    /// MoE layer `moe_layer` of the step begins, before any lookup of it
    /// (`EvictionPolicy::on_layer_begin`); nothing when the cache is off.
    pub fn begin_layer(&mut self, moe_layer: u16) {
        if !self.is_off() {
            self.policy.on_layer_begin(moe_layer);
        }
    }

    #[inline]
    fn index(&self, key: ExpertKey) -> Result<usize, CacheError> {
        match self.n_expert.get(key.layer as usize) {
            Some(&n) if u32::from(key.expert) < n => {
                Ok((self.key_base[key.layer as usize] + u32::from(key.expert)) as usize)
            }
            _ => Err(CacheError::UnknownKey {
                layer: key.layer,
                expert: key.expert,
            }),
        }
    }

    fn key_at(&self, index: usize) -> ExpertKey {
        let layer = self.key_layer[index];
        ExpertKey {
            layer,
            expert: (index as u32 - self.key_base[layer as usize]) as u16,
        }
    }

    /// Whether `key` is resident (a hook's residency question; changes nothing).
    #[inline]
    pub fn contains(&self, key: ExpertKey) -> bool {
        self.index(key).is_ok_and(|i| self.flags[i] & RESIDENT != 0)
    }

    /// Whether `key` is resident and pinned.
    pub fn is_pinned(&self, key: ExpertKey) -> bool {
        self.index(key).is_ok_and(|i| self.pins[i] > 0)
    }

    /// Look `key` up: a hit pins it and tells the policy; a miss is counted (and counted as a
    /// re-read when the cache had held `key` before). See the admission rule above.
    #[inline]
    pub fn lookup(&mut self, key: ExpertKey) -> Result<Lookup, CacheError> {
        self.lookup_with(key, &AccessContext::NONE)
    }

    /// `lookup`, telling the policy what the current routing says of `key`
    /// (`EvictionPolicy::on_access`, before `on_hit`). The streamer's lookup.
    #[inline]
    pub fn lookup_with(
        &mut self,
        key: ExpertKey,
        access: &AccessContext,
    ) -> Result<Lookup, CacheError> {
        let i = self.index(key)?;
        let resident = self.flags[i] & RESIDENT != 0;
        if !self.is_off() {
            self.policy.on_access(i as u32, resident, access);
        }
        if resident {
            self.pin_index(i);
            self.policy.on_hit(i as u32);
            self.counters.hits += 1;
            Ok(Lookup::Hit)
        } else {
            let reread = self.flags[i] & EVER_HELD != 0;
            self.counters.misses += 1;
            if reread {
                self.counters.rereads += 1;
            }
            Ok(Lookup::Miss { reread })
        }
    }

    /// A predictor expects `key` to be routed soon (`--predict-prefetch` retention,
    /// route-ahead's resident committed experts): tell the policy as a hit would, without a
    /// pin and without counting a lookup. False (and nothing done) when `key` is not resident.
    pub fn retain(&mut self, key: ExpertKey) -> bool {
        match self.index(key) {
            Ok(i) if self.flags[i] & RESIDENT != 0 => {
                self.policy.on_hit(i as u32);
                true
            }
            _ => false,
        }
    }

    #[inline]
    fn pin_index(&mut self, i: usize) {
        if self.pins[i] == 0 {
            self.pinned_bytes += self.entry_bytes[self.key_layer[i] as usize];
        }
        self.pins[i] += 1;
    }

    /// Make `key` resident and pinned, evicting unpinned entries by policy until it fits.
    /// Evicted keys are appended to `evicted`; the caller must `Backend::release` each.
    /// Returns `NoRoom` (evicting nothing) when the pinned entries leave no room for it.
    /// The policy is not asked whether to admit (speculative reads; see `admit_with`), so
    /// this never returns `Bypassed`.
    pub fn admit(
        &mut self,
        key: ExpertKey,
        evicted: &mut Vec<ExpertKey>,
    ) -> Result<Admission, CacheError> {
        self.admit_inner(key, None, evicted)
    }

    /// `admit` a demand miss: a policy that filters admission is first asked
    /// (`EvictionPolicy::admit`, with the would-be victim and `access`), and may bypass it —
    /// `Bypassed`, counted in `bypasses`, nothing evicted, `key` not resident. Asked only once
    /// the miss fits beside the pinned entries (`NoRoom` first otherwise, as for `admit`).
    pub fn admit_with(
        &mut self,
        key: ExpertKey,
        access: &AccessContext,
        evicted: &mut Vec<ExpertKey>,
    ) -> Result<Admission, CacheError> {
        self.admit_inner(key, Some(access), evicted)
    }

    fn admit_inner(
        &mut self,
        key: ExpertKey,
        access: Option<&AccessContext>,
        evicted: &mut Vec<ExpertKey>,
    ) -> Result<Admission, CacheError> {
        if self.is_off() {
            return Err(CacheError::Off);
        }
        let i = self.index(key)?;
        if self.flags[i] & RESIDENT != 0 {
            return Err(CacheError::AlreadyResident {
                layer: key.layer,
                expert: key.expert,
            });
        }
        let bytes = self.entry_bytes[key.layer as usize];
        // Evicting every unpinned entry would leave exactly pinned_bytes resident: if the new
        // entry does not fit beside those, refuse before evicting anything.
        if self.pinned_bytes.saturating_add(bytes) > self.budget_bytes {
            return Ok(Admission::NoRoom);
        }
        if let (true, Some(access)) = (self.filters, access) {
            let victim = if self.resident_bytes + bytes > self.budget_bytes {
                let pins = &self.pins;
                self.policy
                    .victim(&|v| pins.get(v as usize).is_some_and(|&p| p == 0))
            } else {
                None
            };
            if !self.policy.admit(i as u32, victim, access) {
                self.counters.bypasses += 1;
                return Ok(Admission::Bypassed);
            }
        }
        while self.resident_bytes + bytes > self.budget_bytes {
            let pins = &self.pins;
            let victim = self
                .policy
                .victim(&|v| pins.get(v as usize).is_some_and(|&p| p == 0));
            let Some(v) = victim.map(|v| v as usize) else {
                return Err(CacheError::Corrupt {
                    what: format!(
                        "policy {} found no victim with {} bytes resident, {} pinned",
                        self.policy.name(),
                        self.resident_bytes,
                        self.pinned_bytes
                    ),
                });
            };
            if v >= self.flags.len() || self.flags[v] & RESIDENT == 0 || self.pins[v] > 0 {
                return Err(CacheError::Corrupt {
                    what: format!(
                        "policy {} named victim {v}, which is not an evictable resident entry",
                        self.policy.name()
                    ),
                });
            }
            self.remove_index(v);
            self.counters.evictions += 1;
            evicted.push(self.key_at(v));
        }
        self.flags[i] |= RESIDENT | EVER_HELD;
        self.resident_bytes += bytes;
        self.resident_count += 1;
        self.pin_index(i);
        self.policy.on_insert(i as u32);
        self.counters.inserts += 1;
        self.debug_check();
        Ok(Admission::Admitted)
    }

    /// Admit `keys` (each with its routing, `admit_with`) in order while each fits beside
    /// what is pinned: the one admission rule of a layer's wave, which the streamer and the
    /// simulator's cache-only replay both run. Each placed key is handed to `placed` with its
    /// outcome — `Admitted` (now resident and pinned) with the keys its admission evicted
    /// (`evicted`, which `placed` drains: the caller releases them), or `Bypassed` (the policy
    /// refused it: the caller reads it into a transient buffer) with none; the first key that
    /// does not fit stops the wave, evicting nothing. Returns how many were placed.
    pub fn admit_wave<E: From<CacheError>>(
        &mut self,
        keys: impl IntoIterator<Item = (ExpertKey, AccessContext)>,
        evicted: &mut Vec<ExpertKey>,
        mut placed: impl FnMut(ExpertKey, Admission, &mut Vec<ExpertKey>) -> Result<(), E>,
    ) -> Result<usize, E> {
        let mut n = 0;
        for (key, access) in keys {
            let admission = self.admit_with(key, &access, evicted)?;
            if admission == Admission::NoRoom {
                break;
            }
            placed(key, admission, evicted)?;
            evicted.clear();
            n += 1;
        }
        Ok(n)
    }

    /// Debug builds hold the cache to its budget after every change that adds or shrinks
    /// (cheap), and re-audit the whole accounting every 1024 insertions, so a long run (the
    /// soak, the randomised simulation) trips on the first broken invariant, not on its effects.
    #[inline]
    fn debug_check(&self) {
        debug_assert!(
            self.resident_bytes <= self.budget_bytes || self.is_off(),
            "cache over budget: {} bytes resident, budget {}",
            self.resident_bytes,
            self.budget_bytes
        );
        #[cfg(debug_assertions)]
        if self.counters.inserts.is_multiple_of(1024) {
            if let Err(e) = self.audit() {
                panic!(
                    "cache audit failed after {} insertions: {e}",
                    self.counters.inserts
                );
            }
        }
    }

    fn remove_index(&mut self, i: usize) {
        let bytes = self.entry_bytes[self.key_layer[i] as usize];
        if self.pins[i] > 0 {
            self.pinned_bytes -= bytes;
            self.pins[i] = 0;
        }
        self.flags[i] &= !RESIDENT;
        self.resident_bytes -= bytes;
        self.resident_count -= 1;
        self.policy.on_remove(i as u32);
    }

    /// Drop one pin of `key` (taken by a hit `lookup` or an `admit`).
    pub fn unpin(&mut self, key: ExpertKey) -> Result<(), CacheError> {
        let i = self.index(key)?;
        if self.pins[i] == 0 {
            return Err(CacheError::NotPinned {
                layer: key.layer,
                expert: key.expert,
            });
        }
        self.pins[i] -= 1;
        if self.pins[i] == 0 {
            self.pinned_bytes -= self.entry_bytes[key.layer as usize];
        }
        Ok(())
    }

    /// Remove `key` even if pinned (its bytes are untrustworthy, e.g. its read failed).
    /// Returns whether it was resident. Not counted as an eviction.
    pub fn discard(&mut self, key: ExpertKey) -> Result<bool, CacheError> {
        let i = self.index(key)?;
        if self.flags[i] & RESIDENT == 0 {
            return Ok(false);
        }
        self.remove_index(i);
        Ok(true)
    }

    /// Change the budget (between generations), evicting unpinned entries by policy until the
    /// resident set fits. The same floor as `new` applies; a cache cannot be turned on or off.
    pub fn set_budget(
        &mut self,
        budget_bytes: u64,
        evicted: &mut Vec<ExpertKey>,
    ) -> Result<(), CacheError> {
        if self.is_off() {
            return Err(CacheError::Off);
        }
        if budget_bytes < self.layer_demand_bytes {
            return Err(CacheError::BudgetBelowLayerDemand {
                budget_bytes,
                layer_demand_bytes: self.layer_demand_bytes,
                k: self.k,
            });
        }
        if budget_bytes < self.pinned_bytes {
            return Err(CacheError::BudgetBelowPinned {
                budget_bytes,
                pinned_bytes: self.pinned_bytes,
            });
        }
        while self.resident_bytes > budget_bytes {
            let pins = &self.pins;
            let Some(v) = self
                .policy
                .victim(&|v| pins.get(v as usize).is_some_and(|&p| p == 0))
            else {
                return Err(CacheError::Corrupt {
                    what: "no victim while shrinking".into(),
                });
            };
            let v = v as usize;
            if v >= self.flags.len() || self.flags[v] & RESIDENT == 0 || self.pins[v] > 0 {
                return Err(CacheError::Corrupt {
                    what: format!("victim {v} is not an evictable resident entry"),
                });
            }
            self.remove_index(v);
            self.counters.evictions += 1;
            evicted.push(self.key_at(v));
        }
        self.budget_bytes = budget_bytes;
        self.policy
            .on_capacity(&capacity(&self.entry_bytes, budget_bytes));
        self.debug_check();
        Ok(())
    }

    /// Resident keys in dense-index order (deterministic; for tests and reports).
    pub fn resident_keys(&self) -> Vec<ExpertKey> {
        (0..self.flags.len())
            .filter(|&i| self.flags[i] & RESIDENT != 0)
            .map(|i| self.key_at(i))
            .collect()
    }

    /// Recompute the byte and pin accounting from scratch and check every invariant.
    pub fn audit(&self) -> Result<(), CacheError> {
        let mut resident = 0u64;
        let mut pinned = 0u64;
        let mut count = 0u32;
        for i in 0..self.flags.len() {
            let bytes = self.entry_bytes[self.key_layer[i] as usize];
            if self.flags[i] & RESIDENT != 0 {
                resident += bytes;
                count += 1;
                if self.pins[i] > 0 {
                    pinned += bytes;
                }
            } else if self.pins[i] > 0 {
                return Err(CacheError::Corrupt {
                    what: format!("key {:?} pinned but not resident", self.key_at(i)),
                });
            }
        }
        let problem = if resident != self.resident_bytes {
            Some(format!(
                "resident_bytes {} but entries sum to {resident}",
                self.resident_bytes
            ))
        } else if pinned != self.pinned_bytes {
            Some(format!(
                "pinned_bytes {} but pinned entries sum to {pinned}",
                self.pinned_bytes
            ))
        } else if count != self.resident_count {
            Some(format!(
                "resident_count {} but {count} entries are resident",
                self.resident_count
            ))
        } else if resident > self.budget_bytes && !self.is_off() {
            Some(format!(
                "{resident} bytes resident over a budget of {}",
                self.budget_bytes
            ))
        } else if self.is_off() && resident > 0 {
            Some("cache is off but holds entries".into())
        } else {
            None
        };
        match problem {
            Some(what) => Err(CacheError::Corrupt { what }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{MoeLayerLayout, ProjExtent};
    use crate::policy::Lru;

    fn layout() -> ExpertLayout {
        let l = |m| MoeLayerLayout {
            model_layer: m,
            n_expert: 4,
            projections: vec![ProjExtent {
                shard: 0,
                base_offset: 0,
                stride_bytes: 10,
            }],
            dense_bytes: 0,
        };
        ExpertLayout::new(2, vec![l(0), l(1)], 2).unwrap()
    }

    fn key(layer: u16, expert: u16) -> ExpertKey {
        ExpertKey { layer, expert }
    }

    #[test]
    fn budget_below_layer_demand_is_refused_naming_the_floor() {
        let err = ExpertCache::new(&layout(), 19, 2, Box::new(Lru::new())).unwrap_err();
        assert_eq!(
            err,
            CacheError::BudgetBelowLayerDemand {
                budget_bytes: 19,
                layer_demand_bytes: 20,
                k: 2
            }
        );
        assert!(err.to_string().contains("layer_demand"));
        // In the unit the flags use, with the bytes beside it and the smallest budget that works.
        let big = CacheError::BudgetBelowLayerDemand {
            budget_bytes: 10 << 20,
            layer_demand_bytes: 24_477_696,
            k: 8,
        }
        .to_string();
        assert!(big.contains("10.0 MiB (10485760 bytes)"), "{big}");
        assert!(
            big.contains("23.3 MiB (24477696 bytes at top-k 8)"),
            "{big}"
        );
        assert!(big.contains("at least 24 MiB"), "{big}");
        assert!(ExpertCache::new(&layout(), 20, 2, Box::new(Lru::new())).is_ok());
        assert!(ExpertCache::new(&layout(), 0, 2, Box::new(Lru::new()))
            .unwrap()
            .is_off());
    }

    /// Debug builds check the budget inside the cache: a budget lowered without evicting (as a
    /// bug in a resize would leave it) stops at the next check, and so does accounting that no
    /// longer matches the entries, at the periodic audit.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "cache over budget: 20 bytes resident, budget 10")]
    fn a_debug_build_asserts_the_budget_inside_the_cache() {
        let mut c = ExpertCache::new(&layout(), 30, 2, Box::new(Lru::new())).unwrap();
        let mut ev = Vec::new();
        for e in 0..2 {
            c.admit(key(0, e), &mut ev).unwrap();
        }
        c.debug_check();
        c.budget_bytes = 10;
        c.debug_check();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "cache audit failed after 1024 insertions")]
    fn a_debug_build_audits_the_cache_every_1024_insertions() {
        let mut c = ExpertCache::new(&layout(), 30, 2, Box::new(Lru::new())).unwrap();
        let mut ev = Vec::new();
        c.resident_count += 7; // a miscount the cheap check cannot see
        for i in 0..1024u32 {
            let k = key((i % 2) as u16, ((i / 2) % 4) as u16);
            if !c.contains(k) {
                c.admit(k, &mut ev).unwrap();
                c.unpin(k).unwrap();
            } else {
                c.discard(k).unwrap();
                c.admit(k, &mut ev).unwrap();
                c.unpin(k).unwrap();
            }
        }
    }

    #[test]
    fn a_wave_admits_in_order_until_a_key_finds_no_room_beside_the_pinned() {
        // Room for 3 experts of 10 bytes; one pinned resident (a hit of this layer).
        let mut c = ExpertCache::new(&layout(), 30, 2, Box::new(Lru::new())).unwrap();
        let mut ev = Vec::new();
        c.admit(key(0, 0), &mut ev).unwrap();
        let mut got = Vec::new();
        let keys = [key(0, 1), key(0, 2), key(0, 3), key(1, 0)].map(|k| (k, AccessContext::NONE));
        let n = c
            .admit_wave(keys, &mut ev, |k, admission, evicted| {
                assert_eq!(admission, Admission::Admitted);
                got.push((k, evicted.len()));
                evicted.clear();
                Ok::<(), CacheError>(())
            })
            .unwrap();
        // Two fit beside the pin; the third would need an unpinned victim and there is none.
        assert_eq!(n, 2);
        assert_eq!(got, [(key(0, 1), 0), (key(0, 2), 0)]);
        assert!(
            !c.contains(key(0, 3)),
            "the key that did not fit evicted nothing"
        );
        // Unpin one: the rest of the wave fits again, evicting by policy (LRU: key(0, 0)).
        c.unpin(key(0, 0)).unwrap();
        let mut again = Vec::new();
        let n = c
            .admit_wave(keys[2..].iter().copied(), &mut ev, |k, _, evicted| {
                again.push((k, evicted.clone()));
                evicted.clear();
                Ok::<(), CacheError>(())
            })
            .unwrap();
        assert_eq!(n, 1, "key(1, 0) finds (0,1), (0,2), (0,3) all pinned");
        assert_eq!(again, [(key(0, 3), vec![key(0, 0)])]);
    }

    #[test]
    fn hits_are_pinned_before_misses_evict() {
        let mut c = ExpertCache::new(&layout(), 30, 2, Box::new(Lru::new())).unwrap();
        let mut ev = Vec::new();
        for e in 0..3 {
            assert_eq!(c.lookup(key(0, e)).unwrap(), Lookup::Miss { reread: false });
            assert_eq!(c.admit(key(0, e), &mut ev).unwrap(), Admission::Admitted);
            c.unpin(key(0, e)).unwrap();
        }
        assert!(ev.is_empty());
        // Routing {0, 3}: 0 is the LRU entry, but it is a hit and pinned before 3 is admitted,
        // so 3 evicts 1 instead.
        assert_eq!(c.lookup(key(0, 0)).unwrap(), Lookup::Hit);
        assert_eq!(c.lookup(key(0, 3)).unwrap(), Lookup::Miss { reread: false });
        assert_eq!(c.admit(key(0, 3), &mut ev).unwrap(), Admission::Admitted);
        assert_eq!(ev, vec![key(0, 1)]);
        assert_eq!(c.resident_keys(), vec![key(0, 0), key(0, 2), key(0, 3)]);
        // Three pinned entries fill the budget: the next miss gets NoRoom and evicts nothing.
        assert_eq!(c.lookup(key(0, 2)).unwrap(), Lookup::Hit);
        ev.clear();
        assert_eq!(c.admit(key(1, 0), &mut ev).unwrap(), Admission::NoRoom);
        assert!(ev.is_empty());
        for e in [0, 2, 3] {
            c.unpin(key(0, e)).unwrap();
        }
        assert_eq!(c.lookup(key(0, 1)).unwrap(), Lookup::Miss { reread: true });
        let n = c.counters();
        assert_eq!(
            (n.hits, n.misses, n.evictions, n.rereads, n.inserts),
            (2, 5, 1, 1, 4)
        );
        c.audit().unwrap();
        assert!(matches!(
            c.unpin(key(0, 0)),
            Err(CacheError::NotPinned { .. })
        ));
        assert!(matches!(
            c.lookup(key(2, 0)),
            Err(CacheError::UnknownKey { .. })
        ));
    }

    #[test]
    fn a_pinned_entry_at_the_lru_tail_is_skipped() {
        let mut c = ExpertCache::new(&layout(), 30, 2, Box::new(Lru::new())).unwrap();
        let mut ev = Vec::new();
        for e in 0..3 {
            c.lookup(key(0, e)).unwrap();
            c.admit(key(0, e), &mut ev).unwrap();
            c.unpin(key(0, e)).unwrap();
        }
        // Pin 0 (now most recent), then touch 1 and 2 without keeping them pinned: 0 drifts to
        // the LRU tail while still pinned.
        assert_eq!(c.lookup(key(0, 0)).unwrap(), Lookup::Hit);
        for e in [1, 2] {
            assert_eq!(c.lookup(key(0, e)).unwrap(), Lookup::Hit);
            c.unpin(key(0, e)).unwrap();
        }
        c.lookup(key(1, 0)).unwrap();
        assert_eq!(c.admit(key(1, 0), &mut ev).unwrap(), Admission::Admitted);
        assert_eq!(ev, vec![key(0, 1)], "the pinned tail entry was skipped");
        assert!(c.contains(key(0, 0)));
        c.audit().unwrap();
    }

    #[test]
    fn shrinking_evicts_unpinned_by_policy() {
        let mut c = ExpertCache::new(&layout(), 40, 2, Box::new(Lru::new())).unwrap();
        let mut ev = Vec::new();
        for e in 0..4 {
            c.lookup(key(1, e)).unwrap();
            c.admit(key(1, e), &mut ev).unwrap();
        }
        for e in 1..4 {
            c.unpin(key(1, e)).unwrap();
        }
        c.set_budget(20, &mut ev).unwrap();
        // Expert 0 is pinned, so the two oldest unpinned ones went.
        assert_eq!(ev, vec![key(1, 1), key(1, 2)]);
        assert_eq!(c.resident_bytes(), 20);
        assert!(c.is_pinned(key(1, 0)));
        assert!(matches!(
            c.set_budget(10, &mut ev),
            Err(CacheError::BudgetBelowLayerDemand { .. })
        ));
        assert!(c.discard(key(1, 0)).unwrap());
        assert_eq!(c.pinned_bytes(), 0);
        c.audit().unwrap();
    }

    /// What `RefuseEvicting` was asked: (key, would-be victim, the miss's routing rows).
    type Asked = std::sync::Arc<std::sync::Mutex<Vec<(u32, Option<u32>, u32)>>>;

    /// LRU that refuses every miss that would evict, and records what it was asked.
    struct RefuseEvicting {
        lru: Lru,
        asked: Asked,
    }

    impl EvictionPolicy for RefuseEvicting {
        fn name(&self) -> &'static str {
            "refuse-evicting"
        }
        fn init(&mut self, layout: &ExpertLayout) {
            self.lru.init(layout);
        }
        fn on_insert(&mut self, index: u32) {
            self.lru.on_insert(index);
        }
        fn on_hit(&mut self, index: u32) {
            self.lru.on_hit(index);
        }
        fn on_remove(&mut self, index: u32) {
            self.lru.on_remove(index);
        }
        fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
            self.lru.victim(is_evictable)
        }
        fn filters_admission(&self) -> bool {
            true
        }
        fn admit(&mut self, index: u32, victim: Option<u32>, access: &AccessContext) -> bool {
            self.asked
                .lock()
                .unwrap()
                .push((index, victim, access.uses));
            victim.is_none()
        }
    }

    #[test]
    fn a_filtering_policy_bypasses_a_miss_without_evicting_and_only_when_asked() {
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let policy = RefuseEvicting {
            lru: Lru::new(),
            asked: asked.clone(),
        };
        let mut c = ExpertCache::new(&layout(), 30, 2, Box::new(policy)).unwrap();
        assert!(c.filters_admission());
        let mut ev = Vec::new();
        let mut access = AccessContext::NONE;
        access.add_use(0, 0.75);
        // Three fit without evicting: asked with no victim, admitted.
        for e in 0..3 {
            assert_eq!(
                c.admit_with(key(0, e), &access, &mut ev).unwrap(),
                Admission::Admitted
            );
            c.unpin(key(0, e)).unwrap();
        }
        // The fourth would evict (0, 0): asked with that victim, refused.
        assert_eq!(
            c.admit_with(key(0, 3), &access, &mut ev).unwrap(),
            Admission::Bypassed
        );
        assert!(ev.is_empty() && !c.contains(key(0, 3)) && c.contains(key(0, 0)));
        assert_eq!(asked.lock().unwrap().last(), Some(&(3, Some(0), 1)));
        // A plain admission (speculation) is not asked.
        let n_asked = asked.lock().unwrap().len();
        assert_eq!(c.admit(key(0, 3), &mut ev).unwrap(), Admission::Admitted);
        assert_eq!(asked.lock().unwrap().len(), n_asked);
        assert_eq!(ev, vec![key(0, 0)]);
        // With every entry pinned the miss finds no room before the policy is asked.
        for e in 1..3 {
            assert_eq!(c.lookup(key(0, e)).unwrap(), Lookup::Hit);
        }
        assert_eq!(
            c.admit_with(key(1, 0), &access, &mut Vec::new()).unwrap(),
            Admission::NoRoom
        );
        assert_eq!(asked.lock().unwrap().len(), n_asked);
        // A wave hands a bypass on and goes on with the next key.
        for e in [1, 2, 3] {
            c.unpin(key(0, e)).unwrap();
        }
        ev.clear();
        let mut got = Vec::new();
        let n = c
            .admit_wave(
                [(key(1, 0), access), (key(1, 1), access)],
                &mut ev,
                |k, admission, evicted| {
                    got.push((k, admission, evicted.len()));
                    Ok::<(), CacheError>(())
                },
            )
            .unwrap();
        assert_eq!(n, 2);
        assert_eq!(
            got,
            [
                (key(1, 0), Admission::Bypassed, 0),
                (key(1, 1), Admission::Bypassed, 0)
            ]
        );
        let n = c.counters();
        assert_eq!((n.bypasses, n.inserts, n.evictions), (3, 4, 1));
        c.audit().unwrap();
    }

    #[test]
    fn off_cache_counts_misses_and_admits_nothing() {
        let mut c = ExpertCache::new(&layout(), 0, 2, Box::new(Lru::new())).unwrap();
        assert_eq!(c.lookup(key(0, 0)).unwrap(), Lookup::Miss { reread: false });
        assert_eq!(c.admit(key(0, 0), &mut Vec::new()), Err(CacheError::Off));
        assert_eq!(c.counters().misses, 1);
    }
}
