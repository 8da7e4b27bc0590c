//! `bmoe-cli`'s run: the configuration resolved and validated, the model loaded (resident, or
//! streamed through the core's decode step over O_DIRECT lanes), the prompt rendered and
//! tokenized, tokens sampled, and the answer and the report printed. The generation itself —
//! prefill, one decode step per token, the ledger and every per-token and end-of-run output —
//! is the core's loop (`bmoe_core::Session`); this file is its engine-side token source (the
//! sampler, the detokenizer, the reasoning split) and its printing.

use crate::arch::Model;
use crate::arena::ArenaOptions;
use crate::cli::RunArgs;
use crate::flash::{LaneFlash, MonotonicClock};
use crate::gguf::GgufFile;
use crate::outputs::{NamedFile, RunOutputs};
use crate::stream::{arena_for, layout_of, Device, EngineBackend};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use anyhow::{anyhow, bail, Context, Result};
use bmoe_core::config::{
    auto_cache_budget, auto_cache_room_from, decide_streaming, RunConfig, StreamChoice, MIB,
};
use bmoe_core::faults::{Fault, FaultyFlash};
use bmoe_core::faults::{RetryFlash, READ_RETRIES};
use bmoe_core::ledger::MemPicture;
use bmoe_core::records::RecordSink;
use bmoe_core::telemetry::io_trace::IoTraceWriter;
use bmoe_core::telemetry::report::ReportContext;
use bmoe_core::telemetry::route_trace::{RoutePreamble, RouteTraceWriter, TraceLayer};
use bmoe_core::{
    CancelFlag, Engine, ExpertCache, MemProbe, Outputs, ResidentFlash, Session, StepInput,
    StepStats, StopReason, StreamConfig, TokenSource, TurnRequest,
};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// The decode step as the engine instantiates it, resident or streamed.
pub type EngineStep = Engine<MonotonicClock, Device, EngineBackend>;

/// Exit code of a run stopped by SIGINT/SIGTERM at a token boundary (128 + SIGINT).
pub const EXIT_INTERRUPTED: i32 = 130;

fn parse_fault(s: &str) -> Result<(u64, Fault)> {
    let (kind, n) = s
        .split_once(':')
        .ok_or_else(|| anyhow!("--inject-read-fault {s}: expected eio:N or short:N"))?;
    let n: u64 = n
        .parse()
        .map_err(|_| anyhow!("--inject-read-fault {s}: N must be a read number"))?;
    let f = match kind {
        "eio" => Fault::Eio,
        "short" => Fault::Short { got: 1 },
        _ => bail!("--inject-read-fault {s}: kind must be eio or short"),
    };
    Ok((n, f))
}

/// The process picture after every step: `getrusage`, `/proc` and a throttled `mincore` of
/// the dense weights.
struct HostProbe {
    dense: crate::probe::DenseResidency,
}

impl MemProbe for HostProbe {
    fn picture(&mut self) -> MemPicture {
        let ru = crate::probe::rusage();
        let ps = crate::probe::proc_status();
        let mi = crate::probe::meminfo();
        MemPicture {
            majflt_total: ru.majflt,
            cpu_ms_total: ru.cpu_s * 1000.0,
            dense_resident_frac: self.dense.sample(),
            rss_mib: ps.rss_mib,
            rss_anon_mib: ps.rss_anon_mib,
            rss_file_mib: ps.rss_file_mib,
            swap_mib: ps.swap_mib,
            mem_available_mib: mi.mem_available_mib,
            mem_free_mib: mi.mem_free_mib,
            swap_free_mib: mi.swap_free_mib,
            page_bytes: crate::probe::page_size_bytes(),
        }
    }
}

/// What a generation produced, for callers that run it in-process (the gates).
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// 0 on success; 3 when a step failed (the output is not trustworthy);
    /// `EXIT_INTERRUPTED` when a signal stopped it.
    pub code: i32,
    /// Generated token ids (the end-of-generation token included when one was sampled).
    pub tokens: Vec<u32>,
    /// The answer text (reasoning excluded).
    pub text: String,
    pub summary: Option<bmoe_core::telemetry::summary::RunSummary>,
}

/// A model loaded and ready to generate: the decode step over the resident or the streamed
/// device, the tokenizer, and the resolved configuration.
pub struct Loaded {
    pub cfg: RunConfig,
    pub engine: EngineStep,
    pub tok: Tokenizer,
    pub file: Arc<GgufFile>,
    pub n_vocab: usize,
    /// Seconds from the start of loading to a ready decode step.
    pub load_s: f64,
}

/// `MemAvailable` in bytes, `None` when `/proc/meminfo` does not say.
fn mem_available_bytes() -> Option<u64> {
    let mi = crate::probe::meminfo();
    (mi.mem_available_mib > 0.0).then_some((mi.mem_available_mib * MIB as f64) as u64)
}

/// The zero-config fit check for a run given no streaming flag: the model's shards and its KV
/// cache at the run's context, with `--cache-floor-mb` kept free, against the smaller of the
/// cgroup limit and `MemAvailable`. (Not the rlimits: streaming answers a lack of RAM, and
/// a streamed run needs no less address space or data than a resident one; they cap the auto
/// cache instead.)
fn fit_check(
    file: &GgufFile,
    arch: &dyn crate::arch::Arch,
    cfg: &RunConfig,
    sequences: u32,
) -> StreamChoice {
    let model_bytes: u64 = file
        .shard_paths()
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum();
    let kv_bytes = crate::arch::kv_bytes(arch, cfg.n_ctx as usize) * u64::from(sequences.max(1));
    let cg = crate::probe::cgroup_memory();
    decide_streaming(
        model_bytes,
        kv_bytes,
        cfg.cache_floor_mb * MIB,
        mem_available_bytes(),
        cg.and_then(|c| c.limit_bytes),
    )
}

/// On a big.LITTLE machine (`crate::cpus`): pin the calling thread — and so the compute pool
/// it is about to spawn — to the big cores, and return the other CPUs for the I/O lanes; say
/// so in one line on `err`. Nothing (and no line) on a machine with one speed class or no
/// cpufreq. With `--threads` above the big-core count nothing is pinned: more threads than
/// big cores would share them.
fn place_threads(threads: u32, err: &mut dyn Write) -> Result<Vec<usize>> {
    use crate::cpus::format_cpu_list as list;
    let Some(p) = crate::cpus::this_placement() else {
        return Ok(Vec::new());
    };
    let big = p.compute.len();
    if threads as usize > big {
        writeln!(
            err,
            "bmoe: cpus: {}: --threads {threads} is more than the {big} big cores (cpus {}), so \
             no thread is pinned",
            p.described,
            list(&p.compute)
        )?;
        return Ok(Vec::new());
    }
    match crate::cpus::pin_current_thread(&p.compute) {
        Ok(()) => {
            let io = if p.io.is_empty() {
                // Spawned from this thread, the lanes inherit its mask.
                "I/O lanes beside them (no other core allowed)".to_string()
            } else {
                format!("I/O lanes on cpus {}", list(&p.io))
            };
            writeln!(
                err,
                "bmoe: cpus: {}: {threads} compute threads on the big cores (cpus {}), {io}",
                p.described,
                list(&p.compute)
            )?;
            Ok(p.io)
        }
        Err(e) => {
            writeln!(
                err,
                "bmoe: cpus: {}: could not pin the compute threads to cpus {} ({e}); the \
                 scheduler places them",
                p.described,
                list(&p.compute)
            )?;
            Ok(Vec::new())
        }
    }
}

/// `--routing-from`: the trace at `path`, checked against the model's routing shape.
fn follow_trace(
    path: &Path,
    layout: &bmoe_core::layout::ExpertLayout,
    dims: &crate::arch::Dims,
    gating: bmoe_core::gating::Gating,
) -> Result<bmoe_core::hooks::follow::FollowTrace> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--routing-from: cannot read {}", path.display()))?;
    let trace = bmoe_core::telemetry::route_trace::RouteTrace::parse(&text)
        .with_context(|| format!("--routing-from {}", path.display()))?;
    bmoe_core::hooks::follow::FollowTrace::new(
        &trace,
        layout.layers().len(),
        dims.n_expert as u32,
        dims.n_expert_used as u32,
        gating,
    )
    .with_context(|| format!("--routing-from {}", path.display()))
}

/// `--draft-replay FILE`: the generated tokens of a recorded run (its `--logits-out` JSON:
/// `token_ids` past `n_prompt`).
fn recorded_tokens(path: &Path) -> Result<Vec<u32>> {
    let what = || format!("--draft-replay {}", path.display());
    let text = std::fs::read_to_string(path).with_context(what)?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(what)?;
    let ids = v["token_ids"]
        .as_array()
        .ok_or_else(|| anyhow!("{}: no token_ids array (a --logits-out JSON file)", what()))?;
    let n_prompt = v["n_prompt"]
        .as_u64()
        .ok_or_else(|| anyhow!("{}: no n_prompt", what()))? as usize;
    ids.iter()
        .skip(n_prompt)
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| anyhow!("{}: token id {t} is not a u32", what()))
        })
        .collect()
}

/// Resolve and validate the configuration, load the model and build its decode step:
/// streamed (`--moe-stream`: expert cache, arena, O_DIRECT lanes, router hooks, predictors)
/// or resident (every expert computed from the model's map, through the same step). Load-time
/// warnings go to `err`.
pub fn load(args: &RunArgs, model_path: &Path, err: &mut dyn Write) -> Result<Loaded> {
    let t_load = Instant::now();
    let mut cfg = RunConfig {
        engine_version: env!("CARGO_PKG_VERSION").to_string(),
        ..RunConfig::default()
    };
    cfg.model = model_path.display().to_string();
    // `-n -1` is resolved against the prompt; until then the context bounds it.
    cfg.n_predict = args.n_predict.min(args.ctx);
    cfg.threads = args.threads;
    cfg.n_ctx = args.ctx;
    cfg.n_ubatch = args.ubatch;
    cfg.chatml = args.chatml;
    cfg.temp = args.temp;
    cfg.top_k = args.top_k as u32;
    cfg.top_p = args.top_p;
    cfg.seed = args.seed;
    if args.ngram || args.draft_replay.is_some() {
        cfg.spec = bmoe_core::config::SpecMode::Ngram;
    } else if args.mtp {
        cfg.spec = bmoe_core::config::SpecMode::Mtp;
        cfg.mtp_p_min = args.mtp_p_min;
    }
    cfg.spec_draft_max = args.draft;
    cfg.ngram_min_match = args.ngram_min_match;
    cfg.ngram_max_match = args.ngram_max_match;
    args.stream.apply(&mut cfg);
    args.telemetry.apply(&mut cfg);
    cfg.compute_trace_layers =
        crate::optrace::Granularity::preamble_value(args.compute_trace().map(|(g, _)| g));
    cfg.validate()?;
    if cfg.spec == bmoe_core::config::SpecMode::Off {
        // A session's or server's request may turn --ngram on: its settings must hold then.
        RunConfig {
            spec: bmoe_core::config::SpecMode::Ngram,
            n_ubatch: 0,
            route_ahead: 0,
            ..cfg.clone()
        }
        .validate()?;
    }

    let file = Arc::new(GgufFile::open(model_path)?);
    cfg.arch = file.architecture().unwrap_or("").to_string();
    if !crate::arch::is_supported(&cfg.arch) {
        // Say what mode the run would be in (not streaming: an unknown architecture never
        // streams) before refusing it by name.
        let shown = RunConfig {
            moe_stream: false,
            ..cfg.clone()
        };
        writeln!(
            err,
            "{}",
            bmoe_core::telemetry::report::mode_line(&shown, false)
        )?;
    }
    // The resident baseline is plain mmap by definition; streaming applies --dense-weights.
    let dense_asked = cfg.dense_weights;
    if !cfg.moe_stream {
        cfg.dense_weights = bmoe_core::config::DenseWeights::Mmap;
    }
    let mut arch = crate::arch::load(file.clone(), cfg.dense_weights.into())?;
    if cfg.stream_choice == StreamChoice::Auto {
        let choice = fit_check(&file, arch.as_ref(), &cfg, args.sequences);
        cfg.resolve_streaming(choice, args.stream.cache_mb.is_some())
            .map_err(|e| match choice.reason() {
                Some(why) => anyhow!("{e} (no streaming flag was given: {why})"),
                None => e.into(),
            })?;
        if cfg.moe_stream {
            cfg.dense_weights = dense_asked;
            if dense_asked != bmoe_core::config::DenseWeights::Mmap {
                arch = crate::arch::load(file.clone(), cfg.dense_weights.into())?;
            }
        }
    }
    if args.verify_reads && !cfg.moe_stream {
        bail!("--verify-reads checks the experts streaming reads from flash: add --moe-stream (a resident run reads none)");
    }
    // The pool's workers inherit the mask of the thread that spawns them: pin this one first.
    let lane_cpus = place_threads(args.threads, err)?;
    let mut model = Model::new(arch, args.threads as usize);
    model.set_check_finite(args.check_finite);
    let dims = model.dims().clone();
    cfg.gating = model.gating();
    cfg.n_layer = dims.n_layer as u32;
    cfg.n_expert = dims.n_expert as u32;
    cfg.n_expert_used = if cfg.n_expert_used_override > 0 {
        cfg.n_expert_used_override
    } else {
        dims.n_expert_used as u32
    };
    cfg.validate_model()?;
    let k = cfg.n_expert_used as u16;
    let tok = Tokenizer::from_gguf(&file)?;
    let layout = layout_of(&model)?;
    let follow = match &args.routing_from {
        Some(path) => {
            let f = follow_trace(path, &layout, &dims, model.gating())?;
            cfg.routing_from = Some(path.display().to_string());
            writeln!(
                err,
                "bmoe: routing follows {} ({} tokens, {}): the output is not the model's own",
                path.display(),
                f.n_tokens(),
                if f.weights_known() {
                    "recorded weights"
                } else {
                    "no recorded weights: the router's own over the recorded ids"
                }
            )?;
            Some(f)
        }
        None => None,
    };
    let policy = bmoe_core::policy::by_name(cfg.eviction.name())
        .ok_or_else(|| anyhow!("unknown eviction policy {}", cfg.eviction.name()))?;

    let mut engine = if cfg.moe_stream {
        let shard_lens: Vec<u64> = file
            .shard_paths()
            .iter()
            .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
            .collect();
        layout.check_shards(&shard_lens)?;
        cfg.cache_cycle_mb = layout.cache_cycle_bytes(k).div_ceil(MIB);
        // A stream the engine chose sizes its auto cache inside the room it measured.
        if let (StreamChoice::TooBig(fit), true, 0) =
            (cfg.stream_choice, cfg.cache_auto, cfg.cache_ceil_mb)
        {
            let ceiling = fit.cache_ceiling_bytes(layout.total_expert_bytes());
            if ceiling < MIB {
                writeln!(
                    err,
                    "bmoe: warning: no room for an expert cache once the dense weights and the KV \
                     cache are in ({}): every routed expert is read from flash every token",
                    cfg.stream_choice.reason().unwrap_or_default()
                )?;
                cfg.cache_auto = false;
                cfg.cache_mb = 0;
            } else {
                cfg.cache_ceil_mb = ceiling / MIB;
            }
        }
        let budget = if cfg.cache_auto {
            // The room: MemAvailable, or the headroom under the process's tightest limit (its
            // cgroup's, RLIMIT_AS, RLIMIT_DATA) where that is smaller; `mode:` names which.
            let avail = mem_available_bytes();
            let room = crate::probe::tightest_headroom(&crate::probe::process_limits());
            cfg.cache_room_from =
                auto_cache_room_from(avail, room.map(|l| (l.headroom_bytes(), l.source)));
            auto_cache_budget(
                avail,
                room.map(|l| l.limit_bytes),
                room.map(|l| l.usage_bytes),
                cfg.cache_floor_mb * MIB,
                cfg.cache_ceil_mb * MIB,
                layout.total_expert_bytes(),
            )
        } else {
            cfg.cache_mb * MIB
        };
        cfg.resolve_cache_budget(budget);
        let cache = ExpertCache::new(&layout, budget, k, policy)?;
        // The keepers commit destination memory ahead only where cached experts will need it,
        // and only in the room the budget has left.
        let arena = Arc::new(arena_for(
            &layout,
            ArenaOptions {
                prefault_bytes: if budget > 0 {
                    crate::arena::PREFAULT_BYTES
                } else {
                    0
                },
                commit_limit: budget,
                huge_pages: cfg.huge_pages,
            },
        )?);
        let paths: Vec<std::path::PathBuf> =
            file.shard_paths().iter().map(|p| p.to_path_buf()).collect();
        let clock = MonotonicClock::new();
        let mut flash = LaneFlash::open_pinned(
            &paths,
            cfg.io_threads,
            cfg.o_direct,
            arena.clone(),
            clock,
            &lane_cpus,
        )?;
        flash.set_read_timeout_ms(cfg.read_timeout_ms);
        if let Some(plan) = &cfg.inject_faults {
            flash.set_faults(plan.clone());
        }
        for w in flash.warnings() {
            writeln!(err, "bmoe: warning: {w}")?;
        }
        cfg.o_direct = flash.o_direct_achieved();
        cfg.o_direct_refused = flash.buffered_reason().map(str::to_string);
        let (nth, fault) = match &args.inject_read_fault {
            Some(f) => parse_fault(f)?,
            None => (u64::MAX, Fault::Eio),
        };
        // EIO and short reads are retried before they are reported; `--inject-read-fault`
        // spoils one read past the retry.
        let flash = Device::Lanes(FaultyFlash::new(
            RetryFlash::new(flash, READ_RETRIES),
            nth,
            fault,
        ));
        let state = model.new_state(args.ctx as usize);
        let mut backend = EngineBackend::new(model, state, Some(arena), layout.clone());
        if let Some(f) = follow {
            backend.set_follow(f);
        }
        if args.verify_reads {
            let path = crate::checksum::sidecar_path(model_path);
            backend.set_verify(crate::checksum::load(&path, &file, &layout)?);
        }
        let stream = StreamConfig {
            overlap: cfg.overlap,
            load_all: cfg.load_all,
            read_split: cfg.read_split,
            prefetch: cfg.prefetch,
        };
        Engine::new(clock, flash, backend, layout, cache, stream)?
    } else {
        // The resident baseline: the same step over a device that reads nothing, every expert
        // computed from the map, no cache.
        let cache = ExpertCache::new(&layout, 0, k, policy)?;
        let state = model.new_state(args.ctx as usize);
        let mut backend = EngineBackend::new(model, state, None, layout.clone());
        if let Some(f) = follow {
            backend.set_follow(f);
        }
        Engine::new(
            MonotonicClock::new(),
            Device::Resident(ResidentFlash::new()),
            backend,
            layout,
            cache,
            StreamConfig::default(),
        )?
    };
    // Top-k override, substitution, dropping, in that order, weighing routings with the
    // model's gating; without streaming only the top-k override can be armed (`validate`
    // refuses the others).
    for hook in bmoe_core::hooks::router_hooks(&cfg, dims.n_expert_used as u32, cfg.gating) {
        engine.add_hook(hook);
    }
    // --predict-log, --predict-prefetch, --route-ahead (committed before the hooks above
    // run), --prefetch-sync.
    engine.set_predictors(bmoe_core::PredictConfig::from_run_config(&cfg));
    use bmoe_core::backend::Backend as _;
    if cfg.spec == bmoe_core::config::SpecMode::Mtp {
        // A file without a head this build runs is refused here, by key.
        engine
            .backend_mut()
            .enable_mtp(args.mtp_logits_out.as_deref())
            .context("--mtp")?;
    }
    if cfg.spec != bmoe_core::config::SpecMode::Off && !engine.backend().verifies_rows() {
        // A backend that cannot verify a drafted group: decode plainly, and say so (the
        // preamble then says spec=off). Every architecture of this build verifies.
        writeln!(
            err,
            "warning: --{}: this backend cannot verify a drafted group on {}; decoding without speculation",
            cfg.spec.name(),
            cfg.arch
        )?;
        cfg.spec = bmoe_core::config::SpecMode::Off;
    }
    // The drop-at-narrow-top-k and cache-cycle warnings, once, each already a full line.
    for w in cfg.load_warnings() {
        writeln!(err, "{w}")?;
    }
    Ok(Loaded {
        cfg,
        engine,
        tok,
        file,
        n_vocab: dims.n_vocab,
        load_s: t_load.elapsed().as_secs_f64(),
    })
}

/// The prompt as the model sees it, and its tokens (`crate::prompt::render`).
fn render_prompt(args: &RunArgs, loaded: &Loaded, model_path: &Path) -> Result<(String, Vec<u32>)> {
    crate::prompt::render(args, &loaded.file, &loaded.tok, model_path)
}

/// Why the engine's token source failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SamplingError {
    #[error("writing {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the model produced {got} logits, fewer than one row of {n_vocab}")]
    NoLogits { got: usize, n_vocab: usize },
    #[error("constrained decoding: {0}")]
    Grammar(String),
}

/// The engine's token source: greedy or seeded sampling over the last row's logits, the
/// detokenizer, the chat template's reasoning split, and — without `--progress` — the answer
/// printed as it grows. It also writes the `--logits-out` rows after every step. One per
/// turn; the sampler (and its seeded stream) outlives it, across a session's turns.
/// A value a turn's source borrows from its caller (a session's sampler, kept across turns)
/// or owns (a server lane's, made for the request).
pub(crate) enum Held<'a, T> {
    Borrowed(&'a mut T),
    Owned(Box<T>),
}

impl<'a, T> From<&'a mut T> for Held<'a, T> {
    fn from(v: &'a mut T) -> Self {
        Held::Borrowed(v)
    }
}

impl<T> From<T> for Held<'_, T> {
    fn from(v: T) -> Self {
        Held::Owned(Box::new(v))
    }
}

impl<T> std::ops::Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Held::Borrowed(v) => v,
            Held::Owned(v) => v,
        }
    }
}

impl<T> std::ops::DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        match self {
            Held::Borrowed(v) => v,
            Held::Owned(v) => v,
        }
    }
}

pub(crate) struct Sampling<'a> {
    tok: &'a Tokenizer,
    sampler: Held<'a, crate::sample::Sampler>,
    n_vocab: usize,
    chatml: bool,
    dec: StreamDecoder,
    split: crate::chat::ReasoningSplitter,
    reasoning: String,
    text: String,
    /// Where the answer is printed as it grows (no `--progress`).
    inline: Option<&'a mut dyn Write>,
    logits_out: Option<&'a mut BufWriter<NamedFile>>,
    /// With `logits_out`: each written row's smallest router margin (`State::router_margin`),
    /// for the sidecar.
    router_margins: Vec<f32>,
    /// The end-of-generation token that ended the turn, if one did.
    eog: Option<u32>,
    /// Generate through end-of-generation tokens (`--routing-from`: the trace, not the
    /// model's text, sets the run's length).
    pub(crate) ignore_eog: bool,
    /// Record each chosen token's log-probability with this many alternatives.
    pub(crate) logprobs: Option<usize>,
    /// The last chosen token's, with `logprobs`.
    pub(crate) last_logprob: Option<crate::sample::TokenLogprob>,
    /// The grammar the answer must follow (structured output, required tool calls).
    pub(crate) constraint: Option<crate::constrain::Constraint>,
    /// The masked row (with a constraint).
    masked: Vec<f32>,
}

impl<'a> Sampling<'a> {
    /// A turn's source. `prompt` is the text the turn's generation follows (the rendered chat,
    /// whose end may open a reasoning span; empty without a chat template).
    pub(crate) fn new(
        tok: &'a Tokenizer,
        sampler: impl Into<Held<'a, crate::sample::Sampler>>,
        n_vocab: usize,
        chatml: bool,
        prompt: &str,
    ) -> Self {
        Sampling {
            tok,
            sampler: sampler.into(),
            n_vocab,
            chatml,
            dec: StreamDecoder::new(),
            split: crate::chat::ReasoningSplitter::for_prompt(if chatml { prompt } else { "" }),
            reasoning: String::new(),
            text: String::new(),
            inline: None,
            logits_out: None,
            router_margins: Vec::new(),
            eog: None,
            ignore_eog: false,
            logprobs: None,
            last_logprob: None,
            constraint: None,
            masked: Vec::new(),
        }
    }

    /// The turn's (reasoning, answer) text.
    pub(crate) fn into_text(self) -> (String, String) {
        (self.reasoning, self.text)
    }

    /// Add decoded text: split off the reasoning, print the answer's part.
    fn push_text(&mut self, piece: &str, last: bool) -> Result<(), SamplingError> {
        let mut d = if self.chatml {
            self.split.push(piece)
        } else {
            crate::chat::Delta {
                text: piece.to_string(),
                ..Default::default()
            }
        };
        if last && self.chatml {
            let rest = self.split.finish();
            d.reasoning.push_str(&rest.reasoning);
            d.text.push_str(&rest.text);
        }
        if d.reset {
            self.reasoning = d.reasoning.clone();
            self.text = d.text.clone();
        } else {
            self.reasoning.push_str(&d.reasoning);
            self.text.push_str(&d.text);
        }
        if let Some(w) = self.inline.as_mut() {
            let io = |source| SamplingError::Io {
                what: "the answer",
                source,
            };
            w.write_all(d.text.as_bytes()).map_err(io)?;
            w.flush().map_err(io)?;
        }
        Ok(())
    }
}

impl TokenSource<EngineBackend> for Sampling<'_> {
    type Error = SamplingError;

    fn after_step(
        &mut self,
        backend: &EngineBackend,
        _input: &StepInput<'_>,
        _stats: &mut StepStats,
    ) -> Result<(), SamplingError> {
        if let Some(w) = self.logits_out.as_mut() {
            for v in &backend.state.logits {
                w.write_all(&v.to_le_bytes())
                    .map_err(|source| SamplingError::Io {
                        what: "--logits-out",
                        source,
                    })?;
            }
            let st = &backend.state;
            self.router_margins.extend(st.out_rows.iter().map(|&r| {
                st.router_margin
                    .get(r as usize)
                    .copied()
                    .unwrap_or(f32::INFINITY)
            }));
        }
        Ok(())
    }

    fn next_token(
        &mut self,
        backend: &mut EngineBackend,
        last: bool,
    ) -> Result<Option<u32>, SamplingError> {
        let rows = backend.state.logits.len() / self.n_vocab.max(1);
        self.choose(backend, rows.max(1) as u32 - 1, last)
    }

    fn verifies(&self) -> bool {
        true
    }

    fn next_token_at(
        &mut self,
        backend: &mut EngineBackend,
        row: u32,
        last: bool,
    ) -> Result<Option<u32>, SamplingError> {
        self.choose(backend, row, last)
    }

    fn text(&self) -> (&str, &str) {
        (&self.reasoning, &self.text)
    }

    fn finish(&mut self, _backend: &mut EngineBackend) -> Result<(), SamplingError> {
        let tail = self.dec.flush();
        // After `last` the splitter and the decoder hold nothing; otherwise (end of
        // generation, a cancel, a failure) whatever they held joins the answer here.
        self.push_text(&tail, true)
    }
}

impl Sampling<'_> {
    /// The token sampled from the logits of the last step's batch row `row` (the head's
    /// output rows, in order), its text pushed; `None` at an end-of-generation token.
    fn choose(
        &mut self,
        backend: &EngineBackend,
        row: u32,
        last: bool,
    ) -> Result<Option<u32>, SamplingError> {
        let logits = &backend.state.logits;
        let at = row as usize * self.n_vocab;
        if self.n_vocab == 0 || logits.len() < at + self.n_vocab {
            return Err(SamplingError::NoLogits {
                got: logits.len(),
                n_vocab: self.n_vocab,
            });
        }
        let row = &logits[at..at + self.n_vocab];
        let next = match self.constraint.as_mut() {
            None => self.sampler.sample(row),
            Some(c) => {
                let grammar = |e: anyhow::Error| SamplingError::Grammar(format!("{e:#}"));
                self.masked.clear();
                self.masked.extend_from_slice(row);
                c.mask(&mut self.masked).map_err(grammar)?;
                let id = self.sampler.sample(&self.masked);
                c.commit(id).map_err(grammar)?;
                id
            }
        };
        self.last_logprob = self
            .logprobs
            .map(|top| crate::sample::logprobs(row, next, top));
        if self.tok.is_eog(next) && !self.ignore_eog {
            self.eog = Some(next);
            return Ok(None);
        }
        let mut piece = self.dec.push(self.tok, next);
        if last {
            // The turn's last token: its line carries everything, an unfinished character too.
            piece.push_str(&self.dec.flush());
        }
        self.push_text(&piece, last)?;
        Ok(Some(next))
    }
}

/// The files a run (or a whole session) writes through the loop: `--csv`, `--route-trace`
/// (streaming only) and `--io-trace`.
pub(crate) struct Sinks {
    csv: Option<BufWriter<NamedFile>>,
    route: Option<RouteTraceWriter<BufWriter<NamedFile>>>,
    io: Option<IoTraceWriter<BufWriter<NamedFile>>>,
}

/// The route trace preamble of a run of `cfg` on `engine`: the model, its routing shape and
/// gating, each MoE layer's bytes and extents (so the simulator prices reads exactly), and
/// what marks the run (`--routing-from`'s note, a speculative run's `spec=`).
pub fn route_preamble(cfg: &RunConfig, engine: &EngineStep) -> RoutePreamble {
    RoutePreamble {
        model: cfg.model.clone(),
        arch: cfg.arch.clone(),
        n_layer: cfg.n_layer,
        n_expert: cfg.n_expert,
        n_expert_used: cfg.n_expert_used,
        gating: cfg.gating,
        layers: TraceLayer::of_layout(engine.layout()),
        notes: cfg
            .routing_from
            .iter()
            .map(|t| {
                format!(
                    "routing followed the recorded trace {t} (--routing-from): an instrumented run"
                )
            })
            .collect(),
        // A speculative run's decode steps verify groups: marked, so the
        // simulator refuses to replay it as plain decoding.
        extra: if cfg.spec == bmoe_core::config::SpecMode::Off {
            Vec::new()
        } else {
            vec![(
                bmoe_core::telemetry::route_trace::SPEC_KEY.to_string(),
                cfg.spec.name().to_string(),
            )]
        },
    }
}

impl Sinks {
    /// `--compute-trace` / `--compute-trace-layers`: hand the opened file to `engine`'s
    /// backend, which writes its rows at the end of every step.
    pub(crate) fn install_compute_trace(
        outputs: &mut RunOutputs,
        cfg: &RunConfig,
        engine: &mut EngineStep,
    ) -> Result<()> {
        let Some((g, w)) = outputs.compute_trace.take() else {
            return Ok(());
        };
        let preamble = format!(
            "model={} arch={} n_layer={} n_threads={} io_threads={} o_direct={} overlap={} moe_stream={}",
            cfg.model,
            cfg.arch,
            cfg.n_layer,
            cfg.threads,
            cfg.io_threads,
            u8::from(cfg.o_direct),
            u8::from(cfg.overlap),
            u8::from(cfg.moe_stream)
        );
        let trace = crate::optrace::OpTrace::new(g, Box::new(w), &preamble)
            .context("--compute-trace: writing its preamble")?;
        engine.backend_mut().state.trace = Some(Box::new(trace));
        Ok(())
    }

    /// Take the files `outputs` opened (checked and created before the model loaded); the
    /// route trace's preamble describes `engine`'s layout. `per_request` says requests may
    /// turn speculation on (a session, a server): the route trace then numbers its steps
    /// (the `group` column) whatever the flags say, so a verify decode replays as one step.
    /// `batched`: several sequences share each step (`serve --parallel`), and the route trace
    /// says whose each token is (the `seq` column).
    pub(crate) fn open(
        outputs: &mut RunOutputs,
        cfg: &RunConfig,
        engine: &EngineStep,
        per_request: bool,
        batched: bool,
    ) -> Result<Sinks> {
        let csv = outputs.csv.take();
        let route = match outputs.route_trace.take() {
            Some(w) if cfg.moe_stream => {
                let pre = route_preamble(cfg, engine);
                Some(RouteTraceWriter::with_columns(
                    w,
                    &pre,
                    bmoe_core::telemetry::route_trace::PredColumns::for_config(cfg),
                    bmoe_core::telemetry::route_trace::StepColumns {
                        group: per_request || cfg.spec != bmoe_core::config::SpecMode::Off,
                        seq: batched,
                    },
                )?)
            }
            _ => None,
        };
        let io = match outputs.io_trace.take() {
            Some(w) => Some(IoTraceWriter::new(w)?),
            None => None,
        };
        Ok(Sinks { csv, route, io })
    }

    /// The loop's outputs over these files, with `progress` for the per-token lines.
    pub(crate) fn outputs<'a>(&'a mut self, progress: Option<&'a mut dyn Write>) -> Outputs<'a> {
        Outputs {
            progress,
            csv: self.csv.as_mut().map(|w| w as &mut dyn Write),
            route: self.route.as_mut().map(|w| w as &mut dyn RecordSink),
            io: self.io.as_mut().map(|w| w as &mut dyn RecordSink),
        }
    }

    /// Flush and close every file, reporting the first write error.
    /// The route and io trace writers as one sink (a batched step's: `serve --parallel`).
    pub(crate) fn traces(&mut self) -> bmoe_core::telemetry::TraceTee<'_> {
        bmoe_core::telemetry::TraceTee {
            route: self.route.as_mut().map(|w| w as &mut dyn RecordSink),
            io: self.io.as_mut().map(|w| w as &mut dyn RecordSink),
        }
    }

    pub(crate) fn finish(self) -> Result<()> {
        if let Some(mut w) = self.csv {
            w.flush().context("writing --csv")?;
        }
        if let Some(r) = self.route {
            r.finish().context("writing --route-trace")?;
        }
        if let Some(w) = self.io {
            w.finish()
                .and_then(|mut f| f.flush())
                .context("writing --io-trace")?;
        }
        Ok(())
    }
}

/// What the device went through, one line each: reads retried after EIO or a short read,
/// and the faults `--inject-faults` dealt. Nothing for a resident run or a clean one.
pub(crate) fn device_notes(engine: &EngineStep) -> Vec<String> {
    let Device::Lanes(faulty) = engine.flash() else {
        return Vec::new();
    };
    let retry = faulty.inner();
    let mut notes = Vec::new();
    if retry.retried() > 0 {
        notes.push(format!(
            "bmoe: warning: {} flash read retries after EIO or a short read; {} read(s) then succeeded (first failure: {})",
            retry.retried(),
            retry.recovered(),
            retry.first_retry().unwrap_or("?")
        ));
    }
    let f = retry.inner().fault_counts();
    if f.total() > 0 {
        notes.push(format!(
            "bmoe: injected faults: eio={} short={} spike={} stuck={} torn={}",
            f.eio, f.short, f.spike, f.stuck, f.torn
        ));
    }
    notes
}

/// The process probe over `engine`'s dense weights (`mincore` at most every 16 tokens and
/// 250 ms).
pub(crate) fn host_probe(engine: &EngineStep) -> impl MemProbe {
    HostProbe {
        dense: crate::probe::DenseResidency::new(
            engine.backend().model.arch.weights().dense_ranges(),
            16,
            250,
        ),
    }
}

/// The run's sampler: greedy at `--temp 0`, else seeded by `--seed`.
pub(crate) fn sampler(args: &RunArgs) -> crate::sample::Sampler {
    crate::sample::Sampler::new(args.sampler_config(args.seed))
}

/// Run a generation printing to the process's stdout/stderr; returns the exit code. `cancel`
/// (set by SIGINT/SIGTERM) stops it at the next token boundary.
pub fn generate(args: &RunArgs, model_path: &Path, cancel: &CancelFlag) -> Result<i32> {
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    Ok(generate_with_cancel(
        args,
        model_path,
        &mut stdout.lock(),
        &mut stderr.lock(),
        cancel,
    )?
    .code)
}

/// Run a generation writing the answer (or progress lines) to `out` and diagnostics and the
/// report to `err` (the report goes to `out` under `--progress`).
pub fn generate_with(
    args: &RunArgs,
    model_path: &Path,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome> {
    generate_with_cancel(args, model_path, out, err, &CancelFlag::new())
}

/// `generate_with`, stopped at the next token boundary once `cancel` is set: every row is
/// whole, the CSV trailer says `interrupted=1`, the traces end on a whole step, and the
/// outcome's code is `EXIT_INTERRUPTED`.
pub fn generate_with_cancel(
    args: &RunArgs,
    model_path: &Path,
    out: &mut dyn Write,
    err: &mut dyn Write,
    cancel: &CancelFlag,
) -> Result<Outcome> {
    args.check_modes()?;
    let mut args = args.clone();
    args.resolve_seed_reported(err)?;
    let args = &args;
    // Every output checked against the model's files and each other, and created, before the
    // model loads: a bad output path costs nothing and never touches an input.
    let mut files = RunOutputs::open(model_path, args)?;
    let loaded = load(args, model_path, err)?;
    let (prompt, prompt_tokens) = render_prompt(args, &loaded, model_path)?;
    if prompt_tokens.is_empty() {
        bail!("the prompt is empty after tokenization: pass -p TEXT, -f FILE or pipe it on stdin");
    }
    let mut n_predict =
        crate::prompt::n_predict_for(args.n_predict, prompt_tokens.len(), args.ctx as usize)?;
    if let Some(f) = loaded.engine.backend().follow() {
        // The run computes the prompt and every generated token (the last one too, so a
        // session can continue from it).
        let (have, prompt) = (f.n_tokens(), prompt_tokens.len() as u64);
        if prompt >= have {
            bail!(
                "--routing-from: the prompt is {prompt} tokens and the trace has {have}: use a shorter prompt"
            );
        }
        if prompt + u64::from(n_predict) > have {
            n_predict = (have - prompt) as u32;
            writeln!(
                err,
                "bmoe: --routing-from: the trace has {have} tokens, so this run generates {n_predict}"
            )?;
        }
    }
    let Loaded {
        mut cfg,
        mut engine,
        tok,
        load_s,
        n_vocab,
        ..
    } = loaded;

    cfg.n_predict = n_predict;
    let mut sinks = Sinks::open(&mut files, &cfg, &engine, false, false)?;
    Sinks::install_compute_trace(&mut files, &cfg, &mut engine)?;
    let mut logits_out = files.logits.take();
    engine.backend_mut().all_logits = logits_out.is_some();
    let progress = args.telemetry.progress;

    // Dense residency by mincore, throttled: at most every 16 tokens and 250 ms.
    let probe = host_probe(&engine);
    let mut session =
        Session::new(engine, cfg, load_s, Box::new(probe)).with_cancel(cancel.clone());
    if let Some(path) = &args.draft_replay {
        session.set_replay_drafts(recorded_tokens(path)?, args.draft);
    }
    let mut sampler = sampler(args);
    sampler.prime(&prompt_tokens);
    let mut source = Sampling::new(&tok, &mut sampler, n_vocab, args.chatml, &prompt);
    source.logits_out = logits_out.as_mut();
    source.ignore_eog = args.ignore_eos || session.engine().backend().follow().is_some();
    let positions: Vec<u32> = (0..prompt_tokens.len() as u32).collect();
    let turn = {
        let (mut answer_out, mut progress_out) = (None, None);
        if progress {
            progress_out = Some(&mut *out as &mut dyn Write);
        } else {
            answer_out = Some(&mut *out as &mut dyn Write);
        }
        source.inline = answer_out;
        let mut outputs = sinks.outputs(progress_out);
        let r = session.generate(
            &TurnRequest {
                prompt: &prompt_tokens,
                positions: &positions,
                n_predict,
            },
            &mut source,
            &mut outputs,
        );
        source.inline = None;
        r?
    };
    let eog = source.eog;
    let router_margins = std::mem::take(&mut source.router_margins);
    let (_, text) = source.into_text();

    if !progress {
        writeln!(out)?;
    }
    for n in device_notes(session.engine()) {
        writeln!(err, "{n}")?;
    }
    let ctx = ReportContext {
        progress,
        answer: &text,
        arch_streamable: true,
    };
    if progress {
        session.write_report(out, &ctx)?;
    } else {
        session.write_report(err, &ctx)?;
    }
    sinks.finish()?;
    if let (Some(mut w), Some(mut json)) = (logits_out, files.logits_json.take()) {
        w.flush()?;
        let mut ids: Vec<u32> = prompt_tokens.clone();
        ids.extend(&turn.tokens);
        // Infinite margins (a row no MoE layer routed) are written as null.
        let side = serde_json::json!({
            "n_vocab": n_vocab, "n_prompt": prompt_tokens.len(), "rows": ids.len(), "dtype": "f32le",
            "token_ids": ids, "note": "row i holds the logits after feeding token_ids[..=i]",
            "router_margin": router_margins,
            "router_margin_note": "per row, the smallest lead of the last chosen expert's ranking score over the best unchosen one's (logit units) over the MoE layers: a row near 0 routes on a near-tie"
        });
        json.write_all(serde_json::to_string_pretty(&side)?.as_bytes())?;
    }
    let mut tokens = turn.tokens;
    tokens.extend(eog);
    let summary = Some(session.summary());
    let code = match turn.stop {
        StopReason::Failed => {
            let e = turn
                .error
                .map(anyhow::Error::from)
                .unwrap_or_else(|| anyhow!("a step failed"));
            fail(progress, e, out, err)?;
            3
        }
        StopReason::Cancelled => {
            writeln!(
                err,
                "bmoe: interrupted: stopped at a token boundary after {} of {} tokens; the CSV rows, \
                 its summary (interrupted=1) and the traces are whole up to there",
                turn.summary.tokens(),
                n_predict
            )?;
            EXIT_INTERRUPTED
        }
        StopReason::Count | StopReason::EndOfGeneration => 0,
    };
    out.flush()?;
    Ok(Outcome {
        code,
        tokens,
        text,
        summary,
    })
}

/// An error as one line: its chain, with the OS error said once (`bmoe_core::telemetry::fmt`).
pub(crate) fn error_text(e: &anyhow::Error) -> String {
    bmoe_core::telemetry::fmt::error_text(e.as_ref())
}

/// A failed step: the output is not trustworthy. Say so loudly.
fn fail(progress: bool, e: anyhow::Error, out: &mut dyn Write, err: &mut dyn Write) -> Result<()> {
    let _ = out.flush();
    let text = error_text(&e);
    writeln!(err, "bmoe: FAILED: {text}")?;
    writeln!(err, "moe-stream: generation stopped by a failed read or step - this run's output is not trustworthy")?;
    if progress {
        writeln!(
            out,
            "BMOE_ERROR {}",
            serde_json::json!({"id": 0, "fatal": true, "msg": text})
        )?;
    }
    Ok(())
}
