//! The command-line flags that `bmoe-cli` and `bmoe-sim` share, as clap derive structs.
//!
//! Exists so the two binaries cannot drift: a policy flag is declared, documented, parsed and
//! defaulted once, both CLIs `#[command(flatten)]` the same struct, and both turn it into the
//! same `RunConfig` fields. Numbers parse strictly (`4x`, `+4`, ` 4` and `1e3` are rejected
//! with exit code 2 by clap); range and combination rules are `RunConfig::validate()`'s job
//! (exit code 1, `config error: ...`).
//!
//! Environment fallbacks (`BMOE_CACHE_MB`, ...) are applied by `apply_env_fallbacks`, a pure
//! function over a list of (name, value) pairs: the binaries pass `std::env::vars()`, tests
//! pass literals, and nothing in the core reads the environment.

use std::path::PathBuf;

use bmoe_core::vocab::ReadSplit;

/// Default of `--read-timeout-ms` (defined in `config`, below this module).
pub use bmoe_core::config::READ_TIMEOUT_MS_DEFAULT;

use bmoe_core::config::{
    DenseWeights, EvictionPolicy, RunConfig, StreamChoice, CACHE_FLOOR_DEFAULT_MB, CACHE_MIN_MB,
    IO_THREADS_DEFAULT, IO_THREADS_MAX, PREDICT_SPEC_MAX_DEFAULT,
};

/// The value of `--cache-mb`: auto-sizing or a fixed budget in MiB (0 = cache off).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CacheMbArg {
    Auto,
    Mb(u64),
}

/// `--read-split`: `auto`, `lanes`, `off`, or a whole number of KiB.
pub fn parse_read_split(s: &str) -> Result<ReadSplit, String> {
    ReadSplit::parse(s)
}

/// Parses `auto` or a strict non-negative integer (MiB).
pub fn parse_cache_mb(s: &str) -> Result<CacheMbArg, String> {
    if s == "auto" {
        return Ok(CacheMbArg::Auto);
    }
    parse_u64_strict(s)
        .map(CacheMbArg::Mb)
        .map_err(|_| format!("expected 'auto' or a whole number of MiB, got '{s}'"))
}

/// Parses a non-negative integer made of ASCII digits only (no sign, spaces, suffix or
/// exponent), so a typo such as `4x` is an error rather than a silent 4.
pub fn parse_u64_strict(s: &str) -> Result<u64, String> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("expected a whole number, got '{s}'"));
    }
    s.parse::<u64>().map_err(|_| format!("'{s}' is too large"))
}

/// `parse_u64_strict` into a `u32`.
pub fn parse_u32_strict(s: &str) -> Result<u32, String> {
    let v = parse_u64_strict(s)?;
    u32::try_from(v).map_err(|_| format!("'{s}' is too large"))
}

/// Parses a plain non-negative decimal (`0.75`, `1`, `.5`, `1.`): digits with at most one
/// point, no sign, exponent, `nan` or `inf`. Range checks are `validate()`'s.
pub fn parse_decimal_strict(s: &str) -> Result<f32, String> {
    let digits = s.bytes().filter(|b| b.is_ascii_digit()).count();
    let points = s.bytes().filter(|&b| b == b'.').count();
    if digits == 0 || points > 1 || digits + points != s.len() {
        return Err(format!("expected a decimal number such as 0.75, got '{s}'"));
    }
    s.parse::<f32>()
        .map_err(|_| format!("expected a decimal number such as 0.75, got '{s}'"))
}

/// Flags that switch on and shape expert streaming, the cache and the policies on top of it.
/// Shared verbatim by `bmoe-cli` and `bmoe-sim`.
#[derive(Clone, Debug, PartialEq, clap::Args)]
#[command(next_help_heading = "Streaming, cache and routing policies")]
pub struct StreamArgs {
    /// Stream routed experts from flash into a fixed-budget cache [default: when the model
    /// does not fit].
    ///
    /// Without this flag or --no-moe-stream the engine decides at load: when the model file,
    /// its KV cache and --cache-floor-mb do not fit the memory the process may use (the
    /// smaller of its cgroup limit and MemAvailable) it streams, with --overlap and
    /// --cache-mb auto; otherwise the experts stay resident. The `mode:` line and the CSV
    /// preamble (`moe_stream_why=`) say which and why. Dense weights stay resident either way.
    #[arg(long)]
    pub moe_stream: bool,

    /// Keep every expert resident (plain mmap), whatever the model's size [default: off].
    ///
    /// The baseline: every `moe-*` report line is absent and the `mode:` line says so. On a
    /// model larger than RAM the kernel pages experts in and out of the mapping.
    #[arg(long, conflicts_with = "moe_stream")]
    pub no_moe_stream: bool,

    /// Expert-cache budget in MiB, or `auto` [default: auto with --moe-stream; env BMOE_CACHE_MB].
    ///
    /// 0 turns the cache off: every routed expert is re-read every token. `auto` sizes the
    /// budget once at load as clamp(min(MemAvailable, cgroup headroom) - floor, 1500 MiB, all
    /// experts), capped by --cache-ceil-mb. 1-1499 MiB is refused without --force-cache: a cache
    /// below one token's routed set thrashes and is slower than none. The budget is RAM the
    /// process keeps for experts.
    #[arg(long, value_name = "auto|MIB", value_parser = parse_cache_mb)]
    pub cache_mb: Option<CacheMbArg>,

    /// RAM `--cache-mb auto` leaves free, in MiB.
    ///
    /// A higher floor is a smaller cache (more flash reads) and more room for everything else.
    #[arg(long, value_name = "MIB", default_value_t = CACHE_FLOOR_DEFAULT_MB, value_parser = parse_u64_strict)]
    pub cache_floor_mb: u64,

    /// Upper bound on the `auto` budget in MiB, 0 = none.
    ///
    /// Recommended: MemAvailable counts the model's own page-cached weights as free, so auto
    /// alone can over-ask.
    #[arg(long, value_name = "MIB", default_value_t = 0, value_parser = parse_u64_strict)]
    pub cache_ceil_mb: u64,

    /// Accept a cache budget of 1-1499 MiB [default: off].
    ///
    /// For experiments on small models; on real ones such a budget thrashes.
    #[arg(long)]
    pub force_cache: bool,

    /// Parallel flash read lanes, 1-8 [default: 4; env BMOE_IO_THREADS].
    ///
    /// Each lane has its own file descriptor and bounce buffer. More lanes help until the
    /// flash saturates (often at 2-4) and then cost CPU and memory only.
    #[arg(long, value_name = "N", value_parser = parse_u32_strict)]
    pub io_threads: Option<u32>,

    /// Read experts through the page cache instead of O_DIRECT [default: O_DIRECT on].
    ///
    /// Buffered reads double-cache expert bytes in RAM. The CSV preamble's `o_direct=` records
    /// what the open achieved, which a platform may downgrade.
    #[arg(long)]
    pub no_odirect: bool,

    /// Keep streamed experts in base pages instead of transparent huge pages [default: huge
    /// pages where the kernel offers them].
    ///
    /// A read into a 2 MiB huge page pins one page instead of 512; resident memory is the
    /// same (only whole huge pages inside every expert's slot are used).
    #[arg(long)]
    pub no_hugepages: bool,

    /// How an expert's projection extents are cut into reads: auto, lanes, off, or a size in
    /// KiB [default: auto].
    ///
    /// `lanes` cuts every extent into one piece per lane (4 KiB multiples, at least 64 KiB),
    /// so a single missed expert keeps every lane busy and the lanes finish together; `off`
    /// reads each extent whole (at most three lanes busy per expert); `auto` is `lanes` for
    /// the few misses of a cached decode step and `off` where a layer already reads an extent
    /// per lane or more (cache off, prefill), where larger requests read faster; a number caps
    /// every read at that many KiB. Output-neutral; the CSV preamble records it
    /// (`read_split=`).
    #[arg(long, value_name = "auto|lanes|off|KIB", default_value = "auto", value_parser = parse_read_split)]
    pub read_split: ReadSplit,

    /// Compute each expert as soon as its own read lands, hiding reads behind compute
    /// [default: off; env BMOE_OVERLAP].
    ///
    /// Needs --moe-stream. Reports `stall_ms` (the union of the intervals compute waited) and
    /// turns `io_ms` into summed lane busy time, which can exceed the wall time.
    #[arg(long)]
    pub overlap: bool,

    /// Debug: read every expert of every layer every token [default: off].
    ///
    /// Needs --moe-stream. Costs the whole expert bank in flash traffic per token; its byte
    /// counts are not comparable with a selective run's.
    #[arg(long)]
    pub load_all: bool,

    /// How dense (non-expert) weights are held: mmap, warm or anon.
    ///
    /// mmap leaves them to the page cache (the kernel may drop and re-fault them); warm adds
    /// one sequential read at load; anon copies them into anonymous memory with O_DIRECT so
    /// reclaim goes to swap/zram rather than back to flash.
    #[arg(long, value_name = "MODE", default_value_t = DenseWeights::Anon, value_parser = dense_weights_parser())]
    pub dense_weights: DenseWeights,

    /// Override the routing width top-k, 0 = the model's own [default: 0; env BMOE_N_EXPERT_USED].
    ///
    /// Lossy but deterministic: fewer experts per token is fewer reads and less compute at a
    /// quality cost. Must not exceed the model's expert count.
    #[arg(long, value_name = "K", value_parser = parse_u32_strict)]
    pub n_expert_used: Option<u32>,

    /// Cache eviction policy (each one's victim rule is listed below; docs/policies.md).
    /// Policies change what is read, never what is computed.
    #[arg(long, value_name = "POLICY", default_value_t = EvictionPolicy::Lru, value_parser = eviction_parser())]
    pub eviction: EvictionPolicy,

    /// Temporal prefetch: read the experts the previous token routed at the next K layers,
    /// 0-8, 0 = off [default: 0; env BMOE_PREFETCH].
    ///
    /// Needs the cache. Output-neutral, but every wrong guess is flash bandwidth taken from
    /// demand reads; measured recall is 18-38%, so it is off by default.
    #[arg(long, value_name = "K", value_parser = parse_u32_strict)]
    pub prefetch: Option<u32>,

    /// For tests: integrate speculation on the eval thread — every speculative read
    /// (--prefetch, --predict-prefetch, --route-ahead) is waited for right where it is issued,
    /// with no lane running beside compute. Needs the cache; output-neutral.
    #[arg(long)]
    pub prefetch_sync: bool,

    /// Score three expert predictors against the real routing and report them
    /// [default: off; env BMOE_PREDICT_LOG].
    ///
    /// Needs --moe-stream; reads nothing extra but costs two small matrix-vector products per
    /// layer, so a probed run is not a benchmark run. Excludes --route-ahead.
    #[arg(long)]
    pub predict_log: bool,

    /// Speculatively read the experts the next layer's router predicts from this layer's
    /// input (stale gate) [default: off; env BMOE_PREDICT_PREFETCH].
    ///
    /// Needs the cache; excludes --prefetch and --route-ahead. Output-neutral; costs flash
    /// bandwidth on wrong guesses.
    #[arg(long)]
    pub predict_prefetch: bool,

    /// Predicted misses --predict-prefetch reads per layer, 0-8; 0 only protects predicted
    /// residents from eviction.
    #[arg(long, value_name = "N", default_value_t = PREDICT_SPEC_MAX_DEFAULT, value_parser = parse_u32_strict)]
    pub predict_spec_max: u32,

    /// Commit each layer's routing as predicted N layers early, 0-8, 0 = off.
    ///
    /// Lossy but deterministic: the committed experts get the router's true weights, and their
    /// reads start N layers early. Needs --moe-stream; excludes --prefetch, --predict-prefetch,
    /// --predict-log and speculative decoding. Use 2 with --overlap.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_u32_strict)]
    pub route_ahead: u32,

    /// Skip a routed expert that is not cached and weighted below F x (1/top-k), F in [0, 1],
    /// 0 = off.
    ///
    /// Lossy and state-dependent (the same prompt can give different text). Needs the cache.
    /// Saves the reads of cold, low-weight experts; the top expert is never dropped. Warns at
    /// load when top-k <= 4, where the same F removes much more.
    #[arg(long, value_name = "F", default_value_t = 0.0, value_parser = parse_decimal_strict)]
    pub drop_cold_experts: f32,

    /// With --drop-cold-experts, do not rescale the surviving weights to the routing's
    /// original mass [default: rescale].
    #[arg(long)]
    pub drop_no_renorm: bool,

    /// With --drop-cold-experts, also drop during prefill [default: decode only].
    ///
    /// With a cold cache almost everything is a miss in prefill, so this discards far more.
    #[arg(long)]
    pub drop_in_prefill: bool,

    /// Re-rank the router's scores with a margin L x (score range) in favour of cached
    /// experts, L in [0, 1], 0 = off.
    ///
    /// Lossy, decode only; needs the cache. Steers routing toward resident experts: fewer
    /// reads, measurable perplexity cost (price it before trusting it).
    #[arg(long, value_name = "L", default_value_t = 0.0, value_parser = parse_decimal_strict)]
    pub expert_substitute: f32,

    /// A flash read not complete after this many milliseconds is reported as a timeout and
    /// stops the run [default: 30000].
    ///
    /// A stuck lane or device then ends the run with an error naming the read, never a hang.
    /// In the simulator the time is virtual.
    #[arg(long, value_name = "MS", default_value_t = READ_TIMEOUT_MS_DEFAULT, value_parser = parse_u64_strict)]
    pub read_timeout_ms: u64,

    /// Test hook: inject seeded flash faults, e.g. `seed=1,eio=0.05,short=0.02,spike=0.1,
    /// spike-ms=20,torn=0.01,stuck=LANE@AFTER,persistent` (docs/reliability.md). Not for
    /// normal use.
    #[arg(long, value_name = "SPEC", hide = true, value_parser = parse_fault_plan)]
    pub inject_faults: Option<bmoe_core::faults::FaultPlan>,
}

/// `--dense-weights`: the core's `DenseWeights` by name, each value with its help.
fn dense_weights_parser() -> impl clap::builder::TypedValueParser<Value = DenseWeights> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new([
        PossibleValue::new("mmap").help("Leave them on the model's mmap: the baseline"),
        PossibleValue::new("warm").help("mmap plus one sequential buffered sweep at load"),
        PossibleValue::new("anon").help(
            "Read into anonymous buffers with O_DIRECT; reclaim then goes to swap/zram, not flash",
        ),
    ])
    .map(|s| s.parse::<DenseWeights>().unwrap_or_default())
}

/// `--eviction`: a policy of the core's registry by name, each with its help.
fn eviction_parser() -> impl clap::builder::TypedValueParser<Value = EvictionPolicy> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(
        bmoe_core::policy::POLICIES
            .iter()
            .map(|p| PossibleValue::new(p.name).help(p.help)),
    )
    .map(|s| s.parse::<EvictionPolicy>().unwrap_or_default())
}

fn parse_fault_plan(s: &str) -> Result<bmoe_core::faults::FaultPlan, String> {
    bmoe_core::faults::FaultPlan::parse(s).map_err(|e| e.reason)
}

/// Flags that choose what a run reports and where. Shared verbatim by `bmoe-cli` and
/// `bmoe-sim`; the binaries open the paths.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "Telemetry")]
pub struct TelemetryArgs {
    /// Emit one machine-readable BMOE_PROGRESS line per token and the ===-bannered report
    /// [default: off; env BMOE_PROGRESS].
    #[arg(long)]
    pub progress: bool,

    /// Write the per-token `# bmoe_metrics v2` CSV (preamble, rows, summary) to PATH.
    ///
    /// Cheap: one row per token.
    #[arg(long, value_name = "PATH")]
    pub csv: Option<PathBuf>,

    /// Write the `route_trace v1` file (one row per routed expert) to PATH.
    ///
    /// Needs --moe-stream. A diagnostic: roughly steps x MoE layers x top-k rows.
    #[arg(long, value_name = "PATH")]
    pub route_trace: Option<PathBuf>,

    /// Write the `io_trace v1` file (one row per flash read) to PATH.
    ///
    /// Needs --moe-stream. A diagnostic: a traced run is not a benchmark run.
    #[arg(long, value_name = "PATH")]
    pub io_trace: Option<PathBuf>,
}

impl StreamArgs {
    /// The cache setting after the default: the flag (or its env fallback) if given, else
    /// `auto` under --moe-stream and off without it.
    pub fn cache(&self) -> CacheMbArg {
        match self.cache_mb {
            Some(c) => c,
            None if self.moe_stream => CacheMbArg::Auto,
            None => CacheMbArg::Mb(0),
        }
    }

    /// Copies these flags into `cfg`: streaming, cache request, lanes, O_DIRECT request, dense
    /// mode, top-k override, eviction and every routing policy. `cfg.o_direct` is the request;
    /// the engine overwrites it with what the open achieved.
    pub fn apply(&self, cfg: &mut RunConfig) {
        cfg.moe_stream = self.moe_stream;
        cfg.stream_choice = if self.moe_stream || self.no_moe_stream {
            StreamChoice::Flag
        } else {
            StreamChoice::Auto
        };
        match self.cache() {
            CacheMbArg::Auto => {
                cfg.cache_auto = true;
                cfg.cache_mb = 0;
            }
            CacheMbArg::Mb(mb) => {
                cfg.cache_auto = false;
                cfg.cache_mb = mb;
            }
        }
        cfg.cache_floor_mb = self.cache_floor_mb;
        cfg.cache_ceil_mb = self.cache_ceil_mb;
        cfg.force_cache = self.force_cache;
        cfg.io_threads = self.io_threads.unwrap_or(IO_THREADS_DEFAULT);
        cfg.o_direct = !self.no_odirect;
        cfg.huge_pages = !self.no_hugepages;
        cfg.overlap = self.overlap;
        cfg.read_split = self.read_split;
        cfg.load_all = self.load_all;
        cfg.dense_weights = self.dense_weights;
        cfg.n_expert_used_override = self.n_expert_used.unwrap_or(0);
        cfg.eviction = self.eviction;
        cfg.prefetch = self.prefetch.unwrap_or(0);
        cfg.prefetch_sync = self.prefetch_sync;
        cfg.predict_log = self.predict_log;
        cfg.predict_prefetch = self.predict_prefetch;
        cfg.predict_spec_max = self.predict_spec_max;
        cfg.route_ahead = self.route_ahead;
        cfg.drop_cold_frac = self.drop_cold_experts;
        cfg.drop_renorm = !self.drop_no_renorm;
        cfg.drop_prefill = self.drop_in_prefill;
        cfg.substitute_lambda = self.expert_substitute;
        cfg.read_timeout_ms = self.read_timeout_ms;
        cfg.inject_faults = self.inject_faults.clone();
    }
}

impl TelemetryArgs {
    /// Records in `cfg` which traces were asked for (validation needs it).
    pub fn apply(&self, cfg: &mut RunConfig) {
        cfg.route_trace = self.route_trace.is_some();
        cfg.io_trace = self.io_trace.is_some();
    }
}

/// The environment variables `apply_env_fallbacks` honours, each standing in for the flag of
/// the same meaning when that flag was not given.
pub const ENV_FALLBACKS: [&str; 8] = [
    "BMOE_CACHE_MB",
    "BMOE_IO_THREADS",
    "BMOE_PROGRESS",
    "BMOE_OVERLAP",
    "BMOE_PREFETCH",
    "BMOE_N_EXPERT_USED",
    "BMOE_PREDICT_LOG",
    "BMOE_PREDICT_PREFETCH",
];

/// An environment fallback with a value that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("environment {name}={value}: {reason}")]
pub struct EnvError {
    pub name: String,
    pub value: String,
    pub reason: String,
}

fn parse_env_bool(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" | "" => Ok(false),
        _ => Err("expected 1/0, true/false, on/off or yes/no".to_string()),
    }
}

/// Applies the `BMOE_*` environment fallbacks (see `ENV_FALLBACKS`) from `vars` to flags the
/// user did not give: a typed flag always wins. A switch that was typed stays on; one that was
/// not takes the variable's value. Other variables are ignored. Returns the (name, value) pairs
/// that took effect, in input order, so a binary can say where a setting came from. A value
/// that does not parse is an error (exit 2, like a bad flag value), never silently ignored.
pub fn apply_env_fallbacks<I, K, V>(
    vars: I,
    stream: &mut StreamArgs,
    telemetry: &mut TelemetryArgs,
) -> Result<Vec<(String, String)>, EnvError>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    let mut applied = Vec::new();
    for (name, value) in vars {
        let (name, value) = (name.as_ref(), value.as_ref());
        let err = |reason: String| EnvError {
            name: name.to_string(),
            value: value.to_string(),
            reason,
        };
        let took = match name {
            "BMOE_CACHE_MB" if stream.cache_mb.is_none() => {
                stream.cache_mb = Some(parse_cache_mb(value).map_err(err)?);
                true
            }
            "BMOE_IO_THREADS" if stream.io_threads.is_none() => {
                stream.io_threads = Some(parse_u32_strict(value).map_err(err)?);
                true
            }
            "BMOE_PREFETCH" if stream.prefetch.is_none() => {
                stream.prefetch = Some(parse_u32_strict(value).map_err(err)?);
                true
            }
            "BMOE_N_EXPERT_USED" if stream.n_expert_used.is_none() => {
                stream.n_expert_used = Some(parse_u32_strict(value).map_err(err)?);
                true
            }
            "BMOE_OVERLAP" if !stream.overlap => {
                stream.overlap = parse_env_bool(value).map_err(err)?;
                true
            }
            "BMOE_PREDICT_LOG" if !stream.predict_log => {
                stream.predict_log = parse_env_bool(value).map_err(err)?;
                true
            }
            "BMOE_PREDICT_PREFETCH" if !stream.predict_prefetch => {
                stream.predict_prefetch = parse_env_bool(value).map_err(err)?;
                true
            }
            "BMOE_PROGRESS" if !telemetry.progress => {
                telemetry.progress = parse_env_bool(value).map_err(err)?;
                true
            }
            _ => false,
        };
        if took {
            applied.push((name.to_string(), value.to_string()));
        }
    }
    Ok(applied)
}

/// One-line reminder of the ranges, for a binary's `after_help`.
pub fn ranges_help() -> String {
    format!(
        "Ranges: --io-threads 1-{IO_THREADS_MAX}; --prefetch, --route-ahead, --predict-spec-max 0-8; \
         --drop-cold-experts and --expert-substitute in [0, 1]; --cache-mb 0, auto or >= {CACHE_MIN_MB} \
         (1-{} with --force-cache).\nEnvironment (a typed flag wins): {}.",
        CACHE_MIN_MB - 1,
        ENV_FALLBACKS.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        stream: StreamArgs,
        #[command(flatten)]
        telemetry: TelemetryArgs,
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("bmoe").chain(args.iter().copied()))
    }

    #[test]
    fn command_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn strict_numbers() {
        assert_eq!(parse_u64_strict("42"), Ok(42));
        for bad in ["4x", "+4", " 4", "4 ", "", "-1", "1e3", "0x10"] {
            assert!(parse_u64_strict(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(parse_decimal_strict("0.75"), Ok(0.75));
        assert_eq!(parse_decimal_strict(".5"), Ok(0.5));
        assert_eq!(parse_decimal_strict("1"), Ok(1.0));
        for bad in ["nan", "inf", "0.7.5", "-0.5", "1e-1", ".", "0.75x", ""] {
            assert!(parse_decimal_strict(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse(&["--io-threads", "4x"]).is_err());
        assert!(parse(&["--cache-mb", "3000MB"]).is_err());
        assert!(parse(&["--drop-cold-experts", "nan"]).is_err());
    }

    #[test]
    fn defaults_follow_the_flag_list() {
        let cli = parse(&[]).expect("no flags parse");
        let mut cfg = RunConfig::default();
        cli.stream.apply(&mut cfg);
        assert!(!cfg.moe_stream);
        assert_eq!((cfg.cache_mb, cfg.cache_auto), (0, false));
        assert_eq!(cfg.cache_floor_mb, 1536);
        assert_eq!(cfg.io_threads, 4);
        assert!(cfg.o_direct);
        assert_eq!(cfg.dense_weights, DenseWeights::Anon);
        assert_eq!(cfg.predict_spec_max, 2);
        assert!(cfg.drop_renorm);
        // No streaming flag: the engine decides at load.
        assert_eq!(cfg.stream_choice, StreamChoice::Auto);
        assert_eq!(
            cfg,
            RunConfig {
                stream_choice: StreamChoice::Auto,
                ..RunConfig::default()
            }
        );
        for flag in ["--moe-stream", "--no-moe-stream"] {
            let mut cfg = RunConfig::default();
            parse(&[flag]).expect("parses").stream.apply(&mut cfg);
            assert_eq!(cfg.stream_choice, StreamChoice::Flag, "{flag}");
        }
        assert!(parse(&["--moe-stream", "--no-moe-stream"]).is_err());

        // --moe-stream without --cache-mb means auto; an explicit 0 stays off.
        let cli = parse(&["--moe-stream"]).expect("parses");
        assert_eq!(cli.stream.cache(), CacheMbArg::Auto);
        let cli = parse(&["--moe-stream", "--cache-mb", "0"]).expect("parses");
        assert_eq!(cli.stream.cache(), CacheMbArg::Mb(0));
    }

    #[test]
    fn conversion() {
        let cli = parse(&[
            "--moe-stream",
            "--cache-mb",
            "3000",
            "--io-threads",
            "2",
            "--no-odirect",
            "--overlap",
            "--dense-weights",
            "mmap",
            "--n-expert-used",
            "6",
            "--drop-cold-experts",
            "0.75",
            "--drop-no-renorm",
            "--drop-in-prefill",
            "--expert-substitute",
            "0.15",
            "--route-trace",
            "r.csv",
        ])
        .expect("parses");
        let mut cfg = RunConfig::default();
        cli.stream.apply(&mut cfg);
        cli.telemetry.apply(&mut cfg);
        assert!(cfg.moe_stream && cfg.overlap && !cfg.o_direct && cfg.route_trace && !cfg.io_trace);
        assert_eq!(
            (cfg.cache_mb, cfg.cache_auto, cfg.io_threads),
            (3000, false, 2)
        );
        assert_eq!(cfg.dense_weights, DenseWeights::Mmap);
        assert_eq!(cfg.n_expert_used_override, 6);
        assert_eq!(
            (cfg.drop_cold_frac, cfg.drop_renorm, cfg.drop_prefill),
            (0.75, false, true)
        );
        assert_eq!(cfg.substitute_lambda, 0.15);
        assert_eq!(cfg.validate(), Ok(()));
    }

    #[test]
    fn env_fallbacks_lose_to_flags() {
        let mut cli = parse(&["--moe-stream", "--io-threads", "2"]).expect("parses");
        let applied = apply_env_fallbacks(
            [
                ("BMOE_IO_THREADS", "8"),
                ("BMOE_CACHE_MB", "4000"),
                ("BMOE_OVERLAP", "1"),
                ("BMOE_PROGRESS", "true"),
                ("PATH", "/bin"),
            ],
            &mut cli.stream,
            &mut cli.telemetry,
        )
        .expect("valid env");
        assert_eq!(cli.stream.io_threads, Some(2), "the flag wins");
        assert_eq!(cli.stream.cache(), CacheMbArg::Mb(4000));
        assert!(cli.stream.overlap && cli.telemetry.progress);
        let names: Vec<&str> = applied.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["BMOE_CACHE_MB", "BMOE_OVERLAP", "BMOE_PROGRESS"]);

        // A typed --cache-mb beats the variable; a bad value is an error naming it.
        let mut cli = parse(&["--cache-mb", "auto"]).expect("parses");
        apply_env_fallbacks(
            [("BMOE_CACHE_MB", "4000")],
            &mut cli.stream,
            &mut cli.telemetry,
        )
        .expect("valid");
        assert_eq!(cli.stream.cache(), CacheMbArg::Auto);
        let e = apply_env_fallbacks(
            [("BMOE_PREFETCH", "2x")],
            &mut cli.stream,
            &mut cli.telemetry,
        )
        .expect_err("2x must not parse");
        assert!(
            e.to_string().starts_with("environment BMOE_PREFETCH=2x:"),
            "{e}"
        );
        let e = apply_env_fallbacks(
            [("BMOE_OVERLAP", "maybe")],
            &mut cli.stream,
            &mut cli.telemetry,
        )
        .expect_err("maybe is not a bool");
        assert_eq!(e.name, "BMOE_OVERLAP");
    }

    #[test]
    fn help_mentions_defaults() {
        use clap::CommandFactory;
        let help = Cli::command().render_long_help().to_string();
        for needle in [
            "--cache-mb <auto|MIB>",
            "default: auto with --moe-stream",
            "--io-threads <N>",
            "1-8",
            "--drop-cold-experts <F>",
            "--eviction <POLICY>",
            "--route-trace <PATH>",
        ] {
            assert!(help.contains(needle), "help lacks {needle:?}:\n{help}");
        }
    }
}
