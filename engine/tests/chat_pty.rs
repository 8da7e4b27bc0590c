//! `bmoe-cli chat` driven in a pseudo-terminal as a person would (issue 18): two turns (the
//! second reusing the first's KV), a Ctrl-C in the middle of a long answer (the answer stops,
//! the process does not), `/stats`, and `/exit`.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_bmoe-cli");

struct Pty {
    out: Arc<Mutex<Vec<u8>>>,
    master: File,
}

impl Pty {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()).into_owned()
    }
    fn send(&mut self, s: &str) {
        self.master.write_all(s.as_bytes()).unwrap();
        self.master.flush().unwrap();
    }
    /// Wait until `pred` holds on the whole output so far.
    fn wait(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let t = self.text();
            if pred(&t) {
                return t;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "timed out waiting for {what}; the terminal shows:\n{t}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A new pseudo-terminal: (master, slave).
fn openpty() -> (File, File) {
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty writes two new descriptors into the ints we pass; the null name, termios
    // and winsize pointers are allowed.
    let r = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just created and are owned by these Files alone.
    unsafe { (File::from_raw_fd(master), File::from_raw_fd(slave)) }
}

#[test]
fn a_chat_in_a_terminal_survives_ctrl_c_and_exits_on_command() {
    let dir = bmoe_engine::testdata::scratch_dir("chat-pty");
    let model = dir.join("tiny.gguf");
    assert!(Command::new(BIN)
        .args(["gen", "--preset", "tiny", "--quiet", "-o"])
        .arg(&model)
        .status()
        .unwrap()
        .success());

    let (master, slave) = openpty();
    let mut cmd = Command::new(BIN);
    cmd.args(["chat", "-n", "6", "-c", "4096", "-m"])
        .arg(&model)
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave));
    // SAFETY: only async-signal-safe calls between fork and exec: a new session whose
    // controlling terminal is the pty (so Ctrl-C written to the master signals the child).
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("spawn bmoe-cli chat");
    drop(cmd);
    let out = Arc::new(Mutex::new(Vec::new()));
    {
        let out = out.clone();
        let mut r = master.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once the child is gone and the slave is closed.
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                out.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
    }
    let mut pty = Pty { out, master };
    let footers = |t: &str| t.matches(" tok/s, ").count();
    let prompts = |t: &str| t.matches("> ").count();

    pty.wait("the first prompt", |t| {
        t.contains("bmoe chat:") && prompts(t) >= 1
    });
    pty.send("Hello there\r");
    pty.wait("the first answer's footer", |t| {
        footers(t) == 1 && prompts(t) >= 2
    });
    pty.send("And what else?\r");
    let t = pty.wait("the second answer's footer", |t| {
        footers(t) == 2 && prompts(t) >= 3
    });
    // The second turn re-renders the history and reuses the first turn's KV.
    let reused: Vec<u32> = t
        .match_indices(" reused)")
        .map(|(i, _)| {
            let head = &t[..i];
            let open = head.rfind('(').unwrap();
            head[open + 1..].trim().parse().unwrap()
        })
        .collect();
    assert_eq!(reused.len(), 2, "{t}");
    assert!(reused[1] > 0, "the second turn reused nothing: {t}");

    pty.send("/n -1\r");
    pty.wait("the /n answer", |t| t.contains("(tokens per answer: -1)"));
    let before = pty.text().len();
    pty.send("Tell me a very long story\r");
    // Mid-answer: well past the echo of the message, long before 4000 tokens are done.
    pty.wait("the long answer to start", |t| t.len() > before + 120);
    pty.send("\x03");
    let t = pty.wait("the cancelled answer", |t| {
        t.contains("(answer cancelled") && prompts(&t[before..]) >= 1
    });
    assert!(t.contains(", cancelled]"), "the footer says cancelled: {t}");
    assert!(
        child.try_wait().unwrap().is_none(),
        "Ctrl-C ended the process"
    );

    pty.send("/stats\r");
    pty.wait("the stats", |t| t.contains("(session: 3 turns"));
    pty.send("/exit\r");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "/exit did not end the chat:\n{}",
            pty.text()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0), "{}", pty.text());
}

#[test]
fn a_bare_run_at_a_terminal_suggests_chat_instead_of_failing_on_an_empty_prompt() {
    let dir = bmoe_engine::testdata::scratch_dir("bare-pty");
    let model = dir.join("tiny.gguf");
    assert!(Command::new(BIN)
        .args(["gen", "--preset", "tiny", "--quiet", "-o"])
        .arg(&model)
        .status()
        .unwrap()
        .success());
    let (_master, slave) = openpty();
    let out = Command::new(BIN)
        .arg("-m")
        .arg(&model)
        .stdin(Stdio::from(slave))
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no prompt") && err.contains(&format!("bmoe-cli chat -m {}", model.display())),
        "{err}"
    );
}

/// `bmoe-cli chat` fed on a pipe (no terminal): what it prints.
fn chat_piped(model: &std::path::Path, args: &[&str], input: &str) -> String {
    let mut child = Command::new(BIN)
        .arg("chat")
        .arg("-m")
        .arg(model)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn chat");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn a_full_context_drops_the_oldest_turns_and_several_lines_make_one_message() {
    let dir = bmoe_engine::testdata::scratch_dir("chat-shift");
    let model = dir.join("tiny.gguf");
    assert!(Command::new(BIN)
        .args(["gen", "--preset", "tiny", "--quiet", "-o"])
        .arg(&model)
        .status()
        .unwrap()
        .success());
    // -c 96 with 16-token answers: the third turn or so no longer fits beside the history.
    let turns = (0..6)
        .map(|i| format!("Tell me about river number {i} please.\n"))
        .collect::<String>();
    let out = chat_piped(
        &model,
        &["-c", "96", "-n", "16", "-sys", "Be brief."],
        &turns,
    );
    let answered = out.matches(" tok/s, ").count();
    assert_eq!(answered, 6, "every message answered:\n{out}");
    assert!(!out.contains("not sent"), "{out}");
    assert!(
        out.contains("is full: the oldest") && out.contains("/clear starts over"),
        "{out}"
    );
    // Lines ending in a backslash, and a bracketed paste, are one message each.
    let out = chat_piped(
        &model,
        &["-n", "4"],
        "first line \\\nsecond line\n\x1b[200~pasted a\npasted b\x1b[201~\n",
    );
    assert_eq!(out.matches(" tok/s, ").count(), 2, "{out}");
}
