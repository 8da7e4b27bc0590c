//! ARC (Megiddo & Modha, FAST 2003): Adaptive Replacement Cache. Two LRU lists of resident
//! experts — `T1`, seen once since it was admitted, and `T2`, hit again — and two ghost lists
//! of keys recently evicted from each, `B1` and `B2` (keys only, no bytes). A target `p` for
//! `T1`'s size moves with the ghosts: a key admitted again while `B1` remembers it means `T1`
//! was too small, so `p` grows; one `B2` remembers means `T2` was, so `p` shrinks. The cache
//! balances recency (`T1`) against frequency (`T2`) by itself, with no parameter to tune.
//!
//! The rule, from the paper (`c` = the cache's size in keys):
//! - hit (in `T1` or `T2`): the key becomes `T2`'s most recent;
//! - admission of a key `B1` remembers: `p ← min(c, p + max(1, |B2|/|B1|))`, the key leaves
//!   `B1` for `T2`'s most recent; one `B2` remembers: `p ← max(0, p − max(1, |B1|/|B2|))`, to
//!   `T2`'s most recent;
//! - admission of a key neither remembers: if `|T1| + |B1|` would exceed `c`, `B1` forgets its
//!   oldest; else if the four lists would exceed `2c`, `B2` forgets its oldest; the key becomes
//!   `T1`'s most recent;
//! - eviction (REPLACE): `T1`'s least recent when `|T1| ≥ 1` and `|T1| > p`, else `T2`'s least
//!   recent; the evicted key becomes the most recent of `B1` or `B2` respectively.
//!
//! How it fits the cache's interface (`EvictionPolicy`):
//! - The cache is byte-budgeted and the trait gives no capacity, so `c` = the most keys the
//!   cache has held at once (a high-water mark, counted on each admission). Every expert of a
//!   layout has one size in the layouts here, so once the cache has filled `c` is exactly how
//!   many it holds; the ghosts are bounded by it as in the paper.
//! - The cache evicts before it admits, and `victim` is not told which key is coming. So the
//!   adaptation of `p` to a ghost hit happens on admission (`on_insert`), after the evictions
//!   that made room for that key rather than before them, and REPLACE drops the paper's tie
//!   case for an incoming `B2` key (`x ∈ B2 and |T1| = p`, which takes from `T1`): at
//!   `|T1| = p` it always takes from `T2`. The paper's directory trimming for a new key
//!   (`B1`'s or `B2`'s oldest forgotten) also runs on admission, after the eviction: it
//!   forgets the same key the paper does, the ghost lists being otherwise unchanged.
//! - The paper's case of a full `T1` (`|T1| = c`, `B1` empty), which drops `T1`'s least
//!   recent without remembering it, needs no branch here: REPLACE takes it into `B1`, and the
//!   admission's trimming then forgets it again.
//! - A pinned (non-evictable) key is passed over: the victim is the least recent evictable key
//!   of the list REPLACE names, or of the other list when that one has none.
//! - `p` is an `f64` (`|B2|/|B1|` need not be whole); only additions, one division and
//!   comparisons touch it, which IEEE 754 rounds alike on every target.
//! - Any removal of a resident key (an eviction, or an entry discarded after a failed read)
//!   moves it to the ghost list of the list it was in.

use super::lists::Lists;
use super::EvictionPolicy;
use crate::layout::ExpertLayout;

const T1: usize = 0;
const T2: usize = 1;
const B1: usize = 2;
const B2: usize = 3;

/// The ARC policy.
#[derive(Clone, Debug, Default)]
pub struct AdaptiveReplacement {
    /// Lists T1, T2 (resident), B1, B2 (ghosts); head = most recent.
    lists: Lists,
    /// The target size of T1, in keys: 0 ≤ p ≤ c.
    p: f64,
    /// The most keys resident at once so far: the cache's size in keys, `c`.
    capacity_keys: u32,
    /// Keys the layout has (`init`); larger indices are ignored.
    n_keys: u32,
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "arc",
    help: "ARC: LRU lists of experts seen once and hit again, sized by a target that ghost lists of recent evictions adapt",
    make: || Box::new(AdaptiveReplacement::new()),
};

impl AdaptiveReplacement {
    /// An empty ARC; `init` sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys in T1, T2, B1 and B2 (each least recent first), for tests and reports.
    pub fn lists(&self) -> [Vec<u32>; 4] {
        [T1, T2, B1, B2].map(|l| self.lists.oldest_first(l).collect())
    }

    /// The target size of T1.
    pub fn target(&self) -> f64 {
        self.p
    }

    fn len(&self, l: usize) -> u32 {
        self.lists.len(l)
    }

    fn forget_oldest(&mut self, l: usize) {
        if let Some(k) = self.lists.oldest(l) {
            self.lists.unlink(k);
        }
    }
}

impl EvictionPolicy for AdaptiveReplacement {
    fn name(&self) -> &'static str {
        INFO.name
    }

    fn init(&mut self, layout: &ExpertLayout) {
        *self = AdaptiveReplacement::new();
        self.n_keys = layout.n_keys();
        self.lists = Lists::new(self.n_keys as usize, 4);
    }

    fn on_insert(&mut self, index: u32) {
        if index >= self.n_keys {
            return;
        }
        let resident = self.len(T1) + self.len(T2);
        let list = self.lists.list_of(index);
        if matches!(list, Some(T1 | T2)) {
            return;
        }
        self.capacity_keys = self.capacity_keys.max(resident + 1);
        let c = self.capacity_keys;
        let (b1, b2) = (f64::from(self.len(B1)), f64::from(self.len(B2)));
        match list {
            Some(B1) => {
                let delta = if b1 >= b2 { 1.0 } else { b2 / b1 };
                self.p = (self.p + delta).min(f64::from(c));
                self.lists.push_front(T2, index);
            }
            Some(B2) => {
                let delta = if b2 >= b1 { 1.0 } else { b1 / b2 };
                self.p = (self.p - delta).max(0.0);
                self.lists.push_front(T2, index);
            }
            _ => {
                while self.len(T1) + self.len(B1) >= c && self.len(B1) > 0 {
                    self.forget_oldest(B1);
                }
                while u64::from(self.len(T1) + self.len(T2) + self.len(B1) + self.len(B2))
                    >= 2 * u64::from(c)
                    && self.len(B1) + self.len(B2) > 0
                {
                    self.forget_oldest(if self.len(B2) > 0 { B2 } else { B1 });
                }
                self.lists.push_front(T1, index);
            }
        }
    }

    fn on_hit(&mut self, index: u32) {
        if matches!(self.lists.list_of(index), Some(T1 | T2)) {
            self.lists.push_front(T2, index);
        }
    }

    fn on_remove(&mut self, index: u32) {
        match self.lists.list_of(index) {
            Some(T1) => self.lists.push_front(B1, index),
            Some(T2) => self.lists.push_front(B2, index),
            _ => {}
        }
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        let t1 = self.len(T1);
        let (first, second) = if t1 >= 1 && f64::from(t1) > self.p {
            (T1, T2)
        } else {
            (T2, T1)
        };
        self.lists
            .oldest_first(first)
            .find(|&k| is_evictable(k))
            .or_else(|| self.lists.oldest_first(second).find(|&k| is_evictable(k)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn ghost_hits_move_the_target_and_replace_follows_it() {
        let mut p = AdaptiveReplacement::new();
        p.init(&layout(1, 32));
        // A cache of 4 keys: 0..4 admitted (T1), 0 and 1 hit again (T2).
        for i in 0..4 {
            p.on_insert(i);
        }
        p.on_hit(0);
        p.on_hit(1);
        assert_eq!(p.lists(), [vec![2, 3], vec![0, 1], vec![], vec![]]);
        // p = 0 < |T1| = 2: T1's least recent goes, into B1.
        assert_eq!(p.victim(&|_| true), Some(2));
        assert_eq!(p.victim(&|k| k != 2), Some(3), "pinned 2 is passed over");
        assert_eq!(p.victim(&|k| k > 3), None);
        p.on_remove(2);
        p.on_insert(4);
        assert_eq!(p.lists(), [vec![3, 4], vec![0, 1], vec![2], vec![]]);
        // 2 comes back while B1 remembers it: T1 was too small, p = 0 + 1 (|B1| ≥ |B2|).
        p.on_remove(3);
        p.on_insert(2);
        assert_eq!(p.target(), 1.0);
        assert_eq!(p.lists(), [vec![4], vec![0, 1, 2], vec![3], vec![]]);
        // |T1| = 1 = p: not above the target, so T2's least recent goes, into B2.
        assert_eq!(p.victim(&|_| true), Some(0));
        p.on_remove(0);
        p.on_insert(5);
        assert_eq!(p.lists(), [vec![4, 5], vec![1, 2], vec![3], vec![0]]);
        // |T1| = 2 > p = 1: T1's 4 goes; 0 returns from B2: p = max(0, 1 − |B1|/|B2|) = 0.
        assert_eq!(p.victim(&|_| true), Some(4));
        p.on_remove(4);
        p.on_insert(0);
        assert_eq!(p.target(), 0.0);
        assert_eq!(p.lists(), [vec![5], vec![1, 2, 0], vec![3, 4], vec![]]);
        // A new key with |T1| + |B1| = 3 < c = 4: nothing forgotten...
        assert_eq!(p.victim(&|_| true), Some(5));
        p.on_remove(5);
        p.on_insert(6);
        assert_eq!(p.lists(), [vec![6], vec![1, 2, 0], vec![3, 4, 5], vec![]]);
        // ...but at |T1| + |B1| = 4 = c, B1 forgets its oldest (3) to make room for the new key.
        assert_eq!(p.victim(&|_| true), Some(6));
        p.on_remove(6);
        p.on_insert(7);
        assert_eq!(p.lists(), [vec![7], vec![1, 2, 0], vec![4, 5, 6], vec![]]);
        p.on_hit(99);
        p.on_remove(99);
        p.on_insert(99);
        assert_eq!(p.victim(&|_| false), None);
    }

    #[test]
    fn the_target_grows_by_the_ghost_ratio_and_the_directory_stays_within_2c() {
        let mut p = AdaptiveReplacement::new();
        p.init(&layout(1, 32));
        // c = 2. Fill T2 with 0, 1; then churn new keys through T1 and T2 into B2.
        for i in 0..2 {
            p.on_insert(i);
            p.on_hit(i);
        }
        for (out, new) in [(0, 2), (1, 3)] {
            assert_eq!(p.victim(&|k| k == out), Some(out));
            p.on_remove(out);
            p.on_insert(new);
        }
        assert_eq!(p.lists(), [vec![2, 3], vec![], vec![], vec![0, 1]]);
        // T1 = 2 > p = 0: 2 goes to B1. Then 2 returns: |B1| = 1 < |B2| = 2, p = 0 + 2/1 = 2.
        assert_eq!(p.victim(&|_| true), Some(2));
        p.on_remove(2);
        p.on_insert(2);
        assert_eq!(p.target(), 2.0, "min(c = 2, 0 + |B2|/|B1|)");
        assert_eq!(p.lists(), [vec![3], vec![2], vec![], vec![0, 1]]);
        // The directory holds 2c = 4 keys: a new key makes B2 forget its oldest.
        assert_eq!(p.victim(&|_| true), Some(2), "|T1| = 1 is not above p = 2");
        p.on_remove(2);
        p.on_insert(9);
        assert_eq!(p.lists(), [vec![3, 9], vec![], vec![], vec![1, 2]]);
    }
}
