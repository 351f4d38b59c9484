"""Shared fixtures and Hypothesis profiles.

Profiles: "ci" (the default; the whole suite in a few minutes on 2 cores) and
"full" (many more examples, for local runs): HYPOTHESIS_PROFILE=full pytest
"""

import atexit
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Claims on CPUs off (pool._claim): in the suite, pytest-xdist's workers and the subprocesses the tests
# start would each find the first one's claim and run unpinned; tests that claim set a directory of their own.
os.environ.setdefault("GPT2NUMBA_CLAIM_DIR", "off")
# The suite runs with dispatch's default thresholds, whatever `gpt2numba tune` measured on this machine
# (reproducible bits); tests/test_tuning.py sets a file of its own where it needs one.
os.environ["GPT2NUMBA_TUNING"] = "off"
# What the package writes for later processes (the tokenizer's tables, mapped copies of weights: 2.5 GB a run)
# goes to this process's own folder, not the user's home, and goes with the process; its subprocesses share it.
os.environ["XDG_CACHE_HOME"] = _SUITE_CACHE = tempfile.mkdtemp(prefix="gpt2numba-suite-cache-")
atexit.register(shutil.rmtree, _SUITE_CACHE, ignore_errors=True)

import gpt2numba as g  # noqa: E402
import warm_kernels  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=12, **_common)
settings.register_profile("full", max_examples=200, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Two layers of 64-wide heads: every code path of GPT-2, at a size that runs in ms.
TINY = g.GPT2Config(n_layer=2, n_head=2, n_embd=128, n_positions=64, vocab_size=512)
# TINY with GPT-2's vocabulary: for whatever goes through the tokenizer (text in or out)
TINY_GPT2 = dataclasses.replace(TINY, vocab_size=50257)

WARM_S = 900  # compiling every format's kernels: minutes on 2 busy cores

_max_diffs = []  # (label, max |cached - oracle|), reported at the end of the run


def record_diff(label: str, diff: float) -> None:
    _max_diffs.append((label, diff))


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its comparisons to the controller, which prints the summary."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["gpt2numba_diffs"] = _max_diffs


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _max_diffs.extend(tuple(pair) for pair in getattr(node, "workeroutput", {}).get("gpt2numba_diffs", []))


def pytest_terminal_summary(terminalreporter):
    if _max_diffs:
        worst = max(_max_diffs, key=lambda p: p[1])
        terminalreporter.write_line(
            f"gpt2numba: {len(_max_diffs)} logit comparisons with the oracle, "
            f"max |cached - oracle| = {worst[1]:.3g} ({worst[0]})"
        )


def pytest_configure(config):
    """For the whole suite under pytest-xdist, the controller compiles the kernels into Numba's cache before the
    workers start (warm_kernels.py, one process a worker, up to one a format), so that each is compiled once,
    not once in every worker. A part of the suite (paths, -k, -m, --lf) compiles what its tests need, as they
    run. A kernel that fails to compile here fails again in its tests; a warm-up that fails is reported."""
    here, option = Path(__file__).parent, config.option
    workers = getattr(option, "numprocesses", None)
    part = (option.keyword or option.markexpr or getattr(option, "lf", False) or option.collectonly
            or any(Path(arg.split("::")[0]).resolve() not in (here, here.parent) for arg in config.args))
    if hasattr(config, "workerinput") or not isinstance(workers, int) or workers < 1 or part or numba.config.DISABLE_JIT:
        return
    paths = [str(Path(g.__file__).parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # the gpt2numba this run imports
    shares = min(workers, len(warm_kernels.FORMATS))
    warming = [subprocess.Popen([sys.executable, str(here / "warm_kernels.py"), str(i), str(shares)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(shares)]
    for process in warming:
        try:
            _, err = process.communicate(timeout=WARM_S)
        except subprocess.TimeoutExpired:
            process.kill()
            err = f"no end after {WARM_S} s"
        if process.returncode:
            print(f"tests/warm_kernels.py {' '.join(process.args[2:])} failed, the workers compile alone: "
                  f"{err.strip().splitlines()[-1] if err.strip() else process.returncode}", file=sys.stderr)


def pytest_collection_modifyitems(items):
    """The slow tests first: under pytest-xdist the workers then end at about the same time, instead of one
    starting a minute-long test when the other has nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def compiled():
    """Compile (or load from Numba's cache) every kernel once, before any timing matters."""
    w = g.random_weights(TINY, seed=0)
    mc = g.ModelCache(TINY)
    g.prefill([1, 2, 3], w, mc)
    g.decode_step(4, w, mc)


@pytest.fixture(scope="session")
def tiny():
    return g.random_weights(TINY, seed=1)


@pytest.fixture(scope="session")
def small():
    """GPT-2 small's real shapes (12 x 12 x 768, vocab 50257, 1024 positions), random weights."""
    return g.random_weights(g.GPT2Config.small(), seed=2)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
