//! Batched decoding (issue 35, `serve --parallel`): requests decoded together in shared steps
//! ([`bmoe_core::lanes::Lanes`]) choose, token for token, what each chooses alone.
//!
//! Every family that batches sequences (qwen3moe, qwen2moe, gpt-oss with its sliding-window
//! ring, gemma4, llama with experts), resident and streamed through an evicting cache: seven
//! greedy requests on three slots, started as slots free up (so a prompt is fed while others
//! are mid-answer, in the same steps as their tokens and, with a chunk, over several steps; a
//! slot's memory is written over by the next request; and one request reuses the prefix its
//! slot already holds). Each request's tokens equal a plain
//! one-sequence greedy loop's on a fresh engine (no lanes, no sequences), which feeds each
//! token in its own step.

use bmoe_core::generate::TokenSource;
use bmoe_core::lanes::{Lanes, Start};
use bmoe_core::records::{NullSink, Phase};
use bmoe_core::{Backend, CancelFlag, StepInput, StopReason};
use bmoe_engine::run::EngineStep;
use bmoe_engine::stream::EngineBackend;
use bmoe_gates::{load_engine, model};
use std::path::Path;

/// Greedy choice from a row of the last step's logits.
struct Greedy;

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

impl TokenSource<EngineBackend> for Greedy {
    type Error = std::convert::Infallible;

    fn next_token(
        &mut self,
        b: &mut EngineBackend,
        _last: bool,
    ) -> Result<Option<u32>, Self::Error> {
        Ok(Some(argmax(b.last_logits().expect("logits"))))
    }

    fn verifies(&self) -> bool {
        true
    }

    fn next_token_at(
        &mut self,
        b: &mut EngineBackend,
        row: u32,
        _last: bool,
    ) -> Result<Option<u32>, Self::Error> {
        let n = b.model.dims().n_vocab;
        let l = &b.state.logits;
        Ok(Some(argmax(&l[row as usize * n..(row as usize + 1) * n])))
    }
}

/// `n` greedy tokens after `prompt`, one sequence, one token per step.
fn alone(e: &mut EngineStep, prompt: &[u32], n: u32) -> Vec<u32> {
    let mut fed: Vec<u32> = prompt.to_vec();
    let mut input: Vec<u32> = prompt.to_vec();
    let mut out = Vec::new();
    loop {
        let from = fed.len() as u32 - input.len() as u32;
        let positions: Vec<u32> = (from..fed.len() as u32).collect();
        e.step(
            &StepInput {
                turn: 0,
                phase: if out.is_empty() {
                    Phase::Prefill
                } else {
                    Phase::Decode
                },
                tokens: &input,
                positions: &positions,
            },
            &mut NullSink,
        )
        .expect("step");
        let t = argmax(e.backend().last_logits().expect("logits"));
        out.push(t);
        if out.len() as u32 == n {
            return out;
        }
        fed.push(t);
        input = vec![t];
    }
}

fn prompts() -> Vec<Vec<u32>> {
    let p = |seed: u32, len: u32| -> Vec<u32> {
        (0..len)
            .map(|i| (i * 131 + seed * 977 + 17) % 4000)
            .collect()
    };
    vec![
        p(1, 23),
        p(2, 5),
        p(3, 40),
        p(4, 1),
        p(5, 17),
        p(7, 30),
        p(6, 9),
    ]
}

fn batched_equals_alone(m: &Path, extra: &[&str], chunk: usize) {
    const N: u32 = 40; // past gpt-oss's tiny window of 32
    let prompts = prompts();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| alone(&mut load_engine(m, extra), p, N))
        .collect();
    let mut e = load_engine(m, extra);
    e.backend_mut().set_sequences(3).expect("sequences");
    let mut lanes: Lanes<Greedy> = Lanes::new(3, chunk);
    let mut got: Vec<Option<(Vec<u32>, u32)>> = vec![None; prompts.len()];
    let mut next = 0usize;
    let mut steps = 0u32;
    while got.iter().any(Option::is_none) {
        // One new request every third step while a slot is free: prompts arrive mid-answer.
        if next < prompts.len()
            && lanes.has_free()
            && (steps.is_multiple_of(3) || lanes.running() == 0)
        {
            let start = Start {
                prompt: &prompts[next],
                n_predict: N,
                cancel: CancelFlag::new(),
            };
            let ended = lanes
                .start(&mut e, next as u64, start, Greedy)
                .expect("start");
            assert!(ended.is_none(), "a lane ended at its start");
            next += 1;
        }
        for end in lanes.step(&mut e, &mut NullSink) {
            assert_eq!(end.stop, StopReason::Count, "{:?}", end.error);
            got[end.key as usize] = Some((end.tokens, end.reused));
        }
        steps += 1;
        assert!(steps < 1000, "the lanes do not finish");
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let (tokens, _) = g.as_ref().unwrap();
        assert_eq!(
            tokens, w,
            "{m:?} {extra:?}: request {i} batched differs from alone"
        );
    }
    // A request continuing the last one's text (its prompt, its answer, more) is placed on
    // the slot that holds it and feeds only what that slot lacks.
    let last = prompts.len() - 1;
    let mut again = prompts[last].clone();
    again.extend_from_slice(&want[last]);
    again.extend_from_slice(&[5, 6, 7]);
    let start = Start {
        prompt: &again,
        n_predict: N,
        cancel: CancelFlag::new(),
    };
    assert!(lanes
        .start(&mut e, 99, start, Greedy)
        .expect("start")
        .is_none());
    let mut ended = Vec::new();
    while ended.is_empty() {
        ended = lanes.step(&mut e, &mut NullSink);
    }
    let end = ended.pop().unwrap();
    assert_eq!(
        end.reused,
        prompts[last].len() as u32 + N - 1,
        "the slot held the prompt and the answer but its unfed last token"
    );
    assert_eq!(
        end.tokens,
        alone(&mut load_engine(m, extra), &again, N),
        "{m:?} {extra:?}: the continuation"
    );
    assert!(
        lanes.rows > lanes.steps,
        "the lanes shared steps: {} rows in {} steps",
        lanes.rows,
        lanes.steps
    );
}

fn arch_model(arch: &str) -> std::path::PathBuf {
    model(
        &format!("batched-{arch}"),
        &["--arch", arch, "--preset", "tiny", "--seed", "7"],
    )
}

const ARCHS: [&str; 5] = ["qwen3moe", "qwen2moe", "gpt-oss", "gemma4", "llama"];

#[test]
fn batched_requests_choose_what_each_chooses_alone_resident() {
    for arch in ARCHS {
        batched_equals_alone(&arch_model(arch), &[], 0);
        // Prompts fed 7 rows a step, beside the others' tokens (`--ubatch 7`).
        batched_equals_alone(&arch_model(arch), &[], 7);
    }
}

#[test]
fn batched_requests_choose_what_each_chooses_alone_streamed() {
    for arch in ARCHS {
        batched_equals_alone(
            &arch_model(arch),
            &["--moe-stream", "--cache-mb", "4", "--force-cache"],
            0,
        );
    }
}

#[test]
fn a_family_that_cannot_batch_sequences_refuses_them() {
    for arch in ["lfm2moe", "qwen35moe", "deepseek2"] {
        let mut e = load_engine(&arch_model(arch), &[]);
        let err = e.backend_mut().set_sequences(2).unwrap_err();
        assert!(err.contains(arch) && err.contains("cannot"), "{err}");
        // And a step naming another sequence is refused, not run over sequence 0's memory.
        use bmoe_core::{SeqRun, Sequences};
        let r = e.backend_mut().assign_rows(&[SeqRun {
            seq: 1,
            first: 0,
            rows: 1,
        }]);
        assert!(r.is_err(), "{arch}");
    }
}

/// The `sim:` and `batched:` lines of a `bmoe-sim` run, as key=value pairs.
fn sim_keys(args: &[String]) -> std::collections::BTreeMap<String, String> {
    let mut argv = vec!["bmoe-sim".to_string()];
    argv.extend(args.iter().cloned());
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(argv, &[], &mut out, &mut err);
    let (out, err) = (String::from_utf8_lossy(&out), String::from_utf8_lossy(&err));
    assert_eq!(code, 0, "bmoe-sim {args:?}: {err}");
    out.lines()
        .filter(|l| l.starts_with("sim: ") || l.starts_with("batched: "))
        .flat_map(|l| l.split_whitespace())
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A batched run recorded with the `seq` column replays in the simulator exactly: every
/// shared step as the one step it was, through the same cache, so the reads, hits, misses and
/// evictions, the decode steps' `bmoe_batch_*` counts and the route trace itself (residency
/// and bytes per routing) equal the engine's.
fn batched_trace_replays_exactly(m: &Path, budget: &str, chunk: usize, tag: &str) {
    use bmoe_core::telemetry::route_trace::{PredColumns, RouteTraceWriter, StepColumns};
    let dir = bmoe_gates::scratch_dir("batched-replay");
    let mut flags: Vec<String> = ["--cache-mb", budget, "--force-cache", "--io-threads", "3"]
        .map(String::from)
        .to_vec();
    let mut argv = vec![
        "bmoe-cli",
        "-m",
        m.to_str().unwrap(),
        "-t",
        "2",
        "--moe-stream",
    ];
    argv.extend(flags.iter().map(String::as_str));
    let cli = <bmoe_engine::cli::Cli as clap::Parser>::try_parse_from(argv).expect("args");
    let loaded = bmoe_engine::run::load(&cli.run, m, &mut Vec::new()).expect("load");
    let (cfg, mut e) = (loaded.cfg, loaded.engine);
    if !cfg.o_direct {
        // Replay what the engine achieved: buffered reads where O_DIRECT was refused.
        flags.push("--no-odirect".into());
    }
    e.backend_mut().set_sequences(3).expect("sequences");
    let recorded = dir.join(format!("{tag}-engine.route.csv"));
    let file = std::io::BufWriter::new(std::fs::File::create(&recorded).expect("trace file"));
    let mut w = RouteTraceWriter::with_columns(
        file,
        &bmoe_engine::run::route_preamble(&cfg, &e),
        PredColumns::NONE,
        StepColumns {
            group: true,
            seq: true,
        },
    )
    .expect("trace header");
    let prompts = prompts();
    let mut lanes: Lanes<Greedy> = Lanes::new(3, chunk);
    let (mut next, mut done, mut steps) = (0usize, 0usize, 0u32);
    while done < prompts.len() {
        if next < prompts.len() && lanes.has_free() && (steps % 3 == 0 || lanes.running() == 0) {
            let start = Start {
                prompt: &prompts[next],
                n_predict: 24,
                cancel: CancelFlag::new(),
            };
            assert!(lanes
                .start(&mut e, next as u64, start, Greedy)
                .expect("start")
                .is_none());
            next += 1;
        }
        for end in lanes.step(&mut e, &mut w) {
            assert_eq!(end.stop, StopReason::Count, "{:?}", end.error);
            done += 1;
        }
        steps += 1;
        assert!(steps < 1000, "the lanes do not finish");
    }
    let counters = e.cache().counters();
    use std::io::Write;
    w.finish().expect("trace written").flush().expect("flushed");

    let replayed = dir.join(format!("{tag}-sim.route.csv"));
    let mut args: Vec<String> = vec![
        "replay".into(),
        "--trace".into(),
        recorded.display().to_string(),
        "--profile".into(),
        "this-machine".into(),
        "--route-trace".into(),
        replayed.display().to_string(),
    ];
    args.extend(flags);
    let sim = sim_keys(&args);
    let get = |k: &str| -> u64 {
        sim.get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{tag}: no {k} in {sim:?}"))
    };
    assert_eq!(
        (get("hits"), get("misses"), get("evictions"), get("rereads")),
        (
            counters.hits,
            counters.misses,
            counters.evictions,
            counters.rereads
        ),
        "{tag}: the replay's cache counts"
    );
    assert_eq!(
        (
            get("decode_steps"),
            get("decode_rows"),
            get("decode_read_bytes"),
            get("decode_routed_bytes"),
            get("decode_routings"),
        ),
        (
            lanes.steps,
            lanes.rows,
            lanes.read_bytes,
            lanes.routed_bytes,
            lanes.routings
        ),
        "{tag}: the replay's decode steps"
    );
    assert!(
        lanes.rows > lanes.steps,
        "{tag}: the lanes shared steps: {} rows in {} steps",
        lanes.rows,
        lanes.steps
    );
    assert!(
        counters.hits > 0 && counters.evictions > 0,
        "{tag}: the budget must both hit and evict, or the gate proves little: {counters:?}"
    );
    let read = |p: &Path| std::fs::read_to_string(p).expect("trace");
    assert!(
        read(&recorded) == read(&replayed),
        "{tag}: the replayed route trace differs from the engine's ({} and {})",
        recorded.display(),
        replayed.display()
    );
}

#[test]
fn a_batched_run_replays_exactly_in_the_simulator() {
    for arch in ["qwen3moe", "gpt-oss"] {
        let m = arch_model(arch);
        batched_trace_replays_exactly(&m, "6", 0, &format!("{arch}-whole"));
        // Prompts fed 7 rows a step: steps where every sequence is mid-prompt route no row
        // at the last layer.
        batched_trace_replays_exactly(&m, "6", 7, &format!("{arch}-ubatch7"));
    }
}
