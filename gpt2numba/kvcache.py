"""ModelCache: the preallocated keys and values of one sequence, and how many positions they hold.

The forward pass (forward.py) writes into these arrays; this module only owns them.
"""

from __future__ import annotations

import numpy as np

from . import checks, compact
from .config import GPT2Config
from .errors import CacheError, CacheFullError, ConfigError


# How a cache can keep its keys and values: float32, or half the bytes as float16 (as llama.cpp's default
# f16 K/V cache) or bfloat16, each value rounded to nearest, ties to even, when it is written.
KV_DTYPES = ("float32", "float16", "bfloat16")
_STORAGE = {"float32": np.float32, "float16": np.uint16, "bfloat16": np.uint16}  # the compact ones as their bits


class ModelCache:
    """Preallocated keys and values of every layer, and how many positions they hold.

    k, v: (n_layer, n_head, max_len, head_dim) in ``dtype``: float32 (the default), float16 (NumPy's own
    float16) or bfloat16 (NumPy has none: its bits as uint16, as bfloat16 weights are kept; ``.view(
    ml_dtypes.bfloat16)`` reads them as numbers). keys() and values() give the filled rows as float32 in
    every case. Rows at and beyond ``length`` hold nothing meaningful. ``lengths`` has one entry per layer:
    what that layer's own cache writes reached, checked and committed after each forward pass. A cache
    costs 2 * n_layer * n_embd * max_len * 4 bytes in float32 (75 MB for GPT-2 small at max_len 1024) and
    half that in float16 or bfloat16 (``nbytes``), so short jobs (and batches) should ask for less.
    Raises ConfigError for a config that is not a GPT2Config, a max_len outside [1, n_positions], a dtype
    not in KV_DTYPES.
    """

    def __init__(self, config: GPT2Config, max_len: int | None = None, dtype: str = "float32"):
        if not isinstance(config, GPT2Config):
            raise ConfigError(f"ModelCache needs a GPT2Config, got {type(config).__name__}")
        if max_len is None:
            max_len = config.n_positions
        if not checks.is_integer(max_len):
            raise ConfigError(f"max_len must be an integer, got {max_len!r}")
        if not 1 <= max_len <= config.n_positions:
            raise ConfigError(f"max_len={max_len} is outside [1, {config.n_positions}] (n_positions)")
        check_kv_dtype(dtype)
        self._config = config
        self._max_len = int(max_len)
        self._dtype = dtype
        shape = (config.n_layer, config.n_head, self._max_len, config.head_dim)
        self._k = np.zeros(shape, _STORAGE[dtype])  # (n_layer, n_head, max_len, head_dim), float32 or bits
        self._v = np.zeros(shape, _STORAGE[dtype])  # (n_layer, n_head, max_len, head_dim)
        self._lengths = np.zeros(config.n_layer, np.int64)  # (n_layer,)
        self._length = 0

    # Read-only attributes: the kernels write into these arrays without bounds checks,
    # so they may not be replaced (their contents are the user's to read).
    config = property(lambda self: self._config)
    max_len = property(lambda self: self._max_len)
    dtype = property(lambda self: self._dtype, doc='How keys and values are kept: "float32", "float16" or "bfloat16".')
    k = property(lambda self: self._public(self._k),
                 doc="Keys (n_layer, n_head, max_len, head_dim): float32, float16, or bfloat16 bits as uint16.")
    v = property(lambda self: self._public(self._v),
                 doc="Values (n_layer, n_head, max_len, head_dim): float32, float16, or bfloat16 bits as uint16.")

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value arrays."""
        return self._k.nbytes + self._v.nbytes

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
        """The filled keys as float32 (n_layer, n_head, length, head_dim): a view of a float32 cache, an
        exact copy of a float16 or bfloat16 one (every such value is a float32)."""
        return self._float32(self._k[:, :, : self._length])

    def values(self) -> np.ndarray:
        """The filled values as float32 (n_layer, n_head, length, head_dim), as keys()."""
        return self._float32(self._v[:, :, : self._length])

    def _public(self, stored: np.ndarray) -> np.ndarray:
        """A stored array as the user sees it: float16 bits viewed as NumPy's float16, the others as kept."""
        return stored.view(np.float16) if self._dtype == "float16" else stored

    def _float32(self, stored: np.ndarray) -> np.ndarray:
        if self._dtype == "float32":
            return stored
        if self._dtype == "float16":
            return stored.view(np.float16).astype(np.float32)
        return compact.from_bfloat16(stored)

    def reset(self) -> None:
        """Forget every position; the arrays stay allocated."""
        self._length = 0
        self._lengths[:] = 0

    def fork(self, length: int | None = None, *, max_len: int | None = None) -> ModelCache:
        """A new cache holding this one's first ``length`` positions (default: all it holds).

        Its rows are copies (72 KB a position for GPT-2 small, far cheaper than computing them
        again), so the two caches go on independently. max_len defaults to this cache's.
        Raises CacheError for a length outside [0, self.length], ConfigError for a bad
        max_len, CacheFullError when max_len < length; this cache is unchanged either way.
        """
        length = self._checked_length(self, length)
        mc = ModelCache(self.config, self.max_len if max_len is None else max_len, self.dtype)  # (checks max_len)
        mc.copy_prefix(self, length)
        return mc

    def copy_prefix(self, src: ModelCache, length: int | None = None, *, start: int = 0) -> None:
        """Make this cache hold the first ``length`` positions of ``src`` (default: all ``src`` holds).

        The rows are copied into this cache's arrays; whatever it held is forgotten, except that with
        ``start``, the caller vouches that this cache's first ``start`` rows equal src's already (both were
        copied from one ancestor: beam search's beams) and only rows [start, length) are copied. ``src``
        may be this cache itself: it then keeps its first ``length`` positions. Raises
        CacheError for a src that is not a ModelCache of the same config and dtype (rows are
        copied as they are, never rounded on the way) or a length outside [0, src.length],
        CacheFullError when length > max_len; then nothing changes.
        """
        if not isinstance(src, ModelCache):
            raise CacheError(f"copy_prefix needs a ModelCache to copy from, got {type(src).__name__}")
        if src.config != self.config:
            raise CacheError(f"cannot copy between caches of different configs: {src.config} into {self.config}")
        if src.dtype != self.dtype:
            raise CacheError(f"cannot copy a {src.dtype} cache into a {self.dtype} one: make the copy with "
                             f"dtype={src.dtype!r} (or fork it)")
        length = self._checked_length(src, length)
        if length > self.max_len:
            raise CacheFullError(f"{length} positions do not fit this cache's max_len={self.max_len}")
        if not checks.is_integer(start) or not 0 <= start <= min(length, self._length):
            raise CacheError(f"start={start!r} is outside [0, {min(length, self._length)}]: the rows this cache "
                             "holds already, up to the length copied")
        if src is not self:
            self._k[:, :, start:length] = src._k[:, :, start:length]
            self._v[:, :, start:length] = src._v[:, :, start:length]
        self._lengths[:] = length
        self._length = length

    def extend(self, k: np.ndarray, v: np.ndarray) -> None:
        """Append positions computed elsewhere (a prefix cache's rows): k, v (n_layer, n_head, n, head_dim), of
        this cache's k and v dtype (float32, float16, or bfloat16 bits as uint16), copied as they are.

        Raises CacheError for arrays of another shape or dtype, CacheFullError when n > room; then nothing changes.
        """
        cfg = self.config
        for name, rows in (("k", k), ("v", v)):
            if not isinstance(rows, np.ndarray) or rows.ndim != 4 or rows.shape[:2] != (cfg.n_layer, cfg.n_head) \
                    or rows.shape[3] != cfg.head_dim or rows.shape != k.shape:
                raise CacheError(f"extend needs {name} of shape (n_layer={cfg.n_layer}, n_head={cfg.n_head}, n, "
                                 f"head_dim={cfg.head_dim}), the same for k and v; got {getattr(rows, 'shape', rows)!r}")
            if rows.dtype != self.k.dtype:
                raise CacheError(f"extend needs {name} of the cache's own dtype {self.k.dtype} (a {self.dtype} "
                                 f"cache), got {rows.dtype}: rows are copied, never converted")
        n = k.shape[2]
        if n > self.room:
            raise CacheFullError(f"{n} positions do not fit: the cache holds {self._length} of max_len={self.max_len}")
        self._k[:, :, self._length : self._length + n] = k.view(self._k.dtype)
        self._v[:, :, self._length : self._length + n] = v.view(self._v.dtype)
        self._lengths[:] = self._length + n
        self._length += n

    @staticmethod
    def _checked_length(src: ModelCache, length) -> int:
        """``length`` (default src.length) as an int in [0, src.length], or CacheError."""
        if length is None:
            return src.length
        if not checks.is_integer(length) or not 0 <= length <= src.length:
            raise CacheError(f"length must be an integer in [0, {src.length}] (the positions the cache holds), "
                             f"got {length!r}")
        return int(length)

    def _commit(self, written: np.ndarray) -> None:
        """After a forward pass has succeeded: written (n_layer,) positions per layer, all equal."""
        self._lengths[:] = written
        self._length = int(written[0])

    def __repr__(self) -> str:
        return (f"ModelCache(length={self._length}, max_len={self.max_len}, dtype={self.dtype!r}, "
                f"config={self.config})")


def check_kv_dtype(dtype) -> str:
    """``dtype`` if it is one of KV_DTYPES, else ConfigError naming them."""
    if not isinstance(dtype, str) or dtype not in KV_DTYPES:
        raise ConfigError(f"the cache's dtype must be one of {', '.join(KV_DTYPES)}; got {dtype!r}")
    return dtype
