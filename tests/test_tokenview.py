"""tokenview.inspect_ids: every token's log-probability, rank and alternatives against a full-vocabulary recount
on the float64 oracle, against score(), and its byte offsets against the text.

Each test names the bug it catches; each was seen to fail once with that bug planted by hand.
"""

import numpy as np
import pytest

import gpt2numba as g
from conftest import TINY_GPT2
from gpt2numba.text import tokenview
from gpt2numba.text.tokenview import MAX_TOP, inspect_ids, inspect_text

TOL = 1e-5  # float32 logits against float64: what the issue asks of log-probabilities
# a character split across tokens: GPT-2's BPE cuts 日本語 into bytes of its characters
TEXTS = ["The quick brown fox jumps over the lazy dog.", "naïve 日本語 🙂 ok\n\nnew  lines\tand tabs",
         "<|endoftext|> inside, and digits 12345"]


@pytest.fixture(scope="module")
def w():
    return g.random_weights(TINY_GPT2, seed=3)


@pytest.fixture(scope="module")
def tokenizer():
    return g.load_tokenizer()


def log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def recount(ids, w, tokenizer):
    """The oracle's (T, V) logits of every token from <|endoftext|> and those before it, its log-softmax, and each
    token's rank counted over the whole vocabulary: 1 + the logits strictly above its own."""
    logits = g.recompute_all_logits([tokenizer.eot_id, *ids[:-1]], w)  # (T, V) float64: row i predicts ids[i]
    own = logits[np.arange(len(ids)), ids]
    return logits, log_softmax(logits), 1 + (logits > own[:, None]).sum(axis=1)


def rank_bounds(logits, ids, w, tokenizer):
    """The ranks the engine's float32 logits could give, from the oracle's: entries more than twice the
    engine's largest error above the token's own are above it in any case, those closer may be on either side.
    (Random weights pack 50257 logits into a few units: 1e-5 would hold a neighbour or two of most tokens.)"""
    fed = [tokenizer.eot_id, *ids[:-1]]
    error = np.abs(g.prefill(fed, w, g.ModelCache(w.config), logits="all") - logits).max()
    assert error < 1e-5
    tol = max(2 * error, 1e-7)
    own = logits[np.arange(len(ids)), ids][:, None]
    return 1 + (logits - own > tol).sum(axis=1), (logits - own > -tol).sum(axis=1)  # (the token itself: -1 + 1)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("head_rows", [64, 5])  # 5: the head's rows in chunks, the last one short
def test_against_the_oracle_recount(text, head_rows, w, tokenizer, monkeypatch):
    """Log-probabilities, ranks and the top 20 equal a recount over every vocabulary entry on the oracle.

    Catches: a token scored from the logits after it rather than before (no <|endoftext|> row, an
    off-by-one), a rank counted from 0 or with >= (the token itself), the log-sum-exp of another row or
    of a chunk's first row only, alternatives out of order or off by the log-sum-exp."""
    monkeypatch.setattr(tokenview, "HEAD_ROWS", head_rows)
    ids = tokenizer.encode(text)
    got = inspect_ids(ids, w, tokenizer, top_logprobs=MAX_TOP)
    logits, ref, ranks = recount(ids, w, tokenizer)
    T = len(ids)
    np.testing.assert_array_equal(got.ids, ids)
    np.testing.assert_allclose(got.logprobs, ref[np.arange(T), ids], rtol=0, atol=TOL)
    low, high = rank_bounds(logits, ids, w, tokenizer)
    assert np.all((low <= got.ranks) & (got.ranks <= high)), (got.ranks, low, high)
    exact = low == high  # no other logit that close to the token's own: the rank is one number
    assert exact.mean() > 0.5, "the recount is vacuous: most ranks are near a tie"
    np.testing.assert_array_equal(got.ranks[exact], ranks[exact])
    best = np.sort(ref, axis=1)[:, ::-1][:, :MAX_TOP]  # (T, 20) the oracle's largest, in order
    np.testing.assert_allclose(got.top_logprobs, best, rtol=0, atol=TOL)
    np.testing.assert_allclose(got.top_logprobs, np.take_along_axis(ref, got.top_ids, axis=1), rtol=0, atol=TOL)
    assert np.all(np.diff(got.top_logprobs, axis=1) <= 0)
    assert got.top_texts == [[tokenizer.decode([int(t)]) for t in row] for row in got.top_ids]


def test_ranks_of_chosen_tokens(w, tokenizer):
    """A text built token by token from the oracle's own choices: the likeliest (rank 1), the second, the
    twelfth...; the inspection gives back exactly those ranks, and the first alternative of a rank-1 token
    is the token itself. Catches a rank of 0 or 2 for the likeliest token, ranks counted over the wrong row."""
    wanted = [1, 2, 1, 5, 12, 1, 3, 1, 1, 30, 2, 1]
    ids = []
    for rank in wanted:
        logits = g.recompute_logits([tokenizer.eot_id, *ids], w)  # (V,) float64
        ids.append(int(np.argsort(-logits, kind="stable")[rank - 1]))
    got = inspect_ids(ids, w, tokenizer)
    low, high = rank_bounds(recount(ids, w, tokenizer)[0], ids, w, tokenizer)
    assert np.all(low == high), "a chosen token is within float32's error of another: pick other ranks"
    assert got.ranks.tolist() == wanted
    for rank, token, top in zip(wanted, ids, got.top_ids):
        assert (top[0] == token) == (rank == 1)
        assert len(top) == 5


@pytest.mark.parametrize("text", TEXTS)
def test_logprobs_equal_score(text, w, tokenizer):
    """The same log-probabilities as score() of <|endoftext|> + the ids, and the same perplexity. Catches a
    log-softmax that differs from scoring's fused head (another exp, a sum in float32)."""
    ids = tokenizer.encode(text)
    got = inspect_ids(ids, w, tokenizer)
    s = g.score([tokenizer.eot_id, *ids], w)
    np.testing.assert_allclose(got.logprobs, s.logprobs, rtol=0, atol=TOL)
    assert got.perplexity == pytest.approx(s.perplexity, rel=TOL)
    np.testing.assert_array_equal(got.ranks == 1, s.greedy)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_compact_weights_equal_score(dtype, tokenizer):
    """The compact formats' head (bfloat16's widened rows, int8's integer tiles) gives score()'s numbers too."""
    w = g.random_weights(TINY_GPT2, seed=3, dtype=dtype)
    ids = tokenizer.encode(TEXTS[0])
    np.testing.assert_allclose(inspect_ids(ids, w, tokenizer).logprobs, g.score([tokenizer.eot_id, *ids], w).logprobs,
                               rtol=0, atol=TOL)


@pytest.mark.parametrize("text", TEXTS)
def test_offsets_reassemble_the_text(text, w, tokenizer):
    """Each token's [start, end) holds its own bytes, and they follow each other to the text's end, a character
    split across tokens included (its pieces' texts are U+FFFD, their offsets exact). Catches offsets counted in
    characters, or from the decoded texts (whose U+FFFD is 3 bytes)."""
    data = text.encode("utf-8")
    got = inspect_text(text, w, tokenizer)
    starts, ends = got.offsets[:, 0], got.offsets[:, 1]
    assert starts[0] == 0 and ends[-1] == len(data) and np.all(starts[1:] == ends[:-1])
    for token, (a, b), piece in zip(got.ids, got.offsets, got.texts):
        assert data[a:b] == tokenizer.token_bytes(int(token))
        assert piece == tokenizer.decode([int(token)])
    if "日本語" in text:
        assert any("\ufffd" in piece for piece in got.texts), "no character was split: the case is not covered"
        assert "".join(got.texts) != text


def test_tokens_as_json(w, tokenizer):
    """tokens() lists each token as POST /v1/inspect does, with plain Python numbers."""
    got = inspect_text(TEXTS[1], w, tokenizer, top_logprobs=3)
    first = got.tokens()[0]
    assert set(first) == {"id", "text", "offset", "logprob", "rank", "top_logprobs"}
    assert type(first["id"]) is int and type(first["logprob"]) is float and type(first["rank"]) is int
    assert [a["id"] for a in first["top_logprobs"]] == got.top_ids[0].tolist()
    assert first["offset"] == got.offsets[0].tolist() and len(got.tokens()) == len(got.ids)


def test_the_longest_text_and_one_more(w, tokenizer):
    """n_positions - 1 tokens fit (with <|endoftext|> before them); one more is refused, naming the limit."""
    n = w.config.n_positions
    ids = [11] * (n - 1)
    assert len(inspect_ids(ids, w, tokenizer).logprobs) == n - 1
    with pytest.raises(g.TokenError, match=f"{n} tokens .* at most {n - 1} "):
        inspect_ids(ids + [11], w, tokenizer)


def test_bad_arguments(w, tokenizer):
    for top in (-1, MAX_TOP + 1, 2.0, True):
        with pytest.raises(g.ConfigError, match="top_logprobs"):
            inspect_ids([1, 2], w, tokenizer, top_logprobs=top)
    with pytest.raises(g.TokenError, match="empty"):
        inspect_ids([], w, tokenizer)
    with pytest.raises(g.TokenError, match="outside"):
        inspect_ids([1, w.config.vocab_size], w, tokenizer)
    with pytest.raises(g.TokenTypeError):
        inspect_text(b"bytes", w, tokenizer)
    got = inspect_ids([1, 2], w, tokenizer, top_logprobs=0)
    assert got.top_ids.shape == (2, 0) and got.tokens()[0]["top_logprobs"] == []


def test_the_row_kernel_on_ties():
    """tokenview._rows on logits with ties, against a plain loop: a rank counts only the logits strictly above
    (a tie with the likeliest is rank 1), equal alternatives come by the lower id, the log-sum-exp is the row's.
    Catches >= for >, a later id kept ahead of an equal earlier one, rows mixed up."""
    logits = np.array([[1, 3, 3, 2, 3, 0], [0, 0, 0, 0, 0, 5], [2, 2, 2, 2, 2, 2]], np.float32)
    targets = np.array([0, 5, 4])
    k = 4
    logprob, rank = np.empty(3), np.empty(3, np.int64)
    top_ids, top_values = np.empty((3, k), np.int64), np.empty((3, k))
    tokenview._rows(logits, targets, logprob, rank, top_ids, top_values, 4)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(axis=1))
    np.testing.assert_allclose(logprob, logits[np.arange(3), targets] - lse, rtol=0, atol=1e-6)
    assert rank.tolist() == [5, 1, 1]
    assert top_ids.tolist() == [[1, 2, 4, 3], [5, 0, 1, 2], [0, 1, 2, 3]]
    np.testing.assert_allclose(top_values, np.take_along_axis(logits, top_ids, axis=1) - lse[:, None], atol=1e-6)
