//! The generation loop — prefill, then one decode step per token — written once for every
//! front end: `bmoe-cli`'s one-shot run (and its session mode), and `bmoe-sim replay`.
//!
//! A `Session` owns the decode step (`Engine`: the model, its KV and the expert cache stay
//! loaded and warm from one turn to the next), the session's telemetry (the CSV preamble
//! once, the turn counter every row and trace record carries), the context the KV holds,
//! the merged summary of every turn, and the report. Each `Session::generate` is one turn.
//! What differs between the front ends is a `TokenSource`: the engine samples each token from
//! the logits and detokenizes it; the simulator replays the recorded steps.
//!
//! **Token count** (the contract's `step`/`steps`): a turn of `n_predict` N yields up to N
//! tokens. Token i is chosen (sampled from the previous step's logits, or replayed) and then
//! fed through one decode step, whose cost is token i's row: `BMOE_PROGRESS` step i, CSV row
//! i, with token i's text in that line's delta. So N tokens are N decode steps, N rows, and
//! the context grows by N — the last token is in the KV, where a continued chat needs it. An
//! end-of-generation token ends the turn without being fed or counted.
//!
//! **Cancellation**: a `CancelFlag` is checked at every token boundary — before the prefill
//! and before each token is chosen. A set flag ends the turn there: every row written so far
//! is whole, the trailer says `interrupted=1`, and the route and io traces end on a whole step
//! (they are flushed at every token boundary, so even a killed process leaves at most one
//! partial last line). The engine sets the flag from SIGINT/SIGTERM; a session `cancel`
//! request sets the same flag.
//!
//! Nothing here reads ambient time: every duration comes from the engine's `Clock` (the
//! simulator's modelled loop overhead is charged to its virtual clock by its token source).

use crate::backend::Backend;
use crate::cache::ExpertCache;
use crate::clock::{Clock, Nanos};
use crate::config::{RunConfig, SpecMode};
use crate::decide::{
    best, check, choice_logp, reusable, DecideOutcome, DecideRejected, DecideRequest,
};
use crate::flash::Flash;
use crate::ledger::{Ledger, MemPicture};
use crate::records::{Phase, RecordSink};
use crate::speculate::{head_draft, ngram_draft, NgramParams, SpecCounters};
use crate::step::{Engine, StepError, StepInput, StepStats};
use crate::telemetry::report::{write_report, ReportContext};
use crate::telemetry::run::RunTelemetry;
use crate::telemetry::sinks::TraceTee;
use crate::telemetry::summary::{RunSummary, SpecSources};
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use thiserror::Error;

/// A request to stop the running generation at its next token boundary. Clones share one
/// flag, so a signal handler or a request reader on another thread can hold one.
#[derive(Clone, Debug, Default)]
pub struct CancelFlag(Arc<AtomicBool>);

impl CancelFlag {
    /// A flag that is not set.
    pub fn new() -> Self {
        Self::default()
    }
    /// Ask the generation to stop at its next token boundary.
    pub fn set(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    /// Withdraw the request (a session does so before a turn it means to run).
    pub fn clear(&self) {
        self.0.store(false, Ordering::SeqCst);
    }
    /// Whether a stop was asked for.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
    /// The underlying flag, for registering with a signal handler.
    pub fn atomic(&self) -> &Arc<AtomicBool> {
        &self.0
    }
}

/// The process memory and CPU picture after each step (`MemPicture`): the engine's probes
/// (`getrusage`, `/proc`, `mincore`); the simulator measures nothing.
pub trait MemProbe {
    fn picture(&mut self) -> MemPicture;
}

/// A probe that measures nothing (every field "unmeasured").
#[derive(Copy, Clone, Debug, Default)]
pub struct NoProbe;

impl MemProbe for NoProbe {
    fn picture(&mut self) -> MemPicture {
        MemPicture::default()
    }
}

/// The n-gram draft settings `cfg` asks for (`--ngram`), or none.
pub fn ngram_of(cfg: &RunConfig) -> Option<NgramParams> {
    (cfg.spec == SpecMode::Ngram).then(|| ngram_params(cfg))
}

/// The n-gram draft settings of `cfg`'s flags, whether or not `--ngram` is on (what a request
/// that asks for speculation gets).
pub fn ngram_params(cfg: &RunConfig) -> NgramParams {
    NgramParams {
        draft_max: cfg.spec_draft_max,
        min_match: cfg.ngram_min_match,
        max_match: cfg.ngram_max_match,
    }
}

/// Where a turn's tokens come from, and what a front end does around each step. The engine
/// samples from the backend's logits and detokenizes; the simulator replays recorded steps.
pub trait TokenSource<B: Backend> {
    type Error: std::error::Error + Send + Sync + 'static;

    /// Before every step of the turn (its prefill and each decode step), once its input is
    /// known. The replayer points its backend at the recorded step. Default: nothing.
    fn before_step(&mut self, _backend: &mut B, _input: &StepInput<'_>) -> Result<(), Self::Error> {
        Ok(())
    }

    /// After every successful step, with its stats: the engine writes `--logits-out` rows;
    /// the replayer takes the route-ahead counters from the trace. Default: nothing.
    fn after_step(
        &mut self,
        _backend: &B,
        _input: &StepInput<'_>,
        _stats: &mut StepStats,
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    /// After every successful step (and `after_step`), with the expert cache as the step left
    /// it: `bmoe-sim fuzz` checks the cache's invariants here. Default: nothing.
    fn observe(&mut self, _cache: &ExpertCache, _stats: &StepStats) -> Result<(), Self::Error> {
        Ok(())
    }

    /// The next token to feed, or `None` to end the turn (an end-of-generation token, or
    /// nothing left to replay). `last` says it will be the turn's last token (`n_predict`
    /// reached), so text held back for an incomplete character must be released with it.
    /// The time spent here is the token's loop overhead.
    fn next_token(&mut self, backend: &mut B, last: bool) -> Result<Option<u32>, Self::Error>;

    /// Whether this source can choose a token from any row of a verify decode
    /// ([`TokenSource::next_token_at`]): speculative decoding runs only where it can.
    /// Default: no.
    fn verifies(&self) -> bool {
        false
    }

    /// [`TokenSource::next_token`] from the logits of batch row `row` of the last step (a
    /// speculative verify decode with logits at every row) instead of its last row: the same
    /// choice, text and end-of-generation handling. Called only when
    /// [`TokenSource::verifies`]; the default takes the last row.
    fn next_token_at(
        &mut self,
        backend: &mut B,
        row: u32,
        last: bool,
    ) -> Result<Option<u32>, Self::Error> {
        let _ = row;
        self.next_token(backend, last)
    }

    /// A replayer of a speculative run: the drafts its recorded step fed after the token just
    /// chosen (placeholders; [`TokenSource::next_token_at`] then confirms as many as the
    /// recording did), written into `out`. `None` (the default): this source drafts nothing
    /// itself and the session's draft source (`--ngram`) is asked instead.
    fn recorded_draft(&mut self, out: &mut Vec<u32>) -> Option<()> {
        let _ = out;
        None
    }

    /// Whether this source replays a speculative run's recorded steps (then the turn counts
    /// its decodes as the recording did, and [`TokenSource::recorded_draft`] gives every
    /// draft). Default: no.
    fn replays_drafts(&self) -> bool {
        false
    }

    /// A replayer of a speculative run: whether the recording's turn speculated (its trace's
    /// turn-end line), which decides whether the turn counts its decodes (`mtp_*`). `None`
    /// (the default, and a trace without the line): as the configuration's `spec` says.
    fn recorded_speculating(&self) -> Option<bool> {
        None
    }

    /// The context position to feed the token just chosen at; `next_free` is the position
    /// after the context's last token. A live source takes it; a replayer returns the
    /// recorded one.
    fn position(&self, next_free: u32) -> u32 {
        next_free
    }

    /// The turn's text so far, as cumulative (reasoning, answer) snapshots; the telemetry
    /// turns them into per-line deltas. Default: no text.
    fn text(&self) -> (&str, &str) {
        ("", "")
    }

    /// The turn ended (count reached, end of generation, cancelled or failed): release any
    /// held-back text; the replayer charges the modelled tail. Default: nothing.
    fn finish(&mut self, _backend: &mut B) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// The token source of a decide: its turn is a prefill and nothing else.
struct Prefill;

impl<B: Backend> TokenSource<B> for Prefill {
    type Error = std::convert::Infallible;
    fn next_token(&mut self, _backend: &mut B, _last: bool) -> Result<Option<u32>, Self::Error> {
        Ok(None)
    }
}

/// Where a turn writes. Every output is optional; each is flushed at every token boundary.
#[derive(Default)]
pub struct Outputs<'a> {
    /// `--progress`: `BMOE_LOAD` / `BMOE_PROGRESS` lines.
    pub progress: Option<&'a mut dyn Write>,
    /// `--csv`: the `# bmoe_metrics v2` file (its preamble once per session).
    pub csv: Option<&'a mut dyn Write>,
    /// `--route-trace` / `--io-trace` sinks.
    pub route: Option<&'a mut dyn RecordSink>,
    pub io: Option<&'a mut dyn RecordSink>,
}

fn reborrow_w<'s>(o: &'s mut Option<&mut dyn Write>) -> Option<&'s mut dyn Write> {
    match o {
        Some(w) => Some(&mut **w),
        None => None,
    }
}

fn reborrow_s<'s>(o: &'s mut Option<&mut dyn RecordSink>) -> Option<&'s mut dyn RecordSink> {
    match o {
        Some(w) => Some(&mut **w),
        None => None,
    }
}

impl Outputs<'_> {
    fn traces(&mut self) -> TraceTee<'_> {
        TraceTee {
            route: reborrow_s(&mut self.route),
            io: reborrow_s(&mut self.io),
        }
    }

    /// Everything written so far reaches its file: called at every token boundary.
    fn flush(&mut self) -> Result<(), GenerateError> {
        if let Some(w) = self.progress.as_mut() {
            w.flush().map_err(io_err("--progress"))?;
        }
        if let Some(w) = self.csv.as_mut() {
            w.flush().map_err(io_err("--csv"))?;
        }
        if let Some(s) = self.route.as_mut() {
            s.flush().map_err(io_err("--route-trace"))?;
        }
        if let Some(s) = self.io.as_mut() {
            s.flush().map_err(io_err("--io-trace"))?;
        }
        Ok(())
    }
}

/// One turn's request.
#[derive(Copy, Clone, Debug)]
pub struct TurnRequest<'a> {
    /// Tokens to prefill this turn (the suffix past any reused context). Empty: no prefill
    /// step (a replayed trace that recorded none).
    pub prompt: &'a [u32],
    /// Their context positions, one per token.
    pub positions: &'a [u32],
    /// Tokens to generate at most (the contract's `steps`).
    pub n_predict: u32,
}

/// Why a turn ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `n_predict` tokens were generated.
    Count,
    /// The source ended the turn (an end-of-generation token, or nothing left to replay).
    EndOfGeneration,
    /// The `CancelFlag` was set; the turn stopped at a token boundary.
    Cancelled,
    /// A step failed (`TurnOutcome::error`); the engine refuses further steps.
    Failed,
}

/// What one turn did.
#[derive(Debug)]
pub struct TurnOutcome {
    /// The turn number every row and trace record of the turn carries.
    pub turn: u32,
    /// The tokens fed through a decode step, in order (the end-of-generation token, which is
    /// never fed, is not among them).
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    /// The failed step's error when `stop` is `Failed`.
    pub error: Option<StepError>,
    /// The turn's summary (what its CSV trailer says and `BMOE_DONE` reports).
    pub summary: RunSummary,
}

/// Why a turn could not be run or reported. A failed *step* is not one of these: it ends the
/// turn with `StopReason::Failed`, and the turn is still reported.
#[derive(Debug, Error)]
pub enum GenerateError {
    #[error("the turn's prompt has {tokens} tokens but {positions} positions")]
    BadRequest { tokens: usize, positions: usize },
    #[error("writing {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("token source: {0}")]
    Source(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("keeping or restoring the decide prefix state: {0}")]
    State(#[source] Box<dyn std::error::Error + Send + Sync>),
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> GenerateError {
    move |source| GenerateError::Io { what, source }
}

fn source_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> GenerateError {
    GenerateError::Source(Box::new(e))
}

/// A loaded model behind the decode step, kept warm across turns. See the module docs.
pub struct Session<C: Clock, F: Flash, B: Backend> {
    engine: Engine<C, F, B>,
    /// The resolved configuration: the CSV preamble and the report are printed from it.
    cfg: RunConfig,
    load_s: f64,
    probe: Box<dyn MemProbe>,
    cancel: CancelFlag,
    /// Further flags that stop a turn like `cancel` (a session's signal flag beside its
    /// request flag); the session never clears them.
    also_stop_on: Vec<CancelFlag>,
    telemetry: RunTelemetry,
    next_turn: u32,
    turns: u32,
    /// Tokens the KV holds, position 0 first (prompt and generated tokens alike).
    context: Vec<u32>,
    /// The position after the last token fed (`context.len()` when fed from 0 in order).
    n_past: u32,
    /// Every turn's summary merged.
    whole: RunSummary,
    /// Whether a decide keeps its prefix state (`--decide-prefix-cache`).
    prefix_cache: bool,
    /// The tokens the backend's kept decide prefix state holds (`None`: nothing kept).
    kept_prefix: Option<Vec<u32>>,
    /// The bytes that state holds.
    kept_bytes: u64,
    /// A decide's prefix length when its prefix state must be kept during the prefill (a
    /// backend whose recurrent state stands only where the last step ended): the prefill
    /// splits there and keeps it ([`Backend::keeps_prefix_where_it_stands`]).
    keep_during_prefill: Option<u32>,
    /// What keeping it during the prefill returned (`keep_prefix`'s bytes, or `None`).
    kept_during_prefill: Option<Option<u64>>,
    /// A turn boundary inside the prompt where a backend whose recurrent state stands only
    /// where the last step ended keeps a copy of it ([`Backend::mark_boundary`]): the prefill
    /// splits there.
    mark_during_prefill: Option<u32>,
    /// `--ngram`: the draft source's settings for the turns that follow (`None`: plain decode).
    speculation: Option<NgramParams>,
    /// `--mtp`: draft with the backend's head ([`crate::speculate::head_draft`], `--draft`
    /// and `--mtp-p-min` from the configuration).
    head_drafts: bool,
    /// Test hook (`--draft-replay`): draft the tokens a recorded run generated next, at most
    /// this many, instead of by prompt lookup — every draft accepted when the run repeats the
    /// recorded one: the ceiling of speculation, and a verify decode of a fixed width. A
    /// recording with some tokens changed drafts groups that are confirmed up to a changed
    /// token and rejected there.
    replay_drafts: Option<(Vec<u32>, u32)>,
}

impl<C: Clock, F: Flash, B: Backend> Session<C, F, B> {
    /// A session over `engine`. `cfg` is the resolved configuration (model facts and the
    /// cache budget filled in); `load_s` the model load time every turn reports.
    pub fn new(
        engine: Engine<C, F, B>,
        cfg: RunConfig,
        load_s: f64,
        probe: Box<dyn MemProbe>,
    ) -> Self {
        let speculation = ngram_of(&cfg);
        let head_drafts = cfg.spec == SpecMode::Mtp;
        Session {
            engine,
            cfg,
            load_s,
            probe,
            cancel: CancelFlag::new(),
            also_stop_on: Vec::new(),
            telemetry: RunTelemetry::new(),
            next_turn: 0,
            turns: 0,
            context: Vec::new(),
            n_past: 0,
            whole: RunSummary::default(),
            prefix_cache: true,
            kept_prefix: None,
            kept_bytes: 0,
            keep_during_prefill: None,
            kept_during_prefill: None,
            mark_during_prefill: None,
            speculation,
            head_drafts,
            replay_drafts: None,
        }
    }

    /// Speculative decoding for the turns that follow (`None`: every step plain): a session's
    /// or server's request may ask for it, or for none, whatever the run's flags said.
    pub fn set_speculation(&mut self, spec: Option<NgramParams>) {
        self.speculation = spec;
    }

    /// `--mtp` for the turns that follow: draft with the backend's head or not. Only a session
    /// whose configuration says `--mtp` has a head that followed every step (false, and
    /// nothing changed, otherwise).
    pub fn set_head_drafts(&mut self, on: bool) -> bool {
        if self.cfg.spec != SpecMode::Mtp {
            return !on;
        }
        self.head_drafts = on;
        true
    }

    /// Test hook: draft from `recorded` (a recorded run's generated tokens), at most `k` per
    /// step, in place of prompt lookup (see `replay_drafts`).
    pub fn set_replay_drafts(&mut self, recorded: Vec<u32>, k: u32) {
        self.replay_drafts = Some((recorded, k));
    }

    /// Whether a decide keeps its prefix state for the next one (default: yes).
    pub fn with_prefix_cache(mut self, on: bool) -> Self {
        self.prefix_cache = on;
        self
    }

    /// The tokens the kept decide prefix state covers, if one is kept.
    pub fn kept_prefix(&self) -> Option<&[u32]> {
        self.kept_prefix.as_deref()
    }

    /// Use `flag` as the session's cancel flag (e.g. one a signal handler already holds).
    pub fn with_cancel(mut self, flag: CancelFlag) -> Self {
        self.cancel = flag;
        self
    }

    /// Also stop a turn when `flag` is set (e.g. a signal flag beside a request flag).
    pub fn also_stop_on(mut self, flag: CancelFlag) -> Self {
        self.also_stop_on.push(flag);
        self
    }

    /// The flag that stops the running turn at its next token boundary.
    pub fn cancel_flag(&self) -> &CancelFlag {
        &self.cancel
    }

    /// Whether a turn should stop at its next token boundary.
    fn stopping(&self) -> bool {
        self.cancel.is_set() || self.also_stop_on.iter().any(CancelFlag::is_set)
    }

    /// The decode step (and through it the backend, the cache and the layout).
    pub fn engine(&self) -> &Engine<C, F, B> {
        &self.engine
    }
    /// The decode step, mutably (between turns).
    pub fn engine_mut(&mut self) -> &mut Engine<C, F, B> {
        &mut self.engine
    }
    /// The resolved configuration.
    pub fn config(&self) -> &RunConfig {
        &self.cfg
    }
    /// The tokens the KV holds, position 0 first.
    pub fn context(&self) -> &[u32] {
        &self.context
    }
    /// The position after the last token fed: where the next prompt continues.
    pub fn n_past(&self) -> u32 {
        self.n_past
    }
    /// The longest prefix of at most `n` positions of the context a turn can continue from:
    /// `n`, or less when the backend's memory no longer holds what a batch starting at `n`
    /// reads (a sliding-window ring rolled back past its slack: [`Backend::reusable_prefix`]).
    pub fn reusable_prefix(&self, n: u32) -> u32 {
        self.engine
            .backend()
            .reusable_prefix(n.min(self.n_past))
            .min(n)
    }
    /// Forget the context from position `n` on (a new chat: 0; a continued chat that diverges
    /// from the KV at `n`). The backend's KV rows past `n` are simply overwritten when those
    /// positions are fed again.
    pub fn truncate_context(&mut self, n: u32) {
        self.context.truncate(n as usize);
        self.n_past = self.n_past.min(n);
    }
    /// The number the next turn will carry.
    pub fn next_turn(&self) -> u32 {
        self.next_turn
    }
    /// Number the next turn `turn` (a replayer follows the recorded numbering).
    pub fn set_next_turn(&mut self, turn: u32) {
        self.next_turn = turn;
    }
    /// Turns run so far.
    pub fn turns(&self) -> u32 {
        self.turns
    }

    /// Every turn so far as one summary: sums and token-weighted means of the turns, the
    /// session's load time, and the hit rate of every lookup the session's cache served.
    pub fn summary(&self) -> RunSummary {
        let mut s = self.whole.clone();
        s.counters.load_s = self.load_s;
        let cache = self.engine.cache();
        s.counters.cache_hit_pct = if cache.is_off() {
            -1.0
        } else {
            let c = cache.counters();
            let n = c.hits + c.misses;
            if n == 0 {
                0.0
            } else {
                100.0 * c.hits as f64 / n as f64
            }
        };
        s
    }

    /// The end-of-run report over every turn (`summary`).
    pub fn write_report(&self, w: &mut dyn Write, ctx: &ReportContext<'_>) -> io::Result<()> {
        write_report(w, &self.cfg, &self.summary(), ctx)
    }

    /// Run one turn: prefill `req.prompt`, then up to `req.n_predict` tokens from `source`,
    /// each fed through one decode step and reported (progress line, CSV row, trace records,
    /// all flushed per token); then the turn's CSV trailer. A failed step or a cancel ends
    /// the turn early, and the turn is reported all the same. A kept decide prefix state is
    /// dropped first: the turn overwrites the KV it mirrors.
    pub fn generate<S: TokenSource<B>>(
        &mut self,
        req: &TurnRequest<'_>,
        source: &mut S,
        out: &mut Outputs<'_>,
    ) -> Result<TurnOutcome, GenerateError> {
        self.forget_prefix();
        self.run_turn(req, source, out)
    }

    /// [`Session::generate`], leaving the backend a copy of the state at `boundary` (a
    /// context position inside this turn's prompt: where a chat's messages end and the
    /// generation prompt begins, or a raw prompt's last token) when its state is one that
    /// stands only where the last step ended ([`Backend::keeps_prefix_where_it_stands`]):
    /// the prefill splits there, so a later turn that shares the prompt up to the boundary but
    /// not what followed it — a template that re-renders the answer, a regenerated reply —
    /// continues from it ([`Backend::reusable_prefix`]) instead of from 0. Other backends
    /// keep every position anyway, and their prefill is not split.
    pub fn generate_marked<S: TokenSource<B>>(
        &mut self,
        req: &TurnRequest<'_>,
        boundary: Option<u32>,
        source: &mut S,
        out: &mut Outputs<'_>,
    ) -> Result<TurnOutcome, GenerateError> {
        let inside = |p: u32| {
            req.positions.first().is_some_and(|&f| p > f)
                && req.positions.last().is_some_and(|&l| p <= l)
        };
        self.mark_during_prefill =
            boundary.filter(|&p| inside(p) && self.engine.backend().keeps_prefix_where_it_stands());
        let r = self.generate(req, source, out);
        self.mark_during_prefill = None;
        r
    }

    /// Drop the kept decide prefix state (and its memory in the backend).
    fn forget_prefix(&mut self) {
        if self.kept_prefix.take().is_some() {
            self.engine.backend_mut().drop_prefix();
        }
        self.kept_bytes = 0;
    }

    /// Score `req.choices` after one prefill of `req.tokens`, with no decode (see
    /// `crate::decide`). When the prefix cache is on and `req.reuse_prefix` allows, the kept
    /// prefix state is restored first if the new prefix renders equal to it or extends it, so
    /// only the tokens past it are prefilled; after the prefill the state of the prefix is kept
    /// for the next decide. The turn is numbered, traced and summarised like a generation with
    /// no tokens (its CSV `# summary` says `tokens=0`). A refused request changes nothing.
    pub fn decide(
        &mut self,
        req: &DecideRequest<'_>,
        out: &mut Outputs<'_>,
    ) -> Result<Result<DecideOutcome, DecideRejected>, GenerateError> {
        if let Err(e) = check(req) {
            return Ok(Err(e));
        }
        let n = req.tokens.len();
        let reuse = if self.prefix_cache && req.reuse_prefix && !self.stopping() {
            reusable(self.kept_prefix.as_deref(), req.tokens, req.prefix_len)
        } else {
            0
        };
        let mut restore_s = 0.0;
        if reuse > 0 {
            let t0 = self.engine.clock().now();
            let restored = self
                .engine
                .backend_mut()
                .restore_prefix()
                .map_err(|e| GenerateError::State(Box::new(e)))?;
            if restored != Some(reuse) {
                return Err(GenerateError::State(
                    format!(
                        "the backend restored {restored:?} prefix tokens; the session kept {reuse}"
                    )
                    .into(),
                ));
            }
            restore_s = (self.engine.clock().now() - t0).as_secs_f64();
            // The KV holds the kept prefix again (and nothing past it that counts).
            self.context.clear();
            self.context
                .extend_from_slice(&req.tokens[..reuse as usize]);
            self.n_past = reuse;
        } else {
            self.truncate_context(0);
        }
        let positions: Vec<u32> = (reuse..n as u32).collect();
        let p = req.prefix_len;
        // A recurrent state stands only where the last step ended: the prefix state is kept
        // between two steps of the prefill, split at the prefix.
        self.kept_during_prefill = None;
        self.keep_during_prefill = (self.prefix_cache
            && p > reuse
            && (p as usize) < n
            && self.engine.backend().keeps_prefix_where_it_stands())
        .then_some(p);
        let turn = self.run_turn(
            &TurnRequest {
                prompt: &req.tokens[reuse as usize..],
                positions: &positions,
                n_predict: 0,
            },
            &mut Prefill,
            out,
        );
        self.keep_during_prefill = None;
        let kept_early = self.kept_during_prefill.take();
        let turn = turn?;
        let mut outcome = DecideOutcome {
            turn: turn.turn,
            cancelled: turn.stop == StopReason::Cancelled,
            choice_logp: vec![None; req.choices.len()],
            best: None,
            n_tokens: n as u32,
            n_reused: reuse,
            n_prefilled: turn.summary.counters.n_prompt as u32,
            restore_s,
            store_s: 0.0,
            prefix_state_bytes: 0,
            summary: turn.summary,
            error: turn.error,
        };
        if outcome.error.is_some() || outcome.cancelled {
            if kept_early.is_some() {
                // The prefill replaced the kept state before it stopped: keep nothing.
                self.engine.backend_mut().drop_prefix();
                self.kept_prefix = None;
                self.kept_bytes = 0;
            }
            // Otherwise nothing ran past the restore: the kept state is as it was.
            outcome.prefix_state_bytes = self.kept_bytes;
            return Ok(Ok(outcome));
        }
        let logits = self.engine.backend().last_logits().ok_or_else(|| {
            GenerateError::State("the backend computed no logits to score the choices".into())
        })?;
        outcome.choice_logp = choice_logp(logits, req.choices);
        outcome.best = best(&outcome.choice_logp);
        if !self.prefix_cache || p == 0 {
            self.forget_prefix();
        } else if reuse != p {
            // The kept state becomes this prefix's (when the prefix equals the kept one, the
            // kept copy already is exactly that).
            let t0 = self.engine.clock().now();
            let kept = match kept_early {
                Some(kept) => kept,
                None => self
                    .engine
                    .backend_mut()
                    .keep_prefix(p)
                    .map_err(|e| GenerateError::State(Box::new(e)))?,
            };
            outcome.store_s = (self.engine.clock().now() - t0).as_secs_f64();
            match kept {
                Some(bytes) => {
                    self.kept_prefix = Some(req.tokens[..p as usize].to_vec());
                    self.kept_bytes = bytes;
                }
                None => {
                    self.kept_prefix = None;
                    self.kept_bytes = 0;
                }
            }
        }
        outcome.prefix_state_bytes = if self.kept_prefix.is_some() {
            self.kept_bytes
        } else {
            0
        };
        Ok(Ok(outcome))
    }

    /// One turn of the loop (`generate` without touching the kept decide prefix state).
    fn run_turn<S: TokenSource<B>>(
        &mut self,
        req: &TurnRequest<'_>,
        source: &mut S,
        out: &mut Outputs<'_>,
    ) -> Result<TurnOutcome, GenerateError> {
        if req.prompt.len() != req.positions.len() {
            return Err(GenerateError::BadRequest {
                tokens: req.prompt.len(),
                positions: req.positions.len(),
            });
        }
        let turn = self.next_turn;
        self.next_turn = turn.saturating_add(1);
        self.turns = self.turns.saturating_add(1);
        if let Some(w) = reborrow_w(&mut out.csv) {
            self.telemetry
                .write_csv_preamble(&self.cfg, w)
                .map_err(io_err("--csv"))?;
        }
        self.telemetry.begin_generation();
        let mut ledger = Ledger::new(
            self.engine.config().overlap,
            self.engine.cache().budget_bytes(),
            turn,
            req.n_predict,
        );
        let mut tokens = Vec::new();
        let mut stop = StopReason::Count;
        let mut error = None;
        let mut prefill_s = 0.0;
        let mut n_prompt = 0u64;
        // The context the KV held before this turn's prompt: what the turn reused.
        let n_reused = req.positions.first().copied().unwrap_or(self.n_past);
        let mut prev_end = self.engine.clock().now();

        if self.stopping() {
            stop = StopReason::Cancelled;
        } else if !req.prompt.is_empty() {
            // `--ubatch`: the prompt in steps of at most that many tokens (0 = one step). Each
            // step reads its own union of experts once per layer; the ledger sums the steps.
            let chunk = match self.cfg.n_ubatch as usize {
                0 => req.prompt.len(),
                n => n,
            };
            // A decide keeping its prefix state, or a turn boundary marked, during the
            // prefill: the steps split there too.
            let keep_at = self.keep_during_prefill;
            let mark_at = self.mark_during_prefill;
            let mut steps: Vec<(&[u32], &[u32])> = Vec::new();
            for (tokens, positions) in req.prompt.chunks(chunk).zip(req.positions.chunks(chunk)) {
                let mut cuts: Vec<usize> = [keep_at, mark_at]
                    .into_iter()
                    .flatten()
                    .filter_map(|p| positions.iter().position(|&q| q == p))
                    .filter(|&i| i > 0)
                    .collect();
                cuts.sort_unstable();
                cuts.dedup();
                let mut start = 0;
                for i in cuts {
                    steps.push((&tokens[start..i], &positions[start..i]));
                    start = i;
                }
                steps.push((&tokens[start..], &positions[start..]));
            }
            for (tokens, positions) in steps {
                if n_prompt > 0 && self.stopping() {
                    stop = StopReason::Cancelled;
                    break;
                }
                let input = StepInput {
                    turn,
                    phase: Phase::Prefill,
                    tokens,
                    positions,
                };
                source
                    .before_step(self.engine.backend_mut(), &input)
                    .map_err(source_err)?;
                let mem_before = self.probe.picture();
                match self.engine.step(&input, &mut out.traces()) {
                    Ok(mut st) => {
                        prev_end = self.engine.clock().now();
                        source
                            .after_step(self.engine.backend(), &input, &mut st)
                            .map_err(source_err)?;
                        source
                            .observe(self.engine.cache(), &st)
                            .map_err(source_err)?;
                        let mem_after = self.probe.picture();
                        ledger.prefill(&st, &mem_before, &mem_after);
                        prefill_s += st.wall.as_secs_f64();
                        n_prompt += tokens.len() as u64;
                        for (&t, &p) in tokens.iter().zip(positions) {
                            self.feed(t, p);
                        }
                        if let Some(p) = keep_at.filter(|&p| positions.last() == Some(&(p - 1))) {
                            let kept = self
                                .engine
                                .backend_mut()
                                .keep_prefix(p)
                                .map_err(|e| GenerateError::State(Box::new(e)))?;
                            self.kept_during_prefill = Some(kept);
                        }
                        if let Some(p) = mark_at.filter(|&p| positions.last() == Some(&(p - 1))) {
                            self.engine
                                .backend_mut()
                                .mark_boundary(p)
                                .map_err(|e| GenerateError::State(Box::new(e)))?;
                        }
                    }
                    Err(e) => {
                        ledger.io_error();
                        stop = StopReason::Failed;
                        error = Some(e);
                        break;
                    }
                }
                out.flush()?;
            }
        }

        // Speculation (`--ngram`) runs where both the source and the backend can verify a
        // drafted group in one step (see `crate::speculate`); elsewhere every step is plain.
        let verifiable = source.verifies() && self.engine.backend().verifies_rows();
        let spec = self.speculation.filter(|_| verifiable);
        let head = (self.head_drafts && verifiable && self.engine.backend().has_draft_head())
            .then_some((self.cfg.spec_draft_max, self.cfg.mtp_p_min));
        // Taken for the turn (and put back after it): the loop feeds `self` as it drafts.
        let replay = self.replay_drafts.take().filter(|_| verifiable);
        // A replayed speculative run drafts what it recorded, and counts its decodes as the
        // recording did (`spec=` on).
        let replaying = verifiable && source.replays_drafts();
        let speculating = spec.is_some()
            || head.is_some()
            || replay.is_some()
            || (replaying
                && source
                    .recorded_speculating()
                    .unwrap_or(self.cfg.spec != SpecMode::Off));
        // The source this turn drafts from, for the summary lines' name: a replay takes its
        // recording's (`spec=`; a request's own choice is not recorded, so prompt lookup).
        let sources = SpecSources {
            mtp: head.is_some() || (replaying && speculating && self.cfg.spec == SpecMode::Mtp),
            ngram: spec.is_some()
                || replay.is_some()
                || (replaying && speculating && self.cfg.spec != SpecMode::Mtp),
        };
        let mut spec_counts = SpecCounters::default();
        // A token chosen from a verify decode's row that rejected its draft: the next one fed.
        let mut pending: Option<u32> = None;
        let (mut draft, mut group, mut group_pos) = (Vec::new(), Vec::new(), Vec::new());
        // A verify decode's rows are written once its group is known, each with the source's
        // text as its token left it: snapshots taken before each row's choice (a snapshot does
        // not always extend the last: a chat parser may rewrite it).
        let mut snaps: Vec<(String, String)> = Vec::new();
        let mut i = 0u32;
        while stop == StopReason::Count && i < req.n_predict {
            // A pending token's text is already out: it is fed whatever happens.
            if pending.is_none() && self.stopping() {
                stop = StopReason::Cancelled;
                break;
            }
            let last = i + 1 == req.n_predict;
            let token = match pending.take() {
                Some(t) => t,
                None => match source
                    .next_token(self.engine.backend_mut(), last)
                    .map_err(source_err)?
                {
                    Some(t) => t,
                    None => {
                        stop = StopReason::EndOfGeneration;
                        break;
                    }
                },
            };
            let position = source.position(self.n_past);
            let drafting = self.engine.clock().now();
            draft.clear();
            let room = req.n_predict - i - 1;
            if replaying && source.recorded_draft(&mut draft).is_some() {
                // A replay: the recorded group's width, whatever the flags say.
            } else if let Some((recorded, k)) = &replay {
                // The recorded run's next tokens wherever this turn's token is the recorded
                // one at its index (a run that repeats the recording drafts it all; a test
                // that spoils some recorded tokens gets confirmed and rejected drafts).
                let n = tokens.len();
                if recorded.get(n) == Some(&token) {
                    let end = recorded.len().min(n + 1 + room.min(*k) as usize);
                    draft.extend_from_slice(&recorded[(n + 1).min(end)..end]);
                }
            } else if let Some((max, p_min)) = head {
                let room = room.min(max) as usize;
                if room > 0 {
                    if let Err(e) = head_draft(
                        self.engine.backend_mut(),
                        token,
                        position,
                        room,
                        p_min,
                        &mut draft,
                    ) {
                        ledger.io_error();
                        stop = StopReason::Failed;
                        error = Some(StepError::Backend {
                            stage: crate::vocab::BackendStage::Draft,
                            layer: self.cfg.n_layer,
                            source: Box::new(e),
                        });
                        break;
                    }
                }
            } else if let Some(sp) = spec {
                let room = room.min(sp.draft_max) as usize;
                let known = (position as usize).min(self.context.len());
                if room > 0 {
                    ngram_draft(
                        &self.context[..known],
                        token,
                        sp.min_match,
                        sp.max_match,
                        room,
                        &mut draft,
                    );
                }
            }
            let draft_ms = (self.engine.clock().now() - drafting).as_ms_f64();
            group.clear();
            group.push(token);
            group.extend_from_slice(&draft);
            group_pos.clear();
            group_pos.extend((0..group.len() as u32).map(|j| position + j));
            let verify = !draft.is_empty();
            let input = StepInput {
                turn,
                phase: Phase::Decode,
                tokens: &group,
                positions: &group_pos,
            };
            source
                .before_step(self.engine.backend_mut(), &input)
                .map_err(source_err)?;
            let loop_overhead = self.engine.clock().now() - prev_end;
            self.engine.backend_mut().logits_at_every_row(verify);
            let stepped = self.engine.step(&input, &mut out.traces());
            self.engine.backend_mut().logits_at_every_row(false);
            let mut st = match stepped {
                Ok(st) => st,
                Err(e) => {
                    ledger.io_error();
                    stop = StopReason::Failed;
                    error = Some(e);
                    out.flush()?;
                    break;
                }
            };
            prev_end = self.engine.clock().now();
            source
                .after_step(self.engine.backend(), &input, &mut st)
                .map_err(source_err)?;
            source
                .observe(self.engine.cache(), &st)
                .map_err(source_err)?;
            tokens.push(token);
            self.feed(token, position);
            let snap = |s: &S| {
                let (r, t) = s.text();
                (r.to_string(), t.to_string())
            };
            snaps.clear();
            let mut confirmed = 1u32;
            // Walk the verify decode's rows: row j chooses the token after the group's j-th;
            // a choice equal to the next draft confirms it, the first that differs is fed next.
            for (j, &d) in draft.iter().enumerate() {
                snaps.push(snap(source));
                // The token chosen here is the turn's (i + confirmed so far)-th.
                let last = i + confirmed + 1 == req.n_predict;
                match source
                    .next_token_at(self.engine.backend_mut(), j as u32, last)
                    .map_err(source_err)?
                {
                    None => {
                        stop = StopReason::EndOfGeneration;
                        break;
                    }
                    Some(s) if s == d => {
                        confirmed += 1;
                        tokens.push(s);
                        self.feed(s, position + 1 + j as u32);
                    }
                    Some(s) => {
                        pending = Some(s);
                        break;
                    }
                }
            }
            if speculating {
                spec_counts.decodes += 1;
                if verify {
                    spec_counts.drafted_steps += 1;
                    spec_counts.drafted += draft.len() as u64;
                    spec_counts.accepted += u64::from(confirmed - 1);
                }
            }
            // The group's rows: the first carries the whole decode's cost and the drafting,
            // the rest zeros; every row says how many tokens its decode confirmed.
            let mem = self.probe.picture();
            let live = source.text();
            for k in 0..confirmed as usize {
                // The last row of a group whose every draft was confirmed: nothing was chosen
                // after its token, so the text as it stands is its own.
                let (reasoning, text) =
                    snaps.get(k).map_or(live, |(r, t)| (r.as_str(), t.as_str()));
                let mut rec = if k == 0 {
                    let mut r = ledger.token(&st, &mem, loop_overhead.as_ms_f64());
                    r.mtp_draft_ms = if speculating { draft_ms } else { 0.0 };
                    r
                } else {
                    ledger.group_row(&mem)
                };
                rec.mtp_batch = confirmed;
                self.telemetry
                    .token(
                        &rec,
                        reasoning,
                        text,
                        reborrow_w(&mut out.progress),
                        reborrow_w(&mut out.csv),
                    )
                    .map_err(io_err("--csv/--progress"))?;
            }
            out.flush()?;
            i += confirmed;
        }
        if replay.is_some() {
            self.replay_drafts = replay;
        }
        // A speculative trace says how many tokens the turn generated and whether it
        // speculated: a replay cannot tell either from the steps alone.
        out.traces()
            .end_turn(turn, tokens.len() as u32, speculating);
        source
            .finish(self.engine.backend_mut())
            .map_err(source_err)?;
        let tail: Nanos = self.engine.clock().now() - prev_end;

        let layer_demand = self
            .engine
            .layout()
            .layer_demand_bytes(self.cfg.n_expert_used.min(u32::from(u16::MAX)) as u16);
        let mut counters = ledger.counters(
            self.engine.cache(),
            layer_demand,
            n_prompt,
            u64::from(self.n_past),
            self.load_s,
            prefill_s,
            tail.as_ms_f64(),
        );
        counters.interrupted = stop == StopReason::Cancelled;
        counters.n_reused = u64::from(n_reused);
        counters.mtp_drafted = spec_counts.drafted;
        counters.mtp_accepted = spec_counts.accepted;
        counters.mtp_decodes = spec_counts.decodes;
        counters.drafted_steps = spec_counts.drafted_steps;
        if spec_counts.decodes > 0 {
            counters.spec_sources = sources;
        }
        let summary = self
            .telemetry
            .finish(counters, reborrow_w(&mut out.csv))
            .map_err(io_err("--csv"))?;
        out.flush()?;
        self.whole.merge_turn(&summary);
        Ok(TurnOutcome {
            turn,
            tokens,
            stop,
            error,
            summary,
        })
    }

    /// A token was fed at `position`: the context holds it there.
    fn feed(&mut self, token: u32, position: u32) {
        let p = position as usize;
        if p < self.context.len() {
            self.context.truncate(p);
        }
        if p == self.context.len() {
            self.context.push(token);
        }
        self.n_past = position.saturating_add(1);
    }

    /// Take the session apart (its engine, with the cache as the last turn left it).
    pub fn into_engine(self) -> Engine<C, F, B> {
        self.engine
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::ExpertCache;
    use crate::flash::ResidentFlash;
    use crate::policy::Lru;
    use crate::records::{IoRecord, RouteRecord};
    use crate::step::StreamConfig;
    use crate::telemetry::MetricsCsv;
    use crate::testing::{
        synthetic_model, Call, ManualClock, MemFlash, ScriptBackend, ScriptCosts, SCRIPT_VOCAB,
    };

    type Rig = Session<ManualClock, MemFlash, ScriptBackend>;

    fn rig(budget_experts: u64) -> Rig {
        let (layout, shards) = synthetic_model(3, &[0, 1, 2], 8, 2, &[16, 16], 5).unwrap();
        let clock = ManualClock::new();
        let flash = MemFlash::new(shards.clone(), 2, clock.clone());
        let backend = ScriptBackend::new(
            layout.clone(),
            shards,
            2,
            5,
            clock.clone(),
            ScriptCosts::default(),
        );
        let cache = ExpertCache::new(
            &layout,
            budget_experts * layout.expert_bytes(0),
            2,
            Box::new(Lru::new()),
        )
        .unwrap();
        let engine = Engine::new(
            clock,
            flash,
            backend,
            layout,
            cache,
            StreamConfig::default(),
        )
        .unwrap();
        let cfg = RunConfig {
            n_expert_used: 2,
            ..RunConfig::default()
        };
        Session::new(engine, cfg, 0.5, Box::new(NoProbe))
    }

    /// Yields tokens 100, 101, ... with text "t0 ", "t1 ", ...; ends the turn after `eog_after`
    /// tokens; sets `cancel` while choosing token `cancel_at` (0-based).
    #[derive(Default)]
    struct Counting {
        given: u32,
        eog_after: Option<u32>,
        cancel_at: Option<(u32, CancelFlag)>,
        text: String,
        lasts: Vec<bool>,
        finished: bool,
    }

    impl<B: Backend> TokenSource<B> for Counting {
        type Error = std::io::Error;
        fn next_token(&mut self, _b: &mut B, last: bool) -> Result<Option<u32>, Self::Error> {
            if self.eog_after == Some(self.given) {
                return Ok(None);
            }
            if let Some((at, flag)) = &self.cancel_at {
                if *at == self.given {
                    flag.set();
                }
            }
            self.text.push_str(&format!("t{} ", self.given));
            self.lasts.push(last);
            self.given += 1;
            Ok(Some(99 + self.given))
        }
        fn text(&self) -> (&str, &str) {
            ("", &self.text)
        }
        fn finish(&mut self, _b: &mut B) -> Result<(), Self::Error> {
            self.finished = true;
            Ok(())
        }
    }

    /// Counts flushes and records.
    #[derive(Default)]
    struct Counter {
        routes: usize,
        flushes: usize,
    }
    impl RecordSink for Counter {
        fn wants_routes(&self) -> bool {
            true
        }
        fn route(&mut self, _r: &RouteRecord) {
            self.routes += 1;
        }
        fn io(&mut self, _r: &IoRecord) {}
        fn flush(&mut self) -> io::Result<()> {
            self.flushes += 1;
            Ok(())
        }
    }

    fn turn(
        s: &mut Rig,
        src: &mut Counting,
        prompt: &[u32],
        n: u32,
        progress: &mut Vec<u8>,
        csv: &mut Vec<u8>,
    ) -> TurnOutcome {
        let from = s.n_past();
        let positions: Vec<u32> = (from..from + prompt.len() as u32).collect();
        let mut out = Outputs {
            progress: Some(progress),
            csv: Some(csv),
            ..Outputs::default()
        };
        s.generate(
            &TurnRequest {
                prompt,
                positions: &positions,
                n_predict: n,
            },
            src,
            &mut out,
        )
        .unwrap()
    }

    fn progress_lines(p: &[u8]) -> Vec<serde_json::Value> {
        String::from_utf8(p.to_vec())
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix("BMOE_PROGRESS "))
            .map(|j| serde_json::from_str(j).unwrap())
            .collect()
    }

    fn begins(s: &Rig) -> Vec<(Vec<u32>, Vec<u32>)> {
        s.engine()
            .backend()
            .log()
            .iter()
            .filter_map(|c| match c {
                Call::Begin { tokens, positions } => Some((tokens.clone(), positions.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn n_tokens_are_n_fed_steps_rows_and_lines_each_with_its_text() {
        for n in [1u32, 2, 5] {
            let mut s = rig(6);
            let mut src = Counting::default();
            let (mut p, mut c) = (Vec::new(), Vec::new());
            let o = turn(&mut s, &mut src, &[1, 2, 3], n, &mut p, &mut c);
            assert_eq!(o.stop, StopReason::Count);
            assert_eq!(o.tokens, (100..100 + n).collect::<Vec<_>>());
            // The prefill, then every token fed at the next position — the last one too.
            let b = begins(&s);
            assert_eq!(b.len(), 1 + n as usize);
            assert_eq!(b[0], (vec![1, 2, 3], vec![0, 1, 2]));
            for (i, (t, pos)) in b[1..].iter().enumerate() {
                assert_eq!((t[0], pos[0]), (100 + i as u32, 3 + i as u32));
            }
            assert_eq!(s.context(), &[&[1, 2, 3][..], &o.tokens[..]].concat()[..]);
            assert_eq!(s.n_past(), 3 + n);
            // Only the last choice is told it is the last.
            assert_eq!(src.lasts.iter().filter(|&&l| l).count(), 1);
            assert!(src.lasts[n as usize - 1] && src.finished);
            let lines = progress_lines(&p);
            assert_eq!(lines.len(), n as usize);
            for (i, v) in lines.iter().enumerate() {
                assert_eq!(
                    (v["step"].as_u64(), v["steps"].as_u64()),
                    (Some(i as u64 + 1), Some(u64::from(n)))
                );
                assert_eq!(
                    v["delta_text"],
                    format!("t{i} "),
                    "token i's text on line i"
                );
            }
            let m = MetricsCsv::parse(&String::from_utf8(c).unwrap()).unwrap();
            assert_eq!(m.rows.len(), n as usize);
            let sm = m.summary().unwrap();
            assert_eq!(sm.get("tokens"), Some(n.to_string().as_str()));
            assert_eq!(sm.get("interrupted"), None);
            assert_eq!(o.summary.counters.n_past, u64::from(3 + n));
            assert_eq!(o.summary.counters.n_prompt, 3);
        }
    }

    #[test]
    fn ubatch_prefills_in_steps_each_reading_its_own_union_once() {
        for (ubatch, steps) in [(0u32, vec![8usize]), (3, vec![3, 3, 2]), (8, vec![8])] {
            let mut s = rig(0);
            s.cfg.n_ubatch = ubatch;
            let (mut p, mut c) = (Vec::new(), Vec::new());
            let prompt: Vec<u32> = (1..=8).collect();
            let o = turn(&mut s, &mut Counting::default(), &prompt, 2, &mut p, &mut c);
            assert_eq!(o.stop, StopReason::Count);
            let b = begins(&s);
            let sizes: Vec<usize> = b.iter().map(|(t, _)| t.len()).collect();
            assert_eq!(sizes[..steps.len()], steps[..], "ubatch {ubatch}");
            assert_eq!(sizes.len(), steps.len() + 2);
            let fed: Vec<u32> = b[..steps.len()]
                .iter()
                .flat_map(|(t, _)| t.clone())
                .collect();
            let pos: Vec<u32> = b[..steps.len()]
                .iter()
                .flat_map(|(_, q)| q.clone())
                .collect();
            assert_eq!((fed, pos), (prompt.clone(), (0..8).collect::<Vec<_>>()));
            assert_eq!((o.summary.counters.n_prompt, s.n_past()), (8, 10));
            // Per step and MoE layer every expert is computed once, and (cache off) read once:
            // the reads are the sum of the steps' unions.
            let mut step = 0usize;
            let mut seen = std::collections::BTreeSet::new();
            for call in s.engine().backend().log() {
                match call {
                    Call::Begin { .. } => step += 1,
                    Call::Expert { layer, expert, .. } => {
                        assert!(
                            seen.insert((step, layer.moe, *expert)),
                            "{step} {layer:?} {expert}"
                        );
                    }
                    _ => {}
                }
            }
            let prefill_experts = seen.iter().filter(|(st, _, _)| *st <= steps.len()).count();
            assert_eq!(s.engine().flash().log().len(), seen.len() * 2);
            let m = MetricsCsv::parse(&String::from_utf8(c).unwrap()).unwrap();
            let sm = m.summary().unwrap();
            let mib = |k: &str| sm.get(k).unwrap().parse::<f64>().unwrap();
            let want =
                (prefill_experts as u64 * s.engine().layout().expert_bytes(0)) as f64 / 1048576.0;
            assert!((mib("prefill_read_mib") - want).abs() < 0.05 + want * 0.01);
        }
    }

    #[test]
    fn an_end_of_generation_ends_the_turn_unfed() {
        let mut s = rig(6);
        let mut src = Counting {
            eog_after: Some(2),
            ..Counting::default()
        };
        let (mut p, mut c) = (Vec::new(), Vec::new());
        let o = turn(&mut s, &mut src, &[7], 10, &mut p, &mut c);
        assert_eq!(o.stop, StopReason::EndOfGeneration);
        assert_eq!(o.tokens, vec![100, 101]);
        assert_eq!(begins(&s).len(), 3);
        assert_eq!(progress_lines(&p).len(), 2);
        assert!(src.finished);
    }

    #[test]
    fn cancel_stops_at_the_next_token_boundary_and_says_so() {
        let mut s = rig(6);
        let flag = s.cancel_flag().clone();
        let mut src = Counting {
            cancel_at: Some((2, flag.clone())),
            ..Counting::default()
        };
        let (mut p, mut c) = (Vec::new(), Vec::new());
        let mut route = Counter::default();
        let positions = [0u32, 1];
        let o = s
            .generate(
                &TurnRequest {
                    prompt: &[5, 6],
                    positions: &positions,
                    n_predict: 10,
                },
                &mut src,
                &mut Outputs {
                    progress: Some(&mut p),
                    csv: Some(&mut c),
                    route: Some(&mut route),
                    io: None,
                },
            )
            .unwrap();
        // Set while the third token was chosen: that token is still fed and reported; the
        // loop stops before choosing a fourth.
        assert_eq!(o.stop, StopReason::Cancelled);
        assert_eq!(o.tokens.len(), 3);
        assert_eq!(progress_lines(&p).len(), 3);
        // The traces were flushed after the prefill, after every token and at the end.
        assert_eq!(route.flushes, 1 + 3 + 1);
        assert!(route.routes > 0);
        let text = String::from_utf8(c).unwrap();
        let m = MetricsCsv::parse(&text).unwrap();
        assert_eq!(m.rows.len(), 3);
        assert_eq!(m.summary().unwrap().get("interrupted"), Some("1"));
        assert!(o.summary.counters.interrupted);

        // A flag already set when a turn starts: nothing runs, and the turn says so.
        let before = s.engine().backend().log().len();
        let mut src = Counting::default();
        let (mut p, mut c) = (Vec::new(), Vec::new());
        let o = turn(&mut s, &mut src, &[9], 4, &mut p, &mut c);
        assert_eq!((o.stop, o.tokens.len()), (StopReason::Cancelled, 0));
        assert_eq!(s.engine().backend().log().len(), before, "no step ran");
        flag.clear();
        let o = turn(&mut s, &mut src, &[9], 4, &mut p, &mut c);
        assert_eq!((o.stop, o.tokens.len()), (StopReason::Count, 4));
    }

    #[test]
    fn turns_are_numbered_share_one_preamble_and_merge() {
        let mut s = rig(6);
        let (mut p, mut c) = (Vec::new(), Vec::new());
        let a = turn(
            &mut s,
            &mut Counting::default(),
            &[1, 2, 3, 4],
            4,
            &mut p,
            &mut c,
        );
        let b = turn(&mut s, &mut Counting::default(), &[5, 6], 3, &mut p, &mut c);
        assert_eq!((a.turn, b.turn, s.turns()), (0, 1, 2));
        // The second turn continues the context where the first left it.
        assert_eq!(s.n_past(), 4 + 4 + 2 + 3);
        assert_eq!(b.summary.counters.n_past, 13);
        let text = String::from_utf8(c).unwrap();
        assert_eq!(text.matches("# bmoe_metrics v2").count(), 1);
        let m = MetricsCsv::parse(&text).unwrap();
        let turns: Vec<u32> = m.rows.iter().map(|r| r.turn).collect();
        assert_eq!(turns, vec![0, 0, 0, 0, 1, 1, 1]);
        assert_eq!(m.summaries.len(), 2);
        let whole = s.summary();
        assert_eq!(whole.tokens(), 7);
        assert_eq!(whole.counters.n_prompt, 6);
        assert_eq!(whole.counters.load_s, 0.5);
        let c = s.engine().cache().counters();
        assert_eq!(
            whole.counters.cache_hit_pct,
            100.0 * c.hits as f64 / (c.hits + c.misses) as f64
        );
        let mut report = Vec::new();
        s.write_report(
            &mut report,
            &ReportContext {
                progress: false,
                answer: "",
                arch_streamable: true,
            },
        )
        .unwrap();
        assert!(String::from_utf8(report)
            .unwrap()
            .starts_with("generation: 7 tokens"));
        // A new chat forgets the context.
        s.truncate_context(0);
        assert_eq!((s.n_past(), s.context().len()), (0, 0));
    }

    #[test]
    fn a_failed_step_ends_the_turn_and_is_reported() {
        let (layout, shards) = synthetic_model(2, &[0, 1], 8, 2, &[16], 3).unwrap();
        let clock = ManualClock::new();
        let backend = ScriptBackend::new(
            layout.clone(),
            shards.clone(),
            2,
            3,
            clock.clone(),
            ScriptCosts::default(),
        )
        .fail_expert_call(9);
        let cache = ExpertCache::new(&layout, 0, 2, Box::new(Lru::new())).unwrap();
        let engine = Engine::new(
            clock.clone(),
            MemFlash::new(shards, 1, clock),
            backend,
            layout,
            cache,
            StreamConfig::default(),
        )
        .unwrap();
        let mut s = Session::new(engine, RunConfig::default(), 0.0, Box::new(NoProbe));
        let (mut p, mut c) = (Vec::new(), Vec::new());
        let o = turn(&mut s, &mut Counting::default(), &[1], 8, &mut p, &mut c);
        assert_eq!(o.stop, StopReason::Failed);
        assert!(o.error.is_some());
        assert!(o.tokens.len() < 8);
        assert_eq!(o.summary.counters.io_errors, 1);
        let m = MetricsCsv::parse(&String::from_utf8(c).unwrap()).unwrap();
        assert_eq!(m.rows.len(), o.tokens.len());
        assert_eq!(m.summary().unwrap().get("io_errors"), Some("1"));
    }

    #[test]
    fn the_resident_device_reads_nothing_and_computes_every_routed_expert() {
        let (layout, shards) = synthetic_model(2, &[0, 1], 8, 2, &[16, 16], 9).unwrap();
        let clock = ManualClock::new();
        let mk_backend = || {
            ScriptBackend::new(
                layout.clone(),
                shards.clone(),
                2,
                9,
                clock.clone(),
                ScriptCosts::default(),
            )
        };
        let cache_on =
            ExpertCache::new(&layout, 4 * layout.expert_bytes(0), 2, Box::new(Lru::new())).unwrap();
        assert!(matches!(
            Engine::new(
                clock.clone(),
                ResidentFlash::new(),
                mk_backend(),
                layout.clone(),
                cache_on,
                StreamConfig::default()
            ),
            Err(StepError::ResidentWithCache { .. })
        ));
        let off = || ExpertCache::new(&layout, 0, 2, Box::new(Lru::new())).unwrap();
        let mut resident = Engine::new(
            clock.clone(),
            ResidentFlash::new(),
            mk_backend(),
            layout.clone(),
            off(),
            StreamConfig::default(),
        )
        .unwrap();
        let mut streamed = Engine::new(
            clock.clone(),
            MemFlash::new(shards.clone(), 2, clock.clone()),
            mk_backend(),
            layout.clone(),
            off(),
            StreamConfig::default(),
        )
        .unwrap();
        for (tokens, positions) in [(&[3u32, 4, 5][..], &[0u32, 1, 2][..]), (&[6][..], &[3][..])] {
            let input = StepInput {
                turn: 0,
                phase: if tokens.len() > 1 {
                    Phase::Prefill
                } else {
                    Phase::Decode
                },
                tokens,
                positions,
            };
            let r = resident
                .step(&input, &mut crate::records::NullSink)
                .unwrap();
            let s = streamed
                .step(&input, &mut crate::records::NullSink)
                .unwrap();
            assert_eq!((r.reads, r.read_bytes, r.hits, r.misses), (0, 0, 0, 0));
            assert!(s.reads > 0);
            assert_eq!(r.experts_routed, s.experts_routed);
            assert_eq!(resident.backend().state(), streamed.backend().state());
        }
        // The same experts, computed in the same order, with the same uses.
        let computed = |log: &[Call]| -> Vec<(u16, u16, usize)> {
            log.iter()
                .filter_map(|c| match c {
                    Call::Expert {
                        layer,
                        expert,
                        uses,
                        ..
                    } => Some((layer.moe, *expert, uses.len())),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(
            computed(resident.backend().log()),
            computed(streamed.backend().log())
        );
    }

    fn decide(
        s: &mut Rig,
        tokens: &[u32],
        prefix_len: u32,
        reuse_prefix: bool,
        csv: &mut Vec<u8>,
    ) -> DecideOutcome {
        s.decide(
            &DecideRequest {
                tokens,
                prefix_len,
                choices: &[3, 7, 11, 15],
                reuse_prefix,
                n_ctx: 64,
            },
            &mut Outputs {
                csv: Some(csv),
                ..Outputs::default()
            },
        )
        .unwrap()
        .unwrap()
    }

    const PREFIX: [u32; 6] = [1, 2, 3, 4, 5, 6];

    /// A bare prefill step outside any turn (what other work would do to the KV).
    fn prefill(s: &mut Rig, tokens: &[u32], positions: &[u32]) {
        s.engine_mut()
            .step(
                &StepInput {
                    turn: 9,
                    phase: Phase::Prefill,
                    tokens,
                    positions,
                },
                &mut crate::records::NullSink,
            )
            .unwrap();
    }

    fn render(prefix: &[u32], suffix: &[u32]) -> Vec<u32> {
        [prefix, suffix, &[40, 41]].concat()
    }

    #[test]
    fn decide_scores_every_choice_over_the_whole_vocabulary() {
        let mut s = rig(6);
        let mut csv = Vec::new();
        let t = render(&PREFIX, &[20, 21]);
        let o = decide(&mut s, &t, 6, true, &mut csv);
        assert!(!o.cancelled && o.error.is_none());
        assert_eq!((o.n_tokens, o.n_reused, o.n_prefilled), (10, 0, 10));
        // One prefill of the whole render, no decode.
        assert_eq!(begins(&s), vec![(t.clone(), (0..10).collect())]);
        let logits = s.engine().backend().last_logits().unwrap().to_vec();
        assert_eq!(logits.len(), SCRIPT_VOCAB);
        assert_eq!(
            o.choice_logp,
            crate::decide::choice_logp(&logits, &[3, 7, 11, 15])
        );
        assert_eq!(
            o.choice_logp[3], None,
            "the backend's impossible token is null"
        );
        let total: f64 = (0..SCRIPT_VOCAB as u32)
            .filter_map(|v| crate::decide::choice_logp(&logits, &[v])[0])
            .map(f64::exp)
            .sum();
        assert!((total - 1.0).abs() < 1e-9, "normalised over the vocabulary");
        assert_eq!(o.best, crate::decide::best(&o.choice_logp));
        // The prefix is kept; the KV holds the render.
        assert_eq!(s.kept_prefix(), Some(&PREFIX[..]));
        assert_eq!(o.prefix_state_bytes, 6 * 8);
        assert_eq!(s.context(), &t[..]);
        // A turn of its own, with a summary and no rows.
        let m = MetricsCsv::parse(&String::from_utf8(csv).unwrap()).unwrap();
        assert_eq!(m.rows.len(), 0);
        let sm = m.summary().unwrap();
        assert_eq!(
            (sm.get("tokens"), sm.get("n_prompt")),
            (Some("0"), Some("10"))
        );
        assert_eq!((o.turn, s.turns()), (0, 1));
    }

    #[test]
    fn a_restored_prefix_scores_bit_for_bit_like_a_cold_one() {
        let mut csv = Vec::new();
        let mut warm = rig(6);
        decide(&mut warm, &render(&PREFIX, &[20, 21]), 6, true, &mut csv);
        // Overwrite the KV past and inside the kept prefix, as other work would.
        let junk: Vec<u32> = (50..60).collect();
        let pos: Vec<u32> = (0..10).collect();
        prefill(&mut warm, &junk, &pos);
        for (suffix, extend) in [(&[30u32, 31, 32][..], &[][..]), (&[33], &[7, 8][..])] {
            let prefix = [&PREFIX[..], extend].concat();
            let t = render(&prefix, suffix);
            let p = prefix.len() as u32;
            let kept = warm.kept_prefix().unwrap().len() as u32;
            let w = decide(&mut warm, &t, p, true, &mut csv);
            assert_eq!((w.n_reused, w.n_prefilled), (kept, t.len() as u32 - kept));
            assert_eq!(begins(&warm).last().unwrap().0, t[kept as usize..].to_vec());
            assert!(w.restore_s >= 0.0);
            assert_eq!(warm.kept_prefix(), Some(&prefix[..]));
            let mut cold = rig(6);
            let c = decide(&mut cold, &t, p, true, &mut csv);
            assert_eq!((c.n_reused, c.n_prefilled), (0, t.len() as u32));
            assert_eq!(w.choice_logp, c.choice_logp, "{suffix:?}");
            assert_eq!(w.best, c.best);
            // reuse_prefix:false on the warm session: cold too.
            let f = decide(&mut warm, &t, p, false, &mut csv);
            assert_eq!(f.n_reused, 0);
            assert_eq!(f.choice_logp, c.choice_logp);
        }
        // Without the restore the clobbered KV would show: the restore is what makes it equal.
        let mut clobbered = rig(6);
        decide(&mut clobbered, &render(&PREFIX, &[20]), 6, true, &mut csv);
        clobbered.engine_mut().backend_mut().drop_prefix();
        prefill(&mut clobbered, &junk, &pos);
        let t = render(&PREFIX, &[30]);
        let tail: Vec<u32> = (6..t.len() as u32).collect();
        prefill(&mut clobbered, &t[6..], &tail);
        let stale = crate::decide::choice_logp(
            clobbered.engine().backend().last_logits().unwrap(),
            &[3, 7, 11, 15],
        );
        let good = decide(&mut rig(6), &t, 6, true, &mut csv).choice_logp;
        assert_ne!(stale, good);
    }

    #[test]
    fn a_generate_drops_the_kept_prefix_and_is_unaffected() {
        let mut csv = Vec::new();
        let t = render(&PREFIX, &[20]);
        let mut s = rig(6);
        decide(&mut s, &t, 6, true, &mut csv);
        let (mut p, mut c) = (Vec::new(), Vec::new());
        s.truncate_context(0);
        let a = turn(
            &mut s,
            &mut Counting::default(),
            &[9, 8, 7],
            4,
            &mut p,
            &mut c,
        );
        assert_eq!(s.kept_prefix(), None);
        let mut fresh = rig(6);
        let b = turn(
            &mut fresh,
            &mut Counting::default(),
            &[9, 8, 7],
            4,
            &mut p,
            &mut c,
        );
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(
            s.engine().backend().state(),
            fresh.engine().backend().state()
        );
        assert_eq!(a.summary.counters.n_reused, 0);
        // Nothing to restore afterwards.
        let o = decide(&mut s, &t, 6, true, &mut csv);
        assert_eq!(o.n_reused, 0);
    }

    #[test]
    fn the_prefix_cache_off_keeps_nothing() {
        let mut csv = Vec::new();
        let mut s = rig(6).with_prefix_cache(false);
        for suffix in [[20u32], [21]] {
            let o = decide(&mut s, &render(&PREFIX, &suffix), 6, true, &mut csv);
            assert_eq!((o.n_reused, o.prefix_state_bytes, o.store_s), (0, 0, 0.0));
            assert_eq!(s.kept_prefix(), None);
        }
    }

    #[test]
    fn refused_and_cancelled_decides_change_nothing() {
        let mut s = rig(6);
        let mut csv = Vec::new();
        let t = render(&PREFIX, &[20]);
        decide(&mut s, &t, 6, true, &mut csv);
        let log = s.engine().backend().log().len();
        let ask = |s: &mut Rig, tokens: &[u32], prefix_len: u32, choices: &[u32]| {
            s.decide(
                &DecideRequest {
                    tokens,
                    prefix_len,
                    choices,
                    reuse_prefix: true,
                    n_ctx: 12,
                },
                &mut Outputs::default(),
            )
            .unwrap()
        };
        assert_eq!(
            ask(&mut s, &t, 6, &[]).unwrap_err(),
            DecideRejected::NoChoices
        );
        assert_eq!(
            ask(&mut s, &t, 6, &[3, 4, 3]).unwrap_err(),
            DecideRejected::SharedFirstToken {
                first: 0,
                second: 2,
                token: 3
            }
        );
        assert_eq!(
            ask(&mut s, &[1; 13], 6, &[3]).unwrap_err(),
            DecideRejected::PastContext {
                tokens: 13,
                n_ctx: 12
            }
        );
        assert_eq!(
            ask(&mut s, &[], 0, &[3]).unwrap_err(),
            DecideRejected::EmptyPrompt
        );
        assert!(matches!(
            ask(&mut s, &t, 9, &[3]).unwrap_err(),
            DecideRejected::PrefixPastPrompt { .. }
        ));
        assert_eq!(s.engine().backend().log().len(), log, "nothing ran");
        assert_eq!(s.turns(), 1);
        assert_eq!(s.kept_prefix(), Some(&PREFIX[..]));
        // Cancelled before its prefill: no scores, the kept state as it was.
        s.cancel_flag().set();
        let o = ask(&mut s, &t, 6, &[3, 4]).unwrap();
        assert!(o.cancelled);
        assert_eq!((o.best, o.choice_logp), (None, vec![None, None]));
        assert_eq!(s.engine().backend().log().len(), log, "nothing ran");
        assert_eq!(s.kept_prefix(), Some(&PREFIX[..]));
        assert!(o.summary.counters.interrupted);
    }
}
