//! A persistent pool of compute threads for the matrix products.
//!
//! Decode issues hundreds of matrix · vector products per token, each a few tens of
//! microseconds, so a call must not spawn threads or allocate: the workers live as long as the
//! pool, spin briefly waiting for the next call (the next product usually follows within
//! microseconds), then sleep on a condition variable so an idle engine costs no CPU.
//!
//! Protocol for one [`ThreadPool::run`]: the caller publishes the job, bumps `generation`, and
//! takes tasks itself; tasks are handed out by an atomic counter. Every worker checks in once per
//! generation (decrements `pending`) after its last use of the job, and `run` returns only when
//! `pending` is zero, so the borrowed closure is never touched after `run` returns.

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle thread spins for the next job (or the caller for stragglers) before it
/// sleeps. Long enough to bridge the gap between consecutive products of one token.
const SPIN: Duration = Duration::from_micros(200);

type Task = dyn Fn(usize) + Sync;

fn noop(_: usize) {}
const NOOP: &Task = &noop;

#[derive(Copy, Clone)]
struct Job {
    /// Valid from the generation bump until every worker has checked in.
    f: *const Task,
    n_tasks: usize,
}

struct Shared {
    /// Bumped once per job (and once at shutdown).
    generation: AtomicU64,
    /// Written only by the caller while no worker is between seeing a generation and checking in.
    job: UnsafeCell<Job>,
    next_task: AtomicUsize,
    /// Workers that have not yet checked in for the current generation.
    pending: AtomicUsize,
    shutdown: AtomicBool,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    done: Condvar,
    sleeping_workers: AtomicUsize,
    caller_sleeping: AtomicBool,
}

// SAFETY: `job` is the only non-Sync field; its accesses are ordered by `generation`
// (release by the writer, acquire by readers) and `pending` (readers finish before the next
// write), as described in the module docs.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

fn lock(m: &Mutex<()>) -> MutexGuard<'_, ()> {
    // Nothing panics while holding these locks; recover the guard if it ever happened.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fixed set of compute threads; the thread calling [`ThreadPool::run`] is one of them.
///
/// `run` calls must not nest (a task must not call `run` on the same pool); concurrent calls
/// from different threads are serialised.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
    run_lock: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` compute threads in all (`n_threads - 1` workers are spawned; the
    /// caller of `run` is the last). `0` is treated as `1`. If the OS refuses to spawn a
    /// worker, the pool runs with the threads it got ([`ThreadPool::n_threads`] tells).
    pub fn new(n_threads: usize) -> Self {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                f: NOOP as *const Task,
                n_tasks: 0,
            }),
            next_task: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            panic: Mutex::new(None),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            done: Condvar::new(),
            sleeping_workers: AtomicUsize::new(0),
            caller_sleeping: AtomicBool::new(false),
        });
        let mut workers = Vec::new();
        for i in 1..n_threads.max(1) {
            let s = Arc::clone(&shared);
            match std::thread::Builder::new()
                .name(format!("bmoe-compute-{i}"))
                .spawn(move || worker_loop(&s))
            {
                Ok(h) => workers.push(h),
                Err(_) => break,
            }
        }
        let n_threads = workers.len() + 1;
        ThreadPool {
            shared,
            workers,
            n_threads,
            run_lock: Mutex::new(()),
        }
    }

    /// Compute threads, counting the caller.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(i)` for every `i` in `0..n_tasks`, spread over the threads, and returns when all
    /// calls have returned. Which thread runs which task is not fixed, so tasks must not depend
    /// on it. No allocation and no thread creation. If a task panics, the panic is re-raised
    /// here after every other task has finished.
    pub fn run<'f>(&self, n_tasks: usize, f: &'f (dyn Fn(usize) + Sync + 'f)) {
        let _serial = lock(&self.run_lock);
        if self.workers.is_empty() || n_tasks <= 1 {
            for i in 0..n_tasks {
                f(i);
            }
            return;
        }
        let s = &*self.shared;
        // SAFETY: erases the borrow's lifetime; `run` does not return before every worker has
        // checked in for this generation, after its last use of `f`.
        let f_static: &'static Task =
            unsafe { std::mem::transmute::<&'f (dyn Fn(usize) + Sync + 'f), &'static Task>(f) };
        // SAFETY: all workers checked in for the previous generation (pending == 0), so none
        // reads `job` until the generation bump below publishes it.
        unsafe {
            *s.job.get() = Job {
                f: f_static as *const Task,
                n_tasks,
            }
        };
        s.next_task.store(0, Ordering::Relaxed);
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.sleeping_workers.load(Ordering::SeqCst) > 0 {
            let _g = lock(&s.sleep_lock);
            s.wake.notify_all();
        }

        let mine = catch_unwind(AssertUnwindSafe(|| take_tasks(s, f, n_tasks)));
        self.wait_for_workers();

        let theirs = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if let Some(p) = theirs {
            resume_unwind(p);
        }
    }

    fn wait_for_workers(&self) {
        let s = &*self.shared;
        let start = Instant::now();
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins % 64 == 0 && start.elapsed() > SPIN {
                let mut g = lock(&s.sleep_lock);
                s.caller_sleeping.store(true, Ordering::SeqCst);
                while s.pending.load(Ordering::SeqCst) != 0 {
                    g = s.done.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.caller_sleeping.store(false, Ordering::SeqCst);
                break;
            }
        }
        // Pairs with the workers' release in `fetch_sub`, so their writes are visible.
        std::sync::atomic::fence(Ordering::Acquire);
    }
}

fn take_tasks(s: &Shared, f: &(dyn Fn(usize) + Sync + '_), n_tasks: usize) {
    loop {
        let i = s.next_task.fetch_add(1, Ordering::Relaxed);
        if i >= n_tasks {
            break;
        }
        f(i);
    }
}

fn worker_loop(s: &Shared) {
    let mut seen = 0u64;
    loop {
        seen = wait_for_generation(s, seen);
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: the generation was published after `job` was written, and the caller does
        // not write it again before this worker checks in below.
        let job = unsafe { *s.job.get() };
        // SAFETY: the closure outlives this generation (see `ThreadPool::run`).
        let f = unsafe { &*job.f };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| take_tasks(s, f, job.n_tasks))) {
            let mut slot = s.panic.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert(p);
        }
        if s.pending.fetch_sub(1, Ordering::SeqCst) == 1 && s.caller_sleeping.load(Ordering::SeqCst)
        {
            let _g = lock(&s.sleep_lock);
            s.done.notify_all();
        }
    }
}

/// Waits until `generation` differs from `seen`; returns the new value.
fn wait_for_generation(s: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let g = s.generation.load(Ordering::Acquire);
        if g != seen {
            return g;
        }
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins % 64 == 0 && start.elapsed() > SPIN {
            break;
        }
    }
    let mut g = lock(&s.sleep_lock);
    s.sleeping_workers.fetch_add(1, Ordering::SeqCst);
    loop {
        let gen = s.generation.load(Ordering::SeqCst);
        if gen != seen {
            s.sleeping_workers.fetch_sub(1, Ordering::SeqCst);
            return gen;
        }
        g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::Release);
        s.generation.fetch_add(1, Ordering::SeqCst);
        {
            let _g = lock(&s.sleep_lock);
            s.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        for threads in 1..=4 {
            let pool = ThreadPool::new(threads);
            assert_eq!(pool.n_threads(), threads);
            for n_tasks in [0usize, 1, 2, 3, 17, 1000] {
                let hits: Vec<AtomicUsize> = (0..n_tasks).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n_tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn many_short_runs_and_sleeping_workers() {
        let pool = ThreadPool::new(3);
        let total = AtomicUsize::new(0);
        for round in 0..2000 {
            pool.run(5, &|i| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
            if round == 1000 {
                // Let the workers fall asleep, then wake them with the next run.
                std::thread::sleep(SPIN * 5);
            }
        }
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 15);
    }

    #[test]
    fn a_panicking_task_is_reraised_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|i| {
                if i == 5 {
                    panic!("task 5 failed");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }
}
