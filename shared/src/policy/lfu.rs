//! Least-frequently-used eviction, ties broken by recency: the victim is the resident key
//! with the fewest accesses, and among equals the least recently used.
//!
//! Frequencies persist across evictions (an expert's popularity is a property of the model
//! and the text, not of one residency), so an expert the router keeps coming back to wins
//! its slot back quickly. This is also what breaks LRU's cycle cliff: under a budget below
//! one token's cycle, LFU keeps the popular experts and lets the rare ones churn.
//!
//! The order `(count, last access)` is kept in O(1) per access: resident keys sit in one FIFO
//! list per access count (a key enters its count's list at the tail when an access raises it
//! to that count, so each list runs least recent first), and the lists are chained in rising
//! count. An access moves a key from list `c` to list `c + 1`, which is the next list or a new
//! one spliced in after it; only a key admitted again with a count no resident key has needs
//! the ordered index of the lists (a `BTreeMap`, O(log lists)). The coldest key is the head of
//! the first list. The same order a `BTreeSet` of `(count, last_tick, index)` gives (the test
//! below holds it to one), without its two tree operations per hit: the cache-only sweep of
//! `lfu` and `layer-lfu` is bound by this structure.

use super::EvictionPolicy;
use crate::layout::ExpertLayout;
use std::collections::BTreeMap;

const NIL: u32 = u32::MAX;

/// One access count's list of resident keys, least recent first, chained to the lists of the
/// next lower and higher counts.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    count: u64,
    head: u32,
    tail: u32,
    prev: u32,
    next: u32,
}

/// Access counts and the resident keys in `(count, last access)` order: the part LFU and
/// layer-LFU share.
#[derive(Clone, Debug, Default)]
pub(crate) struct FreqOrder {
    /// Per key: accesses so far (kept across evictions).
    count: Vec<u64>,
    /// Per key: its bucket while resident, else `NIL`.
    bucket_of: Vec<u32>,
    /// Per key: its neighbours in its bucket's list.
    prev: Vec<u32>,
    next: Vec<u32>,
    buckets: Vec<Bucket>,
    /// Buckets free for reuse.
    free: Vec<u32>,
    /// The bucket of the lowest count (`NIL` when nothing is resident).
    first: u32,
    /// Count -> its bucket, for every non-empty bucket.
    index: BTreeMap<u64, u32>,
    len: usize,
}

impl FreqOrder {
    pub(crate) fn init(&mut self, n_keys: usize) {
        self.count = vec![0; n_keys];
        self.bucket_of = vec![NIL; n_keys];
        self.prev = vec![NIL; n_keys];
        self.next = vec![NIL; n_keys];
        self.buckets.clear();
        self.free.clear();
        self.first = NIL;
        self.index.clear();
        self.len = 0;
    }

    /// A new empty bucket of `count` between buckets `prev` and `next` (either `NIL`).
    fn new_bucket(&mut self, count: u64, prev: u32, next: u32) -> u32 {
        let b = Bucket {
            count,
            head: NIL,
            tail: NIL,
            prev,
            next,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.buckets[id as usize] = b;
                id
            }
            None => {
                self.buckets.push(b);
                (self.buckets.len() - 1) as u32
            }
        };
        match prev {
            NIL => self.first = id,
            p => self.buckets[p as usize].next = id,
        }
        if next != NIL {
            self.buckets[next as usize].prev = id;
        }
        self.index.insert(count, id);
        id
    }

    /// Unlink `i` from its bucket, dropping the bucket when it empties; returns the bucket's
    /// neighbours (`prev`, `next`) as they are after that.
    fn unlink(&mut self, i: u32) -> (u32, u32) {
        let b = self.bucket_of[i as usize];
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        match p {
            NIL => self.buckets[b as usize].head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.buckets[b as usize].tail = p,
            n => self.prev[n as usize] = p,
        }
        self.bucket_of[i as usize] = NIL;
        let bucket = self.buckets[b as usize];
        if bucket.head != NIL {
            return (b, bucket.next);
        }
        match bucket.prev {
            NIL => self.first = bucket.next,
            bp => self.buckets[bp as usize].next = bucket.next,
        }
        if bucket.next != NIL {
            self.buckets[bucket.next as usize].prev = bucket.prev;
        }
        self.index.remove(&bucket.count);
        self.free.push(b);
        (bucket.prev, bucket.next)
    }

    /// Append `i` to the tail of bucket `b`.
    fn push_tail(&mut self, i: u32, b: u32) {
        let t = self.buckets[b as usize].tail;
        self.prev[i as usize] = t;
        self.next[i as usize] = NIL;
        match t {
            NIL => self.buckets[b as usize].head = i,
            t => self.next[t as usize] = i,
        }
        self.buckets[b as usize].tail = i;
        self.bucket_of[i as usize] = b;
    }

    /// Count an access to `i` and make it (or keep it) resident, the most recent of its new
    /// count. False for an out-of-range key.
    pub(crate) fn access(&mut self, i: u32) -> bool {
        let Some(&c) = self.count.get(i as usize) else {
            return false;
        };
        let c = c + 1;
        self.count[i as usize] = c;
        let b = if self.bucket_of[i as usize] != NIL {
            // From bucket c - 1 to bucket c: the next one, or a new one right after.
            let (prev, next) = self.unlink(i);
            if next != NIL && self.buckets[next as usize].count == c {
                next
            } else {
                self.new_bucket(c, prev, next)
            }
        } else {
            self.len += 1;
            match self.index.get(&c) {
                Some(&b) => b,
                None => {
                    // Between the highest count below c and the lowest above it.
                    let prev = self.index.range(..c).next_back().map_or(NIL, |(_, &b)| b);
                    let next = match prev {
                        NIL => self.first,
                        p => self.buckets[p as usize].next,
                    };
                    self.new_bucket(c, prev, next)
                }
            }
        };
        self.push_tail(i, b);
        true
    }

    /// An access to `i` when it is resident (a hit); false when it is not.
    pub(crate) fn hit(&mut self, i: u32) -> bool {
        if self.is_resident(i) {
            self.access(i)
        } else {
            false
        }
    }

    /// `i` left the cache (its count stays); false when it was not resident.
    pub(crate) fn remove(&mut self, i: u32) -> bool {
        if !self.is_resident(i) {
            return false;
        }
        self.unlink(i);
        self.len -= 1;
        true
    }

    pub(crate) fn is_resident(&self, i: u32) -> bool {
        self.bucket_of.get(i as usize).is_some_and(|&b| b != NIL)
    }

    /// Resident keys, coldest first: fewest accesses, then least recent.
    pub(crate) fn coldest_first(&self) -> impl Iterator<Item = u32> + '_ {
        let mut b = self.first;
        let mut k = NIL;
        std::iter::from_fn(move || loop {
            if k != NIL {
                let out = k;
                k = self.next[k as usize];
                return Some(out);
            }
            if b == NIL {
                return None;
            }
            k = self.buckets[b as usize].head;
            b = self.buckets[b as usize].next;
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[derive(Clone, Debug, Default)]
pub struct Lfu {
    freq: FreqOrder,
}

impl Lfu {
    /// An empty LFU; `init` sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Resident keys from the next victim onwards (for tests and reports).
    pub fn order(&self) -> Vec<u32> {
        self.freq.coldest_first().collect()
    }
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "lfu",
    help: "the fewest accesses, ties to the least recent; counts survive eviction",
    make: || Box::new(Lfu::new()),
};

impl EvictionPolicy for Lfu {
    fn name(&self) -> &'static str {
        "lfu"
    }

    fn init(&mut self, layout: &ExpertLayout) {
        self.freq.init(layout.n_keys() as usize);
    }

    fn on_insert(&mut self, index: u32) {
        self.freq.access(index);
    }

    fn on_hit(&mut self, index: u32) {
        self.freq.hit(index);
    }

    fn on_remove(&mut self, index: u32) {
        self.freq.remove(index);
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        self.freq.coldest_first().find(|&i| is_evictable(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;
    use std::collections::BTreeSet;

    #[test]
    fn the_count_lists_keep_the_order_of_an_ordered_set_of_count_and_recency() {
        // The reference: the set the lists replace, `(count, last tick, index)`.
        let n = 40u32;
        let mut f = FreqOrder::default();
        f.init(n as usize);
        let (mut count, mut last, mut tick) = (vec![0u64; 40], vec![0u64; 40], 0u64);
        let mut set: BTreeSet<(u64, u64, u32)> = BTreeSet::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = (x % u64::from(n)) as u32;
            let resident = set.contains(&(count[i as usize], last[i as usize], i));
            assert_eq!(f.is_resident(i), resident, "step {step}");
            match (x >> 32) % 3 {
                // Insert (or an access to a resident key, which on_insert allows).
                0 => {
                    set.remove(&(count[i as usize], last[i as usize], i));
                    tick += 1;
                    count[i as usize] += 1;
                    last[i as usize] = tick;
                    set.insert((count[i as usize], tick, i));
                    assert!(f.access(i));
                }
                1 => {
                    if resident {
                        set.remove(&(count[i as usize], last[i as usize], i));
                        tick += 1;
                        count[i as usize] += 1;
                        last[i as usize] = tick;
                        set.insert((count[i as usize], tick, i));
                    }
                    assert_eq!(f.hit(i), resident);
                }
                _ => {
                    set.remove(&(count[i as usize], last[i as usize], i));
                    assert_eq!(f.remove(i), resident);
                }
            }
            assert_eq!(f.len(), set.len(), "step {step}");
            if step % 7 == 0 {
                let want: Vec<u32> = set.iter().map(|&(_, _, k)| k).collect();
                let got: Vec<u32> = f.coldest_first().collect();
                assert_eq!(got, want, "step {step}");
            }
        }
        // Out of range: refused, nothing changed.
        assert!(!f.access(n) && !f.hit(n) && !f.remove(n) && !f.is_resident(n));
    }

    #[test]
    fn fewest_accesses_go_first_then_least_recent() {
        let mut p = Lfu::new();
        p.init(&layout(1, 8));
        for i in [3, 1, 4, 5] {
            p.on_insert(i);
        }
        p.on_hit(3);
        p.on_hit(3);
        p.on_hit(4);
        // counts: 1→1, 5→1 (1 older), 4→2, 3→3.
        assert_eq!(p.order(), vec![1, 5, 4, 3]);
        assert_eq!(p.victim(&|_| true), Some(1));
        assert_eq!(p.victim(&|i| i != 1), Some(5));
        assert_eq!(p.victim(&|_| false), None);
        // Frequency survives eviction: 3 comes back above the others.
        p.on_remove(3);
        assert_eq!(p.order(), vec![1, 5, 4]);
        p.on_insert(3);
        assert_eq!(p.order(), vec![1, 5, 4, 3]);
        // Unknown and non-resident indices are ignored.
        p.on_hit(99);
        p.on_remove(7);
        p.on_hit(7);
        assert_eq!(p.order().len(), 4);
    }
}
