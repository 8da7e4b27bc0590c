//! A conversation over the one generation loop, for the front ends that hold the model for a
//! long time and take turns from somewhere else: `bmoe-cli serve` (the OpenAI-compatible HTTP
//! server) and `bmoe-cli chat` (the terminal chat). Each turn is one
//! `bmoe_core::Session::generate` with the engine's `Sampling` token source inside a `Relay`
//! that hands the text on as it grows, ends the turn at a stop string, and turns "the listener
//! is gone" into the session's cancel at the next token boundary.
//!
//! KV reuse is the session protocol's: a turn's whole context is rendered and tokenized, and
//! only the tokens past the longest common prefix with what the KV holds are prefilled (at least
//! the last one, for its logits). A cancelled turn is rolled back to where it started.

use crate::chat::{ChatFormat, Message, ThinkCtl};
use crate::cli::RunArgs;
use crate::run::{host_probe, load, Sampling, Sinks};
use crate::sample::{Sampler, SamplerConfig};
use crate::stream::EngineBackend;
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Result};
use bmoe_core::telemetry::summary::RunSummary;
use bmoe_core::{
    Backend, CancelFlag, Session, StepInput, StepStats, StopReason, TokenSource, TurnRequest,
};
use std::io::Write;
use std::path::Path;

/// A chat turn's boundary: the tokens `prompt` (the rendered `messages` with the generation
/// prompt) shares with the messages rendered alone — where the next turn, which re-renders
/// this one's answer its own way, still agrees with this one.
pub fn chat_boundary(
    format: &ChatFormat,
    tok: &Tokenizer,
    messages: &[Message],
    tools: &[serde_json::Value],
    think: bool,
    prompt: &[u32],
) -> Option<u32> {
    chat_boundary_with(format, tok, messages, tools, think, None, prompt)
}

/// [`chat_boundary`] with the turn's `reasoning_effort`.
pub fn chat_boundary_with(
    format: &ChatFormat,
    tok: &Tokenizer,
    messages: &[Message],
    tools: &[serde_json::Value],
    think: bool,
    effort: Option<&str>,
    prompt: &[u32],
) -> Option<u32> {
    let text = format.history_with(messages, tools, think, effort).ok()?;
    let history = tok.encode(&text, true).ok()?;
    Some(common_prefix(&history, prompt) as u32)
}

/// The longest common prefix of two token sequences.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How a JSON value is named in an error message ("a string", "an array", ...).
pub(crate) fn type_name(v: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// What a turn answers.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Messages rendered with the chat template (with `tools`, the request's tool
    /// definitions, when there are any); `think` as `think:false` is honoured.
    Chat {
        messages: Vec<Message>,
        think: bool,
        tools: Vec<serde_json::Value>,
        /// `reasoning_effort` for a template that reads it (gpt-oss's).
        effort: Option<String>,
    },
    /// Raw text, tokenized as given (special tokens parsed unless `--no-parse-special`).
    Raw(String),
}

/// Why a turn was refused before it ran (nothing changed): a client error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("this model has no chat template: use /v1/completions with a raw prompt, or start the server with --chat-template-file FILE")]
    NoTemplate,
    #[error("the chat template failed on these messages: {0}")]
    Template(String),
    #[error("the prompt is empty after tokenization")]
    Empty,
    #[error("the prompt has {tokens} tokens, which leaves no room in the context of {n_ctx} tokens (-c) to generate one")]
    TooLong { tokens: usize, n_ctx: usize },
    #[error("tokenizing the prompt: {0}")]
    Tokenize(String),
    #[error("a step failed earlier and the engine's state is not trustworthy: {0}; restart it")]
    Broken(String),
}

/// A turn, rendered and checked, ready to run.
#[derive(Clone, Debug)]
pub struct Prepared {
    tokens: Vec<u32>,
    text: String,
    chat: bool,
    /// Tokens of `tokens` the KV already holds.
    pub reuse: usize,
    /// Tokens the turn may generate (the request's, clamped to the context's room).
    pub n_predict: u32,
    /// The whole prompt's length in tokens.
    pub prompt_tokens: usize,
    /// Where a recurrent state is copied during the prefill (`Session::generate_marked`):
    /// the end of a chat's messages (its tokens shared with the prompt), a raw prompt's last
    /// token; `None` for a model that keeps every position anyway.
    boundary: Option<u32>,
}

impl Prepared {
    /// A turn its caller rendered and checked itself (`--session`): `tokens` the whole
    /// context wanted in the KV, `text` what the generation follows (a rendered chat), `reuse`
    /// the tokens of it the KV holds, `boundary` as [`Conversation::prepare`] sets it.
    pub fn new(
        tokens: Vec<u32>,
        text: String,
        chat: bool,
        reuse: usize,
        n_predict: u32,
        boundary: Option<u32>,
    ) -> Prepared {
        Prepared {
            prompt_tokens: tokens.len(),
            tokens,
            text,
            chat,
            reuse,
            n_predict,
            boundary,
        }
    }

    /// The whole prompt's tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// The per-turn choices a client makes.
#[derive(Clone, Debug, Default)]
pub struct TurnOptions {
    pub sampler: SamplerConfig,
    /// Stop strings: the answer ends before the first of them (which is not returned).
    pub stop: Vec<String>,
    /// `--ngram` for this turn (`None`: plain decoding).
    pub speculation: Option<bmoe_core::speculate::NgramParams>,
    /// `--mtp` for this turn (a conversation opened with `--mtp` only).
    pub head_drafts: bool,
    /// Report each answer token's log-probability with this many alternatives.
    pub logprobs: Option<usize>,
    /// The grammar the answer must follow (checked first with [`Conversation::grammar`]).
    pub constraint: Option<crate::constrain::Spec>,
    /// Answer text from the first occurrence of this marker on (a tool call's opening) is
    /// not handed to the listener as it grows: the caller reads it from the finished turn.
    pub hold_from: Option<&'static str>,
}

/// One answer token's log-probability, and its most likely alternatives', as OpenAI reports
/// them: the token's text (lossy where it ends inside a character) and its exact bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Logprob {
    pub id: u32,
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// (id, text, bytes, log-probability), most likely first.
    pub top: Vec<(u32, String, Vec<u8>, f32)>,
}

impl Logprob {
    fn new(tok: &Tokenizer, lp: &crate::sample::TokenLogprob) -> Logprob {
        let text = |id: u32| {
            let b = tok.token_bytes(id);
            (String::from_utf8_lossy(&b).into_owned(), b)
        };
        let (token, bytes) = text(lp.id);
        Logprob {
            id: lp.id,
            token,
            bytes,
            logprob: lp.logprob,
            top: lp
                .top
                .iter()
                .map(|&(id, l)| {
                    let (t, b) = text(id);
                    (id, t, b, l)
                })
                .collect(),
        }
    }
}

/// Where a turn's text goes as it grows.
pub trait Listener {
    /// New text; returns false when nobody is listening any more (the turn is cancelled at the
    /// next token boundary).
    fn delta(&mut self, reasoning: &str, content: &str) -> bool;
    /// Whether the listener has gone away (checked after every step).
    fn gone(&self) -> bool {
        false
    }
    /// A token was generated (`n` so far this turn).
    fn token(&mut self, _n: u32) {}
    /// The token just generated, with the turn's `logprobs`: its log-probability (before
    /// the `delta` that carries its text, which a stop string may hold back).
    fn logprob(&mut self, _lp: &Logprob) {}
}

impl<L: Listener + ?Sized> Listener for &mut L {
    fn delta(&mut self, reasoning: &str, content: &str) -> bool {
        (**self).delta(reasoning, content)
    }
    fn gone(&self) -> bool {
        (**self).gone()
    }
    fn token(&mut self, n: u32) {
        (**self).token(n)
    }
    fn logprob(&mut self, lp: &Logprob) {
        (**self).logprob(lp)
    }
}

/// How a turn's generation ended, as the loop that ran it (a session's, a lane's) tells it.
pub(crate) struct Ended {
    pub stop: StopReason,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: u32,
    pub summary: RunSummary,
    pub error: Option<String>,
}

/// What a turn did.
#[derive(Clone, Debug)]
pub struct Finished {
    pub stop: StopReason,
    /// `"stop"` (an end-of-generation token or a stop string) or `"length"`.
    pub finish_reason: &'static str,
    pub reasoning: String,
    pub content: String,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: u32,
    /// The turn's summary (the `BMOE_DONE` keys).
    pub summary: RunSummary,
    /// A failed step's error (`stop == Failed`).
    pub error: Option<String>,
    /// Each answer token's, with the turn's `logprobs` (empty otherwise).
    pub logprobs: Vec<Logprob>,
    /// With a constraint: the token masks computed and the seconds they took.
    pub grammar: Option<(u64, f64)>,
    /// The tool calls read out of the answer (set by the caller that offered tools).
    pub tool_calls: Vec<crate::chat::ToolCall>,
}

impl Finished {
    /// The turn's telemetry: exactly the keys of its `BMOE_DONE` line (the contract's writer),
    /// without `id`, `reasoning` and `text`, which the response carries its own way.
    pub fn telemetry(&self) -> serde_json::Value {
        let mut buf = Vec::new();
        let cancelled = self.stop == StopReason::Cancelled;
        if bmoe_core::telemetry::progress::write_done(&mut buf, 0, cancelled, &self.summary, "", "")
            .is_err()
        {
            return serde_json::Value::Null;
        }
        let line = String::from_utf8_lossy(&buf);
        let json = line.trim_end().trim_start_matches("BMOE_DONE ");
        match serde_json::from_str::<serde_json::Value>(json) {
            Ok(serde_json::Value::Object(mut m)) => {
                for k in ["id", "reasoning", "text"] {
                    m.remove(k);
                }
                serde_json::Value::Object(m)
            }
            _ => serde_json::Value::Null,
        }
    }
}

/// How [`Conversation::open_with`] sets up its session.
#[derive(Default)]
pub struct SessionOptions {
    /// The flag that stops a turn (default: the session's own).
    pub cancel: Option<CancelFlag>,
    /// Another flag that stops a turn too (a signal's).
    pub also_stop_on: Option<CancelFlag>,
    /// Keep the state after a decide's prefix (`--decide-prefix-cache`).
    pub prefix_cache: bool,
}

/// What a turn writes beyond its listener (`--session`): the per-token `BMOE_PROGRESS` lines,
/// and a sampler kept across turns (one random stream for the session) instead of a fresh
/// one of the turn's options.
#[derive(Default)]
pub struct TurnIo<'a> {
    pub progress: Option<&'a mut dyn Write>,
    pub sampler: Option<&'a mut Sampler>,
}

/// The loaded model and its warm session.
pub struct Conversation {
    session: Session<crate::flash::MonotonicClock, crate::stream::Device, EngineBackend>,
    tok: std::sync::Arc<Tokenizer>,
    n_vocab: usize,
    format: Option<ChatFormat>,
    sinks: Sinks,
    default_n_predict: u32,
    parse_special: bool,
    n_ctx: usize,
    broken: Option<String>,
    arch: String,
    load_s: f64,
    /// The grammar engine's token trie, built on the first constrained turn.
    grammars: Option<crate::constrain::Grammars>,
}

impl Conversation {
    /// Check and create the outputs (`--csv`, traces), load the model, compile the chat
    /// template (`--chat-template-file` or the model's). Load warnings go to `err`.
    pub fn open(args: &RunArgs, model_path: &Path, err: &mut dyn Write) -> Result<Conversation> {
        Self::open_with(args, model_path, err, SessionOptions::default())
    }

    /// [`Conversation::open`] with the session's cancel flags and decide prefix cache
    /// (`--session`).
    pub fn open_with(
        args: &RunArgs,
        model_path: &Path,
        err: &mut dyn Write,
        o: SessionOptions,
    ) -> Result<Conversation> {
        if args.logits_out.is_some() {
            bail!("--logits-out is a one-shot diagnostic and cannot be combined with a server or a chat");
        }
        let mut files = crate::outputs::RunOutputs::open(model_path, args)?;
        let loaded = load(args, model_path, err)?;
        let format = crate::prompt::chat_format(args, &loaded.file, &loaded.tok)?;
        let crate::run::Loaded {
            cfg,
            mut engine,
            tok,
            n_vocab,
            load_s,
            ..
        } = loaded;
        let sinks = Sinks::open(&mut files, &cfg, &engine, true, args.sequences > 1)?;
        Sinks::install_compute_trace(&mut files, &cfg, &mut engine)?;
        let probe = host_probe(&engine);
        let n_ctx = cfg.n_ctx as usize;
        let arch = cfg.arch.clone();
        let mut session =
            Session::new(engine, cfg, load_s, Box::new(probe)).with_prefix_cache(o.prefix_cache);
        if let Some(c) = o.cancel {
            session = session.with_cancel(c);
        }
        if let Some(c) = o.also_stop_on {
            session = session.also_stop_on(c);
        }
        Ok(Conversation {
            session,
            tok: std::sync::Arc::new(tok),
            n_vocab,
            format,
            sinks,
            default_n_predict: args.n_predict,
            parse_special: !args.no_parse_special,
            n_ctx,
            broken: None,
            arch,
            load_s,
            grammars: None,
        })
    }

    /// A fresh constraint for `spec`, building the token trie on first use; the error says
    /// what is wrong with the grammar or schema.
    pub fn grammar(
        &mut self,
        spec: &crate::constrain::Spec,
    ) -> Result<crate::constrain::Constraint> {
        if self.grammars.is_none() {
            let eot = self
                .tok
                .eot()
                .or_else(|| self.tok.eos())
                .ok_or_else(|| anyhow::anyhow!("the vocabulary has no end-of-turn or end-of-sequence token to end a grammar with"))?;
            let t = std::time::Instant::now();
            self.grammars = Some(crate::constrain::Grammars::new(
                self.tok.clone(),
                self.n_vocab,
                eot,
            )?);
            eprintln!(
                "bmoe: grammar engine: the token trie of {} tokens built in {:.2} s (once per model)",
                self.n_vocab,
                t.elapsed().as_secs_f64()
            );
        }
        match &self.grammars {
            Some(g) => g.constraint(spec),
            None => bail!("the grammar engine is not built"),
        }
    }

    /// Whether chat prompts can be rendered (the model or `--chat-template-file` has a template).
    pub fn has_template(&self) -> bool {
        self.format.is_some()
    }
    /// How `think:false` is honoured.
    pub fn think_ctl(&self) -> ThinkCtl {
        self.format
            .as_ref()
            .map_or(ThinkCtl::Template, ChatFormat::think_ctl)
    }
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    /// Logits per row (token ids are below it).
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }
    pub fn arch(&self) -> &str {
        &self.arch
    }
    pub fn load_s(&self) -> f64 {
        self.load_s
    }
    /// The report's `mode:` line for this conversation's configuration (streaming or not,
    /// and why), as a one-shot run prints it.
    pub fn mode_line(&self) -> String {
        bmoe_core::telemetry::report::mode_line(self.session.config(), true)
    }
    /// The flag that stops the running turn at its next token boundary.
    pub fn cancel_flag(&self) -> &CancelFlag {
        self.session.cancel_flag()
    }
    /// Every turn so far as one summary.
    pub fn summary(&self) -> RunSummary {
        self.session.summary()
    }
    /// Whether a step failed (the engine refuses further turns).
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }
    /// Tokens the KV holds.
    pub fn context_len(&self) -> usize {
        self.session.context().len()
    }
    /// Forget the KV (a new chat).
    pub fn clear(&mut self) {
        self.session.truncate_context(0);
    }
    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }
    /// The tokenizer, to share with other threads (the server's `/tokenize`).
    pub fn shared_tokenizer(&self) -> std::sync::Arc<Tokenizer> {
        self.tok.clone()
    }
    /// The chat template's source (the model's or `--chat-template-file`'s).
    pub fn template_source(&self) -> Option<&str> {
        self.format.as_ref().map(ChatFormat::source)
    }
    /// The syntax the chat template gives tool calls, if it is one this engine reads.
    pub fn tool_format(&self) -> Option<crate::tools::ToolFormat> {
        self.template_source()
            .and_then(crate::tools::ToolFormat::of_template)
    }
    /// Whether `text` is a control token of the vocabulary (a grammar names those as tokens).
    pub fn is_control_token(&self, text: &str) -> bool {
        self.tok
            .token_id(text)
            .and_then(|id| self.tok.kind(id))
            .is_some_and(|k| k == crate::tokenizer::TokenKind::Control)
    }

    /// Where the next turn may want to continue from, for a model whose recurrent state
    /// cannot roll back (`None` for the others, which keep every position): a chat's
    /// messages without the generation prompt (the next turn re-renders this turn's answer,
    /// and may render it otherwise than it was generated), as far as their tokens agree
    /// with the prompt's; a raw prompt's last token (a regenerated answer shares all
    /// before it).
    fn boundary(&self, prompt: &Prompt, tokens: &[u32]) -> Option<u32> {
        if !self
            .session
            .engine()
            .backend()
            .keeps_prefix_where_it_stands()
        {
            return None;
        }
        match prompt {
            Prompt::Chat {
                messages,
                think,
                tools,
                effort,
            } => chat_boundary_with(
                self.format.as_ref()?,
                &self.tok,
                messages,
                tools,
                *think,
                effort.as_deref(),
                tokens,
            ),
            Prompt::Raw(_) => Some(tokens.len().saturating_sub(1) as u32),
        }
    }

    /// Render and tokenize a turn, and work out what the KV reuses and how many tokens it may
    /// generate: `max_tokens`, else the process's `-n` (`-1`: the context's room), clamped to
    /// the room the context has left.
    pub fn prepare(&self, prompt: &Prompt, max_tokens: Option<u32>) -> Result<Prepared, Refused> {
        if let Some(b) = &self.broken {
            return Err(Refused::Broken(b.clone()));
        }
        let (text, tokens, chat) = match prompt {
            Prompt::Chat {
                messages,
                think,
                tools,
                effort,
            } => {
                let f = self.format.as_ref().ok_or(Refused::NoTemplate)?;
                let text = f
                    .prompt_with(messages, tools, *think, effort.as_deref())
                    .map_err(|e| Refused::Template(e.to_string()))?;
                let t = self
                    .tok
                    .encode(&text, true)
                    .map_err(|e| Refused::Tokenize(e.to_string()))?;
                (text, t, true)
            }
            Prompt::Raw(s) => {
                let t = self
                    .tok
                    .encode(s, self.parse_special)
                    .map_err(|e| Refused::Tokenize(e.to_string()))?;
                (String::new(), t, false)
            }
        };
        if tokens.is_empty() {
            return Err(Refused::Empty);
        }
        if tokens.len() >= self.n_ctx {
            return Err(Refused::TooLong {
                tokens: tokens.len(),
                n_ctx: self.n_ctx,
            });
        }
        let room = (self.n_ctx - tokens.len()) as u32;
        let asked = max_tokens.unwrap_or(self.default_n_predict);
        let n_predict = asked.min(room);
        let common = common_prefix(self.session.context(), &tokens).min(tokens.len() - 1);
        let reuse = self.session.reusable_prefix(common as u32) as usize;
        let boundary = self.boundary(prompt, &tokens);
        Ok(Prepared {
            boundary,
            prompt_tokens: tokens.len(),
            tokens,
            text,
            chat,
            reuse,
            n_predict,
        })
    }

    /// The chat format (the model's template or `--chat-template-file`), if there is one.
    pub fn format(&self) -> Option<&ChatFormat> {
        self.format.as_ref()
    }

    /// The run's configuration as loaded.
    pub fn config(&self) -> &bmoe_core::config::RunConfig {
        self.session.config()
    }

    /// The tokens the KV holds.
    pub fn context(&self) -> &[u32] {
        self.session.context()
    }

    /// How much of a context of `n` tokens the KV can continue from.
    pub fn reusable_prefix(&self, n: u32) -> u32 {
        self.session.reusable_prefix(n)
    }

    /// Whether the model's state stands only where its last step ended (a recurrent layer).
    pub fn keeps_prefix_where_it_stands(&self) -> bool {
        self.session
            .engine()
            .backend()
            .keeps_prefix_where_it_stands()
    }

    /// Whether a turn may draft with the MTP head (`mtp`), and set it so; false when asked
    /// of a conversation not opened with `--mtp`.
    pub fn set_head_drafts(&mut self, mtp: bool) -> bool {
        self.session.set_head_drafts(mtp)
    }

    /// A decide (`--session --decide`): one prefill, the choices scored.
    pub fn decide(
        &mut self,
        req: &bmoe_core::DecideRequest<'_>,
    ) -> Result<Result<bmoe_core::DecideOutcome, bmoe_core::DecideRejected>, bmoe_core::GenerateError>
    {
        self.session.decide(req, &mut self.sinks.outputs(None))
    }

    /// The decode step (its device, for the end-of-run notes).
    pub fn engine(
        &self,
    ) -> &bmoe_core::Engine<crate::flash::MonotonicClock, crate::stream::Device, EngineBackend>
    {
        self.session.engine()
    }

    /// Hold `n` sequences (`serve --parallel`): see [`crate::stream::EngineBackend::set_sequences`].
    pub fn set_sequences(&mut self, n: u32) -> Result<()> {
        self.session
            .engine_mut()
            .backend_mut()
            .set_sequences(n)
            .map_err(|e| anyhow::anyhow!("--parallel {n}: {e}"))
    }

    /// The decode step, for lanes that run on it ([`bmoe_core::lanes::Lanes`]).
    pub fn engine_mut(
        &mut self,
    ) -> &mut bmoe_core::Engine<crate::flash::MonotonicClock, crate::stream::Device, EngineBackend>
    {
        self.session.engine_mut()
    }

    /// `--ubatch`: the prompt step size (0: one step).
    pub fn ubatch(&self) -> usize {
        self.session.config().n_ubatch as usize
    }

    /// The `--ngram` settings of the flags the conversation was opened with (what a turn that
    /// asks for speculation drafts with).
    pub fn ngram_params(&self) -> bmoe_core::speculate::NgramParams {
        bmoe_core::generate::ngram_params(self.session.config())
    }

    /// Run a prepared turn (prepared against the KV as it is now). The text goes to `listener`
    /// as it grows; the turn stops at `n_predict`, an end-of-generation token, a stop string,
    /// the cancel flag, or the listener going away.
    pub fn run(
        &mut self,
        p: &Prepared,
        opts: &TurnOptions,
        listener: &mut dyn Listener,
    ) -> Result<Finished> {
        self.run_with(p, opts, listener, TurnIo::default())
    }

    /// [`Conversation::run`], writing `io.progress` and drawing from `io.sampler`.
    pub fn run_with(
        &mut self,
        p: &Prepared,
        opts: &TurnOptions,
        listener: &mut dyn Listener,
        io: TurnIo<'_>,
    ) -> Result<Finished> {
        let reuse = p.reuse;
        let mut progress = io.progress;
        self.session.set_speculation(opts.speculation);
        if !self.session.set_head_drafts(opts.head_drafts) {
            bail!("mtp: this conversation was not started with --mtp (the MTP head follows every step from the first)");
        }
        self.session.truncate_context(reuse as u32);
        let positions: Vec<u32> = (reuse as u32..p.tokens.len() as u32).collect();
        let cancel = self.session.cancel_flag().clone();
        let constraint = match &opts.constraint {
            Some(spec) => Some(self.grammar(spec)?),
            None => None,
        };
        let mut relay = match io.sampler {
            Some(sampler) => {
                sampler.prime(&p.tokens);
                relay_of(
                    &self.tok,
                    self.n_vocab,
                    p,
                    opts,
                    sampler,
                    constraint,
                    Box::new(listener),
                    cancel,
                )
            }
            None => relay(
                &self.tok,
                self.n_vocab,
                p,
                opts,
                constraint,
                Box::new(listener),
                cancel,
            ),
        };
        let outcome = self.session.generate_marked(
            &TurnRequest {
                prompt: &p.tokens[reuse..],
                positions: &positions,
                n_predict: p.n_predict,
            },
            p.boundary,
            &mut relay,
            &mut self
                .sinks
                .outputs(progress.as_mut().map(|w| &mut **w as &mut dyn Write)),
        )?;
        let mut error = None;
        match outcome.stop {
            StopReason::Cancelled => self.session.truncate_context(reuse as u32),
            StopReason::Failed => {
                let e = outcome
                    .error
                    .map_or_else(|| "a step failed".to_string(), |e| e.to_string());
                self.broken = Some(e.clone());
                error = Some(e);
            }
            StopReason::Count | StopReason::EndOfGeneration => {}
        }
        Ok(relay.finished(Ended {
            stop: outcome.stop,
            prompt_tokens: p.prompt_tokens,
            cached_tokens: outcome.summary.counters.n_reused as usize,
            completion_tokens: outcome.tokens.len() as u32,
            summary: outcome.summary,
            error,
        }))
    }

    /// One step of every lane of `lanes` on this model (`serve --parallel`), its routings and
    /// reads written to the route and io traces (flushed after the step, as the generation
    /// loop flushes after each token).
    pub fn lanes_step<S>(
        &mut self,
        lanes: &mut bmoe_core::lanes::Lanes<S>,
    ) -> Vec<bmoe_core::lanes::Ended<S>>
    where
        S: bmoe_core::TokenSource<EngineBackend>,
    {
        let mut traces = self.sinks.traces();
        let ended = lanes.step(self.session.engine_mut(), &mut traces);
        // A write that failed fails again at `finish`, which reports it (as the generation
        // loop's files do): the step's lanes are not stopped for a trace.
        let _ = bmoe_core::records::RecordSink::flush(&mut traces);
        ended
    }

    /// Flush and close the output files.
    pub fn finish(self) -> Result<()> {
        self.sinks.finish()
    }
}

/// The turn's token source: the engine's sampler and detokenizer (`Sampling`), relaying the
/// text to a listener, ending the turn at a stop string, and cancelling it when the listener
/// goes away.
pub(crate) struct Relay<'a, 'l> {
    inner: Sampling<'a>,
    tok: &'a Tokenizer,
    /// The answer tokens' log-probabilities (with `logprobs`).
    logprobs: Vec<Logprob>,
    listener: Box<dyn Listener + 'l>,
    cancel: CancelFlag,
    stop: Vec<String>,
    /// `TurnOptions::hold_from`.
    hold_from: Option<&'static str>,
    /// Bytes of the reasoning and the answer already handed on.
    sent_reasoning: usize,
    sent_content: usize,
    /// Where the first stop string begins in the answer, once one appeared.
    stopped_at: Option<usize>,
    tokens: u32,
}

/// A turn's token source for prepared `p`: a sampler of `opts` primed with the prompt, the
/// constraint (compiled by [`Conversation::grammar`]), and the listener the text goes to;
/// `cancel` is set when the listener goes away.
pub(crate) fn relay<'a, 'l>(
    tok: &'a Tokenizer,
    n_vocab: usize,
    p: &Prepared,
    opts: &TurnOptions,
    constraint: Option<crate::constrain::Constraint>,
    listener: Box<dyn Listener + 'l>,
    cancel: CancelFlag,
) -> Relay<'a, 'l> {
    let mut sampler = Sampler::new(opts.sampler.clone());
    sampler.prime(&p.tokens);
    relay_of(tok, n_vocab, p, opts, sampler, constraint, listener, cancel)
}

/// [`relay`] drawing from `sampler` (primed by the caller).
#[allow(clippy::too_many_arguments)]
fn relay_of<'a, 'l>(
    tok: &'a Tokenizer,
    n_vocab: usize,
    p: &Prepared,
    opts: &TurnOptions,
    sampler: impl Into<crate::run::Held<'a, Sampler>>,
    constraint: Option<crate::constrain::Constraint>,
    listener: Box<dyn Listener + 'l>,
    cancel: CancelFlag,
) -> Relay<'a, 'l> {
    let mut inner = Sampling::new(tok, sampler, n_vocab, p.chat, &p.text);
    inner.logprobs = opts.logprobs;
    inner.constraint = constraint;
    Relay {
        inner,
        tok,
        logprobs: Vec::new(),
        listener,
        cancel,
        stop: opts.stop.clone(),
        hold_from: opts.hold_from,
        sent_reasoning: 0,
        sent_content: 0,
        stopped_at: None,
        tokens: 0,
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of some stop string:
/// text a later token may turn into a stop, so it is held back.
fn stop_holdback(text: &str, stop: &[String]) -> usize {
    let mut hold = 0;
    for s in stop {
        for k in (1..s.len().min(text.len() + 1)).rev() {
            if k > hold && s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                hold = k;
                break;
            }
        }
    }
    hold
}

impl Relay<'_, '_> {
    /// The finished turn: the text not handed on yet goes out, the answer ends at its stop
    /// string.
    pub(crate) fn finished(mut self, e: Ended) -> Finished {
        let stopped_at = self.stopped_at;
        self.send(true);
        let logprobs = std::mem::take(&mut self.logprobs);
        let grammar = self.inner.constraint.as_ref().map(|c| (c.masks, c.mask_s));
        let (reasoning, mut content) = self.into_text();
        if let Some(at) = stopped_at {
            content.truncate(at);
        }
        let finish_reason = if e.stop == StopReason::Count && stopped_at.is_none() {
            "length"
        } else {
            "stop"
        };
        Finished {
            stop: e.stop,
            finish_reason,
            reasoning,
            content,
            prompt_tokens: e.prompt_tokens,
            cached_tokens: e.cached_tokens,
            completion_tokens: e.completion_tokens,
            summary: e.summary,
            error: e.error,
            logprobs,
            grammar,
            tool_calls: Vec::new(),
        }
    }

    /// Hand on what is new. `last`: nothing is held back for a stop string any more.
    fn send(&mut self, last: bool) {
        let (reasoning, content) = self.inner.text();
        let mut content_end = match self.stopped_at {
            Some(at) => at,
            None if last => content.len(),
            None => content.len() - stop_holdback(content, &self.stop),
        };
        if let Some(m) = self.hold_from {
            let held = match content.find(m) {
                Some(at) => at,
                None if last => content.len(),
                None => content.len() - stop_holdback(content, &[m.to_string()]),
            };
            content_end = content_end.min(held);
        }
        // A reasoning span reclassified after the fact (`reset`) cannot be taken back from a
        // listener: only text that extends what was sent goes out.
        let r = if reasoning.len() > self.sent_reasoning
            && reasoning.is_char_boundary(self.sent_reasoning)
        {
            &reasoning[self.sent_reasoning..]
        } else {
            ""
        };
        let c = if content_end > self.sent_content
            && content.is_char_boundary(self.sent_content)
            && content.is_char_boundary(content_end)
        {
            &content[self.sent_content..content_end]
        } else {
            ""
        };
        if r.is_empty() && c.is_empty() {
            return;
        }
        let (rl, cl) = (r.len(), c.len());
        let listening = self.listener.delta(r, c);
        self.sent_reasoning += rl;
        self.sent_content += cl;
        if !listening {
            self.cancel.set();
        }
    }

    fn into_text(self) -> (String, String) {
        self.inner.into_text()
    }
}

impl TokenSource<EngineBackend> for Relay<'_, '_> {
    type Error = crate::run::SamplingError;

    fn after_step(
        &mut self,
        backend: &EngineBackend,
        input: &StepInput<'_>,
        stats: &mut StepStats,
    ) -> Result<(), Self::Error> {
        self.inner.after_step(backend, input, stats)?;
        if self.listener.gone() {
            self.cancel.set();
        }
        Ok(())
    }

    fn next_token(
        &mut self,
        backend: &mut EngineBackend,
        last: bool,
    ) -> Result<Option<u32>, Self::Error> {
        let t = self.inner.next_token(backend, last)?;
        Ok(self.relay(t))
    }

    fn verifies(&self) -> bool {
        self.inner.verifies()
    }

    fn next_token_at(
        &mut self,
        backend: &mut EngineBackend,
        row: u32,
        last: bool,
    ) -> Result<Option<u32>, Self::Error> {
        let t = self.inner.next_token_at(backend, row, last)?;
        Ok(self.relay(t))
    }

    fn text(&self) -> (&str, &str) {
        self.inner.text()
    }

    fn finish(&mut self, backend: &mut EngineBackend) -> Result<(), Self::Error> {
        self.inner.finish(backend)
    }
}

impl Relay<'_, '_> {
    /// A token the sampler chose, relayed: `None` (the turn ends) at an end of generation or
    /// where it completed a stop string; otherwise counted and its text sent.
    fn relay(&mut self, t: Option<u32>) -> Option<u32> {
        let t = t?;
        if !self.stop.is_empty() {
            let (_, content) = self.inner.text();
            // Search from a little before the text already sent: a stop string may straddle.
            let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
            let mut from = self.sent_content.saturating_sub(longest).min(content.len());
            while !content.is_char_boundary(from) {
                from -= 1;
            }
            let hit = self
                .stop
                .iter()
                .filter(|s| !s.is_empty())
                .filter_map(|s| content[from..].find(s.as_str()).map(|i| from + i))
                .min();
            if let Some(at) = hit {
                // The token that completed the stop string is not fed: the turn ends here.
                self.stopped_at = Some(at);
                return None;
            }
        }
        self.tokens += 1;
        self.listener.token(self.tokens);
        if let Some(lp) = self.inner.last_logprob.take() {
            let lp = Logprob::new(self.tok, &lp);
            self.listener.logprob(&lp);
            self.logprobs.push(lp);
        }
        self.send(false);
        Some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_strings_prefix_is_held_back() {
        let stop = vec!["</s>".to_string(), "STOP".to_string()];
        assert_eq!(stop_holdback("hello <", &stop), 1);
        assert_eq!(stop_holdback("hello </", &stop), 2);
        assert_eq!(stop_holdback("hello ST", &stop), 2);
        assert_eq!(stop_holdback("hello", &stop), 0);
        assert_eq!(stop_holdback("", &stop), 0);
        assert_eq!(stop_holdback("<", &stop), 1);
        // A stop string of several-byte characters is cut only at character boundaries.
        let stop = vec!["жёлтый".to_string()];
        assert_eq!(stop_holdback("это жё", &stop), "жё".len());
        assert_eq!(stop_holdback("это ж", &stop), "ж".len());
        assert_eq!(stop_holdback("это", &stop), 0);
    }
}
