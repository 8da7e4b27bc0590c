//! `TraceTee`: one `RecordSink` over the route-trace and io-trace writers, because the decode
//! step takes a single sink and a run may ask for both traces, either, or neither.

use crate::records::{IoRecord, RecordSink, RouteRecord};

/// Forwards route records to `route` and io records to `io`; an absent side wants nothing.
#[derive(Default)]
pub struct TraceTee<'a> {
    pub route: Option<&'a mut dyn RecordSink>,
    pub io: Option<&'a mut dyn RecordSink>,
}

impl RecordSink for TraceTee<'_> {
    fn wants_routes(&self) -> bool {
        self.route.as_ref().is_some_and(|s| s.wants_routes())
    }
    fn wants_io(&self) -> bool {
        self.io.as_ref().is_some_and(|s| s.wants_io())
    }
    fn begin_step(&mut self, turn: u32, phase: crate::records::Phase) {
        if let Some(s) = self.route.as_mut() {
            s.begin_step(turn, phase);
        }
        if let Some(s) = self.io.as_mut() {
            s.begin_step(turn, phase);
        }
    }
    fn step_rows(&mut self, seqs: &[u32]) {
        if let Some(s) = self.route.as_mut() {
            s.step_rows(seqs);
        }
    }
    fn route(&mut self, r: &RouteRecord) {
        if let Some(s) = self.route.as_mut() {
            s.route(r);
        }
    }
    fn io(&mut self, r: &IoRecord) {
        if let Some(s) = self.io.as_mut() {
            s.io(r);
        }
    }
    fn end_turn(&mut self, turn: u32, tokens: u32, speculating: bool) {
        if let Some(s) = self.route.as_mut() {
            s.end_turn(turn, tokens, speculating);
        }
        if let Some(s) = self.io.as_mut() {
            s.end_turn(turn, tokens, speculating);
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        if let Some(s) = self.route.as_mut() {
            s.flush()?;
        }
        if let Some(s) = self.io.as_mut() {
            s.flush()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::Phase;
    use crate::telemetry::io_trace::{parse_io_trace, IoTraceWriter};

    #[test]
    fn forwards_each_kind_to_its_writer() {
        let mut io = IoTraceWriter::new(Vec::new()).expect("vec");
        let rec = IoRecord {
            turn: 0,
            phase: Phase::Decode,
            step: 3,
            layer: 1,
            expert: 2,
            proj: 0,
            lane: 0,
            speculative: false,
            offset: 0,
            req_bytes: 10,
            read_bytes: 4096,
            latency_ns: 7,
        };
        {
            let mut tee = TraceTee {
                route: None,
                io: Some(&mut io),
            };
            assert!(!tee.wants_routes() && tee.wants_io());
            tee.io(&rec);
        }
        let text = String::from_utf8(io.finish().expect("vec")).expect("utf8");
        assert_eq!(parse_io_trace(&text).expect("parses"), vec![rec]);
        assert!(!TraceTee::default().wants_io());
    }
}
