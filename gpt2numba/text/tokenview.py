"""A text as the model sees it: every token's log-probability, rank and likeliest alternatives.

GLTR (Gehrmann et al., 2019) colours each token of a text by its rank under GPT-2; OpenAI's playground
showed each token's probability beside the alternatives. ``inspect_ids`` computes both for every token
of a text in one forward pass over <|endoftext|> + the text's ids: the first token is predicted from
<|endoftext|>, as lm-eval's rolling log-likelihood does, so every token has a probability. The pass is
forward.forward_pass over every row, as scoring.py's; its head turns HEAD_ROWS rows at a time into logits
and keeps, per row, their log-sum-exp, the target's logit, how many logits are larger and the k
largest (_rows, one kernel with two passes over a row): no (tokens, vocab) array exists, only
(HEAD_ROWS, vocab) at a time.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from numba import njit, prange

from ..cpu import numbacache
from ..cpu.chunks import _claimed
from ..cpu.kernels import FASTMATH, _exp_inplace
from ..errors import ConfigError, TokenError, TokenTypeError
from ..model import checks
from ..model.forward import checked_prompt, forward_pass, logits_head
from ..model.kvcache import ModelCache, check_kv_dtype
from ..model.weights import GPT2Weights
from .tokenizer import Tokenizer, resolve_tokenizer

MAX_TOP = 20  # alternatives a token may list, as the server's logprobs (OpenAI's legacy API: 5)
HEAD_ROWS = 64  # rows of logits at a time: 64 x 50257 float32 is 13 MB


@dataclasses.dataclass(frozen=True, eq=False)
class Inspection:
    """Every token of a text under the model, T tokens and k alternatives each.

    ids: int64 (T,); texts: each token's bytes decoded alone (a character split across tokens is
    U+FFFD in each); offsets: int64 (T, 2), each token's bytes [start, end) in the text's UTF-8;
    logprobs: float64 (T,), log p(token | <|endoftext|> and the tokens before it); ranks: int64
    (T,), 1 + how many vocabulary entries have a larger logit (1: the model's likeliest token);
    top_ids: int64 (T, k) and top_logprobs: float64 (T, k), the k likeliest tokens at each position,
    likeliest first (equal ones: the lower id first); top_texts: their texts.
    """

    ids: np.ndarray
    texts: list[str]
    offsets: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    top_texts: list[list[str]]

    @property
    def perplexity(self) -> float:
        """exp of the mean negative log-probability over every token (nan for none)."""
        return math.exp(-float(self.logprobs.mean())) if len(self.logprobs) else math.nan

    def tokens(self) -> list[dict]:
        """One dict a token, as POST /v1/inspect lists them: id, text, offset, logprob, rank, top_logprobs."""
        return [{"id": int(t), "text": text, "offset": [int(a), int(b)], "logprob": float(lp), "rank": int(r),
                 "top_logprobs": [{"id": int(i), "text": s, "logprob": float(v)}
                                  for i, s, v in zip(top_i, top_s, top_v)]}
                for t, text, (a, b), lp, r, top_i, top_s, top_v in zip(
                    self.ids, self.texts, self.offsets, self.logprobs, self.ranks, self.top_ids, self.top_texts,
                    self.top_logprobs)]


def inspect_ids(ids, w: GPT2Weights, tokenizer: Tokenizer | None = None, *, top_logprobs: int = 5,
                kv_dtype: str = "float32") -> Inspection:
    """Each token of ``ids`` given <|endoftext|> and the tokens before it, in one forward pass.

    ids: non-empty 1-D integer ids in [0, vocab), at most n_positions - 1 of them (<|endoftext|>
    takes the first position); tokenizer: whose texts and <|endoftext|> (GPT-2's if None);
    top_logprobs: the alternatives each token lists, 0 to MAX_TOP. Returns an Inspection. Raises
    TokenError / TokenTypeError for bad or too many ids, ConfigError for a bad top_logprobs or kv_dtype.
    """
    checks.weights(w)
    tokenizer = resolve_tokenizer(tokenizer)
    if not checks.is_integer(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP:
        raise ConfigError(f"top_logprobs must be an integer in [0, {MAX_TOP}], got {top_logprobs!r}")
    check_kv_dtype(kv_dtype)
    cfg = w.config
    ids = checks.token_ids(ids, cfg.vocab_size)
    if len(ids) > cfg.n_positions - 1:
        raise TokenError(f"a text of {len(ids)} tokens is too long to inspect in one pass: at most "
                         f"{cfg.n_positions - 1} (n_positions {cfg.n_positions}, one for <|endoftext|> before it)")
    fed = np.concatenate([[tokenizer.eot_id], ids[:-1]]).astype(np.int64)  # row i predicts ids[i]
    mc = ModelCache(cfg, max_len=len(fed), dtype=kv_dtype)
    logits_of, k, T = logits_head(w), int(top_logprobs), len(ids)
    logprobs, ranks = np.empty(T), np.empty(T, np.int64)
    top_ids, top_values = np.empty((T, k), np.int64), np.empty((T, k))

    def head(h: np.ndarray, chunks: int) -> None:  # h: (T, n_embd), every row after ln_f
        for r0 in range(0, T, HEAD_ROWS):
            r1 = min(T, r0 + HEAD_ROWS)
            _rows(logits_of(h[r0:r1], chunks), ids[r0:r1], logprobs[r0:r1], ranks[r0:r1], top_ids[r0:r1],
                  top_values[r0:r1], chunks)

    forward_pass([checked_prompt(fed, w, mc, "")], w, [mc], head, every_row=True)
    text_of = _Texts(tokenizer)
    lengths = np.array([len(tokenizer.token_bytes(int(t))) for t in ids], np.int64)
    ends = np.cumsum(lengths)
    return Inspection(ids, [text_of(t) for t in ids], np.stack([ends - lengths, ends], axis=1), logprobs, ranks,
                      top_ids, top_values, [[text_of(t) for t in row] for row in top_ids])


def inspect_text(text: str, w: GPT2Weights, tokenizer: Tokenizer | None = None, **options) -> Inspection:
    """inspect_ids of a text's tokens (GPT-2's BPE; a checkpoint's own tokenizer where given)."""
    if not isinstance(text, str):
        raise TokenTypeError(f"text must be a str, got {type(text).__name__}")
    tokenizer = resolve_tokenizer(tokenizer)
    return inspect_ids(tokenizer.encode(text), w, tokenizer, **options)


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _rows(logits, targets, logprob, rank, top_ids, top_values, n_workers):
    """What each row of logits says of its target, into the outputs' rows; a chunk is a row.

    logits: float32 (R, V); targets: int64 (R,); logprob: float64 (R,), log softmax at the target (as
    scoring's fused head: float32 exponentials of logit - max, kernels._exp_inplace's, summed in float64);
    rank: int64 (R,), 1 + the logits strictly above the target's; top_ids: int64 (R, k) and top_values:
    float64 (R, k), the k largest as log-probabilities, largest first, equal ones by the lower id.
    """
    R, V = logits.shape
    k = top_ids.shape[1]
    nxt = np.zeros(1, np.int64)  # the next row (chunks.py)
    for _ in prange(n_workers):  # iterations, each with buffers of its own
        e = np.empty(V, np.float32)  # (V,) logit - max, then its exponential
        bits = np.empty(V, np.int32)
        best = np.empty(max(k, 1), np.float32)  # (k,) the largest logits so far, largest first
        which = np.empty(max(k, 1), np.int64)
        for r in _claimed(nxt, R):
            row = logits[r]
            own, peak, above = row[targets[r]], row.max(), 0
            for t in range(V):
                e[t] = row[t] - peak
                above += row[t] > own
            _exp_inplace(e, bits)
            total = 0.0
            for t in range(V):
                total += e[t]
            lse = np.float64(peak) + math.log(total)
            logprob[r] = np.float64(own) - lse
            rank[r] = 1 + above
            filled = 0
            for t in range(V if k else 0):  # ids in order: an equal logit never passes one before it
                v = row[t]
                if filled == k and not v > best[k - 1]:
                    continue
                at = min(filled, k - 1)
                while at > 0 and best[at - 1] < v:
                    best[at], which[at] = best[at - 1], which[at - 1]
                    at -= 1
                best[at], which[at] = v, t
                filled = min(filled + 1, k)
            for j in range(k):
                top_ids[r, j] = which[j]
                top_values[r, j] = np.float64(best[j]) - lse


class _Texts:
    """token id -> its text, decoded alone (as OpenAI's logprobs' tokens), each id decoded once."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self._text = tokenizer, {}

    def __call__(self, token) -> str:
        token = int(token)
        text = self._text.get(token)
        if text is None:
            text = self._text[token] = self.tokenizer.decode([token])
        return text


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)
