//! Replaying expert predictors from a route trace.
//!
//! Previous-token prefetch (`--prefetch`) needs nothing but the routing the trace records. The
//! stale-gate (`--predict-log`, `--predict-prefetch`) and route-ahead (`--route-ahead N`)
//! predictors apply a router to a hidden state the simulator does not have, so the engine
//! records what they predicted (`pred<h>` / `pred<h>_weight` and `router_expert` route-trace
//! columns) and the simulator replays those predictions (`TraceBackend::predict`). This file
//! decides, per flag, whether a trace carries what the flag needs — refusing, with the
//! recording command named, when it does not — and which routing the replay feeds: for
//! `--route-ahead N` from a trace recorded without it, the routing committed from the recorded
//! horizon-`N` predictions (`RouteTrace::commit_predictions`).

use crate::error::SimError;
use crate::plan::PlanStep;
use bmoe_core::config::RunConfig;
use bmoe_core::records::{Phase, RecordSink, RouteRecord, PRED_HORIZON_MAX};
use bmoe_core::telemetry::route_trace::{PredColumns, RouteTrace};

/// Horizons `--predict-log` records and scores (the stale-gate line and the stale-2 line).
pub const PREDICT_LOG_HORIZONS: u8 = bmoe_core::telemetry::route_trace::STALE_GATE_HORIZONS;

/// The command that records the stale-gate predictions (`pred1..pred2`).
fn record_hint() -> String {
    format!(
        "bmoe-cli ... --route-trace T.csv --predict-log (records pred1..pred{PREDICT_LOG_HORIZONS})"
    )
}

/// The commands that record what `--route-ahead n` replays.
fn route_ahead_hint(n: u8) -> String {
    let exact = format!(
        "bmoe-cli ... --route-trace T.csv --route-ahead {n} (the committed routing itself)"
    );
    if n <= PREDICT_LOG_HORIZONS {
        format!(
            "{exact}, or {} from which the committed routing is approximated",
            record_hint()
        )
    } else {
        exact
    }
}

/// What a replay feeds the core when predictor flags are set.
#[derive(Debug)]
pub struct PredictorReplay {
    /// The trace to replay: the input, or for `--route-ahead N` from `pred<N>` columns the
    /// routing committed from those predictions.
    pub trace: RouteTrace,
    /// The prediction columns a `--route-trace` written by this replay declares.
    pub columns: PredColumns,
    /// Approximations the replay makes, to print before it runs.
    pub warnings: Vec<String>,
}

/// Check `cfg`'s predictor flags against what `trace` recorded and choose the routing to
/// replay. Refuses (`SimError::NeedsRecording`, naming the flag and the recording command):
/// `--predict-log` without `pred1..pred2`; `--predict-prefetch` without `pred1`;
/// `--route-ahead N` on a trace recorded with a different `--route-ahead`, or with neither
/// `route_ahead=N` nor a `pred<N>` column; and a `router_expert` column without the
/// `route_ahead=` key that says how early it committed.
pub fn resolve(cfg: &RunConfig, trace: RouteTrace) -> Result<PredictorReplay, SimError> {
    let recorded = trace.pred_columns();
    let mut warnings = Vec::new();
    if trace.has_router_expert_column() && recorded.route_ahead == 0 {
        return Err(SimError::NeedsRecording {
            flag: "the trace".into(),
            reason: "it has a router_expert column but no route_ahead=<N> key on its model line, \
                     so how early its routing was committed is unknown"
                .into(),
            record_with: "bmoe-cli ... --route-trace T.csv --route-ahead N".into(),
        });
    }
    if cfg.predict_log && recorded.horizons < PREDICT_LOG_HORIZONS {
        return Err(SimError::NeedsRecording {
            flag: "--predict-log".into(),
            reason: format!(
                "it scores the stale-gate predictor one and two layers early, which needs the \
                 router applied to hidden states the simulator does not have; this trace records \
                 {} prediction horizon(s), pred1..pred{PREDICT_LOG_HORIZONS} are needed",
                recorded.horizons
            ),
            record_with: record_hint(),
        });
    }
    if cfg.predict_prefetch {
        if recorded.horizons < 1 {
            return Err(SimError::NeedsRecording {
                flag: "--predict-prefetch".into(),
                reason: "the stale-gate predictor applies the next layer's router to this \
                         layer's hidden state, which the simulator does not have, and this trace \
                         records no predictions (no pred1 column)"
                    .into(),
                record_with: record_hint(),
            });
        }
        if recorded.horizons < 2 {
            warnings.push(
                "bmoe-sim: WARNING: --predict-prefetch: the trace records only pred1; \
                 predictions two layers early are not replayed (record with --predict-log for pred2)"
                    .to_string(),
            );
        }
    }
    let n = cfg.route_ahead;
    if n == 0 {
        if recorded.route_ahead > 0 {
            warnings.push(format!(
                "bmoe-sim: WARNING: the trace was recorded with --route-ahead {m}: its expert \
                 column is the routing committed {m} layers early, and this replay (without \
                 --route-ahead) reads exactly that routing",
                m = recorded.route_ahead
            ));
        }
        return Ok(PredictorReplay {
            columns: recorded,
            trace,
            warnings,
        });
    }
    let flag = format!("--route-ahead {n}");
    // validate() bounds --route-ahead by ROUTE_AHEAD_MAX = PRED_HORIZON_MAX.
    let Some(n8) = u8::try_from(n)
        .ok()
        .filter(|&h| usize::from(h) <= PRED_HORIZON_MAX)
    else {
        return Err(SimError::invalid(
            "--route-ahead",
            format!("{n} is above {PRED_HORIZON_MAX}"),
        ));
    };
    if recorded.route_ahead == n8 {
        // The expert column already holds the committed routing; `predict` replays it.
        return Ok(PredictorReplay {
            columns: recorded,
            trace,
            warnings,
        });
    }
    if recorded.route_ahead > 0 {
        return Err(SimError::NeedsRecording {
            flag,
            reason: format!(
                "the trace was recorded with --route-ahead {m}: its routing is already committed \
                 {m} layers early, and the router's own choices a different depth would start \
                 from are not the ones a run at that depth would have made",
                m = recorded.route_ahead
            ),
            record_with: route_ahead_hint(n8),
        });
    }
    match trace.commit_predictions(n8) {
        Some(committed) => {
            warnings.push(format!(
                "bmoe-sim: WARNING: {flag} replayed from the trace's pred{n} predictions: each \
                 predicted routing is committed as is, but in a real --route-ahead run the hidden \
                 states after a committed layer differ, so its later routings and predictions \
                 would too (record with --route-ahead {n} for the exact run)"
            ));
            Ok(PredictorReplay {
                columns: committed.pred_columns(),
                trace: committed,
                warnings,
            })
        }
        None => Err(SimError::NeedsRecording {
            flag,
            reason: format!(
                "route-ahead commits the routing layer L's router predicts from the hidden state \
                 {n} layer(s) earlier, which the simulator does not have; this trace records {} \
                 prediction horizon(s) and no route-ahead routing",
                recorded.horizons
            ),
            record_with: route_ahead_hint(n8),
        }),
    }
}

/// What `--route-ahead` did in one replayed decode step, read from the trace: the routings it
/// committed (cells with `router_expert`), those it passed through (every other routing of
/// the step), the committed slots and how many of them the router also chose.
///
/// The replay needs this because the core's commit re-weights the prediction with the
/// router's full probabilities, which no trace carries, so in a replay it passes every routing
/// through — while the routing `TraceBackend::route` feeds is already the committed one. The
/// step's route-ahead counters are therefore taken from the trace.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteAheadTally {
    pub committed: u64,
    pub passthrough: u64,
    pub slots: u64,
    pub agreed_slots: u64,
}

/// The `RouteAheadTally` of plan step `step` (a decode step) at routing width `k` (the
/// applied `--n-expert-used`; a narrower width commits the prediction's first `k` and is
/// compared with the router's first `k`). One routing per MoE layer: the step's last row.
pub fn route_ahead_tally(trace: &RouteTrace, step: &PlanStep, k: usize) -> RouteAheadTally {
    let mut t = RouteAheadTally::default();
    for moe in 0..trace.preamble.layers.len() {
        // layers.len() <= n_layer <= u16::MAX (checked by the reader).
        let rows = step.layer_rows(moe as u16);
        let Some(row) = rows.iter().max_by_key(|r| r.batch_row) else {
            continue;
        };
        let Some(cell) = trace.cells.get(row.cell as usize) else {
            continue;
        };
        if !trace.is_committed(cell) {
            t.passthrough += 1;
            continue;
        }
        let width = k.min(usize::from(cell_width(trace, cell)));
        t.committed += 1;
        t.slots += width as u64;
        let committed = &trace.cell_slots(cell)[..width];
        let router: Vec<u32> = (0..width)
            .filter_map(|slot| trace.slot_router_expert(cell, slot))
            .collect();
        t.agreed_slots += committed
            .iter()
            .filter(|s| router.contains(&s.expert))
            .count() as u64;
    }
    t
}

fn cell_width(trace: &RouteTrace, cell: &bmoe_core::telemetry::route_trace::RouteCell) -> u16 {
    // A cell has n_expert_used <= u16::MAX slots (checked by the reader).
    trace.cell_slots(cell).len() as u16
}

fn phase_code(p: Phase) -> u8 {
    match p {
        Phase::Prefill => 0,
        Phase::Decode => 1,
    }
}

/// A route-trace sink that stamps each record with what the replayed trace recorded for its
/// slot — the predictions (`pred<h>`) and the router's own choice (`router_expert`) — before
/// passing it on. The replay's predictions *are* the recorded ones, and the router's own choice
/// is a fact only the trace knows (the core sees the committed routing as the router's), so the
/// replay's `--route-trace` carries them verbatim whatever the core itself filled in.
pub struct RecordedPredictions<'a> {
    trace: &'a RouteTrace,
    inner: &'a mut dyn RecordSink,
}

impl<'a> RecordedPredictions<'a> {
    /// Wrap `inner`, stamping records from `trace` (the trace being replayed).
    pub fn new(trace: &'a RouteTrace, inner: &'a mut dyn RecordSink) -> Self {
        RecordedPredictions { trace, inner }
    }

    fn stamp(&self, r: &RouteRecord) -> RouteRecord {
        let mut out = r.clone();
        out.preds = [None; PRED_HORIZON_MAX];
        out.router_expert = None;
        let key = (r.turn, phase_code(r.phase), r.step, r.layer);
        let found = self.trace.cells.binary_search_by(|c| {
            (c.turn, phase_code(c.phase), c.step, u32::from(c.moe_layer)).cmp(&key)
        });
        if let Ok(i) = found {
            let cell = &self.trace.cells[i];
            let slot = r.slot as usize;
            for (h, p) in out.preds.iter_mut().enumerate() {
                *p = self.trace.slot_pred(cell, slot, h + 1);
            }
            out.router_expert = self.trace.slot_router_expert(cell, slot);
        }
        out
    }
}

impl RecordSink for RecordedPredictions<'_> {
    fn wants_routes(&self) -> bool {
        self.inner.wants_routes()
    }
    fn wants_io(&self) -> bool {
        self.inner.wants_io()
    }
    fn begin_step(&mut self, turn: u32, phase: bmoe_core::records::Phase) {
        self.inner.begin_step(turn, phase);
    }
    fn step_rows(&mut self, seqs: &[u32]) {
        self.inner.step_rows(seqs);
    }
    fn route(&mut self, r: &RouteRecord) {
        let stamped = self.stamp(r);
        self.inner.route(&stamped);
    }
    fn io(&mut self, r: &bmoe_core::records::IoRecord) {
        self.inner.io(r);
    }
    fn end_turn(&mut self, turn: u32, tokens: u32, speculating: bool) {
        self.inner.end_turn(turn, tokens, speculating);
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use bmoe_core::telemetry::route_trace::{RoutePreamble, RouteTraceWriter, TraceLayer};

    pub(crate) const N_EXPERT: u32 = 8;
    /// Decode steps of the synthetic trace (its prefill is steps 0..3).
    pub(crate) const DECODE: std::ops::Range<i64> = 3..9;

    /// The router's routing of (step, layer): two distinct experts.
    pub(crate) fn router_ids(step: i64, layer: u32) -> [u32; 2] {
        let first = (3 * step as u32 + 5 * layer) % N_EXPERT;
        [first, (first + 1 + step as u32 % 3) % N_EXPERT]
    }

    /// The synthetic stale-gate prediction of (step, layer) at horizon `h`.
    pub(crate) fn pred_ids(step: i64, layer: u32, h: u8) -> [u16; 2] {
        let first = router_ids(step, layer)[0] + u32::from(h);
        [(first % N_EXPERT) as u16, ((first + 2) % N_EXPERT) as u16]
    }

    /// A one-turn trace (prefill of 3 tokens, 6 decode steps) over 3 MoE layers of 8
    /// experts, top-2, with the prediction columns `columns` declares, filled where the engine
    /// fills them: decode only, from the second decode token, at layers >= the horizon. With
    /// `route_ahead = N` the same cells of layers >= N are committed to the horizon-N
    /// prediction, the router's choice kept in `router_expert`.
    pub(crate) fn synthetic_text(columns: PredColumns) -> String {
        let pre = RoutePreamble {
            model: "synthetic.gguf".into(),
            arch: "qwen3moe".into(),
            n_layer: 3,
            n_expert: N_EXPERT,
            n_expert_used: 2,
            gating: bmoe_core::Gating::default(),
            layers: (0..3)
                .map(|layer| TraceLayer {
                    layer,
                    expert_bytes: 1 << 20,
                    dense_bytes: 1 << 20,
                    proj: vec![],
                })
                .collect(),
            notes: vec![],
            extra: vec![],
        };
        let mut w = RouteTraceWriter::with_predictions(Vec::new(), &pre, columns).expect("vec");
        for step in 0..DECODE.end {
            let phase = if DECODE.contains(&step) {
                Phase::Decode
            } else {
                Phase::Prefill
            };
            for layer in 0..3u32 {
                let router = router_ids(step, layer);
                let predicted = phase == Phase::Decode && step > DECODE.start;
                let committed =
                    predicted && columns.route_ahead > 0 && layer >= u32::from(columns.route_ahead);
                for slot in 0..2usize {
                    let mut preds = [None; PRED_HORIZON_MAX];
                    for h in 1..=columns.horizons {
                        if predicted && layer >= u32::from(h) {
                            let w = [0.625, 0.375][slot];
                            preds[usize::from(h) - 1] = Some((pred_ids(step, layer, h)[slot], w));
                        }
                    }
                    let expert = if committed {
                        u32::from(pred_ids(step, layer, columns.route_ahead)[slot])
                    } else {
                        router[slot]
                    };
                    w.write(&RouteRecord {
                        turn: 0,
                        phase,
                        step,
                        layer,
                        slot: slot as u32,
                        expert,
                        weight: [0.75, 0.25][slot],
                        residency: 0,
                        expert_bytes: 0,
                        dropped: false,
                        preds,
                        row: 0,
                        router_expert: committed.then_some(router[slot]),
                    })
                    .expect("row");
                }
            }
        }
        String::from_utf8(w.finish().expect("vec")).expect("utf8")
    }

    pub(crate) fn synthetic(columns: PredColumns) -> RouteTrace {
        RouteTrace::parse(&synthetic_text(columns)).expect("synthetic trace parses")
    }

    fn cfg(predict_log: bool, predict_prefetch: bool, route_ahead: u32) -> RunConfig {
        RunConfig {
            predict_log,
            predict_prefetch,
            route_ahead,
            ..RunConfig::default()
        }
    }

    fn refusal(cfg: &RunConfig, trace: RouteTrace) -> String {
        match resolve(cfg, trace) {
            Err(e @ SimError::NeedsRecording { .. }) => e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    const H2: PredColumns = PredColumns {
        horizons: 2,
        route_ahead: 0,
    };

    #[test]
    fn a_trace_without_predictions_refuses_the_hidden_state_predictors() {
        let plain = || synthetic(PredColumns::NONE);
        let e = refusal(&cfg(true, false, 0), plain());
        assert!(e.starts_with("--predict-log cannot be replayed"), "{e}");
        assert!(e.contains("--route-trace T.csv --predict-log"), "{e}");
        let e = refusal(&cfg(false, true, 0), plain());
        assert!(
            e.starts_with("--predict-prefetch cannot be replayed"),
            "{e}"
        );
        assert!(e.contains("no pred1 column"), "{e}");
        assert!(e.contains("--predict-log"), "{e}");
        let e = refusal(&cfg(false, false, 4), plain());
        assert!(e.starts_with("--route-ahead 4 cannot be replayed"), "{e}");
        assert!(e.contains("--route-trace T.csv --route-ahead 4"), "{e}");
        // Nothing asked, nothing refused, the trace unchanged.
        let r = resolve(&cfg(false, false, 0), plain()).expect("plain replay");
        assert_eq!(r.columns, PredColumns::NONE);
        assert!(r.warnings.is_empty());
        assert_eq!(r.trace, plain());
    }

    #[test]
    fn recorded_predictions_enable_the_predictors() {
        let r = resolve(&cfg(true, false, 0), synthetic(H2)).expect("predict-log");
        assert_eq!(r.columns, H2);
        assert!(r.warnings.is_empty());
        let r = resolve(&cfg(false, true, 0), synthetic(H2)).expect("predict-prefetch");
        assert!(r.warnings.is_empty());
        let h1 = PredColumns {
            horizons: 1,
            route_ahead: 0,
        };
        let r = resolve(&cfg(false, true, 0), synthetic(h1)).expect("pred1 suffices");
        assert!(r.warnings[0].contains("only pred1"), "{:?}", r.warnings);
        let e = refusal(&cfg(true, false, 0), synthetic(h1));
        assert!(e.contains("pred1..pred2 are needed"), "{e}");
    }

    #[test]
    fn route_ahead_from_predictions_commits_them_and_says_it_approximates() {
        let r = resolve(&cfg(false, false, 2), synthetic(H2)).expect("pred2");
        assert_eq!(
            r.columns,
            PredColumns {
                horizons: 2,
                route_ahead: 2
            }
        );
        assert!(r.warnings[0].contains("hidden states"), "{:?}", r.warnings);
        // (Debug strings: committed routings carry nan weights, and nan != nan.)
        assert!(
            format!("{:?}", Some(r.trace)) == format!("{:?}", synthetic(H2).commit_predictions(2)),
            "the committed routing is the recorded pred2"
        );
        let e = refusal(&cfg(false, false, 3), synthetic(H2));
        assert!(e.starts_with("--route-ahead 3 cannot be replayed"), "{e}");
        assert!(e.contains("2 prediction horizon(s)"), "{e}");
    }

    #[test]
    fn a_route_ahead_trace_replays_only_at_its_own_depth() {
        let ra2 = || {
            synthetic(PredColumns {
                horizons: 0,
                route_ahead: 2,
            })
        };
        let r = resolve(&cfg(false, false, 2), ra2()).expect("same depth");
        assert_eq!(r.trace, ra2(), "the expert column is already committed");
        assert!(r.warnings.is_empty());
        let e = refusal(&cfg(false, false, 1), ra2());
        assert!(e.contains("recorded with --route-ahead 2"), "{e}");
        let r = resolve(&cfg(false, false, 0), ra2()).expect("plain replay of it");
        assert!(
            r.warnings[0].contains("--route-ahead 2"),
            "{:?}",
            r.warnings
        );
        // A router_expert column without the depth key cannot be judged.
        let text = synthetic_text(PredColumns {
            horizons: 0,
            route_ahead: 2,
        })
        .replace(" route_ahead=2", "");
        let e = refusal(
            &cfg(false, false, 0),
            RouteTrace::parse(&text).expect("parses"),
        );
        assert!(e.contains("no route_ahead=<N> key"), "{e}");
    }

    #[test]
    fn route_ahead_counts_come_from_the_trace() {
        let ra1 = synthetic(PredColumns {
            horizons: 0,
            route_ahead: 1,
        });
        let plan = crate::plan::ReplayPlan::new(&ra1).expect("plan");
        let decode: Vec<&PlanStep> = plan
            .steps
            .iter()
            .filter(|s| s.phase == Phase::Decode)
            .collect();
        assert_eq!(decode.len(), DECODE.count());
        // The first decode token passes every layer through.
        assert_eq!(
            route_ahead_tally(&ra1, decode[0], 2),
            RouteAheadTally {
                committed: 0,
                passthrough: 3,
                slots: 0,
                agreed_slots: 0
            }
        );
        let mut total = RouteAheadTally::default();
        for step in &decode[1..] {
            let t = route_ahead_tally(&ra1, step, 2);
            // Layer 0 passes through; layers 1 and 2 commit.
            assert_eq!((t.committed, t.passthrough, t.slots), (2, 1, 4));
            total.agreed_slots += t.agreed_slots;
        }
        // Recount agreement from the generator: pred_ids vs router_ids.
        let expected: u64 = DECODE
            .skip(1)
            .flat_map(|step| (1..3u32).map(move |layer| (step, layer)))
            .map(|(step, layer)| {
                let router = router_ids(step, layer);
                pred_ids(step, layer, 1)
                    .iter()
                    .filter(|&&e| router.contains(&u32::from(e)))
                    .count() as u64
            })
            .sum();
        assert_eq!(total.agreed_slots, expected);
        // Width 1: the first slot only.
        let t = route_ahead_tally(&ra1, decode[1], 1);
        assert_eq!((t.committed, t.slots), (2, 2));
        // A trace that committed nothing passes everything through.
        let plain = synthetic(PredColumns::NONE);
        let plan = crate::plan::ReplayPlan::new(&plain).expect("plan");
        let step = plan.steps.last().expect("a step");
        assert_eq!(route_ahead_tally(&plain, step, 2).passthrough, 3);
    }

    #[derive(Default)]
    struct Collect(Vec<RouteRecord>);
    impl RecordSink for Collect {
        fn wants_routes(&self) -> bool {
            true
        }
        fn route(&mut self, r: &RouteRecord) {
            self.0.push(r.clone());
        }
    }

    #[test]
    fn the_replayed_route_trace_carries_the_recorded_predictions() {
        let trace = synthetic(H2).commit_predictions(2).expect("pred2");
        let mut inner = Collect::default();
        {
            let mut sink = RecordedPredictions::new(&trace, &mut inner);
            assert!(sink.wants_routes());
            for r in trace.records() {
                // What the core hands the sink: no predictions, no router choice.
                sink.route(&RouteRecord {
                    preds: [None; PRED_HORIZON_MAX],
                    row: 0,
                    router_expert: None,
                    ..r
                });
            }
        }
        assert_eq!(
            format!("{:?}", inner.0),
            format!("{:?}", trace.records().collect::<Vec<_>>())
        );
        assert!(inner.0.iter().any(|r| r.router_expert.is_some()));
        assert!(inner.0.iter().any(|r| r.preds[1].is_some()));
    }
}
