//! Sweeps: one trace replayed over a grid of cache budgets × eviction policies × I/O lanes ×
//! overlap, each cell a full-timing replay through the core, run in parallel on std threads.
//! Every budget also gets the Belady (clairvoyant) bound (`belady.rs`) as a policy, so each
//! table row and plot shows how far a policy is from the best any policy could do.
//!
//! A predictor axis (`Predictor`: none, previous-token `--prefetch K`, `--predict-prefetch`,
//! `--route-ahead N`) runs the grid once per predictor, each from the routing that predictor
//! replays (`predictions::resolve`); the Belady bound runs only without a predictor, since
//! speculative admissions are outside the demand sequence it is clairvoyant over.
//!
//! Outputs: a CSV table (one row per cell, grid order whatever order the threads finished
//! in) and two SVG plots: hit rate vs budget (per policy) and predicted tok/s vs budget (per
//! policy, lanes and overlap).

use crate::belady::Clairvoyant;
use crate::error::SimError;
use crate::plan::{AccessSeq, ReplayPlan};
use crate::profile::DeviceProfile;
use crate::replay::{self, ReplayOutputs, ReplaySetup};
use crate::svg::{self, Chart, Series};
use bmoe_core::config::{RunConfig, MIB};
use bmoe_core::policy::{self, EvictionPolicy};
use bmoe_core::telemetry::fmt::fixed;
use bmoe_core::telemetry::route_trace::RouteTrace;
use bmoe_core::ExpertLayout;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

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
}

/// One cell's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The predictor (`Predictor::name`).
    pub predictor: String,
    pub budget_bytes: u64,
    /// The budget in experts per MoE layer (budget / (layers × largest expert)).
    pub experts_per_layer: f64,
    pub policy: String,
    pub lanes: u32,
    pub overlap: bool,
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub rereads: u64,
    pub read_bytes: u64,
    pub tok_s: f64,
    pub s_per_tok: f64,
    pub io_s_per_tok: f64,
    pub stall_s_per_tok: f64,
    pub mgmt_s_per_tok: f64,
}

impl Row {
    /// Hits over lookups (prefill included).
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits as f64 / self.lookups as f64
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
        ReplayOutputs::default(),
    )?;
    if let Some(d) = desync {
        d.check()?;
    }
    let s = &r.summary;
    let per_expert = u64::from(input.layout.n_moe_layers()) * input.layout.max_expert_bytes();
    Ok(Row {
        predictor: input.predictor.name(),
        budget_bytes: *budget,
        experts_per_layer: *budget as f64 / per_expert.max(1) as f64,
        policy: policy_name.clone(),
        lanes: *lanes,
        overlap: *overlap,
        lookups: r.cache.hits + r.cache.misses,
        hits: r.cache.hits,
        misses: r.cache.misses,
        evictions: r.cache.evictions,
        rereads: r.cache.rereads,
        read_bytes: r.read_bytes,
        tok_s: s.tokens_per_s(),
        s_per_tok: s.s_per_token(),
        io_s_per_tok: s.io_s_per_token(),
        stall_s_per_tok: s.stall_s_per_token(),
        mgmt_s_per_tok: s.mgmt_s_per_token(),
    })
}

/// Run every cell of `grid` on `jobs` threads. `on_done` is called (from the workers) after
/// each cell, for a progress bar. Results come back in grid order.
pub fn run(
    input: &SweepInput<'_>,
    grid: &Grid,
    jobs: usize,
    on_done: &(dyn Fn() + Sync),
) -> Result<Vec<Row>, SimError> {
    let k = u16::try_from(input.cfg.n_expert_used).unwrap_or(0);
    let trace_k = u16::try_from(input.trace.preamble.n_expert_used).unwrap_or(0);
    let seq = AccessSeq::new(&input.trace, &input.plan, if k < trace_k { k } else { 0 });
    let cells = grid.cells();
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<Row, SimError>>>> =
        Mutex::new((0..cells.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs.clamp(1, cells.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(cell) = cells.get(i) else {
                    break;
                };
                let r = run_cell(input, &seq, cell);
                let failed = r.is_err();
                results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                on_done();
                if failed {
                    // Stop handing out work; the first error is reported.
                    next.store(cells.len(), Ordering::Relaxed);
                    break;
                }
            });
        }
    });
    let results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    let mut rows = Vec::with_capacity(results.len());
    for r in results.into_iter().flatten() {
        rows.push(r?);
    }
    Ok(rows)
}

/// Column names of the sweep table.
pub const TABLE_COLUMNS: [&str; 19] = [
    "budget_mib",
    "experts_per_layer",
    "policy",
    "lanes",
    "overlap",
    "lookups",
    "hits",
    "misses",
    "evictions",
    "rereads",
    "hit_rate",
    "read_mib",
    "tok_s",
    "s_per_tok",
    "io_s_per_tok",
    "stall_s_per_tok",
    "mgmt_s_per_tok",
    "budget_bytes",
    "predictor",
];

/// Write the table as CSV.
pub fn write_table(w: &mut dyn Write, rows: &[Row]) -> std::io::Result<()> {
    writeln!(w, "{}", TABLE_COLUMNS.join(","))?;
    for r in rows {
        writeln!(
            w,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            fixed(r.budget_bytes as f64 / MIB as f64, 1),
            fixed(r.experts_per_layer, 2),
            r.policy,
            r.lanes,
            u8::from(r.overlap),
            r.lookups,
            r.hits,
            r.misses,
            r.evictions,
            r.rereads,
            fixed(r.hit_rate(), 4),
            fixed(r.read_bytes as f64 / MIB as f64, 1),
            fixed(r.tok_s, 3),
            fixed(r.s_per_tok, 4),
            fixed(r.io_s_per_tok, 4),
            fixed(r.stall_s_per_tok, 4),
            fixed(r.mgmt_s_per_tok, 4),
            r.budget_bytes,
            r.predictor
        )?;
    }
    Ok(())
}

/// The two plots: hit rate vs budget (one line per policy; hit rates do not depend on lanes
/// or overlap, so the first lanes/overlap cell stands for all) and tok/s vs budget (one line
/// per policy × lanes × overlap).
pub fn charts(rows: &[Row], trace_name: &str) -> (String, String) {
    let mut hit: Vec<Series> = Vec::new();
    let mut tps: Vec<Series> = Vec::new();
    let first = rows.first().map(|r| (r.lanes, r.overlap));
    for r in rows {
        let x = r.budget_bytes as f64 / MIB as f64;
        let policy = if r.predictor == "none" {
            r.policy.clone()
        } else {
            format!("{} {}", r.policy, r.predictor)
        };
        if Some((r.lanes, r.overlap)) == first {
            match hit.iter_mut().find(|s| s.name == policy) {
                Some(s) => s.points.push((x, r.hit_rate())),
                None => hit.push(Series {
                    name: policy.clone(),
                    points: vec![(x, r.hit_rate())],
                    dots: true,
                }),
            }
        }
        let name = format!(
            "{} {} lane{}{}",
            policy,
            r.lanes,
            if r.lanes == 1 { "" } else { "s" },
            if r.overlap { " overlap" } else { "" }
        );
        match tps.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push((x, r.tok_s)),
            None => tps.push(Series {
                name,
                points: vec![(x, r.tok_s)],
                dots: true,
            }),
        }
    }
    (
        svg::render(&Chart {
            title: format!("cache hit rate vs budget — {trace_name}"),
            x_label: "cache budget (MiB)".into(),
            y_label: "hit rate".into(),
            series: hit,
        }),
        svg::render(&Chart {
            title: format!("predicted decode tok/s vs budget — {trace_name}"),
            x_label: "cache budget (MiB)".into(),
            y_label: "tok/s".into(),
            series: tps,
        }),
    )
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
