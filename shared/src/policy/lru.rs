//! Global least-recently-used order over every (layer, expert): the default policy, and the
//! one the original engine measured (including its cycle cliff: with a fixed layer order, a
//! budget below one token's cycle evicts exactly what the next access needs).
//!
//! An intrusive doubly linked list over the layout's dense key indices: O(1) insert, hit and
//! remove with no allocation after `init`, which the simulator's replay rate depends on.

use super::EvictionPolicy;
use crate::layout::ExpertLayout;

const NIL: u32 = u32::MAX;

/// Global LRU. The head is the most recently used key, the tail the least.
#[derive(Clone, Debug, Default)]
pub struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: u32,
}

impl Lru {
    /// An empty LRU; `init` sizes it.
    pub fn new() -> Self {
        Lru {
            head: NIL,
            tail: NIL,
            ..Default::default()
        }
    }

    /// Resident keys tracked.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// True when no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keys from most to least recently used (for tests and reports).
    pub fn order(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len as usize);
        let mut i = self.head;
        while i != NIL {
            out.push(i);
            i = self.next[i as usize];
        }
        out
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.linked[i as usize] = false;
        self.len -= 1;
    }

    fn push_front(&mut self, i: u32) {
        self.prev[i as usize] = NIL;
        self.next[i as usize] = self.head;
        if self.head == NIL {
            self.tail = i;
        } else {
            self.prev[self.head as usize] = i;
        }
        self.head = i;
        self.linked[i as usize] = true;
        self.len += 1;
    }

    fn is_linked(&self, i: u32) -> bool {
        self.linked.get(i as usize).copied().unwrap_or(false)
    }
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "lru",
    help: "the globally least recently used (layer, expert)",
    make: || Box::new(Lru::new()),
};

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn init(&mut self, layout: &ExpertLayout) {
        let n = layout.n_keys() as usize;
        self.prev = vec![NIL; n];
        self.next = vec![NIL; n];
        self.linked = vec![false; n];
        self.head = NIL;
        self.tail = NIL;
        self.len = 0;
    }

    #[inline]
    fn on_insert(&mut self, index: u32) {
        if (index as usize) >= self.linked.len() {
            return;
        }
        if self.is_linked(index) {
            self.unlink(index);
        }
        self.push_front(index);
    }

    #[inline]
    fn on_hit(&mut self, index: u32) {
        if self.is_linked(index) && self.head != index {
            self.unlink(index);
            self.push_front(index);
        }
    }

    #[inline]
    fn on_remove(&mut self, index: u32) {
        if self.is_linked(index) {
            self.unlink(index);
        }
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        let mut i = self.tail;
        while i != NIL {
            if is_evictable(i) {
                return Some(i);
            }
            i = self.prev[i as usize];
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{MoeLayerLayout, ProjExtent};

    fn layout(n: u32) -> ExpertLayout {
        ExpertLayout::new(
            1,
            vec![MoeLayerLayout {
                model_layer: 0,
                n_expert: n,
                projections: vec![ProjExtent {
                    shard: 0,
                    base_offset: 0,
                    stride_bytes: 1,
                }],
                dense_bytes: 0,
            }],
            1,
        )
        .unwrap()
    }

    #[test]
    fn least_recent_evictable_key_is_the_victim() {
        let mut l = Lru::new();
        l.init(&layout(8));
        for i in [3, 1, 4, 5] {
            l.on_insert(i);
        }
        assert_eq!(l.order(), vec![5, 4, 1, 3]);
        l.on_hit(3);
        assert_eq!(l.order(), vec![3, 5, 4, 1]);
        assert_eq!(l.victim(&|_| true), Some(1));
        assert_eq!(l.victim(&|i| i != 1 && i != 4), Some(5));
        assert_eq!(l.victim(&|_| false), None);
        l.on_remove(5);
        l.on_remove(5);
        assert_eq!(l.order(), vec![3, 4, 1]);
        assert_eq!(l.len(), 3);
        l.on_remove(3);
        l.on_remove(4);
        l.on_remove(1);
        assert!(l.is_empty());
        assert_eq!(l.victim(&|_| true), None);
        // Out-of-range and unknown keys are ignored rather than corrupting the list.
        l.on_hit(2);
        l.on_insert(99);
        assert!(l.is_empty());
    }
}
