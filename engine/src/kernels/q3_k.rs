//! Q3_K: super-blocks of 256 3-bit levels in 16 runs of 16, each run with a signed 6-bit scale
//! under an f16 super-scale: value = d · (sc_r − 32) · q, q in −4..=3. The expert format of
//! Q3_K_S/M/L files and Q2_K files' `ffn_down`. Dotted against Q8_K activations.
//!
//! Layout (110 bytes): `hmask[32]`, `qs[64]`, `scales[12]`, `d` (f16). Value
//! `128n + 32t + l` (`n` < 2, `t` < 4, `l` < 32) has its low two bits in bits `2t .. 2t + 2` of
//! `qs[32n + l]` and its high bit in bit `4n + t` of `hmask[l]`; q = low − 4 when that bit is
//! clear, low when it is set. Run `r` = `8n + 2t + l / 16` has the 6-bit scale whose low 4
//! bits are nibble `r / 8` of `scales[r % 8]` and whose top 2 bits are bits `2(r / 4)` of
//! `scales[8 + r % 4]` ([`unpack_scales`]).
//!
//! Summation order (llama.cpp's x86 `ggml_vec_dot_q3_K_q8_K`, shared by every path): 8 lane
//! accumulators, one fused multiply-add per super-block each, `lane_k = fma(d_a·d, sumi_k,
//! lane_k)`, where `sumi_k` sums exactly, over the 8 groups of 32 values, `(sc − 32) · Σ q·a`
//! over values `4k .. 4k + 4` of the group; folded by [`reduce8`] at the end.

use super::q8_k::{BlockQ8K, QK_K};
use super::{f16_to_f32, f32_to_f16, max_by_magnitude, nearest_int, reduce8, RawBlock};

/// One Q3_K super-block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ3K {
    hmask: [u8; QK_K / 8],
    qs: [u8; QK_K / 4],
    scales: [u8; 12],
    d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ3K {}

/// The 16 run scales as stored (0..=63; the value's scale is this − 32), decoded four at a
/// time with word arithmetic: the four little-endian words of [`unpack_scales`].
#[inline(always)]
fn scale_words(s: &[u8; 12]) -> [u32; 4] {
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let a0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let a1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let a2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    [
        (a0 & LOW4) | ((a2 & LOW2) << 4),
        (a1 & LOW4) | (((a2 >> 2) & LOW2) << 4),
        ((a0 >> 4) & LOW4) | (((a2 >> 4) & LOW2) << 4),
        ((a1 >> 4) & LOW4) | (((a2 >> 6) & LOW2) << 4),
    ]
}

/// The 16 run scales as stored (0..=63; the value's scale is this − 32).
#[inline(always)]
pub(super) fn unpack_scales(s: &[u8; 12]) -> [u8; 16] {
    let words = scale_words(s);
    std::array::from_fn(|r| (words[r / 4] >> (8 * (r % 4))) as u8)
}

/// The inverse of [`unpack_scales`] (inputs ≤ 63).
fn pack_scales(sc: &[u8; 16]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for (r, &v) in sc.iter().enumerate() {
        s[r % 8] |= (v & 0x0F) << (4 * (r / 8));
        s[8 + r % 4] |= ((v >> 4) & 3) << (2 * (r / 4));
    }
    s
}

/// The level (−4..=3) of value `v` of a super-block.
#[inline(always)]
fn level(b: &BlockQ3K, v: usize) -> i8 {
    let (n, t, l) = (v / 128, (v % 128) / 32, v % 32);
    let low = ((b.qs[32 * n + l] >> (2 * t)) & 3) as i8;
    let high = (b.hmask[l] >> (4 * n + t)) & 1;
    if high == 1 {
        low
    } else {
        low - 4
    }
}

pub(super) fn dequantize(src: &[BlockQ3K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let sc = unpack_scales(&b.scales);
        for (v, o) in y.iter_mut().enumerate() {
            let dl = d * (sc[v / 16] as i32 - 32) as f32;
            *o = dl * level(b, v) as f32;
        }
    }
}

/// Absmax quantizer: per run of 16 the value of largest magnitude maps to −4; the 16 run
/// scales to signed 6 bits under the f16 super-scale (the largest in magnitude to −32); then
/// each run's scale is refit by least squares on its levels if that rounds to a better stored
/// scale, and the levels are recomputed against the stored scales.
pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ3K]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
        let mut scale = [0f32; 16];
        for (s, r) in scale.iter_mut().zip(x.chunks_exact(16)) {
            let first = max_by_magnitude(r) / -4.0;
            *s = first;
            if first != 0.0 {
                // Least squares on the levels the first scale picks.
                let (num, den) = r.iter().fold((0f32, 0f32), |(n, d), v| {
                    let q = nearest_int(v / first).clamp(-4, 3) as f32;
                    (n + v * q, d + q * q)
                });
                let err = |s: f32| -> f32 {
                    r.iter()
                        .map(|v| (v - s * nearest_int(v / s).clamp(-4, 3) as f32).powi(2))
                        .sum()
                };
                if den > 0.0 {
                    let refit = num / den;
                    if refit != 0.0 && err(refit) < err(first) {
                        *s = refit;
                    }
                }
            }
        }
        let max_scale = max_by_magnitude(&scale);
        let iscale = if max_scale != 0.0 {
            -32.0 / max_scale
        } else {
            0.0
        };
        b.d = f32_to_f16(if iscale != 0.0 { 1.0 / iscale } else { 0.0 });
        let d = f16_to_f32(b.d);
        let sc: [u8; 16] =
            std::array::from_fn(|r| (nearest_int(iscale * scale[r]).clamp(-32, 31) + 32) as u8);
        b.scales = pack_scales(&sc);
        b.hmask = [0; QK_K / 8];
        b.qs = [0; QK_K / 4];
        for (v, xv) in x.iter().enumerate() {
            let dl = d * (sc[v / 16] as i32 - 32) as f32;
            let q = if dl != 0.0 {
                nearest_int(xv / dl).clamp(-4, 3)
            } else {
                0
            };
            let (n, t, l) = (v / 128, (v % 128) / 32, v % 32);
            // q ≥ 0: high bit set, low = q; q < 0: high bit clear, low = q + 4.
            let (low, high) = if q >= 0 { (q, 1) } else { (q + 4, 0) };
            b.qs[32 * n + l] |= (low as u8) << (2 * t);
            b.hmask[l] |= high << (4 * n + t);
        }
    }
}

pub(super) fn dot_scalar(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
    let mut lanes = [0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let d = y.d * f16_to_f32(x.d);
        let sc = unpack_scales(&x.scales);
        let mut sumi = [0i32; 8];
        for n in 0..2 {
            for t in 0..4 {
                let base = 128 * n + 32 * t;
                for (k, s) in sumi.iter_mut().enumerate() {
                    let scale = sc[8 * n + 2 * t + k / 4] as i32 - 32;
                    let p: i32 = (base + 4 * k..base + 4 * k + 4)
                        .map(|v| level(x, v) as i32 * y.qs[v] as i32)
                        .sum();
                    *s += scale * p;
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
unsafe fn dot_avx2(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
    use super::q8_k::x86::{fold, SCALE_PAIR};
    use std::arch::x86_64::*;
    let m3 = _mm256_set1_epi8(3);
    let one = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    for (x, y) in w.iter().zip(a) {
        // SAFETY: F16C is present.
        let d = y.d * unsafe { super::f16c(x.d) };
        // The words straight into a register (a byte array through the stack would stall the
        // vector load on store forwarding).
        let w4 = scale_words(&x.scales);
        let sc8 = _mm_setr_epi32(w4[0] as i32, w4[1] as i32, w4[2] as i32, w4[3] as i32);
        // SAFETY (loads): 32 bytes of hmask, 32 bytes of qs at 32n (n < 2), 32 activation
        // bytes at 128n + 32t < 256, 32-byte masks.
        let scales16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(sc8), _mm256_set1_epi16(32));
        let halves = [
            _mm256_permute2x128_si256(scales16, scales16, 0x00),
            _mm256_permute2x128_si256(scales16, scales16, 0x11),
        ];
        // Bit 4n + t of each hmask byte; shifted right one place per group of 32.
        let mut hbits = unsafe { _mm256_loadu_si256(x.hmask.as_ptr().cast()) };
        let mut sumi = _mm256_setzero_si256();
        for (n, scn) in halves.iter().enumerate() {
            let mut q = unsafe { _mm256_loadu_si256(x.qs.as_ptr().add(32 * n).cast()) };
            for (t, mask) in SCALE_PAIR.iter().enumerate() {
                let yv = unsafe { _mm256_loadu_si256(y.qs.as_ptr().add(128 * n + 32 * t).cast()) };
                let mask = unsafe { _mm256_loadu_si256(mask.as_ptr().cast()) };
                let low = _mm256_and_si256(q, m3);
                // 4 where the high bit is clear, else 0.
                let minus = _mm256_slli_epi16(_mm256_andnot_si256(hbits, one), 2);
                // Each ≤ 2 · 4 · 127 per i16 lane: no saturation; the difference is exact.
                let p = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(low, yv),
                    _mm256_maddubs_epi16(minus, yv),
                );
                sumi =
                    _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_shuffle_epi8(*scn, mask)));
                q = _mm256_srli_epi16(q, 2);
                hbits = _mm256_srli_epi16(hbits, 1);
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    // SAFETY: AVX2 is present.
    unsafe { fold(acc) }
}

super::format::kquant_format!(Q3K, Q3_K, BlockQ3K);

#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(target_arch = "x86_64")]
impl super::format::Kernel<Q3K> for super::format::Avx512 {
    /// AVX2's (the lanes kernel pays off only over many tokens).
    unsafe fn dot(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (the AVX-512 level includes AVX2's features).
        unsafe { dot_avx2(w, a) }
    }

    /// Groups of 4 tokens (prefill's experts with few tokens) decode each block once; 2 or 3
    /// go through single dots (the decoding costs about a token's work: in L2, ns per block
    /// and token under load 8–10, single 15.0–15.4, grouped ×2 20.7, ×3 15.4–16.3, ×4
    /// 12.9–13.4).
    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ3K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY (both): the caller's.
        if N >= 4 {
            unsafe { avx512::dot_n::<N>(w, a) }
        } else {
            a.map(|a| unsafe { dot_avx2(w, a) })
        }
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

/// The AVX-512 level. The lanes kernel (up to 16 tokens, one per i32 lane) decodes each row
/// once per call into signed bytes `−(sc − 32) · q`, the run scale folded in, and takes one
/// `vpdpbusd` per 4 values and token against the activations offset to unsigned `a + 128`;
/// a per-row correction from the bytes' sums removes the offset exactly ([`row_lanes`]).
/// The grouped kernel (4 to 8 tokens) decodes in registers: `q + 4` (0..=7, unsigned) into
/// `vpmaddubsw`, minus 4 times the activations' pair sums, then `vpdpwssd` applies the run's
/// scale.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::format::Activation;
    use super::super::q8_k::{by_row_steps, ActQ8K, LaneCache, LaneSums, Lanes};
    use super::super::{blocks, ActBuf};
    use super::{BlockQ3K, BlockQ8K};
    use std::arch::x86_64::*;

    /// One row's super-block decoded once per call: per value its level times its run's
    /// negated scale, `−(sc − 32) · q` (−124..=128 negated: −128..=124, one signed byte), in
    /// value order; per scalar-order lane `k` the correction `−128 · Σ` of those bytes over
    /// values `4k .. 4k + 4` of the 8 groups; `d` widened.
    #[repr(C, align(64))]
    struct Unpacked {
        v: [i8; 256],
        corr: [i32; 8],
        d: f32,
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
        let nb = row_bytes / std::mem::size_of::<BlockQ3K>();
        let views: Vec<&[BlockQ8K]> = a.iter().map(|a| ActQ8K::view(a)).collect();
        let nb = views.iter().fold(nb, |n, v| n.min(v.len()));
        LANES.with(|cell| {
            let (cache, q) = &mut *cell.borrow_mut();
            // The block sums are not read; the smallest layout.
            let lanes = cache.pack_for(a, nb, LaneSums::Pairs);
            if q.len() < 2 * nb {
                q.resize_with(2 * nb, || Unpacked {
                    v: [0; 256],
                    corr: [0; 8],
                    d: 0.0,
                });
            }
            let row =
                |r: usize| -> &[BlockQ3K] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
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

    /// One block decoded in registers: `q + 4` one byte per value in value order (vector `c`
    /// holds values `64c .. 64c + 64`, groups `2c` and `2c + 1`), and the 16 run scales
    /// `sc − 32`, each twice as an i16 pair in i32 lane `r`. Vector work only.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn decode(x: &BlockQ3K) -> ([__m512i; 4], __m512i) {
        let w4 = super::scale_words(&x.scales);
        let sc8 = _mm_setr_epi32(w4[0] as i32, w4[1] as i32, w4[2] as i32, w4[3] as i32);
        let sc = _mm512_sub_epi32(_mm512_cvtepu8_epi32(sc8), _mm512_set1_epi32(32));
        let sc = _mm512_or_si512(
            _mm512_and_si512(sc, _mm512_set1_epi32(0xFFFF)),
            _mm512_slli_epi32::<16>(sc),
        );
        let m3 = _mm512_set1_epi8(3);
        let four = _mm512_set1_epi8(4);
        // SAFETY: 32 bytes of hmask.
        let hm = unsafe { _mm512_broadcast_i64x4(_mm256_loadu_si256(x.hmask.as_ptr().cast())) };
        let q = std::array::from_fn(|c| {
            let (n, t) = (c / 2, 2 * (c % 2));
            // SAFETY: 32 bytes inside qs (64 bytes), n < 2.
            let bits = unsafe {
                _mm512_broadcast_i64x4(_mm256_loadu_si256(x.qs.as_ptr().add(32 * n).cast()))
            };
            // Group t's in the low 256 bits, group t + 1's in the high.
            let halves = |lo: i32, hi: i32| {
                _mm512_inserti64x4::<1>(_mm512_set1_epi16(lo as i16), _mm256_set1_epi16(hi as i16))
            };
            let low = _mm512_and_si512(
                _mm512_srlv_epi16(bits, halves(2 * t as i32, 2 * t as i32 + 2)),
                m3,
            );
            // The high bit (4n + t of each hmask byte) moved to bit 2: + 4 when set.
            let hb = (4 * n + t) as i32;
            let h = _mm512_sllv_epi16(
                _mm512_srlv_epi16(hm, halves((hb - 2).max(0), (hb - 1).max(0))),
                halves((2 - hb).max(0), (1 - hb).max(0)),
            );
            _mm512_or_si512(low, _mm512_and_si512(h, four))
        });
        (q, sc)
    }

    /// Decodes each block of `w` into `q` (see [`Unpacked`]): the levels and run scales of
    /// [`decode`], multiplied per 16-bit word (both bytes of a word lie in one run of 16, so
    /// share its scale), and the correction summed by `vpdpbusd` of ones. Not inlined: the
    /// main loop must read these bytes from memory as broadcast loads.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline(never)]
    unsafe fn unpack_row(w: &[BlockQ3K], q: &mut [Unpacked]) {
        let four = _mm512_set1_epi8(4);
        let ones = _mm512_set1_epi8(1);
        let low_bytes = _mm512_set1_epi16(0xFF);
        // SAFETY: 64-byte index rows.
        let idx: [__m512i; 4] = std::array::from_fn(|c| unsafe {
            _mm512_loadu_si512(super::super::RUN_IDX[c].as_ptr().cast())
        });
        for (x, u) in w.iter().zip(q.iter_mut()) {
            // SAFETY: this level's features are present; 64-byte aligned stores inside
            // `u.v`, a 32-byte aligned store of `u.corr` (offset 256).
            unsafe {
                let (lv, sc) = decode(x);
                let mut sums = _mm512_setzero_si512();
                for (c, lv) in lv.into_iter().enumerate() {
                    // q (−4..=3) one signed byte; the run's −(sc − 32) in every word of
                    // 128-bit lane i (values 64c + 16i .. + 16, run 4c + i).
                    let qb = _mm512_sub_epi8(lv, four);
                    let nsc = _mm512_sub_epi16(
                        _mm512_setzero_si512(),
                        _mm512_permutexvar_epi32(idx[c], sc),
                    );
                    let even = _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(qb));
                    let odd = _mm512_srai_epi16::<8>(qb);
                    // Each product in −128..=124: its low byte is the signed byte.
                    let v = _mm512_or_si512(
                        _mm512_and_si512(_mm512_mullo_epi16(even, nsc), low_bytes),
                        _mm512_slli_epi16::<8>(_mm512_mullo_epi16(odd, nsc)),
                    );
                    _mm512_store_si512(u.v.as_mut_ptr().add(64 * c).cast(), v);
                    // Dword j: values 64c + 4j .. + 4 = lane j % 8 of group 2c + j / 8.
                    sums = _mm512_dpbusd_epi32(sums, ones, v);
                }
                let s8 = _mm256_add_epi32(
                    _mm512_castsi512_si256(sums),
                    _mm512_extracti64x4_epi64::<1>(sums),
                );
                let corr = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<7>(s8));
                _mm256_store_si256(u.corr.as_mut_ptr().cast(), corr);
                u.d = super::super::f16c(x.d);
            }
        }
    }

    /// One row against `N` tokens (`N <= 8`; prefill's groups and the token left over): each
    /// block decoded once in registers ([`decode`]), then per token and 64 values one
    /// `vpmaddubsw` of `q + 4` minus one of 4 (pair sums of `q · a`, exact in i16) and one
    /// `vpdpwssd` applying each run's scale (lane `j` of vector `c` is values `4j .. 4j + 4`
    /// of group `2c + j / 8`, so the two 256-bit halves added give the scalar order's 8 lane
    /// sums exactly); then the scalar's fused multiply-add per lane and the
    /// [`super::reduce8`] fold: the bits of [`super::dot_scalar`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    pub unsafe fn dot_n<const N: usize>(w: &[BlockQ3K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
        let four = _mm512_set1_epi8(4);
        // SAFETY: 64-byte index rows.
        let idx: [__m512i; 4] = std::array::from_fn(|c| unsafe {
            _mm512_loadu_si512(super::super::RUN_IDX[c].as_ptr().cast())
        });
        let mut acc = [_mm256_setzero_ps(); N];
        for (i, x) in w[..n].iter().enumerate() {
            // SAFETY: this level's features are present.
            let (q, sc) = unsafe { decode(x) };
            let scv: [__m512i; 4] = std::array::from_fn(|c| _mm512_permutexvar_epi32(idx[c], sc));
            // SAFETY: F16C is present.
            let xd = unsafe { super::super::f16c(x.d) };
            for (t, acc) in acc.iter_mut().enumerate() {
                let y = &a[t][i];
                let mut s = [_mm512_setzero_si512(); 2];
                for c in 0..4 {
                    // SAFETY: 64-byte load inside y.qs (256 bytes).
                    let yc = unsafe { _mm512_loadu_si512(y.qs.as_ptr().add(64 * c).cast()) };
                    // ≤ 2 · 7 · 127 and 2 · 4 · 127: exact i16, and so is the difference.
                    let p = _mm512_sub_epi16(
                        _mm512_maddubs_epi16(q[c], yc),
                        _mm512_maddubs_epi16(four, yc),
                    );
                    s[c % 2] = _mm512_dpwssd_epi32(s[c % 2], p, scv[c]);
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

    /// `R` rows (unpacked into `q`, `nb` blocks per row) against the packed tokens. Lane `k`
    /// of the scalar order (values `4k .. 4k + 4` of each group of 32) is its own loop: per
    /// group one `vpdpbusd` of each token's 4 activation bytes offset by 128 (`a + 128`,
    /// 0..=255, unsigned) × the 4 bytes `v = −(sc − 32) · q` broadcast (signed), into an
    /// accumulator started at the row's `−128 · Σ v`. Since `Σ (a + 128) · v = −Σ sc·q·a +
    /// 128 · Σ v`, it ends at exactly `−sumi_k` of the scalar order: each product is at most
    /// 255 · 128 in magnitude, so the 32 products and the start (≤ 128 · 32 · 128) stay far
    /// inside i32 (≤ 1.6 · 10⁶), no wrapping. The scalar's `fma(d, sumi_k, lane)` is then
    /// `fnmadd(d, −sumi_k, lane)`: the conversion of a negated integer is the negated
    /// conversion and the negated product is exact, one rounding either way. The 8
    /// accumulators are folded as [`super::reduce8`]: the bits of [`super::dot_scalar`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    // `k`, the scalar order's lane, indexes the packed tokens, the corrections and every
    // row's accumulators alike; an iterator over one of them would hide that.
    #[allow(clippy::needless_range_loop)]
    unsafe fn row_lanes<const R: usize>(l: &Lanes, q: &[Unpacked], nb: usize) -> [[f32; 16]; R] {
        let bias = _mm512_set1_epi8(i8::MIN);
        let mut acc = [[_mm512_setzero_ps(); 8]; R];
        for b in 0..nb {
            let u: [&Unpacked; R] = std::array::from_fn(|r| &q[r * nb + b]);
            // The block's 64 packed rows as one array: one bounds check per block, none in
            // the loops below (they were 8 compares and branches per lane and row step).
            let qs: &[[i32; 16]; 64] = l.qs[64 * b..64 * b + 64]
                .try_into()
                .expect("64 packed rows per block");
            // SAFETY: 16 floats.
            let d_a = unsafe { _mm512_loadu_ps(l.d[b].as_ptr()) };
            let d: [__m512; R] =
                std::array::from_fn(|r| _mm512_mul_ps(d_a, _mm512_set1_ps(u[r].d)));
            for k in 0..8 {
                let mut s: [__m512i; R] = std::array::from_fn(|r| _mm512_set1_epi32(u[r].corr[k]));
                for g in 0..8 {
                    // SAFETY: 64 bytes of one packed row.
                    let y = unsafe { _mm512_loadu_si512(qs[8 * g + k].as_ptr().cast()) };
                    // a + 128 as an unsigned byte.
                    let y = _mm512_xor_si512(y, bias);
                    for r in 0..R {
                        // SAFETY: 4 bytes inside `v`.
                        let wv = unsafe {
                            std::ptr::read_unaligned(
                                u[r].v.as_ptr().add(32 * g + 4 * k).cast::<i32>(),
                            )
                        };
                        s[r] = _mm512_dpbusd_epi32(s[r], y, _mm512_set1_epi32(wv));
                    }
                }
                for r in 0..R {
                    acc[r][k] = _mm512_fnmadd_ps(d[r], _mm512_cvtepi32_ps(s[r]), acc[r][k]);
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

    /// The lanes kernel (AVX-512) gives each of 1 to 16 tokens the single dot's bits, for
    /// every row step it takes.
    #[test]
    fn wide_dot_matches_single_dots_bits() {
        check_group_matches_single::<Q3K>(
            // Grouped at AVX-512 (the other x86-64 levels run single dots) and at every aarch64
            // level.
            cfg!(target_arch = "aarch64") || super::super::simd_level().name() == "avx512",
        );
    }

    /// ns per (block, token) at each level and width (`--ignored --nocapture`).
    #[test]
    #[ignore]
    fn group_speed() {
        print_group_speed::<Q3K>();
    }

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Q3K>(&[(1, 1), (2, 3), (3, 16)], 50);
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Q3K>(&[231, 232, 233]);
    }

    /// ggml's per-run decoding of the 6-bit scales, byte by byte.
    fn scale_ref(s: &[u8], r: usize) -> u8 {
        let low = if r < 8 { s[r] & 15 } else { s[r - 8] >> 4 };
        let high = (s[8 + r % 4] >> (2 * (r / 4))) & 3;
        low | (high << 4)
    }

    #[test]
    fn scale_decoding_matches_the_per_byte_form_and_packs_back() {
        for seed in 0..256u64 {
            let b: [u8; 12] = bytes(seed, 12).try_into().unwrap();
            let sc = unpack_scales(&b);
            for (r, v) in sc.iter().enumerate() {
                assert_eq!(*v, scale_ref(&b, r), "seed={seed} r={r}");
            }
            assert_eq!(pack_scales(&sc), b, "seed={seed}");
        }
    }

    /// ggml's per-value decoding, written out from the layout.
    #[test]
    fn dequantize_follows_the_layout() {
        let raw = bytes(13, 110 * 2);
        let got = dequantized(GgmlType::Q3_K, &raw);
        for (b, y) in raw.chunks(110).zip(got.chunks(256)) {
            let d = f16_to_f32([b[108], b[109]]);
            let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
            let mut v = 0;
            let mut bit = 0;
            for n in 0..2 {
                for shift in [0, 2, 4, 6] {
                    for l in 0..32 {
                        let low = ((qs[32 * n + l] >> shift) & 3) as i32;
                        let q = low - if hmask[l] & (1 << bit) != 0 { 0 } else { 4 };
                        let dl = d * (scale_ref(scales, v / 16) as i32 - 32) as f32;
                        assert_eq!(y[v].to_bits(), (dl * q as f32).to_bits(), "value {v}");
                        v += 1;
                    }
                    bit += 1;
                }
            }
        }
    }

    #[test]
    fn round_trip_error_within_budget() {
        // 8 levels per run of 16 (absmax): ≈ amax/4/√12 per value.
        let rel = relative_rms_error(GgmlType::Q3_K, &values(9, QK_K * 64, 1.0));
        assert!(rel < 0.2, "relative rmse {rel}");
        let flat = round_trip(GgmlType::Q3_K, &[0.0; QK_K]);
        assert!(flat.iter().all(|v| *v == 0.0));
    }
}
