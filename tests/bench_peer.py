"""A benchmark peer for the tests (tests/test_profiling.py): it answers prefill with fixed logits and reports
the environment it saw, so a test can hold the benchmark to starting its peers as their users run them."""

import os
import sys

import numpy as np


class Probe:
    def prefill(self, ids):
        return np.arange(8, dtype=np.float32)

    def environ(self, arg):
        return dict(os.environ), sorted(name for name in sys.modules if name.split(".")[0] in ("gpt2numba", "numba"))

    def threads(self):
        return 1


def system(kind, path, threads):
    return Probe(), "probe", "probe 1.0"
