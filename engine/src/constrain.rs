//! Constrained decoding: a grammar decides which tokens may come next, and the sampler draws
//! only from those. The grammar engine is `llguidance` (what llama.cpp links for the same
//! job: an Earley parser over a lazily built token trie, with JSON Schema and Lark front ends,
//! masks in well under a millisecond for JSON on 150k-token vocabularies), over a token trie
//! built once per model from our tokenizer's bytes.
//!
//! What a request may ask for ([`Spec`]): any JSON object (`response_format: json_object`), a
//! JSON Schema (`json_schema`), or a Lark grammar (llguidance's dialect; `grammar`). The tool
//! calls of `tool_choice: required` are a Lark grammar built from the tools' schemas.
//!
//! Control tokens (`<|im_end|>`) are in the trie as llguidance's special tokens (a 0xFF byte,
//! then their text), so text can never spell them and a grammar names them as `<|im_end|>` or
//! `<[id]>`; every other token is its bytes. The end of a grammar is the model's end-of-turn
//! token: once the grammar is complete, that is all the mask allows.

use crate::tokenizer::{TokenKind, Tokenizer};
use anyhow::{anyhow, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// What the output must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Spec {
    /// Any JSON object.
    JsonObject,
    /// A value matching this JSON Schema.
    JsonSchema(serde_json::Value),
    /// Text of this Lark grammar (llguidance's dialect: `start: ...`, `%json {...}` for a
    /// schema inside it, `<|name|>` for a control token).
    Lark(String),
}

impl Spec {
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            // Compact JSON: no free whitespace (a random or a weak model would otherwise be
            // free to pad forever).
            Spec::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({
                "type": "object",
                "x-guidance": {"whitespace_flexible": false},
            })),
            Spec::JsonSchema(s) => {
                let mut s = s.clone();
                if let Some(o) = s.as_object_mut() {
                    o.entry("x-guidance")
                        .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
                }
                TopLevelGrammar::from_json_schema(s)
            }
            Spec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// Our tokenizer as llguidance sees it: the trie of every token's bytes, and the tokenizer
/// itself for the text a grammar forces.
struct Env {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tok
                .encode_with(text, false, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// The grammar compiler of one model (its token trie): built once, shared by every request.
pub struct Grammars {
    factory: ParserFactory,
    eot: u32,
}

impl Grammars {
    /// Build the token trie of `tok` (`n_vocab`: the model's logits per row, which may pad the
    /// vocabulary). `eot` ends a finished grammar.
    pub fn new(tok: Arc<Tokenizer>, n_vocab: usize, eot: u32) -> Result<Grammars> {
        let n = n_vocab.max(tok.n_vocab());
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| match tok.kind(id) {
                Some(TokenKind::Control) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(&tok.token_bytes(id));
                    w
                }
                Some(_) => tok.token_bytes(id),
                // Padding rows past the vocabulary: never allowed (no bytes, not special).
                None => Vec::new(),
            })
            .collect();
        let mut info = TokRxInfo::new(n as u32, eot);
        info.tok_bos = tok.bos();
        info.tok_end_of_turn = Some(eot);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env { trie, tok });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| anyhow!("building the grammar engine's token trie: {e}"))?;
        factory.quiet();
        Ok(Grammars { factory, eot })
    }

    /// A fresh constraint for `spec`: an error names what is wrong with the grammar or schema.
    pub fn constraint(&self, spec: &Spec) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser(spec.grammar())
            .map_err(|e| anyhow!("{e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(anyhow!("{e}"));
        }
        Ok(Constraint {
            matcher,
            eot: self.eot,
            mask_s: 0.0,
            masks: 0,
        })
    }
}

/// One generation's grammar state.
pub struct Constraint {
    matcher: Matcher,
    eot: u32,
    /// Time spent computing masks, and how many.
    pub mask_s: f64,
    pub masks: u64,
}

impl Constraint {
    /// Set every logit the grammar does not allow next to `-inf`. Once the grammar is
    /// complete only the end-of-turn token stays.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let t = std::time::Instant::now();
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| anyhow!("the grammar failed: {e}"))?;
        self.mask_s += t.elapsed().as_secs_f64();
        self.masks += 1;
        let mut any = false;
        for (id, l) in logits.iter_mut().enumerate() {
            if mask.is_allowed(id as u32) {
                any |= l.is_finite() || *l == f32::INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            return Err(anyhow!(
                "the grammar allows no token the model can produce here"
            ));
        }
        Ok(())
    }

    /// Advance past the chosen token (which `mask` allowed). The end-of-turn token after a
    /// complete grammar is taken as it is.
    pub fn commit(&mut self, id: u32) -> Result<()> {
        if self.matcher.is_stopped() && id == self.eot {
            return Ok(());
        }
        self.matcher
            .consume_token(id)
            .map_err(|e| anyhow!("the grammar refused token {id}: {e}"))
    }

    /// Whether the grammar is complete (nothing but the end may follow).
    pub fn is_complete(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}

/// A request's grammar as Lark: GBNF (llama.cpp's: it has a `::=`) converted, Lark as it is.
pub fn lark_of(text: &str) -> Result<String> {
    if text.contains("::=") {
        gbnf_to_lark(text)
    } else {
        Ok(text.to_string())
    }
}

/// One GBNF lexeme.
#[derive(Clone, Debug, PartialEq)]
enum Gbnf {
    Name(String),
    Define,
    Text(String),
    /// A character class: negated, and its ranges.
    Class(bool, Vec<(char, char)>),
    Any,
    Open,
    Close,
    Bar,
    Op(char),
    Repeat(String),
    /// A token reference (`<[123]>`, `<think>`), passed on.
    Special(String),
    Newline,
}

/// Read one escaped character of a GBNF string or class (after the backslash).
fn gbnf_escape(it: &mut std::iter::Peekable<std::str::CharIndices<'_>>) -> Result<char> {
    let (at, c) = it.next().ok_or_else(|| anyhow!("a backslash at the end"))?;
    let hex = |it: &mut std::iter::Peekable<std::str::CharIndices<'_>>, n: usize| {
        let mut v = 0u32;
        for _ in 0..n {
            let d = it
                .next()
                .and_then(|(_, d)| d.to_digit(16))
                .ok_or_else(|| anyhow!("byte {at}: \\{c} needs {n} hex digits"))?;
            v = v * 16 + d;
        }
        char::from_u32(v).ok_or_else(|| anyhow!("byte {at}: \\{c}: {v:#x} is not a character"))
    };
    Ok(match c {
        'n' => '\n',
        't' => '\t',
        'r' => '\r',
        'x' => hex(it, 2)?,
        'u' => hex(it, 4)?,
        'U' => hex(it, 8)?,
        other => other,
    })
}

fn gbnf_lex(text: &str) -> Result<Vec<Gbnf>> {
    let mut out = Vec::new();
    let mut it = text.char_indices().peekable();
    while let Some(&(at, c)) = it.peek() {
        match c {
            '#' => {
                while it.peek().is_some_and(|&(_, c)| c != '\n') {
                    it.next();
                }
            }
            '\n' => {
                it.next();
                out.push(Gbnf::Newline);
            }
            c if c.is_whitespace() => {
                it.next();
            }
            ':' => {
                let rest = &text[at..];
                if !rest.starts_with("::=") {
                    bail_at(at, "expected ::=")?;
                }
                for _ in 0..3 {
                    it.next();
                }
                out.push(Gbnf::Define);
            }
            '"' => {
                it.next();
                let mut s = String::new();
                loop {
                    match it.next() {
                        None => bail_at(at, "a string that does not end")?,
                        Some((_, '"')) => break,
                        Some((_, '\\')) => s.push(gbnf_escape(&mut it)?),
                        Some((_, c)) => s.push(c),
                    }
                }
                out.push(Gbnf::Text(s));
            }
            '[' => {
                it.next();
                let neg = it.peek().is_some_and(|&(_, c)| c == '^');
                if neg {
                    it.next();
                }
                let mut ranges = Vec::new();
                loop {
                    let lo = match it.next() {
                        None => bail_at(at, "a character class that does not end")?,
                        Some((_, ']')) => break,
                        Some((_, '\\')) => gbnf_escape(&mut it)?,
                        Some((_, c)) => c,
                    };
                    let mut hi = lo;
                    let mut look = it.clone();
                    if look.next().is_some_and(|(_, c)| c == '-')
                        && look.peek().is_some_and(|&(_, c)| c != ']')
                    {
                        it.next();
                        hi = match it.next() {
                            Some((_, '\\')) => gbnf_escape(&mut it)?,
                            Some((_, c)) => c,
                            None => bail_at(at, "a character class that does not end")?,
                        };
                    }
                    if hi < lo {
                        bail_at(at, "a character range that runs backwards")?;
                    }
                    ranges.push((lo, hi));
                }
                out.push(Gbnf::Class(neg, ranges));
            }
            '<' => {
                let end = text[at..]
                    .find('>')
                    .ok_or_else(|| anyhow!("byte {at}: a token reference without >"))?;
                out.push(Gbnf::Special(text[at..=at + end].to_string()));
                while it.peek().is_some_and(|&(i, _)| i <= at + end) {
                    it.next();
                }
            }
            '{' => {
                let end = text[at..]
                    .find('}')
                    .ok_or_else(|| anyhow!("byte {at}: a repetition without }}"))?;
                let inner: String = text[at + 1..at + end]
                    .chars()
                    .filter(|c| !c.is_whitespace())
                    .collect();
                if inner.is_empty() || !inner.chars().all(|c| c.is_ascii_digit() || c == ',') {
                    bail_at(at, "a repetition is {m}, {m,} or {m,n}")?;
                }
                out.push(Gbnf::Repeat(inner));
                while it.peek().is_some_and(|&(i, _)| i <= at + end) {
                    it.next();
                }
            }
            '.' => {
                it.next();
                out.push(Gbnf::Any);
            }
            '(' => {
                it.next();
                out.push(Gbnf::Open);
            }
            ')' => {
                it.next();
                out.push(Gbnf::Close);
            }
            '|' => {
                it.next();
                out.push(Gbnf::Bar);
            }
            '*' | '+' | '?' => {
                it.next();
                out.push(Gbnf::Op(c));
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let mut name = String::new();
                while let Some(&(_, c)) = it.peek() {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                        name.push(c);
                        it.next();
                    } else {
                        break;
                    }
                }
                out.push(Gbnf::Name(name));
            }
            other => bail_at(at, &format!("unexpected {other:?}"))?,
        }
    }
    Ok(out)
}

fn bail_at<T>(at: usize, what: &str) -> Result<T> {
    Err(anyhow!("GBNF, byte {at}: {what}"))
}

/// A GBNF rule name as a Lark rule name: lower case, `-` kept (llguidance allows it), `root`
/// → `start`; a name that does not start with a letter gets a prefix.
fn lark_name(n: &str) -> String {
    if n == "root" {
        return "start".into();
    }
    let l = n.to_ascii_lowercase().replace('_', "-");
    if l.starts_with(|c: char| c.is_ascii_lowercase()) {
        l
    } else {
        format!("r-{l}")
    }
}

/// Convert a GBNF grammar (llama.cpp's `grammars/*.gbnf` syntax) to llguidance's Lark: one
/// rule per line; strings re-escaped as JSON; character classes and `.` as regexes.
pub fn gbnf_to_lark(text: &str) -> Result<String> {
    let lex = gbnf_lex(text)?;
    // Split into rules: `name ::=` starts one; newlines inside parentheses continue it.
    let mut rules: Vec<(String, Vec<Gbnf>)> = Vec::new();
    let mut depth = 0i32;
    let mut i = 0;
    let mut names = std::collections::HashMap::new();
    while i < lex.len() {
        match (&lex[i], lex.get(i + 1)) {
            (Gbnf::Newline, _) => i += 1,
            (Gbnf::Name(n), Some(Gbnf::Define)) if depth == 0 => {
                let l = lark_name(n);
                if let Some(prev) = names.insert(l.clone(), n.clone()) {
                    if prev != *n {
                        return Err(anyhow!(
                            "GBNF: rules {prev:?} and {n:?} differ only in case or _ vs -"
                        ));
                    }
                }
                rules.push((l, Vec::new()));
                i += 2;
            }
            (t, _) => {
                let Some((_, body)) = rules.last_mut() else {
                    return Err(anyhow!("GBNF: expected `name ::= ...` first, got {t:?}"));
                };
                match t {
                    Gbnf::Open => depth += 1,
                    Gbnf::Close => depth -= 1,
                    _ => {}
                }
                if depth < 0 {
                    return Err(anyhow!("GBNF: a ) without its ("));
                }
                body.push(t.clone());
                i += 1;
            }
        }
    }
    if depth != 0 {
        return Err(anyhow!("GBNF: a ( without its )"));
    }
    if !rules.iter().any(|(n, _)| n == "start") {
        return Err(anyhow!("GBNF: no `root ::= ...` rule"));
    }
    let class_char = |c: char| format!("\\x{{{:x}}}", c as u32);
    let mut out = String::new();
    for (name, body) in rules {
        if body.is_empty() {
            return Err(anyhow!("GBNF: rule {name} is empty"));
        }
        out.push_str(&name);
        out.push(':');
        for t in body {
            match t {
                Gbnf::Name(n) => {
                    out.push(' ');
                    out.push_str(&lark_name(&n));
                }
                Gbnf::Text(s) => {
                    out.push(' ');
                    if s.is_empty() {
                        // An empty literal matches nothing: an empty group.
                        out.push_str("\"\"");
                    } else {
                        out.push_str(&serde_json::to_string(&s)?);
                    }
                }
                Gbnf::Class(neg, ranges) => {
                    out.push_str(" /[");
                    if neg {
                        out.push('^');
                    }
                    for (lo, hi) in ranges {
                        out.push_str(&class_char(lo));
                        if hi != lo {
                            out.push('-');
                            out.push_str(&class_char(hi));
                        }
                    }
                    out.push_str("]/");
                }
                Gbnf::Any => out.push_str(" /(?s:.)/"),
                Gbnf::Open => out.push_str(" ("),
                Gbnf::Close => out.push_str(" )"),
                Gbnf::Bar => out.push_str(" |"),
                Gbnf::Op(c) => out.push(c),
                Gbnf::Repeat(r) => {
                    out.push('{');
                    out.push_str(&r);
                    out.push('}');
                }
                Gbnf::Special(s) => {
                    out.push(' ');
                    out.push_str(&s);
                }
                Gbnf::Newline => {}
                Gbnf::Define => return Err(anyhow!("GBNF: a ::= inside rule {name}")),
            }
        }
        out.push('\n');
    }
    Ok(out)
}

/// Whether `spec` compiles (over llguidance's single-byte test vocabulary), for other
/// modules' tests.
#[cfg(test)]
pub(crate) fn tests_compile(spec: &Spec) -> Result<()> {
    tests::bytes_matcher(spec).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A constraint over single-byte tokens (llguidance's test vocabulary).
    pub(super) fn bytes_matcher(spec: &Spec) -> Result<Matcher> {
        let env = toktrie::ApproximateTokEnv::single_byte_env();
        let mut f = ParserFactory::new_simple(&env)?;
        f.quiet();
        let m = Matcher::new(f.create_parser(spec.grammar()));
        match m.get_error() {
            Some(e) => Err(anyhow!("{e}")),
            None => Ok(m),
        }
    }

    /// Whether `text` (as bytes, then the end token) is a whole sentence of `spec`.
    fn accepts(spec: &Spec, text: &str) -> bool {
        let mut m = bytes_matcher(spec).expect("grammar");
        for b in text.bytes() {
            if m.consume_token(u32::from(b)).is_err() {
                return false;
            }
        }
        m.is_accepting().unwrap_or(false)
    }

    const JSON_GBNF: &str = r#"
# llama.cpp's grammars/json.gbnf, in spirit
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4})
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
"#;

    #[test]
    fn gbnf_converts_to_a_lark_grammar_that_accepts_the_same_language() {
        let lark = gbnf_to_lark(JSON_GBNF).expect("convert");
        assert!(lark.starts_with("start: object\n"), "{lark}");
        let spec = Spec::Lark(lark.clone());
        for ok in [
            r#"{}"#,
            r#"{"a": [1, -2.5e3, "x\n"], "b": {"c": null}}"#,
            r#"{"u":"\u00e9"}"#,
        ] {
            assert!(accepts(&spec, ok), "{ok}\n{lark}");
        }
        for bad in [r#"[]"#, r#"{"a" 1}"#, r#"{"a": tru}"#, r#"{"a": 01}"#] {
            assert!(!accepts(&spec, bad), "{bad}");
        }
    }

    #[test]
    fn gbnf_details_survive_the_conversion() {
        let g = "root ::= greeting-word \" \" [a-c]{2,3} x?\ngreeting-word ::= (\"hi\" | \"yo\")+\nx ::= . \"\\x41\\u00e9\"";
        let spec = Spec::Lark(gbnf_to_lark(g).unwrap());
        assert!(accepts(&spec, "hihi ab"));
        assert!(accepts(&spec, "yo cab"));
        assert!(accepts(&spec, "hi abc!Aé"));
        assert!(!accepts(&spec, "hi a"));
        assert!(!accepts(&spec, "hi abcd"));
        assert!(!accepts(&spec, "hey ab"));
    }

    #[test]
    fn bad_grammars_are_named_errors_not_panics() {
        for (g, needle) in [
            ("root ::= \"a", "does not end"),
            ("root ::= [a-", "does not end"),
            ("root ::= (\"a\"", "without its )"),
            ("a ::= \"x\"", "root"),
            ("root ::= [z-a]", "backwards"),
            ("root ::= \"a\" {x}", "repetition"),
            ("\"a\" ::= b", "name ::="),
        ] {
            let e = gbnf_to_lark(g).expect_err(g).to_string();
            assert!(e.contains(needle), "{g}: {e}");
        }
        // Lark the engine cannot compile: its own message.
        assert!(bytes_matcher(&Spec::Lark("start: undefined_rule".into())).is_err());
        assert!(bytes_matcher(&Spec::JsonSchema(serde_json::json!({"type": "nonsense"}))).is_err());
    }

    #[test]
    fn schemas_hold_their_shape() {
        let spec = Spec::JsonSchema(serde_json::json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["name", "n"],
            "additionalProperties": false,
        }));
        assert!(accepts(&spec, r#"{"name":"abc","n":7}"#));
        assert!(!accepts(&spec, r#"{"name":"abcdef","n":7}"#), "maxLength");
        assert!(!accepts(&spec, r#"{"name":"abc"}"#), "required");
        assert!(
            !accepts(&spec, r#"{"name":"abc", "n":7}"#),
            "no free whitespace"
        );
        assert!(accepts(&Spec::JsonObject, r#"{"a":[1,{"b":null}]}"#));
        assert!(!accepts(&Spec::JsonObject, r#"[1]"#));
    }
}
