//! `lfm2moe` (Liquid AI's LFM2-8B-A1B), after llama.cpp's `src/models/lfm2moe.cpp` (loader)
//! and `src/models/lfm2.cpp` (the graph both LFM2 families share).
//!
//! A hybrid: each layer mixes its positions either by a **short convolution** (a layer whose
//! `attention.head_count_kv` entry is 0) or by GQA attention, then runs a dense SiLU-GLU FFN
//! (the first `leading_dense_block_count` layers) or routed experts. Layer:
//! `attn_norm` (RMS, llama.cpp's "operator_norm") →
//! - short conv: `shortconv.in_proj` (d → 3d) split into `b`, `c`, `x`; `bx = b ⊙ x`; a causal
//!   depthwise convolution over the last `shortconv.l_cache` values of `bx` per channel (the
//!   `l_cache − 1` before the batch kept as the layer's recurrent state); `y = c ⊙ conv`;
//!   `shortconv.out_proj`;
//! - attention: q/k/v → per-head q/k RMS norms → NeoX rope → attention, scores × 1/√head_dim
//!   → `attn_output`;
//!
//! → residual → `ffn_norm` (RMS) → dense `ffn_{gate,up,down}` or the router: `ffn_gate_inp`,
//! a **sigmoid** per expert, top-k of `sigmoid + exp_probs_b` (the bias selects only), the
//! chosen unbiased sigmoids renormalised; SiLU-GLU experts `ffn_{gate,up,down}_exps` → residual.
//! Then `token_embd_norm` (the output norm, under llama.cpp's name for LFM2) and the head
//! (`output`, or the tied `token_embd`).

use super::blocks::{self, AttnShape, Compute, Glu, Rope, RopeKind};
use super::layers::{attention, AttnWeights, GluFfn};
use super::meta::{n_vocab, Meta};
use super::state::{LayerMemory, MemoryKind, RecurrentShape, State};
use super::weights::{Loader, Mat};
use super::{Arch, ArchError, Common, CommonLayer, Dims, Experts};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use bmoe_core::Gating;
use std::sync::Arc;

pub const ARCH: &str = "lfm2moe";

/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID`, the only gating this family states.
const GATING_FUNC_SIGMOID: usize = 2;

/// Widest convolution accepted (LFM2 uses 3): the state is `l_cache − 1` rows of d_model.
const MAX_L_CACHE: usize = 64;

/// The gating: sigmoid scores, selection by score + `exp_probs_b`, the chosen scores
/// renormalised (llama.cpp's `build_moe_ffn` with `norm_w`; this family's loader reads no
/// `expert_weights_scale`).
pub const GATING: Gating = Gating::sigmoid(true);

/// Hyper-parameters, read and checked once at load.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    pub n_layer: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub d_model: usize,
    pub n_ff_exp: usize,
    /// The dense FFN's width per layer (read for the leading dense layers).
    pub n_ff: Vec<usize>,
    pub n_head: usize,
    /// Per layer: KV heads of an attention layer, 0 for a short-conv layer.
    pub n_head_kv: Vec<usize>,
    pub head_dim: usize,
    /// The convolution's width (`shortconv.l_cache`): it reads this many positions.
    pub l_cache: usize,
    /// Layers `0..n_dense_lead` run a dense FFN, the rest routed experts.
    pub n_dense_lead: usize,
    pub n_ctx_train: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub n_vocab: usize,
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<HParams, ArchError> {
        let m = Meta::new(f, ARCH);
        let n_layer = m.req_u("block_count")?;
        let d_model = m.req_u("embedding_length")?;
        m.check_range("block_count", n_layer, 1, 4096)?;
        if d_model == 0 {
            return Err(m.err("embedding_length", "must be positive"));
        }
        let n_head = m.req_u("attention.head_count")?;
        if n_head == 0 {
            return Err(m.err("attention.head_count", "must be positive"));
        }
        // Absent: every layer attends with as many KV heads as query heads.
        let n_head_kv = m
            .per_layer_u("attention.head_count_kv", n_layer)?
            .unwrap_or_else(|| vec![n_head; n_layer]);
        if let Some((il, kv)) = n_head_kv
            .iter()
            .enumerate()
            .find(|&(_, &kv)| kv != 0 && n_head % kv != 0)
        {
            return Err(m.err(
                "attention.head_count_kv",
                format!("is {kv} at layer {il}, which must divide head_count {n_head} (or be 0 for a short-conv layer)"),
            ));
        }
        let head_dim = m.opt_u("attention.key_length")?.unwrap_or(d_model / n_head);
        let v_dim = m.opt_u("attention.value_length")?.unwrap_or(head_dim);
        if v_dim != head_dim {
            return Err(m.err(
                "attention.value_length",
                format!("{v_dim} differs from key_length {head_dim}; unsupported"),
            ));
        }
        if head_dim == 0 || head_dim % 2 != 0 || n_head * head_dim != d_model {
            return Err(m.err(
                "attention.key_length",
                format!(
                    "{head_dim} must be even and × head_count {n_head} give embedding_length \
                     {d_model} (lfm2moe's attn_output is d_model × d_model)"
                ),
            ));
        }
        if let Some(rd) = m.opt_u("rope.dimension_count")? {
            if rd != head_dim {
                return Err(m.err(
                    "rope.dimension_count",
                    format!("{rd} differs from the head dim {head_dim}; partial rotary is not supported"),
                ));
            }
        }
        let l_cache = m.req_u("shortconv.l_cache")?;
        m.check_range("shortconv.l_cache", l_cache, 2, MAX_L_CACHE)?;
        let n_dense_lead = m.opt_u("leading_dense_block_count")?.unwrap_or(0);
        m.check_range("leading_dense_block_count", n_dense_lead, 0, n_layer - 1)?;
        let n_expert = m.req_u("expert_count")?;
        let n_expert_used = m.req_u("expert_used_count")?;
        if n_expert == 0 {
            return Err(ArchError::NotMoe {
                file: f.path().display().to_string(),
                arch: ARCH.into(),
            });
        }
        m.check_range("expert_count", n_expert, 1, 65535)?;
        m.check_range("expert_used_count", n_expert_used, 1, n_expert)?;
        let n_ff_exp = m.req_u("expert_feed_forward_length")?;
        if n_ff_exp == 0 {
            return Err(m.err("expert_feed_forward_length", "is 0"));
        }
        let gating = m.req_u("expert_gating_func")?;
        if gating != GATING_FUNC_SIGMOID {
            return Err(m.err(
                "expert_gating_func",
                format!("is {gating}; this build runs lfm2moe's sigmoid gating ({GATING_FUNC_SIGMOID}) only"),
            ));
        }
        let n_ff = match m.per_layer_u("feed_forward_length", n_layer)? {
            Some(v) => v,
            None if n_dense_lead == 0 => vec![0; n_layer],
            None => {
                return Err(m.err(
                    "feed_forward_length",
                    "is missing (required for the leading dense layers)",
                ))
            }
        };
        if let Some(il) = (0..n_dense_lead).find(|&il| n_ff[il] == 0) {
            return Err(m.err("feed_forward_length", format!("is 0 at dense layer {il}")));
        }
        Ok(HParams {
            n_layer,
            n_expert,
            n_expert_used,
            d_model,
            n_ff_exp,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            l_cache,
            n_dense_lead,
            n_ctx_train: m.req_u("context_length")?,
            rope_base: m.opt_f("rope.freq_base", 10_000.0)?,
            rms_eps: m.req_f("attention.layer_norm_rms_epsilon")?,
            n_vocab: n_vocab(f)?,
        })
    }

    /// Whether layer `il` mixes by its short convolution (no KV heads).
    pub fn is_conv(&self, il: usize) -> bool {
        self.n_head_kv[il] == 0
    }
}

/// A short-conv layer's weights.
struct ShortConv {
    /// `shortconv.in_proj`: d → 3d (b, c, x).
    in_proj: Mat,
    /// `shortconv.conv`: per channel its `l_cache` taps, oldest position first.
    conv: Vec<f32>,
    /// `shortconv.out_proj`: d → d.
    out_proj: Mat,
}

/// How a layer mixes its positions.
enum Mixer {
    Conv(ShortConv),
    Attn {
        w: Box<AttnWeights>,
        shape: AttnShape,
    },
}

struct LayerWeights {
    attn_norm: Vec<f32>,
    mixer: Mixer,
    ffn_norm: Vec<f32>,
    /// A leading dense layer's FFN.
    dense: Option<GluFfn>,
    /// `exp_probs_b.bias`: added to the sigmoid scores for selection only.
    probs_bias: Option<Vec<f32>>,
}

/// A loaded lfm2moe model.
pub struct Lfm2Moe {
    pub hp: HParams,
    common: Common,
    layers: Vec<LayerWeights>,
    rope: Rope,
}

/// Load `file` as lfm2moe (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(Lfm2Moe::load(file, mode)?))
}

impl Lfm2Moe {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Lfm2Moe, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let d = hp.d_model;
        let hd = hp.head_dim;
        let (embd, output, output_norm) =
            ld.embedding_and_head(d, hp.n_vocab, "token_embd_norm.weight")?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        let mut common_layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let (mixer, memory) = if hp.is_conv(i) {
                let conv = ShortConv {
                    in_proj: ld.mat(&n("shortconv.in_proj"), d, 3 * d)?,
                    conv: ld.floats(&n("shortconv.conv"), &[hp.l_cache, d])?,
                    out_proj: ld.mat(&n("shortconv.out_proj"), d, d)?,
                };
                let memory = LayerMemory::Recurrent(RecurrentShape {
                    conv_channels: d,
                    conv_kernel: hp.l_cache,
                    ..RecurrentShape::default()
                });
                (Mixer::Conv(conv), memory)
            } else {
                if ld.has(&n("attn_qkv")) {
                    return Err(ArchError::Tensor {
                        file: ld.file().path().display().to_string(),
                        tensor: n("attn_qkv"),
                        what: "is a fused q/k/v projection, which this build does not read for lfm2moe (split attn_q, attn_k, attn_v)".into(),
                    });
                }
                let kv = hp.n_head_kv[i];
                let w = Box::new(AttnWeights {
                    q: ld.mat(&n("attn_q"), d, d)?,
                    k: ld.mat(&n("attn_k"), d, kv * hd)?,
                    v: ld.mat(&n("attn_v"), d, kv * hd)?,
                    o: ld.mat(&n("attn_output"), d, d)?,
                    q_bias: None,
                    k_bias: None,
                    v_bias: None,
                    q_norm: Some(ld.vector(&n("attn_q_norm"), hd)?),
                    k_norm: Some(ld.vector(&n("attn_k_norm"), hd)?),
                });
                let shape = AttnShape {
                    n_head: hp.n_head,
                    n_head_kv: kv,
                    head_dim: hd,
                    scale: 1.0 / (hd as f32).sqrt(),
                    window: None,
                    softcap: None,
                };
                (
                    Mixer::Attn { w, shape },
                    LayerMemory::kv(MemoryKind::Full, kv, hd),
                )
            };
            let attn_norm = ld.vector(&n("attn_norm"), d)?;
            let ffn_norm = ld.vector(&n("ffn_norm"), d)?;
            let (dense, probs_bias, moe) = if i < hp.n_dense_lead {
                let dense = GluFfn::load(&mut ld, i, "", d, hp.n_ff[i])?;
                (Some(dense), None, None)
            } else {
                let bias = ld.vector(&format!("blk.{i}.exp_probs_b.bias"), hp.n_expert)?;
                let moe = Experts {
                    router: ld.mat(&n("ffn_gate_inp"), d, hp.n_expert)?,
                    router_bias: None,
                    exps: ld.glu_experts(i, d, hp.n_ff_exp, hp.n_expert)?,
                };
                (None, Some(bias), Some(moe))
            };
            layers.push(LayerWeights {
                attn_norm,
                mixer,
                ffn_norm,
                dense,
                probs_bias,
            });
            common_layers.push(CommonLayer { memory, moe });
        }
        Ok(Lfm2Moe {
            common: Common {
                name: ARCH,
                dims: Dims {
                    n_layer: hp.n_layer,
                    n_expert: hp.n_expert,
                    n_expert_used: hp.n_expert_used,
                    d_model: d,
                    n_vocab: hp.n_vocab,
                    n_ctx_train: hp.n_ctx_train,
                },
                gating: GATING,
                embd,
                output,
                output_norm,
                rms_eps: hp.rms_eps,
                n_ff_exp: hp.n_ff_exp,
                glu: Glu::Silu,
                layers: common_layers,
                weights: ld.finish(),
            },
            rope: Rope::plain(RopeKind::Neox, hd, hp.rope_base),
            hp,
            layers,
        })
    }

    /// The short convolution of layer `il` over `st.cur` (the normed input of every batch
    /// row) into `st.out`, its recurrent state continued (or started at position 0).
    fn short_conv(
        &self,
        cx: &Compute,
        st: &mut State,
        il: usize,
        w: &ShortConv,
    ) -> Result<(), ArchError> {
        let n = st.n_rows;
        let d = self.hp.d_model;
        let taps = self.hp.l_cache;
        let keep = taps - 1;
        let State {
            mem,
            cur,
            out,
            positions,
            scratch,
            ..
        } = st;
        let state = mem[il].recurrent(il)?;
        state.begin(il, positions)?;
        // b, c, x of every row.
        scratch.gate.resize(n * 3 * d, 0.0);
        cx.mat_rows(&w.in_proj, cur, n, &mut scratch.acts, &mut scratch.gate)?;
        // The window: the state's `keep` rows of b ⊙ x, then the batch's.
        let win = &mut scratch.up;
        win.clear();
        win.extend_from_slice(&state.conv);
        for r in 0..n {
            let row = &scratch.gate[r * 3 * d..(r + 1) * 3 * d];
            let (b, x) = (&row[..d], &row[2 * d..]);
            win.extend(b.iter().zip(x).map(|(b, x)| b * x));
        }
        // y = c ⊙ conv, the taps summed oldest first from 0 (ggml's ssm_conv order).
        let y = &mut scratch.tmp;
        y.resize(n * d, 0.0);
        for r in 0..n {
            let c = &scratch.gate[r * 3 * d + d..r * 3 * d + 2 * d];
            for ch in 0..d {
                let tap = &w.conv[ch * taps..(ch + 1) * taps];
                let mut sum = 0.0f32;
                for (k, &t) in tap.iter().enumerate() {
                    sum += win[(r + k) * d + ch] * t;
                }
                y[r * d + ch] = c[ch] * sum;
            }
        }
        // A verify decode keeps the window after each row (`State::keep_rows`); the state
        // becomes the window's last `keep` rows.
        for r in 0..n {
            state.row_conv_is(r, &win[(r + 1) * d..(r + 1 + keep) * d]);
        }
        let rows = win.len() / d;
        state
            .conv
            .copy_from_slice(&win[(rows - keep) * d..rows * d]);
        state.finish(positions);
        out.resize(n * d, 0.0);
        cx.mat_rows(&w.out_proj, y, n, &mut scratch.acts, out)
    }
}

impl Arch for Lfm2Moe {
    fn common(&self) -> &Common {
        &self.common
    }

    fn dense(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let (d, eps) = (self.hp.d_model, self.hp.rms_eps);
        let l = &self.layers[il];
        blocks::rms_norm_all(&st.x, d, Some(&l.attn_norm), eps, &mut st.cur);
        st.mark(il, "RMS_NORM", "attn_norm");
        match &l.mixer {
            Mixer::Conv(w) => {
                self.short_conv(cx, st, il, w)?;
                st.mark(il, "SSM_CONV", "shortconv");
            }
            Mixer::Attn { w, shape } => {
                attention(cx, st, il, w, shape, &self.rope, eps, None, None)?;
                st.mark(il, "ATTN", "attn");
            }
        }
        for (x, o) in st.x.iter_mut().zip(&st.out) {
            *x += *o;
        }
        let Some(ffn) = &l.dense else {
            blocks::rms_norm_rows(&st.x, d, &st.ffn_rows, Some(&l.ffn_norm), eps, &mut st.h);
            return Ok(());
        };
        // A leading dense layer: its SiLU-GLU FFN into the FFN rows of the residual.
        ffn.into_residual(cx, st, &l.ffn_norm, eps)
    }

    fn selection_bias(&self, layer: usize) -> Option<&[f32]> {
        self.layers.get(layer)?.probs_bias.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{Value, ValueType};

    /// The `lfm2moe.*` keys of a 4-layer model (attention at layer 2, one dense layer), with
    /// `change` applied: `(key, Some(value))` sets it, `(key, None)` removes it.
    fn file_with(change: &[(&str, Option<Value>)]) -> GgufFile {
        let kv =
            |v: &[u32]| Value::Array(ValueType::U32, v.iter().map(|&x| Value::U32(x)).collect());
        crate::arch::meta::test_file(
            ARCH,
            &[
                ("block_count", Value::U32(4)),
                ("embedding_length", Value::U32(256)),
                ("context_length", Value::U32(4096)),
                ("feed_forward_length", Value::U32(512)),
                ("attention.head_count", Value::U32(4)),
                ("attention.head_count_kv", kv(&[0, 0, 2, 0])),
                ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
                ("expert_count", Value::U32(16)),
                ("expert_used_count", Value::U32(4)),
                ("expert_feed_forward_length", Value::U32(384)),
                ("leading_dense_block_count", Value::U32(1)),
                ("expert_gating_func", Value::U32(2)),
                ("shortconv.l_cache", Value::U32(3)),
            ],
            change,
        )
    }

    /// The error reading `f`'s hyper-parameters (every key check passes on the base file, whose
    /// only fault is having no tensors).
    fn error(f: &GgufFile) -> String {
        HParams::from_gguf(f).unwrap_err().to_string()
    }

    #[test]
    fn what_it_does_not_run_is_refused_by_key() {
        assert!(error(&file_with(&[])).contains("token_embd.weight"));
        for (change, key) in [
            (
                ("expert_gating_func", Some(Value::U32(1))),
                "expert_gating_func",
            ),
            (("expert_gating_func", None), "expert_gating_func"),
            (("shortconv.l_cache", None), "shortconv.l_cache"),
            (
                ("shortconv.l_cache", Some(Value::U32(1))),
                "shortconv.l_cache",
            ),
            (
                ("shortconv.l_cache", Some(Value::U32(100_000))),
                "shortconv.l_cache",
            ),
            (
                ("leading_dense_block_count", Some(Value::U32(4))),
                "leading_dense_block_count",
            ),
            (("feed_forward_length", None), "feed_forward_length"),
            (
                ("attention.key_length", Some(Value::U32(32))),
                "attention.key_length",
            ),
            (
                ("expert_used_count", Some(Value::U32(17))),
                "expert_used_count",
            ),
            (
                (
                    "attention.head_count_kv",
                    Some(Value::Array(ValueType::U32, vec![Value::U32(3); 4])),
                ),
                "attention.head_count_kv",
            ),
            (
                (
                    "attention.head_count_kv",
                    Some(Value::Array(ValueType::U32, vec![Value::U32(2); 3])),
                ),
                "attention.head_count_kv",
            ),
        ] {
            let e = error(&file_with(std::slice::from_ref(&change)));
            assert!(e.contains(&format!("{ARCH}.{key}")), "{change:?}: {e}");
        }
    }

    /// A file without `head_count_kv` attends on every layer; without dense layers it needs no
    /// `feed_forward_length`.
    #[test]
    fn layer_kinds_follow_the_kv_heads() {
        let f = file_with(&[
            ("attention.head_count_kv", None),
            ("leading_dense_block_count", None),
            ("feed_forward_length", None),
        ]);
        assert!(error(&f).contains("token_embd.weight"), "{}", error(&f));
    }
}
