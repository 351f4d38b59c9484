"""Continuous batching: sequences in flight, each in its own cache; one forward pass a step over all of them.

A sequence joins between steps: its prompt is prefilled in the same pass as the
others' next tokens (a one-token "prompt" is a decode row, so prefill_batch
serves both). It leaves when it finishes, or when its owner removes it. Used by
generate_batch (a fixed list of prompts) and by the server (requests that come
and go); the caller checks prompts and settings first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .forward import prefill_batch
from .kvcache import ModelCache
from .tokenizer import EOT_ID
from .weights import GPT2Weights


@dataclass(eq=False)
class Sequence:
    """One sequence in flight. ids: the prompt, then each token as it is chosen."""

    ids: list[int]
    max_new_tokens: int
    sampler: object  # sample.Sampler: (logits (vocab,), ids so far, rng) -> token id
    rng: np.random.Generator
    stop_at_eos: bool
    cache: ModelCache | None  # None once the sequence has left its batch
    prompt_len: int = field(init=False)
    feed: list[int] = field(init=False)  # what the next pass feeds: the prompt, then the last token

    def __post_init__(self):
        self.prompt_len = len(self.ids)
        self.feed = list(self.ids)

    @property
    def new_tokens(self) -> int:
        return len(self.ids) - self.prompt_len


class Batch:
    """At most ``size`` sequences in flight over the weights ``w``."""

    def __init__(self, w: GPT2Weights, size: int):
        self.w, self.size = w, size
        self.sequences: list[Sequence] = []
        self._logits = np.empty((size, w.config.vocab_size), np.float32)  # (size, vocab), reused by every step

    @property
    def full(self) -> bool:
        return len(self.sequences) >= self.size

    def add(self, ids: list[int], *, max_new_tokens: int, sampler, rng: np.random.Generator,
            stop_at_eos: bool = True) -> Sequence:
        """A new sequence, prefilled in the next step; ids (checked) plus max_new_tokens >= 1 fit n_positions."""
        assert not self.full and max_new_tokens >= 1
        cache = ModelCache(self.w.config, max_len=len(ids) + max_new_tokens)
        seq = Sequence(list(ids), max_new_tokens, sampler, rng, stop_at_eos, cache)
        self.sequences.append(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        """Stop a sequence now (its cache goes with it)."""
        self.sequences.remove(seq)
        seq.cache = None  # whoever still holds the sequence, its memory is free

    def step(self) -> list[tuple[Sequence, int, bool, np.ndarray]]:
        """One forward pass over every sequence: (sequence, its new token, whether it is done, its logits).

        A row of logits (vocab,) is valid until the next step. A done sequence has left the batch, and
        its cache is gone (cache None).
        """
        seqs = self.sequences
        if not seqs:
            return []
        rows = prefill_batch([s.feed for s in seqs], self.w, [s.cache for s in seqs],
                             out=self._logits[: len(seqs)])
        out = []
        for seq, row in zip(list(seqs), rows):
            token = seq.sampler(row, seq.ids, seq.rng)
            seq.ids.append(token)
            done = (seq.stop_at_eos and token == EOT_ID) or seq.new_tokens == seq.max_new_tokens
            if done:
                self.remove(seq)
            else:
                seq.feed = [token]
            out.append((seq, token, done, row))
        return out
