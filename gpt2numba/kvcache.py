"""The cached forward pass: ModelCache, prefill and decode_step.

Everything here validates and then calls the kernels; a call that raises leaves
the cache as it was. Shapes: T = new tokens, C = n_embd, V = vocab_size.
"""

from __future__ import annotations

import functools
import os

import numba
import numpy as np

from . import checks, compact
from .config import GPT2Config
from .errors import CacheFullError, ConfigError, GPT2NumbaError
from .kernels import (
    ATTEND_TILE,
    _attend,
    _expand_bf16,
    _expand_int8,
    _gelu,
    _gemv_bf16,
    _gemv_int8,
    _head,
    _head_bf16,
    _head_int8,
    _layernorm,
    _linear,
    _write_kv,
)
from .weights import GPT2Weights, load_weights, random_weights


class ModelCache:
    """Preallocated keys and values of every layer, and how many positions they hold.

    k, v: float32 (n_layer, n_head, max_len, head_dim); rows at and beyond
    ``length`` hold nothing meaningful. ``lengths`` has one entry per layer, each
    advanced by that layer's own cache write.
    """

    def __init__(self, config: GPT2Config, max_len: int | None = None):
        if not isinstance(config, GPT2Config):
            raise ConfigError(f"ModelCache needs a GPT2Config, got {type(config).__name__}")
        if max_len is None:
            max_len = config.n_positions
        if not checks.is_integer(max_len):
            raise ConfigError(f"max_len must be an integer, got {max_len!r}")
        if not 1 <= max_len <= config.n_positions:
            raise ConfigError(f"max_len={max_len} is outside [1, {config.n_positions}] (n_positions)")
        self._config = config
        self._max_len = int(max_len)
        shape = (config.n_layer, config.n_head, self._max_len, config.head_dim)
        self._k = np.zeros(shape, np.float32)  # (n_layer, n_head, max_len, head_dim)
        self._v = np.zeros(shape, np.float32)  # (n_layer, n_head, max_len, head_dim)
        self._lengths = np.zeros(config.n_layer, np.int64)  # (n_layer,)
        self._length = 0
        self._work = _Workspace(config, self.max_len)

    # Read-only attributes: the kernels write into these arrays without bounds checks,
    # so they may not be replaced (their contents are the user's to read).
    config = property(lambda self: self._config)
    max_len = property(lambda self: self._max_len)
    k = property(lambda self: self._k, doc="Keys, float32 (n_layer, n_head, max_len, head_dim).")
    v = property(lambda self: self._v, doc="Values, float32 (n_layer, n_head, max_len, head_dim).")

    @property
    def length(self) -> int:
        """Positions filled, the same in every layer between calls."""
        return self._length

    @property
    def lengths(self) -> np.ndarray:
        """Positions written per layer, (n_layer,) int64 (a copy)."""
        return self._lengths.copy()

    @property
    def room(self) -> int:
        return self.max_len - self._length

    def keys(self) -> np.ndarray:
        """View of the filled keys, (n_layer, n_head, length, head_dim)."""
        return self.k[:, :, : self._length]

    def values(self) -> np.ndarray:
        """View of the filled values, (n_layer, n_head, length, head_dim)."""
        return self.v[:, :, : self._length]

    def reset(self) -> None:
        """Forget every position; the arrays stay allocated."""
        self._length = 0
        self._lengths[:] = 0

    def __repr__(self) -> str:
        return f"ModelCache(length={self._length}, max_len={self.max_len}, config={self.config})"


def embed_token(token_id: int, position: int, w: GPT2Weights) -> np.ndarray:
    """wte[token_id] + wpe[position], float32 (n_embd,)."""
    _check_weights(w)
    cfg = w.config
    token_id = checks.token_id(token_id, cfg.vocab_size)
    position = checks.position(position, cfg.n_positions)
    return _embed(np.array([token_id]), position, w)[0]


def prefill(prompt_ids, w: GPT2Weights, mc: ModelCache) -> np.ndarray:
    """Run the prompt through the model in one batched pass, filling the cache.

    prompt_ids: non-empty 1-D integer ids in [0, vocab). Token i sits at position
    mc.length + i, so a cache that already holds tokens is continued.
    Returns float32 (vocab,): the next-token logits after the last prompt token.
    Raises TokenTypeError / TokenError for bad ids, CacheFullError when the
    prompt needs more than the cache's room, ConfigError when the cache was built
    for another config; the cache is then unchanged.
    """
    _check_pair(w, mc)
    ids = checks.token_ids(prompt_ids, w.config.vocab_size)
    if len(ids) > mc.room:
        raise CacheFullError(
            f"a prompt of {len(ids)} tokens does not fit: the cache holds {mc.length} of "
            f"max_len={mc.max_len} positions, room for {mc.room}"
        )
    return _forward(ids, w, mc)


def decode_step(token_id: int, w: GPT2Weights, mc: ModelCache) -> np.ndarray:
    """Feed one token at position mc.length; return float32 (vocab,) next-token logits.

    Raises TokenTypeError / TokenError for a bad id, CacheFullError when the
    cache is full, ConfigError for a cache of another config; the cache is
    then unchanged.
    """
    _check_pair(w, mc)
    token_id = checks.token_id(token_id, w.config.vocab_size)
    if mc.room == 0:
        raise CacheFullError(f"the cache is full: all max_len={mc.max_len} positions hold tokens")
    return _forward(np.array([token_id], np.int64), w, mc)


def run_prefill(prompt_ids) -> np.ndarray:
    """Prefill ``prompt_ids`` into a fresh cache on the default weights; return the logits."""
    w = default_weights()
    return prefill(prompt_ids, w, ModelCache(w.config))


def default_weights() -> GPT2Weights:
    """The checkpoint named by $GPT2NUMBA_WEIGHTS, else seeded random GPT-2 small."""
    return _default_weights(os.environ.get("GPT2NUMBA_WEIGHTS") or None)


@functools.lru_cache(maxsize=1)
def _default_weights(path: str | None) -> GPT2Weights:
    return load_weights(path) if path else random_weights(GPT2Config.small(), seed=0)


def _check_weights(w) -> None:
    if not isinstance(w, GPT2Weights):
        raise ConfigError(f"expected GPT2Weights, got {type(w).__name__}")


def _check_pair(w, mc) -> None:
    _check_weights(w)
    if not isinstance(mc, ModelCache):
        raise ConfigError(f"expected a ModelCache, got {type(mc).__name__}")
    if mc.config != w.config:
        raise ConfigError(f"the cache was built for {mc.config}, the weights are {w.config}")


def _embed(ids: np.ndarray, start: int, w: GPT2Weights) -> np.ndarray:
    # (T,) ids at positions start.. -> (T, C)
    rows = compact.expand("wte", w.wte[ids], w.scales["wte"][ids] if w.scales else None)
    return rows + w.wpe[start : start + len(ids)]


def _split_k(T: int) -> bool:
    """Whether a product over T tokens splits the weights' rows, rather than the tokens, across threads.

    Measured on 2 cores with GPT-2 small's matrices: splitting the weights wins from
    1 token to 256 (each thread reads only its part of them), except at 2 tokens,
    where one matrix-vector product per thread wins; from 256 on, splitting the
    tokens is as fast or faster and needs no partial sums.
    """
    return T != 2 and T <= 256


class _Workspace:
    """Activation buffers for up to max_len tokens, allocated once with the cache.

    Reused by every call, never reallocated: fresh memory is slow to touch.
    """

    def __init__(self, cfg: GPT2Config, max_len: int):
        C = cfg.n_embd
        self.x = np.empty((max_len, C), np.float32)        # residual stream
        self.h = np.empty((max_len, C), np.float32)        # layernorm out
        self.qkv = np.empty((max_len, 3 * C), np.float32)  # [q | k | v]
        self.a = np.empty((max_len, C), np.float32)        # attention out, heads side by side
        self.f = np.empty((max_len, 4 * C), np.float32)    # MLP hidden
        self._scratch = np.empty(0, np.float32)
        self._dense = np.empty(0, np.float32)
        self.max_len, self.width = max_len, 4 * C
        # per head: a tile of queries and its scores over every visible key
        self.attend = np.empty((cfg.n_head, ATTEND_TILE * (cfg.head_dim + max_len)), np.float32)

    def scratch(self, T: int, threads: int) -> np.ndarray:
        """Where matrix products land first: T rows, or T partial rows per thread (flat)."""
        need = max((threads if _split_k(T) else 1) * T, 2 * threads) * self.width
        if self._scratch.size < need:  # once per cache, or when the thread count grows
            self._scratch = np.empty(max(need, threads * min(self.max_len, 256) * self.width), np.float32)
        return self._scratch

    def dense(self, shape: tuple) -> np.ndarray:
        """A float32 buffer of ``shape`` for one widened compact matrix (prefill only)."""
        size = shape[0] * shape[1]
        if self._dense.size < size:
            self._dense = np.empty(self.width * self.width // 4, np.float32)  # C x 4C, the largest
        return self._dense[:size].reshape(shape)


def _forward(ids: np.ndarray, w: GPT2Weights, mc: ModelCache) -> np.ndarray:
    """All blocks over T checked tokens at positions mc.length..; the last one's logits, (V,).

    The cache's length moves only once everything has succeeded.
    """
    cfg, work = w.config, mc._work
    T, start, eps = len(ids), mc.length, cfg.layer_norm_epsilon
    x, h, qkv, a, f = work.x[:T], work.h[:T], work.qkv[:T], work.a[:T], work.f[:T]
    x[...] = _embed(ids, start, w)
    threads = numba.get_num_threads()
    linear = functools.partial(_matmul, w=w, work=work, threads=threads)
    try:
        with _one_blas_thread():
            for layer in range(cfg.n_layer):
                _layernorm(x, w.ln_1_g[layer], w.ln_1_b[layer], eps, h)
                linear(h, "c_attn_w", layer, w.c_attn_b[layer], out=qkv, accumulate=False)
                _write_kv(qkv, mc.k, mc.v, mc._lengths, layer, start)
                _attend(qkv, mc.k, mc.v, layer, start, a, work.attend)
                linear(a, "attn_c_proj_w", layer, w.attn_c_proj_b[layer], out=x, accumulate=True)

                _layernorm(x, w.ln_2_g[layer], w.ln_2_b[layer], eps, h)
                linear(h, "c_fc_w", layer, w.c_fc_b[layer], out=f, accumulate=False)
                _gelu(f)
                linear(f, "mlp_c_proj_w", layer, w.mlp_c_proj_b[layer], out=x, accumulate=True)
            if (mc._lengths != start + T).any():
                skipped = np.flatnonzero(mc._lengths != start + T).tolist()
                raise GPT2NumbaError(f"internal error: layers {skipped} did not write their cache rows")
            logits = _logits(x[-1], w, threads)
    except BaseException:
        mc._lengths[:] = start  # the rows written past start mean nothing again
        raise
    mc._length = start + T
    return logits


def _matmul(x, field, layer, b, out, accumulate, w, work, threads):
    """out (+)= x @ (layer's matrix ``field``) + b, whatever the matrix's storage."""
    T = x.shape[0]
    matrix = getattr(w, field)[layer]
    scratch = work.scratch(T, threads)
    if w.dtype == "float32":
        _linear(x, matrix, b, scratch, out, accumulate, threads, _split_k(T))
    elif T == 1 and w.dtype == "bfloat16":  # decode reads the compact matrix itself
        _gemv_bf16(x, matrix, b, scratch, out, accumulate, threads)
    elif T == 1:
        _gemv_int8(x, matrix, w.scales[field][layer], b, scratch, out, accumulate, threads)
    else:  # prefill widens the matrix once, then multiplies as float32
        dense = work.dense(matrix.shape)
        if w.dtype == "bfloat16":
            _expand_bf16(matrix, dense)
        else:
            _expand_int8(matrix, w.scales[field][layer], dense)
        _linear(x, dense, b, scratch, out, accumulate, threads, _split_k(T))


def _logits(x_last: np.ndarray, w: GPT2Weights, threads: int) -> np.ndarray:
    # (C,) -> (V,): ln_f, then the tied head wte for this one row; BLAS already pinned by _forward
    h = np.empty((1, w.config.n_embd), np.float32)
    _layernorm(x_last[None, :], w.ln_f_g, w.ln_f_b, w.config.layer_norm_epsilon, h)
    logits = np.empty(w.config.vocab_size, np.float32)
    if w.dtype == "float32":
        _head(w.wte, h[0], logits, threads)
    elif w.dtype == "bfloat16":
        _head_bf16(w.wte, h[0], logits, threads)
    else:
        _head_int8(w.wte, w.scales["wte"], h[0], logits, threads)
    return logits


@functools.lru_cache(maxsize=1)
def _blas_controller():
    import scipy.linalg.cython_blas  # noqa: F401  (the BLAS Numba calls; load it before looking)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _one_blas_thread():
    """Pin every BLAS library to one thread for the duration: our Numba threads are the parallelism."""
    return _blas_controller().limit(limits=1, user_api="blas")


def set_threads(n: int) -> None:
    """Use ``n`` threads (1 to the number Numba started with, by default the cores)."""
    top = numba.config.NUMBA_NUM_THREADS
    if not checks.is_integer(n) or not 1 <= n <= top:
        raise ConfigError(f"threads must be an integer in [1, {top}], got {n!r}")
    numba.set_num_threads(int(n))


def get_threads() -> int:
    return numba.get_num_threads()
