//! `gemma4` (Gemma-4-26B-A4B and its dense-layer relatives), after llama.cpp's
//! `src/models/gemma4.cpp`.
//!
//! Embedding rows are scaled by √d_model. Layer: `attn_norm` (RMS) → q/k/v (`attn_v` optional:
//! the keys serve as values) → per-head RMS norms (q and k with weights, v without) → NeoX
//! rotary embedding (sliding-window layers: their own base, head dim and rotary width; global
//! layers: `rope_freqs` frequency factors) → GQA attention with score scale 1 (a window of
//! `sliding_window` positions on the layers `sliding_window_pattern` marks) → `attn_output` →
//! `post_attention_norm` → residual. Then the FFN:
//! - **MoE layers** (those with `ffn_gate_inp`) run two FFNs on the attention output `a`:
//!   the dense MLP `post_ffw_norm_1(mlp(ffn_norm(a)))` and the routed experts
//!   `post_ffw_norm_2(Σ w·expert(pre_ffw_norm_2(a)))`. The router reads its own input,
//!   `rms_norm(a) / √d_model ⊙ ffn_gate_inp.scale` (`router_separate`); softmax over every
//!   expert, top-k, renormalised. Experts are GELU-gated over a fused `ffn_gate_up_exps` (or
//!   split gate/up), and each expert's output is multiplied by its `ffn_down_exps.scale`;
//! - **dense layers** run the MLP alone;
//!
//! the sum goes through `post_ffw_norm` into the residual, and the layer's output is scaled by
//! `layer_output_scale` when the file has it. At the end `output_norm`, `output` (or the tied
//! embedding) and `final_logit_softcapping`. Every MLP is GELU-gated (tanh approximation through
//! f16, as ggml). The dense MLP is resident and counted in the layer's dense bytes; the router
//! and the cache see only the routed experts.
//!
//! Not run (refused by key): shared KV layers (`attention.shared_kv_layers` > 0) and per-layer
//! input embeddings (`embedding_length_per_layer_input` > 0), the small E2B/E4B models' parts.

use super::blocks::{self, AttnShape, Compute, Glu, Rope, RopeKind};
use super::common;
use super::layers::{add_rows, attend_layer, split_ffn};
use super::meta::{moe_params, n_vocab, Meta};
use super::state::{LayerMemory, MemoryKind, Scratch, State};
use super::weights::{Loader, Mat};
use super::{Arch, ArchError, Common, CommonLayer, Dims, Experts};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use bmoe_core::Gating;
use std::sync::Arc;

pub const ARCH: &str = "gemma4";

/// One layer's attention geometry.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerAttn {
    /// A sliding-window layer (else global).
    pub swa: bool,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Rotated dimensions of each head.
    pub n_rot: usize,
}

/// Hyper-parameters, read and checked once at load.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    pub n_layer: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub d_model: usize,
    pub n_ff_exp: usize,
    /// The dense MLP's width per layer (`feed_forward_length`, scalar or per layer).
    pub n_ff: Vec<usize>,
    pub attn: Vec<LayerAttn>,
    pub n_ctx_train: usize,
    pub rope_base: f32,
    pub rope_base_swa: f32,
    /// `attention.sliding_window`: positions a sliding-window layer sees (itself included).
    pub window: usize,
    pub rms_eps: f32,
    /// `final_logit_softcapping` (none when absent or 0).
    pub softcap: Option<f32>,
    pub n_vocab: usize,
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<HParams, ArchError> {
        Self::from_meta(f, n_vocab(f)?)
    }

    /// The hyper-parameters from `f`'s metadata alone, for a vocabulary of `n_vocab`.
    pub fn from_meta(f: &GgufFile, n_vocab: usize) -> Result<HParams, ArchError> {
        let m = Meta::new(f, ARCH);
        let n_layer = m.req_u("block_count")?;
        let d_model = m.req_u("embedding_length")?;
        if n_layer == 0 || d_model == 0 {
            return Err(m.err(
                "block_count",
                "block_count and embedding_length must be positive",
            ));
        }
        for key in [
            "attention.shared_kv_layers",
            "embedding_length_per_layer_input",
        ] {
            if let Some(n) = m.opt_u(key)? {
                if n != 0 {
                    return Err(m.err(
                        key,
                        format!("is {n}; shared KV layers and per-layer input embeddings (Gemma-4 E2B/E4B) are not supported"),
                    ));
                }
            }
        }
        let (n_expert, n_expert_used, n_ff_exp) = moe_params(&m)?;
        let n_ff = m
            .per_layer_u("feed_forward_length", n_layer)?
            .ok_or_else(|| m.err("feed_forward_length", "is missing (required for gemma4)"))?;
        if let Some(l) = n_ff.iter().position(|&n| n == 0) {
            return Err(m.err("feed_forward_length", format!("is 0 at layer {l}")));
        }
        let n_head = m
            .per_layer_u("attention.head_count", n_layer)?
            .ok_or_else(|| m.err("attention.head_count", "is missing (required for gemma4)"))?;
        let n_head_kv = m
            .per_layer_u("attention.head_count_kv", n_layer)?
            .unwrap_or_else(|| n_head.clone());
        let swa = m
            .per_layer_bool("attention.sliding_window_pattern", n_layer)?
            .ok_or_else(|| {
                m.err(
                    "attention.sliding_window_pattern",
                    "is missing (required for gemma4)",
                )
            })?;
        let window = m.req_u("attention.sliding_window")?;
        if window == 0 {
            return Err(m.err("attention.sliding_window", "is 0"));
        }
        let hd_full = m
            .opt_u("attention.key_length")?
            .unwrap_or(d_model / n_head[0].max(1));
        let hd_swa = m.opt_u("attention.key_length_swa")?.unwrap_or(hd_full);
        for (key, v, k) in [
            ("attention.value_length", "attention.key_length", hd_full),
            (
                "attention.value_length_swa",
                "attention.key_length_swa",
                hd_swa,
            ),
        ] {
            if let Some(vd) = m.opt_u(key)? {
                if vd != k {
                    return Err(m.err(
                        key,
                        format!("{vd} differs from {v} {k}; gemma4 needs them equal"),
                    ));
                }
            }
        }
        let rot_full = m.opt_u("rope.dimension_count")?.unwrap_or(hd_full);
        let rot_swa = m.opt_u("rope.dimension_count_swa")?.unwrap_or(rot_full);
        let mut attn = Vec::with_capacity(n_layer);
        for l in 0..n_layer {
            let (hd, rot) = if swa[l] {
                (hd_swa, rot_swa)
            } else {
                (hd_full, rot_full)
            };
            let (nh, nkv) = (n_head[l], n_head_kv[l]);
            if nh == 0 || nkv == 0 || nh % nkv != 0 {
                return Err(m.err(
                    "attention.head_count_kv",
                    format!("layer {l}: {nkv} KV heads must divide {nh} heads"),
                ));
            }
            if hd == 0 || rot == 0 || rot > hd || rot % 2 != 0 {
                return Err(m.err(
                    if swa[l] {
                        "rope.dimension_count_swa"
                    } else {
                        "rope.dimension_count"
                    },
                    format!("layer {l}: {rot} rotated dimensions of a head of {hd}: must be even, positive, at most the head"),
                ));
            }
            attn.push(LayerAttn {
                swa: swa[l],
                n_head: nh,
                n_head_kv: nkv,
                head_dim: hd,
                n_rot: rot,
            });
        }
        let rope_base = m.opt_f("rope.freq_base", 10_000.0)?;
        let softcap = m.opt_f("final_logit_softcapping", 0.0)?;
        Ok(HParams {
            n_layer,
            n_expert,
            n_expert_used,
            d_model,
            n_ff_exp,
            n_ff,
            attn,
            n_ctx_train: m.req_u("context_length")?,
            rope_base,
            rope_base_swa: m.opt_f("rope.freq_base_swa", rope_base)?,
            window,
            rms_eps: m.req_f("attention.layer_norm_rms_epsilon")?,
            softcap: (softcap != 0.0).then_some(softcap),
            n_vocab,
        })
    }
}

/// A dense GELU-gated MLP.
struct Mlp {
    gate: Mat,
    up: Mat,
    down: Mat,
}

/// The routed side of a MoE layer.
/// A MoE layer's own parts beside its router and experts (those are in [`Common`]: the
/// experts `[gate_up, down]` (fused) or `[gate, up, down]`, in read order).
struct Moe {
    /// `ffn_gate_inp.scale`, one factor per input dimension.
    router_scale: Vec<f32>,
    pre_norm_2: Vec<f32>,
    post_norm_1: Vec<f32>,
    post_norm_2: Vec<f32>,
    /// `ffn_down_exps.scale`: each expert's output factor.
    down_scale: Option<Vec<f32>>,
}

struct LayerWeights {
    attn_norm: Vec<f32>,
    q: Mat,
    k: Mat,
    /// `None`: the keys (before their norm) are the values.
    v: Option<Mat>,
    o: Mat,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    mlp: Mlp,
    post_ffw_norm: Vec<f32>,
    out_scale: Option<f32>,
    moe: Option<Moe>,
    rope: Rope,
    shape: AttnShape,
}

/// A loaded gemma4 model.
pub struct Gemma4 {
    pub hp: HParams,
    common: Common,
    layers: Vec<LayerWeights>,
}

/// Load `file` as gemma4 (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(Gemma4::load(file, mode)?))
}

impl Gemma4 {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Gemma4, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let d = hp.d_model;
        let (embd, output, output_norm) =
            ld.embedding_and_head(d, hp.n_vocab, "output_norm.weight")?;
        // Global layers share one table of rotary frequency factors ("proportional rope").
        let hd_full = hp.attn.iter().find(|a| !a.swa).map(|a| a.head_dim);
        let freq_factors = match hd_full {
            Some(hd) => Some(ld.vector("rope_freqs.weight", hd / 2)?),
            None => None,
        };
        let mut layers = Vec::with_capacity(hp.n_layer);
        let mut common_layers = Vec::with_capacity(hp.n_layer);
        let mut n_moe = 0;
        for (i, a) in hp.attn.iter().enumerate() {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let (qd, kvd) = (a.n_head * a.head_dim, a.n_head_kv * a.head_dim);
            let ff = hp.n_ff[i];
            let (moe, experts) = if ld.has(&n("ffn_gate_inp")) {
                n_moe += 1;
                let ne = hp.n_expert;
                let exps = ld.glu_experts(i, d, hp.n_ff_exp, ne)?;
                for unsupported in ["ffn_gate_up_exps", "ffn_gate_exps", "ffn_up_exps"] {
                    let s = format!("blk.{i}.{unsupported}.scale");
                    if ld.has(&s) {
                        return Err(ArchError::Tensor {
                            file: ld.path(),
                            tensor: s,
                            what: "is a per-expert input scale this build does not apply".into(),
                        });
                    }
                }
                let router = ld.mat(&n("ffn_gate_inp"), d, ne)?;
                let moe = Moe {
                    router_scale: ld.vector(&format!("blk.{i}.ffn_gate_inp.scale"), d)?,
                    pre_norm_2: ld.vector(&n("pre_ffw_norm_2"), d)?,
                    post_norm_1: ld.vector(&n("post_ffw_norm_1"), d)?,
                    post_norm_2: ld.vector(&n("post_ffw_norm_2"), d)?,
                    down_scale: ld.floats_opt(&format!("blk.{i}.ffn_down_exps.scale"), &[ne])?,
                };
                let experts = Experts {
                    router,
                    router_bias: None,
                    exps,
                };
                (Some(moe), Some(experts))
            } else {
                (None, None)
            };
            common_layers.push(CommonLayer {
                memory: LayerMemory::kv(
                    if a.swa {
                        MemoryKind::Ring { window: hp.window }
                    } else {
                        MemoryKind::Full
                    },
                    a.n_head_kv,
                    a.head_dim,
                ),
                moe: experts,
            });
            let rope = if a.swa {
                Rope::plain(RopeKind::Neox, a.n_rot, hp.rope_base_swa)
            } else {
                Rope::plain(RopeKind::Neox, a.n_rot, hp.rope_base)
                    .with_freq_factors(freq_factors.clone())
            };
            layers.push(LayerWeights {
                attn_norm: ld.vector(&n("attn_norm"), d)?,
                q: ld.mat(&n("attn_q"), d, qd)?,
                k: ld.mat(&n("attn_k"), d, kvd)?,
                v: ld.mat_opt(&n("attn_v"), d, kvd)?,
                o: ld.mat(&n("attn_output"), qd, d)?,
                q_norm: ld.vector(&n("attn_q_norm"), a.head_dim)?,
                k_norm: ld.vector(&n("attn_k_norm"), a.head_dim)?,
                post_attn_norm: ld.vector(&n("post_attention_norm"), d)?,
                ffn_norm: ld.vector(&n("ffn_norm"), d)?,
                mlp: Mlp {
                    gate: ld.mat(&n("ffn_gate"), d, ff)?,
                    up: ld.mat(&n("ffn_up"), d, ff)?,
                    down: ld.mat(&n("ffn_down"), ff, d)?,
                },
                post_ffw_norm: ld.vector(&n("post_ffw_norm"), d)?,
                out_scale: ld.floats_opt(&n("layer_output_scale"), &[1])?.map(|v| v[0]),
                moe,
                rope,
                shape: AttnShape {
                    n_head: a.n_head,
                    n_head_kv: a.n_head_kv,
                    head_dim: a.head_dim,
                    scale: 1.0,
                    window: a.swa.then_some(hp.window),
                    softcap: None,
                },
            });
        }
        if n_moe == 0 {
            return Err(ArchError::NotMoe {
                file: ld.path(),
                arch: ARCH.into(),
            });
        }
        Ok(Gemma4 {
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
                glu: Glu::Gelu,
                layers: common_layers,
                weights: ld.finish(),
            },
            hp,
            layers,
        })
    }

    /// Self-attention of `st.cur` into `st.out`: projections, per-head norms (q, k weighted;
    /// v plain), rotary embedding, the layer's memory, attention, output projection.
    fn attention(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let l = &self.layers[il];
        let eps = self.hp.rms_eps;
        let shape = &l.shape;
        let n = st.n_rows;
        let hd = shape.head_dim;
        let (qd, kvd) = (shape.n_head * hd, shape.n_head_kv * hd);
        st.attn.q.resize(n * qd, 0.0);
        st.attn.k.resize(n * kvd, 0.0);
        st.attn.v.resize(n * kvd, 0.0);
        let acts = &mut st.scratch.acts;
        cx.mat_rows(&l.q, &st.cur, n, acts, &mut st.attn.q)?;
        cx.mat_rows(&l.k, &st.cur, n, acts, &mut st.attn.k)?;
        match &l.v {
            Some(v) => cx.mat_rows(v, &st.cur, n, acts, &mut st.attn.v)?,
            None => st.attn.v.copy_from_slice(&st.attn.k),
        }
        let tmp = &mut st.scratch.tmp;
        blocks::rms_norm_heads(&mut st.attn.q, hd, Some(&l.q_norm[..]), eps, tmp);
        blocks::rms_norm_heads(&mut st.attn.k, hd, Some(&l.k_norm[..]), eps, tmp);
        blocks::rms_norm_heads(&mut st.attn.v, hd, None, eps, tmp);
        l.rope
            .apply_rows(&mut st.attn.q, qd, hd, &st.positions, &mut st.scratch.rope);
        l.rope
            .apply_rows(&mut st.attn.k, kvd, hd, &st.positions, &mut st.scratch.rope);
        attend_layer(cx, st, il, shape, None)?;
        st.out.resize(n * self.hp.d_model, 0.0);
        cx.mat_rows(&l.o, &st.attn.att, n, &mut st.scratch.acts, &mut st.out)
    }

    /// The dense MLP of layer `il` on `m` rows of `input` into `out`.
    fn mlp(
        &self,
        cx: &Compute,
        s: &mut Scratch,
        il: usize,
        input: &[f32],
        m: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), ArchError> {
        let w = &self.layers[il].mlp;
        split_ffn(
            cx,
            s,
            Glu::Gelu,
            (w.gate.ty, w.gate.bytes()),
            (w.up.ty, w.up.bytes()),
            (w.down.ty, w.down.bytes()),
            self.hp.n_ff[il],
            self.hp.d_model,
            input,
            m,
            &[],
            out,
        )
    }

    /// `post_ffw_norm` of the FFN rows' output `ffn` (normed in `normed`) into those `rows`
    /// of the residual `x`, then the layer scale.
    fn close_layer(
        &self,
        x: &mut [f32],
        rows: &[u32],
        normed: &mut Vec<f32>,
        il: usize,
        ffn: &[f32],
    ) {
        let l = &self.layers[il];
        let d = self.hp.d_model;
        blocks::rms_norm_all(ffn, d, Some(&l.post_ffw_norm), self.hp.rms_eps, normed);
        add_rows(x, d, rows, normed);
        if let Some(s) = l.out_scale {
            for &r in rows {
                let r = r as usize;
                x[r * d..(r + 1) * d].iter_mut().for_each(|v| *v *= s);
            }
        }
    }
}

impl Arch for Gemma4 {
    fn batches_sequences(&self) -> bool {
        true
    }
    fn common(&self) -> &Common {
        &self.common
    }
    fn embed_scale(&self) -> Option<f32> {
        Some((self.hp.d_model as f32).sqrt())
    }

    /// Attention and its post-norm into the residual; then for a MoE layer the dense MLP
    /// (into `st.side`), the experts' input (`st.h`) and the router's (`st.router_in`); a
    /// dense layer finishes its MLP here.
    fn dense(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let (d, eps) = (self.hp.d_model, self.hp.rms_eps);
        let l = &self.layers[il];
        blocks::rms_norm_all(&st.x, d, Some(&l.attn_norm), eps, &mut st.cur);
        st.mark(il, "RMS_NORM", "attn_norm");
        self.attention(cx, st, il)?;
        st.mark(il, "ATTN", "attn");
        blocks::rms_norm_all(&st.out, d, Some(&l.post_attn_norm), eps, &mut st.cur);
        for (x, o) in st.x.iter_mut().zip(&st.cur) {
            *x += *o;
        }
        let m = st.ffn_rows.len();
        // The dense MLP on ffn_norm(a).
        blocks::rms_norm_rows(
            &st.x,
            d,
            &st.ffn_rows,
            Some(&l.ffn_norm[..]),
            eps,
            &mut st.cur,
        );
        self.mlp(cx, &mut st.scratch, il, &st.cur, m, &mut st.side)?;
        let Some(moe) = &l.moe else {
            let rows = &st.ffn_rows;
            self.close_layer(&mut st.x, rows, &mut st.scratch.down, il, &st.side[..m * d]);
            return Ok(());
        };
        // post_ffw_norm_1 of the MLP, kept for finish_layer.
        blocks::rms_norm_all(
            &st.side[..m * d],
            d,
            Some(&moe.post_norm_1),
            eps,
            &mut st.cur,
        );
        std::mem::swap(&mut st.side, &mut st.cur);
        // The experts' input, and the router's: rms_norm(a) / √d ⊙ scale (ggml's order).
        let rows = &st.ffn_rows;
        blocks::rms_norm_rows(&st.x, d, rows, Some(&moe.pre_norm_2[..]), eps, &mut st.h);
        blocks::rms_norm_rows(&st.x, d, rows, None, eps, &mut st.router_in);
        let inv = 1.0 / (d as f32).sqrt();
        for row in st.router_in[..m * d].chunks_exact_mut(d) {
            for (v, &s) in row.iter_mut().zip(&moe.router_scale) {
                *v = *v * inv * s;
            }
        }
        st.router_separate = true;
        Ok(())
    }

    fn expert_scale(&self, layer: usize, expert: usize) -> Option<f32> {
        let moe = self.layers.get(layer)?.moe.as_ref()?;
        moe.down_scale.as_ref().and_then(|s| s.get(expert).copied())
    }

    /// `post_ffw_norm_2` of the experts' sum plus the MLP's, then `post_ffw_norm`, the
    /// residual and the layer scale.
    fn finish_layer(&self, _cx: &Compute, st: &mut State, layer: usize) -> Result<(), ArchError> {
        let Some(moe) = &self.layers[layer].moe else {
            return Ok(());
        };
        let d = self.hp.d_model;
        let m = st.ffn_rows.len() * d;
        let eps = self.hp.rms_eps;
        blocks::rms_norm_all(
            &st.moe_out[..m],
            d,
            Some(&moe.post_norm_2),
            eps,
            &mut st.cur,
        );
        // llama.cpp adds mlp + moe.
        for (a, &b) in st.cur[..m].iter_mut().zip(&st.side[..m]) {
            *a += b;
        }
        let rows = &st.ffn_rows;
        self.close_layer(&mut st.x, rows, &mut st.scratch.down, layer, &st.cur[..m]);
        Ok(())
    }

    /// The final norm and head, then the logits' soft-cap.
    fn head(&self, cx: &Compute, st: &mut State) -> Result<(), ArchError> {
        common::head(&self.common, cx, st)?;
        if let Some(c) = self.hp.softcap {
            blocks::softcap(&mut st.logits, c);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufWriter, Value};

    /// llama.cpp's gemma-4 vocabulary GGUF carries the real Gemma-4-26B-A4B's metadata.
    fn real_file() -> Option<GgufFile> {
        let path = crate::testdata::shared_path("data/vocab/ggml-vocab-gemma-4.gguf")?;
        Some(GgufFile::open(&path).expect("open the gemma-4 vocabulary"))
    }

    #[test]
    fn the_real_26b_metadata_reads_as_llama_cpp_reads_it() {
        let Some(f) = real_file() else {
            return;
        };
        let hp = HParams::from_meta(&f, 262_144).expect("hparams");
        assert_eq!(
            (hp.n_layer, hp.d_model, hp.n_expert, hp.n_expert_used),
            (30, 2816, 128, 8)
        );
        assert_eq!((hp.n_ff_exp, hp.n_ff[0], hp.window), (704, 2112, 1024));
        assert_eq!(hp.softcap, Some(30.0));
        assert_eq!((hp.rope_base, hp.rope_base_swa), (1_000_000.0, 10_000.0));
        // Five sliding-window layers, then one global, five times.
        for (l, a) in hp.attn.iter().enumerate() {
            let global = l % 6 == 5;
            assert_eq!(a.swa, !global, "layer {l}");
            let want = if global {
                (16, 2, 512, 512)
            } else {
                (16, 8, 256, 256)
            };
            assert_eq!(
                (a.n_head, a.n_head_kv, a.head_dim, a.n_rot),
                want,
                "layer {l}"
            );
        }
    }

    #[test]
    fn parts_of_the_small_models_are_refused_by_key() {
        let Some(f) = real_file() else {
            return;
        };
        let dir = crate::testdata::scratch_dir("gemma4-keys");
        for key in [
            "attention.shared_kv_layers",
            "embedding_length_per_layer_input",
        ] {
            let mut meta: Vec<(String, Value)> = f
                .metadata()
                .iter()
                .filter(|(k, _)| !k.starts_with("tokenizer."))
                .cloned()
                .collect();
            for (k, v) in meta.iter_mut() {
                if *k == format!("gemma4.{key}") {
                    *v = Value::U32(10);
                }
            }
            let path = dir.join("meta.gguf");
            GgufWriter::write_file(&path, &meta, &[]).expect("write");
            let g = GgufFile::open(&path).expect("open");
            let err = HParams::from_meta(&g, 262_144).unwrap_err().to_string();
            assert!(
                err.contains(&format!("gemma4.{key}")) && err.contains("not supported"),
                "{err}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
