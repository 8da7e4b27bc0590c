//! `bmoe-sim convert`: routing captures in the shapes researchers publish, into `route_trace v1`
//! (written by the core's own `RouteTraceWriter`, then parsed and planned back to prove the
//! result replays).
//!
//! **JSONL** — one JSON object per token:
//! `{"turn": 0, "step": 5, "phase": "decode", "experts": [[3, 7], [1, 2], ...], "weights": [[0.6, 0.4], ...]}`.
//! `experts` (alias `expert_ids`) is required: one array of expert ids per MoE layer, in MoE-layer
//! order. `turn` (alias `prompt`, `prompt_id`, `sequence`) defaults to 0, `step` (alias `token`,
//! `position`, `pos`) to the token's index within its turn, `phase` to decode (`prefill`/`0`
//! or `decode`/`1`), `weights` to unknown (`nan`).
//!
//! **CSV (long)** — one row per (token, MoE layer), as per-layer activation captures such as the
//! DeepSeek-V2-Lite one are commonly laid out: a header naming a turn column (`turn`, `prompt`,
//! `prompt_id`, `sequence`, `seq`; optional, default 0), a token column (`step`, `token`,
//! `token_idx`, `position`, `pos`), a layer column (`layer`, `layer_id`, `layer_idx`) and the
//! experts either in one column (`experts`, `expert_ids`, `topk_ids`, `topk`: ids separated by
//! spaces, `;` or `|`, optionally in brackets) or in columns `expert_0`, `expert_1`, … (also
//! `e0`, `e1`, …); optionally `weights` / `weight_0`, …. Layer ids are the model's: the distinct
//! values of the layer column are the MoE layers.
//!
//! Every bad row is refused with its line number and what was expected: a missing column, an
//! id out of `0..n_expert`, a routing wider or narrower than top-k, a repeated expert, a token
//! that misses a layer, a non-number.

use crate::error::SimError;
use bmoe_core::records::{Phase, RouteRecord};
use bmoe_core::telemetry::route_trace::{RoutePreamble, RouteTrace, RouteTraceWriter, TraceLayer};
use std::collections::BTreeMap;
use std::path::Path;

/// The input format.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Format {
    Jsonl,
    Csv,
}

impl Format {
    /// `jsonl` or `csv`; `auto` by `path`'s extension.
    pub fn resolve(name: &str, path: &Path) -> Result<Format, SimError> {
        match name {
            "jsonl" => Ok(Format::Jsonl),
            "csv" => Ok(Format::Csv),
            _ => match path.extension().and_then(|e| e.to_str()) {
                Some("jsonl" | "json" | "ndjson") => Ok(Format::Jsonl),
                Some("csv") => Ok(Format::Csv),
                _ => Err(SimError::invalid(
                    "--format",
                    format!(
                        "cannot tell the format of {} from its extension: pass --format jsonl or csv",
                        path.display()
                    ),
                )),
            },
        }
    }
}

/// Model facts a capture does not carry.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub model: String,
    pub arch: String,
    /// Experts per MoE layer (`None`: the largest id seen + 1).
    pub n_expert: Option<u32>,
    /// Routed experts per token (`None`: the first routing's width).
    pub top_k: Option<u32>,
    /// One expert's bytes (every projection), as the model file would store it.
    pub expert_bytes: u64,
    pub dense_bytes: u64,
    /// JSONL: the model layer id of the first MoE layer (MoE layers are consecutive).
    pub first_layer: u32,
    /// The model's layer count (`None`: last MoE layer + 1).
    pub n_layer: Option<u32>,
    /// The captured model's gating, written as the preamble's `gating=`.
    pub gating: bmoe_core::gating::Gating,
    /// Provenance, written as `# note:` lines.
    pub notes: Vec<String>,
}

/// One routing before it is written: (turn, phase, step, model layer) → (ids, weights).
type Routings = BTreeMap<(u32, u8, i64, u32), (Vec<u32>, Vec<f32>)>;

fn bad(line: usize, what: impl Into<String>) -> SimError {
    SimError::invalid(format!("input line {line}"), what.into())
}

fn json_u64(v: &serde_json::Value, line: usize, key: &str) -> Result<u64, SimError> {
    v.as_u64().ok_or_else(|| {
        bad(
            line,
            format!("`{key}` must be a non-negative integer, got {v}"),
        )
    })
}

fn parse_jsonl(text: &str, opt: &ConvertOptions) -> Result<Routings, SimError> {
    let mut out = Routings::new();
    let mut next_step: BTreeMap<u32, i64> = BTreeMap::new();
    let mut n_layers: Option<usize> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(raw).map_err(|e| bad(line, format!("not a JSON object: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| bad(line, "expected a JSON object with an `experts` array"))?;
        let pick = |keys: &[&'static str]| -> Option<(&'static str, &serde_json::Value)> {
            keys.iter().find_map(|&k| obj.get(k).map(|v| (k, v)))
        };
        let turn = match pick(&["turn", "prompt", "prompt_id", "sequence"]) {
            Some((k, v)) => u32::try_from(json_u64(v, line, k)?)
                .map_err(|_| bad(line, format!("`{k}` is above 2^32")))?,
            None => 0,
        };
        let phase = match obj.get("phase") {
            None => 1u8,
            Some(p) => match (p.as_str(), p.as_u64()) {
                (Some("prefill"), _) | (_, Some(0)) => 0,
                (Some("decode"), _) | (_, Some(1)) => 1,
                _ => {
                    return Err(bad(
                        line,
                        format!("`phase` must be prefill, decode, 0 or 1, got {p}"),
                    ))
                }
            },
        };
        let step = match pick(&["step", "token", "position", "pos"]) {
            Some((k, v)) => i64::try_from(json_u64(v, line, k)?)
                .map_err(|_| bad(line, format!("`{k}` is too large")))?,
            None => *next_step.get(&turn).unwrap_or(&0),
        };
        next_step.insert(turn, step + 1);
        let (key, experts) = pick(&["experts", "expert_ids"]).ok_or_else(|| {
            bad(
                line,
                "missing `experts`: one array of expert ids per MoE layer",
            )
        })?;
        let layers = experts.as_array().ok_or_else(|| {
            bad(
                line,
                format!("`{key}` must be an array of arrays (one per MoE layer)"),
            )
        })?;
        match n_layers {
            None => n_layers = Some(layers.len()),
            Some(n) if n != layers.len() => {
                return Err(bad(
                    line,
                    format!(
                        "`{key}` has {} layers; earlier lines have {n}",
                        layers.len()
                    ),
                ))
            }
            _ => {}
        }
        let weights = obj.get("weights").and_then(|w| w.as_array());
        for (l, ids) in layers.iter().enumerate() {
            let ids = ids
                .as_array()
                .ok_or_else(|| bad(line, format!("`{key}[{l}]` must be an array of expert ids")))?
                .iter()
                .map(|e| {
                    json_u64(e, line, &format!("{key}[{l}]")).and_then(|e| {
                        u32::try_from(e).map_err(|_| bad(line, "expert id above 2^32"))
                    })
                })
                .collect::<Result<Vec<u32>, _>>()?;
            let ws: Vec<f32> = match weights.and_then(|w| w.get(l)).and_then(|w| w.as_array()) {
                Some(ws) if ws.len() == ids.len() => ws
                    .iter()
                    .map(|w| {
                        w.as_f64().map(|w| w as f32).ok_or_else(|| {
                            bad(line, format!("`weights[{l}]` holds a non-number {w}"))
                        })
                    })
                    .collect::<Result<_, _>>()?,
                Some(ws) => {
                    return Err(bad(
                        line,
                        format!(
                            "`weights[{l}]` has {} values for {} experts",
                            ws.len(),
                            ids.len()
                        ),
                    ))
                }
                None => vec![f32::NAN; ids.len()],
            };
            let layer = opt.first_layer + l as u32;
            if out.insert((turn, phase, step, layer), (ids, ws)).is_some() {
                return Err(bad(line, format!("turn {turn} step {step} appears twice")));
            }
        }
    }
    Ok(out)
}

fn split_ids(s: &str) -> Vec<&str> {
    s.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .split([' ', ';', '|', ','])
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn parse_csv(text: &str) -> Result<Routings, SimError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'));
    let Some((_, header)) = lines.next() else {
        return Err(SimError::invalid(
            "input",
            "the CSV is empty: expected a header row",
        ));
    };
    // Quoted single columns ("[1, 2, 3]") hold commas: split on commas outside quotes.
    let split = |l: &str| -> Vec<String> {
        let mut out = vec![String::new()];
        let mut quoted = false;
        for c in l.chars() {
            match c {
                '"' => quoted = !quoted,
                ',' if !quoted => out.push(String::new()),
                _ => out.last_mut().expect("one field").push(c),
            }
        }
        out.into_iter().map(|f| f.trim().to_string()).collect()
    };
    let head: Vec<String> = split(header)
        .into_iter()
        .map(|h| h.to_ascii_lowercase())
        .collect();
    let find = |names: &[&str]| head.iter().position(|h| names.contains(&h.as_str()));
    let turn_col = find(&["turn", "prompt", "prompt_id", "sequence", "seq"]);
    let step_col = find(&["step", "token", "token_idx", "position", "pos"]).ok_or_else(|| {
        SimError::invalid(
            "input header",
            "no token column (step, token, token_idx, position or pos)",
        )
    })?;
    let layer_col = find(&["layer", "layer_id", "layer_idx"]).ok_or_else(|| {
        SimError::invalid(
            "input header",
            "no layer column (layer, layer_id or layer_idx)",
        )
    })?;
    let one_col = find(&["experts", "expert_ids", "topk_ids", "topk"]);
    let numbered = |prefixes: &[&str]| -> Vec<usize> {
        let mut cols: Vec<(u32, usize)> = head
            .iter()
            .enumerate()
            .filter_map(|(i, h)| {
                prefixes
                    .iter()
                    .find_map(|p| h.strip_prefix(p))
                    .and_then(|n| n.parse::<u32>().ok())
                    .map(|n| (n, i))
            })
            .collect();
        cols.sort_unstable();
        cols.into_iter().map(|(_, i)| i).collect()
    };
    let expert_cols = numbered(&["expert_", "e"]);
    if one_col.is_none() && expert_cols.is_empty() {
        return Err(SimError::invalid(
            "input header",
            "no expert column: expected `experts` (ids separated by spaces, ; or |) or expert_0, expert_1, ...",
        ));
    }
    let w_one = find(&["weights", "topk_weights"]);
    let w_cols = numbered(&["weight_", "w"]);
    let mut out = Routings::new();
    for (i, l) in lines {
        let line = i + 1;
        let f = split(l);
        let get = |c: usize, what: &str| -> Result<&str, SimError> {
            f.get(c).map(String::as_str).ok_or_else(|| {
                bad(
                    line,
                    format!(
                        "{} fields, but the header puts `{what}` in column {}",
                        f.len(),
                        c + 1
                    ),
                )
            })
        };
        let num = |c: usize, what: &str| -> Result<u64, SimError> {
            let s = get(c, what)?;
            s.parse::<u64>().map_err(|_| {
                bad(
                    line,
                    format!("`{what}` must be a non-negative integer, got '{s}'"),
                )
            })
        };
        let turn = match turn_col {
            Some(c) => {
                u32::try_from(num(c, &head[c])?).map_err(|_| bad(line, "turn above 2^32"))?
            }
            None => 0,
        };
        let step = i64::try_from(num(step_col, &head[step_col])?)
            .map_err(|_| bad(line, "step too large"))?;
        let layer = u32::try_from(num(layer_col, &head[layer_col])?)
            .map_err(|_| bad(line, "layer above 2^32"))?;
        let id_texts: Vec<String> = match one_col {
            Some(c) => split_ids(get(c, &head[c])?)
                .into_iter()
                .map(str::to_string)
                .collect(),
            None => expert_cols
                .iter()
                .map(|&c| get(c, &head[c]).map(str::to_string))
                .collect::<Result<_, _>>()?,
        };
        let ids = id_texts
            .iter()
            .map(|t| {
                t.parse::<u32>().map_err(|_| {
                    bad(
                        line,
                        format!("expert id '{t}' is not a non-negative integer"),
                    )
                })
            })
            .collect::<Result<Vec<u32>, _>>()?;
        let w_texts: Vec<String> = match (w_one, w_cols.is_empty()) {
            (Some(c), _) => split_ids(get(c, &head[c])?)
                .into_iter()
                .map(str::to_string)
                .collect(),
            (None, false) => w_cols
                .iter()
                .map(|&c| get(c, &head[c]).map(str::to_string))
                .collect::<Result<_, _>>()?,
            (None, true) => Vec::new(),
        };
        let ws: Vec<f32> = if w_texts.is_empty() {
            vec![f32::NAN; ids.len()]
        } else if w_texts.len() != ids.len() {
            return Err(bad(
                line,
                format!("{} weights for {} experts", w_texts.len(), ids.len()),
            ));
        } else {
            w_texts
                .iter()
                .map(|t| {
                    t.parse::<f32>()
                        .map_err(|_| bad(line, format!("weight '{t}' is not a number")))
                })
                .collect::<Result<_, _>>()?
        };
        if out.insert((turn, 1, step, layer), (ids, ws)).is_some() {
            return Err(bad(
                line,
                format!("turn {turn} step {step} layer {layer} appears twice"),
            ));
        }
    }
    if out.is_empty() {
        return Err(SimError::invalid(
            "input",
            "the CSV has a header but no rows",
        ));
    }
    Ok(out)
}

/// What a conversion produced.
pub struct Converted {
    pub text: String,
    pub tokens: usize,
    pub routings: usize,
    pub layers: usize,
    pub n_expert: u32,
    pub top_k: u32,
}

/// Convert `text` (in `format`) into a route trace.
pub fn convert(text: &str, format: Format, opt: &ConvertOptions) -> Result<Converted, SimError> {
    let routings = match format {
        Format::Jsonl => parse_jsonl(text, opt)?,
        Format::Csv => parse_csv(text)?,
    };
    let layer_ids: Vec<u32> = {
        let mut v: Vec<u32> = routings.keys().map(|k| k.3).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    if layer_ids.is_empty() {
        return Err(SimError::invalid("input", "no routing found"));
    }
    let max_id = routings
        .values()
        .flat_map(|(ids, _)| ids.iter())
        .copied()
        .max()
        .unwrap_or(0);
    let n_expert = opt.n_expert.unwrap_or(max_id + 1);
    let top_k = opt.top_k.unwrap_or_else(|| {
        routings
            .values()
            .next()
            .map_or(0, |(ids, _)| ids.len() as u32)
    });
    if top_k == 0 {
        return Err(SimError::invalid(
            "input",
            "the first routing lists no expert: pass --top-k",
        ));
    }
    // Every token routes every MoE layer, top-k distinct ids in range.
    let mut steps: BTreeMap<(u32, u8, i64), Vec<u32>> = BTreeMap::new();
    for (&(turn, phase, step, layer), (ids, _)) in &routings {
        let at = format!("turn {turn} step {step} layer {layer}");
        if ids.len() != top_k as usize {
            return Err(SimError::invalid(
                at,
                format!(
                    "routes {} experts; every routing has top-k = {top_k} (--top-k)",
                    ids.len()
                ),
            ));
        }
        for (j, &e) in ids.iter().enumerate() {
            if e >= n_expert {
                return Err(SimError::invalid(
                    at,
                    format!("expert id {e} is out of range 0..{n_expert} (--n-expert)"),
                ));
            }
            if ids[..j].contains(&e) {
                return Err(SimError::invalid(at, format!("expert {e} is routed twice")));
            }
        }
        steps.entry((turn, phase, step)).or_default().push(layer);
    }
    for (&(turn, _, step), layers) in &steps {
        if layers.len() != layer_ids.len() {
            let missing: Vec<String> = layer_ids
                .iter()
                .filter(|l| !layers.contains(l))
                .map(u32::to_string)
                .collect();
            return Err(SimError::invalid(
                format!("turn {turn} step {step}"),
                format!(
                    "has no routing for MoE layer(s) {}; every token routes every layer",
                    missing.join(", ")
                ),
            ));
        }
    }
    let preamble = RoutePreamble {
        model: opt.model.clone(),
        arch: opt.arch.clone(),
        n_layer: opt
            .n_layer
            .unwrap_or(layer_ids.last().copied().unwrap_or(0) + 1),
        n_expert,
        n_expert_used: top_k,
        layers: layer_ids
            .iter()
            .map(|&layer| TraceLayer {
                layer,
                expert_bytes: opt.expert_bytes,
                dense_bytes: opt.dense_bytes,
                proj: Vec::new(),
            })
            .collect(),
        gating: opt.gating,
        notes: opt.notes.clone(),
        extra: Vec::new(),
    };
    let moe_of: BTreeMap<u32, u32> = layer_ids
        .iter()
        .enumerate()
        .map(|(m, &l)| (l, m as u32))
        .collect();
    let mut w =
        RouteTraceWriter::new(Vec::new(), &preamble).map_err(|e| SimError::io("route trace", e))?;
    let mut n = 0usize;
    for (&(turn, phase, step, layer), (ids, ws)) in &routings {
        for (slot, (&e, &wt)) in ids.iter().zip(ws).enumerate() {
            w.write(&RouteRecord {
                turn,
                phase: if phase == 0 {
                    Phase::Prefill
                } else {
                    Phase::Decode
                },
                step,
                layer: moe_of[&layer],
                slot: slot as u32,
                expert: e,
                weight: wt,
                residency: 0,
                expert_bytes: opt.expert_bytes,
                dropped: false,
                preds: Default::default(),
                row: 0,
                router_expert: None,
            })
            .map_err(|e| SimError::io("route trace", e))?;
            n += 1;
        }
    }
    let bytes = w.finish().map_err(|e| SimError::io("route trace", e))?;
    let text =
        String::from_utf8(bytes).map_err(|e| SimError::invalid("route trace", e.to_string()))?;
    // Prove it: the result parses and plans as a replayable trace.
    let parsed = RouteTrace::parse(&text).map_err(|source| SimError::Parse {
        path: "converted trace".into(),
        source,
    })?;
    crate::plan::ReplayPlan::new(&parsed)?;
    Ok(Converted {
        text,
        tokens: steps.len(),
        routings: n,
        layers: layer_ids.len(),
        n_expert,
        top_k,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opt() -> ConvertOptions {
        ConvertOptions {
            model: "m".into(),
            arch: "unknown".into(),
            n_expert: Some(8),
            top_k: None,
            expert_bytes: 1000,
            dense_bytes: 0,
            first_layer: 1,
            n_layer: None,
            gating: "topk_softmax".parse().unwrap(),
            notes: vec!["converted in a test".into()],
        }
    }

    #[test]
    fn jsonl_and_csv_give_the_same_trace() {
        let jsonl = r#"{"prompt": 0, "experts": [[1, 2], [3, 4]]}
{"prompt": 0, "experts": [[2, 1], [4, 5]], "weights": [[0.7, 0.3], [0.5, 0.5]]}
{"prompt": 1, "token": 0, "experts": [[0, 7], [6, 5]]}
"#;
        let a = convert(jsonl, Format::Jsonl, &opt()).expect("jsonl");
        assert_eq!((a.tokens, a.routings, a.layers, a.top_k), (3, 12, 2, 2));
        let t = RouteTrace::parse(&a.text).expect("parses");
        assert_eq!(
            t.preamble
                .layers
                .iter()
                .map(|l| l.layer)
                .collect::<Vec<_>>(),
            vec![1, 2]
        );
        let csv = "prompt_id,token_idx,layer,experts,weights\n\
                   0,0,1,1 2,\n0,0,2,3 4,\n0,1,1,\"[2, 1]\",0.7 0.3\n0,1,2,4|5,0.5;0.5\n\
                   1,0,1,0 7,\n1,0,2,6 5,\n";
        // Empty weights fields: unknown (nan) weights, as in the JSONL.
        let b = convert(csv, Format::Csv, &opt()).expect("csv");
        assert_eq!(a.text, b.text);
        let cols = "turn,step,layer,expert_0,expert_1\n0,0,1,1,2\n0,0,2,3,4\n0,1,1,2,1\n0,1,2,4,5\n1,0,1,0,7\n1,0,2,6,5\n";
        let c = convert(cols, Format::Csv, &opt()).expect("columns");
        assert_eq!(c.routings, 12);
    }

    #[test]
    fn bad_rows_are_refused_with_their_line() {
        let e =
            |text: &str, f: Format| convert(text, f, &opt()).err().expect("refused").to_string();
        let msg = e(
            "{\"experts\": [[1, 2]]}\n{\"experts\": [[1, 9]]}\n",
            Format::Jsonl,
        );
        assert!(msg.contains("expert id 9 is out of range 0..8"), "{msg}");
        let msg = e("{\"experts\": [[1, 2]]}\nnot json\n", Format::Jsonl);
        assert!(
            msg.contains("input line 2") && msg.contains("not a JSON object"),
            "{msg}"
        );
        let msg = e(
            "{\"experts\": [[1, 2], [3, 4]]}\n{\"experts\": [[1, 2]]}\n",
            Format::Jsonl,
        );
        assert!(
            msg.contains("input line 2") && msg.contains("has 1 layers"),
            "{msg}"
        );
        let msg = e("{\"experts\": [[1, 1]]}\n", Format::Jsonl);
        assert!(msg.contains("routed twice"), "{msg}");
        let msg = e(
            "{\"experts\": [[1, 2]]}\n{\"experts\": [[1, 2, 3]]}\n",
            Format::Jsonl,
        );
        assert!(
            msg.contains("routes 3 experts; every routing has top-k = 2"),
            "{msg}"
        );
        let msg = e("step,layer,experts\n0,1,1 2\n0,2,x 3\n", Format::Csv);
        assert!(msg.contains("input line 3") && msg.contains("'x'"), "{msg}");
        let msg = e(
            "step,layer,experts\n0,1,1 2\n0,2,3 4\n1,1,1 2\n",
            Format::Csv,
        );
        assert!(
            msg.contains("turn 0 step 1") && msg.contains("no routing for MoE layer(s) 2"),
            "{msg}"
        );
        let msg = e("step,experts\n0,1 2\n", Format::Csv);
        assert!(msg.contains("no layer column"), "{msg}");
        let msg = e("step,layer,experts\n0,1\n", Format::Csv);
        assert!(
            msg.contains("input line 2") && msg.contains("2 fields"),
            "{msg}"
        );
        assert!(Format::resolve("auto", Path::new("x.txt")).is_err());
    }
}
