//! The one-pass miss-ratio curve (`bmoe_sim::mrc`) against the core's cache replayed once per
//! budget (`cache_only::run`, policy `lru`) at **every** budget of both real traces in
//! `../shared/traces` (skipped with a message when absent, a failure under CI=true): the cache
//! off, then every whole number of experts from the floor (top-k of the widest layer) to one
//! past the whole bank. Every expert of these traces has the same size, and every step of the
//! curve starts on a whole number of experts, so those budgets cover every byte budget.

mod common;
use bmoe_core::policy::Lru;
use bmoe_sim::plan::{layout_from_preamble, AccessSeq, ReplayPlan};
use common::shared_trace;

fn every_budget_agrees(name: &str) {
    let Some(path) = shared_trace(name) else {
        return;
    };
    let t0 = std::time::Instant::now();
    let text = std::fs::read_to_string(&path).expect("trace");
    let trace = bmoe_core::telemetry::route_trace::RouteTrace::parse(&text).expect("parses");
    let layout = layout_from_preamble(&trace.preamble).expect("layout");
    let plan = ReplayPlan::new(&trace).expect("plan");
    let seq = AccessSeq::new(&trace, &plan, 0);
    let k = trace.preamble.n_expert_used as u16;
    let one = std::time::Instant::now();
    let curve = bmoe_sim::mrc::compute(&layout, &seq, k).expect("curve");
    let one = one.elapsed();
    let expert = layout.max_expert_bytes();
    assert!(
        (0..layout.n_moe_layers()).all(|m| layout.expert_bytes(m) == expert),
        "{name}: experts of one size"
    );
    assert!(
        curve.steps.iter().all(|s| s.from_bytes % expert == 0),
        "{name}: a step off a whole expert"
    );
    let n_keys = u64::from(layout.n_keys());
    let first = curve.floor_bytes / expert;
    let budgets: Vec<u64> = std::iter::once(0)
        .chain((first..=n_keys + 1).map(|c| c * expert))
        .collect();
    for &b in &budgets {
        let want = bmoe_sim::cache_only::run(&layout, &seq, b, k, Box::new(Lru::new()))
            .unwrap_or_else(|e| panic!("{name}: replay at {b}: {e}"));
        let got = curve
            .at(b)
            .unwrap_or_else(|e| panic!("{name}: curve at {b}: {e}"));
        assert_eq!(
            got,
            want,
            "{name}: budget {b} bytes ({} experts)",
            b / expert
        );
    }
    // Below the floor the curve refuses what the cache refuses.
    assert!(curve.at(curve.floor_bytes - 1).is_err());
    assert!(bmoe_sim::cache_only::run(
        &layout,
        &seq,
        curve.floor_bytes - 1,
        k,
        Box::new(Lru::new())
    )
    .is_err());
    eprintln!(
        "{name}: {} lookups, {} budgets agree; one pass {:.1} ms, whole test {:.2} s; {} lookups \
         not inclusive",
        curve.lookups,
        budgets.len(),
        one.as_secs_f64() * 1e3,
        t0.elapsed().as_secs_f64(),
        curve.non_inclusive
    );
}

#[test]
fn the_one_pass_curve_equals_the_replay_at_every_budget_on_mixtral() {
    every_budget_agrees("mixtral-8x7b-humaneval.route.csv");
}

#[test]
fn the_one_pass_curve_equals_the_replay_at_every_budget_on_deepseek() {
    every_budget_agrees("deepseek-v2-lite-puffin.route.csv");
}

/// A small trace that exercises what the real ones do not: layers of different expert sizes
/// (the second's experts twice the first's) and a prefill of 5 positions, whose union of
/// experts is wider than the small budgets (admission in waves); then decode steps.
fn synthetic_trace(turns: u32) -> String {
    let mut t = String::from(
        "# route_trace v1\n# model=synthetic arch=test n_layer=3 n_expert=4 n_expert_used=2\n\
         # layer=1 expert_bytes=4096 dense_bytes=0\n# layer=2 expert_bytes=8192 dense_bytes=0\n\
         turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped\n",
    );
    for turn in 0..turns {
        let mut row = |phase: u32, step: u32, layer: u32, pick: [u32; 2]| {
            for (slot, e) in pick.iter().enumerate() {
                t.push_str(&format!(
                    "{turn},{phase},{step},{layer},{slot},{e},0.5,0,0,0\n"
                ));
            }
        };
        for step in 0..5 {
            for layer in 1..=2 {
                let a = (step + layer + turn) % 4;
                row(0, step, layer, [a, (a + 1 + step % 2) % 4]);
            }
        }
        for step in 5..25 {
            for layer in 1..=2 {
                let a = (step * 3 + layer * turn) % 4;
                let b = (a + 1 + (step / 3) % 3) % 4;
                row(1, step, layer, [a, b]);
            }
        }
    }
    t
}

fn golden(name: &str, actual: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("dir")).expect("golden dir");
        std::fs::write(&path, actual).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reading {} ({e}); run with UPDATE_GOLDEN=1 to create it",
            path.display()
        )
    });
    assert_eq!(
        expected, actual,
        "{name} differs from its golden file (UPDATE_GOLDEN=1 regenerates it; review the diff)"
    );
}

#[test]
fn mrc_lists_and_writes_what_the_replay_counts_at_every_listed_budget() {
    let dir = common::scratch("mrc-cli");
    let trace = dir.join("synthetic.route.csv");
    std::fs::write(&trace, synthetic_trace(3)).expect("trace");
    let t = trace.display().to_string();
    let csv = dir.join("mrc.csv");
    let stem = dir.join("plots/mrc");
    std::fs::create_dir_all(dir.join("plots")).expect("plots dir");
    let (code, out, err) = common::sim(&[
        "mrc",
        "--trace",
        &t,
        "--turns",
        "2",
        "--points",
        "all",
        "--csv",
        &csv.display().to_string(),
        "--plot",
        &stem.display().to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("2 of 3 turns"), "{out}");
    assert!(
        out.contains(&format!("mrc: wrote {}", csv.display())),
        "{out}"
    );
    for ext in ["svg", "png"] {
        assert!(dir.join(format!("plots/mrc.{ext}")).exists(), "{ext}");
    }
    // The listing (the first line carries timings) and the CSV, byte for byte.
    let listing: String = out.lines().skip(1).map(|l| format!("{l}\n")).collect();
    let listing = listing
        .replace(&csv.display().to_string(), "MRC.csv")
        .replace(&dir.join("plots").display().to_string(), "PLOTS");
    golden("mrc_stdout.txt", &listing);
    let table = std::fs::read_to_string(&csv).expect("csv");
    golden("mrc.csv", &table);

    // Every row is what the core's cache counts at that budget over the same two turns.
    let text = common::slice(&synthetic_trace(3), 2);
    let parsed = bmoe_core::telemetry::route_trace::RouteTrace::parse(&text).expect("parses");
    let layout = layout_from_preamble(&parsed.preamble).expect("layout");
    let plan = ReplayPlan::new(&parsed).expect("plan");
    let seq = AccessSeq::new(&parsed, &plan, 0);
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |n: &str| header.iter().position(|h| *h == n).expect(n);
    let mut rows = 0;
    for line in lines {
        let f: Vec<&str> = line.split(',').collect();
        let n = |name: &str| -> u64 { f[col(name)].parse().expect(name) };
        let r =
            bmoe_sim::cache_only::run(&layout, &seq, n("budget_bytes"), 2, Box::new(Lru::new()))
                .expect("replay");
        let c = r.counters;
        assert_eq!(
            [
                n("hits"),
                n("misses"),
                n("evictions"),
                n("rereads"),
                n("inserts")
            ],
            [c.hits, c.misses, c.evictions, c.rereads, c.inserts],
            "{line}"
        );
        assert_eq!(
            [n("miss_bytes"), n("resident_bytes")],
            [r.miss_bytes, r.resident_bytes]
        );
        rows += 1;
    }
    let curve = bmoe_sim::mrc::compute(&layout, &seq, 2).expect("curve");
    assert_eq!(
        rows,
        curve.steps.len() + 1,
        "the cache off, then every step"
    );
}

#[test]
fn mrc_refuses_bad_input_by_name() {
    let dir = common::scratch("mrc-bad");
    let trace = dir.join("t.route.csv");
    std::fs::write(&trace, synthetic_trace(1)).expect("trace");
    let t = trace.display().to_string();
    let (code, _, err) = common::sim(&["mrc", "--trace", &t, "--turns", "0"]);
    assert_eq!(code, 1);
    assert!(err.contains("--turns: 0 turns leave nothing"), "{err}");
    let missing = dir.join("none.route.csv").display().to_string();
    let (code, _, err) = common::sim(&["mrc", "--trace", &missing]);
    assert_eq!(code, 1);
    assert!(err.contains("none.route.csv"), "{err}");
    let (code, _, err) = common::sim(&["mrc", "--trace", &t, "--points", "some"]);
    assert_eq!(code, 2, "{err}");
    let (code, out, _) = common::sim(&["mrc", "--help"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("one pass") && out.contains("--points"),
        "{out}"
    );
}
