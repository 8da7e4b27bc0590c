//! Causal attention of a batch of query rows over a KV memory, in tiles.
//!
//! Why this exists: computed one (row, head) at a time — a lane-tree dot per key, libm `exp`
//! per score, then the weighted value sum — attention took 8-9 % of a 128-token prefill while
//! doing ~1 % of its arithmetic. Here a *unit* of work is one KV head, the query heads that
//! share it (GQA) and a tile of rows: each block of 16 keys is transposed once and scored
//! against every query of the unit (16 keys per vector, the query element broadcast), the
//! softmax runs a polynomial `exp` over 16 scores at a time, and the value sum reads each value
//! vector once per row for all the row's heads, vectorised over `head_dim`.
//!
//! The bits of one (row, head) are defined without reference to the tile, the batch, the
//! thread count or the SIMD level, so a row computed inside a prefill equals the same row
//! computed alone in a decode step, and every [`SimdLevel`] equals the scalar reference:
//! - score `j`: from `acc = 0`, `acc = fma(q[d], k_j[d], acc)` for `d = 0 .. head_dim` in order;
//!   a soft-cap `c·tanh(s/c)` (the `libm` crate's `tanhf`, the same bits on every target;
//!   scalar at every level), then `× scale`;
//! - `m` = the largest score (and the sink); `e_j = exp_neg(s_j − m)` ([`exp_neg`]);
//! - the sum: `e_j` (as f64) joins lane `(j − first) % 16`, each lane in key order, the 16
//!   lanes folded by a fixed tree, the sink's exponential added last; `w_j = e_j · (1/sum)`;
//! - output element `d` = `fma(w_j, v_j[d], acc)` over the row's keys in order, from 0.
//!
//! Work is split over the pool by estimated cost (causal rows differ in length), never by
//! anything the bits depend on.

use super::{SimdLevel, ThreadPool};

/// Where attention reads the key and the value vector (`n_head_kv · head_dim` floats, KV head
/// `h` at `h·head_dim`) of a position. Every position the call's rows attend to must be
/// readable; positions between the smallest and the largest of them must not panic (a tile
/// may score a key it then ignores).
pub trait KvRows: Sync {
    fn key(&self, pos: usize) -> &[f32];
    fn value(&self, pos: usize) -> &[f32];
}

/// One layer's attention geometry and score shaping.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Multiplies every score (`1/√head_dim` for most; gemma4: 1).
    pub scale: f32,
    /// Sliding window: a token attends to itself and the `window − 1` before it.
    pub window: Option<usize>,
    /// Score soft-capping `c·tanh(s/c)`, applied to the raw dot product before `scale`.
    pub softcap: Option<f32>,
}

impl AttnShape {
    /// The first position row `pos` attends to.
    fn first(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// Keys per score block (one AVX-512 vector, two AVX2 vectors).
const KB: usize = 16;
/// Queries a unit aims for: enough that the transposition of a key block is small beside the
/// products it feeds.
const UNIT_QUERIES: usize = 64;
/// Most rows per tile: a tile scores the union of its rows' keys, so its later rows' keys are
/// computed for the earlier ones too (at most `MAX_ROWS − 1` extra per row).
const MAX_ROWS: usize = 16;
/// Score scratch a unit aims to stay under (floats), so scores stay in cache for the softmax.
const UNIT_SCORES: usize = 128 * 1024;

/// One unit: KV head `kh`, query heads `h0 .. h1` (of its group), rows `r0 .. r1`.
#[derive(Clone, Copy, Debug)]
struct Unit {
    kh: usize,
    h0: usize,
    h1: usize,
    r0: usize,
    r1: usize,
    /// Union of the rows' key ranges: `k_lo ..= k_hi`.
    k_lo: usize,
    k_hi: usize,
}

impl Unit {
    fn n_queries(&self) -> usize {
        (self.h1 - self.h0) * (self.r1 - self.r0)
    }
    /// Score row stride: the union's length rounded up to whole key blocks.
    fn stride(&self) -> usize {
        (self.k_hi + 1 - self.k_lo).div_ceil(KB) * KB
    }
}

struct SendPtr<T>(*mut T);
// SAFETY: each task writes only its own disjoint regions behind the pointer (its scratch slice
// and the output of its units), and the pool's `run` returns only when every task is done.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}

/// Causal multi-head attention of `q` (`positions.len()` rows × `n_head·head_dim`) over the
/// keys and values of `kv`, GQA (query head `h` reads KV head `h / (n_head / n_head_kv)`),
/// into `out` (same shape as `q`). `sinks` (one logit per query head) joins each softmax
/// without a value (gpt-oss). `scratch` is resized as needed. The bits of each (row, head) are
/// those of the module's definition at every `level` (a level the CPU lacks is lowered).
#[allow(clippy::too_many_arguments)]
pub fn attend<K: KvRows>(
    pool: &ThreadPool,
    level: SimdLevel,
    shape: &AttnShape,
    q: &[f32],
    positions: &[u32],
    kv: &K,
    sinks: Option<&[f32]>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let level = level.min(super::simd_level());
    let (nh, nkv, hd) = (shape.n_head, shape.n_head_kv, shape.head_dim);
    let n = positions.len();
    if n == 0 || nh == 0 || nkv == 0 || hd == 0 {
        return;
    }
    assert!(
        nh % nkv == 0 && q.len() >= n * nh * hd && out.len() >= n * nh * hd,
        "attention shape: {nh} heads over {nkv} kv heads, {n} rows of {hd}"
    );
    if let Some(s) = sinks {
        assert!(s.len() >= nh, "attention sinks: {} for {nh} heads", s.len());
    }
    let n_threads = pool.n_threads().max(1);
    let units = plan(shape, positions, n_threads);
    let costs: Vec<u64> = units
        .iter()
        .map(|u| unit_cost(shape, positions, u))
        .collect();
    let total: u64 = costs.iter().sum();
    let n_tasks = n_threads.min(units.len());
    // Task t takes the units whose cumulative cost ends in (t·total/T, (t+1)·total/T].
    let mut bounds = Vec::with_capacity(n_tasks + 1);
    bounds.push(0usize);
    let mut acc = 0u64;
    let mut next = 1usize;
    for (i, c) in costs.iter().enumerate() {
        acc += c;
        while next < n_tasks && acc * n_tasks as u64 >= total * next as u64 {
            bounds.push(i + 1);
            next += 1;
        }
    }
    while bounds.len() <= n_tasks {
        bounds.push(units.len());
    }
    *bounds.last_mut().expect("bounds has n_tasks + 1 entries") = units.len();
    let per_task = units
        .iter()
        .map(|u| u.n_queries() * u.stride())
        .max()
        .unwrap_or(0)
        + hd * KB;
    scratch.resize(n_tasks * per_task, 0.0);
    let scratch_ptr = SendPtr(scratch.as_mut_ptr());
    let out_ptr = SendPtr(out.as_mut_ptr());
    pool.run(n_tasks, &|t| {
        // SAFETY: task t alone uses scratch[t*per_task ..][.. per_task].
        let sc = unsafe {
            std::slice::from_raw_parts_mut(scratch_ptr.get().add(t * per_task), per_task)
        };
        let (kt, scores) = sc.split_at_mut(hd * KB);
        for u in &units[bounds[t]..bounds[t + 1]] {
            // SAFETY: units cover disjoint (row, head) slices of `out`, each in one task.
            unsafe {
                run_unit(
                    level,
                    shape,
                    q,
                    positions,
                    kv,
                    sinks,
                    u,
                    kt,
                    scores,
                    out_ptr.get(),
                )
            };
        }
    });
}

/// The units of a call: row tiles × KV heads (× head parts when there are fewer units than
/// threads, as in a decode step with few KV heads).
fn plan(shape: &AttnShape, positions: &[u32], n_threads: usize) -> Vec<Unit> {
    let (nh, nkv) = (shape.n_head, shape.n_head_kv);
    let n = positions.len();
    let group = nh / nkv;
    let max_span = positions
        .iter()
        .map(|&p| p as usize + 1 - shape.first(p as usize))
        .max()
        .unwrap_or(1);
    let mut rows = (UNIT_QUERIES / group).clamp(1, MAX_ROWS).min(n);
    while rows > 1 && group * rows * (max_span + rows + KB) > UNIT_SCORES {
        rows /= 2;
    }
    let tiles = n.div_ceil(rows);
    let parts = if tiles * nkv < n_threads {
        n_threads.div_ceil(tiles * nkv).min(group)
    } else {
        1
    };
    let per_part = group.div_ceil(parts);
    let mut units = Vec::with_capacity(tiles * nkv * parts);
    for tile in 0..tiles {
        let (r0, r1) = (tile * rows, ((tile + 1) * rows).min(n));
        let span = positions[r0..r1].iter().map(|&p| p as usize);
        let k_lo = span.clone().map(|p| shape.first(p)).min().unwrap_or(0);
        let k_hi = span.max().unwrap_or(0);
        for kh in 0..nkv {
            let mut h0 = kh * group;
            while h0 < (kh + 1) * group {
                let h1 = (h0 + per_part).min((kh + 1) * group);
                units.push(Unit {
                    kh,
                    h0,
                    h1,
                    r0,
                    r1,
                    k_lo,
                    k_hi,
                });
                h0 = h1;
            }
        }
    }
    units
}

/// A unit's work in multiply-adds (scores over the union, value sums over each row's keys).
fn unit_cost(shape: &AttnShape, positions: &[u32], u: &Unit) -> u64 {
    let rows = &positions[u.r0..u.r1];
    let own: usize = rows
        .iter()
        .map(|&p| p as usize + 1 - shape.first(p as usize))
        .sum();
    let union = (u.k_hi + 1 - u.k_lo) * rows.len();
    ((union + own) * (u.h1 - u.h0) * shape.head_dim) as u64 + 1
}

/// Scores, softmax and value sums of one unit.
///
/// # Safety
/// `out` points at `positions.len() × n_head·head_dim` floats, of which this call writes only
/// the unit's (row, head) slices, and no other thread writes those.
#[allow(clippy::too_many_arguments)]
unsafe fn run_unit<K: KvRows>(
    level: SimdLevel,
    shape: &AttnShape,
    q: &[f32],
    positions: &[u32],
    kv: &K,
    sinks: Option<&[f32]>,
    u: &Unit,
    kt: &mut [f32],
    scores: &mut [f32],
    out: *mut f32,
) {
    let hd = shape.head_dim;
    let qd = shape.n_head * hd;
    let hn = u.h1 - u.h0;
    let nq = u.n_queries();
    let stride = u.stride();
    let koff = u.kh * hd;
    let q_at = |i: usize| {
        let (r, h) = (u.r0 + i / hn, u.h0 + i % hn);
        r * qd + h * hd
    };
    // Scores: every query of the unit against every key of the union, a key block at a time.
    let mut kb = u.k_lo;
    while kb <= u.k_hi {
        let count = (u.k_hi + 1 - kb).min(KB);
        transpose_keys(level, kv, kb, count, koff, hd, kt);
        let col = kb - u.k_lo;
        let mut i = 0;
        while i < nq {
            let take = (nq - i).min(max_queries(level));
            let mut qs = [std::ptr::null::<f32>(); 8];
            let mut ss = [std::ptr::null_mut::<f32>(); 8];
            for b in 0..take {
                qs[b] = q.as_ptr().add(q_at(i + b));
                ss[b] = scores.as_mut_ptr().add((i + b) * stride + col);
            }
            score_block(level, kt, hd, &qs[..take], &ss[..take]);
            i += take;
        }
        kb += KB;
    }
    // Softmax per query over its own keys.
    for i in 0..nq {
        let (r, h) = (u.r0 + i / hn, u.h0 + i % hn);
        let pos = positions[r] as usize;
        let first = shape.first(pos);
        let row = &mut scores[i * stride + (first - u.k_lo)..i * stride + (pos + 1 - u.k_lo)];
        softmax(level, row, shape.softcap, shape.scale, sinks.map(|s| s[h]));
    }
    // Value sums: a row's heads together, each value vector read once per row.
    for (ri, &pos) in positions[u.r0..u.r1].iter().enumerate() {
        let (r, pos) = (u.r0 + ri, pos as usize);
        let first = shape.first(pos);
        let mut h = 0;
        while h < hn {
            let take = (hn - h).min(max_heads(level));
            let mut ws = [std::ptr::null::<f32>(); 4];
            let mut os = [std::ptr::null_mut::<f32>(); 4];
            for b in 0..take {
                let i = ri * hn + h + b;
                // Weight of key j at ws[b][j - first].
                ws[b] = scores.as_ptr().add(i * stride + (first - u.k_lo));
                os[b] = out.add(r * qd + (u.h0 + h + b) * hd);
            }
            value_sum(level, kv, koff, hd, first, pos, &ws[..take], &os[..take]);
            h += take;
        }
    }
}

/// Key block `kb .. kb + count` (KV head at `koff`) into `kt`: element `d` of key `l` at
/// `d·16 + l`, keys past `count` zero. Pure data movement: the level changes only the speed
/// (a full block at one stride is gathered, one column per `d`).
fn transpose_keys<K: KvRows>(
    level: SimdLevel,
    kv: &K,
    kb: usize,
    count: usize,
    koff: usize,
    hd: usize,
    kt: &mut [f32],
) {
    let kt = &mut kt[..hd * KB];
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 && count == KB {
        let base = kv.key(kb)[koff..koff + hd].as_ptr() as usize;
        let step = (kv.key(kb + 1)[koff..].as_ptr() as usize).wrapping_sub(base);
        let even = step % 4 == 0
            && step / 4 < (i32::MAX as usize) / KB
            && (2..KB)
                .all(|l| kv.key(kb + l)[koff..koff + hd].as_ptr() as usize == base + l * step);
        if even {
            // SAFETY: key `l`'s elements `0 .. hd` are at base + l·step + 4·d (checked above),
            // all inside `kv`'s slices; kt holds hd·16.
            unsafe { x86::gather_keys(level, base as *const f32, step / 4, hd, kt) };
            return;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if level >= SimdLevel::Neon && count == KB {
        let keys: [*const f32; KB] =
            std::array::from_fn(|l| kv.key(kb + l)[koff..koff + hd].as_ptr());
        // SAFETY: each key pointer reads `hd` floats (sliced above); kt holds hd·16.
        unsafe { aarch64::transpose_keys(&keys, hd, kt) };
        return;
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = level;
    for l in 0..KB {
        if l < count {
            let key = &kv.key(kb + l)[koff..koff + hd];
            for (d, &x) in key.iter().enumerate() {
                kt[d * KB + l] = x;
            }
        } else {
            for d in 0..hd {
                kt[d * KB + l] = 0.0;
            }
        }
    }
}

fn max_queries(level: SimdLevel) -> usize {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => 8,
        _ => 4,
    }
}

fn max_heads(level: SimdLevel) -> usize {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => 4,
        _ => 2,
    }
}

// ---------------------------------------------------------------------------------------------
// The exponential

const EXP_LO: f32 = -87.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// 1.5·2²³: adding it rounds to an integer held in the low mantissa bits.
const MAGIC: f32 = 12_582_912.0;
/// ln 2 split so that `n · LN2_HI` is exact for the `n` that occur (Cody–Waite).
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// exp(r) ≈ 1 + r + r²·P(r) on |r| ≤ ln2/2 (Cephes' expf coefficients, highest first).
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` for `x ≤ 0`, the same operations at every level: clamp below at −87 (e^−87 ≈ 1.6e−38,
/// nothing beside a 1 in a softmax), `n = round(x·log2 e)` by the 1.5·2²³ trick, `r = x − n·ln2`
/// in two fused steps, a degree-7 polynomial by fused Horner steps, times `2ⁿ` built in the
/// exponent bits. Within 2 ulp of `exp` on [−87, 0].
#[inline]
pub fn exp_neg(x: f32) -> f32 {
    let x = if x < EXP_LO { EXP_LO } else { x };
    let t = x.mul_add(LOG2E, MAGIC);
    let n = t - MAGIC;
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    let e = (t.to_bits() as i32)
        .wrapping_sub(MAGIC.to_bits() as i32)
        .wrapping_add(127)
        << 23;
    y * f32::from_bits(e as u32)
}

/// The 16 f64 lanes of a softmax sum folded in the fixed tree.
fn fold16(l: &[f64; 16]) -> f64 {
    let a: [f64; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    let b: [f64; 4] = std::array::from_fn(|i| a[i] + a[i + 4]);
    (b[0] + b[2]) + (b[1] + b[3])
}

// ---------------------------------------------------------------------------------------------
// Dispatch

/// 16 scores (key block `kt`, `head_dim × 16`, element `d` of key `l` at `d·16 + l`) for each
/// query `qs[b]` into `ss[b][0 .. 16]`.
///
/// # Safety
/// Each `qs[b]` reads `hd` floats, each `ss[b]` writes 16; `kt` holds `hd·16`.
unsafe fn score_block(level: SimdLevel, kt: &[f32], hd: usize, qs: &[*const f32], ss: &[*mut f32]) {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => match qs.len() {
            8 => x86::scores_512::<8>(kt, hd, qs, ss),
            7 => x86::scores_512::<7>(kt, hd, qs, ss),
            6 => x86::scores_512::<6>(kt, hd, qs, ss),
            5 => x86::scores_512::<5>(kt, hd, qs, ss),
            4 => x86::scores_512::<4>(kt, hd, qs, ss),
            3 => x86::scores_512::<3>(kt, hd, qs, ss),
            2 => x86::scores_512::<2>(kt, hd, qs, ss),
            _ => x86::scores_512::<1>(kt, hd, qs, ss),
        },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => match qs.len() {
            4 => x86::scores_256::<4>(kt, hd, qs, ss),
            3 => x86::scores_256::<3>(kt, hd, qs, ss),
            2 => x86::scores_256::<2>(kt, hd, qs, ss),
            _ => x86::scores_256::<1>(kt, hd, qs, ss),
        },
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon | SimdLevel::Dotprod | SimdLevel::I8mm => match qs.len() {
            4 => aarch64::scores::<4>(kt, hd, qs, ss),
            3 => aarch64::scores::<3>(kt, hd, qs, ss),
            2 => aarch64::scores::<2>(kt, hd, qs, ss),
            _ => aarch64::scores::<1>(kt, hd, qs, ss),
        },
        _ => {
            for (&qp, &sp) in qs.iter().zip(ss) {
                let qv = std::slice::from_raw_parts(qp, hd);
                let s = std::slice::from_raw_parts_mut(sp, KB);
                scores_scalar(kt, qv, s);
            }
        }
    }
}

fn scores_scalar(kt: &[f32], qv: &[f32], s: &mut [f32]) {
    for (l, out) in s.iter_mut().enumerate() {
        let mut acc = 0f32;
        for (d, &x) in qv.iter().enumerate() {
            acc = x.mul_add(kt[d * KB + l], acc);
        }
        *out = acc;
    }
}

/// Turns one query's raw scores into its softmax weights, in place.
fn softmax(level: SimdLevel, row: &mut [f32], cap: Option<f32>, scale: f32, sink: Option<f32>) {
    if row.is_empty() {
        return;
    }
    if let Some(c) = cap {
        for s in row.iter_mut() {
            *s = c * libm::tanhf(*s / c);
        }
    }
    let mut lanes = [0f64; 16];
    let m = match level {
        // SAFETY: the level is at most what the CPU runs (checked in `attend`).
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => unsafe { x86::softmax_512(row, scale, sink, &mut lanes) },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => unsafe { x86::softmax_256(row, scale, sink, &mut lanes) },
        // SAFETY: base Advanced SIMD (every aarch64 core).
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon | SimdLevel::Dotprod | SimdLevel::I8mm => unsafe {
            aarch64::softmax(row, scale, sink, &mut lanes)
        },
        _ => softmax_scalar(row, scale, sink, &mut lanes),
    };
    let mut sum = fold16(&lanes);
    if let Some(s) = sink {
        sum += exp_neg(s - m) as f64;
    }
    let inv = (1.0 / sum) as f32;
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 | SimdLevel::Avx2 => unsafe { x86::scale_256(row, inv) },
        // SAFETY: base Advanced SIMD.
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon | SimdLevel::Dotprod | SimdLevel::I8mm => unsafe {
            aarch64::scale(row, inv)
        },
        _ => row.iter_mut().for_each(|s| *s *= inv),
    }
}

/// Scales the row, writes `exp_neg(s − m)` over it with the sum lanes, returns `m`.
fn softmax_scalar(row: &mut [f32], scale: f32, sink: Option<f32>, lanes: &mut [f64; 16]) -> f32 {
    let mut m = sink.unwrap_or(f32::NEG_INFINITY);
    for s in row.iter_mut() {
        *s *= scale;
        m = m.max(*s);
    }
    for (j, s) in row.iter_mut().enumerate() {
        *s = exp_neg(*s - m);
        lanes[j % 16] += *s as f64;
    }
    m
}

/// `os[b][d] = Σ_j ws[b][j − first] · v_j[koff + d]` over `j = first ..= last` in order.
///
/// # Safety
/// Each `ws[b]` reads `last + 1 − first` floats, each `os[b]` writes `hd`.
#[allow(clippy::too_many_arguments)]
unsafe fn value_sum<K: KvRows>(
    level: SimdLevel,
    kv: &K,
    koff: usize,
    hd: usize,
    first: usize,
    last: usize,
    ws: &[*const f32],
    os: &[*mut f32],
) {
    let simd_dims = match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => {
            let mut d0 = 0;
            while d0 + 16 <= hd {
                let chunks = ((hd - d0) / 16).min(4);
                let o = koff + d0;
                match (ws.len(), chunks) {
                    (4, 4) => x86::values_512::<K, 4, 4>(kv, o, d0, first, last, ws, os),
                    (4, 3) => x86::values_512::<K, 4, 3>(kv, o, d0, first, last, ws, os),
                    (4, 2) => x86::values_512::<K, 4, 2>(kv, o, d0, first, last, ws, os),
                    (4, _) => x86::values_512::<K, 4, 1>(kv, o, d0, first, last, ws, os),
                    (3, 4) => x86::values_512::<K, 3, 4>(kv, o, d0, first, last, ws, os),
                    (3, 3) => x86::values_512::<K, 3, 3>(kv, o, d0, first, last, ws, os),
                    (3, 2) => x86::values_512::<K, 3, 2>(kv, o, d0, first, last, ws, os),
                    (3, _) => x86::values_512::<K, 3, 1>(kv, o, d0, first, last, ws, os),
                    (2, 4) => x86::values_512::<K, 2, 4>(kv, o, d0, first, last, ws, os),
                    (2, 3) => x86::values_512::<K, 2, 3>(kv, o, d0, first, last, ws, os),
                    (2, 2) => x86::values_512::<K, 2, 2>(kv, o, d0, first, last, ws, os),
                    (2, _) => x86::values_512::<K, 2, 1>(kv, o, d0, first, last, ws, os),
                    (_, 4) => x86::values_512::<K, 1, 4>(kv, o, d0, first, last, ws, os),
                    (_, 3) => x86::values_512::<K, 1, 3>(kv, o, d0, first, last, ws, os),
                    (_, 2) => x86::values_512::<K, 1, 2>(kv, o, d0, first, last, ws, os),
                    (_, _) => x86::values_512::<K, 1, 1>(kv, o, d0, first, last, ws, os),
                }
                d0 += chunks * 16;
            }
            d0
        }
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => {
            let mut d0 = 0;
            while d0 + 8 <= hd {
                let chunks = ((hd - d0) / 8).min(4);
                let o = koff + d0;
                match (ws.len(), chunks) {
                    (2, 4) => x86::values_256::<K, 2, 4>(kv, o, d0, first, last, ws, os),
                    (2, 3) => x86::values_256::<K, 2, 3>(kv, o, d0, first, last, ws, os),
                    (2, 2) => x86::values_256::<K, 2, 2>(kv, o, d0, first, last, ws, os),
                    (2, _) => x86::values_256::<K, 2, 1>(kv, o, d0, first, last, ws, os),
                    (_, 4) => x86::values_256::<K, 1, 4>(kv, o, d0, first, last, ws, os),
                    (_, 3) => x86::values_256::<K, 1, 3>(kv, o, d0, first, last, ws, os),
                    (_, 2) => x86::values_256::<K, 1, 2>(kv, o, d0, first, last, ws, os),
                    (_, _) => x86::values_256::<K, 1, 1>(kv, o, d0, first, last, ws, os),
                }
                d0 += chunks * 8;
            }
            d0
        }
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon | SimdLevel::Dotprod | SimdLevel::I8mm => {
            let mut d0 = 0;
            while d0 + 4 <= hd {
                let chunks = ((hd - d0) / 4).min(8);
                let o = koff + d0;
                macro_rules! run {
                    ($($c:literal)*) => {
                        match (ws.len(), chunks) {
                            $((2, $c) => aarch64::values::<K, 2, $c>(kv, o, d0, first, last, ws, os),)*
                            $((_, $c) => aarch64::values::<K, 1, $c>(kv, o, d0, first, last, ws, os),)*
                            _ => unreachable!("1 ..= 8 chunks"),
                        }
                    };
                }
                run!(8 7 6 5 4 3 2 1);
                d0 += chunks * 4;
            }
            d0
        }
        _ => 0,
    };
    if simd_dims < hd {
        for (&wp, &op) in ws.iter().zip(os) {
            let o = std::slice::from_raw_parts_mut(op.add(simd_dims), hd - simd_dims);
            o.iter_mut().for_each(|x| *x = 0.0);
            for j in first..=last {
                let w = *wp.add(j - first);
                let v = &kv.value(j)[koff + simd_dims..koff + hd];
                for (x, &y) in o.iter_mut().zip(v) {
                    *x = w.mul_add(y, *x);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{KvRows, EXP_LO, EXP_P, KB, LN2_HI, LN2_LO, LOG2E, MAGIC};
    use std::arch::x86_64::*;

    /// 16 keys at `base + l·stride` (floats), `hd` elements each, into `kt[d·16 + l]`.
    pub(super) unsafe fn gather_keys(
        level: super::SimdLevel,
        base: *const f32,
        stride: usize,
        hd: usize,
        kt: &mut [f32],
    ) {
        if level >= super::SimdLevel::Avx512 {
            gather_512(base, stride, hd, kt)
        } else {
            gather_256(base, stride, hd, kt)
        }
    }

    #[target_feature(enable = "avx2,fma,avx512f")]
    unsafe fn gather_512(base: *const f32, stride: usize, hd: usize, kt: &mut [f32]) {
        let s = stride as i32;
        let idx = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(s),
        );
        let out = kt.as_mut_ptr();
        for d in 0..hd {
            let v = _mm512_i32gather_ps::<4>(idx, base.add(d));
            _mm512_storeu_ps(out.add(d * KB), v);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn gather_256(base: *const f32, stride: usize, hd: usize, kt: &mut [f32]) {
        let s = stride as i32;
        let idx = _mm256_mullo_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(s),
        );
        let out = kt.as_mut_ptr();
        for d in 0..hd {
            let lo = _mm256_i32gather_ps::<4>(base.add(d), idx);
            let hi = _mm256_i32gather_ps::<4>(base.add(d + 8 * stride), idx);
            _mm256_storeu_ps(out.add(d * KB), lo);
            _mm256_storeu_ps(out.add(d * KB + 8), hi);
        }
    }

    #[target_feature(enable = "avx2,fma,avx512f")]
    pub(super) unsafe fn scores_512<const Q: usize>(
        kt: &[f32],
        hd: usize,
        qs: &[*const f32],
        ss: &[*mut f32],
    ) {
        let k = kt.as_ptr();
        let mut acc = [_mm512_setzero_ps(); Q];
        for d in 0..hd {
            let kv = _mm512_loadu_ps(k.add(d * KB));
            for b in 0..Q {
                acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(*qs[b].add(d)), kv, acc[b]);
            }
        }
        for b in 0..Q {
            _mm512_storeu_ps(ss[b], acc[b]);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_256<const Q: usize>(
        kt: &[f32],
        hd: usize,
        qs: &[*const f32],
        ss: &[*mut f32],
    ) {
        let k = kt.as_ptr();
        let mut lo = [_mm256_setzero_ps(); Q];
        let mut hi = [_mm256_setzero_ps(); Q];
        for d in 0..hd {
            let kl = _mm256_loadu_ps(k.add(d * KB));
            let kh = _mm256_loadu_ps(k.add(d * KB + 8));
            for b in 0..Q {
                let x = _mm256_set1_ps(*qs[b].add(d));
                lo[b] = _mm256_fmadd_ps(x, kl, lo[b]);
                hi[b] = _mm256_fmadd_ps(x, kh, hi[b]);
            }
        }
        for b in 0..Q {
            _mm256_storeu_ps(ss[b], lo[b]);
            _mm256_storeu_ps(ss[b].add(8), hi[b]);
        }
    }

    #[target_feature(enable = "avx2,fma,avx512f")]
    unsafe fn exp_512(x: __m512) -> __m512 {
        let x = _mm512_max_ps(_mm512_set1_ps(EXP_LO), x);
        let magic = _mm512_set1_ps(MAGIC);
        let t = _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), magic);
        let n = _mm512_sub_ps(t, magic);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_P[0]);
        for &c in &EXP_P[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(
            _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
            _mm512_set1_ps(1.0),
        );
        let e = _mm512_sub_epi32(
            _mm512_castps_si512(t),
            _mm512_set1_epi32(MAGIC.to_bits() as i32),
        );
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(e, _mm512_set1_epi32(127)));
        _mm512_mul_ps(y, _mm512_castsi512_ps(e))
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_256(x: __m256) -> __m256 {
        // `max(lo, x)`: x when x is NaN, as the scalar `if x < lo`.
        let x = _mm256_max_ps(_mm256_set1_ps(EXP_LO), x);
        let magic = _mm256_set1_ps(MAGIC);
        let t = _mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), magic);
        let n = _mm256_sub_ps(t, magic);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_P[0]);
        for &c in &EXP_P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let e = _mm256_sub_epi32(
            _mm256_castps_si256(t),
            _mm256_set1_epi32(MAGIC.to_bits() as i32),
        );
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(e, _mm256_set1_epi32(127)));
        _mm256_mul_ps(y, _mm256_castsi256_ps(e))
    }

    /// See `softmax_scalar`; the tail through masks, the same lanes.
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub(super) unsafe fn softmax_512(
        row: &mut [f32],
        scale: f32,
        sink: Option<f32>,
        lanes: &mut [f64; 16],
    ) -> f32 {
        let n = row.len();
        let p = row.as_mut_ptr();
        let sc = _mm512_set1_ps(scale);
        let mut mv = _mm512_set1_ps(sink.unwrap_or(f32::NEG_INFINITY));
        let mut j = 0;
        while j < n {
            let k = mask16(n - j);
            let s = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p.add(j)), sc);
            _mm512_mask_storeu_ps(p.add(j), k, s);
            mv = _mm512_mask_max_ps(mv, k, mv, s);
            j += 16;
        }
        let m = _mm512_reduce_max_ps(mv);
        let mb = _mm512_set1_ps(m);
        let mut lo = _mm512_setzero_pd();
        let mut hi = _mm512_setzero_pd();
        let mut j = 0;
        while j < n {
            let k = mask16(n - j);
            let e = exp_512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p.add(j)), mb));
            _mm512_mask_storeu_ps(p.add(j), k, e);
            let el = _mm512_cvtps_pd(_mm512_castps512_ps256(e));
            let eh = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(e),
            )));
            lo = _mm512_mask_add_pd(lo, k as u8, lo, el);
            hi = _mm512_mask_add_pd(hi, (k >> 8) as u8, hi, eh);
            j += 16;
        }
        _mm512_storeu_pd(lanes.as_mut_ptr(), lo);
        _mm512_storeu_pd(lanes.as_mut_ptr().add(8), hi);
        m
    }

    /// The first `min(n, 16)` lanes.
    #[inline(always)]
    fn mask16(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    /// Lanes `i < n` of 8 set (all ones), the others clear.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mask8(n: usize) -> __m256i {
        let n = n.min(8) as i32;
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    }

    /// See `softmax_scalar`; the tail through masks, the same lanes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax_256(
        row: &mut [f32],
        scale: f32,
        sink: Option<f32>,
        lanes: &mut [f64; 16],
    ) -> f32 {
        let n = row.len();
        let p = row.as_mut_ptr();
        let sc = _mm256_set1_ps(scale);
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut mv = _mm256_set1_ps(sink.unwrap_or(f32::NEG_INFINITY));
        let mut j = 0;
        while j < n {
            let k = mask8(n - j);
            let s = _mm256_mul_ps(_mm256_maskload_ps(p.add(j), k), sc);
            _mm256_maskstore_ps(p.add(j), k, s);
            mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, s, _mm256_castsi256_ps(k)));
            j += 8;
        }
        let mut mm = [0f32; 8];
        _mm256_storeu_ps(mm.as_mut_ptr(), mv);
        let m = mm.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mb = _mm256_set1_ps(m);
        let mut acc = [_mm256_setzero_pd(); 4];
        let mut j = 0;
        let mut half = 0;
        while j < n {
            let k = mask8(n - j);
            let e = exp_256(_mm256_sub_ps(_mm256_maskload_ps(p.add(j), k), mb));
            _mm256_maskstore_ps(p.add(j), k, e);
            // Cleared lanes add +0 (the lanes hold sums of non-negative terms).
            let e = _mm256_and_ps(e, _mm256_castsi256_ps(k));
            let (a, b) = (2 * half, 2 * half + 1);
            acc[a] = _mm256_add_pd(acc[a], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            acc[b] = _mm256_add_pd(acc[b], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
            half ^= 1;
            j += 8;
        }
        for (c, a) in acc.iter().enumerate() {
            _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * c), *a);
        }
        m
    }

    /// `row *= inv`, elementwise.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scale_256(row: &mut [f32], inv: f32) {
        let n = row.len();
        let p = row.as_mut_ptr();
        let iv = _mm256_set1_ps(inv);
        let mut j = 0;
        while j + 8 <= n {
            _mm256_storeu_ps(p.add(j), _mm256_mul_ps(_mm256_loadu_ps(p.add(j)), iv));
            j += 8;
        }
        for s in &mut row[j..] {
            *s *= inv;
        }
    }

    /// Value sums of `H` heads over dims `d0 .. d0 + 16·C` (value offset `o`).
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub(super) unsafe fn values_512<K: KvRows, const H: usize, const C: usize>(
        kv: &K,
        o: usize,
        d0: usize,
        first: usize,
        last: usize,
        ws: &[*const f32],
        os: &[*mut f32],
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; H];
        for j in first..=last {
            let v = kv.value(j)[o..o + 16 * C].as_ptr();
            let mut vv = [_mm512_setzero_ps(); C];
            for (c, x) in vv.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(v.add(16 * c));
            }
            for (a, &wp) in acc.iter_mut().zip(ws) {
                let w = _mm512_set1_ps(*wp.add(j - first));
                for (x, &v) in a.iter_mut().zip(&vv) {
                    *x = _mm512_fmadd_ps(w, v, *x);
                }
            }
        }
        for (a, &op) in acc.iter().zip(os) {
            for (c, x) in a.iter().enumerate() {
                _mm512_storeu_ps(op.add(d0 + 16 * c), *x);
            }
        }
    }

    /// Value sums of `H` heads over dims `d0 .. d0 + 8·C` (value offset `o`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn values_256<K: KvRows, const H: usize, const C: usize>(
        kv: &K,
        o: usize,
        d0: usize,
        first: usize,
        last: usize,
        ws: &[*const f32],
        os: &[*mut f32],
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; H];
        for j in first..=last {
            let v = kv.value(j)[o..o + 8 * C].as_ptr();
            let mut vv = [_mm256_setzero_ps(); C];
            for (c, x) in vv.iter_mut().enumerate() {
                *x = _mm256_loadu_ps(v.add(8 * c));
            }
            for (a, &wp) in acc.iter_mut().zip(ws) {
                let w = _mm256_set1_ps(*wp.add(j - first));
                for (x, &v) in a.iter_mut().zip(&vv) {
                    *x = _mm256_fmadd_ps(w, v, *x);
                }
            }
        }
        for (a, &op) in acc.iter().zip(os) {
            for (c, x) in a.iter().enumerate() {
                _mm256_storeu_ps(op.add(d0 + 8 * c), *x);
            }
        }
    }
}

/// The NEON paths (every aarch64 core; the dotprod and i8mm levels run these too: attention has
/// no 8-bit products). Each follows the scalar definition's operations exactly: `vfmaq_f32` is
/// the scalar `mul_add`, and the lanes of the softmax sum are the scalar's 16 lanes.
#[cfg(target_arch = "aarch64")]
mod aarch64 {
    use super::{KvRows, EXP_LO, EXP_P, KB, LN2_HI, LN2_LO, LOG2E, MAGIC};
    use std::arch::aarch64::*;

    /// 16 keys (`keys[l]`, `hd` floats each) into `kt[d·16 + l]`: 4×4 blocks transposed in
    /// registers (`trn1`/`trn2` on 32- then 64-bit lanes), the last `hd % 4` elements one by one.
    ///
    /// # Safety
    /// Each `keys[l]` reads `hd` floats; `kt` holds `hd·16`.
    pub(super) unsafe fn transpose_keys(keys: &[*const f32; KB], hd: usize, kt: &mut [f32]) {
        let out = kt.as_mut_ptr();
        for l0 in (0..KB).step_by(4) {
            let k = [keys[l0], keys[l0 + 1], keys[l0 + 2], keys[l0 + 3]];
            let mut d = 0;
            while d + 4 <= hd {
                let r0 = vld1q_f32(k[0].add(d));
                let r1 = vld1q_f32(k[1].add(d));
                let r2 = vld1q_f32(k[2].add(d));
                let r3 = vld1q_f32(k[3].add(d));
                // t0 = [r0.0 r1.0 r0.2 r1.2], t1 = [r0.1 r1.1 r0.3 r1.3], likewise t2, t3.
                let t0 = vreinterpretq_f64_f32(vtrn1q_f32(r0, r1));
                let t1 = vreinterpretq_f64_f32(vtrn2q_f32(r0, r1));
                let t2 = vreinterpretq_f64_f32(vtrn1q_f32(r2, r3));
                let t3 = vreinterpretq_f64_f32(vtrn2q_f32(r2, r3));
                let c = [
                    vtrn1q_f64(t0, t2),
                    vtrn1q_f64(t1, t3),
                    vtrn2q_f64(t0, t2),
                    vtrn2q_f64(t1, t3),
                ];
                for (i, c) in c.iter().enumerate() {
                    vst1q_f32(out.add((d + i) * KB + l0), vreinterpretq_f32_f64(*c));
                }
                d += 4;
            }
            for d in d..hd {
                for (i, &p) in k.iter().enumerate() {
                    *out.add(d * KB + l0 + i) = *p.add(d);
                }
            }
        }
    }

    /// The 16 scores of `Q` queries: four accumulators of 4 keys each per query, one fused
    /// step per element `d` in order (the query element taken from a register lane).
    ///
    /// # Safety
    /// As `score_block`.
    pub(super) unsafe fn scores<const Q: usize>(
        kt: &[f32],
        hd: usize,
        qs: &[*const f32],
        ss: &[*mut f32],
    ) {
        let k = kt.as_ptr();
        let mut acc = [[vdupq_n_f32(0.0); 4]; Q];
        macro_rules! step {
            ($d:expr, $qv:expr, $lane:literal) => {{
                let kd = k.add($d * KB);
                let kv = [
                    vld1q_f32(kd),
                    vld1q_f32(kd.add(4)),
                    vld1q_f32(kd.add(8)),
                    vld1q_f32(kd.add(12)),
                ];
                for b in 0..Q {
                    for c in 0..4 {
                        acc[b][c] = vfmaq_laneq_f32::<$lane>(acc[b][c], kv[c], $qv[b]);
                    }
                }
            }};
        }
        let mut d = 0;
        while d + 4 <= hd {
            let qv: [float32x4_t; Q] = std::array::from_fn(|b| vld1q_f32(qs[b].add(d)));
            step!(d, qv, 0);
            step!(d + 1, qv, 1);
            step!(d + 2, qv, 2);
            step!(d + 3, qv, 3);
            d += 4;
        }
        while d < hd {
            let qv: [float32x4_t; Q] = std::array::from_fn(|b| vld1q_dup_f32(qs[b].add(d)));
            step!(d, qv, 0);
            d += 1;
        }
        for b in 0..Q {
            for c in 0..4 {
                vst1q_f32(ss[b].add(4 * c), acc[b][c]);
            }
        }
    }

    /// [`super::exp_neg`] on four lanes, the same operations.
    #[inline(always)]
    unsafe fn exp4(x: float32x4_t) -> float32x4_t {
        let lo = vdupq_n_f32(EXP_LO);
        // `x < lo ? lo : x`, as the scalar (a NaN stays).
        let x = vbslq_f32(vcltq_f32(x, lo), lo, x);
        let magic = vdupq_n_f32(MAGIC);
        let t = vfmaq_f32(magic, x, vdupq_n_f32(LOG2E));
        let n = vsubq_f32(t, magic);
        let r = vfmaq_f32(x, n, vdupq_n_f32(-LN2_HI));
        let r = vfmaq_f32(r, n, vdupq_n_f32(-LN2_LO));
        let mut p = vdupq_n_f32(EXP_P[0]);
        for &c in &EXP_P[1..] {
            p = vfmaq_f32(vdupq_n_f32(c), p, r);
        }
        let y = vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), vdupq_n_f32(1.0));
        let e = vsubq_s32(
            vreinterpretq_s32_f32(t),
            vdupq_n_s32(MAGIC.to_bits() as i32),
        );
        let e = vshlq_n_s32::<23>(vaddq_s32(e, vdupq_n_s32(127)));
        vmulq_f32(y, vreinterpretq_f32_s32(e))
    }

    /// See `softmax_scalar`: 4 scores a step for the scale and the maximum (`fmaxnm`, which
    /// like `f32::max` ignores a NaN) and for the exponentials, then 16 a step for the 16 f64
    /// lanes (8 vectors of 2); the last `n % 16` scores one by one into their lanes.
    ///
    /// # Safety
    /// Base Advanced SIMD.
    pub(super) unsafe fn softmax(
        row: &mut [f32],
        scale: f32,
        sink: Option<f32>,
        lanes: &mut [f64; 16],
    ) -> f32 {
        let n = row.len();
        let (src, dst) = read_write(row);
        let sc = vdupq_n_f32(scale);
        let mut mv = vdupq_n_f32(sink.unwrap_or(f32::NEG_INFINITY));
        let mut j = 0;
        while j + 4 <= n {
            let s = vmulq_f32(vld1q_f32(src.add(j)), sc);
            vst1q_f32(dst.add(j), s);
            mv = vmaxnmq_f32(mv, s);
            j += 4;
        }
        let mut m = vmaxnmvq_f32(mv);
        for s in &mut row[j..] {
            *s *= scale;
            m = m.max(*s);
        }
        let mb = vdupq_n_f32(m);
        // Taken again: the tail above borrowed the row.
        let (src, dst) = read_write(row);
        // The exponentials 4 a step, then their sum 16 a step: one pass doing both holds more
        // live vectors than NEON has registers (16 scores in flight beside 8 sum vectors and
        // the constants) and spilled.
        let mut j = 0;
        while j + 4 <= n {
            vst1q_f32(dst.add(j), exp4(vsubq_f32(vld1q_f32(src.add(j)), mb)));
            j += 4;
        }
        for s in &mut row[j..] {
            *s = super::exp_neg(*s - m);
        }
        let p = row.as_ptr();
        let mut acc = [vdupq_n_f64(0.0); 8];
        let mut j = 0;
        while j + 16 <= n {
            for c in 0..4 {
                let e = vld1q_f32(p.add(j + 4 * c));
                acc[2 * c] = vaddq_f64(acc[2 * c], vcvt_f64_f32(vget_low_f32(e)));
                acc[2 * c + 1] = vaddq_f64(acc[2 * c + 1], vcvt_high_f64_f32(e));
            }
            j += 16;
        }
        for (c, a) in acc.iter().enumerate() {
            vst1q_f64(lanes.as_mut_ptr().add(2 * c), *a);
        }
        for (l, s) in row[j..].iter().enumerate() {
            lanes[l] += *s as f64;
        }
        m
    }

    /// The row's start as two pointers the compiler cannot prove equal, one to read through and
    /// one to write through. With one pointer the compiler folds its increment into the store
    /// (`str q, [x], #16`), and the next load's address then waits for the store's data in
    /// llvm-mca's models of the cores (an instruction issues when all its operands are ready),
    /// which serialises the iterations of the exponential loop (56 cycles per 4 scores there
    /// instead of 13 on Neoverse-N2).
    #[inline(always)]
    fn read_write(row: &mut [f32]) -> (*const f32, *mut f32) {
        let w = row.as_mut_ptr();
        (std::hint::black_box(w) as *const f32, w)
    }

    /// `row *= inv`, elementwise.
    ///
    /// # Safety
    /// Base Advanced SIMD.
    pub(super) unsafe fn scale(row: &mut [f32], inv: f32) {
        let n = row.len();
        let (src, dst) = read_write(row);
        let iv = vdupq_n_f32(inv);
        let mut j = 0;
        while j + 4 <= n {
            vst1q_f32(dst.add(j), vmulq_f32(vld1q_f32(src.add(j)), iv));
            j += 4;
        }
        for s in &mut row[j..] {
            *s *= inv;
        }
    }

    /// Value sums of `H` heads over dims `d0 .. d0 + 4·C` (value offset `o`): per key, the
    /// `C` value vectors loaded once for the `H` heads, one fused step each.
    ///
    /// # Safety
    /// As `value_sum`.
    pub(super) unsafe fn values<K: KvRows, const H: usize, const C: usize>(
        kv: &K,
        o: usize,
        d0: usize,
        first: usize,
        last: usize,
        ws: &[*const f32],
        os: &[*mut f32],
    ) {
        let mut acc = [[vdupq_n_f32(0.0); C]; H];
        for j in first..=last {
            let v = kv.value(j)[o..o + 4 * C].as_ptr();
            let vv: [float32x4_t; C] = std::array::from_fn(|c| vld1q_f32(v.add(4 * c)));
            for (a, &wp) in acc.iter_mut().zip(ws) {
                let w = vld1q_dup_f32(wp.add(j - first));
                for (x, &v) in a.iter_mut().zip(&vv) {
                    *x = vfmaq_f32(*x, w, v);
                }
            }
        }
        for (a, &op) in acc.iter().zip(os) {
            for (c, x) in a.iter().enumerate() {
                vst1q_f32(op.add(d0 + 4 * c), *x);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::values;
    use super::*;

    /// A KV memory holding positions `0 .. len`.
    struct Mem {
        k: Vec<f32>,
        v: Vec<f32>,
        kv_dim: usize,
    }

    impl KvRows for Mem {
        fn key(&self, pos: usize) -> &[f32] {
            &self.k[pos * self.kv_dim..(pos + 1) * self.kv_dim]
        }
        fn value(&self, pos: usize) -> &[f32] {
            &self.v[pos * self.kv_dim..(pos + 1) * self.kv_dim]
        }
    }

    struct Case {
        shape: AttnShape,
        positions: Vec<u32>,
        q: Vec<f32>,
        mem: Mem,
        sinks: Option<Vec<f32>>,
    }

    impl Case {
        /// `n` consecutive rows ending at position `last`.
        #[allow(clippy::too_many_arguments)]
        fn new(
            seed: u64,
            nh: usize,
            nkv: usize,
            hd: usize,
            n: usize,
            last: usize,
            window: Option<usize>,
            softcap: Option<f32>,
            sinks: bool,
        ) -> Case {
            let kv_dim = nkv * hd;
            let len = last + 1;
            // Keys scaled so scores spread over several units (a softmax with real contrast).
            let ks = 2.5 / (hd as f32).sqrt().sqrt();
            Case {
                shape: AttnShape {
                    n_head: nh,
                    n_head_kv: nkv,
                    head_dim: hd,
                    scale: 1.0 / (hd as f32).sqrt(),
                    window,
                    softcap,
                },
                positions: (len - n..len).map(|p| p as u32).collect(),
                q: values(seed, n * nh * hd, ks),
                mem: Mem {
                    k: values(seed + 1, len * kv_dim, ks),
                    v: values(seed + 2, len * kv_dim, 1.0),
                    kv_dim,
                },
                sinks: sinks.then(|| values(seed + 3, nh, 2.0)),
            }
        }

        fn run(&self, level: SimdLevel, threads: usize) -> Vec<f32> {
            self.run_rows(level, threads, 0, self.positions.len())
        }

        /// Rows `r0 .. r1` of the case as their own batch.
        fn run_rows(&self, level: SimdLevel, threads: usize, r0: usize, r1: usize) -> Vec<f32> {
            let qd = self.shape.n_head * self.shape.head_dim;
            let pool = ThreadPool::new(threads);
            let mut out = vec![f32::NAN; (r1 - r0) * qd];
            let mut scratch = Vec::new();
            attend(
                &pool,
                level,
                &self.shape,
                &self.q[r0 * qd..r1 * qd],
                &self.positions[r0..r1],
                &self.mem,
                self.sinks.as_deref(),
                &mut scratch,
                &mut out,
            );
            out
        }

        /// Plain softmax attention in f64.
        fn reference(&self) -> Vec<f64> {
            let s = &self.shape;
            let (nh, hd) = (s.n_head, s.head_dim);
            let group = nh / s.n_head_kv;
            let mut out = Vec::new();
            for (r, &p) in self.positions.iter().enumerate() {
                let p = p as usize;
                let first = s.first(p);
                for h in 0..nh {
                    let qv = &self.q[(r * nh + h) * hd..(r * nh + h + 1) * hd];
                    let ko = (h / group) * hd;
                    let sc: Vec<f64> = (first..=p)
                        .map(|j| {
                            let k = &self.mem.key(j)[ko..ko + hd];
                            let mut d: f64 =
                                qv.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum();
                            if let Some(c) = s.softcap {
                                d = c as f64 * (d / c as f64).tanh();
                            }
                            d * s.scale as f64
                        })
                        .collect();
                    let sink = self.sinks.as_ref().map(|v| v[h] as f64);
                    let m = sc.iter().copied().fold(sink.unwrap_or(f64::MIN), f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                    let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |x| (x - m).exp());
                    for d in 0..hd {
                        let v: f64 = (first..=p)
                            .zip(&e)
                            .map(|(j, w)| w * self.mem.value(j)[ko + d] as f64)
                            .sum();
                        out.push(v / sum);
                    }
                }
            }
            out
        }
    }

    fn cases() -> Vec<(String, Case)> {
        let mut v = Vec::new();
        let mut seed = 100;
        // (heads, kv heads, head_dim, rows, last position, window, softcap, sinks)
        #[allow(clippy::type_complexity)]
        let shapes: &[(
            usize,
            usize,
            usize,
            usize,
            usize,
            Option<usize>,
            Option<f32>,
            bool,
        )] = &[
            (16, 4, 64, 37, 36, None, None, false),
            (32, 4, 128, 9, 40, None, None, false),
            (8, 8, 24, 19, 50, None, None, false),
            (6, 2, 7, 5, 4, None, None, false),
            (4, 1, 72, 1, 130, None, None, false),
            (4, 2, 33, 23, 60, Some(17), None, false),
            (8, 2, 64, 40, 39, Some(5), None, true),
            (8, 4, 64, 13, 20, None, Some(5.0), true),
            (2, 1, 80, 3, 2, Some(1), Some(3.0), true),
            (12, 3, 16, 70, 69, None, None, true),
        ];
        for &(nh, nkv, hd, n, last, w, cap, sinks) in shapes {
            seed += 10;
            let name = format!(
                "heads {nh}/{nkv} hd {hd} rows {n} last {last} window {w:?} softcap {cap:?} sinks {sinks}"
            );
            v.push((name, Case::new(seed, nh, nkv, hd, n, last, w, cap, sinks)));
        }
        v
    }

    #[test]
    fn exp_neg_is_within_two_ulp_of_exp() {
        let mut worst = 0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let got = exp_neg(x) as f64;
            let want = (x as f64).exp();
            let ulp = (want as f32).to_bits();
            let ulp = (f32::from_bits(ulp + 1) - f32::from_bits(ulp)) as f64;
            worst = worst.max((got - want).abs() / ulp);
        }
        assert!(worst <= 2.0, "exp_neg off by {worst} ulp");
        assert_eq!(exp_neg(0.0), 1.0);
        assert!(exp_neg(-200.0) < 1e-37 && exp_neg(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn every_simd_level_gives_the_scalar_bits() {
        for (name, c) in cases() {
            let want = c.run(SimdLevel::Scalar, 1);
            for level in SimdLevel::available() {
                let got = c.run(level, 2);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{name}: {} element {i}: {a} vs scalar {b}",
                        level.name()
                    );
                }
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_as_in_any_batch_and_thread_count() {
        for (name, c) in cases() {
            let n = c.positions.len();
            let qd = c.shape.n_head * c.shape.head_dim;
            for level in SimdLevel::available() {
                let whole = c.run(level, 1);
                for threads in [2, 3] {
                    assert_eq!(
                        c.run(level, threads)
                            .iter()
                            .map(|x| x.to_bits())
                            .collect::<Vec<_>>(),
                        whole.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "{name}: {} with {threads} threads",
                        level.name()
                    );
                }
                // Each row alone (a decode step), and the rows split into uneven batches.
                for r in 0..n {
                    let alone = c.run_rows(level, 2, r, r + 1);
                    let a: Vec<u32> = alone.iter().map(|x| x.to_bits()).collect();
                    let w: Vec<u32> = whole[r * qd..(r + 1) * qd]
                        .iter()
                        .map(|x| x.to_bits())
                        .collect();
                    assert_eq!(a, w, "{name}: {} row {r} alone", level.name());
                }
                let cut = n / 3;
                let mut parts = c.run_rows(level, 3, 0, cut);
                parts.extend(c.run_rows(level, 1, cut, n));
                assert_eq!(
                    parts.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    whole.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{name}: {} split at {cut}",
                    level.name()
                );
            }
        }
    }

    #[test]
    fn attention_matches_a_plain_f64_softmax() {
        for (name, c) in cases() {
            let want = c.reference();
            let got = c.run(simd_level_for_tests(), 2);
            assert_eq!(got.len(), want.len());
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                let err = (*a as f64 - b).abs();
                assert!(
                    err <= 2e-6 * (1.0 + b.abs()) * (c.shape.head_dim as f64).sqrt(),
                    "{name}: element {i}: {a} vs f64 {b} (error {err:e})"
                );
            }
        }
    }

    fn simd_level_for_tests() -> SimdLevel {
        super::super::simd_level()
    }
}
