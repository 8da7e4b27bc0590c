//! Telemetry: every output format a run produces, written once and used by both the engine
//! and the simulator — `BMOE_*` progress and session lines, the `# bmoe_metrics v2` CSV, the
//! `route_trace v1` and `io_trace v1` files, and the end-of-run report — plus the readers the
//! simulator's `diff` and `calibrate` use on the engine's files.
//!
//! The binding contract is `seeds/telemetry.md`; `docs/telemetry.md` says where each field
//! comes from in bmoe. Writers take `&mut dyn std::io::Write` (or own a `Write`); nothing here
//! opens a file or reads a clock: times arrive as numbers in the records.

pub mod csv;
pub mod fmt;
pub mod io_trace;
pub mod progress;
pub mod report;
pub mod route_trace;
pub mod run;
pub mod sinks;
pub mod summary;

pub use csv::{MetricsCsv, TokenRecord};
pub use run::RunTelemetry;
pub use sinks::TraceTee;
pub use summary::{PredictReport, PredictorStats, RunCounters, RunSummary};

/// A file in one of the telemetry formats that could not be read. Names the format, and the
/// 1-based line when the fault belongs to one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The fault is on one line.
    #[error("{format}: line {line}: {reason}")]
    AtLine {
        format: &'static str,
        line: usize,
        reason: String,
    },
    /// The fault is a property of the whole file (missing header, cross-row inconsistency
    /// without a single culprit line).
    #[error("{format}: {reason}")]
    File {
        format: &'static str,
        reason: String,
    },
}

impl ParseError {
    /// The 1-based line the fault is on, if it is on one.
    pub fn line(&self) -> Option<usize> {
        match self {
            ParseError::AtLine { line, .. } => Some(*line),
            ParseError::File { .. } => None,
        }
    }
}
