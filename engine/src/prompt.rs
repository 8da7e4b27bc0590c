//! The command line conventions of llama.cpp that decide what a run's prompt is and how it is
//! sampled: `-f FILE`, `-p -` or a piped stdin as the prompt, `-sys` (a system message, which
//! makes the prompt a chat), `--chat-template-file` (another template than the model's),
//! special tokens parsed in a raw prompt unless `--no-parse-special`, `-n -1` (until the end of
//! generation or a full context) and `--seed -1` (random, the default, and reported).

use crate::cli::RunArgs;
use crate::gguf::GgufFile;
use anyhow::{anyhow, bail, Context, Result};
use std::io::{Read, Write};
use std::path::Path;

/// The longest prompt read from `-f` or stdin (64 MiB: far past any context's worth of text).
pub const MAX_PROMPT_BYTES: u64 = 64 << 20;

pub use crate::conventions::{
    parse_additive_penalty, parse_n_predict, parse_penalty_factor, parse_seed, parse_unit,
    rewrite_llama_flags, rewrite_llama_flags_noting, N_PREDICT_FILL, SEED_RANDOM,
};

/// How many tokens a turn generates: `n`, or with `-n -1` as many as the context has room
/// for after the prompt. Refuses a prompt that leaves no room.
pub fn n_predict_for(n: u32, prompt_len: usize, n_ctx: usize) -> Result<u32> {
    if n == N_PREDICT_FILL {
        if prompt_len >= n_ctx {
            bail!(
                "prompt of {prompt_len} tokens leaves no room in the context of {n_ctx} (-c {n_ctx}) for -n -1"
            );
        }
        return Ok((n_ctx - prompt_len).min(u32::MAX as usize - 1) as u32);
    }
    if prompt_len + n as usize > n_ctx {
        bail!("prompt of {prompt_len} tokens plus -n {n} exceeds the context size {n_ctx} (-c {n_ctx})");
    }
    Ok(n)
}

impl RunArgs {
    /// Draw the random seed of `--seed -1` (the default) once. Returns it when one was drawn,
    /// so the caller can report it; a run is repeated with `--seed <that>`.
    pub fn resolve_seed(&mut self) -> Option<u64> {
        if self.seed != SEED_RANDOM {
            return None;
        }
        // A 32-bit seed, as llama.cpp reports it: short enough to type back.
        self.seed = u64::from(rand::random::<u32>());
        Some(self.seed)
    }

    /// `resolve_seed`, reporting a drawn seed on `err` when it matters (sampling, `--temp > 0`).
    pub fn resolve_seed_reported(&mut self, err: &mut dyn Write) -> Result<()> {
        if let Some(s) = self.resolve_seed() {
            if self.temp > 0.0 {
                writeln!(
                    err,
                    "bmoe: sampling seed {s} (random; --seed {s} repeats this run)"
                )?;
            }
        }
        Ok(())
    }

    /// The prompt of a one-shot run from `-f FILE`, `-p -` or a piped `stdin` (read when
    /// neither `-p` nor `-f` is given and stdin is not a terminal). `-sys` and
    /// `--chat-template-file` turn the chat template on (giving a template says the prompt is
    /// a chat, as llama.cpp's `--chat-template-file` does). Called once by the binary before
    /// the run.
    pub fn resolve_prompt(&mut self, stdin: &mut dyn Read, stdin_is_tty: bool) -> Result<()> {
        if self.system_prompt.is_some() || self.chat_template_file.is_some() {
            self.chatml = true;
        }
        let from_p = !self.prompt.is_empty();
        match (&self.file, from_p) {
            (Some(f), true) => bail!(
                "both -p and -f {} give a prompt: pass one of them",
                f.display()
            ),
            (Some(f), false) => {
                self.prompt = read_text(
                    std::fs::File::open(f).with_context(|| {
                        format!("-f {}: cannot open the prompt file", f.display())
                    })?,
                    &format!("-f {}", f.display()),
                )?;
            }
            (None, true) if self.prompt == "-" => {
                self.prompt = read_text(stdin, "-p - (stdin)")?;
            }
            (None, true) => {}
            (None, false) if !stdin_is_tty && !self.session => {
                self.prompt = read_text(stdin, "the piped stdin")?;
            }
            (None, false) => {}
        }
        Ok(())
    }
}

/// Read a whole prompt, at most `MAX_PROMPT_BYTES`, as UTF-8.
fn read_text(r: impl Read, what: &str) -> Result<String> {
    let mut buf = Vec::new();
    r.take(MAX_PROMPT_BYTES + 1)
        .read_to_end(&mut buf)
        .with_context(|| format!("reading the prompt from {what}"))?;
    if buf.len() as u64 > MAX_PROMPT_BYTES {
        bail!(
            "the prompt from {what} is longer than {} MiB",
            MAX_PROMPT_BYTES >> 20
        );
    }
    String::from_utf8(buf).map_err(|e| {
        anyhow!(
            "the prompt from {what} is not valid UTF-8 (byte {})",
            e.utf8_error().valid_up_to()
        )
    })
}

/// The chat template a run renders with: `--chat-template-file`, else the model's
/// `tokenizer.chat_template`; `None` when neither exists.
pub fn chat_template_source(args: &RunArgs, file: &GgufFile) -> Result<Option<String>> {
    if let Some(p) = &args.chat_template_file {
        let text = std::fs::read_to_string(p)
            .with_context(|| format!("--chat-template-file {}: cannot read it", p.display()))?;
        return Ok(Some(text));
    }
    Ok(file
        .get("tokenizer.chat_template")
        .and_then(|v| v.as_str())
        .map(str::to_string))
}

/// The chat format turns are rendered with (`chat_template_source`), with how `think:false`
/// is honoured decided from the template and the vocabulary (never the model's name); `None`
/// when there is no template.
pub fn chat_format(
    args: &RunArgs,
    file: &GgufFile,
    tok: &crate::tokenizer::Tokenizer,
) -> Result<Option<crate::chat::ChatFormat>> {
    let Some(src) = chat_template_source(args, file)? else {
        return Ok(None);
    };
    let thinks = tok.token_id("<think>").is_some() && tok.token_id("</think>").is_some();
    let template = crate::chat::ChatTemplate::new(&src, &tok.bos_text(), &tok.eos_text())
        .with_context(|| match &args.chat_template_file {
            Some(p) => format!("--chat-template-file {}", p.display()),
            None => "the model's tokenizer.chat_template".to_string(),
        })?;
    Ok(Some(crate::chat::ChatFormat::new(template, thinks)))
}

/// The prompt of a one-shot run as the model sees it, and its tokens: with `--chatml` (or
/// `-sys`) the chat template applied to the system message (if any) and one user message;
/// else the text as given, its special tokens parsed unless `--no-parse-special`.
pub fn render(
    args: &RunArgs,
    file: &GgufFile,
    tok: &crate::tokenizer::Tokenizer,
    model_path: &Path,
) -> Result<(String, Vec<u32>)> {
    if args.system_prompt.is_some() && !args.chatml {
        bail!("-sys/--system-prompt makes the prompt a chat: add --chatml");
    }
    if !args.chatml {
        let tokens = tok.encode(&args.prompt, !args.no_parse_special)?;
        return Ok((args.prompt.clone(), tokens));
    }
    let src = chat_template_source(args, file)?.ok_or_else(|| {
        anyhow!(
            "--chatml: {} has no tokenizer.chat_template (pass --chat-template-file FILE)",
            model_path.display()
        )
    })?;
    let ct = crate::chat::ChatTemplate::new(&src, &tok.bos_text(), &tok.eos_text())?;
    let mut msgs = Vec::new();
    if let Some(s) = &args.system_prompt {
        msgs.push(crate::chat::Message::new("system", s.clone()));
    }
    msgs.push(crate::chat::Message::new("user", args.prompt.clone()));
    let prompt = ct.render(&msgs, true, Some(!args.no_think))?;
    let tokens = tok.encode(&prompt, true)?;
    Ok((prompt, tokens))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn n_predict_takes_minus_one_and_counts() {
        assert_eq!(parse_n_predict("-1"), Ok(N_PREDICT_FILL));
        assert_eq!(parse_n_predict("7"), Ok(7));
        for bad in ["0", "-2", "x", "4294967295"] {
            assert!(parse_n_predict(bad).is_err(), "{bad}");
        }
        assert_eq!(n_predict_for(N_PREDICT_FILL, 10, 64).unwrap(), 54);
        assert!(n_predict_for(N_PREDICT_FILL, 64, 64).is_err());
        assert_eq!(n_predict_for(5, 10, 64).unwrap(), 5);
        assert!(n_predict_for(60, 10, 64).is_err());
    }

    #[test]
    fn seed_minus_one_is_random_and_drawn_once() {
        assert_eq!(parse_seed("-1"), Ok(SEED_RANDOM));
        assert_eq!(parse_seed("42"), Ok(42));
        assert!(parse_seed("-2").is_err());
        assert!(parse_seed(&u64::MAX.to_string()).is_err());
        let mut draws = std::collections::HashSet::new();
        for _ in 0..8 {
            let mut a = crate::cli::Cli::parse_run(&["bmoe-cli"]).unwrap();
            assert_eq!(a.seed, SEED_RANDOM, "the default is random");
            let s = a.resolve_seed().unwrap();
            assert_eq!(a.seed, s);
            assert_eq!(a.resolve_seed(), None, "drawn once");
            draws.insert(s);
        }
        assert!(
            draws.len() > 1,
            "eight random seeds were all equal: {draws:?}"
        );
        let mut fixed = crate::cli::Cli::parse_run(&["bmoe-cli", "--seed", "5"]).unwrap();
        assert_eq!(fixed.resolve_seed(), None);
        assert_eq!(fixed.seed, 5);
    }

    #[test]
    fn sys_is_rewritten_unless_it_is_a_value() {
        let v = |a: &[&str]| -> Vec<String> {
            rewrite_llama_flags(a.iter().map(OsString::from).collect())
                .into_iter()
                .map(|s| s.into_string().unwrap())
                .collect()
        };
        assert_eq!(
            v(&["x", "-sys", "be brief", "-p", "hi"]),
            ["x", "--system-prompt", "be brief", "-p", "hi"]
        );
        assert_eq!(v(&["x", "-sys=terse"]), ["x", "--system-prompt=terse"]);
        assert_eq!(v(&["x", "-p", "-sys"]), ["x", "-p", "-sys"]);
    }

    #[test]
    fn llama_cpp_habits_are_rewritten_with_a_note() {
        let v = |a: &[&str]| -> (Vec<String>, usize) {
            let (argv, notes) = rewrite_llama_flags_noting(a.iter().map(OsString::from).collect());
            (
                argv.into_iter().map(|s| s.into_string().unwrap()).collect(),
                notes.len(),
            )
        };
        assert_eq!(
            v(&["x", "-m", "m.gguf", "-ngl", "99", "-fa", "on", "-p", "hi"]),
            (
                vec![
                    "x".to_string(),
                    "-m".into(),
                    "m.gguf".into(),
                    "-p".into(),
                    "hi".into()
                ],
                2
            )
        );
        assert_eq!(v(&["x", "-ngl=20", "-fa", "-n", "4"]).0, ["x", "-n", "4"]);
        assert_eq!(
            v(&["x", "-m", "m.gguf", "-cnv"]).0,
            ["x", "chat", "-m", "m.gguf"]
        );
        assert_eq!(
            v(&["x", "chat", "-m", "m.gguf", "-cnv"]).0,
            ["x", "chat", "-m", "m.gguf"]
        );
        assert_eq!(
            v(&["x", "-m", "m.gguf", "-no-cnv"]),
            (vec!["x".to_string(), "-m".into(), "m.gguf".into()], 0)
        );
        // A value is a value.
        assert_eq!(v(&["x", "-p", "-ngl"]).0, ["x", "-p", "-ngl"]);
        // Parsed as clap would see them: -ngl no longer reads as -n gl.
        let run = crate::cli::Cli::parse_run(&["x", "-ngl", "99", "-n", "7"]).unwrap();
        assert_eq!(run.n_predict, 7);
        assert!(matches!(
            crate::cli::Cli::parse_argv(["x", "-m", "m.gguf", "-cnv"])
                .unwrap()
                .cmd,
            Some(crate::cli::Cmd::Chat(_))
        ));
    }

    #[test]
    fn the_prompt_comes_from_one_place() {
        let parse = |a: &[&str]| {
            let mut v = vec!["bmoe-cli"];
            v.extend_from_slice(a);
            crate::cli::Cli::parse_run(&v).unwrap()
        };
        let dir = crate::testdata::scratch_dir("prompt-unit");
        let f = dir.join("p.txt");
        std::fs::write(&f, "from a file\n").unwrap();
        let fs = f.to_str().unwrap();

        let mut a = parse(&["-f", fs]);
        a.resolve_prompt(&mut &b"ignored"[..], false).unwrap();
        assert_eq!(a.prompt, "from a file\n");

        let mut a = parse(&["-p", "-"]);
        a.resolve_prompt(&mut &b"from stdin"[..], true).unwrap();
        assert_eq!(a.prompt, "from stdin");

        let mut a = parse(&[]);
        a.resolve_prompt(&mut &b"piped"[..], false).unwrap();
        assert_eq!(a.prompt, "piped");

        let mut a = parse(&[]);
        a.resolve_prompt(&mut &b"a terminal is not read"[..], true)
            .unwrap();
        assert_eq!(a.prompt, "");

        let mut a = parse(&["-p", "given"]);
        a.resolve_prompt(&mut &b"piped"[..], false).unwrap();
        assert_eq!(a.prompt, "given");

        let e = parse(&["-p", "x", "-f", fs])
            .resolve_prompt(&mut &b""[..], true)
            .unwrap_err();
        assert!(e.to_string().contains("both -p and -f"), "{e}");
        let e = parse(&["-f", "/nonexistent/p.txt"])
            .resolve_prompt(&mut &b""[..], true)
            .unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/p.txt"), "{e:#}");
        let e = parse(&["-p", "-"])
            .resolve_prompt(&mut &b"\xff\xfe"[..], true)
            .unwrap_err();
        assert!(e.to_string().contains("UTF-8"), "{e}");

        let mut a = parse(&["--system-prompt", "be brief", "-p", "hi"]);
        a.resolve_prompt(&mut &b""[..], true).unwrap();
        assert!(a.chatml, "-sys makes the prompt a chat");
    }
}
