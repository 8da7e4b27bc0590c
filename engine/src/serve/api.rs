//! The OpenAI request bodies `bmoe-cli serve` takes, checked field by field, and the error
//! shape it answers with. Every way a body can be wrong is a 400 whose message names the
//! field and what was expected. A field this server knows but does not honour (tools, a
//! response format, llama-server's other samplers) is a 400 naming it whenever it asks for
//! something other than the default, never a silent 200; fields nobody here knows are
//! ignored (clients send many).

use crate::chat::Message;
use crate::converse::type_name;
use axum::http::StatusCode;
use serde_json::{json, Map, Value};

/// An error in the OpenAI shape: `{"error":{"message","type","param","code"}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for `Retry-After` (503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }
    /// A 400 about one field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let mut e = ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            message.into(),
        );
        e.param = Some(param.to_string());
        e
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl axum::response::IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = axum::http::HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(axum::http::header::RETRY_AFTER, v);
            }
        }
        r
    }
}

/// What both endpoints share.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Common {
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// llama-server's.
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<usize>,
    /// Token id → bias (`-inf`: banned).
    pub logit_bias: Vec<(u32, f32)>,
    /// Report log-probabilities with this many alternatives (chat: `logprobs: true` with
    /// `top_logprobs`; legacy: `logprobs: N`).
    pub logprobs: Option<usize>,
    /// Choices to generate (`n`), one after another from the same prompt.
    pub n: u32,
    /// The grammar the answer must follow, and the field that asked for it.
    pub constraint: Option<(crate::constrain::Spec, &'static str)>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// bmoe's extension: `"ngram": true|false` turns prompt-lookup speculation on or off for
    /// this request (default: the server's `--ngram`).
    pub ngram: Option<bool>,
    /// bmoe's extension: `"mtp": true|false` drafts with the model's MTP head for this request
    /// or not (default: the server's `--mtp`; true needs a server started with `--mtp`).
    pub mtp: Option<bool>,
}

/// A chat completion request.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub think: Option<bool>,
    /// `reasoning_effort` (`low`, `medium`, `high`): for a template that reads it.
    pub effort: Option<String>,
    pub common: Common,
    /// The tool definitions as sent (what the template renders), and read.
    pub tool_defs: Vec<Value>,
    pub tools: Vec<crate::tools::Tool>,
    pub tool_choice: crate::tools::ToolChoice,
}

/// A (raw) completion request.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    pub prompt: String,
    pub common: Common,
}

/// The body as a JSON object.
pub fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad_request(format!(
            "the request body must be a JSON object; got {}",
            type_name(&other)
        ))),
    }
}

struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(o) => Err(ApiError::invalid(
                k,
                format!("{k}: expected true or false, got {}", type_name(o)),
            )),
        }
    }
    fn number(&self, k: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x as f32)),
                _ => Err(ApiError::invalid(
                    k,
                    format!("{k}: expected a number from {lo} to {hi}, got {n}"),
                )),
            },
            Some(o) => Err(ApiError::invalid(
                k,
                format!(
                    "{k}: expected a number from {lo} to {hi}, got {}",
                    type_name(o)
                ),
            )),
        }
    }
    fn count(&self, k: &str, min: u64) -> Result<Option<u64>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_u64() {
                Some(x) if x >= min => Ok(Some(x)),
                _ => Err(ApiError::invalid(
                    k,
                    format!("{k}: expected an integer >= {min}, got {n}"),
                )),
            },
            Some(o) => Err(ApiError::invalid(
                k,
                format!("{k}: expected an integer >= {min}, got {}", type_name(o)),
            )),
        }
    }
}

fn common(m: &Map<String, Value>) -> Result<Common, ApiError> {
    let f = Fields(m);
    let max_tokens = match (
        f.count("max_completion_tokens", 1)?,
        f.count("max_tokens", 1)?,
    ) {
        (Some(a), _) | (None, Some(a)) => Some(a.min(u64::from(u32::MAX - 1)) as u32),
        (None, None) => None,
    };
    let n = match f.count("n", 1)? {
        None => 1,
        Some(n) if n <= MAX_CHOICES => n as u32,
        Some(n) => {
            return Err(ApiError::invalid(
                "n",
                format!("n: at most {MAX_CHOICES} choices per request, got {n}"),
            ))
        }
    };
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > 16 {
                return Err(ApiError::invalid(
                    "stop",
                    format!("stop: at most 16 stop strings, got {}", a.len()),
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s.clone()),
                    o => Err(ApiError::invalid(
                        "stop",
                        format!("stop[{i}]: expected a string, got {}", type_name(o)),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        Some(o) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "stop: expected a string or an array of strings, got {}",
                    type_name(o)
                ),
            ))
        }
    };
    let stop = stop.into_iter().filter(|s| !s.is_empty()).collect();
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields(o).bool("include_usage")?.unwrap_or(false),
        Some(o) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!("stream_options: expected an object, got {}", type_name(o)),
            ))
        }
    };
    let seed = match f.get("seed") {
        None => None,
        Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(s), _) => Some(s),
            // A negative seed is read as its two's complement, as llama-server does.
            (None, Some(s)) => Some(s as u64),
            _ => {
                return Err(ApiError::invalid(
                    "seed",
                    format!("seed: expected an integer, got {n}"),
                ))
            }
        },
        Some(o) => {
            return Err(ApiError::invalid(
                "seed",
                format!("seed: expected an integer, got {}", type_name(o)),
            ))
        }
    };
    let repeat_penalty = f.number("repeat_penalty", 0.0, 10.0)?;
    if repeat_penalty == Some(0.0) {
        return Err(ApiError::invalid(
            "repeat_penalty",
            "repeat_penalty: expected a number above 0 (1 = off), got 0",
        ));
    }
    let repeat_last_n = match f.get("repeat_last_n") {
        // llama-server's -1: the whole context.
        Some(Value::Number(n)) if n.as_i64() == Some(-1) => Some(usize::MAX),
        _ => f.count("repeat_last_n", 0)?.map(|n| n as usize),
    };
    Ok(Common {
        max_tokens,
        temperature: f.number("temperature", 0.0, 2.0)?,
        top_p: f.number("top_p", 0.0, 1.0)?,
        top_k: f.count("top_k", 0)?.map(|k| k.min(1 << 20) as usize),
        seed,
        min_p: f.number("min_p", 0.0, 1.0)?,
        presence_penalty: f.number("presence_penalty", -2.0, 2.0)?,
        frequency_penalty: f.number("frequency_penalty", -2.0, 2.0)?,
        repeat_penalty,
        repeat_last_n,
        logit_bias: logit_bias(f.get("logit_bias"))?,
        logprobs: None,
        n,
        constraint: constraint(m)?,
        stop,
        stream: f.bool("stream")?.unwrap_or(false),
        include_usage,
        ngram: f.bool("ngram")?,
        mtp: f.bool("mtp")?,
    })
}

/// The most choices one request may ask for (`n`): they run one after another.
pub const MAX_CHOICES: u64 = 16;

/// The most alternatives `top_logprobs` (chat) or `logprobs` (legacy) may ask for.
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// `logit_bias`: OpenAI's object of token id → bias from -100 to 100, or llama-server's array
/// of `[id, bias]` pairs, where a bias of `false` bans the token.
fn logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::invalid("logit_bias", format!("logit_bias: {m}"));
    let id = |k: &str| {
        k.trim().parse::<u32>().map_err(|_| {
            bad(format!(
                "{}: expected a token id (a non-negative integer)",
                serde_json::to_string(k).unwrap_or_default()
            ))
        })
    };
    let bias = |at: &str, v: &Value| match v {
        Value::Bool(false) => Ok(f32::NEG_INFINITY),
        Value::Number(n) => match n.as_f64() {
            Some(b) if (-100.0..=100.0).contains(&b) => Ok(b as f32),
            _ => Err(bad(format!(
                "{at}: expected a bias from -100 to 100, got {n}"
            ))),
        },
        o => Err(bad(format!(
            "{at}: expected a bias from -100 to 100 (or false to ban the token), got {}",
            type_name(o)
        ))),
    };
    match v {
        None => Ok(Vec::new()),
        Some(Value::Object(m)) => m.iter().map(|(k, b)| Ok((id(k)?, bias(k, b)?))).collect(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, pair)| match pair.as_array().map(Vec::as_slice) {
                Some([Value::Number(n), b]) => match n.as_u64() {
                    Some(t) if t <= u64::from(u32::MAX) => {
                        Ok((t as u32, bias(&format!("[{i}]"), b)?))
                    }
                    _ => Err(bad(format!("[{i}]: expected a token id, got {n}"))),
                },
                _ => Err(bad(format!("[{i}]: expected a pair [token_id, bias]"))),
            })
            .collect(),
        Some(o) => Err(bad(format!(
            "expected an object of token id to bias, got {}",
            type_name(o)
        ))),
    }
}

/// The grammar a request asks for: `response_format` (`json_object`, or `json_schema` with
/// its `schema`), llama-server's `json_schema` (a schema) or `grammar` (Lark, llguidance's
/// dialect, or GBNF). At most one of them.
fn constraint(
    m: &Map<String, Value>,
) -> Result<Option<(crate::constrain::Spec, &'static str)>, ApiError> {
    use crate::constrain::Spec;
    let f = Fields(m);
    let mut found = Vec::new();
    match f.get("response_format") {
        None => {}
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push((Spec::JsonObject, "response_format")),
            Some("json_schema") => {
                let schema = match o.get("json_schema") {
                    Some(Value::Object(js)) => match js.get("schema") {
                        Some(s @ Value::Object(_)) => s.clone(),
                        Some(Value::Bool(true)) | None => serde_json::json!({}),
                        Some(other) => {
                            return Err(ApiError::invalid(
                                "response_format",
                                format!(
                                    "response_format.json_schema.schema: expected a JSON Schema object, got {}",
                                    type_name(other)
                                ),
                            ))
                        }
                    },
                    _ => {
                        return Err(ApiError::invalid(
                            "response_format",
                            "response_format.json_schema: missing (an object with name and schema)",
                        ))
                    }
                };
                found.push((Spec::JsonSchema(schema), "response_format"));
            }
            other => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!(
                        "response_format.type: expected text, json_object or json_schema, got {}",
                        other.map_or_else(|| "nothing".to_string(), |t| format!("{t:?}"))
                    ),
                ))
            }
        },
        Some(o) => {
            return Err(ApiError::invalid(
                "response_format",
                format!("response_format: expected an object, got {}", type_name(o)),
            ))
        }
    }
    match f.get("json_schema") {
        None => {}
        Some(s @ Value::Object(_)) => found.push((Spec::JsonSchema(s.clone()), "json_schema")),
        Some(o) => {
            return Err(ApiError::invalid(
                "json_schema",
                format!(
                    "json_schema: expected a JSON Schema object, got {}",
                    type_name(o)
                ),
            ))
        }
    }
    match f.get("grammar") {
        None => {}
        Some(Value::String(g)) if g.trim().is_empty() => {}
        Some(Value::String(g)) => {
            let lark = crate::constrain::lark_of(g)
                .map_err(|e| ApiError::invalid("grammar", format!("grammar: {e}")))?;
            found.push((Spec::Lark(lark), "grammar"))
        }
        Some(o) => {
            return Err(ApiError::invalid(
                "grammar",
                format!(
                    "grammar: expected a string (a Lark or GBNF grammar), got {}",
                    type_name(o)
                ),
            ))
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|f| f.1).collect();
        return Err(ApiError::invalid(
            found[1].1,
            format!(
                "{}: one constraint per request (given: {})",
                found[1].1,
                names.join(", ")
            ),
        ));
    }
    Ok(found.pop())
}

/// A field this server knows and does not honour, asked for: a 400 naming it. `neutral`
/// says which values ask for nothing (an empty tool list, a plain text response format).
fn refuse_unsupported(m: &Map<String, Value>, fields: &[(&str, &str)]) -> Result<(), ApiError> {
    for &(k, why) in fields {
        let Some(v) = m.get(k).filter(|v| !v.is_null()) else {
            continue;
        };
        let neutral = match k {
            "functions" => v.as_array().is_some_and(Vec::is_empty),
            "function_call" => v.as_str() == Some("none"),
            "modalities" => v
                .as_array()
                .is_some_and(|a| a.iter().all(|x| x.as_str() == Some("text"))),
            "typical_p" => v.as_f64() == Some(1.0),
            "mirostat" | "dry_multiplier" | "xtc_probability" | "n_probs" => {
                v.as_f64() == Some(0.0)
            }
            "top_n_sigma" => v.as_f64().is_some_and(|x| x <= 0.0),
            "best_of" => v.as_u64() == Some(1),
            "suffix" => v.as_str() == Some(""),
            _ => false,
        };
        if !neutral {
            return Err(ApiError::invalid(k, format!("{k}: {why}")));
        }
    }
    Ok(())
}

/// What both endpoints refuse.
const UNSUPPORTED: &[(&str, &str)] = &[
    (
        "mirostat",
        "mirostat sampling is not supported (use temperature, top_k, top_p, min_p)",
    ),
    (
        "typical_p",
        "typical sampling is not supported (use temperature, top_k, top_p, min_p)",
    ),
    (
        "dry_multiplier",
        "DRY sampling is not supported (use repeat_penalty, presence_penalty, frequency_penalty)",
    ),
    ("xtc_probability", "XTC sampling is not supported"),
    ("top_n_sigma", "top-n-sigma sampling is not supported"),
    ("n_probs", "use logprobs and top_logprobs"),
];

/// What chat requests refuse on top.
const CHAT_UNSUPPORTED: &[(&str, &str)] = &[
    (
        "functions",
        "function calling is not supported by this server",
    ),
    (
        "function_call",
        "function calling is not supported by this server",
    ),
    ("audio", "audio output is not supported"),
    ("modalities", "only the text modality is served"),
    ("prediction", "predicted outputs are not supported"),
];

/// What legacy completions refuse on top.
const COMPLETION_UNSUPPORTED: &[(&str, &str)] = &[
    ("best_of", "only best_of 1 is served"),
    ("suffix", "suffix (fill-in-the-middle) is not supported"),
];

/// `tools`: function definitions `{"type": "function", "function": {"name", "description"?,
/// "parameters"?}}`, kept as sent for the template, and read.
fn tools(v: Option<&Value>) -> Result<(Vec<Value>, Vec<crate::tools::Tool>), ApiError> {
    let arr = match v {
        None => return Ok((Vec::new(), Vec::new())),
        Some(Value::Array(a)) => a,
        Some(o) => {
            return Err(ApiError::invalid(
                "tools",
                format!(
                    "tools: expected an array of tool definitions, got {}",
                    type_name(o)
                ),
            ))
        }
    };
    let mut out = Vec::with_capacity(arr.len());
    for (i, t) in arr.iter().enumerate() {
        let bad = |m: &str| ApiError::invalid("tools", format!("tools[{i}]: {m}"));
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                "expected {\"type\": \"function\", \"function\": {...}}",
            ));
        }
        let f = t
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| bad("function: missing (an object with a name)"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| {
                !n.is_empty()
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
            })
            .ok_or_else(|| bad("function.name: expected a name of letters, digits, _ - ."))?;
        if out.iter().any(|t: &crate::tools::Tool| t.name == name) {
            return Err(bad(&format!("function.name: {name:?} is defined twice")));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(o) => {
                return Err(bad(&format!(
                    "function.parameters: expected a JSON Schema object, got {}",
                    type_name(o)
                )))
            }
        };
        out.push(crate::tools::Tool {
            name: name.to_string(),
            parameters,
        });
    }
    // Templates print `description` without a default (gpt-oss's does `"// " +
    // tool.description`): a tool sent without one gets an empty one, as llama-server's does.
    let defs = arr
        .iter()
        .cloned()
        .map(|mut t| {
            if let Some(f) = t.get_mut("function").and_then(Value::as_object_mut) {
                f.entry("description")
                    .or_insert_with(|| Value::String(String::new()));
            }
            t
        })
        .collect();
    Ok((defs, out))
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name"}}`.
fn tool_choice(
    v: Option<&Value>,
    tools: &[crate::tools::Tool],
) -> Result<crate::tools::ToolChoice, ApiError> {
    use crate::tools::ToolChoice;
    let bad = |m: String| ApiError::invalid("tool_choice", format!("tool_choice: {m}"));
    let choice = match v {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "expected none, auto, required or a function, got {other:?}"
                )))
            }
        },
        Some(Value::Object(o)) => match o
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
        {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => {
                return Err(bad(
                    "expected {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
                ))
            }
        },
        Some(o) => {
            return Err(bad(format!(
                "expected a string or an object, got {}",
                type_name(o)
            )))
        }
    };
    match &choice {
        ToolChoice::Required if tools.is_empty() => Err(bad("\"required\" needs tools".into())),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => {
            Err(bad(format!("names {n:?}, which is not among the tools")))
        }
        _ => Ok(choice),
    }
}

/// An assistant message's `tool_calls`: `[{"id", "type": "function", "function": {"name",
/// "arguments"}}]`, the arguments a JSON text (an object is taken too).
fn assistant_tool_calls(
    i: usize,
    v: Option<&Value>,
) -> Result<Vec<crate::chat::ToolCall>, ApiError> {
    let param = format!("messages[{i}].tool_calls");
    let arr = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(o) => {
            return Err(ApiError::invalid(
                &param,
                format!("{param}: expected an array, got {}", type_name(o)),
            ))
        }
    };
    arr.iter()
        .enumerate()
        .map(|(j, c)| {
            let bad = |m: &str| ApiError::invalid(&param, format!("{param}[{j}]: {m}"));
            let f = c.get("function").ok_or_else(|| bad("function: missing"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("function.name: missing"))?;
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(o @ Value::Object(_)) => o.to_string(),
                None | Some(Value::Null) => "{}".to_string(),
                Some(o) => {
                    return Err(bad(&format!(
                        "function.arguments: expected a JSON string, got {}",
                        type_name(o)
                    )))
                }
            };
            Ok(crate::chat::ToolCall {
                id: c
                    .get("id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                name: name.to_string(),
                arguments,
            })
        })
        .collect()
}

/// A message's content: a string, or an array of text parts.
fn content(i: usize, v: Option<&Value>, role: &str) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) if role == "assistant" => Ok(String::new()),
        None | Some(Value::Null) => Err(ApiError::invalid(
            &param,
            format!("{param}: missing (a string, or an array of text parts)"),
        )),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                let typ = p.get("type").and_then(Value::as_str);
                match (typ, p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push_str(t),
                    (Some(other), _) if other != "text" => {
                        return Err(ApiError::invalid(
                            &param,
                            format!(
                                "{param}[{j}]: content parts of type {other:?} are not supported (text only)"
                            ),
                        ))
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            &param,
                            format!("{param}[{j}]: expected {{\"type\":\"text\",\"text\":\"...\"}}"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(o) => Err(ApiError::invalid(
            &param,
            format!(
                "{param}: expected a string or an array of text parts, got {}",
                type_name(o)
            ),
        )),
    }
}

/// Parse a `/v1/chat/completions` body.
pub fn chat_request(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let m = object(body)?;
    let f = Fields(&m);
    let msgs = match f.get("messages") {
        Some(Value::Array(a)) => a,
        Some(o) => {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "messages: expected an array of messages, got {}",
                    type_name(o)
                ),
            ))
        }
        None => {
            return Err(ApiError::invalid(
                "messages",
                "messages: missing (an array of {\"role\",\"content\"} objects)",
            ))
        }
    };
    if msgs.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "messages: empty; send at least one message",
        ));
    }
    let mut messages = Vec::with_capacity(msgs.len());
    for (i, v) in msgs.iter().enumerate() {
        let Value::Object(o) = v else {
            return Err(ApiError::invalid(
                &format!("messages[{i}]"),
                format!("messages[{i}]: expected an object, got {}", type_name(v)),
            ));
        };
        let role = match o.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(other) => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!(
                        "messages[{i}].role: expected a string, got {}",
                        type_name(other)
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!("messages[{i}].role: missing (system, developer, user or assistant)"),
                ))
            }
        };
        // `developer` is OpenAI's newer name for the system message.
        let role = match role {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            other => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!(
                        "messages[{i}].role: unknown role {}: expected system, developer, user, assistant or tool",
                        serde_json::to_string(other).unwrap_or_default()
                    ),
                ))
            }
        };
        let calls = if role == "assistant" {
            assistant_tool_calls(i, o.get("tool_calls"))?
        } else {
            Vec::new()
        };
        let text = if calls.is_empty() {
            content(i, o.get("content"), role)?
        } else {
            // An assistant message that calls tools may have no text.
            content(i, o.get("content").filter(|c| !c.is_null()), "assistant")?
        };
        let mut msg = Message::new(role, text);
        msg.tool_calls = calls;
        if role == "assistant" {
            if let Some(Value::String(r)) = o.get("reasoning_content") {
                msg = msg.with_reasoning(r.clone());
            }
        }
        if role == "tool" {
            let opt_str = |k: &str| match o.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(ApiError::invalid(
                    &format!("messages[{i}].{k}"),
                    format!(
                        "messages[{i}].{k}: expected a string, got {}",
                        type_name(other)
                    ),
                )),
            };
            msg.tool_call_id = opt_str("tool_call_id")?;
            msg.name = opt_str("name")?;
        }
        messages.push(msg);
    }
    // Reasoning on or off: our `think` extension, or llama-server's chat_template_kwargs.
    let think = match f.bool("think")? {
        Some(t) => Some(t),
        None => match f.get("chat_template_kwargs") {
            Some(Value::Object(k)) => Fields(k).bool("enable_thinking")?,
            Some(o) => {
                return Err(ApiError::invalid(
                    "chat_template_kwargs",
                    format!(
                        "chat_template_kwargs: expected an object, got {}",
                        type_name(o)
                    ),
                ))
            }
            None => None,
        },
    };
    let effort = match f.get("reasoning_effort") {
        None | Some(Value::Null) => None,
        Some(Value::String(e)) if ["low", "medium", "high"].contains(&e.as_str()) => {
            Some(e.clone())
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "reasoning_effort",
                format!("reasoning_effort: expected \"low\", \"medium\" or \"high\", got {other}"),
            ))
        }
    };
    refuse_unsupported(&m, UNSUPPORTED)?;
    refuse_unsupported(&m, CHAT_UNSUPPORTED)?;
    let (tool_defs, tools) = tools(f.get("tools"))?;
    let tool_choice = tool_choice(f.get("tool_choice"), &tools)?;
    let mut common = common(&m)?;
    if common.constraint.is_some()
        && matches!(
            tool_choice,
            crate::tools::ToolChoice::Required | crate::tools::ToolChoice::Named(_)
        )
    {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice: a required tool call is a constraint of its own; it cannot be combined with response_format, json_schema or grammar",
        ));
    }
    let top = f.count("top_logprobs", 0)?;
    if let Some(t) = top.filter(|&t| t > MAX_TOP_LOGPROBS) {
        return Err(ApiError::invalid(
            "top_logprobs",
            format!("top_logprobs: at most {MAX_TOP_LOGPROBS}, got {t}"),
        ));
    }
    common.logprobs = match (f.bool("logprobs")?, top) {
        (Some(true), t) => Some(t.unwrap_or(0) as usize),
        (_, Some(t)) if t > 0 => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs: needs \"logprobs\": true",
            ))
        }
        _ => None,
    };
    Ok(ChatRequest {
        messages,
        think,
        effort,
        common,
        tool_defs,
        tools,
        tool_choice,
    })
}

/// Parse a `/v1/completions` body: `prompt` a string (or an array of one string).
pub fn completion_request(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let m = object(body)?;
    let prompt = match Fields(&m).get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        Some(Value::Array(a)) => {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "prompt: one prompt per request is served (a string, or an array of one string); got an array of {}",
                    a.len()
                ),
            ))
        }
        Some(o) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("prompt: expected a string, got {}", type_name(o)),
            ))
        }
        None => return Err(ApiError::invalid("prompt", "prompt: missing (a string)")),
    };
    if Fields(&m).bool("echo")? == Some(true) {
        return Err(ApiError::invalid("echo", "echo: not supported"));
    }
    refuse_unsupported(&m, UNSUPPORTED)?;
    refuse_unsupported(&m, COMPLETION_UNSUPPORTED)?;
    let mut common = common(&m)?;
    common.logprobs = match Fields(&m).count("logprobs", 0)? {
        Some(t) if t > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs: at most {MAX_TOP_LOGPROBS}, got {t}"),
            ))
        }
        t => t.map(|t| t as usize),
    };
    Ok(CompletionRequest { prompt, common })
}

/// A `/tokenize` body.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizeRequest {
    pub content: String,
    /// Prepend BOS where the vocabulary asks for it (default false, as llama-server).
    pub add_special: bool,
    /// Control-token texts become their ids (default true).
    pub parse_special: bool,
    pub with_pieces: bool,
}

/// Parse a `/tokenize` body.
pub fn tokenize_request(body: &[u8]) -> Result<TokenizeRequest, ApiError> {
    let m = object(body)?;
    let f = Fields(&m);
    let content = match f.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(o) => {
            return Err(ApiError::invalid(
                "content",
                format!("content: expected a string, got {}", type_name(o)),
            ))
        }
        None => return Err(ApiError::invalid("content", "content: missing (a string)")),
    };
    Ok(TokenizeRequest {
        content,
        add_special: f.bool("add_special")?.unwrap_or(false),
        parse_special: f.bool("parse_special")?.unwrap_or(true),
        with_pieces: f.bool("with_pieces")?.unwrap_or(false),
    })
}

/// Parse a `/detokenize` body: the token ids.
pub fn detokenize_request(body: &[u8]) -> Result<Vec<u32>, ApiError> {
    let m = object(body)?;
    match Fields(&m).get("tokens") {
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_u64() {
                Some(t) if t <= u64::from(u32::MAX) => Ok(t as u32),
                _ => Err(ApiError::invalid(
                    "tokens",
                    format!("tokens[{i}]: expected a token id, got {v}"),
                )),
            })
            .collect(),
        Some(o) => Err(ApiError::invalid(
            "tokens",
            format!(
                "tokens: expected an array of token ids, got {}",
                type_name(o)
            ),
        )),
        None => Err(ApiError::invalid(
            "tokens",
            "tokens: missing (an array of token ids)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_err(body: &str) -> ApiError {
        chat_request(body.as_bytes()).expect_err(body)
    }

    #[test]
    fn chat_requests_parse() {
        let r = chat_request(
            br#"{"model":"x","messages":[{"role":"developer","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]},
            {"role":"assistant","content":null,"reasoning_content":"hm"},
            {"role":"user","content":"again"}],
            "max_completion_tokens":5,"max_tokens":9,"temperature":0.5,"top_p":0.9,"seed":-1,
            "stop":"\n","stream":true,"stream_options":{"include_usage":true},
            "chat_template_kwargs":{"enable_thinking":false},"tools":[]}"#,
        )
        .unwrap();
        assert_eq!(r.messages.len(), 4);
        assert_eq!(r.messages[0].role, "system");
        assert_eq!(r.messages[1].content, "hi there");
        assert_eq!(r.messages[2].reasoning_content.as_deref(), Some("hm"));
        assert_eq!(r.think, Some(false));
        let c = &r.common;
        assert_eq!(c.max_tokens, Some(5), "max_completion_tokens wins");
        assert_eq!((c.temperature, c.top_p), (Some(0.5), Some(0.9)));
        assert_eq!(c.seed, Some(u64::MAX));
        assert_eq!(c.stop, vec!["\n".to_string()]);
        assert!(c.stream && c.include_usage);
    }

    #[test]
    fn bad_chat_requests_name_the_field() {
        for (body, param, needle) in [
            ("{", None, "not valid JSON"),
            ("[1]", None, "JSON object"),
            (r#"{}"#, Some("messages"), "missing"),
            (r#"{"messages":[]}"#, Some("messages"), "empty"),
            (
                r#"{"messages":"hi"}"#,
                Some("messages"),
                "expected an array",
            ),
            (
                r#"{"messages":[{"role":"wizard","content":"x"}]}"#,
                Some("messages[0].role"),
                "unknown role \"wizard\"",
            ),
            (
                r#"{"messages":[{"content":"x"}]}"#,
                Some("messages[0].role"),
                "missing",
            ),
            (
                r#"{"messages":[{"role":"user","content":5}]}"#,
                Some("messages[0].content"),
                "got a number",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                Some("messages[0].content"),
                "not supported",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":0}"#,
                Some("max_tokens"),
                ">= 1",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"8"}"#,
                Some("max_tokens"),
                "got a string",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"temperature":3}"#,
                Some("temperature"),
                "from 0 to 2",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
                Some("stream"),
                "true or false",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"stop":[1]}"#,
                Some("stop"),
                "stop[0]",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"n":17}"#,
                Some("n"),
                "at most 16",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f x"}}]}"#,
                Some("tools"),
                "tools[0]: function.name",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"code"}]}"#,
                Some("tools"),
                "tools[0]",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tool_choice":"required"}"#,
                Some("tool_choice"),
                "needs tools",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"g"}}}"#,
                Some("tool_choice"),
                "not among",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required","response_format":{"type":"json_object"}}"#,
                Some("tool_choice"),
                "cannot be combined",
            ),
            (
                r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":5}}]}]}"#,
                Some("messages[0].tool_calls"),
                "arguments",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"yaml"}}"#,
                Some("response_format"),
                "json_object or json_schema",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema"}}"#,
                Some("response_format"),
                "missing",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"grammar":7}"#,
                Some("grammar"),
                "expected a string",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"grammar":"start: \"a\"","json_schema":{}}"#,
                Some("grammar"),
                "one constraint",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"mirostat":2}"#,
                Some("mirostat"),
                "not supported",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":3}"#,
                Some("top_logprobs"),
                "needs",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}"#,
                Some("top_logprobs"),
                "at most 20",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"abc":1}}"#,
                Some("logit_bias"),
                "token id",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"5":101}}"#,
                Some("logit_bias"),
                "-100 to 100",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"presence_penalty":3}"#,
                Some("presence_penalty"),
                "from -2 to 2",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"min_p":1.5}"#,
                Some("min_p"),
                "from 0 to 1",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"repeat_penalty":0}"#,
                Some("repeat_penalty"),
                "above 0",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"reasoning_effort":"extreme"}"#,
                Some("reasoning_effort"),
                "expected \"low\", \"medium\" or \"high\"",
            ),
        ] {
            let e = chat_err(body);
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), param, "{body}: {}", e.message);
            assert!(e.message.contains(needle), "{body}: {}", e.message);
            assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn tools_and_the_tool_role_parse() {
        let r = chat_request(
            br#"{"messages":[{"role":"user","content":"weather?"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}}]},
            {"role":"tool","tool_call_id":"call_1","content":"12 C"}],
            "tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],
            "tool_choice":{"type":"function","function":{"name":"get_weather"}}}"#,
        )
        .unwrap();
        assert_eq!(r.messages[1].tool_calls[0].name, "get_weather");
        assert_eq!(r.messages[1].content, "");
        assert_eq!(r.messages[2].role, "tool");
        assert_eq!(r.messages[2].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(r.tools.len(), 1);
        assert_eq!(r.tool_defs.len(), 1);
        assert_eq!(
            r.tool_choice,
            crate::tools::ToolChoice::Named("get_weather".into())
        );
        let r = chat_request(br#"{"messages":[{"role":"user","content":"x"}]}"#).unwrap();
        assert_eq!(r.tool_choice, crate::tools::ToolChoice::Auto);
    }

    #[test]
    fn the_sampling_surface_parses_and_neutral_values_of_unsupported_fields_pass() {
        let r = chat_request(
            br#"{"messages":[{"role":"user","content":"x"}],"n":3,"min_p":0.1,
            "presence_penalty":-0.5,"frequency_penalty":0.5,"repeat_penalty":1.1,"repeat_last_n":-1,
            "logit_bias":{"7":-100,"9":2.5},"logprobs":true,"top_logprobs":2,
            "tools":[],"tool_choice":"none","response_format":{"type":"text"},"typical_p":1.0,
            "mirostat":0,"modalities":["text"],"user":"u","store":false}"#,
        )
        .unwrap();
        let c = &r.common;
        assert_eq!(c.n, 3);
        assert_eq!(c.min_p, Some(0.1));
        assert_eq!(
            (c.presence_penalty, c.frequency_penalty),
            (Some(-0.5), Some(0.5))
        );
        assert_eq!(
            (c.repeat_penalty, c.repeat_last_n),
            (Some(1.1), Some(usize::MAX))
        );
        assert_eq!(c.logit_bias, vec![(7, -100.0), (9, 2.5)]);
        assert_eq!(c.logprobs, Some(2));
        let r = chat_request(
            br#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"logit_bias":[[3,false]]}"#,
        )
        .unwrap();
        assert_eq!(r.common.logprobs, Some(0));
        assert_eq!(r.common.logit_bias, vec![(3, f32::NEG_INFINITY)]);
        assert_eq!(r.common.n, 1);
        let c = completion_request(br#"{"prompt":"a","logprobs":3,"best_of":1}"#).unwrap();
        assert_eq!(c.common.logprobs, Some(3));
        for (body, param) in [
            (r#"{"prompt":"a","logprobs":21}"#, "logprobs"),
            (r#"{"prompt":"a","best_of":2}"#, "best_of"),
            (r#"{"prompt":"a","suffix":"b"}"#, "suffix"),
            (r#"{"prompt":"a","grammar":"root ::= \"x"}"#, "grammar"),
            (
                r#"{"prompt":"a","response_format":{"type":"json_schema","json_schema":{"schema":3}}}"#,
                "response_format",
            ),
        ] {
            let e = completion_request(body.as_bytes()).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn completion_requests_parse() {
        let r = completion_request(br#"{"prompt":["once"],"max_tokens":3}"#).unwrap();
        assert_eq!(r.prompt, "once");
        assert_eq!(r.common.max_tokens, Some(3));
        assert!(completion_request(br#"{"prompt":["a","b"]}"#).is_err());
        assert!(completion_request(br#"{"prompt":7}"#).is_err());
        assert!(completion_request(br#"{}"#).is_err());
    }
}
