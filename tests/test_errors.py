"""Every bad input raises the project's own error, names the problem, and changes nothing."""

import dataclasses

import numpy as np
import pytest

import gpt2numba as g
from conftest import TINY


@pytest.fixture
def filled(tiny):
    """A cache holding 5 positions, and a snapshot of everything in it."""
    mc = g.ModelCache(TINY, max_len=8)
    g.prefill([1, 2, 3, 4, 5], tiny, mc)
    return mc, (mc.length, mc.lengths, mc.k.copy(), mc.v.copy())


def assert_unchanged(mc, snapshot):
    length, lengths, k, v = snapshot
    assert mc.length == length
    np.testing.assert_array_equal(mc.lengths, lengths)
    np.testing.assert_array_equal(mc.k, k)
    np.testing.assert_array_equal(mc.v, v)


@pytest.mark.parametrize("prompt, error, match", [
    ([], g.TokenError, "empty"),
    (np.array([], np.int64), g.TokenError, "empty"),
    ([1, 512], g.TokenError, r"512 is outside \[0, 512\)"),
    ([-1], g.TokenError, r"-1 is outside \[0, 512\)"),
    (np.array([7, 600]), g.TokenError, r"600 at index 1 is outside \[0, 512\)"),
    (np.array([-3], np.int8), g.TokenError, "-3"),
    ([1, 2**70], g.TokenError, "outside"),
    ([1.0, 2.0], g.TokenTypeError, "must be an integer, got 1.0"),
    (np.array([1.5]), g.TokenTypeError, "float64"),
    ([True], g.TokenTypeError, "True"),
    (np.array([True, False]), g.TokenTypeError, "bool"),
    ("hello", g.TokenTypeError, "str"),
    ([b"x"], g.TokenTypeError, "bytes"),
    (["3"], g.TokenTypeError, "'3'"),
    (7, g.TokenTypeError, "int"),
    (np.ones((2, 2), np.int64), g.TokenError, r"1-D.*\(2, 2\)"),
    ([1, 2, 3, 4], g.CacheFullError, "4 tokens.*holds 5 of max_len=8.*room for 3"),
])
def test_bad_prompt(tiny, filled, prompt, error, match):
    mc, snapshot = filled
    with pytest.raises(error, match=match):
        g.prefill(prompt, tiny, mc)
    assert_unchanged(mc, snapshot)


@pytest.mark.parametrize("token, error, match", [
    (512, g.TokenError, r"512 is outside \[0, 512\)"),
    (np.int64(-1), g.TokenError, "-1"),
    (1.0, g.TokenTypeError, "float"),
    (True, g.TokenTypeError, "bool"),
    ("3", g.TokenTypeError, "str"),
    ([3], g.TokenTypeError, "list"),
    (None, g.TokenTypeError, "None"),
])
def test_bad_decode_token(tiny, filled, token, error, match):
    mc, snapshot = filled
    with pytest.raises(error, match=match):
        g.decode_step(token, tiny, mc)
    assert_unchanged(mc, snapshot)


def test_decode_on_full_cache(tiny, filled):
    mc, _ = filled
    g.prefill([6, 7, 8], tiny, mc)
    snapshot = (mc.length, mc.lengths, mc.k.copy(), mc.v.copy())
    with pytest.raises(g.CacheFullError, match="full.*max_len=8"):
        g.decode_step(1, tiny, mc)
    with pytest.raises(g.CacheFullError, match="room for 0"):
        g.prefill([1], tiny, mc)
    assert_unchanged(mc, snapshot)


def test_cache_of_another_config(tiny, filled):
    mc, snapshot = filled
    other = g.random_weights(g.GPT2Config(n_layer=3, n_head=2, n_embd=128, n_positions=64, vocab_size=512))
    with pytest.raises(g.ConfigError, match="n_layer=2.*n_layer=3"):
        g.prefill([1], other, mc)
    with pytest.raises(g.ConfigError, match="cache was built for"):
        g.decode_step(1, other, mc)
    assert_unchanged(mc, snapshot)


@pytest.mark.parametrize("w, mc", [("weights", "cache"), ("w", None)])
def test_wrong_objects(tiny, filled, w, mc):
    with pytest.raises(g.ConfigError, match="expected"):
        g.prefill([1], tiny if w == "w" else w, mc)


@pytest.mark.parametrize("max_len, match", [
    (0, r"max_len=0 is outside \[1, 64\]"),
    (-5, "max_len=-5"),
    (65, r"max_len=65 is outside \[1, 64\]"),
    (2.5, "must be an integer"),
    (True, "must be an integer"),
])
def test_bad_max_len(max_len, match):
    with pytest.raises(g.ConfigError, match=match):
        g.ModelCache(TINY, max_len=max_len)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_embd=100, n_head=3), "not divisible"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(vocab_size=2.5), "vocab_size"),
    (dict(layer_norm_epsilon=0), "layer_norm_epsilon"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(g.ConfigError, match=match):
        g.GPT2Config(**kwargs)


def test_embed_token_checks(tiny):
    with pytest.raises(g.TokenError, match=r"position 64 is outside \[0, 64\)"):
        g.embed_token(1, 64, tiny)
    with pytest.raises(g.TokenError, match=r"token id 512"):
        g.embed_token(512, 0, tiny)
    with pytest.raises(g.TokenTypeError, match="position must be an integer"):
        g.embed_token(1, 1.0, tiny)


def test_reset_and_reuse(tiny, filled):
    mc, _ = filled
    mc.reset()
    assert mc.length == 0 and (mc.lengths == 0).all() and mc.keys().shape[2] == 0
    fresh = g.ModelCache(TINY, max_len=8)
    np.testing.assert_array_equal(g.prefill([9, 8, 7], tiny, mc), g.prefill([9, 8, 7], tiny, fresh))


def test_cache_arrays_cannot_be_replaced(filled):
    mc, _ = filled
    for name in ("k", "v", "max_len", "config", "dtype"):
        with pytest.raises(AttributeError):
            setattr(mc, name, None)


@pytest.mark.parametrize("module, kernel", [("model.forward", "_attend"), ("model.forward", "head_logits")])
def test_interrupted_call_leaves_the_cache(tiny, filled, monkeypatch, module, kernel):
    """An exception inside the layer loop (attention) or after it (the output head,
    once every layer wrote its rows) rolls the lengths back."""
    mc, (length, lengths, _, _) = filled
    import importlib

    def broken(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(importlib.import_module(f"gpt2numba.{module}"), kernel, broken)
    with pytest.raises(KeyboardInterrupt):
        g.prefill([1, 2], tiny, mc)
    assert mc.length == length and (mc.lengths == lengths).all()


@pytest.mark.parametrize("ids, error, match", [
    ([], g.TokenError, "empty"), ([-1], g.TokenError, "outside"), ([512], g.TokenError, "outside"),
    ([1.7], g.TokenTypeError, "integer"), (list(range(65)), g.TokenError, "n_positions=64"),
])
def test_oracle_checks_its_input(tiny, ids, error, match):
    with pytest.raises(error, match=match):
        g.recompute_logits(ids, tiny)
    with pytest.raises(g.ConfigError, match="GPT2Weights"):
        g.recompute_logits([1], None)


@pytest.mark.parametrize("call, error, match", [
    (lambda: g.random_weights(None), g.ConfigError, "GPT2Config"),
    (lambda: g.random_weights(TINY, seed=-1), g.ConfigError, "seed"),
    (lambda: g.random_weights(g.GPT2Config(n_layer=1, n_head=1, n_embd=48, n_positions=8, vocab_size=32),
                              dtype="int8"), g.ConfigError, "divisible by 32"),
    (lambda: g.load_weights(None), g.CheckpointNotFoundError, "NoneType"),
    (lambda: g.load_tokenizer(5), g.CheckpointNotFoundError, "int"),
    (lambda: g.save_weights(None, "x"), g.ConfigError, "GPT2Weights"),
    (lambda: g.load_tokenizer().encode(b"bytes"), g.TokenTypeError, "bytes"),
])
def test_more_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_save_weights_onto_a_file(tiny, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(g.CheckpointError, match="is a file"):
        g.save_weights(tiny, tmp_path / "f")


def test_weights_do_not_freeze_the_callers_arrays(tiny):
    import dataclasses

    mine = tiny.wte.copy()
    w = dataclasses.replace(tiny, wte=mine)
    mine[0, 0] = 1.0  # still writable
    assert not w.wte.flags.writeable


# --- ids past the end of the vocabulary, at every entry point that takes ids ------------------------------

V = 100  # every integer dtype can hold vocab_size itself: each can name the first id past the end of wte
SMALL_VOCAB = dataclasses.replace(TINY, vocab_size=V)
INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
PYTHON_BAD = [V, -1, 2**31, 2**63, 2**64 - 1, 2**70, -2**70]


@pytest.fixture(scope="module")
def small_vocab():
    return g.random_weights(SMALL_VOCAB, seed=3)


def bad_ids(dtype):
    """The ids of this dtype outside [0, V): V, -1, and the dtype's extremes."""
    info = np.iinfo(dtype)
    return sorted({v for v in (V, V + 1, -1, info.max, info.min) if info.min <= v <= info.max and not 0 <= v < V})


def sequence_forms(dtype, bad):
    """A bad id in each form a sequence of ids can take: a list of NumPy scalars, an array of the dtype."""
    return [[1, dtype(bad)], np.array([1, bad], dtype)]


# entry point -> a call with one sequence of ids that must be refused (and the cache it must leave empty)
SEQUENCE_ENTRIES = {
    "prefill": lambda w, ids, mc: g.prefill(ids, w, mc),
    "prefill_batch": lambda w, ids, mc: g.prefill_batch([[1], ids], w, [g.ModelCache(w.config), mc]),
    "score": lambda w, ids, mc: g.score(ids, w),
    "score_batch": lambda w, ids, mc: g.score_batch([[1, 2], ids], w),
    "generate": lambda w, ids, mc: list(g.generate(ids, w, max_new_tokens=1, cache=mc)),
    "generate_batch": lambda w, ids, mc: list(g.generate_batch([[1], ids], w, max_new_tokens=1)),
}
TOKEN_ENTRIES = {
    "decode_step": lambda w, token, mc: g.decode_step(token, w, mc),
    "decode_batch": lambda w, token, mc: g.decode_batch([1, token], w, [g.ModelCache(w.config), mc]),
    "decode_batch of an array": lambda w, token, mc: g.decode_batch(
        np.array([1, token], type(token)), w, [g.ModelCache(w.config), mc]),
}


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("entry", SEQUENCE_ENTRIES)
def test_ids_past_the_vocabulary_are_refused(small_vocab, entry, dtype):
    """vocab_size, -1 and the dtype's extremes, in a list of NumPy scalars, an array of every integer dtype,
    a 0-d array, and as Python ints. Catches: `values > vocab_size` for arrays (id V reads past the end of
    wte: no kernel checks bounds), a check made after a cast that wraps (uint64's 2**64 - 1 to -1, or a
    cast to a narrower type), a dtype left out of the check."""
    call = SEQUENCE_ENTRIES[entry]
    mc = g.ModelCache(SMALL_VOCAB)
    for bad in bad_ids(dtype):
        for ids in sequence_forms(dtype, bad):
            with pytest.raises(g.TokenError, match=rf"{bad} .*outside \[0, {V}\)"):
                call(small_vocab, ids, mc)
        with pytest.raises((g.TokenError, g.TokenTypeError)):
            call(small_vocab, np.array(bad, dtype), mc)  # 0-d: not a sequence of ids
    for bad in PYTHON_BAD if dtype is np.int64 else []:
        with pytest.raises(g.TokenError, match=rf"{bad} .*outside \[0, {V}\)"):
            call(small_vocab, [1, bad], mc)
    assert mc.length == 0 and (mc.lengths == 0).all()


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("entry", TOKEN_ENTRIES)
def test_token_ids_past_the_vocabulary_are_refused(small_vocab, entry, dtype):
    """decode_step's and decode_batch's ids: vocab_size, -1 and the dtype's extremes as NumPy scalars (and in
    an array of the dtype, for decode_batch), a 0-d array, and as Python ints."""
    call = TOKEN_ENTRIES[entry]
    mc = g.ModelCache(SMALL_VOCAB)
    for bad in bad_ids(dtype):
        with pytest.raises(g.TokenError, match=rf"{bad} is outside \[0, {V}\)"):
            call(small_vocab, dtype(bad), mc)
        if "array" not in entry:
            with pytest.raises((g.TokenError, g.TokenTypeError)):
                call(small_vocab, np.array(bad, dtype), mc)
    for bad in PYTHON_BAD if dtype is np.int64 and "array" not in entry else []:
        with pytest.raises(g.TokenError, match=rf"{bad} is outside \[0, {V}\)"):
            call(small_vocab, bad, mc)
    assert mc.length == 0 and (mc.lengths == 0).all()


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: d.__name__)
def test_the_last_id_of_every_dtype_is_taken(small_vocab, dtype):
    """V - 1 and 0 in every dtype give what the same Python ints give. Catches a check that refuses the
    last id (`>= vocab_size - 1`) or any dtype it should take."""
    ids = np.array([V - 1, 0, 7], dtype)
    expected = g.prefill([V - 1, 0, 7], small_vocab, g.ModelCache(SMALL_VOCAB))
    np.testing.assert_array_equal(g.prefill(ids, small_vocab, g.ModelCache(SMALL_VOCAB)), expected)
    np.testing.assert_array_equal(g.prefill(list(ids), small_vocab, g.ModelCache(SMALL_VOCAB)), expected)
    mc = g.ModelCache(SMALL_VOCAB)
    g.prefill(ids[:2], small_vocab, mc)
    np.testing.assert_allclose(g.decode_step(dtype(7), small_vocab, mc), expected, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(g.score(ids, small_vocab).logprobs, g.score([V - 1, 0, 7], small_vocab).logprobs)


@pytest.mark.parametrize("bad", [50257, 50258, -1, 2**31, 2**63, 2**64, 10**30, -2**63])
def test_the_servers_id_prompts_past_the_vocabulary_get_400(bad):
    """The server's prompts of token ids (JSON integers, so Python ints of any size): one list, or one of
    several lists. Checked in-process: parse_completion is what the route calls."""
    from gpt2numba import serve

    tok = g.load_tokenizer()
    for prompt in ([1, bad], [[1], [2, bad]]):
        with pytest.raises(serve.ApiError, match=rf"{bad} is not in \[0, 50257\)") as e:
            serve.parse_completion({"prompt": prompt, "max_tokens": 1}, tok, 1024, 50257)
        assert e.value.status == 400 and e.value.param == "prompt"
    assert serve.parse_completion({"prompt": [1, 50256]}, tok, 1024, 50257).prompts == [[1, 50256]]
