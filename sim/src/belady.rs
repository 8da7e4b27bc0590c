//! The Belady (clairvoyant) bound: evict the resident expert whose next use lies furthest in
//! the future.
//!
//! It needs the future, so it is an analysis bound, not a runtime policy, and it lives here
//! rather than in the core. It is written against the core's `EvictionPolicy` interface so the
//! very same `ExpertCache` — budget, pinning, and the admission rule — runs it: a routing's
//! hits are found and pinned before its misses evict anything, and every miss is admitted
//! (the engine computes experts from cache slots, so a miss cannot bypass the cache). Under
//! that rule, with equal-sized experts, evicting the furthest next use is Belady's MIN: no
//! demand-paging policy hits more. With experts of different sizes it is the classic
//! heuristic, not a proven optimum.
//!
//! Ties (several residents never used again, or used next in the same group) go to the
//! smallest dense key index (`layer_base + expert`); `scripts/sim-check.py` breaks them the
//! same way, which is what makes the gate's count exact.
//!
//! The policy follows the access sequence by counting the cache's `on_hit` / `on_insert`
//! calls: each key of a group produces exactly one (a hit or an admission). A call for a key
//! the current group does not hold means the sequence and the run disagree (a hook that
//! rewrote routings, `--load-all`); the policy then records the fault in its `Desync` handle
//! and the caller must not trust the run.

use crate::error::SimError;
use crate::plan::AccessSeq;
use bmoe_core::policy::EvictionPolicy;
use bmoe_core::ExpertLayout;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// "Never used again".
const NEVER: u32 = u32::MAX;

/// Where a clairvoyant policy reports that it lost track of the access sequence. Shared with
/// the caller, because the cache owns the policy once built.
#[derive(Clone, Debug, Default)]
pub struct Desync(Arc<Mutex<Option<String>>>);

impl Desync {
    fn set(&self, what: String) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(what);
        }
    }

    /// `Ok` when the policy followed the whole run, the first disagreement otherwise.
    pub fn check(&self) -> Result<(), SimError> {
        match self.0.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            None => Ok(()),
            Some(reason) => Err(SimError::Clairvoyant { reason }),
        }
    }
}

/// The clairvoyant eviction policy over one access sequence.
pub struct Clairvoyant {
    /// Per position of `seq.keys`: the dense key index.
    key_index: Vec<u32>,
    /// Per position: the next group (after this one) that holds the same key, or `NEVER`.
    next_group: Vec<u32>,
    group_end: Vec<u32>,
    /// The group being served and how many of its keys the cache has reported.
    group: usize,
    seen: u32,
    /// Per dense key: its next use while resident.
    next_use: Vec<u32>,
    resident: Vec<bool>,
    /// Resident keys ordered by (next use, reversed key): the last evictable one is the victim.
    order: BTreeSet<(u32, u32)>,
    desync: Desync,
}

impl Clairvoyant {
    /// A policy for runs whose cache sees exactly `seq` over `layout`; its `Desync` handle.
    pub fn new(seq: &AccessSeq, layout: &ExpertLayout) -> (Clairvoyant, Desync) {
        let desync = Desync::default();
        let key_index: Vec<u32> = seq
            .keys
            .iter()
            .map(|&k| layout.key_index(k).unwrap_or(NEVER))
            .collect();
        if key_index.contains(&NEVER) {
            desync.set("the access sequence names an expert the layout lacks".to_string());
        }
        let n_keys = layout.n_keys() as usize;
        let mut next_group = vec![NEVER; key_index.len()];
        let mut last_group = vec![NEVER; n_keys];
        let mut end = key_index.len();
        for g in (0..seq.group_end.len()).rev() {
            let start = if g == 0 {
                0
            } else {
                seq.group_end[g - 1] as usize
            };
            let keys = &key_index[start..end];
            for (next, &k) in next_group[start..end].iter_mut().zip(keys) {
                if let Some(&n) = last_group.get(k as usize) {
                    *next = n;
                }
            }
            for &k in keys {
                if let Some(slot) = last_group.get_mut(k as usize) {
                    *slot = g as u32;
                }
            }
            end = start;
        }
        (
            Clairvoyant {
                key_index,
                next_group,
                group_end: seq.group_end.clone(),
                group: 0,
                seen: 0,
                next_use: vec![NEVER; n_keys],
                resident: vec![false; n_keys],
                order: BTreeSet::new(),
                desync: desync.clone(),
            },
            desync,
        )
    }

    fn rev(index: u32) -> u32 {
        u32::MAX - index
    }

    /// `index` was used now: find it in the current group, set its next use, advance.
    fn touch(&mut self, index: u32) {
        let Some(&end) = self.group_end.get(self.group) else {
            self.desync
                .set(format!("key {index} used after the access sequence ended"));
            return;
        };
        let start = if self.group == 0 {
            0
        } else {
            self.group_end[self.group - 1] as usize
        };
        let Some(p) = (start..end as usize).find(|&p| self.key_index[p] == index) else {
            self.desync.set(format!(
                "key {index} used at group {}, which does not route it",
                self.group
            ));
            return;
        };
        let i = index as usize;
        if self.resident[i] {
            self.order.remove(&(self.next_use[i], Self::rev(index)));
        }
        self.next_use[i] = self.next_group[p];
        if self.resident[i] {
            self.order.insert((self.next_use[i], Self::rev(index)));
        }
        self.seen += 1;
        if self.seen as usize == end as usize - start {
            self.group += 1;
            self.seen = 0;
        }
    }
}

impl EvictionPolicy for Clairvoyant {
    fn name(&self) -> &'static str {
        "belady"
    }

    fn init(&mut self, layout: &ExpertLayout) {
        if layout.n_keys() as usize != self.resident.len() {
            self.desync
                .set("the cache's layout is not the sequence's".to_string());
        }
    }

    fn on_insert(&mut self, index: u32) {
        let i = index as usize;
        if i >= self.resident.len() {
            return;
        }
        // Its next use first (`touch` finds it not yet resident, so the ordered set is left
        // alone), then one insertion rather than an insertion, a removal and a re-insertion.
        self.touch(index);
        self.resident[i] = true;
        self.order.insert((self.next_use[i], Self::rev(index)));
    }

    fn on_hit(&mut self, index: u32) {
        self.touch(index);
    }

    fn on_remove(&mut self, index: u32) {
        let i = index as usize;
        if i >= self.resident.len() || !self.resident[i] {
            return;
        }
        self.order.remove(&(self.next_use[i], Self::rev(index)));
        self.resident[i] = false;
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        self.order
            .iter()
            .rev()
            .map(|&(_, r)| u32::MAX - r)
            .find(|&index| is_evictable(index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bmoe_core::policy::Lru;
    use bmoe_core::{ExpertKey, MoeLayerLayout, ProjExtent};

    fn layout() -> ExpertLayout {
        ExpertLayout::new(
            1,
            vec![MoeLayerLayout {
                model_layer: 0,
                n_expert: 8,
                projections: vec![ProjExtent {
                    shard: 0,
                    base_offset: 0,
                    stride_bytes: 10,
                }],
                dense_bytes: 0,
            }],
            1,
        )
        .expect("layout")
    }

    fn seq(ids: &[u16]) -> AccessSeq {
        let mut s = AccessSeq::default();
        for &e in ids {
            s.keys.push(ExpertKey {
                layer: 0,
                expert: e,
            });
            s.group_end.push(s.keys.len() as u32);
            s.routings += 1;
        }
        s
    }

    #[test]
    fn belady_beats_lru_on_the_textbook_sequence() {
        // The classic reference string, 3 frames: MIN has 7 misses (cold ones included).
        let ids = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1];
        let l = layout();
        let s = seq(&ids);
        let (policy, desync) = Clairvoyant::new(&s, &l);
        let b = crate::cache_only::run(&l, &s, 30, 1, Box::new(policy)).expect("belady");
        desync.check().expect("in sync");
        assert_eq!(b.counters.misses, 9);
        let lru = crate::cache_only::run(&l, &s, 30, 1, Box::new(Lru::new())).expect("lru");
        assert_eq!(lru.counters.misses, 12);
    }

    #[test]
    fn a_run_that_strays_from_the_sequence_is_reported() {
        let l = layout();
        let (policy, desync) = Clairvoyant::new(&seq(&[1, 2, 3]), &l);
        let other = seq(&[1, 5, 3]);
        let _ = crate::cache_only::run(&l, &other, 20, 1, Box::new(policy));
        assert!(desync.check().is_err());
    }
}
