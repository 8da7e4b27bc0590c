//! The flash model: the simulator's implementation of the core's `Flash` trait.
//!
//! A device with N lanes, each a FIFO queue. A read occupies its lane from the moment it
//! reaches the head of the queue until its bytes have landed: first a fixed per-request
//! latency (command and queueing overhead, no bandwidth used), then a transfer of its aligned
//! window (`read_bytes`: the O_DIRECT window `[floor(offset), ceil(offset + len))` to
//! `align_bytes`, exactly as the engine's lanes read). Transfers in progress share the device:
//! each moves at `min(lane rate, device rate / transfers in progress)` — a fluid
//! (processor-sharing) model, so one lane alone gets its full rate and many lanes together
//! saturate the device ceiling. Optional jitter scales each read's latency and transfer work by
//! `1 + jitter·u`, `u` uniform in [-1, 1], drawn from a seeded `rand_chacha` stream in
//! submission order. A read that reaches the head of its lane while the compute model's
//! kernels run (`kernel_end`, below) first waits `dispatch_us`: the lane's thread waiting for a
//! core the kernels hold. The compute model asks the same model (`SharedFlash`) which reads are
//! in flight while a kernel runs, to slow the kernel by `compute.read_slowdown` over them.
//!
//! The model is evaluated lazily: its own time trails the virtual clock and catches up (event
//! by event) whenever the core calls in, and `wait` advances the clock to the awaited read's
//! completion. Completions are ordered by (time, submission sequence), so ties depend only on
//! the inputs, and the same inputs and seed always give the same times.

use crate::clock::VirtualClock;
use crate::error::SimError;
use bmoe_core::faults::{injected_error, FaultCounts, FaultInjector, FaultPlan, InjectedFault};
use bmoe_core::{Clock, Flash, FlashError, Nanos, ReadDone, ReadId, ReadRequest};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::rc::Rc;

/// The `rand_chacha` stream the flash model draws its jitter from (the compute model uses
/// another), so turning one model's jitter on never changes the other's draws.
pub const FLASH_JITTER_STREAM: u64 = 1;

/// Timing parameters of a flash device (one `flash` object of a device profile).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlashParams {
    /// Fixed time per request before its bytes move, microseconds.
    pub read_latency_us: f64,
    /// One lane's transfer rate, MiB/s.
    pub lane_mib_per_s: f64,
    /// The device's rate shared by every lane, MiB/s.
    pub device_mib_per_s: f64,
    /// O_DIRECT alignment of the window a read pulls (the engine uses 4096); applied when the
    /// run reads with O_DIRECT, 1 byte otherwise.
    pub align_bytes: u64,
    /// Relative jitter in [0, 1): 0 = none.
    #[serde(default)]
    pub jitter: f64,
    /// The measured spread of read service times: multipliers of a read's modelled time
    /// (latency and transfer), one per evenly spaced quantile, mean 1 (`calibrate` writes them
    /// from an io trace). Each read draws one uniformly (seeded, stream 1) instead of the
    /// uniform jitter. A lane preempted for a few milliseconds gives a heavy tail, and a layer
    /// waits for its slowest read: the more reads a layer has, the more of the tail it meets,
    /// so the stall grows faster than the mean read time — which a mean rate alone misses.
    /// Empty (the default) = no spread beyond `jitter`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_quantiles: Vec<f64>,
    /// A lane's time to get to a read that reaches the head of its queue while the kernels
    /// hold the cores (the lane's thread waiting to be scheduled, then dequeuing and issuing),
    /// before the read's own service time starts, microseconds. A read that starts while the
    /// kernels wait for reads pays none: the lane finds a free core. The engine's io trace
    /// times a read from the moment its lane picked it up, so this time is in no read's
    /// latency, yet a layer whose reads queue behind one another while it computes pays it
    /// once per read. Only a replay whose compute model runs its kernels through
    /// `FlashModel::kernel_end` tells the lanes when the kernels run. 0 in profiles written
    /// before it existed.
    #[serde(default)]
    pub dispatch_us: f64,
}

/// At most this many `service_quantiles`.
pub const MAX_SERVICE_QUANTILES: usize = 1024;

impl FlashParams {
    /// Check every field is usable: positive finite rates, a non-negative finite latency, a
    /// power-of-two alignment, jitter in [0, 1).
    pub fn validate(&self, profile: &str) -> Result<(), SimError> {
        let bad = |reason: String| SimError::Profile {
            name: profile.to_string(),
            reason,
        };
        for (name, v) in [
            ("read_latency_us", self.read_latency_us),
            ("dispatch_us", self.dispatch_us),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(format!(
                    "flash.{name}={v} must be a finite number >= 0"
                )));
            }
        }
        for (name, v) in [
            ("lane_mib_per_s", self.lane_mib_per_s),
            ("device_mib_per_s", self.device_mib_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(format!("flash.{name}={v} must be a finite number > 0")));
            }
        }
        if self.align_bytes == 0 || !self.align_bytes.is_power_of_two() {
            return Err(bad(format!(
                "flash.align_bytes={} must be a power of two (1 = no alignment)",
                self.align_bytes
            )));
        }
        if !(self.jitter.is_finite() && (0.0..1.0).contains(&self.jitter)) {
            return Err(bad(format!(
                "flash.jitter={} must be in [0, 1)",
                self.jitter
            )));
        }
        if self.service_quantiles.len() > MAX_SERVICE_QUANTILES {
            return Err(bad(format!(
                "flash.service_quantiles has {} values, at most {MAX_SERVICE_QUANTILES}",
                self.service_quantiles.len()
            )));
        }
        if let Some((i, v)) = self
            .service_quantiles
            .iter()
            .enumerate()
            .find(|(_, v)| !(v.is_finite() && **v > 0.0 && **v <= 1e4))
        {
            return Err(bad(format!(
                "flash.service_quantiles[{i}]={v} must be a finite multiplier in (0, 10000]"
            )));
        }
        Ok(())
    }
}

/// The aligned window a read of `len` bytes at `offset` pulls: `[floor(offset), ceil(offset +
/// len))` to `align` bytes.
pub fn aligned_window_bytes(offset: u64, len: u64, align: u64) -> u64 {
    let a = align.max(1);
    let lo = offset / a * a;
    let hi = offset.saturating_add(len).div_ceil(a).saturating_mul(a);
    hi - lo
}

const MIB_F: f64 = (1u64 << 20) as f64;

#[derive(Clone, Debug)]
enum Status {
    /// Waiting behind another read of its lane.
    Queued,
    /// At the head of its lane, in its fixed latency until the given time.
    Latency { until: u64 },
    /// Moving bytes; `remaining` transfer work in bytes.
    Transfer { remaining: f64 },
    /// Bytes landed at `end`, completion not yet delivered.
    Done { end: u64 },
    /// Refused at submission (bad lane); delivered as an error.
    Failed { error: FlashError },
    /// Completion delivered, or cancelled: the id is spent.
    Spent,
}

#[derive(Clone, Debug)]
struct Read {
    req: ReadRequest,
    submit: u64,
    start: u64,
    read_bytes: u64,
    latency_ns: u64,
    work_bytes: f64,
    status: Status,
    /// `--inject-faults`: what this read suffers (a spike is already in `latency_ns`, a stuck
    /// read never leaves its latency).
    fault: Option<InjectedFault>,
}

/// A modelled flash device on a virtual clock. See the module documentation.
#[derive(Debug)]
pub struct FlashModel {
    clock: VirtualClock,
    lanes: u32,
    latency_ns: f64,
    /// `FlashParams::dispatch_us`, in nanoseconds.
    dispatch_ns: u64,
    /// Inside `kernel_end`: the kernels hold the cores, and a lane taking up a read waits.
    in_kernel: bool,
    /// Bytes per nanosecond.
    lane_rate: f64,
    device_rate: f64,
    align_bytes: u64,
    jitter: f64,
    /// `FlashParams::service_quantiles`.
    service: Vec<f64>,
    rng: ChaCha8Rng,
    /// The model's own time: every event up to it has been processed.
    t: u64,
    next_id: u64,
    /// Id of `reads[0]`.
    base_id: u64,
    reads: VecDeque<Read>,
    /// Per lane: ids in arrival order; the head is the one being served.
    queues: Vec<VecDeque<u64>>,
    /// Completions not yet delivered (lazily pruned), earliest (end, id) first.
    completed: BinaryHeap<Reverse<(u64, u64)>>,
    /// Σ read_bytes over every completed read.
    bytes_read: u64,
    /// `--inject-faults`.
    injector: Option<FaultInjector>,
    /// `--read-timeout-ms`, in virtual nanoseconds.
    timeout_ns: u64,
    /// Counts every read submitted, for the compute model's lane-CPU charge.
    meter: Option<crate::compute::ReadMeter>,
}

impl FlashModel {
    /// A device with `lanes` lanes (at least 1) timed by `params` on `clock`. With
    /// `o_direct` false the alignment is 1 (buffered reads pull exactly what was asked).
    /// `seed` seeds the jitter stream.
    pub fn new(
        clock: VirtualClock,
        params: &FlashParams,
        lanes: u32,
        o_direct: bool,
        seed: u64,
    ) -> Self {
        let lanes = lanes.max(1);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(FLASH_JITTER_STREAM);
        FlashModel {
            clock,
            lanes,
            latency_ns: params.read_latency_us * 1e3,
            dispatch_ns: (params.dispatch_us * 1e3).round() as u64,
            in_kernel: false,
            lane_rate: params.lane_mib_per_s * MIB_F / 1e9,
            device_rate: params.device_mib_per_s * MIB_F / 1e9,
            align_bytes: if o_direct {
                params.align_bytes.max(1)
            } else {
                1
            },
            jitter: params.jitter,
            service: params.service_quantiles.clone(),
            rng,
            t: 0,
            next_id: 0,
            base_id: 0,
            reads: VecDeque::new(),
            queues: vec![VecDeque::new(); lanes as usize],
            completed: BinaryHeap::new(),
            bytes_read: 0,
            injector: None,
            timeout_ns: bmoe_core::config::READ_TIMEOUT_MS_DEFAULT * 1_000_000,
            meter: None,
        }
    }

    /// Count every read submitted (and its aligned bytes) on `meter`: the compute model
    /// charges the lanes' CPU from it.
    pub fn set_read_meter(&mut self, meter: crate::compute::ReadMeter) {
        self.meter = Some(meter);
    }

    /// `--inject-faults`: EIO and short reads fail at their modelled completion, a spike adds
    /// its time to the read's latency, a stuck lane never completes (its waits time out).
    /// Torn reads change bytes, which the model does not move: callers refuse them.
    pub fn set_faults(&mut self, plan: FaultPlan) {
        self.injector = Some(FaultInjector::new(plan));
    }

    /// Faults injected so far.
    pub fn fault_counts(&self) -> FaultCounts {
        self.injector
            .as_ref()
            .map(FaultInjector::counts)
            .unwrap_or_default()
    }

    /// `--read-timeout-ms`: a `wait` gives up after this much virtual time and reports
    /// `FlashError::Timeout`.
    pub fn set_read_timeout_ms(&mut self, ms: u64) {
        self.timeout_ns = ms.max(1).saturating_mul(1_000_000);
    }

    /// Σ `read_bytes` of every read completed so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// Reads submitted and not yet delivered or cancelled.
    pub fn in_flight(&self) -> usize {
        self.reads
            .iter()
            .filter(|r| !matches!(r.status, Status::Spent))
            .count()
    }

    fn read_mut(&mut self, id: u64) -> Option<&mut Read> {
        let i = id.checked_sub(self.base_id)?;
        self.reads.get_mut(usize::try_from(i).ok()?)
    }

    fn read(&self, id: u64) -> Option<&Read> {
        let i = id.checked_sub(self.base_id)?;
        self.reads.get(usize::try_from(i).ok()?)
    }

    fn jitter_factor(&mut self) -> f64 {
        if !self.service.is_empty() {
            let i = self.rng.gen_range(0..self.service.len());
            self.service[i]
        } else if self.jitter == 0.0 {
            1.0
        } else {
            let u: f64 = self.rng.gen::<f64>() * 2.0 - 1.0;
            1.0 + self.jitter * u
        }
    }

    /// Put `id` at work on its lane at time `t` (it just reached the head): its lane takes
    /// it up after the dispatch time, and its service starts then.
    fn start(&mut self, id: u64, t: u64) {
        let t = if self.in_kernel {
            t.saturating_add(self.dispatch_ns)
        } else {
            t
        };
        if let Some(r) = self.read_mut(id) {
            r.start = t;
            r.status = Status::Latency {
                until: t.saturating_add(r.latency_ns),
            };
        }
    }

    /// The read at `id` finished at `t`: record it, free its lane, start the next one.
    fn finish(&mut self, lane: usize, id: u64, t: u64) {
        let mut bytes = 0;
        if let Some(r) = self.read_mut(id) {
            r.status = Status::Done { end: t };
            bytes = r.read_bytes;
        }
        self.bytes_read += bytes;
        self.completed.push(Reverse((t, id)));
        self.queues[lane].pop_front();
        if let Some(&next) = self.queues[lane].front() {
            self.start(next, t);
        }
    }

    /// The time of the next event (a latency ending, a transfer finishing; `u64::MAX` when
    /// none is coming) and the rate every transfer in progress moves at until then.
    fn next_event(&self) -> (u64, f64) {
        let mut transfers = 0u32;
        let mut next = u64::MAX;
        for q in &self.queues {
            let Some(&id) = q.front() else { continue };
            match self.read(id).map(|r| &r.status) {
                Some(Status::Latency { until }) => next = next.min(*until),
                Some(Status::Transfer { .. }) => transfers += 1,
                _ => {}
            }
        }
        let rate = if transfers == 0 {
            self.lane_rate
        } else {
            self.lane_rate.min(self.device_rate / f64::from(transfers))
        };
        for q in &self.queues {
            let Some(&id) = q.front() else { continue };
            if let Some(Status::Transfer { remaining }) = self.read(id).map(|r| &r.status) {
                let dt = (remaining / rate).ceil().max(0.0);
                let finish = if dt >= u64::MAX as f64 {
                    u64::MAX
                } else {
                    self.t.saturating_add(dt as u64)
                };
                next = next.min(finish);
            }
        }
        (next, rate)
    }

    /// When a kernel of `work_ns` (its time alone) started at `t0` ends, if it runs
    /// `1 + slowdown` times slower while any lane has a read to serve (the lanes' threads
    /// taking the kernels' cores). No read is submitted while a kernel runs, so the reads in
    /// flight now decide it; the model is moved on to the kernel's last read event before
    /// its end, never past it.
    pub fn kernel_end(&mut self, t0: u64, work_ns: f64, slowdown: f64) -> u64 {
        if t0 > self.t {
            self.run(t0, None);
        }
        let alone = |t: f64, w: f64| (t + w).round().min(u64::MAX as f64) as u64;
        if work_ns.is_nan() || work_ns <= 0.0 {
            return t0;
        }
        let slow = 1.0 + slowdown.max(0.0);
        let (mut t, mut remaining) = (t0 as f64, work_ns);
        self.in_kernel = true;
        let end = loop {
            if self.queues.iter().all(VecDeque::is_empty) {
                break alone(t, remaining);
            }
            let (next, _) = self.next_event();
            let need = remaining * slow;
            if next == u64::MAX || t + need <= next as f64 {
                break alone(t, need);
            }
            let next = next.max(t.ceil() as u64);
            remaining -= (next as f64 - t) / slow;
            t = next as f64;
            self.run(next, None);
        };
        self.in_kernel = false;
        end
    }

    /// Whether reads pay a dispatch time (`FlashParams::dispatch_us` > 0): the compute model
    /// then runs its kernels through `kernel_end`, which tells the lanes the kernels hold the
    /// cores.
    pub fn dispatches(&self) -> bool {
        self.dispatch_ns > 0
    }

    /// Process events until the model's time reaches `limit`, or (when `target` is given)
    /// until that read has completed, whichever comes first. `limit = u64::MAX` runs until
    /// the target completes or nothing is active.
    fn run(&mut self, limit: u64, target: Option<u64>) {
        loop {
            if let Some(id) = target {
                if !self.read(id).is_some_and(|r| {
                    matches!(
                        r.status,
                        Status::Queued | Status::Latency { .. } | Status::Transfer { .. }
                    )
                }) {
                    return;
                }
            }
            let (next, rate) = self.next_event();
            if next == u64::MAX || next > limit {
                // Nothing happens before the limit: move the transfers along and stop.
                if limit != u64::MAX && limit > self.t {
                    let dt = (limit - self.t) as f64;
                    self.progress(dt * rate);
                    self.t = limit;
                }
                return;
            }
            let dt_ns = next - self.t;
            let moved = dt_ns as f64 * rate;
            self.t = next;
            for lane in 0..self.queues.len() {
                let Some(&id) = self.queues[lane].front() else {
                    continue;
                };
                let t = self.t;
                let Some(r) = self.read_mut(id) else { continue };
                match r.status {
                    Status::Latency { until } if until <= t => {
                        if r.work_bytes <= 0.0 {
                            self.finish(lane, id, t);
                        } else {
                            r.status = Status::Transfer {
                                remaining: r.work_bytes,
                            };
                        }
                    }
                    Status::Transfer { remaining } => {
                        // The same arithmetic that chose `next`: this read ends now iff its
                        // own finish time was `next`.
                        let finish_dt = (remaining / rate).ceil().max(0.0);
                        let left = remaining - moved;
                        if finish_dt <= dt_ns as f64 || left <= 1e-6 {
                            self.finish(lane, id, t);
                        } else {
                            r.status = Status::Transfer { remaining: left };
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// Move every transfer in progress along by `bytes`.
    fn progress(&mut self, bytes: f64) {
        for lane in 0..self.queues.len() {
            let Some(&id) = self.queues[lane].front() else {
                continue;
            };
            if let Some(r) = self.read_mut(id) {
                if let Status::Transfer { remaining } = r.status {
                    r.status = Status::Transfer {
                        remaining: (remaining - bytes).max(1e-6),
                    };
                }
            }
        }
    }

    /// Catch the model up with the virtual clock.
    fn sync(&mut self) {
        let now = self.clock.now().0;
        if now > self.t {
            self.run(now, None);
        }
    }

    fn deliver(&mut self, id: u64) -> Result<ReadDone, FlashError> {
        let Some(r) = self.read_mut(id) else {
            return Err(FlashError::UnknownRead { id: ReadId(id) });
        };
        let status = std::mem::replace(&mut r.status, Status::Spent);
        let injected = r.fault.and_then(|f| injected_error(&r.req, f));
        let outcome = match status {
            Status::Done { .. } if injected.is_some() => {
                Err(injected.unwrap_or(FlashError::UnknownRead { id: ReadId(id) }))
            }
            Status::Done { end } => Ok(ReadDone {
                id: ReadId(id),
                lane: r.req.lane,
                req_bytes: r.req.len,
                read_bytes: r.read_bytes,
                submit: Nanos(r.submit),
                start: Nanos(r.start),
                end: Nanos(end),
            }),
            Status::Failed { error } => Err(error),
            other => {
                r.status = other;
                return Err(FlashError::UnknownRead { id: ReadId(id) });
            }
        };
        while self
            .reads
            .front()
            .is_some_and(|r| matches!(r.status, Status::Spent))
        {
            self.reads.pop_front();
            self.base_id += 1;
        }
        outcome
    }
}

/// One flash model shared by the engine (through `Flash`) and the compute model, which asks it
/// which reads are in flight while a kernel runs (`FlashModel::kernel_end`). Single-threaded,
/// like the virtual clock; each call borrows the model for its own duration only.
#[derive(Clone, Debug)]
pub struct SharedFlash(Rc<RefCell<FlashModel>>);

impl SharedFlash {
    pub fn new(model: FlashModel) -> Self {
        SharedFlash(Rc::new(RefCell::new(model)))
    }

    /// `FlashModel::dispatches`.
    pub fn dispatches(&self) -> bool {
        self.0.borrow().dispatches()
    }

    /// `FlashModel::kernel_end`.
    pub fn kernel_end(&self, t0: u64, work_ns: f64, slowdown: f64) -> u64 {
        self.0.borrow_mut().kernel_end(t0, work_ns, slowdown)
    }

    /// Faults injected so far.
    pub fn fault_counts(&self) -> FaultCounts {
        self.0.borrow().fault_counts()
    }
}

impl Flash for SharedFlash {
    fn lanes(&self) -> u32 {
        self.0.borrow().lanes()
    }

    fn submit(&mut self, read: ReadRequest) -> ReadId {
        self.0.borrow_mut().submit(read)
    }

    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        self.0.borrow_mut().wait(id)
    }

    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        self.0.borrow_mut().poll()
    }

    fn cancel(&mut self, id: ReadId) -> bool {
        self.0.borrow_mut().cancel(id)
    }
}

impl Flash for FlashModel {
    fn lanes(&self) -> u32 {
        self.lanes
    }

    fn submit(&mut self, read: ReadRequest) -> ReadId {
        self.sync();
        let id = self.next_id;
        self.next_id += 1;
        let now = self.t.max(self.clock.now().0);
        let read_bytes = aligned_window_bytes(read.offset, read.len, self.align_bytes);
        let factor = self.jitter_factor();
        let fault = match &mut self.injector {
            Some(f) if read.lane < self.lanes => f.on_submit(&read),
            _ => None,
        };
        let mut latency_ns = (self.latency_ns * factor).round() as u64;
        match fault {
            Some(InjectedFault::Spike { ns }) => latency_ns = latency_ns.saturating_add(ns),
            Some(InjectedFault::Stuck) => latency_ns = u64::MAX,
            _ => {}
        }
        let status = if read.lane >= self.lanes {
            Status::Failed {
                error: FlashError::BadLane {
                    id: ReadId(id),
                    lane: read.lane,
                    lanes: self.lanes,
                },
            }
        } else {
            Status::Queued
        };
        let failed = matches!(status, Status::Failed { .. });
        self.reads.push_back(Read {
            req: read,
            submit: now,
            start: now,
            read_bytes,
            latency_ns,
            work_bytes: read_bytes as f64 * factor,
            status,
            fault,
        });
        if failed {
            self.completed.push(Reverse((now, id)));
        } else {
            if let Some(m) = &self.meter {
                m.add(read_bytes);
            }
            let lane = read.lane as usize;
            self.queues[lane].push_back(id);
            if self.queues[lane].len() == 1 {
                self.start(id, now);
            }
        }
        ReadId(id)
    }

    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        self.sync();
        match self.read(id.0).map(|r| &r.status) {
            None | Some(Status::Spent) => return Err(FlashError::UnknownRead { id }),
            Some(Status::Queued | Status::Latency { .. } | Status::Transfer { .. }) => loop {
                // Wait until the read lands, or until the read its lane is serving has been
                // in service for the timeout (as the engine's watchdog judges a lane): a
                // stuck lane ends in a reported timeout, never a hang.
                let lane = self.read(id.0).map_or(0, |r| r.req.lane as usize);
                let head = self.queues.get(lane).and_then(|q| q.front().copied());
                let head_start = head.and_then(|h| self.read(h)).map_or(self.t, |r| r.start);
                let deadline = head_start.saturating_add(self.timeout_ns).max(self.t);
                self.run(deadline, Some(id.0));
                let active = self.read(id.0).is_some_and(|r| {
                    matches!(
                        r.status,
                        Status::Queued | Status::Latency { .. } | Status::Transfer { .. }
                    )
                });
                if !active {
                    break;
                }
                let same_head = self.queues.get(lane).and_then(|q| q.front().copied()) == head;
                if same_head && self.t >= deadline {
                    self.clock.advance_to(Nanos(deadline));
                    return Err(FlashError::Timeout {
                        id,
                        lane: lane as u32,
                        timeout_ms: self.timeout_ns / 1_000_000,
                    });
                }
            },
            Some(Status::Done { .. } | Status::Failed { .. }) => {}
        }
        if let Some(Status::Done { end }) = self.read(id.0).map(|r| &r.status) {
            self.clock.advance_to(Nanos(*end));
        }
        self.deliver(id.0)
    }

    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        self.sync();
        let now = self.clock.now().0;
        while let Some(&Reverse((end, id))) = self.completed.peek() {
            let pending = self
                .read(id)
                .is_some_and(|r| matches!(r.status, Status::Done { .. } | Status::Failed { .. }));
            if !pending {
                self.completed.pop();
                continue;
            }
            if end > now {
                return None;
            }
            self.completed.pop();
            return Some((ReadId(id), self.deliver(id)));
        }
        None
    }

    fn cancel(&mut self, id: ReadId) -> bool {
        self.sync();
        let Some(r) = self.read(id.0) else {
            return false;
        };
        if !matches!(r.status, Status::Queued) {
            return false;
        }
        let lane = r.req.lane as usize;
        if let Some(q) = self.queues.get_mut(lane) {
            q.retain(|&x| x != id.0);
        }
        if let Some(r) = self.read_mut(id.0) {
            r.status = Status::Spent;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(latency_us: f64, lane: f64, device: f64) -> FlashParams {
        FlashParams {
            service_quantiles: Vec::new(),
            dispatch_us: 0.0,
            read_latency_us: latency_us,
            lane_mib_per_s: lane,
            device_mib_per_s: device,
            align_bytes: 4096,
            jitter: 0.0,
        }
    }

    fn req(lane: u32, offset: u64, len: u64) -> ReadRequest {
        bmoe_core::testing::read_request(lane, offset, len)
    }

    const MIB: u64 = 1 << 20;

    /// Each read's service time is the model's times one of the measured multipliers, drawn
    /// from the seeded stream: only those values occur, each about equally often, the same
    /// sequence for the same seed; bad multipliers are refused by name.
    #[test]
    fn service_quantiles_spread_read_times_reproducibly() {
        let mut p = params(0.0, 1024.0, 1024.0);
        p.service_quantiles = vec![0.5, 1.0, 4.0];
        let durations = |seed: u64| -> Vec<u64> {
            let clock = VirtualClock::new();
            let mut f = FlashModel::new(clock, &p, 1, true, seed);
            (0..300)
                .map(|i| {
                    let id = f.submit(req(0, i * MIB, MIB));
                    let d = f.wait(id).expect("read");
                    d.end.0 - d.start.0
                })
                .collect()
        };
        let a = durations(9);
        assert_eq!(a, durations(9), "same seed, same draws");
        let mut counts = [0usize; 3];
        for &d in &a {
            // 1 MiB at 1024 MiB/s: 976 562.5 ns.
            let m = d as f64 / 976_562.5;
            let i = [0.5, 1.0, 4.0]
                .iter()
                .position(|q| (m - q).abs() < 0.01)
                .unwrap_or_else(|| panic!("duration {d} ns is no listed multiple of 976562.5"));
            counts[i] += 1;
        }
        assert!(counts.iter().all(|&c| c > 60), "{counts:?}");
        p.service_quantiles = vec![1.0, f64::NAN];
        assert!(p.validate("x").is_err());
        p.service_quantiles = vec![0.0];
        assert!(p.validate("x").is_err());
    }

    #[test]
    fn injected_faults_fail_delay_or_stick_reads_and_a_stuck_wait_times_out() {
        let clock = VirtualClock::new();
        let mut f = FlashModel::new(clock.clone(), &params(100.0, 1024.0, 4096.0), 2, true, 0);
        let mut plan = FaultPlan::parse("seed=1,spike=1,spike-ms=5,stuck=1@1").unwrap();
        f.set_faults(plan.clone());
        f.set_read_timeout_ms(50);
        // Lane 0: spiked by 5 ms. Lane 1: its first read is fine, its second sticks.
        let a = f.submit(req(0, 0, MIB));
        let b = f.submit(req(1, 4 * MIB, MIB));
        let c = f.submit(req(1, 8 * MIB, MIB));
        let d = f.submit(req(1, 12 * MIB, MIB));
        let da = f.wait(a).expect("a spike is only slower");
        assert!(da.end.0 - da.start.0 >= 5_000_000 + 100_000, "{da:?}");
        assert!(f.wait(b).is_ok(), "lane 1's first read is served");
        let t0 = clock.now();
        let e = f.wait(c).expect_err("stuck");
        assert!(
            matches!(
                e,
                FlashError::Timeout {
                    lane: 1,
                    timeout_ms: 50,
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            clock.now().0 - t0.0 <= 50_000_000 + 1_000_000,
            "waited about the timeout"
        );
        assert!(
            matches!(f.wait(d), Err(FlashError::Timeout { .. })),
            "queued behind it"
        );
        assert!(f.poll().is_none());
        // EIO and short reads fail at their modelled completion.
        plan = FaultPlan::parse("seed=2,eio=0.5,short=0.5").unwrap();
        let clock = VirtualClock::new();
        let mut f = FlashModel::new(clock.clone(), &params(100.0, 1024.0, 4096.0), 1, true, 0);
        f.set_faults(plan);
        let ids: Vec<ReadId> = (0..8).map(|i| f.submit(req(0, i * MIB, MIB))).collect();
        for id in ids {
            let e = f.wait(id).expect_err("every read faults");
            assert!(
                matches!(e, FlashError::Io { .. } | FlashError::Short { .. }),
                "{e}"
            );
        }
        assert!(clock.now().0 > 0, "after their transfer time");
        let c = f.fault_counts();
        assert_eq!(c.eio + c.short, 8);
    }

    #[test]
    fn a_long_queue_is_not_a_timeout() {
        // Twenty 100 ms reads on one lane: the last waits ~2 s, each served in 100 ms, under a
        // 150 ms timeout judged per read in service.
        let clock = VirtualClock::new();
        let mut f = FlashModel::new(clock.clone(), &params(0.0, 10.0, 10.0), 1, true, 0);
        f.set_read_timeout_ms(150);
        let ids: Vec<ReadId> = (0..20).map(|i| f.submit(req(0, i * MIB, MIB))).collect();
        assert!(f.wait(*ids.last().unwrap()).is_ok());
        assert!(clock.now().as_secs_f64() > 1.9);
    }

    #[test]
    fn alignment_windows_match_the_engine() {
        assert_eq!(aligned_window_bytes(0, 4096, 4096), 4096);
        assert_eq!(aligned_window_bytes(1, 4096, 4096), 8192);
        assert_eq!(aligned_window_bytes(4095, 2, 4096), 8192);
        assert_eq!(aligned_window_bytes(100, 10, 1), 10);
    }

    #[test]
    fn one_read_takes_latency_plus_bytes_over_the_lane_rate() {
        let clock = VirtualClock::new();
        // 1000 MiB/s per lane: 1 MiB per ms.
        let mut f = FlashModel::new(clock.clone(), &params(100.0, 1000.0, 4000.0), 2, true, 0);
        let id = f.submit(req(0, 0, MIB));
        let d = f.wait(id).expect("done");
        assert_eq!(d.read_bytes, MIB);
        assert_eq!(d.start, Nanos(0));
        // 100 us + 1 ms (rounded up to the ns).
        assert!((d.end.0 as i64 - 1_100_000).abs() <= 1, "{:?}", d.end);
        assert_eq!(
            clock.now(),
            d.end,
            "wait advances the clock to the completion"
        );
        assert!(f.wait(id).is_err(), "a completion is delivered once");
    }

    #[test]
    fn lanes_share_the_device_ceiling() {
        let clock = VirtualClock::new();
        // Each lane could do 1 MiB/ms, the device only 1 MiB/ms in total.
        let mut f = FlashModel::new(clock.clone(), &params(0.0, 1000.0, 1000.0), 2, true, 0);
        let a = f.submit(req(0, 0, MIB));
        let b = f.submit(req(1, MIB, MIB));
        let da = f.wait(a).expect("a");
        let db = f.wait(b).expect("b");
        // Both share 1 MiB/ms: each finishes after 2 ms.
        assert!((da.end.0 as i64 - 2_000_000).abs() <= 2, "{:?}", da.end);
        assert!((db.end.0 as i64 - 2_000_000).abs() <= 2, "{:?}", db.end);
        // Same lane: FIFO, the second starts when the first ends.
        let c = f.submit(req(0, 0, MIB));
        let d = f.submit(req(0, MIB, MIB));
        let dd = f.wait(d).expect("d");
        let dc = f.wait(c).expect("c");
        assert_eq!(dd.start, dc.end);
        assert!(((dd.end.0 - dc.end.0) as i64 - 1_000_000).abs() <= 2);
    }

    #[test]
    fn unequal_sizes_free_bandwidth_when_the_short_read_ends() {
        let clock = VirtualClock::new();
        let mut f = FlashModel::new(clock.clone(), &params(0.0, 1000.0, 1000.0), 2, true, 0);
        let small = f.submit(req(0, 0, MIB));
        let big = f.submit(req(1, 0, 3 * MIB));
        // Shared: 0.5 MiB/ms each until the small one ends at 2 ms (big has 2 MiB left),
        // then the big one alone at 1 MiB/ms: 4 ms.
        let db = f.wait(big).expect("big");
        assert!((db.end.0 as i64 - 4_000_000).abs() <= 3, "{:?}", db.end);
        let ds = f.wait(small).expect("small");
        assert!((ds.end.0 as i64 - 2_000_000).abs() <= 3, "{:?}", ds.end);
    }

    #[test]
    fn poll_delivers_in_time_then_sequence_order_and_only_what_is_done() {
        let clock = VirtualClock::new();
        let mut f = FlashModel::new(clock.clone(), &params(10.0, 1024.0, 8192.0), 4, true, 0);
        let ids: Vec<ReadId> = (0..4).map(|l| f.submit(req(l, 0, 4096))).collect();
        assert!(f.poll().is_none(), "nothing is done at t=0");
        clock.advance(Nanos::from_ms(1));
        let order: Vec<ReadId> = std::iter::from_fn(|| f.poll().map(|(id, _)| id)).collect();
        assert_eq!(
            order, ids,
            "equal completion times are delivered by sequence"
        );
        assert_eq!(f.in_flight(), 0);
    }

    #[test]
    fn bad_lanes_fail_through_the_completion_and_cancel_spares_queued_reads() {
        let clock = VirtualClock::new();
        let mut f = FlashModel::new(clock.clone(), &params(0.0, 1024.0, 1024.0), 1, false, 0);
        let bad = f.submit(req(3, 0, 10));
        assert!(matches!(
            f.wait(bad),
            Err(FlashError::BadLane { lane: 3, .. })
        ));
        let a = f.submit(req(0, 0, MIB));
        let b = f.submit(req(0, 0, MIB));
        assert!(!f.cancel(a), "a read at the head of its lane has started");
        assert!(f.cancel(b));
        assert!(f.wait(b).is_err());
        let da = f.wait(a).expect("a");
        assert_eq!(da.read_bytes, MIB, "buffered: no alignment");
    }

    #[test]
    fn jitter_is_seeded_and_bounded() {
        let run = |seed: u64, jitter: f64| {
            let clock = VirtualClock::new();
            let mut p = params(50.0, 1000.0, 1000.0);
            p.jitter = jitter;
            let mut f = FlashModel::new(clock, &p, 1, true, seed);
            (0..20)
                .map(|i| {
                    let id = f.submit(req(0, i * MIB, MIB));
                    let d = f.wait(id).expect("read");
                    (d.end - d.start).0
                })
                .collect::<Vec<u64>>()
        };
        assert_eq!(run(7, 0.2), run(7, 0.2));
        assert_ne!(run(7, 0.2), run(8, 0.2));
        assert_eq!(run(7, 0.0), run(8, 0.0));
        for d in run(9, 0.2) {
            let nominal = 1_050_000.0;
            assert!((d as f64) >= nominal * 0.8 - 2.0 && (d as f64) <= nominal * 1.2 + 2.0);
        }
    }

    proptest::proptest! {
        /// Whatever is submitted, in whatever order it is waited for or polled: each read is
        /// delivered once, `submit <= start <= end`, a lane serves its reads one after another
        /// in submission order, a read never beats its latency plus its bytes at the lane
        /// rate, and the device never moves bytes faster than its ceiling.
        #[test]
        fn timing_invariants(
            reads in proptest::collection::vec((0u32..3, 1u64..3_000_000, 0u64..2_000_000), 1..40),
            gaps in proptest::collection::vec(0u64..400_000, 40),
            poll_first in proptest::bool::ANY,
        ) {
            let clock = VirtualClock::new();
            let p = params(20.0, 700.0, 1000.0);
            let mut f = FlashModel::new(clock.clone(), &p, 3, true, 1);
            let mut ids = Vec::new();
            for (i, &(lane, len, off)) in reads.iter().enumerate() {
                clock.advance(Nanos(gaps[i]));
                ids.push((f.submit(req(lane, off, len)), lane, len, off));
            }
            let mut done = Vec::new();
            if poll_first {
                clock.advance(Nanos::from_ms(50));
                while let Some((id, d)) = f.poll() {
                    done.push((id, d.expect("read")));
                }
            }
            for &(id, ..) in &ids {
                if !done.iter().any(|(x, _)| *x == id) {
                    done.push((id, f.wait(id).expect("read")));
                }
            }
            proptest::prop_assert_eq!(done.len(), ids.len());
            proptest::prop_assert_eq!(f.in_flight(), 0);
            let lane_ns_per_byte = 1e9 / (700.0 * MIB as f64);
            let mut bytes = 0u64;
            let (mut first, mut last) = (u64::MAX, 0u64);
            for &(id, lane, len, off) in &ids {
                let d = done.iter().find(|(x, _)| *x == id).map(|(_, d)| *d).expect("delivered");
                proptest::prop_assert!(d.submit <= d.start && d.start <= d.end);
                proptest::prop_assert_eq!(d.read_bytes, aligned_window_bytes(off, len, 4096));
                let floor = 20_000.0 + d.read_bytes as f64 * lane_ns_per_byte;
                proptest::prop_assert!((d.end - d.start).0 as f64 >= floor - 2.0);
                // FIFO per lane: a later read of the same lane starts after this one ends.
                for &(other, other_lane, ..) in &ids {
                    if other_lane == lane && other > id {
                        let o = done.iter().find(|(x, _)| *x == other).map(|(_, d)| *d).expect("o");
                        proptest::prop_assert!(o.start >= d.end);
                    }
                }
                bytes += d.read_bytes;
                first = first.min(d.start.0);
                last = last.max(d.end.0);
            }
            // Ceiling: all bytes took at least bytes / device rate.
            let ceiling_ns = bytes as f64 * 1e9 / (1000.0 * MIB as f64);
            proptest::prop_assert!((last - first) as f64 >= ceiling_ns - 2.0 * ids.len() as f64);
        }
    }

    #[test]
    fn a_kernel_runs_slower_while_reads_are_in_flight_and_not_after() {
        let clock = VirtualClock::new();
        // 1000 MiB/s: a 1 MiB read takes 1 ms.
        let mut f = FlashModel::new(clock.clone(), &params(0.0, 1000.0, 1000.0), 1, true, 0);
        assert_eq!(
            f.kernel_end(0, 2e6, 1.0),
            2_000_000,
            "no read in flight: its time alone"
        );
        let id = f.submit(req(0, 0, MIB));
        // 2 ms of work, twice as slow for the first 1 ms (0.5 ms done), then 1.5 ms alone.
        let end = f.kernel_end(0, 2e6, 1.0);
        assert!((end as i64 - 2_500_000).abs() <= 2, "{end}");
        clock.advance_to(Nanos(end));
        let d = f.wait(id).expect("read");
        assert!(
            (d.end.0 as i64 - 1_000_000).abs() <= 2,
            "the read is not slowed: {d:?}"
        );
        assert_eq!(f.kernel_end(end, 1e6, 0.0), end + 1_000_000);
    }

    #[test]
    fn a_read_that_starts_while_a_kernel_runs_waits_its_dispatch_time() {
        let mut p = params(0.0, 1000.0, 1000.0);
        p.dispatch_us = 100.0;
        let run = |kernel: bool| {
            let clock = VirtualClock::new();
            let mut f = FlashModel::new(clock.clone(), &p, 1, true, 0);
            let a = f.submit(req(0, 0, MIB));
            let b = f.submit(req(0, MIB, MIB));
            if kernel {
                let end = f.kernel_end(0, 5e6, 0.0);
                assert_eq!(end, 5_000_000, "no slowdown asked");
                clock.advance_to(Nanos(end));
            }
            let (da, db) = (f.wait(a).expect("a"), f.wait(b).expect("b"));
            (da.start.0, da.end.0, db.start.0, db.end.0)
        };
        // Submitted outside a kernel: the first read starts at once. Its successor reaches
        // the head at 1 ms: at once while the kernels wait, 100 us later while one runs —
        // and the read's own service time (end - start) is the same either way.
        let (a0, a1, b0, b1) = run(false);
        assert_eq!((a0, b0), (0, a1));
        let (c0, c1, d0, d1) = run(true);
        assert_eq!(c0, 0);
        assert!(
            (d0 as i64 - (c1 as i64 + 100_000)).abs() <= 1,
            "{d0} vs {c1}"
        );
        assert_eq!(d1 - d0, b1 - b0);
    }

    #[test]
    fn params_are_checked() {
        assert!(params(1.0, 1.0, 1.0).validate("p").is_ok());
        assert!(params(-1.0, 1.0, 1.0).validate("p").is_err());
        assert!(params(1.0, 0.0, 1.0).validate("p").is_err());
        assert!(params(1.0, 1.0, f64::NAN).validate("p").is_err());
        let mut p = params(1.0, 1.0, 1.0);
        p.align_bytes = 3000;
        assert!(p.validate("p").is_err());
        p.align_bytes = 4096;
        p.jitter = 1.0;
        assert!(p.validate("p").is_err());
        p.jitter = 0.0;
        p.dispatch_us = -1.0;
        assert!(p.validate("p").is_err());
        p.dispatch_us = f64::INFINITY;
        assert!(p.validate("p").is_err());
        p.dispatch_us = 50.0;
        assert!(p.validate("p").is_ok());
    }
}
