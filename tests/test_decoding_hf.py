"""transformers' own generate on the same checkpoint gives the same tokens: greedy with the new settings, and
beam search (hypotheses, order and scores), over seeded random prompts and settings. Runs where torch and
transformers are installed (tox's `hf` env, which .ci/run runs)."""

import numpy as np
import pytest

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TIE = 1e-5  # two candidates' scores this close may come out in either order (float32 sums in transformers)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    w = g.random_weights(TINY, seed=11)
    path = tmp_path_factory.mktemp("hf")
    write_dir(w, path, layout="transformers")
    return w, transformers.GPT2LMHeadModel.from_pretrained(str(path)).eval()


def theirs(model, prompt, **settings):
    """transformers' generate: the new ids of each returned sequence (padding dropped), and the beam scores."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, return_dict_in_generate=True, output_scores=True,
                             pad_token_id=-1, **settings)
    sequences = [[t for t in s[len(prompt):].tolist() if t != -1] for s in out.sequences]
    return sequences, getattr(out, "sequences_scores", None)


def random_settings(rng, beams: bool) -> dict:
    settings = dict(max_new_tokens=int(rng.integers(1, 14)), no_repeat_ngram_size=int(rng.integers(0, 4)),
                    repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])), min_new_tokens=int(rng.integers(0, 5)),
                    eos_token_id=rng.integers(0, TINY.vocab_size, int(rng.integers(1, 3))).tolist(),
                    bad_words_ids=[rng.integers(0, TINY.vocab_size, int(rng.integers(1, 3))).tolist()
                                   for _ in range(4)])
    if beams:
        settings.update(num_beams=int(rng.integers(2, 6)), length_penalty=float(rng.choice([1.0, 0.5, 2.0, -1.0])),
                        early_stopping=[True, False, "never"][int(rng.integers(0, 3))])
        settings["num_return_sequences"] = int(rng.integers(1, settings["num_beams"] + 1))
    return settings


def test_greedy_with_every_setting_is_transformers(models):
    """40 seeded prompts, each with random processors' settings: the same tokens, the same stop. Where the
    tokens part, the two best processed logits there are within TIE (none in the seeded set so far)."""
    w, model = models
    rng = np.random.default_rng(0)
    ties = 0
    for _ in range(40):
        prompt = rng.integers(0, TINY.vocab_size, int(rng.integers(1, 12))).tolist()
        settings = random_settings(rng, beams=False)
        ours = list(g.generate(prompt, w, temperature=0, **settings))
        (expected,), _ = theirs(model, prompt, **settings)
        if ours != expected:
            at = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), min(len(ours), len(expected)))
            assert at < min(len(ours), len(expected)), (prompt, settings, ours, expected)  # one stopped early
            z = g.Sampler(0, **{k: v for k, v in settings.items() if k != "max_new_tokens"}).processors(
                g.recompute_logits(prompt + ours[:at], w), prompt + ours[:at], len(prompt))
            assert abs(z[ours[at]] - z[expected[at]]) < TIE, (prompt, settings, ours, expected)
            ties += 1
    assert ties <= 2


def test_beam_search_is_transformers(models):
    """60 seeded prompts and settings (beams, length penalty, early stopping, returned sequences, the
    processors): the same hypotheses in the same order, their scores within 1e-4 of transformers'
    sequences_scores; where a hypothesis differs, its score ties with theirs (TIE)."""
    w, model = models
    rng = np.random.default_rng(1)
    ties = 0
    for _ in range(60):
        prompt = rng.integers(0, TINY.vocab_size, int(rng.integers(1, 12))).tolist()
        settings = random_settings(rng, beams=True)
        ours = g.beam_search(prompt, w, **settings)
        expected, scores = theirs(model, prompt, **settings)
        np.testing.assert_allclose([h.score for h in ours], scores.numpy(), atol=1e-4)
        if [h.ids for h in ours] != expected:
            assert np.allclose([h.score for h in ours], scores.numpy(), atol=TIE), (prompt, settings)
            ties += 1
    assert ties <= 3
