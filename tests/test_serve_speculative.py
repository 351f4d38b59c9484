"""Speculative decoding in the server (issue 57): --draft, --num-speculative-tokens, --prompt-lookup. In-process
(Starlette's TestClient): every answer is the one a server without a draft gives, token by token, with stop strings
and log-probabilities; /metrics counts what was drafted and kept."""

import concurrent.futures
import dataclasses
import json

import pytest

import gpt2numba as g
from conftest import TINY_GPT2

pytest.importorskip("starlette", reason="the server needs the [serve] extra")

from starlette.testclient import TestClient  # noqa: E402

from gpt2numba import serve  # noqa: E402
from gpt2numba.serve.config import ServeConfig  # noqa: E402
from test_serve_metrics import families, value  # noqa: E402

CONFIG = dataclasses.replace(TINY_GPT2, n_positions=128)
REQUESTS = [
    {"prompt": [464, 3290, 286], "max_tokens": 24, "temperature": 0, "logprobs": 2},
    {"prompt": "The cat", "max_tokens": 30, "temperature": 0, "n": 1, "echo": True},
    {"prompt": [11, 12, 13, 11, 12], "max_tokens": 20, "temperature": 0, "stream": True},
    {"prompt": ["a b", "c d e"], "max_tokens": 16, "temperature": 0, "logprobs": 0},
]


@pytest.fixture(scope="module")
def model():
    return g.random_weights(CONFIG, seed=5), g.load_tokenizer()


def answers(model, requests, **settings):
    """Each request's choices (text, finish reason, tokens' log-probabilities) from a server with ``settings``,
    all sent at once (their tokens share steps), and the server's /metrics."""
    w, tok = model
    app = serve.create_app(w, tok, max_batch=4, **settings)
    with TestClient(app) as client:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            replies = list(pool.map(lambda body: client.post("/v1/completions", json=body), requests))
        metrics = families(client.get("/metrics").text)
    out = []
    for body, r in zip(requests, replies):
        assert r.status_code == 200, r.text
        if body.get("stream"):
            out.append(r.text)  # the events, in order
        else:
            out.append([(c["text"], c["finish_reason"], c["logprobs"]) for c in r.json()["choices"]])
    return out, metrics


@pytest.mark.parametrize("settings", [{"draft": "int4", "num_speculative_tokens": 3}, {"draft": "int8"},
                                      {"prompt_lookup": 4}])
def test_greedy_answers_are_a_plain_servers(model, settings):
    """Texts, finish reasons, log-probabilities and stream events equal a plain server's (the events' ids and
    times aside); the drafts were checked (/metrics' counters move, kept <= drafted)."""
    plain, plain_metrics = answers(model, REQUESTS)
    fast, metrics = answers(model, REQUESTS, **settings)
    for p, f, body in zip(plain, fast, REQUESTS):
        if body.get("stream"):
            assert [_text_of(line) for line in p.splitlines()] == [_text_of(line) for line in f.splitlines()]
        else:
            assert _same(p, f), (body, p, f)
    assert not [name for name in plain_metrics if "spec_decode" in name]
    drafted = value(metrics, "gpt2numba_spec_decode_num_draft_tokens", "gpt2numba_spec_decode_num_draft_tokens_total")
    kept = value(metrics, "gpt2numba_spec_decode_num_accepted_tokens",
                 "gpt2numba_spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 <= kept <= drafted
    assert value(metrics, "gpt2numba_generation_tokens", "gpt2numba_generation_tokens_total") == \
        value(plain_metrics, "gpt2numba_generation_tokens", "gpt2numba_generation_tokens_total")


def _text_of(line: str):
    """A stream event's text and finish reason (not its id or time)."""
    if not line.startswith("data:") or line == "data: [DONE]":
        return line
    choice = json.loads(line[5:])["choices"][0]
    return choice["text"], choice["finish_reason"]


def _same(a, b) -> bool:
    """Choices equal but for log-probabilities within 1e-4 (a pass over several rows rounds otherwise than one's)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_a_stop_string_ends_the_text_among_kept_drafts(model):
    """A stop string met at the first of several tokens a step keeps: the text ends there, as a plain server's,
    and the tokens after it are neither sent nor counted."""
    w, tok = model
    body = {"prompt": [11, 12, 13, 11, 12], "max_tokens": 40, "temperature": 0}
    text = answers(model, [body])[0][0][0][0]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    plain, plain_metrics = answers(model, [dict(body, stop=[stop])])
    fast, metrics = answers(model, [dict(body, stop=[stop])], prompt_lookup=8)
    assert _same(plain, fast) and plain[0][0][1] == "stop"
    name = "gpt2numba_generation_tokens"
    assert value(metrics, name, name + "_total") == value(plain_metrics, name, name + "_total")


def test_a_constrained_request_beside_drafting_ones(model):
    """A request with a constraint does not draft (speculative decoding does not take one yet); the others beside
    it do, and every answer is a plain server's."""
    pytest.importorskip("llguidance", reason="structured output needs the [structured] extra")
    requests = [{"prompt": "x", "max_tokens": 12, "temperature": 0, "guided_regex": "[ab]{3,8}"}, REQUESTS[0]]
    assert _same(answers(model, requests)[0], answers(model, requests, draft="int8")[0])


@pytest.mark.parametrize("settings, message", [
    ({"num_speculative_tokens": 3}, "num_speculative_tokens=3 needs a draft"),
    ({"draft": "int4", "prompt_lookup": 3}, "not both"),
    ({"draft": 4}, "draft must be one of"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(g.ConfigError, match=message):
        ServeConfig(**settings)


def test_a_draft_checkpoint_of_another_vocabulary_is_refused(model, tmp_path):
    g.save_weights(g.random_weights(dataclasses.replace(CONFIG, vocab_size=512)), tmp_path / "draft")
    with pytest.raises(g.ConfigError, match="the draft's vocabulary has 512 tokens, the model's 50257"):
        serve.create_app(*model, draft=str(tmp_path / "draft"))
