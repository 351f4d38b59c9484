"""GET /metrics (issue 19): Prometheus' text, read back with prometheus-client's own parser, whose counters and
histograms add up to the requests sent. In-process (Starlette's TestClient). Nothing is timed and nothing
sleeps: the engine counts a step's tokens and a request's times before it hands the step's events out, and
the routes count a status before its answer's last byte, so a scrape sent after an answer finds it counted;
where a test needs the engine to stand still, it holds it with an event."""

import concurrent.futures
import types

import pytest

import gpt2numba as g
from helpers import hold_after_first_step
from test_serve import CONFIG, KEY

pytest.importorskip("starlette", reason="the server needs the [serve] extra")
pytest.importorskip("prometheus_client", reason="/metrics needs prometheus-client (the [serve] extra)")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gpt2numba import serve  # noqa: E402
from gpt2numba.serve.metrics import Metrics  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
FAILS = [42, 42, 42]  # a prompt whose echo raises in the engine (a 500)


def ids(length: int) -> list[int]:
    return list(range(100, 100 + length))


# (body, prompt tokens counted: each choice its own prompt, tokens out, choices of two tokens or more)
SERVED = [
    ({"prompt": ids(3), "max_tokens": 4}, 3, 4, 1),
    ({"prompt": [ids(2), ids(5)], "n": 2, "max_tokens": 3}, 2 * 2 + 5 * 2, 12, 4),
    ({"prompt": ids(6), "max_tokens": 1}, 6, 1, 0),
    ({"prompt": ids(4), "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}, 4, 5, 1),
    ({"prompt": ids(7), "max_tokens": 2, "n": 2, "stream": True}, 7 * 2, 4, 2),
    ({"prompt": ids(5), "max_tokens": 0, "echo": True}, 5, 0, 0),  # no token: no time to first token
]


def families(text: str) -> dict:
    """name -> (type, {(sample name, sorted labels): value}), by prometheus-client's parser."""
    return {f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
            for f in text_string_to_metric_families(text)}


def scrape(client) -> dict:
    """/metrics, sent without the key (it is open, as /health), parsed."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return families(r.text)


def value(found: dict, name: str, sample: str | None = None, **labels) -> float:
    _, samples = found[name]
    return samples[(sample or name, tuple(sorted(labels.items())))]


def histogram(found: dict, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram whose buckets are cumulative and end in +Inf = count."""
    kind, samples = found[name]
    assert kind == "histogram"
    buckets = sorted(((float(dict(labels)["le"]), v) for (sample, labels), v in samples.items()
                      if sample == f"{name}_bucket"))
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1][0] == float("inf"), buckets
    count = value(found, name, f"{name}_count")
    assert counts[-1] == count
    return count, value(found, name, f"{name}_sum")


def gauges(found: dict) -> tuple:
    return tuple(value(found, f"gpt2numba_num_{what}") for what in ("requests_waiting", "choices_waiting",
                                                                    "sequences_running", "sequences_paused"))


def statuses(found: dict) -> dict:
    """gpt2numba_requests_total by status: {"200": 6.0, ...}."""
    return {dict(labels)["status"]: v for (sample, labels), v in found["gpt2numba_requests"][1].items()
            if sample == "gpt2numba_requests_total"}


def test_the_counters_add_up_to_the_requests_sent(monkeypatch):
    """Six requests served (streamed and not, n = 2, several prompts, an echo of no token), two 500s (the
    engine fails a request's echo: one answered whole, one streamed, whose error ends a 200 stream), two
    400s, two 401s and a 503 (the server draining): every counter and every histogram's count exactly.
    Catches: a stream counted 200 when it starts (its error uncounted), a status counted twice or not at
    all, the prompt counted once per request (not once per choice started), tokens counted per request or
    per finish, the time to first token per choice or before the first token (an echo of none), the time
    per token for one-token choices, a failed request's time among the served ones', the /metrics route
    behind the key."""
    original = serve.logprobs.Logprobs.prompt

    def fails(self, prompt, k, into=None):
        if prompt == FAILS:
            raise RuntimeError("planted")
        return original(self, prompt, k, into)

    monkeypatch.setattr(serve.logprobs.Logprobs, "prompt", fails)
    app = serve.create_app(g.random_weights(CONFIG, seed=5), g.load_tokenizer(), max_batch=2, api_key=KEY)
    with TestClient(app) as client:
        for body, _, tokens, _ in SERVED:
            r = client.post("/v1/completions", json={**body, "ignore_eos": True}, headers=AUTH)
            assert r.status_code == 200, r.text
            if body.get("stream"):
                assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
            else:
                assert r.json()["usage"]["completion_tokens"] == tokens
        failing = {"prompt": FAILS, "max_tokens": 2, "echo": True, "logprobs": 1}
        r = client.post("/v1/completions", json=failing, headers=AUTH)
        assert r.status_code == 500, r.text
        r = client.post("/v1/completions", json={**failing, "stream": True}, headers=AUTH)
        assert r.status_code == 200 and "planted" in r.text and r.text.endswith("data: [DONE]\n\n"), r.text
        for body in ({"prompt": "x", "max_tokens": "ten"}, {"prompt": "x", "frobnicate": 1}):
            assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 400
        for headers in ({}, {"Authorization": f"Bearer {KEY}x"}):
            assert client.post("/v1/completions", json={"prompt": "x"}, headers=headers).status_code == 401
        app.state.engine.drain()
        assert client.post("/v1/completions", json={"prompt": "x"}, headers=AUTH).status_code == 503
        found = scrape(client)

    assert statuses(found) == {"200": 6, "400": 2, "401": 2, "500": 2, "503": 1}
    prompt_tokens = sum(p for _, p, _, _ in SERVED) + 2 * len(FAILS)  # the failed choices started too
    assert value(found, "gpt2numba_prompt_tokens", "gpt2numba_prompt_tokens_total") == prompt_tokens
    assert value(found, "gpt2numba_generation_tokens", "gpt2numba_generation_tokens_total") == \
        sum(t for _, _, t, _ in SERVED)
    ttft = histogram(found, "gpt2numba_time_to_first_token_seconds")
    tpot = histogram(found, "gpt2numba_time_per_output_token_seconds")
    whole = histogram(found, "gpt2numba_e2e_request_latency_seconds")
    assert ttft[0] == sum(1 for _, _, t, _ in SERVED if t)  # requests with a token
    assert tpot[0] == sum(c for _, _, _, c in SERVED)
    assert whole[0] == len(SERVED)  # served in full: not the failures
    assert 0 < ttft[1] <= whole[1] and tpot[1] > 0  # each request's first token comes before its end
    assert gauges(found) == (0, 0, 0, 0)


def test_the_queue_and_the_batch_are_read_at_each_scrape(monkeypatch):
    """One place in the batch, a streamed request of three choices, the engine held after its first step:
    /metrics shows one sequence running, one request and two choices waiting; after the answer, none.
    Catches: gauges set when something happens and not read (left at their last value), choices waiting
    counted as requests, the batch's size for the sequences in it.

    The request streams on a thread of its own: whether the TestClient returns from entering the stream
    before the response's first event depends on Starlette's version (1.7 does not, 1.10 does), and that
    event waits for the held step, so the test waits only on the engine, never on the client."""
    armed, held, release = hold_after_first_step(monkeypatch)
    app = serve.create_app(g.random_weights(CONFIG, seed=5), g.load_tokenizer(), max_batch=1)
    body = {"prompt": ids(3), "max_tokens": 3, "n": 3, "stream": True, "ignore_eos": True}
    with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        armed.set()  # (after the engine's warm-up)
        try:
            lines = pool.submit(sse_lines, client, body)
            assert held.wait(300), "the engine's first step"
            assert gauges(scrape(client)) == (1, 2, 1, 0)
        finally:
            release.set()
        assert lines.result(300)[-1] == "data: [DONE]"
        found = scrape(client)
    assert gauges(found) == (0, 0, 0, 0)
    assert value(found, "gpt2numba_generation_tokens", "gpt2numba_generation_tokens_total") == 9


def sse_lines(client, body) -> list[str]:
    """A streamed completion's non-empty lines, read to the end."""
    with client.stream("POST", "/v1/completions", json=body) as r:
        return [line for line in r.iter_lines() if line]


class PrefixCache:
    """What the prefix cache offers /metrics: integer counts, its bytes, and len() its blocks."""

    def __init__(self, lookups, hits, hit_tokens, evictions, nbytes, blocks):
        self.lookups, self.hits, self.hit_tokens, self.evictions = lookups, hits, hit_tokens, evictions
        self.nbytes, self.blocks = nbytes, blocks

    def __len__(self):
        return self.blocks


def test_the_prefix_cache_is_read_at_each_scrape():
    """An engine without a prefix cache (no attribute, as today's; or None, switched off) shows none of its
    metrics; one with it shows each count, read anew at every scrape. Catches: engine.prefixes read without
    a default (today's engine fails the scrape), values copied once when the server starts, two counts
    swapped, a count exported as a gauge."""
    engine = types.SimpleNamespace(queued=2, queued_choices=5, active=3, paused=1, preemptions=4, positions=(7, 9),
                                   max_positions=None)  # no .prefixes
    metrics = Metrics()
    metrics.watch(engine)
    found = families(metrics.text().decode())
    assert gauges(found) == (2, 5, 3, 1) and not [name for name in found if "prefix" in name]
    assert value(found, "gpt2numba_num_preemptions", "gpt2numba_num_preemptions_total") == 4
    engine.prefixes = None  # switched off
    assert not [name for name in families(metrics.text().decode()) if "prefix" in name]
    engine.prefixes = cache = PrefixCache(0, 0, 0, 0, 0, 0)
    for figures in ((10, 4, 96, 1, 4096, 3), (13, 6, 160, 2, 2048, 2)):  # more traffic: every figure moves
        cache.lookups, cache.hits, cache.hit_tokens, cache.evictions, cache.nbytes, cache.blocks = figures
        found = families(metrics.text().decode())
        for name, count in zip(("lookups", "hits", "hit_tokens", "evictions"), figures):
            family = f"gpt2numba_prefix_cache_{name}"
            assert found[family][0] == "counter" and value(found, family, f"{family}_total") == count, name
        for name, count in zip(("bytes", "blocks"), figures[4:]):
            family = f"gpt2numba_prefix_cache_{name}"
            assert found[family][0] == "gauge" and value(found, family) == count, name


def test_each_server_counts_its_own_requests():
    """Two servers in one process: each its own registry (the global one would refuse the second server's
    metrics), each counting only its requests. No engine starts: 401 and 400 need none."""
    w, tok = g.random_weights(CONFIG, seed=5), g.load_tokenizer()
    first, second = (TestClient(serve.create_app(w, tok, api_key=KEY, max_batch=1)) for _ in range(2))
    assert first.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    assert first.post("/v1/completions", json={"prompt": "x", "n": 0}, headers=AUTH).status_code == 400
    for _ in range(2):
        assert second.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    for client, expected in ((first, {"401": 1, "400": 1}), (second, {"401": 2})):
        assert statuses(scrape(client)) == expected


def test_cache_positions_own_and_shared_are_read_at_each_scrape(monkeypatch):
    """Three choices of one prompt, the engine held after its first step: the first choice wrote the prompt's
    positions, the other two read them in place; after the answer, none. Catches: shared rows counted as
    owned (copies), positions left at their last value."""
    armed, held, release = hold_after_first_step(monkeypatch)
    app = serve.create_app(g.random_weights(CONFIG, seed=5), g.load_tokenizer(), max_batch=3, prefix_cache_mb=0)
    body = {"prompt": ids(5), "max_tokens": 3, "n": 3, "stream": True, "ignore_eos": True}
    with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        armed.set()
        try:
            lines = pool.submit(sse_lines, client, body)
            assert held.wait(300), "the engine's first step"
            found = scrape(client)
            assert value(found, "gpt2numba_kv_cache_positions", kind="own") == 5
            assert value(found, "gpt2numba_kv_cache_positions", kind="shared") == 10
            assert value(found, "gpt2numba_kv_cache_max_positions") == 0
        finally:
            release.set()
        assert lines.result(300)[-1] == "data: [DONE]"
        found = scrape(client)
    assert value(found, "gpt2numba_kv_cache_positions", kind="own") == 0
    assert value(found, "gpt2numba_kv_cache_positions", kind="shared") == 0
