"""GPT-2 model sizes, and reading them from a checkpoint's config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError

HEAD_DIM = 64  # every released GPT-2 size has 64-wide heads


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """The hyperparameters that fix every array's shape."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_positions: int = 1024
    vocab_size: int = 50257
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}"
            )
        eps = self.layer_norm_epsilon
        if not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ConfigError(f"layer_norm_epsilon must be in (0, 1), got {eps!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def small(cls) -> GPT2Config:
        return cls(n_layer=12, n_head=12, n_embd=768)

    @classmethod
    def medium(cls) -> GPT2Config:
        return cls(n_layer=24, n_head=16, n_embd=1024)

    @classmethod
    def large(cls) -> GPT2Config:
        return cls(n_layer=36, n_head=20, n_embd=1280)

    @classmethod
    def xl(cls) -> GPT2Config:
        return cls(n_layer=48, n_head=25, n_embd=1600)

    @classmethod
    def from_json(cls, path: str | Path) -> GPT2Config:
        """Read a Hugging Face GPT-2 config.json.

        Raises CheckpointNotFoundError if the file is missing and CheckpointError
        if it is not JSON or lacks n_layer, n_head or n_embd.
        """
        if not Path(path).is_file():  # (the messages name ``path`` as given: Path would drop a leading ./)
            raise CheckpointNotFoundError(f"config file {str(path)!r} does not exist")
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{str(path)!r} is not a readable JSON file: {e}") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{str(path)!r} holds {type(raw).__name__}, not an object")
        missing = [k for k in ("n_layer", "n_head", "n_embd") if k not in raw]
        if missing:
            raise CheckpointError(f"{str(path)!r} lacks {', '.join(missing)}")
        fields = {k: raw[k] for k in ("n_layer", "n_head", "n_embd")}
        # Older configs call the context length n_ctx.
        fields["n_positions"] = raw.get("n_positions", raw.get("n_ctx", 1024))
        fields["vocab_size"] = raw.get("vocab_size", 50257)
        fields["layer_norm_epsilon"] = raw.get("layer_norm_epsilon", 1e-5)
        try:
            return cls(**fields)
        except ConfigError as e:
            raise CheckpointError(f"{str(path)!r}: {e}") from None
