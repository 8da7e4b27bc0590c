//! Which cores compute on: the speed classes of a big.LITTLE CPU from
//! `/sys/devices/system/cpu/cpu*/cpufreq/cpuinfo_max_freq`, the default `--threads` they imply,
//! and pinning the compute threads to the big cores (and the I/O lanes to the others).
//!
//! Why: a phone's SoC mixes one or a few fast cores with slow ones (e.g. 1 Cortex-X + 3 A7xx +
//! 4 A5xx). The compute pool splits every matrix evenly over its threads and waits for the
//! slowest, so a thread on a little core makes every token as slow as that core; and the
//! scheduler moves threads between clusters at will. So the default is one thread per big core,
//! each pinned there, and the I/O lanes (which mostly wait in `pread`) take the little ones.
//!
//! The classes: CPUs sorted by max frequency, fastest first; a CPU joins the current class when
//! its max frequency is at least [`CLASS_SPREAD`] of the class's fastest, else it starts the
//! next class. A 10 % spread keeps a desktop's "favoured cores" (a few 100 MHz of turbo apart)
//! one class, and separates every phone cluster seen (X2 3.0 / A710 2.5 / A510 1.8 GHz).
//! The big cores: the fastest class, or the fastest two when the fastest is a single prime core
//! (1+3+4 gives 4 threads, not 1: one thread leaves most of the memory bandwidth unused).
//!
//! A machine with one class, or without cpufreq at all (VMs, most x86 servers), keeps the
//! behaviour that predates this file: `min(available cores, 4)` threads, nothing pinned.
//! Parsing takes a root path, so it is tested on synthetic `/sys` trees.

use std::path::Path;

/// A CPU belongs to a class when its max frequency is at least this fraction of the class's
/// fastest.
pub const CLASS_SPREAD: f64 = 0.9;

/// Threads when the topology says nothing: the default before big.LITTLE awareness.
pub const FLAT_THREADS_MAX: u32 = 4;

/// CPUs of one speed class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuClass {
    /// The fastest `cpuinfo_max_freq` in the class (kHz).
    pub max_khz: u64,
    /// CPU numbers, ascending.
    pub cpus: Vec<usize>,
}

/// The online CPUs that report a max frequency, in speed classes, fastest first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub classes: Vec<CpuClass>,
}

/// A kernel CPU list (`0-3,6,8-9`); `None` when malformed.
pub fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi): (usize, usize) = match part.split_once('-') {
            Some((a, b)) => (a.parse().ok()?, b.parse().ok()?),
            None => {
                let n = part.parse().ok()?;
                (n, n)
            }
        };
        // A kernel has at most a few thousand CPUs; a bigger range is not a CPU list.
        if hi < lo || hi >= 1 << 16 {
            return None;
        }
        out.extend(lo..=hi);
    }
    out.sort_unstable();
    out.dedup();
    Some(out)
}

/// Group `(cpu, max_khz)` pairs into speed classes, fastest first (see the module docs).
pub fn classes_of(mut freqs: Vec<(usize, u64)>) -> Vec<CpuClass> {
    freqs.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut classes: Vec<CpuClass> = Vec::new();
    for (cpu, khz) in freqs {
        match classes.last_mut() {
            Some(c) if khz as f64 >= CLASS_SPREAD * c.max_khz as f64 => c.cpus.push(cpu),
            _ => classes.push(CpuClass {
                max_khz: khz,
                cpus: vec![cpu],
            }),
        }
    }
    for c in &mut classes {
        c.cpus.sort_unstable();
    }
    classes
}

/// The topology of the tree at `root` (`root/sys/devices/system/cpu/...`): every online CPU
/// (all `cpuN` directories when `online` is unreadable) with a readable, non-zero
/// `cpufreq/cpuinfo_max_freq`. `None` when no CPU reports one.
pub fn read_topology(root: &Path) -> Option<Topology> {
    let base = root.join("sys/devices/system/cpu");
    let online = std::fs::read_to_string(base.join("online"))
        .ok()
        .and_then(|t| parse_cpu_list(&t));
    let cpus: Vec<usize> = match online {
        Some(list) => list,
        None => std::fs::read_dir(&base)
            .ok()?
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_prefix("cpu")?.parse().ok())
            .collect(),
    };
    let freqs: Vec<(usize, u64)> = cpus
        .into_iter()
        .filter_map(|cpu| {
            let f = base.join(format!("cpu{cpu}/cpufreq/cpuinfo_max_freq"));
            let khz: u64 = std::fs::read_to_string(f).ok()?.trim().parse().ok()?;
            (khz > 0).then_some((cpu, khz))
        })
        .collect();
    if freqs.is_empty() {
        return None;
    }
    Some(Topology {
        classes: classes_of(freqs),
    })
}

impl Topology {
    /// The big cores: the fastest class, or the two fastest when the fastest is one core.
    pub fn big(&self) -> Vec<usize> {
        let take = match self.classes.first() {
            Some(c) if c.cpus.len() == 1 => 2,
            _ => 1,
        };
        let mut out: Vec<usize> = self
            .classes
            .iter()
            .take(take)
            .flat_map(|c| c.cpus.iter().copied())
            .collect();
        out.sort_unstable();
        out
    }

    /// The classes as a person reads them: `1×3000 + 3×2500 + 4×1800 MHz`.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .classes
            .iter()
            .map(|c| format!("{}×{}", c.cpus.len(), c.max_khz / 1000))
            .collect();
        format!("{} MHz", parts.join(" + "))
    }
}

/// Where the threads of a run go on a machine with more than one speed class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The big cores this process may run on: the compute threads' set.
    pub compute: Vec<usize>,
    /// The other CPUs this process may run on: the I/O lanes' set (may be empty).
    pub io: Vec<usize>,
    /// The topology it came from (for the startup line).
    pub described: String,
}

/// The placement for `topo` within `allowed` (the process's affinity mask; `None`: every
/// CPU). `None` — today's behaviour — when there is no topology, a single class, or none of
/// the big cores is allowed.
pub fn placement(topo: Option<&Topology>, allowed: Option<&[usize]>) -> Option<Placement> {
    let topo = topo?;
    if topo.classes.len() < 2 {
        return None;
    }
    let ok = |c: &usize| allowed.is_none_or(|a| a.contains(c));
    let big = topo.big();
    let compute: Vec<usize> = big.iter().copied().filter(ok).collect();
    if compute.is_empty() {
        return None;
    }
    let mut io: Vec<usize> = topo
        .classes
        .iter()
        .flat_map(|c| c.cpus.iter().copied())
        .filter(|c| ok(c) && !big.contains(c))
        .collect();
    io.sort_unstable();
    Some(Placement {
        compute,
        io,
        described: topo.describe(),
    })
}

/// The default `--threads` for `placement`: one per allowed big core; without a placement
/// `min(available, FLAT_THREADS_MAX)`.
pub fn default_threads_for(placement: Option<&Placement>, available: u32) -> u32 {
    match placement {
        Some(p) => p.compute.len() as u32,
        None => available.clamp(1, FLAT_THREADS_MAX),
    }
}

/// This machine's placement (the live `/sys`, the process's affinity mask).
pub fn this_placement() -> Option<Placement> {
    placement(
        read_topology(Path::new("/")).as_ref(),
        allowed_cpus().as_deref(),
    )
}

/// The default `--threads` of this machine.
pub fn default_threads() -> u32 {
    let available = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(FLAT_THREADS_MAX);
    default_threads_for(this_placement().as_ref(), available)
}

/// The CPUs the calling thread may run on (`sched_getaffinity`); `None` when unknown.
pub fn allowed_cpus() -> Option<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is the empty set; sched_getaffinity writes at most its
    // size into it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return None;
    }
    let n = 8 * std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: CPU_ISSET reads bit `c` of the set, `c` below its size in bits.
    Some(
        (0..n)
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect(),
    )
}

/// Pin the calling thread to `cpus` (`sched_setaffinity`). An empty list is refused, and so
/// is a CPU past the set's size; the OS's error otherwise (EINVAL when none of them is in the
/// process's cpuset, EPERM where a sandbox forbids it).
pub fn pin_current_thread(cpus: &[usize]) -> std::io::Result<()> {
    let n = 8 * std::mem::size_of::<libc::cpu_set_t>();
    if cpus.is_empty() || cpus.iter().any(|&c| c >= n) {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `c < n`, checked above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; the set is ours and of the size we pass.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// CPU numbers as the kernel writes them: `0-3,6`.
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if j > i {
            format!("{}-{}", cpus[i], cpus[j])
        } else {
            cpus[i].to_string()
        });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// A synthetic `/sys/devices/system/cpu` with `online` (when given) and one
    /// `cpuN/cpufreq/cpuinfo_max_freq` per `(cpu, khz)`; `khz` 0 writes a CPU without cpufreq.
    fn sys(name: &str, online: Option<&str>, cpus: &[(usize, u64)]) -> PathBuf {
        let root = crate::testdata::scratch_dir(&format!("cpus-{name}"));
        let _ = std::fs::remove_dir_all(&root);
        let base = root.join("sys/devices/system/cpu");
        std::fs::create_dir_all(&base).expect("mkdir");
        if let Some(o) = online {
            std::fs::write(base.join("online"), format!("{o}\n")).expect("write");
        }
        for &(cpu, khz) in cpus {
            let d = base.join(format!("cpu{cpu}"));
            std::fs::create_dir_all(&d).expect("mkdir");
            if khz > 0 {
                std::fs::create_dir_all(d.join("cpufreq")).expect("mkdir");
                std::fs::write(d.join("cpufreq/cpuinfo_max_freq"), format!("{khz}\n"))
                    .expect("write");
            }
        }
        root
    }

    /// Snapdragon 8 Gen 1: cpu0-3 A510 1.8 GHz, cpu4-6 A710 2.5 GHz, cpu7 X2 3.0 GHz.
    fn gen1(name: &str) -> PathBuf {
        let mut cpus: Vec<(usize, u64)> = (0..4).map(|c| (c, 1_785_600)).collect();
        cpus.extend((4..7).map(|c| (c, 2_496_000)));
        cpus.push((7, 2_995_200));
        sys(name, Some("0-7"), &cpus)
    }

    #[test]
    fn cpu_lists_parse_like_the_kernel_writes_them() {
        assert_eq!(
            parse_cpu_list("0-3,6,8-9\n"),
            Some(vec![0, 1, 2, 3, 6, 8, 9])
        );
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(parse_cpu_list("0-99999999"), None);
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
        assert_eq!(format_cpu_list(&[]), "");
    }

    #[test]
    fn a_prime_core_joins_the_big_cluster() {
        let t = read_topology(&gen1("gen1")).expect("cpufreq");
        assert_eq!(t.classes.len(), 3);
        assert_eq!(t.describe(), "1×2995 + 3×2496 + 4×1785 MHz");
        assert_eq!(t.big(), vec![4, 5, 6, 7]);
        let p = placement(Some(&t), None).expect("big.LITTLE");
        assert_eq!(p.compute, vec![4, 5, 6, 7]);
        assert_eq!(p.io, vec![0, 1, 2, 3]);
        assert_eq!(default_threads_for(Some(&p), 8), 4);
    }

    #[test]
    fn a_big_cluster_of_several_is_the_big_cores_alone() {
        // Tensor G2: 4× A55 1.8, 2× A78 2.35, 2× X1 2.85 GHz.
        let mut cpus: Vec<(usize, u64)> = (0..4).map(|c| (c, 1_803_000)).collect();
        cpus.extend([
            (4, 2_348_000),
            (5, 2_348_000),
            (6, 2_850_000),
            (7, 2_850_000),
        ]);
        let t = read_topology(&sys("g2", Some("0-7"), &cpus)).expect("cpufreq");
        assert_eq!(t.big(), vec![6, 7]);
        let p = placement(Some(&t), None).expect("big.LITTLE");
        assert_eq!(p.io, vec![0, 1, 2, 3, 4, 5]);
        // Dimensity 9000: X2 3.05 within 10 % of the A710s' 2.85: one class of four.
        let mut cpus: Vec<(usize, u64)> = (0..4).map(|c| (c, 1_800_000)).collect();
        cpus.extend([
            (4, 2_850_000),
            (5, 2_850_000),
            (6, 2_850_000),
            (7, 3_050_000),
        ]);
        let t = read_topology(&sys("d9000", None, &cpus)).expect("cpufreq");
        assert_eq!(t.classes.len(), 2);
        assert_eq!(t.big(), vec![4, 5, 6, 7]);
    }

    #[test]
    fn one_class_or_no_cpufreq_keeps_the_flat_default() {
        // A desktop: favoured cores 200 MHz above the rest are one class.
        let mut cpus: Vec<(usize, u64)> = (0..6).map(|c| (c, 4_700_000)).collect();
        cpus.extend([(6, 4_900_000), (7, 4_900_000)]);
        let t = read_topology(&sys("desktop", Some("0-7"), &cpus)).expect("cpufreq");
        assert_eq!(t.classes.len(), 1);
        assert_eq!(placement(Some(&t), None), None);
        assert_eq!(default_threads_for(None, 8), 4);
        assert_eq!(default_threads_for(None, 2), 2);
        assert_eq!(default_threads_for(None, 0), 1);
        // This VM: cpu directories without cpufreq.
        let root = sys("vm", Some("0-1"), &[(0, 0), (1, 0)]);
        assert_eq!(read_topology(&root), None);
        assert_eq!(placement(read_topology(&root).as_ref(), None), None);
        // No /sys at all.
        let empty = crate::testdata::scratch_dir("cpus-empty");
        assert_eq!(read_topology(&empty.join("nothing")), None);
    }

    #[test]
    fn offline_and_disallowed_cpus_are_left_out() {
        // cpu7 (the prime core) offline: the A710s are the fastest class, three of them.
        let root = gen1("offline");
        std::fs::write(root.join("sys/devices/system/cpu/online"), "0-6\n").expect("write");
        let t = read_topology(&root).expect("cpufreq");
        assert_eq!(t.big(), vec![4, 5, 6]);
        // An affinity mask without cpu4 and cpu7: the big cores left are 5 and 6.
        let t = read_topology(&gen1("cpuset")).expect("cpufreq");
        let allowed = [0, 1, 2, 3, 5, 6];
        let p = placement(Some(&t), Some(&allowed)).expect("two big cores allowed");
        assert_eq!(p.compute, vec![5, 6]);
        assert_eq!(p.io, vec![0, 1, 2, 3]);
        // None of the big cores allowed (a background cpuset): nothing is pinned.
        assert_eq!(placement(Some(&t), Some(&[0, 1, 2, 3])), None);
        // Without `online`, every cpuN directory counts; garbage frequencies are skipped.
        let root = sys("noonline", None, &[(0, 1_000_000), (1, 2_000_000)]);
        std::fs::write(
            root.join("sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"),
            "fast\n",
        )
        .expect("write");
        let t = read_topology(&root).expect("cpu1 reports");
        assert_eq!(
            t.classes,
            vec![CpuClass {
                max_khz: 2_000_000,
                cpus: vec![1]
            }]
        );
    }

    #[test]
    fn pinning_this_thread_to_what_it_may_run_on_works() {
        let allowed = allowed_cpus().expect("sched_getaffinity");
        assert!(!allowed.is_empty());
        // In a thread of its own, so the test harness's thread keeps its mask.
        let pinned =
            std::thread::spawn(move || pin_current_thread(&allowed[..1]).map(|()| allowed_cpus()))
                .join()
                .expect("thread");
        assert_eq!(pinned.expect("pin").map(|a| a.len()), Some(1));
        assert!(pin_current_thread(&[]).is_err());
        assert!(pin_current_thread(&[1 << 20]).is_err());
    }
}
