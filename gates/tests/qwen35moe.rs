//! qwen35moe beyond the per-architecture table of `archs.rs` (issue 32 items 4 and 5): its
//! recurrent (Gated DeltaNet) state carried across batches and turns.
//!
//! - Through the engine's backend: a prompt fed in pieces (the state continued where it
//!   stands) gives a fresh prefill's logits bit for bit, resident and streamed through an
//!   evicting cache; a kept prefix state is restored exactly, and one that moved on is never
//!   kept (a recurrent state cannot roll back).
//! - In a session: a turn that appends to the last continues the state over every position
//!   fed; with Qwen3.5's chat template (`think_ctl` `template`) a chat and decides run, and a
//!   decide scores alike whether it may reuse a kept prefix or not, resident and streamed.

use bmoe_gates::{model, SessionDriver};
use std::path::PathBuf;

/// The tiny qwen35moe file (DeltaNet, attention, DeltaNet, attention; an MTP block).
fn tiny35() -> PathBuf {
    model(
        "qwen35moe-tiny",
        &["--arch", "qwen35moe", "--preset", "tiny", "--seed", "7"],
    )
}

/// The tiny file with Qwen3.5's chat template.
fn chat35() -> Option<PathBuf> {
    bmoe_gates::tiny_with_template("qwen35moe-chat", "qwen35moe", "Qwen3.5-4B")
}

const STREAMED: [&str; 6] = [
    "--moe-stream",
    "--cache-mb",
    "2",
    "--force-cache",
    "--io-threads",
    "2",
];

#[test]
fn a_continued_recurrent_state_gives_a_fresh_prefills_bits() {
    bmoe_gates::assert_recurrent_state_continues_exactly(&tiny35());
}

fn ready_json(d: &SessionDriver) -> serde_json::Value {
    let l = d
        .lines
        .iter()
        .find(|l| l.starts_with("BMOE_READY "))
        .expect("ready line");
    serde_json::from_str(l.split_once(' ').unwrap().1).unwrap()
}

/// A raw-text session whose second turn appends to the first (a pure append: the state
/// stands where the new tokens begin) continues the recurrent state over every position the
/// first turn fed, and answers alike resident and streamed through an evicting cache.
#[test]
fn a_continued_session_reuses_the_state_where_it_stands() {
    let m = tiny35();
    let gen = |id: u32, p: &str, clear: bool| {
        serde_json::json!({"cmd": "generate", "id": id, "prompt": p, "n_predict": 12,
            "clear_kv": clear})
        .to_string()
    };
    let mut runs = Vec::new();
    for extra in [
        &["-t", "2"][..],
        &[&["-t", "2"][..], &STREAMED[..]].concat()[..],
    ] {
        let mut s = SessionDriver::start(&m, extra);
        let (a, _) = s.generate(&gen(
            1,
            "Once upon a time there was a little fox who lived by the river",
            true,
        ));
        let (b, _) = s.generate(&gen(2, " and the river froze in winter", false));
        let (c, _) = s.generate(&gen(3, " so the fox slept", false));
        for (prev, next) in [(&a, &b), (&b, &c)] {
            assert_eq!(next["n_reused"], prev["n_past"], "{extra:?}: {next}");
        }
        assert_eq!(s.close().0, 0);
        runs.push([a, b, c].map(|d| d["text"].clone()));
    }
    assert_eq!(runs[0], runs[1], "streamed == resident");
}

/// Qwen3.5's template in a chat session: `think_ctl` `template`, three turns of one chat, and
/// decides whose scores are the same whether they may reuse a kept prefix or not (a recurrent
/// state is kept only where it stands), resident and streamed alike.
#[test]
fn qwen35_chat_sessions_and_decides() {
    let Some(m) = chat35() else {
        return;
    };
    let turns = [
        "Tell me about the fox that lived by the river",
        "And where did it sleep in winter",
        "Was it happy",
    ];
    let prefix = "A fox lived by a river and ate berries every morning. ";
    let mut runs = Vec::new();
    for extra in [&[][..], &STREAMED[..]] {
        let mut s = SessionDriver::start(
            &m,
            &[&["--chatml", "--decide", "-t", "2"][..], extra].concat(),
        );
        let ready = ready_json(&s);
        assert_eq!(ready["arch"], "qwen35moe", "{ready}");
        assert_eq!(ready["think_ctl"], "template", "{ready}");
        let mut got = Vec::new();
        for (i, p) in turns.iter().enumerate() {
            let req = serde_json::json!({"cmd": "generate", "id": i, "prompt": p,
                "n_predict": 16, "think": false, "clear_kv": i == 0});
            let (done, _) = s.generate(&req.to_string());
            assert_eq!(done["tokens"], 16, "{done}");
            // A re-rendered chat is not a pure append (the template drops the empty think
            // block of the answered turn): the turn continues from the state copied at the
            // previous prompt's end, never from a wrong one.
            if i > 0 {
                assert!(done["n_reused"].as_u64() > Some(0), "{done}");
            }
            got.push(done["text"].clone());
            got.push(done["n_reused"].clone());
        }
        for (i, suffix) in ["Was it happy?", "Did it eat?"].iter().enumerate() {
            let d = |id: u32, reuse: bool| {
                serde_json::json!({"cmd": "decide", "id": id, "prefix": prefix,
                    "suffix": suffix, "choices": ["yes", "no", "maybe"],
                    "reuse_prefix": reuse})
                .to_string()
            };
            let (warm, _) = s.decide(&d(10 + i as u32, true));
            let (cold, _) = s.decide(&d(20 + i as u32, false));
            assert_eq!(warm["choice_logp"], cold["choice_logp"], "{warm} {cold}");
            got.push(warm["choice_logp"].clone());
        }
        assert_eq!(s.close().0, 0);
        runs.push(got);
    }
    assert_eq!(runs[0], runs[1], "streamed == resident");
}

/// The full Qwen3.6-35B-A3B shape (`qwen3.6-35b-a3b-shape`: d_model 2048, DeltaNet of 16 key
/// and 32 value heads of 128 over 8192 conv channels, attention of 16 heads of 256 with 64
/// rotated dimensions in sections 11/11/10, a shared expert, an MTP block) cut to 4 layers
/// (three DeltaNet, one attention) and 4 experts so CI can afford it: llama.cpp loads our
/// file and its logits match ours position by position. In Q8_0: this shape's random weights
/// are chaotic enough that Q4_K_M moves its own logits to a median cosine of 0.96 against F32
/// (Q8_0: 0.9996), so the tiny files of `archs.rs` are the ones held to parity in Q4_K_M.
#[test]
fn the_full_qwen35moe_shape_loads_in_llama_cpp_and_matches() {
    use bmoe_gates::llama::{ours, parity, py_batch, python_ready};
    if !python_ready() {
        return;
    }
    let m = model(
        "qwen3.6-35b-a3b-shape-cut",
        &[
            "--preset",
            "qwen3.6-35b-a3b-shape",
            "--layers",
            "4",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--type",
            "q8_0",
        ],
    );
    let dir = bmoe_gates::scratch_dir("qwen35moe-shape");
    let mine = dir.join("ours.f32");
    ours(&m, &mine);
    let ids = format!("{}.json", mine.display());
    let side: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ids).unwrap()).unwrap();
    let n_vocab = side["n_vocab"].as_u64().unwrap().to_string();
    let reference = dir.join("ref.f32");
    let result = dir.join("cmp.json");
    py_batch(
        &dir,
        "shape",
        &[
            serde_json::json!({"op": "logits", "args": [&m, &ids, &reference]}),
            serde_json::json!({"op": "compare", "out": &result,
                "args": [&mine, &reference, n_vocab]}),
        ],
    );
    let p = parity(
        &std::fs::read_to_string(&result).unwrap(),
        "qwen3.6-35b-a3b-shape (4 layers, 4 experts) q8_0",
    );
    assert!(p.rows >= 100, "{} positions", p.rows);
    assert!(
        p.good >= 0.98,
        "top-1 with cos >= 0.999 on {:.1}% (cos min {:.6})",
        100.0 * p.good,
        p.cos_min
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A turn that keeps the previous prompt but not its answer continues from the state copied
/// at the prompt's end (`bmoe_gates::assert_turn_boundary_reuse`), resident and streamed.
#[test]
fn a_turn_that_shares_only_the_prompt_continues_from_the_turn_boundary() {
    let m = tiny35();
    bmoe_gates::assert_turn_boundary_reuse(&m, &["-t", "2"]);
    bmoe_gates::assert_turn_boundary_reuse(&m, &[&["-t", "2"][..], &STREAMED[..]].concat());
}

/// `--mtp`'s draft head computes what llama.cpp's MTP graph (`graph_mtp`) does: the head's
/// logits at every prompt position (token p with the trunk's hidden state of position p−1),
/// ours (`--mtp-logits-out`) against `llama_parity.py mtp-logits`, on the tiny file (F32 with
/// Q8_0 experts) and its Q4_K_M.
#[test]
fn the_mtp_head_computes_what_llama_cpps_mtp_graph_does() {
    use bmoe_gates::llama::{ours, parity, py_batch, python_ready, PROMPT};
    if !python_ready() {
        return;
    }
    let dir = bmoe_gates::scratch_dir("qwen35moe-mtp-parity");
    for ty in ["default", "q4_k_m"] {
        let mut gen = vec!["--arch", "qwen35moe", "--preset", "tiny", "--seed", "7"];
        if ty != "default" {
            gen.extend_from_slice(&["--type", ty]);
        }
        let m = model(&format!("qwen35moe-mtp-{ty}"), &gen);
        // The prompt's token ids, from a plain teacher-forced run.
        let plain = dir.join(format!("{ty}.plain.f32"));
        ours(&m, &plain);
        let side: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(format!("{}.json", plain.display())).unwrap(),
        )
        .unwrap();
        let n_prompt = side["n_prompt"].as_u64().unwrap() as usize;
        let n_vocab = side["n_vocab"].as_u64().unwrap().to_string();
        let ids = dir.join(format!("{ty}.ids.json"));
        let prompt_ids = &side["token_ids"].as_array().unwrap()[..n_prompt];
        std::fs::write(
            &ids,
            serde_json::json!({ "token_ids": prompt_ids }).to_string(),
        )
        .unwrap();
        let mine = dir.join(format!("{ty}.mtp.f32"));
        let r = bmoe_gates::run(
            &m,
            &[
                "-p",
                PROMPT,
                "-n",
                "1",
                "--no-moe-stream",
                "--mtp",
                "--mtp-logits-out",
                mine.to_str().unwrap(),
            ],
        );
        assert_eq!(r.code, 0, "{}", r.stderr);
        let reference = dir.join(format!("{ty}.ref.f32"));
        let result = dir.join(format!("{ty}.cmp.json"));
        py_batch(
            &dir,
            &format!("mtp-{ty}"),
            &[
                serde_json::json!({"op": "mtp-logits", "args": [&m, &ids, &reference]}),
                serde_json::json!({"op": "compare", "out": &result,
                    "args": [&mine, &reference, n_vocab]}),
            ],
        );
        let p = parity(
            &std::fs::read_to_string(&result).unwrap(),
            &format!("qwen35moe tiny {ty}: the MTP head"),
        );
        assert_eq!(p.rows, n_prompt, "one row per prompt position");
        assert!(
            p.good >= 0.98,
            "{ty}: top-1 with cos >= 0.999 on {:.1}% (cos min {:.6})",
            100.0 * p.good,
            p.cos_min
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
