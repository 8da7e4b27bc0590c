//! bmoe-core: the one core of bmoe — expert cache and eviction policies, router hook,
//! prefetch, streamer, decode step and telemetry — generic over a `Clock`, a `Flash` device
//! and a compute `Backend`, so the engine (real flash, real kernels) and the simulator
//! (virtual clock, modelled flash) run the very same code.

pub mod config;
pub mod flags;
pub mod records;
pub mod telemetry;
