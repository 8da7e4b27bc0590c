//! Zero-config streaming (issue 20): with neither `--moe-stream` nor `--no-moe-stream` the
//! engine streams exactly when the model does not fit the memory the process may use, and the
//! `mode:` line and the CSV preamble say which and why. The real binary runs here, the second
//! case inside a cgroup v1 memory limit smaller than the model (needs root and a writable
//! memory hierarchy; skipped with a message where there is none).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_bmoe-cli");
const PROMPT: &str = "The cache of experts keeps what the router asked for";

fn scratch() -> PathBuf {
    bmoe_engine::testdata::scratch_dir("zero-config")
}

fn gen(path: &Path, extra: &[&str]) {
    let st = Command::new(BIN)
        .args(["gen", "--preset", "tiny", "--seed", "3", "--quiet", "-o"])
        .arg(path)
        .args(extra)
        .status()
        .expect("run bmoe-cli gen");
    assert!(st.success(), "gen failed");
}

fn run(model: &Path, csv: &Path, flags: &[&str]) -> Output {
    Command::new(BIN)
        .arg("-m")
        .arg(model)
        .args(["-p", PROMPT, "-n", "16", "-t", "2", "--csv"])
        .arg(csv)
        .args(flags)
        .output()
        .expect("run bmoe-cli")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn mode_line(o: &Output) -> String {
    let e = stderr(o);
    e.lines()
        .find(|l| l.starts_with("mode:"))
        .unwrap_or_else(|| panic!("no mode: line in {e}"))
        .to_string()
}

/// `key=value` from the CSV preamble.
fn preamble(csv: &Path, key: &str) -> String {
    let text = std::fs::read_to_string(csv).expect("read the CSV");
    let want = format!("{key}=");
    text.lines()
        .take_while(|l| l.starts_with('#'))
        .flat_map(|l| l.split_whitespace())
        .find_map(|kv| kv.strip_prefix(want.as_str()))
        .unwrap_or_else(|| panic!("no {key}= in the preamble of {}", csv.display()))
        .to_string()
}

#[test]
fn a_model_that_fits_runs_resident_without_flags_and_says_why() {
    let dir = scratch();
    let model = dir.join("fits.gguf");
    gen(&model, &[]);
    let csv = dir.join("fits.csv");
    let o = run(&model, &csv, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mode = mode_line(&o);
    assert!(
        mode.starts_with("mode: mmap, experts resident because the model needs"),
        "{mode}"
    );
    assert!(mode.contains("--moe-stream streams them anyway"), "{mode}");
    assert!(
        !stderr(&o).contains("moe-stream:"),
        "a resident run reads no experts"
    );
    assert_eq!(preamble(&csv, "moe_stream"), "0");
    assert_eq!(preamble(&csv, "moe_stream_why"), "fits");
    assert!(preamble(&csv, "mem_room_mb").parse::<u64>().unwrap() > 0);

    // A flag decides without the fit check, and the two flags exclude each other.
    let o = run(&model, &csv, &["--no-moe-stream"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(mode_line(&o).contains("Expert streaming is OFF"));
    assert_eq!(preamble(&csv, "moe_stream_why"), "flag");
    let o = run(&model, &csv, &["--moe-stream", "--no-moe-stream"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cannot be used with"), "{}", stderr(&o));

    // A streaming knob on a model that fits is refused with the reason, not ignored.
    let o = run(&model, &csv, &["--prefetch", "2"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("--prefetch requires --moe-stream"), "{e}");
    assert!(e.contains("no streaming flag was given"), "{e}");
}

/// This process's memory cgroup directory (v1), if it can hold a child cgroup.
fn memory_cgroup() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        ctrl.split(',')
            .any(|c| c == "memory")
            .then(|| path.to_string())
    })?;
    let dir = Path::new("/sys/fs/cgroup/memory").join(rel.trim_start_matches('/'));
    dir.join("memory.limit_in_bytes").exists().then_some(dir)
}

#[test]
fn a_model_larger_than_its_cgroup_limit_streams_without_flags_and_equals_resident() {
    let Some(parent) = memory_cgroup() else {
        eprintln!("SKIP: no cgroup v1 memory hierarchy here to set a limit in");
        return;
    };
    let cg = parent.join(format!("bmoe-zero-config-{}", std::process::id()));
    if std::fs::create_dir(&cg).is_err() {
        eprintln!(
            "SKIP: cannot create a memory cgroup under {} (needs root)",
            parent.display()
        );
        return;
    }
    let limit: u64 = 256 << 20;
    std::fs::write(cg.join("memory.limit_in_bytes"), limit.to_string())
        .expect("set the cgroup's memory limit");

    let dir = scratch();
    // 256 experts per layer: 318 MiB, larger than the 256 MiB the cgroup allows.
    let model = dir.join("too-big.gguf");
    gen(&model, &["--experts", "256"]);
    assert!(std::fs::metadata(&model).unwrap().len() > limit);
    let csv = dir.join("too-big.csv");
    let script = format!(
        "echo $$ > '{}' && exec \"$0\" \"$@\"",
        cg.join("cgroup.procs").display()
    );
    let streamed = Command::new("sh")
        .args(["-c", &script, BIN, "-m"])
        .arg(&model)
        .args(["-p", PROMPT, "-n", "16", "-t", "2", "--csv"])
        .arg(&csv)
        .output()
        .expect("run bmoe-cli in the cgroup");
    let failcnt = std::fs::read_to_string(cg.join("memory.failcnt")).unwrap_or_default();
    let _ = std::fs::remove_dir(&cg);
    assert!(streamed.status.success(), "{}", stderr(&streamed));
    let mode = mode_line(&streamed);
    assert!(
        mode.starts_with(
            "mode: expert streaming, cache auto (room: its cgroup's memory limit), dense anon, \
             overlap (streaming because"
        ),
        "{mode}"
    );
    assert!(
        mode.contains("256 MiB (its cgroup's memory limit)"),
        "{mode}"
    );
    assert!(
        mode.contains("--no-moe-stream forces the resident run"),
        "{mode}"
    );
    assert_eq!(preamble(&csv, "moe_stream"), "1");
    assert_eq!(preamble(&csv, "moe_stream_why"), "too_big");
    assert_eq!(preamble(&csv, "mem_room_from"), "cgroup");
    assert_eq!(preamble(&csv, "mem_room_mb"), "256");
    // The auto cache was sized inside the room, not at the formula's 1500 MiB minimum.
    let budget: u64 = preamble(&csv, "cache_mb").parse().unwrap();
    assert!(budget > 0 && budget < 256, "cache_mb={budget}");
    eprintln!("cgroup memory.failcnt after the run: {}", failcnt.trim());

    let resident = run(&model, &dir.join("resident.csv"), &["--no-moe-stream"]);
    assert!(resident.status.success(), "{}", stderr(&resident));
    assert_eq!(
        String::from_utf8_lossy(&streamed.stdout),
        String::from_utf8_lossy(&resident.stdout),
        "the stream the engine chose must equal the resident run byte for byte"
    );
}
