//! The 32-value block formats dotted against Q8_0 activations (Q4_1, Q5_0, Q5_1, IQ4_NL,
//! MXFP4), written once: each format only says how its block turns into 32 integer levels and a
//! scale ([`Block32`]); the dequantizer, the scalar reference dot and the AVX2 dot live here.
//!
//! Why: these formats differ only in how a level is stored (4 bits, 4 + 1 bits, a 4-bit index
//! into a table of 16 values) and in their scale (f16, f16 with an offset, a power of two). The
//! dot products are all "exact integer sums inside a block, one float step per block", in one
//! of the two orders llama.cpp's x86 CPU backend uses for them ([`Order`]), so the loops are
//! shared and SIMD == scalar is proved once for all of them.
//!
//! The aarch64 levels (NEON, dotprod) are in `block32/neon.rs`, over the same trait.
//!
//! Lane layout (every order): a block's 32 products are summed exactly in 8 lanes of 4
//! consecutive values (lane `k` holds values `4k .. 4k + 4`), as `maddubs` + `madd` leave them.

use super::q8_0::{BlockQ8_0, Q8Act};
use super::{f16_to_f32, reduce8, RawBlock};

#[cfg(target_arch = "aarch64")]
pub(super) mod neon;

/// Values per block.
pub(super) const QK: usize = 32;

/// How a format's per-block float steps are ordered (llama.cpp's x86 `ggml_vec_dot_*_q8_0/1`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Order {
    /// 8 lane accumulators, one fused multiply-add per block each:
    /// `lane_k = fma(d_w·d_a, sum_k, lane_k)`, folded by [`reduce8`] (Q5_0).
    Lanes,
    /// As `Lanes`, plus the offset term in its own fused chain over blocks,
    /// `m_sum = fma(m_w, s_a, m_sum)` (`s_a` = the activation block's f16 `d·Σq`), added last:
    /// `reduce8(lanes) + m_sum` (Q4_1, Q5_1, against llama.cpp's Q8_1 activations).
    LanesOffset,
    /// Two sets of 8 lane accumulators, even blocks into one and odd into the other (whole
    /// pairs only), added lane by lane and folded by [`reduce8`]; a last unpaired block is then
    /// fused in whole: `sum = fma(d_w·d_a, Σ all, sum)` (IQ4_NL, MXFP4).
    Pairs,
}

/// How a block stores its scale.
#[derive(Copy, Clone, Debug)]
pub(super) enum Scale {
    /// f16 bits.
    F16([u8; 2]),
    /// A power of two: MXFP4's E8M0 exponent, for its doubled table.
    E8m0Half(u8),
}

/// A 32-value block: value `i` is `scale() · levels()[i] (+ offset())`.
pub(super) trait Block32: RawBlock {
    /// The float order of its dot product.
    const ORDER: Order;
    /// The 32 integer levels (each within ±127, so products with activations fit `maddubs`).
    fn levels(&self) -> [i8; QK];
    /// The scale as stored.
    fn scale_raw(&self) -> Scale;
    /// The offset added to every value, f16 bits (only read for [`Order::LanesOffset`]).
    #[inline(always)]
    fn offset_raw(&self) -> [u8; 2] {
        [0; 2]
    }
    /// The scale, exactly as an f32.
    #[inline(always)]
    fn scale(&self) -> f32 {
        match self.scale_raw() {
            Scale::F16(b) => f16_to_f32(b),
            Scale::E8m0Half(e) => super::mxfp4::e8m0_half(e),
        }
    }
    /// The offset, exactly as an f32.
    #[inline(always)]
    fn offset(&self) -> f32 {
        f16_to_f32(self.offset_raw())
    }
    /// [`Block32::levels`] as one vector (byte `i` = level `i`).
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present.
    #[cfg(target_arch = "x86_64")]
    unsafe fn levels_avx2(&self) -> std::arch::x86_64::__m256i;
    /// [`Block32::levels`] as two vectors (values 0–15, 16–31), with base Advanced SIMD.
    #[cfg(target_arch = "aarch64")]
    fn levels_neon(&self) -> [std::arch::aarch64::int8x16_t; 2];
}

/// Values `d · level` (`+ m` for the offset formats), multiplied then added: gguf-py's and
/// ggml's reference dequantizers, bit for bit.
pub(super) fn dequantize<B: Block32>(src: &[B], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let (d, q) = (b.scale(), b.levels());
        if B::ORDER == Order::LanesOffset {
            let m = b.offset();
            for (o, l) in y.iter_mut().zip(q) {
                *o = d * l as f32 + m;
            }
        } else {
            for (o, l) in y.iter_mut().zip(q) {
                *o = d * l as f32;
            }
        }
    }
}

/// The 4-value lane sums of one block's products (exact).
#[inline(always)]
fn lane_sums(q: &[i8; QK], a: &BlockQ8_0) -> [i32; 8] {
    std::array::from_fn(|k| {
        (4 * k..4 * k + 4)
            .map(|i| q[i] as i32 * a.qs[i] as i32)
            .sum()
    })
}

/// One block's step of 8 lane accumulators.
#[inline(always)]
fn fma_lanes(lanes: &mut [f32; 8], d: f32, sums: &[i32; 8]) {
    for (l, s) in lanes.iter_mut().zip(sums) {
        *l = d.mul_add(*s as f32, *l);
    }
}

/// The scalar reference dot of a row of `B` blocks with a Q8_0 activation.
pub(super) fn dot_scalar<B: Block32>(w: &[B], a: &Q8Act) -> f32 {
    let n = w.len().min(a.blocks.len());
    let d_of = |x: &B, y: &BlockQ8_0| x.scale() * f16_to_f32(y.d);
    match B::ORDER {
        Order::Lanes | Order::LanesOffset => {
            let mut lanes = [0f32; 8];
            let mut m_sum = 0f32;
            for ((x, y), s) in w.iter().zip(&a.blocks).zip(&a.s) {
                fma_lanes(&mut lanes, d_of(x, y), &lane_sums(&x.levels(), y));
                if B::ORDER == Order::LanesOffset {
                    m_sum = x.offset().mul_add(f16_to_f32(*s), m_sum);
                }
            }
            if B::ORDER == Order::LanesOffset {
                reduce8(&lanes) + m_sum
            } else {
                reduce8(&lanes)
            }
        }
        Order::Pairs => {
            let mut acc = [[0f32; 8]; 2];
            let paired = n / 2 * 2;
            let mut tail = None;
            for (i, (x, y)) in w.iter().zip(&a.blocks).enumerate() {
                let sums = lane_sums(&x.levels(), y);
                if i < paired {
                    fma_lanes(&mut acc[i % 2], d_of(x, y), &sums);
                } else {
                    tail = Some((d_of(x, y), sums.iter().sum::<i32>()));
                }
            }
            let lanes: [f32; 8] = std::array::from_fn(|k| acc[0][k] + acc[1][k]);
            let sum = reduce8(&lanes);
            match tail {
                Some((d, s)) => d.mul_add(s as f32, sum),
                None => sum,
            }
        }
    }
}

/// Block `x`'s exact lane sums with activation block `y`, as floats (exact: |sum| < 2^24).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn lane_sums_avx2<B: Block32>(x: &B, y: &BlockQ8_0) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 is present (this function's contract); 32-byte unaligned load of the
    // activation block's quants.
    unsafe {
        let yv = _mm256_loadu_si256(y.qs.as_ptr().cast());
        super::q8_0::x86::mul_sum_i8(x.levels_avx2(), yv)
    }
}

/// `scale · d_a` of a block pair with the F16C conversion (the scalar path's bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn d_f16c<B: Block32>(x: &B, y: &BlockQ8_0) -> f32 {
    // SAFETY: F16C is present (this function's contract).
    match x.scale_raw() {
        Scale::F16(b) => unsafe { super::f16c_mul(b, y.d) },
        Scale::E8m0Half(e) => super::mxfp4::e8m0_half(e) * unsafe { super::f16c(y.d) },
    }
}

/// [`dot_scalar`] with AVX2: the lane sums come from one `maddubs` + `madd` per block, the
/// float steps are the same operations lane for lane, so the bits are the scalar ones.
///
/// # Safety
/// AVX2, FMA and F16C are present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_avx2<B: Block32>(w: &[B], a: &Q8Act) -> f32 {
    use super::q8_k::x86::fold;
    use std::arch::x86_64::*;
    let n = w.len().min(a.blocks.len());
    let (w, y) = (&w[..n], &a.blocks[..n]);
    match B::ORDER {
        Order::Lanes | Order::LanesOffset => {
            let mut acc = _mm256_setzero_ps();
            // Lane 0: the offset chain m_sum.
            let mut m_sum = _mm_setzero_ps();
            for (i, (x, yb)) in w.iter().zip(y).enumerate() {
                // SAFETY: AVX2, FMA and F16C are present (this function's contract).
                let d = unsafe { d_f16c(x, yb) };
                // SAFETY: as above.
                let s = unsafe { lane_sums_avx2(x, yb) };
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s), acc);
                if B::ORDER == Order::LanesOffset {
                    // [m, s_a] in one conversion, then m_sum = fma(m, s_a, m_sum).
                    // SAFETY: as above.
                    let ms = unsafe { super::f16c_pair(x.offset_raw(), a.s[i]) };
                    m_sum = _mm_fmadd_ss(ms, _mm_movehdup_ps(ms), m_sum);
                }
            }
            // SAFETY: AVX2 is present.
            let sum = unsafe { fold(acc) };
            if B::ORDER == Order::LanesOffset {
                sum + _mm_cvtss_f32(m_sum)
            } else {
                sum
            }
        }
        Order::Pairs => {
            let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut pairs = w.chunks_exact(2).zip(y.chunks_exact(2));
            for (x, yb) in &mut pairs {
                // SAFETY: AVX2, FMA and F16C are present (this function's contract).
                let (d0, d1) = unsafe { (d_f16c(&x[0], &yb[0]), d_f16c(&x[1], &yb[1])) };
                // SAFETY: AVX2 is present.
                let (s0, s1) =
                    unsafe { (lane_sums_avx2(&x[0], &yb[0]), lane_sums_avx2(&x[1], &yb[1])) };
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(s0), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(s1), acc1);
            }
            // SAFETY: AVX2 is present.
            let mut sum = unsafe { fold(_mm256_add_ps(acc0, acc1)) };
            if n % 2 == 1 {
                let (x, yb) = (&w[n - 1], &y[n - 1]);
                // SAFETY: AVX2 is present; the same exact lane sums, added up exactly.
                let s = unsafe { super::q8_k::x86::hsum_i32(lane_sums_avx2(x, yb)) };
                // SAFETY: as above.
                sum = unsafe { d_f16c(x, yb) }.mul_add(s as f32, sum);
            }
            sum
        }
    }
}

/// AVX2 pieces the formats build their levels from.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    /// The 32 nibbles of 16 packed bytes as bytes: byte `j` of `qs` gives value `j` (low
    /// nibble) and value `j + 16` (high nibble).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn nibbles(qs: &[u8; 16]) -> __m256i {
        // SAFETY: 16 bytes.
        let x = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        let m4 = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(x, m4);
        let hi = _mm_and_si128(_mm_srli_epi16(x, 4), m4);
        _mm256_set_m128i(hi, lo)
    }

    /// Byte `i` is 0x10 where bit `i` of the little-endian word `qh` is set, else 0 (the fifth
    /// bit of Q5_0/Q5_1 levels).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn fifth_bits(qh: [u8; 4]) -> __m256i {
        let word = _mm256_set1_epi32(i32::from_le_bytes(qh));
        // Byte i takes byte i / 8 of the word, then keeps bit i % 8 of it.
        let spread = _mm256_shuffle_epi8(
            word,
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let bit = _mm256_set1_epi64x(i64::from_le_bytes([1, 2, 4, 8, 16, 32, 64, -128i8 as u8]));
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    /// `table[n]` for each nibble byte `n` of `idx` (16 signed values).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn lookup(table: &[i8; 16], idx: __m256i) -> __m256i {
        // SAFETY: 16 bytes.
        let t = unsafe { _mm_loadu_si128(table.as_ptr().cast()) };
        _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t), idx)
    }
}

/// The [`super::format::Format`] and AVX2 [`super::format::Kernel`] of a [`Block32`] format:
/// `block32_format!(Name, GgmlTypeVariant, BlockType, quantizer)`.
macro_rules! block32_format {
    ($name:ident, $ty:ident, $block:ty, $quantize:path) => {
        /// The weight format (see the module header).
        pub(crate) struct $name;

        impl $crate::kernels::format::Format for $name {
            const TY: $crate::gguf::GgmlType = $crate::gguf::GgmlType::$ty;
            type Block = $block;
            type Act = $crate::kernels::q8_0::ActQ8_0;

            fn quantize(src: &[f32], dst: &mut [$block]) {
                $quantize(src, dst)
            }

            fn dequantize(src: &[$block], dst: &mut [f32]) {
                $crate::kernels::block32::dequantize(src, dst)
            }

            fn dot(w: &[$block], a: &$crate::kernels::q8_0::Q8Act) -> f32 {
                $crate::kernels::block32::dot_scalar(w, a)
            }
        }

        #[cfg(target_arch = "x86_64")]
        impl $crate::kernels::format::Kernel<$name> for $crate::kernels::format::Avx2 {
            unsafe fn dot(w: &[$block], a: &$crate::kernels::q8_0::Q8Act) -> f32 {
                // SAFETY: the caller's (AVX2, FMA and F16C are present).
                unsafe { $crate::kernels::block32::dot_avx2(w, a) }
            }
        }

        $crate::kernels::block32::block32_format!(@arm $name, $block, Neon, dot_neon, rows_neon, group_neon);
        $crate::kernels::block32::block32_format!(
            @arm $name, $block, Dotprod, dot_dotprod, rows_dotprod, group_dotprod, wide_dotprod
        );
    };
    (@arm $name:ident, $block:ty, $level:ident, $dot:ident, $rows:ident, $group:ident $(, $wide:ident)?) => {
        /// Two rows at a time for one token, each weight block unpacked once for a group
        /// of tokens (`block32/neon.rs`).
        #[cfg(target_arch = "aarch64")]
        impl $crate::kernels::format::Kernel<$name> for $crate::kernels::format::$level {
            unsafe fn dot(w: &[$block], a: &$crate::kernels::q8_0::Q8Act) -> f32 {
                // SAFETY: the caller's (the level is available).
                unsafe { $crate::kernels::block32::neon::$dot(w, a) }
            }

            unsafe fn dot_rows(
                w: &[u8],
                row_bytes: usize,
                rows: std::ops::Range<usize>,
                a: &$crate::kernels::q8_0::Q8Act,
                out: &mut [f32],
            ) {
                // SAFETY: the caller's.
                unsafe { $crate::kernels::block32::neon::$rows::<$block>(w, row_bytes, rows, a, out) }
            }

            const GROUPED: bool = true;

            unsafe fn dot_group<const N: usize>(
                w: &[$block],
                a: [&$crate::kernels::q8_0::Q8Act; N],
            ) -> [f32; N] {
                // SAFETY: the caller's.
                unsafe { $crate::kernels::block32::neon::$group::<$block, N>(w, a) }
            }

            $(
            /// Each row unpacked once for all the tokens, then dotted by groups of 4.
            const WIDE: bool = true;

            /// From 5 tokens on the unpacking saved beats the stores and loads of the unpacked
            /// row (llvm-mca, 2 rows × T tokens, MXFP4 N2 cycles per 256 × token, grouped
            /// vs unpacked: T=4 30.2 vs 31.3, T=5 32.9 vs 30.0, T=7 28.1 vs 27.1; Q5_1 T=5
            /// 38.7 vs 36.7, T=6 37.9 vs 34.0).
            const WIDE_MIN: usize = 5;

            unsafe fn dot_wide(
                w: &[u8],
                row_bytes: usize,
                rows: std::ops::Range<usize>,
                a: &[&$crate::kernels::ActBuf],
                out: &mut [&mut [f32]],
            ) {
                // SAFETY: the caller's (dotprod is present).
                unsafe { $crate::kernels::block32::neon::$wide::<$block>(w, row_bytes, rows, a, out) }
            }
            )?
        }
    };
}
pub(super) use block32_format;

/// Nearest-level search over an ascending table of up to 16 levels, by counting the midpoints
/// between neighbours that a value exceeds: 15 branch-free comparisons (the quantizers' inner
/// loop). Ties go to the lower level; NaN to the first.
pub(super) struct Nearest {
    mids: [f32; 15],
}

impl Nearest {
    /// `sorted` ascending, 2..=16 levels.
    pub const fn new(sorted: &[f32]) -> Nearest {
        let mut mids = [f32::INFINITY; 15];
        let mut k = 0;
        while k + 1 < sorted.len() && k < 15 {
            mids[k] = (sorted[k] + sorted[k + 1]) / 2.0;
            k += 1;
        }
        Nearest { mids }
    }

    /// The index of the level nearest to `v`.
    #[inline(always)]
    pub fn index(&self, v: f32) -> usize {
        self.mids.iter().map(|m| (v > *m) as usize).sum()
    }
}

/// Packs 32 levels (each < 16) into 16 bytes: level `j` in the low nibble of byte `j`, level
/// `j + 16` in the high nibble.
#[inline]
pub(super) fn pack_nibbles(levels: &[u8; QK]) -> [u8; QK / 2] {
    std::array::from_fn(|j| (levels[j] & 0x0F) | ((levels[j + 16] & 0x0F) << 4))
}

/// The nibble of value `i` (< 32) of a block's 16 packed bytes.
#[inline(always)]
pub(super) fn nibble(qs: &[u8; QK / 2], i: usize) -> u8 {
    if i < 16 {
        qs[i] & 0x0F
    } else {
        qs[i - 16] >> 4
    }
}

/// Checks shared by the formats' tests.
#[cfg(test)]
pub(super) mod checks {
    use super::super::format::Format;
    use super::super::testutil::*;
    use super::super::SimdLevel;

    /// Every level's `dot_rows` (which takes several rows at once where that is faster) gives
    /// each row exactly the scalar bits: 1 to 7 rows of quantized values and random bytes, at
    /// block counts that leave every remainder (and more than one restart of the NEON running
    /// sums).
    pub fn check_rows_match_scalar<F: Format>() {
        for (seed, nb) in [(1u64, 1usize), (2, 5), (3, 67), (4, 130), (5, 131)] {
            let n = nb * F::TY.block_size() as usize;
            let row_bytes = quantized_bytes(F::TY, &values(seed, n, 0.1)).len();
            let w: Vec<u8> = (0..7u64)
                .flat_map(|r| {
                    if r % 3 == 1 {
                        bytes(seed * 31 + r, row_bytes)
                    } else {
                        quantized_bytes(F::TY, &values(seed * 31 + r, n, 0.1 + r as f32 * 0.02))
                    }
                })
                .collect();
            let act = prepared(F::TY, &values(seed + 500, n, 1.0));
            let t = table_of::<F>();
            for level in SimdLevel::available() {
                for rows in [0..7, 0..1, 1..3, 2..7, 3..6] {
                    let mut out = vec![f32::NAN; rows.len()];
                    // SAFETY: the level is available; the rows lie inside `w`.
                    unsafe { (t.at(level).rows)(&w, row_bytes, rows.clone(), &act, &mut out) };
                    for (r, got) in rows.clone().zip(&out) {
                        let want = scalar_dot::<F>(&w[r * row_bytes..(r + 1) * row_bytes], &act);
                        assert!(
                            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                            "{} {level:?} nb={nb} rows {rows:?} row {r}: {got} vs {want}",
                            F::TY
                        );
                    }
                }
            }
        }
    }
}
