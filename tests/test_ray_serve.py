"""The server's replicas on Ray Serve (a local cluster of 2 CPUs, one replica, started once for the module): the
openai client gets the answers of the server in-process, streams too; /metrics is the replica's; a replica killed
mid-request fails its requests at once (a bounded client timeout would catch a hang) and the next request is
served by the replica Ray Serve puts in its place."""

import dataclasses
import socket
import threading
import time

import pytest

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY_GPT2

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e \".[ray]\")")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e \".[ray]\")")
openai = pytest.importorskip("openai", reason="the server's tests need the openai client (the test extra)")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette", reason="the server needs the [serve] extra")
from starlette.testclient import TestClient  # noqa: E402

from gpt2numba.serve import create_app  # noqa: E402
from gpt2numba.serve.ray import deployment  # noqa: E402

CONFIG = dataclasses.replace(TINY_GPT2, n_positions=128)
MAX_BATCH = 4
WAIT_S = 300  # a replica's start (the weights, the kernels from Numba's cache) on a busy 2-core machine


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model path, the proxy's URL): one replica of 1 thread, checked by Ray Serve every second (so that a
    dead one is replaced within seconds, not the default 10)."""
    path = tmp_path_factory.mktemp("ray_serve") / "model"
    write_dir(g.random_weights(CONFIG, seed=5), path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(str(path), replicas=1, threads=1, max_batch=MAX_BATCH,
                             options={"health_check_period_s": 1}), name="gpt2numba", route_prefix="/")
        yield path, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str, timeout: float = 120):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)


def answer(completion) -> list[tuple]:
    """A completion's choices as (index, text, finish_reason, tokens, their log-probabilities)."""
    return [(c.index, c.text, c.finish_reason, c.logprobs.tokens, c.logprobs.token_logprobs)
            for c in completion.choices]


def streamed(chunks) -> dict[int, tuple[str, str | None]]:
    """A stream's text and finish_reason by choice index."""
    out: dict[int, list] = {}
    for chunk in chunks:
        for c in chunk.choices:
            text, reason = out.setdefault(c.index, ["", None])
            out[c.index] = [text + c.text, c.finish_reason or reason]
    return {i: tuple(v) for i, v in out.items()}


@pytest.mark.slow
def test_a_replica_answers_as_the_server_in_process(served):
    """The same seeded request (2 prompts, 2 choices each, log-probabilities) to the replica through Ray Serve's
    proxy and to create_app's server in this process: the same choices, and the same streamed text; GET /metrics
    answers with the replica's registry (named by X-Replica) and counts the requests it answered."""
    path, url = served
    request = dict(model="model", prompt=["Hello world", "Once upon a time"], max_tokens=12, n=2, seed=7,
                   temperature=0.8, logprobs=1)
    remote = client(url)
    app = create_app(g.load_weights(path), g.load_tokenizer(path), model_name="model", max_batch=MAX_BATCH)
    with TestClient(app) as local_http:
        local = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=local_http)
        expected = local.completions.create(**request)
        assert answer(remote.completions.create(**request)) == answer(expected)
        assert remote.completions.create(**request).usage == expected.usage
        stream = dict(request, logprobs=None, stream=True)
        assert streamed(remote.completions.create(**stream)) == streamed(local.completions.create(**stream))
    metrics = httpx.get(f"{url}/metrics", timeout=60)
    assert metrics.status_code == 200 and metrics.headers["x-replica"].startswith("SERVE_REPLICA::gpt2numba#")
    answered = next(line for line in metrics.text.splitlines() if line.startswith('gpt2numba_requests_total{status="200"}'))
    assert float(answered.split()[-1]) >= 3


def test_deployment_refuses_bad_settings():
    """Settings are checked where deployment() is called, before Ray Serve starts anything: create_app's own
    checks, the serve command's ranges, and the uvicorn settings that Ray Serve's proxy owns."""
    for kwargs, match in [({"replicas": 0}, "replicas"), ({"threads": 0}, "threads"), ({"max_batch": 0}, "max_batch"),
                          ({"dtype": "int3"}, "dtype"), ({"kv_dtype": "int8"}, "cache's dtype"),
                          ({"activations": "float16"}, "activations must be one of"),
                          ({"api_key": " "}, "API key"), ({"max_step_tokens": 0}, "max_step_tokens"),
                          ({"max_choices": 8, "max_queued_choices": 4}, "max_queued_choices"),
                          ({"port": 8000}, "port is the HTTP proxy's"), ({"max_batchs": 4}, "max_batchs"),
                          ({"options": {"num_replicas": 2}}, "num_replicas")]:
        with pytest.raises(g.ConfigError, match=match):
            deployment(None, **kwargs)


@pytest.mark.slow
def test_a_replica_killed_mid_request_fails_it_and_the_next_request_is_served(served):
    """Two long requests under way on the replica (a response and a stream, 128 and 64 choices through 4 places);
    the replica's actor is killed after the stream's first tokens: the stream ends in a connection error, the
    response in a 500, both at once (each client's timeout is 60 s); the next request waits for the new replica
    and gets its answer from it."""
    _, url = served
    replica = httpx.get(f"{url}/health", timeout=WAIT_S).headers["x-replica"]
    long = dict(model="model", max_tokens=60, n=4, temperature=1.0, extra_body={"ignore_eos": True})
    failed = {}

    def respond():
        try:
            client(url, timeout=60).completions.create(prompt=["Hello"] * 32, **long)
        except Exception as e:  # what the client saw
            failed["response"] = e
    responding = threading.Thread(target=respond)
    responding.start()
    for _ in range(3000):  # until the response's choices are in the replica's batch
        if httpx.get(f"{url}/health", timeout=60).json()["active"] > 0:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the first request never started")
    chunks = iter(client(url, timeout=60).completions.create(prompt=["Once"] * 16, stream=True, **long))
    next(chunks)  # under way
    ray.kill(ray.get_actor(replica, namespace="serve"))
    with pytest.raises(openai.APIConnectionError):
        for _ in chunks:
            pass
    responding.join(120)
    assert not responding.is_alive() and isinstance(failed.get("response"), openai.InternalServerError)

    after = client(url, timeout=WAIT_S).completions.create(model="model", prompt="Hello", max_tokens=4)
    assert len(after.choices) == 1 and after.choices[0].finish_reason in ("length", "stop")
    assert httpx.get(f"{url}/health", timeout=60).headers["x-replica"] != replica
