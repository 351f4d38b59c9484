"""Weights mapped, not read (model/mapped.py): a checkpoint's stacked copy in the user's cache, and stacked files.

Every mapped load is held to the loader reading into memory, bit for bit and layout for layout; a copy that is
stale, cut short or altered is made again, never served; a cache that cannot be written leaves the weights
in memory, with a warning.
"""

import dataclasses
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import gpt2numba as g
from checkpoints import write_dir, write_file
from conftest import TINY
from gpt2numba.errors import CheckpointError
from gpt2numba.model import checkpoints, compact, mapped
from gpt2numba.model.mapped import is_mapped

FORMATS = ["float32", "bfloat16", "int8", "int4"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The user's cache of this test alone: its folder of mapped copies."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gpt2numba" / "weights"


@pytest.fixture(scope="module")
def tiny():
    return g.random_weights(TINY, seed=11)


def assert_identical(got, want):
    """Every array of ``got`` equal to ``want``'s to the bit, laid out alike, read-only; the same config and
    formats."""
    assert (got.config, got.dtype, got.activations) == (want.config, want.dtype, want.activations)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and a.strides == b.strides, f.name
            assert a.tobytes() == b.tobytes(), f.name
            assert not a.flags.writeable, f.name
    for field, scale in (want.scales or {}).items():
        assert np.array_equal(got.scales[field], scale), field


def no_conversion(monkeypatch):
    """Reading a checkpoint's tensors raises from here on: what loads, loads from a mapped file."""
    def refused(*args, **kwargs):
        raise AssertionError("the checkpoint was read again")
    monkeypatch.setattr(checkpoints, "_read", refused)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("layout", ["transformers", "openai"])
def test_a_checkpoint_is_converted_once_then_mapped(tiny, tmp_path, cache, monkeypatch, layout, dtype):
    path = write_dir(tiny, tmp_path / "ckpt", layout=layout) if layout == "transformers" else \
        write_file(tiny, tmp_path / "bare.safetensors", layout=layout)
    in_memory = g.load_weights(path, dtype, mapped=False)
    assert not is_mapped(in_memory) and not cache.exists()
    first = g.load_weights(path, dtype)
    (copy,) = cache.iterdir()
    assert is_mapped(first) and dtype in copy.name
    no_conversion(monkeypatch)
    again = g.load_weights(path, dtype)
    assert is_mapped(again)
    for w in (first, again):
        assert_identical(w, in_memory)
    assert list(cache.iterdir()) == [copy]


def test_mapped_weights_give_the_same_logits_and_cannot_be_written(tiny, tmp_path, cache):
    path = write_dir(tiny, tmp_path / "ckpt")
    w, read = g.load_weights(path), g.load_weights(path, mapped=False)
    ids = [5, 3, 9, 2, 7]
    assert np.array_equal(g.prefill(ids, w, g.ModelCache(w.config)), g.prefill(ids, read, g.ModelCache(w.config)))
    with pytest.raises(ValueError, match="read-only"):
        w.c_fc_w[0][...] = 0
    assert np.array_equal(w.c_fc_w, read.c_fc_w)


def test_bfloat16_activations_map_the_bfloat16_copy(tiny, tmp_path, cache):
    path = write_dir(tiny, tmp_path / "ckpt")
    w = g.load_weights(path, "bfloat16", activations="bfloat16")
    assert is_mapped(w) and w.activations == "bfloat16"
    assert_identical(w, g.load_weights(path, "bfloat16", activations="bfloat16", mapped=False))


def harm(copy, how):
    data = bytearray(copy.read_bytes())
    if how == "a byte changed":
        data[-100] ^= 1
    elif how == "cut short":
        data = data[:-64]
    elif how == "blocks swapped":  # (in a copy of more than two 1 MiB blocks)
        start = len(data) - 2 * 2**20
        data[start:] = data[start + 2**20:] + data[start:start + 2**20]
    elif how == "an older layout":
        data = data.replace(mapped.LAYOUT.encode(), b"gpt2numba-stacked-0", 1)
    elif how == "its config altered":  # (the header still parses, the data's sums still hold)
        data = data.replace(b'\\"layer_norm_epsilon\\": 1e-05', b'\\"layer_norm_epsilon\\": 1e-06', 1)
    elif how == "its header's length garbled":
        data[:8] = b"\xff" * 8
    copy.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["a byte changed", "cut short", "blocks swapped", "an older layout",
                                 "its config altered", "its header's length garbled"])
def test_a_harmed_copy_is_made_again_not_served(tmp_path, cache, how):
    w = g.random_weights(dataclasses.replace(TINY, vocab_size=8192), seed=2)  # (a wte of 4 MiB: several blocks)
    path = write_dir(w, tmp_path / "ckpt")
    g.load_weights(path)
    (copy,) = cache.iterdir()
    good = copy.read_bytes()
    harm(copy, how)
    assert copy.read_bytes() != good
    assert_identical(g.load_weights(path), g.load_weights(path, mapped=False))
    assert [c.read_bytes() == good for c in cache.iterdir()] == [True]


def test_a_checkpoint_changed_after_its_conversion_is_converted_again(tiny, tmp_path, cache):
    path = write_dir(tiny, tmp_path / "ckpt")
    before = g.load_weights(path)
    (old,) = cache.iterdir()
    file, stat = path / "model.safetensors", os.stat(path / "model.safetensors")
    with open(file, "r+b") as f:  # one byte in the middle, in place (the same inode), and the old time set back
        f.seek(stat.st_size // 2)
        byte = f.read(1)
        f.seek(stat.st_size // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (os.stat(file).st_ino, os.stat(file).st_size, os.stat(file).st_mtime_ns) == \
        (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    after = g.load_weights(path)
    assert_identical(after, g.load_weights(path, mapped=False))
    assert any(not np.array_equal(getattr(after, f), getattr(before, f)) for f in compact.MATRICES)
    assert [c.name for c in cache.iterdir()] != [old.name] and len(list(cache.iterdir())) == 1


def test_a_changed_config_json_is_not_served_from_the_old_copy(tiny, tmp_path, cache):
    path = write_dir(tiny, tmp_path / "ckpt")
    g.load_weights(path)
    config = (path / "config.json").read_text().replace('"layer_norm_epsilon": 1e-05', '"layer_norm_epsilon": 0.001')
    assert config != (path / "config.json").read_text()
    (path / "config.json").write_text(config)
    assert g.load_weights(path).config.layer_norm_epsilon == 0.001


def test_a_cache_that_cannot_be_written_leaves_the_weights_in_memory(tiny, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # (as root, a read-only folder is writable)
    path = write_dir(tiny, tmp_path / "ckpt")
    with pytest.warns(mapped.MappingWarning, match="read into this process's memory"):
        w = g.load_weights(path)
    assert not is_mapped(w)
    assert_identical(w, g.load_weights(path, mapped=False))
    assert (tmp_path / "file").read_text() == "not a folder"


@pytest.mark.parametrize("dtype", FORMATS)
def test_a_stacked_file_is_mapped_as_it_is(tiny, tmp_path, cache, monkeypatch, dtype):
    g.save_weights(tiny, tmp_path / "stacked", dtype=dtype, layout="stacked")
    no_conversion(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = g.load_weights(tmp_path / "stacked", dtype)
    assert is_mapped(w) and not cache.exists()  # (no copy of a file that is one)
    assert_identical(w, tiny.astype(dtype))
    assert_identical(g.load_weights(tmp_path / "stacked", dtype, mapped=False), tiny.astype(dtype))
    assert oct(os.stat(tmp_path / "stacked" / "model.safetensors").st_mode & 0o777) == \
        oct(os.stat(tmp_path / "stacked" / "config.json").st_mode & 0o777)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "stacked" / "model.safetensors"), framework="numpy") as f:  # (a safetensors file)
        assert np.array_equal(f.get_tensor("wpe"), tiny.wpe)


def test_a_stacked_file_that_fails_its_checks_is_an_error(tiny, tmp_path):
    g.save_weights(tiny, tmp_path / "stacked", layout="stacked")
    file = tmp_path / "stacked" / "model.safetensors"
    harm(file, "a byte changed")
    with pytest.raises(CheckpointError, match="sums differ"):
        g.load_weights(tmp_path / "stacked")
    g.save_weights(tiny, tmp_path / "stacked", layout="stacked")
    (tmp_path / "stacked" / "config.json").write_text((tmp_path / "stacked" / "config.json").read_text().replace(
        f'"n_positions": {TINY.n_positions}', f'"n_positions": {2 * TINY.n_positions}'))
    with pytest.raises(CheckpointError, match="config.json says"):
        g.load_weights(tmp_path / "stacked")
    with pytest.raises(g.ConfigError, match="layout must be"):
        g.save_weights(tiny, tmp_path / "x", layout="gguf")
    with pytest.raises(g.ConfigError, match="in the stacked layout, got 'float16'"):
        g.save_weights(tiny, tmp_path / "x", dtype="float16", layout="stacked")


def test_two_processes_map_one_copy(tiny, tmp_path, cache):
    """A second process maps the copy the first wrote (it converts nothing), and both run."""
    path = write_dir(tiny, tmp_path / "ckpt")
    code = ("import sys, gpt2numba as g; from gpt2numba.model import checkpoints; w = g.load_weights(sys.argv[1]); "
            "checkpoints._read = None; w2 = g.load_weights(sys.argv[1]); "
            "print(float(g.prefill([1, 2], w2, g.ModelCache(w2.config))[0]))")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parent.parent)}
    runs = [subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                           timeout=600) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and len(list(cache.iterdir())) == 1


def test_saving_over_a_mapped_file_leaves_the_mapped_weights_whole(tiny, tmp_path):
    """save_weights into the folder of a file mapped by this process, in either layout, writes a new file: the
    weights mapped from the old one read as before (a file truncated under its map would kill the process)."""
    g.save_weights(tiny, tmp_path / "d", layout="stacked")
    w = g.load_weights(tmp_path / "d")
    inode = os.stat(tmp_path / "d" / "model.safetensors").st_ino
    for layout in ("pretrained", "stacked"):
        g.save_weights(w, tmp_path / "d", layout=layout)
        assert os.stat(tmp_path / "d" / "model.safetensors").st_ino != inode
        assert_identical(w, tiny)
    assert_identical(g.load_weights(tmp_path / "d", mapped=False), tiny)


def test_the_default_random_weights_are_drawn_once_then_mapped(cache, monkeypatch):
    """random_copy gives random_weights' bits, drawn once per machine (their copy named by the config, the seed
    and NumPy's version), then mapped; another seed or config is another copy."""
    from gpt2numba.model import weights

    config = dataclasses.replace(TINY, vocab_size=700)
    first = mapped.random_copy(config, 3)
    assert is_mapped(first)
    assert_identical(first, g.random_weights(config, seed=3))
    monkeypatch.setattr(weights, "random_weights", None)  # (drawn again, it would raise)
    assert_identical(mapped.random_copy(config, 3), first)
    monkeypatch.undo()
    assert not np.array_equal(mapped.random_copy(config, 4).wte, first.wte)


def test_a_conversion_cleans_up_after_killed_ones_and_leaves_disk_free(tiny, tmp_path, cache, monkeypatch):
    """Files a killed conversion left (.partial, untouched for an hour) go when a copy is next written, one being
    written now stays; a copy that would leave under 1 GiB free is not written (a warning, the weights in memory)."""
    cache.mkdir(parents=True)
    old, fresh = cache / "x.safetensors1.partial", cache / "y.safetensors2.partial"
    for f in (old, fresh):
        f.write_bytes(b"half a copy")
    os.utime(old, (os.stat(old).st_atime - 7200, os.stat(old).st_mtime - 7200))
    g.load_weights(write_dir(tiny, tmp_path / "ckpt"))
    assert not old.exists() and fresh.exists()
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, (1 << 40) - 2**29, 2**29))
    with pytest.warns(mapped.MappingWarning, match="512 MiB free"):
        w = g.load_weights(write_dir(tiny, tmp_path / "other"))
    assert not is_mapped(w)
