//! Helpers the simulator's integration tests share: the real traces in `../shared` (skipped
//! with a message when absent, a failure under CI=true), scratch directories, the binary's
//! entry point in-process, and trace slices.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `../shared/traces/NAME` beside the project (or `$BMOE_SHARED_DIR/traces/NAME`), or `None`
/// with a message when it is absent outside CI.
pub fn shared_trace(name: &str) -> Option<PathBuf> {
    let base = std::env::var_os("BMOE_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    let p = base.join("traces").join(name);
    if p.exists() {
        return Some(p);
    }
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        panic!("CI=true but the shared trace {} is missing", p.display());
    }
    eprintln!("skipping: shared trace {} not found", p.display());
    None
}

/// A fresh scratch directory for this process and `name`.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("bmoe-simtest-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// `bmoe-sim ARGS` in-process: (exit code, stdout, stderr).
pub fn sim(args: &[&str]) -> (i32, String, String) {
    let mut argv = vec!["bmoe-sim".to_string()];
    argv.extend(args.iter().map(|s| s.to_string()));
    let (mut o, mut e) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(argv, &[], &mut o, &mut e);
    (
        code,
        String::from_utf8_lossy(&o).into_owned(),
        String::from_utf8_lossy(&e).into_owned(),
    )
}

/// The first `turns` turns of a route trace (preamble kept).
pub fn slice(text: &str, turns: u32) -> String {
    text.lines()
        .filter(|l| {
            l.starts_with('#')
                || l.starts_with("turn,")
                || l.split(',').next().and_then(|t| t.parse::<u32>().ok()) < Some(turns)
        })
        .map(|l| format!("{l}\n"))
        .collect()
}
