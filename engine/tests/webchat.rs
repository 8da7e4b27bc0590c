//! The web chat at `/` in headless Chromium (issue 35, item 5): the checks live in
//! `scripts/webchat_test.py` (the page loads, a message's streamed answer in the DOM equals the
//! API's, a second message reuses the KV, Stop cancels a long answer). Skipped with a message
//! when Chromium, its driver or selenium are missing, except under CI=true (where
//! `scripts/browser.sh` installs them), where that fails.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_bmoe-cli");

#[test]
fn the_web_chat_answers_in_a_real_browser() {
    let have = |c: &str| {
        Command::new("sh")
            .args(["-c", c])
            .status()
            .is_ok_and(|s| s.success())
    };
    let ready = have("command -v chromium >/dev/null")
        && have("command -v chromedriver >/dev/null || test -x /usr/lib/chromium/chromedriver")
        && have("python3 -c 'import selenium'");
    if !ready {
        let msg =
            "Chromium, chromedriver and selenium are needed: scripts/browser.sh installs them";
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
        eprintln!("skipped: {msg}");
        return;
    }
    let dir = bmoe_engine::testdata::scratch_dir("webchat");
    let model = dir.join("tiny.gguf");
    assert!(Command::new(BIN)
        .args(["gen", "--preset", "tiny", "--quiet", "-o"])
        .arg(&model)
        .status()
        .expect("gen")
        .success());
    let script = bmoe_engine::testdata::project_root().join("scripts/webchat_test.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg("--bin")
        .arg(BIN)
        .arg("--model")
        .arg(&model)
        .output()
        .expect("python3");
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{so}\n{se}");
    assert!(so.contains("all checks passed"), "{so}");
}
