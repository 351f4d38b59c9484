"""Every setting of the server and its default, in one place: ServeConfig.

`gpt2numba serve` makes its flags from it (cli/options.py: each field's Flag, in its --help's order); create_app,
Engine and server.run take one (or its fields as keywords); admission.py reads its limits from it,
connections.GuardedH11 its deadlines, and serve.ray.deployment checks a replica's settings against it.
vLLM's EngineArgs feeds argparse and the engine the same way. No web framework here: the engine imports it.
"""

from __future__ import annotations

import dataclasses

from ..decoding import speculative
from ..errors import ConfigError
from ..model.kvcache import check_kv_dtype

__all__ = ["CONNECTION_SETTINGS", "Flag", "ServeConfig", "flags"]


@dataclasses.dataclass(frozen=True)
class Flag:
    """How `gpt2numba serve` takes a setting: --its-name, ``help`` (argparse fills in %(default)s), a metavar,
    and its values: integers from ``at_least`` (to ``at_most``), numbers above 0 (``positive``), or any text."""

    help: str
    metavar: str | None = None
    at_least: int | None = None
    positive: bool = False
    at_most: int | None = None


def _setting(default, flag: Flag | None = None, *, connection: bool = False):
    """A field of ServeConfig. flag: None for a setting the serve command has no flag of its own for;
    connection: uvicorn's (server.run's), which Ray Serve's proxy owns on a cluster."""
    return dataclasses.field(default=default, metadata={"flag": flag, "connection": connection})


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The server's settings, in the order of `gpt2numba serve --help`. Checked when made: ConfigError naming
    the setting (the ranges of the flags themselves are checked by the command line and serve.ray)."""

    host: str = _setting("127.0.0.1", Flag("address to bind (default %(default)s: this machine only)"),
                         connection=True)
    port: int = _setting(8000, Flag("default %(default)s", at_least=0, at_most=65535),
                         connection=True)
    max_batch: int = _setting(16, Flag("sequences in flight at once (default %(default)s)", "N", at_least=1))
    # Prompt rows a step feeds beside its decode rows (chunked prefill): the streams in flight take a token at
    # each step while a long prompt is prefilled. 16 keeps their slowest gaps near 2.2-2.4x a plain step's;
    # more rows give the long prompt its first token sooner (docs/serving.md, "In chunks", has the table).
    max_step_tokens: int = _setting(16, Flag(
        "prompt tokens a step prefills beside the decode rows: a long prompt runs in chunks so the streams in "
        "flight keep their pace (default %(default)s)", "N", at_least=1))
    # Memory for the keys and values of recent prompts' blocks (prefixes.py): 256 MB holds 3,400 prompt tokens
    # of GPT-2 small, 1,300 of GPT-2 medium. 0 turns the prefix cache off.
    prefix_cache_mb: float = _setting(256, Flag(
        "memory for recent prompts' keys and values: a prompt that begins as one before prefills only the rest; "
        "0 turns it off (default %(default)s)", "MB", at_least=0))
    # Memory for the keys and values the sequences in flight write (those they read in place, a prefix cache's
    # blocks or a shared prompt's rows, cost nothing more): a choice that would pass it waits for others to
    # leave. 0: bounded by max_batch alone (each sequence owns up to n_positions positions).
    kv_cache_mb: float = _setting(0, Flag(
        "memory for the keys and values the sequences in flight write; a choice that would pass it waits in the "
        "queue; 0: no bound but --max-batch (default %(default)s)", "MB", at_least=0))
    max_queue: int = _setting(64, Flag("requests waiting beyond those; more get 503 (default %(default)s)", "N",
                                       at_least=1))
    max_queued_choices: int = _setting(1024, Flag(
        "choices (prompts x n) waiting, over every request; more get 503 (default %(default)s)", "N", at_least=1))
    max_choices: int = _setting(256, Flag(
        "choices in one request, prompts x n; more get 400 (default %(default)s)", "N", at_least=1))
    max_response_mb: float = _setting(64, Flag(
        "the largest response a request may ask for, estimated from its choices, tokens and log-probabilities; "
        "larger get 400 (default %(default)s)", "MB", positive=True))  # (admission.response_bytes)
    # A structured-output field's grammar (a JSON schema, regex, choice or grammar: decoding/constraints.py):
    # larger get 400, and so do those whose compiling takes longer (llguidance compiles a 20-field schema in
    # about a millisecond; compiled ones are cached by their text)
    max_grammar_bytes: int = _setting(2**16, Flag(
        "the largest JSON schema, regex, choice list or grammar a request may give; larger get 400 (default "
        "%(default)s)", "BYTES", at_least=1))
    max_grammar_seconds: float = _setting(2.0, Flag(
        "the longest a request's grammar may take to compile; longer get 400 (default %(default)s)", "SECONDS",
        positive=True))
    # Speculative decoding (decoding/speculative.py): each sequence without a constraint drafts tokens that the
    # step checks in its pass; the same tokens greedy, the same distribution sampled
    draft: str | None = _setting(None, Flag(
        "speculative decoding: int4, int8 or bfloat16 (the model's own weights in that format, its keys and values "
        "as many again) or a checkpoint of a GPT-2 with the same vocabulary (default: none)", "DRAFT"))
    num_speculative_tokens: int | None = _setting(None, Flag(
        "with --draft: tokens drafted a step (default: adapted to how many are kept)", "N", at_least=1, at_most=64))
    prompt_lookup: int | None = _setting(None, Flag(
        "speculative decoding by prompt lookup: draft N tokens copied from what followed the last words where they "
        "occurred before (default: none)", "N", at_least=1, at_most=64))
    max_connections: int = _setting(1024, Flag(
        "open connections; one more closes the one idle longest (default %(default)s)", "N", at_least=1),
        connection=True)
    header_timeout: float = _setting(10, Flag(
        "for a request's headers to arrive, else the connection is closed (default %(default)s)", "SECONDS",
        positive=True), connection=True)
    body_timeout: float = _setting(30, Flag(
        "for a request's body to arrive after its headers (default %(default)s)", "SECONDS", positive=True),
        connection=True)
    keep_alive_timeout: float = _setting(5, Flag(
        "an idle connection is closed after this (default %(default)s)", "SECONDS", positive=True), connection=True)
    # None: no authentication. The command line also reads it from --api-key-file or $GPT2NUMBA_API_KEY.
    api_key: str | None = _setting(None, Flag(
        "require Authorization: Bearer KEY (default: $GPT2NUMBA_API_KEY, else none)", "KEY"))
    # The id in /v1/models; None: the checkpoint's name (ServeConfig.named)
    model_name: str | None = _setting(None, Flag("the id in /v1/models (default: the checkpoint's name)", "NAME"))
    shutdown_grace: float = _setting(5, Flag(
        "on Ctrl-C or SIGTERM, how long requests in flight may take to finish (default %(default)s)", "SECONDS",
        at_least=0), connection=True)
    max_body_bytes: int = 2**20  # a request's body; larger get 400
    kv_dtype: str = "float32"  # every sequence's cache (kvcache.KV_DTYPES): the flag is --kv-dtype, every command's

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty: give a key, or none for no authentication")
        if self.max_choices > self.max_queued_choices:  # such a request could never be queued
            raise ConfigError(f"max_choices ({self.max_choices}) must be at most max_queued_choices "
                              f"({self.max_queued_choices})")
        if self.max_step_tokens < 1:
            raise ConfigError(f"max_step_tokens must be at least 1, got {self.max_step_tokens}")
        for name in ("prefix_cache_mb", "kv_cache_mb"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be at least 0, got {getattr(self, name)}")
        check_kv_dtype(self.kv_dtype)
        speculative.check(self.draft, self.num_speculative_tokens, self.prompt_lookup)

    def named(self, model: str | None) -> ServeConfig:
        """This config with model_name, if not given, from the model as models.resolve_model takes it: a
        checkpoint's folder or file name (without .safetensors), a hub name's last part; gpt2 for None."""
        if self.model_name is not None:
            return self
        name = model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".safetensors") if model else "gpt2"
        return dataclasses.replace(self, model_name=name)

    @classmethod
    def made(cls, config: ServeConfig | None, settings: dict) -> ServeConfig:
        """``config`` (the defaults for None) with ``settings`` (field name -> value) over it: how create_app,
        Engine and server.run take either a config or keywords. TypeError for a name that is no setting."""
        return dataclasses.replace(config or cls(), **settings)


CONNECTION_SETTINGS = tuple(f.name for f in dataclasses.fields(ServeConfig) if f.metadata.get("connection"))


def flags() -> list[tuple[str, object, Flag]]:
    """(setting, default, Flag) of each setting the serve command has a flag for, in its --help's order."""
    return [(f.name, f.default, f.metadata["flag"]) for f in dataclasses.fields(ServeConfig)
            if f.metadata.get("flag") is not None]
