//! aarch64 building blocks the formats' NEON kernels share (`<format>/neon.rs`).
//!
//! Why this exists: stable Rust has the base Advanced SIMD intrinsics (`std::arch::aarch64`) but
//! not yet the 8-bit dot and matrix products (`vdotq_s32`, `vmmlaq_s32`: unstable features
//! `stdarch_neon_dotprod`, `stdarch_neon_i8mm`) nor the f16 vector type the half-precision
//! conversions take. Each of those is one instruction, written here once as inline assembly
//! (pure, no memory access, so the compiler may move, merge or drop it like an intrinsic), with
//! the fixed float reductions the scalar references use, so every format's kernel reads the
//! same names.
//!
//! The dotprod and i8mm wrappers carry their feature: they inline into callers compiled with it
//! (`#[target_feature(enable = "dotprod")]`), which is where the kernels of those levels live.

use std::arch::aarch64::*;
use std::arch::asm;

/// `acc[i] + Σ_{k<4} a[4i + k] · b[4i + k]` in each i32 lane (`sdot`): a lane's four
/// consecutive signed byte products, exactly.
///
/// # Safety
/// The CPU has FEAT_DotProd.
#[inline]
#[target_feature(enable = "dotprod")]
pub(crate) unsafe fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: register-only instruction of a feature this function requires.
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    acc
}

/// The 2×2 product of two 2×8 signed byte matrices (`smmla`): with `a` = rows `a0 | a1` (bytes
/// 0–7 and 8–15) and `b` = rows `b0 | b1`, `acc + [a0·b0, a0·b1, a1·b0, a1·b1]` (8-value dots,
/// exact in i32).
///
/// # Safety
/// The CPU has FEAT_I8MM.
#[inline]
#[target_feature(enable = "i8mm")]
pub(crate) unsafe fn smmla(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: register-only instruction of a feature this function requires.
    unsafe {
        asm!(
            "smmla {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    acc
}

/// [`smmla`] with unsigned `a` and signed `b` (`usmmla`).
///
/// # Safety
/// The CPU has FEAT_I8MM.
#[inline]
#[target_feature(enable = "i8mm")]
pub(crate) unsafe fn usmmla(mut acc: int32x4_t, a: uint8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: register-only instruction of a feature this function requires.
    unsafe {
        asm!(
            "usmmla {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    acc
}

/// Four zero i32 lanes, loaded (`ldr q` of a static): a fresh accumulator from a load pipe
/// where `movi` would take one of the vector pipes a kernel is bound by. Not `pure`, so
/// that every call is its own load (merged ones would need a vector `mov` per use, as each
/// use overwrites its accumulator).
#[inline(always)]
pub(crate) fn zeros_by_load() -> int32x4_t {
    static ZEROS: [i32; 4] = [0; 4];
    let out: int32x4_t;
    // SAFETY: reads the 16 bytes of `ZEROS`.
    unsafe {
        asm!(
            "ldr {o:q}, [{p}]",
            p = in(reg) ZEROS.as_ptr(),
            o = lateout(vreg) out,
            options(readonly, nostack, preserves_flags)
        )
    };
    out
}

/// Four f16 values (their bits) widened to f32 (`fcvtl`): exact, the same bits as
/// [`super::f16_to_f32`] for every input (NaNs quieted with their payload kept; the tests
/// check all 65536).
#[inline(always)]
pub(crate) fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: register-only base Advanced SIMD instruction (every aarch64 core).
    unsafe {
        asm!(
            "fcvtl {o:v}.4s, {h:v}.4h",
            o = lateout(vreg) out,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    out
}

/// The upper four f16 values of `h` widened to f32 (`fcvtl2`).
#[inline(always)]
pub(crate) fn f16x8_high_to_f32(h: uint16x8_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: register-only base Advanced SIMD instruction.
    unsafe {
        asm!(
            "fcvtl2 {o:v}.4s, {h:v}.8h",
            o = lateout(vreg) out,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    out
}

/// Four f32 values narrowed to f16 bits (`fcvtn`), rounding to nearest even (the default
/// rounding mode, which Linux and Android leave set).
#[inline(always)]
pub(crate) fn f32x4_to_f16(x: float32x4_t) -> uint16x4_t {
    let out: uint16x4_t;
    // SAFETY: register-only base Advanced SIMD instruction.
    unsafe {
        asm!(
            "fcvtn {o:v}.4h, {x:v}.4s",
            o = lateout(vreg) out,
            x = in(vreg) x,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    out
}

/// One f16 (little-endian bits) as f32 with the scalar conversion instruction (`fcvt s, h`):
/// the same bits as [`super::f16_to_f32`], one instruction where the portable form is several.
#[inline(always)]
pub(crate) fn f16_to_f32(bits: [u8; 2]) -> f32 {
    let h = u16::from_le_bytes(bits);
    let out: f32;
    // SAFETY: register-only base floating-point instruction; the f16 sits in the low 16 bits
    // of the vector register (`fmov s, w` zeroes the rest).
    unsafe {
        asm!(
            "fmov {t:s}, {h:w}",
            "fcvt {o:s}, {t:h}",
            h = in(reg) h as u32,
            t = out(vreg) _,
            o = lateout(vreg) out,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    out
}

/// The 8 float lanes `lo | hi` (lanes 0–3, 4–7) folded in [`super::reduce8`]'s tree (halves,
/// then quarters, then pairs), so a NEON kernel keeping the scalar's 8 lanes in two vectors
/// ends with its bits.
#[inline(always)]
pub(crate) fn reduce8(lo: float32x4_t, hi: float32x4_t) -> f32 {
    // SAFETY (every intrinsic): base Advanced SIMD, register-only.
    unsafe {
        let a = vaddq_f32(lo, hi); // [l0+l4, l1+l5, l2+l6, l3+l7]
        let b = vadd_f32(vget_low_f32(a), vget_high_f32(a)); // [a0+a2, a1+a3]
        vget_lane_f32::<0>(b) + vget_lane_f32::<1>(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The conversion instructions give the portable conversion's bits for every f16.
    #[test]
    fn f16_conversions_match_the_portable_one() {
        for h in 0..=u16::MAX {
            let want = super::super::f16_to_f32(h.to_le_bytes());
            let one = f16_to_f32(h.to_le_bytes());
            // SAFETY: base Advanced SIMD, register-only.
            let four = unsafe { vgetq_lane_f32::<2>(f16x4_to_f32(vdup_n_u16(h))) };
            // SAFETY: as above.
            let high = unsafe { vgetq_lane_f32::<3>(f16x8_high_to_f32(vdupq_n_u16(h))) };
            for got in [one, four, high] {
                assert_eq!(got.to_bits(), want.to_bits(), "f16 {h:#06x}");
            }
        }
    }

    /// f32 → f16 narrowing gives the `half` crate's (round to nearest even) bits, NaNs aside.
    #[test]
    fn f32_to_f16_matches_the_portable_one() {
        let mut x = 0x1234_5678u32;
        for i in 0..200_000u32 {
            // xorshift over all bit patterns, plus the exact halfway cases of small integers.
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let v = if i % 4 == 0 {
                (i as f32) + 0.5
            } else {
                f32::from_bits(x)
            };
            // SAFETY: base Advanced SIMD, register-only.
            let got = unsafe { vget_lane_u16::<1>(f32x4_to_f16(vdupq_n_f32(v))) };
            let want = u16::from_le_bytes(super::super::f32_to_f16(v));
            if v.is_nan() {
                assert!(half::f16::from_bits(got).is_nan(), "{v}");
            } else {
                assert_eq!(got, want, "{v} ({:#010x})", v.to_bits());
            }
        }
    }

    /// The dot and matrix instructions, on the CPU's levels (qemu's `max` has both).
    #[test]
    fn dot_and_matrix_products_are_exact() {
        if !std::arch::is_aarch64_feature_detected!("dotprod") {
            eprintln!("no dotprod on this CPU: its wrappers are not run");
            return;
        }
        let a: [i8; 16] = std::array::from_fn(|i| (i as i8).wrapping_mul(37).wrapping_sub(100));
        let b: [i8; 16] = std::array::from_fn(|i| (i as i8).wrapping_mul(91).wrapping_add(7));
        let ua: [u8; 16] = std::array::from_fn(|i| (i as u8).wrapping_mul(201));
        let lane = |i: usize| {
            (0..4)
                .map(|k| a[4 * i + k] as i32 * b[4 * i + k] as i32)
                .sum()
        };
        let want: [i32; 4] = std::array::from_fn(lane);
        let mut got = [0i32; 4];
        // SAFETY: dotprod is present (checked); the arrays hold 16 bytes / 4 lanes.
        unsafe {
            let (va, vb) = (vld1q_s8(a.as_ptr()), vld1q_s8(b.as_ptr()));
            vst1q_s32(got.as_mut_ptr(), sdot(vdupq_n_s32(1), va, vb));
        }
        assert_eq!(got, want.map(|v| v + 1));
        if !std::arch::is_aarch64_feature_detected!("i8mm") {
            eprintln!("no i8mm on this CPU: its wrappers are not run");
            return;
        }
        let mut mm = [0i32; 4];
        let mut usm = [0i32; 4];
        // SAFETY: i8mm is present (checked).
        unsafe {
            let (va, vb) = (vld1q_s8(a.as_ptr()), vld1q_s8(b.as_ptr()));
            vst1q_s32(mm.as_mut_ptr(), smmla(vdupq_n_s32(0), va, vb));
            let vu = vld1q_u8(ua.as_ptr());
            vst1q_s32(usm.as_mut_ptr(), usmmla(vdupq_n_s32(0), vu, vb));
        }
        let dot8 = |x: &dyn Fn(usize) -> i32, r: usize, c: usize| -> i32 {
            (0..8).map(|k| x(8 * r + k) * b[8 * c + k] as i32).sum()
        };
        let sa = |i: usize| a[i] as i32;
        let ub = |i: usize| ua[i] as i32;
        assert_eq!(
            mm,
            [
                dot8(&sa, 0, 0),
                dot8(&sa, 0, 1),
                dot8(&sa, 1, 0),
                dot8(&sa, 1, 1)
            ]
        );
        assert_eq!(
            usm,
            [
                dot8(&ub, 0, 0),
                dot8(&ub, 0, 1),
                dot8(&ub, 1, 0),
                dot8(&ub, 1, 1)
            ]
        );
    }

    /// [`reduce8`] is the scalar tree.
    #[test]
    fn reduce8_is_the_scalar_tree() {
        let l: [f32; 8] = [1e8, 1.0, -1e8, 3.5, 0.1, 7e-3, 2.0, -1.0];
        // SAFETY: base Advanced SIMD; the array holds 8 floats.
        let got = unsafe { reduce8(vld1q_f32(l.as_ptr()), vld1q_f32(l.as_ptr().add(4))) };
        assert_eq!(got.to_bits(), super::super::reduce8(&l).to_bits());
    }
}
