//! `bailingmoe3` (Ling/Ring 3.0: 7.9B-A1.3B, 124B-A5.1B), after llama.cpp's
//! `src/models/bailingmoe3.cpp`: a hybrid of recurrent **Kimi Delta Attention** layers and
//! absorbed **multi-head latent attention** layers, with deepseek2's routing.
//!
//! Which kind a layer is: `attention.head_count_kv` per layer, 0 for KDA. Every layer starts
//! with `attn_norm` (RMS).
//!
//! - **KDA** (`kda.head_dim` = d_h, `attention.head_count` heads, d_inner = heads · d_h):
//!   `q`, `k`, `v` = `attn_q/k/v · x`, each through its own causal depthwise convolution
//!   (`ssm_conv1d_q/k/v`, `ssm.conv_kernel` taps) and SiLU; q and k L2-normed per head. A
//!   **per-channel** gate `g = lb · σ(a_h · (ssm_f_a · x + ssm_dt.bias))` (`lb` =
//!   `kda.gate_lower_bound` < 0, `a_h` = `ssm_a` of the head) and `β = σ(ssm_beta · x)` per
//!   head. Each head's `d_h × d_h` state decays by `exp(g)` along its key dimension, then the
//!   delta rule as qwen35moe's ([`super::delta`]), `o = S·q / √d_h`. Output: RMS norm per
//!   head (`ssm_norm`) × `σ(ssm_g_a · x)`, then `attn_output`. Memory: the three convolution
//!   windows and the state matrices ([`LayerMemory::Recurrent`]).
//! - **MLA**: deepseek2's absorbed latent attention ([`super::mla`]), scores × 1/√key_length_mla,
//!   the original (adjacent-pair) rotary embedding, then a per-head output gate
//!   `σ(attn_gate · x)` before `attn_output`. Memory: the latent row
//!   ([`LayerMemory::Latent`]).
//!
//! Then the residual, `ffn_norm` (RMS), a dense SiLU-GLU FFN (the first
//! `leading_dense_block_count` layers) or the routed experts (sigmoid scores selected with the
//! required `exp_probs_b` bias, renormalised where `expert_weights_norm` says, ×
//! `expert_weights_scale`) beside an ungated shared SiLU-GLU expert, summed → residual. Then
//! `output_norm` and the head (or the tied embedding).
//!
//! The recurrence runs token by token in a fixed order for a prefill too (llama.cpp's prefill
//! uses a chunked form): a prompt gives the same bits however it is split into batches.
//!
//! Per-layer SwiGLU limits (`swiglu_clamp_exp` for the routed experts, `swiglu_clamp_shexp` for
//! the shared expert and the dense layers) give `min(silu(g), L) · clamp(u, −L, L)`
//! ([`Glu::SiluClamped`]). Refused by name: M-RoPE sections (the VL files), rope scaling,
//! softmax gating (the selection bias is sigmoid's) and `kda.safe_gate` false. An MTP block
//! (`nextn_predict_layers` = 1) is not run: the trunk before it loads and decodes, and `--mtp`
//! is refused for this family.

use super::blocks::{self, sigmoid, AttnShape, Compute, Glu, Rope, RopeKind};
use super::delta::{self, Decay};
use super::layers::{finish_with_shared, residual_then_ffn, GluFfn};
use super::meta::{self, leading_dense, moe_params, n_vocab, yarn_params, Meta};
use super::mla::{Mla, MlaDims};
use super::state::{LayerMemory, RecurrentShape, State};
use super::weights::{Loader, Mat};
use super::{Arch, ArchError, Common, CommonLayer, Dims, Experts};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use bmoe_core::{Gating, GatingFunc};
use std::sync::Arc;

pub const ARCH: &str = "bailingmoe3";

/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID`.
const GATING_FUNC_SIGMOID: usize = 2;

/// Hyper-parameters, read and checked once at load.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    /// Layers the forward pass runs (`block_count` less the MTP block).
    pub n_layer: usize,
    /// `nextn_predict_layers`: MTP blocks after the trunk (0 or 1; not run).
    pub n_nextn: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub d_model: usize,
    pub n_ff_exp: usize,
    /// The leading dense layers' FFN width (`feed_forward_length`).
    pub n_ff: usize,
    pub n_dense_lead: usize,
    /// The shared expert's width (`expert_shared_feed_forward_length`, else the expert FFN ×
    /// `expert_shared_count`).
    pub n_ff_shexp: usize,
    pub mla: MlaDims,
    /// Per trunk layer: a KDA layer (else MLA).
    pub recurrent: Vec<bool>,
    /// `kda.head_dim`, `ssm.conv_kernel`, `kda.gate_lower_bound`.
    pub kda_head_dim: usize,
    pub d_conv: usize,
    pub gate_lower_bound: f32,
    /// Per layer, the routed experts' and the shared expert's (and a dense layer's) SwiGLU
    /// limit (`swiglu_clamp_exp`, `swiglu_clamp_shexp`; 0: none).
    pub clamp_exp: Vec<f32>,
    pub clamp_shexp: Vec<f32>,
    pub gating: Gating,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub n_ctx_train: usize,
    pub n_vocab: usize,
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<HParams, ArchError> {
        let m = Meta::new(f, ARCH);
        let block_count = m.req_u("block_count")?;
        m.check_range("block_count", block_count, 1, 4096)?;
        let n_nextn = m.opt_u("nextn_predict_layers")?.unwrap_or(0);
        if n_nextn > 1 || n_nextn >= block_count {
            return Err(m.err(
                "nextn_predict_layers",
                format!(
                    "is {n_nextn}: expected 0 or 1 (llama.cpp's bailingmoe3 has one MTP block)"
                ),
            ));
        }
        let n_layer = block_count - n_nextn;
        let d_model = m.req_u("embedding_length")?;
        if d_model == 0 {
            return Err(m.err("embedding_length", "must be positive"));
        }
        let n_head = m.req_u("attention.head_count")?;
        m.check_range("attention.head_count", n_head, 1, 1024)?;
        let kv = m
            .per_layer_u("attention.head_count_kv", block_count)?
            .ok_or_else(|| {
                m.err(
                    "attention.head_count_kv",
                    "is missing: bailingmoe3 says per layer which are KDA (0) and MLA",
                )
            })?;
        let recurrent: Vec<bool> = kv[..n_layer].iter().map(|&k| k == 0).collect();
        let (n_expert, n_expert_used, n_ff_exp) = moe_params(&m)?;
        let (n_dense_lead, n_ff) = leading_dense(&m, n_layer, true)?;
        let n_shared = m.req_u("expert_shared_count")?;
        m.check_range("expert_shared_count", n_shared, 0, 64)?;
        let n_ff_shexp = match m.opt_u("expert_shared_feed_forward_length")? {
            Some(n) if n > 0 => n,
            _ => n_ff_exp * n_shared.max(1),
        };
        // The latent attention.
        let k_mla = m.req_u("attention.key_length_mla")?;
        let v_mla = m.req_u("attention.value_length_mla")?;
        let kv_lora_rank = m.req_u("attention.kv_lora_rank")?;
        let n_rot = m.req_u("rope.dimension_count")?;
        if n_rot == 0 || n_rot % 2 != 0 || n_rot >= k_mla {
            return Err(m.err(
                "rope.dimension_count",
                format!("is {n_rot}: expected an even count under key_length_mla {k_mla}"),
            ));
        }
        if v_mla == 0 || kv_lora_rank == 0 {
            return Err(m.err(
                "attention.kv_lora_rank",
                format!("is {kv_lora_rank} with value_length_mla {v_mla}: both must be positive"),
            ));
        }
        if let Some(s) = m.per_layer_u("rope.dimension_sections", 4).ok().flatten() {
            if s.iter().any(|&x| x != 0) {
                return Err(m.err(
                    "rope.dimension_sections",
                    "is set (a vision-language file's M-RoPE), which this build does not run",
                ));
            }
        }
        let n_ctx_train = m.req_u("context_length")?;
        if yarn_params(&m, n_ctx_train)?.is_some() {
            return Err(m.err(
                "rope.scaling.type",
                "is set: bailingmoe3 with rope scaling is not run by this build",
            ));
        }
        let rms_eps = m.req_f("attention.layer_norm_rms_epsilon")?;
        // The recurrent layers.
        let kda_head_dim = m.req_u("kda.head_dim")?;
        m.check_range("kda.head_dim", kda_head_dim, 1, 1024)?;
        let d_conv = m.req_u("ssm.conv_kernel")?;
        m.check_range("ssm.conv_kernel", d_conv, 1, 64)?;
        if let Some(v) = f.get(&m.key("kda.safe_gate")) {
            if v.as_bool() != Some(true) {
                return Err(m.err(
                    "kda.safe_gate",
                    format!("is {v}: llama.cpp runs only the safe gate (true)"),
                ));
            }
        }
        let gate_lower_bound = m.req_f("kda.gate_lower_bound")?;
        if gate_lower_bound >= 0.0 {
            return Err(m.err(
                "kda.gate_lower_bound",
                format!("is {gate_lower_bound}: expected a negative bound"),
            ));
        }
        let clamp_exp = meta::swiglu_limits(&m, "swiglu_clamp_exp", n_layer)?;
        let clamp_shexp = meta::swiglu_limits(&m, "swiglu_clamp_shexp", n_layer)?;
        // Routing: sigmoid scores, selected with the layer's bias.
        let func = match m.req_u("expert_gating_func")? {
            GATING_FUNC_SIGMOID => GatingFunc::Sigmoid,
            other => {
                return Err(m.err(
                    "expert_gating_func",
                    format!("is {other}: bailingmoe3 selects with a bias, which this build runs with sigmoid gating (2) only"),
                ))
            }
        };
        let renormalize = m.opt_bool("expert_weights_norm")?.unwrap_or(false);
        Ok(HParams {
            n_layer,
            n_nextn,
            n_expert,
            n_expert_used,
            d_model,
            n_ff_exp,
            n_ff,
            n_dense_lead,
            n_ff_shexp,
            mla: MlaDims {
                d_model,
                n_head,
                q_lora_rank: m.opt_u("attention.q_lora_rank")?.unwrap_or(0),
                kv_lora_rank,
                k_mla,
                v_mla,
                n_rot,
                rms_eps,
            },
            recurrent,
            kda_head_dim,
            d_conv,
            gate_lower_bound,
            clamp_exp,
            clamp_shexp,
            gating: Gating {
                func,
                renormalize,
                scale: m.opt_f("expert_weights_scale", 0.0)?,
                groups: 0,
                groups_used: 0,
            },
            rope_base: m.opt_f("rope.freq_base", 10_000.0)?,
            rms_eps,
            n_ctx_train,
            n_vocab: n_vocab(f)?,
        })
    }

    /// A KDA layer's width: heads × `kda.head_dim`.
    pub fn d_inner(&self) -> usize {
        self.mla.n_head * self.kda_head_dim
    }

    /// A KDA layer's recurrent memory: the windows of its three convolutions, one
    /// `d_h × d_h` state per head.
    pub fn recurrent_shape(&self) -> RecurrentShape {
        RecurrentShape {
            conv_channels: 3 * self.d_inner(),
            conv_kernel: self.d_conv,
            heads: self.mla.n_head,
            key_dim: self.kda_head_dim,
            value_dim: self.kda_head_dim,
        }
    }
}

/// The GLU a limit gives: llama.cpp limits only above 1e-6.
fn glu_for(limit: f32) -> Glu {
    if limit > 1e-6 {
        Glu::SiluClamped { limit }
    } else {
        Glu::Silu
    }
}

/// A KDA layer's weights.
struct Kda {
    q: Mat,
    k: Mat,
    v: Mat,
    /// The three convolutions' taps (`ssm_conv1d_q`, `_k`, `_v` one after the other: per
    /// channel of `[q | k | v]` its `d_conv` taps, oldest input first).
    conv: Vec<f32>,
    /// `ssm_f_a` (the gate's projection) and `ssm_dt.bias`, per channel.
    f_a: Mat,
    dt_bias: Vec<f32>,
    /// `ssm_a`: one per head.
    a: Vec<f32>,
    beta: Mat,
    /// `ssm_g_a`: the output gate's projection.
    g_a: Mat,
    /// `ssm_norm`: one head's width.
    norm: Vec<f32>,
    out: Mat,
}

enum Mixer {
    Kda(Kda),
    Mla(Mla),
}

struct LayerWeights {
    attn_norm: Vec<f32>,
    mixer: Mixer,
    ffn_norm: Vec<f32>,
    /// A leading dense layer's FFN, or a MoE layer's shared expert.
    ffn: GluFfn,
    probs_bias: Option<Vec<f32>>,
}

/// A loaded bailingmoe3 model.
pub struct BailingMoe3 {
    pub hp: HParams,
    common: Common,
    layers: Vec<LayerWeights>,
    rope: Rope,
    shape: AttnShape,
}

/// Load `file` as bailingmoe3 (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(BailingMoe3::load(file, mode)?))
}

/// A small tensor whose shape is `want` up to dimensions of 1 (llama.cpp declares the
/// convolutions `[d_conv, 1, d_inner, 1]` and `ssm_a` `[1, n_head]`; converters write them
/// with or without the 1s).
fn floats_squeezed(ld: &mut Loader, name: &str, want: &[usize]) -> Result<Vec<f32>, ArchError> {
    let t = ld.tensor(name)?;
    let dims: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
    let squeezed: Vec<usize> = dims.iter().copied().filter(|&d| d != 1).collect();
    let want_sq: Vec<usize> = want.iter().copied().filter(|&d| d != 1).collect();
    if squeezed != want_sq {
        return Err(ArchError::Tensor {
            file: ld.path(),
            tensor: name.into(),
            what: format!("has shape {dims:?}, expected {want:?}"),
        });
    }
    ld.floats(name, &dims)
}

fn kda(ld: &mut Loader, hp: &HParams, il: usize) -> Result<Kda, ArchError> {
    let n = |s: &str| format!("blk.{il}.{s}.weight");
    let (d, di, nh) = (hp.d_model, hp.d_inner(), hp.mla.n_head);
    let mut conv = Vec::with_capacity(3 * di * hp.d_conv);
    for p in ["q", "k", "v"] {
        conv.extend(floats_squeezed(
            ld,
            &n(&format!("ssm_conv1d_{p}")),
            &[hp.d_conv, 1, di],
        )?);
    }
    Ok(Kda {
        q: ld.mat(&n("attn_q"), d, di)?,
        k: ld.mat(&n("attn_k"), d, di)?,
        v: ld.mat(&n("attn_v"), d, di)?,
        conv,
        f_a: ld.mat(&n("ssm_f_a"), d, di)?,
        dt_bias: ld.vector(&format!("blk.{il}.ssm_dt.bias"), di)?,
        a: floats_squeezed(ld, &format!("blk.{il}.ssm_a"), &[1, nh])?,
        beta: ld.mat(&n("ssm_beta"), d, nh)?,
        g_a: ld.mat(&n("ssm_g_a"), d, di)?,
        norm: ld.vector(&n("ssm_norm"), hp.kda_head_dim)?,
        out: ld.mat(&n("attn_output"), di, d)?,
    })
}

impl BailingMoe3 {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<BailingMoe3, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let d = hp.d_model;
        let (embd, output, output_norm) =
            ld.embedding_and_head(d, hp.n_vocab, "output_norm.weight")?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        let mut common_layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let attn_norm = ld.vector(&n("attn_norm"), d)?;
            let (mixer, memory) = if hp.recurrent[i] {
                (
                    Mixer::Kda(kda(&mut ld, &hp, i)?),
                    LayerMemory::Recurrent(hp.recurrent_shape()),
                )
            } else {
                (
                    Mixer::Mla(Mla::load(&mut ld, i, &hp.mla, true)?),
                    LayerMemory::Latent {
                        width: hp.mla.latent_width(),
                    },
                )
            };
            let ffn_norm = ld.vector(&n("ffn_norm"), d)?;
            let (mut ffn, probs_bias, moe) = if i < hp.n_dense_lead {
                (GluFfn::load(&mut ld, i, "", d, hp.n_ff)?, None, None)
            } else {
                let probs_bias = ld.vector(&format!("blk.{i}.exp_probs_b.bias"), hp.n_expert)?;
                let shared = GluFfn::load(&mut ld, i, "_shexp", d, hp.n_ff_shexp)?;
                let exps = ld.glu_experts(i, d, hp.n_ff_exp, hp.n_expert)?;
                let moe = Experts {
                    router: ld.mat(&n("ffn_gate_inp"), d, hp.n_expert)?,
                    router_bias: None,
                    exps,
                };
                (shared, Some(probs_bias), Some(moe))
            };
            // llama.cpp's build_ffn limits a dense layer's FFN as a shared expert's.
            ffn.glu = glu_for(hp.clamp_shexp[i]);
            layers.push(LayerWeights {
                attn_norm,
                mixer,
                ffn_norm,
                ffn,
                probs_bias,
            });
            common_layers.push(CommonLayer { memory, moe });
        }
        let shape = AttnShape {
            n_head: hp.mla.n_head,
            n_head_kv: 1,
            head_dim: hp.mla.latent_width(),
            scale: 1.0 / (hp.mla.k_mla as f32).sqrt(),
            window: None,
            softcap: None,
        };
        Ok(BailingMoe3 {
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
                gating: hp.gating,
                embd,
                output,
                output_norm,
                rms_eps: hp.rms_eps,
                n_ff_exp: hp.n_ff_exp,
                glu: Glu::Silu,
                layers: common_layers,
                weights: ld.finish(),
            },
            rope: Rope::plain(RopeKind::Normal, hp.mla.n_rot, hp.rope_base),
            shape,
            hp,
            layers,
        })
    }

    /// The Kimi Delta Attention of layer `il` on `st.cur` into `st.out`, continuing the
    /// layer's recurrent state (or starting it, at position 0).
    fn kda(&self, cx: &Compute, st: &mut State, il: usize, w: &Kda) -> Result<(), ArchError> {
        let hp = &self.hp;
        let n = st.n_rows;
        let (di, nh, hd) = (hp.d_inner(), hp.mla.n_head, hp.kda_head_dim);
        let channels = 3 * di;
        let State {
            mem,
            attn,
            scratch,
            cur,
            out,
            positions,
            ..
        } = st;
        // q, k, v → attn.q/k/v; the gate's projection → scratch.gate, β → scratch.up, the
        // output gate → scratch.down.
        attn.q.resize(n * di, 0.0);
        attn.k.resize(n * di, 0.0);
        attn.v.resize(n * di, 0.0);
        scratch.gate.resize(n * di, 0.0);
        scratch.up.resize(n * nh, 0.0);
        scratch.down.resize(n * di, 0.0);
        cx.mats_rows(
            &mut [
                (&w.q, &mut attn.q),
                (&w.k, &mut attn.k),
                (&w.v, &mut attn.v),
                (&w.f_a, &mut scratch.gate),
                (&w.beta, &mut scratch.up),
                (&w.g_a, &mut scratch.down),
            ],
            cur,
            n,
            &mut scratch.acts,
        )?;
        // The rows [q | k | v] (attn.att), through the convolutions (attn.scores).
        let raw = &mut attn.att;
        raw.resize(n * channels, 0.0);
        for t in 0..n {
            let row = &mut raw[t * channels..(t + 1) * channels];
            row[..di].copy_from_slice(&attn.q[t * di..(t + 1) * di]);
            row[di..2 * di].copy_from_slice(&attn.k[t * di..(t + 1) * di]);
            row[2 * di..].copy_from_slice(&attn.v[t * di..(t + 1) * di]);
        }
        let r = mem[il].recurrent(il)?;
        r.begin(il, positions)?;
        let conv_out = &mut attn.scores;
        conv_out.resize(n * channels, 0.0);
        delta::causal_conv_silu(r, &w.conv, hp.d_conv, channels, raw, n, conv_out);
        for t in 0..n {
            let row = &mut conv_out[t * channels..t * channels + 2 * di];
            delta::l2_norm_heads(row, hd, hp.rms_eps, &mut scratch.tmp);
        }
        // The delta rule, token by token, each head on its own state with a per-key decay.
        let att = &mut attn.q;
        let mut decay = vec![0f32; hd];
        let scale = 1.0 / (hd as f32).sqrt();
        let lb = hp.gate_lower_bound;
        for t in 0..n {
            let row = &conv_out[t * channels..(t + 1) * channels];
            for h in 0..nh {
                let c = h * hd..(h + 1) * hd;
                for (j, x) in decay.iter_mut().enumerate() {
                    let pre = scratch.gate[t * di + h * hd + j] + w.dt_bias[h * hd + j];
                    *x = (lb * sigmoid(pre * w.a[h])).exp();
                }
                delta::delta_step(
                    &mut r.state[h * hd * hd..(h + 1) * hd * hd],
                    hd,
                    (
                        &row[c.clone()],
                        &row[di + h * hd..di + (h + 1) * hd],
                        &row[2 * di + h * hd..2 * di + (h + 1) * hd],
                    ),
                    sigmoid(scratch.up[t * nh + h]),
                    Decay::PerKey(&decay),
                    scale,
                    &mut att[t * di + c.start..t * di + c.end],
                );
            }
            r.row_state_done(t);
        }
        r.finish(positions);
        // Each head RMS-normed with `ssm_norm`, × σ(the output gate).
        for (o, g) in att.chunks_exact_mut(hd).zip(scratch.down.chunks_exact(hd)) {
            blocks::rms_norm(o, Some(&w.norm), hp.rms_eps, &mut scratch.tmp);
            for ((x, &y), &gg) in o.iter_mut().zip(scratch.tmp.iter()).zip(g) {
                *x = y * sigmoid(gg);
            }
        }
        out.resize(n * hp.d_model, 0.0);
        cx.mat_rows(&w.out, att, n, &mut scratch.acts, out)
    }
}

impl Arch for BailingMoe3 {
    fn common(&self) -> &Common {
        &self.common
    }

    /// The layer's mixer, then a leading layer's dense FFN into the residual, or a MoE layer's
    /// FFN norm (the routed experts' input, `st.h`) and its shared expert (into `st.side`).
    fn dense(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let (d, eps) = (self.hp.d_model, self.hp.rms_eps);
        let l = &self.layers[il];
        blocks::rms_norm_all(&st.x, d, Some(&l.attn_norm), eps, &mut st.cur);
        st.mark(il, "RMS_NORM", "attn_norm");
        match &l.mixer {
            Mixer::Kda(w) => {
                self.kda(cx, st, il, w)?;
                st.mark(il, "KDA", "kda");
            }
            Mixer::Mla(w) => {
                w.run(cx, st, il, &self.hp.mla, &self.rope, &self.shape)?;
                st.mark(il, "ATTN", "attn");
            }
        }
        let dense = il < self.hp.n_dense_lead;
        residual_then_ffn(cx, st, il, dense, &l.ffn, &l.ffn_norm, d, eps)
    }

    fn selection_bias(&self, layer: usize) -> Option<&[f32]> {
        self.layers.get(layer)?.probs_bias.as_deref()
    }

    /// SiLU, limited where the file says (`swiglu_clamp_exp`).
    fn split_glu(&self, layer: usize) -> Option<Glu> {
        self.common.layers.get(layer)?.moe.as_ref()?;
        Some(glu_for(self.hp.clamp_exp[layer]))
    }

    /// The routed experts' sum plus the shared expert's, then the residual (llama.cpp's order).
    fn finish_layer(&self, _cx: &Compute, st: &mut State, _layer: usize) -> Result<(), ArchError> {
        finish_with_shared(st, self.hp.d_model);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{Value, ValueType};

    /// The `bailingmoe3.*` keys of a 4-layer model (KDA, KDA, KDA, MLA; one dense layer), with
    /// `change` applied: `(key, Some(value))` sets it, `(key, None)` removes it.
    fn file_with(change: &[(&str, Option<Value>)]) -> GgufFile {
        let kv = [0u32, 0, 0, 1].iter().map(|&k| Value::U32(k)).collect();
        crate::arch::meta::test_file(
            ARCH,
            &[
                ("block_count", Value::U32(4)),
                ("embedding_length", Value::U32(256)),
                ("context_length", Value::U32(4096)),
                ("feed_forward_length", Value::U32(512)),
                ("attention.head_count", Value::U32(4)),
                ("attention.head_count_kv", Value::Array(ValueType::U32, kv)),
                ("attention.key_length_mla", Value::U32(96)),
                ("attention.value_length_mla", Value::U32(64)),
                ("attention.kv_lora_rank", Value::U32(256)),
                ("rope.dimension_count", Value::U32(32)),
                ("attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
                ("expert_count", Value::U32(16)),
                ("expert_used_count", Value::U32(4)),
                ("expert_feed_forward_length", Value::U32(384)),
                ("expert_shared_count", Value::U32(1)),
                ("leading_dense_block_count", Value::U32(1)),
                ("expert_gating_func", Value::U32(2)),
                ("ssm.conv_kernel", Value::U32(4)),
                ("kda.head_dim", Value::U32(64)),
                ("kda.gate_lower_bound", Value::F32(-5.0)),
            ],
            change,
        )
    }

    fn error(f: &GgufFile) -> String {
        HParams::from_gguf(f).expect_err("refused").to_string()
    }

    #[test]
    fn its_layer_kinds_and_widths_come_from_the_keys() {
        use crate::gen::{self, GenOptions, Preset, TypeScheme};
        let preset = Preset::Tiny;
        let opts = GenOptions {
            seed: 5,
            shape: preset.shape_for(gen::GenArch::BailingMoe3).unwrap(),
            vocab: crate::vocab::builtin_vocab().unwrap(),
            ..gen::tests::options(preset, TypeScheme::from_name("q8_0").unwrap())
        };
        let path =
            std::env::temp_dir().join(format!("bmoe-bailingmoe3-{}-tiny.gguf", std::process::id()));
        gen::generate(&opts, &path, |_, _| {}).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let hp = HParams::from_gguf(&file).expect("keys");
        assert_eq!(hp.recurrent, [true, true, true, false]);
        assert_eq!(hp.d_inner(), 256);
        assert_eq!(hp.n_ff_shexp, hp.n_ff_exp);
        assert_eq!(hp.recurrent_shape().conv_channels, 3 * 256);
        assert_eq!(hp.gating.to_string(), "sigmoid_topk_norm*2.5");
        // An MTP block's layer is not among the layers run; its keys are accepted (the first
        // thing missing is a tensor).
        let e = error(&file_with(&[
            ("nextn_predict_layers", Some(Value::U32(1))),
            ("block_count", Some(Value::U32(5))),
            (
                "attention.head_count_kv",
                Some(Value::Array(
                    ValueType::U32,
                    [0u32, 1, 0, 1, 1].iter().map(|&k| Value::U32(k)).collect(),
                )),
            ),
        ]));
        assert!(e.contains("token_embd.weight"), "{e}");
    }

    #[test]
    fn what_it_does_not_run_is_refused_by_key() {
        // Every key fine: the first thing missing is a tensor.
        assert!(error(&file_with(&[])).contains("token_embd.weight"));
        for (change, key) in [
            (("attention.head_count_kv", None), "attention.head_count_kv"),
            (
                ("expert_gating_func", Some(Value::U32(1))),
                "expert_gating_func",
            ),
            (
                ("kda.gate_lower_bound", Some(Value::F32(0.5))),
                "kda.gate_lower_bound",
            ),
            (("kda.safe_gate", Some(Value::Bool(false))), "kda.safe_gate"),
            (("kda.head_dim", None), "kda.head_dim"),
            (("ssm.conv_kernel", None), "ssm.conv_kernel"),
            (
                (
                    "rope.dimension_sections",
                    Some(Value::Array(
                        ValueType::U32,
                        [8u32, 4, 4, 0].iter().map(|&k| Value::U32(k)).collect(),
                    )),
                ),
                "rope.dimension_sections",
            ),
            (
                ("rope.scaling.type", Some(Value::String("yarn".into()))),
                "rope.scaling.type",
            ),
            (
                (
                    "swiglu_clamp_exp",
                    Some(Value::Array(ValueType::F32, vec![Value::F32(7.0); 3])),
                ),
                "swiglu_clamp_exp",
            ),
            (
                ("nextn_predict_layers", Some(Value::U32(2))),
                "nextn_predict_layers",
            ),
            (
                ("leading_dense_block_count", Some(Value::U32(4))),
                "leading_dense_block_count",
            ),
            (
                ("rope.dimension_count", Some(Value::U32(31))),
                "rope.dimension_count",
            ),
        ] {
            let e = error(&file_with(std::slice::from_ref(&change)));
            assert!(e.contains(&format!("{ARCH}.{key}")), "{change:?}: {e}");
        }
    }
}
