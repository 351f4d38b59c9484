"""Scoring text: every token's log-probability given those before it, and perplexity.

The forward pass runs over every position of a window; its head is a fused
log-softmax (matkernels._head_log_softmax) that keeps, per position, only the
target's log-probability and the argmax: no (T, vocab) array exists. Documents
longer than the context are scored in sliding windows, as in Hugging Face's guide
"Perplexity of fixed-length models"; many short documents share one pass.
Documents that begin with the same tokens (a context and its continuations) are
scored in groups: the shared rows run once into a cache, which is forked for each
member (reading those rows in place), and only the members' own rows run after it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..cpu.matkernels import _head_log_softmax
from ..errors import ConfigError, TokenTypeError
from ..model import checks
from ..model.forward import forward_pass
from ..model.kvcache import ModelCache, check_kv_dtype
from ..model.products import head_inputs
from ..model.weights import GPT2Weights
from .tokenizer import Tokenizer, resolve_tokenizer

# Rows of one scoring pass when documents share it. Each row holds its K and V (2 x n_layer x n_embd
# float32: 74 KB for GPT-2 small) and about 10 n_embd of activations for the pass; the head's chunk
# scores are rows x HEAD_CHUNK per thread. 1024 rows: 110 MB less at peak than 2048, for 2% of the
# speed of 200 short documents (measured with GPT-2 small, 2 threads).
BATCH_ROWS = 1024
# Leading tokens sequences must share to be scored as a group: fewer are cheaper run again than forked.
SHARED_MIN = 8
# Cache positions a scoring pass may allocate, in batch_rows: forks of contexts for the members' rows
# (4 x 1024 x 72 KB = 300 MB for GPT-2 small); larger passes of members waste less of each pass.
FORK_FACTOR = 4


@dataclasses.dataclass(frozen=True, eq=False)
class Score:
    """How likely each token of a sequence is given the ones before it.

    logprobs: float64 (len(ids) - 1,), log p(ids[i+1] | ids[..i]); nan where a token
    was not scored (only with stride == n_positions: a window's first token has no
    position before it inside the window). greedy: bool (len(ids) - 1,), whether
    ids[i+1] is the argmax there (False where not scored).
    """

    logprobs: np.ndarray
    greedy: np.ndarray

    @property
    def n_tokens(self) -> int:
        """Tokens scored."""
        return int(np.isfinite(self.logprobs).sum())

    @property
    def nll(self) -> float:
        """Negative log-likelihood of the scored tokens, in nats (0.0 for none)."""
        return float(-np.nansum(self.logprobs)) + 0.0  # (+ 0.0: no -0.0 for no tokens)

    @property
    def perplexity(self) -> float:
        """exp of the mean negative log-likelihood per scored token (nan for none)."""
        return math.exp(self.nll / self.n_tokens) if self.n_tokens else math.nan


def score(ids, w: GPT2Weights, *, stride: int | None = None, kv_dtype: str = "float32") -> Score:
    """Score every token of ``ids`` but the first: log p(ids[i+1] | ids[..i]).

    ids: 1-D integer ids in [0, vocab); fewer than two give a Score of 0 tokens.
    A sequence longer than n_positions is scored in windows that begin at 0,
    stride, 2 stride, ... (stride defaults to n_positions // 2) and end at
    min(begin + n_positions, len); each scores the tokens from the previous
    window's end to its own, from the logits of the position before each inside
    the window. ``kv_dtype`` (kvcache.KV_DTYPES) is how the windows' caches keep keys and
    values: the scores are then those of a model reading them so rounded. Raises TokenError /
    TokenTypeError for bad ids, ConfigError for a stride outside [1, n_positions] or a bad kv_dtype.
    """
    return score_batch([ids], w, stride=stride, kv_dtype=kv_dtype)[0]


def score_batch(sequences, w: GPT2Weights, *, stride: int | None = None,
                batch_rows: int = BATCH_ROWS, share: bool = True, kv_dtype: str = "float32") -> list[Score]:
    """score() for many sequences; those that fit the context share forward passes of up to batch_rows rows.

    With ``share``, sequences that begin with the same tokens (at least SHARED_MIN) run those
    rows once, in a cache forked for each (the same scores to float32 rounding).
    Returns one Score per sequence, in order. Raises as score, naming the sequence's index.
    """
    checks.weights(w)
    cfg = w.config
    stride = cfg.n_positions // 2 if stride is None else stride
    if not checks.is_integer(stride) or not 1 <= stride <= cfg.n_positions:
        raise ConfigError(f"stride must be an integer in [1, {cfg.n_positions}] (n_positions), got {stride!r}")
    if not checks.is_integer(batch_rows) or batch_rows < 1:
        raise ConfigError(f"batch_rows must be an integer >= 1, got {batch_rows!r}")
    check_kv_dtype(kv_dtype)
    sequences = checks.sequence(sequences, "sequences")
    docs = [checks.labelled(f"sequence {i}: ", _ids, ids, cfg.vocab_size) for i, ids in enumerate(sequences)]

    scores: list[Score | None] = [None] * len(docs)
    short = []  # (index, ids) of the documents one window holds
    for i, ids in enumerate(docs):
        if len(ids) < 2:
            scores[i] = Score(np.empty(0), np.zeros(0, bool))
        elif len(ids) > cfg.n_positions:
            scores[i] = _windows(ids, w, stride, kv_dtype)
        else:
            short.append((i, ids))
    results = _score_ends([ids for _, ids in short], [len(ids) - 1 for _, ids in short], w,
                          share=share, batch_rows=batch_rows, kv_dtype=kv_dtype)
    for (i, _), result in zip(short, results):
        scores[i] = Score(*result)
    return scores


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of logits (R, vocab) as log-probabilities, a new (R, vocab) float64 array."""
    z = logits.astype(np.float64)
    peak = z.max(axis=1, keepdims=True)
    z -= peak + np.log(np.exp(z - peak).sum(axis=1, keepdims=True))
    return z


def passes(items: list, rows_of, budget: int = BATCH_ROWS):
    """items in consecutive groups of at most ``budget`` rows (rows_of(item) each), one forward pass a group.

    An item of more rows than the budget makes a group of its own.
    """
    group, rows = [], 0
    for item in items:
        if group and rows + rows_of(item) > budget:
            yield group
            group, rows = [], 0
        group.append(item)
        rows += rows_of(item)
    if group:
        yield group


def score_text(text: str, w: GPT2Weights, tokenizer: Tokenizer | None = None, **options) -> Score:
    """score() of a text's tokens (GPT-2's BPE; a checkpoint's own tokenizer where given)."""
    if not isinstance(text, str):
        raise TokenTypeError(f"text must be a str, got {type(text).__name__}")
    return score(resolve_tokenizer(tokenizer).encode(text), w, **options)


def perplexity(text: str, w: GPT2Weights, tokenizer: Tokenizer | None = None, **options) -> float:
    """The perplexity of a text under the model: exp of the mean NLL per scored token."""
    return score_text(text, w, tokenizer, **options).perplexity


def _ids(ids, vocab_size: int) -> np.ndarray:
    """A document's ids, checked; empty is allowed (it scores 0 tokens)."""
    empty_array = isinstance(ids, np.ndarray) and ids.shape == (0,) and ids.dtype.kind in "iu"
    if empty_array or isinstance(ids, (list, tuple)) and len(ids) == 0:
        return np.zeros(0, np.int64)
    return checks.token_ids(ids, vocab_size)


def _windows(ids: np.ndarray, w: GPT2Weights, stride: int, kv_dtype: str = "float32") -> Score:
    """Sliding windows over a sequence longer than the context (Hugging Face's guide), BATCH_ROWS rows a pass."""
    L, n = len(ids), w.config.n_positions
    plan = []  # (begin, end, first token it scores)
    scored_to = 0  # tokens before this index are scored (or are the first)
    for begin in range(0, L, stride):
        end = min(begin + n, L)
        first = max(scored_to, begin + 1)
        if first < end:  # (a one-token last window, after windows that do not overlap, scores nothing)
            plan.append((begin, end, first))
        scored_to = end
        if end == L:
            break
    logprobs, greedy = np.full(L - 1, np.nan), np.zeros(L - 1, bool)
    for group in passes(plan, lambda window: window[1] - window[0]):
        scored = _score_windows([ids[b:e] for b, e, _ in group], w, kv_dtype)
        for (begin, end, first), (lp, gr) in zip(group, scored):
            # lp[j]: token begin + j + 1 from position begin + j
            logprobs[first - 1:end - 1] = lp[first - begin - 1:]
            greedy[first - 1:end - 1] = gr[first - begin - 1:]
    return Score(logprobs, greedy)


def _targets(ids: np.ndarray) -> np.ndarray:
    """What each position of a window predicts: the next id, and none (-1) after the last."""
    return np.append(ids[1:], -1)


def _score_windows(windows: list[np.ndarray], w: GPT2Weights,
                   kv_dtype: str = "float32") -> list[tuple[np.ndarray, np.ndarray]]:
    """Each window from a fresh context, all in one forward pass: (logprobs, greedy) of its own next ids.

    windows: checked int64 ids, 1 <= len <= n_positions each; the last position predicts nothing.
    """
    caches = [ModelCache(w.config, max_len=len(ids), dtype=kv_dtype) for ids in windows]
    return _score_pass(windows, [_targets(ids) for ids in windows], caches, [(0, len(ids) - 1) for ids in windows], w)


def _score_pass(inputs, targets, caches, spans, w: GPT2Weights) -> list[tuple[np.ndarray, np.ndarray]]:
    """One forward pass: inputs[b], int64 (T_b,), continues caches[b]; (logprobs, greedy) of its rows lo..hi-1.

    targets[b]: int64 (T_b,), the id each row predicts; spans[b] = (lo, hi): the rows scored (the
    others only fill the cache: the head, a third of GPT-2 small's work a row, skips them).
    """
    starts = np.cumsum([0] + [len(ids) for ids in inputs])
    rows = np.concatenate([np.arange(start + lo, start + hi) for start, (lo, hi) in zip(starts, spans)])
    wanted = np.concatenate(targets)[rows]
    scale = w.scales["wte"] if w.scales else None

    def head(h, chunks):
        logprob, best = np.empty(len(rows)), np.empty(len(rows), np.int64)
        if len(rows):
            _head_log_softmax(w.wte, scale, head_inputs(w, h[rows]), wanted, logprob, best, chunks)
        return logprob, best

    logprob, best = forward_pass(list(inputs), w, caches, head, every_row=True)
    greedy, bounds = best == wanted, np.cumsum([0] + [hi - lo for lo, hi in spans])
    return [(logprob[a:b], greedy[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _score_ends(seqs: list[np.ndarray], counts: list[int], w: GPT2Weights, *, share: bool = True,
                batch_rows: int = BATCH_ROWS, kv_dtype: str = "float32") -> list[tuple[np.ndarray, np.ndarray]]:
    """(logprobs, greedy) of the last counts[i] tokens of each sequence, each from the tokens before it.

    seqs[i]: checked int64 ids, 2 <= len <= n_positions + 1 (all but the last token are fed);
    0 <= counts[i] < len. With ``share``, a group of sequences that begin alike (see _groups) runs
    its c shared rows once (its context) into one cache, forked for each member; then only the
    members' own rows run. Only the rows of scored tokens go through the head.
    """
    out: list = [None] * len(seqs)
    fed = [len(ids) - 1 for ids in seqs]  # rows fed: every token but the last
    first = [n - k for n, k in zip(fed, counts)]  # the first row scored
    groups = _groups(seqs) if share else [(0, [i]) for i in range(len(seqs))]
    held = {}  # group -> its context's cache, first row scored and scores, until its last member runs
    for part in _plan(groups, fed, batch_rows):
        inputs, targets, caches, spans = [], [], [], []
        for g, i in part:
            c, members = groups[g]
            if i is None:  # the context: rows 0..c-1 of the first member, the same in all (ids and targets)
                ids = seqs[members[0]]
                inputs.append(ids[:c])
                targets.append(_targets(ids)[:c])
                caches.append(ModelCache(w.config, max_len=fed[members[-1]], dtype=kv_dtype))  # the last member's
                spans.append((min(c, *(first[m] for m in members)), c))
            else:  # a member's own rows, in a fork of its context (the last member in the context's own cache)
                inputs.append(seqs[i][c:-1])
                targets.append(_targets(seqs[i])[c:-1])
                if not c:
                    caches.append(ModelCache(w.config, max_len=fed[i], dtype=kv_dtype))
                else:
                    caches.append(held[g][0] if i == members[-1] else held[g][0].fork(max_len=fed[i]))
                spans.append((max(first[i] - c, 0), fed[i] - c))
        for (g, i), mc, (lo, _), scored in zip(part, caches, spans, _score_pass(inputs, targets, caches, spans, w)):
            c, members = groups[g]
            if i is None:
                held[g] = (mc, lo, scored)
                continue
            logprob, greedy = scored
            if first[i] < c:  # its first scored tokens are in the context's rows
                _, lo, (lp, gr) = held[g]
                logprob = np.concatenate([lp[first[i] - lo:], logprob])
                greedy = np.concatenate([gr[first[i] - lo:], greedy])
            out[i] = (logprob, greedy)
            if c and i == members[-1]:
                del held[g]
    return out


def _plan(groups: list[tuple[int, list[int]]], fed: list[int], batch_rows: int):
    """The forward passes: lists of (group, member), member None for the group's context.

    Contexts come by chunks of up to batch_rows rows, each chunk's members after them, so a pass
    holds the members of one chunk beside the contexts of the next: few, full passes. A member
    never shares a pass with its context; a pass runs at most batch_rows rows (unless one job has
    more) and its new caches hold at most FORK_FACTOR * batch_rows positions.
    """
    jobs = []
    for chunk in passes(list(range(len(groups))), lambda g: groups[g][0] or fed[groups[g][1][0]], batch_rows):
        jobs += [(g, None) for g in chunk if groups[g][0]] + [(g, i) for g in chunk for i in groups[g][1]]
    part, rows, positions, contexts = [], 0, 0, set()
    for g, i in jobs:
        c, members = groups[g]
        if i is None:
            job_rows, job_positions = c, fed[members[-1]]
        else:
            job_rows, job_positions = fed[i] - c, 0 if c and i == members[-1] else fed[i]
        if part and (i is not None and g in contexts or rows + job_rows > batch_rows
                     or positions + job_positions > FORK_FACTOR * batch_rows):
            yield part
            part, rows, positions, contexts = [], 0, 0, set()
        part.append((g, i))
        rows, positions = rows + job_rows, positions + job_positions
        if i is None:
            contexts.add(g)
    if part:
        yield part


def _groups(seqs: list[np.ndarray]) -> list[tuple[int, list[int]]]:
    """The sequences as groups (c, members): the members' first c + 1 tokens are the same, so their
    first c rows (ids and targets) are, and each has rows of its own after them (c <= len - 2).

    Sorted, sequences that begin alike are neighbours. One joins the group before it when they share
    at least SHARED_MIN rows and it saves more rows than shortening c costs the group. A sequence in
    a group of its own has c = 0.
    """
    groups: list[tuple[int, list[int]]] = []
    # (descending: a sequence comes after those it begins, so it cannot cut a group's c down to its length)
    for i in sorted(range(len(seqs)), key=lambda i: seqs[i].tolist(), reverse=True):
        ids = seqs[i]
        if groups:
            c, members = groups[-1]
            limit = c if len(members) > 1 else len(seqs[members[0]]) - 2
            joined = min(limit, _common(seqs[members[-1]], ids) - 1, len(ids) - 2)
            # rows saved: ``joined`` of this one's; rows lost: c - joined for each member but one
            if joined >= SHARED_MIN and joined > (limit - joined) * (len(members) - 1):
                groups[-1] = (joined, members + [i])
                continue
        groups.append((0, [i]))
    return groups


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
