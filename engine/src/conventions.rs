//! llama.cpp's command line habits as values and argv: `-n -1`, `--seed -1`, the sampling
//! parameters' ranges, and the short flags (`-sys`, `-cnv`, `-ngl`, `-fa`) rewritten before
//! clap parses. A leaf: `cli` takes its value parsers from here, and `prompt` the rest.

use std::ffi::OsString;

/// `-n -1`: generate until an end-of-generation token or until the context is full.
pub const N_PREDICT_FILL: u32 = u32::MAX;

/// `--seed -1` (the default): a random seed, drawn once per process and reported.
pub const SEED_RANDOM: u64 = u64::MAX;

/// `-n`: `-1`, or a count of at least 1.
pub fn parse_n_predict(s: &str) -> Result<u32, String> {
    let s = s.trim();
    if s == "-1" {
        return Ok(N_PREDICT_FILL);
    }
    match s.parse::<u32>() {
        Ok(n) if n >= 1 && n != N_PREDICT_FILL => Ok(n),
        _ => Err(format!(
            "expected a token count >= 1, or -1 for \"until end of generation or the context is full\"; got {s:?}"
        )),
    }
}

/// `--seed`: `-1` (random), or any seed below 2^64 - 1.
pub fn parse_seed(s: &str) -> Result<u64, String> {
    let s = s.trim();
    if s == "-1" {
        return Ok(SEED_RANDOM);
    }
    match s.parse::<u64>() {
        Ok(n) if n != SEED_RANDOM => Ok(n),
        _ => Err(format!(
            "expected a seed from 0 to {}, or -1 for a random one; got {s:?}",
            SEED_RANDOM - 1
        )),
    }
}

/// A number from 0 to 1 (`--min-p`).
pub fn parse_unit(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(x) if (0.0..=1.0).contains(&x) => Ok(x),
        _ => Err(format!("expected a number from 0 to 1; got {s:?}")),
    }
}

/// A positive factor (`--repeat-penalty`; 1 = off).
pub fn parse_penalty_factor(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        _ => Err(format!("expected a positive number (1 = off); got {s:?}")),
    }
}

/// An additive penalty from -2 to 2, as OpenAI's (`--presence-penalty`, `--frequency-penalty`).
pub fn parse_additive_penalty(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(x) if (-2.0..=2.0).contains(&x) => Ok(x),
        _ => Err(format!(
            "expected a number from -2 to 2 (0 = off); got {s:?}"
        )),
    }
}

/// llama.cpp's flags a user types out of habit, rewritten before clap parses (clap would read
/// `-ngl 99` as `-n gl`): `-sys` (and `-sys=TEXT`) becomes `--system-prompt`; `-cnv` /
/// `--conversation` runs `chat` (as the subcommand, when none is given); `-no-cnv` /
/// `--no-conversation` is bmoe's default (one-shot) and is dropped; `-ngl` / `--gpu-layers` /
/// `--n-gpu-layers` with its count and `-fa` / `--flash-attn` with an optional `on`/`off`/
/// `auto` are dropped with a note (this engine runs on the CPU, its attention has one path).
/// A flag in the value position of the flag before it (`-p -sys`) is left alone.
pub fn rewrite_llama_flags(argv: Vec<OsString>) -> Vec<OsString> {
    rewrite_llama_flags_noting(argv).0
}

/// [`rewrite_llama_flags`] and one note per flag it dropped, for the user.
pub fn rewrite_llama_flags_noting(argv: Vec<OsString>) -> (Vec<OsString>, Vec<String>) {
    const TAKES_VALUE: &[&str] = &["-p", "--prompt", "--system-prompt", "-f", "--file"];
    const SUBCOMMANDS: &[&str] = &[
        "gen", "inspect", "bench", "checksum", "serve", "chat", "help",
    ];
    let mut out: Vec<OsString> = Vec::with_capacity(argv.len());
    let mut notes = Vec::new();
    let mut chat = false;
    let mut it = argv.into_iter().peekable();
    if let Some(a) = it.next() {
        out.push(a);
    }
    while let Some(a) = it.next() {
        let after_value_flag = out
            .last()
            .and_then(|p| p.to_str())
            .is_some_and(|p| TAKES_VALUE.contains(&p));
        let text = a.to_str().unwrap_or("");
        if !after_value_flag {
            if text == "-sys" {
                out.push("--system-prompt".into());
                continue;
            }
            if text == "-np" {
                out.push("--parallel".into());
                continue;
            }
            if let Some(v) = text.strip_prefix("-sys=") {
                out.push(format!("--system-prompt={v}").into());
                continue;
            }
            match text {
                "-cnv" | "--conversation" => {
                    chat = true;
                    continue;
                }
                "-no-cnv" | "--no-conversation" => continue,
                "-ngl" | "--gpu-layers" | "--n-gpu-layers" => {
                    let n = it.next_if(|v| {
                        v.to_str()
                            .is_some_and(|v| v.parse::<i64>().is_ok() || v == "auto" || v == "all")
                    });
                    notes.push(format!(
                        "{text}{} ignored: bmoe runs on the CPU (no layers to offload)",
                        n.map(|n| format!(" {}", n.to_string_lossy()))
                            .unwrap_or_default()
                    ));
                    continue;
                }
                "-fa" | "--flash-attn" => {
                    let v = it
                        .next_if(|v| matches!(v.to_str(), Some("on" | "off" | "auto" | "1" | "0")));
                    notes.push(format!(
                        "{text}{} ignored: bmoe's attention has one CPU path",
                        v.map(|v| format!(" {}", v.to_string_lossy()))
                            .unwrap_or_default()
                    ));
                    continue;
                }
                _ => {}
            }
            if let Some(n) = text
                .strip_prefix("-ngl=")
                .or_else(|| text.strip_prefix("--n-gpu-layers="))
                .or_else(|| text.strip_prefix("--gpu-layers="))
            {
                notes.push(format!(
                    "-ngl {n} ignored: bmoe runs on the CPU (no layers to offload)"
                ));
                continue;
            }
        }
        out.push(a);
    }
    if chat {
        let has_sub = out
            .get(1)
            .and_then(|a| a.to_str())
            .is_some_and(|a| SUBCOMMANDS.contains(&a));
        if !has_sub {
            out.insert(1.min(out.len()), "chat".into());
        }
    }
    (out, notes)
}
