//! The resolved configuration of one run, its validation, and the pure sizing formulas.
//!
//! Exists so that every rule about which knobs combine lives in one place that both
//! `bmoe-cli` and `bmoe-sim` call: the engine and the simulator must refuse the same
//! configurations with the same words, and the `# bmoe_metrics v2` preamble must describe a run
//! from the same fields whoever produced it. Nothing here reads the environment, a file or a
//! clock: the binaries probe memory (`/proc/meminfo`, the cgroup files) and pass numbers in.

use std::fmt;
use std::str::FromStr;

/// Bytes in one MiB (2^20); every `_mb` / `_mib` quantity in bmoe is in these units.
pub const MIB: u64 = 1 << 20;
/// Smallest cache budget accepted without `--force-cache` (MiB). Below it a cache cannot hold
/// one token's routed working set on the models this was measured on, and thrashes.
pub const CACHE_MIN_MB: u64 = 1500;
/// Default `--cache-floor-mb`: RAM that `--cache-mb auto` leaves free (MiB).
pub const CACHE_FLOOR_DEFAULT_MB: u64 = 1536;
/// Most read lanes `--io-threads` accepts.
pub const IO_THREADS_MAX: u32 = 8;
/// Default `--io-threads`.
pub const IO_THREADS_DEFAULT: u32 = 4;
/// Default of `--read-timeout-ms`.
pub const READ_TIMEOUT_MS_DEFAULT: u64 = 30_000;
/// Deepest `--prefetch` horizon (layers).
pub const PREFETCH_MAX: u32 = 8;
/// Largest `--predict-spec-max` (predicted misses read per layer).
pub const PREDICT_SPEC_MAX_LIMIT: u32 = 8;
/// Default `--predict-spec-max`.
pub const PREDICT_SPEC_MAX_DEFAULT: u32 = 2;
/// Deepest `--route-ahead` horizon (layers); beyond it the staleness has no measured meaning.
pub const ROUTE_AHEAD_MAX: u32 = 8;
/// Largest `--draft` (tokens drafted per speculative step).
pub const DRAFT_MAX_LIMIT: u32 = 8;
/// Largest `--ngram-max-match`.
pub const NGRAM_MATCH_LIMIT: u32 = 64;
/// Top-k at or below which `--drop-cold-experts` is warned about. An evidence boundary, not a
/// physical one: the policy was measured at top-k 8 only.
pub const DROP_LOW_TOPK_WARN: u32 = 4;

/// How the dense (non-expert) weights are held in RAM (`--dense-weights`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum DenseWeights {
    /// Leave them on the model's mmap: the baseline.
    Mmap,
    /// mmap plus one sequential buffered sweep at load.
    Warm,
    /// Read into anonymous buffers with O_DIRECT; reclaim then goes to swap/zram, not flash.
    #[default]
    Anon,
}

impl DenseWeights {
    /// The spelling used by the flag and the CSV preamble.
    pub fn name(self) -> &'static str {
        match self {
            DenseWeights::Mmap => "mmap",
            DenseWeights::Warm => "warm",
            DenseWeights::Anon => "anon",
        }
    }
}

impl fmt::Display for DenseWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DenseWeights {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mmap" => Ok(DenseWeights::Mmap),
            "warm" => Ok(DenseWeights::Warm),
            "anon" => Ok(DenseWeights::Anon),
            _ => Err(UnknownName {
                what: "dense-weights mode",
                name: s.to_string(),
                expected: "mmap|warm|anon",
            }),
        }
    }
}

/// Which expert the cache evicts when it is over budget (`--eviction`): the name of a policy
/// in the registry `policy::POLICIES`, so a policy added there (one file and one line) is a
/// flag value, a preamble `eviction=` value and a sweep policy with no edit here. The original
/// engine had global LRU only.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct EvictionPolicy(&'static str);

#[allow(non_upper_case_globals)]
impl EvictionPolicy {
    /// The globally least recently used (layer, expert).
    pub const Lru: EvictionPolicy = EvictionPolicy("lru");
    /// The least frequently used, ties to the least recent (`policy::Lfu`).
    pub const Lfu: EvictionPolicy = EvictionPolicy("lfu");
    /// LRFU, decayed frequency: a frequency/recency hybrid (`policy::Lrfu`).
    pub const Lfru: EvictionPolicy = EvictionPolicy("lfru");
    /// Per-layer partitions with LFU inside (`policy::LayerLfu`).
    pub const LayerLfu: EvictionPolicy = EvictionPolicy("layer-lfu");

    /// The spelling used by the flag and the CSV preamble.
    pub fn name(self) -> &'static str {
        self.0
    }

    /// The name of a policy handed to the cache as an object rather than built from the
    /// registry (a Python class through `bmoe_sim`'s Python module), so the preamble's
    /// `eviction=` and the reports name the policy that ran. `policy::by_name` cannot build
    /// it: only the caller holding the object can run it.
    pub const fn unregistered(name: &'static str) -> EvictionPolicy {
        EvictionPolicy(name)
    }

    /// Every registered policy, in registry order.
    pub fn all() -> Vec<EvictionPolicy> {
        crate::policy::POLICIES
            .iter()
            .map(|p| EvictionPolicy(p.name))
            .collect()
    }
}

impl Default for EvictionPolicy {
    fn default() -> Self {
        EvictionPolicy::Lru
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

static POLICY_EXPECTED: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| crate::policy::POLICY_NAMES.join("|"));

impl FromStr for EvictionPolicy {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        crate::policy::POLICIES
            .iter()
            .find(|p| p.name == s)
            .map(|p| EvictionPolicy(p.name))
            .ok_or_else(|| UnknownName {
                what: "eviction policy",
                name: s.to_string(),
                expected: POLICY_EXPECTED.as_str(),
            })
    }
}

/// Where speculative draft tokens come from (`--mtp` / `--ngram`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum SpecMode {
    #[default]
    Off,
    Mtp,
    Ngram,
}

impl SpecMode {
    /// The spelling used by the CSV preamble's `spec=` key.
    pub fn name(self) -> &'static str {
        match self {
            SpecMode::Off => "off",
            SpecMode::Mtp => "mtp",
            SpecMode::Ngram => "ngram",
        }
    }
}

impl fmt::Display for SpecMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not one of an enum's spellings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} '{name}' (expected {expected})")]
pub struct UnknownName {
    pub what: &'static str,
    pub name: String,
    pub expected: &'static str,
}

/// A configuration `validate()` refuses. Every message starts with `config error:` and names
/// the flag and the rule it broke; the binaries print it and exit 1.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A value outside its accepted range.
    #[error("config error: {flag} {value} is out of range: {rule}")]
    OutOfRange {
        flag: &'static str,
        value: String,
        rule: String,
    },
    /// A flag that only works together with another setting.
    #[error("config error: {flag} requires {needs}: {why}")]
    Requires {
        flag: &'static str,
        needs: &'static str,
        why: &'static str,
    },
    /// Two flags that cannot be combined.
    #[error("config error: {flag} excludes {other}: {why}")]
    Excludes {
        flag: &'static str,
        other: &'static str,
        why: &'static str,
    },
}

/// Where the memory a process may use was read from. A phone's shell or Termux process has no
/// memory cgroup of its own (Android gives it no v1 controller); there `MemAvailable` and the
/// process's own resource limits are what bound it.
///
/// The fit check ([`decide_streaming`]) weighs only the cgroup and `MemAvailable`: streaming
/// is the answer to too little RAM, not to a resource limit. `RLIMIT_AS` counts the mapped
/// model whether its experts stream or not (a streamed run needs more address space, not
/// less), and `RLIMIT_DATA` does not count a resident run's file mapping at all; both bound
/// what a run adds, so they cap the auto cache ([`auto_cache_room_from`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MemSource {
    /// The memory cgroup's limit (v1 `memory.limit_in_bytes`, v2 `memory.max`).
    Cgroup,
    /// `/proc/meminfo`'s `MemAvailable`.
    MemAvailable,
    /// The process's `RLIMIT_AS` soft limit (`ulimit -v`): its whole address space, the
    /// mapped model included.
    RlimitAs,
    /// The process's `RLIMIT_DATA` soft limit (`ulimit -d`): its private writable memory
    /// (heap, anonymous mappings: the expert cache and the dense copy).
    RlimitData,
}

impl MemSource {
    pub fn name(self) -> &'static str {
        match self {
            MemSource::Cgroup => "cgroup",
            MemSource::MemAvailable => "memavailable",
            MemSource::RlimitAs => "rlimit_as",
            MemSource::RlimitData => "rlimit_data",
        }
    }

    /// How the `mode:` line names the source.
    pub fn phrase(self) -> &'static str {
        match self {
            MemSource::Cgroup => "its cgroup's memory limit",
            MemSource::MemAvailable => "MemAvailable",
            MemSource::RlimitAs => "its RLIMIT_AS, ulimit -v",
            MemSource::RlimitData => "its RLIMIT_DATA, ulimit -d",
        }
    }
}

/// The fit check's inputs, as the `mode:` line and the preamble state them.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Fit {
    /// The model's bytes on disk (every shard: dense and experts).
    pub model_bytes: u64,
    /// Its KV cache at the run's context (every layer's memory at full size).
    pub kv_bytes: u64,
    /// Memory kept free beside them (`--cache-floor-mb`).
    pub margin_bytes: u64,
    /// The memory the process may use: the smaller of the cgroup limit and `MemAvailable`.
    pub room_bytes: u64,
    pub room_from: MemSource,
}

impl Fit {
    /// What a resident run needs: model + KV cache + margin.
    pub fn need_bytes(&self) -> u64 {
        self.model_bytes
            .saturating_add(self.kv_bytes)
            .saturating_add(self.margin_bytes)
    }

    fn reason(&self) -> String {
        format!(
            "the model needs {} (file {} + KV cache {} + {} kept free, --cache-floor-mb) and this \
             process may use {} ({})",
            gib(self.need_bytes()),
            gib(self.model_bytes),
            gib(self.kv_bytes),
            gib(self.margin_bytes),
            gib(self.room_bytes),
            self.room_from.phrase()
        )
    }
}

/// A memory size as a person reads it: MiB below a GiB, GiB with two decimals above.
fn gib(bytes: u64) -> String {
    if bytes < 1 << 30 {
        format!("{} MiB", bytes.div_ceil(MIB))
    } else {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    }
}

/// How a run came to stream its experts or not.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StreamChoice {
    /// `--moe-stream` or `--no-moe-stream` (or a caller that set `moe_stream` itself).
    Flag,
    /// Neither flag: the engine decides at load ([`decide_streaming`]); unresolved until then.
    Auto,
    /// Decided at load: the memory the process may use is unknown, so the run is resident.
    Unknown,
    /// Decided at load: the model fits, so its experts stay resident.
    Fits(Fit),
    /// Decided at load: the model does not fit, so its experts stream.
    TooBig(Fit),
}

impl StreamChoice {
    /// The preamble's `moe_stream_why=` value.
    pub fn name(&self) -> &'static str {
        match self {
            StreamChoice::Flag => "flag",
            StreamChoice::Auto => "auto",
            StreamChoice::Unknown => "unknown",
            StreamChoice::Fits(_) => "fits",
            StreamChoice::TooBig(_) => "too_big",
        }
    }

    pub fn fit(&self) -> Option<&Fit> {
        match self {
            StreamChoice::Fits(f) | StreamChoice::TooBig(f) => Some(f),
            _ => None,
        }
    }

    /// Why the engine chose, for the `mode:` line; `None` when a flag chose.
    pub fn reason(&self) -> Option<String> {
        match self {
            StreamChoice::Flag | StreamChoice::Auto => None,
            StreamChoice::Unknown => Some(
                "how much memory this process may use is unknown (no MemAvailable, no cgroup \
                 limit), so the experts stay resident; --moe-stream streams them"
                    .into(),
            ),
            StreamChoice::Fits(f) => Some(format!(
                "experts resident because {}; --moe-stream streams them anyway",
                f.reason()
            )),
            StreamChoice::TooBig(f) => Some(format!(
                "streaming because {}; --no-moe-stream forces the resident run",
                f.reason()
            )),
        }
    }
}

impl Fit {
    /// The most the auto-sized cache may take when the engine chose to stream: the room once
    /// the dense weights (the model's bytes that are not experts), the KV cache and a margin are
    /// in — the margin `--cache-floor-mb`, or a quarter of the room where that floor is more
    /// than the room can spare (a small cgroup). Without it the auto formula's 1500 MiB minimum
    /// could size a cache past a cgroup limit, and the kernel would kill the run. 0: no room.
    pub fn cache_ceiling_bytes(&self, expert_bytes: u64) -> u64 {
        let dense = self.model_bytes.saturating_sub(expert_bytes);
        let margin = self.margin_bytes.min(self.room_bytes / 4);
        self.room_bytes
            .saturating_sub(dense)
            .saturating_sub(self.kv_bytes)
            .saturating_sub(margin)
    }
}

/// The zero-config fit check: stream when the model, its KV cache and `margin_bytes` do not
/// fit the memory the process may use — the smaller of the cgroup limit and `MemAvailable`.
/// `MemAvailable` counts page-cached file pages as free, which is right here: a resident run
/// maps the file, and the kernel may drop other files' pages for it.
pub fn decide_streaming(
    model_bytes: u64,
    kv_bytes: u64,
    margin_bytes: u64,
    mem_available_bytes: Option<u64>,
    cgroup_limit_bytes: Option<u64>,
) -> StreamChoice {
    let (room_bytes, room_from) = match (cgroup_limit_bytes, mem_available_bytes) {
        (Some(c), Some(m)) if c <= m => (c, MemSource::Cgroup),
        (_, Some(m)) => (m, MemSource::MemAvailable),
        (Some(c), None) => (c, MemSource::Cgroup),
        (None, None) => return StreamChoice::Unknown,
    };
    let fit = Fit {
        model_bytes,
        kv_bytes,
        margin_bytes,
        room_bytes,
        room_from,
    };
    if fit.need_bytes() > room_bytes {
        StreamChoice::TooBig(fit)
    } else {
        StreamChoice::Fits(fit)
    }
}

/// The resolved configuration of one run: every knob the decode step, the telemetry and the
/// `# bmoe_metrics v2` preamble need, as values rather than as typed flags.
///
/// Built in two stages. From flags (before the model is loaded) the model facts are empty and
/// `cache_budget_mb` is 0; `validate()` judges this stage. After the model is loaded the engine
/// (or the simulator, from a trace preamble) fills the model facts, the effective top-k, the
/// cache cycle and the resolved budget (`resolve_cache_budget`), and `validate_model()` checks
/// what needed the model. The preamble prints the second stage.
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    /// Version of the build that produced the run (`bmoe-cli --version`); `unknown` if unset.
    pub engine_version: String,

    // --- model facts (filled at load) ---
    /// The model file name (or path) as the user named it.
    pub model: String,
    /// GGUF `general.architecture`.
    pub arch: String,
    /// How the model's router selects and weights experts (the architecture's, or a trace
    /// preamble's `gating=`; qwen3moe's until a model is loaded).
    pub gating: crate::gating::Gating,
    /// Transformer layers in the model.
    pub n_layer: u32,
    /// Experts per MoE layer; 0 on a dense model.
    pub n_expert: u32,
    /// Effective routing width after any `--n-expert-used` override; 0 before load or on a
    /// dense model.
    pub n_expert_used: u32,
    /// `--n-expert-used`: top-k override, 0 = the model's own.
    pub n_expert_used_override: u32,

    // --- run ---
    /// `-n`: tokens to generate.
    pub n_predict: u32,
    /// `-t`: compute threads.
    pub threads: u32,
    /// `-c`: context size in tokens.
    pub n_ctx: u32,
    /// `--ubatch`: widest graph in tokens, 0 = as wide as the context.
    pub n_ubatch: u32,
    /// `--chatml`: the prompt is rendered through the chat template.
    pub chatml: bool,

    // --- streaming and cache ---
    /// `--moe-stream`: routed experts are read from flash instead of the mmap.
    pub moe_stream: bool,
    /// `--routing-from`: the route trace the router followed (an instrumented run).
    pub routing_from: Option<String>,
    /// How `moe_stream` was settled: by a flag, or by the engine's fit check at load when
    /// neither `--moe-stream` nor `--no-moe-stream` was given ([`StreamChoice::Auto`] until then).
    pub stream_choice: StreamChoice,
    /// The fixed budget asked for (MiB), 0 = no fixed budget (off, or auto).
    pub cache_mb: u64,
    /// `--cache-mb auto`: size the budget at load from free memory.
    pub cache_auto: bool,
    /// The budget the streamer settled on (MiB): `cache_mb` when fixed, the auto formula's
    /// result under auto, 0 with the cache off. What the preamble prints as `cache_mb=`.
    pub cache_budget_mb: u64,
    /// Under auto, the figure that bounded the room the budget was sized in
    /// ([`auto_cache_room_from`]), for the `mode:` line; `None` when unknown or not auto.
    pub cache_room_from: Option<MemSource>,
    /// `--cache-floor-mb`: RAM auto-sizing leaves free (MiB).
    pub cache_floor_mb: u64,
    /// `--cache-ceil-mb`: upper bound on the auto budget (MiB), 0 = none.
    pub cache_ceil_mb: u64,
    /// One token's worst-case routed bytes at the effective top-k (MiB), priced at load.
    pub cache_cycle_mb: u64,
    /// `--force-cache`: accept a budget in 1..CACHE_MIN_MB.
    pub force_cache: bool,
    /// `--load-all`: read every expert every token (debug).
    pub load_all: bool,
    /// `--io-threads`: read lanes.
    pub io_threads: u32,
    /// Whether the expert reads bypass the page cache, as the open **achieved** it (not as
    /// asked): `--no-odirect` asks for buffered reads, and a platform may refuse O_DIRECT.
    pub o_direct: bool,
    /// Why the reads are buffered although O_DIRECT was asked for (the filesystem refused it:
    /// the engine's one-line summary), for the `mode:` line; `None` when nothing was refused.
    pub o_direct_refused: Option<String>,
    /// Streamed experts in transparent huge pages where possible (`--no-hugepages` off).
    pub huge_pages: bool,
    /// `--overlap`: compute each expert as soon as its own read lands.
    pub overlap: bool,
    /// Two-wave publish (an original-engine knob kept for the preamble; no bmoe flag sets it).
    pub io_two_wave: bool,
    /// `--prefetch K`: temporal prefetch horizon in layers, 0 = off.
    pub prefetch: u32,
    /// `--route-ahead N`: commit the routing predicted N layers early, 0 = off.
    pub route_ahead: u32,
    /// `--predict-prefetch`: stale-gate speculative prefetch.
    pub predict_prefetch: bool,
    /// `--predict-log`: the prediction probe (an instrumented run).
    pub predict_log: bool,
    /// `--predict-spec-max`: predicted misses read per layer.
    pub predict_spec_max: u32,
    /// Speculation integrated synchronously (tests only; no bmoe flag sets it yet).
    pub prefetch_sync: bool,
    /// `--dense-weights`.
    pub dense_weights: DenseWeights,
    /// `--eviction`.
    pub eviction: EvictionPolicy,
    /// `--read-split`: how an expert's projection extents are cut into reads.
    pub read_split: crate::vocab::ReadSplit,
    /// `--drop-cold-experts F`: drop a missed expert weighted below F/top-k, 0 = off.
    pub drop_cold_frac: f32,
    /// Rescale the survivors of a drop to the routing's original mass (`--drop-no-renorm` off).
    pub drop_renorm: bool,
    /// `--drop-in-prefill`: also drop during prefill.
    pub drop_prefill: bool,
    /// `--expert-substitute L`: residency margin for re-ranking, 0 = off.
    pub substitute_lambda: f32,
    /// `--read-timeout-ms`: a flash read not done by then is a reported timeout.
    pub read_timeout_ms: u64,
    /// `--inject-faults` (a test hook): the seeded flash faults both leaves inject.
    pub inject_faults: Option<crate::faults::FaultPlan>,

    // --- sampling ---
    /// `--temp`: > 0 samples, otherwise greedy.
    pub temp: f32,
    /// `--top-k` sampling cutoff.
    pub top_k: u32,
    /// `--top-p` sampling cutoff.
    pub top_p: f32,
    /// `--seed`, resolved (a random seed is drawn by the binary and recorded here).
    pub seed: u64,

    // --- diagnostics ---
    /// Per-layer compute trace granularity; 0 = no compute trace.
    pub compute_trace_layers: u32,
    /// `--route-trace` was given.
    pub route_trace: bool,
    /// `--io-trace` was given.
    pub io_trace: bool,

    // --- speculation ---
    /// Draft source.
    pub spec: SpecMode,
    /// `--draft`: tokens drafted per step.
    pub spec_draft_max: u32,
    /// `--mtp-p-min`: MTP confidence floor.
    pub mtp_p_min: f32,
    /// `--ngram-min-match`.
    pub ngram_min_match: u32,
    /// `--ngram-max-match`.
    pub ngram_max_match: u32,
}

impl Default for RunConfig {
    /// The defaults of `bmoe-cli`'s flag list (features.md §14).
    fn default() -> Self {
        RunConfig {
            engine_version: "unknown".to_string(),
            model: String::new(),
            arch: String::new(),
            gating: crate::gating::Gating::default(),
            n_layer: 0,
            n_expert: 0,
            n_expert_used: 0,
            n_expert_used_override: 0,
            n_predict: 128,
            threads: 4,
            n_ctx: 2048,
            n_ubatch: 0,
            chatml: false,
            moe_stream: false,
            stream_choice: StreamChoice::Flag,
            routing_from: None,
            cache_mb: 0,
            cache_auto: false,
            cache_budget_mb: 0,
            cache_room_from: None,
            cache_floor_mb: CACHE_FLOOR_DEFAULT_MB,
            cache_ceil_mb: 0,
            cache_cycle_mb: 0,
            force_cache: false,
            load_all: false,
            io_threads: IO_THREADS_DEFAULT,
            o_direct: true,
            o_direct_refused: None,
            huge_pages: true,
            overlap: false,
            io_two_wave: false,
            prefetch: 0,
            route_ahead: 0,
            predict_prefetch: false,
            predict_log: false,
            predict_spec_max: PREDICT_SPEC_MAX_DEFAULT,
            prefetch_sync: false,
            dense_weights: DenseWeights::Anon,
            eviction: EvictionPolicy::Lru,
            read_split: crate::vocab::ReadSplit::Auto,
            drop_cold_frac: 0.0,
            drop_renorm: true,
            drop_prefill: false,
            substitute_lambda: 0.0,
            read_timeout_ms: READ_TIMEOUT_MS_DEFAULT,
            inject_faults: None,
            temp: 0.0,
            top_k: 40,
            top_p: 0.95,
            seed: 0,
            compute_trace_layers: 0,
            route_trace: false,
            io_trace: false,
            spec: SpecMode::Off,
            spec_draft_max: 3,
            mtp_p_min: 0.0,
            ngram_min_match: 3,
            ngram_max_match: 12,
        }
    }
}

/// Largest `--read-timeout-ms`: a day.
pub const READ_TIMEOUT_MS_MAX: u64 = 86_400_000;

fn requires(flag: &'static str, needs: &'static str, why: &'static str) -> ConfigError {
    ConfigError::Requires { flag, needs, why }
}

fn excludes(flag: &'static str, other: &'static str, why: &'static str) -> ConfigError {
    ConfigError::Excludes { flag, other, why }
}

fn out_of_range(
    flag: &'static str,
    value: impl fmt::Display,
    rule: impl Into<String>,
) -> ConfigError {
    ConfigError::OutOfRange {
        flag,
        value: value.to_string(),
        rule: rule.into(),
    }
}

const STREAMING: &str = "--moe-stream";
const THE_CACHE: &str = "the expert cache (--cache-mb N or auto)";

impl RunConfig {
    /// Whether an expert cache is in use: a fixed budget or auto-sizing, under streaming.
    pub fn cache_on(&self) -> bool {
        self.moe_stream && (self.cache_mb > 0 || self.cache_auto)
    }

    /// Checks every rule that needs only the flags (features.md §1–§8, §14). Returns the first
    /// broken rule; the message names the flag and the rule.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.n_predict == 0 {
            return Err(out_of_range("-n/--n-predict", 0, "must be > 0"));
        }
        if self.threads == 0 {
            return Err(out_of_range("-t/--threads", 0, "must be > 0"));
        }
        if self.n_ctx == 0 {
            return Err(out_of_range("-c/--ctx-size", 0, "must be > 0"));
        }
        if self.n_ubatch > self.n_ctx {
            return Err(out_of_range(
                "--ubatch",
                self.n_ubatch,
                format!(
                    "must be <= the context size {} (0 = as wide as the context): a wider graph \
                     would be reserved for a batch that cannot occur",
                    self.n_ctx
                ),
            ));
        }
        self.validate_sampling()?;
        self.validate_spec()?;
        // Without a streaming flag the engine decides at load; the knobs that need streaming
        // are judged once it has (`resolve_streaming`).
        if self.stream_choice != StreamChoice::Auto {
            self.validate_needs_streaming()?;
        }
        if self.moe_stream {
            self.validate_streaming()?;
        }
        Ok(())
    }

    fn validate_sampling(&self) -> Result<(), ConfigError> {
        if !(self.temp.is_finite() && self.temp >= 0.0) {
            return Err(out_of_range(
                "--temp",
                self.temp,
                "must be a finite number >= 0",
            ));
        }
        // The other sampling knobs are inert under greedy decoding, so they are judged only
        // when sampling is on.
        if self.temp > 0.0 && !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(out_of_range("--top-p", self.top_p, "must be in (0, 1]"));
        }
        Ok(())
    }

    fn validate_spec(&self) -> Result<(), ConfigError> {
        if self.spec == SpecMode::Off {
            return Ok(());
        }
        if !(1..=DRAFT_MAX_LIMIT).contains(&self.spec_draft_max) {
            return Err(out_of_range(
                "--draft",
                self.spec_draft_max,
                format!("must be in [1, {DRAFT_MAX_LIMIT}]"),
            ));
        }
        if self.spec == SpecMode::Mtp && !(self.mtp_p_min >= 0.0 && self.mtp_p_min <= 1.0) {
            return Err(out_of_range(
                "--mtp-p-min",
                self.mtp_p_min,
                "must be in [0, 1]",
            ));
        }
        if self.spec == SpecMode::Ngram {
            if self.mtp_p_min != 0.0 {
                return Err(excludes(
                    "--mtp-p-min",
                    "--ngram",
                    "the n-gram source has no probabilities; its confidence gate is --ngram-min-match",
                ));
            }
            if !(1..=NGRAM_MATCH_LIMIT).contains(&self.ngram_max_match) {
                return Err(out_of_range(
                    "--ngram-max-match",
                    self.ngram_max_match,
                    format!("must be in [1, {NGRAM_MATCH_LIMIT}]"),
                ));
            }
            if !(1..=self.ngram_max_match).contains(&self.ngram_min_match) {
                return Err(out_of_range(
                    "--ngram-min-match",
                    self.ngram_min_match,
                    format!(
                        "must be in [1, --ngram-max-match={}]: a floor above the longest suffix \
                         considered would never draft",
                        self.ngram_max_match
                    ),
                ));
            }
        }
        if self.n_ubatch > 0 && self.n_ubatch < self.spec_draft_max + 1 {
            return Err(out_of_range(
                "--ubatch",
                self.n_ubatch,
                format!(
                    "is narrower than the verify batch ({} positions): raise --ubatch or lower --draft",
                    self.spec_draft_max + 1
                ),
            ));
        }
        Ok(())
    }

    /// Knobs that attach to the streaming path and mean nothing without it. A cache budget
    /// without streaming is not refused: `BMOE_CACHE_MB` may be exported for every run, and a
    /// baseline simply has no cache (`cache_on()` is false).
    fn validate_needs_streaming(&self) -> Result<(), ConfigError> {
        if self.moe_stream {
            return Ok(());
        }
        let why_stream =
            "it acts on the streamer's own reads, which a run without streaming does not make";
        let checks: [(bool, &'static str, &'static str); 13] = [
            (
                self.inject_faults.is_some(),
                "--inject-faults",
                "faults are injected into the streamer's flash reads",
            ),
            (self.overlap, "--overlap", why_stream),
            (self.io_two_wave, "--io-two-wave", why_stream),
            (
                self.predict_log,
                "--predict-log",
                "the probe rides on the routing the streamer isolates",
            ),
            (self.predict_prefetch, "--predict-prefetch", why_stream),
            (
                self.route_ahead > 0,
                "--route-ahead",
                "it commits routings at the nodes the streamer isolates; off the streaming path there is nothing to commit to",
            ),
            (self.prefetch > 0, "--prefetch", why_stream),
            (self.prefetch_sync, "--prefetch-sync", why_stream),
            (
                self.drop_cold_frac > 0.0,
                "--drop-cold-experts",
                "dropping consults the expert cache, which only exists under streaming",
            ),
            (
                self.substitute_lambda > 0.0,
                "--expert-substitute",
                "substitution prefers resident experts, and residency only exists under streaming",
            ),
            (self.load_all, "--load-all", why_stream),
            (
                self.route_trace,
                "--route-trace",
                "without streaming there is no routing to observe",
            ),
            (
                self.io_trace,
                "--io-trace",
                "without streaming the engine issues no expert reads",
            ),
        ];
        for (set, flag, why) in checks {
            if set {
                return Err(requires(flag, STREAMING, why));
            }
        }
        Ok(())
    }

    fn validate_streaming(&self) -> Result<(), ConfigError> {
        if !(1..=READ_TIMEOUT_MS_MAX).contains(&self.read_timeout_ms) {
            return Err(out_of_range(
                "--read-timeout-ms",
                self.read_timeout_ms,
                format!("must be in [1, {READ_TIMEOUT_MS_MAX}] (a day)"),
            ));
        }
        if !(1..=IO_THREADS_MAX).contains(&self.io_threads) {
            return Err(out_of_range(
                "--io-threads",
                self.io_threads,
                format!("must be in [1, {IO_THREADS_MAX}]"),
            ));
        }
        if self.cache_auto && self.cache_mb > 0 {
            return Err(excludes(
                "--cache-mb auto",
                "a numeric --cache-mb",
                "choose auto-sizing or a fixed budget, not both",
            ));
        }
        if self.cache_mb > 0 && self.cache_mb < CACHE_MIN_MB && !self.force_cache {
            return Err(out_of_range(
                "--cache-mb",
                self.cache_mb,
                format!(
                    "1-{} MiB is the pathological band: a cache smaller than one token's routed \
                     working set thrashes and is slower than no cache. Use 0 (off), a value >= {}, \
                     or add --force-cache",
                    CACHE_MIN_MB - 1,
                    CACHE_MIN_MB
                ),
            ));
        }
        if self.prefetch > PREFETCH_MAX {
            return Err(out_of_range(
                "--prefetch",
                self.prefetch,
                format!("must be in [0, {PREFETCH_MAX}]"),
            ));
        }
        if self.predict_spec_max > PREDICT_SPEC_MAX_LIMIT {
            return Err(out_of_range(
                "--predict-spec-max",
                self.predict_spec_max,
                format!(
                    "must be in [0, {PREDICT_SPEC_MAX_LIMIT}] (0 = retention only, no speculation)"
                ),
            ));
        }
        if self.route_ahead > ROUTE_AHEAD_MAX {
            return Err(out_of_range(
                "--route-ahead",
                self.route_ahead,
                format!("must be in [0, {ROUTE_AHEAD_MAX}] (0 = off)"),
            ));
        }
        // Written as negated inclusive ranges so NaN (every comparison false) is refused too.
        if !(self.drop_cold_frac >= 0.0 && self.drop_cold_frac <= 1.0) {
            return Err(out_of_range(
                "--drop-cold-experts",
                self.drop_cold_frac,
                "must be in [0, 1] (0 = off): above 1.0 the threshold can exceed the largest \
                 weight of a routing and empty it; 1.0 is the uniform share 1/top-k",
            ));
        }
        if !(self.substitute_lambda >= 0.0 && self.substitute_lambda <= 1.0) {
            return Err(out_of_range(
                "--expert-substitute",
                self.substitute_lambda,
                "must be in [0, 1] (0 = off): at 1.0 a resident expert already outranks every \
                 non-resident one",
            ));
        }
        let cache_on = self.cache_on();
        let why_slots =
            "speculative reads land in cache slots, which do not exist with the cache off";
        if self.prefetch > 0 && !cache_on {
            return Err(requires("--prefetch", THE_CACHE, why_slots));
        }
        if self.predict_prefetch && !cache_on {
            return Err(requires("--predict-prefetch", THE_CACHE, why_slots));
        }
        if self.predict_prefetch && self.prefetch > 0 {
            return Err(excludes(
                "--predict-prefetch",
                "--prefetch",
                "they are two predictors for the same speculative lanes; both would double the \
                 speculated bytes for one future",
            ));
        }
        if self.route_ahead > 0 && (self.predict_log || self.predict_prefetch || self.prefetch > 0)
        {
            return Err(excludes(
                "--route-ahead",
                "--predict-log, --predict-prefetch and --prefetch",
                "the probe would grade a predictor against a routing rewritten from it, and a \
                 speculative prefetch would bet lanes on a future route-ahead has already fixed",
            ));
        }
        if self.route_ahead > 0 && self.spec != SpecMode::Off {
            return Err(excludes(
                "--route-ahead",
                "--mtp/--ngram",
                "a verify decode is several positions wide, so route-ahead would commit nothing \
                 while still paying for its predictions",
            ));
        }
        if self.drop_cold_frac > 0.0 && !cache_on {
            return Err(requires(
                "--drop-cold-experts",
                THE_CACHE,
                "with the cache off every expert is a miss, so the policy degenerates into an \
                 unconditional weight cut (what --n-expert-used already does)",
            ));
        }
        if self.substitute_lambda > 0.0 && !cache_on {
            return Err(requires(
                "--expert-substitute",
                THE_CACHE,
                "with the cache off nothing is resident, so there is nothing to prefer",
            ));
        }
        if self.io_two_wave && !self.overlap {
            return Err(requires(
                "--io-two-wave",
                "--overlap",
                "without overlap reads are drained synchronously and no lane idles on the publish",
            ));
        }
        if self.io_two_wave && !cache_on {
            return Err(requires(
                "--io-two-wave",
                THE_CACHE,
                "the wave split moves cache page commits off the publish path",
            ));
        }
        if self.prefetch_sync && !cache_on {
            return Err(requires("--prefetch-sync", THE_CACHE, why_slots));
        }
        Ok(())
    }

    /// Checks what needs the loaded model: the top-k override against the expert count. Call it
    /// once `n_expert` is filled.
    pub fn validate_model(&self) -> Result<(), ConfigError> {
        if self.n_expert > 0 && self.n_expert_used_override > self.n_expert {
            return Err(out_of_range(
                "--n-expert-used",
                self.n_expert_used_override,
                format!(
                    "must be <= the model's {} experts per layer (0 = the model's own top-k)",
                    self.n_expert
                ),
            ));
        }
        Ok(())
    }

    /// Settles a run given neither `--moe-stream` nor `--no-moe-stream` with the engine's fit
    /// check ([`decide_streaming`]): a model that does not fit streams, with `--overlap` and —
    /// unless a budget was given (`cache_given`: `--cache-mb` or `BMOE_CACHE_MB`) —
    /// `--cache-mb auto`. Then judges the knobs that need streaming, which `validate()`
    /// deferred.
    pub fn resolve_streaming(
        &mut self,
        choice: StreamChoice,
        cache_given: bool,
    ) -> Result<(), ConfigError> {
        self.stream_choice = choice;
        if let StreamChoice::TooBig(_) = choice {
            self.moe_stream = true;
            self.overlap = true;
            if !cache_given {
                self.cache_auto = true;
                self.cache_mb = 0;
            }
        }
        self.validate()
    }

    /// Fixes `cache_budget_mb`: the fixed budget, the given auto-sized budget (bytes, from
    /// `auto_cache_budget`) under auto, or 0 when the cache is off.
    pub fn resolve_cache_budget(&mut self, auto_budget_bytes: u64) {
        self.cache_budget_mb = if !self.cache_on() {
            0
        } else if self.cache_auto {
            auto_budget_bytes / MIB
        } else {
            self.cache_mb
        };
    }

    /// The once-at-load warning for a budget below one token's worst-case cycle, or `None`.
    pub fn cache_cycle_warning(&self) -> Option<String> {
        if self.cache_budget_mb > 0
            && self.cache_cycle_mb > 0
            && self.cache_budget_mb < self.cache_cycle_mb
        {
            Some(format!(
                "bmoe: WARNING expert cache {} MiB is below this model's worst-case token cycle of {} MiB \
                 at top-k {} — no entry can survive to the next token, so expect a hit rate near zero.",
                self.cache_budget_mb, self.cache_cycle_mb, self.n_expert_used
            ))
        } else {
            None
        }
    }

    /// Every once-at-load warning that applies to the resolved configuration, in print order.
    pub fn load_warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.moe_stream {
            if let Some(w) = drop_low_topk_warning(self.drop_cold_frac, self.n_expert_used) {
                out.push(w);
            }
        }
        if let Some(w) = self.cache_cycle_warning() {
            out.push(w);
        }
        out
    }
}

/// The warning printed once at load when `--drop-cold-experts F` is armed on a routing of
/// `DROP_LOW_TOPK_WARN` experts or fewer (expert-dropping.md), or `None`. One line; the
/// document wraps it for reading. `top_k` is the effective routing width.
pub fn drop_low_topk_warning(drop_cold_frac: f32, top_k: u32) -> Option<String> {
    if drop_cold_frac > 0.0 && top_k > 0 && top_k <= DROP_LOW_TOPK_WARN {
        let threshold_pct = 100.0 * f64::from(drop_cold_frac) / f64::from(top_k);
        Some(format!(
            "bmoe: WARNING drop-cold-experts={:.2} with top-k {} — the threshold is {:.1}% of the \
             routing here, against 12.5% at the top-k 8 this was measured on. Expect it to discard \
             much more, and check output quality on your own task.",
            drop_cold_frac, top_k, threshold_pct
        ))
    } else {
        None
    }
}

/// The `--cache-mb auto` budget in bytes (cache-sizing.md, plus the process's cgroup):
///
/// `clamp(min(MemAvailable, cgroup_limit − cgroup_usage) − floor, 1500 MiB, total_expert_bytes)`,
/// then `min(·, ceil)` when `ceil_bytes > 0`.
///
/// Unknown inputs are `None` (no `/proc/meminfo`, no cgroup limit — `max` — or an unreadable
/// usage, taken as 0). When neither memory figure is known the budget is the 1500 MiB minimum.
/// When the whole expert set is smaller than 1500 MiB the budget is the whole set: a cache
/// larger than everything it could hold buys nothing. A dense model (`total_expert_bytes` 0)
/// gets 0.
pub fn auto_cache_budget(
    mem_available_bytes: Option<u64>,
    cgroup_limit_bytes: Option<u64>,
    cgroup_usage_bytes: Option<u64>,
    floor_bytes: u64,
    ceil_bytes: u64,
    total_expert_bytes: u64,
) -> u64 {
    let cgroup_headroom =
        cgroup_limit_bytes.map(|limit| limit.saturating_sub(cgroup_usage_bytes.unwrap_or(0)));
    let available = match (mem_available_bytes, cgroup_headroom) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (Some(a), None) | (None, Some(a)) => Some(a),
        (None, None) => None,
    };
    let min_bytes = CACHE_MIN_MB * MIB;
    let wanted = match available {
        Some(a) => a.saturating_sub(floor_bytes).max(min_bytes),
        None => min_bytes,
    };
    let budget = wanted.min(total_expert_bytes);
    if ceil_bytes > 0 {
        budget.min(ceil_bytes)
    } else {
        budget
    }
}

/// Which figure bounded [`auto_cache_budget`]'s room: `MemAvailable` or the process limit's
/// headroom (`headroom` is its limit − usage, and where the limit came from), whichever is
/// smaller; `None` when neither is known. Ties go to the limit, as in the fit check.
pub fn auto_cache_room_from(
    mem_available_bytes: Option<u64>,
    headroom: Option<(u64, MemSource)>,
) -> Option<MemSource> {
    match (mem_available_bytes, headroom) {
        (Some(a), Some((h, from))) => Some(if h <= a {
            from
        } else {
            MemSource::MemAvailable
        }),
        (Some(_), None) => Some(MemSource::MemAvailable),
        (None, Some((_, from))) => Some(from),
        (None, None) => None,
    }
}

/// One token's worst-case routed bytes: `Σ_layers expert_bytes(layer) × min(top_k, n_expert)`
/// (cache-sizing.md's cycle guard), with `per_layer_expert_bytes[l]` the bytes of one expert of
/// MoE layer `l` (every projection). An upper bound on the measured `token_demand_MiB`.
pub fn cache_cycle_bytes(per_layer_expert_bytes: &[u64], top_k: u32, n_expert: u32) -> u64 {
    let k = u64::from(top_k.min(n_expert));
    per_layer_expert_bytes
        .iter()
        .fold(0u64, |acc, &b| acc.saturating_add(b.saturating_mul(k)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streaming() -> RunConfig {
        RunConfig {
            moe_stream: true,
            ..RunConfig::default()
        }
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_auto_budget_names_the_smaller_of_memavailable_and_the_headroom() {
        let from = auto_cache_room_from;
        assert_eq!(from(None, None), None);
        assert_eq!(from(Some(GIB), None), Some(MemSource::MemAvailable));
        assert_eq!(
            from(None, Some((GIB, MemSource::RlimitAs))),
            Some(MemSource::RlimitAs)
        );
        assert_eq!(
            from(Some(4 * GIB), Some((GIB, MemSource::Cgroup))),
            Some(MemSource::Cgroup)
        );
        assert_eq!(
            from(Some(GIB), Some((4 * GIB, MemSource::RlimitData))),
            Some(MemSource::MemAvailable)
        );
    }

    #[test]
    fn the_fit_check_compares_model_kv_and_margin_with_the_smaller_room() {
        // 10 GiB model, 1 GiB KV, 1.5 GiB margin: 12.5 GiB needed.
        let need = |avail, cg| decide_streaming(10 * GIB, GIB, 3 * GIB / 2, avail, cg);
        // Ample MemAvailable, no cgroup: resident.
        let c = need(Some(20 * GIB), None);
        assert!(matches!(c, StreamChoice::Fits(f) if f.room_from == MemSource::MemAvailable));
        // A cgroup limit below MemAvailable decides, and it is too small: stream.
        let c = need(Some(20 * GIB), Some(8 * GIB));
        assert!(
            matches!(c, StreamChoice::TooBig(f) if f.room_from == MemSource::Cgroup && f.room_bytes == 8 * GIB)
        );
        // A cgroup limit above MemAvailable does not: MemAvailable is the room.
        let c = need(Some(12 * GIB), Some(64 * GIB));
        assert!(matches!(c, StreamChoice::TooBig(f) if f.room_from == MemSource::MemAvailable));
        // Exactly enough fits; a byte less does not.
        assert!(matches!(
            need(Some(25 * GIB / 2), None),
            StreamChoice::Fits(_)
        ));
        assert!(matches!(
            need(Some(25 * GIB / 2 - 1), None),
            StreamChoice::TooBig(_)
        ));
        // Nothing known: resident, and the reason says so.
        let c = need(None, None);
        assert_eq!(c, StreamChoice::Unknown);
        assert!(c.reason().unwrap().contains("unknown"));
        assert_eq!(need(None, Some(4 * GIB)).name(), "too_big");
    }

    #[test]
    fn a_model_too_big_streams_with_overlap_and_auto_cache_unless_a_budget_was_given() {
        let too_big = decide_streaming(10 * GIB, 0, 0, Some(GIB), None);
        let mut c = RunConfig {
            stream_choice: StreamChoice::Auto,
            ..RunConfig::default()
        };
        c.resolve_streaming(too_big, false).unwrap();
        assert!(c.moe_stream && c.overlap && c.cache_auto);
        assert!(c
            .stream_choice
            .reason()
            .unwrap()
            .contains("--no-moe-stream"));
        let mut c = RunConfig {
            stream_choice: StreamChoice::Auto,
            cache_mb: 2000,
            ..RunConfig::default()
        };
        c.resolve_streaming(too_big, true).unwrap();
        assert!(c.moe_stream && !c.cache_auto && c.cache_mb == 2000);
    }

    #[test]
    fn the_auto_cache_of_a_chosen_stream_stays_inside_the_room() {
        // 8 GiB cgroup, 17 GiB model of which 15.5 GiB experts, 0.5 GiB KV, 1.5 GiB floor:
        // 8 - 1.5 dense - 0.5 KV - 1.5 margin = 4.5 GiB.
        let f = match decide_streaming(
            17 * GIB,
            GIB / 2,
            3 * GIB / 2,
            Some(20 * GIB),
            Some(8 * GIB),
        ) {
            StreamChoice::TooBig(f) => f,
            c => panic!("{c:?}"),
        };
        assert_eq!(f.cache_ceiling_bytes(31 * GIB / 2), 9 * GIB / 2);
        // A 256 MiB cgroup: the 1.5 GiB floor is more than it can spare, so a quarter of it
        // (64 MiB) is kept: 256 - 20 dense - 8 KV - 64 = 164 MiB.
        let f = decide_streaming(312 * MIB, 8 * MIB, 1536 * MIB, None, Some(256 * MIB));
        assert_eq!(f.fit().unwrap().cache_ceiling_bytes(292 * MIB), 164 * MIB);
        // No room at all once the dense weights are in.
        let f = decide_streaming(4 * GIB, 0, 0, None, Some(GIB));
        assert_eq!(f.fit().unwrap().cache_ceiling_bytes(2 * GIB), 0);
    }

    #[test]
    fn streaming_knobs_wait_for_the_fit_check_and_are_refused_when_the_model_fits() {
        let mut c = RunConfig {
            stream_choice: StreamChoice::Auto,
            prefetch: 2,
            ..RunConfig::default()
        };
        c.validate()
            .expect("undecided: --prefetch waits for the fit check");
        let fits = decide_streaming(GIB, 0, 0, Some(10 * GIB), None);
        let e = c.clone().resolve_streaming(fits, false).unwrap_err();
        assert!(
            e.to_string().contains("--prefetch requires --moe-stream"),
            "{e}"
        );
        let too_big = decide_streaming(GIB, 0, 0, Some(GIB / 2), None);
        c.resolve_streaming(too_big, false).unwrap();
        assert!(c.moe_stream && c.prefetch == 2);
    }

    #[test]
    fn defaults_validate() {
        assert_eq!(RunConfig::default().validate(), Ok(()));
        assert_eq!(streaming().validate(), Ok(()));
    }

    #[test]
    fn auto_budget_formula() {
        let gib = 1024 * MIB;
        // 8 GiB available, floor 1536 MiB -> 6.5 GiB, well inside [1500 MiB, 20 GiB].
        assert_eq!(
            auto_cache_budget(Some(8 * gib), None, None, 1536 * MIB, 0, 20 * gib),
            8 * gib - 1536 * MIB
        );
        // The cgroup headroom is tighter than MemAvailable.
        assert_eq!(
            auto_cache_budget(
                Some(8 * gib),
                Some(6 * gib),
                Some(gib),
                1536 * MIB,
                0,
                20 * gib
            ),
            5 * gib - 1536 * MIB
        );
        // Below the floor: the minimum.
        assert_eq!(
            auto_cache_budget(Some(gib), None, None, 1536 * MIB, 0, 20 * gib),
            1500 * MIB
        );
        // Unknown memory: the minimum.
        assert_eq!(
            auto_cache_budget(None, None, None, 1536 * MIB, 0, 20 * gib),
            1500 * MIB
        );
        // The whole expert set is smaller than the minimum: the whole set.
        assert_eq!(
            auto_cache_budget(Some(8 * gib), None, None, 0, 0, 300 * MIB),
            300 * MIB
        );
        // Ceiling applies last.
        assert_eq!(
            auto_cache_budget(Some(8 * gib), None, None, 1536 * MIB, 3000 * MIB, 20 * gib),
            3000 * MIB
        );
        // Dense model.
        assert_eq!(auto_cache_budget(Some(8 * gib), None, None, 0, 0, 0), 0);
        // Usage above the limit leaves no headroom: the minimum.
        assert_eq!(
            auto_cache_budget(Some(8 * gib), Some(gib), Some(2 * gib), 0, 0, 20 * gib),
            1500 * MIB
        );
    }

    #[test]
    fn cycle_bytes() {
        assert_eq!(cache_cycle_bytes(&[10, 20, 30], 4, 8), 240);
        assert_eq!(cache_cycle_bytes(&[10, 20, 30], 16, 8), 480);
        assert_eq!(cache_cycle_bytes(&[], 4, 8), 0);
    }

    #[test]
    fn drop_warning_text() {
        let w = drop_low_topk_warning(0.75, 2);
        assert_eq!(
            w.as_deref(),
            Some(
                "bmoe: WARNING drop-cold-experts=0.75 with top-k 2 — the threshold is 37.5% of the routing \
                 here, against 12.5% at the top-k 8 this was measured on. Expect it to discard much more, \
                 and check output quality on your own task."
            )
        );
        assert!(drop_low_topk_warning(0.75, 4).is_some());
        assert!(drop_low_topk_warning(0.75, 5).is_none());
        assert!(drop_low_topk_warning(0.0, 2).is_none());
        assert!(drop_low_topk_warning(0.75, 0).is_none());
    }

    #[test]
    fn resolve_budget() {
        let mut c = streaming();
        c.cache_auto = true;
        c.resolve_cache_budget(3000 * MIB + 5);
        assert_eq!(c.cache_budget_mb, 3000);
        c.cache_auto = false;
        c.cache_mb = 2000;
        c.resolve_cache_budget(3000 * MIB);
        assert_eq!(c.cache_budget_mb, 2000);
        c.moe_stream = false;
        c.resolve_cache_budget(3000 * MIB);
        assert_eq!(c.cache_budget_mb, 0);
    }

    #[test]
    fn cycle_warning() {
        let mut c = streaming();
        c.cache_mb = 1500;
        c.cache_budget_mb = 1500;
        c.cache_cycle_mb = 1815;
        c.n_expert_used = 4;
        let w = c.cache_cycle_warning().unwrap_or_default();
        assert!(w.contains("expert cache 1500 MiB is below this model's worst-case token cycle of 1815 MiB at top-k 4"));
        c.cache_budget_mb = 2000;
        assert!(c.cache_cycle_warning().is_none());
    }
}
