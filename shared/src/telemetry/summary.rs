//! What one generation cost, accumulated: the per-token sums the telemetry collects from the
//! `TokenRecord`s it writes, plus the cumulative counters the decode step, the cache and the
//! router hook hand over at the end. Every end-of-run output — the CSV `# summary` trailer,
//! `BMOE_DONE`, the report lines — is a function of this one struct, so they cannot disagree.

use super::csv::TokenRecord;
use super::fmt::mib;
pub use crate::vocab::{PredictReport, PredictorStats};

/// Sums over the generation's `TokenRecord`s (one per generated token).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenTotals {
    /// Rows seen: generated tokens.
    pub tokens: u64,
    // The rest are sums of the `TokenRecord` columns of the same name.
    pub wall_ms: f64,
    pub io_ms: f64,
    pub compute_ms: f64,
    pub stall_ms: f64,
    pub mgmt_ms: f64,
    pub read_bytes: u64,
    pub majflt: u64,
    pub cpu_ms: f64,
    pub loop_overhead_ms: f64,
    pub mtp_draft_ms: f64,
    pub drain_ms: f64,
    pub adopt_ms: f64,
    pub ra_issue_ms: f64,
    pub ra_wd_ms: f64,
    /// The last row's cumulative hit rate (-1 = no cache), used when the counters carry none.
    pub last_cache_hit_pct: f64,
}

impl TokenTotals {
    /// Adds one token's row.
    pub fn add(&mut self, r: &TokenRecord) {
        self.tokens += 1;
        self.wall_ms += r.wall_ms;
        self.io_ms += r.io_ms;
        self.compute_ms += r.compute_ms;
        self.stall_ms += r.stall_ms;
        self.mgmt_ms += r.mgmt_ms;
        self.read_bytes += r.read_bytes;
        self.majflt += r.majflt;
        self.cpu_ms += r.cpu_ms;
        self.loop_overhead_ms += r.loop_overhead_ms;
        self.mtp_draft_ms += r.mtp_draft_ms;
        self.drain_ms += r.drain_ms;
        self.adopt_ms += r.adopt_ms;
        self.ra_issue_ms += r.ra_issue_ms;
        self.ra_wd_ms += r.ra_wd_ms;
        self.last_cache_hit_pct = r.cache_hit_pct;
    }

    /// Adds another generation's sums (a session's turns). The last hit rate is the later
    /// generation's when it had tokens.
    pub fn merge(&mut self, t: &TokenTotals) {
        self.tokens += t.tokens;
        self.wall_ms += t.wall_ms;
        self.io_ms += t.io_ms;
        self.compute_ms += t.compute_ms;
        self.stall_ms += t.stall_ms;
        self.mgmt_ms += t.mgmt_ms;
        self.read_bytes += t.read_bytes;
        self.majflt += t.majflt;
        self.cpu_ms += t.cpu_ms;
        self.loop_overhead_ms += t.loop_overhead_ms;
        self.mtp_draft_ms += t.mtp_draft_ms;
        self.drain_ms += t.drain_ms;
        self.adopt_ms += t.adopt_ms;
        self.ra_issue_ms += t.ra_issue_ms;
        self.ra_wd_ms += t.ra_wd_ms;
        if t.tokens > 0 {
            self.last_cache_hit_pct = t.last_cache_hit_pct;
        }
    }
}

/// The prompt phase's own attribution (the `prefill_*` keys), deltas of the same cumulative
/// counters the decode columns come from, taken across this turn's prefill.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrefillCounters {
    /// Process CPU time over the prefill window (an upper bound on compute-thread CPU).
    pub cpu_s: f64,
    pub read_bytes: u64,
    /// Read time: blocked wall time in serial, summed lane busy time under overlap.
    pub io_s: f64,
    /// Union of stalled intervals (overlap).
    pub stall_s: f64,
    pub mgmt_s: f64,
}

/// The draft sources a generation's speculative decodes used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecSources {
    /// Prompt lookup (`--ngram`, or a request's `"ngram": true`).
    pub ngram: bool,
    /// The model's MTP head (`--mtp`).
    pub mtp: bool,
}

impl SpecSources {
    /// The name the summary lines take: the one source used, `mtp+ngram` for a session whose
    /// requests used both, `None` for none.
    pub fn name(self) -> Option<&'static str> {
        match (self.mtp, self.ngram) {
            (true, true) => Some("mtp+ngram"),
            (true, false) => Some("mtp"),
            (false, true) => Some("ngram"),
            (false, false) => None,
        }
    }
}

/// Cumulative counters of one generation, handed over by the decode step (cache, streamer,
/// router hook, speculation) and the engine's probes when the generation ends. Fields a run did
/// not exercise stay at their defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct RunCounters {
    /// Tokens prefilled this turn (after any reused KV prefix).
    pub n_prompt: u64,
    /// Context length after the turn.
    pub n_past: u64,
    /// Context the KV already held when the turn's prompt began (reused, not prefilled).
    pub n_reused: u64,
    /// Model load time (s).
    pub load_s: f64,
    /// Prompt prefill wall time (s).
    pub prefill_s: f64,
    /// Cumulative cache hit rate at the end, -1 = no cache. NaN means "take the last row's".
    pub cache_hit_pct: f64,
    pub cache_resident_bytes: u64,
    pub cache_budget_bytes: u64,
    /// Budget changes between generations (`set_cache_budget`).
    pub cache_resizes: u64,
    /// Cache lookups that hit and missed (prefill included). Not printed: `cache_hit_pct` is
    /// their ratio; here for a gate that holds two runs to the same counts exactly.
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Reads of an entry the cache had already held once.
    pub rereads: u64,
    /// Misses the policy's admission filter bypassed (read, computed, never cached).
    pub bypasses: u64,
    /// The policy filters admission (`EvictionPolicy::filters_admission`): the reports carry
    /// `bypasses` only then, so every other run's output reads as before the key existed.
    pub admission_filter: bool,
    /// Flash bytes read speculatively (a subset of the total).
    pub spec_read_bytes: u64,
    /// Experts fully read ahead.
    pub spec_experts: u64,
    /// Of those, how many a later routing hit.
    pub spec_useful: u64,
    /// Mean routed expert bytes per decode token (measured).
    pub token_demand_bytes: f64,
    /// The widest layer's routed bytes: the mechanical floor.
    pub layer_demand_bytes: u64,
    pub experts_routed: u64,
    pub experts_dropped: u64,
    /// Slots the substitution re-ranking examined.
    pub experts_reranked: u64,
    /// Slots it moved to a resident expert.
    pub experts_substituted: u64,
    /// Decode routings whose selection route-ahead replaced.
    pub ra_committed: u64,
    /// Eligible routings that had no prediction to commit.
    pub ra_passthrough: u64,
    /// Committed slots, and those that agreed with the router.
    pub ra_slots: u64,
    pub ra_agreed_slots: u64,
    /// Route-ahead prediction CPU (worker side) and its job count.
    pub ra_gemv_ns: u64,
    pub ra_gemv_jobs: u64,
    pub mtp_drafted: u64,
    pub mtp_accepted: u64,
    pub mtp_decodes: u64,
    pub drafted_steps: u64,
    /// Which draft sources the turns' speculation used (a session's requests may each choose
    /// one): what the `mtp:` / `ngram:` lines are named after.
    pub spec_sources: SpecSources,
    pub prefill: PrefillCounters,
    /// Between-decode time after the last token, which no row can carry (ms).
    pub loop_overhead_tail_ms: f64,
    /// Failed flash reads: any non-zero count makes the output untrustworthy.
    pub io_errors: u64,
    /// `--predict-log` results.
    pub predict: Option<PredictReport>,
    /// The generation was stopped at a token boundary before its end (SIGINT/SIGTERM, or a
    /// session `cancel`): its rows are whole and its figures cover the tokens it generated.
    pub interrupted: bool,
}

impl Default for RunCounters {
    fn default() -> Self {
        RunCounters {
            n_prompt: 0,
            n_past: 0,
            n_reused: 0,
            load_s: 0.0,
            prefill_s: 0.0,
            cache_hit_pct: f64::NAN,
            cache_resident_bytes: 0,
            cache_budget_bytes: 0,
            cache_resizes: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
            rereads: 0,
            bypasses: 0,
            admission_filter: false,
            spec_read_bytes: 0,
            spec_experts: 0,
            spec_useful: 0,
            token_demand_bytes: 0.0,
            layer_demand_bytes: 0,
            experts_routed: 0,
            experts_dropped: 0,
            experts_reranked: 0,
            experts_substituted: 0,
            ra_committed: 0,
            ra_passthrough: 0,
            ra_slots: 0,
            ra_agreed_slots: 0,
            ra_gemv_ns: 0,
            ra_gemv_jobs: 0,
            mtp_drafted: 0,
            mtp_accepted: 0,
            mtp_decodes: 0,
            drafted_steps: 0,
            spec_sources: SpecSources::default(),
            prefill: PrefillCounters::default(),
            loop_overhead_tail_ms: 0.0,
            io_errors: 0,
            predict: None,
            interrupted: false,
        }
    }
}

impl RunCounters {
    /// Adds one turn's counters to a session's: counts add; the token demand is the
    /// token-weighted mean (`tokens_before` tokens so far, `tokens` in this turn); the layer
    /// demand is the widest; the cache's state and the context length are the latest turn's.
    /// The load time and the session-wide hit rate are the session's, not a sum: its owner sets
    /// them.
    pub fn merge_turn(&mut self, c: &RunCounters, tokens_before: u64, tokens: u64) {
        if tokens_before == 0 {
            self.token_demand_bytes = c.token_demand_bytes;
        } else if tokens > 0 {
            let total = (tokens_before + tokens) as f64;
            self.token_demand_bytes = (self.token_demand_bytes * tokens_before as f64
                + c.token_demand_bytes * tokens as f64)
                / total;
        }
        self.n_prompt += c.n_prompt;
        self.n_past = c.n_past;
        self.n_reused += c.n_reused;
        self.prefill_s += c.prefill_s;
        self.cache_resident_bytes = c.cache_resident_bytes;
        self.cache_budget_bytes = c.cache_budget_bytes;
        self.cache_resizes += c.cache_resizes;
        self.hits += c.hits;
        self.misses += c.misses;
        self.evictions += c.evictions;
        self.rereads += c.rereads;
        self.bypasses += c.bypasses;
        self.admission_filter |= c.admission_filter;
        self.spec_read_bytes += c.spec_read_bytes;
        self.spec_experts += c.spec_experts;
        self.spec_useful += c.spec_useful;
        self.experts_reranked += c.experts_reranked;
        self.experts_substituted += c.experts_substituted;
        self.layer_demand_bytes = self.layer_demand_bytes.max(c.layer_demand_bytes);
        self.experts_routed += c.experts_routed;
        self.experts_dropped += c.experts_dropped;
        self.ra_committed += c.ra_committed;
        self.ra_passthrough += c.ra_passthrough;
        self.ra_slots += c.ra_slots;
        self.ra_agreed_slots += c.ra_agreed_slots;
        self.ra_gemv_ns += c.ra_gemv_ns;
        self.ra_gemv_jobs += c.ra_gemv_jobs;
        self.mtp_drafted += c.mtp_drafted;
        self.mtp_accepted += c.mtp_accepted;
        self.mtp_decodes += c.mtp_decodes;
        self.drafted_steps += c.drafted_steps;
        self.spec_sources.ngram |= c.spec_sources.ngram;
        self.spec_sources.mtp |= c.spec_sources.mtp;
        self.prefill.cpu_s += c.prefill.cpu_s;
        self.prefill.read_bytes += c.prefill.read_bytes;
        self.prefill.io_s += c.prefill.io_s;
        self.prefill.stall_s += c.prefill.stall_s;
        self.prefill.mgmt_s += c.prefill.mgmt_s;
        self.loop_overhead_tail_ms += c.loop_overhead_tail_ms;
        self.io_errors += c.io_errors;
        if let Some(p) = &c.predict {
            self.predict
                .get_or_insert_with(PredictReport::default)
                .merge(p);
        }
        self.interrupted |= c.interrupted;
    }
}

/// One generation's summary: token sums plus counters, and every derived figure the outputs
/// print. Per-token figures divide by `tokens` (0 when there were none).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunSummary {
    pub totals: TokenTotals,
    pub counters: RunCounters,
}

impl RunSummary {
    /// Adds one turn's summary to a session's (see `RunCounters::merge_turn`).
    pub fn merge_turn(&mut self, turn: &RunSummary) {
        let before = self.totals.tokens;
        self.totals.merge(&turn.totals);
        self.counters
            .merge_turn(&turn.counters, before, turn.totals.tokens);
    }

    /// Generated tokens.
    pub fn tokens(&self) -> u64 {
        self.totals.tokens
    }

    fn per_token(&self, total: f64) -> f64 {
        if self.totals.tokens == 0 {
            0.0
        } else {
            total / self.totals.tokens as f64
        }
    }

    /// Decode wall seconds (Σ `wall_ms`; between-decode time excluded).
    pub fn gen_s(&self) -> f64 {
        self.totals.wall_ms / 1e3
    }
    /// Mean decode seconds per token.
    pub fn s_per_token(&self) -> f64 {
        self.per_token(self.gen_s())
    }
    /// Tokens per decode second (0 with no time).
    pub fn tokens_per_s(&self) -> f64 {
        let s = self.gen_s();
        if s > 0.0 {
            self.totals.tokens as f64 / s
        } else {
            0.0
        }
    }
    /// Decode flash bytes in MiB.
    pub fn read_mib(&self) -> f64 {
        mib(self.totals.read_bytes)
    }
    /// Σ `io_ms` in seconds.
    pub fn io_s(&self) -> f64 {
        self.totals.io_ms / 1e3
    }
    /// Mean compute residual per token (s).
    pub fn compute_s_per_token(&self) -> f64 {
        self.per_token(self.totals.compute_ms / 1e3)
    }
    /// Mean read time per token (s): blocked time in serial, lane busy time under overlap.
    pub fn io_s_per_token(&self) -> f64 {
        self.per_token(self.io_s())
    }
    /// Mean overlap stall per token (s); 0 in serial.
    pub fn stall_s_per_token(&self) -> f64 {
        self.per_token(self.totals.stall_ms / 1e3)
    }
    /// Mean cache-management time per token (s).
    pub fn mgmt_s_per_token(&self) -> f64 {
        self.per_token(self.totals.mgmt_ms / 1e3)
    }
    /// Mean major page faults per token.
    pub fn majflt_per_token(&self) -> f64 {
        self.per_token(self.totals.majflt as f64)
    }
    /// Mean process CPU time per token (s), all threads.
    pub fn cpu_s_per_token(&self) -> f64 {
        self.per_token(self.totals.cpu_ms / 1e3)
    }
    /// Between-decode time per token, the tail after the last token included.
    pub fn loop_overhead_s_per_token(&self) -> f64 {
        self.per_token((self.totals.loop_overhead_ms + self.counters.loop_overhead_tail_ms) / 1e3)
    }
    /// Mean drafting time per token (s), outside the decode.
    pub fn mtp_draft_s_per_token(&self) -> f64 {
        self.per_token(self.totals.mtp_draft_ms / 1e3)
    }
    /// Mean overlap drain wait per token (s), part of compute.
    pub fn drain_s_per_token(&self) -> f64 {
        self.per_token(self.totals.drain_ms / 1e3)
    }
    /// Mean route-ahead adoption wait per token (s), part of mgmt.
    pub fn adopt_s_per_token(&self) -> f64 {
        self.per_token(self.totals.adopt_ms / 1e3)
    }
    /// Mean route-ahead read-issue time per token (ms).
    pub fn ra_issue_ms_per_token(&self) -> f64 {
        self.per_token(self.totals.ra_issue_ms)
    }
    /// Mean route-ahead watchdog time per token (ms).
    pub fn ra_wd_ms_per_token(&self) -> f64 {
        self.per_token(self.totals.ra_wd_ms)
    }
    /// Mean route-ahead prediction CPU per token (ms, worker side).
    pub fn ra_gemv_ms_per_token(&self) -> f64 {
        self.per_token(self.counters.ra_gemv_ns as f64 / 1e6)
    }
    /// Route-ahead agreement with the router, % of committed slots.
    pub fn ra_agree_pct(&self) -> f64 {
        super::fmt::pct(self.counters.ra_agreed_slots, self.counters.ra_slots)
    }
    /// Effective flash bandwidth over the decode reads, MiB/s (0 without read time).
    pub fn read_mib_per_s(&self) -> f64 {
        let s = self.io_s();
        if s > 0.0 {
            self.read_mib() / s
        } else {
            0.0
        }
    }
    /// The final cumulative hit rate: the counters', or the last row's when they carry none.
    pub fn cache_hit_pct(&self) -> f64 {
        if self.counters.cache_hit_pct.is_nan() {
            if self.totals.tokens == 0 {
                -1.0
            } else {
                self.totals.last_cache_hit_pct
            }
        } else {
            self.counters.cache_hit_pct
        }
    }
    /// Prompt tokens per prefill second.
    pub fn prefill_tps(&self) -> f64 {
        if self.counters.prefill_s > 0.0 {
            self.counters.n_prompt as f64 / self.counters.prefill_s
        } else {
            0.0
        }
    }
    /// Cache bytes resident at the end, MiB.
    pub fn cache_resident_mib(&self) -> f64 {
        mib(self.counters.cache_resident_bytes)
    }
    /// Cache budget in effect, MiB.
    pub fn cache_budget_mib(&self) -> f64 {
        mib(self.counters.cache_budget_bytes)
    }
    /// Speculatively read bytes, MiB.
    pub fn spec_read_mib(&self) -> f64 {
        mib(self.counters.spec_read_bytes)
    }
    /// Mean routed expert bytes per decode token, MiB.
    pub fn token_demand_mib(&self) -> f64 {
        self.counters.token_demand_bytes / (1u64 << 20) as f64
    }
    /// The widest layer's routed bytes, MiB.
    pub fn layer_demand_mib(&self) -> f64 {
        mib(self.counters.layer_demand_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_token_figures() {
        let mut t = TokenTotals::default();
        for wall in [100.0, 300.0] {
            t.add(&TokenRecord {
                wall_ms: wall,
                io_ms: 50.0,
                read_bytes: 1 << 20,
                cpu_ms: 400.0,
                majflt: 3,
                cache_hit_pct: 75.0,
                ..TokenRecord::default()
            });
        }
        let s = RunSummary {
            totals: t,
            counters: RunCounters {
                loop_overhead_tail_ms: 10.0,
                ..RunCounters::default()
            },
        };
        assert_eq!(s.tokens(), 2);
        assert!((s.s_per_token() - 0.2).abs() < 1e-12);
        assert!((s.tokens_per_s() - 5.0).abs() < 1e-12);
        assert!((s.io_s_per_token() - 0.05).abs() < 1e-12);
        assert!((s.read_mib_per_s() - 20.0).abs() < 1e-9);
        assert!((s.majflt_per_token() - 3.0).abs() < 1e-12);
        assert!((s.loop_overhead_s_per_token() - 0.005).abs() < 1e-12);
        assert_eq!(s.cache_hit_pct(), 75.0, "falls back to the last row");
        assert_eq!(RunSummary::default().cache_hit_pct(), -1.0);
        assert_eq!(RunSummary::default().s_per_token(), 0.0);
    }

    fn stats(n: u64) -> PredictorStats {
        PredictorStats {
            rows: n,
            slots: 2 * n,
            hit_slots: n,
            exact_rows: n,
        }
    }

    #[test]
    fn turns_add_their_predictor_counters() {
        let turn = RunCounters {
            ra_committed: 3,
            ra_passthrough: 1,
            ra_slots: 12,
            ra_agreed_slots: 10,
            ra_gemv_ns: 7,
            ra_gemv_jobs: 3,
            predict: Some(PredictReport {
                stale: stats(4),
                stale2: stats(2),
                prev: stats(4),
                ctrl: stats(6),
                unscored: 5,
                by_layer: vec![[stats(1), stats(2), stats(3)]],
            }),
            ..RunCounters::default()
        };
        let mut whole = RunCounters::default();
        whole.merge_turn(&turn, 0, 10);
        whole.merge_turn(&turn, 10, 10);
        assert_eq!(
            (
                whole.ra_committed,
                whole.ra_passthrough,
                whole.ra_slots,
                whole.ra_agreed_slots,
                whole.ra_gemv_ns,
                whole.ra_gemv_jobs
            ),
            (6, 2, 24, 20, 14, 6)
        );
        let p = whole.predict.expect("probe");
        assert_eq!(p.stale, stats(8));
        assert_eq!(p.stale2, stats(4));
        assert_eq!(p.ctrl, stats(12));
        assert_eq!(p.unscored, 10);
        assert_eq!(p.by_layer, vec![[stats(2), stats(4), stats(6)]]);
        let mut none = RunCounters::default();
        none.merge_turn(&RunCounters::default(), 0, 1);
        assert_eq!(none.predict, None, "no probe, no report");
    }

    #[test]
    fn one_turn_merged_is_that_turn() {
        let mut t = TokenTotals::default();
        t.add(&TokenRecord {
            wall_ms: 0.1,
            cache_hit_pct: 42.0,
            ..TokenRecord::default()
        });
        let turn = RunSummary {
            totals: t.clone(),
            counters: RunCounters {
                token_demand_bytes: 1_234.567_891,
                n_prompt: 7,
                n_past: 9,
                layer_demand_bytes: 5,
                interrupted: true,
                ..RunCounters::default()
            },
        };
        let mut whole = RunSummary::default();
        whole.merge_turn(&turn);
        assert_eq!(whole.totals, turn.totals);
        assert_eq!(
            whole.counters.token_demand_bytes,
            turn.counters.token_demand_bytes
        );
        assert_eq!((whole.counters.n_prompt, whole.counters.n_past), (7, 9));
        assert!(whole.counters.interrupted);
        // A second, token-less turn leaves the mean where it was.
        whole.merge_turn(&RunSummary::default());
        assert_eq!(
            whole.counters.token_demand_bytes,
            turn.counters.token_demand_bytes
        );
    }
}
