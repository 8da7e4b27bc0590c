//! The `--csv` metrics file (`# bmoe_metrics v2`): run-parameter preamble, one row per token,
//! `# summary` trailer — and the reader the simulator's `diff` and `calibrate` use on it.
//!
//! A row without the preamble is not evidence (two files only answer "which is faster" if they
//! say what differed), so the preamble prints the **resolved** `RunConfig`. Consumers read
//! columns by NAME: columns are append-only and any may be missing from an older file, which
//! the reader tolerates; keys in `#` lines are order-independent and unknown ones are kept.

use std::io::{self, Write};

use super::fmt::{bit, fixed, g4, kv_token, parse_key_values};
use super::summary::RunSummary;
use super::ParseError;
use crate::config::{RunConfig, MIB};

/// The first line of every metrics file.
pub const METRICS_MAGIC: &str = "# bmoe_metrics v2";
const FORMAT: &str = "bmoe_metrics";

/// The per-token columns in the contract's order.
pub const COLUMNS: [&str; 29] = [
    "step",
    "steps",
    "wall_ms",
    "io_ms",
    "compute_ms",
    "read_bytes",
    "cache_hit_pct",
    "stall_ms",
    "mgmt_ms",
    "majflt",
    "cpu_ms",
    "dense_resident_frac",
    "turn",
    "majflt_mib",
    "cache_budget_mib",
    "rss_mib",
    "rss_anon_mib",
    "rss_file_mib",
    "swap_mib",
    "mem_available_mib",
    "mem_free_mib",
    "swap_free_mib",
    "loop_overhead_ms",
    "mtp_batch",
    "mtp_draft_ms",
    "drain_ms",
    "adopt_ms",
    "ra_issue_ms",
    "ra_wd_ms",
];

/// One generated token: a CSV row, and the source of its `BMOE_PROGRESS` line. Every column of
/// the contract, in its units. Probes a platform cannot take stay 0 (or -1 where the contract
/// says "unmeasured" is -1).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenRecord {
    /// 1-based index of the token in this generation.
    pub step: u32,
    /// Target token count of this generation.
    pub steps: u32,
    /// Decode wall time of the token (the step, nothing between steps).
    pub wall_ms: f64,
    /// Flash read time: blocked wall time in serial; summed lane busy time under overlap.
    pub io_ms: f64,
    /// Residual, not measured: see `compute_residual_ms`.
    pub compute_ms: f64,
    /// Flash bytes read this token (aligned windows, demand and speculative).
    pub read_bytes: u64,
    /// Cumulative cache hit rate, -1 when no cache is used.
    pub cache_hit_pct: f64,
    /// Union of the intervals compute waited on a read (overlap; 0 in serial).
    pub stall_ms: f64,
    /// Cache management: slot commits, evictions, bookkeeping.
    pub mgmt_ms: f64,
    /// Major page faults this token.
    pub majflt: u64,
    /// Process CPU time this token, all threads.
    pub cpu_ms: f64,
    /// Sampled fraction of dense weights still resident, -1 = unmeasured.
    pub dense_resident_frac: f64,
    /// Session turn, 0 for a one-shot run.
    pub turn: u32,
    /// `majflt` × page size, in MiB.
    pub majflt_mib: f64,
    /// Expert-cache budget in effect.
    pub cache_budget_mib: f64,
    pub rss_mib: f64,
    pub rss_anon_mib: f64,
    pub rss_file_mib: f64,
    pub swap_mib: f64,
    pub mem_available_mib: f64,
    pub mem_free_mib: f64,
    pub swap_free_mib: f64,
    /// Wall time between the previous token's decode and this one's.
    pub loop_overhead_ms: f64,
    /// Tokens the decode that produced this row confirmed (1 without speculation).
    pub mtp_batch: u32,
    /// Drafting time of this group (a slice of `loop_overhead_ms`).
    pub mtp_draft_ms: f64,
    /// Overlap: waiting for the previous layer's read batch (part of `compute_ms`).
    pub drain_ms: f64,
    /// Route-ahead: waiting for committed speculative reads (part of `mgmt_ms`).
    pub adopt_ms: f64,
    /// Route-ahead: issuing the early reads (part of `compute_ms`).
    pub ra_issue_ms: f64,
    /// Route-ahead: the watchdog GEMV (part of `compute_ms`).
    pub ra_wd_ms: f64,
}

impl Default for TokenRecord {
    fn default() -> Self {
        TokenRecord {
            step: 0,
            steps: 0,
            wall_ms: 0.0,
            io_ms: 0.0,
            compute_ms: 0.0,
            read_bytes: 0,
            cache_hit_pct: -1.0,
            stall_ms: 0.0,
            mgmt_ms: 0.0,
            majflt: 0,
            cpu_ms: 0.0,
            dense_resident_frac: -1.0,
            turn: 0,
            majflt_mib: 0.0,
            cache_budget_mib: 0.0,
            rss_mib: 0.0,
            rss_anon_mib: 0.0,
            rss_file_mib: 0.0,
            swap_mib: 0.0,
            mem_available_mib: 0.0,
            mem_free_mib: 0.0,
            swap_free_mib: 0.0,
            loop_overhead_ms: 0.0,
            mtp_batch: 1,
            mtp_draft_ms: 0.0,
            drain_ms: 0.0,
            adopt_ms: 0.0,
            ra_issue_ms: 0.0,
            ra_wd_ms: 0.0,
        }
    }
}

/// The contract's compute residual: `wall − io − mgmt` in serial, `wall − stall − mgmt` under
/// overlap, clamped at 0 (a negative compute would be nonsense).
pub fn compute_residual_ms(
    wall_ms: f64,
    io_ms: f64,
    stall_ms: f64,
    mgmt_ms: f64,
    overlap: bool,
) -> f64 {
    let flash_ms = if overlap { stall_ms } else { io_ms };
    (wall_ms - flash_ms - mgmt_ms).max(0.0)
}

impl TokenRecord {
    /// Sets `compute_ms` to the residual of this row's measured terms.
    pub fn set_compute_residual(&mut self, overlap: bool) {
        self.compute_ms = compute_residual_ms(
            self.wall_ms,
            self.io_ms,
            self.stall_ms,
            self.mgmt_ms,
            overlap,
        );
    }

    /// The row's value of the named column, as a number.
    pub fn column(&self, name: &str) -> Option<f64> {
        Some(match name {
            "step" => f64::from(self.step),
            "steps" => f64::from(self.steps),
            "wall_ms" => self.wall_ms,
            "io_ms" => self.io_ms,
            "compute_ms" => self.compute_ms,
            "read_bytes" => self.read_bytes as f64,
            "cache_hit_pct" => self.cache_hit_pct,
            "stall_ms" => self.stall_ms,
            "mgmt_ms" => self.mgmt_ms,
            "majflt" => self.majflt as f64,
            "cpu_ms" => self.cpu_ms,
            "dense_resident_frac" => self.dense_resident_frac,
            "turn" => f64::from(self.turn),
            "majflt_mib" => self.majflt_mib,
            "cache_budget_mib" => self.cache_budget_mib,
            "rss_mib" => self.rss_mib,
            "rss_anon_mib" => self.rss_anon_mib,
            "rss_file_mib" => self.rss_file_mib,
            "swap_mib" => self.swap_mib,
            "mem_available_mib" => self.mem_available_mib,
            "mem_free_mib" => self.mem_free_mib,
            "swap_free_mib" => self.swap_free_mib,
            "loop_overhead_ms" => self.loop_overhead_ms,
            "mtp_batch" => f64::from(self.mtp_batch),
            "mtp_draft_ms" => self.mtp_draft_ms,
            "drain_ms" => self.drain_ms,
            "adopt_ms" => self.adopt_ms,
            "ra_issue_ms" => self.ra_issue_ms,
            "ra_wd_ms" => self.ra_wd_ms,
            _ => return None,
        })
    }
}

/// Writes the five-line run-parameter preamble (magic, `# engine=`, the model line, the
/// streaming line, the sampling/diagnostics line). Values are the resolved configuration:
/// `cache_mb=` is `cfg.cache_budget_mb`. `eviction=` is bmoe's addition, appended last on the
/// streaming line; so is `gating=` (the model's router gating, `Gating`'s name) on the model
/// line.
pub fn write_preamble(w: &mut dyn Write, cfg: &RunConfig) -> io::Result<()> {
    writeln!(w, "{METRICS_MAGIC}")?;
    writeln!(w, "# engine={}", kv_token(&cfg.engine_version))?;
    writeln!(
        w,
        "# model={} arch={} n_layer={} n_expert={} n_expert_used={} threads={} n_ctx={} n_ubatch={} chatml={} gating={}",
        kv_token(&cfg.model),
        kv_token(&cfg.arch),
        cfg.n_layer,
        cfg.n_expert,
        cfg.n_expert_used,
        cfg.threads,
        cfg.n_ctx,
        cfg.n_ubatch,
        bit(cfg.chatml),
        cfg.gating
    )?;
    writeln!(
        w,
        "# moe_stream={} cache_mb={} cache_auto={} cache_floor_mb={} cache_ceil_mb={} cache_cycle_mb={} \
         force_cache={} load_all={} io_threads={} o_direct={} overlap={} io_two_wave={} prefetch={} \
         route_ahead={} predict_prefetch={} predict_log={} predict_spec_max={} prefetch_sync={} \
         dense_weights={} drop_cold_frac={} drop_renorm={} drop_prefill={} substitute_lambda={} eviction={} read_split={} \
         moe_stream_why={} mem_need_mb={} mem_room_mb={} mem_room_from={} routing_from={}",
        bit(cfg.moe_stream),
        cfg.cache_budget_mb,
        bit(cfg.cache_auto),
        cfg.cache_floor_mb,
        cfg.cache_ceil_mb,
        cfg.cache_cycle_mb,
        bit(cfg.force_cache),
        bit(cfg.load_all),
        cfg.io_threads,
        bit(cfg.o_direct),
        bit(cfg.overlap),
        bit(cfg.io_two_wave),
        cfg.prefetch,
        cfg.route_ahead,
        bit(cfg.predict_prefetch),
        bit(cfg.predict_log),
        cfg.predict_spec_max,
        bit(cfg.prefetch_sync),
        cfg.dense_weights.name(),
        g4(f64::from(cfg.drop_cold_frac)),
        bit(cfg.drop_renorm),
        bit(cfg.drop_prefill),
        g4(f64::from(cfg.substitute_lambda)),
        cfg.eviction.name(),
        cfg.read_split.name(),
        cfg.stream_choice.name(),
        cfg.stream_choice.fit().map_or(0, |f| f.need_bytes() / MIB),
        cfg.stream_choice.fit().map_or(0, |f| f.room_bytes / MIB),
        cfg.stream_choice
            .fit()
            .map_or("none", |f| f.room_from.name()),
        kv_token(cfg.routing_from.as_deref().unwrap_or("none")),
    )?;
    writeln!(
        w,
        "# temp={} top_k={} top_p={} seed={} compute_trace_layers={} spec={} spec_draft_max={} mtp_p_min={} \
         ngram_min_match={}",
        g4(f64::from(cfg.temp)),
        cfg.top_k,
        g4(f64::from(cfg.top_p)),
        cfg.seed,
        cfg.compute_trace_layers,
        cfg.spec.name(),
        cfg.spec_draft_max,
        g4(f64::from(cfg.mtp_p_min)),
        cfg.ngram_min_match
    )
}

/// Writes the column header row.
pub fn write_header(w: &mut dyn Write) -> io::Result<()> {
    writeln!(w, "{}", COLUMNS.join(","))
}

/// Writes one token's row. Precision per column is fixed: times in ms with 3 decimals,
/// `cache_hit_pct` 2, `dense_resident_frac` 3, `majflt_mib` 2, memory MiB 1, counts as integers.
pub fn write_row(w: &mut dyn Write, r: &TokenRecord) -> io::Result<()> {
    writeln!(
        w,
        "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
        r.step,
        r.steps,
        fixed(r.wall_ms, 3),
        fixed(r.io_ms, 3),
        fixed(r.compute_ms, 3),
        r.read_bytes,
        fixed(r.cache_hit_pct, 2),
        fixed(r.stall_ms, 3),
        fixed(r.mgmt_ms, 3),
        r.majflt,
        fixed(r.cpu_ms, 3),
        fixed(r.dense_resident_frac, 3),
        r.turn,
        fixed(r.majflt_mib, 2),
        fixed(r.cache_budget_mib, 1),
        fixed(r.rss_mib, 1),
        fixed(r.rss_anon_mib, 1),
        fixed(r.rss_file_mib, 1),
        fixed(r.swap_mib, 1),
        fixed(r.mem_available_mib, 1),
        fixed(r.mem_free_mib, 1),
        fixed(r.swap_free_mib, 1),
        fixed(r.loop_overhead_ms, 3),
        r.mtp_batch,
        fixed(r.mtp_draft_ms, 3),
        fixed(r.drain_ms, 3),
        fixed(r.adopt_ms, 3),
        fixed(r.ra_issue_ms, 3),
        fixed(r.ra_wd_ms, 3)
    )
}

/// The `# summary` trailer's key=value pairs, in print order. Keys follow the contract's
/// spelling exactly; the `row_*` and `prefill_dev_*` keys are absent because bmoe has neither
/// row streaming nor a prefill device, and bmoe adds `io_errors` and, only on a generation
/// stopped at a token boundary before its end, `interrupted=1`.
pub fn summary_pairs(s: &RunSummary) -> Vec<(&'static str, String)> {
    let c = &s.counters;
    let mut pairs = vec![
        ("tokens", s.tokens().to_string()),
        ("s/tok", fixed(s.s_per_token(), 3)),
        ("tok/s", fixed(s.tokens_per_s(), 3)),
        ("read_MiB", fixed(s.read_mib(), 1)),
        ("io_s", fixed(s.io_s(), 2)),
        ("compute_s/tok", fixed(s.compute_s_per_token(), 3)),
        ("io_s/tok", fixed(s.io_s_per_token(), 3)),
        ("cache_hit_pct", fixed(s.cache_hit_pct(), 1)),
        ("n_prompt", c.n_prompt.to_string()),
        ("load_s", fixed(c.load_s, 3)),
        ("prefill_s", fixed(c.prefill_s, 3)),
        ("prefill_tps", fixed(s.prefill_tps(), 2)),
        ("stall_s/tok", fixed(s.stall_s_per_token(), 3)),
        ("mgmt_s/tok", fixed(s.mgmt_s_per_token(), 3)),
        ("cache_resident_MiB", fixed(s.cache_resident_mib(), 1)),
        ("cache_budget_MiB", fixed(s.cache_budget_mib(), 1)),
        ("cache_resizes", c.cache_resizes.to_string()),
        ("spec_read_MiB", fixed(s.spec_read_mib(), 1)),
        ("spec_experts", c.spec_experts.to_string()),
        ("spec_useful", c.spec_useful.to_string()),
        ("majflt/tok", fixed(s.majflt_per_token(), 2)),
        ("cpu_s/tok", fixed(s.cpu_s_per_token(), 4)),
        ("token_demand_MiB", fixed(s.token_demand_mib(), 1)),
        ("layer_demand_MiB", fixed(s.layer_demand_mib(), 1)),
        ("experts_routed", c.experts_routed.to_string()),
        ("experts_dropped", c.experts_dropped.to_string()),
        (
            "loop_overhead_s/tok",
            fixed(s.loop_overhead_s_per_token(), 4),
        ),
        ("mtp_drafted", c.mtp_drafted.to_string()),
        ("mtp_accepted", c.mtp_accepted.to_string()),
        ("mtp_decodes", c.mtp_decodes.to_string()),
        ("mtp_draft_s/tok", fixed(s.mtp_draft_s_per_token(), 4)),
        ("drafted_steps", c.drafted_steps.to_string()),
        ("ra_committed", c.ra_committed.to_string()),
        ("ra_passthrough", c.ra_passthrough.to_string()),
        ("ra_agree_pct", fixed(s.ra_agree_pct(), 1)),
        ("ra_gemv_ms/tok", fixed(s.ra_gemv_ms_per_token(), 2)),
        ("ra_issue_ms/tok", fixed(s.ra_issue_ms_per_token(), 2)),
        ("ra_wd_ms/tok", fixed(s.ra_wd_ms_per_token(), 2)),
        ("drain_s/tok", fixed(s.drain_s_per_token(), 3)),
        ("adopt_s/tok", fixed(s.adopt_s_per_token(), 3)),
        ("evictions", c.evictions.to_string()),
        ("rereads", c.rereads.to_string()),
        ("experts_reranked", c.experts_reranked.to_string()),
        ("experts_substituted", c.experts_substituted.to_string()),
        ("prefill_cpu_s", fixed(c.prefill.cpu_s, 3)),
        (
            "prefill_read_mib",
            fixed(super::fmt::mib(c.prefill.read_bytes), 1),
        ),
        ("prefill_io_s", fixed(c.prefill.io_s, 3)),
        ("prefill_stall_s", fixed(c.prefill.stall_s, 3)),
        ("prefill_mgmt_s", fixed(c.prefill.mgmt_s, 3)),
        ("io_errors", c.io_errors.to_string()),
    ];
    // Present only under a policy that filters admission: every other run's trailer
    // reads exactly as before the key existed.
    if c.admission_filter {
        pairs.push(("bypasses", c.bypasses.to_string()));
    }
    // Present only when set, like `BMOE_PROGRESS`'s `"reset":1`: every file written before
    // the key existed, and every run that was not interrupted, reads the same.
    if c.interrupted {
        pairs.push(("interrupted", "1".to_string()));
    }
    pairs
}

/// Writes the `# summary key=value ...` trailer of one generation.
pub fn write_summary(w: &mut dyn Write, s: &RunSummary) -> io::Result<()> {
    let body: Vec<String> = summary_pairs(s)
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    writeln!(w, "# summary {}", body.join(" "))
}

/// Ordered `key=value` pairs from `#` lines. Lookups return the last occurrence of a key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyValues(pub Vec<(String, String)>);

impl KeyValues {
    /// The raw value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The value of `key` as a number; `Ok(None)` when absent, an error naming the key when
    /// present and not numeric.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>, ParseError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => parse_number(v).map(Some).map_err(|_| ParseError::File {
                format: FORMAT,
                reason: format!("key {key}={v} is not a number"),
            }),
        }
    }
}

fn parse_number(s: &str) -> Result<f64, ()> {
    if s.eq_ignore_ascii_case("nan") {
        return Ok(f64::NAN);
    }
    let v: f64 = s.parse().map_err(|_| ())?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(())
    }
}

/// A parsed metrics file.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricsCsv {
    /// The format version from the magic line (`2`), `None` for a file without one.
    pub version: Option<u32>,
    /// Every `key=value` pair of the `#` lines above the header, in file order.
    pub preamble: KeyValues,
    /// Column names of the header row, in file order.
    pub columns: Vec<String>,
    /// One record per data row; columns the file lacks keep `TokenRecord::default()` values.
    pub rows: Vec<TokenRecord>,
    /// The 1-based line of each row.
    pub row_lines: Vec<usize>,
    /// Every `# summary` trailer, in file order (a session writes one per generation).
    pub summaries: Vec<KeyValues>,
    /// Every cell as a number, row-major over `columns` (unknown columns included).
    cells: Vec<f64>,
}

impl MetricsCsv {
    /// Parses a metrics file. Rejects, naming the line: a row whose field count differs from the
    /// header's, a non-numeric field, a count column (`step`, `read_bytes`, ...) that is not a
    /// non-negative integer, a duplicate column name, a `# summary` token without `=`, and
    /// data before any header.
    pub fn parse(text: &str) -> Result<MetricsCsv, ParseError> {
        let at = |line: usize, reason: String| ParseError::AtLine {
            format: FORMAT,
            line,
            reason,
        };
        let mut out = MetricsCsv {
            version: None,
            preamble: KeyValues::default(),
            columns: Vec::new(),
            rows: Vec::new(),
            row_lines: Vec::new(),
            summaries: Vec::new(),
            cells: Vec::new(),
        };
        super::check_whole_lines(text, FORMAT)?;
        let mut header_seen = false;
        for (index, raw) in text.lines().enumerate() {
            let line_no = index + 1;
            let line = raw.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            if let Some(body) = line.strip_prefix('#') {
                if let Some(other) = super::announced_format(line) {
                    if line.trim() != METRICS_MAGIC {
                        return Err(at(
                            line_no,
                            format!(
                                "not a bmoe_metrics file: '{}' announces {other}",
                                line.trim()
                            ),
                        ));
                    }
                }
                let body = body.trim();
                if let Some(rest) = body.strip_prefix("summary") {
                    if rest.is_empty() || rest.starts_with(char::is_whitespace) {
                        let pairs = parse_key_values(rest).ok_or_else(|| {
                            at(line_no, "a # summary token is not key=value".to_string())
                        })?;
                        out.summaries.push(KeyValues(pairs));
                        continue;
                    }
                }
                if let Some(v) = body.strip_prefix("bmoe_metrics v") {
                    out.version = Some(
                        v.trim()
                            .parse()
                            .map_err(|_| at(line_no, format!("bad format version '{v}'")))?,
                    );
                    continue;
                }
                if !header_seen {
                    // Free-form comments are allowed; key=value lines are the preamble.
                    if let Some(pairs) = parse_key_values(body) {
                        out.preamble.0.extend(pairs);
                    }
                }
                continue;
            }
            if !header_seen {
                out.columns = line.split(',').map(|c| c.trim().to_string()).collect();
                for (i, c) in out.columns.iter().enumerate() {
                    if c.is_empty() {
                        return Err(at(line_no, format!("header column {} is empty", i + 1)));
                    }
                    if out.columns[..i].contains(c) {
                        return Err(at(line_no, format!("header names column {c} twice")));
                    }
                }
                if !out.columns.iter().any(|c| COLUMNS.contains(&c.as_str())) {
                    return Err(at(
                        line_no,
                        format!("not a bmoe_metrics file: expected the header row (step,steps,wall_ms,...), found '{line}'"),
                    ));
                }
                // A file with the magic line may carry columns newer than this reader; one
                // without it (an old file) only ever had columns we know. Anything else is some
                // other CSV that happens to share a column name.
                if out.version.is_none() {
                    if let Some(c) = out.columns.iter().find(|c| !COLUMNS.contains(&c.as_str())) {
                        return Err(at(
                            line_no,
                            format!("not a bmoe_metrics file: no '{METRICS_MAGIC}' line, and the header has column '{c}', which no metrics file has"),
                        ));
                    }
                }
                header_seen = true;
                continue;
            }
            let row = parse_row(line, &out.columns).map_err(|reason| at(line_no, reason))?;
            out.cells.extend_from_slice(&row.1);
            out.rows.push(row.0);
            out.row_lines.push(line_no);
        }
        if !header_seen {
            return Err(ParseError::File {
                format: FORMAT,
                reason: "no header row".to_string(),
            });
        }
        Ok(out)
    }

    /// Whether the file has the named column.
    pub fn has_column(&self, name: &str) -> bool {
        self.columns.iter().any(|c| c == name)
    }

    /// Every row's value of the named column (unknown columns included), or `None` when the
    /// file lacks it.
    pub fn column_values(&self, name: &str) -> Option<Vec<f64>> {
        let index = self.columns.iter().position(|c| c == name)?;
        let width = self.columns.len();
        Some(self.cells.chunks(width).map(|row| row[index]).collect())
    }

    /// The last `# summary` trailer, if any.
    pub fn summary(&self) -> Option<&KeyValues> {
        self.summaries.last()
    }
}

fn parse_row(line: &str, columns: &[String]) -> Result<(TokenRecord, Vec<f64>), String> {
    let fields: Vec<&str> = line.split(',').collect();
    if fields.len() != columns.len() {
        return Err(format!(
            "{} fields, but the header has {} columns",
            fields.len(),
            columns.len()
        ));
    }
    let mut rec = TokenRecord::default();
    let mut values = Vec::with_capacity(fields.len());
    for (name, field) in columns.iter().zip(&fields) {
        let field = field.trim();
        let v =
            parse_number(field).map_err(|_| format!("column {name}: '{field}' is not a number"))?;
        values.push(v);
        set_column(&mut rec, name, v, field)?;
    }
    Ok((rec, values))
}

fn count<T: TryFrom<u64>>(name: &str, field: &str) -> Result<T, String> {
    field
        .parse::<u64>()
        .ok()
        .and_then(|v| T::try_from(v).ok())
        .ok_or_else(|| format!("column {name}: '{field}' is not a non-negative integer"))
}

fn set_column(r: &mut TokenRecord, name: &str, v: f64, field: &str) -> Result<(), String> {
    match name {
        "step" => r.step = count(name, field)?,
        "steps" => r.steps = count(name, field)?,
        "read_bytes" => r.read_bytes = count(name, field)?,
        "majflt" => r.majflt = count(name, field)?,
        "turn" => r.turn = count(name, field)?,
        "mtp_batch" => r.mtp_batch = count(name, field)?,
        "wall_ms" => r.wall_ms = v,
        "io_ms" => r.io_ms = v,
        "compute_ms" => r.compute_ms = v,
        "cache_hit_pct" => r.cache_hit_pct = v,
        "stall_ms" => r.stall_ms = v,
        "mgmt_ms" => r.mgmt_ms = v,
        "cpu_ms" => r.cpu_ms = v,
        "dense_resident_frac" => r.dense_resident_frac = v,
        "majflt_mib" => r.majflt_mib = v,
        "cache_budget_mib" => r.cache_budget_mib = v,
        "rss_mib" => r.rss_mib = v,
        "rss_anon_mib" => r.rss_anon_mib = v,
        "rss_file_mib" => r.rss_file_mib = v,
        "swap_mib" => r.swap_mib = v,
        "mem_available_mib" => r.mem_available_mib = v,
        "mem_free_mib" => r.mem_free_mib = v,
        "swap_free_mib" => r.swap_free_mib = v,
        "loop_overhead_ms" => r.loop_overhead_ms = v,
        "mtp_draft_ms" => r.mtp_draft_ms = v,
        "drain_ms" => r.drain_ms = v,
        "adopt_ms" => r.adopt_ms = v,
        "ra_issue_ms" => r.ra_issue_ms = v,
        "ra_wd_ms" => r.ra_wd_ms = v,
        _ => {} // a column this build does not know: kept in the cells only
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residual_is_clamped_and_mode_dependent() {
        assert_eq!(compute_residual_ms(100.0, 30.0, 5.0, 10.0, false), 60.0);
        assert_eq!(compute_residual_ms(100.0, 300.0, 5.0, 10.0, true), 85.0);
        assert_eq!(compute_residual_ms(100.0, 300.0, 5.0, 10.0, false), 0.0);
    }

    #[test]
    fn every_column_round_trips_through_column() {
        let r = TokenRecord::default();
        for c in COLUMNS {
            assert!(r.column(c).is_some(), "{c}");
        }
        assert!(r.column("nope").is_none());
    }

    #[test]
    fn old_files_with_fewer_columns_parse() {
        let text = "step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct\n1,2,10.5,1.0,9.5,4096,-1.00\n";
        let m = MetricsCsv::parse(text).expect("parses");
        assert_eq!(m.version, None);
        assert_eq!(m.rows.len(), 1);
        assert_eq!(m.rows[0].read_bytes, 4096);
        assert_eq!(
            m.rows[0].dense_resident_frac, -1.0,
            "missing column keeps its default"
        );
        assert!(!m.has_column("stall_ms"));
        assert_eq!(m.column_values("wall_ms"), Some(vec![10.5]));
    }

    #[test]
    fn bad_rows_name_their_line() {
        let e =
            MetricsCsv::parse("# bmoe_metrics v2\nstep,wall_ms\n1,2.0\n2,abc\n").expect_err("abc");
        assert_eq!(e.line(), Some(4));
        assert!(e.to_string().contains("column wall_ms"), "{e}");
        let e = MetricsCsv::parse("step,wall_ms\n1\n").expect_err("short row");
        assert_eq!(e.line(), Some(2));
        let e = MetricsCsv::parse("step,wall_ms\n1.5,2\n").expect_err("fractional step");
        assert!(e.to_string().contains("non-negative integer"), "{e}");
        let e = MetricsCsv::parse("# only a preamble\n").expect_err("no header");
        assert_eq!(e.line(), None);
        let e = MetricsCsv::parse("a,b\n").expect_err("not our header");
        assert_eq!(e.line(), Some(1));
    }

    #[test]
    fn other_csvs_are_not_bmoe_metrics_files() {
        // A route trace shares the column `step` with the metrics header.
        let route = "# route_trace v1\n# model=m arch=a n_layer=1 n_expert=2 n_expert_used=1\n# layer=0 expert_bytes=1 dense_bytes=1\nturn,phase,step,layer,slot,expert,weight,residency,expert_bytes\n0,0,0,0,0,1,1.0,0,1\n";
        let e = MetricsCsv::parse(route).expect_err("a route trace");
        assert!(e.to_string().contains("not a bmoe_metrics file"), "{e}");
        assert!(e.to_string().contains("a route trace"), "{e}");
        let e = MetricsCsv::parse("step,layer\n1,2\n").expect_err("foreign columns");
        assert!(e.to_string().contains("not a bmoe_metrics file"), "{e}");
        assert!(e.to_string().contains("'layer'"), "{e}");
        // With the magic line, newer columns are welcome.
        let m = MetricsCsv::parse("# bmoe_metrics v2\nstep,future_col\n1,2\n").expect("newer");
        assert_eq!(m.column_values("future_col"), Some(vec![2.0]));
    }

    #[test]
    fn a_row_cut_by_sigkill_is_named_partial() {
        let e =
            MetricsCsv::parse("# bmoe_metrics v2\nstep,wall_ms\n1,2.0\n2,3").expect_err("cut row");
        assert_eq!(e.line(), Some(4));
        assert!(e.to_string().contains("partial last line"), "{e}");
    }
}
