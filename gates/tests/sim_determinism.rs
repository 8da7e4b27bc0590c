//! Gate: the simulator is deterministic. Two replays with the same inputs and seed write
//! byte-identical CSV, route trace, io trace and report; a different seed changes nothing
//! while jitter is off, and with jitter on changes only the modelled times — never a count,
//! a byte or a hit rate.
//!
//! The trace is synthetic (written here through the core's route-trace writer) so the gate
//! runs without `../shared`: two turns, each a prefill batch (whose last MoE layer routes only
//! the final token) and decode steps, over odd projection offsets so O_DIRECT alignment
//! matters, replayed under `--overlap` on a jittery profile.

use bmoe_core::records::{Phase, RouteRecord};
use bmoe_core::telemetry::route_trace::{ProjExtent, RoutePreamble, RouteTraceWriter, TraceLayer};
use bmoe_core::telemetry::MetricsCsv;
use bmoe_core::testing::splitmix64;
use std::path::{Path, PathBuf};

fn temp_dir(name: &str) -> PathBuf {
    bmoe_gates::scratch_dir(name)
}

const N_EXPERT: u32 = 16;
const K: usize = 4;

/// A two-turn trace: 3 MoE layers (model layers 1..=3 of 4), 16 experts, top-4.
fn write_trace(path: &Path) {
    let layers: Vec<TraceLayer> = (1..=3u32)
        .map(|l| {
            let base = 4096 * 1000 * u64::from(l) + 512 * u64::from(l);
            let proj = [20_000u64, 20_000, 24_000]
                .iter()
                .scan(base, |at, &stride| {
                    let e = ProjExtent {
                        shard: 0,
                        offset: *at,
                        stride,
                    };
                    *at += stride * u64::from(N_EXPERT) + 100;
                    Some(e)
                })
                .collect::<Vec<_>>();
            TraceLayer {
                layer: l,
                expert_bytes: 64_000,
                dense_bytes: 500_000,
                proj,
            }
        })
        .collect();
    let pre = RoutePreamble {
        model: "synthetic.gguf".into(),
        arch: "qwen3moe".into(),
        n_layer: 4,
        n_expert: N_EXPERT,
        n_expert_used: K as u32,
        gating: bmoe_core::Gating::default(),
        layers,
        notes: vec![],
        extra: vec![],
    };
    let file = std::fs::File::create(path).expect("trace file");
    let mut w = RouteTraceWriter::new(std::io::BufWriter::new(file), &pre).expect("writer");
    let mut s = 7u64;
    let mut route =
        |turn: u32, phase: Phase, step: i64, layer: u32, w: &mut RouteTraceWriter<_>| {
            let mut ids: Vec<u32> = Vec::new();
            while ids.len() < K {
                s = splitmix64(s);
                let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                let e = (u * u * f64::from(N_EXPERT)) as u32;
                if !ids.contains(&e) {
                    ids.push(e);
                }
            }
            for (slot, &e) in ids.iter().enumerate() {
                w.write(&RouteRecord {
                    turn,
                    phase,
                    step,
                    layer,
                    slot: slot as u32,
                    expert: e,
                    weight: 0.4 / (slot as f32 + 1.0),
                    residency: 0,
                    expert_bytes: 64_000,
                    dropped: false,
                    preds: Default::default(),
                    row: 0,
                    router_expert: None,
                })
                .expect("row");
            }
        };
    let mut pos = 0i64;
    for turn in 0..2u32 {
        let prompt = 6;
        for p in 0..prompt {
            for layer in 0..3u32 {
                if layer == 2 && p + 1 != prompt {
                    continue; // the last MoE layer routes only the final prompt token
                }
                route(turn, Phase::Prefill, pos + p, layer, &mut w);
            }
        }
        pos += prompt;
        for _ in 0..40 {
            for layer in 0..3u32 {
                route(turn, Phase::Decode, pos, layer, &mut w);
            }
            pos += 1;
        }
    }
    w.finish().expect("finish");
}

struct Run {
    stdout: String,
    csv: String,
    route: String,
    io: String,
}

fn replay(dir: &Path, tag: &str, trace: &Path, extra: &[&str]) -> Run {
    let csv = dir.join(format!("{tag}.csv"));
    let route = dir.join(format!("{tag}.route.csv"));
    let io = dir.join(format!("{tag}.io.csv"));
    let mut argv: Vec<String> = [
        "bmoe-sim",
        "replay",
        "--trace",
        &trace.display().to_string(),
        "--profile",
        "ufs40-phone",
        "--cache-mb",
        "1",
        "--force-cache",
        "--overlap",
        "--io-threads",
        "3",
        "--progress",
        "--csv",
        &csv.display().to_string(),
        "--route-trace",
        &route.display().to_string(),
        "--io-trace",
        &io.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    argv.extend(extra.iter().map(|s| s.to_string()));
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(argv, &[], &mut out, &mut err);
    assert_eq!(code, 0, "{}", String::from_utf8_lossy(&err));
    let read = |p: &Path| std::fs::read_to_string(p).expect("output file");
    Run {
        stdout: String::from_utf8(out).expect("utf8"),
        csv: read(&csv),
        route: read(&route),
        io: read(&io),
    }
}

fn column(csv: &str, name: &str) -> Vec<f64> {
    MetricsCsv::parse(csv)
        .expect("csv parses")
        .column_values(name)
        .expect("column")
}

#[test]
fn same_inputs_and_seed_give_identical_bytes_and_seeds_move_only_jittered_times() {
    let dir = temp_dir("sim-determinism");
    let trace = dir.join("trace.csv");
    write_trace(&trace);

    let a = replay(&dir, "a", &trace, &["--seed", "11", "--jitter", "0.2"]);
    let b = replay(&dir, "b", &trace, &["--seed", "11", "--jitter", "0.2"]);
    // Plain `assert!`s: on failure the files are long, and the tag says which differed.
    assert!(a.stdout == b.stdout, "report and progress lines differ");
    assert!(a.csv == b.csv, "csv differs");
    assert!(a.route == b.route, "route trace differs");
    assert!(a.io == b.io, "io trace differs");
    assert!(
        a.stdout.contains("BMOE_PROGRESS"),
        "progress lines were asked for"
    );
    assert_eq!(
        MetricsCsv::parse(&a.csv).expect("csv").summaries.len(),
        2,
        "one trailer per turn"
    );

    // Without jitter the seed has nothing to move.
    let c = replay(&dir, "c", &trace, &["--seed", "1", "--jitter", "0"]);
    let d = replay(&dir, "d", &trace, &["--seed", "2", "--jitter", "0"]);
    assert!(
        c.csv.replace("seed=1", "seed=2") == d.csv,
        "csv differs without jitter"
    );
    assert!(c.route == d.route, "route trace differs without jitter");
    assert!(c.io == d.io, "io trace differs without jitter");

    // With jitter a different seed changes the times and nothing else.
    let e = replay(&dir, "e", &trace, &["--seed", "3", "--jitter", "0.2"]);
    assert_ne!(a.csv, e.csv, "jitter with another seed must move some time");
    assert_ne!(column(&a.csv, "wall_ms"), column(&e.csv, "wall_ms"));
    for exact in ["read_bytes", "cache_hit_pct", "step", "turn"] {
        assert_eq!(column(&a.csv, exact), column(&e.csv, exact), "{exact}");
    }
    assert!(
        a.route == e.route,
        "routing and residency do not depend on time"
    );
    // Under overlap io rows come in completion order, which is a matter of time: the same
    // reads, maybe in another order, with other latencies.
    let reads = |io: &str| -> Vec<String> {
        let mut v: Vec<String> = io
            .lines()
            .map(|l| l.rsplit_once(',').map_or(l, |(head, _)| head).to_string())
            .collect();
        v.sort();
        v
    };
    assert!(reads(&a.io) == reads(&e.io), "same reads, other latencies");
    let _ = std::fs::remove_dir_all(&dir);
}
