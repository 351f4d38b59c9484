"""GPT-2 inference on the CPU: Numba kernels over a preallocated key/value cache."""

from .config import GPT2Config
from .errors import (
    CacheFullError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    GPT2NumbaError,
    TokenError,
    TokenTypeError,
)
from .kvcache import ModelCache, decode_step, default_weights, embed_token, prefill, run_prefill
from .oracle import recompute_logits
from .weights import GPT2Weights, load_weights, random_weights, save_weights

__all__ = [
    "GPT2Config", "GPT2Weights", "ModelCache",
    "load_weights", "random_weights", "save_weights", "default_weights",
    "prefill", "decode_step", "embed_token", "run_prefill", "recompute_logits",
    "GPT2NumbaError", "TokenError", "TokenTypeError", "CacheFullError",
    "ConfigError", "CheckpointError", "CheckpointNotFoundError",
]
__version__ = "0.1.0"
