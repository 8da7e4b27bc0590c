//! The `io_trace v1` file: one row per flash read the streamer issued, tagged with the
//! (layer, expert, projection) it serves — where the read time went, read by read.
//!
//! Written from the `IoRecord`s the decode step emits (engine and simulator alike); the reader
//! gives them back so `bmoe-sim diff` can compare latency distributions and alignment waste.

use std::io::{self, Write};

use super::ParseError;
use crate::records::{IoRecord, Phase, RecordSink};

/// The first line of every io trace.
pub const IO_MAGIC: &str = "# io_trace v1";
/// The columns, in the contract's order.
pub const IO_COLUMNS: [&str; 12] = [
    "turn",
    "phase",
    "step",
    "layer",
    "expert",
    "proj",
    "lane",
    "spec",
    "offset",
    "req_bytes",
    "read_bytes",
    "latency_ns",
];
const FORMAT: &str = "io_trace";

/// Writes an io trace: the magic line and header at creation, then one row per read. A
/// `RecordSink`; the first write error is kept and reported by `finish`.
pub struct IoTraceWriter<W: Write> {
    w: W,
    error: Option<io::Error>,
}

impl<W: Write> IoTraceWriter<W> {
    /// Writes the magic line and the header row.
    pub fn new(mut w: W) -> io::Result<Self> {
        writeln!(w, "{IO_MAGIC}")?;
        writeln!(w, "{}", IO_COLUMNS.join(","))?;
        Ok(IoTraceWriter { w, error: None })
    }

    /// Writes one read's row.
    pub fn write(&mut self, r: &IoRecord) -> io::Result<()> {
        writeln!(
            self.w,
            "{},{},{},{},{},{},{},{},{},{},{},{}",
            r.turn,
            match r.phase {
                Phase::Prefill => 0,
                Phase::Decode => 1,
            },
            r.step,
            r.layer,
            r.expert,
            r.proj,
            r.lane,
            u8::from(r.speculative),
            r.offset,
            r.req_bytes,
            r.read_bytes,
            r.latency_ns
        )
    }

    /// Flushes and returns the writer, or the first error any write met.
    pub fn finish(mut self) -> io::Result<W> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.w.flush()?;
        Ok(self.w)
    }
}

impl<W: Write> RecordSink for IoTraceWriter<W> {
    fn wants_io(&self) -> bool {
        self.error.is_none()
    }
    fn io(&mut self, r: &IoRecord) {
        if self.error.is_none() {
            if let Err(e) = self.write(r) {
                self.error = Some(e);
            }
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match &self.error {
            // The first failure stays for `finish`; this reports it as it was.
            Some(e) => Err(io::Error::new(e.kind(), e.to_string())),
            None => self.w.flush(),
        }
    }
}

/// Parses an io trace. Columns are read by name (all twelve are required; extra ones are
/// ignored). Rejects, naming the line: a missing magic line or header column, a row with the
/// wrong field count, a non-integer field, `phase` or `spec` other than 0/1, `proj` above 255,
/// and `read_bytes` below `req_bytes` (the aligned window always covers the request).
pub fn parse_io_trace(text: &str) -> Result<Vec<IoRecord>, ParseError> {
    let at = |line: usize, reason: String| ParseError::AtLine {
        format: FORMAT,
        line,
        reason,
    };
    super::check_whole_lines(text, FORMAT)?;
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim_end_matches('\r')))
        .filter(|(_, l)| !l.trim().is_empty());
    let Some((n, magic)) = lines.next() else {
        return Err(ParseError::File {
            format: FORMAT,
            reason: "empty file".to_string(),
        });
    };
    let magic = magic.trim_start_matches('\u{feff}').trim();
    if magic != IO_MAGIC {
        return Err(at(n, format!("expected '{IO_MAGIC}', found '{magic}'")));
    }
    let (header_line, header) = loop {
        match lines.next() {
            Some((_, l)) if l.starts_with('#') => continue,
            Some(found) => break found,
            None => {
                return Err(ParseError::File {
                    format: FORMAT,
                    reason: "no header row".to_string(),
                })
            }
        }
    };
    let names: Vec<&str> = header.split(',').map(str::trim).collect();
    let mut index = [0usize; 12];
    for (slot, col) in index.iter_mut().zip(IO_COLUMNS) {
        *slot = names.iter().position(|n| *n == col).ok_or_else(|| {
            at(
                header_line,
                format!("header lacks the required column {col}"),
            )
        })?;
    }
    let mut out = Vec::new();
    let mut fields: Vec<&str> = Vec::with_capacity(names.len());
    for (n, l) in lines {
        if l.starts_with('#') {
            continue;
        }
        fields.clear();
        fields.extend(l.split(','));
        if fields.len() != names.len() {
            return Err(at(
                n,
                format!(
                    "{} fields, but the header has {} columns",
                    fields.len(),
                    names.len()
                ),
            ));
        }
        let int = |i: usize| -> Result<u64, ParseError> {
            let f = fields[index[i]];
            f.parse::<u64>().map_err(|_| {
                at(
                    n,
                    format!(
                        "column {}: '{f}' is not a non-negative integer",
                        IO_COLUMNS[i]
                    ),
                )
            })
        };
        let small = |i: usize, max: u64| -> Result<u64, ParseError> {
            let v = int(i)?;
            if v > max {
                return Err(at(
                    n,
                    format!("column {}: {v} is above {max}", IO_COLUMNS[i]),
                ));
            }
            Ok(v)
        };
        let step_field = fields[index[2]];
        let step: i64 = step_field
            .parse()
            .map_err(|_| at(n, format!("column step: '{step_field}' is not an integer")))?;
        let phase = match small(1, 1)? {
            0 => Phase::Prefill,
            _ => Phase::Decode,
        };
        let r = IoRecord {
            turn: small(0, u64::from(u32::MAX))? as u32,
            phase,
            step,
            layer: small(3, u64::from(u32::MAX))? as u32,
            expert: small(4, u64::from(u32::MAX))? as u32,
            proj: small(5, 255)? as u8,
            lane: small(6, u64::from(u32::MAX))? as u32,
            speculative: small(7, 1)? == 1,
            offset: int(8)?,
            req_bytes: int(9)?,
            read_bytes: int(10)?,
            latency_ns: int(11)?,
        };
        if r.read_bytes < r.req_bytes {
            return Err(at(
                n,
                format!(
                    "read_bytes {} is below req_bytes {}: the aligned window always covers the request",
                    r.read_bytes, r.req_bytes
                ),
            ));
        }
        out.push(r);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_columns_and_comments_are_ignored() {
        let text = "# io_trace v1\n# a comment\nturn,phase,step,layer,expert,proj,lane,spec,offset,req_bytes,read_bytes,latency_ns,extra\n\
                    0,1,-1,2,3,1,0,1,4096,100,4096,5000,x\n";
        let rows = parse_io_trace(text).expect("parses");
        assert_eq!(rows.len(), 1);
        assert_eq!(
            (rows[0].step, rows[0].speculative, rows[0].read_bytes),
            (-1, true, 4096)
        );
    }
}
