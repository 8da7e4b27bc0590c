//! deepseek4 (issue 34 item 4) beyond what the archs gate holds every family to, on the tiny
//! file `gen --arch deepseek4` writes (window-only, ratio 4, ratio 128, ratio 4; the first
//! layer hash-routed):
//! - its memory — each position's raw key, compressor inputs and, at a block's end, the
//!   block's compressed rows — read back exactly: a prompt fed in pieces whose batches end
//!   inside and at the ends of blocks gives one prefill's bits, and a turn fed over rows an
//!   earlier one wrote (keeping 10 positions: inside a block) equals a fresh prefill;
//! - a prompt longer than every ring (600 positions) continues exactly in pieces, resident
//!   and streamed;
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

#[test]
fn a_prompt_longer_than_every_ring_continues_exactly() {
    // 600 positions: every ring (the window and the block being filled, plus 256 of slack:
    // 272 or 384 rows) wraps, and four ratio-128 blocks finish. Fed whole, in pieces (one of
    // them a single token) and streamed through an evicting cache under overlap, the last
    // position's logits are one prefill's bits.
    let m = tiny();
    let prompt: Vec<u32> = (0..600).map(|i| (i * 131 + 17) % 4000).collect();
    let load = |extra: &[&str]| bmoe_gates::load_engine(&m, extra);
    let want = bmoe_gates::step_logit_bits(&mut load(&[]), &prompt, 0).unwrap();
    for extra in [
        &[][..],
        &[
            "--moe-stream",
            "--cache-mb",
            "4",
            "--force-cache",
            "--overlap",
        ][..],
    ] {
        let mut e = load(extra);
        for (from, to) in [(0, 300), (300, 301), (301, 517), (517, 600)] {
            let got = bmoe_gates::step_logit_bits(&mut e, &prompt[from..to], from as u32).unwrap();
            if to == 600 {
                assert_eq!(got, want, "{extra:?}: pieces");
            }
        }
    }
}
