"""ModelCache: the preallocated keys and values of one sequence, and how many positions they hold.

A cache's history can begin with rows that other caches hold: a fork, copy_prefix, a prefix cache's blocks
read them in place, by reference, instead of copying them (as vLLM's shared blocks or llama.cpp's cells
shared between sequences). Rows are written only at a cache's own length, into its own arrays, and rows
another cache reads are never written again: a cache whose history is cut below what it has lent gets new
arrays first (copy on write, with nothing to copy, since each array keeps rows at their positions).
The forward pass (forward.py) reads a history through ``segments()`` and writes the new rows into the
own arrays; this module only owns them.
"""

from __future__ import annotations

import numpy as np
from numba import typed

from ..errors import CacheError, CacheFullError, ConfigError
from . import checks, compact
from .config import GPT2Config


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
        # (n_layer, n_head, max_len, head_dim), float32 or bits; empty, not zeroed: rows are read only once
        # written, and zeroing tens of MB cost a new cache up to 100 ms where the allocator reused memory
        self._k = np.empty(shape, _STORAGE[dtype])
        self._v = np.empty(shape, _STORAGE[dtype])
        self._lengths = np.zeros(config.n_layer, np.int64)  # (n_layer,)
        self._length = 0
        # positions [0, _split) are rows of other arrays, read in place: (k, v, first, end, row of first), in
        # order; [_split, _length) are rows of the own _k, _v at their positions
        self._shared: tuple[tuple[np.ndarray, np.ndarray, int, int, int], ...] = ()
        self._split = 0
        self._lent = 0  # other caches read own rows below this position: they are never written again

    # Read-only attributes: the kernels write into these arrays without bounds checks,
    # so they may not be replaced (their contents are the user's to read).
    config = property(lambda self: self._config)
    max_len = property(lambda self: self._max_len)
    dtype = property(lambda self: self._dtype, doc='How keys and values are kept: "float32", "float16" or "bfloat16".')

    @property
    def k(self) -> np.ndarray:
        """Keys (n_layer, n_head, max_len, head_dim): float32, float16, or bfloat16 bits as uint16. Rows this
        cache shares with others are copied into its own arrays first (the kernels read them in place)."""
        self._own_all()
        return self._public(self._k)

    @property
    def v(self) -> np.ndarray:
        """Values (n_layer, n_head, max_len, head_dim), as k."""
        self._own_all()
        return self._public(self._v)

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value arrays."""
        return self._k.nbytes + self._v.nbytes

    @property
    def shared(self) -> int:
        """Positions read in place from rows other caches (or a prefix cache) hold, not held here."""
        return self._split

    @property
    def position_bytes(self) -> int:
        """Bytes of one position's keys and values (every layer and head)."""
        return self.nbytes // self.max_len

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
        return self._float32(self._gathered(0, 0, self._length))

    def values(self) -> np.ndarray:
        """The filled values as float32 (n_layer, n_head, length, head_dim), as keys()."""
        return self._float32(self._gathered(1, 0, self._length))

    def segments(self, n: int | None = None) -> list[tuple[np.ndarray, np.ndarray, int, int, int]]:
        """Where positions [0, n) (default: length) are kept: (k, v, first, end, row) for each run, in order,
        positions first..end-1 being rows row..row+end-first-1 of k and v (n_layer, n_head, rows, head_dim). The
        last run is this cache's own arrays (row == first) unless all n are shared."""
        n = self._length if n is None else n
        runs = [(k, v, a, min(b, n), r) for k, v, a, b, r in self._shared if a < n]
        if n > self._split:
            runs.append((self._k, self._v, self._split, n, self._split))
        return runs

    def _rows(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [start, end) as stored, k and v (n_layer, n_head, end - start, head_dim): _gathered."""
        return self._gathered(0, start, end), self._gathered(1, start, end)

    def _gathered(self, which: int, start: int, end: int) -> np.ndarray:
        """Positions [start, end) of the keys (``which`` 0) or the values (1), as stored: a slice of the own
        array when they are all its own, else a copy gathered from the runs."""
        own = (self._k, self._v)[which]
        if start >= self._split:
            return own[:, :, start:end]
        out = np.empty(own.shape[:2] + (end - start,) + own.shape[3:], own.dtype)
        for *stores, a, b, r in self.segments(end):
            lo = max(a, start)
            if lo < b:
                out[:, :, lo - start : b - start] = stores[which][:, :, r + lo - a : r + b - a]
        return out

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
        """Forget every position; the arrays stay allocated (unless other caches read them)."""
        self._cut(0)

    def fork(self, length: int | None = None, *, max_len: int | None = None) -> ModelCache:
        """A new cache holding this one's first ``length`` positions (default: all it holds).

        The new cache reads those rows where they are (nothing is copied, however long), and the two
        go on independently: each writes its next rows into arrays of its own. max_len defaults to this cache's.
        Raises CacheError for a length outside [0, self.length], ConfigError for a bad
        max_len, CacheFullError when max_len < length; this cache is unchanged either way.
        """
        length = self._checked_length(self, length)
        mc = ModelCache(self.config, self.max_len if max_len is None else max_len, self.dtype)  # (checks max_len)
        mc.copy_prefix(self, length)
        return mc

    def copy_prefix(self, src: ModelCache, length: int | None = None, *, start: int = 0) -> None:
        """Make this cache hold the first ``length`` positions of ``src`` (default: all ``src`` holds).

        Whatever this cache held is forgotten, and src's rows are read where they are, not copied; src
        and this cache go on independently. ``start`` says that this cache's first ``start`` rows equal src's
        already (beam search's beams, both from one ancestor); it is checked, and changes nothing else now
        that no row is copied. ``src`` may be this cache itself: it then keeps its first ``length`` positions. Raises
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
        if src is self:
            self._cut(length)
            return
        runs = src._lend(length)
        self._cut(0)
        self._shared, self._split = runs, length
        self._set_length(length)

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
            if rows.dtype != self._public(self._k).dtype:
                raise CacheError(f"extend needs {name} of the cache's own dtype {self._public(self._k).dtype} (a {self.dtype} "
                                 f"cache), got {rows.dtype}: rows are copied, never converted")
        n = k.shape[2]
        if n > self.room:
            raise CacheFullError(f"{n} positions do not fit: the cache holds {self._length} of max_len={self.max_len}")
        self._writable()
        self._k[:, :, self._length : self._length + n] = k.view(self._k.dtype)
        self._v[:, :, self._length : self._length + n] = v.view(self._v.dtype)
        self._set_length(self._length + n)

    def _extend_shared(self, k: np.ndarray, v: np.ndarray) -> None:
        """Append positions read in place from k, v (n_layer, n_head, n, head_dim) of this cache's storage
        dtype, which nobody writes again (a prefix cache's blocks); the caller has checked shape and room."""
        start, n = self._length, k.shape[2]
        self._shared = tuple(self.segments()) + ((k, v, start, start + n, 0),)
        if start > self._split:  # the own rows, now a run like the others: lent to this cache itself
            self._lent = max(self._lent, start)
        self._split = start + n
        self._set_length(start + n)

    # --- sharing: rows lent in place, copy on write --------------------------------------------------

    def _lend(self, n: int) -> tuple:
        """The runs of positions [0, n) for another cache to read in place; own rows read so are never written
        again by this cache."""
        if n > self._split:
            self._lent = max(self._lent, n)
        return tuple(self.segments(n))

    def _writable(self) -> None:
        """Before rows are written at the length: own arrays whose rows there are lent are left to those who
        read them, and this cache goes on in new ones (rows of its history there become a run it reads)."""
        if self._lent <= self._length:
            return
        self._shared, self._split = tuple(self.segments()), self._length
        self._k, self._v = np.empty_like(self._k), np.empty_like(self._v)
        self._lent = 0

    def _cut(self, length: int) -> None:
        """Keep the first ``length`` positions (at most the length)."""
        self._shared = tuple(self.segments(min(length, self._split)))
        self._split = min(self._split, length)
        self._set_length(length)

    def _own_all(self) -> None:
        """Copy the shared rows into the own arrays (new ones if others read these), which then hold the
        whole history."""
        if not self._split:
            return
        k, v = self._rows(0, self._length)
        if self._lent:
            self._k, self._v, self._lent = np.empty_like(self._k), np.empty_like(self._v), 0
        self._k[:, :, : self._length], self._v[:, :, : self._length] = k, v
        self._shared, self._split = (), 0

    def _set_length(self, length: int) -> None:
        self._lengths[:] = length
        self._length = length

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


def stores(caches: list[ModelCache]) -> tuple:
    """The kernels' view of B caches' histories (kernels.py's docstring): ks, vs, runs (S, 4) int64 and run0
    (B + 1,) int64, each sequence's last run its own arrays up to max_len, where its new rows go. One
    cache that shares nothing passes its arrays themselves."""
    for mc in caches:
        mc._writable()
    if len(caches) == 1 and not caches[0]._split:
        mc = caches[0]
        return mc._k, mc._v, np.array([[0, 0, mc.max_len, 0]], np.int64), np.array([0, 1], np.int64)
    index, ks, vs, runs, run0 = {}, [], [], [], [0]
    for mc in caches:
        for k, v, first, end, row in mc.segments(mc._split) + [(mc._k, mc._v, mc._split, mc.max_len, mc._split)]:
            if id(k) not in index:
                index[id(k)] = len(ks)
                ks.append(k)
                vs.append(v)
            runs.append((index[id(k)], first, end, row))
        run0.append(len(runs))
    return typed.List(ks), typed.List(vs), np.array(runs, np.int64), np.array(run0, np.int64)


def check_kv_dtype(dtype) -> str:
    """``dtype`` if it is one of KV_DTYPES, else ConfigError naming them."""
    if not isinstance(dtype, str) or dtype not in KV_DTYPES:
        raise ConfigError(f"the cache's dtype must be one of {', '.join(KV_DTYPES)}; got {dtype!r}")
    return dtype
