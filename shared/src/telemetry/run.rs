//! `RunTelemetry`: the one object a run feeds, token by token, to produce its per-token
//! outputs (`BMOE_LOAD` / `BMOE_PROGRESS` lines, CSV rows) and accumulate the `RunSummary`
//! its end-of-run outputs are printed from.
//!
//! It holds no writers: each call takes the writers that are enabled, so a session can keep
//! one aggregator across turns while stdout is also used for the control lines.

use std::io::{self, Write};

use super::csv::{write_header, write_preamble, write_row, write_summary, TokenRecord};
use super::progress::{write_token_lines, DeltaTracker};
use super::summary::{RunCounters, RunSummary, TokenTotals};
use crate::config::RunConfig;

/// Per-run (per-session) telemetry state.
#[derive(Clone, Debug, Default)]
pub struct RunTelemetry {
    csv_header_written: bool,
    totals: TokenTotals,
    delta: DeltaTracker,
}

impl RunTelemetry {
    /// A fresh aggregator: no CSV written yet, empty sums, empty text.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes the CSV preamble and header — once per session; later calls write nothing.
    pub fn write_csv_preamble(&mut self, cfg: &RunConfig, csv: &mut dyn Write) -> io::Result<()> {
        if self.csv_header_written {
            return Ok(());
        }
        write_preamble(csv, cfg)?;
        write_header(csv)?;
        self.csv_header_written = true;
        Ok(())
    }

    /// Starts a generation: clears the token sums and the text-delta state (the first progress
    /// line of a generation extends the empty text).
    pub fn begin_generation(&mut self) {
        self.totals = TokenTotals::default();
        self.delta = DeltaTracker::new();
    }

    /// Records one generated token: adds it to the sums, writes its progress lines (with the
    /// text delta computed from the cumulative `reasoning` / `text` snapshots) and its CSV row.
    /// A CSV that never got a preamble still gets its header before the first row.
    pub fn token(
        &mut self,
        record: &TokenRecord,
        reasoning: &str,
        text: &str,
        progress: Option<&mut dyn Write>,
        csv: Option<&mut dyn Write>,
    ) -> io::Result<()> {
        self.totals.add(record);
        let delta = self.delta.advance(reasoning, text);
        if let Some(w) = progress {
            write_token_lines(w, record, &delta)?;
        }
        if let Some(w) = csv {
            if !self.csv_header_written {
                write_header(w)?;
                self.csv_header_written = true;
            }
            write_row(w, record)?;
        }
        Ok(())
    }

    /// Ends the generation: combines the sums with the counters the decode step hands over,
    /// writes the CSV `# summary` trailer, and returns the summary for `BMOE_DONE` and the
    /// report.
    pub fn finish(
        &self,
        counters: RunCounters,
        csv: Option<&mut dyn Write>,
    ) -> io::Result<RunSummary> {
        let summary = RunSummary {
            totals: self.totals.clone(),
            counters,
        };
        if let Some(w) = csv {
            write_summary(w, &summary)?;
        }
        Ok(summary)
    }

    /// The sums so far.
    pub fn totals(&self) -> &TokenTotals {
        &self.totals
    }

    /// The accumulated (reasoning, answer) text of the generation.
    pub fn text(&self) -> (&str, &str) {
        (self.delta.reasoning(), self.delta.text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preamble_once_per_session_and_sums_per_generation() {
        let cfg = RunConfig::default();
        let mut t = RunTelemetry::new();
        let mut csv = Vec::new();
        for turn in 0..2u32 {
            t.write_csv_preamble(&cfg, &mut csv).expect("vec");
            t.begin_generation();
            for step in 1..=3 {
                let r = TokenRecord {
                    step,
                    steps: 3,
                    turn,
                    wall_ms: 10.0,
                    ..TokenRecord::default()
                };
                t.token(&r, "", "x", None, Some(&mut csv)).expect("vec");
            }
            let s = t
                .finish(RunCounters::default(), Some(&mut csv))
                .expect("vec");
            assert_eq!(s.tokens(), 3, "sums restart each generation");
        }
        let text = String::from_utf8(csv).expect("utf8");
        assert_eq!(text.matches("# bmoe_metrics v2").count(), 1);
        assert_eq!(text.matches("\nstep,steps,").count(), 1);
        assert_eq!(text.matches("# summary ").count(), 2);
        let parsed = crate::telemetry::MetricsCsv::parse(&text).expect("own output parses");
        assert_eq!(parsed.rows.len(), 6);
        assert_eq!(parsed.summaries.len(), 2);
    }
}
