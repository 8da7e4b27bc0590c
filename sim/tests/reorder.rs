//! `bmoe-sim sweep --placements`, the reordering study, through the binary's entry point: on a
//! trace whose experts co-activate in known pairs the counts are what a hand count says; on
//! the DeepSeek-V2-Lite capture (`../shared/traces`; skipped with a message when absent, a
//! failure under CI=true) merging never adds requests, every placement sees the same misses,
//! and a parallel study writes the bytes a serial one does.

mod common;
use common::{scratch, shared_trace, sim, slice};
use std::collections::BTreeMap;
use std::path::Path;

const STRIDE: u64 = 65_536;

/// One MoE layer of 8 experts, top-2, three stacked projections of `STRIDE` bytes per expert;
/// `turns` turns of `steps` decode steps, each routing the pair {i, i + 4} with i from a
/// fixed LCG — experts 4 apart always co-activate, adjacent ids never do.
fn paired_trace(turns: u32, steps: u32) -> String {
    let mut s = String::from(
        "# route_trace v1\n# model=pairs arch=qwen3moe n_layer=2 n_expert=8 n_expert_used=2\n",
    );
    let base = 1u64 << 20;
    let proj: Vec<String> = (0..3)
        .map(|p| format!("0:{}:{STRIDE}", base + p * 8 * STRIDE))
        .collect();
    s.push_str(&format!(
        "# layer=1 expert_bytes={} dense_bytes=4096 proj={}\n",
        3 * STRIDE,
        proj.join(",")
    ));
    s.push_str("turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped\n");
    let mut x: u32 = 12_345;
    for turn in 0..turns {
        for step in 0..steps {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let i = (x >> 16) % 4;
            for (slot, e) in [i, i + 4].into_iter().enumerate() {
                s.push_str(&format!(
                    "{turn},1,{step},1,{slot},{e},0.5,0,{},0\n",
                    3 * STRIDE
                ));
            }
        }
    }
    s
}

/// placement.csv as (policy, placement) → (requests_per_token, kib_per_request,
/// misses_per_token), for one budget.
fn read_csv(path: &Path, budget_mib: &str) -> BTreeMap<(String, String), (f64, f64, f64)> {
    let text = std::fs::read_to_string(path).expect("placement.csv");
    let mut lines = text.lines();
    let head: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |name: &str| head.iter().position(|h| *h == name).expect(name);
    let (b, pol, pl, req, kib, mis) = (
        col("budget_mib"),
        col("policy"),
        col("placement"),
        col("requests_per_token"),
        col("kib_per_request"),
        col("misses_per_token"),
    );
    lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|f| f[b] == budget_mib)
        .map(|f| {
            (
                (f[pol].to_string(), f[pl].to_string()),
                (
                    f[req].parse().expect("requests"),
                    f[kib].parse().expect("kib"),
                    f[mis].parse().expect("misses"),
                ),
            )
        })
        .collect()
}

/// `bmoe-sim sweep` of `trace` into `out` on one lane without overlap or bootstrap, with
/// `extra` flags (budgets, policies, placements, jobs).
fn sweep(trace: &Path, out: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "sweep",
        "--trace",
        trace.to_str().expect("utf-8"),
        "--lanes",
        "1",
        "--overlap",
        "off",
        "--bootstrap",
        "0",
        "--out",
        out.to_str().expect("utf-8"),
    ];
    args.extend_from_slice(extra);
    sim(&args)
}

#[test]
fn paired_experts_halve_the_requests_when_placed_side_by_side() {
    let dir = scratch("reorder-pairs");
    let trace = dir.join("pairs.csv");
    std::fs::write(&trace, paired_trace(4, 40)).expect("trace");
    let out = dir.join("sweep");
    let (code, stdout, stderr) = sweep(
        &trace,
        &out,
        &[
            "--budgets-mb",
            "0",
            "--policies",
            "lru",
            "--placements",
            "separate,file,coact,coact-in-sample",
        ],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("fitted on the decode steps of the first 2 of 4 turns"),
        "{stdout}"
    );
    let rows = read_csv(&out.join("placement.csv"), "0.0");
    let get = |p: &str| rows[&("lru".to_string(), p.to_string())];
    // Cache off: both experts of every token miss. Separately: 2 experts x 3 projections.
    assert_eq!(get("separate"), (6.0, 64.0, 2.0));
    // The file's order never puts a pair side by side: merging finds nothing.
    assert_eq!(get("file"), (6.0, 64.0, 2.0));
    // The fitted placement does: one 128 KiB request per projection.
    assert_eq!(get("coact"), (3.0, 128.0, 2.0));
    assert_eq!(get("coact-in-sample"), (3.0, 128.0, 2.0));
    let md = std::fs::read_to_string(out.join("placement.md")).expect("placement.md");
    assert!(md.contains("| coact | 3.00 | 128 |"), "{md}");
}

#[test]
fn one_decode_step_cannot_be_split() {
    let dir = scratch("reorder-short");
    let trace = dir.join("short.csv");
    std::fs::write(&trace, paired_trace(1, 1)).expect("trace");
    let (code, stdout, stderr) = sweep(
        &trace,
        &dir.join("sweep"),
        &[
            "--budgets-mb",
            "0",
            "--policies",
            "lru",
            "--placements",
            "coact",
        ],
    );
    assert_ne!(code, 0, "{stdout}");
    assert!(
        stderr.contains("--placements") && stderr.contains("1 decode step"),
        "{stderr}"
    );
    let (code, _, stderr) = sim(&[
        "sweep",
        "--trace",
        trace.to_str().expect("utf-8"),
        "--placements",
        "shuffled",
    ]);
    assert_ne!(code, 0);
    assert!(stderr.contains("'shuffled' is not"), "{stderr}");
}

#[test]
fn deepseek_merging_never_adds_requests_and_parallel_equals_serial() {
    let Some(path) = shared_trace("deepseek-v2-lite-puffin.route.csv") else {
        return;
    };
    let dir = scratch("reorder-deepseek");
    let text = std::fs::read_to_string(&path).expect("trace");
    let trace = dir.join("ds.csv");
    std::fs::write(&trace, slice(&text, 10)).expect("slice");
    let run = |jobs: &str, name: &str| {
        let out = dir.join(name);
        let (code, stdout, stderr) = sweep(
            &trace,
            &out,
            &[
                "--experts-per-layer",
                "6,12,24",
                "--policies",
                "lru,lfu",
                "--jobs",
                jobs,
                "--placements",
                "separate,file,coact,coact-in-sample",
            ],
        );
        assert_eq!(code, 0, "{stdout}{stderr}");
        out
    };
    let serial = run("1", "serial");
    let parallel = run("2", "parallel");
    for f in ["placement.csv", "placement.md"] {
        assert_eq!(
            std::fs::read(serial.join(f)).expect("serial"),
            std::fs::read(parallel.join(f)).expect("parallel"),
            "{f}"
        );
    }
    let text = std::fs::read_to_string(serial.join("placement.csv")).expect("csv");
    let budgets: Vec<String> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().expect("budget").to_string())
        .collect();
    assert_eq!(budgets.len(), 3 * 2 * 4);
    for b in &budgets {
        let rows = read_csv(&serial.join("placement.csv"), b);
        for policy in ["lru", "lfu"] {
            let get = |p: &str| rows[&(policy.to_string(), p.to_string())];
            let (sep, file, coact) = (get("separate"), get("file"), get("coact"));
            assert!(sep.2 > 0.0, "budget {b} {policy} misses something");
            assert_eq!(sep.2, file.2);
            assert_eq!(sep.2, coact.2);
            assert!(
                file.0 <= sep.0 && coact.0 <= sep.0,
                "{b} {policy}: {rows:?}"
            );
        }
    }
}
