//! The engine's flash device: N I/O lane threads reading expert extents from the model's
//! shard files straight into the expert arena, with O_DIRECT when the filesystem allows it.
//!
//! Why lanes: one `pread` at a time leaves a flash device mostly idle, and a fixed pool of
//! threads each with its own file descriptor per shard is the simplest way to keep several
//! requests in flight without io_uring. Why O_DIRECT: streamed experts must not also sit in
//! the page cache — that would double their memory and let the kernel, not the cache's
//! byte budget, decide what stays resident.
//!
//! The core talks to this through `bmoe_core::Flash`; the threads talk to the core through
//! `bmoe_core::handoff` (one `LaneQueue` per lane, one `Completions` board), whose
//! happens-before edges are the ones the loom model checks: a lane writes the slot, *then*
//! publishes; the core reads the slot only after taking the outcome.
//!
//! Placement (see `docs/flash.md`): a projection's bytes start at
//! `arena.window_dest(layer, slot, proj) + extent_offset % 4096` (the slot's chunk, given to it
//! when its first read is resolved), so the destination address
//! is congruent to the file offset modulo 4096 and the aligned O_DIRECT window of any piece of
//! the extent lands on a page boundary. Buffered reads put the same bytes at the same address.

use crate::arena::{Arena, SlotAddr, ALIGN, HUGE};
use bmoe_core::backend::SlotId;
use bmoe_core::clock::{Clock, Nanos};
use bmoe_core::faults::{injected_error, FaultCounts, FaultInjector, FaultPlan, InjectedFault};
use bmoe_core::flash::{Flash, FlashError, ReadDone, ReadId, ReadRequest};
use bmoe_core::handoff::{Completions, HandoffError, LaneQueue};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;
use thiserror::Error;

/// Most lanes a device may have: beyond this a phone's flash gains nothing and the threads
/// only compete with compute for cores.
pub const MAX_LANES: u32 = 8;

/// Bytes compared at each end of a shard by the verify read at open.
const VERIFY_BYTES: u64 = 64 * 1024;

static ORIGIN: OnceLock<Instant> = OnceLock::new();

/// The engine's `Clock`: nanoseconds since a process-wide origin (the first time any
/// `MonotonicClock` was made), from the OS monotonic clock. Every copy reads the same
/// timeline, so lane timestamps and the core's readings are directly comparable.
#[derive(Copy, Clone, Debug)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock on the process-wide timeline.
    pub fn new() -> Self {
        MonotonicClock {
            origin: *ORIGIN.get_or_init(Instant::now),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Nanos {
        // u64 nanoseconds last 584 years; saturate rather than wrap past that.
        Nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }
}

/// Why a `LaneFlash` (or the raw benchmark) could not start.
#[derive(Debug, Error)]
pub enum FlashOpenError {
    #[error("flash: no shard files given")]
    NoShards,
    #[error("flash: {lanes} I/O lanes requested; expected 1..={MAX_LANES}")]
    BadLanes { lanes: u32 },
    #[error("flash: cannot open shard {shard} ({path}): {source}")]
    Open {
        shard: usize,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("flash: cannot stat shard {shard} ({path}): {source}")]
    Stat {
        shard: usize,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("flash: cannot start I/O lane {lane}: {source}")]
    Spawn { lane: u32, source: std::io::Error },
    #[error("flash benchmark: {what} must be positive (got {got})")]
    BadBenchArgument { what: &'static str, got: u64 },
    #[error("flash benchmark: read at offset {offset} of {path} failed: {source}")]
    BenchRead {
        path: PathBuf,
        offset: u64,
        source: std::io::Error,
    },
}

/// How one shard is read by every lane.
#[derive(Copy, Clone, Debug)]
struct ShardInfo {
    len_bytes: u64,
    direct: bool,
}

/// A destination address in the arena, handed from the core thread to a lane.
#[derive(Copy, Clone, Debug)]
struct DestPtr(*mut u8);
// SAFETY: the pointer targets the arena, which the lanes keep alive through their `Arc`;
// which thread writes which bytes when is the handoff's contract (see the module docs).
unsafe impl Send for DestPtr {}

/// A read queued on a lane: everything resolved on the core thread, so the lane only does I/O.
struct Job {
    id: u64,
    req: ReadRequest,
    /// Where file byte `req.offset` lands.
    target: DestPtr,
    submit: Nanos,
    /// `--inject-faults`: what this read suffers, decided at submit.
    fault: Option<InjectedFault>,
}

type Outcome = Result<ReadDone, FlashError>;

/// State shared by the core-side handle and the lane threads.
struct Shared {
    queues: Vec<LaneQueue<Job>>,
    board: Completions<Outcome>,
    /// Set when a lane thread panicked: the device is then closed for good.
    broken: AtomicBool,
    broken_reason: Mutex<String>,
    /// Per lane: the job in progress (id + 1, 0 = idle) and when it started (ns on the
    /// device clock), for the watchdog.
    busy: Vec<(AtomicU64, AtomicU64)>,
    /// `--read-timeout-ms`.
    timeout_ms: AtomicU64,
    /// Set when the device is dropped: the watchdog and any injected stuck lane stop.
    shutdown: AtomicBool,
}

impl Shared {
    /// Close the device for good: every waiter gets `Closed` with `reason` (or the outcome
    /// already published for its read).
    fn close_broken(&self, reason: String) {
        if let Ok(mut r) = self.broken_reason.lock() {
            if r.is_empty() {
                *r = reason;
            }
        }
        self.broken.store(true, Ordering::SeqCst);
        for q in &self.queues {
            q.close();
        }
        self.board.close();
    }
}

/// `bmoe_core::Flash` over real files: `lanes` threads, each with its own descriptor per
/// shard, reading into the expert arena.
///
/// Contract beyond the trait's: a read is served into the arena slot its `ReadRequest::dest`
/// names (see the module docs for the placement); `ReadDone::read_bytes` is the aligned
/// window for an O_DIRECT shard and `len` for a buffered one; a read that cannot be placed
/// (unknown shard, past the file's end, outside its slot) fails through its completion as
/// `FlashError::Io`, never by writing elsewhere. Dropping the device discards queued reads,
/// lets in-progress ones finish and joins the threads.
pub struct LaneFlash {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    watchdog: Option<JoinHandle<()>>,
    injector: Option<FaultInjector>,
    shards: Arc<Vec<ShardInfo>>,
    arena: Arc<Arena>,
    clock: MonotonicClock,
    next_id: u64,
    warnings: Vec<String>,
    /// Why some shard is read buffered although O_DIRECT was asked for, in one line.
    buffered_reason: Option<String>,
}

impl std::fmt::Debug for LaneFlash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneFlash")
            .field("lanes", &self.shared.queues.len())
            .field("shards", &self.shards)
            .field("next_id", &self.next_id)
            .finish_non_exhaustive()
    }
}

/// A 4096-aligned zeroed buffer, for O_DIRECT reads outside the arena (verify, benchmark):
/// from the heap, or (`huge`) a mapping of whole 2 MiB pages marked for transparent huge
/// pages and committed, the memory the arena reads experts into.
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// `Some((mapping, mapping length))` when mapped, `None` when from the heap.
    map: Option<(*mut libc::c_void, usize)>,
}

impl AlignedBuf {
    fn new(len: usize) -> Option<AlignedBuf> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), ALIGN as usize).ok()?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(AlignedBuf {
            ptr: std::ptr::NonNull::new(p)?,
            len: layout.size(),
            map: None,
        })
    }

    /// As `new`, in huge pages when `huge` (best effort: a kernel without THP leaves base
    /// pages, committed all the same).
    fn for_reads(len: usize, huge: bool) -> Option<AlignedBuf> {
        if !huge {
            return Self::new(len);
        }
        let hp = HUGE as usize;
        let len = len.max(1).div_ceil(hp) * hp;
        let map_len = len + hp;
        // SAFETY: a fresh anonymous private mapping; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let lead = (p as usize).next_multiple_of(hp) - p as usize;
        // SAFETY: `lead < hp`, so `lead..lead + len` is inside the mapping, page aligned, and
        // nobody else has seen it; advice and commit on our own fresh pages.
        let ptr = unsafe {
            let a = (p as *mut u8).add(lead);
            libc::madvise(a as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            crate::arena::commit_pages(a, len);
            a
        };
        Some(AlignedBuf {
            ptr: std::ptr::NonNull::new(ptr)?,
            len,
            map: Some((p, map_len)),
        })
    }
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn as_slice(&self) -> &[u8] {
        // SAFETY: zero-initialised memory of `len` bytes that we own.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

// SAFETY: the buffer is plain memory owned by one value (the raw pointer is its mapping).
unsafe impl Send for AlignedBuf {}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.map {
            // SAFETY: unmapping exactly what `for_reads` mapped.
            Some((p, n)) => unsafe {
                libc::munmap(p, n);
            },
            // SAFETY: allocated in `new` with this size and alignment.
            None => unsafe {
                std::alloc::dealloc(
                    self.ptr.as_ptr(),
                    std::alloc::Layout::from_size_align_unchecked(self.len, ALIGN as usize),
                )
            },
        }
    }
}

/// `pread` into raw memory until `want` bytes arrived or the file ended, retrying on EINTR.
/// With `direct`, a partial read that is not page aligned can only be the end of the file
/// (O_DIRECT transfers whole blocks otherwise), and the next aligned pread would be refused,
/// so it ends the loop. Returns the bytes read.
///
/// # Safety
/// `dest .. dest + want` must be writable memory that nothing else reads during the call.
unsafe fn pread_full(
    file: &File,
    dest: *mut u8,
    offset: u64,
    want: u64,
    direct: bool,
) -> std::io::Result<u64> {
    let mut got = 0u64;
    while got < want {
        let pos = libc::off_t::try_from(offset + got)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        let n = libc::pread(
            file.as_raw_fd(),
            dest.add(got as usize) as *mut libc::c_void,
            (want - got) as usize,
            pos,
        );
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        got += n as u64;
        if direct && got & (ALIGN - 1) != 0 {
            break;
        }
    }
    Ok(got)
}

fn open_shard(path: &Path, direct: bool) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// Read `[offset, offset+len)` through an O_DIRECT descriptor and through a buffered one and
/// compare; `Err(reason)` when the direct read fails or mis-serves.
fn verify_direct(direct: &File, buffered: &File, offset: u64, len: u64) -> Result<(), String> {
    let lo = offset / ALIGN * ALIGN;
    let hi = (offset + len).div_ceil(ALIGN) * ALIGN;
    let mut dbuf = AlignedBuf::new((hi - lo) as usize).ok_or("cannot allocate a buffer")?;
    let mut bbuf = vec![0u8; len as usize];
    // SAFETY: both buffers are ours and at least as long as the reads.
    let dgot = unsafe { pread_full(direct, dbuf.as_mut_ptr(), lo, hi - lo, true) }
        .map_err(|e| format!("O_DIRECT read failed: {e}"))?;
    let bgot = unsafe { pread_full(buffered, bbuf.as_mut_ptr(), offset, len, false) }
        .map_err(|e| format!("buffered read failed: {e}"))?;
    let skip = (offset - lo) as usize;
    if bgot != len || dgot < (offset + len - lo) {
        return Err(format!(
            "O_DIRECT read {dgot} bytes of a {}-byte window, buffered {bgot} of {len}",
            hi - lo
        ));
    }
    if dbuf.as_slice()[skip..skip + len as usize] != bbuf[..] {
        return Err("O_DIRECT read returned different bytes than a buffered read".into());
    }
    Ok(())
}

/// Decide one shard's mode: O_DIRECT if asked and the filesystem both accepts the flag and
/// serves a verify read of the file's head and tail correctly; buffered otherwise, with the
/// reason (EINVAL at open: procfs, FUSE without direct I/O, older tmpfs; a failed or wrong
/// first aligned read: some phone storage stacks).
fn probe_shard(
    shard: usize,
    path: &Path,
    want_direct: bool,
) -> Result<(ShardInfo, Option<String>), FlashOpenError> {
    let buffered = open_shard(path, false).map_err(|source| FlashOpenError::Open {
        shard,
        path: path.to_owned(),
        source,
    })?;
    let len_bytes = buffered
        .metadata()
        .map_err(|source| FlashOpenError::Stat {
            shard,
            path: path.to_owned(),
            source,
        })?
        .len();
    let info = |direct| ShardInfo { len_bytes, direct };
    if !want_direct {
        return Ok((info(false), None));
    }
    let direct = match open_shard(path, true) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            return Ok((info(false), Some(format!("open refused: {e}"))));
        }
        Err(source) => {
            return Err(FlashOpenError::Open {
                shard,
                path: path.to_owned(),
                source,
            })
        }
    };
    let head = len_bytes.min(VERIFY_BYTES);
    // The tail check exercises the short O_DIRECT read at end of file.
    let tail_off = len_bytes.saturating_sub(VERIFY_BYTES);
    let checks = [(0, head), (tail_off, len_bytes - tail_off)];
    for (off, len) in checks {
        if len == 0 {
            continue;
        }
        if let Err(reason) = verify_direct(&direct, &buffered, off, len) {
            return Ok((info(false), Some(format!("verify read: {reason}"))));
        }
    }
    Ok((info(true), None))
}

/// The one-line summary of the shards read buffered although O_DIRECT was asked for (`refused`:
/// per shard, its reason or `None`), for the `mode:` line; `None` when none was.
fn buffered_summary(refused: &[Option<String>]) -> Option<String> {
    let first = refused.iter().flatten().next()?;
    let n = refused.iter().flatten().count();
    Some(if refused.len() == 1 {
        format!("O_DIRECT refused: {first}")
    } else {
        format!(
            "O_DIRECT refused on {n} of {} shards; first: {first}",
            refused.len()
        )
    })
}

/// Marks the device broken if a lane thread unwinds, so waiters get `Closed` instead of
/// blocking for an outcome that will never be published.
struct PanicGuard {
    shared: Arc<Shared>,
    lane: u32,
}

impl Drop for PanicGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared
                .close_broken(format!("I/O lane {} panicked", self.lane));
        }
    }
}

/// Publishes a timeout for a read a lane has been serving longer than `--read-timeout-ms`,
/// and closes the device (the reads queued behind it would wait forever too). The lane
/// itself cannot be interrupted in `pread`; the run stops instead of hanging.
fn watchdog_main(shared: Arc<Shared>, clock: MonotonicClock) {
    while !shared.shutdown.load(Ordering::SeqCst) {
        let timeout_ms = shared.timeout_ms.load(Ordering::SeqCst).max(1);
        std::thread::sleep(std::time::Duration::from_millis(
            (timeout_ms / 4).clamp(1, 50),
        ));
        let now = clock.now().0;
        for (lane, (job, since)) in shared.busy.iter().enumerate() {
            let j = job.load(Ordering::SeqCst);
            let started = since.load(Ordering::SeqCst);
            if j == 0 || now.saturating_sub(started) <= timeout_ms.saturating_mul(1_000_000) {
                continue;
            }
            let id = j - 1;
            shared.board.publish(
                id,
                Err(FlashError::Timeout {
                    id: ReadId(id),
                    lane: lane as u32,
                    timeout_ms,
                }),
            );
            shared.close_broken(format!(
                "I/O lane {lane} is stuck: read #{id} has not completed in {timeout_ms} ms"
            ));
            return;
        }
    }
}

/// Apply an injected fault around one read: a spike waits first, a stuck lane never returns
/// (until the device is dropped), EIO and short reads fail after the read, a torn read
/// changes one landed byte. `None` when the read never completes.
fn serve_with_fault(
    job: &Job,
    files: &[File],
    shards: &[ShardInfo],
    shared: &Shared,
) -> Option<Result<u64, FlashError>> {
    match job.fault {
        Some(InjectedFault::Spike { ns }) => {
            std::thread::sleep(std::time::Duration::from_nanos(ns))
        }
        Some(InjectedFault::Stuck) => {
            while !shared.shutdown.load(Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            return None;
        }
        _ => {}
    }
    let outcome = serve(job, files, shards);
    Some(match (job.fault, outcome) {
        (Some(f), Ok(_)) if injected_error(&job.req, f).is_some() => {
            Err(injected_error(&job.req, f).unwrap_or_else(|| io_error(&job.req, String::new())))
        }
        (Some(InjectedFault::Torn { at }), Ok(n)) => {
            if at < job.req.len {
                // SAFETY: byte `at` of the request lies inside the window `serve` just wrote,
                // which submit checked is inside the destination slot.
                unsafe { *job.target.0.add(at as usize) ^= 0x5a };
            }
            Ok(n)
        }
        (_, outcome) => outcome,
    })
}

fn lane_main(
    lane: u32,
    shared: Arc<Shared>,
    files: Vec<File>,
    shards: Arc<Vec<ShardInfo>>,
    _arena: Arc<Arena>,
    clock: MonotonicClock,
) {
    let _guard = PanicGuard {
        shared: shared.clone(),
        lane,
    };
    let (busy_job, busy_since) = &shared.busy[lane as usize];
    while let Some(job) = shared.queues[lane as usize].pop() {
        let start = clock.now();
        busy_since.store(start.0, Ordering::SeqCst);
        busy_job.store(job.id + 1, Ordering::SeqCst);
        let outcome = match job.fault {
            None => Some(serve(&job, &files, &shards)),
            Some(_) => serve_with_fault(&job, &files, &shards, &shared),
        };
        let Some(outcome) = outcome else {
            continue;
        };
        busy_job.store(0, Ordering::SeqCst);
        let end = clock.now();
        let outcome = outcome.map(|read_bytes| ReadDone {
            id: ReadId(job.id),
            lane,
            req_bytes: job.req.len,
            read_bytes,
            submit: job.submit,
            start,
            end,
        });
        shared.board.publish(job.id, outcome);
    }
}

/// Do one read; `Ok(read_bytes)`.
fn serve(job: &Job, files: &[File], shards: &[ShardInfo]) -> Result<u64, FlashError> {
    let r = &job.req;
    let shard = r.shard as usize;
    // Checked at submit; a second look costs nothing and keeps indexing panic-free.
    let (Some(file), Some(info)) = (files.get(shard), shards.get(shard)) else {
        return Err(io_error(r, format!("no shard {shard}")));
    };
    if info.direct {
        let lo = r.offset / ALIGN * ALIGN;
        let hi = (r.offset + r.len).div_ceil(ALIGN) * ALIGN;
        let need = r.offset + r.len - lo;
        // SAFETY: submit checked that `target - (offset - lo) .. + (hi - lo)` lies inside the
        // destination slot, which no other read's requested bytes overlap and compute does
        // not read until this completion is delivered. Neighbouring pieces of the same
        // extent may rewrite the shared boundary page with the same file bytes.
        let dest = unsafe { job.target.0.sub((r.offset - lo) as usize) };
        let got = unsafe { pread_full(file, dest, lo, hi - lo, true) }
            .map_err(|e| io_error(r, e.to_string()))?;
        if got < need {
            return Err(FlashError::Short {
                shard: r.shard,
                offset: r.offset,
                expected: r.len,
                got: got.saturating_sub(r.offset - lo),
            });
        }
        Ok(hi - lo)
    } else {
        // SAFETY: as above, for exactly the requested bytes.
        let got = unsafe { pread_full(file, job.target.0, r.offset, r.len, false) }
            .map_err(|e| io_error(r, e.to_string()))?;
        if got < r.len {
            return Err(FlashError::Short {
                shard: r.shard,
                offset: r.offset,
                expected: r.len,
                got,
            });
        }
        Ok(r.len)
    }
}

fn io_error(r: &ReadRequest, message: String) -> FlashError {
    FlashError::Io {
        shard: r.shard,
        offset: r.offset,
        len: r.len,
        message,
    }
}

impl LaneFlash {
    /// Open `shard_paths` for `lanes` lane threads (1..=`MAX_LANES`), each with its own
    /// descriptor per shard, O_DIRECT when `o_direct` and the filesystem allows it (see
    /// `warnings()` and `o_direct_achieved()`), reading into `arena` and timestamping with
    /// `clock`.
    pub fn open(
        shard_paths: &[PathBuf],
        lanes: u32,
        o_direct: bool,
        arena: Arc<Arena>,
        clock: MonotonicClock,
    ) -> Result<LaneFlash, FlashOpenError> {
        Self::open_pinned(shard_paths, lanes, o_direct, arena, clock, &[])
    }

    /// [`LaneFlash::open`] with each lane thread pinned to `lane_cpus` (empty: not pinned) —
    /// on a big.LITTLE phone the little cores, so the lanes never take a big core from
    /// compute (`crate::cpus`).
    pub fn open_pinned(
        shard_paths: &[PathBuf],
        lanes: u32,
        o_direct: bool,
        arena: Arc<Arena>,
        clock: MonotonicClock,
        lane_cpus: &[usize],
    ) -> Result<LaneFlash, FlashOpenError> {
        if shard_paths.is_empty() {
            return Err(FlashOpenError::NoShards);
        }
        if !(1..=MAX_LANES).contains(&lanes) {
            return Err(FlashOpenError::BadLanes { lanes });
        }
        let mut warnings = Vec::new();
        let mut infos = Vec::with_capacity(shard_paths.len());
        let mut refused = Vec::with_capacity(shard_paths.len());
        for (i, p) in shard_paths.iter().enumerate() {
            let (info, why) = probe_shard(i, p, o_direct)?;
            if let Some(reason) = &why {
                warnings.push(format!(
                    "flash: shard {i} ({}): O_DIRECT unavailable ({reason}); reading it buffered \
                     through the page cache",
                    p.display()
                ));
            }
            infos.push(info);
            refused.push(why);
        }
        let buffered_reason = buffered_summary(&refused);
        let shards = Arc::new(infos);
        // Open every descriptor before starting any thread, so a failure leaves nothing
        // running.
        let mut lane_files = Vec::with_capacity(lanes as usize);
        for _ in 0..lanes {
            let mut files = Vec::with_capacity(shard_paths.len());
            for (i, (p, info)) in shard_paths.iter().zip(shards.iter()).enumerate() {
                files.push(
                    open_shard(p, info.direct).map_err(|source| FlashOpenError::Open {
                        shard: i,
                        path: p.clone(),
                        source,
                    })?,
                );
            }
            lane_files.push(files);
        }
        let shared = Arc::new(Shared {
            queues: (0..lanes).map(|_| LaneQueue::new()).collect(),
            board: Completions::new(),
            broken: AtomicBool::new(false),
            broken_reason: Mutex::new(String::new()),
            busy: (0..lanes)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
            timeout_ms: AtomicU64::new(bmoe_core::config::READ_TIMEOUT_MS_DEFAULT),
            shutdown: AtomicBool::new(false),
        });
        let mut dev = LaneFlash {
            shared: shared.clone(),
            threads: Vec::with_capacity(lanes as usize),
            watchdog: None,
            injector: None,
            shards: shards.clone(),
            arena: arena.clone(),
            clock,
            next_id: 0,
            warnings,
            buffered_reason,
        };
        for (lane, files) in (0..lanes).zip(lane_files) {
            let (sh, si, ar) = (shared.clone(), shards.clone(), arena.clone());
            let cpus = lane_cpus.to_vec();
            let t = std::thread::Builder::new()
                .name(format!("bmoe-io-{lane}"))
                .spawn(move || {
                    if !cpus.is_empty() {
                        // Best effort: refused (a sandbox, a cpuset), the lane runs wherever
                        // the scheduler puts it, as without pinning.
                        let _ = crate::cpus::pin_current_thread(&cpus);
                    }
                    lane_main(lane, sh, files, si, ar, clock)
                })
                .map_err(|source| FlashOpenError::Spawn { lane, source })?;
            // On a spawn error `dev` drops here, closing and joining the lanes started so far.
            dev.threads.push(t);
        }
        let sh = shared.clone();
        dev.watchdog = Some(
            std::thread::Builder::new()
                .name("bmoe-io-watchdog".into())
                .spawn(move || watchdog_main(sh, clock))
                .map_err(|source| FlashOpenError::Spawn {
                    lane: lanes,
                    source,
                })?,
        );
        Ok(dev)
    }

    /// `--read-timeout-ms`: a read a lane has served longer than this fails as
    /// `FlashError::Timeout` and closes the device (the run stops rather than hangs).
    pub fn set_read_timeout_ms(&mut self, ms: u64) {
        self.shared.timeout_ms.store(ms.max(1), Ordering::SeqCst);
    }

    /// `--inject-faults`: spoil reads as `plan` says, in the lanes, on real files.
    pub fn set_faults(&mut self, plan: FaultPlan) {
        self.injector = Some(FaultInjector::new(plan));
    }

    /// Faults injected so far (zero without `set_faults`).
    pub fn fault_counts(&self) -> FaultCounts {
        self.injector
            .as_ref()
            .map(FaultInjector::counts)
            .unwrap_or_default()
    }

    /// Why some shard is read buffered although O_DIRECT was asked for (one line each).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Why some shard is read buffered although O_DIRECT was asked for, in one line (the
    /// `mode:` line's `buffered reads (...)`); `None` when every shard got what was asked.
    pub fn buffered_reason(&self) -> Option<&str> {
        self.buffered_reason.as_deref()
    }

    /// True when every shard is read with O_DIRECT.
    pub fn o_direct_achieved(&self) -> bool {
        self.shards.iter().all(|s| s.direct)
    }

    /// The clock the lanes timestamp with.
    pub fn clock(&self) -> MonotonicClock {
        self.clock
    }

    /// Where file byte `req.offset` lands, after checking that the whole window the read will
    /// write lies inside its destination slot and the file holds the extent.
    fn resolve(&self, req: &ReadRequest) -> Result<*mut u8, String> {
        let info = self
            .shards
            .get(req.shard as usize)
            .ok_or_else(|| format!("no shard {} (device has {})", req.shard, self.shards.len()))?;
        let end = req
            .offset
            .checked_add(req.len)
            .ok_or("offset + len overflows")?;
        if req.len == 0 || end > info.len_bytes {
            return Err(format!(
                "extent [{}, {end}) is empty or past the shard's end ({} bytes)",
                req.offset, info.len_bytes
            ));
        }
        // The extent this piece belongs to starts `dest_offset` bytes earlier in the file.
        let extent_offset = req
            .offset
            .checked_sub(req.dest_offset)
            .ok_or("dest_offset exceeds offset")?;
        let layer = req.tag.layer as usize;
        let proj = req.tag.proj as usize;
        let arena = &self.arena;
        let slot = match req.dest {
            SlotId::Canonical(key) => {
                if key.layer != req.tag.layer || key.expert != req.tag.expert {
                    return Err(format!(
                        "slot {:?} does not match tag layer {} expert {}",
                        key, req.tag.layer, req.tag.expert
                    ));
                }
                SlotAddr::Canonical(u32::from(key.expert))
            }
            SlotId::Staging(e) => SlotAddr::Staging(u32::from(e)),
        };
        // The arena indexes its tables without bounds checks of its own (it trusts the
        // layout it was built from); a request naming a layer or projection it does not have
        // must fail this read, not the process.
        let lookup = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let limit = match slot {
                SlotAddr::Canonical(e) => arena.n_expert(layer) > e,
                SlotAddr::Staging(e) => arena.n_staging() > e,
            };
            (
                limit,
                arena.window_dest(layer, slot, 0),
                arena.window_dest(layer, slot, proj),
                arena.slot_bytes(layer),
            )
        }));
        let Ok((in_range, slot_start, region, slot_bytes)) = lookup else {
            return Err(format!("the arena has no layer {layer} projection {proj}"));
        };
        if !in_range {
            return Err(format!("slot {:?} is outside the arena", req.dest));
        }
        if slot_start.is_null() || region.is_null() {
            return Err(format!(
                "the arena has no memory left for slot {:?}",
                req.dest
            ));
        }
        let data_start = extent_offset % ALIGN + req.dest_offset;
        let window_lo = if info.direct {
            data_start - req.offset % ALIGN
        } else {
            data_start
        };
        let window_len = if info.direct {
            end.div_ceil(ALIGN) * ALIGN - req.offset / ALIGN * ALIGN
        } else {
            req.len
        };
        let region_off = region as u64 - slot_start as u64;
        if region_off + window_lo + window_len > slot_bytes {
            return Err(format!(
                "read window of {window_len} bytes at {} in projection {proj} overruns the \
                 {slot_bytes}-byte slot",
                window_lo
            ));
        }
        // SAFETY: inside the slot, checked just above.
        Ok(unsafe { region.add(data_start as usize) })
    }

    fn closed_reason(&self) -> String {
        self.shared
            .broken_reason
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }
}

impl Flash for LaneFlash {
    fn lanes(&self) -> u32 {
        self.shared.queues.len() as u32
    }

    fn submit(&mut self, read: ReadRequest) -> ReadId {
        let submit = self.clock.now();
        let id = self.next_id;
        self.next_id += 1;
        self.shared.board.expect(id);
        let lanes = self.lanes();
        if read.lane >= lanes {
            self.shared.board.publish(
                id,
                Err(FlashError::BadLane {
                    id: ReadId(id),
                    lane: read.lane,
                    lanes,
                }),
            );
            return ReadId(id);
        }
        let target = match self.resolve(&read) {
            Ok(t) => t,
            Err(message) => {
                self.shared.board.publish(id, Err(io_error(&read, message)));
                return ReadId(id);
            }
        };
        let fault = self.injector.as_mut().and_then(|f| f.on_submit(&read));
        let job = Job {
            id,
            req: read,
            target: DestPtr(target),
            submit,
            fault,
        };
        if self.shared.queues[read.lane as usize].push(job).is_err() {
            let reason = self.closed_reason();
            self.shared
                .board
                .publish(id, Err(FlashError::Closed { reason }));
        }
        ReadId(id)
    }

    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        match self.shared.board.wait(id.0) {
            Ok(outcome) => outcome,
            Err(HandoffError::UnknownRead { .. }) => Err(FlashError::UnknownRead { id }),
            Err(HandoffError::Closed) => Err(FlashError::Closed {
                reason: self.closed_reason(),
            }),
        }
    }

    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        self.shared
            .board
            .try_take()
            .map(|(id, outcome)| (ReadId(id), outcome))
    }

    fn cancel(&mut self, id: ReadId) -> bool {
        // Only speculative reads are cancellable; removing under the queue's lock means the
        // lane either popped it already (false) or never will (true).
        let removed = self
            .shared
            .queues
            .iter()
            .find_map(|q| q.remove_first(|j| j.id == id.0 && j.req.speculative));
        removed.is_some() && self.shared.board.forget(id.0)
    }
}

impl Drop for LaneFlash {
    fn drop(&mut self) {
        // Queued reads are discarded (nobody will take their outcome); reads in progress
        // finish into the arena, which the lanes keep alive until they exit.
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for q in &self.shared.queues {
            while q.remove_first(|_| true).is_some() {}
            q.close();
        }
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        let broken = self.shared.broken.load(Ordering::SeqCst);
        for (lane, t) in self.threads.drain(..).enumerate() {
            // A lane still inside a read after a timeout may never return from `pread`:
            // leave it (the process is ending its run); join the others. A lane that
            // panicked already marked the device broken.
            let busy = self.shared.busy[lane].0.load(Ordering::SeqCst) != 0;
            if broken && busy {
                continue;
            }
            let _ = t.join();
        }
        self.shared.board.close();
    }
}

/// What both raw benchmarks start from: the file's length, the request size as read (rounded
/// up to 4096 under O_DIRECT) and one descriptor per lane.
struct BenchFiles {
    file_len: u64,
    req: u64,
    files: Vec<File>,
}

/// Check the lane count, `request_bytes` and every `(name, value)` in `positive`, and open
/// `path` once per lane.
fn bench_files(
    path: &Path,
    request_bytes: u64,
    lanes: u32,
    o_direct: bool,
    positive: &[(&'static str, u64)],
) -> Result<BenchFiles, FlashOpenError> {
    if !(1..=MAX_LANES).contains(&lanes) {
        return Err(FlashOpenError::BadLanes { lanes });
    }
    for &(what, got) in [("request_bytes", request_bytes)].iter().chain(positive) {
        if got == 0 {
            return Err(FlashOpenError::BadBenchArgument { what, got });
        }
    }
    let open_err = |source| FlashOpenError::Open {
        shard: 0,
        path: path.to_owned(),
        source,
    };
    let file_len = open_shard(path, false)
        .and_then(|f| f.metadata())
        .map_err(open_err)?
        .len();
    let req = if o_direct {
        request_bytes.div_ceil(ALIGN) * ALIGN
    } else {
        request_bytes
    };
    let files = (0..lanes)
        .map(|_| open_shard(path, o_direct).map_err(open_err))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(BenchFiles {
        file_len,
        req,
        files,
    })
}

/// How the raw benchmarks read: O_DIRECT or buffered, into huge or base pages.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RawIo {
    pub o_direct: bool,
    pub huge_pages: bool,
}

/// Raw read bandwidth of `path` in MiB/s: `lanes` threads, each with its own descriptor,
/// issuing `request_bytes` preads (rounded up to 4096 under O_DIRECT) until `total_bytes` were
/// read: in file order, lanes interleaved and wrapping around, or with `random = Some(seed)` at
/// request-aligned offsets drawn from a hash of (seed, request number) — the access pattern of
/// expert reads, which a device's or host's read-ahead does not help. The same seed reads the
/// same offsets, which a virtual disk's host may still cache from the last run: repeats that
/// must measure the device take new seeds. The baseline the
/// streaming benchmark's achieved MiB/s is judged against. Buffered mode measures the page
/// cache after the first pass, so compare like with like.
pub fn raw_read_bench(
    path: &Path,
    request_bytes: u64,
    lanes: u32,
    io: RawIo,
    total_bytes: u64,
    random: Option<u64>,
) -> Result<f64, FlashOpenError> {
    let BenchFiles {
        file_len,
        req,
        files,
    } = bench_files(
        path,
        request_bytes,
        lanes,
        io.o_direct,
        &[("total_bytes", total_bytes)],
    )?;
    let n_slots = file_len / req;
    if n_slots == 0 {
        return Err(FlashOpenError::BadBenchArgument {
            what: "file length / request_bytes",
            got: 0,
        });
    }
    let n_requests = total_bytes.div_ceil(req);
    let t0 = Instant::now();
    let results: Vec<Result<u64, FlashOpenError>> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(lane, file)| {
                s.spawn(move || {
                    let mut buf = AlignedBuf::for_reads(req as usize, io.huge_pages).ok_or(
                        FlashOpenError::BadBenchArgument {
                            what: "request_bytes (allocation)",
                            got: req,
                        },
                    )?;
                    let mut bytes = 0u64;
                    let mut i = lane as u64;
                    while i < n_requests {
                        let slot = match random {
                            Some(seed) => mix64(i ^ mix64(seed)) % n_slots,
                            None => i % n_slots,
                        };
                        let offset = slot * req;
                        // SAFETY: `buf` is ours and `req` bytes long.
                        let got =
                            unsafe { pread_full(file, buf.as_mut_ptr(), offset, req, io.o_direct) }
                                .map_err(|source| FlashOpenError::BenchRead {
                                    path: path.to_owned(),
                                    offset,
                                    source,
                                })?;
                        bytes += got;
                        i += u64::from(lanes);
                    }
                    Ok(bytes)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or(Err(FlashOpenError::BadBenchArgument {
                    what: "lane (panicked)",
                    got: 0,
                }))
            })
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    let mut bytes = 0u64;
    for r in results {
        bytes += r?;
    }
    Ok(bytes as f64 / (1024.0 * 1024.0) / secs.max(1e-9))
}

/// The access shape of a cached decode, for [`raw_burst_bench`]: `reads` requests issued
/// together, round-robin over the lanes as the core assigns them, then the device left idle for
/// `gap` (the compute between two layers that miss); the requests come in runs of `adjacent`
/// neighbouring ones at a random place (`--read-split lanes` cuts a projection into one piece
/// per lane, read at the same time).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct BurstShape {
    pub reads: u32,
    pub adjacent: u32,
    pub gap: std::time::Duration,
}

/// What [`raw_burst_bench`] measured.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct BurstResult {
    /// Bytes read ÷ time from a burst's release to its last read's completion, summed over
    /// bursts (the idle gaps excluded): comparable with a serial decode's bytes ÷ blocked time.
    pub mib_s: f64,
    /// Mean time of one pread.
    pub mean_read_ms: f64,
    pub bursts: u64,
}

/// Raw O_DIRECT (or buffered, `io`) bandwidth of `path` for reads in bursts of `shape`: each lane a
/// thread with its own descriptor, released together at each burst (the way a lane wakes for
/// a layer's misses), read `i` of a burst on lane `i % lanes`, offsets drawn from `seed` and
/// the burst number, until `total_bytes` were read. The raw stream ([`raw_read_bench`]) keeps
/// every lane busy without a break; this is the same device driven the way a cached decode
/// drives it, so the difference between the two is what the access shape costs, and the
/// difference between this and the engine is what the engine costs.
pub fn raw_burst_bench(
    path: &Path,
    request_bytes: u64,
    lanes: u32,
    io: RawIo,
    total_bytes: u64,
    seed: u64,
    shape: BurstShape,
) -> Result<BurstResult, FlashOpenError> {
    use std::sync::Barrier;
    let BenchFiles {
        file_len,
        req,
        files,
    } = bench_files(
        path,
        request_bytes,
        lanes,
        io.o_direct,
        &[
            ("total_bytes", total_bytes),
            ("burst reads", u64::from(shape.reads)),
            ("burst adjacent", u64::from(shape.adjacent)),
        ],
    )?;
    let adjacent = u64::from(shape.adjacent);
    let n_bases = (file_len / req).saturating_sub(adjacent - 1);
    if n_bases == 0 {
        return Err(FlashOpenError::BadBenchArgument {
            what: "file length / (request_bytes x adjacent)",
            got: 0,
        });
    }
    let reads = u64::from(shape.reads);
    let bursts = total_bytes.div_ceil(reads * req);
    let offset_of = move |burst: u64, i: u64| {
        let group = i / adjacent;
        let base = mix64(mix64(seed) ^ mix64(burst.wrapping_mul(1 << 20) + group)) % n_bases;
        (base + i % adjacent) * req
    };
    // Start and end of every burst: the lanes and the timing thread meet twice per burst.
    let gate = Barrier::new(lanes as usize + 1);
    let failed = AtomicBool::new(false);
    let mut busy = std::time::Duration::ZERO;
    let results: Vec<Result<(u64, u64, f64), FlashOpenError>> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(lane, file)| {
                let (gate, failed) = (&gate, &failed);
                s.spawn(move || {
                    let mut buf = AlignedBuf::for_reads(req as usize, io.huge_pages);
                    let (mut bytes, mut n, mut secs) = (0u64, 0u64, 0f64);
                    let mut err = None;
                    if buf.is_none() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    for b in 0..bursts {
                        gate.wait();
                        let mut i = lane as u64;
                        while i < reads && err.is_none() && !failed.load(Ordering::Relaxed) {
                            let Some(buf) = buf.as_mut() else { break };
                            let offset = offset_of(b, i);
                            let t = Instant::now();
                            // SAFETY: `buf` is ours and `req` bytes long.
                            match unsafe {
                                pread_full(file, buf.as_mut_ptr(), offset, req, io.o_direct)
                            } {
                                Ok(got) => bytes += got,
                                Err(source) => {
                                    failed.store(true, Ordering::Relaxed);
                                    err = Some(FlashOpenError::BenchRead {
                                        path: path.to_owned(),
                                        offset,
                                        source,
                                    });
                                }
                            }
                            secs += t.elapsed().as_secs_f64();
                            n += 1;
                            i += u64::from(lanes);
                        }
                        gate.wait();
                    }
                    match (err, buf) {
                        (Some(e), _) => Err(e),
                        (None, None) => Err(FlashOpenError::BadBenchArgument {
                            what: "request_bytes (allocation)",
                            got: req,
                        }),
                        (None, Some(_)) => Ok((bytes, n, secs)),
                    }
                })
            })
            .collect();
        for _ in 0..bursts {
            std::thread::sleep(shape.gap);
            let t = Instant::now();
            gate.wait();
            gate.wait();
            busy += t.elapsed();
        }
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or(Err(FlashOpenError::BadBenchArgument {
                    what: "lane (panicked)",
                    got: 0,
                }))
            })
            .collect()
    });
    let (mut bytes, mut n, mut secs) = (0u64, 0u64, 0f64);
    for r in results {
        let (b, k, t) = r?;
        bytes += b;
        n += k;
        secs += t;
    }
    Ok(BurstResult {
        mib_s: bytes as f64 / (1024.0 * 1024.0) / busy.as_secs_f64().max(1e-9),
        mean_read_ms: if n > 0 { secs * 1e3 / n as f64 } else { 0.0 },
        bursts,
    })
}

/// SplitMix64's finaliser: a fixed, well-spread hash of the request number, so a random-offset
/// benchmark reads the same offsets every run.
fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two ways a filesystem refuses O_DIRECT, each with its reason: EINVAL at open
    /// (procfs stands in for a FUSE mount without direct I/O), and a first aligned read that
    /// fails (a descriptor that cannot read stands in for a phone storage stack that accepts
    /// the flag and then refuses the read).
    #[test]
    fn a_refused_o_direct_falls_back_with_its_reason() {
        let (info, why) = probe_shard(0, Path::new("/proc/version"), true).expect("readable");
        assert!(!info.direct);
        let why = why.expect("procfs refuses O_DIRECT at open");
        assert!(why.starts_with("open refused:"), "{why}");
        assert!(why.contains("os error 22"), "EINVAL: {why}");
        // Not asked for: nothing probed, nothing refused.
        let (info, why) = probe_shard(0, Path::new("/proc/version"), false).expect("readable");
        assert!(!info.direct && why.is_none());

        let dir = crate::testdata::scratch_dir("flash-verify");
        let path = dir.join("shard.bin");
        std::fs::write(&path, vec![7u8; 10_000]).expect("write");
        let write_only = OpenOptions::new().write(true).open(&path).expect("open");
        let buffered = open_shard(&path, false).expect("open");
        let e = verify_direct(&write_only, &buffered, 0, 10_000).expect_err("cannot read");
        assert!(e.starts_with("O_DIRECT read failed:"), "{e}");
        // A filesystem that serves O_DIRECT (target/ is a real one) passes the same check.
        if let Ok(direct) = open_shard(&path, true) {
            assert_eq!(verify_direct(&direct, &buffered, 0, 10_000), Ok(()));
            assert_eq!(verify_direct(&direct, &buffered, 4000, 6000), Ok(()));
        }
    }

    #[test]
    fn the_mode_line_summary_names_the_first_refusal() {
        assert_eq!(buffered_summary(&[None, None]), None);
        assert_eq!(buffered_summary(&[]), None);
        assert_eq!(
            buffered_summary(&[Some("open refused: EINVAL".into())]).as_deref(),
            Some("O_DIRECT refused: open refused: EINVAL")
        );
        assert_eq!(
            buffered_summary(&[None, Some("verify read: x".into()), Some("y".into())]).as_deref(),
            Some("O_DIRECT refused on 2 of 3 shards; first: verify read: x")
        );
    }

    #[test]
    fn random_bench_offsets_spread_over_the_file() {
        // 1000 requests over 64 slots: every slot drawn, none more than 3x its share.
        let mut seen = [0u32; 64];
        for i in 0..1000u64 {
            seen[(mix64(i) % 64) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 0 && n < 3 * 1000 / 64), "{seen:?}");
        assert_ne!(mix64(1), mix64(2));
    }

    #[test]
    fn monotonic_clock_is_shared_and_nondecreasing() {
        let a = MonotonicClock::new();
        let t1 = a.now();
        let b = MonotonicClock::new();
        let t2 = b.now();
        let t3 = a.now();
        assert!(t1 <= t2 && t2 <= t3);
    }

    #[test]
    fn a_burst_bench_reads_what_it_says_and_refuses_nonsense() {
        const BUF: RawIo = RawIo {
            o_direct: false,
            huge_pages: true,
        };
        let dir = std::env::temp_dir().join(format!("bmoe-burst-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
        let shape = BurstShape {
            reads: 6,
            adjacent: 3,
            gap: std::time::Duration::from_millis(1),
        };
        let r = raw_burst_bench(&path, 8192, 2, BUF, 96 << 10, 5, shape).unwrap();
        assert_eq!(r.bursts, 2);
        assert!(r.mib_s > 0.0 && r.mean_read_ms >= 0.0);
        let zero = BurstShape { reads: 0, ..shape };
        assert!(matches!(
            raw_burst_bench(&path, 8192, 2, BUF, 1 << 20, 5, zero),
            Err(FlashOpenError::BadBenchArgument { .. })
        ));
        let too_wide = BurstShape {
            adjacent: 1000,
            ..shape
        };
        assert!(matches!(
            raw_burst_bench(&path, 8192, 2, BUF, 1 << 20, 5, too_wide),
            Err(FlashOpenError::BadBenchArgument { .. })
        ));
        assert!(matches!(
            raw_burst_bench(&path, 8192, 9, BUF, 1 << 20, 5, shape),
            Err(FlashOpenError::BadLanes { lanes: 9 })
        ));
        let missing = dir.join("missing.bin");
        assert!(matches!(
            raw_burst_bench(&missing, 8192, 1, BUF, 1 << 20, 5, shape),
            Err(FlashOpenError::Open { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn aligned_buffers_are_aligned() {
        let mut b = AlignedBuf::new(10_000).unwrap();
        assert_eq!(b.as_mut_ptr() as usize % ALIGN as usize, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
    }
}
