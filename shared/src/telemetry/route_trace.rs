//! The `route_trace v1` file: which experts each MoE layer routed for each token, how strongly,
//! and whether they were resident — written by the engine, replayed by the simulator.
//!
//! The writer follows the contract's layout and appends bmoe's projection extents to each
//! `# layer=` line (`proj=<shard>:<offset>:<stride>,...`) so a replay reproduces the engine's
//! aligned read bytes. The reader is defensive because traces also come from other systems
//! (`../shared/traces`): it reads columns by name, ignores unknown ones, and rejects — naming
//! the line — anything a replay could silently get wrong.

use std::io::{self, Write};

use super::fmt::{kv_token, parse_key_values};
use super::ParseError;
use crate::records::{Phase, RecordSink, RouteRecord};

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

/// The `#` preamble: the run's static facts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutePreamble {
    pub model: String,
    pub arch: String,
    pub n_layer: u32,
    pub n_expert: u32,
    /// Effective routing width: every routing has exactly this many slots.
    pub n_expert_used: u32,
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
pub struct RouteTraceWriter<W: Write> {
    w: W,
    layer_ids: Vec<u32>,
    error: Option<io::Error>,
}

impl<W: Write> RouteTraceWriter<W> {
    /// Writes the preamble and the header row.
    pub fn new(mut w: W, p: &RoutePreamble) -> io::Result<Self> {
        writeln!(w, "{ROUTE_MAGIC}")?;
        write!(
            w,
            "# model={} arch={} n_layer={} n_expert={} n_expert_used={}",
            kv_token(&p.model),
            kv_token(&p.arch),
            p.n_layer,
            p.n_expert,
            p.n_expert_used
        )?;
        for (k, v) in &p.extra {
            write!(w, " {}={}", kv_token(k), kv_token(v))?;
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
        writeln!(w, "{}", ROUTE_COLUMNS.join(","))?;
        Ok(RouteTraceWriter {
            w,
            layer_ids: p.layers.iter().map(|l| l.layer).collect(),
            error: None,
        })
    }

    /// Writes one row. `r.layer` is the MoE layer index; the row carries that layer's id from
    /// the preamble. A record for a layer the preamble does not declare is an error.
    pub fn write(&mut self, r: &RouteRecord) -> io::Result<()> {
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
        let weight = if r.weight.is_nan() {
            "nan".to_string()
        } else {
            super::fmt::fixed(f64::from(r.weight), 6)
        };
        writeln!(
            self.w,
            "{},{},{},{},{},{},{},{},{},{}",
            r.turn,
            phase_code(r.phase),
            r.step,
            id,
            r.slot,
            r.expert,
            weight,
            r.residency,
            r.expert_bytes,
            u8::from(r.dropped)
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
    fn route(&mut self, r: &RouteRecord) {
        if self.error.is_none() {
            if let Err(e) = self.write(r) {
                self.error = Some(e);
            }
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
}

struct Entry {
    turn: u32,
    phase: u8,
    step: i64,
    moe_layer: u16,
    slot: u16,
    line: u32,
    value: RouteSlot,
}

impl Entry {
    fn cell_key(&self) -> (u32, u8, i64, u16) {
        (self.turn, self.phase, self.step, self.moe_layer)
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
                _ => extra.extend(pairs),
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
            }
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
        let mut fields: Vec<&str> = Vec::with_capacity(columns.count);
        for (n, l) in lines {
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
            let weight = parse_weight(fields[columns.weight]).map_err(|reason| at(n, reason))?;
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
            entries.push(Entry {
                turn,
                phase: phase_raw,
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
            });
        }

        let preamble = RoutePreamble {
            model,
            arch,
            n_layer,
            n_expert,
            n_expert_used,
            layers,
            notes,
            extra,
        };
        let trace = build_cells(preamble, columns.dropped.is_some(), entries)?;
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
                    c.turn == first.turn && c.phase == first.phase && c.step == first.step
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

    /// Every row as a `RouteRecord` (with `layer` the MoE layer index), in cell order.
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
                    preds: Default::default(),
                    router_expert: None,
                })
        })
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
            for (l, &count) in counts.iter().enumerate() {
                let prefill_last =
                    head.phase == Phase::Prefill && l == last && count == 1 && n_layers > 1;
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
        count: names.len(),
    })
}

fn parse_weight(field: &str) -> Result<f32, String> {
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
    if w > WEIGHT_MAX {
        return Err(format!("weight {field} is above 1"));
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

fn build_cells(
    preamble: RoutePreamble,
    has_dropped_column: bool,
    mut entries: Vec<Entry>,
) -> Result<RouteTrace, ParseError> {
    entries.sort_unstable_by_key(|e| (e.turn, e.phase, e.step, e.moe_layer, e.slot, e.line));
    let k = preamble.n_expert_used as usize;
    let mut cells = Vec::with_capacity(entries.len() / k.max(1));
    let mut cell_lines = Vec::with_capacity(entries.len() / k.max(1));
    let mut slots = Vec::with_capacity(entries.len());
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
                        "duplicate (turn {}, phase {}, step {}, layer {}, slot {}): first on line {}",
                        pair[1].turn,
                        pair[1].phase,
                        pair[1].step,
                        preamble.layers[pair[1].moe_layer as usize].layer,
                        pair[1].slot,
                        pair[0].line
                    ),
                ));
            }
        }
        let describe = || {
            format!(
                "routing (turn {}, phase {}, step {}, layer {})",
                key.0, key.1, key.2, preamble.layers[key.3 as usize].layer
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
        let nan_count = group.iter().filter(|e| e.value.weight.is_nan()).count();
        if nan_count != 0 && nan_count != group.len() {
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
            step: key.2,
            moe_layer: key.3,
            first_slot,
            n_slots: k as u16, // k <= n_expert <= u16::MAX; checked at the model line
        });
        cell_lines.push(first_line as u32);
        slots.extend(group.iter().map(|e| e.value));
        start = end;
    }
    Ok(RouteTrace {
        preamble,
        has_dropped_column,
        cells,
        slots,
        cell_lines,
    })
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
    fn writer_refuses_undeclared_layers() {
        let p = RoutePreamble {
            model: "m".into(),
            arch: "a".into(),
            n_layer: 2,
            n_expert: 4,
            n_expert_used: 1,
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
            router_expert: None,
        };
        assert!(w.write(&r).is_err(), "MoE layer 1 is not declared");
        w.route(&r);
        assert!(!w.wants_routes(), "the sink stops after its first error");
        assert!(w.finish().is_err(), "and reports it");
    }
}
