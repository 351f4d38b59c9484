"""GGUF files: ours (for llama.cpp in the benchmark) read back with the gguf package's reader, and any of
llama.cpp's GPT-2 files read by load_weights and load_tokenizer (model/from_gguf.py); llama.cpp's own
converter's files in tests/test_gguf_llama.py."""

import dataclasses
import hashlib
import json
import os
import warnings

import numpy as np
import pytest

import gpt2numba as g
from conftest import TINY_GPT2
from gpt2numba.errors import CheckpointError
from gpt2numba.model.from_gguf import GGUFWarning
from gpt2numba.model.mapped import is_mapped
from helpers import assert_matches_oracle

gguf = pytest.importorskip("gguf", reason="the GGUF writer needs the gguf package (the test and peers extras)")

CONFIG = TINY_GPT2


@pytest.fixture(scope="module")
def weights():
    return g.random_weights(CONFIG, seed=1)


@pytest.mark.parametrize("fmt, atol", [("F32", 0), ("F16", 1e-3), ("Q8_0", 2e-3)])
def test_tensors_read_back_as_the_weights(weights, tmp_path, fmt, atol):
    from gpt2numba.integrations.gguf_export import write_gguf

    reader = gguf.GGUFReader(write_gguf(weights, tmp_path / f"m-{fmt}.gguf", fmt))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 4 + 12 * CONFIG.n_layer

    def values(name):  # [out, in] as llama.cpp holds it
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))

    np.testing.assert_allclose(values("token_embd.weight"), weights.wte, atol=atol)
    np.testing.assert_array_equal(values("position_embd.weight"), weights.wpe)  # float32 in every format
    np.testing.assert_allclose(values("blk.1.attn_qkv.weight"), weights.c_attn_w[1].T, atol=atol)  # transposed
    np.testing.assert_allclose(values("blk.0.ffn_down.weight"), weights.mlp_c_proj_w[0].T, atol=atol)
    np.testing.assert_array_equal(values("blk.1.ffn_up.bias"), weights.c_fc_b[1])
    fields = reader.fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "gpt2"
    assert int(fields["gpt2.block_count"].parts[-1][0]) == CONFIG.n_layer
    assert len(fields["tokenizer.ggml.tokens"].data) == CONFIG.vocab_size


def test_compact_weights_export_the_values_they_stand_for(weights, tmp_path):
    from gpt2numba.integrations.gguf_export import write_gguf

    w8 = weights.astype("int8")
    reader = gguf.GGUFReader(write_gguf(w8, tmp_path / "m.gguf", "F32"))
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_output.weight")
    np.testing.assert_array_equal(t.data.reshape(CONFIG.n_embd, CONFIG.n_embd), w8.dequantized().attn_c_proj_w[0].T)


def test_a_vocabulary_other_than_gpt2s_is_refused(tmp_path):
    from gpt2numba.integrations.gguf_export import write_gguf

    with pytest.raises(ValueError, match="GPT-2's vocabulary"):
        write_gguf(g.random_weights(g.GPT2Config(n_layer=1, n_head=2, n_embd=64, n_positions=16, vocab_size=512)),
                   tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="fmt must be one of"):
        write_gguf(g.random_weights(CONFIG), tmp_path / "m.gguf", "Q5_K")


# load_weights and load_tokenizer of a GGUF

IDS = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
MATRICES = (("token_embd.weight", "wte", None), ("blk.1.attn_qkv.weight", "c_attn_w", 1),
            ("blk.0.attn_output.weight", "attn_c_proj_w", 0), ("blk.1.ffn_up.weight", "c_fc_w", 1),
            ("blk.0.ffn_down.weight", "mlp_c_proj_w", 0))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gpt2numba"


@pytest.fixture(scope="module")
def files(weights, tmp_path_factory):
    """Our export of ``weights`` in each format (Q4_0 by the gguf package: its embedding in Q8_0)."""
    from gpt2numba.integrations.gguf_export import write_gguf

    folder = tmp_path_factory.mktemp("gguf")
    return {fmt: write_gguf(weights, folder / f"m-{fmt}.gguf", fmt, quantizer="gguf")
            for fmt in ("F32", "F16", "Q8_0", "Q4_0")}


def file_values(path):
    """Every tensor's values [out, in] as the file holds them, by name."""
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in gguf.GGUFReader(path).tensors}


def loaded(path, dtype, mapped=True):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a format that holds the file exactly says nothing)
        return g.load_weights(path, dtype=dtype, mapped=mapped)


@pytest.mark.parametrize("fmt, dtype", [("F32", "float32"), ("F16", "float32"), ("Q8_0", "float32"),
                                        ("Q8_0", "int8"), ("Q4_0", "int4"), ("Q4_0", "float32")])
def test_a_gguf_loads_as_the_values_it_holds(weights, files, cache, fmt, dtype):
    w = loaded(files[fmt], dtype)
    assert w.dtype == dtype and w.config == CONFIG and is_mapped(w)
    values = file_values(files[fmt])
    for name, field, layer in MATRICES:  # the file's values, to the bit, each in its place ([in, out] for ours)
        got = w.matrix(field) if layer is None else w.matrix(field)[layer].T
        np.testing.assert_array_equal(got, values[name], err_msg=name)
    np.testing.assert_array_equal(w.wpe, values["position_embd.weight"])
    np.testing.assert_array_equal(w.ln_2_b[1], values["blk.1.ffn_norm.bias"])
    np.testing.assert_array_equal(w.ln_f_g, values["output_norm.weight"])
    logits = g.prefill(IDS, w, g.ModelCache(w.config, max_len=16))
    assert_matches_oracle(logits, IDS, w.dequantized() if dtype == "float32" else w, f"GGUF {fmt} as {dtype}")


def test_an_f32_gguf_loads_as_the_weights_it_was_written_from(weights, files, cache):
    w = loaded(files["F32"], "float32", mapped=False)
    for field in ("wte", "wpe", "c_attn_w", "attn_c_proj_w", "c_fc_w", "mlp_c_proj_w", "ln_1_g", "c_fc_b", "ln_f_b"):
        np.testing.assert_array_equal(getattr(w, field), getattr(weights, field), err_msg=field)
        assert getattr(w, field).strides == getattr(weights, field).strides, field
    mc1, mc2 = g.ModelCache(CONFIG, max_len=16), g.ModelCache(CONFIG, max_len=16)
    np.testing.assert_array_equal(g.prefill(IDS, w, mc1), g.prefill(IDS, weights, mc2))


def test_a_gguf_is_converted_once_then_mapped(files, cache, monkeypatch):
    first = loaded(files["Q8_0"], "int8")
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("the file was parsed again"))
    again = loaded(files["Q8_0"], "int8")
    assert is_mapped(again)
    for field in ("wte", "c_fc_w", "ln_1_g"):
        np.testing.assert_array_equal(getattr(again, field), getattr(first, field))
        np.testing.assert_array_equal(again.scales["c_fc_w"], first.scales["c_fc_w"])


def test_a_format_that_cannot_hold_the_file_rounds_again_and_says_so(files, cache):
    with pytest.warns(GGUFWarning, match=r"int4 cannot hold blk\.0\.attn_qkv\.weight \(Q8_0\).* and 5 more"):
        w = g.load_weights(files["Q8_0"], dtype="int4", mapped=False)
    values = file_values(files["Q8_0"])
    np.testing.assert_array_equal(w.matrix("wte"), values["token_embd.weight"])  # int4's wte is int8: as stored
    assert not np.array_equal(w.matrix("c_fc_w")[1].T, values["blk.1.ffn_up.weight"])
    with pytest.warns(GGUFWarning, match="bfloat16 cannot hold token_embd.weight \\(F16\\)"):
        g.load_weights(files["F16"], dtype="bfloat16", mapped=False)
    loaded(files["F32"], "int8", mapped=False)  # (rounding float32 as asked, as from any float32 checkpoint: silent)


def _rewritten(weights, path, monkeypatch, *, drop=(), change=None, arch=None):
    """Our F32 export of ``weights`` with tensors dropped or changed (name -> function of its values) and
    another architecture named."""
    from gpt2numba.integrations.gguf_export import write_gguf

    with monkeypatch.context() as m:
        add = gguf.GGUFWriter.add_tensor

        def add_tensor(self, name, a, *args, **kwargs):
            if name in drop:
                return None
            return add(self, name, change[name](a) if change and name in change else a, *args, **kwargs)

        m.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
        if arch:
            m.setattr(gguf.GGUFWriter, "add_architecture", lambda self: self.add_string("general.architecture", arch))
        return write_gguf(weights, path)


@pytest.mark.parametrize("edit, message", [
    (dict(arch="llama"), "holds a 'llama' model; gpt2numba runs GPT-2"),
    (dict(drop=["blk.1.ffn_up.bias"]), "lacks tensor 'blk.1.ffn_up.bias'"),
    (dict(change={"blk.0.attn_output.weight": lambda a: a[:, :64]}), "'blk.0.attn_output.weight' has shape"),
    (dict(change={"blk.1.attn_norm.bias": lambda a: np.where(np.arange(a.size) == 3, np.nan, a)}), "non-finite"),
    (dict(change={"output_norm.bias": lambda a: a}, drop=[]), None),
])
def test_a_gguf_that_is_not_gpt2s_is_refused_and_nothing_kept(weights, tmp_path, cache, monkeypatch, edit, message):
    path = _rewritten(weights, tmp_path / "m.gguf", monkeypatch, **edit)
    if message is None:  # (the helper itself leaves a file that loads)
        assert loaded(path, "float32").config == CONFIG
        return
    with pytest.raises(CheckpointError, match=message):
        g.load_weights(path)
    assert not list((cache / "weights").glob("*.safetensors")) if (cache / "weights").exists() else True


def _with_extra(weights, path, monkeypatch, extra):
    """Our F32 export of ``weights`` with a tensor added after token_embd: name -> (function of token_embd's values,
    the GGUF type to write it in)."""
    from gpt2numba.integrations.gguf_export import write_gguf

    (name, (values_of, kind)), = extra.items()
    with monkeypatch.context() as m:
        add = gguf.GGUFWriter.add_tensor

        def add_tensor(self, tensor, a, *args, **kwargs):
            add(self, tensor, a, *args, **kwargs)
            if tensor == "token_embd.weight":
                qtype = getattr(gguf.GGMLQuantizationType, kind)
                b = values_of(a)
                add(self, name, b if kind == "F32" else gguf.quants.quantize(b, qtype), raw_dtype=qtype)

        m.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
        return write_gguf(weights, path)


def test_a_tied_head_loads_and_an_untied_one_is_refused(weights, tmp_path, cache, monkeypatch):
    tied = _with_extra(weights, tmp_path / "tied.gguf", monkeypatch, {"output.weight": (np.copy, "F32")})
    assert loaded(tied, "float32", mapped=False).config == CONFIG
    untied = _with_extra(weights, tmp_path / "untied.gguf", monkeypatch, {"output.weight": (lambda a: a * 2, "F32")})
    with pytest.raises(CheckpointError, match="output.weight that differs from token_embd.weight"):
        g.load_weights(untied)
    # llama.cpp's quantiser gives a head of its own another type: the same matrix rounded apart, set aside
    apart = _with_extra(weights, tmp_path / "apart.gguf", monkeypatch, {"output.weight": (np.copy, "Q8_0")})
    with pytest.warns(GGUFWarning, match=r"output.weight \(Q8_0\) is token_embd.weight \(F32\) rounded apart"):
        w = g.load_weights(apart, mapped=False)
    np.testing.assert_array_equal(w.wte, weights.wte)
    def noisy(by):  # the embedding plus noise whose root mean square is ``by`` of its own (llama.cpp's Q2_K: 0.3)
        return lambda a: a + by * np.sqrt(np.mean(np.square(a))) * np.random.default_rng(0).standard_normal(
            a.shape, dtype=np.float32)

    coarse = _with_extra(weights, tmp_path / "coarse.gguf", monkeypatch, {"output.weight": (noisy(0.35), "Q8_0")})
    with pytest.warns(GGUFWarning, match="rounded apart"):
        g.load_weights(coarse, mapped=False)
    for name, values_of in (("far", noisy(0.6)), ("drawn", lambda a: np.random.default_rng(0).permutation(a))):
        apart = _with_extra(weights, tmp_path / f"{name}.gguf", monkeypatch, {"output.weight": (values_of, "Q8_0")})
        with pytest.raises(CheckpointError, match="output.weight that differs"):
            g.load_weights(apart)


@pytest.mark.parametrize("extra, message", [
    ({"blk.0.extra.weight": (np.copy, "F32")}, "unexpected tensor 'blk.0.extra.weight'; is this GPT-2?"),
])
def test_an_extra_tensor_is_refused(weights, tmp_path, cache, monkeypatch, extra, message):
    with pytest.raises(CheckpointError, match=message):
        g.load_weights(_with_extra(weights, tmp_path / "m.gguf", monkeypatch, extra))


def test_a_cut_or_foreign_file_is_refused(weights, files, tmp_path, cache, monkeypatch):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["F32"].read_bytes()[: os.path.getsize(files["F32"]) // 2])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        g.load_weights(cut)
    flat = _rewritten(weights, tmp_path / "flat.gguf", monkeypatch, change={"token_embd.weight": np.ravel})
    with pytest.raises(CheckpointError, match="no tensor 'token_embd.weight' of two axes"):
        g.load_weights(flat)
    wide = _rewritten(weights, tmp_path / "wide.gguf", monkeypatch,
                      change={"blk.0.ffn_norm.weight": lambda a: a.astype(np.float64)})
    with pytest.raises(CheckpointError, match="'blk.0.ffn_norm.weight' is of type F64, which gpt2numba cannot read"):
        g.load_weights(wide)
    assert not (cache / "weights").exists() or not list((cache / "weights").glob("*.safetensors"))


def test_the_tokenizer_is_the_files_own(files, weights, tmp_path, cache, monkeypatch):
    from gpt2numba.integrations import gguf_export
    from gpt2numba.text.tokenizer import EOT, gpt2_vocabulary_files

    text = "Hello, world! It's GPT-2's own <|endoftext|> tokenizer: 12345 ünïcødé"
    assert g.load_tokenizer(files["F32"]).encode(text) == g.load_tokenizer().encode(text)
    # A vocabulary of GPT-2's 256 bytes, one merge ("h" "e" -> "he") and <|endoftext|>: only the file has it
    encoder = json.loads(gpt2_vocabulary_files()[0].read_text(encoding="utf-8"))
    tokens = [t for t, i in sorted(encoder.items(), key=lambda item: item[1]) if i < 256] + ["he", EOT]

    def vocabulary(writer, gguf, vocab_size):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_merges(["h e"])

    monkeypatch.setattr(gguf_export, "_vocabulary", vocabulary)
    small = dataclasses.replace(CONFIG, vocab_size=len(tokens))
    path = gguf_export.write_gguf(g.random_weights(small, seed=2), tmp_path / "small.gguf")
    tok = g.load_tokenizer(path)
    assert tok.encode("hehe") == [256, 256] and tok.encode(EOT) == [257]
    assert tok.decode([256, *tok.encode("h")]) == "heh"
    with monkeypatch.context() as m:
        m.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("the file was parsed again"))
        assert g.load_tokenizer(path).encode("hehe") == [256, 256]  # (from the cache)
    place = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:16]
    kept, = (cache / "tokenizers").glob(f"gguf-{place}-*")
    # Altered copies, a BPE of their own that would make "hehe" one token (257): made again
    altered_vocab = {t: i for i, t in enumerate(tokens[:256] + ["he", "hehe", EOT])}
    for digests in (None, "{}", "[]", '{"encoder.json": "0"}'):
        (kept / "vocab.json").write_text(json.dumps(altered_vocab), encoding="utf-8")
        (kept / "merges.txt").write_text("#version: 0.2\nh e\nhe he\n", encoding="utf-8")
        if digests is not None:
            (kept / "sha256.json").write_text(digests)
        assert g.load_tokenizer(path).encode("hehe") == [256, 256], digests
        assert (kept / "merges.txt").read_text(encoding="utf-8").splitlines()[1:] == ["h e"]
    os.utime(path, ns=(1, 1))  # a new state: a new copy, the old one removed
    g.load_tokenizer(path)
    now, = (cache / "tokenizers").glob(f"gguf-{place}-*")
    assert now != kept


@pytest.mark.parametrize("key, value, message", [("model", "llama", "carries a 'llama' tokenizer"),
                                                 ("pre", "qwen2", "splits text as 'qwen2'")])
def test_a_tokenizer_other_than_gpt2s_kind_is_refused(weights, tmp_path, cache, monkeypatch, key, value, message):
    from gpt2numba.integrations import gguf_export

    setter = f"add_tokenizer_{key}"
    original = getattr(gguf.GGUFWriter, setter)
    monkeypatch.setattr(gguf.GGUFWriter, setter, lambda self, v: original(self, value))
    path = gguf_export.write_gguf(weights, tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match=message):
        g.load_tokenizer(path)


def test_a_q8_0_value_outside_int8s_range_is_rounded_again(files, tmp_path, cache):
    """ggml's quantiser never writes -128, but a file may hold it: int8 ([-127, 127]) cannot."""
    data = bytearray(files["Q8_0"].read_bytes())
    t = next(t for t in gguf.GGUFReader(files["Q8_0"]).tensors if t.name == "blk.1.ffn_down.weight")
    data[t.data_offset + 2 + 5] = 0x80  # the first block's sixth value, after its float16 scale
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(data))
    with pytest.warns(GGUFWarning, match=r"int8 cannot hold blk\.1\.ffn_down\.weight \(Q8_0\) as"):
        w = g.load_weights(path, dtype="int8", mapped=False)
    assert (w.mlp_c_proj_w[1] >= -127).all()
    values = file_values(path)
    np.testing.assert_array_equal(w.matrix("c_fc_w")[1].T, values["blk.1.ffn_up.weight"])  # the rest as stored
    np.testing.assert_array_equal(loaded(path, "float32", mapped=False).matrix("mlp_c_proj_w")[1].T,
                                  values["blk.1.ffn_down.weight"])


@pytest.mark.parametrize("patch, message", [
    ("big-endian", "reads little-endian GGUF files"),
    ("per-layer heads", "'gpt2.attention.head_count' is an array"),
])
def test_a_file_gpt2numba_cannot_read_as_written_is_refused(weights, tmp_path, cache, monkeypatch, patch, message):
    from gpt2numba.integrations.gguf_export import write_gguf

    with monkeypatch.context() as m:
        if patch == "big-endian":
            init = gguf.GGUFWriter.__init__
            m.setattr(gguf.GGUFWriter, "__init__", lambda self, path, arch, **kw: init(
                self, path, arch, endianess=gguf.GGUFEndian.BIG, **kw))
        else:
            add = gguf.GGUFWriter.add_head_count
            m.setattr(gguf.GGUFWriter, "add_head_count", lambda self, n: add(self, [n] * CONFIG.n_layer))
        path = write_gguf(weights, tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match=message):
        g.load_weights(path)
