"""The page (GET / of `gpt2numba serve`) in headless Chromium, driven by Selenium: a prompt typed, a seeded
generation with "show probabilities" on, then the page's text, token elements, tip, histogram, perplexity and
network requests held to the server's own API (/v1/completions, /tokenize, /v1/inspect).

Debian's `chromium` and `chromium-driver` packages (apt-get install chromium chromium-driver); pip's browser
downloads are not used, and Selenium is given the driver's path so that Selenium Manager downloads nothing.
A screenshot of the page goes to $GPT2NUMBA_ARTIFACTS, else to the test's temporary directory.
"""

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("selenium", reason="the browser tests need selenium (pip install -e \".[test]\")")
from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from test_serve import Server  # noqa: E402  (the server subprocess on a free port, random tiny GPT-2-vocab weights)


def _found(name: str) -> str | None:
    return next((p for p in (f"/usr/bin/{name}", shutil.which(name)) if p and os.access(p, os.X_OK)), None)


CHROMIUM, CHROMEDRIVER = _found("chromium"), _found("chromedriver")
CHROME_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage"]
WIDTH, HEIGHT, NARROW = 1280, 900, 360
GENERATE_S = 120  # the page's generation and inspection; CI shares its machine
PROMPT = "The café on the corner serves"  # a two-byte character: the tokens' byte offsets differ from characters'
SETTINGS = {"max_tokens": "12", "temperature": "1", "seed": "7"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="no Chromium or chromedriver found: apt-get install chromium chromium-driver "
                              "(Debian's packages; the browser tests drive them headless)"),
]


def artifacts(tmp: Path) -> Path:
    """Where screenshots go: $GPT2NUMBA_ARTIFACTS if set (CI keeps it), else the test's temporary directory."""
    where = Path(os.environ.get("GPT2NUMBA_ARTIFACTS") or tmp)
    where.mkdir(parents=True, exist_ok=True)
    return where


def screenshot(driver, tmp: Path, name: str) -> Path:
    path = artifacts(tmp) / name
    assert driver.save_screenshot(str(path)), f"no screenshot at {path}"
    print(f"screenshot: {path}")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("page"), key=())  # no API key: the page sends none
    yield s
    try:
        s.stop(timeout=60)
    except subprocess.TimeoutExpired:
        s.process.kill()
        s.process.wait()


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROME_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
                 f"--window-size={WIDTH},{HEIGHT}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # every request the page makes
    d = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        d.set_window_size(WIDTH, HEIGHT)
        yield d
    finally:
        d.quit()


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def state(driver) -> str:
    return js(driver, "return document.body ? document.body.dataset.state || '' : ''")


def text_of(driver, selector: str) -> str:
    """The element's textContent: exact, where Selenium's .text is the rendered text with whitespace folded."""
    return js(driver, "const e = document.querySelector(arguments[0]); return e ? e.textContent : null", selector)


def tokens(driver) -> list[dict]:
    """The span.tok elements of #view, in document order, with their data."""
    return js(driver, "return Array.from(document.querySelectorAll('#view span.tok'), e => "
                      "({id: e.dataset.id, rank: e.dataset.rank, logprob: e.dataset.logprob, tabindex: e.getAttribute('tabindex')}))")


def request_of(values: dict, prompt: str) -> dict:
    """The contract's body of the page's request, without "stream": the inputs' values, optional ones omitted if empty."""
    body = {"prompt": prompt, "max_tokens": int(values["max_tokens"]), "temperature": float(values["temperature"]),
            "top_p": float(values["top_p"]), "n": int(values["n"])}
    for name, kind in (("top_k", int), ("stop", str), ("seed", int)):
        if values[name].strip():
            body[name] = kind(values[name])
    return body


def requests_made(entries) -> list[dict]:
    """Network.requestWillBeSent's requests (url, method, postData) from Chromium's performance log."""
    messages = (json.loads(entry["message"])["message"] for entry in entries)
    return [m["params"]["request"] for m in messages if m["method"] == "Network.requestWillBeSent"]


def wait_for(driver, condition, what: str, timeout: float, server=None):
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))
    except TimeoutException:
        log = server.log.read_text()[-3000:] if server else ""
        pytest.fail(f"waited {timeout} s for {what}; the page's state is {state(driver)!r}, "
                    f"#error says {text_of(driver, '#error')!r}\n{log}")


@pytest.fixture(scope="module")
def generated(server, driver, tmp_path_factory):
    """The page after one generation: type the prompt, set the settings, show probabilities, Generate, wait for
    "done". Returns the request the page's inputs stand for, the completion shown and the requests made."""
    page = httpx.get(f"{server.url}/", timeout=60)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), \
        f"GET / gave {page.status_code} {page.headers.get('content-type')}: {page.text[:200]}"
    driver.get_log("performance")  # drops what the browser fetched for itself before the page (its new-tab page)
    driver.get(f"{server.url}/")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "button#generate"), "a button#generate", 30)
    prompt = driver.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(PROMPT)
    for name, value in SETTINGS.items():
        field = driver.find_element(By.ID, name)
        field.clear()
        field.send_keys(value)
    if not driver.find_element(By.ID, "show-probs").is_selected():
        driver.find_element(By.ID, "show-probs").click()
    assert state(driver) not in ("busy", "done", "error"), f"the page is {state(driver)!r} before Generate"
    driver.find_element(By.ID, "generate").click()
    wait_for(driver, lambda d: state(d) in ("done", "error"), 'document.body.dataset.state "done"', GENERATE_S, server)
    assert state(driver) == "done", f"the page failed: {text_of(driver, '#error')!r}"
    shot = screenshot(driver, tmp_path_factory.mktemp("artifacts"), "page.png")
    values = js(driver, "return Object.fromEntries(arguments[0].map(id => [id, document.getElementById(id).value]))",
                ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed"])
    assert values["prompt"] == PROMPT and all(values[k] == v for k, v in SETTINGS.items()), values
    return {"body": request_of(values, PROMPT), "completion": text_of(driver, "#completion"), "screenshot": shot,
            "requests": requests_made(driver.get_log("performance"))}


@pytest.fixture(scope="module")
def inspected(server, generated):
    """/v1/inspect of the prompt and the completion as one text, and /tokenize's ids of the same text."""
    text = PROMPT + generated["completion"]
    r = server.post("/v1/inspect", {"text": text}, key=None)
    assert r.status_code == 200, r.text
    ids = server.post("/tokenize", {"content": text}, key=None).json()["tokens"]
    return {"ids": ids, **r.json()}


def test_the_completion_shown_is_the_apis_answer(server, generated):
    """The streamed text, put together by the page, against the same request not streamed. Catches chunks
    dropped, doubled or reordered, the settings not sent (another seed or temperature gives another text),
    and a page that sends a request other than the contract's."""
    body = generated["body"]
    sent = [r for r in generated["requests"] if r["url"] == f"{server.url}/v1/completions" and r["method"] == "POST"]
    assert len(sent) == 1, f"the page posted /v1/completions {len(sent)} times"
    page_body = json.loads(sent[0]["postData"])
    assert page_body.get("stream") is True
    assert {k: page_body.get(k) for k in ("prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed")
            if k in page_body or k in body} == body
    r = server.post("/v1/completions", body, key=None)
    assert r.status_code == 200, r.text
    assert generated["completion"] == r.json()["choices"][0]["text"]
    assert generated["completion"], "an empty completion checks nothing"


def test_one_token_element_per_token(driver, generated, inspected):
    """One span.tok per token of prompt + completion, with the tokenizer's ids in its order, each focusable.
    Catches the completion's tokens missing or the prompt's, a token split or merged, tokens out of order."""
    shown = tokens(driver)
    assert len(shown) == len(inspected["ids"])
    assert [int(t["id"]) for t in shown] == inspected["ids"]
    assert all(t["tabindex"] == "0" for t in shown)


def test_ranks_and_logprobs_are_inspects(driver, generated, inspected):
    """data-rank and data-logprob, in order, against /v1/inspect of the same text. Catches ranks taken one position
    off (the token's from the next position's prediction), ranks of another text, log-probabilities rounded."""
    shown = tokens(driver)
    assert [int(t["rank"]) for t in shown] == [t["rank"] for t in inspected["tokens"]]
    assert [float(t["logprob"]) for t in shown] == pytest.approx([t["logprob"] for t in inspected["tokens"]], abs=1e-5)


def alternatives_shown(driver) -> int:
    tip = driver.find_element(By.ID, "tip")
    return len(tip.find_elements(By.CSS_SELECTOR, ".alt")) if tip.is_displayed() else -1


def test_focusing_a_token_with_the_keyboard_shows_five_alternatives(driver, generated):
    """Tab from the prompt box until a token has the focus: #tip shows, with 5 .alt. Catches tokens that are not
    focusable, a tip shown on hover only, a tip with the wrong number of alternatives."""
    ActionChains(driver).move_to_element(driver.find_element(By.ID, "prompt")).click().perform()  # the pointer off the text
    assert not driver.find_element(By.ID, "tip").is_displayed(), "#tip shows before any token is hovered or focused"
    presses = len(driver.find_elements(By.CSS_SELECTOR, "input, select, textarea, button, a[href], [tabindex]")) + 1
    for _ in range(presses):
        ActionChains(driver).send_keys(Keys.TAB).perform()
        if js(driver, "return document.activeElement.matches('#view span.tok')"):
            break
    else:
        pytest.fail(f"{presses} presses of Tab never focused a token of #view")
    wait_for(driver, lambda d: alternatives_shown(d) >= 0, "#tip to show on focus", 10)
    assert alternatives_shown(driver) == 5


def test_hovering_a_token_shows_five_alternatives(driver, generated, tmp_path):
    """The pointer over a completion token: #tip shows, with 5 .alt (the screenshot page-tip.png shows it)."""
    js(driver, "document.activeElement.blur()")  # a token focused before would show the tip whatever the pointer does
    ActionChains(driver).move_to_element(driver.find_element(By.ID, "prompt")).perform()
    wait_for(driver, lambda d: alternatives_shown(d) < 0, "#tip to hide with no token focused or hovered", 10)
    token = driver.find_elements(By.CSS_SELECTOR, "#view span.tok")[-1]
    js(driver, "arguments[0].scrollIntoView({block: 'center'})", token)
    ActionChains(driver).move_to_element(token).perform()
    wait_for(driver, lambda d: alternatives_shown(d) >= 0, "#tip to show on hover", 10)
    assert alternatives_shown(driver) == 5
    screenshot(driver, tmp_path, "page-tip.png")


def test_rank_histogram_and_perplexity(driver, generated, inspected):
    """4 buckets counting every token once, and the perplexity /v1/inspect gives. Catches a bucket left out,
    tokens counted twice or the prompt's left out, the perplexity of the completion alone or in another base."""
    counts = js(driver, "return Array.from(document.querySelectorAll('#ranks .bucket'), e => e.dataset.count)")
    assert len(counts) == 4
    assert sum(int(c) for c in counts) == len(inspected["ids"])
    shown = text_of(driver, "#perplexity")
    number = re.search(r"[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?", re.sub(r"[,\s\u202f\u2009]", "", shown or ""))
    assert number, f"#perplexity shows no number: {shown!r}"
    assert math.isclose(float(number.group()), inspected["perplexity"], rel_tol=0.01), (shown, inspected["perplexity"])


def test_no_request_leaves_the_server(driver, server, generated):
    """Every URL the page fetched (the performance log, and the resource timings) is the server's: no CDN, font or
    analytics. The log holds the page's own /v1/completions, so an empty log does not pass."""
    urls = [r["url"] for r in generated["requests"] + requests_made(driver.get_log("performance"))]
    urls += js(driver, "return performance.getEntriesByType('resource').map(e => e.name)")
    assert f"{server.url}/v1/completions" in urls
    inline = ("data:", "blob:", "chrome:", "devtools:")  # the page's own bytes, or the browser's (no web page loads chrome:)
    outside = [u for u in urls if not u.startswith(f"{server.url}/") and not u.startswith(inline)]
    assert not outside, f"requests outside {server.url}: {outside}"


def test_no_horizontal_scroll_at_360_px(driver, generated, tmp_path):
    """At 360 px wide the generated page (long tokens and all) fits: nothing scrolls sideways."""
    try:
        driver.set_window_size(NARROW, HEIGHT)
        wait_for(driver, lambda d: js(d, "return window.innerWidth") == NARROW, f"a window {NARROW} px wide", 10)
        widths = js(driver, "return [document.documentElement.scrollWidth, window.innerWidth]")
        screenshot(driver, tmp_path, f"page-{NARROW}.png")
        assert widths[0] <= widths[1], f"scrollWidth {widths[0]} > innerWidth {widths[1]}"
    finally:
        driver.set_window_size(WIDTH, HEIGHT)


def test_the_json_schema_box(driver, server, generated):
    """A schema typed in the "JSON schema" box goes out as response_format, and the completion shown is JSON of
    that schema (finished, or a prefix of it); a box that is not JSON is the page's error, and nothing is
    posted. Runs after the tests above: it loads the page again."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    driver.get(f"{server.url}/")
    wait_for(driver, lambda d: d.find_elements(By.ID, "json_schema"), "the JSON schema box", 30)
    driver.find_element(By.CSS_SELECTOR, "details.schema summary").click()
    for name, value in (("prompt", "Data:"), ("max_tokens", "40"), ("seed", "3"), ("json_schema", "{not json")):
        field = driver.find_element(By.ID, name)
        field.clear()
        field.send_keys(value)
    driver.get_log("performance")
    driver.find_element(By.ID, "generate").click()
    wait_for(driver, lambda d: state(d) == "error", "the page's error", 30)
    assert text_of(driver, "#error").startswith("JSON schema: not valid JSON")
    assert not [r for r in requests_made(driver.get_log("performance")) if r["url"].endswith("/v1/completions")]
    box = driver.find_element(By.ID, "json_schema")
    box.clear()
    box.send_keys(json.dumps(schema))
    driver.find_element(By.ID, "generate").click()
    wait_for(driver, lambda d: state(d) in ("done", "error"), "the generation", GENERATE_S, server)
    assert state(driver) == "done", text_of(driver, "#error")
    sent = [json.loads(r["postData"]) for r in requests_made(driver.get_log("performance"))
            if r["url"] == f"{server.url}/v1/completions" and r["method"] == "POST"]
    assert [b["response_format"] for b in sent] == [{"type": "json_schema",
                                                     "json_schema": {"name": "schema", "schema": schema}}]
    text = text_of(driver, "#completion")
    r = server.post("/v1/completions", {**{k: v for k, v in sent[0].items() if k != "stream"}}, key=None)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    if r.json()["choices"][0]["finish_reason"] == "stop":
        value = json.loads(text)
        assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
