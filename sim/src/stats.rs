//! `bmoe-sim stats`: what a route trace says about caching, before any policy runs.
//!
//! Over the trace's decode tokens (all its steps when it has no decode phase), per MoE layer:
//!
//! - **popularity**: routings per expert; the share the top 10 % of experts take (a tenth of
//!   the layer's experts rounded up, at least one: 1 of 8, 7 of 64; the column says how many)
//!   and the normalised entropy (1 = uniform);
//! - **reuse (stack) distance**: for each routing, how many distinct other experts of the same
//!   layer were routed since that expert's previous routing (experts of earlier tokens only).
//!   Its cumulative distribution at `C` is, to within the order of ties inside a token, the
//!   hit rate of a per-layer LRU holding `C` experts per layer (the inclusion property) — a
//!   whole miss-ratio curve from one pass;
//! - **previous-token overlap by lag**: the share of a token's routed experts the same layer
//!   also routed `lag` tokens earlier (same turn);
//! - **working set vs window**: distinct experts per layer routed in a window of `W`
//!   consecutive tokens (same turn), averaged over every window position.

use crate::error::SimError;
use crate::sweep::plot::{self, HeatFigure, HeatPanel, Line, LineFigure, Panel};
use bmoe_core::records::Phase;
use bmoe_core::telemetry::fmt::fixed;
use bmoe_core::telemetry::route_trace::RouteTrace;
use std::fmt::Write as _;
use std::path::Path;

/// Lags of the overlap statistic.
pub const LAGS: [u32; 10] = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64];
/// Windows (tokens) of the working-set statistic.
pub const WINDOWS: [u32; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

/// One token: per MoE layer, the routed (not dropped) experts in slot order.
type Token = Vec<Vec<u16>>;

/// A trace's caching statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceStats {
    pub layer_ids: Vec<u32>,
    pub n_expert: u32,
    pub k: u32,
    pub tokens: u64,
    pub turns: u64,
    /// True when the trace had no decode steps and every step was used.
    pub used_prefill: bool,
    /// [layer][expert] routings.
    pub popularity: Vec<Vec<u64>>,
    /// [d] routings whose per-layer stack distance is d (d < n_expert); then first uses.
    pub stack: Vec<u64>,
    pub cold: u64,
    /// (lag, overlap share, tokens compared).
    pub overlap: Vec<(u32, f64, u64)>,
    /// (window, mean distinct experts per layer, windows averaged).
    pub working_set: Vec<(u32, f64, u64)>,
}

impl TraceStats {
    /// Routings counted.
    pub fn routings(&self) -> u64 {
        self.stack.iter().sum::<u64>() + self.cold
    }

    /// Share of routings with stack distance below `c` (≈ per-layer LRU hit rate at `c`
    /// experts per layer).
    pub fn lru_hit_at(&self, c: usize) -> f64 {
        let hits: u64 = self.stack.iter().take(c).sum();
        hits as f64 / self.routings().max(1) as f64
    }
}

fn turns_of(trace: &RouteTrace) -> (Vec<Vec<Token>>, bool) {
    let n_layers = trace.preamble.layers.len();
    let any_decode = trace.cells.iter().any(|c| c.phase == Phase::Decode);
    let mut turns: Vec<(u32, Vec<Token>)> = Vec::new();
    for step in trace.steps() {
        if any_decode && step.phase != Phase::Decode {
            continue;
        }
        let mut tok: Token = vec![Vec::new(); n_layers];
        for cell in step.cells {
            let ids = &mut tok[cell.moe_layer as usize];
            for s in trace.cell_slots(cell) {
                if !s.dropped && !ids.contains(&(s.expert as u16)) {
                    ids.push(s.expert as u16);
                }
            }
        }
        match turns.last_mut() {
            Some((t, v)) if *t == step.turn => v.push(tok),
            _ => turns.push((step.turn, vec![tok])),
        }
    }
    (turns.into_iter().map(|(_, v)| v).collect(), !any_decode)
}

/// Compute every statistic of `trace`.
pub fn compute(trace: &RouteTrace) -> TraceStats {
    let p = &trace.preamble;
    let n_layers = p.layers.len();
    let n_expert = p.n_expert as usize;
    let (turns, used_prefill) = turns_of(trace);
    let mut popularity = vec![vec![0u64; n_expert]; n_layers];
    let mut stack_hist = vec![0u64; n_expert];
    let mut cold = 0u64;
    // Per layer, experts from most to least recently routed (over the whole trace: the cache
    // stays warm across turns).
    let mut stacks: Vec<Vec<u16>> = vec![Vec::with_capacity(n_expert); n_layers];
    let mut tokens = 0u64;
    for turn in &turns {
        for tok in turn {
            tokens += 1;
            for (l, ids) in tok.iter().enumerate() {
                let st = &mut stacks[l];
                let before: Vec<Option<usize>> =
                    ids.iter().map(|e| st.iter().position(|x| x == e)).collect();
                for (&e, d) in ids.iter().zip(&before) {
                    if let Some(c) = popularity[l].get_mut(e as usize) {
                        *c += 1;
                    }
                    match d {
                        Some(d) => stack_hist[(*d).min(n_expert - 1)] += 1,
                        None => cold += 1,
                    }
                }
                for &e in ids {
                    if let Some(i) = st.iter().position(|&x| x == e) {
                        st.remove(i);
                    }
                    st.insert(0, e);
                }
            }
        }
    }
    let overlap = LAGS
        .iter()
        .map(|&lag| {
            let (mut shared, mut routed, mut n) = (0u64, 0u64, 0u64);
            for turn in &turns {
                for t in lag as usize..turn.len() {
                    n += 1;
                    for (now, then) in turn[t].iter().zip(&turn[t - lag as usize]) {
                        routed += now.len() as u64;
                        shared += now.iter().filter(|e| then.contains(e)).count() as u64;
                    }
                }
            }
            (lag, shared as f64 / routed.max(1) as f64, n)
        })
        .filter(|&(_, _, n)| n > 0)
        .collect();
    let working_set = WINDOWS
        .iter()
        .map(|&w| {
            let w = w as usize;
            let (mut sum, mut windows) = (0u64, 0u64);
            let mut count = vec![0u32; n_layers * n_expert];
            for turn in &turns {
                if turn.len() < w {
                    continue;
                }
                count.iter_mut().for_each(|c| *c = 0);
                let mut distinct = 0u64;
                let add = |tok: &Token, count: &mut Vec<u32>, distinct: &mut u64, up: bool| {
                    for (l, ids) in tok.iter().enumerate() {
                        for &e in ids {
                            let c = &mut count[l * n_expert + (e as usize).min(n_expert - 1)];
                            if up {
                                *c += 1;
                                if *c == 1 {
                                    *distinct += 1;
                                }
                            } else {
                                *c -= 1;
                                if *c == 0 {
                                    *distinct -= 1;
                                }
                            }
                        }
                    }
                };
                for (t, tok) in turn.iter().enumerate() {
                    add(tok, &mut count, &mut distinct, true);
                    if t >= w {
                        add(&turn[t - w], &mut count, &mut distinct, false);
                    }
                    if t + 1 >= w {
                        sum += distinct;
                        windows += 1;
                    }
                }
            }
            (
                w as u32,
                sum as f64 / windows.max(1) as f64 / n_layers.max(1) as f64,
                windows,
            )
        })
        .filter(|&(_, _, n)| n > 0)
        .collect();
    TraceStats {
        layer_ids: p.layers.iter().map(|l| l.layer).collect(),
        n_expert: p.n_expert,
        k: p.n_expert_used,
        tokens,
        turns: turns.len() as u64,
        used_prefill,
        popularity,
        stack: stack_hist,
        cold,
        overlap,
        working_set,
    }
}

/// How many experts "the top 10 %" of `n_expert` is: a tenth rounded up, at least one (1 of 8,
/// 7 of 64), in integers so 30 gives 3 and not 4.
fn top_count(n_expert: usize) -> usize {
    n_expert.div_ceil(10).max(1).min(n_expert)
}

/// The share of the routings the `top_count` most routed experts take.
fn top_share(counts: &[u64]) -> f64 {
    let mut v = counts.to_vec();
    v.sort_unstable_by(|a, b| b.cmp(a));
    let total: u64 = v.iter().sum();
    v.iter().take(top_count(v.len())).sum::<u64>() as f64 / total.max(1) as f64
}

fn entropy(counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 || counts.len() < 2 {
        return 0.0;
    }
    let h: f64 = counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total as f64;
            -p * p.ln()
        })
        .sum();
    h / (counts.len() as f64).ln()
}

/// The Markdown summary.
pub fn summary_md(s: &TraceStats, name: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# Trace statistics: {name}\n");
    let _ = writeln!(
        o,
        "{} {} tokens in {} turn(s), {} MoE layers × {} experts, top-{}; {} routings.\n",
        s.tokens,
        if s.used_prefill {
            "(prefill: the trace has no decode)"
        } else {
            "decode"
        },
        s.turns,
        s.layer_ids.len(),
        s.n_expert,
        s.k,
        s.routings()
    );
    let _ = writeln!(
        o,
        "## Per-layer LRU hit rate from the reuse (stack) distance\n\n| experts per layer | hit rate |\n| --- | --- |"
    );
    let mut caps: Vec<usize> = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]
        .iter()
        .map(|f| (f * s.k as f64).round() as usize)
        .filter(|&c| c >= 1 && c < s.n_expert as usize)
        .collect();
    caps.push(s.n_expert as usize);
    caps.dedup();
    for c in caps {
        let _ = writeln!(o, "| {c} | {} % |", fixed(100.0 * s.lru_hit_at(c), 1));
    }
    let _ = writeln!(
        o,
        "\nFirst uses (cold): {} % of routings.\n\n## Previous-token overlap by lag\n\n| lag (tokens) | overlap | tokens compared |\n| --- | --- | --- |",
        fixed(100.0 * s.cold as f64 / s.routings().max(1) as f64, 2)
    );
    for &(lag, v, n) in &s.overlap {
        let _ = writeln!(o, "| {lag} | {} % | {n} |", fixed(100.0 * v, 1));
    }
    let _ = writeln!(
        o,
        "\n## Working set vs window\n\n| window (tokens) | distinct experts per layer | % of the layer | windows |\n| --- | --- | --- | --- |"
    );
    for &(w, v, n) in &s.working_set {
        let _ = writeln!(
            o,
            "| {w} | {} | {} % | {n} |",
            fixed(v, 2),
            fixed(100.0 * v / f64::from(s.n_expert.max(1)), 1)
        );
    }
    let n_expert = s.n_expert as usize;
    let _ = writeln!(
        o,
        "\n## Expert popularity per layer\n\n| layer | routings | experts used | top 10 % ({} of {n_expert}) of experts take | normalised entropy |\n| --- | --- | --- | --- | --- |",
        top_count(n_expert)
    );
    for (l, counts) in s.popularity.iter().enumerate() {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} % | {} |",
            s.layer_ids[l],
            counts.iter().sum::<u64>(),
            counts.iter().filter(|&&c| c > 0).count(),
            fixed(100.0 * top_share(counts), 1),
            fixed(entropy(counts), 3)
        );
    }
    o
}

/// Write `stats.md`, the CSVs and the charts into `dir`; returns the names written.
pub fn write_outputs(dir: &Path, s: &TraceStats, name: &str) -> Result<Vec<String>, SimError> {
    let write = |file: &str, text: &str| -> Result<String, SimError> {
        let path = dir.join(file);
        std::fs::write(&path, text).map_err(|e| SimError::io(&path, e))?;
        Ok(file.to_string())
    };
    let mut written = vec![write("stats.md", &summary_md(s, name))?];
    let mut pop = String::from("layer,expert,routings,share\n");
    for (l, counts) in s.popularity.iter().enumerate() {
        let total: u64 = counts.iter().sum();
        for (e, &c) in counts.iter().enumerate() {
            let _ = writeln!(
                pop,
                "{},{e},{c},{}",
                s.layer_ids[l],
                fixed(c as f64 / total.max(1) as f64, 5)
            );
        }
    }
    written.push(write("popularity.csv", &pop)?);
    let mut reuse = String::from("stack_distance,routings,lru_hit_rate_at_distance_plus_1\n");
    for (d, &c) in s.stack.iter().enumerate() {
        let _ = writeln!(reuse, "{d},{c},{}", fixed(s.lru_hit_at(d + 1), 5));
    }
    let _ = writeln!(reuse, "cold,{},", s.cold);
    written.push(write("reuse.csv", &reuse)?);
    let mut ov = String::from("lag,overlap,tokens\n");
    for &(lag, v, n) in &s.overlap {
        let _ = writeln!(ov, "{lag},{},{n}", fixed(v, 5));
    }
    written.push(write("overlap.csv", &ov)?);
    let mut ws = String::from("window,experts_per_layer,windows\n");
    for &(w, v, n) in &s.working_set {
        let _ = writeln!(ws, "{w},{},{n}", fixed(v, 4));
    }
    written.push(write("working_set.csv", &ws)?);

    let line = |title: &str, x: &str, y: &str, fraction: bool, pts: Vec<(f64, f64)>, log2: bool| {
        LineFigure {
            title: format!("{title} — {name}"),
            x_label: x.into(),
            y_label: y.into(),
            fraction,
            x_log2: log2,
            panels: vec![Panel {
                title: String::new(),
                lines: vec![Line {
                    name: name.to_string(),
                    style: 0,
                    black: false,
                    markers: true,
                    points: pts.into_iter().map(|(a, b)| (a, b, None)).collect(),
                }],
            }],
        }
    };
    let curve: Vec<(f64, f64)> = (1..=s.n_expert as usize)
        .map(|c| (c as f64, s.lru_hit_at(c)))
        .collect();
    plot::write_line_figure(
        dir,
        "reuse",
        &line(
            "per-layer LRU hit rate from reuse distance",
            "experts per MoE layer cached",
            "routings with stack distance below",
            true,
            curve,
            false,
        ),
    )?;
    plot::write_line_figure(
        dir,
        "overlap",
        &line(
            "overlap with the token `lag` earlier",
            "lag (tokens)",
            "routed experts shared",
            true,
            s.overlap
                .iter()
                .map(|&(l, v, _)| (f64::from(l).log2(), v))
                .collect(),
            true,
        ),
    )?;
    plot::write_line_figure(
        dir,
        "working_set",
        &line(
            "working set vs window",
            "window (tokens)",
            "distinct experts per layer",
            false,
            s.working_set
                .iter()
                .map(|&(w, v, _)| (f64::from(w).log2(), v))
                .collect(),
            true,
        ),
    )?;
    let layers = s.popularity.len();
    let heat = HeatFigure {
        title: format!("expert popularity per MoE layer — {name}"),
        x_desc: "expert id".into(),
        y_desc: "MoE layer".into(),
        scale_label: "routings / layer's busiest expert".into(),
        x_labels: (0..s.n_expert).map(|e| e.to_string()).collect(),
        y_labels: s.layer_ids.iter().map(u32::to_string).collect(),
        panels: vec![HeatPanel {
            title: String::new(),
            cells: (0..s.n_expert as usize)
                .map(|e| {
                    (0..layers)
                        .map(|l| {
                            let max = s.popularity[l].iter().copied().max().unwrap_or(0);
                            s.popularity[l][e] as f64 / max.max(1) as f64
                        })
                        .collect()
                })
                .collect(),
        }],
    };
    plot::write_heat_figure(dir, "popularity", &heat)?;
    for stem in ["reuse", "overlap", "working_set", "popularity"] {
        written.push(format!("{stem}.svg"));
        written.push(format!("{stem}.png"));
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(rows: &[(u32, u32, u32, &[u32])]) -> RouteTrace {
        let mut t = String::from(
            "# route_trace v1\n# model=t arch=qwen3moe n_layer=1 n_expert=8 n_expert_used=2\n# layer=0 expert_bytes=10 dense_bytes=0\nturn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped\n",
        );
        for &(turn, step, layer, ids) in rows {
            for (slot, e) in ids.iter().enumerate() {
                let _ = writeln!(t, "{turn},1,{step},{layer},{slot},{e},nan,0,10,0");
            }
        }
        RouteTrace::parse(&t).expect("trace")
    }

    #[test]
    fn stack_distance_overlap_and_working_set_by_hand() {
        // Tokens: {0,1} {0,2} {3,1} | next turn {0,1}.
        let t = trace(&[
            (0, 0, 0, &[0, 1]),
            (0, 1, 0, &[0, 2]),
            (0, 2, 0, &[3, 1]),
            (1, 0, 0, &[0, 1]),
        ]);
        let s = compute(&t);
        assert_eq!((s.tokens, s.turns), (4, 2));
        assert_eq!(s.popularity[0][..4], [3, 3, 1, 1]);
        // Token 1: 0 at distance 1 (stack [1, 0]). Token 2: 1 at distance 2 (stack [2, 0, 1]).
        // Token 3: stack [1, 3, 2, 0]: 0 at 3, 1 at 0.
        assert_eq!(s.cold, 4);
        assert_eq!(s.stack[..4], [1, 1, 1, 1]);
        assert!((s.lru_hit_at(2) - 2.0 / 8.0).abs() < 1e-12);
        // Lag 1 within turns: token1 shares {0} of 2, token2 shares none: 1/4.
        assert_eq!(s.overlap[0], (1, 0.25, 2));
        // Window 2 over turn 0 (3 tokens): {0,1,2} = 3 and {0,2,3,1} = 4 → 3.5.
        let w2 = s.working_set.iter().find(|w| w.0 == 2).expect("w2");
        assert_eq!((w2.1, w2.2), (3.5, 2));
        let md = summary_md(&s, "t");
        assert!(md.contains("| 1 | 25.0 % | 2 |"), "{md}");
    }

    #[test]
    fn the_top_ten_percent_column_says_how_many_experts_it_counts() {
        assert_eq!(top_count(8), 1);
        assert_eq!(top_count(64), 7);
        assert_eq!(top_count(160), 16);
        // 30 × 0.1 is 3.0000000000000004 in floating point: still 3.
        assert_eq!(top_count(30), 3);
        assert_eq!(top_count(0), 0);
        // 8 experts: the "top 10 %" is the single most routed one, 2 of the 6 routings.
        let t = trace(&[(0, 0, 0, &[0, 1]), (0, 1, 0, &[0, 2]), (0, 2, 0, &[3, 1])]);
        let md = summary_md(&compute(&t), "t");
        assert!(md.contains("top 10 % (1 of 8)"), "{md}");
        assert!(md.contains("| 0 | 6 | 4 | 33.3 % |"), "{md}");
    }
}
