//! Model-checks the I/O-lane → compute handoff (`bmoe_core::handoff`) with loom: under every
//! interleaving loom explores, a slot is never read before the lane's bytes landed and never
//! rewritten by a lane while the compute side still reads it. The slot is a
//! `loom::cell::UnsafeCell`, so any access not ordered by happens-before is reported as a race.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p bmoe-core --release --test loom_handoff`
//! (a separate `CARGO_TARGET_DIR` avoids rebuilding the normal target).

#![cfg(loom)]

use bmoe_core::handoff::{Completions, LaneQueue};
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

/// Expert memory the lane writes and the compute reads.
struct Slot(UnsafeCell<u64>);

// SAFETY: access is what this test checks; loom's UnsafeCell reports any unsynchronised use.
unsafe impl Sync for Slot {}

impl Slot {
    fn new() -> Self {
        Slot(UnsafeCell::new(0))
    }
    /// The lane's `pread` into the slot.
    fn fill(&self, value: u64) {
        self.0.with_mut(|p| unsafe { *p = value });
    }
    /// The compute's read of the slot.
    fn compute(&self) -> u64 {
        self.0.with(|p| unsafe { *p })
    }
}

/// A read request: (read id, slot index, value to write).
type Req = (u64, usize, u64);

fn lane(queue: Arc<LaneQueue<Req>>, board: Arc<Completions<()>>, slots: Arc<Vec<Slot>>) {
    while let Some((id, slot, value)) = queue.pop() {
        slots[slot].fill(value);
        board.publish(id, ());
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// Serial pattern on one lane: read, wait, compute, then reuse the same slot for the next read.
#[test]
fn a_slot_is_read_after_its_bytes_land_and_reused_only_after_compute() {
    model(|| {
        let queue = Arc::new(LaneQueue::new());
        let board = Arc::new(Completions::new());
        let slots = Arc::new(vec![Slot::new()]);
        let t = {
            let (q, b, s) = (queue.clone(), board.clone(), slots.clone());
            thread::spawn(move || lane(q, b, s))
        };
        for (id, value) in [(1u64, 41u64), (2, 42)] {
            board.expect(id);
            queue.push((id, 0, value)).unwrap();
            board.wait(id).unwrap();
            assert_eq!(
                slots[0].compute(),
                value,
                "compute saw the bytes of read {id}"
            );
        }
        queue.close();
        t.join().unwrap();
    });
}

/// Overlap pattern on two lanes and two slots: the core takes whichever completion is in
/// (`try_take`), computes that slot, and otherwise blocks on the oldest read.
#[test]
fn overlap_computes_each_slot_as_its_own_read_lands() {
    model(|| {
        let queues = [Arc::new(LaneQueue::new()), Arc::new(LaneQueue::new())];
        let board = Arc::new(Completions::new());
        let slots = Arc::new(vec![Slot::new(), Slot::new()]);
        let threads: Vec<_> = queues
            .iter()
            .map(|q| {
                let (q, b, s) = (q.clone(), board.clone(), slots.clone());
                thread::spawn(move || lane(q, b, s))
            })
            .collect();
        for (id, slot) in [(0u64, 0usize), (1, 1)] {
            board.expect(id);
            queues[slot].push((id, slot, 100 + id)).unwrap();
        }
        let mut computed = [false, false];
        while computed.iter().any(|c| !c) {
            let id = match board.try_take() {
                Some((id, ())) => id,
                None => {
                    let oldest = if computed[0] { 1 } else { 0 };
                    board.wait(oldest).unwrap();
                    oldest
                }
            };
            let slot = id as usize;
            assert_eq!(slots[slot].compute(), 100 + id);
            computed[slot] = true;
        }
        for q in &queues {
            q.close();
        }
        for t in threads {
            t.join().unwrap();
        }
    });
}

/// Cancel: a read removed from its lane queue before the lane popped it never touches the
/// slot and is never published; otherwise its outcome arrives as usual.
#[test]
fn a_cancelled_read_never_lands() {
    model(|| {
        let queue = Arc::new(LaneQueue::new());
        let board = Arc::new(Completions::new());
        let slots = Arc::new(vec![Slot::new()]);
        board.expect(7);
        queue.push((7, 0, 77)).unwrap();
        let t = {
            let (q, b, s) = (queue.clone(), board.clone(), slots.clone());
            thread::spawn(move || lane(q, b, s))
        };
        if queue.remove_first(|r| r.0 == 7).is_some() {
            assert!(board.forget(7));
            queue.close();
            t.join().unwrap();
            assert_eq!(slots[0].compute(), 0, "a cancelled read wrote the slot");
        } else {
            board.wait(7).unwrap();
            assert_eq!(slots[0].compute(), 77);
            queue.close();
            t.join().unwrap();
        }
        assert_eq!(board.outstanding(), 0);
    });
}

/// Negative control: reading the slot *before* waiting for its completion is a race loom
/// must find — proof that the checks above can fail.
#[test]
#[should_panic(expected = "Causality violation")]
fn computing_before_the_completion_is_caught() {
    model(|| {
        let queue = Arc::new(LaneQueue::new());
        let board = Arc::new(Completions::new());
        let slots = Arc::new(vec![Slot::new()]);
        let t = {
            let (q, b, s) = (queue.clone(), board.clone(), slots.clone());
            thread::spawn(move || lane(q, b, s))
        };
        board.expect(1);
        queue.push((1, 0, 5)).unwrap();
        let _ = slots[0].compute();
        board.wait(1).unwrap();
        queue.close();
        t.join().unwrap();
    });
}

/// Negative control: queueing the next read into a slot *before* computing on it lets the
/// lane overwrite bytes the compute is reading — loom must find it.
#[test]
#[should_panic(expected = "Causality violation")]
fn reusing_a_slot_before_compute_finishes_is_caught() {
    model(|| {
        let queue = Arc::new(LaneQueue::new());
        let board = Arc::new(Completions::new());
        let slots = Arc::new(vec![Slot::new()]);
        let t = {
            let (q, b, s) = (queue.clone(), board.clone(), slots.clone());
            thread::spawn(move || lane(q, b, s))
        };
        board.expect(1);
        queue.push((1, 0, 5)).unwrap();
        board.wait(1).unwrap();
        board.expect(2);
        queue.push((2, 0, 6)).unwrap();
        let _ = slots[0].compute();
        board.wait(2).unwrap();
        queue.close();
        t.join().unwrap();
    });
}
