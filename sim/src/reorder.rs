//! The reordering study: how many flash requests a co-activation-aware placement of the
//! experts in the file would save on a trace, per cache budget and policy.
//!
//! Experts are stacked one tensor per projection, so expert `e` of a projection is the extent
//! at `base + e·stride` (`layout.rs`): two experts with adjacent ids are adjacent bytes, and a
//! reader that merged the misses of one (step, layer) into runs of adjacent experts would read
//! a run with one request per projection instead of one per expert. Which experts are adjacent
//! is the file's choice: a file written with the experts of each layer permuted so that experts
//! routed together sit side by side makes those runs longer — fewer, larger reads for the same
//! bytes.
//!
//! The study prices that, on the misses the core's cache and policy produce (`cache_only`,
//! the same cache a full replay runs), for these placements:
//!
//! - `separate`: every missed (expert, projection) extent is its own request — what the
//!   streamer reads today;
//! - `file`: the file's own order, misses merged into runs of adjacent ids;
//! - `coact`: a co-activation placement **fitted on the first half** of the trace (its first
//!   half of turns, or of decode steps for a one-turn trace) and **counted on the second**, so
//!   the saving is out of sample;
//! - `coact-in-sample`: the same fit on the counted half itself, an upper bound of what this
//!   placement heuristic finds.
//!
//! Every placement is counted on the same misses (a placement relabels a layer's experts; it
//! changes no routing and, for the core's policies, no residency), over the decode steps of the
//! counted half only: a prefill step reads the union of the prompt's experts and merges runs
//! trivially.
//!
//! The fit: per MoE layer, `C[i][j]` counts the decode steps of the fitted half that routed
//! both `i` and `j`; a path cover is built greedily from the heaviest pairs (an edge joins two
//! experts that are both still path ends of different paths — the greedy heuristic for a
//! maximum-weight Hamiltonian path), and the paths are laid out heaviest-routed first, unrouted
//! experts last in id order. Deterministic: ties break by expert id.
//!
//! Time is priced with the device profile's flash, one lane: `requests × read_latency +
//! window bytes / lane rate`, the windows aligned as the run reads them (O_DIRECT: 4096). It is
//! a study of read requests, not a replay: the streamer does not merge reads today, so the
//! sweep's tok/s columns do not move with `--placements`.

use crate::error::SimError;
use crate::flash::FlashParams;
use crate::plan::{AccessSeq, ReplayPlan};
use bmoe_core::policy::EvictionPolicy;
use bmoe_core::records::Phase;
use bmoe_core::{ExpertKey, ExpertLayout};
use rayon::prelude::*;

/// One placement the study compares.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// One request per missed extent (the streamer today).
    Separate,
    /// The file's order, runs merged.
    File,
    /// Co-activation order fitted on the first half, counted on the second.
    Coact,
    /// Co-activation order fitted on the counted half itself (an upper bound).
    CoactInSample,
}

impl Placement {
    /// Every placement, in table order.
    pub const ALL: [Placement; 4] = [
        Placement::Separate,
        Placement::File,
        Placement::Coact,
        Placement::CoactInSample,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Placement::Separate => "separate",
            Placement::File => "file",
            Placement::Coact => "coact",
            Placement::CoactInSample => "coact-in-sample",
        }
    }

    pub fn parse(s: &str) -> Result<Placement, SimError> {
        Placement::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                SimError::invalid(
                    "--placements",
                    format!("'{s}' is not separate, file, coact or coact-in-sample"),
                )
            })
    }
}

/// Which decode steps fit the placement and which are counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    /// Per plan step: fitted on.
    pub fit: Vec<bool>,
    /// Per plan step: counted.
    pub count: Vec<bool>,
    /// How the split was made, for the report.
    pub rule: String,
}

impl Split {
    /// Halve `plan` by turns when it has at least two turns that decode, else by the decode
    /// steps of its one turn. Refuses a plan with fewer than two decode steps.
    pub fn halves(plan: &ReplayPlan) -> Result<Split, SimError> {
        let n = plan.steps.len();
        let mut fit = vec![false; n];
        let mut count = vec![false; n];
        let decoding: Vec<_> = plan.turns.iter().filter(|t| !t.decode.is_empty()).collect();
        let rule = if decoding.len() >= 2 {
            let half = decoding.len() / 2;
            for (i, t) in decoding.iter().enumerate() {
                let side = if i < half { &mut fit } else { &mut count };
                for s in t.decode.clone() {
                    side[s] = true;
                }
            }
            format!(
                "fitted on the decode steps of the first {half} of {} turns, counted on the other {}",
                decoding.len(),
                decoding.len() - half
            )
        } else {
            let steps: Vec<usize> = decoding.iter().flat_map(|t| t.decode.clone()).collect();
            if steps.len() < 2 {
                return Err(SimError::invalid(
                    "--placements",
                    format!(
                        "the trace has {} decode step(s): a placement needs some to fit on and \
                         others to count on",
                        steps.len()
                    ),
                ));
            }
            let half = steps.len() / 2;
            for (i, &s) in steps.iter().enumerate() {
                if i < half {
                    fit[s] = true;
                } else {
                    count[s] = true;
                }
            }
            format!(
                "one turn: fitted on its first {half} of {} decode steps, counted on the other {}",
                steps.len(),
                steps.len() - half
            )
        };
        debug_assert!(plan
            .steps
            .iter()
            .enumerate()
            .all(|(i, s)| !(fit[i] || count[i]) || s.phase == Phase::Decode));
        Ok(Split { fit, count, rule })
    }
}

/// Per MoE layer, `position[expert]`: where the expert sits in the layer's stacked tensors.
pub type Positions = Vec<Vec<u32>>;

/// The file's own order.
pub fn identity(layout: &ExpertLayout) -> Positions {
    layout
        .layers()
        .iter()
        .map(|l| (0..l.n_expert).collect())
        .collect()
}

/// The co-activation placement fitted on the groups of `seq` whose step `steps[g / n_moe]`
/// is set.
pub fn fit_coact(layout: &ExpertLayout, seq: &AccessSeq, steps: &[bool]) -> Positions {
    let n_moe = usize::from(layout.n_moe_layers()).max(1);
    let mut pair: Vec<Vec<u32>> = layout
        .layers()
        .iter()
        .map(|l| vec![0u32; (l.n_expert as usize).pow(2)])
        .collect();
    let mut routed: Vec<Vec<u64>> = layout
        .layers()
        .iter()
        .map(|l| vec![0u64; l.n_expert as usize])
        .collect();
    for (g, group) in seq.groups().enumerate() {
        if !steps.get(g / n_moe).copied().unwrap_or(false) {
            continue;
        }
        for (a, ka) in group.iter().enumerate() {
            let m = usize::from(ka.layer);
            let n = layout.layers()[m].n_expert as usize;
            routed[m][usize::from(ka.expert)] += 1;
            for kb in &group[a + 1..] {
                let (i, j) = (usize::from(ka.expert), usize::from(kb.expert));
                let (i, j) = (i.min(j), i.max(j));
                pair[m][i * n + j] += 1;
            }
        }
    }
    layout
        .layers()
        .iter()
        .enumerate()
        .map(|(m, l)| order_layer(l.n_expert as usize, &pair[m], &routed[m]))
        .collect()
}

/// A greedy maximum-weight path cover of one layer's co-activation graph, laid out as
/// positions (see the module docs).
fn order_layer(n: usize, pair: &[u32], routed: &[u64]) -> Vec<u32> {
    let mut edges: Vec<(u32, usize, usize)> = Vec::new();
    for i in 0..n {
        for j in i + 1..n {
            let w = pair[i * n + j];
            if w > 0 {
                edges.push((w, i, j));
            }
        }
    }
    edges.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut parent: Vec<usize> = (0..n).collect();
    fn root(parent: &mut [usize], mut x: usize) -> usize {
        while parent[x] != x {
            parent[x] = parent[parent[x]];
            x = parent[x];
        }
        x
    }
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (_, i, j) in edges {
        if next[i].len() >= 2 || next[j].len() >= 2 {
            continue;
        }
        let (ri, rj) = (root(&mut parent, i), root(&mut parent, j));
        if ri == rj {
            continue;
        }
        parent[ri] = rj;
        next[i].push(j);
        next[j].push(i);
    }
    // Walk each path from its lower-id end.
    let mut seen = vec![false; n];
    let mut paths: Vec<Vec<usize>> = Vec::new();
    for start in 0..n {
        if seen[start] || next[start].len() > 1 {
            continue;
        }
        let mut path = vec![start];
        seen[start] = true;
        let mut prev = usize::MAX;
        let mut at = start;
        while let Some(&to) = next[at].iter().find(|&&x| x != prev && !seen[x]) {
            seen[to] = true;
            path.push(to);
            prev = at;
            at = to;
        }
        paths.push(path);
    }
    debug_assert!(seen.iter().all(|&s| s), "a path cover has no cycle");
    let weight = |p: &Vec<usize>| p.iter().map(|&e| routed[e]).sum::<u64>();
    paths.sort_by(|a, b| weight(b).cmp(&weight(a)).then(a[0].cmp(&b[0])));
    let mut position = vec![0u32; n];
    for (p, e) in paths.iter().flatten().enumerate() {
        position[*e] = p as u32;
    }
    position
}

/// What one (budget, policy, placement) cell counted over the counted decode steps.
#[derive(Clone, Debug, PartialEq)]
pub struct PlacementRow {
    pub budget_bytes: u64,
    pub policy: String,
    pub placement: Placement,
    /// Decode tokens counted.
    pub tokens: u64,
    /// Missed experts.
    pub misses: u64,
    /// Flash requests (one per run of adjacent missed experts per projection).
    pub requests: u64,
    /// Bytes the requests' aligned windows read.
    pub window_bytes: u64,
    /// Modelled one-lane read time, seconds.
    pub read_s: f64,
}

impl PlacementRow {
    pub fn per_token(&self, v: f64) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            v / self.tokens as f64
        }
    }
}

/// Counts of one placement over one cell.
#[derive(Copy, Clone, Default)]
struct Tally {
    requests: u64,
    window_bytes: u64,
}

fn align_down(x: u64, a: u64) -> u64 {
    x - x % a
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a).saturating_mul(a)
}

/// Add the reads of one group's `misses` under `pos` (None = every extent separate).
fn tally(
    layout: &ExpertLayout,
    misses: &[ExpertKey],
    pos: Option<&Positions>,
    align: u64,
    scratch: &mut Vec<u32>,
    t: &mut Tally,
) {
    let Some(first) = misses.first() else {
        return;
    };
    let m = usize::from(first.layer);
    let l = &layout.layers()[m];
    scratch.clear();
    match pos {
        Some(p) => scratch.extend(misses.iter().map(|k| p[m][usize::from(k.expert)])),
        None => scratch.extend(misses.iter().map(|k| u32::from(k.expert))),
    }
    scratch.sort_unstable();
    // Runs of adjacent positions: [a, b] inclusive.
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &x in scratch.iter() {
        match runs.last_mut() {
            Some((_, b)) if pos.is_some() && *b + 1 == x => *b = x,
            _ => runs.push((x, x)),
        }
    }
    for proj in &l.projections {
        for &(a, b) in &runs {
            let start = proj.base_offset + u64::from(a) * proj.stride_bytes;
            let end = proj.base_offset + (u64::from(b) + 1) * proj.stride_bytes;
            t.requests += 1;
            t.window_bytes += align_up(end, align) - align_down(start, align);
        }
    }
}

/// Builds a fresh eviction policy for a cell, by name.
pub type PolicyMaker = dyn Fn(&str) -> Result<Box<dyn EvictionPolicy>, SimError> + Sync;

/// What the study needs besides the cells.
pub struct StudyInput<'a> {
    pub layout: &'a ExpertLayout,
    pub plan: &'a ReplayPlan,
    pub seq: &'a AccessSeq,
    /// Top-k the cache is built with.
    pub k: u16,
    pub flash: &'a FlashParams,
    /// The run reads with O_DIRECT (aligned windows).
    pub o_direct: bool,
}

/// Count every placement of `placements` for every (budget, policy) cell on a pool of `jobs`
/// threads; rows come back in (budget, policy, placement) order whatever `jobs` is.
/// `make_policy` builds a fresh policy for a cell by name.
pub fn study(
    input: &StudyInput<'_>,
    budgets: &[u64],
    policies: &[String],
    placements: &[Placement],
    make_policy: &PolicyMaker,
    jobs: usize,
) -> Result<(Vec<PlacementRow>, String), SimError> {
    let split = Split::halves(input.plan)?;
    let file = identity(input.layout);
    let coact = fit_coact(input.layout, input.seq, &split.fit);
    let in_sample = fit_coact(input.layout, input.seq, &split.count);
    let n_moe = usize::from(input.layout.n_moe_layers()).max(1);
    let tokens = split.count.iter().filter(|&&c| c).count() as u64;
    let align = if input.o_direct {
        input.flash.align_bytes.max(1)
    } else {
        1
    };
    let cells: Vec<(u64, &String)> = budgets
        .iter()
        .flat_map(|&b| policies.iter().map(move |p| (b, p)))
        .collect();
    let one = |&(budget, name): &(u64, &String)| -> Result<Vec<PlacementRow>, SimError> {
        let mut tallies = vec![Tally::default(); placements.len()];
        let mut misses_n = 0u64;
        let mut scratch = Vec::new();
        crate::cache_only::run_observed(
            input.layout,
            input.seq,
            budget,
            input.k,
            make_policy(name)?,
            &mut |g, misses| {
                if !split.count.get(g / n_moe).copied().unwrap_or(false) {
                    return;
                }
                misses_n += misses.len() as u64;
                for (t, p) in tallies.iter_mut().zip(placements) {
                    let pos = match p {
                        Placement::Separate => None,
                        Placement::File => Some(&file),
                        Placement::Coact => Some(&coact),
                        Placement::CoactInSample => Some(&in_sample),
                    };
                    tally(input.layout, misses, pos, align, &mut scratch, t);
                }
            },
        )?;
        Ok(placements
            .iter()
            .zip(&tallies)
            .map(|(&placement, t)| PlacementRow {
                budget_bytes: budget,
                policy: name.clone(),
                placement,
                tokens,
                misses: misses_n,
                requests: t.requests,
                window_bytes: t.window_bytes,
                read_s: t.requests as f64 * input.flash.read_latency_us * 1e-6
                    + t.window_bytes as f64
                        / (input.flash.lane_mib_per_s * bmoe_core::config::MIB as f64),
            })
            .collect())
    };
    let per_cell: Vec<Vec<PlacementRow>> = if jobs <= 1 {
        cells.iter().map(one).collect::<Result<_, _>>()?
    } else {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(jobs)
            .build()
            .map_err(|e| {
                SimError::invalid("--jobs", format!("cannot start {jobs} threads: {e}"))
            })?;
        pool.install(|| cells.par_iter().map(one).collect::<Result<_, _>>())?
    };
    Ok((per_cell.into_iter().flatten().collect(), split.rule))
}

/// The tidy CSV: one row per (budget, policy, placement).
pub fn csv(rows: &[PlacementRow], per_layer_expert: u64) -> String {
    let mut s = String::from(
        "budget_mib,experts_per_layer,policy,placement,tokens,misses,requests,window_bytes,\
         misses_per_token,requests_per_token,kib_per_request,window_mib_per_token,\
         read_ms_per_token,saving_vs_separate_pct\n",
    );
    for r in rows {
        let base = rows
            .iter()
            .find(|b| {
                b.budget_bytes == r.budget_bytes
                    && b.policy == r.policy
                    && b.placement == Placement::Separate
            })
            .map(|b| b.read_s);
        let saving = base.filter(|&b| b > 0.0).map_or(String::new(), |b| {
            format!("{:.2}", 100.0 * (1.0 - r.read_s / b))
        });
        s.push_str(&format!(
            "{:.1},{:.2},{},{},{},{},{},{},{:.3},{:.3},{:.1},{:.3},{:.4},{}\n",
            r.budget_bytes as f64 / bmoe_core::config::MIB as f64,
            r.budget_bytes as f64 / per_layer_expert.max(1) as f64,
            r.policy,
            r.placement.name(),
            r.tokens,
            r.misses,
            r.requests,
            r.window_bytes,
            r.per_token(r.misses as f64),
            r.per_token(r.requests as f64),
            if r.requests == 0 {
                0.0
            } else {
                r.window_bytes as f64 / r.requests as f64 / 1024.0
            },
            r.per_token(r.window_bytes as f64) / bmoe_core::config::MIB as f64,
            r.per_token(r.read_s) * 1e3,
            saving
        ));
    }
    s
}

/// The Markdown table: per (budget, policy), requests and modelled read time per token for
/// each placement, and the savings against separate reads and against the file's order.
pub fn markdown(
    rows: &[PlacementRow],
    per_layer_expert: u64,
    trace_name: &str,
    rule: &str,
    profile: &str,
) -> String {
    let mut s = format!(
        "# Reordering study: {trace_name}\n\n\
         Read requests per decode token if a reader merged each layer's misses into runs of \
         adjacent experts, for the file's order and a co-activation placement; modelled read \
         time on one lane of profile `{profile}` (requests × latency + aligned bytes ÷ lane \
         rate). Placement {rule}.\n\n\
         | budget MiB | experts/layer | policy | misses/tok | placement | requests/tok | KiB/request | read ms/tok | vs separate | vs file |\n\
         | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n"
    );
    let find = |r: &PlacementRow, p: Placement| {
        rows.iter()
            .find(|b| b.budget_bytes == r.budget_bytes && b.policy == r.policy && b.placement == p)
            .map(|b| b.read_s)
    };
    let delta = |v: f64, base: Option<f64>| match base {
        Some(b) if b > 0.0 && v != b => format!("{:+.1} %", 100.0 * (v / b - 1.0)),
        Some(b) if b > 0.0 => "±0".to_string(),
        _ => "—".to_string(),
    };
    for r in rows {
        s.push_str(&format!(
            "| {:.0} | {:.2} | {} | {:.2} | {} | {:.2} | {:.0} | {:.3} | {} | {} |\n",
            r.budget_bytes as f64 / bmoe_core::config::MIB as f64,
            r.budget_bytes as f64 / per_layer_expert.max(1) as f64,
            r.policy,
            r.per_token(r.misses as f64),
            r.placement.name(),
            r.per_token(r.requests as f64),
            if r.requests == 0 {
                0.0
            } else {
                r.window_bytes as f64 / r.requests as f64 / 1024.0
            },
            r.per_token(r.read_s) * 1e3,
            delta(r.read_s, find(r, Placement::Separate)),
            delta(r.read_s, find(r, Placement::File)),
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_of_pairs_is_laid_out_adjacent() {
        // 6 experts; 0-3 and 3-5 and 1-4 co-activate, 2 never routes.
        let n = 6;
        let mut pair = vec![0u32; n * n];
        let mut set = |i: usize, j: usize, w: u32| pair[i.min(j) * n + i.max(j)] = w;
        set(0, 3, 10);
        set(3, 5, 8);
        set(1, 4, 5);
        set(0, 5, 1); // would close a cycle: refused
        let routed = vec![11, 5, 0, 18, 5, 9];
        let pos = order_layer(n, &pair, &routed);
        let mut order = vec![0usize; n];
        for (e, &p) in pos.iter().enumerate() {
            order[p as usize] = e;
        }
        // Heaviest path first (0-3-5, routed 38), then 1-4 (10), then the unrouted 2.
        assert_eq!(order, vec![0, 3, 5, 1, 4, 2]);
    }

    #[test]
    fn every_layout_is_a_permutation() {
        let n = 16;
        let mut pair = vec![0u32; n * n];
        for i in 0..n {
            for j in i + 1..n {
                pair[i * n + j] = ((i * 7 + j * 13) % 5) as u32;
            }
        }
        let routed: Vec<u64> = (0..n as u64).map(|i| i % 3).collect();
        let mut pos = order_layer(n, &pair, &routed);
        pos.sort_unstable();
        assert_eq!(pos, (0..n as u32).collect::<Vec<_>>());
    }

    #[test]
    fn names_round_trip() {
        for p in Placement::ALL {
            assert_eq!(Placement::parse(p.name()).expect("parses"), p);
        }
        assert!(Placement::parse("coactivation").is_err());
    }
}
