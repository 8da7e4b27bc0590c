//! S3-FIFO (Yang et al., SOSP 2023): three FIFO queues — a small one `S` (10 % of the cache), a
//! main one `M` (the other 90 %) and a ghost one `G` (keys only, as many as `M` holds) — and a
//! 2-bit access count per resident entry.
//!
//! The rule, from the paper: a newly admitted expert enters `S`, or `M` if `G` remembers it
//! (then `G` forgets it); it starts with count 0, and each hit adds 1 up to 3. To evict: while
//! `S` holds at least 10 % of the cache, look at `S`'s oldest entry — one hit more than once
//! (count > 1) moves to `M`'s head with its count cleared (and, if that puts `M` over its 90 %,
//! `M` evicts instead), one hit at most once is the victim and its key enters `G`. Otherwise
//! (or when `S` has nothing left to look at) `M` evicts: its oldest entry with a count above 0
//! is reinserted at the head with the count lowered by one, the first one at 0 is the victim.
//! `G` drops its oldest keys beyond `M`'s share. Most experts a routing touches once leave from
//! `S` quickly (quick demotion); the ones hit again earn their place in `M` only when they
//! reach `S`'s tail (lazy promotion).
//!
//! How it fits the cache's interface (`EvictionPolicy`):
//! - The cache is byte-budgeted and the trait gives no capacity, so the cache's size in keys is
//!   `c` = the most keys it has held at once (a high-water mark, counted on each admission).
//!   Every expert of a layout has one size in the layouts here, so once the cache has filled
//!   `c` is exactly how many it holds. The shares are then `10·|S| ≥ c` (evict from `S`),
//!   `10·|M| > 9·c` (`M` over its share) and `10·|G| ≤ 9·c`.
//! - One `victim` call names one key: the first the paper's eviction would take out. The
//!   promotions and reinsertions on the way are part of that one eviction; the paper's loop
//!   would go on to evict from `S` after a promotion overflowed `M`, here the cache asks again
//!   only if it still needs room.
//! - A pinned (non-evictable) entry is passed over where it stands: not promoted, not
//!   reinserted, its count unchanged.
//! - `victim` is a query: it works out the victim and the moves on the way (promotions,
//!   reinsertions) without making them, and `on_remove` of that very key makes them, so they
//!   take effect exactly when the cache evicts what it named (it removes the victim straight
//!   after asking). For `M` the paper's loop is closed-form: with the evictable entries of
//!   `M` oldest first (then any entries promoted on the way, count 0), the loop goes round
//!   them `f` whole times, `f` the lowest count among them, lowering each, then stops on the
//!   first entry whose count was `f`, having reinserted those before it once more.
//! - Any other removal (an entry discarded after a failed read) just takes the entry out; its
//!   key enters `G` if it was in `S`, as an eviction from `S` would.

use super::lists::Lists;
use super::EvictionPolicy;
use crate::layout::ExpertLayout;
use std::cell::RefCell;

const SMALL: usize = 0;
const MAIN: usize = 1;
const GHOST: usize = 2;
/// The 2-bit access count's ceiling.
const MAX_COUNT: u8 = 3;

/// The S3-FIFO policy.
#[derive(Clone, Debug, Default)]
pub struct S3Fifo {
    /// Lists 0 = S, 1 = M (resident), 2 = G (keys only); head = newest.
    queues: Lists,
    /// Per resident key: hits, capped at 3 (lowered by M's reinsertions).
    count: Vec<u8>,
    /// The most keys resident at once so far: the cache's size in keys.
    capacity_keys: u32,
    /// What the last `victim` decided, for `on_remove` of that key to apply.
    pending: RefCell<Eviction>,
}

/// One eviction worked out by `victim`: the moves before it, in order, and the victim.
#[derive(Clone, Debug, Default)]
struct Eviction {
    victim: Option<u32>,
    moves: Vec<Move>,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Move {
    /// From S's tail to M's head, count cleared.
    Promote(u32),
    /// From M's tail to M's head, count lowered by one.
    Reinsert(u32),
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "s3fifo",
    help: "S3-FIFO: new experts in a small FIFO (10 %), those hit twice there promoted to a main FIFO with reinsertion, a ghost FIFO sends returning ones straight to main",
    make: || Box::new(S3Fifo::new()),
};

impl S3Fifo {
    /// An empty S3-FIFO; `init` sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys in S, M and G (each oldest first), for tests and reports.
    pub fn queues(&self) -> [Vec<u32>; 3] {
        [SMALL, MAIN, GHOST].map(|q| self.queues.oldest_first(q).collect())
    }

    /// `key`'s access count (0 when not resident).
    pub fn count(&self, key: u32) -> u8 {
        self.count.get(key as usize).copied().unwrap_or(0)
    }

    fn is_resident(&self, key: u32) -> bool {
        matches!(self.queues.list_of(key), Some(SMALL | MAIN))
    }

    /// M evicts, after `promoted` (count 0) joined its head: pushes the reinsertions onto
    /// `plan.moves` and returns the victim.
    fn evict_main(
        &self,
        is_evictable: &dyn Fn(u32) -> bool,
        promoted: &[u32],
        plan: &mut Eviction,
    ) -> Option<u32> {
        let mut lap: Vec<u32> = Vec::new();
        for k in self.queues.oldest_first(MAIN).filter(|&k| is_evictable(k)) {
            if self.count[k as usize] == 0 {
                plan.moves.extend(lap.iter().map(|&e| Move::Reinsert(e)));
                return Some(k);
            }
            lap.push(k);
        }
        if let Some(&first) = promoted.first() {
            plan.moves.extend(lap.iter().map(|&e| Move::Reinsert(e)));
            return Some(first);
        }
        let lowest = lap.iter().map(|&k| self.count[k as usize]).min()?;
        for _ in 0..lowest {
            plan.moves.extend(lap.iter().map(|&e| Move::Reinsert(e)));
        }
        let stop = lap
            .iter()
            .position(|&k| self.count[k as usize] == lowest)
            .unwrap_or(0);
        plan.moves
            .extend(lap[..stop].iter().map(|&e| Move::Reinsert(e)));
        Some(lap[stop])
    }
}

impl EvictionPolicy for S3Fifo {
    fn name(&self) -> &'static str {
        INFO.name
    }

    fn init(&mut self, layout: &ExpertLayout) {
        let n = layout.n_keys() as usize;
        *self = S3Fifo::new();
        self.queues = Lists::new(n, 3);
        self.count = vec![0; n];
    }

    fn on_insert(&mut self, index: u32) {
        let i = index as usize;
        if i >= self.count.len() || self.is_resident(index) {
            return;
        }
        self.pending.get_mut().victim = None;
        let resident = self.queues.len(SMALL) + self.queues.len(MAIN);
        self.capacity_keys = self.capacity_keys.max(resident + 1);
        let queue = if self.queues.list_of(index) == Some(GHOST) {
            MAIN
        } else {
            SMALL
        };
        self.queues.push_front(queue, index);
        self.count[i] = 0;
    }

    fn on_hit(&mut self, index: u32) {
        if self.is_resident(index) {
            self.pending.get_mut().victim = None;
            let c = &mut self.count[index as usize];
            *c = (*c + 1).min(MAX_COUNT);
        }
    }

    fn on_remove(&mut self, index: u32) {
        if !self.is_resident(index) {
            return;
        }
        let plan = self.pending.get_mut();
        if plan.victim.take() == Some(index) {
            for m in plan.moves.drain(..) {
                match m {
                    Move::Promote(k) => {
                        self.queues.push_front(MAIN, k);
                        self.count[k as usize] = 0;
                    }
                    Move::Reinsert(k) => {
                        self.queues.push_front(MAIN, k);
                        self.count[k as usize] -= 1;
                    }
                }
            }
        }
        plan.moves.clear();
        self.count[index as usize] = 0;
        if self.queues.list_of(index) == Some(SMALL) {
            self.queues.push_front(GHOST, index);
            let c = u64::from(self.capacity_keys);
            while 10 * u64::from(self.queues.len(GHOST)) > 9 * c {
                let Some(oldest) = self.queues.oldest(GHOST) else {
                    break;
                };
                self.queues.unlink(oldest);
            }
        } else {
            self.queues.unlink(index);
        }
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        let mut plan = self.pending.borrow_mut();
        plan.victim = None;
        plan.moves.clear();
        let c = u64::from(self.capacity_keys);
        let main_len = u64::from(self.queues.len(MAIN));
        let mut promoted: Vec<u32> = Vec::new();
        if 10 * u64::from(self.queues.len(SMALL)) >= c {
            for t in self.queues.oldest_first(SMALL).filter(|&k| is_evictable(k)) {
                if self.count[t as usize] <= 1 {
                    plan.victim = Some(t);
                    return Some(t);
                }
                plan.moves.push(Move::Promote(t));
                promoted.push(t);
                if 10 * (main_len + promoted.len() as u64) > 9 * c {
                    break;
                }
            }
        }
        let v = self.evict_main(is_evictable, &promoted, &mut plan);
        plan.victim = v;
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn small_queue_filters_main_reinserts_ghost_readmits() {
        let mut p = S3Fifo::new();
        p.init(&layout(1, 32));
        for i in 0..10 {
            p.on_insert(i);
        }
        // c = 10: S (10 entries) is over its 1-entry share, so S evicts its oldest, 0.
        assert_eq!(p.victim(&|_| true), Some(0));
        p.on_hit(0);
        assert_eq!(p.victim(&|_| true), Some(0), "one hit is not enough");
        p.on_hit(0);
        p.on_hit(1);
        p.on_hit(1);
        p.on_hit(1);
        p.on_hit(1);
        assert_eq!(p.count(1), 3, "the count saturates");
        // 0 and 1 were hit twice: both move to M (M then holds 2 of its 9), 2 goes.
        assert_eq!(p.victim(&|_| true), Some(2));
        assert_eq!(p.queues()[MAIN], Vec::<u32>::new(), "asking moved nothing");
        p.on_remove(2);
        assert_eq!(p.queues(), [vec![3, 4, 5, 6, 7, 8, 9], vec![0, 1], vec![2]]);
        assert_eq!(
            (p.count(0), p.count(1)),
            (0, 0),
            "counts cleared on promotion"
        );
        // 2 returns while G remembers it: straight to M.
        p.on_insert(2);
        assert_eq!(p.queues()[MAIN], vec![0, 1, 2]);
        assert_eq!(p.queues()[GHOST], Vec::<u32>::new());
        // A pinned entry in S is passed over: 4 goes instead of 3.
        assert_eq!(p.victim(&|k| k != 3), Some(4));
        p.on_remove(4);
        // Shrink S below its share (10·|S| < c = 10 needs S empty): M evicts.
        for k in [3, 5, 6, 7, 8, 9] {
            p.on_remove(k);
        }
        assert_eq!(p.queues()[SMALL], Vec::<u32>::new());
        // M = 0, 1, 2 (oldest first), all counts 0: the oldest evictable goes.
        p.on_hit(0);
        p.on_hit(0);
        p.on_hit(1);
        p.on_hit(2);
        p.on_hit(2);
        // Counts 0:2, 1:1, 2:2. One lap reinserts all three, lowering them to 1, 0, 1; the
        // second reinserts 0 again (1 → 0) and stops at 1, the first whose count was lowest.
        assert_eq!(p.victim(&|_| true), Some(1));
        p.on_remove(1);
        assert_eq!(p.queues()[MAIN], vec![2, 0]);
        assert_eq!((p.count(0), p.count(2)), (0, 1));
        // Pinned 0 stays put with its count; 2 is reinserted once (count 0), then evicted.
        p.on_hit(0);
        assert_eq!(p.victim(&|k| k != 0), Some(2));
        p.on_remove(2);
        assert_eq!((p.queues()[MAIN].clone(), p.count(0)), (vec![0], 1));
        assert_eq!(p.victim(&|_| false), None);
        p.on_hit(99);
        p.on_remove(99);
        p.on_insert(99);
    }

    #[test]
    fn a_promotion_that_fills_main_makes_main_evict() {
        let mut p = S3Fifo::new();
        p.init(&layout(1, 32));
        for i in 0..10 {
            p.on_insert(i);
        }
        // Fill M to its 9-entry share: promote 0..=8 through S.
        for i in 0..9 {
            p.on_hit(i);
            p.on_hit(i);
        }
        // S = 0..=9; 0..=8 were hit twice. Promoting them all fills M to 9 = its share; 9 goes.
        assert_eq!(p.victim(&|_| true), Some(9));
        p.on_remove(9);
        assert_eq!(p.queues()[MAIN], (0..9).collect::<Vec<_>>());
        p.on_insert(10);
        p.on_hit(10);
        p.on_hit(10);
        p.on_hit(3);
        // S = {10} (10·1 ≥ 10): 10 is promoted, M (10 > 9) evicts: 0 is the oldest with count
        // 0 (3 has count 1, but 0 comes first).
        assert_eq!(p.victim(&|_| true), Some(0));
        p.on_remove(0);
        assert_eq!(p.queues()[SMALL], Vec::<u32>::new());
        assert_eq!(
            p.queues()[MAIN],
            vec![1, 2, 3, 4, 5, 6, 7, 8, 10],
            "no reinsertion before the victim"
        );
        assert_eq!(
            p.queues()[GHOST],
            vec![9],
            "M's victims leave no ghost; S's 9 does"
        );
    }
}
