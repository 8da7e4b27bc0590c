//! The generation ledger: turns each step's `StepStats` (and the memory picture the host
//! supplies) into the contract's per-token `TokenRecord`, and the run's cumulative figures
//! into the `RunCounters` the end-of-run report and `BMOE_DONE` are printed from.
//!
//! Written once so the engine and the simulator report identically: a simulated CSV and a
//! measured one differ only in what was measured, never in how it was accounted.

use crate::cache::ExpertCache;
use crate::predict::accumulate;
use crate::step::StepStats;
use crate::telemetry::csv::TokenRecord;
use crate::telemetry::summary::PredictReport;
use crate::telemetry::summary::{PrefillCounters, RunCounters};

const MIB: f64 = 1048576.0;

/// The process memory and CPU picture at the end of a token. The engine fills it from
/// `getrusage`, `/proc` and `mincore`; the simulator leaves the defaults (unmeasured).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct MemPicture {
    /// Cumulative major faults and CPU time of the process (the ledger takes deltas).
    pub majflt_total: u64,
    pub cpu_ms_total: f64,
    /// Sampled dense residency, −1 when unmeasured.
    pub dense_resident_frac: f64,
    pub rss_mib: f64,
    pub rss_anon_mib: f64,
    pub rss_file_mib: f64,
    pub swap_mib: f64,
    pub mem_available_mib: f64,
    pub mem_free_mib: f64,
    pub swap_free_mib: f64,
    /// Bytes per page, to convert faults to MiB.
    pub page_bytes: u64,
}

impl Default for MemPicture {
    fn default() -> Self {
        MemPicture {
            majflt_total: 0,
            cpu_ms_total: 0.0,
            dense_resident_frac: -1.0,
            rss_mib: 0.0,
            rss_anon_mib: 0.0,
            rss_file_mib: 0.0,
            swap_mib: 0.0,
            mem_available_mib: 0.0,
            mem_free_mib: 0.0,
            swap_free_mib: 0.0,
            page_bytes: 4096,
        }
    }
}

/// Per-generation accounting.
#[derive(Clone, Debug)]
pub struct Ledger {
    overlap: bool,
    cache_on: bool,
    cache_budget_bytes: u64,
    turn: u32,
    steps: u32,
    step: u32,
    hits: u64,
    misses: u64,
    evictions: u64,
    rereads: u64,
    bypasses: u64,
    experts_routed: u64,
    experts_dropped: u64,
    experts_reranked: u64,
    experts_substituted: u64,
    decode_routed_bytes: u64,
    decode_tokens: u64,
    io_errors: u64,
    spec_read_bytes: u64,
    spec_experts: u64,
    spec_useful: u64,
    /// `--predict-log`: the probe's results over the decode steps (None until one reported).
    predict: Option<PredictReport>,
    ra_committed: u64,
    ra_passthrough: u64,
    ra_slots: u64,
    ra_agreed_slots: u64,
    ra_gemv_ns: u64,
    ra_gemv_jobs: u64,
    prefill: PrefillCounters,
    last_mem: Option<MemPicture>,
}

impl Ledger {
    /// A ledger for one generation of `steps` tokens.
    pub fn new(overlap: bool, cache_budget_bytes: u64, turn: u32, steps: u32) -> Ledger {
        Ledger {
            overlap,
            cache_on: cache_budget_bytes > 0,
            cache_budget_bytes,
            turn,
            steps,
            step: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
            rereads: 0,
            bypasses: 0,
            experts_routed: 0,
            experts_dropped: 0,
            experts_reranked: 0,
            experts_substituted: 0,
            decode_routed_bytes: 0,
            decode_tokens: 0,
            io_errors: 0,
            spec_read_bytes: 0,
            spec_experts: 0,
            spec_useful: 0,
            predict: None,
            ra_committed: 0,
            ra_passthrough: 0,
            ra_slots: 0,
            ra_agreed_slots: 0,
            ra_gemv_ns: 0,
            ra_gemv_jobs: 0,
            prefill: PrefillCounters::default(),
            last_mem: None,
        }
    }

    fn add_cache(&mut self, s: &StepStats) {
        self.hits += s.hits;
        self.misses += s.misses;
        self.evictions += s.evictions;
        self.rereads += s.rereads;
        self.bypasses += s.bypasses;
        self.spec_read_bytes += s.spec_read_bytes;
        self.spec_experts += s.spec_experts;
        self.spec_useful += s.spec_useful;
        if let Some(p) = &s.predict {
            accumulate(self.predict.get_or_insert_with(PredictReport::default), p);
        }
        self.ra_committed += s.ra_committed;
        self.ra_passthrough += s.ra_passthrough;
        self.ra_slots += s.ra_slots;
        self.ra_agreed_slots += s.ra_agreed_slots;
        self.ra_gemv_ns += s.ra_gemv_ns;
        self.ra_gemv_jobs += s.ra_gemv_jobs;
    }

    /// Account the prompt's step. `mem_before`/`mem_after` bracket it for its CPU time.
    pub fn prefill(&mut self, s: &StepStats, mem_before: &MemPicture, mem_after: &MemPicture) {
        self.add_cache(s);
        self.prefill.cpu_s += (mem_after.cpu_ms_total - mem_before.cpu_ms_total).max(0.0) / 1000.0;
        self.prefill.read_bytes += s.read_bytes;
        self.prefill.io_s += s.io.as_secs_f64();
        self.prefill.stall_s += s.stall.as_secs_f64();
        self.prefill.mgmt_s += s.mgmt.as_secs_f64();
        self.last_mem = Some(*mem_after);
    }

    /// Cumulative hit rate in percent, −1 with the cache off.
    pub fn cache_hit_pct(&self) -> f64 {
        if !self.cache_on {
            return -1.0;
        }
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            100.0 * self.hits as f64 / n as f64
        }
    }

    /// Account one decode step and build its row. `loop_overhead_ms` is the wall time
    /// between the previous decode and this one (sampling, detokenizing, sinks).
    pub fn token(&mut self, s: &StepStats, mem: &MemPicture, loop_overhead_ms: f64) -> TokenRecord {
        self.add_cache(s);
        self.step += 1;
        self.experts_routed += s.experts_routed;
        self.experts_dropped += s.experts_dropped;
        self.experts_reranked += s.experts_reranked;
        self.experts_substituted += s.experts_substituted;
        self.decode_routed_bytes += s.routed_bytes;
        self.decode_tokens += 1;
        let prev = self.last_mem.unwrap_or(*mem);
        let majflt = mem.majflt_total.saturating_sub(prev.majflt_total);
        let mut r = TokenRecord {
            wall_ms: s.wall.as_ms_f64(),
            io_ms: s.io.as_ms_f64(),
            read_bytes: s.read_bytes,
            stall_ms: s.stall.as_ms_f64(),
            mgmt_ms: s.mgmt.as_ms_f64(),
            majflt,
            cpu_ms: (mem.cpu_ms_total - prev.cpu_ms_total).max(0.0),
            majflt_mib: majflt as f64 * mem.page_bytes as f64 / MIB,
            loop_overhead_ms,
            ..self.row(mem)
        };
        r.set_compute_residual(self.overlap);
        self.last_mem = Some(*mem);
        r
    }

    /// A row of a speculative group after its first: a token the group's verify decode
    /// confirmed, whose cost the first row carries (zeros here, so no token reads as free
    /// twice); the memory picture is the group's.
    pub fn group_row(&mut self, mem: &MemPicture) -> TokenRecord {
        self.step += 1;
        self.row(mem)
    }

    /// A row of the current step with no cost in it: its place in the turn, the cache's hit
    /// rate and budget, and the memory picture `mem`.
    fn row(&self, mem: &MemPicture) -> TokenRecord {
        TokenRecord {
            step: self.step,
            steps: self.steps,
            cache_hit_pct: self.cache_hit_pct(),
            dense_resident_frac: mem.dense_resident_frac,
            turn: self.turn,
            cache_budget_mib: self.cache_budget_bytes as f64 / MIB,
            rss_mib: mem.rss_mib,
            rss_anon_mib: mem.rss_anon_mib,
            rss_file_mib: mem.rss_file_mib,
            swap_mib: mem.swap_mib,
            mem_available_mib: mem.mem_available_mib,
            mem_free_mib: mem.mem_free_mib,
            swap_free_mib: mem.swap_free_mib,
            mtp_batch: 1,
            ..TokenRecord::default()
        }
    }

    /// A read failed: the run's output is not trustworthy (reported in the summary).
    pub fn io_error(&mut self) {
        self.io_errors += 1;
    }

    /// The run's counters for the report, given the cache as it ends the generation.
    #[allow(clippy::too_many_arguments)]
    pub fn counters(
        &self,
        cache: &ExpertCache,
        layer_demand_bytes: u64,
        n_prompt: u64,
        n_past: u64,
        load_s: f64,
        prefill_s: f64,
        loop_overhead_tail_ms: f64,
    ) -> RunCounters {
        RunCounters {
            n_prompt,
            n_past,
            load_s,
            prefill_s,
            cache_hit_pct: self.cache_hit_pct(),
            cache_resident_bytes: cache.resident_bytes(),
            cache_budget_bytes: cache.budget_bytes(),
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
            rereads: self.rereads,
            bypasses: self.bypasses,
            admission_filter: cache.filters_admission(),
            token_demand_bytes: if self.decode_tokens > 0 {
                self.decode_routed_bytes as f64 / self.decode_tokens as f64
            } else {
                0.0
            },
            layer_demand_bytes,
            experts_routed: self.experts_routed,
            experts_dropped: self.experts_dropped,
            experts_reranked: self.experts_reranked,
            experts_substituted: self.experts_substituted,
            prefill: self.prefill.clone(),
            loop_overhead_tail_ms,
            io_errors: self.io_errors,
            spec_read_bytes: self.spec_read_bytes,
            spec_experts: self.spec_experts,
            spec_useful: self.spec_useful,
            predict: self.predict.clone(),
            ra_committed: self.ra_committed,
            ra_passthrough: self.ra_passthrough,
            ra_slots: self.ra_slots,
            ra_agreed_slots: self.ra_agreed_slots,
            ra_gemv_ns: self.ra_gemv_ns,
            ra_gemv_jobs: self.ra_gemv_jobs,
            ..RunCounters::default()
        }
    }
}
