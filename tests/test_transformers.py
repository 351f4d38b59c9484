"""Hugging Face transformers' GPT-2, where installed: the same checkpoint gives the same logits.

An implementation nobody here wrote, run on files written in its own layout: agreement
with it checks the loader, the engine and the oracle against GPT-2 as it is used.
"""

import numpy as np
import pytest

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("layout", ["transformers", "openai"])
def test_same_logits_as_transformers(tmp_path, layout):
    w = g.random_weights(TINY, seed=11)
    write_dir(w, tmp_path, layout=layout)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    ours = g.load_weights(tmp_path)
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, 30)
    mc = g.ModelCache(ours.config)
    logits = [g.prefill(ids[:20], ours, mc)] + [g.decode_step(int(t), ours, mc) for t in ids[20:]]
    with torch.inference_mode():
        reference = theirs(torch.as_tensor(ids[None])).logits[0, 19:].numpy()
    np.testing.assert_allclose(np.array(logits), reference, atol=1e-4, rtol=1e-4)
