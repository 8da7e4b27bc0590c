//! deepseek4 (issue 34 item 4) beyond what the archs gate holds every family to, on the tiny
//! file `gen --arch deepseek4` writes (window-only, ratio 4, ratio 128, ratio 4; the first
//! layer hash-routed):
//! - its memory — each position's raw key, compressor inputs and, at a block's end, the
//!   block's compressed rows — read back exactly: a prompt fed in pieces whose batches end
//!   inside and at the ends of blocks gives one prefill's bits, and a turn fed over rows an
//!   earlier one wrote (keeping 10 positions: inside a block) equals a fresh prefill;
//! - a decide, restored or cold, scores as a fresh session does;
//! - DeepSeek V4's own chat template (`../shared/data/templates`) chats in a session.

use bmoe_gates::model;
use std::path::PathBuf;

fn tiny() -> PathBuf {
    model(
        "deepseek4-tiny",
        &["--arch", "deepseek4", "--preset", "tiny", "--seed", "7"],
    )
}

#[test]
fn the_compressed_memory_continues_and_rolls_back_exactly() {
    bmoe_gates::assert_pieces_and_rollback_exact(&tiny());
}

#[test]
fn decides_restored_or_cold_equal_fresh_runs() {
    bmoe_gates::assert_decides_equal_fresh(&tiny());
}

#[test]
fn deepseek_v4_template_chats_in_a_session() {
    let Some(m) = bmoe_gates::tiny_with_template(
        "deepseek4-deepseek-v4",
        "deepseek4",
        "deepseek-ai-DeepSeek-V4",
    ) else {
        return;
    };
    bmoe_gates::assert_template_chats(&m, "deepseek4", None, &[]);
}
