//! `bmoe-sim whatif`: a recorded routing priced on a model and a device that were never run
//! together.
//!
//! Three inputs, each from its own place:
//! - **routing** — which experts each token chose, layer by layer: the route trace;
//! - **bytes** — what each expert and each layer's dense part weigh, and where the experts sit
//!   in the file: the target model's layout (`bmoe-cli inspect MODEL --layout-out L.csv`, or any
//!   run's `--route-trace` of that model);
//! - **time** — the device's flash and compute rates, latency and memory: a device profile.
//!
//! When the trace's routing shape (MoE layers, experts per layer, experts per token) is the
//! model's, the routing is replayed as recorded. When it is not, the routing is mapped onto the
//! model's shape by a fixed, stated rule (`map_routing`): the model's MoE layer `j` of `L'`
//! takes the trace's layer `round(j·(L−1)/(L'−1))` (first to first, last to last); expert `e` of
//! `E` becomes `⌊e·E'/E⌋` (neighbouring experts fold together, so a share of the bank maps to
//! the same share); ids that collide within a routing move to the next free id, and a model
//! that routes more experts per token than the trace takes the following free ids; a model
//! that routes fewer keeps the first ones in rank order. A model with more experts per layer
//! than the trace is refused: a recording cannot say how a routing spreads over experts it never
//! had — unless the user asks for an invented spread (`--split-experts`, `split_routing`): each
//! trace expert `e` becomes the group of the model's experts `⌊e·E'/E⌋ .. ⌊(e+1)·E'/E⌋`, and a
//! routing takes its groups' first members in rank order, then their second members, and so
//! on, so a token that routes the trace's experts again routes the same members again (the
//! recording's reuse is kept), while how a real router of that width spreads inside a group is
//! made up, and the mapping line says so. Routing weights are dropped (`nan`) in a mapped trace,
//! since they belonged to other ids.

use crate::error::SimError;
use bmoe_core::records::{Phase, RouteRecord, PRED_HORIZON_MAX};
use bmoe_core::telemetry::route_trace::{RoutePreamble, RouteTrace, RouteTraceWriter};

/// The trace's MoE layer that the model's MoE layer `j` (of `to`) takes its routing from (of
/// `from` layers): first to first, last to last, evenly between.
pub fn source_layer(j: usize, from: usize, to: usize) -> usize {
    if to <= 1 || from <= 1 {
        return 0;
    }
    // round(j·(from−1)/(to−1)) in integers.
    (2 * j * (from - 1) + (to - 1)) / (2 * (to - 1))
}

/// Whether `trace` already has `model`'s routing shape (MoE layers, experts, experts per
/// token): then it is replayed as recorded, only re-priced.
pub fn same_shape(trace: &RoutePreamble, model: &RoutePreamble) -> bool {
    trace.layers.len() == model.layers.len()
        && trace.n_expert == model.n_expert
        && trace.n_expert_used == model.n_expert_used
}

/// One routing folded onto `e_to` experts and widened or narrowed to `k_to` ids: each id
/// `e` becomes `⌊e·e_to/e_from⌋`, moving to the next free id on a collision; missing ids are
/// the next free ones after the last.
pub fn fold_routing(ids: &[u32], e_from: u32, e_to: u32, k_to: usize) -> Vec<u32> {
    let mut used = vec![false; e_to as usize];
    let mut out = Vec::with_capacity(k_to);
    let take = |mut id: u32, used: &mut [bool]| {
        while used[id as usize] {
            id = (id + 1) % e_to;
        }
        used[id as usize] = true;
        id
    };
    for &e in ids.iter().take(k_to) {
        let id = (u64::from(e) * u64::from(e_to) / u64::from(e_from)) as u32;
        out.push(take(id, &mut used));
    }
    while out.len() < k_to {
        let next = out.last().map_or(0, |&l| (l + 1) % e_to);
        out.push(take(next, &mut used));
    }
    out
}

/// One routing spread onto `e_to ≥ e_from` experts (`--split-experts`): trace expert `e` owns
/// the group `⌊e·e_to/e_from⌋ .. ⌊(e+1)·e_to/e_from⌋` (at least one id), and the `k_to` ids are
/// taken round by round — every rank's group's first member in rank order, then every group's
/// second member, … — so the same trace experts at the same ranks give the same ids. Should
/// the groups run out (more ids per token than they hold), the next free ids follow the last.
pub fn split_routing(ids: &[u32], e_from: u32, e_to: u32, k_to: usize) -> Vec<u32> {
    let group = |e: u32| {
        let start = (u64::from(e) * u64::from(e_to) / u64::from(e_from)) as u32;
        let end = ((u64::from(e) + 1) * u64::from(e_to) / u64::from(e_from)) as u32;
        start..end.max(start + 1).min(e_to)
    };
    let mut used = vec![false; e_to as usize];
    let mut out = Vec::with_capacity(k_to);
    let widest = ids.iter().map(|&e| group(e).len()).max().unwrap_or(0);
    'rounds: for round in 0..widest {
        for &e in ids {
            if out.len() == k_to {
                break 'rounds;
            }
            let g = group(e);
            if let Some(id) = g.clone().nth(round) {
                if !used[id as usize] {
                    used[id as usize] = true;
                    out.push(id);
                }
            }
        }
    }
    while out.len() < k_to {
        let mut next = out.last().map_or(0, |&l| (l + 1) % e_to);
        while used[next as usize] {
            next = (next + 1) % e_to;
        }
        used[next as usize] = true;
        out.push(next);
    }
    out
}

/// `trace`'s routing on `model`'s shape (see the module docs), with `model`'s preamble (its
/// layers, bytes and extents), plus a sentence describing the mapping for the output.
/// `allow_split` allows a model with more experts per layer than the trace ([`split_routing`]).
pub fn map_routing(
    trace: &RouteTrace,
    model: &RoutePreamble,
    model_name: &str,
    allow_split: bool,
) -> Result<(RouteTrace, String), SimError> {
    let src = &trace.preamble;
    let (l_from, l_to) = (src.layers.len(), model.layers.len());
    let (e_from, e_to) = (src.n_expert, model.n_expert);
    let k_to = model.n_expert_used as usize;
    let bad = |why: String| SimError::invalid(format!("whatif --model {model_name}"), why);
    if l_to == 0 {
        return Err(bad("its layout lists no MoE layer".into()));
    }
    let split = e_to > e_from;
    if split && !allow_split {
        return Err(bad(format!(
            "the model has {e_to} experts per layer and the trace routes over {e_from}: a recording cannot say how a routing spreads over experts it never had (record one on a model with at least {e_to} experts, or pass --split-experts to spread each of the trace's experts over a group of the model's, an invented spread the output names)"
        )));
    }
    if k_to as u32 > e_to {
        return Err(bad(format!(
            "it routes {k_to} experts per token out of {e_to}"
        )));
    }
    let mut pre = model.clone();
    pre.notes = src.notes.clone();
    pre.notes.push(format!(
        "routing of {} ({} MoE layers x {} experts, top-{}) mapped onto {} ({} x {}, top-{}) by bmoe-sim whatif",
        src.model, l_from, e_from, src.n_expert_used, model.model, l_to, e_to, k_to
    ));
    let mut buf = Vec::new();
    let mut w = RouteTraceWriter::new(&mut buf, &pre).map_err(|e| SimError::io("whatif", e))?;
    for step in trace.steps() {
        // A prefill token the trace's last MoE layer did not route (the engine computes only
        // the final row there): the model's last layer does not route it either, and inner
        // layers mapped onto the trace's last take the one before it.
        let by_layer = |l: usize| step.cells.iter().find(|c| c.moe_layer as usize == l);
        for j in 0..l_to {
            let mut l = source_layer(j, l_from, l_to);
            if by_layer(l).is_none() && j + 1 < l_to && l + 1 == l_from && l > 0 {
                l -= 1;
            }
            let Some(cell) = by_layer(l) else { continue };
            let ids: Vec<u32> = trace.cell_slots(cell).iter().map(|s| s.expert).collect();
            let routed = if split {
                split_routing(&ids, e_from, e_to, k_to)
            } else {
                fold_routing(&ids, e_from, e_to, k_to)
            };
            for (slot, expert) in routed.into_iter().enumerate() {
                w.write(&RouteRecord {
                    turn: step.turn,
                    phase: step.phase,
                    step: step.step,
                    layer: j as u32,
                    slot: slot as u32,
                    expert,
                    weight: f32::NAN,
                    residency: 0,
                    expert_bytes: 0,
                    dropped: false,
                    preds: [None; PRED_HORIZON_MAX],
                    row: 0,
                    router_expert: None,
                })
                .map_err(|e| SimError::io("whatif", e))?;
            }
        }
    }
    w.finish().map_err(|e| SimError::io("whatif", e))?;
    let text = String::from_utf8(buf).map_err(|e| bad(e.to_string()))?;
    let mapped = RouteTrace::parse(&text).map_err(|e| {
        bad(format!(
            "the mapped routing does not parse as a route trace ({e}): please report this"
        ))
    })?;
    let experts = if split {
        format!(
            "expert e becomes the group floor(e*{e_to}/{e_from})..floor((e+1)*{e_to}/{e_from}) \
             and a routing takes its groups' first members in rank order, then their second \
             members (--split-experts: how a router of {e_to} experts spreads inside a group \
             is invented, the trace's reuse is kept)"
        )
    } else {
        format!(
            "expert e becomes floor(e*{e_to}/{e_from}) (collisions move to the next free id{})",
            if k_to as u32 > src.n_expert_used {
                "; the extra ids per token are the next free ones"
            } else {
                ""
            }
        )
    };
    let how = format!(
        "the trace's {l_from} MoE layers x {e_from} experts (top-{}) mapped onto the model's {l_to} x {e_to} (top-{k_to}): layer j takes the trace's layer round(j*{}/{}), {experts}, weights dropped",
        src.n_expert_used,
        l_from.saturating_sub(1),
        l_to.saturating_sub(1).max(1),
    );
    Ok((mapped, how))
}

/// The locality a mapped routing carries, beside the trace's own: what a whatif across shapes
/// assumes of the model's router, said in numbers. Over the decode tokens (every token of a
/// trace without decode): the share of a token's experts the previous token routed in the
/// same layer, and the per-layer LRU hit rate with a quarter of each layer's experts cached.
/// A mapped routing keeps the source model's locality (folded), not the model's own router's,
/// and a model that keeps more of its experts from token to token runs faster than predicted
/// (measured on two generated models: docs/simulator.md, "By budget").
pub fn locality_note(source: &RouteTrace, mapped: &RouteTrace) -> String {
    let of = |t: &RouteTrace| {
        let s = crate::stats::compute(t);
        let reuse = s.overlap.iter().find(|o| o.0 == 1).map_or(0.0, |o| o.1);
        let quarter = (s.n_expert as usize / 4).max(1);
        (100.0 * reuse, quarter, 100.0 * s.lru_hit_at(quarter))
    };
    let (m_reuse, m_q, m_hit) = of(mapped);
    let (s_reuse, s_q, s_hit) = of(source);
    format!(
        "the mapped routing carries the trace model's locality, not this model's own router's: \
         {m_reuse:.1}% of a token's experts are the previous token's (the trace: {s_reuse:.1}%), \
         a per-layer LRU of {m_q} experts (a quarter of the layer) hits {m_hit:.1}% (the trace \
         at {s_q}: {s_hit:.1}%); a model whose own router keeps more of its experts from token to \
         token runs faster than predicted"
    )
}

/// The trace's prefill and decode tokens (for the inputs summary).
pub fn count_tokens(trace: &RouteTrace) -> (usize, usize) {
    let (mut prefill, mut decode) = (0, 0);
    for s in trace.steps() {
        match s.phase {
            Phase::Prefill => prefill += 1,
            Phase::Decode => decode += 1,
        }
    }
    (prefill, decode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_map_first_to_first_and_last_to_last() {
        assert_eq!(source_layer(0, 48, 12), 0);
        assert_eq!(source_layer(11, 48, 12), 47);
        assert_eq!(source_layer(0, 12, 48), 0);
        assert_eq!(source_layer(47, 12, 48), 11);
        // Evenly between: 48 onto 12 takes every ~4.3th layer, in order, never twice.
        let v: Vec<usize> = (0..12).map(|j| source_layer(j, 48, 12)).collect();
        assert!(v.windows(2).all(|w| w[0] < w[1]), "{v:?}");
        assert_eq!(source_layer(5, 26, 26), 5);
        assert_eq!(source_layer(0, 1, 3), 0);
        assert_eq!(source_layer(2, 3, 1), 0);
    }

    #[test]
    fn folding_keeps_ranks_and_resolves_collisions() {
        // 128 -> 64: neighbours fold together; 10 and 11 collide, 11 moves to the next free id.
        assert_eq!(
            fold_routing(&[10, 11, 127, 0], 128, 64, 4),
            vec![5, 6, 63, 0]
        );
        // Narrower: the first k in rank order.
        assert_eq!(fold_routing(&[7, 3, 5], 8, 8, 2), vec![7, 3]);
        // Wider: the next free ids after the last.
        assert_eq!(fold_routing(&[7, 3], 8, 8, 4), vec![7, 3, 4, 5]);
        // Wrapping around the bank.
        assert_eq!(fold_routing(&[3, 3, 3], 4, 4, 3), vec![3, 0, 1]);
        // Every routing stays distinct and in range.
        for a in 0..32u32 {
            let r = fold_routing(&[a, (a * 7) % 32, (a * 13 + 1) % 32, 31 - a], 32, 4, 4);
            let mut s = r.clone();
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len(), 4);
            assert!(r.iter().all(|&x| x < 4));
        }
    }

    #[test]
    fn splitting_takes_first_members_in_rank_order_then_second() {
        // 64 -> 128: expert e owns {2e, 2e + 1}; top-6 -> top-8 takes the six first members in
        // rank order, then the second members of the two highest ranks.
        assert_eq!(
            split_routing(&[5, 0, 63, 7, 1, 2], 64, 128, 8),
            vec![10, 0, 126, 14, 2, 4, 11, 1]
        );
        // The same experts at the same ranks give the same ids; other ranks, other extras.
        assert_eq!(
            split_routing(&[5, 0, 63, 7, 1, 2], 64, 128, 8),
            split_routing(&[5, 0, 63, 7, 1, 2], 64, 128, 8)
        );
        assert_eq!(split_routing(&[0, 5], 64, 128, 3), vec![0, 10, 1]);
        // Uneven groups (3 -> 8: {0, 1}, {2, 3, 4}, {5, 6, 7}) and fewer ids than the trace's.
        assert_eq!(split_routing(&[2, 1, 0], 3, 8, 5), vec![5, 2, 0, 6, 3]);
        assert_eq!(split_routing(&[2, 1, 0], 3, 8, 2), vec![5, 2]);
        // More ids than the groups hold: the next free ones after the last.
        assert_eq!(split_routing(&[1], 2, 4, 3), vec![2, 3, 0]);
        // Every routing stays distinct and in range.
        for a in 0..16u32 {
            let r = split_routing(&[a, (a * 7 + 3) % 16, 15 - a], 16, 40, 6);
            let mut s = r.clone();
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len(), 6, "{r:?}");
            assert!(r.iter().all(|&x| x < 40));
        }
    }
}
