//! Gating: how a MoE router turns its logits into the experts a token uses and their weights —
//! one type for every family (features.md §15), so the engine's router, every router hook
//! (top-k override, substitution, route-ahead's commit) and the simulator's replay weight a
//! routing the same way, and the renormalisation floor is written once.
//!
//! A routing row carries the router's **scores** over all experts (`Routing::probs`), in the
//! gating's own space, from which the final weights of any chosen set follow:
//!
//! | function | scores | selection | weights of the chosen `k` |
//! | --- | --- | --- | --- |
//! | `Softmax` (qwen3moe, qwen2moe, gemma4) | softmax over all experts | top-k scores | their scores |
//! | `TopKSoftmax` (gpt-oss) | the raw logits | top-k logits | softmax over the `k` logits |
//! | `Sigmoid` (deepseek-v3, lfm2moe) | sigmoid per expert | top-k of score + the layer's selection bias | their (unbiased) scores |
//!
//! then, with `renormalize`, divided by their sum floored at [`RENORM_MIN_SUM`], then multiplied
//! by `scale` (llama.cpp's `expert_weights_scale`) when it is not 1 — llama.cpp's
//! `build_moe_ffn` order. Ranking is descending with ties to the lower expert id, so it is total
//! and the same wherever it runs.

use std::fmt;

/// The most expert groups a grouped gating may have (DeepSeek-V3 and Kimi-K2 have 8, V2 8).
pub const MAX_GROUPS: usize = 64;

/// The floor on a renormalisation denominator: llama.cpp clamps the selected weights' sum to
/// the smallest normal f16 before dividing (`ffn_moe_weights_sum_clamped`).
pub const RENORM_MIN_SUM: f32 = 6.103_515_6e-5;

/// The function from router logits to scores (see the module table).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum GatingFunc {
    /// Softmax over every expert; the selected experts weigh their probabilities.
    Softmax,
    /// Top-k on the raw logits, then a softmax over the selected `k` only.
    TopKSoftmax,
    /// A sigmoid per expert; selection may add a per-expert bias the weights never see.
    Sigmoid,
    /// `√softplus(logit)` per expert (DeepSeek V4); selection may add a bias, as sigmoid's.
    SqrtSoftplus,
}

/// How a router selects and weights its experts. Carried by the expert layout's owner (the
/// engine's architecture, the simulator's trace preamble) and handed to every hook. Equality
/// compares the scale's bits, so it is an equivalence (preambles derive `Eq`).
#[derive(Copy, Clone, Debug)]
pub struct Gating {
    pub func: GatingFunc,
    /// Divide the selected weights by their sum (floored at [`RENORM_MIN_SUM`]).
    pub renormalize: bool,
    /// Multiply the final weights by this; 1 (or 0, as llama.cpp reads an absent key) = none.
    pub scale: f32,
    /// Grouped selection (DeepSeek's `n_group` / `topk_group`, llama.cpp's
    /// `expert_group_count` / `expert_group_used_count`): the experts in `groups` consecutive
    /// groups, a group scored by the sum of its two best selection scores, only the best
    /// `groups_used` groups' experts selectable. `groups` ≤ 1: no grouping.
    pub groups: u16,
    pub groups_used: u16,
}

impl PartialEq for Gating {
    fn eq(&self, other: &Gating) -> bool {
        self.func == other.func
            && self.renormalize == other.renormalize
            && self.scale.to_bits() == other.scale.to_bits()
            && self.grouped() == other.grouped()
    }
}

impl Eq for Gating {}

impl Default for Gating {
    /// qwen3moe's: a trace or CSV written before gating was recorded reads as this.
    fn default() -> Self {
        Gating::SOFTMAX_RENORM
    }
}

/// Why a `gating=` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("gating '{value}': expected softmax_topk, softmax_topk_norm, topk_softmax, sigmoid_topk or sigmoid_topk_norm, optionally followed by _g<GROUPS>of<USED> (grouped selection) and *SCALE (a positive number)")]
pub struct GatingParseError {
    pub value: String,
}

impl Gating {
    /// qwen3moe, gemma4: softmax, top-k, renormalised.
    pub const SOFTMAX_RENORM: Gating = Gating {
        func: GatingFunc::Softmax,
        renormalize: true,
        scale: 1.0,
        groups: 0,
        groups_used: 0,
    };
    /// qwen2moe: softmax, top-k, weights as the softmax gave them.
    pub const SOFTMAX: Gating = Gating {
        func: GatingFunc::Softmax,
        renormalize: false,
        scale: 1.0,
        groups: 0,
        groups_used: 0,
    };
    /// gpt-oss: top-k on the logits, softmax over the selected.
    pub const TOPK_SOFTMAX: Gating = Gating {
        func: GatingFunc::TopKSoftmax,
        renormalize: false,
        scale: 1.0,
        groups: 0,
        groups_used: 0,
    };

    /// A sigmoid gating (selection may add a bias), renormalised or not.
    pub const fn sigmoid(renormalize: bool) -> Gating {
        Gating {
            func: GatingFunc::Sigmoid,
            renormalize,
            scale: 1.0,
            groups: 0,
            groups_used: 0,
        }
    }

    /// With grouped selection: `groups` groups of consecutive experts, the best `used` of them
    /// selectable (`groups` ≤ 1: none).
    pub fn with_groups(self, groups: u16, used: u16) -> Gating {
        Gating {
            groups,
            groups_used: used,
            ..self
        }
    }

    /// `(groups, used)` when selection is grouped.
    pub fn grouped(&self) -> Option<(u16, u16)> {
        (self.groups > 1 && self.groups_used < self.groups)
            .then_some((self.groups, self.groups_used))
    }

    /// With `expert_weights_scale = scale` (0 and 1 mean none, as in llama.cpp).
    pub fn with_scale(self, scale: f32) -> Gating {
        Gating { scale, ..self }
    }

    /// Whether selection adds a per-expert bias (sigmoid, sqrt-softplus).
    pub fn takes_bias(&self) -> bool {
        matches!(self.func, GatingFunc::Sigmoid | GatingFunc::SqrtSoftplus)
    }

    fn scaled(&self) -> bool {
        self.scale != 0.0 && self.scale != 1.0
    }

    /// Whether the final weights of a selection sum to a constant (1, or `scale`): the
    /// renormalising gatings and the softmax over the selected.
    pub fn normalizes(&self) -> bool {
        self.renormalize || self.func == GatingFunc::TopKSoftmax
    }

    /// The largest final weight a routing can carry (what a trace reader accepts).
    pub fn max_weight(&self) -> f32 {
        if self.scaled() {
            self.scale.abs().max(1.0)
        } else {
            1.0
        }
    }

    /// Turn one row of router logits into this gating's scores, in place (softmax with the
    /// sum widened to f64, as llama.cpp's `soft_max`; sigmoid; or the logits left as they are).
    pub fn scores_in_place(&self, logits: &mut [f32]) {
        match self.func {
            GatingFunc::Softmax => softmax_in_place(logits),
            GatingFunc::TopKSoftmax => {}
            GatingFunc::Sigmoid => {
                for v in logits.iter_mut() {
                    *v = 1.0 / (1.0 + (-*v).exp());
                }
            }
            GatingFunc::SqrtSoftplus => {
                // ggml's softplus: the identity past 20, else ln(1 + eˣ) in f32.
                for v in logits.iter_mut() {
                    let sp = if *v > 20.0 { *v } else { (1.0 + v.exp()).ln() };
                    *v = sp.sqrt();
                }
            }
        }
    }

    /// The score an expert is ranked by: its score plus its selection bias (sigmoid), for
    /// the softmax the log of its probability (so a re-ranking margin is in logit units, as
    /// for the raw logits of `TopKSoftmax`).
    pub fn rank_score(&self, score: f32, bias: f32) -> f32 {
        match self.func {
            GatingFunc::Softmax => score.max(f32::MIN_POSITIVE).ln(),
            GatingFunc::TopKSoftmax => score,
            GatingFunc::Sigmoid | GatingFunc::SqrtSoftplus => score + bias,
        }
    }

    /// Select the top `ids.len()` experts of one row: `scores` (this gating's space, one per
    /// expert), an optional selection bias (sigmoid only; ignored otherwise), `order` scratch.
    /// Writes the ids in rank order and their final weights.
    pub fn select(
        &self,
        scores: &[f32],
        bias: Option<&[f32]>,
        order: &mut Vec<u32>,
        ids: &mut [u32],
        weights: &mut [f32],
    ) {
        let k = ids.len().min(scores.len());
        order.clear();
        order.extend(0..scores.len() as u32);
        let bias = bias.filter(|b| self.takes_bias() && b.len() == scores.len());
        let key = |e: usize| match bias {
            Some(b) => scores[e] + b[e],
            None => scores[e],
        };
        // The groups whose experts may be selected (all without grouping).
        let n = scores.len();
        let mut kept = [true; MAX_GROUPS];
        let per = match self.grouped() {
            Some((g, used))
                if (g as usize) <= MAX_GROUPS
                    && n.is_multiple_of(g as usize)
                    && n >= 2 * g as usize =>
            {
                let (g, per) = (g as usize, n / g as usize);
                // A group's score: the sum of its two best selection scores (llama.cpp's
                // `build_moe_ffn`, DeepSeek-V3's `noaux_tc`).
                let mut group_score = [f32::NEG_INFINITY; MAX_GROUPS];
                for (gi, gs) in group_score.iter_mut().enumerate().take(g) {
                    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                    for e in gi * per..(gi + 1) * per {
                        let v = key(e);
                        if v.total_cmp(&a).is_gt() {
                            b = a;
                            a = v;
                        } else if v.total_cmp(&b).is_gt() {
                            b = v;
                        }
                    }
                    *gs = a + b;
                }
                // Ranked on the stack: this runs for every row of every MoE layer.
                let mut rank = [0usize; MAX_GROUPS];
                rank.iter_mut().enumerate().for_each(|(i, r)| *r = i);
                let rank = &mut rank[..g];
                rank.sort_unstable_by(|&x, &y| {
                    group_score[y].total_cmp(&group_score[x]).then(x.cmp(&y))
                });
                kept[..g].iter_mut().for_each(|k| *k = false);
                for &gi in &rank[..used as usize] {
                    kept[gi] = true;
                }
                per
            }
            _ => n.max(1),
        };
        // Descending by selection score (a masked group's experts last, as at −∞); ties by the
        // lower id, so the order is total.
        let masked = |e: u32| {
            let e = e as usize;
            if kept[e / per] {
                key(e)
            } else {
                f32::NEG_INFINITY
            }
        };
        order.sort_by(|&x, &y| masked(y).total_cmp(&masked(x)).then(x.cmp(&y)));
        ids[..k].copy_from_slice(&order[..k]);
        self.weights_for(scores, &ids[..k], &mut weights[..k]);
    }

    /// The final weights of the experts `ids` (rank order) from the row's `scores`: exactly
    /// the router's own arithmetic, so a hook that narrows or re-chooses a routing weighs it as
    /// the router would have.
    pub fn weights_for<I: Copy + Into<u32>>(&self, scores: &[f32], ids: &[I], out: &mut [f32]) {
        let at = |e: I| scores.get(e.into() as usize).copied().unwrap_or(0.0);
        match self.func {
            GatingFunc::Softmax | GatingFunc::Sigmoid | GatingFunc::SqrtSoftplus => {
                for (w, &e) in out.iter_mut().zip(ids) {
                    *w = at(e);
                }
            }
            GatingFunc::TopKSoftmax => {
                for (w, &e) in out.iter_mut().zip(ids) {
                    *w = at(e);
                }
                softmax_in_place(&mut out[..ids.len()]);
            }
        }
        self.finish(&mut out[..ids.len()]);
    }

    /// Renormalise (if asked) and scale a chosen set's weights.
    fn finish(&self, w: &mut [f32]) {
        if self.renormalize {
            let sum: f32 = w.iter().sum();
            let denom = sum.max(RENORM_MIN_SUM);
            for x in w.iter_mut() {
                *x /= denom;
            }
        }
        if self.scaled() {
            for x in w.iter_mut() {
                *x *= self.scale;
            }
        }
    }

    /// The share of a routing's mass one selected expert carries, for the drop threshold
    /// `F / k` (expert-dropping.md), given its final weight `w` and the row's total `mass`:
    /// the weight itself where the gating's weights sum to 1 (qwen3moe's, gpt-oss's — what the
    /// threshold is defined on, kept bit for bit), the weight over the scale where they sum to
    /// it, and the weight over the row's mass where they sum to no constant (qwen2moe's softmax
    /// without renormalisation, whose k weights may sum to far below 1).
    pub fn share(&self, w: f32, mass: f32) -> f32 {
        if self.normalizes() {
            if self.scaled() {
                w / self.scale
            } else {
                w
            }
        } else if mass > 0.0 && mass.is_finite() {
            w / mass
        } else {
            w
        }
    }

    /// The weights the router would give the first `k` of a wider selection, from that
    /// selection's final weights alone (a replay has no scores): a normalising gating divides
    /// them by their sum (the softmax over a subset is proportional to the softmax over the
    /// whole), the others keep them. Ranks past `k` are left as they were.
    pub fn narrow(&self, weights: &mut [f32], k: usize) {
        let k = k.min(weights.len());
        if !self.normalizes() {
            return;
        }
        let unscale = if self.scaled() { self.scale } else { 1.0 };
        let sum: f32 = weights[..k].iter().map(|w| w / unscale).sum();
        let denom = sum.max(RENORM_MIN_SUM);
        for w in &mut weights[..k] {
            *w = *w / unscale / denom * unscale;
        }
    }
}

/// Softmax in place: max-subtracted exponentials, their sum widened to f64, one reciprocal
/// multiplied in (llama.cpp's `ggml_soft_max` on the CPU).
pub fn softmax_in_place(v: &mut [f32]) {
    let mx = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for x in v.iter_mut() {
        *x = (*x - mx).exp();
        sum += *x as f64;
    }
    let inv = (1.0 / sum) as f32;
    v.iter_mut().for_each(|x| *x *= inv);
}

impl fmt::Display for Gating {
    /// `softmax_topk_norm`, `softmax_topk`, `topk_softmax`, `sigmoid_topk[_norm]`, and `*SCALE`
    /// when the weights are scaled: one whitespace-free token for a `gating=` key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let base = match self.func {
            GatingFunc::Softmax => "softmax_topk",
            GatingFunc::TopKSoftmax => "topk_softmax",
            GatingFunc::Sigmoid => "sigmoid_topk",
            GatingFunc::SqrtSoftplus => "sqrtsoftplus_topk",
        };
        f.write_str(base)?;
        if self.renormalize {
            f.write_str("_norm")?;
        }
        if let Some((g, used)) = self.grouped() {
            write!(f, "_g{g}of{used}")?;
        }
        if self.scaled() {
            write!(f, "*{}", self.scale)?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Gating {
    type Err = GatingParseError;

    fn from_str(s: &str) -> Result<Gating, GatingParseError> {
        let bad = || GatingParseError {
            value: s.to_string(),
        };
        let (name, scale) = match s.split_once('*') {
            Some((n, sc)) => {
                let v: f32 = sc.parse().map_err(|_| bad())?;
                if !(v.is_finite() && v > 0.0) {
                    return Err(bad());
                }
                (n, v)
            }
            None => (s, 1.0),
        };
        // `_g<groups>of<used>`: grouped selection.
        let (name, groups, groups_used) = match name.rsplit_once("_g") {
            Some((n, g)) if g.contains("of") => {
                let (a, b) = g.split_once("of").ok_or_else(bad)?;
                let (a, b): (u16, u16) =
                    (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if a < 2 || b == 0 || b >= a || a as usize > MAX_GROUPS {
                    return Err(bad());
                }
                (n, a, b)
            }
            _ => (name, 0, 0),
        };
        let (func, renormalize) = match name {
            "softmax_topk" => (GatingFunc::Softmax, false),
            "softmax_topk_norm" => (GatingFunc::Softmax, true),
            "topk_softmax" => (GatingFunc::TopKSoftmax, false),
            "topk_softmax_norm" => (GatingFunc::TopKSoftmax, true),
            "sigmoid_topk" => (GatingFunc::Sigmoid, false),
            "sigmoid_topk_norm" => (GatingFunc::Sigmoid, true),
            "sqrtsoftplus_topk" => (GatingFunc::SqrtSoftplus, false),
            "sqrtsoftplus_topk_norm" => (GatingFunc::SqrtSoftplus, true),
            _ => return Err(bad()),
        };
        Ok(Gating {
            func,
            renormalize,
            scale,
            groups,
            groups_used,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(g: Gating, logits: &[f32], k: usize) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
        let mut s = logits.to_vec();
        g.scores_in_place(&mut s);
        let mut order = Vec::new();
        let (mut ids, mut w) = (vec![0u32; k], vec![0f32; k]);
        g.select(&s, None, &mut order, &mut ids, &mut w);
        (ids, w, s)
    }

    #[test]
    fn softmax_renormalised_is_the_routers_arithmetic() {
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let (ids, w, p) = pick(Gating::SOFTMAX_RENORM, &logits, 2);
        assert_eq!(ids, [1, 2]);
        let s = p[1] + p[2];
        assert_eq!(w, [p[1] / s, p[2] / s]);
        // Without renormalisation the probabilities stay as they are.
        let (_, w, p) = pick(Gating::SOFTMAX, &logits, 2);
        assert_eq!(w, [p[1], p[2]]);
    }

    #[test]
    fn topk_softmax_is_a_softmax_over_the_selected_logits() {
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let (ids, w, scores) = pick(Gating::TOPK_SOFTMAX, &logits, 2);
        assert_eq!(ids, [1, 2]);
        assert_eq!(scores, logits, "the scores are the raw logits");
        let e = (2.0f32 - 3.0).exp();
        assert!((w[0] - 1.0 / (1.0 + e)).abs() < 1e-7);
        assert!((w[0] + w[1] - 1.0).abs() < 1e-6);
        // Narrowing from the weights alone gives what the router gives at the narrower k.
        let (_, mut wide, _) = pick(Gating::TOPK_SOFTMAX, &logits, 3);
        Gating::TOPK_SOFTMAX.narrow(&mut wide, 2);
        assert!((wide[0] - w[0]).abs() < 1e-6 && (wide[1] - w[1]).abs() < 1e-6);
    }

    #[test]
    fn sigmoid_selects_with_the_bias_and_weighs_without_it() {
        let g = Gating::sigmoid(true);
        let mut s = vec![0.0f32, 1.0, 2.0];
        g.scores_in_place(&mut s);
        let bias = [5.0f32, 0.0, 0.0];
        let (mut ids, mut w) = (vec![0u32; 2], vec![0f32; 2]);
        g.select(&s, Some(&bias), &mut Vec::new(), &mut ids, &mut w);
        assert_eq!(ids, [0, 2], "the bias lifts expert 0 into the selection");
        let sum = s[0] + s[2];
        assert_eq!(w, [s[0] / sum, s[2] / sum]);
    }

    #[test]
    fn sqrt_softplus_scores_select_with_the_bias_and_weigh_without_it() {
        let g = Gating {
            func: GatingFunc::SqrtSoftplus,
            ..Gating::sigmoid(true)
        }
        .with_scale(1.5);
        let mut s = vec![-1.0f32, 0.5, 3.0, 25.0];
        g.scores_in_place(&mut s);
        // √ln(1 + eˣ), and past 20 the identity under the root (ggml's softplus).
        assert!((s[0] - (1.0f32 + (-1.0f32).exp()).ln().sqrt()).abs() < 1e-7);
        assert!((s[2] - (1.0f32 + 3.0f32.exp()).ln().sqrt()).abs() < 1e-6);
        assert_eq!(s[3], 25.0f32.sqrt());
        let bias = [10.0f32, 0.0, 0.0, 0.0];
        let (mut ids, mut w) = (vec![0u32; 2], vec![0f32; 2]);
        g.select(&s, Some(&bias), &mut Vec::new(), &mut ids, &mut w);
        assert_eq!(ids, [0, 3], "the bias lifts expert 0 into the selection");
        let sum = s[0] + s[3];
        assert_eq!(w, [s[0] / sum * 1.5, s[3] / sum * 1.5]);
        assert_eq!(g.to_string(), "sqrtsoftplus_topk_norm*1.5");
    }

    #[test]
    fn grouped_selection_keeps_the_groups_with_the_best_two_scores() {
        // 8 experts in 4 groups of 2. Expert 0 is the single best, but its group's pair sums
        // lowest but one; groups 1 and 2 (experts 2-5) have the best pairs.
        let scores = [0.9f32, -0.2, 0.5, 0.45, 0.4, 0.4, 0.1, 0.2];
        let g = Gating::SOFTMAX.with_groups(4, 2);
        let (mut ids, mut w) = (vec![0u32; 3], vec![0f32; 3]);
        g.select(&scores, None, &mut Vec::new(), &mut ids, &mut w);
        assert_eq!(ids, [2, 3, 4], "expert 0's group is masked");
        assert_eq!(w, [0.5, 0.45, 0.4], "weights are the unmasked scores");
        // Three groups kept: group 0 (0.9) comes back and leads.
        let (mut ids3, mut w3) = (vec![0u32; 3], vec![0f32; 3]);
        g.with_groups(4, 3)
            .select(&scores, None, &mut Vec::new(), &mut ids3, &mut w3);
        assert_eq!(ids3, [0, 2, 3]);
        // Sigmoid: the groups are scored on score + bias, the weights stay unbiased.
        let sg = Gating::sigmoid(false).with_groups(4, 1);
        let bias = [0.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0];
        let (mut ids, mut w) = (vec![0u32; 2], vec![0f32; 2]);
        sg.select(&scores, Some(&bias), &mut Vec::new(), &mut ids, &mut w);
        assert_eq!(ids, [7, 6], "the biased group wins");
        assert_eq!(w, [0.2, 0.1]);
        // Without grouping the plain top-k.
        let (mut ids, mut w) = (vec![0u32; 3], vec![0f32; 3]);
        Gating::SOFTMAX.select(&scores, None, &mut Vec::new(), &mut ids, &mut w);
        assert_eq!(ids, [0, 2, 3]);
    }

    #[test]
    fn the_floor_and_the_scale_apply_once_in_llama_cpp_order() {
        let g = Gating::SOFTMAX_RENORM.with_scale(2.5);
        let mut w = [0.0f32; 2];
        g.weights_for(&[1e-9, 1e-9, 0.5], &[0u32, 1], &mut w);
        assert_eq!(w, [1e-9 / RENORM_MIN_SUM * 2.5; 2]);
        assert_eq!(g.max_weight(), 2.5);
        // Narrowing a scaled, renormalised routing keeps its mass at the scale.
        let mut w = [1.5f32, 0.5, 0.5];
        g.narrow(&mut w, 2);
        assert!((w[0] + w[1] - 2.5).abs() < 1e-6, "{w:?}");
        // Scale 0 and 1 are "none", as llama.cpp reads them.
        assert_eq!(Gating::SOFTMAX.with_scale(0.0).max_weight(), 1.0);
    }

    #[test]
    fn a_share_is_of_the_mass_the_gating_gives_a_row() {
        // Normalised: the weight itself (bit for bit); scaled: over the scale.
        assert_eq!(Gating::SOFTMAX_RENORM.share(0.3, 0.9), 0.3);
        assert_eq!(Gating::TOPK_SOFTMAX.share(0.3, 0.9), 0.3);
        assert_eq!(Gating::SOFTMAX_RENORM.with_scale(2.0).share(0.5, 2.0), 0.25);
        // Not normalised (qwen2moe): over the row's mass.
        assert_eq!(Gating::SOFTMAX.share(0.05, 0.2), 0.25);
        assert_eq!(Gating::SOFTMAX.share(0.05, 0.0), 0.05);
    }

    #[test]
    fn names_round_trip_and_bad_ones_are_refused() {
        for g in [
            Gating::SOFTMAX_RENORM,
            Gating::SOFTMAX,
            Gating::TOPK_SOFTMAX,
            Gating::SOFTMAX.with_scale(2.5),
            Gating::sigmoid(true),
            Gating::sigmoid(true).with_groups(8, 4).with_scale(2.5),
            Gating::SOFTMAX.with_groups(8, 3),
            Gating {
                func: GatingFunc::SqrtSoftplus,
                ..Gating::sigmoid(false)
            },
        ] {
            assert_eq!(g.to_string().parse::<Gating>(), Ok(g), "{g}");
        }
        assert_eq!(Gating::SOFTMAX_RENORM.to_string(), "softmax_topk_norm");
        assert_eq!(Gating::default(), Gating::SOFTMAX_RENORM);
        for bad in [
            "",
            "softmax",
            "topk_softmax*",
            "softmax_topk*-1",
            "sigmoid*2",
            "softmax_topk_g8of8",
            "softmax_topk_g1of1",
            "softmax_topk_g8ofx",
        ] {
            assert!(bad.parse::<Gating>().is_err(), "{bad}");
        }
    }
}
