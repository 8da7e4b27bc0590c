//! 2Q (Johnson & Shasha, VLDB 1994), the "full" version: a newly admitted expert enters a FIFO
//! probation queue `A1in`; one evicted from probation is remembered in a ghost queue `A1out`
//! (keys only, no bytes); an expert admitted again while remembered was wanted twice within a
//! short interval and goes to the protected LRU `Am`. Experts used once (a one-off routing)
//! leave through `A1in` without displacing the hot set in `Am`. Hits in `A1in` do not move an
//! entry (correlated references), hits in `Am` make it most recent.
//!
//! The policy interface gives no capacity in entries, so the queue sizes follow the resident
//! count `n` (the cache is full whenever it asks for a victim): `Kin = max(1, n/4)` and
//! `Kout = max(1, n/2)`, the paper's recommended 25 % and 50 %. The victim is `A1in`'s oldest
//! evictable entry while `A1in` holds more than `Kin` entries, else `Am`'s least recent; when the
//! preferred queue has nothing evictable, the other queue's.
//!
//! Intrusive lists over the dense key indices (`lists.rs`, O(1) per event); the ghost queue is a
//! FIFO of (key, stamp) with lazy deletion.

use super::lists::Lists;
use super::EvictionPolicy;
use crate::layout::ExpertLayout;
use std::collections::VecDeque;

const A1IN: usize = 0;
const AM: usize = 1;

/// The 2Q policy.
#[derive(Clone, Debug, Default)]
pub struct TwoQ {
    /// List 0 = A1in (FIFO), list 1 = Am (LRU); head = newest.
    queues: Lists,
    /// A1out: (key, stamp); live while `ghost[key] == stamp`.
    ghost_fifo: VecDeque<(u32, u64)>,
    ghost: Vec<u64>,
    ghost_len: usize,
    stamp: u64,
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "2q",
    help: "2Q: new experts on a FIFO probation queue, re-admitted ones (remembered by a ghost queue) on a protected LRU",
    make: || Box::new(TwoQ::new()),
};

impl TwoQ {
    /// An empty 2Q; `init` sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries in (A1in, Am) and remembered in A1out.
    pub fn sizes(&self) -> (u32, u32, usize) {
        (self.queues.len(A1IN), self.queues.len(AM), self.ghost_len)
    }

    fn resident(&self) -> u32 {
        self.queues.len(A1IN) + self.queues.len(AM)
    }
}

impl EvictionPolicy for TwoQ {
    fn name(&self) -> &'static str {
        INFO.name
    }

    fn init(&mut self, layout: &ExpertLayout) {
        let n = layout.n_keys() as usize;
        *self = TwoQ::new();
        self.queues = Lists::new(n, 2);
        self.ghost = vec![0; n];
    }

    fn on_insert(&mut self, index: u32) {
        let i = index as usize;
        if i >= self.ghost.len() {
            return;
        }
        if self.ghost[i] != 0 {
            self.ghost[i] = 0;
            self.ghost_len -= 1;
            self.queues.push_front(AM, index);
        } else {
            self.queues.push_front(A1IN, index);
        }
    }

    fn on_hit(&mut self, index: u32) {
        if self.queues.list_of(index) == Some(AM) {
            self.queues.push_front(AM, index);
        }
    }

    fn on_remove(&mut self, index: u32) {
        match self.queues.list_of(index) {
            Some(A1IN) => {
                self.queues.unlink(index);
                self.stamp += 1;
                self.ghost[index as usize] = self.stamp;
                self.ghost_fifo.push_back((index, self.stamp));
                self.ghost_len += 1;
                let kout = (self.resident() as usize / 2).max(1);
                while self.ghost_len > kout {
                    let Some((k, s)) = self.ghost_fifo.pop_front() else {
                        break;
                    };
                    if self.ghost[k as usize] == s {
                        self.ghost[k as usize] = 0;
                        self.ghost_len -= 1;
                    }
                }
            }
            Some(_) => self.queues.unlink(index),
            None => {}
        }
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        let kin = (self.resident() / 4).max(1);
        let (first, second) = if self.queues.len(A1IN) > kin {
            (A1IN, AM)
        } else {
            (AM, A1IN)
        };
        self.queues
            .oldest_first(first)
            .find(|&i| is_evictable(i))
            .or_else(|| self.queues.oldest_first(second).find(|&i| is_evictable(i)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn probation_ghost_and_protected_queue() {
        let mut p = TwoQ::new();
        p.init(&layout(1, 16));
        for i in 0..8 {
            p.on_insert(i);
        }
        // 8 resident, all on probation (> Kin = 2): the oldest probationer goes.
        assert_eq!(p.sizes(), (8, 0, 0));
        assert_eq!(p.victim(&|_| true), Some(0));
        assert_eq!(p.victim(&|i| i != 0), Some(1));
        p.on_remove(0);
        assert_eq!(p.sizes(), (7, 0, 1));
        // A hit on probation moves nothing.
        p.on_hit(1);
        assert_eq!(p.victim(&|_| true), Some(1));
        // 0 comes back while remembered: protected.
        p.on_insert(0);
        assert_eq!(p.sizes(), (7, 1, 0));
        for i in 1..6 {
            p.on_remove(i);
        }
        // A1in = {6, 7} (2 = Kin of 3 resident... Kin = max(1, 3/4) = 1 < 2): probation first.
        assert_eq!(p.victim(&|_| true), Some(6));
        p.on_remove(6);
        // A1in = {7}, Am = {0}: 1 = Kin, so the protected LRU gives the victim.
        assert_eq!(p.victim(&|_| true), Some(0));
        assert_eq!(p.victim(&|i| i != 0), Some(7));
        // Ghost queue bounded by max(1, resident/2).
        let (_, _, ghosts) = p.sizes();
        assert_eq!(ghosts, 1);
        p.on_hit(99);
        p.on_remove(99);
        assert_eq!(p.victim(&|_| false), None);
    }
}
