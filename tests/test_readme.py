"""The README's commands and Python snippets run as a new user would type them, in order, and the examples in
docs/ that show a command's output print that output (docs/testing.md).

Python blocks run one after another in one namespace; each shell command runs in a scratch directory that
the blocks share (files one makes, a later one reads). A command that cannot run here is skipped by a rule
below that says why; no other command may fail.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLES = ("docs/generate.md", "docs/scoring.md")  # the docs whose examples show what a command printed
# (what a command contains, why it does not run in the suite)
SKIPPED = (
    ("pip install", "installs the project: the suite runs in what it installed"),
    ("python -m pytest", "the test suite itself"),
    ("openai-community/", "a hub name: needs the network and the [hub] extra"),
    ("path/to/", "a placeholder for a checkpoint of the reader's"),
    ("--ray", "starts a Ray cluster (tests/test_distributed.py runs it)"),
    ("gpt2numba serve", "a server runs until stopped (tests/test_serve.py runs it)"),
    ("curl ", "talks to the server above"),
    ("essay", "a file of the reader's own"),
    ("corpus.jsonl", "a file of the reader's own"),
    ("--html", "writes a page (tests/test_report.py holds it)"),
)


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def commands(code: str) -> list[str]:
    """The commands of a shell block: lines joined at a trailing backslash, each line's commands split at
    ``&&``, blank lines dropped."""
    out, pieces = [], []
    for raw in code.splitlines():
        pieces.append(raw.removesuffix("\\").strip())
        if not raw.endswith("\\"):
            out += [part.strip() for part in " ".join(pieces).split(" && ") if part.strip()]
            pieces = []
    return out


@contextlib.contextmanager
def _in(directory):
    """In ``directory`` for the duration (contextlib.chdir, before Python 3.11)."""
    before = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def skipped(command: str) -> str | None:
    return next((why for pattern, why in SKIPPED if pattern in command), None)


def test_the_blocks_are_found():
    found = blocks(README.read_text())
    assert sum(lang == "python" for lang, _ in found) >= 4 and sum(lang == "sh" for lang, _ in found) >= 6
    assert commands("a \\\n  b\n\nd && e") == ["a b", "d", "e"]
    assert skipped("gpt2numba serve --port 8000") and not skipped("gpt2numba generate Hello")


@pytest.mark.slow
def test_every_snippet_runs_in_order(tmp_path):
    """Every block, top to bottom: the Python ones must run and the shell commands exit 0 (those SKIPPED
    aside), each printing what it prints."""
    namespace, ran, passed = {}, [], []
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for lang, code in blocks(README.read_text()):
        if lang == "python":
            with _in(tmp_path), contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, str(README), "exec"), namespace)
            ran.append(code.splitlines()[0])
        elif lang == "sh":
            for command in commands(code):
                if skipped(command):
                    passed.append(command)
                    continue
                done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                                      timeout=600, executable="/bin/bash")
                assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
                ran.append(command)
    assert any("gpt2numba generate" in r for r in ran) and any("gpt2numba score" in r for r in ran)
    print(f"{len(ran)} snippets ran; skipped: {passed}")


def examples(text: str) -> list[tuple[str, list[str]]]:
    """(command, the lines shown after it) of each ``$ command`` in the shell blocks of a doc."""
    found = []
    for lang, code in blocks(text):
        shown = None  # the lines after this block's latest command
        for line in code.splitlines() if lang == "sh" else []:
            if line.startswith("$ "):
                shown = []
                found.append((line[2:].split("  #")[0].strip(), shown))
            elif shown is not None:
                shown.append(line)
    return found


def _same(shown: str, printed: str) -> bool:
    """A line as the doc shows it and as the command printed it: JSON alike to 1e-6 (the last digits of a
    sum depend on the CPU's kernels), other text exactly."""
    try:
        return _close(json.loads(shown), json.loads(printed))
    except ValueError:
        return shown == printed


def _close(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, rel=1e-6)
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize("doc", EXAMPLES)
def test_docs_examples_print_what_they_show(doc, tmp_path):
    """Each ``$ command`` of the doc runs in order and prints to stdout the lines shown under it (the lines
    that begin "gpt2numba:" are its summary on stderr, timings in them: not compared)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("GPT2NUMBA_WEIGHTS", None)
    checked = 0
    for command, shown in examples((ROOT / doc).read_text()):
        if skipped(command):
            continue
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600, executable="/bin/bash")
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
        expected = [line for line in shown if not line.startswith("gpt2numba:")]
        printed = done.stdout.splitlines()
        assert len(printed) == len(expected) and all(map(_same, expected, printed)), (
            f"{doc}: {command}\nshown:\n" + "\n".join(expected) + "\nprinted:\n" + done.stdout)
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("page, most", [("README.md", 200), ("docs/performance.md", 399)])
def test_the_pages_a_reader_opens_first_stay_short(page, most):
    """The README and the performance page are read, not searched: detail goes to docs/ and the history file."""
    lines = (ROOT / page).read_text().count("\n")
    assert lines <= most, f"{page} has {lines} lines (at most {most}): move detail to docs/ or the history"
