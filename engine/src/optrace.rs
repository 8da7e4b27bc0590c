//! `--compute-trace PATH` and `--compute-trace-layers PATH`: where a step's wall time went, op
//! by op or layer by layer, with the major faults sampled at every boundary (the contract's
//! `compute_trace v1`, `seeds/telemetry.md` "Decode traces").
//!
//! Our forward pass is our own code, so a boundary is a clock read where an op ends
//! ([`OpTrace::mark`]): the wall time since the previous boundary is that op's, measured. The
//! time the core spends between two backend calls — waiting on expert reads, managing the
//! cache, the router hooks — is a `WAIT` row, closed where the next backend call starts. With
//! `--compute-trace-layers` only the first boundary of each layer is kept (one `LAYER` row per
//! segment: `pre` the embedding, `blk.<il>` layer il from its first op to the next layer's
//! (the core's waits included), `post` the final norm and head — the contract puts the last
//! layer's tail in `post`; here it is `blk.<last>`, one boundary more), ~`n_layer` clock reads
//! and fault samples per step.
//!
//! A traced run is a diagnostic, not a benchmark: each boundary costs a `getrusage` call.

use std::io::{self, Write};
use std::time::Instant;

/// How finely a trace cuts a step.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Granularity {
    /// One row per op (`--compute-trace`).
    Op,
    /// One row per layer segment (`--compute-trace-layers`).
    Layers,
}

impl Granularity {
    /// The CSV preamble's `compute_trace_layers=` value: 0 off, 1 per layer, 2 per op.
    pub fn preamble_value(g: Option<Granularity>) -> u32 {
        match g {
            None => 0,
            Some(Granularity::Layers) => 1,
            Some(Granularity::Op) => 2,
        }
    }
}

/// One row: the wall time and faults since the previous boundary.
#[derive(Clone, Debug, PartialEq)]
struct Row {
    layer: i32,
    op: &'static str,
    name: &'static str,
    /// `Some(e)`: the row is routed expert `e`'s (named `<name>.<e>-<il>`).
    expert: Option<u16>,
    wall_ns: u64,
    majflt: u64,
}

/// The per-step recorder and its file.
pub struct OpTrace {
    granularity: Granularity,
    out: Box<dyn Write + Send>,
    rows: Vec<Row>,
    last: Instant,
    last_flt: u64,
    /// The running step: turn, phase (0 prefill, 1 decode), its first position.
    step: (u32, u8, u32),
    /// Layers mode: the segment now open (`-1` = `pre`).
    segment: i32,
}

impl OpTrace {
    /// A trace writing to `out`, its preamble first.
    pub fn new(
        granularity: Granularity,
        mut out: Box<dyn Write + Send>,
        preamble: &str,
    ) -> io::Result<OpTrace> {
        writeln!(out, "# compute_trace v1")?;
        writeln!(
            out,
            "# {preamble} granularity={}",
            match granularity {
                Granularity::Op => "op",
                Granularity::Layers => "layers",
            }
        )?;
        writeln!(out, "turn,phase,step,seq,layer,op,name,wall_ns,majflt")?;
        out.flush()?;
        Ok(OpTrace {
            granularity,
            out,
            rows: Vec::new(),
            last: Instant::now(),
            last_flt: crate::probe::rusage().majflt,
            step: (0, 0, 0),
            segment: -1,
        })
    }

    /// A step starts: its rows are stamped `(turn, phase, first position)`; the clock and the
    /// fault count restart here (the time before it is the loop's, not the step's).
    pub fn begin(&mut self, turn: u32, phase: u8, first: u32) {
        self.rows.clear();
        self.step = (turn, phase, first);
        self.segment = -1;
        self.last = Instant::now();
        self.last_flt = crate::probe::rusage().majflt;
    }

    /// Close the interval since the previous boundary as op `op` named `name` of `layer`
    /// (`-1`: no layer). Per-op granularity only; the layer trace ignores it.
    pub fn mark(&mut self, layer: i32, op: &'static str, name: &'static str) {
        if self.granularity == Granularity::Op {
            self.close(layer, op, name, None);
        }
    }

    /// [`OpTrace::mark`] for routed expert `expert`'s compute.
    pub fn mark_expert(&mut self, layer: i32, expert: u16) {
        if self.granularity == Granularity::Op {
            self.close(layer, "MOE", "ffn_moe", Some(expert));
        }
    }

    /// Layer `layer`'s first op starts: the layer trace closes the open segment (`pre` before
    /// the first layer); the op trace closes the core's gap before it as `WAIT`.
    pub fn layer_starts(&mut self, layer: i32) {
        match self.granularity {
            Granularity::Op => self.close(layer, "WAIT", "wait", None),
            Granularity::Layers => {
                let open = self.segment;
                self.close_segment(open);
                self.segment = layer;
            }
        }
    }

    /// The output head starts: the layer trace closes the last layer's segment (so `post` is
    /// the final norm and head alone); the op trace closes the core's gap before it.
    pub fn head_starts(&mut self) {
        // The head is no layer's: the same boundary as a layer's start, with layer −1.
        self.layer_starts(-1);
    }

    /// The batch closes (after the head): the layer trace's `post` segment.
    pub fn end(&mut self) {
        if self.granularity == Granularity::Layers {
            self.close(-1, "LAYER", "post", None);
        }
    }

    fn close_segment(&mut self, open: i32) {
        let name = if open < 0 { "pre" } else { "blk" };
        self.close(open, "LAYER", name, None);
    }

    fn close(&mut self, layer: i32, op: &'static str, name: &'static str, expert: Option<u16>) {
        let now = Instant::now();
        let flt = crate::probe::rusage().majflt;
        self.rows.push(Row {
            layer,
            op,
            name,
            expert,
            wall_ns: now.duration_since(self.last).as_nanos() as u64,
            majflt: flt.saturating_sub(self.last_flt),
        });
        self.last = now;
        self.last_flt = flt;
    }

    /// Write the step's rows and flush (the file is complete at every step boundary).
    pub fn flush_step(&mut self) -> io::Result<()> {
        let (turn, phase, step) = self.step;
        for (seq, r) in self.rows.iter().enumerate() {
            write!(
                self.out,
                "{turn},{phase},{step},{seq},{},{},",
                r.layer, r.op
            )?;
            match (r.name, r.layer, r.expert) {
                ("blk", l, _) => write!(self.out, "blk.{l}")?,
                (n, l, Some(e)) => write!(self.out, "{n}.{e}-{l}")?,
                (n, l, None) if l >= 0 => write!(self.out, "{n}-{l}")?,
                (n, _, None) => write!(self.out, "{n}")?,
            }
            writeln!(self.out, ",{},{}", r.wall_ns, r.majflt)?;
        }
        self.rows.clear();
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn lines(s: &Shared) -> Vec<String> {
        String::from_utf8(s.0.lock().unwrap().clone())
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn op_rows_are_named_by_layer_and_expert_in_order() {
        let buf = Shared::default();
        let mut t = OpTrace::new(Granularity::Op, Box::new(buf.clone()), "model=m").unwrap();
        t.begin(2, 1, 40);
        t.mark(-1, "GET_ROWS", "embd");
        t.layer_starts(0);
        t.mark(0, "ATTN", "attn");
        t.mark_expert(0, 7);
        t.head_starts();
        t.mark(-1, "HEAD", "result_output");
        t.end();
        t.flush_step().unwrap();
        let l = lines(&buf);
        assert_eq!(l[0], "# compute_trace v1");
        assert_eq!(l[1], "# model=m granularity=op");
        assert_eq!(l[2], "turn,phase,step,seq,layer,op,name,wall_ns,majflt");
        let cells: Vec<Vec<&str>> = l[3..].iter().map(|r| r.split(',').collect()).collect();
        let names: Vec<&str> = cells.iter().map(|c| c[6]).collect();
        assert_eq!(
            names,
            [
                "embd",
                "wait-0",
                "attn-0",
                "ffn_moe.7-0",
                "wait",
                "result_output"
            ]
        );
        for (i, c) in cells.iter().enumerate() {
            assert_eq!(&c[..4], &["2", "1", "40", &i.to_string()]);
            assert!(c[7].parse::<u64>().is_ok() && c[8].parse::<u64>().is_ok());
        }
    }

    #[test]
    fn the_layer_trace_keeps_one_row_per_segment() {
        let buf = Shared::default();
        let mut t = OpTrace::new(Granularity::Layers, Box::new(buf.clone()), "x=1").unwrap();
        t.begin(0, 0, 0);
        t.mark(-1, "GET_ROWS", "embd");
        t.layer_starts(0);
        t.mark(0, "ATTN", "attn");
        t.mark_expert(0, 3);
        t.layer_starts(1);
        t.head_starts();
        t.end();
        t.flush_step().unwrap();
        let l = lines(&buf);
        let rows: Vec<String> = l[3..]
            .iter()
            .map(|r| r.split(',').take(7).collect::<Vec<_>>().join(","))
            .collect();
        assert_eq!(
            rows,
            [
                "0,0,0,0,-1,LAYER,pre",
                "0,0,0,1,0,LAYER,blk.0",
                "0,0,0,2,1,LAYER,blk.1",
                "0,0,0,3,-1,LAYER,post"
            ]
        );
    }
}
