//! The end-of-run text report (`generation:`, `compute:`, `mode:`, `moe-*:` lines), as
//! functions of the resolved `RunConfig` and the generation's `RunSummary`.
//!
//! One place prints these lines for the engine and the simulator, with one precision per
//! field, so a sim report and a measured report can be read — and diffed — side by side. Each
//! line builder returns `None` when its line does not apply; `write_report` prints them in the
//! contract's order.

use std::io::{self, Write};

use super::fmt::{fixed, pct};
use super::summary::{PredictReport, PredictorStats, RunSummary};
use crate::config::{RunConfig, SpecMode};

/// What the report needs beyond the configuration and the summary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReportContext<'a> {
    /// `--progress`: print the `=== answer ===` / `=== perf ===` banners around the answer.
    /// Without it the answer was streamed inline and only the summary lines are printed.
    pub progress: bool,
    /// The full generated answer (printed only with `progress`).
    pub answer: &'a str,
    /// Whether the model's architecture is one this build can stream (decides the wording of
    /// the baseline `mode:` line).
    pub arch_streamable: bool,
}

/// `generation: <n> tokens, <s> s/token (<t> tok/s)`.
pub fn generation_line(s: &RunSummary) -> String {
    format!(
        "generation: {} tokens, {} s/token ({} tok/s)",
        s.tokens(),
        fixed(s.s_per_token(), 3),
        fixed(s.tokens_per_s(), 3)
    )
}

/// `generation: interrupted ...` after the `generation:` line when the run was stopped at a
/// token boundary before its end (a signal, or a session `cancel`), so the figures above are
/// not read as a complete run's. `None` otherwise.
pub fn interrupted_line(s: &RunSummary) -> Option<String> {
    s.counters.interrupted.then(|| {
        format!(
            "generation: interrupted at a token boundary after {} tokens; the figures cover those tokens",
            s.tokens()
        )
    })
}

/// `prompt: <n> tokens in <s> s (<t> tok/s)[, <r> reused from the KV]`: the prefill this run
/// or turn did (llama.cpp's "prompt eval" line); `None` when nothing was prefilled.
pub fn prompt_line(s: &RunSummary) -> Option<String> {
    let c = &s.counters;
    (c.n_prompt > 0 && c.prefill_s > 0.0).then(|| {
        let reused = if c.n_reused > 0 {
            format!(", {} reused from the KV", c.n_reused)
        } else {
            String::new()
        };
        format!(
            "prompt: {} tokens in {} s ({} tok/s){reused}",
            c.n_prompt,
            fixed(c.prefill_s, 3),
            fixed(c.n_prompt as f64 / c.prefill_s, 1)
        )
    })
}

/// `load: <s> s`: opening the model until the first step could run; `None` when not measured
/// (the simulator loads nothing).
pub fn load_line(s: &RunSummary) -> Option<String> {
    (s.counters.load_s > 0.0).then(|| format!("load: {} s", fixed(s.counters.load_s, 2)))
}

/// `compute: <pct>% CPU occupancy (...)`, or `None` when the platform measured neither CPU
/// time nor faults.
pub fn compute_line(cfg: &RunConfig, s: &RunSummary) -> Option<String> {
    let cpu = s.cpu_s_per_token();
    let majflt = s.majflt_per_token();
    if cpu <= 0.0 && majflt <= 0.0 {
        return None;
    }
    let spt = s.s_per_token();
    let occupancy = if spt > 0.0 && cfg.threads > 0 {
        cpu / (spt * f64::from(cfg.threads))
    } else {
        0.0
    };
    Some(format!(
        "compute: {}% CPU occupancy ({} cpu-s/token over {} threads), {} major faults/token",
        fixed(occupancy * 100.0, 1),
        fixed(cpu, 4),
        cfg.threads,
        fixed(majflt, 2)
    ))
}

/// The `mtp:` / `ngram:` lines (acceptance, cost, and for n-gram coverage), or none.
pub fn speculation_lines(cfg: &RunConfig, s: &RunSummary) -> Vec<String> {
    let c = &s.counters;
    if c.mtp_decodes == 0 {
        return Vec::new();
    }
    // Named after the source that drafted (a session's request may choose another than the
    // run's flag); a replayed run names the one its recording's header gave.
    let src = match (c.spec_sources.name(), cfg.spec) {
        (Some(name), _) => name,
        (None, SpecMode::Off) => return Vec::new(),
        (None, mode) => mode.name(),
    };
    let mut out = vec![format!(
        "{src}: {}/{} drafts accepted ({}%), {} tokens per verify decode ({} decodes for {} tokens)",
        c.mtp_accepted,
        c.mtp_drafted,
        fixed(pct(c.mtp_accepted, c.mtp_drafted), 1),
        fixed(s.tokens() as f64 / c.mtp_decodes as f64, 2),
        c.mtp_decodes,
        s.tokens()
    )];
    let with_drafting = s.s_per_token() + s.mtp_draft_s_per_token();
    let effective = if with_drafting > 0.0 {
        1.0 / with_drafting
    } else {
        0.0
    };
    out.push(format!(
        "{src}: drafting costs {} s/token on top of decode → {} tok/s effective (vs {} reported)",
        fixed(s.mtp_draft_s_per_token(), 4),
        fixed(effective, 2),
        fixed(s.tokens_per_s(), 2)
    ));
    if src == "ngram" {
        out.push(format!(
            "ngram: drafted on {} of {} steps ({}%); the rest decoded plainly",
            c.drafted_steps,
            c.mtp_decodes,
            fixed(pct(c.drafted_steps, c.mtp_decodes), 1)
        ));
    }
    out
}

/// `mode:` — printed on every run. Streaming names the cache (`auto`, `<n> MiB`, `off`), the
/// dense mode and overlap; a run without streaming says it is a baseline and, on an
/// architecture this build streams, names the flag. When the engine chose (no streaming flag),
/// the line ends with why: the model's need against the memory the process may use.
pub fn mode_line(cfg: &RunConfig, arch_streamable: bool) -> String {
    let line = mode_line_flags(cfg, arch_streamable);
    match cfg.stream_choice.reason() {
        Some(why) if cfg.moe_stream => format!("{line} ({why})"),
        Some(why) if arch_streamable => format!("mode: mmap, {why}."),
        _ => line,
    }
}

/// The `mode:` line as the flags alone settle it.
fn mode_line_flags(cfg: &RunConfig, arch_streamable: bool) -> String {
    if cfg.moe_stream {
        let cache = if cfg.cache_auto {
            match cfg.cache_room_from {
                Some(from) => format!("cache auto (room: {})", from.phrase()),
                None => "cache auto".to_string(),
            }
        } else if cfg.cache_mb > 0 {
            format!("cache {} MiB", cfg.cache_mb)
        } else {
            "cache off".to_string()
        };
        let buffered = match &cfg.o_direct_refused {
            Some(why) => format!(", buffered reads ({why})"),
            None => String::new(),
        };
        format!(
            "mode: expert streaming, {cache}, dense {}{}{buffered}",
            cfg.dense_weights.name(),
            if cfg.overlap { ", overlap" } else { "" }
        )
    } else if arch_streamable {
        format!(
            "mode: mmap. Expert streaming is OFF on a MoE model ({}), so this run is a baseline, not \
             this engine: add --moe-stream --overlap to stream the routed experts from flash.",
            cfg.arch
        )
    } else {
        let arch = if cfg.arch.is_empty() {
            "the model"
        } else {
            cfg.arch.as_str()
        };
        format!("mode: mmap ({arch} is not a MoE architecture this build streams; --list-archs lists the supported ones)")
    }
}

/// The `moe-stream:` line (with `stall_s/tok=` under overlap), plus a failure line when reads
/// failed. Empty without streaming.
pub fn stream_lines(cfg: &RunConfig, s: &RunSummary) -> Vec<String> {
    if !cfg.moe_stream {
        return Vec::new();
    }
    let n = s.tokens();
    let read_per_token = if n > 0 { s.read_mib() / n as f64 } else { 0.0 };
    let mut line = format!(
        "moe-stream: read {} MiB ({} MiB/token), decode {} s/token (compute {} + cache mgmt {} + flash I/O {} s/token, {} MiB/s)",
        fixed(s.read_mib(), 1),
        fixed(read_per_token, 2),
        fixed(s.s_per_token(), 3),
        fixed(s.compute_s_per_token(), 3),
        fixed(s.mgmt_s_per_token(), 3),
        fixed(s.io_s_per_token(), 3),
        fixed(s.read_mib_per_s(), 0)
    );
    if cfg.overlap {
        line.push_str(&format!(
            ", stall_s/tok={}",
            fixed(s.stall_s_per_token(), 3)
        ));
    }
    let mut out = vec![line];
    if s.counters.io_errors > 0 {
        out.push(format!(
            "moe-stream: {} FAILED reads — this run's output is not trustworthy",
            s.counters.io_errors
        ));
    }
    out
}

/// The `moe-cache:` lines: hit rate and residency (plus the budget when auto chose it), then
/// the churn line when anything was evicted or re-read. Empty when no cache was active.
pub fn cache_lines(cfg: &RunConfig, s: &RunSummary) -> Vec<String> {
    let hit = s.cache_hit_pct();
    if !cfg.moe_stream || hit < 0.0 {
        return Vec::new();
    }
    let mut out = vec![if cfg.cache_auto {
        format!(
            "moe-cache: {}% hit, resident {} MiB, budget {} MiB (auto)",
            fixed(hit, 1),
            fixed(s.cache_resident_mib(), 1),
            fixed(s.cache_budget_mib(), 0)
        )
    } else {
        format!(
            "moe-cache: {}% hit, resident {} MiB",
            fixed(hit, 1),
            fixed(s.cache_resident_mib(), 1)
        )
    }];
    let c = &s.counters;
    if c.evictions > 0 || c.rereads > 0 {
        let per_token = if s.tokens() > 0 {
            c.rereads as f64 / s.tokens() as f64
        } else {
            0.0
        };
        out.push(format!(
            "moe-cache: {} evictions, {} re-reads ({}/token) — bytes the cache had already paid for once",
            c.evictions,
            c.rereads,
            fixed(per_token, 1)
        ));
    }
    if c.admission_filter {
        let per_token = if s.tokens() > 0 {
            c.bypasses as f64 / s.tokens() as f64
        } else {
            0.0
        };
        out.push(format!(
            "moe-cache: {} misses bypassed ({}/token) — read and computed from a transient buffer, never cached",
            c.bypasses,
            fixed(per_token, 1)
        ));
    }
    out
}

/// `moe-prefetch:` with the predictor tag, when any speculative predictor was on.
pub fn prefetch_line(cfg: &RunConfig, s: &RunSummary) -> Option<String> {
    if !cfg.moe_stream || !(cfg.prefetch > 0 || cfg.predict_prefetch || cfg.route_ahead > 0) {
        return None;
    }
    let c = &s.counters;
    let tag = if cfg.route_ahead > 0 {
        " [route-ahead]"
    } else if cfg.predict_prefetch {
        " [stale-gate]"
    } else {
        ""
    };
    Some(format!(
        "moe-prefetch: {} MiB speculative, {}/{} experts useful ({}%){tag}",
        fixed(s.spec_read_mib(), 1),
        c.spec_useful,
        c.spec_experts,
        fixed(pct(c.spec_useful, c.spec_experts), 0)
    ))
}

/// `moe-drop:` when `--drop-cold-experts` was armed.
pub fn drop_line(cfg: &RunConfig, s: &RunSummary) -> Option<String> {
    if !cfg.moe_stream || cfg.drop_cold_frac <= 0.0 {
        return None;
    }
    let c = &s.counters;
    Some(format!(
        "moe-drop: {}/{} routed experts dropped ({}%), threshold {} x uniform",
        c.experts_dropped,
        c.experts_routed,
        fixed(pct(c.experts_dropped, c.experts_routed), 1),
        fixed(f64::from(cfg.drop_cold_frac), 2)
    ))
}

/// `moe-substitute:` when `--expert-substitute` was armed.
pub fn substitute_line(cfg: &RunConfig, s: &RunSummary) -> Option<String> {
    if !cfg.moe_stream || cfg.substitute_lambda <= 0.0 {
        return None;
    }
    let c = &s.counters;
    Some(format!(
        "moe-substitute: {}/{} reranked slots went to a resident expert ({}%), margin {} x score range",
        c.experts_substituted,
        c.experts_reranked,
        fixed(pct(c.experts_substituted, c.experts_reranked), 1),
        fixed(f64::from(cfg.substitute_lambda), 2)
    ))
}

/// The `moe-route-ahead:` lines (commitment and agreement; prediction CPU when it ran).
pub fn route_ahead_lines(cfg: &RunConfig, s: &RunSummary) -> Vec<String> {
    if !cfg.moe_stream || cfg.route_ahead == 0 {
        return Vec::new();
    }
    let c = &s.counters;
    let mut out = vec![format!(
        "moe-route-ahead: {} layers early — {} routings committed, {} passed through; committed selection agreed with the router on {}% of slots",
        cfg.route_ahead,
        c.ra_committed,
        c.ra_passthrough,
        fixed(s.ra_agree_pct(), 1)
    )];
    if c.ra_gemv_jobs > 0 {
        // bmoe computes the predictions inline on the eval thread (no worker pool), and has no
        // sampled watchdog; read-issue time is printed only when a build measures it.
        let mut line = format!(
            "moe-route-ahead: prediction {} ms/token on the eval thread ({} GEMVs, {} ms each)",
            fixed(s.ra_gemv_ms_per_token(), 1),
            c.ra_gemv_jobs,
            fixed(c.ra_gemv_ns as f64 / 1e6 / c.ra_gemv_jobs as f64, 3),
        );
        if s.ra_issue_ms_per_token() > 0.0 || s.ra_wd_ms_per_token() > 0.0 {
            line.push_str(&format!(
                " + {} ms/token issuing the reads + {} ms/token watchdog",
                fixed(s.ra_issue_ms_per_token(), 1),
                fixed(s.ra_wd_ms_per_token(), 1)
            ));
        }
        out.push(line);
    }
    out
}

fn predictor_pct(p: &PredictorStats) -> String {
    if p.rows == 0 {
        format!("{:>6}", "-")
    } else {
        format!("{:>6}", fixed(100.0 * p.hit_frac(), 1))
    }
}

/// The `moe-predict:` lines and per-layer table for `--predict-log`. A predictor with no
/// routings at a layer prints `-`, never `0.0`.
pub fn predict_lines(cfg: &RunConfig, s: &RunSummary) -> Vec<String> {
    let Some(p) = s
        .counters
        .predict
        .as_ref()
        .filter(|_| cfg.moe_stream && cfg.predict_log)
    else {
        return Vec::new();
    };
    predict_report_lines(p)
}

fn predict_report_lines(p: &PredictReport) -> Vec<String> {
    let f = |x: f64| fixed(100.0 * x, 1);
    let mut out = vec![format!(
        "moe-predict: stale-gate {}% of routed slots ({}% whole routings) | prev-token {}% ({}%) | fresh-gate control {}% ({}%)",
        f(p.stale.hit_frac()),
        f(p.stale.exact_frac()),
        f(p.prev.hit_frac()),
        f(p.prev.exact_frac()),
        f(p.ctrl.hit_frac()),
        f(p.ctrl.exact_frac())
    )];
    if p.stale2.rows > 0 {
        out.push(format!(
            "moe-predict: stale-2 (two layers early) {}% of routed slots ({}% whole routings)",
            f(p.stale2.hit_frac()),
            f(p.stale2.exact_frac())
        ));
    }
    out.push(format!(
        "moe-predict: scored — stale-gate {} routings/{} slots, prev-token {}/{}, control {}/{}; {} routings the stale-gate could not rank",
        p.stale.rows, p.stale.slots, p.prev.rows, p.prev.slots, p.ctrl.rows, p.ctrl.slots, p.unscored
    ));
    if p.ctrl.rows > 0 && p.ctrl.hit_frac() < 0.999 {
        out.push(
            "moe-predict: the control is below 100%, so this model's expert selection is not raw-logit\n             \
             ranking (an added selection bias, or group-limited routing). The stale-gate\n             \
             figure understates the method by about the control's own gap."
                .to_string(),
        );
    }
    if !p.by_layer.is_empty() {
        out.push("  layer   stale    prev   ctrl   routings".to_string());
        for (layer, [stale, prev, ctrl]) in p.by_layer.iter().enumerate() {
            if stale.rows == 0 && prev.rows == 0 && ctrl.rows == 0 {
                continue;
            }
            out.push(format!(
                "  {layer:>5}  {}  {} {}     {:>6}",
                predictor_pct(stale),
                predictor_pct(prev),
                predictor_pct(ctrl),
                stale.rows
            ));
        }
    }
    out
}

/// Writes the whole end-of-run report: the banners and answer (progress mode only), then every
/// line that applies, in the contract's order.
pub fn write_report(
    w: &mut dyn Write,
    cfg: &RunConfig,
    s: &RunSummary,
    ctx: &ReportContext<'_>,
) -> io::Result<()> {
    if ctx.progress {
        writeln!(w, "=== answer ===")?;
        writeln!(w, "{}", ctx.answer)?;
        writeln!(w, "=== perf ===")?;
    }
    let mut lines = vec![generation_line(s)];
    lines.extend(interrupted_line(s));
    lines.extend(prompt_line(s));
    lines.extend(load_line(s));
    lines.extend(compute_line(cfg, s));
    lines.extend(speculation_lines(cfg, s));
    lines.push(mode_line(cfg, ctx.arch_streamable));
    lines.extend(stream_lines(cfg, s));
    lines.extend(cache_lines(cfg, s));
    lines.extend(prefetch_line(cfg, s));
    lines.extend(drop_line(cfg, s));
    lines.extend(substitute_line(cfg, s));
    lines.extend(route_ahead_lines(cfg, s));
    lines.extend(predict_lines(cfg, s));
    for line in lines {
        writeln!(w, "{line}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_and_load_lines_say_what_the_prefill_and_the_load_took() {
        let mut s = RunSummary::default();
        assert_eq!((prompt_line(&s), load_line(&s)), (None, None));
        s.counters.n_prompt = 30;
        s.counters.prefill_s = 0.25;
        s.counters.load_s = 1.234;
        assert_eq!(
            prompt_line(&s).as_deref(),
            Some("prompt: 30 tokens in 0.250 s (120.0 tok/s)")
        );
        s.counters.n_reused = 12;
        assert_eq!(
            prompt_line(&s).as_deref(),
            Some("prompt: 30 tokens in 0.250 s (120.0 tok/s), 12 reused from the KV")
        );
        assert_eq!(load_line(&s).as_deref(), Some("load: 1.23 s"));
    }

    #[test]
    fn speculation_lines_are_named_after_the_source_that_drafted() {
        use super::super::summary::SpecSources;
        let mut s = RunSummary::default();
        s.totals.tokens = 40;
        s.counters.mtp_decodes = 20;
        s.counters.mtp_drafted = 30;
        s.counters.mtp_accepted = 20;
        s.counters.drafted_steps = 15;
        let cfg = RunConfig::default();
        // No source recorded and no flag: a run that never speculated.
        assert!(speculation_lines(&cfg, &s).is_empty());
        // A session opened without --ngram whose requests asked for it.
        s.counters.spec_sources = SpecSources {
            ngram: true,
            mtp: false,
        };
        let l = speculation_lines(&cfg, &s);
        assert!(l[0].starts_with("ngram: 20/30 drafts accepted"), "{l:?}");
        assert!(
            l[2].starts_with("ngram: drafted on 15 of 20 steps"),
            "{l:?}"
        );
        // A --mtp session one of whose requests drafted by prompt lookup.
        let cfg = RunConfig {
            spec: SpecMode::Mtp,
            ..RunConfig::default()
        };
        s.counters.spec_sources.mtp = true;
        let l = speculation_lines(&cfg, &s);
        assert!(l[0].starts_with("mtp+ngram: "), "{l:?}");
        assert_eq!(l.len(), 2, "{l:?}");
        // A replay whose counters name no source takes the configuration's.
        s.counters.spec_sources = SpecSources::default();
        assert!(speculation_lines(&cfg, &s)[0].starts_with("mtp: "));
    }

    #[test]
    fn mode_line_variants() {
        let mut cfg = RunConfig {
            arch: "qwen3moe".to_string(),
            ..RunConfig::default()
        };
        assert!(mode_line(&cfg, true).contains("add --moe-stream"));
        assert_eq!(
            mode_line(&cfg, false),
            "mode: mmap (qwen3moe is not a MoE architecture this build streams; --list-archs lists the supported ones)"
        );
        cfg.moe_stream = true;
        cfg.cache_auto = true;
        assert_eq!(
            mode_line(&cfg, true),
            "mode: expert streaming, cache auto, dense anon"
        );
        cfg.cache_room_from = Some(crate::config::MemSource::MemAvailable);
        assert_eq!(
            mode_line(&cfg, true),
            "mode: expert streaming, cache auto (room: MemAvailable), dense anon"
        );
        cfg.cache_room_from = None;
        cfg.cache_auto = false;
        cfg.cache_mb = 3000;
        cfg.overlap = true;
        assert_eq!(
            mode_line(&cfg, true),
            "mode: expert streaming, cache 3000 MiB, dense anon, overlap"
        );
        cfg.o_direct_refused = Some("O_DIRECT refused: open refused: EINVAL".into());
        assert_eq!(
            mode_line(&cfg, true),
            "mode: expert streaming, cache 3000 MiB, dense anon, overlap, buffered reads \
             (O_DIRECT refused: open refused: EINVAL)"
        );
        cfg.o_direct_refused = None;
        cfg.cache_mb = 0;
        cfg.overlap = false;
        cfg.dense_weights = crate::config::DenseWeights::Mmap;
        assert_eq!(
            mode_line(&cfg, true),
            "mode: expert streaming, cache off, dense mmap"
        );
    }

    #[test]
    fn a_mode_the_engine_chose_says_why() {
        use crate::config::{decide_streaming, StreamChoice};
        const GIB: u64 = 1 << 30;
        let mut cfg = RunConfig {
            arch: "qwen3moe".to_string(),
            stream_choice: StreamChoice::Auto,
            ..RunConfig::default()
        };
        let too_big = decide_streaming(
            17 * GIB,
            GIB / 2,
            3 * GIB / 2,
            Some(20 * GIB),
            Some(8 * GIB),
        );
        cfg.resolve_streaming(too_big, false).unwrap();
        assert_eq!(
            mode_line(&cfg, true),
            "mode: expert streaming, cache auto, dense anon, overlap (streaming because the model \
             needs 19.00 GiB (file 17.00 GiB + KV cache 512 MiB + 1.50 GiB kept free, \
             --cache-floor-mb) and this process may use 8.00 GiB (its cgroup's memory limit); \
             --no-moe-stream forces the resident run)"
        );
        let mut cfg = RunConfig {
            arch: "qwen3moe".to_string(),
            stream_choice: StreamChoice::Auto,
            ..RunConfig::default()
        };
        let fits = decide_streaming(GIB, 0, 0, Some(20 * GIB), None);
        cfg.resolve_streaming(fits, false).unwrap();
        let line = mode_line(&cfg, true);
        assert!(
            line.starts_with("mode: mmap, experts resident because the model needs 1.00 GiB"),
            "{line}"
        );
        assert!(
            line.ends_with("(MemAvailable); --moe-stream streams them anyway."),
            "{line}"
        );
    }

    #[test]
    fn no_cache_no_cache_lines() {
        let cfg = RunConfig {
            moe_stream: true,
            ..RunConfig::default()
        };
        let s = RunSummary::default();
        assert!(
            cache_lines(&cfg, &s).is_empty(),
            "hit rate -1 means no cache"
        );
        assert!(
            compute_line(&cfg, &s).is_none(),
            "unmeasured CPU omits the line"
        );
    }
}
