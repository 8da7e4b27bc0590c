//! The benchmark suite (`scripts/bench-suite.py`, issue 20 item 4) cannot rot unnoticed: its
//! `--quick` run — the tiny model, no llama.cpp, no cgroup, a few tokens — goes end to end on
//! this build's binaries and writes a well-formed table (a row per cell, bmoe's rate, the
//! ceilings and the simulator's prediction filled in, llama.cpp's columns empty), the JSON
//! with every cell's commands, and the plot (`bmoe-sim bars`, SVG and PNG). It checks the
//! plumbing, not speed. Skipped with a message when python3 or the bmoe-sim binary is missing,
//! except under CI=true, where that fails.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_bmoe-cli");

fn skip_or_fail(msg: &str) {
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
    eprintln!("skipped: {msg}");
}

/// The cells of the table's row `id` (`| a | b | ... |`), or panic naming what is missing.
fn row<'a>(md: &'a str, id: &str) -> Vec<&'a str> {
    let line = md
        .lines()
        .find(|l| l.starts_with(&format!("| {id} |")))
        .unwrap_or_else(|| panic!("no row {id} in\n{md}"));
    line.trim_matches('|').split('|').map(str::trim).collect()
}

fn number(cell: &str, what: &str) -> f64 {
    let first = cell.split_whitespace().next().unwrap_or("");
    first
        .parse()
        .unwrap_or_else(|_| panic!("{what}: {cell:?} is not a number"))
}

#[test]
fn the_quick_suite_writes_a_well_formed_table_and_plot() {
    if !Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return skip_or_fail("python3 is needed to run scripts/bench-suite.py");
    }
    let bin_dir = Path::new(BIN).parent().expect("the binary's directory");
    if !bin_dir.join("bmoe-sim").exists() {
        return skip_or_fail(&format!(
            "{} is missing (built by `cargo build -p bmoe-sim` or a workspace test run)",
            bin_dir.join("bmoe-sim").display()
        ));
    }
    let out = bmoe_engine::testdata::scratch_dir("bench-suite");
    let script = bmoe_engine::testdata::project_root().join("scripts/bench-suite.py");
    let r = Command::new("python3")
        .arg(&script)
        .arg("--quick")
        .arg("--bin-dir")
        .arg(bin_dir)
        .arg("--out")
        .arg(&out)
        .env_remove("CI")
        .output()
        .expect("run python3");
    let (so, se) = (
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr),
    );
    assert!(r.status.success(), "{so}\n{se}");
    // Progress with an ETA for every step.
    assert!(se.contains("[1/") && se.contains("ETA"), "{se}");

    let md = std::fs::read_to_string(out.join("suite.md")).expect("suite.md");
    let header = md
        .lines()
        .find(|l| l.starts_with("| cell |"))
        .expect("a table header");
    let columns = header.trim_matches('|').split('|').count();
    assert_eq!(columns, 8, "{header}");
    for id in ["tiny-tg", "tiny-pp", "tiny-capped"] {
        let cells = row(&md, id);
        assert_eq!(cells.len(), columns, "{id}: {cells:?}");
        assert!(number(cells[2], "bmoe tok/s") > 0.0, "{id}: {cells:?}");
        assert_eq!(cells[3], "—", "no llama.cpp in --quick: {cells:?}");
    }
    for id in ["tiny-tg", "tiny-capped"] {
        let cells = row(&md, id);
        assert!(number(cells[5], "ceiling") > 0.0, "{id}: {cells:?}");
        assert!(number(cells[6], "bmoe ÷ ceiling") > 0.0, "{id}: {cells:?}");
    }
    assert!(
        number(row(&md, "tiny-capped")[7], "sim prediction") > 0.0,
        "{md}"
    );
    assert!(
        md.contains("## Commands") && md.contains("bmoe-cli -m"),
        "{md}"
    );

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("suite.json")).unwrap()).unwrap();
    let cells = json["cells"].as_array().expect("cells");
    assert_eq!(cells.len(), 3);
    for c in cells {
        let id = c["id"].as_str().unwrap();
        assert!(
            json["commands"][id]
                .as_array()
                .is_some_and(|v| !v.is_empty()),
            "no commands recorded for {id}"
        );
    }
    let svg = std::fs::read_to_string(out.join("suite.svg")).expect("suite.svg");
    assert!(
        svg.contains("tiny") && svg.contains("bmoe") && svg.contains("simulator"),
        "the plot names the cells and series"
    );
    let png = std::fs::read(out.join("suite.png")).expect("suite.png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}
