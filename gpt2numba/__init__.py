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
# Everything else is imported on first use (PEP 562), so that `import gpt2numba` costs neither Numba nor NumPy:
# a command, a server's worker or a notebook pays for what it calls (docs/performance-history.md, "Start").
_LAZY = {
    ".model.config": ("GPT2Config",),
    ".model.weights": ("GPT2Weights", "random_weights"),
    ".model.checkpoints": ("load_weights", "save_weights"),
    ".model.kvcache": ("KV_DTYPES", "ModelCache"),
    ".model.forward": ("decode_batch", "decode_step", "default_weights", "embed_token", "get_threads", "prefill",
                       "prefill_batch", "run_prefill", "set_threads"),
    ".model.oracle": ("recompute_all_logits", "recompute_logits"),
    ".text.tokenizer": ("Tokenizer", "load_tokenizer"),
    ".text.scoring": ("Score", "perplexity", "score", "score_batch", "score_text"),
    ".decoding.sample": ("Sampler", "generate", "generate_batch", "generate_text", "generate_text_batch"),
    ".decoding.beams": ("Hypothesis", "beam_search", "beam_search_batch"),
    ".decoding.constraints": ("Constraint", "constraint"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}
_ROOMS = ("cpu", "model", "text", "decoding")  # gpt2numba.cpu and the like, found as once imported with the package


def __getattr__(name: str):
    import importlib

    if name in _MODULE_OF:
        value = getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
    elif name in _ROOMS:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # (once: the next lookup finds it without calling here)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
