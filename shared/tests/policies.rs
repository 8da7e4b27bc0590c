//! Properties of the cache-aware routing hooks and of every eviction policy, over random
//! routings, residencies and access sequences (proptest; a failure prints its seed).
//!
//! Dropping: a routing is never emptied, the top expert survives, only cold experts under the
//! threshold go, and with renormalisation the routing keeps its mass. Substitution: the width
//! and distinctness hold, only resident experts come in, an unchanged set is left untouched.
//! Eviction: every policy, driven through the real `ExpertCache` in the streamer's protocol,
//! keeps the budget and never evicts a pinned entry (the cache checks every victim it is
//! given and reports a policy that names a wrong one as `Corrupt`).

use bmoe_core::cache::{Admission, ExpertCache, Lookup};
use bmoe_core::hooks::{DropCold, Substitute};
use bmoe_core::layout::{ExpertKey, ExpertLayout, MoeLayerLayout, ProjExtent};
use bmoe_core::policy::{by_name, AccessContext, StepContext, POLICY_NAMES};
use bmoe_core::records::Phase;
use bmoe_core::Routing;
use proptest::prelude::*;

/// One routing row of width `k` out of `n_expert`, from random logits (softmax, top-k,
/// renormalised, as qwen3moe routes), with the full probabilities attached.
fn routed(logits: &[f32], k: usize) -> Routing {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let total: f32 = exp.iter().sum();
    let probs: Vec<f32> = exp.iter().map(|&e| e / total).collect();
    let mut order: Vec<u16> = (0..probs.len() as u16).collect();
    order.sort_by(|&a, &b| {
        probs[b as usize]
            .total_cmp(&probs[a as usize])
            .then(a.cmp(&b))
    });
    let ids = &order[..k];
    let sum: f32 = ids.iter().map(|&e| probs[e as usize]).sum();
    let weights: Vec<f32> = ids.iter().map(|&e| probs[e as usize] / sum).collect();
    let mut r = Routing::new();
    r.reset(probs.len() as u32, 1);
    r.push_row_with_probs(0, ids, &weights, &probs)
        .expect("valid row");
    r
}

fn row_strategy() -> impl Strategy<Value = (Vec<f32>, usize, Vec<bool>)> {
    (2usize..24).prop_flat_map(|n| {
        (
            proptest::collection::vec(-12f32..12.0, n),
            1..=n.min(8),
            proptest::collection::vec(any::<bool>(), n),
        )
    })
}

fn layout(n_layers: u32, n_expert: u32, k: u16) -> ExpertLayout {
    let layers = (0..n_layers)
        .map(|m| MoeLayerLayout {
            model_layer: m,
            n_expert,
            projections: vec![ProjExtent {
                shard: 0,
                base_offset: 0,
                stride_bytes: 10 + u64::from(m),
            }],
            dense_bytes: 0,
        })
        .collect();
    ExpertLayout::new(n_layers, layers, k).expect("test layout")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn dropping_never_empties_keeps_the_top_and_preserves_mass(
        (logits, k, resident) in row_strategy(),
        frac in 0.0001f32..=1.0,
        renormalize in any::<bool>(),
    ) {
        let mut r = routed(&logits, k);
        let before_ids = r.ids(0).to_vec();
        let before_w = r.weights(0).to_vec();
        let hook = DropCold { frac, renormalize, in_prefill: false, gating: bmoe_core::Gating::SOFTMAX_RENORM };
        let n = hook.drop_rows(&mut r, &|e| resident[e as usize]);
        let dropped = r.dropped(0).to_vec();
        prop_assert_eq!(n, dropped.iter().filter(|&&d| d).count() as u64);
        prop_assert!(dropped.iter().any(|&d| !d), "routing emptied");
        prop_assert_eq!(r.ids(0), &before_ids[..], "dropping never changes ids");
        // The top-weighted expert (first on ties) survives.
        let top = (0..k).fold(0, |b, j| if before_w[j] > before_w[b] { j } else { b });
        prop_assert!(!dropped[top], "top expert dropped");
        let threshold = frac / k as f32;
        for j in 0..k {
            if dropped[j] {
                prop_assert!(!resident[before_ids[j] as usize], "resident expert dropped");
                prop_assert!(before_w[j] < threshold);
                prop_assert_eq!(r.weights(0)[j], before_w[j], "trace keeps the router weight");
            } else if j != top {
                // Kept: resident or heavy enough.
                prop_assert!(resident[before_ids[j] as usize] || before_w[j] >= threshold);
            }
        }
        let kept: f32 = (0..k).filter(|&j| !dropped[j]).map(|j| r.weights(0)[j]).sum();
        let original: f32 = before_w.iter().sum();
        if renormalize {
            prop_assert!((kept - original).abs() <= 1e-5 * original.max(1.0), "{} vs {}", kept, original);
        } else {
            for j in (0..k).filter(|&j| !dropped[j]) {
                prop_assert_eq!(r.weights(0)[j], before_w[j]);
            }
        }
        // k = 1: always a no-op.
        if k == 1 {
            prop_assert_eq!(n, 0);
        }
    }

    #[test]
    fn substitution_keeps_width_brings_in_only_residents_and_counts_changes(
        (logits, k, resident) in row_strategy(),
        lambda in 0.0f32..=1.0,
    ) {
        let mut r = routed(&logits, k);
        let before_ids = r.ids(0).to_vec();
        let before_w = r.weights(0).to_vec();
        let mut hook = Substitute::new(lambda, bmoe_core::Gating::SOFTMAX_RENORM);
        hook.rerank_rows(&mut r, &|e| resident[e as usize]);
        let c = bmoe_core::RouterHook::take_counts(&mut hook);
        let after = r.ids(0).to_vec();
        prop_assert_eq!(after.len(), k);
        prop_assert!(r.validate(0).is_ok(), "duplicate or out-of-range id: {:?}", after);
        let moved: Vec<u16> = after.iter().copied().filter(|e| !before_ids.contains(e)).collect();
        prop_assert_eq!(c.substituted, moved.len() as u64);
        prop_assert!(c.substituted <= c.reranked);
        if lambda > 0.0 && logits.len() > k {
            prop_assert_eq!(c.reranked, k as u64);
        }
        for e in &moved {
            prop_assert!(resident[*e as usize], "a cold expert {} came in", e);
        }
        if moved.is_empty() {
            prop_assert_eq!(&after, &before_ids);
            prop_assert_eq!(r.weights(0), &before_w[..]);
        } else {
            // The router's own probabilities, renormalised as qwen3moe does (its denominator
            // is floored at 6.1035e-5, so a very improbable selection sums below 1).
            let probs = r.probs(0).expect("probs kept").to_vec();
            let chosen: f32 = after.iter().map(|&e| probs[e as usize]).sum();
            let denom = chosen.max(6.103_515_6e-5);
            for (j, &e) in after.iter().enumerate() {
                prop_assert_eq!(r.weights(0)[j], probs[e as usize] / denom);
            }
        }
    }

    /// Every policy through the real cache in the streamer's protocol (context and admission
    /// included): never over budget, a pinned key is never evicted, hits + misses = lookups,
    /// every miss is admitted or bypassed (only by a policy that filters admission, evicting
    /// nothing and leaving it out of the cache), and the cache's audit holds.
    #[test]
    fn every_policy_keeps_the_cache_invariants(
        policy_i in 0usize..POLICY_NAMES.len(),
        n_layers in 1u32..4,
        n_expert in 4u32..12,
        k in 1u16..4,
        extra in 0u64..200,
        steps in proptest::collection::vec(proptest::collection::vec(any::<u16>(), 1..6), 1..40),
    ) {
        let layout = layout(n_layers, n_expert, k);
        let budget = layout.layer_demand_bytes(k) + extra;
        let policy = by_name(POLICY_NAMES[policy_i]).expect("known policy");
        let mut cache = ExpertCache::new(&layout, budget, k, policy).expect("cache");
        let filters = cache.filters_admission();
        let mut lookups = 0u64;
        let mut evicted = Vec::new();
        for (turn, draws) in steps.iter().enumerate() {
            cache.begin_step(&StepContext { turn: turn as u32 / 8, phase: Phase::Decode, n_rows: 1 });
            for m in 0..layout.n_moe_layers() {
                cache.begin_layer(m);
                let mut union: Vec<u16> = Vec::new();
                for &d in draws.iter().take(usize::from(k)) {
                    let e = d % n_expert as u16;
                    if !union.contains(&e) { union.push(e); }
                }
                let mut pinned = Vec::new();
                let mut misses = Vec::new();
                for (rank, &e) in union.iter().enumerate() {
                    let key = ExpertKey { layer: m, expert: e };
                    let mut access = AccessContext::NONE;
                    access.add_use(rank as u16, 1.0 / (rank as f32 + 1.0));
                    lookups += 1;
                    match cache.lookup_with(key, &access).expect("lookup") {
                        Lookup::Hit => pinned.push(key),
                        Lookup::Miss { .. } => misses.push((key, access)),
                    }
                }
                for (key, access) in misses {
                    evicted.clear();
                    let a = cache
                        .admit_with(key, &access, &mut evicted)
                        .expect("policy named a valid victim");
                    prop_assert!(a != Admission::NoRoom, "a layer's union fits its demand");
                    for v in &evicted {
                        prop_assert!(!pinned.contains(v), "evicted pinned {:?}", v);
                    }
                    if a == Admission::Bypassed {
                        prop_assert!(filters, "only a filtering policy bypasses");
                        prop_assert!(evicted.is_empty(), "a bypass evicted {:?}", evicted);
                        prop_assert!(!cache.contains(key), "a bypassed key is resident");
                    } else {
                        pinned.push(key);
                    }
                    prop_assert!(cache.resident_bytes() <= budget);
                }
                for key in pinned.drain(..) { cache.unpin(key).expect("unpin"); }
            }
            cache.audit().expect("audit");
        }
        let c = cache.counters();
        prop_assert_eq!(c.hits + c.misses, lookups);
        prop_assert_eq!(c.inserts + c.bypasses, c.misses);
    }
}
