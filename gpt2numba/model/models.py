"""Where weights come from: a checkpoint path, a Hugging Face hub name, $GPT2NUMBA_WEIGHTS, or the seeded
random default. The command line, the lm-eval and Ray adapters and the server all resolve a model here."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from ..errors import GPT2NumbaError
from .config import GPT2Config
from . import mapped
from .checkpoints import load_weights
from .weights import GPT2Weights, check_dtype

RANDOM_NOTE = "random GPT-2 small weights (seed 0): the text is meaningless; pass --model for a real checkpoint"
RANDOM_NAME = "random-gpt2-small"  # the server's model id for them, unless --model-name says otherwise
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # the hub's "name" or "owner/name"


def resolve_model(model: str | None, dtype: str = "float32", activations: str = "float32"):
    """(weights, checkpoint path or None, description) for a --model value.

    model: a checkpoint directory, a .safetensors or .gguf file, a hub name such as gpt2 or openai-community/gpt2
    (fetched with the [hub] extra), or None: $GPT2NUMBA_WEIGHTS, else seeded random GPT-2 small (path None).
    is_hub_name says which a name is. dtype: how the matrices are kept (compact.DTYPES); activations: how
    their products take their inputs (compact.ACTIVATIONS). Raises
    GPT2NumbaError (a checkpoint error, a missing path, or a hub name that cannot be fetched).
    """
    check_dtype(dtype, activations=activations)  # before anything is built or read
    if model is None:
        env = os.environ.get("GPT2NUMBA_WEIGHTS") or None
        try:
            w = default_weights()
        except GPT2NumbaError as e:  # (said where the path came from: the variable, not a flag)
            raise type(e)(f"$GPT2NUMBA_WEIGHTS={env!r}: {e}") from None
        return w.astype(dtype, activations), env, env or "random GPT-2 small weights (seed 0)"
    path = _download(model) if is_hub_name(model) else model  # (a path as given: an error names it so)
    return load_weights(path, dtype=dtype, activations=activations), path, str(model)


def is_hub_name(model: str) -> bool:
    """Whether ``model`` names a Hugging Face hub repository rather than a local checkpoint, as the hub reads
    names: a file or folder of that name here wins; else "name" or "owner/name" in the hub's characters is a
    hub name, unless a folder "owner" exists here (then "owner/name" is a local path that is missing)."""
    if Path(model).exists() or not _HUB_ID.fullmatch(model) or model.endswith((".safetensors", ".gguf")):
        return False
    owner, _, name = model.rpartition("/")
    return not owner or not Path(owner).is_dir()


def default_weights() -> GPT2Weights:
    """The checkpoint named by $GPT2NUMBA_WEIGHTS, else seeded random GPT-2 small."""
    return _default_weights(os.environ.get("GPT2NUMBA_WEIGHTS") or None)


@functools.lru_cache(maxsize=1)
def _default_weights(path: str | None) -> GPT2Weights:
    return load_weights(path) if path else mapped.random_copy(GPT2Config.small(), seed=0)  # (drawn once a machine)


def _download(name: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise GPT2NumbaError(f"no file or folder {name!r} here, and fetching it from the Hugging Face hub needs "
                             "huggingface_hub: pip install -e \".[hub]\"") from None
    try:
        return Path(snapshot_download(name, allow_patterns=[
            "config.json", "model.safetensors", "tokenizer.json", "vocab.json", "merges.txt"]))
    except Exception as e:  # the hub's errors are many; all mean "not available here"
        raise GPT2NumbaError(f"no file or folder {name!r} here, and the Hugging Face hub gave no checkpoint of "
                             f"that name: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
