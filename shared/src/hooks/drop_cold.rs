//! `--drop-cold-experts F` (expert-dropping.md): skip a routed expert that is not resident
//! *and* weighted below `F × 1/k`, `k` the routing's effective width (after any top-k
//! override). Spends quality only where it buys a flash read. The weight is the expert's share
//! of the routing's mass as the model's gating gives it (`Gating::share`): the weight itself
//! for the gatings whose weights sum to 1 (qwen3moe, gpt-oss), the weight over the row's sum
//! for qwen2moe's unnormalised softmax.
//!
//! The top-weighted expert of a row is pinned, so a routing is never emptied even if the
//! `F ≤ 1` bound were lifted. A dropped slot is flagged (`Routing::drop_entry`): the streamer
//! neither reads it nor hands it to the backend, which sums only the ranks it computed, so its
//! effective weight is zero and no repointing is needed (our engine owns its graph; there is
//! no `mul_mat_id` reading an uncommitted slot). The slot keeps the router's weight in the
//! `Routing` so the route trace records what the router produced (expert-dropping.md: `weight`
//! stays as the router produced it, `dropped` says what the policy did). With `renormalize`
//! the survivors are scaled back to the row's original mass.

use super::{HookContext, RouterHook};
use crate::backend::Routing;
use crate::gating::Gating;
use crate::layout::ExpertKey;
use crate::records::Phase;
use crate::vocab::HookError;

/// The dropping hook. `frac` in (0, 1] (validated by `RunConfig::validate`); `frac ≤ 0` makes
/// it a no-op.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct DropCold {
    /// `F`: the threshold as a fraction of the uniform share `1/k`.
    pub frac: f32,
    /// Rescale the survivors to the row's original total weight (`--drop-no-renorm` clears).
    pub renormalize: bool,
    /// Also drop during prefill (`--drop-in-prefill`).
    pub in_prefill: bool,
    /// The model's gating: what share of a row's mass a weight is.
    pub gating: Gating,
}

impl DropCold {
    /// Apply the rule to every row of `routing`, with `is_resident(expert)` telling residency.
    /// Returns the number of slots dropped. Exposed for property tests and the simulator.
    pub fn drop_rows(&self, routing: &mut Routing, is_resident: &dyn Fn(u16) -> bool) -> u64 {
        let k = routing.k();
        if self.frac.is_nan() || self.frac <= 0.0 || k <= 1 {
            return 0;
        }
        let threshold = self.frac / k as f32;
        let mut n_dropped = 0u64;
        for r in 0..routing.n_rows() {
            let top = top_rank(routing.weights(r), routing.dropped(r));
            let mass: f32 = (0..k)
                .filter(|&j| !routing.dropped(r)[j])
                .map(|j| routing.weights(r)[j])
                .sum();
            let mut original = 0f32;
            let mut kept = 0f32;
            let mut any = false;
            for rank in 0..k {
                if routing.dropped(r)[rank] {
                    continue;
                }
                let w = routing.weights(r)[rank];
                original += w;
                let cold = !is_resident(routing.ids(r)[rank]);
                if Some(rank) != top && cold && self.gating.share(w, mass) < threshold {
                    routing.drop_entry(r, rank);
                    n_dropped += 1;
                    any = true;
                } else {
                    kept += w;
                }
            }
            if any && self.renormalize && kept > 0.0 && kept.is_finite() {
                let scale = original / kept;
                for rank in 0..k {
                    if !routing.dropped(r)[rank] {
                        routing.weights_mut(r)[rank] *= scale;
                    }
                }
            }
        }
        n_dropped
    }
}

/// The rank with the largest weight among the not-yet-dropped (first on ties).
fn top_rank(weights: &[f32], dropped: &[bool]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (rank, (&w, &d)) in weights.iter().zip(dropped).enumerate() {
        if d {
            continue;
        }
        if best.is_none_or(|b| w > weights[b]) {
            best = Some(rank);
        }
    }
    best
}

impl RouterHook for DropCold {
    fn name(&self) -> &'static str {
        "drop-cold-experts"
    }

    fn apply(&mut self, cx: &HookContext<'_>, routing: &mut Routing) -> Result<(), HookError> {
        if cx.phase == Phase::Prefill && !self.in_prefill {
            return Ok(());
        }
        let layer = cx.layer.moe;
        let cache = cx.cache;
        self.drop_rows(routing, &|expert| {
            cache.contains(ExpertKey { layer, expert })
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ids: &[u16], w: &[f32]) -> Routing {
        let mut r = Routing::new();
        r.reset(16, 1);
        r.push_row(0, ids, w).unwrap();
        r
    }

    #[test]
    fn drops_only_cold_light_non_top_experts_and_renormalises() {
        let hook = DropCold {
            frac: 1.0,
            renormalize: true,
            in_prefill: false,
            gating: Gating::SOFTMAX_RENORM,
        };
        // k = 4: threshold 0.25. Expert 3 (0.1) is cold → dropped; expert 5 (0.2) is resident
        // → kept; expert 1 (0.4) is above the threshold.
        let mut r = row(&[1, 2, 3, 5], &[0.4, 0.3, 0.1, 0.2]);
        let n = hook.drop_rows(&mut r, &|e| e == 5);
        assert_eq!(n, 1);
        assert_eq!(r.dropped(0), &[false, false, true, false]);
        // The dropped slot keeps its router weight (for the trace); the survivors carry the mass.
        assert_eq!(r.weights(0)[2], 0.1);
        let sum: f32 = r.weights(0)[..2].iter().sum::<f32>() + r.weights(0)[3];
        assert!((sum - 1.0).abs() < 1e-6, "{sum}");
        assert!((r.weights(0)[0] - 0.4 / 0.9).abs() < 1e-6);

        // Without renormalisation the survivors keep their router weights.
        let hook = DropCold {
            renormalize: false,
            ..hook
        };
        let mut r = row(&[1, 2, 3, 5], &[0.4, 0.3, 0.1, 0.2]);
        hook.drop_rows(&mut r, &|_| false);
        assert_eq!(r.dropped(0), &[false, false, true, true]);
        assert_eq!(r.weights(0), &[0.4, 0.3, 0.1, 0.2]);
    }

    #[test]
    fn an_unnormalised_gating_drops_by_share_of_the_row() {
        // qwen2moe: the k softmax probabilities sum to 0.2, so 0.06 is 30 % of the row.
        let hook = DropCold {
            frac: 1.0,
            renormalize: true,
            in_prefill: false,
            gating: Gating::SOFTMAX,
        };
        let mut r = row(&[1, 2, 3, 4], &[0.08, 0.06, 0.035, 0.025]);
        assert_eq!(hook.drop_rows(&mut r, &|_| false), 2);
        assert_eq!(r.dropped(0), &[false, false, true, true]);
        // The survivors carry the row's original mass.
        let kept = r.weights(0)[0] + r.weights(0)[1];
        assert!((kept - 0.2).abs() < 1e-6, "{kept}");
        // Read as weights summing to 1, every one would be below 1/4 and all but the top go.
        let hook = DropCold {
            gating: Gating::SOFTMAX_RENORM,
            ..hook
        };
        let mut r = row(&[1, 2, 3, 4], &[0.08, 0.06, 0.035, 0.025]);
        assert_eq!(hook.drop_rows(&mut r, &|_| false), 3);
    }

    #[test]
    fn top_expert_survives_even_when_cold_and_light() {
        let hook = DropCold {
            frac: 1.0,
            renormalize: true,
            in_prefill: false,
            gating: Gating::SOFTMAX_RENORM,
        };
        // Uniform weights: every slot sits exactly at the threshold, nothing below it.
        let mut r = row(&[1, 2], &[0.5, 0.5]);
        assert_eq!(hook.drop_rows(&mut r, &|_| false), 0);
        // Top-1: the only expert is the top one.
        let mut r = row(&[7], &[0.01]);
        assert_eq!(hook.drop_rows(&mut r, &|_| false), 0);
        assert_eq!(r.weights(0), &[0.01]);
    }
}
