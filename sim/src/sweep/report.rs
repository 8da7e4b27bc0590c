//! What a sweep writes for a researcher: the tidy table (`sweep.csv`, one row per cell, every
//! counter), the Markdown pivot (`pivot.md`: policy × budget, hit rate and tok/s with their
//! deltas against LRU, the share of the LRU→Belady headroom, bootstrap 95 % intervals), and
//! the per-layer table (`per_layer.csv`, `per_layer.md`).
//!
//! **Intervals.** A trace's turns (prompts) are the independent units: each interval is the
//! 2.5–97.5 percentile range of `B` bootstrap resamples of the turns, with replacement, of a
//! ratio of sums (Σ hits / Σ routings; Σ tokens / Σ decode seconds). Every cell uses the *same*
//! resamples (drawn once from the sweep's seed), so a delta against LRU is a paired difference
//! and its interval says whether the policy beats LRU beyond turn-to-turn variation. The cache
//! stays warm across turns, so turns are not perfectly independent: the intervals describe
//! prompt-to-prompt variation, not run-to-run noise (the replay is deterministic). With fewer
//! than `MIN_TURNS` turns no interval is given.

use super::{ratio, Row, BELADY};
use bmoe_core::config::MIB;
use bmoe_core::telemetry::fmt::fixed;
use rand::{Rng, SeedableRng};
use std::fmt::Write as _;

/// Fewest turns a bootstrap interval is computed from.
pub const MIN_TURNS: usize = 10;

/// What the x-axis (and the pivot's columns) measure a budget in (`--x`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum XAxis {
    /// MiB.
    Mib,
    /// Experts per MoE layer.
    Experts,
    /// Percent of the expert bank (every expert of every MoE layer).
    Pct,
}

impl XAxis {
    /// Parse `mib`, `experts` or `pct`.
    pub fn parse(s: &str) -> Option<XAxis> {
        match s {
            "mib" => Some(XAxis::Mib),
            "experts" => Some(XAxis::Experts),
            "pct" => Some(XAxis::Pct),
            _ => None,
        }
    }

    /// A row's budget on this axis.
    pub fn value(self, r: &Row) -> f64 {
        match self {
            XAxis::Mib => r.budget_bytes as f64 / MIB as f64,
            XAxis::Experts => r.experts_per_layer,
            XAxis::Pct => 100.0 * r.bank_frac,
        }
    }

    /// The axis label.
    pub fn label(self) -> &'static str {
        match self {
            XAxis::Mib => "cache budget (MiB)",
            XAxis::Experts => "cache budget (experts per MoE layer)",
            XAxis::Pct => "cache budget (% of the expert bank)",
        }
    }

    /// A budget as a column heading.
    pub fn heading(self, r: &Row) -> String {
        match self {
            XAxis::Mib => format!("{} MiB", fixed(self.value(r), 0)),
            XAxis::Experts => format!("{}/layer", trim(self.value(r), 2)),
            XAxis::Pct => format!("{} %", fixed(self.value(r), 1)),
        }
    }
}

/// `v` with at most `places` decimals, trailing zeros dropped (6.00 → 6, 1.50 → 1.5).
pub fn trim(v: f64, places: usize) -> String {
    let s = fixed(v, places);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// A 95 % interval.
pub type Interval = (f64, f64);

/// The statistics a cell's outputs carry beside its counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CellStats {
    /// Decode routing hit rate and its interval.
    pub hit: f64,
    pub hit_ci: Option<Interval>,
    /// tok/s interval (the point value is `Row::tok_s`).
    pub tok_s_ci: Option<Interval>,
    /// Decode hit rate minus LRU's at the same predictor, budget, lanes and overlap (fraction),
    /// with its paired interval.
    pub d_hit: Option<f64>,
    pub d_hit_ci: Option<Interval>,
    /// tok/s relative to LRU's (fraction: +0.05 = 5 % faster), with its paired interval.
    pub d_tok_s: Option<f64>,
    pub d_tok_s_ci: Option<Interval>,
    /// (hit − LRU's) / (Belady's − LRU's) at the same budget, lanes and overlap, predictor none.
    pub belady_share: Option<f64>,
}

/// Bootstrap resamples: `draws[b]` holds, per turn, how many times resample `b` drew it.
pub struct Resamples {
    weights: Vec<Vec<u32>>,
}

impl Resamples {
    /// `b` resamples of `n` turns from `seed`; none when `n < MIN_TURNS` or `b == 0`.
    pub fn new(n: usize, b: usize, seed: u64) -> Resamples {
        if n < MIN_TURNS || b == 0 {
            return Resamples {
                weights: Vec::new(),
            };
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0xb007_57a9);
        let weights = (0..b)
            .map(|_| {
                let mut w = vec![0u32; n];
                for _ in 0..n {
                    w[rng.gen_range(0..n)] += 1;
                }
                w
            })
            .collect();
        Resamples { weights }
    }

    /// The resampled values of `f(weights)`.
    fn map(&self, f: impl Fn(&[u32]) -> f64) -> Vec<f64> {
        self.weights.iter().map(|w| f(w)).collect()
    }

    fn hit(&self, r: &Row) -> Vec<f64> {
        self.map(|w| {
            let (mut n, mut h) = (0u64, 0u64);
            for (t, &k) in r.per_turn.iter().zip(w) {
                n += t.routings * u64::from(k);
                h += t.hits * u64::from(k);
            }
            ratio(h, n)
        })
    }

    /// Resampled tok/s; empty for a cell without times (cache-only).
    fn tok_s(&self, r: &Row) -> Vec<f64> {
        if r.per_turn.iter().any(|t| t.time.is_none()) {
            return Vec::new();
        }
        self.map(|w| {
            let (mut n, mut s) = (0u64, 0f64);
            for (t, &k) in r.per_turn.iter().zip(w) {
                let time = t.time.unwrap_or_default();
                n += time.tokens * u64::from(k);
                s += time.decode_s * f64::from(k);
            }
            if s > 0.0 {
                n as f64 / s
            } else {
                0.0
            }
        })
    }
}

/// The 2.5 and 97.5 percentiles (nearest rank); `None` for no values.
fn interval(mut v: Vec<f64>) -> Option<Interval> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    Some((at(0.025), at(0.975)))
}

type Key = (String, u32, bool, u64);

fn key(r: &Row) -> Key {
    (r.predictor.clone(), r.lanes, r.overlap, r.budget_bytes)
}

/// Every row's statistics (same order as `rows`), from `b` bootstrap resamples seeded by
/// `seed`.
pub fn analyse(rows: &[Row], b: usize, seed: u64) -> Vec<CellStats> {
    let n_turns = rows.first().map_or(0, |r| r.per_turn.len());
    let rs = Resamples::new(n_turns, b, seed);
    let usable = |r: &Row| r.per_turn.len() == n_turns && !rs.weights.is_empty();
    let boot: Vec<Option<(Vec<f64>, Vec<f64>)>> = rows
        .iter()
        .map(|r| usable(r).then(|| (rs.hit(r), rs.tok_s(r))))
        .collect();
    let find = |k: &Key, policy: &str| -> Option<usize> {
        rows.iter().position(|r| r.policy == policy && key(r) == *k)
    };
    rows.iter()
        .enumerate()
        .map(|(i, r)| {
            let hit = r.decode_hit_rate();
            let mut s = CellStats {
                hit,
                ..CellStats::default()
            };
            if let Some((h, t)) = &boot[i] {
                s.hit_ci = interval(h.clone());
                s.tok_s_ci = interval(t.clone());
            }
            if let Some(l) = find(&key(r), "lru") {
                let lru = &rows[l];
                s.d_hit = Some(hit - lru.decode_hit_rate());
                if let (Some(t), Some(lt)) = (r.tok_s(), lru.tok_s()) {
                    if lt > 0.0 {
                        s.d_tok_s = Some(t / lt - 1.0);
                    }
                }
                if let (Some((h, t)), Some((lh, lt))) = (&boot[i], &boot[l]) {
                    s.d_hit_ci = interval(h.iter().zip(lh).map(|(a, b)| a - b).collect());
                    s.d_tok_s_ci = interval(
                        t.iter()
                            .zip(lt)
                            .filter(|(_, b)| **b > 0.0)
                            .map(|(a, b)| a / b - 1.0)
                            .collect(),
                    );
                }
                if r.predictor == "none" {
                    if let Some(bi) = find(&key(r), BELADY) {
                        let gap = rows[bi].decode_hit_rate() - lru.decode_hit_rate();
                        if gap > 1e-9 {
                            s.belady_share = Some((hit - lru.decode_hit_rate()) / gap);
                        }
                    }
                }
            }
            s
        })
        .collect()
}

/// Column names of `sweep.csv`, in order. `mode` says what produced the row (`full-timing`
/// or `cache-only`); a cache-only row leaves `lanes`, `overlap` and every read and time column
/// empty (it models no I/O and no clock).
pub const COLUMNS: &[&str] = &[
    "mode",
    "predictor",
    "policy",
    "lanes",
    "overlap",
    "budget_bytes",
    "budget_mib",
    "experts_per_layer",
    "bank_pct",
    "lookups",
    "hits",
    "misses",
    "evictions",
    "rereads",
    "inserts",
    "hit_rate",
    "decode_routings",
    "decode_hits",
    "decode_hit_rate",
    "decode_hit_rate_lo",
    "decode_hit_rate_hi",
    "d_hit_vs_lru",
    "d_hit_vs_lru_lo",
    "d_hit_vs_lru_hi",
    "belady_share",
    "read_bytes",
    "read_mib",
    "read_mib_per_tok",
    "spec_experts",
    "spec_useful",
    "spec_useful_frac",
    "spec_read_bytes",
    "tokens",
    "turns",
    "tok_s",
    "tok_s_lo",
    "tok_s_hi",
    "d_tok_s_vs_lru",
    "d_tok_s_vs_lru_lo",
    "d_tok_s_vs_lru_hi",
    "s_per_tok",
    "compute_s_per_tok",
    "io_s_per_tok",
    "stall_s_per_tok",
    "mgmt_s_per_tok",
    // Appended (issue 36): misses an admission-filtering policy bypassed.
    "bypasses",
];

fn opt(v: Option<f64>, places: usize) -> String {
    v.map_or(String::new(), |x| fixed(x, places))
}

/// The tidy table: one row per cell, `COLUMNS` in order; empty fields where a value does not
/// apply (no interval, no LRU or Belady cell to compare with, no timing in a cache-only cell).
pub fn tidy_csv(rows: &[Row], stats: &[CellStats]) -> String {
    let mut out = COLUMNS.join(",");
    out.push('\n');
    for (r, s) in rows.iter().zip(stats) {
        let (dr, dh) = r.decode_counts();
        let lo = |c: Option<Interval>| c.map(|c| c.0);
        let hi = |c: Option<Interval>| c.map(|c| c.1);
        let timed = r.timing;
        // A value only a full-timing cell has: empty in a cache-only one.
        let t = |f: &dyn Fn(&super::Timing) -> String| timed.as_ref().map_or(String::new(), f);
        let mut fields: Vec<String> = vec![
            r.mode().name().to_string(),
            r.predictor.clone(),
            r.policy.clone(),
            t(&|_| r.lanes.to_string()),
            t(&|_| u8::from(r.overlap).to_string()),
            r.budget_bytes.to_string(),
            fixed(r.budget_bytes as f64 / MIB as f64, 1),
            fixed(r.experts_per_layer, 2),
            fixed(100.0 * r.bank_frac, 2),
            r.lookups.to_string(),
            r.hits.to_string(),
            r.misses.to_string(),
            r.evictions.to_string(),
            r.rereads.to_string(),
            r.inserts.to_string(),
            fixed(r.hit_rate(), 4),
            dr.to_string(),
            dh.to_string(),
            fixed(s.hit, 4),
            opt(lo(s.hit_ci), 4),
            opt(hi(s.hit_ci), 4),
            opt(s.d_hit, 4),
            opt(lo(s.d_hit_ci), 4),
            opt(hi(s.d_hit_ci), 4),
            opt(s.belady_share, 3),
        ];
        fields.extend([
            t(&|m| m.read_bytes.to_string()),
            t(&|m| fixed(m.read_bytes as f64 / MIB as f64, 1)),
            t(&|m| fixed(ratio(m.read_bytes, m.tokens.max(1)) / MIB as f64, 3)),
            t(&|m| m.spec_experts.to_string()),
            t(&|m| m.spec_useful.to_string()),
            t(&|m| {
                if m.spec_experts > 0 {
                    fixed(ratio(m.spec_useful, m.spec_experts), 4)
                } else {
                    String::new()
                }
            }),
            t(&|m| m.spec_read_bytes.to_string()),
            t(&|m| m.tokens.to_string()),
            r.per_turn.len().to_string(),
            t(&|m| fixed(m.tok_s, 4)),
            opt(lo(s.tok_s_ci), 4),
            opt(hi(s.tok_s_ci), 4),
            opt(s.d_tok_s, 4),
            opt(lo(s.d_tok_s_ci), 4),
            opt(hi(s.d_tok_s_ci), 4),
            t(&|m| fixed(m.s_per_tok, 5)),
            t(&|m| fixed(m.compute_s_per_tok, 5)),
            t(&|m| fixed(m.io_s_per_tok, 5)),
            t(&|m| fixed(m.stall_s_per_tok, 5)),
            t(&|m| fixed(m.mgmt_s_per_tok, 5)),
            r.bypasses.to_string(),
        ]);
        debug_assert_eq!(fields.len(), COLUMNS.len());
        out.push_str(&fields.join(","));
        out.push('\n');
    }
    out
}

/// The distinct values of `f` over `rows`, in first-seen order.
pub fn distinct<T: PartialEq + Clone>(rows: &[Row], f: impl Fn(&Row) -> T) -> Vec<T> {
    let mut v: Vec<T> = Vec::new();
    for r in rows {
        let x = f(r);
        if !v.contains(&x) {
            v.push(x);
        }
    }
    v
}

/// The (lanes, overlap) setting as a caption; lanes 0 is a cache-only cell's (no I/O).
pub fn setting_name(lanes: u32, overlap: bool) -> String {
    if lanes == 0 {
        return "cache-only: no I/O or time modelled".to_string();
    }
    format!(
        "{lanes} lane{}, overlap {}",
        if lanes == 1 { "" } else { "s" },
        if overlap { "on" } else { "off" }
    )
}

fn pct(v: f64) -> String {
    format!("{} %", fixed(100.0 * v, 1))
}

fn signed(v: f64, places: usize) -> String {
    let s = fixed(v, places);
    if v >= 0.0 && !s.starts_with('-') {
        format!("+{s}")
    } else {
        s
    }
}

fn ci_pct(c: Option<Interval>) -> String {
    c.map_or(String::new(), |(a, b)| {
        format!(" [{}–{}]", fixed(100.0 * a, 1), fixed(100.0 * b, 1))
    })
}

fn ci_num(c: Option<Interval>, places: usize) -> String {
    c.map_or(String::new(), |(a, b)| {
        format!(" [{}–{}]", fixed(a, places), fixed(b, places))
    })
}

/// Decimal places that show a tok/s value with about 3 significant digits.
fn tok_places(v: f64) -> usize {
    if v >= 100.0 {
        1
    } else if v >= 10.0 {
        2
    } else {
        3
    }
}

/// The Markdown pivot.
pub fn pivot_md(rows: &[Row], stats: &[CellStats], x: XAxis, title: &str) -> String {
    let mut o = String::new();
    let n_turns = rows.first().map_or(0, |r| r.per_turn.len());
    let boot = stats.iter().any(|s| s.hit_ci.is_some());
    let _ = writeln!(o, "# Sweep: {title}\n");
    let timed = rows.iter().all(|r| r.timing.is_some());
    let _ = writeln!(
        o,
        "Mode: {}.\n",
        if timed {
            "full-timing (each cell a replay of the core on the modelled device: counts, reads and \
             times)"
        } else {
            "cache-only (each cell the core's cache and policy over the access sequence: counts \
             only; no reads, times or tok/s were modelled, so no tok/s table)"
        }
    );
    let _ = writeln!(
        o,
        "{} cells; hit rate = decode routings found resident (a prefetched expert's first use \
         counts); Δ against `lru` at the same predictor, budget, lanes and overlap (points of hit \
         rate; % of tok/s). {}\n",
        rows.len(),
        if boot {
            format!(
                "[lo–hi] = bootstrap 95 % interval over the trace's {n_turns} turns (paired for Δ)."
            )
        } else {
            format!(
                "No intervals: the trace has {n_turns} turn(s); at least {MIN_TURNS} are needed."
            )
        }
    );
    let budgets = distinct(rows, |r| r.budget_bytes);
    let heading = |b: u64| {
        rows.iter()
            .find(|r| r.budget_bytes == b)
            .map_or(String::new(), |r| x.heading(r))
    };
    let header = |o: &mut String, first: &str| {
        let _ = write!(o, "| {first} |");
        for &b in &budgets {
            let _ = write!(o, " {} |", heading(b));
        }
        let _ = write!(o, "\n| --- |");
        for _ in &budgets {
            let _ = write!(o, " --- |");
        }
        o.push('\n');
    };
    let settings = distinct(rows, |r| (r.lanes, r.overlap));
    for predictor in distinct(rows, |r| r.predictor.clone()) {
        let of_p: Vec<usize> = (0..rows.len())
            .filter(|&i| rows[i].predictor == predictor)
            .collect();
        let policies = distinct(rows, |r| r.policy.clone())
            .into_iter()
            .filter(|p| of_p.iter().any(|&i| &rows[i].policy == p))
            .collect::<Vec<_>>();
        let cell = |p: &str, b: u64, (l, ov): (u32, bool)| {
            of_p.iter().copied().find(|&i| {
                let r = &rows[i];
                r.policy == p && r.budget_bytes == b && r.lanes == l && r.overlap == ov
            })
        };
        // The hit-rate table (and its Belady-share table) of one lanes/overlap setting.
        let hit_tables = |(l, ov): (u32, bool)| {
            let mut o = String::new();
            header(&mut o, "policy");
            for p in &policies {
                let _ = write!(o, "| {p} |");
                for &b in &budgets {
                    match cell(p, b, (l, ov)) {
                        Some(i) => {
                            let s = &stats[i];
                            let _ = write!(o, " {}{}", pct(s.hit), ci_pct(s.hit_ci));
                            if p != "lru" {
                                if let Some(d) = s.d_hit {
                                    let _ = write!(
                                        o,
                                        " ({} pt{})",
                                        signed(100.0 * d, 1),
                                        s.d_hit_ci.map_or(String::new(), |(a, b)| format!(
                                            " [{}, {}]",
                                            signed(100.0 * a, 1),
                                            signed(100.0 * b, 1)
                                        ))
                                    );
                                }
                            }
                            o.push_str(" |");
                        }
                        None => o.push_str(" — |"),
                    }
                }
                o.push('\n');
            }
            o.push('\n');
            let shares = policies
                .iter()
                .filter(|p| *p != "lru" && *p != BELADY)
                .any(|p| {
                    budgets.iter().any(|&b| {
                        cell(p, b, (l, ov)).is_some_and(|i| stats[i].belady_share.is_some())
                    })
                });
            if shares {
                let _ = writeln!(
                    o,
                    "Share of the LRU→Belady headroom captured, (hit − lru) / (belady − lru):\n"
                );
                header(&mut o, "policy");
                for p in policies.iter().filter(|p| *p != "lru" && *p != BELADY) {
                    let _ = write!(o, "| {p} |");
                    for &b in &budgets {
                        let v = cell(p, b, (l, ov)).and_then(|i| stats[i].belady_share);
                        let _ = write!(
                            o,
                            " {} |",
                            v.map_or("—".to_string(), |v| format!("{} %", signed(100.0 * v, 0)))
                        );
                    }
                    o.push('\n');
                }
                o.push('\n');
            }
            o
        };
        // Hit rates depend on lanes and overlap only through a predictor's timing: settings
        // whose tables are identical share one, said so, rather than repeating it byte for
        // byte (in the order the settings first appear).
        let mut groups: Vec<(String, Vec<(u32, bool)>)> = Vec::new();
        for &setting in &settings {
            let body = hit_tables(setting);
            match groups.iter_mut().find(|(b, _)| *b == body) {
                Some((_, of)) => of.push(setting),
                None => groups.push((body, vec![setting])),
            }
        }
        let names = |of: &[(u32, bool)]| {
            of.iter()
                .map(|&(l, ov)| setting_name(l, ov))
                .collect::<Vec<_>>()
                .join("; ")
        };
        for (body, of) in &groups {
            if !timed {
                let _ = writeln!(
                    o,
                    "## Hit rate, predictor `{predictor}` (cache-only: the same under every lanes/overlap setting)\n"
                );
            } else if groups.len() == 1 {
                let _ = writeln!(
                    o,
                    "## Hit rate, predictor `{predictor}` (the same under every lanes/overlap setting)\n"
                );
                if of.len() > 1 {
                    let _ = writeln!(
                        o,
                        "This table holds for every lanes/overlap setting of the sweep ({}): \
                         the hit rates do not depend on them here.\n",
                        names(of)
                    );
                }
            } else {
                let _ = writeln!(o, "## Hit rate, predictor `{predictor}`, {}\n", names(of));
                if of.len() > 1 {
                    let _ = writeln!(
                        o,
                        "This table holds for each of these lanes/overlap settings: their hit \
                         rates are identical.\n"
                    );
                }
            }
            o.push_str(body);
        }
        for &(l, ov) in settings.iter().filter(|_| timed) {
            let _ = writeln!(
                o,
                "## Predicted tok/s, predictor `{predictor}`, {}\n",
                setting_name(l, ov)
            );
            header(&mut o, "policy");
            for p in &policies {
                let _ = write!(o, "| {p} |");
                for &b in &budgets {
                    match cell(p, b, (l, ov)) {
                        Some(i) => {
                            let (tok_s, s) = (rows[i].tok_s().unwrap_or(0.0), &stats[i]);
                            let places = tok_places(tok_s);
                            let _ = write!(
                                o,
                                " {}{}",
                                fixed(tok_s, places),
                                ci_num(s.tok_s_ci, places)
                            );
                            if p != "lru" {
                                if let Some(d) = s.d_tok_s {
                                    let _ = write!(o, " ({} %)", signed(100.0 * d, 1));
                                }
                            }
                            o.push_str(" |");
                        }
                        None => o.push_str(" — |"),
                    }
                }
                o.push('\n');
            }
            o.push('\n');
        }
    }
    o
}

/// `per_layer.csv`: one row per (cell, MoE layer); `mode`, `lanes` and `overlap` as in
/// `sweep.csv`.
pub fn per_layer_csv(rows: &[Row], layer_ids: &[u32]) -> String {
    let mut o = String::from(
        "mode,predictor,policy,lanes,overlap,budget_bytes,experts_per_layer,layer,routings,hits,hit_rate\n",
    );
    for r in rows {
        for (m, &(n, h)) in r.per_layer.iter().enumerate() {
            let (lanes, overlap) = match r.timing {
                Some(_) => (r.lanes.to_string(), u8::from(r.overlap).to_string()),
                None => (String::new(), String::new()),
            };
            let _ = writeln!(
                o,
                "{},{},{},{},{},{},{},{},{n},{h},{}",
                r.mode().name(),
                r.predictor,
                r.policy,
                lanes,
                overlap,
                r.budget_bytes,
                fixed(r.experts_per_layer, 2),
                layer_ids.get(m).copied().unwrap_or(m as u32),
                fixed(ratio(h, n), 4)
            );
        }
    }
    o
}

/// `per_layer.md`: per budget, a layer × policy table of decode hit rates (the first lanes/
/// overlap setting; per predictor).
pub fn per_layer_md(rows: &[Row], layer_ids: &[u32], x: XAxis, title: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# Per-layer decode hit rate: {title}\n");
    let Some(first) = rows.first() else {
        return o;
    };
    let (l0, o0) = (first.lanes, first.overlap);
    let _ = writeln!(
        o,
        "{}; rows are the trace's MoE layers (model layer ids).\n",
        setting_name(l0, o0)
    );
    let sel: Vec<&Row> = rows
        .iter()
        .filter(|r| r.lanes == l0 && r.overlap == o0)
        .collect();
    for predictor in distinct(rows, |r| r.predictor.clone()) {
        for b in distinct(rows, |r| r.budget_bytes) {
            let cells: Vec<&&Row> = sel
                .iter()
                .filter(|r| r.predictor == predictor && r.budget_bytes == b)
                .collect();
            let Some(any) = cells.first() else {
                continue;
            };
            let _ = writeln!(o, "## {}, predictor `{predictor}`\n", x.heading(any));
            let _ = write!(o, "| layer |");
            for r in &cells {
                let _ = write!(o, " {} |", r.policy);
            }
            let _ = write!(o, "\n| --- |");
            for _ in &cells {
                let _ = write!(o, " --- |");
            }
            o.push('\n');
            for (m, id) in layer_ids.iter().enumerate() {
                let _ = write!(o, "| {id} |");
                for r in &cells {
                    let (n, h) = r.per_layer.get(m).copied().unwrap_or((0, 0));
                    let _ = write!(o, " {} |", pct(ratio(h, n)));
                }
                o.push('\n');
            }
            o.push('\n');
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::super::TurnStat;
    use super::*;

    fn row(policy: &str, turns: &[(u64, u64, f64)]) -> Row {
        Row {
            predictor: "none".into(),
            budget_bytes: 8 * MIB,
            experts_per_layer: 2.0,
            bank_frac: 0.25,
            policy: policy.into(),
            lanes: 1,
            overlap: false,
            lookups: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
            rereads: 0,
            inserts: 0,
            bypasses: 0,
            timing: Some(super::super::Timing {
                tokens: turns.len() as u64,
                tok_s: 1.0,
                s_per_tok: 1.0,
                ..Default::default()
            }),
            per_layer: vec![(1, 1)],
            per_turn: turns
                .iter()
                .map(|&(routings, hits, decode_s)| TurnStat {
                    routings,
                    hits,
                    time: Some(super::super::TurnTime {
                        tokens: 1,
                        decode_s,
                    }),
                })
                .collect(),
        }
    }

    #[test]
    fn belady_share_and_paired_deltas() {
        let t = |h: u64| {
            (0..12)
                .map(move |i| (10, h + (i % 3), 1.0))
                .collect::<Vec<_>>()
        };
        let rows = vec![row("lru", &t(2)), row("lfu", &t(4)), row(BELADY, &t(6))];
        let s = analyse(&rows, 200, 7);
        // lru 3/10 on average, lfu 5/10, belady 7/10: lfu captures half the headroom.
        assert!((s[1].belady_share.expect("share") - 0.5).abs() < 1e-9);
        assert!((s[1].d_hit.expect("d") - 0.2).abs() < 1e-9);
        // The same turns drawn for both cells: the paired delta has no spread.
        let (lo, hi) = s[1].d_hit_ci.expect("ci");
        assert!(
            (lo - 0.2).abs() < 1e-9 && (hi - 0.2).abs() < 1e-9,
            "{lo} {hi}"
        );
        let (lo, hi) = s[0].hit_ci.expect("ci");
        assert!(lo < 0.3 && hi > 0.3 && lo >= 0.2 && hi <= 0.4, "{lo} {hi}");
        assert!(s[0].belady_share.is_none() || s[0].belady_share == Some(0.0));
        // Same seed, same intervals; too few turns, none.
        assert_eq!(analyse(&rows, 200, 7), s);
        let few = vec![row("lru", &t(2)[..3])];
        assert!(analyse(&few, 200, 7)[0].hit_ci.is_none());
        let csv = tidy_csv(&rows, &s);
        let header: Vec<&str> = csv.lines().next().expect("header").split(',').collect();
        assert_eq!(header, COLUMNS);
        assert!(csv
            .lines()
            .skip(1)
            .all(|l| l.split(',').count() == COLUMNS.len()));
        let md = pivot_md(&rows, &s, XAxis::Experts, "t");
        assert!(md.contains("| lfu | 50.0 %"), "{md}");
        assert!(md.contains("(+20.0 pt [+20.0, +20.0])"), "{md}");
        assert!(md.contains("| lfu | +50 % |"), "{md}");
    }

    #[test]
    fn x_axes_parse() {
        for (s, x) in [
            ("mib", XAxis::Mib),
            ("experts", XAxis::Experts),
            ("pct", XAxis::Pct),
        ] {
            assert_eq!(XAxis::parse(s), Some(x));
        }
        assert_eq!(XAxis::parse("bytes"), None);
        let r = row("lru", &[]);
        assert_eq!(XAxis::Mib.value(&r), 8.0);
        assert_eq!(XAxis::Pct.value(&r), 25.0);
    }
}
