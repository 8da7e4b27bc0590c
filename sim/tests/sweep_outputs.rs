//! `bmoe-sim sweep` outputs: a parallel sweep writes exactly the bytes a serial one does (every
//! file, the PNGs included), and the tidy table, pivot and per-layer table agree with each
//! other. A synthetic 12-turn trace (written here), so the test needs nothing outside.

mod common;

use common::{scratch, sim};
use std::fmt::Write as _;
use std::path::Path;

/// A route trace of `turns` turns × `tokens` decode tokens over 3 MoE layers of 16 experts,
/// top-2, skewed popularity that drifts from turn to turn.
fn synthetic_trace(turns: u32, tokens: u32) -> String {
    let mut t = String::from(
        "# route_trace v1\n# model=synthetic arch=qwen3moe n_layer=3 n_expert=16 n_expert_used=2\n",
    );
    for l in 0..3 {
        let _ = writeln!(t, "# layer={l} expert_bytes=1048576 dense_bytes=4096");
    }
    t.push_str("turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped\n");
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for turn in 0..turns {
        for step in 0..tokens {
            for layer in 0..3u32 {
                let mut ids: Vec<u64> = Vec::new();
                while ids.len() < 2 {
                    // Squared uniform: low ids are popular; the turn shifts which.
                    let u = (next() % 1000) as f64 / 1000.0;
                    let e = ((u * u * 16.0) as u64 + u64::from(turn) + u64::from(layer)) % 16;
                    if !ids.contains(&e) {
                        ids.push(e);
                    }
                }
                for (slot, e) in ids.iter().enumerate() {
                    let _ = writeln!(
                        t,
                        "{turn},1,{step},{layer},{slot},{e},{},0,1048576,0",
                        if slot == 0 { "0.6" } else { "0.4" }
                    );
                }
            }
        }
    }
    t
}

fn sweep(trace: &Path, out: &Path, jobs: &str, extra: &[&str]) -> String {
    let mut argv: Vec<String> = [
        "bmoe-sim",
        "sweep",
        "--trace",
        &trace.display().to_string(),
        "--experts-per-layer",
        "2,4,8",
        "--lanes",
        "1,2",
        "--overlap",
        "both",
        "--predictors",
        "none,prefetch:1",
        "--jobs",
        jobs,
        "--out",
        &out.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    argv.extend(extra.iter().map(|s| s.to_string()));
    let (mut o, mut e) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(argv, &[], &mut o, &mut e);
    assert_eq!(code, 0, "{}", String::from_utf8_lossy(&e));
    String::from_utf8_lossy(&o).into_owned()
}

#[test]
fn a_parallel_sweep_writes_the_bytes_a_serial_one_does() {
    let dir = scratch("par");
    let trace = dir.join("t.route.csv");
    std::fs::write(&trace, synthetic_trace(12, 10)).expect("trace");
    let (serial, parallel) = (dir.join("serial"), dir.join("parallel"));
    let a = sweep(&trace, &serial, "1", &["--x", "experts"]);
    let b = sweep(&trace, &parallel, "2", &["--x", "experts"]);
    assert_eq!(a.replace("serial", "X"), b.replace("parallel", "X"));
    let mut names: Vec<String> = std::fs::read_dir(&serial)
        .expect("serial dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "hit_rate.png",
            "hit_rate.svg",
            "per_layer.csv",
            "per_layer.md",
            "per_layer.png",
            "per_layer.svg",
            "pivot.md",
            "sweep.csv",
            "tok_s.png",
            "tok_s.svg"
        ]
    );
    for n in &names {
        let (x, y) = (
            std::fs::read(serial.join(n)).expect(n),
            std::fs::read(parallel.join(n)).expect(n),
        );
        assert!(!x.is_empty(), "{n} is empty");
        assert!(x == y, "{n} differs between --jobs 1 and --jobs 2");
    }
    let png = std::fs::read(serial.join("hit_rate.png")).expect("png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");

    // The tidy table: one row per cell (3 budgets × (5 policies + belady) × 2 × 2 for none,
    // 3 × 5 × 2 × 2 for prefetch:1), and its counts agree with the per-layer table.
    let table = std::fs::read_to_string(serial.join("sweep.csv")).expect("sweep.csv");
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    assert_eq!(header, bmoe_sim::sweep::report::COLUMNS);
    let col = |n: &str| header.iter().position(|h| *h == n).expect(n);
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    let n_policies = bmoe_core::policy::POLICY_NAMES.len();
    assert_eq!(rows.len(), 3 * (n_policies + 1) * 4 + 3 * n_policies * 4);
    let per_layer = std::fs::read_to_string(serial.join("per_layer.csv")).expect("per_layer");
    for r in &rows {
        assert_eq!(r[col("turns")], "12");
        let key = [
            r[col("mode")],
            r[col("predictor")],
            r[col("policy")],
            r[col("lanes")],
            r[col("overlap")],
            r[col("budget_bytes")],
        ]
        .join(",");
        let (mut n, mut h) = (0u64, 0u64);
        for l in per_layer
            .lines()
            .filter(|l| l.starts_with(&format!("{key},")))
        {
            let f: Vec<&str> = l.split(',').collect();
            n += f[8].parse::<u64>().expect("routings");
            h += f[9].parse::<u64>().expect("hits");
        }
        assert_eq!(n.to_string(), r[col("decode_routings")], "{key}");
        assert_eq!(h.to_string(), r[col("decode_hits")], "{key}");
        // Every lookup is a decode routing here (no prefill), so the two hit counts agree.
        assert_eq!(r[col("hits")], r[col("decode_hits")], "{key}");
        // 12 turns: intervals exist and hold the point value.
        let f = |c: &str| {
            r[col(c)]
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("{c} {key}"))
        };
        assert!(
            f("decode_hit_rate_lo") <= f("decode_hit_rate") + 1e-4,
            "{key}"
        );
        assert!(
            f("decode_hit_rate_hi") >= f("decode_hit_rate") - 1e-4,
            "{key}"
        );
        if r[col("predictor")] == "prefetch:1" {
            assert!(f("spec_useful") <= f("spec_experts"), "{key}");
        } else {
            assert_eq!(r[col("spec_experts")], "0", "{key}");
        }
    }
    let pivot = std::fs::read_to_string(serial.join("pivot.md")).expect("pivot");
    assert!(pivot.contains("## Hit rate, predictor `none`"), "{pivot}");
    assert!(
        pivot.contains("Share of the LRU→Belady headroom"),
        "{pivot}"
    );
    assert!(pivot.contains("| 2/layer | 4/layer | 8/layer |"), "{pivot}");
    assert!(pivot.contains("bootstrap 95 % interval over the trace's 12 turns"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hit_rate_panels_follow_the_settings_they_differ_by() {
    // Without a predictor the hits cannot depend on lanes or overlap: one panel, said so.
    let dir = scratch("facets");
    let trace = dir.join("t.route.csv");
    std::fs::write(&trace, synthetic_trace(3, 12)).expect("trace");
    let out = dir.join("none");
    let mut argv: Vec<String> = [
        "bmoe-sim",
        "sweep",
        "--trace",
        &trace.display().to_string(),
        "--experts-per-layer",
        "2,4",
        "--policies",
        "lru",
        "--lanes",
        "1,4",
        "--out",
        &out.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (mut o, mut e) = (Vec::new(), Vec::new());
    assert_eq!(bmoe_sim::cli::run(argv.clone(), &[], &mut o, &mut e), 0);
    let svg = std::fs::read_to_string(out.join("hit_rate.svg")).expect("svg");
    assert!(svg.contains("identical under every lanes/overlap setting"));
    let tps = std::fs::read_to_string(out.join("tok_s.svg")).expect("svg");
    for s in [
        "1 lane, overlap off",
        "1 lane, overlap on",
        "4 lanes, overlap off",
        "4 lanes, overlap on",
    ] {
        assert!(tps.contains(s), "tok/s panel {s}");
    }
    let pivot = std::fs::read_to_string(out.join("pivot.md")).expect("pivot");
    assert!(
        pivot.contains("No intervals: the trace has 3 turn(s)"),
        "{pivot}"
    );
    // A bad axis is a usage error.
    argv.extend(["--x".to_string(), "bytes".to_string()]);
    assert_eq!(bmoe_sim::cli::run(argv, &[], &mut o, &mut e), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_wrote_line_names_every_output_by_its_real_path() {
    // `--out DIR/` (a trailing slash, as shell completion gives it) once printed `DIR//{...}`.
    let dir = scratch("wrote");
    let trace = dir.join("t.route.csv");
    std::fs::write(&trace, synthetic_trace(3, 4)).expect("trace");
    let out = format!("{}/", dir.join("out").display());
    let (code, stdout, stderr) = sim(&[
        "sweep",
        "--trace",
        &trace.display().to_string(),
        "--experts-per-layer",
        "2",
        "--policies",
        "lru",
        "--lanes",
        "1",
        "--overlap",
        "off",
        "--bootstrap",
        "0",
        "--out",
        &out,
    ]);
    assert_eq!(code, 0, "{stderr}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("sweep: "))
        .expect("the sweep: line");
    assert!(!line.contains("//"), "{line}");
    let (_, paths) = line.split_once(" wrote ").expect("wrote");
    let paths: Vec<&str> = paths.split(", ").collect();
    assert_eq!(paths.len(), 10, "{line}");
    for p in &paths {
        assert!(std::path::Path::new(p).is_file(), "{p} in {line}");
    }
    assert!(paths.contains(&dir.join("out/sweep.csv").display().to_string().as_str()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sweep_help_lists_every_policy_the_core_registers() {
    let (code, help, _) = sim(&["sweep", "--help"]);
    assert_eq!(code, 0);
    // The --policies entry runs up to the next flag.
    let start = help.find("--policies").expect("--policies in help");
    let section = &help[start..];
    let end = section[2..]
        .find("\n      --")
        .map_or(section.len(), |i| i + 2);
    // clap aligns and wraps the values' help: compare with the whitespace runs collapsed.
    let section = section[..end]
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    for info in bmoe_core::policy::POLICIES {
        assert!(
            section.contains(&format!("- {}: {}", info.name, info.help)),
            "{} missing from:\n{section}",
            info.name
        );
    }
    assert!(section.contains("- belady: "), "{section}");
    // The short help names them too.
    let (_, short, _) = sim(&["sweep", "-h"]);
    for name in bmoe_core::policy::POLICY_NAMES {
        assert!(short.contains(name), "{name} missing from -h");
    }
    // An unknown name is a usage error that lists the known ones.
    let (code, _, err) = sim(&["sweep", "--trace", "t.csv", "--policies", "lru,mru"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("mru") && err.contains("belady"), "{err}");
}

#[test]
fn a_budget_past_the_expert_bank_gets_a_note_not_an_error() {
    // The synthetic bank: 3 MoE layers x 16 experts x 1 MiB = 48 MiB.
    let dir = scratch("bank");
    let trace = dir.join("t.route.csv");
    std::fs::write(&trace, synthetic_trace(3, 4)).expect("trace");
    let t = trace.display().to_string();
    let out = dir.join("out").display().to_string();
    let sweep = |budgets: &str| {
        sim(&[
            "sweep",
            "--trace",
            &t,
            "--budgets-mb",
            budgets,
            "--policies",
            "lru",
            "--lanes",
            "1",
            "--overlap",
            "off",
            "--bootstrap",
            "0",
            "--out",
            &out,
        ])
    };
    let (code, _, err) = sweep("8,48");
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("every expert"), "{err}");
    let (code, _, err) = sweep("8,64,100");
    assert_eq!(code, 0, "{err}");
    let notes: Vec<&str> = err.lines().filter(|l| l.contains("every expert")).collect();
    assert_eq!(notes.len(), 1, "{err}");
    assert!(
        notes[0].contains("64 MiB, 100 MiB") && notes[0].contains("48.0 MiB"),
        "{err}"
    );
    let replay = |mib: &str| sim(&["replay", "--trace", &t, "--cache-mb", mib, "--force-cache"]);
    let (code, _, err) = replay("48");
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("every expert"), "{err}");
    let (code, _, err) = replay("49");
    assert_eq!(code, 0, "{err}");
    let notes: Vec<&str> = err.lines().filter(|l| l.contains("every expert")).collect();
    assert_eq!(notes.len(), 1, "{err}");
    assert!(notes[0].contains("49 MiB"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pivot_writes_a_hit_rate_table_once_for_the_settings_it_holds_for() {
    // Without a predictor the hits cannot depend on lanes or overlap, even when a prefetch
    // predictor's hits in the same sweep do: `none`'s table is written once, said to hold for
    // every setting; no two hit-rate tables of a predictor are byte-identical.
    let dir = scratch("pivot-once");
    let trace = dir.join("t.route.csv");
    std::fs::write(&trace, synthetic_trace(12, 10)).expect("trace");
    let out = dir.join("out");
    sweep(&trace, &out, "2", &["--policies", "lru,lfu"]);
    let pivot = std::fs::read_to_string(out.join("pivot.md")).expect("pivot");
    // (heading, body without the heading's note) of every hit-rate section.
    let mut sections: Vec<(String, String)> = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in pivot.lines() {
        if line.starts_with("## ") {
            sections.extend(current.take());
            if line.starts_with("## Hit rate") {
                current = Some((line.to_string(), String::new()));
            }
        } else if let Some((_, body)) = current.as_mut() {
            if !line.starts_with("This table holds") {
                body.push_str(line);
                body.push('\n');
            }
        }
    }
    sections.extend(current);
    let of = |p: &str| {
        sections
            .iter()
            .filter(|(h, _)| h.starts_with(&format!("## Hit rate, predictor `{p}`")))
            .collect::<Vec<_>>()
    };
    let none = of("none");
    assert_eq!(none.len(), 1, "{pivot}");
    assert!(
        pivot.contains(
            "This table holds for every lanes/overlap setting of the sweep (1 lane, overlap off; \
             1 lane, overlap on; 2 lanes, overlap off; 2 lanes, overlap on)"
        ),
        "{pivot}"
    );
    for p in ["none", "prefetch:1"] {
        let tables = of(p);
        assert!(!tables.is_empty(), "no hit-rate table for {p}:\n{pivot}");
        for (i, a) in tables.iter().enumerate() {
            for b in &tables[i + 1..] {
                assert_ne!(a.1, b.1, "{} and {} repeat one table:\n{pivot}", a.0, b.0);
            }
        }
    }
    // Every setting still has its own tok/s table.
    assert_eq!(
        pivot
            .matches("## Predicted tok/s, predictor `none`")
            .count(),
        4,
        "{pivot}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `sweep.csv` as (policy, budget) -> its named columns.
fn table(dir: &Path) -> (Vec<String>, Vec<Vec<String>>) {
    let text = std::fs::read_to_string(dir.join("sweep.csv")).expect("sweep.csv");
    let mut lines = text.lines();
    let header: Vec<String> = lines
        .next()
        .expect("header")
        .split(',')
        .map(str::to_string)
        .collect();
    let rows = lines
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect();
    (header, rows)
}

/// The columns that depend on the cache alone, and those only a full-timing cell has.
const COUNT_COLUMNS: &[&str] = &[
    "predictor",
    "policy",
    "budget_bytes",
    "experts_per_layer",
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
    "turns",
];
const TIMED_COLUMNS: &[&str] = &[
    "lanes",
    "overlap",
    "read_bytes",
    "read_mib",
    "read_mib_per_tok",
    "spec_experts",
    "spec_useful",
    "spec_useful_frac",
    "spec_read_bytes",
    "tokens",
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
];

/// A cache-only sweep (every policy, Belady too) against a full-timing one at one lanes/
/// overlap setting: every count, rate, interval and delta equal; the per-layer table equal but
/// for its mode, lanes and overlap; and nothing timed written.
fn cache_only_matches_full_timing(trace: &Path, budgets: &str, name: &str) {
    let dir = scratch(&format!("cache-only-{name}"));
    let run = |out: &str, extra: &[&str]| {
        let mut args = vec![
            "sweep",
            "--trace",
            trace.to_str().expect("path"),
            "--experts-per-layer",
            budgets,
            "--jobs",
            "2",
            "--bootstrap",
            "200",
            "--out",
        ];
        let out = dir.join(out).display().to_string();
        args.push(&out);
        args.extend_from_slice(extra);
        let (code, stdout, err) = sim(&args);
        assert_eq!(code, 0, "{name}: {err}");
        stdout
    };
    let t0 = std::time::Instant::now();
    run("full", &["--lanes", "1", "--overlap", "off"]);
    let t_full = t0.elapsed();
    let t0 = std::time::Instant::now();
    let stdout = run("cache", &["--cache-only"]);
    let t_cache = t0.elapsed();
    assert!(
        stdout.contains("cache-only: counts only, no reads or times"),
        "{stdout}"
    );
    let (header, full) = table(&dir.join("full"));
    let (cache_header, cache) = table(&dir.join("cache"));
    assert_eq!(header, cache_header);
    assert_eq!(
        full.len(),
        cache.len(),
        "{name}: one cell per (budget, policy)"
    );
    let col = |n: &str| header.iter().position(|h| h == n).expect(n);
    for (f, c) in full.iter().zip(&cache) {
        assert_eq!(f[col("mode")], "full-timing");
        assert_eq!(c[col("mode")], "cache-only");
        for n in COUNT_COLUMNS {
            assert_eq!(f[col(n)], c[col(n)], "{name}: {n} of {f:?}");
        }
        for n in TIMED_COLUMNS {
            assert_eq!(c[col(n)], "", "{name}: {n} of a cache-only cell");
        }
    }
    let per_layer = |d: &str| -> Vec<String> {
        std::fs::read_to_string(dir.join(d).join("per_layer.csv"))
            .expect("per_layer.csv")
            .lines()
            .skip(1)
            .map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                [&f[1..3], &f[5..]].concat().join(",")
            })
            .collect()
    };
    assert_eq!(per_layer("full"), per_layer("cache"), "{name}");
    for chart in ["tok_s.svg", "tok_s.png"] {
        assert!(!dir.join("cache").join(chart).exists(), "{chart}");
    }
    let pivot = std::fs::read_to_string(dir.join("cache/pivot.md")).expect("pivot");
    assert!(pivot.contains("Mode: cache-only"), "{pivot}");
    assert!(!pivot.contains("tok/s,"), "{pivot}");
    eprintln!(
        "{name}: {} cells; full timing {:.2} s, cache-only {:.2} s",
        cache.len(),
        t_full.as_secs_f64(),
        t_cache.as_secs_f64()
    );
}

#[test]
fn a_cache_only_sweep_counts_what_a_full_timing_one_does_and_times_nothing() {
    let dir = scratch("cache-only-trace");
    let trace = dir.join("t.route.csv");
    std::fs::write(&trace, synthetic_trace(12, 20)).expect("trace");
    cache_only_matches_full_timing(&trace, "2,4,8", "synthetic");
    if let Some(t) = common::shared_trace("mixtral-8x7b-humaneval.route.csv") {
        cache_only_matches_full_timing(&t, "2,4,6", "mixtral");
    }
    if let Some(t) = common::shared_trace("deepseek-v2-lite-puffin.route.csv") {
        cache_only_matches_full_timing(&t, "6,12,24", "deepseek");
    }
}

#[test]
fn a_cache_only_sweep_refuses_what_it_cannot_model() {
    let dir = scratch("cache-only-refusals");
    let trace = dir.join("t.route.csv");
    std::fs::write(&trace, synthetic_trace(2, 4)).expect("trace");
    let t = trace.display().to_string();
    let out = dir.join("out").display().to_string();
    for (extra, says) in [
        (&["--lanes", "1"][..], "--cache-only with --lanes"),
        (&["--overlap", "on"][..], "--cache-only with --overlap"),
        (&["--jitter", "0.1"][..], "--cache-only with --jitter"),
        (
            &["--profile", "laptop-nvme"][..],
            "--cache-only with --profile",
        ),
        (
            &["--predictors", "none,prefetch:1"][..],
            "--cache-only with --predictors prefetch:1",
        ),
    ] {
        let mut args = vec!["sweep", "--trace", &t, "--cache-only", "--out", &out];
        args.extend_from_slice(extra);
        let (code, _, err) = sim(&args);
        assert_eq!(code, 1, "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}

/// `bench --cells` (a benchmark: its times are not judged here) checks that both modes count
/// the same in every cell it times, and says so.
#[test]
fn bench_cells_reports_both_modes_counting_alike() {
    let dir = scratch("bench-cells");
    let trace = dir.join("t.route.csv");
    std::fs::write(&trace, synthetic_trace(3, 8)).expect("trace");
    let (code, out, err) = sim(&[
        "bench",
        "--trace",
        trace.to_str().expect("path"),
        "--cells",
        "--reps",
        "1",
        "--policies",
        "lru,belady",
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    for policy in ["lru", "belady", "all"] {
        let line = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(policy))
            .unwrap_or_else(|| panic!("no {policy} row in\n{out}"));
        assert!(line.ends_with("equal"), "{line}");
    }
    assert!(out.contains("mrc: the lru curve at every budget"), "{out}");
}
