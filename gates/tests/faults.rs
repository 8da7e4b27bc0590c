//! The fault matrix (issue 14): every seeded flash fault × serial/overlap × cache off/on ×
//! prefetch off/on, in the engine (real files, faults injected in its I/O lanes) and in the
//! simulator (its flash model). Each cell asserts what the fault must come to:
//! - transient EIO and short reads are retried: the output is identical to the fault-free run
//!   of the same configuration (tokens in the engine; every count and byte in the simulator);
//! - latency spikes change times only: identical output;
//! - persistent EIO and short reads are reported errors (exit 3 in the engine, 1 in the
//!   simulator), naming the read;
//! - a stuck lane ends in a reported timeout, never a hang;
//! - torn reads (engine only: the simulator moves no bytes and refuses them) are caught by
//!   `--verify-reads` against the checksum sidecar.

use bmoe_engine::cli::{Cli, Cmd};
use bmoe_gates::{scratch_dir, sim, tiny};
use clap::Parser;
use std::path::Path;

const PROMPT: &str = "Once upon a time there was a little fox";

/// (name, flags) of the streaming configurations: serial/overlap × cache off, on, on+prefetch.
fn configs() -> Vec<(String, Vec<&'static str>)> {
    let mut out = Vec::new();
    for (mode, m) in [("serial", &[][..]), ("overlap", &["--overlap"][..])] {
        for (cache, c) in [
            ("cache-off", &["--cache-mb", "0"][..]),
            ("cache-on", &["--cache-mb", "8", "--force-cache"][..]),
            (
                "cache-on+prefetch",
                &["--cache-mb", "8", "--force-cache", "--prefetch", "1"][..],
            ),
        ] {
            let mut flags = vec!["--moe-stream"];
            flags.extend_from_slice(m);
            flags.extend_from_slice(c);
            out.push((format!("{mode}/{cache}"), flags));
        }
    }
    out
}

/// What a fault must come to.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// Same output as the fault-free run.
    Identical,
    /// A reported error whose message holds this text.
    Error(&'static str),
}

/// (name, --inject-faults spec, extra flags, expectation in the engine, in the simulator).
fn faults() -> Vec<(
    &'static str,
    &'static str,
    Vec<&'static str>,
    Expect,
    Expect,
)> {
    use Expect::*;
    vec![
        ("eio", "seed=1,eio=0.3", vec![], Identical, Identical),
        ("short", "seed=2,short=0.3", vec![], Identical, Identical),
        (
            "spike",
            "seed=3,spike=0.3,spike-ms=2",
            vec![],
            Identical,
            Identical,
        ),
        (
            "eio-persistent",
            "seed=1,eio=0.3,persistent",
            vec![],
            Error("injected EIO"),
            Error("injected EIO"),
        ),
        (
            "short-persistent",
            "seed=2,short=0.3,persistent",
            vec![],
            Error("short read"),
            Error("short read"),
        ),
        (
            "stuck-lane",
            "stuck=0@3",
            vec!["--read-timeout-ms", "300"],
            Error("did not complete within 300 ms"),
            Error("did not complete within 300 ms"),
        ),
        (
            "torn",
            "seed=4,torn=0.3",
            vec!["--verify-reads"],
            Error("torn or stale read"),
            Error("flash model moves none"),
        ),
    ]
}

struct EngineRun {
    code: i32,
    tokens: Vec<u32>,
    stderr: String,
}

fn engine(model: &Path, flags: &[&str]) -> Result<EngineRun, String> {
    let mut argv = vec![
        "bmoe-cli",
        "-m",
        model.to_str().unwrap(),
        "-p",
        PROMPT,
        "-n",
        "6",
    ];
    argv.extend_from_slice(flags);
    let cli = Cli::try_parse_from(&argv).map_err(|e| e.to_string())?;
    let (mut o, mut e) = (Vec::new(), Vec::new());
    let r = bmoe_engine::run::generate_with(&cli.run, model, &mut o, &mut e)
        .map_err(|e| bmoe_core::telemetry::fmt::error_text(e.as_ref()))?;
    Ok(EngineRun {
        code: r.code,
        tokens: r.tokens,
        stderr: String::from_utf8_lossy(&e).into_owned(),
    })
}

/// The counts of the simulator's `sim:` line (everything but the modelled time).
fn sim_counts(out: &str) -> String {
    out.lines()
        .find(|l| l.starts_with("sim: profile="))
        .map(|l| {
            l.split(' ')
                .filter(|t| !t.starts_with("virtual_s="))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

#[test]
fn every_fault_is_a_retried_success_or_a_reported_error_in_the_engine() {
    let model = tiny();
    // The sidecar --verify-reads checks against, written once for this model.
    let cli = Cli::try_parse_from(["bmoe-cli", "checksum", "--quiet", model.to_str().unwrap()])
        .expect("checksum flags");
    match cli.cmd {
        Some(Cmd::Checksum(a)) => bmoe_engine::cli::checksum(a).expect("checksum"),
        _ => panic!("checksum subcommand"),
    }
    let mut failures = Vec::new();
    let mut cells = 0;
    for (cname, cflags) in configs() {
        let base = engine(&model, &cflags).expect("fault-free run");
        assert_eq!(base.code, 0, "{cname}: {}", base.stderr);
        for (fname, spec, extra, expect, _) in faults() {
            cells += 1;
            let mut flags = cflags.clone();
            flags.extend_from_slice(&["--inject-faults", spec]);
            flags.extend_from_slice(&extra);
            let t0 = std::time::Instant::now();
            let r = engine(&model, &flags);
            let cell = format!("engine {cname} {fname}");
            match (expect, r) {
                (_, Err(e)) => failures.push(format!("{cell}: refused: {e}")),
                (Expect::Identical, Ok(r)) => {
                    if r.code != 0 || r.tokens != base.tokens {
                        failures.push(format!(
                            "{cell}: code {} tokens {:?} != {:?}\n{}",
                            r.code, r.tokens, base.tokens, r.stderr
                        ));
                    } else if !r.stderr.contains("injected faults:") {
                        failures.push(format!("{cell}: no fault was injected\n{}", r.stderr));
                    }
                }
                (Expect::Error(text), Ok(r)) => {
                    if r.code == 0 || !r.stderr.contains(text) || !r.stderr.contains("FAILED") {
                        failures.push(format!(
                            "{cell}: code {}, expected a reported error with '{text}'\n{}",
                            r.code, r.stderr
                        ));
                    }
                }
            }
            if t0.elapsed().as_secs() > 20 {
                failures.push(format!("{cell}: took {:?}", t0.elapsed()));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {cells} engine cells failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_fault_is_a_retried_success_or_a_reported_error_in_the_simulator() {
    // A route trace of the tiny model, recorded once by the engine.
    let dir = scratch_dir("faults");
    let trace = dir.join(format!("tiny-{}.route.csv", std::process::id()));
    let rec = engine(
        &tiny(),
        &["--moe-stream", "--route-trace", trace.to_str().unwrap()],
    )
    .expect("record a trace");
    assert_eq!(rec.code, 0, "{}", rec.stderr);
    let t = trace.to_str().unwrap();
    let mut failures = Vec::new();
    let mut cells = 0;
    for (cname, cflags) in configs() {
        let mut args = vec!["replay", "--trace", t];
        args.extend_from_slice(&cflags);
        let (code, base, err) = sim(&args);
        assert_eq!(code, 0, "{cname}: {err}");
        let base = sim_counts(&base);
        assert!(base.contains("misses="), "{cname}: {base}");
        for (fname, spec, extra, _, expect) in faults() {
            cells += 1;
            let extra: Vec<&str> = extra
                .into_iter()
                .filter(|f| *f != "--verify-reads")
                .collect();
            let mut a = args.clone();
            a.extend_from_slice(&["--inject-faults", spec]);
            a.extend_from_slice(&extra);
            let (code, out, err) = sim(&a);
            let cell = format!("sim {cname} {fname}");
            // Speculative reads are cancelled or adopted depending on when reads land, so
            // under --prefetch a fault that changes times (a retry, a spike) legitimately
            // moves hits, misses and bytes, as any timing change does; the routing replayed
            // (steps, lookups) is the same. Without prefetch every count must be identical.
            let same = |out: &str| {
                let (a, b) = (sim_counts(out), base.clone());
                if cname.ends_with("prefetch") {
                    let keep = |s: &str| {
                        s.split(' ')
                            .filter(|t| t.starts_with("steps=") || t.starts_with("lookups="))
                            .collect::<Vec<_>>()
                            .join(" ")
                    };
                    keep(&a) == keep(&b)
                } else {
                    a == b
                }
            };
            match expect {
                Expect::Identical => {
                    if code != 0 || !same(&out) {
                        failures.push(format!(
                            "{cell}: code {code}\n{}\n!= {base}\n{err}",
                            sim_counts(&out)
                        ));
                    } else if !out.contains("sim: injected faults") {
                        failures.push(format!("{cell}: no fault line\n{out}"));
                    }
                }
                Expect::Error(text) => {
                    if code == 0 || !err.contains(text) {
                        failures.push(format!(
                            "{cell}: code {code}, expected an error with '{text}'\n{err}"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {cells} simulator cells failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn a_stale_or_cut_checksum_sidecar_is_refused() {
    let dir = scratch_dir("faults");
    let model = dir.join(format!("sums-{}.gguf", std::process::id()));
    std::fs::copy(tiny(), &model).expect("copy");
    let checksum = |m: &Path| {
        let cli = Cli::try_parse_from(["bmoe-cli", "checksum", "--quiet", m.to_str().unwrap()])
            .expect("flags");
        match cli.cmd {
            Some(Cmd::Checksum(a)) => bmoe_engine::cli::checksum(a).expect("checksum"),
            _ => panic!("checksum"),
        }
    };
    checksum(&model);
    let sums = bmoe_engine::checksum::sidecar_path(&model);
    let text = std::fs::read_to_string(&sums).unwrap();
    let run = || engine(&model, &["--moe-stream", "--verify-reads"]);
    assert_eq!(run().expect("verified run").code, 0);
    // Without streaming there is nothing to verify: refused, not ignored.
    let e = engine(&model, &["--verify-reads"])
        .err()
        .expect("needs --moe-stream");
    assert!(e.contains("--moe-stream"), "{e}");
    // Cut short: refused, naming the sidecar.
    std::fs::write(&sums, &text[..text.len() / 2]).unwrap();
    let e = run().err().expect("a cut sidecar");
    assert!(e.contains(sums.to_str().unwrap()), "{e}");
    // Another model's bytes (the identity line changes): stale.
    let other = text.replacen("header_xxh3=", "header_xxh3=0", 1);
    std::fs::write(&sums, other).unwrap();
    let e = run().err().expect("a stale sidecar");
    assert!(e.contains("another model or an older file"), "{e}");
    // Changed expert hashes: every read is reported as torn or stale.
    let changed: Vec<String> = text
        .lines()
        .enumerate()
        .map(|(i, l)| match l.rsplit_once(' ') {
            Some((head, _)) if i >= 2 => format!("{head} 0000000000000000"),
            _ => l.to_string(),
        })
        .collect();
    std::fs::write(&sums, changed.join("\n") + "\n").unwrap();
    let r = run().expect("runs, and fails loudly");
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("torn or stale read"), "{}", r.stderr);
}
