//! `bmoe-cli serve`: an OpenAI-compatible HTTP server over the one generation loop.
//!
//! One engine thread owns the model (`converse::Conversation`: the session, its KV and its
//! expert cache, warm across requests) and runs one generation at a time — or, with
//! `--parallel N`, up to N decoded together in shared steps (`lanes`) — taking jobs from a
//! channel. The HTTP side is axum on a single-threaded tokio runtime: it checks and parses each
//! request, admits it to a bounded queue (full: 503 with `Retry-After`), and relays the engine's
//! events back — a JSON response, or server-sent events ending in `data: [DONE]`. A client that
//! disconnects cancels its generation at the next token boundary (its response stream is
//! dropped, which sets the job's `gone` flag the engine checks after every step); a client that
//! reads too slowly is cancelled after `--client-timeout`.
//!
//! Safety on a workstation: binds 127.0.0.1 unless `--host` says otherwise (with a warning);
//! on a loopback bind a `Host` or `Origin` that is not loopback is refused (a web page cannot
//! reach the server through DNS rebinding); `--api-key` requires `Authorization: Bearer KEY`
//! on everything but `/health`; bodies past `--body-limit-kib` are refused (413) and bodies that
//! do not arrive within `--read-timeout` time out (408). See docs/serving.md.

pub mod api;
mod lanes;
pub mod metrics;

use crate::cli::{RunArgs, ServeArgs};
use crate::converse::{Conversation, Finished, Listener, Logprob, Prompt, Refused, TurnOptions};
use anyhow::{anyhow, bail, Context, Result};
use api::{ApiError, Common};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bmoe_core::{CancelFlag, StopReason};
use metrics::Metrics;
use rand::{RngCore, SeedableRng};
use serde_json::{json, Value};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Where a request came in, for the metrics' `endpoint` label.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
}

/// What the engine tells a waiting request.
enum Event {
    /// The turn was accepted and starts: its prompt's tokens and how many the KV reused.
    Started,
    /// Text of choice `index`, and the log-probabilities of the tokens generated since the
    /// last delta (with `logprobs`).
    Delta {
        index: u32,
        reasoning: String,
        content: String,
        logprobs: Vec<Logprob>,
    },
    /// Choice `index` finished.
    Choice(u32, Box<Finished>),
    /// Every choice finished.
    End,
    Error(ApiError),
}

/// What the HTTP side and the engine share about one job.
struct Watch {
    gone: AtomicBool,
    /// Tokens generated so far, and how many there were when the client was found gone.
    produced: AtomicU32,
    gone_at: AtomicU32,
}

impl Watch {
    fn new() -> Arc<Watch> {
        Arc::new(Watch {
            gone: AtomicBool::new(false),
            produced: AtomicU32::new(0),
            gone_at: AtomicU32::new(u32::MAX),
        })
    }
    fn mark_gone(&self) {
        let n = self.produced.load(Ordering::SeqCst);
        let _ = self
            .gone_at
            .compare_exchange(u32::MAX, n, Ordering::SeqCst, Ordering::SeqCst);
        self.gone.store(true, Ordering::SeqCst);
    }
}

/// Marks the job gone when the response is dropped before it was delivered whole.
struct GoneOnDrop {
    watch: Arc<Watch>,
    armed: bool,
}

impl Drop for GoneOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.watch.mark_gone();
        }
    }
}

/// A chat request's tools: what it offers and what it allows.
struct ToolRequest {
    tools: Vec<crate::tools::Tool>,
    choice: crate::tools::ToolChoice,
}

struct Job {
    id: u64,
    endpoint: Endpoint,
    prompt: Prompt,
    common: Common,
    tools: Option<ToolRequest>,
    events: mpsc::Sender<Event>,
    watch: Arc<Watch>,
}

struct AppState {
    jobs: Mutex<Option<std_mpsc::Sender<Job>>>,
    in_flight: Arc<AtomicUsize>,
    capacity: usize,
    ready: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    model_id: String,
    created: u64,
    api_key: Option<String>,
    loopback: bool,
    body_limit: usize,
    read_timeout: Duration,
    think_default: bool,
    next_id: AtomicU64,
    /// `--cors-origin`: pages (origins) that may call the server from a browser; `*` any.
    cors: Vec<String>,
    /// One line per request on stderr (off with `--no-access-log`).
    access_log: bool,
    /// Serve the web chat at `/` (off with `--no-webui`).
    web_ui: bool,
    /// What the engine thread shares once the model is loaded.
    loaded: Arc<std::sync::OnceLock<Served>>,
}

/// What the HTTP side needs of the loaded model: its tokenizer (`/tokenize`, `/detokenize`)
/// and the `/props` body.
struct Served {
    tok: Arc<crate::tokenizer::Tokenizer>,
    props: Value,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether a `Host` header names this machine's loopback (with any port).
fn loopback_host(h: &str) -> bool {
    let host = if let Some(rest) = h.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        h.rsplit_once(':').map_or(h, |(a, p)| {
            if p.chars().all(|c| c.is_ascii_digit()) {
                a
            } else {
                h
            }
        })
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Whether an `Origin` is a page served from this machine's loopback.
fn loopback_origin(o: &str) -> bool {
    let rest = o
        .strip_prefix("http://")
        .or_else(|| o.strip_prefix("https://"));
    rest.is_some_and(|r| !r.contains('/') && loopback_host(r))
}

/// The metrics label of a path (known endpoints only, so a scan cannot grow the label set).
fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/models" => "/v1/models",
        "/health" => "/health",
        "/metrics" => "/metrics",
        "/" => "/",
        "/tokenize" => "/tokenize",
        "/detokenize" => "/detokenize",
        "/props" => "/props",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        _ => "other",
    }
}

/// Constant-time equality, so a key cannot be guessed byte by byte from response times.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `--cors-origin` lets a page from `origin` call this server.
fn cors_allows(st: &AppState, origin: &str) -> bool {
    st.cors
        .iter()
        .any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
}

/// Every request passes here: CORS (a preflight is answered here), the loopback
/// `Host`/`Origin` check, the API key, the count, and one access-log line.
async fn gatekeeper(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let t0 = Instant::now();
    let label = endpoint_label(req.uri().path());
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let peer = req
        .extensions()
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
        .map_or_else(|| "-".to_string(), |c| c.0.ip().to_string());
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|o| o.to_str().ok())
        .filter(|o| cors_allows(&st, o))
        .map(str::to_string);
    let mut resp = if method == axum::http::Method::OPTIONS && origin.is_some() {
        // A CORS preflight from an allowed origin: what it may send.
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            header::HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            header::HeaderValue::from_static("authorization, content-type"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            header::HeaderValue::from_static("600"),
        );
        r
    } else {
        match admit(&st, &req) {
            Err(e) => e.into_response(),
            Ok(()) => next.run(req).await,
        }
    };
    if let Some(o) = origin.and_then(|o| header::HeaderValue::from_str(&o).ok()) {
        resp.headers_mut()
            .insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, o);
        resp.headers_mut()
            .insert(header::VARY, header::HeaderValue::from_static("Origin"));
    }
    st.metrics.request(label, resp.status().as_u16());
    if st.access_log {
        // Time to the response's head: a stream's body follows it.
        eprintln!(
            "bmoe: serve: {peer} \"{method} {path}\" {} {:.3} s",
            resp.status().as_u16(),
            t0.elapsed().as_secs_f64()
        );
    }
    resp
}

fn admit(st: &AppState, req: &Request) -> Result<(), ApiError> {
    let h = req.headers();
    if st.loopback {
        if let Some(host) = h.get(header::HOST) {
            let ok = host.to_str().is_ok_and(loopback_host);
            if !ok {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "permission_error",
                    format!(
                        "Host {:?} is not loopback: this server is bound to loopback and answers only requests addressed to localhost (restart it with --host to serve other names)",
                        host.to_str().unwrap_or("?")
                    ),
                ));
            }
        }
        if let Some(origin) = h.get(header::ORIGIN) {
            let allowed = origin
                .to_str()
                .is_ok_and(|o| loopback_origin(o) || cors_allows(st, o));
            if !allowed {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "permission_error",
                    format!(
                        "Origin {:?} is not a loopback page: requests from other sites are refused (--cors-origin allows one)",
                        origin.to_str().unwrap_or("?")
                    ),
                ));
            }
        }
    }
    if let Some(key) = &st.api_key {
        if req.uri().path() != "/health" && req.uri().path() != "/" {
            let given = h
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim);
            if !given.is_some_and(|g| same_key(g.as_bytes(), key.as_bytes())) {
                return Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "authentication_error",
                    if given.is_some() {
                        "invalid API key"
                    } else {
                        "missing API key: send Authorization: Bearer KEY"
                    },
                )
                .with_code("invalid_api_key"));
            }
        }
    }
    Ok(())
}

/// The body, at most `body_limit` bytes, within `read_timeout`.
async fn read_body(st: &AppState, req: Request) -> Result<axum::body::Bytes, ApiError> {
    let too_big = |n: Option<u64>| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            match n {
                Some(n) => format!(
                    "the request body of {n} bytes is larger than the limit of {} bytes (--body-limit-kib)",
                    st.body_limit
                ),
                None => format!(
                    "the request body is larger than the limit of {} bytes (--body-limit-kib)",
                    st.body_limit
                ),
            },
        )
    };
    if let Some(n) = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if n > st.body_limit as u64 {
            return Err(too_big(Some(n)));
        }
    }
    let body = req.into_body();
    match tokio::time::timeout(st.read_timeout, axum::body::to_bytes(body, st.body_limit)).await {
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body did not arrive within {:.1} s (--read-timeout)",
                st.read_timeout.as_secs_f64()
            ),
        )),
        Ok(Err(e)) => {
            let text = format!("{e}");
            let mut src: Option<&dyn std::error::Error> = Some(&e);
            let mut limit = false;
            while let Some(s) = src {
                limit |= s.to_string().contains("length limit");
                src = s.source();
            }
            if limit || text.contains("length limit") {
                Err(too_big(None))
            } else {
                Err(ApiError::bad_request(format!(
                    "reading the request body: {text}"
                )))
            }
        }
        Ok(Ok(b)) => Ok(b),
    }
}

async fn chat_completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let r = async {
        let body = read_body(&st, req).await?;
        let r = api::chat_request(&body)?;
        // A grammar constrains the answer from its first token: no reasoning span before it.
        let think = r.common.constraint.is_none() && r.think.unwrap_or(st.think_default);
        let tools = (!r.tools.is_empty()).then(|| ToolRequest {
            tools: r.tools,
            choice: r.tool_choice,
        });
        Ok::<_, ApiError>((
            Prompt::Chat {
                messages: r.messages,
                think,
                tools: r.tool_defs,
                effort: r.effort,
            },
            r.common,
            tools,
        ))
    }
    .await;
    match r {
        Ok((p, c, t)) => submit(st, Endpoint::Chat, p, c, t).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let r = async {
        let body = read_body(&st, req).await?;
        let r = api::completion_request(&body)?;
        Ok::<_, ApiError>((Prompt::Raw(r.prompt), r.common))
    }
    .await;
    match r {
        Ok((p, c)) => submit(st, Endpoint::Completion, p, c, None).await,
        Err(e) => e.into_response(),
    }
}

/// The `usage` object of a request's choices: the prompt counted once (as the first choice
/// prefilled it), the completions summed.
fn usage(choices: &[Finished]) -> Value {
    let first = choices.first();
    let prompt = first.map_or(0, |f| f.prompt_tokens);
    let completion: usize = choices.iter().map(|f| f.completion_tokens as usize).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": first.map_or(0, |f| f.cached_tokens)},
    })
}

/// The `bmoe` telemetry of a request: one choice's object, or with `n` > 1 the list of each
/// choice's.
fn telemetry(choices: &[Finished]) -> Value {
    match choices {
        [one] => one.telemetry(),
        many => Value::Array(many.iter().map(Finished::telemetry).collect()),
    }
}

/// Tool calls as a message carries them (`streamed`: with each call's `index`, as deltas do).
fn tool_calls_json(calls: &[crate::chat::ToolCall], streamed: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}});
                if streamed {
                    v["index"] = json!(i);
                }
                v
            })
            .collect(),
    )
}

/// A token's log-probability in the chat shape: `{token, logprob, bytes, top_logprobs}`,
/// plus llama-server's `id` (what `logit_bias` takes).
fn chat_logprob(lp: &Logprob) -> Value {
    json!({
        "id": lp.id,
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": lp.bytes,
        "top_logprobs": lp.top.iter().map(|(id, t, b, l)| json!({"id": id, "token": t, "logprob": l, "bytes": b})).collect::<Vec<_>>(),
    })
}

/// Log-probabilities as a chat choice carries them (`null` without `logprobs`).
fn chat_logprobs(want: bool, lps: &[Logprob]) -> Value {
    if !want {
        return Value::Null;
    }
    json!({"content": lps.iter().map(chat_logprob).collect::<Vec<_>>(), "refusal": null})
}

/// Log-probabilities in the legacy completions shape: parallel lists of the tokens, their
/// log-probabilities, the top alternatives as `{token: logprob}` objects, and each token's
/// offset in the text (counted from `offset`); plus `content`, the same in the chat shape
/// (with token ids, and alternatives in order: a `{token: logprob}` object loses both).
fn legacy_logprobs(want: bool, lps: &[Logprob], offset: usize) -> Value {
    if !want {
        return Value::Null;
    }
    let mut at = offset;
    let mut offsets = Vec::with_capacity(lps.len());
    for lp in lps {
        offsets.push(at);
        at += lp.token.len();
    }
    json!({
        "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| {
            l.top.iter().map(|(_, t, _, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
        "content": lps.iter().map(chat_logprob).collect::<Vec<_>>(),
    })
}

/// Queue a job and answer it: JSON, or an SSE stream.
async fn submit(
    st: Arc<AppState>,
    endpoint: Endpoint,
    prompt: Prompt,
    common: Common,
    tools: Option<ToolRequest>,
) -> Response {
    if !st.ready.load(Ordering::SeqCst) {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the model is still loading: retry shortly (GET /health says when it is ready)",
        );
        e.retry_after = Some(1);
        return e.into_response();
    }
    if st.in_flight.fetch_add(1, Ordering::SeqCst) >= st.capacity {
        st.in_flight.fetch_sub(1, Ordering::SeqCst);
        st.metrics.rejected_busy();
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!(
                "the server is busy: one generation runs and {} wait (--queue); retry later",
                st.capacity - 1
            ),
        )
        .with_code("server_busy");
        e.retry_after = Some(1);
        return e.into_response();
    }
    let (tx, mut rx) = mpsc::channel(16);
    let watch = Watch::new();
    let mut guard = GoneOnDrop {
        watch: watch.clone(),
        armed: true,
    };
    let id = st.next_id.fetch_add(1, Ordering::SeqCst);
    let stream = common.stream;
    let include_usage = common.include_usage;
    let want_logprobs = common.logprobs.is_some();
    let n_choices = common.n;
    let job = Job {
        id,
        endpoint,
        prompt,
        common,
        tools,
        events: tx,
        watch,
    };
    let sent = st
        .jobs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map(|s| s.send(job).is_ok());
    if sent != Some(true) {
        st.in_flight.fetch_sub(1, Ordering::SeqCst);
        guard.armed = false;
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the server is shutting down",
        )
        .into_response();
    }
    let engine_gone = || {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the engine stopped before answering",
        )
    };
    match rx.recv().await {
        Some(Event::Started) => {}
        Some(Event::Error(e)) => {
            guard.armed = false;
            return e.into_response();
        }
        Some(Event::Delta { .. } | Event::Choice(..) | Event::End) | None => {
            guard.armed = false;
            return engine_gone().into_response();
        }
    }
    let (prefix, object) = match endpoint {
        Endpoint::Chat => ("chatcmpl", "chat.completion"),
        Endpoint::Completion => ("cmpl", "text_completion"),
    };
    let rid = format!("{prefix}-bmoe-{}-{id}", st.created);
    let model = st.model_id.clone();
    let created = unix_now();
    if !stream {
        let mut done: Vec<(u32, Finished)> = Vec::new();
        loop {
            match rx.recv().await {
                Some(Event::Delta { .. } | Event::Started) => {}
                Some(Event::Error(e)) => {
                    guard.armed = false;
                    return e.into_response();
                }
                None => {
                    guard.armed = false;
                    return engine_gone().into_response();
                }
                Some(Event::Choice(i, f)) => done.push((i, *f)),
                Some(Event::End) => {
                    guard.armed = false;
                    // Choices decoded together (--parallel) may finish in any order.
                    done.sort_by_key(|(i, _)| *i);
                    let choices: Vec<Value> = done
                        .iter()
                        .map(|(i, f)| match endpoint {
                            Endpoint::Chat => {
                                let mut msg = json!({"role": "assistant", "content": f.content});
                                if !f.reasoning.is_empty() {
                                    msg["reasoning_content"] = json!(f.reasoning);
                                }
                                if !f.tool_calls.is_empty() {
                                    if f.content.is_empty() {
                                        msg["content"] = Value::Null;
                                    }
                                    msg["tool_calls"] = tool_calls_json(&f.tool_calls, false);
                                }
                                json!({"index": i, "message": msg, "finish_reason": f.finish_reason,
                                       "logprobs": chat_logprobs(want_logprobs, &f.logprobs)})
                            }
                            Endpoint::Completion => {
                                json!({"index": i, "text": f.content, "finish_reason": f.finish_reason,
                                       "logprobs": legacy_logprobs(want_logprobs, &f.logprobs, 0)})
                            }
                        })
                        .collect();
                    let finished: Vec<Finished> = done.into_iter().map(|(_, f)| f).collect();
                    return Json(json!({
                        "id": rid, "object": object, "created": created, "model": model,
                        "choices": choices, "usage": usage(&finished), "bmoe": telemetry(&finished),
                    }))
                    .into_response();
                }
            }
        }
    }
    // Server-sent events. The stream owns the guard: a client that goes away drops the stream,
    // and the guard tells the engine.
    let chunk_object = match endpoint {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completion => "text_completion",
    };
    let base = json!({"id": rid, "object": chunk_object, "created": created, "model": model});
    let with = move |choices: Value| {
        let mut v = base.clone();
        v["choices"] = choices;
        v
    };
    struct S {
        rx: mpsc::Receiver<Event>,
        guard: GoneOnDrop,
        pending: std::collections::VecDeque<String>,
        done: bool,
        /// Per choice: log-probabilities sent so far, and bytes of text (legacy offsets).
        sent_logprobs: Vec<usize>,
        sent_text: Vec<usize>,
        /// Per choice: the answer text sent so far (what a held-back tool call leaves).
        sent_content: Vec<String>,
        finished: Vec<Finished>,
    }
    let mut first = std::collections::VecDeque::new();
    if endpoint == Endpoint::Chat {
        for i in 0..n_choices {
            first.push_back(
                with(json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]))
                    .to_string(),
            );
        }
    }
    let state = S {
        rx,
        guard,
        pending: first,
        done: false,
        sent_logprobs: vec![0; n_choices as usize],
        sent_text: vec![0; n_choices as usize],
        sent_content: vec![String::new(); n_choices as usize],
        finished: Vec::new(),
    };
    let events = futures_util::stream::unfold((state, with), move |(mut s, with)| async move {
        loop {
            if let Some(data) = s.pending.pop_front() {
                let ev = SseEvent::default().data(data);
                return Some((Ok::<_, std::convert::Infallible>(ev), (s, with)));
            }
            if s.done {
                return None;
            }
            match s.rx.recv().await {
                Some(Event::Started) => {}
                Some(Event::Delta {
                    index,
                    reasoning,
                    content,
                    logprobs,
                }) => {
                    let i = index as usize;
                    let offset = s.sent_text.get(i).copied().unwrap_or(0);
                    if let Some(n) = s.sent_logprobs.get_mut(i) {
                        *n += logprobs.len();
                    }
                    if let Some(n) = s.sent_text.get_mut(i) {
                        *n += content.len();
                    }
                    if let Some(t) = s.sent_content.get_mut(i) {
                        t.push_str(&content);
                    }
                    let choice = match endpoint {
                        Endpoint::Chat => {
                            let mut d = serde_json::Map::new();
                            if !reasoning.is_empty() {
                                d.insert("reasoning_content".into(), json!(reasoning));
                            }
                            if !content.is_empty() {
                                d.insert("content".into(), json!(content));
                            }
                            if d.is_empty() && logprobs.is_empty() {
                                continue;
                            }
                            json!({"index": index, "delta": d, "finish_reason": null,
                                   "logprobs": chat_logprobs(want_logprobs, &logprobs)})
                        }
                        Endpoint::Completion => {
                            if content.is_empty() && logprobs.is_empty() {
                                continue;
                            }
                            json!({"index": index, "text": content, "finish_reason": null,
                                   "logprobs": legacy_logprobs(want_logprobs, &logprobs, offset)})
                        }
                    };
                    s.pending.push_back(with(json!([choice])).to_string());
                }
                Some(Event::Choice(index, f)) => {
                    let i = index as usize;
                    if endpoint == Endpoint::Chat {
                        // What a tool-call marker held back: the rest of the answer's text
                        // (when the marker opened no call), then the calls.
                        let sent = s.sent_content.get(i).map_or("", String::as_str);
                        let rest = f.content.strip_prefix(sent).unwrap_or("");
                        if !rest.is_empty() {
                            s.pending.push_back(
                                with(json!([{"index": index, "delta": {"content": rest}, "finish_reason": null}]))
                                    .to_string(),
                            );
                        }
                        if !f.tool_calls.is_empty() {
                            s.pending.push_back(
                                with(json!([{"index": index, "delta": {"tool_calls": tool_calls_json(&f.tool_calls, true)}, "finish_reason": null}]))
                                    .to_string(),
                            );
                        }
                    }
                    // Log-probabilities of tokens whose text a stop string held back, or that
                    // came after the last delta, go with the finishing chunk.
                    let from = s
                        .sent_logprobs
                        .get(i)
                        .copied()
                        .unwrap_or(0)
                        .min(f.logprobs.len());
                    let rest = &f.logprobs[from..];
                    let offset = s.sent_text.get(i).copied().unwrap_or(0);
                    let choice = match endpoint {
                        Endpoint::Chat => {
                            json!({"index": index, "delta": {}, "finish_reason": f.finish_reason,
                                   "logprobs": chat_logprobs(want_logprobs && !rest.is_empty(), rest)})
                        }
                        Endpoint::Completion => {
                            json!({"index": index, "text": "", "finish_reason": f.finish_reason,
                                   "logprobs": legacy_logprobs(want_logprobs && !rest.is_empty(), rest, offset)})
                        }
                    };
                    let mut last = with(json!([choice]));
                    if n_choices == 1 {
                        last["bmoe"] = f.telemetry();
                    }
                    s.pending.push_back(last.to_string());
                    s.finished.push(*f);
                }
                Some(Event::End) => {
                    if n_choices > 1 {
                        let mut t = with(json!([]));
                        t["bmoe"] = telemetry(&s.finished);
                        s.pending.push_back(t.to_string());
                    }
                    if include_usage {
                        let mut u = with(json!([]));
                        u["usage"] = usage(&s.finished);
                        s.pending.push_back(u.to_string());
                    }
                    s.pending.push_back("[DONE]".to_string());
                    s.guard.armed = false;
                    s.done = true;
                }
                Some(Event::Error(e)) => {
                    // Headers are sent: the error travels as an event, then the stream ends.
                    s.pending.push_back(e.body().to_string());
                    s.guard.armed = false;
                    s.done = true;
                }
                None => {
                    s.guard.armed = false;
                    s.done = true;
                }
            }
        }
    });
    Sse::new(events).into_response()
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [{
        "id": st.model_id, "object": "model", "created": st.created, "owned_by": "bmoe",
    }]}))
    .into_response()
}

/// `GET /v1/models/{id}`: the model, when `id` names it.
async fn model_by_id(
    State(st): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id != st.model_id {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "the model {:?} does not exist: this server serves {:?}",
                id, st.model_id
            ),
        )
        .with_code("model_not_found")
        .into_response();
    }
    Json(json!({"id": st.model_id, "object": "model", "created": st.created, "owned_by": "bmoe"}))
        .into_response()
}

/// The loaded model's shared parts, or the 503 a request before the load gets.
fn served(st: &AppState) -> Result<&Served, ApiError> {
    st.loaded.get().ok_or_else(|| {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the model is still loading: retry shortly (GET /health says when it is ready)",
        );
        e.retry_after = Some(1);
        e
    })
}

/// `GET /props`: the model and the server's defaults, as llama-server's.
async fn props(State(st): State<Arc<AppState>>) -> Response {
    match served(&st) {
        Ok(s) => Json(s.props.clone()).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /tokenize` `{"content", "add_special"?, "parse_special"?, "with_pieces"?}`, as
/// llama-server's: `{"tokens": [ids]}`, or with `with_pieces` `[{"id", "piece"}]`.
async fn tokenize(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let r = async {
        let body = read_body(&st, req).await?;
        let t = api::tokenize_request(&body)?;
        let s = served(&st)?;
        let ids = s
            .tok
            .encode_with(
                &t.content,
                t.add_special && s.tok.add_bos(),
                t.parse_special,
            )
            .map_err(|e| ApiError::invalid("content", format!("content: {e}")))?;
        Ok::<_, ApiError>(if t.with_pieces {
            json!({"tokens": ids.iter().map(|&id| {
                let b = s.tok.token_bytes(id);
                match String::from_utf8(b) {
                    Ok(piece) => json!({"id": id, "piece": piece}),
                    // A piece that is not whole UTF-8 goes as its bytes, as llama-server's.
                    Err(e) => json!({"id": id, "piece": e.into_bytes()}),
                }
            }).collect::<Vec<_>>()})
        } else {
            json!({ "tokens": ids })
        })
    }
    .await;
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize` `{"tokens": [ids]}` → `{"content"}`.
async fn detokenize(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let r = async {
        let body = read_body(&st, req).await?;
        let ids = api::detokenize_request(&body)?;
        let s = served(&st)?;
        let n = s.tok.n_vocab();
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= n) {
            return Err(ApiError::invalid(
                "tokens",
                format!("tokens[{i}]: {id} is outside the vocabulary of {n} tokens"),
            ));
        }
        Ok(json!({"content": s.tok.decode(&ids)}))
    }
    .await;
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The web chat: one static page, served at `/` (no key needed to load it: it holds nothing;
/// its requests carry the key the user gives it).
const WEB_CHAT: &str = include_str!("../../assets/webchat.html");

async fn web_chat(State(st): State<Arc<AppState>>) -> Response {
    if !st.web_ui {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "the web chat is off (--no-webui)",
        )
        .with_code("not_found")
        .into_response();
    }
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'",
            ),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        WEB_CHAT,
    )
        .into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.ready.load(Ordering::SeqCst) {
        Json(json!({"status": "ready"})).into_response()
    } else {
        let mut r = (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        r
    }
}

async fn metrics_text(State(st): State<Arc<AppState>>) -> Response {
    let body = st.metrics.render(
        st.in_flight.load(Ordering::SeqCst),
        st.ready.load(Ordering::SeqCst),
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

async fn not_found(req: Request) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!(
            "unknown path {}: this server answers GET / (the web chat), POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/ID], POST /tokenize, POST /detokenize, GET /props, GET /health and GET /metrics",
            req.uri().path()
        ),
    )
    .with_code("not_found")
    .into_response()
}

async fn wrong_method(req: Request) -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
    .into_response()
}

fn router(st: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/", get(web_chat))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_by_id))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/props", get(props))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::middleware::from_fn_with_state(st.clone(), gatekeeper))
        .with_state(st)
}

/// The engine's listener for one job: deltas to the HTTP side (streaming), with back-pressure
/// and a deadline for a client that stops reading.
struct JobListener<'a> {
    job: Arc<Job>,
    /// Which choice this turn is.
    index: u32,
    stream: bool,
    client_timeout: Duration,
    signal: &'a CancelFlag,
    /// Log-probabilities for the next delta.
    logprobs: Vec<Logprob>,
}

impl Listener for JobListener<'_> {
    fn delta(&mut self, reasoning: &str, content: &str) -> bool {
        if !self.stream {
            return !self.gone();
        }
        let ev = Event::Delta {
            index: self.index,
            reasoning: reasoning.to_string(),
            content: content.to_string(),
            logprobs: std::mem::take(&mut self.logprobs),
        };
        match send_within(&self.job.events, ev, self.client_timeout, || self.gone()) {
            Sent::Yes => true,
            Sent::Gone => false,
            Sent::Closed => {
                self.job.watch.mark_gone();
                false
            }
            Sent::TimedOut => {
                eprintln!(
                    "bmoe: serve: request {}: the client read nothing for {:.0} s; its generation is cancelled",
                    self.job.id,
                    self.client_timeout.as_secs_f64()
                );
                self.job.watch.mark_gone();
                false
            }
        }
    }
    fn gone(&self) -> bool {
        self.job.watch.gone.load(Ordering::SeqCst) || self.signal.is_set()
    }
    fn token(&mut self, n: u32) {
        self.job.watch.produced.store(n, Ordering::SeqCst);
    }
    fn logprob(&mut self, lp: &Logprob) {
        if self.stream {
            self.logprobs.push(lp.clone());
        }
    }
}

/// How a send from the engine to a request ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Sent {
    Yes,
    /// The request's receiver is gone (its client disconnected).
    Closed,
    /// `gone()` said to stop waiting.
    Gone,
    /// The client took nothing for `timeout`.
    TimedOut,
}

/// Send `ev`, waiting while the request's buffer is full (a client reading slowly holds the
/// engine back rather than piling up text), at most `timeout`.
fn send_within(
    tx: &mpsc::Sender<Event>,
    mut ev: Event,
    timeout: Duration,
    gone: impl Fn() -> bool,
) -> Sent {
    let deadline = Instant::now() + timeout;
    loop {
        match tx.try_send(ev) {
            Ok(()) => return Sent::Yes,
            Err(mpsc::error::TrySendError::Closed(_)) => return Sent::Closed,
            Err(mpsc::error::TrySendError::Full(back)) => {
                if gone() {
                    return Sent::Gone;
                }
                if Instant::now() >= deadline {
                    return Sent::TimedOut;
                }
                ev = back;
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

fn refused(r: &Refused) -> ApiError {
    match r {
        Refused::TooLong { .. } => {
            ApiError::invalid("messages", r.to_string()).with_code("context_length_exceeded")
        }
        Refused::Broken(_) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            r.to_string(),
        ),
        _ => ApiError::bad_request(r.to_string()),
    }
}

/// What a job runs with, once checked ([`Engine::plan`]).
struct Plan {
    opts: TurnOptions,
    prompt: Prompt,
    tool_format: Option<crate::tools::ToolFormat>,
    /// The seed of choice 0 (choice i draws from `base + i`).
    base: u64,
}

/// A prompt the conversation refused, as the request's error (naming `prompt` on the legacy
/// endpoint, where there are no messages).
fn refused_for(job: &Job, r: &Refused) -> ApiError {
    let mut e = refused(r);
    if job.endpoint == Endpoint::Completion && e.param.as_deref() == Some("messages") {
        e.param = Some("prompt".into());
    }
    e
}

/// The engine thread: load, then one job at a time until the job channel closes.
struct Engine {
    args: RunArgs,
    model: PathBuf,
    model_id: String,
    loaded: Arc<std::sync::OnceLock<Served>>,
    jobs: std_mpsc::Receiver<Job>,
    in_flight: Arc<AtomicUsize>,
    ready: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    client_timeout: Duration,
    signal: CancelFlag,
    /// `--parallel`: lanes decoded together (1: one request at a time).
    parallel: u32,
}

impl Engine {
    fn run(self) -> Result<()> {
        let mut err = std::io::stderr();
        let mut conv = Conversation::open(&self.args, &self.model, &mut err)?;
        if self.parallel > 1 {
            conv.set_sequences(self.parallel)?;
        }
        let a = &self.args;
        let _ = self.loaded.set(Served {
            tok: conv.shared_tokenizer(),
            props: json!({
                "model_alias": self.model_id,
                "model_path": self.model.display().to_string(),
                "architecture": conv.arch(),
                "n_ctx": conv.n_ctx(),
                "n_vocab": conv.n_vocab(),
                "total_slots": self.parallel,
                "chat_template": conv.template_source(),
                "modalities": {"vision": false, "audio": false},
                "default_generation_settings": {
                    "n_ctx": conv.n_ctx(),
                    "params": {
                        "n_predict": if a.n_predict == crate::prompt::N_PREDICT_FILL { -1 } else { i64::from(a.n_predict) },
                        "temperature": a.temp, "top_k": a.top_k, "top_p": a.top_p, "min_p": a.min_p,
                        "repeat_penalty": a.repeat_penalty, "repeat_last_n": a.repeat_last_n,
                        "presence_penalty": a.presence_penalty, "frequency_penalty": a.frequency_penalty,
                        "seed": a.seed, "speculative.ngram": a.ngram, "speculative.mtp": a.mtp,
                    },
                },
                "build_info": format!("bmoe {}", env!("CARGO_PKG_VERSION")),
            }),
        });
        self.ready.store(true, Ordering::SeqCst);
        eprintln!(
            "bmoe: serve: model loaded in {:.2} s ({}, n_ctx {}, chat template: {}{})",
            conv.load_s(),
            conv.arch(),
            conv.n_ctx(),
            if conv.has_template() { "yes" } else { "none" },
            conv.tool_format()
                .map_or_else(String::new, |f| format!(", tool calls: {}", f.name()))
        );
        eprintln!("bmoe: serve: {}", conv.mode_line());
        if self.parallel > 1 {
            eprintln!(
                "bmoe: serve: {} slots of {} tokens each (-c is split between them): up to {} requests decode together",
                self.parallel,
                conv.n_ctx(),
                self.parallel
            );
        }
        // Requests without a seed draw one from a stream seeded by --seed: a server started
        // with the same --seed answers the same sequence of requests the same way.
        let mut seeds = rand_chacha::ChaCha20Rng::seed_from_u64(self.args.seed);
        if self.parallel > 1 {
            self.run_lanes(&mut conv, self.parallel, &mut seeds)?;
            return conv.finish();
        }
        for job in self.jobs.iter() {
            let job = Arc::new(job);
            let last = self.serve_job(&mut conv, &job, &mut seeds);
            // Free before the answer goes out: a client that sends its next request on seeing
            // it finds the queue as it left it.
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            if let Some(ev) = last {
                send_within(&job.events, ev, self.client_timeout, || false);
            }
        }
        conv.finish()
    }

    /// Run one job, its `n` choices one after another; returns its last event (sent once the
    /// job no longer counts as in flight).
    fn serve_job(
        &self,
        conv: &mut Conversation,
        job: &Arc<Job>,
        seeds: &mut impl RngCore,
    ) -> Option<Event> {
        let Plan {
            mut opts,
            prompt,
            tool_format,
            base,
        } = match self.plan(conv, job, seeds) {
            Ok(p) => p,
            Err(ev) => return ev,
        };
        for index in 0..job.common.n.max(1) {
            // Each choice draws from its own seed: the request's (or the drawn one) plus its index.
            opts.sampler.seed = base.wrapping_add(u64::from(index));
            let prepared = match conv.prepare(&prompt, job.common.max_tokens) {
                Ok(p) => p,
                Err(r) => return Some(Event::Error(refused_for(job, &r))),
            };
            if index == 0
                && send_within(&job.events, Event::Started, self.client_timeout, || false)
                    != Sent::Yes
            {
                self.metrics.skipped();
                return None;
            }
            let fin = match self.serve_choice(conv, job, index, &prepared, &opts) {
                Ok(f) => f,
                Err(e) => return Some(e),
            };
            let ev = self.choice_done(job, index, fin, tool_format);
            if send_within(&job.events, ev, self.client_timeout, || false) != Sent::Yes {
                return None;
            }
        }
        Some(Event::End)
    }

    /// A finished choice's event: its tool calls parsed out of the answer (a request with
    /// tools), the grammar's cost logged.
    fn choice_done(
        &self,
        job: &Job,
        index: u32,
        mut fin: Finished,
        tool_format: Option<crate::tools::ToolFormat>,
    ) -> Event {
        if let Some(fmt) = tool_format {
            let parsed = fmt.parse(&fin.content);
            if !parsed.calls.is_empty() {
                fin.content = parsed.content;
                fin.tool_calls =
                    crate::tools::with_ids(&parsed.calls, &format!("{}_{index}", job.id));
                fin.finish_reason = "tool_calls";
            }
        }
        if let Some((masks, secs)) = fin.grammar {
            eprintln!(
                "bmoe: serve: request {}: grammar: {masks} token masks in {:.1} ms ({:.3} ms each)",
                job.id,
                secs * 1e3,
                secs * 1e3 / masks.max(1) as f64
            );
        }
        Event::Choice(index, Box::new(fin))
    }

    /// What a job runs with: its sampling, stop strings, grammar and prompt, checked against
    /// the model; `Err` carries the event that ends it (`None`: its client left while it
    /// waited).
    fn plan(
        &self,
        conv: &mut Conversation,
        job: &Job,
        seeds: &mut impl RngCore,
    ) -> Result<Plan, Option<Event>> {
        let seed = seeds.next_u64();
        if job.watch.gone.load(Ordering::SeqCst) {
            self.metrics.skipped();
            return Err(None);
        }
        let a = &self.args;
        let c = &job.common;
        let (ngram, mtp) = (c.ngram.unwrap_or(a.ngram), c.mtp.unwrap_or(a.mtp));
        let refusal = if mtp && !a.mtp {
            Some("the server was not started with --mtp (the MTP head follows every step from the first)")
        } else if mtp && ngram {
            Some("one draft source per request: \"ngram\": true needs \"mtp\": false on a --mtp server")
        } else {
            None
        };
        if let Some(why) = refusal {
            return Err(Some(Event::Error(ApiError::invalid("mtp", why))));
        }
        if let Some(&(id, _)) = c
            .logit_bias
            .iter()
            .find(|(id, _)| *id as usize >= conv.n_vocab())
        {
            return Err(Some(Event::Error(ApiError::invalid(
                "logit_bias",
                format!(
                    "logit_bias: token id {id} is outside the vocabulary of {} tokens",
                    conv.n_vocab()
                ),
            ))));
        }
        let base = c.seed.unwrap_or(seed);
        let mut sampler = a.sampler_config(base);
        sampler.temp = c.temperature.unwrap_or(a.temp);
        sampler.top_k = c.top_k.unwrap_or(a.top_k);
        sampler.top_p = c.top_p.unwrap_or(a.top_p);
        sampler.min_p = c.min_p.unwrap_or(a.min_p);
        let p = &mut sampler.penalties;
        p.repeat = c.repeat_penalty.unwrap_or(p.repeat);
        p.presence = c.presence_penalty.unwrap_or(p.presence);
        p.frequency = c.frequency_penalty.unwrap_or(p.frequency);
        p.last_n = c.repeat_last_n.unwrap_or(p.last_n);
        sampler.logit_bias = c.logit_bias.clone();
        let mut opts = TurnOptions {
            sampler,
            stop: c.stop.clone(),
            speculation: ngram.then(|| conv.ngram_params()),
            head_drafts: mtp,
            logprobs: c.logprobs,
            constraint: c.constraint.as_ref().map(|(spec, _)| spec.clone()),
            hold_from: None,
        };
        let mut prompt = job.prompt.clone();
        if let Prompt::Chat {
            effort: Some(e), ..
        } = &prompt
        {
            if !conv.format().is_some_and(|f| f.reads_reasoning_effort()) {
                return Err(Some(Event::Error(ApiError::invalid(
                    "reasoning_effort",
                    format!("reasoning_effort \"{e}\": this model's chat template reads no reasoning_effort (gpt-oss's does); use \"think\": false or chat_template_kwargs.enable_thinking to turn reasoning off"),
                ))));
            }
        }
        let mut tool_format = None;
        if let Some(t) = &job.tools {
            use crate::tools::ToolChoice;
            let Some(fmt) = conv.tool_format() else {
                return Err(Some(Event::Error(ApiError::invalid(
                    "tools",
                    "tools: this model's chat template writes no tool-call syntax this server reads (Hermes <tool_call>, gpt-oss harmony, Gemma 4); start the server with --chat-template-file for one that does",
                ))));
            };
            if t.choice != ToolChoice::None {
                tool_format = Some(fmt);
                opts.hold_from = Some(fmt.marker());
            }
            if matches!(t.choice, ToolChoice::Required | ToolChoice::Named(_)) {
                let grammar = fmt.grammar(&t.tools, &t.choice, &|s| conv.is_control_token(s));
                let spec = match grammar {
                    Ok(g) => crate::constrain::Spec::Lark(g),
                    Err(e) => {
                        return Err(Some(Event::Error(ApiError::invalid(
                            "tool_choice",
                            format!("tool_choice: {e:#}"),
                        ))))
                    }
                };
                if let Err(e) = conv.grammar(&spec) {
                    return Err(Some(Event::Error(ApiError::invalid(
                        "tools",
                        format!("tools: the grammar of a required call does not compile: {e:#}"),
                    ))));
                }
                opts.constraint = Some(spec);
                // The call is the answer's first token on: no reasoning before it, except in
                // harmony, where not reasoning means starting in the final channel, past
                // where a call is written.
                if fmt != crate::tools::ToolFormat::Harmony {
                    if let Prompt::Chat { think, .. } = &mut prompt {
                        *think = false;
                    }
                }
            }
        }
        if let Some((spec, param)) = &c.constraint {
            // Compiled once here so that a bad grammar is the client's 400, not a failed turn.
            if let Err(e) = conv.grammar(spec) {
                return Err(Some(Event::Error(ApiError::invalid(
                    param,
                    format!("{param}: the grammar does not compile: {e:#}"),
                ))));
            }
        }
        Ok(Plan {
            opts,
            prompt,
            tool_format,
            base,
        })
    }

    /// Run one choice of a job: the finished turn, or the event that ends the job (a cancel,
    /// a failure).
    fn serve_choice(
        &self,
        conv: &mut Conversation,
        job: &Arc<Job>,
        index: u32,
        prepared: &crate::converse::Prepared,
        opts: &TurnOptions,
    ) -> Result<Finished, Event> {
        conv.cancel_flag().clear();
        let mut listener = JobListener {
            job: job.clone(),
            index,
            stream: job.common.stream,
            client_timeout: self.client_timeout,
            signal: &self.signal,
            logprobs: Vec::new(),
        };
        let fin = match conv.run(prepared, opts, &mut listener) {
            Ok(f) => f,
            Err(e) => {
                return Err(Event::Error(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    format!("the generation failed: {}", crate::run::error_text(&e)),
                )));
            }
        };
        self.turn_result(job, fin, Some(conv.summary()))
    }

    /// A finished turn, counted: the turn, or the event that ends its job (a cancel, a
    /// failure). `summary`: the session's, where one session ran it.
    fn turn_result(
        &self,
        job: &Job,
        fin: Finished,
        summary: Option<bmoe_core::telemetry::summary::RunSummary>,
    ) -> Result<Finished, Event> {
        self.metrics.turn(
            fin.prompt_tokens,
            fin.cached_tokens,
            fin.completion_tokens,
            summary,
        );
        match fin.stop {
            StopReason::Cancelled => {
                let at = job.watch.gone_at.load(Ordering::SeqCst);
                let overrun =
                    (at != u32::MAX).then(|| u64::from(fin.completion_tokens.saturating_sub(at)));
                self.metrics.cancelled(overrun);
                eprintln!(
                    "bmoe: serve: request {}: client gone{}; stopped after {} tokens ({} after it was noticed)",
                    job.id,
                    if at == u32::MAX { String::new() } else { format!(" after {at} tokens") },
                    fin.completion_tokens,
                    overrun.map_or_else(|| "?".into(), |o| o.to_string()),
                );
                Err(Event::Error(if self.signal.is_set() {
                    ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "the server is stopping: the generation was cancelled",
                    )
                } else {
                    ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "the generation was cancelled",
                    )
                }))
            }
            StopReason::Failed => {
                let msg = fin.error.clone().unwrap_or_default();
                eprintln!("bmoe: serve: FAILED: {msg}; the engine refuses further requests");
                Err(Event::Error(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    format!("a step failed: {msg}; this server's output is no longer trustworthy"),
                )))
            }
            StopReason::Count | StopReason::EndOfGeneration => Ok(fin),
        }
    }
}

/// Run the server until SIGINT/SIGTERM (`signal`). Returns the exit code.
pub fn serve(mut a: ServeArgs, signal: &CancelFlag) -> Result<i32> {
    let Some(model) = a.run.model.clone() else {
        bail!("serve: no model given: pass -m MODEL.gguf");
    };
    if !a.run.prompt.is_empty() || a.run.file.is_some() || a.run.system_prompt.is_some() {
        bail!("serve: -p, -f and -sys have no meaning: prompts arrive as requests (a system prompt is a system message)");
    }
    if a.run.session || a.run.decide {
        bail!("serve: --session and --decide are the stdin protocol; the server speaks HTTP");
    }
    if a.queue > 4096 {
        bail!("--queue {}: at most 4096", a.queue);
    }
    if !(a.read_timeout > 0.0 && a.read_timeout.is_finite())
        || !(a.client_timeout > 0.0 && a.client_timeout.is_finite())
    {
        bail!("--read-timeout and --client-timeout take a positive number of seconds");
    }
    a.run.check_modes()?;
    a.run.resolve_seed_reported(&mut std::io::stderr())?;
    if a.parallel > 1 {
        if a.run.mtp || a.run.ngram {
            bail!("--parallel {}: --mtp and --ngram draft for one request at a time; use --parallel 1 to draft", a.parallel);
        }
        // The route and io traces record shared steps (the route trace's `seq` column says
        // whose each token is); the per-token files follow one generation.
        let t = &a.run.telemetry;
        if t.csv.is_some() || a.run.compute_trace.is_some() || a.run.compute_trace_layers.is_some()
        {
            bail!("--parallel {}: --csv and the compute traces follow one request at a time; use --parallel 1 to write them (--route-trace and --io-trace record the shared steps)", a.parallel);
        }
        // As llama-server: the context is split between the slots.
        let per = a.run.ctx / a.parallel;
        if per < 16 {
            bail!(
                "--parallel {} with -c {} leaves {per} tokens per slot: raise -c (the context is split between the slots)",
                a.parallel,
                a.run.ctx
            );
        }
        a.run.ctx = per;
        a.run.sequences = a.parallel;
    }
    // The engine's ordinary environment fallbacks apply, as for a run.
    let ip: IpAddr = match a.host.as_str() {
        "localhost" => IpAddr::from([127, 0, 0, 1]),
        h => h.parse().with_context(|| {
            format!("--host {h}: expected an IP address (127.0.0.1, ::1, 0.0.0.0, ...)")
        })?,
    };
    let loopback = ip.is_loopback();
    let listener = std::net::TcpListener::bind(SocketAddr::new(ip, a.port))
        .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    if !loopback {
        eprintln!(
            "bmoe: serve: WARNING: listening on {addr}, reachable from other machines{}",
            if a.api_key.is_some() {
                ""
            } else {
                " with no --api-key: anyone who can reach this port can use the model"
            }
        );
    }
    let model_id = a.alias.clone().unwrap_or_else(|| {
        model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "bmoe".into())
    });
    let (job_tx, job_rx) = std_mpsc::channel();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let ready = Arc::new(AtomicBool::new(false));
    let metrics = Arc::new(Metrics::default());
    let loaded = Arc::new(std::sync::OnceLock::new());
    let st = Arc::new(AppState {
        loaded: loaded.clone(),
        jobs: Mutex::new(Some(job_tx)),
        in_flight: in_flight.clone(),
        capacity: a.queue + a.parallel as usize,
        ready: ready.clone(),
        metrics: metrics.clone(),
        model_id,
        created: unix_now(),
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        loopback,
        body_limit: a.body_limit_kib.max(1) * 1024,
        read_timeout: Duration::from_secs_f64(a.read_timeout),
        think_default: !a.run.no_think,
        next_id: AtomicU64::new(1),
        cors: a.cors_origin.clone(),
        access_log: !a.no_access_log,
        web_ui: !a.no_webui,
    });
    let engine = Engine {
        args: a.run.clone(),
        model,
        model_id: st.model_id.clone(),
        loaded,
        jobs: job_rx,
        in_flight,
        ready,
        metrics,
        client_timeout: Duration::from_secs_f64(a.client_timeout),
        signal: signal.clone(),
        parallel: a.parallel,
    };
    let engine_done = Arc::new(AtomicBool::new(false));
    let engine_thread = {
        let done = engine_done.clone();
        std::thread::Builder::new()
            .name("bmoe-engine".into())
            .spawn(move || {
                let r = engine.run();
                done.store(true, Ordering::SeqCst);
                r
            })?
    };
    eprintln!("bmoe: serve: listening on http://{addr} (loading the model; GET /health says when it is ready){}",
        if a.no_webui { "" } else { "; a web chat at /" });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let app = router(st.clone());
    let stop = {
        let signal = signal.clone();
        let done = engine_done.clone();
        async move {
            while !signal.is_set() && !done.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let served: Result<()> = rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(stop)
        .await
        .map_err(|e| anyhow!("serving HTTP: {e}"))
    });
    // No more jobs: the engine finishes the one it runs (a signal has cancelled it) and ends.
    st.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(st);
    let engined = engine_thread
        .join()
        .map_err(|_| anyhow!("the engine thread panicked"))?;
    engined?;
    served?;
    if signal.is_set() {
        eprintln!("bmoe: serve: stopped by SIGINT/SIGTERM");
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_are_recognised() {
        for h in [
            "localhost",
            "localhost:8080",
            "127.0.0.1",
            "127.0.0.1:1",
            "[::1]:80",
            "[::1]",
            "LOCALHOST.",
            "app.localhost:3000",
        ] {
            assert!(loopback_host(h), "{h}");
        }
        for h in [
            "example.com",
            "evil.com:8080",
            "10.0.0.1",
            "127.0.0.1.evil.com",
            "localhost.evil.com",
            "",
        ] {
            assert!(!loopback_host(h), "{h}");
        }
        assert!(loopback_origin("http://localhost:3000"));
        assert!(loopback_origin("https://127.0.0.1"));
        assert!(!loopback_origin("http://evil.com"));
        assert!(!loopback_origin("null"));
        assert!(!loopback_origin("http://localhost:3000/x"));
    }

    #[test]
    fn keys_compare_whole() {
        assert!(same_key(b"abc", b"abc"));
        assert!(!same_key(b"abc", b"abd"));
        assert!(!same_key(b"abc", b"abcd"));
    }
}
