//! Shared plumbing for the gates: synthetic models made once per test binary, and runs of
//! `bmoe-cli` in-process with their answer captured.

pub mod llama;

use bmoe_engine::cli::Cli;
use clap::Parser;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// A scratch directory for this test process, removed by a later test process once this
/// one is gone (`bmoe_engine::testdata::scratch_dir`).
pub fn scratch_dir(name: &str) -> PathBuf {
    bmoe_engine::testdata::scratch_dir(name)
}

static MODELS: OnceLock<Mutex<Vec<(String, PathBuf)>>> = OnceLock::new();

/// A synthetic model made once per process by `bmoe-cli gen` with these arguments.
pub fn model(key: &str, gen_args: &[&str]) -> PathBuf {
    let m = MODELS.get_or_init(|| Mutex::new(Vec::new()));
    let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = g.iter().find(|(k, _)| k == key) {
        return p.clone();
    }
    let path = scratch_dir("models").join(format!("{key}.gguf"));
    let mut argv = vec![
        "bmoe-cli",
        "gen",
        "--quiet",
        "--out",
        path.to_str().expect("utf-8 path"),
    ];
    argv.extend_from_slice(gen_args);
    let cli = Cli::try_parse_from(&argv).expect("gen arguments parse");
    match cli.cmd {
        Some(bmoe_engine::cli::Cmd::Gen(a)) => bmoe_engine::cli::gen(a).expect("gen"),
        _ => panic!("not a gen command"),
    }
    g.push((key.to_string(), path.clone()));
    path
}

/// The result of one in-process run.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub outcome: bmoe_engine::run::Outcome,
}

/// Run `bmoe-cli -m MODEL <args>` in-process.
pub fn run(model: &Path, args: &[&str]) -> Run {
    let mut argv = vec!["bmoe-cli", "-m", model.to_str().expect("utf-8 path")];
    argv.extend_from_slice(args);
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("arguments {args:?}: {e}"));
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let outcome = bmoe_engine::run::generate_with(&cli.run, model, &mut out, &mut err)
        .unwrap_or_else(|e| panic!("run {args:?}: {e:#}\n{}", String::from_utf8_lossy(&err)));
    Run {
        code: outcome.code,
        stdout: String::from_utf8_lossy(&out).into_owned(),
        stderr: String::from_utf8_lossy(&err).into_owned(),
        outcome,
    }
}

/// The tiny preset (4 layers, 16 experts, top-4, Q8_0 experts).
pub fn tiny() -> PathBuf {
    model("tiny", &["--preset", "tiny", "--seed", "7"])
}

/// A `bmoe-cli --session` served in-process over a pipe: requests are written one line at a
/// time and replies read back as they come, as a client program would drive it.
pub struct SessionDriver {
    requests: Option<std::io::PipeWriter>,
    replies: std::io::BufReader<std::io::PipeReader>,
    server: Option<std::thread::JoinHandle<(anyhow::Result<i32>, String)>>,
    /// Every stdout line so far.
    pub lines: Vec<String>,
}

impl SessionDriver {
    /// Start `bmoe-cli -m MODEL --session <args>` and read its `BMOE_READY` line.
    pub fn start(model: &Path, args: &[&str]) -> SessionDriver {
        let mut argv = vec![
            "bmoe-cli",
            "-m",
            model.to_str().expect("utf-8 path"),
            "--session",
        ];
        argv.extend_from_slice(args);
        let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("arguments {args:?}: {e}"));
        let (req_r, req_w) = std::io::pipe().expect("pipe");
        let (rep_r, rep_w) = std::io::pipe().expect("pipe");
        let model = model.to_path_buf();
        let server = std::thread::spawn(move || {
            let mut err = Vec::new();
            let r = bmoe_engine::session::serve(
                &cli.run,
                &model,
                Box::new(std::io::BufReader::new(req_r)),
                Box::new(rep_w),
                &mut err,
                &bmoe_core::CancelFlag::new(),
            );
            (r, String::from_utf8_lossy(&err).into_owned())
        });
        let mut d = SessionDriver {
            requests: Some(req_w),
            replies: std::io::BufReader::new(rep_r),
            server: Some(server),
            lines: Vec::new(),
        };
        let ready = d.read_until(&["BMOE_READY", "BMOE_ERROR"]);
        assert!(
            ready.last().is_some_and(|l| l.starts_with("BMOE_READY ")),
            "no BMOE_READY: {ready:?}"
        );
        d
    }

    /// Send one request line.
    pub fn send(&mut self, line: &str) {
        use std::io::Write;
        let w = self.requests.as_mut().expect("requests still open");
        writeln!(w, "{line}").expect("write request");
        w.flush().expect("flush request");
    }

    /// Read reply lines up to and including the first whose tag is in `tags`.
    pub fn read_until(&mut self, tags: &[&str]) -> Vec<String> {
        use std::io::BufRead;
        let mut got = Vec::new();
        loop {
            let mut l = String::new();
            let n = self.replies.read_line(&mut l).expect("read reply");
            assert!(n > 0, "the session closed stdout; got {got:?}");
            let l = l.trim_end_matches('\n').to_string();
            self.lines.push(l.clone());
            got.push(l.clone());
            if tags.iter().any(|t| l.split(' ').next() == Some(t)) {
                return got;
            }
        }
    }

    /// Send a generate request and return its `BMOE_DONE` as JSON (and the turn's lines).
    pub fn generate(&mut self, request: &str) -> (serde_json::Value, Vec<String>) {
        self.send(request);
        let lines = self.read_until(&["BMOE_DONE", "BMOE_ERROR"]);
        let last = lines.last().expect("a reply");
        let (tag, json) = last.split_once(' ').expect("TAG {json}");
        assert_eq!(tag, "BMOE_DONE", "{request} -> {last}");
        (serde_json::from_str(json).expect("BMOE_DONE JSON"), lines)
    }

    /// Send a decide request and return its `BMOE_DECIDE` as JSON (and the request's lines:
    /// `BMOE_BEGIN`, then the `BMOE_DECIDE`, nothing between).
    pub fn decide(&mut self, request: &str) -> (serde_json::Value, Vec<String>) {
        self.send(request);
        let lines = self.read_until(&["BMOE_DECIDE", "BMOE_ERROR"]);
        let last = lines.last().expect("a reply");
        let (tag, json) = last.split_once(' ').expect("TAG {json}");
        assert_eq!(tag, "BMOE_DECIDE", "{request} -> {last}");
        (serde_json::from_str(json).expect("BMOE_DECIDE JSON"), lines)
    }

    /// Close stdin and wait for the session to end: its exit code and stderr.
    pub fn close(mut self) -> (i32, String) {
        drop(self.requests.take());
        let (r, err) = self
            .server
            .take()
            .expect("server")
            .join()
            .expect("session thread");
        (
            r.unwrap_or_else(|e| panic!("session failed: {e:#}\n{err}")),
            err,
        )
    }
}

/// Run `bmoe-sim <args>` in-process: (exit code, stdout, stderr).
pub fn sim(args: &[&str]) -> (i32, String, String) {
    let mut argv = vec!["bmoe-sim"];
    argv.extend_from_slice(args);
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(argv, &[], &mut out, &mut err);
    (
        code,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

/// Replay a session's route trace through `bmoe-sim replay` with the engine's cache `flags`
/// and hold the simulated CSV to the engine's `csv`: the same rows and, turn by turn, every
/// exact summary key (hits, misses, read bytes, ...), and `bmoe-sim diff --exact-only` agrees.
/// Returns the engine's metrics.
pub fn assert_session_replays_exactly(
    csv: &Path,
    route: &Path,
    flags: &[&str],
) -> bmoe_core::telemetry::MetricsCsv {
    use bmoe_core::telemetry::MetricsCsv;
    let measured = MetricsCsv::parse(&std::fs::read_to_string(csv).expect("engine csv"))
        .expect("engine csv parses");
    let mut argv: Vec<String> = ["bmoe-sim", "replay", "--trace", route.to_str().unwrap()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    argv.extend(["--profile".into(), "this-machine".into()]);
    argv.extend(flags.iter().map(|s| s.to_string()));
    if measured.preamble.get("o_direct") == Some("0") {
        argv.push("--no-odirect".into());
    }
    let sim_csv = csv.with_extension("sim.csv");
    argv.extend(["--csv".into(), sim_csv.display().to_string()]);
    let (mut out, mut serr) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(argv, &[], &mut out, &mut serr);
    assert_eq!(code, 0, "{}", String::from_utf8_lossy(&serr));
    let simulated = MetricsCsv::parse(&std::fs::read_to_string(&sim_csv).expect("sim csv"))
        .expect("sim csv parses");
    assert_eq!(simulated.rows.len(), measured.rows.len());
    for (m, s) in measured.rows.iter().zip(&simulated.rows) {
        assert_eq!(
            (m.turn, m.step, m.read_bytes, m.cache_hit_pct),
            (s.turn, s.step, s.read_bytes, s.cache_hit_pct),
            "turn {} token {}",
            m.turn,
            m.step
        );
    }
    assert_eq!(simulated.summaries.len(), measured.summaries.len());
    for (t, (ms, ss)) in measured
        .summaries
        .iter()
        .zip(&simulated.summaries)
        .enumerate()
    {
        for key in bmoe_sim::diff::EXACT_SUMMARY_KEYS {
            assert_eq!(ms.get(key), ss.get(key), "turn {t}: summary {key}");
        }
    }
    let (mut out, mut serr) = (Vec::new(), Vec::new());
    let code = bmoe_sim::cli::run(
        [
            "bmoe-sim".to_string(),
            "diff".into(),
            sim_csv.display().to_string(),
            csv.display().to_string(),
            "--exact-only".into(),
        ],
        &[],
        &mut out,
        &mut serr,
    );
    assert_eq!(
        code,
        0,
        "{}{}",
        String::from_utf8_lossy(&out),
        String::from_utf8_lossy(&serr)
    );
    let _ = std::fs::remove_file(sim_csv);
    measured
}

/// A recurrent model served as the server serves it (each request the whole prompt; the warm
/// state reused up to the common prefix): a request that keeps the last one's prompt but not
/// its answer — the same prompt again (a regenerated reply), or the prompt with other text
/// after it (an edited reply; a chat template that re-renders the answer is the same case) —
/// cannot continue from where the answer left the state, which cannot roll back, so it
/// continues from the copy kept at the raw prompt's boundary, its last token — every
/// position before it reused — and answers as a fresh conversation given its prompt does.
/// A request that rolls back into the first prompt finds no copy there and is fed from 0.
/// `args`: the flags.
pub fn assert_turn_boundary_reuse(model: &Path, args: &[&str]) {
    use bmoe_engine::converse::{Conversation, Listener, Prompt, TurnOptions};
    struct Text(String);
    impl Listener for Text {
        fn delta(&mut self, reasoning: &str, content: &str) -> bool {
            self.0.push_str(reasoning);
            self.0.push_str(content);
            true
        }
    }
    let open = || {
        let mut argv = vec!["bmoe-cli", "-m", model.to_str().expect("utf-8 path")];
        argv.extend_from_slice(args);
        let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("arguments {args:?}: {e}"));
        Conversation::open(&cli.run, model, &mut std::io::sink()).expect("open")
    };
    // (text, tokens reused, prompt tokens)
    let turn = |c: &mut Conversation, prompt: &str| {
        let p = c
            .prepare(&Prompt::Raw(prompt.to_string()), Some(8))
            .expect("prepare");
        let mut t = Text(String::new());
        let f = c.run(&p, &TurnOptions::default(), &mut t).expect("run");
        assert_eq!(f.completion_tokens, 8, "{prompt}: {:?}", f.error);
        (t.0, f.cached_tokens, f.prompt_tokens)
    };
    let first = "The fox lived by the river and every morning it walked";
    let second = format!("{first} to the old mill where the miller kept his grain");
    let third = "The fox lived by the sea";
    let mut warm = open();
    let a = turn(&mut warm, first);
    let again = turn(&mut warm, first);
    let b = turn(&mut warm, &second);
    let r = turn(&mut warm, third);
    assert_eq!(
        again.1,
        a.2 - 1,
        "a regenerated reply reuses the prompt: {again:?}"
    );
    assert_eq!(again.0, a.0, "and answers alike (greedy)");
    assert_eq!(
        b.1,
        a.2 - 1,
        "an edited reply reuses the prompt: {a:?} {b:?}"
    );
    assert_eq!(r.1, 0, "{r:?}");
    let mut fresh = open();
    let c = turn(&mut fresh, &second);
    let mut fresh = open();
    let q = turn(&mut fresh, third);
    assert_eq!(b.0, c.0, "continued {b:?}\nfresh {c:?}");
    assert_eq!(r.0, q.0, "re-fed {r:?}\nfresh {q:?}");
}

/// The step engine of `m` as `bmoe-cli -m m -t 2 <extra>` loads it, for tests that drive steps
/// themselves.
pub fn load_engine(m: &Path, extra: &[&str]) -> bmoe_engine::run::EngineStep {
    let mut argv = vec!["bmoe-cli", "-m", m.to_str().unwrap(), "-t", "2"];
    argv.extend_from_slice(extra);
    let cli = Cli::try_parse_from(argv).expect("args");
    bmoe_engine::run::load(&cli.run, m, &mut Vec::new())
        .expect("load")
        .engine
}

/// Feed `tokens` at positions `from..` as one prefill step; the last row's logits as bits.
pub fn step_logit_bits(
    e: &mut bmoe_engine::run::EngineStep,
    tokens: &[u32],
    from: u32,
) -> Result<Vec<u32>, String> {
    use bmoe_core::Backend;
    let positions: Vec<u32> = (from..from + tokens.len() as u32).collect();
    e.step(
        &bmoe_core::StepInput {
            turn: 0,
            phase: bmoe_core::records::Phase::Prefill,
            tokens,
            positions: &positions,
        },
        &mut bmoe_core::records::NullSink,
    )
    .map_err(|e| format!("{e:#}"))?;
    Ok(e.backend()
        .last_logits()
        .expect("logits")
        .iter()
        .map(|x| x.to_bits())
        .collect())
}

/// A KV memory read back exactly: a prompt fed in pieces (two prefills, then token by token)
/// and a turn fed over rows an earlier one wrote (keeping the first 10 positions) each give
/// the logits of one fresh prefill, bit for bit.
pub fn assert_pieces_and_rollback_exact(m: &Path) {
    let prompt: Vec<u32> = (0..29).map(|i| (i * 131 + 17) % 4000).collect();
    let want = step_logit_bits(&mut load_engine(m, &[]), &prompt, 0).unwrap();
    let mut e = load_engine(m, &[]);
    step_logit_bits(&mut e, &prompt[..11], 0).unwrap();
    step_logit_bits(&mut e, &prompt[11..20], 11).unwrap();
    let mut got = Vec::new();
    for (i, &t) in prompt.iter().enumerate().skip(20) {
        got = step_logit_bits(&mut e, &[t], i as u32).unwrap();
    }
    assert_eq!(got, want, "{}: pieces", m.display());
    let first: Vec<u32> = (0..16).map(|i| (i * 97 + 3) % 4000).collect();
    let other: Vec<u32> = (0..9).map(|i| (i * 61 + 11) % 4000).collect();
    let mut e = load_engine(m, &[]);
    step_logit_bits(&mut e, &first, 0).unwrap();
    let got = step_logit_bits(&mut e, &other, 10).unwrap();
    let whole: Vec<u32> = first[..10].iter().chain(&other).copied().collect();
    let want = step_logit_bits(&mut load_engine(m, &[]), &whole, 0).unwrap();
    assert_eq!(got, want, "{}: rolled back", m.display());
}

/// A recurrent state carried across batches, through the engine's backend, resident and
/// streamed through an evicting cache (with and without overlap): a prompt fed in pieces, one
/// of them a single token, gives a fresh prefill's logits bit for bit; the whole prompt is
/// reusable where the state stands and nothing before it; a prefix kept where the state stands
/// is restored exactly after everything was overwritten, and one asked for where the state no
/// longer stands is not kept (a recurrent state cannot roll back).
pub fn assert_recurrent_state_continues_exactly(m: &Path) {
    let streamed = [
        "--moe-stream",
        "--cache-mb",
        "2",
        "--force-cache",
        "--io-threads",
        "2",
    ];
    for extra in [
        &[][..],
        &streamed[..],
        &[&streamed[..], &["--overlap"]].concat()[..],
    ] {
        let load = || load_engine(m, extra);
        let step = |e: &mut bmoe_engine::run::EngineStep, tokens: &[u32], from: u32| {
            step_logit_bits(e, tokens, from).expect("step")
        };
        let prompt: Vec<u32> = (300..330).collect();
        let junk: Vec<u32> = (900..916).collect();
        let want = step(&mut load(), &prompt, 0);

        let mut e = load();
        step(&mut e, &prompt[..11], 0);
        step(&mut e, &prompt[11..12], 11);
        assert_eq!(step(&mut e, &prompt[12..], 12), want, "{extra:?}: pieces");
        use bmoe_core::Backend;
        assert_eq!(e.backend().reusable_prefix(30), 30);
        assert_eq!(e.backend().reusable_prefix(29), 0);

        let mut e = load();
        step(&mut e, &prompt[..9], 0);
        assert!(e.backend_mut().keep_prefix(9).expect("keep").is_some());
        step(&mut e, &prompt[9..14], 9);
        assert_eq!(e.backend_mut().keep_prefix(9).expect("keep"), None);
        assert_eq!(e.backend_mut().restore_prefix().expect("restore"), None);
        step(&mut e, &prompt[..9], 0);
        assert!(e.backend_mut().keep_prefix(9).expect("keep").is_some());
        step(&mut e, &junk, 0);
        assert_eq!(e.backend_mut().restore_prefix().expect("restore"), Some(9));
        assert_eq!(step(&mut e, &prompt[9..], 9), want, "{extra:?}: restored");
    }
}

/// A session `decide` request of three choices.
pub fn decide_request(id: u32, prefix: &str, suffix: &str, reuse: bool) -> String {
    serde_json::json!({"cmd": "decide", "id": id, "prefix": prefix, "suffix": suffix,
           "choices": ["yes", "no", "maybe"], "reuse_prefix": reuse})
    .to_string()
}

/// A `BMOE_DECIDE`'s choice log-probabilities as bits (`None` for a null).
pub fn logp_bits(d: &serde_json::Value) -> Vec<Option<u64>> {
    d["choice_logp"]
        .as_array()
        .unwrap_or_else(|| panic!("no choice_logp: {d}"))
        .iter()
        .map(|v| v.as_f64().map(f64::to_bits))
        .collect()
}

/// Decides on `m` (`--decide --chatml`) over a prefix, a second question on it and a longer
/// prefix: warm (the prefix state restored where possible: a state of a few MiB is kept, the
/// later decides reuse it), cold in the same session, and fresh in a new session all score
/// the same bits.
pub fn assert_decides_equal_fresh(m: &Path) {
    let prefix = "The fox lived by the river and ate berries every morning. ";
    let cases = [
        (prefix.to_string(), "Did the fox eat berries?"),
        (prefix.to_string(), "Was the river dry?"),
        (
            format!("{prefix}It slept under an old oak. "),
            "Did it sleep?",
        ),
    ];
    let args = ["-t", "2", "--decide", "--chatml"];
    let mut s = SessionDriver::start(m, &args);
    for (i, (p, q)) in cases.iter().enumerate() {
        let (warm, _) = s.decide(&decide_request(10 + i as u32, p, q, true));
        assert!(warm["prefix_state_mib"].as_f64().unwrap() > 0.0, "{warm}");
        if i > 0 {
            assert!(warm["n_reused"].as_u64().unwrap() > 0, "decide {i}: {warm}");
        }
        let (cold, _) = s.decide(&decide_request(20 + i as u32, p, q, false));
        assert_eq!(
            logp_bits(&warm),
            logp_bits(&cold),
            "decide {i}: warm == cold"
        );
        let mut f = SessionDriver::start(m, &args);
        let (fresh, _) = f.decide(&decide_request(1, p, q, true));
        assert_eq!(f.close().0, 0);
        assert_eq!(logp_bits(&warm), logp_bits(&fresh), "decide {i}: == fresh");
    }
    assert_eq!(s.close().0, 0);
}

/// `m` (a file with a chat template) in a session: `BMOE_READY` names `arch` (and `think_ctl`
/// where given), and a chat's second turn renders the history again and reuses the memory of
/// the first.
pub fn assert_template_chats(m: &Path, arch: &str, think_ctl: Option<&str>, extra: &[&str]) {
    let mut args = vec!["-t", "2"];
    args.extend_from_slice(extra);
    let mut s = SessionDriver::start(m, &args);
    let ready = s
        .lines
        .iter()
        .find_map(|l| l.strip_prefix("BMOE_READY "))
        .map(|j| serde_json::from_str::<serde_json::Value>(j).unwrap())
        .expect("ready line");
    assert_eq!(ready["arch"], arch, "{ready}");
    if let Some(ctl) = think_ctl {
        assert_eq!(ready["think_ctl"], ctl, "{}: {ready}", m.display());
    }
    for (i, p) in ["Tell me about the fox", "And where did it sleep"]
        .iter()
        .enumerate()
    {
        let req = serde_json::json!({"cmd": "generate", "id": i, "prompt": p, "n_predict": 12,
            "clear_kv": i == 0});
        let (done, _) = s.generate(&req.to_string());
        assert_eq!(done["cancelled"], false, "{}: {done}", m.display());
        if i > 0 {
            assert!(
                done["n_reused"].as_u64().unwrap() > 0,
                "{}: {done}",
                m.display()
            );
        }
    }
    let (code, err) = s.close();
    assert_eq!(code, 0, "{}: {err}", m.display());
}

/// The tiny file of `arch` (seed 7) with the chat template `stem` of `../shared/data/templates`
/// (`None` without ../shared), cached under `key`.
pub fn tiny_with_template(key: &str, arch: &str, stem: &str) -> Option<PathBuf> {
    let t = bmoe_engine::testdata::shared_path(&format!("data/templates/{stem}.jinja"))?;
    Some(model(
        key,
        &[
            "--arch",
            arch,
            "--preset",
            "tiny",
            "--seed",
            "7",
            "--template",
            t.to_str().unwrap(),
        ],
    ))
}
