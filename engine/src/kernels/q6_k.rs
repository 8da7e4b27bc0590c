//! Q6_K: super-blocks of 256 6-bit values in 16 runs of 16, each with a signed 8-bit scale,
//! under an f16 super-scale: value = d · sc_j · (q − 32). The token embedding and some
//! ffn_down tensors of Q4_K_M files. Dotted against Q8_K activations.
//!
//! Layout (210 bytes): `ql[128]` (low 4 bits), `qh[64]` (high 2 bits), `scales[16]` (i8), `d`
//! (f16). Each half `h` of 128 values uses `ql[64h..]` and `qh[32h..]`: for `l < 32`, value
//! `l` is `ql[l] & 15` with bits 0–1 of `qh[l]`; `l + 32` is `ql[l + 32] & 15` with bits 2–3;
//! `l + 64` is `ql[l] >> 4` with bits 4–5; `l + 96` is `ql[l + 32] >> 4` with bits 6–7. Value
//! `i` of the super-block uses `scales[i / 16]`.
//!
//! Summation order (llama.cpp's x86 `ggml_vec_dot_q6_K_q8_K`, shared by every path): 8 lane
//! accumulators, one fused multiply-add per super-block each, `lane_k = fma(d_a·d, sumi_k,
//! lane_k)`, folded by [`reduce8`]. `sumi_k` is exact: over the 8 groups of 32 values,
//! `sc · Σ q·a` for values `4k .. 4k + 4` of the group (q unsigned, 0..=63), minus the offset
//! `32 · (sc_2k·bsum_2k + sc_2k+1·bsum_2k+1)` (runs `2k`, `2k + 1`), as llama.cpp partitions it.

use super::q8_k::{BlockQ8K, QK_K};
use super::{f16_to_f32, f32_to_f16, max_by_magnitude, nearest_int, reduce8, RawBlock};

/// One Q6_K super-block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ6K {
    ql: [u8; QK_K / 2],
    qh: [u8; QK_K / 4],
    scales: [i8; QK_K / 16],
    d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ6K {}

/// Absmax quantizer: per run of 16 the value of largest magnitude maps to −32; the 16 scales
/// are quantized to i8 under an f16 super-scale, and the levels recomputed with the stored
/// scales.
pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ6K]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
        let mut scale = [0f32; 16];
        for (s, run) in scale.iter_mut().zip(x.chunks_exact(16)) {
            *s = max_by_magnitude(run) / -32.0;
        }
        let max_scale = max_by_magnitude(&scale);
        let iscale = if max_scale != 0.0 {
            -128.0 / max_scale
        } else {
            0.0
        };
        let d = f32_to_f16(if iscale != 0.0 { 1.0 / iscale } else { 0.0 });
        let d_f = f16_to_f32(d);
        let mut levels = [32u8; QK_K];
        for (j, s) in scale.iter().enumerate() {
            let sc = nearest_int(iscale * s).clamp(-128, 127) as i8;
            b.scales[j] = sc;
            let dl = d_f * sc as f32;
            if dl != 0.0 {
                for i in 16 * j..16 * j + 16 {
                    levels[i] = (nearest_int(x[i] / dl).clamp(-32, 31) + 32) as u8;
                }
            }
        }
        b.d = d;
        for h in 0..2 {
            let lv = &levels[128 * h..128 * h + 128];
            for l in 0..32 {
                b.ql[64 * h + l] = (lv[l] & 0x0F) | ((lv[l + 64] & 0x0F) << 4);
                b.ql[64 * h + l + 32] = (lv[l + 32] & 0x0F) | ((lv[l + 96] & 0x0F) << 4);
                b.qh[32 * h + l] = (lv[l] >> 4)
                    | ((lv[l + 32] >> 4) << 2)
                    | ((lv[l + 64] >> 4) << 4)
                    | ((lv[l + 96] >> 4) << 6);
            }
        }
    }
}

/// The four levels (0..=63) sharing `ql[64h + l]`, `ql[64h + l + 32]` and `qh[32h + l]`: values
/// `l`, `l + 32`, `l + 64`, `l + 96` of half `h`.
#[inline(always)]
fn levels(b: &BlockQ6K, h: usize, l: usize) -> [u8; 4] {
    let a = b.ql[64 * h + l];
    let c = b.ql[64 * h + l + 32];
    let q = b.qh[32 * h + l];
    [
        (a & 0x0F) | ((q & 3) << 4),
        (c & 0x0F) | (((q >> 2) & 3) << 4),
        (a >> 4) | (((q >> 4) & 3) << 4),
        (c >> 4) | (((q >> 6) & 3) << 4),
    ]
}

pub(super) fn dequantize(src: &[BlockQ6K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        for h in 0..2 {
            for l in 0..32 {
                for (t, q) in levels(b, h, l).into_iter().enumerate() {
                    let i = 128 * h + 32 * t + l;
                    y[i] = d * b.scales[i / 16] as f32 * (q as i32 - 32) as f32;
                }
            }
        }
    }
}

super::format::kquant_format!(Q6K, Q6_K, BlockQ6K, grouped);

#[cfg(target_arch = "aarch64")]
pub(super) mod neon;

pub(super) fn dot_scalar(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
    let mut lanes = [0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let mut sumi = [0i32; 8];
        for h in 0..2 {
            for l in 0..32 {
                for (t, q) in levels(x, h, l).into_iter().enumerate() {
                    // Value 128h + 32t + l: group 4h + t, lane l / 4, run of 16 (l / 16).
                    let v = 128 * h + 32 * t + l;
                    sumi[l / 4] += x.scales[v / 16] as i32 * (q as i32 * y.qs[v] as i32);
                }
            }
        }
        for (k, s) in sumi.iter_mut().enumerate() {
            let offset = x.scales[2 * k] as i32 * y.bsums[2 * k] as i32
                + x.scales[2 * k + 1] as i32 * y.bsums[2 * k + 1] as i32;
            *s -= 32 * offset;
        }
        let d = y.d * f16_to_f32(x.d);
        for (l, s) in lanes.iter_mut().zip(sumi) {
            *l = d.mul_add(s as f32, *l);
        }
    }
    reduce8(&lanes)
}

/// `pshufb` masks: pair `p` broadcasts scale byte `2p` to bytes 0–7 and `2p + 1` to 8–15.
#[cfg(target_arch = "x86_64")]
const SCALE_SHUFFLE: [[u8; 16]; 8] = {
    let mut m = [[0u8; 16]; 8];
    let mut p = 0;
    while p < 8 {
        let mut i = 0;
        while i < 16 {
            m[p][i] = (2 * p + i / 8) as u8;
            i += 1;
        }
        p += 1;
    }
    m
};

/// The levels (0..=63) of half `h` (< 2) of `x` as four vectors of 32 bytes: values
/// `128h + 32t .. 128h + 32t + 32` in vector `t` (the vector form of [`levels`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn levels_avx2(x: &BlockQ6K, h: usize) -> [std::arch::x86_64::__m256i; 4] {
    use std::arch::x86_64::*;
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    // SAFETY: 32-byte loads inside ql (128) and qh (64), as h < 2.
    let (ql0, ql1, qh) = unsafe {
        (
            _mm256_loadu_si256(x.ql.as_ptr().add(64 * h).cast()),
            _mm256_loadu_si256(x.ql.as_ptr().add(64 * h + 32).cast()),
            _mm256_loadu_si256(x.qh.as_ptr().add(32 * h).cast()),
        )
    };
    // Bits 2t..2t+2 of each qh byte move to bits 4–5 (16-bit shifts; the mask keeps
    // only bits that came from the same byte).
    [
        _mm256_or_si256(
            _mm256_and_si256(ql0, m4),
            _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(ql1, m4),
            _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
            _mm256_and_si256(qh, m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
        ),
    ]
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
    use super::q8_k::x86::fold;
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    for (x, y) in w.iter().zip(a) {
        // SAFETY: scales is 16 bytes, bsums 16 i16 (32 bytes).
        let (scales8, bsums) = unsafe {
            (
                _mm_loadu_si128(x.scales.as_ptr().cast()),
                _mm256_loadu_si256(y.bsums.as_ptr().cast()),
            )
        };
        // Σ_j sc_j · bsum_j: 32 times it is the offset of q − 32.
        let offset = _mm256_madd_epi16(_mm256_cvtepi8_epi16(scales8), bsums);
        let mut sumi = _mm256_setzero_si256();
        for h in 0..2 {
            let q = unsafe { levels_avx2(x, h) };
            for (t, qt) in q.into_iter().enumerate() {
                // SAFETY: 32-byte load inside y.qs (256 bytes); the mask table has 8 entries,
                // 4h + t < 8.
                let (yv, mask) = unsafe {
                    (
                        _mm256_loadu_si256(y.qs.as_ptr().add(128 * h + 32 * t).cast()),
                        _mm_loadu_si128(SCALE_SHUFFLE[4 * h + t].as_ptr().cast()),
                    )
                };
                let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales8, mask));
                // ≤ 2 · 63 · 127 per i16 lane: no saturation.
                let p = _mm256_maddubs_epi16(qt, yv);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sc));
            }
        }
        let sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5));
        // SAFETY: F16C is present.
        let d = y.d * unsafe { super::f16c(x.d) };
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    // SAFETY: AVX2 is present.
    unsafe { fold(acc) }
}

/// `N` dots of one row at once: the 6-bit values and scale vectors are built once per group of
/// 32; each activation keeps its own exact sum and the float steps of [`dot_avx2`] (kept
/// separate because the single dot is faster with fewer live registers; the tests check the
/// two agree bit for bit).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_n_avx2<const N: usize>(w: &[BlockQ6K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    use super::q8_k::x86::fold;
    use std::arch::x86_64::*;
    let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
    let mut acc = [_mm256_setzero_ps(); N];
    for (i, x) in w[..n].iter().enumerate() {
        // SAFETY: scales is 16 bytes.
        let scales8 = unsafe { _mm_loadu_si128(x.scales.as_ptr().cast()) };
        let scales16 = _mm256_cvtepi8_epi16(scales8);
        let mut sumi = [_mm256_setzero_si256(); N];
        for h in 0..2 {
            let q = unsafe { levels_avx2(x, h) };
            for (k, qk) in q.into_iter().enumerate() {
                // SAFETY: the mask table has 8 entries, 4h + k < 8.
                let mask = unsafe { _mm_loadu_si128(SCALE_SHUFFLE[4 * h + k].as_ptr().cast()) };
                let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales8, mask));
                for (t, s) in sumi.iter_mut().enumerate() {
                    // SAFETY: 32-byte load inside y.qs (256 bytes).
                    let yv = unsafe {
                        _mm256_loadu_si256(a[t][i].qs.as_ptr().add(128 * h + 32 * k).cast())
                    };
                    // ≤ 2 · 63 · 127 per i16 lane: no saturation.
                    let p = _mm256_maddubs_epi16(qk, yv);
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, sc));
                }
            }
        }
        for t in 0..N {
            let y = &a[t][i];
            // SAFETY: bsums is 16 i16 (32 bytes).
            let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr().cast()) };
            // Lane k: sc_2k·bsum_2k + sc_2k+1·bsum_2k+1; 32 times it is the offset of q − 32.
            let offset = _mm256_madd_epi16(scales16, bsums);
            let s = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(offset, 5));
            // SAFETY: F16C is present.
            let d = y.d * unsafe { super::f16c(x.d) };
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s), acc[t]);
        }
    }
    // SAFETY: AVX2 is present.
    acc.map(|v| unsafe { fold(v) })
}

#[cfg(target_arch = "x86_64")]
impl super::format::Kernel<Q6K> for super::format::Avx512 {
    /// AVX2's (the lanes kernel pays off only over many tokens).
    unsafe fn dot(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (the AVX-512 level includes AVX2's features).
        unsafe { dot_avx2(w, a) }
    }

    /// AVX2's grouped dot for the token groups too narrow for the lanes kernel.
    const GROUPED: bool = true;

    const WIDE: bool = true;

    /// The lanes kernel costs about the same per call at any width (~65 ns per block in L2,
    /// 16 tokens 4.1 ns per token, 8 tokens 8.1), the AVX2 groups 6.1 per token in fours:
    /// 8–10 tokens are cheaper as groups (8: 48.8 against 65 ns per block), 11 and more as
    /// one lanes call. Prefill CPU time of `small` Q4_K_M did not move (1.00).
    const WIDE_MIN: usize = 11;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ6K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n_avx2::<N>(w, a) }
    }

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

/// The AVX-512 level: up to 16 tokens, one per i32 lane, so each weight value is decoded once
/// per row for all of them (the AVX2 dots decode it once per token or per group of 4).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::format::Activation;
    use super::super::q8_k::{by_row_steps, ActQ8K, LaneCache, LaneSums, Lanes};
    use super::super::{blocks, ActBuf};
    use super::{levels_avx2, BlockQ6K, BlockQ8K};
    use std::arch::x86_64::*;

    /// One row's super-block decoded once per call: the levels (0..=63) one byte per value in
    /// value order; per run of 16 its scale twice as an i16 pair (`vpdpwssd` applies it to
    /// both halves of a `vpmaddubsw` result); the offset's scale pairs `(sc_2k, sc_2k+1)`.
    #[repr(C, align(64))]
    struct Unpacked {
        q: [u8; 256],
        sc: [i32; 16],
        off: [i32; 8],
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
        let nb = row_bytes / std::mem::size_of::<BlockQ6K>();
        let views: Vec<&[BlockQ8K]> = a.iter().map(|a| ActQ8K::view(a)).collect();
        let nb = views.iter().fold(nb, |n, v| n.min(v.len()));
        LANES.with(|cell| {
            let (cache, q) = &mut *cell.borrow_mut();
            let lanes = cache.pack_for(a, nb, LaneSums::Runs);
            if q.len() < 2 * nb {
                q.resize_with(2 * nb, || Unpacked {
                    q: [0; 256],
                    sc: [0; 16],
                    off: [0; 8],
                });
            }
            let row =
                |r: usize| -> &[BlockQ6K] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
            by_row_steps::<2>(w, row_bytes, rows, out, |r, n| {
                let mut v = [[0f32; 16]; 2];
                // SAFETY: the caller's (this level's features are present).
                unsafe {
                    unpack_row(row(r), &mut q[..nb]);
                    if n == 2 {
                        unpack_row(row(r + 1), &mut q[nb..2 * nb]);
                        v = row_lanes::<2>([row(r), row(r + 1)], lanes, q);
                    } else {
                        [v[0]] = row_lanes::<1>([row(r)], lanes, q);
                    }
                }
                v
            });
        });
    }

    /// Decodes each block of `w` into `q` (see [`Unpacked`]). Not inlined: the main loop must
    /// read these bytes from memory as broadcast loads.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline(never)]
    unsafe fn unpack_row(w: &[BlockQ6K], q: &mut [Unpacked]) {
        for (x, u) in w.iter().zip(q.iter_mut()) {
            for h in 0..2 {
                // SAFETY: h < 2; 32-byte stores inside `u.q` (256 bytes).
                unsafe {
                    let l = levels_avx2(x, h);
                    for (t, v) in l.into_iter().enumerate() {
                        _mm256_store_si256(u.q.as_mut_ptr().add(128 * h + 32 * t).cast(), v);
                    }
                }
            }
            for (j, s) in u.sc.iter_mut().enumerate() {
                let v = x.scales[j] as i16 as u16 as i32;
                *s = v | (v << 16);
            }
            for (k, o) in u.off.iter_mut().enumerate() {
                let (lo, hi) = (x.scales[2 * k] as i16, x.scales[2 * k + 1] as i16);
                *o = (lo as u16 as i32) | ((hi as u16 as i32) << 16);
            }
        }
    }

    /// `R` rows (unpacked into `q`, `nb` blocks per row) against the packed tokens. Lane `k`
    /// of the scalar order (values `4k .. 4k + 4` of each group of 32) is its own loop: per
    /// group, one `vpmaddubsw` (the 4 levels broadcast × each token's 4 activation bytes, as
    /// two i16 pair sums ≤ 2 · 63 · 127) and one `vpdpwssd` applying the run's scale into the
    /// lane's exact sum; minus 32 times the offset from the run sums (`vpdpwssd` with the
    /// scale pairs). Each token's lane then takes the scalar fused multiply-add into its own
    /// accumulator `k`, and the 8 accumulators are folded as [`super::reduce8`]: the bits of
    /// [`super::dot_scalar`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    // `k`, the scalar order's lane, indexes the packed tokens, the scales and every row's
    // accumulators alike; an iterator over one of them would hide that.
    #[allow(clippy::needless_range_loop)]
    unsafe fn row_lanes<const R: usize>(
        w: [&[BlockQ6K]; R],
        l: &Lanes,
        q: &[Unpacked],
    ) -> [[f32; 16]; R] {
        let nb = w[0].len();
        let mut acc = [[_mm512_setzero_ps(); 8]; R];
        for b in 0..nb {
            let u: [&Unpacked; R] = std::array::from_fn(|r| &q[r * nb + b]);
            // SAFETY: 16 floats; F16C is present.
            let d_a = unsafe { _mm512_loadu_ps(l.d[b].as_ptr()) };
            let d: [__m512; R] = std::array::from_fn(|r| {
                _mm512_mul_ps(
                    d_a,
                    _mm512_set1_ps(unsafe { super::super::f16c(w[r][b].d) }),
                )
            });
            for k in 0..8 {
                let mut s = [_mm512_setzero_si512(); R];
                for g in 0..8 {
                    // SAFETY: 64 bytes of one packed row; 4 bytes inside each `q`.
                    let y = unsafe { _mm512_loadu_si512(l.qs[64 * b + 8 * g + k].as_ptr().cast()) };
                    for r in 0..R {
                        let wq = unsafe {
                            std::ptr::read_unaligned(
                                u[r].q.as_ptr().add(32 * g + 4 * k).cast::<i32>(),
                            )
                        };
                        let p = _mm512_maddubs_epi16(_mm512_set1_epi32(wq), y);
                        s[r] =
                            _mm512_dpwssd_epi32(s[r], p, _mm512_set1_epi32(u[r].sc[2 * g + k / 4]));
                    }
                }
                // SAFETY: 64 bytes of one packed row.
                let runs = unsafe { _mm512_loadu_si512(l.sums[8 * b + k].as_ptr().cast()) };
                for r in 0..R {
                    let off = _mm512_dpwssd_epi32(
                        _mm512_setzero_si512(),
                        runs,
                        _mm512_set1_epi32(u[r].off[k]),
                    );
                    let sumi = _mm512_sub_epi32(s[r], _mm512_slli_epi32::<5>(off));
                    acc[r][k] = _mm512_fmadd_ps(d[r], _mm512_cvtepi32_ps(sumi), acc[r][k]);
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

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Q6K>(&[(1, 1), (2, 3), (3, 16)], 50);
    }

    /// ns per (super-block, token) at each level and group width (`--ignored --nocapture`).
    #[test]
    #[ignore]
    fn group_speed() {
        print_group_speed::<Q6K>();
    }

    /// Every level above scalar has a grouped kernel (AVX2, NEON, dotprod), so the best does.
    #[test]
    fn group_dot_matches_single_dots_bits() {
        check_group_matches_single::<Q6K>(true);
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Q6K>(&[61, 62, 63]);
    }

    #[test]
    fn round_trip_error_within_budget() {
        // 64 levels over ±amax of each run of 16: step amax/32, rmse ≈ step/√12.
        let rel = relative_rms_error(GgmlType::Q6_K, &values(9, QK_K * 64, 1.0));
        assert!(rel < 0.04, "relative rmse {rel}");
        let flat = round_trip(GgmlType::Q6_K, &[0.0; QK_K]);
        assert!(flat.iter().all(|v| *v == 0.0));
    }
}
