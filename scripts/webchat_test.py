#!/usr/bin/env python3
"""The web chat at `/` in a real browser (issue 35, item 5): headless Chromium, driven by
Selenium through Debian's chromedriver (scripts/browser.sh installs both).

    python3 scripts/webchat_test.py --bin BMOE_CLI --model TINY.gguf [--screenshot PNG]

Starts `bmoe-cli serve` on a free loopback port, opens the page, types a message and sends it,
and reads the streamed answer from the DOM: its text and reasoning must equal what the API
answers for the same request; a second message continues the chat (the footer reports reused
tokens); a long answer is stopped with the Stop button (the turn says "stopped" and the server
counts a cancelled request). Exit 0 when every check passed.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)
    print(f"ok: {msg}")


def browser():
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver") or "/usr/lib/chromium/chromedriver"
    if not chrome or not os.path.exists(driver):
        fail("chromium and chromedriver are needed (scripts/browser.sh installs them)")
    o = webdriver.ChromeOptions()
    o.binary_location = chrome
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,760"):
        o.add_argument(a)
    return webdriver.Chrome(service=Service(executable_path=driver), options=o)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--screenshot")
    a = ap.parse_args()
    err = tempfile.NamedTemporaryFile("w+", suffix=".stderr", delete=False)
    srv = subprocess.Popen([a.bin, "serve", "-m", a.model, "--port", "0", "-c", "8192", "-n", "24"],
                           stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
    port = None
    deadline = time.time() + 60
    while port is None and time.time() < deadline:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", open(err.name).read())
        port = m and int(m.group(1))
        time.sleep(0.05)
    if port is None:
        fail(f"the server did not start: {open(err.name).read()}")
    base = f"http://127.0.0.1:{port}"
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                break
        except Exception:
            time.sleep(0.1)
    d = browser()
    try:
        run(d, base, a)
    finally:
        d.quit()
        srv.terminate()
        code = srv.wait(timeout=30)
    check(code == 0, "the server stopped cleanly")
    print("all checks passed")


def api_answer(base, messages):
    body = json.dumps({"messages": messages, "think": True}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    m = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["message"]
    return m.get("reasoning_content") or "", m["content"]


def turn_done(d, n):
    """Wait for the n-th assistant turn to leave the streaming state; return it."""
    def ready(drv):
        turns = drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        return len(turns) >= n and turns[n - 1].get_attribute("data-state") != "streaming" and turns[n - 1]
    return WebDriverWait(d, 120).until(ready)


def say(d, text):
    box = d.find_element(By.ID, "input")
    box.send_keys(text)
    d.find_element(By.ID, "send").click()


def run(d, base, a):
    d.get(base + "/")
    check("bmoe chat" in d.title, "the page loads at /")
    WebDriverWait(d, 30).until(lambda drv: drv.find_element(By.ID, "model").text != "")
    check(d.find_element(By.ID, "model").text == os.path.splitext(os.path.basename(a.model))[0], "it names the served model")
    q1 = "Tell me about the river."
    say(d, q1)
    t = turn_done(d, 1)
    check(t.get_attribute("data-state") == "done", "the first answer streams to the end")
    reasoning = t.find_element(By.CSS_SELECTOR, ".reasoning").get_attribute("textContent")
    content = t.find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent")
    want_r, want_c = api_answer(base, [{"role": "user", "content": q1}])
    check(content == want_c, f"the page shows the API's answer ({content[:40]!r}...)")
    check(reasoning == want_r, "and its reasoning apart from it")
    stats = t.find_element(By.CSS_SELECTOR, ".stats").text
    check("tok" in stats, f"a footer with the turn's figures ({stats})")
    if a.screenshot:
        d.save_screenshot(a.screenshot)
        print(f"wrote {a.screenshot}")
    say(d, "And the fox?")
    t2 = turn_done(d, 2)
    stats2 = t2.find_element(By.CSS_SELECTOR, ".stats").text
    m = re.search(r"prompt (\d+) \((\d+) reused\)", stats2)
    check(t2.get_attribute("data-state") == "done" and m and int(m.group(2)) > 0, f"the second message continues the chat, reusing the KV ({stats2})")
    # Stop: a long answer, stopped once it has begun.
    d.find_element(By.ID, "max").send_keys("7500")
    say(d, "Write a very long story.")
    WebDriverWait(d, 60, poll_frequency=0.05).until(lambda drv: len(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")) >= 3
                               and drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")[2].find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent") != "")
    d.find_element(By.ID, "stop").click()
    t3 = turn_done(d, 3)
    check(t3.get_attribute("data-state") == "stopped",
          f"Stop ends the answer being streamed (the turn is {t3.get_attribute('data-state')}: {t3.find_element(By.CSS_SELECTOR, '.stats').text})")
    metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    deadline = time.time() + 10
    while "bmoe_requests_cancelled_total 1" not in metrics and time.time() < deadline:
        time.sleep(0.2)
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    check("bmoe_requests_cancelled_total 1" in metrics, "and the server cancelled that generation")
    check(d.find_element(By.ID, "send").is_enabled(), "the page is ready for the next message")


if __name__ == "__main__":
    main()
