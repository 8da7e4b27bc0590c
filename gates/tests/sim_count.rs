//! Gate: the hit counts bmoe-sim reports on the real Mixtral-8x7B trace, at global budgets of
//! 2, 4 and 6 experts per layer (2×32, 4×32, 6×32 experts' bytes), agree **exactly** with the
//! independent count of `scripts/sim-check.py` — a stdlib-only Python script with its own
//! trace reader and its own cache, sharing no code with bmoe. Both the full-timing replay
//! (the core's `Engine` on the virtual clock, through the binary's own entry point) and the
//! cache-only path are checked, for global LRU (the core's policy) and for the Belady bound
//! (`bmoe_sim::belady`, an analysis policy the script re-implements on its own).
//!
//! Skips with a message when `python3` or `../shared` is missing; fails instead under
//! `CI=true`.

use bmoe_engine::testdata::shared_path;
use bmoe_sim::plan::{layout_from_preamble, AccessSeq, ReplayPlan};
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: u64 = 1 << 20;

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

fn project_root() -> PathBuf {
    bmoe_engine::testdata::project_root()
}

/// `python3`, or `None` (skip) when it cannot run here; panics under CI.
fn python3() -> Option<&'static str> {
    match Command::new("python3").arg("--version").output() {
        Ok(o) if o.status.success() => Some("python3"),
        _ if in_ci() => panic!("CI=true but python3 is not available for scripts/sim-check.py"),
        _ => {
            eprintln!("skipping: python3 is not available to run scripts/sim-check.py");
            None
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Count {
    policy: String,
    budget_bytes: u64,
    lookups: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
    rereads: u64,
}

fn python_counts(py: &str, trace: &Path, policies: &str) -> Vec<Count> {
    python_counts_at(py, trace, policies, "2,4,6")
}

/// The `sim:` line of a `bmoe-sim replay` run, as key=value pairs.
fn replay_sim_line(args: &[String]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut err = Vec::new();
    let mut argv = vec!["bmoe-sim".to_string(), "replay".to_string()];
    argv.extend(args.iter().cloned());
    let code = bmoe_sim::cli::run(argv, &[], &mut out, &mut err);
    let err = String::from_utf8_lossy(&err);
    assert_eq!(code, 0, "bmoe-sim replay failed: {err}");
    let text = String::from_utf8_lossy(&out);
    let line = text
        .lines()
        .find(|l| l.starts_with("sim: "))
        .unwrap_or_else(|| panic!("no sim: line in\n{text}"));
    line["sim: ".len()..]
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn get(kv: &[(String, String)], key: &str) -> u64 {
    kv.iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("{key} missing from {kv:?}"))
}

#[test]
fn mixtral_lru_and_belady_counts_agree_with_the_independent_python_count() {
    let Some(trace_path) = shared_path("traces/mixtral-8x7b-humaneval.route.csv") else {
        return;
    };
    let Some(py) = python3() else {
        return;
    };
    let all = python_counts(py, &trace_path, "lru,belady");
    assert_eq!(all.len(), 6);
    let (expected, belady): (Vec<Count>, Vec<Count>) =
        all.into_iter().partition(|c| c.policy == "lru");

    let trace = bmoe_sim::cli::load_trace(&trace_path).expect("trace");
    let layout = layout_from_preamble(&trace.preamble).expect("layout");
    let plan = ReplayPlan::new(&trace).expect("plan");
    let seq = AccessSeq::new(&trace, &plan, 0);
    let mut previous_hits = 0;
    for want in &expected {
        // 2, 4, 6 experts/layer of 114229248 bytes over 32 layers are whole MiB: the replay
        // is given exactly the script's budget.
        assert_eq!(want.budget_bytes % MIB, 0);
        let kv = replay_sim_line(&[
            "--trace".into(),
            trace_path.display().to_string(),
            "--cache-mb".into(),
            (want.budget_bytes / MIB).to_string(),
        ]);
        let full = Count {
            policy: "lru".into(),
            budget_bytes: want.budget_bytes,
            lookups: get(&kv, "lookups"),
            hits: get(&kv, "hits"),
            misses: get(&kv, "misses"),
            evictions: get(&kv, "evictions"),
            rereads: get(&kv, "rereads"),
        };
        assert_eq!(&full, want, "full replay vs sim-check.py");

        let fast = bmoe_sim::cache_only::run(
            &layout,
            &seq,
            want.budget_bytes,
            2,
            bmoe_core::policy::by_name("lru").expect("lru"),
        )
        .expect("cache-only");
        assert_eq!(
            (
                fast.counters.hits,
                fast.counters.misses,
                fast.counters.evictions,
                fast.counters.rereads
            ),
            (want.hits, want.misses, want.evictions, want.rereads),
            "cache-only vs sim-check.py at {} bytes",
            want.budget_bytes
        );
        // Not a trivial agreement: every decode routing was looked up, the hit rates are the
        // trace's known global-LRU figures (README: about 0.57 at 4 per layer), and they grow
        // with the budget.
        assert_eq!(want.lookups, 21_312);
        assert!(want.hits > previous_hits);
        previous_hits = want.hits;
    }
    let at4 = expected[1].hits as f64 / expected[1].lookups as f64;
    assert!((0.55..0.60).contains(&at4), "LRU hit rate at 4/layer {at4}");

    // The Belady bound: the cache-only evaluator and a full-timing replay under the
    // clairvoyant policy both count what the script counts, and the bound beats LRU at every
    // budget (README: about 0.82 at 4 per layer).
    let trace = std::sync::Arc::new(trace);
    for (want, lru) in belady.iter().zip(&expected) {
        let (policy, desync) = bmoe_sim::belady::Clairvoyant::new(&seq, &layout);
        let fast = bmoe_sim::cache_only::run(&layout, &seq, want.budget_bytes, 2, Box::new(policy))
            .expect("belady cache-only");
        desync.check().expect("belady followed the sequence");
        let (policy, desync) = bmoe_sim::belady::Clairvoyant::new(&seq, &layout);
        let full = full_replay_with(&trace, want.budget_bytes, false, Box::new(policy));
        desync.check().expect("belady followed the replay");
        for got in [fast.counters, full] {
            assert_eq!(
                (got.hits, got.misses, got.evictions, got.rereads),
                (want.hits, want.misses, want.evictions, want.rereads),
                "belady at {} bytes",
                want.budget_bytes
            );
        }
        assert!(want.hits > lru.hits, "the bound must beat LRU");
    }
    let b4 = belady[1].hits as f64 / belady[1].lookups as f64;
    assert!(
        (0.80..0.84).contains(&b4),
        "Belady hit rate at 4/layer {b4}"
    );
}

/// The full-timing replay of `trace` at `budget_bytes` under global LRU, serial or overlap.
fn full_replay_counts(
    trace: &std::sync::Arc<bmoe_core::telemetry::route_trace::RouteTrace>,
    budget_bytes: u64,
    overlap: bool,
) -> bmoe_core::CacheCounters {
    full_replay_with(
        trace,
        budget_bytes,
        overlap,
        bmoe_core::policy::by_name("lru").expect("lru"),
    )
}

/// The full-timing replay of `trace` at `budget_bytes` under `policy`.
fn full_replay_with(
    trace: &std::sync::Arc<bmoe_core::telemetry::route_trace::RouteTrace>,
    budget_bytes: u64,
    overlap: bool,
    policy: Box<dyn bmoe_core::policy::EvictionPolicy>,
) -> bmoe_core::CacheCounters {
    let layout = layout_from_preamble(&trace.preamble).expect("layout");
    let plan = std::sync::Arc::new(ReplayPlan::new(trace).expect("plan"));
    let cfg = bmoe_core::config::RunConfig {
        moe_stream: true,
        overlap,
        n_expert_used: trace.preamble.n_expert_used,
        ..Default::default()
    };
    let profile = bmoe_sim::DeviceProfile::load("ufs40-phone").expect("profile");
    let r = bmoe_sim::replay::run(
        bmoe_sim::replay::ReplaySetup {
            trace: trace.clone(),
            plan,
            layout: &layout,
            cfg: &cfg,
            budget_bytes,
            policy,
            profile: &profile,
            seed: 0,
        },
        bmoe_sim::replay::ReplayOutputs::default(),
    )
    .expect("replay");
    r.cache
}

#[test]
fn the_cache_only_path_counts_what_the_full_replay_counts_on_both_real_traces() {
    for (name, per_layer) in [
        ("traces/mixtral-8x7b-humaneval.route.csv", [2u64, 3, 5]),
        ("traces/deepseek-v2-lite-puffin.route.csv", [6u64, 12, 32]),
    ] {
        let Some(path) = shared_path(name) else {
            return;
        };
        let trace = std::sync::Arc::new(bmoe_sim::cli::load_trace(&path).expect("trace"));
        let layout = layout_from_preamble(&trace.preamble).expect("layout");
        let plan = ReplayPlan::new(&trace).expect("plan");
        let seq = AccessSeq::new(&trace, &plan, 0);
        let k = trace.preamble.n_expert_used as u16;
        for n in per_layer {
            let budget = n * u64::from(layout.n_moe_layers()) * layout.max_expert_bytes();
            let fast = bmoe_sim::cache_only::run(
                &layout,
                &seq,
                budget,
                k,
                bmoe_core::policy::by_name("lru").expect("lru"),
            )
            .expect("cache-only");
            for overlap in [false, true] {
                let full = full_replay_counts(&trace, budget, overlap);
                assert_eq!(
                    full, fast.counters,
                    "{name} at {n}/layer, overlap {overlap}"
                );
            }
            assert!(
                fast.counters.hits > 0 && fast.counters.evictions > 0,
                "{name} {n}"
            );
        }
        // Every other registered policy at the middle budget: `sweep --cache-only` offers
        // them all, admission filters (bypasses) included.
        let budget = per_layer[1] * u64::from(layout.n_moe_layers()) * layout.max_expert_bytes();
        for info in bmoe_core::policy::POLICIES
            .iter()
            .filter(|p| p.name != "lru")
        {
            let fast = bmoe_sim::cache_only::run(&layout, &seq, budget, k, (info.make)())
                .expect("cache-only");
            let full = full_replay_with(&trace, budget, false, (info.make)());
            assert_eq!(
                full, fast.counters,
                "{name} {} at {}/layer",
                info.name, per_layer[1]
            );
        }
    }
}

#[test]
fn the_sweep_table_carries_the_independent_counts_and_its_plots() {
    let Some(trace_path) = shared_path("traces/mixtral-8x7b-humaneval.route.csv") else {
        return;
    };
    let Some(py) = python3() else {
        return;
    };
    let expected = python_counts(py, &trace_path, "lru,belady");
    let out_dir = bmoe_gates::scratch_dir("sweep");
    let argv: Vec<String> = [
        "bmoe-sim",
        "sweep",
        "--trace",
        &trace_path.display().to_string(),
        "--experts-per-layer",
        "2,4,6",
        "--policies",
        "lru,belady",
        "--lanes",
        "1,4",
        "--overlap",
        "both",
        "--jobs",
        "2",
        "--out",
        &out_dir.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(argv, &[], &mut out, &mut err);
    assert_eq!(code, 0, "{}", String::from_utf8_lossy(&err));
    let table = std::fs::read_to_string(out_dir.join("sweep.csv")).expect("sweep.csv");
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).expect(name);
    let rows: Vec<Vec<String>> = lines
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect();
    assert_eq!(
        rows.len(),
        3 * 2 * 2 * 2,
        "budgets x policies x lanes x overlap"
    );
    for row in &rows {
        let policy = &row[col("policy")];
        let budget: u64 = row[col("budget_bytes")].parse().expect("budget");
        let want = expected
            .iter()
            .find(|c| &c.policy == policy && c.budget_bytes == budget)
            .unwrap_or_else(|| panic!("no independent count for {policy} at {budget}"));
        let n = |name: &str| -> u64 { row[col(name)].parse().expect(name) };
        assert_eq!(
            (n("hits"), n("misses"), n("evictions"), n("rereads")),
            (want.hits, want.misses, want.evictions, want.rereads),
            "sweep row {row:?}"
        );
        let tok_s: f64 = row[col("tok_s")].parse().expect("tok_s");
        assert!(tok_s > 0.0);
    }
    for plot in ["hit_rate.svg", "tok_s.svg"] {
        let svg = std::fs::read_to_string(out_dir.join(plot)).expect(plot);
        assert!(
            svg.starts_with("<svg") && svg.contains("<polyline"),
            "{plot}"
        );
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// `sim-check.py` on `trace` for `policies` at `experts_per_layer`, as counts.
fn python_counts_at(py: &str, trace: &Path, policies: &str, experts_per_layer: &str) -> Vec<Count> {
    let out = Command::new(py)
        .arg(project_root().join("scripts/sim-check.py"))
        .arg(trace)
        .args([
            "--experts-per-layer",
            experts_per_layer,
            "--policy",
            policies,
        ])
        .output()
        .expect("run scripts/sim-check.py");
    assert!(
        out.status.success(),
        "sim-check.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json line");
            let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} in {l}"));
            Count {
                policy: v["policy"].as_str().expect("policy").to_string(),
                budget_bytes: n("budget_bytes"),
                lookups: n("lookups"),
                hits: n("hits"),
                misses: n("misses"),
                evictions: n("evictions"),
                rereads: n("rereads"),
            }
        })
        .collect()
}

/// The layer-LRU, 2Q and LeCaR policies (`shared/src/policy/`), run by the full-timing replay
/// of `bmoe-sim sweep`, hit exactly what `sim-check.py`'s own implementations of their written
/// rules hit: on the whole Mixtral trace and on the first 4 prompts of the DeepSeek trace.
#[test]
fn new_policies_counts_agree_with_the_independent_python_count() {
    let Some(py) = python3() else {
        return;
    };
    let policies = "layer-lru,2q,lecar";
    let dir = bmoe_gates::scratch_dir("sweep-policies");
    let mut cases: Vec<(PathBuf, &str)> = Vec::new();
    if let Some(t) = shared_path("traces/mixtral-8x7b-humaneval.route.csv") {
        cases.push((t, "2,4,6"));
    }
    if let Some(t) = shared_path("traces/deepseek-v2-lite-puffin.route.csv") {
        let p = dir.join("deepseek-4-turns.route.csv");
        std::fs::write(&p, first_turns(&t, 4)).expect("slice");
        cases.push((p, "6,12,24"));
    }
    for (trace, per_layer) in &cases {
        let expected = python_counts_at(py, trace, policies, per_layer);
        assert_eq!(expected.len(), 9, "{}", trace.display());
        let out_dir = dir.join("out");
        let argv: Vec<String> = [
            "bmoe-sim",
            "sweep",
            "--trace",
            &trace.display().to_string(),
            "--experts-per-layer",
            per_layer,
            "--policies",
            policies,
            "--lanes",
            "2",
            "--overlap",
            "on",
            "--out",
            &out_dir.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = bmoe_sim::cli::run(argv, &[], &mut out, &mut err);
        assert_eq!(code, 0, "{}", String::from_utf8_lossy(&err));
        let table = std::fs::read_to_string(out_dir.join("sweep.csv")).expect("sweep.csv");
        let mut lines = table.lines();
        let header: Vec<&str> = lines.next().expect("header").split(',').collect();
        let col = |name: &str| header.iter().position(|h| *h == name).expect(name);
        let mut checked = 0;
        for line in lines {
            let row: Vec<&str> = line.split(',').collect();
            let n = |name: &str| -> u64 { row[col(name)].parse().expect(name) };
            let got = Count {
                policy: row[col("policy")].to_string(),
                budget_bytes: n("budget_bytes"),
                lookups: n("lookups"),
                hits: n("hits"),
                misses: n("misses"),
                evictions: n("evictions"),
                rereads: n("rereads"),
            };
            assert!(
                expected.contains(&got),
                "{} {got:?} not in {expected:?}",
                trace.display()
            );
            checked += 1;
        }
        assert_eq!(checked, 9);
        eprintln!("{}: 9 cells agree with sim-check.py", trace.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The reordering study (`bmoe-sim sweep --placements`) on the first 10 turns of the DeepSeek
/// capture, at 6 and 12 experts per layer under LRU: misses and flash requests of every
/// placement (separate reads, the file's order merged, the co-activation placement fitted on
/// one half and on the other) equal the independent count of `scripts/reorder-check.py`, which
/// re-implements the placement and the merging from their written rules over sim-check.py's
/// cache.
#[test]
fn deepseek_placement_counts_agree_with_the_independent_python_count() {
    let Some(trace_path) = shared_path("traces/deepseek-v2-lite-puffin.route.csv") else {
        return;
    };
    let Some(py) = python3() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("bmoe-reorder-gate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch");
    let trace = dir.join("ds10.csv");
    std::fs::write(&trace, first_turns(&trace_path, 10)).expect("slice");
    let out = Command::new(py)
        .arg(project_root().join("scripts/reorder-check.py"))
        .arg(&trace)
        .args(["--experts-per-layer", "6,12"])
        .output()
        .expect("run reorder-check.py");
    assert!(
        out.status.success(),
        "reorder-check.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |line: &str, key: &str| -> String {
        let at = line.find(&format!("\"{key}\": ")).expect(key) + key.len() + 4;
        line[at..]
            .split([',', '}'])
            .next()
            .expect("value")
            .trim_matches('"')
            .to_string()
    };
    let want: Vec<(u64, String, u64, u64)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            (
                field(l, "budget_bytes").parse().expect("budget"),
                field(l, "placement"),
                field(l, "misses").parse().expect("misses"),
                field(l, "requests").parse().expect("requests"),
            )
        })
        .collect();
    assert_eq!(want.len(), 8, "two budgets x four placements");

    let sweep = dir.join("sweep");
    let (code, _, err) = bmoe_gates::sim(&[
        "sweep",
        "--trace",
        trace.to_str().expect("utf-8"),
        "--experts-per-layer",
        "6,12",
        "--policies",
        "lru",
        "--lanes",
        "1",
        "--overlap",
        "off",
        "--bootstrap",
        "0",
        "--placements",
        "separate,file,coact,coact-in-sample",
        "--out",
        sweep.to_str().expect("utf-8"),
    ]);
    assert_eq!(code, 0, "sweep: {err}");
    let layout = layout_from_preamble(&bmoe_sim::cli::load_trace(&trace).expect("trace").preamble)
        .expect("layout");
    let per_layer = u64::from(layout.n_moe_layers()) * layout.max_expert_bytes();
    let csv = std::fs::read_to_string(sweep.join("placement.csv")).expect("placement.csv");
    let mut lines = csv.lines();
    let head: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |name: &str| head.iter().position(|h| *h == name).expect(name);
    let got: Vec<(u64, String, u64, u64)> = lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let per: f64 = f[col("experts_per_layer")].parse().expect("experts");
            (
                per.round() as u64 * per_layer,
                f[col("placement")].to_string(),
                f[col("misses")].parse().expect("misses"),
                f[col("requests")].parse().expect("requests"),
            )
        })
        .collect();
    assert_eq!(got, want, "bmoe-sim sweep --placements vs reorder-check.py");
    let (sep, coact) = (&got[0], &got[2]);
    assert!(
        coact.3 < sep.3,
        "the fitted placement merges something on a real capture: {got:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The policies `sim-check.py` re-implements on its own, from the rules written in
/// docs/policies.md, that this gate holds to its counts on both real traces.
const RECOUNTED_POLICIES: &str = "arc,s3fifo,sieve";

/// ARC, S3-FIFO and SIEVE (`shared/src/policy/`), run by the core's cache on the cache-only
/// path, hit exactly what `sim-check.py`'s own implementations of their written rules hit: on
/// the whole Mixtral trace and on the first 8 prompts of the DeepSeek trace (the script takes
/// about a second per prompt there; the Rust side would take the whole trace in a second), at
/// five budgets each. The cache-only path's agreement with the full-timing replay is shown
/// for LRU above; it is checked for these policies too, at one budget per trace, since
/// their victims depend on the order of every event the cache sends.
#[test]
fn arc_s3fifo_and_sieve_counts_agree_with_the_independent_python_count() {
    let Some(py) = python3() else {
        return;
    };
    let dir = bmoe_gates::scratch_dir("recount");
    let mut traces: Vec<(PathBuf, &str)> = Vec::new();
    for (name, per_layer, turns) in [
        ("traces/mixtral-8x7b-humaneval.route.csv", "2,3,4,5,6", None),
        (
            "traces/deepseek-v2-lite-puffin.route.csv",
            "6,12,16,24,32",
            Some(8),
        ),
    ] {
        let Some(path) = shared_path(name) else {
            return;
        };
        let path = match turns {
            None => path,
            Some(t) => {
                let sliced = dir.join(format!("first-{t}-turns.route.csv"));
                std::fs::write(&sliced, first_turns(&path, t)).expect("slice");
                sliced
            }
        };
        traces.push((path, per_layer));
    }
    // The script runs once per trace, both at once (it is the slow side).
    let expected: Vec<Vec<Count>> = std::thread::scope(|s| {
        let runs: Vec<_> = traces
            .iter()
            .map(|(path, per_layer)| {
                s.spawn(move || python_counts_at(py, path, RECOUNTED_POLICIES, per_layer))
            })
            .collect();
        runs.into_iter()
            .map(|r| r.join().expect("sim-check.py thread"))
            .collect()
    });
    for ((path, _), expected) in traces.iter().zip(&expected) {
        let n_policies = RECOUNTED_POLICIES.split(',').count();
        assert_eq!(expected.len(), 5 * n_policies, "{}", path.display());
        let trace = std::sync::Arc::new(bmoe_sim::cli::load_trace(path).expect("trace"));
        let layout = layout_from_preamble(&trace.preamble).expect("layout");
        let plan = ReplayPlan::new(&trace).expect("plan");
        let seq = AccessSeq::new(&trace, &plan, 0);
        let k = trace.preamble.n_expert_used as u16;
        for want in expected {
            let policy = bmoe_core::policy::by_name(&want.policy).expect("registered policy");
            let fast = bmoe_sim::cache_only::run(&layout, &seq, want.budget_bytes, k, policy)
                .expect("cache-only");
            let got = Count {
                policy: want.policy.clone(),
                budget_bytes: want.budget_bytes,
                lookups: fast.counters.hits + fast.counters.misses,
                hits: fast.counters.hits,
                misses: fast.counters.misses,
                evictions: fast.counters.evictions,
                rereads: fast.counters.rereads,
            };
            assert_eq!(&got, want, "{}: bmoe-sim vs sim-check.py", path.display());
            assert!(
                got.evictions > 0,
                "{} evicts at every budget",
                path.display()
            );
        }
        for policy in RECOUNTED_POLICIES.split(',') {
            let want = expected
                .iter()
                .find(|c| c.policy == policy)
                .expect("a count");
            let policy_box = bmoe_core::policy::by_name(policy).expect("registered policy");
            let full = full_replay_with(&trace, want.budget_bytes, true, policy_box);
            assert_eq!(
                (full.hits, full.misses, full.evictions, full.rereads),
                (want.hits, want.misses, want.evictions, want.rereads),
                "{} {policy}: full-timing replay vs sim-check.py",
                path.display()
            );
        }
        for c in expected {
            eprintln!(
                "{}: {} at {} bytes: {} of {} hit",
                path.display(),
                c.policy,
                c.budget_bytes,
                c.hits,
                c.lookups
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The route trace at `path` cut to its turns numbered below `turns` (header and notes kept).
fn first_turns(path: &Path, turns: u32) -> String {
    let text = std::fs::read_to_string(path).expect("trace");
    text.lines()
        .filter(|l| {
            l.starts_with('#')
                || l.starts_with("turn,")
                || l.split(',').next().and_then(|t| t.parse::<u32>().ok()) < Some(turns)
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Issue 36's policies, which `sim-check.py` re-implements from docs/policies.md: TinyLFU
/// admission over LRU and over S3-FIFO (the sketch's hash defined there), and next-use.
const ADMISSION_POLICIES: &str = "tinylfu,tinylfu-s3fifo,next-use";

/// One line of `sim-check.py`: its counts and the misses it bypassed.
fn python_counts_with_bypasses(
    py: &str,
    trace: &Path,
    policies: &str,
    per_layer: &str,
) -> Vec<(Count, u64)> {
    let out = Command::new(py)
        .arg(project_root().join("scripts/sim-check.py"))
        .arg(trace)
        .args(["--experts-per-layer", per_layer, "--policy", policies])
        .output()
        .expect("run scripts/sim-check.py");
    assert!(
        out.status.success(),
        "sim-check.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json line");
            let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} in {l}"));
            (
                Count {
                    policy: v["policy"].as_str().expect("policy").to_string(),
                    budget_bytes: n("budget_bytes"),
                    lookups: n("lookups"),
                    hits: n("hits"),
                    misses: n("misses"),
                    evictions: n("evictions"),
                    rereads: n("rereads"),
                },
                n("bypasses"),
            )
        })
        .collect()
}

/// `tinylfu`, `tinylfu-s3fifo` and `next-use` (`shared/src/policy/`), run by the core's cache on
/// the cache-only path, count exactly what `sim-check.py`'s own implementations of their
/// written rules count — hits, misses, evictions, re-reads and bypassed misses — on both real
/// traces at five budgets each (Mixtral whole, the first 8 DeepSeek prompts: the script is the
/// slow side), and so does the full-timing replay at one budget per trace and policy (through
/// `bmoe-sim replay`'s own `sim:` line on Mixtral, whose budgets are whole MiB).
#[test]
fn tinylfu_and_next_use_counts_and_bypasses_agree_with_the_independent_python_count() {
    let Some(py) = python3() else {
        return;
    };
    let dir = bmoe_gates::scratch_dir("recount-admission");
    let mut traces: Vec<(PathBuf, &str, bool)> = Vec::new();
    for (name, per_layer, turns) in [
        ("traces/mixtral-8x7b-humaneval.route.csv", "2,3,4,5,6", None),
        (
            "traces/deepseek-v2-lite-puffin.route.csv",
            "6,12,16,24,32",
            Some(8),
        ),
    ] {
        let Some(path) = shared_path(name) else {
            return;
        };
        let path = match turns {
            None => path,
            Some(t) => {
                let sliced = dir.join(format!("first-{t}-turns.route.csv"));
                std::fs::write(&sliced, first_turns(&path, t)).expect("slice");
                sliced
            }
        };
        traces.push((path, per_layer, turns.is_none()));
    }
    // The script is the slow side: one process per trace and policy, all at once.
    let started = std::time::Instant::now();
    let expected: Vec<Vec<(Count, u64)>> = std::thread::scope(|s| {
        let runs: Vec<Vec<_>> = traces
            .iter()
            .map(|(path, per_layer, _)| {
                ADMISSION_POLICIES
                    .split(',')
                    .map(|policy| {
                        s.spawn(move || python_counts_with_bypasses(py, path, policy, per_layer))
                    })
                    .collect()
            })
            .collect();
        runs.into_iter()
            .map(|per_policy| {
                per_policy
                    .into_iter()
                    .flat_map(|r| r.join().expect("sim-check.py thread"))
                    .collect()
            })
            .collect()
    });
    eprintln!("sim-check.py: {:.1} s", started.elapsed().as_secs_f64());
    for ((path, _, whole_mib), expected) in traces.iter().zip(&expected) {
        let n_policies = ADMISSION_POLICIES.split(',').count();
        assert_eq!(expected.len(), 5 * n_policies, "{}", path.display());
        let trace = std::sync::Arc::new(bmoe_sim::cli::load_trace(path).expect("trace"));
        let layout = layout_from_preamble(&trace.preamble).expect("layout");
        let plan = ReplayPlan::new(&trace).expect("plan");
        let seq = AccessSeq::new(&trace, &plan, 0);
        let k = trace.preamble.n_expert_used as u16;
        let counts =
            |c: &bmoe_core::CacheCounters| (c.hits, c.misses, c.evictions, c.rereads, c.bypasses);
        for (want, bypasses) in expected {
            let policy = bmoe_core::policy::by_name(&want.policy).expect("registered policy");
            let fast = bmoe_sim::cache_only::run(&layout, &seq, want.budget_bytes, k, policy)
                .expect("cache-only");
            assert_eq!(
                counts(&fast.counters),
                (
                    want.hits,
                    want.misses,
                    want.evictions,
                    want.rereads,
                    *bypasses
                ),
                "{} {} at {} bytes: bmoe-sim vs sim-check.py",
                path.display(),
                want.policy,
                want.budget_bytes
            );
            assert_eq!(fast.counters.hits + fast.counters.misses, want.lookups);
            if want.policy.starts_with("tinylfu") {
                assert!(*bypasses > 0, "{} bypasses nothing", want.policy);
            } else {
                assert_eq!(*bypasses, 0, "{} cannot bypass", want.policy);
            }
            let lru = bmoe_sim::cache_only::run(
                &layout,
                &seq,
                want.budget_bytes,
                k,
                bmoe_core::policy::by_name("lru").expect("lru"),
            )
            .expect("lru cache-only");
            eprintln!(
                "{}: {} at {} bytes: {} of {} hit, {} bypassed (lru: {} hit)",
                path.display(),
                want.policy,
                want.budget_bytes,
                want.hits,
                want.lookups,
                bypasses,
                lru.counters.hits
            );
        }
        // The full-timing replay at the middle budget, for every policy.
        for policy in ADMISSION_POLICIES.split(',') {
            let (want, bypasses) = expected
                .iter()
                .filter(|(c, _)| c.policy == policy)
                .nth(2)
                .expect("a middle budget");
            let box_policy = bmoe_core::policy::by_name(policy).expect("registered policy");
            let full = full_replay_with(&trace, want.budget_bytes, true, box_policy);
            assert_eq!(
                counts(&full),
                (
                    want.hits,
                    want.misses,
                    want.evictions,
                    want.rereads,
                    *bypasses
                ),
                "{} {policy}: full-timing replay vs sim-check.py",
                path.display()
            );
            if *whole_mib && want.budget_bytes % MIB == 0 {
                let kv = replay_sim_line(&[
                    "--trace".into(),
                    path.display().to_string(),
                    "--cache-mb".into(),
                    (want.budget_bytes / MIB).to_string(),
                    "--eviction".into(),
                    policy.into(),
                ]);
                let filters = policy.starts_with("tinylfu");
                assert_eq!(
                    kv.iter().any(|(k, _)| k == "bypasses"),
                    filters,
                    "the sim: line carries bypasses= exactly for a filtering policy: {kv:?}"
                );
                let line_bypasses = if filters { get(&kv, "bypasses") } else { 0 };
                assert_eq!(
                    (
                        get(&kv, "hits"),
                        get(&kv, "misses"),
                        get(&kv, "evictions"),
                        line_bypasses
                    ),
                    (want.hits, want.misses, want.evictions, *bypasses),
                    "bmoe-sim replay --eviction {policy}"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `next-use-hazard` (`shared/src/policy/next_use_hazard.rs`), run by the core's cache on the
/// cache-only path, counts exactly what `sim-check.py`'s own implementation of its written rule
/// counts — the hazard table learned from the trace's router weights (Mixtral) or from missed
/// visits alone (DeepSeek, `nan` weights) — on both real traces at five budgets each (Mixtral
/// whole, the first 8 DeepSeek prompts), and so does the full-timing replay at the middle
/// budget. One script process per trace, both at once: about 10 s on two cores.
#[test]
fn next_use_hazard_counts_agree_with_the_independent_python_count() {
    const POLICY: &str = "next-use-hazard";
    let Some(py) = python3() else {
        return;
    };
    let dir = bmoe_gates::scratch_dir("recount-hazard");
    let mut traces: Vec<(PathBuf, &str)> = Vec::new();
    for (name, per_layer, turns) in [
        ("traces/mixtral-8x7b-humaneval.route.csv", "2,3,4,5,6", None),
        (
            "traces/deepseek-v2-lite-puffin.route.csv",
            "6,12,16,24,32",
            Some(8),
        ),
    ] {
        let Some(path) = shared_path(name) else {
            return;
        };
        let path = match turns {
            None => path,
            Some(t) => {
                let sliced = dir.join(format!("first-{t}-turns.route.csv"));
                std::fs::write(&sliced, first_turns(&path, t)).expect("slice");
                sliced
            }
        };
        traces.push((path, per_layer));
    }
    let started = std::time::Instant::now();
    let expected: Vec<Vec<(Count, u64)>> = std::thread::scope(|s| {
        let runs: Vec<_> = traces
            .iter()
            .map(|(path, per_layer)| {
                s.spawn(move || python_counts_with_bypasses(py, path, POLICY, per_layer))
            })
            .collect();
        runs.into_iter()
            .map(|r| r.join().expect("sim-check.py thread"))
            .collect()
    });
    eprintln!("sim-check.py: {:.1} s", started.elapsed().as_secs_f64());
    for ((path, _), expected) in traces.iter().zip(&expected) {
        assert_eq!(expected.len(), 5, "{}", path.display());
        let trace = std::sync::Arc::new(bmoe_sim::cli::load_trace(path).expect("trace"));
        let layout = layout_from_preamble(&trace.preamble).expect("layout");
        let plan = ReplayPlan::new(&trace).expect("plan");
        let seq = AccessSeq::new(&trace, &plan, 0);
        let k = trace.preamble.n_expert_used as u16;
        let counts =
            |c: &bmoe_core::CacheCounters| (c.hits, c.misses, c.evictions, c.rereads, c.bypasses);
        for (want, bypasses) in expected {
            assert_eq!(want.policy, POLICY);
            assert_eq!(*bypasses, 0, "{POLICY} cannot bypass");
            let run = |name: &str| {
                let policy = bmoe_core::policy::by_name(name).expect("registered policy");
                bmoe_sim::cache_only::run(&layout, &seq, want.budget_bytes, k, policy)
                    .expect("cache-only")
                    .counters
            };
            let fast = run(POLICY);
            assert_eq!(
                counts(&fast),
                (want.hits, want.misses, want.evictions, want.rereads, 0),
                "{} {POLICY} at {} bytes: bmoe-sim vs sim-check.py",
                path.display(),
                want.budget_bytes
            );
            assert_eq!(fast.hits + fast.misses, want.lookups);
            eprintln!(
                "{}: {POLICY} at {} bytes: {} of {} hit (next-use: {}, lru: {})",
                path.display(),
                want.budget_bytes,
                want.hits,
                want.lookups,
                run("next-use").hits,
                run("lru").hits
            );
        }
        let (want, _) = &expected[2];
        let full = full_replay_with(
            &trace,
            want.budget_bytes,
            true,
            bmoe_core::policy::by_name(POLICY).expect("registered policy"),
        );
        assert_eq!(
            counts(&full),
            (want.hits, want.misses, want.evictions, want.rereads, 0),
            "{} {POLICY}: full-timing replay vs sim-check.py",
            path.display()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A policy that records every event the cache sends it (context included) over LRU's
/// decisions, so two paths through the core can be held to the same conversation.
struct Recorder {
    inner: bmoe_core::policy::Lru,
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Recorder {
    fn note(&self, event: String) {
        self.log.lock().expect("log").push(event);
    }
}

impl bmoe_core::policy::EvictionPolicy for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }
    fn init(&mut self, layout: &bmoe_core::ExpertLayout) {
        self.inner.init(layout);
    }
    fn on_insert(&mut self, index: u32) {
        self.note(format!("insert {index}"));
        self.inner.on_insert(index);
    }
    fn on_hit(&mut self, index: u32) {
        self.note(format!("hit {index}"));
        self.inner.on_hit(index);
    }
    fn on_remove(&mut self, index: u32) {
        self.note(format!("remove {index}"));
        self.inner.on_remove(index);
    }
    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        self.inner.victim(is_evictable)
    }
    fn on_capacity(&mut self, c: &bmoe_core::policy::CacheCapacity) {
        self.note(format!("capacity {c:?}"));
    }
    fn on_step_begin(&mut self, step: &bmoe_core::policy::StepContext) {
        self.note(format!("step {step:?}"));
    }
    fn on_layer_begin(&mut self, moe_layer: u16) {
        self.note(format!("layer {moe_layer}"));
    }
    fn on_access(&mut self, index: u32, resident: bool, a: &bmoe_core::policy::AccessContext) {
        self.note(format!(
            "access {index} {resident} uses={} rank={} sum={:x} max={:x}",
            a.uses,
            a.top_rank,
            a.weight_sum.to_bits(),
            a.weight_max.to_bits()
        ));
    }
    fn filters_admission(&self) -> bool {
        true
    }
    fn admit(
        &mut self,
        index: u32,
        victim: Option<u32>,
        a: &bmoe_core::policy::AccessContext,
    ) -> bool {
        self.note(format!(
            "admit {index} {victim:?} uses={} sum={:x}",
            a.uses,
            a.weight_sum.to_bits()
        ));
        // Bypass every third admission that would evict: the bypass path on both sides.
        !(victim.is_some() && index.is_multiple_of(3))
    }
}

/// The policy hears the same conversation — capacity, step and layer boundaries, every
/// lookup's routing (rows, rank, router weights bit for bit), every admission question with
/// its would-be victim, every insert, hit and removal — on the cache-only path as in the
/// full-timing replay (serial and overlap), on both real traces (Mixtral carries router
/// weights, DeepSeek `nan`) and with a top-k override (which renormalises the weights), so a
/// policy tried on the fast path is the policy the engine runs.
#[test]
fn the_policy_hears_the_same_context_on_the_cache_only_path_and_the_full_replay() {
    for (name, per_layer, turns, k_override) in [
        ("traces/mixtral-8x7b-humaneval.route.csv", 3u64, None, 0u16),
        ("traces/mixtral-8x7b-humaneval.route.csv", 3, None, 1),
        (
            "traces/deepseek-v2-lite-puffin.route.csv",
            12,
            Some(3u32),
            0,
        ),
    ] {
        let Some(path) = shared_path(name) else {
            return;
        };
        let text;
        let trace = match turns {
            None => bmoe_sim::cli::load_trace(&path).expect("trace"),
            Some(t) => {
                text = first_turns(&path, t);
                bmoe_core::telemetry::route_trace::RouteTrace::parse(&text).expect("trace")
            }
        };
        let trace = std::sync::Arc::new(trace);
        let layout = layout_from_preamble(&trace.preamble).expect("layout");
        let plan = ReplayPlan::new(&trace).expect("plan");
        let k = if k_override > 0 {
            k_override
        } else {
            trace.preamble.n_expert_used as u16
        };
        let seq = AccessSeq::new(&trace, &plan, k_override);
        let budget = per_layer * u64::from(layout.n_moe_layers()) * layout.max_expert_bytes();
        let recorder = || {
            let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let policy = Box::new(Recorder {
                inner: bmoe_core::policy::Lru::new(),
                log: log.clone(),
            });
            (policy, log)
        };
        let (policy, fast_log) = recorder();
        let fast = bmoe_sim::cache_only::run(&layout, &seq, budget, k, policy).expect("cache-only");
        let fast_log = std::mem::take(&mut *fast_log.lock().expect("log"));
        assert!(fast.counters.bypasses > 0, "{name}: the bypass path ran");
        assert!(fast_log.iter().any(|e| e.starts_with("step ")));
        for overlap in [false, true] {
            let (policy, full_log) = recorder();
            let layout_full = layout_from_preamble(&trace.preamble).expect("layout");
            let plan_full = std::sync::Arc::new(ReplayPlan::new(&trace).expect("plan"));
            let cfg = bmoe_core::config::RunConfig {
                moe_stream: true,
                overlap,
                n_expert_used: u32::from(k),
                n_expert_used_override: u32::from(k_override),
                ..Default::default()
            };
            let profile = bmoe_sim::DeviceProfile::load("ufs40-phone").expect("profile");
            let r = bmoe_sim::replay::run(
                bmoe_sim::replay::ReplaySetup {
                    trace: trace.clone(),
                    plan: plan_full,
                    layout: &layout_full,
                    cfg: &cfg,
                    budget_bytes: budget,
                    policy,
                    profile: &profile,
                    seed: 0,
                },
                bmoe_sim::replay::ReplayOutputs::default(),
            )
            .expect("replay");
            let full_log = std::mem::take(&mut *full_log.lock().expect("log"));
            assert_eq!(r.cache, fast.counters, "{name} k {k}: counters");
            assert_eq!(full_log.len(), fast_log.len(), "{name} k {k}: event count");
            if let Some(i) = (0..full_log.len()).find(|&i| full_log[i] != fast_log[i]) {
                panic!(
                    "{name} k {k} overlap {overlap}: event {i} differs: full replay {:?}, cache-only {:?}",
                    full_log[i], fast_log[i]
                );
            }
        }
        eprintln!(
            "{name} k {k}: {} events agree, {} bypasses",
            fast_log.len(),
            fast.counters.bypasses
        );
    }
}
