//! Tool calling: which syntax a model's chat template gives tool calls, reading the calls out
//! of a generated answer, and the grammar that makes a model call one (`tool_choice:
//! "required"` or a named function) through constrained decoding.
//!
//! The syntax is recognised from the template's own text, never the model's name:
//!
//! - **Hermes** (Qwen2.5/Qwen3 and their kin): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`;
//! - **Harmony** (gpt-oss): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`;
//! - **Gemma 4**: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, strings quoted as `<|"|>...<|"|>`.
//!
//! A template with none of these has no tool calls this server can read: a request with
//! tools is refused for it by name rather than answered as if there were none.

use crate::chat::ToolCall;
use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

/// How a model writes a tool call.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Harmony,
    Gemma4,
}

/// A tool a request offers: its name and the JSON Schema of its arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub parameters: Value,
}

/// What a request allows (`tool_choice`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The tools are shown to the model; its answer is not read for calls.
    None,
    /// The model may call tools (the default when tools are given).
    Auto,
    /// The model must call one of the tools.
    Required,
    /// The model must call this one.
    Named(String),
}

/// An answer split into its text and its tool calls.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    pub content: String,
    /// (name, arguments as JSON text)
    pub calls: Vec<(String, String)>,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const HARMONY_TO: &str = "to=functions.";
const GEMMA_OPEN: &str = "<|tool_call>call:";
const GEMMA_CLOSE: &str = "<tool_call|>";
const GEMMA_QUOTE: &str = "<|\"|>";

impl ToolFormat {
    /// The syntax a chat template writes tool calls in, if it writes any we read.
    pub fn of_template(source: &str) -> Option<ToolFormat> {
        if source.contains("<|tool_call>call:") {
            Some(ToolFormat::Gemma4)
        } else if source.contains("<|call|>") && source.contains("functions.") {
            Some(ToolFormat::Harmony)
        } else if source.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Harmony => "harmony",
            ToolFormat::Gemma4 => "gemma4",
        }
    }

    /// Where a call may begin in streamed text: the answer is held back from here (a prefix
    /// of it at the end of the text is held back too, as a stop string's is).
    pub fn marker(self) -> &'static str {
        match self {
            ToolFormat::Hermes => HERMES_OPEN,
            ToolFormat::Harmony => "<|channel|>commentary",
            ToolFormat::Gemma4 => "<|tool_call>",
        }
    }

    /// Split a whole answer into its text and its calls. A call whose arguments do not parse
    /// stays in the text: nothing is invented.
    pub fn parse(self, text: &str) -> Parsed {
        match self {
            ToolFormat::Hermes => parse_hermes(text),
            ToolFormat::Harmony => parse_harmony(text),
            ToolFormat::Gemma4 => parse_gemma(text),
        }
    }

    /// The Lark grammar of one call to one of `tools` (all of them, or the one `choice`
    /// names). `special` says whether a marker is a control token of the vocabulary (named
    /// `<|...|>` in the grammar) or text.
    pub fn grammar(
        self,
        tools: &[Tool],
        choice: &ToolChoice,
        special: &dyn Fn(&str) -> bool,
    ) -> Result<String> {
        let chosen: Vec<&Tool> = match choice {
            ToolChoice::Named(n) => {
                let t = tools.iter().find(|t| &t.name == n).ok_or_else(|| {
                    anyhow!("tool_choice names {n:?}, which is not among the tools")
                })?;
                vec![t]
            }
            _ => tools.iter().collect(),
        };
        if chosen.is_empty() {
            bail!("tool_choice \"required\" needs at least one tool");
        }
        let lit = |s: &str| -> String {
            if special(s)
                && s.starts_with('<')
                && s.ends_with('>')
                && !s.contains(char::is_whitespace)
            {
                s.to_string()
            } else {
                serde_json::to_string(s).unwrap_or_default()
            }
        };
        let mut g = String::new();
        let alts: Vec<String> = (0..chosen.len()).map(|i| format!("call{i}")).collect();
        g.push_str(&format!("start: {}\n", alts.join(" | ")));
        for (i, t) in chosen.iter().enumerate() {
            let schema = compact(t.parameters.clone());
            match self {
                ToolFormat::Hermes => {
                    let call = compact(json!({
                        "type": "object",
                        "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                        "required": ["name", "arguments"],
                        "additionalProperties": false,
                    }));
                    g.push_str(&format!(
                        "call{i}: {} \"\\n\" body{i} \"\\n\" {}\nbody{i}: %json {}\n",
                        lit(HERMES_OPEN),
                        lit(HERMES_CLOSE),
                        call
                    ));
                }
                ToolFormat::Harmony => {
                    g.push_str(&format!(
                        "call{i}: {} {} {} {} {} args{i} {}\nargs{i}: %json {}\n",
                        lit("<|channel|>"),
                        serde_json::to_string(&format!("commentary to=functions.{} ", t.name))?,
                        lit("<|constrain|>"),
                        serde_json::to_string("json")?,
                        lit("<|message|>"),
                        lit("<|call|>"),
                        schema
                    ));
                }
                ToolFormat::Gemma4 => {
                    let q = lit(GEMMA_QUOTE);
                    let props = t.parameters.get("properties").and_then(Value::as_object);
                    let required: Vec<&str> = t
                        .parameters
                        .get("required")
                        .and_then(Value::as_array)
                        .map(|r| r.iter().filter_map(Value::as_str).collect())
                        .unwrap_or_default();
                    // The template sorts the keys (`dictsort`): the required ones, in order.
                    let mut keys: Vec<&str> = required.clone();
                    keys.sort_unstable();
                    let mut pairs = Vec::new();
                    for k in keys {
                        let ps = props.and_then(|p| p.get(k)).cloned().unwrap_or(json!({}));
                        pairs.push(format!(
                            "{} {}",
                            serde_json::to_string(&format!("{k}:"))?,
                            gemma_value(&ps, &q)
                        ));
                    }
                    let body = if pairs.is_empty() {
                        String::new()
                    } else {
                        pairs.join(" \",\" ")
                    };
                    g.push_str(&format!(
                        "call{i}: {} {} {} \"}}\" {}\n",
                        lit("<|tool_call>"),
                        serde_json::to_string(&format!("call:{}{{", t.name))?,
                        body,
                        lit(GEMMA_CLOSE)
                    ));
                }
            }
        }
        Ok(g)
    }
}

/// A schema with no free whitespace in what it generates.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false}));
    }
    schema
}

/// A Gemma 4 argument value of `schema`'s type, as Lark (strings bounded so a weak model
/// cannot run on forever; objects and arrays, which this grammar does not describe, as strings).
fn gemma_value(schema: &Value, q: &str) -> String {
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        let alts: Vec<String> = e
            .iter()
            .map(|v| match v {
                Value::String(s) => {
                    format!("{q} {} {q}", serde_json::to_string(s).unwrap_or_default())
                }
                other => serde_json::to_string(&other.to_string()).unwrap_or_default(),
            })
            .collect();
        if !alts.is_empty() {
            return format!("({})", alts.join(" | "));
        }
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("integer") => {
            let lo = schema.get("minimum").and_then(Value::as_i64);
            let hi = schema.get("maximum").and_then(Value::as_i64);
            match (lo, hi) {
                // A small range: every value, spelled out.
                (Some(lo), Some(hi)) if lo <= hi && hi - lo <= 256 => {
                    let alts: Vec<String> = (lo..=hi).map(|v| format!("\"{v}\"")).collect();
                    format!("({})", alts.join(" | "))
                }
                (Some(lo), _) if lo >= 0 => "/[0-9]{1,9}/".into(),
                _ => "/-?[0-9]{1,9}/".into(),
            }
        }
        Some("number") => "/-?[0-9]{1,9}(\\.[0-9]{1,6})?/".into(),
        Some("boolean") => "(\"true\" | \"false\")".into(),
        _ => {
            let max = schema
                .get("maxLength")
                .and_then(Value::as_u64)
                .unwrap_or(48)
                .min(48);
            let min = schema
                .get("minLength")
                .and_then(Value::as_u64)
                .unwrap_or(0)
                .min(max);
            // No quote inside: the closing quote is a token (or text) of its own.
            format!("{q} /[^<\"\\\\]{{{min},{max}}}/ {q}")
        }
    }
}

/// `{"name": ..., "arguments": ...}` (or `"parameters"`) as a call.
fn call_of_json(v: &Value) -> Option<(String, String)> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(json!({}));
    let args = match args {
        // Some models write the arguments as a JSON string.
        Value::String(s) if serde_json::from_str::<Value>(&s).is_ok_and(|v| v.is_object()) => s,
        Value::Object(_) => args.to_string(),
        _ => return None,
    };
    Some((name, args))
}

fn parse_hermes(text: &str) -> Parsed {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(HERMES_OPEN) {
        let body_start = at + HERMES_OPEN.len();
        let (body, next) = match rest[body_start..].find(HERMES_CLOSE) {
            Some(e) => (
                &rest[body_start..body_start + e],
                body_start + e + HERMES_CLOSE.len(),
            ),
            // The answer ended (at the end of turn) before the closing tag.
            None => (&rest[body_start..], rest.len()),
        };
        match serde_json::from_str::<Value>(body.trim())
            .ok()
            .as_ref()
            .and_then(call_of_json)
        {
            Some(c) => {
                content.push_str(&rest[..at]);
                calls.push(c);
            }
            None => content.push_str(&rest[..next]),
        }
        rest = &rest[next..];
    }
    content.push_str(rest);
    parsed(content, calls)
}

fn parse_harmony(text: &str) -> Parsed {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(to) = rest.find(HARMONY_TO) {
        let name_start = to + HARMONY_TO.len();
        let name_len = rest[name_start..]
            .find(|c: char| c.is_whitespace() || c == '<')
            .unwrap_or(rest.len() - name_start);
        let name = &rest[name_start..name_start + name_len];
        let Some(msg) = rest[name_start..].find("<|message|>") else {
            break;
        };
        let args_start = name_start + msg + "<|message|>".len();
        let args_len = ["<|call|>", "<|end|>", "<|start|>"]
            .iter()
            .filter_map(|m| rest[args_start..].find(m))
            .min()
            .unwrap_or(rest.len() - args_start);
        let args = rest[args_start..args_start + args_len].trim();
        let mut next = args_start + args_len;
        if rest[next..].starts_with("<|call|>") {
            next += "<|call|>".len();
        }
        // The call's header starts at the channel marker (or the turn's start) before it.
        let head = rest[..to]
            .rfind("<|start|>")
            .into_iter()
            .chain(rest[..to].rfind("<|channel|>"))
            .min()
            .unwrap_or(to);
        let ok =
            !name.is_empty() && serde_json::from_str::<Value>(args).is_ok_and(|v| v.is_object());
        if ok {
            content.push_str(&rest[..head]);
            calls.push((name.to_string(), args.to_string()));
        } else {
            content.push_str(&rest[..next]);
        }
        rest = &rest[next..];
    }
    content.push_str(rest);
    parsed(content, calls)
}

/// A Gemma 4 argument list `key:value,...` (the braces' inside) as a JSON object.
fn gemma_args(s: &str) -> Option<Value> {
    let mut p = GemmaParser { s, at: 0 };
    let mut out = serde_json::Map::new();
    p.ws();
    if p.at == s.len() {
        return Some(Value::Object(out));
    }
    loop {
        let key = p.key()?;
        p.ws();
        p.eat(":")?;
        let v = p.value()?;
        out.insert(key, v);
        p.ws();
        if p.at == s.len() {
            return Some(Value::Object(out));
        }
        p.eat(",")?;
        p.ws();
    }
}

struct GemmaParser<'a> {
    s: &'a str,
    at: usize,
}

impl<'a> GemmaParser<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.at..]
    }
    fn ws(&mut self) {
        let t = self.rest().len() - self.rest().trim_start().len();
        self.at += t;
    }
    fn eat(&mut self, t: &str) -> Option<()> {
        self.rest().starts_with(t).then(|| self.at += t.len())
    }
    fn key(&mut self) -> Option<String> {
        if self.rest().starts_with(GEMMA_QUOTE) {
            return self.quoted();
        }
        let n = self
            .rest()
            .find(|c: char| c == ':' || c.is_whitespace())
            .unwrap_or(self.rest().len());
        (n > 0).then(|| {
            let k = self.rest()[..n].to_string();
            self.at += n;
            k
        })
    }
    fn quoted(&mut self) -> Option<String> {
        self.eat(GEMMA_QUOTE)?;
        let end = self.rest().find(GEMMA_QUOTE)?;
        let v = self.rest()[..end].to_string();
        self.at += end + GEMMA_QUOTE.len();
        Some(v)
    }
    fn value(&mut self) -> Option<Value> {
        self.ws();
        let r = self.rest();
        if r.starts_with(GEMMA_QUOTE) {
            return self.quoted().map(Value::String);
        }
        if self.eat("{").is_some() {
            let mut m = serde_json::Map::new();
            self.ws();
            if self.eat("}").is_some() {
                return Some(Value::Object(m));
            }
            loop {
                let k = self.key()?;
                self.ws();
                self.eat(":")?;
                let v = self.value()?;
                m.insert(k, v);
                self.ws();
                if self.eat("}").is_some() {
                    return Some(Value::Object(m));
                }
                self.eat(",")?;
                self.ws();
            }
        }
        if self.eat("[").is_some() {
            let mut a = Vec::new();
            self.ws();
            if self.eat("]").is_some() {
                return Some(Value::Array(a));
            }
            loop {
                a.push(self.value()?);
                self.ws();
                if self.eat("]").is_some() {
                    return Some(Value::Array(a));
                }
                self.eat(",")?;
            }
        }
        let n = r
            .find(|c: char| c == ',' || c == '}' || c == ']' || c.is_whitespace())
            .unwrap_or(r.len());
        let word = &r[..n];
        let v = match word {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            "null" | "None" => Value::Null,
            w => serde_json::from_str::<serde_json::Number>(w)
                .ok()
                .map(Value::Number)?,
        };
        self.at += n;
        Some(v)
    }
}

fn parse_gemma(text: &str) -> Parsed {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(GEMMA_OPEN) {
        let name_start = at + GEMMA_OPEN.len();
        let Some(brace) = rest[name_start..].find('{') else {
            break;
        };
        let name = rest[name_start..name_start + brace].trim();
        let args_start = name_start + brace + 1;
        let (inner, next) = match rest[args_start..].find(GEMMA_CLOSE) {
            Some(e) => {
                let body = rest[args_start..args_start + e].trim_end();
                (
                    body.strip_suffix('}').unwrap_or(body),
                    args_start + e + GEMMA_CLOSE.len(),
                )
            }
            None => {
                let body = rest[args_start..].trim_end();
                (body.strip_suffix('}').unwrap_or(body), rest.len())
            }
        };
        match gemma_args(inner).filter(|_| !name.is_empty()) {
            Some(args) => {
                content.push_str(&rest[..at]);
                calls.push((name.to_string(), args.to_string()));
            }
            None => content.push_str(&rest[..next]),
        }
        rest = &rest[next..];
    }
    content.push_str(rest);
    parsed(content, calls)
}

/// An answer split: its text (trimmed when calls were taken out of it) and its calls.
fn parsed(content: String, calls: Vec<(String, String)>) -> Parsed {
    Parsed {
        content: if calls.is_empty() {
            content
        } else {
            content.trim().to_string()
        },
        calls,
    }
}

/// The calls of a parsed answer with OpenAI ids (`call_<request>_<choice>_<n>`).
pub fn with_ids(calls: &[(String, String)], prefix: &str) -> Vec<ToolCall> {
    calls
        .iter()
        .enumerate()
        .map(|(i, (name, arguments))| ToolCall {
            id: format!("call_{prefix}_{i}"),
            name: name.clone(),
            arguments: arguments.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_is_recognised_from_its_template() {
        let t = |p: &str| std::fs::read_to_string(crate::testdata::shared_path(p)?).ok();
        for (file, want) in [
            (
                "data/templates/Qwen-Qwen3-0.6B.jinja",
                Some(ToolFormat::Hermes),
            ),
            (
                "data/templates/openai-gpt-oss-120b.jinja",
                Some(ToolFormat::Harmony),
            ),
            (
                "data/templates/google-gemma-4-31B-it.jinja",
                Some(ToolFormat::Gemma4),
            ),
            ("data/templates/google-gemma-2-2b-it.jinja", None),
        ] {
            let Some(src) = t(file) else {
                return;
            };
            assert_eq!(ToolFormat::of_template(&src), want, "{file}");
        }
        assert_eq!(
            ToolFormat::of_template(crate::vocab::BUILTIN_CHAT_TEMPLATE),
            None
        );
    }

    #[test]
    fn hermes_calls_are_read_and_bad_ones_left_as_text() {
        let p = ToolFormat::Hermes.parse(
            "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": \"{\\\"a\\\": 1}\"}\n</tool_call>",
        );
        assert_eq!(p.content, "Let me look.");
        assert_eq!(
            p.calls,
            vec![
                ("get_weather".into(), r#"{"city":"Paris"}"#.into()),
                ("t".into(), r#"{"a": 1}"#.into())
            ]
        );
        // Unclosed at the end of the turn: still a call.
        let p = ToolFormat::Hermes.parse("<tool_call>\n{\"name\":\"f\",\"arguments\":{}}");
        assert_eq!(p.calls.len(), 1);
        // Not JSON: text, untouched.
        let t = "see <tool_call>not json</tool_call> here";
        assert_eq!(
            ToolFormat::Hermes.parse(t),
            Parsed {
                content: t.into(),
                calls: vec![]
            }
        );
    }

    #[test]
    fn harmony_calls_are_read() {
        let p = ToolFormat::Harmony.parse(
            "<|channel|>analysis<|message|>need weather<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}<|call|>",
        );
        assert_eq!(
            p.calls,
            vec![("get_weather".into(), r#"{"city":"Oslo"}"#.into())]
        );
        assert_eq!(
            p.content,
            "<|channel|>analysis<|message|>need weather<|end|>"
        );
        let p = ToolFormat::Harmony
            .parse("<|channel|>commentary to=functions.f json<|message|>{\"x\":1}");
        assert_eq!(p.calls, vec![("f".into(), r#"{"x":1}"#.into())]);
        assert_eq!(p.content, "");
    }

    #[test]
    fn gemma_calls_are_read_as_json() {
        let p = ToolFormat::Gemma4.parse(
            "ok <|tool_call>call:get_weather{city:<|\"|>Paris, FR<|\"|>,days:3,hot:true,opts:{unit:<|\"|>c<|\"|>},tags:[1,2]}<tool_call|>",
        );
        assert_eq!(p.content, "ok");
        assert_eq!(p.calls.len(), 1);
        let v: Value = serde_json::from_str(&p.calls[0].1).unwrap();
        assert_eq!(
            v,
            json!({"city": "Paris, FR", "days": 3, "hot": true, "opts": {"unit": "c"}, "tags": [1, 2]})
        );
        assert_eq!(
            ToolFormat::Gemma4
                .parse("<|tool_call>call:f{}<tool_call|>")
                .calls[0]
                .1,
            "{}"
        );
        let bad = "<|tool_call>call:f{a:<|\"|>unterminated}<tool_call|>";
        assert!(ToolFormat::Gemma4.parse(bad).calls.is_empty());
    }

    #[test]
    fn required_grammars_compile_and_name_the_tool() {
        let tools = vec![
            Tool {
                name: "get_weather".into(),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}),
            },
            Tool {
                name: "noop".into(),
                parameters: json!({"type": "object", "properties": {}}),
            },
        ];
        let none = |_: &str| false;
        for f in [ToolFormat::Hermes, ToolFormat::Harmony, ToolFormat::Gemma4] {
            let g = f.grammar(&tools, &ToolChoice::Required, &none).unwrap();
            assert!(g.contains("get_weather") && g.contains("noop"), "{g}");
            let spec = crate::constrain::Spec::Lark(g.clone());
            crate::constrain::tests_compile(&spec).unwrap_or_else(|e| panic!("{f:?}: {e}\n{g}"));
            let g = f
                .grammar(&tools, &ToolChoice::Named("noop".into()), &none)
                .unwrap();
            assert!(!g.contains("get_weather"), "{g}");
        }
        let e = ToolFormat::Hermes
            .grammar(&tools, &ToolChoice::Named("nope".into()), &none)
            .unwrap_err();
        assert!(e.to_string().contains("not among"));
    }
}
