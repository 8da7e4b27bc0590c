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
