//! Process memory and CPU probes (getrusage, /proc/self/status, /proc/meminfo, mincore, the
//! cgroup memory limit): the engine's answers to the telemetry's memory-picture questions.

/// CPU time and fault counts of the whole process.
#[derive(Copy, Clone, Debug, Default)]
pub struct Rusage {
    pub cpu_s: f64,
    pub majflt: u64,
    pub minflt: u64,
    pub maxrss_kib: u64,
}

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
