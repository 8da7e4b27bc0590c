//! The fuzz targets on stable: each target's body (`bmoe_engine::fuzzing`, the same function
//! libFuzzer drives in `fuzz/`) over its seed corpus and a few thousand deterministic
//! mutations of it. A smoke test for CI, which has no nightly; the long runs are
//! `scripts/fuzz.sh TARGET SECONDS` (figures in docs/reliability.md).
//!
//! `BMOE_FUZZ_MUTATIONS=N` runs N mutations per target instead of the default.

use bmoe_engine::fuzzing::{mutations, seeds, Target};
use bmoe_engine::testdata::{project_root, shared_path};

const DEFAULT_MUTATIONS: usize = 3000;

fn smoke(target: Target) {
    let scratch = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "fuzz-{}-{}",
        target.name(),
        std::process::id()
    ));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let shared = shared_path("traces").and_then(|p| p.parent().map(|p| p.to_path_buf()));
    let seeds = seeds(target, &project_root(), shared.as_deref(), &scratch).expect("seeds");
    assert!(seeds.len() >= 2, "{}: too few seeds", target.name());
    for (name, bytes) in &seeds {
        eprintln!("{}: seed {name} ({} bytes)", target.name(), bytes.len());
        target.run(bytes);
    }
    let n = std::env::var("BMOE_FUZZ_MUTATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_MUTATIONS);
    // One seed per target, so a failure names an input that can be regenerated.
    for (i, input) in mutations(&seeds, n, 14).iter().enumerate() {
        let r = std::panic::catch_unwind(|| target.run(input));
        if r.is_err() {
            let p = scratch.join(format!("crash-{i}"));
            std::fs::write(&p, input).expect("save the crashing input");
            panic!(
                "{}: mutation {i} broke a property; input saved to {} (replay: scripts/fuzz.sh {} repro {})",
                target.name(),
                p.display(),
                target.name(),
                p.display()
            );
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
}

#[test]
fn gguf_reader_survives_its_seeds_and_mutations() {
    smoke(Target::Gguf);
}

#[test]
fn route_trace_reader_survives_its_seeds_and_mutations() {
    smoke(Target::RouteTrace);
}

#[test]
fn io_trace_reader_survives_its_seeds_and_mutations() {
    smoke(Target::IoTrace);
}

#[test]
fn metrics_csv_reader_survives_its_seeds_and_mutations() {
    smoke(Target::MetricsCsv);
}

#[test]
fn chat_template_renderer_survives_its_seeds_and_mutations() {
    smoke(Target::ChatTemplate);
}

#[test]
fn every_seed_of_the_readers_is_accepted() {
    // Seeds made from real files must parse: otherwise the fuzzer starts from rejections and
    // never reaches the checks behind them. (Trace seeds are cut back until they parse, and
    // dropped when they cannot be; the GGUF seeds are written by our writer.)
    let scratch = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fuzz-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    use bmoe_core::telemetry::{io_trace::parse_io_trace, route_trace::RouteTrace, MetricsCsv};
    for target in [
        Target::Gguf,
        Target::RouteTrace,
        Target::IoTrace,
        Target::MetricsCsv,
    ] {
        let shared = shared_path("traces").and_then(|p| p.parent().map(|p| p.to_path_buf()));
        for (name, bytes) in seeds(target, &project_root(), shared.as_deref(), &scratch).unwrap() {
            let text = String::from_utf8_lossy(&bytes);
            let ok = match target {
                Target::Gguf => bmoe_engine::gguf::GgufFile::from_bytes("s", bytes.clone())
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                Target::RouteTrace => RouteTrace::parse(&text)
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                Target::IoTrace => parse_io_trace(&text).map(|_| ()).map_err(|e| e.to_string()),
                _ => MetricsCsv::parse(&text)
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
            };
            if let Err(e) = ok {
                panic!("{} seed {name} is refused: {e}", target.name());
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
}

#[test]
fn a_hostile_template_runs_out_of_fuel() {
    // The chat_template long run's timeout (~0.4 s a render natively under the old budget):
    // it must now stop on fuel, a bound counted in instructions, not in luck or seconds.
    let src = bmoe_engine::fuzzing::HOSTILE_TEMPLATES
        .iter()
        .find(|(n, _)| *n == "hostile-undefined-loops")
        .expect("kept as a seed")
        .1;
    let t = bmoe_engine::chat::ChatTemplate::new(src, "<s>", "</s>").expect("compiles");
    let msgs = [bmoe_engine::chat::Message::new("user", "hi")];
    let e = t.render(&msgs, true, None).expect_err("out of fuel");
    assert!(e.to_string().contains("fuel"), "{e}");
}
