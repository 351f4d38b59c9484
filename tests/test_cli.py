"""The command line, run as a user types it: a subprocess."""

import os
import subprocess
import sys

import pytest

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "gpt2numba", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


def test_check_on_a_checkpoint(tmp_path):
    write_dir(g.random_weights(TINY, seed=3), tmp_path)
    r = run("check", "--model", str(tmp_path), "--prompts", "2", "--prompt-len", "20", "--decode", "3")
    assert r.returncode == 0, r.stderr
    assert "2 layers" in r.stdout and "all of 2 prompts and the batch match the oracle" in r.stdout
    assert r.stdout.count(" ok;") == 3 and "batch of 2: the same prompts in one pass" in r.stdout


def test_check_compact_dtypes(tmp_path):
    write_dir(g.random_weights(TINY, seed=3), tmp_path)
    for dtype in ("bfloat16", "int8", "int4"):
        r = run("check", "--model", str(tmp_path), "--dtype", dtype, "--prompts", "1", "--prompt-len", "9",
                "--decode", "2")
        assert r.returncode == 0, r.stderr
        assert dtype in r.stdout and "all of 1 prompts and the batch match the oracle" in r.stdout


def test_check_default_weights_from_environment(tmp_path):
    write_dir(g.random_weights(TINY, seed=3), tmp_path)
    r = run("check", "--prompts", "1", "--prompt-len", "5", "--decode", "1", env={"GPT2NUMBA_WEIGHTS": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert str(tmp_path) in r.stdout


def test_errors_are_one_line(tmp_path):
    r = run("check", "--model", str(tmp_path / "missing"))
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr
    (tmp_path / "x.safetensors").write_text("not a checkpoint")
    r = run("check", "--model", str(tmp_path / "x.safetensors"))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "not a readable safetensors file" in r.stderr
    r = run("check", "--prompts", "0")
    assert r.returncode == 2 and "--prompts: must be at least 1" in r.stderr


def test_help():
    assert "generate" in run("--help").stdout
    assert "--prompt-len" in run("check", "--help").stdout
    assert "--top-p" in run("generate", "--help").stdout


def test_bench_takes_the_benchmarks_own_options():
    """Everything after "bench" reaches the benchmark's parser (which used to see none of it)."""
    r = run("bench", "--help")
    assert r.returncode == 0 and "--threads" in r.stdout and "--score-stride" in r.stdout
    r = run("bench", "--threads", "2", "--no-such-option")
    assert r.returncode == 2 and "gpt2numba bench: error: unrecognized arguments: --no-such-option" in r.stderr


def test_generate_streams_text_and_a_summary():
    r = run("generate", "Hello world", "--max-new-tokens", "8", "--seed", "3", "--top-k", "40")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello world") and len(r.stdout) > len("Hello world\n")
    assert "random GPT-2 small weights" in r.stderr and "2 prompt tokens, 8 new tokens" in r.stderr
    again = run("generate", "Hello world", "--max-new-tokens", "8", "--seed", "3", "--top-k", "40")
    assert again.stdout == r.stdout


def test_generate_bad_settings_are_one_line():
    for args, match in [(["--temperature", "-1"], "temperature"), (["--top-p", "2"], "top_p"),
                        (["--max-new-tokens", "2000"], "context of 1024")]:
        r = run("generate", "Hi", *args)
        assert r.returncode == 1 and match in r.stderr and "Traceback" not in r.stderr


def test_unknown_hub_model_is_one_line():
    r = run("generate", "Hi", "--model", "nobody/no-such-model", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1 and "Traceback" not in r.stderr and "no-such-model" in r.stderr


@pytest.mark.slow
def test_generate_a_prompts_file(tmp_path):
    """One JSON line per prompt, as it finishes; the same tokens whatever the batch size."""
    import json

    (tmp_path / "p.txt").write_text("Hello world\n\nThe meaning of life is\n{\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "Hello world"}\n{"prompt": "", "id": 7}\n')
    runs = [run("generate", "--prompts-file", str(tmp_path / "p.txt"), "--max-new-tokens", "4", "--seed", "1",
                "--batch-size", str(n)) for n in (1, 3)]
    for r in runs:
        assert r.returncode == 0, r.stderr
        assert "3 prompts, 12 new tokens" in r.stderr and "tokens/s" in r.stderr
    records = [sorted((json.loads(line) for line in r.stdout.splitlines()), key=lambda x: x["index"]) for r in runs]
    assert records[0] == records[1]
    assert [x["prompt"] for x in records[0]] == ["Hello world", "The meaning of life is", "{"]
    assert all(len(x["tokens"]) == 4 and x["text"] for x in records[0])
    r = run("generate", "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "2", "--temperature", "0")
    assert r.returncode == 0 and [json.loads(line)["prompt"] for line in r.stdout.splitlines()] == ["Hello world", ""]
    r = run("generate", "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "0")
    assert r.returncode == 0 and [json.loads(line)["text"] for line in r.stdout.splitlines()] == ["", ""]


def test_bad_prompts_files_are_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "latin1.txt").write_bytes("fine\ncaf\u00e9\n".encode("latin-1"))
    for args, code, match in [
        (["--prompts-file", str(tmp_path / "bad.jsonl")], 1, "bad.jsonl, line 2: expected an object"),
        (["--prompts-file", str(tmp_path / "empty.txt")], 1, "no prompts"),
        (["--prompts-file", str(tmp_path / "missing.txt")], 1, "missing.txt"),
        (["Hi", "--prompts-file", str(tmp_path / "empty.txt")], 2, "not both"),
        (["Hi", "--batch-size", "2"], 2, "--batch-size goes with --prompts-file"),
        (["--prompts-file", str(tmp_path / "bad.jsonl"), "--slide"], 2, "--slide goes with a single PROMPT"),
        (["--prompts-file", str(tmp_path / "latin1.txt")], 1, "latin1.txt, line 2: bytes that are not UTF-8"),
    ]:
        r = run("generate", *args)
        assert r.returncode == code and match in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_score_files(tmp_path):
    """One JSON line per document, in order; the same figures as score_text in-process."""
    import json
    import math

    (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog.")
    (tmp_path / "lines.txt").write_text("Hello world\n\nOnce upon a time\n")
    (tmp_path / "c.jsonl").write_text('{"text": "A cat sat."}\n{"text": "x", "id": 2}\n')
    r = run("score", str(tmp_path / "a.txt"), str(tmp_path / "c.jsonl"))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["source"].rsplit("/", 1)[-1], x["index"]) for x in rows] == [("a.txt", 0), ("c.jsonl", 0), ("c.jsonl", 1)]
    expected = g.score_text("The quick brown fox jumps over the lazy dog.", g.default_weights())
    assert rows[0]["tokens"] == expected.n_tokens and math.isclose(rows[0]["nll"], expected.nll, rel_tol=1e-6)
    assert math.isclose(rows[0]["bits_per_byte"], expected.nll / math.log(2) / 44, rel_tol=1e-6)
    assert rows[2]["tokens"] == 0 and rows[2]["perplexity"] is None  # one token: nothing to score
    assert "3 documents" in r.stderr and "tokens/s" in r.stderr
    r = run("score", "--lines", str(tmp_path / "lines.txt"), "--stride", "8", "--batch-size", "2")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["tokens"] for line in r.stdout.splitlines()] == [1, 0, 3]  # the empty line: 0


def test_score_reports_bad_bytes_and_keeps_what_came_before(tmp_path):
    import json

    (tmp_path / "bad.txt").write_bytes(b"good line\nanother good one\nbad \xff byte\nnever read\n")
    r = run("score", "--lines", str(tmp_path / "bad.txt"))
    assert r.returncode == 1 and "bad.txt, line 3: bytes that are not UTF-8" in r.stderr and "Traceback" not in r.stderr
    assert [json.loads(line)["index"] for line in r.stdout.splitlines()] == [0, 1]
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "score", "-", "--field", "body"], input='{"text": "a"}\n',
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and '<stdin>, line 1: no string field "body"' in r.stderr
