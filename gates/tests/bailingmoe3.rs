//! bailingmoe3 (issue 34 item 3) beyond what the archs gate holds every family to, on the tiny
//! file `gen --arch bailingmoe3` writes (KDA, KDA, KDA, gated MLA; the first layer dense):
//! - its memory of two kinds — the KDA layers' convolution windows and per-head states, the
//!   MLA layer's latent rows — carried across batches: a prompt fed in pieces gives a fresh
//!   prefill's bits, resident and streamed; a kept prefix is restored exactly and one where
//!   the state no longer stands is never kept;
//! - a decide, restored or cold, scores as a fresh session does;
//! - Ling 3.0's own chat template (`../shared/data/templates`) chats in a session, its second
//!   turn reusing the first's state.

use bmoe_gates::model;
use std::path::PathBuf;

fn tiny() -> PathBuf {
    model(
        "bailingmoe3-tiny",
        &["--arch", "bailingmoe3", "--preset", "tiny", "--seed", "7"],
    )
}

#[test]
fn the_recurrent_and_latent_memory_continue_exactly() {
    bmoe_gates::assert_recurrent_state_continues_exactly(&tiny());
}

#[test]
fn decides_restored_or_cold_equal_fresh_runs() {
    bmoe_gates::assert_decides_equal_fresh(&tiny());
}

#[test]
fn ling_3_template_chats_in_a_session() {
    let Some(m) = bmoe_gates::tiny_with_template(
        "bailingmoe3-ling-3.0-flash",
        "bailingmoe3",
        "inclusionai-ling-3.0-flash",
    ) else {
        return;
    };
    bmoe_gates::assert_template_chats(&m, "bailingmoe3", Some("template"), &[]);
}
