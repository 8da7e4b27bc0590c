//! `--compute-trace` and `--compute-trace-layers` (issue 33 item 3): the contract's
//! `compute_trace v1` file, per op and per layer segment, with and without `--moe-stream` and in
//! session mode; tracing changes no output; `scripts/decode-analyze.py` reads both.

use bmoe_gates::{model, run, scratch_dir, tiny, SessionDriver};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const PROMPT: &str = "The cache of experts keeps what the router asked for";

/// One row: (seq, layer, op, name, wall_ns, majflt).
type Row = (u32, i32, String, String, u64, u64);

/// A parsed trace: the preamble's keys, and per (turn, phase, step) its rows.
struct Trace {
    keys: BTreeMap<String, String>,
    steps: BTreeMap<(u32, u8, u32), Vec<Row>>,
}

fn parse(path: &Path) -> Trace {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("# compute_trace v1"));
    let keys = lines
        .next()
        .unwrap()
        .trim_start_matches("# ")
        .split(' ')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert_eq!(
        lines.next(),
        Some("turn,phase,step,seq,layer,op,name,wall_ns,majflt")
    );
    let mut steps: BTreeMap<_, Vec<_>> = BTreeMap::new();
    for l in lines {
        let c: Vec<&str> = l.split(',').collect();
        assert_eq!(c.len(), 9, "{l}");
        let key = (
            c[0].parse().unwrap(),
            c[1].parse().unwrap(),
            c[2].parse().unwrap(),
        );
        steps.entry(key).or_default().push((
            c[3].parse().unwrap(),
            c[4].parse().unwrap(),
            c[5].to_string(),
            c[6].to_string(),
            c[7].parse().unwrap(),
            c[8].parse().unwrap(),
        ));
    }
    Trace { keys, steps }
}

fn traced(m: &Path, flag: &str, extra: &[&str], name: &str) -> (bmoe_gates::Run, PathBuf) {
    let path = scratch_dir("compute-trace").join(name);
    let mut a = vec![
        "-p",
        PROMPT,
        "-n",
        "6",
        "--ignore-eos",
        flag,
        path.to_str().unwrap(),
    ];
    a.extend_from_slice(extra);
    let r = run(m, &a);
    assert_eq!(r.code, 0, "{}", r.stderr);
    (r, path)
}

#[test]
fn an_op_trace_names_every_op_of_every_step_and_changes_nothing() {
    let m = tiny();
    for (extra, streamed) in [
        (&["--no-moe-stream"][..], false),
        (
            &[
                "--moe-stream",
                "--cache-mb",
                "2",
                "--force-cache",
                "--overlap",
            ],
            true,
        ),
    ] {
        let mut plain_args = vec!["-p", PROMPT, "-n", "6", "--ignore-eos"];
        plain_args.extend_from_slice(extra);
        let plain = run(&m, &plain_args);
        let (r, path) = traced(&m, "--compute-trace", extra, "op.csv");
        assert_eq!(
            r.outcome.tokens, plain.outcome.tokens,
            "tracing changed the output"
        );
        let t = parse(&path);
        assert_eq!(t.keys["arch"], "qwen3moe");
        assert_eq!(t.keys["granularity"], "op");
        assert_eq!(t.keys["n_layer"], "4");
        // One prefill step and six decode steps, each stamped with its first position.
        let phases: Vec<u8> = t.steps.keys().map(|k| k.1).collect();
        assert_eq!(phases, [0, 1, 1, 1, 1, 1, 1]);
        for ((_, phase, _), rows) in &t.steps {
            let seqs: Vec<u32> = rows.iter().map(|r| r.0).collect();
            assert_eq!(seqs, (0..rows.len() as u32).collect::<Vec<_>>());
            assert_eq!((rows[0].1, rows[0].3.as_str()), (-1, "embd"));
            let last = rows.last().unwrap();
            assert_eq!((last.1, last.2.as_str()), (-1, "HEAD"));
            for layer in 0..4 {
                let ops: Vec<&str> = rows
                    .iter()
                    .filter(|r| r.1 == layer)
                    .map(|r| r.2.as_str())
                    .collect();
                for op in ["RMS_NORM", "ATTN", "ROUTER", "MOE", "WAIT", "ADD"] {
                    assert!(
                        ops.contains(&op),
                        "layer {layer} phase {phase}: no {op} in {ops:?}"
                    );
                }
                let attn = format!("attn-{layer}");
                assert!(rows.iter().any(|r| r.3 == attn), "no {attn}");
            }
            // Streamed, each routed expert is its own row (tiny: top-4 of 16 per token).
            let experts = rows.iter().filter(|r| r.2 == "MOE").count();
            if streamed {
                assert!(rows.iter().any(|r| r.3.starts_with("ffn_moe.")));
                if *phase == 1 {
                    assert_eq!(experts, 4 * 4, "one row per routed expert per layer");
                }
            } else {
                assert_eq!(experts, 4, "resident: each layer's experts together");
            }
            assert!(rows.iter().map(|r| r.4).sum::<u64>() > 0);
        }
    }
}

#[test]
fn a_layer_trace_has_one_segment_per_layer() {
    let m = tiny();
    let (_, path) = traced(
        &m,
        "--compute-trace-layers",
        &["--no-moe-stream"],
        "layers.csv",
    );
    let t = parse(&path);
    assert_eq!(t.keys["granularity"], "layers");
    for rows in t.steps.values() {
        let names: Vec<&str> = rows.iter().map(|r| r.3.as_str()).collect();
        assert_eq!(names, ["pre", "blk.0", "blk.1", "blk.2", "blk.3", "post"]);
        assert!(rows.iter().all(|r| r.2 == "LAYER"));
        let layers: Vec<i32> = rows.iter().map(|r| r.1).collect();
        assert_eq!(layers, [-1, 0, 1, 2, 3, -1]);
    }
}

#[test]
fn the_csv_preamble_says_the_run_was_traced() {
    let m = tiny();
    let csv = scratch_dir("compute-trace").join("traced-run.csv");
    let (_, _) = traced(
        &m,
        "--compute-trace-layers",
        &["--no-moe-stream", "--csv", csv.to_str().unwrap()],
        "preamble.csv",
    );
    let text = std::fs::read_to_string(&csv).unwrap();
    assert!(text.contains(" compute_trace_layers=1 "), "{text}");
}

#[test]
fn a_session_appends_each_turn_to_the_trace() {
    let m = tiny();
    let path = scratch_dir("compute-trace").join("session.csv");
    let mut s = SessionDriver::start(
        &m,
        &[
            "-n",
            "3",
            "--ignore-eos",
            "--moe-stream",
            "--cache-mb",
            "2",
            "--force-cache",
            "--compute-trace",
            path.to_str().unwrap(),
        ],
    );
    for id in 1..=2 {
        let (done, _) = s.generate(&format!(
            r#"{{"cmd":"generate","id":{id},"prompt":"hello there","clear_kv":false}}"#
        ));
        assert_eq!(done["tokens"], 3, "{done}");
    }
    let (code, err) = s.close();
    assert_eq!(code, 0, "{err}");
    let t = parse(&path);
    let turns: std::collections::BTreeSet<u32> = t.steps.keys().map(|k| k.0).collect();
    assert_eq!(turns.len(), 2, "{:?}", t.steps.keys().collect::<Vec<_>>());
    // Each turn: a prefill and three decodes.
    assert_eq!(t.steps.len(), 8);
}

#[test]
fn the_two_granularities_exclude_each_other() {
    let m = tiny();
    let argv = [
        "bmoe-cli",
        "-m",
        m.to_str().unwrap(),
        "--compute-trace",
        "/tmp/a.csv",
        "--compute-trace-layers",
        "/tmp/b.csv",
    ];
    let e = bmoe_engine::cli::Cli::parse_argv(argv).expect_err("both accepted");
    assert!(e.to_string().contains("--compute-trace"), "{e}");
}

#[test]
fn decode_analyze_reads_both_granularities() {
    let python = std::process::Command::new("python3")
        .arg("--version")
        .output();
    if python.is_err() {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("python3 is missing under CI");
        }
        eprintln!("skipping: no python3");
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/decode-analyze.py");
    let m = model(
        "ct-gemma4",
        &["--arch", "gemma4", "--preset", "tiny", "--seed", "7"],
    );
    for (flag, needle) in [
        ("--compute-trace", "share by op"),
        ("--compute-trace-layers", "share by segment kind"),
    ] {
        let (_, path) = traced(&m, flag, &["--no-moe-stream"], "analyze.csv");
        let out = std::process::Command::new("python3")
            .arg(&script)
            .args(["compute", path.to_str().unwrap(), "--layers"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains(needle), "{text}");
        assert!(text.contains("granularity"), "{text}");
    }
    // A file that is not a trace: one line naming it, exit 1.
    let bad = scratch_dir("compute-trace").join("bad.csv");
    std::fs::write(&bad, "# io_trace v1\n").unwrap();
    let out = std::process::Command::new("python3")
        .arg(&script)
        .args(["compute", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad.csv"));
}
