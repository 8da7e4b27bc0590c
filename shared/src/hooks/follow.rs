//! `--routing-from TRACE`: the router follows a recorded route trace. Random-weight models
//! route unlike trained ones, which flatters every streamed figure; this makes a synthetic
//! model of the recorded model's shape route as the real one did — its ids, and its weights
//! where the trace has them (else the router's own over those ids, renormalised) — layer by
//! layer, token by token, while every expert is really read and computed.
//!
//! Tokens are matched by order: the `n`-th token the engine computes (prompt rows and
//! generated tokens alike) follows the trace's `n`-th token in (turn, phase, step) order. The
//! trace reader refuses a token that lacks a layer, so every cell is there; should one not be,
//! the router's own choice stays and is counted.

use crate::backend::Routing;
use crate::gating::{Gating, RENORM_MIN_SUM};
use crate::telemetry::route_trace::RouteTrace;

/// Why a trace cannot drive this model, or ran out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FollowError {
    #[error(
        "--routing-from: the trace's {what} is {trace}, the model's is {model}: a trace drives \
         only a model of its own routing shape (bmoe-cli gen has presets for the shipped traces)"
    )]
    Shape {
        what: &'static str,
        trace: u64,
        model: u64,
    },
    #[error(
        "--routing-from: the trace has {n_tokens} tokens and the run asked for token {token}: \
         use a shorter prompt or a smaller -n"
    )]
    Exhausted { n_tokens: u64, token: u64 },
}

const NONE: u32 = u32::MAX;

/// A route trace flattened to what the router needs: per token and MoE layer, the recorded
/// ids and weights.
#[derive(Clone, Debug)]
pub struct FollowTrace {
    n_moe: usize,
    k: usize,
    /// `n_tokens × n_moe` entries: the index of the cell's first slot in `ids`/`weights`
    /// (`k` of them), or `NONE` where the trace lacks the cell.
    cells: Vec<u32>,
    ids: Vec<u16>,
    weights: Vec<f32>,
    weights_known: bool,
    gating: Gating,
    scratch: Vec<f32>,
    /// Cells the trace lacked, routed by the model's own router instead.
    pub missing_cells: u64,
}

impl FollowTrace {
    /// Checks `trace` against the model's routing shape — MoE layers, experts per layer and
    /// experts per token — and flattens it. `gating` weighs a trace without weights.
    pub fn new(
        trace: &RouteTrace,
        n_moe_layers: usize,
        n_expert: u32,
        k: u32,
        gating: Gating,
    ) -> Result<FollowTrace, FollowError> {
        let p = &trace.preamble;
        let checks = [
            (
                "number of MoE layers",
                p.layers.len() as u64,
                n_moe_layers as u64,
            ),
            (
                "experts per layer (n_expert)",
                u64::from(p.n_expert),
                u64::from(n_expert),
            ),
            (
                "experts per token (n_expert_used)",
                u64::from(p.n_expert_used),
                u64::from(k),
            ),
        ];
        for (what, trace, model) in checks {
            if trace != model {
                return Err(FollowError::Shape { what, trace, model });
            }
        }
        let k = k as usize;
        let steps: Vec<_> = trace.steps().collect();
        let mut cells = vec![NONE; steps.len() * n_moe_layers];
        let mut ids = Vec::with_capacity(trace.cells.len() * k);
        let mut weights = Vec::with_capacity(trace.cells.len() * k);
        for (t, step) in steps.iter().enumerate() {
            for cell in step.cells {
                cells[t * n_moe_layers + cell.moe_layer as usize] = ids.len() as u32;
                for s in trace.cell_slots(cell) {
                    // The reader checked expert < n_expert (= the model's, checked above).
                    ids.push(s.expert as u16);
                    weights.push(s.weight);
                }
            }
        }
        Ok(FollowTrace {
            n_moe: n_moe_layers,
            k,
            cells,
            ids,
            weights,
            weights_known: trace.weights_known(),
            gating,
            scratch: vec![0.0; k],
            missing_cells: 0,
        })
    }

    /// Tokens in the trace.
    pub fn n_tokens(&self) -> u64 {
        (self.cells.len() / self.n_moe.max(1)) as u64
    }

    /// Whether the trace carries router weights (else the router's own are used).
    pub fn weights_known(&self) -> bool {
        self.weights_known
    }

    /// Rewrites MoE layer `moe`'s routing, whose batch row `r` is the run's token
    /// `first_token + r`, with the trace's choice for those tokens.
    pub fn apply(
        &mut self,
        moe: u16,
        first_token: u64,
        routing: &mut Routing,
    ) -> Result<(), FollowError> {
        let k = self.k;
        for row in 0..routing.n_rows() {
            let token = first_token + u64::from(routing.batch_row(row));
            if token >= self.n_tokens() {
                return Err(FollowError::Exhausted {
                    n_tokens: self.n_tokens(),
                    token,
                });
            }
            let at = self.cells[token as usize * self.n_moe + moe as usize];
            if at == NONE || routing.k() != k {
                self.missing_cells += 1;
                continue;
            }
            let at = at as usize;
            routing.ids_mut(row).copy_from_slice(&self.ids[at..at + k]);
            if self.weights_known {
                routing
                    .weights_mut(row)
                    .copy_from_slice(&self.weights[at..at + k]);
                continue;
            }
            // No recorded weights: the router's own over the recorded ids, renormalised.
            let w = &mut self.scratch[..k];
            match routing.probs(row) {
                Some(scores) => self.gating.weights_for(scores, &self.ids[at..at + k], w),
                None => w.fill(1.0),
            }
            if !self.gating.normalizes() || routing.probs(row).is_none() {
                let sum: f32 = w.iter().sum();
                let denom = sum.max(RENORM_MIN_SUM);
                for x in w.iter_mut() {
                    *x /= denom;
                }
            }
            routing.weights_mut(row).copy_from_slice(w);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = "# route_trace v1\n\
# model=m arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2\n\
# layer=0 expert_bytes=100 dense_bytes=10\n\
# layer=1 expert_bytes=100 dense_bytes=10\n\
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped\n\
0,1,0,0,0,3,nan,0,100,0\n0,1,0,0,1,1,nan,0,100,0\n\
0,1,0,1,0,2,nan,0,100,0\n0,1,0,1,1,0,nan,0,100,0\n\
0,1,1,0,0,0,nan,0,100,0\n0,1,1,0,1,2,nan,0,100,0\n\
0,1,1,1,0,1,nan,0,100,0\n0,1,1,1,1,3,nan,0,100,0\n";

    fn routing(scores: &[f32]) -> Routing {
        let mut r = Routing::new();
        r.reset(4, 1);
        r.push_row_with_probs(0, &[0, 1], &[0.6, 0.4], scores)
            .unwrap();
        r
    }

    #[test]
    fn the_router_follows_the_trace_and_weighs_its_ids_with_its_own_scores() {
        let t = RouteTrace::parse(TRACE).unwrap();
        let mut f = FollowTrace::new(&t, 2, 4, 2, Gating::SOFTMAX_RENORM).unwrap();
        assert_eq!(f.n_tokens(), 2);
        let mut r = routing(&[0.1, 0.2, 0.3, 0.4]);
        f.apply(0, 0, &mut r).unwrap();
        assert_eq!(r.ids(0), &[3, 1]);
        let w = r.weights(0);
        assert!(
            (w[0] - 0.4 / 0.6).abs() < 1e-6 && (w[1] - 0.2 / 0.6).abs() < 1e-6,
            "{w:?}"
        );
        // Token 1 at layer 1, as the second row of a batch that starts at token 0.
        let mut r = Routing::new();
        r.reset(4, 2);
        r.push_row_with_probs(1, &[0, 1], &[0.6, 0.4], &[0.1, 0.2, 0.3, 0.4])
            .unwrap();
        f.apply(1, 0, &mut r).unwrap();
        assert_eq!(r.ids(0), &[1, 3]);
        assert_eq!(f.missing_cells, 0);
        // A third token is past the trace's end: an error naming both.
        let e = f.apply(0, 2, &mut routing(&[0.25; 4])).unwrap_err();
        assert_eq!(
            e,
            FollowError::Exhausted {
                n_tokens: 2,
                token: 2
            }
        );
    }

    #[test]
    fn a_trace_of_another_shape_is_refused_by_name() {
        let t = RouteTrace::parse(TRACE).unwrap();
        let e = FollowTrace::new(&t, 2, 8, 2, Gating::SOFTMAX_RENORM).unwrap_err();
        assert!(
            e.to_string()
                .contains("experts per layer (n_expert) is 4, the model's is 8"),
            "{e}"
        );
        let e = FollowTrace::new(&t, 3, 4, 2, Gating::SOFTMAX_RENORM).unwrap_err();
        assert!(e.to_string().contains("number of MoE layers is 2"), "{e}");
        let e = FollowTrace::new(&t, 2, 4, 3, Gating::SOFTMAX_RENORM).unwrap_err();
        assert!(e.to_string().contains("n_expert_used"), "{e}");
    }

    #[test]
    fn recorded_weights_are_applied_as_recorded() {
        let text = TRACE.replace("nan", "0.5");
        let t = RouteTrace::parse(&text).unwrap();
        let mut f = FollowTrace::new(&t, 2, 4, 2, Gating::SOFTMAX_RENORM).unwrap();
        let mut r = routing(&[0.1, 0.2, 0.3, 0.4]);
        f.apply(1, 0, &mut r).unwrap();
        assert_eq!(
            (r.ids(0), r.weights(0)),
            (&[2u16, 0][..], &[0.5f32, 0.5][..])
        );
    }
}
