//! The expert arena: where streamed expert bytes live in memory.
//!
//! One virtual address range is reserved (never committed up front). Expert slots are
//! carved from it in *chunks*, one size class per distinct slot size (layers quantized the
//! same way share a class), plus a few fixed staging slots for the cache-off mode. A cached
//! (layer, expert) gets a chunk when its first read is resolved and gives it back when the
//! cache evicts it. Returned chunks stay committed, up to `WARM_MAX_BYTES` in total, and the
//! next admission of the same class reuses one: in a full cache every admission follows an
//! eviction, so its read lands in pages that are already there instead of faulting in and
//! zeroing a fresh ~3 MiB (measured ~10 % of a cold burst's read time on this machine, and
//! page faults cost more on a phone's cores). Past that cap a returned chunk is released with
//! `madvise(MADV_DONTNEED)`, so resident memory tracks the cache's byte budget (plus at most
//! the cap), not the model's size.
//!
//! Each projection gets a 4096-aligned region big enough for the O_DIRECT window that
//! covers it: the read lands at the region start and the projection's bytes begin at
//! `offset % 4096`, so buffered and direct reads put the data at the same address.

use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

/// O_DIRECT alignment of buffers, offsets and lengths.
pub const ALIGN: u64 = 4096;

/// Most bytes of evicted chunks kept committed for reuse (the rest are released at once).
pub const WARM_MAX_BYTES: u64 = 32 << 20;

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
    /// The chunk size class this layer's slots come from.
    class: usize,
}

/// Chunks of one slot size.
#[derive(Debug)]
struct Class {
    slot_bytes: u64,
    /// Next never-used chunk, and the end of the class's region.
    next: u64,
    end: u64,
    /// Returned chunks still committed (reused first) and released ones.
    warm: Vec<u64>,
    cold: Vec<u64>,
}

/// Who holds which chunk. Changed only on the core thread (a read being resolved, an
/// eviction); the mutex makes the shared `Arena` sound, not fast paths contended.
#[derive(Debug)]
struct Pool {
    /// Arena offset of each (layer, expert)'s chunk, `NONE` when it holds none.
    chunk: Vec<Vec<u64>>,
    classes: Vec<Class>,
    warm_bytes: u64,
    /// Chunks handed out from the warm list (for tests and diagnostics).
    reused: u64,
}

/// Reserved memory for every expert plus staging slots.
pub struct Arena {
    ptr: NonNull<u8>,
    len: u64,
    layers: Vec<LayerGeom>,
    n_expert: Vec<u32>,
    pool: Mutex<Pool>,
    staging_base: u64,
    staging_slot: u64,
    n_staging: u32,
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

impl Arena {
    /// Reserve an arena for `layers[l] = (n_expert, projection lengths)`, with `n_staging`
    /// shared slots big enough for any layer's expert.
    pub fn new(layers: &[(u32, Vec<u64>)], n_staging: u32) -> Result<Arena, ArenaError> {
        let mut geoms = Vec::with_capacity(layers.len());
        let mut classes: Vec<Class> = Vec::new();
        // Slots per class: every expert of every layer of that size could be resident at once.
        let mut class_slots: Vec<u64> = Vec::new();
        let mut max_slot = ALIGN;
        for (n_expert, lens) in layers {
            let mut proj_off = Vec::with_capacity(lens.len());
            let mut s = 0;
            for &l in lens {
                proj_off.push(s);
                s += region_for(l);
            }
            max_slot = max_slot.max(s);
            let class = match classes.iter().position(|c| c.slot_bytes == s) {
                Some(c) => c,
                None => {
                    classes.push(Class {
                        slot_bytes: s,
                        next: 0,
                        end: 0,
                        warm: Vec::new(),
                        cold: Vec::new(),
                    });
                    class_slots.push(0);
                    classes.len() - 1
                }
            };
            class_slots[class] += u64::from(*n_expert);
            geoms.push(LayerGeom {
                slot_bytes: s,
                proj_off,
                proj_len: lens.clone(),
                class,
            });
        }
        let mut off = 0u64;
        for (c, n) in classes.iter_mut().zip(&class_slots) {
            c.next = off;
            off += c.slot_bytes * n;
            c.end = off;
        }
        let staging_base = off;
        let len = off + max_slot * n_staging as u64;
        let len = len.max(ALIGN);
        // SAFETY: an anonymous private mapping with no fixed address; MAP_NORESERVE so a
        // reservation larger than RAM + swap is accepted and pages commit on first write.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(ArenaError::Reserve {
                bytes: len,
                source: std::io::Error::last_os_error(),
            });
        }
        let ptr = NonNull::new(p as *mut u8).ok_or(ArenaError::Reserve {
            bytes: len,
            source: std::io::Error::other("null mapping"),
        })?;
        let pool = Pool {
            chunk: layers
                .iter()
                .map(|(n, _)| vec![NONE; *n as usize])
                .collect(),
            classes,
            warm_bytes: 0,
            reused: 0,
        };
        Ok(Arena {
            ptr,
            len,
            layers: geoms,
            n_expert: layers.iter().map(|l| l.0).collect(),
            pool: Mutex::new(pool),
            staging_base,
            staging_slot: max_slot,
            n_staging,
        })
    }

    fn pool(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Arena offset of a slot, giving a canonical (layer, expert) a chunk if it has none
    /// (`assign`) — or `None` when it has none and may not get one.
    fn slot_base(&self, layer: usize, slot: SlotAddr, assign: bool) -> Option<u64> {
        match slot {
            SlotAddr::Staging(i) => Some(self.staging_base + i as u64 * self.staging_slot),
            SlotAddr::Canonical(e) => {
                let mut pool = self.pool();
                let held = *pool.chunk.get(layer)?.get(e as usize)?;
                if held != NONE || !assign {
                    return (held != NONE).then_some(held);
                }
                let class = self.layers[layer].class;
                let Pool {
                    classes,
                    warm_bytes,
                    reused,
                    ..
                } = &mut *pool;
                let c = &mut classes[class];
                let off = if let Some(off) = c.warm.pop() {
                    *warm_bytes -= c.slot_bytes;
                    *reused += 1;
                    off
                } else if let Some(off) = c.cold.pop() {
                    off
                } else if c.next + c.slot_bytes <= c.end {
                    c.next += c.slot_bytes;
                    c.next - c.slot_bytes
                } else {
                    // More chunks than the class has slots: only a caller that resolves slots
                    // it never releases could get here.
                    return None;
                };
                pool.chunk[layer][e as usize] = off;
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
    /// admission of its size while fewer than `WARM_MAX_BYTES` are kept so; otherwise its
    /// pages go back to the kernel. A slot that holds no chunk is left alone.
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
        let class = self.layers[layer].class;
        let len = self.layers[layer].slot_bytes;
        if pool.warm_bytes + len <= WARM_MAX_BYTES {
            pool.warm_bytes += len;
            pool.classes[class].warm.push(off);
            return;
        }
        // SAFETY: the range is page aligned and inside our mapping; MADV_DONTNEED on a
        // private anonymous mapping only drops the pages (they read back as zeros).
        unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(off as usize) as *mut libc::c_void,
                len as usize,
                libc::MADV_DONTNEED,
            );
        }
        pool.classes[class].cold.push(off);
    }

    /// Chunks reused warm since the arena was made.
    pub fn reused_chunks(&self) -> u64 {
        self.pool().reused
    }

    /// Bytes of returned chunks kept committed for reuse right now.
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
        // SAFETY: unmapping exactly what `new` mapped.
        unsafe {
            libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len as usize);
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
    fn an_evicted_chunk_is_reused_warm_by_the_next_admission_of_its_size() {
        // Layers 0 and 2 share a size class, layer 1 has its own.
        let a = Arena::new(
            &[(3, vec![9000, 9000, 9000]), (3, vec![100, 100, 100]), (3, vec![9000, 9000, 9000])],
            1,
        )
        .unwrap();
        let ext = Extent {
            shard: 0,
            offset: 0,
            len: 100,
        };
        assert!(unsafe { a.proj_bytes(0, SlotAddr::Canonical(0), 0, &ext) }.is_none());
        let first = a.window_dest(0, SlotAddr::Canonical(0), 0);
        unsafe { *first = 7 };
        // The same slot keeps its chunk until it is released.
        assert_eq!(a.window_dest(0, SlotAddr::Canonical(0), 0), first);
        a.release(0, 0);
        assert!(unsafe { a.proj_bytes(0, SlotAddr::Canonical(0), 0, &ext) }.is_none());
        assert_eq!(a.warm_bytes(), a.slot_bytes(0));
        // Another size does not take it; the same size in another layer does, pages and all.
        let other = a.window_dest(1, SlotAddr::Canonical(0), 0);
        assert_ne!(other, first);
        let reused = a.window_dest(2, SlotAddr::Canonical(1), 0);
        assert_eq!(reused, first);
        assert_eq!(unsafe { *reused }, 7, "a warm chunk keeps its pages");
        assert_eq!(a.reused_chunks(), 1);
        assert_eq!(a.warm_bytes(), 0);
        // Releasing twice, or a slot that holds nothing, changes nothing.
        a.release(2, 1);
        a.release(2, 1);
        a.release(2, 2);
        assert_eq!(a.warm_bytes(), a.slot_bytes(2));
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
