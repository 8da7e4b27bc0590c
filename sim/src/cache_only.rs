//! The cache-only replay: the core's `ExpertCache` (and its eviction policy) driven straight
//! over a trace's access sequence, with no flash, no compute and no clock.
//!
//! It answers "what would this budget and policy hit" at tens of millions of routings per
//! second, for sweeps and the replay-speed benchmark. It calls the cache in exactly the order
//! the streamer does for a layer — every expert looked up (hits pinned) before any miss is
//! admitted; misses admitted through the core's one admission rule
//! (`ExpertCache::admit_wave`, which the streamer runs too): a miss that finds no room beside
//! the pinned entries ends the wave, the wave is unpinned, and admission resumes — so its
//! counters equal a full replay's; a test checks that on both real traces. Nothing here decides
//! residency: the core's cache and policy do. The policy hears what it hears in the streamer:
//! each step's and each layer's beginning, and each lookup's and admission's routing (the
//! sequence's `AccessContext`s); a miss it bypasses is counted and simply not admitted.

use crate::error::SimError;
use crate::plan::AccessSeq;
use bmoe_core::cache::Admission;
use bmoe_core::policy::{AccessContext, EvictionPolicy};
use bmoe_core::{CacheCounters, CacheError, ExpertCache, ExpertKey, ExpertLayout, Lookup};

/// What a cache-only replay counted.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheOnlyResult {
    pub counters: CacheCounters,
    /// Bytes the misses would read (expert bytes, before any alignment).
    pub miss_bytes: u64,
    /// Bytes resident at the end.
    pub resident_bytes: u64,
}

/// Replay `seq` through a cache of `budget_bytes` over `layout` with top-k `k` and `policy`.
/// Budget 0 is the cache off: every lookup misses.
pub fn run(
    layout: &ExpertLayout,
    seq: &AccessSeq,
    budget_bytes: u64,
    k: u16,
    policy: Box<dyn EvictionPolicy>,
) -> Result<CacheOnlyResult, SimError> {
    run_observed(layout, seq, budget_bytes, k, policy, &mut |_, _| {})
}

/// `run`, calling `on_misses(g, misses)` for every group `g` with the experts it missed (in
/// lookup order; also when the group missed nothing) before they are admitted: the reads the
/// streamer would issue for that (step, layer).
pub fn run_observed(
    layout: &ExpertLayout,
    seq: &AccessSeq,
    budget_bytes: u64,
    k: u16,
    policy: Box<dyn EvictionPolicy>,
    on_misses: &mut dyn FnMut(usize, &[ExpertKey]),
) -> Result<CacheOnlyResult, SimError> {
    let mut cache = ExpertCache::new(layout, budget_bytes, k, policy)?;
    let mut misses: Vec<(ExpertKey, AccessContext)> = Vec::new();
    let mut missed: Vec<ExpertKey> = Vec::new();
    let mut wave: Vec<ExpertKey> = Vec::new();
    let mut evicted: Vec<ExpertKey> = Vec::new();
    let mut miss_bytes = 0u64;
    let off = cache.is_off();
    let mut start = 0usize;
    let mut steps = seq.steps.iter().peekable();
    for (g, &end) in seq.group_end.iter().enumerate() {
        let group = &seq.keys[start..end as usize];
        let group_start = start;
        start = end as usize;
        if let Some((_, step)) = steps.next_if(|(first, _)| *first as usize == g) {
            cache.begin_step(step);
        }
        if let Some(&m) = seq.group_layer.get(g).or(group.first().map(|k| &k.layer)) {
            cache.begin_layer(m);
        }
        misses.clear();
        missed.clear();
        wave.clear();
        for (i, &key) in group.iter().enumerate() {
            let access = seq
                .access
                .get(group_start + i)
                .copied()
                .unwrap_or(AccessContext::NONE);
            match cache.lookup_with(key, &access)? {
                Lookup::Hit => wave.push(key),
                Lookup::Miss { .. } => {
                    misses.push((key, access));
                    missed.push(key);
                    miss_bytes += layout.expert_bytes(key.layer);
                }
            }
        }
        on_misses(g, &missed);
        if off {
            continue;
        }
        // The core's admission rule (`ExpertCache::admit_wave`, the streamer's): admit in
        // order while room; a miss that finds none ends the wave, whose experts are then
        // computed and unpinned, and admission resumes with it. A bypassed miss is read and
        // computed outside the cache: nothing to pin.
        let mut next = 0;
        while next < misses.len() {
            let n = cache.admit_wave(
                misses[next..].iter().copied(),
                &mut evicted,
                |key, admission, ev| {
                    ev.clear();
                    if admission == Admission::Admitted {
                        wave.push(key);
                    }
                    Ok::<(), SimError>(())
                },
            )?;
            next += n;
            if next == misses.len() {
                break;
            }
            if n == 0 && wave.is_empty() {
                let (key, _) = misses[next];
                return Err(SimError::Cache(CacheError::Corrupt {
                    what: format!(
                        "expert {} of MoE layer {} fits nowhere even with nothing pinned",
                        key.expert, key.layer
                    ),
                }));
            }
            for &w in &wave {
                cache.unpin(w)?;
            }
            wave.clear();
        }
        for &w in &wave {
            cache.unpin(w)?;
        }
    }
    Ok(CacheOnlyResult {
        counters: cache.counters(),
        miss_bytes,
        resident_bytes: cache.resident_bytes(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bmoe_core::policy::Lru;
    use bmoe_core::{MoeLayerLayout, ProjExtent};

    fn layout(n_layers: u16, n_expert: u32) -> ExpertLayout {
        let layers = (0..n_layers)
            .map(|m| MoeLayerLayout {
                model_layer: u32::from(m),
                n_expert,
                projections: vec![ProjExtent {
                    shard: 0,
                    base_offset: u64::from(m) * 1_000_000,
                    stride_bytes: 10,
                }],
                dense_bytes: 0,
            })
            .collect();
        ExpertLayout::new(u32::from(n_layers), layers, 2).expect("layout")
    }

    fn seq(groups: &[&[(u16, u16)]]) -> AccessSeq {
        let mut s = AccessSeq::default();
        for g in groups {
            for &(layer, expert) in g.iter() {
                s.keys.push(ExpertKey { layer, expert });
            }
            s.group_end.push(s.keys.len() as u32);
            s.routings += g.len() as u64;
        }
        s
    }

    #[test]
    fn global_lru_by_hand() {
        // Room for 3 experts of 10 bytes; top-2 groups.
        let l = layout(2, 4);
        let s = seq(&[
            &[(0, 0), (0, 1)],
            &[(1, 0), (1, 1)],
            &[(0, 0), (0, 2)],
            &[(1, 1), (1, 2)],
        ]);
        let r = run(&l, &s, 30, 2, Box::new(Lru::new())).expect("run");
        // g0: 2 misses. g1: 2 misses, evicts (0,1)? LRU order after g0: (0,1) MRU, (0,0).
        // g1 admits (1,0) -> evict (0,0); admits (1,1) -> evict (0,1). Resident (1,0),(1,1).
        // g2: (0,0) miss, (0,2) miss -> one fits beside nothing pinned... resident 2 + 1 = 3,
        // then (0,2) evicts the LRU (1,0). Resident (1,1),(0,0),(0,2).
        // g3: (1,1) hit; (1,2) miss evicts the LRU unpinned: (0,0).
        assert_eq!(r.counters.hits, 1);
        assert_eq!(r.counters.misses, 7);
        assert_eq!(r.counters.evictions, 4);
        assert_eq!(r.counters.rereads, 1, "(0,0) was held before");
        assert_eq!(r.miss_bytes, 70);
        assert_eq!(r.resident_bytes, 30);
    }

    #[test]
    fn a_wide_group_admits_in_waves_and_the_cache_off_misses_everything() {
        let l = layout(1, 8);
        let s = seq(&[&[(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]]);
        let r = run(&l, &s, 20, 2, Box::new(Lru::new())).expect("waves");
        assert_eq!(r.counters.misses, 5);
        assert_eq!(r.counters.inserts, 5);
        assert_eq!(r.counters.evictions, 3);
        let off = run(&l, &s, 0, 2, Box::new(Lru::new())).expect("off");
        assert_eq!((off.counters.hits, off.counters.misses), (0, 5));
        assert!(
            run(&l, &s, 15, 2, Box::new(Lru::new())).is_err(),
            "below layer demand"
        );
    }
}
