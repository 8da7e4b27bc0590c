//! G18 — decide (issue 15 item 5), on the tiny synthetic model:
//! - G18a: a restored prefix state is a real restore: the KV rows of the prefix are put back bit
//!   for bit even after everything was overwritten, and the suffix's logits equal a cold
//!   prefill's.
//! - G18b: over a session, a decide whose prefix was restored (equal prefix, or one extending
//!   it) gives bit-identical `choice_logp` to a cold one (`reuse_prefix:false`, and a fresh
//!   session), with only the tokens past the kept prefix prefilled.
//! - G18c: resident == streamed: the same decides through an evicting expert cache (serial and
//!   `--overlap`) give the resident run's `choice_logp` bit for bit.
//! - G18d: a `generate` after decides is unaffected: a new chat, and a continued one, answer
//!   exactly as in a session that never decided.
//! - G18e: a session trace with decides replays through `bmoe-sim replay` turn by turn with the
//!   engine's hits, misses and read bytes.

use bmoe_core::records::{NullSink, Phase};
use bmoe_core::{Backend, StepInput};
use bmoe_engine::cli::Cli;
use bmoe_gates::{
    assert_session_replays_exactly, decide_request as decide, logp_bits, scratch_dir, tiny,
    SessionDriver,
};
use clap::Parser;
use serde_json::{json, Value};

const PREFIX: &str = "The fox lived by the river and ate berries every morning. ";

fn generate(id: u32, prompt: &str, n: u32, clear_kv: bool) -> String {
    json!({"cmd": "generate", "id": id, "prompt": prompt, "n_predict": n, "clear_kv": clear_kv})
        .to_string()
}

const STREAMED: [&str; 6] = [
    "--moe-stream",
    "--cache-mb",
    "4",
    "--force-cache",
    "--io-threads",
    "2",
];

fn session(extra: &[&str]) -> SessionDriver {
    let mut args = vec!["-t", "2", "--decide", "--chatml"];
    args.extend_from_slice(extra);
    SessionDriver::start(&tiny(), &args)
}

#[test]
fn g18a_a_restored_kv_prefix_is_put_back_bit_for_bit() {
    let model = tiny();
    let cli =
        Cli::try_parse_from(["bmoe-cli", "-m", model.to_str().unwrap(), "-t", "2"]).expect("args");
    let load = || {
        bmoe_engine::run::load(&cli.run, &model, &mut Vec::new())
            .expect("load")
            .engine
    };
    let step = |e: &mut bmoe_engine::run::EngineStep, tokens: &[u32], from: u32| -> Vec<u32> {
        let positions: Vec<u32> = (from..from + tokens.len() as u32).collect();
        e.step(
            &StepInput {
                turn: 0,
                phase: Phase::Prefill,
                tokens,
                positions: &positions,
            },
            &mut NullSink,
        )
        .expect("step");
        e.backend()
            .last_logits()
            .expect("logits")
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    let prompt: Vec<u32> = (300..316).collect();
    let junk: Vec<u32> = (900..916).collect();
    let p = 9usize;

    let mut cold = load();
    let want = step(&mut cold, &prompt, 0);

    let mut e = load();
    step(&mut e, &prompt[..12], 0);
    let bytes = e.backend_mut().keep_prefix(p as u32).expect("keep");
    assert!(bytes.is_some_and(|b| b > 0), "the engine keeps KV state");
    // Everything overwritten, the prefix included.
    step(&mut e, &junk, 0);
    assert_eq!(
        e.backend_mut().restore_prefix().expect("restore"),
        Some(p as u32)
    );
    assert_eq!(
        step(&mut e, &prompt[p..], p as u32),
        want,
        "restored + suffix == cold"
    );

    // Without the restore the overwritten rows show: the restore is what makes it equal.
    e.backend_mut().drop_prefix();
    assert_eq!(e.backend_mut().restore_prefix().expect("restore"), None);
    step(&mut e, &junk, 0);
    assert_ne!(step(&mut e, &prompt[p..], p as u32), want);
}

/// The decide sequence of G18b/c: cold, an equal prefix, an extended prefix, each restored;
/// every one also asked cold. Returns every `BMOE_DECIDE`.
fn decide_sequence(s: &mut SessionDriver) -> Vec<Value> {
    let mut out = Vec::new();
    let longer = format!("{PREFIX}It slept under an old oak. ");
    for (i, (prefix, suffix)) in [
        (PREFIX, "Did the fox eat berries?"),
        (PREFIX, "Was the river dry?"),
        (longer.as_str(), "Did it sleep?"),
    ]
    .into_iter()
    .enumerate()
    {
        let (warm, lines) = s.decide(&decide(10 + i as u32, prefix, suffix, true));
        assert_eq!(lines.len(), 2, "BMOE_BEGIN then BMOE_DECIDE: {lines:?}");
        assert!(lines[0].starts_with("BMOE_BEGIN "));
        let n = warm["n_tokens"].as_u64().unwrap();
        let reused = warm["n_reused"].as_u64().unwrap();
        assert_eq!(warm["n_prefilled"].as_u64().unwrap(), n - reused, "{warm}");
        assert!(warm["prefix_state_mib"].as_f64().unwrap() > 0.0, "{warm}");
        if i == 0 {
            assert_eq!(reused, 0, "nothing kept yet: {warm}");
        } else {
            assert!(reused > 0, "the kept prefix was restored: {warm}");
        }
        let (cold, _) = s.decide(&decide(20 + i as u32, prefix, suffix, false));
        assert_eq!(cold["n_reused"], 0, "{cold}");
        assert_eq!(cold["n_prefilled"].as_u64().unwrap(), n);
        assert_eq!(
            logp_bits(&warm),
            logp_bits(&cold),
            "decide {i}: restored == cold"
        );
        assert_eq!(warm["best"], cold["best"]);
        out.push(warm);
    }
    out
}

#[test]
fn g18b_c_restored_equals_cold_and_resident_equals_streamed() {
    let mut resident = session(&[]);
    let want = decide_sequence(&mut resident);
    assert_eq!(resident.close().0, 0);
    // Each decide on a fresh session: the same scores.
    for (i, w) in want.iter().enumerate() {
        let mut fresh = session(&[]);
        let prefix = if i < 2 {
            PREFIX.to_string()
        } else {
            format!("{PREFIX}It slept under an old oak. ")
        };
        let suffix = [
            "Did the fox eat berries?",
            "Was the river dry?",
            "Did it sleep?",
        ][i];
        let (d, _) = fresh.decide(&decide(1, &prefix, suffix, true));
        assert_eq!(logp_bits(&d), logp_bits(w), "fresh session, decide {i}");
        fresh.close();
    }
    for extra in [&[][..], &["--overlap"][..]] {
        let mut args = STREAMED.to_vec();
        args.extend_from_slice(extra);
        let mut streamed = session(&args);
        let got = decide_sequence(&mut streamed);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                logp_bits(g),
                logp_bits(w),
                "{extra:?} decide {i}: streamed == resident"
            );
            assert_eq!((&g["best"], &g["n_reused"]), (&w["best"], &w["n_reused"]));
            // Streamed through the cache: it read experts for the prefill.
            assert!(g["prefill_read_mib"].as_f64().unwrap() > 0.0, "{g}");
        }
        assert_eq!(streamed.close().0, 0);
    }
}

/// `--decide-prefix-cache off`: nothing kept, every decide prefills its whole render, and the
/// scores are the same.
#[test]
fn g18_the_prefix_cache_off_keeps_nothing_and_scores_the_same() {
    let mut on = session(&[]);
    let mut off = session(&["--decide-prefix-cache", "off"]);
    for (i, suffix) in ["Did the fox eat berries?", "Was the river dry?"]
        .into_iter()
        .enumerate()
    {
        let (a, _) = on.decide(&decide(i as u32, PREFIX, suffix, true));
        let (b, _) = off.decide(&decide(i as u32, PREFIX, suffix, true));
        assert_eq!(
            (&b["n_reused"], &b["prefix_state_mib"]),
            (&json!(0), &json!(0.0)),
            "{b}"
        );
        assert_eq!(b["n_prefilled"], a["n_tokens"]);
        assert_eq!(logp_bits(&a), logp_bits(&b));
    }
    on.close();
    off.close();
}

#[test]
fn g18d_a_generate_after_decides_is_unaffected() {
    let chat = [("Tell me about the fox", true), ("And the river?", false)];
    let mut plain = session(&STREAMED);
    let mut want = Vec::new();
    for (i, (p, clear)) in chat.iter().enumerate() {
        want.push(plain.generate(&generate(i as u32, p, 12, *clear)).0);
    }
    assert_eq!(plain.close().0, 0);

    let mut mixed = session(&STREAMED);
    mixed.decide(&decide(100, PREFIX, "Is it about animals?", true));
    mixed.decide(&decide(101, PREFIX, "Is it about cars?", true));
    let (first, _) = mixed.generate(&generate(0, chat[0].0, 12, true));
    // Decides between the turns of a chat: the KV now holds the decide's prompt, and the
    // continued turn still answers exactly as without them.
    let (d, _) = mixed.decide(&decide(102, PREFIX, "Is it night?", true));
    assert_eq!(
        d["n_reused"], 0,
        "the generate dropped the kept prefix: {d}"
    );
    let (second, _) = mixed.generate(&generate(1, chat[1].0, 12, false));
    // The decide displaced the chat from the KV, so the continued turn prefilled more than it
    // did without it — and still answers the same.
    assert!(
        second["n_prompt"].as_u64() > want[1]["n_prompt"].as_u64(),
        "{second} vs {}",
        want[1]
    );
    for (got, w) in [first, second].iter().zip(&want) {
        assert_eq!(got["text"], w["text"], "{got}");
        assert_eq!(got["tokens"], w["tokens"]);
        assert_eq!(got["n_past"], w["n_past"]);
    }
    assert_eq!(mixed.close().0, 0);
}

#[test]
fn g18e_a_session_with_decides_replays_turn_by_turn() {
    let dir = scratch_dir("decide-replay");
    let tag = std::process::id();
    let (csv, route) = (
        dir.join(format!("engine-{tag}.csv")),
        dir.join(format!("engine-{tag}.route.csv")),
    );
    let mut args = STREAMED.to_vec();
    args.extend_from_slice(&[
        "--csv",
        csv.to_str().unwrap(),
        "--route-trace",
        route.to_str().unwrap(),
    ]);
    let mut s = session(&args);
    s.generate(&generate(0, "Tell me about the fox", 6, true));
    s.decide(&decide(1, PREFIX, "Is it about animals?", true));
    let (d, _) = s.decide(&decide(2, PREFIX, "Is it about cars?", true));
    assert!(d["n_reused"].as_u64().unwrap() > 0);
    s.generate(&generate(3, "And the river?", 6, false));
    assert_eq!(s.close().0, 0);

    let measured = assert_session_replays_exactly(&csv, &route, &STREAMED[1..]);
    assert_eq!(
        measured.summaries.len(),
        4,
        "a summary per turn, decides included"
    );
    assert_eq!(measured.summaries[1].get("tokens"), Some("0"));
    for f in [csv, route] {
        let _ = std::fs::remove_file(f);
    }
}
