//! Gate: replaying an engine's route trace reproduces the engine's run exactly.
//!
//! A tiny synthetic model is generated (`bmoe-cli gen --preset tiny`), run for real with
//! `--moe-stream --force-cache` at several budgets, serial and under `--overlap`, recording
//! `--route-trace`, `--io-trace` and `--csv`; then `bmoe-sim replay` replays the route trace
//! with the same budget and flags. Hits, misses, evictions and read bytes are decided by the
//! same core code on the same routing, so they must agree exactly:
//! - the replayed route trace is byte-identical to the engine's (residency and bytes per
//!   routing included);
//! - the replayed io trace holds the same reads (offset, lane, requested and aligned bytes) —
//!   only their latencies are modelled;
//! - every CSV row's `read_bytes` and `cache_hit_pct`, and the trailer's count and byte keys,
//!   are equal; `bmoe-sim diff --exact-only` agrees.
//!
//! Both programs run in-process (`bmoe_engine::run::generate_with`, `bmoe_sim::cli::run`).

use bmoe_core::telemetry::MetricsCsv;
use bmoe_engine::cli::{Cli, Cmd};
use clap::Parser;
use std::path::{Path, PathBuf};

const PROMPT: &str = "Once upon a time there was a little fox who lived by the river";

fn temp_dir(name: &str) -> PathBuf {
    bmoe_gates::scratch_dir(name)
}

fn gen_tiny(path: &Path) {
    let cli = Cli::try_parse_from([
        "bmoe-cli",
        "gen",
        "--preset",
        "tiny",
        "--quiet",
        "-o",
        &path.display().to_string(),
    ])
    .expect("gen flags");
    match cli.cmd {
        Some(Cmd::Gen(a)) => bmoe_engine::cli::gen(a).expect("gen tiny"),
        other => panic!("expected the gen subcommand, got {other:?}"),
    }
}

struct Files {
    csv: PathBuf,
    route: PathBuf,
    io: PathBuf,
}

fn files(dir: &Path, tag: &str) -> Files {
    Files {
        csv: dir.join(format!("{tag}.csv")),
        route: dir.join(format!("{tag}.route.csv")),
        io: dir.join(format!("{tag}.io.csv")),
    }
}

fn telemetry_flags(f: &Files) -> Vec<String> {
    vec![
        "--csv".into(),
        f.csv.display().to_string(),
        "--route-trace".into(),
        f.route.display().to_string(),
        "--io-trace".into(),
        f.io.display().to_string(),
    ]
}

fn engine_run(model: &Path, flags: &[String], f: &Files) {
    let mut argv: Vec<String> = ["bmoe-cli", "-m", &model.display().to_string(), "-p", PROMPT]
        .iter()
        .map(|s| s.to_string())
        .collect();
    argv.extend([
        "-n".into(),
        "40".into(),
        "-t".into(),
        "2".into(),
        "--moe-stream".into(),
    ]);
    argv.extend(flags.iter().cloned());
    argv.extend(telemetry_flags(f));
    let cli = Cli::try_parse_from(&argv).expect("engine flags");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let outcome =
        bmoe_engine::run::generate_with(&cli.run, model, &mut out, &mut err).expect("engine run");
    assert_eq!(outcome.code, 0, "{}", String::from_utf8_lossy(&err));
}

fn sim_run(args: &[String]) -> (i32, String, String) {
    let mut argv = vec!["bmoe-sim".to_string()];
    argv.extend(args.iter().cloned());
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(argv, &[], &mut out, &mut err);
    (
        code,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// io rows without their latency, sorted (overlap delivers in completion order).
fn reads(io: &str) -> Vec<String> {
    let mut v: Vec<String> = io
        .lines()
        .map(|l| l.rsplit_once(',').map_or(l, |(head, _)| head).to_string())
        .collect();
    v.sort();
    v
}

#[test]
fn replaying_an_engine_trace_reproduces_its_hits_misses_evictions_and_bytes() {
    let dir = temp_dir("sim-engine");
    let model = dir.join("tiny.gguf");
    gen_tiny(&model);
    let mut checked_hits = false;
    for budget in ["2", "4", "8"] {
        for overlap in [false, true] {
            let tag = format!("b{budget}{}", if overlap { "o" } else { "s" });
            let mut flags: Vec<String> = vec![
                "--cache-mb".into(),
                budget.into(),
                "--force-cache".into(),
                "--io-threads".into(),
                "3".into(),
            ];
            if overlap {
                flags.push("--overlap".into());
            }
            let e = files(&dir, &format!("{tag}-engine"));
            engine_run(&model, &flags, &e);
            let measured = MetricsCsv::parse(&read(&e.csv)).expect("engine csv");
            // Replay what the engine achieved: buffered reads if O_DIRECT was refused here.
            if measured.preamble.get("o_direct") == Some("0") {
                flags.push("--no-odirect".into());
            }
            let s = files(&dir, &format!("{tag}-sim"));
            let mut args = vec![
                "replay".to_string(),
                "--trace".into(),
                e.route.display().to_string(),
                "--profile".into(),
                "this-machine".into(),
            ];
            args.extend(flags.iter().cloned());
            args.extend(telemetry_flags(&s));
            let (code, out, err) = sim_run(&args);
            assert_eq!(code, 0, "{tag}: {err}");
            assert!(out.contains("moe-cache:"), "{tag}: {out}");

            assert!(
                read(&e.route) == read(&s.route),
                "{tag}: route traces differ"
            );
            assert!(
                reads(&read(&e.io)) == reads(&read(&s.io)),
                "{tag}: io traces hold different reads"
            );
            let simulated = MetricsCsv::parse(&read(&s.csv)).expect("sim csv");
            assert_eq!(simulated.rows.len(), measured.rows.len(), "{tag}: rows");
            for (m, s) in measured.rows.iter().zip(&simulated.rows) {
                assert_eq!(
                    (m.step, m.read_bytes, m.cache_hit_pct),
                    (s.step, s.read_bytes, s.cache_hit_pct),
                    "{tag}: token {}",
                    m.step
                );
            }
            let (ms, ss) = (
                measured.summary().expect("engine trailer"),
                simulated.summary().expect("sim trailer"),
            );
            // Every key the simulator's own `diff` holds to equality.
            for key in bmoe_sim::diff::EXACT_SUMMARY_KEYS {
                assert_eq!(ms.get(key), ss.get(key), "{tag}: summary {key}");
            }
            let hit: f64 = ms
                .get("cache_hit_pct")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            checked_hits |= hit > 0.0;

            let (code, out, err) = sim_run(&[
                "diff".into(),
                s.csv.display().to_string(),
                e.csv.display().to_string(),
                "--exact-only".into(),
            ]);
            assert_eq!(code, 0, "{tag}: diff says\n{out}{err}");
        }
    }
    assert!(
        checked_hits,
        "some budget must produce cache hits, or the gate proves little"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// One engine run of the tiny model with `flags` (the prompt, 40 tokens, 2 threads), its
/// outcome and its stdout and stderr.
fn engine_outcome(model: &Path, flags: &[String]) -> (bmoe_engine::run::Outcome, String, String) {
    let mut argv: Vec<String> = ["bmoe-cli", "-m", &model.display().to_string(), "-p", PROMPT]
        .iter()
        .map(|s| s.to_string())
        .collect();
    argv.extend(["-n".into(), "40".into(), "-t".into(), "2".into()]);
    argv.extend(flags.iter().cloned());
    let cli = Cli::try_parse_from(&argv).expect("engine flags");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let outcome =
        bmoe_engine::run::generate_with(&cli.run, model, &mut out, &mut err).expect("engine run");
    let err = String::from_utf8_lossy(&err).into_owned();
    assert_eq!(outcome.code, 0, "{err}");
    (outcome, String::from_utf8_lossy(&out).into_owned(), err)
}

fn bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Issue 36: under `--eviction tinylfu` a miss the admission filter refuses is bypassed — the
/// engine reads it into a staging buffer (4096-aligned, O_DIRECT where the shard allows it) and
/// computes it from there, and it never enters the cache. The simulator, replaying the engine's
/// route trace with the same flags, must bypass exactly the same misses: equal hits, misses,
/// evictions, bypasses and read bytes, the same reads, a byte-identical route trace, serial
/// and under `--overlap`, at a budget that evicts every token and at one that holds a third
/// of the experts. And bypassing is lossless: tokens, text and every logit are those of the
/// resident run, bit for bit.
#[test]
fn the_engine_and_the_simulator_bypass_the_same_misses_and_bypassing_is_lossless() {
    let dir = temp_dir("sim-engine-bypass");
    let model = dir.join("tiny.gguf");
    gen_tiny(&model);
    let resident_logits = dir.join("resident.logits");
    let (resident, resident_text, _) = engine_outcome(
        &model,
        &["--logits-out".into(), resident_logits.display().to_string()],
    );
    for budget in ["2", "6"] {
        for overlap in [false, true] {
            let tag = format!("tinylfu-b{budget}{}", if overlap { "o" } else { "s" });
            let mut flags: Vec<String> = vec![
                "--moe-stream".into(),
                "--cache-mb".into(),
                budget.into(),
                "--force-cache".into(),
                "--io-threads".into(),
                "3".into(),
                "--eviction".into(),
                "tinylfu".into(),
            ];
            if overlap {
                flags.push("--overlap".into());
            }
            let e = files(&dir, &format!("{tag}-engine"));
            let logits = dir.join(format!("{tag}.logits"));
            let mut engine_flags = flags.clone();
            engine_flags.extend(telemetry_flags(&e));
            engine_flags.extend(["--logits-out".into(), logits.display().to_string()]);
            let (outcome, text, stderr) = engine_outcome(&model, &engine_flags);

            // Lossless: the resident run's tokens, text and logits, bit for bit.
            assert_eq!(outcome.tokens, resident.tokens, "{tag}: tokens");
            assert_eq!(text, resident_text, "{tag}: text");
            assert!(
                bytes(&logits) == bytes(&resident_logits),
                "{tag}: logits differ from the resident run's"
            );
            let json = |p: &Path| bytes(&PathBuf::from(format!("{}.json", p.display())));
            assert!(
                json(&logits) == json(&resident_logits),
                "{tag}: the logits' token ids and router margins differ"
            );

            let summary = outcome.summary.as_ref().expect("a streamed run's summary");
            let c = &summary.counters;
            assert!(c.admission_filter, "{tag}: tinylfu filters admission");
            assert!(c.bypasses > 0, "{tag}: nothing was bypassed");
            assert!(c.evictions > 0, "{tag}: nothing was evicted");
            assert!(
                stderr.contains(&format!("moe-cache: {} misses bypassed", c.bypasses)),
                "{tag}: the report's bypass line\n{stderr}"
            );

            let measured = MetricsCsv::parse(&read(&e.csv)).expect("engine csv");
            if measured.preamble.get("o_direct") == Some("0") {
                flags.push("--no-odirect".into());
            }
            let s = files(&dir, &format!("{tag}-sim"));
            let mut args = vec![
                "replay".to_string(),
                "--trace".into(),
                e.route.display().to_string(),
                "--profile".into(),
                "this-machine".into(),
            ];
            args.extend(flags.iter().filter(|f| *f != "--moe-stream").cloned());
            args.extend(telemetry_flags(&s));
            let (code, out, err) = sim_run(&args);
            assert_eq!(code, 0, "{tag}: {err}");
            assert!(
                read(&e.route) == read(&s.route),
                "{tag}: route traces differ"
            );
            assert!(
                reads(&read(&e.io)) == reads(&read(&s.io)),
                "{tag}: io traces hold different reads"
            );
            let line = out
                .lines()
                .find(|l| l.starts_with("sim: profile="))
                .unwrap_or_else(|| panic!("{tag}: no sim: line in\n{out}"));
            let kv = |key: &str| -> u64 {
                line.split(' ')
                    .find_map(|t| t.strip_prefix(&format!("{key}=")))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("{tag}: {key} in {line}"))
            };
            assert_eq!(
                (
                    kv("hits"),
                    kv("misses"),
                    kv("evictions"),
                    kv("bypasses"),
                    kv("read_bytes")
                ),
                (
                    c.hits,
                    c.misses,
                    c.evictions,
                    c.bypasses,
                    summary.totals.read_bytes + c.prefill.read_bytes
                ),
                "{tag}: engine vs simulator"
            );
            let simulated = MetricsCsv::parse(&read(&s.csv)).expect("sim csv");
            let (ms, ss) = (
                measured.summary().expect("engine trailer"),
                simulated.summary().expect("sim trailer"),
            );
            assert_eq!(
                ms.get("bypasses"),
                Some(c.bypasses.to_string().as_str()),
                "{tag}: the engine trailer's bypasses="
            );
            for key in bmoe_sim::diff::EXACT_SUMMARY_KEYS {
                assert_eq!(ms.get(key), ss.get(key), "{tag}: summary {key}");
            }
            for (m, s) in measured.rows.iter().zip(&simulated.rows) {
                assert_eq!(
                    (m.step, m.read_bytes, m.cache_hit_pct),
                    (s.step, s.read_bytes, s.cache_hit_pct),
                    "{tag}: token {}",
                    m.step
                );
            }
            eprintln!(
                "{tag}: {} hits, {} misses, {} evictions, {} bypassed; engine == simulator",
                c.hits, c.misses, c.evictions, c.bypasses
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
