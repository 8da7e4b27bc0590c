//! From a parsed route trace to what a replay runs: the model's `ExpertLayout` (from the
//! preamble), the sequence of decode-step batches (`ReplayPlan`), and the cache's access
//! sequence (`AccessSeq`) that the cache-only path, the Belady bound and the independent
//! Python count all walk.
//!
//! **Batches.** Every decode step of the trace is one engine step of one token. A turn's
//! prefill rows (phase 0, one trace step per prompt position) are one engine step over the
//! whole prompt, as the engine runs it: each layer routes every prompt token it has rows for —
//! all of them, except the last MoE layer, which routes only the final position.
//!
//! **Batched runs** (`serve --parallel`, a trace with the `seq` column): each shared step is a
//! turn of its own; its rows are every sequence's tokens, in (sequence, position) order — the
//! engine's batch order. A step that feeds any prompt is a prefill, whose last layer routes
//! only the rows that choose a token (none, when every sequence is mid-prompt).
//!
//! **Access order.** The core's streamer looks a layer's experts up in first-use order: rows in
//! batch order, ranks in router order within a row, each expert once. `AccessSeq` is exactly
//! that order, one group per (step, MoE layer), in step order and, within a step, MoE-layer
//! order — the order the engine visits them.

use crate::error::SimError;
use bmoe_core::policy::{AccessContext, StepContext};
use bmoe_core::records::Phase;
use bmoe_core::telemetry::route_trace::{RoutePreamble, RouteTrace};
use bmoe_core::{ExpertKey, ExpertLayout, MoeLayerLayout, ProjExtent};

/// Alignment of the synthetic extents of a trace without `proj=` (the engine's O_DIRECT
/// window), so a synthetic layout pulls exactly its expert bytes per read.
pub const SYNTHETIC_ALIGN_BYTES: u64 = 4096;

/// The expert layout a trace preamble describes. With `proj=` extents (bmoe engine traces)
/// they are used verbatim, so aligned read bytes match the engine's exactly; the extents must
/// add up to the layer's `expert_bytes`. Without them (traces from other systems) each layer
/// gets one synthetic extent per expert, layers packed one after the other in shard 0, each
/// starting on a 4096-byte boundary. `# layer=` lines must be in increasing layer order.
pub fn layout_from_preamble(p: &RoutePreamble) -> Result<ExpertLayout, SimError> {
    let mut layers = Vec::with_capacity(p.layers.len());
    let mut cursor = 0u64;
    for l in &p.layers {
        let projections = if l.proj.is_empty() {
            let extent = ProjExtent {
                shard: 0,
                base_offset: cursor,
                stride_bytes: l.expert_bytes,
            };
            let span = l
                .expert_bytes
                .checked_mul(u64::from(p.n_expert))
                .and_then(|s| cursor.checked_add(s))
                .ok_or_else(|| SimError::Trace {
                    reason: format!("layer {}: the synthetic layout overflows 64 bits", l.layer),
                })?;
            cursor = span.div_ceil(SYNTHETIC_ALIGN_BYTES) * SYNTHETIC_ALIGN_BYTES;
            vec![extent]
        } else {
            let mut v = Vec::with_capacity(l.proj.len());
            let mut sum = 0u64;
            for e in &l.proj {
                let shard = u16::try_from(e.shard).map_err(|_| SimError::Trace {
                    reason: format!("layer {}: proj shard {} is above 65535", l.layer, e.shard),
                })?;
                sum = sum.saturating_add(e.stride);
                v.push(ProjExtent {
                    shard,
                    base_offset: e.offset,
                    stride_bytes: e.stride,
                });
            }
            if sum != l.expert_bytes {
                return Err(SimError::Trace {
                    reason: format!(
                        "layer {}: proj strides add up to {sum} bytes but expert_bytes={}",
                        l.layer, l.expert_bytes
                    ),
                });
            }
            v
        };
        layers.push(MoeLayerLayout {
            model_layer: l.layer,
            n_expert: p.n_expert,
            projections,
            dense_bytes: l.dense_bytes,
        });
    }
    let k = u16::try_from(p.n_expert_used).map_err(|_| SimError::Trace {
        reason: format!("n_expert_used={} is above 65535", p.n_expert_used),
    })?;
    ExpertLayout::new(p.n_layer, layers, k).map_err(|source| SimError::Layout {
        what: "preamble".to_string(),
        source,
    })
}

/// One routing row of a planned step: the batch row it routes and the trace cell it replays.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RowRef {
    pub batch_row: u32,
    /// Index into `RouteTrace::cells`.
    pub cell: u32,
}

/// One engine step of the replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanStep {
    pub turn: u32,
    pub phase: Phase,
    /// Context position of each batch row.
    pub positions: Vec<u32>,
    /// The sequence of each batch row (a batched run's `seq` column; 0 without it).
    pub seqs: Vec<u32>,
    /// Rows sorted by (MoE layer, batch row); layer `m`'s are `rows[layer_start[m] ..
    /// layer_start[m + 1]]`.
    pub rows: Vec<RowRef>,
    pub layer_start: Vec<u32>,
}

impl PlanStep {
    /// The routing rows of MoE layer `moe` (empty for a layer out of range).
    pub fn layer_rows(&self, moe: u16) -> &[RowRef] {
        let m = moe as usize;
        match (self.layer_start.get(m), self.layer_start.get(m + 1)) {
            (Some(&a), Some(&b)) => &self.rows[a as usize..b as usize],
            _ => &[],
        }
    }
}

/// One turn of the replay: an optional prefill step, then its decode steps (plan indices).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanTurn {
    pub turn: u32,
    pub prefill: Option<usize>,
    pub decode: std::ops::Range<usize>,
}

/// Every engine step a replay runs, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayPlan {
    pub steps: Vec<PlanStep>,
    pub turns: Vec<PlanTurn>,
    pub n_moe_layers: u16,
}

fn position(step: i64, turn: u32) -> Result<u32, SimError> {
    u32::try_from(step).map_err(|_| SimError::Trace {
        reason: format!(
            "turn {turn}: step {step} is not a context position (0..2^32): a routing that could not \
             be attributed to a token cannot be replayed"
        ),
    })
}

/// Sort a multi-row step's `rows` by (MoE layer, batch row) and count each layer's: entry
/// `m + 1` of the result is layer `m`'s row count (the caller sums it into `layer_start`).
fn order_rows(trace: &RouteTrace, n_moe: usize, rows: &mut [RowRef]) -> Vec<u32> {
    rows.sort_by_key(|r| (trace.cells[r.cell as usize].moe_layer, r.batch_row));
    let mut counts = vec![0u32; n_moe + 1];
    for r in rows.iter() {
        counts[trace.cells[r.cell as usize].moe_layer as usize + 1] += 1;
    }
    counts
}

impl ReplayPlan {
    /// Plan the replay of `trace`. Refuses a decode step that lacks a routing at some MoE
    /// layer, and a prefill in which some layer routes no token: the engine routes every
    /// layer of every step, so such a trace cannot be what it recorded.
    pub fn new(trace: &RouteTrace) -> Result<ReplayPlan, SimError> {
        let n_moe = trace.preamble.layers.len();
        let n_moe_layers = u16::try_from(n_moe).map_err(|_| SimError::Trace {
            reason: format!("{n_moe} MoE layers; at most 65535 are supported"),
        })?;
        let mut steps: Vec<PlanStep> = Vec::new();
        let mut turns: Vec<PlanTurn> = Vec::new();
        let mut prefill: Option<PlanStep> = None;
        let flush_prefill = |prefill: &mut Option<PlanStep>,
                             steps: &mut Vec<PlanStep>,
                             turns: &mut Vec<PlanTurn>|
         -> Result<(), SimError> {
            let Some(mut p) = prefill.take() else {
                return Ok(());
            };
            let mut layer_start = order_rows(trace, n_moe, &mut p.rows);
            // A batched step whose sequences are all mid-prompt routes none of its rows at
            // the last layer (none of them chooses a token).
            let batched_last = |m: usize| trace.has_seq_column() && m + 1 == n_moe && n_moe > 1;
            for m in 0..n_moe {
                if layer_start[m + 1] == 0 && !batched_last(m) {
                    return Err(SimError::Trace {
                        reason: format!(
                            "turn {}: the prefill routes no token at layer {}",
                            p.turn, trace.preamble.layers[m].layer
                        ),
                    });
                }
                layer_start[m + 1] += layer_start[m];
            }
            p.layer_start = layer_start;
            turns.push(PlanTurn {
                turn: p.turn,
                prefill: Some(steps.len()),
                decode: steps.len() + 1..steps.len() + 1,
            });
            steps.push(p);
            Ok(())
        };
        // Cells are sorted by (turn, phase, group, step, MoE layer): walk them a token at a time.
        let cells = &trace.cells;
        let mut first = 0usize;
        // The (turn, group) of the decode step last planned.
        let mut open_group: Option<(u32, u32)> = None;
        while first < cells.len() {
            let head = cells[first];
            let end = first
                + cells[first..]
                    .iter()
                    .take_while(|c| {
                        c.turn == head.turn
                            && c.phase == head.phase
                            && c.group == head.group
                            && c.seq == head.seq
                            && c.step == head.step
                    })
                    .count();
            let token = first..end;
            first = end;
            let ts = &head;
            match ts.phase {
                Phase::Prefill => {
                    if prefill.as_ref().is_some_and(|p| p.turn != ts.turn) {
                        flush_prefill(&mut prefill, &mut steps, &mut turns)?;
                    }
                    let p = prefill.get_or_insert_with(|| PlanStep {
                        turn: ts.turn,
                        phase: Phase::Prefill,
                        positions: Vec::new(),
                        seqs: Vec::new(),
                        rows: Vec::new(),
                        layer_start: Vec::new(),
                    });
                    let batch_row = p.positions.len() as u32;
                    p.positions.push(position(ts.step, ts.turn)?);
                    p.seqs.push(ts.seq);
                    for i in token {
                        p.rows.push(RowRef {
                            batch_row,
                            cell: i as u32,
                        });
                    }
                }
                Phase::Decode => {
                    flush_prefill(&mut prefill, &mut steps, &mut turns)?;
                    if token.len() != n_moe {
                        let have: Vec<u16> =
                            cells[token.clone()].iter().map(|c| c.moe_layer).collect();
                        let missing = (0..n_moe as u16)
                            .find(|m| !have.contains(m))
                            .map_or(0, |m| trace.preamble.layers[m as usize].layer);
                        return Err(SimError::Trace {
                            reason: format!(
                                "turn {} decode step {} has no routing at layer {missing}: every \
                                 decode step must route every MoE layer",
                                ts.turn, ts.step
                            ),
                        });
                    }
                    if turns.last().is_none_or(|t| t.turn != ts.turn) {
                        turns.push(PlanTurn {
                            turn: ts.turn,
                            prefill: None,
                            decode: steps.len()..steps.len(),
                        });
                    }
                    // A speculative run's verify decode, or a batched run's step: the
                    // positions of one group are the batch rows of one step (sorted by layer
                    // below).
                    if (trace.has_group_column() || trace.has_seq_column())
                        && turns.last().is_some_and(|t| !t.decode.is_empty())
                        && open_group == Some((ts.turn, ts.group))
                    {
                        let s = steps.last_mut().expect("the group's step");
                        let batch_row = s.positions.len() as u32;
                        s.positions.push(position(ts.step, ts.turn)?);
                        s.seqs.push(ts.seq);
                        s.rows.extend(token.map(|i| RowRef {
                            batch_row,
                            cell: i as u32,
                        }));
                        continue;
                    }
                    open_group = Some((ts.turn, ts.group));
                    let rows = token
                        .map(|i| RowRef {
                            batch_row: 0,
                            cell: i as u32,
                        })
                        .collect();
                    steps.push(PlanStep {
                        turn: ts.turn,
                        phase: Phase::Decode,
                        positions: vec![position(ts.step, ts.turn)?],
                        seqs: vec![ts.seq],
                        rows,
                        layer_start: (0..=n_moe as u32).collect(),
                    });
                    if let Some(t) = turns.last_mut() {
                        t.decode.end = steps.len();
                    }
                }
            }
        }
        flush_prefill(&mut prefill, &mut steps, &mut turns)?;
        // A verify decode's rows in (MoE layer, batch row) order, as every step's.
        for s in steps
            .iter_mut()
            .filter(|s| s.positions.len() > 1 && s.phase == Phase::Decode)
        {
            let mut layer_start = order_rows(trace, n_moe, &mut s.rows);
            for m in 0..n_moe {
                layer_start[m + 1] += layer_start[m];
            }
            s.layer_start = layer_start;
        }
        Ok(ReplayPlan {
            steps,
            turns,
            n_moe_layers,
        })
    }

    /// Decode steps in the plan.
    pub fn decode_steps(&self) -> usize {
        self.turns.iter().map(|t| t.decode.len()).sum()
    }
}

/// The cache's access sequence: for every (step, MoE layer), the distinct experts the layer
/// routes in the streamer's first-use order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AccessSeq {
    pub keys: Vec<ExpertKey>,
    /// Group `g` is `keys[group_end[g-1] .. group_end[g]]`.
    pub group_end: Vec<u32>,
    /// Routed (row, rank) slots the groups came from, before de-duplication: what a replay
    /// "routes".
    pub routings: u64,
    /// Beside `keys`: each key's routing in its group, as the streamer hands it to the policy
    /// (rows, best rank, router weights — narrowed as the top-k override narrows them). A
    /// sequence built by hand may leave it empty: then every key gets `AccessContext::NONE`.
    pub access: Vec<AccessContext>,
    /// Each group's MoE layer (empty for a sequence built by hand: the group's first key's).
    pub group_layer: Vec<u16>,
    /// The engine steps: the group each begins at, and what the policy is told of it (empty
    /// for a sequence built by hand: no step boundaries are told).
    pub steps: Vec<(u32, StepContext)>,
}

impl AccessSeq {
    /// The access sequence of `plan` over `trace`, keeping the first `k` ranks of each
    /// routing (`k = 0`: all of them; the `--n-expert-used` override otherwise).
    pub fn new(trace: &RouteTrace, plan: &ReplayPlan, k: u16) -> AccessSeq {
        let n_expert = trace.preamble.n_expert as usize;
        let mut stamp = vec![u32::MAX; n_expert];
        // Per expert id: its position in `keys` (valid when stamped this epoch).
        let mut pos = vec![0u32; n_expert];
        let mut weights: Vec<f32> = Vec::new();
        let mut out = AccessSeq::default();
        let mut epoch = 0u32;
        for step in &plan.steps {
            out.steps.push((
                out.group_end.len() as u32,
                StepContext {
                    turn: step.turn,
                    phase: step.phase,
                    n_rows: step.positions.len() as u32,
                },
            ));
            for m in 0..plan.n_moe_layers {
                epoch = epoch.wrapping_add(1);
                if epoch == u32::MAX {
                    stamp.fill(u32::MAX);
                    epoch = 0;
                }
                for row in step.layer_rows(m) {
                    let cell = &trace.cells[row.cell as usize];
                    let slots = trace.cell_slots(cell);
                    let take = if k == 0 {
                        slots.len()
                    } else {
                        slots.len().min(k as usize)
                    };
                    out.routings += take as u64;
                    // The weights the replayed routing carries: the top-k override narrows
                    // them as the recorded gating would (hooks::TopKOverride, no probabilities).
                    weights.clear();
                    weights.extend(slots.iter().map(|s| s.weight));
                    if take < slots.len() {
                        trace.preamble.gating.narrow(&mut weights, take);
                    }
                    for (rank, s) in slots[..take].iter().enumerate() {
                        let e = s.expert as usize;
                        if stamp[e] != epoch {
                            stamp[e] = epoch;
                            pos[e] = out.keys.len() as u32;
                            out.keys.push(ExpertKey {
                                layer: m,
                                expert: s.expert as u16,
                            });
                            out.access.push(AccessContext::NONE);
                        }
                        out.access[pos[e] as usize].add_use(rank as u16, weights[rank]);
                    }
                }
                out.group_end.push(out.keys.len() as u32);
                out.group_layer.push(m);
            }
        }
        out
    }

    /// Number of groups.
    pub fn n_groups(&self) -> usize {
        self.group_end.len()
    }

    /// The groups, in order.
    pub fn groups(&self) -> impl Iterator<Item = &[ExpertKey]> + '_ {
        let mut start = 0usize;
        self.group_end.iter().map(move |&end| {
            let g = &self.keys[start..end as usize];
            start = end as usize;
            g
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = "# route_trace v1
# model=m arch=a n_layer=3 n_expert=4 n_expert_used=2
# layer=1 expert_bytes=8192 dense_bytes=100
# layer=2 expert_bytes=8192 dense_bytes=300 proj=0:0:4096,1:100:4096
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped
0,0,0,1,0,0,0.6,0,8192,0
0,0,0,1,1,1,0.4,0,8192,0
0,0,1,1,0,1,0.7,0,0,0
0,0,1,1,1,2,0.3,0,8192,0
0,0,1,2,0,3,0.5,0,8192,0
0,0,1,2,1,2,0.5,0,8192,0
0,1,2,1,0,2,0.9,0,8192,0
0,1,2,1,1,3,0.1,0,8192,0
0,1,2,2,0,0,0.9,0,8192,0
0,1,2,2,1,1,0.1,0,8192,0
";

    #[test]
    fn layouts_use_exact_or_synthetic_extents() {
        let t = RouteTrace::parse(TRACE).expect("trace");
        let l = layout_from_preamble(&t.preamble).expect("layout");
        assert_eq!(l.n_moe_layers(), 2);
        assert_eq!(l.moe_index(1), Some(0));
        assert_eq!(l.moe_index(0), None);
        let k1 = ExpertKey {
            layer: 0,
            expert: 1,
        };
        assert_eq!(l.extent(k1, 0), Some((0, 8192, 8192)), "synthetic");
        let k2 = ExpertKey {
            layer: 1,
            expert: 3,
        };
        assert_eq!(l.extent(k2, 1), Some((1, 100 + 3 * 4096, 4096)), "exact");

        let bad = TRACE.replace("proj=0:0:4096,1:100:4096", "proj=0:0:4096");
        let t = RouteTrace::parse(&bad).expect("trace");
        assert!(layout_from_preamble(&t.preamble)
            .expect_err("strides")
            .to_string()
            .contains("add up"));
    }

    #[test]
    fn prefill_is_one_batch_and_the_last_layer_routes_the_last_token() {
        let t = RouteTrace::parse(TRACE).expect("trace");
        let p = ReplayPlan::new(&t).expect("plan");
        assert_eq!(p.steps.len(), 2);
        assert_eq!(
            p.turns,
            vec![PlanTurn {
                turn: 0,
                prefill: Some(0),
                decode: 1..2
            }]
        );
        let pre = &p.steps[0];
        assert_eq!(pre.positions, vec![0, 1]);
        assert_eq!(pre.layer_rows(0).len(), 2);
        assert_eq!(pre.layer_rows(1).len(), 1);
        assert_eq!(pre.layer_rows(1)[0].batch_row, 1);
        assert_eq!(p.decode_steps(), 1);

        let seq = AccessSeq::new(&t, &p, 0);
        let groups: Vec<Vec<(u16, u16)>> = seq
            .groups()
            .map(|g| g.iter().map(|k| (k.layer, k.expert)).collect())
            .collect();
        assert_eq!(
            groups,
            vec![
                vec![(0, 0), (0, 1), (0, 2)],
                vec![(1, 3), (1, 2)],
                vec![(0, 2), (0, 3)],
                vec![(1, 0), (1, 1)],
            ]
        );
        assert_eq!(seq.routings, 10);
        let top1 = AccessSeq::new(&t, &p, 1);
        assert_eq!(top1.routings, 5);
        assert_eq!(top1.keys.len(), 5);
    }

    #[test]
    fn a_decode_step_missing_a_layer_is_refused() {
        let text = TRACE.replace("0,1,2,2,0,0,0.9,0,8192,0\n0,1,2,2,1,1,0.1,0,8192,0\n", "");
        // The reader itself refuses a per-layer count mismatch; build one it accepts: two
        // decode steps each missing a different layer.
        let text = format!("{text}0,1,3,2,0,0,0.9,0,8192,0\n0,1,3,2,1,1,0.1,0,8192,0\n");
        let t = RouteTrace::parse(&text).expect("trace");
        let e = ReplayPlan::new(&t).expect_err("missing layer");
        assert!(e.to_string().contains("no routing at layer"), "{e}");
    }
}
