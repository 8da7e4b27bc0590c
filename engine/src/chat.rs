//! Chat prompts and the thinking span: render a model's own Jinja chat template the way Hugging
//! Face transformers does, decide how a "think: false" request can be honoured
//! ([`ThinkCtl`], the `think_ctl` of the telemetry contract), and split generated text into
//! reasoning and answer as it streams ([`ReasoningSplitter`], the contract's
//! `delta_reasoning` / `delta_text` / `reset`).
//!
//! Rendering matches transformers' `apply_chat_template` byte for byte on the templates in
//! `../shared/data/templates` (golden files from `scripts/render-chat-golden.py`, checked by
//! `engine/tests/chat.rs`): `trim_blocks` and `lstrip_blocks`, loop controls,
//! `raise_exception`, `strftime_now`, a `tojson` that is Python's `json.dumps` with
//! `ensure_ascii=False`, Python string and dict methods, Python's spelling of `None`/`True`/
//! `False`, and the `{% generation %}` block of transformers' assistant-mask tracker.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior};

/// Every way a chat template can fail.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template does not compile: {message}")]
    Compile { message: String },
    #[error("chat template failed to render: {message}")]
    Render { message: String },
    #[error("the model has no chat template (tokenizer.chat_template is missing)")]
    Missing,
}

/// One chat turn. `reasoning_content` is the thinking span of an earlier assistant turn, passed
/// to the template under that name (transformers' convention); `None` leaves it undefined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
    pub reasoning_content: Option<String>,
    /// An assistant message's tool calls.
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message: the call it answers, and the tool's name.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// A tool call as the OpenAI API carries it: `arguments` is a JSON text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

impl ToolCall {
    /// As templates read it: `{"id", "type": "function", "function": {"name", "arguments"}}`,
    /// the arguments parsed to an object where they parse (templates print them with `tojson`
    /// or walk them as a mapping), else the text as given.
    fn to_value(&self) -> Value {
        let args = serde_json::from_str::<serde_json::Value>(&self.arguments)
            .ok()
            .filter(serde_json::Value::is_object)
            .map_or_else(
                || Value::from(self.arguments.as_str()),
                |v| Value::from_serialize(&v),
            );
        let function: Value = [
            ("name", Value::from(self.name.as_str())),
            ("arguments", args),
        ]
        .into_iter()
        .collect();
        [
            ("id", Value::from(self.id.as_str())),
            ("type", Value::from("function")),
            ("function", function),
        ]
        .into_iter()
        .collect()
    }
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    pub fn with_reasoning(mut self, reasoning: impl Into<String>) -> Self {
        self.reasoning_content = Some(reasoning.into());
        self
    }

    fn to_value(&self) -> Value {
        let mut fields: Vec<(&str, Value)> = vec![
            ("role", Value::from(self.role.as_str())),
            ("content", Value::from(self.content.as_str())),
        ];
        if let Some(r) = &self.reasoning_content {
            fields.push(("reasoning_content", Value::from(r.as_str())));
        }
        if !self.tool_calls.is_empty() {
            let calls: Vec<Value> = self.tool_calls.iter().map(ToolCall::to_value).collect();
            fields.push(("tool_calls", Value::from(calls)));
        }
        if let Some(id) = &self.tool_call_id {
            fields.push(("tool_call_id", Value::from(id.as_str())));
        }
        if let Some(n) = &self.name {
            fields.push(("name", Value::from(n.as_str())));
        }
        fields.into_iter().collect()
    }
}

/// How a request to not think can be honoured on a model (telemetry contract `think_ctl`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ThinkCtl {
    /// Passing `enable_thinking` is all there is to do: the template reads it, or the model
    /// does not reason and there is nothing to suppress.
    Template,
    /// The template ignores the flag, but reasoning is a structural section (harmony's
    /// analysis channel) the turn can be started past.
    Prefill,
    /// The model reasons on every turn in a span it owns and cannot be asked not to.
    None,
}

impl ThinkCtl {
    /// The contract's spelling: `template`, `prefill` or `none`.
    pub fn as_str(self) -> &'static str {
        match self {
            ThinkCtl::Template => "template",
            ThinkCtl::Prefill => "prefill",
            ThinkCtl::None => "none",
        }
    }
}

/// A calendar instant for `strftime_now` (no time zone: the template sees it as local time).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CivilTime {
    pub year: i32,
    /// 1..=12
    pub month: u32,
    /// 1..=31
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
}

impl CivilTime {
    /// The current UTC time from the system clock.
    pub fn now_utc() -> CivilTime {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        CivilTime::from_unix_seconds(secs)
    }

    /// The UTC calendar time of a Unix timestamp.
    pub fn from_unix_seconds(secs: i64) -> CivilTime {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        // Howard Hinnant's days-from-civil inverse.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = (yoe + era * 400 + if month <= 2 { 1 } else { 0 }) as i32;
        CivilTime {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem % 3600 / 60) as u32,
            second: (rem % 60) as u32,
        }
    }

    fn days_from_civil(&self) -> i64 {
        let y = self.year as i64 - if self.month <= 2 { 1 } else { 0 };
        let era = y.div_euclid(400);
        let yoe = y.rem_euclid(400);
        let m = self.month as i64;
        let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + self.day as i64 - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        era * 146_097 + doe - 719_468
    }

    /// 0 = Monday .. 6 = Sunday.
    fn weekday_from_monday(&self) -> usize {
        // 1970-01-01 was a Thursday (3).
        (self.days_from_civil() + 3).rem_euclid(7) as usize
    }

    fn day_of_year(&self) -> i64 {
        let jan1 = CivilTime {
            month: 1,
            day: 1,
            ..*self
        };
        self.days_from_civil() - jan1.days_from_civil() + 1
    }

    /// Format like C/Python `strftime` in the C locale. Supported: `%Y %y %m %d %e %H %I %M
    /// %S %p %b %h %B %a %A %j %w %u %F %T %D %R %%`; any other directive is kept verbatim.
    pub fn strftime(&self, format: &str) -> String {
        const MONTHS: [&str; 12] = [
            "January",
            "February",
            "March",
            "April",
            "May",
            "June",
            "July",
            "August",
            "September",
            "October",
            "November",
            "December",
        ];
        const DAYS: [&str; 7] = [
            "Monday",
            "Tuesday",
            "Wednesday",
            "Thursday",
            "Friday",
            "Saturday",
            "Sunday",
        ];
        let month_name = MONTHS[(self.month.clamp(1, 12) - 1) as usize];
        let day_name = DAYS[self.weekday_from_monday()];
        let hour12 = match self.hour % 12 {
            0 => 12,
            h => h,
        };
        let mut out = String::with_capacity(format.len() + 16);
        let mut chars = format.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let Some(d) = chars.next() else {
                out.push('%');
                break;
            };
            match d {
                'Y' => out.push_str(&self.year.to_string()),
                'y' => out.push_str(&format!("{:02}", self.year.rem_euclid(100))),
                'm' => out.push_str(&format!("{:02}", self.month)),
                'd' => out.push_str(&format!("{:02}", self.day)),
                'e' => out.push_str(&format!("{:2}", self.day)),
                'H' => out.push_str(&format!("{:02}", self.hour)),
                'I' => out.push_str(&format!("{:02}", hour12)),
                'M' => out.push_str(&format!("{:02}", self.minute)),
                'S' => out.push_str(&format!("{:02}", self.second)),
                'p' => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                'b' | 'h' => out.push_str(&month_name[..3]),
                'B' => out.push_str(month_name),
                'a' => out.push_str(&day_name[..3]),
                'A' => out.push_str(day_name),
                'j' => out.push_str(&format!("{:03}", self.day_of_year())),
                'w' => out.push_str(&((self.weekday_from_monday() + 1) % 7).to_string()),
                'u' => out.push_str(&(self.weekday_from_monday() + 1).to_string()),
                'F' => out.push_str(&format!("{}-{:02}-{:02}", self.year, self.month, self.day)),
                'T' => out.push_str(&format!(
                    "{:02}:{:02}:{:02}",
                    self.hour, self.minute, self.second
                )),
                'R' => out.push_str(&format!("{:02}:{:02}", self.hour, self.minute)),
                'D' => out.push_str(&format!(
                    "{:02}/{:02}/{:02}",
                    self.month,
                    self.day,
                    self.year.rem_euclid(100)
                )),
                '%' => out.push('%'),
                other => {
                    out.push('%');
                    out.push(other);
                }
            }
        }
        out
    }
}

/// A compiled chat template with the special-token strings it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_bytes", &self.source.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

const TEMPLATE_NAME: &str = "chat";

/// Instructions one render may execute: a base for the template's own text, plus a share per
/// message. The real templates in `../shared/data/templates` use at most ~220 + 170 per message
/// (Kimi-K3); Gemma 4's is quadratic (623k instructions for 402 messages), which this covers up
/// to ~5,000 messages. A hostile template (`{% for i in range(9**9) %}`) stops after ~100k
/// instructions plus the share of its messages, with an "out of fuel" error instead of
/// spinning: well under a second (the chat_template fuzz target found that a 1M base let a
/// loop over undefined names run ~0.4 s per render natively, seconds under a sanitizer).
const FUEL_BASE: u64 = 100_000;
/// See [`FUEL_BASE`].
const FUEL_PER_MESSAGE: u64 = 20_000;

fn render_fuel(n_messages: u64) -> u64 {
    FUEL_BASE.saturating_add(FUEL_PER_MESSAGE.saturating_mul(n_messages))
}

/// minijinja's recursion budget (nested blocks, loops, macro calls; a macro call costs more
/// than a loop). Its own default is 500, the most it considers safe without growing the stack.
const RECURSION_LIMIT: usize = 500;

impl ChatTemplate {
    /// Compile `source`. `bos` and `eos` are the texts of the model's BOS and EOS tokens,
    /// visible to the template as `bos_token` and `eos_token`. `strftime_now` reads the system
    /// clock (UTC); see [`ChatTemplate::with_fixed_time`].
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate, ChatError> {
        Self::build(source, bos, eos, None)
    }

    /// Like [`ChatTemplate::new`], with `strftime_now` always answering `now` (reproducible
    /// prompts, golden tests).
    pub fn with_fixed_time(
        source: &str,
        bos: &str,
        eos: &str,
        now: CivilTime,
    ) -> Result<ChatTemplate, ChatError> {
        Self::build(source, bos, eos, Some(now))
    }

    fn build(
        source: &str,
        bos: &str,
        eos: &str,
        now: Option<CivilTime>,
    ) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        env.set_recursion_limit(RECURSION_LIMIT);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson_filter);
        // Python cannot iterate None; minijinja can (as empty), so its `iterable` test says
        // yes to none. Templates guard `tools is iterable and tools | length > 0`.
        env.add_test("iterable", |v: Value| {
            !v.is_none() && (v.is_undefined() || v.try_iter().is_ok())
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", move |format: &str| -> String {
            now.unwrap_or_else(CivilTime::now_utc).strftime(format)
        });
        let prepared = rewrite_generation_blocks(source);
        env.add_template_owned(TEMPLATE_NAME, prepared)
            .map_err(|e| ChatError::Compile {
                message: describe(&e),
            })?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos: bos.to_string(),
            eos: eos.to_string(),
        })
    }

    /// The template text as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Render `messages` as transformers' `apply_chat_template(messages, tools=None,
    /// documents=None, add_generation_prompt, enable_thinking=…)` would. `enable_thinking`
    /// `None` leaves the variable undefined (the template's own default).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, ChatError> {
        self.render_tools(messages, &[], add_generation_prompt, enable_thinking)
    }

    /// [`ChatTemplate::render`] with `tools` (the request's tool definitions, as OpenAI sends
    /// them: `{"type": "function", "function": {...}}`); none leaves `tools` undefined.
    pub fn render_tools(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, ChatError> {
        self.render_with(
            messages,
            tools,
            add_generation_prompt,
            enable_thinking,
            None,
        )
    }

    /// [`ChatTemplate::render_tools`] with `reasoning_effort` defined (`low`, `medium`,
    /// `high`: what gpt-oss's template writes into its system message); `None` leaves it
    /// undefined.
    pub fn render_with(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
        reasoning_effort: Option<&str>,
    ) -> Result<String, ChatError> {
        let messages: Vec<Value> = messages.iter().map(Message::to_value).collect();
        let tools = if tools.is_empty() {
            Value::from(())
        } else {
            Value::from_serialize(tools)
        };
        self.render_context(
            Value::from(messages),
            tools,
            add_generation_prompt,
            enable_thinking,
            reasoning_effort,
        )
    }

    fn render_values(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, ChatError> {
        self.render_context(
            messages,
            Value::from(()),
            add_generation_prompt,
            enable_thinking,
            None,
        )
    }

    fn render_context(
        &self,
        messages: Value,
        tools: Value,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
        reasoning_effort: Option<&str>,
    ) -> Result<String, ChatError> {
        let n_messages = messages.len().unwrap_or(0) as u64;
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", messages),
            ("tools", tools),
            ("documents", Value::from(())),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.bos.as_str())),
            ("eos_token", Value::from(self.eos.as_str())),
        ];
        if let Some(t) = enable_thinking {
            ctx.push(("enable_thinking", Value::from(t)));
        }
        if let Some(e) = reasoning_effort {
            ctx.push(("reasoning_effort", Value::from(e)));
        }
        let ctx: Value = ctx.into_iter().collect();
        // A template is a program the model file supplies: its loops are bounded by fuel
        // (instructions per render, scaled to the conversation) and its nesting by the
        // recursion limit set at build, not by luck.
        let mut env = self.env.clone();
        env.set_fuel(Some(render_fuel(n_messages)));
        let template = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Render {
                message: describe(&e),
            })?;
        template.render(ctx).map_err(|e| ChatError::Render {
            message: describe(&e),
        })
    }

    /// How a "think: false" request can be honoured, assuming the vocabulary declares a
    /// `<think>`/`</think>` pair. See [`ChatTemplate::think_control_for_vocab`].
    pub fn think_control(&self) -> ThinkCtl {
        self.think_control_for_vocab(true)
    }

    /// Decide `think_ctl` from the template (telemetry contract), by rendering it: a
    /// one-question chat with `enable_thinking` true and false; if the prompts differ the
    /// template reads the flag (`Template`). Otherwise, if the vocabulary declares a think
    /// pair *and* the template owns a `<think>` span (renders one in a probe, or writes one in
    /// its source), the model always reasons (`None`). Otherwise, if the template puts an
    /// answer behind a marker of its own ([`ChatTemplate::answer_prefill`]) and renders a
    /// turn's reasoning in a section apart from that marked answer (harmony's analysis and
    /// final channels), the turn can be started past the reasoning (`Prefill`). Anything else
    /// has nothing to suppress (`Template`). A template that cannot render a probe counts as
    /// not having what that probe looks for.
    pub fn think_control_for_vocab(&self, vocab_declares_think: bool) -> ThinkCtl {
        let question = vec![Message::new("user", PROBE_QUESTION).to_value()];
        let on = self.render_values(Value::from(question.clone()), true, Some(true));
        let off = self.render_values(Value::from(question.clone()), true, Some(false));
        if let (Ok(on), Ok(off)) = (&on, &off) {
            if on != off {
                return ThinkCtl::Template;
            }
        }
        if vocab_declares_think && self.owns_think_span(&question, on.ok()) {
            return ThinkCtl::None;
        }
        if let Some(marker) = self.answer_prefill().filter(|m| !m.trim().is_empty()) {
            let reasoned = self.render_values(Value::from(answered(&question)), false, None);
            if reasoned.is_ok_and(|r| {
                r.contains(PROBE_REASONING) && r.contains(&format!("{marker}{PROBE_ANSWER}"))
            }) {
                return ThinkCtl::Prefill;
            }
        }
        ThinkCtl::Template
    }

    /// What the template writes between the generation prompt and an answer given without
    /// reasoning — harmony's `<|channel|>final<|message|>` — found by rendering a question with
    /// the generation prompt and the same question answered: the first must be a prefix of the
    /// second, and the text from there to the answer is the marker. Appended to a prompt it
    /// starts the turn at the answer, past any reasoning section (`think_ctl` `prefill` with
    /// `think:false`). `None` when the renders do not line up that way (or fail); empty when
    /// the answer follows the generation prompt directly.
    pub fn answer_prefill(&self) -> Option<String> {
        let question = vec![Message::new("user", PROBE_QUESTION).to_value()];
        let prompt = self
            .render_values(Value::from(question.clone()), true, None)
            .ok()?;
        let mut chat = question;
        chat.push(Message::new("assistant", PROBE_ANSWER).to_value());
        let done = self.render_values(Value::from(chat), false, None).ok()?;
        let rest = done.strip_prefix(prompt.as_str())?;
        let at = rest.find(PROBE_ANSWER)?;
        Some(rest[..at].to_string())
    }

    fn owns_think_span(&self, question: &[Value], prompt: Option<String>) -> bool {
        if self.source.contains("<think>") {
            return true;
        }
        if prompt.is_some_and(|p| p.contains("<think>")) {
            return true;
        }
        self.render_values(Value::from(answered(question)), false, None)
            .is_ok_and(|p| p.contains("<think>"))
    }
}

const PROBE_QUESTION: &str = "Hi";
const PROBE_ANSWER: &str = "Hello.";
const PROBE_REASONING: &str = "Greet back.";

/// `question` and a finished answer that carries reasoning under both common field names
/// (`reasoning_content`, transformers' convention; `thinking`, harmony's).
fn answered(question: &[Value]) -> Vec<Value> {
    let answer: Value = [
        ("role", Value::from("assistant")),
        ("content", Value::from(PROBE_ANSWER)),
        ("reasoning_content", Value::from(PROBE_REASONING)),
        ("thinking", Value::from(PROBE_REASONING)),
    ]
    .into_iter()
    .collect();
    let mut chat = question.to_vec();
    chat.push(answer);
    chat
}

/// A model's chat template with how it honours `think:false` worked out once: the prompt of a
/// turn, rendered so that a request not to reason is honoured the way the template allows
/// (telemetry contract, `think_ctl`).
#[derive(Debug)]
pub struct ChatFormat {
    template: ChatTemplate,
    think_ctl: ThinkCtl,
    /// What starts a turn past its reasoning section (`Prefill` templates only).
    answer_prefill: Option<String>,
}

impl ChatFormat {
    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        self.template.source()
    }

    /// `template` for a model whose vocabulary does (or does not) declare a `<think>` pair.
    pub fn new(template: ChatTemplate, vocab_declares_think: bool) -> ChatFormat {
        let think_ctl = template.think_control_for_vocab(vocab_declares_think);
        let answer_prefill = match think_ctl {
            ThinkCtl::Prefill => template.answer_prefill(),
            _ => None,
        };
        ChatFormat {
            template,
            think_ctl,
            answer_prefill,
        }
    }

    /// How `think:false` is honoured on this model.
    pub fn think_ctl(&self) -> ThinkCtl {
        self.think_ctl
    }

    /// The messages alone, without the generation prompt: where a turn boundary stands (a
    /// template that re-renders the answer next turn still renders these the same way).
    pub fn history(&self, messages: &[Message], think: bool) -> Result<String, ChatError> {
        self.history_tools(messages, &[], think)
    }

    /// [`ChatFormat::history`] with the request's tool definitions.
    pub fn history_tools(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        think: bool,
    ) -> Result<String, ChatError> {
        self.history_with(messages, tools, think, None)
    }

    /// [`ChatFormat::history_tools`] with `reasoning_effort` (see [`ChatTemplate::render_with`]).
    pub fn history_with(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        think: bool,
        effort: Option<&str>,
    ) -> Result<String, ChatError> {
        self.template
            .render_with(messages, tools, false, Some(think), effort)
    }

    /// [`ChatFormat::prompt`] with the request's tool definitions.
    pub fn prompt_tools(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        think: bool,
    ) -> Result<String, ChatError> {
        self.prompt_with(messages, tools, think, None)
    }

    /// [`ChatFormat::prompt_tools`] with `reasoning_effort` (see [`ChatTemplate::render_with`]).
    pub fn prompt_with(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        think: bool,
        effort: Option<&str>,
    ) -> Result<String, ChatError> {
        let mut text = self
            .template
            .render_with(messages, tools, true, Some(think), effort)?;
        if !think {
            if let Some(p) = &self.answer_prefill {
                text.push_str(p);
            }
        }
        Ok(text)
    }

    /// Whether the template reads `reasoning_effort` (gpt-oss's does; most do not).
    pub fn reads_reasoning_effort(&self) -> bool {
        self.template.source().contains("reasoning_effort")
    }

    /// The prompt of a turn answering `messages`: the template with its generation prompt and
    /// `enable_thinking = think`; with `think` false on a `prefill` template, followed by the
    /// marker that starts the answer past the reasoning section. (`template` templates read the
    /// flag themselves; a `none` model cannot be asked.)
    pub fn prompt(&self, messages: &[Message], think: bool) -> Result<String, ChatError> {
        self.prompt_tools(messages, &[], think)
    }
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' assistant-token tracker) only
/// records offsets; rewrite them to an always-true `if` with the same whitespace control so
/// the rendered text is unchanged.
fn rewrite_generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        // The closing `%}` is searched after the opening `{%`: in `{%}` they overlap.
        let Some(end) = tag[2..].find("%}").map(|i| i + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.push_str(lead);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.push_str(trail);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn describe(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// Print values as Jinja2 (Python) does: `None`, `True`, `False`; everything else as usual.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &minijinja::State,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(Error::from),
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`.
fn tojson_filter(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => Some(" ".repeat(v.as_usize().unwrap_or(0))),
            ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() => {
            let parts: Vec<Value> = s.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => (
                    a.as_str().unwrap_or(",").to_string(),
                    b.as_str().unwrap_or(":").to_string(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        // Python's defaults: ", " without indent, "," with it.
        _ => (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        ),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn newline_indent(out: &mut String, opts: &JsonOpts, level: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&python_float_repr(f));
            }
        }
        ValueKind::String => write_json_string(out, v.as_str().unwrap_or(""), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, level + 1);
                let key_text = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or("").to_string(),
                    ValueKind::None => "null".to_string(),
                    ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_string(),
                    _ => key.to_string(),
                };
                write_json_string(out, &key_text, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, &v.get_item(key)?, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push('}');
        }
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: Object of type Undefined is not JSON serializable",
            ))
        }
        _ => write_json_string(out, &v.to_string(), opts.ensure_ascii),
    }
    Ok(())
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{:04x}", unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents -4..16,
/// otherwise `d.ddde+XX`.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{:e}", f);
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let body = if exp >= 0 {
            if n > exp + 1 {
                format!(
                    "{}.{}",
                    &digits[..(exp + 1) as usize],
                    &digits[(exp + 1) as usize..]
                )
            } else {
                format!("{}{}.0", digits, "0".repeat((exp + 1 - n) as usize))
            }
        } else {
            format!("0.{}{}", "0".repeat((-exp - 1) as usize), digits)
        };
        format!("{sign}{body}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits.clone()
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{esign}{:02}", exp.abs())
    }
}

/// Where a prompt leaves the thinking span: `true` when its last `<think>` is not closed (the
/// generation starts inside the reasoning, e.g. DeepSeek-R1 or Qwen3.5 thinking prompts).
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

/// What one piece of generated text added to the reasoning and to the answer. With `reset`,
/// the two strings are full snapshots that *replace* everything delivered before (the
/// contract's `"reset":1`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    pub reasoning: String,
    pub text: String,
    pub reset: bool,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.text.is_empty() && !self.reset
    }
}

/// Splits streamed text into reasoning (inside `<think>…</think>`) and answer.
///
/// Guarantees: a tag split across pieces is recognised (a possible tag prefix at the end of a
/// piece is held back until the next piece decides it); tags never appear in either stream;
/// whitespace just inside the span and just after its end is dropped (`<think>\n…\n</think>\n\n`
/// yields the reasoning and the answer without the padding). If `</think>` arrives while we
/// believed we were in the answer, everything delivered so far is reclassified as reasoning and
/// the delta is a `reset` snapshot. The concatenation of all deltas (applying resets) plus
/// [`ReasoningSplitter::finish`] equals [`ReasoningSplitter::reasoning`] and
/// [`ReasoningSplitter::text`].
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    in_reasoning: bool,
    /// Text not yet classified: a possible tag prefix, or whitespace that may precede a tag.
    pending: String,
    /// Drop whitespace until the next non-space character (start of a span or of the answer).
    skip_leading_ws: bool,
    reasoning: String,
    text: String,
}

impl ReasoningSplitter {
    /// Start in reasoning mode when the prompt already opened the span.
    pub fn new(starts_in_reasoning: bool) -> Self {
        ReasoningSplitter {
            in_reasoning: starts_in_reasoning,
            pending: String::new(),
            skip_leading_ws: starts_in_reasoning,
            reasoning: String::new(),
            text: String::new(),
        }
    }

    /// A splitter for the generation that follows `prompt` (see [`prompt_opens_reasoning`]).
    pub fn for_prompt(prompt: &str) -> Self {
        Self::new(prompt_opens_reasoning(prompt))
    }

    /// Whether the next text is classified as reasoning.
    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    /// All reasoning delivered so far.
    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }

    /// All answer text delivered so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Feed one decoded piece; return what it added.
    pub fn push(&mut self, piece: &str) -> Delta {
        let mut buf = std::mem::take(&mut self.pending);
        buf.push_str(piece);
        let mut delta = Delta::default();
        let mut rest: &str = &buf;
        loop {
            if self.skip_leading_ws {
                let trimmed = rest.trim_start();
                rest = trimmed;
                if rest.is_empty() {
                    break;
                }
                self.skip_leading_ws = false;
            }
            let open = if self.in_reasoning {
                None
            } else {
                rest.find(THINK_OPEN)
            };
            let close = rest.find(THINK_CLOSE);
            let next = match (open, close) {
                (Some(o), Some(c)) if o < c => Some((o, true)),
                (Some(o), None) => Some((o, true)),
                (_, Some(c)) => Some((c, false)),
                (None, None) => None,
            };
            match next {
                Some((at, true)) => {
                    // `<think>` in the answer: a span opens.
                    self.emit(&mut delta, &rest[..at]);
                    self.in_reasoning = true;
                    self.skip_leading_ws = true;
                    rest = &rest[at + THINK_OPEN.len()..];
                }
                Some((at, false)) => {
                    let before = &rest[..at];
                    if self.in_reasoning {
                        self.emit_trimmed_end(&mut delta, before);
                    } else {
                        // A close we did not see open: all delivered so far was reasoning.
                        let mut all = std::mem::take(&mut self.reasoning);
                        all.push_str(&self.text);
                        all.push_str(before);
                        self.reasoning = all.trim().to_string();
                        self.text.clear();
                        delta = Delta {
                            reasoning: self.reasoning.clone(),
                            text: String::new(),
                            reset: true,
                        };
                    }
                    self.in_reasoning = false;
                    self.skip_leading_ws = true;
                    rest = &rest[at + THINK_CLOSE.len()..];
                }
                None => {
                    let hold = self.holdback_len(rest);
                    let (now, later) = rest.split_at(rest.len() - hold);
                    self.emit(&mut delta, now);
                    self.pending = later.to_string();
                    break;
                }
            }
        }
        delta
    }

    /// End of generation: classify whatever was held back.
    pub fn finish(&mut self) -> Delta {
        let rest = std::mem::take(&mut self.pending);
        let mut delta = Delta::default();
        if self.skip_leading_ws {
            let t = rest.trim_start();
            if self.in_reasoning {
                self.emit_trimmed_end(&mut delta, t);
            } else {
                self.emit(&mut delta, t);
            }
        } else if self.in_reasoning {
            self.emit_trimmed_end(&mut delta, &rest);
        } else {
            self.emit(&mut delta, &rest);
        }
        delta
    }

    fn emit(&mut self, delta: &mut Delta, s: &str) {
        if s.is_empty() {
            return;
        }
        if self.in_reasoning {
            self.reasoning.push_str(s);
            delta.reasoning.push_str(s);
        } else {
            self.text.push_str(s);
            delta.text.push_str(s);
        }
    }

    /// Reasoning text right before the end of the span: drop its trailing whitespace.
    fn emit_trimmed_end(&mut self, delta: &mut Delta, s: &str) {
        let t = s.trim_end();
        self.emit(delta, t);
    }

    /// How many bytes at the end of `s` must wait: a proper prefix of a tag we could be
    /// reading, and, inside a span, trailing whitespace that may turn out to precede `</think>`.
    fn holdback_len(&self, s: &str) -> usize {
        let mut hold = 0;
        let mut tags: Vec<&str> = vec![THINK_CLOSE];
        if !self.in_reasoning {
            tags.push(THINK_OPEN);
        }
        for tag in tags {
            for k in (1..tag.len()).rev() {
                if k <= s.len() && s.is_char_boundary(s.len() - k) && s.ends_with(&tag[..k]) {
                    hold = hold.max(k);
                    break;
                }
            }
        }
        if self.in_reasoning {
            let body = &s[..s.len() - hold];
            let ws = body.len() - body.trim_end().len();
            hold += ws;
        }
        hold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Render `source` on a thread with the stack a spawned thread gets by default (2 MiB),
    /// as a server's worker would.
    fn render_hostile(source: &str) -> Result<String, ChatError> {
        let source = source.to_string();
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let t = ChatTemplate::new(&source, "<s>", "</s>")?;
                t.render(&[Message::new("user", "hi")], true, None)
            })
            .expect("spawn")
            .join()
            .expect("no stack overflow, no panic")
    }

    #[test]
    fn hostile_templates_are_bounded_by_fuel_and_recursion() {
        // A loop of 9^9 iterations runs out of fuel, quickly.
        let t0 = std::time::Instant::now();
        let e = render_hostile("{% for i in range(387420489) %}x{% endfor %}")
            .expect_err("a huge loop");
        assert!(
            e.to_string().contains("fuel") || e.to_string().contains("range"),
            "{e}"
        );
        let e = render_hostile(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        )
        .expect_err("nested loops");
        assert!(e.to_string().contains("fuel"), "{e}");
        assert!(t0.elapsed().as_secs() < 20, "fuel must stop a loop early");
        // Unbounded macro recursion stops at the recursion limit.
        let e = render_hostile("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
            .expect_err("recursion");
        assert!(e.to_string().contains("recursion"), "{e}");
        // Deeply nested source is refused at compile time or render time, not by a crash.
        let deep = format!(
            "{}{}",
            "{% if true %}".repeat(2000),
            "{% endif %}".repeat(2000)
        );
        assert!(render_hostile(&deep).is_err());
        let parens = format!("{{{{ {}1{} }}}}", "(".repeat(5000), ")".repeat(5000));
        assert!(render_hostile(&parens).is_err());
    }

    #[test]
    fn an_overlapping_tag_end_is_not_a_panic() {
        // Found by the chat_template fuzz target: `{%}` made the generation-block rewrite
        // slice backwards and panic on a template a model file could carry.
        for src in [
            "{%}",
            "{%}%}",
            "a{%}b",
            "{%-}",
            "{%}{% generation %}x{% endgeneration %}",
        ] {
            let _ = rewrite_generation_blocks(src);
            let _ = render_hostile(src);
        }
        assert_eq!(
            rewrite_generation_blocks("{%}%- generation %}"),
            "{%}%- generation %}"
        );
    }

    #[test]
    fn fuel_grows_with_the_conversation() {
        assert_eq!(render_fuel(0), FUEL_BASE);
        assert!(render_fuel(2000) > 100 * FUEL_BASE / 2);
        assert_eq!(render_fuel(u64::MAX), u64::MAX);
    }

    fn apply(acc: &mut (String, String), d: &Delta) {
        if d.reset {
            acc.0 = d.reasoning.clone();
            acc.1 = d.text.clone();
        } else {
            acc.0.push_str(&d.reasoning);
            acc.1.push_str(&d.text);
        }
    }

    fn run(start_in_reasoning: bool, pieces: &[&str]) -> ((String, String), Vec<Delta>) {
        let mut s = ReasoningSplitter::new(start_in_reasoning);
        let mut acc = (String::new(), String::new());
        let mut deltas = Vec::new();
        for p in pieces {
            let d = s.push(p);
            apply(&mut acc, &d);
            deltas.push(d);
        }
        let d = s.finish();
        apply(&mut acc, &d);
        deltas.push(d);
        assert_eq!(acc.0, s.reasoning(), "accumulated reasoning matches");
        assert_eq!(acc.1, s.text(), "accumulated text matches");
        (acc, deltas)
    }

    #[test]
    fn plain_answer_passes_through() {
        let ((r, t), deltas) = run(false, &["Hello", ", world", "!"]);
        assert_eq!((r.as_str(), t.as_str()), ("", "Hello, world!"));
        assert!(deltas.iter().all(|d| !d.reset));
    }

    #[test]
    fn think_span_in_output_is_reasoning() {
        let ((r, t), deltas) = run(
            false,
            &[
                "<think>", "\nLet me", " add.\n", "</think>", "\n\n", "It is 4.",
            ],
        );
        assert_eq!(r, "Let me add.");
        assert_eq!(t, "It is 4.");
        assert!(deltas.iter().all(|d| !d.reset));
        assert_eq!(deltas[1].reasoning, "Let me");
    }

    #[test]
    fn prompt_that_opened_the_span_starts_in_reasoning() {
        let prompt = "<|im_start|>assistant\n<think>\n";
        assert!(prompt_opens_reasoning(prompt));
        assert!(!prompt_opens_reasoning("<think>\n\n</think>\n\n"));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n"));
        let mut s = ReasoningSplitter::for_prompt(prompt);
        assert!(s.in_reasoning());
        let d = s.push("Hmm, 2+2.");
        assert_eq!((d.reasoning.as_str(), d.text.as_str()), ("Hmm, 2+2.", ""));
        let d = s.push("</think>\n\nFour.");
        assert_eq!((d.reasoning.as_str(), d.text.as_str()), ("", "Four."));
        assert!(!d.reset);
    }

    #[test]
    fn tags_split_across_pieces_are_held_back() {
        let ((r, t), deltas) = run(
            false,
            &["<th", "ink>why", "</th", "i", "nk>", "be", "cause <", "b>"],
        );
        assert_eq!(r, "why");
        assert_eq!(t, "because <b>");
        // Nothing of a tag leaks into either stream while it is incomplete.
        assert_eq!(deltas[0], Delta::default());
        assert_eq!(deltas[2].reasoning, "");
        for d in &deltas {
            assert!(!d.reasoning.contains('<') && !d.reasoning.contains('>'));
        }
        // A '<' that turned out not to start a tag is released with what followed.
        assert_eq!(deltas[6].text, "cause ");
        assert_eq!(deltas[7].text, "<b>");
    }

    #[test]
    fn unexpected_close_reclassifies_with_a_reset() {
        let ((r, t), deltas) = run(false, &["The user", " wants 4.", "\n</think>\n\n", "4"]);
        assert_eq!(r, "The user wants 4.");
        assert_eq!(t, "4");
        assert_eq!(deltas[0].text, "The user");
        let reset = &deltas[2];
        assert!(reset.reset);
        assert_eq!(reset.reasoning, "The user wants 4.");
        assert_eq!(reset.text, "");
        assert!(!deltas[3].reset);
        assert_eq!(deltas[3].text, "4");
    }

    #[test]
    fn reset_snapshot_carries_answer_after_the_tag() {
        let mut s = ReasoningSplitter::new(false);
        s.push("plan");
        let d = s.push(" more</think>Answer");
        assert!(d.reset);
        assert_eq!(d.reasoning, "plan more");
        assert_eq!(d.text, "Answer");
    }

    #[test]
    fn unfinished_span_is_flushed_as_reasoning() {
        let ((r, t), _) = run(true, &["still thinking ", "</thi"]);
        assert_eq!(r, "still thinking </thi");
        assert_eq!(t, "");
    }

    #[test]
    fn multibyte_text_next_to_tags() {
        let ((r, t), _) = run(false, &["<think>ü", "ber</think>", "—ja ✓"]);
        assert_eq!(r, "über");
        assert_eq!(t, "—ja ✓");
    }

    #[test]
    fn strftime_fixed_date() {
        let t = CivilTime {
            year: 2025,
            month: 3,
            day: 14,
            hour: 15,
            minute: 9,
            second: 26,
        };
        assert_eq!(t.strftime("%d %b %Y"), "14 Mar 2025");
        assert_eq!(
            t.strftime("%A, %B %e %y %H:%M:%S %I%p %j %%"),
            "Friday, March 14 25 15:09:26 03PM 073 %"
        );
        assert_eq!(t.strftime("%F %T %u %w"), "2025-03-14 15:09:26 5 5");
        assert_eq!(
            CivilTime::from_unix_seconds(0).strftime("%F %a"),
            "1970-01-01 Thu"
        );
        assert_eq!(
            CivilTime::from_unix_seconds(1_741_964_966),
            t,
            "2025-03-14T15:09:26Z"
        );
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let tpl = ChatTemplate::new(
            "{{ x|tojson }}|{{ x|tojson(indent=2) }}|{{ y|tojson(ensure_ascii=True) }}|{{ x|tojson(separators=(',', ':'), sort_keys=true) }}",
            "",
            "",
        )
        .unwrap();
        let x: Value = [
            ("b", Value::from(1)),
            (
                "a",
                Value::from(vec![Value::from(1.5), Value::from(()), Value::from(true)]),
            ),
            ("s", Value::from("<é\"\n>")),
            ("e", Value::from(Vec::<Value>::new())),
        ]
        .into_iter()
        .collect();
        let out = tpl
            .env
            .get_template(TEMPLATE_NAME)
            .unwrap()
            .render(minijinja::context! { x => x, y => "é😀" })
            .unwrap();
        assert_eq!(
            out,
            "{\"b\": 1, \"a\": [1.5, null, true], \"s\": \"<é\\\"\\n>\", \"e\": []}|\
             {\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    null,\n    true\n  ],\n  \"s\": \"<é\\\"\\n>\",\n  \"e\": []\n}|\
             \"\\u00e9\\ud83d\\ude00\"|\
             {\"a\":[1.5,null,true],\"b\":1,\"e\":[],\"s\":\"<é\\\"\\n>\"}"
        );
    }

    #[test]
    fn python_float_repr_cases() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (123456789012345.6, "123456789012345.6"),
            (-2.5, "-2.5"),
            (0.0001, "0.0001"),
        ] {
            assert_eq!(python_float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn generation_block_is_transparent() {
        // Expected output from jinja2 with transformers' settings.
        let src = "{%- for m in messages %}{% generation %}[{{ m.content }}]{{ \"\\n\" }}{%- endgeneration %} x\n{% endfor %}";
        let rewritten = rewrite_generation_blocks(src);
        assert!(!rewritten.contains("generation"));
        let tpl = ChatTemplate::new(src, "", "").unwrap();
        let out = tpl
            .render(
                &[Message::new("user", "a"), Message::new("assistant", "b")],
                false,
                None,
            )
            .unwrap();
        assert_eq!(out, "[a]\n x\n[b]\n x\n");
    }

    #[test]
    fn raise_exception_and_python_literals() {
        let tpl = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ none }} {{ true }} {{ enable_thinking is defined }}",
            "",
            "",
        )
        .unwrap();
        let err = tpl
            .render(&[Message::new("system", "x")], false, None)
            .unwrap_err();
        assert!(err.to_string().contains("first must be user"), "{err}");
        assert_eq!(
            tpl.render(&[Message::new("user", "x")], false, None)
                .unwrap(),
            "None True False"
        );
    }

    #[test]
    fn think_control_from_template_shape() {
        let reads_flag = "{{ messages[0].content }}{% if add_generation_prompt %}<a>{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}";
        assert_eq!(
            ChatTemplate::new(reads_flag, "", "")
                .unwrap()
                .think_control(),
            ThinkCtl::Template
        );
        let always =
            "{{ messages[0].content }}{% if add_generation_prompt %}<a><think>\n{% endif %}";
        let t = ChatTemplate::new(always, "", "").unwrap();
        assert_eq!(t.think_control(), ThinkCtl::None);
        assert_eq!(t.think_control_for_vocab(false), ThinkCtl::Template);
        // Reasoning in a section of its own, the answer behind a marker: decided by what the
        // template renders, not by what its source mentions.
        let channels = "{% for m in messages %}<|start|>{{ m.role }}{% if m.thinking %}<|channel|>analysis<|message|>{{ m.thinking }}<|end|><|start|>assistant{% endif %}{% if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}";
        let t = ChatTemplate::new(channels, "", "").unwrap();
        assert_eq!(t.think_control(), ThinkCtl::Prefill);
        assert_eq!(
            t.answer_prefill().as_deref(),
            Some("<|channel|>final<|message|>")
        );
        let mentioned = "{{ messages[0].content }}{% if add_generation_prompt %}<|start|>assistant{% endif %}{# <|channel|>analysis #}";
        assert_eq!(
            ChatTemplate::new(mentioned, "", "")
                .unwrap()
                .think_control(),
            ThinkCtl::Template
        );
        // A marker but no reasoning section: nothing to start past.
        let marked = "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}[final] {% endif %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";
        let t = ChatTemplate::new(marked, "", "").unwrap();
        assert_eq!(t.answer_prefill().as_deref(), Some("[final] "));
        assert_eq!(t.think_control(), ThinkCtl::Template);
        let plain = "{% for m in messages %}{{ m.content }}{% endfor %}";
        assert_eq!(
            ChatTemplate::new(plain, "", "").unwrap().think_control(),
            ThinkCtl::Template
        );
    }

    #[test]
    fn reasoning_effort_reaches_a_template_that_reads_it_and_only_when_given() {
        let src = "{{ messages[0].content }}|{% if reasoning_effort is defined %}{{ reasoning_effort }}{% else %}unset{% endif %}";
        let f = ChatFormat::new(ChatTemplate::new(src, "", "").unwrap(), false);
        let m = [Message::new("user", "hi")];
        assert!(f.reads_reasoning_effort());
        assert_eq!(
            f.prompt_with(&m, &[], true, Some("high")).unwrap(),
            "hi|high"
        );
        assert_eq!(f.prompt_tools(&m, &[], true).unwrap(), "hi|unset");
        assert_eq!(
            f.history_with(&m, &[], true, Some("low")).unwrap(),
            "hi|low"
        );
        let plain = ChatFormat::new(
            ChatTemplate::new("{{ messages[0].content }}", "", "").unwrap(),
            false,
        );
        assert!(!plain.reads_reasoning_effort());
    }
}
