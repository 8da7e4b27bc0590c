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
        quantize(x, &mut buf.q8_k);
    }

    fn view(buf: &ActBuf) -> &[BlockQ8K] {
        &buf.q8_k
    }
}

/// Which of the block sums a [`Lanes`] kernel reads (only those are packed).
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
#[derive(Default)]
pub(super) struct LaneCache(PackRing<Lanes>);

impl LaneCache {
    /// The first `nb` blocks of each of `acts` (at most [`WIDE`], each prepared as Q8_K with
    /// at least `nb` blocks) packed with the block sums laid out as `sums` says: a slot that
    /// already holds exactly that, else the oldest slot repacked.
    pub fn pack_for(&mut self, acts: &[&ActBuf], nb: usize, sums: LaneSums) -> &Lanes {
        self.0
            .get(|l| l.holds(acts, nb, sums), |l| l.pack_for(acts, nb, sums))
    }
}

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
}
