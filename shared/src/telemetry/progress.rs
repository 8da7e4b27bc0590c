//! The `BMOE_*` line protocol: per-token `BMOE_LOAD` / `BMOE_PROGRESS` lines and the session
//! control lines `BMOE_READY`, `BMOE_BEGIN`, `BMOE_DONE`, `BMOE_DECIDE`, `BMOE_ERROR`.
//!
//! Apps parse these lines, so both emitters (one-shot `--progress` and `--session`) go through
//! these functions and produce byte-identical lines. Keys are written in the contract's order;
//! numbers use a fixed precision per key; strings are JSON-escaped.

use std::io::{self, Write};

use super::csv::TokenRecord;
use super::fmt::{json_fixed, json_str, mib};
use super::summary::RunSummary;

/// The newly generated text since the previous `BMOE_PROGRESS` line. With `reset` the fields
/// are full snapshots that replace what the reader accumulated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextDelta<'a> {
    pub reset: bool,
    pub reasoning: &'a str,
    pub text: &'a str,
}

/// Turns the chat parser's cumulative (reasoning, answer) snapshots into per-line deltas. When
/// a snapshot does not extend the previous one (the parser reclassified text, e.g. a closing
/// think tag turned answer into reasoning) the delta is the whole snapshot with `reset`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeltaTracker {
    reasoning: String,
    text: String,
}

impl DeltaTracker {
    /// A tracker at the empty state (the start of a generation).
    pub fn new() -> Self {
        Self::default()
    }

    /// The delta from the previous snapshot to this one, and remembers this one.
    pub fn advance<'a>(&mut self, reasoning: &'a str, text: &'a str) -> TextDelta<'a> {
        let extends =
            reasoning.starts_with(self.reasoning.as_str()) && text.starts_with(self.text.as_str());
        let delta = if extends {
            TextDelta {
                reset: false,
                reasoning: &reasoning[self.reasoning.len()..],
                text: &text[self.text.len()..],
            }
        } else {
            TextDelta {
                reset: true,
                reasoning,
                text,
            }
        };
        if extends {
            self.reasoning.push_str(delta.reasoning);
            self.text.push_str(delta.text);
        } else {
            self.reasoning = reasoning.to_string();
            self.text = text.to_string();
        }
        delta
    }

    /// The accumulated reasoning snapshot.
    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }

    /// The accumulated answer snapshot.
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// Writes `BMOE_LOAD {"mb":..,"ms":..}`: flash MiB read this token and the read time.
pub fn write_load(w: &mut dyn Write, read_bytes: u64, io_ms: f64) -> io::Result<()> {
    writeln!(
        w,
        "BMOE_LOAD {{\"mb\":{},\"ms\":{}}}",
        json_fixed(mib(read_bytes), 2),
        json_fixed(io_ms, 1)
    )
}

/// Writes one token's lines: `BMOE_LOAD` when experts were read this token
/// (`read_bytes > 0`), then `BMOE_PROGRESS` with every key in the contract's order.
pub fn write_token_lines(
    w: &mut dyn Write,
    r: &TokenRecord,
    delta: &TextDelta<'_>,
) -> io::Result<()> {
    if r.read_bytes > 0 {
        write_load(w, r.read_bytes, r.io_ms)?;
    }
    writeln!(
        w,
        "BMOE_PROGRESS {{\"step\":{},\"steps\":{},\"wall_ms\":{},\"io_ms\":{},\"compute_ms\":{},\"mgmt_ms\":{},\
         \"stall_ms\":{},\"read_mb\":{},\"cache_hit_pct\":{},\"majflt\":{},\"cpu_ms\":{},\
         \"dense_resident_frac\":{},{}\"delta_reasoning\":{},\"delta_text\":{}}}",
        r.step,
        r.steps,
        json_fixed(r.wall_ms, 1),
        json_fixed(r.io_ms, 1),
        json_fixed(r.compute_ms, 1),
        json_fixed(r.mgmt_ms, 1),
        json_fixed(r.stall_ms, 1),
        json_fixed(mib(r.read_bytes), 2),
        json_fixed(r.cache_hit_pct, 1),
        r.majflt,
        json_fixed(r.cpu_ms, 1),
        json_fixed(r.dense_resident_frac, 3),
        if delta.reset { "\"reset\":1," } else { "" },
        json_str(delta.reasoning),
        json_str(delta.text)
    )
}

/// How a `"think":false` request can be honoured on the loaded model (`BMOE_READY.think_ctl`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ThinkControl {
    /// Passing the flag is all there is to do (the template reads it, or nothing to suppress).
    Template,
    /// Reasoning is a structural section the turn can start past.
    Prefill,
    /// The model reasons on every turn and cannot be asked not to.
    None,
}

impl ThinkControl {
    /// The protocol spelling.
    pub fn name(self) -> &'static str {
        match self {
            ThinkControl::Template => "template",
            ThinkControl::Prefill => "prefill",
            ThinkControl::None => "none",
        }
    }
}

/// The facts `BMOE_READY` announces once the model is loaded.
#[derive(Clone, Debug, PartialEq)]
pub struct Ready<'a> {
    pub load_s: f64,
    pub arch: &'a str,
    pub n_ctx: u32,
    pub think_ctl: ThinkControl,
    /// Effective routing width after any override, 0 on a dense model.
    pub n_expert_used: u32,
}

/// Writes `BMOE_READY {...}`.
pub fn write_ready(w: &mut dyn Write, r: &Ready<'_>) -> io::Result<()> {
    writeln!(
        w,
        "BMOE_READY {{\"load_s\":{},\"arch\":{},\"n_ctx\":{},\"think_ctl\":{},\"n_expert_used\":{}}}",
        json_fixed(r.load_s, 3),
        json_str(r.arch),
        r.n_ctx,
        json_str(r.think_ctl.name()),
        r.n_expert_used
    )
}

/// Writes `BMOE_BEGIN {"id":..}`: a generation started.
pub fn write_begin(w: &mut dyn Write, id: i64) -> io::Result<()> {
    writeln!(w, "BMOE_BEGIN {{\"id\":{id}}}")
}

/// Writes `BMOE_ERROR {...}`. `fatal:false` is a rejected request (the session stays usable);
/// `fatal:true` means the process is ending.
pub fn write_error(w: &mut dyn Write, id: i64, fatal: bool, msg: &str) -> io::Result<()> {
    writeln!(
        w,
        "BMOE_ERROR {{\"id\":{id},\"fatal\":{fatal},\"msg\":{}}}",
        json_str(msg)
    )
}

/// Writes `BMOE_DONE {...}` with every key of the contract, in its order, and bmoe's
/// `n_reused` (the context the turn reused from the KV) after `n_past`. The `prefill_dev_*`
/// keys are always 0: bmoe has no prefill device (the contract's value when the device is off).
pub fn write_done(
    w: &mut dyn Write,
    id: i64,
    cancelled: bool,
    s: &RunSummary,
    reasoning: &str,
    text: &str,
) -> io::Result<()> {
    let c = &s.counters;
    writeln!(
        w,
        "BMOE_DONE {{\"id\":{id},\"cancelled\":{cancelled},\"tokens\":{},\"tok_s\":{},\"prefill_s\":{},\
         \"prefill_tps\":{},\"load_s\":{},\"cache_hit_pct\":{},\"n_prompt\":{},\"n_past\":{},\
         \"n_reused\":{},\"compute_s_tok\":{},\"io_s_tok\":{},\"cache_resident_mib\":{},\"cache_budget_mib\":{},\
         \"read_mib\":{},\"stall_s_tok\":{},\"mgmt_s_tok\":{},\"majflt_tok\":{},\"cpu_s_tok\":{},\
         \"prefill_cpu_s\":{},\"prefill_read_mib\":{},\"prefill_io_s\":{},\"prefill_stall_s\":{},\
         \"prefill_mgmt_s\":{},\"prefill_dev_tokens\":0,\"prefill_dev_nodes\":0,\
         \"prefill_dev_read_mib\":0.0,\"prefill_dev_stall_s\":0.000,\"token_demand_mib\":{},\
         \"mtp_drafted\":{},\"mtp_accepted\":{},\"mtp_decodes\":{},\"mtp_draft_s_tok\":{},\
         \"drafted_steps\":{},\"loop_overhead_s_tok\":{},\"reasoning\":{},\"text\":{}}}",
        s.tokens(),
        json_fixed(s.tokens_per_s(), 3),
        json_fixed(c.prefill_s, 3),
        json_fixed(s.prefill_tps(), 2),
        json_fixed(c.load_s, 3),
        json_fixed(s.cache_hit_pct(), 1),
        c.n_prompt,
        c.n_past,
        c.n_reused,
        json_fixed(s.compute_s_per_token(), 4),
        json_fixed(s.io_s_per_token(), 4),
        json_fixed(s.cache_resident_mib(), 0),
        json_fixed(s.cache_budget_mib(), 0),
        json_fixed(s.read_mib(), 1),
        json_fixed(s.stall_s_per_token(), 4),
        json_fixed(s.mgmt_s_per_token(), 4),
        json_fixed(s.majflt_per_token(), 2),
        json_fixed(s.cpu_s_per_token(), 4),
        json_fixed(c.prefill.cpu_s, 3),
        json_fixed(mib(c.prefill.read_bytes), 1),
        json_fixed(c.prefill.io_s, 3),
        json_fixed(c.prefill.stall_s, 3),
        json_fixed(c.prefill.mgmt_s, 3),
        json_fixed(s.token_demand_mib(), 1),
        c.mtp_drafted,
        c.mtp_accepted,
        c.mtp_decodes,
        json_fixed(s.mtp_draft_s_per_token(), 4),
        c.drafted_steps,
        json_fixed(s.loop_overhead_s_per_token(), 4),
        json_str(reasoning),
        json_str(text)
    )
}

/// What a decide did: the contract's `BMOE_DECIDE` fields. Defined here, beside the line
/// that reports it, so telemetry needs nothing from `decide`; `decide` re-exports it.
#[derive(Debug)]
pub struct DecideOutcome {
    /// The turn number its prefill's trace rows carry.
    pub turn: u32,
    /// Stopped before its prefill ran (a cancel): no logits, `best` is `None`.
    pub cancelled: bool,
    pub choice_logp: Vec<Option<f64>>,
    pub best: Option<usize>,
    /// Tokens of the render, how many were restored from the kept state, how many prefilled.
    pub n_tokens: u32,
    pub n_reused: u32,
    pub n_prefilled: u32,
    /// Seconds to restore the kept state before the prefill, and to keep the new one after.
    pub restore_s: f64,
    pub store_s: f64,
    /// Bytes the kept state holds after the call (0 when none is kept).
    pub prefix_state_bytes: u64,
    /// The turn's summary: its prefill figures (`prefill_s`, `prefill.*`), no tokens.
    pub summary: RunSummary,
    /// The failed step's error, when the prefill failed (the engine then refuses further
    /// steps, and the outcome carries no scores).
    pub error: Option<crate::vocab::StepError>,
}

/// A log-probability as JSON: the shortest text that reads back as the same `f64` (so two
/// runs' values can be compared bit for bit through the line), `null` for `None` (−∞).
fn json_logp(v: Option<f64>) -> String {
    match v {
        // Rust's `{:?}` of an f64 is the shortest round-trip text, always valid JSON
        // (`-2.5`, `-3.0`, `-1e-7`).
        Some(x) if x.is_finite() => format!("{x:?}"),
        _ => "null".to_string(),
    }
}

/// Writes `BMOE_DECIDE {...}` with every key of the contract, in its order. `best` is `-1`
/// when no choice was scored (a cancelled decide, whose `choice_logp` is all `null`). The
/// `prefill_dev_*` keys are 0: bmoe has no prefill device.
pub fn write_decide(w: &mut dyn Write, id: i64, o: &DecideOutcome) -> io::Result<()> {
    let c = &o.summary.counters;
    let logp: Vec<String> = o.choice_logp.iter().map(|&v| json_logp(v)).collect();
    writeln!(
        w,
        "BMOE_DECIDE {{\"id\":{id},\"cancelled\":{},\"best\":{},\"choice_logp\":[{}],\
         \"n_tokens\":{},\"n_reused\":{},\"n_prefilled\":{},\"restore_s\":{},\"store_s\":{},\
         \"prefill_s\":{},\"prefill_cpu_s\":{},\"prefill_read_mib\":{},\"prefill_io_s\":{},\
         \"prefill_stall_s\":{},\"prefill_mgmt_s\":{},\"prefill_dev_tokens\":0,\
         \"prefill_dev_read_mib\":0.0,\"prefill_dev_stall_s\":0.000,\"prefill_dev_routed\":0,\
         \"prefill_dev_demand\":0,\"prefix_state_mib\":{}}}",
        o.cancelled,
        o.best.map_or(-1, |b| b as i64),
        logp.join(","),
        o.n_tokens,
        o.n_reused,
        o.n_prefilled,
        json_fixed(o.restore_s, 4),
        json_fixed(o.store_s, 4),
        json_fixed(c.prefill_s, 3),
        json_fixed(c.prefill.cpu_s, 3),
        json_fixed(mib(c.prefill.read_bytes), 1),
        json_fixed(c.prefill.io_s, 3),
        json_fixed(c.prefill.stall_s, 3),
        json_fixed(c.prefill.mgmt_s, 3),
        json_fixed(mib(o.prefix_state_bytes), 2)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_extend_then_reset() {
        let mut t = DeltaTracker::new();
        let d = t.advance("", "Hel");
        assert_eq!((d.reset, d.reasoning, d.text), (false, "", "Hel"));
        let d = t.advance("", "Hello");
        assert_eq!((d.reset, d.reasoning, d.text), (false, "", "lo"));
        // A closing think tag reclassifies the answer as reasoning.
        let d = t.advance("Hello", "");
        assert_eq!((d.reset, d.reasoning, d.text), (true, "Hello", ""));
        let d = t.advance("Hello", " world");
        assert_eq!((d.reset, d.reasoning, d.text), (false, "", " world"));
        assert_eq!((t.reasoning(), t.text()), ("Hello", " world"));
    }

    #[test]
    fn load_line_only_when_read() {
        let mut out = Vec::new();
        let delta = TextDelta {
            reset: false,
            reasoning: "",
            text: "x",
        };
        write_token_lines(&mut out, &TokenRecord::default(), &delta).expect("vec write");
        let s = String::from_utf8(out).expect("utf8");
        assert!(!s.contains("BMOE_LOAD"));
        assert!(!s.contains("reset"));
        for line in s.lines() {
            let json = line.split_once(' ').map(|(_, j)| j).unwrap_or("");
            serde_json::from_str::<serde_json::Value>(json).expect("valid JSON");
        }
    }
}
