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
//! Intrusive lists over the dense key indices (O(1) per event); the ghost queue is a FIFO of
//! (key, stamp) with lazy deletion.

use super::EvictionPolicy;
use crate::layout::ExpertLayout;
use std::collections::VecDeque;

const NIL: u32 = u32::MAX;
const A1IN: usize = 0;
const AM: usize = 1;

/// The 2Q policy.
#[derive(Clone, Debug, Default)]
pub struct TwoQ {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// 0 = not resident, 1 = in A1in, 2 = in Am.
    queue: Vec<u8>,
    head: [u32; 2],
    tail: [u32; 2],
    len: [u32; 2],
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
        TwoQ {
            head: [NIL; 2],
            tail: [NIL; 2],
            ..Default::default()
        }
    }

    /// Entries in (A1in, Am) and remembered in A1out.
    pub fn sizes(&self) -> (u32, u32, usize) {
        (self.len[A1IN], self.len[AM], self.ghost_len)
    }

    fn resident(&self) -> u32 {
        self.len[A1IN] + self.len[AM]
    }

    fn unlink(&mut self, i: u32) {
        let q = usize::from(self.queue[i as usize] - 1);
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            self.head[q] = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail[q] = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.queue[i as usize] = 0;
        self.len[q] -= 1;
    }

    fn push_front(&mut self, q: usize, i: u32) {
        self.prev[i as usize] = NIL;
        self.next[i as usize] = self.head[q];
        if self.head[q] == NIL {
            self.tail[q] = i;
        } else {
            self.prev[self.head[q] as usize] = i;
        }
        self.head[q] = i;
        self.queue[i as usize] = q as u8 + 1;
        self.len[q] += 1;
    }

    fn oldest_evictable(&self, q: usize, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        let mut i = self.tail[q];
        while i != NIL {
            if is_evictable(i) {
                return Some(i);
            }
            i = self.prev[i as usize];
        }
        None
    }
}

impl EvictionPolicy for TwoQ {
    fn name(&self) -> &'static str {
        INFO.name
    }

    fn init(&mut self, layout: &ExpertLayout) {
        let n = layout.n_keys() as usize;
        *self = TwoQ::new();
        self.prev = vec![NIL; n];
        self.next = vec![NIL; n];
        self.queue = vec![0; n];
        self.ghost = vec![0; n];
    }

    fn on_insert(&mut self, index: u32) {
        let i = index as usize;
        if i >= self.queue.len() {
            return;
        }
        if self.queue[i] != 0 {
            self.unlink(index);
        }
        if self.ghost[i] != 0 {
            self.ghost[i] = 0;
            self.ghost_len -= 1;
            self.push_front(AM, index);
        } else {
            self.push_front(A1IN, index);
        }
    }

    fn on_hit(&mut self, index: u32) {
        if self.queue.get(index as usize) == Some(&2) {
            self.unlink(index);
            self.push_front(AM, index);
        }
    }

    fn on_remove(&mut self, index: u32) {
        let i = index as usize;
        match self.queue.get(i) {
            Some(1) => {
                self.unlink(index);
                self.stamp += 1;
                self.ghost[i] = self.stamp;
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
            Some(2) => self.unlink(index),
            _ => {}
        }
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        let kin = (self.resident() / 4).max(1);
        let (first, second) = if self.len[A1IN] > kin {
            (A1IN, AM)
        } else {
            (AM, A1IN)
        };
        self.oldest_evictable(first, is_evictable)
            .or_else(|| self.oldest_evictable(second, is_evictable))
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
