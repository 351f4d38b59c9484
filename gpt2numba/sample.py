"""Generation: sampling settings, one prefill, then decode steps over one cache."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from . import checks
from .errors import CacheFullError, ConfigError, GPT2NumbaError
from .kvcache import ModelCache, _check_weights, decode_step, prefill
from .tokenizer import EOT_ID, Tokenizer, load_tokenizer
from .weights import GPT2Weights


class SamplingError(GPT2NumbaError, ValueError):
    """A generation setting is out of its range."""


@dataclass(frozen=True)
class Sampler:
    """How the next token is chosen from the logits.

    temperature 0 is greedy (argmax); otherwise softmax(logits / temperature),
    cut to the top_k most likely and then to the smallest set whose probability
    reaches top_p. repetition_penalty > 1 makes tokens already in the sequence
    less likely (a positive logit is divided by it, a negative one multiplied).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self):
        t, k, p, r = self.temperature, self.top_k, self.top_p, self.repetition_penalty
        if not checks.is_real(t) or not 0 <= t < math.inf:
            raise SamplingError(f"temperature must be a finite number >= 0, got {t!r}")
        if k is not None and (not checks.is_integer(k) or k < 1):
            raise SamplingError(f"top_k must be an integer >= 1 or None, got {k!r}")
        if p is not None and (not checks.is_real(p) or not 0 < p <= 1):
            raise SamplingError(f"top_p must be in (0, 1] or None, got {p!r}")
        if not checks.is_real(r) or not 0 < r < math.inf:
            raise SamplingError(f"repetition_penalty must be a finite number > 0, got {r!r}")

    def __call__(self, logits, previous, rng: np.random.Generator) -> int:
        """One token id from float logits (vocab,), given the ids so far (ids in [0, vocab))."""
        z = np.array(logits, dtype=np.float64)
        if z.ndim != 1 or z.size == 0:
            raise SamplingError(f"logits must be a non-empty 1-D array, got shape {z.shape}")
        if self.repetition_penalty != 1.0 and len(previous):
            seen = np.unique(checks.token_ids(previous, z.size))
            z[seen] = np.where(z[seen] > 0, z[seen] / self.repetition_penalty, z[seen] * self.repetition_penalty)
        if self.temperature == 0:
            return int(np.argmax(z))
        with np.errstate(over="ignore"):  # <= 0: a tiny temperature gives -inf, never nan
            z = (z - z.max()) / self.temperature
        candidates = self.candidates(z)
        probs = _softmax(z[candidates])
        return int(candidates[min(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"),
                                  len(candidates) - 1)])

    def candidates(self, z: np.ndarray) -> np.ndarray:
        """Ids allowed by top_k and top_p, most likely first, for tempered logits z."""
        order = np.argsort(-z, kind="stable")
        if self.top_k is not None:
            order = order[: self.top_k]
        if self.top_p is not None:
            probs = _softmax(z[order])  # renormalised over the top_k set, as is usual
            # smallest prefix whose mass reaches top_p: the first index where the sum >= p
            keep = int(np.searchsorted(np.cumsum(probs), self.top_p * (1 - 1e-12), side="left")) + 1
            order = order[: min(keep, len(order))]
        return order


def generate(prompt_ids, w: GPT2Weights, *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, repetition_penalty: float = 1.0,
             seed: int | None = None, stop_at_eos: bool = True, slide: bool = False,
             cache: ModelCache | None = None) -> Iterator[int]:
    """Yield new token ids one at a time: one prefill, then a decode step per token.

    Stops after max_new_tokens, or after yielding <|endoftext|> when stop_at_eos.
    The sequence may not pass the model's n_positions: when prompt plus
    max_new_tokens would, CacheFullError is raised before any work, unless
    ``slide``, which keeps the newest half of the context, re-prefills it at
    positions 0.., and goes on. The same seed gives the same tokens.
    Raises SamplingError for settings out of range, TokenError/TokenTypeError
    for bad prompt ids.
    """
    _check_weights(w)
    cfg = w.config
    sampler = Sampler(temperature, top_k, top_p, repetition_penalty)
    if not checks.is_integer(max_new_tokens) or max_new_tokens < 0:
        raise SamplingError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if seed is not None and (not checks.is_integer(seed) or seed < 0):
        raise SamplingError(f"seed must be an integer >= 0 or None, got {seed!r}")
    ids = [int(t) for t in checks.token_ids(prompt_ids, cfg.vocab_size)]
    if len(ids) > cfg.n_positions:
        raise CacheFullError(f"the prompt has {len(ids)} tokens; the model's context is {cfg.n_positions}")
    if not slide and len(ids) + max_new_tokens > cfg.n_positions:
        raise CacheFullError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} "
            f"passes the model's context of {cfg.n_positions} positions; ask for fewer tokens or slide=True"
        )
    if cache is None:
        cache = ModelCache(cfg)
    elif not isinstance(cache, ModelCache) or cache.config != cfg or cache.max_len != cfg.n_positions:
        raise ConfigError("generate needs a cache of the weights' config with max_len = n_positions")
    return _generate(ids, w, cache, sampler, max_new_tokens, np.random.default_rng(seed), stop_at_eos)


def _generate(ids, w, mc, sampler, max_new_tokens, rng, stop_at_eos):
    mc.reset()
    if max_new_tokens == 0:
        return
    logits = prefill(ids, w, mc)
    for n in range(max_new_tokens):
        token = sampler(logits, ids, rng)
        ids.append(token)
        yield token
        if (stop_at_eos and token == EOT_ID) or n == max_new_tokens - 1:
            return
        if mc.room == 0:  # only reached with slide=True: keep the newest half, re-prefill
            mc.reset()
            logits = prefill(ids[-max(1, mc.max_len // 2):], w, mc)
        else:
            logits = decode_step(token, w, mc)


def generate_text(prompt: str, w: GPT2Weights, tokenizer: Tokenizer | None = None, **options) -> Iterator[str]:
    """Like generate, from text to text: yields decoded pieces as tokens arrive.

    A piece never ends inside a multi-byte character (bytes wait for the rest);
    <|endoftext|> ends the text and is not shown.
    """
    tokenizer = tokenizer or load_tokenizer()
    if not isinstance(prompt, str):
        raise SamplingError(f"prompt must be a str, got {type(prompt).__name__}")
    tokens = generate(prompt_ids(prompt, tokenizer), w, **options)
    return (text for _, text in text_stream(tokens, tokenizer) if text)


def prompt_ids(prompt: str, tokenizer: Tokenizer) -> list[int]:
    """The prompt's ids; an empty prompt is <|endoftext|>, GPT-2's start of an unconditioned text."""
    return tokenizer.encode(prompt) or [tokenizer.eot_id]


def text_stream(tokens, tokenizer: Tokenizer):
    """(token, text) for each token as it arrives, then (None, text held back at the end).

    text is "" while a character's bytes are incomplete, and for <|endoftext|>.
    """
    decode = tokenizer.stream_decoder()
    for token in tokens:
        yield token, "" if token == tokenizer.eot_id else decode(token)
    yield None, decode(None)  # bytes of a character the generation stopped inside


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()

