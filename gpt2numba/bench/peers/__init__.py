"""The peers' side of the benchmark: each module here runs in a peer's worker process (worker.py), loaded by
its file's path in a process that never imports gpt2numba, so that the peer runs as its users run it. So these
modules import the standard library, NumPy and their peer's library only, never gpt2numba
(tests/test_layout.py holds them to it).

Each has ``system(kind, path, threads) -> (system, name, version)``: version None when the peer's library is
not installed. A system answers the benchmark's calls (prefill, decode, ...) and ``threads()``, the threads it
runs on as its library reports them.
"""
