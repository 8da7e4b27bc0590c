//! Process memory and CPU probes (getrusage, /proc/self/status, /proc/meminfo, mincore, the
//! cgroup memory limit, the process's own resource limits): the engine's answers to the
//! telemetry's memory-picture questions and to "how much memory may this process use".
//!
//! Every probe answers "unknown" instead of failing — `0` for counters and sizes, `-1` for
//! fractions, `None` for limits — because telemetry must never stop a generation, and the
//! formats define those values as "unmeasured". Parsing is split into pure functions over
//! `&str` so it is tested on fixture text, and the file-reading probes have `_under(root)`
//! forms that read `root/proc/...` and `root/sys/...`, so they are tested on synthetic trees
//! (a phone's, a container's), not only on whatever machine runs the tests.
//!
//! Why the process limits: a shell or Termux process on Android has no memory cgroup of its
//! own (no v1 controller; v2 `memory.max` at most on some builds), so its bounds are
//! `MemAvailable` and whatever `ulimit -v` / `ulimit -d` set; [`process_limits`] lists every
//! limit there is, and [`tightest_headroom`] picks the one the auto cache must fit under.

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

/// Value of a `Key:   1234 kB` line, in KiB; `None` when `key` is absent or malformed.
fn kb_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        let mut it = rest.split_whitespace();
        let n: u64 = it.next()?.parse().ok()?;
        // Both files state kB (KiB); anything else is not what we think it is.
        match it.next() {
            Some("kB") | None => Some(n),
            Some(_) => None,
        }
    })
}

/// Value of a `Key:   1234 kB` line, in MiB; `None` when `key` is absent or malformed.
fn kb_field_mib(text: &str, key: &str) -> Option<f64> {
    kb_field(text, key).map(|n| n as f64 / 1024.0)
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
    meminfo_under(Path::new("/"))
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
    cgroup_memory_under(Path::new("/"))
}

/// [`cgroup_memory`] of the tree at `root`: `root/proc/self/{cgroup,mountinfo}` and the
/// mount points they name, under `root`.
pub fn cgroup_memory_under(root: &Path) -> Option<CgroupMem> {
    let cg = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let mi = std::fs::read_to_string(root.join("proc/self/mountinfo")).ok()?;
    cgroup_candidate_dirs(&cg, &mi)
        .into_iter()
        .find_map(|(v, dir)| read_cgroup_dir(v, &under(root, &dir)))
}

/// The absolute `path` inside the tree at `root`.
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// This process's soft limits on memory (`getrlimit`), `None` where unlimited.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Rlimits {
    /// `RLIMIT_AS` (`ulimit -v`): the address space, every mapping counted.
    pub as_bytes: Option<u64>,
    /// `RLIMIT_DATA` (`ulimit -d`): private writable memory (since Linux 4.7 every private
    /// writable mapping, the anonymous ones the cache uses included).
    pub data_bytes: Option<u64>,
}

/// `getrlimit(RLIMIT_AS)` and `getrlimit(RLIMIT_DATA)`: the soft limits (what the kernel
/// enforces), `None` for `RLIM_INFINITY` or a failed call.
pub fn rlimits() -> Rlimits {
    // A closure, not a fn: glibc types the resource as its own enum, musl (the phone build)
    // as `c_int`, and `libc::RLIMIT_*` carry the right one.
    let soft = |resource| {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one struct rlimit into `r`, which is ours.
        let rc = unsafe { libc::getrlimit(resource, &mut r) };
        (rc == 0 && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
    };
    Rlimits {
        as_bytes: soft(libc::RLIMIT_AS),
        data_bytes: soft(libc::RLIMIT_DATA),
    }
}

/// One bound on the memory this process may use: a limit, what already counts against it,
/// and where it came from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ProcessLimit {
    pub limit_bytes: u64,
    /// The cgroup's `memory.current` / `usage_in_bytes`; `VmSize` for `RLIMIT_AS`, `VmData`
    /// for `RLIMIT_DATA` (0 when `/proc/self/status` does not say).
    pub usage_bytes: u64,
    pub source: bmoe_core::config::MemSource,
}

impl ProcessLimit {
    /// What is left under the limit.
    pub fn headroom_bytes(&self) -> u64 {
        self.limit_bytes.saturating_sub(self.usage_bytes)
    }
}

/// Every limit that bounds this process's memory in the tree at `root`, given its resource
/// limits `rl`: the cgroup's (when it has a limit), `RLIMIT_AS` against `VmSize` and
/// `RLIMIT_DATA` against `VmData` from `root/proc/self/status`. Empty on an unlimited process
/// (a phone's shell, usually).
pub fn process_limits_under(root: &Path, rl: Rlimits) -> Vec<ProcessLimit> {
    use bmoe_core::config::MemSource;
    let mut out = Vec::new();
    if let Some(CgroupMem {
        limit_bytes: Some(limit_bytes),
        usage_bytes,
        ..
    }) = cgroup_memory_under(root)
    {
        out.push(ProcessLimit {
            limit_bytes,
            usage_bytes,
            source: MemSource::Cgroup,
        });
    }
    let status = std::fs::read_to_string(root.join("proc/self/status")).unwrap_or_default();
    let used = |key| kb_field(&status, key).map_or(0, |k| k.saturating_mul(1024));
    for (limit, key, source) in [
        (rl.as_bytes, "VmSize", MemSource::RlimitAs),
        (rl.data_bytes, "VmData", MemSource::RlimitData),
    ] {
        if let Some(limit_bytes) = limit {
            out.push(ProcessLimit {
                limit_bytes,
                usage_bytes: used(key),
                source,
            });
        }
    }
    out
}

/// The limit of `limits` with the least headroom (limit − usage): what the auto cache, added on
/// top of what is already used, must fit under. The first wins a tie, so a cgroup is named
/// before an rlimit leaving the same room.
pub fn tightest_headroom(limits: &[ProcessLimit]) -> Option<ProcessLimit> {
    limits.iter().copied().reduce(|best, l| {
        if l.headroom_bytes() < best.headroom_bytes() {
            l
        } else {
            best
        }
    })
}

/// [`process_limits_under`] of this process.
pub fn process_limits() -> Vec<ProcessLimit> {
    process_limits_under(Path::new("/"), rlimits())
}

/// [`meminfo`] of the tree at `root` (`root/proc/meminfo`).
pub fn meminfo_under(root: &Path) -> MemInfo {
    std::fs::read_to_string(root.join("proc/meminfo"))
        .map(|t| parse_meminfo(&t))
        .unwrap_or_default()
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

#[cfg(test)]
mod tests {
    use super::*;
    use bmoe_core::config::MemSource;

    const GIB: u64 = 1 << 30;

    /// A synthetic `/` holding `files` (path relative to the root, contents).
    fn tree(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let root = crate::testdata::scratch_dir(&format!("probe-{name}"));
        let _ = std::fs::remove_dir_all(&root);
        for (path, text) in files {
            let p = root.join(path);
            std::fs::create_dir_all(p.parent().expect("a file has a parent")).expect("mkdir");
            std::fs::write(&p, text).expect("write");
        }
        root
    }

    const MEMINFO: &str = "MemTotal:       11534336 kB\nMemFree:          524288 kB\n\
MemAvailable:    6291456 kB\nSwapFree:        2097152 kB\n";
    const STATUS: &str = "Name:\tbmoe-cli\nVmPeak:\t 9437184 kB\nVmSize:\t 5767168 kB\n\
VmData:\t  104857 kB\nVmRSS:\t  524288 kB\n";

    /// An `adb shell` process on Android 13: cgroup v2 mounted with per-uid/pid groups but no
    /// memory controller files in them, cpu/cpuset v1 hierarchies beside it, no rlimits.
    fn android_shell(name: &str, extra: &[(&str, &str)]) -> PathBuf {
        let mut files = vec![
            ("proc/meminfo", MEMINFO),
            ("proc/self/status", STATUS),
            (
                "proc/self/cgroup",
                "4:cpuset:/foreground\n3:cpu:/\n2:schedtune:/\n0::/uid_2000/pid_4242\n",
            ),
            (
                "proc/self/mountinfo",
                "20 1 0:18 / /dev/cpuset rw,nosuid - cgroup none rw,cpuset\n\
21 1 0:19 / /dev/cpuctl rw,nosuid - cgroup none rw,cpu\n\
22 1 0:20 / /sys/fs/cgroup rw,nosuid - cgroup2 none rw\n\
30 1 259:5 / /data rw,lazytime - f2fs /dev/block/dm-7 rw\n",
            ),
            ("sys/fs/cgroup/uid_2000/pid_4242/cgroup.procs", "4242\n"),
        ];
        files.extend_from_slice(extra);
        tree(name, &files)
    }

    #[test]
    fn a_phone_shell_has_memavailable_and_no_limit() {
        let root = android_shell("shell", &[]);
        assert_eq!(cgroup_memory_under(&root), None);
        assert!(process_limits_under(&root, Rlimits::default()).is_empty());
        assert_eq!(meminfo_under(&root).mem_available_mib, 6144.0);
        assert_eq!(tightest_headroom(&[]), None);
    }

    #[test]
    fn a_v2_memory_max_on_the_process_group_is_its_limit() {
        let root = android_shell(
            "v2max",
            &[
                ("sys/fs/cgroup/uid_2000/pid_4242/memory.max", "4294967296\n"),
                (
                    "sys/fs/cgroup/uid_2000/pid_4242/memory.current",
                    "1073741824\n",
                ),
            ],
        );
        let limits = process_limits_under(&root, Rlimits::default());
        assert_eq!(
            limits,
            vec![ProcessLimit {
                limit_bytes: 4 * GIB,
                usage_bytes: GIB,
                source: MemSource::Cgroup
            }]
        );
        assert_eq!(limits[0].headroom_bytes(), 3 * GIB);
        // `max` is no limit.
        let root = android_shell(
            "v2unlimited",
            &[
                ("sys/fs/cgroup/uid_2000/memory.max", "max\n"),
                ("sys/fs/cgroup/uid_2000/memory.current", "5\n"),
            ],
        );
        assert!(process_limits_under(&root, Rlimits::default()).is_empty());
        assert_eq!(
            cgroup_memory_under(&root).map(|c| (c.limit_bytes, c.version)),
            Some((None, CgroupVersion::V2))
        );
    }

    #[test]
    fn rlimits_count_what_the_process_already_uses() {
        let root = android_shell("rlimits", &[]);
        let limits = process_limits_under(
            &root,
            Rlimits {
                as_bytes: Some(6 * GIB),
                data_bytes: Some(7 * GIB),
            },
        );
        assert_eq!(
            limits,
            vec![
                ProcessLimit {
                    limit_bytes: 6 * GIB,
                    usage_bytes: 5767168 * 1024,
                    source: MemSource::RlimitAs
                },
                ProcessLimit {
                    limit_bytes: 7 * GIB,
                    usage_bytes: 104857 * 1024,
                    source: MemSource::RlimitData
                },
            ]
        );
        // The smaller headroom (6 GiB - 5.5 GiB of address space already mapped, against
        // 7 GiB - 0.1 GiB of data) sizes the cache.
        let room = tightest_headroom(&limits);
        assert_eq!(room.map(|l| l.source), Some(MemSource::RlimitAs));
        assert_eq!(room.map(|l| l.headroom_bytes()), Some(GIB / 2));
        // Without /proc/self/status the usage is unknown: 0.
        let bare = tree("rlimits-bare", &[]);
        let only = process_limits_under(
            &bare,
            Rlimits {
                as_bytes: None,
                data_bytes: Some(GIB),
            },
        );
        assert_eq!(only.len(), 1);
        assert_eq!(only[0].usage_bytes, 0);
    }

    #[test]
    fn the_tightest_limit_beside_a_cgroup() {
        // A v1 container (the CI machine's shape) with a cgroup limit and a `ulimit -d`.
        let root = tree(
            "v1",
            &[
                ("proc/self/status", STATUS),
                ("proc/self/cgroup", "4:memory:/job\n0::/\n"),
                (
                    "proc/self/mountinfo",
                    "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
                ),
                (
                    "sys/fs/cgroup/memory/job/memory.limit_in_bytes",
                    "8589934592\n",
                ),
                (
                    "sys/fs/cgroup/memory/job/memory.usage_in_bytes",
                    "7516192768\n",
                ),
            ],
        );
        let limits = process_limits_under(
            &root,
            Rlimits {
                as_bytes: None,
                data_bytes: Some(12 * GIB),
            },
        );
        assert_eq!(limits[0].source, MemSource::Cgroup);
        // 8 GiB - 7 GiB used leaves less than 12 GiB - 0.1 GiB.
        let room = tightest_headroom(&limits);
        assert_eq!(
            room.map(|l| (l.source, l.headroom_bytes())),
            Some((MemSource::Cgroup, GIB))
        );
        // Equal headroom: the cgroup is named (it comes first).
        let tie = [
            ProcessLimit {
                limit_bytes: GIB,
                usage_bytes: 0,
                source: MemSource::Cgroup,
            },
            ProcessLimit {
                limit_bytes: GIB,
                usage_bytes: 0,
                source: MemSource::RlimitAs,
            },
        ];
        assert_eq!(
            tightest_headroom(&tie).map(|l| l.source),
            Some(MemSource::Cgroup)
        );
    }

    #[test]
    fn no_proc_at_all_is_unknown_not_an_error() {
        let root = tree("empty", &[]);
        assert_eq!(cgroup_memory_under(&root), None);
        assert_eq!(meminfo_under(&root), MemInfo::default());
        assert!(process_limits_under(&root, Rlimits::default()).is_empty());
    }

    #[test]
    fn this_process_limits_are_plausible() {
        // The live probes: an unlimited test process has no rlimits; whatever it has is > 0.
        let rl = rlimits();
        for b in [rl.as_bytes, rl.data_bytes].into_iter().flatten() {
            assert!(b > 0);
        }
        for l in process_limits() {
            assert!(l.limit_bytes > 0, "{l:?}");
        }
    }
}
