//! Layer-LRU: the expert budget partitioned evenly between MoE layers, LRU inside each
//! partition — the origin's per-layer ("layer") comparison against one global LRU, with
//! recency instead of `layer-lfu`'s frequency inside the partitions.
//!
//! As for `layer-lfu`, the policy is not told which key is being admitted, so the partition is
//! enforced at eviction time: the victim comes from the layer holding the most resident
//! entries (ties to the lower layer), and within it is that layer's least recently used
//! evictable entry; when that layer has none evictable, the next fullest layer's. Under steady
//! pressure every layer converges to an equal share of the cache.
//!
//! One intrusive list per layer (`lists.rs`): O(1) insert, hit and remove, O(layers log
//! layers) to order the layers by size.

use super::lists::Lists;
use super::EvictionPolicy;
use crate::layout::ExpertLayout;

/// Per-layer LRU partitions: one list per MoE layer (head = most recently used).
#[derive(Clone, Debug, Default)]
pub struct LayerLru {
    lists: Lists,
    /// Dense key index → MoE layer.
    key_layer: Vec<u16>,
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "layer-lru",
    help: "per-layer partitions: the fullest layer's least recently used",
    make: || Box::new(LayerLru::new()),
};

impl LayerLru {
    /// An empty layer-LRU; `init` sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Resident entries per layer.
    pub fn resident_per_layer(&self) -> Vec<u32> {
        (0..self.lists.n_lists())
            .map(|l| self.lists.len(l))
            .collect()
    }

    /// Layer `l`'s keys from most to least recently used.
    pub fn layer_order(&self, l: usize) -> Vec<u32> {
        self.lists.newest_first(l).collect()
    }
}

impl EvictionPolicy for LayerLru {
    fn name(&self) -> &'static str {
        INFO.name
    }

    fn init(&mut self, layout: &ExpertLayout) {
        let n = layout.n_keys() as usize;
        self.key_layer = Vec::with_capacity(n);
        for (l, layer) in layout.layers().iter().enumerate() {
            self.key_layer
                .extend(std::iter::repeat_n(l as u16, layer.n_expert as usize));
        }
        self.lists = Lists::new(n, layout.layers().len());
    }

    fn on_insert(&mut self, index: u32) {
        if let Some(&l) = self.key_layer.get(index as usize) {
            self.lists.push_front(usize::from(l), index);
        }
    }

    fn on_hit(&mut self, index: u32) {
        if let Some(l) = self.lists.list_of(index) {
            self.lists.push_front(l, index);
        }
    }

    fn on_remove(&mut self, index: u32) {
        self.lists.unlink(index);
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        // The fullest layer (the lowest among equals) nearly always has an unpinned entry:
        // tried before ranking every layer (no allocation, no sort on the common path).
        let fullest = (0..self.lists.n_lists())
            .filter(|&l| self.lists.len(l) > 0)
            .min_by(|&a, &b| self.lists.len(b).cmp(&self.lists.len(a)).then(a.cmp(&b)));
        if let Some(i) = fullest.and_then(|l| self.lists.oldest_first(l).find(|&i| is_evictable(i)))
        {
            return Some(i);
        }
        // Layers by resident count, largest first; ties to the lower layer.
        let mut by_size: Vec<usize> = (0..self.lists.n_lists())
            .filter(|&l| self.lists.len(l) > 0)
            .collect();
        by_size.sort_by(|&a, &b| self.lists.len(b).cmp(&self.lists.len(a)).then(a.cmp(&b)));
        by_size
            .into_iter()
            .find_map(|l| self.lists.oldest_first(l).find(|&i| is_evictable(i)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn victim_is_the_fullest_layers_least_recent() {
        let mut p = LayerLru::new();
        p.init(&layout(2, 4)); // keys 0..4 layer 0, 4..8 layer 1
        for i in [0, 1, 2, 4, 5] {
            p.on_insert(i);
        }
        p.on_hit(0);
        assert_eq!(p.resident_per_layer(), vec![3, 2]);
        assert_eq!(p.layer_order(0), vec![0, 2, 1]);
        // Layer 0 is fullest; its least recent is 1 (0 was hit after it).
        assert_eq!(p.victim(&|_| true), Some(1));
        assert_eq!(p.victim(&|i| i != 1), Some(2));
        // Layer 0 wholly pinned: the next fullest layer's least recent.
        assert_eq!(p.victim(&|i| i >= 4), Some(4));
        p.on_remove(1);
        p.on_remove(2);
        // Now layer 1 (2 entries) is fuller than layer 0 (1).
        assert_eq!(p.victim(&|_| true), Some(4));
        p.on_insert(2);
        // 2 each: ties to the lower layer.
        assert_eq!(p.victim(&|_| true), Some(0));
        p.on_hit(99);
        p.on_insert(99);
        assert_eq!(p.victim(&|_| false), None);
    }
}
