//! Gate: the simulator replays the expert predictors from what a route trace recorded, and
//! refuses — naming the flag to record with — what it cannot replay.
//!
//! The stale-gate (`--predict-log`, `--predict-prefetch`) and route-ahead (`--route-ahead N`)
//! predictors apply a router to hidden states the simulator does not have, so the engine
//! records their predictions in the route trace (`pred<h>` / `pred<h>_weight`, `router_expert`)
//! and `bmoe-sim replay` plays them back.
//!
//! The first group runs on synthetic traces written here through the core's writer, so it runs
//! anywhere. The last group records with the engine (`bmoe-cli --predict-log` etc. on the tiny
//! synthetic model) and replays through `bmoe-sim`; it needs the engine side of the predictors
//! (the `pred` branch) and is ignored until that is merged.

use bmoe_core::records::{Phase, RouteRecord, PRED_HORIZON_MAX};
use bmoe_core::telemetry::route_trace::{
    PredColumns, RoutePreamble, RouteTrace, RouteTraceWriter, TraceLayer,
};
use bmoe_core::telemetry::MetricsCsv;
use std::path::{Path, PathBuf};

const N_EXPERT: u32 = 16;
const K: usize = 4;
const N_LAYERS: u32 = 3;
const PREFILL_TOKENS: i64 = 5;
const DECODE_STEPS: i64 = 30;

fn scratch(name: &str) -> PathBuf {
    bmoe_gates::scratch_dir(&format!("sim-predictors-{name}"))
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// K distinct experts drawn from `seed`, skewed toward low ids (so a cache can hit).
fn draw(seed: u64) -> Vec<u16> {
    let mut ids = Vec::with_capacity(K);
    let mut s = seed;
    while ids.len() < K {
        s = mix(s);
        let u = (s >> 11) as f64 / (1u64 << 53) as f64;
        let e = (u * u * f64::from(N_EXPERT)) as u16;
        if !ids.contains(&e) {
            ids.push(e);
        }
    }
    ids
}

fn router(step: i64, layer: u32) -> Vec<u16> {
    draw(1000 * step as u64 + u64::from(layer))
}

/// The stale-gate prediction of (step, layer) at horizon h: the router's first `K − h`
/// choices, then `h` experts it did not choose (good predictions, worse with the horizon).
fn predicted(step: i64, layer: u32, h: u8) -> Vec<u16> {
    let own = router(step, layer);
    let mut ids: Vec<u16> = own[..K.saturating_sub(usize::from(h))].to_vec();
    let mut x = 7_000_000 + 1000 * step as u64 + 10 * u64::from(layer) + u64::from(h);
    while ids.len() < K {
        x = mix(x);
        let e = (x % u64::from(N_EXPERT)) as u16;
        if !ids.contains(&e) && !own.contains(&e) {
            ids.push(e);
        }
    }
    ids
}

const WEIGHTS: [f32; K] = [0.5, 0.25, 0.125, 0.125];

/// A one-turn trace (a prefill of 5 tokens, 30 decode steps, 3 MoE layers of 16 experts,
/// top-4) with `columns`' prediction columns filled where the engine fills them: decode only,
/// from the second decode token, at layers >= the horizon; with `route_ahead = N` those cells
/// of layers >= N committed to the horizon-N prediction.
fn write_trace(path: &Path, columns: PredColumns) {
    let pre = RoutePreamble {
        model: "synthetic.gguf".into(),
        arch: "qwen3moe".into(),
        n_layer: N_LAYERS,
        n_expert: N_EXPERT,
        n_expert_used: K as u32,
        gating: bmoe_core::Gating::default(),
        layers: (0..N_LAYERS)
            .map(|layer| TraceLayer {
                layer,
                expert_bytes: 64_000,
                dense_bytes: 500_000,
                proj: vec![],
            })
            .collect(),
        notes: vec![],
        extra: vec![],
    };
    let file = std::fs::File::create(path).expect("trace file");
    let mut w = RouteTraceWriter::with_predictions(std::io::BufWriter::new(file), &pre, columns)
        .expect("writer");
    for step in 0..PREFILL_TOKENS + DECODE_STEPS {
        let phase = if step < PREFILL_TOKENS {
            Phase::Prefill
        } else {
            Phase::Decode
        };
        let predicting = phase == Phase::Decode && step > PREFILL_TOKENS;
        for layer in 0..N_LAYERS {
            let own = router(step, layer);
            let committed =
                predicting && columns.route_ahead > 0 && layer >= u32::from(columns.route_ahead);
            let routing = if committed {
                predicted(step, layer, columns.route_ahead)
            } else {
                own.clone()
            };
            for slot in 0..K {
                let mut preds = [None; PRED_HORIZON_MAX];
                for h in 1..=columns.horizons {
                    if predicting && layer >= u32::from(h) {
                        preds[usize::from(h) - 1] =
                            Some((predicted(step, layer, h)[slot], WEIGHTS[slot]));
                    }
                }
                w.write(&RouteRecord {
                    turn: 0,
                    phase,
                    step,
                    layer,
                    slot: slot as u32,
                    expert: u32::from(routing[slot]),
                    weight: WEIGHTS[slot],
                    residency: 0,
                    expert_bytes: 0,
                    dropped: false,
                    preds,
                    row: 0,
                    router_expert: committed.then_some(u32::from(own[slot])),
                })
                .expect("row");
            }
        }
    }
    w.finish().expect("flush");
}

fn sim(args: &[&str]) -> (i32, String, String) {
    let mut argv = vec!["bmoe-sim"];
    argv.extend_from_slice(args);
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(argv, &[], &mut out, &mut err);
    (
        code,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

fn read_trace(path: &Path) -> RouteTrace {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    RouteTrace::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

const CACHE: [&str; 3] = ["--cache-mb", "1", "--force-cache"];

/// `bmoe-sim replay --trace TRACE [--route-trace OUT] FLAGS… --cache-mb 1 --force-cache`.
fn replay(trace: &Path, out: Option<&Path>, flags: &[&str]) -> (i32, String, String) {
    let (t, o) = (s(trace), out.map(s));
    let mut args = vec!["replay", "--trace", t.as_str()];
    if let Some(o) = &o {
        args.extend(["--route-trace", o.as_str()]);
    }
    args.extend_from_slice(flags);
    args.extend_from_slice(&CACHE);
    sim(&args)
}

#[test]
fn a_trace_without_predictions_refuses_each_predictor_naming_the_recording_flag() {
    let dir = scratch("plain");
    let trace = dir.join("plain.route.csv");
    write_trace(&trace, PredColumns::NONE);
    for (flags, flag, record) in [
        (vec!["--predict-log"], "--predict-log", "--predict-log"),
        (
            vec!["--predict-prefetch"],
            "--predict-prefetch",
            "--predict-log",
        ),
        (
            vec!["--route-ahead", "2"],
            "--route-ahead 2",
            "--route-ahead 2",
        ),
    ] {
        let (code, _, err) = replay(&trace, None, &flags);
        assert_eq!(code, 1, "{flags:?}: {err}");
        assert!(
            err.contains(&format!("{flag} cannot be replayed from this trace")),
            "{flags:?}: {err}"
        );
        assert!(
            err.contains(&format!("bmoe-cli ... --route-trace T.csv {record}")),
            "{flags:?} must name how to record: {err}"
        );
    }
    // The previous-token predictor needs nothing but the routing.
    let (code, _, err) = replay(&trace, None, &["--prefetch", "1"]);
    assert_eq!(code, 0, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn recorded_predictions_replay_and_travel_into_the_replayed_trace() {
    let dir = scratch("recorded");
    let trace = dir.join("pred.route.csv");
    let columns = PredColumns {
        horizons: 2,
        route_ahead: 0,
    };
    write_trace(&trace, columns);
    let input = read_trace(&trace);
    for flag in ["--predict-log", "--predict-prefetch"] {
        let out = dir.join(format!("{}.route.csv", flag.trim_start_matches('-')));
        let (code, stdout, err) = replay(&trace, Some(&out), &[flag]);
        assert_eq!(code, 0, "{flag}: {err}");
        assert!(stdout.contains("moe-cache:"), "{flag}: {stdout}");
        let replayed = read_trace(&out);
        assert_eq!(replayed.pred_columns(), columns, "{flag}");
        // The same routing, with the recorded predictions on every row.
        let strip = |r: RouteRecord| (r.turn, r.step, r.layer, r.slot, r.expert, r.preds);
        let a: Vec<_> = input.records().map(strip).collect();
        let b: Vec<_> = replayed.records().map(strip).collect();
        assert_eq!(a, b, "{flag}");
        assert!(b.iter().any(|r| r.5[1].is_some()), "horizon 2 recorded");
    }
    // --route-ahead 3 needs pred3.
    let (code, _, err) = replay(&trace, None, &["--route-ahead", "3"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--route-ahead 3 cannot be replayed"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn route_ahead_from_pred_columns_replays_the_committed_routing() {
    let dir = scratch("commit");
    let trace = dir.join("pred.route.csv");
    write_trace(
        &trace,
        PredColumns {
            horizons: 2,
            route_ahead: 0,
        },
    );
    let out = dir.join("ra2.route.csv");
    let (code, _, err) = replay(&trace, Some(&out), &["--route-ahead", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("WARNING: --route-ahead 2 replayed from the trace's pred2 predictions"),
        "the approximation is said: {err}"
    );
    let replayed = read_trace(&out);
    assert_eq!(replayed.pred_columns().route_ahead, 2);
    assert!(replayed.has_router_expert_column());
    let mut committed = 0;
    for r in replayed.records() {
        let own = router(r.step, r.layer);
        if r.phase == Phase::Decode && r.step > PREFILL_TOKENS && r.layer >= 2 {
            committed += 1;
            assert_eq!(
                r.expert,
                u32::from(predicted(r.step, r.layer, 2)[r.slot as usize]),
                "the streamed routing is the prediction"
            );
            assert_eq!(r.router_expert, Some(u32::from(own[r.slot as usize])));
            // The router's weight where it chose the same expert, nan where it did not.
            match own.iter().position(|&e| u32::from(e) == r.expert) {
                Some(i) => assert_eq!(r.weight, WEIGHTS[i]),
                None => assert!(r.weight.is_nan(), "{r:?}"),
            }
        } else {
            assert_eq!(r.expert, u32::from(own[r.slot as usize]), "passed through");
            assert_eq!(r.router_expert, None);
        }
    }
    assert_eq!(committed, (DECODE_STEPS as usize - 1) * K);

    // Replaying that committed trace at its own depth reproduces it exactly.
    let again = dir.join("ra2-again.route.csv");
    let (code, _, err) = replay(&out, Some(&again), &["--route-ahead", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("WARNING: --route-ahead"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&out).expect("first"),
        std::fs::read_to_string(&again).expect("second")
    );
    // But not at another depth.
    let (code, _, err) = replay(&out, None, &["--route-ahead", "1"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("recorded with --route-ahead 2"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_engine_route_ahead_trace_replays_as_recorded() {
    let dir = scratch("engine-ra");
    let trace = dir.join("ra1.route.csv");
    write_trace(
        &trace,
        PredColumns {
            horizons: 0,
            route_ahead: 1,
        },
    );
    let out = dir.join("replayed.route.csv");
    let (code, _, err) = replay(&trace, Some(&out), &["--route-ahead", "1"]);
    assert_eq!(code, 0, "{err}");
    let key = |r: RouteRecord| (r.step, r.layer, r.slot, r.expert, r.router_expert);
    let a: Vec<_> = read_trace(&trace).records().map(key).collect();
    let b: Vec<_> = read_trace(&out).records().map(key).collect();
    assert_eq!(a, b);
    // Without the flag it replays the committed routing and says so.
    let (code, _, err) = replay(&trace, None, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("recorded with --route-ahead 1"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- Engine-recorded traces (need the engine side of the predictors) ----

const PROMPT: &str = "Once upon a time there was a little fox who lived by the river";

fn engine(model: &Path, flags: &[&str]) -> bmoe_gates::Run {
    let mut args = vec!["-p", PROMPT, "-n", "32", "-t", "2", "--moe-stream"];
    args.extend_from_slice(flags);
    let r = bmoe_gates::run(model, &args);
    assert_eq!(r.code, 0, "{flags:?}: {}", r.stderr);
    r
}

fn summary_u64(csv: &Path, key: &str) -> u64 {
    let text = std::fs::read_to_string(csv).expect("csv");
    let m = MetricsCsv::parse(&text).expect("csv parses");
    m.summary()
        .and_then(|s| s.get(key).and_then(|v| v.parse().ok()))
        .unwrap_or_else(|| panic!("{}: no summary key {key}", csv.display()))
}

#[test]
fn an_engine_predict_log_trace_replays_predict_prefetch() {
    let dir = scratch("engine-log");
    let model = bmoe_gates::tiny();
    let trace = dir.join("log.route.csv");
    let t = s(&trace);
    engine(
        &model,
        &[
            "--cache-mb",
            "2",
            "--force-cache",
            "--route-trace",
            &t,
            "--predict-log",
        ],
    );
    let recorded = read_trace(&trace);
    assert_eq!(
        recorded.pred_columns().horizons,
        2,
        "--predict-log records horizons 1 and 2"
    );
    assert!(
        recorded.any_pred(1) && recorded.any_pred(2),
        "and fills them"
    );
    let csv = dir.join("sim.csv");
    let c = s(&csv);
    let (code, out, err) = sim(&[
        "replay",
        "--trace",
        &t,
        "--profile",
        "this-machine",
        "--cache-mb",
        "2",
        "--force-cache",
        "--predict-prefetch",
        "--csv",
        &c,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("moe-prefetch:") && out.contains("[stale-gate]"),
        "{out}"
    );
    assert!(
        summary_u64(&csv, "spec_experts") > 0,
        "the replayed stale-gate predictor speculated"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The report lines a predictor adds, without their timing line (`moe-route-ahead:`'s second
/// line is CPU time, which the simulator does not model).
fn predictor_lines(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter(|l| {
            l.starts_with("moe-predict:")
                || l.starts_with("moe-prefetch:")
                || l.starts_with("moe-cache:")
                || (l.starts_with("moe-route-ahead:") && l.contains("committed"))
        })
        .collect()
}

/// The exactness promise for predictors: an engine run with the predictor on, replayed with
/// the same flags, gives the same hits, misses, bytes, route trace and predictor report
/// lines. `--prefetch-sync` makes speculation independent of timing (each speculative read is
/// waited for where it is issued), as the engine's own predictor gates do.
#[test]
fn engine_predictor_runs_replay_exactly() {
    let dir = scratch("engine-exact");
    let model = bmoe_gates::tiny();
    for (tag, flags) in [
        ("log", vec!["--predict-log"]),
        ("pp", vec!["--predict-prefetch", "--prefetch-sync"]),
        ("ra1", vec!["--route-ahead", "1", "--prefetch-sync"]),
        (
            "ra2",
            vec!["--route-ahead", "2", "--prefetch-sync", "--overlap"],
        ),
    ] {
        let (trace, csv, sim_csv, sim_trace) = (
            dir.join(format!("{tag}.route.csv")),
            dir.join(format!("{tag}.csv")),
            dir.join(format!("{tag}.sim.csv")),
            dir.join(format!("{tag}.sim.route.csv")),
        );
        let (t, c, sc, st) = (s(&trace), s(&csv), s(&sim_csv), s(&sim_trace));
        let mut e = vec![
            "--cache-mb",
            "2",
            "--force-cache",
            "--route-trace",
            &t,
            "--csv",
            &c,
        ];
        e.extend_from_slice(&flags);
        let measured = engine(&model, &e);
        let mut args = vec![
            "replay",
            "--trace",
            &t,
            "--profile",
            "this-machine",
            "--cache-mb",
            "2",
            "--force-cache",
            "--csv",
            &sc,
            "--route-trace",
            &st,
        ];
        args.extend_from_slice(&flags);
        let (code, out, err) = sim(&args);
        assert_eq!(code, 0, "{tag}: {err}");
        assert!(
            std::fs::read_to_string(&trace).expect("engine trace")
                == std::fs::read_to_string(&sim_trace).expect("sim trace"),
            "{tag}: the replayed route trace (routing, residency, bytes, predictions) is the engine's"
        );
        // The engine prints its report where the CLI does (stderr or stdout); the sim on stdout.
        let report = format!("{}{}", measured.stdout, measured.stderr);
        let (want, got) = (predictor_lines(&report), predictor_lines(&out));
        let marker = match tag {
            "log" => "moe-predict:",
            "pp" => "moe-prefetch:",
            _ => "moe-route-ahead:",
        };
        assert!(
            want.iter().any(|l| l.starts_with(marker)),
            "{tag}: no {marker} line in {report}"
        );
        assert_eq!(want, got, "{tag}: predictor report lines");
        for key in [
            "read_MiB",
            "cache_hit_pct",
            "evictions",
            "spec_experts",
            "spec_useful",
        ] {
            let get = |p: &Path| {
                let m = MetricsCsv::parse(&std::fs::read_to_string(p).expect("csv")).expect("csv");
                m.summary().and_then(|s| s.get(key).map(str::to_string))
            };
            assert_eq!(get(&csv), get(&sim_csv), "{tag}: {key}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn sim_hits(stdout: &str) -> u64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("sim: "))
        .unwrap_or_else(|| panic!("no sim: line in {stdout}"));
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix("hits="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no hits= in {line}"))
}

#[test]
fn sweep_compares_predictors_with_the_counts_replay_gives() {
    let dir = scratch("sweep");
    let trace = dir.join("pred.route.csv");
    write_trace(
        &trace,
        PredColumns {
            horizons: 2,
            route_ahead: 0,
        },
    );
    let out_dir = dir.join("sweep");
    let (t, o) = (s(&trace), s(&out_dir));
    let (code, stdout, err) = sim(&[
        "sweep",
        "--trace",
        &t,
        "--budgets-mb",
        "1",
        "--policies",
        "lru,belady",
        "--lanes",
        "2",
        "--overlap",
        "off",
        "--predictors",
        "none,prefetch:1,predict-prefetch,route-ahead:2",
        "--out",
        &o,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        stdout.contains("sweep: route-ahead:2: bmoe-sim: WARNING: --route-ahead 2 replayed"),
        "{stdout}"
    );
    let table = std::fs::read_to_string(out_dir.join("sweep.csv")).expect("sweep.csv");
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).expect(name);
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    let cells: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r[col("predictor")], r[col("policy")]))
        .collect();
    assert_eq!(
        cells,
        vec![
            ("none", "lru"),
            ("none", "belady"),
            ("prefetch:1", "lru"),
            ("predict-prefetch", "lru"),
            ("route-ahead:2", "lru"),
        ],
        "one grid per predictor; Belady only without one"
    );
    // Each predictor's row has the counts a replay with its flag gives.
    assert_eq!(rows[0][col("budget_bytes")], (1u64 << 20).to_string());
    for (row, flags) in rows.iter().zip([
        vec![],
        vec![],
        vec!["--prefetch", "1"],
        vec!["--predict-prefetch"],
        vec!["--route-ahead", "2"],
    ]) {
        if row[col("policy")] == "belady" {
            continue;
        }
        let mut args = vec![
            "replay",
            "--trace",
            &t,
            "--cache-mb",
            "1",
            "--force-cache",
            "--io-threads",
            "2",
        ];
        args.extend_from_slice(&flags);
        let (code, stdout, err) = sim(&args);
        assert_eq!(code, 0, "{flags:?}: {err}");
        assert_eq!(
            row[col("hits")].parse::<u64>().expect("hits"),
            sim_hits(&stdout),
            "{flags:?}"
        );
    }
    assert_ne!(
        rows[0][col("hits")],
        rows[4][col("hits")],
        "route-ahead replays another routing"
    );
    // A predictor the trace cannot support stops the sweep, naming the recording flag.
    let plain = dir.join("plain.route.csv");
    write_trace(&plain, PredColumns::NONE);
    let p = s(&plain);
    let (code, _, err) = sim(&[
        "sweep",
        "--trace",
        &p,
        "--experts-per-layer",
        "6",
        "--predictors",
        "none,predict-prefetch",
        "--out",
        &o,
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("--predict-prefetch cannot be replayed"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
