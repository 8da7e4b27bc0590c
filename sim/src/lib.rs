//! bmoe-sim: the bmoe core on a virtual clock.
//!
//! The simulator supplies only the three leaves the core is generic over — a virtual `Clock`,
//! a modelled `Flash` device and a trace-driven compute `Backend` — and runs the very same
//! `bmoe_core::Engine` (cache, policies, streamer, telemetry) over a recorded route trace. So a
//! replay reproduces an engine run's hits, misses, evictions and read bytes exactly, and only
//! the times are modelled. Beside replay: sweeps over budgets, policies, lanes and overlap
//! (with the clairvoyant Belady bound), a sim-vs-measured diff, profile calibration, and
//! `whatif`: a recorded routing priced on another model's bytes and another device.

pub mod bars;
pub mod belady;
pub mod cache_only;
pub mod calibrate;
pub mod cli;
pub mod clock;
pub mod compute;
pub mod convert;
pub mod diff;
pub mod error;
pub mod flash;
pub mod fuzz;
pub mod mrc;
pub mod plan;
pub mod predictions;
pub mod profile;
pub mod reorder;
pub mod replay;
pub mod stats;
pub mod svg;
pub mod sweep;
pub mod whatif;

pub use clock::VirtualClock;
pub use compute::{ComputeParams, TraceBackend};
pub use error::SimError;
pub use flash::{FlashModel, FlashParams};
pub use plan::{AccessSeq, ReplayPlan};
pub use profile::DeviceProfile;
