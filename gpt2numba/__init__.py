"""GPT-2 inference on the CPU: Numba kernels over a preallocated key/value cache."""

import os as _os

# The environment as gpt2numba found it, before its dependencies' imports (threadpoolctl adds
# KMP_DUPLICATE_LIB_OK: docs/api.md, "What gpt2numba leaves as it found it"): the benchmark's peers start with it.
_ENVIRON_AT_IMPORT = dict(_os.environ)

from .beams import Hypothesis, beam_search, beam_search_batch
from .config import GPT2Config
from .errors import (
    BatchError,
    CacheError,
    CacheFullError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    GPT2NumbaError,
    SamplingError,
    TokenError,
    TokenTypeError,
)
from .forward import (
    decode_batch,
    decode_step,
    default_weights,
    embed_token,
    get_threads,
    prefill,
    prefill_batch,
    run_prefill,
    set_threads,
)
from .kvcache import KV_DTYPES, ModelCache
from .oracle import recompute_all_logits, recompute_logits
from .scoring import Score, perplexity, score, score_batch, score_text
from .sample import Sampler, generate, generate_batch, generate_text, generate_text_batch
from .tokenizer import Tokenizer, load_tokenizer
from .weights import GPT2Weights, load_weights, random_weights, save_weights

__all__ = [
    "GPT2Config", "GPT2Weights", "ModelCache", "KV_DTYPES",
    "load_weights", "random_weights", "save_weights", "default_weights",
    "prefill", "decode_step", "prefill_batch", "decode_batch", "embed_token", "run_prefill", "recompute_logits", "recompute_all_logits",
    "generate", "generate_text", "beam_search", "beam_search_batch", "Hypothesis", "generate_batch", "generate_text_batch",
    "Score", "score", "score_batch", "score_text", "perplexity", "Sampler", "load_tokenizer", "Tokenizer", "set_threads", "get_threads",
    "GPT2NumbaError", "BatchError", "TokenError", "TokenTypeError", "CacheError", "CacheFullError",
    "ConfigError", "CheckpointError", "CheckpointNotFoundError", "SamplingError",
]
__version__ = "0.1.0"
