//! The expert arena: where streamed expert bytes live in memory.
//!
//! One virtual address range is reserved (never committed up front) with a fixed place for
//! every (layer, expert) — the core's `SlotId::Canonical` — plus a few shared staging slots
//! for the cache-off mode. Pages are committed by the kernel when a read lands in them and
//! released with `madvise(MADV_DONTNEED)` when the cache evicts the expert, so resident
//! memory tracks the cache's byte budget, not the model's size.
//!
//! Each projection gets a 4096-aligned region big enough for the O_DIRECT window that
//! covers it: the read lands at the region start and the projection's bytes begin at
//! `offset % 4096`, so buffered and direct reads put the data at the same address.

use std::ptr::NonNull;

/// O_DIRECT alignment of buffers, offsets and lengths.
pub const ALIGN: u64 = 4096;

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
    /// Offset of this layer's first slot in the arena.
    base: u64,
}

/// Reserved memory for every expert plus staging slots.
pub struct Arena {
    ptr: NonNull<u8>,
    len: u64,
    layers: Vec<LayerGeom>,
    n_expert: Vec<u32>,
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
        let mut off = 0u64;
        let mut max_slot = ALIGN;
        for (n_expert, lens) in layers {
            let mut proj_off = Vec::with_capacity(lens.len());
            let mut s = 0;
            for &l in lens {
                proj_off.push(s);
                s += region_for(l);
            }
            max_slot = max_slot.max(s);
            geoms.push(LayerGeom {
                slot_bytes: s,
                proj_off,
                proj_len: lens.clone(),
                base: off,
            });
            off += s * *n_expert as u64;
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
        Ok(Arena {
            ptr,
            len,
            layers: geoms,
            n_expert: layers.iter().map(|l| l.0).collect(),
            staging_base,
            staging_slot: max_slot,
            n_staging,
        })
    }

    /// Arena offset of a slot: canonical (layer, expert) or staging index.
    fn slot_base(&self, layer: usize, slot: SlotAddr) -> u64 {
        match slot {
            SlotAddr::Canonical(e) => {
                self.layers[layer].base + e as u64 * self.layers[layer].slot_bytes
            }
            SlotAddr::Staging(i) => self.staging_base + i as u64 * self.staging_slot,
        }
    }

    /// Where the O_DIRECT window for projection `p` lands, given the extent being read.
    pub fn window_dest(&self, layer: usize, slot: SlotAddr, p: usize) -> *mut u8 {
        let off = self.slot_base(layer, slot) + self.layers[layer].proj_off[p];
        debug_assert!(off < self.len);
        // SAFETY: in bounds of the reservation by construction.
        unsafe { self.ptr.as_ptr().add(off as usize) }
    }

    /// The bytes of projection `p` once its read of `extent` completed.
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
    ) -> &[u8] {
        let start = self
            .window_dest(layer, slot, p)
            .add((extent.offset % ALIGN) as usize);
        std::slice::from_raw_parts(start, self.layers[layer].proj_len[p] as usize)
    }

    /// Release a canonical slot's pages back to the kernel (after eviction).
    pub fn release(&self, layer: usize, expert: u32) {
        let off = self.slot_base(layer, SlotAddr::Canonical(expert));
        let len = self.layers[layer].slot_bytes;
        // SAFETY: the range is page aligned and inside our mapping; MADV_DONTNEED on a
        // private anonymous mapping only drops the pages (they read back as zeros).
        unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(off as usize) as *mut libc::c_void,
                len as usize,
                libc::MADV_DONTNEED,
            );
        }
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
    fn slots_do_not_overlap_and_release_zeroes() {
        let a = Arena::new(&[(4, vec![5000, 5000, 7000]), (2, vec![100, 100, 100])], 2).unwrap();
        let p0 = a.window_dest(0, SlotAddr::Canonical(1), 2) as usize;
        let p1 = a.window_dest(0, SlotAddr::Canonical(2), 0) as usize;
        assert!(p0 + region_for(7000) as usize <= p1);
        unsafe { *a.window_dest(1, SlotAddr::Canonical(1), 0) = 7 };
        a.release(1, 1);
        assert_eq!(unsafe { *a.window_dest(1, SlotAddr::Canonical(1), 0) }, 0);
        assert_eq!(
            a.window_dest(0, SlotAddr::Canonical(0), 0) as usize % ALIGN as usize,
            0
        );
    }
}
