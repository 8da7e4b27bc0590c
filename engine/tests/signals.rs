//! A signal mid-generation (issue 14): the real `bmoe-cli` binary is started with `--csv`,
//! `--route-trace` and `--io-trace`, signalled once its CSV holds a few rows, and must stop at
//! a token boundary with whole files — exit 130, every CSV row and a `# summary` saying
//! `interrupted=1` over exactly those rows, traces ending on a whole step — that our own
//! `bmoe-sim replay` and `bmoe-sim diff --exact-only` accept. A SIGKILL, which nothing can
//! handle, still leaves only whole rows up to its last newline (rows are flushed per token).

use bmoe_core::telemetry::io_trace::parse_io_trace;
use bmoe_core::telemetry::route_trace::RouteTrace;
use bmoe_core::telemetry::MetricsCsv;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_bmoe-cli");
const N_PREDICT: u32 = 4000;

/// A scratch directory on the project's filesystem (O_DIRECT needs a real one; /tmp may be
/// tmpfs).
fn scratch() -> PathBuf {
    bmoe_engine::testdata::scratch_dir("signals")
}

fn gen_tiny(path: &Path) {
    let st = Command::new(BIN)
        .args(["gen", "--preset", "tiny", "--quiet", "-o"])
        .arg(path)
        .status()
        .expect("run bmoe-cli gen");
    assert!(st.success(), "gen failed");
}

struct Files {
    csv: PathBuf,
    route: PathBuf,
    io: PathBuf,
    err: PathBuf,
}

fn start(model: &Path, dir: &Path, tag: &str) -> (Child, Files) {
    let f = Files {
        csv: dir.join(format!("{tag}.csv")),
        route: dir.join(format!("{tag}.route.csv")),
        io: dir.join(format!("{tag}.io.csv")),
        err: dir.join(format!("{tag}.stderr")),
    };
    let child = Command::new(BIN)
        .arg("-m")
        .arg(model)
        .args(["-p", "Once upon a time there was a little fox", "-t", "1"])
        .args(["-n", &N_PREDICT.to_string(), "-c", "4200"])
        .args(["--moe-stream", "--cache-mb", "4", "--force-cache"])
        .arg("--csv")
        .arg(&f.csv)
        .arg("--route-trace")
        .arg(&f.route)
        .arg("--io-trace")
        .arg(&f.io)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&f.err).expect("stderr file"))
        .spawn()
        .expect("spawn bmoe-cli");
    (child, f)
}

fn data_rows(csv: &Path) -> usize {
    std::fs::read_to_string(csv)
        .map(|t| {
            t.lines()
                .filter(|l| l.as_bytes().first().is_some_and(u8::is_ascii_digit))
                .count()
        })
        .unwrap_or(0)
}

/// Wait until the CSV holds `rows` rows, then send `sig`.
fn signal_after_rows(child: &mut Child, csv: &Path, rows: usize, sig: libc::c_int) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while data_rows(csv) < rows {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("bmoe-cli ended ({st}) before writing {rows} rows");
        }
        assert!(Instant::now() < deadline, "no {rows} rows within 120 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    let r = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(r, 0, "kill failed");
}

fn wait(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("bmoe-cli did not stop within 60 s of the signal");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn sim(args: &[String]) -> (i32, String) {
    let mut argv = vec!["bmoe-sim".to_string()];
    argv.extend(args.iter().cloned());
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(argv, &[], &mut out, &mut err);
    (
        code,
        format!(
            "{}{}",
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&err)
        ),
    )
}

#[test]
fn sigint_and_sigterm_stop_at_a_token_boundary_with_whole_files_the_simulator_accepts() {
    let dir = scratch();
    let model = dir.join("tiny.gguf");
    gen_tiny(&model);
    for (sig, tag) in [(libc::SIGINT, "sigint"), (libc::SIGTERM, "sigterm")] {
        let (mut child, f) = start(&model, &dir, tag);
        signal_after_rows(&mut child, &f.csv, 5, sig);
        let st = wait(&mut child);
        let stderr = read(&f.err);
        assert_eq!(st.code(), Some(130), "{tag}: exit status {st}\n{stderr}");
        assert!(stderr.contains("interrupted"), "{tag}: {stderr}");

        // The CSV: whole rows 1..=n, each targeting N_PREDICT, and a trailer over exactly them.
        let text = read(&f.csv);
        assert!(text.ends_with('\n'), "{tag}: the CSV ends mid-line");
        let csv = MetricsCsv::parse(&text).unwrap_or_else(|e| panic!("{tag}: {e}"));
        let n = csv.rows.len();
        assert!(n >= 5, "{tag}: {n} rows");
        assert!(n < N_PREDICT as usize, "{tag}: the run was not stopped");
        for (i, r) in csv.rows.iter().enumerate() {
            assert_eq!(
                (r.step, r.steps),
                (i as u32 + 1, N_PREDICT),
                "{tag}: row {i}"
            );
        }
        let summary = csv.summary().expect("a # summary trailer");
        assert_eq!(summary.get("interrupted"), Some("1"), "{tag}");
        assert_eq!(summary.get("tokens"), Some(n.to_string().as_str()), "{tag}");
        assert!(
            stderr.contains(&format!("after {n} of {N_PREDICT} tokens")),
            "{tag}: {stderr}"
        );

        // The traces end on the last step the CSV reports, whole.
        let route_text = read(&f.route);
        assert!(
            route_text.ends_with('\n'),
            "{tag}: the route trace ends mid-line"
        );
        let route = RouteTrace::parse(&route_text).unwrap_or_else(|e| panic!("{tag}: {e}"));
        let last = route.cells.last().expect("route cells");
        let decode_steps: std::collections::BTreeSet<i64> = route
            .cells
            .iter()
            .filter(|c| c.phase == bmoe_core::records::Phase::Decode)
            .map(|c| c.step)
            .collect();
        assert_eq!(decode_steps.len(), n, "{tag}: one decode step per CSV row");
        let n_layers = route.preamble.layers.len();
        let last_step_cells = route
            .cells
            .iter()
            .filter(|c| (c.turn, c.phase, c.step) == (last.turn, last.phase, last.step))
            .count();
        assert_eq!(last_step_cells, n_layers, "{tag}: the last step is cut");
        let io_text = read(&f.io);
        assert!(io_text.ends_with('\n'), "{tag}: the io trace ends mid-line");
        let reads = parse_io_trace(&io_text).unwrap_or_else(|e| panic!("{tag}: {e}"));
        assert!(
            reads.iter().all(|r| r.step <= last.step),
            "{tag}: io past the last step"
        );

        // Our own simulator takes both files as they are.
        let sim_csv = dir.join(format!("{tag}.sim.csv"));
        let mut args: Vec<String> = [
            "replay",
            "--trace",
            f.route.to_str().expect("utf-8"),
            "--profile",
            "this-machine",
            "--cache-mb",
            "4",
            "--force-cache",
            "--csv",
            sim_csv.to_str().expect("utf-8"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if csv.preamble.get("o_direct") == Some("0") {
            args.push("--no-odirect".into());
        }
        let (code, said) = sim(&args);
        assert_eq!(code, 0, "{tag}: bmoe-sim replay refused the trace:\n{said}");
        let (code, said) = sim(&[
            "diff".into(),
            sim_csv.display().to_string(),
            f.csv.display().to_string(),
            "--exact-only".into(),
        ]);
        assert_eq!(code, 0, "{tag}: bmoe-sim diff:\n{said}");
    }

    // SIGKILL: no handler runs, no trailer is written, but every line before the last
    // newline is a whole row (flushed per token), so the prefix parses.
    let (mut child, f) = start(&model, &dir, "sigkill");
    signal_after_rows(&mut child, &f.csv, 5, libc::SIGKILL);
    let st = wait(&mut child);
    assert_eq!(st.code(), None, "killed by a signal");
    let text = read(&f.csv);
    let whole = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    let csv = MetricsCsv::parse(whole).expect("the CSV's whole lines parse");
    assert!(csv.rows.len() >= 5);
    for (i, r) in csv.rows.iter().enumerate() {
        assert_eq!(r.step, i as u32 + 1);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
