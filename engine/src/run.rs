//! One generation: configuration resolved and validated, the model loaded (resident, or
//! streamed through the core's decode step over O_DIRECT lanes), the prompt prefilled, tokens
//! decoded and sampled, and every token reported through the core's telemetry (progress
//! lines, CSV, route/io traces, end-of-run report).

use crate::arch::qwen3moe::{Qwen3Moe, State, Weights};
use crate::arena::ArenaOptions;
use crate::cli::RunArgs;
use crate::flash::{LaneFlash, MonotonicClock};
use crate::gguf::GgufFile;
use crate::stream::{arena_for, layout_of, EngineBackend};
use anyhow::{anyhow, bail, Result};
use bmoe_core::config::{auto_cache_budget, RunConfig, MIB};
use bmoe_core::faults::{RetryFlash, READ_RETRIES};
use bmoe_core::ledger::{Ledger, MemPicture};
use bmoe_core::records::{Phase, RecordSink};
use bmoe_core::telemetry::io_trace::IoTraceWriter;
use bmoe_core::telemetry::report::{write_report, ReportContext};
use bmoe_core::telemetry::route_trace::{RoutePreamble, RouteTraceWriter, TraceLayer};
use bmoe_core::telemetry::run::RunTelemetry;
use bmoe_core::telemetry::sinks::TraceTee;
use bmoe_core::testing::{Fault, FaultyFlash};
use bmoe_core::{Engine, ExpertCache, StepInput, StepStats, StreamConfig};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// The engine's device: the O_DIRECT lanes (which inject `--inject-faults` and time reads
/// out), behind the core's retry of EIO and short reads, behind the single-read spoiler of
/// `--inject-read-fault` (which spoils nothing unless asked to).
type Device = FaultyFlash<RetryFlash<LaneFlash>>;
type Streamed = Engine<MonotonicClock, Device, EngineBackend>;

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

/// The model, resident (every expert read from the memory map) or streamed by the core.
#[allow(clippy::large_enum_variant)] // one per run; boxing the state buys nothing
pub enum Runner {
    Resident { model: Qwen3Moe, state: State },
    Streamed(Box<Streamed>),
}

impl Runner {
    /// Run one batch. `all_logits` asks for every row's logits (for `--logits-out`).
    pub fn step(
        &mut self,
        input: &StepInput<'_>,
        all_logits: bool,
        sink: &mut dyn RecordSink,
    ) -> Result<StepStats> {
        let stats = self.forward(input, all_logits, sink)?;
        // NaN logits would sample token 0 forever and exit 0: stop, naming the step.
        crate::finite::check_logits(self.logits(), input)?;
        Ok(stats)
    }

    fn forward(
        &mut self,
        input: &StepInput<'_>,
        all_logits: bool,
        sink: &mut dyn RecordSink,
    ) -> Result<StepStats> {
        match self {
            Runner::Resident { model, state } => {
                let t = Instant::now();
                let n = input.tokens.len() as u32;
                let rows: Vec<u32> = if all_logits {
                    (0..n).collect()
                } else {
                    vec![n - 1]
                };
                model.forward_resident(state, input.tokens, input.positions, &rows)?;
                Ok(StepStats {
                    tokens: n,
                    wall: bmoe_core::Nanos(t.elapsed().as_nanos() as u64),
                    ..Default::default()
                })
            }
            Runner::Streamed(e) => {
                e.backend_mut().all_logits = all_logits;
                Ok(e.step(input, sink)?)
            }
        }
    }

    /// Logits of the last batch's output rows (`rows × n_vocab`).
    pub fn logits(&self) -> &[f32] {
        match self {
            Runner::Resident { state, .. } => &state.logits,
            Runner::Streamed(e) => &e.backend().state.logits,
        }
    }

    fn dense_ranges(&self) -> Vec<(*const u8, usize)> {
        match self {
            Runner::Resident { model, .. } => model.w.dense_ranges(),
            Runner::Streamed(e) => e.backend().model.w.dense_ranges(),
        }
    }

    /// What the device went through: retried reads, injected faults (one line each).
    fn device_notes(&self) -> Vec<String> {
        let Runner::Streamed(e) = self else {
            return Vec::new();
        };
        let retry = e.flash().inner();
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

    fn cache(&self) -> Option<&ExpertCache> {
        match self {
            Runner::Resident { .. } => None,
            Runner::Streamed(e) => Some(e.cache()),
        }
    }
}

fn mem_picture(dense: &mut crate::probe::DenseResidency) -> MemPicture {
    let ru = crate::probe::rusage();
    let ps = crate::probe::proc_status();
    let mi = crate::probe::meminfo();
    MemPicture {
        majflt_total: ru.majflt,
        cpu_ms_total: ru.cpu_s * 1000.0,
        dense_resident_frac: dense.sample(),
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

/// What a generation produced, for callers that run it in-process (the gates).
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// 0 on success; non-zero when a step failed (the output is not trustworthy).
    pub code: i32,
    /// Generated token ids (the end-of-generation token included when one was sampled).
    pub tokens: Vec<u32>,
    /// The answer text (reasoning excluded).
    pub text: String,
    pub summary: Option<bmoe_core::telemetry::summary::RunSummary>,
}

/// Run a generation printing to the process's stdout/stderr; returns the exit code.
pub fn generate(args: &RunArgs, model_path: &Path) -> Result<i32> {
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    Ok(generate_with(args, model_path, &mut stdout.lock(), &mut stderr.lock())?.code)
}

/// Run a generation writing the answer (or progress lines) to `out` and diagnostics and the
/// report to `err` (the report goes to `out` under `--progress`).
pub fn generate_with(
    args: &RunArgs,
    model_path: &Path,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome> {
    let t_load = Instant::now();
    let mut cfg = RunConfig {
        engine_version: env!("CARGO_PKG_VERSION").to_string(),
        ..RunConfig::default()
    };
    cfg.model = model_path.display().to_string();
    cfg.n_predict = args.n_predict;
    cfg.threads = args.threads;
    cfg.n_ctx = args.ctx;
    cfg.chatml = args.chatml;
    cfg.temp = args.temp;
    cfg.top_k = args.top_k as u32;
    cfg.top_p = args.top_p;
    cfg.seed = args.seed;
    args.stream.apply(&mut cfg);
    args.telemetry.apply(&mut cfg);
    cfg.validate()?;
    if args.verify_reads && !cfg.moe_stream {
        bail!("--verify-reads checks the experts streaming reads from flash: add --moe-stream (a resident run reads none)");
    }
    // Every output checked against the model's files and each other, and created, before the
    // model loads: a bad output path costs nothing and never touches an input.
    let mut outputs = crate::outputs::RunOutputs::open(model_path, args)?;

    let file = Arc::new(GgufFile::open(model_path)?);
    cfg.arch = file.architecture().unwrap_or("").to_string();
    let mut weights = Weights::load(file.clone())?;
    // The resident baseline is plain mmap by definition; streaming applies --dense-weights.
    if cfg.moe_stream {
        weights.apply_dense_mode(cfg.dense_weights.into())?;
    } else {
        cfg.dense_weights = bmoe_core::config::DenseWeights::Mmap;
    }
    let hp = weights.hp.clone();
    cfg.n_layer = hp.n_layer as u32;
    cfg.n_expert = hp.n_expert as u32;
    cfg.n_expert_used = if cfg.n_expert_used_override > 0 {
        cfg.n_expert_used_override
    } else {
        hp.n_expert_used as u32
    };
    cfg.validate_model()?;
    let k = cfg.n_expert_used as u16;
    let tok = crate::tokenizer::Tokenizer::from_gguf(&file)?;

    let mut runner = if cfg.moe_stream {
        let layout = layout_of(&weights)?;
        let shard_lens: Vec<u64> = file
            .shard_paths()
            .iter()
            .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
            .collect();
        layout.check_shards(&shard_lens)?;
        cfg.cache_cycle_mb = layout.cache_cycle_bytes(k).div_ceil(MIB);
        let budget = if cfg.cache_auto {
            let mi = crate::probe::meminfo();
            let cg = crate::probe::cgroup_memory();
            auto_cache_budget(
                (mi.mem_available_mib > 0.0).then_some((mi.mem_available_mib * MIB as f64) as u64),
                cg.as_ref().and_then(|c| c.limit_bytes),
                cg.as_ref().map(|c| c.usage_bytes),
                cfg.cache_floor_mb * MIB,
                cfg.cache_ceil_mb * MIB,
                layout.total_expert_bytes(),
            )
        } else {
            cfg.cache_mb * MIB
        };
        cfg.resolve_cache_budget(budget);
        let policy = bmoe_core::policy::by_name(cfg.eviction.name())
            .ok_or_else(|| anyhow!("unknown eviction policy {}", cfg.eviction.name()))?;
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
        let mut flash =
            LaneFlash::open(&paths, cfg.io_threads, cfg.o_direct, arena.clone(), clock)?;
        flash.set_read_timeout_ms(cfg.read_timeout_ms);
        if let Some(plan) = &cfg.inject_faults {
            flash.set_faults(plan.clone());
        }
        for w in flash.warnings() {
            writeln!(err, "bmoe: warning: {w}")?;
        }
        cfg.o_direct = flash.o_direct_achieved();
        let (nth, fault) = match &args.inject_read_fault {
            Some(f) => parse_fault(f)?,
            None => (u64::MAX, Fault::Eio),
        };
        let flash = FaultyFlash::new(RetryFlash::new(flash, READ_RETRIES), nth, fault);
        let mut model = Qwen3Moe::new(weights, args.threads as usize);
        model.set_check_finite(args.check_finite);
        let state = model.new_state(args.ctx as usize);
        let mut backend = EngineBackend::new(model, state, arena, layout.clone());
        if args.verify_reads {
            let path = crate::checksum::sidecar_path(model_path);
            backend.set_verify(crate::checksum::load(&path, &file, &layout)?);
        }
        let mut e = Engine::new(
            clock,
            flash,
            backend,
            layout,
            cache,
            StreamConfig {
                overlap: cfg.overlap,
                load_all: cfg.load_all,
                read_split: cfg.read_split,
                prefetch: cfg.prefetch,
            },
        )?;
        // Top-k override, substitution, dropping, in that order (qwen3moe renormalises).
        for hook in bmoe_core::hooks::router_hooks(&cfg, hp.n_expert_used as u32, true) {
            e.add_hook(hook);
        }
        // --predict-log, --predict-prefetch, --route-ahead (committed before the hooks above
        // run), --prefetch-sync.
        e.set_predictors(bmoe_core::PredictConfig::from_run_config(&cfg));
        Runner::Streamed(Box::new(e))
    } else {
        let mut model = Qwen3Moe::new(weights, args.threads as usize);
        model.set_check_finite(args.check_finite);
        if cfg.n_expert_used_override > 0 {
            model.set_top_k(cfg.n_expert_used_override as usize);
        }
        let state = model.new_state(args.ctx as usize);
        Runner::Resident { model, state }
    };
    // The drop-at-narrow-top-k and cache-cycle warnings, once, each already a full line.
    for w in cfg.load_warnings() {
        writeln!(err, "{w}")?;
    }

    let prompt = if args.chatml {
        let tpl = file
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .ok_or_else(|| {
                anyhow!(
                    "--chatml: {} has no tokenizer.chat_template",
                    model_path.display()
                )
            })?;
        let ct = crate::chat::ChatTemplate::new(tpl, &tok.bos_text(), &tok.eos_text())?;
        ct.render(
            &[crate::chat::Message::new("user", args.prompt.clone())],
            true,
            Some(!args.no_think),
        )?
    } else {
        args.prompt.clone()
    };
    let mut tokens = tok.encode(&prompt, args.chatml)?;
    if tokens.is_empty() {
        bail!("the prompt is empty after tokenization: pass -p TEXT");
    }
    let n_ctx = args.ctx as usize;
    if tokens.len() + args.n_predict as usize > n_ctx {
        bail!(
            "prompt of {} tokens plus -n {} exceeds the context size {} (-c {})",
            tokens.len(),
            args.n_predict,
            n_ctx,
            n_ctx
        );
    }
    let load_s = t_load.elapsed().as_secs_f64();

    // Sinks.
    let mut csv = outputs.csv.take();
    let mut route = match (outputs.route_trace.take(), &runner) {
        (Some(w), Runner::Streamed(e)) => {
            let layers = e
                .layout()
                .layers()
                .iter()
                .map(|l| TraceLayer {
                    layer: l.model_layer,
                    expert_bytes: l.projections.iter().map(|p| p.stride_bytes).sum(),
                    dense_bytes: l.dense_bytes,
                    proj: l
                        .projections
                        .iter()
                        .map(|p| bmoe_core::telemetry::route_trace::ProjExtent {
                            shard: p.shard as u32,
                            offset: p.base_offset,
                            stride: p.stride_bytes,
                        })
                        .collect(),
                })
                .collect();
            let pre = RoutePreamble {
                model: cfg.model.clone(),
                arch: cfg.arch.clone(),
                n_layer: cfg.n_layer,
                n_expert: cfg.n_expert,
                n_expert_used: cfg.n_expert_used,
                layers,
                notes: Vec::new(),
                extra: Vec::new(),
            };
            Some(RouteTraceWriter::with_predictions(
                w,
                &pre,
                bmoe_core::telemetry::route_trace::PredColumns::for_config(&cfg),
            )?)
        }
        _ => None,
    };
    let mut io = match outputs.io_trace.take() {
        Some(w) => Some(IoTraceWriter::new(w)?),
        None => None,
    };
    let mut telemetry = RunTelemetry::new();
    if let Some(w) = csv.as_mut() {
        telemetry.write_csv_preamble(&cfg, w)?;
    }
    telemetry.begin_generation();
    let progress = args.telemetry.progress;
    let mut logits_out = outputs.logits.take();
    let all_logits = logits_out.is_some();

    // Prefill.
    let n_prompt = tokens.len();
    let positions: Vec<u32> = (0..n_prompt as u32).collect();
    let mut ledger = Ledger::new(
        cfg.overlap,
        runner.cache().map(|c| c.budget_bytes()).unwrap_or(0),
        0,
        args.n_predict,
    );
    // Dense residency by mincore, throttled: at most every 16 tokens and 250 ms.
    let mut dense = crate::probe::DenseResidency::new(&runner.dense_ranges(), 16, 250);
    let m0 = mem_picture(&mut dense);
    let t_prefill = Instant::now();
    let st = {
        let mut tee = TraceTee {
            route: route.as_mut().map(|r| r as &mut dyn RecordSink),
            io: io.as_mut().map(|r| r as &mut dyn RecordSink),
        };
        runner.step(
            &StepInput {
                turn: 0,
                phase: Phase::Prefill,
                tokens: &tokens,
                positions: &positions,
            },
            all_logits,
            &mut tee,
        )
    };
    let st = match st {
        Ok(s) => s,
        Err(e) => {
            for n in runner.device_notes() {
                writeln!(err, "{n}")?;
            }
            return fail(progress, e, out, err);
        }
    };
    let prefill_s = t_prefill.elapsed().as_secs_f64();
    let m1 = mem_picture(&mut dense);
    ledger.prefill(&st, &m0, &m1);
    let nv = hp.n_vocab;
    if let Some(w) = logits_out.as_mut() {
        for v in runner.logits() {
            w.write_all(&v.to_le_bytes())?;
        }
    }

    let mut sampler = crate::sample::Sampler::new(crate::sample::SamplerConfig {
        temp: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    });
    let last = runner.logits();
    let mut next = sampler.sample(&last[last.len() - nv..]);
    let mut dec = crate::tokenizer::StreamDecoder::new();
    let mut split =
        crate::chat::ReasoningSplitter::for_prompt(if args.chatml { &prompt } else { "" });
    let (mut reasoning, mut text) = (String::new(), String::new());
    let mut generated: Vec<u32> = Vec::new();
    let mut t_prev_end = Instant::now();
    let mut failed = None;
    for i in 0..args.n_predict as usize {
        generated.push(next);
        let eog = tok.is_eog(next);
        if !eog {
            let piece = dec.push(&tok, next);
            let d = if args.chatml {
                split.push(&piece)
            } else {
                crate::chat::Delta {
                    text: piece,
                    ..Default::default()
                }
            };
            if d.reset {
                reasoning = d.reasoning.clone();
                text = d.text.clone();
            } else {
                reasoning.push_str(&d.reasoning);
                text.push_str(&d.text);
            }
            if !progress {
                out.write_all(d.text.as_bytes())?;
                out.flush()?;
            }
        }
        if eog || i + 1 == args.n_predict as usize {
            break;
        }
        let pos = tokens.len() as u32;
        tokens.push(next);
        let loop_ms = t_prev_end.elapsed().as_secs_f64() * 1000.0;
        let r = {
            let mut tee = TraceTee {
                route: route.as_mut().map(|r| r as &mut dyn RecordSink),
                io: io.as_mut().map(|r| r as &mut dyn RecordSink),
            };
            runner.step(
                &StepInput {
                    turn: 0,
                    phase: Phase::Decode,
                    tokens: &[next],
                    positions: &[pos],
                },
                all_logits,
                &mut tee,
            )
        };
        let s = match r {
            Ok(s) => s,
            Err(e) => {
                ledger.io_error();
                failed = Some(e);
                break;
            }
        };
        t_prev_end = Instant::now();
        let rec = ledger.token(&s, &mem_picture(&mut dense), loop_ms);
        telemetry.token(
            &rec,
            &reasoning,
            &text,
            if progress {
                Some(&mut *out as &mut dyn Write)
            } else {
                None
            },
            csv.as_mut().map(|w| w as &mut dyn Write),
        )?;
        if let Some(w) = logits_out.as_mut() {
            for v in runner.logits() {
                w.write_all(&v.to_le_bytes())?;
            }
        }
        next = sampler.sample(&runner.logits()[runner.logits().len() - nv..]);
    }
    let tail = dec.flush();
    if !tail.is_empty() {
        let d = if args.chatml {
            split.push(&tail)
        } else {
            crate::chat::Delta {
                text: tail,
                ..Default::default()
            }
        };
        text.push_str(&d.text);
        reasoning.push_str(&d.reasoning);
        if !progress {
            out.write_all(d.text.as_bytes())?;
        }
    }
    if !progress {
        writeln!(out)?;
    }
    let tail_ms = t_prev_end.elapsed().as_secs_f64() * 1000.0;
    let layer_demand = match &runner {
        Runner::Streamed(e) => e.layout().layer_demand_bytes(k),
        _ => 0,
    };
    let counters = match runner.cache() {
        Some(c) => ledger.counters(
            c,
            layer_demand,
            n_prompt as u64,
            tokens.len() as u64,
            load_s,
            prefill_s,
            tail_ms,
        ),
        None => bmoe_core::telemetry::summary::RunCounters {
            n_prompt: n_prompt as u64,
            load_s,
            prefill_s,
            cache_hit_pct: -1.0,
            loop_overhead_tail_ms: tail_ms,
            ..Default::default()
        },
    };
    let summary = telemetry.finish(counters, csv.as_mut().map(|w| w as &mut dyn Write))?;
    for n in runner.device_notes() {
        writeln!(err, "{n}")?;
    }
    let ctx = ReportContext {
        progress,
        answer: &text,
        arch_streamable: true,
    };
    if progress {
        write_report(out, &cfg, &summary, &ctx)?;
    } else {
        write_report(err, &cfg, &summary, &ctx)?;
    }
    if let Some(mut w) = csv {
        w.flush()?;
    }
    if let Some(r) = route.take() {
        r.finish()?;
    }
    if let Some(w) = io.take() {
        w.finish()?.flush()?;
    }
    if let (Some(mut w), Some(mut json)) = (logits_out, outputs.logits_json.take()) {
        w.flush()?;
        let mut ids: Vec<u32> = tokens[..n_prompt].to_vec();
        ids.extend(generated.iter().take(generated.len().saturating_sub(1)));
        let side = serde_json::json!({
            "n_vocab": nv, "n_prompt": n_prompt, "rows": ids.len(), "dtype": "f32le",
            "token_ids": ids, "note": "row i holds the logits after feeding token_ids[..=i]"
        });
        json.write_all(serde_json::to_string_pretty(&side)?.as_bytes())?;
    }
    if let Some(e) = failed {
        return fail(progress, e, out, err);
    }
    out.flush()?;
    Ok(Outcome {
        code: 0,
        tokens: generated,
        text,
        summary: Some(summary),
    })
}

/// A failed step: the output is not trustworthy. Say so loudly and exit non-zero.
fn fail(
    progress: bool,
    e: anyhow::Error,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome> {
    let _ = out.flush();
    let text = bmoe_core::telemetry::fmt::error_text(e.as_ref());
    writeln!(err, "bmoe: FAILED: {text}")?;
    writeln!(err, "moe-stream: generation stopped by a failed read or step - this run's output is not trustworthy")?;
    if progress {
        writeln!(
            out,
            "BMOE_ERROR {}",
            serde_json::json!({"id": 0, "fatal": true, "msg": text})
        )?;
    }
    Ok(Outcome {
        code: 3,
        ..Outcome::default()
    })
}
