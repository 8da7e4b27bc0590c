//! Plain records that flow from the decode step to the telemetry writers: one routed
//! expert (a route-trace row) and one flash read (an io-trace row). Both the engine and the
//! simulator produce them through the same core code, which is what makes their traces
//! comparable.

/// Prefill (one batched step over the prompt) or decode (one token per step).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    Prefill = 0,
    Decode = 1,
}

/// One routed expert of one token at one MoE layer (a `route_trace v1` row).
#[derive(Clone, Debug, PartialEq)]
pub struct RouteRecord {
    pub turn: u32,
    pub phase: Phase,
    /// Absolute context position of the routed token.
    pub step: i64,
    /// The token's row in its step's batch (which sequence it belongs to, under
    /// `serve --parallel`, is the step's [`RecordSink::step_rows`]).
    pub row: u32,
    /// MoE layer index.
    pub layer: u32,
    /// Rank in the router's order, 0 = top choice.
    pub slot: u32,
    pub expert: u32,
    /// Final applied routing weight (NaN = unknown).
    pub weight: f32,
    /// 0 miss, 1 hit, 2 hit on a speculative prefetch's first touch.
    pub residency: u8,
    /// Flash bytes this routing read (0 unless it was the first miss of the expert).
    pub expert_bytes: u64,
    /// Discarded by cache-aware dropping.
    pub dropped: bool,
    /// Stale-gate predictions for this slot, recorded so the simulator can replay predictors
    /// that need hidden states (`pred<h>` / `pred<h>_weight` route-trace columns):
    /// `preds[h-1]` is the (expert, weight) this layer's router ranked at this slot when applied
    /// to the router input `h` MoE layers earlier; `None` where nothing was predicted (layer < h,
    /// prefill, the first decode token). All `None` when the run recorded no predictions.
    pub preds: [Option<(u16, f32)>; PRED_HORIZON_MAX],
    /// `--route-ahead`: the expert the router itself chose at this slot, when the routing in
    /// `expert` was committed from a prediction (`router_expert` column). `None` for a routing
    /// the router chose (passed through, or route-ahead off).
    pub router_expert: Option<u32>,
}

/// Widest prediction horizon a route trace records (= the `--route-ahead` maximum).
pub const PRED_HORIZON_MAX: usize = 8;

/// One flash read (an `io_trace v1` row).
#[derive(Clone, Debug, PartialEq)]
pub struct IoRecord {
    pub turn: u32,
    pub phase: Phase,
    pub step: i64,
    pub layer: u32,
    pub expert: u32,
    /// 0 gate, 1 up, 2 down (or the index in a fused layout).
    pub proj: u8,
    pub lane: u32,
    pub speculative: bool,
    pub offset: u64,
    pub req_bytes: u64,
    pub read_bytes: u64,
    pub latency_ns: u64,
}

/// Where the decode step sends per-routing and per-read records. Writers that are not
/// enabled simply ignore them; `wants_*` lets the step skip building records nobody reads.
pub trait RecordSink {
    fn wants_routes(&self) -> bool {
        false
    }
    fn wants_io(&self) -> bool {
        false
    }
    /// A step starts (before any of its records): a speculative run's route trace numbers
    /// its steps, so a verify decode's positions replay as the one step they were.
    fn begin_step(&mut self, _turn: u32, _phase: Phase) {}
    /// The sequence each batch row of the next step belongs to (`seqs[row]`), before it runs:
    /// sent by steps that decode several sequences together (the lanes of `serve --parallel`), so a route trace
    /// can say which sequence a routed token belongs to. Not sent otherwise.
    fn step_rows(&mut self, _seqs: &[u32]) {}
    fn route(&mut self, _r: &RouteRecord) {}
    fn io(&mut self, _r: &IoRecord) {}
    /// A turn ended, having generated `tokens` tokens, with speculation on or not: what a
    /// speculative run's route trace cannot say from its steps alone (a verify decode that
    /// met an end-of-generation token confirmed fewer rows than it fed; a turn whose steps
    /// each fed one row may or may not have been speculating).
    fn end_turn(&mut self, _turn: u32, _tokens: u32, _speculating: bool) {}
    /// Push everything recorded so far to its file. The generation loop calls it at every
    /// token boundary, so a file ends on a whole step whenever the run stops (an interrupt, a
    /// failure, even SIGKILL leaves at most one partial last line). A writer whose earlier
    /// write failed returns that failure here.
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A sink that drops everything.
pub struct NullSink;
impl RecordSink for NullSink {}
