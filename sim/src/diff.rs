//! `bmoe-sim diff SIM.csv MEASURED.csv`: a simulated run against a measured one, metric by
//! metric.
//!
//! Two kinds of comparison, because the simulator promises two kinds of thing:
//! - **exact** — what the core decides (hits, misses, evictions, bytes): the row count, every
//!   row's `read_bytes` and `cache_hit_pct`, and the count and byte keys of every `# summary`
//!   trailer (where both files carry them) must be equal;
//! - **modelled** — what the device decides (time): tok/s, per-token wall time (p50, p90,
//!   MAPE and mean signed error), and the per-token I/O, stall and management time (MAPE and
//!   mean signed error), each against a tolerance.
//!
//! The result is a list of lines and a failure count; the binary exits 1 when anything is
//! outside, and can draw both per-token series in one SVG.

use crate::svg::{self, Chart, Series};
use bmoe_core::telemetry::fmt::fixed;
use bmoe_core::telemetry::MetricsCsv;

/// Summary keys that count or size what the core decided: equal in a faithful replay.
pub const EXACT_SUMMARY_KEYS: [&str; 21] = [
    "tokens",
    "read_MiB",
    "cache_hit_pct",
    "evictions",
    "rereads",
    // Only under an admission-filtering policy (absent keys are not compared).
    "bypasses",
    "experts_routed",
    "experts_dropped",
    "token_demand_MiB",
    "layer_demand_MiB",
    "n_prompt",
    "prefill_read_mib",
    "spec_read_MiB",
    "spec_experts",
    "spec_useful",
    "cache_budget_MiB",
    "cache_resident_MiB",
    // Speculation's counters: the trace's groups and turn-end lines say them.
    "mtp_drafted",
    "mtp_accepted",
    "mtp_decodes",
    "drafted_steps",
];

/// Relative tolerances of the modelled metrics (0.15 = 15%).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Tolerances {
    /// |sim − measured| / measured of decode tok/s.
    pub tok_s: f64,
    /// Relative error of the per-token wall time's median and 90th percentile.
    pub wall_p50: f64,
    pub wall_p90: f64,
    /// Mean absolute percentage error of the per-token wall time.
    pub wall_mape: f64,
    /// MAPE of per-token `io_ms` and `stall_ms` (rows where the measured value is above
    /// `floor_ms`).
    pub io_mape: f64,
    pub stall_mape: f64,
    /// Rows whose measured value is at or below this are left out of a MAPE (a relative
    /// error of a near-zero time means nothing).
    pub floor_ms: f64,
}

impl Default for Tolerances {
    fn default() -> Self {
        Tolerances {
            tok_s: 0.15,
            wall_p50: 0.15,
            wall_p90: 0.25,
            wall_mape: 0.20,
            io_mape: 0.30,
            stall_mape: 0.50,
            floor_ms: 0.05,
        }
    }
}

/// One compared metric.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    pub kind: &'static str,
    pub metric: String,
    pub detail: String,
    /// `None`: informational, not judged.
    pub ok: Option<bool>,
}

/// The comparison.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DiffReport {
    pub lines: Vec<Line>,
}

impl DiffReport {
    /// Lines outside their tolerance or not equal.
    pub fn failures(&self) -> usize {
        self.lines.iter().filter(|l| l.ok == Some(false)).count()
    }

    fn push(
        &mut self,
        kind: &'static str,
        metric: impl Into<String>,
        detail: String,
        ok: Option<bool>,
    ) {
        self.lines.push(Line {
            kind,
            metric: metric.into(),
            detail,
            ok,
        });
    }

    /// The report as text, one line per metric.
    pub fn text(&self) -> String {
        let mut s = String::new();
        for l in &self.lines {
            let verdict = match l.ok {
                Some(true) => "ok",
                Some(false) => "FAIL",
                None => "-",
            };
            s.push_str(&format!(
                "{:<6} {:<28} {:<58} {}\n",
                l.kind, l.metric, l.detail, verdict
            ));
        }
        s
    }
}

/// Nearest-rank percentile `p` (0..=100) of `v`, `None` when empty.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s: Vec<f64> = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    Some(s[rank.min(s.len()) - 1])
}

/// MAPE and mean signed error (ms) of `sim` against `measured`, over the rows whose measured
/// value exceeds `floor`; `None` when no row qualifies.
pub fn mape_and_bias(sim: &[f64], measured: &[f64], floor: f64) -> Option<(f64, f64, usize)> {
    let mut ape = 0.0;
    let mut signed = 0.0;
    let mut n = 0usize;
    for (&s, &m) in sim.iter().zip(measured) {
        if m > floor && s.is_finite() && m.is_finite() {
            ape += ((s - m) / m).abs();
            signed += s - m;
            n += 1;
        }
    }
    (n > 0).then(|| (ape / n as f64, signed / n as f64, n))
}

fn rel(sim: f64, measured: f64) -> Option<f64> {
    (measured.abs() > 0.0 && sim.is_finite() && measured.is_finite())
        .then(|| (sim - measured) / measured)
}

fn pct(x: f64) -> String {
    format!("{}%", fixed(100.0 * x, 1))
}

fn signed_pct(x: f64) -> String {
    let s = fixed(100.0 * x, 1);
    if x >= 0.0 {
        format!("+{s}%")
    } else {
        format!("{s}%")
    }
}

/// Compare `sim` against `measured`. With `exact_only` the modelled metrics are skipped.
pub fn compare(
    sim: &MetricsCsv,
    measured: &MetricsCsv,
    tol: &Tolerances,
    exact_only: bool,
) -> DiffReport {
    let mut r = DiffReport::default();
    let (ns, nm) = (sim.rows.len(), measured.rows.len());
    r.push("exact", "rows", format!("{ns} = {nm}"), Some(ns == nm));
    let n = ns.min(nm);
    for col in ["read_bytes", "cache_hit_pct"] {
        if !(sim.has_column(col) && measured.has_column(col)) {
            r.push(
                "exact",
                format!("{col} per token"),
                "absent from a file".into(),
                None,
            );
            continue;
        }
        let (a, b) = (
            sim.column_values(col).unwrap_or_default(),
            measured.column_values(col).unwrap_or_default(),
        );
        let first_bad = (0..n).find(|&i| a[i] != b[i]);
        let equal = (0..n).filter(|&i| a[i] == b[i]).count();
        let detail = match first_bad {
            None => format!("{equal}/{n} equal"),
            Some(i) => format!(
                "{equal}/{n} equal; first differs at row {} ({} vs {})",
                i + 1,
                a[i],
                b[i]
            ),
        };
        r.push(
            "exact",
            format!("{col} per token"),
            detail,
            Some(first_bad.is_none() && ns == nm),
        );
    }
    let (ss, ms) = (&sim.summaries, &measured.summaries);
    r.push(
        "exact",
        "summary trailers",
        format!("{} = {}", ss.len(), ms.len()),
        Some(ss.len() == ms.len()),
    );
    for key in EXACT_SUMMARY_KEYS {
        let mut compared = 0;
        let mut first_bad: Option<(usize, String, String)> = None;
        for (i, (a, b)) in ss.iter().zip(ms).enumerate() {
            if let (Some(x), Some(y)) = (a.get(key), b.get(key)) {
                compared += 1;
                if x != y && first_bad.is_none() {
                    first_bad = Some((i, x.to_string(), y.to_string()));
                }
            }
        }
        if compared == 0 {
            continue;
        }
        let detail = match &first_bad {
            None => {
                let v = ss.last().and_then(|s| s.get(key)).unwrap_or("");
                format!("equal in {compared} trailer(s) (last {v})")
            }
            Some((i, x, y)) => format!("trailer {}: {x} vs {y}", i + 1),
        };
        r.push(
            "exact",
            format!("summary {key}"),
            detail,
            Some(first_bad.is_none()),
        );
    }
    if exact_only {
        return r;
    }

    let wall = |m: &MetricsCsv| m.column_values("wall_ms").unwrap_or_default();
    let (ws, wm) = (wall(sim), wall(measured));
    let tps = |w: &[f64]| {
        let t: f64 = w.iter().sum();
        if t > 0.0 {
            w.len() as f64 * 1000.0 / t
        } else {
            0.0
        }
    };
    let (ts, tm) = (tps(&ws), tps(&wm));
    match rel(ts, tm) {
        Some(e) => r.push(
            "time",
            "tok/s",
            format!(
                "sim {} measured {} err {} tol {}",
                fixed(ts, 3),
                fixed(tm, 3),
                signed_pct(e),
                pct(tol.tok_s)
            ),
            Some(e.abs() <= tol.tok_s),
        ),
        None => r.push(
            "time",
            "tok/s",
            "no decode time in the measured file".into(),
            None,
        ),
    }
    for (name, p, t) in [
        ("wall_ms p50", 50.0, tol.wall_p50),
        ("wall_ms p90", 90.0, tol.wall_p90),
    ] {
        if let (Some(a), Some(b)) = (percentile(&ws, p), percentile(&wm, p)) {
            let e = rel(a, b);
            r.push(
                "time",
                name,
                format!(
                    "sim {} measured {} err {} tol {}",
                    fixed(a, 3),
                    fixed(b, 3),
                    e.map_or("n/a".into(), signed_pct),
                    pct(t)
                ),
                e.map(|e| e.abs() <= t),
            );
        }
    }
    for (col, t) in [
        ("wall_ms", Some(tol.wall_mape)),
        ("io_ms", Some(tol.io_mape)),
        ("stall_ms", Some(tol.stall_mape)),
        ("mgmt_ms", None),
        ("compute_ms", None),
    ] {
        let (Some(a), Some(b)) = (sim.column_values(col), measured.column_values(col)) else {
            continue;
        };
        match mape_and_bias(&a[..n.min(a.len())], &b[..n.min(b.len())], tol.floor_ms) {
            Some((mape, bias, rows)) => r.push(
                "time",
                format!("{col} per token"),
                format!(
                    "MAPE {} mean signed {} ms over {rows} rows{}",
                    pct(mape),
                    fixed(bias, 3),
                    t.map_or(String::new(), |t| format!(" tol {}", pct(t)))
                ),
                t.map(|t| mape <= t),
            ),
            None => r.push(
                "time",
                format!("{col} per token"),
                format!("measured never above {} ms: not judged", tol.floor_ms),
                None,
            ),
        }
    }
    r
}

/// Both files' per-token wall time (and I/O time) in one chart.
pub fn overlay_svg(sim: &MetricsCsv, measured: &MetricsCsv, title: &str) -> String {
    let series = |m: &MetricsCsv, col: &str, name: &str| Series {
        name: name.to_string(),
        points: m
            .column_values(col)
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, v)| ((i + 1) as f64, v))
            .collect(),
        dots: false,
    };
    svg::render(&Chart {
        title: title.to_string(),
        x_label: "token (row)".into(),
        y_label: "ms".into(),
        series: vec![
            series(sim, "wall_ms", "sim wall_ms"),
            series(measured, "wall_ms", "measured wall_ms"),
            series(sim, "io_ms", "sim io_ms"),
            series(measured, "io_ms", "measured io_ms"),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csv(rows: &[(u64, f64, f64, f64)], summary: &str) -> MetricsCsv {
        let mut t =
            String::from("# bmoe_metrics v2\nstep,wall_ms,io_ms,read_bytes,cache_hit_pct\n");
        for (i, (b, w, io, hit)) in rows.iter().enumerate() {
            t.push_str(&format!("{},{w},{io},{b},{hit}\n", i + 1));
        }
        t.push_str(summary);
        MetricsCsv::parse(&t).expect("csv")
    }

    #[test]
    fn stats() {
        assert_eq!(percentile(&[3.0, 1.0, 2.0, 4.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0, 4.0], 90.0), Some(4.0));
        assert_eq!(percentile(&[], 50.0), None);
        let (mape, bias, n) =
            mape_and_bias(&[110.0, 90.0, 5.0], &[100.0, 100.0, 0.0], 0.05).expect("rows");
        assert!((mape - 0.1).abs() < 1e-12);
        assert_eq!((bias, n), (0.0, 2));
        assert!(mape_and_bias(&[1.0], &[0.0], 0.05).is_none());
    }

    #[test]
    fn exact_and_modelled_verdicts() {
        let m = csv(
            &[(4096, 10.0, 5.0, 0.0), (0, 10.0, 0.0, 50.0)],
            "# summary tokens=2 read_MiB=0.0 evictions=1\n",
        );
        let same_counts = csv(
            &[(4096, 11.0, 5.5, 0.0), (0, 10.5, 0.0, 50.0)],
            "# summary tokens=2 read_MiB=0.0 evictions=1\n",
        );
        let r = compare(&same_counts, &m, &Tolerances::default(), false);
        assert_eq!(r.failures(), 0, "{}", r.text());
        assert!(r.text().contains("summary evictions"));

        let other_bytes = csv(
            &[(8192, 10.0, 5.0, 0.0), (0, 10.0, 0.0, 50.0)],
            "# summary tokens=2 read_MiB=0.0 evictions=2\n",
        );
        let r = compare(&other_bytes, &m, &Tolerances::default(), true);
        assert_eq!(r.failures(), 2, "{}", r.text());
        assert!(r.text().contains("first differs at row 1 (8192 vs 4096)"));

        let slow = csv(
            &[(4096, 20.0, 5.0, 0.0), (0, 20.0, 0.0, 50.0)],
            "# summary tokens=2 read_MiB=0.0 evictions=1\n",
        );
        let r = compare(&slow, &m, &Tolerances::default(), false);
        assert!(
            r.failures() >= 3,
            "tok/s, p50, p90 and wall MAPE: {}",
            r.text()
        );
        assert!(r.text().contains("err -50.0%"));
        let svg = overlay_svg(&slow, &m, "t");
        assert_eq!(svg.matches("<polyline").count(), 4);
    }
}
