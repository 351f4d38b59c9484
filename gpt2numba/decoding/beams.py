"""Beam search with transformers' semantics (``GenerationMixin._beam_search``), over the batched forward pass.

Per prompt: ``num_beams`` running beams, each a cache; a step scores every beam's next token by its
cumulative log-probability (the log-softmax, processed as transformers processes it: repetition penalty,
no repeated n-grams, banned words, min_new_tokens), keeps the best ``max(2, 1 + n_eos) * num_beams``
candidates, moves those among the first ``num_beams`` that end (an end-of-text id, or the last token) to the
finished hypotheses, scored by their sum over ``len ** length_penalty``, and runs on with the best
``num_beams`` that do not. ``early_stopping`` is transformers': True stops when ``num_beams`` hypotheses
are finished; False when the best running beam, at its current length, cannot beat the worst finished one;
"never" as False but at the longest length when length_penalty > 0 (the exact bound).

The beams of every prompt share one forward pass a step (decode_batch). A beam that takes a parent's place
takes its cache; a second child of one parent takes the cache of a beam that has no child, which then
reads the parent's rows in place (ModelCache.copy_prefix shares them; no row is copied).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from ..cpu.topk import _best, _log_softmax
from ..errors import PartialBatchError, SamplingError
from ..model import checks
from ..model.forward import decode_batch, prefill_batch
from ..model.kvcache import ModelCache, check_kv_dtype
from ..model.weights import GPT2Weights
from .constraints import Constraint, Matcher, per_sequence
from .processors import Processors

_FAR = 1.0e9  # what transformers subtracts from a score to rule a candidate out (not -inf: sums stay finite)


@dataclass(frozen=True)
class Hypothesis:
    """One finished beam: its new token ids (an end-of-text id last, when one ended it) and its score, the sum
    of their log-probabilities (as processed) over ``len(ids) ** length_penalty``."""

    ids: list[int]
    score: float


def beam_search(prompt_ids, w: GPT2Weights, *, num_beams: int, max_new_tokens: int, length_penalty: float = 1.0,
                early_stopping: bool | str = False, num_return_sequences: int = 1, no_repeat_ngram_size: int = 0,
                repetition_penalty: float = 1.0, eos_token_id=None, min_new_tokens: int = 0,
                bad_words_ids=None, kv_dtype: str | None = None, json_schema=None, regex=None, choice=None,
                grammar=None, tokenizer=None) -> list[Hypothesis]:
    """The ``num_return_sequences`` best hypotheses of a beam search from ``prompt_ids``, best first.

    num_beams >= 1; max_new_tokens >= 1 (prompt + max_new_tokens <= n_positions); length_penalty a finite
    number (> 0 favours longer hypotheses); early_stopping True, False or "never"; 1 <= num_return_sequences
    <= num_beams; eos_token_id an id or ids (default <|endoftext|>); no_repeat_ngram_size, repetition_penalty,
    min_new_tokens and bad_words_ids as in Sampler; kv_dtype the caches' (kvcache.KV_DTYPES, default float32).
    json_schema, regex, choice or grammar (at most one, as generate takes them, with ``tokenizer``): every
    beam's tokens keep its text inside it (-inf for the others, after the processors), and a beam whose text
    is complete ends there, as at an end-of-text id. Fewer than num_return_sequences hypotheses come back when
    the constraint allows fewer texts (the same text may come twice, tokenized two ways).
    Everything is checked before any work: SamplingError for a setting, TokenError / TokenTypeError for ids,
    CacheFullError when the prompt and max_new_tokens pass n_positions, ConfigError for kv_dtype,
    GrammarError for a constraint. What fails the search during the work is raised as it is.
    """
    try:
        return beam_search_batch([prompt_ids], w, num_beams=num_beams, max_new_tokens=max_new_tokens,
                                 length_penalty=length_penalty, early_stopping=early_stopping,
                                 num_return_sequences=num_return_sequences, no_repeat_ngram_size=no_repeat_ngram_size,
                                 repetition_penalty=repetition_penalty, eos_token_id=eos_token_id,
                                 min_new_tokens=min_new_tokens, bad_words_ids=bad_words_ids, kv_dtype=kv_dtype,
                                 json_schema=json_schema, regex=regex, choice=choice, grammar=grammar,
                                 tokenizer=tokenizer)[0]
    except PartialBatchError as e:  # (its one prompt's)
        raise e.errors[0] from None


def beam_search_batch(prompts, w: GPT2Weights, *, num_beams: int, max_new_tokens: int, kv_dtype: str | None = None,
                      json_schema=None, regex=None, choice=None, grammar=None, constraints=None, tokenizer=None,
                      **settings) -> list[list[Hypothesis]]:
    """beam_search for each of ``prompts``, their beams in one forward pass a step; a list per prompt, in
    order. Takes beam_search's settings and raises what it raises before any work (naming the prompt), and
    BatchError for no prompts; ``constraints`` as generate_batch takes it, one Constraint or None a prompt.
    A prompt whose search fails during the work (its constraint's error, a bug) stops alone, its caches freed;
    the others search on as without it, and once they are done PartialBatchError is raised, its ``errors`` by
    prompt index, its ``results`` this function's list with None for each failed prompt. What the forward pass
    raises ends every search."""
    checks.weights(w)
    cfg = w.config
    checks.known_settings(settings, [f.name for f in fields(_Settings) if f.init])
    search = _Settings(num_beams=num_beams, max_new_tokens=max_new_tokens, **settings)
    search.processors.check_vocab(cfg.vocab_size, default_eos=settings.get("eos_token_id") is None)
    kv_dtype = checks.labelled("kv_dtype: ", check_kv_dtype, "float32" if kv_dtype is None else kv_dtype)
    checked = checks.prompts(prompts, cfg, max_new_tokens)
    each = per_sequence(len(checked), constraints, tokenizer, cfg.vocab_size, json_schema=json_schema, regex=regex,
                        choice=choice, grammar=grammar)
    beams = [_Beams(ids, search, [ModelCache(cfg, len(ids) + max_new_tokens, kv_dtype) for _ in range(num_beams)],
                    constraint) for ids, constraint in zip(checked, each)]
    logits = prefill_batch(checked, w, [b.caches[0] for b in beams])
    running = beams
    while running:
        rows = np.split(logits, np.cumsum([len(b.caches) for b in running])[:-1])
        for b, row in zip(running, rows):
            try:
                b.step(row)
            except Exception as e:  # (its own: the other prompts search on)
                b.fail(e)
        running = [b for b in running if not b.done]
        if running:
            logits = decode_batch([ids[-1] for b in running for ids in b.running], w,
                                  [mc for b in running for mc in b.caches])
    found = [None if b.error is not None else
             [Hypothesis(ids, float(score)) for score, ids in b.finished[: search.num_return_sequences]] for b in beams]
    errors = {i: b.error for i, b in enumerate(beams) if b.error is not None}
    if errors:
        raise PartialBatchError(errors, len(beams), found)
    return found


@dataclass(frozen=True)
class _Settings:
    num_beams: int
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    eos_token_id: int | tuple[int, ...] | None = None
    min_new_tokens: int = 0
    bad_words_ids: tuple | None = None
    processors: Processors = field(init=False)

    def __post_init__(self):
        if not checks.is_integer(self.num_beams) or self.num_beams < 1:
            raise SamplingError(f"num_beams must be an integer >= 1, got {self.num_beams!r}")
        if not checks.is_integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not checks.is_real(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise SamplingError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"):
            raise SamplingError(f'early_stopping must be True, False or "never", got {self.early_stopping!r}')
        r = self.num_return_sequences
        if not checks.is_integer(r) or not 1 <= r <= self.num_beams:
            raise SamplingError(f"num_return_sequences must be an integer in [1, num_beams={self.num_beams}], "
                                f"got {r!r}")
        object.__setattr__(self, "processors", Processors(
            repetition_penalty=self.repetition_penalty, no_repeat_ngram_size=self.no_repeat_ngram_size,
            bad_words_ids=self.bad_words_ids, min_new_tokens=self.min_new_tokens, eos_token_id=self.eos_token_id))

    @property
    def candidates(self) -> int:
        """How many continuations a step keeps: enough that num_beams of them do not end."""
        return max(2, 1 + len(self.processors.eos_token_id)) * self.num_beams


class _Beams:
    """One prompt's search: running beams (new ids, cumulative scores, caches) and finished hypotheses."""

    def __init__(self, prompt: list[int], settings: _Settings, caches: list[ModelCache],
                 constraint: Constraint | None = None):
        self.prompt, self.s = prompt, settings
        # with a constraint, each running beam's Matcher (None: a beam the constraint left no token, ruled out)
        self.matchers: list[Matcher | None] | None = None if constraint is None else [Matcher(constraint)]
        self.running: list[list[int]] = [[]]  # one beam until the first step: every beam starts as the prompt
        self.scores = np.zeros(1)  # (beams,) float64: sums of processed log-probabilities
        self.caches = caches[:1]  # one per running beam; the rest wait for the first step in spare
        self.spare = caches[1:]
        self.finished: list[tuple[float, list[int]]] = []  # (score, ids), best first, at most num_beams
        self.improvable = True  # transformers' "early stop heuristic unsatisfied"
        self.done = False
        self.error: Exception | None = None  # what failed its search, if something did

    def step(self, logits: np.ndarray) -> None:
        """Take the running beams' next-token logits (beams, vocab); move on by one token."""
        s, vocab = self.s, logits.shape[1]
        z = np.empty(logits.shape)  # (beams, vocab) float64
        _log_softmax(np.ascontiguousarray(logits, np.float32), z)
        for b, ids in enumerate(self.running):
            s.processors(z[b], self.prompt + ids, len(self.prompt))
            if self.matchers is not None:  # the constraint, after the processors (transformers' place for it)
                z[b][~self.matchers[b].allowed() if self.matchers[b] is not None else slice(None)] = -np.inf
        scores, top = _best(z, self.scores, min(s.candidates, z.size))  # best first; ties by beam, then id
        parents, tokens = top // vocab, top % vocab
        length = len(self.running[0]) + 1  # every candidate's new tokens
        ends = np.isin(tokens, s.processors.eos_token_id) | (length >= s.max_new_tokens)
        if self.matchers is not None:  # each candidate's place in the grammar; a complete text ends its beam
            followed = [self._follow(p, t) if score > -np.inf else None for p, t, score in zip(parents, tokens, scores)]
            ends |= np.array([m is not None and m.done for m in followed])
        full = len(self.finished) == s.num_beams
        if self.improvable and not (full and s.early_stopping is True):
            new = [(scores[i] / length ** s.length_penalty, self.running[parents[i]] + [int(tokens[i])])
                   for i in np.flatnonzero(ends[: s.num_beams]) if scores[i] > -_FAR / 2]  # (not a beam ruled
            # out: -inf, or one kept running at -_FAR after its text ended, as a constraint can leave it)
            self.finished = sorted(self.finished + new, key=lambda hypothesis: -hypothesis[0])[: s.num_beams]
        kept = np.argsort(-(scores - _FAR * ends), kind="stable")[: s.num_beams]
        self.scores = scores[kept] - _FAR * ends[kept]
        self.running = [self.running[parents[i]] + [int(tokens[i])] for i in kept]
        if self.matchers is not None:
            self.matchers = [followed[i] for i in kept]
        longest = s.max_new_tokens if s.early_stopping == "never" and s.length_penalty > 0 else length
        worst = self.finished[-1][0] if len(self.finished) == s.num_beams else -_FAR
        self.improvable = self.improvable and self.scores[0] / longest ** s.length_penalty > worst
        full = len(self.finished) == s.num_beams
        self.done = not self.improvable or (full and s.early_stopping is True) or bool(ends.all())
        if self.done:
            self.caches = self.spare = []
        else:
            self._reorder(parents[kept])

    def fail(self, error: Exception) -> None:
        """Its search failed with ``error``: it is done, its caches freed."""
        self.error, self.done = error, True
        self.caches = self.spare = []

    def _follow(self, parent: int, token: int) -> Matcher:
        """A running beam's Matcher advanced by a token it allows: its own copy, as beams share a parent."""
        matcher = self.matchers[parent].fork()
        matcher.advance(token)
        return matcher

    def _reorder(self, parents: np.ndarray) -> None:
        """Each running beam's cache: its parent's own for the first child; for the others a free cache
        that reads the parent's rows in place (ModelCache.copy_prefix: nothing is copied)."""
        caches = [None] * len(parents)
        taken = set()
        for i, p in enumerate(parents):
            if p not in taken:
                caches[i] = self.caches[p]
                taken.add(p)
        free = [mc for q, mc in enumerate(self.caches) if q not in taken] + self.spare
        for i, p in enumerate(parents):
            if caches[i] is None:
                caches[i] = free.pop()
                caches[i].copy_prefix(self.caches[p])
        self.caches, self.spare = caches, free
