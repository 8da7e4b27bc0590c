//! bmoe-core: the one core of bmoe — expert cache and eviction policies, router hook,
//! prefetch, streamer, decode step, generation loop and telemetry — generic over a `Clock`, a `Flash` device
//! and a compute `Backend`, so the engine (real flash, real kernels) and the simulator
//! (virtual clock, modelled flash) run the very same code.
//!
//! Nothing in this crate reads ambient time, sleeps, opens files or draws unseeded random
//! numbers: time comes from `Clock`, bytes from `Flash`, compute from `Backend`.

pub mod backend;
pub mod cache;
pub mod clock;
pub mod config;
pub mod decide;
pub mod faults;
pub mod flash;
pub mod gating;
pub mod generate;
pub mod handoff;
pub mod hooks;
pub mod lanes;
pub mod layout;
pub mod ledger;
pub mod policy;
pub mod predict;
mod prefetch;
pub mod records;
pub mod speculate;
pub mod step;
mod streamer;
pub mod telemetry;
pub mod testing;
pub mod vocab;

pub use backend::{
    Backend, BackendStage, ExpertUse, LayerId, Prediction, Routing, RoutingError, SeqRun,
    Sequences, SlotId,
};
pub use cache::{Admission, CacheCounters, CacheError, ExpertCache, Lookup};
pub use clock::{Clock, Nanos};
pub use decide::{DecideOutcome, DecideRejected, DecideRequest};
pub use flash::{Flash, FlashError, ReadDone, ReadId, ReadRequest, ReadTag, ResidentFlash};
pub use gating::{Gating, GatingFunc};
pub use generate::{
    CancelFlag, GenerateError, MemProbe, NoProbe, Outputs, Session, StopReason, TokenSource,
    TurnOutcome, TurnRequest,
};
pub use layout::{ExpertKey, ExpertLayout, LayoutError, MoeLayerLayout, ProjExtent};
pub use policy::EvictionPolicy;
pub use predict::PredictConfig;
pub use step::{
    Engine, HookContext, HookCounts, HookError, ReadSplit, RouterHook, StepError, StepInput,
    StepStats, StreamConfig, TopKOverride,
};
