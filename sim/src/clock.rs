//! The virtual clock: simulated time that moves only when the flash model (a read completes)
//! or the compute model (a modelled kernel ran) moves it.
//!
//! One clock is shared by the engine, the flash model and the backend of a replay, so every
//! duration the core measures (`wall`, `io`, `stall`, `mgmt`) is a difference of modelled
//! instants. A replay runs on one thread, so the shared cell is an `Rc<Cell>`, not an atomic:
//! the replay's speed is one of the simulator's goals.

use bmoe_core::{Clock, Nanos};
use std::cell::Cell;
use std::rc::Rc;

/// Simulated time in nanoseconds. Clones share the same instant.
#[derive(Clone, Debug, Default)]
pub struct VirtualClock(Rc<Cell<u64>>);

impl VirtualClock {
    /// A clock at time 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Move forward by `d` (saturating).
    pub fn advance(&self, d: Nanos) {
        self.0.set(self.0.get().saturating_add(d.0));
    }

    /// Move forward to `t`; an earlier `t` leaves the clock where it is (time never goes back).
    pub fn advance_to(&self, t: Nanos) {
        if t.0 > self.0.get() {
            self.0.set(t.0);
        }
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Nanos {
        Nanos(self.0.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_time_and_time_never_goes_back() {
        let a = VirtualClock::new();
        let b = a.clone();
        a.advance(Nanos(10));
        assert_eq!(b.now(), Nanos(10));
        b.advance_to(Nanos(5));
        assert_eq!(a.now(), Nanos(10));
        b.advance_to(Nanos(25));
        assert_eq!(a.now(), Nanos(25));
        a.advance(Nanos(u64::MAX));
        assert_eq!(a.now(), Nanos(u64::MAX));
    }
}
