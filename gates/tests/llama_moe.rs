//! llama with routed experts (Mixtral; issue 34 item 2) beyond what the archs gate holds every
//! family to: its KV read back exactly (a prompt fed in pieces, a turn over rows an earlier one
//! wrote: one fresh prefill's logits, bit for bit; decides restored, cold and fresh score the
//! same bits), and a file with Mixtral's SentencePiece
//! vocabulary (`../shared/data/vocab/ggml-vocab-llama-spm.gguf`) and a Mistral chat template
//! matching llama.cpp and chatting in a session.

use bmoe_gates::llama::{ours, parity, py_batch, python_ready};
use bmoe_gates::{model, scratch_dir};
use serde_json::{json, Value};
use std::path::PathBuf;

#[test]
fn a_prompt_fed_in_pieces_or_over_old_rows_gives_one_prefills_logits() {
    let m = model(
        "llama-moe-tiny",
        &["--arch", "llama", "--preset", "tiny", "--seed", "7"],
    );
    bmoe_gates::assert_pieces_and_rollback_exact(&m);
}

#[test]
fn decides_restored_or_cold_equal_fresh_runs() {
    bmoe_gates::assert_decides_equal_fresh(&model(
        "llama-moe-tiny",
        &["--arch", "llama", "--preset", "tiny", "--seed", "7"],
    ));
}

/// The tiny llama file with Mixtral's SentencePiece vocabulary and Mistral's chat template
/// (`None` without ../shared).
fn spm_mistral() -> Option<PathBuf> {
    let vocab = bmoe_engine::testdata::shared_path("data/vocab/ggml-vocab-llama-spm.gguf")?;
    let t = bmoe_engine::testdata::shared_path(
        "data/templates/Mistral-Small-3.2-24B-Instruct-2506.jinja",
    )?;
    Some(model(
        "llama-moe-spm",
        &[
            "--arch",
            "llama",
            "--preset",
            "tiny",
            "--seed",
            "7",
            "--type",
            "q8_0",
            "--vocab",
            vocab.to_str().unwrap(),
            "--template",
            t.to_str().unwrap(),
        ],
    ))
}

#[test]
fn the_sentencepiece_file_matches_llama_cpp_and_chats() {
    let Some(m) = spm_mistral() else {
        return;
    };
    if python_ready() {
        let dir = scratch_dir("llama-moe-spm");
        let mine = dir.join("ours.f32");
        ours(&m, &mine);
        let ids = format!("{}.json", mine.display());
        let side: Value = serde_json::from_str(&std::fs::read_to_string(&ids).unwrap()).unwrap();
        assert_eq!(side["n_vocab"], 32000, "{side}");
        let (reference, result) = (dir.join("ref.f32"), dir.join("cmp.json"));
        py_batch(
            &dir,
            "spm",
            &[
                json!({"op": "logits", "args": [&m, ids, &reference]}),
                json!({"op": "compare", "out": &result, "args": [&mine, &reference, "32000"]}),
            ],
        );
        let p = parity(&std::fs::read_to_string(&result).unwrap(), "llama spm q8_0");
        assert!(
            p.rows >= 100 && p.good >= 0.98,
            "{} rows, {:.3} good",
            p.rows,
            p.good
        );
    }
    bmoe_gates::assert_template_chats(&m, "llama", None, &[]);
}
