"""The server against a careless or hostile client (issue 20): bounded work per request, fair admission,
memory freed when a client leaves, read deadlines and a cap on connections, malformed JSON, a shutdown
that answers everyone, and the API key. Each test names the defect it catches. The figures (RSS, /health's
latency, GPT-2 small) are profiling/serve_abuse.py's; nothing here is timed."""

import concurrent.futures
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

import gpt2numba as g
from helpers import counted_step, hold_after_first_step
from test_serve import CONFIG, KEY, Server, wait_until

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette", reason="the server needs the [serve] extra")

AUTH = {"Authorization": f"Bearer {KEY}"}
# One request of 64 choices of 127 tokens, one place in the batch: 8,128 steps, the others wait behind it
LIMITS = ("--max-batch", "1", "--max-choices", "64", "--max-queued-choices", "100", "--max-response-mb", "1")
LONG = {"prompt": "y", "max_tokens": CONFIG.n_positions - 1, "n": 64, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("limited"), *LIMITS)
    yield s
    s.stop()


@contextlib.contextmanager
def long_request(server):
    """The batch held by LONG (streamed, never read); the context waits until it holds the batch."""
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json=LONG, timeout=300) as held:
        wait_until(lambda: server.health() == {"status": "ok", "active": 1, "queued": 1}, "the long request")
        yield held
    wait_until(lambda: server.health() == {"status": "ok", "active": 0, "queued": 0}, "an idle server")


def test_choices_per_request_are_limited(limited):
    """prompts x n over --max-choices: 400 naming the flag (was: any number of prompts, 640,000 choices)."""
    r = limited.post("/v1/completions", {"prompt": [[1]] * 13, "n": 5, "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "65 choices" in error["message"] and "--max-choices" in error["message"] and error["param"] == "n"
    assert limited.post("/v1/completions", {"prompt": [[1]] * 16, "n": 4, "max_tokens": 1}).status_code == 200


def test_the_response_size_is_limited(limited):
    """echo + logprobs + n: a response over --max-response-mb is refused before any work (was: 78 MB from a
    2 KB request)."""
    r = limited.post("/v1/completions", {"prompt": list(range(100)), "n": 64, "max_tokens": 20, "echo": True,
                                         "logprobs": 20})
    assert r.status_code == 400 and "--max-response-mb" in r.json()["error"]["message"], r.text
    assert limited.post("/v1/completions", {"prompt": list(range(100)), "max_tokens": 0, "echo": True,
                                            "logprobs": 20}).status_code == 200


def test_queued_choices_are_limited(limited):
    """Choices waiting over --max-queued-choices: 503 with Retry-After naming the flag (was: --max-queue counted
    requests, whatever their choices)."""
    with long_request(limited):  # 63 of its choices wait
        r = limited.post("/v1/completions", {"prompt": "x", "n": 64, "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert "--max-queued-choices" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"


def test_a_small_request_is_not_starved_by_a_large_one(limited):
    """Round-robin admission: a request of one choice sent behind one of 64 starts at the next free place
    and ends while most of the large one still waits (first-in first-out: after all 64)."""
    with long_request(limited):
        r = limited.post("/v1/completions", {"prompt": "small", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert limited.health()["queued"] == 1  # the large one still has choices waiting


def test_malformed_json_gets_a_400_error_object(limited):
    """Deep nesting and a lone surrogate (was: a plain-text 500, and the connection dropped)."""
    bodies = [b"[" * 100_000 + b"]" * 100_000, b'{"\\ud800": 1}', b'{"prompt": "x", "\\udfff": [[[[[1]]]]]}',
              b'{"prompt": ' * 50_000]
    with httpx.Client(base_url=limited.url, headers=AUTH, timeout=300) as client:
        for body in bodies:
            r = client.post("/v1/completions", content=body)
            assert r.status_code == 400, (body[:20], r.text)
            assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
        for body in bodies[:2]:  # and the other routes
            r = client.post("/tokenize", content=body)
            assert r.status_code == 400 and r.json()["error"]["message"], r.text
        r = client.post("/v1/completions", content=b'{"prompt": "\\ud800 lone", "max_tokens": 1}')
        assert r.status_code in (200, 400) and r.json(), r.text


def test_a_client_that_leaves_leaves_nothing_behind(monkeypatch):
    """In-process, with the garbage collector off: once streams leave after two events and the server is
    idle, no job and no cache of theirs is alive (was: a reference cycle through the cancellation's
    traceback kept each job and its caches until a full collection, and the engine thread's loop
    variables kept the last step's caches)."""
    import uvicorn

    from gpt2numba.decoding.batching import Batch
    from gpt2numba.serve import create_app, engine

    alive = []  # weak references to every job and every sequence's cache
    job_init, batch_add = engine.Job.__init__, Batch.add

    def job(self, *args):
        job_init(self, *args)
        alive.append(weakref.ref(self))

    def add(self, *args, **kwargs):
        sequence = batch_add(self, *args, **kwargs)
        alive.append(weakref.ref(sequence.cache))
        return sequence

    monkeypatch.setattr(engine.Job, "__init__", job)
    monkeypatch.setattr(Batch, "add", add)
    app = create_app(g.random_weights(CONFIG, seed=5), g.load_tokenizer(), max_batch=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    gc.disable()
    try:
        wait_until(lambda: server.started, "the server")
        for i in range(6):
            body = {"prompt": f"leave {i}", "max_tokens": 120, "n": 1 + i % 2, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300) as r:
                events = (line for line in r.iter_lines() if line.startswith("data:"))
                next(events), next(events)
        engine_ = app.state.engine
        wait_until(lambda: not engine_.busy and engine_.active == 0, "an idle engine")
        wait_until(lambda: len(alive) >= 12 and all(ref() is None for ref in alive),
                   "every job and cache of the streams that left to be freed, without a garbage collection")
    finally:
        gc.enable()
        server.should_exit = True
        thread.join(300)


def raw(server, data: bytes = b"") -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=120)
    if data:
        s.sendall(data)
    return s


def closed_by_server(s: socket.socket) -> bool:
    """Waits (up to the socket's timeout) for the server to end the connection: True if it did."""
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:  # (closed with bytes unread: a reset)
        pass
    except socket.timeout:
        return False
    return True


def test_idle_connections_are_closed_and_cannot_lock_others_out(tmp_path):
    """Slowloris: 80 connections that send nothing, half a head, or a short body, against a cap of 30. A new
    client still gets /health and a completion (the connection idle longest makes room), and every idle
    one is closed by its deadline; the timeouts are logged once, not once per connection (was: no read
    deadline and no cap: 1,100 idle connections timed everyone out)."""
    s = Server(tmp_path, "--max-connections", "30", "--header-timeout", "2", "--body-timeout", "2")
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        idle = [raw(s, [b"", head, head + b"Content-Length: 100\r\n\r\n{\"pro"][i % 3]) for i in range(80)]
        assert httpx.get(f"{s.url}/health", timeout=300).json()["status"] == "ok"
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        assert all(closed_by_server(c) for c in idle)
        for c in idle:
            c.close()
        wait_until(lambda: s.log_lines("did not arrive within"), "the timeout's log line")
        assert len(s.log_lines("did not arrive within")) + len(s.log_lines("the one idle longest")) <= 3
        assert "Traceback" not in s.log.read_text()
    finally:
        assert s.stop() == 0


def test_connections_fit_the_open_file_limit(tmp_path):
    """With ulimit -n 256, --max-connections 1000 is cut to what fits (a warning, once), and 400
    connections neither exhaust the descriptors nor fill the log (was: "Too many open files" with a
    traceback for every accept, 444 MB in 95 s)."""
    s = Server(tmp_path, "--max-connections", "1000", open_files=256)
    try:
        assert len(s.log_lines("leaves room for")) == 1
        idle = [raw(s) for _ in range(400)]
        assert httpx.get(f"{s.url}/health", timeout=300).json()["status"] == "ok"
        assert sum(map(closed_by_server, idle[:300])) >= 300 - 256
        for c in idle:
            c.close()
        log = s.log.read_text()
        assert "Traceback" not in log and log.count("out of system resource") <= 1, log[-3000:]
    finally:
        assert s.stop() == 0


def sse(response) -> list[str]:
    return [line for line in response.iter_lines() if line]


def test_shutdown_answers_every_request_and_exits_0(tmp_path):
    """SIGTERM with two streams and a response under way (each of 64 long choices, one place in the batch)
    and no grace: each stream ends with an error event and [DONE], the response is a 503 error object, and
    the exit status is 0 (was: streams cut with neither, a plain-text 500, and the signal's status)."""
    s = Server(tmp_path, "--max-batch", "1", "--max-choices", "64", "--max-queued-choices", "256",
               "--shutdown-grace", "0")
    with contextlib.ExitStack() as stack, httpx.Client(base_url=s.url, headers=AUTH, timeout=300) as client:
        running = stack.enter_context(client.stream("POST", "/v1/completions", json=LONG))
        wait_until(lambda: s.health() == {"status": "ok", "active": 1, "queued": 1}, "the long request")
        waiting = stack.enter_context(client.stream("POST", "/v1/completions", json=LONG))
        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(1))
        answer = pool.submit(client.post, "/v1/completions", json={**LONG, "stream": False})
        wait_until(lambda: s.health()["queued"] == 3, "three requests under way")
        s.process.send_signal(signal.SIGTERM)
        for stream in (running, waiting):
            lines = sse(stream)
            assert lines[-1] == "data: [DONE]", lines[-3:]
            assert "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
        r = answer.result()
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
    assert s.process.wait(300) == 0, s.log.read_text()[-3000:]
    assert "Traceback" not in s.log.read_text()


def test_an_empty_api_key_is_refused(tmp_path):
    """--api-key "" (and an empty key file or variable) stops the server with an error (was: no authentication)."""
    model = tmp_path / "model"
    from checkpoints import write_dir

    write_dir(g.random_weights(CONFIG, seed=5), model)
    (tmp_path / "empty").write_text("\n")
    env = {**os.environ, "GPT2NUMBA_API_KEY": ""}
    for flags, environ in [(["--api-key", ""], None), (["--api-key-file", str(tmp_path / "empty")], None),
                           ([], env)]:
        done = subprocess.run([sys.executable, "-m", "gpt2numba", "serve", "--model", str(model), *flags],
                              capture_output=True, text=True, timeout=600, env=environ)
        assert done.returncode == 1 and "API key" in done.stderr and "empty" in done.stderr, (flags, done.stderr)
        assert done.stderr.startswith("gpt2numba: error:") and "Traceback" not in done.stderr, done.stderr
    from gpt2numba.serve import create_app

    with pytest.raises(ValueError, match="empty"):  # and in-process
        create_app(g.random_weights(CONFIG, seed=5), g.load_tokenizer(), api_key=" ")


@pytest.mark.parametrize("source", ["file", "environment"])
def test_the_api_key_from_a_file_or_the_environment(tmp_path, source):
    """The key need not be on the command line (visible in ps): --api-key-file or $GPT2NUMBA_API_KEY."""
    (tmp_path / "key").write_text(KEY + "\n")
    if source == "file":
        s = Server(tmp_path, key=("--api-key-file", str(tmp_path / "key")))
    else:
        s = Server(tmp_path, key=(), env={**os.environ, "GPT2NUMBA_API_KEY": KEY})
    try:
        assert s.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, key=None).status_code == 401
        assert s.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, key=KEY + "x").status_code == 401
        assert s.post("/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
    finally:
        s.stop()


async def job_events(job, *read, timeout: float = 300) -> list:
    """A job's events up to its last (Done or Failed), after ``read`` (the first ones, already taken)."""
    import asyncio

    from gpt2numba.serve import Done, Failed

    events = list(read)
    while not events or not isinstance(events[-1], (Done, Failed)):
        events.append(await asyncio.wait_for(job.events.get(), timeout))
    return events


def test_echo_is_serialised_once_for_the_n_choices():
    """The engine emits one serialised piece for an echoed prompt, the same object for each of its n
    choices: the response repeats its text, nothing computes or serialises it again (was: a dict per
    choice, serialised n times on the event loop)."""
    import asyncio

    from gpt2numba.serve import Engine, Job, Text, parse_completion

    w, tok = g.random_weights(CONFIG, seed=5), g.load_tokenizer()
    engine = Engine(w, tok, max_batch=2)
    engine.start()
    try:
        async def events():
            r = parse_completion({"prompt": ["one two", "three"], "n": 3, "echo": True, "logprobs": 2,
                                  "max_tokens": 1}, tok, CONFIG.n_positions, CONFIG.vocab_size)
            job = Job(r, asyncio.get_running_loop())
            engine.submit(job)
            return await job_events(job)

        out = asyncio.run(events())
    finally:
        engine.stop()
    echoed = {}  # choice -> the piece of its first Text event: the echo
    for event in out:
        if isinstance(event, Text):
            echoed.setdefault(event.choice, event.logprobs)
    assert sorted(echoed) == list(range(6))
    assert echoed[0] is echoed[1] is echoed[2] and echoed[3] is echoed[4] is echoed[5]
    assert isinstance(echoed[0].top_logprobs, str) and np.isfinite(json.loads(f"[{echoed[0].token_logprobs}]")[1])


def started_engine(max_batch: int, **defaults):
    """An engine over the tiny model, started, and a maker of its requests (each body over ``defaults``)."""
    from gpt2numba.serve import Engine, parse_completion

    w, tok = g.random_weights(CONFIG, seed=5), g.load_tokenizer()
    engine = Engine(w, tok, max_batch=max_batch)
    engine.start()

    def request(**body):
        body = {"prompt": "x", "ignore_eos": True, **defaults, **body}
        return parse_completion(body, tok, CONFIG.n_positions, CONFIG.vocab_size)
    return engine, request


def test_a_small_request_takes_a_place_from_a_large_one():
    """Every place of the batch held by one request: a request with nothing in flight pauses one of its
    choices (cache kept), ends within a few steps, and the paused choice goes on as if it had not paused
    (was: the small request waited for a place to free, 96x its time alone)."""
    import asyncio

    from gpt2numba.serve import Job, Text

    engine, request = started_engine(2, temperature=0)

    async def texts(job, *read):
        """Each choice's text, from the job's events (``read``: the first ones, already taken)."""
        by_choice = {}
        for event in await job_events(job, *read):
            if isinstance(event, Text):
                by_choice[event.choice] = by_choice.get(event.choice, "") + event.text
        return by_choice

    async def run():
        loop = asyncio.get_running_loop()
        alone, large, small = (Job(request(n=4, max_tokens=60), loop), Job(request(n=4, max_tokens=60), loop),
                               Job(request(prompt="small", max_tokens=2), loop))
        engine.submit(alone)
        alone = await texts(alone)
        engine.submit(large)
        first = await asyncio.wait_for(large.events.get(), 300)  # its first token: both places are its own
        engine.submit(small)
        await texts(small)
        events_then = large.events.qsize()  # (events come in step order: these, before the small one's end)
        return alone, await texts(large, first), events_then

    try:
        alone, large, events_then = asyncio.run(run())
    finally:
        engine.stop()
    assert engine.preemptions == 1
    assert events_then < 2 * 30  # a few steps of two places, not the 60 steps its first two choices take
    assert large == alone  # greedy: the same text, with a pause in one choice and without


def test_a_paused_choice_resumes_when_the_batch_empties(monkeypatch):
    """Two places, both held by one request's choices after its first step: a request of one token pauses
    one of them, and in the next step every sequence in the batch ends. The engine goes on with the paused
    choice (was: it slept with it, waiting for a request to come)."""
    import asyncio

    from gpt2numba.serve import Done, Job

    armed, stepped, go = hold_after_first_step(monkeypatch)
    engine, request = started_engine(2)
    armed.set()  # (after the engine's warm-up)

    async def run():
        loop = asyncio.get_running_loop()
        large, small = Job(request(n=2, max_tokens=2), loop), Job(request(max_tokens=1), loop)
        engine.submit(large)
        assert await asyncio.to_thread(stepped.wait, 600), "the large request's first step"
        engine.submit(small)
        go.set()
        return [(await job_events(job, timeout=60))[-1] for job in (small, large)]

    try:
        ends = asyncio.run(run())
    finally:
        go.set()
        engine.stop()
    assert ends == [Done(), Done()] and engine.preemptions == 1


def test_draining_fails_requests_not_started_and_finishes_the_others():
    """Shutdown's first step (Engine.drain): a request with no choice started gets 503 at once; one under
    way goes on to its end, its choices not yet started too (was: every request ran or waited until the
    grace ran out, then was cut)."""
    import asyncio

    from gpt2numba.serve import Done, Failed, Finish, Job

    engine, request = started_engine(1, max_tokens=100)

    async def run():
        loop = asyncio.get_running_loop()
        running = Job(request(n=2), loop)
        engine.submit(running)
        first = await asyncio.wait_for(running.events.get(), 300)  # its first choice has started
        waiting = Job(request(), loop)
        with engine._wake:  # (the engine's lock: it cannot start the new request between these two)
            engine.submit(waiting)
            engine.drain()
        refused = await asyncio.wait_for(waiting.events.get(), 300)
        return refused, await job_events(running, first)

    try:
        refused, events = asyncio.run(run())
    finally:
        engine.stop()
    assert isinstance(refused, Failed) and refused.status == 503 and "shutting down" in refused.message
    assert events[-1] == Done() and sum(e.tokens for e in events if isinstance(e, Finish)) == 200


def test_a_step_prefills_a_bounded_number_of_prompt_rows(monkeypatch):
    """Long prompts are prefilled --max-step-tokens rows a step beside decode rows (chunked), so the sequences
    in flight are not held up by one huge step, and IDLE_PROMPT_ROWS when nothing decodes, so the forward
    pass's workspace, sized by the largest step, stays small (was: 16 prompts of 1,000 tokens in one step,
    24 s and 490 MB kept)."""
    import asyncio

    from gpt2numba.decoding import batching
    from gpt2numba.serve import Done, Engine, Job, parse_completion

    prefilled = []  # (prompt rows fed, prompt rows to feed, whether a sequence decoded) of each step
    step = batching.Batch.step

    def counted(self, max_prompt_rows=None):
        out, counts = counted_step(step, self, max_prompt_rows)
        prefilled.append(counts)
        return out

    monkeypatch.setattr(batching.Batch, "step", counted)
    monkeypatch.setattr(batching, "IDLE_PROMPT_ROWS", 64)
    w, tok = g.random_weights(CONFIG, seed=5), g.load_tokenizer()
    engine = Engine(w, tok, max_batch=8, max_step_tokens=40)
    engine.start()
    prefilled.clear()  # (the warm-up's)

    async def run():
        body = {"prompt": [list(range(i, i + 30)) for i in range(6)] + [list(range(100))], "max_tokens": 3,
                "ignore_eos": True}
        job = Job(parse_completion(body, tok, CONFIG.n_positions, CONFIG.vocab_size), asyncio.get_running_loop())
        engine.submit(job)
        return await job_events(job)

    try:
        events = asyncio.run(run())
    finally:
        engine.stop()
    assert events[-1] == Done()
    assert sum(rows for rows, *_ in prefilled) == 6 * 30 + 100  # every prompt row once
    assert max(rows for rows, _, decoding in prefilled if decoding) == 40  # 40 a step beside decode rows
    assert max(rows for rows, *_ in prefilled) == 64  # and the idle bound when nothing decodes
