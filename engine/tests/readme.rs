//! The README's "Using it" commands, run as typed (issue 35, item 8): the checks live in
//! `scripts/readme-commands.py` (it says which few run differently, and why). `bmoe-sim` is
//! taken from beside this `bmoe-cli`: a workspace build (the test command) puts it there.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_bmoe-cli");

#[test]
fn the_readme_commands_run_as_typed() {
    let dir = Path::new(BIN).parent().expect("bin dir");
    if !dir.join("bmoe-sim").exists() {
        let msg = format!(
            "{} has no bmoe-sim: build the workspace (cargo build, or the README's test command)",
            dir.display()
        );
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
        eprintln!("skipped: {msg}");
        return;
    }
    let script = bmoe_engine::testdata::project_root().join("scripts/readme-commands.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg("--bin-dir")
        .arg(dir)
        .output()
        .expect("python3");
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{so}\n{se}");
    assert!(so.contains(" 0 failed"), "{so}");
}
