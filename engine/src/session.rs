//! `bmoe-cli --session`: the model loaded once and kept warm — weights, KV and expert cache —
//! driven by one JSON request per line on stdin and answered on stdout with the contract's
//! `BMOE_*` lines (`seeds/telemetry.md`, "Session mode"): `BMOE_READY` once after the load,
//! then per `generate` a `BMOE_BEGIN`, the per-token `BMOE_LOAD` / `BMOE_PROGRESS` lines and a
//! `BMOE_DONE`; every rejected request a `BMOE_ERROR` with `fatal:false`, and the session goes
//! on. Stdout carries nothing else.
//!
//! Requests are read on their own thread while a generation runs, so `cancel` stops it at the
//! next token boundary (the core loop's `CancelFlag`), and requests that arrive meanwhile wait
//! in order (at most `MAX_QUEUED`; one more is answered with `BMOE_ERROR`); `cancel` with an
//! `id` stops that request, running or still queued (a queued one is answered `cancelled:true`
//! with nothing generated). Each turn is one `Conversation::run_with` (the same conversation
//! `serve` and `chat` run on: one `bmoe_core::Session::generate`), so `--csv`, `--route-trace`
//! and `--io-trace` span the session (the preamble once, `turn` counting turns). The engine owns
//! the conversation: `clear_kv:true` starts a new chat, `clear_kv:false` continues it — the
//! whole history is rendered again with the model's template and only the tokens past what the
//! KV already holds are prefilled (without `--chatml`, the new prompt's tokens are appended). A
//! cancelled turn is rolled back: the KV to where the turn started, the user message dropped.
//! `think:false` is honoured as the model's template allows (`chat::ChatFormat`).
//!
//! With `--decide`, a `decide` is answered by `BMOE_BEGIN` and one `BMOE_DECIDE`: prefix and
//! suffix rendered as one user message with reasoning off, one prefill and no decode
//! (`bmoe_core::Session::decide`); the state after the prefix is kept and restored for the next
//! decide whose prefix renders equal to it or extends it (`--decide-prefix-cache`), and a
//! `generate` drops it. `close` and EOF end the session once every request queued before them
//! has been served: `bmoe-cli --session < requests.jsonl` runs the file.

use crate::chat::{ChatFormat, Message, ThinkCtl};
use crate::cli::RunArgs;
use crate::converse::{
    common_prefix, type_name, Conversation, Prepared, SessionOptions, TurnIo, TurnOptions,
};
use crate::run::sampler;
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Result};
use bmoe_core::telemetry::progress::ThinkControl;
use bmoe_core::telemetry::progress::{
    write_begin, write_decide, write_done, write_error, write_ready, Ready,
};
use bmoe_core::{CancelFlag, DecideRejected, StopReason};
use serde_json::Value;
use std::io::{self, BufRead, Write};
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The listener of a session's turn: nobody (the `BMOE_*` lines carry the text).
struct Silent;

impl crate::converse::Listener for Silent {
    fn delta(&mut self, _reasoning: &str, _content: &str) -> bool {
        true
    }
}

/// The longest request line read; a longer one is answered with `BMOE_ERROR` and skipped.
/// Far above any prompt a context holds (a token is several bytes).
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

/// A `generate` request. Absent optional fields default to the process's flags (`-n`,
/// `--no-think`) and to `clear_kv: true`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerateRequest {
    pub id: i64,
    pub prompt: String,
    pub n_predict: Option<u32>,
    pub think: Option<bool>,
    pub clear_kv: Option<bool>,
    /// `--ngram` for this turn (default: the session's flag).
    pub ngram: Option<bool>,
    /// `--mtp` for this turn (default: the session's flag; true needs a session started with
    /// `--mtp`).
    pub mtp: Option<bool>,
}

/// A `decide` request (answered only by a session opened with `--decide`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecideRequest {
    pub id: i64,
    pub prefix: String,
    pub suffix: String,
    pub choices: Vec<String>,
    pub reuse_prefix: Option<bool>,
}

/// One request line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Generate(GenerateRequest),
    Decide(DecideRequest),
    /// Stop the running request, or with an id the request of that id, running or queued.
    Cancel(Option<i64>),
    Close,
}

/// A request that cannot be served as sent: answered with `BMOE_ERROR` (`fatal:false`) naming
/// the problem and the request's id where it had one (0 otherwise).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct RequestError {
    pub id: i64,
    pub msg: String,
}

/// Parse one request line (without its newline). Never panics: every way a line can be wrong
/// — not UTF-8, not JSON, not an object, no or an unknown `cmd`, a missing or mistyped field —
/// is a `RequestError` that says which. Fields the protocol does not define are ignored, and a
/// `null` optional field counts as absent.
pub fn parse_request(line: &[u8]) -> Result<Request, RequestError> {
    let err = |id: i64, msg: String| RequestError { id, msg };
    let text = std::str::from_utf8(line).map_err(|e| {
        err(
            0,
            format!("the request is not valid UTF-8 (byte {})", e.valid_up_to()),
        )
    })?;
    let v: Value =
        serde_json::from_str(text).map_err(|e| err(0, format!("the request is not JSON: {e}")))?;
    let Value::Object(obj) = &v else {
        return Err(err(
            0,
            format!("a request is a JSON object; got {}", type_name(&v)),
        ));
    };
    let present = |k: &str| obj.get(k).filter(|v| !v.is_null());
    // The id first, so every later error can name it.
    let id = match present("id") {
        None => None,
        Some(Value::Number(n)) => match n.as_i64() {
            Some(i) => Some(i),
            None => return Err(err(0, format!("field id: expected an integer, got {n}"))),
        },
        Some(other) => {
            return Err(err(
                0,
                format!("field id: expected an integer, got {}", type_name(other)),
            ))
        }
    };
    let at = id.unwrap_or(0);
    let cmd = match present("cmd") {
        Some(Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(err(
                at,
                format!("field cmd: expected a string, got {}", type_name(other)),
            ))
        }
        None => {
            return Err(err(
                at,
                "missing field cmd (generate, decide, cancel or close)".to_string(),
            ))
        }
    };
    let need_id =
        |cmd: &str| id.ok_or_else(|| err(0, format!("{cmd}: missing field id (an integer)")));
    let string = |cmd: &str, k: &str| -> Result<String, RequestError> {
        match present(k) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(err(
                at,
                format!(
                    "{cmd}: field {k}: expected a string, got {}",
                    type_name(other)
                ),
            )),
            None => Err(err(at, format!("{cmd}: missing field {k} (a string)"))),
        }
    };
    let boolean = |cmd: &str, k: &str| -> Result<Option<bool>, RequestError> {
        match present(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(err(
                at,
                format!(
                    "{cmd}: field {k}: expected true or false, got {}",
                    type_name(other)
                ),
            )),
        }
    };
    match cmd {
        "generate" => {
            let id = need_id(cmd)?;
            let prompt = string(cmd, "prompt")?;
            let n_predict = match present("n_predict") {
                None => None,
                Some(Value::Number(n)) => match n.as_u64() {
                    Some(k) if (1..=u64::from(u32::MAX)).contains(&k) => Some(k as u32),
                    _ => {
                        return Err(err(
                            id,
                            format!("generate: field n_predict: expected an integer >= 1, got {n}"),
                        ))
                    }
                },
                Some(other) => {
                    return Err(err(
                        id,
                        format!(
                            "generate: field n_predict: expected an integer >= 1, got {}",
                            type_name(other)
                        ),
                    ))
                }
            };
            Ok(Request::Generate(GenerateRequest {
                id,
                prompt,
                n_predict,
                think: boolean(cmd, "think")?,
                clear_kv: boolean(cmd, "clear_kv")?,
                ngram: boolean(cmd, "ngram")?,
                mtp: boolean(cmd, "mtp")?,
            }))
        }
        "decide" => {
            let id = need_id(cmd)?;
            let choices = match present("choices") {
                Some(Value::Array(a)) => a
                    .iter()
                    .enumerate()
                    .map(|(i, c)| match c {
                        Value::String(s) => Ok(s.clone()),
                        other => Err(err(
                            id,
                            format!(
                                "decide: choices[{i}]: expected a string, got {}",
                                type_name(other)
                            ),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
                Some(other) => {
                    return Err(err(
                        id,
                        format!(
                            "decide: field choices: expected an array of strings, got {}",
                            type_name(other)
                        ),
                    ))
                }
                None => {
                    return Err(err(
                        id,
                        "decide: missing field choices (an array of strings)".to_string(),
                    ))
                }
            };
            Ok(Request::Decide(DecideRequest {
                id,
                prefix: string(cmd, "prefix")?,
                suffix: string(cmd, "suffix")?,
                choices,
                reuse_prefix: boolean(cmd, "reuse_prefix")?,
            }))
        }
        "cancel" => Ok(Request::Cancel(id)),
        "close" => Ok(Request::Close),
        other => Err(err(
            at,
            format!(
                "unknown cmd {}: expected generate, decide, cancel or close",
                serde_json::to_string(other).unwrap_or_default()
            ),
        )),
    }
}

/// One line from the request stream.
#[derive(Debug, PartialEq, Eq)]
pub enum LineRead {
    Line(Vec<u8>),
    /// A line past `max` bytes (its length), skipped to its newline.
    TooLong(usize),
    Eof,
}

/// Read one line of at most `max` bytes (newline and a trailing `\r` removed), never holding
/// more than `max` bytes of it: a longer line is consumed and reported as `TooLong`.
pub fn read_line(r: &mut dyn BufRead, max: usize) -> io::Result<LineRead> {
    let mut line = Vec::new();
    let mut len = 0usize;
    loop {
        let avail = match r.fill_buf() {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(if len == 0 {
                LineRead::Eof
            } else if len > max {
                LineRead::TooLong(len)
            } else {
                LineRead::Line(line)
            });
        }
        let (chunk, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (&avail[..i], true),
            None => (avail, false),
        };
        len += chunk.len();
        if len <= max {
            line.extend_from_slice(chunk);
        } else {
            line = Vec::new();
        }
        let used = chunk.len() + usize::from(done);
        r.consume(used);
        if done {
            if len > max {
                return Ok(LineRead::TooLong(len));
            }
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            return Ok(LineRead::Line(line));
        }
    }
}

/// Stdout, shared by the request reader and the generation: every reply is written whole,
/// under one lock, and flushed, so lines from the two threads never interleave.
#[derive(Clone)]
struct Replies(Arc<Mutex<Box<dyn Write + Send>>>);

impl Replies {
    fn line(&self, f: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> io::Result<()> {
        let mut buf = Vec::new();
        f(&mut buf)?;
        let mut w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        w.write_all(&buf)?;
        w.flush()
    }

    fn error(&self, id: i64, fatal: bool, msg: &str) -> io::Result<()> {
        self.line(|w| write_error(w, id, fatal, msg))
    }
}

/// The per-token lines of a turn: bytes gather until a newline, then every whole line goes
/// out under the lock.
struct LineOut {
    replies: Replies,
    buf: Vec<u8>,
}

impl Write for LineOut {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if let Some(end) = self.buf.iter().rposition(|&b| b == b'\n') {
            let rest = self.buf.split_off(end + 1);
            let whole = std::mem::replace(&mut self.buf, rest);
            let mut w = self.replies.0.lock().unwrap_or_else(|e| e.into_inner());
            w.write_all(&whole)?;
            w.flush()?;
        }
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What the request reader hands the generation.
enum Work {
    Generate(GenerateRequest),
    Decide(DecideRequest),
    Close,
    /// The request stream failed; the session ends with this error.
    Failed(String),
}

/// Requests that may wait while one runs; one more is answered with `BMOE_ERROR`.
pub const MAX_QUEUED: usize = 16;

/// What the request reader and the generation side share: the request running, the ones
/// waiting (in order), and the waiting ones a `cancel` named.
#[derive(Debug, Default)]
struct Queue {
    running: Option<i64>,
    waiting: std::collections::VecDeque<i64>,
    cancelled: std::collections::HashSet<i64>,
}

type Busy = Arc<Mutex<Queue>>;

fn lock(busy: &Busy) -> std::sync::MutexGuard<'_, Queue> {
    busy.lock().unwrap_or_else(|e| e.into_inner())
}

/// `close` or EOF: the session ends once every request already queued has been served (the
/// running one is not stopped: `cancel` does that).
fn end_session(tx: &mpsc::Sender<Work>) {
    let _ = tx.send(Work::Close);
}

/// The request reader: parses each line, answers what it can at once (bad requests, a
/// `cancel` with nothing to stop, a request past a full queue), sets the cancel flag or marks
/// a queued request cancelled, and queues the rest in order. EOF and `close` end the session
/// after what is queued.
fn read_requests(
    mut input: Box<dyn BufRead + Send>,
    replies: Replies,
    busy: Busy,
    cancel: CancelFlag,
    tx: mpsc::Sender<Work>,
) {
    let outcome: io::Result<()> = (|| loop {
        let line = match read_line(&mut *input, MAX_REQUEST_BYTES)? {
            LineRead::Eof => {
                end_session(&tx);
                return Ok(());
            }
            LineRead::TooLong(n) => {
                replies.error(
                    0,
                    false,
                    &format!(
                        "a request line of {n} bytes is longer than the {MAX_REQUEST_BYTES} bytes read; it was skipped"
                    ),
                )?;
                continue;
            }
            LineRead::Line(l) => l,
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match parse_request(&line) {
            Err(e) => replies.error(e.id, false, &e.msg)?,
            Ok(Request::Cancel(target)) => {
                let mut q = lock(&busy);
                match target {
                    Some(t) if q.running == Some(t) => cancel.set(),
                    None if q.running.is_some() => cancel.set(),
                    Some(t) if q.waiting.contains(&t) => {
                        q.cancelled.insert(t);
                    }
                    Some(t) => {
                        drop(q);
                        replies.error(
                            t,
                            false,
                            &format!("cancel: request {t} is neither running nor queued"),
                        )?;
                    }
                    None => {
                        drop(q);
                        replies.error(0, false, "cancel: no request is running")?;
                    }
                }
            }
            Ok(Request::Close) => {
                end_session(&tx);
                return Ok(());
            }
            Ok(r @ (Request::Generate(_) | Request::Decide(_))) => {
                let (id, work) = match r {
                    Request::Generate(g) => (g.id, Work::Generate(g)),
                    Request::Decide(d) => (d.id, Work::Decide(d)),
                    _ => unreachable!("matched above"),
                };
                let mut q = lock(&busy);
                if q.waiting.len() >= MAX_QUEUED {
                    let running = q.running.map_or_else(|| "?".to_string(), |r| r.to_string());
                    drop(q);
                    replies.error(
                        id,
                        false,
                        &format!(
                            "request {id}: the queue is full ({MAX_QUEUED} requests wait behind request {running}): wait for a BMOE_DONE, or send cancel"
                        ),
                    )?;
                } else {
                    q.waiting.push_back(id);
                    drop(q);
                    if tx.send(work).is_err() {
                        return Ok(());
                    }
                }
            }
        }
    })();
    if let Err(e) = outcome {
        let _ = tx.send(Work::Failed(format!("reading requests: {e}")));
    }
}

fn think_control(c: ThinkCtl) -> ThinkControl {
    match c {
        ThinkCtl::Template => ThinkControl::Template,
        ThinkCtl::Prefill => ThinkControl::Prefill,
        ThinkCtl::None => ThinkControl::None,
    }
}

/// Between requests, hand the heap's free pages back to the system. A long-lived process
/// otherwise keeps the high-water mark of its largest request (a 25 KB prompt's tokenization
/// leaves thousands of small freed blocks behind) as resident memory for good; glibc's
/// `malloc_trim` releases free pages from the middle of every arena too, with one walk over
/// the arenas — nothing next to a request.
fn give_back_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own arenas; no pointer of ours is involved.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Exit code of a session that ended on a failed step (its output was not trustworthy).
const EXIT_FAILED: i32 = 3;

/// A decide request as the model sees it: prefix and suffix rendered as one user message
/// with reasoning off (the model's chat template, whether or not `--chatml`; the plain text
/// when the model has none), its tokens, where the prefix ends in them (`decide::prefix_split`
/// on the render cut where the prefix text ends) and each choice's first token.
struct DecideTokens {
    tokens: Vec<u32>,
    prefix_len: u32,
    choices: Vec<Option<u32>>,
}

fn decide_tokens(
    d: &DecideRequest,
    format: Option<&ChatFormat>,
    tok: &Tokenizer,
) -> Result<DecideTokens> {
    if d.prefix.is_empty() && d.suffix.is_empty() {
        bail!("decide: prefix and suffix are both empty");
    }
    let render = |content: String| -> Result<String> {
        Ok(match format {
            Some(f) => f.prompt(&[Message::new("user", content)], false)?,
            None => content,
        })
    };
    let special = format.is_some();
    let text = render(format!("{}{}", d.prefix, d.suffix))?;
    let tokens = tok.encode(&text, special)?;
    // Where the prefix ends in the render: the common start of this render and one whose
    // suffix differs at its first character.
    let other_suffix = if d.suffix.starts_with('\u{1}') {
        "\u{2}"
    } else {
        "\u{1}"
    };
    let other = render(format!("{}{other_suffix}", d.prefix))?;
    let mut cut = text
        .bytes()
        .zip(other.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let prefix_tokens = tok.encode(&text[..cut], special)?;
    let prefix_len = bmoe_core::decide::prefix_split(&prefix_tokens, &tokens);
    let choices = d
        .choices
        .iter()
        .map(|c| Ok(tok.encode_with(c, false, false)?.first().copied()))
        .collect::<Result<Vec<_>>>()?;
    Ok(DecideTokens {
        tokens,
        prefix_len,
        choices,
    })
}

/// A refused decide, in words that name the choices.
fn rejected(d: &DecideRequest, tok: &Tokenizer, r: &DecideRejected) -> String {
    let choice = |i: usize| serde_json::to_string(&d.choices[i]).unwrap_or_default();
    match r {
        DecideRejected::NoChoices => "decide: choices is empty: send at least one".to_string(),
        DecideRejected::EmptyChoice { index } => {
            format!("decide: choices[{index}] is empty: it has no first token to score")
        }
        DecideRejected::SharedFirstToken {
            first,
            second,
            token,
        } => format!(
            "decide: choices[{first}] {} and choices[{second}] {} both start with token {token} ({}), \
             so one prefill cannot tell them apart: make their first tokens differ",
            choice(*first),
            choice(*second),
            serde_json::to_string(&tok.decode(&[*token])).unwrap_or_default()
        ),
        DecideRejected::PastContext { tokens, n_ctx } => format!(
            "decide: the rendered prompt has {tokens} tokens, past n_ctx {n_ctx} (-c)"
        ),
        other => format!("decide: {other}"),
    }
}

/// Serve a session: load, `BMOE_READY`, then requests from `input` until `close` or EOF
/// (exit 0; a running request is stopped at its next token boundary and answered first), a
/// signal (`signal` set: the running turn stops at its next token boundary, a fatal
/// `BMOE_ERROR` says why, exit 130) or a failed step (fatal `BMOE_ERROR`, exit 3). Replies go
/// to `out`; diagnostics (load warnings) to `err`.
pub fn serve(
    args: &RunArgs,
    model_path: &Path,
    input: Box<dyn BufRead + Send>,
    out: Box<dyn Write + Send>,
    err: &mut dyn Write,
    signal: &CancelFlag,
) -> Result<i32> {
    let replies = Replies(Arc::new(Mutex::new(out)));
    let refuse = |msg: String| -> Result<i32> {
        replies.error(0, true, &msg)?;
        bail!("{msg}")
    };
    let mut args = args.clone();
    args.resolve_seed_reported(err)?;
    let args = &args;
    if let Err(e) = args.check_modes() {
        return refuse(format!("{e:#}"));
    }
    if !args.prompt.is_empty() || args.file.is_some() || args.system_prompt.is_some() {
        return refuse(
            "-p, -f and -sys have no meaning with --session: prompts arrive as generate requests on stdin".into(),
        );
    }
    if args.logits_out.is_some() {
        return refuse(
            "--logits-out is a one-shot diagnostic and cannot be combined with --session".into(),
        );
    }
    // The conversation the server and the chat run on: every output checked against the
    // model's files and each other and created before the model loads, the model, its chat
    // format, the session with this front end's cancel flags.
    let cancel = CancelFlag::new();
    let opened = Conversation::open_with(
        args,
        model_path,
        err,
        SessionOptions {
            cancel: Some(cancel.clone()),
            also_stop_on: Some(signal.clone()),
            prefix_cache: args.decide_keeps_prefix(),
        },
    );
    let mut conv = match opened {
        Ok(c) => c,
        Err(e) => {
            replies.error(0, true, &crate::run::error_text(&e))?;
            return Err(e);
        }
    };
    if conv.format().is_none() && args.chatml {
        return refuse(format!(
            "--chatml: {} has no tokenizer.chat_template (pass --chat-template-file FILE)",
            model_path.display()
        ));
    }
    // How think:false is honoured is decided from the model's own template, never its name;
    // with no template there is no way to ask for reasoning, so nothing to suppress.
    let think_ctl = conv
        .format()
        .map_or(ThinkCtl::Template, ChatFormat::think_ctl);
    // Generations use the template with --chatml; decides always do.
    let chat = args.chatml && conv.format().is_some();
    let tok = conv.shared_tokenizer();
    let n_ctx = conv.n_ctx();
    {
        let cfg = conv.config();
        replies.line(|w| {
            write_ready(
                w,
                &Ready {
                    load_s: conv.load_s(),
                    arch: &cfg.arch,
                    n_ctx: cfg.n_ctx,
                    think_ctl: think_control(think_ctl),
                    n_expert_used: cfg.n_expert_used,
                },
            )
        })?;
    }
    // One random stream for the session's turns, seeded once by --seed.
    let mut sampler = sampler(args);
    let mut history: Vec<Message> = Vec::new();

    let busy: Busy = Arc::new(Mutex::new(Queue::default()));
    let (tx, rx) = mpsc::channel();
    {
        let (replies, busy, cancel) = (replies.clone(), busy.clone(), cancel.clone());
        let input = input;
        std::thread::Builder::new()
            .name("bmoe-requests".to_string())
            .spawn(move || read_requests(input, replies, busy, cancel, tx))?;
    }
    // The generation side is idle again — before its last reply goes out, so a client that
    // sends its next request on seeing that reply finds the session free; a cancel that comes
    // later has nothing to stop.
    let idle = |busy: &Busy, cancel: &CancelFlag| {
        let mut q = lock(busy);
        cancel.clear();
        q.running = None;
        drop(q);
        give_back_freed_memory();
    };
    // A request taken from the queue: it runs now (true), unless a cancel named it while it
    // waited — then it is answered here as cancelled, with nothing generated (false).
    let start = |busy: &Busy, id: i64| -> io::Result<bool> {
        let mut q = lock(busy);
        if let Some(at) = q.waiting.iter().position(|&w| w == id) {
            q.waiting.remove(at);
        }
        if q.cancelled.remove(&id) {
            drop(q);
            let none = bmoe_core::telemetry::RunSummary::default();
            replies.line(|w| write_done(w, id, true, &none, "", ""))?;
            return Ok(false);
        }
        q.running = Some(id);
        Ok(true)
    };
    // A request refused before it started: idle again, and say why.
    let refuse_request = |id: i64, msg: &str| -> io::Result<()> {
        idle(&busy, &cancel);
        replies.error(id, false, msg)
    };
    // A step failed: streaming errors are sticky, and nothing after it can be trusted.
    let untrustworthy = |id: i64, e: &dyn std::fmt::Display| -> io::Result<i32> {
        replies.error(
            id,
            true,
            &format!("{e}; this session's output is no longer trustworthy"),
        )?;
        Ok(EXIT_FAILED)
    };
    // The loop itself failed (not a step: a write, a broken token source): say so, end.
    let broken = |id: i64, e: &dyn std::fmt::Display| -> io::Result<i32> {
        replies.error(id, true, &format!("{e}; the session ends"))?;
        Ok(1)
    };

    let code = loop {
        if signal.is_set() {
            replies.error(0, true, "interrupted by SIGINT/SIGTERM: the session ends")?;
            break crate::run::EXIT_INTERRUPTED;
        }
        let work = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(w) => w,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break 0,
        };
        let g = match work {
            Work::Close => break 0,
            Work::Failed(msg) => {
                replies.error(0, true, &msg)?;
                break 1;
            }
            Work::Decide(d) => {
                let id = d.id;
                if !start(&busy, id)? {
                    continue;
                }
                if !args.decide {
                    refuse_request(
                        id,
                        "decide: this session was opened without --decide (start it with --session --decide)",
                    )?;
                    continue;
                }
                let dt = match decide_tokens(&d, conv.format(), &tok) {
                    Ok(t) => t,
                    Err(e) => {
                        refuse_request(id, &format!("{e:#}"))?;
                        continue;
                    }
                };
                let choices = match bmoe_core::decide::check_choices(&dt.choices) {
                    Ok(c) => c,
                    Err(r) => {
                        refuse_request(id, &rejected(&d, &tok, &r))?;
                        continue;
                    }
                };
                let req = bmoe_core::DecideRequest {
                    tokens: &dt.tokens,
                    prefix_len: dt.prefix_len,
                    choices: &choices,
                    reuse_prefix: d.reuse_prefix.unwrap_or(true),
                    n_ctx: n_ctx as u32,
                };
                if let Err(r) = bmoe_core::decide::check(&req) {
                    refuse_request(id, &rejected(&d, &tok, &r))?;
                    continue;
                }
                replies.line(|w| write_begin(w, id))?;
                let outcome = match conv.decide(&req) {
                    Ok(Ok(o)) => o,
                    Ok(Err(r)) => {
                        // Checked above; a refusal here would be a bug, and nothing ran.
                        refuse_request(id, &rejected(&d, &tok, &r))?;
                        continue;
                    }
                    Err(e) => break broken(id, &e)?,
                };
                if let Some(e) = &outcome.error {
                    break untrustworthy(id, e)?;
                }
                idle(&busy, &cancel);
                replies.line(|w| write_decide(w, id, &outcome))?;
                continue;
            }
            Work::Generate(g) => g,
        };
        let id = g.id;
        if !start(&busy, id)? {
            continue;
        }
        let special = !args.no_parse_special;
        let think = g.think.unwrap_or(!args.no_think);
        let clear_kv = g.clear_kv.unwrap_or(true);
        let (ngram, mtp) = (g.ngram.unwrap_or(args.ngram), g.mtp.unwrap_or(args.mtp));
        if mtp && ngram {
            refuse_request(
                id,
                "generate: one draft source per request: \"ngram\": true needs \"mtp\": false in a --mtp session",
            )?;
            continue;
        }
        if !conv.set_head_drafts(mtp) {
            refuse_request(
                id,
                "generate: \"mtp\": true needs a session started with --mtp (the MTP head follows every step from the first)",
            )?;
            continue;
        }
        let speculation = ngram.then(|| conv.ngram_params());
        // The whole context the turn wants in the KV, and the text its generation follows.
        let wanted: Result<(Vec<u32>, String, Vec<Message>)> = (|| {
            if g.prompt.is_empty() {
                bail!("generate: the prompt is empty");
            }
            Ok(match conv.format().filter(|_| chat) {
                Some(f) => {
                    let mut msgs = if clear_kv {
                        Vec::new()
                    } else {
                        history.clone()
                    };
                    msgs.push(Message::new("user", g.prompt.clone()));
                    let text = f.prompt(&msgs, think)?;
                    (tok.encode(&text, true)?, text, msgs)
                }
                None if clear_kv => (tok.encode(&g.prompt, special)?, String::new(), Vec::new()),
                None => {
                    let mut all = conv.context().to_vec();
                    all.extend(tok.encode_with(&g.prompt, false, special)?);
                    (all, String::new(), Vec::new())
                }
            })
        })();
        let (wanted, text, msgs) = match wanted {
            Ok(w) => w,
            Err(e) => {
                refuse_request(id, &format!("{e:#}"))?;
                continue;
            }
        };
        // A chat turn's boundary, for a recurrent state that cannot roll back to it (raw
        // turns here only append).
        let boundary = match conv.format().filter(|_| chat) {
            Some(f) if conv.keeps_prefix_where_it_stands() => {
                crate::converse::chat_boundary(f, &tok, &msgs, &[], think, &wanted)
            }
            _ => None,
        };
        if wanted.is_empty() {
            refuse_request(id, "generate: the prompt is empty after tokenization")?;
            continue;
        }
        let n_predict = match g.n_predict {
            Some(n) if wanted.len() + n as usize > n_ctx => {
                refuse_request(
                    id,
                    &format!(
                        "generate: a context of {} tokens plus n_predict {n} exceeds n_ctx {n_ctx}",
                        wanted.len()
                    ),
                )?;
                continue;
            }
            Some(n) => n,
            // The process's -n (-1: what the context has room for).
            None => match crate::prompt::n_predict_for(args.n_predict, wanted.len(), n_ctx) {
                Ok(n) => n,
                Err(e) => {
                    refuse_request(id, &format!("generate: {e:#}"))?;
                    continue;
                }
            },
        };
        // Reuse what the KV already holds; at least the last token is fed again, for its
        // logits.
        let reuse = if clear_kv {
            0
        } else {
            let common = common_prefix(conv.context(), &wanted).min(wanted.len() - 1);
            conv.reusable_prefix(common as u32) as usize
        };
        if clear_kv {
            // A new chat starts here, whatever becomes of this turn.
            history.clear();
        }
        replies.line(|w| write_begin(w, id))?;
        let prepared = Prepared::new(wanted, text, chat, reuse, n_predict, boundary);
        let opts = TurnOptions {
            speculation,
            head_drafts: mtp,
            ..TurnOptions::default()
        };
        let mut progress = LineOut {
            replies: replies.clone(),
            buf: Vec::new(),
        };
        let io = TurnIo {
            progress: Some(&mut progress),
            sampler: Some(&mut sampler),
        };
        // The session's own lines carry the text (`BMOE_PROGRESS`, `BMOE_DONE`): nobody
        // listens to the deltas, and a cancel comes through the session's flag.
        let fin = match conv.run_with(&prepared, &opts, &mut Silent, io) {
            Ok(f) => f,
            Err(e) => break broken(id, &e)?,
        };
        let (reasoning, answer) = (fin.reasoning, fin.content);
        match fin.stop {
            StopReason::Failed => {
                let e = fin.error.unwrap_or_else(|| "a step failed".to_string());
                break untrustworthy(id, &e)?;
            }
            // Rolled back by the conversation: the KV to where this turn's prefill began; the
            // user message is not kept (`history` is as it was before the turn, or empty
            // after a new chat).
            StopReason::Cancelled => {}
            StopReason::Count | StopReason::EndOfGeneration => {
                if chat {
                    history = msgs;
                    history.push(
                        Message::new("assistant", answer.clone()).with_reasoning(reasoning.clone()),
                    );
                }
            }
        }
        let outcome = fin.summary;
        let cancelled = fin.stop == StopReason::Cancelled;
        idle(&busy, &cancel);
        replies.line(|w| write_done(w, id, cancelled, &outcome, &reasoning, &answer))?;
    };
    // What the device went through over the whole session (retried reads, injected faults),
    // as a one-shot run reports it.
    let notes = crate::run::device_notes(conv.engine());
    conv.finish()?;
    for n in notes {
        writeln!(err, "{n}")?;
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(line: &str) -> RequestError {
        parse_request(line.as_bytes()).expect_err(line)
    }

    #[test]
    fn requests_parse_with_their_defaults() {
        assert_eq!(
            parse_request(br#"{"cmd":"generate","id":7,"prompt":"hi\nthere"}"#).unwrap(),
            Request::Generate(GenerateRequest {
                id: 7,
                prompt: "hi\nthere".into(),
                n_predict: None,
                think: None,
                clear_kv: None,
                ngram: None,
                mtp: None,
            })
        );
        assert_eq!(
            parse_request(
                br#"{"cmd":"generate","id":-1,"prompt":"x","n_predict":3,"think":false,"clear_kv":false,"ngram":true,"extra":1}"#
            )
            .unwrap(),
            Request::Generate(GenerateRequest {
                id: -1,
                prompt: "x".into(),
                n_predict: Some(3),
                think: Some(false),
                clear_kv: Some(false),
                ngram: Some(true),
                mtp: None,
            })
        );
        assert_eq!(
            parse_request(br#"{"cmd":"generate","id":1,"prompt":"x","n_predict":null}"#).unwrap(),
            Request::Generate(GenerateRequest {
                id: 1,
                prompt: "x".into(),
                n_predict: None,
                think: None,
                clear_kv: None,
                ngram: None,
                mtp: None,
            })
        );
        assert_eq!(
            parse_request(br#"{"cmd":"cancel"}"#).unwrap(),
            Request::Cancel(None)
        );
        assert_eq!(
            parse_request(br#" {"cmd":"close"} "#).unwrap(),
            Request::Close
        );
        assert_eq!(
            parse_request(
                br#"{"cmd":"decide","id":2,"prefix":"p","suffix":"s","choices":["a","b"]}"#
            )
            .unwrap(),
            Request::Decide(DecideRequest {
                id: 2,
                prefix: "p".into(),
                suffix: "s".into(),
                choices: vec!["a".into(), "b".into()],
                reuse_prefix: None,
            })
        );
    }

    #[test]
    fn bad_requests_name_the_problem_and_the_id() {
        for (line, id, needle) in [
            ("not json", 0, "not JSON"),
            ("[1,2]", 0, "JSON object; got an array"),
            ("\"generate\"", 0, "got a string"),
            (r#"{"id":4}"#, 4, "missing field cmd"),
            (r#"{"cmd":"dance","id":5}"#, 5, "unknown cmd \"dance\""),
            (r#"{"cmd":7}"#, 0, "field cmd: expected a string"),
            (r#"{"cmd":"generate","prompt":"x"}"#, 0, "missing field id"),
            (
                r#"{"cmd":"generate","id":"3","prompt":"x"}"#,
                0,
                "field id: expected an integer",
            ),
            (
                r#"{"cmd":"generate","id":1.5,"prompt":"x"}"#,
                0,
                "field id: expected an integer",
            ),
            (r#"{"cmd":"generate","id":3}"#, 3, "missing field prompt"),
            (
                r#"{"cmd":"generate","id":3,"prompt":5}"#,
                3,
                "field prompt: expected a string",
            ),
            (
                r#"{"cmd":"generate","id":3,"prompt":"x","n_predict":0}"#,
                3,
                "n_predict",
            ),
            (
                r#"{"cmd":"generate","id":3,"prompt":"x","n_predict":-2}"#,
                3,
                "n_predict",
            ),
            (
                r#"{"cmd":"generate","id":3,"prompt":"x","n_predict":"8"}"#,
                3,
                "n_predict",
            ),
            (
                r#"{"cmd":"generate","id":3,"prompt":"x","think":"no"}"#,
                3,
                "field think",
            ),
            (
                r#"{"cmd":"generate","id":3,"prompt":"x","clear_kv":1}"#,
                3,
                "field clear_kv",
            ),
            (
                r#"{"cmd":"decide","id":6,"prefix":"p","suffix":"s"}"#,
                6,
                "missing field choices",
            ),
            (
                r#"{"cmd":"decide","id":6,"prefix":"p","suffix":"s","choices":[1]}"#,
                6,
                "choices[0]",
            ),
        ] {
            let e = err(line);
            assert_eq!(e.id, id, "{line}: {e}");
            assert!(e.msg.contains(needle), "{line}: {e}");
        }
        let e = parse_request(b"{\"cmd\":\"generate\",\"id\":1,\"prompt\":\"\xff\"}").unwrap_err();
        assert!(e.msg.contains("UTF-8"), "{e}");
    }

    #[test]
    fn lines_are_read_whole_and_long_ones_skipped() {
        let data = b"short\r\n0123456789ABCDEF\nlast".to_vec();
        let mut r = io::BufReader::with_capacity(4, &data[..]);
        assert_eq!(
            read_line(&mut r, 8).unwrap(),
            LineRead::Line(b"short".to_vec())
        );
        assert_eq!(read_line(&mut r, 8).unwrap(), LineRead::TooLong(16));
        assert_eq!(
            read_line(&mut r, 8).unwrap(),
            LineRead::Line(b"last".to_vec())
        );
        assert_eq!(read_line(&mut r, 8).unwrap(), LineRead::Eof);
    }

    #[test]
    fn common_prefix_counts_matching_tokens() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[1, 2], &[1, 2]), 2);
    }
}
