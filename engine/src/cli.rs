//! The `bmoe-cli` command line: argument structures and the commands behind them.

use crate::gen::{self, GenOptions, Preset, TypeScheme};
use crate::gguf::{GgmlType, GgufFile};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(
    name = "bmoe-cli",
    version,
    about = "Run Mixture-of-Experts GGUF models bigger than RAM by streaming routed experts from flash",
    long_about = "Run Mixture-of-Experts GGUF models bigger than RAM by streaming each token's routed experts \
from flash into a fixed-budget expert cache.\n\nRun a model:  bmoe-cli -m MODEL.gguf -p \"PROMPT\" -n 64\n\
Serve:        bmoe-cli serve -m MODEL.gguf [--port 8080]   (OpenAI-compatible HTTP API)\n\
Chat:         bmoe-cli chat -m MODEL.gguf\n\
Tools:        bmoe-cli gen | inspect | bench | checksum  (see bmoe-cli <tool> --help)",
    args_conflicts_with_subcommands = true,
    allow_negative_numbers = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Option<Cmd>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Write a synthetic MoE model (qwen3moe, or any --arch) with deterministic random weights
    Gen(GenArgs),
    /// Describe a GGUF file: hyper-parameters, tensors, per-expert bytes
    Inspect(InspectArgs),
    /// Measure kernel throughput against memory bandwidth, side by side
    Bench(BenchArgs),
    /// Write MODEL.bmoe-sums: a checksum of every expert's bytes, for --verify-reads
    Checksum(ChecksumArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions,
    /// /v1/completions, /v1/models, /health, /metrics; see docs/serving.md)
    Serve(ServeArgs),
    /// Chat with the model in the terminal (history kept, Ctrl-C stops an answer, /exit)
    Chat(ChatArgs),
}

#[derive(Args, Debug)]
pub struct ChecksumArgs {
    /// The GGUF model (any shard of a split set)
    pub model: PathBuf,
    /// Where to write [default: MODEL.bmoe-sums, where --verify-reads looks]
    #[arg(long, short = 'o', value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Never show a progress bar
    #[arg(long)]
    pub quiet: bool,
}

/// Flags of a generation run.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// The GGUF model (the first shard of a split set)
    #[arg(short = 'm', long = "model", value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Prompt text; `-p -` reads it from stdin (as does a piped stdin when neither -p nor -f
    /// is given). Special tokens written in it (`<|im_start|>`) are parsed as tokens unless
    /// --no-parse-special
    #[arg(
        short = 'p',
        long = "prompt",
        default_value = "",
        allow_hyphen_values = true
    )]
    pub prompt: String,
    /// Read the prompt from FILE (any size the context holds)
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// A system message before the prompt (`-sys` as in llama.cpp); makes the prompt a chat
    /// (--chatml)
    #[arg(
        long = "system-prompt",
        value_name = "TEXT",
        allow_hyphen_values = true
    )]
    pub system_prompt: Option<String>,
    /// Render chats with this Jinja chat template instead of the model's
    /// tokenizer.chat_template
    #[arg(long = "chat-template-file", value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// Tokenize special-token text in a raw prompt (`<|im_end|>`) as plain characters instead
    /// of as the special tokens
    #[arg(long = "no-parse-special")]
    pub no_parse_special: bool,
    /// Tokens to generate; -1 = until an end-of-generation token or the context is full.
    /// Generation stops at the model's end-of-generation tokens unless --ignore-eos
    #[arg(short = 'n', long = "n-predict", default_value = "128", value_parser = crate::conventions::parse_n_predict, allow_negative_numbers = true)]
    pub n_predict: u32,
    /// Keep generating past end-of-generation tokens (sampled and printed like any other) until
    /// -n tokens or the context is full: fixed-length runs for benchmarks and gates, as
    /// llama.cpp's --ignore-eos
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Compute threads
    #[arg(short = 't', long = "threads", default_value_t = default_threads(), value_parser = clap::value_parser!(u32).range(1..=256))]
    pub threads: u32,
    /// Context size in tokens (prompt + generation)
    #[arg(short = 'c', long = "ctx-size", default_value_t = 2048, value_parser = clap::value_parser!(u32).range(1..))]
    pub ctx: u32,
    /// Sequences of `ctx` tokens the run will hold (`serve --parallel`; 0 or 1: one): what
    /// the zero-config fit check counts of the KV.
    #[arg(skip)]
    pub sequences: u32,
    /// Prompt tokens per prefill step (llama.cpp's `-ub`); 0 = the whole prompt in one step.
    /// A step reads each routed expert once per MoE layer, so smaller steps read more; they
    /// bound the batch's activation memory. Must be <= --ctx-size
    #[arg(long = "ubatch", default_value_t = 0)]
    pub ubatch: u32,
    /// Apply the model's chat template to the prompt (as one user message)
    #[arg(long)]
    pub chatml: bool,
    /// Ask the template to disable reasoning (where it supports it)
    #[arg(long = "no-think")]
    pub no_think: bool,
    /// Sampling temperature; 0 = greedy (deterministic)
    #[arg(long, default_value_t = 0.0)]
    pub temp: f32,
    /// Top-k cutoff when sampling
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Top-p cutoff when sampling
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p cutoff when sampling: keep tokens at least this times as likely as the most
    /// likely one (at temperature 1); 0 = off
    #[arg(long = "min-p", default_value_t = 0.0, value_parser = crate::conventions::parse_unit)]
    pub min_p: f32,
    /// Divide the logit of a token seen in the last --repeat-last-n tokens by this (multiply
    /// a negative one); 1 = off. As llama.cpp's; also applies to greedy decoding
    #[arg(long = "repeat-penalty", default_value_t = 1.0, value_parser = crate::conventions::parse_penalty_factor)]
    pub repeat_penalty: f32,
    /// How many recent tokens (the prompt's tail, then the answer) the penalties look at
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Subtract this from the logit of every token seen in the last --repeat-last-n tokens;
    /// 0 = off
    #[arg(long = "presence-penalty", default_value_t = 0.0, allow_negative_numbers = true, value_parser = crate::conventions::parse_additive_penalty)]
    pub presence_penalty: f32,
    /// Subtract this times its count there from a token's logit; 0 = off
    #[arg(long = "frequency-penalty", default_value_t = 0.0, allow_negative_numbers = true, value_parser = crate::conventions::parse_additive_penalty)]
    pub frequency_penalty: f32,
    /// Sampling seed (reproducible per seed); -1 = a random seed, drawn once and reported on
    /// stderr and in the --csv preamble
    #[arg(long, default_value = "-1", value_parser = crate::conventions::parse_seed, allow_negative_numbers = true)]
    pub seed: u64,
    /// Write the logits of every prompt position and generated step (raw little-endian f32,
    /// one row of n_vocab per position) plus PATH.json naming the token ids and each
    /// position's smallest router margin (how close its routing came to a tie)
    #[arg(long = "logits-out", value_name = "PATH")]
    pub logits_out: Option<PathBuf>,
    /// Keep the model loaded and serve requests: one JSON object per line on stdin
    /// (generate, decide, cancel, close; EOF = close), BMOE_* replies on stdout, the expert
    /// cache warm across turns (see docs/telemetry.md, "Session mode")
    #[arg(long)]
    pub session: bool,
    /// Diagnose NaN: check every layer's intermediates (inp_embd, ffn_inp, ffn_norm,
    /// ffn_moe_logits, l_out) and stop at the first that holds a NaN or infinity, naming the
    /// layer, the tensor and the position. Logits are always checked; this finds where it began
    #[arg(long = "check-finite")]
    pub check_finite: bool,
    /// Check every streamed expert's bytes against MODEL.bmoe-sums (written once by
    /// `bmoe-cli checksum MODEL`) before computing on them; a mismatch (a torn or stale read)
    /// stops the run as a failed read. Costs one hash per expert read
    #[arg(long = "verify-reads")]
    pub verify_reads: bool,
    /// Make the router follow a recorded route trace (route_trace v1: `bmoe-cli --route-trace`,
    /// `bmoe-sim convert`, or ../shared/traces): the n-th token computed routes to the trace's
    /// n-th token's experts, layer by layer, with its weights (or, where the trace has none,
    /// the router's own over those ids, renormalised), while every expert is really read and
    /// computed. For measuring streaming on real routing with a synthetic model of the
    /// recorded model's shape (`gen --preset deepseek-v2-lite-shape`). The trace's MoE layers,
    /// experts and top-k must match the model's; the run stops where the trace ends. The
    /// output text is not the model's own: the preamble marks the run (`routing_from=`)
    #[arg(long = "routing-from", value_name = "TRACE")]
    pub routing_from: Option<PathBuf>,
    /// With --session: answer decide requests — prefix + suffix rendered as one user message
    /// (reasoning off), one prefill and no decode, and the log-probability of each choice's
    /// first token over the whole vocabulary (BMOE_DECIDE)
    #[arg(long)]
    pub decide: bool,
    /// With --decide: keep the sequence state after a decide's prefix and restore it when the
    /// next prefix renders equal to it or extends it, so only the rest is prefilled. auto = on
    /// (bmoe has no prefill device, the one case where auto means off)
    #[arg(long = "decide-prefix-cache", value_enum, value_name = "MODE")]
    pub decide_prefix_cache: Option<PrefixCacheMode>,
    /// Speculative decoding by prompt lookup: draft the continuation of the longest earlier
    /// match of the last tokens (prompt and output) and verify the whole group in one decode
    /// step. Output is the plain run's, greedy or sampled (docs/speculation.md); pays on text
    /// that repeats its context (code edits, quotes, lists), costs little where nothing matches
    #[arg(long, help_heading = "Speculation")]
    pub ngram: bool,
    /// Speculative decoding with the model's own MTP head (qwen35moe's block at n_layer): it
    /// drafts up to --draft tokens from the trunk's last hidden state, and one decode step
    /// verifies the group. Output is the plain run's, greedy or sampled (docs/speculation.md).
    /// A file without an MTP head is refused at load
    #[arg(long, help_heading = "Speculation", conflicts_with = "ngram")]
    pub mtp: bool,
    /// --mtp stops drafting at a token whose probability under the head is below F, 0-1
    #[arg(
        long = "mtp-p-min",
        value_name = "F",
        default_value_t = 0.0,
        help_heading = "Speculation"
    )]
    pub mtp_p_min: f32,
    /// Test hook (gates): write the MTP head's logits of every position it catches up on as
    /// f32 rows (row p: the head's prediction from token p and the trunk's hidden state of
    /// position p-1), the reference llama_parity.py mtp-logits computes
    #[arg(long = "mtp-logits-out", value_name = "FILE", hide = true)]
    pub mtp_logits_out: Option<PathBuf>,
    /// Tokens drafted per speculative step, 1-8
    #[arg(
        long = "draft",
        visible_alias = "spec-draft-max",
        value_name = "N",
        default_value_t = 3,
        help_heading = "Speculation"
    )]
    pub draft: u32,
    /// --ngram drafts only after a match of at least N trailing tokens, 1 to --ngram-max-match
    #[arg(
        long = "ngram-min-match",
        value_name = "N",
        default_value_t = 3,
        help_heading = "Speculation"
    )]
    pub ngram_min_match: u32,
    /// Longest suffix --ngram matches, 1-64
    #[arg(
        long = "ngram-max-match",
        value_name = "N",
        default_value_t = 12,
        help_heading = "Speculation"
    )]
    pub ngram_max_match: u32,
    /// Write a `compute_trace v1` file: one row per op of every step (norms, attention, router,
    /// each routed expert, the head, and WAIT: the core's time between two ops, waiting on
    /// expert reads), with the major faults of each. A diagnostic: a barrier per op, so a
    /// traced run is not a benchmark run; `scripts/decode-analyze.py compute PATH` reads it
    #[arg(
        long = "compute-trace",
        value_name = "PATH",
        conflicts_with = "compute_trace_layers"
    )]
    pub compute_trace: Option<PathBuf>,
    /// Write a `compute_trace v1` file with one row per layer segment (`pre`, `blk.<il>`,
    /// `post`): ~n_layer clock reads per step, close to an untraced run's speed
    #[arg(long = "compute-trace-layers", value_name = "PATH")]
    pub compute_trace_layers: Option<PathBuf>,
    /// Test hook (benchmarks, gates): draft the tokens a recorded run generated next (FILE: its
    /// --logits-out JSON) wherever the token just chosen is the recorded one at its index,
    /// --draft at a time, instead of by prompt lookup; a repeat of that run accepts every
    /// draft: the ceiling of speculation. Implies --ngram's reporting
    #[arg(long = "draft-replay", value_name = "FILE", hide = true)]
    pub draft_replay: Option<PathBuf>,
    /// Print the architectures this build runs and exit
    #[arg(long = "list-archs")]
    pub list_archs: bool,
    /// Test hook: spoil the Nth flash read (0-based) with an injected fault, `eio:N` or
    /// `short:N`, to check that a failed read stops the run loudly. Not for normal use.
    #[arg(long = "inject-read-fault", value_name = "KIND:N", hide = true)]
    pub inject_read_fault: Option<String>,
    #[command(flatten)]
    pub stream: bmoe_flags::StreamArgs,
    #[command(flatten)]
    pub telemetry: bmoe_flags::TelemetryArgs,
}

/// `--decide-prefix-cache`.
#[derive(clap::ValueEnum, Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum PrefixCacheMode {
    /// On (bmoe has no prefill device).
    #[default]
    Auto,
    On,
    Off,
}

/// `bmoe-cli serve` flags: the engine's run flags plus the server's own.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to bind. Anything but a loopback address exposes the model to the network
    /// (a warning is printed; use --api-key)
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the chosen one is printed)
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health
    #[arg(
        long = "api-key",
        env = "BMOE_API_KEY",
        value_name = "KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
    /// Requests that may wait for the engine while one generates; more are answered 503
    /// with Retry-After
    #[arg(long, default_value_t = 8)]
    pub queue: usize,
    /// Largest request body accepted, KiB (413 past it)
    #[arg(long = "body-limit-kib", default_value_t = 4096)]
    pub body_limit_kib: usize,
    /// Seconds a request body may take to arrive (408 past it)
    #[arg(long = "read-timeout", default_value_t = 10.0, value_name = "SECONDS")]
    pub read_timeout: f64,
    /// Seconds a streaming client may leave the next chunk unread before its generation is
    /// cancelled (the engine serves one request at a time)
    #[arg(
        long = "client-timeout",
        default_value_t = 30.0,
        value_name = "SECONDS"
    )]
    pub client_timeout: f64,
    /// The model name /v1/models lists and responses carry [default: the model file's stem]
    #[arg(long, value_name = "NAME")]
    pub alias: Option<String>,
    /// Let web pages from this origin call the server (CORS: preflights answered,
    /// Access-Control-Allow-Origin sent); repeat for several, `*` for any. Off by default:
    /// a browser page from elsewhere cannot read the answers
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
    /// Do not print one line per request (peer, method, path, status, time to the response's
    /// head) on stderr
    #[arg(long = "no-access-log")]
    pub no_access_log: bool,
    /// Do not serve the web chat page at `/`
    #[arg(long = "no-webui")]
    pub no_webui: bool,
    /// Requests decoded together (slots, `-np` as llama-server): each running request feeds
    /// one row of a shared decode step, so the dense weights and each layer's union of
    /// experts are read once per step for all of them. The context (-c) is split between the
    /// slots, as llama-server does. 1: one request at a time (with --ngram/--mtp drafting,
    /// and the per-token telemetry files, which a shared step does not write)
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub parallel: u32,
    #[command(flatten)]
    pub run: RunArgs,
}

/// `bmoe-cli chat` flags: the engine's run flags plus the chat's own.
#[derive(Args, Debug, Clone)]
pub struct ChatArgs {
    /// No colours or dimming, even on a terminal (also: the NO_COLOR environment variable)
    #[arg(long)]
    pub plain: bool,
    #[command(flatten)]
    pub run: RunArgs,
}

impl RunArgs {
    /// The sampling flags, seeded with `seed`.
    pub fn sampler_config(&self, seed: u64) -> crate::sample::SamplerConfig {
        crate::sample::SamplerConfig {
            temp: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed,
            penalties: crate::sample::Penalties {
                repeat: self.repeat_penalty,
                frequency: self.frequency_penalty,
                presence: self.presence_penalty,
                last_n: self.repeat_last_n,
            },
            logit_bias: Vec::new(),
        }
    }

    /// `--compute-trace` or `--compute-trace-layers`: the granularity and the path.
    pub fn compute_trace(&self) -> Option<(crate::optrace::Granularity, &Path)> {
        use crate::optrace::Granularity;
        match (&self.compute_trace, &self.compute_trace_layers) {
            (Some(p), _) => Some((Granularity::Op, p)),
            (None, Some(p)) => Some((Granularity::Layers, p)),
            (None, None) => None,
        }
    }

    /// Flags that only mean something together: `--decide` needs `--session`, and
    /// `--decide-prefix-cache` needs `--decide`.
    pub fn check_modes(&self) -> Result<()> {
        if self.decide && !self.session {
            return Err(anyhow!(
                "config error: --decide needs --session (decide requests arrive on a session's stdin)"
            ));
        }
        if (self.ngram || self.draft_replay.is_some()) && self.routing_from.is_some() {
            return Err(anyhow!(
                "config error: --routing-from gives the n-th token computed the trace's n-th routing, and --ngram computes drafts a verify step may reject; run one without the other"
            ));
        }
        if self.ngram && self.logits_out.is_some() {
            return Err(anyhow!(
                "config error: --logits-out writes one row per fed position, and --ngram feeds drafts a verify step may reject; run one without the other"
            ));
        }
        if self.mtp && (self.logits_out.is_some() || self.routing_from.is_some()) {
            return Err(anyhow!(
                "config error: --mtp feeds drafts a verify step may reject; --logits-out and --routing-from need one fed position per token: run one without the other"
            ));
        }
        if self.mtp_logits_out.is_some() && !self.mtp {
            return Err(anyhow!("config error: --mtp-logits-out needs --mtp"));
        }
        if self.decide_prefix_cache.is_some() && !self.decide {
            return Err(anyhow!(
                "config error: --decide-prefix-cache needs --decide"
            ));
        }
        Ok(())
    }

    /// Whether decides keep their prefix state (`--decide-prefix-cache`, auto = on).
    pub fn decide_keeps_prefix(&self) -> bool {
        self.decide_prefix_cache.unwrap_or_default() != PrefixCacheMode::Off
    }
}

impl Cli {
    /// Parse a command line the way the binary does (llama.cpp's `-sys` accepted).
    pub fn parse_argv<I: IntoIterator<Item = S>, S: Into<std::ffi::OsString>>(
        argv: I,
    ) -> Result<Cli, clap::Error> {
        let (argv, notes) = crate::conventions::rewrite_llama_flags_noting(
            argv.into_iter().map(Into::into).collect(),
        );
        for n in notes {
            eprintln!("bmoe: note: {n}");
        }
        <Cli as Parser>::try_parse_from(argv)
    }

    /// The run flags of a command line (tests).
    pub fn parse_run(argv: &[&str]) -> Result<RunArgs, clap::Error> {
        Ok(Cli::parse_argv(argv.iter().copied())?.run)
    }
}

/// One per big core on a big.LITTLE machine, else `min(cores, 4)` (`crate::cpus`).
fn default_threads() -> u32 {
    crate::cpus::default_threads()
}

#[derive(Args, Debug)]
pub struct GenArgs {
    /// Architecture of the file (`general.architecture`); default: the preset's (qwen3moe for
    /// tiny, tiny-odd and small). `bmoe-cli --list-archs` lists each with its presets
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(gen::GenArch::NAMES))]
    pub arch: Option<String>,
    /// Preset shape: tiny, tiny-odd (tests), small (benchmarks), or a full-size shape of one
    /// architecture: qwen3-30b-a3b-shape (qwen3moe), qwen1.5-moe-a2.7b-shape (qwen2moe),
    /// gemma-4-26b-a4b-shape (gemma4), gpt-oss-20b-shape and gpt-oss-120b-shape (gpt-oss),
    /// lfm2-8b-a1b-shape (lfm2moe), qwen3.6-35b-a3b-shape (qwen35moe), deepseek-v2-lite-shape
    /// and moonlight-16b-a3b-shape (deepseek2), mixtral-8x7b-shape (llama with experts),
    /// deepseek-v4-flash-shape (deepseek4); the
    /// first of those and the Mixtral shape match real traces in ../shared/traces, for
    /// --routing-from; deepseek-v2-lite-qwen2moe-stand-in and mixtral-8x7b-qwen3moe-stand-in are
    /// the files that stood in for them before
    #[arg(long, default_value = "tiny", value_parser = clap::builder::PossibleValuesParser::new(Preset::NAMES))]
    pub preset: String,
    /// Seed of the weights
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output file
    #[arg(long, short = 'o', value_name = "FILE")]
    pub out: PathBuf,
    /// Weight types: a llama-quantize preset, written with its per-tensor choices (which
    /// tensors and layers get more bits, and the 32-value stand-ins for rows not a multiple of
    /// 256): f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k_s, q3_k_m, q3_k_l,
    /// q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k, iq4_nl, iq4_xs, mxfp4_moe; or q4_k, q5_k, q3_k,
    /// mxfp4 for that type everywhere (llama-quantize --pure). Default: the preset's
    /// (tiny: F32 dense + Q8_0 experts; small, qwen3-30b-a3b-shape: q4_k_m; the gpt-oss
    /// shapes: mxfp4_moe)
    #[arg(long = "type", value_name = "T")]
    pub ty: Option<String>,
    /// Override the expert weights' type only (any type --type takes as "everywhere", or a
    /// preset's main type); rows it cannot hold fall back as llama-quantize does
    #[arg(long = "experts-type", value_name = "T")]
    pub experts_type: Option<String>,
    #[arg(long)]
    pub layers: Option<u32>,
    #[arg(long)]
    pub experts: Option<u32>,
    /// Experts used per token
    #[arg(long = "top-k")]
    pub top_k: Option<u32>,
    #[arg(long = "d-model")]
    pub d_model: Option<u32>,
    #[arg(long = "expert-ffn")]
    pub expert_ffn: Option<u32>,
    /// The shared expert's FFN width (qwen2moe), or the dense MLP's beside the experts
    /// (gemma4)
    #[arg(long = "shared-ffn")]
    pub shared_ffn: Option<u32>,
    /// The FFN width of the leading dense layers (deepseek2, lfm2moe)
    #[arg(long = "dense-ffn")]
    pub dense_ffn: Option<u32>,
    /// The query LoRA's rank (deepseek2, 0 = one attn_q projection; deepseek4)
    #[arg(long = "q-lora-rank")]
    pub q_lora_rank: Option<u32>,
    #[arg(long)]
    pub heads: Option<u32>,
    #[arg(long = "kv-heads")]
    pub kv_heads: Option<u32>,
    #[arg(long = "head-dim")]
    pub head_dim: Option<u32>,
    /// Trained context length recorded in the file
    #[arg(long = "ctx")]
    pub ctx: Option<u32>,
    /// Tie the output head to the token embedding (no output.weight)
    #[arg(long = "tie-output")]
    pub tie_output: bool,
    /// Routing realism: router mix of context (slowly drifting) vs token identity, in [0,1].
    /// Default per preset, calibrated to ~35-40% previous-token reuse on English text in every
    /// layer (tiny 0.65, small and qwen3-30b-a3b-shape 0.7; gemma4 files 0.2; see
    /// docs/models.md); 0 = random routing
    #[arg(long = "routing-context")]
    pub routing_context: Option<f32>,
    /// Router logit gain (higher = sharper routing)
    #[arg(long = "router-gain", default_value_t = 6.0)]
    pub router_gain: f32,
    /// Layer i's router reads the context at 1/(i+1)^P of its gain, offsetting the context's
    /// growth with depth so reuse stays flat over the layers; 0 = one gain for every layer
    /// (deep layers then route on context alone), in [0, 4]. Default 0.75; gemma4 files 0
    /// (gemma4 normalises every sub-layer's output, so its context does not grow with depth)
    #[arg(long = "routing-depth", value_name = "P")]
    pub routing_depth: Option<f32>,
    /// q/k norm weight: small = near-uniform attention (a running context mean)
    #[arg(long = "attn-sharpness", default_value_t = 0.5)]
    pub attn_sharpness: f32,
    /// Tokenizer vocabulary: a GGUF file with tokenizer.* keys, or a tokenizer.json (default: built in)
    #[arg(long, value_name = "FILE")]
    pub vocab: Option<PathBuf>,
    /// Chat template file (jinja) replacing the vocabulary's
    #[arg(long, value_name = "FILE")]
    pub template: Option<PathBuf>,
    /// Generator threads
    #[arg(long, default_value_t = default_threads())]
    pub threads: u32,
    /// Never show a progress bar
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The GGUF file
    pub model: PathBuf,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
    /// Also write the model's expert layout as a route-trace preamble with no rows (each MoE
    /// layer's expert bytes, dense bytes and projection extents, as `--route-trace` states
    /// them): what `bmoe-sim whatif --model` re-prices a recorded routing with, for a model
    /// that was never run
    #[arg(long, value_name = "PATH")]
    pub layout_out: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Compute threads (the benchmark runs 1 and this many)
    #[arg(short = 't', long = "threads", default_value_t = default_threads())]
    pub threads: u32,
    /// Matrix size per format in MiB (should exceed the last-level cache)
    #[arg(long = "size-mib", default_value_t = 256)]
    pub size_mib: usize,
    /// Only the memory read and copy bandwidth (the floor a decode is judged against: active
    /// weight bytes ÷ read bandwidth), not the kernels; one line, in seconds instead of minutes
    #[arg(long = "memory-only", conflicts_with = "io_file")]
    pub memory_only: bool,
    /// Instead of the kernels: raw read bandwidth of this file (the ceiling streaming is
    /// judged against), with the request size and lane counts below
    #[arg(long = "io-file", value_name = "PATH")]
    pub io_file: Option<PathBuf>,
    /// Request size for --io-file, KiB
    #[arg(long = "io-request-kib", default_value_t = 1024)]
    pub io_request_kib: u64,
    /// Lane counts for --io-file, comma separated
    #[arg(long = "io-lanes", default_value = "1,2,4")]
    pub io_lanes: String,
    /// Bytes read per setting for --io-file, MiB
    #[arg(long = "io-total-mib", default_value_t = 1024)]
    pub io_total_mib: u64,
    /// Buffered reads instead of O_DIRECT for --io-file
    #[arg(long = "no-odirect")]
    pub no_odirect: bool,
    /// For --io-file: read into base pages instead of transparent huge pages (the engine's
    /// `--no-hugepages`); by default the benchmark reads into the memory the engine reads
    /// experts into, so the two are compared like with like
    #[arg(long = "no-hugepages")]
    pub no_hugepages: bool,
    /// For --io-file: read at random request-aligned offsets (the pattern of expert reads)
    /// instead of in file order, where read-ahead helps
    #[arg(long)]
    pub io_random: bool,
    /// For --io-random: which offsets (a seed). A virtual disk's host may cache what an
    /// earlier run read, so give each repeat a new seed to measure the device, not that cache
    #[arg(long = "io-seed", default_value_t = 0)]
    pub io_seed: u64,
    /// For --io-file: read in bursts of this many requests (all lanes released together, read
    /// i on lane i mod lanes) with the device idle --io-gap-ms between bursts, at random
    /// offsets from --io-seed: the shape of a cached decode's misses. 0 = an unbroken stream
    #[arg(long = "io-burst", default_value_t = 0)]
    pub io_burst: u32,
    /// Idle time between bursts (--io-burst), ms
    #[arg(long = "io-gap-ms", default_value_t = 20.0)]
    pub io_gap_ms: f64,
    /// With --io-burst: requests come in runs of this many neighbours (a projection cut into
    /// one piece per lane by --read-split lanes)
    #[arg(long = "io-adjacent", default_value_t = 1)]
    pub io_adjacent: u32,
}

pub fn gen(a: GenArgs) -> Result<()> {
    let preset =
        Preset::from_name(&a.preset).ok_or_else(|| anyhow!("unknown preset {}", a.preset))?;
    let arch = match &a.arch {
        Some(n) => gen::GenArch::from_name(n)
            .ok_or_else(|| anyhow!("--arch {n}: gen writes {}", gen::GenArch::NAMES.join(", ")))?,
        None => preset.arch().unwrap_or(gen::GenArch::Qwen3Moe),
    };
    let mut shape = preset.shape_for(arch)?;
    macro_rules! ov {
        ($f:ident, $v:expr) => {
            if let Some(v) = $v {
                shape.$f = v;
            }
        };
    }
    ov!(n_layer, a.layers);
    ov!(n_expert, a.experts);
    ov!(n_expert_used, a.top_k);
    ov!(d_model, a.d_model);
    ov!(n_ff_exp, a.expert_ffn);
    ov!(n_ff_shexp, a.shared_ffn);
    ov!(n_head, a.heads);
    ov!(n_head_kv, a.kv_heads);
    ov!(head_dim, a.head_dim);
    ov!(n_ctx_train, a.ctx);
    if let Some(n) = a.dense_ffn {
        match (&mut shape.deepseek2, &mut shape.lfm2) {
            (Some(d), _) => d.n_ff_dense = n,
            (_, Some(l)) => l.n_ff_dense = n,
            _ => bail!(
                "--dense-ffn: {} has no leading dense layers (deepseek2 and lfm2moe have)",
                shape.arch.name()
            ),
        }
    }
    if let Some(n) = a.q_lora_rank {
        match (&mut shape.deepseek2, &mut shape.deepseek4) {
            (Some(d), _) => d.q_lora_rank = n,
            (_, Some(d)) => d.q_lora_rank = n,
            _ => bail!("--q-lora-rank: only deepseek2 and deepseek4 have a query LoRA"),
        }
    }
    shape.tie_output |= a.tie_output;
    let gemma = shape.gemma.is_some();
    let mut types = match &a.ty {
        Some(t) => TypeScheme::from_name(t)
            .ok_or_else(|| anyhow!("--type {t}: expected one of the {}", TypeScheme::NAMES))?,
        None => preset.default_types(),
    };
    if let Some(t) = &a.experts_type {
        let e = GgmlType::from_name(t)
            .filter(|t| crate::kernels::supports_quantize(*t))
            .or_else(|| gen::Ftype::from_name(t).map(|f| f.default_type()))
            .ok_or_else(|| {
                anyhow!(
                    "--experts-type {t}: expected a weight type the kernels take ({})",
                    crate::kernels::weight_types()
                        .iter()
                        .map(|t| t.name().to_lowercase())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
        types.experts = Some(e);
    }
    // `-o` over the vocabulary or template it reads would destroy that input.
    let inputs: Vec<crate::files::Named<'_>> = [("--vocab", &a.vocab), ("--template", &a.template)]
        .into_iter()
        .filter_map(|(flag, p)| p.as_deref().map(|p| crate::files::Named::new(flag, p)))
        .collect();
    crate::files::check_distinct(&inputs, &[crate::files::Named::new("--out", &a.out)])?;
    let mut vocab = match &a.vocab {
        None => crate::vocab::builtin_vocab().context("building the built-in vocabulary")?,
        Some(p) => crate::vocab::vocab_from_file(p)
            .with_context(|| format!("reading vocabulary {}", p.display()))?,
    };
    if let Some(t) = &a.template {
        let text = std::fs::read_to_string(t)
            .with_context(|| format!("reading chat template {}", t.display()))?;
        vocab.retain(|(k, _)| k != "tokenizer.chat_template");
        vocab.push((
            "tokenizer.chat_template".into(),
            crate::gguf::Value::String(text),
        ));
    }
    let opts = GenOptions {
        preset,
        shape,
        types,
        seed: a.seed,
        routing_context: a.routing_context.unwrap_or(if gemma {
            gen::GEMMA4_ROUTING_CONTEXT
        } else {
            preset.default_routing_context()
        }),
        router_gain: a.router_gain,
        routing_depth: a.routing_depth.unwrap_or(if gemma {
            0.0
        } else {
            gen::ROUTING_DEPTH_DEFAULT
        }),
        attn_sharpness: a.attn_sharpness,
        vocab,
        threads: a.threads.max(1) as usize,
    };
    // Checked here too so a bad option is not reported as a failure to write the file.
    opts.validate()?;
    let bar = if a.quiet {
        None
    } else {
        Some(indicatif::ProgressBar::new(0))
    };
    if let Some(b) = &bar {
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} gen {bytes}/{total_bytes} [{bar:30}] {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
    }
    let t0 = std::time::Instant::now();
    let rep = gen::generate(&opts, &a.out, |done, total| {
        if let Some(b) = &bar {
            b.set_length(total);
            b.set_position(done);
        }
    })
    .with_context(|| format!("writing {}", a.out.display()))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    // One line per (requested, stored) pair, as llama-quantize's fallbacks are per type.
    let mut groups: Vec<(GgmlType, GgmlType, Vec<&str>)> = Vec::new();
    for (t, want, got) in &rep.fallbacks {
        match groups.iter_mut().find(|g| g.0 == *want && g.1 == *got) {
            Some(g) => g.2.push(t),
            None => groups.push((*want, *got, vec![t])),
        }
    }
    for (want, got, names) in &groups {
        let shown = names.iter().take(3).copied().collect::<Vec<_>>().join(", ");
        let more = if names.len() > 3 {
            format!(" and {} more", names.len() - 3)
        } else {
            String::new()
        };
        eprintln!(
            "bmoe: note: {} tensor(s) with rows that are not whole {want} blocks stored as {got}, \
             as llama-quantize does: {shown}{more}",
            names.len()
        );
    }
    eprintln!(
        "bmoe: wrote {} ({:.1} MiB, {} tensors, vocab {}, preset {}, types {}) in {:.1} s",
        a.out.display(),
        rep.bytes as f64 / 1048576.0,
        rep.n_tensors,
        rep.n_vocab,
        preset.name(),
        opts.types.label(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `bmoe-cli checksum MODEL`: hash every expert projection into the sidecar.
pub fn checksum(a: ChecksumArgs) -> Result<()> {
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| crate::checksum::sidecar_path(&a.model));
    let file = std::sync::Arc::new(GgufFile::open(&a.model)?);
    let inputs: Vec<PathBuf> = file.shard_paths().iter().map(|p| p.to_path_buf()).collect();
    let named: Vec<crate::files::Named<'_>> = inputs
        .iter()
        .map(|p| crate::files::Named::new("MODEL", p))
        .collect();
    crate::files::check_distinct(&named, &[crate::files::Named::new("--out", &out)])?;
    // Mapped, not copied: only the expert tensors' places are needed.
    let model = crate::arch::load_model(file.clone(), crate::dense::DenseMode::Mmap, 1)?;
    let layout = crate::stream::layout_of(&model)?;
    let bar = (!a.quiet).then(|| {
        let b = indicatif::ProgressBar::new(layout.total_expert_bytes());
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} checksum {bytes}/{total_bytes} [{bar:30}] {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b
    });
    let t0 = std::time::Instant::now();
    let sums = crate::checksum::compute(&file, &layout, |done, _| {
        if let Some(b) = &bar {
            b.set_position(done);
        }
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    crate::checksum::write(&out, &file, &sums)
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "bmoe: wrote {} ({} expert projections, {:.1} MiB hashed in {:.1} s)",
        out.display(),
        layout
            .layers()
            .iter()
            .map(|l| l.n_expert as usize * l.projections.len())
            .sum::<usize>(),
        layout.total_expert_bytes() as f64 / 1048576.0,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Writes `text` to standard output. A reader that has gone (`bmoe-cli inspect M | head`)
/// ends the process quietly with status 0, as Unix tools stop when their pipe closes;
/// `println!` would panic there. Any other write error is returned.
pub fn stdout_text(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        r => Ok(r.context("writing to standard output")?),
    }
}

/// [`stdout_text`] of a formatted line.
macro_rules! say {
    ($($arg:tt)*) => {
        stdout_text(&format!("{}\n", format_args!($($arg)*)))
    };
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    if let Some(out) = &a.layout_out {
        write_layout(&a.model, out)?;
    }
    let f = GgufFile::open(&a.model)?;
    if a.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&crate::inspect::inspect_json(&f))?
        )?;
    } else {
        stdout_text(&crate::inspect::inspect(&f))?;
    }
    Ok(())
}

/// `inspect --layout-out`: the model's layout as the preamble of a route trace with no rows.
fn write_layout(model_path: &std::path::Path, out: &std::path::Path) -> Result<()> {
    use bmoe_core::telemetry::route_trace::{RoutePreamble, RouteTraceWriter, TraceLayer};
    let file = std::sync::Arc::new(GgufFile::open(model_path)?);
    let inputs: Vec<PathBuf> = file.shard_paths().iter().map(|p| p.to_path_buf()).collect();
    let named: Vec<crate::files::Named<'_>> = inputs
        .iter()
        .map(|p| crate::files::Named::new("MODEL", p))
        .collect();
    crate::files::check_distinct(&named, &[crate::files::Named::new("--layout-out", out)])?;
    // Mapped, not copied: only the tensors' places and sizes are needed.
    let model = crate::arch::load_model(file.clone(), crate::dense::DenseMode::Mmap, 1)?;
    let layout = crate::stream::layout_of(&model)?;
    let dims = model.dims();
    let pre = RoutePreamble {
        model: model_path.display().to_string(),
        arch: file.architecture().unwrap_or("").to_string(),
        n_layer: dims.n_layer as u32,
        n_expert: dims.n_expert as u32,
        n_expert_used: dims.n_expert_used as u32,
        gating: model.gating(),
        layers: TraceLayer::of_layout(&layout),
        notes: vec!["layout only (bmoe-cli inspect --layout-out): no routing rows".to_string()],
        extra: Vec::new(),
    };
    let f = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    RouteTraceWriter::new(std::io::BufWriter::new(f), &pre)
        .and_then(|w| w.finish())
        .and_then(|mut w| std::io::Write::flush(&mut w))
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "bmoe: wrote the layout of {} ({} MoE layers x {} experts, {:.1} MiB of experts) to {}",
        model_path.display(),
        layout.layers().len(),
        dims.n_expert,
        layout.total_expert_bytes() as f64 / 1048576.0,
        out.display()
    );
    Ok(())
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if let Some(path) = &a.io_file {
        if a.io_burst > 0 && !(a.io_gap_ms.is_finite() && a.io_gap_ms >= 0.0) {
            return Err(anyhow!(
                "--io-gap-ms: expected a non-negative number of milliseconds, got {}",
                a.io_gap_ms
            ));
        }
        say!(
            "raw {} {} reads of {} KiB into {} from {}",
            if a.no_odirect { "buffered" } else { "O_DIRECT" },
            if a.io_random || a.io_burst > 0 {
                format!("random-offset (seed {})", a.io_seed)
            } else {
                "sequential".to_string()
            },
            a.io_request_kib,
            if a.no_hugepages {
                "base pages"
            } else {
                "huge pages"
            },
            path.display()
        )?;
        if a.io_burst > 0 {
            say!(
                "in bursts of {} reads ({} adjacent), {} ms idle between bursts",
                a.io_burst,
                a.io_adjacent,
                a.io_gap_ms
            )?;
        }
        let io = crate::flash::RawIo {
            o_direct: !a.no_odirect,
            huge_pages: !a.no_hugepages,
        };
        for lanes in a.io_lanes.split(',') {
            let lanes: u32 = lanes
                .trim()
                .parse()
                .map_err(|_| anyhow!("--io-lanes: {lanes} is not a number"))?;
            if a.io_burst > 0 {
                let r = crate::flash::raw_burst_bench(
                    path,
                    a.io_request_kib * 1024,
                    lanes,
                    io,
                    a.io_total_mib << 20,
                    a.io_seed,
                    crate::flash::BurstShape {
                        reads: a.io_burst,
                        adjacent: a.io_adjacent,
                        gap: std::time::Duration::from_secs_f64(a.io_gap_ms / 1e3),
                    },
                )?;
                say!(
                    "  {lanes} lanes: {:.0} MiB/s (mean read {:.2} ms, {} bursts)",
                    r.mib_s,
                    r.mean_read_ms,
                    r.bursts
                )?;
                continue;
            }
            let mib_s = crate::flash::raw_read_bench(
                path,
                a.io_request_kib * 1024,
                lanes,
                io,
                a.io_total_mib << 20,
                a.io_random.then_some(a.io_seed),
            )?;
            say!("  {lanes} lanes: {mib_s:.0} MiB/s")?;
        }
        return Ok(());
    }
    if a.memory_only {
        let (read, copy) =
            crate::kernels::bench::memory_only(a.threads.max(1) as usize, a.size_mib);
        say!(
            "memory: read {read:.1} GB/s, copy {copy:.1} GB/s (read + written), {} thread(s), {} MiB",
            a.threads.max(1),
            a.size_mib.max(1)
        )?;
        return Ok(());
    }
    let rep = crate::kernels::bench::run_bench(a.threads.max(1) as usize, a.size_mib);
    say!("{rep}")?;
    Ok(())
}
