//! Shared plumbing for the gates: synthetic models made once per test binary, and runs of
//! `bmoe-cli` in-process with their answer captured.

use bmoe_engine::cli::Cli;
use clap::Parser;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// A scratch directory under the workspace's `target/` (a real filesystem, so O_DIRECT works;
/// `/tmp` may be tmpfs).
pub fn scratch_dir(name: &str) -> PathBuf {
    let d = bmoe_engine::testdata::project_root()
        .join("target")
        .join("gates")
        .join(name);
    std::fs::create_dir_all(&d).expect("create scratch dir");
    d
}

static MODELS: OnceLock<Mutex<Vec<(String, PathBuf)>>> = OnceLock::new();

/// A synthetic model made once per process by `bmoe-cli gen` with these arguments.
pub fn model(key: &str, gen_args: &[&str]) -> PathBuf {
    let m = MODELS.get_or_init(|| Mutex::new(Vec::new()));
    let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = g.iter().find(|(k, _)| k == key) {
        return p.clone();
    }
    let path = scratch_dir("models").join(format!("{key}-{}.gguf", std::process::id()));
    let mut argv = vec![
        "bmoe-cli",
        "gen",
        "--quiet",
        "--out",
        path.to_str().expect("utf-8 path"),
    ];
    argv.extend_from_slice(gen_args);
    let cli = Cli::try_parse_from(&argv).expect("gen arguments parse");
    match cli.cmd {
        Some(bmoe_engine::cli::Cmd::Gen(a)) => bmoe_engine::cli::gen(a).expect("gen"),
        _ => panic!("not a gen command"),
    }
    g.push((key.to_string(), path.clone()));
    path
}

/// The result of one in-process run.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub outcome: bmoe_engine::run::Outcome,
}

/// Run `bmoe-cli -m MODEL <args>` in-process.
pub fn run(model: &Path, args: &[&str]) -> Run {
    let mut argv = vec!["bmoe-cli", "-m", model.to_str().expect("utf-8 path")];
    argv.extend_from_slice(args);
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("arguments {args:?}: {e}"));
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let outcome = bmoe_engine::run::generate_with(&cli.run, model, &mut out, &mut err)
        .unwrap_or_else(|e| panic!("run {args:?}: {e:#}\n{}", String::from_utf8_lossy(&err)));
    Run {
        code: outcome.code,
        stdout: String::from_utf8_lossy(&out).into_owned(),
        stderr: String::from_utf8_lossy(&err).into_owned(),
        outcome,
    }
}

/// The tiny preset (4 layers, 16 experts, top-4, Q8_0 experts).
pub fn tiny() -> PathBuf {
    model("tiny", &["--preset", "tiny", "--seed", "7"])
}

/// Run `bmoe-sim <args>` in-process: (exit code, stdout, stderr).
pub fn sim(args: &[&str]) -> (i32, String, String) {
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
