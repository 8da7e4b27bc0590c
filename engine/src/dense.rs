//! Dense-weight residency policies (`--dense-weights mmap|warm|anon`).
//!
//! The dense part of a MoE model (attention, routers, embeddings, head) is needed by every
//! token, so it must stay resident. On plain mmap the kernel may drop those file pages under
//! memory pressure and fault them back from flash inside a decode (major faults that read
//! as "compute"). `anon` copies them into anonymous memory, which the kernel can only swap
//! (zram on phones), never silently re-read from flash.

use std::alloc::{alloc, dealloc, Layout};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

const ALIGN: usize = 4096;

/// The `--dense-weights` modes this engine implements.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum DenseMode {
    Mmap,
    Warm,
    Anon,
}

impl From<bmoe_core::config::DenseWeights> for DenseMode {
    fn from(d: bmoe_core::config::DenseWeights) -> Self {
        match d {
            bmoe_core::config::DenseWeights::Mmap => DenseMode::Mmap,
            bmoe_core::config::DenseWeights::Warm => DenseMode::Warm,
            bmoe_core::config::DenseWeights::Anon => DenseMode::Anon,
        }
    }
}

/// Touch every page of `bytes` once, in order; returns the bytes swept.
pub fn warm(bytes: &[u8]) -> usize {
    let mut acc = 0u8;
    for chunk in bytes.chunks(ALIGN) {
        acc = acc.wrapping_add(chunk[0]);
    }
    std::hint::black_box(acc);
    bytes.len()
}

/// Drop the page-aligned interior of a file-mapped range from our mapping (the bytes are
/// no longer read through it).
pub fn drop_map_pages(bytes: &[u8]) {
    let start = (bytes.as_ptr() as usize).div_ceil(ALIGN) * ALIGN;
    let end = (bytes.as_ptr() as usize + bytes.len()) / ALIGN * ALIGN;
    if end > start {
        // SAFETY: the range lies inside a live read-only file mapping we own; MADV_DONTNEED
        // only drops our page-table entries (a later access would fault the file back in).
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
        }
    }
}

/// A 4096-aligned anonymous buffer holding one tensor's bytes.
pub struct AnonBuf {
    ptr: *mut u8,
    cap: usize,
    /// Offset of the tensor's first byte inside the buffer (the O_DIRECT window starts on a
    /// page boundary before it).
    start: usize,
    len: usize,
}

// SAFETY: the buffer is written once at creation and only read afterwards.
unsafe impl Send for AnonBuf {}
unsafe impl Sync for AnonBuf {}

impl AnonBuf {
    /// Read `len` bytes at `offset` of `path` into a new buffer, with O_DIRECT when the
    /// filesystem allows it (so the copy does not also fill the page cache), else buffered.
    pub fn read(path: &Path, offset: u64, len: usize) -> std::io::Result<AnonBuf> {
        let lo = offset / ALIGN as u64 * ALIGN as u64;
        let hi = (offset + len as u64).div_ceil(ALIGN as u64) * ALIGN as u64;
        let cap = (hi - lo) as usize;
        let layout =
            Layout::from_size_align(cap.max(ALIGN), ALIGN).map_err(std::io::Error::other)?;
        // SAFETY: non-zero size, valid alignment.
        let ptr = unsafe { alloc(layout) };
        if ptr.is_null() {
            return Err(std::io::Error::other(format!(
                "cannot allocate {cap} bytes"
            )));
        }
        let mut buf = AnonBuf {
            ptr,
            cap: cap.max(ALIGN),
            start: (offset - lo) as usize,
            len,
        };
        // SAFETY: ptr is valid for cap bytes, exclusively ours.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.ptr, cap) };
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path);
        let done = match direct {
            Ok(f) => read_fully(&f, lo, dst)
                .map(|n| n >= buf.start + len)
                .unwrap_or(false),
            Err(_) => false,
        };
        if !done {
            let f = File::open(path)?;
            let d = &mut dst[buf.start..buf.start + len];
            f.read_exact_at(d, offset)?;
        }
        buf.len = len;
        Ok(buf)
    }

    pub fn data(&self) -> &[u8] {
        // SAFETY: start + len <= cap, written at creation.
        unsafe { std::slice::from_raw_parts(self.ptr.add(self.start), self.len) }
    }
}

fn read_fully(f: &File, mut off: u64, mut dst: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while !dst.is_empty() {
        match f.read_at(dst, off) {
            Ok(0) => break,
            Ok(k) => {
                n += k;
                off += k as u64;
                dst = &mut dst[k..];
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

impl Drop for AnonBuf {
    fn drop(&mut self) {
        if let Ok(layout) = Layout::from_size_align(self.cap, ALIGN) {
            // SAFETY: allocated in `read` with this layout.
            unsafe { dealloc(self.ptr, layout) };
        }
    }
}
