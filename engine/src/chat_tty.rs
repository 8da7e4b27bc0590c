//! `bmoe-cli chat -m MODEL`: an interactive terminal chat over the one generation loop
//! (`converse::Conversation`). The history is kept and re-rendered every turn, so only the new
//! message is prefilled (KV prefix reuse); the reasoning span is shown apart (dimmed on a
//! terminal); each answer ends with a one-line stats footer (tokens, tok/s, cache hit rate, MiB
//! read from flash). Ctrl-C stops the running answer at its next token — not the process; at the
//! prompt it says how to leave, and a second Ctrl-C within two seconds leaves. `/exit` (or
//! Ctrl-D), `/clear` (a new chat), `/stats` (the session so far), `/n N` (tokens per answer),
//! `/help`.

use crate::chat::Message;
use crate::cli::{ChatArgs, RunArgs};
use crate::converse::{Conversation, Finished, Listener, Prompt, TurnOptions};
use anyhow::{bail, Result};
use bmoe_core::{CancelFlag, StopReason};
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

const HELP: &str =
    "commands: /exit (or Ctrl-D) leave · /clear start a new chat · /stats the session so far · \
/n N tokens per answer (-1: until the end of generation) · /help this. Ctrl-C stops an answer; \
a line ending in \\ continues on the next; a paste is one message.";

/// The terminal's bracketed-paste markers: a paste arrives between them.
const PASTE_START: &str = "\x1b[200~";
const PASTE_END: &str = "\x1b[201~";

/// Read one message: a line; or lines joined while each ends in `\` (the backslash dropped,
/// `more` called before each continuation); or a bracketed paste, whatever lines it spans.
/// `None` at the end of input (what was read of an unfinished message is sent).
fn read_message(
    input: &mut dyn BufRead,
    more: &mut dyn FnMut(),
) -> std::io::Result<Option<String>> {
    let mut msg = String::new();
    let mut line = String::new();
    let mut in_paste = false;
    let mut read_any = false;
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 {
            return Ok(read_any.then_some(msg));
        }
        read_any = true;
        let mut text = line.as_str();
        if !in_paste {
            if let Some(at) = text.find(PASTE_START) {
                msg.push_str(&text[..at]);
                text = &text[at + PASTE_START.len()..];
                in_paste = true;
            }
        }
        if in_paste {
            match text.find(PASTE_END) {
                Some(at) => {
                    msg.push_str(&text[..at]);
                    in_paste = false;
                    let rest = text[at + PASTE_END.len()..].trim_end_matches(['\n', '\r']);
                    msg.push_str(rest);
                    if !rest.ends_with('\\') {
                        // The paste ended its line: the message is what was pasted (plus
                        // anything typed around it), unless Enter is still to come.
                        if line.ends_with('\n') {
                            return Ok(Some(msg));
                        }
                    }
                }
                None => {
                    msg.push_str(text);
                    continue;
                }
            }
            if !line.ends_with('\n') {
                continue;
            }
        } else {
            let t = text.trim_end_matches(['\n', '\r']);
            match t.strip_suffix('\\') {
                Some(head) => {
                    msg.push_str(head);
                    msg.push('\n');
                    more();
                    continue;
                }
                None => {
                    msg.push_str(t);
                    return Ok(Some(msg));
                }
            }
        }
        if let Some(head) = msg.strip_suffix('\\') {
            msg.truncate(head.len());
            msg.push('\n');
            more();
            continue;
        }
        return Ok(Some(msg));
    }
}

/// Prints the answer as it grows: reasoning dimmed and apart, then the answer.
struct Printer {
    out: std::io::Stdout,
    color: bool,
    in_reasoning: bool,
    printed_any: bool,
}

impl Printer {
    fn write(&mut self, s: &str) {
        let mut o = self.out.lock();
        let _ = o.write_all(s.as_bytes());
        let _ = o.flush();
    }
}

impl Listener for Printer {
    fn delta(&mut self, reasoning: &str, content: &str) -> bool {
        if !reasoning.is_empty() {
            if !self.in_reasoning {
                self.in_reasoning = true;
                let head = if self.color {
                    format!("{DIM}[thinking] ")
                } else {
                    "[thinking] ".to_string()
                };
                self.write(&head);
            }
            self.write(reasoning);
        }
        if !content.is_empty() {
            if self.in_reasoning {
                self.in_reasoning = false;
                let tail = if self.color {
                    format!("{RESET}\n")
                } else {
                    "\n[answer] ".to_string()
                };
                self.write(&tail);
            }
            self.write(content);
        }
        self.printed_any |= !reasoning.is_empty() || !content.is_empty();
        true
    }
}

fn footer(f: &Finished) -> String {
    let s = &f.summary;
    let hit = if s.cache_hit_pct() < 0.0 {
        "cache off".to_string()
    } else {
        format!("hit {:.1}%", s.cache_hit_pct())
    };
    format!(
        "[{} tok, {:.1} tok/s, {hit}, read {:.1} MiB, prompt {} tok ({} reused){}]",
        f.completion_tokens,
        s.tokens_per_s(),
        s.read_mib(),
        f.prompt_tokens,
        f.cached_tokens,
        match f.stop {
            StopReason::Cancelled => ", cancelled",
            StopReason::Count => ", length",
            _ => "",
        }
    )
}

/// Run the chat on the terminal until `/exit` or end of input. Returns the exit code.
pub fn chat(mut a: ChatArgs) -> Result<i32> {
    let Some(model) = a.run.model.clone() else {
        bail!("chat: no model given: pass -m MODEL.gguf");
    };
    if !a.run.prompt.is_empty() || a.run.file.is_some() {
        bail!("chat: -p and -f have no meaning: type the messages (-sys sets a system message)");
    }
    if a.run.session || a.run.decide {
        bail!("chat: --session and --decide are the stdin protocol, not a chat");
    }
    a.run.check_modes()?;
    let args: &mut RunArgs = &mut a.run;
    args.resolve_seed_reported(&mut std::io::stderr())?;
    let color =
        !a.plain && std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let mut conv = Conversation::open(args, &model, &mut std::io::stderr())?;
    if !conv.has_template() {
        bail!(
            "chat: {} has no chat template: pass --chat-template-file FILE",
            model.display()
        );
    }
    // Ctrl-C sets the session's cancel flag: the running answer stops at its next token. At the
    // prompt a watcher explains, and a second Ctrl-C soon after leaves.
    let cancel: CancelFlag = conv.cancel_flag().clone();
    signal_hook::flag::register(signal_hook::consts::SIGINT, cancel.atomic().clone())?;
    let term = CancelFlag::new();
    signal_hook::flag::register_conditional_shutdown(
        signal_hook::consts::SIGTERM,
        crate::run::EXIT_INTERRUPTED,
        term.atomic().clone(),
    )?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, term.atomic().clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, cancel.atomic().clone())?;
    let generating = Arc::new(AtomicBool::new(false));
    {
        let (cancel, generating, term) = (cancel.clone(), generating.clone(), term.clone());
        std::thread::Builder::new()
            .name("bmoe-chat-ctrl-c".into())
            .spawn(move || {
                let mut last: Option<Instant> = None;
                loop {
                    std::thread::sleep(Duration::from_millis(50));
                    if term.is_set() && !generating.load(Ordering::SeqCst) {
                        std::process::exit(crate::run::EXIT_INTERRUPTED);
                    }
                    if cancel.is_set() && !generating.load(Ordering::SeqCst) {
                        cancel.clear();
                        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(2)) {
                            eprintln!();
                            std::process::exit(0);
                        }
                        last = Some(Instant::now());
                        eprint!("\n(Ctrl-C stops an answer; /exit or Ctrl-D leaves, or Ctrl-C again)\n> ");
                    }
                }
            })?;
    }

    let mut n_predict = args.n_predict;
    let mut history: Vec<Message> = Vec::new();
    if let Some(s) = &args.system_prompt {
        history.push(Message::new("system", s.clone()));
    }
    let system_len = history.len();
    println!(
        "bmoe chat: {} ({}, n_ctx {}). {HELP}",
        model.display(),
        conv.arch(),
        conv.n_ctx()
    );
    let stdin = std::io::stdin();
    let tty = stdin.is_terminal();
    let mut input = stdin.lock();
    // Bracketed paste on: a pasted block arrives marked, and is sent as one message.
    let _paste = tty.then(|| {
        print!("\x1b[?2004h");
        PasteMode
    });
    let mut turns = 0u32;
    loop {
        print!("> ");
        std::io::stdout().flush()?;
        let mut more = || {
            print!("… ");
            let _ = std::io::stdout().flush();
        };
        let Some(message) = read_message(&mut input, &mut more)? else {
            println!();
            break;
        };
        let text = message.as_str();
        if text.trim().is_empty() {
            continue;
        }
        match text.trim() {
            "/exit" | "/quit" => break,
            "/help" => {
                println!("{HELP}");
                continue;
            }
            "/clear" => {
                history.truncate(system_len);
                conv.clear();
                println!("(a new chat: history and KV cleared)");
                continue;
            }
            "/stats" => {
                let s = conv.summary();
                println!(
                    "(session: {turns} turns, {} tokens, {:.1} tok/s, cache hit {}, read {:.1} MiB, prefill {:.2} s, context {} of {} tokens)",
                    s.tokens(),
                    s.tokens_per_s(),
                    if s.cache_hit_pct() < 0.0 {
                        "off".to_string()
                    } else {
                        format!("{:.1}%", s.cache_hit_pct())
                    },
                    s.read_mib(),
                    s.counters.prefill_s,
                    conv.context_len(),
                    conv.n_ctx()
                );
                continue;
            }
            t if t.starts_with("/n") => {
                match crate::prompt::parse_n_predict(t[2..].trim()) {
                    Ok(n) => {
                        n_predict = n;
                        println!("(tokens per answer: {})", t[2..].trim());
                    }
                    Err(e) => println!("(/n: {e})"),
                }
                continue;
            }
            t if t.starts_with('/') => {
                println!("(unknown command {t}; {HELP})");
                continue;
            }
            _ => {}
        }
        // Context shift: when the history leaves too little room (less than the answer's
        // tokens, or a quarter of the context), the oldest messages after the system prompt
        // are dropped, a turn at a time, and the user is told.
        let mut dropped = 0usize;
        let (msgs, prepared) = loop {
            let mut msgs = history.clone();
            msgs.push(Message::new("user", text.to_string()));
            let prompt = Prompt::Chat {
                messages: msgs.clone(),
                think: !args.no_think,
                tools: Vec::new(),
                effort: None,
            };
            let can_drop = history.len() > system_len;
            let want = n_predict.min((conv.n_ctx() / 4).max(1) as u32);
            match conv.prepare(&prompt, Some(n_predict)) {
                Ok(p) if p.n_predict >= want || !can_drop => break (msgs, Some(p)),
                Err(crate::converse::Refused::TooLong { .. }) if can_drop => {}
                Ok(_) => {}
                Err(e) => {
                    let hint = if matches!(e, crate::converse::Refused::TooLong { .. }) {
                        " — the message alone is longer than the context (-c); /clear starts over"
                    } else {
                        ""
                    };
                    println!("(not sent: {e}{hint})");
                    break (msgs, None);
                }
            }
            // Drop the oldest turn: its user message and everything up to the next one.
            let mut end = system_len + 1;
            while end < history.len() && history[end].role != "user" {
                end += 1;
            }
            dropped += end - system_len;
            history.drain(system_len..end);
        };
        if dropped > 0 {
            println!(
                "(the context of {} tokens is full: the oldest {dropped} message{} dropped; /clear starts over)",
                conv.n_ctx(),
                if dropped == 1 { " was" } else { "s were" }
            );
        }
        let Some(prepared) = prepared else {
            continue;
        };
        let opts = TurnOptions {
            sampler: args.sampler_config(args.seed.wrapping_add(u64::from(turns))),
            stop: Vec::new(),
            speculation: args.ngram.then(|| conv.ngram_params()),
            head_drafts: args.mtp,
            logprobs: None,
            constraint: None,
            hold_from: None,
        };
        let mut printer = Printer {
            out: std::io::stdout(),
            color,
            in_reasoning: false,
            printed_any: false,
        };
        cancel.clear();
        generating.store(true, Ordering::SeqCst);
        let r = conv.run(&prepared, &opts, &mut printer);
        generating.store(false, Ordering::SeqCst);
        cancel.clear();
        let fin = r?;
        turns += 1;
        if printer.in_reasoning && color {
            printer.write(RESET);
        }
        let foot = footer(&fin);
        if color {
            println!("\n{DIM}{foot}{RESET}");
        } else {
            println!("\n{foot}");
        }
        match fin.stop {
            StopReason::Failed => {
                eprintln!(
                    "bmoe: chat: a step failed: {}; the output is not trustworthy",
                    fin.error.unwrap_or_default()
                );
                return Ok(3);
            }
            // A cancelled answer is not kept: the KV is rolled back, the message dropped.
            StopReason::Cancelled => println!("(answer cancelled; your message was not kept)"),
            StopReason::Count | StopReason::EndOfGeneration => {
                history = msgs;
                history.push(
                    Message::new("assistant", fin.content.clone()).with_reasoning(fin.reasoning),
                );
            }
        }
    }
    conv.finish()?;
    Ok(0)
}

/// Bracketed paste, turned off again when the chat ends.
struct PasteMode;

impl Drop for PasteMode {
    fn drop(&mut self) {
        print!("\x1b[?2004l");
        let _ = std::io::stdout().flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(input: &str) -> Vec<String> {
        let mut r = std::io::Cursor::new(input.as_bytes().to_vec());
        let mut out = Vec::new();
        let mut n_more = 0;
        while let Some(m) = read_message(&mut r, &mut || n_more += 1).unwrap() {
            out.push(m);
        }
        out
    }

    #[test]
    fn a_paste_or_a_trailing_backslash_makes_one_message_of_several_lines() {
        assert_eq!(messages("one\ntwo\n"), vec!["one", "two"]);
        assert_eq!(
            messages("first \\\nsecond\nthird\n"),
            vec!["first \nsecond", "third"]
        );
        assert_eq!(
            messages("\x1b[200~line a\nline b\n\nline d\x1b[201~\nnext\n"),
            vec!["line a\nline b\n\nline d", "next"]
        );
        // Typed text around a paste joins it; a backslash after it continues.
        assert_eq!(
            messages("look: \x1b[200~x\ny\x1b[201~ \\\nok?\n"),
            vec!["look: x\ny \nok?"]
        );
        // A paste still open at the end of input is sent as far as it got.
        assert_eq!(messages("\x1b[200~half\n"), vec!["half\n"]);
        assert_eq!(messages(""), Vec::<String>::new());
    }
}
