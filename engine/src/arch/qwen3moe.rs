//! `qwen3moe` (Qwen3-30B-A3B, Qwen3-235B-A22B), after llama.cpp's `src/models/qwen3moe.cpp`.
//!
//! Layer: `attn_norm` (RMS) → GQA attention with per-head q/k RMS norms and NeoX rotary
//! embedding, scores scaled by 1/√head_dim → residual → `ffn_norm` (RMS) → router
//! (`ffn_gate_inp`, softmax over every expert, top-k, renormalised) → SiLU-gated experts over
//! the stacked `ffn_{gate,up,down}_exps` → weighted sum in rank order → residual. Then
//! `output_norm` and the head (`output`, or `token_embd` when the file ties them). No shared
//! expert; every layer is a MoE layer.

use super::blocks::{self, AttnShape, Compute, Glu, Rope, RopeKind};
use super::meta::Meta;
use super::state::{LayerMemory, MemoryKind, Scratch, State};
use super::weights::{ExpertTensor, Loader, Mat, Weights};
use super::{Arch, ArchError, Dims, ExpertIn, MoeLayer};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use crate::kernels::{self, ActBuf, ActFormat};
use bmoe_core::Gating;
use std::sync::Arc;

pub const ARCH: &str = "qwen3moe";

/// Hyper-parameters, read and checked once at load.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    pub n_layer: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub d_model: usize,
    pub n_ff_exp: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ctx_train: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub n_vocab: usize,
}

/// The attention hyper-parameters every qwen-family file states the same way: head counts,
/// head dim (`key_length`, defaulting to d/heads; `value_length` must agree), rotary base and
/// dimension (the whole head: partial rotary is refused), RMS epsilon.
pub(crate) struct AttnParams {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
}

pub(crate) fn attn_params(m: &Meta, d_model: usize) -> Result<AttnParams, ArchError> {
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
    let v_dim = m.opt_u("attention.value_length")?.unwrap_or(head_dim);
    if v_dim != head_dim {
        return Err(m.err(
            "attention.value_length",
            format!("{v_dim} differs from key_length {head_dim}; unsupported"),
        ));
    }
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(m.err(
            "attention.key_length",
            format!("{head_dim} must be even and positive for rotary embedding"),
        ));
    }
    if let Some(rd) = m.opt_u("rope.dimension_count")? {
        if rd != head_dim {
            return Err(m.err(
                "rope.dimension_count",
                format!(
                    "{rd} differs from the head dim {head_dim}; partial rotary is not supported"
                ),
            ));
        }
    }
    Ok(AttnParams {
        n_head,
        n_head_kv,
        head_dim,
        rope_base: m.opt_f("rope.freq_base", 10_000.0)?,
        rms_eps: m.req_f("attention.layer_norm_rms_epsilon")?,
    })
}

/// The MoE counts: `expert_count` (a MoE model has at least one), `expert_used_count` in
/// `1..=expert_count`, the expert FFN width (`expert_feed_forward_length`, or
/// `feed_forward_length / expert_used_count` as older files state it).
pub(crate) fn moe_params(m: &Meta) -> Result<(usize, usize, usize), ArchError> {
    let n_expert = m.req_u("expert_count")?;
    let n_expert_used = m.req_u("expert_used_count")?;
    if n_expert == 0 {
        return Err(ArchError::NotMoe {
            file: m.f.path().display().to_string(),
            arch: m.arch.into(),
        });
    }
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(m.err(
            "expert_used_count",
            format!("{n_expert_used}, expected 1..={n_expert}"),
        ));
    }
    let n_ff_exp = match m.opt_u("expert_feed_forward_length")? {
        Some(n) => n,
        None => m.req_u("feed_forward_length")? / n_expert_used,
    };
    if n_ff_exp == 0 {
        return Err(m.err("expert_feed_forward_length", "is 0"));
    }
    Ok((n_expert, n_expert_used, n_ff_exp))
}

/// The vocabulary size, from `token_embd.weight`'s second dimension.
pub(crate) fn n_vocab(f: &GgufFile) -> Result<usize, ArchError> {
    let embd = f
        .tensor("token_embd.weight")
        .ok_or_else(|| ArchError::Tensor {
            file: f.path().display().to_string(),
            tensor: "token_embd.weight".into(),
            what: "is missing".into(),
        })?;
    Ok(embd.dims.get(1).copied().unwrap_or(0) as usize)
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<HParams, ArchError> {
        let m = Meta::new(f, ARCH);
        let n_layer = m.req_u("block_count")?;
        let d_model = m.req_u("embedding_length")?;
        if n_layer == 0 {
            return Err(m.err("block_count", "must be positive"));
        }
        let a = attn_params(&m, d_model)?;
        let (n_expert, n_expert_used, n_ff_exp) = moe_params(&m)?;
        Ok(HParams {
            n_layer,
            n_expert,
            n_expert_used,
            d_model,
            n_ff_exp,
            n_head: a.n_head,
            n_head_kv: a.n_head_kv,
            head_dim: a.head_dim,
            n_ctx_train: m.req_u("context_length")?,
            rope_base: a.rope_base,
            rms_eps: a.rms_eps,
            n_vocab: n_vocab(f)?,
        })
    }
}

/// One layer's attention weights as the qwen family names them.
pub(crate) struct QwenAttn {
    pub q: Mat,
    pub k: Mat,
    pub v: Mat,
    pub o: Mat,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

/// GQA self-attention of `st.cur` (the normed input of every batch row) into `st.out`
/// (`n_rows × d_model`, after the output projection): projections (+ biases), per-head q/k
/// norms, rotary embedding, the layer's memory, attention, output projection.
/// The pre-norm attention sublayer of the llama-style families (qwen3moe, qwen2moe, gpt-oss):
/// `attn_norm`, [`qwen_attention`], the residual, then `ffn_norm` of the FFN rows into
/// `State::h`, the FFN's input.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_sublayer(
    cx: &Compute,
    st: &mut State,
    layer: usize,
    (attn_norm, ffn_norm): (&[f32], &[f32]),
    w: &QwenAttn,
    shape: &AttnShape,
    rope: &Rope,
    rms_eps: f32,
    sinks: Option<&[f32]>,
    o_bias: Option<&[f32]>,
) -> Result<(), ArchError> {
    let d = w.o.rows;
    blocks::rms_norm_all(&st.x, d, Some(attn_norm), rms_eps, &mut st.cur);
    qwen_attention(cx, st, layer, w, shape, rope, rms_eps, sinks, o_bias)?;
    for (x, o) in st.x.iter_mut().zip(&st.out) {
        *x += *o;
    }
    let rows = std::mem::take(&mut st.ffn_rows);
    blocks::rms_norm_rows(&st.x, d, &rows, Some(ffn_norm), rms_eps, &mut st.h);
    st.ffn_rows = rows;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn qwen_attention(
    cx: &Compute,
    st: &mut State,
    layer: usize,
    w: &QwenAttn,
    shape: &AttnShape,
    rope: &Rope,
    rms_eps: f32,
    sinks: Option<&[f32]>,
    o_bias: Option<&[f32]>,
) -> Result<(), ArchError> {
    let n = st.n_rows;
    let hd = shape.head_dim;
    let (qd, kvd) = (shape.n_head * hd, shape.n_head_kv * hd);
    let d = w.o.rows;
    st.q.resize(n * qd, 0.0);
    st.k.resize(n * kvd, 0.0);
    st.v.resize(n * kvd, 0.0);
    let mut acts = std::mem::take(&mut st.scratch.acts);
    let r = cx.mats_rows(
        &mut [(&w.q, &mut st.q), (&w.k, &mut st.k), (&w.v, &mut st.v)],
        &st.cur,
        n,
        &mut acts,
    );
    st.scratch.acts = acts;
    r?;
    for (buf, b) in [
        (&mut st.q, &w.q_bias),
        (&mut st.k, &w.k_bias),
        (&mut st.v, &w.v_bias),
    ] {
        if let Some(b) = b {
            blocks::add_bias(buf, b);
        }
    }
    if let Some(qn) = &w.q_norm {
        blocks::rms_norm_heads(&mut st.q, hd, Some(&qn[..]), rms_eps, &mut st.scratch.tmp);
    }
    if let Some(kn) = &w.k_norm {
        blocks::rms_norm_heads(&mut st.k, hd, Some(&kn[..]), rms_eps, &mut st.scratch.tmp);
    }
    rope.apply_rows(&mut st.q, qd, hd, &st.positions, &mut st.scratch.rope);
    rope.apply_rows(&mut st.k, kvd, hd, &st.positions, &mut st.scratch.rope);
    attend_layer(cx, st, layer, shape, sinks)?;
    st.out.resize(n * d, 0.0);
    let mut acts = std::mem::take(&mut st.scratch.acts);
    let r = cx.mat_rows(&w.o, &st.att, n, &mut acts, &mut st.out);
    st.scratch.acts = acts;
    r?;
    if let Some(b) = o_bias {
        blocks::add_bias(&mut st.out, b);
    }
    Ok(())
}

/// Attention of `st.q` over layer `layer`'s memory and the batch's `st.k` / `st.v` into
/// `st.att`; the memory keeps what it must afterwards.
pub(crate) fn attend_layer(
    cx: &Compute,
    st: &mut State,
    layer: usize,
    shape: &AttnShape,
    sinks: Option<&[f32]>,
) -> Result<(), ArchError> {
    let n = st.n_rows;
    st.att.resize(n * shape.n_head * shape.head_dim, 0.0);
    let State {
        mem,
        q,
        k,
        v,
        att,
        scores,
        positions,
        ..
    } = st;
    let kv = mem[layer].source(layer, positions, k, v)?;
    blocks::attend(&cx.pool, shape, q, positions, &kv, sinks, scores, att);
    mem[layer].commit(positions, k, v);
    Ok(())
}

/// Add `src` (rows of `st.ffn_rows`, consecutive) into those rows of the residual `x`.
pub(crate) fn add_rows(x: &mut [f32], d: usize, rows: &[u32], src: &[f32]) {
    for (i, &r) in rows.iter().enumerate() {
        let r = r as usize;
        for (a, &b) in x[r * d..(r + 1) * d]
            .iter_mut()
            .zip(&src[i * d..(i + 1) * d])
        {
            *a += b;
        }
    }
}

/// The gated FFN of split `gate`/`up`/`down` matrices (given as bytes and types: an expert's
/// slice or a dense matrix) on `n` rows of `input`: `down(glu(gate·x, up·x))` into `out`.
/// `pre` may hold the same `n` rows already quantised (see [`ExpertIn::prepared`]); gate and
/// up use them when their activation format is the one prepared, and quantise `input`
/// themselves otherwise (the bits are the same either way).
#[allow(clippy::too_many_arguments)]
pub(crate) fn split_ffn(
    cx: &Compute,
    s: &mut Scratch,
    glu: Glu,
    g: (crate::gguf::GgmlType, &[u8]),
    u: (crate::gguf::GgmlType, &[u8]),
    dn: (crate::gguf::GgmlType, &[u8]),
    ff: usize,
    d: usize,
    input: &[f32],
    n: usize,
    pre: &[&ActBuf],
    out: &mut Vec<f32>,
) -> Result<(), ArchError> {
    split_ffn_biased(cx, s, glu, g, u, dn, None, ff, d, input, n, pre, out)
}

/// One expert's biases (gpt-oss): added to the gate and up products before the activation
/// and to the down product after it.
#[derive(Copy, Clone)]
pub struct FfnBias<'a> {
    pub gate: &'a [f32],
    pub up: &'a [f32],
    pub down: &'a [f32],
}

/// [`split_ffn`] with per-projection biases: `down(glu(gate·x + bg, up·x + bu)) + bd`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn split_ffn_biased(
    cx: &Compute,
    s: &mut Scratch,
    glu: Glu,
    (gt, g): (crate::gguf::GgmlType, &[u8]),
    (ut, u): (crate::gguf::GgmlType, &[u8]),
    (dt, dn): (crate::gguf::GgmlType, &[u8]),
    bias: Option<FfnBias<'_>>,
    ff: usize,
    d: usize,
    input: &[f32],
    n: usize,
    pre: &[&ActBuf],
    out: &mut Vec<f32>,
) -> Result<(), ArchError> {
    s.gate.resize(n * ff, 0.0);
    s.up.resize(n * ff, 0.0);
    out.resize(n * d, 0.0);
    let usable = |ty| {
        let f = ActFormat::for_weights(ty);
        pre.len() == n && f.is_some() && pre.iter().all(|a| a.format() == f && a.n_cols() == d)
    };
    let (g_pre, u_pre) = (usable(gt), usable(ut));
    if g_pre && u_pre {
        gate_up(cx, pre, (gt, g), (ut, u), ff, d, &mut s.gate, &mut s.up)?;
    } else if !g_pre && !u_pre && ActFormat::for_weights(ut) == ActFormat::for_weights(gt) {
        blocks::prepare_acts(&cx.pool, gt, input, n, d, &mut s.acts)?;
        gate_up(
            cx,
            &s.acts[..n],
            (gt, g),
            (ut, u),
            ff,
            d,
            &mut s.gate,
            &mut s.up,
        )?;
    } else {
        // A mixed file: gate and up quantise for different activation formats.
        for (pre_ok, ty, w, o) in [(g_pre, gt, g, &mut s.gate), (u_pre, ut, u, &mut s.up)] {
            if pre_ok {
                blocks::mul_prepared(&cx.pool, ty, w, ff, d, pre, o)?;
            } else {
                blocks::prepare_acts(&cx.pool, ty, input, n, d, &mut s.acts)?;
                blocks::mul_prepared(&cx.pool, ty, w, ff, d, &s.acts[..n], o)?;
            }
        }
    }
    if let Some(b) = bias {
        blocks::add_bias(&mut s.gate[..n * ff], b.gate);
        blocks::add_bias(&mut s.up[..n * ff], b.up);
    }
    glu.apply(&mut s.gate, &s.up);
    blocks::prepare_acts(&cx.pool, dt, &s.gate, n, ff, &mut s.act2)?;
    blocks::mul_prepared(&cx.pool, dt, dn, d, ff, &s.act2[..n], out)?;
    if let Some(b) = bias {
        blocks::add_bias(&mut out[..n * d], b.down);
    }
    Ok(())
}

/// gate and up (both `ff × d`) on the same prepared rows, in one round of the pool.
#[allow(clippy::too_many_arguments)]
fn gate_up<A: std::borrow::Borrow<ActBuf> + Sync>(
    cx: &Compute,
    acts: &[A],
    (gt, g): (crate::gguf::GgmlType, &[u8]),
    (ut, u): (crate::gguf::GgmlType, &[u8]),
    ff: usize,
    d: usize,
    gate: &mut [f32],
    up: &mut [f32],
) -> Result<(), ArchError> {
    let n = acts.len();
    let product = |ty, w, out| kernels::Product {
        ty,
        w,
        n_rows: ff,
        n_cols: d,
        acts,
        out,
    };
    kernels::matmul_round(
        &cx.pool,
        &mut [
            product(gt, g, &mut gate[..n * ff]),
            product(ut, u, &mut up[..n * ff]),
        ],
    )
    .map_err(blocks::kerr)
}

pub struct LayerWeights {
    attn_norm: Vec<f32>,
    attn: QwenAttn,
    ffn_norm: Vec<f32>,
    router: Mat,
    /// gate, up, down
    exps: [ExpertTensor; 3],
}

/// A loaded qwen3moe model.
pub struct Qwen3Moe {
    pub hp: HParams,
    dims: Dims,
    embd: Mat,
    output: Mat,
    output_norm: Vec<f32>,
    layers: Vec<LayerWeights>,
    rope: Rope,
    shape: AttnShape,
    weights: Weights,
}

/// Load `file` as qwen3moe (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(Qwen3Moe::load(file, mode)?))
}

impl Qwen3Moe {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Qwen3Moe, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let d = hp.d_model;
        let qd = hp.n_head * hp.head_dim;
        let kvd = hp.n_head_kv * hp.head_dim;
        let embd = ld.mat("token_embd.weight", d, hp.n_vocab)?;
        let output = ld.mat_opt("output.weight", d, hp.n_vocab)?.unwrap_or(embd);
        let output_norm = ld.vector("output_norm.weight", d)?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(LayerWeights {
                attn_norm: ld.vector(&n("attn_norm"), d)?,
                attn: QwenAttn {
                    q: ld.mat(&n("attn_q"), d, qd)?,
                    k: ld.mat(&n("attn_k"), d, kvd)?,
                    v: ld.mat(&n("attn_v"), d, kvd)?,
                    o: ld.mat(&n("attn_output"), qd, d)?,
                    q_bias: None,
                    k_bias: None,
                    v_bias: None,
                    q_norm: Some(ld.vector(&n("attn_q_norm"), hp.head_dim)?),
                    k_norm: Some(ld.vector(&n("attn_k_norm"), hp.head_dim)?),
                },
                ffn_norm: ld.vector(&n("ffn_norm"), d)?,
                router: ld.mat(&n("ffn_gate_inp"), d, hp.n_expert)?,
                exps: [
                    ld.experts(&n("ffn_gate_exps"), d, hp.n_ff_exp, hp.n_expert)?,
                    ld.experts(&n("ffn_up_exps"), d, hp.n_ff_exp, hp.n_expert)?,
                    ld.experts(&n("ffn_down_exps"), hp.n_ff_exp, d, hp.n_expert)?,
                ],
            });
        }
        Ok(Qwen3Moe {
            dims: Dims {
                n_layer: hp.n_layer,
                n_expert: hp.n_expert,
                n_expert_used: hp.n_expert_used,
                d_model: d,
                n_vocab: hp.n_vocab,
                n_ctx_train: hp.n_ctx_train,
            },
            rope: Rope::plain(RopeKind::Neox, hp.head_dim, hp.rope_base),
            shape: AttnShape {
                n_head: hp.n_head,
                n_head_kv: hp.n_head_kv,
                head_dim: hp.head_dim,
                scale: 1.0 / (hp.head_dim as f32).sqrt(),
                window: None,
                softcap: None,
            },
            hp,
            embd,
            output,
            output_norm,
            layers,
            weights: ld.finish(),
        })
    }
}

/// Final norm and output head of the `out_rows` (the qwen family's head).
pub(crate) fn norm_head(
    cx: &Compute,
    st: &mut State,
    norm: &[f32],
    output: &Mat,
    eps: f32,
) -> Result<(), ArchError> {
    let d = norm.len();
    let rows = std::mem::take(&mut st.out_rows);
    blocks::rms_norm_rows(&st.x, d, &rows, Some(norm), eps, &mut st.cur);
    st.out_rows = rows;
    let m = st.out_rows.len();
    st.logits.resize(m * output.rows, 0.0);
    let mut acts = std::mem::take(&mut st.scratch.acts);
    let r = cx.mat_rows(output, &st.cur, m, &mut acts, &mut st.logits);
    st.scratch.acts = acts;
    r
}

impl Arch for Qwen3Moe {
    fn name(&self) -> &'static str {
        ARCH
    }
    fn dims(&self) -> &Dims {
        &self.dims
    }
    fn gating(&self) -> Gating {
        Gating::SOFTMAX_RENORM
    }
    fn weights(&self) -> &Weights {
        &self.weights
    }
    fn moe_layers(&self) -> Vec<MoeLayer<'_>> {
        self.layers
            .iter()
            .enumerate()
            .map(|(layer, l)| MoeLayer {
                layer,
                projections: &l.exps,
            })
            .collect()
    }
    fn memory(&self, _layer: usize) -> LayerMemory {
        LayerMemory {
            kind: MemoryKind::Full,
            n_head_kv: self.hp.n_head_kv,
            head_dim: self.hp.head_dim,
        }
    }
    fn token_embd(&self) -> &Mat {
        &self.embd
    }

    fn dense(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let l = &self.layers[il];
        attention_sublayer(
            cx,
            st,
            il,
            (&l.attn_norm[..], &l.ffn_norm[..]),
            &l.attn,
            &self.shape,
            &self.rope,
            self.hp.rms_eps,
            None,
            None,
        )
    }

    fn router_logits(
        &self,
        cx: &Compute,
        layer: usize,
        input: &[f32],
        rows: usize,
        acts: &mut Vec<ActBuf>,
        out: &mut [f32],
    ) -> Result<(), ArchError> {
        cx.mat_rows(&self.layers[layer].router, input, rows, acts, out)
    }

    fn expert(
        &self,
        cx: &Compute,
        s: &mut Scratch,
        layer: usize,
        _expert: usize,
        proj: &[&[u8]],
        input: &ExpertIn<'_>,
        out: &mut Vec<f32>,
    ) -> Result<(), ArchError> {
        let [g, u, dn] = &self.layers[layer].exps;
        split_ffn(
            cx,
            s,
            Glu::Silu,
            (g.info.ty, proj[0]),
            (u.info.ty, proj[1]),
            (dn.info.ty, proj[2]),
            self.hp.n_ff_exp,
            self.hp.d_model,
            input.rows,
            input.n,
            input.prepared,
            out,
        )
    }

    fn split_glu(&self, _layer: usize) -> Option<Glu> {
        Some(Glu::Silu)
    }

    fn finish_layer(&self, _cx: &Compute, st: &mut State, _layer: usize) -> Result<(), ArchError> {
        add_rows(&mut st.x, self.hp.d_model, &st.ffn_rows, &st.moe_out);
        Ok(())
    }

    fn head(&self, cx: &Compute, st: &mut State) -> Result<(), ArchError> {
        norm_head(cx, st, &self.output_norm, &self.output, self.hp.rms_eps)
    }
}
