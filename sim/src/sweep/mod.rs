//! Sweeps: one trace replayed over a grid of cache budgets × eviction policies × I/O lanes ×
//! overlap, each cell a full-timing replay through the core, run in parallel on a `rayon`
//! pool. When only hit rates are wanted (`Mode::CacheOnly`, `sweep --cache-only`), each cell is
//! a cache-only replay instead (`cache_only.rs`: the core's cache and policy over the access
//! sequence, no flash, compute or clock) over budgets × policies alone: the same hits, misses,
//! evictions, re-reads and per-layer and per-turn decode counts, and no time at all
//! (`Row::timing` is `None`, and every output says which mode wrote it). Cells are independent and deterministic (seeded), and come back in grid order, so a
//! parallel sweep writes exactly the bytes a serial one does (`--jobs 1`; a test checks it).
//! Every budget also gets the Belady (clairvoyant) bound (`belady.rs`) as a policy, so each
//! table row and plot shows how far a policy is from the best any policy could do.
//!
//! A predictor axis (`Predictor`: none, previous-token `--prefetch K`, `--predict-prefetch`,
//! `--route-ahead N`) runs the grid once per predictor, each from the routing that predictor
//! replays (`predictions::resolve`); the Belady bound runs only without a predictor, since
//! speculative admissions are outside the demand sequence it is clairvoyant over.
//!
//! Every cell also counts its decode routings per MoE layer and per turn (`CellCounter`, a
//! route-record sink), so the outputs (`report.rs`: tidy CSV, Markdown pivot, per-layer
//! table, bootstrap intervals over turns; `plot.rs`: SVG and PNG charts) need no second run.

use crate::belady::Clairvoyant;
use crate::error::SimError;
use crate::plan::{AccessSeq, ReplayPlan};
use crate::profile::DeviceProfile;
use crate::replay::{self, ReplayOutputs, ReplaySetup};
use bmoe_core::config::{RunConfig, MIB};
use bmoe_core::policy::{self, EvictionPolicy};
use bmoe_core::records::{Phase, RecordSink, RouteRecord};
use bmoe_core::telemetry::route_trace::RouteTrace;
use bmoe_core::ExpertLayout;
use rayon::prelude::*;
use std::sync::Arc;

pub mod plot;
pub mod report;

/// The analysis-only policy name the sweep adds to the core's.
pub const BELADY: &str = "belady";

/// The policies a sweep runs by default: every policy the core has, then Belady.
pub fn default_policies() -> Vec<String> {
    policy::POLICY_NAMES
        .iter()
        .map(|s| s.to_string())
        .chain(std::iter::once(BELADY.to_string()))
        .collect()
}

/// Default budgets, as experts per MoE layer: every count from top-k to the whole layer on
/// small layers (≤ 16 experts), else top-k × {1, 1.5, 2, 3, 4, 6, 8} and the whole layer.
pub fn default_experts_per_layer(k: u32, n_expert: u32) -> Vec<u32> {
    let mut v: Vec<u32> = if n_expert <= 16 {
        (k..=n_expert).collect()
    } else {
        [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]
            .iter()
            .map(|f| (f64::from(k) * f).round() as u32)
            .filter(|&n| n < n_expert)
            .chain(std::iter::once(n_expert))
            .collect()
    };
    v.dedup();
    v
}

/// An expert predictor a sweep compares, by its flag.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Predictor {
    /// No prediction.
    None,
    /// `--prefetch K`: previous-token speculative prefetch.
    Prefetch(u32),
    /// `--predict-prefetch`: stale-gate speculative prefetch (needs `pred1` in the trace).
    PredictPrefetch,
    /// `--route-ahead N` (needs a route-ahead-N trace or `pred<N>`).
    RouteAhead(u32),
}

impl Predictor {
    /// Parse `none`, `prefetch:K`, `predict-prefetch` or `route-ahead:N`.
    pub fn parse(s: &str) -> Result<Predictor, SimError> {
        let bad = || {
            SimError::invalid(
                "--predictors",
                format!("'{s}' is not none, prefetch:<K>, predict-prefetch or route-ahead:<N>"),
            )
        };
        let number = |v: &str| -> Result<u32, SimError> {
            v.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(bad)
        };
        match s.split_once(':') {
            None if s == "none" => Ok(Predictor::None),
            None if s == "predict-prefetch" => Ok(Predictor::PredictPrefetch),
            Some(("prefetch", k)) => Ok(Predictor::Prefetch(number(k)?)),
            Some(("route-ahead", n)) => Ok(Predictor::RouteAhead(number(n)?)),
            _ => Err(bad()),
        }
    }

    /// The name `parse` reads back (the table's `predictor` column).
    pub fn name(&self) -> String {
        match self {
            Predictor::None => "none".into(),
            Predictor::Prefetch(k) => format!("prefetch:{k}"),
            Predictor::PredictPrefetch => "predict-prefetch".into(),
            Predictor::RouteAhead(n) => format!("route-ahead:{n}"),
        }
    }

    /// Set this predictor's flag on `cfg` (and clear the others).
    pub fn apply(&self, cfg: &mut RunConfig) {
        cfg.prefetch = 0;
        cfg.predict_prefetch = false;
        cfg.route_ahead = 0;
        match *self {
            Predictor::None => {}
            Predictor::Prefetch(k) => cfg.prefetch = k,
            Predictor::PredictPrefetch => cfg.predict_prefetch = true,
            Predictor::RouteAhead(n) => cfg.route_ahead = n,
        }
    }
}

/// The grid.
#[derive(Clone, Debug, PartialEq)]
pub struct Grid {
    /// Cache budgets in bytes.
    pub budgets: Vec<u64>,
    pub policies: Vec<String>,
    pub lanes: Vec<u32>,
    pub overlap: Vec<bool>,
}

impl Grid {
    /// Cells in grid order: budget, then policy, lanes, overlap.
    pub fn cells(&self) -> Vec<(u64, String, u32, bool)> {
        let mut out = Vec::new();
        for &b in &self.budgets {
            for p in &self.policies {
                for &l in &self.lanes {
                    for &o in &self.overlap {
                        out.push((b, p.clone(), l, o));
                    }
                }
            }
        }
        out
    }

    /// The cells `mode` runs, in grid order: every cell with full timing; with cache-only
    /// timing, one per budget and policy (lanes 0, overlap off: a cache-only cell models
    /// neither).
    pub fn cells_in(&self, mode: Mode) -> Vec<(u64, String, u32, bool)> {
        match mode {
            Mode::FullTiming => self.cells(),
            Mode::CacheOnly => {
                let mut v = Vec::with_capacity(self.budgets.len() * self.policies.len());
                for &b in &self.budgets {
                    for p in &self.policies {
                        v.push((b, p.clone(), 0, false));
                    }
                }
                v
            }
        }
    }
}

/// What a sweep's cells run.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Each cell a full-timing replay (`replay::run`): counts, bytes read and modelled times.
    FullTiming,
    /// Each cell a cache-only replay (`cache_only::run_observed`): counts only.
    CacheOnly,
}

impl Mode {
    /// The name the outputs carry (`sweep.csv`'s `mode` column).
    pub fn name(self) -> &'static str {
        match self {
            Mode::FullTiming => "full-timing",
            Mode::CacheOnly => "cache-only",
        }
    }
}

/// A turn's decode tokens and modelled decode time (full-timing cells only).
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct TurnTime {
    /// Decode tokens.
    pub tokens: u64,
    /// Modelled decode seconds (Σ wall).
    pub decode_s: f64,
}

/// Decode routings and hits of one turn, and its modelled decode time.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct TurnStat {
    /// Decode routings (dropped ones excluded).
    pub routings: u64,
    /// Of those, found resident (a speculative prefetch's first touch included).
    pub hits: u64,
    /// `None` in a cache-only cell, which models no time.
    pub time: Option<TurnTime>,
}

/// What only a full-timing cell measures: the reads the streamer issued and the modelled
/// times.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct Timing {
    /// Flash bytes read (aligned windows; demand and speculative).
    pub read_bytes: u64,
    /// Speculative (prefetch / route-ahead) reads: experts, of which later routed, and bytes.
    pub spec_experts: u64,
    pub spec_useful: u64,
    pub spec_read_bytes: u64,
    pub tokens: u64,
    pub tok_s: f64,
    pub s_per_tok: f64,
    pub compute_s_per_tok: f64,
    pub io_s_per_tok: f64,
    pub stall_s_per_tok: f64,
    pub mgmt_s_per_tok: f64,
}

/// One cell's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The predictor (`Predictor::name`).
    pub predictor: String,
    pub budget_bytes: u64,
    /// The budget in experts per MoE layer (budget / (layers × largest expert)).
    pub experts_per_layer: f64,
    /// The budget as a share of every expert's bytes (the whole expert bank), in [0, 1+].
    pub bank_frac: f64,
    pub policy: String,
    /// I/O lanes and overlap; 0 and false in a cache-only cell, which models no I/O (its
    /// outputs leave them empty).
    pub lanes: u32,
    pub overlap: bool,
    /// Cache lookups over the whole replay (prefill included).
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub rereads: u64,
    pub inserts: u64,
    /// Misses an admission-filtering policy bypassed (0 for every other policy).
    pub bypasses: u64,
    /// Reads and times: `None` in a cache-only cell.
    pub timing: Option<Timing>,
    /// Per MoE layer (trace order): (decode routings, hits).
    pub per_layer: Vec<(u64, u64)>,
    /// Per turn, in replay order.
    pub per_turn: Vec<TurnStat>,
}

impl Row {
    /// The mode that produced the cell.
    pub fn mode(&self) -> Mode {
        if self.timing.is_some() {
            Mode::FullTiming
        } else {
            Mode::CacheOnly
        }
    }

    /// Predicted tok/s (full-timing cells).
    pub fn tok_s(&self) -> Option<f64> {
        self.timing.map(|t| t.tok_s)
    }

    /// Hits over lookups (prefill included).
    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits, self.lookups)
    }

    /// Decode routings and hits over every turn.
    pub fn decode_counts(&self) -> (u64, u64) {
        self.per_turn
            .iter()
            .fold((0, 0), |(r, h), t| (r + t.routings, h + t.hits))
    }

    /// Decode routing hit rate (a speculative first touch counts as a hit).
    pub fn decode_hit_rate(&self) -> f64 {
        let (r, h) = self.decode_counts();
        ratio(h, r)
    }
}

/// `a / b`, 0 when `b` is 0.
pub fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Counts a replay's decode routings per MoE layer and per turn from its route records.
#[derive(Default)]
struct CellCounter {
    per_layer: Vec<(u64, u64)>,
    /// (turn id, routings, hits), in order of first appearance.
    per_turn: Vec<(u32, u64, u64)>,
}

impl RecordSink for CellCounter {
    fn wants_routes(&self) -> bool {
        true
    }

    fn route(&mut self, r: &RouteRecord) {
        if r.phase != Phase::Decode || r.dropped {
            return;
        }
        let hit = u64::from(r.residency > 0);
        let l = r.layer as usize;
        if self.per_layer.len() <= l {
            self.per_layer.resize(l + 1, (0, 0));
        }
        self.per_layer[l].0 += 1;
        self.per_layer[l].1 += hit;
        match self.per_turn.last_mut() {
            Some(t) if t.0 == r.turn => {
                t.1 += 1;
                t.2 += hit;
            }
            _ => self.per_turn.push((r.turn, 1, hit)),
        }
    }
}

/// What a sweep replays.
pub struct SweepInput<'a> {
    pub trace: Arc<RouteTrace>,
    pub plan: Arc<ReplayPlan>,
    pub layout: &'a ExpertLayout,
    /// The resolved configuration every cell starts from (its predictor flag set).
    pub cfg: &'a RunConfig,
    pub profile: &'a DeviceProfile,
    pub seed: u64,
    /// The predictor the cells run with (the rows' `predictor`).
    pub predictor: Predictor,
}

fn make_policy(
    name: &str,
    seq: &AccessSeq,
    layout: &ExpertLayout,
) -> Result<(Box<dyn EvictionPolicy>, Option<crate::belady::Desync>), SimError> {
    if name == BELADY {
        let (p, d) = Clairvoyant::new(seq, layout);
        return Ok((Box::new(p), Some(d)));
    }
    policy::by_name(name)
        .map(|p| (p, None))
        .ok_or_else(|| SimError::invalid("--policies", format!("no policy named {name}")))
}

/// Bytes of one expert in every MoE layer (one "expert per layer" of budget).
pub fn bytes_per_layer_expert(layout: &ExpertLayout) -> u64 {
    u64::from(layout.n_moe_layers()) * layout.max_expert_bytes()
}

/// Bytes of every expert of every MoE layer (the whole expert bank).
pub fn bank_bytes(layout: &ExpertLayout) -> u64 {
    (0..layout.n_moe_layers())
        .map(|m| layout.expert_bytes(m) * u64::from(layout.layers()[m as usize].n_expert))
        .sum()
}

fn run_cell(
    input: &SweepInput<'_>,
    seq: &AccessSeq,
    (budget, policy_name, lanes, overlap): &(u64, String, u32, bool),
) -> Result<Row, SimError> {
    let mut cfg = input.cfg.clone();
    cfg.overlap = *overlap;
    cfg.io_threads = *lanes;
    cfg.cache_mb = budget / MIB;
    cfg.cache_auto = false;
    cfg.force_cache = true;
    cfg.cache_budget_mb = budget / MIB;
    cfg.validate()?;
    let (policy, desync) = make_policy(policy_name, seq, input.layout)?;
    let mut counter = CellCounter::default();
    let r = replay::run(
        ReplaySetup {
            trace: input.trace.clone(),
            plan: input.plan.clone(),
            layout: input.layout,
            cfg: &cfg,
            budget_bytes: *budget,
            policy,
            profile: input.profile,
            seed: input.seed,
        },
        ReplayOutputs {
            route: Some(&mut counter),
            ..ReplayOutputs::default()
        },
    )?;
    if let Some(d) = desync {
        d.check()?;
    }
    let s = &r.summary;
    let mut per_layer = counter.per_layer;
    per_layer.resize(usize::from(input.layout.n_moe_layers()), (0, 0));
    // The turns that decoded, in replay order, paired with their summaries.
    let decoding: Vec<&bmoe_core::telemetry::summary::RunSummary> =
        r.turns.iter().filter(|t| t.tokens() > 0).collect();
    let per_turn = if decoding.len() == counter.per_turn.len() {
        decoding
            .iter()
            .zip(&counter.per_turn)
            .map(|(t, &(_, routings, hits))| TurnStat {
                routings,
                hits,
                time: Some(TurnTime {
                    tokens: t.tokens(),
                    decode_s: t.gen_s(),
                }),
            })
            .collect()
    } else {
        return Err(SimError::invalid(
            "sweep",
            format!(
                "{} turns decoded but {} turns had decode routings",
                decoding.len(),
                counter.per_turn.len()
            ),
        ));
    };
    Ok(Row {
        predictor: input.predictor.name(),
        budget_bytes: *budget,
        experts_per_layer: *budget as f64 / bytes_per_layer_expert(input.layout).max(1) as f64,
        bank_frac: *budget as f64 / bank_bytes(input.layout).max(1) as f64,
        policy: policy_name.clone(),
        lanes: *lanes,
        overlap: *overlap,
        lookups: r.cache.hits + r.cache.misses,
        hits: r.cache.hits,
        misses: r.cache.misses,
        evictions: r.cache.evictions,
        rereads: r.cache.rereads,
        inserts: r.cache.inserts,
        bypasses: r.cache.bypasses,
        timing: Some(Timing {
            read_bytes: r.read_bytes,
            spec_experts: s.counters.spec_experts,
            spec_useful: s.counters.spec_useful,
            spec_read_bytes: s.counters.spec_read_bytes,
            tokens: s.tokens(),
            tok_s: s.tokens_per_s(),
            s_per_tok: s.s_per_token(),
            compute_s_per_tok: s.compute_s_per_token(),
            io_s_per_tok: s.io_s_per_token(),
            stall_s_per_tok: s.stall_s_per_token(),
            mgmt_s_per_tok: s.mgmt_s_per_token(),
        }),
        per_layer,
        per_turn,
    })
}

/// Per group of the access sequence (step-major, MoE-layer order within a step:
/// `AccessSeq::new`), what a cache-only cell needs to count decode routings as the full
/// replay's route records do. Built once per sweep, shared by its cells.
#[derive(Copy, Clone, Debug)]
struct GroupRoutings {
    /// Plan step and MoE layer; `None` for a prefill group (not counted).
    decode: Option<(usize, u16)>,
    turn: u32,
    /// Routed slots (the first k ranks of each row).
    routings: u64,
    /// Every expert of the group routed by exactly one slot (a one-row decode step): then
    /// its hits are `routings - misses`, with no walk over the slots.
    one_slot_each: bool,
}

fn group_routings(
    trace: &RouteTrace,
    plan: &ReplayPlan,
    seq: &AccessSeq,
    k: usize,
) -> Vec<GroupRoutings> {
    let n_moe = usize::from(plan.n_moe_layers);
    let mut out = Vec::with_capacity(seq.group_end.len());
    let mut start = 0usize;
    for (g, &end) in seq.group_end.iter().enumerate() {
        let keys = end as usize - start;
        start = end as usize;
        let Some(step) = plan.steps.get(g / n_moe.max(1)) else {
            break;
        };
        let m = (g % n_moe.max(1)) as u16;
        let routings: u64 = step
            .layer_rows(m)
            .iter()
            .map(|r| {
                let n = trace.cell_slots(&trace.cells[r.cell as usize]).len();
                n.min(k) as u64
            })
            .sum();
        out.push(GroupRoutings {
            decode: (step.phase == Phase::Decode).then_some((g / n_moe.max(1), m)),
            turn: step.turn,
            routings,
            one_slot_each: routings == keys as u64,
        });
    }
    out
}

/// One cell as a cache-only replay: the same cache, policy and admission rule as the full
/// replay's, and the same decode counts per layer and per turn (a routing hits when its
/// expert's lookup in that step and layer hit, as the streamer marks it), but no reads, no
/// clock and no time. Speculative predictors need timing and are refused by the caller.
fn run_cache_only_cell(
    input: &SweepInput<'_>,
    seq: &AccessSeq,
    groups: &[GroupRoutings],
    k: u16,
    (budget, policy_name): (u64, &str),
) -> Result<Row, SimError> {
    let (policy, desync) = make_policy(policy_name, seq, input.layout)?;
    let trace = &input.trace;
    let plan = &input.plan;
    // The ranks a routing keeps, as `group_routings` counted them.
    let take_k = if k == 0 { usize::MAX } else { usize::from(k) };
    let mut missed = vec![u32::MAX; trace.preamble.n_expert as usize];
    let mut per_layer = vec![(0u64, 0u64); usize::from(input.layout.n_moe_layers())];
    let mut per_turn: Vec<(u32, u64, u64)> = Vec::new();
    let r =
        crate::cache_only::run_observed(input.layout, seq, budget, k, policy, &mut |g, misses| {
            let Some(&GroupRoutings {
                decode: Some((step, m)),
                turn,
                routings,
                one_slot_each,
            }) = groups.get(g)
            else {
                return;
            };
            let hits = if one_slot_each {
                routings - misses.len() as u64
            } else {
                // Several rows (a verify decode) may route one expert: walk the slots.
                for key in misses {
                    if let Some(slot) = missed.get_mut(usize::from(key.expert)) {
                        *slot = g as u32;
                    }
                }
                let mut hits = 0u64;
                for row in plan.steps[step].layer_rows(m) {
                    let slots = trace.cell_slots(&trace.cells[row.cell as usize]);
                    for s in &slots[..slots.len().min(take_k)] {
                        hits += u64::from(missed.get(s.expert as usize) != Some(&(g as u32)));
                    }
                }
                hits
            };
            if let Some(l) = per_layer.get_mut(usize::from(m)) {
                l.0 += routings;
                l.1 += hits;
            }
            match per_turn.last_mut() {
                Some(t) if t.0 == turn => {
                    t.1 += routings;
                    t.2 += hits;
                }
                _ => per_turn.push((turn, routings, hits)),
            }
        })?;
    if let Some(d) = desync {
        d.check()?;
    }
    let c = r.counters;
    Ok(Row {
        predictor: input.predictor.name(),
        budget_bytes: budget,
        experts_per_layer: budget as f64 / bytes_per_layer_expert(input.layout).max(1) as f64,
        bank_frac: budget as f64 / bank_bytes(input.layout).max(1) as f64,
        policy: policy_name.to_string(),
        lanes: 0,
        overlap: false,
        lookups: c.hits + c.misses,
        hits: c.hits,
        misses: c.misses,
        evictions: c.evictions,
        rereads: c.rereads,
        inserts: c.inserts,
        bypasses: c.bypasses,
        timing: None,
        per_layer,
        per_turn: per_turn
            .into_iter()
            .map(|(_, routings, hits)| TurnStat {
                routings,
                hits,
                time: None,
            })
            .collect(),
    })
}

/// Run every cell of `grid` on a pool of `jobs` threads (`jobs` = 1 runs them in order on
/// this thread), as `mode` says: full-timing cells over budgets × policies × lanes × overlap,
/// or cache-only cells over budgets × policies (a cache-only cell models no I/O, so the grid's
/// lanes and overlap do not enter it; nor may a predictor, whose admissions depend on timing).
/// `on_done` is called (from the workers) after each cell, for a progress bar. Results come
/// back in grid order; the first error in grid order is returned.
pub fn run(
    input: &SweepInput<'_>,
    grid: &Grid,
    mode: Mode,
    jobs: usize,
    on_done: &(dyn Fn() + Sync),
) -> Result<Vec<Row>, SimError> {
    let k = u16::try_from(input.cfg.n_expert_used).unwrap_or(0);
    let trace_k = u16::try_from(input.trace.preamble.n_expert_used).unwrap_or(0);
    let seq = AccessSeq::new(&input.trace, &input.plan, if k < trace_k { k } else { 0 });
    if mode == Mode::CacheOnly && input.predictor != Predictor::None {
        return Err(SimError::invalid(
            "--cache-only",
            format!(
                "predictor {} admits experts on the modelled clock, which a cache-only \
                 cell has not: sweep it with full timing",
                input.predictor.name()
            ),
        ));
    }
    let cells = grid.cells_in(mode);
    let groups = match mode {
        Mode::FullTiming => Vec::new(),
        Mode::CacheOnly => group_routings(
            &input.trace,
            &input.plan,
            &seq,
            if k == 0 { usize::MAX } else { usize::from(k) },
        ),
    };
    let one = |cell: &(u64, String, u32, bool)| {
        let r = match mode {
            Mode::FullTiming => run_cell(input, &seq, cell),
            Mode::CacheOnly => run_cache_only_cell(input, &seq, &groups, k, (cell.0, &cell.1)),
        };
        on_done();
        r
    };
    if jobs <= 1 {
        return cells.iter().map(one).collect();
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(jobs)
        .build()
        .map_err(|e| SimError::invalid("--jobs", format!("cannot start {jobs} threads: {e}")))?;
    pool.install(|| cells.par_iter().map(one).collect())
}

/// A sweep's text outputs, each with the file name `write_outputs` gives it: `sweep.csv`,
/// `pivot.md`, `per_layer.csv`, `per_layer.md` (what `bmoe_sim.sweep` returns without writing).
pub fn text_outputs(
    rows: &[Row],
    stats: &[report::CellStats],
    layer_ids: &[u32],
    x: report::XAxis,
    trace_name: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("sweep.csv", report::tidy_csv(rows, stats)),
        ("pivot.md", report::pivot_md(rows, stats, x, trace_name)),
        ("per_layer.csv", report::per_layer_csv(rows, layer_ids)),
        (
            "per_layer.md",
            report::per_layer_md(rows, layer_ids, x, trace_name),
        ),
    ]
}

/// Write every output of a sweep into `dir`; returns the file names written.
pub fn write_outputs(
    dir: &std::path::Path,
    rows: &[Row],
    layer_ids: &[u32],
    x: report::XAxis,
    bootstrap: usize,
    seed: u64,
    trace_name: &str,
) -> Result<Vec<String>, SimError> {
    let stats = report::analyse(rows, bootstrap, seed);
    let mut written = Vec::new();
    for (name, text) in text_outputs(rows, &stats, layer_ids, x, trace_name) {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| SimError::io(&path, e))?;
        written.push(name.to_string());
    }
    let (hit, tps) = plot::sweep_figures(rows, &stats, x, trace_name);
    plot::write_line_figure(dir, "hit_rate", &hit)?;
    // A cache-only sweep has no times: no tok/s chart rather than an empty or a made-up one.
    let timed = rows.iter().all(|r| r.timing.is_some());
    if timed {
        plot::write_line_figure(dir, "tok_s", &tps)?;
    }
    plot::write_heat_map(dir, rows, layer_ids, x, trace_name)?;
    let charts: &[&str] = if timed {
        &["hit_rate", "tok_s", "per_layer"]
    } else {
        &["hit_rate", "per_layer"]
    };
    for stem in charts {
        written.push(format!("{stem}.svg"));
        written.push(format!("{stem}.png"));
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_budget_points() {
        assert_eq!(default_experts_per_layer(2, 8), vec![2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            default_experts_per_layer(6, 64),
            vec![6, 9, 12, 18, 24, 36, 48, 64]
        );
        assert_eq!(
            default_experts_per_layer(8, 128),
            vec![8, 12, 16, 24, 32, 48, 64, 128]
        );
        assert!(default_policies().ends_with(&[BELADY.to_string()]));
    }

    #[test]
    fn predictor_names_round_trip() {
        for p in [
            Predictor::None,
            Predictor::Prefetch(2),
            Predictor::PredictPrefetch,
            Predictor::RouteAhead(3),
        ] {
            assert_eq!(Predictor::parse(&p.name()).expect("parses"), p);
            let mut cfg = RunConfig {
                prefetch: 9,
                predict_prefetch: true,
                route_ahead: 9,
                ..RunConfig::default()
            };
            p.apply(&mut cfg);
            let set = [cfg.prefetch > 0, cfg.predict_prefetch, cfg.route_ahead > 0];
            assert_eq!(
                set.iter().filter(|&&b| b).count(),
                usize::from(p != Predictor::None),
                "{p:?} sets only its own flag"
            );
        }
        for bad in [
            "",
            "prefetch",
            "prefetch:0",
            "route-ahead:x",
            "stale",
            "none:1",
        ] {
            assert!(Predictor::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn grid_order_is_budget_policy_lanes_overlap() {
        let g = Grid {
            budgets: vec![1, 2],
            policies: vec!["lru".into()],
            lanes: vec![1, 4],
            overlap: vec![false, true],
        };
        let c = g.cells();
        assert_eq!(c.len(), 8);
        assert_eq!(c[0], (1, "lru".into(), 1, false));
        assert_eq!(c[1], (1, "lru".into(), 1, true));
        assert_eq!(c[2], (1, "lru".into(), 4, false));
        assert_eq!(c[4].0, 2);
    }
}
