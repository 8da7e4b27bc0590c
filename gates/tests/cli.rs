//! The CLI's promises on bad requests and determinism (issue 3): clear errors naming what was
//! wrong, never a panic; greedy output identical across runs and thread counts.

use bmoe_engine::cli::Cli;
use bmoe_engine::gguf::{GgufWriter, Value};
use bmoe_gates::{run, scratch_dir, tiny};
use clap::Parser;

fn try_run(model: &std::path::Path, args: &[&str]) -> Result<bmoe_engine::run::Outcome, String> {
    let mut argv = vec!["bmoe-cli", "-m", model.to_str().unwrap()];
    argv.extend_from_slice(args);
    let cli = Cli::try_parse_from(&argv).map_err(|e| e.to_string())?;
    let (mut o, mut e) = (Vec::new(), Vec::new());
    bmoe_engine::run::generate_with(&cli.run, model, &mut o, &mut e).map_err(|e| format!("{e:#}"))
}

#[test]
fn greedy_output_is_identical_across_runs_and_thread_counts() {
    let base = run(
        &tiny(),
        &[
            "-p",
            "Determinism is tested, not hoped for",
            "-n",
            "48",
            "-t",
            "1",
        ],
    );
    for t in ["1", "2", "3"] {
        let r = run(
            &tiny(),
            &[
                "-p",
                "Determinism is tested, not hoped for",
                "-n",
                "48",
                "-t",
                t,
            ],
        );
        assert_eq!(r.outcome.tokens, base.outcome.tokens, "-t {t}");
        assert_eq!(r.stdout, base.stdout, "-t {t}");
    }
}

#[test]
fn a_non_moe_architecture_is_refused_by_name() {
    // An architecture this build does not run: named, with the ones it does.
    let p = scratch_dir("cli").join("falcon.gguf");
    GgufWriter::write_file(
        &p,
        &[(
            "general.architecture".to_string(),
            Value::String("falcon".into()),
        )],
        &[],
    )
    .unwrap();
    let e = try_run(&p, &["-p", "hi", "-n", "2"]).expect_err("falcon is not supported");
    assert!(e.contains("'falcon'") && e.contains("qwen3moe"), "{e}");
    // A llama file without experts (a dense Llama): not a MoE model, whatever else it lacks.
    let p = scratch_dir("cli").join("llama.gguf");
    GgufWriter::write_file(
        &p,
        &[(
            "general.architecture".to_string(),
            Value::String("llama".into()),
        )],
        &[],
    )
    .unwrap();
    let e = try_run(&p, &["-p", "hi", "-n", "2"]).expect_err("a dense llama is refused");
    assert!(
        e.contains("'llama'") && e.contains("not a mixture-of-experts model"),
        "{e}"
    );
}

#[test]
fn a_prompt_longer_than_the_context_is_a_clear_error() {
    let long = "word ".repeat(400);
    let e = try_run(&tiny(), &["-p", &long, "-n", "8", "-c", "64"]).expect_err("context overflow");
    assert!(e.contains("exceeds the context size 64"), "{e}");
}

#[test]
fn a_truncated_model_is_a_clear_error() {
    let src = std::fs::read(tiny()).unwrap();
    let p = scratch_dir("cli").join("trunc.gguf");
    std::fs::write(&p, &src[..src.len() / 2]).unwrap();
    let e = try_run(&p, &["-p", "hi", "-n", "2"]).expect_err("truncated file");
    assert!(
        e.contains(p.to_str().unwrap()),
        "the message must name the file: {e}"
    );
}

#[test]
fn invalid_flag_combinations_are_config_errors() {
    for (args, needle) in [
        (vec!["-p", "x", "--overlap"], "--overlap"),
        (
            vec!["-p", "x", "--moe-stream", "--cache-mb", "100"],
            "--force-cache",
        ),
        (
            vec!["-p", "x", "--moe-stream", "--io-threads", "9"],
            "--io-threads",
        ),
    ] {
        let e = try_run(&tiny(), &args).expect_err("must be refused");
        assert!(
            e.contains("config error") && e.contains(needle),
            "{args:?}: {e}"
        );
    }
}

#[test]
fn numbers_parse_strictly() {
    assert!(Cli::try_parse_from(["bmoe-cli", "-m", "x", "--io-threads", "4x"]).is_err());
    assert!(Cli::try_parse_from(["bmoe-cli", "-m", "x", "--cache-mb", "12q"]).is_err());
}

/// The deltas of `BMOE_PROGRESS` lines joined as a reader joins them (`reset` replaces).
fn joined_deltas(lines: &[serde_json::Value]) -> (String, String) {
    let (mut reasoning, mut text) = (String::new(), String::new());
    for v in lines {
        let (r, t) = (
            v["delta_reasoning"].as_str().expect("delta_reasoning"),
            v["delta_text"].as_str().expect("delta_text"),
        );
        if v.get("reset").is_some() {
            reasoning = r.to_string();
            text = t.to_string();
        } else {
            reasoning.push_str(r);
            text.push_str(t);
        }
    }
    (reasoning, text)
}

/// The contract's token count (issue 15): `-n N` gives N tokens — N `BMOE_PROGRESS` lines with
/// `step` 1..N and `steps` N, the last token's text in the last line's `delta_text` (the
/// deltas join to the whole answer), N CSV rows, a trailer and a report saying N tokens —
/// resident and streamed, serial and under overlap, with and without the chat template.
#[test]
fn n_predict_n_gives_n_tokens_lines_and_rows_for_1_2_and_32() {
    let dir = scratch_dir("token-count");
    for n in [1u32, 2, 32] {
        for extra in [
            &[][..],
            &["--moe-stream", "--cache-mb", "0"][..],
            &[
                "--moe-stream",
                "--cache-mb",
                "2",
                "--force-cache",
                "--overlap",
            ][..],
            &["--chatml"][..],
        ] {
            let what = format!("-n {n} {extra:?}");
            let ns = n.to_string();
            let csv = dir.join(format!("n{n}-{}.csv", extra.len()));
            let mut a = vec!["-p", "Once upon a time", "-n", &ns, "-t", "2"];
            a.extend_from_slice(extra);
            let plain = run(&tiny(), &a);
            assert_eq!(plain.code, 0, "{what}: {}", plain.stderr);
            a.extend_from_slice(&["--progress", "--csv", csv.to_str().unwrap()]);
            let r = run(&tiny(), &a);
            assert_eq!(r.code, 0, "{what}: {}", r.stderr);
            assert_eq!(r.outcome.tokens, plain.outcome.tokens, "{what}");
            assert_eq!(
                r.outcome.tokens.len(),
                n as usize,
                "{what}: no end-of-generation here"
            );

            let lines: Vec<serde_json::Value> = r
                .stdout
                .lines()
                .filter_map(|l| l.strip_prefix("BMOE_PROGRESS "))
                .map(|j| serde_json::from_str(j).expect("progress JSON"))
                .collect();
            assert_eq!(lines.len(), n as usize, "{what}: progress lines");
            for (i, v) in lines.iter().enumerate() {
                assert_eq!(v["step"], i as u64 + 1, "{what}");
                assert_eq!(v["steps"], u64::from(n), "{what}");
            }
            let last = lines.last().expect("a line");
            assert!(
                !last["delta_text"].as_str().unwrap_or("").is_empty()
                    || !last["delta_reasoning"].as_str().unwrap_or("").is_empty(),
                "{what}: the last token's text is in no delta: {last}"
            );
            let answer = r
                .stdout
                .split_once("=== answer ===\n")
                .and_then(|(_, rest)| rest.split_once("\n=== perf ===\n"))
                .map(|(a, _)| a)
                .expect("answer block");
            let (_, text) = joined_deltas(&lines);
            assert_eq!(text, answer, "{what}: the deltas join to the answer");
            assert_eq!(text, r.outcome.text, "{what}");
            // Without --progress the same answer is printed inline, then a newline.
            assert_eq!(plain.stdout, format!("{answer}\n"), "{what}");
            assert!(
                r.stdout.contains(&format!("\ngeneration: {n} tokens, ")),
                "{what}: {}",
                r.stdout
            );

            let m =
                bmoe_core::telemetry::MetricsCsv::parse(&std::fs::read_to_string(&csv).unwrap())
                    .expect("own CSV parses");
            assert_eq!(m.rows.len(), n as usize, "{what}: CSV rows");
            for (i, row) in m.rows.iter().enumerate() {
                assert_eq!((row.step, row.steps), (i as u32 + 1, n), "{what}");
            }
            let s = m.summary().expect("trailer");
            assert_eq!(s.get("tokens"), Some(ns.as_str()), "{what}");
            assert_eq!(s.get("interrupted"), None, "{what}: not interrupted");
            let summary = r.outcome.summary.as_ref().expect("summary");
            assert_eq!(summary.tokens(), u64::from(n), "{what}");
            // The context holds the prompt and every generated token.
            assert_eq!(
                summary.counters.n_past,
                summary.counters.n_prompt + u64::from(n),
                "{what}"
            );
            let _ = std::fs::remove_file(&csv);
        }
    }
}
