//! The OpenAI request bodies `bmoe-cli serve` takes, checked field by field, and the error
//! shape it answers with. Every way a body can be wrong is a 400 whose message names the
//! field and what was expected; fields we do not know are ignored (clients send many).

use crate::chat::Message;
use crate::session::type_name;
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
    pub common: Common,
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
    if let Some(n) = f.count("n", 1)? {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("n: only 1 choice per request is served, got {n}"),
            ));
        }
    }
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
    Ok(Common {
        max_tokens,
        temperature: f.number("temperature", 0.0, 2.0)?,
        top_p: f.number("top_p", 0.0, 1.0)?,
        top_k: f.count("top_k", 0)?.map(|k| k.min(1 << 20) as usize),
        seed,
        stop,
        stream: f.bool("stream")?.unwrap_or(false),
        include_usage,
        ngram: f.bool("ngram")?,
        mtp: f.bool("mtp")?,
    })
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
            other => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!(
                        "messages[{i}].role: unknown role {}: expected system, developer, user or assistant",
                        serde_json::to_string(other).unwrap_or_default()
                    ),
                ))
            }
        };
        let text = content(i, o.get("content"), role)?;
        let mut msg = Message::new(role, text);
        if role == "assistant" {
            if let Some(Value::String(r)) = o.get("reasoning_content") {
                msg = msg.with_reasoning(r.clone());
            }
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
    Ok(ChatRequest {
        messages,
        think,
        common: common(&m)?,
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
    Ok(CompletionRequest {
        prompt,
        common: common(&m)?,
    })
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
                r#"{"messages":[{"role":"user","content":"x"}],"n":2}"#,
                Some("n"),
                "only 1",
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
    fn completion_requests_parse() {
        let r = completion_request(br#"{"prompt":["once"],"max_tokens":3}"#).unwrap();
        assert_eq!(r.prompt, "once");
        assert_eq!(r.common.max_tokens, Some(3));
        assert!(completion_request(br#"{"prompt":["a","b"]}"#).is_err());
        assert!(completion_request(br#"{"prompt":7}"#).is_err());
        assert!(completion_request(br#"{}"#).is_err());
    }
}
