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
    let p = scratch_dir("cli").join(format!("llama-{}.gguf", std::process::id()));
    GgufWriter::write_file(
        &p,
        &[(
            "general.architecture".to_string(),
            Value::String("llama".into()),
        )],
        &[],
    )
    .unwrap();
    let e = try_run(&p, &["-p", "hi", "-n", "2"]).expect_err("llama is not supported");
    assert!(e.contains("'llama'") && e.contains("qwen3moe"), "{e}");
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
    let p = scratch_dir("cli").join(format!("trunc-{}.gguf", std::process::id()));
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
