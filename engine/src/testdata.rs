//! Test plumbing shared by every test binary of the workspace: locating the read-only
//! `../shared` directory (beside the project root) that holds real vocabularies, chat
//! templates and route traces, and scratch directories that do not outlive their process.
//!
//! A user's machine has no `../shared`: tests that need it skip with a message there. In CI
//! (`CI=true`) its absence is a failure, so a broken checkout can never pass by skipping.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The project root (the workspace directory).
pub fn project_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(|p| p.to_path_buf()).unwrap_or(here)
}

/// A scratch directory for this test process: `target/scratch/<pid>/<name>` (under the
/// workspace's `target/`, a real filesystem, so O_DIRECT works there; `/tmp` may be tmpfs).
///
/// A test process cannot clean up after itself (nextest runs each test as its own process,
/// and statics are never dropped), and the models the tests make are tens of MiB each: keyed
/// by pid and never removed they filled the disk after a few dozen suite runs. So the first
/// call in each process removes the directories of processes that are gone, which bounds the
/// scratch space by the tests running at once.
pub fn scratch_dir(name: &str) -> PathBuf {
    static SWEPT: OnceLock<()> = OnceLock::new();
    let root = project_root().join("target").join("scratch");
    SWEPT.get_or_init(|| sweep_dead(&root));
    let d = root.join(std::process::id().to_string()).join(name);
    std::fs::create_dir_all(&d)
        .unwrap_or_else(|e| panic!("create scratch dir {}: {e}", d.display()));
    d
}

/// Remove every `<root>/<pid>` whose process no longer runs (best effort: a directory being
/// removed by another sweeper at the same time is fine).
fn sweep_dead(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// `../shared/<rel>` if it exists. When it does not: under `CI=true` this panics (the test
/// fails); otherwise it prints why the caller is skipping and returns `None`.
pub fn shared_path(rel: &str) -> Option<PathBuf> {
    let base = std::env::var_os("BMOE_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| project_root().join("..").join("shared"));
    let p = base.join(rel);
    if p.exists() {
        return Some(p);
    }
    if std::env::var("CI")
        .map(|v| v == "true" || v == "1")
        .unwrap_or(false)
    {
        panic!(
            "CI=true but the shared test data {} is missing",
            p.display()
        );
    }
    eprintln!(
        "skipping: shared test data {} not found (it lives in ../shared beside the project)",
        p.display()
    );
    None
}
