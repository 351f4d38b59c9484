"""Scoring text: every token's log-probability given those before it, and perplexity.

The forward pass runs over every position of a window; its head is a fused
log-softmax (kernels._head_log_softmax) that keeps, per position, only the
target's log-probability and the argmax: no (T, vocab) array exists. Documents
longer than the context are scored in sliding windows, as in Hugging Face's guide
"Perplexity of fixed-length models"; many short documents share one pass.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import checks
from .errors import ConfigError, TokenTypeError
from .forward import _forward, head_inputs
from .matkernels import _head_log_softmax
from .kvcache import ModelCache
from .sample import _tokenizer
from .tokenizer import Tokenizer
from .weights import GPT2Weights

# Rows of one scoring pass when documents share it. Each row holds its K and V (2 x n_layer x n_embd
# float32: 74 KB for GPT-2 small) and about 10 n_embd of activations for the pass; the head's chunk
# scores are rows x HEAD_CHUNK per thread. 1024 rows: 110 MB less at peak than 2048, for 2% of the
# speed of 200 short documents (measured with GPT-2 small, 2 threads).
BATCH_ROWS = 1024


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


def score(ids, w: GPT2Weights, *, stride: int | None = None) -> Score:
    """Score every token of ``ids`` but the first: log p(ids[i+1] | ids[..i]).

    ids: 1-D integer ids in [0, vocab); fewer than two give a Score of 0 tokens.
    A sequence longer than n_positions is scored in windows that begin at 0,
    stride, 2 stride, ... (stride defaults to n_positions // 2) and end at
    min(begin + n_positions, len); each scores the tokens from the previous
    window's end to its own, from the logits of the position before each inside
    the window. Raises TokenError / TokenTypeError for bad ids, ConfigError for a
    stride outside [1, n_positions].
    """
    return score_batch([ids], w, stride=stride)[0]


def score_batch(sequences, w: GPT2Weights, *, stride: int | None = None,
                batch_rows: int = BATCH_ROWS) -> list[Score]:
    """score() for many sequences; those that fit the context share forward passes of up to batch_rows rows.

    Returns one Score per sequence, in order. Raises as score, naming the sequence's index.
    """
    checks.weights(w)
    cfg = w.config
    stride = cfg.n_positions // 2 if stride is None else stride
    if not checks.is_integer(stride) or not 1 <= stride <= cfg.n_positions:
        raise ConfigError(f"stride must be an integer in [1, {cfg.n_positions}] (n_positions), got {stride!r}")
    if not checks.is_integer(batch_rows) or batch_rows < 1:
        raise ConfigError(f"batch_rows must be an integer >= 1, got {batch_rows!r}")
    sequences = checks.sequence(sequences, "sequences")
    docs = [checks.labelled(f"sequence {i}: ", _ids, ids, cfg.vocab_size) for i, ids in enumerate(sequences)]

    scores: list[Score | None] = [None] * len(docs)
    short = []  # (index, ids) of the documents one window holds
    for i, ids in enumerate(docs):
        if len(ids) < 2:
            scores[i] = Score(np.empty(0), np.zeros(0, bool))
        elif len(ids) > cfg.n_positions:
            scores[i] = _windows(ids, w, stride)
        else:
            short.append((i, ids))
    for group in passes(short, lambda item: len(item[1]), batch_rows):
        for (i, _), result in zip(group, _score_windows([ids for _, ids in group], w)):
            scores[i] = Score(*result)
    return scores


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
    return score(_tokenizer(tokenizer).encode(text), w, **options)


def perplexity(text: str, w: GPT2Weights, tokenizer: Tokenizer | None = None, **options) -> float:
    """The perplexity of a text under the model: exp of the mean NLL per scored token."""
    return score_text(text, w, tokenizer, **options).perplexity


def _ids(ids, vocab_size: int) -> np.ndarray:
    """A document's ids, checked; empty is allowed (it scores 0 tokens)."""
    empty_array = isinstance(ids, np.ndarray) and ids.shape == (0,) and ids.dtype.kind in "iu"
    if empty_array or isinstance(ids, (list, tuple)) and len(ids) == 0:
        return np.zeros(0, np.int64)
    return checks.token_ids(ids, vocab_size)


def _windows(ids: np.ndarray, w: GPT2Weights, stride: int) -> Score:
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
        for (begin, end, first), (lp, gr) in zip(group, _score_windows([ids[b:e] for b, e, _ in group], w)):
            # lp[j]: token begin + j + 1 from position begin + j
            logprobs[first - 1:end - 1] = lp[first - begin - 1:]
            greedy[first - 1:end - 1] = gr[first - begin - 1:]
    return Score(logprobs, greedy)


def _targets(ids: np.ndarray) -> np.ndarray:
    """What each position of a window predicts: the next id, and none (-1) after the last."""
    return np.append(ids[1:], -1)


def _score_windows(windows: list[np.ndarray], w: GPT2Weights,
                   targets: list[np.ndarray] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each window from a fresh context, all in one forward pass: (logprobs, greedy) of what it predicts.

    windows: checked int64 ids, 1 <= len <= n_positions each. targets: for each window,
    the id each position predicts (as long as the window); by default the window's own
    next ids, so the last position predicts nothing and is left out of the result.
    """
    caches = [ModelCache(w.config, max_len=len(ids)) for ids in windows]
    own = targets is None
    targets = np.concatenate([_targets(ids) for ids in windows] if own else targets)
    scale = w.scales["wte"] if w.scales else None

    def head(h, chunks):
        logprob, best = np.empty(len(h)), np.empty(len(h), np.int64)
        _head_log_softmax(w.wte, scale, head_inputs(w, h), targets, logprob, best, chunks)
        return logprob, best

    logprob, best = _forward(windows, w, caches, head, every_row=True)
    out, start = [], 0
    for ids in windows:
        rows = slice(start, start + len(ids) - own)  # with its own targets, the last row predicts nothing
        out.append((logprob[rows], best[rows] == targets[rows]))
        start += len(ids)
    return out

