//! Q2_K: super-blocks of 256 2-bit levels in 16 runs of 16, each run with a 4-bit scale and a
//! 4-bit minimum under f16 super-scales: value = d · sc_r · q − dmin · m_r. The expert format of
//! the smallest K-quant files (Q2_K presets, the "dynamic" 2–3-bit files that fit a 30B MoE on a
//! phone). Dotted against Q8_K activations.
//!
//! Layout (84 bytes): `scales[16]` (run `r`: scale in the low nibble, minimum in the high),
//! `qs[64]`, `d`, `dmin` (f16). Value `128n + 32t + l` (`n` < 2, `t` < 4, `l` < 32) is bits
//! `2t .. 2t + 2` of `qs[32n + l]`, in run `8n + 2t + l / 16`.
//!
//! Summation order (llama.cpp's x86 `ggml_vec_dot_q2_K_q8_K`, shared by every path): 8 lane
//! accumulators; per super-block, first `lane_k = fma(−d_a·dmin, m_2k·bsum_2k + m_2k+1·bsum_2k+1,
//! lane_k)`, then `lane_k = fma(d_a·d, sumi_k, lane_k)` where `sumi_k` sums, exactly over the
//! 8 groups of 32 values, `sc · Σ q·a` over values `4k .. 4k + 4` of the group; folded by
//! [`reduce8`] at the end. The AVX2 path computes those integers with `maddubs`/`madd`.

use super::q8_k::{BlockQ8K, QK_K};
use super::{f16_to_f32, f32_to_f16, nearest_int, reduce8, RawBlock};

/// One Q2_K super-block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ2K {
    scales: [u8; QK_K / 16],
    qs: [u8; QK_K / 4],
    d: [u8; 2],
    dmin: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ2K {}

/// The level (0..=3) of value `v` of a super-block.
#[inline(always)]
fn level(b: &BlockQ2K, v: usize) -> u8 {
    let (n, t, l) = (v / 128, (v % 128) / 32, v % 32);
    (b.qs[32 * n + l] >> (2 * t)) & 3
}

/// The run (0..16) of value `v`.
#[inline(always)]
fn run(v: usize) -> usize {
    v / 16
}

pub(super) fn dequantize(src: &[BlockQ2K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let dmin = f16_to_f32(b.dmin);
        for (v, o) in y.iter_mut().enumerate() {
            let s = b.scales[run(v)];
            let dl = d * (s & 0x0F) as f32;
            let ml = dmin * (s >> 4) as f32;
            *o = dl * level(b, v) as f32 - ml;
        }
    }
}

/// A run of values fitted to `scale · q − min` (q in 0..=n_max, min ≥ 0): the min-max fit,
/// then one least-squares refit of both on the chosen levels if it lowers the error.
/// Returns (scale, min).
pub(super) fn fit_min_max(x: &[f32], n_max: u8) -> (f32, f32) {
    let lo = x.iter().fold(0f32, |a, v| a.min(*v));
    let hi = x.iter().fold(f32::NEG_INFINITY, |a, v| a.max(*v));
    if hi <= lo || hi.is_nan() {
        return (0.0, -lo);
    }
    let scale = (hi - lo) / n_max as f32;
    let min = -lo;
    let err = |s: f32, m: f32| -> f32 {
        x.iter()
            .map(|v| {
                let q = if s > 0.0 {
                    nearest_int((v + m) / s).clamp(0, n_max as i32)
                } else {
                    0
                };
                (v - (s * q as f32 - m)).powi(2)
            })
            .sum()
    };
    // Least squares for x ≈ s·q − m on the min-max levels.
    let q: Vec<f32> = x
        .iter()
        .map(|v| nearest_int((v + min) / scale).clamp(0, n_max as i32) as f32)
        .collect();
    let n = x.len() as f32;
    let (sq, sqq, sx, sqx) = q.iter().zip(x).fold((0f32, 0f32, 0f32, 0f32), |a, (q, v)| {
        (a.0 + q, a.1 + q * q, a.2 + v, a.3 + q * v)
    });
    let det = n * sqq - sq * sq;
    if det > 0.0 {
        let s = (n * sqx - sq * sx) / det;
        let m = (s * sq - sx) / n;
        if s > 0.0 && m >= 0.0 && err(s, m) < err(scale, min) {
            return (s, m);
        }
    }
    (scale, min)
}

pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ2K]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
        let fits: Vec<(f32, f32)> = x.chunks_exact(16).map(|r| fit_min_max(r, 3)).collect();
        let max_scale = fits.iter().fold(0f32, |a, f| a.max(f.0));
        let max_min = fits.iter().fold(0f32, |a, f| a.max(f.1));
        b.d = f32_to_f16(max_scale / 15.0);
        b.dmin = f32_to_f16(max_min / 15.0);
        let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
        let inv = |m: f32| if m > 0.0 { 15.0 / m } else { 0.0 };
        for (r, f) in fits.iter().enumerate() {
            let sc = nearest_int(f.0 * inv(max_scale)).clamp(0, 15) as u8;
            let mn = nearest_int(f.1 * inv(max_min)).clamp(0, 15) as u8;
            b.scales[r] = sc | (mn << 4);
        }
        b.qs = [0; QK_K / 4];
        for (v, xv) in x.iter().enumerate() {
            let s = b.scales[run(v)];
            let dl = d * (s & 0x0F) as f32;
            let ml = dmin * (s >> 4) as f32;
            let q = if dl > 0.0 {
                nearest_int((xv + ml) / dl).clamp(0, 3) as u8
            } else {
                0
            };
            let (n, t, l) = (v / 128, (v % 128) / 32, v % 32);
            b.qs[32 * n + l] |= q << (2 * t);
        }
    }
}

/// `m_2k·bsum_2k + m_2k+1·bsum_2k+1` per lane `k` (exact).
#[inline(always)]
fn min_lanes(b: &BlockQ2K, y: &BlockQ8K) -> [i32; 8] {
    std::array::from_fn(|k| {
        (2 * k..2 * k + 2)
            .map(|r| (b.scales[r] >> 4) as i32 * y.bsums[r] as i32)
            .sum()
    })
}

pub(super) fn dot_scalar(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
    let mut lanes = [0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let d = y.d * f16_to_f32(x.d);
        let dmin = -y.d * f16_to_f32(x.dmin);
        for (l, m) in lanes.iter_mut().zip(min_lanes(x, y)) {
            *l = dmin.mul_add(m as f32, *l);
        }
        let mut sumi = [0i32; 8];
        for n in 0..2 {
            for t in 0..4 {
                let base = 128 * n + 32 * t;
                for (k, s) in sumi.iter_mut().enumerate() {
                    let sc = (x.scales[8 * n + 2 * t + k / 4] & 0x0F) as i32;
                    let p: i32 = (base + 4 * k..base + 4 * k + 4)
                        .map(|v| level(x, v) as i32 * y.qs[v] as i32)
                        .sum();
                    *s += sc * p;
                }
            }
        }
        for (l, s) in lanes.iter_mut().zip(sumi) {
            *l = d.mul_add(s as f32, *l);
        }
    }
    reduce8(&lanes)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
    use super::q8_k::x86::{fold, SCALE_PAIR};
    use std::arch::x86_64::*;
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    for (x, y) in w.iter().zip(a) {
        // SAFETY: F16C is present.
        let (xd, xdmin) = unsafe { (super::f16c(x.d), super::f16c(x.dmin)) };
        let d = y.d * xd;
        let dmin = -y.d * xdmin;
        // SAFETY (loads): 16 bytes of scales, 16 i16 of bsums, 32 bytes of qs at 32n (n < 2),
        // 32 bytes of activations at 128n + 32t < 256, 32 bytes of masks.
        let packed = unsafe { _mm_loadu_si128(x.scales.as_ptr().cast()) };
        let scales16 = _mm256_cvtepu8_epi16(_mm_and_si128(packed, m4));
        let mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), m4));
        let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr().cast()) };
        let prod = _mm256_madd_epi16(mins16, bsums);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), acc);
        // The 8 scales of half n in both 128-bit lanes.
        let halves = [
            _mm256_permute2x128_si256(scales16, scales16, 0x00),
            _mm256_permute2x128_si256(scales16, scales16, 0x11),
        ];
        let mut sumi = _mm256_setzero_si256();
        for (n, sc) in halves.iter().enumerate() {
            let mut q = unsafe { _mm256_loadu_si256(x.qs.as_ptr().add(32 * n).cast()) };
            for (t, mask) in SCALE_PAIR.iter().enumerate() {
                let yv = unsafe { _mm256_loadu_si256(y.qs.as_ptr().add(128 * n + 32 * t).cast()) };
                let mask = unsafe { _mm256_loadu_si256(mask.as_ptr().cast()) };
                // ≤ 2 · 3 · 127 per i16 lane: no saturation.
                let p = _mm256_maddubs_epi16(_mm256_and_si256(q, m3), yv);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_shuffle_epi8(*sc, mask)));
                // The next two bits into place (16-bit shifts; the mask drops what crossed bytes).
                q = _mm256_srli_epi16(q, 2);
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    // SAFETY: AVX2 is present.
    unsafe { fold(acc) }
}

super::format::kquant_format!(Q2K, Q2_K, BlockQ2K);

#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(target_arch = "x86_64")]
impl super::format::Kernel<Q2K> for super::format::Avx512 {
    /// AVX2's (the lanes kernel pays off only over many tokens).
    unsafe fn dot(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (the AVX-512 level includes AVX2's features).
        unsafe { dot_avx2(w, a) }
    }

    /// Groups (2–4 tokens, prefill's experts with few tokens) decode each block once.
    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ2K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { avx512::dot_n::<N>(w, a) }
    }

    const WIDE: bool = true;

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
}

/// The AVX-512 level: up to 16 tokens, one per i32 lane. A level (≤ 3) times its run's
/// 4-bit scale (≤ 15) fits a byte, so the row is decoded once per call into those products and
/// each 4 values take one `vpdpbusd` for all tokens.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::format::Activation;
    use super::super::q8_k::{by_row_steps, ActQ8K, LaneCache, LaneSums, Lanes};
    use super::super::{blocks, ActBuf};
    use super::{BlockQ2K, BlockQ8K};
    use std::arch::x86_64::*;

    /// One row's super-block decoded once per call: `sc_r · q` one byte per value in value
    /// order; the minimums' pairs `(m_2k, m_2k+1)` as two i16; `d` and `dmin` widened.
    #[repr(C, align(64))]
    struct Unpacked {
        q: [u8; 256],
        mins: [i32; 8],
        d: f32,
        dmin: f32,
    }

    thread_local! {
        /// The packed tokens and the unpacked rows of the current call.
        static LANES: std::cell::RefCell<(LaneCache, Vec<Unpacked>)> =
            std::cell::RefCell::new((LaneCache::default(), Vec::new()));
    }

    /// Rows `rows` against up to 16 activations, one per i32 lane ([`Lanes`], packed once per
    /// call and reused by every row), two rows at a time (each activation load serves both).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn dot_wide(
        w: &[u8],
        row_bytes: usize,
        rows: std::ops::Range<usize>,
        a: &[&ActBuf],
        out: &mut [&mut [f32]],
    ) {
        let nb = row_bytes / std::mem::size_of::<BlockQ2K>();
        let views: Vec<&[BlockQ8K]> = a.iter().map(|a| ActQ8K::view(a)).collect();
        let nb = views.iter().fold(nb, |n, v| n.min(v.len()));
        LANES.with(|cell| {
            let (cache, q) = &mut *cell.borrow_mut();
            let lanes = cache.pack_for(a, nb, LaneSums::Runs);
            if q.len() < 2 * nb {
                q.resize_with(2 * nb, || Unpacked {
                    q: [0; 256],
                    mins: [0; 8],
                    d: 0.0,
                    dmin: 0.0,
                });
            }
            let row =
                |r: usize| -> &[BlockQ2K] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
            by_row_steps::<2>(w, row_bytes, rows, out, |r, n| {
                let mut v = [[0f32; 16]; 2];
                // SAFETY: the caller's (this level's features are present).
                unsafe {
                    unpack_row(row(r), &mut q[..nb]);
                    if n == 2 {
                        unpack_row(row(r + 1), &mut q[nb..2 * nb]);
                        v = row_lanes::<2>(lanes, &q[..2 * nb], nb);
                    } else {
                        [v[0]] = row_lanes::<1>(lanes, &q[..nb], nb);
                    }
                }
                v
            });
        });
    }

    /// One block decoded in registers: `sc_r · q` one byte per value in value order (vector
    /// `c` holds values `64c .. 64c + 64`), and the 16 minimums as i16 (i32 lane `k` holds the
    /// pair `(m_2k, m_2k+1)`). Vector work only: the run's product comes from a 4-entry table
    /// per run (`sc · [0, 1, 2, 3]`, built for all 16 runs by one multiply) looked up by the
    /// level with `vpshufb`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn decode(x: &BlockQ2K) -> ([__m512i; 4], __m256i) {
        let m4 = _mm_set1_epi8(0x0F);
        // SAFETY: 16 bytes of scales.
        let packed = unsafe { _mm_loadu_si128(x.scales.as_ptr().cast()) };
        let sc = _mm512_cvtepu8_epi32(_mm_and_si128(packed, m4));
        // Dword r: bytes (0, sc_r, 2 sc_r, 3 sc_r); each ≤ 45, so no byte carries.
        let table = _mm512_mullo_epi32(sc, _mm512_set1_epi32(0x0302_0100));
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), m4));
        let m3 = _mm512_set1_epi8(3);
        let q = std::array::from_fn(|c| {
            let (n, t) = (c / 2, 2 * (c % 2));
            // SAFETY: 32 bytes inside qs (64 bytes), n < 2; 64-byte index rows.
            let (bits, idx) = unsafe {
                (
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(x.qs.as_ptr().add(32 * n).cast())),
                    _mm512_loadu_si512(super::super::RUN_IDX[c].as_ptr().cast()),
                )
            };
            // Group t's levels in the low 256 bits, group t + 1's in the high.
            let shift = _mm512_inserti64x4::<1>(
                _mm512_set1_epi16(2 * t as i16),
                _mm256_set1_epi16(2 * t as i16 + 2),
            );
            let levels = _mm512_and_si512(_mm512_srlv_epi16(bits, shift), m3);
            _mm512_shuffle_epi8(_mm512_permutexvar_epi32(idx, table), levels)
        });
        (q, mins)
    }

    /// Decodes each block of `w` into `q` (see [`Unpacked`]). Not inlined: the main loop must
    /// read these bytes from memory as broadcast loads.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline(never)]
    unsafe fn unpack_row(w: &[BlockQ2K], q: &mut [Unpacked]) {
        for (x, u) in w.iter().zip(q.iter_mut()) {
            // SAFETY: this level's features are present; 64-byte aligned stores inside
            // `u.q`, 32 bytes into `u.mins`.
            unsafe {
                let (v, mins) = decode(x);
                for (c, v) in v.into_iter().enumerate() {
                    _mm512_store_si512(u.q.as_mut_ptr().add(64 * c).cast(), v);
                }
                _mm256_storeu_si256(u.mins.as_mut_ptr().cast(), mins);
                u.d = super::super::f16c(x.d);
                u.dmin = super::super::f16c(x.dmin);
            }
        }
    }

    /// One row against `N` tokens (`N <= 8`; prefill's groups and the token left over): each
    /// block decoded once in registers ([`decode`]), then per token one `vpdpbusd` per 64
    /// values (lane `j` of vector `c` is values `4j .. 4j + 4` of group `2c + j / 8`, so the
    /// two 256-bit halves added give the scalar order's 8 lane sums exactly) and the
    /// minimums' `vpmaddwd` on the block sums; then the scalar's two fused multiply-adds per
    /// lane and the [`super::reduce8`] fold: the bits of [`super::dot_scalar`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    pub unsafe fn dot_n<const N: usize>(w: &[BlockQ2K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
        let mut acc = [_mm256_setzero_ps(); N];
        for (i, x) in w[..n].iter().enumerate() {
            // SAFETY: this level's features are present.
            let (q, mins) = unsafe { decode(x) };
            // SAFETY: F16C is present.
            let (xd, xdmin) = unsafe { (super::super::f16c(x.d), super::super::f16c(x.dmin)) };
            for (t, acc) in acc.iter_mut().enumerate() {
                let y = &a[t][i];
                // SAFETY: 16 i16 of bsums; 64-byte loads inside y.qs (256 bytes).
                let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr().cast()) };
                let m = _mm256_madd_epi16(mins, bsums);
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(-y.d * xdmin), _mm256_cvtepi32_ps(m), *acc);
                let mut s = [_mm512_setzero_si512(); 2];
                for (c, qc) in q.iter().enumerate() {
                    let yc = unsafe { _mm512_loadu_si512(y.qs.as_ptr().add(64 * c).cast()) };
                    // ≤ 4 · 45 · 127 per step: exact.
                    s[c % 2] = _mm512_dpbusd_epi32(s[c % 2], *qc, yc);
                }
                let s = _mm512_add_epi32(s[0], s[1]);
                let s8 =
                    _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64::<1>(s));
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(y.d * xd), _mm256_cvtepi32_ps(s8), *acc);
            }
        }
        // SAFETY: AVX2 is present.
        acc.map(|acc| unsafe { super::super::q8_k::x86::fold(acc) })
    }

    /// `R` rows (unpacked into `q`, `nb` blocks per row) against the packed tokens. Per block
    /// and lane `k` of the scalar order: first the minimums' term (`vpdpwssd` of the run sums
    /// with the minimum pairs) and its fused multiply-add, then the exact sum over the 8
    /// groups of `vpdpbusd` (4 scaled levels broadcast × each token's 4 activation bytes) and
    /// its fused multiply-add, into that token's accumulator `k`; the 8 accumulators are
    /// folded as [`super::reduce8`]: the bits of [`super::dot_scalar`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    // `k`, the scalar order's lane, indexes the packed tokens, the scales and every row's
    // accumulators alike; an iterator over one of them would hide that.
    #[allow(clippy::needless_range_loop)]
    unsafe fn row_lanes<const R: usize>(l: &Lanes, q: &[Unpacked], nb: usize) -> [[f32; 16]; R] {
        let mut acc = [[_mm512_setzero_ps(); 8]; R];
        let sign = _mm512_set1_ps(-0.0);
        for b in 0..nb {
            let u: [&Unpacked; R] = std::array::from_fn(|r| &q[r * nb + b]);
            // The block's 64 packed rows as one array: one bounds check per block, none in
            // the loops below (they were 8 compares and branches per lane and row step).
            let qs: &[[i32; 16]; 64] = l.qs[64 * b..64 * b + 64]
                .try_into()
                .expect("64 packed rows per block");
            // SAFETY: 16 floats.
            let d_a = unsafe { _mm512_loadu_ps(l.d[b].as_ptr()) };
            let neg_d_a = _mm512_xor_ps(d_a, sign);
            let d: [__m512; R] =
                std::array::from_fn(|r| _mm512_mul_ps(d_a, _mm512_set1_ps(u[r].d)));
            let dmin: [__m512; R] =
                std::array::from_fn(|r| _mm512_mul_ps(neg_d_a, _mm512_set1_ps(u[r].dmin)));
            for k in 0..8 {
                // SAFETY: 64 bytes of one packed row.
                let runs = unsafe { _mm512_loadu_si512(l.sums[8 * b + k].as_ptr().cast()) };
                for r in 0..R {
                    let m = _mm512_dpwssd_epi32(
                        _mm512_setzero_si512(),
                        runs,
                        _mm512_set1_epi32(u[r].mins[k]),
                    );
                    acc[r][k] = _mm512_fmadd_ps(dmin[r], _mm512_cvtepi32_ps(m), acc[r][k]);
                }
                let mut s = [_mm512_setzero_si512(); R];
                for g in 0..8 {
                    // SAFETY: 64 bytes of one packed row; 4 bytes inside each `q`.
                    let y = unsafe { _mm512_loadu_si512(qs[8 * g + k].as_ptr().cast()) };
                    for r in 0..R {
                        let wq = unsafe {
                            std::ptr::read_unaligned(
                                u[r].q.as_ptr().add(32 * g + 4 * k).cast::<i32>(),
                            )
                        };
                        // ≤ 4 · 45 · 127 per step: exact.
                        s[r] = _mm512_dpbusd_epi32(s[r], _mm512_set1_epi32(wq), y);
                    }
                }
                for r in 0..R {
                    acc[r][k] = _mm512_fmadd_ps(d[r], _mm512_cvtepi32_ps(s[r]), acc[r][k]);
                }
            }
        }
        std::array::from_fn(|r| {
            let a = &acc[r];
            // reduce8: halves, then quarters, then pairs.
            let h: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(a[i], a[i + 4]));
            let v = _mm512_add_ps(_mm512_add_ps(h[0], h[2]), _mm512_add_ps(h[1], h[3]));
            let mut o = [0f32; 16];
            // SAFETY: 16 floats.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
            o
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    /// The grouped kernel (1 to 4 tokens) and the lanes kernel (1 to 16 tokens, AVX-512)
    /// give each token the single dot's bits, for every row step they take.
    #[test]
    fn wide_dot_matches_single_dots_bits() {
        check_group_matches_single::<Q2K>(
            // Grouped at AVX-512 (the other x86-64 levels run single dots) and at every aarch64
            // level.
            cfg!(target_arch = "aarch64") || super::super::simd_level().name() == "avx512",
        );
    }

    /// ns per (block, token) at each level and width (`--ignored --nocapture`).
    #[test]
    #[ignore]
    fn group_speed() {
        print_group_speed::<Q2K>();
    }

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Q2K>(&[(1, 1), (2, 3), (3, 16)], 50);
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Q2K>(&[221, 222, 223]);
    }

    /// ggml's per-value decoding, written out from the layout.
    #[test]
    fn dequantize_follows_the_layout() {
        let raw = bytes(12, 84 * 2);
        let got = dequantized(GgmlType::Q2_K, &raw);
        for (b, y) in raw.chunks(84).zip(got.chunks(256)) {
            let d = f16_to_f32([b[80], b[81]]);
            let dmin = f16_to_f32([b[82], b[83]]);
            let mut v = 0;
            for n in 0..2 {
                for shift in [0, 2, 4, 6] {
                    for l in 0..32 {
                        let s = b[v / 16];
                        let q = (b[16 + 32 * n + l] >> shift) & 3;
                        let want = d * (s & 15) as f32 * q as f32 - dmin * (s >> 4) as f32;
                        assert_eq!(y[v].to_bits(), want.to_bits(), "value {v}");
                        v += 1;
                    }
                }
            }
        }
    }

    #[test]
    fn round_trip_error_within_budget() {
        // 4 levels per run of 16: coarse by design (≈ range/3/√12 ≈ 0.25σ before the fits).
        let rel = relative_rms_error(GgmlType::Q2_K, &values(9, QK_K * 64, 1.0));
        assert!(rel < 0.33, "relative rmse {rel}");
        let flat = round_trip(GgmlType::Q2_K, &[0.0; QK_K]);
        assert!(flat.iter().all(|v| *v == 0.0));
    }
}
