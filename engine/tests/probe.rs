//! The memory probes: parsing on fixture text (so every branch runs on any machine), then a
//! live smoke test of each probe on this process, and `mincore` residency against memory we
//! commit and release ourselves.

use bmoe_engine::probe::{
    cgroup_candidate_dirs, cgroup_memory, meminfo, page_size_bytes, parse_limit, parse_maps_for,
    parse_meminfo, parse_mountinfo, parse_proc_cgroup, parse_proc_status, proc_status,
    resident_fraction, rusage, CgroupVersion, DenseResidency, MemInfo, ProcStatus,
    RESIDENCY_SAMPLE_PAGES,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const STATUS: &str = "Name:\tbmoe-cli\nUmask:\t0022\nState:\tR (running)\n\
VmPeak:\t 9999999 kB\nVmRSS:\t  524288 kB\nRssAnon:\t  262144 kB\nRssFile:\t  261120 kB\n\
RssShmem:\t    1024 kB\nVmSwap:\t   10240 kB\nThreads:\t5\n";

const MEMINFO: &str = "MemTotal:        7864320 kB\nMemFree:          204800 kB\n\
MemAvailable:    1048576 kB\nBuffers:           24560 kB\nSwapTotal:       4194304 kB\n\
SwapFree:        2097152 kB\n";

#[test]
fn status_fields_parse_to_mib() {
    assert_eq!(
        parse_proc_status(STATUS),
        ProcStatus {
            rss_mib: 512.0,
            rss_anon_mib: 256.0,
            rss_file_mib: 255.0,
            swap_mib: 10.0,
        }
    );
    // Older kernels have no RssAnon/RssFile; a garbled value is "unknown", not a panic.
    let old = "VmRSS:\t 2048 kB\nVmSwap:\t garbage kB\n";
    assert_eq!(
        parse_proc_status(old),
        ProcStatus {
            rss_mib: 2.0,
            ..ProcStatus::default()
        }
    );
    // A key that only starts like ours is not ours.
    assert_eq!(parse_proc_status("VmRSSx: 10 kB\n").rss_mib, 0.0);
    assert_eq!(parse_proc_status(""), ProcStatus::default());
}

#[test]
fn meminfo_fields_parse_to_mib() {
    assert_eq!(
        parse_meminfo(MEMINFO),
        MemInfo {
            mem_available_mib: 1024.0,
            mem_free_mib: 200.0,
            swap_free_mib: 2048.0,
        }
    );
    assert_eq!(parse_meminfo("MemFree: 12 MB\n").mem_free_mib, 0.0);
}

const CGROUP_V1: &str = "12:pids:/user.slice\n4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/\n";
const MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
50 1 8:1 / / rw - ext4 /dev/root rw
";

#[test]
fn mountinfo_keeps_memory_v1_and_every_v2() {
    let m = parse_mountinfo(MOUNTINFO);
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].version, CgroupVersion::V1);
    assert_eq!(m[0].mount_point, PathBuf::from("/sys/fs/cgroup/memory"));
    assert_eq!(m[1].version, CgroupVersion::V2);
    assert_eq!(m[1].mount_point, PathBuf::from("/sys/fs/cgroup/unified"));
    // Escaped spaces in the mount point; a truncated line is skipped.
    let odd = "1 2 0:1 /a /mnt/my\\040cg rw - cgroup2 none rw\n1 2 0:1\n";
    let m = parse_mountinfo(odd);
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].mount_point, PathBuf::from("/mnt/my cg"));
    assert_eq!(m[0].root, "/a");
}

#[test]
fn proc_cgroup_paths() {
    assert_eq!(
        parse_proc_cgroup(CGROUP_V1),
        (Some("/process_api/abc".into()), Some("/".into()))
    );
    assert_eq!(
        parse_proc_cgroup("0::/user.slice/app.scope\n"),
        (None, Some("/user.slice/app.scope".into()))
    );
    assert_eq!(parse_proc_cgroup("nonsense\n"), (None, None));
}

#[test]
fn candidate_dirs_walk_up_to_the_mount_and_prefer_v1() {
    let dirs = cgroup_candidate_dirs(CGROUP_V1, MOUNTINFO);
    let want: Vec<(CgroupVersion, PathBuf)> = vec![
        (
            CgroupVersion::V1,
            "/sys/fs/cgroup/memory/process_api/abc".into(),
        ),
        (
            CgroupVersion::V1,
            "/sys/fs/cgroup/memory/process_api".into(),
        ),
        (CgroupVersion::V1, "/sys/fs/cgroup/memory".into()),
        (CgroupVersion::V2, "/sys/fs/cgroup/unified".into()),
    ];
    assert_eq!(dirs, want);
    // A namespaced v2 mount whose root is a prefix of our path.
    let mi = "1 2 0:1 /user.slice /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
    let dirs = cgroup_candidate_dirs("0::/user.slice/app.scope\n", mi);
    assert_eq!(dirs[0].1, PathBuf::from("/sys/fs/cgroup/app.scope"));
    assert_eq!(dirs[1].1, PathBuf::from("/sys/fs/cgroup"));
    // "..", as seen for a process outside the mount's namespace, never climbs out.
    let dirs = cgroup_candidate_dirs("0::/../x\n", mi);
    assert!(dirs.iter().all(|(_, d)| d.starts_with("/sys/fs/cgroup")));
}

#[test]
fn limits_parse_unlimited_and_numbers() {
    assert_eq!(parse_limit("max\n"), Some(None));
    assert_eq!(parse_limit("9223372036854771712\n"), Some(None));
    assert_eq!(parse_limit("2147483648\n"), Some(Some(2_147_483_648)));
    assert_eq!(parse_limit("lots"), None);
}

#[test]
fn maps_lines_select_the_file() {
    let maps = "\
7f0000000000-7f0000100000 r--p 00000000 08:01 123 /models/m.gguf
7f0000100000-7f0000200000 r--p 00100000 08:01 123 /models/m.gguf
7f0000200000-7f0000300000 rw-p 00000000 00:00 0 
7f0000300000-7f0000301000 r--p 00000000 08:01 124 /models/m.gguf.bak
7f0000400000-7f0000402000 r--p 00000000 08:01 125 /models/with space.gguf
";
    assert_eq!(
        parse_maps_for(maps, Path::new("/models/m.gguf")),
        vec![(0x7f00_0000_0000, 0x10_0000), (0x7f00_0010_0000, 0x10_0000)]
    );
    assert_eq!(
        parse_maps_for(maps, Path::new("/models/with space.gguf")),
        vec![(0x7f00_0040_0000, 0x2000)]
    );
}

/// Anonymous memory we commit, check and release ourselves.
struct Anon {
    ptr: *mut u8,
    len: usize,
}

impl Anon {
    fn new(len: usize) -> Anon {
        // SAFETY: a fresh private anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Anon {
            ptr: p as *mut u8,
            len,
        }
    }
    fn touch(&self, from: usize, to: usize) {
        let page = page_size_bytes() as usize;
        for off in (from..to).step_by(page) {
            // SAFETY: inside our mapping.
            unsafe { self.ptr.add(off).write_volatile(1) };
        }
    }
    fn release(&self) {
        // SAFETY: our whole mapping; DONTNEED drops the private pages.
        unsafe { libc::madvise(self.ptr as *mut libc::c_void, self.len, libc::MADV_DONTNEED) };
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: exactly what `new` mapped.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

#[test]
fn resident_fraction_tracks_committed_pages() {
    let page = page_size_bytes() as usize;
    let a = Anon::new(64 * page);
    assert_eq!(resident_fraction(&[(a.ptr, a.len)]), 0.0);
    a.touch(0, 16 * page);
    assert_eq!(resident_fraction(&[(a.ptr, a.len)]), 0.25);
    // Unaligned ranges are widened to whole pages.
    assert_eq!(
        resident_fraction(&[(unsafe { a.ptr.add(page + 7) }, 10)]),
        1.0
    );
    assert_eq!(resident_fraction(&[]), -1.0);
    assert_eq!(resident_fraction(&[(a.ptr, 0)]), -1.0);
    a.release();
    assert_eq!(resident_fraction(&[(a.ptr, a.len)]), 0.0);
}

#[test]
fn resident_fraction_samples_large_ranges() {
    let page = page_size_bytes() as usize;
    let pages = RESIDENCY_SAMPLE_PAGES * 8;
    let a = Anon::new(pages * page);
    // First half resident: evenly spread samples see about half.
    a.touch(0, pages / 2 * page);
    let f = resident_fraction(&[(a.ptr, a.len)]);
    assert!((f - 0.5).abs() < 0.05, "sampled fraction {f}");
    // Two ranges, one fully resident and one not, weigh by pages.
    let b = Anon::new(pages * page);
    let f = resident_fraction(&[(a.ptr, a.len / 2), (b.ptr, b.len / 2)]);
    assert!((f - 0.5).abs() < 0.05, "two-range fraction {f}");
}

#[test]
fn dense_residency_throttles_and_reports_the_last_value() {
    let page = page_size_bytes() as usize;
    let a = Anon::new(32 * page);
    a.touch(0, a.len);
    let mut d = DenseResidency::new(&[(a.ptr, a.len)], 3, 100);
    let t0 = Instant::now();
    assert_eq!(d.sample_at(t0), 1.0);
    a.release();
    // Within both limits the stale value is returned without measuring.
    assert_eq!(d.sample_at(t0 + Duration::from_millis(500)), 1.0);
    assert_eq!(d.sample_at(t0 + Duration::from_millis(500)), 1.0);
    assert_eq!(d.measurements(), 1);
    // Third call since the last measurement, but too soon: still stale.
    assert_eq!(d.sample_at(t0 + Duration::from_millis(50)), 1.0);
    // Enough calls and enough time: measured.
    assert_eq!(d.sample_at(t0 + Duration::from_millis(150)), 0.0);
    assert_eq!(d.measurements(), 2);
    let mut empty = DenseResidency::new(&[], 1, 0);
    assert_eq!(empty.sample(), -1.0);
}

/// Every probe on this process: plausible values, no panics. Linux-only facts are asserted
/// only where /proc exists.
#[test]
fn live_smoke() {
    let ru = rusage();
    let spin: u64 = (0..2_000_000u64).fold(0, |a, x| a.wrapping_add(x * x));
    assert!(spin > 0);
    assert!(rusage().cpu_s >= ru.cpu_s);
    if Path::new("/proc/self/status").exists() {
        let s = proc_status();
        assert!(s.rss_mib > 0.0, "{s:?}");
        assert!(s.rss_anon_mib + s.rss_file_mib <= s.rss_mib + 1.0, "{s:?}");
        let m = meminfo();
        assert!(m.mem_available_mib > 0.0 && m.mem_free_mib > 0.0, "{m:?}");
    }
    if let Some(c) = cgroup_memory() {
        if let Some(limit) = c.limit_bytes {
            assert!(limit > 0, "{c:?}");
        }
        eprintln!("cgroup memory: {c:?}");
    } else {
        eprintln!("no readable cgroup memory controller");
    }
}
