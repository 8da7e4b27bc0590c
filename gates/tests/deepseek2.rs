//! deepseek2 (issue 34 item 1) beyond what the archs gate holds every family to:
//! - the parts of the published shapes the tiny file does not have — V2-Lite's YaRN with its
//!   log multiplier and one query projection, Moonlight's sigmoid routing with a selection
//!   bias, renormalised and scaled (given a query LoRA here, so the LoRA meets that routing),
//!   DeepSeek-V2's grouped top-k (8 groups, 3 selectable) — match llama.cpp on reduced files of
//!   those presets: F32 exactly (top-1 everywhere, cosine ≥ 0.9999), Q4_K_M on ≥ 98 % of the
//!   positions pooled over three seeds (95 % for V2; through one MoE layer: see the test);
//! - the latent memory: a prompt fed in pieces gives one prefill's logits bit for bit, and so
//!   does a turn fed over rows an earlier one wrote (a continued chat that re-renders its
//!   answer); a decide — its prefix's latent rows restored, or cold — scores as a fresh
//!   session does, bit for bit.

use bmoe_gates::llama::{ours, parity, py_batch, python_ready};
use bmoe_gates::{model, scratch_dir};
use serde_json::{json, Value};
use std::path::PathBuf;

fn tiny() -> PathBuf {
    model(
        "deepseek2-tiny",
        &["--arch", "deepseek2", "--preset", "tiny", "--seed", "7"],
    )
}

/// A published shape's preset reduced to a tiny file's size — its attention, gating and rope
/// kept; narrower experts, dense FFN and query LoRA — with `layers` layers (the first dense),
/// of type `ty`.
fn reduced(preset: &str, ty: &str, seed: u64, layers: u32) -> PathBuf {
    let (seed, layers) = (seed.to_string(), layers.to_string());
    // DeepSeek-V2's 8 groups need at least 2 experts each.
    let (experts, top_k) = if preset == "deepseek-v2-shape" {
        ("16", "4")
    } else {
        ("8", "3")
    };
    let mut args = vec![
        "--preset",
        preset,
        "--layers",
        &layers,
        "--d-model",
        "256",
        "--experts",
        experts,
        "--top-k",
        top_k,
        "--expert-ffn",
        "128",
        "--heads",
        "4",
        "--dense-ffn",
        "512",
        "--type",
        ty,
        "--seed",
        &seed,
    ];
    match preset {
        "moonlight-16b-a3b-shape" => args.extend_from_slice(&["--q-lora-rank", "384"]),
        "deepseek-v2-shape" => args.extend_from_slice(&["--q-lora-rank", "128"]),
        _ => {}
    }
    model(&format!("deepseek2-{preset}-{ty}-s{seed}-l{layers}"), &args)
}

#[test]
fn the_published_shapes_match_llama_cpp() {
    if !python_ready() {
        return;
    }
    let dir = scratch_dir("deepseek2-shapes");
    let mut failures = Vec::new();
    // The lossy files' bars: 98 %, but DeepSeek-V2's at 95 %: its weights × 16 over 16
    // experts in 8 groups (3 selectable), through one MoE layer, measured 97.6-98.1 % pooled
    // on 2026-12-07, the positions off at cosine 0.996-0.999 with the top-1 agreeing and router
    // margins of 0.04 to 6.5 — no near-tie: the × 16 amplifies the two engines' last-bit
    // differences in the Q4_K experts (the reference's `plain_kernels` sum in another order
    // than ours). Its F32 file holds the exact bar, and without the group keys llama.cpp's
    // logits part from ours at cosine 0.56: the grouped selection is what agrees.
    for (preset, bar) in [
        ("deepseek-v2-lite-shape", 0.98),
        ("moonlight-16b-a3b-shape", 0.98),
        ("deepseek-v2-shape", 0.95),
    ] {
        let (mut rows, mut good) = (0usize, 0f64);
        for seed in [11u64, 12, 13] {
            // F32 through four layers; Q4_K_M through one MoE layer after the dense one: on
            // these shapes a routing near-tie that last-bit differences flip (sigmoid routing
            // renormalised and scaled by 2.446 over 8 experts) changes every later layer's
            // input, so deeper lossy files measure the chaos of random weights, not the graph
            // (four layers: 94-98 % of positions, every one off at a router margin under 6e-3).
            let files = [
                (reduced(preset, "f32", seed, 4), true),
                (reduced(preset, "q4_k_m", seed, 2), false),
            ];
            let mut jobs = Vec::new();
            let mut results = Vec::new();
            for (i, (file, exact)) in files.iter().enumerate() {
                let stem = format!("{preset}-s{seed}-{i}");
                let mine = dir.join(format!("{stem}.ours.f32"));
                ours(file, &mine);
                let ids = format!("{}.json", mine.display());
                let side: Value =
                    serde_json::from_str(&std::fs::read_to_string(&ids).unwrap()).unwrap();
                let n_vocab = side["n_vocab"].as_u64().unwrap().to_string();
                let reference = dir.join(format!("{stem}.ref.f32"));
                let result = dir.join(format!("{stem}.cmp.json"));
                jobs.push(json!({"op": "logits", "args": [file, ids, &reference]}));
                jobs.push(json!({"op": "compare", "out": &result,
                    "args": [&mine, &reference, n_vocab]}));
                results.push((result, *exact));
            }
            py_batch(&dir, &format!("{preset}-s{seed}"), &jobs);
            for (result, exact) in results {
                let kind = if exact { "f32" } else { "q4_k_m" };
                let tag = format!("{preset} {kind} (seed {seed})");
                let p = parity(&std::fs::read_to_string(&result).unwrap(), &tag);
                if p.rows < 100 {
                    failures.push(format!("{tag}: {} positions", p.rows));
                }
                if exact && (p.top1 < 1.0 || p.cos_min < 0.9999) {
                    failures.push(format!(
                        "{tag}: top-1 {:.1}%, cos min {:.6}",
                        100.0 * p.top1,
                        p.cos_min
                    ));
                }
                if !exact {
                    rows += p.rows;
                    good += p.good * p.rows as f64;
                }
            }
        }
        let share = good / rows.max(1) as f64;
        eprintln!(
            "parity {preset} q4_k_m: {:.1}% of {rows} positions good",
            100.0 * share
        );
        if share < bar {
            failures.push(format!(
                "{preset} q4_k_m: {:.1}% of {rows} positions good, below {:.0}%",
                100.0 * share,
                100.0 * bar
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_prompt_fed_in_pieces_or_over_old_rows_gives_one_prefills_logits() {
    // Both query forms: the tiny file's LoRA, V2-Lite's one projection (with YaRN).
    for m in [tiny(), reduced("deepseek-v2-lite-shape", "q4_k_m", 1, 4)] {
        bmoe_gates::assert_pieces_and_rollback_exact(&m);
    }
}

#[test]
fn decides_restored_or_cold_equal_fresh_runs() {
    // Warm (the prefix's latent rows restored where possible) and cold in one session, and
    // each in a fresh session, score the same bits.
    bmoe_gates::assert_decides_equal_fresh(&tiny());
}

/// The tiny file with the chat template of `stem` (`../shared/data/templates`).
fn with_template(stem: &str) -> Option<PathBuf> {
    bmoe_gates::tiny_with_template(&format!("deepseek2-{stem}"), "deepseek2", stem)
}

#[test]
fn deepseek_and_kimi_templates_chat_in_a_session() {
    // DeepSeek's own template (V3.1: a thinking flag) and Kimi-K2's (Moonlight's family): a
    // chat's second turn renders the history again and reuses the latent rows of the first.
    for stem in ["deepseek-ai-DeepSeek-V3.1", "Kimi-K2-Instruct"] {
        let Some(m) = with_template(stem) else {
            return;
        };
        bmoe_gates::assert_template_chats(&m, "deepseek2", Some("template"), &[]);
    }
}
