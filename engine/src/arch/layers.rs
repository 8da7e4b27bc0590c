//! The sub-layers the architecture files compose their graphs from, over the operations of
//! [`super::blocks`]: the pre-norm attention sub-layer and GQA attention over a layer's
//! memory, the split gated FFN (with per-projection biases where a family has them), the
//! residual add of the FFN rows, and the final norm and head. An architecture file is its
//! graph over these (as llama.cpp's `src/models/<arch>.cpp` are over `llm_graph_context`'s
//! builders); what only one family does stays in its file.

use super::blocks::{self, AttnShape, Compute, Glu, Rope};
use super::state::{AttnBufs, Scratch, State};
use super::weights::Mat;
use super::ArchError;
use crate::kernels::{self, ActBuf, ActFormat};

/// One layer's attention projections (`attn_q`, `attn_k`, `attn_v`, `attn_output`), with the
/// biases (qwen2moe, gpt-oss) and per-head q/k norms (qwen3moe) a family has.
pub(crate) struct AttnWeights {
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

/// The pre-norm attention sub-layer of the llama-style families (qwen3moe, qwen2moe, gpt-oss):
/// `attn_norm`, [`attention`], the residual, then `ffn_norm` of the FFN rows into `State::h`,
/// the FFN's input.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_sublayer(
    cx: &Compute,
    st: &mut State,
    layer: usize,
    (attn_norm, ffn_norm): (&[f32], &[f32]),
    w: &AttnWeights,
    shape: &AttnShape,
    rope: &Rope,
    rms_eps: f32,
    sinks: Option<&[f32]>,
    o_bias: Option<&[f32]>,
) -> Result<(), ArchError> {
    let d = w.o.rows;
    blocks::rms_norm_all(&st.x, d, Some(attn_norm), rms_eps, &mut st.cur);
    st.mark(layer, "RMS_NORM", "attn_norm");
    attention(cx, st, layer, w, shape, rope, rms_eps, sinks, o_bias)?;
    st.mark(layer, "ATTN", "attn");
    for (x, o) in st.x.iter_mut().zip(&st.out) {
        *x += *o;
    }
    blocks::rms_norm_rows(&st.x, d, &st.ffn_rows, Some(ffn_norm), rms_eps, &mut st.h);
    st.mark(layer, "RMS_NORM", "ffn_norm");
    Ok(())
}

/// GQA self-attention of `st.cur` (the normed input of every batch row) into `st.out`
/// (`n_rows × d_model`, after the output projection): projections (+ biases), per-head q/k
/// norms, rotary embedding, the layer's memory, attention, output projection.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    cx: &Compute,
    st: &mut State,
    layer: usize,
    w: &AttnWeights,
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
    st.attn.q.resize(n * qd, 0.0);
    st.attn.k.resize(n * kvd, 0.0);
    st.attn.v.resize(n * kvd, 0.0);
    cx.mats_rows(
        &mut [
            (&w.q, &mut st.attn.q),
            (&w.k, &mut st.attn.k),
            (&w.v, &mut st.attn.v),
        ],
        &st.cur,
        n,
        &mut st.scratch.acts,
    )?;
    for (buf, b) in [
        (&mut st.attn.q, &w.q_bias),
        (&mut st.attn.k, &w.k_bias),
        (&mut st.attn.v, &w.v_bias),
    ] {
        if let Some(b) = b {
            blocks::add_bias(buf, b);
        }
    }
    if let Some(qn) = &w.q_norm {
        blocks::rms_norm_heads(
            &mut st.attn.q,
            hd,
            Some(&qn[..]),
            rms_eps,
            &mut st.scratch.tmp,
        );
    }
    if let Some(kn) = &w.k_norm {
        blocks::rms_norm_heads(
            &mut st.attn.k,
            hd,
            Some(&kn[..]),
            rms_eps,
            &mut st.scratch.tmp,
        );
    }
    rope.apply_rows(&mut st.attn.q, qd, hd, &st.positions, &mut st.scratch.rope);
    rope.apply_rows(&mut st.attn.k, kvd, hd, &st.positions, &mut st.scratch.rope);
    attend_layer(cx, st, layer, shape, sinks)?;
    st.out.resize(n * d, 0.0);
    cx.mat_rows(&w.o, &st.attn.att, n, &mut st.scratch.acts, &mut st.out)?;
    if let Some(b) = o_bias {
        blocks::add_bias(&mut st.out, b);
    }
    Ok(())
}

/// Attention of `st.attn.q` over layer `layer`'s memory and the batch's `st.attn.k` /
/// `st.attn.v` into `st.attn.att`; the memory keeps what it must afterwards.
pub(crate) fn attend_layer(
    cx: &Compute,
    st: &mut State,
    layer: usize,
    shape: &AttnShape,
    sinks: Option<&[f32]>,
) -> Result<(), ArchError> {
    let n = st.n_rows;
    st.attn.att.resize(n * shape.n_head * shape.head_dim, 0.0);
    let State {
        mem,
        attn:
            AttnBufs {
                q,
                k,
                v,
                att,
                scores,
            },
        positions,
        seqs,
        groups,
        ..
    } = st;
    if groups.is_empty() {
        let memory = mem[layer].kv(layer)?;
        let kv = memory.source(layer, positions, k, v)?;
        blocks::attend(&cx.pool, shape, q, positions, &kv, sinks, scores, att);
        memory.commit(positions, k, v);
        return Ok(());
    }
    // Rows of several sequences (`serve --parallel`): each run of rows attends over its own
    // sequence's memory. A row's bits do not depend on the rows beside it.
    let (qd, kvd) = (
        shape.n_head * shape.head_dim,
        shape.n_head_kv * shape.head_dim,
    );
    for &(seq, first, rows) in groups.iter() {
        let memory = match seq {
            0 => &mut mem[layer],
            s => seqs
                .get_mut(s - 1)
                .and_then(|m| m.get_mut(layer))
                .ok_or_else(|| ArchError::Key {
                    file: String::new(),
                    key: "sequence".into(),
                    what: format!("{seq} is not held"),
                })?,
        }
        .kv(layer)?;
        let (r, end) = (first, first + rows);
        let pos = &positions[r..end];
        let (gk, gv) = (&k[r * kvd..end * kvd], &v[r * kvd..end * kvd]);
        let src = memory.source(layer, pos, gk, gv)?;
        blocks::attend(
            &cx.pool,
            shape,
            &q[r * qd..end * qd],
            pos,
            &src,
            sinks,
            scores,
            &mut att[r * qd..end * qd],
        );
        memory.commit(pos, gk, gv);
    }
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
/// `pre` may hold the same `n` rows already quantised (see [`super::ExpertIn::prepared`]); gate and
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

/// Final RMS norm and output head of the `out_rows` into `st.logits` (every family's head but
/// gemma4's soft-capped one, which adds its cap after this).
pub(crate) fn norm_head(
    cx: &Compute,
    st: &mut State,
    norm: &[f32],
    output: &Mat,
    eps: f32,
) -> Result<(), ArchError> {
    let d = norm.len();
    blocks::rms_norm_rows(&st.x, d, &st.out_rows, Some(norm), eps, &mut st.cur);
    let m = st.out_rows.len();
    st.logits.resize(m * output.rows, 0.0);
    cx.mat_rows(output, &st.cur, m, &mut st.scratch.acts, &mut st.logits)
}

/// A SiLU-gated FFN of dense matrices: `down(silu(gate·x) ⊙ up·x)` — a leading dense layer's
/// (lfm2moe, deepseek2) or a layer's shared expert(s); `glu` is SiLU but where a family limits
/// it ([`Glu::SiluClamped`], bailingmoe3).
pub struct GluFfn {
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
    pub glu: Glu,
}

impl GluFfn {
    /// Layer `layer`'s `ffn_gate{suffix}`, `ffn_up{suffix}`, `ffn_down{suffix}` of width `ff`
    /// over `d` (suffix "" for a dense layer's FFN, "_shexp" for a shared expert).
    pub fn load(
        ld: &mut super::weights::Loader,
        layer: usize,
        suffix: &str,
        d: usize,
        ff: usize,
    ) -> Result<GluFfn, ArchError> {
        let n = |s: &str| format!("blk.{layer}.{s}{suffix}.weight");
        Ok(GluFfn {
            gate: ld.mat(&n("ffn_gate"), d, ff)?,
            up: ld.mat(&n("ffn_up"), d, ff)?,
            down: ld.mat(&n("ffn_down"), ff, d)?,
            glu: Glu::Silu,
        })
    }

    /// The FFN of the first `m` rows of `input` into `out` (`m × d`).
    pub fn run(
        &self,
        cx: &Compute,
        s: &mut Scratch,
        input: &[f32],
        m: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), ArchError> {
        let (ff, d) = (self.gate.rows, self.gate.cols);
        split_ffn(
            cx,
            s,
            self.glu,
            (self.gate.ty, self.gate.bytes()),
            (self.up.ty, self.up.bytes()),
            (self.down.ty, self.down.bytes()),
            ff,
            d,
            input,
            m,
            &[],
            out,
        )
    }

    /// A leading dense layer's FFN: `norm` (RMS) of the FFN rows of the residual, this FFN,
    /// added back into those rows.
    pub fn into_residual(
        &self,
        cx: &Compute,
        st: &mut State,
        norm: &[f32],
        eps: f32,
    ) -> Result<(), ArchError> {
        let (d, m) = (self.gate.cols, st.ffn_rows.len());
        blocks::rms_norm_rows(&st.x, d, &st.ffn_rows, Some(norm), eps, &mut st.cur);
        let State {
            cur, side, scratch, ..
        } = st;
        self.run(cx, scratch, cur, m, side)?;
        add_rows(&mut st.x, d, &st.ffn_rows, &st.side[..m * d]);
        Ok(())
    }
}

/// A layer's shared expert and its gate (one weight per input dimension): qwen2moe's and
/// qwen35moe's, run on every FFN row beside the routed experts.
pub struct SharedExpert {
    pub gate_inp: Vec<f32>,
    pub ffn: GluFfn,
}

impl SharedExpert {
    /// The SiLU-gated FFN of `st.h`'s FFN rows into `st.side`, each row scaled by
    /// `gate(gate_inp · row)` (the family's sigmoid: its bits are the family's).
    pub fn run(
        &self,
        cx: &Compute,
        st: &mut State,
        d: usize,
        gate: fn(f32) -> f32,
    ) -> Result<(), ArchError> {
        let m = st.ffn_rows.len();
        let State {
            h, side, scratch, ..
        } = st;
        self.ffn.run(cx, scratch, h, m, side)?;
        for (row, out) in h.chunks_exact(d).zip(side.chunks_exact_mut(d)).take(m) {
            let logit: f32 = row.iter().zip(&self.gate_inp).map(|(a, b)| a * b).sum();
            let g = gate(logit);
            out.iter_mut().for_each(|v| *v *= g);
        }
        Ok(())
    }
}

/// After a layer's mixer wrote `st.out`: the residual; then a leading dense layer's FFN
/// (`ffn` behind `ffn_norm`) into the residual, or a MoE layer's FFN norm of its FFN rows (the
/// routed experts' input, `st.h`) and its shared experts `ffn` beside them into `st.side`,
/// which [`finish_with_shared`] adds (deepseek2, bailingmoe3).
#[allow(clippy::too_many_arguments)]
pub(crate) fn residual_then_ffn(
    cx: &Compute,
    st: &mut State,
    il: usize,
    dense: bool,
    ffn: &GluFfn,
    ffn_norm: &[f32],
    d: usize,
    eps: f32,
) -> Result<(), ArchError> {
    for (x, o) in st.x.iter_mut().zip(&st.out) {
        *x += *o;
    }
    if dense {
        return ffn.into_residual(cx, st, ffn_norm, eps);
    }
    blocks::rms_norm_rows(&st.x, d, &st.ffn_rows, Some(ffn_norm), eps, &mut st.h);
    st.mark(il, "RMS_NORM", "ffn_norm");
    let m = st.ffn_rows.len();
    let State {
        h, side, scratch, ..
    } = st;
    ffn.run(cx, scratch, h, m, side)
}

/// The experts' sum plus the shared expert's output (`st.side`), then the residual
/// (llama.cpp's order).
pub fn finish_with_shared(st: &mut State, d: usize) {
    let m = st.ffn_rows.len() * d;
    for (a, &b) in st.moe_out[..m].iter_mut().zip(&st.side[..m]) {
        *a += b;
    }
    add_rows(&mut st.x, d, &st.ffn_rows, &st.moe_out);
}
