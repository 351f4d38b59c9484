"""--kv-cache-mb: the positions the sequences in flight may write, reserved as each starts. A choice that would
pass the bound waits in the queue until others leave; one that could never fit is refused (400)."""

import concurrent.futures

import numpy as np
import pytest

import gpt2numba as g
from conftest import TINY
from gpt2numba.decoding import batching, prefixes

pytest.importorskip("starlette", reason="the server needs the [serve] extra")

from starlette.testclient import TestClient  # noqa: E402

from gpt2numba import serve  # noqa: E402
from test_serve import CONFIG, KEY  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}


def greedy(logits, ids, rng, prompt_len):
    return int(np.argmax(logits))


def test_a_batch_reserves_what_its_sequences_may_write(tiny):
    """A sequence reserves its prompt and tokens, less what it reads in place (a prefix cache's blocks, a
    shared prompt another sequence runs); the reservation goes when it leaves, and a batch admits only what
    fits beside those reserved."""
    cache = prefixes.PrefixCache(TINY, 2**22)
    prompt = list(range(1, 2 * prefixes.BLOCK + 3))
    first = g.ModelCache(TINY)
    g.prefill(prompt, tiny, first)
    cache.store(prompt, first)
    batch = batching.Batch(tiny, 4, cache, max_positions=60)
    assert batch.need(prompt, 5) == len(prompt) - 2 * prefixes.BLOCK + 5  # its cached blocks are read in place
    shared = batching.SharedPrompt(2)
    lead = batch.add(prompt, max_new_tokens=5, sampler=greedy, rng=np.random.default_rng(0), shared=shared)
    assert batch.need(prompt, 5, shared) == 5  # the leader runs the prompt
    follower = batch.add(prompt, max_new_tokens=5, sampler=greedy, rng=np.random.default_rng(0), shared=shared)
    assert batch.reserved == (len(prompt) - 2 * prefixes.BLOCK + 5) + 5 == 12
    assert batch.need(list(range(100, 140)), 4) == 44 and batch.admits(60 - 12) and not batch.admits(60 - 12 + 1)
    while batch.sequences:
        batch.step()
        own, shared_positions = batch.positions()
        assert own <= batch.reserved
    assert batch.reserved == 0 and lead.cache is None and follower.cache is None


def test_a_choice_that_could_never_fit_is_refused():
    app = serve.create_app(g.random_weights(CONFIG, seed=5), g.load_tokenizer(), api_key=KEY, kv_cache_mb=0.05)
    positions = int(0.05 * 2**20) // g.ModelCache(CONFIG, 1).nbytes
    with TestClient(app) as client:
        r = client.post("/v1/completions", headers=AUTH, json={"prompt": [1] * 4, "max_tokens": positions - 3})
        assert r.status_code == 400 and "--kv-cache-mb" in r.json()["error"]["message"]
        r = client.post("/v1/completions", headers=AUTH, json={"prompt": [1] * 4, "max_tokens": positions - 4})
        assert r.status_code == 200


def test_choices_past_the_bound_wait_and_the_bound_holds(monkeypatch):
    """Room for one choice's positions at a time: four requests at once all finish, with the answers they get
    alone, and no step ever holds more reserved than the bound. Catches: a reservation not released (the
    second request would wait for ever: the test's time limit), admitting past the bound."""
    w = g.random_weights(CONFIG, seed=5)
    position = g.ModelCache(CONFIG, 1).nbytes
    app = serve.create_app(w, g.load_tokenizer(), api_key=KEY, kv_cache_mb=20 * position / 2**20, max_batch=4,
                           prefix_cache_mb=0)
    seen = []
    step = batching.Batch.step

    def watched(self, max_prompt_rows=None):
        seen.append((self.reserved, len(self.sequences)))
        return step(self, max_prompt_rows)
    monkeypatch.setattr(batching.Batch, "step", watched)
    bodies = [{"prompt": [10 + i] * 6, "max_tokens": 8, "temperature": 0, "ignore_eos": True} for i in range(4)]
    with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: client.post("/v1/completions", headers=AUTH, json=b), bodies))
    for body, r in zip(bodies, answers):
        assert r.status_code == 200
        alone = list(g.generate(body["prompt"], w, max_new_tokens=8, temperature=0, stop_at_eos=False))
        assert r.json()["choices"][0]["text"] == g.load_tokenizer().decode(alone)
    assert max(reserved for reserved, _ in seen) <= 20 and max(n for _, n in seen) == 1
