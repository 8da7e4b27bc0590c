//! Layer-LFU: the expert budget partitioned evenly between MoE layers, LFU inside each
//! partition — the origin's `layer-lfu` (features.md §10), kept as a measured negative result:
//! it simulated a couple of points of hit rate better than LRU and ran ~30% slower on device,
//! because hard per-layer caps churned pages and pushed the dense set into zram.
//!
//! The policy interface names a victim without being told which key is being admitted, so
//! the partition is enforced at eviction time: the victim comes from the layer holding the
//! most resident entries (the one furthest over an equal share; ties to the lower layer), and
//! within it is that layer's least frequently, then least recently, used evictable entry.
//! Under steady pressure every layer converges to an equal share of the cache.

use super::lfu::FreqOrder;
use super::EvictionPolicy;
use crate::layout::ExpertLayout;

/// Per-layer LFU partitions.
#[derive(Clone, Debug, Default)]
pub struct LayerLfu {
    /// One frequency order per MoE layer, over that layer's expert ids.
    layers: Vec<FreqOrder>,
    /// Dense key index → (layer, expert).
    key_layer: Vec<u16>,
    layer_base: Vec<u32>,
}

impl LayerLfu {
    /// An empty layer-LFU; `init` sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    fn split(&self, index: u32) -> Option<(usize, u32)> {
        let l = *self.key_layer.get(index as usize)? as usize;
        Some((l, index - self.layer_base[l]))
    }

    /// Resident entries per layer.
    pub fn resident_per_layer(&self) -> Vec<usize> {
        self.layers.iter().map(FreqOrder::len).collect()
    }
}

/// The registry entry (`policy::POLICIES`).
pub const INFO: super::PolicyInfo = super::PolicyInfo {
    name: "layer-lfu",
    help: "per-layer partitions: the fullest layer's least frequently used",
    make: || Box::new(LayerLfu::new()),
};

impl EvictionPolicy for LayerLfu {
    fn name(&self) -> &'static str {
        "layer-lfu"
    }

    fn init(&mut self, layout: &ExpertLayout) {
        self.layers.clear();
        self.key_layer.clear();
        self.layer_base.clear();
        let mut base = 0u32;
        for (l, layer) in layout.layers().iter().enumerate() {
            let mut f = FreqOrder::default();
            f.init(layer.n_expert as usize);
            self.layers.push(f);
            self.layer_base.push(base);
            self.key_layer
                .extend(std::iter::repeat_n(l as u16, layer.n_expert as usize));
            base += layer.n_expert;
        }
    }

    fn on_insert(&mut self, index: u32) {
        if let Some((l, e)) = self.split(index) {
            self.layers[l].access(e);
        }
    }

    fn on_hit(&mut self, index: u32) {
        if let Some((l, e)) = self.split(index) {
            self.layers[l].hit(e);
        }
    }

    fn on_remove(&mut self, index: u32) {
        if let Some((l, e)) = self.split(index) {
            self.layers[l].remove(e);
        }
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        // Layers by resident count, largest first; ties to the lower layer. The fullest
        // nearly always has an unpinned entry: tried first, before ranking them all.
        let coldest_of = |l: usize| {
            let base = self.layer_base[l];
            self.layers[l]
                .coldest_first()
                .map(move |e| base + e)
                .find(|&i| is_evictable(i))
        };
        let fullest = (0..self.layers.len())
            .filter(|&l| self.layers[l].len() > 0)
            .min_by(|&a, &b| {
                self.layers[b]
                    .len()
                    .cmp(&self.layers[a].len())
                    .then(a.cmp(&b))
            });
        if let Some(i) = fullest.and_then(coldest_of) {
            return Some(i);
        }
        let mut by_size: Vec<usize> = (0..self.layers.len()).collect();
        by_size.sort_by(|&a, &b| {
            self.layers[b]
                .len()
                .cmp(&self.layers[a].len())
                .then(a.cmp(&b))
        });
        by_size.into_iter().find_map(coldest_of)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::layout;

    #[test]
    fn victim_comes_from_the_fullest_layer_by_lfu() {
        let mut p = LayerLfu::new();
        p.init(&layout(2, 4)); // keys 0..4 layer 0, 4..8 layer 1
        for i in [0, 1, 2, 4] {
            p.on_insert(i);
        }
        p.on_hit(0);
        p.on_hit(2);
        assert_eq!(p.resident_per_layer(), vec![3, 1]);
        // Layer 0 is fullest; its coldest is 1 (one access).
        assert_eq!(p.victim(&|_| true), Some(1));
        // With layer 0 pinned entirely, fall back to layer 1.
        assert_eq!(p.victim(&|i| i >= 4), Some(4));
        p.on_remove(1);
        p.on_insert(5);
        p.on_insert(6);
        assert_eq!(p.resident_per_layer(), vec![2, 3]);
        assert_eq!(p.victim(&|_| true), Some(4));
        p.on_hit(99);
        assert_eq!(p.victim(&|_| false), None);
    }
}
