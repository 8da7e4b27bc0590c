//! The llama.cpp command line conventions (issue 18, item 3), through the real binary: `-f`,
//! `-p -` and a piped stdin, `-sys`, `--chat-template-file`, special tokens parsed in a raw
//! prompt (and `--no-parse-special`), `-n -1`, `--seed -1` (the default, random and reported),
//! and generation ending at an end-of-generation token. Also two of bmoe-cli's own outputs'
//! conventions: `--logits-out`'s per-row router margins, and `gen`'s routing defaults per
//! architecture.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

const BIN: &str = env!("CARGO_BIN_EXE_bmoe-cli");

fn dir() -> PathBuf {
    bmoe_engine::testdata::scratch_dir("cli-conventions")
}

fn model() -> &'static Path {
    static M: OnceLock<PathBuf> = OnceLock::new();
    M.get_or_init(|| {
        let m = dir().join("tiny.gguf");
        let st = Command::new(BIN)
            .args(["gen", "--preset", "tiny", "--quiet", "-o"])
            .arg(&m)
            .status()
            .expect("gen");
        assert!(st.success());
        m
    })
}

/// Run the binary with `args` and `stdin` bytes (None: /dev/null).
fn run(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut c = Command::new(BIN);
    c.arg("-m").arg(model()).args(args);
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    c.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = c.spawn().expect("spawn");
    if let Some(b) = stdin {
        let mut w = child.stdin.take().unwrap();
        w.write_all(b).unwrap();
    }
    let o = child.wait_with_output().unwrap();
    o
}

fn ok(o: &Output) -> (String, String) {
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "exit {:?}\n{out}\n{err}", o.status);
    (out, err)
}

/// The prompt's token ids, from `--logits-out`'s sidecar.
fn prompt_ids(tag: &str, args: &[&str], stdin: Option<&[u8]>) -> Vec<u32> {
    let path = dir().join(format!("{tag}.logits"));
    let p = path.to_str().unwrap().to_string();
    let mut a: Vec<&str> = args.to_vec();
    a.extend_from_slice(&["-n", "1", "--logits-out", &p]);
    ok(&run(&a, stdin));
    let side: serde_json::Value =
        serde_json::from_slice(&std::fs::read(format!("{p}.json")).unwrap()).unwrap();
    let n = side["n_prompt"].as_u64().unwrap() as usize;
    side["token_ids"].as_array().unwrap()[..n]
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn tokenizer() -> bmoe_engine::tokenizer::Tokenizer {
    let f = bmoe_engine::gguf::GgufFile::open(model()).unwrap();
    bmoe_engine::tokenizer::Tokenizer::from_gguf(&f).unwrap()
}

#[test]
fn the_prompt_comes_from_p_f_p_dash_or_a_piped_stdin() {
    let text = "The quick brown fox jumps over the lazy dog";
    let f = dir().join("prompt.txt");
    std::fs::write(&f, text).unwrap();
    let base = ok(&run(&["-p", text, "-n", "6"], None)).0;
    assert!(!base.trim().is_empty());
    let from_file = ok(&run(&["-f", f.to_str().unwrap(), "-n", "6"], None)).0;
    let dash = ok(&run(&["-p", "-", "-n", "6"], Some(text.as_bytes()))).0;
    let piped = ok(&run(&["-n", "6"], Some(text.as_bytes()))).0;
    assert_eq!(from_file, base, "-f");
    assert_eq!(dash, base, "-p -");
    assert_eq!(piped, base, "piped stdin");
    // A prompt past 128 KiB (too long for an argument on many systems) through -f and stdin.
    let long: String = text.repeat(200_000 / text.len() + 1);
    std::fs::write(&f, &long).unwrap();
    let o = run(&["-f", f.to_str().unwrap(), "-n", "1"], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("exceeds the context size"),
        "a long prompt is read whole and judged against the context: {err}"
    );
    let o = run(&["-n", "1", "-c", "65536"], Some(long.as_bytes()));
    assert!(o.status.success() || String::from_utf8_lossy(&o.stderr).contains("context"));
    // Both -p and -f: refused, naming both.
    let o = run(&["-p", "x", "-f", f.to_str().unwrap()], None);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("both -p and -f"));
    let o = run(&["-f", "/nonexistent/prompt.txt"], None);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/prompt.txt"));
}

#[test]
fn sys_adds_a_system_message_and_a_template_file_replaces_the_models() {
    let tok = tokenizer();
    let plain = prompt_ids("chat", &["--chatml", "-p", "Hello there"], None);
    let sys = prompt_ids(
        "sys",
        &["-sys", "Answer in one word", "-p", "Hello there"],
        None,
    );
    let (plain_t, sys_t) = (tok.decode(&plain), tok.decode(&sys));
    assert!(!plain_t.contains("Answer in one word"), "{plain_t}");
    assert!(
        sys_t.contains("system\nAnswer in one word") && sys_t.contains("Hello there"),
        "{sys_t}"
    );
    // The long spelling too.
    let long = prompt_ids(
        "sys-long",
        &["--system-prompt", "Answer in one word", "-p", "Hello there"],
        None,
    );
    assert_eq!(long, sys);

    let tpl = dir().join("custom.jinja");
    std::fs::write(
        &tpl,
        "{% for m in messages %}[[{{ m.role }}]] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[[bot]]{% endif %}",
    )
    .unwrap();
    let custom = prompt_ids(
        "tpl",
        &[
            "--chatml",
            "--chat-template-file",
            tpl.to_str().unwrap(),
            "-sys",
            "S",
            "-p",
            "Hello there",
        ],
        None,
    );
    let t = tok.decode(&custom);
    assert!(
        t.contains("[[system]] S\n[[user]] Hello there\n[[bot]]"),
        "{t}"
    );
    let o = run(
        &[
            "--chatml",
            "--chat-template-file",
            "/nonexistent.jinja",
            "-p",
            "x",
        ],
        None,
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--chat-template-file /nonexistent.jinja"));
}

#[test]
fn special_tokens_in_a_raw_prompt_are_parsed_unless_told_not_to() {
    let tok = tokenizer();
    let im_start = tok
        .token_id("<|im_start|>")
        .expect("the built-in vocabulary has it");
    let parsed = prompt_ids("special", &["-p", "<|im_start|>user"], None);
    let literal = prompt_ids(
        "literal",
        &["-p", "<|im_start|>user", "--no-parse-special"],
        None,
    );
    assert!(parsed.contains(&im_start), "{parsed:?}");
    assert!(!literal.contains(&im_start), "{literal:?}");
    assert!(literal.len() > parsed.len());
}

fn generated(err: &str) -> u32 {
    err.lines()
        .find_map(|l| l.strip_prefix("generation: "))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no generation line in {err}"))
}

#[test]
fn n_minus_one_fills_the_context_and_an_end_of_generation_token_stops_it() {
    let prompt = prompt_ids("fill", &["-p", "Tell me"], None).len() as u32;
    let (_, err) = ok(&run(&["-p", "Tell me", "-n", "-1", "-c", "96"], None));
    assert_eq!(generated(&err), 96 - prompt, "{err}");
    let o = run(&["-p", "Tell me", "-n", "-2"], None);
    assert_eq!(o.status.code(), Some(2), "a bad value is exit 2");
    assert!(String::from_utf8_lossy(&o.stderr).contains("-1 for"));

    // Near-uniform sampling reaches one of the vocabulary's end-of-generation tokens within
    // 512 positions for most seeds (each step draws one with probability ~1/1000): the turn
    // ends there, short of the room. Which seeds do moves with every change to the model's
    // bits, so the test takes the first of 32 that does (each run is deterministic) — and
    // fails if none does, or if a run that ended early did not end on one.
    let tok = tokenizer();
    let mut ended = None;
    for seed in 0..32u32 {
        let seed = seed.to_string();
        let args = bmoe_engine::cli::Cli::parse_run(&[
            "bmoe-cli", "-p", "Tell me", "-n", "-1", "-c", "512", "--temp", "3", "--top-k", "0",
            "--top-p", "1", "--seed", &seed,
        ])
        .unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let o = bmoe_engine::run::generate_with(&args, model(), &mut out, &mut err).unwrap();
        if (o.tokens.len() as u32) < 512 - prompt {
            ended = Some((seed, o));
            break;
        }
        assert!(
            o.tokens.iter().all(|&t| !tok.is_eog(t)),
            "seed {seed}: the run filled the room past an end-of-generation token"
        );
    }
    let (seed, o) = ended.expect("no seed of 32 reached an end-of-generation token");
    let last = *o.tokens.last().unwrap();
    assert!(
        tok.is_eog(last),
        "seed {seed}: the run ended early on {last}, not an end-of-generation token"
    );
    assert!(
        o.tokens[..o.tokens.len() - 1]
            .iter()
            .all(|&t| !tok.is_eog(t)),
        "nothing after the first end-of-generation token"
    );
}

#[test]
fn the_default_seed_is_random_reported_and_repeatable() {
    let seed_of = |err: &str| -> u64 {
        err.lines()
            .find_map(|l| l.strip_prefix("bmoe: sampling seed "))
            .and_then(|l| l.split(' ').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no seed reported: {err}"))
    };
    let args = ["-p", "Once", "-n", "12", "--temp", "1.5", "--top-k", "0"];
    let (a_out, a_err) = ok(&run(&args, None));
    let (_, b_err) = ok(&run(&args, None));
    let (sa, sb) = (seed_of(&a_err), seed_of(&b_err));
    assert_ne!(sa, sb, "two runs drew the same random seed");
    let s = sa.to_string();
    let mut again = args.to_vec();
    again.extend_from_slice(&["--seed", &s]);
    let (c_out, c_err) = ok(&run(&again, None));
    assert_eq!(c_out, a_out, "--seed {s} repeats the run that reported it");
    assert!(
        !c_err.contains("sampling seed"),
        "a given seed is not 'random'"
    );
    // -1 spelled out is the default; greedy runs say nothing about a seed.
    let mut neg = args.to_vec();
    neg.extend_from_slice(&["--seed", "-1"]);
    seed_of(&ok(&run(&neg, None)).1);
    assert!(!ok(&run(&["-p", "Once", "-n", "2"], None))
        .1
        .contains("sampling seed"));
    // The CSV preamble records the seed drawn.
    let csv = dir().join("seed.csv");
    let mut c = args.to_vec();
    let cs = csv.to_str().unwrap().to_string();
    c.extend_from_slice(&["--csv", &cs]);
    let seed = seed_of(&ok(&run(&c, None)).1);
    let text = std::fs::read_to_string(&csv).unwrap();
    assert!(text.contains(&format!("seed={seed} ")), "{text}");
}

/// `--logits-out`'s sidecar carries one router margin per logits row (prompt positions and
/// generated steps): over the MoE layers that routed the row, the lead of the last chosen
/// expert over the best unchosen one, in logit units — never negative (the chosen lead by
/// construction), finite on a model whose every layer routes, and spread over positions.
#[test]
fn logits_out_reports_each_rows_router_margin() {
    let path = dir().join("margins.logits");
    let p = path.to_str().unwrap().to_string();
    ok(&run(
        &[
            "-p",
            "The cache of experts keeps what the router asked for.",
            "-n",
            "3",
            "--ignore-eos",
            "--logits-out",
            &p,
        ],
        None,
    ));
    let side: serde_json::Value =
        serde_json::from_slice(&std::fs::read(format!("{p}.json")).unwrap()).unwrap();
    let n_vocab = side["n_vocab"].as_u64().unwrap();
    let rows = std::fs::metadata(&path).unwrap().len() / (4 * n_vocab);
    let margins: Vec<f64> = side["router_margin"]
        .as_array()
        .expect("router_margin in the sidecar")
        .iter()
        .map(|m| {
            m.as_f64()
                .expect("a finite margin: every tiny layer routes")
        })
        .collect();
    assert_eq!(margins.len() as u64, rows, "one margin per logits row");
    assert!(margins.iter().all(|&m| m >= 0.0), "{margins:?}");
    let (lo, hi) = margins
        .iter()
        .fold((f64::MAX, 0.0f64), |(a, b), &m| (a.min(m), b.max(m)));
    assert!(hi > lo, "margins differ between positions: {margins:?}");
}

/// `gen`'s routing defaults follow the architecture: gemma4 files route on routing context 0.2
/// at depth 0 (its sub-layer outputs are normalised, so its context does not grow with depth),
/// the others on their preset's context at depth 0.75 — and given flags win over both.
#[test]
fn gen_routing_defaults_follow_the_architecture_and_yield_to_flags() {
    let meta = |tag: &str, args: &[&str]| -> (f64, f64) {
        let out = dir().join(format!("gen-{tag}.gguf"));
        let st = Command::new(BIN)
            .args(["gen", "--preset", "tiny", "--quiet", "-o"])
            .arg(&out)
            .args(args)
            .output()
            .expect("gen");
        assert!(
            st.status.success(),
            "{}",
            String::from_utf8_lossy(&st.stderr)
        );
        let f = bmoe_engine::gguf::GgufFile::open(&out).unwrap();
        let get = |k: &str| f.get(k).and_then(|v| v.as_f64()).expect(k);
        let r = (
            get("bmoe.gen.routing_context"),
            get("bmoe.gen.routing_depth"),
        );
        let _ = std::fs::remove_file(&out);
        r
    };
    let close = |a: (f64, f64), b: (f64, f64)| (a.0 - b.0).abs() < 1e-6 && (a.1 - b.1).abs() < 1e-6;
    let g = meta("gemma4", &["--arch", "gemma4"]);
    assert!(close(g, (0.2, 0.0)), "gemma4 defaults: {g:?}");
    let q = meta("qwen3moe", &[]);
    assert!(close(q, (0.65, 0.75)), "qwen3moe tiny defaults: {q:?}");
    let given = meta(
        "gemma4-given",
        &[
            "--arch",
            "gemma4",
            "--routing-depth",
            "0.5",
            "--routing-context",
            "0.4",
        ],
    );
    assert!(close(given, (0.4, 0.5)), "flags win: {given:?}");
}

#[test]
fn the_penalty_flags_are_checked_and_change_greedy_decoding() {
    let args = |extra: &[&str]| {
        let mut v = vec![
            "bmoe-cli",
            "-p",
            "The river runs past the old mill and the mill runs past the river",
            "-n",
            "48",
        ];
        v.extend_from_slice(extra);
        bmoe_engine::cli::Cli::parse_run(&v).unwrap()
    };
    let tokens = |a| {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        bmoe_engine::run::generate_with(&a, model(), &mut out, &mut err)
            .unwrap()
            .tokens
    };
    let plain = tokens(args(&[]));
    // Every penalty at its neutral value (and min-p, which greedy ignores) leaves the bits alone.
    assert_eq!(
        tokens(args(&[
            "--repeat-penalty",
            "1",
            "--presence-penalty",
            "0",
            "--min-p",
            "0.3"
        ])),
        plain
    );
    let penalised = tokens(args(&["--repeat-penalty", "3", "--repeat-last-n", "256"]));
    assert_ne!(
        penalised, plain,
        "a repeat penalty of 3 changes greedy decoding"
    );
    for (flag, value, needle) in [
        ("--repeat-penalty", "0", "positive"),
        ("--presence-penalty", "2.5", "-2 to 2"),
        ("--frequency-penalty", "x", "-2 to 2"),
        ("--min-p", "1.5", "0 to 1"),
    ] {
        let o = run(&["-p", "hi", flag, value], None);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.contains(needle), "{flag} {value}: {err}");
    }
}

#[test]
fn a_plain_run_reports_its_load_and_prompt_and_a_template_file_alone_makes_a_chat() {
    let (_, err) = ok(&run(&["-p", "Tell me about the river", "-n", "4"], None));
    let line = |p: &str| {
        err.lines()
            .find(|l| l.starts_with(p))
            .unwrap_or_else(|| panic!("no {p} line in\n{err}"))
            .to_string()
    };
    let prompt = line("prompt: ");
    let n: usize = prompt_ids("report", &["-p", "Tell me about the river"], None).len();
    assert!(
        prompt.starts_with(&format!("prompt: {n} tokens in ")),
        "{prompt}"
    );
    assert!(prompt.ends_with(" tok/s)"), "{prompt}");
    assert!(line("load: ").ends_with(" s"));
    // --chat-template-file alone renders the prompt as a chat with that template, the same
    // as with --chatml; without either, the prompt is raw text.
    let template = dir().join("alone.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n",
    )
    .unwrap();
    let t = template.to_str().unwrap();
    let alone = prompt_ids("tpl-alone", &["-p", "hi", "--chat-template-file", t], None);
    let with = prompt_ids(
        "tpl-chatml",
        &["-p", "hi", "--chatml", "--chat-template-file", t],
        None,
    );
    let raw = prompt_ids("tpl-raw", &["-p", "hi"], None);
    assert_eq!(alone, with);
    assert_ne!(alone, raw);
    let tok = tokenizer();
    assert!(
        tok.decode(&alone)
            .contains("<|im_start|>user\nhi<|im_end|>"),
        "{}",
        tok.decode(&alone)
    );
}
