//! A persistent pool of compute threads for the matrix products.
//!
//! Decode issues hundreds of matrix · vector products per token, each a few tens of
//! microseconds, so a call must not spawn threads or allocate: the workers live as long as the
//! pool, spin briefly waiting for the next call (the next product usually follows within
//! microseconds), then sleep on a condition variable so an idle engine costs no CPU.
//!
//! Protocol for one [`ThreadPool::run`]: one atomic word holds (generation, task count, next
//! task). The caller points `job` at the closure, publishes a new word, and takes tasks itself;
//! anyone claims task `i` by a compare-and-swap of `next` from `i` to `i + 1` within the same
//! word, and only then reads `job`. `run` returns when `done` reaches the task count. So a
//! worker that wakes late (descheduled on a busy machine) never holds the caller up: it finds
//! no task left and goes back to waiting, and a successful claim proves the job is still live
//! (the caller cannot return before that claimed task completes).

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle thread spins for the next job (or the caller for stragglers) before it
/// sleeps. Long enough to bridge the gap between consecutive products of one token.
const SPIN: Duration = Duration::from_micros(200);

/// Tasks per round: the task count and the next index are 24-bit fields of the state word.
const MAX_ROUND: usize = (1 << 24) - 1;

/// The state word: generation (16 bits, wrapping) | task count (24) | next task (24).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
struct State {
    generation: u16,
    n_tasks: usize,
    next: usize,
}

impl State {
    fn pack(self) -> u64 {
        ((self.generation as u64) << 48) | ((self.n_tasks as u64) << 24) | self.next as u64
    }
    fn unpack(w: u64) -> State {
        State {
            generation: (w >> 48) as u16,
            n_tasks: ((w >> 24) & MAX_ROUND as u64) as usize,
            next: (w & MAX_ROUND as u64) as usize,
        }
    }
}

/// What a claimed task runs: the caller's closure and the index offset of this round. Lives on
/// the caller's stack for the duration of one round.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync + 'a),
    base: usize,
}

struct Shared {
    state: AtomicU64,
    /// The current round's `Job` (type-erased); read only after a successful claim.
    job: AtomicPtr<()>,
    /// Tasks of the current round that have returned.
    done: AtomicUsize,
    shutdown: AtomicBool,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    finished: Condvar,
    sleeping_workers: AtomicUsize,
    caller_sleeping: AtomicBool,
}

fn lock(m: &Mutex<()>) -> MutexGuard<'_, ()> {
    // Nothing panics while holding these locks; recover the guard if it ever happened.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fixed set of compute threads; the thread calling [`ThreadPool::run`] is one of them.
///
/// `run` calls must not nest (a task must not call `run` on the same pool: it would wait for
/// itself); concurrent calls from different threads are serialised.
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
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            panic: Mutex::new(None),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            finished: Condvar::new(),
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
    /// calls have returned. Which thread runs which task is not fixed, so results must not
    /// depend on it. No allocation and no thread creation. If a task panics, the other tasks
    /// still run and the first panic is re-raised here.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let _serial = lock(&self.run_lock);
        if self.workers.is_empty() || n_tasks <= 1 {
            for i in 0..n_tasks {
                f(i);
            }
            return;
        }
        let mut base = 0;
        while base < n_tasks {
            let count = (n_tasks - base).min(MAX_ROUND);
            self.round(&Job { f, base }, count);
            base += count;
        }
        let panicked = self
            .shared
            .panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(p) = panicked {
            resume_unwind(p);
        }
    }

    fn round(&self, job: &Job<'_>, count: usize) {
        let s = &*self.shared;
        s.done.store(0, Ordering::Relaxed);
        s.job
            .store(job as *const Job<'_> as *mut (), Ordering::Relaxed);
        let old = State::unpack(s.state.load(Ordering::Relaxed));
        let fresh = State {
            generation: old.generation.wrapping_add(1),
            n_tasks: count,
            next: 0,
        };
        // Publishes `job` and `done` to whoever acquires this word.
        s.state.store(fresh.pack(), Ordering::SeqCst);
        if s.sleeping_workers.load(Ordering::SeqCst) > 0 {
            let _g = lock(&s.sleep_lock);
            s.wake.notify_all();
        }
        while claim_and_run(s, fresh.generation) {}
        self.wait_done(count);
    }

    fn wait_done(&self, count: usize) {
        let s = &*self.shared;
        let start = Instant::now();
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) != count {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins % 64 == 0 && start.elapsed() > SPIN {
                let mut g = lock(&s.sleep_lock);
                s.caller_sleeping.store(true, Ordering::SeqCst);
                while s.done.load(Ordering::SeqCst) != count {
                    g = s.finished.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.caller_sleeping.store(false, Ordering::SeqCst);
                break;
            }
        }
        std::sync::atomic::fence(Ordering::Acquire);
    }
}

/// Claims the next task of `generation` and runs it; false when none is left (or the
/// generation is over).
fn claim_and_run(s: &Shared, generation: u16) -> bool {
    let mut word = s.state.load(Ordering::Acquire);
    loop {
        let st = State::unpack(word);
        if st.generation != generation || st.next >= st.n_tasks {
            return false;
        }
        let claimed = State {
            next: st.next + 1,
            ..st
        };
        match s.state.compare_exchange_weak(
            word,
            claimed.pack(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                // SAFETY: the claim succeeded on this round's word, so the round is not over
                // (it cannot end before this task reports done) and `job` points at the
                // caller's live `Job`, published before the word.
                let job = unsafe { &*(s.job.load(Ordering::Acquire) as *const Job<'_>) };
                if let Err(p) = catch_unwind(AssertUnwindSafe(|| (job.f)(job.base + st.next))) {
                    let mut slot = s.panic.lock().unwrap_or_else(|e| e.into_inner());
                    slot.get_or_insert(p);
                }
                let finished = s.done.fetch_add(1, Ordering::SeqCst) + 1 == st.n_tasks;
                if finished && s.caller_sleeping.load(Ordering::SeqCst) {
                    let _g = lock(&s.sleep_lock);
                    s.finished.notify_all();
                }
                return true;
            }
            Err(now) => word = now,
        }
    }
}

fn worker_loop(s: &Shared) {
    let mut seen = State::unpack(s.state.load(Ordering::Acquire)).generation;
    loop {
        seen = wait_for_generation(s, seen);
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        while claim_and_run(s, seen) {}
    }
}

/// Waits until the state's generation differs from `seen` (or shutdown); returns the new one.
fn wait_for_generation(s: &Shared, seen: u16) -> u16 {
    let current = || State::unpack(s.state.load(Ordering::SeqCst)).generation;
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let g = current();
        if g != seen || s.shutdown.load(Ordering::Relaxed) {
            return g;
        }
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins % 64 == 0 && start.elapsed() > SPIN {
            break;
        }
    }
    let mut guard = lock(&s.sleep_lock);
    s.sleeping_workers.fetch_add(1, Ordering::SeqCst);
    loop {
        let g = current();
        if g != seen || s.shutdown.load(Ordering::SeqCst) {
            s.sleeping_workers.fetch_sub(1, Ordering::SeqCst);
            return g;
        }
        guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::SeqCst);
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
    fn state_word_round_trips() {
        let st = State {
            generation: 0xBEEF,
            n_tasks: MAX_ROUND,
            next: 12345,
        };
        assert_eq!(State::unpack(st.pack()), st);
    }

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
