"""Where weights come from: a checkpoint path, a Hugging Face hub name, $GPT2NUMBA_WEIGHTS, or the seeded
random default. The command line, the lm-eval and Ray adapters and the server all resolve a model here."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .config import GPT2Config
from .errors import GPT2NumbaError
from .weights import GPT2Weights, load_weights, random_weights


def resolve_model(model: str | None, dtype: str = "float32"):
    """(weights, checkpoint path or None, description) for a --model value.

    model: a checkpoint directory, a .safetensors file, a hub name such as openai-community/gpt2 (fetched
    with the [hub] extra), or None: $GPT2NUMBA_WEIGHTS, else seeded random GPT-2 small. dtype: how the
    matrices are kept (compact.DTYPES). Raises GPT2NumbaError (a checkpoint error, or a hub name that
    cannot be fetched).
    """
    if model is None:
        env = os.environ.get("GPT2NUMBA_WEIGHTS")
        return default_weights().astype(dtype), env, env or "random GPT-2 small weights (seed 0)"
    path = Path(model)
    if not path.exists() and model.count("/") == 1 and not model.startswith((".", "/")):
        path = _download(model)
    return load_weights(path, dtype=dtype), path, str(model)


def default_weights() -> GPT2Weights:
    """The checkpoint named by $GPT2NUMBA_WEIGHTS, else seeded random GPT-2 small."""
    return _default_weights(os.environ.get("GPT2NUMBA_WEIGHTS") or None)


@functools.lru_cache(maxsize=1)
def _default_weights(path: str | None) -> GPT2Weights:
    return load_weights(path) if path else random_weights(GPT2Config.small(), seed=0)


def _download(name: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise GPT2NumbaError(f"{name!r} is not a local path; fetching it from the Hugging Face hub needs "
                             "huggingface_hub: pip install 'gpt2numba[hub]'") from None
    try:
        return Path(snapshot_download(name, allow_patterns=[
            "config.json", "model.safetensors", "tokenizer.json", "vocab.json", "merges.txt"]))
    except Exception as e:  # the hub's errors are many; all mean "not available here"
        raise GPT2NumbaError(f"cannot fetch {name!r} from the Hugging Face hub: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
