"""The chat page at `/` in headless Chromium (Debian's chromium and chromium-driver, through
selenium): the model's name shows; a message gets a reply that is seen growing and ends with its
tok/s; a long reply is stopped mid-way (it stops growing, the page is ready again, the server
counts the request cancelled and frees its slot); a refused request shows the server's error and
leaves the conversation as it was; a third turn sends the whole conversation back with the system
prompt. Saves a screenshot.

Usage: chat_page_browser.py BASE_URL MODEL_ID SCREENSHOT.png
"""

import re
import shutil
import sys
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

base, model_id, screenshot = sys.argv[1:4]
# The request of the reply that is stopped mid-way.
LONG_PROMPT = "Write a long story about a dragon who learns to fly."


def metric(name):
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return float(next(l.split()[1] for l in text.splitlines() if l.startswith(f"turbospark_{name} ")))


def wait_for(what, check, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


browser, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
if not browser or not driver_path:
    sys.exit("chromium or chromedriver is not installed: run tools/server-test/fetch-chromium.sh")
options = webdriver.ChromeOptions()
options.binary_location = browser
for arg in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,700"]:
    options.add_argument(arg)
driver = webdriver.Chrome(service=Service(driver_path), options=options)
try:
    # The page's own size, whatever the window's decorations take.
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 1000, "height": 700, "deviceScaleFactor": 1, "mobile": False}
    )
    el = lambda id: driver.find_element(By.ID, id)
    driver.get(base + "/")
    wait_for("the model's name", lambda: el("model").text == model_id, 10)
    print(f"page loaded, model {model_id}")

    # Every request body the page sends, and the lengths the newest reply is seen to take.
    driver.execute_script("""
        window.sent = [];
        const f = window.fetch;
        window.fetch = (url, o) => { if (o && o.body) window.sent.push(JSON.parse(o.body)); return f(url, o); };
        window.lengths = [];
        new MutationObserver(() => {
            const r = document.querySelectorAll('.assistant .text');
            if (r.length) window.lengths.push(r[r.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    """)

    def fill(id, text):
        el(id).clear()
        el(id).send_keys(text)

    def reply():
        r = driver.find_elements(By.CSS_SELECTOR, ".assistant")
        return r[-1] if r else None

    def text_of(r):
        return r.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent")

    def ask(prompt):
        driver.execute_script("window.lengths = []")
        fill("prompt", prompt)
        el("send").click()
        wait_for("the reply to start", lambda: reply() is not None and reply().get_attribute("aria-busy") == "true", 10)

    def finished():
        r = reply()
        return r if r.get_attribute("aria-busy") is None else None

    def ready():
        return el("send").is_enabled() and not el("stop").is_enabled()

    fill("system", "You are a helpful assistant. Answer briefly.")
    fill("temperature", "0")

    # A reply, streamed.
    fill("max-tokens", "64")
    ask("What is the capital of France?")
    first = wait_for("the first reply to end", finished)
    text1 = text_of(first)
    lengths = driver.execute_script("return window.lengths")
    grown = sorted({n for n in lengths if n > 0})
    stats = first.find_element(By.CSS_SELECTOR, ".stats").text
    print(f"reply 1: {text1!r}; lengths seen {grown}; {stats}")
    assert text1.strip(), "empty reply"
    assert len(grown) >= 2, f"the reply was not seen growing: lengths {lengths}"
    assert grown[-1] == len(text1), (grown, text1)
    m = re.fullmatch(r"(\d+) tokens · ([\d.]+) tok/s · (stop|length)", stats)
    assert m and int(m[1]) > 1 and float(m[2]) > 0, stats
    assert ready(), "the page is not ready after the first reply"

    # A long reply, stopped mid-way.
    cancelled, generated = metric("requests_cancelled_total"), metric("completion_tokens_total")
    fill("max-tokens", "1500")
    # A story: long on every CPU's kernels (a count to 500 ended after 9 tokens on AVX2 ones).
    ask(LONG_PROMPT)
    second = reply()
    wait_for("some of the long reply", lambda: len(text_of(second)) >= 40, 60)
    el("stop").click()
    wait_for("the stopped reply to end", finished, 10)
    stopped_at = len(text_of(second))
    time.sleep(1.5)
    text2 = text_of(second)
    stats = second.find_element(By.CSS_SELECTOR, ".stats").text
    print(f"reply 2 stopped at {stopped_at} characters: {stats}")
    assert len(text2) == stopped_at, f"the reply grew after Stop: {stopped_at} -> {len(text2)}"
    assert stats.endswith("stopped"), stats
    assert ready(), "the page is not ready after Stop"
    wait_for(
        "the server to cancel the stopped request",
        lambda: metric("requests_cancelled_total") == cancelled + 1 and metric("slots_busy") == 0,
        10,
    )
    generated = metric("completion_tokens_total") - generated
    print(f"server: requests_cancelled_total +1, slots_busy 0, {generated:.0f} tokens generated of 1500")
    assert generated < 300, f"the server went on generating after Stop: {generated} tokens"

    # A request the server refuses: the error is shown, the turn taken back, its text kept.
    fill("max-tokens", "100000")
    fill("prompt", "Too long a reply.")
    el("send").click()
    error = wait_for("the error", lambda: el("status").text, 10)
    print(f"refused: {error}")
    assert error.startswith("error: ") and "max_tokens" in error, error
    assert el("prompt").get_attribute("value") == "Too long a reply.", "the refused text was not kept"
    assert driver.execute_script("return document.querySelectorAll('#messages .msg').length") == 4
    assert ready(), "the page is not ready after an error"

    # The next turn works and carries the conversation back.
    fill("max-tokens", "32")
    ask("Thanks. Now say goodbye.")
    third = wait_for("the third reply to end", finished)
    text3 = text_of(third)
    stats = third.find_element(By.CSS_SELECTOR, ".stats").text
    print(f"reply 3: {text3!r}; {stats}")
    assert text3.strip() and "tok/s" in stats, stats
    sent = driver.execute_script("return window.sent")
    assert len(sent) == 4, sent
    want = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": text1},
        {"role": "user", "content": LONG_PROMPT},
        {"role": "assistant", "content": text2},
        {"role": "user", "content": "Thanks. Now say goodbye."},
    ]
    assert sent[3]["messages"] == want, sent[3]["messages"]
    assert sent[3]["stream"] is True and sent[3]["temperature"] == 0 and sent[3]["max_tokens"] == 32, sent[3]
    assert driver.execute_script("return document.querySelectorAll('#messages .msg').length") == 6

    driver.save_screenshot(screenshot)
    print(f"screenshot: {screenshot}")
finally:
    driver.quit()
print("chat page: ok")
