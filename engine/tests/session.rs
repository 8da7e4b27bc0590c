//! `bmoe-cli --session` driven over a pipe as a client program drives it (issue 15): 50 turns
//! mixing new chats, continued chats, cancels mid-stream and decides (restored and cold), with
//! every kind of bad request between them. Every stdout line must parse as a contract line,
//! every request must be answered (`BMOE_DONE`, `BMOE_DECIDE`, or `BMOE_ERROR` with
//! `fatal:false` and the request's id), a continued turn must prefill fewer tokens than a fresh
//! render of its history, and the process's RSS at turn 50 must be within 5 % of turn 10, its
//! open fds and threads equal — with transient flash faults injected throughout, each retried.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_bmoe-cli");
const TAGS: [&str; 7] = [
    "BMOE_READY",
    "BMOE_BEGIN",
    "BMOE_LOAD",
    "BMOE_PROGRESS",
    "BMOE_DONE",
    "BMOE_DECIDE",
    "BMOE_ERROR",
];

fn scratch() -> PathBuf {
    bmoe_engine::testdata::scratch_dir("session-test")
}

struct Client {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    /// Every stdout line, parsed: (tag, json).
    lines: Vec<(String, serde_json::Value)>,
    /// Where the session's stderr goes.
    stderr: PathBuf,
}

impl Client {
    fn start(model: &Path, args: &[&str]) -> Client {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stderr = model.with_file_name(format!("session-{n}.stderr"));
        let mut child = Command::new(BIN)
            .arg("-m")
            .arg(model)
            .arg("--session")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("spawn bmoe-cli --session");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Client {
            child,
            stdin,
            stdout,
            lines: Vec::new(),
            stderr,
        }
    }

    fn send_bytes(&mut self, b: &[u8]) {
        let w = self.stdin.as_mut().expect("stdin open");
        w.write_all(b).expect("write request");
        w.write_all(b"\n").expect("write newline");
        w.flush().expect("flush");
    }

    fn send(&mut self, v: serde_json::Value) {
        self.send_bytes(v.to_string().as_bytes());
    }

    /// The next stdout line, which must be a contract line: a known tag and a JSON object.
    fn next(&mut self) -> (String, serde_json::Value) {
        let mut l = String::new();
        let n = self.stdout.read_line(&mut l).expect("read stdout");
        assert!(n > 0, "stdout closed");
        let l = l.trim_end_matches('\n');
        let (tag, json) = l
            .split_once(' ')
            .unwrap_or_else(|| panic!("not a contract line: {l:?}"));
        assert!(TAGS.contains(&tag), "not a contract tag: {l:?}");
        let v: serde_json::Value =
            serde_json::from_str(json).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}"));
        assert!(v.is_object(), "not a JSON object: {l:?}");
        self.lines.push((tag.to_string(), v.clone()));
        (tag.to_string(), v)
    }

    fn until(&mut self, tag: &str) -> Vec<(String, serde_json::Value)> {
        let mut got = Vec::new();
        loop {
            let (t, v) = self.next();
            let done = t == tag;
            got.push((t, v));
            if done {
                return got;
            }
        }
    }

    /// Expect a non-fatal error for request `id` whose message contains `needle`.
    fn expect_error(&mut self, id: i64, needle: &str) {
        let (t, v) = self.next();
        assert_eq!(t, "BMOE_ERROR", "{v}");
        assert_eq!(v["id"], id, "{v}");
        assert_eq!(v["fatal"], false, "{v}");
        let msg = v["msg"].as_str().unwrap_or("");
        assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
    }

    /// (open file descriptors, threads) of the session process.
    fn fds_threads(&self) -> (usize, usize) {
        let n = |d: &str| {
            std::fs::read_dir(format!("/proc/{}/{d}", self.child.id()))
                .expect("/proc")
                .count()
        };
        (n("fd"), n("task"))
    }

    fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("/proc status");
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }
}

/// `bmoe-cli gen --preset tiny` into `dir`.
fn tiny_model(dir: &Path) -> PathBuf {
    let model = dir.join("tiny.gguf");
    let st = Command::new(BIN)
        .args(["gen", "--preset", "tiny", "--quiet", "-o"])
        .arg(&model)
        .status()
        .expect("gen");
    assert!(st.success());
    model
}

fn generate(id: i64, prompt: &str, n: u32, clear_kv: bool) -> serde_json::Value {
    serde_json::json!({"cmd":"generate","id":id,"prompt":prompt,"n_predict":n,"clear_kv":clear_kv})
}

const DECIDE_PREFIX: &str = "A fox lived by a river and ate berries every morning. ";

fn decide(id: i64, suffix: &str, choices: &[&str], reuse: bool) -> serde_json::Value {
    serde_json::json!({"cmd":"decide","id":id,"prefix":DECIDE_PREFIX,"suffix":suffix,
                       "choices":choices,"reuse_prefix":reuse})
}

/// `choice_logp` as bit patterns (`None` for null).
fn logp_bits(d: &serde_json::Value) -> Vec<Option<u64>> {
    d["choice_logp"]
        .as_array()
        .unwrap_or_else(|| panic!("no choice_logp: {d}"))
        .iter()
        .map(|v| v.as_f64().map(f64::to_bits))
        .collect()
}

impl Client {
    /// A decide answered by `BMOE_BEGIN` and one `BMOE_DECIDE`, nothing between.
    fn decide(&mut self, v: serde_json::Value) -> serde_json::Value {
        let id = v["id"].clone();
        self.send(v);
        let (t, b) = self.next();
        assert_eq!((t.as_str(), &b["id"]), ("BMOE_BEGIN", &id), "{b}");
        let (t, d) = self.next();
        assert_eq!((t.as_str(), &d["id"]), ("BMOE_DECIDE", &id), "{d}");
        assert_eq!(d["cancelled"], false);
        let n = d["n_tokens"].as_u64().unwrap();
        assert_eq!(
            d["n_reused"].as_u64().unwrap() + d["n_prefilled"].as_u64().unwrap(),
            n,
            "{d}"
        );
        let logp = logp_bits(&d);
        assert_eq!(logp.len(), 3);
        let best = d["best"].as_u64().unwrap() as usize;
        let lp: Vec<f64> = logp.iter().map(|b| f64::from_bits(b.unwrap())).collect();
        assert!(lp.iter().all(|&v| v <= lp[best] && v < 0.0), "{d}");
        d
    }
}

/// What the KV holds when the next turn begins.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Kv {
    /// Nothing of the current chat (a new chat, or one whose only turn was cancelled).
    Empty,
    /// The current chat.
    Chat,
    /// A decide's prompt.
    Decide,
}

#[test]
fn fifty_turns_over_a_pipe_with_bad_requests_between_them() {
    let dir = scratch();
    let model = tiny_model(&dir);
    let mut c = Client::start(
        &model,
        &[
            "--chatml",
            "-t",
            "1",
            "-c",
            "4096",
            "--moe-stream",
            "--cache-mb",
            "4",
            "--force-cache",
            "--overlap",
            "--decide",
            // Transient faults on about a third of the extents' first reads: each retried,
            // so every answer below is as without them (the soak, scripts/soak.py, runs
            // this mix for 1,000 turns).
            "--inject-faults",
            "seed=7,eio=0.15,short=0.15,spike=0.1,spike-ms=1",
        ],
    );
    let (t, ready) = c.next();
    assert_eq!(t, "BMOE_READY");
    assert_eq!(ready["n_ctx"], 4096);
    assert_eq!(ready["arch"], "qwen3moe");
    assert_eq!(ready["n_expert_used"], 4);
    assert!(["template", "prefill", "none"].contains(&ready["think_ctl"].as_str().unwrap()));

    let prompts = [
        "Tell me about the fox",
        "And the river?",
        "What did it eat",
        "Where did it sleep",
        "Was it happy",
    ];
    let (mut rss_10, mut rss_50) = (0u64, 0u64);
    let (mut held_10, mut held_50) = ((0, 0), (0, 0));
    let mut continued_checked = 0;
    let mut cancelled = 0;
    let mut decides = 0;
    // A cancelled new chat leaves the KV empty (rolled back to where its prefill began), so
    // the next turn has nothing to reuse; a decide leaves its own prompt there.
    let mut kv = Kv::Empty;
    for turn in 1..=50i64 {
        let id = 1000 + turn;
        let new_chat = turn % 5 == 1;
        let prompt = prompts[(turn % 5) as usize];
        if turn % 7 == 0 {
            // Cancel mid-stream, and a second generate while this one runs.
            c.send(generate(id, prompt, 3000, new_chat));
            let (t, v) = c.next();
            assert_eq!(
                (t.as_str(), &v["id"]),
                ("BMOE_BEGIN", &serde_json::json!(id))
            );
            c.until("BMOE_PROGRESS");
            // Two requests queue behind the running one; each is cancelled by its id while it
            // waits, then the running one by a plain cancel.
            c.send(generate(id + 500, "again", 4, true));
            c.send(decide(id + 600, "Busy?", &["yes", "no", "maybe"], true));
            c.send(serde_json::json!({"cmd":"cancel","id":id + 500}));
            c.send(serde_json::json!({"cmd":"cancel","id":id + 600}));
            c.send(serde_json::json!({"cmd":"cancel"}));
            let rest = c.until("BMOE_DONE");
            for other in [id + 500, id + 600] {
                let (t, v) = c.next();
                assert_eq!(
                    (t.as_str(), &v["id"]),
                    ("BMOE_DONE", &serde_json::json!(other)),
                    "{v}"
                );
                assert_eq!(
                    (&v["cancelled"], &v["tokens"]),
                    (&serde_json::json!(true), &serde_json::json!(0)),
                    "{v}"
                );
            }
            let done = &rest.last().unwrap().1;
            assert_eq!(done["id"], id);
            assert_eq!(done["cancelled"], true, "{done}");
            assert!(done["tokens"].as_u64().unwrap() < 3000);
            if new_chat {
                kv = Kv::Empty;
            }
            let steps = rest.iter().filter(|(t, _)| t == "BMOE_PROGRESS").count() + 1;
            assert_eq!(done["tokens"].as_u64().unwrap() as usize, steps);
            cancelled += 1;
        } else {
            c.send(generate(id, prompt, 6, new_chat));
            let lines = c.until("BMOE_DONE");
            assert_eq!(lines[0].0, "BMOE_BEGIN");
            let done = &lines.last().unwrap().1;
            assert_eq!(
                (done["id"].as_i64(), done["tokens"].as_u64()),
                (Some(id), Some(6))
            );
            assert_eq!(done["cancelled"], false);
            let progress: Vec<_> = lines.iter().filter(|(t, _)| t == "BMOE_PROGRESS").collect();
            assert_eq!(progress.len(), 6);
            let n_prompt = done["n_prompt"].as_u64().unwrap();
            let fresh = done["n_past"].as_u64().unwrap() - 6;
            assert_eq!(
                done["n_reused"].as_u64().unwrap() + n_prompt,
                fresh,
                "what was reused and what was prefilled make the render: {done}"
            );
            match (new_chat, kv) {
                (true, _) | (false, Kv::Empty) => assert_eq!(
                    n_prompt, fresh,
                    "nothing to reuse: the whole render: {done}"
                ),
                (false, Kv::Chat) => {
                    // The render of the whole history would prefill `fresh` tokens; the KV
                    // already held most of them.
                    assert!(
                        n_prompt < fresh,
                        "continued turn {turn} reused nothing: {done}"
                    );
                    continued_checked += 1;
                }
                // The decide's prompt shares at most the template's opening with the chat.
                (false, Kv::Decide) => assert!(n_prompt <= fresh),
            }
            kv = Kv::Chat;
        }
        // Decides between turns (before a new chat, and once inside a chat): the first
        // cold, the next restoring its prefix, and the same asked cold to compare.
        if turn % 5 == 0 || turn == 23 {
            let choices = ["yes", "no", "maybe"];
            let first = c.decide(decide(id * 10, "Is this about animals?", &choices, true));
            assert_eq!(
                first["n_reused"], 0,
                "a generate dropped the kept state: {first}"
            );
            let warm = c.decide(decide(id * 10 + 1, "Is it night?", &choices, true));
            assert!(warm["n_reused"].as_u64().unwrap() > 0, "{warm}");
            let cold = c.decide(decide(id * 10 + 2, "Is it night?", &choices, false));
            assert_eq!(cold["n_reused"], 0);
            assert_eq!(logp_bits(&warm), logp_bits(&cold), "restored == cold");
            decides += 3;
            kv = Kv::Decide;
        }
        // Bad requests between turns; each answered, the session goes on.
        match turn % 10 {
            2 => {
                c.send_bytes(b"this is not json");
                c.expect_error(0, "not JSON");
                c.send_bytes(b"[1,2,3]");
                c.expect_error(0, "JSON object");
            }
            3 => {
                c.send(serde_json::json!({"cmd":"dance","id":id}));
                c.expect_error(id, "unknown cmd");
                c.send(serde_json::json!({"cmd":"generate","id":id}));
                c.expect_error(id, "missing field prompt");
                c.send(serde_json::json!({"cmd":"generate","id":id,"prompt":3}));
                c.expect_error(id, "field prompt");
            }
            4 => {
                c.send(serde_json::json!({"cmd":"cancel"}));
                c.expect_error(0, "no request is running");
                c.send(serde_json::json!({"cmd":"cancel","id":id}));
                c.expect_error(id, "neither running nor queued");
                c.send(generate(id, "", 4, true));
                c.expect_error(id, "prompt is empty");
            }
            5 => {
                c.send(generate(id, "Tell me everything", 4095, true));
                c.expect_error(id, "exceeds n_ctx");
                c.send(decide(id, "Which?", &[], true));
                c.expect_error(id, "choices is empty");
                c.send(decide(id, "Which?", &["apple", "apple pie", "pear"], true));
                c.expect_error(id, "both start with token");
                let long = "word ".repeat(5000);
                c.send(decide(id, &long, &["yes", "no"], true));
                c.expect_error(id, "past n_ctx");
                c.send(serde_json::json!({"cmd":"decide","id":id,"prefix":"a","suffix":"b"}));
                c.expect_error(id, "missing field choices");
            }
            6 if turn == 16 => {
                let mut huge = b"{\"cmd\":\"generate\",\"id\":1,\"prompt\":\"".to_vec();
                huge.resize(10 << 20, b'a');
                huge.extend_from_slice(b"\"}");
                c.send_bytes(&huge);
                c.expect_error(0, "longer than");
                c.send_bytes(b"{\"cmd\":\"generate\",\"id\":9,\"prompt\":\"\xff\xfe\"}");
                c.expect_error(0, "UTF-8");
            }
            _ => {}
        }
        if turn == 10 {
            rss_10 = c.rss_kib();
            held_10 = c.fds_threads();
        }
        if turn == 50 {
            rss_50 = c.rss_kib();
            held_50 = c.fds_threads();
        }
    }
    assert!(
        continued_checked >= 30,
        "{continued_checked} continued turns"
    );
    assert!(cancelled >= 7);
    assert!(decides >= 30, "{decides} decides");
    let growth = rss_50 as f64 / rss_10 as f64 - 1.0;
    eprintln!(
        "RSS turn 10: {rss_10} KiB, turn 50: {rss_50} KiB ({:+.2} %)",
        100.0 * growth
    );
    assert!(
        growth.abs() <= 0.05,
        "RSS moved {:+.2} % from turn 10 ({rss_10} KiB) to 50 ({rss_50} KiB)",
        100.0 * growth
    );
    assert_eq!(
        held_10, held_50,
        "(open fds, threads) at turn 10 and at turn 50"
    );
    c.send(serde_json::json!({"cmd":"close"}));
    drop(c.stdin.take());
    let st = c.child.wait().expect("wait");
    assert_eq!(st.code(), Some(0));
    // The faults were dealt, and every one retried into a success.
    let notes = std::fs::read_to_string(&c.stderr).expect("stderr");
    let dealt = notes
        .lines()
        .find_map(|l| l.strip_prefix("bmoe: injected faults: eio="))
        .unwrap_or_else(|| panic!("no injected faults reported: {notes}"));
    assert!(!dealt.starts_with("0 short=0"), "{dealt}");
    assert!(notes.contains("flash read retries"), "{notes}");
    // Nothing but contract lines, every one parsed above; and stdout ended cleanly.
    let mut rest = String::new();
    c.stdout.read_line(&mut rest).expect("read");
    assert!(rest.is_empty(), "stdout after close: {rest:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_signal_ends_the_session_after_answering_the_running_turn() {
    let dir = scratch();
    let model = tiny_model(&dir);
    let mut c = Client::start(&model, &["-t", "1", "-c", "4096"]);
    assert_eq!(c.next().0, "BMOE_READY");
    c.send(generate(1, "Once upon a time", 4000, true));
    c.until("BMOE_PROGRESS");
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(
        unsafe { libc::kill(c.child.id() as libc::pid_t, libc::SIGINT) },
        0
    );
    let done = c.until("BMOE_DONE").pop().unwrap().1;
    assert_eq!(
        (done["id"].as_i64(), &done["cancelled"]),
        (Some(1), &serde_json::json!(true))
    );
    let (t, v) = c.next();
    assert_eq!(t, "BMOE_ERROR");
    assert_eq!(v["fatal"], true, "{v}");
    assert_eq!(c.child.wait().expect("wait").code(), Some(130));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `close` and EOF end the session once what was queued before them has been served: the
/// running request finishes, the queued ones run in order (one cancelled by its id while it
/// waited is answered `cancelled:true` with nothing generated), then the process exits 0 —
/// so `bmoe-cli --session < requests.jsonl` runs the file. Past `MAX_QUEUED` waiting, a
/// request is refused by its id. A session opened without `--decide` refuses a decide and goes
/// on; `--decide` needs `--session`.
#[test]
fn close_and_eof_finish_the_queue_and_a_cancel_names_its_request() {
    let dir = scratch();
    let model = tiny_model(&dir);
    for how in ["close", "eof"] {
        let mut c = Client::start(&model, &["-t", "1", "-c", "4096"]);
        assert_eq!(c.next().0, "BMOE_READY");
        c.send(decide(1, "Is it?", &["yes", "no"], true));
        c.expect_error(1, "without --decide");
        c.send(generate(2, "Once upon a time", 40, true));
        c.until("BMOE_PROGRESS");
        let queued: Vec<i64> = (10..10 + bmoe_engine::session::MAX_QUEUED as i64).collect();
        for &q in &queued {
            c.send(generate(q, "Hi", 3, true));
        }
        c.send(generate(99, "Hi", 3, true));
        let lines = c.until("BMOE_ERROR");
        let (_, err) = lines.last().unwrap();
        assert_eq!(err["id"], 99, "{err}");
        assert!(
            err["msg"].as_str().unwrap().contains("queue is full"),
            "{err}"
        );
        c.send(serde_json::json!({"cmd":"cancel","id":12}));
        if how == "close" {
            c.send(serde_json::json!({"cmd":"close"}));
        } else {
            drop(c.stdin.take());
        }
        let mut done = Vec::new();
        while done.len() < 1 + queued.len() {
            let (t, v) = c.next();
            if t == "BMOE_DONE" {
                done.push(v);
            }
        }
        let ids: Vec<i64> = done.iter().map(|d| d["id"].as_i64().unwrap()).collect();
        let mut want = vec![2];
        want.extend(&queued);
        assert_eq!(ids, want, "{how}: answered in order");
        for d in &done {
            let cancelled = d["id"] == 12;
            assert_eq!(d["cancelled"], cancelled, "{how}: {d}");
            let tokens = d["tokens"].as_u64().unwrap();
            let expect = match d["id"].as_i64() {
                Some(2) => 40,
                Some(12) => 0,
                _ => 3,
            };
            assert!(
                tokens == expect || (!cancelled && tokens < expect),
                "{how}: {d}"
            );
        }
        drop(c.stdin.take());
        assert_eq!(c.child.wait().expect("wait").code(), Some(0), "{how}");
        let mut rest = String::new();
        c.stdout.read_line(&mut rest).expect("read");
        assert!(rest.is_empty(), "{how}: stdout after the end: {rest:?}");
    }
    let out = Command::new(BIN)
        .arg("-m")
        .arg(&model)
        .args(["--decide", "-p", "hi", "-n", "1"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--decide needs --session"), "{err}");
    let out = Command::new(BIN)
        .arg("-m")
        .arg(&model)
        .args(["--session", "--decide-prefix-cache", "on"])
        .stdin(Stdio::null())
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--decide-prefix-cache needs --decide"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
