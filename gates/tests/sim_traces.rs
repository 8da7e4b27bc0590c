//! Exact replay gate over the recorded traces in `traces/` (see `traces/MANIFEST.md`): each
//! engine route trace, replayed with the recording run's budget and flags (read back from its
//! CSV's `# bmoe_metrics v2` preamble), reproduces the measured hits, misses, evictions and
//! read bytes exactly (`bmoe-sim diff --exact-only` against the measured CSV).

use bmoe_core::telemetry::MetricsCsv;
use std::path::PathBuf;

fn sim(args: &[String]) -> (i32, String, String) {
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

#[test]
fn every_recorded_trace_replays_exactly() {
    let dir = bmoe_engine::testdata::project_root().join("traces");
    let mut traces: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("traces/ exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.to_string_lossy().ends_with(".route.csv"))
        .collect();
    traces.sort();
    assert!(
        traces.len() >= 2,
        "traces/ should hold the recorded traces of MANIFEST.md"
    );
    let out = bmoe_gates::scratch_dir("sim-traces");
    for t in traces {
        let measured = PathBuf::from(t.to_string_lossy().replace(".route.csv", ".csv"));
        let text = std::fs::read_to_string(&measured).expect("each trace has its measured CSV");
        let csv = MetricsCsv::parse(&text).expect("measured CSV parses");
        let get = |k: &str| {
            csv.preamble
                .get(k)
                .unwrap_or_else(|| panic!("{}: preamble lacks {k}", measured.display()))
                .to_string()
        };
        let mut args: Vec<String> = vec![
            "replay".into(),
            "--trace".into(),
            t.display().to_string(),
            "--moe-stream".into(),
            "--cache-mb".into(),
            get("cache_mb"),
            "--io-threads".into(),
            get("io_threads"),
        ];
        if get("force_cache") == "1" {
            args.push("--force-cache".into());
        }
        if get("overlap") == "1" {
            args.push("--overlap".into());
        }
        // Traces recorded before `--read-split` existed read every extent whole.
        let split = csv.preamble.get("read_split").unwrap_or("off").to_string();
        args.extend(["--read-split".into(), split]);
        let sim_csv = out.join(format!(
            "{}.sim.csv",
            t.file_name().unwrap().to_string_lossy()
        ));
        args.extend(["--csv".into(), sim_csv.display().to_string()]);
        let (code, _, err) = sim(&args);
        assert_eq!(code, 0, "replay of {} failed: {err}", t.display());
        let (code, out_text, err) = sim(&[
            "diff".into(),
            "--exact-only".into(),
            sim_csv.display().to_string(),
            measured.display().to_string(),
        ]);
        assert_eq!(
            code,
            0,
            "{}: replay differs from the measured run:\n{out_text}\n{err}",
            t.display()
        );
    }
}
