//! Every telemetry format against a golden file (`tests/golden/`, regenerated only with
//! `UPDATE_GOLDEN=1` and reviewed in the diff), against the contract's key lists, through
//! writer → reader round trips, and — for the route trace — against every class of malformed
//! input and the two real traces in `../shared/traces`.

use std::path::PathBuf;

use bmoe_core::config::{DenseWeights, RunConfig, SpecMode};
use bmoe_core::records::{IoRecord, Phase, RouteRecord};
use bmoe_core::telemetry::csv::{write_header, write_preamble, MetricsCsv, TokenRecord, COLUMNS};
use bmoe_core::telemetry::io_trace::{parse_io_trace, IoTraceWriter};
use bmoe_core::telemetry::progress::{
    write_begin, write_decide, write_done, write_error, write_ready, DeltaTracker, Ready,
    ThinkControl,
};
use bmoe_core::telemetry::report::{write_report, ReportContext};
use bmoe_core::telemetry::route_trace::{
    ProjExtent, RoutePreamble, RouteTrace, RouteTraceWriter, TraceLayer,
};
use bmoe_core::telemetry::summary::{PredictReport, PredictorStats, PrefillCounters};
use bmoe_core::telemetry::{RunCounters, RunSummary, RunTelemetry};
use bmoe_core::DecideOutcome;

// ---------------------------------------------------------------------------------------------
// Harness

fn golden(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        std::fs::write(&path, actual).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reading {} ({e}); run with UPDATE_GOLDEN=1 to create it",
            path.display()
        )
    });
    if expected != actual {
        let first = expected
            .lines()
            .zip(actual.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(expected.lines().count().min(actual.lines().count()));
        panic!(
            "{name} differs from its golden file at line {}:\n  golden: {:?}\n  actual: {:?}\n\
             (UPDATE_GOLDEN=1 regenerates it; review the diff)",
            first + 1,
            expected.lines().nth(first),
            actual.lines().nth(first)
        );
    }
}

/// `../shared/<rel>` beside the project, or `None` (skipping) when absent; under `CI=true`
/// absence fails. A local copy of `bmoe_engine::testdata::shared_path`, which this crate cannot
/// depend on.
fn shared_path(rel: &str) -> Option<PathBuf> {
    let base = std::env::var_os("BMOE_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join("..")
                .join("shared")
        });
    let p = base.join(rel);
    if p.exists() {
        return Some(p);
    }
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        panic!(
            "CI=true but the shared test data {} is missing",
            p.display()
        );
    }
    eprintln!("skipping: shared test data {} not found", p.display());
    None
}

fn utf8(v: Vec<u8>) -> String {
    String::from_utf8(v).expect("writers emit UTF-8")
}

/// Asserts each key appears as `"key":` in `line`, in the given order.
fn assert_key_order(line: &str, keys: &[&str]) {
    let mut from = 0;
    for k in keys {
        let needle = format!("\"{k}\":");
        match line[from..].find(&needle) {
            Some(i) => from += i + needle.len(),
            None => panic!("key {k} missing or out of order in {line}"),
        }
    }
}

fn json_of(line: &str) -> serde_json::Value {
    let (_, json) = line.split_once(' ').expect("TAG {json}");
    serde_json::from_str(json).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
}

// ---------------------------------------------------------------------------------------------
// Fixtures

fn serial_config() -> RunConfig {
    RunConfig {
        engine_version: "0.1.0-test".to_string(),
        model: "qwen3moe-synth tiny.gguf".to_string(),
        arch: "qwen3moe".to_string(),
        n_layer: 4,
        n_expert: 16,
        n_expert_used: 4,
        threads: 4,
        n_ctx: 512,
        chatml: true,
        moe_stream: true,
        cache_mb: 2000,
        cache_budget_mb: 2000,
        cache_cycle_mb: 96,
        io_threads: 2,
        prefetch: 1,
        drop_cold_frac: 0.75,
        substitute_lambda: 0.15,
        dense_weights: DenseWeights::Mmap,
        seed: 42,
        ..RunConfig::default()
    }
}

fn overlap_config() -> RunConfig {
    RunConfig {
        cache_mb: 0,
        cache_auto: true,
        cache_budget_mb: 3000,
        cache_ceil_mb: 3000,
        overlap: true,
        prefetch: 0,
        drop_cold_frac: 0.0,
        substitute_lambda: 0.0,
        route_ahead: 2,
        predict_log: false,
        dense_weights: DenseWeights::Anon,
        ..serial_config()
    }
}

fn tokens(overlap: bool) -> Vec<TokenRecord> {
    let base = TokenRecord {
        steps: 4,
        turn: 0,
        dense_resident_frac: 0.982,
        cache_budget_mib: 2000.0,
        rss_mib: 3120.5,
        rss_anon_mib: 2100.25,
        rss_file_mib: 1020.0,
        swap_mib: 0.0,
        mem_available_mib: 5012.0,
        mem_free_mib: 812.5,
        swap_free_mib: 2048.0,
        ..TokenRecord::default()
    };
    let rows = [
        // (wall, io, stall, mgmt, read MiB×1024 KiB, hit, majflt, cpu, loop)
        (250.0, 120.0, 40.0, 12.5, 6 << 20, 50.0, 3, 800.0, 1.5),
        (180.0, 60.0, 20.0, 2.25, 3 << 20, 62.5, 0, 650.0, 0.75),
        (150.0, 0.0, 0.0, 0.5, 0, 71.875, 0, 560.0, 0.5),
        (160.5, 20.0, 8.0, 0.25, 1 << 20, 75.0, 1, 590.0, 0.625),
    ];
    rows.iter()
        .enumerate()
        .map(
            |(i, &(wall, io, stall, mgmt, read, hit, majflt, cpu, lo))| {
                let mut r = TokenRecord {
                    step: i as u32 + 1,
                    wall_ms: wall,
                    io_ms: io,
                    stall_ms: if overlap { stall } else { 0.0 },
                    mgmt_ms: mgmt,
                    read_bytes: read,
                    cache_hit_pct: hit,
                    majflt,
                    majflt_mib: majflt as f64 * 4096.0 / 1048576.0,
                    cpu_ms: cpu,
                    loop_overhead_ms: lo,
                    drain_ms: if overlap { 1.25 } else { 0.0 },
                    adopt_ms: if overlap { 0.5 } else { 0.0 },
                    ra_issue_ms: if overlap { 0.125 } else { 0.0 },
                    ra_wd_ms: if overlap { 0.375 } else { 0.0 },
                    ..base.clone()
                };
                r.set_compute_residual(overlap);
                r
            },
        )
        .collect()
}

/// (reasoning, answer) snapshots per token: an extension, a reclassification (reset) and
/// characters that need escaping.
fn snapshots() -> [(&'static str, &'static str); 4] {
    [
        ("", "<think"),
        ("Let me \"think\"", ""),
        ("Let me \"think\"", "Path: C:\\tmp\n"),
        ("Let me \"think\"", "Path: C:\\tmp\n\tdone \u{1} é ✓"),
    ]
}

fn counters_serial() -> RunCounters {
    RunCounters {
        n_prompt: 12,
        n_past: 16,
        load_s: 1.25,
        prefill_s: 0.75,
        cache_hit_pct: 75.0,
        cache_resident_bytes: 1900 << 20,
        cache_budget_bytes: 2000 << 20,
        evictions: 7,
        rereads: 3,
        spec_read_bytes: 2 << 20,
        spec_experts: 8,
        spec_useful: 3,
        token_demand_bytes: 24.0 * 1048576.0,
        layer_demand_bytes: 6 << 20,
        experts_routed: 64,
        experts_dropped: 5,
        experts_reranked: 64,
        experts_substituted: 9,
        prefill: PrefillCounters {
            cpu_s: 2.5,
            read_bytes: 48 << 20,
            io_s: 0.375,
            stall_s: 0.0,
            mgmt_s: 0.125,
        },
        loop_overhead_tail_ms: 2.0,
        ..RunCounters::default()
    }
}

fn counters_overlap() -> RunCounters {
    RunCounters {
        cache_resident_bytes: 2999 << 20,
        cache_budget_bytes: 3000 << 20,
        evictions: 0,
        rereads: 0,
        spec_read_bytes: 4 << 20,
        spec_experts: 12,
        spec_useful: 12,
        ra_committed: 18,
        ra_passthrough: 6,
        ra_slots: 72,
        ra_agreed_slots: 61,
        ra_gemv_ns: 8_000_000,
        ra_gemv_jobs: 64,
        experts_dropped: 0,
        experts_reranked: 0,
        experts_substituted: 0,
        io_errors: 2,
        predict: Some(PredictReport {
            stale: PredictorStats {
                rows: 40,
                slots: 160,
                hit_slots: 141,
                exact_rows: 21,
            },
            stale2: PredictorStats {
                rows: 30,
                slots: 120,
                hit_slots: 99,
                exact_rows: 12,
            },
            prev: PredictorStats {
                rows: 44,
                slots: 176,
                hit_slots: 70,
                exact_rows: 2,
            },
            ctrl: PredictorStats {
                rows: 48,
                slots: 192,
                hit_slots: 190,
                exact_rows: 46,
            },
            unscored: 8,
            by_layer: vec![
                [
                    PredictorStats::default(),
                    PredictorStats {
                        rows: 11,
                        slots: 44,
                        hit_slots: 15,
                        exact_rows: 0,
                    },
                    PredictorStats {
                        rows: 12,
                        slots: 48,
                        hit_slots: 48,
                        exact_rows: 12,
                    },
                ],
                [PredictorStats::default(); 3],
                [
                    PredictorStats {
                        rows: 40,
                        slots: 160,
                        hit_slots: 141,
                        exact_rows: 21,
                    },
                    PredictorStats {
                        rows: 33,
                        slots: 132,
                        hit_slots: 55,
                        exact_rows: 2,
                    },
                    PredictorStats {
                        rows: 36,
                        slots: 144,
                        hit_slots: 142,
                        exact_rows: 34,
                    },
                ],
            ],
        }),
        ..counters_serial()
    }
}

/// Runs the fixture tokens through `RunTelemetry`, returning (progress, csv, summary).
fn run_fixture(
    cfg: &RunConfig,
    overlap: bool,
    counters: RunCounters,
) -> (String, String, RunSummary) {
    let mut t = RunTelemetry::new();
    let mut progress = Vec::new();
    let mut csv = Vec::new();
    t.write_csv_preamble(cfg, &mut csv).expect("vec write");
    t.begin_generation();
    for (r, (reasoning, text)) in tokens(overlap).iter().zip(snapshots()) {
        t.token(r, reasoning, text, Some(&mut progress), Some(&mut csv))
            .expect("vec write");
    }
    let summary = t.finish(counters, Some(&mut csv)).expect("vec write");
    (utf8(progress), utf8(csv), summary)
}

// ---------------------------------------------------------------------------------------------
// CSV

const CONTRACT_PREAMBLE_KEYS: [&str; 43] = [
    "engine",
    "model",
    "arch",
    "n_layer",
    "n_expert",
    "n_expert_used",
    "threads",
    "n_ctx",
    "n_ubatch",
    "chatml",
    "moe_stream",
    "cache_mb",
    "cache_auto",
    "cache_floor_mb",
    "cache_ceil_mb",
    "cache_cycle_mb",
    "force_cache",
    "load_all",
    "io_threads",
    "o_direct",
    "overlap",
    "io_two_wave",
    "prefetch",
    "route_ahead",
    "predict_prefetch",
    "predict_log",
    "predict_spec_max",
    "prefetch_sync",
    "dense_weights",
    "drop_cold_frac",
    "drop_renorm",
    "drop_prefill",
    "substitute_lambda",
    "temp",
    "top_k",
    "top_p",
    "seed",
    "compute_trace_layers",
    "spec",
    "spec_draft_max",
    "mtp_p_min",
    "ngram_min_match",
    "eviction",
];

const CONTRACT_SUMMARY_KEYS: [&str; 34] = [
    "tokens",
    "s/tok",
    "tok/s",
    "stall_s/tok",
    "mgmt_s/tok",
    "majflt/tok",
    "cpu_s/tok",
    "token_demand_MiB",
    "experts_routed",
    "experts_dropped",
    "experts_reranked",
    "experts_substituted",
    "layer_demand_MiB",
    "loop_overhead_s/tok",
    "mtp_drafted",
    "mtp_accepted",
    "mtp_decodes",
    "mtp_draft_s/tok",
    "drafted_steps",
    "ra_committed",
    "ra_passthrough",
    "ra_agree_pct",
    "ra_gemv_ms/tok",
    "ra_issue_ms/tok",
    "ra_wd_ms/tok",
    "drain_s/tok",
    "adopt_s/tok",
    "evictions",
    "rereads",
    "prefill_cpu_s",
    "prefill_read_mib",
    "prefill_io_s",
    "prefill_stall_s",
    "prefill_mgmt_s",
];

#[test]
fn csv_golden_and_contract() {
    let (_, csv, _) = run_fixture(&serial_config(), false, counters_serial());
    golden("metrics_serial.csv", &csv);

    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], "# bmoe_metrics v2");
    assert!(lines[1].starts_with("# engine="));
    assert!(lines[2].starts_with("# model="));
    assert!(lines[3].starts_with("# moe_stream="));
    assert!(lines[4].starts_with("# temp="));
    assert_eq!(lines[5], COLUMNS.join(","));
    assert_eq!(
        lines[5],
        "step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct,stall_ms,mgmt_ms,majflt,cpu_ms,\
         dense_resident_frac,turn,majflt_mib,cache_budget_mib,rss_mib,rss_anon_mib,rss_file_mib,swap_mib,\
         mem_available_mib,mem_free_mib,swap_free_mib,loop_overhead_ms,mtp_batch,mtp_draft_ms,drain_ms,\
         adopt_ms,ra_issue_ms,ra_wd_ms",
        "the contract's column list, in its order"
    );
    assert!(lines
        .last()
        .is_some_and(|l| l.starts_with("# summary tokens=4 ")));

    let parsed = MetricsCsv::parse(&csv).expect("own output parses");
    for k in CONTRACT_PREAMBLE_KEYS {
        assert!(parsed.preamble.get(k).is_some(), "preamble lacks {k}");
    }
    assert_eq!(
        parsed.preamble.get("model"),
        Some("qwen3moe-synth_tiny.gguf")
    );
    assert_eq!(
        parsed.preamble.get("cache_mb"),
        Some("2000"),
        "the resolved budget"
    );
    let summary = parsed.summary().expect("a summary");
    for k in CONTRACT_SUMMARY_KEYS {
        assert!(summary.get(k).is_some(), "summary lacks {k}");
    }
}

#[test]
fn csv_round_trip() {
    let (_, csv, summary) = run_fixture(&overlap_config(), true, counters_overlap());
    golden("metrics_overlap.csv", &csv);
    let parsed = MetricsCsv::parse(&csv).expect("own output parses");
    assert_eq!(parsed.version, Some(2));
    // The reader returns what the writer wrote: integers exactly, the rest within the written
    // precision (the coarsest column has one decimal).
    let written = tokens(true);
    assert_eq!(parsed.rows.len(), written.len());
    for (got, want) in parsed.rows.iter().zip(&written) {
        for c in COLUMNS {
            let (g, w) = (
                got.column(c).expect("known"),
                want.column(c).expect("known"),
            );
            assert!(
                (g - w).abs() <= 0.05 + 1e-9,
                "column {c}: wrote {w}, read {g}"
            );
        }
    }
    let s = parsed.summary().expect("summary");
    assert_eq!(s.get_f64("tokens").expect("number"), Some(4.0));
    let spt = s.get_f64("s/tok").expect("number").expect("present");
    assert!((spt - summary.s_per_token()).abs() < 5e-4);
    assert_eq!(
        s.get("stall_s/tok"),
        Some(format!("{:.3}", summary.stall_s_per_token()).as_str())
    );
    assert_eq!(s.get("io_errors"), Some("2"));
}

#[test]
fn csv_header_without_preamble() {
    // A caller that never wrote a preamble still gets a readable file.
    let mut t = RunTelemetry::new();
    let mut csv = Vec::new();
    t.begin_generation();
    t.token(&tokens(false)[0], "", "", None, Some(&mut csv))
        .expect("vec");
    let parsed = MetricsCsv::parse(&utf8(csv)).expect("parses");
    assert_eq!(parsed.rows.len(), 1);
    assert!(parsed.preamble.0.is_empty());
    let mut just_header = Vec::new();
    write_header(&mut just_header).expect("vec");
    write_preamble(&mut Vec::new(), &RunConfig::default()).expect("vec");
    assert_eq!(utf8(just_header).trim_end(), COLUMNS.join(","));
}

// ---------------------------------------------------------------------------------------------
// Progress and session lines

const PROGRESS_KEYS: [&str; 14] = [
    "step",
    "steps",
    "wall_ms",
    "io_ms",
    "compute_ms",
    "mgmt_ms",
    "stall_ms",
    "read_mb",
    "cache_hit_pct",
    "majflt",
    "cpu_ms",
    "dense_resident_frac",
    "delta_reasoning",
    "delta_text",
];

#[test]
fn progress_golden_and_contract() {
    let (progress, _, _) = run_fixture(&serial_config(), false, counters_serial());
    golden("progress.txt", &progress);

    let lines: Vec<&str> = progress.lines().collect();
    let loads = lines.iter().filter(|l| l.starts_with("BMOE_LOAD ")).count();
    assert_eq!(
        loads, 3,
        "one BMOE_LOAD per token that read experts (token 3 read nothing)"
    );
    let progress_lines: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with("BMOE_PROGRESS "))
        .collect();
    assert_eq!(progress_lines.len(), 4);

    // Replaying the deltas the way a reader does reproduces the final snapshots.
    let (mut reasoning, mut text) = (String::new(), String::new());
    for line in &progress_lines {
        assert_key_order(line, &PROGRESS_KEYS);
        let v = json_of(line);
        let (dr, dt) = (
            v["delta_reasoning"].as_str().expect("string"),
            v["delta_text"].as_str().expect("string"),
        );
        if v.get("reset").is_some() {
            assert_eq!(v["reset"], 1);
            assert!(
                line.contains("\"reset\":1,\"delta_reasoning\""),
                "reset sits before the deltas"
            );
            reasoning = dr.to_string();
            text = dt.to_string();
        } else {
            reasoning.push_str(dr);
            text.push_str(dt);
        }
    }
    let (final_reasoning, final_text) = snapshots()[3];
    assert_eq!(
        (reasoning.as_str(), text.as_str()),
        (final_reasoning, final_text)
    );
    assert_eq!(
        progress_lines
            .iter()
            .filter(|l| l.contains("\"reset\":1"))
            .count(),
        1,
        "reset only on the reclassifying token"
    );
    for line in lines.iter().filter(|l| l.starts_with("BMOE_LOAD ")) {
        assert_key_order(line, &["mb", "ms"]);
        json_of(line);
    }
}

/// The contract's `BMOE_DONE` keys in its order, and bmoe's `n_reused` after `n_past`.
const DONE_KEYS: [&str; 38] = [
    "id",
    "cancelled",
    "tokens",
    "tok_s",
    "prefill_s",
    "prefill_tps",
    "load_s",
    "cache_hit_pct",
    "n_prompt",
    "n_past",
    "n_reused",
    "compute_s_tok",
    "io_s_tok",
    "cache_resident_mib",
    "cache_budget_mib",
    "read_mib",
    "stall_s_tok",
    "mgmt_s_tok",
    "majflt_tok",
    "cpu_s_tok",
    "prefill_cpu_s",
    "prefill_read_mib",
    "prefill_io_s",
    "prefill_stall_s",
    "prefill_mgmt_s",
    "prefill_dev_tokens",
    "prefill_dev_nodes",
    "prefill_dev_read_mib",
    "prefill_dev_stall_s",
    "token_demand_mib",
    "mtp_drafted",
    "mtp_accepted",
    "mtp_decodes",
    "mtp_draft_s_tok",
    "drafted_steps",
    "loop_overhead_s_tok",
    "reasoning",
    "text",
];

/// The contract's `BMOE_DECIDE` keys, in its order.
const DECIDE_KEYS: [&str; 21] = [
    "id",
    "cancelled",
    "best",
    "choice_logp",
    "n_tokens",
    "n_reused",
    "n_prefilled",
    "restore_s",
    "store_s",
    "prefill_s",
    "prefill_cpu_s",
    "prefill_read_mib",
    "prefill_io_s",
    "prefill_stall_s",
    "prefill_mgmt_s",
    "prefill_dev_tokens",
    "prefill_dev_read_mib",
    "prefill_dev_stall_s",
    "prefill_dev_routed",
    "prefill_dev_demand",
    "prefix_state_mib",
];

/// Exactly `keys`, in that order, and nothing else.
fn assert_exact_keys(line: &str, keys: &[&str]) {
    assert_key_order(line, keys);
    let v = json_of(line);
    let got: Vec<&str> = v
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    let mut want = keys.to_vec();
    want.sort_unstable();
    let mut got_sorted = got.clone();
    got_sorted.sort_unstable();
    assert_eq!(got_sorted, want, "{line}");
}

/// A decide that restored 31 tokens and prefilled 39 (the spec's measured Qwen3.6 case).
fn decide_fixture() -> DecideOutcome {
    DecideOutcome {
        turn: 1,
        cancelled: false,
        choice_logp: vec![Some(-0.10536051565782628), None, Some(-2.3025850929940455)],
        best: Some(0),
        n_tokens: 70,
        n_reused: 31,
        n_prefilled: 39,
        restore_s: 0.00754,
        store_s: 0.0123,
        prefix_state_bytes: 63 << 20,
        summary: RunSummary {
            totals: Default::default(),
            counters: RunCounters {
                n_prompt: 39,
                n_past: 70,
                n_reused: 31,
                prefill_s: 8.1,
                prefill: PrefillCounters {
                    cpu_s: 15.25,
                    read_bytes: 412 << 20,
                    io_s: 3.5,
                    stall_s: 1.25,
                    mgmt_s: 0.05,
                },
                ..RunCounters::default()
            },
        },
        error: None,
    }
}

#[test]
fn session_golden_and_contract() {
    let cfg = overlap_config();
    let mut out = Vec::new();
    write_ready(
        &mut out,
        &Ready {
            load_s: 1.25,
            arch: &cfg.arch,
            n_ctx: cfg.n_ctx,
            think_ctl: ThinkControl::Template,
            n_expert_used: cfg.n_expert_used,
        },
    )
    .expect("vec");
    write_begin(&mut out, 7).expect("vec");
    let (progress, _, summary) = run_fixture(&cfg, true, counters_overlap());
    out.extend_from_slice(progress.as_bytes());
    let (reasoning, text) = snapshots()[3];
    write_done(&mut out, 7, false, &summary, reasoning, text).expect("vec");
    write_begin(&mut out, 9).expect("vec");
    write_decide(&mut out, 9, &decide_fixture()).expect("vec");
    let cancelled = DecideOutcome {
        cancelled: true,
        choice_logp: vec![None, None],
        best: None,
        n_reused: 0,
        n_prefilled: 0,
        restore_s: 0.0,
        store_s: 0.0,
        summary: RunSummary::default(),
        ..decide_fixture()
    };
    write_begin(&mut out, 10).expect("vec");
    write_decide(&mut out, 10, &cancelled).expect("vec");
    write_begin(&mut out, 8).expect("vec");
    write_error(
        &mut out,
        8,
        false,
        "prompt of 600 tokens plus n_predict 128 exceeds the session n_ctx 512",
    )
    .expect("vec");
    write_error(&mut out, 0, true, "flash read failed: \"EIO\"").expect("vec");
    let out = utf8(out);
    golden("session.txt", &out);

    for line in out.lines() {
        json_of(line);
    }
    let ready = out.lines().next().expect("ready");
    assert_key_order(
        ready,
        &["load_s", "arch", "n_ctx", "think_ctl", "n_expert_used"],
    );
    let done = out
        .lines()
        .find(|l| l.starts_with("BMOE_DONE "))
        .expect("done");
    assert_exact_keys(done, &DONE_KEYS);
    let v = json_of(done);
    assert_eq!(
        (&v["n_prompt"], &v["n_past"], &v["n_reused"]),
        (&12.into(), &16.into(), &0.into())
    );
    assert_eq!(v["text"], text);
    assert_eq!(v["reasoning"], reasoning);
    assert_eq!(v["tokens"], 4);
    let err = out
        .lines()
        .find(|l| l.starts_with("BMOE_ERROR "))
        .expect("error");
    assert_key_order(err, &["id", "fatal", "msg"]);
    assert_eq!(json_of(err)["fatal"], false);

    let decides: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("BMOE_DECIDE "))
        .collect();
    assert_eq!(decides.len(), 2);
    for d in &decides {
        assert_exact_keys(d, &DECIDE_KEYS);
    }
    let v = json_of(decides[0]);
    // The log-probabilities read back bit for bit; -inf is null.
    let logp: Vec<Option<f64>> = v["choice_logp"]
        .as_array()
        .expect("array")
        .iter()
        .map(serde_json::Value::as_f64)
        .collect();
    assert_eq!(logp, decide_fixture().choice_logp);
    assert_eq!(
        (&v["best"], &v["n_reused"], &v["n_prefilled"]),
        (&0.into(), &31.into(), &39.into())
    );
    assert_eq!(v["prefix_state_mib"], 63.0);
    let v = json_of(decides[1]);
    assert_eq!((&v["cancelled"], &v["best"]), (&true.into(), &(-1).into()));
    assert_eq!(v["choice_logp"], serde_json::json!([null, null]));
}

#[test]
fn delta_tracker_is_linear_in_text() {
    // Appending N pieces must not re-send the whole text each time.
    let mut t = DeltaTracker::new();
    let mut full = String::new();
    let mut sent = 0;
    for i in 0..200 {
        full.push_str(&format!("w{i} "));
        let d = t.advance("", &full);
        assert!(!d.reset);
        sent += d.text.len();
    }
    assert_eq!(sent, full.len());
}

// ---------------------------------------------------------------------------------------------
// End-of-run report

#[test]
fn report_serial_golden() {
    let cfg = serial_config();
    let (_, _, summary) = run_fixture(&cfg, false, counters_serial());
    let mut out = Vec::new();
    let (_, answer) = snapshots()[3];
    write_report(
        &mut out,
        &cfg,
        &summary,
        &ReportContext {
            progress: true,
            answer,
            arch_streamable: true,
        },
    )
    .expect("vec");
    let out = utf8(out);
    golden("report_serial.txt", &out);
    assert!(out.starts_with("=== answer ===\n"));
    assert!(out.contains("\n=== perf ===\ngeneration: 4 tokens, "));
    assert!(out.contains("mode: expert streaming, cache 2000 MiB, dense mmap\n"));
    assert!(
        !out.contains("stall_s/tok="),
        "serial mode reports no stall"
    );
    assert!(out.contains("moe-cache: 75.0% hit, resident 1900.0 MiB\n"));
    assert!(out.contains("moe-cache: 7 evictions, 3 re-reads"));
    assert!(out.contains("moe-prefetch: 2.0 MiB speculative, 3/8 experts useful (38%)\n"));
    assert!(
        out.contains("moe-drop: 5/64 routed experts dropped (7.8%), threshold 0.75 x uniform\n")
    );
    assert!(out.contains(
        "moe-substitute: 9/64 reranked slots went to a resident expert (14.1%), margin 0.15"
    ));
}

#[test]
fn report_overlap_golden() {
    let cfg = RunConfig {
        route_ahead: 0,
        predict_log: true,
        predict_prefetch: true,
        ..overlap_config()
    };
    let cfg_ra = overlap_config();
    let (_, _, summary) = run_fixture(&cfg_ra, true, counters_overlap());
    let mut out = Vec::new();
    for c in [&cfg_ra, &cfg] {
        write_report(
            &mut out,
            c,
            &summary,
            &ReportContext {
                progress: false,
                answer: "unused",
                arch_streamable: true,
            },
        )
        .expect("vec");
    }
    let out = utf8(out);
    golden("report_overlap.txt", &out);
    assert!(
        !out.contains("=== answer ==="),
        "banners only in progress mode"
    );
    assert!(out.contains("mode: expert streaming, cache auto, dense anon, overlap\n"));
    assert!(out.contains(", stall_s/tok="));
    assert!(out.contains(", budget 3000 MiB (auto)\n"));
    assert!(out.contains("moe-stream: 2 FAILED reads — this run's output is not trustworthy\n"));
    assert!(out.contains(" [route-ahead]\n") && out.contains(" [stale-gate]\n"));
    assert!(out.contains(
        "moe-route-ahead: 2 layers early — 18 routings committed, 6 passed through; committed selection agreed with the router on 84.7% of slots\n"
    ));
    assert!(out.contains("  layer   stale    prev   ctrl   routings\n"));
    assert!(
        out.contains("      0       -    34.1  100.0          0\n"),
        "{out}"
    );
    assert!(
        !out.contains("\n      1 "),
        "a layer with no routings is skipped"
    );
}

#[test]
fn report_baseline_and_speculation() {
    let dense = RunConfig {
        moe_stream: false,
        cache_mb: 0,
        prefetch: 0,
        drop_cold_frac: 0.0,
        substitute_lambda: 0.0,
        ..serial_config()
    };
    let ngram = RunConfig {
        spec: SpecMode::Ngram,
        ..serial_config()
    };
    let (_, _, summary) = run_fixture(&dense, false, counters_serial());
    let spec_summary = RunSummary {
        counters: RunCounters {
            mtp_drafted: 30,
            mtp_accepted: 18,
            mtp_decodes: 3,
            drafted_steps: 2,
            ..counters_serial()
        },
        ..summary.clone()
    };
    let mut out = Vec::new();
    for (cfg, streamable, s) in [
        (&dense, true, &summary),
        (&dense, false, &summary),
        (&ngram, true, &spec_summary),
    ] {
        write_report(
            &mut out,
            cfg,
            s,
            &ReportContext {
                progress: false,
                answer: "",
                arch_streamable: streamable,
            },
        )
        .expect("vec");
    }
    let out = utf8(out);
    golden("report_baseline.txt", &out);
    assert!(out.contains("Expert streaming is OFF on a MoE model (qwen3moe)"));
    assert!(out.contains("add --moe-stream"));
    assert!(out.contains(
        "mode: mmap (qwen3moe is not a MoE architecture this build streams; --list-archs"
    ));
    let baseline_part = out.split("generation:").nth(1).expect("first report");
    assert!(
        !baseline_part.contains("\nmoe-"),
        "a baseline report has no moe-* lines"
    );
    assert!(out.contains("ngram: 18/30 drafts accepted (60.0%), 1.33 tokens per verify decode (3 decodes for 4 tokens)"));
    assert!(out.contains("ngram: drafted on 2 of 3 steps (66.7%); the rest decoded plainly"));
}

// ---------------------------------------------------------------------------------------------
// Route trace

fn route_preamble() -> RoutePreamble {
    RoutePreamble {
        model: "qwen3moe-synth tiny.gguf".to_string(),
        arch: "qwen3moe".to_string(),
        n_layer: 4,
        n_expert: 16,
        n_expert_used: 4,
        gating: bmoe_core::Gating::default(),
        layers: [1u32, 2, 3]
            .iter()
            .map(|&layer| TraceLayer {
                layer,
                expert_bytes: 3 * 147456,
                dense_bytes: 1_572_864,
                proj: (0..3u64)
                    .map(|p| ProjExtent {
                        shard: 0,
                        offset: 4096 * (1000 + 100 * u64::from(layer) + 30 * p),
                        stride: 147456,
                    })
                    .collect(),
            })
            .collect(),
        notes: vec!["synthetic fixture for the golden test".to_string()],
        extra: vec![],
    }
}

/// Prefill over steps 0..=2 (the last layer routes only the final prompt token), then decode
/// steps 3..=5; layer 1 of step 4 has unknown weights; a few hits, a speculative hit, a drop.
fn route_records() -> Vec<RouteRecord> {
    let mut out = Vec::new();
    let mut push = |phase: Phase,
                    step: i64,
                    layer: u32,
                    experts: [u32; 4],
                    weights: [f32; 4],
                    residency: [u8; 4],
                    dropped: [bool; 4]| {
        for slot in 0..4 {
            out.push(RouteRecord {
                turn: 0,
                phase,
                step,
                layer,
                slot: slot as u32,
                expert: experts[slot],
                weight: weights[slot],
                residency: residency[slot],
                expert_bytes: if residency[slot] == 0 && !dropped[slot] {
                    3 * 147456
                } else {
                    0
                },
                dropped: dropped[slot],
                preds: Default::default(),
                row: 0,
                router_expert: None,
            });
        }
    };
    let w = [0.4, 0.3, 0.2, 0.1];
    let nan = [f32::NAN; 4];
    let miss = [0u8; 4];
    let none = [false; 4];
    for step in 0..3 {
        for layer in 0..3u32 {
            if layer == 2 && step != 2 {
                continue;
            }
            let base = step as u32 * 3 + layer;
            push(
                Phase::Prefill,
                step,
                layer,
                [
                    base % 16,
                    (base + 5) % 16,
                    (base + 9) % 16,
                    (base + 13) % 16,
                ],
                w,
                miss,
                none,
            );
        }
    }
    push(
        Phase::Decode,
        3,
        0,
        [1, 2, 3, 4],
        [0.55, 0.25, 0.125, 0.075],
        [1, 1, 0, 2],
        none,
    );
    push(
        Phase::Decode,
        3,
        1,
        [5, 6, 7, 8],
        w,
        [1, 0, 1, 0],
        [false, false, false, true],
    );
    push(Phase::Decode, 3, 2, [9, 10, 11, 12], w, miss, none);
    push(
        Phase::Decode,
        4,
        0,
        [1, 2, 5, 4],
        [1.0, 0.0, 0.0, 0.0],
        [1, 1, 0, 1],
        none,
    );
    push(Phase::Decode, 4, 1, [5, 6, 7, 15], nan, [1, 1, 1, 0], none);
    push(Phase::Decode, 4, 2, [9, 10, 11, 13], w, [1, 1, 1, 0], none);
    push(Phase::Decode, 5, 0, [0, 2, 5, 4], w, [0, 1, 1, 1], none);
    push(Phase::Decode, 5, 1, [5, 6, 7, 14], w, [1, 1, 1, 0], none);
    push(Phase::Decode, 5, 2, [9, 10, 11, 14], w, [1, 1, 1, 0], none);
    out
}

fn write_route_trace(records: &[RouteRecord]) -> String {
    let mut w = RouteTraceWriter::new(Vec::new(), &route_preamble()).expect("vec");
    for r in records {
        w.write(r).expect("declared layer");
    }
    utf8(w.finish().expect("vec"))
}

fn same_record(a: &RouteRecord, b: &RouteRecord) -> bool {
    let weight_eq = (a.weight.is_nan() && b.weight.is_nan()) || a.weight == b.weight;
    weight_eq
        && RouteRecord {
            weight: 0.0,
            ..a.clone()
        } == RouteRecord {
            weight: 0.0,
            ..b.clone()
        }
}

#[test]
fn route_trace_golden_and_round_trip() {
    let records = route_records();
    let text = write_route_trace(&records);
    golden("route_trace.csv", &text);
    assert!(text.starts_with("# route_trace v1\n# model=qwen3moe-synth_tiny.gguf arch=qwen3moe n_layer=4 n_expert=16 n_expert_used=4 gating=softmax_topk_norm\n"));
    assert!(
        text.contains("\n# layer=1 expert_bytes=442368 dense_bytes=1572864 proj=0:4505600:147456,")
    );
    assert!(text
        .contains("\nturn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped\n"));

    let trace = RouteTrace::parse(&text).expect("own output parses");
    let mut expected = route_preamble();
    expected.model = "qwen3moe-synth_tiny.gguf".to_string(); // whitespace cannot survive key=value
    assert_eq!(trace.preamble, expected);
    assert!(trace.has_dropped_column);
    let back: Vec<RouteRecord> = trace.records().collect();
    assert_eq!(back.len(), records.len());
    for (a, b) in records.iter().zip(&back) {
        assert!(same_record(a, b), "{a:?} != {b:?}");
    }
    let steps: Vec<(Phase, i64, usize)> = trace
        .steps()
        .map(|s| (s.phase, s.step, s.cells.len()))
        .collect();
    assert_eq!(
        steps,
        [
            (Phase::Prefill, 0, 2),
            (Phase::Prefill, 1, 2),
            (Phase::Prefill, 2, 3),
            (Phase::Decode, 3, 3),
            (Phase::Decode, 4, 3),
            (Phase::Decode, 5, 3),
        ]
    );
    assert!(trace.weights_known());
}

/// The fixture trace, then `edit` applied to its text.
fn mutated(edit: impl Fn(&str) -> String) -> String {
    edit(&write_route_trace(&route_records()))
}

fn replace_line(text: &str, line_prefix: &str, with: &str) -> String {
    let mut done = false;
    let out = text
        .lines()
        .map(|l| {
            if !done && l.starts_with(line_prefix) {
                done = true;
                with.to_string()
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>();
    assert!(done, "fixture has no line starting {line_prefix:?}");
    out.join("\n") + "\n"
}

fn drop_lines(text: &str, pred: impl Fn(&str) -> bool) -> String {
    text.lines()
        .filter(|l| !pred(l))
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
fn route_trace_rejects_each_malformed_class() {
    let model_line = "# model=qwen3moe-synth_tiny.gguf arch=qwen3moe n_layer=4 n_expert=16 n_expert_used=4 gating=softmax_topk_norm";
    let cases: Vec<(&str, String, &str, bool)> = vec![
        (
            "wrong magic",
            mutated(|t| t.replacen("# route_trace v1", "# route_trace v2", 1)),
            "expected '# route_trace v1'",
            true,
        ),
        (
            "missing header key",
            mutated(|t| t.replacen(" n_expert_used=4", "", 1)),
            "missing required key n_expert_used=",
            true,
        ),
        (
            "missing model line",
            mutated(|t| drop_lines(t, |l| l == model_line)),
            "missing the '# model=",
            false,
        ),
        (
            "missing layer key",
            mutated(|t| {
                t.replacen(
                    "# layer=2 expert_bytes=442368 dense_bytes=1572864",
                    "# layer=2 expert_bytes=442368",
                    1,
                )
            }),
            "missing required key dense_bytes=",
            true,
        ),
        (
            "layer declared twice",
            mutated(|t| t.replacen("# layer=2 ", "# layer=1 ", 1)),
            "declared twice",
            true,
        ),
        (
            "layers disagree in token count",
            mutated(|t| drop_lines(t, |l| l.starts_with("0,1,4,2,"))),
            "layer 2 routes 2 tokens but layer 1 routes 3",
            true,
        ),
        (
            "a layer with no rows in a phase",
            mutated(|t| {
                drop_lines(t, |l| {
                    l.starts_with("0,1,") && l.split(',').nth(3) == Some("3")
                })
            }),
            "turn 0 decode: layer 3 routes 0 tokens but layer 1 routes 3",
            false,
        ),
        (
            "negative weight",
            mutated(|t| replace_line(t, "0,1,3,2,0,5,", "0,1,3,2,0,5,-0.400000,1,0,0")),
            "weight -0.400000 is negative",
            true,
        ),
        (
            "weight above 1",
            mutated(|t| replace_line(t, "0,1,3,2,0,5,", "0,1,3,2,0,5,1.400000,1,0,0")),
            "weight 1.400000 is above 1",
            true,
        ),
        (
            "nan mixed with numbers",
            mutated(|t| replace_line(t, "0,1,4,3,0,9,", "0,1,4,3,0,9,nan,1,0,0")),
            "mixes numeric and nan weights",
            true,
        ),
        (
            "duplicate key",
            mutated(|t| replace_line(t, "0,1,5,2,1,", "0,1,5,2,0,6,0.300000,1,0,0")),
            "duplicate (turn 0, phase 1, step 5, layer 2, slot 0)",
            true,
        ),
        (
            "expert id beyond n_expert",
            mutated(|t| replace_line(t, "0,1,5,2,3,", "0,1,5,2,3,16,0.100000,1,0,0")),
            "expert 16 is not below n_expert=16",
            true,
        ),
        (
            "non-numeric field",
            mutated(|t| replace_line(t, "0,1,5,2,3,", "0,1,5,2,3,x7,0.100000,1,0,0")),
            "column expert: 'x7' is not a valid integer",
            true,
        ),
        (
            "non-numeric weight",
            mutated(|t| replace_line(t, "0,1,5,2,3,", "0,1,5,2,3,7,0.1.0,1,0,0")),
            "column weight: '0.1.0' is not a number",
            true,
        ),
        (
            "slot beyond n_expert_used",
            mutated(|t| replace_line(t, "0,1,5,2,3,", "0,1,5,2,4,14,0.100000,1,0,0")),
            "slot 4 is not below n_expert_used=4",
            true,
        ),
        (
            "routing with a missing slot",
            mutated(|t| drop_lines(t, |l| l.starts_with("0,1,5,2,3,"))),
            "has 3 of its 4 slots",
            true,
        ),
        (
            "expert routed twice",
            mutated(|t| replace_line(t, "0,1,5,2,3,", "0,1,5,2,3,5,0.100000,1,0,0")),
            "routes expert 5 twice",
            true,
        ),
        (
            "row for an undeclared layer",
            mutated(|t| replace_line(t, "0,1,5,2,3,", "0,1,5,0,3,14,0.100000,1,0,0")),
            "layer 0 has no '# layer=0' line",
            true,
        ),
        (
            "wrong field count",
            mutated(|t| replace_line(t, "0,1,5,2,3,", "0,1,5,2,3,14,0.100000,1,0")),
            "9 fields, but the header has 10 columns",
            true,
        ),
        (
            "missing required column",
            mutated(|t| {
                t.replacen(
                    "turn,phase,step,layer,slot,expert,weight,",
                    "turn,phase,step,layer,slot,expert,wt,",
                    1,
                )
            }),
            "header lacks the required column weight",
            true,
        ),
        (
            "bytes on a hit",
            mutated(|t| replace_line(t, "0,1,5,2,3,", "0,1,5,2,3,14,0.100000,1,442368,0")),
            "expert_bytes 442368 on a hit",
            true,
        ),
        (
            "phase out of range",
            mutated(|t| replace_line(t, "0,1,5,2,3,", "0,2,5,2,3,14,0.100000,0,442368,0")),
            "phase 2 is not 0 (prefill) or 1 (decode)",
            true,
        ),
    ];
    for (what, text, needle, has_line) in cases {
        match RouteTrace::parse(&text) {
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(needle),
                    "{what}: message lacks {needle:?}: {msg}"
                );
                assert_eq!(
                    e.line().is_some(),
                    has_line,
                    "{what}: line expectation: {msg}"
                );
                if has_line {
                    assert!(msg.starts_with("route_trace: line "), "{what}: {msg}");
                }
            }
        }
    }
}

#[test]
fn route_trace_rejects_a_constant_routing() {
    let mut text = String::from(
        "# route_trace v1\n# model=m arch=a n_layer=2 n_expert=8 n_expert_used=2\n\
         # layer=0 expert_bytes=10 dense_bytes=5\n# layer=1 expert_bytes=10 dense_bytes=5\n\
         turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped\n",
    );
    for step in 0..5 {
        for layer in 0..2 {
            text.push_str(&format!(
                "0,1,{step},{layer},0,3,0.6,0,10,0\n0,1,{step},{layer},1,{},0.4,0,10,0\n",
                4 + layer
            ));
        }
    }
    let e = RouteTrace::parse(&text).expect_err("constant routing");
    assert!(
        e.to_string()
            .contains("every token routes the same experts"),
        "{e}"
    );
    // One token differing anywhere makes it a real trace.
    let real = text.replacen("0,1,4,1,1,5,", "0,1,4,1,1,6,", 1);
    RouteTrace::parse(&real).expect("varied routing parses");
}

#[test]
fn route_trace_accepts_what_the_contract_allows() {
    let base = write_route_trace(&route_records());
    // No dropped column; extra columns; columns in another order; a note after the header.
    let header = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped";
    let reordered: String = base
        .lines()
        .map(|l| {
            if l.starts_with('#') {
                format!("{l}\n")
            } else {
                let f: Vec<&str> = l.split(',').collect();
                // expert_bytes, weight, extra, turn..expert, residency (dropped removed)
                format!(
                    "{},{},{},{},{}\n",
                    f[8],
                    f[6],
                    if l == header { "extra" } else { "x" },
                    f[..6].join(","),
                    f[7]
                )
            }
        })
        .collect();
    let trace = RouteTrace::parse(&reordered).expect("columns by name");
    assert!(!trace.has_dropped_column);
    assert_eq!(trace.n_rows(), route_records().len());
    // An all-nan trace is "unknown weights", not an error.
    let all_nan: String = base
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            if l.starts_with('#') || l == header {
                format!("{l}\n")
            } else {
                format!("{},nan,{}\n", f[..6].join(","), f[7..].join(","))
            }
        })
        .collect();
    let trace = RouteTrace::parse(&all_nan).expect("nan weights");
    assert!(!trace.weights_known());
}

fn load_real_trace(name: &str, rows: usize, n_expert_used: u32, layers: usize) {
    let Some(path) = shared_path(&format!("traces/{name}")) else {
        return;
    };
    let text = std::fs::read_to_string(&path).expect("readable trace");
    let start = std::time::Instant::now();
    let trace = RouteTrace::parse(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
    eprintln!(
        "{name}: {} rows parsed and checked in {:?}",
        trace.n_rows(),
        start.elapsed()
    );
    assert_eq!(trace.n_rows(), rows);
    assert_eq!(trace.preamble.n_expert_used, n_expert_used);
    assert_eq!(trace.preamble.layers.len(), layers);
    assert!(!trace.preamble.notes.is_empty());
    assert_eq!(trace.cells.len() * n_expert_used as usize, rows);
    assert!(trace
        .steps()
        .all(|s| s.cells.len() == layers && s.phase == Phase::Decode));
}

#[test]
fn real_mixtral_trace_loads() {
    load_real_trace("mixtral-8x7b-humaneval.route.csv", 21_312, 2, 32);
}

#[test]
fn real_deepseek_trace_loads() {
    load_real_trace("deepseek-v2-lite-puffin.route.csv", 125_424, 6, 26);
}

// ---------------------------------------------------------------------------------------------
// IO trace

fn io_records() -> Vec<IoRecord> {
    (0..6u64)
        .map(|i| IoRecord {
            turn: 0,
            phase: if i < 2 { Phase::Prefill } else { Phase::Decode },
            step: 28 + i as i64 / 2,
            layer: (i % 3) as u32,
            expert: 87 - i as u32,
            proj: (i % 3) as u8,
            lane: (i % 2) as u32,
            speculative: i == 4,
            offset: 1_526_304 + 147_456 * i,
            req_bytes: 65_536,
            read_bytes: 69_632,
            latency_ns: 416_800 + 1000 * i,
        })
        .collect()
}

#[test]
fn io_trace_golden_round_trip_and_rejections() {
    let mut w = IoTraceWriter::new(Vec::new()).expect("vec");
    for r in io_records() {
        w.write(&r).expect("vec");
    }
    let text = utf8(w.finish().expect("vec"));
    golden("io_trace.csv", &text);
    assert!(text.starts_with(
        "# io_trace v1\nturn,phase,step,layer,expert,proj,lane,spec,offset,req_bytes,read_bytes,latency_ns\n"
    ));
    assert_eq!(
        parse_io_trace(&text).expect("own output parses"),
        io_records()
    );

    let bad = [
        (
            "short read",
            text.replacen("65536,69632,416800", "65536,4096,416800", 1),
            "below req_bytes",
        ),
        (
            "spec 2",
            text.replacen(",0,1526304,", ",2,1526304,", 1),
            "column spec: 2 is above 1",
        ),
        (
            "non-numeric",
            text.replacen("416800", "4168O0", 1),
            "column latency_ns",
        ),
        (
            "missing column",
            text.replacen(",latency_ns", ",lat", 1),
            "lacks the required column latency_ns",
        ),
        (
            "no magic",
            text.replacen("# io_trace v1\n", "", 1),
            "expected '# io_trace v1'",
        ),
    ];
    for (what, t, needle) in bad {
        let e = parse_io_trace(&t).expect_err(what);
        assert!(e.to_string().contains(needle), "{what}: {e}");
    }
}
