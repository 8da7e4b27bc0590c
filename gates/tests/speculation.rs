//! Speculative decoding (`--ngram`, issue 33): a verify decode over a drafted group must give
//! exactly the plain run's tokens — greedy and sampled, resident and streamed, on every
//! attention memory kind (a full KV and a sliding-window ring that rolls back) — and report
//! what it did in the contract's lines, columns and keys. A hybrid's recurrent state comes back
//! from the copy kept after the last confirmed row.

use bmoe_gates::{model, run, scratch_dir, tiny};
use std::path::Path;

/// A prompt that repeats itself, so prompt lookup finds matches from the first step; the tiny
/// models also fall into loops of their own, which it drafts from.
const PROMPT: &str = "one two three four five six one two three four five six one two three four five six one two three";

/// The tiny file of `arch` (seed 7) the gates speculate on.
fn spec_model(arch: &str) -> std::path::PathBuf {
    model(
        &format!("spec-{arch}"),
        &["--arch", arch, "--preset", "tiny", "--seed", "7"],
    )
}

/// The run's stderr line that starts with `prefix`.
fn line<'a>(stderr: &'a str, prefix: &str) -> &'a str {
    stderr
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} line in:\n{stderr}"))
}

/// Run plain and with `--ngram` (plus `spec`), assert the same tokens and text, and return
/// the speculated run's summary counters.
fn same_with_ngram(
    m: &Path,
    args: &[&str],
    spec: &[&str],
) -> bmoe_core::telemetry::summary::RunCounters {
    let mut a = vec!["-p", PROMPT, "-n", "64", "--ignore-eos"];
    a.extend_from_slice(args);
    let plain = run(m, &a);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    a.push("--ngram");
    a.extend_from_slice(spec);
    let ngram = run(m, &a);
    assert_eq!(ngram.code, 0, "{}", ngram.stderr);
    assert_eq!(
        ngram.outcome.tokens, plain.outcome.tokens,
        "--ngram {spec:?} {args:?} changed the tokens"
    );
    assert_eq!(ngram.stdout, plain.stdout);
    let s = ngram.outcome.summary.expect("a summary");
    assert_eq!(s.tokens(), 64);
    s.counters
}

#[test]
fn greedy_ngram_equals_plain_decoding_resident_and_streamed() {
    let m = tiny();
    for args in [
        &["--no-moe-stream"][..],
        &["--moe-stream", "--cache-mb", "0"],
        &[
            "--moe-stream",
            "--cache-mb",
            "2",
            "--force-cache",
            "--overlap",
        ],
    ] {
        for spec in [&["--ngram-min-match", "1", "--draft", "8"][..], &[]] {
            let c = same_with_ngram(&m, args, spec);
            // The run really verified drafts, some of them confirmed: otherwise equality
            // would say nothing about verification.
            assert!(
                c.drafted_steps > 0 && c.mtp_drafted > 0,
                "{args:?} {spec:?}: {c:?}"
            );
            assert!(
                c.mtp_accepted > 0,
                "{args:?} {spec:?}: nothing accepted: {c:?}"
            );
            assert!(
                c.mtp_accepted < c.mtp_drafted,
                "{args:?}: every draft accepted"
            );
            assert_eq!(
                64 - c.mtp_accepted,
                c.mtp_decodes,
                "each decode confirms its token and the accepted drafts"
            );
        }
    }
}

#[test]
fn sampled_ngram_draws_the_plain_runs_tokens_seed_by_seed() {
    // Verification draws once per output token from the row a plain decode would have drawn
    // from (crate::speculate): with a seeded sampler the tokens are the same, seed by seed,
    // so the output distribution over seeds is the plain one.
    let m = tiny();
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 1..=24 {
        let seed = seed.to_string();
        let args = [
            "--no-moe-stream",
            "--temp",
            "0.7",
            "--top-k",
            "8",
            "--seed",
            &seed,
        ];
        let c = same_with_ngram(&m, &args, &["--ngram-min-match", "1"]);
        drafted += c.mtp_drafted;
        accepted += c.mtp_accepted;
    }
    assert!(
        drafted > 0 && accepted > 0,
        "sampled runs verified nothing: {drafted} {accepted}"
    );
    assert!(accepted < drafted, "sampling accepted every draft");
}

#[test]
fn a_sliding_window_rolls_back_a_rejected_draft() {
    // Window 16: 83 positions wrap each ring several times, and every rejected draft is
    // fed again over ring slots a verify decode wrote.
    for arch in ["gemma4", "gpt-oss"] {
        let m = spec_model(arch);
        let c = same_with_ngram(&m, &["--no-moe-stream"], &["--ngram-min-match", "1"]);
        assert!(
            c.mtp_drafted > c.mtp_accepted,
            "{arch}: nothing rejected: {c:?}"
        );
        let c = same_with_ngram(
            &m,
            &["--moe-stream", "--cache-mb", "2", "--force-cache"],
            &["--ngram-min-match", "1", "--draft", "4"],
        );
        assert!(c.mtp_drafted > 0, "{arch} streamed: nothing drafted");
    }
}

#[test]
fn the_report_csv_and_done_keys_say_what_speculation_did() {
    let m = tiny();
    let dir = scratch_dir("speculation");
    let csv = dir.join("ngram.csv");
    let r = run(
        &m,
        &[
            "-p",
            PROMPT,
            "-n",
            "48",
            "--ignore-eos",
            "--moe-stream",
            "--cache-mb",
            "2",
            "--force-cache",
            "--ngram",
            "--ngram-min-match",
            "1",
            "--draft",
            "4",
            "--csv",
            csv.to_str().unwrap(),
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let c = r
        .outcome
        .summary
        .as_ref()
        .expect("summary")
        .counters
        .clone();
    let first = line(&r.stderr, "ngram: ");
    assert!(
        first.contains(&format!(
            "{}/{} drafts accepted",
            c.mtp_accepted, c.mtp_drafted
        )),
        "{first}"
    );
    assert!(
        first.contains(&format!("({} decodes for 48 tokens)", c.mtp_decodes)),
        "{first}"
    );
    assert!(r.stderr.contains("ngram: drafting costs "), "{}", r.stderr);
    assert!(
        r.stderr.contains(&format!(
            "ngram: drafted on {} of {} steps",
            c.drafted_steps, c.mtp_decodes
        )),
        "{}",
        r.stderr
    );
    let text = std::fs::read_to_string(&csv).unwrap();
    assert!(
        text.contains(" spec=ngram spec_draft_max=4 "),
        "preamble: {text}"
    );
    let header = text
        .lines()
        .find(|l| l.starts_with("step,"))
        .expect("a header");
    let cols: Vec<&str> = header.split(',').collect();
    let col = |name: &str| cols.iter().position(|c| *c == name).unwrap();
    let (batch, wall, read, draft) = (
        col("mtp_batch"),
        col("wall_ms"),
        col("read_bytes"),
        col("mtp_draft_ms"),
    );
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(rows.len(), 48);
    // Groups: a row with mtp_batch = m opens a group of m rows; the first carries the decode's
    // cost, the rest zeros; the groups are the decodes.
    let (mut i, mut groups, mut widest) = (0, 0u64, 0);
    while i < rows.len() {
        let m: usize = rows[i][batch].parse().unwrap();
        assert!(m >= 1 && i + m <= rows.len(), "row {i}: mtp_batch {m}");
        assert!(
            rows[i][wall].parse::<f64>().unwrap() > 0.0,
            "row {i} carries no cost"
        );
        for r in &rows[i + 1..i + m] {
            assert_eq!(r[batch], rows[i][batch], "a group's rows say its width");
            assert_eq!(r[wall].parse::<f64>().unwrap(), 0.0);
            assert_eq!(r[read], "0");
            assert_eq!(r[draft].parse::<f64>().unwrap(), 0.0);
        }
        widest = widest.max(m);
        groups += 1;
        i += m;
    }
    assert_eq!(groups, c.mtp_decodes);
    assert!(widest > 1, "no group confirmed more than its first token");
    for key in [
        "mtp_drafted=",
        "mtp_accepted=",
        "mtp_decodes=",
        "mtp_draft_s/tok=",
        "drafted_steps=",
    ] {
        assert!(text.contains(key), "trailer lacks {key}");
    }
    assert!(text.contains(&format!("mtp_decodes={}", c.mtp_decodes)));
}

/// Each `BMOE_PROGRESS` line's (reasoning, text) delta, in order.
fn deltas(stdout: &str) -> Vec<(String, String)> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("BMOE_PROGRESS "))
        .map(|j| {
            let v: serde_json::Value = serde_json::from_str(j).expect("progress JSON");
            let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
            (s("delta_reasoning"), s("delta_text"))
        })
        .collect()
}

#[test]
fn each_row_of_a_group_carries_its_own_tokens_text() {
    // A group's rows are written after its verify decode, yet each line's text is the one its
    // token added, line for line as in the plain run.
    let m = tiny();
    let a = [
        "-p",
        PROMPT,
        "-n",
        "40",
        "--ignore-eos",
        "--no-moe-stream",
        "--progress",
    ];
    let plain = run(&m, &a);
    let mut b = a.to_vec();
    b.extend_from_slice(&["--ngram", "--ngram-min-match", "1", "--draft", "6"]);
    let spec = run(&m, &b);
    let c = &spec.outcome.summary.as_ref().unwrap().counters;
    assert!(c.mtp_accepted > 0, "{c:?}");
    let (p, s) = (deltas(&plain.stdout), deltas(&spec.stdout));
    assert_eq!(p.len(), 40);
    assert_eq!(s, p);
}

#[test]
fn without_speculation_nothing_is_drafted_and_rows_are_single() {
    let r = run(
        &tiny(),
        &["-p", PROMPT, "-n", "16", "--ignore-eos", "--no-moe-stream"],
    );
    let c = &r.outcome.summary.as_ref().unwrap().counters;
    assert_eq!((c.mtp_drafted, c.mtp_decodes, c.drafted_steps), (0, 0, 0));
    assert!(!r.stderr.contains("ngram:"), "{}", r.stderr);
}

/// A recorded plain run of `m` (`-n n`, `args`) as `--draft-replay` takes it, with every
/// `every`-th generated token changed: drafts from it are confirmed up to a changed token
/// and rejected there. Returns the plain run's tokens and the recording's path.
fn spoiled_recording(
    m: &Path,
    tag: &str,
    n: usize,
    args: &[&str],
    every: usize,
) -> (Vec<u32>, std::path::PathBuf) {
    let dir = scratch_dir(&format!("speculation-spoiled-{tag}"));
    let rec = dir.join("rec");
    let n_s = n.to_string();
    let mut a = vec!["-p", PROMPT, "-n", &n_s, "--ignore-eos"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["--logits-out", rec.to_str().unwrap()]);
    let plain = run(m, &a);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    let json = dir.join("rec.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let n_prompt = v["n_prompt"].as_u64().unwrap() as usize;
    let ids = v["token_ids"].as_array_mut().unwrap();
    for (i, t) in ids.iter_mut().enumerate().skip(n_prompt) {
        if (i - n_prompt) % every == every - 1 {
            *t = serde_json::json!((t.as_u64().unwrap() + 1) % 4096);
        }
    }
    let spoiled = dir.join("spoiled.json");
    std::fs::write(&spoiled, v.to_string()).unwrap();
    (plain.outcome.tokens, spoiled)
}

#[test]
fn a_hybrid_takes_back_a_rejected_drafts_recurrent_state() {
    // A recurrent layer keeps its state after each row of a verify decode; the next step
    // starts from the one after the last confirmed row. Random-weight hybrids never repeat
    // themselves, so the drafts come from a recording of the plain run with every 3rd token
    // changed: groups confirmed in part, rejected at a changed token. Any wrong state
    // shows in the tokens.
    for arch in ["qwen35moe", "lfm2moe", "bailingmoe3"] {
        takes_back_rejected_drafts(arch);
    }
}

#[test]
fn latent_attention_verifies_drafts_as_plain_decoding() {
    // deepseek2's latent memory: a verify decode's rows are each a one-token decode's (the
    // per-head absorption products batched), and a rejected row's latent is written over.
    takes_back_rejected_drafts("deepseek2");
}

#[test]
fn compressed_attention_verifies_drafts_as_plain_decoding() {
    // deepseek4's memory: a verify decode's rows may finish a block (its compressed rows are
    // written from the group's rows) that a rejected draft then leaves behind; the rows the
    // next step writes over them, and its blocks, must be a plain run's.
    takes_back_rejected_drafts("deepseek4");
}

/// Drafts of `arch`'s plain run with every 3rd token spoiled, resident (`--draft` 3 and 8) and
/// streamed under overlap (`--draft` 4): the plain run's tokens, with groups both accepted
/// and rejected.
fn takes_back_rejected_drafts(arch: &str) {
    let m = spec_model(arch);
    for (args, draft) in [
        (&["--no-moe-stream"][..], "3"),
        (&["--no-moe-stream"], "8"),
        (
            &[
                "--moe-stream",
                "--cache-mb",
                "2",
                "--force-cache",
                "--overlap",
            ],
            "4",
        ),
    ] {
        let (plain, spoiled) = spoiled_recording(&m, arch, 40, args, 3);
        let mut b = vec!["-p", PROMPT, "-n", "40", "--ignore-eos"];
        b.extend_from_slice(args);
        b.extend_from_slice(&[
            "--draft-replay",
            spoiled.to_str().unwrap(),
            "--draft",
            draft,
        ]);
        let spec = run(&m, &b);
        assert_eq!(spec.code, 0, "{}", spec.stderr);
        assert_eq!(
            spec.outcome.tokens, plain,
            "{arch} {args:?} --draft {draft}"
        );
        let c = &spec.outcome.summary.as_ref().unwrap().counters;
        assert!(
            c.mtp_accepted > 0 && c.mtp_drafted > c.mtp_accepted,
            "{arch} {args:?}: nothing both accepted and rejected: {c:?}"
        );
        assert_eq!(40 - c.mtp_accepted, c.mtp_decodes, "{arch} {args:?}");
    }
}

#[test]
fn greedy_mtp_equals_plain_decoding_resident_and_streamed() {
    // The MTP head drafts from the trunk's hidden state; verification keeps the plain run's
    // tokens (a random head's drafts are almost all rejected: the recurrent state comes back
    // after the group's first row every time).
    let m = spec_model("qwen35moe");
    for args in [
        &["--no-moe-stream"][..],
        &[
            "--moe-stream",
            "--cache-mb",
            "2",
            "--force-cache",
            "--overlap",
        ],
    ] {
        let mut a = vec!["-p", PROMPT, "-n", "40", "--ignore-eos"];
        a.extend_from_slice(args);
        let plain = run(&m, &a);
        assert_eq!(plain.code, 0, "{}", plain.stderr);
        for draft in ["1", "3", "8"] {
            let mut b = a.clone();
            b.extend_from_slice(&["--mtp", "--draft", draft]);
            let mtp = run(&m, &b);
            assert_eq!(mtp.code, 0, "{}", mtp.stderr);
            assert_eq!(
                mtp.outcome.tokens, plain.outcome.tokens,
                "{args:?} --draft {draft}"
            );
            assert_eq!(mtp.stdout, plain.stdout);
            let s = mtp.outcome.summary.as_ref().unwrap();
            let c = &s.counters;
            assert!(c.mtp_drafted > 0 && c.drafted_steps > 0, "{args:?}: {c:?}");
            assert_eq!(40 - c.mtp_accepted, c.mtp_decodes, "{args:?}: {c:?}");
            assert!(
                s.mtp_draft_s_per_token() > 0.0,
                "drafting is a decode of the head"
            );
            let acc = line(&mtp.stderr, "mtp: ");
            assert!(acc.contains("drafts accepted"), "{acc}");
            assert!(mtp.stderr.contains("mtp: drafting costs"), "{}", mtp.stderr);
            assert!(!mtp.stderr.contains("ngram:"), "{}", mtp.stderr);
        }
    }
    // Sampled: one draw per output token from the row a plain decode draws from, so a seeded
    // run gives the plain run's tokens, seed by seed.
    for seed in ["1", "2", "3", "4"] {
        let a = [
            "-p",
            PROMPT,
            "-n",
            "24",
            "--ignore-eos",
            "--no-moe-stream",
            "--temp",
            "0.9",
            "--top-k",
            "4",
            "--seed",
            seed,
        ];
        let plain = run(&m, &a);
        let mut b = a.to_vec();
        b.extend_from_slice(&["--mtp", "--draft", "3"]);
        let mtp = run(&m, &b);
        assert_eq!(mtp.outcome.tokens, plain.outcome.tokens, "--seed {seed}");
        let c = &mtp.outcome.summary.as_ref().unwrap().counters;
        assert!(c.mtp_drafted > 0, "--seed {seed}: {c:?}");
    }
    // A floor no draft reaches: nothing drafted, every step plain.
    let b = [
        "-p",
        PROMPT,
        "-n",
        "12",
        "--ignore-eos",
        "--no-moe-stream",
        "--mtp",
        "--mtp-p-min",
        "1",
    ];
    let r = run(&m, &b);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let c = &r.outcome.summary.as_ref().unwrap().counters;
    assert_eq!((c.mtp_drafted, c.mtp_decodes), (0, 12), "{c:?}");
}

#[test]
fn bad_speculation_flags_are_refused_by_name() {
    let m = tiny();
    for (args, needle) in [
        (&["--ngram", "--draft", "9"][..], "--draft"),
        (&["--ngram", "--draft", "0"], "--draft"),
        (&["--ngram", "--ngram-min-match", "13"], "--ngram-min-match"),
        (&["--ngram", "--ngram-max-match", "65"], "--ngram-max-match"),
        (&["--ngram", "--logits-out", "/dev/null"], "--logits-out"),
        (
            &["--ngram", "--routing-from", "/dev/null"],
            "--routing-from",
        ),
        // The tiny qwen3moe file has no MTP head.
        (&["--mtp"], "nextn_predict_layers"),
        (&["--mtp", "--mtp-p-min", "1.5"], "--mtp-p-min"),
        (&["--mtp", "--logits-out", "/dev/null"], "--logits-out"),
        (&["--mtp-logits-out", "/dev/null"], "needs --mtp"),
    ] {
        let mut argv = vec!["bmoe-cli", "-m", m.to_str().unwrap(), "-p", "x", "-n", "2"];
        argv.extend_from_slice(args);
        let cli = bmoe_engine::cli::Cli::parse_argv(argv.iter().copied()).expect("parses");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let e = bmoe_engine::run::generate_with(&cli.run, &m, &mut out, &mut err)
            .expect_err(&format!("{args:?} was accepted"));
        assert!(format!("{e:#}").contains(needle), "{args:?}: {e:#}");
    }
    // Two draft sources: refused by the parser (exit 2).
    let argv = ["bmoe-cli", "-m", m.to_str().unwrap(), "--mtp", "--ngram"];
    let Err(e) = bmoe_engine::cli::Cli::parse_argv(argv.iter().copied()) else {
        panic!("--mtp with --ngram was accepted");
    };
    assert!(e.to_string().contains("--ngram"), "{e}");
}

#[test]
fn a_session_request_turns_speculation_on_and_off() {
    // The session was opened without --ngram; each request says. Every turn starts from a
    // cleared KV, so the three answers must be the same text.
    let m = tiny();
    let mut s = bmoe_gates::SessionDriver::start(
        &m,
        &[
            "-n",
            "40",
            "--ignore-eos",
            "--no-moe-stream",
            "--ngram-min-match",
            "1",
        ],
    );
    let prompt = serde_json::to_string(PROMPT).unwrap();
    let mut texts = Vec::new();
    for (id, ngram) in [(1, "true"), (2, "false"), (3, "true")] {
        let (done, _) = s.generate(&format!(
            r#"{{"cmd":"generate","id":{id},"prompt":{prompt},"ngram":{ngram}}}"#
        ));
        let decodes = done["mtp_decodes"].as_u64().expect("mtp_decodes");
        if ngram == "true" {
            assert!(decodes > 0 && decodes < 40, "request {id}: {done}");
            assert!(done["mtp_accepted"].as_u64().unwrap() > 0, "{done}");
            assert_eq!(
                done["mtp_decodes"].as_u64().unwrap() + done["mtp_accepted"].as_u64().unwrap(),
                40
            );
        } else {
            assert_eq!(decodes, 0, "request {id}: {done}");
        }
        texts.push(done["text"].as_str().unwrap().to_string());
    }
    assert_eq!(texts[0], texts[1]);
    assert_eq!(texts[1], texts[2]);
    let (code, err) = s.close();
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_session_whose_requests_turn_speculation_on_and_off_replays_exactly() {
    // Session traces always number their steps; each turn's end line says whether it
    // speculated, so the replay counts `mtp_*` for the turns that did and for no other.
    let m = tiny();
    let dir = scratch_dir("speculation-session-replay");
    let (csv, route) = (dir.join("e.csv"), dir.join("e.route.csv"));
    let cache = ["--moe-stream", "--cache-mb", "3", "--force-cache"];
    let mut args = vec![
        "-n",
        "24",
        "--ignore-eos",
        "--ngram-min-match",
        "1",
        "--csv",
    ];
    args.push(csv.to_str().unwrap());
    args.extend_from_slice(&["--route-trace", route.to_str().unwrap()]);
    args.extend_from_slice(&cache);
    let mut s = bmoe_gates::SessionDriver::start(&m, &args);
    let prompt = serde_json::to_string(PROMPT).unwrap();
    let mut drafted = Vec::new();
    for (id, ngram) in [(1, "true"), (2, "false"), (3, "true")] {
        let (done, _) = s.generate(&format!(
            r#"{{"cmd":"generate","id":{id},"prompt":{prompt},"ngram":{ngram}}}"#
        ));
        drafted.push(done["mtp_decodes"].as_u64().unwrap());
    }
    let (code, err) = s.close();
    assert_eq!(code, 0, "{err}");
    assert!(
        drafted[0] > 0 && drafted[1] == 0 && drafted[2] > 0,
        "{drafted:?}"
    );
    bmoe_gates::assert_session_replays_exactly(&csv, &route, &cache[1..]);
}

#[test]
fn a_session_request_turns_the_mtp_head_on_and_off() {
    // A --mtp session drafts by default; a request may turn the head off (or ask for n-gram
    // drafts instead, saying so). Every turn starts from a cleared KV: the same text each time.
    let m = spec_model("qwen35moe");
    let args = ["-n", "24", "--ignore-eos", "--no-moe-stream"];
    let mut s = bmoe_gates::SessionDriver::start(&m, &[&args[..], &["--mtp"]].concat());
    let prompt = serde_json::to_string(PROMPT).unwrap();
    let mut texts = Vec::new();
    for (id, extra, drafts) in [
        (1, "", true),
        (2, r#","mtp":false"#, false),
        (3, r#","mtp":false,"ngram":true"#, false),
        (4, r#","mtp":true"#, true),
    ] {
        let (done, _) = s.generate(&format!(
            r#"{{"cmd":"generate","id":{id},"prompt":{prompt}{extra}}}"#
        ));
        let drafted = done["mtp_drafted"].as_u64().expect("mtp_drafted");
        if drafts {
            assert!(drafted > 0, "request {id}: {done}");
        }
        if id == 2 {
            assert_eq!(done["mtp_decodes"].as_u64(), Some(0), "{done}");
        }
        texts.push(done["text"].as_str().unwrap().to_string());
    }
    assert!(texts.iter().all(|t| *t == texts[0]), "{texts:?}");
    // Both sources at once: refused, and the session goes on.
    s.send(&format!(
        r#"{{"cmd":"generate","id":5,"prompt":{prompt},"ngram":true}}"#
    ));
    let l = s.read_until(&["BMOE_DONE", "BMOE_ERROR"]);
    assert!(l.last().unwrap().contains("one draft source"), "{l:?}");
    let (code, err) = s.close();
    assert_eq!(code, 0, "{err}");
    // A session without --mtp refuses a request for the head by name.
    let mut s = bmoe_gates::SessionDriver::start(&m, &args);
    s.send(&format!(
        r#"{{"cmd":"generate","id":1,"prompt":{prompt},"mtp":true}}"#
    ));
    let l = s.read_until(&["BMOE_DONE", "BMOE_ERROR"]);
    assert!(l.last().unwrap().contains("started with --mtp"), "{l:?}");
    let (code, err) = s.close();
    assert_eq!(code, 0, "{err}");
}

#[test]
fn replayed_drafts_of_the_same_run_are_all_accepted() {
    // The benchmark's ceiling hook (--draft-replay): drafting what a recorded greedy run
    // generated next accepts every draft and changes nothing.
    let m = tiny();
    let dir = scratch_dir("speculation-replay");
    let rec = dir.join("rec");
    let a = ["-p", PROMPT, "-n", "33", "--ignore-eos", "--no-moe-stream"];
    let mut r = a.to_vec();
    r.extend_from_slice(&["--logits-out", rec.to_str().unwrap()]);
    let plain = run(&m, &r);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    let json = dir.join("rec.json");
    let mut b = a.to_vec();
    b.extend_from_slice(&["--draft-replay", json.to_str().unwrap(), "--draft", "4"]);
    let replay = run(&m, &b);
    assert_eq!(replay.outcome.tokens, plain.outcome.tokens);
    let c = &replay.outcome.summary.as_ref().unwrap().counters;
    assert_eq!(c.mtp_accepted, c.mtp_drafted);
    assert_eq!(
        c.mtp_decodes,
        33 / 5 + 1,
        "groups of 5 and a last token: {c:?}"
    );
}

/// Each data row of a `bmoe_metrics` CSV as (mtp_batch, read_bytes, cache_hit_pct).
fn csv_rows(text: &str) -> Vec<(String, String, String)> {
    let mut lines = text.lines().filter(|l| !l.starts_with('#'));
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |n: &str| header.iter().position(|c| *c == n).expect(n);
    let (b, r, h) = (col("mtp_batch"), col("read_bytes"), col("cache_hit_pct"));
    lines
        .map(|l| {
            let c: Vec<&str> = l.split(',').collect();
            (c[b].to_string(), c[r].to_string(), c[h].to_string())
        })
        .collect()
}

/// The `# summary` trailer's value of `key`.
fn trailer<'a>(text: &'a str, key: &str) -> &'a str {
    trailer_opt(text, key).unwrap_or_else(|| panic!("no {key} in the trailer"))
}

/// The `# summary` trailer's value of `key`, `None` when the trailer has no such key.
fn trailer_opt<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find(|l| l.starts_with("# summary"))
        .and_then(|l| {
            l.split(' ')
                .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        })
}

/// Run `m` with `engine` (a CSV and a route trace added), replay its trace through `bmoe-sim
/// replay` with `sim` (the same outputs added), and hold the replay to the run: the same route
/// trace byte for byte, the same rows, every exact summary key (`tokens`, reads, evictions and
/// speculation's `mtp_*` among them). Returns the run, both CSVs and the simulator's stdout.
fn engine_and_replay(
    m: &Path,
    tag: &str,
    engine: &[&str],
    sim: &[&str],
) -> (bmoe_gates::Run, String, String, String) {
    let dir = scratch_dir("speculation-sim");
    let [ecsv, eroute, scsv, sroute] =
        ["e.csv", "e.route.csv", "s.csv", "s.route.csv"].map(|f| dir.join(format!("{tag}-{f}")));
    let (ecsv_s, eroute_s) = (ecsv.to_str().unwrap(), eroute.to_str().unwrap());
    let outputs = ["--csv", ecsv_s, "--route-trace", eroute_s];
    let e = run(m, &[engine, &outputs[..]].concat());
    assert_eq!(e.code, 0, "{tag}: {}", e.stderr);
    let replay = [
        "replay",
        "--trace",
        eroute_s,
        "--profile",
        "this-machine",
        "--csv",
        scsv.to_str().unwrap(),
        "--route-trace",
        sroute.to_str().unwrap(),
    ];
    let (code, out, err) = bmoe_gates::sim(&[&replay[..], sim].concat());
    assert_eq!(code, 0, "{tag}: {err}");
    assert!(
        std::fs::read_to_string(&eroute).unwrap() == std::fs::read_to_string(&sroute).unwrap(),
        "{tag}: the replayed route trace differs"
    );
    let (ec, sc) = (
        std::fs::read_to_string(&ecsv).unwrap(),
        std::fs::read_to_string(&scsv).unwrap(),
    );
    assert_eq!(csv_rows(&ec), csv_rows(&sc), "{tag}: rows");
    // Every exact key, present in both or in neither (`bypasses` is written only under a
    // policy that filters admission).
    for key in bmoe_sim::diff::EXACT_SUMMARY_KEYS {
        assert_eq!(trailer_opt(&ec, key), trailer_opt(&sc, key), "{tag}: {key}");
    }
    assert!(
        trailer_opt(&ec, "tokens").is_some(),
        "{tag}: no tokens in the trailer"
    );
    (e, ec, sc, out)
}

#[test]
fn the_simulator_replays_a_speculative_run_exactly() {
    // The route trace numbers its steps (group column), so each verify decode replays as the
    // one step it was, its rejected positions fed again by the next: the same reads, hits and
    // evictions, the same groups and counters.
    let m = tiny();
    let dir = scratch_dir("speculation-sim");
    for (tag, extra) in [
        ("serial", &["--cache-mb", "3"][..]),
        ("overlap", &["--cache-mb", "5", "--overlap"]),
    ] {
        let common = [&["--force-cache", "--io-threads", "3"][..], extra].concat();
        let engine = [
            "-p",
            PROMPT,
            "-n",
            "40",
            "--ignore-eos",
            "-t",
            "2",
            "--moe-stream",
            "--ngram",
            "--ngram-min-match",
            "1",
            "--draft",
            "4",
        ];
        let (_, ec, _, out) = engine_and_replay(&m, tag, &[&engine[..], &common].concat(), &common);
        assert!(out.contains("ngram: "), "{tag}: {out}");
        let et = std::fs::read_to_string(dir.join(format!("{tag}-e.route.csv"))).unwrap();
        assert!(et.lines().nth(3).unwrap_or("").ends_with(",group") || et.contains(",group\n"));
        assert!(
            trailer(&ec, "mtp_accepted") != "0",
            "{tag}: nothing accepted"
        );
    }
    // An --mtp run on a hybrid: every step's last layer routes every row (the head's input),
    // and the verify groups replay as they were.
    let cache = ["--cache-mb", "3", "--force-cache", "--io-threads", "3"];
    let engine = [
        "-p",
        PROMPT,
        "-n",
        "24",
        "--ignore-eos",
        "--moe-stream",
        "--mtp",
    ];
    let (_, ec, _, out) = engine_and_replay(
        &spec_model("qwen35moe"),
        "mtp",
        &[&engine[..], &cache].concat(),
        &cache,
    );
    assert!(out.contains("mtp: "), "{out}");
    assert!(ec.contains("spec=mtp"), "{ec}");
    assert_ne!(trailer(&ec, "mtp_drafted"), "0");
    // A turn that meets its end-of-generation token inside a verify decode: the drafts come
    // from a recording of the plain run (which stops at that token) with one token appended,
    // so the last group feeds a row past the end. The trace's turn-end line says how many
    // tokens the turn generated; the replay confirms no more.
    let m = tiny();
    let rec = dir.join("eog");
    let short = ["-p", "a b c d e f g", "-n", "200", "--no-moe-stream"];
    let plain = run(
        &m,
        &[&short[..], &["--logits-out", rec.to_str().unwrap()]].concat(),
    );
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    let n_plain = plain.outcome.tokens.len();
    assert!(
        n_plain < 200,
        "the tiny model must stop at its end-of-generation token"
    );
    let json = dir.join("eog.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    v["token_ids"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!(5));
    let plus = dir.join("eog-plus.json");
    std::fs::write(&plus, v.to_string()).unwrap();
    let cache = ["--cache-mb", "3", "--force-cache"];
    let engine = [
        "-p",
        "a b c d e f g",
        "-n",
        "200",
        "--moe-stream",
        "--draft-replay",
        plus.to_str().unwrap(),
        "--draft",
        "4",
    ];
    let (e, ec, _, _) = engine_and_replay(&m, "eog", &[&engine[..], &cache].concat(), &cache);
    assert_eq!(e.outcome.tokens, plain.outcome.tokens);
    assert!(trailer(&ec, "tokens").parse::<usize>().unwrap() < 200);
    assert_ne!(
        trailer(&ec, "mtp_accepted"),
        trailer(&ec, "mtp_drafted"),
        "the row past the end was drafted and not confirmed"
    );
    // A speculative trace without the group column (an older writer's) is refused, by name.
    let text = std::fs::read_to_string(dir.join("serial-e.route.csv")).unwrap();
    let stripped: String = text
        .lines()
        .map(|l| match l.starts_with('#') {
            true => l.to_string(),
            false => l.rsplit_once(',').map_or(l, |(h, _)| h).to_string(),
        })
        .map(|l| l + "\n")
        .collect();
    let old = dir.join("old.route.csv");
    std::fs::write(&old, stripped).unwrap();
    let (code, _, err) = bmoe_gates::sim(&[
        "replay",
        "--trace",
        old.to_str().unwrap(),
        "--profile",
        "this-machine",
        "--cache-mb",
        "3",
        "--force-cache",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("group column"), "{err}");
}
