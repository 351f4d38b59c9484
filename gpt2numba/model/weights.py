"""GPT-2 weights: stacked arrays, float32 or compact, and seeded random ones (checkpoints.py reads and writes files)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..errors import CheckpointError, ConfigError
from . import checks, compact
from .compact import ACTIVATIONS, BLOCK_MATRICES, DTYPES, INTEGER, MATRICES, storage
from .config import GPT2Config

# Per-layer tensors: our field name, the checkpoint's name inside block "h.N.",
# and the shape (from the config) as GPT-2's Conv1D stores it: [in, out].
_LAYER_TENSORS = (
    ("ln_1_g", "ln_1.weight", lambda c: (c.n_embd,)),
    ("ln_1_b", "ln_1.bias", lambda c: (c.n_embd,)),
    ("c_attn_w", "attn.c_attn.weight", lambda c: (c.n_embd, 3 * c.n_embd)),
    ("c_attn_b", "attn.c_attn.bias", lambda c: (3 * c.n_embd,)),
    ("attn_c_proj_w", "attn.c_proj.weight", lambda c: (c.n_embd, c.n_embd)),
    ("attn_c_proj_b", "attn.c_proj.bias", lambda c: (c.n_embd,)),
    ("ln_2_g", "ln_2.weight", lambda c: (c.n_embd,)),
    ("ln_2_b", "ln_2.bias", lambda c: (c.n_embd,)),
    ("c_fc_w", "mlp.c_fc.weight", lambda c: (c.n_embd, 4 * c.n_embd)),
    ("c_fc_b", "mlp.c_fc.bias", lambda c: (4 * c.n_embd,)),
    ("mlp_c_proj_w", "mlp.c_proj.weight", lambda c: (4 * c.n_embd, c.n_embd)),
    ("mlp_c_proj_b", "mlp.c_proj.bias", lambda c: (c.n_embd,)),
)
_MODEL_TENSORS = (
    ("wte", "wte.weight", lambda c: (c.vocab_size, c.n_embd)),
    ("wpe", "wpe.weight", lambda c: (c.n_positions, c.n_embd)),
    ("ln_f_g", "ln_f.weight", lambda c: (c.n_embd,)),
    ("ln_f_b", "ln_f.bias", lambda c: (c.n_embd,)),
)


def _field_shapes(c: GPT2Config):
    """(field, shape) of every GPT2Weights array, per-layer kinds stacked."""
    for field, _, shape_of in _MODEL_TENSORS:
        yield field, shape_of(c)
    for field, _, shape_of in _LAYER_TENSORS:
        yield field, (c.n_layer, *shape_of(c))


@dataclasses.dataclass(frozen=True, eq=False)
class GPT2Weights:
    """Every GPT-2 parameter as read-only arrays.

    Per-layer kinds are stacked on a leading layer axis (L = n_layer, C = n_embd,
    V = vocab_size, P = n_positions); matrices are [in, out], so ``x @ w + b``.
    The output head is tied: logits = ln_f(x) @ wte.T. In float32 the blocks' four
    matrices are views [in, out] of arrays kept [out, in] (``compact.to_rows`` gives
    those, C-contiguous), so that an output's weights are contiguous for the products
    over a few rows; everything else is C-contiguous. The compact formats store the
    matrices (wte and the blocks' four) [out, in]: "bfloat16" as bfloat16 bits in
    uint16, "int8" or "int4" as int8 or as packed nibbles (uint8; int4 keeps wte in
    int8), and ``scales`` maps each integer matrix to its float32 per-group scales
    (see compact.py).
    ``matrix(field)`` gives any of them as float32 in the layout above.
    Everything else is float32 always. ``activations`` says how the matrix products take their inputs:
    as float32, or (bfloat16 weights only) rounded to bfloat16 once, for the CPU's bfloat16 products.
    """

    config: GPT2Config
    wte: np.ndarray            # (V, C) token embeddings, also the output head
    wpe: np.ndarray            # (P, C) position embeddings
    ln_1_g: np.ndarray         # (L, C)
    ln_1_b: np.ndarray         # (L, C)
    c_attn_w: np.ndarray       # (L, C, 3C) columns: q | k | v, heads in order
    c_attn_b: np.ndarray       # (L, 3C)
    attn_c_proj_w: np.ndarray  # (L, C, C)
    attn_c_proj_b: np.ndarray  # (L, C)
    ln_2_g: np.ndarray         # (L, C)
    ln_2_b: np.ndarray         # (L, C)
    c_fc_w: np.ndarray         # (L, C, 4C)
    c_fc_b: np.ndarray         # (L, 4C)
    mlp_c_proj_w: np.ndarray   # (L, 4C, C)
    mlp_c_proj_b: np.ndarray   # (L, C)
    ln_f_g: np.ndarray         # (C,)
    ln_f_b: np.ndarray         # (C,)
    dtype: str = "float32"     # of the matrices: "float32", "bfloat16", "int8" or "int4"
    scales: dict | None = None  # int8, int4: matrix field -> float32 scales, compact.scale_shape
    activations: str = "float32"  # the products' inputs: "float32", or "bfloat16" with bfloat16 weights

    def __post_init__(self):
        check_dtype(self.dtype, self.config, self.activations)
        if (self.scales is not None) != (self.dtype in INTEGER):
            raise ConfigError("int8 and int4 weights need scales, and only they have them")
        arrays = [(field, shape, storage(field, self.dtype) if field in MATRICES else np.float32)
                  for field, shape in _field_shapes(self.config)]
        for field, shape, dtype in arrays:
            stored = compact.stored_shape(field, shape, self.dtype) if field in MATRICES else shape
            keep = functools.partial(_kept_as_rows, field) if self.dtype == "float32" and field in BLOCK_MATRICES \
                else np.ascontiguousarray
            object.__setattr__(self, field, _checked(field, getattr(self, field), stored, dtype, keep))
        if self.scales is not None:
            scales = {field: _checked(f"scales[{field!r}]", self.scales.get(field),
                                      compact.scale_shape(field, shape), np.float32)
                      for field, shape, _ in arrays if field in MATRICES}
            object.__setattr__(self, "scales", scales)

    @property
    def nbytes(self) -> int:
        scales = sum(a.nbytes for a in self.scales.values()) if self.scales else 0
        return scales + sum(getattr(self, field).nbytes for field, _ in _field_shapes(self.config))

    def matrix(self, field: str) -> np.ndarray:
        """A matrix kind as float32, whatever its storage (a new array unless float32)."""
        return compact.expand(field, getattr(self, field), self.scales and self.scales[field])

    def astype(self, dtype: str, activations: str | None = None) -> GPT2Weights:
        """These weights with their matrices stored as ``dtype`` (from float32 values), their products taking
        ``activations`` ("float32", or "bfloat16" with bfloat16 weights; by default these weights' own where
        ``dtype`` allows it, else "float32")."""
        if activations is None:
            activations = self.activations if dtype == "bfloat16" else "float32"
        check_dtype(dtype, self.config, activations)
        if dtype == self.dtype:
            return self if activations == self.activations else dataclasses.replace(self, activations=activations)
        stored = {field: compact.compress(field, self.matrix(field), dtype) for field in MATRICES}
        return dataclasses.replace(
            self, dtype=dtype, activations=activations, **{field: a for field, (a, _) in stored.items()},
            scales={field: s for field, (_, s) in stored.items()} if dtype in INTEGER else None)

    def __reduce__(self):  # unpickled through __init__, so that the arrays are kept as above
        return _rebuilt, ({f.name: getattr(self, f.name) for f in dataclasses.fields(self)},)

    def dequantized(self) -> GPT2Weights:
        """float32 weights with the values these ones stand for (self if float32)."""
        if self.dtype == "float32":
            return self
        return dataclasses.replace(self, dtype="float32", scales=None, activations="float32",
                                   **{field: self.matrix(field) for field in MATRICES})


def check_dtype(dtype: str, config: GPT2Config | None = None, activations: str = "float32") -> None:
    """ConfigError unless ``dtype`` is a storage format (and, given a config, one it fits) whose products
    may take ``activations``: what every entry point checks before it loads anything."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if activations not in ACTIVATIONS:
        raise ConfigError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    if activations == "bfloat16" and dtype != "bfloat16":
        raise ConfigError(f"activations='bfloat16' needs bfloat16 weights (dtype='bfloat16'), got dtype={dtype!r}")
    if activations == "bfloat16" and config is not None and config.n_embd % 2:
        raise ConfigError(f"bfloat16 activations need an even n_embd (their products take inputs in pairs), "
                          f"got {config.n_embd}")
    if dtype in INTEGER and config is not None and config.n_embd % compact.GROUP:
        raise ConfigError(f"{dtype} weights need n_embd divisible by {compact.GROUP}, got {config.n_embd}")


def _rebuilt(fields: dict) -> GPT2Weights:
    return GPT2Weights(**fields)


def _checked(name, a, shape, dtype, keep=np.ascontiguousarray):
    """``a`` as a read-only array of ``shape`` and ``dtype`` laid out by ``keep`` (C-contiguous unless
    _kept_as_rows), or CheckpointError."""
    if not isinstance(a, np.ndarray) or a.dtype != dtype:
        raise CheckpointError(f"{name} must be a {np.dtype(dtype).name} ndarray, got "
                              f"{getattr(a, 'dtype', type(a).__name__)}")
    if a.shape != shape:
        raise CheckpointError(f"{name} has shape {a.shape}, expected {shape}")
    a = keep(a).view()  # a view: the caller's own array stays writable
    a.flags.writeable = False  # nothing we run may change the weights
    return a


def _kept_as_rows(field: str, a: np.ndarray) -> np.ndarray:
    """A float32 block matrix (L, in, out) as a view of the same values kept [out, in] (copied unless they are)."""
    return compact.from_rows(field, np.ascontiguousarray(compact.to_rows(field, a)))


def random_weights(config: GPT2Config, seed: int = 0, dtype: str = "float32") -> GPT2Weights:
    """Seeded random weights with GPT-2's shapes and its initialisation scales.

    Matrices ~ N(0, 0.02) (residual projections scaled by 1/sqrt(2 n_layer), as
    GPT-2 does); unlike a fresh GPT-2, biases and layernorm parameters are random
    too, so that a test can tell when one of them is dropped or misplaced.
    ``dtype`` stores the matrices compactly ("bfloat16", "int8", "int4") from those values.
    """
    if not isinstance(config, GPT2Config):
        raise ConfigError(f"random_weights needs a GPT2Config, got {type(config).__name__}")
    if not checks.is_integer(seed) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
    check_dtype(dtype, config)
    rng = np.random.default_rng(seed)
    cfg, L, C = config, config.n_layer, config.n_embd

    def normal(shape, std, mean=0.0):
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= np.float32(std)
        a += np.float32(mean)
        return a

    proj_std = 0.02 / np.sqrt(2 * L)
    return GPT2Weights(
        config=cfg,
        wte=normal((cfg.vocab_size, C), 0.02),
        wpe=normal((cfg.n_positions, C), 0.01),
        ln_1_g=normal((L, C), 0.1, 1.0),
        ln_1_b=normal((L, C), 0.02),
        c_attn_w=normal((L, C, 3 * C), 0.02),
        c_attn_b=normal((L, 3 * C), 0.02),
        attn_c_proj_w=normal((L, C, C), proj_std),
        attn_c_proj_b=normal((L, C), 0.02),
        ln_2_g=normal((L, C), 0.1, 1.0),
        ln_2_b=normal((L, C), 0.02),
        c_fc_w=normal((L, C, 4 * C), 0.02),
        c_fc_b=normal((L, 4 * C), 0.02),
        mlp_c_proj_w=normal((L, 4 * C, C), proj_std),
        mlp_c_proj_b=normal((L, C), 0.02),
        ln_f_g=normal((C,), 0.1, 1.0),
        ln_f_b=normal((C,), 0.02),
    ).astype(dtype)
