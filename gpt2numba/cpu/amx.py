"""Intel's matrix tiles (AMX): whether this process may use them, and the layouts their products read.

A tile register holds up to 16 rows of 64 bytes. ``tdpbf16ps`` multiplies a tile of bfloat16 inputs, 16 rows x
32 inputs, by a tile of bfloat16 weights laid out by *pairs* (a row per two consecutive inputs, in it 16 outputs
x those two inputs) into a tile of 16 x 16 float32 sums; ``tdpbusd``/``tdpbssd`` do the same with bytes laid out
by *quads* (a row per four inputs). So the weights are laid out once for the tiles (bf16_pairs, int8_quads) and
the inputs are read as they are, rows of bfloat16 or bytes. float32 inputs to bfloat16 weights are split into two
bfloat16 parts, x = hi + lo to 2^-16 of x (split_hi_lo: 16 of float32's 24 bits), two tile passes into one
sum: the inputs' error is then far below bfloat16 weights' own, and their tolerance holds (docs/formats.md).

Linux lends a process the tiles' 8 KB of register state only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``, Linux 5.16 on): the request grows every signal frame of the process, so it is made once,
by request(), and only where the tiles are to run. available() says whether this CPU has them and the
environment lets them be used (``GPT2NUMBA_AMX=0`` does not).

No product runs on the tiles yet: the tile kernels need a machine with the tiles to be tested on
(docs/performance.md, "Intel's matrix tiles"). Until then every product runs as dispatch.py chooses without them,
bit for bit; what is here is tested everywhere against a NumPy model of the tiles (tests/test_amx.py).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import numpy as np
from numba import njit

from . import dispatch, numbacache
from ..errors import ConfigError
from .dispatch import AMX_FEATURES, GROUP
from .kernels import _from_bfloat16, _to_bfloat16

TILE_ROWS = 16  # rows of a tile: input rows of a product, and the outputs of one tile of sums
PAIR_INPUTS = 32  # inputs in one tile row of bfloat16 (64 bytes); its weights' tile: 16 rows of pairs
QUAD_INPUTS = 64  # inputs in one tile row of bytes; GROUP (32) of them with an integer format's scale

_ARCH_PRCTL = 158  # x86-64 system call number
_ARCH_GET_XCOMP_SUPP = 0x1021  # the extended features Linux supports: a bit mask
_ARCH_REQ_XCOMP_PERM = 0x1023  # ask for one of them
_XFEATURE_XTILEDATA = 18  # the tiles' data (the bit of the mask and the request's argument)


def available() -> str | None:
    """None when this process may ask for the tiles: an x86 CPU with amx-tile, amx-bf16 and amx-int8 as Numba
    compiles for it (dispatch.AMX) and GPT2NUMBA_AMX not 0. Else why not, in a sentence."""
    if os.environ.get("GPT2NUMBA_AMX", "1") == "0":
        return "GPT2NUMBA_AMX=0 in the environment"
    if dispatch.AMX:
        return None
    if dispatch.FEATURES is None:
        return "not an x86 CPU"
    return f"this CPU has no {', '.join(f for f in AMX_FEATURES if f not in dispatch.FEATURES)}"


_granted: list[str | None] = []  # request()'s answer, once asked
_lock = threading.Lock()


def request(syscall=None) -> str | None:
    """Ask Linux, once a process, for the tiles' register state. None when granted (or granted before); else why
    not: available()'s reason, not Linux, or what the system call answered (an old kernel, a refusal). Thread-
    safe; later calls return the first answer. ``syscall``: libc's syscall(2), replaced by the tests."""
    with _lock:
        if not _granted:
            _granted.append(_request(syscall))
        return _granted[0]


def _request(syscall):
    why = available()
    if why is not None:
        return why
    if not sys.platform.startswith("linux") or sys.maxsize < 2**32:
        return f"not 64-bit Linux ({sys.platform}): tiles are asked for with x86-64 Linux's arch_prctl"
    if syscall is None:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
        syscall.restype = ctypes.c_long
    supported = ctypes.c_uint64(0)
    if syscall(_ARCH_PRCTL, _ARCH_GET_XCOMP_SUPP, ctypes.byref(supported)) != 0:
        return f"Linux does not say which CPU state it supports ({_errno()}): before 5.16?"
    if not supported.value >> _XFEATURE_XTILEDATA & 1:
        return "Linux does not support the tiles' state here (ARCH_GET_XCOMP_SUPP lacks XTILEDATA)"
    if syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(_XFEATURE_XTILEDATA)) != 0:
        return f"Linux refused the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM: {_errno()})"
    return None


def _errno() -> str:
    e = ctypes.get_errno()
    return os.strerror(e) if e else "no error number"


def describe() -> str:
    """Whether the tiles are used, and if not, why: for `gpt2numba check`, the pool's describe() and the bench.
    Asks Linux for nothing (request() does)."""
    why = available()
    if why is None and _granted:
        why = _granted[0]
    if why is not None:
        return f"off: {why}"
    granted = "granted by Linux" if _granted else "not asked of Linux yet"
    return (f"off: this CPU has them ({', '.join(AMX_FEATURES)}; the tile state {granted}), "
            "but no tile kernel is built")


# --- layouts (every CPU) -------------------------------------------------------------------------------------

def bf16_pairs(bits: np.ndarray) -> np.ndarray:
    """A bfloat16 matrix [out, in] as stored (compact.py: uint16 bits) laid out for tdpbf16ps: uint16
    (ceil(out / 16), ceil(in / 32), 16, 32), zeros past the matrix. Tile [n, k] holds outputs 16 n .. 16 n + 15
    and inputs 32 k .. 32 k + 31; its row r is the pairs of inputs 32 k + 2 r and 32 k + 2 r + 1 of each output:
    tile[n, k][r, 2 c + j] = bits[16 n + c, 32 k + 2 r + j]. The same bytes as the matrix but for the padding."""
    return _tiled(bits, 2, PAIR_INPUTS)


def int8_quads(q: np.ndarray) -> np.ndarray:
    """An int8 matrix [out, in] (int4's unpacked to a byte each: compact.unpack) laid out for tdpbssd/tdpbusd by
    groups of GROUP inputs, each with its scale: int8 (ceil(out / 16), in / GROUP, GROUP / 4, 64), zeros past the
    matrix's outputs. Tile [n, g] is the weights of outputs 16 n .. 16 n + 15 and group g:
    tile[n, g][r, 4 c + j] = q[16 n + c, GROUP g + 4 r + j] (a half-height tile: a group is half a tile row's
    64 inputs, and every group's sums are scaled on their own)."""
    if q.shape[1] % GROUP:
        raise ConfigError(f"int8_quads takes whole groups of {GROUP} inputs, not {q.shape[1]}")
    return _tiled(q, 4, GROUP)


def _tiled(m, per, block):
    """m [out, in] -> (ceil(out / 16), ceil(in / block), block // per, 16 * per): a tile per 16 outputs x block
    inputs, a row per ``per`` consecutive inputs, in it each output's ``per`` inputs side by side."""
    out, k = m.shape
    n_tiles, k_tiles = -(-out // TILE_ROWS), -(-k // block)
    padded = np.zeros((n_tiles * TILE_ROWS, k_tiles * block), m.dtype)
    padded[:out, :k] = m
    # (n, c, k, r, j) -> (n, k, r, c, j): output c of tile n, input per r + j of block k
    tiles = padded.reshape(n_tiles, TILE_ROWS, k_tiles, block // per, per).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(tiles).reshape(n_tiles, k_tiles, block // per, TILE_ROWS * per)


@njit(cache=True, nogil=True, fastmath=False)
def split_hi_lo(x, hi, lo):
    """x = hi + lo in two bfloat16 parts, for products of float32 inputs on bfloat16 tiles: hi = x rounded to
    bfloat16 (to nearest, ties to even), lo = x - hi (exact in float32) rounded the same, so that
    |x - (hi + lo)| <= 2^-16 |x| (bfloat16's unit roundoff squared) for normal x below bfloat16's largest.
    x: float32 (T, K); hi, lo: uint16 (T, K), bits."""
    for t in range(x.shape[0]):
        for k in range(x.shape[1]):
            high = _to_bfloat16(x[t, k])
            hi[t, k] = high
            lo[t, k] = _to_bfloat16(x[t, k] - _from_bfloat16(high))


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)
