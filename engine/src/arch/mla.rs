//! Multi-head latent attention (DeepSeek-V2's MLA) in the **absorbed** form llama.cpp runs
//! for files that split `attn_kv_b` into `attn_k_b` and `attn_v_b`: deepseek2's attention and
//! bailingmoe3's MLA layers (which add a per-head output gate).
//!
//! Per row: `q = wq · x`, or `wq_b · rms(wq_a · x, attn_q_a_norm)` where the file has a query
//! LoRA; per head `q = [q_nope | q_pe]` (`key_length_mla − rope` and `rope.dimension_count`
//! values). `wkv_a_mqa · x` gives the latent `c` (`kv_lora_rank` values, then
//! `rms(c, attn_kv_a_norm)`) and one shared `k_pe`. `q_pe` and `k_pe` take the family's rotary
//! embedding. Absorbed: per head `q_abs = wk_b[h] · q_nope`; the query `[q_abs | q_pe]` attends
//! to one key per position `[c | k_pe]` shared by every head (MQA), whose value is `c`; a
//! head's output goes through `wv_b[h]` to `value_length_mla` values (× `σ(attn_gate · x)[h]`
//! where the layer has a gate), then `attn_output`. The memory is the row `[c | k_pe]` per
//! position ([`super::state::LayerMemory::Latent`]).

use super::blocks::{self, AttnShape, Compute, Rope};
use super::state::State;
use super::weights::{Loader, Mat};
use super::ArchError;
use crate::kernels;

/// The widths of a family's latent attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaDims {
    pub d_model: usize,
    pub n_head: usize,
    /// The query LoRA's rank (0: one `attn_q`).
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    /// A head's q·k width (`key_length_mla`: non-rotary then rotary) and value width.
    pub k_mla: usize,
    pub v_mla: usize,
    /// Rotated dimensions (`rope.dimension_count`).
    pub n_rot: usize,
    pub rms_eps: f32,
}

impl MlaDims {
    /// A head's non-rotary q·k part.
    pub fn nope(&self) -> usize {
        self.k_mla - self.n_rot
    }

    /// The latent memory's row: the latent and the roped key part.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.n_rot
    }
}

/// The query projection: one matrix, or a LoRA with a norm between its halves.
pub enum QProj {
    Full(Mat),
    Lora { a: Mat, norm: Vec<f32>, b: Mat },
}

/// One layer's latent attention weights.
pub struct Mla {
    pub q: QProj,
    pub kv_a: Mat,
    pub kv_a_norm: Vec<f32>,
    /// `n_head` stacked `kv_lora_rank × nope` matrices.
    pub k_b: Mat,
    /// `n_head` stacked `v_mla × kv_lora_rank` matrices.
    pub v_b: Mat,
    pub o: Mat,
    /// `attn_gate` (`d_model → n_head`): bailingmoe3's per-head output gate.
    pub gate: Option<Mat>,
}

impl Mla {
    /// Layer `il`'s tensors (`attn_gate` too where `gated`).
    pub fn load(ld: &mut Loader, il: usize, hp: &MlaDims, gated: bool) -> Result<Mla, ArchError> {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let (d, nh, r) = (hp.d_model, hp.n_head, hp.kv_lora_rank);
        let q = if hp.q_lora_rank > 0 {
            QProj::Lora {
                a: ld.mat(&n("attn_q_a"), d, hp.q_lora_rank)?,
                norm: ld.vector(&n("attn_q_a_norm"), hp.q_lora_rank)?,
                b: ld.mat(&n("attn_q_b"), hp.q_lora_rank, nh * hp.k_mla)?,
            }
        } else {
            QProj::Full(ld.mat(&n("attn_q"), d, nh * hp.k_mla)?)
        };
        Ok(Mla {
            q,
            kv_a: ld.mat(&n("attn_kv_a_mqa"), d, hp.latent_width())?,
            kv_a_norm: ld.vector(&n("attn_kv_a_norm"), r)?,
            k_b: ld.mat_stacked(&n("attn_k_b"), hp.nope(), r, nh)?,
            v_b: ld.mat_stacked(&n("attn_v_b"), r, hp.v_mla, nh)?,
            o: ld.mat(&n("attn_output"), nh * hp.v_mla, d)?,
            gate: if gated {
                Some(ld.mat(&n("attn_gate"), d, nh)?)
            } else {
                None
            },
        })
    }

    /// Multi-head latent attention of `st.cur` (every batch row, normed) into `st.out`
    /// (`n × d_model`, after `attn_output`), the latent rows kept in layer `il`'s memory;
    /// `shape` is the MQA over the latent rows (one head per query head, the latent row
    /// wide, the family's score scale).
    pub fn run(
        &self,
        cx: &Compute,
        st: &mut State,
        il: usize,
        hp: &MlaDims,
        rope: &Rope,
        shape: &AttnShape,
    ) -> Result<(), ArchError> {
        let w = self;
        let n = st.n_rows;
        let (nh, r, rot, nope) = (hp.n_head, hp.kv_lora_rank, hp.n_rot, hp.nope());
        let (kq, lw) = (hp.k_mla, hp.latent_width());
        // q (n × nh·k_mla) and the latent with its key part (n × lw).
        let q = &mut st.scratch.down;
        q.resize(n * nh * kq, 0.0);
        st.attn.k.resize(n * lw, 0.0);
        match &w.q {
            QProj::Full(wq) => cx.mats_rows(
                &mut [(wq, &mut q[..]), (&w.kv_a, &mut st.attn.k[..])],
                &st.cur,
                n,
                &mut st.scratch.acts,
            )?,
            QProj::Lora { a, norm, b } => {
                let qa = &mut st.scratch.tmp;
                qa.resize(n * hp.q_lora_rank, 0.0);
                cx.mats_rows(
                    &mut [(a, &mut qa[..]), (&w.kv_a, &mut st.attn.k[..])],
                    &st.cur,
                    n,
                    &mut st.scratch.acts,
                )?;
                blocks::rms_norm_heads(qa, hp.q_lora_rank, Some(norm), hp.rms_eps, &mut st.attn.v);
                cx.mat_rows(b, qa, n, &mut st.scratch.acts, q)?;
            }
        }
        // The key row [rms(c) | rope(k_pe)]; q_pe roped; q_nope gathered head-major.
        let nope_in = &mut st.scratch.gate;
        nope_in.resize(nh * n * nope, 0.0);
        for t in 0..n {
            rope.cache(st.positions[t], &mut st.scratch.rope);
            let cache = &st.scratch.rope;
            let krow = &mut st.attn.k[t * lw..(t + 1) * lw];
            blocks::rms_norm_heads(
                &mut krow[..r],
                r,
                Some(&w.kv_a_norm),
                hp.rms_eps,
                &mut st.attn.v,
            );
            rope.apply(cache, &mut krow[r..]);
            for h in 0..nh {
                let head = &mut q[(t * nh + h) * kq..(t * nh + h + 1) * kq];
                rope.apply(cache, &mut head[nope..]);
                nope_in[(h * n + t) * nope..(h * n + t + 1) * nope].copy_from_slice(&head[..nope]);
            }
        }
        // q_abs = wk_b[h] · q_nope of every head, in one round of the pool.
        let absorbed = &mut st.scratch.up;
        absorbed.resize(nh * n * r, 0.0);
        per_head(
            cx,
            &w.k_b,
            nh,
            r,
            nope,
            nope_in,
            n,
            &mut st.scratch.acts,
            absorbed,
        )?;
        // The query rows [q_abs | q_pe] per head.
        st.attn.q.resize(n * nh * lw, 0.0);
        for t in 0..n {
            for h in 0..nh {
                let dst = &mut st.attn.q[(t * nh + h) * lw..(t * nh + h + 1) * lw];
                dst[..r].copy_from_slice(&absorbed[(h * n + t) * r..(h * n + t + 1) * r]);
                dst[r..].copy_from_slice(&q[(t * nh + h) * kq + nope..(t * nh + h + 1) * kq]);
            }
        }
        debug_assert_eq!(rot, lw - r);
        // MQA over the latent rows (a value is the row; its first r outputs are the head's).
        st.attn.att.resize(n * nh * lw, 0.0);
        {
            let State {
                mem,
                attn,
                positions,
                ..
            } = &mut *st;
            let memory = mem[il].kv(il)?;
            let kv = memory.source(il, positions, &attn.k, &attn.k)?;
            blocks::attend(
                &cx.pool,
                shape,
                &attn.q,
                positions,
                &kv,
                None,
                &mut attn.scores,
                &mut attn.att,
            );
        }
        // Each head's latent output through wv_b[h], then attn_output.
        let lat = &mut st.scratch.gate;
        lat.resize(nh * n * r, 0.0);
        for t in 0..n {
            for h in 0..nh {
                let src = &st.attn.att[(t * nh + h) * lw..(t * nh + h) * lw + r];
                lat[(h * n + t) * r..(h * n + t + 1) * r].copy_from_slice(src);
            }
        }
        let vo = &mut st.scratch.up;
        vo.resize(nh * n * hp.v_mla, 0.0);
        per_head(
            cx,
            &w.v_b,
            nh,
            hp.v_mla,
            r,
            lat,
            n,
            &mut st.scratch.acts,
            vo,
        )?;
        // bailingmoe3's per-head output gate σ(attn_gate · x) on the normed input.
        let gate = &mut st.scratch.gate;
        if let Some(g) = &w.gate {
            gate.resize(n * nh, 0.0);
            cx.mat_rows(g, &st.cur, n, &mut st.scratch.acts, gate)?;
        }
        let o_in = &mut st.scratch.tmp;
        o_in.resize(n * nh * hp.v_mla, 0.0);
        for t in 0..n {
            for h in 0..nh {
                let v = hp.v_mla;
                let dst = &mut o_in[(t * nh + h) * v..(t * nh + h + 1) * v];
                dst.copy_from_slice(&vo[(h * n + t) * v..(h * n + t + 1) * v]);
                if w.gate.is_some() {
                    let g = blocks::sigmoid(gate[t * nh + h]);
                    dst.iter_mut().for_each(|x| *x *= g);
                }
            }
        }
        st.out.resize(n * hp.d_model, 0.0);
        cx.mat_rows(&w.o, o_in, n, &mut st.scratch.acts, &mut st.out)
    }
}

/// `out[h]` = matrix `h` of `m` (`nh` stacked `rows × cols` matrices) · each of the `n` rows of
/// `input[h]` — both head-major (`input` is `nh × n × cols`, `out` `nh × n × rows`) — in one
/// round of the pool; each row's bits are a one-row product's.
#[allow(clippy::too_many_arguments)]
fn per_head(
    cx: &Compute,
    m: &Mat,
    nh: usize,
    rows: usize,
    cols: usize,
    input: &[f32],
    n: usize,
    acts: &mut Vec<kernels::ActBuf>,
    out: &mut [f32],
) -> Result<(), ArchError> {
    blocks::prepare_acts(&cx.pool, m.ty, input, nh * n, cols, acts)?;
    let head_bytes = rows * m.row_bytes();
    let bytes = m.bytes();
    let mut products: Vec<kernels::Product<'_, kernels::ActBuf>> = out[..nh * n * rows]
        .chunks_exact_mut(n * rows)
        .enumerate()
        .map(|(h, o)| kernels::Product {
            ty: m.ty,
            w: &bytes[h * head_bytes..(h + 1) * head_bytes],
            n_rows: rows,
            n_cols: cols,
            acts: &acts[h * n..(h + 1) * n],
            out: o,
        })
        .collect();
    kernels::matmul_round(&cx.pool, &mut products).map_err(blocks::kerr)
}
