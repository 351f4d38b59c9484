"""The tuning file (cpu/tuning.py), dispatch taking its values, and `gpt2numba tune` writing them.

The suite itself runs with GPT2NUMBA_TUNING=off (conftest.py); here each test names a file of its own.
"""

import json
import os
import stat
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import gpt2numba as g
from conftest import TINY
from gpt2numba.bench import tune
from gpt2numba.cpu import dispatch, inttiles, paneltiles, tuning
from gpt2numba.errors import ConfigError
from gpt2numba.model import products

MACHINE = dispatch.TUNING.key  # this process's key (computed with tuning off too)
OTHER = {**MACHINE, "numba": "0.0.0"}  # what an older Numba wrote: stale here


@pytest.fixture
def tuning_file(tmp_path, monkeypatch):
    file = tmp_path / "cache" / "tuning.json"
    monkeypatch.setenv("GPT2NUMBA_TUNING", str(file))
    return file


def test_written_and_read_back(tuning_file):
    values = {"rows_max": 12, "int4_rows_max": 16}
    assert tuning.save(MACHINE, values, {"threads": 2}, "2026-12-06T00:00:00+00:00") == tuning_file
    loaded = tuning.load(MACHINE)
    assert (loaded.path, loaded.values, loaded.entry["measured"]) == (tuning_file, values, {"threads": 2})
    assert not list(tuning_file.parent.glob(".tuning-*"))  # the temporary file was renamed, not left


def test_a_stale_key_is_ignored_and_other_machines_kept(tuning_file):
    tuning.save(OTHER, {"rows_max": 5}, {}, "then")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # another machine's entry is not a problem to warn about
        assert tuning.load(MACHINE).values == {}
    tuning.save(MACHINE, {"rows_max": 7}, {}, "now")
    tuning.save(MACHINE, {"rows_max": 9}, {}, "later")  # replaces this machine's entry only
    entries = json.loads(tuning_file.read_text())["entries"]
    assert [(e["key"] == MACHINE, e["values"]) for e in entries] == [(False, {"rows_max": 5}), (True, {"rows_max": 9})]
    assert tuning.load(MACHINE).values == {"rows_max": 9}


def _warned_and_ignored(tuning_file, text, says, whole):
    tuning_file.parent.mkdir(parents=True)
    tuning_file.write_text(text)
    with pytest.warns(tuning.TuningWarning, match="ignoring the tuning file") as caught:
        assert tuning.load(MACHINE).values == {}
    message = str(caught[0].message)
    assert str(tuning_file) in message and says in message
    # tune again: a file unusable as a whole is replaced, saying so; a bad entry, replaced by the new one
    with pytest.warns(tuning.TuningWarning, match="replacing the tuning file") if whole else warnings.catch_warnings():
        tuning.save(MACHINE, {"rows_max": 3}, {}, "now")
    assert tuning.load(MACHINE).values == {"rows_max": 3}


@pytest.mark.parametrize("text, says", [
    ("{not json", "Expecting property name"),
    ('{"gpt2numba_tuning": 99, "entries": []}', "format 99; this version reads 1"),
    ('{"entries": []}', "not a gpt2numba tuning file"),
    ('{"gpt2numba_tuning": 1, "entries": {}}', "not a list of objects"),
])
def test_a_malformed_file_is_warned_about_and_ignored(tuning_file, text, says):
    _warned_and_ignored(tuning_file, text, says, whole=True)


@pytest.mark.parametrize("values, says", [
    ({"rows_max": 65}, "rows_max must be an integer in [1, 64], got 65"),
    ({"head_rows_max": 0}, "head_rows_max must be an integer in [1, 64], got 0"),
    ({"int_rows_max": 8.0}, "int_rows_max must be an integer in [1, 64], got 8.0"),
    ({"int_rows_max": True}, "int_rows_max must be an integer in [1, 64], got True"),
    ({"split_k": 4}, "'split_k' is not a threshold gpt2numba tunes"),
    ([1, 2], "the values are not an object"),
])
def test_an_entry_out_of_range_is_warned_about_and_ignored(tuning_file, values, says):
    text = json.dumps({"gpt2numba_tuning": 1, "entries": [{"key": MACHINE, "values": values}]})
    _warned_and_ignored(tuning_file, text, says, whole=False)


@pytest.mark.parametrize("off", ["off", "OFF", "0", "false", "no", "None", " off "])
def test_off_reads_and_writes_nothing(monkeypatch, off):
    monkeypatch.setenv("GPT2NUMBA_TUNING", off)
    assert tuning.path() is None and tuning.load(MACHINE).values == {}
    with pytest.raises(ConfigError, match="GPT2NUMBA_TUNING is off"):
        tuning.save(MACHINE, {"rows_max": 3}, {}, "now")


def test_where_the_file_is(monkeypatch, tmp_path):
    monkeypatch.delenv("GPT2NUMBA_TUNING")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.path() == tmp_path / "gpt2numba" / "tuning.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: a relative one is ignored
    assert tuning.path() == Path.home() / ".cache" / "gpt2numba" / "tuning.json"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPT2NUMBA_TUNING", "mine.json")  # a relative path: where the process started
    assert tuning.path() == tmp_path / "mine.json"


def test_an_unfindable_file_never_stops_the_import(monkeypatch):
    """No home directory (a container with an arbitrary user id), a directory one may not search: warned, the
    defaults."""
    def nowhere():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(tuning, "path", nowhere)
    with pytest.warns(tuning.TuningWarning, match="Could not determine home directory"):
        found = tuning.load(MACHINE)
    assert found.values == {} and "unusable" in found.why_not


def test_writers_at_once_keep_every_entry(tuning_file):
    """Machines sharing a home directory, tuning at once: none loses its entry (the lock)."""
    keys = [{**OTHER, "cpu": f"cpu {i}"} for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: tuning.save(k, {"rows_max": 5}, {}, "now"), keys * 3))
    entries = json.loads(tuning_file.read_text())["entries"]
    assert sorted(e["key"]["cpu"] for e in entries) == sorted(k["cpu"] for k in keys)


def test_the_file_keeps_its_mode_and_its_link(tuning_file, tmp_path):
    tuning.save(MACHINE, {"rows_max": 5}, {}, "now")
    assert stat.S_IMODE(tuning_file.stat().st_mode) == 0o644  # readable by the others sharing it
    tuning_file.chmod(0o664)
    link = tmp_path / "link.json"
    link.symlink_to(tuning_file)
    os.environ["GPT2NUMBA_TUNING"] = str(link)  # (monkeypatch restores it: tuning_file set it)
    tuning.save(MACHINE, {"rows_max": 6}, {}, "later")
    assert link.is_symlink() and stat.S_IMODE(tuning_file.stat().st_mode) == 0o664
    assert tuning.load(MACHINE).values == {"rows_max": 6}


@pytest.mark.parametrize("dtype, threshold, few, many", [
    ("float32", "ROWS_MAX", "_rows_product", "_linear"), ("bfloat16", "BF16_ROWS_MAX", "_rows_product", "_linear"),
    ("int8", "INT_ROWS_MAX", "_int_matmul", "_tiles_matmul"), ("int4", "INT4_ROWS_MAX", "_int_matmul", "_tiles_matmul"),
    ("float32", "HEAD_ROWS_MAX", "_rows_product", "_head"),
    # bfloat16 activations: many rows in panels with AVX512_BF16, else BLAS on the rounded values
    ("bfloat16 activations", "BF16_DOT_ROWS_MAX", "_rows_product",
     "_panel_product" if dispatch.BF16_DOT else "_linear"),
    pytest.param("bfloat16 activations", "BF16_DOT_ROWS_MAX", "_rows_product",
                 "_panel_product" if dispatch.BF16_DOT else "_head", id="bfloat16 activations' head"),
])
def test_products_follow_the_thresholds(monkeypatch, request, dtype, threshold, few, many):
    """The kernel a product takes changes where dispatch's value says, read at every call (what a tuning sets)."""
    w = g.random_weights(TINY, seed=0)
    w = w.astype("bfloat16", activations="bfloat16") if dtype == "bfloat16 activations" else w.astype(dtype)
    head = threshold == "HEAD_ROWS_MAX" or "head" in request.node.callspec.id
    calls = []
    for name in (few, many):
        owner = inttiles if name == "_tiles_matmul" else paneltiles if name == "_panel_product" else products
        kernel = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _k=kernel, _n=name: (calls.append(_n), _k(*a))[1])
    monkeypatch.setattr(dispatch, threshold, 3)
    for T in (3, 4):
        x = np.ones((T, TINY.n_embd), np.float32)
        if head:
            products.head_logits(w, x, np.empty((T, TINY.vocab_size), np.float32), 8)
        else:
            out = np.empty((T, 3 * TINY.n_embd), np.float32)
            products.matmul(x, "c_attn_w", 0, w.c_attn_b[0], out, False, w, products.workspace(w, T, 2), 8)
    assert calls == [few, many]


def test_tune_names_every_threshold():
    assert set(tune.FORMATS) == set(tuning.TUNABLE)


def test_the_key_names_the_machine_and_code():
    assert MACHINE["cpu"] == dispatch.cpu_name() and MACHINE["features"] == (
        None if dispatch.FEATURES is None else sorted(dispatch.FEATURES))
    assert {"numba", "kernels"} <= set(MACHINE)


def test_the_suite_runs_with_the_defaults():
    assert os.environ["GPT2NUMBA_TUNING"] == "off" and dispatch.CHOICES == dispatch.DEFAULTS
    said = dispatch.describe_tuning()
    assert "GPT2NUMBA_TUNING=off; `gpt2numba tune` measures them on this CPU" in said
    assert "few-rows kernels for BLAS or the integer tiles" in said  # (what it may change)


@pytest.mark.parametrize("figures, expected", [
    ({2: (1, 2), 3: (1, 2), 4: (3, 2), 6: (1, 2), 8: (3, 2), 12: (3, 2)}, (6, True)),  # one loss is noise; two end it
    ({2: (3, 2), 3: (3, 2), 4: (1, 2)}, (1, True)),  # many rows won from the start
    ({2: (1, 1), 64: (1, 1)}, (64, False)),  # a tie goes to the few-rows kernel
    ({2: (1, 2), 3: (3, 2)}, (2, False)),  # one loss so far
])
def test_the_crossing(figures, expected):
    assert tune.crossing(figures) == expected


_MODEL_UNDER_TUNING = """
import json, sys
import numpy as np
import gpt2numba as g
from gpt2numba.cpu import dispatch
from gpt2numba.model.oracle import recompute_logits

expected = json.loads(sys.argv[1])
assert dispatch.CHOICES._asdict() | expected == dispatch.CHOICES._asdict(), dispatch.CHOICES
assert all(f"{name} {value} (measured" in dispatch.describe_tuning() for name, value in expected.items())
cfg = g.GPT2Config(n_layer=2, n_head=2, n_embd=128, n_positions=64, vocab_size=512)
base = g.random_weights(cfg, seed=3)
rng = np.random.default_rng(0)
worst = 0.0
for dtype, activations in (("float32",) * 2, ("bfloat16", "float32"), ("int8", "float32"), ("int4", "float32"),
                           ("bfloat16",) * 2):
    w = base.astype(dtype, activations)
    ref_w = w if activations == "bfloat16" else w.astype("float32")  # (the oracle rounds the inputs as w does)
    for B in (1, 3, 9):  # decode_batch over B rows: each side of the thresholds in the file
        prompts = [list(rng.integers(0, 512, 5)) for _ in range(B)]
        caches = [g.ModelCache(cfg, max_len=16) for _ in range(B)]
        g.prefill_batch(prompts, w, caches)
        nxt = [int(t) for t in rng.integers(0, 512, B)]
        logits = g.decode_batch(nxt, w, caches)
        for ids, t, row in zip(prompts, nxt, logits):
            ref = recompute_logits(ids + [t], ref_w)
            atol = 3e-2 if activations == "bfloat16" else 1e-3 if dtype in ("float32", "bfloat16") else 2e-2
            assert np.allclose(row, ref, atol=atol, rtol=1e-2), (dtype, B, float(np.abs(row - ref).max()))
            worst = max(worst, float(np.abs(row - ref).max()))
print(f"ok {worst:.2e}")
"""


@pytest.mark.parametrize("threshold", [1, 4])
def test_the_model_matches_the_oracle_with_tuned_thresholds(tuning_file, threshold):
    """A process that reads a file takes its values, and its passes still match the oracle: thresholds of 1 send
    every batch of 2 rows or more to BLAS and the integer tiles, 4 splits the batches of 3 and 9."""
    values = {name: threshold for name in tuning.TUNABLE}
    tuning.save(MACHINE, values, {}, "now")
    done = subprocess.run([sys.executable, "-c", _MODEL_UNDER_TUNING, json.dumps(values)],
                          capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]


def test_tune_writes_what_dispatch_reads(tuning_file):
    """`gpt2numba tune` (one threshold, cut short) writes a value in range, which the next process takes."""
    done = subprocess.run([sys.executable, "-m", "gpt2numba", "tune", "--only", "int4_rows_max", "--repeat", "1",
                           "--layers", "1", "--idle-patience", "0"],
                          capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    value = tuning.load(MACHINE).values["int4_rows_max"]
    assert value in (1, *tune.ROWS) and f"int4_rows_max: {value} (default" in done.stdout
    assert f"written to {tuning_file}" in done.stdout
    shown = subprocess.run([sys.executable, "-c", "from gpt2numba.cpu import dispatch; "
                            "print(dispatch.INT4_ROWS_MAX, dispatch.describe_tuning())"],
                           capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert shown.stdout.startswith(f"{value} ") and f"int4_rows_max {value} (measured" in shown.stdout
