//! The expert arena: where streamed expert bytes live in memory.
//!
//! One virtual address range is reserved (never committed up front). Expert slots are
//! carved from it in *chunks*, all the size of the largest slot, plus a few fixed staging
//! slots for the cache-off mode. A cached (layer, expert) gets a chunk when its first read is
//! resolved and gives it back when the cache evicts it. Returned chunks stay committed, up to
//! `WARM_MAX_BYTES` in total, and the next admission reuses one: in a full cache every
//! admission follows an eviction, so its read lands in pages that are already there instead
//! of faulting in and zeroing ~3 MiB of fresh ones. One chunk size means any evicted chunk
//! fits any admission (layers quantized differently have slots of different sizes); a chunk
//! taken by a smaller slot than it last held has its committed tail released, so resident
//! memory stays the sum of the resident experts' slots. Past the cap a returned chunk is
//! released with `madvise(MADV_DONTNEED)`, so resident memory tracks the cache's byte budget
//! (plus at most the cap), not the model's size.
//!
//! While the cache fills, no chunk comes back to take. With `prefault_bytes > 0` keeper
//! threads keep that many bytes of chunks committed in advance (`MADV_POPULATE_WRITE`, or
//! touching each page where the kernel lacks it), at idle priority and never past
//! `commit_limit` counting the chunks experts hold (the cache's budget: the stock lives in the
//! room a filling cache has not used yet, and a full cache gets none), so an expert's read need
//! not wait for its destination pages to be faulted in — which on a VM whose balloon reports
//! freed pages to the host costs a host fault per page, 5–10 ms for one expert here.
//!
//! Chunks holding at least one 2 MiB huge page's worth of every slot are laid out 2 MiB
//! apart and the whole huge pages at each chunk's head are marked `MADV_HUGEPAGE` (the rest of
//! the arena `MADV_NOHUGEPAGE`, so no huge page ever straddles two chunks or commits past a
//! slot): an O_DIRECT read into a huge page pins one page instead of 512 and hands the device
//! one contiguous segment, measured 25–40 % faster per read on this project's VM (256 KiB and
//! 1 MiB requests, docs/flash.md).
//!
//! Each projection gets a 4096-aligned region big enough for the O_DIRECT window that
//! covers it: the read lands at the region start and the projection's bytes begin at
//! `offset % 4096`, so buffered and direct reads put the data at the same address.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// O_DIRECT alignment of buffers, offsets and lengths.
pub const ALIGN: u64 = 4096;

/// Most bytes of evicted chunks kept committed for reuse (the rest are released at once).
pub const WARM_MAX_BYTES: u64 = 32 << 20;

/// Bytes the engine keeps committed ahead of use while its cache fills (within the budget's
/// unused room): the early decode steps of a filling cache miss a dozen experts and more in
/// a token, and the keepers refill the stock only in idle time.
pub const PREFAULT_BYTES: u64 = 128 << 20;

/// Keeper threads. Committing a chunk on this project's VM is 5–10 ms of host faults, a
/// filling cache admits several a token, and one idle-priority thread fell behind (slow reads
/// into uncommitted chunks: 67–188 a run with one, 6–15 with two, docs/benchmarks.md).
pub const KEEPERS: usize = 2;

/// Size of a transparent huge page (x86-64, and arm64 with 4 KiB pages).
pub const HUGE: u64 = 2 << 20;

/// No chunk assigned.
const NONE: u64 = u64::MAX;

/// One projection extent of one expert on flash.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    pub shard: u16,
    pub offset: u64,
    pub len: u64,
}

impl Extent {
    /// The aligned window an O_DIRECT read of this extent covers.
    pub fn window(&self) -> (u64, u64) {
        let lo = self.offset / ALIGN * ALIGN;
        let hi = (self.offset + self.len).div_ceil(ALIGN) * ALIGN;
        (lo, hi - lo)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    #[error("expert arena: reserving {bytes} bytes of address space failed: {source}")]
    Reserve { bytes: u64, source: std::io::Error },
    #[error("expert arena: cannot start the thread that commits memory ahead: {source}")]
    Keeper { source: std::io::Error },
}

/// Per-layer geometry: each projection's region size and offset inside a slot.
#[derive(Clone, Debug)]
struct LayerGeom {
    /// Bytes of one expert's slot (sum of its projection regions).
    slot_bytes: u64,
    /// Offset of projection p's region inside the slot.
    proj_off: Vec<u64>,
    /// Length of projection p's data.
    proj_len: Vec<u64>,
}

/// Who holds which chunk. Changed on the core thread (a read being resolved, an eviction)
/// and by the keeper; the mutex makes the shared `Arena` sound, it is not contended.
#[derive(Debug)]
struct Pool {
    /// Arena offset of each (layer, expert)'s chunk, `NONE` when it holds none.
    chunk: Vec<Vec<u64>>,
    chunk_bytes: u64,
    /// Distance between chunk starts: `chunk_bytes`, or rounded up to `HUGE` with huge pages.
    stride: u64,
    /// Bytes at each chunk's head to mark `MADV_HUGEPAGE` when the chunk is first used (0: none),
    /// and the arena's base address to do it at.
    huge_head: u64,
    base: usize,
    /// Next never-used chunk, and the end of the chunk region.
    next: u64,
    end: u64,
    /// Returned or prefaulted chunks still committed (reused first), and released ones.
    warm: Vec<u64>,
    cold: Vec<u64>,
    /// Per chunk (offset / stride): bytes from its start that may be committed.
    committed: Vec<u64>,
    /// Committed bytes of warm chunks, plus chunks the keepers are committing.
    warm_bytes: u64,
    /// Chunks the keepers took and are committing (counted in `warm_bytes` already).
    preparing: u32,
    /// Bytes committed for the chunks (layer, expert)s hold.
    held_bytes: u64,
    /// Chunks handed out from the warm list (for tests and diagnostics).
    reused: u64,
    /// Chunks the keeper committed ahead of use.
    prefaulted: u64,
    /// Bytes the keepers keep committed ahead (0: no keeper), and the most the held plus
    /// the warm chunks may commit before they stop.
    stock: u64,
    limit: u64,
    stop: bool,
}

impl Pool {
    fn index(&self, off: u64) -> usize {
        (off / self.stride) as usize
    }

    /// A free chunk with nothing committed: a released one, else a never-used one (whose
    /// head is marked for huge pages here, once).
    fn take_uncommitted(&mut self) -> Option<u64> {
        if let Some(off) = self.cold.pop() {
            return Some(off);
        }
        if self.next + self.stride <= self.end {
            let off = self.next;
            self.next += self.stride;
            // SAFETY: `off..off + huge_head` is inside the chunk region of the mapping at
            // `base` and 2 MiB aligned (the base and the stride are); advice changes no data.
            unsafe { advise_huge(self.base, off, self.huge_head) };
            return Some(off);
        }
        None
    }

    /// A free chunk, warm first (then `take_uncommitted`); `true` when it was warm.
    fn take(&mut self) -> Option<(u64, bool)> {
        if let Some(off) = self.warm.pop() {
            self.warm_bytes -= self.committed[self.index(off)];
            return Some((off, true));
        }
        self.take_uncommitted().map(|off| (off, false))
    }

    /// Whether `more` bytes kept committed beside the held chunks stay within the stock and
    /// the limit.
    fn stock_has_room(&self, more: u64) -> bool {
        let warm = self.warm_bytes + more;
        warm <= self.stock && self.held_bytes + warm <= self.limit
    }

    /// Whether one more chunk committed ahead stays within the stock and the limit.
    fn keeper_has_work(&self) -> bool {
        self.stock_has_room(self.chunk_bytes)
    }

    /// A chunk for a keeper to commit, reserved in `warm_bytes`; `None` when the stock is
    /// full, the limit is reached, or no uncommitted chunk is free.
    fn take_for_keeper(&mut self) -> Option<u64> {
        if !self.keeper_has_work() {
            return None;
        }
        let off = self.take_uncommitted()?;
        self.preparing += 1;
        self.warm_bytes += self.chunk_bytes;
        Some(off)
    }
}

/// The pool and the keeper's wake-up, shared with the keeper thread.
type Shared = Arc<(Mutex<Pool>, Condvar)>;

fn lock_pool(shared: &Shared) -> MutexGuard<'_, Pool> {
    shared.0.lock().unwrap_or_else(|e| e.into_inner())
}

/// Release `len` bytes at `addr` to the kernel (they read back as zeros).
///
/// # Safety
/// The range is page aligned, inside the arena's mapping, and nobody reads it meanwhile.
unsafe fn drop_pages(addr: *mut u8, len: u64) {
    if len > 0 {
        libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_DONTNEED);
    }
}

/// Mark `len` bytes at `base + off` for transparent huge pages (no-op for 0). Best effort: a
/// kernel without THP refuses and the range keeps base pages.
///
/// # Safety
/// The range is inside the arena's mapping.
unsafe fn advise_huge(base: usize, off: u64, len: u64) {
    if len > 0 {
        libc::madvise(
            (base as *mut u8).add(off as usize) as *mut libc::c_void,
            len as usize,
            libc::MADV_HUGEPAGE,
        );
    }
}

/// Commit `len` bytes at `addr`: `MADV_POPULATE_WRITE` (Linux 5.14+), else a write per page.
///
/// # Safety
/// `addr..addr + len` is page aligned, inside a private anonymous mapping of ours (the arena's,
/// or a read buffer's), and no one else reads or writes it meanwhile (a chunk no slot holds).
pub(crate) unsafe fn commit_pages(addr: *mut u8, len: usize) {
    if libc::madvise(addr as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) == 0 {
        return;
    }
    for off in (0..len).step_by(ALIGN as usize) {
        std::ptr::write_volatile(addr.add(off), 0);
    }
}

/// A keeper: whenever woken, commit chunks until the stock is full (or the limit reached).
///
/// It runs under `SCHED_IDLE`: committing pages is CPU work (and on a VM host faults), and it
/// must not take a core from the compute threads — only the idle time while a decode waits
/// for its reads or between tokens. Falling behind just means an admission faults its own
/// pages in, as without a keeper.
fn keeper_main(shared: Shared) {
    // SAFETY: an all-zero `sched_param` is valid (priority 0, which SCHED_IDLE requires; musl's
    // has reserved fields beside it).
    let param: libc::sched_param = unsafe { std::mem::zeroed() };
    // The raw system call: musl's `sched_setscheduler` wrapper is a stub that returns ENOSYS.
    // SAFETY: plain syscall on the calling thread (pid 0) with a valid pointer; failure leaves
    // normal priority.
    unsafe {
        libc::syscall(
            libc::SYS_sched_setscheduler,
            0,
            libc::SCHED_IDLE,
            &param as *const libc::sched_param,
        )
    };
    let mut pool = lock_pool(&shared);
    loop {
        if pool.stop {
            return;
        }
        let Some(off) = pool.take_for_keeper() else {
            pool = shared.1.wait(pool).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        let (len, base) = (pool.chunk_bytes, pool.base);
        drop(pool);
        // SAFETY: the chunk is inside the mapping (the chunk region), page aligned, and held
        // by nobody: taken from the free lists under the lock and counted as `preparing`. The
        // arena joins this thread before it unmaps.
        unsafe { commit_pages((base as *mut u8).add(off as usize), len as usize) };
        pool = lock_pool(&shared);
        pool.preparing -= 1;
        let i = pool.index(off);
        pool.committed[i] = len;
        pool.warm.push(off);
        pool.prefaulted += 1;
        // An admission may be waiting for this chunk (every other one held).
        shared.1.notify_all();
    }
}

/// Stop and join keeper threads.
fn stop_keepers(pool: &Shared, keepers: &mut Vec<JoinHandle<()>>) {
    if keepers.is_empty() {
        return;
    }
    lock_pool(pool).stop = true;
    pool.1.notify_all();
    for k in keepers.drain(..) {
        let _ = k.join();
    }
}

/// Reserved memory for every expert plus staging slots.
pub struct Arena {
    /// The mapping as made (`ptr` may start up to a huge page into it).
    map: NonNull<u8>,
    map_len: u64,
    ptr: NonNull<u8>,
    len: u64,
    layers: Vec<LayerGeom>,
    n_expert: Vec<u32>,
    pool: Shared,
    keepers: Vec<JoinHandle<()>>,
    staging_base: u64,
    staging_slot: u64,
    n_staging: u32,
    /// One past the highest staging slot resolved since the last `trim_staging`.
    staging_high: AtomicU32,
}

// SAFETY: the arena is a plain memory range; who writes which slot when is decided by the
// core's cache and streamer (a slot is written only by its read and read only after the
// read completed), which the loom model of the handoff checks.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

fn region_for(len: u64) -> u64 {
    // A window covering `len` bytes starting anywhere in a page spans at most len + 2 pages.
    (len + 2 * ALIGN - 1) / ALIGN * ALIGN
}

/// How an arena commits its memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ArenaOptions {
    /// Bytes of chunks `KEEPERS` threads keep committed ahead of use; 0 starts no thread.
    pub prefault_bytes: u64,
    /// The keepers stop where the chunks held plus those committed ahead would pass this
    /// (the cache's budget, so a stock never adds to a full cache's memory).
    pub commit_limit: u64,
    /// Back each chunk's head with transparent huge pages where every slot is at least one
    /// huge page long.
    pub huge_pages: bool,
}

impl Default for ArenaOptions {
    fn default() -> Self {
        ArenaOptions {
            prefault_bytes: 0,
            commit_limit: u64::MAX,
            huge_pages: true,
        }
    }
}

impl Arena {
    /// Reserve an arena for `layers[l] = (n_expert, projection lengths)`, with `n_staging`
    /// shared slots big enough for any layer's expert, huge pages and no keeper.
    pub fn new(layers: &[(u32, Vec<u64>)], n_staging: u32) -> Result<Arena, ArenaError> {
        Self::with_options(layers, n_staging, ArenaOptions::default())
    }

    /// As `new`, with the given options.
    pub fn with_options(
        layers: &[(u32, Vec<u64>)],
        n_staging: u32,
        opts: ArenaOptions,
    ) -> Result<Arena, ArenaError> {
        let mut geoms = Vec::with_capacity(layers.len());
        let mut max_slot = ALIGN;
        let mut min_slot = u64::MAX;
        let mut n_slots = 0u64;
        for (n_expert, lens) in layers {
            let mut proj_off = Vec::with_capacity(lens.len());
            let mut s = 0;
            for &l in lens {
                proj_off.push(s);
                s += region_for(l);
            }
            max_slot = max_slot.max(s);
            if *n_expert > 0 {
                min_slot = min_slot.min(s);
            }
            n_slots += u64::from(*n_expert);
            geoms.push(LayerGeom {
                slot_bytes: s,
                proj_off,
                proj_len: lens.clone(),
            });
        }
        // The whole huge pages every slot fills: marking more would commit past a smaller
        // slot's end (a huge page is committed whole on its first touch).
        let huge_head = if opts.huge_pages && min_slot != u64::MAX {
            min_slot / HUGE * HUGE
        } else {
            0
        };
        let stride = if huge_head > 0 {
            max_slot.div_ceil(HUGE) * HUGE
        } else {
            max_slot
        };
        // Every expert could be resident at once: one chunk each, `stride` apart.
        let off = stride * n_slots;
        let staging_base = off;
        let len = (off + stride * n_staging as u64).max(ALIGN);
        // Room to start the arena on a huge page boundary.
        let map_len = len + if huge_head > 0 { HUGE } else { 0 };
        // SAFETY: an anonymous private mapping with no fixed address; MAP_NORESERVE so a
        // reservation larger than RAM + swap is accepted and pages commit on first write.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(ArenaError::Reserve {
                bytes: map_len,
                source: std::io::Error::last_os_error(),
            });
        }
        let map = NonNull::new(p as *mut u8).ok_or(ArenaError::Reserve {
            bytes: map_len,
            source: std::io::Error::other("null mapping"),
        })?;
        let lead = (map.as_ptr() as u64).next_multiple_of(if huge_head > 0 { HUGE } else { 1 })
            - map.as_ptr() as u64;
        // SAFETY: `lead < HUGE` and the mapping has `HUGE` spare bytes when `lead` can be > 0.
        let ptr = unsafe { NonNull::new_unchecked(map.as_ptr().add(lead as usize)) };
        // SAFETY: advice on our own fresh mapping. No huge pages anywhere unless marked below,
        // even where the system default is `always`: one could straddle two chunks and commit
        // memory for an expert the cache never admitted. Failure (no THP) changes nothing.
        unsafe {
            libc::madvise(p, map_len as usize, libc::MADV_NOHUGEPAGE);
            for i in 0..u64::from(n_staging) {
                advise_huge(ptr.as_ptr() as usize, staging_base + i * stride, huge_head);
            }
        }
        let pool = Pool {
            chunk: layers
                .iter()
                .map(|(n, _)| vec![NONE; *n as usize])
                .collect(),
            chunk_bytes: max_slot,
            stride,
            huge_head,
            base: ptr.as_ptr() as usize,
            next: 0,
            end: off,
            warm: Vec::new(),
            cold: Vec::new(),
            committed: vec![0; n_slots as usize],
            warm_bytes: 0,
            preparing: 0,
            held_bytes: 0,
            reused: 0,
            prefaulted: 0,
            stock: opts.prefault_bytes,
            limit: opts.commit_limit,
            stop: false,
        };
        let pool: Shared = Arc::new((Mutex::new(pool), Condvar::new()));
        let n_keepers = if opts.prefault_bytes > 0 { KEEPERS } else { 0 };
        let mut keepers = Vec::with_capacity(n_keepers);
        for i in 0..n_keepers {
            let shared = pool.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("bmoe-arena-keeper-{i}"))
                .spawn(move || keeper_main(shared));
            match spawned {
                Ok(h) => keepers.push(h),
                Err(e) => {
                    stop_keepers(&pool, &mut keepers);
                    // SAFETY: unmapping what we just mapped; the keepers that saw it are gone.
                    unsafe { libc::munmap(p, map_len as usize) };
                    return Err(ArenaError::Keeper { source: e });
                }
            }
        }
        // Stock the pool before the first read.
        pool.1.notify_all();
        Ok(Arena {
            map,
            map_len,
            ptr,
            len,
            layers: geoms,
            n_expert: layers.iter().map(|l| l.0).collect(),
            pool,
            keepers,
            staging_base,
            staging_slot: stride,
            n_staging,
            staging_high: AtomicU32::new(0),
        })
    }

    fn pool(&self) -> MutexGuard<'_, Pool> {
        lock_pool(&self.pool)
    }

    /// Arena offset of a slot, giving a canonical (layer, expert) a chunk if it has none
    /// (`assign`) — or `None` when it has none and may not get one.
    fn slot_base(&self, layer: usize, slot: SlotAddr, assign: bool) -> Option<u64> {
        match slot {
            SlotAddr::Staging(i) => {
                if assign {
                    self.staging_high.fetch_max(i + 1, Ordering::Relaxed);
                }
                Some(self.staging_base + i as u64 * self.staging_slot)
            }
            SlotAddr::Canonical(e) => {
                let mut pool = self.pool();
                let held = *pool.chunk.get(layer)?.get(e as usize)?;
                if held != NONE || !assign {
                    return (held != NONE).then_some(held);
                }
                // With every expert resident at once there is no spare chunk: the last free
                // one may be with a keeper, committing it outside the lock. Wait for it to come
                // back warm rather than fail. Still none and none being prepared: more chunks
                // than slots, which only a caller that resolves slots it never releases could
                // reach.
                let (off, warm) = loop {
                    if let Some(taken) = pool.take() {
                        break taken;
                    }
                    if pool.preparing == 0 {
                        return None;
                    }
                    pool = self.pool.1.wait(pool).unwrap_or_else(|e| e.into_inner());
                };
                if warm {
                    pool.reused += 1;
                }
                // A chunk that held a larger slot keeps no committed tail past this one.
                let i = pool.index(off);
                let want = self.layers[layer].slot_bytes;
                let had = pool.committed[i];
                if had > want {
                    // SAFETY: page aligned (slot sizes are multiples of 4096), inside this
                    // chunk, which nobody holds: it was just taken from the free lists.
                    unsafe { drop_pages(self.ptr.as_ptr().add((off + want) as usize), had - want) };
                }
                pool.committed[i] = want;
                pool.held_bytes += want;
                pool.chunk[layer][e as usize] = off;
                // Wake the keepers only when they have work: a full cache leaves them none, and
                // a wake-up per admission would only cost a context switch.
                if !self.keepers.is_empty() && pool.keeper_has_work() {
                    self.pool.1.notify_all();
                }
                Some(off)
            }
        }
    }

    /// Where the O_DIRECT window for projection `p` lands, given the extent being read. A
    /// canonical slot without memory gets a chunk here (the first read into it). Null only
    /// for a slot the arena does not have.
    pub fn window_dest(&self, layer: usize, slot: SlotAddr, p: usize) -> *mut u8 {
        let Some(base) = self.slot_base(layer, slot, true) else {
            return std::ptr::null_mut();
        };
        let off = base + self.layers[layer].proj_off[p];
        debug_assert!(off < self.len);
        // SAFETY: in bounds of the reservation by construction.
        unsafe { self.ptr.as_ptr().add(off as usize) }
    }

    /// The bytes of projection `p` once its read of `extent` completed; `None` for a
    /// canonical slot no read was ever resolved into (it holds no expert's bytes).
    ///
    /// # Safety
    /// The caller guarantees the read into this slot has completed and no read into it is in
    /// flight (the core's pinning and the handoff guarantee this).
    pub unsafe fn proj_bytes(
        &self,
        layer: usize,
        slot: SlotAddr,
        p: usize,
        extent: &Extent,
    ) -> Option<&[u8]> {
        let base = self.slot_base(layer, slot, false)?;
        let start = self
            .ptr
            .as_ptr()
            .add((base + self.layers[layer].proj_off[p] + extent.offset % ALIGN) as usize);
        Some(std::slice::from_raw_parts(
            start,
            self.layers[layer].proj_len[p] as usize,
        ))
    }

    /// The cache evicted (layer, expert): take its chunk back. It stays committed for the next
    /// admission while fewer than `WARM_MAX_BYTES` are kept so (or the stock's bytes, where
    /// the commit limit still has room); otherwise its pages go back to the kernel. A slot
    /// that holds no chunk is left alone.
    pub fn release(&self, layer: usize, expert: u32) {
        let mut pool = self.pool();
        let Some(held) = pool
            .chunk
            .get_mut(layer)
            .and_then(|l| l.get_mut(expert as usize))
        else {
            return;
        };
        let off = std::mem::replace(held, NONE);
        if off == NONE {
            return;
        }
        let i = pool.index(off);
        let len = pool.committed[i];
        pool.held_bytes -= len;
        // Kept warm within the cap, or within the stock where the limit still has room (a
        // filling cache that evicts, e.g. after a shrink of its budget, keeps its stock).
        if pool.warm_bytes + len <= WARM_MAX_BYTES || pool.stock_has_room(len) {
            pool.warm_bytes += len;
            pool.warm.push(off);
            return;
        }
        // SAFETY: the chunk is ours and nobody reads it any more (the cache evicted it).
        unsafe { drop_pages(self.ptr.as_ptr().add(off as usize), len) };
        pool.committed[i] = 0;
        pool.cold.push(off);
    }

    /// Give back the memory of staging slots `keep..`: a prefill reads a layer's whole union
    /// of routed experts into staging, a decode step only its top k, so the engine trims to k
    /// when decoding starts and the wider union's pages do not stay resident all run. A no-op
    /// when no slot past `keep` was used since the last trim.
    ///
    /// Call only between steps, when no read into staging is in flight and no compute reads
    /// it (staging is valid only until its layer finishes; speculative reads never target it).
    pub fn trim_staging(&self, keep: u32) {
        let high = self.staging_high.load(Ordering::Relaxed);
        if high <= keep {
            return;
        }
        self.staging_high.store(keep, Ordering::Relaxed);
        let from = self.staging_base + u64::from(keep) * self.staging_slot;
        let to = self.staging_base + u64::from(high) * self.staging_slot;
        // SAFETY: page aligned (the slot stride is), inside the staging region, and by the
        // contract above nobody reads or writes those slots now.
        unsafe { drop_pages(self.ptr.as_ptr().add(from as usize), to - from) };
    }

    /// Chunks reused warm since the arena was made.
    pub fn reused_chunks(&self) -> u64 {
        self.pool().reused
    }

    /// Chunks the keepers committed ahead of use since the arena was made.
    pub fn prefaulted_chunks(&self) -> u64 {
        self.pool().prefaulted
    }

    /// Bytes of returned or stocked chunks kept committed for reuse right now.
    pub fn warm_bytes(&self) -> u64 {
        self.pool().warm_bytes
    }

    pub fn n_staging(&self) -> u32 {
        self.n_staging
    }

    pub fn n_expert(&self, layer: usize) -> u32 {
        self.n_expert[layer]
    }

    /// Bytes of memory one expert of `layer` occupies when resident.
    pub fn slot_bytes(&self, layer: usize) -> u64 {
        self.layers[layer].slot_bytes
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // The keepers write into the mapping: they must be gone before the unmap.
        stop_keepers(&self.pool, &mut self.keepers);
        // SAFETY: unmapping exactly what `with_options` mapped.
        unsafe {
            libc::munmap(
                self.map.as_ptr() as *mut libc::c_void,
                self.map_len as usize,
            );
        }
    }
}

/// A slot inside a layer: the expert's canonical place or a staging buffer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SlotAddr {
    Canonical(u32),
    Staging(u32),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_aligned_and_cover_the_extent() {
        let e = Extent {
            shard: 0,
            offset: 5000,
            len: 10000,
        };
        let (lo, n) = e.window();
        assert_eq!(lo % ALIGN, 0);
        assert_eq!(n % ALIGN, 0);
        assert!(lo <= 5000 && lo + n >= 15000);
        assert!(n <= region_for(10000));
    }

    #[test]
    fn chunks_do_not_overlap_and_are_aligned() {
        let a = Arena::new(&[(4, vec![5000, 5000, 7000]), (2, vec![100, 100, 100])], 2).unwrap();
        let mut spans = Vec::new();
        for (layer, n) in [(0usize, 4u32), (1, 2)] {
            for e in 0..n {
                let lo = a.window_dest(layer, SlotAddr::Canonical(e), 0) as usize;
                assert_eq!(lo % ALIGN as usize, 0);
                spans.push((lo, lo + a.slot_bytes(layer) as usize));
            }
        }
        for i in 0..2 {
            let lo = a.window_dest(0, SlotAddr::Staging(i), 0) as usize;
            spans.push((lo, lo + a.slot_bytes(0).max(a.slot_bytes(1)) as usize));
        }
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "{:?} overlaps {:?}", w[0], w[1]);
        }
        // Projection regions inside a slot do not overlap either.
        let p0 = a.window_dest(0, SlotAddr::Canonical(1), 2) as usize;
        let p1 = a.window_dest(0, SlotAddr::Canonical(1), 1) as usize;
        assert!(p1 + region_for(5000) as usize <= p0);
    }

    #[test]
    fn an_evicted_chunk_is_reused_warm_by_the_next_admission_of_any_size() {
        // Layer 0 has the large slots, layer 1 small ones.
        let a = Arena::new(&[(3, vec![9000, 9000, 9000]), (3, vec![100, 100, 100])], 1).unwrap();
        let ext = Extent {
            shard: 0,
            offset: 0,
            len: 100,
        };
        assert!(unsafe { a.proj_bytes(0, SlotAddr::Canonical(0), 0, &ext) }.is_none());
        let first = a.window_dest(0, SlotAddr::Canonical(0), 0);
        let big = a.slot_bytes(0) as usize;
        unsafe {
            *first = 7;
            *first.add(big - 1) = 9;
        }
        // The same slot keeps its chunk until it is released.
        assert_eq!(a.window_dest(0, SlotAddr::Canonical(0), 0), first);
        a.release(0, 0);
        assert!(unsafe { a.proj_bytes(0, SlotAddr::Canonical(0), 0, &ext) }.is_none());
        assert_eq!(a.warm_bytes(), a.slot_bytes(0));
        // A small slot takes the large chunk: its head keeps its pages, the tail past the
        // small slot is released.
        let reused = a.window_dest(1, SlotAddr::Canonical(2), 0);
        assert_eq!(reused, first);
        assert_eq!(unsafe { *reused }, 7, "a warm chunk keeps its pages");
        assert_eq!(unsafe { *reused.add(big - 1) }, 0, "the tail was released");
        assert_eq!(a.reused_chunks(), 1);
        assert_eq!(a.warm_bytes(), 0);
        // Back on the warm list it counts only what the small slot committed.
        a.release(1, 2);
        assert_eq!(a.warm_bytes(), a.slot_bytes(1));
        // Releasing twice, or a slot that holds nothing, changes nothing.
        a.release(1, 2);
        a.release(0, 1);
        assert_eq!(a.warm_bytes(), a.slot_bytes(1));
        // The next large slot takes it again.
        assert_eq!(a.window_dest(0, SlotAddr::Canonical(1), 0), first);
    }

    #[test]
    fn the_keeper_commits_chunks_ahead_and_admissions_take_them() {
        let a = Arena::with_options(
            &[(8, vec![9000, 9000, 9000]), (8, vec![100, 100, 100])],
            1,
            ArenaOptions {
                prefault_bytes: 2 * 3 * region_for(9000),
                commit_limit: u64::MAX,
                huge_pages: true,
            },
        )
        .unwrap();
        let wait_for = |n: u64| {
            let t = std::time::Instant::now();
            while a.prefaulted_chunks() < n {
                assert!(
                    t.elapsed().as_secs() < 10,
                    "keeper stalled at {}",
                    a.prefaulted_chunks()
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        // Two chunks stocked before any read.
        wait_for(2);
        assert_eq!(a.warm_bytes(), 2 * a.slot_bytes(0));
        // Every slot gets its own chunk, the first ones from the keeper's stock, and no chunk
        // is ever handed out twice while the keeper takes more beside the admissions.
        let mut seen = std::collections::HashSet::new();
        for (layer, e) in (0..2usize).flat_map(|l| (0..8u32).map(move |e| (l, e))) {
            let p = a.window_dest(layer, SlotAddr::Canonical(e), 0) as usize;
            assert!(seen.insert(p), "chunk {p:#x} handed out twice");
        }
        assert!(a.reused_chunks() >= 2);
        // Releasing everything keeps the warm bytes under the cap; dropping joins the keeper.
        for e in 0..8u32 {
            a.release(0, e);
            a.release(1, e);
        }
        assert!(a.warm_bytes() <= WARM_MAX_BYTES);
        drop(a);
    }

    #[test]
    fn an_admission_waits_for_a_chunk_a_keeper_is_committing_instead_of_failing() {
        // Every expert resident at once leaves no spare chunk: when the keepers hold the last
        // free chunk (committing it outside the lock), the admission that needs it must wait
        // for it, not fail with "no memory left" (seen under load in gate G8).
        let a = Arena::with_options(
            // Chunks larger than the warm cap, a stock of one chunk: most released chunks go
            // back cold, and the keepers commit them again while the next round admits.
            &[(4, vec![20 << 20, 20 << 20]), (4, vec![20 << 20, 20 << 20])],
            1,
            ArenaOptions {
                prefault_bytes: 100 << 20,
                commit_limit: u64::MAX,
                huge_pages: false,
            },
        )
        .unwrap();
        for round in 0..30 {
            for (layer, e) in (0..2usize).flat_map(|l| (0..4u32).map(move |e| (l, e))) {
                let p = a.window_dest(layer, SlotAddr::Canonical(e), 0);
                assert!(
                    !p.is_null(),
                    "round {round}: layer {layer} expert {e} got no chunk"
                );
                // The read that fills the slot: time for a keeper to take a chunk meanwhile.
                // SAFETY: the slot's first projection region is this chunk's, held by no one else.
                unsafe { std::ptr::write_bytes(p, 1, 20 << 20) };
            }
            for e in 0..4u32 {
                a.release(0, e);
                a.release(1, e);
            }
            // Let a keeper start committing a cold chunk before the next round needs it.
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    #[test]
    fn the_keepers_stock_only_the_room_the_limit_leaves() {
        let chunk = 3 * region_for(9000);
        // A stock of 100 chunks under a limit of 4: the keepers stop at 4.
        let a = Arena::with_options(
            &[(8, vec![9000, 9000, 9000])],
            0,
            ArenaOptions {
                prefault_bytes: 100 * chunk,
                commit_limit: 4 * chunk,
                huge_pages: false,
            },
        )
        .unwrap();
        let settle = |n: u64| {
            let t = std::time::Instant::now();
            while a.prefaulted_chunks() < n {
                assert!(t.elapsed().as_secs() < 10, "keepers stalled");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            // Time for a keeper that would wrongly go on.
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        settle(4);
        assert_eq!(a.prefaulted_chunks(), 4);
        assert_eq!(a.warm_bytes(), 4 * chunk);
        // Three admissions take stocked chunks; held + stock is still 4 chunks, so no more.
        for e in 0..3 {
            a.window_dest(0, SlotAddr::Canonical(e), 0);
        }
        settle(4);
        assert_eq!(a.prefaulted_chunks(), 4);
        assert_eq!(a.reused_chunks(), 3);
        assert_eq!(a.warm_bytes(), chunk);
        // Past the limit admissions fault their own chunks, and the keepers stay idle.
        for e in 3..8 {
            a.window_dest(0, SlotAddr::Canonical(e), 0);
        }
        settle(4);
        assert_eq!(a.prefaulted_chunks(), 4);
        assert_eq!(a.warm_bytes(), 0);
        // Evictions from the over-full set: kept warm within WARM_MAX_BYTES as always, and
        // once held + warm is back under the limit the keepers refill nothing past it.
        for e in 0..8 {
            a.release(0, e);
        }
        assert_eq!(a.warm_bytes(), 8 * chunk);
        settle(4);
        assert_eq!(
            a.prefaulted_chunks(),
            4,
            "warm chunks from evictions count as stock"
        );
    }

    /// Resident 4 KiB pages of `[p, p + len)` by `mincore`.
    fn resident_pages(p: *const u8, len: usize) -> usize {
        let pages = len.div_ceil(ALIGN as usize);
        let mut v = vec![0u8; pages];
        // SAFETY: `p` is page aligned inside a live mapping and `v` has one byte per page.
        let rc = unsafe { libc::mincore(p as *mut libc::c_void, len, v.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().filter(|&&b| b & 1 != 0).count()
    }

    fn thp_enabled() -> bool {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .map(|s| !s.contains("[never]"))
            .unwrap_or(false)
    }

    #[test]
    fn huge_page_heads_are_aligned_and_never_commit_past_a_slot() {
        // Two slot sizes above one huge page (2.5 and 3 MiB, like Q4_K_M's two down types):
        // chunks are 2 MiB aligned and 4 MiB apart, and only the first 2 MiB of each is marked.
        let mib = 1u64 << 20;
        let layers = [
            (3, vec![mib, mib, mib / 2 - 4 * ALIGN]),
            (3, vec![mib, mib, mib - 4 * ALIGN]),
        ];
        let a = Arena::new(&layers, 1).unwrap();
        let small = a.slot_bytes(0) as usize;
        let big = a.slot_bytes(1) as usize;
        assert!(small < big && small as u64 > HUGE);
        let mut chunks = Vec::new();
        for (layer, slot) in [(0usize, small), (1, big), (0, small), (1, big)] {
            let e = chunks.len() as u32 / 2;
            let p = a.window_dest(layer, SlotAddr::Canonical(e), 0);
            assert_eq!(p as u64 % HUGE, 0, "chunk {p:?} not huge-page aligned");
            // Fill the slot as a read would.
            unsafe { std::ptr::write_bytes(p, 0xab, slot) };
            chunks.push((p, slot));
        }
        let stride = 4 * mib as usize;
        for w in chunks.windows(2) {
            assert_eq!(w[1].0 as usize - w[0].0 as usize, stride);
        }
        // Every slot is resident, and nothing past it: the head's huge page lies inside the
        // smallest slot, the tail is in base pages.
        for &(p, slot) in &chunks {
            assert_eq!(resident_pages(p, slot), slot / ALIGN as usize);
            let rest = stride - slot;
            assert_eq!(
                resident_pages(unsafe { p.add(slot) }, rest),
                0,
                "memory committed past a {slot}-byte slot"
            );
        }
        // Where the kernel has THP, the heads are huge pages (mincore cannot tell; smaps can).
        if thp_enabled() {
            let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
            let huge_kib: u64 = smaps
                .lines()
                .filter_map(|l| l.strip_prefix("AnonHugePages:"))
                .filter_map(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .sum();
            assert!(
                huge_kib >= 4 * HUGE / 1024,
                "expected the four chunk heads in huge pages, AnonHugePages {huge_kib} kB"
            );
        }
    }

    #[test]
    fn slots_under_one_huge_page_or_huge_pages_off_keep_the_plain_layout() {
        let mib = 1u64 << 20;
        for (layers, huge) in [
            (vec![(4u32, vec![mib, mib / 2])], true),
            (vec![(4u32, vec![mib, mib, mib])], false),
        ] {
            let a = Arena::with_options(
                &layers,
                1,
                ArenaOptions {
                    huge_pages: huge,
                    ..ArenaOptions::default()
                },
            )
            .unwrap();
            let p0 = a.window_dest(0, SlotAddr::Canonical(0), 0) as u64;
            let p1 = a.window_dest(0, SlotAddr::Canonical(1), 0) as u64;
            assert_eq!(p1 - p0, a.slot_bytes(0), "chunks packed at the slot size");
        }
    }

    #[test]
    fn trimming_staging_releases_the_slots_past_keep_only() {
        let a = Arena::new(&[(8, vec![20_000, 20_000, 20_000])], 8).unwrap();
        let slot = a.slot_bytes(0) as usize;
        let mut ptrs = Vec::new();
        for i in 0..6u32 {
            let p = a.window_dest(0, SlotAddr::Staging(i), 0);
            unsafe { std::ptr::write_bytes(p, 1 + i as u8, slot) };
            ptrs.push(p);
        }
        a.trim_staging(2);
        for (i, &p) in ptrs.iter().enumerate() {
            let want = if i < 2 { slot / ALIGN as usize } else { 0 };
            assert_eq!(resident_pages(p, slot), want, "staging slot {i}");
        }
        assert_eq!(unsafe { *ptrs[1] }, 2, "kept slots keep their bytes");
        // Nothing used past keep since: a second trim releases nothing, and slots below keep
        // used again stay.
        unsafe { std::ptr::write_bytes(a.window_dest(0, SlotAddr::Staging(0), 0), 9, slot) };
        a.trim_staging(2);
        assert_eq!(resident_pages(ptrs[0], slot), slot / ALIGN as usize);
        // A slot past keep used again is released by the next trim.
        unsafe { std::ptr::write_bytes(a.window_dest(0, SlotAddr::Staging(7), 0), 3, slot) };
        let p7 = a.window_dest(0, SlotAddr::Staging(7), 0);
        assert_eq!(resident_pages(p7, slot), slot / ALIGN as usize);
        a.trim_staging(2);
        assert_eq!(resident_pages(p7, slot), 0);
    }

    #[test]
    fn past_the_warm_cap_released_chunks_go_back_to_the_kernel() {
        // Slots of 8 MiB: four fill the 32 MiB cap, the fifth is released cold.
        let big = 8 << 20;
        let a = Arena::new(&[(6, vec![big - 2 * ALIGN, ALIGN, ALIGN])], 0).unwrap();
        let slot = a.slot_bytes(0);
        let mut ptrs = Vec::new();
        for e in 0..6u32 {
            let p = a.window_dest(0, SlotAddr::Canonical(e), 0);
            unsafe { *p = 1 + e as u8 };
            ptrs.push(p);
        }
        for e in 0..6u32 {
            a.release(0, e);
        }
        let warm = WARM_MAX_BYTES / slot;
        assert_eq!(a.warm_bytes(), warm * slot);
        // Every chunk still reads its old byte or zero, and the cold ones read zero.
        let zeros = ptrs.iter().filter(|&&p| unsafe { *p } == 0).count() as u64;
        assert_eq!(zeros, 6 - warm);
        // All six chunks are handed out again before any new memory: warm first.
        let mut again: Vec<_> = (0..6u32)
            .map(|e| a.window_dest(0, SlotAddr::Canonical(e), 0))
            .collect();
        again.sort();
        ptrs.sort();
        assert_eq!(again, ptrs);
        assert_eq!(a.reused_chunks(), warm);
    }
}
