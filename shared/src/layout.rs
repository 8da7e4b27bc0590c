//! Where every expert's bytes live on flash, and what a token or a layer can demand.
//!
//! The engine builds an `ExpertLayout` from the GGUF tensor table; the simulator builds it from
//! a route trace's preamble. Both then hand it to the same cache and streamer, so "which bytes
//! does expert `e` of MoE layer `l` need" is answered in one place. Experts are stacked in one
//! 3-D tensor per projection, so expert `e` of a projection is the contiguous extent
//! `base_offset + e·stride_bytes .. + stride_bytes` (docs/architecture.md).

use thiserror::Error;

/// One (MoE layer, expert) pair: the unit the cache keeps and the streamer reads.
///
/// `layer` is the **MoE layer index** (0 = first MoE layer), not the model's layer number;
/// `ExpertLayout::layer` maps between the two.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExpertKey {
    pub layer: u16,
    pub expert: u16,
}

/// One projection's stacked expert tensor: expert `e`'s bytes are
/// `base_offset + e·stride_bytes .. base_offset + (e+1)·stride_bytes` in file `shard`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ProjExtent {
    pub shard: u16,
    pub base_offset: u64,
    pub stride_bytes: u64,
}

/// One MoE layer of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeLayerLayout {
    /// The model layer this MoE layer belongs to (`blk.N`).
    pub model_layer: u32,
    /// Routed experts in this layer (1..=65536).
    pub n_expert: u32,
    /// Projections in read order (gate, up, down; or a fused gate_up and down). The index in
    /// this vector is the `proj` of reads and io-trace rows.
    pub projections: Vec<ProjExtent>,
    /// Non-expert bytes of this layer (attention, norms, router, shared experts): never
    /// streamed, stated once in trace preambles.
    pub dense_bytes: u64,
}

/// Why a layout was refused. Every variant names the MoE layer and field at fault.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    #[error("expert layout has no MoE layer")]
    NoMoeLayers,
    #[error("expert layout has {count} MoE layers; at most 65535 are supported")]
    TooManyLayers { count: usize },
    #[error("MoE layer {moe_layer}: model layer {model_layer} is not increasing or not below n_model_layers={n_model_layers}")]
    ModelLayerOrder {
        moe_layer: usize,
        model_layer: u32,
        n_model_layers: u32,
    },
    #[error("MoE layer {moe_layer}: n_expert={n_expert}, expected 1..=65536")]
    ExpertCount { moe_layer: usize, n_expert: u32 },
    #[error("MoE layer {moe_layer}: {count} projections, expected 1..=255")]
    ProjectionCount { moe_layer: usize, count: usize },
    #[error("MoE layer {moe_layer} projection {proj}: expert stride is 0 bytes")]
    ZeroStride { moe_layer: usize, proj: usize },
    #[error("MoE layer {moe_layer} projection {proj}: base_offset + n_expert x stride overflows 64 bits")]
    ExtentOverflow { moe_layer: usize, proj: usize },
    #[error("MoE layer {moe_layer}: one expert's bytes overflow 64 bits")]
    ExpertBytesOverflow { moe_layer: usize },
    #[error("n_expert_used is 0; a MoE model routes at least one expert per token")]
    ZeroExpertsUsed,
    #[error("expert layout has {count} (layer, expert) keys; at most 2^32-1 are supported")]
    TooManyKeys { count: u64 },
    #[error(
        "MoE layer {moe_layer} projection {proj}: shard {shard} does not exist ({n_shards} shards)"
    )]
    MissingShard {
        moe_layer: usize,
        proj: usize,
        shard: u16,
        n_shards: usize,
    },
    #[error("MoE layer {moe_layer} projection {proj}: extent ends at byte {end} but shard {shard} has {shard_len} bytes")]
    ExtentPastEnd {
        moe_layer: usize,
        proj: usize,
        shard: u16,
        end: u64,
        shard_len: u64,
    },
}

/// The validated expert layout of one model.
///
/// Invariants (checked by `new`): at least one MoE layer and at most 65535; model layers
/// strictly increasing and below `n_model_layers`; every layer has 1..=65536 experts and
/// 1..=255 projections; no zero stride; no extent or per-expert byte count overflows `u64`;
/// fewer than 2^32 keys in total.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    n_model_layers: u32,
    layers: Vec<MoeLayerLayout>,
    n_expert_used: u16,
    /// Per MoE layer: bytes of one expert (sum of the projection strides).
    expert_bytes: Vec<u64>,
    /// Per MoE layer: dense index of its expert 0; one extra entry holds the key count.
    key_base: Vec<u32>,
    /// Per model layer: its MoE index, or `NOT_MOE`.
    moe_of_model: Vec<u16>,
}

const NOT_MOE: u16 = u16::MAX;

impl ExpertLayout {
    /// Validate and index a layout. `n_expert_used` is the model's top-k (its
    /// `expert_used_count`), used by the demand figures when no other k is given.
    pub fn new(
        n_model_layers: u32,
        layers: Vec<MoeLayerLayout>,
        n_expert_used: u16,
    ) -> Result<Self, LayoutError> {
        if layers.is_empty() {
            return Err(LayoutError::NoMoeLayers);
        }
        if layers.len() >= NOT_MOE as usize {
            return Err(LayoutError::TooManyLayers {
                count: layers.len(),
            });
        }
        if n_expert_used == 0 {
            return Err(LayoutError::ZeroExpertsUsed);
        }
        let mut expert_bytes = Vec::with_capacity(layers.len());
        let mut key_base = Vec::with_capacity(layers.len() + 1);
        let mut next_key: u64 = 0;
        let mut previous_model_layer: Option<u32> = None;
        for (moe_layer, l) in layers.iter().enumerate() {
            let ordered = previous_model_layer.is_none_or(|p| l.model_layer > p);
            if !ordered || l.model_layer >= n_model_layers {
                return Err(LayoutError::ModelLayerOrder {
                    moe_layer,
                    model_layer: l.model_layer,
                    n_model_layers,
                });
            }
            previous_model_layer = Some(l.model_layer);
            if l.n_expert == 0 || l.n_expert > 65_536 {
                return Err(LayoutError::ExpertCount {
                    moe_layer,
                    n_expert: l.n_expert,
                });
            }
            if l.projections.is_empty() || l.projections.len() > 255 {
                return Err(LayoutError::ProjectionCount {
                    moe_layer,
                    count: l.projections.len(),
                });
            }
            let mut bytes: u64 = 0;
            for (proj, p) in l.projections.iter().enumerate() {
                if p.stride_bytes == 0 {
                    return Err(LayoutError::ZeroStride { moe_layer, proj });
                }
                p.stride_bytes
                    .checked_mul(u64::from(l.n_expert))
                    .and_then(|span| span.checked_add(p.base_offset))
                    .ok_or(LayoutError::ExtentOverflow { moe_layer, proj })?;
                bytes = bytes
                    .checked_add(p.stride_bytes)
                    .ok_or(LayoutError::ExpertBytesOverflow { moe_layer })?;
            }
            expert_bytes.push(bytes);
            key_base.push(next_key as u32);
            next_key += u64::from(l.n_expert);
            if next_key >= u64::from(u32::MAX) {
                return Err(LayoutError::TooManyKeys { count: next_key });
            }
        }
        key_base.push(next_key as u32);
        let mut moe_of_model = vec![NOT_MOE; n_model_layers as usize];
        for (moe_layer, l) in layers.iter().enumerate() {
            moe_of_model[l.model_layer as usize] = moe_layer as u16;
        }
        Ok(ExpertLayout {
            n_model_layers,
            layers,
            n_expert_used,
            expert_bytes,
            key_base,
            moe_of_model,
        })
    }

    /// Check every extent against the shard file lengths (`shard_lens[s]` = bytes in shard
    /// `s`), so no read the streamer issues can run past a file's end.
    pub fn check_shards(&self, shard_lens: &[u64]) -> Result<(), LayoutError> {
        for (moe_layer, l) in self.layers.iter().enumerate() {
            for (proj, p) in l.projections.iter().enumerate() {
                let shard_len =
                    *shard_lens
                        .get(p.shard as usize)
                        .ok_or(LayoutError::MissingShard {
                            moe_layer,
                            proj,
                            shard: p.shard,
                            n_shards: shard_lens.len(),
                        })?;
                // `new` proved this cannot overflow.
                let end = p.base_offset + p.stride_bytes * u64::from(l.n_expert);
                if end > shard_len {
                    return Err(LayoutError::ExtentPastEnd {
                        moe_layer,
                        proj,
                        shard: p.shard,
                        end,
                        shard_len,
                    });
                }
            }
        }
        Ok(())
    }

    /// Layers in the model (MoE and dense).
    pub fn n_model_layers(&self) -> u32 {
        self.n_model_layers
    }

    /// Number of MoE layers.
    pub fn n_moe_layers(&self) -> u16 {
        self.layers.len() as u16
    }

    /// All MoE layers, by MoE index.
    pub fn layers(&self) -> &[MoeLayerLayout] {
        &self.layers
    }

    /// One MoE layer, if the index is in range.
    pub fn layer(&self, moe_layer: u16) -> Option<&MoeLayerLayout> {
        self.layers.get(moe_layer as usize)
    }

    /// The MoE index of model layer `model_layer`, or `None` for a dense layer.
    pub fn moe_index(&self, model_layer: u32) -> Option<u16> {
        match self.moe_of_model.get(model_layer as usize) {
            Some(&m) if m != NOT_MOE => Some(m),
            _ => None,
        }
    }

    /// The model's routed experts per token (`expert_used_count`).
    pub fn n_expert_used(&self) -> u16 {
        self.n_expert_used
    }

    /// The largest `n_expert` over the MoE layers.
    pub fn max_n_expert(&self) -> u32 {
        self.layers.iter().map(|l| l.n_expert).max().unwrap_or(0)
    }

    /// Bytes of one expert of MoE layer `moe_layer` (all projections); 0 when out of range.
    pub fn expert_bytes(&self, moe_layer: u16) -> u64 {
        self.expert_bytes
            .get(moe_layer as usize)
            .copied()
            .unwrap_or(0)
    }

    /// The largest `expert_bytes` over the MoE layers.
    pub fn max_expert_bytes(&self) -> u64 {
        self.expert_bytes.iter().copied().max().unwrap_or(0)
    }

    /// Bytes of every expert of every MoE layer (what `--load-all` reads per token).
    pub fn total_expert_bytes(&self) -> u64 {
        self.layers
            .iter()
            .zip(&self.expert_bytes)
            .map(|(l, &b)| b.saturating_mul(u64::from(l.n_expert)))
            .fold(0u64, u64::saturating_add)
    }

    /// One token's worst-case routed bytes at top-k `k`: Σ_layers expert_bytes × min(k,
    /// n_expert). A budget below it cannot hold a token cycle (the CSV's `cache_cycle_mb`).
    pub fn cache_cycle_bytes(&self, k: u16) -> u64 {
        self.layers
            .iter()
            .zip(&self.expert_bytes)
            .map(|(l, &b)| b.saturating_mul(u64::from(k).min(u64::from(l.n_expert))))
            .fold(0u64, u64::saturating_add)
    }

    /// The widest layer's routed bytes at top-k `k`: max over layers of expert_bytes ×
    /// min(k, n_expert). The mechanical floor a cache budget must stage (`layer_demand_MiB`).
    pub fn layer_demand_bytes(&self, k: u16) -> u64 {
        self.layers
            .iter()
            .zip(&self.expert_bytes)
            .map(|(l, &b)| b.saturating_mul(u64::from(k).min(u64::from(l.n_expert))))
            .max()
            .unwrap_or(0)
    }

    /// `(shard, offset, len)` of projection `proj` of the expert `key`, if both exist.
    pub fn extent(&self, key: ExpertKey, proj: u8) -> Option<(u16, u64, u64)> {
        let l = self.layers.get(key.layer as usize)?;
        if u32::from(key.expert) >= l.n_expert {
            return None;
        }
        let p = l.projections.get(proj as usize)?;
        Some((
            p.shard,
            p.base_offset + u64::from(key.expert) * p.stride_bytes,
            p.stride_bytes,
        ))
    }

    /// Total number of (layer, expert) keys: the size of the cache's dense arrays.
    pub fn n_keys(&self) -> u32 {
        self.key_base.last().copied().unwrap_or(0)
    }

    /// Dense index of `key` (`key_base[layer] + expert`), if the key exists.
    #[inline]
    pub fn key_index(&self, key: ExpertKey) -> Option<u32> {
        let l = self.layers.get(key.layer as usize)?;
        if u32::from(key.expert) >= l.n_expert {
            return None;
        }
        Some(self.key_base[key.layer as usize] + u32::from(key.expert))
    }

    /// The key with dense index `index`, if any.
    pub fn key_of(&self, index: u32) -> Option<ExpertKey> {
        if index >= self.n_keys() {
            return None;
        }
        // key_base is increasing; the layer is the last base <= index.
        let layer = self.key_base.partition_point(|&b| b <= index) - 1;
        Some(ExpertKey {
            layer: layer as u16,
            expert: (index - self.key_base[layer]) as u16,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(model_layer: u32, n_expert: u32, strides: &[u64]) -> MoeLayerLayout {
        let mut base = 0;
        let projections = strides
            .iter()
            .map(|&s| {
                let p = ProjExtent {
                    shard: 0,
                    base_offset: base,
                    stride_bytes: s,
                };
                base += s * u64::from(n_expert);
                p
            })
            .collect();
        MoeLayerLayout {
            model_layer,
            n_expert,
            projections,
            dense_bytes: 7,
        }
    }

    #[test]
    fn totals_and_demand_follow_the_formulas() {
        let l =
            ExpertLayout::new(4, vec![layer(1, 8, &[10, 10, 20]), layer(3, 2, &[100])], 4).unwrap();
        assert_eq!(l.expert_bytes(0), 40);
        assert_eq!(l.expert_bytes(1), 100);
        assert_eq!(l.total_expert_bytes(), 8 * 40 + 2 * 100);
        // k=4: layer 0 stages 4 experts, layer 1 only has 2.
        assert_eq!(l.cache_cycle_bytes(4), 4 * 40 + 2 * 100);
        assert_eq!(l.layer_demand_bytes(4), 200);
        assert_eq!(l.layer_demand_bytes(1), 100);
        assert_eq!(l.moe_index(1), Some(0));
        assert_eq!(l.moe_index(2), None);
        assert_eq!(l.moe_index(3), Some(1));
        assert_eq!(l.moe_index(99), None);
    }

    #[test]
    fn extents_and_key_indices_round_trip() {
        let l = ExpertLayout::new(2, vec![layer(0, 3, &[5, 6]), layer(1, 4, &[7])], 2).unwrap();
        assert_eq!(l.n_keys(), 7);
        for i in 0..7 {
            let k = l.key_of(i).unwrap();
            assert_eq!(l.key_index(k), Some(i));
        }
        assert_eq!(l.key_of(7), None);
        let k = ExpertKey {
            layer: 0,
            expert: 2,
        };
        assert_eq!(l.extent(k, 0), Some((0, 10, 5)));
        assert_eq!(l.extent(k, 1), Some((0, 15 + 12, 6)));
        assert_eq!(l.extent(k, 2), None);
        assert_eq!(
            l.key_index(ExpertKey {
                layer: 0,
                expert: 3
            }),
            None
        );
    }

    #[test]
    fn bad_layouts_are_refused_with_the_field_named() {
        assert_eq!(
            ExpertLayout::new(1, vec![], 1),
            Err(LayoutError::NoMoeLayers)
        );
        assert_eq!(
            ExpertLayout::new(1, vec![layer(0, 2, &[0])], 1),
            Err(LayoutError::ZeroStride {
                moe_layer: 0,
                proj: 0
            })
        );
        let mut overflowing = layer(0, 2, &[8]);
        overflowing.projections[0].base_offset = u64::MAX - 8;
        assert_eq!(
            ExpertLayout::new(1, vec![overflowing], 1),
            Err(LayoutError::ExtentOverflow {
                moe_layer: 0,
                proj: 0
            })
        );
        assert!(matches!(
            ExpertLayout::new(2, vec![layer(1, 2, &[8]), layer(1, 2, &[8])], 1),
            Err(LayoutError::ModelLayerOrder { moe_layer: 1, .. })
        ));
        assert!(matches!(
            ExpertLayout::new(1, vec![layer(0, 0, &[8])], 1),
            Err(LayoutError::ExpertCount { .. })
        ));
        assert_eq!(
            ExpertLayout::new(1, vec![layer(0, 2, &[8])], 0),
            Err(LayoutError::ZeroExpertsUsed)
        );
    }

    #[test]
    fn shard_lengths_bound_every_extent() {
        let l = ExpertLayout::new(1, vec![layer(0, 4, &[10, 10])], 2).unwrap();
        assert_eq!(l.check_shards(&[80]), Ok(()));
        assert!(matches!(
            l.check_shards(&[79]),
            Err(LayoutError::ExtentPastEnd {
                proj: 1,
                end: 80,
                ..
            })
        ));
        assert!(matches!(
            l.check_shards(&[]),
            Err(LayoutError::MissingShard { shard: 0, .. })
        ));
    }
}
