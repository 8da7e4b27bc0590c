//! The validation matrix of features.md §1–§8 and §14, row by row: every rule must refuse
//! with a `config error:` message naming its flag, and every legal neighbour must pass.

use bmoe_core::config::{ConfigError, RunConfig, SpecMode};

fn streaming() -> RunConfig {
    RunConfig {
        moe_stream: true,
        cache_auto: true,
        ..RunConfig::default()
    }
}

fn no_cache() -> RunConfig {
    RunConfig {
        moe_stream: true,
        cache_auto: false,
        cache_mb: 0,
        ..RunConfig::default()
    }
}

/// (what the row is, the configuration, the flag the message must name, a word of the rule)
fn rejected() -> Vec<(&'static str, RunConfig, &'static str, &'static str)> {
    vec![
        (
            "n_predict 0",
            RunConfig {
                n_predict: 0,
                ..RunConfig::default()
            },
            "--n-predict",
            "> 0",
        ),
        (
            "threads 0",
            RunConfig {
                threads: 0,
                ..RunConfig::default()
            },
            "--threads",
            "> 0",
        ),
        (
            "ctx 0",
            RunConfig {
                n_ctx: 0,
                ..RunConfig::default()
            },
            "--ctx-size",
            "> 0",
        ),
        (
            "ubatch above ctx",
            RunConfig {
                n_ubatch: 4096,
                ..RunConfig::default()
            },
            "--ubatch",
            "context size 2048",
        ),
        (
            "cache 1000 MiB without force",
            RunConfig {
                cache_auto: false,
                cache_mb: 1000,
                ..streaming()
            },
            "--cache-mb",
            "pathological band",
        ),
        (
            "cache 1499 MiB without force",
            RunConfig {
                cache_auto: false,
                cache_mb: 1499,
                ..streaming()
            },
            "--cache-mb",
            "--force-cache",
        ),
        (
            "auto with a numeric budget",
            RunConfig {
                cache_auto: true,
                cache_mb: 3000,
                ..streaming()
            },
            "--cache-mb auto",
            "not both",
        ),
        (
            "io-threads 0",
            RunConfig {
                io_threads: 0,
                ..streaming()
            },
            "--io-threads",
            "[1, 8]",
        ),
        (
            "io-threads 9",
            RunConfig {
                io_threads: 9,
                ..streaming()
            },
            "--io-threads",
            "[1, 8]",
        ),
        (
            "prefetch 9",
            RunConfig {
                prefetch: 9,
                ..streaming()
            },
            "--prefetch",
            "[0, 8]",
        ),
        (
            "prefetch without cache",
            RunConfig {
                prefetch: 1,
                ..no_cache()
            },
            "--prefetch",
            "expert cache",
        ),
        (
            "predict-spec-max 9",
            RunConfig {
                predict_spec_max: 9,
                ..streaming()
            },
            "--predict-spec-max",
            "[0, 8]",
        ),
        (
            "route-ahead 9",
            RunConfig {
                route_ahead: 9,
                ..streaming()
            },
            "--route-ahead",
            "[0, 8]",
        ),
        (
            "route-ahead without streaming",
            RunConfig {
                route_ahead: 2,
                ..RunConfig::default()
            },
            "--route-ahead",
            "--moe-stream",
        ),
        (
            "route-ahead with predict-log",
            RunConfig {
                route_ahead: 2,
                predict_log: true,
                ..streaming()
            },
            "--route-ahead",
            "--predict-log",
        ),
        (
            "route-ahead with predict-prefetch",
            RunConfig {
                route_ahead: 2,
                predict_prefetch: true,
                ..streaming()
            },
            "--route-ahead",
            "--predict-prefetch",
        ),
        (
            "route-ahead with prefetch",
            RunConfig {
                route_ahead: 2,
                prefetch: 1,
                ..streaming()
            },
            "--route-ahead",
            "--prefetch",
        ),
        (
            "route-ahead with ngram",
            RunConfig {
                route_ahead: 2,
                spec: SpecMode::Ngram,
                ..streaming()
            },
            "--route-ahead",
            "--mtp/--ngram",
        ),
        (
            "drop above 1",
            RunConfig {
                drop_cold_frac: 1.5,
                ..streaming()
            },
            "--drop-cold-experts",
            "[0, 1]",
        ),
        (
            "drop NaN",
            RunConfig {
                drop_cold_frac: f32::NAN,
                ..streaming()
            },
            "--drop-cold-experts",
            "[0, 1]",
        ),
        (
            "drop negative",
            RunConfig {
                drop_cold_frac: -0.1,
                ..streaming()
            },
            "--drop-cold-experts",
            "[0, 1]",
        ),
        (
            "drop without cache",
            RunConfig {
                drop_cold_frac: 0.75,
                ..no_cache()
            },
            "--drop-cold-experts",
            "expert cache",
        ),
        (
            "drop without streaming",
            RunConfig {
                drop_cold_frac: 0.75,
                ..RunConfig::default()
            },
            "--drop-cold-experts",
            "--moe-stream",
        ),
        (
            "substitute above 1",
            RunConfig {
                substitute_lambda: 1.01,
                ..streaming()
            },
            "--expert-substitute",
            "[0, 1]",
        ),
        (
            "substitute NaN",
            RunConfig {
                substitute_lambda: f32::NAN,
                ..streaming()
            },
            "--expert-substitute",
            "[0, 1]",
        ),
        (
            "substitute without cache",
            RunConfig {
                substitute_lambda: 0.15,
                ..no_cache()
            },
            "--expert-substitute",
            "expert cache",
        ),
        (
            "predict-prefetch without cache",
            RunConfig {
                predict_prefetch: true,
                ..no_cache()
            },
            "--predict-prefetch",
            "expert cache",
        ),
        (
            "predict-prefetch with prefetch",
            RunConfig {
                predict_prefetch: true,
                prefetch: 2,
                ..streaming()
            },
            "--predict-prefetch",
            "--prefetch",
        ),
        (
            "overlap without streaming",
            RunConfig {
                overlap: true,
                ..RunConfig::default()
            },
            "--overlap",
            "--moe-stream",
        ),
        (
            "predict-log without streaming",
            RunConfig {
                predict_log: true,
                ..RunConfig::default()
            },
            "--predict-log",
            "--moe-stream",
        ),
        (
            "predict-prefetch without streaming",
            RunConfig {
                predict_prefetch: true,
                ..RunConfig::default()
            },
            "--predict-prefetch",
            "--moe-stream",
        ),
        (
            "route-trace without streaming",
            RunConfig {
                route_trace: true,
                ..RunConfig::default()
            },
            "--route-trace",
            "--moe-stream",
        ),
        (
            "io-trace without streaming",
            RunConfig {
                io_trace: true,
                ..RunConfig::default()
            },
            "--io-trace",
            "--moe-stream",
        ),
        (
            "io-two-wave without overlap",
            RunConfig {
                io_two_wave: true,
                ..streaming()
            },
            "--io-two-wave",
            "--overlap",
        ),
        (
            "temp NaN",
            RunConfig {
                temp: f32::NAN,
                ..RunConfig::default()
            },
            "--temp",
            "finite",
        ),
        (
            "top-p 0 while sampling",
            RunConfig {
                temp: 0.7,
                top_p: 0.0,
                ..RunConfig::default()
            },
            "--top-p",
            "(0, 1]",
        ),
        (
            "draft 9",
            RunConfig {
                spec: SpecMode::Mtp,
                spec_draft_max: 9,
                ..RunConfig::default()
            },
            "--draft",
            "[1, 8]",
        ),
        (
            "p-min with ngram",
            RunConfig {
                spec: SpecMode::Ngram,
                mtp_p_min: 0.5,
                ..RunConfig::default()
            },
            "--mtp-p-min",
            "--ngram",
        ),
        (
            "ngram min above max",
            RunConfig {
                spec: SpecMode::Ngram,
                ngram_min_match: 13,
                ..RunConfig::default()
            },
            "--ngram-min-match",
            "--ngram-max-match=12",
        ),
        (
            "ubatch narrower than verify",
            RunConfig {
                spec: SpecMode::Mtp,
                n_ubatch: 3,
                ..RunConfig::default()
            },
            "--ubatch",
            "verify batch (4 positions)",
        ),
    ]
}

#[test]
fn every_rule_refuses_with_its_flag() {
    for (what, cfg, flag, rule) in rejected() {
        let err = match cfg.validate() {
            Err(e) => e,
            Ok(()) => panic!("{what}: accepted"),
        };
        let msg = err.to_string();
        assert!(msg.starts_with("config error: "), "{what}: {msg}");
        assert!(
            msg.contains(flag),
            "{what}: message does not name {flag}: {msg}"
        );
        assert!(
            msg.contains(rule),
            "{what}: message does not state the rule ({rule}): {msg}"
        );
    }
}

#[test]
fn legal_neighbours_pass() {
    let legal = [
        ("cache 0 (off)", no_cache()),
        (
            "cache 1500",
            RunConfig {
                cache_auto: false,
                cache_mb: 1500,
                ..streaming()
            },
        ),
        (
            "cache 1000 forced",
            RunConfig {
                cache_auto: false,
                cache_mb: 1000,
                force_cache: true,
                ..streaming()
            },
        ),
        (
            "io-threads 8",
            RunConfig {
                io_threads: 8,
                ..streaming()
            },
        ),
        (
            "prefetch 8 with cache",
            RunConfig {
                prefetch: 8,
                ..streaming()
            },
        ),
        (
            "route-ahead without cache",
            RunConfig {
                route_ahead: 8,
                overlap: true,
                ..no_cache()
            },
        ),
        (
            "drop 1.0 and substitute 1.0",
            RunConfig {
                drop_cold_frac: 1.0,
                substitute_lambda: 1.0,
                ..streaming()
            },
        ),
        (
            "predict-spec-max 0",
            RunConfig {
                predict_spec_max: 0,
                predict_prefetch: true,
                ..streaming()
            },
        ),
        (
            "predict-log without cache",
            RunConfig {
                predict_log: true,
                ..no_cache()
            },
        ),
        (
            "traces under streaming",
            RunConfig {
                route_trace: true,
                io_trace: true,
                ..streaming()
            },
        ),
        (
            "a cache budget without streaming is ignored, not refused",
            RunConfig {
                cache_mb: 3000,
                ..RunConfig::default()
            },
        ),
        (
            "top-p 0 is inert when greedy",
            RunConfig {
                top_p: 0.0,
                ..RunConfig::default()
            },
        ),
        (
            "ngram 1..64",
            RunConfig {
                spec: SpecMode::Ngram,
                ngram_min_match: 1,
                ngram_max_match: 64,
                ..RunConfig::default()
            },
        ),
        (
            // Verification draws from each row as a plain decode would (crate::speculate):
            // the output distribution is unchanged, so sampling is not refused.
            "ngram while sampling",
            RunConfig {
                spec: SpecMode::Ngram,
                temp: 0.7,
                ..RunConfig::default()
            },
        ),
    ];
    for (what, cfg) in legal {
        assert_eq!(cfg.validate(), Ok(()), "{what}");
    }
}

#[test]
fn model_checks_need_the_model() {
    let cfg = RunConfig {
        n_expert: 8,
        n_expert_used_override: 9,
        ..streaming()
    };
    assert_eq!(
        cfg.validate(),
        Ok(()),
        "the override is judged only once the model is known"
    );
    match cfg.validate_model() {
        Err(ConfigError::OutOfRange { flag, .. }) => assert_eq!(flag, "--n-expert-used"),
        other => panic!("expected an out-of-range --n-expert-used, got {other:?}"),
    }
    let ok = RunConfig {
        n_expert: 8,
        n_expert_used_override: 8,
        ..streaming()
    };
    assert_eq!(ok.validate_model(), Ok(()));
}
