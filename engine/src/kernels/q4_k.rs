//! Q4_K: super-blocks of 256 4-bit values in 8 sub-blocks of 32, each with a 6-bit scale and a
//! 6-bit minimum, under f16 super-scales: value = d · sc_j · q − dmin · m_j. The expert format
//! of Q4_K_M files. Dotted against Q8_K activations.
//!
//! Layout (144 bytes): `d`, `dmin` (f16), `scales[12]` (8 scales and 8 minimums, 6 bits each,
//! packed as [`unpack_scales`] reads them), `qs[128]`: each 32-byte chunk `c` holds values
//! `64c .. 64c + 32` in its low nibbles and `64c + 32 .. 64c + 64` in its high nibbles.
//!
//! Summation order (shared by every path): per super-block, `sumi = Σ_j sc_j · Σ q·a` and
//! `summ = Σ_j m_j · (bsum_2j + bsum_2j+1)` exactly in i32; then two accumulators, each one
//! fused multiply-add per super-block in row order, `acc_d = fma(sumi, d·d_a, acc_d)` and
//! `acc_m = fma(summ, dmin·d_a, acc_m)`, and the result `acc_d − acc_m`. SIMD only computes the
//! integers, so it matches the scalar bits.
//!
//! That float order is llama.cpp's x86 CPU backend's for a Q4_K row dotted with one token: its
//! repacked `q4_K_8x8` gemv (2-D weights in decode, and the rows left over after a prompt's
//! groups of 4) and its MUL_MAT_ID over expert tensors. Matching it bit for bit matters more
//! than it looks: a one-ulp difference in a matmul output can move an activation across a Q8_K
//! rounding boundary or a router near-tie, and the model amplifies that into a visible logit
//! difference (see `llama_cpp_orders` in the tests). llama.cpp's 4-row prompt gemm accumulates
//! per pair of sub-blocks instead; no single order can match both, and ours must not depend on
//! the batch, so we take the one-token order.

#[cfg(target_arch = "aarch64")]
pub(super) mod neon;
#[cfg(target_arch = "x86_64")]
use super::q8_k::GROUP;
use super::q8_k::{BlockQ8K, QK_K};
use super::{f16_to_f32, f32_to_f16, nearest_int, RawBlock};

/// One Q4_K super-block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ4K {
    d: [u8; 2],
    dmin: [u8; 2],
    scales: [u8; 12],
    qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);

impl BlockQ4K {
    /// `d`, `dmin` and `scales`: the first 16 bytes.
    #[cfg(target_arch = "x86_64")]
    fn head(&self) -> &[u8; 16] {
        // SAFETY: repr(C) with alignment 1; the block is 144 bytes, so its first 16 bytes are
        // in bounds and any bits are valid for u8.
        unsafe { &*(self as *const Self).cast::<[u8; 16]>() }
    }
}
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ4K {}

/// The 8 scales then the 8 minimums (6 bits each) of a Q4_K/Q5_K super-block, as the 16 bytes
/// of 4 little-endian words. Sub-blocks 0–3 keep their low 6 bits in bytes 0–3 (scales) and
/// 4–7 (mins); sub-blocks 4–7 keep their low 4 bits in the nibbles of bytes 8–11 (scale low,
/// min high) and their top 2 bits in the top bits of bytes 0–3 (scales) and 4–7 (mins).
/// Word arithmetic decodes four sub-blocks per operation.
#[inline(always)]
pub(super) fn scale_words(s: &[u8; 12]) -> [u32; 4] {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let u0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let u1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let u2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    [
        u0 & LOW6,
        (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4),
        u1 & LOW6,
        ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4),
    ]
}

/// The 8 scales and 8 minimums (see [`scale_words`]).
#[inline(always)]
pub(super) fn unpack_scales(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let w = scale_words(s);
    let b = |i: usize| (w[i / 4] >> (8 * (i % 4))) as u8;
    (std::array::from_fn(b), std::array::from_fn(|i| b(8 + i)))
}

/// The inverse of [`unpack_scales`] (inputs ≤ 63).
pub(super) fn pack_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    s
}

/// A super-block quantized with 6-bit sub-block scales and minimums (shared by Q4_K and Q5_K).
pub(super) struct KQuant {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    /// Levels 0..=nmax, one per value.
    pub levels: [u8; QK_K],
}

/// Min-max quantizer: per sub-block of 32, the range [min(0, lo), hi] is split into `nmax`
/// steps; scales and minimums are then quantized to 6 bits under f16 super-scales, and the
/// levels recomputed with the stored (rounded) scales so dequantization sees what we chose.
pub(super) fn quantize_super_block(x: &[f32], nmax: u8) -> KQuant {
    let mut scale = [0f32; 8];
    let mut min = [0f32; 8];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let lo = sub.iter().fold(0f32, |a, v| a.min(*v));
        let hi = sub.iter().fold(f32::NEG_INFINITY, |a, v| a.max(*v));
        scale[j] = if hi > lo {
            (hi - lo) / nmax as f32
        } else {
            0.0
        };
        min[j] = -lo;
    }
    let max_scale = scale.iter().fold(0f32, |a, v| a.max(*v));
    let max_min = min.iter().fold(0f32, |a, v| a.max(*v));
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = nearest_int(inv_scale * scale[j]).clamp(0, 63) as u8;
        lm[j] = nearest_int(inv_min * min[j]).clamp(0, 63) as u8;
    }
    let d = f32_to_f16(max_scale / 63.0);
    let dmin = f32_to_f16(max_min / 63.0);
    let (d_f, dmin_f) = (f16_to_f32(d), f16_to_f32(dmin));
    let mut levels = [0u8; QK_K];
    for (j, (sub, out)) in x
        .chunks_exact(32)
        .zip(levels.chunks_exact_mut(32))
        .enumerate()
    {
        let dl = d_f * ls[j] as f32;
        let dm = dmin_f * lm[j] as f32;
        if dl > 0.0 {
            for (l, v) in out.iter_mut().zip(sub) {
                *l = nearest_int((v + dm) / dl).clamp(0, nmax as i32) as u8;
            }
        }
    }
    KQuant {
        d,
        dmin,
        scales: pack_scales(&ls, &lm),
        levels,
    }
}

pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ4K]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
        let k = quantize_super_block(x, 15);
        b.d = k.d;
        b.dmin = k.dmin;
        b.scales = k.scales;
        for c in 0..4 {
            for l in 0..32 {
                b.qs[32 * c + l] = k.levels[64 * c + l] | (k.levels[64 * c + 32 + l] << 4);
            }
        }
    }
}

pub(super) fn dequantize(src: &[BlockQ4K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let dmin = f16_to_f32(b.dmin);
        let (sc, m) = unpack_scales(&b.scales);
        for c in 0..4 {
            let (d1, m1) = (d * sc[2 * c] as f32, dmin * m[2 * c] as f32);
            let (d2, m2) = (d * sc[2 * c + 1] as f32, dmin * m[2 * c + 1] as f32);
            for l in 0..32 {
                let q = b.qs[32 * c + l];
                y[64 * c + l] = d1 * (q & 0x0F) as f32 - m1;
                y[64 * c + 32 + l] = d2 * (q >> 4) as f32 - m2;
            }
        }
    }
}

/// `Σ_j m_j · (bsum_2j + bsum_2j+1)`: the minimums' share of a super-block dot (Q4_K, Q5_K).
#[inline(always)]
pub(super) fn mins_dot(m: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    let mut s = 0i32;
    for j in 0..8 {
        s += m[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
    }
    s
}

super::format::kquant_format!(Q4K, Q4_K, BlockQ4K, grouped);

/// One super-block's step of the two accumulators (see the module header): exact integers in,
/// one fused multiply-add each.
#[inline(always)]
fn accumulate(acc: &mut [f32; 2], d: [u8; 2], dmin: [u8; 2], d_a: f32, sumi: i32, summ: i32) {
    acc[0] = (sumi as f32).mul_add(f16_to_f32(d) * d_a, acc[0]);
    acc[1] = (summ as f32).mul_add(f16_to_f32(dmin) * d_a, acc[1]);
}

pub(super) fn dot_scalar(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    let mut acc = [0f32; 2];
    for (x, y) in w.iter().zip(a) {
        let (sc, m) = unpack_scales(&x.scales);
        let mut sumi = 0i32;
        for c in 0..4 {
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                let q = x.qs[32 * c + l];
                lo += (q & 0x0F) as i32 * y.qs[64 * c + l] as i32;
                hi += (q >> 4) as i32 * y.qs[64 * c + 32 + l] as i32;
            }
            sumi += sc[2 * c] as i32 * lo + sc[2 * c + 1] as i32 * hi;
        }
        accumulate(&mut acc, x.d, x.dmin, y.d, sumi, mins_dot(&m, &y.bsums));
    }
    acc[0] - acc[1]
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    let [v] = unsafe { dot_each_avx2::<1>(w, [a]) };
    v
}

/// The exact integer sums (8 i32 lanes each) of block `x` against block `i` of each of `N`
/// activations: the nibbles and scales prepared once per chunk, multiplied into every
/// activation's own sum. Shared by the single, grouped and leftover dots.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_sums<const N: usize>(
    x: &BlockQ4K,
    scales: std::arch::x86_64::__m256i,
    a: [&[BlockQ8K]; N],
    i: usize,
) -> [std::arch::x86_64::__m256i; N] {
    use std::arch::x86_64::*;
    let m4 = _mm256_set1_epi8(0x0F);
    let mut sumi = [_mm256_setzero_si256(); N];
    for c in 0..4 {
        // SAFETY: 32-byte load inside qs (128 bytes).
        let q = unsafe { _mm256_loadu_si256(x.qs.as_ptr().add(32 * c).cast()) };
        let lo = _mm256_and_si256(q, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        let (sc_lo, sc_hi) = unsafe {
            (
                x86::scale_of(scales, 2 * c),
                x86::scale_of(scales, 2 * c + 1),
            )
        };
        for (t, s) in sumi.iter_mut().enumerate() {
            let y = &a[t][i];
            // SAFETY: 32-byte loads inside y.qs (256 bytes).
            let (ylo, yhi) = unsafe {
                (
                    _mm256_loadu_si256(y.qs.as_ptr().add(64 * c).cast()),
                    _mm256_loadu_si256(y.qs.as_ptr().add(64 * c + 32).cast()),
                )
            };
            // ≤ 2 · 15 · 127 per i16 lane: no saturation.
            let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ylo), sc_lo);
            let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, yhi), sc_hi);
            *s = _mm256_add_epi32(*s, _mm256_add_epi32(plo, phi));
        }
    }
    sumi
}

/// The grouped dot (prefill): [`dot_each_avx2`]'s integer work for 4 activations, with the
/// per-block tail done for all 4 at once — the exact sums of the 4 tokens' lanes reduced
/// together by horizontal adds (one transposing reduction instead of four), then both
/// accumulators of all 4 tokens stepped with one fused multiply-add each. Per lane that is the
/// very `fma(sumi, d·d_a, acc_d)` and `fma(summ, dmin·d_a, acc_m)` of the scalar `accumulate`
/// on the same exact integers, so the bits are those of 4 single dots (the tests check it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_4_avx2(w: &[BlockQ4K], a: [&[BlockQ8K]; GROUP]) -> [f32; GROUP] {
    use std::arch::x86_64::*;
    const { assert!(GROUP == 4) };
    let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
    let (mut acc_d, mut acc_m) = (_mm_setzero_ps(), _mm_setzero_ps());
    for (i, x) in w[..n].iter().enumerate() {
        let (scales, mins) = unsafe { x86::scales_mins(x.head()) };
        let sumi = unsafe { block_sums(x, scales, a, i) };
        // [sumi_0, sumi_1, sumi_2, sumi_3]: each token's 8 lanes summed (exact in i32).
        let s01 = _mm256_hadd_epi32(sumi[0], sumi[1]);
        let s23 = _mm256_hadd_epi32(sumi[2], sumi[3]);
        let s = _mm256_hadd_epi32(s01, s23);
        let sumi4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        // [summ_0, ..., summ_3]: Σ_j m_j · (bsum_2j + bsum_2j+1) per token (exact).
        let mins_dot = |t: usize| {
            // SAFETY: 16 i16 = 32 bytes.
            let bs = unsafe { _mm256_loadu_si256(a[t][i].bsums.as_ptr().cast()) };
            // Pair sums ≤ 2 · 16 · 127: no i16 overflow.
            let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
            _mm_madd_epi16(mins, pairs)
        };
        let m01 = _mm_hadd_epi32(mins_dot(0), mins_dot(1));
        let m23 = _mm_hadd_epi32(mins_dot(2), mins_dot(3));
        let summ4 = _mm_hadd_epi32(m01, m23);
        // [d, dmin, 0, 0] widened exactly, times each token's activation scale.
        let dd = unsafe { x86::super_scales(x.d, x.dmin) };
        let d_a = _mm_setr_ps(a[0][i].d, a[1][i].d, a[2][i].d, a[3][i].d);
        let scale_d = _mm_mul_ps(_mm_shuffle_ps(dd, dd, 0b00_00_00_00), d_a);
        let scale_m = _mm_mul_ps(_mm_shuffle_ps(dd, dd, 0b01_01_01_01), d_a);
        acc_d = _mm_fmadd_ps(_mm_cvtepi32_ps(sumi4), scale_d, acc_d);
        acc_m = _mm_fmadd_ps(_mm_cvtepi32_ps(summ4), scale_m, acc_m);
    }
    let mut out = [0f32; GROUP];
    // SAFETY: 4 floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc_d, acc_m)) };
    out
}

/// The AVX2 grouped dot for `N` activations: [`dot_4_avx2`] for a whole group, else single
/// dots (the 2 or 3 tokens left over after the groups: `dot_each_avx2` for 2 or 3 measured no
/// faster than single dots, 5.8–9.5 against 7.6 ns per block and token in L2).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_n_avx2<const N: usize>(w: &[BlockQ4K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    if N == GROUP {
        let r = unsafe { dot_4_avx2(w, std::array::from_fn(|k| a[k])) };
        std::array::from_fn(|k| r[k])
    } else {
        a.map(|a| unsafe { dot_avx2(w, a) })
    }
}

/// `N` dots of one row at once: per chunk the nibbles and scales are prepared once and
/// multiplied into each activation's own exact integer sum; each activation then gets its own
/// float steps, the same for any `N`, so the bits never depend on the grouping.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_each_avx2<const N: usize>(w: &[BlockQ4K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    use std::arch::x86_64::*;
    let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
    let mut acc = [_mm_setzero_ps(); N];
    for (i, x) in w[..n].iter().enumerate() {
        let (scales, mins) = unsafe { x86::scales_mins(x.head()) };
        let sumi = unsafe { block_sums(x, scales, a, i) };
        for t in 0..N {
            let y = &a[t][i];
            acc[t] = unsafe { x86::accumulate(acc[t], sumi[t], mins, &y.bsums, x.d, x.dmin, y.d) };
        }
    }
    acc.map(|acc| _mm_cvtss_f32(_mm_sub_ss(acc, _mm_movehdup_ps(acc))))
}

#[cfg(target_arch = "x86_64")]
impl super::format::Kernel<Q4K> for super::format::Avx512 {
    /// AVX2's: one token's 512-bit kernel measured slower (its per-block reduction of 16
    /// lanes outweighs the wider multiplies).
    unsafe fn dot(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (the AVX-512 level includes AVX2's features).
        unsafe { dot_avx2(w, a) }
    }

    const GROUPED: bool = true;

    const WIDE: bool = true;

    /// From 6 tokens on the lanes kernel is the cheaper (in L2, ns per block and token: 6
    /// tokens 4.8 against 5.2 as a group of 4 and one of 2, 7 tokens 4.1 against 4.9; at 5
    /// the group of 4 and a single dot, 5.3, beat its 5.7–5.9). Prefill CPU time of `small`
    /// Q4_K_M did not move (1.01); the 30B-A3B shape's ~8 tokens per expert meet it more often.
    const WIDE_MIN: usize = 6;

    unsafe fn dot_wide(
        w: &[u8],
        row_bytes: usize,
        rows: std::ops::Range<usize>,
        a: &[&super::ActBuf],
        out: &mut [&mut [f32]],
    ) {
        // SAFETY: the caller's.
        unsafe { avx512::dot_wide(w, row_bytes, rows, a, out) }
    }

    unsafe fn dot_group<const N: usize>(w: &[BlockQ4K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { avx512::dot_n::<N>(w, a) }
    }
}

/// The AVX-512 level: 64 values per instruction, and `vpdpwssd` (AVX512-VNNI) applying a
/// sub-block's scale and adding into the sum in one step where AVX2 takes two.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::format::Activation;
    use super::super::q8_k::{by_row_steps, ActQ8K, LaneCache, LaneSums, Lanes};
    use super::super::{blocks, ActBuf};
    use super::{x86, BlockQ4K, BlockQ8K};
    use std::arch::x86_64::*;

    /// `vpermw` indices: chunk `c`'s scales as 32 i16, sub-block `2c`'s in the low 256 bits
    /// (the chunk's low nibbles) and `2c + 1`'s in the high 256 bits (its high nibbles).
    const SCALE_IDX: [[u16; 32]; 4] = {
        let mut m = [[0u16; 32]; 4];
        let mut c = 0;
        while c < 4 {
            let mut i = 0;
            while i < 32 {
                m[c][i] = (2 * c + i / 16) as u16;
                i += 1;
            }
            c += 1;
        }
        m
    };

    thread_local! {
        /// The packed tokens and the unpacked row of the current call.
        static LANES: std::cell::RefCell<(LaneCache, Vec<Unpacked>)> =
            std::cell::RefCell::new((LaneCache::default(), Vec::new()));
    }

    /// A row's nibbles unpacked to one byte per value, in value order.
    #[repr(C, align(64))]
    struct Unpacked([u8; 256]);

    /// Rows `rows` against up to 16 activations, one per i32 lane ([`Lanes`], packed once per
    /// call and reused by every row).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn dot_wide(
        w: &[u8],
        row_bytes: usize,
        rows: std::ops::Range<usize>,
        a: &[&ActBuf],
        out: &mut [&mut [f32]],
    ) {
        let nb = row_bytes / std::mem::size_of::<BlockQ4K>();
        let views: Vec<&[BlockQ8K]> = a.iter().map(|a| ActQ8K::view(a)).collect();
        let nb = views.iter().fold(nb, |n, v| n.min(v.len()));
        LANES.with(|cell| {
            let (cache, q) = &mut *cell.borrow_mut();
            let lanes = cache.pack_for(a, nb, LaneSums::Pairs);
            let row =
                |r: usize| -> &[BlockQ4K] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
            // Four rows at a time share each activation load (then two, then one).
            by_row_steps::<4>(w, row_bytes, rows, out, |r, n| {
                let mut v = [[0f32; 16]; 4];
                // SAFETY: the caller's (this level's features are present).
                unsafe {
                    match n {
                        4 => {
                            v = row_lanes::<4>(
                                [row(r), row(r + 1), row(r + 2), row(r + 3)],
                                lanes,
                                q,
                            )
                        }
                        2 => [v[0], v[1]] = row_lanes::<2>([row(r), row(r + 1)], lanes, q),
                        _ => [v[0]] = row_lanes::<1>([row(r)], lanes, q),
                    }
                }
                v
            });
        });
    }

    /// Each block's nibbles of `w` as one byte per value, in value order, into `q`. Not
    /// inlined on purpose: the main loop must read these bytes from memory (a broadcast load
    /// costs a load port), not have the compiler forward them through vector shuffles.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline(never)]
    unsafe fn unpack_row(w: &[BlockQ4K], q: &mut [Unpacked]) {
        let m4 = _mm512_set1_epi8(0x0F);
        for (x, q) in w.iter().zip(q.iter_mut()) {
            for c in 0..4 {
                // SAFETY: 32-byte load inside qs; 64-byte aligned store inside `q`.
                unsafe {
                    let v = _mm256_loadu_si256(x.qs.as_ptr().add(32 * c).cast());
                    let both =
                        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4));
                    _mm512_store_si512(
                        q.0.as_mut_ptr().add(64 * c).cast(),
                        _mm512_and_si512(both, m4),
                    );
                }
            }
        }
    }

    /// `R` rows against the packed tokens (each activation load serves all `R`): per sub-block of 32 values, eight `vpdpbusd` (4
    /// weight bytes broadcast × each token's 4 activation bytes, summed into its lane), then
    /// times the sub-block's scale; the minimums' term by `vpdpwssd` on the pair sums. Every
    /// lane's integers are exactly the scalar `sumi` and `summ` of its token, and its two
    /// accumulators take the scalar `accumulate`'s fused multiply-adds, so each lane has the
    /// bits of [`super::dot_scalar`]. `q` is scratch for the unpacked row.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn row_lanes<const R: usize>(
        w: [&[BlockQ4K]; R],
        l: &Lanes,
        q: &mut Vec<Unpacked>,
    ) -> [[f32; 16]; R] {
        let nb = w[0].len();
        if q.len() < R * nb {
            q.resize_with(R * nb, || Unpacked([0; 256]));
        }
        for (r, w) in w.iter().enumerate() {
            // SAFETY: this level's features are present.
            unsafe { unpack_row(w, &mut q[r * nb..(r + 1) * nb]) };
        }
        let mut acc_d = [_mm512_setzero_ps(); R];
        let mut acc_m = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let mut sc = [[0i32; 8]; R];
            let mut m = [[0i32; 4]; R];
            for r in 0..R {
                // SAFETY: AVX2 is present (implied by this level); 8 and 4 i32 stores.
                unsafe {
                    let (scales, mins) = x86::scales_mins(w[r][b].head());
                    _mm256_storeu_si256(
                        sc[r].as_mut_ptr().cast(),
                        _mm256_cvtepu16_epi32(_mm256_castsi256_si128(scales)),
                    );
                    // (m_2i, m_2i+1) as the i16 pair of i32 lane i.
                    _mm_storeu_si128(m[r].as_mut_ptr().cast(), mins);
                }
            }
            let qs = &l.qs[64 * b..64 * b + 64];
            let mut sumi = [_mm512_setzero_si512(); R];
            for j in 0..8 {
                let mut t = [_mm512_setzero_si512(); R];
                for k in 0..8 {
                    // SAFETY: 64 bytes of one packed row; 4 bytes inside row r's `q`.
                    unsafe {
                        let y = _mm512_loadu_si512(qs[8 * j + k].as_ptr().cast());
                        for r in 0..R {
                            let wq = std::ptr::read_unaligned(
                                q[r * nb + b].0.as_ptr().add(32 * j + 4 * k).cast::<i32>(),
                            );
                            // ≤ 4 · 15 · 127 per step, ≤ 32 · 15 · 127 per sub-block: exact.
                            t[r] = _mm512_dpbusd_epi32(t[r], _mm512_set1_epi32(wq), y);
                        }
                    }
                }
                for r in 0..R {
                    let scaled = _mm512_mullo_epi32(t[r], _mm512_set1_epi32(sc[r][j]));
                    sumi[r] = _mm512_add_epi32(sumi[r], scaled);
                }
            }
            // SAFETY: 16 floats.
            let d_a = unsafe { _mm512_loadu_ps(l.d[b].as_ptr()) };
            for r in 0..R {
                let mut summ = _mm512_setzero_si512();
                for (i, &mi) in m[r].iter().enumerate() {
                    // SAFETY: 64 bytes of one packed row.
                    let p = unsafe { _mm512_loadu_si512(l.sums[4 * b + i].as_ptr().cast()) };
                    summ = _mm512_dpwssd_epi32(summ, p, _mm512_set1_epi32(mi));
                }
                let x = &w[r][b];
                // SAFETY: F16C is present.
                let dd = unsafe { x86::super_scales(x.d, x.dmin) };
                let d = _mm512_broadcastss_ps(dd);
                let dmin = _mm512_broadcastss_ps(_mm_movehdup_ps(dd));
                acc_d[r] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(d, d_a), acc_d[r]);
                acc_m[r] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dmin, d_a), acc_m[r]);
            }
        }
        let mut out = [[0f32; 16]; R];
        for r in 0..R {
            // SAFETY: 16 floats.
            unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), _mm512_sub_ps(acc_d[r], acc_m[r])) };
        }
        out
    }

    /// `[Σ s0, Σ s1, Σ s2, Σ s3]` over each vector's 16 i32 lanes (exact).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    fn sum4_512(s: [__m512i; 4]) -> __m128i {
        // Per 128-bit lane: [s0, s1, s0, s1] partials, then [s0, s1, s2, s3].
        let u0 = _mm512_add_epi32(
            _mm512_unpacklo_epi32(s[0], s[1]),
            _mm512_unpackhi_epi32(s[0], s[1]),
        );
        let u1 = _mm512_add_epi32(
            _mm512_unpacklo_epi32(s[2], s[3]),
            _mm512_unpackhi_epi32(s[2], s[3]),
        );
        let v = _mm512_add_epi32(_mm512_unpacklo_epi64(u0, u1), _mm512_unpackhi_epi64(u0, u1));
        let y = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
        _mm_add_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256::<1>(y))
    }

    /// `[Σ s0, Σ s1, Σ s2, Σ s3]` over each vector's 8 i32 lanes (exact).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    fn sum4_256(s: [__m256i; 4]) -> __m128i {
        let u0 = _mm256_add_epi32(
            _mm256_unpacklo_epi32(s[0], s[1]),
            _mm256_unpackhi_epi32(s[0], s[1]),
        );
        let u1 = _mm256_add_epi32(
            _mm256_unpacklo_epi32(s[2], s[3]),
            _mm256_unpackhi_epi32(s[2], s[3]),
        );
        let v = _mm256_add_epi32(_mm256_unpacklo_epi64(u0, u1), _mm256_unpackhi_epi64(u0, u1));
        _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v))
    }

    /// One row against `N` activations (`N <= 8`). Per super-block: each 32-byte chunk of
    /// nibbles becomes one 64-value vector (low nibbles, then high: the chunk's 64 values in
    /// order, matching 64 consecutive activation bytes), and each activation's exact sum takes
    /// one `vpmaddubsw` and one `vpdpwssd` (times the two sub-blocks' scales) per chunk. The
    /// sums and minimums' terms of up to 4 activations are then reduced together, and every
    /// activation's two accumulators stepped with one fused multiply-add each: the scalar
    /// `accumulate` on the same exact integers, so the bits of [`super::dot_scalar`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    pub unsafe fn dot_n<const N: usize>(w: &[BlockQ4K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        const { assert!(N >= 1 && N <= 8) };
        let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
        let m4 = _mm512_set1_epi8(0x0F);
        // SAFETY: 64-byte loads of the 32 i16 of each index row.
        let idx: [__m512i; 4] =
            std::array::from_fn(|c| unsafe { _mm512_loadu_si512(SCALE_IDX[c].as_ptr().cast()) });
        let mut acc_d = [_mm_setzero_ps(); 2];
        let mut acc_m = [_mm_setzero_ps(); 2];
        for (i, x) in w[..n].iter().enumerate() {
            // SAFETY: AVX2 is present (implied by this level).
            let (scales, mins) = unsafe { x86::scales_mins(x.head()) };
            let sc = _mm512_castsi256_si512(scales);
            let mut sumi = [_mm512_setzero_si512(); N];
            for (c, idx_c) in idx.iter().enumerate() {
                // SAFETY: 32-byte load inside qs (128 bytes).
                let q = unsafe { _mm256_loadu_si256(x.qs.as_ptr().add(32 * c).cast()) };
                let both =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4));
                let qv = _mm512_and_si512(both, m4);
                let scv = _mm512_permutexvar_epi16(*idx_c, sc);
                for (t, s) in sumi.iter_mut().enumerate() {
                    // SAFETY: 64-byte load inside qs (256 bytes).
                    let y = unsafe { _mm512_loadu_si512(a[t][i].qs.as_ptr().add(64 * c).cast()) };
                    // ≤ 2 · 15 · 127 per i16 lane: no saturation; then · scale ≤ 63, exact.
                    *s = _mm512_dpwssd_epi32(*s, _mm512_maddubs_epi16(qv, y), scv);
                }
            }
            // Each i32 lane j: m_j in both halves, so that `vpmaddwd` with the bsums gives
            // m_j · (bsum_2j + bsum_2j+1).
            let m32 = _mm256_cvtepu16_epi32(mins);
            let mins2 = _mm256_or_si256(m32, _mm256_slli_epi32::<16>(m32));
            // SAFETY: F16C is present.
            let dd = unsafe { x86::super_scales(x.d, x.dmin) };
            let dsc = _mm_shuffle_ps::<0b00_00_00_00>(dd, dd);
            let msc = _mm_shuffle_ps::<0b01_01_01_01>(dd, dd);
            for g in 0..N.div_ceil(4) {
                let tok = |k: usize| (4 * g + k < N).then(|| &a[4 * g + k][i]);
                let sumi4 = sum4_512(std::array::from_fn(|k| {
                    if 4 * g + k < N {
                        sumi[4 * g + k]
                    } else {
                        _mm512_setzero_si512()
                    }
                }));
                let summ4 = sum4_256(std::array::from_fn(|k| match tok(k) {
                    // SAFETY: 16 i16 = 32 bytes. Pair sums ≤ 2 · 16 · 127 fit, times ≤ 63.
                    Some(y) => _mm256_madd_epi16(
                        unsafe { _mm256_loadu_si256(y.bsums.as_ptr().cast()) },
                        mins2,
                    ),
                    None => _mm256_setzero_si256(),
                }));
                let d = |k: usize| tok(k).map_or(0.0, |y| y.d);
                let d_a = _mm_setr_ps(d(0), d(1), d(2), d(3));
                acc_d[g] = _mm_fmadd_ps(_mm_cvtepi32_ps(sumi4), _mm_mul_ps(dsc, d_a), acc_d[g]);
                acc_m[g] = _mm_fmadd_ps(_mm_cvtepi32_ps(summ4), _mm_mul_ps(msc, d_a), acc_m[g]);
            }
        }
        let mut out = [[0f32; 4]; 2];
        for g in 0..N.div_ceil(4) {
            // SAFETY: 4 floats.
            unsafe { _mm_storeu_ps(out[g].as_mut_ptr(), _mm_sub_ps(acc_d[g], acc_m[g])) };
        }
        std::array::from_fn(|t| out[t / 4][t % 4])
    }
}

/// AVX2 pieces shared by Q4_K and Q5_K.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    /// `pshufb` masks: mask `k` fills every 16-bit lane with lane `k` (of each 128-bit half).
    const SCALE_SHUFFLE: [[u8; 32]; 8] = {
        let mut m = [[0u8; 32]; 8];
        let mut k = 0;
        while k < 8 {
            let mut i = 0;
            while i < 32 {
                m[k][i] = (2 * k + i % 2) as u8;
                i += 1;
            }
            k += 1;
        }
        m
    };

    /// The 8 scales as i16 (in both 128-bit halves) and the 8 minimums as i16, from the first
    /// 16 bytes of a Q4_K/Q5_K block (`d`, `dmin`, `scales`): [`scale_words`] done on the
    /// three scale words in one register.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn scales_mins(head: &[u8; 16]) -> (__m256i, __m128i) {
        // SAFETY: 16 bytes. Lanes: [d | dmin, u0, u1, u2].
        let v = unsafe { _mm_loadu_si128(head.as_ptr().cast()) };
        let a = _mm_shuffle_epi32(v, 0b11_10_11_01); // [u0, u2, u1, u2]
        let b = _mm_shuffle_epi32(v, 0b10_10_01_01); // [u0, u0, u1, u1]
        let low = _mm_and_si128(
            _mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
            _mm_setr_epi32(0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f, 0x0f0f_0f0f),
        );
        // Top two bits of the first eight 6-bit fields, moved to bits 4-5 of lanes 1 and 3.
        let high = _mm_and_si128(
            _mm_srli_epi32(b, 2),
            _mm_setr_epi32(0, 0x3030_3030, 0, 0x3030_3030),
        );
        let words = _mm_or_si128(low, high); // [sc 0-3, sc 4-7, m 0-3, m 4-7]
        let sc = _mm_cvtepu8_epi16(words);
        let m = _mm_cvtepu8_epi16(_mm_srli_si128(words, 8));
        (_mm256_broadcastsi128_si256(sc), m)
    }

    /// Sub-block `k`'s scale in every i16 lane.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn scale_of(scales: __m256i, k: usize) -> __m256i {
        // SAFETY: k < 8 (callers index sub-blocks); 32-byte load.
        let mask = unsafe { _mm256_loadu_si256(SCALE_SHUFFLE[k & 7].as_ptr().cast()) };
        _mm256_shuffle_epi8(scales, mask)
    }

    /// `[sumi, summ, sumi, summ]`, exact in i32: the total of the 8 lanes of `sumi`, and
    /// `summ` from the minimums (`mins`, from [`scales_mins`]) and the pair sums of `bsums`.
    /// The integer half of [`accumulate`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn totals(sumi: __m256i, mins: __m128i, bsums: &[i16; 16]) -> __m128i {
        // SAFETY: 16 i16 = 32 bytes.
        let bs = unsafe { _mm256_loadu_si256(bsums.as_ptr().cast()) };
        // Pair sums ≤ 2 · 16 · 127: no i16 overflow.
        let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        let summ4 = _mm_madd_epi16(mins, pairs);
        let sumi4 = _mm_add_epi32(
            _mm256_castsi256_si128(sumi),
            _mm256_extracti128_si256(sumi, 1),
        );
        let h = _mm_hadd_epi32(sumi4, summ4);
        _mm_hadd_epi32(h, h)
    }

    /// `[d, dmin, 0, 0]` widened from f16 (exact).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn super_scales(d: [u8; 2], dmin: [u8; 2]) -> __m128 {
        let bits = u16::from_le_bytes(d) as i32 | ((u16::from_le_bytes(dmin) as i32) << 16);
        _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
    }

    /// `Σ_j m_j · (bsum_2j + bsum_2j+1)` (exact), the scalar [`super::mins_dot`] from the
    /// minimums of [`scales_mins`] (Q5_K's minimums' term).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn mins_dot(mins: __m128i, bsums: &[i16; 16]) -> i32 {
        // SAFETY: 16 i16 = 32 bytes.
        let bs = unsafe { _mm256_loadu_si256(bsums.as_ptr().cast()) };
        // Pair sums ≤ 2 · 16 · 127: no i16 overflow.
        let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        let s = _mm_madd_epi16(mins, pairs);
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// Q4_K's step of its two accumulators, lanes 0 (`acc_d`) and 1 (`acc_m`) of `acc`, exactly
    /// as the scalar `accumulate`: the integers `sumi` and `summ` reduced exactly, then one
    /// fused multiply-add per lane.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn accumulate(
        acc: __m128,
        sumi: __m256i,
        mins: __m128i,
        bsums: &[i16; 16],
        d: [u8; 2],
        dmin: [u8; 2],
        d_a: f32,
    ) -> __m128 {
        let h = unsafe { totals(sumi, mins, bsums) };
        // [d·d_a, dmin·d_a, 0, 0]
        let scales = _mm_mul_ps(unsafe { super_scales(d, dmin) }, _mm_set1_ps(d_a));
        _mm_fmadd_ps(_mm_cvtepi32_ps(h), scales, acc)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Q4K>(&[(1, 1), (2, 3), (3, 16)], 50);
    }

    /// Every level's `dot_rows` (two rows a step at dotprod and i8mm) gives each row the
    /// scalar bits.
    #[test]
    fn rows_match_scalar() {
        super::super::block32::checks::check_rows_match_scalar::<Q4K>();
    }

    /// ns per (super-block, token) at each level and group width (`--ignored --nocapture`).
    #[test]
    #[ignore]
    fn group_speed() {
        print_group_speed::<Q4K>();
    }

    /// Grouped from AVX2 on x86-64 and from dotprod on aarch64.
    #[test]
    fn group_dot_matches_single_dots_bits() {
        #[cfg(target_arch = "aarch64")]
        let grouped = super::super::simd_level() >= super::super::SimdLevel::Dotprod;
        #[cfg(not(target_arch = "aarch64"))]
        let grouped = true;
        check_group_matches_single::<Q4K>(grouped);
    }

    /// Rows of an expert `ffn_down` (two super-blocks) and the results llama.cpp computed for
    /// them: our order must give its bits at every SIMD level. The previous order
    /// (`acc += d·sumi − dmin·summ` per super-block) misses all four.
    #[test]
    fn matches_llama_cpp_rows_bit_for_bit() {
        check_llama_rows(
            GgmlType::Q4_K,
            include_bytes!("testdata/llama_rows_q4_k.bin"),
            4,
        );
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Q4K>(&[41, 42, 43]);
    }

    /// ggml's per-sub-block decoding (`get_scale_min_k4`), the reference for `scale_words`.
    fn scale_min_ref(j: usize, q: &[u8; 12]) -> (u8, u8) {
        if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            (
                (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
                (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
            )
        }
    }

    #[test]
    fn scale_decoding_matches_the_per_byte_form() {
        for seed in 0..256u64 {
            let b: [u8; 12] = bytes(seed, 12).try_into().unwrap();
            let (sc, m) = unpack_scales(&b);
            for j in 0..8 {
                assert_eq!((sc[j], m[j]), scale_min_ref(j, &b), "seed={seed} j={j}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_scale_decoding_matches_scalar() {
        if super::super::simd_level() < super::super::SimdLevel::Avx2 {
            return;
        }
        use std::arch::x86_64::*;
        for seed in 0..256u64 {
            let head: [u8; 16] = bytes(seed, 16).try_into().unwrap();
            let (sc, m) = unpack_scales(head[4..].try_into().unwrap());
            let (mut got_sc, mut got_m) = ([0i16; 16], [0i16; 8]);
            // SAFETY: AVX2 is present (checked above); stores fit the arrays.
            unsafe {
                let (s, mm) = x86::scales_mins(&head);
                _mm256_storeu_si256(got_sc.as_mut_ptr().cast(), s);
                _mm_storeu_si128(got_m.as_mut_ptr().cast(), mm);
            }
            for j in 0..8 {
                assert_eq!(got_sc[j], sc[j] as i16, "seed={seed}");
                assert_eq!(got_sc[j + 8], sc[j] as i16, "seed={seed}");
                assert_eq!(got_m[j], m[j] as i16, "seed={seed}");
            }
        }
    }

    #[test]
    fn scale_packing_round_trips() {
        for seed in 0..64u64 {
            let b = bytes(seed, 16);
            let sc: [u8; 8] = std::array::from_fn(|i| b[i] & 63);
            let m: [u8; 8] = std::array::from_fn(|i| b[8 + i] & 63);
            assert_eq!(unpack_scales(&pack_scales(&sc, &m)), (sc, m), "seed={seed}");
        }
    }

    #[test]
    fn round_trip_error_within_budget() {
        // 16 levels over each sub-block's range: uniform rounding gives range/15/√12 ≈ 0.08σ
        // for these values; the 6-bit scales and the min-max (not searched) fit add some.
        let rel = relative_rms_error(GgmlType::Q4_K, &values(9, QK_K * 64, 1.0));
        assert!(rel < 0.11, "relative rmse {rel}");
        // All-equal and all-zero blocks survive.
        let flat = round_trip(GgmlType::Q4_K, &[0.0; QK_K]);
        assert!(flat.iter().all(|v| *v == 0.0));
        let flat = round_trip(GgmlType::Q4_K, &[-0.5; QK_K]);
        assert!(
            flat.iter().all(|v| (v + 0.5).abs() < 1e-3),
            "{:?}",
            &flat[..4]
        );
    }
}
