//! SIEVE (Zhang et al., NSDI 2024): one FIFO queue, one visited bit per entry, and a hand.
//!
//! A newly admitted expert enters at the head with its bit clear; a hit only sets the bit
//! (nothing moves). To evict, the hand walks from where it last stopped towards the head,
//! wrapping from the head to the tail: an entry whose bit is set has it cleared and is passed
//! over, and the first entry whose bit is clear is the victim; the hand then rests on the
//! victim's newer neighbour (on the tail, after the head). Survivors keep their place, so the
//! entries newer than the hand — the recent admissions — are judged soon after they arrive,
//! and a one-off routing leaves quickly without first sinking through a whole LRU list.
//!
//! How it fits the cache's interface (`EvictionPolicy`):
//! - The byte budget decides *when* to evict; SIEVE only decides *which*, so it needs no
//!   capacity.
//! - A pinned (non-evictable) entry is passed over with its bit unchanged: the hand neither
//!   clears nor picks it, and it keeps its place.
//! - `victim` is a query: it walks a copy of the hand over the unchanged queue, names the
//!   victim and remembers the bits that walk clears. `on_remove` of that very key applies them
//!   and moves the hand on, so the walk takes effect exactly when the cache evicts what it
//!   named (the cache removes the victim straight after asking). Any other removal (an entry
//!   discarded after a failed read) only takes the entry out; a hand resting on it moves to
//!   its newer neighbour.
//! - If every evictable entry has its bit set, the walk clears them all and comes round to the
//!   first of them again: that one is the victim, as in the paper's loop.

use super::lists::Lists;
use super::EvictionPolicy;
use crate::layout::ExpertLayout;
use std::cell::RefCell;

/// The one queue, in `Lists` list 0: head = newest admission.
const QUEUE: usize = 0;

/// The SIEVE policy.
#[derive(Clone, Debug, Default)]
pub struct Sieve {
    queue: Lists,
    /// Per key: hit since it was admitted or since the hand last passed it.
    visited: Vec<bool>,
    /// The next entry the hand examines; `None` = the tail (oldest).
    hand: Option<u32>,
    /// What the last `victim` decided, for `on_remove` of that key to apply.
    pending: RefCell<Walk>,
}

/// One walk of the hand: the victim it stopped on and the visited bits it cleared on the way.
#[derive(Clone, Debug, Default)]
struct Walk {
    victim: Option<u32>,
    cleared: Vec<u32>,
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "sieve",
    help: "SIEVE: a FIFO queue with a visited bit; a moving hand clears set bits and evicts the first entry not hit since it last passed",
    make: || Box::new(Sieve::new()),
};

impl Sieve {
    /// An empty SIEVE; `init` sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys from the oldest (tail) to the newest (head), each with its visited bit (for tests
    /// and reports).
    pub fn order(&self) -> Vec<(u32, bool)> {
        self.queue
            .oldest_first(QUEUE)
            .map(|k| (k, self.visited[k as usize]))
            .collect()
    }

    /// The entry the hand examines next (`None` = the tail).
    pub fn hand(&self) -> Option<u32> {
        self.hand
    }

    /// One step of the hand: the next newer entry, wrapping from the head to the tail.
    fn step(&self, key: u32) -> Option<u32> {
        self.queue.newer(key).or_else(|| self.queue.oldest(QUEUE))
    }
}

impl EvictionPolicy for Sieve {
    fn name(&self) -> &'static str {
        INFO.name
    }

    fn init(&mut self, layout: &ExpertLayout) {
        let n = layout.n_keys() as usize;
        *self = Sieve::new();
        self.queue = Lists::new(n, 1);
        self.visited = vec![false; n];
    }

    fn on_insert(&mut self, index: u32) {
        let i = index as usize;
        if i >= self.visited.len() || self.queue.list_of(index).is_some() {
            return;
        }
        self.pending.get_mut().victim = None;
        self.queue.push_front(QUEUE, index);
        self.visited[i] = false;
    }

    fn on_hit(&mut self, index: u32) {
        if self.queue.list_of(index).is_some() {
            self.pending.get_mut().victim = None;
            self.visited[index as usize] = true;
        }
    }

    fn on_remove(&mut self, index: u32) {
        if self.queue.list_of(index).is_none() {
            return;
        }
        let walk = self.pending.get_mut();
        let planned = walk.victim.take() == Some(index);
        if planned {
            for &k in &walk.cleared {
                self.visited[k as usize] = false;
            }
        }
        walk.cleared.clear();
        if planned || self.hand == Some(index) {
            self.hand = self.queue.newer(index);
        }
        self.queue.unlink(index);
        self.visited[index as usize] = false;
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        let mut walk = self.pending.borrow_mut();
        walk.victim = None;
        walk.cleared.clear();
        let mut at = self.hand.or_else(|| self.queue.oldest(QUEUE));
        let mut first_evictable = None;
        // One lap examines every entry once; a second lap would stop on the first evictable
        // entry, whose bit the first lap cleared.
        for _ in 0..self.queue.len(QUEUE) {
            let Some(k) = at else {
                break;
            };
            if is_evictable(k) {
                if !self.visited[k as usize] {
                    walk.victim = Some(k);
                    return Some(k);
                }
                first_evictable.get_or_insert(k);
                walk.cleared.push(k);
            }
            at = self.step(k);
        }
        walk.victim = first_evictable;
        first_evictable
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn the_hand_clears_visited_entries_and_evicts_the_first_unvisited() {
        let mut p = Sieve::new();
        p.init(&layout(1, 16));
        for i in 0..5 {
            p.on_insert(i);
        }
        p.on_hit(0);
        p.on_hit(2);
        // Tail to head: 0* 1 2* 3 4. From the tail: 0 is cleared, 1 goes.
        assert_eq!(p.victim(&|_| true), Some(1));
        // Asking is not evicting: nothing moved, and asking again gives the same answer.
        assert_eq!(p.order()[0], (0, true));
        assert_eq!(p.hand(), None);
        assert_eq!(p.victim(&|_| true), Some(1));
        p.on_remove(1);
        assert_eq!(
            p.order(),
            vec![(0, false), (2, true), (3, false), (4, false)]
        );
        assert_eq!(
            p.hand(),
            Some(2),
            "the hand rests on the victim's newer neighbour"
        );
        // 5 enters at the head, unvisited; the hand goes on from 2: 2 is cleared, 3 goes.
        p.on_insert(5);
        assert_eq!(p.victim(&|_| true), Some(3));
        p.on_remove(3);
        assert_eq!(p.hand(), Some(4));
        // A pinned entry is passed over with its bit kept: 4 (pinned) and 5 are skipped...
        p.on_hit(5);
        p.on_hit(4);
        assert_eq!(
            p.victim(&|i| i != 4),
            Some(0),
            "wraps to the tail; 5 is cleared"
        );
        p.on_remove(0);
        assert_eq!(p.order(), vec![(2, false), (4, true), (5, false)]);
        assert_eq!(p.hand(), Some(2));
        // Every evictable entry visited: one lap clears them all, the first one goes.
        p.on_hit(2);
        p.on_hit(5);
        assert_eq!(p.victim(&|_| true), Some(2));
        p.on_remove(2);
        assert_eq!(p.order(), vec![(4, false), (5, false)]);
        assert_eq!(p.hand(), Some(4));
        // A removal the walk did not name (a discard) applies nothing; removing the entry the
        // hand rests on moves the hand to its newer neighbour (none: back to the tail).
        p.on_hit(5);
        assert_eq!(p.victim(&|_| true), Some(4));
        p.on_remove(5);
        assert_eq!(p.order(), vec![(4, false)]);
        assert_eq!(p.hand(), Some(4));
        p.on_remove(4);
        assert_eq!(p.hand(), None);
        assert_eq!(p.victim(&|_| true), None);
        p.on_hit(99);
        p.on_insert(99);
        p.on_remove(99);
        assert_eq!(p.victim(&|_| false), None);
    }
}
