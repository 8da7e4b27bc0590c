//! Process memory and CPU probes (getrusage, /proc/self/status, /proc/meminfo, mincore, the
//! cgroup memory limit): the engine's answers to the telemetry's memory-picture questions.
//!
//! Every probe answers "unknown" instead of failing — `0` for counters and sizes, `-1` for
//! fractions, `None` for limits — because telemetry must never stop a generation, and the
//! formats define those values as "unmeasured". Parsing is split into pure functions over
//! `&str` so it is tested on fixture text, not only on whatever machine runs the tests.

use std::path::{Path, PathBuf};
use std::time::Instant;

/// CPU time and fault counts of the whole process.
#[derive(Copy, Clone, Debug, Default)]
pub struct Rusage {
    /// User + system CPU seconds, summed over all threads.
    pub cpu_s: f64,
    /// Major page faults (served from storage).
    pub majflt: u64,
    pub minflt: u64,
    pub maxrss_kib: u64,
}

/// `getrusage(RUSAGE_SELF)`; all zero when the call fails.
pub fn rusage() -> Rusage {
    // SAFETY: getrusage writes into the zeroed struct we pass; RUSAGE_SELF is always valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    if rc != 0 {
        return Rusage::default();
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Rusage {
        cpu_s: tv(ru.ru_utime) + tv(ru.ru_stime),
        majflt: ru.ru_majflt as u64,
        minflt: ru.ru_minflt as u64,
        maxrss_kib: ru.ru_maxrss as u64,
    }
}

/// The system page size in bytes (4096 when it cannot be read). `majflt_mib` is
/// `majflt × page_size_bytes()`.
pub fn page_size_bytes() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// This process's resident and swapped memory, from `/proc/self/status`. A field the kernel
/// does not report reads 0.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct ProcStatus {
    /// `VmRSS`: total resident.
    pub rss_mib: f64,
    /// `RssAnon`: resident anonymous memory (the expert cache, heap).
    pub rss_anon_mib: f64,
    /// `RssFile`: resident file-backed memory (the mmap'd model).
    pub rss_file_mib: f64,
    /// `VmSwap`: anonymous memory swapped out (zram on a phone).
    pub swap_mib: f64,
}

/// Value of a `Key:   1234 kB` line, in MiB; `None` when `key` is absent or malformed.
fn kb_field_mib(text: &str, key: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        let mut it = rest.split_whitespace();
        let n: u64 = it.next()?.parse().ok()?;
        // Both files state kB (KiB); anything else is not what we think it is.
        match it.next() {
            Some("kB") | None => Some(n as f64 / 1024.0),
            Some(_) => None,
        }
    })
}

/// Parse `/proc/self/status` text.
pub fn parse_proc_status(text: &str) -> ProcStatus {
    let f = |k| kb_field_mib(text, k).unwrap_or(0.0);
    ProcStatus {
        rss_mib: f("VmRSS"),
        rss_anon_mib: f("RssAnon"),
        rss_file_mib: f("RssFile"),
        swap_mib: f("VmSwap"),
    }
}

/// `/proc/self/status` now; all zero when unreadable (not Linux).
pub fn proc_status() -> ProcStatus {
    std::fs::read_to_string("/proc/self/status")
        .map(|t| parse_proc_status(&t))
        .unwrap_or_default()
}

/// What the system says about its free memory, from `/proc/meminfo`. Absent fields read 0.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct MemInfo {
    /// `MemAvailable` (counts our own mmap'd weights as reclaimable, so it over-states headroom).
    pub mem_available_mib: f64,
    pub mem_free_mib: f64,
    pub swap_free_mib: f64,
}

/// Parse `/proc/meminfo` text.
pub fn parse_meminfo(text: &str) -> MemInfo {
    let f = |k| kb_field_mib(text, k).unwrap_or(0.0);
    MemInfo {
        mem_available_mib: f("MemAvailable"),
        mem_free_mib: f("MemFree"),
        swap_free_mib: f("SwapFree"),
    }
}

/// `/proc/meminfo` now; all zero when unreadable.
pub fn meminfo() -> MemInfo {
    std::fs::read_to_string("/proc/meminfo")
        .map(|t| parse_meminfo(&t))
        .unwrap_or_default()
}

/// Which cgroup hierarchy a memory controller belongs to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// The memory controller of this process's cgroup.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CgroupMem {
    /// `memory.limit_in_bytes` (v1) / `memory.max` (v2); `None` when unlimited.
    pub limit_bytes: Option<u64>,
    /// `memory.usage_in_bytes` (v1) / `memory.current` (v2).
    pub usage_bytes: u64,
    pub version: CgroupVersion,
}

/// A memory-capable cgroup mount from `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupMount {
    pub version: CgroupVersion,
    /// The cgroup path the mount exposes as its root (`/` unless namespaced).
    pub root: String,
    pub mount_point: PathBuf,
}

/// The memory-relevant mounts in `/proc/self/mountinfo` text: v1 hierarchies with the
/// `memory` controller and every v2 hierarchy.
pub fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    let mut out = Vec::new();
    for line in text.lines() {
        // id parent major:minor root mount_point options [optional...] - fstype source super
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        let (Some(root), Some(mp), Some(fstype)) = (pre.get(3), pre.get(4), post.first()) else {
            continue;
        };
        let version = match *fstype {
            "cgroup" => {
                let super_opts = post.get(2).copied().unwrap_or("");
                if !super_opts.split(',').any(|o| o == "memory") {
                    continue;
                }
                CgroupVersion::V1
            }
            "cgroup2" => CgroupVersion::V2,
            _ => continue,
        };
        out.push(CgroupMount {
            version,
            root: unescape_mountinfo(root),
            mount_point: PathBuf::from(unescape_mountinfo(mp)),
        });
    }
    out
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo` octal.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        if let (b'\\', Some(d)) = (b[i], octal) {
            let v = d.iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// This process's cgroup path for the v1 memory controller and for v2, from
/// `/proc/self/cgroup` text (`hierarchy:controllers:path` lines).
pub fn parse_proc_cgroup(text: &str) -> (Option<String>, Option<String>) {
    let (mut v1, mut v2) = (None, None);
    for line in text.lines() {
        let mut it = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if id == "0" && ctrls.is_empty() {
            v2 = Some(path.to_string());
        } else if ctrls.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_string());
        }
    }
    (v1, v2)
}

/// Directories to look for this process's memory controller in, best first: for each mount
/// (v1 memory preferred, then v2), the process's cgroup path relative to the mount's root,
/// then its ancestors up to the mount point. The ancestors matter in containers whose
/// `/proc/self/cgroup` names a host path the namespaced mount does not show: the nearest
/// existing ancestor is then the container's own group.
pub fn cgroup_candidate_dirs(proc_cgroup: &str, mountinfo: &str) -> Vec<(CgroupVersion, PathBuf)> {
    let (v1, v2) = parse_proc_cgroup(proc_cgroup);
    let mut mounts = parse_mountinfo(mountinfo);
    mounts.sort_by_key(|m| match m.version {
        CgroupVersion::V1 => 0,
        CgroupVersion::V2 => 1,
    });
    let mut out = Vec::new();
    for m in mounts {
        let Some(path) = (match m.version {
            CgroupVersion::V1 => v1.as_deref(),
            CgroupVersion::V2 => v2.as_deref(),
        }) else {
            continue;
        };
        let rel = if m.root == "/" {
            path
        } else {
            match path.strip_prefix(m.root.as_str()) {
                Some(r) if r.is_empty() || r.starts_with('/') => r,
                _ => path,
            }
        };
        let mut parts: Vec<&str> = rel
            .split('/')
            .filter(|p| !p.is_empty() && *p != "..")
            .collect();
        loop {
            let mut dir = m.mount_point.clone();
            dir.extend(&parts);
            out.push((m.version, dir));
            if parts.pop().is_none() {
                break;
            }
        }
    }
    out
}

/// A limit file's value: `Some(None)` for unlimited (`max`, or v1's near-`i64::MAX`
/// sentinel), `Some(Some(n))` for a limit, `None` when unparseable.
pub fn parse_limit(text: &str) -> Option<Option<u64>> {
    let t = text.trim();
    if t == "max" {
        return Some(None);
    }
    let n: u64 = t.parse().ok()?;
    // v1 reports "unlimited" as LONG_MAX rounded down to a page.
    Some(if n >= 1 << 62 { None } else { Some(n) })
}

/// Read the controller in `dir`, if it has one.
fn read_cgroup_dir(version: CgroupVersion, dir: &Path) -> Option<CgroupMem> {
    let (limit_file, usage_file) = match version {
        CgroupVersion::V1 => ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        CgroupVersion::V2 => ("memory.max", "memory.current"),
    };
    let limit = parse_limit(&std::fs::read_to_string(dir.join(limit_file)).ok()?)?;
    let usage = std::fs::read_to_string(dir.join(usage_file)).ok()?;
    Some(CgroupMem {
        limit_bytes: limit,
        usage_bytes: usage.trim().parse().ok()?,
        version,
    })
}

/// The memory limit and usage of this process's cgroup (v1 memory controller preferred,
/// else v2); `None` when there is no readable controller. The v2 root group has no
/// `memory.max` and so reads as `None` too.
pub fn cgroup_memory() -> Option<CgroupMem> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mi = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    cgroup_candidate_dirs(&cg, &mi)
        .into_iter()
        .find_map(|(v, dir)| read_cgroup_dir(v, &dir))
}

/// Most pages `resident_fraction` asks `mincore` about per call.
pub const RESIDENCY_SAMPLE_PAGES: usize = 4096;
/// Pages per contiguous sample chunk (one `mincore` call each).
const SAMPLE_CHUNK_PAGES: usize = 64;

/// Fraction of the pages of `ranges` (address, length) resident in RAM, by `mincore`.
///
/// Ranges are widened to page boundaries. When they span more than
/// `RESIDENCY_SAMPLE_PAGES` pages, that many are sampled in chunks of 64 consecutive pages
/// spread evenly over the whole span (deterministic, so successive calls compare like with
/// like), which keeps a call to a few dozen syscalls whatever the model size. A chunk that
/// touches unmapped memory (`mincore` fails with ENOMEM) is skipped whole. `-1.0` when nothing could be measured. Swapped-out anonymous
/// pages count as not resident.
pub fn resident_fraction(ranges: &[(*const u8, usize)]) -> f64 {
    let page = page_size_bytes() as usize;
    // Page-aligned (start, pages) spans.
    let spans: Vec<(usize, usize)> = ranges
        .iter()
        .filter(|(_, len)| *len > 0)
        .map(|&(p, len)| {
            let a = p as usize;
            let lo = a / page * page;
            let hi = a.saturating_add(len).div_ceil(page) * page;
            (lo, (hi - lo) / page)
        })
        .collect();
    let total: usize = spans.iter().map(|s| s.1).sum();
    if total == 0 {
        return -1.0;
    }
    // Chunks of global page indices to examine.
    let chunks: Vec<(usize, usize)> = if total <= RESIDENCY_SAMPLE_PAGES {
        vec![(0, total)]
    } else {
        let n = RESIDENCY_SAMPLE_PAGES / SAMPLE_CHUNK_PAGES;
        (0..n)
            .map(|i| {
                let start = (i as u128 * total as u128 / n as u128) as usize;
                (start, SAMPLE_CHUNK_PAGES.min(total - start))
            })
            .collect()
    };
    let (mut resident, mut seen) = (0usize, 0usize);
    let mut vec = Vec::new();
    for (start, n) in chunks {
        // Map the global chunk [start, end) onto the spans it covers.
        let end = start + n;
        let mut base = 0usize;
        for &(lo, pages) in &spans {
            let (s_lo, s_hi) = (base, base + pages);
            base = s_hi;
            let (a, b) = (start.max(s_lo), end.min(s_hi));
            if a >= b {
                continue;
            }
            let count = b - a;
            vec.clear();
            vec.resize(count, 0u8);
            let addr = lo + (a - s_lo) * page;
            // SAFETY: mincore only inspects the page tables for the range and writes one byte
            // per page into `vec`, which holds `count` bytes; an unmapped range is ENOMEM,
            // not a fault.
            let rc = unsafe {
                libc::mincore(
                    addr as *mut libc::c_void,
                    count * page,
                    vec.as_mut_ptr() as *mut _,
                )
            };
            if rc == 0 {
                seen += count;
                resident += vec.iter().filter(|&&v| v & 1 != 0).count();
            }
        }
    }
    if seen == 0 {
        -1.0
    } else {
        resident as f64 / seen as f64
    }
}

/// Address ranges of the mappings of `path` in `/proc/self/maps` text (where an mmap'd model
/// lives, for `dense_resident_frac` under mmap).
pub fn parse_maps_for(text: &str, path: &Path) -> Vec<(usize, usize)> {
    let want = path.to_string_lossy();
    text.lines()
        .filter_map(|line| {
            // start-end perms offset dev inode path (the path may contain spaces)
            let mut it = line.splitn(6, ' ');
            let range = it.next()?;
            let name = it.nth(4)?.trim_start();
            if name != want {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            let a = usize::from_str_radix(a, 16).ok()?;
            let b = usize::from_str_radix(b, 16).ok()?;
            (b > a).then_some((a, b - a))
        })
        .collect()
}

/// A throttled `resident_fraction` over fixed ranges (the dense weights), for one reading
/// per token without one `mincore` sweep per token.
///
/// A real measurement happens on the first call and then only when **both** at least
/// `every_calls` calls and at least `every_ms` milliseconds have passed since the last one;
/// in between the last value is returned. `-1.0` until something was measured (or when the
/// ranges are empty / unmapped).
#[derive(Debug)]
pub struct DenseResidency {
    /// (address, length) pairs; kept as integers so the helper is `Send`.
    ranges: Vec<(usize, usize)>,
    every_calls: u64,
    every_ms: u64,
    calls_since: u64,
    last_at: Option<Instant>,
    last: f64,
    measurements: u64,
}

impl DenseResidency {
    /// Watch `ranges`, measuring at most once per `every_calls` calls and `every_ms` ms.
    pub fn new(ranges: &[(*const u8, usize)], every_calls: u64, every_ms: u64) -> Self {
        DenseResidency {
            ranges: ranges.iter().map(|&(p, l)| (p as usize, l)).collect(),
            every_calls,
            every_ms,
            calls_since: 0,
            last_at: None,
            last: -1.0,
            measurements: 0,
        }
    }

    /// The residency fraction: measured now if the throttle allows, else the last value.
    pub fn sample(&mut self) -> f64 {
        self.sample_at(Instant::now())
    }

    /// `sample` with the caller's notion of now (tests).
    pub fn sample_at(&mut self, now: Instant) -> f64 {
        self.calls_since += 1;
        let due = match self.last_at {
            None => true,
            Some(t) => {
                self.calls_since >= self.every_calls
                    && now.saturating_duration_since(t).as_millis() >= u128::from(self.every_ms)
            }
        };
        if due {
            let r: Vec<(*const u8, usize)> = self
                .ranges
                .iter()
                .map(|&(a, l)| (a as *const u8, l))
                .collect();
            self.last = resident_fraction(&r);
            self.last_at = Some(now);
            self.calls_since = 0;
            self.measurements += 1;
        }
        self.last
    }

    /// Real measurements taken so far.
    pub fn measurements(&self) -> u64 {
        self.measurements
    }
}
