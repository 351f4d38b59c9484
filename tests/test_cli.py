"""The command line, run as a user types it: a subprocess."""

import os
import subprocess
import sys

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
    assert "2 layers" in r.stdout and "all of 2 prompts match the oracle" in r.stdout
    assert r.stdout.count(" ok;") == 2


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
    assert "check" in run("--help").stdout
    assert "--prompt-len" in run("check", "--help").stdout
