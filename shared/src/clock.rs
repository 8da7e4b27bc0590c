//! Time for the core: a nanosecond newtype and the `Clock` trait.
//!
//! Core code never reads ambient time. The engine plugs in a monotonic clock; the simulator
//! plugs in a virtual clock that only moves when its event loop moves it; tests use
//! `testing::ManualClock`. Every duration the core reports (wall, io, stall, mgmt) is a
//! difference of two `Clock::now()` readings, so the same code measures real and modelled runs.

use std::iter::Sum;
use std::ops::{Add, AddAssign, Sub, SubAssign};

/// Nanoseconds: a point in time since the clock's arbitrary origin, or a duration.
///
/// Subtraction saturates at zero: a clock never goes backwards, and a duration computed from a
/// misbehaving one should read as "nothing happened" rather than panic or wrap to centuries.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Nanos(pub u64);

impl Nanos {
    /// Zero nanoseconds.
    pub const ZERO: Nanos = Nanos(0);

    /// A duration of `us` microseconds (saturating).
    pub const fn from_us(us: u64) -> Nanos {
        Nanos(us.saturating_mul(1_000))
    }

    /// A duration of `ms` milliseconds (saturating).
    pub const fn from_ms(ms: u64) -> Nanos {
        Nanos(ms.saturating_mul(1_000_000))
    }

    /// This duration in milliseconds, as the telemetry formats print it.
    pub fn as_ms_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    /// This duration in seconds.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// `self - earlier`, or zero when `earlier` is later.
    pub const fn saturating_sub(self, earlier: Nanos) -> Nanos {
        Nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add for Nanos {
    type Output = Nanos;
    fn add(self, rhs: Nanos) -> Nanos {
        Nanos(self.0.saturating_add(rhs.0))
    }
}

impl AddAssign for Nanos {
    fn add_assign(&mut self, rhs: Nanos) {
        *self = *self + rhs;
    }
}

impl Sub for Nanos {
    type Output = Nanos;
    /// Saturating: see the type's documentation.
    fn sub(self, rhs: Nanos) -> Nanos {
        self.saturating_sub(rhs)
    }
}

impl SubAssign for Nanos {
    fn sub_assign(&mut self, rhs: Nanos) {
        *self = *self - rhs;
    }
}

impl Sum for Nanos {
    fn sum<I: Iterator<Item = Nanos>>(iter: I) -> Nanos {
        iter.fold(Nanos::ZERO, |a, b| a + b)
    }
}

/// A source of time. Readings never decrease.
///
/// The engine's implementation reads a monotonic OS clock; the simulator's returns the
/// virtual time its event loop has reached, and advances only when the loop (or a `Flash` /
/// `Backend` charging modelled time) moves it.
pub trait Clock {
    /// The current time.
    fn now(&self) -> Nanos;
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> Nanos {
        (**self).now()
    }
}

impl<C: Clock + ?Sized> Clock for std::sync::Arc<C> {
    fn now(&self) -> Nanos {
        (**self).now()
    }
}

impl<C: Clock + ?Sized> Clock for std::rc::Rc<C> {
    fn now(&self) -> Nanos {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_instead_of_wrapping() {
        assert_eq!(Nanos(5) - Nanos(7), Nanos::ZERO);
        assert_eq!(Nanos(u64::MAX) + Nanos(1), Nanos(u64::MAX));
        let mut t = Nanos(10);
        t -= Nanos(3);
        t += Nanos(1);
        assert_eq!(t, Nanos(8));
        assert_eq!(
            [Nanos(1), Nanos(2), Nanos(3)].into_iter().sum::<Nanos>(),
            Nanos(6)
        );
    }

    #[test]
    fn unit_conversions() {
        assert_eq!(Nanos::from_ms(3), Nanos(3_000_000));
        assert_eq!(Nanos::from_us(3), Nanos(3_000));
        assert!((Nanos(1_500_000).as_ms_f64() - 1.5).abs() < 1e-12);
        assert!((Nanos(2_500_000_000).as_secs_f64() - 2.5).abs() < 1e-12);
    }
}
