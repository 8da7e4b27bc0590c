//! `--routing-from` (issue 20): a synthetic model of a real trace's routing shape, made to route
//! as the recorded model did, really reads and computes every expert — and its hits, misses,
//! evictions, re-reads and read bytes equal `bmoe-sim replay` of the same recorded trace at the
//! same budget, re-priced with the engine's file layout (`--layout-from`). Tiny shapes of the
//! DeepSeek-V2-Lite and Mixtral-8x7B captures in ../shared/traces.

use bmoe_engine::testdata::shared_path;
use bmoe_gates::{model, run, scratch_dir, sim};
use clap::Parser;
use std::path::Path;

/// `key=value` from a space-separated line.
fn field(line: &str, key: &str) -> u64 {
    let want = format!("{key}=");
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(want.as_str()))
        .unwrap_or_else(|| panic!("no {key}= in {line}"))
        .parse()
        .unwrap_or_else(|e| panic!("{key} in {line}: {e}"))
}

/// Column `name` of every data row of a bmoe CSV file (comment lines skipped).
fn column(path: &Path, name: &str) -> Vec<u64> {
    let text = std::fs::read_to_string(path).expect("read the CSV");
    let mut lines = text.lines().filter(|l| !l.starts_with('#'));
    let header: Vec<&str> = lines.next().expect("a header").split(',').collect();
    let at = header
        .iter()
        .position(|h| *h == name)
        .unwrap_or_else(|| panic!("no column {name} in {}", path.display()));
    lines
        .map(|l| {
            l.split(',')
                .nth(at)
                .expect("a full row")
                .parse()
                .expect("a number")
        })
        .collect()
}

fn engine_equals_replay(trace_rel: &str, key: &str, gen: &[&str], n_tokens: u64) {
    let Some(trace) = shared_path(trace_rel) else {
        return;
    };
    let m = model(key, gen);
    let dir = scratch_dir("routing-from");
    let (route, io, csv) = (
        dir.join(format!("{key}.route.csv")),
        dir.join(format!("{key}.io.csv")),
        dir.join(format!("{key}.csv")),
    );
    let s = |p: &Path| p.to_str().expect("utf-8 path").to_string();
    // A one-token prompt: every step routes one token, as the capture's decode steps did. The
    // engine's first step is still a prefill, whose `auto` read split reads extents whole where
    // the replay's decode step splits them per lane: one split for both keeps bytes exact.
    let r = run(
        &m,
        &[
            "-p",
            "The",
            "-n",
            "4000",
            "-c",
            "4096",
            "--moe-stream",
            "--cache-mb",
            "20",
            "--force-cache",
            "--read-split",
            "lanes",
            "--routing-from",
            &s(&trace),
            "--route-trace",
            &s(&route),
            "--io-trace",
            &s(&io),
            "--csv",
            &s(&csv),
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("routing follows"), "{}", r.stderr);
    let residency = column(&route, "residency");
    assert_eq!(
        residency.len() as u64,
        n_tokens * {
            let t = bmoe_core::telemetry::route_trace::RouteTrace::parse(
                &std::fs::read_to_string(&trace).unwrap(),
            )
            .unwrap();
            u64::from(t.preamble.n_expert_used) * t.preamble.layers.len() as u64
        },
        "every token of the trace was routed once per MoE layer"
    );
    let hits = residency.iter().filter(|&&r| r != 0).count() as u64;
    let misses = residency.len() as u64 - hits;
    let read_bytes: u64 = column(&io, "read_bytes").iter().sum();
    let text = std::fs::read_to_string(&csv).unwrap();
    let summary = text
        .lines()
        .find(|l| l.starts_with("# summary"))
        .expect("a # summary line");
    assert!(text.contains(&format!("routing_from={}", s(&trace))));

    // The engine's streaming settings, for every replay of its trace below.
    let stream = [
        "--moe-stream",
        "--cache-mb",
        "20",
        "--force-cache",
        "--read-split",
        "lanes",
    ];
    let (t, r) = (s(&trace), s(&route));
    let (code, out, err) =
        sim(&[&["replay", "--trace", &t, "--layout-from", &r][..], &stream].concat());
    assert_eq!(code, 0, "{err}");
    let line = out
        .lines()
        .chain(err.lines())
        .find(|l| l.starts_with("sim:"))
        .unwrap_or_else(|| panic!("no sim: line in {out}{err}"));
    assert_eq!(field(line, "steps"), n_tokens, "{line}");
    assert_eq!(
        (field(line, "hits"), field(line, "misses")),
        (hits, misses),
        "{line}"
    );
    assert!(
        hits > 0 && misses > 0,
        "a budget that both hits and misses: {line}"
    );
    assert_eq!(
        field(line, "evictions"),
        field(summary, "evictions"),
        "{line}"
    );
    assert_eq!(field(line, "rereads"), field(summary, "rereads"), "{line}");
    assert_eq!(field(line, "read_bytes"), read_bytes, "{line}");

    // `inspect --layout-out` states the layout the run used without running it: the same
    // `# layer=` lines, and `whatif --model` with it (same routing shape: no mapping) prices the
    // trace as the replay above did, byte for byte past its inputs statement.
    let layout = dir.join(format!("{key}.layout.csv"));
    let cli = bmoe_engine::cli::Cli::try_parse_from([
        "bmoe-cli",
        "inspect",
        &s(&m),
        "--layout-out",
        &s(&layout),
    ])
    .expect("inspect arguments parse");
    match cli.cmd {
        Some(bmoe_engine::cli::Cmd::Inspect(a)) => bmoe_engine::cli::inspect(a).expect("inspect"),
        _ => panic!("not an inspect command"),
    }
    let layer_lines = |p: &Path| -> Vec<String> {
        std::fs::read_to_string(p)
            .expect("read")
            .lines()
            .filter(|l| l.starts_with("# layer="))
            .map(str::to_string)
            .collect()
    };
    assert!(!layer_lines(&route).is_empty());
    assert_eq!(layer_lines(&layout), layer_lines(&route));
    let (code, whatif, err) = sim(&[
        &[
            "whatif",
            "--trace",
            &t,
            "--model",
            &s(&layout),
            "--device",
            "origin-12gb-phone",
        ][..],
        &stream,
    ]
    .concat());
    assert_eq!(code, 0, "{err}");
    assert!(whatif.contains("whatif: mapping   none"), "{whatif}");
    let report: Vec<&str> = whatif
        .lines()
        .filter(|l| !l.starts_with("whatif:"))
        .collect();
    assert_eq!(report, out.lines().collect::<Vec<_>>());
}

#[test]
fn deepseek_routing_drives_the_engine_as_the_simulator_replays_it() {
    engine_equals_replay(
        "traces/deepseek-v2-lite-puffin.route.csv",
        "deepseek-tiny",
        // deepseek2 as V2-Lite is: a dense first layer and 26 MoE layers (tiny-odd: no query
        // LoRA, which llama.cpp's reading of a 27-layer file as V2-Lite requires).
        &[
            "--arch",
            "deepseek2",
            "--preset",
            "tiny-odd",
            "--layers",
            "27",
            "--experts",
            "64",
            "--top-k",
            "6",
            "--expert-ffn",
            "64",
            "--seed",
            "5",
        ],
        804,
    );
}

#[test]
fn mixtral_routing_drives_the_engine_as_the_simulator_replays_it() {
    engine_equals_replay(
        "traces/mixtral-8x7b-humaneval.route.csv",
        "mixtral-tiny",
        &[
            "--arch",
            "llama",
            "--preset",
            "tiny",
            "--layers",
            "32",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--seed",
            "5",
        ],
        333,
    );
}

#[test]
fn a_trace_of_another_routing_shape_is_refused_by_name() {
    let Some(trace) = shared_path("traces/deepseek-v2-lite-puffin.route.csv") else {
        return;
    };
    let m = bmoe_gates::tiny();
    let argv = [
        "bmoe-cli",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "The",
        "--routing-from",
        trace.to_str().unwrap(),
    ];
    let cli = <bmoe_engine::cli::Cli as clap::Parser>::try_parse_from(argv).unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let e = bmoe_engine::run::generate_with(&cli.run, &m, &mut out, &mut err)
        .expect_err("a 4-layer model cannot follow a 26-layer trace");
    let msg = format!("{e:#}");
    assert!(msg.contains("--routing-from"), "{msg}");
    assert!(
        msg.contains("number of MoE layers is 26, the model's is 4"),
        "{msg}"
    );
}
