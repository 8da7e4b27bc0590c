//! The vocabulary every layer of the core speaks, at the bottom of the stack: the ids of
//! expert slots and MoE layers, what one read is tagged with and how it fails, how a routing
//! or a backend call fails, and a decode step's input, its read split, its stats and its
//! errors.
//!
//! These types are named by several layers above (flash, backend, cache, prefetch, streamer,
//! predict, step, telemetry), so they live here, below all of them, and depend only on the
//! leaves (`clock`, `layout`, `records`). Each is re-exported from the module that used to
//! define it (`step::StepInput`, `flash::FlashError`, ...), so those paths keep working.

use crate::clock::Nanos;
use crate::layout::ExpertKey;
use crate::records::Phase;
use thiserror::Error;

/// Where an expert's bytes live while a layer computes. The core decides slots; the engine
/// maps them to memory; the simulator has no memory at all.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SlotId {
    /// A cached expert: the engine's arena reserves one address range per (layer, expert)
    /// (per projection, native GGUF layout) and commits its pages lazily. Valid from the read
    /// that fills it until `Backend::release` of the same slot.
    Canonical(ExpertKey),
    /// Cache off: a place in the shared staging buffers (`max n_expert` expert slots), reused
    /// by every layer. The number is the expert's position in the layer's union of routed
    /// experts (0..k-1 in a decode step), not its id, so that only as many slots as a layer
    /// reads at once are ever touched. Valid from the read that fills it until the layer's
    /// `finish_layer` returns; the next layer's reads may overwrite it.
    Staging(u16),
}

/// A model layer that has routed experts: its model layer number and its MoE index.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LayerId {
    /// Model layer (`blk.N`).
    pub model: u32,
    /// MoE layer index (what `ExpertKey::layer`, traces and the cache use).
    pub moe: u16,
}

/// What a read serves, for the io trace and error messages.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReadTag {
    /// MoE layer index.
    pub layer: u16,
    pub expert: u16,
    /// Projection index in `MoeLayerLayout::projections` (0 gate, 1 up, 2 down for qwen3moe).
    pub proj: u8,
}

/// A submitted read's handle, unique for the lifetime of the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReadId(pub u64);

impl std::fmt::Display for ReadId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Why a read failed. Errors are sticky and loud (STYLE 12): the step that sees one stops,
/// and its engine refuses further steps — the output can no longer be trusted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FlashError {
    #[error("read of {len} bytes at offset {offset} of shard {shard} failed: {message}")]
    Io {
        shard: u16,
        offset: u64,
        len: u64,
        message: String,
    },
    #[error(
        "short read at offset {offset} of shard {shard}: expected {expected} bytes, got {got}"
    )]
    Short {
        shard: u16,
        offset: u64,
        expected: u64,
        got: u64,
    },
    #[error("read {id} was cancelled")]
    Cancelled { id: ReadId },
    #[error("read {id} is unknown or its completion was already delivered")]
    UnknownRead { id: ReadId },
    #[error("read {id} asked for lane {lane}, but the device has {lanes} lanes")]
    BadLane { id: ReadId, lane: u32, lanes: u32 },
    #[error("flash device is closed: {reason}")]
    Closed { reason: String },
    /// The read did not complete within the device's read timeout (`--read-timeout-ms`): a
    /// stuck lane or device. Never retried — the read may still write its destination.
    #[error(
        "read {id} on lane {lane} did not complete within {timeout_ms} ms (a stuck lane or device)"
    )]
    Timeout {
        id: ReadId,
        lane: u32,
        timeout_ms: u64,
    },
}

/// Why a routing was refused. A router that breaks these is a bug in the backend, and the
/// step stops rather than read or compute something arbitrary.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RoutingError {
    #[error("routing row has {ids} expert ids but {weights} weights")]
    LengthMismatch { ids: usize, weights: usize },
    #[error("routing row is {got} experts wide; earlier rows of this layer are {expected} wide")]
    WidthMismatch { expected: usize, got: usize },
    #[error("routing row is {width} experts wide; expected 1..=65535")]
    BadWidth { width: usize },
    #[error("routing row carries {got} router probabilities; the layer has {n_expert} experts")]
    ProbsLength { n_expert: u32, got: usize },
    #[error("either every routing row of a layer carries router probabilities or none does")]
    ProbsMixed,
    #[error("routing row for batch row {batch_row}, but the batch has {n_tokens} tokens")]
    RowOutOfBatch { batch_row: u32, n_tokens: u32 },
    #[error("layer {layer} row {row} rank {rank}: expert {expert} is out of range (n_expert={n_expert})")]
    ExpertOutOfRange {
        layer: u16,
        row: u32,
        rank: u16,
        expert: u16,
        n_expert: u32,
    },
    #[error("layer {layer} row {row}: expert {expert} is routed twice")]
    DuplicateExpert { layer: u16, row: u32, expert: u16 },
    #[error("routing has {rows} rows; at most 2^32-1 are supported")]
    TooManyRows { rows: usize },
}

/// Which backend call failed (for error messages).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BackendStage {
    Begin,
    Dense,
    Route,
    Expert,
    FinishLayer,
    Head,
    Release,
    /// Drafting with the model's own head (`--mtp`), at the head's layer.
    Draft,
}

impl std::fmt::Display for BackendStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendStage::Begin => "begin",
            BackendStage::Dense => "dense",
            BackendStage::Route => "route",
            BackendStage::Expert => "expert",
            BackendStage::FinishLayer => "finish_layer",
            BackendStage::Head => "head",
            BackendStage::Release => "release",
            BackendStage::Draft => "draft",
        })
    }
}

const MIB: f64 = 1048576.0;

/// Why the cache refused something.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CacheError {
    #[error(
        "cache budget {budget_mib:.1} MiB ({budget_bytes} bytes) is below one layer's routed experts: \
         the layer_demand floor is {demand_mib:.1} MiB ({layer_demand_bytes} bytes at top-k {k}); \
         give it at least {floor_mib} MiB, or 0 (cache off)",
        budget_mib = *.budget_bytes as f64 / MIB,
        demand_mib = *.layer_demand_bytes as f64 / MIB,
        floor_mib = .layer_demand_bytes.div_ceil(1 << 20)
    )]
    BudgetBelowLayerDemand {
        budget_bytes: u64,
        layer_demand_bytes: u64,
        k: u16,
    },
    #[error("cannot resize to {budget_bytes} bytes: {pinned_bytes} bytes are pinned")]
    BudgetBelowPinned {
        budget_bytes: u64,
        pinned_bytes: u64,
    },
    #[error("the cache is off (budget 0): nothing can be admitted")]
    Off,
    #[error("expert {expert} of MoE layer {layer} is not in the layout")]
    UnknownKey { layer: u16, expert: u16 },
    #[error("expert {expert} of MoE layer {layer} is already resident")]
    AlreadyResident { layer: u16, expert: u16 },
    #[error("expert {expert} of MoE layer {layer} is not pinned")]
    NotPinned { layer: u16, expert: u16 },
    #[error("cache invariant broken: {what}")]
    Corrupt { what: String },
}

/// How the streamer cuts an expert's projection extents into reads (`--read-split`). Demand
/// and speculative reads of an expert are always cut the same way.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum ReadSplit {
    /// One read per projection extent. With three projections a single missed expert keeps at
    /// most three lanes busy, and the lanes finish at different times (the projections differ
    /// in size).
    #[default]
    Whole,
    /// Pieces of at most this many bytes (> 0).
    MaxBytes(u64),
    /// Each extent in as many equal pieces as there are lanes (4 KiB multiples, none smaller
    /// than `SPLIT_MIN_BYTES`): with lanes round-robin every lane reads one piece of every
    /// projection, so one missed expert keeps every lane busy and the lanes finish together.
    Lanes,
    /// `Lanes` where a layer reads a few missed experts (decode with the cache on), whole
    /// extents where a wave already has an extent for every lane (cache off, prefill): there
    /// splitting only makes the requests smaller, and this disk reads large ones faster
    /// (cache off, 4 lanes: 1640–1717 MiB/s whole against 1448–1463 in lane pieces).
    Auto,
}

/// Smallest piece `ReadSplit::Lanes` cuts: below this a request's fixed cost outweighs what a
/// further lane adds.
pub const SPLIT_MIN_BYTES: u64 = 64 * 1024;

impl ReadSplit {
    /// Size of the pieces an extent of `extent_bytes` is read in with `lanes` lanes (the last
    /// piece may be shorter). Never 0 for a non-empty extent.
    /// `Auto` cuts as `Lanes` here; see `resolve`.
    pub fn piece_bytes(self, extent_bytes: u64, lanes: u32) -> u64 {
        match self {
            ReadSplit::Whole => extent_bytes,
            ReadSplit::MaxBytes(m) => m.max(1),
            ReadSplit::Lanes | ReadSplit::Auto => {
                let lanes = u64::from(lanes.max(1));
                let even = extent_bytes.div_ceil(lanes).div_ceil(4096) * 4096;
                even.max(SPLIT_MIN_BYTES)
            }
        }
        .max(1)
    }

    /// The cut for one wave of reads: `Auto` becomes `Lanes` in a decode step with the cache
    /// on — always, so that a speculative read (decode, cache on) is cut exactly like the
    /// demand read that adopts it — and otherwise `Whole` when the wave has at least
    /// `extents >= lanes` extents (`Lanes` when fewer). Other variants are returned as they are.
    pub fn resolve(self, cache_on: bool, decode: bool, extents: usize, lanes: u32) -> ReadSplit {
        match self {
            ReadSplit::Auto if cache_on && decode => ReadSplit::Lanes,
            ReadSplit::Auto if extents >= lanes.max(1) as usize => ReadSplit::Whole,
            ReadSplit::Auto => ReadSplit::Lanes,
            other => other,
        }
    }

    /// The `--read-split` / CSV preamble spelling: `off`, `lanes`, `auto` or a size in KiB.
    pub fn name(self) -> String {
        match self {
            ReadSplit::Whole => "off".to_string(),
            ReadSplit::Lanes => "lanes".to_string(),
            ReadSplit::Auto => "auto".to_string(),
            ReadSplit::MaxBytes(b) => format!("{}", b.div_ceil(1024)),
        }
    }

    /// Parse the `--read-split` spelling (`off`, `lanes`, `auto`, or a whole number of KiB
    /// ≥ 4).
    pub fn parse(s: &str) -> Result<ReadSplit, String> {
        match s {
            "off" => Ok(ReadSplit::Whole),
            "lanes" => Ok(ReadSplit::Lanes),
            "auto" => Ok(ReadSplit::Auto),
            n => match n.parse::<u64>() {
                Ok(k) if (4..=1 << 30).contains(&k) && n.bytes().all(|b| b.is_ascii_digit()) => {
                    Ok(ReadSplit::MaxBytes(k * 1024))
                }
                _ => Err(format!(
                    "'{s}' is not off, lanes, auto, or a whole number of KiB in [4, 2^30]"
                )),
            },
        }
    }
}

/// How the streamer reads and computes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamConfig {
    /// `--overlap`: compute each expert as soon as its own reads are in, instead of after all
    /// of the layer's reads.
    pub overlap: bool,
    /// `--load-all`: read every expert of every MoE layer every step (a check: its output
    /// must equal the selective run's). Unrouted experts are read but not computed. With the
    /// cache on they are looked up like routed ones, so only non-resident ones are read.
    /// Under `--overlap`, waiting for those unneeded reads at the end of a layer counts as
    /// stall (the layer cannot finish before they land).
    pub load_all: bool,
    /// How a projection extent is cut into reads (`--read-split`).
    pub read_split: ReadSplit,
    /// `--prefetch K`: during each decode layer, read ahead the experts the previous token
    /// routed at the next `K` MoE layers (0 = off; needs the cache). See `prefetch`.
    pub prefetch: u32,
}

/// One step's batch.
#[derive(Copy, Clone, Debug)]
pub struct StepInput<'a> {
    /// Session turn (0 for a one-shot run).
    pub turn: u32,
    pub phase: Phase,
    /// Token ids, one per batch row.
    pub tokens: &'a [u32],
    /// Absolute context position of each token.
    pub positions: &'a [u32],
}

/// One expert predictor's score (`--predict-log`): routings and routed slots it was scored on,
/// slots it predicted, and routings it predicted exactly.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PredictorStats {
    pub rows: u64,
    pub slots: u64,
    pub hit_slots: u64,
    pub exact_rows: u64,
}

impl PredictorStats {
    /// Fraction of routed slots predicted (0 with no slots).
    pub fn hit_frac(&self) -> f64 {
        if self.slots == 0 {
            0.0
        } else {
            self.hit_slots as f64 / self.slots as f64
        }
    }
    /// Fraction of routings predicted exactly (0 with no routings).
    pub fn exact_frac(&self) -> f64 {
        if self.rows == 0 {
            0.0
        } else {
            self.exact_rows as f64 / self.rows as f64
        }
    }

    /// Adds another run's scores.
    pub fn merge(&mut self, s: &PredictorStats) {
        self.rows += s.rows;
        self.slots += s.slots;
        self.hit_slots += s.hit_slots;
        self.exact_rows += s.exact_rows;
    }
}

/// The prediction probe's results, whole-run and per MoE layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PredictReport {
    /// Next layer's router on this layer's input.
    pub stale: PredictorStats,
    /// Two layers early (printed only when scored).
    pub stale2: PredictorStats,
    /// What this layer routed for the previous token.
    pub prev: PredictorStats,
    /// This layer's own router on its own input: should read 100%.
    pub ctrl: PredictorStats,
    /// Routings the stale gate structurally could not rank (layer 0, the first token).
    pub unscored: u64,
    /// Per MoE layer: [stale, prev, ctrl].
    pub by_layer: Vec<[PredictorStats; 3]>,
}

impl PredictReport {
    /// Adds another run's probe results (a session's turns): every score adds, per layer too.
    pub fn merge(&mut self, r: &PredictReport) {
        self.stale.merge(&r.stale);
        self.stale2.merge(&r.stale2);
        self.prev.merge(&r.prev);
        self.ctrl.merge(&r.ctrl);
        self.unscored += r.unscored;
        if self.by_layer.len() < r.by_layer.len() {
            self.by_layer
                .resize(r.by_layer.len(), [PredictorStats::default(); 3]);
        }
        for (mine, theirs) in self.by_layer.iter_mut().zip(&r.by_layer) {
            for (a, b) in mine.iter_mut().zip(theirs) {
                a.merge(b);
            }
        }
    }
}

/// What one step cost and did. Times come from the engine's `Clock`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Tokens in the batch.
    pub tokens: u32,
    /// The whole step, `begin` to `head`.
    pub wall: Nanos,
    /// Serial: wall time from submitting a layer's reads to the last one landing, summed over
    /// layers (a subset of `wall`). Overlap: summed per-read lane busy time (`lane_busy`),
    /// which can exceed `wall`.
    pub io: Nanos,
    /// Σ (end − start) over every read, in both modes.
    pub lane_busy: Nanos,
    /// Overlap only (0 in serial): wall time the step waited for a read with nothing else to
    /// compute — the union of stalled intervals.
    pub stall: Nanos,
    /// Cache management: lookups, admissions and evictions, `Backend::release`, unpinning.
    pub mgmt: Nanos,
    /// Reads completed.
    pub reads: u64,
    /// Bytes pulled from flash (aligned windows, from `ReadDone::read_bytes`).
    pub read_bytes: u64,
    /// Bytes the reads asked for.
    pub req_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub rereads: u64,
    pub inserts: u64,
    /// Misses the policy bypassed (read and computed from staging, never inserted).
    pub bypasses: u64,
    /// Routings (row × rank) over all MoE layers, dropped ones included.
    pub experts_routed: u64,
    /// Routings discarded by a dropping hook.
    pub experts_dropped: u64,
    /// Routing slots a re-ranking hook examined (`--expert-substitute`).
    pub experts_reranked: u64,
    /// Slots a re-ranking hook moved to a different (resident) expert.
    pub experts_substituted: u64,
    /// Σ over MoE layers of (distinct non-dropped routed experts × expert bytes): the
    /// measured `token_demand` of a decode step.
    pub routed_bytes: u64,
    /// The same per MoE layer (`layer_demand` is the widest).
    pub layer_routed_bytes: Vec<u64>,
    /// Layers that needed more than one admission wave (their union exceeded the budget).
    pub extra_waves: u32,
    /// `--prefetch`: speculative reads completed (included in `reads`).
    pub spec_reads: u64,
    /// Bytes those pulled from flash (included in `read_bytes`).
    pub spec_read_bytes: u64,
    /// Experts admitted speculatively (their reads submitted).
    pub spec_issued: u64,
    /// Speculative experts whose every read landed (fully read ahead).
    pub spec_experts: u64,
    /// Routings whose lookup hit a speculatively admitted expert on its first touch.
    pub spec_useful: u64,
    /// Speculative reads cancelled before they started (including ones pulled back so
    /// demand could pass, which are resubmitted).
    pub spec_cancelled: u64,
    /// Speculative experts given up (not needed and incomplete, failed, or displaced by demand).
    pub spec_dropped: u64,
    /// Speculative reads that failed where no layer needed them (dropped, not fatal).
    pub spec_failed: u64,
    /// `--predict-log`: this step's probe results (`None` when the probe is off or the step
    /// was not a single-row decode step).
    pub predict: Option<PredictReport>,
    /// `--route-ahead`: decode routings whose selection was replaced by the prediction.
    pub ra_committed: u64,
    /// Decode routings that kept the router's choice (layers < N, the first decode token, no
    /// prediction or no router probabilities to weight it).
    pub ra_passthrough: u64,
    /// Committed slots, and how many of them the router also chose.
    pub ra_slots: u64,
    pub ra_agreed_slots: u64,
    /// Time in the route-ahead predictions (`Backend::predict` at horizon N), by the `Clock`,
    /// and how many there were.
    pub ra_gemv_ns: u64,
    pub ra_gemv_jobs: u64,
}

/// A router hook failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{message}")]
pub struct HookError {
    pub message: String,
}

/// Why a step failed. Every variant except `BadInput` poisons the engine: the failed step may
/// have left the backend and cache half-way, so later steps return `Poisoned` (STYLE 12).
#[derive(Debug, Error)]
pub enum StepError {
    #[error(
        "step input has {tokens} tokens and {positions} positions; need the same number, 1..2^32"
    )]
    BadInput { tokens: usize, positions: usize },
    #[error("flash read for MoE layer {} expert {} projection {} failed: {source}", .tag.layer, .tag.expert, .tag.proj)]
    Flash {
        tag: ReadTag,
        #[source]
        source: FlashError,
    },
    #[error("flash delivered a completion for read {id}, which this step did not submit or already received")]
    UnexpectedCompletion { id: ReadId },
    #[error("backend {stage} failed at model layer {layer}: {source}")]
    Backend {
        stage: BackendStage,
        layer: u32,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("routing of MoE layer {layer}: {source}")]
    Routing {
        layer: u16,
        #[source]
        source: RoutingError,
    },
    #[error("router hook {hook} failed at MoE layer {layer}: {source}")]
    Hook {
        hook: &'static str,
        layer: u16,
        #[source]
        source: HookError,
    },
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("flash device has no lanes")]
    NoLanes,
    #[error("the cache was built for {cache_keys} experts but the layout has {layout_keys}")]
    CacheLayoutMismatch { cache_keys: u32, layout_keys: u32 },
    #[error("a resident device reads nothing, so an expert cache over it (budget {budget_bytes} bytes) would hold nothing: build it with budget 0")]
    ResidentWithCache { budget_bytes: u64 },
    #[error("an earlier step failed ({first}); its output is untrustworthy and this engine refuses further steps")]
    Poisoned { first: String },
}

/// Map a backend error into `StepError::Backend` for `stage` at model layer `layer`.
pub(crate) fn be<E: std::error::Error + Send + Sync + 'static>(
    stage: BackendStage,
    layer: u32,
) -> impl FnOnce(E) -> StepError {
    move |e| StepError::Backend {
        stage,
        layer,
        source: Box::new(e),
    }
}
