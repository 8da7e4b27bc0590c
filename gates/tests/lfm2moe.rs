//! lfm2moe's recurrent state (issue 32 item 4), on the tiny file `gen --arch lfm2moe` writes
//! (its last layer a short convolution):
//! - a prompt fed in pieces — a prefill continued where the convolution's state stands, token
//!   by token — gives the logits of one prefill of the whole prompt, bit for bit;
//! - a batch that does not start where the state stands is refused by name, never run on a
//!   wrong state, and a prefix state is kept only where the state stands;
//! - a continued chat reuses the state where it stands and answers as a fresh session given
//!   the whole conversation; a decide — restored or cold — scores as a fresh session does;
//! - its chat templates run in a session (LFM2.5's reasons always: `think_ctl` none).

use bmoe_core::Backend;
use bmoe_gates::{model, SessionDriver};
use serde_json::json;
use std::path::PathBuf;

fn lfm2() -> PathBuf {
    model(
        "lfm2moe-tiny",
        &["--arch", "lfm2moe", "--preset", "tiny", "--seed", "7"],
    )
}

type Engine = bmoe_engine::run::EngineStep;

fn load(extra: &[&str]) -> Engine {
    bmoe_gates::load_engine(&lfm2(), extra)
}

fn step(e: &mut Engine, tokens: &[u32], from: u32) -> Result<Vec<u32>, String> {
    bmoe_gates::step_logit_bits(e, tokens, from)
}

#[test]
fn a_prompt_fed_in_pieces_gives_the_logits_of_one_prefill() {
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 250).collect();
    for extra in [
        &[][..],
        &[
            "--moe-stream",
            "--cache-mb",
            "2",
            "--force-cache",
            "--overlap",
        ][..],
    ] {
        let mut cold = load(extra);
        let want = step(&mut cold, &prompt, 0).unwrap();
        // Two prefills, the second continuing where the state stands.
        let mut e = load(extra);
        step(&mut e, &prompt[..10], 0).unwrap();
        assert_eq!(step(&mut e, &prompt[10..], 10).unwrap(), want, "{extra:?}");
        // Token by token.
        let mut e = load(extra);
        let mut got = Vec::new();
        for (i, &t) in prompt.iter().enumerate() {
            got = step(&mut e, &[t], i as u32).unwrap();
        }
        assert_eq!(got, want, "{extra:?}: one by one");
        // Starting over at 0 forgets what was fed.
        assert_eq!(step(&mut e, &prompt, 0).unwrap(), want, "{extra:?}: again");
    }
}

#[test]
fn a_state_is_never_rolled_back_or_kept_where_it_does_not_stand() {
    let prompt: Vec<u32> = (0..16).map(|i| (i * 11 + 3) % 250).collect();
    // Back to position 9, or past where it stands: refused by name (and the engine refuses
    // every later step: its state is untrustworthy).
    for from in [9, 17] {
        let mut e = load(&[]);
        step(&mut e, &prompt, 0).unwrap();
        let err = step(&mut e, &prompt[9..], from).unwrap_err();
        assert!(err.contains("recurrent state"), "{err}");
        assert!(
            step(&mut e, &prompt, 0).is_err(),
            "a failed engine stays failed"
        );
    }
    let mut e = load(&[]);
    step(&mut e, &prompt, 0).unwrap();
    // Its memory says so: a batch may start at 0 or at 16, or continue at 16 from a longer
    // prefix; no prefix state of 9 positions can be kept, one of 16 can.
    assert_eq!(e.backend().reusable_prefix(16), 16);
    assert_eq!(e.backend().reusable_prefix(20), 16);
    assert_eq!(e.backend().reusable_prefix(9), 0);
    assert_eq!(e.backend_mut().keep_prefix(9).expect("keep"), None);
    assert!(e.backend_mut().keep_prefix(16).expect("keep").is_some());
    // The kept state of 16 positions, restored after junk, continues as a cold run does.
    let more: Vec<u32> = (40..48).collect();
    let mut cold = load(&[]);
    let all: Vec<u32> = prompt.iter().chain(&more).copied().collect();
    let want = step(&mut cold, &all, 0).unwrap();
    step(&mut e, &more, 0).unwrap();
    assert_eq!(e.backend_mut().restore_prefix().expect("restore"), Some(16));
    assert_eq!(step(&mut e, &more, 16).unwrap(), want);
}

fn generate(id: u32, prompt: &str, n: u32, clear_kv: bool) -> String {
    json!({"cmd": "generate", "id": id, "prompt": prompt, "n_predict": n, "clear_kv": clear_kv})
        .to_string()
}

#[test]
fn a_continued_chat_and_decides_equal_fresh_runs() {
    let first = "The fox lived by the river";
    let mut s = SessionDriver::start(&lfm2(), &["-t", "2"]);
    let (a, _) = s.generate(&generate(1, first, 8, true));
    // The conversation so far, extended: the state stands one short of it (the last sampled
    // token was never fed), so the turn continues from there.
    let so_far = format!("{first}{}", a["text"].as_str().unwrap());
    let next = format!("{so_far} and then the fox");
    let (b, _) = s.generate(&generate(2, &next, 8, false));
    assert_eq!(s.close().0, 0);
    let mut fresh = SessionDriver::start(&lfm2(), &["-t", "2"]);
    let (c, _) = fresh.generate(&generate(1, &next, 8, true));
    assert_eq!(fresh.close().0, 0);
    assert_eq!(b["text"], c["text"], "continued {b}\nfresh {c}");
    assert!(
        b["n_reused"].as_u64().unwrap() > 0,
        "the continued turn reused the state: {b}"
    );

    // Decides: warm (the state kept between the prefill's steps, where the convolutions'
    // state stood, restored by the next decide of that prefix or one extending it) and cold
    // in one session, and each in a fresh session, score the same bits.
    bmoe_gates::assert_decides_equal_fresh(&lfm2());
}

/// The tiny lfm2moe file with the chat template of `stem` (`../shared/data/templates`).
fn with_template(stem: &str) -> Option<PathBuf> {
    bmoe_gates::tiny_with_template(&format!("lfm2moe-{stem}"), "lfm2moe", stem)
}

#[test]
fn its_templates_chat_in_a_session_with_their_reasoning_control() {
    // LFM2.5 always reasons (think_ctl none); LFM2-8B-A1B's template reads no flag.
    for (stem, ctl) in [("LFM2.5-8B-A1B", "none"), ("LFM2-8B-A1B", "template")] {
        let Some(m) = with_template(stem) else {
            return;
        };
        bmoe_gates::assert_template_chats(&m, "lfm2moe", Some(ctl), &["--chatml"]);
    }
}

/// A turn that keeps the previous prompt but not its answer continues from the state copied
/// at the prompt's end (`bmoe_gates::assert_turn_boundary_reuse`), resident and streamed.
#[test]
fn a_turn_that_shares_only_the_prompt_continues_from_the_turn_boundary() {
    let m = lfm2();
    bmoe_gates::assert_turn_boundary_reuse(&m, &["-t", "2"]);
    bmoe_gates::assert_turn_boundary_reuse(
        &m,
        &[
            "-t",
            "2",
            "--moe-stream",
            "--cache-mb",
            "2",
            "--force-cache",
        ],
    );
}
