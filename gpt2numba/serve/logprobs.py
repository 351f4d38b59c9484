"""OpenAI's log-probabilities, computed on the engine thread and kept as JSON text.

A Piece holds the four lists of OpenAI's ``logprobs`` object for some consecutive tokens, each already
serialised (the items without their brackets), each token's length for ``text_offset``, and the sum of
their log-probabilities (what best_of ranks choices by). A response joins pieces without parsing or
serialising them again: an echoed prompt's piece is computed and serialised once, however many choices
repeat it, and the event loop only concatenates text.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np

from ..decoding.batching import SharedPrompt
from ..model.forward import checked_prompt, forward_pass, logits_head
from ..model.kvcache import ModelCache
from ..model.weights import GPT2Weights
from ..text.scoring import log_softmax
from ..text.tokenizer import Tokenizer

LOGPROB_ROWS = 64  # rows of logits turned into log-probabilities at a time (float64)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Log-probabilities of consecutive tokens: JSON items of each of OpenAI's lists (no brackets)."""

    tokens: str  # '"The", " cat"'
    token_logprobs: str  # 'null, -2.5'
    top_logprobs: str  # 'null, {" cat": -2.5, " dog": -3.0}'
    lengths: tuple[int, ...]  # characters of each token's text: text_offset steps by them
    logprob: float = 0.0  # the sum of the tokens' log-probabilities (a null one counts 0)


def join(pieces: list[Piece]) -> Piece:
    """One piece of consecutive pieces."""
    return Piece(*(", ".join(getattr(p, name) for p in pieces) for name in ("tokens", "token_logprobs",
                                                                         "top_logprobs")),
                 tuple(n for p in pieces for n in p.lengths), sum(p.logprob for p in pieces))


def as_json(pieces: list[Piece], start: int) -> str:
    """OpenAI's logprobs object over a choice's pieces, in order; text offsets counted from ``start``."""
    whole = join(pieces)
    offsets = itertools.accumulate(whole.lengths[:-1], initial=start) if whole.lengths else ()
    return (f'{{"tokens": [{whole.tokens}], "token_logprobs": [{whole.token_logprobs}], '
            f'"top_logprobs": [{whole.top_logprobs}], "text_offset": [{", ".join(map(str, offsets))}]}}')


class Logprobs:
    """Log-softmax over rows of logits and the k best alternatives, as Pieces (one per model)."""

    def __init__(self, w: GPT2Weights, tokenizer: Tokenizer, kv_dtype: str = "float32"):
        self.w, self.tokenizer, self.kv_dtype = w, tokenizer, kv_dtype  # echo's cache: as the batch's
        self._text: dict[int, str] = {}  # token id -> its text (at most the vocabulary)

    def text(self, token: int) -> str:
        text = self._text.get(token)
        if text is None:
            text = self._text[token] = self.tokenizer.decode([token])
        return text

    def rows(self, logits: np.ndarray, tokens: list[int], k: int) -> Piece:
        """The piece for rows of logits (R, vocab) float32 and the token chosen after each."""
        texts, chosen, top = [], [], []
        for r0 in range(0, len(tokens), LOGPROB_ROWS):
            z = log_softmax(logits[r0:r0 + LOGPROB_ROWS])  # (rows, vocab)
            for row, token in zip(z, tokens[r0:r0 + LOGPROB_ROWS]):
                texts.append(self.text(token))
                chosen.append(float(row[token]))
                best = np.argpartition(-row, k - 1)[:k] if k else np.zeros(0, np.int64)
                best = best[np.lexsort((best, -row[best]))]
                top.append({self.text(int(t)): float(row[t]) for t in best})
        return Piece(_items(texts), _items(chosen), _items(top), tuple(map(len, texts)), sum(chosen))

    def prompt(self, ids: list[int], k: int, into: SharedPrompt | None = None) -> Piece:
        """Echo: each prompt token's log-probability given those before it (null for the first).

        One forward pass over the prompt, whose head turns LOGPROB_ROWS rows at a time into logits and
        then log-probabilities (as scoring.py's head does): no (T, vocab) array, 200 MB for 1,000 tokens.
        ``into`` (new) gets the pass's cache and the logits after the prompt: the prompt's sequences then
        start from them instead of running the prompt again."""
        first = Piece(_items([self.text(ids[0])]), "null", "null", (len(self.text(ids[0])),))
        if len(ids) == 1 and into is None:
            return first
        mc = ModelCache(self.w.config, max_len=len(ids), dtype=self.kv_dtype)
        logits = logits_head(self.w)

        def head(h: np.ndarray, chunks: int) -> list[Piece]:  # h: (T, n_embd), every position after ln_f
            if into is not None:
                into.logits = logits(h[-1:], chunks)[0]
            return [self.rows(logits(h[r0:min(r0 + LOGPROB_ROWS, len(ids) - 1)], chunks),
                              ids[r0 + 1:r0 + 1 + LOGPROB_ROWS], k) for r0 in range(0, len(ids) - 1, LOGPROB_ROWS)]

        piece = join([first, *forward_pass([checked_prompt(ids, self.w, mc, "")], self.w, [mc], head, every_row=True)])
        if into is not None:
            into.cache = mc
        return piece


def _items(values: list) -> str:
    return json.dumps(values)[1:-1]
