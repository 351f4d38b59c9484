"""Caches that keep keys and values in float16 or bfloat16 (ModelCache(..., dtype=...)).

A compact cache rounds each key and value to nearest, ties to even, when it is written; attention
reads them widened, exactly. So the engine with such a cache is the model with rounded K and V:
checked against a float64 reference that rounds them by hand (tight), and against the oracle, which
does not round (within the rounding's own effect, stated below).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import njit

import gpt2numba as g
from gpt2numba.cpu import kernels
from gpt2numba.model import compact, oracle
from conftest import TINY, record_diff

COMPACT = ("float16", "bfloat16")
# A float16 keeps 11 significant bits, a bfloat16 8: rounding to nearest moves a value by at most
# half an ulp, 2^-11 or 2^-8 of it.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
# Against the oracle, which does not round: max |logits - oracle| <= ORACLE_FACTOR * u * max |oracle logits|.
# Every K and V moved by up to u relative moves an attention output by at most about u relative (the
# values; the softmax weights sum to 1) plus u times the scores' size (the keys, through the softmax), and
# the layers after carry a relative change on with a factor of order one each, so the logits move by
# about u times their own size. Measured (random weights, prompts of 1 to 200 tokens): the ratio
# max |diff| / (u max |logit|) was 0.05-0.29 on TINY (2 layers) and 0.11 on GPT-2 small's shapes (12
# layers), for both formats. A factor of 1 leaves 3x room above that, and a cache that kept bfloat16's 8
# bits where float16's 11 were asked for (8x the error) fails it.
ORACLE_FACTOR = 1.0
# Against the reference that rounds K and V by hand as the cache does: the engine is float32, the
# reference float64, and a value that float32 puts on the other side of a rounding tie than float64 lands
# on the other neighbour. Measured, as a share of the rounding's own effect |reference - oracle|: at
# most 0.15 for prompts of 6 tokens or more (150 random prompts on TINY; 0.085 on GPT-2 small's shapes
# at 200 tokens), but up to 0.58 for one-token prompts, where a single value on the other side of a tie
# weighs as much as all the others' rounding. Allowed: 1.0 of it, or float32's own noise against the
# oracle (1e-5 of the logits' size) where the effect is smaller still. Truncating (2.1x the effect,
# measured) and keeping bfloat16's bits in a float16 cache (8x) fail here; a cache that does not round at
# all (1.0x) is caught bit for bit by test_layer_0_holds_the_float32_rows_rounded and test_kernels.
ROUNDED_SHARE = 1.0
FLOAT32_NOISE = 1e-5


def round_kv(a: np.ndarray, kv_dtype: str) -> np.ndarray:
    """float64 values -> their float32 -> rounded to kv_dtype, to nearest even (NumPy's and compact's
    rounding, not the engine's) -> float64."""
    a32 = a.astype(np.float32)
    if kv_dtype == "float16":
        return a32.astype(np.float16).astype(np.float64)
    return compact.from_bfloat16(compact.to_bfloat16(a32)).astype(np.float64)


def rounded_logits(ids, w, kv_dtype: str, every_row: bool = False, last: int = 1) -> np.ndarray:
    """The oracle's forward pass (float32 weights) with every layer's K and V rounded as a kv_dtype cache
    keeps them: float64 (vocab,) logits after the last position, (last, vocab) after each of the last
    ``last`` > 1, or (len(ids), vocab) after every one."""
    ids = np.asarray(ids)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    eps, n_head = w.config.layer_norm_epsilon, w.config.n_head
    x = f64(w.wte[ids]) + f64(w.wpe[: len(ids)])
    for layer in range(w.config.n_layer):
        h = oracle.layer_norm(x, f64(w.ln_1_g[layer]), f64(w.ln_1_b[layer]), eps)
        q, k, v = np.split(h @ f64(w.c_attn_w[layer]) + f64(w.c_attn_b[layer]), 3, axis=-1)
        k, v = round_kv(k, kv_dtype), round_kv(v, kv_dtype)  # what the cache holds
        heads = [oracle.attention(*hv) for hv in zip(*(np.split(a, n_head, axis=-1) for a in (q, k, v)))]
        x = x + np.hstack(heads) @ f64(w.attn_c_proj_w[layer]) + f64(w.attn_c_proj_b[layer])
        h = oracle.layer_norm(x, f64(w.ln_2_g[layer]), f64(w.ln_2_b[layer]), eps)
        x = x + oracle.gelu(h @ f64(w.c_fc_w[layer]) + f64(w.c_fc_b[layer])) @ f64(w.mlp_c_proj_w[layer]) \
            + f64(w.mlp_c_proj_b[layer])
    h = oracle.layer_norm(x if every_row else x[-last:], f64(w.ln_f_g), f64(w.ln_f_b), eps)
    return oracle.head(h, w) if every_row or last > 1 else oracle.head(h, w)[0]


def prompts(max_len):
    return st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=max_len).map(np.array)


def check_logits(logits, ids, w, kv_dtype, label, exact=None, rounded=None):
    """logits (V,) after ``ids`` with a kv_dtype cache: near the rounded reference, and within the stated
    bound of the oracle. exact, rounded: the oracle's and the rounded reference's logits, if already computed."""
    rounded = rounded_logits(ids, w, kv_dtype) if rounded is None else rounded
    exact = g.recompute_logits(ids, w) if exact is None else exact
    to_rounded, to_exact = float(np.abs(logits - rounded).max()), float(np.abs(logits - exact).max())
    effect, size = float(np.abs(rounded - exact).max()), float(np.abs(exact).max())
    record_diff(f"{label} {kv_dtype} cache vs rounded reference, {len(ids)} tokens", to_rounded)
    allowed = max(ROUNDED_SHARE * effect, FLOAT32_NOISE * size)
    assert to_rounded <= allowed, (f"{to_rounded:.3g} from the reference that rounds K and V (allowed "
                                   f"{allowed:.3g}; rounding moves the logits by {effect:.3g})")
    bound = ORACLE_FACTOR * UNIT_ROUNDOFF[kv_dtype] * size
    assert to_exact <= bound, f"{to_exact:.3g} from the oracle, above {bound:.3g}"
    return to_rounded, to_exact


# --- the conversions -------------------------------------------------------------------------------

@njit
def _widen_all(bits, soft):
    out = np.empty(bits.size, np.float32)
    for j in range(bits.size):
        out[j] = kernels._half_to_float32_soft(bits[j]) if soft else kernels._to_float32_f16(bits[j])
    return out


@njit
def _round_all(x, fmt):
    out = np.empty(x.size, np.uint16)
    for j in range(x.size):
        if fmt == 0:
            out[j] = kernels._to_half(x[j])
        elif fmt == 1:
            out[j] = kernels._float32_to_half_soft(x[j])
        else:
            out[j] = kernels._to_bfloat16(x[j])
    return out


def _tricky_floats():
    """float32 values across every exponent, halfway cases of float16 and bfloat16, their limits, inf, nan."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    halves = np.arange(2**16, dtype=np.uint32)
    ties16 = (np.arange(-2**15, 2**15, dtype=np.int64).astype(np.uint16).view(np.float16)
              .astype(np.float32).view(np.uint32) + np.uint32(1 << 12))  # halfway to the next float16
    ties_bf = (halves << 16) + np.uint32(1 << 15)  # halfway to the next bfloat16
    special = np.array([0.0, -0.0, 65504, 65519.99, 65520, 65536, 2**-14, 2**-24, 2**-25, 2**-25 * 1.0001,
                        6.1e-5, np.inf, -np.inf, np.nan], np.float32).view(np.uint32)
    return np.concatenate([bits, ties16, ties_bf, special]).view(np.float32)


def test_float16_widening_is_exact_for_every_half():
    """Every one of the 65,536 float16 bit patterns widens to NumPy's float32 value of it (nan to a nan),
    by the path this CPU uses and by the one for an x86 without F16C."""
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    for soft in (False, True):
        got = _widen_all(bits, soft)
        assert np.array_equal(got, want, equal_nan=True), f"soft={soft}"
        assert np.array_equal(np.signbit(got), np.signbit(want))


def test_rounding_to_float16_and_bfloat16_is_to_nearest_even():
    """float32 -> float16 as NumPy rounds (to nearest, ties to even, overflow to inf, subnormals kept) by both
    paths; -> bfloat16 as compact.to_bfloat16 rounds the weights. Catches truncation, ties away from zero."""
    x = _tricky_floats()
    with np.errstate(over="ignore"):  # 65520 and above: inf, as it should
        want16 = x.astype(np.float16)
    for fmt in (0, 1):
        got = _round_all(x, fmt).view(np.float16)
        same = (got.view(np.uint16) == want16.view(np.uint16)) | (np.isnan(got) & np.isnan(want16))
        assert same.all(), f"path {fmt}: {x[~same][:5]} -> {got[~same][:5]}, NumPy: {want16[~same][:5]}"
    finite = np.isfinite(x)
    np.testing.assert_array_equal(_round_all(x[finite], 2), compact.to_bfloat16(x[finite]))


# --- the cache's API -------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype, shown", [("float32", np.float32), ("float16", np.float16),
                                             ("bfloat16", np.uint16)])
def test_arrays_bytes_and_float32_reads(tiny, kv_dtype, shown):
    """k and v in the dtype (bfloat16 as its bits); nbytes half of float32's; keys() and values() float32,
    the stored values exactly; fork keeps the dtype and the bits."""
    mc = g.ModelCache(TINY, max_len=10, dtype=kv_dtype)
    assert mc.dtype == kv_dtype and mc.k.dtype == mc.v.dtype == shown
    assert mc.nbytes == 2 * TINY.n_layer * TINY.n_embd * 10 * (4 if kv_dtype == "float32" else 2)
    g.prefill([5, 6, 7], tiny, mc)
    keys, values = mc.keys(), mc.values()
    assert keys.dtype == values.dtype == np.float32 and keys.shape == (TINY.n_layer, TINY.n_head, 3, TINY.head_dim)
    widened = {np.float32: lambda a: a, np.float16: lambda a: a.astype(np.float32),
               np.uint16: compact.from_bfloat16}[shown]
    np.testing.assert_array_equal(keys, widened(mc.k[:, :, :3]))
    np.testing.assert_array_equal(values, widened(mc.v[:, :, :3]))
    fork = mc.fork()
    assert fork.dtype == kv_dtype and "dtype" in repr(fork)
    np.testing.assert_array_equal(fork.k[:, :, :3], mc.k[:, :, :3])


@pytest.mark.parametrize("bad", ["float64", "f16", "Float16", "int8", None, np.float16, 16])
def test_a_bad_dtype_is_refused_by_name(tiny, bad):
    with pytest.raises(g.ConfigError, match="float32, float16, bfloat16"):
        g.ModelCache(TINY, dtype=bad)
    with pytest.raises(g.ConfigError, match="float32, float16, bfloat16"):
        list(g.generate_batch([[1]], tiny, max_new_tokens=1, kv_dtype=bad))
    with pytest.raises(g.ConfigError, match="float32, float16, bfloat16"):
        g.score_batch([[1, 2]], tiny, kv_dtype=bad)
    if bad is not None:  # (generate's None: the given cache's dtype, or float32)
        with pytest.raises(g.ConfigError, match="float32, float16, bfloat16"):
            list(g.generate([1], tiny, max_new_tokens=1, kv_dtype=bad))


def test_caches_of_different_dtypes_do_not_mix(tiny):
    """copy_prefix copies rows as they are: between dtypes it refuses (CacheError) and changes nothing. One
    forward pass takes caches of one dtype (BatchError). generate refuses a cache and a kv_dtype that differ."""
    half, full = g.ModelCache(TINY, max_len=8, dtype="float16"), g.ModelCache(TINY, max_len=8)
    g.prefill([1, 2, 3], tiny, half)
    g.prefill([4], tiny, full)
    for src, dst in ((half, full), (full, half), (half, g.ModelCache(TINY, dtype="bfloat16"))):
        before = dst.length, dst.keys().copy(), dst.values().copy()
        with pytest.raises(g.CacheError, match=f"cannot copy a {src.dtype} cache into a {dst.dtype} one"):
            dst.copy_prefix(src)
        assert dst.length == before[0] and np.array_equal(dst.keys(), before[1]) and np.array_equal(dst.values(), before[2])
    with pytest.raises(g.BatchError, match="cache 0 is float16 but cache 1 is float32"):
        g.decode_batch([1, 2], tiny, [half, full])
    assert half.length == 3 and full.length == 1
    with pytest.raises(g.ConfigError, match="kv_dtype='bfloat16' but the cache given is float16"):
        list(g.generate([1], tiny, max_new_tokens=1, cache=g.ModelCache(TINY, dtype="float16"), kv_dtype="bfloat16"))


# --- what the engine computes with a compact cache ----------------------------------------------------

@pytest.mark.parametrize("kv_dtype", COMPACT)
def test_layer_0_holds_the_float32_rows_rounded(tiny, kv_dtype):
    """Layer 0's keys and values come from the embeddings alone: a compact cache holds a float32 cache's
    rows rounded to nearest even, to the bit. Catches truncating, the other format's rounding, rows
    shifted or swapped (keys for values)."""
    ids = np.arange(1, 30) * 17 % TINY.vocab_size
    full, half = g.ModelCache(TINY), g.ModelCache(TINY, dtype=kv_dtype)
    g.prefill(ids, tiny, full)
    g.prefill(ids, tiny, half)
    for got, want in ((half.k, full.k), (half.v, full.v)):
        got, want = got[0, :, : len(ids)], want[0, :, : len(ids)]
        if kv_dtype == "float16":
            np.testing.assert_array_equal(got.view(np.uint16), want.astype(np.float16).view(np.uint16))
        else:
            np.testing.assert_array_equal(got, compact.to_bfloat16(want))


@pytest.mark.parametrize("kv_dtype", COMPACT)
@given(ids=prompts(TINY.n_positions), data=st.data())
def test_prefill_then_decode_is_the_model_on_rounded_kv(tiny, kv_dtype, ids, data):
    """Prefill a part of the prompt, then feed the rest in chunks and single decode steps: after each, the
    logits equal the float64 forward pass with K and V rounded by hand (to float32 noise) and stay within
    the stated bound of the oracle, which does not round.

    Catches: K or V left unrounded or rounded the wrong way (far from the rounded reference), rows read
    back in the wrong format (bfloat16 bits as float16: far from both), a widened block reused for the
    values (the keys' rows), the widened rows of a position not yet written.
    """
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids) - 1), max_size=4)) if len(ids) > 1 else []))
    mc = g.ModelCache(TINY, dtype=kv_dtype)
    bounds = [0, *cuts, len(ids)]
    for lo, hi in zip(bounds, bounds[1:]):
        logits = g.decode_step(int(ids[lo]), tiny, mc) if hi - lo == 1 and lo else g.prefill(ids[lo:hi], tiny, mc)
        assert mc.length == hi
        check_logits(logits, ids[:hi], tiny, kv_dtype, "tiny")


@pytest.mark.parametrize("kv_dtype", COMPACT)
def test_gpt2_small_shapes_within_the_bound(small, kv_dtype):
    """GPT-2 small's shapes (12 layers, so 12 roundings deep; 64-wide heads): a prompt of 200 and 3 decode
    steps, each against the rounded reference and the oracle."""
    ids = list(np.random.default_rng(3).integers(0, small.config.vocab_size, 200))
    mc = g.ModelCache(small.config, max_len=210, dtype=kv_dtype)
    cached = [g.prefill(ids, small, mc)]
    for _ in range(3):
        ids.append(int(np.argmax(cached[-1])))
        cached.append(g.decode_step(ids[-1], small, mc))
    # the logits after a position depend on none after it: one pass of each reference serves the 4 checks
    rounded = rounded_logits(ids, small, kv_dtype, last=4)
    h, f32 = oracle.final_states(ids, small)
    exact = oracle.head(h[-4:], f32)
    for i, logits in enumerate(cached):
        check_logits(logits, ids[:200 + i], small, kv_dtype, "small", exact=exact[i], rounded=rounded[i])


@pytest.mark.parametrize("kv_dtype", COMPACT)
def test_batches_scores_and_generation_take_the_dtype(tiny, kv_dtype):
    """A ragged batch of compact caches equals each alone; greedy generate_batch equals generate;
    score_batch's tokens are those of the model on rounded K and V."""
    prompts_ = [[1, 2, 3, 4, 5], [9], list(range(20, 60))]
    alone = [g.prefill(p, tiny, g.ModelCache(TINY, dtype=kv_dtype)) for p in prompts_]
    caches = [g.ModelCache(TINY, dtype=kv_dtype) for _ in prompts_]
    np.testing.assert_allclose(g.prefill_batch(prompts_, tiny, caches), np.stack(alone), atol=FLOAT32_NOISE, rtol=0)
    batch = g.generate_batch(prompts_, tiny, max_new_tokens=6, temperature=0, stop_at_eos=False, kv_dtype=kv_dtype)
    by_prompt = {i: [] for i in range(len(prompts_))}
    for i, token in batch:
        by_prompt[i].append(token)
    for i, p in enumerate(prompts_):
        assert by_prompt[i] == list(g.generate(p, tiny, max_new_tokens=6, temperature=0, stop_at_eos=False,
                                               kv_dtype=kv_dtype))
    ids = np.array(prompts_[2])
    s = g.score_batch([ids], tiny, kv_dtype=kv_dtype)[0]
    ref = rounded_logits(ids, tiny, kv_dtype, every_row=True)[:-1]
    ref -= ref.max(axis=1, keepdims=True)
    want = (ref - np.log(np.exp(ref).sum(axis=1, keepdims=True)))[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(s.logprobs, want, atol=1e-4)  # as test_score's scores against the oracle


def test_the_cli_and_the_server_take_kv_dtype(tiny, capsys, tmp_path):
    """--kv-dtype reaches the caches the commands make; a bad one is an argparse error naming the choices;
    the server's engine makes its batch's caches in it."""
    from gpt2numba import cli
    from gpt2numba.serve.engine import Engine
    from checkpoints import write_dir

    write_dir(tiny, tmp_path / "ckpt")

    with pytest.raises(SystemExit):
        cli.main(["generate", "hi", "--kv-dtype", "float64"])
    assert "float32" in capsys.readouterr().err
    made = []
    real = g.ModelCache.__init__

    def spy(self, *args, **kw):
        real(self, *args, **kw)
        made.append(self.dtype)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(g.ModelCache, "__init__", spy)
        assert cli.main(["check", "--model", str(tmp_path / "ckpt"), "--kv-dtype", "bfloat16", "--prompts", "1",
                         "--prompt-len", "4", "--decode", "1"]) == 0
    assert made and set(made) == {"bfloat16"}
    engine = Engine(tiny, g.load_tokenizer(), max_batch=2, kv_dtype="float16")
    seq = engine.batch.add([1, 2], max_new_tokens=1, sampler=g.Sampler(0.0), rng=np.random.default_rng(0))
    assert seq.cache.dtype == "float16"
    with pytest.raises(g.ConfigError, match="float32, float16, bfloat16"):
        Engine(tiny, g.load_tokenizer(), max_batch=2, kv_dtype="half")


def test_prefill_of_the_whole_context(tiny):
    """Every position of the context, in one prefill, with a compact cache: the widened block holds
    n_positions rows."""
    ids = np.arange(TINY.n_positions) * 7 % TINY.vocab_size
    for kv_dtype in COMPACT:
        mc = g.ModelCache(TINY, dtype=kv_dtype)
        check_logits(g.prefill(ids, tiny, mc), ids, tiny, kv_dtype, "tiny, whole context")


def test_a_prefix_cache_of_compact_rows(tiny):
    """The server's prefix cache keeps a float16 batch's blocks as stored and loads them into float16 caches
    (the logits those give are the full prefill's); extend refuses rows of another dtype."""
    from gpt2numba.decoding.batching import Batch
    from gpt2numba.decoding.prefixes import BLOCK, PrefixCache

    prompt = list(range(1, 2 * BLOCK + 5))
    prefixes = PrefixCache(TINY, 2**20, "float16")
    assert prefixes.block_bytes == g.ModelCache(TINY, BLOCK).nbytes // 2
    rows = []
    for _ in range(2):  # the first stores the prompt's blocks, the second starts from them
        batch = Batch(tiny, 1, prefixes, "float16")
        batch.add(prompt, max_new_tokens=1, sampler=g.Sampler(0.0), rng=np.random.default_rng(0))
        (_, _, _, row), = batch.step()
        rows.append(row.copy())
    assert prefixes.hits == 1 and prefixes.hit_tokens == 2 * BLOCK
    np.testing.assert_allclose(rows[1], rows[0], atol=FLOAT32_NOISE, rtol=0)
    mc = g.ModelCache(TINY, dtype="float16")
    shape = (TINY.n_layer, TINY.n_head, 2, TINY.head_dim)
    with pytest.raises(g.CacheError, match="own dtype float16"):
        mc.extend(np.zeros(shape, np.float32), np.zeros(shape, np.float32))
    assert mc.length == 0
