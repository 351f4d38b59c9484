"""POST /v1/completions' decoding fields (issue 38): OpenAI's logit_bias, presence_penalty, frequency_penalty and
best_of, and vLLM's top_k, min_p, repetition_penalty and min_tokens. In-process (Starlette's TestClient); each
answer is compared with the library's on the same weights (g.generate, g.generate_batch, g.score), token by
token, and each comparison is also checked to differ from what the server would give without the field."""

import dataclasses
import json

import numpy as np
import pytest

import gpt2numba as g
from conftest import TINY_GPT2

pytest.importorskip("starlette", reason="the server needs the [serve] extra")

from starlette.testclient import TestClient  # noqa: E402

from gpt2numba import serve  # noqa: E402

CONFIG = dataclasses.replace(TINY_GPT2, n_positions=128)
PROMPT = [464, 3290, 286]
EOT = 50256
MAX_CHOICES = 8


@pytest.fixture(scope="module")
def model():
    return g.random_weights(CONFIG, seed=5), g.load_tokenizer()


@pytest.fixture(scope="module")
def served(model):
    """(client, the list of jobs the engine was given): every request submitted is recorded."""
    w, tok = model
    app = serve.create_app(w, tok, max_batch=4, max_choices=MAX_CHOICES)
    engine, submitted = app.state.engine, []
    submit = engine.submit

    def recorded(job):
        submitted.append(job)
        submit(job)

    engine.submit = recorded
    with TestClient(app) as client:
        yield client, submitted


def complete(served, **body) -> dict:
    client, _ = served
    r = client.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, "logprobs": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def tokens_of(choice: dict) -> list[str]:
    return choice["logprobs"]["tokens"]


def texts(tok, ids) -> list[str]:
    """Each token's text, as the logprobs field lists them."""
    return [tok.decode([t]) for t in ids]


def library(w, max_new_tokens: int, **sampling) -> list[int]:
    return list(g.generate(PROMPT, w, max_new_tokens=max_new_tokens, stop_at_eos=False, **sampling))


@pytest.mark.parametrize("temperature", [0, 1])
def test_a_bias_of_100_forces_a_token(served, model, temperature):
    _, tok = model
    body = dict(max_tokens=6, temperature=temperature, seed=1)
    forced = 1234
    assert tokens_of(complete(served, **body)["choices"][0]) != texts(tok, [forced] * 6)  # not so without it
    biased = complete(served, **body, logit_bias={str(forced): 100})
    assert tokens_of(biased["choices"][0]) == texts(tok, [forced] * 6)


def test_a_bias_of_minus_100_bans_the_greedy_token(served, model):
    """The first token becomes the second most likely (by the library's logits), and the answer is the
    library's greedy one under the same bias: the token never comes."""
    w, tok = model
    logits = g.prefill(PROMPT, w, g.ModelCache(w.config))
    best, second = np.argsort(-logits.astype(np.float64), kind="stable")[:2]
    answer = tokens_of(complete(served, max_tokens=6, temperature=0, logit_bias={str(best): -100})["choices"][0])
    assert answer[0] == tok.decode([int(second)]) != tok.decode([int(best)])
    assert answer == texts(tok, library(w, 6, temperature=0, logit_bias={int(best): -100}))


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.5), (0, 2), (2, 0), (2, -0.5)])
def test_presence_and_frequency_penalties_are_the_samplers(served, model, presence, frequency):
    w, tok = model
    plain = texts(tok, library(w, 12, temperature=0))
    answer = complete(served, max_tokens=12, temperature=0, presence_penalty=presence,
                      frequency_penalty=frequency)
    assert tokens_of(answer["choices"][0]) == texts(tok, library(
        w, 12, temperature=0, presence_penalty=presence, frequency_penalty=frequency)) != plain


def test_vllms_top_k_min_p_repetition_penalty(served, model):
    """top_k 1 and min_p 1 sample the greedy token at temperature 1 (which, without them, samples other
    ones); repetition_penalty changes a greedy answer as the library's does; top_k -1 and 0 are none."""
    w, tok = model
    greedy = texts(tok, library(w, 8, temperature=0))
    sampled = tokens_of(complete(served, max_tokens=8, temperature=1, seed=2)["choices"][0])
    assert sampled != greedy
    for field in ({"top_k": 1}, {"min_p": 1}):
        assert tokens_of(complete(served, max_tokens=8, temperature=1, seed=2, **field)["choices"][0]) == greedy
    for top_k in (-1, 0):
        assert tokens_of(complete(served, max_tokens=8, temperature=1, seed=2, top_k=top_k)["choices"][0]) == sampled
    answers = {p: tokens_of(complete(served, max_tokens=8, temperature=0, repetition_penalty=p)["choices"][0])
               for p in (0.5, 1.5)}
    for penalty, answer in answers.items():
        assert answer == texts(tok, library(w, 8, temperature=0, repetition_penalty=penalty))
    assert any(answer != greedy for answer in answers.values())  # (one encourages the repeated token)


def test_min_tokens_holds_back_the_end(served, model):
    """With <|endoftext|> forced (bias 100) and eos honoured, min_tokens 5 gives 5 other tokens, then the end
    (6 tokens, "stop"), as the library's min_new_tokens; without it the end comes first. A stop string counts
    only after min_tokens tokens too (vLLM's)."""
    w, tok = model
    client, _ = served
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logit_bias": {str(EOT): 100}}
    plain = client.post("/v1/completions", json=body).json()
    assert plain["usage"]["completion_tokens"] == 1 and plain["choices"][0]["finish_reason"] == "stop"
    held = client.post("/v1/completions", json={**body, "min_tokens": 5}).json()
    expected = list(g.generate(PROMPT, w, max_new_tokens=10, temperature=0, logit_bias={EOT: 100}, min_new_tokens=5))
    assert expected[5:] == [EOT] and held["usage"]["completion_tokens"] == 6
    assert held["choices"][0]["text"] == tok.decode(expected[:5]) and held["choices"][0]["finish_reason"] == "stop"
    greedy = tok.decode(library(w, 8, temperature=0))  # a token repeated: its text is the stop
    stop = tok.decode(library(w, 1, temperature=0))
    assert greedy == stop * 8
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": stop, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == ""
    cut = client.post("/v1/completions", json={**body, "min_tokens": 3}).json()
    assert cut["choices"][0]["text"] == stop * 3 and cut["usage"]["completion_tokens"] == 4


def candidate_logprobs(w, max_tokens: int, best_of: int, seed: int, prompts: int = 1,
                       **sampling) -> list[tuple[float, list]]:
    """The server's best_of candidates of ``prompts`` times PROMPT as the library samples them (candidate j of
    prompt i is seeded [seed, i x best_of + j] in both), each with its cumulative log-probability by g.score
    (the model's own: whatever ``sampling`` does to the logits, not counted)."""
    candidates = [[] for _ in range(prompts * best_of)]
    for i, token in g.generate_batch([PROMPT] * prompts, w, max_new_tokens=max_tokens, temperature=1, seed=seed,
                                     n=best_of, **sampling):
        candidates[i].append(token)
    return [(float(g.score(PROMPT + c, w).logprobs[len(PROMPT) - 1:].sum()), c) for c in candidates]


@pytest.mark.parametrize("logprobs", [0, None])
def test_best_of_returns_the_n_most_likely_candidates(served, model, logprobs):
    """best_of 4, n 2: the two candidates of the highest cumulative log-probability (the model's log-softmax,
    not the biased logits they were sampled from), the higher first, and usage counts the tokens of all four.
    <|endoftext|>, made likely by a bias, ends them at different lengths, so that a sum of raw logits (about
    0 a token here, where a log-probability is about -10.8) ranks them otherwise. The seed is one whose best
    two are not the first two, nor the best two by raw logits."""
    w, tok = model
    sampling = {"stop_at_eos": True, "logit_bias": {EOT: 10}}
    scored = candidate_logprobs(w, 6, 4, seed=3, **sampling)
    ranked = sorted(range(4), key=lambda j: -scored[j][0])
    assert ranked[:2] != [0, 1] and scored[ranked[1]][0] - scored[ranked[2]][0] > 1e-3  # (no near tie)
    r = complete(served, max_tokens=6, temperature=1, seed=3, n=2, best_of=4, logprobs=logprobs, ignore_eos=False,
                 logit_bias={str(EOT): 10})
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["text"] for c in r["choices"]] == [tok.decode([t for t in scored[j][1] if t != EOT])
                                                 for j in ranked[:2]]
    lengths = [len(c) for _, c in scored]
    assert r["usage"]["completion_tokens"] == sum(lengths) != sum(lengths[j] for j in ranked[:2])
    if logprobs is not None:
        sums = [sum(c["logprobs"]["token_logprobs"]) for c in r["choices"]]
        np.testing.assert_allclose(sums, [scored[j][0] for j in ranked[:2]], atol=1e-4)
    else:
        assert all(c["logprobs"] is None for c in r["choices"])


def test_best_of_with_several_prompts_and_n_equal(served, model, monkeypatch):
    """Two prompts: each ranks its own candidates (choice i is prompt i // n), with echo too (each prompt's
    candidates share its one pass). best_of = n is plain n, and may stream."""
    w, tok = model
    client, _ = served
    r = complete(served, prompt=[PROMPT, PROMPT], max_tokens=4, temperature=1, seed=3, n=1, best_of=3,
                 logprobs=None)
    scored = candidate_logprobs(w, 4, 3, seed=3, prompts=2, stop_at_eos=False)
    best = [max(scored[3 * i: 3 * i + 3], key=lambda s: s[0])[1] for i in range(2)]
    assert best[0] != best[1] and [c["text"] for c in r["choices"]] == [tok.decode(b) for b in best]
    assert r["usage"]["completion_tokens"] == 2 * 3 * 4
    calls, prompt = [], serve.logprobs.Logprobs.prompt
    monkeypatch.setattr(serve.logprobs.Logprobs, "prompt", lambda *args, **kw: calls.append(1) or prompt(*args, **kw))
    echoed = complete(served, prompt=[PROMPT, PROMPT], max_tokens=4, temperature=1, seed=3, n=1, best_of=3,
                      logprobs=1, echo=True)
    assert [c["text"] for c in echoed["choices"]] == [tok.decode(PROMPT) + c["text"] for c in r["choices"]]
    assert len(calls) == 2  # once a prompt, for its three candidates
    same = complete(served, max_tokens=4, temperature=1, seed=3, n=2, logprobs=None)
    assert complete(served, max_tokens=4, temperature=1, seed=3, n=2, best_of=2, logprobs=None)["choices"] == \
        same["choices"]
    streamed = client.post("/v1/completions", json={"prompt": PROMPT, "n": 2, "best_of": 2, "stream": True})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"50257": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {" 12": 1}}, "logit_bias"),
    ({"logit_bias": {"": 1}}, "logit_bias"),
    ({"logit_bias": {"\uff11\uff12": 1}}, "logit_bias"),  # full-width digits
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {"12": 100.5}}, "logit_bias"),
    ({"logit_bias": {"12": -101}}, "logit_bias"),
    ({"logit_bias": {"12": "1"}}, "logit_bias"),
    ({"logit_bias": {"12": True}}, "logit_bias"),
    ({"logit_bias": {"12": float("inf")}}, "logit_bias"),
    ({"logit_bias": [12, 1]}, "logit_bias"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": 129}, "best_of"),
    ({"best_of": "2"}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"n": 1, "best_of": MAX_CHOICES + 1}, "best_of"),  # --max-choices counts the candidates
    ({"prompt": ["a", "b"], "n": 2, "best_of": MAX_CHOICES // 2 + 1}, "best_of"),  # (before tokenising)
    ({"prompt": [PROMPT, PROMPT], "best_of": MAX_CHOICES // 2 + 1}, "best_of"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # over max_tokens (16 by default)
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[f"{p}={list(b.values())[-1]!r:.20}" for b, p in BAD])
def test_bad_values_get_400_naming_the_field_before_any_work(served, body, param):
    client, submitted = served
    before = len(submitted)
    r = client.post("/v1/completions", content=json.dumps({"prompt": PROMPT, **body}),  # (NaN and Infinity too)
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"], error
    if param == "logit_bias" and isinstance(body["logit_bias"], dict):
        assert json.dumps(next(iter(body["logit_bias"])))[:10] in error["message"]  # which key
    assert len(submitted) == before  # refused before the engine saw it


def test_max_choices_counts_best_of_before_any_prompt_is_tokenised(served, monkeypatch):
    client, _ = served
    tokenised = []
    monkeypatch.setattr(serve.requests, "prompt_ids", lambda prompt, tokenizer: tokenised.append(prompt) or [1])
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "best_of": MAX_CHOICES // 2 + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    assert "--max-choices" in r.json()["error"]["message"] and tokenised == []


def test_the_edges_of_each_range_are_taken(served):
    client, submitted = served
    for body in ({"presence_penalty": -2, "frequency_penalty": 2}, {"logit_bias": {"0": -100, "50256": 100}},
                 {"logit_bias": {}}, {"top_k": 50257 * 2}, {"min_p": 0}, {"repetition_penalty": 1e-3},
                 {"min_tokens": 2, "max_tokens": 2}, {"n": 2, "best_of": MAX_CHOICES}):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body})
        assert r.status_code == 200, (body, r.text)


def test_best_of_is_bounded_as_n_is(model):
    """128 candidates a prompt at most, as n (whatever --max-choices allows)."""
    _, tok = model
    assert serve.parse_completion({"prompt": [1], "best_of": 128}, tok, 128, 50257).best_of == 128
    for field in ("n", "best_of"):
        with pytest.raises(serve.ApiError) as e:
            serve.parse_completion({"prompt": [1], field: 129}, tok, 128, 50257)
        assert e.value.param == field


@pytest.mark.parametrize("top_p", [0, 1.5, -1])
def test_top_p_out_of_range_names_one_range(served, top_p):
    """0 and 1.5 are refused in the same words: the range is (0, 1] either way."""
    client, _ = served
    r = client.post("/v1/completions", json={"prompt": PROMPT, "top_p": top_p})
    assert r.status_code == 400 and r.json()["error"]["message"] == f"top_p must be in (0, 1], got {top_p}"
