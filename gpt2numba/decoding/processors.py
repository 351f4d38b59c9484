"""Logits processors: what a generation's settings do to one row of scores before a token is chosen.

Each is the transformers processor of the same meaning (``generation/logits_process.py``), on one sequence,
in float64, in transformers' order (``GenerationMixin._get_logits_processor``): the bias of single tokens
(OpenAI's ``logit_bias``, transformers' ``sequence_bias`` of one-token sequences, which comes first there too),
the repetition penalty, OpenAI's presence and frequency penalties (after it, as vLLM applies them), no
repeated n-grams, banned token sequences, and no end before ``min_new_tokens``. Sampling applies them to the
logits, beam search to their log-softmax, as transformers does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import SamplingError
from ..model import checks
from ..text.tokenizer import EOT_ID

MAX_BIAS = 100.0  # |logit_bias| at most, as OpenAI's


@dataclass(frozen=True)
class Processors:
    """The settings that change scores, checked (SamplingError names the setting) and held in canonical form.

    logit_bias: {token id: bias in [-100, 100]}, added to the scores. repetition_penalty > 0: a token already
    in the sequence (prompt included) has a positive score divided by it, a negative one multiplied.
    presence_penalty, frequency_penalty in [-2, 2]: a token generated c > 0 times so far loses
    ``c * frequency_penalty + presence_penalty``. no_repeat_ngram_size n >= 0: no n-gram of the sequence
    (prompt included) occurs twice. bad_words_ids: token sequences never produced (a sequence's last token is
    banned where the sequence's other tokens end the ids; a lone end-of-text id is not banned, as in
    transformers). min_new_tokens: the end-of-text ids are banned until that many tokens are new.
    eos_token_id: an id or ids that end a sequence (default GPT-2's <|endoftext|>, 50256).
    """

    logit_bias: Mapping[int, float] | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    min_new_tokens: int = 0
    eos_token_id: int | tuple[int, ...] | None = None
    _bias: tuple[np.ndarray, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        r = self.repetition_penalty
        if not checks.is_real(r) or not 0 < r < math.inf:
            raise SamplingError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not checks.is_real(value) or not -2 <= value <= 2:
                raise SamplingError(f"{name} must be a number in [-2, 2], got {value!r}")
        for name in ("no_repeat_ngram_size", "min_new_tokens"):
            value = getattr(self, name)
            if not checks.is_integer(value) or value < 0:
                raise SamplingError(f"{name} must be an integer >= 0, got {value!r}")
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("eos_token_id", _ids("eos_token_id", (EOT_ID,) if self.eos_token_id is None else self.eos_token_id))
        if not self.eos_token_id:
            raise SamplingError("eos_token_id must be an id or a non-empty list of ids")
        lone_eos = {(t,) for t in self.eos_token_id}  # transformers never bans an eos alone
        set_("bad_words_ids", tuple(w for w in _bad_words(self.bad_words_ids) if w not in lone_eos))
        set_("logit_bias", _logit_bias(self.logit_bias))
        set_("_bias", (np.array(list(self.logit_bias), np.int64), np.array(list(self.logit_bias.values()))))

    @property
    def active(self) -> bool:
        """Whether any processor changes scores."""
        return bool(self.logit_bias or self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.no_repeat_ngram_size or self.bad_words_ids
                    or self.min_new_tokens)

    def check_vocab(self, vocab_size: int, default_eos: bool = True) -> None:
        """TokenError for an id of logit_bias or bad_words_ids (or eos_token_id, unless it is the default,
        which a model with a smaller vocabulary never produces) outside [0, vocab_size)."""
        for token in self.logit_bias:
            checks.token_id(token, vocab_size, "logit_bias: token id")
        for i, words in enumerate(self.bad_words_ids):
            checks.labelled(f"bad_words_ids[{i}]: ", checks.token_ids, words, vocab_size)
        if not default_eos:
            checks.labelled("eos_token_id: ", checks.token_ids, self.eos_token_id, vocab_size)

    def __call__(self, z: np.ndarray, ids, prompt_len: int) -> np.ndarray:
        """Process the float64 scores z (vocab,) in place for the sequence ``ids`` (its first prompt_len are
        the prompt); returns z."""
        if not self.active:
            return z
        if self.logit_bias:
            z[self._bias[0]] += self._bias[1]
        ids = np.asarray(ids, np.int64)
        if self.repetition_penalty != 1.0 and ids.size:
            seen = np.unique(ids)
            z[seen] = np.where(z[seen] < 0, z[seen] * self.repetition_penalty, z[seen] / self.repetition_penalty)
        if (self.presence_penalty or self.frequency_penalty) and ids.size > prompt_len:
            tokens, counts = np.unique(ids[prompt_len:], return_counts=True)
            z[tokens] -= counts * self.frequency_penalty + self.presence_penalty
        if self.no_repeat_ngram_size:
            z[repeated_ngram_ends(ids, self.no_repeat_ngram_size)] = -np.inf
        for words in self.bad_words_ids:
            if words[-1] < z.size and (len(words) == 1 or tuple(ids[ids.size - len(words) + 1:]) == words[:-1]):
                z[words[-1]] = -np.inf
        if ids.size - prompt_len < self.min_new_tokens:
            z[[t for t in self.eos_token_id if t < z.size]] = -np.inf
        return z


def repeated_ngram_ends(ids: np.ndarray, n: int) -> np.ndarray:
    """The tokens that would end an n-gram already in ``ids`` (int64, 1-D): those that follow an earlier
    occurrence of its last n - 1 tokens."""
    if ids.size < n:
        return np.empty(0, np.int64)
    grams = np.lib.stride_tricks.sliding_window_view(ids, n)  # (len - n + 1, n)
    if n == 1:
        return grams[:, 0]
    return grams[(grams[:, :-1] == ids[ids.size - n + 1:]).all(axis=1), -1]


def _ids(name: str, value) -> tuple[int, ...]:
    """An id or a sequence of ids (integers >= 0) as a tuple."""
    values = [value] if checks.is_integer(value) else value
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise SamplingError(f"{name} must be a token id or a list of ids, got {value!r}")
    values = list(values)
    if not all(checks.is_integer(t) and t >= 0 for t in values):
        raise SamplingError(f"{name} must hold token ids (integers >= 0), got {value!r}")
    return tuple(int(t) for t in values)


def _bad_words(value) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise SamplingError(f"bad_words_ids must be a list of lists of token ids, got {value!r}")
    words = tuple(_ids("bad_words_ids", w) if not checks.is_integer(w) else None for w in value)
    if any(w is None or not w for w in words):
        raise SamplingError(f"bad_words_ids must be a list of non-empty lists of token ids, got {value!r}")
    return words


def _logit_bias(value) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SamplingError(f"logit_bias must be a mapping of token id to bias, got {type(value).__name__}")
    bias = {}
    for token, b in value.items():
        if not checks.is_integer(token) or token < 0:
            raise SamplingError(f"logit_bias: a key must be a token id (an integer >= 0), got {token!r}")
        if not checks.is_real(b) or not -MAX_BIAS <= b <= MAX_BIAS:
            raise SamplingError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {b!r}")
        bias[int(token)] = float(b)
    return bias
