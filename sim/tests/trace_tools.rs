//! `bmoe-sim stats` and `bmoe-sim convert` through the binary's entry point, and the one-command
//! researcher workflow on a slice of the real DeepSeek-V2-Lite trace (`../shared/traces`:
//! skipped with a message when absent, a failure under CI=true).

mod common;
use common::{scratch, shared_trace, sim, slice};
use std::path::Path;

#[test]
fn convert_round_trips_a_real_trace_and_refuses_bad_rows() {
    let Some(path) = shared_trace("deepseek-v2-lite-puffin.route.csv") else {
        return;
    };
    let dir = scratch("convert");
    let text = slice(&std::fs::read_to_string(&path).expect("trace"), 3);
    let original = dir.join("original.route.csv");
    std::fs::write(&original, &text).expect("slice");
    let t = bmoe_core::telemetry::route_trace::RouteTrace::parse(&text).expect("parses");
    // The slice as a researcher's long CSV: one row per (prompt, token, layer).
    let mut long = String::from("prompt_id,token_idx,layer,topk_ids\n");
    for step in t.steps() {
        for cell in step.cells {
            let ids: Vec<String> = t
                .cell_slots(cell)
                .iter()
                .map(|s| s.expert.to_string())
                .collect();
            long.push_str(&format!(
                "{},{},{},{}\n",
                step.turn,
                step.step,
                t.preamble.layers[cell.moe_layer as usize].layer,
                ids.join(" ")
            ));
        }
    }
    let capture = dir.join("capture.csv");
    std::fs::write(&capture, long).expect("capture");
    let converted = dir.join("converted.route.csv");
    let (code, out, err) = sim(&[
        "convert",
        &capture.display().to_string(),
        "--expert-bytes",
        "5609472",
        "--n-expert",
        "64",
        "--n-layer",
        "27",
        "--out",
        &converted.display().to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("26 MoE layers x 64 experts, top-6"), "{out}");
    // Replaying either gives the same counts.
    let hits = |p: &Path| {
        let (code, out, err) = sim(&[
            "replay",
            "--trace",
            &p.display().to_string(),
            "--cache-mb",
            "1670",
            "--force-cache",
        ]);
        assert_eq!(code, 0, "{err}");
        out.lines()
            .find(|l| l.starts_with("sim: "))
            .expect("sim line")
            .split_whitespace()
            .filter(|kv| kv.starts_with("hits=") || kv.starts_with("misses="))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(hits(&original), hits(&converted));
    // A bad row names its file, line and what was expected.
    let bad = dir.join("bad.csv");
    std::fs::write(
        &bad,
        "prompt_id,token_idx,layer,topk_ids\n0,0,1,1 2 3 4 5 99\n",
    )
    .expect("bad");
    let (code, _, err) = sim(&[
        "convert",
        &bad.display().to_string(),
        "--expert-bytes",
        "1",
        "--n-expert",
        "64",
        "--out",
        &dir.join("x.csv").display().to_string(),
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("bad.csv") && err.contains("expert id 99 is out of range 0..64"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn one_command_gives_pivot_per_layer_and_intervals_on_deepseek() {
    let Some(path) = shared_trace("deepseek-v2-lite-puffin.route.csv") else {
        return;
    };
    let dir = scratch("deepseek");
    // 12 of the 50 prompts keep CI fast and still allow intervals (≥ 10 turns).
    let trace = dir.join("deepseek-12.route.csv");
    std::fs::write(
        &trace,
        slice(&std::fs::read_to_string(&path).expect("trace"), 12),
    )
    .expect("slice");
    let out = dir.join("sweep");
    let (code, stdout, err) = sim(&[
        "sweep",
        "--trace",
        &trace.display().to_string(),
        "--experts-per-layer",
        "6,12,24",
        "--policies",
        "lru,layer-lru,lecar,belady",
        "--lanes",
        "4",
        "--overlap",
        "on",
        "--x",
        "pct",
        "--out",
        &out.display().to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("sweep: 12 cells"), "{stdout}");
    let pivot = std::fs::read_to_string(out.join("pivot.md")).expect("pivot");
    assert!(pivot.contains("over the trace's 12 turns"), "{pivot}");
    assert!(pivot.contains("| 9.4 % | 18.8 % | 37.5 % |"), "{pivot}");
    assert!(
        pivot.contains("Share of the LRU→Belady headroom"),
        "{pivot}"
    );
    let per_layer = std::fs::read_to_string(out.join("per_layer.md")).expect("per_layer");
    assert!(per_layer.contains("| 26 |"), "{per_layer}");
    let csv = std::fs::read_to_string(out.join("sweep.csv")).expect("csv");
    let header: Vec<&str> = csv.lines().next().expect("header").split(',').collect();
    let lo = header
        .iter()
        .position(|h| *h == "decode_hit_rate_lo")
        .expect("lo");
    assert!(csv
        .lines()
        .skip(1)
        .all(|l| !l.split(',').nth(lo).expect("field").is_empty()));

    let (code, stdout, err) = sim(&[
        "stats",
        "--trace",
        &trace.display().to_string(),
        "--out",
        &dir.join("stats").display().to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        stdout.contains("in 12 turn(s), 26 MoE layers × 64 experts, top-6"),
        "{stdout}"
    );
    for f in [
        "stats.md",
        "popularity.png",
        "reuse.png",
        "overlap.png",
        "working_set.png",
    ] {
        assert!(dir.join("stats").join(f).exists(), "{f}");
    }
    // The reuse curve ends at the layer's size with every non-cold routing a hit.
    let reuse = std::fs::read_to_string(dir.join("stats/reuse.csv")).expect("reuse");
    let last = reuse.lines().nth(64).expect("d = 63");
    assert!(last.starts_with("63,"), "{last}");
    let _ = std::fs::remove_dir_all(&dir);
}
