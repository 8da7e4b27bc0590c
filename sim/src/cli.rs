//! The `bmoe-sim` command line. `run` is the whole program behind a testable signature
//! (arguments, environment and the two output streams in, exit code out), so the gates can run
//! it in-process and compare its bytes.
//!
//! The streaming, cache and telemetry flags are the core's `StreamArgs` / `TelemetryArgs`,
//! flattened exactly as `bmoe-cli` flattens them, and turned into the same `RunConfig` and
//! judged by the same `validate()`; so a flag means the same thing in both binaries.
//!
//! Exit codes: 0 success; 1 an error (bad input, a refused configuration), or for `diff` a
//! comparison outside its tolerances; 2 a usage error (clap's code for a bad flag or value).

use crate::error::SimError;
use crate::plan::{layout_from_preamble, AccessSeq, ReplayPlan};
use crate::predictions::{self, PredictorReplay, RecordedPredictions};
use crate::profile::{DeviceProfile, DEFAULT_PROFILE};
use crate::replay::{self, ReplayOutputs, ReplaySetup};
use bmoe_core::config::{auto_cache_budget, RunConfig, SpecMode, MIB};
use bmoe_core::telemetry::io_trace::IoTraceWriter;
use bmoe_core::telemetry::report::{write_report, ReportContext};
use bmoe_core::telemetry::route_trace::{
    PredColumns, RoutePreamble, RouteTrace, RouteTraceWriter, StepColumns, SPEC_KEY,
};
use bmoe_core::{records::RecordSink, ExpertLayout};
use bmoe_flags::{
    apply_env_fallbacks, parse_decimal_strict, parse_u32_strict, parse_u64_strict, StreamArgs,
    TelemetryArgs,
};
use clap::{Args, Parser, Subcommand};
use std::ffi::OsString;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    name = "bmoe-sim",
    version,
    about = "Replay MoE route traces through the bmoe core on a modelled device",
    long_about = "Replay MoE route traces through the very same core bmoe-cli runs (expert cache, \
policies, streamer, telemetry), on a virtual clock with a modelled flash device and compute model. \
Hits, misses, evictions and read bytes are exact; times are modelled from a device profile.\n\n\
  bmoe-sim replay --trace T.csv --cache-mb 4000 --csv sim.csv\n\
  bmoe-sim whatif --trace T.csv --model other.layout.csv --device ufs40-phone --cache-mb 2000\n\
  bmoe-sim sweep --trace T.csv --out sweep\n\
  bmoe-sim diff sim.csv measured.csv\n\
  bmoe-sim calibrate --csv run.csv --trace run.route.csv --out profile.json\n\
  bmoe-sim stats --trace T.csv --out stats\n\
  bmoe-sim convert capture.jsonl --expert-bytes 5609472 --out T.csv"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Replay a route trace and write the same CSV, traces and report lines as bmoe-cli
    /// (the simulator always streams: --moe-stream is implied). A batched server run's trace
    /// (serve --parallel, its seq column) replays step by step: a `batched:` report, no CSV
    Replay(ReplayArgs),
    /// Predict a model and device that were never run together: a recorded routing priced with
    /// another model's expert and dense bytes (its layout) and another device's profile; a
    /// routing of another shape is mapped onto the model's (stated in the output, with the
    /// locality the mapped routing carries: the prediction assumes the model routes like the
    /// trace's, and one whose router keeps more experts from token to token runs faster)
    Whatif(WhatifArgs),
    /// Replay a trace over a grid of budgets x policies (with the Belady bound) x lanes x overlap
    Sweep(SweepArgs),
    /// Global LRU's miss-ratio curve: hits, misses and hit rate at every cache budget from one
    /// pass of the trace, exact (each budget counts what a cache-only replay at it counts)
    #[command(
        long_about = "Global LRU's miss-ratio curve over every cache budget, from one pass of \
the trace: stack distances (Mattson et al. 1970) under the core's admission rule, where a \
(step, MoE layer) looks every routed expert up before it admits any miss. The order that rule \
leaves a layer's experts in depends on which of them hit, so one stack cannot serve every budget \
and a larger budget can miss what a smaller one hits; each lookup therefore carries the budgets \
at which it hits. The result is exact: at every budget it counts what a cache-only replay of the \
core's cache with the lru policy counts (hits, misses, evictions, re-reads, inserts; prefill \
waves included). Budgets are listed in experts per MoE layer (N x MoE layers x the largest \
expert's bytes) and in bytes; between 0 (the cache off) and the layer demand (top-k experts of \
the widest layer) the cache takes no budget.\n\n\
  bmoe-sim mrc --trace T.csv\n\
  bmoe-sim mrc --trace T.csv --points all --csv mrc.csv --plot mrc"
    )]
    Mrc(MrcArgs),
    /// Measure replay speed: routings per second per core, cache-only and full timing
    Bench(BenchArgs),
    /// Compare a simulated CSV with a measured one: counts exactly, times within tolerances
    Diff(DiffArgs),
    /// Fit a device profile to a measured bmoe-cli run, and check that it replays that run
    /// (a WARNING when it misses; exit 3 then with --fail-on-misfit)
    Calibrate(CalibrateArgs),
    /// Trace statistics: per-layer expert popularity, reuse (stack) distance = the per-layer
    /// LRU miss-ratio curve, previous-token overlap by lag, working set vs window; with plots
    Stats(StatsArgs),
    /// Convert a routing capture (JSONL of per-token per-layer expert ids, or a long CSV with
    /// one row per token and layer) into a route_trace v1 file the simulator replays
    Convert(ConvertArgs),
    /// Draw a grouped bar chart (SVG and PNG) from a JSON description: the benchmark suite's
    /// plot (scripts/bench-suite.py), so it needs no Python plotting library
    Bars(BarsArgs),
    /// Randomised simulation testing of the core: each seed picks a synthetic trace, a
    /// configuration and a fault schedule, replays it, and checks the invariants after every
    /// step (docs/reliability.md). A failing seed is the bug report: --seed N reproduces it
    Fuzz(FuzzArgs),
}

/// Flags of `bmoe-sim bars`.
#[derive(Args, Debug, Clone)]
pub struct BarsArgs {
    /// The chart: {"title", "y_label", "log_y", "groups": [{"name", "bars": [{"series",
    /// "value"}]}]} (see sim/src/bars.rs); a null value leaves its slot empty
    #[arg(long, value_name = "CHART.json")]
    pub json: PathBuf,
    /// Output path without extension: writes STEM.svg and STEM.png
    #[arg(long, value_name = "STEM")]
    pub out: PathBuf,
}

/// Flags of `bmoe-sim stats`.
#[derive(Args, Debug, Clone)]
pub struct StatsArgs {
    /// The route trace
    #[arg(long, value_name = "PATH")]
    pub trace: PathBuf,
    /// Directory for stats.md, the CSVs (popularity, reuse, overlap, working_set) and their
    /// charts (.svg and .png)
    #[arg(long, value_name = "DIR", default_value = "stats")]
    pub out: PathBuf,
}

/// Flags of `bmoe-sim convert`.
#[derive(Args, Debug, Clone)]
pub struct ConvertArgs {
    /// The capture: JSONL (one object per token: {"turn", "step", "experts": [[ids per MoE
    /// layer]], "weights"}) or CSV (one row per token and layer: turn/prompt, step/token,
    /// layer, experts or expert_0..; see docs/simulator.md)
    #[arg(value_name = "INPUT")]
    pub input: PathBuf,
    /// Where to write the route trace
    #[arg(long, value_name = "OUT.route.csv")]
    pub out: PathBuf,
    /// Input format (auto: by extension, .jsonl/.json/.ndjson or .csv)
    #[arg(long, value_name = "auto|jsonl|csv", default_value = "auto", value_parser = ["auto", "jsonl", "csv"])]
    pub format: String,
    /// Bytes of one expert (every projection) as the model file stores it: what a miss reads
    #[arg(long, value_name = "BYTES", value_parser = parse_u64_strict)]
    pub expert_bytes: u64,
    /// Dense (non-expert) bytes per layer
    #[arg(long, value_name = "BYTES", default_value_t = 0, value_parser = parse_u64_strict)]
    pub dense_bytes: u64,
    /// Experts per MoE layer [default: the largest id seen + 1]
    #[arg(long, value_name = "N", value_parser = parse_u32_strict)]
    pub n_expert: Option<u32>,
    /// Routed experts per token [default: the first routing's width]
    #[arg(long, value_name = "K", value_parser = parse_u32_strict)]
    pub top_k: Option<u32>,
    /// JSONL: model layer id of the first MoE layer (e.g. 1 when layer 0 is dense)
    #[arg(long, value_name = "L", default_value_t = 0, value_parser = parse_u32_strict)]
    pub first_layer: u32,
    /// The model's layer count [default: last MoE layer + 1]
    #[arg(long, value_name = "N", value_parser = parse_u32_strict)]
    pub n_layer: Option<u32>,
    /// Model name for the preamble [default: the input's file stem]
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// Architecture name for the preamble
    #[arg(long, value_name = "ARCH", default_value = "unknown")]
    pub arch: String,
    /// How the captured model's router turned logits into weights, for the preamble's
    /// `gating=` (the hooks apply it on replay): softmax_topk_norm (qwen3moe), softmax_topk
    /// (qwen2moe, DeepSeek-V2), topk_softmax (Mixtral, gpt-oss), sigmoid_topk[_norm], with
    /// `*SCALE` when the weights are scaled
    #[arg(long, value_name = "GATING", default_value = "softmax_topk_norm")]
    pub gating: bmoe_core::gating::Gating,
    /// Provenance lines for the trace's `# note:` (repeatable)
    #[arg(long, value_name = "TEXT")]
    pub note: Vec<String>,
}

/// Flags of `bmoe-sim fuzz`.
#[derive(Args, Debug, Clone)]
pub struct FuzzArgs {
    /// The first seed
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_u64_strict)]
    pub seed: u64,
    /// How many seeds, from --seed on
    #[arg(long, value_name = "M", default_value_t = 1, value_parser = parse_u64_strict)]
    pub seeds: u64,
    /// Print each seed's configuration
    #[arg(long)]
    pub verbose: bool,
}

/// Flags of `bmoe-sim calibrate`.
#[derive(Args, Debug, Clone)]
pub struct CalibrateArgs {
    /// The measured run's `--csv` (with --sweep: once per run)
    #[arg(long, value_name = "RUN.csv", required = true)]
    pub csv: Vec<PathBuf>,
    /// The run's `--io-trace` (the reads as measured; with --sweep: none, or one per --csv in
    /// the same order)
    #[arg(long, value_name = "IO.csv")]
    pub io_trace: Vec<PathBuf>,
    /// The run's `--route-trace` (what each token read and computed; without it compute is a
    /// fixed time per token; with --sweep: one per --csv in the same order)
    #[arg(long, value_name = "ROUTE.csv")]
    pub trace: Vec<PathBuf>,
    /// Fit one profile over several runs (e.g. 2-3 budgets or policies, one I/O configuration)
    /// by least squares over all their tokens, and report its leave-one-run-out error
    #[arg(long)]
    pub sweep: bool,
    /// The fit before issue 19, for comparison: compute as one rate with the lanes' cost
    /// folded in at the calibration run's read volume (no slowdown while reading, no lane
    /// dispatch time), flash a mean rate without the measured spread of read times (it does not
    /// hold at other read volumes)
    #[arg(long)]
    pub single_rate: bool,
    /// Where to write the profile (JSON)
    #[arg(long, value_name = "PROFILE.json")]
    pub out: PathBuf,
    /// The profile's name
    #[arg(long, value_name = "NAME", default_value = "calibrated")]
    pub name: String,
    /// Profile whose unfitted fields (alignment) the result keeps
    #[arg(long, value_name = "NAME|PATH", default_value = "this-machine")]
    pub base: String,
    /// Exit 3 when the fitted profile misses its own calibration run beyond the self-check's
    /// tolerances (10 % on tok/s, 25 % on the wall time's p90); without it the WARNING is
    /// printed and calibrate exits 0
    #[arg(long)]
    pub fail_on_misfit: bool,
}

/// `calibrate --fail-on-misfit`'s exit code when the fitted profile misses the run it was
/// fitted on beyond the self-check's tolerances (`calibrate::SelfCheck`). The profile is
/// written all the same, for inspection. Distinct from 1 (an error) and 2 (usage). Without the
/// flag the check only reports (a WARNING, exit 0): a run measured on a loaded machine can
/// miss its own fit by noise alone.
pub const EXIT_MISFIT: i32 = 3;

/// Flags of `bmoe-sim diff`.
#[derive(Args, Debug, Clone)]
pub struct DiffArgs {
    /// The simulated run's `--csv` (bmoe-sim replay)
    #[arg(value_name = "SIM.csv")]
    pub sim: PathBuf,
    /// The measured run's `--csv` (bmoe-cli)
    #[arg(value_name = "MEASURED.csv")]
    pub measured: PathBuf,
    /// Also draw both per-token wall and I/O series into this SVG
    #[arg(long, value_name = "PATH")]
    pub svg: Option<PathBuf>,
    /// Judge only what must be equal (rows, read_bytes, cache_hit_pct, summary counts)
    #[arg(long)]
    pub exact_only: bool,
    /// Tolerance on decode tok/s (relative)
    #[arg(long, value_name = "F", default_value_t = 0.15, value_parser = parse_decimal_strict)]
    pub tol_tok_s: f32,
    /// Tolerance on the per-token wall time's median (relative)
    #[arg(long, value_name = "F", default_value_t = 0.15, value_parser = parse_decimal_strict)]
    pub tol_wall_p50: f32,
    /// Tolerance on the per-token wall time's 90th percentile (relative)
    #[arg(long, value_name = "F", default_value_t = 0.25, value_parser = parse_decimal_strict)]
    pub tol_wall_p90: f32,
    /// Tolerance on the per-token wall time's mean absolute percentage error
    #[arg(long, value_name = "F", default_value_t = 0.2, value_parser = parse_decimal_strict)]
    pub tol_wall_mape: f32,
    /// Tolerance on the per-token io_ms MAPE
    #[arg(long, value_name = "F", default_value_t = 0.3, value_parser = parse_decimal_strict)]
    pub tol_io_mape: f32,
    /// Tolerance on the per-token stall_ms MAPE
    #[arg(long, value_name = "F", default_value_t = 0.5, value_parser = parse_decimal_strict)]
    pub tol_stall_mape: f32,
}

/// Flags of `bmoe-sim sweep`.
#[derive(Args, Debug, Clone)]
pub struct SweepArgs {
    /// The route trace to replay
    #[arg(long, value_name = "PATH")]
    pub trace: PathBuf,
    /// Device profile: a built-in name or a JSON file [default: origin-12gb-phone]
    #[arg(long, value_name = "NAME|PATH")]
    pub profile: Option<String>,
    /// Seed of the jitter streams
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_u64_strict)]
    pub seed: u64,
    /// Override the profile's flash and compute jitter, in [0, 1)
    #[arg(long, value_name = "F", value_parser = parse_decimal_strict)]
    pub jitter: Option<f32>,
    /// Price the trace's experts with another file's layout (`bmoe-cli inspect MODEL
    /// --layout-out L.csv`, or a run's route trace): its MoE layers and experts per layer must
    /// match the trace's (as `replay --layout-from`)
    #[arg(long, value_name = "PATH")]
    pub layout_from: Option<PathBuf>,
    /// Budgets as experts per MoE layer (N x layers x expert bytes) [default: top-k up to the
    /// whole layer]
    #[arg(long, value_name = "N,...", value_delimiter = ',', value_parser = parse_u32_strict)]
    pub experts_per_layer: Vec<u32>,
    /// Budgets in MiB (instead of --experts-per-layer)
    #[arg(long, value_name = "MIB,...", value_delimiter = ',', value_parser = parse_u64_strict, conflicts_with = "experts_per_layer")]
    pub budgets_mb: Vec<u64>,
    /// Eviction policies: every one the core registers (as `--eviction` takes them) and
    /// belady, the clairvoyant bound [default: all]
    #[arg(long, value_name = "NAME,...", value_delimiter = ',', value_parser = policies_parser())]
    pub policies: Vec<String>,
    /// I/O lane counts [default: 1,4]
    #[arg(long, value_name = "N,...", value_delimiter = ',', value_parser = parse_u32_strict)]
    pub lanes: Vec<u32>,
    /// Overlap settings to sweep: off, on or both [default: both]
    #[arg(long, value_name = "off|on|both", value_parser = ["off", "on", "both"])]
    pub overlap: Option<String>,
    /// Hit rates only: each cell is a cache-only replay (the core's cache, policy and admission
    /// rule over the trace's access sequence; no flash, compute or clock), over budgets x
    /// policies: 2-20x faster per cell (the policy's own work remains; `bench --cells`
    /// measures it), one cell per point instead of one per lanes/overlap setting. Its counts are the full replay's exactly (without a
    /// predictor, residency does not depend on timing). Nothing timed is made up: sweep.csv and
    /// per_layer.csv say mode cache-only and leave lanes, overlap, read and time columns empty,
    /// pivot.md says so and has no tok/s table, and no tok_s chart is written. Refuses
    /// --lanes, --overlap, --jitter, a predictor other than none, and --profile without
    /// --placements (none of them can change a count)
    #[arg(long)]
    pub cache_only: bool,
    /// Expert predictors to compare: none, prefetch:<K> (previous token), predict-prefetch
    /// (stale gate; the trace must record pred1), route-ahead:<N> (the trace must be recorded
    /// with --route-ahead N or record pred<N>). Belady runs only with none
    #[arg(
        long,
        value_name = "NAME,...",
        value_delimiter = ',',
        default_value = "none"
    )]
    pub predictors: Vec<String>,
    /// Worker threads
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = parse_u32_strict)]
    pub jobs: u32,
    /// Directory for the outputs: sweep.csv (tidy, one row per cell), pivot.md (policy x
    /// budget with deltas against LRU, Belady headroom share and intervals), per_layer.csv/.md,
    /// and hit_rate, tok_s and per_layer charts as .svg and .png
    #[arg(long, value_name = "DIR", default_value = "sweep")]
    pub out: PathBuf,
    /// The budget axis of the charts and the pivot: MiB, experts per MoE layer, or percent of
    /// the expert bank
    #[arg(long, value_name = "mib|experts|pct", default_value = "mib", value_parser = ["mib", "experts", "pct"])]
    pub x: String,
    /// Bootstrap resamples of the trace's turns for the 95 % intervals (0 = none; needs at
    /// least 10 turns)
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = parse_u32_strict)]
    pub bootstrap: u32,
    /// The reordering study: for every budget and core policy, the decode read requests per
    /// token under each placement of the experts in the file — separate (one request per
    /// missed expert and projection, as the streamer reads today), file (the file's order,
    /// adjacent misses merged), coact (a co-activation placement fitted on the trace's first
    /// half, counted on its second), coact-in-sample (fitted on the counted half); writes
    /// placement.csv and placement.md (docs/simulator.md, "Reordering study")
    #[arg(long, value_name = "NAME,...", value_delimiter = ',')]
    pub placements: Vec<String>,
}

/// `sweep --policies`: the core's registry (`bmoe_core::policy::POLICIES`, the list
/// `--eviction` offers), each with its help, then Belady; so `--help` names every policy and an
/// unknown name is a usage error that lists them.
fn policies_parser() -> clap::builder::PossibleValuesParser {
    use clap::builder::{PossibleValue, PossibleValuesParser};
    PossibleValuesParser::new(
        bmoe_core::policy::POLICIES
            .iter()
            .map(|p| PossibleValue::new(p.name).help(p.help))
            .chain(std::iter::once(
                PossibleValue::new(crate::sweep::BELADY).help(
                    "the resident used next furthest in the future: the clairvoyant bound (analysis only)",
                ),
            )),
    )
}

/// Flags of `bmoe-sim mrc`.
#[derive(Args, Debug, Clone)]
pub struct MrcArgs {
    /// The route trace
    #[arg(long, value_name = "PATH")]
    pub trace: PathBuf,
    /// Only the first N turns of the trace (in the order they replay); the rest are left out
    #[arg(long, value_name = "N", value_parser = parse_u32_strict)]
    pub turns: Option<u32>,
    /// The budgets listed (stdout and --csv): layer = the cache off, then every whole number of
    /// experts per MoE layer from the layer demand to the whole layer; all = the cache off, then
    /// every budget at which a count changes (a step function: each row holds up to the next)
    #[arg(long, value_name = "layer|all", default_value = "layer", value_parser = ["layer", "all"])]
    pub points: String,
    /// Write the listed budgets as CSV: budget (bytes, MiB, experts per layer, % of the expert
    /// bank), lookups, hits, misses, evictions, rereads, inserts, hit_rate, miss_ratio,
    /// miss_bytes, resident_bytes
    #[arg(long, value_name = "PATH")]
    pub csv: Option<PathBuf>,
    /// Draw the whole curve (miss ratio against experts per layer) as STEM.svg and STEM.png
    #[arg(long, value_name = "STEM")]
    pub plot: Option<PathBuf>,
}

/// Flags of `bmoe-sim bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// The route trace to replay
    #[arg(long, value_name = "PATH")]
    pub trace: PathBuf,
    /// Replay the trace this many times back to back (one long trace; the cache stays warm)
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = parse_u32_strict)]
    pub repeat: u32,
    /// Cache budget as experts per MoE layer
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = parse_u32_strict)]
    pub experts_per_layer: u32,
    /// Device profile for the full-timing path
    #[arg(long, value_name = "NAME|PATH")]
    pub profile: Option<String>,
    /// Time sweep cells instead: per policy, the sweep's own cells over its default budgets,
    /// full-timing (x its default lanes 1,4 x overlap off,on) and cache-only, the modes
    /// alternating, one thread, best of --reps each; prints each mode's time per cell and their
    /// ratios per cell and per (budget, policy) point, checks that the two modes count the
    /// same (exit 1 if not), and times the one-pass curve (`mrc`) against a cache-only lru cell
    #[arg(long)]
    pub cells: bool,
    /// With --cells: runs of each mode (the best is reported)
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = parse_u32_strict)]
    pub reps: u32,
    /// With --cells: the cells' policies [default: the sweep's, every core policy and belady]
    #[arg(long, value_name = "NAME,...", value_delimiter = ',', value_parser = policies_parser())]
    pub policies: Vec<String>,
}

/// Flags of `bmoe-sim replay`.
#[derive(Args, Debug, Clone)]
pub struct ReplayArgs {
    /// The route trace to replay (route_trace v1, from bmoe-cli --route-trace or another system)
    #[arg(long, value_name = "PATH")]
    pub trace: PathBuf,
    /// Device profile: a built-in name (origin-12gb-phone, ufs40-phone, ufs40-phone-cycles,
    /// laptop-nvme, this-machine) or a JSON file [default: origin-12gb-phone]
    #[arg(long, value_name = "NAME|PATH")]
    pub profile: Option<String>,
    /// Seed of the flash and compute jitter streams (only matters when the profile has jitter)
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_u64_strict)]
    pub seed: u64,
    /// Override the profile's flash and compute jitter, in [0, 1)
    #[arg(long, value_name = "F", value_parser = parse_decimal_strict)]
    pub jitter: Option<f32>,
    /// Re-price the trace's experts with another run's file layout: the `# layer=` lines
    /// (expert bytes, dense bytes, projection extents) of the route trace at PATH — e.g. the
    /// engine's own `--route-trace` of a `--routing-from` run on a model of this trace's routing
    /// shape, so hits, misses and read bytes compare exactly. Its MoE layers and experts per
    /// layer must match the trace's
    #[arg(long, value_name = "PATH")]
    pub layout_from: Option<PathBuf>,
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// Flags of `bmoe-sim whatif`.
#[derive(Args, Debug, Clone)]
pub struct WhatifArgs {
    /// The recorded routing (route_trace v1: a bmoe run's --route-trace, or a converted capture)
    #[arg(long, value_name = "PATH")]
    pub trace: PathBuf,
    /// The model to price it on: its layout (`bmoe-cli inspect MODEL --layout-out L.csv`, which
    /// reads only the file's header) or any route trace of it
    #[arg(long, value_name = "LAYOUT.csv")]
    pub model: PathBuf,
    /// The device: a built-in profile (origin-12gb-phone, ufs40-phone, ufs40-phone-cycles,
    /// laptop-nvme, this-machine) or a JSON profile (e.g. from `bmoe-sim calibrate`)
    #[arg(long, value_name = "NAME|PATH")]
    pub device: String,
    /// Seed of the flash and compute jitter streams (only matters when the profile has jitter)
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_u64_strict)]
    pub seed: u64,
    /// Override the profile's flash and compute jitter, in [0, 1)
    #[arg(long, value_name = "F", value_parser = parse_decimal_strict)]
    pub jitter: Option<f32>,
    /// Price a model with MORE experts per layer than the trace (refused without it): each of
    /// the trace's experts becomes a group of the model's neighbouring experts, and a routing
    /// takes its groups' first members in rank order, then their second members. The trace's
    /// reuse is kept; how the model's own router spreads inside a group is invented, and the
    /// `whatif: mapping` line says so
    #[arg(long)]
    pub split_experts: bool,
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// Run `bmoe-sim` with `args` (program name first) and environment `env`, writing to `out`
/// and `err`. Returns the exit code.
pub fn run<I, T>(args: I, env: &[(String, String)], out: &mut dyn Write, err: &mut dyn Write) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            let code = match e.kind() {
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => 0,
                _ => 2,
            };
            let text = e.render().to_string();
            let _ = if code == 0 {
                out.write_all(text.as_bytes())
            } else {
                err.write_all(text.as_bytes())
            };
            return code;
        }
    };
    let result = match cli.cmd {
        Cmd::Replay(a) => replay(a, env, out, err, None).map(|_| 0),
        Cmd::Whatif(a) => whatif(a, env, out, err, None).map(|_| 0),
        Cmd::Sweep(a) => cmd_sweep(a, env, out, err),
        Cmd::Mrc(a) => cmd_mrc(a, out),
        Cmd::Bench(a) => cmd_bench(a, out),
        Cmd::Diff(a) => cmd_diff(a, out, err),
        Cmd::Calibrate(a) => cmd_calibrate(a, out, err),
        Cmd::Fuzz(a) => cmd_fuzz(a, out, err),
        Cmd::Stats(a) => cmd_stats(a, out),
        Cmd::Convert(a) => cmd_convert(a, out),
        Cmd::Bars(a) => cmd_bars(a, out),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            let _ = writeln!(err, "bmoe-sim: error: {e}");
            1
        }
    }
}

/// Read and parse a route trace, naming the file in errors.
fn read_trace(path: &Path) -> Result<RouteTrace, SimError> {
    let text = std::fs::read_to_string(path).map_err(|e| SimError::io(path, e))?;
    RouteTrace::parse(&text).map_err(|source| SimError::Parse {
        path: path.to_path_buf(),
        source,
    })
}

/// Read and check a route trace. A trace with a preamble and no rows is refused: replaying
/// it would report a run of 0 tokens as a success.
pub fn load_trace(path: &Path) -> Result<RouteTrace, SimError> {
    let trace = read_trace(path)?;
    if trace.cells.is_empty() {
        return Err(SimError::invalid(
            format!("route trace {}", path.display()),
            "it has a preamble but no rows: nothing to replay (was its run stopped before the first step?)",
        ));
    }
    let spec = trace.preamble.extra.iter().find(|(k, _)| k == SPEC_KEY);
    if let (Some((_, v)), false) = (spec, trace.has_group_column()) {
        return Err(SimError::invalid(
            format!("route trace {}", path.display()),
            format!(
                "it was recorded with speculative decoding (spec={v}) but has no group column: \
                 its verify decodes cannot be told from plain ones; record it with this \
                 bmoe-cli, which numbers its steps"
            ),
        ));
    }
    Ok(trace)
}

/// Read the layout of a model: a route trace of it (its `# layer=` lines), with or without
/// rows — `bmoe-cli inspect MODEL --layout-out` writes one with none.
pub fn load_layout(path: &Path) -> Result<RoutePreamble, SimError> {
    Ok(read_trace(path)?.preamble)
}

/// How `prepare` prices a trace's experts.
#[derive(Clone, Copy, Debug)]
pub enum Reprice<'a> {
    /// With the trace's own layout.
    Own,
    /// `replay --layout-from`: another run's layout; the routing shape must be the same.
    Layout(&'a Path),
    /// `whatif --model`: another model's layout; a routing of another shape is mapped onto it
    /// (`whatif::map_routing`; onto more experts per layer only with `--split-experts`, the
    /// flag).
    Model(&'a Path, bool),
}

/// Where the experts' bytes of a re-priced trace came from: the layout file, and the model
/// and architecture its preamble names (not the trace's, which a same-shape re-pricing keeps
/// for the report).
#[derive(Clone, Debug)]
pub struct LayoutSource {
    pub path: PathBuf,
    pub model: String,
    pub arch: String,
}

/// What `reprice` did: how a routing was mapped and the locality it carries
/// (`whatif::locality_note`), when it was; and the layout the bytes came from, when not the
/// trace's own.
#[derive(Default)]
struct Repriced {
    mapping: Option<(String, String)>,
    layout_source: Option<LayoutSource>,
}

/// Re-price `trace` as `how` says.
fn reprice(trace: &mut RouteTrace, how: Reprice<'_>) -> Result<Repriced, SimError> {
    let (other, map, split) = match how {
        Reprice::Own => return Ok(Repriced::default()),
        Reprice::Layout(p) => (p, false, false),
        Reprice::Model(p, split) => (p, true, split),
    };
    let model = load_layout(other)?;
    let layout_source = Some(LayoutSource {
        path: other.to_path_buf(),
        model: model.model.clone(),
        arch: model.arch.clone(),
    });
    if map && !crate::whatif::same_shape(&trace.preamble, &model) {
        let (mapped, how) =
            crate::whatif::map_routing(trace, &model, &other.display().to_string(), split)?;
        let locality = crate::whatif::locality_note(trace, &mapped);
        *trace = mapped;
        return Ok(Repriced {
            mapping: Some((how, locality)),
            layout_source,
        });
    }
    let (have, want) = (&model, &trace.preamble);
    if have.layers.len() != want.layers.len() || have.n_expert != want.n_expert {
        return Err(SimError::invalid(
            format!("--layout-from {}", other.display()),
            format!(
                "its layout has {} MoE layers of {} experts, the trace {} of {}: a layout re-prices \
                 only a trace of its own routing shape (bmoe-sim whatif --model maps a routing onto another shape)",
                have.layers.len(),
                have.n_expert,
                want.layers.len(),
                want.n_expert
            ),
        ));
    }
    trace.preamble.layers = model.layers.clone();
    trace.preamble.notes.push(format!(
        "experts re-priced with the layout of {} ({})",
        other.display(),
        if map {
            "whatif --model"
        } else {
            "--layout-from"
        }
    ));
    Ok(Repriced {
        mapping: None,
        layout_source,
    })
}

/// A trace ready to replay: parsed, planned, its layout built, and the run configured.
pub struct Prepared {
    pub trace: Arc<RouteTrace>,
    pub plan: Arc<ReplayPlan>,
    pub layout: ExpertLayout,
    pub cfg: RunConfig,
    pub profile: DeviceProfile,
    /// The prediction columns a `--route-trace` of this replay declares.
    pub pred_columns: PredColumns,
    /// Approximations the replay makes (printed to stderr by `replay`).
    pub warnings: Vec<String>,
    /// How the routing was mapped onto another model's shape (`whatif`), and the locality the
    /// mapped routing carries, when it was.
    pub mapping: Option<(String, String)>,
    /// The layout file the experts' bytes were read from (`--layout-from`, `whatif --model`),
    /// `None` when they are the trace's own.
    pub layout_source: Option<LayoutSource>,
}

impl Prepared {
    /// The model layer ids of the trace's MoE layers, in order.
    pub fn layout_layer_ids(&self) -> Vec<u32> {
        self.trace.preamble.layers.iter().map(|l| l.layer).collect()
    }
}

/// Flags a route trace can never carry what they need for: refused rather than ignored, so a
/// replay never claims to have modelled what it did not. (The predictor flags are judged
/// against what the trace recorded, in `predictions::resolve`.)
fn refuse_unmodelled(cfg: &RunConfig) -> Result<(), SimError> {
    if cfg.inject_faults.as_ref().is_some_and(|p| p.torn > 0.0) {
        return Err(SimError::Unsupported {
            flag: "--inject-faults torn=",
            why:
                "a torn read changes bytes, and the flash model moves none (the engine injects it)",
        });
    }
    if cfg.substitute_lambda > 0.0 {
        return Err(SimError::Unsupported {
            flag: "--expert-substitute",
            why: "substitution re-ranks the router's full probabilities, which a route trace does not carry",
        });
    }
    Ok(())
}

/// Resolve a run configuration for `trace` (its experts priced as `how` says) the way
/// `bmoe-cli` resolves one for a model: flags (with their environment fallbacks) into a
/// `RunConfig`, `validate()`, the model facts from the trace preamble, `validate_model()`, the cache cycle and the budget (`auto` from
/// the profile's `mem_available_mib`). The simulator always streams: `--moe-stream` is
/// implied.
#[allow(clippy::too_many_arguments)]
pub fn prepare(
    trace_path: &Path,
    how: Reprice<'_>,
    profile_spec: Option<&str>,
    jitter: Option<f32>,
    stream: &StreamArgs,
    telemetry: &TelemetryArgs,
    seed: u64,
    env: &[(String, String)],
) -> Result<Prepared, SimError> {
    let mut stream = stream.clone();
    let mut telemetry = telemetry.clone();
    apply_env_fallbacks(
        env.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        &mut stream,
        &mut telemetry,
    )
    .map_err(|e| SimError::invalid("environment", e.to_string()))?;
    if stream.no_moe_stream {
        return Err(SimError::invalid(
            "--no-moe-stream",
            "the simulator replays the streamer; a resident run has nothing to simulate",
        ));
    }
    stream.moe_stream = true;
    let mut cfg = RunConfig {
        engine_version: env!("CARGO_PKG_VERSION").to_string(),
        ..RunConfig::default()
    };
    stream.apply(&mut cfg);
    telemetry.apply(&mut cfg);
    cfg.seed = seed;
    cfg.validate()?;
    refuse_unmodelled(&cfg)?;

    let mut profile = DeviceProfile::load(profile_spec.unwrap_or(DEFAULT_PROFILE))?;
    if let Some(j) = jitter {
        profile.flash.jitter = f64::from(j);
        profile.compute.jitter = f64::from(j);
        profile.validate()?;
    }
    cfg.threads = profile.threads;

    let PredictorReplay {
        trace,
        columns: pred_columns,
        warnings,
    } = predictions::resolve(&cfg, load_trace(trace_path)?)?;
    let mut trace = trace;
    let Repriced {
        mapping,
        layout_source,
    } = reprice(&mut trace, how)?;
    let layout = layout_from_preamble(&trace.preamble)?;
    let plan = ReplayPlan::new(&trace)?;
    let p = &trace.preamble;
    cfg.model = p.model.clone();
    cfg.arch = p.arch.clone();
    cfg.gating = p.gating;
    // A speculative run's verify decodes replay as the groups they were, and its counters
    // (`mtp_*`) are counted as the recording counted them, under the source's name.
    if let Some(spec) = p.extra.iter().find_map(|(k, v)| {
        (k == SPEC_KEY)
            .then(|| {
                [SpecMode::Ngram, SpecMode::Mtp]
                    .into_iter()
                    .find(|m| v == m.name())
            })
            .flatten()
    }) {
        cfg.spec = spec;
    }
    cfg.n_layer = p.n_layer;
    cfg.n_expert = p.n_expert;
    cfg.n_expert_used = if cfg.n_expert_used_override > 0 {
        cfg.n_expert_used_override.min(p.n_expert_used)
    } else {
        p.n_expert_used
    };
    cfg.validate_model()?;
    let k = cfg.n_expert_used as u16;
    cfg.cache_cycle_mb = layout.cache_cycle_bytes(k).div_ceil(MIB);
    let budget = if cfg.cache_auto {
        auto_cache_budget(
            Some(profile.mem_available_mib.saturating_mul(MIB)),
            None,
            None,
            cfg.cache_floor_mb.saturating_mul(MIB),
            cfg.cache_ceil_mb.saturating_mul(MIB),
            layout.total_expert_bytes(),
        )
    } else {
        cfg.cache_mb.saturating_mul(MIB)
    };
    cfg.resolve_cache_budget(budget);
    Ok(Prepared {
        trace: Arc::new(trace),
        plan: Arc::new(plan),
        layout,
        cfg,
        profile,
        pred_columns,
        warnings,
        mapping,
        layout_source,
    })
}

fn create(path: &Path) -> Result<BufWriter<File>, SimError> {
    File::create(path)
        .map(BufWriter::new)
        .map_err(|e| SimError::io(path, e))
}

/// What a path is, to compare it with another: canonical form (the directory's, joined with
/// the name, for a file not yet there) and, when it exists, device and inode.
fn file_identity(path: &Path) -> Option<(PathBuf, Option<(u64, u64)>)> {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata(path) {
        Ok(m) => Some((std::fs::canonicalize(path).ok()?, Some((m.dev(), m.ino())))),
        Err(_) => {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            Some((
                std::fs::canonicalize(dir).ok()?.join(path.file_name()?),
                None,
            ))
        }
    }
}

/// Refuse a replay output that is its trace or another output (compared through links), before
/// the trace is read or anything created: `--csv trace.csv` would otherwise replace the trace.
fn check_replay_outputs(trace: &Path, telemetry: &TelemetryArgs) -> Result<(), SimError> {
    let same = |a: &Path, b: &Path| match (file_identity(a), file_identity(b)) {
        (Some((ca, ia)), Some((cb, ib))) => {
            ca != Path::new("/dev/null") && (ca == cb || (ia.is_some() && ia == ib))
        }
        _ => false,
    };
    let outputs: Vec<(&str, &Path)> = [
        ("--csv", telemetry.csv.as_deref()),
        ("--route-trace", telemetry.route_trace.as_deref()),
        ("--io-trace", telemetry.io_trace.as_deref()),
    ]
    .into_iter()
    .filter_map(|(f, p)| p.map(|p| (f, p)))
    .collect();
    for (i, (flag, p)) in outputs.iter().enumerate() {
        if same(p, trace) {
            return Err(SimError::invalid(
                format!("{flag} {}", p.display()),
                format!(
                    "is the trace being replayed (--trace {}): refusing to overwrite an input; choose another path",
                    trace.display()
                ),
            ));
        }
        if let Some((other, q)) = outputs[..i].iter().find(|(_, q)| same(p, q)) {
            return Err(SimError::invalid(
                format!("{flag} {}", p.display()),
                format!(
                    "is the same file as {other} {}: each output needs its own path",
                    q.display()
                ),
            ));
        }
    }
    Ok(())
}

/// What `replay` or `whatif` ran: its inputs, prepared, and the replay's result; the report
/// went to `out` as the binary prints it. `bmoe_sim`'s Python module returns these numbers
/// beside the report's bytes.
pub struct ReplayRun {
    pub prepared: Prepared,
    pub seed: u64,
    pub outcome: ReplayOutcome,
}

/// A replay's result: a generation replayed token by token, or a batched run's steps.
pub enum ReplayOutcome {
    Tokens(Box<replay::ReplayResult>),
    Batched(Box<replay::BatchedResult>),
}

/// `bmoe-sim replay`. `policy`, when given, replaces the `--eviction` policy with an object
/// the caller built (`bmoe_sim.replay(policy=...)` hands a Python class over this way, no
/// registry involved); the preamble and the report name it by its own `name()`.
pub fn replay(
    a: ReplayArgs,
    env: &[(String, String)],
    out: &mut dyn Write,
    err: &mut dyn Write,
    policy: Option<Box<dyn bmoe_core::policy::EvictionPolicy>>,
) -> Result<ReplayRun, SimError> {
    let how = a.layout_from.clone();
    run_replay(
        a,
        how.as_deref().map_or(Reprice::Own, Reprice::Layout),
        false,
        env,
        out,
        err,
        policy,
    )
}

/// `bmoe-sim whatif`; `policy` as in [`replay`].
pub fn whatif(
    a: WhatifArgs,
    env: &[(String, String)],
    out: &mut dyn Write,
    err: &mut dyn Write,
    policy: Option<Box<dyn bmoe_core::policy::EvictionPolicy>>,
) -> Result<ReplayRun, SimError> {
    check_replay_outputs(&a.model, &a.telemetry)?;
    let replay = ReplayArgs {
        trace: a.trace,
        profile: Some(a.device),
        seed: a.seed,
        jitter: a.jitter,
        layout_from: None,
        stream: a.stream,
        telemetry: a.telemetry,
    };
    run_replay(
        replay,
        Reprice::Model(&a.model, a.split_experts),
        true,
        env,
        out,
        err,
        policy,
    )
}

/// `whatif`'s statement of where each input came from.
fn write_inputs(out: &mut dyn Write, p: &Prepared, trace: &Path) -> std::io::Result<()> {
    let t = &p.trace.preamble;
    let (prefill, decode) = crate::whatif::count_tokens(&p.trace);
    let expert_mib =
        |l: &bmoe_core::telemetry::route_trace::TraceLayer| l.expert_bytes as f64 / MIB as f64;
    let n = t.layers.len().max(1) as f64;
    let mean_expert = t.layers.iter().map(expert_mib).sum::<f64>() / n;
    let mean_dense = t
        .layers
        .iter()
        .map(|l| l.dense_bytes as f64 / MIB as f64)
        .sum::<f64>()
        / n;
    writeln!(
        out,
        "whatif: routing   from {} ({} prefill + {} decode tokens)",
        trace.display(),
        prefill,
        decode
    )?;
    match &p.mapping {
        Some((how, locality)) => {
            writeln!(out, "whatif: mapping   {how}")?;
            writeln!(out, "whatif: locality  {locality}")?;
        }
        None => writeln!(
            out,
            "whatif: mapping   none: the trace has the model's routing shape, replayed as recorded"
        )?,
    }
    // The layout's own model and file: in a same-shape re-pricing the trace keeps its own
    // preamble's name (the report equals `replay --layout-from`'s), which is not where the
    // bytes came from.
    let (model, arch, file) = match &p.layout_source {
        Some(s) => (
            s.model.as_str(),
            s.arch.as_str(),
            format!(" in {}", s.path.display()),
        ),
        None => (t.model.as_str(), t.arch.as_str(), String::new()),
    };
    writeln!(
        out,
        "whatif: bytes     from the layout of {}{} ({}, {} MoE layers x {} experts, top-{}): {:.3} MiB per expert, {:.1} MiB dense per MoE layer (means), {:.1} MiB of experts",
        model,
        file,
        arch,
        t.layers.len(),
        t.n_expert,
        t.n_expert_used,
        mean_expert,
        mean_dense,
        p.layout.total_expert_bytes() as f64 / MIB as f64
    )?;
    let (f, c) = (&p.profile.flash, &p.profile.compute);
    writeln!(
        out,
        "whatif: time      from device profile {}: flash {:.0} MiB/s per lane, {:.0} MiB/s device, {:.0} us latency; compute dense {:.0} / expert {:.0} MiB/s, head {:.2} ms; {} threads",
        p.profile.name,
        f.lane_mib_per_s,
        f.device_mib_per_s,
        f.read_latency_us,
        c.dense_mib_per_s,
        c.expert_mib_per_s,
        c.head_ms,
        p.profile.threads
    )?;
    for src in &p.profile.sources {
        writeln!(out, "whatif:           source: {src}")?;
    }
    writeln!(
        out,
        "whatif: budget    {} MiB expert cache ({}), policy {}",
        p.cfg.cache_budget_mb,
        if p.cfg.cache_auto {
            format!(
                "auto, from the profile's {} MiB available",
                p.profile.mem_available_mib
            )
        } else {
            "--cache-mb".to_string()
        },
        p.cfg.eviction.name()
    )
}

/// `replay` and `whatif`: prepare the trace (priced as `how` says), replay it, write the
/// outputs and the report (after `whatif`'s inputs statement when `inputs`).
fn run_replay(
    a: ReplayArgs,
    how: Reprice<'_>,
    inputs: bool,
    env: &[(String, String)],
    out: &mut dyn Write,
    err: &mut dyn Write,
    given: Option<Box<dyn bmoe_core::policy::EvictionPolicy>>,
) -> Result<ReplayRun, SimError> {
    check_replay_outputs(&a.trace, &a.telemetry)?;
    let mut p = prepare(
        &a.trace,
        how,
        a.profile.as_deref(),
        a.jitter,
        &a.stream,
        &a.telemetry,
        a.seed,
        env,
    )?;
    for w in p.cfg.load_warnings().iter().chain(&p.warnings) {
        // The core's warnings carry their own "bmoe: WARNING" prefix, ours "bmoe-sim: WARNING".
        writeln!(err, "{w}").map_err(|e| SimError::io("stderr", e))?;
    }
    let budget_bytes = p.cfg.cache_budget_mb.saturating_mul(MIB);
    if let Some(note) = bank_note(&[budget_bytes], p.layout.total_expert_bytes()) {
        writeln!(err, "{note}").map_err(|e| SimError::io("stderr", e))?;
    }
    if let Some(policy) = &given {
        p.cfg.eviction = bmoe_core::config::EvictionPolicy::unregistered(policy.name());
    }
    if inputs {
        write_inputs(out, &p, &a.trace).map_err(|e| SimError::io("stdout", e))?;
    }
    let policy = match given {
        Some(policy) => policy,
        None => bmoe_core::policy::by_name(p.cfg.eviction.name()).ok_or_else(|| {
            SimError::invalid(
                "--eviction",
                format!("no policy named {}", p.cfg.eviction.name()),
            )
        })?,
    };
    let batched = p.trace.has_seq_column();
    if batched && (a.telemetry.csv.is_some() || a.telemetry.progress) {
        return Err(SimError::invalid(
            if a.telemetry.csv.is_some() {
                "--csv"
            } else {
                "--progress"
            },
            "the trace is a batched run's (its seq column: serve --parallel), replayed step by \
             step with no generation loop to report per token; drop the flag (--route-trace and \
             --io-trace work)",
        ));
    }
    let mut csv = a.telemetry.csv.as_deref().map(create).transpose()?;
    let mut route = match &a.telemetry.route_trace {
        Some(path) => {
            let mut pre = p.trace.preamble.clone();
            pre.n_expert_used = p.cfg.n_expert_used;
            Some(
                RouteTraceWriter::with_columns(
                    create(path)?,
                    &pre,
                    p.pred_columns,
                    StepColumns {
                        group: p.trace.has_group_column(),
                        seq: p.trace.has_seq_column(),
                    },
                )
                .map_err(|e| SimError::io(path, e))?,
            )
        }
        None => None,
    };
    let mut io = match &a.telemetry.io_trace {
        Some(path) => Some(IoTraceWriter::new(create(path)?).map_err(|e| SimError::io(path, e))?),
        None => None,
    };
    let progress = a.telemetry.progress;
    let mut stamped = route
        .as_mut()
        .map(|w| RecordedPredictions::new(&p.trace, w as &mut dyn RecordSink));
    let setup = ReplaySetup {
        trace: p.trace.clone(),
        plan: p.plan.clone(),
        layout: &p.layout,
        cfg: &p.cfg,
        budget_bytes,
        policy,
        profile: &p.profile,
        seed: a.seed,
    };
    if batched {
        let result = replay::run_batched(
            setup,
            ReplayOutputs {
                route: stamped.as_mut().map(|w| w as &mut dyn RecordSink),
                io: io.as_mut().map(|w| w as &mut dyn RecordSink),
                ..Default::default()
            },
        )?;
        finish_traces(route, io, &a.telemetry)?;
        write_batched_report(out, &p, a.seed, &result).map_err(|e| SimError::io("stdout", e))?;
        return Ok(ReplayRun {
            prepared: p,
            seed: a.seed,
            outcome: ReplayOutcome::Batched(Box::new(result)),
        });
    }
    let result = replay::run(
        setup,
        ReplayOutputs {
            csv: csv.as_mut().map(|w| w as &mut dyn Write),
            progress: if progress { Some(&mut *out) } else { None },
            route: stamped.as_mut().map(|w| w as &mut dyn RecordSink),
            io: io.as_mut().map(|w| w as &mut dyn RecordSink),
            decode_stats: None,
            on_step: None,
        },
    )?;
    if let (Some(mut w), Some(path)) = (csv, &a.telemetry.csv) {
        w.flush().map_err(|e| SimError::io(path, e))?;
    }
    finish_traces(route, io, &a.telemetry)?;
    let ctx = ReportContext {
        progress,
        answer: "",
        arch_streamable: true,
    };
    let w = |e| SimError::io("stdout", e);
    write_report(out, &p.cfg, &result.summary, &ctx).map_err(w)?;
    write_sim_lines(
        out,
        &p,
        a.seed,
        SimLine {
            steps: p.plan.steps.len() as u64,
            cache: result.cache,
            read_bytes: result.read_bytes,
            end: result.end,
            read_retries: result.read_retries,
            faults: result.faults,
        },
    )
    .map_err(w)?;
    Ok(ReplayRun {
        prepared: p,
        seed: a.seed,
        outcome: ReplayOutcome::Tokens(Box::new(result)),
    })
}

/// Flush the replay's route and io traces to their files.
fn finish_traces(
    route: Option<RouteTraceWriter<std::io::BufWriter<std::fs::File>>>,
    io: Option<IoTraceWriter<std::io::BufWriter<std::fs::File>>>,
    t: &TelemetryArgs,
) -> Result<(), SimError> {
    if let (Some(w), Some(path)) = (route, &t.route_trace) {
        w.finish()
            .and_then(|mut f| f.flush())
            .map_err(|e| SimError::io(path, e))?;
    }
    if let (Some(w), Some(path)) = (io, &t.io_trace) {
        w.finish()
            .and_then(|mut f| f.flush())
            .map_err(|e| SimError::io(path, e))?;
    }
    Ok(())
}

/// The report of a batched run's replay: the `batched:` line (what `serve --parallel`'s
/// `bmoe_batch_*_total` metrics count) and the `sim:` line every replay prints.
fn write_batched_report(
    out: &mut dyn Write,
    p: &Prepared,
    seed: u64,
    r: &replay::BatchedResult,
) -> std::io::Result<()> {
    let per = |x: u64| {
        if r.decode_rows == 0 {
            0.0
        } else {
            x as f64 / r.decode_rows as f64 / MIB as f64
        }
    };
    writeln!(
        out,
        "batched: {} steps, {} of them decoding {} tokens (mean batch {:.2}): {:.2} MiB read and {:.2} MiB routed per token, {} routings",
        r.steps,
        r.decode_steps,
        r.decode_rows,
        if r.decode_steps == 0 {
            0.0
        } else {
            r.decode_rows as f64 / r.decode_steps as f64
        },
        per(r.decode_read_bytes),
        per(r.decode_routed_bytes),
        r.decode_routings
    )?;
    writeln!(
        out,
        "batched: decode_steps={} decode_rows={} decode_read_bytes={} decode_routed_bytes={} decode_routings={}",
        r.decode_steps, r.decode_rows, r.decode_read_bytes, r.decode_routed_bytes, r.decode_routings
    )?;
    write_sim_lines(
        out,
        p,
        seed,
        SimLine {
            steps: r.steps,
            cache: r.cache,
            read_bytes: r.read_bytes,
            end: r.end,
            read_retries: r.read_retries,
            faults: r.faults,
        },
    )
}

/// What every replay's `sim:` line reports.
struct SimLine {
    steps: u64,
    cache: bmoe_core::CacheCounters,
    read_bytes: u64,
    end: bmoe_core::Nanos,
    read_retries: u64,
    faults: bmoe_core::faults::FaultCounts,
}

/// The `sim:` line (and, with injected faults or retries, the faults line) of a replay.
fn write_sim_lines(
    out: &mut dyn Write,
    p: &Prepared,
    seed: u64,
    r: SimLine,
) -> std::io::Result<()> {
    let c = r.cache;
    writeln!(
        out,
        "sim: profile={} seed={} steps={} lookups={} hits={} misses={} evictions={} rereads={} read_bytes={} virtual_s={}{}",
        p.profile.name,
        seed,
        r.steps,
        c.hits + c.misses,
        c.hits,
        c.misses,
        c.evictions,
        c.rereads,
        r.read_bytes,
        bmoe_core::telemetry::fmt::fixed(r.end.as_secs_f64(), 6),
        bypasses_key(&p.cfg, &c)
    )?;
    if p.cfg.inject_faults.is_some() || r.read_retries > 0 {
        let f = r.faults;
        writeln!(
            out,
            "sim: injected faults eio={} short={} spike={} stuck={} retried_reads={}",
            f.eio, f.short, f.spike, f.stuck, r.read_retries
        )?;
    }
    out.flush()
}

/// ` bypasses=<n>`, appended to the `sim:` line under a policy that filters admission
/// (`EvictionPolicy::filters_admission`); empty otherwise, so every other line reads as before
/// the key existed.
fn bypasses_key(cfg: &RunConfig, c: &bmoe_core::CacheCounters) -> String {
    let filters = bmoe_core::policy::by_name(cfg.eviction.name())
        .is_some_and(|policy| policy.filters_admission());
    if filters {
        format!(" bypasses={}", c.bypasses)
    } else {
        String::new()
    }
}

/// The shared flags at their defaults (what a sweep starts every cell from).
pub fn default_flags() -> Result<(StreamArgs, TelemetryArgs), SimError> {
    #[derive(Parser)]
    struct Defaults {
        #[command(flatten)]
        stream: StreamArgs,
        #[command(flatten)]
        telemetry: TelemetryArgs,
    }
    let d = Defaults::try_parse_from(["bmoe-sim"])
        .map_err(|e| SimError::invalid("default flags", e.to_string()))?;
    Ok((d.stream, d.telemetry))
}

/// The files `names` in `dir` as one line, `DIR/a, DIR/b`: each a path to paste. The directory
/// loses the separators the user may have doubled or left trailing (`--out out/`), which a
/// `DIR/{a,b}` shorthand once printed as `out//{...}`.
fn written_paths(dir: &Path, names: &[String]) -> String {
    if names.is_empty() {
        return "nothing".to_string();
    }
    let dir: PathBuf = dir.components().collect();
    names
        .iter()
        .map(|n| dir.join(n).display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn write_file(path: &Path, text: &str) -> Result<(), SimError> {
    std::fs::write(path, text).map_err(|e| SimError::io(path, e))
}

/// The one-line note for cache budgets past the whole expert bank (every expert of every MoE
/// layer), or `None` when there is none. Not an error: such a budget is legal, it just holds
/// every expert, so any larger one gives the same result.
fn bank_note(budgets_bytes: &[u64], bank_bytes: u64) -> Option<String> {
    let mib = |b: u64| {
        if b.is_multiple_of(MIB) {
            format!("{} MiB", b / MIB)
        } else {
            format!("{:.1} MiB", b as f64 / MIB as f64)
        }
    };
    let over: Vec<String> = budgets_bytes
        .iter()
        .filter(|&&b| b > bank_bytes)
        .map(|&b| mib(b))
        .collect();
    let (what, holds) = match over.len() {
        0 => return None,
        1 => ("cache budget", "exceeds the whole expert bank"),
        _ => ("cache budgets", "exceed the whole expert bank"),
    };
    Some(format!(
        "bmoe-sim: note: {what} {} {holds} ({:.1} MiB, every expert of every MoE layer): the \
         cache holds every expert, so a larger budget cannot change the result",
        over.join(", "),
        bank_bytes as f64 / MIB as f64
    ))
}

/// A sweep's cells, run: what `sweep` writes its outputs from (and what `bmoe_sim.sweep`
/// returns, or writes with the same functions when given a directory).
pub struct SweepRun {
    pub prepared: Prepared,
    /// Every cell's result, in grid order (per predictor, then budget, policy, lanes, overlap).
    pub rows: Vec<crate::sweep::Row>,
    /// The budgets swept, in bytes.
    pub budgets: Vec<u64>,
    /// The policies swept (Belady included when asked for).
    pub policies: Vec<String>,
    pub placements: Vec<crate::reorder::Placement>,
    /// The trace's file name, the outputs' title.
    pub trace_name: String,
    /// The charts' and the pivot's budget axis (`--x`).
    pub x: crate::sweep::report::XAxis,
    /// Full-timing cells, or cache-only ones.
    pub mode: crate::sweep::Mode,
}

fn cmd_sweep(
    a: SweepArgs,
    env: &[(String, String)],
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<i32, SimError> {
    let run = sweep_cells(&a, env, out, err)?;
    sweep_write(&a, &run, out)?;
    Ok(0)
}

/// The first half of `bmoe-sim sweep`: resolve the grid from the flags and run every cell
/// (the predictors' warnings to `out`, the budget note to `err`, a progress bar on a
/// terminal). `sweep_write` is the second half.
pub fn sweep_cells(
    a: &SweepArgs,
    env: &[(String, String)],
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<SweepRun, SimError> {
    sweep_plan(a, env, out, err)?.run(a)
}

/// A sweep's grid, resolved from its flags before any cell runs.
pub struct SweepPlan {
    pub prepared: Prepared,
    /// The budgets, in bytes.
    pub budgets: Vec<u64>,
    /// The same budgets as experts per MoE layer when they were given that way (the default),
    /// `None` for `--budgets-mb`.
    pub experts_per_layer: Option<Vec<u32>>,
    pub policies: Vec<String>,
    pub placements: Vec<crate::reorder::Placement>,
    /// Full-timing cells, or cache-only ones (`--cache-only`).
    pub mode: crate::sweep::Mode,
    cases: Vec<SweepCase>,
}

/// One predictor's part of a sweep: its configuration, the routing it replays, its grid.
struct SweepCase {
    predictor: crate::sweep::Predictor,
    cfg: RunConfig,
    trace: Arc<RouteTrace>,
    plan: Arc<ReplayPlan>,
    grid: crate::sweep::Grid,
}

impl SweepPlan {
    /// Every cell in the order the sweep runs and reports them: by predictor, then in grid
    /// order (budget, policy, lanes, overlap).
    pub fn cells(&self) -> Vec<(crate::sweep::Predictor, (u64, String, u32, bool))> {
        self.cases
            .iter()
            .flat_map(|c| {
                c.grid
                    .cells_in(self.mode)
                    .into_iter()
                    .map(|cell| (c.predictor, cell))
            })
            .collect()
    }

    /// Run every cell on `a.jobs` threads, with a progress bar on a terminal.
    pub fn run(self, a: &SweepArgs) -> Result<SweepRun, SimError> {
        use crate::sweep;
        let p = self.prepared;
        let mode = self.mode;
        let n_cells: u64 = self
            .cases
            .iter()
            .map(|c| c.grid.cells_in(mode).len() as u64)
            .sum();
        let bar = indicatif::ProgressBar::new(n_cells);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "sweep {bar:40.cyan/blue} {pos}/{len} cells [{elapsed_precise} < {eta_precise}]",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let mut rows = Vec::new();
        for case in &self.cases {
            rows.extend(sweep::run(
                &sweep::SweepInput {
                    trace: case.trace.clone(),
                    plan: case.plan.clone(),
                    layout: &p.layout,
                    cfg: &case.cfg,
                    profile: &p.profile,
                    seed: a.seed,
                    predictor: case.predictor,
                },
                &case.grid,
                mode,
                a.jobs as usize,
                &|| bar.inc(1),
            )?);
        }
        bar.finish_and_clear();
        let trace_name = a.trace.file_name().map_or_else(
            || a.trace.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        Ok(SweepRun {
            prepared: p,
            rows,
            budgets: self.budgets,
            policies: self.policies,
            placements: self.placements,
            trace_name,
            x: sweep::report::XAxis::parse(&a.x).unwrap_or(sweep::report::XAxis::Mib),
            mode,
        })
    }
}

/// Resolve a sweep's grid from its flags: the trace prepared, the budgets, the policies
/// checked, each predictor's routing resolved (its warnings to `out`, the budget note to
/// `err`); no cell runs.
pub fn sweep_plan(
    a: &SweepArgs,
    env: &[(String, String)],
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<SweepPlan, SimError> {
    use crate::sweep;
    let (stream, telemetry) = default_flags()?;
    let p = prepare(
        &a.trace,
        a.layout_from
            .as_deref()
            .map_or(Reprice::Own, Reprice::Layout),
        a.profile.as_deref(),
        a.jitter,
        &stream,
        &telemetry,
        a.seed,
        env,
    )?;
    let per_expert_layer = u64::from(p.layout.n_moe_layers()) * p.layout.max_expert_bytes();
    let (budgets, experts_per_layer): (Vec<u64>, _) = if !a.budgets_mb.is_empty() {
        let b = a.budgets_mb.iter().map(|m| m.saturating_mul(MIB)).collect();
        (b, None)
    } else {
        let n = if a.experts_per_layer.is_empty() {
            sweep::default_experts_per_layer(p.cfg.n_expert_used, p.cfg.n_expert)
        } else {
            a.experts_per_layer.clone()
        };
        let b = n
            .iter()
            .map(|&n| u64::from(n).saturating_mul(per_expert_layer))
            .collect();
        (b, Some(n))
    };
    if let Some(note) = bank_note(&budgets, p.layout.total_expert_bytes()) {
        writeln!(err, "{note}").map_err(|e| SimError::io("stderr", e))?;
    }
    let policies = if a.policies.is_empty() {
        sweep::default_policies()
    } else {
        a.policies.clone()
    };
    for name in &policies {
        if name != sweep::BELADY && bmoe_core::policy::by_name(name).is_none() {
            return Err(SimError::invalid(
                "--policies",
                format!(
                    "no policy named {name} (known: {}, {})",
                    bmoe_core::policy::POLICY_NAMES.join(", "),
                    sweep::BELADY
                ),
            ));
        }
    }
    let mode = if a.cache_only {
        // Refused rather than ignored: a cache-only cell models no I/O and no clock.
        let refuse = |flag: &str, why: &str| {
            Err(SimError::invalid(
                format!("--cache-only with {flag}"),
                format!("{why}; drop {flag}, or sweep with full timing (without --cache-only)"),
            ))
        };
        if !a.lanes.is_empty() {
            return refuse("--lanes", "a cache-only cell models no I/O lanes");
        }
        if a.overlap.is_some() {
            return refuse(
                "--overlap",
                "a cache-only cell models no compute to overlap",
            );
        }
        if a.jitter.is_some() {
            return refuse("--jitter", "a cache-only cell models no time to jitter");
        }
        if a.profile.is_some() && a.placements.is_empty() {
            return refuse(
                "--profile",
                "a device profile prices reads and times, which a cache-only cell has none of (only --placements reads it)",
            );
        }
        if let Some(p) = a.predictors.iter().find(|p| p.as_str() != "none") {
            return refuse(
                &format!("--predictors {p}"),
                "a predictor's admissions ride the modelled clock, which a cache-only cell has not",
            );
        }
        sweep::Mode::CacheOnly
    } else {
        sweep::Mode::FullTiming
    };
    let lanes = if a.lanes.is_empty() {
        vec![1, 4]
    } else {
        a.lanes.clone()
    };
    let overlap = match a.overlap.as_deref() {
        Some("off") => vec![false],
        Some("on") => vec![true],
        _ => vec![false, true],
    };
    let predictors = a
        .predictors
        .iter()
        .map(|name| sweep::Predictor::parse(name))
        .collect::<Result<Vec<_>, _>>()?;
    let placements = a
        .placements
        .iter()
        .map(|name| crate::reorder::Placement::parse(name))
        .collect::<Result<Vec<_>, _>>()?;
    // Each predictor replays its own routing (route-ahead from pred<N> commits it), checked
    // against what the trace recorded before any cell runs.
    let w = |e| SimError::io("stdout", e);
    let mut cases = Vec::with_capacity(predictors.len());
    for predictor in &predictors {
        let mut cfg = p.cfg.clone();
        predictor.apply(&mut cfg);
        let replay = predictions::resolve(&cfg, (*p.trace).clone())?;
        for warning in &replay.warnings {
            writeln!(out, "sweep: {}: {warning}", predictor.name()).map_err(w)?;
        }
        let plan = if replay.trace == *p.trace {
            p.plan.clone()
        } else {
            Arc::new(ReplayPlan::new(&replay.trace)?)
        };
        let policies: Vec<String> = if *predictor == sweep::Predictor::None {
            policies.clone()
        } else {
            policies
                .iter()
                .filter(|name| *name != sweep::BELADY)
                .cloned()
                .collect()
        };
        let grid = sweep::Grid {
            budgets: budgets.clone(),
            policies,
            lanes: lanes.clone(),
            overlap: overlap.clone(),
        };
        cases.push(SweepCase {
            predictor: *predictor,
            cfg,
            trace: Arc::new(replay.trace),
            plan,
            grid,
        });
    }
    Ok(SweepPlan {
        prepared: p,
        budgets,
        experts_per_layer,
        policies,
        placements,
        mode,
        cases,
    })
}

/// The second half of `bmoe-sim sweep`: every output into `--out`, the placement study when
/// asked for, and the table and the `wrote` line to `out`.
pub fn sweep_write(a: &SweepArgs, run: &SweepRun, out: &mut dyn Write) -> Result<(), SimError> {
    use crate::sweep;
    let w = |e| SimError::io("stdout", e);
    let (p, rows) = (&run.prepared, &run.rows);
    std::fs::create_dir_all(&a.out).map_err(|e| SimError::io(&a.out, e))?;
    let mut written = sweep::write_outputs(
        &a.out,
        rows,
        &p.layout_layer_ids(),
        run.x,
        a.bootstrap as usize,
        a.seed,
        &run.trace_name,
    )?;
    if !run.placements.is_empty() {
        written.extend(placement_study(
            p,
            a,
            &run.budgets,
            &run.policies,
            &run.placements,
            &run.trace_name,
            out,
        )?);
    }
    writeln!(
        out,
        "{:>10} {:>6} {:>10} {:>16} {:>5} {:>7} {:>8} {:>8} {:>10}",
        "budget_MiB",
        "per_l",
        "policy",
        "predictor",
        "lanes",
        "overlap",
        "hit",
        "tok/s",
        "read_MiB"
    )
    .map_err(w)?;
    for r in rows {
        // A cache-only cell has no lanes, overlap, tok/s or reads: a dash, never a number.
        let (lanes, overlap, tok_s, read) = match &r.timing {
            Some(t) => (
                r.lanes.to_string(),
                if r.overlap { "on" } else { "off" }.to_string(),
                format!("{:.3}", t.tok_s),
                format!("{:.0}", t.read_bytes as f64 / MIB as f64),
            ),
            None => ("-".into(), "-".into(), "-".into(), "-".into()),
        };
        writeln!(
            out,
            "{:>10.0} {:>6.2} {:>10} {:>16} {:>5} {:>7} {:>7.2}% {:>8} {:>10}",
            r.budget_bytes as f64 / MIB as f64,
            r.experts_per_layer,
            r.policy,
            r.predictor,
            lanes,
            overlap,
            100.0 * r.hit_rate(),
            tok_s,
            read
        )
        .map_err(w)?;
    }
    let how = match run.mode {
        sweep::Mode::FullTiming => format!("full-timing, profile {}", p.profile.name),
        sweep::Mode::CacheOnly => "cache-only: counts only, no reads or times".to_string(),
    };
    writeln!(
        out,
        "sweep: {} cells, {how}, wrote {}",
        rows.len(),
        written_paths(&a.out, &written)
    )
    .map_err(w)?;
    Ok(())
}

/// `sweep --placements`: the reordering study over the sweep's budgets and core policies
/// (Belady is left out: its clairvoyance is over the file order's demand sequence, which a
/// placement does not change, but it is an analysis policy, not one a reader would run).
fn placement_study(
    p: &Prepared,
    a: &SweepArgs,
    budgets: &[u64],
    policies: &[String],
    placements: &[crate::reorder::Placement],
    trace_name: &str,
    out: &mut dyn Write,
) -> Result<Vec<String>, SimError> {
    use crate::reorder;
    let k = u16::try_from(p.cfg.n_expert_used).unwrap_or(0);
    let trace_k = u16::try_from(p.trace.preamble.n_expert_used).unwrap_or(0);
    let seq = AccessSeq::new(&p.trace, &p.plan, if k < trace_k { k } else { 0 });
    let core: Vec<String> = policies
        .iter()
        .filter(|n| *n != crate::sweep::BELADY)
        .cloned()
        .collect();
    let (rows, rule) = reorder::study(
        &reorder::StudyInput {
            layout: &p.layout,
            plan: &p.plan,
            seq: &seq,
            k,
            flash: &p.profile.flash,
            o_direct: p.cfg.o_direct,
        },
        budgets,
        &core,
        placements,
        &|name| {
            bmoe_core::policy::by_name(name)
                .ok_or_else(|| SimError::invalid("--policies", format!("no policy named {name}")))
        },
        a.jobs as usize,
    )?;
    let per_layer_expert = crate::sweep::bytes_per_layer_expert(&p.layout);
    let write = |file: &str, text: &str| -> Result<String, SimError> {
        let path = a.out.join(file);
        std::fs::write(&path, text).map_err(|e| SimError::io(&path, e))?;
        Ok(file.to_string())
    };
    let names = vec![
        write("placement.csv", &reorder::csv(&rows, per_layer_expert))?,
        write(
            "placement.md",
            &reorder::markdown(&rows, per_layer_expert, trace_name, &rule, &p.profile.name),
        )?,
    ];
    writeln!(out, "sweep: placements {rule}").map_err(|e| SimError::io("stdout", e))?;
    Ok(names)
}

/// The first `turns` turns of `plan` (all of them when it has no more).
fn first_turns(plan: &ReplayPlan, turns: u32) -> Result<ReplayPlan, SimError> {
    if turns == 0 {
        return Err(SimError::invalid(
            "--turns",
            "0 turns leave nothing to count: give at least 1",
        ));
    }
    let Some(next) = plan.turns.get(turns as usize) else {
        return Ok(plan.clone());
    };
    let cut = next.prefill.unwrap_or(next.decode.start);
    Ok(ReplayPlan {
        steps: plan.steps[..cut].to_vec(),
        turns: plan.turns[..turns as usize].to_vec(),
        n_moe_layers: plan.n_moe_layers,
    })
}

fn cmd_mrc(a: MrcArgs, out: &mut dyn Write) -> Result<i32, SimError> {
    let t0 = std::time::Instant::now();
    let trace = load_trace(&a.trace)?;
    let layout = layout_from_preamble(&trace.preamble)?;
    let full = ReplayPlan::new(&trace)?;
    let plan = match a.turns {
        Some(n) => first_turns(&full, n)?,
        None => full.clone(),
    };
    let k = u16::try_from(trace.preamble.n_expert_used).map_err(|_| SimError::Trace {
        reason: format!(
            "n_expert_used={} is above 65535",
            trace.preamble.n_expert_used
        ),
    })?;
    let seq = AccessSeq::new(&trace, &plan, 0);
    let built = t0.elapsed();
    let t1 = std::time::Instant::now();
    let curve = crate::mrc::compute(&layout, &seq, k)?;
    let pass = t1.elapsed();
    let points = crate::mrc::Points::parse(&a.points).unwrap_or(crate::mrc::Points::Layer);
    let budgets = curve.budgets(&layout, points);
    let name = a.trace.file_name().map_or_else(
        || a.trace.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let unit = crate::sweep::bytes_per_layer_expert(&layout).max(1);
    let w = |e| SimError::io("stdout", e);
    writeln!(
        out,
        "mrc: {name}: {} of {} turns, {} groups, {} lookups ({} routings), {} MoE layers x {} \
         experts, top-{k}; trace read and planned in {:.0} ms, the curve in one pass in {:.0} ms",
        plan.turns.len(),
        full.turns.len(),
        curve.groups,
        curve.lookups,
        curve.routings,
        layout.n_moe_layers(),
        layout.max_n_expert(),
        built.as_secs_f64() * 1e3,
        pass.as_secs_f64() * 1e3
    )
    .map_err(w)?;
    writeln!(
        out,
        "mrc: global LRU under the core's admission rule, exact at every budget; 1 expert per \
         layer = {} bytes ({:.1} MiB); the cache takes 0 (off) or at least {} experts/layer \
         ({} bytes, the layer demand at top-{k}); {} lookups hit at some budget and miss at a \
         larger one",
        unit,
        unit as f64 / MIB as f64,
        crate::sweep::report::trim(curve.floor_bytes as f64 / unit as f64, 2),
        curve.floor_bytes,
        curve.non_inclusive
    )
    .map_err(w)?;
    writeln!(
        out,
        "{:>9} {:>11} {:>15} {:>10} {:>10} {:>8}",
        "per_layer", "budget_MiB", "budget_bytes", "hits", "misses", "hit"
    )
    .map_err(w)?;
    for &b in &budgets {
        let c = curve.at(b)?.counters;
        writeln!(
            out,
            "{:>9.2} {:>11.1} {:>15} {:>10} {:>10} {:>7.2}%",
            b as f64 / unit as f64,
            b as f64 / MIB as f64,
            b,
            c.hits,
            c.misses,
            100.0 * crate::sweep::ratio(c.hits, curve.lookups)
        )
        .map_err(w)?;
    }
    let mut written = Vec::new();
    if let Some(path) = &a.csv {
        write_file(path, &curve.csv(&layout, &budgets)?)?;
        written.push(path.display().to_string());
    }
    if let Some(stem) = &a.plot {
        let (dir, file) = match (stem.parent(), stem.file_name()) {
            (Some(d), Some(f)) => (
                if d.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    d
                },
                f.to_string_lossy().into_owned(),
            ),
            _ => {
                return Err(SimError::invalid(
                    format!("--plot {}", stem.display()),
                    "not a file path stem (e.g. out/mrc writes out/mrc.svg and out/mrc.png)",
                ))
            }
        };
        crate::sweep::plot::write_line_figure(dir, &file, &curve.figure(&layout, &name))?;
        for ext in ["svg", "png"] {
            written.push(dir.join(format!("{file}.{ext}")).display().to_string());
        }
    }
    if !written.is_empty() {
        writeln!(out, "mrc: wrote {}", written.join(", ")).map_err(w)?;
    }
    Ok(0)
}

fn cmd_bench(a: BenchArgs, out: &mut dyn Write) -> Result<i32, SimError> {
    use std::time::Instant;
    let (stream, telemetry) = default_flags()?;
    let p = prepare(
        &a.trace,
        Reprice::Own,
        a.profile.as_deref(),
        None,
        &stream,
        &telemetry,
        0,
        &[],
    )?;
    if a.cells {
        return bench_cells(&p, &a, out);
    }
    let k = p.cfg.n_expert_used as u16;
    let budget = u64::from(a.experts_per_layer)
        * u64::from(p.layout.n_moe_layers())
        * p.layout.max_expert_bytes();
    let one = AccessSeq::new(&p.trace, &p.plan, 0);
    let repeat = a.repeat.max(1) as usize;
    let mut long = AccessSeq::default();
    for _ in 0..repeat {
        let base = long.keys.len() as u32;
        let group_base = long.group_end.len() as u32;
        long.keys.extend_from_slice(&one.keys);
        long.access.extend_from_slice(&one.access);
        long.group_end
            .extend(one.group_end.iter().map(|e| e + base));
        long.group_layer.extend_from_slice(&one.group_layer);
        long.steps
            .extend(one.steps.iter().map(|&(g, s)| (g + group_base, s)));
        long.routings += one.routings;
    }
    let w = |e| SimError::io("stdout", e);
    writeln!(
        out,
        "bench: {} ({} routings) x {repeat} = {} routings, budget {} experts/layer ({:.0} MiB), one thread",
        a.trace.display(),
        one.routings,
        long.routings,
        a.experts_per_layer,
        budget as f64 / MIB as f64
    )
    .map_err(w)?;
    for policy in ["lru", crate::sweep::BELADY] {
        let mut best = f64::INFINITY;
        let mut hits = 0;
        for _ in 0..3 {
            let (pol, _): (Box<dyn bmoe_core::policy::EvictionPolicy>, _) = if policy == "lru" {
                (Box::new(bmoe_core::policy::Lru::new()), None)
            } else {
                let (c, d) = crate::belady::Clairvoyant::new(&long, &p.layout);
                (Box::new(c), Some(d))
            };
            let t = Instant::now();
            let r = crate::cache_only::run(&p.layout, &long, budget, k, pol)?;
            best = best.min(t.elapsed().as_secs_f64());
            hits = r.counters.hits;
        }
        writeln!(
            out,
            "cache-only  {policy:>6}: {:.2} M routings/s ({:.3} s best of 3, hit {:.1}%)",
            long.routings as f64 / best / 1e6,
            best,
            100.0 * hits as f64 / long.keys.len().max(1) as f64
        )
        .map_err(w)?;
    }
    for overlap in [false, true] {
        let mut cfg = p.cfg.clone();
        cfg.overlap = overlap;
        let t = Instant::now();
        for _ in 0..repeat {
            replay::run(
                ReplaySetup {
                    trace: p.trace.clone(),
                    plan: p.plan.clone(),
                    layout: &p.layout,
                    cfg: &cfg,
                    budget_bytes: budget,
                    policy: Box::new(bmoe_core::policy::Lru::new()),
                    profile: &p.profile,
                    seed: 0,
                },
                ReplayOutputs::default(),
            )?;
        }
        let s = t.elapsed().as_secs_f64();
        writeln!(
            out,
            "full timing    lru {}: {:.2} M routings/s ({:.3} s)",
            if overlap { "overlap" } else { "serial " },
            long.routings as f64 / s / 1e6,
            s
        )
        .map_err(w)?;
    }
    Ok(0)
}

/// `bench --cells`: sweep cells, full-timing against cache-only, measured side by side in one
/// run (per policy, the two modes alternating, so a load that comes and goes hits both), and
/// the one-pass curve against a cache-only cell.
fn bench_cells(p: &Prepared, a: &BenchArgs, out: &mut dyn Write) -> Result<i32, SimError> {
    use crate::sweep::{self, Mode};
    use std::time::Instant;
    let w = |e| SimError::io("stdout", e);
    let unit = sweep::bytes_per_layer_expert(&p.layout);
    let per_layer = sweep::default_experts_per_layer(p.cfg.n_expert_used, p.cfg.n_expert);
    let policies = if a.policies.is_empty() {
        sweep::default_policies()
    } else {
        a.policies.clone()
    };
    let input = sweep::SweepInput {
        trace: p.trace.clone(),
        plan: p.plan.clone(),
        layout: &p.layout,
        cfg: &p.cfg,
        profile: &p.profile,
        seed: 0,
        predictor: sweep::Predictor::None,
    };
    let reps = a.reps.max(1);
    let seq = AccessSeq::new(&p.trace, &p.plan, 0);
    writeln!(
        out,
        "bench: sweep cells of {} ({} routings), budgets {:?} experts/layer, profile {}; per \
         policy, full timing at each of the sweep's default lanes 1,4 x overlap off,on ({} cells) \
         and cache-only ({} cells), the runs alternating, one thread, best of {reps}; x per cell = \
         mean full-timing cell / cache-only cell, x per point = a point's 4 full-timing cells / \
         its 1 cache-only cell",
        a.trace.display(),
        seq.routings,
        per_layer,
        p.profile.name,
        4 * per_layer.len(),
        per_layer.len()
    )
    .map_err(w)?;
    const SETTINGS: [(u32, bool); 4] = [(1, false), (1, true), (4, false), (4, true)];
    writeln!(
        out,
        "{:>10} {:>31} {:>8} {:>8} {:>10} {:>10} {:>8}",
        "", "full ms/cell: lanes/overlap", "", "cache", "x per", "x per", ""
    )
    .map_err(w)?;
    writeln!(
        out,
        "{:>10} {:>7} {:>7} {:>7} {:>7} {:>8} {:>8} {:>10} {:>10} {:>8}",
        "policy", "1/off", "1/on", "4/off", "4/on", "mean", "ms/cell", "cell", "point", "counts"
    )
    .map_err(w)?;
    let counts = |r: &sweep::Row| {
        (
            [
                r.lookups,
                r.hits,
                r.misses,
                r.evictions,
                r.rereads,
                r.inserts,
            ],
            r.per_layer.clone(),
            r.per_turn
                .iter()
                .map(|t| (t.routings, t.hits))
                .collect::<Vec<_>>(),
        )
    };
    let (mut all_full, mut all_cache, mut all_same) = (0f64, 0f64, true);
    let (mut n_full, mut n_cache) = (0usize, 0usize);
    let mut lru_cell = None;
    for policy in &policies {
        let grid = |lanes: u32, overlap: bool| sweep::Grid {
            budgets: per_layer.iter().map(|&n| u64::from(n) * unit).collect(),
            policies: vec![policy.clone()],
            lanes: vec![lanes],
            overlap: vec![overlap],
        };
        let points = per_layer.len();
        let full_cells = SETTINGS.len() * points;
        let mut setting_best = [f64::INFINITY; SETTINGS.len()];
        let mut cache_best = f64::INFINITY;
        let mut full_rows = Vec::new();
        let mut cache_rows = Vec::new();
        for _ in 0..reps {
            full_rows.clear();
            for (i, &(lanes, overlap)) in SETTINGS.iter().enumerate() {
                let t = Instant::now();
                let rows = sweep::run(&input, &grid(lanes, overlap), Mode::FullTiming, 1, &|| {})?;
                setting_best[i] = setting_best[i].min(t.elapsed().as_secs_f64());
                full_rows.extend(rows);
            }
            let t = Instant::now();
            cache_rows = sweep::run(&input, &grid(1, false), Mode::CacheOnly, 1, &|| {})?;
            cache_best = cache_best.min(t.elapsed().as_secs_f64());
        }
        let full_best: f64 = setting_best.iter().sum();
        // Every full-timing cell counts what its point's cache-only cell counts.
        let same = cache_rows.len() == points
            && full_rows.len() == full_cells
            && full_rows.iter().all(|f| {
                cache_rows
                    .iter()
                    .find(|c| c.budget_bytes == f.budget_bytes)
                    .is_some_and(|c| counts(f) == counts(c))
            });
        let (full_cell, cache_cell) = (full_best / full_cells as f64, cache_best / points as f64);
        if policy == "lru" {
            lru_cell = Some(cache_cell);
        }
        let ms = |s: f64| format!("{:.2}", 1e3 * s / points as f64);
        writeln!(
            out,
            "{:>10} {:>7} {:>7} {:>7} {:>7} {:>8.2} {:>8.3} {:>9.1}x {:>9.1}x {:>8}",
            policy,
            ms(setting_best[0]),
            ms(setting_best[1]),
            ms(setting_best[2]),
            ms(setting_best[3]),
            1e3 * full_cell,
            1e3 * cache_cell,
            full_cell / cache_cell.max(1e-12),
            full_best / cache_best.max(1e-12),
            if same { "equal" } else { "DIFFER" }
        )
        .map_err(w)?;
        all_full += full_best;
        all_cache += cache_best;
        n_full += full_cells;
        n_cache += points;
        all_same &= same;
    }
    let (full_cell, cache_cell) = (all_full / n_full as f64, all_cache / n_cache.max(1) as f64);
    writeln!(
        out,
        "{:>10} {:>7} {:>7} {:>7} {:>7} {:>8.2} {:>8.3} {:>9.1}x {:>9.1}x {:>8}",
        "all",
        "",
        "",
        "",
        "",
        1e3 * full_cell,
        1e3 * cache_cell,
        full_cell / cache_cell.max(1e-12),
        all_full / all_cache.max(1e-12),
        if all_same { "equal" } else { "DIFFER" }
    )
    .map_err(w)?;
    let mut mrc_best = f64::INFINITY;
    let mut steps = 0;
    for _ in 0..reps {
        let t = Instant::now();
        let curve = crate::mrc::compute(&p.layout, &seq, p.cfg.n_expert_used as u16)?;
        mrc_best = mrc_best.min(t.elapsed().as_secs_f64());
        steps = curve.steps.len();
    }
    writeln!(
        out,
        "mrc: the lru curve at every budget ({steps} steps) in one pass: {:.3} ms{}",
        1e3 * mrc_best,
        lru_cell.map_or(String::new(), |c| format!(
            ", the time of {:.1} cache-only lru cells",
            mrc_best / c.max(1e-12)
        ))
    )
    .map_err(w)?;
    Ok(if all_same { 0 } else { 1 })
}

fn load_metrics(path: &Path) -> Result<bmoe_core::telemetry::MetricsCsv, SimError> {
    let text = std::fs::read_to_string(path).map_err(|e| SimError::io(path, e))?;
    bmoe_core::telemetry::MetricsCsv::parse(&text).map_err(|source| SimError::Parse {
        path: path.to_path_buf(),
        source,
    })
}

fn cmd_diff(a: DiffArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32, SimError> {
    use crate::diff;
    let loaded = load_metrics(&a.sim).and_then(|s| Ok((s, load_metrics(&a.measured)?)));
    let (sim, measured) = match loaded {
        Ok(pair) => pair,
        Err(e) => {
            writeln!(err, "bmoe-sim: diff: cannot compare: {e}")
                .map_err(|e| SimError::io("stderr", e))?;
            return Ok(2);
        }
    };
    let tol = diff::Tolerances {
        tok_s: f64::from(a.tol_tok_s),
        wall_p50: f64::from(a.tol_wall_p50),
        wall_p90: f64::from(a.tol_wall_p90),
        wall_mape: f64::from(a.tol_wall_mape),
        io_mape: f64::from(a.tol_io_mape),
        stall_mape: f64::from(a.tol_stall_mape),
        ..diff::Tolerances::default()
    };
    let report = diff::compare(&sim, &measured, &tol, a.exact_only);
    let w = |e| SimError::io("stdout", e);
    writeln!(
        out,
        "diff: sim {} vs measured {}",
        a.sim.display(),
        a.measured.display()
    )
    .map_err(w)?;
    out.write_all(report.text().as_bytes()).map_err(w)?;
    if let Some(path) = &a.svg {
        let title = format!(
            "per-token time: {} vs {}",
            a.sim
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned()),
            a.measured
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned())
        );
        write_file(path, &diff::overlay_svg(&sim, &measured, &title))?;
    }
    let failures = report.failures();
    if failures > 0 {
        writeln!(out, "diff: {failures} metric(s) outside their tolerance").map_err(w)?;
        Ok(1)
    } else {
        writeln!(out, "diff: every judged metric within tolerance").map_err(w)?;
        Ok(0)
    }
}

fn cmd_stats(a: StatsArgs, out: &mut dyn Write) -> Result<i32, SimError> {
    stats(&a, true, out).map(|_| 0)
}

/// `bmoe-sim stats`: the trace's statistics, their summary to `out`, and, when `write`, every
/// file into `--out` and the `wrote` line (`bmoe_sim.stats` without a directory does not
/// write).
pub fn stats(
    a: &StatsArgs,
    write: bool,
    out: &mut dyn Write,
) -> Result<crate::stats::TraceStats, SimError> {
    let trace = load_trace(&a.trace)?;
    let s = crate::stats::compute(&trace);
    let name = a.trace.file_name().map_or_else(
        || a.trace.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let written = if write {
        std::fs::create_dir_all(&a.out).map_err(|e| SimError::io(&a.out, e))?;
        Some(crate::stats::write_outputs(&a.out, &s, &name)?)
    } else {
        None
    };
    let w = |e| SimError::io("stdout", e);
    out.write_all(crate::stats::summary_md(&s, &name).as_bytes())
        .map_err(w)?;
    if let Some(written) = written {
        writeln!(out, "\nstats: wrote {}", written_paths(&a.out, &written)).map_err(w)?;
    }
    Ok(s)
}

fn cmd_bars(a: BarsArgs, out: &mut dyn Write) -> Result<i32, SimError> {
    let text = std::fs::read_to_string(&a.json).map_err(|e| SimError::io(&a.json, e))?;
    let chart = crate::bars::BarChart::parse(&text, &a.json.display().to_string())?;
    let (svg, png) = crate::bars::write_bars(&a.out, &chart)?;
    writeln!(out, "bars: wrote {} and {}", svg.display(), png.display())
        .map_err(|e| SimError::io("stdout", e))?;
    Ok(0)
}

fn cmd_convert(a: ConvertArgs, out: &mut dyn Write) -> Result<i32, SimError> {
    convert(&a, out).map(|_| 0)
}

/// `bmoe-sim convert`: the capture converted and written to `--out`, one line to `out`.
pub fn convert(
    a: &ConvertArgs,
    out: &mut dyn Write,
) -> Result<crate::convert::Converted, SimError> {
    use crate::convert;
    let format = convert::Format::resolve(&a.format, &a.input)?;
    let text = std::fs::read_to_string(&a.input).map_err(|e| SimError::io(&a.input, e))?;
    let stem = a
        .input
        .file_stem()
        .map_or("capture".to_string(), |s| s.to_string_lossy().into_owned());
    let mut notes = vec![format!(
        "converted by bmoe-sim convert from {} ({})",
        a.input
            .file_name()
            .map_or(stem.clone(), |n| n.to_string_lossy().into_owned()),
        if format == convert::Format::Jsonl {
            "jsonl"
        } else {
            "csv"
        }
    )];
    notes.extend(a.note.iter().cloned());
    let c = convert::convert(
        &text,
        format,
        &convert::ConvertOptions {
            model: a.model.clone().unwrap_or(stem),
            arch: a.arch.clone(),
            n_expert: a.n_expert,
            top_k: a.top_k,
            expert_bytes: a.expert_bytes,
            dense_bytes: a.dense_bytes,
            first_layer: a.first_layer,
            n_layer: a.n_layer,
            gating: a.gating,
            notes,
        },
    )
    .map_err(|e| match e {
        SimError::Invalid { what, reason } => SimError::Invalid {
            what: format!("{}: {what}", a.input.display()),
            reason,
        },
        other => other,
    })?;
    write_file(&a.out, &c.text)?;
    writeln!(
        out,
        "convert: {} tokens, {} MoE layers x {} experts, top-{}, {} routings -> {}",
        c.tokens,
        c.layers,
        c.n_expert,
        c.top_k,
        c.routings,
        a.out.display()
    )
    .map_err(|e| SimError::io("stdout", e))?;
    Ok(c)
}

fn cmd_fuzz(a: FuzzArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32, SimError> {
    let t0 = std::time::Instant::now();
    let every = (a.seeds / 20).max(1);
    let mut line_err = None;
    let r = crate::fuzz::run_seeds(a.seed, a.seeds, |done, case| {
        let mut say = |text: String| {
            if let Err(e) = writeln!(err, "{text}") {
                line_err.get_or_insert(e);
            }
        };
        if a.verbose {
            say(format!("fuzz: seed {}: ok ({})", case.seed, case.summary));
        } else if done % every == 0 || done == a.seeds {
            say(format!("fuzz: {done}/{} seeds", a.seeds));
        }
    });
    if let Some(e) = line_err {
        return Err(SimError::io("stderr", e));
    }
    let (n, steps, faulted) = r?;
    writeln!(
        out,
        "fuzz: seeds {}..{} ok: {n} seeds, {steps} steps checked, {faulted} stopped by a reported fault, {:.1} s",
        a.seed,
        a.seed.saturating_add(a.seeds),
        t0.elapsed().as_secs_f64()
    )
    .map_err(|e| SimError::io("stdout", e))?;
    Ok(0)
}

fn cmd_calibrate(
    a: CalibrateArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<i32, SimError> {
    calibrate(&a, out, err).map(|(_, code)| code)
}

/// `bmoe-sim calibrate`: the fitted profile, written to `--out`, and the exit code the binary
/// returns (0, or `EXIT_MISFIT` under `--fail-on-misfit` when the profile misses its own run).
pub fn calibrate(
    a: &CalibrateArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<(crate::calibrate::Calibration, i32), SimError> {
    let runs = a.csv.len();
    if !a.sweep && runs != 1 {
        return Err(SimError::invalid(
            "--csv",
            format!("given {runs} times: fitting several runs needs --sweep"),
        ));
    }
    for (flag, n) in [("--trace", a.trace.len()), ("--io-trace", a.io_trace.len())] {
        if n != 0 && n != runs {
            return Err(SimError::invalid(
                flag,
                format!("given {n} times for {runs} --csv: give none or one per run, in order"),
            ));
        }
    }
    let base = DeviceProfile::load(&a.base)?;
    let csvs: Vec<bmoe_core::telemetry::MetricsCsv> = a
        .csv
        .iter()
        .map(|p| load_metrics(p))
        .collect::<Result<_, _>>()?;
    let (stream, telemetry) = default_flags()?;
    let prepared: Vec<Prepared> = a
        .trace
        .iter()
        .map(|t| {
            prepare(
                t,
                Reprice::Own,
                Some(&a.base),
                None,
                &stream,
                &telemetry,
                0,
                &[],
            )
        })
        .collect::<Result<_, _>>()?;
    let ios: Vec<Vec<bmoe_core::records::IoRecord>> = a
        .io_trace
        .iter()
        .map(|path| {
            let text = std::fs::read_to_string(path).map_err(|e| SimError::io(path, e))?;
            bmoe_core::telemetry::io_trace::parse_io_trace(&text).map_err(|source| {
                SimError::Parse {
                    path: path.clone(),
                    source,
                }
            })
        })
        .collect::<Result<_, _>>()?;
    let names: Vec<String> = a.csv.iter().map(|p| p.display().to_string()).collect();
    let inputs: Vec<crate::calibrate::RunInput> = (0..runs)
        .map(|i| crate::calibrate::RunInput {
            csv: &csvs[i],
            name: &names[i],
            prepared: prepared.get(i),
            io: ios.get(i).map(Vec::as_slice),
        })
        .collect();
    let opts = crate::calibrate::FitOptions {
        read_cpu: !a.single_rate,
        service_spread: !a.single_rate,
    };
    let c = if a.sweep {
        crate::calibrate::calibrate_sweep(&inputs, &base, &a.name, opts)?
    } else {
        crate::calibrate::calibrate_run(&inputs[0], &base, &a.name, opts)?
    };
    write_file(&a.out, &c.profile.to_json())?;
    let w = |e| SimError::io("stdout", e);
    for n in &c.notes {
        writeln!(out, "calibrate: {n}").map_err(w)?;
    }
    writeln!(out, "calibrate: wrote {}", a.out.display()).map_err(w)?;
    if c.self_check.is_empty() {
        writeln!(
            out,
            "calibrate: self-check skipped: without --trace there is no replay of the run to compare"
        )
        .map_err(w)?;
        return Ok((c, 0));
    }
    let mut misfit = false;
    for check in &c.self_check {
        writeln!(out, "calibrate: {}", check.line()).map_err(w)?;
        let misses = check.misses();
        if misses.is_empty() {
            continue;
        }
        misfit = true;
        writeln!(
            err,
            "bmoe-sim: WARNING: calibrate: the fitted profile {} misses its own calibration run {}: {}; its predictions are not to be trusted{}",
            a.out.display(),
            check.run,
            misses.join(", "),
            if a.fail_on_misfit {
                format!(" (--fail-on-misfit: exit {EXIT_MISFIT})")
            } else {
                format!(" (reported only; --fail-on-misfit makes it exit {EXIT_MISFIT})")
            }
        )
        .map_err(|e| SimError::io("stderr", e))?;
    }
    let code = if misfit && a.fail_on_misfit {
        EXIT_MISFIT
    } else {
        0
    };
    Ok((c, code))
}
