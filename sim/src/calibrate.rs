//! `bmoe-sim calibrate`: fit a device profile to a measured engine run.
//!
//! Inputs: the run's `--csv` (always), its `--route-trace` (for everything per token: which
//! reads and which computes each token did — the replay reproduces them exactly) and its
//! `--io-trace` (the reads as measured). The fit, per decode token `t`:
//!
//! - **flash**: `io_ms_t ≈ L·A_t + B_t / D` by least squares, where `B_t` is the token's read
//!   bytes and `A_t` the per-request latencies on its critical path — in serial runs
//!   `Σ_layers ceil(reads_l / lanes)` (a layer waits for its busiest lane), under `--overlap`
//!   the token's read count (`io_ms` is then summed lane busy time). `L` is the per-request
//!   latency and `D` the rate; lane and device rate are both set to `D` (the run cannot tell
//!   them apart; on this machine one lane saturates the device). Reads come from the io trace
//!   when given, else from replaying the route trace. A negative `L` is clamped to 0 and `D`
//!   refit through the origin.
//! - **compute**: the mean compute residual over the mean bytes a token computes (every
//!   layer's dense bytes plus its routed experts') gives one processing rate for dense and
//!   expert weights; fixed costs and the head are folded into it (`head_ms` = 0).
//! - **cache management**: Σ `mgmt_ms` / Σ evictions, per MiB of expert.
//! - **prefill batching**: the prefill's compute (`prefill_s − prefill_io_s − prefill_mgmt_s`,
//!   stall instead of io under overlap) against the fitted per-row costs gives
//!   `batch_row_factor`, clamped to [0, 1].
//! - **loop overhead**: the mean `loop_overhead_ms`; memory: the mean `mem_available_mib`;
//!   threads: the preamble's.
//!
//! Without a route trace the compute is one fixed time per token (`head_ms`) and the flash a
//! pure rate from `Σ read_bytes / Σ io_ms`. Then the fitted profile is replayed against the
//! run and the in-sample errors are reported, so a profile never claims more than it showed.

use crate::cli::Prepared;
use crate::compute::ComputeParams;
use crate::diff::{self, Tolerances};
use crate::error::SimError;
use crate::flash::FlashParams;
use crate::profile::DeviceProfile;
use crate::replay::{self, ReplayOutputs, ReplaySetup};
use bmoe_core::config::{RunConfig, MIB};
use bmoe_core::records::{IoRecord, Phase, RecordSink};
use bmoe_core::telemetry::MetricsCsv;
use bmoe_core::StepStats;
use std::collections::BTreeMap;

const MIB_F: f64 = MIB as f64;

/// What calibration produced: the profile and a line per fitted quantity.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    pub profile: DeviceProfile,
    pub notes: Vec<String>,
}

/// The run configuration a metrics file's preamble describes, for replaying its trace.
pub fn run_config_from_csv(csv: &MetricsCsv) -> Result<RunConfig, SimError> {
    let p = &csv.preamble;
    let num = |key: &str| -> Result<Option<f64>, SimError> {
        p.get_f64(key)
            .map_err(|e| SimError::invalid("--csv preamble", e.to_string()))
    };
    if num("moe_stream")? != Some(1.0) {
        return Err(SimError::invalid(
            "--csv",
            "the run did not stream experts (moe_stream=1 is missing): there is no flash to fit",
        ));
    }
    let mut cfg = RunConfig {
        moe_stream: true,
        ..RunConfig::default()
    };
    let mb = num("cache_mb")?.unwrap_or(0.0).max(0.0) as u64;
    cfg.cache_mb = mb;
    cfg.cache_budget_mb = mb;
    cfg.force_cache = true;
    cfg.overlap = num("overlap")? == Some(1.0);
    cfg.load_all = num("load_all")? == Some(1.0);
    cfg.o_direct = num("o_direct")? != Some(0.0);
    // Runs recorded before `--read-split` existed read every extent whole.
    cfg.read_split = match p.get("read_split") {
        None => bmoe_core::ReadSplit::Whole,
        Some(s) => bmoe_core::ReadSplit::parse(s)
            .map_err(|e| SimError::invalid("--csv preamble", format!("read_split: {e}")))?,
    };
    if let Some(t) = num("io_threads")? {
        cfg.io_threads = t as u32;
    }
    if let Some(t) = num("threads")? {
        cfg.threads = t as u32;
    }
    if let Some(k) = num("n_expert_used")? {
        cfg.n_expert_used = k as u32;
    }
    Ok(cfg)
}

/// Robust `y ≈ a·x1 + b·x2`: least squares, then once more without the tokens whose residual
/// is an outlier (above 3 × the residuals' scaled median absolute deviation). One preempted
/// read or descheduled token in a calibration run would otherwise pull the whole fit; the
/// replay models the typical token, and the noise stays in the measured run it is compared to.
fn fit2(rows: &[(f64, f64, f64)]) -> Option<(f64, f64)> {
    let (a, b) = fit2_ls(rows)?;
    let kept = without_outliers(rows, |&(x1, x2, y)| y - a * x1 - b * x2);
    if kept.len() == rows.len() || kept.len() < 8 {
        return Some((a, b));
    }
    fit2_ls(&kept).or(Some((a, b)))
}

/// Robust `y ≈ b·x` through the origin (outliers dropped as in `fit2`).
fn fit1(rows: &[(f64, f64)]) -> Option<f64> {
    let b = fit1_ls(rows)?;
    let kept = without_outliers(rows, |&(x, y)| y - b * x);
    if kept.len() == rows.len() || kept.len() < 8 {
        return Some(b);
    }
    fit1_ls(&kept).or(Some(b))
}

/// The rows whose residual is within 3 × 1.4826 × MAD of the median residual (all rows when
/// there are fewer than 8 or the residuals do not spread).
fn without_outliers<T: Copy>(rows: &[T], resid: impl Fn(&T) -> f64) -> Vec<T> {
    if rows.len() < 8 {
        return rows.to_vec();
    }
    let r: Vec<f64> = rows.iter().map(&resid).collect();
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let m = med(&mut r.clone());
    let mad = med(&mut r.iter().map(|x| (x - m).abs()).collect());
    if mad <= 0.0 || !mad.is_finite() {
        return rows.to_vec();
    }
    let bound = 3.0 * 1.4826 * mad;
    rows.iter()
        .zip(&r)
        .filter(|(_, &x)| (x - m).abs() <= bound)
        .map(|(row, _)| *row)
        .collect()
}

/// Least squares `y ≈ a·x1 + b·x2` (no intercept): `(a, b)`, or `None` when singular.
fn fit2_ls(rows: &[(f64, f64, f64)]) -> Option<(f64, f64)> {
    let (mut s11, mut s12, mut s22, mut s1y, mut s2y) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x1, x2, y) in rows {
        s11 += x1 * x1;
        s12 += x1 * x2;
        s22 += x2 * x2;
        s1y += x1 * y;
        s2y += x2 * y;
    }
    let det = s11 * s22 - s12 * s12;
    if det.abs() <= 1e-12 * (s11 * s22).max(1e-300) {
        return None;
    }
    Some(((s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det))
}

/// Least squares `y ≈ b·x` through the origin.
fn fit1_ls(rows: &[(f64, f64)]) -> Option<f64> {
    let (sxx, sxy) = rows
        .iter()
        .fold((0.0, 0.0), |(a, b), &(x, y)| (a + x * x, b + x * y));
    (sxx > 0.0).then(|| sxy / sxx)
}

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| s / n as f64)
}

/// The configuration a calibration replays the measured run with: the prepared trace's, with
/// the run's own streaming settings from its CSV preamble. One place, so the fit's replay and
/// the in-sample check cannot replay different runs.
fn replay_config(p: &Prepared, run: &RunConfig) -> RunConfig {
    let mut c = p.cfg.clone();
    c.overlap = run.overlap;
    c.io_threads = run.io_threads;
    c.o_direct = run.o_direct;
    c.read_split = run.read_split;
    c.load_all = run.load_all;
    c.cache_budget_mb = run.cache_budget_mb;
    c
}

struct IoCollector(Vec<IoRecord>);

impl RecordSink for IoCollector {
    fn wants_io(&self) -> bool {
        true
    }
    fn io(&mut self, r: &IoRecord) {
        self.0.push(r.clone());
    }
}

/// Reads per MoE layer and their bytes, for each decode token keyed by (turn, position).
type TokenReads = BTreeMap<(u32, i64), BTreeMap<u32, (u64, u64)>>;

fn reads_by_token(io: &[IoRecord]) -> TokenReads {
    let mut out = TokenReads::new();
    for r in io.iter().filter(|r| r.phase == Phase::Decode) {
        let e = out
            .entry((r.turn, r.step))
            .or_default()
            .entry(r.layer)
            .or_insert((0, 0));
        e.0 += 1;
        e.1 += r.read_bytes;
    }
    out
}

/// (turn, position) of every CSV row: from the replay plan when there is one, else from the
/// rows themselves (decode token `step` of a turn sits at position `n_prompt + step - 1`, the
/// turn's `n_prompt` from its `# summary` trailer).
fn row_keys(csv: &MetricsCsv, prepared: Option<&Prepared>) -> Vec<(u32, i64)> {
    if let Some(p) = prepared {
        return p
            .plan
            .turns
            .iter()
            .flat_map(|t| t.decode.clone())
            .map(|i| {
                let s = &p.plan.steps[i];
                (s.turn, s.positions.first().map_or(-1, |&x| i64::from(x)))
            })
            .collect();
    }
    let mut turn_index: BTreeMap<u32, usize> = BTreeMap::new();
    for r in &csv.rows {
        let next = turn_index.len();
        turn_index.entry(r.turn).or_insert(next);
    }
    csv.rows
        .iter()
        .map(|r| {
            let n_prompt = turn_index
                .get(&r.turn)
                .and_then(|&i| csv.summaries.get(i))
                .and_then(|s| s.get("n_prompt"))
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or(0);
            (r.turn, n_prompt + i64::from(r.step) - 1)
        })
        .collect()
}

/// Fit a profile. `prepared` is the route trace (with a configuration and the base profile
/// whose unfitted fields — alignment — are kept); `io` the measured io trace.
pub fn calibrate(
    csv: &MetricsCsv,
    csv_name: &str,
    prepared: Option<&Prepared>,
    io: Option<&[IoRecord]>,
    base: &DeviceProfile,
    name: &str,
) -> Result<Calibration, SimError> {
    if csv.rows.is_empty() {
        return Err(SimError::invalid("--csv", "no decode rows to fit"));
    }
    let cfg = run_config_from_csv(csv)?;
    let mut notes = Vec::new();
    let mut flash = FlashParams {
        jitter: 0.0,
        ..base.flash.clone()
    };
    let mut compute = ComputeParams {
        dense_mib_per_s: 0.0,
        expert_mib_per_s: 0.0,
        layer_fixed_us: 0.0,
        expert_fixed_us: 0.0,
        head_ms: 0.0,
        batch_row_factor: base.compute.batch_row_factor,
        release_us: 0.0,
        release_us_per_mib: 0.0,
        loop_overhead_ms: 0.0,
        jitter: 0.0,
    };
    let rows = &csv.rows;
    let n = rows.len() as f64;
    let sum =
        |f: &dyn Fn(&bmoe_core::telemetry::TokenRecord) -> f64| rows.iter().map(f).sum::<f64>();
    compute.loop_overhead_ms = sum(&|r| r.loop_overhead_ms) / n;

    // The replay of the route trace: exact reads, evictions and routed bytes per token.
    let mut stats: Vec<StepStats> = Vec::new();
    let mut sim_io = IoCollector(Vec::new());
    if let Some(p) = prepared {
        let run_cfg = replay_config(p, &cfg);
        replay::run(
            ReplaySetup {
                trace: p.trace.clone(),
                plan: p.plan.clone(),
                layout: &p.layout,
                cfg: &run_cfg,
                budget_bytes: cfg.cache_budget_mb.saturating_mul(MIB),
                policy: bmoe_core::policy::by_name(run_cfg.eviction.name()).ok_or_else(|| {
                    SimError::invalid("eviction", "the run's policy is unknown to this build")
                })?,
                profile: base,
                seed: 0,
            },
            ReplayOutputs {
                io: Some(&mut sim_io),
                decode_stats: Some(&mut stats),
                ..ReplayOutputs::default()
            },
        )?;
        if stats.len() != rows.len() {
            return Err(SimError::invalid(
                "--trace",
                format!(
                    "replays {} decode tokens but the CSV has {} rows: not the same run",
                    stats.len(),
                    rows.len()
                ),
            ));
        }
        if let Some(i) = (0..rows.len()).find(|&i| stats[i].read_bytes != rows[i].read_bytes) {
            return Err(SimError::invalid(
                "--trace",
                format!(
                    "token {} reads {} bytes in the replay but {} in the CSV: not the same run, or \
                     not the same budget",
                    i + 1,
                    stats[i].read_bytes,
                    rows[i].read_bytes
                ),
            ));
        }
    }

    // Flash.
    let by_token = match io {
        Some(io) => {
            notes.push(format!(
                "flash: reads per token from the measured io trace ({} reads)",
                io.len()
            ));
            Some(reads_by_token(io))
        }
        None if prepared.is_some() => Some(reads_by_token(&sim_io.0)),
        None => None,
    };
    let empty = BTreeMap::new();
    let reads: Vec<&BTreeMap<u32, (u64, u64)>> = match &by_token {
        Some(m) => row_keys(csv, prepared)
            .iter()
            .map(|k| m.get(k).unwrap_or(&empty))
            .collect(),
        None => Vec::new(),
    };
    let lanes = f64::from(cfg.io_threads.max(1));
    let flash_rows: Vec<(f64, f64, f64)> = if reads.len() == rows.len() {
        rows.iter()
            .zip(&reads)
            .filter(|(_, m)| !m.is_empty())
            .map(|(r, m)| {
                let a: f64 = if cfg.overlap {
                    m.values().map(|&(n, _)| n as f64).sum()
                } else {
                    m.values().map(|&(n, _)| (n as f64 / lanes).ceil()).sum()
                };
                let b: f64 = m.values().map(|&(_, bytes)| bytes as f64).sum();
                (a, b, r.io_ms)
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut how = if flash_rows.is_empty() {
        "rate only: no per-token reads"
    } else if cfg.overlap {
        "overlap: io_ms is lane busy time"
    } else {
        "serial: io_ms is blocked time"
    };
    let (latency_ms, ms_per_byte) = match fit2(&flash_rows) {
        Some((l, x)) if l >= 0.0 && x > 0.0 => (l, Some(x)),
        _ => {
            if !flash_rows.is_empty() {
                how = "the latency fit came out negative: latency 0, rate through the origin";
            }
            let through: Vec<(f64, f64)> = if flash_rows.is_empty() {
                rows.iter()
                    .map(|r| (r.read_bytes as f64, r.io_ms))
                    .collect()
            } else {
                flash_rows.iter().map(|&(_, b, y)| (b, y)).collect()
            };
            (0.0, fit1(&through).filter(|x| *x > 0.0))
        }
    };
    match ms_per_byte {
        Some(x) => {
            let mib_s = 1e3 / (x * MIB_F);
            flash.read_latency_us = latency_ms * 1e3;
            flash.lane_mib_per_s = mib_s;
            // Serial: the fit is over blocked wall time, i.e. what all lanes together deliver,
            // so one rate is both. Overlap: the fit is over summed lane busy time, i.e. one
            // lane's rate (contention already inside each read's busy time), and the lanes
            // together deliver up to `lanes` times it — a ceiling equal to one lane's rate would
            // serialise concurrent lanes and over-charge every overlapped read.
            flash.device_mib_per_s = if cfg.overlap && !flash_rows.is_empty() {
                mib_s * lanes
            } else {
                mib_s
            };
            notes.push(format!(
                "flash: latency {:.1} us per request, {:.0} MiB/s ({} tokens, {})",
                flash.read_latency_us,
                mib_s,
                if flash_rows.is_empty() {
                    rows.len()
                } else {
                    flash_rows.len()
                },
                how
            ));
        }
        None => notes.push(format!(
            "flash: the run read nothing a rate can be fit to; kept {}'s flash",
            base.name
        )),
    }
    if let (Some(io), 1) = (io, cfg.io_threads) {
        // One lane shares nothing: each read's own latency is request cost + bytes / lane rate.
        let per_read: Vec<(f64, f64, f64)> = io
            .iter()
            .map(|r| (1.0, r.read_bytes as f64, r.latency_ns as f64 / 1e6))
            .collect();
        if let Some((l, x)) = fit2(&per_read).filter(|&(l, x)| l >= 0.0 && x > 0.0) {
            notes.push(format!(
                "flash: per-read fit (one lane, nothing shared): {:.1} us per request + bytes at {:.0} MiB/s (the profile keeps the per-token fit above; this one separates request cost from rate)",
                l * 1e3,
                1e3 / (x * MIB_F)
            ));
        }
    }
    if let Some(io) = io {
        let mut lat: Vec<f64> = io.iter().map(|r| r.latency_ns as f64 / 1e3).collect();
        lat.sort_by(f64::total_cmp);
        if let (Some(p50), Some(p90)) = (diff::percentile(&lat, 50.0), diff::percentile(&lat, 90.0))
        {
            notes.push(format!(
                "flash: measured per-read latency p50 {p50:.1} us, p90 {p90:.1} us"
            ));
        }
    }

    // Compute, management, prefill.
    let compute_ms = sum(&|r| r.compute_ms) / n;
    let mgmt_ms: f64 = sum(&|r| r.mgmt_ms);
    match prepared {
        Some(p) => {
            let layout = &p.layout;
            let listed: Vec<u64> = layout.layers().iter().map(|l| l.dense_bytes).collect();
            let mean_dense = listed.iter().sum::<u64>() / listed.len().max(1) as u64;
            let dense_total: u64 = (0..layout.n_model_layers())
                .map(|m| {
                    layout
                        .moe_index(m)
                        .and_then(|i| layout.layer(i))
                        .map_or(mean_dense, |l| l.dense_bytes)
                })
                .sum();
            let routed = mean(stats.iter().map(|s| s.routed_bytes as f64)).unwrap_or(0.0);
            let work_bytes = dense_total as f64 + routed;
            if compute_ms > 0.0 && work_bytes > 0.0 {
                let rate = work_bytes / MIB_F / (compute_ms / 1e3);
                compute.dense_mib_per_s = rate;
                compute.expert_mib_per_s = rate;
                notes.push(format!(
                    "compute: {rate:.0} MiB/s over {:.2} MiB per token (dense {:.2} + routed {:.2}), mean residual {compute_ms:.3} ms",
                    work_bytes / MIB_F,
                    dense_total as f64 / MIB_F,
                    routed / MIB_F
                ));
            } else {
                notes.push("compute: no compute residual to fit; compute is free".to_string());
            }
            let evictions: u64 = stats.iter().map(|s| s.evictions).sum();
            if evictions > 0 {
                let per_eviction_us = mgmt_ms * 1e3 / evictions as f64;
                let expert_mib = layout.max_expert_bytes() as f64 / MIB_F;
                compute.release_us_per_mib = per_eviction_us / expert_mib.max(1e-9);
                notes.push(format!(
                    "cache mgmt: {per_eviction_us:.1} us per eviction ({:.1} us/MiB, {evictions} evictions)",
                    compute.release_us_per_mib
                ));
            } else {
                notes.push("cache mgmt: no evictions in the run; release cost 0".to_string());
            }
            fit_prefill(csv, p, &cfg, &mut compute, &mut notes);
        }
        None => {
            compute.head_ms = compute_ms;
            notes.push(format!(
                "compute: {compute_ms:.3} ms per token as a fixed cost (no --trace: bytes per token unknown)"
            ));
            let evictions = csv
                .summaries
                .iter()
                .filter_map(|s| s.get("evictions").and_then(|v| v.parse::<u64>().ok()))
                .sum::<u64>();
            if evictions > 0 {
                compute.release_us = mgmt_ms * 1e3 / evictions as f64;
                notes.push(format!(
                    "cache mgmt: {:.1} us per eviction ({evictions} evictions)",
                    compute.release_us
                ));
            }
        }
    }

    let mem = sum(&|r| r.mem_available_mib) / n;
    let model = csv.preamble.get("model").unwrap_or("unknown");
    let engine = csv.preamble.get("engine").unwrap_or("unknown");
    let mut profile = DeviceProfile {
        name: name.to_string(),
        description: format!(
            "Calibrated by bmoe-sim calibrate from {csv_name} (engine {engine}, model {model}, {} decode tokens, cache {} MiB, {} lanes, {}).",
            rows.len(),
            cfg.cache_budget_mb,
            cfg.io_threads,
            if cfg.overlap { "overlap" } else { "serial" }
        ),
        sources: notes.clone(),
        flash,
        compute,
        mem_available_mib: if mem > 0.0 { mem.round() as u64 } else { base.mem_available_mib },
        threads: if cfg.threads > 0 { cfg.threads } else { base.threads },
    };
    profile.validate()?;

    // In-sample accuracy: replay with the fitted profile and compare.
    if let Some(p) = prepared {
        let mut csv_out = Vec::new();
        let run_cfg = replay_config(p, &cfg);
        replay::run(
            ReplaySetup {
                trace: p.trace.clone(),
                plan: p.plan.clone(),
                layout: &p.layout,
                cfg: &run_cfg,
                budget_bytes: cfg.cache_budget_mb.saturating_mul(MIB),
                policy: bmoe_core::policy::by_name(run_cfg.eviction.name())
                    .ok_or_else(|| SimError::invalid("eviction", "unknown policy"))?,
                profile: &profile,
                seed: 0,
            },
            ReplayOutputs {
                csv: Some(&mut csv_out),
                ..ReplayOutputs::default()
            },
        )?;
        let sim = MetricsCsv::parse(&String::from_utf8_lossy(&csv_out))
            .map_err(|e| SimError::invalid("calibration replay", e.to_string()))?;
        let report = diff::compare(&sim, csv, &Tolerances::default(), false);
        for l in report.lines.iter().filter(|l| l.kind == "time") {
            notes.push(format!("in-sample {}: {}", l.metric, l.detail));
        }
        profile.sources = notes.clone();
    }
    Ok(Calibration { profile, notes })
}

/// `batch_row_factor` from the first generation's prefill, when the run had one.
fn fit_prefill(
    csv: &MetricsCsv,
    p: &Prepared,
    cfg: &RunConfig,
    compute: &mut ComputeParams,
    notes: &mut Vec<String>,
) {
    let Some(first) = p.plan.turns.first() else {
        return;
    };
    let (Some(index), Some(summary)) = (first.prefill, csv.summaries.first()) else {
        notes.push("prefill: none in the run; batch_row_factor kept".to_string());
        return;
    };
    let get = |k: &str| summary.get(k).and_then(|v| v.parse::<f64>().ok());
    let (Some(prefill_s), Some(io_s), Some(stall_s), Some(mgmt_s)) = (
        get("prefill_s"),
        get("prefill_io_s"),
        get("prefill_stall_s"),
        get("prefill_mgmt_s"),
    ) else {
        return;
    };
    let measured_ms = (prefill_s - if cfg.overlap { stall_s } else { io_s } - mgmt_s) * 1e3;
    let step = &p.plan.steps[index];
    let layout = &p.layout;
    let rows = step.positions.len();
    let listed: Vec<u64> = layout.layers().iter().map(|l| l.dense_bytes).collect();
    let mean_dense = listed.iter().sum::<u64>() / listed.len().max(1) as u64;
    let (mut base_ns, mut extra_ns) = (compute.head_ms * 1e6, 0.0);
    for m in 0..layout.n_model_layers() {
        let bytes = layout
            .moe_index(m)
            .and_then(|i| layout.layer(i))
            .map_or(mean_dense, |l| l.dense_bytes);
        base_ns += compute.dense_ns(bytes);
        extra_ns += compute.dense_ns(bytes) * rows.saturating_sub(1) as f64;
    }
    for moe in 0..layout.n_moe_layers() {
        let mut uses: BTreeMap<u32, usize> = BTreeMap::new();
        for row in step.layer_rows(moe) {
            for s in p.trace.cell_slots(&p.trace.cells[row.cell as usize]) {
                *uses.entry(s.expert).or_default() += 1;
            }
        }
        let e = compute.expert_ns(layout.expert_bytes(moe));
        for &u in uses.values() {
            base_ns += e;
            extra_ns += e * u.saturating_sub(1) as f64;
        }
    }
    if extra_ns > 0.0 && measured_ms > 0.0 {
        let f = ((measured_ms * 1e6 - base_ns) / extra_ns).clamp(0.0, 1.0);
        compute.batch_row_factor = f;
        notes.push(format!(
            "prefill: {rows} tokens, compute {measured_ms:.3} ms measured -> batch_row_factor {f:.3}"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_squares() {
        // y = 2·x1 + 0.5·x2 exactly.
        let rows: Vec<(f64, f64, f64)> = [(1.0, 10.0), (2.0, 10.0), (3.0, 40.0), (5.0, 7.0)]
            .iter()
            .map(|&(a, b)| (a, b, 2.0 * a + 0.5 * b))
            .collect();
        let (a, b) = fit2(&rows).expect("fit");
        assert!((a - 2.0).abs() < 1e-9 && (b - 0.5).abs() < 1e-9);
        assert!(
            fit2(&[(1.0, 2.0, 3.0), (2.0, 4.0, 6.0)]).is_none(),
            "collinear"
        );
        assert_eq!(fit1(&[(2.0, 4.0), (1.0, 2.0)]), Some(2.0));
        assert_eq!(fit1(&[]), None);
    }

    #[test]
    fn one_stalled_token_does_not_pull_the_fit() {
        // y = 1·x1 + 0.25·x2 with small noise, and one token 10× slower (a preempted read).
        let mut rows: Vec<(f64, f64, f64)> = (0..40)
            .map(|i| {
                let (a, b) = (1.0 + (i % 4) as f64, 4.0 + (i % 7) as f64);
                let wobble = if i % 2 == 0 { 0.01 } else { -0.01 };
                (a, b, a + 0.25 * b + wobble)
            })
            .collect();
        let clean = fit2(&rows).expect("fit");
        rows[17].2 *= 10.0;
        let plain = fit2_ls(&rows).expect("fit");
        let robust = fit2(&rows).expect("fit");
        assert!((robust.0 - clean.0).abs() < 0.01 && (robust.1 - clean.1).abs() < 0.01);
        assert!((plain.0 - clean.0).abs() > 0.05 || (plain.1 - clean.1).abs() > 0.05);
        let line: Vec<(f64, f64)> = (1..30).map(|i| (i as f64, 2.0 * i as f64)).collect();
        let mut spiked = line.clone();
        spiked[3].1 = 500.0;
        assert!((fit1(&spiked).unwrap() - 2.0).abs() < 1e-9);
        assert!((fit1_ls(&spiked).unwrap() - 2.0).abs() > 0.1);
    }

    /// A synthetic trace: 2 MoE layers of 16 experts (3 projections each), top-4, a prefill of
    /// 8 tokens and `decode` steps, skewed routing from a fixed seed.
    fn synthetic_trace(decode: usize) -> String {
        let mut t = String::from(
            "# route_trace v1\n# model=syn arch=qwen3moe n_layer=3 n_expert=16 n_expert_used=4\n",
        );
        for l in 1..=2u64 {
            let base = l * 50_000_000 + 1000;
            t.push_str(&format!(
                "# layer={l} expert_bytes=300000 dense_bytes=2000000 proj=0:{}:100000,0:{}:100000,0:{}:100000\n",
                base,
                base + 1_600_123,
                base + 3_200_321
            ));
        }
        t.push_str("turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped\n");
        let mut s = 5u64;
        let mut row = |t: &mut String, phase: u8, step: usize, layer: u64| {
            let mut ids: Vec<u64> = Vec::new();
            while ids.len() < 4 {
                s = bmoe_core::testing::splitmix64(s);
                let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                let e = (u * u * 16.0) as u64;
                if !ids.contains(&e) {
                    ids.push(e);
                }
            }
            for (slot, e) in ids.iter().enumerate() {
                t.push_str(&format!("0,{phase},{step},{layer},{slot},{e},0.25,0,0,0\n"));
            }
        };
        for p in 0..8 {
            for l in 1..=2 {
                if l == 2 && p != 7 {
                    continue;
                }
                row(&mut t, 0, p, l);
            }
        }
        for d in 0..decode {
            for l in 1..=2 {
                row(&mut t, 1, 8 + d, l);
            }
        }
        t
    }

    /// The "measured" run of a calibration test: `bmoe-sim replay` of `trace` on the `truth`
    /// profile with a 4 MiB churning cache and `flags`, writing its CSV (and io trace).
    fn measure_with(
        dir: &std::path::Path,
        trace: &std::path::Path,
        truth: &DeviceProfile,
        flags: &[&str],
        csv: &std::path::Path,
        io: Option<&std::path::Path>,
    ) {
        let truth_path = dir.join("truth.json");
        std::fs::write(&truth_path, truth.to_json()).expect("profile");
        let mut args: Vec<String> = vec!["bmoe-sim".into(), "replay".into(), "--trace".into()];
        args.push(trace.display().to_string());
        args.extend(["--profile".into(), truth_path.display().to_string()]);
        args.extend(["--cache-mb", "4", "--force-cache"].map(String::from));
        args.extend(flags.iter().map(|f| f.to_string()));
        args.extend(["--csv".into(), csv.display().to_string()]);
        if let Some(io) = io {
            args.extend(["--io-trace".into(), io.display().to_string()]);
        }
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(
            crate::cli::run(args, &[], &mut out, &mut err),
            0,
            "{}",
            String::from_utf8_lossy(&err)
        );
    }

    #[test]
    fn calibration_recovers_the_profile_that_produced_a_run() {
        let dir = std::env::temp_dir().join(format!("bmoe-sim-cal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let trace_path = dir.join("t.csv");
        std::fs::write(&trace_path, synthetic_trace(200)).expect("trace");
        let truth = DeviceProfile {
            name: "truth".into(),
            description: String::new(),
            sources: vec!["test".into()],
            flash: FlashParams {
                read_latency_us: 80.0,
                lane_mib_per_s: 900.0,
                device_mib_per_s: 900.0,
                align_bytes: 4096,
                jitter: 0.0,
            },
            compute: ComputeParams {
                dense_mib_per_s: 3000.0,
                expert_mib_per_s: 3000.0,
                layer_fixed_us: 0.0,
                expert_fixed_us: 0.0,
                head_ms: 0.0,
                batch_row_factor: 0.3,
                release_us: 0.0,
                release_us_per_mib: 150.0,
                loop_overhead_ms: 0.5,
                jitter: 0.0,
            },
            mem_available_mib: 5000,
            threads: 2,
        };
        // The "measured" run: one lane, serial, a budget that churns.
        let csv_path = dir.join("run.csv");
        measure_with(
            &dir,
            &trace_path,
            &truth,
            &["--io-threads", "1"],
            &csv_path,
            None,
        );
        let csv =
            MetricsCsv::parse(&std::fs::read_to_string(&csv_path).expect("csv")).expect("parse");
        let base = DeviceProfile::load("this-machine").expect("base");
        let (stream, telemetry) = crate::cli::default_flags().expect("flags");
        let prepared = crate::cli::prepare(
            &trace_path,
            crate::cli::Reprice::Own,
            Some("this-machine"),
            None,
            &stream,
            &telemetry,
            0,
            &[],
        )
        .expect("prepare");
        let c = calibrate(&csv, "run.csv", Some(&prepared), None, &base, "fit").expect("fit");
        let close = |got: f64, want: f64, tol: f64, what: &str| {
            assert!(
                ((got - want) / want).abs() <= tol,
                "{what}: fitted {got}, true {want}\n{:#?}",
                c.notes
            );
        };
        let f = &c.profile.flash;
        let k = &c.profile.compute;
        close(f.read_latency_us, 80.0, 0.02, "latency");
        close(f.device_mib_per_s, 900.0, 0.02, "flash rate");
        close(k.dense_mib_per_s, 3000.0, 0.01, "compute rate");
        close(k.release_us_per_mib, 150.0, 0.02, "eviction cost");
        close(k.batch_row_factor, 0.3, 0.05, "batch factor");
        close(k.loop_overhead_ms, 0.5, 0.01, "loop overhead");
        assert!(c.notes.iter().any(|n| n.starts_with("in-sample tok/s")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// An overlapped run on four lanes: the fit over summed lane busy time is one lane's rate,
    /// and the device must deliver four of them at once — a ceiling of one lane's rate would
    /// serialise the lanes and make the replay far slower than the run it was fitted on.
    #[test]
    fn an_overlapped_run_calibrates_to_its_own_speed() {
        let dir = std::env::temp_dir().join(format!("bmoe-sim-cal-ov-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let trace_path = dir.join("t.csv");
        std::fs::write(&trace_path, synthetic_trace(200)).expect("trace");
        let mut truth = DeviceProfile::load("this-machine").expect("base");
        truth.flash = FlashParams {
            read_latency_us: 300.0,
            lane_mib_per_s: 300.0,
            device_mib_per_s: 1200.0,
            align_bytes: 4096,
            jitter: 0.0,
        };
        truth.compute.jitter = 0.0;
        truth.flash.jitter = 0.0;
        let (csv_path, io_path) = (dir.join("run.csv"), dir.join("run.io.csv"));
        measure_with(
            &dir,
            &trace_path,
            &truth,
            &["--io-threads", "4", "--overlap"],
            &csv_path,
            Some(&io_path),
        );
        let csv =
            MetricsCsv::parse(&std::fs::read_to_string(&csv_path).expect("csv")).expect("parse");
        let io = bmoe_core::telemetry::io_trace::parse_io_trace(
            &std::fs::read_to_string(&io_path).expect("io"),
        )
        .expect("io parse");
        let base = DeviceProfile::load("this-machine").expect("base");
        let (mut stream, telemetry) = crate::cli::default_flags().expect("flags");
        stream.overlap = true;
        stream.io_threads = Some(4);
        let prepared = crate::cli::prepare(
            &trace_path,
            crate::cli::Reprice::Own,
            Some("this-machine"),
            None,
            &stream,
            &telemetry,
            0,
            &[],
        )
        .expect("prepare");
        let c = calibrate(&csv, "run.csv", Some(&prepared), Some(&io), &base, "fit").expect("fit");
        let f = &c.profile.flash;
        assert!(
            f.device_mib_per_s >= 3.0 * f.lane_mib_per_s,
            "four lanes must be able to run at once: {f:?}\n{:#?}",
            c.notes
        );
        let tok_s = c
            .notes
            .iter()
            .find(|n| n.starts_with("in-sample tok/s"))
            .expect("in-sample note");
        let err_pct: f64 = tok_s
            .split("err ")
            .nth(1)
            .and_then(|t| t.split('%').next())
            .and_then(|t| t.trim().parse().ok())
            .expect("error figure");
        assert!(err_pct.abs() <= 10.0, "{tok_s}\n{:#?}", c.notes);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_preamble_gives_the_replay_configuration() {
        let text = "# bmoe_metrics v2\n# moe_stream=1 cache_mb=8 overlap=1 io_threads=3 o_direct=0 threads=2 n_expert_used=4\nstep,wall_ms\n1,2.0\n";
        let cfg = run_config_from_csv(&MetricsCsv::parse(text).expect("csv")).expect("cfg");
        assert_eq!(
            (
                cfg.cache_budget_mb,
                cfg.overlap,
                cfg.io_threads,
                cfg.o_direct,
                cfg.threads
            ),
            (8, true, 3, false, 2)
        );
        let baseline = "# bmoe_metrics v2\n# moe_stream=0\nstep,wall_ms\n1,2.0\n";
        assert!(run_config_from_csv(&MetricsCsv::parse(baseline).expect("csv")).is_err());
    }
}
