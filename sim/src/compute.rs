//! The compute model: the simulator's implementation of the core's `Backend`.
//!
//! Routing comes from the route trace (the ids and weights each (step, layer) cell recorded,
//! prefill cells with many tokens included, and the last layer's single prefill row); time
//! comes from a small model charged to the virtual clock:
//!
//! - `dense(layer)`: `layer_fixed_us + dense_bytes(layer) / dense_mib_per_s`;
//! - `expert(...)`: `expert_fixed_us + expert_bytes(layer) / expert_mib_per_s`;
//! - `head()`: `head_ms` (the final norm and output head, plus any other fixed per-step cost);
//! - a batch of n rows costs `1 + (n − 1)·batch_row_factor` times one row (dense: the step's
//!   tokens; an expert: the rows routed to it);
//! - `release(slot)`: `release_us + release_us_per_mib × expert MiB` per eviction — the
//!   cache-management cost of churn (freeing a slot's pages and committing the next one's),
//!   which is what makes churn-heavy policies lose on device;
//! - `loop_gap()`: `loop_overhead_ms` between two decode steps (sampling, detokenisation);
//! - the CPU the I/O lanes take from the kernels: `read_cpu_us` per read submitted plus
//!   `read_cpu_us_per_mib` per MiB it reads, charged to the next compute call after the read
//!   was submitted (a `ReadMeter` shared with the flash model counts them). On a machine whose
//!   lanes share the kernels' cores (O_DIRECT submission, completion, copies, checksums), the
//!   measured compute per token grows with the read volume; without this term a profile
//!   calibrated at one read volume is fast at a larger one and slow at a smaller one.
//! - the same contention as a slowdown instead (`read_slowdown`, what `calibrate` fits for
//!   runs of one model shape): a kernel runs `1 + read_slowdown` times slower over the part of
//!   it during which the flash model has reads in flight (`SharedFlash::kernel_end`). It
//!   costs nothing for reads that run while the kernels wait, so compute per token stops
//!   growing once the reads cover every kernel of a layer, as the engine's does on two cores
//!   (7.4 ms at 1.3 MiB read per token, 10.5 at 15, 11.1-11.4 from 25 to 46 MiB).
//!
//! Predictions (`Backend::predict`) are replayed from the trace's `pred<h>` columns (or, for
//! a `--route-ahead` trace, its committed routing) and cost no modelled time: the engine's
//! prediction GEMVs are not measured separately in a run this model is calibrated from, so
//! their cost is **not modelled** (it stays inside whatever the calibration attributes to
//! dense compute).
//!
//! Each charge is scaled by `1 + jitter·u`, `u` uniform in [-1, 1], from a seeded
//! `rand_chacha` stream of its own. Dense bytes of a layer the trace does not list (a dense
//! layer such as DeepSeek's layer 0) are the mean of the listed layers'.

use crate::clock::VirtualClock;
use crate::error::SimError;
use crate::flash::SharedFlash;
use crate::plan::ReplayPlan;
use bmoe_core::telemetry::route_trace::RouteTrace;
use bmoe_core::{
    Backend, Clock, ExpertLayout, ExpertUse, LayerId, Nanos, Prediction, Routing, RoutingError,
    SlotId,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use thiserror::Error;

/// The `rand_chacha` stream the compute model draws its jitter from.
pub const COMPUTE_JITTER_STREAM: u64 = 2;

const MIB_F: f64 = (1u64 << 20) as f64;

/// Timing parameters of the compute side (one `compute` object of a device profile).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeParams {
    /// Rate at which a layer's dense weights are processed for one token, MiB/s; 0 = no
    /// per-byte cost.
    pub dense_mib_per_s: f64,
    /// Rate at which one expert's weights are processed for one row, MiB/s; 0 = no per-byte
    /// cost.
    pub expert_mib_per_s: f64,
    /// Fixed cost of every model layer per step, microseconds.
    #[serde(default)]
    pub layer_fixed_us: f64,
    /// Fixed cost of every expert computed, microseconds.
    #[serde(default)]
    pub expert_fixed_us: f64,
    /// Final norm and output head (and other fixed per-step cost), milliseconds.
    #[serde(default)]
    pub head_ms: f64,
    /// Each extra row of a batch costs this fraction of the first row (0 = batching is free,
    /// 1 = rows cost the same as separate steps).
    #[serde(default = "one")]
    pub batch_row_factor: f64,
    /// Cache-management cost of one eviction (`Backend::release`), microseconds.
    #[serde(default)]
    pub release_us: f64,
    /// Cache-management cost of one eviction per MiB of the evicted expert (freeing and
    /// re-committing its pages), microseconds.
    #[serde(default)]
    pub release_us_per_mib: f64,
    /// Time between two decode steps (sampling, detokenisation), milliseconds.
    #[serde(default)]
    pub loop_overhead_ms: f64,
    /// CPU the I/O lanes take from the kernels per read submitted, microseconds (charged to
    /// compute; 0 in profiles written before it existed).
    #[serde(default)]
    pub read_cpu_us: f64,
    /// CPU the I/O lanes take from the kernels per MiB read, microseconds.
    #[serde(default)]
    pub read_cpu_us_per_mib: f64,
    /// How much slower a kernel runs while any lane has a read to serve: the part of a kernel
    /// that overlaps reads takes `1 + read_slowdown` times its time alone (the lanes' threads
    /// take the kernels' cores). Unlike the per-read charge above it costs nothing for reads
    /// that run while the kernels wait, so it stops growing once the reads cover every kernel
    /// of a layer — as the engine's compute per token does. 0 = off (and in profiles written
    /// before it existed).
    #[serde(default)]
    pub read_slowdown: f64,
    /// Relative jitter in [0, 1): 0 = none.
    #[serde(default)]
    pub jitter: f64,
}

fn one() -> f64 {
    1.0
}

impl ComputeParams {
    /// Check every field: finite and non-negative, `batch_row_factor` in [0, 1], jitter in
    /// [0, 1).
    pub fn validate(&self, profile: &str) -> Result<(), SimError> {
        let fields = [
            ("dense_mib_per_s", self.dense_mib_per_s),
            ("expert_mib_per_s", self.expert_mib_per_s),
            ("layer_fixed_us", self.layer_fixed_us),
            ("expert_fixed_us", self.expert_fixed_us),
            ("head_ms", self.head_ms),
            ("batch_row_factor", self.batch_row_factor),
            ("release_us", self.release_us),
            ("release_us_per_mib", self.release_us_per_mib),
            ("loop_overhead_ms", self.loop_overhead_ms),
            ("read_cpu_us", self.read_cpu_us),
            ("read_cpu_us_per_mib", self.read_cpu_us_per_mib),
            ("read_slowdown", self.read_slowdown),
            ("jitter", self.jitter),
        ];
        for (name, v) in fields {
            if !(v.is_finite() && v >= 0.0) {
                return Err(SimError::Profile {
                    name: profile.to_string(),
                    reason: format!("compute.{name}={v} must be a finite number >= 0"),
                });
            }
        }
        if self.batch_row_factor > 1.0 {
            return Err(SimError::Profile {
                name: profile.to_string(),
                reason: format!(
                    "compute.batch_row_factor={} must be in [0, 1]",
                    self.batch_row_factor
                ),
            });
        }
        if self.jitter >= 1.0 {
            return Err(SimError::Profile {
                name: profile.to_string(),
                reason: format!("compute.jitter={} must be in [0, 1)", self.jitter),
            });
        }
        Ok(())
    }

    /// Modelled time of one dense layer over `bytes` of dense weights for one row.
    pub fn dense_ns(&self, bytes: u64) -> f64 {
        self.layer_fixed_us * 1e3 + per_byte_ns(bytes, self.dense_mib_per_s)
    }

    /// Modelled time of one expert of `bytes` for one row.
    pub fn expert_ns(&self, bytes: u64) -> f64 {
        self.expert_fixed_us * 1e3 + per_byte_ns(bytes, self.expert_mib_per_s)
    }

    /// Modelled management time of evicting an expert of `bytes`.
    pub fn release_ns(&self, bytes: u64) -> f64 {
        (self.release_us + self.release_us_per_mib * bytes as f64 / MIB_F) * 1e3
    }

    /// Modelled CPU the lanes take from the kernels for `reads` reads of `bytes` in all.
    pub fn read_cpu_ns(&self, reads: u64, bytes: u64) -> f64 {
        (self.read_cpu_us * reads as f64 + self.read_cpu_us_per_mib * bytes as f64 / MIB_F) * 1e3
    }

    /// Cost multiplier of a batch of `rows` rows.
    pub fn batch_factor(&self, rows: usize) -> f64 {
        1.0 + rows.saturating_sub(1) as f64 * self.batch_row_factor
    }
}

fn per_byte_ns(bytes: u64, mib_per_s: f64) -> f64 {
    if mib_per_s > 0.0 {
        bytes as f64 / (mib_per_s * MIB_F) * 1e9
    } else {
        0.0
    }
}

/// Reads submitted so far and their bytes, counted by the flash model and read by the compute
/// model (which charges their CPU to the kernels). Shared on one thread, like the clock.
#[derive(Clone, Debug, Default)]
pub struct ReadMeter(Rc<Cell<(u64, u64)>>);

impl ReadMeter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Count one read of `bytes`.
    pub fn add(&self, bytes: u64) {
        let (n, b) = self.0.get();
        self.0.set((n + 1, b.saturating_add(bytes)));
    }

    /// (reads, bytes) counted so far.
    pub fn get(&self) -> (u64, u64) {
        self.0.get()
    }
}

/// Why the trace backend refused a call: each is a broken replay contract.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum TraceBackendError {
    #[error("no step is set: call set_step before Engine::step")]
    NoStep,
    #[error("step {step} is not in the replay plan ({steps} steps)")]
    StepOutOfPlan { step: usize, steps: usize },
    #[error("routing from the trace: {0}")]
    Routing(#[from] RoutingError),
}

/// Replays a route trace's routings and charges the compute model to the virtual clock.
pub struct TraceBackend {
    clock: VirtualClock,
    params: ComputeParams,
    rng: ChaCha8Rng,
    /// Per model layer.
    dense_bytes: Vec<u64>,
    /// Per MoE layer.
    expert_bytes: Vec<u64>,
    trace: Arc<RouteTrace>,
    plan: Arc<ReplayPlan>,
    step: Option<usize>,
    n_tokens: usize,
    ids: Vec<u16>,
    weights: Vec<f32>,
    busy: Nanos,
    /// Reads the flash model counted, and how many of them were charged already.
    reads: Option<ReadMeter>,
    reads_charged: (u64, u64),
    /// The flash model, asked which reads are in flight while a kernel runs
    /// (`read_slowdown`).
    flash: Option<SharedFlash>,
}

impl TraceBackend {
    /// A backend replaying `plan` (built from `trace`) over `layout`, charging `params` to
    /// `clock`, with jitter drawn from `seed`.
    pub fn new(
        clock: VirtualClock,
        params: &ComputeParams,
        layout: &ExpertLayout,
        trace: Arc<RouteTrace>,
        plan: Arc<ReplayPlan>,
        seed: u64,
    ) -> Self {
        let listed: Vec<u64> = layout.layers().iter().map(|l| l.dense_bytes).collect();
        let mean = if listed.is_empty() {
            0
        } else {
            listed.iter().sum::<u64>() / listed.len() as u64
        };
        let dense_bytes = (0..layout.n_model_layers())
            .map(|m| {
                layout
                    .moe_index(m)
                    .and_then(|i| layout.layer(i))
                    .map_or(mean, |l| l.dense_bytes)
            })
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(COMPUTE_JITTER_STREAM);
        TraceBackend {
            clock,
            params: params.clone(),
            rng,
            dense_bytes,
            expert_bytes: (0..layout.n_moe_layers())
                .map(|m| layout.expert_bytes(m))
                .collect(),
            trace,
            plan,
            step: None,
            n_tokens: 0,
            ids: Vec::new(),
            weights: Vec::new(),
            busy: Nanos::ZERO,
            reads: None,
            reads_charged: (0, 0),
            flash: None,
        }
    }

    /// Slow the kernels by `read_slowdown` while `flash` has reads in flight.
    pub fn set_flash(&mut self, flash: SharedFlash) {
        self.flash = Some(flash);
    }

    /// Charge the lanes' CPU of the reads `meter` counts (the flash model's) to compute.
    pub fn set_read_meter(&mut self, meter: ReadMeter) {
        self.reads_charged = meter.get();
        self.reads = Some(meter);
    }

    /// Route the next `Engine::step` from plan step `index`.
    pub fn set_step(&mut self, index: usize) -> Result<(), TraceBackendError> {
        if index >= self.plan.steps.len() {
            return Err(TraceBackendError::StepOutOfPlan {
                step: index,
                steps: self.plan.steps.len(),
            });
        }
        self.step = Some(index);
        Ok(())
    }

    /// Charge the between-steps overhead to the clock and return it.
    pub fn loop_gap(&mut self) -> Nanos {
        let ns = self.params.loop_overhead_ms * 1e6;
        self.charge_ns(ns)
    }

    /// Modelled compute time charged so far (loop gaps excluded).
    pub fn busy(&self) -> Nanos {
        self.busy
    }

    fn charge_ns(&mut self, ns: f64) -> Nanos {
        if ns <= 0.0 {
            return Nanos::ZERO;
        }
        let d = Nanos(self.jittered(ns).round() as u64);
        self.clock.advance(d);
        d
    }

    /// `ns` scaled by this charge's jitter draw.
    fn jittered(&mut self, ns: f64) -> f64 {
        let factor = if self.params.jitter > 0.0 {
            1.0 + self.params.jitter * (self.rng.gen::<f64>() * 2.0 - 1.0)
        } else {
            1.0
        };
        ns * factor
    }

    fn charge_busy(&mut self, ns: f64) {
        let d = self.charge_ns(ns);
        self.busy += d;
    }

    /// A kernel's time plus the lanes' CPU taken since the last kernel (not charged to
    /// `release`, which the core times as cache management). With a slowdown while reading or
    /// a lane dispatch time in the profile the kernel runs through the flash model
    /// (`SharedFlash::kernel_end`), which slows it over the reads in flight and learns that the
    /// kernels hold the cores.
    fn charge_kernel(&mut self, ns: f64) {
        let ns = ns + self.pending_read_cpu_ns();
        let slowdown = self.params.read_slowdown;
        let shared = self
            .flash
            .clone()
            .filter(|f| slowdown > 0.0 || f.dispatches());
        match shared {
            Some(flash) if ns > 0.0 => {
                let work = self.jittered(ns);
                let t0 = self.clock.now();
                let end = flash.kernel_end(t0.0, work, slowdown);
                self.clock.advance_to(Nanos(end));
                self.busy += Nanos(end.saturating_sub(t0.0));
            }
            _ => self.charge_busy(ns),
        }
    }

    /// The lanes' CPU of the reads submitted since the last charge.
    fn pending_read_cpu_ns(&mut self) -> f64 {
        let Some(meter) = &self.reads else {
            return 0.0;
        };
        let (n, b) = meter.get();
        let (n0, b0) = self.reads_charged;
        self.reads_charged = (n, b);
        self.params
            .read_cpu_ns(n.saturating_sub(n0), b.saturating_sub(b0))
    }
}

impl Backend for TraceBackend {
    type Error = TraceBackendError;

    /// A recorded verify decode replays as the one step it was: its rows are priced as a
    /// batch and routed as recorded (the replayer says which drafts were confirmed).
    fn verifies_rows(&self) -> bool {
        true
    }

    fn begin(&mut self, tokens: &[u32], _positions: &[u32]) -> Result<(), Self::Error> {
        if self.step.is_none() {
            return Err(TraceBackendError::NoStep);
        }
        self.n_tokens = tokens.len();
        Ok(())
    }

    fn dense(&mut self, layer: u32) -> Result<(), Self::Error> {
        let bytes = self.dense_bytes.get(layer as usize).copied().unwrap_or(0);
        let ns = self.params.dense_ns(bytes) * self.params.batch_factor(self.n_tokens);
        self.charge_kernel(ns);
        Ok(())
    }

    fn route(&mut self, layer: LayerId, routing: &mut Routing) -> Result<(), Self::Error> {
        let index = self.step.ok_or(TraceBackendError::NoStep)?;
        let step = &self.plan.steps[index];
        for row in step.layer_rows(layer.moe) {
            let Some(cell) = self.trace.cells.get(row.cell as usize) else {
                continue;
            };
            self.ids.clear();
            self.weights.clear();
            for s in self.trace.cell_slots(cell) {
                // The trace reader checked expert < n_expert <= u16::MAX.
                self.ids.push(s.expert as u16);
                self.weights.push(s.weight);
            }
            routing.push_row(row.batch_row, &self.ids, &self.weights)?;
        }
        Ok(())
    }

    fn expert(
        &mut self,
        layer: LayerId,
        _expert: u16,
        _slot: SlotId,
        uses: &[ExpertUse],
    ) -> Result<(), Self::Error> {
        let bytes = self
            .expert_bytes
            .get(layer.moe as usize)
            .copied()
            .unwrap_or(0);
        let ns = self.params.expert_ns(bytes) * self.params.batch_factor(uses.len());
        self.charge_kernel(ns);
        Ok(())
    }

    fn finish_layer(&mut self, _layer: LayerId) -> Result<(), Self::Error> {
        Ok(())
    }

    fn head(&mut self) -> Result<(), Self::Error> {
        let ns = self.params.head_ms * 1e6;
        self.charge_kernel(ns);
        Ok(())
    }

    /// Replays what the recorded run predicted for the batch's last row at `target` in this
    /// step: horizon `h = target.moe − from.moe`. `h = 0` (the control) is the trace's own
    /// routing of `target` (the committed one in a route-ahead trace); `h > 0` the cell's
    /// `pred<h>` columns, or — in a trace recorded with `--route-ahead h` — the committed
    /// routing of a committed cell. `Ok(false)` where nothing was recorded, for `from` after
    /// `target`, or when `k` is wider than what was recorded; a narrower `k` (top-k override)
    /// keeps the first `k` in rank order weighted as the recorded gating would
    /// (`Gating::narrow`: renormalised for a normalising gating). Charges no time.
    fn predict(
        &mut self,
        from: LayerId,
        target: LayerId,
        k: usize,
        out: &mut Prediction,
    ) -> Result<bool, Self::Error> {
        out.clear();
        let index = self.step.ok_or(TraceBackendError::NoStep)?;
        if from.moe > target.moe || k == 0 {
            return Ok(false);
        }
        let step = &self.plan.steps[index];
        let Some(row) = step
            .layer_rows(target.moe)
            .iter()
            .max_by_key(|r| r.batch_row)
        else {
            return Ok(false);
        };
        let Some(cell) = self.trace.cells.get(row.cell as usize) else {
            return Ok(false);
        };
        let horizon = usize::from(target.moe - from.moe);
        let recorded_route_ahead = usize::from(self.trace.pred_columns().route_ahead);
        let use_routing = horizon == 0
            || (horizon == recorded_route_ahead
                && self.trace.is_committed(cell)
                && !self.trace.has_pred(cell, horizon));
        if use_routing {
            for s in self.trace.cell_slots(cell) {
                // The trace reader checked expert < n_expert <= u16::MAX.
                out.ids.push(s.expert as u16);
                out.weights.push(s.weight);
            }
        } else if !self.trace.cell_pred(cell, horizon, out) {
            return Ok(false);
        }
        if out.ids.len() < k {
            out.clear();
            return Ok(false);
        }
        if out.ids.len() > k {
            out.ids.truncate(k);
            out.weights.truncate(k);
            self.trace.preamble.gating.narrow(&mut out.weights, k);
        }
        Ok(true)
    }

    fn release(&mut self, slot: SlotId) -> Result<(), Self::Error> {
        let bytes = match slot {
            SlotId::Canonical(key) => self
                .expert_bytes
                .get(key.layer as usize)
                .copied()
                .unwrap_or(0),
            SlotId::Staging(_) => 0,
        };
        let ns = self.params.release_ns(bytes);
        self.charge_busy(ns);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> ComputeParams {
        ComputeParams {
            dense_mib_per_s: 1024.0,
            expert_mib_per_s: 2048.0,
            layer_fixed_us: 10.0,
            expert_fixed_us: 5.0,
            head_ms: 1.0,
            batch_row_factor: 0.25,
            release_us: 300.0,
            release_us_per_mib: 100.0,
            loop_overhead_ms: 2.0,
            read_cpu_us: 0.0,
            read_cpu_us_per_mib: 0.0,
            read_slowdown: 0.0,
            jitter: 0.0,
        }
    }

    #[test]
    fn formulas() {
        let p = params();
        // 1 MiB at 1 GiB/s = 1/1024 s.
        assert!((p.dense_ns(1 << 20) - (10_000.0 + 1e9 / 1024.0)).abs() < 1e-6);
        assert!((p.expert_ns(1 << 20) - (5_000.0 + 1e9 / 2048.0)).abs() < 1e-6);
        assert_eq!(p.batch_factor(1), 1.0);
        assert_eq!(p.batch_factor(5), 2.0);
        assert_eq!(p.batch_factor(0), 1.0);
        let free = ComputeParams {
            dense_mib_per_s: 0.0,
            ..p
        };
        assert_eq!(free.dense_ns(1 << 30), 10_000.0);
        assert!((params().release_ns(2 << 20) - 500_000.0).abs() < 1e-6);
    }

    #[test]
    fn params_are_checked() {
        assert!(params().validate("p").is_ok());
        for bad in [
            ComputeParams {
                head_ms: -1.0,
                ..params()
            },
            ComputeParams {
                batch_row_factor: 1.5,
                ..params()
            },
            ComputeParams {
                jitter: 1.0,
                ..params()
            },
            ComputeParams {
                expert_mib_per_s: f64::INFINITY,
                ..params()
            },
        ] {
            assert!(bad.validate("p").is_err(), "{bad:?}");
        }
    }

    mod predict {
        use super::*;
        use crate::plan::layout_from_preamble;
        use crate::predictions::tests::{pred_ids, router_ids, synthetic, DECODE};
        use bmoe_core::telemetry::route_trace::PredColumns;
        use bmoe_core::Clock;

        fn backend(columns: PredColumns) -> TraceBackend {
            let trace = synthetic(columns);
            let layout = layout_from_preamble(&trace.preamble).expect("layout");
            let plan = ReplayPlan::new(&trace).expect("plan");
            TraceBackend::new(
                VirtualClock::new(),
                &params(),
                &layout,
                Arc::new(trace),
                Arc::new(plan),
                0,
            )
        }

        /// The plan index of decode step `step` (the prefill is one plan step).
        fn plan_index(step: i64) -> usize {
            1 + (step - DECODE.start) as usize
        }

        fn layer(moe: u16) -> LayerId {
            LayerId {
                model: u32::from(moe),
                moe,
            }
        }

        fn ask(b: &mut TraceBackend, from: u16, target: u16, k: usize) -> Option<Prediction> {
            let mut p = Prediction::default();
            let found = b
                .predict(layer(from), layer(target), k, &mut p)
                .expect("predict");
            assert_eq!(
                found,
                !p.ids.is_empty(),
                "Ok(false) leaves the prediction empty"
            );
            found.then_some(p)
        }

        #[test]
        fn replays_the_recorded_horizons_and_the_control() {
            let mut b = backend(PredColumns {
                horizons: 2,
                route_ahead: 0,
            });
            let mut p = Prediction::default();
            assert_eq!(
                b.predict(layer(0), layer(1), 2, &mut p),
                Err(TraceBackendError::NoStep)
            );
            let step = DECODE.start + 2;
            b.set_step(plan_index(step)).expect("step");
            let clock_before = b.clock.now();
            for (from, target, h) in [(1, 2, 1u8), (0, 1, 1), (0, 2, 2)] {
                let p = ask(&mut b, from, target, 2).expect("recorded");
                assert_eq!(p.ids, pred_ids(step, u32::from(target), h).to_vec());
                assert_eq!(p.weights, vec![0.625, 0.375]);
            }
            assert_eq!(
                b.clock.now(),
                clock_before,
                "predictions cost no modelled time"
            );
            // The control is the trace's own routing.
            let p = ask(&mut b, 2, 2, 2).expect("control");
            let router: Vec<u16> = router_ids(step, 2).iter().map(|&e| e as u16).collect();
            assert_eq!(p.ids, router);
            assert_eq!(p.weights, vec![0.75, 0.25]);
            // Narrower than recorded (top-k override): the first k, renormalised.
            let p = ask(&mut b, 1, 2, 1).expect("k=1");
            assert_eq!(p.ids, vec![pred_ids(step, 2, 1)[0]]);
            assert_eq!(p.weights, vec![1.0]);
            // Nothing to replay: wider than recorded, backwards, the first decode token.
            assert!(ask(&mut b, 1, 2, 3).is_none());
            assert!(ask(&mut b, 2, 1, 2).is_none());
            b.set_step(plan_index(DECODE.start)).expect("first decode");
            assert!(ask(&mut b, 1, 2, 2).is_none(), "first decode token");
            assert!(ask(&mut b, 2, 2, 2).is_some(), "the control always");
        }

        #[test]
        fn without_pred_columns_only_the_control_is_known() {
            let mut b = backend(PredColumns::NONE);
            b.set_step(plan_index(DECODE.start + 2)).expect("step");
            assert!(ask(&mut b, 1, 2, 2).is_none());
            assert!(ask(&mut b, 1, 1, 2).is_some());
        }

        #[test]
        fn a_route_ahead_trace_predicts_its_committed_routing() {
            let mut b = backend(PredColumns {
                horizons: 0,
                route_ahead: 1,
            });
            let step = DECODE.start + 3;
            b.set_step(plan_index(step)).expect("step");
            let p = ask(&mut b, 1, 2, 2).expect("committed");
            assert_eq!(p.ids, pred_ids(step, 2, 1).to_vec());
            assert!(ask(&mut b, 0, 2, 2).is_none(), "horizon 2 was not recorded");
            b.set_step(plan_index(DECODE.start)).expect("first decode");
            assert!(
                ask(&mut b, 1, 2, 2).is_none(),
                "passed through: nothing committed"
            );
        }
    }
}
