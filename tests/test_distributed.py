"""Scoring on a local Ray cluster (2 CPUs) gives the numbers score() gives in-process."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY_GPT2

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e \".[ray]\")")

CONFIG = TINY_GPT2
TEXTS = ["The quick brown fox jumps over the lazy dog.", "", "x",
         "A longer document, scored in sliding windows. " * 12, "Once upon a time"]

# A command that starts a local Ray cluster, scores and stops it: minutes on a busy 2-core machine.
COMMAND_S = 900


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray") / "model"
    w = g.random_weights(CONFIG, seed=4)
    write_dir(w, path)
    return path, w


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_score_command_on_ray_writes_a_directory(model, tmp_path):
    """gpt2numba score --ray --output DIR: a new local cluster (first: no other is running) writes the records
    score gives in-process (source, index, tokens, nll) as JSON-lines files. (Each command starts a cluster of
    its own, a minute on 2 cores: the two tests share the cases, stdout in the next.)"""
    path, w = model
    (tmp_path / "docs.txt").write_text("\n".join(t for t in TEXTS if t) + "\n")
    base = [sys.executable, "-m", "gpt2numba", "score", "--model", str(path), "--lines", str(tmp_path / "docs.txt")]
    local = subprocess.run(base, capture_output=True, text=True, timeout=COMMAND_S)
    written = subprocess.run([*base, "--ray", "--output", str(tmp_path / "out")], capture_output=True, text=True,
                             timeout=COMMAND_S)
    assert local.returncode == 0 and written.returncode == 0, written.stderr[-2000:]
    assert "documents on Ray" in written.stderr
    expected = [json.loads(line) for line in local.stdout.splitlines()]
    rows = sorted((json.loads(line) for f in (tmp_path / "out").iterdir() for line in f.read_text().splitlines()),
                  key=lambda r: r["index"])
    assert [(r["source"], r["index"], r["tokens"]) for r in rows] == [
        (str(tmp_path / "docs.txt"), i, e["tokens"]) for i, e in enumerate(expected)]
    assert [r["nll"] for r in rows] == pytest.approx([e["nll"] for e in expected], rel=1e-6)


@pytest.mark.slow
def test_score_command_on_ray_takes_whole_files(model, tmp_path):
    """Without --lines each file is one document, on Ray as in-process: the same records on stdout (source,
    index, tokens, nll, perplexity, bits_per_byte), the files in the order given."""
    path, _ = model
    files = [tmp_path / "b.txt", tmp_path / "a.txt"]
    files[0].write_text(TEXTS[3])
    files[1].write_text("\n".join(TEXTS) + "\n")
    base = [sys.executable, "-m", "gpt2numba", "score", "--model", str(path), *map(str, files)]
    local = subprocess.run(base, capture_output=True, text=True, timeout=COMMAND_S)
    on_ray = subprocess.run([*base, "--ray"], capture_output=True, text=True, timeout=COMMAND_S)
    assert local.returncode == 0 and on_ray.returncode == 0, on_ray.stderr[-2000:]
    assert [json.loads(line)["source"] for line in on_ray.stdout.splitlines()] == list(map(str, files))
    assert_same_records(on_ray.stdout, local.stdout)


def assert_same_records(got: str, expected: str):
    """JSON lines with the same fields, sources, indices and token counts; the numbers to 1e-6."""
    got, expected = ([json.loads(line) for line in out.splitlines()] for out in (got, expected))
    assert [list(r) for r in got] == [list(r) for r in expected]
    assert [(r["source"], r["index"], r["tokens"]) for r in got] == [
        (r["source"], r["index"], r["tokens"]) for r in expected]
    for a, b in zip(got, expected):
        for name in ("nll", "perplexity", "bits_per_byte"):
            assert (a[name] is None) == (b[name] is None), name
            if a[name] is not None:
                assert a[name] == pytest.approx(b[name], rel=1e-6, abs=1e-9), name


@pytest.mark.parametrize("dtype, activations", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_score_dataset_equals_score_in_process(model, cluster, dtype, activations):
    from gpt2numba.integrations.distributed import score_dataset

    path, w = model
    w = w.astype(dtype, activations=activations)
    tok = g.load_tokenizer()
    ds = ray.data.from_items([{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    rows = sorted(score_dataset(ds, str(path), dtype=dtype, activations=activations, stride=24, batch_size=2)
                  .take_all(), key=lambda r: r["id"])
    assert [r["text"] for r in rows] == TEXTS  # the input columns are kept
    for row, text in zip(rows, TEXTS):
        s = g.score(tok.encode(text), w, stride=24)
        assert row["tokens"] == s.n_tokens
        assert row["nll"] == pytest.approx(s.nll, rel=1e-6, abs=1e-9)
        assert (math.isnan(row["perplexity"]) and s.n_tokens == 0) or row["perplexity"] == pytest.approx(s.perplexity, rel=1e-6)
    assert rows[3]["tokens"] > CONFIG.n_positions  # several windows


def test_score_dataset_checks_its_arguments(cluster):
    from gpt2numba.integrations.distributed import score_dataset

    ds = ray.data.from_items([{"text": "a"}])
    for kwargs, match in [({"threads_per_worker": 0}, "threads_per_worker"), ({"stride": 0}, "stride"),
                          ({"concurrency": 0}, "concurrency"), ({"batch_size": 0}, "batch_size"),
                          ({"dtype": "int3"}, "dtype"), ({"activations": "bfloat16"}, "needs bfloat16 weights")]:
        with pytest.raises(g.ConfigError, match=match):
            score_dataset(ds, None, **kwargs)
