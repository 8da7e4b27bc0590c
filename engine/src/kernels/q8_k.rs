//! Q8_K: the activation format for K-quant weights — blocks of 256 int8 with an f32 scale and
//! the 16 sums of each run of 16 values (so a K-quant dot can subtract its minimums or offsets
//! with 16 multiplies instead of 256).
//!
//! Only ever produced by us (for activations), never read from a weight file, so it is an
//! [`Activation`], not a weight format.

use super::format::Activation;
use super::{max_by_magnitude, nearest_int, ActBuf, ActFormat};

/// Values per super-block (all K-quants).
pub(super) const QK_K: usize = 256;

/// Activations per K-quant `dot_group` call (prefill: one unpacking of each weight block serves
/// this many tokens).
pub(super) const GROUP: usize = 4;

/// Activations per `dot_wide` call: one per i32 lane of a 512-bit vector.
pub(super) const WIDE: usize = 16;

/// One Q8_K block.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct BlockQ8K {
    pub(super) d: f32,
    pub(super) qs: [i8; QK_K],
    /// `bsums[j]` = Σ qs[16j .. 16j + 16].
    pub(super) bsums: [i16; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);

impl BlockQ8K {
    pub(super) const ZERO: BlockQ8K = BlockQ8K {
        d: 0.0,
        qs: [0; QK_K],
        bsums: [0; QK_K / 16],
    };
}

/// llama.cpp's reference quantizer: the value of largest magnitude maps to ∓127 (the scale
/// takes its sign), values round to nearest, ties to even.
pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ8K]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
        let max = max_by_magnitude(x);
        // |max| is the absmax; only 0 when every value is.
        if max == 0.0 {
            *b = BlockQ8K::ZERO;
            continue;
        }
        let iscale = -127.0 / max;
        for (q, v) in b.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).clamp(-127, 127) as i8;
        }
        for (s, run) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = run.iter().map(|q| *q as i16).sum();
        }
        b.d = 1.0 / iscale;
    }
}

/// [`quantize`] at the best level this CPU runs: the same bytes (the tests compare every
/// level on random and edge inputs), AVX2 where available (also at AVX-512: 256-bit vectors
/// keep up with the loads here), NEON on aarch64 (`q8_k/neon.rs`).
fn quantize_fast(src: &[f32], dst: &mut [BlockQ8K]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd_level() >= super::SimdLevel::Avx2 {
        // SAFETY: the CPU has AVX2 (the detected level says so).
        unsafe { avx2::quantize(src, dst) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if super::simd_level() >= super::SimdLevel::Neon {
        neon::quantize(src, dst);
        return;
    }
    quantize(src, dst)
}

#[cfg(target_arch = "aarch64")]
mod neon;

/// [`quantize`] eight values a step. The scalar's arithmetic lane by lane: the absmax by
/// `vmaxps` (a NaN lane keeps the running maximum, as the scalar's `>` skips it), the first
/// value reaching it as the signed maximum, the same f32 product and the same rounding
/// (adding 1.5 · 2^23 and reading the low mantissa bits). Where that rounding would not hold
/// — a product of magnitude 2^21 or more, infinite or NaN (an infinite or NaN input, a scale
/// overflowing on a denormal maximum) — the block is done again by the scalar code.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BlockQ8K, QK_K};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize(src: &[f32], dst: &mut [BlockQ8K]) {
        for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
            // SAFETY: the caller's; `x` is one whole block.
            if !unsafe { block(x, b) } {
                super::quantize(x, std::slice::from_mut(b));
            }
        }
    }

    /// One block of 256 values; false (and `b` half written) where the scalar code must redo
    /// it.
    ///
    /// # Safety
    /// AVX2; `x.len() == QK_K`.
    #[target_feature(enable = "avx2")]
    unsafe fn block(x: &[f32], b: &mut BlockQ8K) -> bool {
        debug_assert_eq!(x.len(), QK_K);
        let p = x.as_ptr();
        let sign = _mm256_set1_ps(-0.0);
        let mut acc = _mm256_setzero_ps();
        for i in 0..QK_K / 8 {
            // SAFETY (every load here): 8 values at 8·i < QK_K = x.len().
            let v = unsafe { _mm256_loadu_ps(p.add(8 * i)) };
            acc = _mm256_max_ps(_mm256_andnot_ps(sign, v), acc);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
        if amax == 0.0 {
            *b = BlockQ8K::ZERO;
            return true;
        }
        let amax_v = _mm256_set1_ps(amax);
        let mut max = amax;
        for i in 0..QK_K / 8 {
            let v = unsafe { _mm256_loadu_ps(p.add(8 * i)) };
            let hit = _mm256_cmp_ps(_mm256_andnot_ps(sign, v), amax_v, _CMP_EQ_OQ);
            let mask = _mm256_movemask_ps(hit);
            if mask != 0 {
                max = x[8 * i + mask.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0 / max;
        let k = Consts {
            scale: _mm256_set1_ps(iscale),
            sign,
            magic: _mm256_set1_ps(12_582_912.0),
            limit: _mm256_set1_ps(2_097_152.0),
            mant: _mm256_set1_epi32(0x007f_ffff),
            bias: _mm256_set1_epi32(0x0040_0000),
            lo: _mm256_set1_epi32(-127),
            hi: _mm256_set1_epi32(127),
        };
        let mut in_range = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        // The i32 lanes to pack in order: [0, 4, 1, 5, 2, 6, 3, 7] undoes the per-128-bit-lane
        // interleaving of the two packs.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let qs = b.qs.as_mut_ptr();
        let sums = b.bsums.as_mut_ptr();
        for half in 0..2 {
            // Per run of 16 values (two vectors), its lanes' sums; 8 runs per half.
            let mut runs = [_mm256_setzero_si256(); 8];
            for g in 0..4 {
                let i = half * 16 + g * 4;
                // SAFETY: values 8·i .. 8·i + 32 lie inside the block.
                let (a, bb, c, d) = unsafe {
                    (
                        quant(&k, _mm256_loadu_ps(p.add(8 * i)), &mut in_range),
                        quant(&k, _mm256_loadu_ps(p.add(8 * i + 8)), &mut in_range),
                        quant(&k, _mm256_loadu_ps(p.add(8 * i + 16)), &mut in_range),
                        quant(&k, _mm256_loadu_ps(p.add(8 * i + 24)), &mut in_range),
                    )
                };
                runs[2 * g] = _mm256_add_epi32(a, bb);
                runs[2 * g + 1] = _mm256_add_epi32(c, d);
                let packed =
                    _mm256_packs_epi16(_mm256_packs_epi32(a, bb), _mm256_packs_epi32(c, d));
                let packed = _mm256_permutevar8x32_epi32(packed, order);
                // SAFETY: 32 bytes at 8·i < QK_K inside `qs`.
                unsafe { _mm256_storeu_si256(qs.add(8 * i) as *mut __m256i, packed) };
            }
            let h01 = _mm256_hadd_epi32(runs[0], runs[1]);
            let h23 = _mm256_hadd_epi32(runs[2], runs[3]);
            let h45 = _mm256_hadd_epi32(runs[4], runs[5]);
            let h67 = _mm256_hadd_epi32(runs[6], runs[7]);
            let (h03, h47) = (_mm256_hadd_epi32(h01, h23), _mm256_hadd_epi32(h45, h67));
            // Lane-low and lane-high halves of runs 0..3 and 4..7, added: the 8 run sums.
            let t = _mm256_add_epi32(
                _mm256_permute2x128_si256(h03, h47, 0x20),
                _mm256_permute2x128_si256(h03, h47, 0x31),
            );
            let s16 = _mm_packs_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            // SAFETY: 8 i16 at 8·half inside `bsums` (16 of them).
            unsafe { _mm_storeu_si128(sums.add(8 * half) as *mut __m128i, s16) };
        }
        if _mm256_movemask_ps(in_range) != 0xff {
            return false;
        }
        b.d = 1.0 / iscale;
        true
    }

    /// A block's constants for [`quant`].
    struct Consts {
        scale: __m256,
        sign: __m256,
        magic: __m256,
        limit: __m256,
        mant: __m256i,
        bias: __m256i,
        lo: __m256i,
        hi: __m256i,
    }

    /// Eight values times the block's scale, rounded to nearest (ties to even) and clamped to
    /// ±127 as i32 lanes; `in_range` loses the lanes whose product the rounding does not hold
    /// for.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn quant(k: &Consts, x: __m256, in_range: &mut __m256) -> __m256i {
        let v = _mm256_mul_ps(k.scale, x);
        let ok = _mm256_cmp_ps(_mm256_andnot_ps(k.sign, v), k.limit, _CMP_LT_OQ);
        *in_range = _mm256_and_ps(*in_range, ok);
        let r = _mm256_castps_si256(_mm256_add_ps(v, k.magic));
        let q = _mm256_sub_epi32(_mm256_and_si256(r, k.mant), k.bias);
        _mm256_min_epi32(_mm256_max_epi32(q, k.lo), k.hi)
    }
}

#[cfg(test)]
pub(super) fn dequantize(src: &[BlockQ8K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        for (o, q) in y.iter_mut().zip(&b.qs) {
            *o = b.d * *q as f32;
        }
    }
}

/// Q8_K blocks as an [`Activation`] (for the 256-value weight formats).
pub(crate) struct ActQ8K;

impl Activation for ActQ8K {
    const FORMAT: ActFormat = ActFormat::Q8K;
    const BLOCK: usize = QK_K;
    type View = [BlockQ8K];

    fn prepare(x: &[f32], buf: &mut ActBuf) {
        buf.q8_k.resize(x.len() / QK_K, BlockQ8K::ZERO);
        quantize_fast(x, &mut buf.q8_k);
    }

    fn view(buf: &ActBuf) -> &[BlockQ8K] {
        &buf.q8_k
    }
}

/// Which of the block sums a [`Lanes`] kernel reads (only those are packed).
#[cfg(target_arch = "x86_64")]
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub(super) enum LaneSums {
    /// `sums[4b + i][t]`: the pair sums `bsum_4i + bsum_4i+1` and `bsum_4i+2 + bsum_4i+3` as
    /// two i16 (each ≤ 2 · 16 · 127): one per sub-block of 32 (Q4_K's minimums).
    Pairs,
    /// `sums[8b + k][t]`: `bsum_2k` and `bsum_2k+1` as two i16, the block's 16 sums as they
    /// lie in memory (Q6_K's offset).
    Runs,
}

/// Up to [`WIDE`] tokens' Q8_K blocks with the tokens in vector lanes, for the kernels that
/// take one token per i32 lane: `qs[64b + g][t]` is values `4g .. 4g + 4` of block `b` of token
/// `t` (4 int8 as one i32); `sums` the block sums in the layout of [`LaneSums`]; `d[b][t]` the
/// scale. Lanes past the last token are zero. Kept per thread ([`LaneCache`]): it never
/// reallocates once grown, and a later call on the same tokens (a product's row bands are one
/// call each) reuses it.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
pub(super) struct Lanes {
    pub qs: Vec<[i32; WIDE]>,
    pub sums: Vec<[i32; WIDE]>,
    pub d: Vec<[f32; WIDE]>,
    /// What the lanes hold: the tokens' [`ActBuf::stamp`]s, the block count and the layout.
    key: (Vec<u64>, usize, Option<LaneSums>),
}

/// Packed batches of tokens kept per thread by a lanes kernel ([`PackRing`]): a task runs
/// every batch of a product over its row band in turn, so one per batch of a 128-token prompt.
const CACHED_BATCHES: usize = 8;

/// The last [`CACHED_BATCHES`] packings one thread made, the oldest replaced first: what every
/// lanes kernel keeps its packed tokens in (Q8_K's [`Lanes`] here, Q8_0's its own).
pub(super) struct PackRing<T> {
    slots: Vec<T>,
    next: usize,
}

impl<T> Default for PackRing<T> {
    fn default() -> Self {
        PackRing {
            slots: Vec::new(),
            next: 0,
        }
    }
}

impl<T: Default> PackRing<T> {
    /// The slot that `holds` what the caller needs, else a fresh slot (or, once there are
    /// [`CACHED_BATCHES`], the oldest) after `fill` packed it.
    pub fn get(&mut self, holds: impl Fn(&T) -> bool, fill: impl FnOnce(&mut T)) -> &T {
        if let Some(i) = self.slots.iter().position(holds) {
            return &self.slots[i];
        }
        let i = if self.slots.len() < CACHED_BATCHES {
            self.slots.push(T::default());
            self.slots.len() - 1
        } else {
            let i = self.next;
            self.next = (i + 1) % CACHED_BATCHES;
            i
        };
        fill(&mut self.slots[i]);
        &self.slots[i]
    }
}

/// Runs a lanes kernel over rows `rows` of `w` (`row_bytes` each), `STEP` rows at a time, then
/// halving the step for the rows left (4, 2, 1 or 2, 1): `step(r, n)` computes rows `r .. r +
/// n` for every token and returns their lanes (the first `n` entries); token `t`'s result for
/// row `r` lands in `out[t][r − rows.start]`. Before each step the next step's rows are
/// prefetched: an expert's rows come from memory, and the hardware prefetchers stop at each
/// 4 KiB page. On `small` Q4_K_M that only moved the wait out of the row unpacking (its share
/// of the samples 6.8 → 2.4 %) into the kernel, CPU time unchanged (docs/benchmarks.md, "Row
/// unpacking, grouped Q2_K/Q3_K, prefetching"); wider rows read from memory may gain.
#[inline(always)]
pub(super) fn by_row_steps<const STEP: usize>(
    w: &[u8],
    row_bytes: usize,
    rows: std::ops::Range<usize>,
    out: &mut [&mut [f32]],
    mut step: impl FnMut(usize, usize) -> [[f32; WIDE]; STEP],
) {
    let mut r = rows.start;
    while r < rows.end {
        let mut n = STEP;
        while n > rows.end - r {
            n /= 2;
        }
        super::format::prefetch_lines(w, (r + n) * row_bytes, n * row_bytes);
        let v = step(r, n);
        for (k, o) in out.iter_mut().enumerate() {
            for i in 0..n {
                o[r + i - rows.start] = v[i][k];
            }
        }
        r += n;
    }
}

/// The Q8_K packings of one thread.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
pub(super) struct LaneCache(PackRing<Lanes>);

#[cfg(target_arch = "x86_64")]
impl LaneCache {
    /// The first `nb` blocks of each of `acts` (at most [`WIDE`], each prepared as Q8_K with
    /// at least `nb` blocks) packed with the block sums laid out as `sums` says: a slot that
    /// already holds exactly that, else the oldest slot repacked.
    pub fn pack_for(&mut self, acts: &[&ActBuf], nb: usize, sums: LaneSums) -> &Lanes {
        self.0
            .get(|l| l.holds(acts, nb, sums), |l| l.pack_for(acts, nb, sums))
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes {
    /// True when the lanes hold exactly these tokens' first `nb` blocks in layout `sums`.
    fn holds(&self, acts: &[&ActBuf], nb: usize, sums: LaneSums) -> bool {
        let (stamps, key_nb, key_sums) = &self.key;
        *key_nb == nb
            && *key_sums == Some(sums)
            && stamps.len() == acts.len()
            && stamps.iter().zip(acts).all(|(s, a)| *s == a.stamp())
    }

    /// Packs the first `nb` blocks of each of `acts` (see [`LaneCache::pack_for`]) and
    /// records what they are.
    fn pack_for(&mut self, acts: &[&ActBuf], nb: usize, sums: LaneSums) {
        let (stamps, key_nb, key_sums) = &mut self.key;
        stamps.clear();
        stamps.extend(acts.iter().map(|a| a.stamp()));
        (*key_nb, *key_sums) = (nb, Some(sums));
        let views: Vec<&[BlockQ8K]> = acts.iter().map(|a| ActQ8K::view(a)).collect();
        self.pack(&views, nb, sums);
    }

    /// Packs the first `nb` blocks of each of `acts` (at most [`WIDE`], each at least `nb`
    /// blocks long), with the block sums laid out as `sums` says.
    fn pack(&mut self, acts: &[&[BlockQ8K]], nb: usize, sums: LaneSums) {
        let per_block = match sums {
            LaneSums::Pairs => 4,
            LaneSums::Runs => 8,
        };
        self.qs.clear();
        self.qs.resize(nb * 64, [0; WIDE]);
        self.sums.clear();
        self.sums.resize(nb * per_block, [0; WIDE]);
        self.d.clear();
        self.d.resize(nb, [0.0; WIDE]);
        let pair = |lo: i16, hi: i16| (lo as u16 as i32) | ((hi as u16 as i32) << 16);
        for (t, a) in acts.iter().enumerate().take(WIDE) {
            for (b, y) in a[..nb].iter().enumerate() {
                let qs = &mut self.qs[64 * b..64 * b + 64];
                for (g, q) in y.qs.chunks_exact(4).enumerate() {
                    qs[g][t] = i32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]);
                }
                let out = &mut self.sums[per_block * b..per_block * (b + 1)];
                match sums {
                    LaneSums::Pairs => {
                        for (i, o) in out.iter_mut().enumerate() {
                            let s = &y.bsums[4 * i..4 * i + 4];
                            o[t] = pair(s[0] + s[1], s[2] + s[3]);
                        }
                    }
                    LaneSums::Runs => {
                        for (k, o) in out.iter_mut().enumerate() {
                            o[t] = pair(y.bsums[2 * k], y.bsums[2 * k + 1]);
                        }
                    }
                }
                self.d[b][t] = y.d;
            }
        }
    }
}

/// AVX2 building blocks shared by the K-quant dots.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    /// `pshufb` masks over 8 i16 scales held in both 128-bit lanes: mask `t` fills the low
    /// lane's i16s with scale `2t` and the high lane's with scale `2t + 1` (the two runs of 16
    /// of a group of 32 values).
    pub const SCALE_PAIR: [[u8; 32]; 4] = {
        let mut m = [[0u8; 32]; 4];
        let mut t = 0;
        while t < 4 {
            let mut i = 0;
            while i < 32 {
                let s = 2 * t + i / 16;
                m[t][i] = (2 * s + i % 2) as u8;
                i += 1;
            }
            t += 1;
        }
        m
    };

    /// The [`super::super::reduce8`] of a vector's 8 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn fold(v: __m256) -> f32 {
        let mut lanes = [0f32; 8];
        // SAFETY: 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        super::super::reduce8(&lanes)
    }

    /// The sum of the 8 i32 lanes (exact, wrapping like the scalar code never needs to).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    #[test]
    fn round_trip_within_half_a_step_and_bsums_match() {
        let x = values(4, QK_K * 16, 1.0);
        let q = q8_k_blocks(&x);
        let mut back = vec![0f32; x.len()];
        dequantize(&q, &mut back);
        for (xb, yb) in x.chunks(QK_K).zip(back.chunks(QK_K)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (p, r) in xb.iter().zip(yb) {
                assert!((p - r).abs() <= amax / 254.0 * 1.0001, "{p} {r}");
            }
        }
        for b in &q {
            for (j, s) in b.bsums.iter().enumerate() {
                let want: i32 = b.qs[16 * j..16 * j + 16].iter().map(|v| *v as i32).sum();
                assert_eq!(*s as i32, want);
            }
        }
        assert_eq!(q8_k_blocks(&[0.0; QK_K])[0], BlockQ8K::ZERO);
    }

    /// The bytes of blocks: scale bits, quants, sums (a NaN or −0 scale compares by its bits).
    fn block_bytes(b: &[BlockQ8K]) -> Vec<(u32, [i8; QK_K], [i16; QK_K / 16])> {
        b.iter().map(|b| (b.d.to_bits(), b.qs, b.bsums)).collect()
    }

    /// Blocks that stress the quantizer: random at many scales, zeros, ±0, ±f32::MAX, ties
    /// of the rounding, the maximum reached twice with either sign first, denormals (alone:
    /// the scale overflows; and beside normal values), infinities and NaNs. Fixed seeds.
    fn hard_blocks() -> Vec<Vec<f32>> {
        let mut blocks: Vec<Vec<f32>> = Vec::new();
        for (seed, scale) in [
            (1u64, 1.0f32),
            (2, 1e-3),
            (3, 1e3),
            (4, 1e-30),
            (5, 1e30),
            (6, 3e-39),
        ] {
            for i in 0..8 {
                blocks.push(values(seed * 100 + i, QK_K, scale));
            }
        }
        blocks.push(vec![0.0; QK_K]);
        blocks.push(
            (0..QK_K)
                .map(|i| if i % 3 == 0 { -0.0 } else { 0.0 })
                .collect(),
        );
        for m in [f32::MAX, -f32::MAX] {
            let mut x = values(7, QK_K, 1e37);
            x[100] = m;
            blocks.push(x);
        }
        // Scale ∓1: every k + 1/2 is a tie (to even, as the scalar's rounding); and ±1/2·odd
        // with the scale ±1/2 · 127/127.
        for max in [127.0f32, -127.0, 63.5, -254.0] {
            let mut x: Vec<f32> = (0..QK_K).map(|i| (i as f32 - 128.0) * 0.5).collect();
            x[QK_K - 1] = max;
            blocks.push(x);
        }
        for (first, second) in [(3.0f32, -3.0f32), (-3.0, 3.0)] {
            let mut x = values(8, QK_K, 0.5);
            x[17] = first;
            x[200] = second;
            blocks.push(x);
        }
        let tiny = f32::from_bits(1);
        for x in [
            (0..QK_K)
                .map(|i| f32::from_bits(i as u32 % 7) * if i % 2 == 0 { 1.0 } else { -1.0 })
                .collect(),
            (0..QK_K).map(|i| tiny * (i as f32 - 100.0)).collect(),
            {
                let mut x = values(9, QK_K, 1e-38);
                x[5] = f32::MIN_POSITIVE;
                x[6] = tiny;
                x
            },
        ] {
            blocks.push(x);
        }
        for special in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            for at in [0usize, 77, 255] {
                let mut x = values(10 + at as u64, QK_K, 2.0);
                x[at] = special;
                blocks.push(x);
            }
        }
        blocks.push(vec![f32::NAN; QK_K]);
        blocks
    }

    /// The vectorised quantizer ([`ActQ8K::prepare`] at this CPU's level) writes exactly the
    /// scalar reference's bytes, block by block and over many blocks at once.
    #[test]
    fn fast_quantizer_writes_the_scalar_bytes() {
        let blocks = hard_blocks();
        for (i, x) in blocks.iter().enumerate() {
            let want = q8_k_blocks(x);
            let mut got = vec![BlockQ8K::ZERO; 1];
            quantize_fast(x, &mut got);
            assert_eq!(
                block_bytes(&want),
                block_bytes(&got),
                "block {i}: {:?}",
                &x[..4]
            );
        }
        let all: Vec<f32> = blocks.concat();
        let mut buf = ActBuf::new();
        ActQ8K::prepare(&all, &mut buf);
        assert_eq!(block_bytes(&q8_k_blocks(&all)), block_bytes(&buf.q8_k));
        #[cfg(target_arch = "x86_64")]
        if super::super::simd_level() >= super::super::SimdLevel::Avx2 {
            let mut got = vec![BlockQ8K::ZERO; blocks.len()];
            // SAFETY: the CPU has AVX2.
            unsafe { avx2::quantize(&all, &mut got) };
            assert_eq!(block_bytes(&q8_k_blocks(&all)), block_bytes(&got));
        } else {
            eprintln!("no AVX2 here: only the scalar quantizer was compared with itself");
        }
        #[cfg(target_arch = "aarch64")]
        {
            let mut got = vec![BlockQ8K::ZERO; blocks.len()];
            neon::quantize(&all, &mut got);
            assert_eq!(block_bytes(&q8_k_blocks(&all)), block_bytes(&got));
        }
    }

    /// Tuning aid: ns of thread CPU time per value, scalar and fast quantizer (best of 9).
    #[test]
    #[ignore]
    fn quantizer_speed() {
        let x = values(11, QK_K * 64, 1.0);
        let mut b = vec![BlockQ8K::ZERO; 64];
        for (name, f) in [
            ("scalar", quantize as fn(&[f32], &mut [BlockQ8K])),
            ("fast", quantize_fast),
        ] {
            let mut best = f64::MAX;
            for _ in 0..9 {
                let t = thread_cpu_s();
                for _ in 0..200 {
                    f(std::hint::black_box(&x), &mut b);
                }
                best = best.min((thread_cpu_s() - t) / (200.0 * x.len() as f64));
            }
            println!("{name}: {:.3} ns per value", best * 1e9);
        }
    }
}
