//! Write a fuzz target's seed corpus: `fuzz_seeds TARGET DIR` (used by scripts/fuzz.sh).
//! Seeds are made at run time from real files (see `bmoe_engine::fuzzing::seeds`), so no
//! corpus is committed.

use bmoe_engine::fuzzing::{seeds, Target};
use bmoe_engine::testdata::{project_root, shared_path};
use std::path::PathBuf;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(name), Some(dir)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: fuzz_seeds TARGET DIR   (targets: gguf route_trace io_trace metrics_csv chat_template)");
        std::process::exit(2);
    };
    let Some(target) = Target::from_name(name) else {
        eprintln!("fuzz_seeds: unknown target {name}");
        std::process::exit(2);
    };
    let dir = PathBuf::from(dir);
    let shared = shared_path("traces").and_then(|p| p.parent().map(|p| p.to_path_buf()));
    let run = || -> std::io::Result<usize> {
        std::fs::create_dir_all(&dir)?;
        let list = seeds(target, &project_root(), shared.as_deref(), &dir)?;
        for (seed_name, bytes) in &list {
            std::fs::write(dir.join(format!("seed-{seed_name}")), bytes)?;
        }
        Ok(list.len())
    };
    match run() {
        Ok(n) => eprintln!("fuzz_seeds: {n} seeds for {name} in {}", dir.display()),
        Err(e) => {
            eprintln!("fuzz_seeds: {}: {e}", dir.display());
            std::process::exit(1);
        }
    }
}
