//! Issue 14, "tried as a new user would": each case that once destroyed a file, printed
//! garbage with exit 0, or said something unhelpful, with a regression test named after it.

use bmoe_engine::cli::Cli;
use bmoe_engine::gguf::GgufFile;
use bmoe_gates::{run, scratch_dir, sim, tiny};
use clap::Parser;
use std::path::{Path, PathBuf};

/// Run `bmoe-cli -m MODEL <args>` in-process; `Err` carries the message `main` would print
/// after `bmoe: error: `.
fn try_run(model: &Path, args: &[&str]) -> Result<bmoe_gates::Run, String> {
    let mut argv = vec!["bmoe-cli", "-m", model.to_str().unwrap()];
    argv.extend_from_slice(args);
    let cli = Cli::try_parse_from(&argv).map_err(|e| e.to_string())?;
    let (mut o, mut e) = (Vec::new(), Vec::new());
    match bmoe_engine::run::generate_with(&cli.run, model, &mut o, &mut e) {
        Ok(outcome) => Ok(bmoe_gates::Run {
            code: outcome.code,
            stdout: String::from_utf8_lossy(&o).into_owned(),
            stderr: String::from_utf8_lossy(&e).into_owned(),
            outcome,
        }),
        Err(err) => Err(bmoe_core::telemetry::fmt::error_text(err.as_ref())),
    }
}

/// A private copy of the tiny model (tests that may damage it never touch the shared one).
fn copy_of_tiny(name: &str) -> PathBuf {
    let p = scratch_dir("reliability").join(format!("{name}-{}.gguf", std::process::id()));
    std::fs::copy(tiny(), &p).expect("copy the tiny model");
    p
}

#[test]
fn an_output_flag_pointed_at_the_model_is_refused_and_the_model_is_intact() {
    let model = copy_of_tiny("victim");
    let before = std::fs::read(&model).unwrap();
    let m = model.to_str().unwrap();
    for flags in [
        vec!["--csv", m],
        vec!["--logits-out", m],
        vec!["--moe-stream", "--route-trace", m],
        vec!["--moe-stream", "--io-trace", m],
    ] {
        let mut args = vec!["-p", "hi", "-n", "2"];
        args.extend_from_slice(&flags);
        let e = try_run(&model, &args).err().expect("must be refused");
        assert!(
            e.contains("refusing to overwrite an input") && e.contains(flags[flags.len() - 2]),
            "{flags:?}: {e}"
        );
    }
    // Through a symlink too (compared by canonical path and inode).
    let link = model.with_extension("csv");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&model, &link).unwrap();
    let e = try_run(
        &model,
        &["-p", "hi", "-n", "2", "--csv", link.to_str().unwrap()],
    )
    .err()
    .expect("a link to the model is the model");
    assert!(e.contains("refusing to overwrite"), "{e}");
    assert!(
        std::fs::read(&model).unwrap() == before,
        "the model file must be untouched"
    );
}

#[test]
fn two_outputs_on_one_path_are_refused() {
    let d = scratch_dir("reliability");
    let p = d.join(format!("both-{}.csv", std::process::id()));
    let _ = std::fs::remove_file(&p);
    let same = d.join(format!("./both-{}.csv", std::process::id()));
    let e = try_run(
        &tiny(),
        &[
            "-p",
            "hi",
            "-n",
            "2",
            "--moe-stream",
            "--csv",
            p.to_str().unwrap(),
            "--route-trace",
            same.to_str().unwrap(),
        ],
    )
    .err()
    .expect("two outputs on one path");
    assert!(
        e.contains("--csv") && e.contains("--route-trace") && e.contains("same file"),
        "{e}"
    );
}

#[test]
fn outputs_are_checked_before_the_model_loads() {
    // The model does not exist: if the output were checked after loading, the error would
    // be about the model.
    let missing = Path::new("/nonexistent-bmoe/model.gguf");
    if Path::new("/dev/full").exists() {
        let e = try_run(missing, &["-p", "hi", "--csv", "/dev/full"])
            .err()
            .expect("/dev/full");
        assert!(
            e.contains("--csv /dev/full") && e.contains("No space left on device"),
            "{e}"
        );
    }
    let e = try_run(
        missing,
        &["-p", "hi", "--csv", "/nonexistent-bmoe-dir/run.csv"],
    )
    .err()
    .expect("missing directory");
    assert!(e.contains("--csv /nonexistent-bmoe-dir/run.csv"), "{e}");
    let dir = scratch_dir("reliability");
    let e = try_run(missing, &["-p", "hi", "--csv", dir.to_str().unwrap()])
        .err()
        .expect("a directory as output");
    assert!(e.contains("--csv") && e.contains("Is a directory"), "{e}");
}

#[test]
fn a_header_tensor_count_off_by_one_is_refused() {
    for delta in [-1i64, 1] {
        let p = copy_of_tiny(&format!("count{delta:+}"));
        let mut b = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(b[8..16].try_into().unwrap());
        b[8..16].copy_from_slice(&((n as i64 + delta) as u64).to_le_bytes());
        std::fs::write(&p, &b).unwrap();
        let e = try_run(&p, &["-p", "hi", "-n", "2"])
            .err()
            .expect("a tensor count off by one must not load");
        assert!(
            e.contains(p.to_str().unwrap()) && e.contains("tensor_count"),
            "{delta:+}: {e}"
        );
    }
}

/// A copy of the tiny model with `tensor`'s first f32 set to NaN.
fn with_nan_in(tensor: &str) -> PathBuf {
    let p = copy_of_tiny(&format!("nan-{}", tensor.replace('.', "_")));
    let off = {
        let f = GgufFile::open(&p).unwrap();
        let t = f.tensor(tensor).expect("tensor exists");
        assert_eq!(t.ty, bmoe_engine::gguf::GgmlType::F32, "{tensor} is F32");
        t.offset as usize
    };
    let mut b = std::fs::read(&p).unwrap();
    b[off..off + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    p
}

#[test]
fn a_model_with_nan_weights_stops_with_an_error_naming_the_step() {
    let p = with_nan_in("blk.1.ffn_norm.weight");
    for mode in [&[][..], &["--moe-stream"][..]] {
        let mut args = vec!["-p", "Hello there", "-n", "4"];
        args.extend_from_slice(mode);
        let r = try_run(&p, &args).expect("runs, and fails loudly");
        assert_ne!(r.code, 0, "{mode:?}: NaN logits must not exit 0");
        assert!(
            r.stderr.contains("logits of the prefill step") && r.stderr.contains("not finite"),
            "{mode:?}: {}",
            r.stderr
        );
        assert!(r.outcome.tokens.is_empty(), "no token sampled from NaN");
        // --check-finite names the first layer and intermediate that broke.
        args.push("--check-finite");
        let r = try_run(&p, &args).expect("runs");
        assert_ne!(r.code, 0);
        assert!(
            r.stderr.contains("layer 1 ffn_norm"),
            "{mode:?}: {}",
            r.stderr
        );
    }
    // The healthy model is not disturbed by the checks.
    let ok = run(&tiny(), &["-p", "Hello there", "-n", "4", "--check-finite"]);
    let base = run(&tiny(), &["-p", "Hello there", "-n", "4"]);
    assert_eq!(ok.code, 0);
    assert_eq!(ok.outcome.tokens, base.outcome.tokens);
}

#[test]
fn gen_refuses_non_finite_options() {
    let out = scratch_dir("reliability").join(format!("nan-gen-{}.gguf", std::process::id()));
    let _ = std::fs::remove_file(&out);
    for (flag, v) in [
        ("--router-gain", "nan"),
        ("--router-gain", "inf"),
        ("--attn-sharpness", "NaN"),
        ("--routing-context", "nan"),
        ("--routing-depth", "nan"),
        ("--routing-depth", "4.5"),
    ] {
        let cli = Cli::try_parse_from([
            "bmoe-cli",
            "gen",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            flag,
            v,
        ])
        .expect("parses");
        let Some(bmoe_engine::cli::Cmd::Gen(a)) = cli.cmd else {
            panic!("gen")
        };
        let e = bmoe_engine::cli::gen(a).expect_err("non-finite option");
        let text = bmoe_core::telemetry::fmt::error_text(e.as_ref());
        assert!(
            text.contains(flag) && !text.contains("writing"),
            "{flag} {v}: {text}"
        );
        assert!(!out.exists(), "{flag} {v}: nothing written");
    }
}

#[test]
fn errors_name_the_file_and_say_the_os_error_once() {
    let e = try_run(Path::new("/nonexistent-bmoe/m.gguf"), &["-p", "hi"])
        .err()
        .expect("missing model");
    assert!(e.contains("/nonexistent-bmoe/m.gguf"), "{e}");
    assert_eq!(e.matches("(os error 2)").count(), 1, "{e}");
}

#[test]
fn a_directory_passed_as_the_model_is_named_as_such() {
    let d = scratch_dir("reliability");
    let e = try_run(&d, &["-p", "hi"]).err().expect("a directory");
    assert!(e.contains("is a directory"), "{e}");
    assert!(!e.contains("No such device"), "{e}");
}

fn project_trace(name: &str) -> PathBuf {
    bmoe_engine::testdata::project_root()
        .join("traces")
        .join(name)
}

#[test]
fn replay_refuses_a_route_trace_with_a_preamble_and_no_rows() {
    let text = std::fs::read_to_string(project_trace("tiny-s1-cache4.route.csv")).unwrap();
    // Everything up to and including the header row.
    let header_end = text
        .match_indices('\n')
        .map(|(i, _)| i + 1)
        .find(|&i| !text[..i].lines().last().unwrap_or("").starts_with('#'))
        .expect("a header row");
    let p = scratch_dir("reliability").join(format!("preamble-only-{}.csv", std::process::id()));
    std::fs::write(&p, &text[..header_end]).unwrap();
    let (code, out, err) = sim(&[
        "replay",
        "--trace",
        p.to_str().unwrap(),
        "--cache-mb",
        "8",
        "--force-cache",
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("no rows") && err.contains(p.to_str().unwrap()),
        "{err}"
    );
}

#[test]
fn diff_refuses_a_file_that_is_not_a_bmoe_metrics_csv() {
    let csv = project_trace("tiny-s1-cache4.csv");
    let route = project_trace("tiny-s1-cache4.route.csv");
    let (code, out, err) = sim(&["diff", route.to_str().unwrap(), csv.to_str().unwrap()]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("not a bmoe_metrics file"), "{err}");
    assert!(!out.contains('%'), "no comparison is printed: {out}");
}

#[test]
fn our_readers_name_a_partial_last_line() {
    use bmoe_core::telemetry::{io_trace::parse_io_trace, route_trace::RouteTrace, MetricsCsv};
    type Reader = fn(&str) -> Result<(), bmoe_core::telemetry::ParseError>;
    let readers: [(&str, Reader); 3] = [
        ("tiny-s1-cache4.csv", |t| MetricsCsv::parse(t).map(|_| ())),
        ("tiny-s1-cache4.route.csv", |t| {
            RouteTrace::parse(t).map(|_| ())
        }),
        ("tiny-s1-cache4.io.csv", |t| parse_io_trace(t).map(|_| ())),
    ];
    for (name, read) in readers {
        let text = std::fs::read_to_string(project_trace(name)).unwrap();
        read(&text).unwrap_or_else(|e| panic!("{name} whole: {e}"));
        // Cut inside the last data row, as a SIGKILL between two writes of a row would.
        let body = text.trim_end_matches('\n');
        let last_start = body.rfind('\n').unwrap() + 1;
        let cut = &text[..last_start + (body.len() - last_start) / 2];
        let e = read(cut).expect_err("a cut file");
        assert!(e.to_string().contains("partial last line"), "{name}: {e}");
        assert_eq!(e.line(), Some(cut.lines().count()), "{name}: {e}");
    }
}

#[test]
fn a_replay_output_pointed_at_its_trace_is_refused_and_the_trace_is_intact() {
    let d = scratch_dir("reliability");
    let trace = d.join(format!("victim-{}.route.csv", std::process::id()));
    std::fs::copy(project_trace("tiny-s1-cache4.route.csv"), &trace).unwrap();
    let before = std::fs::read(&trace).unwrap();
    let t = trace.to_str().unwrap();
    for flag in ["--csv", "--route-trace", "--io-trace"] {
        let (code, _, err) = sim(&[
            "replay",
            "--trace",
            t,
            "--cache-mb",
            "8",
            "--force-cache",
            flag,
            t,
        ]);
        assert_eq!(code, 1, "{flag}: {err}");
        assert!(
            err.contains("refusing to overwrite an input"),
            "{flag}: {err}"
        );
    }
    let other = d.join(format!("both-{}.csv", std::process::id()));
    let o = other.to_str().unwrap();
    let (code, _, err) = sim(&[
        "replay",
        "--trace",
        t,
        "--cache-mb",
        "8",
        "--force-cache",
        "--csv",
        o,
        "--io-trace",
        o,
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("each output needs its own path"), "{err}");
    assert_eq!(
        std::fs::read(&trace).unwrap(),
        before,
        "the trace is untouched"
    );
}
