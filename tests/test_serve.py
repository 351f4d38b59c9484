"""The HTTP server as its clients see it: a subprocess on a free port, the official openai client."""

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY_GPT2

openai = pytest.importorskip("openai", reason="the server's tests need the openai client (the test extra)")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette", reason="the server needs the [serve] extra")

CONFIG = dataclasses.replace(TINY_GPT2, n_positions=128)
KEY = "sk-test"
MAX_BATCH, MAX_QUEUE = 8, 24  # 20 concurrent requests may all be waiting at once: the queue holds them


def wait_until(condition, what: str, timeout: float = 300):
    """Poll ``condition`` until it is true; a generous timeout, since CI shares its machine."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.05)


class Server:
    def __init__(self, tmp: Path, *extra, key=("--api-key", KEY), env=None, open_files=None):
        """extra: more flags; key: the flags that give the key; env: the environment; open_files: a limit on
        the server's open files (RLIMIT_NOFILE, soft and hard)."""
        self.model = tmp / "model"
        if not self.model.exists():
            write_dir(g.random_weights(CONFIG, seed=5), self.model)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / f"server-{port}.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpt2numba", "serve", "--model", str(self.model), "--port", str(port),
             "--threads", "2", *key, *extra],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env,
            preexec_fn=None if open_files is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                                   (open_files, open_files)))
        deadline = time.monotonic() + 600  # a cold start compiles; CI shares its machine
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise AssertionError(f"the server did not start: {self.log.read_text()}")
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0)

    def post(self, path, body=None, content=None, key=KEY):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}{path}", json=body, content=content, headers=headers, timeout=300)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=60).json()

    def log_lines(self, text: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if text in line]

    def rss_mb(self) -> float:
        for line in open(f"/proc/{self.process.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stop(self, timeout=300) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local(server):
    """The same model in this process: weights and tokenizer."""
    return g.load_weights(server.model), g.load_tokenizer(server.model)


def greedy_tokens(local, ids, n):
    w, _ = local
    return list(g.generate(ids, w, max_new_tokens=n, temperature=0))


def text_of(local, tokens):
    _, tok = local
    return tok.decode([t for t in tokens if t != tok.eot_id])


def log_softmax(z):
    z = np.asarray(z, np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def test_greedy_completion_equals_generate(server, local):
    _, tok = local
    r = server.client.completions.create(model="gpt2", prompt="The meaning of life is", max_tokens=12,
                                         temperature=0)
    tokens = greedy_tokens(local, tok.encode("The meaning of life is"), 12)
    assert r.choices[0].text == text_of(local, tokens)
    assert r.choices[0].finish_reason == ("stop" if tok.eot_id in tokens else "length")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == len(tokens)
    assert r.object == "text_completion" and r.model == "model"


def test_token_id_prompts_and_several_prompts(server, local):
    ids = [[464, 3290, 286], [15496, 11, 995, 0, 314]]
    r = server.client.completions.create(model="gpt2", prompt=ids, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:  # choice i is prompt i // n
        assert c.text == text_of(local, greedy_tokens(local, ids[c.index // 2], 6))


def test_stream_concatenates_to_the_whole(server):
    kw = dict(model="gpt2", prompt="Once upon a time", max_tokens=20, temperature=0.8, seed=7)
    whole = server.client.completions.create(**kw).choices[0]
    chunks = list(server.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].usage.completion_tokens >= 1 and not chunks[-1].choices


def test_seed_makes_n_choices_reproducible(server):
    kw = dict(model="gpt2", prompt="A", max_tokens=10, n=2, temperature=1.0, seed=3)
    first, again = (server.client.completions.create(**kw) for _ in range(2))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text  # each choice its own stream


def test_stop_strings_cut_the_text(server, local):
    full = server.client.completions.create(model="gpt2", prompt="Hello", max_tokens=30, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3
    r = server.client.completions.create(model="gpt2", prompt="Hello", max_tokens=30, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True}).choices[0]
    assert r.text == full[:full.index(stop)] and r.finish_reason == "stop"
    chunks = server.client.completions.create(model="gpt2", prompt="Hello", max_tokens=30, temperature=0,
                                              stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == r.text  # a stop split across tokens never leaks


def test_logprobs_are_the_models(server, local):
    w, tok = local
    ids = tok.encode("Numbers: 1, 2, 3")
    r = server.client.completions.create(model="gpt2", prompt=ids, max_tokens=5, temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True}).choices[0]
    tokens = greedy_tokens(local, ids, 5)
    mc = g.ModelCache(w.config)
    logits = [g.prefill(ids, w, mc), *(g.decode_step(t, w, mc) for t in tokens[:-1])]
    expected = [log_softmax(z)[t] for z, t in zip(logits, tokens)]
    np.testing.assert_allclose(r.logprobs.token_logprobs, expected, atol=1e-4)
    for top, lp in zip(r.logprobs.top_logprobs, r.logprobs.token_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp)  # greedy: the token is the best
    assert r.logprobs.tokens == [tok.decode([t]) for t in tokens]
    assert r.logprobs.text_offset[0] == 0


def test_echo_gives_the_prompts_log_probabilities(server, local):
    w, tok = local
    text = "The quick brown fox jumps over the lazy dog"
    r = server.client.completions.create(model="gpt2", prompt=text, max_tokens=0, echo=True, logprobs=1).choices[0]
    assert r.text == text
    expected = g.score(tok.encode(text), w)
    assert r.logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(r.logprobs.token_logprobs[1:], expected.logprobs, atol=1e-4)
    greedy = [lp == pytest.approx(max(top.values())) for top, lp in
              zip(r.logprobs.top_logprobs[1:], r.logprobs.token_logprobs[1:])]
    assert greedy == list(expected.greedy)
    assert r.logprobs.text_offset == [text.index(t, o) for t, o in zip(r.logprobs.tokens, r.logprobs.text_offset)]


def test_echo_and_one_token_as_lm_eval_asks(server, local):
    """lm-evaluation-harness's local-completions: token ids, echo, max_tokens 1, logprobs 1, temperature 0."""
    w, _ = local
    ids = [[464, 3290, 286, 1204, 318], [40, 588]]
    r = server.post("/v1/completions", {"model": "gpt2", "prompt": ids, "max_tokens": 1, "logprobs": 1,
                                        "echo": True, "temperature": 0, "seed": 1234}).json()
    for choice, prompt in zip(r["choices"], ids):
        lp = choice["logprobs"]["token_logprobs"]
        assert len(lp) == len(prompt) + 1
        np.testing.assert_allclose(lp[1:len(prompt)], g.score(prompt, w).logprobs, atol=1e-4)


def test_concurrent_requests_equal_one_at_a_time(server):
    rng = np.random.default_rng(0)
    requests = [dict(model="gpt2", prompt=rng.integers(0, 50257, int(n)).tolist(), max_tokens=int(m), temperature=0)
                for n, m in zip(rng.integers(1, 60, 20), rng.integers(1, 40, 20))]
    alone = [server.client.completions.create(**kw).choices[0].text for kw in requests]
    health = []

    def poll(stop):  # /health answers while the batch is busy: the handlers never wait for the engine
        while not stop.done():
            health.append(server.health())
            time.sleep(0.01)

    with concurrent.futures.ThreadPoolExecutor(22) as pool:
        futures = [pool.submit(server.client.completions.create, **kw) for kw in requests]
        done = concurrent.futures.Future()
        poller = pool.submit(poll, done)
        try:
            together = [f.result().choices[0].text for f in futures]
        finally:  # the poller stops whatever happened
            done.set_result(None)
        poller.result()
    assert together == alone
    assert any(h["active"] > 0 for h in health), health


def test_a_client_that_leaves_frees_its_slot(server):
    before = len(server.log_lines("completion cancelled"))
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "x", "max_tokens": 120, "stream": True, "ignore_eos": True}, timeout=300) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    wait_until(lambda: len(server.log_lines("completion cancelled")) > before, "the cancelled request's log line")
    wait_until(lambda: server.health() == {"status": "ok", "active": 0, "queued": 0}, "an idle server")
    cancelled = server.log_lines("completion cancelled")[-1]
    assert int(cancelled.split(" tokens out")[0].split()[-1]) < 120


def test_memory_is_flat_after_many_requests(server):
    def burst(n):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: server.client.completions.create(
                model="gpt2", prompt=f"request {i}", max_tokens=4, logprobs=2, echo=i % 2 == 0), range(n)))

    burst(50)
    before = server.rss_mb()
    burst(200)
    assert server.rss_mb() - before < 16, f"RSS grew from {before:.0f} MB to {server.rss_mb():.0f} MB"


BAD = [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "stop": ["a", 3]}, "stop"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": [1, 2, 50257]}, "prompt"),
    ({"prompt": [[1], [-1]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": list(range(100)), "max_tokens": 29}, "max_tokens"),
    ([1, 2], None),
]


@pytest.mark.parametrize("body, param", BAD, ids=[str(p) for _, p in BAD])
def test_bad_requests_get_400_and_the_server_goes_on(server, body, param):
    r = server.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert server.client.completions.create(model="gpt2", prompt="ok", max_tokens=2).choices[0].text is not None


def test_bodies_that_are_not_json_or_too_big(server):
    for content in (b"{not json", b"\xff\xfe", b"x" * (2**20 + 1)):
        r = server.post("/v1/completions", content=content)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    assert "over the limit" in r.json()["error"]["message"]
    assert server.post("/v1/completions", {"prompt": "x"}, key="wrong").status_code == 401
    assert server.post("/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    assert httpx.get(f"{server.url}/v1/nothing-here").json()["error"]["message"]


def test_a_full_queue_gets_503(server):
    """Fill the batch and the queue, watching /health, then one request more: 503 with Retry-After. The
    batch is held by MAX_BATCH requests of one long choice each (a request's only place is never taken from
    it); the queue by requests that stream. Nothing depends on how fast the machine is: each step waits on
    /health."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=300,
                      limits=httpx.Limits(max_connections=MAX_BATCH + MAX_QUEUE + 2)) as client, \
            contextlib.ExitStack() as open_:
        def stream(body):
            return open_.enter_context(client.stream("POST", "/v1/completions", json={"stream": True, **body}))

        held = [stream({"prompt": "y", "max_tokens": CONFIG.n_positions - 1, "ignore_eos": True})
                for _ in range(MAX_BATCH)]
        wait_until(lambda: server.health() == {"status": "ok", "active": MAX_BATCH, "queued": 0}, "a full batch")
        waiting = [stream({"prompt": f"w{i}", "max_tokens": 2, "ignore_eos": True,
                           "stream_options": {"include_usage": True}}) for i in range(MAX_QUEUE)]
        wait_until(lambda: server.health()["queued"] == MAX_QUEUE, "a full queue")
        busy = client.post("/v1/completions", json={"prompt": "z", "max_tokens": 1}, timeout=120)  # (no compute)
        assert busy.status_code == 503 and busy.headers["retry-after"], busy.text
        assert busy.json()["error"]["type"] == "server_error"
        for r in held:  # the clients leave: their choices leave the batch, and the queued requests are served
            r.close()
        for r in waiting:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert events[-1]["usage"]["completion_tokens"] == 2 and events[-2]["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: server.health() == {"status": "ok", "active": 0, "queued": 0}, "an idle server")


def test_usage_counts_the_prompt_once_whatever_n(server):
    """OpenAI's usage: each prompt once, however many choices; total = prompts + every choice's tokens.
    Catches: prompt_tokens counted once per choice (x n), total_tokens without the completions."""
    r = server.client.completions.create(model="gpt2", prompt=[464, 3290, 286], max_tokens=4, n=2,
                                         extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 8, 11)
    r = server.client.completions.create(model="gpt2", prompt=[[464, 3290, 286], [15496, 11]], max_tokens=3, n=3,
                                         extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 18, 23)
    chunks = list(server.client.completions.create(model="gpt2", prompt=[464, 3290, 286], max_tokens=4, n=2,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}))
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.total_tokens) == (3, 11)


@pytest.mark.parametrize("key", [KEY + "X", KEY[:-1], KEY.upper(), "", " " + KEY],
                         ids=["suffix", "last char dropped", "upper case", "empty", "leading space"])
def test_a_key_that_is_nearly_right_gets_401(server, key):
    """Catches a check by prefix (Bearer KEYEXTRA), by the given key's own length, or without case."""
    headers = {"Authorization": f"Bearer {key}".rstrip()}  # (a header value may not end in a space)
    for method, path, body in [("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
                               ("GET", "/v1/models", None), ("POST", "/tokenize", {"content": "x"})]:
        r = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=300)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, r.text)
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_request_that_fills_the_context_exactly(server):
    """prompt + max_tokens == n_positions is served, every token of it; one more token is refused.
    Catches: >= for > in the length check (or in the batch's room), and a check that lets n_positions + 1 in."""
    n = CONFIG.n_positions
    fits = server.post("/v1/completions", {"prompt": list(range(100)), "max_tokens": n - 100, "ignore_eos": True})
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"] == {"prompt_tokens": 100, "completion_tokens": n - 100, "total_tokens": n}
    whole = server.post("/v1/completions", {"prompt": list(range(n)), "max_tokens": 0, "echo": True})
    assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] == n, whole.text
    for body in ({"prompt": list(range(100)), "max_tokens": n - 99}, {"prompt": list(range(n + 1)), "max_tokens": 0},
                 {"prompt": [list(range(5)), list(range(101))], "max_tokens": n - 100}):
        r = server.post("/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_choices_of_neighbouring_seeds_do_not_collide(server):
    """Choice 1 under seed s and choice 0 under seed s + 1: different texts (each choice's stream comes from
    (seed, index); seed + index would give them one stream)."""
    kw = dict(model="gpt2", prompt="A", max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    second = server.client.completions.create(n=2, seed=3, **kw).choices[1].text
    assert second != server.client.completions.create(n=1, seed=4, **kw).choices[0].text


def test_every_request_leaves_a_log_line_refused_ones_too(server):
    """docs/serving.md: one line per request, with its status (AccessLog), whatever the status."""
    marks = {"/nowhere-404": 404, "/v1/completions": 400}
    httpx.get(f"{server.url}/nowhere-404", timeout=60)
    assert httpx.get(f"{server.url}/v1/completions", timeout=60).status_code == 405
    server.post("/v1/completions", {"prompt": "x", "max_tokens": -5})
    for path, status in marks.items():  # (a line is written once its response has gone)
        wait_until(lambda: server.log_lines(f" {path} {status} "), f"the log line of {path}", 30)
    assert server.log_lines("GET /v1/completions 405")


@pytest.mark.slow
def test_random_weights_say_so(tmp_path):
    """Without --model or $GPT2NUMBA_WEIGHTS the server runs random GPT-2 small: its output and /v1/models say
    so, not "gpt2"."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "server.log"
    process = subprocess.Popen([sys.executable, "-m", "gpt2numba", "serve", "--port", str(port)],
                               stdout=log.open("w"), stderr=subprocess.STDOUT,
                               env={k: v for k, v in os.environ.items() if k != "GPT2NUMBA_WEIGHTS"})
    try:
        def up():
            assert process.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False
        wait_until(up, "the server")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60).json()
        assert [m["id"] for m in models["data"]] == ["random-gpt2-small"]
        assert "random GPT-2 small weights (seed 0)" in log.read_text() and "serving random-gpt2-small" in log.read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def test_models_health_tokenize_detokenize(server, local):
    _, tok = local
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["model"]
    ids = server.post("/tokenize", {"content": "Hello, world"}).json()["tokens"]
    assert ids == tok.encode("Hello, world")
    assert server.post("/detokenize", {"tokens": ids}).json()["content"] == "Hello, world"
    assert server.post("/tokenize", {"prompt": "Hello, world"}).json()["tokens"] == ids  # as vLLM's
    assert server.post("/detokenize", {"tokens": [50257]}).status_code == 400
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_metrics_need_no_key_and_parse(server):
    """GET /metrics answers without the key, as /health does, in Prometheus' text format as prometheus-client
    reads it, and a 401 just sent is in it. (The exact sums: tests/test_serve_metrics.py, in-process.)"""
    parser = pytest.importorskip("prometheus_client.parser")
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, key="wrong").status_code == 401
    r = httpx.get(f"{server.url}/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    found = {f.name: f for f in parser.text_string_to_metric_families(r.text)}
    assert {"gpt2numba_requests", "gpt2numba_time_to_first_token_seconds", "gpt2numba_num_requests_waiting",
            "process_resident_memory_bytes"} <= set(found), sorted(found)
    assert any(s.labels == {"status": "401"} and s.value >= 1 for s in found["gpt2numba_requests"].samples)


def test_sigterm_stops_cleanly_with_a_stream_in_flight(tmp_path):
    s = Server(tmp_path, "--shutdown-grace", "600")  # the stream must finish within the grace, however busy the machine
    with httpx.stream("POST", f"{s.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "z", "max_tokens": 120, "stream": True, "ignore_eos": True}, timeout=600) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        s.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]  # uvicorn lets a request in flight finish
    # uvicorn re-raises the signal once it has shut down, so the exit is the signal's, as for any process
    assert s.process.wait(300) in (0, -signal.SIGTERM), s.log.read_text()
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    log = s.log.read_text()
    assert "Application shutdown complete" in log and "Traceback" not in log


def test_lm_eval_local_completions(server, tmp_path):
    """lm-evaluation-harness's local-completions model against the server, with its remote tokenizer: the
    same numbers, sample by sample, as its gpt2numba model in-process (tests/test_harness.py's tasks)."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (the test extra)")
    from lm_eval.tasks import TaskManager
    from test_harness import write_tasks

    import gpt2numba.harness  # noqa: F401  (registers "gpt2numba")

    write_tasks(tmp_path)
    tasks, manager = ["gn_mc", "gn_ppl", "gn_gen"], TaskManager(include_path=str(tmp_path), include_defaults=False)
    remote = lm_eval.simple_evaluate(
        model="local-completions", tasks=tasks, task_manager=manager, log_samples=True,
        model_args={"base_url": f"{server.url}/v1/completions", "model": "model", "tokenizer_backend": "remote",
                    "auth_token": KEY, "header": {"Authorization": f"Bearer {KEY}"}, "tokenized_requests": True,
                    "max_length": CONFIG.n_positions, "num_concurrent": 4, "max_retries": 1,
                    "timeout": 900})  # seconds for each request, and the remote tokenizer's: CI shares its machine
    # the API model keeps a position for the token it asks to generate, and its rolling windows are one
    # shorter still: n_positions - 2 tokens. The in-process model gets the same windows
    local = lm_eval.simple_evaluate(model="gpt2numba", tasks=tasks,
                                    model_args=f"model={server.model},max_length={CONFIG.n_positions - 2}",
                                    task_manager=manager, log_samples=True)
    for task in tasks:
        ours, theirs = (sorted(out["samples"][task], key=lambda s: s["doc_id"]) for out in (local, remote))
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs):
            for x, y in zip(a["resps"], b["resps"]):
                x, y = np.array(x[0], dtype=object).ravel(), np.array(y[0], dtype=object).ravel()
                assert [type(v) for v in x] == [type(v) for v in y]
                for u, v in zip(x, y):
                    assert u == (pytest.approx(v, abs=1e-3) if isinstance(v, float) else v), (task, a["doc_id"])


def test_an_engine_failure_fails_one_request_and_the_server_goes_on(monkeypatch):
    """In-process (Starlette's TestClient): a request whose work raises gets a 500 in OpenAI's shape, and the
    engine thread lives on for the next."""
    from starlette.testclient import TestClient

    from gpt2numba import serve

    def broken(self, ids, k, into=None):
        raise RuntimeError("planted")

    monkeypatch.setattr(serve.logprobs.Logprobs, "prompt", broken)
    w = g.random_weights(CONFIG, seed=5)
    with TestClient(serve.create_app(w, g.load_tokenizer(), max_batch=2)) as client:
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "echo": True, "logprobs": 1})
        assert r.status_code == 500 and "planted" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_echo_runs_the_prompt_once_for_the_n_choices(monkeypatch):
    """With one place in the batch, the n choices of an echoed prompt start in different steps. The prompt runs
    once: the pass that gives its log-probabilities, whose cache the choices go on from (the batch runs none
    of its rows). Every choice begins with the echo and goes on as it would without it."""
    from starlette.testclient import TestClient

    from gpt2numba import serve
    from gpt2numba.decoding import batching

    calls, fed = [], []
    prompt, prefill_batch = serve.logprobs.Logprobs.prompt, batching.prefill_batch

    def counted(self, ids, k, into=None):
        calls.append(len(ids))
        return prompt(self, ids, k, into)

    def rows(prompts, *args, **kwargs):
        fed.append([len(p) for p in prompts])
        return prefill_batch(prompts, *args, **kwargs)

    monkeypatch.setattr(serve.logprobs.Logprobs, "prompt", counted)
    monkeypatch.setattr(batching, "prefill_batch", rows)
    body = {"prompt": "Echo me", "max_tokens": 3, "n": 3, "logprobs": 1, "temperature": 0, "ignore_eos": True}
    w = g.random_weights(CONFIG, seed=5)
    with TestClient(serve.create_app(w, g.load_tokenizer(), max_batch=1)) as client:
        fed.clear()  # (the engine's warm-up, which ran before the app started, is not counted)
        echoed = client.post("/v1/completions", json={**body, "echo": True}).json()
        n_prompt = len(g.load_tokenizer().encode("Echo me"))
        assert calls == [n_prompt] and fed and all(step == [1] for step in fed)  # decode rows only
        plain = client.post("/v1/completions", json=body).json()
    assert len(echoed["choices"]) == len(plain["choices"]) == 3
    assert len({tuple(c["logprobs"]["token_logprobs"][:n_prompt]) for c in echoed["choices"]}) == 1
    for e, p in zip(echoed["choices"], plain["choices"]):
        assert e["text"] == "Echo me" + p["text"]
        assert e["logprobs"]["tokens"][n_prompt:] == p["logprobs"]["tokens"]
        assert e["logprobs"]["token_logprobs"][n_prompt:] == pytest.approx(p["logprobs"]["token_logprobs"], abs=1e-5)


def test_the_start_says_which_row_thresholds_serve(caplog):
    """serve does not tune on its start (docs/performance.md, "Tuned on this machine"): it logs the thresholds it
    takes, and where they came from, so that an operator sees whether `gpt2numba tune` ran on this machine."""
    from starlette.testclient import TestClient

    from gpt2numba import serve

    w = g.random_weights(CONFIG, seed=5)
    with caplog.at_level("INFO", logger="gpt2numba"), TestClient(serve.create_app(w, g.load_tokenizer(), max_batch=1)):
        pass
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("row thresholds: ")]
    assert len(said) == 1 and "rows_max" in said[0] and "`gpt2numba tune` measures them" in said[0]
