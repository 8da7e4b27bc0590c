//! `--route-ahead N` (features.md §6): commit a decode routing predicted N layers early.
//!
//! Layer L's selected ids are replaced by the top-k of L's own router applied to the router
//! input of layer L−N (the stale gate, `predict.rs`). L's router still runs, so the committed
//! experts get the router's **true** scores, weighted exactly as the model's gating weighs a
//! selection (`Gating::weights_for`; qwen3moe: `p_j / max(Σ p, 6.1035e-5)`). Lossy but
//! deterministic: the perturbation is measured as the fraction of committed slots the router
//! itself would not have chosen.
//!
//! The decode step calls `commit` before every other router hook, so the top-k override,
//! substitution, dropping, the trace and the loader all see the committed routing (a top-k
//! override after a commit keeps the prefix of the predicted ranking and re-weighs it from the
//! same scores, which is what committing after the override would give). It is not a
//! boxed `RouterHook` because it needs the step's predictions, which `HookContext` does not
//! carry.

use crate::backend::Routing;
use crate::gating::Gating;

/// What one commit did: committed slots and how many of them the router also chose.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CommitCounts {
    pub slots: u64,
    pub agreed: u64,
}

/// Replace row `row`'s ids with the first `routing.k()` of `predicted` (rank order) and its
/// weights with what `gating` gives those ids from the router's scores. `None` (routing left
/// as the router made it: passed through) when the row carries no router scores, the
/// prediction is narrower than the routing, or it names an id out of range or twice.
pub fn commit(
    routing: &mut Routing,
    row: u32,
    predicted: &[u16],
    gating: Gating,
) -> Option<CommitCounts> {
    let k = routing.k();
    if row >= routing.n_rows() || k == 0 || predicted.len() < k {
        return None;
    }
    let ids = &predicted[..k];
    let n_expert = routing.n_expert();
    for (j, &e) in ids.iter().enumerate() {
        if u32::from(e) >= n_expert || ids[..j].contains(&e) {
            return None;
        }
    }
    let probs = routing.probs(row)?;
    let mut weights = [0f32; 64];
    let mut wide = Vec::new();
    let w: &mut [f32] = if k <= weights.len() {
        &mut weights[..k]
    } else {
        wide.resize(k, 0.0);
        &mut wide
    };
    gating.weights_for(probs, ids, w);
    let agreed = ids.iter().filter(|e| routing.ids(row).contains(e)).count() as u64;
    routing.ids_mut(row).copy_from_slice(ids);
    routing.weights_mut(row).copy_from_slice(w);
    Some(CommitCounts {
        slots: k as u64,
        agreed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_takes_the_prediction_with_true_renormalised_weights() {
        let probs = [0.1f32, 0.4, 0.3, 0.2];
        let mut r = Routing::new();
        r.reset(4, 1);
        r.push_row_with_probs(0, &[1, 2], &[0.4 / 0.7, 0.3 / 0.7], &probs)
            .unwrap();
        let c = commit(&mut r, 0, &[3, 1, 0], Gating::SOFTMAX_RENORM).unwrap();
        assert_eq!(
            c,
            CommitCounts {
                slots: 2,
                agreed: 1
            }
        );
        assert_eq!(r.ids(0), &[3, 1]);
        let denom = 0.2f32 + 0.4f32;
        assert_eq!(r.weights(0), &[0.2 / denom, 0.4 / denom]);
        // The router's own choice commits unchanged, bit for bit.
        let mut r2 = Routing::new();
        r2.reset(4, 1);
        let s = 0.4f32 + 0.3f32;
        r2.push_row_with_probs(0, &[1, 2], &[0.4 / s, 0.3 / s], &probs)
            .unwrap();
        let c = commit(&mut r2, 0, &[1, 2], Gating::SOFTMAX_RENORM).unwrap();
        assert_eq!(c.agreed, 2);
        assert_eq!(r2.weights(0), &[0.4 / s, 0.3 / s]);
    }

    #[test]
    fn unreadable_rows_pass_through() {
        let mut r = Routing::new();
        r.reset(4, 1);
        r.push_row(0, &[1, 2], &[0.6, 0.4]).unwrap();
        // No router probabilities: nothing to weight the committed ids with.
        assert_eq!(commit(&mut r, 0, &[3, 0], Gating::SOFTMAX_RENORM), None);
        assert_eq!(r.ids(0), &[1, 2]);
        let mut r = Routing::new();
        r.reset(4, 1);
        r.push_row_with_probs(0, &[1, 2], &[0.6, 0.4], &[0.1, 0.4, 0.3, 0.2])
            .unwrap();
        assert_eq!(
            commit(&mut r, 0, &[3], Gating::SOFTMAX_RENORM),
            None,
            "narrower prediction"
        );
        assert_eq!(
            commit(&mut r, 0, &[3, 3], Gating::SOFTMAX_RENORM),
            None,
            "duplicate id"
        );
        assert_eq!(
            commit(&mut r, 0, &[3, 4], Gating::SOFTMAX_RENORM),
            None,
            "out of range"
        );
        assert_eq!(r.ids(0), &[1, 2]);
    }
}
