//! Where expert bytes come from: a small, completion-shaped I/O trait.
//!
//! The streamer submits reads and later waits for (or polls) their completions, so the same
//! code drives O_DIRECT lanes in the engine, a modelled device in the simulator (which
//! completes a read at its modelled time by advancing its virtual clock), the in-memory
//! device in `testing` and the fault-injecting ones in `faults`. Destinations are cache slots, not pointers: the
//! engine maps a slot to memory, the simulator has none.

use crate::clock::Nanos;
use crate::vocab::SlotId;
pub use crate::vocab::{FlashError, ReadId, ReadTag};

/// One read: `len` bytes at `offset` of file `shard`, landing in projection `tag.proj` of
/// slot `dest` at byte `dest_offset` of that projection's slice for this expert.
///
/// The core guarantees: `len > 0`; the extent lies inside the layout (checked against shard
/// lengths by the engine at load); `lane < Flash::lanes()`; no two in-flight reads overlap
/// the same destination bytes; a destination is not read by compute until this read's
/// completion has been delivered.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReadRequest {
    pub shard: u16,
    pub offset: u64,
    pub len: u64,
    pub dest: SlotId,
    pub dest_offset: u64,
    /// The I/O lane the core chose (round-robin over `lanes()`).
    pub lane: u32,
    /// A prefetch the core may cancel; demand reads are never speculative.
    pub speculative: bool,
    pub tag: ReadTag,
}

/// A successful read's completion.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ReadDone {
    pub id: ReadId,
    pub lane: u32,
    /// Bytes the request asked for (its `len`).
    pub req_bytes: u64,
    /// Bytes actually pulled from the device: the aligned window under O_DIRECT, so
    /// `read_bytes >= req_bytes`. Effective bandwidth is judged against this.
    pub read_bytes: u64,
    /// When `submit` was called, when the lane started the read, when its bytes landed —
    /// all on the device's clock (the same clock the core reads).
    pub submit: Nanos,
    pub start: Nanos,
    pub end: Nanos,
}

/// A flash device with `lanes()` parallel read lanes.
///
/// Every submitted read's outcome is delivered **exactly once**, by `wait(id)` or by `poll()`,
/// whichever asks first; a later `wait` on the same id returns `UnknownRead`. A read's bytes
/// are in its destination before its completion is delivered (the happens-before edge the
/// compute side relies on; see `handoff`).
pub trait Flash {
    /// Number of lanes; `ReadRequest::lane` must be below it. At least 1.
    fn lanes(&self) -> u32;

    /// Queue a read on its lane. Never blocks. A request the device cannot accept (bad lane,
    /// out of range) is reported through its completion, not here.
    fn submit(&mut self, read: ReadRequest) -> ReadId;

    /// Block until read `id` is done and return its outcome. The engine blocks on its lane;
    /// the simulator advances its virtual clock to the modelled completion time.
    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError>;

    /// An outcome that is already in (on the simulator: whose modelled completion time is not
    /// after the clock's now), earliest first where the device knows the order; `None` when
    /// nothing is ready. Never blocks. The id is returned beside the outcome so a failed
    /// read is attributable (and not waited for again).
    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)>;

    /// Cancel a speculative read that has not started: returns true when it never will (its
    /// completion is then never delivered); false when it already started or finished (its
    /// outcome is still delivered as usual). Demand reads are never cancelled by the core.
    fn cancel(&mut self, id: ReadId) -> bool;

    /// Whether every expert's bytes are already in memory where the backend computes them
    /// from — the resident baseline's device (`ResidentFlash`). The streamer then looks nothing
    /// up and reads nothing: each routed expert goes straight to `Backend::expert`, in the
    /// serial first-use order, with a `SlotId::Staging` slot the backend does not read from.
    /// Such a device needs the cache off (`Engine::new` refuses otherwise). Default: false.
    fn resident(&self) -> bool {
        false
    }
}

/// The resident baseline's device: every expert is in memory already (the engine's model
/// map), so `resident()` is true and the streamer never reads. A read submitted anyway is a
/// bug, and fails loudly instead of computing on bytes nobody wrote.
#[derive(Debug, Default)]
pub struct ResidentFlash {
    next_id: u64,
    refused: std::collections::VecDeque<ReadId>,
}

impl ResidentFlash {
    /// The device (one lane, which the streamer never uses).
    pub fn new() -> Self {
        Self::default()
    }

    fn refusal() -> FlashError {
        FlashError::Closed {
            reason: "the resident device holds every expert in memory and reads nothing"
                .to_string(),
        }
    }
}

impl Flash for ResidentFlash {
    fn lanes(&self) -> u32 {
        1
    }
    fn submit(&mut self, _read: ReadRequest) -> ReadId {
        let id = ReadId(self.next_id);
        self.next_id += 1;
        self.refused.push_back(id);
        id
    }
    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        match self.refused.iter().position(|&r| r == id) {
            Some(i) => {
                self.refused.remove(i);
                Err(Self::refusal())
            }
            None => Err(FlashError::UnknownRead { id }),
        }
    }
    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        self.refused
            .pop_front()
            .map(|id| (id, Err(Self::refusal())))
    }
    fn cancel(&mut self, _id: ReadId) -> bool {
        false
    }
    fn resident(&self) -> bool {
        true
    }
}

impl<F: Flash + ?Sized> Flash for &mut F {
    fn lanes(&self) -> u32 {
        (**self).lanes()
    }
    fn submit(&mut self, read: ReadRequest) -> ReadId {
        (**self).submit(read)
    }
    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        (**self).wait(id)
    }
    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        (**self).poll()
    }
    fn cancel(&mut self, id: ReadId) -> bool {
        (**self).cancel(id)
    }
    fn resident(&self) -> bool {
        (**self).resident()
    }
}

impl<F: Flash + ?Sized> Flash for Box<F> {
    fn lanes(&self) -> u32 {
        (**self).lanes()
    }
    fn submit(&mut self, read: ReadRequest) -> ReadId {
        (**self).submit(read)
    }
    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        (**self).wait(id)
    }
    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        (**self).poll()
    }
    fn cancel(&mut self, id: ReadId) -> bool {
        (**self).cancel(id)
    }
    fn resident(&self) -> bool {
        (**self).resident()
    }
}
