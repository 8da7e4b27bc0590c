//! The parts of a delta-rule recurrent layer that qwen35moe's Gated DeltaNet and bailingmoe3's
//! Kimi Delta Attention share, as ggml-cpu computes them (`ssm_conv`, `build_gdn_l2_norm`,
//! `gated_delta_net` in its one-token form): the causal convolution over the window the
//! layer's state carries, the per-head L2 norm of q and k, and one step of the delta rule on
//! one head's state matrix. Each runs token by token in a fixed order, so a prompt gives the
//! same bits however it is split into batches.

use super::blocks;
use super::state::RecurrentLayer;

/// The causal depthwise convolution of `n` rows of `raw` (`n × channels`, the layer's
/// projected input) over the last `k_taps − 1` inputs `r` keeps, then SiLU, into `out`
/// (`n × channels`); `conv` holds each channel's `k_taps` taps, oldest input first. The
/// window moves on by each row's raw input and every row is reported to `r` (for the rows a
/// verify decode keeps).
pub fn causal_conv_silu(
    r: &mut RecurrentLayer,
    conv: &[f32],
    k_taps: usize,
    channels: usize,
    raw: &[f32],
    n: usize,
    out: &mut [f32],
) {
    for t in 0..n {
        let x = &raw[t * channels..(t + 1) * channels];
        let o = &mut out[t * channels..(t + 1) * channels];
        for c in 0..channels {
            let taps = &conv[c * k_taps..(c + 1) * k_taps];
            let mut acc = 0.0f32;
            for (k, &tap) in taps[..k_taps - 1].iter().enumerate() {
                acc += r.conv[k * channels + c] * tap;
            }
            acc += x[c] * taps[k_taps - 1];
            o[c] = blocks::silu(acc);
        }
        if k_taps > 1 {
            r.conv.copy_within(channels.., 0);
            let last = (k_taps - 2) * channels;
            r.conv[last..last + channels].copy_from_slice(x);
        }
        r.row_conv_done(t);
    }
}

/// Every `width`-wide head of `rows` L2-normed as ggml's graph does it: an RMS norm with
/// `eps / width`, × `1/√width`. `tmp` is scratch.
pub fn l2_norm_heads(rows: &mut [f32], width: usize, eps: f32, tmp: &mut Vec<f32>) {
    let l2_eps = eps / width as f32;
    let inv_sqrt = 1.0 / (width as f32).sqrt();
    tmp.resize(width, 0.0);
    for head in rows.chunks_exact_mut(width) {
        blocks::rms_norm(head, None, l2_eps, tmp);
        for (x, &y) in head.iter_mut().zip(tmp.iter()) {
            *x = y * inv_sqrt;
        }
    }
}

/// How a head's state decays before a token's update.
#[derive(Clone, Copy)]
pub enum Decay<'a> {
    /// One factor for the whole matrix (Gated DeltaNet: `exp(g)` per head).
    Head(f32),
    /// One factor per key channel (Kimi Delta Attention: `exp(g)` of each of the head's
    /// key dimensions).
    PerKey(&'a [f32]),
}

/// One token of the delta rule on one head's state `s` (`width` rows, one per value index,
/// each over the key index): decay, `d = (v − S·k)·β`, `S ← S + d⊗k`, `o = S·q · scale`.
#[allow(clippy::too_many_arguments)]
pub fn delta_step(
    s: &mut [f32],
    width: usize,
    (q, k, v): (&[f32], &[f32], &[f32]),
    beta: f32,
    decay: Decay<'_>,
    scale: f32,
    o: &mut [f32],
) {
    for (j, m) in s.chunks_exact_mut(width).enumerate() {
        match decay {
            Decay::Head(f) => m.iter_mut().for_each(|x| *x *= f),
            Decay::PerKey(f) => m.iter_mut().zip(f).for_each(|(x, &f)| *x *= f),
        }
        let delta = (v[j] - blocks::dot_lanes(m, k)) * beta;
        for (x, &kk) in m.iter_mut().zip(k) {
            *x += kk * delta;
        }
        o[j] = blocks::dot_lanes(m, q) * scale;
    }
}
