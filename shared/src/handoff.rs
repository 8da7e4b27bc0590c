//! The handoff between the engine's I/O lane threads and the core loop: a work queue per lane
//! and one completion board.
//!
//! The core loop is single-threaded, but the engine's `Flash` reads on N lane threads. Two
//! things must hold for the bytes the backend computes on (STYLE 9, model-checked with loom in
//! `tests/loom_handoff.rs`):
//! 1. **A slot is never read before its bytes landed.** A lane writes the slot, *then*
//!    `publish`es the read's outcome under the board's mutex; the core reads the slot only
//!    after `wait`/`try_take` returned that outcome (same mutex), so the lane's writes
//!    happen-before the core's reads.
//! 2. **A slot is never reused while a compute reads it.** The core pushes the next read into
//!    a slot only after the compute on it returned; the push and the lane's `pop` go through
//!    the queue's mutex, so the compute's reads happen-before the lane's next write.
//!
//! Under `cfg(loom)` the primitives are loom's, so the same code is what the model checker
//! explores.

use std::collections::VecDeque;
use thiserror::Error;

#[cfg(loom)]
use loom::sync::{Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
use std::sync::{Condvar, Mutex, MutexGuard};

/// Why a handoff call failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HandoffError {
    #[error("read {id} was never expected, or its outcome was already taken")]
    UnknownRead { id: u64 },
    #[error("the handoff is closed (the I/O lanes are shutting down)")]
    Closed,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking lane leaves the data consistent (every update is a single push/remove), so
    // a poisoned lock is still usable; the panic itself surfaces when the lane is joined.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct QueueState<T> {
    items: VecDeque<T>,
    closed: bool,
}

/// A blocking FIFO of reads for one I/O lane: the core pushes, the lane pops.
pub struct LaneQueue<T> {
    state: Mutex<QueueState<T>>,
    ready: Condvar,
}

impl<T> Default for LaneQueue<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> LaneQueue<T> {
    /// An empty, open queue.
    pub fn new() -> Self {
        LaneQueue {
            state: Mutex::new(QueueState {
                items: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }

    /// Queue `item` for the lane. Refused once the queue is closed.
    pub fn push(&self, item: T) -> Result<(), HandoffError> {
        let mut s = lock(&self.state);
        if s.closed {
            return Err(HandoffError::Closed);
        }
        s.items.push_back(item);
        drop(s);
        self.ready.notify_one();
        Ok(())
    }

    /// The lane's next item, blocking while the queue is empty and open; `None` once it is
    /// closed and drained.
    pub fn pop(&self) -> Option<T> {
        let mut s = lock(&self.state);
        loop {
            if let Some(item) = s.items.pop_front() {
                return Some(item);
            }
            if s.closed {
                return None;
            }
            s = self.ready.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Remove the first queued item matching `pred` (a read the lane has not started: the
    /// cancel path). `None` when no queued item matches — it already started or never was.
    pub fn remove_first(&self, mut pred: impl FnMut(&T) -> bool) -> Option<T> {
        let mut s = lock(&self.state);
        let i = s.items.iter().position(&mut pred)?;
        s.items.remove(i)
    }

    /// Stop accepting items; the lane drains what is queued, then `pop` returns `None`.
    pub fn close(&self) {
        lock(&self.state).closed = true;
        self.ready.notify_all();
    }

    /// Items queued and not yet popped.
    pub fn len(&self) -> usize {
        lock(&self.state).items.len()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

struct BoardState<T> {
    /// Ids expected and not yet taken (published or not).
    expected: Vec<u64>,
    /// Published outcomes, in publication order.
    done: VecDeque<(u64, T)>,
    closed: bool,
}

/// Where lanes publish finished reads and the core collects them. Each expected read's
/// outcome is taken exactly once, by `wait` or `try_take`.
pub struct Completions<T> {
    state: Mutex<BoardState<T>>,
    published: Condvar,
}

impl<T> Default for Completions<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Completions<T> {
    /// An empty, open board.
    pub fn new() -> Self {
        Completions {
            state: Mutex::new(BoardState {
                expected: Vec::new(),
                done: VecDeque::new(),
                closed: false,
            }),
            published: Condvar::new(),
        }
    }

    /// Core: announce read `id` before handing it to a lane, so `wait(id)` knows to block
    /// for it instead of refusing it.
    pub fn expect(&self, id: u64) {
        lock(&self.state).expected.push(id);
    }

    /// Lane: the read's bytes are in its slot (or it failed); hand over its outcome.
    pub fn publish(&self, id: u64, outcome: T) {
        lock(&self.state).done.push_back((id, outcome));
        self.published.notify_all();
    }

    /// Core: block until read `id` is published and take its outcome. `UnknownRead` when
    /// `id` was never expected or was already taken; `Closed` when the board closes first.
    pub fn wait(&self, id: u64) -> Result<T, HandoffError> {
        let mut s = lock(&self.state);
        loop {
            if let Some(i) = s.done.iter().position(|(d, _)| *d == id) {
                s.expected.retain(|&e| e != id);
                return s
                    .done
                    .remove(i)
                    .map(|(_, t)| t)
                    .ok_or(HandoffError::UnknownRead { id });
            }
            if !s.expected.contains(&id) {
                return Err(HandoffError::UnknownRead { id });
            }
            if s.closed {
                return Err(HandoffError::Closed);
            }
            s = self.published.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Core: the earliest published outcome not yet taken, without blocking.
    pub fn try_take(&self) -> Option<(u64, T)> {
        let mut s = lock(&self.state);
        let (id, t) = s.done.pop_front()?;
        s.expected.retain(|&e| e != id);
        Some((id, t))
    }

    /// Core: read `id` was cancelled before a lane started it and will never be published.
    /// Returns whether it was expected.
    pub fn forget(&self, id: u64) -> bool {
        let mut s = lock(&self.state);
        let before = s.expected.len();
        s.expected.retain(|&e| e != id);
        before != s.expected.len()
    }

    /// Reads expected and not yet taken.
    pub fn outstanding(&self) -> usize {
        lock(&self.state).expected.len()
    }

    /// Wake every waiter with `Closed` (the lanes are gone); published outcomes can still be
    /// taken.
    pub fn close(&self) {
        lock(&self.state).closed = true;
        self.published.notify_all();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn lane_thread_round_trip_and_cancel() {
        let queue: Arc<LaneQueue<(u64, u32)>> = Arc::new(LaneQueue::new());
        let board: Arc<Completions<u32>> = Arc::new(Completions::new());
        for id in 0..3u64 {
            board.expect(id);
            queue.push((id, id as u32 * 10)).unwrap();
        }
        // Cancel read 2 before any lane runs.
        assert_eq!(queue.remove_first(|(id, _)| *id == 2), Some((2, 20)));
        assert!(board.forget(2));
        let (q, b) = (queue.clone(), board.clone());
        let lane = std::thread::spawn(move || {
            while let Some((id, v)) = q.pop() {
                b.publish(id, v + 1);
            }
        });
        assert_eq!(board.wait(1), Ok(11));
        assert_eq!(board.wait(0), Ok(1));
        assert_eq!(board.wait(0), Err(HandoffError::UnknownRead { id: 0 }));
        assert_eq!(board.wait(2), Err(HandoffError::UnknownRead { id: 2 }));
        queue.close();
        assert_eq!(queue.push((9, 9)), Err(HandoffError::Closed));
        lane.join().unwrap();
        assert_eq!(board.outstanding(), 0);
        board.expect(5);
        board.close();
        assert_eq!(board.wait(5), Err(HandoffError::Closed));
    }
}
