"""Weights mapped from a file, not read: gpt2numba's stacked layout, and a copy of each checkpoint in it.

A save_pretrained checkpoint keeps a tensor per layer, and the blocks' matrices [in, out]; the kernels read
them stacked over the layers and, in every format, [out, in] (weights.py), so load_weights reads and
converts them: GPT-2 xl's 6.2 GB took 10.6 s. The stacked layout is a safetensors file of the GPT2Weights
arrays as the kernels read them (a tensor per field; "scales.FIELD" for int8's and int4's scales), with the
config and the format in its metadata. Mapped read-only, it is ready once its sums are read (from the page
cache, 10-30 GB/s), and is one copy in memory for every process that maps it.

save_weights(w, path, layout="stacked") writes one to ship. load_weights writes one of each checkpoint
and format it converts to $XDG_CACHE_HOME/gpt2numba/weights, and maps it from then on. A copy is named by
what it was made from: the checkpoint's path, device, inode, size, modification and change times (a
write changes the change time, which cannot be set back), its header, and the format; the copies of
a checkpoint's earlier states are removed when a new one is written, and files a killed conversion left.
Its metadata holds the sha256 of the rest of its header and two sums of the data's 64-bit words (plain, and
weighted by 1 MiB block), checked as it is mapped: a copy cut short, altered or of an older layout is not
trusted but made again; a stacked file the user gives that fails them is a CheckpointError. Files are
little-endian, as safetensors': a big-endian machine reads its checkpoints into memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import mmap
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from ..cpu.tuning import replacing
from ..errors import CheckpointError
from . import compact
from .compact import BLOCK_MATRICES, INTEGER, MATRICES
from .config import GPT2Config
from .weights import GPT2Weights, _field_shapes

LAYOUT = "gpt2numba-stacked-1"  # the metadata's "layout": a new number for any change in what the file holds
_DTYPES = {np.dtype("float32"): "F32", np.dtype("uint16"): "U16", np.dtype("int8"): "I8", np.dtype("uint8"): "U8"}
_BLOCK_WORDS = 1 << 17  # 64-bit words a block of the weighted sum holds: 1 MiB
_ABANDONED_S = 3600  # a .partial file untouched this long was left by a conversion that was killed


class MappingWarning(UserWarning):
    """A converted checkpoint could not be written for mapping: the weights were read into memory."""


def is_mapped(w: GPT2Weights) -> bool:
    """Whether the weights' arrays lie in a memory map (of a stacked file)."""
    base = w.c_fc_w
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)


def is_stacked(header: dict) -> bool:
    """Whether a safetensors header is of a file in the stacked layout (of any version)."""
    return str(header.get("__metadata__", {}).get("layout", "")).startswith("gpt2numba-stacked")


def write(w: GPT2Weights, file: Path, metadata: dict | None = None) -> None:
    """Write ``w`` to ``file`` in the stacked layout, whole or not at all (a temporary file, renamed)."""
    arrays = _arrays(w)
    order = sorted(arrays, key=lambda name: (-arrays[name].itemsize, name))  # (each tensor aligned to its type)
    header, offset = {}, 0
    for name in order:
        a = arrays[name]
        header[name] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    meta = {"layout": LAYOUT, "dtype": w.dtype, "config": json.dumps(dataclasses.asdict(w.config)), **(metadata or {})}
    meta |= {"header_sha256": _header_digest(header, meta), "sums": "0" * 33}
    if sys.byteorder != "little":
        raise CheckpointError("the stacked layout is little-endian; this machine is not")
    with replacing(file) as out:
        out.write(_header(header, meta))  # (the sums, of the data written, go in once known: the same length)
        for name in order:
            out.write(memoryview(np.ascontiguousarray(arrays[name])).cast("B"))
        out.flush()
        start = out.tell() - offset
        with mmap.mmap(out.fileno(), 0, access=mmap.ACCESS_READ) as data:
            meta["sums"] = _sums(np.frombuffer(data, np.uint8, offset, start))
        out.seek(0)
        out.write(_header(header, meta))


def _header_digest(header: dict, meta: dict) -> str:
    """The sha256 of the header's tensors and metadata but the digest and the sums themselves."""
    rest = {k: v for k, v in meta.items() if k not in ("header_sha256", "sums")}
    return hashlib.sha256(json.dumps([rest, header], sort_keys=True).encode()).hexdigest()


def _header(header: dict, meta: dict) -> bytes:
    """A safetensors header: its length, then its JSON padded to 8 bytes (where the data start)."""
    encoded = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded


def read(file: Path, source: str, mapped: bool = True) -> GPT2Weights:
    """The weights of a stacked file, mapped read-only (or read into memory); CheckpointError (naming ``source``)
    for a file cut short, altered, of another layout or inconsistent."""
    if sys.byteorder != "little":
        raise CheckpointError(f"{source!r} is little-endian, as the stacked layout is; this machine is not")
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            header_len = int.from_bytes(f.read(8), "little")
            if not 0 < header_len <= size - 8:
                raise ValueError(f"a header of {header_len} bytes in a file of {size}")
            header = json.loads(f.read(header_len))
            meta = header.pop("__metadata__")
            if meta.get("layout") != LAYOUT:
                raise CheckpointError(f"{source!r} is in layout {meta.get('layout')!r}; this gpt2numba maps {LAYOUT!r}")
            if meta.get("header_sha256") != _header_digest(header, meta):
                raise CheckpointError(f"{source!r} does not hold the header it was written with (its digest differs)")
            config, dtype = GPT2Config(**json.loads(meta["config"])), meta["dtype"]
            end = max((t["data_offsets"][1] for t in header.values()), default=0)
        except CheckpointError:
            raise
        except Exception as e:  # (any header that fails to parse is not one this layout wrote)
            raise CheckpointError(f"{source!r} has no readable stacked-layout header: {e!r}") from None
        start = 8 + header_len
        if size != start + end or not end:
            raise CheckpointError(f"{source!r} holds {size} bytes; its header says {start + end}")
        # (a map stays while an array uses it)
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if mapped else f.seek(0) or f.read()
    if _sums(np.frombuffer(data, np.uint8, end, start)) != meta.get("sums"):
        raise CheckpointError(f"{source!r} does not hold the data it was written with (its sums differ)")
    arrays = {}
    for name, t in header.items():
        kind = next((d for d, code in _DTYPES.items() if code == t.get("dtype")), None)
        begin, stop = t["data_offsets"]
        if kind is None or (start + begin) % kind.itemsize or stop - begin != kind.itemsize * math.prod(t["shape"]):
            raise CheckpointError(f"{source!r}: tensor {name!r} is not one of the stacked layout ({t})")
        arrays[name] = np.frombuffer(data, kind, (stop - begin) // kind.itemsize, start + begin).reshape(t["shape"])
    return _weights(arrays, config, dtype, source)


def _arrays(w: GPT2Weights) -> dict[str, np.ndarray]:
    """The arrays of ``w`` as the kernels read them (float32's block matrices [out, in]), by tensor name."""
    arrays = {}
    for field, _ in _field_shapes(w.config):
        a = getattr(w, field)
        arrays[field] = compact.to_rows(field, a) if w.dtype == "float32" and field in BLOCK_MATRICES else a
    for field, scale in (w.scales or {}).items():
        arrays[f"scales.{field}"] = scale
    return arrays


def _weights(arrays: dict, config: GPT2Config, dtype: str, source: str) -> GPT2Weights:
    expected = {field for field, _ in _field_shapes(config)} | ({f"scales.{f}" for f in MATRICES} if dtype in INTEGER
                                                               else set())
    if set(arrays) != expected:
        raise CheckpointError(f"{source!r} holds tensors {sorted(set(arrays) ^ expected)} it should not, or lacks them")
    fields = {field: compact.from_rows(field, arrays[field]) if dtype == "float32" and field in BLOCK_MATRICES
              else arrays[field] for field, _ in _field_shapes(config)}
    scales = {field: arrays[f"scales.{field}"] for field in MATRICES} if dtype in INTEGER else None
    return GPT2Weights(config=config, dtype=dtype, scales=scales, **fields)  # (checks every shape and type)


def _sums(data: np.ndarray) -> str:
    """Two sums of the bytes' little-endian 64-bit words (the last padded with zeros), mod 2^64, in hex: the
    plain sum, and the sum of each 1 MiB block's sum times the block's number from 1, which moving a block
    changes. Read from a mapped file's page cache at 10-30 GB/s (docs/performance-history.md, "Start")."""
    whole = data.size // 8
    words = np.frombuffer(data, np.uint64, whole) if whole else np.zeros(0, np.uint64)
    full = whole // _BLOCK_WORDS * _BLOCK_WORDS
    tail = np.zeros(8, np.uint8)
    tail[: data.size - whole * 8] = data[whole * 8:]
    with np.errstate(over="ignore"):
        blocks = words[:full].reshape(-1, _BLOCK_WORDS).sum(axis=1, dtype=np.uint64)
        last = words[full:].sum(dtype=np.uint64) + tail.view(np.uint64)[0]
        blocks = np.append(blocks, np.uint64(last))
        weighted = (blocks * np.arange(1, blocks.size + 1, dtype=np.uint64)).sum(dtype=np.uint64)
        return f"{int(blocks.sum(dtype=np.uint64)):016x} {int(weighted):016x}"


def state_of(file: Path) -> list:
    """What a change to ``file`` changes: its real path, device, inode, size, times, and the sha256 of its first
    and last 64 KiB (a file rewritten in place with its times set back)."""
    real = os.path.realpath(file)
    st = os.stat(real)
    with open(real, "rb") as f:
        ends = f.read(1 << 16)
        f.seek(max(0, st.st_size - (1 << 16)))
        ends += f.read()
    return [real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, hashlib.sha256(ends).hexdigest()]


def copy_path(file: Path, config_json: Path | None, dtype: str) -> Path | None:
    """Where the stacked copy of checkpoint ``file`` (with its config.json, if any) in ``dtype`` is kept: named
    by the checkpoint's path, then by its state (state_of) and config.json's; None where there is no cache
    (no home directory) or the machine is big-endian."""
    from ..cpu.tuning import cache_home

    if sys.byteorder != "little":
        return None
    made_from = [*state_of(file), dtype, LAYOUT,
                 hashlib.sha256(config_json.read_bytes()).hexdigest() if config_json is not None else None]
    try:
        folder = cache_home() / "weights"
    except RuntimeError:
        return None
    key = hashlib.sha256(json.dumps(made_from).encode()).hexdigest()[:24]
    # (a place's copies in one format and layout version replace each other: keep_copy)
    place, version = hashlib.sha256(made_from[0].encode()).hexdigest()[:16], LAYOUT.rsplit("-", 1)[1]
    return folder / f"{place}-{dtype}-{version}-{key}.safetensors"


def mapped_copy(copy: Path) -> GPT2Weights | None:
    """The weights of a copy, mapped; None (and the copy removed) where there is none or it fails its checks."""
    if not os.path.isfile(copy):  # (False, not an error, where the folder cannot be searched)
        return None
    try:
        return read(copy, str(copy))
    except Exception:  # (a copy is untrusted: whatever reading it raises, it is made again)
        with contextlib.suppress(OSError):
            copy.unlink()
        return None


def keep_copy(w: GPT2Weights, copy: Path, source: str) -> GPT2Weights:
    """``w`` written to ``copy`` and mapped from it, the copies of the checkpoint's earlier states removed; ``w``
    itself, with a MappingWarning, where the copy cannot be written."""
    try:
        copy.parent.mkdir(parents=True, exist_ok=True)
        for left in copy.parent.glob("*.partial"):
            with contextlib.suppress(OSError):
                if time.time() - left.stat().st_mtime > _ABANDONED_S:
                    left.unlink()
        free = shutil.disk_usage(copy.parent).free
        if free < w.nbytes + (1 << 30):  # (a copy must not fill the disk others write to)
            raise OSError(f"{free >> 20} MiB free, the copy takes {w.nbytes >> 20} MiB and 1 GiB must stay free")
        write(w, copy, {"source": source})
        for stale in copy.parent.glob(copy.name.rsplit("-", 1)[0] + "-*.safetensors"):
            if stale != copy:
                with contextlib.suppress(OSError):
                    stale.unlink()
        return read(copy, str(copy))
    except OSError as e:
        warnings.warn(f"gpt2numba: cannot keep a mapped copy of {source!r} in {str(copy.parent)!r} ({e}); its weights "
                      "are read into this process's memory, as they will be until one can be written", MappingWarning,
                      stacklevel=3)
        return w


def random_copy(config: GPT2Config, seed: int) -> GPT2Weights:
    """random_weights(config, seed), mapped from a copy in the user's cache made the first time (GPT-2 small's
    take 3-4 s to draw): named by the config, the seed, NumPy's version (its generator's stream) and weights.py's
    source, where random_weights is written."""
    from ..cpu.tuning import cache_home
    from . import weights

    drawn = hashlib.sha256(json.dumps([dataclasses.asdict(config), seed]).encode()).hexdigest()[:12]
    try:
        made_from = [drawn, np.__version__, LAYOUT, hashlib.sha256(Path(weights.__file__).read_bytes()).hexdigest()]
        key = hashlib.sha256(json.dumps(made_from).encode()).hexdigest()[:24]
        copy = cache_home() / "weights" / f"random-{drawn}-{key}.safetensors"
    except (RuntimeError, OSError):
        return weights.random_weights(config, seed)
    if sys.byteorder != "little":
        return weights.random_weights(config, seed)
    w = mapped_copy(copy)
    return w if w is not None else keep_copy(weights.random_weights(config, seed), copy, f"random weights, seed {seed}")
