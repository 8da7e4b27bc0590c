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

/// Refuse a file whose last line has no newline. Every writer here ends each line as it
/// writes it, so an unterminated last line was cut short (its writer killed mid-line, or the
/// disk filled): its values cannot be trusted, and it is named as what it is rather than
/// reported as a malformed row.
pub(crate) fn check_whole_lines(text: &str, format: &'static str) -> Result<(), ParseError> {
    if text.is_empty() || text.ends_with('\n') {
        return Ok(());
    }
    let last = text.rsplit('\n').next().unwrap_or("");
    if last.trim().is_empty() {
        return Ok(());
    }
    let preview: String = last.chars().take(40).collect();
    let more = if last.chars().count() > 40 { "..." } else { "" };
    Err(ParseError::AtLine {
        format,
        line: text.lines().count(),
        reason: format!(
            "partial last line '{preview}{more}': the file ends mid-line, as when its writer is killed; remove that line to read the rest"
        ),
    })
}

/// The format a file's first line announces, when it is one of ours: lets a reader given the
/// wrong kind of file say which kind it was given.
pub(crate) fn announced_format(first_line: &str) -> Option<&'static str> {
    let l = first_line.trim_start_matches('\u{feff}').trim();
    [
        (csv::METRICS_MAGIC, "a bmoe_metrics CSV"),
        (route_trace::ROUTE_MAGIC, "a route trace"),
        (io_trace::IO_MAGIC, "an io trace"),
    ]
    .into_iter()
    .find(|(magic, _)| l == *magic)
    .map(|(_, what)| what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_last_line_is_named() {
        assert!(check_whole_lines("", "x").is_ok());
        assert!(check_whole_lines("a\nb\n", "x").is_ok());
        assert!(check_whole_lines("a\nb\n  ", "x").is_ok());
        let e = check_whole_lines("a\nb\n1,2,3", "x").unwrap_err();
        assert_eq!(e.line(), Some(3));
        assert!(e.to_string().contains("partial last line '1,2,3'"), "{e}");
    }
}
