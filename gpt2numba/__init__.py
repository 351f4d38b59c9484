"""GPT-2 inference on the CPU: Numba kernels over a preallocated key/value cache."""

import os as _os

# The environment as gpt2numba found it, before its dependencies' imports (threadpoolctl adds
# KMP_DUPLICATE_LIB_OK: docs/api.md, "What gpt2numba leaves as it found it"): the benchmark's peers start with it.
_ENVIRON_AT_IMPORT = dict(_os.environ)

from .errors import (
    BatchError,
    CacheError,
    CacheFullError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    GPT2NumbaError,
    GrammarError,
    PartialBatchError,
    SamplingError,
    TokenError,
    TokenTypeError,
)
from .model.config import GPT2Config
from .model.weights import GPT2Weights, random_weights
from .model.checkpoints import load_weights, save_weights
from .model.kvcache import KV_DTYPES, ModelCache
from .model.forward import (
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
from .model.oracle import recompute_all_logits, recompute_logits
from .text.tokenizer import Tokenizer, load_tokenizer
from .text.scoring import Score, perplexity, score, score_batch, score_text
from .decoding.sample import Sampler, generate, generate_batch, generate_text, generate_text_batch
from .decoding.beams import Hypothesis, beam_search, beam_search_batch
from .decoding.constraints import Constraint, constraint

__all__ = [
    "GPT2Config", "GPT2Weights", "ModelCache", "KV_DTYPES",
    "load_weights", "random_weights", "save_weights", "default_weights",
    "prefill", "decode_step", "prefill_batch", "decode_batch", "embed_token", "run_prefill", "recompute_logits", "recompute_all_logits",
    "generate", "generate_text", "beam_search", "beam_search_batch", "Hypothesis", "generate_batch", "generate_text_batch",
    "Score", "score", "score_batch", "score_text", "perplexity", "Sampler", "load_tokenizer", "Tokenizer", "set_threads", "get_threads",
    "GPT2NumbaError", "BatchError", "TokenError", "TokenTypeError", "CacheError", "CacheFullError",
    "ConfigError", "CheckpointError", "CheckpointNotFoundError", "SamplingError", "GrammarError",
    "PartialBatchError",
    "Constraint", "constraint",
]
__version__ = "0.1.0"

from .cpu import numbacache as _numbacache

_numbacache.guard(__name__)  # every kernel's cache files under a lock, for processes compiling at once
