//! The simulator's error type: every way a replay, sweep, diff or calibration can refuse its
//! input, with the file and the field at fault named. The binary prints these and exits 1
//! (2 for `diff` inputs that cannot be compared at all). A profile `calibrate` fitted but that
//! misses its own run is no error: it is written with a WARNING, and the binary exits 0, or
//! `cli::EXIT_MISFIT` (3) under `--fail-on-misfit`.

use std::path::PathBuf;
use thiserror::Error;

/// Why the simulator could not do what it was asked.
#[derive(Debug, Error)]
pub enum SimError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: bmoe_core::telemetry::ParseError,
    },
    #[error("route trace {what}: {source}")]
    Layout {
        what: String,
        #[source]
        source: bmoe_core::LayoutError,
    },
    #[error("route trace {reason}")]
    Trace { reason: String },
    #[error(transparent)]
    Config(#[from] bmoe_core::config::ConfigError),
    #[error(transparent)]
    Cache(#[from] bmoe_core::CacheError),
    #[error("replay step failed: {0}")]
    Step(#[from] bmoe_core::StepError),
    #[error("profile {name}: {reason}")]
    Profile { name: String, reason: String },
    #[error("{flag} is not modelled: {why}")]
    Unsupported {
        flag: &'static str,
        why: &'static str,
    },
    /// A predictor flag the trace did not record what it needs for.
    #[error("{flag} cannot be replayed from this trace: {reason}. Record a trace that can with: {record_with}")]
    NeedsRecording {
        flag: String,
        reason: String,
        record_with: String,
    },
    #[error("{what}: {reason}")]
    Invalid { what: String, reason: String },
    #[error("clairvoyant policy lost track of the access sequence: {reason}")]
    Clairvoyant { reason: String },
}

impl SimError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        SimError::Io {
            path: path.into(),
            source,
        }
    }

    /// An input that is well-formed but unusable for the request.
    pub fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Self {
        SimError::Invalid {
            what: what.into(),
            reason: reason.into(),
        }
    }
}
