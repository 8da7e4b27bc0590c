//! Locating the read-only `../shared` directory (beside the project root) that holds real
//! vocabularies, chat templates and route traces for tests.
//!
//! A user's machine has no `../shared`: tests that need it skip with a message there. In CI
//! (`CI=true`) its absence is a failure, so a broken checkout can never pass by skipping.

use std::path::PathBuf;

/// The project root (the workspace directory).
pub fn project_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(|p| p.to_path_buf()).unwrap_or(here)
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
