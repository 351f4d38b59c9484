"""POST /v1/inspect and the playground's files (GET /, /static/...), in-process (Starlette's TestClient): the
answer against score() and a full-vocabulary recount on the float64 oracle, every bad input a 400 naming its
field before any work, the queue's 503, and the page's elements as the browser test (test_page.py) expects them.

Each test names the bug it catches; each was seen to fail once with that bug planted by hand.
"""

import asyncio
import html.parser
import threading
import time

import numpy as np
import pytest

import gpt2numba as g
from test_serve import CONFIG, KEY
from test_tokenview import rank_bounds, recount

pytest.importorskip("starlette", reason="the server needs the [serve] extra")

from starlette.testclient import TestClient  # noqa: E402

from gpt2numba import serve  # noqa: E402
from gpt2numba.text.tokenview import inspect_ids  # noqa: E402
from gpt2numba.serve import app as app_module  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "The café on the corner serves 日本語 tea.\nIt opens at 7."  # 日本語: characters split across tokens
TOL = 1e-5


@pytest.fixture(scope="module")
def w():
    return g.random_weights(CONFIG, seed=5)


@pytest.fixture(scope="module")
def tokenizer():
    return g.load_tokenizer()


@pytest.fixture(scope="module")
def client(w, tokenizer):
    app = serve.create_app(w, tokenizer, max_batch=2, api_key=KEY, max_body_bytes=2**14, model_name="tiny")
    with TestClient(app) as c:
        yield c


def inspect(client, body, **headers):
    return client.post("/v1/inspect", json=body, headers={**AUTH, **headers})


def test_the_answer_against_score_and_the_recount(client, w, tokenizer):
    """The contract's JSON; each token's log-probability equals score()'s of <|endoftext|> + the ids and the
    oracle's, its rank a recount over the whole vocabulary, its 20 alternatives the oracle's likeliest; the
    offsets reassemble the text's bytes. Catches the <|endoftext|> listed as a token or not fed, an
    off-by-one between a token and the row that predicts it, offsets in characters, usage counting the
    <|endoftext|>, the perplexity of another base or of the completion's tokens only."""
    r = inspect(client, {"text": TEXT, "top_logprobs": 20})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    body = r.json()
    assert set(body) == {"object", "model", "tokens", "perplexity", "usage"}
    assert body["object"] == "inspection" and body["model"] == "tiny"
    ids = tokenizer.encode(TEXT)
    tokens = body["tokens"]
    assert [t["id"] for t in tokens] == ids and body["usage"] == {"prompt_tokens": len(ids)}
    assert all(set(t) == {"id", "text", "offset", "logprob", "rank", "top_logprobs"} for t in tokens)
    data = TEXT.encode("utf-8")
    assert b"".join(data[a:b] for a, b in (t["offset"] for t in tokens)) == data
    assert [t["offset"][0] for t in tokens[1:]] == [t["offset"][1] for t in tokens[:-1]]
    assert [t["text"] for t in tokens] == [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in t["text"] for t in tokens), "no character split across tokens: the case is not covered"

    logprobs = np.array([t["logprob"] for t in tokens])
    s = g.score([tokenizer.eot_id, *ids], w)
    np.testing.assert_allclose(logprobs, s.logprobs, rtol=0, atol=TOL)
    assert body["perplexity"] == pytest.approx(s.perplexity, rel=TOL)
    logits, ref, ranks = recount(ids, w, tokenizer)
    np.testing.assert_allclose(logprobs, ref[np.arange(len(ids)), ids], rtol=0, atol=TOL)
    shown = np.array([t["rank"] for t in tokens])
    low, high = rank_bounds(logits, ids, w, tokenizer)
    assert np.all((low <= shown) & (shown <= high))
    exact = low == high
    assert exact.mean() > 0.5
    np.testing.assert_array_equal(shown[exact], ranks[exact])
    best = np.sort(ref, axis=1)[:, ::-1][:, :20]
    alternatives = np.array([[a["logprob"] for a in t["top_logprobs"]] for t in tokens])
    np.testing.assert_allclose(alternatives, best, rtol=0, atol=TOL)
    assert all(a["text"] == tokenizer.decode([a["id"]]) for t in tokens for a in t["top_logprobs"])


def test_ids_text_and_the_library_agree(client, w, tokenizer):
    """{"prompt": ids} answers as {"text": ...} of the same tokens, and both as the library's Inspection;
    top_logprobs defaults to 5 and 0 lists none. Catches a prompt read as text, a default other than 5."""
    ids = tokenizer.encode(TEXT)
    by_text, by_ids = (inspect(client, body).json() for body in ({"text": TEXT}, {"prompt": ids}))
    assert by_text == by_ids
    assert by_text["tokens"] == inspect_ids(ids, w, tokenizer).tokens()
    assert all(len(t["top_logprobs"]) == 5 for t in by_text["tokens"])
    none = inspect(client, {"prompt": ids, "top_logprobs": 0, "model": "tiny"}).json()
    assert all(t["top_logprobs"] == [] for t in none["tokens"])
    assert [t["rank"] for t in none["tokens"]] == [t["rank"] for t in by_text["tokens"]]


def test_the_longest_text(client, tokenizer):
    """n_positions - 1 tokens are inspected (<|endoftext|> takes the first position); one more is a 400 naming
    the field and the limit."""
    n = CONFIG.n_positions
    r = inspect(client, {"prompt": [262] * (n - 1)})
    assert r.status_code == 200 and len(r.json()["tokens"]) == n - 1, r.text
    for body, field in (({"prompt": [262] * n}, "prompt"), ({"text": " the" * n}, "text")):
        r = inspect(client, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert f"at most {n - 1} tokens" in r.json()["error"]["message"]


BAD = [  # (body, the field the 400 names)
    ({}, "text"),
    ({"top_logprobs": 3}, "text"),
    ({"text": "a", "prompt": [1]}, "prompt"),
    ({"text": 5}, "text"),
    ({"text": ["a"]}, "text"),
    ({"text": ""}, "text"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "a b"}, "prompt"),
    ({"prompt": [1, "2"]}, "prompt"),
    ({"prompt": [1, 2.0]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [CONFIG.vocab_size]}, "prompt"),
    ({"prompt": [[1, 2]]}, "prompt"),
    ({"text": "a", "top_logprobs": 21}, "top_logprobs"),
    ({"text": "a", "top_logprobs": -1}, "top_logprobs"),
    ({"text": "a", "top_logprobs": 2.5}, "top_logprobs"),
    ({"text": "a", "top_logprobs": True}, "top_logprobs"),
    ({"text": "a", "top_logprobs": "5"}, "top_logprobs"),
    ({"text": "a", "model": 1}, "model"),
    ({"text": "a", "echo": True}, "echo"),
]


@pytest.fixture
def calls(client, monkeypatch):
    """What reaches the engine: each call handed to Engine.call is counted."""
    engine, made = client.app.state.engine, []
    call = engine.call

    def counted(function, loop):
        made.append(function)
        return call(function, loop)

    monkeypatch.setattr(engine, "call", counted)
    return made


@pytest.mark.parametrize("body, field", BAD, ids=[str(b)[:40] for b, _ in BAD])
def test_a_bad_body_is_a_400_naming_the_field(client, calls, body, field):
    """Every bad field: 400 with OpenAI's error object naming it, and nothing reaches the engine."""
    r = inspect(client, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error
    assert not calls


def test_bodies_the_server_refuses_before_reading_them(client, calls):
    """Not JSON, not an object, over --max-body-bytes, without the key: 400, 400, 400, 401, and no work."""
    for content in (b"{not json", b"[1, 2]", b'{"text": "' + b"a" * 2**14 + b'"}'):
        r = client.post("/v1/inspect", content=content, headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "over the limit of 16384 bytes" in r.json()["error"]["message"]
    assert client.post("/v1/inspect", json={"text": "a"}).status_code == 401
    assert not calls


def test_the_work_runs_on_the_engine_thread(client, monkeypatch):
    """The handler computes nothing: inspect_ids runs on the engine's thread, between its steps. Catches an
    inspection run on the event loop (which would stall every other request) or in a thread of its own
    beside the engine's (two forward passes at once on the kernels' threads)."""
    threads = []

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return inspect_ids(*args, **kwargs)

    monkeypatch.setattr(app_module, "inspect_ids", recorded)
    assert inspect(client, {"text": "Hello"}).status_code == 200
    assert threads == ["gpt2numba-engine"]


def test_a_full_queue_is_a_503(w, tokenizer):
    """--max-queue calls waiting: the next inspection gets 503 with Retry-After, naming the flag; once the
    engine is free it is served. The engine is held by a call of the test's own that waits on an event."""
    app = serve.create_app(w, tokenizer, max_batch=1, max_queue=1)
    loop = asyncio.new_event_loop()  # (never run: the held calls' futures are nobody's)
    running, release = threading.Event(), threading.Event()
    with TestClient(app) as c:
        engine = app.state.engine
        try:
            engine.call(lambda: (running.set(), release.wait(300)), loop)
            assert running.wait(300), "the engine never ran the held call"
            engine.call(lambda: None, loop)  # waits: the queue is full
            r = c.post("/v1/inspect", json={"text": "Hello"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "--max-queue" in r.json()["error"]["message"]
        finally:
            release.set()
        deadline = time.monotonic() + 300  # the held call and the waiting one leave the queue (a busy machine
        while engine.busy and time.monotonic() < deadline:  # may take a while to run the engine's thread)
            time.sleep(0.01)
        assert c.post("/v1/inspect", json={"text": "Hello"}).status_code == 200
        engine.drain()
        r = c.post("/v1/inspect", json={"text": "Hello"})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    loop.close()


class Elements(html.parser.HTMLParser):
    """Every element of a page: (tag, attributes, the ids of its ancestors)."""

    def __init__(self):
        super().__init__()
        self.found, self.open = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.found.append((tag, attrs, [a.get("id") for _, a in self.open]))
        if tag not in ("input", "meta", "link", "br", "img"):
            self.open.append((tag, attrs))

    def handle_endtag(self, tag):
        while self.open and self.open.pop()[0] != tag:
            pass


def test_the_page_and_its_files(client):
    """GET / (open, no key) is the playground with the contract's elements, under a policy that lets it load and
    ask nothing but this server; its CSS and JS come from /static/; no file of it names another site."""
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.text[:200]
    policy = r.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "http" not in policy
    page = Elements()
    page.feed(r.text)
    by_id = {attrs.get("id"): (tag, attrs, above) for tag, attrs, above in page.found if attrs.get("id")}
    for element, tag in {"prompt": "textarea", "generate": "button", "show-probs": "input", "color-by": "select",
                         "output": "div", "prompt-text": "span", "completion": "span", "view": "div", "tip": "div",
                         "ranks": "div", "perplexity": "span", "error": "p"}.items():
        assert by_id[element][0] == tag, element
    for field in ("max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed"):
        assert by_id[field][0] == "input", field
    assert by_id["show-probs"][1]["type"] == "checkbox"
    assert "output" in by_id["prompt-text"][2] and "output" in by_id["completion"][2]
    options = [attrs["value"] for tag, attrs, above in page.found if tag == "option" and "color-by" in above]
    assert options == ["probability", "rank"]
    sources = [attrs.get("src") or attrs.get("href") for tag, attrs, _ in page.found if tag in ("script", "link")]
    assert set(sources) == {"data:,", "/static/view.css", "/static/view.js", "/static/playground.js"}
    for name, kind in (("view.css", "text/css"), ("view.js", "javascript"), ("playground.js", "javascript")):
        f = client.get(f"/static/{name}")
        assert f.status_code == 200 and kind in f.headers["content-type"], name
        assert "http:" not in f.text and "https:" not in f.text and "@import" not in f.text, name
    assert "http:" not in r.text and "https:" not in r.text
    assert client.get("/static/nothing.js").status_code == 404
