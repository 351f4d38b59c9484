"""CTranslate2 behind the benchmark's calls (gpt2numba bench --ct2 and --neighbour): a Generator on a model
converted from the same weights, its tokens the ids written out. Runs in a peer's worker, which never imports
gpt2numba (peers/__init__.py); ctranslate2 is in the [peers] extra."""

from __future__ import annotations

import time

import numpy as np

# tokens per score_batch batch: as many rows as gpt2numba's score_batch puts in one pass (scoring.BATCH_ROWS,
# which a test holds this to; imported, it would bring gpt2numba into the peer's process)
BATCH_TOKENS = 1024


def system(kind, model_dir, threads):
    """(system, "CTranslate2 KIND", version) for Remote: a Generator of compute type ``kind`` on a converted
    model; system and version are None when ctranslate2 is not installed."""
    try:
        import ctranslate2
    except ImportError:
        return None, f"CTranslate2 {kind}", None
    generator = ctranslate2.Generator(str(model_dir), device="cpu", compute_type=kind, intra_threads=threads,
                                      inter_threads=1)
    return CTranslate2(generator, threads), f"CTranslate2 {kind}", f"ctranslate2 {ctranslate2.__version__}"


def _tokens(ids) -> list[str]:
    return [str(int(i)) for i in ids]


class CTranslate2:
    """A ctranslate2.Generator behind the calls of the benchmark's gpt2numba worker (core.Ours)."""

    def __init__(self, generator, threads):
        self.generator, self._threads = generator, threads

    def threads(self):
        return self._threads

    def _generate(self, prompts, new_tokens, callback=None):
        """Greedy, no end token: new_tokens ids per prompt, the prompts forwarded at once."""
        results = self.generator.generate_batch([_tokens(ids) for ids in prompts], max_length=new_tokens,
                                                include_prompt_in_result=False, end_token=[], beam_size=1,
                                                callback=callback)
        return [r.sequences_ids[0] for r in results]

    def generate(self, job):
        """Greedy Generator.generate_batch of (prompts, new_tokens): tokens per prompt."""
        return self._generate(*job)

    def beam(self, job):
        """Generator.generate_batch with beam_size of (prompts, new_tokens, beams), no end token: the best
        hypothesis's tokens per prompt."""
        prompts, new_tokens, beams = job
        results = self.generator.generate_batch([_tokens(ids) for ids in prompts], max_length=new_tokens,
                                                include_prompt_in_result=False, end_token=[], beam_size=beams)
        return [r.sequences_ids[0] for r in results]

    def logprobs(self, docs):
        """log p of each token but the first, per document, from Generator.score_batch: float64 arrays."""
        results = self.generator.score_batch([_tokens(ids) for ids in docs], max_batch_size=BATCH_TOKENS,
                                             batch_type="tokens")
        return [np.asarray(r.log_probs, np.float64) for r in results]

    def score_docs(self, docs):
        """Many short documents: (tokens scored, nll per document)."""
        logprobs = self.logprobs(docs)
        return sum(len(lp) for lp in logprobs), [float(-lp.sum()) for lp in logprobs]

    def prefill(self, ids):
        """The prompt through the model with the head on its last row: CTranslate2's public API has no prefill
        alone, so it is a generate of one token (all but the last id forwarded at once, the last one as the
        decoding loop's first step). Returns that token."""
        return self._generate([ids], 1)[0][0]

    def decode_steps(self, job):
        """generate of one prompt, ``steps`` + 1 tokens: seconds per step after the first token (the prompt's
        forward pass untimed), from the times the per-token callback was called. job: (ids, steps)."""
        ids, steps = job
        times = []
        self._generate([ids], steps + 1, callback=lambda step: times.append(time.perf_counter()))
        return (times[-1] - times[0]) / steps
