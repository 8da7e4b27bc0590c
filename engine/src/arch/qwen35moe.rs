//! `qwen35moe` (Qwen3.5/3.6-35B-A3B), after llama.cpp's `src/models/qwen35moe.cpp` and the
//! gated delta rule of `src/models/delta-net-base.cpp` (its one-token form, as ggml-cpu's
//! `gated_delta_net` computes it).
//!
//! Two kinds of layer, as `attention.recurrent_layers` says (else every
//! `full_attention_interval`-th layer attends, the others are recurrent):
//!
//! - **Gated DeltaNet** (recurrent): `attn_norm` (RMS) → `attn_qkv` (q, k, v mixed) and
//!   `attn_gate` (z) → a causal convolution over the last `ssm.conv_kernel` inputs of every
//!   channel, SiLU → q and k L2-normed per head → per value head `h` (reading key head
//!   `h % n_k`: ggml repeats the key heads tiled, not interleaved) the delta rule on its
//!   `state_size × state_size` matrix `S`: `S ← S·exp(g)`, `d = (v − S·k)·β`, `S ← S + d⊗k`,
//!   `o = S·q / √state_size`, with `β = σ(ssm_beta·x)` and
//!   `g = softplus(ssm_alpha·x + ssm_dt.bias) · ssm_a` → RMS norm of each head with `ssm_norm`,
//!   times SiLU(z) → `ssm_out`.
//! - **gated full attention**: `attn_q` projects each head's query and its output gate side by
//!   side; q and k RMS-normed per head; rotary embedding on the first `rope.dimension_count`
//!   dimensions (llama.cpp's interleaved multi-section rope, which for text — its t, h and w
//!   positions equal, e at 0 — is NeoX rope at the position, except the pairs of the e
//!   section, which stay put); GQA attention, scores × 1/√head_dim; output × σ(gate) →
//!   `attn_output`.
//!
//! Then the residual, `post_attention_norm` (RMS) into the router and the experts (softmax
//! over every expert, top-k, renormalised; SiLU-gated, fused `ffn_gate_up_exps` or split),
//! beside a shared expert scaled by `σ(ffn_gate_inp_shexp · x)` (dense, resident), summed and
//! added to the residual. Then `output_norm` and the head.
//!
//! The recurrence runs token by token in a fixed order for a prefill too (llama.cpp's prefill
//! uses a chunked form): a prompt gives the same bits however it is split into batches, so a
//! session that continues a state matches a fresh prefill exactly.
//!
//! The MTP block (`nextn_predict_layers` = 1, at layer index `n_layer`) is the draft head of
//! `--mtp` ([`Arch::mtp_forward`], llama.cpp's `graph_mtp`): its experts are computed from the
//! file's map, not streamed.

use super::blocks::{self, sigmoid, AttnShape, Compute, Glu, Rope, RopeKind};
use super::delta::{self, Decay};
use super::layers::{attend_layer, finish_with_shared, GluFfn, SharedExpert};
use super::meta::{moe_params, n_vocab, Meta};
use super::state::{LayerMemory, MemoryKind, RecurrentShape, State};
use super::weights::{ExpertTensor, Loader, Mat};
use super::{Arch, ArchError, Common, CommonLayer, Dims, Experts};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use bmoe_core::Gating;
use std::sync::Arc;

pub const ARCH: &str = "qwen35moe";

/// Hyper-parameters, read and checked once at load.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    /// Layers the forward pass runs (`block_count` less the MTP block).
    pub n_layer: usize,
    /// `nextn_predict_layers`: MTP blocks after the trunk (0 or 1).
    pub n_nextn: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub d_model: usize,
    pub n_ff_exp: usize,
    /// The shared expert's width (`expert_shared_feed_forward_length`, else
    /// `feed_forward_length`).
    pub n_ff_shexp: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Rotated dimensions of each head (`rope.dimension_count`).
    pub n_rot: usize,
    /// `rope.dimension_sections`: pairs per section (t, h, w, e).
    pub rope_sections: [usize; 4],
    pub rope_base: f32,
    pub rms_eps: f32,
    pub n_ctx_train: usize,
    pub n_vocab: usize,
    /// Per trunk layer: a Gated DeltaNet layer (else full attention).
    pub recurrent: Vec<bool>,
    /// `ssm.conv_kernel`.
    pub d_conv: usize,
    /// `ssm.state_size`: each head's key and value width.
    pub d_state: usize,
    /// `ssm.group_count`: key heads.
    pub n_k_heads: usize,
    /// `ssm.time_step_rank`: value heads (`ssm.inner_size` = `n_v_heads · d_state`).
    pub n_v_heads: usize,
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<HParams, ArchError> {
        let m = Meta::new(f, ARCH);
        let n_layer_all = m.req_u("block_count")?;
        let n_nextn = m.opt_u("nextn_predict_layers")?.unwrap_or(0);
        if n_nextn > 1 {
            return Err(m.err(
                "nextn_predict_layers",
                format!("is {n_nextn}; this build loads at most one MTP block"),
            ));
        }
        if n_layer_all <= n_nextn {
            return Err(m.err(
                "block_count",
                format!("{n_layer_all} leaves no trunk layer beside {n_nextn} MTP block(s)"),
            ));
        }
        let n_layer = n_layer_all - n_nextn;
        let d_model = m.req_u("embedding_length")?;
        let n_head = m.req_u("attention.head_count")?;
        if n_head == 0 || d_model == 0 {
            return Err(m.err(
                "attention.head_count",
                "embedding_length and head_count must be positive",
            ));
        }
        let n_head_kv = m.opt_u("attention.head_count_kv")?.unwrap_or(n_head);
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(m.err(
                "attention.head_count_kv",
                format!("{n_head_kv} must divide head_count {n_head}"),
            ));
        }
        let head_dim = m.opt_u("attention.key_length")?.unwrap_or(d_model / n_head);
        if m.opt_u("attention.value_length")?.unwrap_or(head_dim) != head_dim {
            return Err(m.err("attention.value_length", "must equal key_length"));
        }
        let n_rot = m.opt_u("rope.dimension_count")?.unwrap_or(head_dim);
        if head_dim == 0 || n_rot == 0 || n_rot % 2 != 0 || n_rot > head_dim {
            return Err(m.err(
                "rope.dimension_count",
                format!("{n_rot} must be even, positive and at most the head width {head_dim}"),
            ));
        }
        let sections = m
            .per_layer_u("rope.dimension_sections", 4)
            .map_err(|_| m.err("rope.dimension_sections", "must be 4 counts (t, h, w, e)"))?
            .ok_or_else(|| {
                m.err(
                    "rope.dimension_sections",
                    "is missing (required for qwen35moe)",
                )
            })?;
        let rope_sections = [sections[0], sections[1], sections[2], sections[3]];
        let sect_pairs: usize = rope_sections.iter().sum();
        if sect_pairs == 0 || sect_pairs > n_rot / 2 {
            return Err(m.err(
                "rope.dimension_sections",
                format!(
                    "{rope_sections:?} must add up to 1..={} (the rotated pairs)",
                    n_rot / 2
                ),
            ));
        }
        if let Some(t) = m.opt_str("rope.scaling.type")? {
            if t != "none" {
                return Err(m.err(
                    "rope.scaling.type",
                    format!("is {t}; this build runs qwen35moe without rope scaling"),
                ));
            }
        }
        let (n_expert, n_expert_used, n_ff_exp) = moe_params(&m)?;
        let n_ff_shexp = match m.opt_u("expert_shared_feed_forward_length")? {
            Some(n) => n,
            None => m.req_u("feed_forward_length")?,
        };
        if n_ff_shexp == 0 {
            return Err(m.err("expert_shared_feed_forward_length", "is 0"));
        }
        // llama.cpp never reads it for this family; a file that means something by it is refused
        // rather than run as if it were not there.
        let scale = m.opt_f("expert_weights_scale", 1.0)?;
        if scale != 1.0 && scale != 0.0 {
            return Err(m.err(
                "expert_weights_scale",
                format!("is {scale}; qwen35moe's routing weights are not scaled (llama.cpp ignores the key)"),
            ));
        }
        let d_conv = m.req_u("ssm.conv_kernel")?;
        let d_inner = m.req_u("ssm.inner_size")?;
        let d_state = m.req_u("ssm.state_size")?;
        let n_v_heads = m.req_u("ssm.time_step_rank")?;
        let n_k_heads = m.req_u("ssm.group_count")?;
        m.check_range("ssm.conv_kernel", d_conv, 1, 64)?;
        m.check_range("ssm.state_size", d_state, 1, 4096)?;
        m.check_range("ssm.group_count", n_k_heads, 1, 4096)?;
        if n_v_heads == 0 || n_v_heads % n_k_heads != 0 {
            return Err(m.err(
                "ssm.time_step_rank",
                format!("{n_v_heads} value heads must be a positive multiple of the {n_k_heads} key heads (ssm.group_count)"),
            ));
        }
        if d_inner != d_state * n_v_heads {
            return Err(m.err(
                "ssm.inner_size",
                format!(
                    "{d_inner} must be state_size × time_step_rank = {}",
                    d_state * n_v_heads
                ),
            ));
        }
        let recurrent = match m.per_layer_bool("attention.recurrent_layers", n_layer_all)? {
            Some(flags) => flags[..n_layer].to_vec(),
            None => {
                let interval = m.opt_u("full_attention_interval")?.unwrap_or(4);
                if interval == 0 {
                    return Err(m.err("full_attention_interval", "must be positive"));
                }
                (0..n_layer).map(|i| (i + 1) % interval != 0).collect()
            }
        };
        Ok(HParams {
            n_layer,
            n_nextn,
            n_expert,
            n_expert_used,
            d_model,
            n_ff_exp,
            n_ff_shexp,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_sections,
            rope_base: m.opt_f("rope.freq_base", 10_000.0)?,
            rms_eps: m.req_f("attention.layer_norm_rms_epsilon")?,
            n_ctx_train: m.req_u("context_length")?,
            n_vocab: n_vocab(f)?,
            recurrent,
            d_conv,
            d_state,
            n_k_heads,
            n_v_heads,
        })
    }

    /// Channels of the convolution: q and k of every key head, v of every value head.
    pub fn conv_channels(&self) -> usize {
        2 * self.n_k_heads * self.d_state + self.n_v_heads * self.d_state
    }

    /// Width of the value heads together (`ssm.inner_size`).
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.d_state
    }

    /// A recurrent layer's state.
    pub fn recurrent_shape(&self) -> RecurrentShape {
        RecurrentShape {
            conv_channels: self.conv_channels(),
            conv_kernel: self.d_conv,
            heads: self.n_v_heads,
            key_dim: self.d_state,
            value_dim: self.d_state,
        }
    }

    /// Per rotated pair, whether it turns with the position: llama.cpp's interleaved
    /// multi-section rope gives pair `i` (sector `s = i % Σ sections`) the t, h or w position
    /// when `s % 3` is 0, 1 or 2 and `s < 3 ·` that section's count — for text all three are
    /// the token's position — and the e position, 0 for text, otherwise.
    pub fn rotating_pairs(&self) -> Vec<bool> {
        let [t, h, w, _] = self.rope_sections;
        let total: usize = self.rope_sections.iter().sum();
        (0..self.n_rot / 2)
            .map(|i| {
                let s = i % total;
                match s % 3 {
                    0 => s < 3 * t,
                    1 => s < 3 * h,
                    _ => s < 3 * w,
                }
            })
            .collect()
    }
}

/// A gated full-attention layer's projections and norms.
pub struct FullAttn {
    /// Each head's query then its output gate (`2 · n_head · head_dim` rows).
    pub q_gate: Mat,
    pub k: Mat,
    pub v: Mat,
    pub o: Mat,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

/// A Gated DeltaNet layer's weights.
pub struct DeltaNet {
    /// `attn_qkv`: q, k and v mixed (the convolution's channels).
    pub qkv: Mat,
    /// `attn_gate`: z, the output norm's gate.
    pub z: Mat,
    /// `ssm_conv1d`: per channel its `d_conv` taps, oldest input first.
    pub conv: Vec<f32>,
    /// `ssm_dt.bias`, `ssm_a` (−exp(A_log)): one per value head.
    pub dt_bias: Vec<f32>,
    pub a: Vec<f32>,
    pub beta: Mat,
    pub alpha: Mat,
    /// `ssm_norm`: one head's width.
    pub norm: Vec<f32>,
    pub out: Mat,
}

/// What mixes a layer's positions.
pub enum Mixer {
    Attention(FullAttn),
    DeltaNet(DeltaNet),
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub mixer: Mixer,
    pub shexp: SharedExpert,
}

/// The MTP (next-token prediction) block at layer index `n_layer`: a full-attention layer
/// with its own experts and the NextN projections. Loaded and kept for speculation; the
/// forward pass does not run it.
pub struct MtpBlock {
    pub layer: LayerWeights,
    pub router: Mat,
    pub experts: Vec<ExpertTensor>,
    /// `nextn.eh_proj` (`2·d_model → d_model`), `nextn.enorm`, `nextn.hnorm`.
    pub eh_proj: Mat,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// Optional: its own embedding, head and head norm (else the model's).
    pub embed_tokens: Option<Mat>,
    pub shared_head_head: Option<Mat>,
    pub shared_head_norm: Option<Vec<f32>>,
}

/// A loaded qwen35moe model.
pub struct Qwen35Moe {
    pub hp: HParams,
    common: Common,
    layers: Vec<LayerWeights>,
    mtp: Option<MtpBlock>,
    rope: Rope,
    shape: AttnShape,
}

/// Load `file` as qwen35moe (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(Qwen35Moe::load(file, mode)?))
}

/// `blk.{il}.{s}.weight`.
fn wname(il: usize, s: &str) -> String {
    format!("blk.{il}.{s}.weight")
}

impl Qwen35Moe {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Qwen35Moe, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let d = hp.d_model;
        let (embd, output, output_norm) =
            ld.embedding_and_head(d, hp.n_vocab, "output_norm.weight")?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        let mut common_layers = Vec::with_capacity(hp.n_layer);
        for il in 0..hp.n_layer {
            let mixer = if hp.recurrent[il] {
                Mixer::DeltaNet(delta_net(&mut ld, &hp, il)?)
            } else {
                Mixer::Attention(full_attn(&mut ld, &hp, il)?)
            };
            layers.push(layer(&mut ld, &hp, il, mixer)?);
            common_layers.push(CommonLayer {
                memory: if hp.recurrent[il] {
                    LayerMemory::Recurrent(hp.recurrent_shape())
                } else {
                    LayerMemory::kv(MemoryKind::Full, hp.n_head_kv, hp.head_dim)
                },
                moe: Some(Experts {
                    router: ld.mat(&wname(il, "ffn_gate_inp"), d, hp.n_expert)?,
                    router_bias: None,
                    exps: ld.glu_experts(il, hp.d_model, hp.n_ff_exp, hp.n_expert)?,
                }),
            });
        }
        let mtp = if hp.n_nextn == 1 {
            Some(mtp_block(&mut ld, &hp)?)
        } else {
            None
        };
        let rotating = hp.rotating_pairs();
        // A pair that does not turn: an infinite frequency divisor makes its angle 0.
        let factors = rotating.iter().any(|r| !r).then(|| {
            rotating
                .iter()
                .map(|&r| if r { 1.0 } else { f32::INFINITY })
                .collect()
        });
        Ok(Qwen35Moe {
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
                gating: Gating::SOFTMAX_RENORM,
                embd,
                output,
                output_norm,
                rms_eps: hp.rms_eps,
                n_ff_exp: hp.n_ff_exp,
                glu: Glu::Silu,
                layers: common_layers,
                weights: ld.finish(),
            },
            rope: Rope::plain(RopeKind::Neox, hp.n_rot, hp.rope_base).with_freq_factors(factors),
            shape: AttnShape {
                n_head: hp.n_head,
                n_head_kv: hp.n_head_kv,
                head_dim: hp.head_dim,
                scale: 1.0 / (hp.head_dim as f32).sqrt(),
                window: None,
                softcap: None,
            },
            hp,
            layers,
            mtp,
        })
    }

    /// The MTP block, when the file has one.
    pub fn mtp(&self) -> Option<&MtpBlock> {
        self.mtp.as_ref()
    }

    /// The gated full attention of layer `il` on `st.cur` into `st.out`.
    fn full_attention(
        &self,
        cx: &Compute,
        st: &mut State,
        il: usize,
        w: &FullAttn,
    ) -> Result<(), ArchError> {
        let n = st.n_rows;
        let hd = self.hp.head_dim;
        let (qd, kvd) = (self.hp.n_head * hd, self.hp.n_head_kv * hd);
        st.attn.q.resize(n * 2 * qd, 0.0);
        st.attn.k.resize(n * kvd, 0.0);
        st.attn.v.resize(n * kvd, 0.0);
        cx.mats_rows(
            &mut [
                (&w.q_gate, &mut st.attn.q),
                (&w.k, &mut st.attn.k),
                (&w.v, &mut st.attn.v),
            ],
            &st.cur,
            n,
            &mut st.scratch.acts,
        )?;
        // Each head's 2·hd values are its query then its gate: gates out, queries packed.
        let gate = &mut st.scratch.gate;
        gate.resize(n * qd, 0.0);
        for r in 0..n {
            for h in 0..self.hp.n_head {
                let src = r * 2 * qd + h * 2 * hd;
                let dst = r * qd + h * hd;
                gate[dst..dst + hd].copy_from_slice(&st.attn.q[src + hd..src + 2 * hd]);
                st.attn.q.copy_within(src..src + hd, dst);
            }
        }
        st.attn.q.truncate(n * qd);
        let eps = self.hp.rms_eps;
        blocks::rms_norm_heads(
            &mut st.attn.q,
            hd,
            Some(&w.q_norm),
            eps,
            &mut st.scratch.tmp,
        );
        blocks::rms_norm_heads(
            &mut st.attn.k,
            hd,
            Some(&w.k_norm),
            eps,
            &mut st.scratch.tmp,
        );
        self.rope
            .apply_rows(&mut st.attn.q, qd, hd, &st.positions, &mut st.scratch.rope);
        self.rope
            .apply_rows(&mut st.attn.k, kvd, hd, &st.positions, &mut st.scratch.rope);
        attend_layer(cx, st, il, &self.shape, None)?;
        for (a, &g) in st.attn.att.iter_mut().zip(st.scratch.gate.iter()) {
            *a *= sigmoid(g);
        }
        st.out.resize(n * self.hp.d_model, 0.0);
        cx.mat_rows(&w.o, &st.attn.att, n, &mut st.scratch.acts, &mut st.out)
    }

    /// The Gated DeltaNet of layer `il` on `st.cur` into `st.out`, continuing the layer's
    /// recurrent state (or starting it, at position 0).
    fn delta_net(
        &self,
        cx: &Compute,
        st: &mut State,
        il: usize,
        w: &DeltaNet,
    ) -> Result<(), ArchError> {
        let hp = &self.hp;
        let n = st.n_rows;
        let (channels, vd, nv) = (hp.conv_channels(), hp.value_dim(), hp.n_v_heads);
        let State {
            mem,
            attn,
            scratch,
            cur,
            out,
            positions,
            ..
        } = st;
        // qkv_mixed → attn.q, z → attn.k, β → scratch.up, α → scratch.gate.
        attn.q.resize(n * channels, 0.0);
        attn.k.resize(n * vd, 0.0);
        scratch.up.resize(n * nv, 0.0);
        scratch.gate.resize(n * nv, 0.0);
        cx.mats_rows(
            &mut [
                (&w.qkv, &mut attn.q),
                (&w.z, &mut attn.k),
                (&w.beta, &mut scratch.up),
                (&w.alpha, &mut scratch.gate),
            ],
            cur,
            n,
            &mut scratch.acts,
        )?;
        let r = mem[il].recurrent(il)?;
        r.begin(il, positions)?;
        // The convolution, token by token over the window the state carries, into
        // attn.scores; then q and k L2-normed per head.
        let conv_out = &mut attn.scores;
        conv_out.resize(n * channels, 0.0);
        delta::causal_conv_silu(r, &w.conv, hp.d_conv, channels, &attn.q, n, conv_out);
        let ds = hp.d_state;
        let key_dim = hp.n_k_heads * ds;
        for t in 0..n {
            let row = &mut conv_out[t * channels..t * channels + 2 * key_dim];
            delta::l2_norm_heads(row, ds, hp.rms_eps, &mut scratch.tmp);
        }
        // The delta rule, token by token, each value head on its own state matrix.
        let att = &mut attn.att;
        att.resize(n * vd, 0.0);
        let scale = 1.0 / (ds as f32).sqrt();
        for t in 0..n {
            let row = &conv_out[t * channels..(t + 1) * channels];
            for h in 0..nv {
                let kh = h % hp.n_k_heads;
                let q = &row[kh * ds..(kh + 1) * ds];
                let k = &row[key_dim + kh * ds..key_dim + (kh + 1) * ds];
                let v = &row[2 * key_dim + h * ds..2 * key_dim + (h + 1) * ds];
                let beta = sigmoid(scratch.up[t * nv + h]);
                let g = softplus(scratch.gate[t * nv + h] + w.dt_bias[h]) * w.a[h];
                delta::delta_step(
                    &mut r.state[h * ds * ds..(h + 1) * ds * ds],
                    ds,
                    (q, k, v),
                    beta,
                    Decay::Head(g.exp()),
                    scale,
                    &mut att[t * vd + h * ds..t * vd + (h + 1) * ds],
                );
            }
            r.row_state_done(t);
        }
        r.finish(positions);
        // Each head RMS-normed with `ssm_norm`, times SiLU(z).
        for (o, z) in att.chunks_exact_mut(ds).zip(attn.k.chunks_exact(ds)) {
            blocks::rms_norm(o, Some(&w.norm), hp.rms_eps, &mut scratch.tmp);
            for ((x, &y), &zz) in o.iter_mut().zip(scratch.tmp.iter()).zip(z) {
                *x = y * blocks::silu(zz);
            }
        }
        out.resize(n * hp.d_model, 0.0);
        cx.mat_rows(&w.out, att, n, &mut scratch.acts, out)
    }
}

impl Qwen35Moe {
    /// The keys and values of the MTP layer `il` for the rows of `st.cur` (its normed input)
    /// into its memory, as [`Qwen35Moe::full_attention`] computes and commits them; nothing
    /// else (no output row is wanted).
    fn mtp_keys_values(
        &self,
        cx: &Compute,
        st: &mut State,
        il: usize,
        w: &FullAttn,
        h_out: &mut Vec<f32>,
    ) -> Result<(), ArchError> {
        let n = st.n_rows;
        let hd = self.hp.head_dim;
        let kvd = self.hp.n_head_kv * hd;
        st.attn.k.resize(n * kvd, 0.0);
        st.attn.v.resize(n * kvd, 0.0);
        cx.mats_rows(
            &mut [(&w.k, &mut st.attn.k), (&w.v, &mut st.attn.v)],
            &st.cur,
            n,
            &mut st.scratch.acts,
        )?;
        blocks::rms_norm_heads(
            &mut st.attn.k,
            hd,
            Some(&w.k_norm),
            self.hp.rms_eps,
            &mut st.scratch.tmp,
        );
        self.rope
            .apply_rows(&mut st.attn.k, kvd, hd, &st.positions, &mut st.scratch.rope);
        let State {
            mem,
            attn,
            positions,
            ..
        } = st;
        // What `attend_layer` writes of them (a full layer as it reads them, a ring after).
        let kv = mem[il].kv(il)?;
        kv.source(il, positions, &attn.k, &attn.v)?;
        kv.commit(positions, &attn.k, &attn.v);
        h_out.clear();
        st.logits.clear();
        Ok(())
    }

    /// The MTP block's routed experts on `st.h` (every row): softmax over the experts, top-k,
    /// renormalised, each expert's rows computed together from the file's map, the weighted
    /// outputs summed in rank order into `st.moe_out` (the trunk's arithmetic).
    fn mtp_experts(&self, cx: &Compute, st: &mut State, b: &MtpBlock) -> Result<(), ArchError> {
        let (d, ne, k) = (self.hp.d_model, self.hp.n_expert, self.hp.n_expert_used);
        let n = st.ffn_rows.len();
        let gating = self.common.gating;
        let mut probs = vec![0.0f32; n * ne];
        cx.mat_rows(&b.router, &st.h, n, &mut st.scratch.acts, &mut probs)?;
        let (mut ids, mut weights) = (vec![0u32; n * k], vec![0.0f32; n * k]);
        for r in 0..n {
            let scores = &mut probs[r * ne..(r + 1) * ne];
            gating.scores_in_place(scores);
            gating.select(
                scores,
                None,
                &mut st.pred.order,
                &mut ids[r * k..(r + 1) * k],
                &mut weights[r * k..(r + 1) * k],
            );
        }
        // (row, rank) slots, filled expert by expert.
        let mut per_rank = vec![0.0f32; n * k * d];
        let mut rows: Vec<usize> = Vec::new();
        let mut input: Vec<f32> = Vec::new();
        let mut out: Vec<f32> = Vec::new();
        let ty = |x: &ExpertTensor| x.info.ty;
        for e in 0..ne {
            rows.clear();
            rows.extend((0..n * k).filter(|&slot| ids[slot] as usize == e));
            if rows.is_empty() {
                continue;
            }
            input.clear();
            for &slot in &rows {
                let r = slot / k;
                input.extend_from_slice(&st.h[r * d..(r + 1) * d]);
            }
            let proj: Vec<&[u8]> = b
                .experts
                .iter()
                .map(|x| self.common.weights.expert_bytes(x, e))
                .collect();
            let types = match &b.experts[..] {
                [gu, dn] => Some([ty(gu), ty(gu), ty(dn)]),
                [g, u, dn] => Some([ty(g), ty(u), ty(dn)]),
                _ => None,
            };
            let (Some([g, u, dn]), Some(types)) = (super::gate_up_down(&proj), types) else {
                return Err(ArchError::Tensor {
                    file: String::new(),
                    tensor: wname(self.hp.n_layer, "ffn_gate_up_exps"),
                    what: "the MTP block's experts are not [gate_up, down] or [gate, up, down] of \
                           whole halves"
                        .into(),
                });
            };
            super::layers::split_ffn_biased(
                cx,
                &mut st.scratch,
                Glu::Silu,
                (types[0], g),
                (types[1], u),
                (types[2], dn),
                None,
                self.hp.n_ff_exp,
                d,
                &input,
                rows.len(),
                &[],
                &mut out,
            )?;
            for (i, &slot) in rows.iter().enumerate() {
                let w = weights[slot];
                for (a, &v) in per_rank[slot * d..(slot + 1) * d]
                    .iter_mut()
                    .zip(&out[i * d..(i + 1) * d])
                {
                    *a = v * w;
                }
            }
        }
        st.moe_out.clear();
        st.moe_out.resize(n * d, 0.0);
        for r in 0..n {
            let acc = &mut st.moe_out[r * d..(r + 1) * d];
            acc.copy_from_slice(&per_rank[r * k * d..(r * k + 1) * d]);
            for j in 1..k {
                let src = &per_rank[(r * k + j) * d..(r * k + j + 1) * d];
                for (x, &y) in acc.iter_mut().zip(src) {
                    *x += y;
                }
            }
        }
        Ok(())
    }
}

/// σ(x) as ggml computes it.

/// ggml's softplus: `ln(1 + eˣ)`, `x` itself past 20.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

fn full_attn(ld: &mut Loader, hp: &HParams, il: usize) -> Result<FullAttn, ArchError> {
    let d = hp.d_model;
    let qd = hp.n_head * hp.head_dim;
    let kvd = hp.n_head_kv * hp.head_dim;
    for b in ["attn_q", "attn_k", "attn_v", "attn_qkv"] {
        let name = format!("blk.{il}.{b}.bias");
        if ld.has(&name) {
            return Err(ArchError::Tensor {
                file: ld.path(),
                tensor: name,
                what: "is a bias qwen35moe's attention does not have; not supported".into(),
            });
        }
    }
    Ok(FullAttn {
        q_gate: ld.mat(&wname(il, "attn_q"), d, 2 * qd)?,
        k: ld.mat(&wname(il, "attn_k"), d, kvd)?,
        v: ld.mat(&wname(il, "attn_v"), d, kvd)?,
        o: ld.mat(&wname(il, "attn_output"), qd, d)?,
        q_norm: ld.vector(&wname(il, "attn_q_norm"), hp.head_dim)?,
        k_norm: ld.vector(&wname(il, "attn_k_norm"), hp.head_dim)?,
    })
}

fn delta_net(ld: &mut Loader, hp: &HParams, il: usize) -> Result<DeltaNet, ArchError> {
    let d = hp.d_model;
    let (channels, vd, nv) = (hp.conv_channels(), hp.value_dim(), hp.n_v_heads);
    Ok(DeltaNet {
        qkv: ld.mat(&wname(il, "attn_qkv"), d, channels)?,
        z: ld.mat(&wname(il, "attn_gate"), d, vd)?,
        conv: ld.floats(&wname(il, "ssm_conv1d"), &[hp.d_conv, channels])?,
        dt_bias: ld.vector(&format!("blk.{il}.ssm_dt.bias"), nv)?,
        a: ld.vector(&format!("blk.{il}.ssm_a"), nv)?,
        beta: ld.mat(&wname(il, "ssm_beta"), d, nv)?,
        alpha: ld.mat(&wname(il, "ssm_alpha"), d, nv)?,
        norm: ld.vector(&wname(il, "ssm_norm"), hp.d_state)?,
        out: ld.mat(&wname(il, "ssm_out"), vd, d)?,
    })
}

/// A layer's norms and shared expert around its mixer.
fn layer(
    ld: &mut Loader,
    hp: &HParams,
    il: usize,
    mixer: Mixer,
) -> Result<LayerWeights, ArchError> {
    let (d, fs) = (hp.d_model, hp.n_ff_shexp);
    Ok(LayerWeights {
        attn_norm: ld.vector(&wname(il, "attn_norm"), d)?,
        post_norm: ld.vector(&wname(il, "post_attention_norm"), d)?,
        mixer,
        shexp: SharedExpert {
            gate_inp: ld.vector(&wname(il, "ffn_gate_inp_shexp"), d)?,
            ffn: GluFfn::load(ld, il, "_shexp", d, fs)?,
        },
    })
}

fn mtp_block(ld: &mut Loader, hp: &HParams) -> Result<MtpBlock, ArchError> {
    let (il, d) = (hp.n_layer, hp.d_model);
    let attn = full_attn(ld, hp, il)?;
    let layer = layer(ld, hp, il, Mixer::Attention(attn))?;
    let n = |s: &str| wname(il, &format!("nextn.{s}"));
    Ok(MtpBlock {
        layer,
        router: ld.mat(&wname(il, "ffn_gate_inp"), d, hp.n_expert)?,
        experts: ld.glu_experts(il, hp.d_model, hp.n_ff_exp, hp.n_expert)?,
        eh_proj: ld.mat(&n("eh_proj"), 2 * d, d)?,
        enorm: ld.vector(&n("enorm"), d)?,
        hnorm: ld.vector(&n("hnorm"), d)?,
        embed_tokens: ld.mat_opt(&n("embed_tokens"), d, hp.n_vocab)?,
        shared_head_head: ld.mat_opt(&n("shared_head_head"), d, hp.n_vocab)?,
        shared_head_norm: ld.floats_opt(&n("shared_head_norm"), &[d])?,
    })
}

impl Arch for Qwen35Moe {
    fn common(&self) -> &Common {
        &self.common
    }

    fn mtp_memory(&self) -> Option<LayerMemory> {
        self.mtp
            .as_ref()
            .map(|_| LayerMemory::kv(MemoryKind::Full, self.hp.n_head_kv, self.hp.head_dim))
    }

    /// llama.cpp's `graph_mtp`: the token's embedding and `h`, each RMS-normed (`enorm`,
    /// `hnorm`), concatenated (embedding first) through `eh_proj`; then a full-attention
    /// layer with its routed experts and sigmoid-gated shared expert, as the trunk's; then
    /// `shared_head_norm` (else `output_norm`) and `shared_head_head` (else the output head).
    fn mtp_forward(
        &self,
        cx: &Compute,
        st: &mut State,
        tokens: &[u32],
        h: &[f32],
        h_out: &mut Vec<f32>,
    ) -> Result<(), ArchError> {
        let Some(b) = self.mtp.as_ref() else {
            return Err(ArchError::Key {
                file: String::new(),
                key: "nextn_predict_layers".into(),
                what: "is 0: the file has no MTP block".into(),
            });
        };
        let (d, eps, il) = (self.hp.d_model, self.hp.rms_eps, self.hp.n_layer);
        let n = tokens.len();
        // [enorm(embedding) | hnorm(h)] per row, into `st.out` (attention rewrites it).
        let embd = b.embed_tokens.as_ref().unwrap_or(&self.common.embd);
        st.scratch.tmp.resize(d, 0.0);
        st.out.resize(n * 2 * d, 0.0);
        for (r, &t) in tokens.iter().enumerate() {
            embd.row_f32(t as usize, &mut st.scratch.tmp)?;
            let row = &mut st.out[r * 2 * d..(r + 1) * 2 * d];
            blocks::rms_norm(&st.scratch.tmp, Some(&b.enorm), eps, &mut row[..d]);
            blocks::rms_norm(&h[r * d..(r + 1) * d], Some(&b.hnorm), eps, &mut row[d..]);
        }
        st.x.resize(n * d, 0.0);
        let State {
            out, x, scratch, ..
        } = &mut *st;
        cx.mat_rows(&b.eh_proj, out, n, &mut scratch.acts, x)?;
        // The layer: gated attention, the residual, post_attention_norm into the experts.
        let l = &b.layer;
        blocks::rms_norm_all(&st.x, d, Some(&l.attn_norm), eps, &mut st.cur);
        let Mixer::Attention(w) = &l.mixer else {
            return Err(ArchError::Tensor {
                file: String::new(),
                tensor: wname(il, "attn_q"),
                what: "the MTP block's layer is not an attention layer".into(),
            });
        };
        if st.out_rows.is_empty() {
            // A catch-up: what a later draft reads of these rows is their keys and values,
            // which need only the projections that make them (the bits full attention makes).
            return self.mtp_keys_values(cx, st, il, w, h_out);
        }
        self.full_attention(cx, st, il, w)?;
        for (x, o) in st.x.iter_mut().zip(&st.out) {
            *x += *o;
        }
        st.ffn_rows.clear();
        st.ffn_rows.extend(0..n as u32);
        blocks::rms_norm_rows(&st.x, d, &st.ffn_rows, Some(&l.post_norm), eps, &mut st.h);
        l.shexp.run(cx, st, d, sigmoid)?;
        self.mtp_experts(cx, st, b)?;
        finish_with_shared(st, d);
        // The head, for the rows asked for.
        let norm = b
            .shared_head_norm
            .as_deref()
            .unwrap_or(&self.common.output_norm);
        let head = b.shared_head_head.as_ref().unwrap_or(&self.common.output);
        blocks::rms_norm_rows(&st.x, d, &st.out_rows, Some(norm), eps, &mut st.cur);
        let m = st.out_rows.len();
        h_out.clear();
        h_out.extend_from_slice(&st.cur[..m * d]);
        if m == 0 {
            st.logits.clear();
            return Ok(());
        }
        st.logits.resize(m * head.rows, 0.0);
        let State {
            cur,
            scratch,
            logits,
            ..
        } = &mut *st;
        cx.mat_rows(head, cur, m, &mut scratch.acts, logits)
    }

    /// The mixer (DeltaNet or gated attention), the residual, `post_attention_norm` into the
    /// experts' input, and the shared expert (into `st.side`).
    fn dense(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let (d, eps) = (self.hp.d_model, self.hp.rms_eps);
        let l = &self.layers[il];
        blocks::rms_norm_all(&st.x, d, Some(&l.attn_norm), eps, &mut st.cur);
        st.mark(il, "RMS_NORM", "attn_norm");
        match &l.mixer {
            Mixer::Attention(w) => {
                self.full_attention(cx, st, il, w)?;
                st.mark(il, "ATTN", "attn");
            }
            Mixer::DeltaNet(w) => {
                self.delta_net(cx, st, il, w)?;
                st.mark(il, "GATED_DELTA_NET", "delta_net");
            }
        }
        for (x, o) in st.x.iter_mut().zip(&st.out) {
            *x += *o;
        }
        blocks::rms_norm_rows(&st.x, d, &st.ffn_rows, Some(&l.post_norm), eps, &mut st.h);
        st.mark(il, "RMS_NORM", "ffn_norm");
        l.shexp.run(cx, st, d, sigmoid)?;
        st.mark(il, "FFN", "ffn_shexp");
        Ok(())
    }

    /// The experts' sum plus the shared expert, then the residual (llama.cpp's order).
    fn finish_layer(&self, _cx: &Compute, st: &mut State, _layer: usize) -> Result<(), ArchError> {
        finish_with_shared(st, self.hp.d_model);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{load_model, Model, RouteOut};
    use crate::gen::{self, GenOptions, Preset, TypeScheme};

    /// The tiny qwen35moe file of `preset` in `scheme` (seed 5), loaded on 2 threads.
    fn tiny(preset: Preset, scheme: &str) -> Model {
        let types = TypeScheme::from_name(scheme).unwrap();
        let opts = GenOptions {
            seed: 5,
            shape: preset.shape_for(gen::GenArch::Qwen35Moe).unwrap(),
            vocab: crate::vocab::builtin_vocab().unwrap(),
            ..gen::tests::options(preset, types)
        };
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "bmoe-qwen35moe-{}-{call}-{}-{scheme}.gguf",
            std::process::id(),
            preset.name()
        ));
        gen::generate(&opts, &path, |_, _| {}).unwrap();
        let file = Arc::new(GgufFile::open(&path).unwrap());
        let model = load_model(file, DenseMode::Mmap, 2).unwrap();
        let _ = std::fs::remove_file(&path);
        model
    }

    /// Feed `tokens` at `first..` as one batch; every row's logits.
    fn feed(model: &Model, st: &mut State, tokens: &[u32], first: u32) -> Vec<f32> {
        let positions: Vec<u32> = (first..first + tokens.len() as u32).collect();
        let out_rows: Vec<u32> = (0..tokens.len() as u32).collect();
        model.begin(st, tokens, &positions, &out_rows).unwrap();
        let w = model.arch.weights();
        let mut ro = RouteOut::default();
        for layer in 0..model.dims().n_layer {
            model.dense(st, layer).unwrap();
            model.route(st, layer, &mut ro).unwrap();
            let xs = model.experts(layer).to_vec();
            let mut by_expert: std::collections::BTreeMap<usize, Vec<(u32, u16, f32)>> =
                Default::default();
            for i in 0..ro.rows.len() {
                for rank in 0..ro.k {
                    by_expert
                        .entry(ro.ids[i * ro.k + rank] as usize)
                        .or_default()
                        .push((i as u32, rank as u16, ro.weights[i * ro.k + rank]));
                }
            }
            for (e, uses) in by_expert {
                let proj: Vec<&[u8]> = xs.iter().map(|x| w.expert_bytes(x, e)).collect();
                model.expert(st, layer, e, &proj, &uses).unwrap();
            }
            model.finish_layer(st, layer).unwrap();
        }
        model.head(st).unwrap();
        st.logits.clone()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The recurrence runs token by token, so a prompt gives the same bits however it is
    /// split into batches (a session continuing a state equals a fresh prefill), on both
    /// kinds of layer, fused experts (tiny) and split ones (tiny-odd, whose DeltaNet heads
    /// are 24 wide).
    #[test]
    fn a_prompt_gives_the_same_bits_however_it_is_batched() {
        for (preset, scheme) in [(Preset::Tiny, "q8_0"), (Preset::TinyOdd, "f32")] {
            let model = tiny(preset, scheme);
            let hp = model_hp(&model);
            assert!(hp.recurrent.iter().any(|&r| r) && hp.recurrent.iter().any(|&r| !r));
            let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 250).collect();
            let nv = model.dims().n_vocab;
            let mut st = model.new_state(64);
            let whole = feed(&model, &mut st, &prompt, 0);
            assert!(whole.iter().all(|v| v.is_finite()));
            for cuts in [
                &[1usize, 24][..],
                &[5, 6, 24],
                &[23, 24],
                &[7, 8, 9, 10, 24],
            ] {
                let mut st = model.new_state(64);
                let mut start = 0;
                let mut rows = Vec::new();
                for &end in cuts {
                    rows.extend(feed(&model, &mut st, &prompt[start..end], start as u32));
                    start = end;
                }
                assert_eq!(
                    bits(&rows),
                    bits(&whole),
                    "{} cut at {cuts:?}",
                    preset.name()
                );
            }
            // A batch that does not start where the state stands is refused by name.
            let e = {
                let mut st = model.new_state(64);
                feed(&model, &mut st, &prompt[..5], 0);
                let positions = [3u32];
                model
                    .begin(&mut st, &prompt[3..4], &positions, &[0])
                    .unwrap();
                model.dense(&mut st, 0).unwrap_err().to_string()
            };
            assert!(e.contains("cannot roll back"), "{e}");
            assert_eq!(whole.len(), 24 * nv);
        }
    }

    fn model_hp(m: &Model) -> HParams {
        let f = m.arch.weights().file().clone();
        HParams::from_gguf(&f).unwrap()
    }

    /// Qwen3.5's sections (11, 11, 10 of 32 pairs) turn every pair; sections that leave
    /// pairs to the e position (0 for text) leave those pairs unturned.
    #[test]
    fn multi_section_rope_for_text_is_neox_but_the_e_pairs() {
        let f = |n_rot, rope_sections| HParams {
            n_layer: 1,
            n_nextn: 0,
            n_expert: 1,
            n_expert_used: 1,
            d_model: 1,
            n_ff_exp: 1,
            n_ff_shexp: 1,
            n_head: 1,
            n_head_kv: 1,
            head_dim: 256,
            n_rot,
            rope_sections,
            rope_base: 1e7,
            rms_eps: 1e-6,
            n_ctx_train: 1,
            n_vocab: 1,
            recurrent: vec![true],
            d_conv: 4,
            d_state: 1,
            n_k_heads: 1,
            n_v_heads: 1,
        };
        assert!(f(64, [11, 11, 10, 0]).rotating_pairs().iter().all(|&r| r));
        // 8 pairs in sections 2/2/2/2: sectors 6 (t, 6 ≥ 3·2) and 7 (h, 7 ≥ 3·2) go to e.
        let r = f(16, [2, 2, 2, 2]).rotating_pairs();
        assert_eq!(r, [true, true, true, true, true, true, false, false]);
    }

    /// A catch-up that wants no output row writes only the MTP layer's keys and values, with
    /// the bits the whole layer writes: a draft after it gives the same logits either way.
    #[test]
    fn an_mtp_catch_up_without_outputs_writes_the_same_keys_and_values() {
        let model = tiny(Preset::Tiny, "q8_0");
        let d = model.dims().d_model;
        let tokens = [3u32, 77, 1000, 5, 42, 9];
        let positions: Vec<u32> = (0..tokens.len() as u32).collect();
        let h: Vec<f32> = (0..tokens.len() * d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let draft = |rows: &[u32]| {
            let mut st = model.new_mtp_state(32).expect("an MTP head");
            let mut h_out = Vec::new();
            model
                .mtp(&mut st, &tokens, &positions, &h, rows, &mut h_out)
                .unwrap();
            assert_eq!(h_out.len(), rows.len() * d);
            model
                .mtp(&mut st, &[11], &[6], &h[..d], &[0], &mut h_out)
                .unwrap();
            (bits(&st.logits), bits(&h_out))
        };
        let all: Vec<u32> = (0..tokens.len() as u32).collect();
        assert_eq!(draft(&[]), draft(&all));
        // And the keys and values matter: a draft from an empty memory differs.
        let mut st = model.new_mtp_state(32).unwrap();
        let mut h_out = Vec::new();
        model
            .mtp(&mut st, &[11], &[6], &h[..d], &[0], &mut h_out)
            .unwrap();
        assert_ne!(bits(&st.logits), draft(&[]).0);
    }

    /// The MTP block is loaded and kept, and the file's keys come back as written.
    #[test]
    fn the_tiny_file_has_both_layer_kinds_and_its_mtp_block() {
        let model = tiny(Preset::Tiny, "f32");
        let hp = model_hp(&model);
        assert_eq!((hp.n_layer, hp.n_nextn), (4, 1));
        assert_eq!(hp.recurrent, [true, false, true, false]);
        assert_eq!((hp.n_k_heads, hp.n_v_heads, hp.d_state), (2, 4, 32));
        assert_eq!((hp.n_rot, hp.rope_sections), (16, [3, 3, 2, 0]));
        let file = model.arch.weights().file().clone();
        let q = Qwen35Moe::load(file, DenseMode::Mmap).unwrap();
        let mtp = q.mtp().expect("an MTP block");
        assert_eq!(mtp.experts.len(), 2, "fused gate_up and down");
        assert_eq!(mtp.eh_proj.cols, 2 * hp.d_model);
        assert!(mtp.shared_head_norm.is_some() && mtp.embed_tokens.is_none());
        assert_eq!(
            model.arch.memory(0),
            LayerMemory::Recurrent(hp.recurrent_shape())
        );
    }
}
