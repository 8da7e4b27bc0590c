//! Seeded fault injection for both leaves' flash devices, and the retry that turns a
//! transient fault into a success.
//!
//! A `FaultPlan` says what goes wrong: EIO, short reads, latency spikes, torn data (bytes
//! changed after a read that reports success) and a stuck lane. A `FaultInjector` decides, read
//! by read, which fault (if any) a submitted request suffers. The decision depends only on the
//! plan's seed and the request's extent (shard, offset, length) — not on timing, lanes or
//! submission order — so the engine (real files, `engine/src/flash.rs`) and the simulator
//! (`sim/src/flash.rs`) spoil the same reads of the same run, serial or overlapped. The stuck
//! lane is the exception: it is a lane, stuck from its `after`-th read on.
//!
//! A fault is *transient* by default: only the first read of an extent can suffer it, so a
//! retry succeeds; with `persistent` every read of a faulted extent fails again. `RetryFlash`
//! resubmits a read that failed with EIO or a short read (up to `max_retries` times) and hands
//! the caller only the final outcome: a fault becomes a retried success or a reported error,
//! never different bytes. Timeouts are not retried: a read that never returned may still write
//! its destination, so the run must stop.
//!
//! Nothing here reads a clock or sleeps: the leaves apply spikes and stuck lanes in their own
//! time (real or virtual).

use crate::flash::{Flash, FlashError, ReadDone, ReadId, ReadRequest};
use std::collections::HashMap;
use thiserror::Error;

/// Retries of a read that failed with EIO or a short read, before the failure is reported.
pub const READ_RETRIES: u32 = 2;

/// What happens to one read.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum InjectedFault {
    /// The read fails with an I/O error.
    Eio,
    /// The device returns `got` bytes of the request's `len` (the read fails as short).
    Short { got: u64 },
    /// The read takes `ns` longer than it would.
    Spike { ns: u64 },
    /// The read never completes: its lane is stuck (the device reports a timeout).
    Stuck,
    /// The read succeeds but byte `at` of the request's bytes is changed (a torn or stale
    /// read): only checksums (`--verify-reads`) can catch it.
    Torn { at: u64 },
}

/// A seeded schedule of faults. Rates are per read, in [0, 1].
#[derive(Clone, Debug, PartialEq)]
pub struct FaultPlan {
    pub seed: u64,
    pub eio: f64,
    pub short: f64,
    pub spike: f64,
    /// Extra time of a spiked read, nanoseconds.
    pub spike_ns: u64,
    pub torn: f64,
    /// `(lane, after)`: every read on `lane` from its `after`-th (0-based) on never completes.
    pub stuck: Option<(u32, u64)>,
    /// Every read of a faulted extent fails, not only the first (a retry cannot help).
    pub persistent: bool,
}

impl Default for FaultPlan {
    fn default() -> Self {
        FaultPlan {
            seed: 0,
            eio: 0.0,
            short: 0.0,
            spike: 0.0,
            spike_ns: 20_000_000,
            torn: 0.0,
            stuck: None,
            persistent: false,
        }
    }
}

/// A fault specification that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("--inject-faults {spec}: {reason}")]
pub struct FaultSpecError {
    pub spec: String,
    pub reason: String,
}

impl FaultPlan {
    /// Parse `seed=N,eio=P,short=P,spike=P,spike-ms=M,torn=P,stuck=LANE@AFTER,persistent`
    /// (any subset, any order; rates in [0, 1], their sum at most 1).
    pub fn parse(spec: &str) -> Result<FaultPlan, FaultSpecError> {
        let err = |reason: String| FaultSpecError {
            spec: spec.to_string(),
            reason,
        };
        let mut plan = FaultPlan::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if item == "persistent" {
                plan.persistent = true;
                continue;
            }
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| err(format!("'{item}' is not key=value or 'persistent'")))?;
            let rate = |v: &str| -> Result<f64, FaultSpecError> {
                v.parse::<f64>()
                    .ok()
                    .filter(|r| (0.0..=1.0).contains(r))
                    .ok_or_else(|| err(format!("{k}={v}: expected a rate in [0, 1]")))
            };
            let int = |v: &str| -> Result<u64, FaultSpecError> {
                v.parse::<u64>()
                    .map_err(|_| err(format!("{k}={v}: expected a non-negative integer")))
            };
            match k {
                "seed" => plan.seed = int(v)?,
                "eio" => plan.eio = rate(v)?,
                "short" => plan.short = rate(v)?,
                "spike" => plan.spike = rate(v)?,
                "torn" => plan.torn = rate(v)?,
                "spike-ms" => {
                    plan.spike_ns = int(v)?
                        .checked_mul(1_000_000)
                        .ok_or_else(|| err(format!("spike-ms={v} is too large")))?
                }
                "stuck" => {
                    let (lane, after) = v.split_once('@').ok_or_else(|| {
                        err(format!("stuck={v}: expected LANE@AFTER (e.g. 1@20)"))
                    })?;
                    plan.stuck = Some((int(lane)? as u32, int(after)?));
                }
                _ => {
                    return Err(err(format!(
                        "unknown key '{k}' (expected seed, eio, short, spike, spike-ms, torn, stuck, persistent)"
                    )))
                }
            }
        }
        if plan.eio + plan.short + plan.spike + plan.torn > 1.0 {
            return Err(err("the rates add up to more than 1".into()));
        }
        Ok(plan)
    }

    /// True when the plan injects nothing.
    pub fn is_empty(&self) -> bool {
        self.eio == 0.0
            && self.short == 0.0
            && self.spike == 0.0
            && self.torn == 0.0
            && self.stuck.is_none()
    }
}

/// How many faults an injector has dealt, by kind.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub eio: u64,
    pub short: u64,
    pub spike: u64,
    pub stuck: u64,
    pub torn: u64,
}

impl FaultCounts {
    pub fn total(&self) -> u64 {
        self.eio + self.short + self.spike + self.stuck + self.torn
    }
}

/// Decides each read's fault from a plan. Owned by a leaf's device and asked at `submit`.
#[derive(Clone, Debug)]
pub struct FaultInjector {
    plan: FaultPlan,
    /// Reads per extent so far (a transient fault hits only the first).
    attempts: HashMap<(u16, u64, u64), u32>,
    /// Reads submitted per lane.
    per_lane: Vec<u64>,
    counts: FaultCounts,
}

impl FaultInjector {
    pub fn new(plan: FaultPlan) -> Self {
        FaultInjector {
            plan,
            attempts: HashMap::new(),
            per_lane: Vec::new(),
            counts: FaultCounts::default(),
        }
    }

    pub fn plan(&self) -> &FaultPlan {
        &self.plan
    }

    pub fn counts(&self) -> FaultCounts {
        self.counts
    }

    /// The fault `req` suffers, if any. Call once per submitted read, in submission order.
    pub fn on_submit(&mut self, req: &ReadRequest) -> Option<InjectedFault> {
        let lane = req.lane as usize;
        if self.per_lane.len() <= lane {
            self.per_lane.resize(lane + 1, 0);
        }
        let nth_on_lane = self.per_lane[lane];
        self.per_lane[lane] += 1;
        if let Some((stuck_lane, after)) = self.plan.stuck {
            if stuck_lane == req.lane && nth_on_lane >= after {
                self.counts.stuck += 1;
                return Some(InjectedFault::Stuck);
            }
        }
        let attempt = self
            .attempts
            .entry((req.shard, req.offset, req.len))
            .or_insert(0);
        *attempt += 1;
        if *attempt > 1 && !self.plan.persistent {
            return None;
        }
        let p = &self.plan;
        let h = splitmix64(
            splitmix64(p.seed ^ u64::from(req.shard).rotate_left(48))
                ^ splitmix64(req.offset)
                ^ req.len.rotate_left(20),
        );
        let u = (h >> 11) as f64 / (1u64 << 53) as f64;
        let (c, fault) = if u < p.eio {
            (&mut self.counts.eio, InjectedFault::Eio)
        } else if u < p.eio + p.short {
            (
                &mut self.counts.short,
                InjectedFault::Short { got: req.len / 2 },
            )
        } else if u < p.eio + p.short + p.spike {
            (
                &mut self.counts.spike,
                InjectedFault::Spike { ns: p.spike_ns },
            )
        } else if u < p.eio + p.short + p.spike + p.torn {
            (
                &mut self.counts.torn,
                InjectedFault::Torn {
                    at: splitmix64(h) % req.len.max(1),
                },
            )
        } else {
            return None;
        };
        *c += 1;
        Some(fault)
    }
}

/// The error an injected EIO or short read produces, as a device would report it.
pub fn injected_error(req: &ReadRequest, fault: InjectedFault) -> Option<FlashError> {
    match fault {
        InjectedFault::Eio => Some(FlashError::Io {
            shard: req.shard,
            offset: req.offset,
            len: req.len,
            message: "Input/output error (injected EIO)".into(),
        }),
        InjectedFault::Short { got } => Some(FlashError::Short {
            shard: req.shard,
            offset: req.offset,
            expected: req.len,
            got,
        }),
        _ => None,
    }
}

/// Whether a failed read is worth another attempt: a device error or a short read may be
/// transient; a timeout, a closed device or a bad request is not.
pub fn retryable(e: &FlashError) -> bool {
    matches!(e, FlashError::Io { .. } | FlashError::Short { .. })
}

#[derive(Copy, Clone, Debug)]
struct Attempt {
    inner: ReadId,
    req: ReadRequest,
    retries: u32,
}

/// A flash device that retries reads failing with EIO or a short read, up to `max_retries`
/// times each, and delivers only the final outcome under the id the caller was given. The
/// retried read lands the same bytes at the same destination, so a transient fault leaves
/// nothing behind; `retried()` counts the retries so a run can report them.
#[derive(Debug)]
pub struct RetryFlash<F> {
    inner: F,
    max_retries: u32,
    next: u64,
    by_outer: HashMap<u64, Attempt>,
    outer_of: HashMap<ReadId, u64>,
    retried: u64,
    recovered: u64,
    first_retry: Option<String>,
}

impl<F: Flash> RetryFlash<F> {
    pub fn new(inner: F, max_retries: u32) -> Self {
        RetryFlash {
            inner,
            max_retries,
            next: 0,
            by_outer: HashMap::new(),
            outer_of: HashMap::new(),
            retried: 0,
            recovered: 0,
            first_retry: None,
        }
    }

    pub fn inner(&self) -> &F {
        &self.inner
    }

    pub fn inner_mut(&mut self) -> &mut F {
        &mut self.inner
    }

    /// Reads resubmitted after a retryable failure.
    pub fn retried(&self) -> u64 {
        self.retried
    }

    /// Reads that failed, were retried, and then succeeded.
    pub fn recovered(&self) -> u64 {
        self.recovered
    }

    /// The first failure that was retried, for the report.
    pub fn first_retry(&self) -> Option<&str> {
        self.first_retry.as_deref()
    }

    /// Settle the outcome of attempt `inner` of read `outer`: `Some` final outcome, or `None`
    /// when it was resubmitted.
    fn settle(
        &mut self,
        outer: u64,
        outcome: Result<ReadDone, FlashError>,
    ) -> Option<Result<ReadDone, FlashError>> {
        let a = *self.by_outer.get(&outer)?;
        self.outer_of.remove(&a.inner);
        match outcome {
            Err(e) if retryable(&e) && a.retries < self.max_retries => {
                self.retried += 1;
                if self.first_retry.is_none() {
                    self.first_retry = Some(e.to_string());
                }
                let inner = self.inner.submit(a.req);
                self.outer_of.insert(inner, outer);
                self.by_outer.insert(
                    outer,
                    Attempt {
                        inner,
                        retries: a.retries + 1,
                        ..a
                    },
                );
                None
            }
            outcome => {
                self.by_outer.remove(&outer);
                if outcome.is_ok() && a.retries > 0 {
                    self.recovered += 1;
                }
                Some(outcome.map(|mut d| {
                    d.id = ReadId(outer);
                    d
                }))
            }
        }
    }
}

impl<F: Flash> Flash for RetryFlash<F> {
    fn lanes(&self) -> u32 {
        self.inner.lanes()
    }

    fn submit(&mut self, read: ReadRequest) -> ReadId {
        let outer = self.next;
        self.next += 1;
        let inner = self.inner.submit(read);
        self.outer_of.insert(inner, outer);
        self.by_outer.insert(
            outer,
            Attempt {
                inner,
                req: read,
                retries: 0,
            },
        );
        ReadId(outer)
    }

    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        loop {
            let Some(a) = self.by_outer.get(&id.0).copied() else {
                return Err(FlashError::UnknownRead { id });
            };
            let outcome = self.inner.wait(a.inner);
            if let Some(done) = self.settle(id.0, outcome) {
                return done;
            }
        }
    }

    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        loop {
            let (inner, outcome) = self.inner.poll()?;
            let Some(outer) = self.outer_of.get(&inner).copied() else {
                // Not ours to map: hand it up as is (the caller refuses unknown reads).
                return Some((inner, outcome));
            };
            if let Some(done) = self.settle(outer, outcome) {
                return Some((ReadId(outer), done));
            }
        }
    }

    fn cancel(&mut self, id: ReadId) -> bool {
        let Some(a) = self.by_outer.get(&id.0).copied() else {
            return false;
        };
        if self.inner.cancel(a.inner) {
            self.by_outer.remove(&id.0);
            self.outer_of.remove(&a.inner);
            true
        } else {
            false
        }
    }
}

/// What `FaultyFlash` does to its chosen read.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The read fails with an I/O error (EIO).
    Eio,
    /// The read reports a short read error: `got` bytes instead of the request.
    Short { got: u64 },
    /// The read "succeeds" but reports fewer bytes than requested, as a buggy device might:
    /// the step must catch it itself.
    SilentShort { got: u64 },
}

/// Wraps a device and spoils its `nth` submitted read (0-based) with `fault`.
#[derive(Debug)]
pub struct FaultyFlash<F> {
    inner: F,
    nth: u64,
    fault: Fault,
    submitted: u64,
    target: Option<ReadId>,
    target_req: Option<ReadRequest>,
    injected: bool,
}

impl<F: Flash> FaultyFlash<F> {
    /// Spoil read number `nth` (counting every `submit` from now, from 0) with `fault`.
    pub fn new(inner: F, nth: u64, fault: Fault) -> Self {
        FaultyFlash {
            inner,
            nth,
            fault,
            submitted: 0,
            target: None,
            target_req: None,
            injected: false,
        }
    }
    /// The wrapped device.
    pub fn inner(&self) -> &F {
        &self.inner
    }
    /// Whether the fault has been delivered.
    pub fn injected(&self) -> bool {
        self.injected
    }

    fn spoil(
        &mut self,
        id: ReadId,
        outcome: Result<ReadDone, FlashError>,
        req: Option<ReadRequest>,
    ) -> Result<ReadDone, FlashError> {
        if self.target != Some(id) {
            return outcome;
        }
        self.injected = true;
        let (shard, offset, len) = req.map_or((0, 0, 0), |r| (r.shard, r.offset, r.len));
        match self.fault {
            Fault::Eio => Err(FlashError::Io {
                shard,
                offset,
                len,
                message: "EIO (injected)".into(),
            }),
            Fault::Short { got } => Err(FlashError::Short {
                shard,
                offset,
                expected: len,
                got,
            }),
            Fault::SilentShort { got } => outcome.map(|mut d| {
                d.req_bytes = got.min(d.req_bytes);
                d
            }),
        }
    }
}

/// Requests are remembered so an injected error can name its extent.
impl<F: Flash> Flash for FaultyFlash<F> {
    fn lanes(&self) -> u32 {
        self.inner.lanes()
    }
    fn submit(&mut self, read: ReadRequest) -> ReadId {
        let id = self.inner.submit(read);
        if self.submitted == self.nth {
            self.target = Some(id);
            self.target_req = Some(read);
        }
        self.submitted += 1;
        id
    }
    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        let outcome = self.inner.wait(id);
        let req = self.target_req;
        self.spoil(id, outcome, req)
    }
    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        let (id, outcome) = self.inner.poll()?;
        let req = self.target_req;
        Some((id, self.spoil(id, outcome, req)))
    }
    fn cancel(&mut self, id: ReadId) -> bool {
        self.inner.cancel(id)
    }
    fn resident(&self) -> bool {
        self.inner.resident()
    }
}

/// SplitMix64: a tiny deterministic mixer for test data and scripted routings.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{ManualClock, MemFlash};
    use std::sync::Arc;

    fn req(offset: u64, len: u64, lane: u32) -> ReadRequest {
        crate::testing::read_request(lane, offset, len)
    }

    #[test]
    fn specs_parse_and_bad_ones_are_named() {
        let p = FaultPlan::parse(
            "seed=7,eio=0.1,short=0.05,spike=0.2,spike-ms=5,torn=0.01,stuck=1@20,persistent",
        )
        .unwrap();
        assert_eq!(p.seed, 7);
        assert_eq!(p.spike_ns, 5_000_000);
        assert_eq!(p.stuck, Some((1, 20)));
        assert!(p.persistent && !p.is_empty());
        assert!(FaultPlan::parse("").unwrap().is_empty());
        for bad in [
            "eio=2",
            "eio=x",
            "bogus=1",
            "stuck=3",
            "eio=0.6,short=0.6",
            "nokey",
        ] {
            let e = FaultPlan::parse(bad).unwrap_err();
            assert!(
                e.to_string()
                    .starts_with(&format!("--inject-faults {bad}:")),
                "{e}"
            );
        }
    }

    #[test]
    fn faults_depend_on_the_extent_not_the_order_and_transient_ones_hit_once() {
        let plan = FaultPlan::parse("seed=3,eio=0.3,short=0.2,spike=0.2,torn=0.1").unwrap();
        let reqs: Vec<ReadRequest> = (0..200)
            .map(|i| req(i * 4096, 4096, (i % 3) as u32))
            .collect();
        let mut a = FaultInjector::new(plan.clone());
        let fa: Vec<_> = reqs.iter().map(|r| a.on_submit(r)).collect();
        let mut b = FaultInjector::new(plan.clone());
        let mut fb: Vec<_> = reqs
            .iter()
            .rev()
            .map(|r| b.on_submit(&ReadRequest { lane: 2, ..*r }))
            .collect();
        fb.reverse();
        assert_eq!(fa, fb, "order and lane do not matter");
        let c = a.counts();
        assert!(
            c.eio > 30 && c.short > 20 && c.spike > 20 && c.torn > 5,
            "{c:?}"
        );
        // A second read of each extent is clean (transient), or faulted again (persistent).
        assert!(reqs.iter().all(|r| a.on_submit(r).is_none()));
        let mut p = FaultInjector::new(FaultPlan {
            persistent: true,
            ..plan
        });
        let first: Vec<_> = reqs.iter().map(|r| p.on_submit(r)).collect();
        let again: Vec<_> = reqs.iter().map(|r| p.on_submit(r)).collect();
        assert_eq!(first, again);
    }

    #[test]
    fn a_stuck_lane_sticks_from_its_nth_read() {
        let mut f = FaultInjector::new(FaultPlan::parse("stuck=1@2").unwrap());
        let got: Vec<_> = (0..8)
            .map(|i| f.on_submit(&req(i * 10, 10, (i % 2) as u32)))
            .collect();
        let stuck: Vec<usize> = got
            .iter()
            .enumerate()
            .filter(|(_, g)| **g == Some(InjectedFault::Stuck))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(stuck, vec![5, 7], "lane 1's reads 2 and 3");
    }

    /// A device that fails reads of chosen offsets a given number of times.
    struct Flaky {
        inner: MemFlash,
        fail: HashMap<u64, u32>,
        failing: HashMap<ReadId, ReadRequest>,
    }

    impl Flash for Flaky {
        fn lanes(&self) -> u32 {
            self.inner.lanes()
        }
        fn submit(&mut self, read: ReadRequest) -> ReadId {
            let id = self.inner.submit(read);
            if let Some(n) = self.fail.get_mut(&read.offset) {
                if *n > 0 {
                    *n -= 1;
                    self.failing.insert(id, read);
                }
            }
            id
        }
        fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
            let o = self.inner.wait(id);
            match self.failing.remove(&id) {
                Some(r) => Err(injected_error(&r, InjectedFault::Eio).unwrap()),
                None => o,
            }
        }
        fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
            let (id, o) = self.inner.poll()?;
            Some(match self.failing.remove(&id) {
                Some(r) => (
                    id,
                    Err(injected_error(&r, InjectedFault::Short { got: 1 }).unwrap()),
                ),
                None => (id, o),
            })
        }
        fn cancel(&mut self, id: ReadId) -> bool {
            self.inner.cancel(id)
        }
    }

    #[test]
    fn retry_turns_transient_failures_into_successes_and_gives_up_on_persistent_ones() {
        let shards = Arc::new(vec![vec![0u8; 1 << 16]]);
        let flaky = Flaky {
            inner: MemFlash::new(shards, 2, ManualClock::new()),
            fail: HashMap::from([(0, 1), (4096, 2), (8192, 5)]),
            failing: HashMap::new(),
        };
        let mut f = RetryFlash::new(flaky, 2);
        let a = f.submit(req(0, 100, 0));
        let b = f.submit(req(4096, 100, 1));
        let c = f.submit(req(8192, 100, 0));
        let d = f.submit(req(12288, 100, 1));
        assert_eq!(f.wait(b).map(|d| d.id), Ok(b), "two failures, two retries");
        assert!(
            matches!(f.wait(c), Err(FlashError::Io { .. })),
            "five failures"
        );
        // a and d by poll: a fails once (short via poll) and is retried.
        let mut got = Vec::new();
        while let Some((id, o)) = f.poll() {
            got.push((id, o.is_ok()));
        }
        got.sort();
        assert_eq!(got, vec![(a, true), (d, true)]);
        assert_eq!(f.retried(), 1 + 2 + 2);
        assert_eq!(f.recovered(), 2, "a and b");
        assert!(f.first_retry().is_some());
        assert_eq!(f.wait(a), Err(FlashError::UnknownRead { id: a }));
    }
}
