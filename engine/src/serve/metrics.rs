//! `GET /metrics`: the server's counters in the Prometheus text exposition format (0.0.4).
//! Request counts by endpoint and status, the tokens the turns prompted, reused, prefilled and
//! generated, cancels (and how many tokens ran past the moment the server learned the client was
//! gone), and the session's engine figures from its merged summary: tok/s, cache hit rate,
//! flash MiB read, stall time.

use bmoe_core::telemetry::summary::RunSummary;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

#[derive(Default)]
struct Counters {
    requests: BTreeMap<(&'static str, u16), u64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
    turns: u64,
    cancelled: u64,
    skipped: u64,
    overrun_last: u64,
    overrun_max: u64,
    rejected_busy: u64,
    batch_steps: u64,
    batch_rows: u64,
    batch_read_bytes: u64,
    batch_routed_bytes: u64,
    batch_routings: u64,
    engine: Option<RunSummary>,
}

/// The server's counters, shared by the HTTP side and the engine thread.
#[derive(Default)]
pub struct Metrics {
    c: Mutex<Counters>,
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Counters) -> R) -> R {
        f(&mut self.c.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// One answered request.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        self.with(|c| *c.requests.entry((endpoint, status)).or_default() += 1);
    }
    /// A request turned away because the queue was full.
    pub fn rejected_busy(&self) {
        self.with(|c| c.rejected_busy += 1);
    }
    /// A queued request whose client left before it started.
    pub fn skipped(&self) {
        self.with(|c| c.skipped += 1);
    }
    /// A turn ran: its tokens, and the session's summary after it.
    /// (`None` where lanes decoded it together: there is no one session's summary.)
    pub fn turn(&self, prompt: usize, cached: usize, completion: u32, session: Option<RunSummary>) {
        self.with(|c| {
            c.turns += 1;
            c.prompt_tokens += prompt as u64;
            c.cached_tokens += cached as u64;
            c.completion_tokens += u64::from(completion);
            if session.is_some() {
                c.engine = session;
            }
        });
    }
    /// `--parallel`: shared decode steps run, the rows (running requests) they held, the
    /// bytes they read from flash, their routed experts' bytes (each distinct expert of a
    /// layer once) and their routings (row × rank).
    pub fn batch(&self, steps: u64, rows: u64, read: u64, routed: u64, routings: u64) {
        self.with(|c| {
            c.batch_steps += steps;
            c.batch_rows += rows;
            c.batch_read_bytes += read;
            c.batch_routed_bytes += routed;
            c.batch_routings += routings;
        });
    }
    /// A turn cancelled because its client left; `overrun`: tokens generated after the server
    /// learned it.
    pub fn cancelled(&self, overrun: Option<u64>) {
        self.with(|c| {
            c.cancelled += 1;
            if let Some(o) = overrun {
                c.overrun_last = o;
                c.overrun_max = c.overrun_max.max(o);
            }
        });
    }

    /// The text exposition. `queued`: requests waiting or running; `ready`: the model loaded.
    pub fn render(&self, queued: usize, ready: bool) -> String {
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
            let _ = writeln!(s, "# HELP {name} {help}");
            let _ = writeln!(s, "# TYPE {name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(s, "{name}{labels} {}", fmt(*v));
            }
        };
        self.with(|c| {
            let one = |v: f64| vec![(String::new(), v)];
            metric(
                "bmoe_ready",
                "gauge",
                "1 once the model is loaded and requests are served",
                &one(f64::from(u8::from(ready))),
            );
            metric(
                "bmoe_requests_in_flight",
                "gauge",
                "Generation requests running or waiting in the queue",
                &one(queued as f64),
            );
            let reqs: Vec<(String, f64)> = c
                .requests
                .iter()
                .map(|((e, st), n)| (format!("{{endpoint=\"{e}\",status=\"{st}\"}}"), *n as f64))
                .collect();
            metric(
                "bmoe_requests_total",
                "counter",
                "HTTP requests answered, by endpoint and status code",
                &reqs,
            );
            metric(
                "bmoe_requests_rejected_busy_total",
                "counter",
                "Requests answered 503 because the queue was full",
                &one(c.rejected_busy as f64),
            );
            metric(
                "bmoe_batch_steps_total",
                "counter",
                "--parallel: decode steps shared by the running requests",
                &one(c.batch_steps as f64),
            );
            metric(
                "bmoe_batch_rows_total",
                "counter",
                "--parallel: rows of those steps (one per running request); rows/steps is the mean batch",
                &one(c.batch_rows as f64),
            );
            metric(
                "bmoe_batch_read_bytes_total",
                "counter",
                "--parallel: bytes those steps read from flash",
                &one(c.batch_read_bytes as f64),
            );
            metric(
                "bmoe_batch_routed_bytes_total",
                "counter",
                "--parallel: those steps' routed experts' bytes, each distinct expert of a layer once (the union the rows share)",
                &one(c.batch_routed_bytes as f64),
            );
            metric(
                "bmoe_batch_routings_total",
                "counter",
                "--parallel: those steps' routings (row x rank, over every MoE layer)",
                &one(c.batch_routings as f64),
            );
            metric(
                "bmoe_turns_total",
                "counter",
                "Generations run on the engine",
                &one(c.turns as f64),
            );
            metric(
                "bmoe_prompt_tokens_total",
                "counter",
                "Prompt tokens of every turn (reused and prefilled)",
                &one(c.prompt_tokens as f64),
            );
            metric(
                "bmoe_cached_tokens_total",
                "counter",
                "Prompt tokens reused from the KV (not prefilled)",
                &one(c.cached_tokens as f64),
            );
            metric(
                "bmoe_prefilled_tokens_total",
                "counter",
                "Prompt tokens prefilled",
                &one(c.prompt_tokens.saturating_sub(c.cached_tokens) as f64),
            );
            metric(
                "bmoe_completion_tokens_total",
                "counter",
                "Tokens generated",
                &one(c.completion_tokens as f64),
            );
            metric(
                "bmoe_requests_cancelled_total",
                "counter",
                "Generations stopped because their client disconnected",
                &one(c.cancelled as f64),
            );
            metric(
                "bmoe_requests_skipped_total",
                "counter",
                "Queued requests dropped because their client left before they started",
                &one(c.skipped as f64),
            );
            metric(
                "bmoe_cancel_overrun_tokens",
                "gauge",
                "Tokens generated after the server learned the client was gone, last cancel",
                &one(c.overrun_last as f64),
            );
            metric(
                "bmoe_cancel_overrun_tokens_max",
                "gauge",
                "Tokens generated after the server learned the client was gone, worst cancel",
                &one(c.overrun_max as f64),
            );
            let e = c.engine.clone().unwrap_or_default();
            metric(
                "bmoe_decode_tokens_per_second",
                "gauge",
                "Decode rate over every turn so far (the BMOE_DONE tok_s of the whole session)",
                &one(e.tokens_per_s()),
            );
            metric(
                "bmoe_decode_seconds_total",
                "counter",
                "Seconds spent in decode steps",
                &one(e.gen_s()),
            );
            metric(
                "bmoe_cache_hit_ratio",
                "gauge",
                "Expert cache hit rate over the session (-1: no cache)",
                &one(if e.cache_hit_pct() < 0.0 {
                    -1.0
                } else {
                    e.cache_hit_pct() / 100.0
                }),
            );
            metric(
                "bmoe_flash_read_mib_total",
                "counter",
                "MiB of experts read from flash while decoding",
                &one(e.read_mib()),
            );
            metric(
                "bmoe_stall_seconds_total",
                "counter",
                "Seconds the decode waited on flash reads",
                &one(e.stall_s_per_token() * e.tokens() as f64),
            );
            metric(
                "bmoe_prefill_seconds_total",
                "counter",
                "Seconds spent prefilling prompts",
                &one(e.counters.prefill_s),
            );
        });
        s
    }
}

/// A sample value: finite numbers as Rust prints them (a valid Prometheus float).
fn fmt(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else if v.is_nan() {
        "NaN".into()
    } else if v > 0.0 {
        "+Inf".into()
    } else {
        "-Inf".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_has_help_type_and_samples() {
        let m = Metrics::default();
        m.request("/v1/chat/completions", 200);
        m.request("/v1/chat/completions", 200);
        m.request("other", 404);
        m.turn(10, 4, 3, Some(RunSummary::default()));
        m.batch(5, 12, 0, 0, 0);
        m.cancelled(Some(1));
        let t = m.render(2, true);
        assert!(t.contains("# TYPE bmoe_requests_total counter"));
        assert!(
            t.contains("bmoe_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2")
        );
        assert!(t.contains("bmoe_prefilled_tokens_total 6"));
        assert!(t.contains("bmoe_cancel_overrun_tokens_max 1"));
        assert!(t.contains("bmoe_requests_in_flight 2"));
        assert!(t.contains("bmoe_batch_rows_total 12"));
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            let v = line.rsplit(' ').next().unwrap();
            assert!(v.parse::<f64>().is_ok() || v == "NaN", "{line}");
        }
    }
}
