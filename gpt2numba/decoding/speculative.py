"""Speculative decoding: a cheap draft proposes k tokens, the model checks them in one pass over k + 1 rows of
its cache, keeps the longest prefix it agrees with and adds one token of its own.

Drafts: the same weights in a compact format (``draft="int4"``, ``"int8"``, ``"bfloat16"``), another GPT-2 of the
same vocabulary (weights, or a checkpoint's path), or prompt lookup (transformers' ``prompt_lookup_num_tokens``
and ``max_matching_ngram_size``): the tokens that followed the latest earlier occurrence of the last n-gram.

The output is the model's own (Leviathan et al. 2023; Chen et al. 2023). Greedy: a drafted token is kept when it
is the model's argmax there, so the tokens are plain greedy decoding's. Sampling: a token d drawn from the draft's
q is kept with probability min(1, p(d) / q(d)), else the token is drawn from max(0, p - q) normalised, and after
the last drafted token kept, one more from p: each token then has plain sampling's distribution p. p and q are
Sampler.probabilities, every setting (processors, temperature, cuts) applied to both alike. Prompt lookup's q puts
all its mass on the token it proposes. The same seed gives the same tokens (not plain sampling's: the draws differ).

The model's cache holds every token but the last, which the next pass feeds before the drafts. After a pass over
[last, d1 .. dk] that keeps a of them, the cache is cut back to the tokens kept (copy_prefix onto itself) and
the model's own token waits to be fed: rows past the cut are overwritten by the next pass, never read.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass
from os import PathLike

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import CheckpointNotFoundError, ConfigError
from ..model import checks
from ..model.checkpoints import load_weights
from ..model.forward import checked_prompt, decode_batch, forward_pass, prefill, prefill_batch
from ..model.kvcache import ModelCache
from ..model.weights import GPT2Weights

SETTINGS = ("draft", "num_speculative_tokens", "prompt_lookup_num_tokens", "max_matching_ngram_size")  # by name
COMPACT_DRAFTS = ("int4", "int8", "bfloat16")  # draft=<one of these>: the model's own weights in that format
MAX_DRAFT = 64  # num_speculative_tokens and prompt_lookup_num_tokens at most (a pass over 65 rows)
ADAPTIVE = (4, 1, 12)  # num_speculative_tokens=None: k starts at 4, +2 when all are kept, -1 when not, in [1, 12]
# A batch drafts for its greedy sequences only while at most this many are in flight (vLLM's
# speculative_disable_by_batch_size): past it a step is arithmetic more than a read of the weights, and checking
# drafts costs more than it gives. GPT-2 large, float32, 2 threads, AMD EPYC Zen 4, decoding alone
# (docs/speculative.md): int4 drafts (k = 2) 1.37x with 1 sequence, 1.44x with 2, 1.23x with 4, 0.80x with 8;
# prompt lookup (no draft model) 2.44x, 2.85x, 2.15x, 1.50x with 8, 1.11x with 16, and 0.94x in the server under
# 16 streams (their prompts' prefill held up by the longer steps).
DRAFT_MAX_BATCH = 4
LOOKUP_MAX_BATCH = 8

_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # weights -> {draft as given: its weights}
_BYTES = {"int4": 0.5, "int8": 1, "bfloat16": 2, "float32": 4}  # a matrix's bytes a weight, by format


@dataclass
class Stats:
    """What speculation did in one generation: passes of the model, tokens drafted and kept, seconds spent."""

    rounds: int = 0  # a sequence's drafts checked (a batch's pass checks those of every sequence that drafted)
    passes: int = 0  # passes of the model that checked drafts
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # the model's pass over the drafts
    choose_seconds: float = 0.0  # p, q, acceptance, the cache's cut

    @property
    def acceptance(self) -> float:
        """The share of drafted tokens kept (nan before any draft)."""
        return self.accepted / self.drafted if self.drafted else float("nan")


@dataclass
class Speculation:
    """Checked settings: the draft (a ModelDraft's weights, as given before plan makes them; None for prompt
    lookup) and k (None: adaptive)."""

    draft: GPT2Weights | str | PathLike | None
    k: int | None
    ngram: int = 0  # prompt lookup's max_matching_ngram_size (0 with a model draft)
    shares: bool = False  # the draft is the model's own weights in a compact format: it reads the model's cache

    def position_bytes(self, kv_dtype: str) -> int:
        """What each position of a sequence costs beside the model's cache of ``kv_dtype``: its draft's keys and
        values (of the model's dtype when it shares the model's cache, else float32)."""
        if self.draft is None:
            return 0
        return ModelCache(self.draft.config, 1, kv_dtype if self.shares else "float32").nbytes

    @property
    def first_k(self) -> int:
        """The tokens a sequence drafts at first: k, or adapted from ADAPTIVE's start."""
        return self.k or ADAPTIVE[0]

    @property
    def max_batch(self) -> int:
        """The most sequences decoding at once for which a batch drafts."""
        return DRAFT_MAX_BATCH if self.draft is not None else LOOKUP_MAX_BATCH

    def drafter(self, target: ModelCache):
        """A new sequence's draft state beside the model's cache ``target``: a ModelDraft, or prompt lookup."""
        if self.draft is None:
            return PromptLookup(self.ngram)
        return ModelDraft(self.draft, target.max_len, target if self.shares else None)


def plan(w: GPT2Weights, draft=None, num_speculative_tokens: int | None = None,
         prompt_lookup_num_tokens: int | None = None, max_matching_ngram_size: int | None = None,
         ) -> Speculation | None:
    """The speculation asked for, checked (None when none is): ``draft`` "int4", "int8" or "bfloat16" (w itself
    in that format, made once per weights), GPT2Weights, or a checkpoint's path; or prompt lookup. Raises
    ConfigError naming the setting: both kinds at once, a setting without its kind, a count outside [1,
    MAX_DRAFT], a draft of another vocabulary; and what load_weights raises for a path."""
    spec = check(draft, num_speculative_tokens, prompt_lookup_num_tokens, max_matching_ngram_size)
    if spec is None or spec.draft is None:
        return spec
    shares = isinstance(spec.draft, str) and spec.draft in COMPACT_DRAFTS
    return dataclasses.replace(spec, draft=draft_weights(w, spec.draft), shares=shares)


def check(draft=None, num_speculative_tokens: int | None = None, prompt_lookup_num_tokens: int | None = None,
          max_matching_ngram_size: int | None = None) -> Speculation | None:
    """plan's checks that need no weights (the draft as given, not yet made or loaded): where the weights are
    elsewhere (Ray's workers)."""
    lookup = prompt_lookup_num_tokens is not None
    if draft is not None and lookup:
        raise ConfigError("give a draft or prompt_lookup_num_tokens, not both")
    if draft is None and not lookup:
        for name, value in (("num_speculative_tokens", num_speculative_tokens),
                            ("max_matching_ngram_size", max_matching_ngram_size)):
            if value is not None:
                raise ConfigError(f"{name}={value!r} needs a draft (draft= or prompt_lookup_num_tokens=)")
        return None
    if lookup:
        if num_speculative_tokens is not None:
            raise ConfigError("prompt lookup drafts prompt_lookup_num_tokens tokens: num_speculative_tokens is "
                              "for a draft model")
        k = _count("prompt_lookup_num_tokens", prompt_lookup_num_tokens)
        ngram = 2 if max_matching_ngram_size is None else max_matching_ngram_size
        if not checks.is_integer(ngram) or not 1 <= ngram <= MAX_DRAFT:
            raise ConfigError(f"max_matching_ngram_size must be an integer in [1, {MAX_DRAFT}], got {ngram!r}")
        return Speculation(None, k, int(ngram))
    if max_matching_ngram_size is not None:
        raise ConfigError("max_matching_ngram_size is for prompt lookup (prompt_lookup_num_tokens=)")
    if not isinstance(draft, (str, PathLike, GPT2Weights)):
        raise ConfigError(f"draft must be one of {', '.join(COMPACT_DRAFTS)}, GPT2Weights or a checkpoint's path; "
                          f"got {type(draft).__name__}")
    k = None if num_speculative_tokens is None else _count("num_speculative_tokens", num_speculative_tokens)
    return Speculation(draft, k)


def _count(name: str, value) -> int:
    if not checks.is_integer(value) or not 1 <= value <= MAX_DRAFT:
        raise ConfigError(f"{name} must be an integer in [1, {MAX_DRAFT}], got {value!r}")
    return int(value)


def draft_weights(w: GPT2Weights, draft, label: str | None = None) -> GPT2Weights:
    """The draft model's weights for ``draft`` (as plan takes it, checked); ``label`` names it in an error
    (default: draft=...)."""
    label = label or f"draft={str(draft)!r}"
    made = _made.setdefault(w, {})  # (a checkpoint by its path: Ray's workers ask once a block)
    key = str(draft) if isinstance(draft, (str, PathLike)) else None
    if key in made:
        return made[key]
    if isinstance(draft, str) and draft in COMPACT_DRAFTS:
        if _BYTES[draft] >= _BYTES[w.dtype]:
            raise ConfigError(f"{label} is no smaller than the model's own {w.dtype} weights: a draft is worth it "
                              f"only cheaper (int4 < int8 < bfloat16 < float32)")
        made[key] = w.astype(draft)
        return made[key]
    if isinstance(draft, (str, PathLike)):
        try:
            draft = load_weights(draft)
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(f"{label} is neither {', '.join(COMPACT_DRAFTS)} nor a checkpoint: "
                                          f"{e}") from None
    if draft.config.vocab_size != w.config.vocab_size:
        raise ConfigError(f"{label}: the draft's vocabulary has {draft.config.vocab_size} tokens, the model's "
                          f"{w.config.vocab_size}: a draft must share the model's tokens")
    if key is not None:
        made[key] = draft
    return draft


class ModelDraft:
    """A draft model with a cache of its own (at most ``max_len`` positions), which holds ``fed``, the tokens it has
    read. With ``target``, the model's cache (the draft is the model's own weights in a compact format), the draft
    reads the model's keys and values of every token but the last in place (shared, not copied: as QSpec's
    quantized draft shares its verifier's cache) and computes its own only for the tokens it drafts: it never
    prefills the prompt, and its context is the model's exactly."""

    def __init__(self, w: GPT2Weights, max_len: int | None = None, target: ModelCache | None = None):
        self.w, self.fed, self.target = w, [], target
        max_len = min(max_len or w.config.n_positions, w.config.n_positions)
        self.cache = ModelCache(w.config, max_len, target.dtype if target is not None else "float32")

    def propose(self, ids: list[int], k: int, sampler, rng, prompt_len: int):
        """Up to k tokens after ``ids``, and the draft's distribution for each (None when greedy)."""
        drafted = propose_all([(self, ids, k, sampler, rng, prompt_len)])[0]
        if isinstance(drafted, Exception):
            raise drafted
        return drafted

    def _start(self, ids: list[int], k: int) -> tuple[list[int], int]:
        """(The tokens to feed first, how many it can draft): its cache keeps what still holds of ``ids``."""
        k = min(k, self.cache.max_len - len(ids) + 1)  # it reads the k - 1 first drafts too
        if k <= 0:
            return [], k
        if self.target is not None:  # the model's cache holds every token but the last
            assert self.target.length == len(ids) - 1
            self.cache.copy_prefix(self.target)
            keep = len(ids) - 1
        else:
            keep = min(_shared_prefix(self.fed, ids), len(ids) - 1)  # (one token fed at least: its logits)
            self.cache.copy_prefix(self.cache, keep)
        self.fed = list(ids)
        return ids[keep:], k


def propose_all(jobs: list[tuple]) -> list[tuple[list[int], list | None] | Exception]:
    """The drafts of several sequences: jobs (drafter, ids, k, sampler, rng, prompt_len) give each (up to k
    tokens, the draft's distribution for each or None when greedy). Model drafts (of one weights) draft
    together, one pass for each token over all of them. A job whose own drafting raises (its sampler, its
    drafter) gets the exception in its place and drafts no further; the others draft as without it. What the
    draft model's pass raises, propose_all raises."""
    results: list = [([], None) for _ in jobs]
    models = []  # (job, the tokens it feeds first, k)
    for i, (drafter, ids, k, sampler, rng, prompt_len) in enumerate(jobs):
        try:
            if isinstance(drafter, ModelDraft):
                feed, k = drafter._start(ids, k)
                if k > 0:
                    models.append((i, feed, k))
            else:
                results[i] = drafter.propose(ids, k, sampler, rng, prompt_len)
        except Exception as e:  # (its own: the others draft on)
            results[i] = e
    if not models:
        return results
    w = jobs[models[0][0]][0].w
    assert all(jobs[i][0].w is w for i, _, _ in models)  # (one draft model: a batch's speculation has one)
    drafted = {i: ([], []) for i, _, _ in models}  # job -> (tokens, distributions)
    active = [i for i, _, _ in models]
    logits = prefill_batch([feed for _, feed, _ in models], w, [jobs[i][0].cache for i in active])
    wanted = {i: k for i, _, k in models}
    while True:
        going = []
        for i, row in zip(active, logits):
            try:
                _draft_one(jobs[i], row, *drafted[i])
            except Exception as e:  # (its own: the others draft on)
                results[i] = e
                continue
            if len(drafted[i][0]) < wanted[i]:
                going.append(i)
        if not going:
            break
        active = going
        logits = decode_batch([drafted[i][0][-1] for i in active], w, [jobs[i][0].cache for i in active])
        for i in active:  # (once its cache holds them)
            jobs[i][0].fed.append(drafted[i][0][-1])
    for i, (tokens, qs) in drafted.items():
        if not isinstance(results[i], Exception):
            results[i] = (tokens, qs if qs else None)
    return results


def _draft_one(job: tuple, row: np.ndarray, tokens: list[int], qs: list) -> None:
    """A model draft's next token from its logits ``row`` (vocab,), onto ``tokens`` (and its distribution onto
    ``qs`` when it samples)."""
    drafter, ids, _, sampler, rng, prompt_len = job
    if sampler.temperature == 0:
        tokens.append(sampler(row, ids + tokens, rng, prompt_len))
    else:
        qs.append(sampler.probabilities(row, ids + tokens, prompt_len))
        tokens.append(_draw(qs[-1], rng))


class PromptLookup:
    """Prompt lookup: the continuation of the latest earlier occurrence of the last n-gram of the text so far,
    n from ``ngram`` down to 1. The continuation is copied token by token, so one that reaches the end of the text
    goes on with the tokens just drafted (a loop goes round again). transformers takes the first occurrence; the
    latest follows what the text did most recently."""

    def __init__(self, ngram: int):
        self.ngram = ngram

    def propose(self, ids: list[int], k: int, sampler, rng, prompt_len: int):
        text = np.asarray(ids)
        for n in range(min(self.ngram, len(ids) - 1), 0, -1):
            hits = np.flatnonzero((sliding_window_view(text[:-1], n) == text[-n:]).all(axis=1))
            if hits.size:
                start, drafted = int(hits[-1]) + n, []
                for j in range(k):
                    drafted.append(ids[start + j] if start + j < len(ids) else drafted[start + j - len(ids)])
                return drafted, None
        return [], None


def generate(ids: list[int], w: GPT2Weights, mc: ModelCache, sampler, max_new_tokens: int, rng, stop_at_eos: bool,
             spec: Speculation, stats: Stats | None = None):
    """Yield the new tokens: ``ids`` (checked) continued by the model ``w`` in ``mc`` (max_len n_positions, room
    for them all), drafted as ``spec`` says. ``stats`` (a Stats) counts what it does."""
    stats = Stats() if stats is None else stats
    mc.reset()
    if max_new_tokens == 0:
        return
    if len(ids) > 1:  # every prompt token but the last, which goes with the first drafts
        forward_pass([checked_prompt(ids[:-1], w, mc, "")], w, [mc], lambda h, n_chunks: None)
    prompt_len, drafter, k = len(ids), spec.drafter(mc), spec.first_k
    eos = sampler.processors.eos_token_id
    produced = 0
    while True:
        start = time.perf_counter()
        want = min(k, max_new_tokens - produced - 1)
        drafted, qs = drafter.propose(ids, want, sampler, rng, prompt_len) if want > 0 else ([], None)
        drafted_at = time.perf_counter()
        rows = prefill([ids[-1]] + drafted, w, mc, logits="all")
        stats.passes += 1
        stats.draft_seconds += drafted_at - start
        stats.verify_seconds += time.perf_counter() - drafted_at
        new, k = settle(rows, drafted, qs, ids, mc, sampler, rng, prompt_len, spec, k, stats)
        for token in new:
            ids.append(token)
            produced += 1
            yield token
            if (stop_at_eos and token in eos) or produced == max_new_tokens:
                return


def settle(rows: np.ndarray, drafted: list[int], qs, ids: list[int], mc: ModelCache, sampler, rng, prompt_len: int,
           spec: Speculation, k: int, stats: Stats) -> tuple[list[int], int]:
    """After the model's pass over [ids[-1], *drafted], its logits ``rows``: (the new tokens, the drafts it
    keeps and then its own, and the next k). Its cache ``mc`` is cut back to ids and the drafts kept."""
    started = time.perf_counter()
    kept, token = _verify(rows, drafted, qs, ids, sampler, rng, prompt_len)
    mc.copy_prefix(mc, len(ids) + kept)
    stats.rounds += 1
    stats.drafted += len(drafted)
    stats.accepted += kept
    if spec.k is None and drafted:  # as transformers' "heuristic" schedule: longer while all are kept
        k = min(k + 2, ADAPTIVE[2]) if kept == len(drafted) else max(k - 1, ADAPTIVE[1])
    stats.choose_seconds += time.perf_counter() - started
    return drafted[:kept] + [token], k


def _verify(rows: np.ndarray, drafted: list[int], qs, ids: list[int], sampler, rng, prompt_len: int):
    """(How many drafted tokens the model keeps, its own token after them), from its logits ``rows`` (k + 1,
    vocab) after ids[-1] and after each drafted token."""
    for i, row in enumerate(rows):
        previous = ids + drafted[:i]
        if sampler.temperature == 0:  # greedy: the model's argmax, as plain decoding takes it
            token = sampler(row, previous, rng, prompt_len)
            if i < len(drafted) and token == drafted[i]:
                continue
            return i, token
        p = sampler.probabilities(row, previous, prompt_len)
        if i == len(drafted):
            return i, _draw(p, rng)
        d = drafted[i]
        q = None if qs is None else qs[i]
        if rng.random() * (1.0 if q is None else q[d]) < p[d]:  # kept with probability min(1, p(d) / q(d))
            continue
        residual = p.copy()
        if q is None:
            residual[d] = 0.0
        else:
            np.maximum(p - q, 0.0, out=residual)
        return i, _draw(residual if residual.sum() > 0 else p, rng)  # (0 only where rounding made p = q)
    raise AssertionError("unreachable: the last row always gives a token")


def _draw(p: np.ndarray, rng) -> int:
    """A token drawn from weights p (vocab,) >= 0, not all 0."""
    cumulative = np.cumsum(p)
    return min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")), len(p) - 1)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n
