"""GPT-2 checkpoints in safetensors: load_weights reads both layouts real checkpoints use, save_weights writes
the save_pretrained one (and gpt2numba's own int8 and int4 files)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import stat
import sys
from pathlib import Path

import numpy as np

from ..cpu.tuning import replacing
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError
from . import compact, mapped as mapped_layout
from .checks import check_finite
from .compact import BLOCK_MATRICES, INTEGER, MATRICES, STORAGE, storage
from .config import HEAD_DIM, GPT2Config
from .weights import _LAYER_TENSORS, _MODEL_TENSORS, GPT2Weights, check_dtype, _field_shapes

# Buffers, not parameters: the causal mask GPT-2 checkpoints carry per layer.
_IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")


def load_weights(path: str | Path, dtype: str = "float32", activations: str = "float32", *,
                 mapped: bool = True) -> GPT2Weights:
    """Load GPT-2 weights from a safetensors checkpoint or a llama.cpp GGUF file.

    ``path`` is a directory holding ``model.safetensors`` (and ``config.json``,
    whose sizes must agree with the tensors), a ``.safetensors`` file, whose
    config is inferred from the tensor shapes (head_dim 64), or a GGUF file of
    llama.cpp's "gpt2" architecture (from_gguf.py: any type the gguf package dequantizes,
    F16, BF16, Q8_0, Q4_0 and Q6_K exactly in float32; Q8_0, Q4_0 and BF16 as stored
    by int8, int4 and bfloat16). Both layouts of real
    GPT-2 checkpoints load: ``transformer.``-prefixed keys (``save_pretrained``)
    and bare keys (``openai-community/gpt2``). float32, float16 and bfloat16
    tensors are read, and the int8 and int4 files save_weights writes; ``dtype``
    says how the matrices are kept ("float32", "bfloat16", "int8" or "int4", see
    compact.py), one tensor at a time, never the whole model in float32 on the
    way; a file read in its own format (bfloat16, int8, int4) is copied as it is
    (bfloat16's block matrices turned [out, in]). ``activations="bfloat16"`` (bfloat16 weights only)
    rounds every matrix product's inputs to bfloat16, for the CPU's bfloat16 products (docs/formats.md).

    Mapped (the default), the weights are a read-only memory map: of the file itself where it is in
    gpt2numba's stacked layout (save_weights(..., layout="stacked")), else of a copy in that layout that the
    first load of the checkpoint in ``dtype`` writes to $XDG_CACHE_HOME/gpt2numba/weights (mapped.py): the next
    loads take no time, and processes share one copy of the weights in memory. Where no copy can be written
    the weights are read into memory, with a MappingWarning. ``mapped=False`` reads them into memory always,
    and a stacked file asked for in a format other than its own is converted in memory.

    Raises CheckpointNotFoundError for a missing path and CheckpointError for an
    unreadable file, a missing, mis-shaped or non-finite tensor, an untied
    ``lm_head.weight`` (a GGUF's ``output.weight``) or a config.json that disagrees with the tensors.
    """
    from safetensors import SafetensorError, safe_open

    from . import from_gguf

    check_dtype(dtype, activations=activations)  # the config, known later, is checked against it in _read
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointNotFoundError(f"path must be a str or path, got {type(path).__name__}")
    checkpoint = Path(path)  # (the messages name ``path`` as given: Path would drop a leading ./ and a trailing /)
    if not checkpoint.exists():
        raise CheckpointNotFoundError(f"checkpoint {str(path)!r} does not exist")
    config, config_json = None, None
    if checkpoint.is_dir():
        file, source = checkpoint / "model.safetensors", os.path.join(path, "model.safetensors")
        if not file.is_file():
            raise CheckpointNotFoundError(f"checkpoint directory {str(path)!r} has no model.safetensors")
        if (checkpoint / "config.json").is_file():
            config_json = checkpoint / "config.json"
            config = GPT2Config.from_json(os.path.join(path, "config.json"))
    else:
        file, source = checkpoint, os.fspath(path)
    if from_gguf.is_gguf(file):
        read = functools.partial(from_gguf.read, file, source, dtype)
    else:
        try:
            with safe_open(str(file), framework="numpy") as f:
                stacked = mapped_layout.is_stacked({"__metadata__": f.metadata() or {}})
        except SafetensorError as e:
            raise CheckpointError(f"{source!r} is not a readable safetensors file: {e}") from None
        if stacked:
            return _stacked(file, source, config, dtype, mapped).astype(dtype, activations)
        read = functools.partial(_read_safetensors, file, source, config, dtype)
    copy = mapped_layout.copy_path(file, config_json, dtype) if mapped else None
    if copy is not None and (w := mapped_layout.mapped_copy(copy)) is not None:
        return w.astype(dtype, activations)
    w = read()
    if copy is not None and copy == mapped_layout.copy_path(file, config_json, dtype):  # (not changed meanwhile)
        w = mapped_layout.keep_copy(w, copy, source)
    return w.astype(dtype, activations)


def _read_safetensors(file: Path, source: str, config: GPT2Config | None, dtype: str) -> GPT2Weights:
    from safetensors import SafetensorError, safe_open

    # The library checks the file (header, offsets, size) and lists the tensors;
    # their bytes we read ourselves, straight into the stacked arrays: its
    # get_tensor would copy each one out of a memory map that, once read, counts
    # against the process's resident memory beside our copy, doubling the peak.
    try:
        with safe_open(str(file), framework="numpy") as f, open(file, "rb", buffering=0) as raw:
            return _read(f, _TensorReader(raw), source, config, dtype)
    except SafetensorError as e:
        raise CheckpointError(f"{source!r} is not a readable safetensors file: {e}") from None


def _stacked(file: Path, source: str, config: GPT2Config | None, dtype: str, mapped: bool) -> GPT2Weights:
    """A file in the stacked layout, mapped or read; CheckpointError where config.json disagrees with it."""
    w = mapped_layout.read(file, source, mapped)
    if config is not None and config != w.config:
        raise CheckpointError(f"config.json says {config} but {source!r} holds weights of {w.config}")
    check_dtype(dtype, w.config)
    return w


class _TensorReader:
    """Reads tensors from an open safetensors file into preallocated arrays, by the header's offsets."""

    _DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "I8": np.dtype("i1"),
               "U8": np.dtype("u1")}

    def __init__(self, raw):
        self.raw = raw
        header_len = int.from_bytes(raw.read(8), "little")
        self.header = json.loads(raw.read(header_len))
        self.data_start = 8 + header_len

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def read_into(self, name: str, dest: np.ndarray) -> None:
        """The tensor's float32 values into float32 ``dest``."""
        dtype = self.dtype(name)
        if dtype not in ("F32", "F16", "BF16"):
            raise CheckpointError(f"tensor {name!r} has dtype {dtype}; expected F32, F16 or BF16")
        if dtype == "F32" and dest.flags.c_contiguous:
            self.read_stored(name, dest)
            return
        stored = self._fromfile(name, dest.size).reshape(dest.shape)
        dest[...] = compact.from_bfloat16(stored) if dtype == "BF16" else stored

    def read_stored(self, name: str, dest: np.ndarray) -> None:
        """The tensor's bytes as they are into ``dest`` of the same format (F32, BF16 as uint16, I8, U8)."""
        if sys.byteorder != "little" or dest.itemsize == 1:
            dest[...] = self._fromfile(name, dest.size).reshape(dest.shape)
            return
        self.raw.seek(self.data_start + self.header[name]["data_offsets"][0])
        if self.raw.readinto(memoryview(dest).cast("B")) != dest.nbytes:
            raise CheckpointError(f"tensor {name!r} is cut short")

    def _fromfile(self, name: str, count: int) -> np.ndarray:
        self.raw.seek(self.data_start + self.header[name]["data_offsets"][0])
        return np.fromfile(self.raw, self._DTYPES[self.dtype(name)], count)


def _read(f, reader: _TensorReader, source: str, config: GPT2Config | None, dtype: str) -> GPT2Weights:
    """Gather, check and stack the tensors of an open safetensors file (``source``: its path, as the messages
    name it)."""
    names = set(f.keys())
    integer_file = any(n.endswith(_SCALE) for n in names)  # int8 or int4, as save_weights writes them
    prefix = "transformer." if "transformer.wte.weight" in names else ""

    def shape(name):
        return tuple(f.get_slice(prefix + name).get_shape())

    for name in ("wte.weight", "wpe.weight"):
        if prefix + name not in names:
            raise CheckpointError(f"{source!r} has no tensor {prefix + name!r}")
    n_layer = len({m.group(1) for n in names if (m := re.match(rf"{re.escape(prefix)}h\.(\d+)\.", n))})
    inferred = _infer_config(shape("wte.weight"), shape("wpe.weight"), n_layer, source)
    if config is None:
        config = inferred
    elif (config.n_layer, config.n_embd, config.vocab_size, config.n_positions) != (
        inferred.n_layer, inferred.n_embd, inferred.vocab_size, inferred.n_positions
    ):
        raise CheckpointError(
            f"config.json says n_layer={config.n_layer}, n_embd={config.n_embd}, "
            f"vocab_size={config.vocab_size}, n_positions={config.n_positions} but the tensors in "
            f"{source!r} give n_layer={inferred.n_layer}, n_embd={inferred.n_embd}, "
            f"vocab_size={inferred.vocab_size}, n_positions={inferred.n_positions}"
        )

    check_dtype(dtype, config)
    expected = {}  # checkpoint name -> (field, layer or None, shape)
    for field, name, shape_of in _MODEL_TENSORS:
        expected[prefix + name] = (field, None, shape_of(config))
    for layer in range(config.n_layer):
        for field, name, shape_of in _LAYER_TENSORS:
            expected[f"{prefix}h.{layer}.{name}"] = (field, layer, shape_of(config))
    missing = sorted(set(expected) - names, key=_natural)
    if missing:
        raise CheckpointError(f"{source!r} lacks tensor {missing[0]!r} ({len(missing)} missing in all)")
    known = set(expected) | {"lm_head.weight"} | {n for n in names if integer_file and n.endswith(_SCALE)}
    unknown = sorted(n for n in names - known if not _IGNORED.search(n))
    if unknown:
        raise CheckpointError(f"{source!r} has unexpected tensor {unknown[0]!r}; is this GPT-2?")

    arrays = {field: np.empty(compact.stored_shape(field, shape, dtype) if field in MATRICES else shape,
                              storage(field, dtype) if field in MATRICES else np.float32)
              for field, shape in _field_shapes(config)}
    if dtype == "float32":  # the blocks' matrices kept [out, in] from the start (GPT2Weights)
        arrays |= {field: compact.from_rows(field, np.empty(compact.to_rows(field, arrays[field]).shape, np.float32))
                   for field in BLOCK_MATRICES}
    scales = {field: np.empty(compact.scale_shape(field, shape), np.float32)
              for field, shape in _field_shapes(config) if field in MATRICES} if dtype in INTEGER else None
    for name, (field, layer, model_shape) in expected.items():
        got, kind = shape(name[len(prefix):]), _FILE_FORMATS.get(reader.dtype(name))
        # bfloat16 files keep the model's layout; int8 and int4 ones ours
        want = compact.stored_shape(field, model_shape, kind) if kind in INTEGER and field in MATRICES else model_shape
        if got != want:
            raise CheckpointError(f"tensor {name!r} has shape {list(got)}, expected {list(want)}")
        at = ... if layer is None else layer
        if field not in MATRICES or dtype == "float32" and not integer_file:
            reader.read_into(name, arrays[field][at])
            check_finite(name, arrays[field][at])
        elif kind == compact.format_of(field, dtype):  # as stored
            if dtype in INTEGER:
                reader.read_stored(name, arrays[field][at])
                _read_scale(f, reader, name, scales[field][at])
            else:  # bfloat16 bits, turned [out, in]
                bits = np.empty(model_shape, np.uint16)
                reader.read_stored(name, bits)
                check_finite(name, compact.from_bfloat16(bits))
                arrays[field][at] = compact.to_rows(field, bits)
        else:  # through float32, one tensor at a time
            values = _read_float32(f, reader, name, field, model_shape)
            check_finite(name, values)
            stored, scale = compact.compress(field, values, dtype)
            arrays[field][at] = stored
            if scales is not None:
                scales[field][at] = scale
    if "lm_head.weight" in names:
        lm_head = np.empty(tuple(f.get_slice("lm_head.weight").get_shape()), np.float32)
        if lm_head.shape == arrays["wte"].shape:
            reader.read_into("lm_head.weight", lm_head)
        if lm_head.shape != arrays["wte"].shape or not np.array_equal(
                compact.compress("wte", lm_head, dtype)[0], arrays["wte"]):
            raise CheckpointError(
                f"{source!r} has an lm_head.weight that differs from wte.weight; "
                "gpt2numba supports only GPT-2's tied output head"
            )
    return GPT2Weights(config=config, **arrays, dtype=dtype, scales=scales)


_SCALE = "_scale"  # an int8 or int4 file's scales of tensor NAME: NAME_scale (save_weights writes them)
_FILE_FORMATS = {"BF16": "bfloat16", "I8": "int8", "U8": "int4"}  # a file's tensors in our formats, by safetensors dtype


def _read_scale(f, reader, name, dest):
    if name + _SCALE not in reader.header:
        raise CheckpointError(f"{_FILE_FORMATS[reader.dtype(name)]} tensor {name!r} has no {name + _SCALE!r}")
    got = tuple(f.get_slice(name + _SCALE).get_shape())
    if got != dest.shape or reader.dtype(name + _SCALE) != "F32":
        raise CheckpointError(f"tensor {name + _SCALE!r} is not F32 of shape {list(dest.shape)}")
    reader.read_stored(name + _SCALE, dest)
    check_finite(name + _SCALE, dest)


def _read_float32(f, reader, name, field, shape) -> np.ndarray:
    """One matrix's float32 values in the model's layout ``shape``, dequantised if the file holds int8 or int4."""
    kind = _FILE_FORMATS.get(reader.dtype(name))
    if kind not in INTEGER:
        values = np.empty(shape, np.float32)
        reader.read_into(name, values)
        return values
    q = np.empty(compact.stored_shape(field, shape, kind), STORAGE[kind])
    reader.read_stored(name, q)
    scale = np.empty(compact.scale_shape(field, shape), np.float32)
    _read_scale(f, reader, name, scale)
    return compact.expand(field, q, scale)


def _infer_config(wte_shape, wpe_shape, n_layer, source) -> GPT2Config:
    if len(wte_shape) != 2 or len(wpe_shape) != 2 or wte_shape[1] != wpe_shape[1]:
        raise CheckpointError(
            f"{source!r}: wte {list(wte_shape)} and wpe {list(wpe_shape)} are not [vocab, n_embd] "
            "and [n_positions, n_embd]"
        )
    n_embd = wte_shape[1]
    if n_layer == 0:
        raise CheckpointError(f"{source!r} has no transformer blocks (no 'h.N.' tensors)")
    if n_embd % HEAD_DIM:
        raise CheckpointError(f"{source!r}: n_embd={n_embd} is not a multiple of head_dim {HEAD_DIM}")
    return GPT2Config(
        n_layer=n_layer,
        n_head=n_embd // HEAD_DIM,
        n_embd=n_embd,
        n_positions=wpe_shape[0],
        vocab_size=wte_shape[0],
    )


def _natural(name: str):
    """Sort key that puts h.2 before h.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def save_weights(w: GPT2Weights, path: str | Path, dtype: str | None = None, layout: str = "pretrained") -> None:
    """Write ``w`` as a checkpoint directory: config.json and model.safetensors.

    ``layout="pretrained"``: the ``save_pretrained`` layout, ``transformer.``-prefixed keys. ``dtype``
    (default: the weights' own) is "float32", "float16", "bfloat16" (files any GPT-2 loader reads), "int8" or
    "int4": gpt2numba's own formats, each matrix as stored in memory ([out, in], I8, or U8 of packed
    nibbles) beside its F32 scales in NAME_scale, so that quantisation is paid once; load_weights(path,
    dtype=...) reads them back bit for bit. ``layout="stacked"``: the arrays as the kernels read them
    (mapped.py; any ``dtype`` but float16), which load_weights maps as they are: the file to ship where
    processes should start at once.
    """
    if not isinstance(w, GPT2Weights):
        raise ConfigError(f"save_weights needs GPT2Weights, got {type(w).__name__}")
    dtype = dtype or w.dtype
    if layout not in ("pretrained", "stacked"):
        raise ConfigError(f"layout must be 'pretrained' or 'stacked', got {layout!r}")
    if dtype not in ("float32", "float16", "bfloat16", *INTEGER) or layout == "stacked" and dtype == "float16":
        raise ConfigError(f"dtype must be float32, {'float16, ' * (layout == 'pretrained')}bfloat16, int8 or int4 "
                          f"in the {layout} layout, got {dtype!r}")
    if Path(path).exists() and not Path(path).is_dir():
        raise CheckpointError(f"{str(path)!r} is a file; save_weights writes a directory")
    if dtype in ("bfloat16", *INTEGER) or layout == "stacked":
        w = w.astype(dtype)  # as it is if already so
    path = Path(path)
    if layout == "stacked":
        mapped_layout.write(w, path / "model.safetensors")
    else:
        _write_pretrained(w, path / "model.safetensors", dtype)
    # (n_ctx: the older name of n_positions, which GPT-2's own config.json carries and llama.cpp's converter reads)
    config = dataclasses.asdict(w.config) | {"n_ctx": w.config.n_positions, "model_type": "gpt2",
                                             "architectures": ["GPT2LMHeadModel"]}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # safetensors (and a temporary file) writes for its owner alone (0600); the weights get the mode the umask
    # gives config.json, as any file the user writes
    os.chmod(path / "model.safetensors", stat.S_IMODE((path / "config.json").stat().st_mode))


def _write_pretrained(w: GPT2Weights, file: Path, dtype: str) -> None:
    from safetensors.numpy import save_file

    cfg = w.config
    tensors = {}
    # (L, ...) arrays as the file stores them, each kind converted once
    if dtype == "bfloat16":
        import ml_dtypes

        stored = {field: compact.from_rows(field, getattr(w, field)).view(ml_dtypes.bfloat16) for field in MATRICES}
    elif dtype in INTEGER:
        stored = {field: getattr(w, field) for field in MATRICES}
    else:
        stored = {field: w.matrix(field) for field in MATRICES}

    def put(name, field, layer):
        at = ... if layer is None else layer
        a = stored[field][at] if field in MATRICES else getattr(w, field)[at]
        if field in MATRICES and dtype in INTEGER:
            tensors[name + _SCALE] = w.scales[field][at]
        if a.dtype == np.float32 and dtype in ("float16", "bfloat16"):
            a = _cast16(a, dtype)
        tensors[name] = np.ascontiguousarray(a)

    for field, name, _ in _MODEL_TENSORS:
        put(f"transformer.{name}", field, None)
    for layer in range(cfg.n_layer):
        for field, name, _ in _LAYER_TENSORS:
            put(f"transformer.h.{layer}.{name}", field, layer)
    with replacing(file) as part:  # (a process that maps the old file, this one too, keeps it whole)
        save_file(tensors, part.name)


def _cast16(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return a.astype(np.float16)
    import ml_dtypes

    return compact.to_bfloat16(a).view(ml_dtypes.bfloat16)
