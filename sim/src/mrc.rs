//! The layer-atomic global-LRU miss-ratio curve over **every** budget from one pass of an
//! access sequence, by stack distances (Mattson et al. 1970), and exact: at each budget it
//! counts what `cache_only::run` with the core's `lru` policy counts (hits, misses, evictions,
//! re-reads, inserts, miss bytes and resident bytes), waves included. A sweep replays once per
//! budget; this answers all of them for the price of one replay.
//!
//! **The group rule on a stack.** Fix a budget B. Order every expert ever looked up by
//! recency: the *B-stack*. The core's cache at B holds exactly the longest prefix of the
//! B-stack whose bytes fit in B, so an expert is a hit iff its byte depth in the B-stack
//! before its group (its own bytes and those of every expert above it) is at most B. This
//! holds across a whole group (one (step, MoE layer)): every expert is looked up first, so
//! hits and misses are decided on the state before the group; the misses are then admitted,
//! each evicting least-recent unpinned entries, and the pinned ones are always the top of the
//! list, so evictions only ever take the B-stack's tail. After the group its experts sit on top
//! of the B-stack in the order the cache leaves them — **its misses (last admitted on top)
//! above its hits (last looked up on top)** — and the cache again holds the longest prefix
//! that fits. Waves change nothing here: a miss that finds no room beside the pinned entries
//! only waits for the unpin, and the final list is the same prefix (when a group is wider than
//! the budget, its last-admitted misses).
//!
//! **Why not one stack.** The order inside a group depends on which of its experts hit,
//! i.e. on B, so no single stack serves every budget, and the inclusion property fails: with
//! a group {a, b, c} in which a misses at B but hits at B + 1 (b and c hit at both), a ends
//! above b and c at B and below them at B + 1; after B − 1 other experts are touched, a is the
//! one left at B and the one gone at B + 1. So each lookup gets a *hit set*: the budgets, as
//! intervals of bytes, at which it hits. For a lookup of x whose previous lookup was in group
//! g: let D be the experts looked up in the groups strictly between (above x at every B; their
//! bytes come from a Fenwick tree over group indices, each expert counted at its latest
//! group), and R the other experts of g not looked up since (all of x's layer, s bytes each).
//! Then x hits at B iff `bytes(D) + s × (1 + r_B) <= B`, where r_B counts the experts of R
//! above x in g's order at B — a function of which of g's experts hit at B, read from their
//! own hit sets. Below `bytes(D) + s` x always misses; from `bytes(D) + s × (1 + |R|)` it
//! always hits; in between the hit set is worked out segment by segment. Lookups whose hit set
//! is not one interval `[t, ∞)` — where inclusion fails — are counted (`non_inclusive`).
//!
//! Cost: O(N log G) for N lookups in G groups, plus O(|g|²) per lookup of a group g's expert
//! (decode groups hold top-k experts). Nothing falls back to a per-budget replay.

use crate::cache_only::CacheOnlyResult;
use crate::error::SimError;
use crate::plan::AccessSeq;
use bmoe_core::{CacheCounters, CacheError, ExpertLayout};

/// `last_group` of an expert never looked up.
const NEVER: u32 = u32::MAX;
/// The open end of a hit set's last interval.
const UNBOUNDED: u64 = u64::MAX;

/// Budgets (bytes) at which one lookup hits: sorted, disjoint, non-adjacent half-open
/// intervals `[from, to)`, `to = UNBOUNDED` for no end. Empty: a miss at every budget.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct HitSet(Vec<(u64, u64)>);

impl HitSet {
    #[inline]
    fn contains(&self, budget: u64) -> bool {
        for &(from, to) in &self.0 {
            if budget < from {
                return false;
            }
            if budget < to {
                return true;
            }
        }
        false
    }

    /// Append `[from, to)`, which must start at or after the last interval's end.
    fn push(&mut self, from: u64, to: u64) {
        if from >= to {
            return;
        }
        match self.0.last_mut() {
            Some(last) if last.1 == from => last.1 = to,
            _ => self.0.push((from, to)),
        }
    }
}

/// Sums over group indices, with point updates (a Fenwick tree). Values are bytes; removals
/// wrap, and every prefix sum of what is stored is a true (non-negative) sum.
struct Fenwick {
    tree: Vec<u64>,
}

impl Fenwick {
    fn new(n: usize) -> Fenwick {
        Fenwick {
            tree: vec![0; n + 1],
        }
    }

    fn add(&mut self, at: usize, bytes: u64, remove: bool) {
        let mut i = at + 1;
        while i < self.tree.len() {
            self.tree[i] = if remove {
                self.tree[i].wrapping_sub(bytes)
            } else {
                self.tree[i].wrapping_add(bytes)
            };
            i += i & i.wrapping_neg();
        }
    }

    /// Σ of positions `[0, end)`.
    fn prefix(&self, end: usize) -> u64 {
        let mut i = end.min(self.tree.len() - 1);
        let mut sum = 0u64;
        while i > 0 {
            sum = sum.wrapping_add(self.tree[i]);
            i -= i & i.wrapping_neg();
        }
        sum
    }
}

/// One step of the curve: the counts at every budget from `from_bytes` up to the next step's.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MrcStep {
    pub from_bytes: u64,
    pub hits: u64,
    /// Expert bytes of those hits.
    pub hit_bytes: u64,
    /// Experts resident at the end of the sequence, and their bytes.
    pub resident_count: u64,
    pub resident_bytes: u64,
}

/// The curve: the cache off (budget 0), and every budget from the floor up, as steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mrc {
    /// The top-k the floor was worked out for (as `ExpertCache::new` takes it: 0 reads as 1).
    pub k: u16,
    /// The smallest budget above 0 the cache takes (`layer_demand_bytes(k)`); below it, and
    /// above 0, `ExpertCache::new` refuses the budget.
    pub floor_bytes: u64,
    /// Every expert of every MoE layer: at or past it nothing is ever evicted.
    pub bank_bytes: u64,
    /// Lookups (the sequence's keys), their expert bytes, and the first ones (misses at every
    /// budget).
    pub lookups: u64,
    pub lookup_bytes: u64,
    pub cold: u64,
    /// Routed slots the lookups came from (`AccessSeq::routings`).
    pub routings: u64,
    pub groups: u64,
    /// Lookups whose hit budgets are not one interval `[t, ∞)`: there a larger budget misses
    /// what a smaller one hits (the group order breaks LRU's inclusion property).
    pub non_inclusive: u64,
    /// Ascending `from_bytes`; the first is `floor_bytes`. A step holds up to the next one's
    /// `from_bytes` (the last, for every larger budget). Consecutive steps differ.
    pub steps: Vec<MrcStep>,
}

impl Mrc {
    /// The step that holds at `budget_bytes` (at least the floor).
    fn step_at(&self, budget_bytes: u64) -> MrcStep {
        let i = self
            .steps
            .partition_point(|s| s.from_bytes <= budget_bytes)
            .saturating_sub(1);
        self.steps.get(i).copied().unwrap_or_default()
    }

    /// What `cache_only::run` with the `lru` policy counts at `budget_bytes` (0 = the cache
    /// off). A budget above 0 and below the floor is refused, as the cache refuses it.
    pub fn at(&self, budget_bytes: u64) -> Result<CacheOnlyResult, SimError> {
        if budget_bytes == 0 {
            return Ok(CacheOnlyResult {
                counters: CacheCounters {
                    misses: self.lookups,
                    ..CacheCounters::default()
                },
                miss_bytes: self.lookup_bytes,
                resident_bytes: 0,
            });
        }
        if budget_bytes < self.floor_bytes {
            return Err(SimError::Cache(CacheError::BudgetBelowLayerDemand {
                budget_bytes,
                layer_demand_bytes: self.floor_bytes,
                k: self.k,
            }));
        }
        let s = self.step_at(budget_bytes);
        let misses = self.lookups - s.hits;
        Ok(CacheOnlyResult {
            counters: CacheCounters {
                hits: s.hits,
                misses,
                // Every miss is admitted (in waves when it must); nothing leaves the cache
                // but by eviction; every lookup after an expert's first finds it held before.
                evictions: misses - s.resident_count,
                rereads: misses - self.cold,
                inserts: misses,
                bypasses: 0,
            },
            miss_bytes: self.lookup_bytes - s.hit_bytes,
            resident_bytes: s.resident_bytes,
        })
    }
}

/// The start of every group, checked: ends never decrease nor pass the keys.
fn group_starts(seq: &AccessSeq) -> Result<Vec<u32>, SimError> {
    let mut starts = Vec::with_capacity(seq.group_end.len() + 1);
    let mut start = 0u32;
    for (g, &end) in seq.group_end.iter().enumerate() {
        if end < start || end as usize > seq.keys.len() {
            return Err(SimError::invalid(
                "access sequence",
                format!(
                    "group {g} ends at key {end}, outside {start}..={} (group ends must not \
                     decrease nor pass the {} keys)",
                    seq.keys.len(),
                    seq.keys.len()
                ),
            ));
        }
        starts.push(start);
        start = end;
    }
    starts.push(start);
    Ok(starts)
}

/// Everything one pass keeps.
struct Pass<'a> {
    keys: &'a [u32],
    starts: Vec<u32>,
    /// Expert bytes, per dense key index.
    size: Vec<u64>,
    floor: u64,
    /// Per key: the group of its latest lookup (`NEVER`), its place in that group's lookup
    /// order, and the budgets at which that lookup hit.
    last: Vec<u32>,
    place: Vec<u32>,
    hit: Vec<HitSet>,
    /// Bytes of each key at its latest group.
    fenwick: Fenwick,
    // Scratch.
    others: Vec<u32>,
    points: Vec<u64>,
}

impl Pass<'_> {
    /// The hit set of a lookup of key `x`, before group `now`'s updates (`now` = the number
    /// of groups for "resident at the end"). `x` must have been looked up before.
    fn hit_set(&mut self, x: u32, now: usize, out: &mut HitSet) {
        out.0.clear();
        let xi = x as usize;
        let g = self.last[xi] as usize;
        let s = self.size[xi];
        let above = self
            .fenwick
            .prefix(now)
            .wrapping_sub(self.fenwick.prefix(g + 1));
        self.others.clear();
        for &y in &self.keys[self.starts[g] as usize..self.starts[g + 1] as usize] {
            if y != x && self.last[y as usize] as usize == g {
                self.others.push(y);
            }
        }
        let n = self.others.len() as u64;
        let depth = |r: u64| above.saturating_add(s.saturating_mul(r + 1));
        let always = depth(n);
        if always <= self.floor {
            out.push(self.floor, UNBOUNDED);
            return;
        }
        let first = depth(0).max(self.floor);
        // Inside [first, always) the answer changes only where the allowed number of experts
        // above x does (every s bytes) or where an expert of g changes between hit and miss.
        self.points.clear();
        self.points.push(first);
        for r in 0..n {
            let p = depth(r);
            if p > first {
                self.points.push(p);
            }
        }
        let inside = |p: u64| p > first && p < always;
        for &y in self.others.iter().chain(std::iter::once(&x)) {
            for &(from, to) in &self.hit[y as usize].0 {
                if inside(from) {
                    self.points.push(from);
                }
                if inside(to) {
                    self.points.push(to);
                }
            }
        }
        self.points.sort_unstable();
        self.points.dedup();
        let x_place = self.place[xi];
        for (i, &b) in self.points.iter().enumerate() {
            let end = self.points.get(i + 1).copied().unwrap_or(always);
            // Group g's order at b: its misses above its hits, later lookups above earlier.
            let x_hit = self.hit[xi].contains(b);
            let r = self
                .others
                .iter()
                .filter(|&&y| {
                    let y_hit = self.hit[y as usize].contains(b);
                    let later = self.place[y as usize] > x_place;
                    if x_hit {
                        !y_hit || later
                    } else {
                        !y_hit && later
                    }
                })
                .count() as u64;
            if depth(r) <= b {
                out.push(b, end);
            }
        }
        out.push(always, UNBOUNDED);
    }
}

/// The curve of `seq` over `layout` for a cache sized for top-k `k` (the floor), in one pass.
pub fn compute(layout: &ExpertLayout, seq: &AccessSeq, k: u16) -> Result<Mrc, SimError> {
    // Every expert has a size: `ExpertLayout` refuses 0-byte projections.
    let starts = group_starts(seq)?;
    let n_keys = layout.n_keys() as usize;
    let n_groups = seq.group_end.len();
    if n_groups >= NEVER as usize {
        return Err(SimError::invalid(
            "access sequence",
            format!("{n_groups} groups; at most {} are supported", NEVER - 1),
        ));
    }
    // Dense indices, checked: known keys, each once per group.
    let mut keys = Vec::with_capacity(seq.keys.len());
    let mut seen = vec![NEVER; n_keys];
    for g in 0..n_groups {
        for key in &seq.keys[starts[g] as usize..starts[g + 1] as usize] {
            let i = layout
                .key_index(*key)
                .ok_or(SimError::Cache(CacheError::UnknownKey {
                    layer: key.layer,
                    expert: key.expert,
                }))?;
            if seen[i as usize] == g as u32 {
                return Err(SimError::invalid(
                    "access sequence",
                    format!(
                        "group {g} looks expert {} of MoE layer {} up twice (a group holds \
                         each expert once)",
                        key.expert, key.layer
                    ),
                ));
            }
            seen[i as usize] = g as u32;
            keys.push(i);
        }
    }
    // Keys past the last group are never looked up (as in `cache_only::run`).
    let mut size = vec![0u64; n_keys];
    for m in 0..layout.n_moe_layers() {
        let base = layout
            .key_index(bmoe_core::ExpertKey {
                layer: m,
                expert: 0,
            })
            .unwrap_or(0) as usize;
        let n = layout.layers()[m as usize].n_expert as usize;
        size[base..base + n].fill(layout.expert_bytes(m));
    }
    let floor = layout.layer_demand_bytes(k.max(1));
    let mut pass = Pass {
        keys: &keys,
        starts,
        size,
        floor,
        last: vec![NEVER; n_keys],
        place: vec![0; n_keys],
        hit: vec![HitSet::default(); n_keys],
        fenwick: Fenwick::new(n_groups),
        others: Vec::new(),
        points: Vec::new(),
    };
    // (budget, what, bytes, removed): what 0 = a hit, 1 = resident at the end.
    let mut events: Vec<(u64, u8, u64, bool)> = Vec::with_capacity(2 * keys.len());
    let mut fresh: Vec<HitSet> = Vec::new();
    let (mut cold, mut lookup_bytes, mut non_inclusive) = (0u64, 0u64, 0u64);
    let emit = |events: &mut Vec<(u64, u8, u64, bool)>, set: &HitSet, what: u8, bytes: u64| {
        for &(from, to) in &set.0 {
            events.push((from, what, bytes, false));
            if to != UNBOUNDED {
                events.push((to, what, bytes, true));
            }
        }
    };
    for g in 0..n_groups {
        let group = &keys[pass.starts[g] as usize..pass.starts[g + 1] as usize];
        if fresh.len() < group.len() {
            fresh.resize(group.len(), HitSet::default());
        }
        // Every lookup of the group is decided on the state before it.
        for (j, &x) in group.iter().enumerate() {
            let bytes = pass.size[x as usize];
            lookup_bytes += bytes;
            if pass.last[x as usize] == NEVER {
                cold += 1;
                fresh[j].0.clear();
                continue;
            }
            let mut set = std::mem::take(&mut fresh[j]);
            pass.hit_set(x, g, &mut set);
            if set.0.len() > 1 {
                non_inclusive += 1;
            }
            emit(&mut events, &set, 0, bytes);
            fresh[j] = set;
        }
        for (j, &x) in group.iter().enumerate() {
            let xi = x as usize;
            let bytes = pass.size[xi];
            if pass.last[xi] != NEVER {
                pass.fenwick.add(pass.last[xi] as usize, bytes, true);
            }
            pass.fenwick.add(g, bytes, false);
            pass.last[xi] = g as u32;
            pass.place[xi] = j as u32;
            std::mem::swap(&mut pass.hit[xi], &mut fresh[j]);
        }
    }
    // Resident at the end: a lookup of every expert after the last group.
    let mut set = HitSet::default();
    for x in 0..n_keys as u32 {
        if pass.last[x as usize] != NEVER {
            pass.hit_set(x, n_groups, &mut set);
            emit(&mut events, &set, 1, pass.size[x as usize]);
        }
    }
    events.sort_unstable_by_key(|e| e.0);
    let mut steps: Vec<MrcStep> = vec![MrcStep {
        from_bytes: floor,
        ..MrcStep::default()
    }];
    let mut now = MrcStep::default();
    let mut i = 0;
    while i < events.len() {
        let at = events[i].0;
        while i < events.len() && events[i].0 == at {
            let (_, what, bytes, removed) = events[i];
            let (count, sum) = if what == 0 {
                (&mut now.hits, &mut now.hit_bytes)
            } else {
                (&mut now.resident_count, &mut now.resident_bytes)
            };
            if removed {
                *count = count.wrapping_sub(1);
                *sum = sum.wrapping_sub(bytes);
            } else {
                *count = count.wrapping_add(1);
                *sum = sum.wrapping_add(bytes);
            }
            i += 1;
        }
        now.from_bytes = at;
        match steps.last_mut() {
            Some(last) if last.from_bytes == at => *last = now,
            Some(last)
                if (
                    last.hits,
                    last.hit_bytes,
                    last.resident_count,
                    last.resident_bytes,
                ) == (
                    now.hits,
                    now.hit_bytes,
                    now.resident_count,
                    now.resident_bytes,
                ) => {}
            _ => steps.push(now),
        }
    }
    Ok(Mrc {
        k,
        floor_bytes: floor,
        bank_bytes: layout.total_expert_bytes(),
        lookups: keys.len() as u64,
        lookup_bytes,
        cold,
        routings: seq.routings,
        groups: n_groups as u64,
        non_inclusive,
        steps,
    })
}

/// Which budgets a listing of the curve names (`bmoe-sim mrc --points`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Points {
    /// The cache off, then every whole number of experts per MoE layer the cache takes, up to
    /// the widest layer's expert count.
    Layer,
    /// The cache off, then every budget at which a count changes (the curve's steps).
    All,
}

impl Points {
    /// Parse `layer` or `all`.
    pub fn parse(s: &str) -> Option<Points> {
        match s {
            "layer" => Some(Points::Layer),
            "all" => Some(Points::All),
            _ => None,
        }
    }
}

/// Bytes of one expert in every MoE layer: one "expert per layer" of budget (the sweep's
/// unit, `sweep::bytes_per_layer_expert`).
fn per_layer_unit(layout: &ExpertLayout) -> u64 {
    crate::sweep::bytes_per_layer_expert(layout).max(1)
}

impl Mrc {
    /// The budgets `points` names, ascending, the cache off first.
    pub fn budgets(&self, layout: &ExpertLayout, points: Points) -> Vec<u64> {
        let mut v = vec![0];
        match points {
            Points::Layer => {
                let unit = per_layer_unit(layout);
                let first = self.floor_bytes.div_ceil(unit).max(1);
                let last = u64::from(layout.max_n_expert()).max(first);
                v.extend((first..=last).map(|m| m.saturating_mul(unit)));
            }
            Points::All => v.extend(self.steps.iter().map(|s| s.from_bytes)),
        }
        v
    }

    /// The CSV of the curve at `budgets` (`Mrc::budgets`): one row per budget, the sweep's
    /// budget columns and counters (`sweep.csv`'s names where they mean the same), then the
    /// miss ratio and the misses' and resident experts' bytes.
    pub fn csv(&self, layout: &ExpertLayout, budgets: &[u64]) -> Result<String, SimError> {
        use bmoe_core::config::MIB;
        use bmoe_core::telemetry::fmt::fixed;
        let unit = per_layer_unit(layout);
        let bank = self.bank_bytes.max(1);
        let mut o = String::from(
            "budget_bytes,budget_mib,experts_per_layer,bank_pct,lookups,hits,misses,evictions,\
             rereads,inserts,hit_rate,miss_ratio,miss_bytes,resident_bytes\n",
        );
        for &b in budgets {
            let r = self.at(b)?;
            let c = r.counters;
            let ratio = |x: u64| crate::sweep::ratio(x, self.lookups);
            o.push_str(&format!(
                "{b},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
                fixed(b as f64 / MIB as f64, 1),
                fixed(b as f64 / unit as f64, 2),
                fixed(100.0 * b as f64 / bank as f64, 2),
                self.lookups,
                c.hits,
                c.misses,
                c.evictions,
                c.rereads,
                c.inserts,
                fixed(ratio(c.hits), 4),
                fixed(ratio(c.misses), 4),
                r.miss_bytes,
                r.resident_bytes
            ));
        }
        Ok(o)
    }

    /// The whole curve as a figure: miss ratio against the budget in experts per MoE layer,
    /// a staircase from the floor to the whole bank (the cache off is not drawn: it is no
    /// point of the curve's x range, only its listing's first row).
    pub fn figure(
        &self,
        layout: &ExpertLayout,
        trace_name: &str,
    ) -> crate::sweep::plot::LineFigure {
        use crate::sweep::plot::{Line, LineFigure, Panel};
        let unit = per_layer_unit(layout) as f64;
        let ratio = |hits: u64| crate::sweep::ratio(self.lookups - hits, self.lookups);
        let end = self
            .steps
            .last()
            .map_or(self.bank_bytes, |s| s.from_bytes.max(self.bank_bytes));
        let mut points = Vec::with_capacity(2 * self.steps.len());
        for (i, s) in self.steps.iter().enumerate() {
            let to = self.steps.get(i + 1).map_or(end, |n| n.from_bytes);
            let y = ratio(s.hits);
            points.push((s.from_bytes as f64 / unit, y, None));
            points.push((to as f64 / unit, y, None));
        }
        LineFigure {
            title: format!("global LRU miss ratio at every budget (one pass) — {trace_name}"),
            x_label: "cache budget (experts per MoE layer)".into(),
            y_label: "miss ratio (misses / lookups)".into(),
            fraction: true,
            x_log2: false,
            panels: vec![Panel {
                title: format!(
                    "{} lookups; the cache takes budgets from {} experts/layer (layer demand)",
                    self.lookups,
                    crate::sweep::report::trim(self.floor_bytes as f64 / unit, 2)
                ),
                lines: vec![Line {
                    name: "lru (layer-atomic, exact)".into(),
                    style: 0,
                    black: false,
                    markers: false,
                    points,
                }],
            }],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache_only;
    use bmoe_core::policy::Lru;
    use bmoe_core::{ExpertKey, MoeLayerLayout, ProjExtent};
    use proptest::prelude::*;

    fn layout(expert_bytes: &[u64], n_expert: u32, k: u16) -> ExpertLayout {
        let layers = expert_bytes
            .iter()
            .enumerate()
            .map(|(m, &b)| MoeLayerLayout {
                model_layer: m as u32,
                n_expert,
                projections: vec![ProjExtent {
                    shard: 0,
                    base_offset: m as u64 * 1_000_000,
                    stride_bytes: b,
                }],
                dense_bytes: 0,
            })
            .collect();
        ExpertLayout::new(expert_bytes.len() as u32, layers, k).expect("layout")
    }

    fn seq(groups: &[Vec<(u16, u16)>]) -> AccessSeq {
        let mut s = AccessSeq::default();
        for g in groups {
            for &(layer, expert) in g {
                s.keys.push(ExpertKey { layer, expert });
            }
            s.group_end.push(s.keys.len() as u32);
            s.routings += g.len() as u64;
        }
        s
    }

    /// Every budget from 0 through one past the bank, one byte at a time: the curve against
    /// the core's cache replayed at that budget.
    fn check_every_budget(l: &ExpertLayout, s: &AccessSeq, k: u16) -> Result<(), TestCaseError> {
        let curve = compute(l, s, k).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for budget in 0..=curve.bank_bytes + 1 {
            let replay = cache_only::run(l, s, budget, k, Box::new(Lru::new()));
            match (curve.at(budget), replay) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b, "budget {}", budget),
                (Err(_), Err(_)) => {}
                (a, b) => prop_assert!(false, "budget {budget}: curve {a:?}, replay {b:?}"),
            }
        }
        Ok(())
    }

    #[test]
    fn a_larger_budget_can_miss_what_a_smaller_one_hits() {
        // One layer of 8 experts of 10 bytes, top-3. Stack before group 2 (most recent
        // first): c, b, x, y, a — a at depth 5. At 4 experts a misses, at 5 it hits.
        let l = layout(&[10], 8, 3);
        let (a, b, c, x, y, p, q, r) = (0, 1, 2, 3, 4, 5, 6, 7);
        let s = seq(&[
            vec![(0, a)],
            vec![(0, y), (0, x)],
            vec![(0, b), (0, c)],
            // Group {a, b, c}: at 4 experts a misses and ends on top (misses above hits),
            // at 5 it hits and ends below b and c (looked up after it).
            vec![(0, a), (0, b), (0, c)],
            // Three others: at 4 one of the group stays (a), at 5 two (c, b).
            vec![(0, p), (0, q), (0, r)],
            vec![(0, a)],
        ]);
        let hits = |s: &AccessSeq, experts: u64| {
            let c = compute(&l, s, 3).expect("curve");
            let got = c.at(experts * 10).expect("budget").counters;
            let want = cache_only::run(&l, s, experts * 10, 3, Box::new(Lru::new()))
                .expect("replay")
                .counters;
            assert_eq!(got, want, "{experts} experts");
            got.hits
        };
        let mut before = s.clone();
        before.keys.pop();
        before.group_end.pop();
        before.routings -= 1;
        // The last lookup of a: a hit at 4 experts, a miss at 5, a hit again at 6.
        let last: Vec<u64> = (4..=6).map(|e| hits(&s, e) - hits(&before, e)).collect();
        assert_eq!(last, [1, 0, 1]);
        assert_eq!(compute(&l, &s, 3).expect("curve").non_inclusive, 1);
    }

    #[test]
    fn bad_sequences_and_budgets_are_refused_by_name() {
        let l = layout(&[10, 10], 4, 2);
        let twice = seq(&[vec![(0, 1), (0, 1)]]);
        let e = compute(&l, &twice, 2).expect_err("duplicate");
        assert!(
            e.to_string()
                .contains("group 0 looks expert 1 of MoE layer 0 up twice"),
            "{e}"
        );
        let unknown = seq(&[vec![(2, 0)]]);
        assert!(compute(&l, &unknown, 2).is_err());
        let mut broken = seq(&[vec![(0, 1)]]);
        broken.group_end.push(7);
        let e = compute(&l, &broken, 2).expect_err("past the keys");
        assert!(e.to_string().contains("group 1 ends at key 7"), "{e}");
        let ok = compute(&l, &seq(&[vec![(0, 1)]]), 2).expect("curve");
        let e = ok.at(19).expect_err("below the floor");
        assert!(e.to_string().contains("layer_demand"), "{e}");
        assert_eq!(ok.at(0).expect("off").counters.misses, 1);
    }

    /// (expert bytes per layer, top-k, groups of (layer, expert)).
    type Case = (Vec<u64>, u16, Vec<Vec<(u16, u16)>>);

    /// Groups of one layer each, of random width (wider than top-k too: the prefill's waves),
    /// over layers of different expert sizes.
    fn groups() -> impl Strategy<Value = Case> {
        (
            prop::collection::vec(prop::sample::select(vec![10u64, 15, 25]), 1..=3),
            1u16..=3,
        )
            .prop_flat_map(|(sizes, k)| {
                let n_layers = sizes.len() as u16;
                let group = (
                    0..n_layers,
                    prop::sample::subsequence((0u16..6).collect::<Vec<_>>(), 1..=6),
                )
                    .prop_flat_map(|(layer, experts)| {
                        Just(experts).prop_shuffle().prop_map(move |e| {
                            e.into_iter().map(|x| (layer, x)).collect::<Vec<_>>()
                        })
                    });
                (Just(sizes), Just(k), prop::collection::vec(group, 1..60))
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        #[test]
        fn the_one_pass_curve_is_the_per_budget_replay((sizes, k, g) in groups()) {
            let l = layout(&sizes, 6, k);
            check_every_budget(&l, &seq(&g), k)?;
        }

        #[test]
        fn decode_shaped_groups_of_top_k_agree_too(
            (sizes, k, g) in groups().prop_map(|(s, k, g)| {
                let g = g.into_iter().map(|mut v| { v.truncate(k as usize); v }).collect::<Vec<_>>();
                (s, k, g)
            })
        ) {
            let l = layout(&sizes, 6, k);
            check_every_budget(&l, &seq(&g), k)?;
        }
    }
}
