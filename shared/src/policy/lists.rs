//! Intrusive doubly linked lists over the layout's dense key indices, several lists sharing one
//! pair of link arrays (each key is in at most one list): O(1) push, unlink and move with no
//! allocation after `init`. `layer-lru` keeps one list per MoE layer, `2q` its two queues, `arc`
//! its two resident and two ghost lists, `s3fifo` its three queues, `sieve` its one queue.

const NIL: u32 = u32::MAX;

/// `n_lists` lists over `n_keys` keys. Each list runs from its head (most recently pushed) to
/// its tail (least recently pushed).
#[derive(Clone, Debug, Default)]
pub struct Lists {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// 0 = in no list, else list index + 1.
    member: Vec<u16>,
    head: Vec<u32>,
    tail: Vec<u32>,
    len: Vec<u32>,
}

impl Lists {
    /// Empty lists sized for `n_keys` keys.
    pub fn new(n_keys: usize, n_lists: usize) -> Lists {
        Lists {
            prev: vec![NIL; n_keys],
            next: vec![NIL; n_keys],
            member: vec![0; n_keys],
            head: vec![NIL; n_lists],
            tail: vec![NIL; n_lists],
            len: vec![0; n_lists],
        }
    }

    /// The list `key` is in, or `None` (also for a key out of range).
    pub fn list_of(&self, key: u32) -> Option<usize> {
        match self.member.get(key as usize) {
            Some(&m) if m > 0 => Some(usize::from(m - 1)),
            _ => None,
        }
    }

    /// Keys in list `l`.
    pub fn len(&self, l: usize) -> u32 {
        self.len.get(l).copied().unwrap_or(0)
    }

    /// Number of lists.
    pub fn n_lists(&self) -> usize {
        self.len.len()
    }

    /// Remove `key` from its list (nothing if it is in none).
    pub fn unlink(&mut self, key: u32) {
        let Some(l) = self.list_of(key) else {
            return;
        };
        let i = key as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head[l] = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail[l] = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.member[i] = 0;
        self.len[l] -= 1;
    }

    /// Put `key` at the head of list `l` (taking it out of any list first). Keys out of range
    /// are ignored.
    pub fn push_front(&mut self, l: usize, key: u32) {
        let i = key as usize;
        if i >= self.member.len() || l >= self.head.len() {
            return;
        }
        self.unlink(key);
        self.prev[i] = NIL;
        self.next[i] = self.head[l];
        if self.head[l] == NIL {
            self.tail[l] = key;
        } else {
            self.prev[self.head[l] as usize] = key;
        }
        self.head[l] = key;
        self.member[i] = l as u16 + 1;
        self.len[l] += 1;
    }

    /// The oldest key of list `l` (its tail), or `None` when it is empty.
    pub fn oldest(&self, l: usize) -> Option<u32> {
        self.tail.get(l).copied().filter(|&k| k != NIL)
    }

    /// The key pushed just after `key` into its list (one step towards the head), or `None`
    /// when `key` is the newest or in no list. SIEVE's hand walks this way.
    pub fn newer(&self, key: u32) -> Option<u32> {
        self.list_of(key)?;
        Some(self.prev[key as usize]).filter(|&k| k != NIL)
    }

    /// List `l`'s keys from the tail (oldest) towards the head.
    pub fn oldest_first(&self, l: usize) -> impl Iterator<Item = u32> + '_ {
        let mut i = self.tail.get(l).copied().unwrap_or(NIL);
        std::iter::from_fn(move || {
            (i != NIL).then(|| {
                let k = i;
                i = self.prev[k as usize];
                k
            })
        })
    }

    /// List `l`'s keys from the head (newest) towards the tail.
    pub fn newest_first(&self, l: usize) -> impl Iterator<Item = u32> + '_ {
        let mut i = self.head.get(l).copied().unwrap_or(NIL);
        std::iter::from_fn(move || {
            (i != NIL).then(|| {
                let k = i;
                i = self.next[k as usize];
                k
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_move_between_lists() {
        let mut l = Lists::new(8, 2);
        for k in [1, 2, 3] {
            l.push_front(0, k);
        }
        l.push_front(1, 5);
        l.push_front(1, 2); // moves 2 from list 0
        assert_eq!(l.newest_first(0).collect::<Vec<_>>(), vec![3, 1]);
        assert_eq!(l.oldest_first(1).collect::<Vec<_>>(), vec![5, 2]);
        assert_eq!(
            (l.len(0), l.len(1), l.list_of(2), l.list_of(7)),
            (2, 2, Some(1), None)
        );
        assert_eq!(
            (l.oldest(0), l.oldest(1), l.oldest(7)),
            (Some(1), Some(5), None)
        );
        assert_eq!(
            (l.newer(1), l.newer(3), l.newer(5), l.newer(7)),
            (Some(3), None, Some(2), None)
        );
        l.unlink(5);
        l.unlink(5);
        l.push_front(0, 99);
        assert_eq!(l.oldest_first(1).collect::<Vec<_>>(), vec![2]);
        assert_eq!(l.len(1), 1);
    }
}
