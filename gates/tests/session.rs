//! Session gates (issue 15), the session served in-process over a pipe:
//! - S1, S2 (S2 under `--overlap`): a warm second `generate` — same prompt, new chat —
//!   streamed through an evicting cache equals the resident output, and so does the first.
//! - A multi-turn session recorded with `--route-trace` and `--csv` replays through
//!   `bmoe-sim replay` with every turn's hits, misses (hit rate) and read bytes exactly equal
//!   to the engine's, turn by turn, and `bmoe-sim diff --exact-only` agrees.

use bmoe_gates::{assert_session_replays_exactly, run, scratch_dir, tiny, SessionDriver};

const PROMPT: &str = "Once upon a time there was a little fox who lived by the river";

fn generate(id: u32, prompt: &str, n: u32, clear_kv: bool) -> String {
    serde_json::json!({"cmd": "generate", "id": id, "prompt": prompt, "n_predict": n, "clear_kv": clear_kv})
        .to_string()
}

fn warm_second_generate_equals_resident(extra: &[&str]) {
    let resident = run(&tiny(), &["-p", PROMPT, "-n", "16", "-t", "2"]);
    assert_eq!(resident.code, 0, "{}", resident.stderr);
    let mut args = vec![
        "-t",
        "2",
        "--moe-stream",
        "--cache-mb",
        "4",
        "--force-cache",
    ];
    args.extend_from_slice(extra);
    let mut s = SessionDriver::start(&tiny(), &args);
    let (first, _) = s.generate(&generate(1, PROMPT, 16, true));
    let (second, lines) = s.generate(&generate(2, PROMPT, 16, true));
    for d in [&first, &second] {
        assert_eq!(d["text"], resident.outcome.text.as_str(), "{extra:?}: {d}");
        assert_eq!(d["tokens"], 16);
        assert_eq!(d["cancelled"], false);
    }
    // The second turn ran on a warm, evicting cache: it hit, and it read.
    assert!(second["cache_hit_pct"].as_f64().unwrap() > 0.0, "{second}");
    assert!(second["read_mib"].as_f64().unwrap() > 0.0, "{second}");
    assert_eq!(
        lines.first().map(String::as_str),
        Some("BMOE_BEGIN {\"id\":2}")
    );
    let (code, err) = s.close();
    assert_eq!(code, 0, "{err}");
}

#[test]
fn s1_a_warm_second_generate_equals_the_resident_output() {
    warm_second_generate_equals_resident(&[]);
}

#[test]
fn s2_a_warm_second_generate_equals_the_resident_output_under_overlap() {
    warm_second_generate_equals_resident(&["--overlap"]);
}

#[test]
fn a_five_turn_session_replays_exactly_turn_by_turn() {
    let dir = scratch_dir("session-replay");
    let (csv, route) = (dir.join("engine.csv"), dir.join("engine.route.csv"));
    let flags = ["--cache-mb", "4", "--force-cache", "--io-threads", "3"];
    let mut args = vec!["-t", "2", "--moe-stream", "--chatml"];
    args.extend_from_slice(&flags);
    args.extend_from_slice(&[
        "--csv",
        csv.to_str().unwrap(),
        "--route-trace",
        route.to_str().unwrap(),
    ]);
    let mut s = SessionDriver::start(&tiny(), &args);
    // New chats and continued ones: a continued turn prefills only past the reused KV.
    for (i, (prompt, clear_kv)) in [
        ("Tell me about the fox", true),
        ("And the river?", false),
        ("Once upon a time", true),
        ("What happened next", false),
        ("The end", false),
    ]
    .iter()
    .enumerate()
    {
        let (done, _) = s.generate(&generate(i as u32, prompt, 8, *clear_kv));
        assert_eq!(done["tokens"], 8, "{done}");
    }
    let (code, err) = s.close();
    assert_eq!(code, 0, "{err}");

    let measured = assert_session_replays_exactly(&csv, &route, &flags);
    assert_eq!(measured.summaries.len(), 5, "one trailer per turn");
    let turns: Vec<u32> = measured.rows.iter().map(|r| r.turn).collect();
    assert_eq!(turns, (0..5u32).flat_map(|t| [t; 8]).collect::<Vec<_>>());
    for f in [csv, route] {
        let _ = std::fs::remove_file(f);
    }
}

/// The contract's token count in the session mode: `n_predict` N gives N `BMOE_PROGRESS`
/// lines with `step` 1..N of `steps` N, whose deltas join to `BMOE_DONE.text`, and
/// `tokens` N — turn after turn on one warm session, the same as the one-shot run.
#[test]
fn session_turns_of_1_2_and_32_tokens_report_that_many() {
    let mut s = SessionDriver::start(
        &tiny(),
        &[
            "-t",
            "2",
            "--moe-stream",
            "--cache-mb",
            "4",
            "--force-cache",
        ],
    );
    for (i, n) in [1u32, 2, 32, 1].into_iter().enumerate() {
        let (done, lines) = s.generate(&generate(i as u32, PROMPT, n, true));
        let progress: Vec<serde_json::Value> = lines
            .iter()
            .filter_map(|l| l.strip_prefix("BMOE_PROGRESS "))
            .map(|j| serde_json::from_str(j).expect("progress JSON"))
            .collect();
        assert_eq!(progress.len(), n as usize, "n_predict {n}");
        let mut text = String::new();
        for (k, v) in progress.iter().enumerate() {
            assert_eq!(
                (v["step"].as_u64(), v["steps"].as_u64()),
                (Some(k as u64 + 1), Some(u64::from(n)))
            );
            text.push_str(v["delta_text"].as_str().unwrap());
        }
        assert_eq!(done["tokens"], n);
        assert_eq!(
            done["text"].as_str(),
            Some(text.as_str()),
            "the deltas join to the answer"
        );
        let one_shot = run(&tiny(), &["-p", PROMPT, "-n", &n.to_string(), "-t", "2"]);
        assert_eq!(
            one_shot.outcome.text, text,
            "n_predict {n}: as the one-shot run"
        );
    }
    let (code, err) = s.close();
    assert_eq!(code, 0, "{err}");
}
