//! The `route_trace v1` file: which experts each MoE layer routed for each token, how strongly,
//! and whether they were resident — written by the engine, replayed by the simulator.
//!
//! The writer follows the contract's layout and appends bmoe's projection extents to each
//! `# layer=` line (`proj=<shard>:<offset>:<stride>,...`) so a replay reproduces the engine's
//! aligned read bytes. The reader is defensive because traces also come from other systems
//! (`../shared/traces`): it reads columns by name, ignores unknown ones, and rejects — naming
//! the line — anything a replay could silently get wrong.
//!
//! Predictions (`--predict-log`, `--route-ahead`) travel as appended, optional columns so the
//! simulator can replay predictors that need hidden states it does not have: `pred<h>` /
//! `pred<h>_weight` for `h = 1..=H` (what this layer's router ranked at this slot from the
//! router input `h` MoE layers earlier; empty = not predicted) and `router_expert` (the
//! router's own choice where `--route-ahead` committed a predicted routing; empty = the
//! routing is the router's). The run declares them at construction (`PredColumns`); a trace
//! without them reads exactly as before.

use std::io::{self, Write};

use super::fmt::{kv_token, parse_key_values};
use super::ParseError;
use crate::backend::Prediction;
use crate::gating::Gating;
use crate::records::{Phase, RecordSink, RouteRecord, PRED_HORIZON_MAX};

/// The first line of every route trace.
pub const ROUTE_MAGIC: &str = "# route_trace v1";
/// The columns the writer emits, in the contract's order.
pub const ROUTE_COLUMNS: [&str; 10] = [
    "turn",
    "phase",
    "step",
    "layer",
    "slot",
    "expert",
    "weight",
    "residency",
    "expert_bytes",
    "dropped",
];
const FORMAT: &str = "route_trace";
/// Largest `n_layer` / `n_expert` a trace may declare: ids are stored as `u16`.
pub const MAX_TRACE_INDEX: u32 = u16::MAX as u32;
/// Slack for float rounding above a routing weight of 1.
const WEIGHT_MAX: f32 = 1.0 + 1e-4;
/// The column holding the router's own choice under `--route-ahead`.
pub const ROUTER_EXPERT_COLUMN: &str = "router_expert";
/// The optional column a speculative run's trace numbers its steps in (the step's index within
/// its turn), so the positions of one verify decode replay as one step, and a position fed again
/// after a rejected draft as another.
pub const GROUP_COLUMN: &str = "group";
/// The optional column of a batched run's trace (`serve --parallel`): the sequence (the
/// server's slot) a routed token belongs to. Several sequences share each step, each at its
/// own positions, so with the column a cell's key is `(turn, phase, group, seq, step, layer)`;
/// the steps are numbered by `turn` (one per shared step) and `group` is always 0.
pub const SEQ_COLUMN: &str = "seq";
/// The model-line key a speculative run's trace carries: its draft source (`spec=ngram`).
pub const SPEC_KEY: &str = "spec";
/// The model-line key naming the `--route-ahead` depth a trace was recorded with.
pub const ROUTE_AHEAD_KEY: &str = "route_ahead";
/// The model-line key naming the router's gating (`Gating`); a trace without it was written
/// before gating was recorded (or by another system) and reads as qwen3moe's (softmax, top-k,
/// renormalised).
pub const GATING_KEY: &str = "gating";

/// Horizons the stale-gate predictors record (`--predict-log` scores one and two layers
/// early; `--predict-prefetch` reads up to two layers ahead).
pub const STALE_GATE_HORIZONS: u8 = 2;

/// The optional prediction columns a run writes, decided when the writer is built.
///
/// `horizons = H` appends `pred1,pred1_weight,…,predH,predH_weight` after `dropped`;
/// `route_ahead = N > 0` appends `router_expert` after them and `route_ahead=N` to the model
/// line. `PredColumns::NONE` writes the trace exactly as before predictions existed.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PredColumns {
    /// Widest prediction horizon recorded, `0..=PRED_HORIZON_MAX` (`--predict-log`
    /// records 2; `--route-ahead N` records at least `N` when it records its predictions).
    pub horizons: u8,
    /// `--route-ahead` depth the run committed routings at, `0..=PRED_HORIZON_MAX`; 0 = off
    /// (no `router_expert` column).
    pub route_ahead: u8,
}

impl PredColumns {
    /// No prediction columns.
    pub const NONE: PredColumns = PredColumns {
        horizons: 0,
        route_ahead: 0,
    };

    /// The columns a run with `cfg`'s predictor flags records: `--predict-log` and
    /// `--predict-prefetch` the stale-gate horizons 1–2, `--route-ahead N` horizons up to `N`
    /// and the `router_expert` column (depths clamped to `PRED_HORIZON_MAX`, which
    /// `validate()` already enforces).
    pub fn for_config(cfg: &crate::config::RunConfig) -> PredColumns {
        let max = PRED_HORIZON_MAX as u32;
        let route_ahead = cfg.route_ahead.min(max) as u8; // <= PRED_HORIZON_MAX
        let stale_gate = if cfg.predict_log || cfg.predict_prefetch {
            STALE_GATE_HORIZONS
        } else {
            0
        };
        PredColumns {
            horizons: stale_gate.max(route_ahead),
            route_ahead,
        }
    }

    /// The appended column names, in order.
    pub fn column_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for h in 1..=self.horizons {
            names.push(format!("pred{h}"));
            names.push(format!("pred{h}_weight"));
        }
        if self.route_ahead > 0 {
            names.push(ROUTER_EXPERT_COLUMN.to_string());
        }
        names
    }
}

/// One projection's extent in the model file: expert `e` occupies
/// `offset + e·stride .. offset + (e+1)·stride` of shard `shard`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProjExtent {
    pub shard: u32,
    pub offset: u64,
    pub stride: u64,
}

/// One `# layer=` line: a MoE layer's id (as the rows' `layer` column spells it), one expert's
/// bytes (every projection), the layer's dense bytes, and (bmoe traces) its projection extents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceLayer {
    pub layer: u32,
    pub expert_bytes: u64,
    pub dense_bytes: u64,
    pub proj: Vec<ProjExtent>,
}

impl TraceLayer {
    /// The `# layer=` lines of `layout`: each MoE layer's id, one expert's bytes, its dense
    /// bytes and its projection extents (what `bmoe-sim` rebuilds a layout from).
    pub fn of_layout(layout: &crate::layout::ExpertLayout) -> Vec<TraceLayer> {
        layout
            .layers()
            .iter()
            .map(|l| TraceLayer {
                layer: l.model_layer,
                expert_bytes: l.projections.iter().map(|p| p.stride_bytes).sum(),
                dense_bytes: l.dense_bytes,
                proj: l
                    .projections
                    .iter()
                    .map(|p| ProjExtent {
                        shard: u32::from(p.shard),
                        offset: p.base_offset,
                        stride: p.stride_bytes,
                    })
                    .collect(),
            })
            .collect()
    }
}

/// The `#` preamble: the run's static facts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutePreamble {
    pub model: String,
    pub arch: String,
    pub n_layer: u32,
    pub n_expert: u32,
    /// Effective routing width: every routing has exactly this many slots.
    pub n_expert_used: u32,
    /// How the router selected and weighted the experts (`gating=`), so a replay applies the
    /// router hooks the way the recording engine did.
    pub gating: Gating,
    /// The MoE layers in file order; a record's / cell's MoE layer index is a position here.
    pub layers: Vec<TraceLayer>,
    /// Free-form `# note: ...` lines (without the prefix).
    pub notes: Vec<String>,
    /// Keys of the model line (or other key=value comment lines) this build does not know.
    pub extra: Vec<(String, String)>,
}

fn phase_code(p: Phase) -> u8 {
    match p {
        Phase::Prefill => 0,
        Phase::Decode => 1,
    }
}

fn phase_from_code(c: u8) -> Option<Phase> {
    match c {
        0 => Some(Phase::Prefill),
        1 => Some(Phase::Decode),
        _ => None,
    }
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Prefill => "prefill",
        Phase::Decode => "decode",
    }
}

/// Writes a route trace: the preamble and header at creation, then one row per routed expert.
/// A `RecordSink`, so the decode step can feed it directly; the sink interface cannot return
/// errors, so the first write error is kept and reported by `finish` (and the rest skipped).
/// A speculative-capable trace's line after each turn's rows: `# turn=<t> tokens=<n>
/// speculating=<0|1>` (the tokens the turn generated, and whether it speculated).
pub const TURN_END_PREFIX: &str = "# turn=";

/// What a trace's [`TURN_END_PREFIX`] line says of its turn.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TurnEnd {
    pub tokens: u32,
    pub speculating: bool,
}

pub struct RouteTraceWriter<W: Write> {
    w: W,
    layer_ids: Vec<u32>,
    n_expert: u32,
    columns: PredColumns,
    /// With the `group` column: the turn and the index within it of the step being written.
    group: Option<(Option<u32>, u32)>,
    /// With the `seq` column: the sequence of each batch row of the step being written
    /// ([`RecordSink::step_rows`]).
    seqs: Option<Vec<u32>>,
    error: Option<io::Error>,
}

/// The optional columns that place a row within its run's steps: `group` (a speculative or
/// session run: [`GROUP_COLUMN`]) and `seq` (a batched run: [`SEQ_COLUMN`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct StepColumns {
    pub group: bool,
    pub seq: bool,
}

fn invalid_input(reason: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, reason)
}

/// The weight's shortest decimal that parses back to the same `f32`: a replay that thresholds
/// on it (`--drop-cold-experts`, whose cut is often exactly `1/k`) must see the bits the engine
/// saw — six fixed decimals turned a sigmoid router's `0.2499999` into `0.250000`.
fn format_weight(w: f32) -> String {
    if w.is_nan() {
        "nan".to_string()
    } else {
        format!("{w}")
    }
}

impl<W: Write> RouteTraceWriter<W> {
    /// Writes the preamble and the header row, without prediction columns.
    pub fn new(w: W, p: &RoutePreamble) -> io::Result<Self> {
        Self::with_predictions(w, p, PredColumns::NONE)
    }

    /// Writes the preamble and the header row with the prediction columns `columns` declares.
    /// `InvalidInput` when a horizon or the route-ahead depth exceeds `PRED_HORIZON_MAX`.
    /// A `route_ahead` key in `p.extra` is not copied: `columns` is authoritative.
    pub fn with_predictions(w: W, p: &RoutePreamble, columns: PredColumns) -> io::Result<Self> {
        Self::with_columns(w, p, columns, StepColumns::default())
    }

    /// [`RouteTraceWriter::with_predictions`], and the step columns `steps` asks for: `group`
    /// (a speculative run: see [`GROUP_COLUMN`]), numbered from the steps' `begin_step`, and
    /// `seq` ([`SEQ_COLUMN`]), from the steps' `step_rows`.
    pub fn with_columns(
        mut w: W,
        p: &RoutePreamble,
        columns: PredColumns,
        steps: StepColumns,
    ) -> io::Result<Self> {
        if usize::from(columns.horizons) > PRED_HORIZON_MAX
            || usize::from(columns.route_ahead) > PRED_HORIZON_MAX
        {
            return Err(invalid_input(format!(
                "route trace prediction columns {columns:?}: horizons and route_ahead must be at most {PRED_HORIZON_MAX}"
            )));
        }
        writeln!(w, "{ROUTE_MAGIC}")?;
        write!(
            w,
            "# model={} arch={} n_layer={} n_expert={} n_expert_used={} {GATING_KEY}={}",
            kv_token(&p.model),
            kv_token(&p.arch),
            p.n_layer,
            p.n_expert,
            p.n_expert_used,
            p.gating
        )?;
        for (k, v) in p
            .extra
            .iter()
            .filter(|(k, _)| k != ROUTE_AHEAD_KEY && k != GATING_KEY)
        {
            write!(w, " {}={}", kv_token(k), kv_token(v))?;
        }
        if columns.route_ahead > 0 {
            write!(w, " {ROUTE_AHEAD_KEY}={}", columns.route_ahead)?;
        }
        writeln!(w)?;
        for note in &p.notes {
            writeln!(w, "# note: {}", note.replace(['\n', '\r'], " "))?;
        }
        for l in &p.layers {
            write!(
                w,
                "# layer={} expert_bytes={} dense_bytes={}",
                l.layer, l.expert_bytes, l.dense_bytes
            )?;
            if !l.proj.is_empty() {
                let extents: Vec<String> = l
                    .proj
                    .iter()
                    .map(|e| format!("{}:{}:{}", e.shard, e.offset, e.stride))
                    .collect();
                write!(w, " proj={}", extents.join(","))?;
            }
            writeln!(w)?;
        }
        let mut header = ROUTE_COLUMNS.join(",");
        for name in columns.column_names() {
            header.push(',');
            header.push_str(&name);
        }
        if steps.group {
            header.push(',');
            header.push_str(GROUP_COLUMN);
        }
        if steps.seq {
            header.push(',');
            header.push_str(SEQ_COLUMN);
        }
        writeln!(w, "{header}")?;
        Ok(RouteTraceWriter {
            w,
            layer_ids: p.layers.iter().map(|l| l.layer).collect(),
            n_expert: p.n_expert,
            columns,
            group: steps.group.then_some((None, 0)),
            seqs: steps.seq.then(Vec::new),
            error: None,
        })
    }

    /// The prediction columns this writer declared.
    pub fn columns(&self) -> PredColumns {
        self.columns
    }

    /// Writes one row. `r.layer` is the MoE layer index; the row carries that layer's id from
    /// the preamble. `InvalidInput` (nothing written) for a record of a layer the preamble does
    /// not declare, a prediction beyond the declared horizon, a `router_expert` without the
    /// declared column, or a predicted / router expert id not below `n_expert`.
    pub fn write(&mut self, r: &RouteRecord) -> io::Result<()> {
        let horizons = usize::from(self.columns.horizons);
        for (i, p) in r.preds.iter().enumerate() {
            let Some((id, _)) = p else { continue };
            if i >= horizons {
                return Err(invalid_input(format!(
                    "route record (step {}, MoE layer {}, slot {}) has a horizon-{} prediction but the trace declares {horizons} prediction horizon(s)",
                    r.step,
                    r.layer,
                    r.slot,
                    i + 1
                )));
            }
            if u32::from(*id) >= self.n_expert {
                return Err(invalid_input(format!(
                    "route record (step {}, MoE layer {}, slot {}): predicted expert {id} is not below n_expert={}",
                    r.step, r.layer, r.slot, self.n_expert
                )));
            }
        }
        if let Some(id) = r.router_expert {
            if self.columns.route_ahead == 0 {
                return Err(invalid_input(format!(
                    "route record (step {}, MoE layer {}, slot {}) carries router_expert but the trace declares no route-ahead column",
                    r.step, r.layer, r.slot
                )));
            }
            if id >= self.n_expert {
                return Err(invalid_input(format!(
                    "route record (step {}, MoE layer {}, slot {}): router_expert {id} is not below n_expert={}",
                    r.step, r.layer, r.slot, self.n_expert
                )));
            }
        }
        let id = self
            .layer_ids
            .get(r.layer as usize)
            .copied()
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "route record for MoE layer {} but the trace preamble declares {} layers",
                        r.layer,
                        self.layer_ids.len()
                    ),
                )
            })?;
        let weight = format_weight(r.weight);
        let mut tail = String::new();
        for p in &r.preds[..horizons] {
            match p {
                Some((id, w)) => {
                    tail.push_str(&format!(",{id},{}", format_weight(*w)));
                }
                None => tail.push_str(",,"),
            }
        }
        if self.columns.route_ahead > 0 {
            tail.push(',');
            if let Some(id) = r.router_expert {
                tail.push_str(&id.to_string());
            }
        }
        if let Some((_, g)) = self.group {
            tail.push_str(&format!(",{g}"));
        }
        if let Some(seqs) = &self.seqs {
            let seq = seqs.get(r.row as usize).ok_or_else(|| {
                invalid_input(format!(
                    "route record (step {}, MoE layer {}, slot {}) of batch row {} but the step named the sequences of {} rows",
                    r.step,
                    r.layer,
                    r.slot,
                    r.row,
                    seqs.len()
                ))
            })?;
            tail.push_str(&format!(",{seq}"));
        }
        writeln!(
            self.w,
            "{},{},{},{},{},{},{},{},{},{}{}",
            r.turn,
            phase_code(r.phase),
            r.step,
            id,
            r.slot,
            r.expert,
            weight,
            r.residency,
            r.expert_bytes,
            u8::from(r.dropped),
            tail
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

impl<W: Write> RecordSink for RouteTraceWriter<W> {
    fn wants_routes(&self) -> bool {
        self.error.is_none()
    }
    fn begin_step(&mut self, turn: u32, _phase: Phase) {
        if let Some((t, g)) = self.group.as_mut() {
            if *t == Some(turn) {
                *g += 1;
            } else {
                *t = Some(turn);
                *g = 0;
            }
        }
    }
    fn step_rows(&mut self, seqs: &[u32]) {
        if let Some(v) = self.seqs.as_mut() {
            v.clear();
            v.extend_from_slice(seqs);
        }
    }
    fn route(&mut self, r: &RouteRecord) {
        if self.error.is_none() {
            if let Err(e) = self.write(r) {
                self.error = Some(e);
            }
        }
    }
    /// With the `group` column, `# turn=<t> tokens=<n> speculating=<0|1>` after the turn's
    /// rows ([`TURN_END_PREFIX`]).
    fn end_turn(&mut self, turn: u32, tokens: u32, speculating: bool) {
        if self.error.is_none() && self.group.is_some() {
            if let Err(e) = writeln!(
                self.w,
                "{TURN_END_PREFIX}{turn} tokens={tokens} speculating={}",
                u8::from(speculating)
            ) {
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

/// One routed expert of a cell.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct RouteSlot {
    pub expert: u32,
    /// Final applied weight; NaN = unknown (then every slot of the cell is NaN).
    pub weight: f32,
    pub residency: u8,
    pub expert_bytes: u64,
    pub dropped: bool,
}

/// One routing: the `n_expert_used` rows sharing (turn, phase, step, layer).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RouteCell {
    pub turn: u32,
    pub phase: Phase,
    /// The step's index within its turn (the `group` column of a speculative run's trace; 0
    /// in a trace without it, where a decode step is one position).
    pub group: u32,
    /// The sequence the token belongs to (the `seq` column of a batched run's trace; 0 in a
    /// trace without it).
    pub seq: u32,
    pub step: i64,
    /// Position of the layer in `RoutePreamble::layers`.
    pub moe_layer: u16,
    first_slot: u32,
    n_slots: u16,
}

/// The cells of one token (same turn, phase and step), in MoE-layer order.
#[derive(Copy, Clone, Debug)]
pub struct TraceStep<'a> {
    pub turn: u32,
    pub phase: Phase,
    pub step: i64,
    pub cells: &'a [RouteCell],
}

/// A parsed and checked route trace. Cells are sorted by (turn, phase, step, MoE layer), their
/// slots in router rank order.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteTrace {
    pub preamble: RoutePreamble,
    /// Whether the file had the optional `dropped` column.
    pub has_dropped_column: bool,
    pub cells: Vec<RouteCell>,
    slots: Vec<RouteSlot>,
    /// The first file line of each cell, for cross-row error messages.
    cell_lines: Vec<u32>,
    /// Which prediction columns the file had (`route_ahead` from the model line's key).
    pred_columns: PredColumns,
    /// Whether the file had the `router_expert` column.
    has_router_expert_column: bool,
    /// Whether the file had the `group` column (a speculative run's).
    has_group_column: bool,
    /// Whether the file had the `seq` column (a batched run's).
    has_seq_column: bool,
    /// Each turn's [`TURN_END_PREFIX`] line, by turn (a trace whose writer had none: empty).
    turn_ends: std::collections::BTreeMap<u32, TurnEnd>,
    /// Per slot (parallel to `slots`), `pred_columns.horizons` entries: horizon `h` at
    /// `slot_index · H + h − 1`.
    preds: Vec<Option<(u16, f32)>>,
    /// Per slot (parallel to `slots`) when the file had `router_expert`; empty otherwise.
    router_experts: Vec<Option<u16>>,
}

struct Entry {
    turn: u32,
    phase: u8,
    group: u32,
    seq: u32,
    step: i64,
    moe_layer: u16,
    slot: u16,
    line: u32,
    value: RouteSlot,
    preds: [Option<(u16, f32)>; PRED_HORIZON_MAX],
    router_expert: Option<u16>,
}

impl Entry {
    fn cell_key(&self) -> (u32, u8, u32, u32, i64, u16) {
        (
            self.turn,
            self.phase,
            self.group,
            self.seq,
            self.step,
            self.moe_layer,
        )
    }
}

struct Columns {
    turn: usize,
    phase: usize,
    step: usize,
    layer: usize,
    slot: usize,
    expert: usize,
    weight: usize,
    residency: usize,
    expert_bytes: usize,
    dropped: Option<usize>,
    /// `(pred<h>, pred<h>_weight)` for `h = 1..=H`.
    preds: Vec<(usize, usize)>,
    router_expert: Option<usize>,
    group: Option<usize>,
    seq: Option<usize>,
    count: usize,
}

fn at(line: usize, reason: impl Into<String>) -> ParseError {
    ParseError::AtLine {
        format: FORMAT,
        line,
        reason: reason.into(),
    }
}

fn whole(reason: impl Into<String>) -> ParseError {
    ParseError::File {
        format: FORMAT,
        reason: reason.into(),
    }
}

fn parse_int<T: std::str::FromStr>(field: &str, name: &str, line: usize) -> Result<T, ParseError> {
    field.parse::<T>().map_err(|_| {
        at(
            line,
            format!("column {name}: '{field}' is not a valid integer"),
        )
    })
}

impl RouteTrace {
    /// Parses and checks a route trace. Rejects, naming the line where there is one:
    /// a missing magic line, model line key (`model`, `arch`, `n_layer`, `n_expert`,
    /// `n_expert_used`) or `# layer=` key; a layer declared twice or not below `n_layer`;
    /// a missing required column; a row with the wrong field count or a non-numeric field; a
    /// phase other than 0/1, a layer without a `# layer=` line, a slot ≥ `n_expert_used`, an
    /// expert ≥ `n_expert`, a residency other than 0/1/2, `dropped` other than 0/1; a weight
    /// that is negative, above 1, or infinite; `expert_bytes` on a hit or on a dropped routing;
    /// a duplicate `(turn, phase, step, layer, slot)`; a routing with missing slots, an expert
    /// twice, or known and `nan` weights mixed; layers that disagree in token count within a
    /// (turn, phase) (prefill's last layer may route a single token, as llama.cpp's does); and
    /// a trace in which every token routes the same experts at every layer.
    pub fn parse(text: &str) -> Result<RouteTrace, ParseError> {
        super::check_whole_lines(text, FORMAT)?;
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim_end_matches('\r')));

        // Magic.
        let (magic_line, magic) = loop {
            match lines.next() {
                Some((_, l)) if l.trim().is_empty() => continue,
                Some(found) => break found,
                None => return Err(whole("empty file")),
            }
        };
        let magic = magic.trim_start_matches('\u{feff}').trim();
        if magic != ROUTE_MAGIC {
            return Err(at(
                magic_line,
                format!("expected '{ROUTE_MAGIC}', found '{magic}'"),
            ));
        }

        // Preamble up to the header row.
        let mut model_line: Option<(usize, Vec<(String, String)>)> = None;
        let mut layer_lines: Vec<(usize, Vec<(String, String)>)> = Vec::new();
        let mut notes = Vec::new();
        let mut extra = Vec::new();
        // The line each extra pair came from, for the duplicate-key error below.
        let mut extra_lines: Vec<usize> = Vec::new();
        let (header_line, header) = loop {
            let Some((n, l)) = lines.next() else {
                return Err(whole("no header row"));
            };
            if l.trim().is_empty() {
                continue;
            }
            let Some(body) = l.strip_prefix('#') else {
                break (n, l);
            };
            let body = body.trim();
            if let Some(note) = body.strip_prefix("note:") {
                notes.push(note.trim().to_string());
                continue;
            }
            let Some(pairs) = parse_key_values(body) else {
                continue; // a free-form comment
            };
            match pairs.first().map(|(k, _)| k.as_str()) {
                Some("model") => {
                    if model_line.is_some() {
                        return Err(at(n, "a second '# model=' line"));
                    }
                    model_line = Some((n, pairs));
                }
                Some("layer") => layer_lines.push((n, pairs)),
                _ => {
                    extra_lines.extend(std::iter::repeat_n(n, pairs.len()));
                    extra.extend(pairs);
                }
            }
        };

        let Some((model_no, model_pairs)) = model_line else {
            return Err(whole("missing the '# model=... arch=... n_layer=... n_expert=... n_expert_used=...' line"));
        };
        let get = |key: &str| -> Result<&str, ParseError> {
            model_pairs
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
                .ok_or_else(|| at(model_no, format!("missing required key {key}=")))
        };
        let get_count = |key: &str| -> Result<u32, ParseError> {
            let v = get(key)?;
            v.parse::<u32>()
                .map_err(|_| at(model_no, format!("{key}={v} is not a non-negative integer")))
        };
        let model = get("model")?.to_string();
        let arch = get("arch")?.to_string();
        let n_layer = get_count("n_layer")?;
        let n_expert = get_count("n_expert")?;
        let n_expert_used = get_count("n_expert_used")?;
        if n_layer == 0 || n_layer > MAX_TRACE_INDEX {
            return Err(at(
                model_no,
                format!("n_layer={n_layer} must be in [1, {MAX_TRACE_INDEX}]"),
            ));
        }
        if n_expert == 0 || n_expert > MAX_TRACE_INDEX {
            return Err(at(
                model_no,
                format!("n_expert={n_expert} must be in [1, {MAX_TRACE_INDEX}]"),
            ));
        }
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(at(
                model_no,
                format!("n_expert_used={n_expert_used} must be in [1, n_expert={n_expert}]"),
            ));
        }
        for (k, v) in model_pairs.iter() {
            if !["model", "arch", "n_layer", "n_expert", "n_expert_used"].contains(&k.as_str()) {
                extra.push((k.clone(), v.clone()));
                extra_lines.push(model_no);
            }
        }
        // A key given twice is ambiguous (and the writer, which puts every extra key on the
        // model line, could not write the trace back as read).
        let mut seen: Vec<&str> = model_pairs.iter().map(|(k, _)| k.as_str()).collect();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(at(model_no, format!("key {}= appears twice", w[0])));
        }
        for (i, (k, _)) in extra.iter().enumerate() {
            let known = ["model", "arch", "n_layer", "n_expert", "n_expert_used"];
            let line = extra_lines.get(i).copied().unwrap_or(model_no);
            if known.contains(&k.as_str()) || extra[..i].iter().any(|(p, _)| p == k) {
                return Err(at(line, format!("key {k}= appears twice in the preamble")));
            }
        }
        // `gating=` is structured; absent, the trace predates it (qwen3moe's gating).
        let mut gating = Gating::default();
        if let Some(i) = extra.iter().position(|(k, _)| k == GATING_KEY) {
            let (_, v) = extra.remove(i);
            gating = v
                .parse::<Gating>()
                .map_err(|e| at(model_no, e.to_string()))?;
        }
        // `route_ahead=N` (the depth a `--route-ahead` run committed at) is structured, not
        // an opaque extra key.
        let mut route_ahead = 0u8;
        if let Some(i) = extra.iter().position(|(k, _)| k == ROUTE_AHEAD_KEY) {
            let (_, v) = extra.remove(i);
            route_ahead = v
                .parse::<u8>()
                .ok()
                .filter(|&n| (1..=PRED_HORIZON_MAX).contains(&usize::from(n)))
                .ok_or_else(|| {
                    at(
                        model_no,
                        format!("{ROUTE_AHEAD_KEY}={v} is not in [1, {PRED_HORIZON_MAX}]"),
                    )
                })?;
        }

        // Layers.
        if layer_lines.is_empty() {
            return Err(whole(
                "no '# layer=<id> expert_bytes=<n> dense_bytes=<n>' lines",
            ));
        }
        let mut layers = Vec::with_capacity(layer_lines.len());
        let mut moe_of_id = vec![u16::MAX; n_layer as usize];
        for (n, pairs) in &layer_lines {
            let n = *n;
            let get = |key: &str| -> Result<&str, ParseError> {
                pairs
                    .iter()
                    .find(|(k, _)| k == key)
                    .map(|(_, v)| v.as_str())
                    .ok_or_else(|| at(n, format!("missing required key {key}=")))
            };
            let layer: u32 = parse_int(get("layer")?, "layer", n)?;
            let expert_bytes: u64 = parse_int(get("expert_bytes")?, "expert_bytes", n)?;
            let dense_bytes: u64 = parse_int(get("dense_bytes")?, "dense_bytes", n)?;
            if layer >= n_layer {
                return Err(at(
                    n,
                    format!("layer={layer} is not below n_layer={n_layer}"),
                ));
            }
            if moe_of_id[layer as usize] != u16::MAX {
                return Err(at(n, format!("layer={layer} is declared twice")));
            }
            let proj = match pairs.iter().find(|(k, _)| k == "proj") {
                Some((_, v)) => parse_proj(v).map_err(|reason| at(n, reason))?,
                None => Vec::new(),
            };
            // layers.len() < n_layer <= u16::MAX (one per distinct id), so this index fits.
            moe_of_id[layer as usize] = layers.len() as u16;
            layers.push(TraceLayer {
                layer,
                expert_bytes,
                dense_bytes,
                proj,
            });
        }

        // Header.
        let columns = parse_header(header, header_line)?;

        // Rows.
        let mut entries: Vec<Entry> = Vec::new();
        let mut turn_ends = std::collections::BTreeMap::new();
        let mut fields: Vec<&str> = Vec::with_capacity(columns.count);
        for (n, l) in lines {
            if let Some(rest) = l.strip_prefix(TURN_END_PREFIX) {
                let (turn, end) = parse_turn_end(rest).ok_or_else(|| {
                    at(
                        n,
                        format!("expected `{TURN_END_PREFIX}<turn> tokens=<n> speculating=<0|1>`"),
                    )
                })?;
                if turn_ends.insert(turn, end).is_some() {
                    return Err(at(n, format!("a second end line for turn {turn}")));
                }
                continue;
            }
            if l.is_empty() || l.starts_with('#') || l.trim().is_empty() {
                continue;
            }
            fields.clear();
            fields.extend(l.split(','));
            if fields.len() != columns.count {
                return Err(at(
                    n,
                    format!(
                        "{} fields, but the header has {} columns",
                        fields.len(),
                        columns.count
                    ),
                ));
            }
            let line = u32::try_from(n).map_err(|_| at(n, "file has too many lines"))?;
            let turn: u32 = parse_int(fields[columns.turn], "turn", n)?;
            let phase_raw: u8 = parse_int(fields[columns.phase], "phase", n)?;
            if phase_from_code(phase_raw).is_none() {
                return Err(at(
                    n,
                    format!("phase {phase_raw} is not 0 (prefill) or 1 (decode)"),
                ));
            }
            let step: i64 = parse_int(fields[columns.step], "step", n)?;
            let layer_id: u32 = parse_int(fields[columns.layer], "layer", n)?;
            let moe_layer = moe_of_id
                .get(layer_id as usize)
                .copied()
                .unwrap_or(u16::MAX);
            if moe_layer == u16::MAX {
                return Err(at(
                    n,
                    format!("layer {layer_id} has no '# layer={layer_id}' line"),
                ));
            }
            let slot: u32 = parse_int(fields[columns.slot], "slot", n)?;
            if slot >= n_expert_used {
                return Err(at(
                    n,
                    format!("slot {slot} is not below n_expert_used={n_expert_used}"),
                ));
            }
            let expert: u32 = parse_int(fields[columns.expert], "expert", n)?;
            if expert >= n_expert {
                return Err(at(
                    n,
                    format!("expert {expert} is not below n_expert={n_expert}"),
                ));
            }
            let weight = parse_weight_max(fields[columns.weight], gating.max_weight())
                .map_err(|reason| at(n, reason))?;
            let residency: u8 = parse_int(fields[columns.residency], "residency", n)?;
            if residency > 2 {
                return Err(at(n, format!("residency {residency} is not 0, 1 or 2")));
            }
            let expert_bytes: u64 = parse_int(fields[columns.expert_bytes], "expert_bytes", n)?;
            let dropped = match columns.dropped {
                None => false,
                Some(i) => match fields[i] {
                    "0" => false,
                    "1" => true,
                    other => return Err(at(n, format!("column dropped: '{other}' is not 0 or 1"))),
                },
            };
            if expert_bytes > 0 && residency != 0 {
                return Err(at(
                    n,
                    format!("expert_bytes {expert_bytes} on a hit (residency {residency}): only a miss reads"),
                ));
            }
            if expert_bytes > 0 && dropped {
                return Err(at(
                    n,
                    format!(
                        "expert_bytes {expert_bytes} on a dropped routing, which is never read"
                    ),
                ));
            }
            let mut preds = [None; PRED_HORIZON_MAX];
            for (h, &(id_col, weight_col)) in columns.preds.iter().enumerate() {
                preds[h] = parse_pred(
                    fields[id_col],
                    fields[weight_col],
                    h + 1,
                    n_expert,
                    gating.max_weight(),
                )
                .map_err(|reason| at(n, reason))?;
            }
            let router_expert = match columns.router_expert {
                None => None,
                Some(i) if fields[i].is_empty() => None,
                Some(i) => {
                    let id: u32 = parse_int(fields[i], ROUTER_EXPERT_COLUMN, n)?;
                    if id >= n_expert {
                        return Err(at(
                            n,
                            format!("column {ROUTER_EXPERT_COLUMN}: expert {id} is not below n_expert={n_expert}"),
                        ));
                    }
                    Some(id as u16) // id < n_expert <= u16::MAX
                }
            };
            let group: u32 = match columns.group {
                None => 0,
                Some(i) => parse_int(fields[i], GROUP_COLUMN, n)?,
            };
            let seq: u32 = match columns.seq {
                None => 0,
                Some(i) => parse_int(fields[i], SEQ_COLUMN, n)?,
            };
            entries.push(Entry {
                turn,
                phase: phase_raw,
                group,
                seq,
                step,
                moe_layer,
                slot: slot as u16, // slot < n_expert_used <= u16::MAX
                line,
                value: RouteSlot {
                    expert,
                    weight,
                    residency,
                    expert_bytes,
                    dropped,
                },
                preds,
                router_expert,
            });
        }

        let preamble = RoutePreamble {
            model,
            arch,
            n_layer,
            n_expert,
            n_expert_used,
            gating,
            layers,
            notes,
            extra,
        };
        let pred_columns = PredColumns {
            // columns.preds.len() <= PRED_HORIZON_MAX (checked in parse_header).
            horizons: columns.preds.len() as u8,
            route_ahead,
        };
        let mut trace = build_cells(
            preamble,
            FileColumns {
                dropped: columns.dropped.is_some(),
                preds: pred_columns,
                router_expert: columns.router_expert.is_some(),
                group: columns.group.is_some(),
                seq: columns.seq.is_some(),
            },
            entries,
        )?;
        trace.turn_ends = turn_ends;
        trace.check_layer_token_counts()?;
        trace.check_not_constant()?;
        Ok(trace)
    }

    /// The slots of a cell, in rank order.
    pub fn cell_slots(&self, cell: &RouteCell) -> &[RouteSlot] {
        let start = cell.first_slot as usize;
        &self.slots[start..start + cell.n_slots as usize]
    }

    /// The tokens of the trace, in (turn, phase, step) order, each with its cells.
    pub fn steps(&self) -> impl Iterator<Item = TraceStep<'_>> + '_ {
        let mut rest: &[RouteCell] = &self.cells;
        std::iter::from_fn(move || {
            let first = *rest.first()?;
            let len = rest
                .iter()
                .take_while(|c| {
                    c.turn == first.turn
                        && c.phase == first.phase
                        && c.group == first.group
                        && c.seq == first.seq
                        && c.step == first.step
                })
                .count();
            let (cells, tail) = rest.split_at(len);
            rest = tail;
            Some(TraceStep {
                turn: first.turn,
                phase: first.phase,
                step: first.step,
                cells,
            })
        })
    }

    /// Every row as a `RouteRecord` (with `layer` the MoE layer index), in cell order, with
    /// its recorded predictions and router choice.
    pub fn records(&self) -> impl Iterator<Item = RouteRecord> + '_ {
        self.cells.iter().flat_map(move |c| {
            self.cell_slots(c)
                .iter()
                .enumerate()
                .map(move |(slot, s)| RouteRecord {
                    turn: c.turn,
                    phase: c.phase,
                    step: c.step,
                    layer: u32::from(c.moe_layer),
                    slot: slot as u32,
                    expert: s.expert,
                    weight: s.weight,
                    residency: s.residency,
                    expert_bytes: s.expert_bytes,
                    dropped: s.dropped,
                    preds: self.slot_preds(c, slot),
                    row: 0,
                    router_expert: self.slot_router_expert(c, slot),
                })
        })
    }

    /// The prediction columns the file had (`route_ahead` is the model line's
    /// `route_ahead=N`, 0 when absent).
    pub fn pred_columns(&self) -> PredColumns {
        self.pred_columns
    }

    /// Whether the file had the `router_expert` column.
    pub fn has_router_expert_column(&self) -> bool {
        self.has_router_expert_column
    }

    /// Whether the file had the `group` column: a speculative run's, whose decode steps may
    /// hold several positions and feed a position again ([`GROUP_COLUMN`]).
    pub fn has_group_column(&self) -> bool {
        self.has_group_column
    }

    /// Whether the file had the `seq` column: a batched run's, whose steps hold tokens of
    /// several sequences, each at its own positions ([`SEQ_COLUMN`]).
    pub fn has_seq_column(&self) -> bool {
        self.has_seq_column
    }

    /// What turn `turn`'s end line says, if the trace has one.
    pub fn turn_end(&self, turn: u32) -> Option<TurnEnd> {
        self.turn_ends.get(&turn).copied()
    }

    /// The recorded prediction at `slot` of `cell` for `horizon` (1-based): `None` where
    /// nothing was predicted, the horizon is 0 or beyond the file's columns, or the slot is
    /// out of the cell.
    pub fn slot_pred(&self, cell: &RouteCell, slot: usize, horizon: usize) -> Option<(u16, f32)> {
        let h_max = usize::from(self.pred_columns.horizons);
        if horizon == 0 || horizon > h_max || slot >= usize::from(cell.n_slots) {
            return None;
        }
        let index = (cell.first_slot as usize + slot) * h_max + horizon - 1;
        self.preds.get(index).copied().flatten()
    }

    fn slot_preds(&self, cell: &RouteCell, slot: usize) -> [Option<(u16, f32)>; PRED_HORIZON_MAX] {
        let mut out = [None; PRED_HORIZON_MAX];
        for (h, p) in out.iter_mut().enumerate() {
            *p = self.slot_pred(cell, slot, h + 1);
        }
        out
    }

    /// Whether `cell` carries a prediction at `horizon` (1-based; then every slot does).
    pub fn has_pred(&self, cell: &RouteCell, horizon: usize) -> bool {
        self.slot_pred(cell, 0, horizon).is_some()
    }

    /// Fill `out` with the recorded horizon-`horizon` prediction of `cell` (ids and weights
    /// in the router's rank order). False, with `out` cleared, where nothing was predicted.
    pub fn cell_pred(&self, cell: &RouteCell, horizon: usize, out: &mut Prediction) -> bool {
        out.clear();
        if !self.has_pred(cell, horizon) {
            return false;
        }
        for slot in 0..usize::from(cell.n_slots) {
            if let Some((id, w)) = self.slot_pred(cell, slot, horizon) {
                out.ids.push(id);
                out.weights.push(w);
            }
        }
        true
    }

    /// The router's own choice at `slot` of `cell` where `--route-ahead` committed the
    /// routing (the `expert` column then holds the committed id); `None` for a routing the
    /// router chose.
    pub fn slot_router_expert(&self, cell: &RouteCell, slot: usize) -> Option<u32> {
        if slot >= usize::from(cell.n_slots) {
            return None;
        }
        self.router_experts
            .get(cell.first_slot as usize + slot)
            .copied()
            .flatten()
            .map(u32::from)
    }

    /// Whether `--route-ahead` committed `cell`'s routing from a prediction.
    pub fn is_committed(&self, cell: &RouteCell) -> bool {
        self.slot_router_expert(cell, 0).is_some()
    }

    /// Whether any cell carries a prediction at `horizon` (1-based).
    pub fn any_pred(&self, horizon: usize) -> bool {
        self.cells.iter().any(|c| self.has_pred(c, horizon))
    }

    /// The trace as a `--route-ahead n` run would have routed it, approximated from the
    /// recorded horizon-`n` predictions: in every cell that carries one, the committed routing
    /// is the prediction's ids in its rank order, each with the router's recorded weight where
    /// the router also chose that id and `nan` where it did not (the router's weight of an id
    /// outside its top-k is not in the trace); `router_expert` holds the router's choice.
    /// Cells without a prediction keep the router's routing (passed through). A slot whose id
    /// changed loses its residency facts (`residency` 0, no bytes, not dropped): they belonged
    /// to another expert. `None` when the file has no `pred<n>` column or `n` is 0.
    ///
    /// This is an approximation: in a real `--route-ahead` run the hidden states after the
    /// first committed layer differ, so later routings and predictions would differ too.
    pub fn commit_predictions(&self, n: u8) -> Option<RouteTrace> {
        let horizon = usize::from(n);
        if n == 0 || n > self.pred_columns.horizons {
            return None;
        }
        let mut out = self.clone();
        out.pred_columns.route_ahead = n;
        out.has_router_expert_column = true;
        out.router_experts = vec![None; self.slots.len()];
        for cell in &self.cells {
            if !self.has_pred(cell, horizon) {
                continue;
            }
            let router = self.cell_slots(cell);
            for slot in 0..usize::from(cell.n_slots) {
                let Some((id, _)) = self.slot_pred(cell, slot, horizon) else {
                    continue;
                };
                let index = cell.first_slot as usize + slot;
                let original = router[slot];
                let weight = router
                    .iter()
                    .find(|s| s.expert == u32::from(id))
                    .map_or(f32::NAN, |s| s.weight);
                out.slots[index] = if original.expert == u32::from(id) {
                    RouteSlot { weight, ..original }
                } else {
                    RouteSlot {
                        expert: u32::from(id),
                        weight,
                        residency: 0,
                        expert_bytes: 0,
                        dropped: false,
                    }
                };
                // The reader checked expert < n_expert <= u16::MAX.
                out.router_experts[index] = Some(original.expert as u16);
            }
        }
        Some(out)
    }

    /// Number of rows (routed slots).
    pub fn n_rows(&self) -> usize {
        self.slots.len()
    }

    /// Whether the routings carry weights (false when every weight is `nan`).
    pub fn weights_known(&self) -> bool {
        self.slots.iter().any(|s| !s.weight.is_nan())
    }

    fn check_layer_token_counts(&self) -> Result<(), ParseError> {
        let n_layers = self.preamble.layers.len();
        let last = n_layers - 1;
        let mut start = 0;
        while start < self.cells.len() {
            let head = self.cells[start];
            let end = start
                + self.cells[start..]
                    .iter()
                    .take_while(|c| c.turn == head.turn && c.phase == head.phase)
                    .count();
            let mut counts = vec![0u64; n_layers];
            let mut first_line = vec![0u32; n_layers];
            for (i, c) in self.cells[start..end].iter().enumerate() {
                let l = c.moe_layer as usize;
                if counts[l] == 0 {
                    first_line[l] = self.cell_lines[start + i];
                }
                counts[l] += 1;
            }
            let reference = counts[0];
            // A batched step's last layer routes the rows that choose a token: at most one
            // per sequence, none when every sequence is still mid-prompt.
            let seqs = if self.has_seq_column {
                let mut v: Vec<u32> = self.cells[start..end].iter().map(|c| c.seq).collect();
                v.sort_unstable();
                v.dedup();
                v.len() as u64
            } else {
                1
            };
            for (l, &count) in counts.iter().enumerate() {
                let prefill_last = head.phase == Phase::Prefill
                    && l == last
                    && n_layers > 1
                    && if self.has_seq_column {
                        count <= seqs
                    } else {
                        count == 1
                    };
                if count == reference || prefill_last {
                    continue;
                }
                let what = format!(
                    "turn {} {}: layer {} routes {} tokens but layer {} routes {}",
                    head.turn,
                    phase_name(head.phase),
                    self.preamble.layers[l].layer,
                    count,
                    self.preamble.layers[0].layer,
                    reference
                );
                return Err(if count > 0 {
                    at(first_line[l] as usize, what)
                } else {
                    whole(what)
                });
            }
            start = end;
        }
        Ok(())
    }

    fn check_not_constant(&self) -> Result<(), ParseError> {
        let p = &self.preamble;
        if p.n_expert_used >= p.n_expert || self.steps().nth(1).is_none() {
            return Ok(());
        }
        let mut first_set: Vec<Option<Vec<u32>>> = vec![None; p.layers.len()];
        let mut set = Vec::new();
        for c in &self.cells {
            set.clear();
            set.extend(self.cell_slots(c).iter().map(|s| s.expert));
            set.sort_unstable();
            match &first_set[c.moe_layer as usize] {
                None => first_set[c.moe_layer as usize] = Some(set.clone()),
                Some(first) if *first != set => return Ok(()),
                Some(_) => {}
            }
        }
        Err(whole(
            "every token routes the same experts at every layer: not a real routing capture \
             (a stuck router or a broken exporter)",
        ))
    }
}

fn parse_header(header: &str, line: usize) -> Result<Columns, ParseError> {
    let names: Vec<&str> = header.split(',').map(str::trim).collect();
    for (i, n) in names.iter().enumerate() {
        if names[..i].contains(n) {
            return Err(at(line, format!("header names column {n} twice")));
        }
    }
    let find = |name: &str| -> Result<usize, ParseError> {
        names
            .iter()
            .position(|n| *n == name)
            .ok_or_else(|| at(line, format!("header lacks the required column {name}")))
    };
    // Prediction columns: `pred<h>` and `pred<h>_weight` in pairs, horizons 1..=H without
    // gaps, H <= PRED_HORIZON_MAX. Other unknown columns are ignored, as the contract says.
    let mut horizons: Vec<usize> = Vec::new();
    for name in &names {
        let Some(rest) = name.strip_prefix("pred") else {
            continue;
        };
        let (digits, is_weight) = match rest.strip_suffix("_weight") {
            Some(d) => (d, true),
            None => (rest, false),
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let h: usize = digits.parse().unwrap_or(usize::MAX);
        if h == 0 || h > PRED_HORIZON_MAX || digits != h.to_string() {
            return Err(at(
                line,
                format!("column {name}: prediction horizons are pred1..pred{PRED_HORIZON_MAX}"),
            ));
        }
        let partner = if is_weight {
            format!("pred{h}")
        } else {
            format!("pred{h}_weight")
        };
        if !names.contains(&partner.as_str()) {
            return Err(at(
                line,
                format!("column {name} has no partner column {partner}"),
            ));
        }
        if !is_weight {
            horizons.push(h);
        }
    }
    horizons.sort_unstable();
    let mut preds = Vec::with_capacity(horizons.len());
    for (i, &h) in horizons.iter().enumerate() {
        if h != i + 1 {
            return Err(at(
                line,
                format!(
                    "column pred{h} without pred{}: prediction horizons must run 1..=H without gaps",
                    i + 1
                ),
            ));
        }
        preds.push((
            find(&format!("pred{h}"))?,
            find(&format!("pred{h}_weight"))?,
        ));
    }
    Ok(Columns {
        turn: find("turn")?,
        phase: find("phase")?,
        step: find("step")?,
        layer: find("layer")?,
        slot: find("slot")?,
        expert: find("expert")?,
        weight: find("weight")?,
        residency: find("residency")?,
        expert_bytes: find("expert_bytes")?,
        dropped: names.iter().position(|n| *n == "dropped"),
        preds,
        router_expert: names.iter().position(|n| *n == ROUTER_EXPERT_COLUMN),
        group: names.iter().position(|n| *n == GROUP_COLUMN),
        seq: names.iter().position(|n| *n == SEQ_COLUMN),
        count: names.len(),
    })
}

/// One `pred<h>` / `pred<h>_weight` field pair: both empty = not predicted.
fn parse_pred(
    id: &str,
    weight: &str,
    horizon: usize,
    n_expert: u32,
    max_weight: f32,
) -> Result<Option<(u16, f32)>, String> {
    match (id.is_empty(), weight.is_empty()) {
        (true, true) => return Ok(None),
        (false, true) => {
            return Err(format!(
                "column pred{horizon}_weight is empty but pred{horizon} is {id}"
            ))
        }
        (true, false) => {
            return Err(format!(
                "column pred{horizon} is empty but pred{horizon}_weight is {weight}"
            ))
        }
        (false, false) => {}
    }
    let expert: u32 = id
        .parse()
        .map_err(|_| format!("column pred{horizon}: '{id}' is not a valid integer"))?;
    if expert >= n_expert {
        return Err(format!(
            "column pred{horizon}: expert {expert} is not below n_expert={n_expert}"
        ));
    }
    let w = parse_weight_max(weight, max_weight)
        .map_err(|reason| format!("column pred{horizon}_weight: {reason}"))?;
    Ok(Some((expert as u16, w))) // expert < n_expert <= u16::MAX
}

#[cfg(test)]
fn parse_weight(field: &str) -> Result<f32, String> {
    parse_weight_max(field, 1.0)
}

/// A routing weight in `[0, max]` (plus float slack), or `nan`.
fn parse_weight_max(field: &str, max: f32) -> Result<f32, String> {
    if field.eq_ignore_ascii_case("nan") {
        return Ok(f32::NAN);
    }
    let w: f32 = field
        .parse()
        .map_err(|_| format!("column weight: '{field}' is not a number"))?;
    if !w.is_finite() {
        return Err(format!("weight {field} is not finite"));
    }
    if w < 0.0 {
        return Err(format!("weight {field} is negative"));
    }
    if w > max * WEIGHT_MAX {
        return Err(if max == 1.0 {
            format!("weight {field} is above 1")
        } else {
            format!("weight {field} is above the gating's scale {max}")
        });
    }
    Ok(w)
}

fn parse_proj(v: &str) -> Result<Vec<ProjExtent>, String> {
    v.split(',')
        .map(|item| {
            let mut parts = item.split(':');
            let (Some(shard), Some(offset), Some(stride), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                return Err(format!(
                    "proj extent '{item}' is not <shard>:<offset>:<stride>"
                ));
            };
            let bad = || format!("proj extent '{item}' has a non-integer field");
            Ok(ProjExtent {
                shard: shard.parse().map_err(|_| bad())?,
                offset: offset.parse().map_err(|_| bad())?,
                stride: stride.parse().map_err(|_| bad())?,
            })
        })
        .collect()
}

/// Which optional columns the file had.
struct FileColumns {
    dropped: bool,
    preds: PredColumns,
    router_expert: bool,
    group: bool,
    seq: bool,
}

fn build_cells(
    preamble: RoutePreamble,
    file: FileColumns,
    mut entries: Vec<Entry>,
) -> Result<RouteTrace, ParseError> {
    let horizons = usize::from(file.preds.horizons);
    entries.sort_unstable_by_key(|e| {
        (
            e.turn,
            e.phase,
            e.group,
            e.seq,
            e.step,
            e.moe_layer,
            e.slot,
            e.line,
        )
    });
    let k = preamble.n_expert_used as usize;
    let mut cells = Vec::with_capacity(entries.len() / k.max(1));
    let mut cell_lines = Vec::with_capacity(entries.len() / k.max(1));
    let mut slots = Vec::with_capacity(entries.len());
    let mut preds = Vec::with_capacity(entries.len() * horizons);
    let mut router_experts = Vec::new();
    let mut start = 0;
    while start < entries.len() {
        let key = entries[start].cell_key();
        let end = start
            + entries[start..]
                .iter()
                .take_while(|e| e.cell_key() == key)
                .count();
        let group = &entries[start..end];
        let first_line = group.iter().map(|e| e.line).min().unwrap_or(0) as usize;
        for pair in group.windows(2) {
            if pair[0].slot == pair[1].slot {
                return Err(at(
                    pair[1].line as usize,
                    format!(
                        "duplicate (turn {}, phase {}, {}{}step {}, layer {}, slot {}): first on line {}{}",
                        pair[1].turn,
                        pair[1].phase,
                        if file.group {
                            format!("group {}, ", pair[1].group)
                        } else {
                            String::new()
                        },
                        if file.seq {
                            format!("seq {}, ", pair[1].seq)
                        } else {
                            String::new()
                        },
                        pair[1].step,
                        preamble.layers[pair[1].moe_layer as usize].layer,
                        pair[1].slot,
                        pair[0].line,
                        if !file.group && preamble.extra.iter().any(|(k, _)| k == SPEC_KEY) {
                            " — a speculative run feeds a position again after a rejected draft, \
                             and its trace needs the group column to tell the two steps apart"
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        let describe = || {
            format!(
                "routing (turn {}, phase {}, {}step {}, layer {})",
                key.0,
                key.1,
                if file.seq {
                    format!("seq {}, ", key.3)
                } else {
                    String::new()
                },
                key.4,
                preamble.layers[key.5 as usize].layer
            )
        };
        if group.len() != k {
            return Err(at(
                first_line,
                format!("{} has {} of its {} slots", describe(), group.len(), k),
            ));
        }
        for (i, e) in group.iter().enumerate() {
            if let Some(prev) = group[..i].iter().find(|p| p.value.expert == e.value.expert) {
                return Err(at(
                    e.line as usize,
                    format!(
                        "{} routes expert {} twice (also on line {})",
                        describe(),
                        e.value.expert,
                        prev.line
                    ),
                ));
            }
        }
        check_cell_predictions(group, horizons, &describe)?;
        let committed = group.iter().any(|e| e.router_expert.is_some());
        let nan_count = group.iter().filter(|e| e.value.weight.is_nan()).count();
        // A committed route-ahead routing may know only some weights: the router's weight of
        // an expert it did not choose is not always available (`commit_predictions`).
        if nan_count != 0 && nan_count != group.len() && !committed {
            return Err(at(
                first_line,
                format!(
                    "{} mixes numeric and nan weights ({} of {} nan): a weight is either known for the whole routing or unknown",
                    describe(),
                    nan_count,
                    group.len()
                ),
            ));
        }
        let phase = phase_from_code(key.1).ok_or_else(|| at(first_line, "bad phase"))?;
        let first_slot = u32::try_from(slots.len()).map_err(|_| whole("too many rows"))?;
        cells.push(RouteCell {
            turn: key.0,
            phase,
            group: key.2,
            seq: key.3,
            step: key.4,
            moe_layer: key.5,
            first_slot,
            n_slots: k as u16, // k <= n_expert <= u16::MAX; checked at the model line
        });
        cell_lines.push(first_line as u32);
        slots.extend(group.iter().map(|e| e.value));
        for e in group {
            preds.extend_from_slice(&e.preds[..horizons]);
        }
        if file.router_expert {
            router_experts.extend(group.iter().map(|e| e.router_expert));
        }
        start = end;
    }
    Ok(RouteTrace {
        preamble,
        has_dropped_column: file.dropped,
        cells,
        slots,
        cell_lines,
        pred_columns: file.preds,
        has_router_expert_column: file.router_expert,
        has_group_column: file.group,
        has_seq_column: file.seq,
        turn_ends: Default::default(),
        preds,
        router_experts,
    })
}

/// `<turn> tokens=<n> speculating=<0|1>` (after [`TURN_END_PREFIX`]).
fn parse_turn_end(rest: &str) -> Option<(u32, TurnEnd)> {
    let mut it = rest.split_whitespace();
    let turn = it.next()?.parse().ok()?;
    let tokens = it.next()?.strip_prefix("tokens=")?.parse().ok()?;
    let speculating = match it.next()?.strip_prefix("speculating=")? {
        "0" => false,
        "1" => true,
        _ => return None,
    };
    it.next().is_none().then_some((
        turn,
        TurnEnd {
            tokens,
            speculating,
        },
    ))
}

/// Within one routing, each prediction horizon and the router's own choice are known for
/// every slot or for none (a prediction is a whole top-k), and name no expert twice.
fn check_cell_predictions(
    group: &[Entry],
    horizons: usize,
    describe: &dyn Fn() -> String,
) -> Result<(), ParseError> {
    let check = |what: &str, ids: &[(u32, Option<u16>)]| -> Result<(), ParseError> {
        let known = ids.iter().filter(|(_, id)| id.is_some()).count();
        if known != 0 && known != ids.len() {
            let line = ids
                .iter()
                .find(|(_, id)| id.is_none())
                .map_or(0, |(l, _)| *l as usize);
            return Err(at(
                line,
                format!(
                    "{} has {what} on {known} of its {} slots: it is known for the whole routing or for none",
                    describe(),
                    ids.len()
                ),
            ));
        }
        for (i, (line, id)) in ids.iter().enumerate() {
            if let Some(id) = id {
                if let Some((first, _)) = ids[..i].iter().find(|(_, other)| other == &Some(*id)) {
                    return Err(at(
                        *line as usize,
                        format!(
                            "{} has expert {id} twice in {what} (also on line {first})",
                            describe()
                        ),
                    ));
                }
            }
        }
        Ok(())
    };
    let mut ids: Vec<(u32, Option<u16>)> = Vec::with_capacity(group.len());
    for h in 0..horizons {
        ids.clear();
        ids.extend(group.iter().map(|e| (e.line, e.preds[h].map(|(id, _)| id))));
        check(&format!("pred{}", h + 1), &ids)?;
    }
    ids.clear();
    ids.extend(group.iter().map(|e| (e.line, e.router_expert)));
    check(ROUTER_EXPERT_COLUMN, &ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights() {
        assert_eq!(parse_weight("0.5"), Ok(0.5));
        assert!(parse_weight("NaN").is_ok_and(f32::is_nan));
        assert_eq!(
            parse_weight("1.00001"),
            Ok(1.00001),
            "rounding slack above 1"
        );
        assert!(parse_weight("1.01").is_err());
        assert!(parse_weight("-0.1").is_err());
        assert!(parse_weight("inf").is_err());
        assert!(parse_weight("").is_err());
    }

    #[test]
    fn written_weights_parse_back_to_the_same_bits() {
        // 1/k thresholds are where a replay decides: one ulp below and above 0.25 must survive.
        let quarter = 0.25f32;
        let ws = [
            f32::from_bits(quarter.to_bits() - 1),
            quarter,
            f32::from_bits(quarter.to_bits() + 1),
            1.0 / 3.0,
            0.695_958,
            1e-9,
            1.0,
        ];
        for w in ws {
            let text = format_weight(w);
            assert_eq!(
                parse_weight(&text).map(f32::to_bits),
                Ok(w.to_bits()),
                "{w} as {text}"
            );
        }
        assert_eq!(format_weight(0.75), "0.75");
        assert_eq!(format_weight(f32::NAN), "nan");
    }

    #[test]
    fn projection_extents() {
        assert_eq!(
            parse_proj("0:4096:128,1:0:64"),
            Ok(vec![
                ProjExtent {
                    shard: 0,
                    offset: 4096,
                    stride: 128
                },
                ProjExtent {
                    shard: 1,
                    offset: 0,
                    stride: 64
                },
            ])
        );
        assert!(parse_proj("0:4096").is_err());
        assert!(parse_proj("0:4096:128:1").is_err());
        assert!(parse_proj("0:x:128").is_err());
    }

    #[test]
    fn a_preamble_key_given_twice_is_refused() {
        // Found by the route_trace fuzz target: a mutated `# layer=` line became extra keys,
        // one of them `arch=` again, and the trace could not be written back as read.
        let body = "# layer=0 expert_bytes=8 dense_bytes=4\nturn,phase,step,layer,slot,expert,weight,residency,expert_bytes\n0,1,0,0,0,1,1.0,0,8\n0,1,1,0,0,2,1.0,0,8\n";
        let model = "# route_trace v1\n# model=m arch=a n_layer=1 n_expert=4 n_expert_used=1";
        RouteTrace::parse(&format!("{model}\n{body}")).expect("the plain trace parses");
        for (extra, line) in [
            (" arch=b", 2),
            (" ctx=1 ctx=2", 2),
            ("\n# foo=1 arch=b", 3),
            (" ctx=1\n# ctx=2", 2),
        ] {
            let e = RouteTrace::parse(&format!("{model}{extra}\n{body}")).expect_err(extra);
            assert!(e.to_string().contains("appears twice"), "{extra}: {e}");
            assert_eq!(e.line(), Some(line), "{extra}: {e}");
        }
    }

    #[test]
    fn a_turn_end_line_is_read_and_a_malformed_one_refused() {
        let head = "# route_trace v1\n# model=m arch=a n_layer=1 n_expert=4 n_expert_used=1\n# layer=0 expert_bytes=8 dense_bytes=4\nturn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped,group\n0,1,0,0,0,1,1.0,0,8,0,0\n0,1,1,0,0,2,1.0,0,8,0,0\n";
        let t =
            RouteTrace::parse(&format!("{head}# turn=0 tokens=1 speculating=1\n")).expect("parses");
        assert_eq!(
            t.turn_end(0),
            Some(TurnEnd {
                tokens: 1,
                speculating: true
            })
        );
        assert_eq!(t.turn_end(1), None);
        for bad in [
            "# turn=0 tokens=1",
            "# turn=x tokens=1 speculating=0",
            "# turn=0 tokens=1 speculating=2",
            "# turn=0 tokens=1 speculating=0 more",
            "# turn=0 tokens=1 speculating=0\n# turn=0 tokens=2 speculating=0",
        ] {
            let e = RouteTrace::parse(&format!("{head}{bad}\n")).expect_err(bad);
            assert_eq!(e.line(), Some(7 + bad.matches('\n').count()), "{bad}: {e}");
        }
    }

    #[test]
    fn a_batched_trace_keys_its_tokens_by_sequence() {
        let p = RoutePreamble {
            model: "m".into(),
            arch: "a".into(),
            n_layer: 2,
            n_expert: 4,
            n_expert_used: 1,
            gating: crate::gating::Gating::default(),
            layers: (0..2)
                .map(|layer| TraceLayer {
                    layer,
                    expert_bytes: 8,
                    dense_bytes: 4,
                    proj: vec![],
                })
                .collect(),
            notes: vec![],
            extra: vec![],
        };
        let steps = StepColumns {
            group: true,
            seq: true,
        };
        let mut w =
            RouteTraceWriter::with_columns(Vec::new(), &p, PredColumns::NONE, steps).expect("vec");
        let rec =
            |turn: u32, phase: Phase, row: u32, step: i64, layer: u32, expert: u32| RouteRecord {
                turn,
                phase,
                step,
                row,
                layer,
                slot: 0,
                expert,
                weight: 1.0,
                residency: 0,
                expert_bytes: 8,
                dropped: false,
                preds: Default::default(),
                router_expert: None,
            };
        // Step 0: sequence 2 feeds a prompt of two tokens at 0..2 mid-way (no row chooses, so
        // the last layer routes none); step 1: sequences 0 and 2 each decode one token at
        // position 2 — the same position, told apart by the column.
        w.begin_step(0, Phase::Prefill);
        w.step_rows(&[2, 2]);
        w.route(&rec(0, Phase::Prefill, 0, 0, 0, 1));
        w.route(&rec(0, Phase::Prefill, 1, 1, 0, 2));
        w.begin_step(1, Phase::Decode);
        w.step_rows(&[0, 2]);
        for layer in 0..2 {
            w.route(&rec(1, Phase::Decode, 0, 2, layer, 3));
            w.route(&rec(1, Phase::Decode, 1, 2, layer, 0));
        }
        let text = String::from_utf8(w.finish().expect("written")).expect("utf8");
        assert!(text.contains("dropped,group,seq\n"), "{text}");
        let t = RouteTrace::parse(&text).expect("parses");
        assert!(t.has_seq_column() && t.has_group_column());
        let keys: Vec<(u32, u32, i64, u16)> = t
            .cells
            .iter()
            .map(|c| (c.turn, c.seq, c.step, c.moe_layer))
            .collect();
        assert_eq!(
            keys,
            [
                (0, 2, 0, 0),
                (0, 2, 1, 0),
                (1, 0, 2, 0),
                (1, 0, 2, 1),
                (1, 2, 2, 0),
                (1, 2, 2, 1)
            ]
        );
        // Without the column the two tokens at position 2 are one routing twice.
        let plain = text
            .replace(",group,seq\n", ",group\n")
            .lines()
            .map(|l| match l.rsplit_once(',') {
                Some((head, _)) if !l.starts_with('#') && !l.starts_with("turn") => {
                    head.to_string()
                }
                _ => l.to_string(),
            })
            .map(|l| l + "\n")
            .collect::<String>();
        let e = RouteTrace::parse(&plain).expect_err("duplicate");
        assert!(e.to_string().contains("duplicate"), "{e}");
        // A record of a row the step did not name is refused, not written under a guess.
        let mut w =
            RouteTraceWriter::with_columns(Vec::new(), &p, PredColumns::NONE, steps).expect("vec");
        w.step_rows(&[0]);
        assert!(w.write(&rec(0, Phase::Decode, 1, 0, 0, 1)).is_err());
    }

    #[test]
    fn writer_refuses_undeclared_layers() {
        let p = RoutePreamble {
            model: "m".into(),
            arch: "a".into(),
            n_layer: 2,
            n_expert: 4,
            n_expert_used: 1,
            gating: crate::gating::Gating::default(),
            layers: vec![TraceLayer {
                layer: 1,
                expert_bytes: 8,
                dense_bytes: 4,
                proj: vec![],
            }],
            notes: vec![],
            extra: vec![],
        };
        let mut w = RouteTraceWriter::new(Vec::new(), &p).expect("vec");
        let r = RouteRecord {
            turn: 0,
            phase: Phase::Decode,
            step: 0,
            layer: 1,
            slot: 0,
            expert: 0,
            weight: 1.0,
            residency: 0,
            expert_bytes: 8,
            dropped: false,
            preds: Default::default(),
            row: 0,
            router_expert: None,
        };
        assert!(w.write(&r).is_err(), "MoE layer 1 is not declared");
        w.route(&r);
        assert!(!w.wants_routes(), "the sink stops after its first error");
        assert!(w.finish().is_err(), "and reports it");
    }

    fn pred_preamble() -> RoutePreamble {
        RoutePreamble {
            model: "m".into(),
            arch: "a".into(),
            n_layer: 3,
            n_expert: 8,
            n_expert_used: 2,
            gating: crate::gating::Gating::default(),
            layers: (0..3)
                .map(|layer| TraceLayer {
                    layer,
                    expert_bytes: 8,
                    dense_bytes: 4,
                    proj: vec![],
                })
                .collect(),
            notes: vec![],
            extra: vec![("ctx".into(), "64".into())],
        }
    }

    /// Three decode steps x three layers x two slots; predictions where the engine makes
    /// them (layer >= h, not the first decode token), weights exact at 6 decimals.
    fn pred_records(columns: PredColumns) -> Vec<RouteRecord> {
        let mut out = Vec::new();
        for step in 10..13i64 {
            for layer in 0..3u32 {
                let base = (step as u32 * 3 + layer) % 8;
                let experts = [base, (base + 1 + layer) % 8];
                for slot in 0..2u32 {
                    let mut preds = [None; PRED_HORIZON_MAX];
                    for h in 1..=usize::from(columns.horizons) {
                        if layer as usize >= h && step > 10 {
                            let p0 = ((experts[0] + h as u32) % 8) as u16;
                            let p1 = ((experts[1] + 3 + h as u32) % 8) as u16;
                            let ids = if p0 == p1 {
                                [p0, (p1 + 1) % 8]
                            } else {
                                [p0, p1]
                            };
                            let w = [0.625, 0.375];
                            preds[h - 1] = Some((ids[slot as usize], w[slot as usize]));
                        }
                    }
                    let committed = columns.route_ahead > 0
                        && layer >= u32::from(columns.route_ahead)
                        && step > 10;
                    out.push(RouteRecord {
                        turn: 0,
                        phase: Phase::Decode,
                        step,
                        layer,
                        slot,
                        expert: experts[slot as usize],
                        weight: if slot == 0 { 0.75 } else { 0.25 },
                        residency: 1,
                        expert_bytes: 0,
                        dropped: false,
                        preds,
                        row: 0,
                        router_expert: committed.then_some((experts[slot as usize] + 4) % 8),
                    });
                }
            }
        }
        out
    }

    fn write_trace(columns: PredColumns, records: &[RouteRecord]) -> String {
        let mut w =
            RouteTraceWriter::with_predictions(Vec::new(), &pred_preamble(), columns).expect("vec");
        for r in records {
            w.write(r).expect("declared columns");
        }
        String::from_utf8(w.finish().expect("vec")).expect("utf8")
    }

    #[test]
    fn prediction_columns_round_trip() {
        for columns in [
            PredColumns::NONE,
            PredColumns {
                horizons: 2,
                route_ahead: 0,
            },
            PredColumns {
                horizons: 2,
                route_ahead: 2,
            },
            PredColumns {
                horizons: 0,
                route_ahead: 1,
            },
        ] {
            let records = pred_records(columns);
            let text = write_trace(columns, &records);
            let header = text
                .lines()
                .find(|l| l.starts_with("turn,"))
                .expect("header");
            let mut expected = ROUTE_COLUMNS.join(",");
            for name in columns.column_names() {
                expected = format!("{expected},{name}");
            }
            assert_eq!(header, expected);
            let trace = RouteTrace::parse(&text).unwrap_or_else(|e| panic!("{columns:?}: {e}"));
            assert_eq!(trace.pred_columns(), columns);
            assert_eq!(trace.has_router_expert_column(), columns.route_ahead > 0);
            assert_eq!(trace.preamble.extra, vec![("ctx".into(), "64".into())]);
            let back: Vec<RouteRecord> = trace.records().collect();
            assert_eq!(back, records, "{columns:?}");
            // Writing what was read reproduces the bytes.
            assert_eq!(write_trace(trace.pred_columns(), &back), text);
        }
    }

    #[test]
    fn columns_follow_the_run_flags() {
        use crate::config::RunConfig;
        let cfg = |predict_log, predict_prefetch, route_ahead| RunConfig {
            predict_log,
            predict_prefetch,
            route_ahead,
            ..RunConfig::default()
        };
        assert_eq!(
            PredColumns::for_config(&cfg(false, false, 0)),
            PredColumns::NONE
        );
        let stale = PredColumns {
            horizons: 2,
            route_ahead: 0,
        };
        assert_eq!(PredColumns::for_config(&cfg(true, false, 0)), stale);
        assert_eq!(PredColumns::for_config(&cfg(false, true, 0)), stale);
        assert_eq!(
            PredColumns::for_config(&cfg(false, false, 3)),
            PredColumns {
                horizons: 3,
                route_ahead: 3
            }
        );
        assert_eq!(
            PredColumns::for_config(&cfg(false, false, 1)),
            PredColumns {
                horizons: 1,
                route_ahead: 1
            }
        );
    }

    #[test]
    fn no_prediction_columns_write_exactly_as_before() {
        let records = pred_records(PredColumns::NONE);
        let mut w = RouteTraceWriter::new(Vec::new(), &pred_preamble()).expect("vec");
        for r in &records {
            w.write(r).expect("row");
        }
        let text = String::from_utf8(w.finish().expect("vec")).expect("utf8");
        assert!(text.contains(
            "\nturn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped\n"
        ));
        assert!(text.contains("\n1,1,10,0,0,6,0.75,1,0,0\n") || text.contains(",0.75,1,0,0\n"));
        assert!(!text.contains("route_ahead"));
        let t = RouteTrace::parse(&text).expect("parses");
        assert_eq!(t.pred_columns(), PredColumns::NONE);
        assert!(!t.any_pred(1));
        let c = t.cells[3];
        assert_eq!(t.slot_pred(&c, 0, 1), None);
        assert_eq!(t.slot_router_expert(&c, 0), None);
    }

    #[test]
    fn writer_refuses_predictions_it_did_not_declare() {
        let mut records = pred_records(PredColumns {
            horizons: 2,
            route_ahead: 1,
        });
        let one = PredColumns {
            horizons: 1,
            route_ahead: 0,
        };
        let mut w =
            RouteTraceWriter::with_predictions(Vec::new(), &pred_preamble(), one).expect("vec");
        let horizon2 = records
            .iter()
            .find(|r| r.preds[1].is_some())
            .expect("a horizon-2 prediction")
            .clone();
        let e = w
            .write(&horizon2)
            .expect_err("horizon 2 beyond the declared 1");
        assert!(e.to_string().contains("horizon-2"), "{e}");
        let committed = records
            .iter()
            .find(|r| r.router_expert.is_some())
            .expect("a committed slot")
            .clone();
        let committed = RouteRecord {
            preds: [None; PRED_HORIZON_MAX],
            ..committed
        };
        let e = w.write(&committed).expect_err("no router_expert column");
        assert!(e.to_string().contains("router_expert"), "{e}");
        records[0].preds[0] = Some((8, 0.5));
        let e = w.write(&records[0]).expect_err("expert 8 of 8");
        assert!(e.to_string().contains("not below n_expert"), "{e}");
        assert!(RouteTraceWriter::with_predictions(
            Vec::new(),
            &pred_preamble(),
            PredColumns {
                horizons: PRED_HORIZON_MAX as u8 + 1,
                route_ahead: 0
            }
        )
        .is_err());
    }

    /// Replace `from` by `to` in the text and expect a parse error naming `needle` (and the
    /// line when `line` is set).
    fn expect_reject(text: &str, from: &str, to: &str, needle: &str, line: Option<usize>) {
        assert!(text.contains(from), "fixture lacks {from:?}");
        let bad = text.replacen(from, to, 1);
        let e = RouteTrace::parse(&bad).expect_err(needle);
        let msg = e.to_string();
        assert!(msg.contains(needle), "{needle:?} not in {msg}");
        if let Some(l) = line {
            assert_eq!(e.line(), Some(l), "{msg}");
        }
    }

    #[test]
    fn reader_rejects_malformed_prediction_columns() {
        let columns = PredColumns {
            horizons: 2,
            route_ahead: 1,
        };
        let text = write_trace(columns, &pred_records(columns));
        let header = text
            .lines()
            .find(|l| l.starts_with("turn,"))
            .expect("header")
            .to_string();
        let header_line = text.lines().position(|l| l == header).expect("line") + 1;
        // Column-level faults name the header line and the column.
        expect_reject(
            &text,
            ",pred2_weight,",
            ",pred2_w,",
            "pred2 has no partner column pred2_weight",
            Some(header_line),
        );
        expect_reject(
            &text,
            ",pred1,pred1_weight,",
            ",pred3,pred3_weight,",
            "without pred1: prediction horizons must run 1..=H without gaps",
            Some(header_line),
        );
        expect_reject(
            &text,
            ",pred1,",
            ",pred01,",
            "column pred01",
            Some(header_line),
        );
        expect_reject(
            &text,
            ",pred1,pred1_weight,",
            ",pred9,pred9_weight,",
            "pred1..pred8",
            Some(header_line),
        );
        // Field-level faults name the row's line and the column. Rows of step 11, layer 2
        // carry both horizons and the router's choice; find the first one.
        let row = text
            .lines()
            .position(|l| l.starts_with("0,1,11,2,0,"))
            .expect("row")
            + 1;
        let line = text.lines().nth(row - 1).expect("row").to_string();
        let fields: Vec<&str> = line.split(',').collect();
        let with = |i: usize, v: &str| {
            let mut f = fields.clone();
            f[i] = v;
            f.join(",")
        };
        // Layout: 10 base columns, pred1 (10), pred1_weight (11), pred2 (12), pred2_weight
        // (13), router_expert (14).
        expect_reject(
            &text,
            &line,
            &with(11, ""),
            "pred1_weight is empty",
            Some(row),
        );
        expect_reject(&text, &line, &with(12, ""), "pred2 is empty", Some(row));
        expect_reject(
            &text,
            &line,
            &with(10, "8"),
            "column pred1: expert 8 is not below n_expert=8",
            Some(row),
        );
        expect_reject(&text, &line, &with(10, "x"), "column pred1: 'x'", Some(row));
        expect_reject(
            &text,
            &line,
            &with(13, "1.5"),
            "column pred2_weight: weight 1.5 is above 1",
            Some(row),
        );
        expect_reject(
            &text,
            &line,
            &with(14, "9"),
            "column router_expert: expert 9",
            Some(row),
        );
        // Cell-level faults: a prediction or router choice on only some slots, or twice.
        let both_empty = {
            let mut f = fields.clone();
            f[10] = "";
            f[11] = "";
            f.join(",")
        };
        expect_reject(
            &text,
            &line,
            &both_empty,
            "pred1 on 1 of its 2 slots",
            Some(row),
        );
        expect_reject(
            &text,
            &line,
            &with(14, ""),
            "router_expert on 1 of its 2 slots",
            Some(row),
        );
        let next = text.lines().nth(row).expect("slot 1").to_string();
        let dup: Vec<&str> = next.split(',').collect();
        let mut dup_fields = dup.clone();
        dup_fields[10] = fields[10];
        expect_reject(
            &text,
            &next,
            &dup_fields.join(","),
            "twice in pred1",
            Some(row + 1),
        );
        // NaN prediction weights are "unknown", not an error.
        RouteTrace::parse(&text.replacen(&line, &with(11, "nan"), 1)).expect("nan weight");
        // route_ahead must be a depth.
        expect_reject(
            &text,
            "route_ahead=1",
            "route_ahead=9",
            "route_ahead=9 is not in [1, 8]",
            Some(2),
        );
    }

    #[test]
    fn committing_predictions_rewrites_the_routing() {
        let columns = PredColumns {
            horizons: 2,
            route_ahead: 0,
        };
        let trace =
            RouteTrace::parse(&write_trace(columns, &pred_records(columns))).expect("parses");
        assert!(trace.commit_predictions(0).is_none());
        assert!(trace.commit_predictions(3).is_none(), "no pred3 column");
        let committed = trace.commit_predictions(2).expect("pred2");
        assert_eq!(committed.pred_columns().route_ahead, 2);
        assert!(committed.has_router_expert_column());
        let mut n_committed = 0;
        for (cell, orig) in committed.cells.iter().zip(&trace.cells) {
            let router: Vec<u32> = trace.cell_slots(orig).iter().map(|s| s.expert).collect();
            let slots = committed.cell_slots(cell);
            if !trace.has_pred(orig, 2) {
                assert!(!committed.is_committed(cell));
                assert_eq!(slots, trace.cell_slots(orig), "passed through");
                continue;
            }
            n_committed += 1;
            assert!(committed.is_committed(cell));
            for (slot, s) in slots.iter().enumerate() {
                let (id, _) = trace.slot_pred(orig, slot, 2).expect("predicted");
                assert_eq!(s.expert, u32::from(id));
                assert_eq!(committed.slot_router_expert(cell, slot), Some(router[slot]));
                match router.iter().position(|&r| r == s.expert) {
                    Some(i) => assert_eq!(s.weight, trace.cell_slots(orig)[i].weight),
                    None => assert!(s.weight.is_nan(), "router did not choose {}", s.expert),
                }
            }
        }
        // Steps 11 and 12 at layer 2.
        assert_eq!(n_committed, 2);
        // The committed trace is a trace: writing and reading it gives it back.
        let records: Vec<RouteRecord> = committed.records().collect();
        let text = write_trace(committed.pred_columns(), &records);
        let back = RouteTrace::parse(&text).expect("committed trace parses");
        // (Debug strings: the committed routing carries nan weights, and nan != nan.)
        assert_eq!(
            format!("{:?}", back.records().collect::<Vec<_>>()),
            format!("{records:?}")
        );
    }

    #[test]
    fn gating_is_recorded_and_an_old_trace_reads_as_qwen3moes() {
        use crate::gating::Gating;
        let text = write_trace(PredColumns::NONE, &pred_records(PredColumns::NONE));
        assert!(
            text.contains(" n_expert_used=2 gating=softmax_topk_norm"),
            "{text}"
        );
        // Written before gating was recorded: qwen3moe's.
        let old = text.replace(" gating=softmax_topk_norm", "");
        assert!(!old.contains("gating"));
        assert_eq!(
            RouteTrace::parse(&old).expect("old trace").preamble.gating,
            Gating::SOFTMAX_RENORM
        );
        // gpt-oss's round-trips; a scaled gating admits weights up to its scale.
        let gpt = text.replace("gating=softmax_topk_norm", "gating=topk_softmax");
        let t = RouteTrace::parse(&gpt).expect("gpt-oss trace");
        assert_eq!(t.preamble.gating, Gating::TOPK_SOFTMAX);
        let mut out = Vec::new();
        RouteTraceWriter::new(&mut out, &t.preamble).expect("vec");
        assert!(String::from_utf8(out)
            .unwrap()
            .contains(" gating=topk_softmax"));
        let heavy = |g: &str| {
            text.replace("gating=softmax_topk_norm", g)
                .replacen(",0.75,", ",2.000000,", 1)
        };
        assert!(RouteTrace::parse(&heavy("gating=softmax_topk_norm*2.5")).is_ok());
        let e = RouteTrace::parse(&heavy("gating=softmax_topk_norm")).expect_err("above 1");
        assert!(e.to_string().contains("above 1"), "{e}");
        // A gating this build does not know is refused, naming the line.
        let e = RouteTrace::parse(&text.replace("gating=softmax_topk_norm", "gating=argmax"))
            .expect_err("unknown gating");
        assert!(e.to_string().contains("gating 'argmax'"), "{e}");
    }

    #[test]
    fn cell_prediction_in_rank_order() {
        let columns = PredColumns {
            horizons: 1,
            route_ahead: 0,
        };
        let trace =
            RouteTrace::parse(&write_trace(columns, &pred_records(columns))).expect("parses");
        let mut p = Prediction::default();
        let first = trace.cells[0];
        assert!(
            !trace.cell_pred(&first, 1, &mut p),
            "first token: nothing predicted"
        );
        assert!(p.ids.is_empty());
        let cell = *trace
            .cells
            .iter()
            .find(|c| trace.has_pred(c, 1))
            .expect("a prediction");
        assert!(trace.cell_pred(&cell, 1, &mut p));
        assert_eq!(p.weights, vec![0.625, 0.375]);
        assert_eq!(
            p.ids,
            vec![
                trace.slot_pred(&cell, 0, 1).expect("slot 0").0,
                trace.slot_pred(&cell, 1, 1).expect("slot 1").0
            ]
        );
        assert!(!trace.cell_pred(&cell, 2, &mut p), "no pred2 column");
    }

    mod round_trip {
        use super::*;
        use proptest::prelude::*;

        /// Weights exact at 6 decimals (multiples of 1/64), or nan.
        fn weight(code: u8) -> f32 {
            if code == 64 {
                f32::NAN
            } else {
                f32::from(code) / 64.0
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]

            /// Any records within the declared columns come back from writer → reader →
            /// `records()` unchanged, and re-writing them reproduces the bytes.
            #[test]
            fn writer_then_reader_is_identity(
                horizons in 0u8..=3,
                route_ahead in 0u8..=2,
                steps in 2usize..6,
                seed in any::<u64>(),
            ) {
                let columns = PredColumns { horizons, route_ahead };
                let k = 2usize;
                let mut records = Vec::new();
                let mut x = seed;
                let mut next = |m: u64| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (x >> 33) % m
                };
                for step in 0..steps as i64 {
                    for layer in 0..3u32 {
                        let first = (step as u32 + layer) % 8;
                        let experts = [first, (first + 1 + next(6) as u32) % 8];
                        let pred_sets: Vec<Option<[u16; 2]>> = (0..horizons)
                            .map(|_| {
                                (next(3) > 0).then(|| {
                                    let a = next(8) as u16;
                                    [a, (a + 1 + next(7) as u16) % 8]
                                })
                            })
                            .collect();
                        let committed = route_ahead > 0 && next(2) == 1;
                        let router = [(first + 3) % 8, (first + 5) % 8];
                        let nan_cell = next(5) == 0;
                        for slot in 0..k {
                            let mut preds = [None; PRED_HORIZON_MAX];
                            for (h, set) in pred_sets.iter().enumerate() {
                                if let Some(ids) = set {
                                    preds[h] = Some((ids[slot], weight(next(65) as u8)));
                                }
                            }
                            records.push(RouteRecord {
                                turn: 0,
                                phase: Phase::Decode,
                                step,
                                layer,
                                slot: slot as u32,
                                expert: experts[slot],
                                weight: if nan_cell { f32::NAN } else { weight(next(64) as u8) },
                                residency: 1,
                                expert_bytes: 0,
                                dropped: false,
                                preds,
                                row: 0,
                                router_expert: committed.then_some(router[slot]),
                            });
                        }
                    }
                }
                let text = write_trace(columns, &records);
                let trace = RouteTrace::parse(&text).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(trace.pred_columns(), columns);
                let back: Vec<RouteRecord> = trace.records().collect();
                prop_assert_eq!(format!("{back:?}"), format!("{records:?}"));
                prop_assert_eq!(write_trace(columns, &back), text);
            }
        }
    }
}
