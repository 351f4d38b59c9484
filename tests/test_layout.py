"""The package's layout: imports point one way (no circles), modules and functions a reader can hold, the CPU
read in one place."""

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpt2numba

PACKAGE = Path(gpt2numba.__file__).parent
MAX_MODULE_LINES = 500  # the library proper; the benchmark (bench/) is apart
MAX_FUNCTION_LINES = 80  # in serve/ and bench/


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> source file (a package is its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source (inside functions too: an import
    put off until a call is still an arrow): ``from .x import y``, ``from . import x``, ``import gpt2numba.x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # from base import y: y is a submodule if there is one, else a name defined in base
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, as [a, b, ..., a], or None (depth-first search, three colours)."""
    state, stack = {}, []  # state: 1 on the current path, 2 done

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_module_imports():
    """Each module imports on its own (an optional extra that is missing is the only excuse)."""
    for name in modules():
        if name.endswith("__main__"):  # running it is the command itself
            continue
        try:
            importlib.import_module(name)
        except ImportError as e:
            if (e.name or "").split(".")[0] == "gpt2numba":
                raise
    # and pkgutil sees the same modules as the walk below
    seen = {m.name for m in pkgutil.walk_packages([str(PACKAGE)], "gpt2numba.")}
    assert seen | {"gpt2numba"} == set(modules())


# The floors, lowest first: a module imports from its own room or from rooms on floors below, never above
# and never beside (serve/ and integrations/ know nothing of each other). A room is a subpackage or a module
# at the top; "__init__" is the package's own public names, which the benchmark and the command line use.
FLOORS = [
    {"errors", "argtypes"},
    {"cpu"},
    {"model"},
    {"text"},
    {"decoding"},
    {"__init__"},
    {"serve", "integrations"},
    {"bench"},
    {"cli"},
    {"__main__", "harness", "distributed"},  # python -m gpt2numba; documented paths of integrations/
]
MAX_TOP_MODULES = 6


def room(name: str) -> str:
    """The room of a module: gpt2numba.model.forward -> model, gpt2numba.errors -> errors, gpt2numba -> __init__."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def wrong_arrows(graph: dict[str, set[str]]) -> list[str]:
    """The imports that point up or sideways between rooms, as "a -> b" (a room on no floor counts as wrong)."""
    floor = {r: level for level, rooms in enumerate(FLOORS) for r in rooms}
    wrong = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            ra, rb = room(a), room(b)
            if ra != rb and not floor.get(rb, len(FLOORS)) < floor.get(ra, -1):
                wrong.append(f"{a} -> {b}")
    return wrong


def test_no_import_circles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert graph["gpt2numba.cli.commands"] >= {"gpt2numba.model.models", "gpt2numba.bench"}  # the walk sees arrows
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
    assert "gpt2numba.model.weights" not in graph["gpt2numba.model.checks"]
    assert not {n for n in graph["gpt2numba.serve.engine"]} & {"gpt2numba.serve.app"}


def test_rooms_import_down_only():
    """Upper floors use lower ones, none the reverse: the kernels know no model, the model no decoding, the
    library no server, no benchmark, no command line; every room is on a floor."""
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert not wrong_arrows(graph), "imports against the floors: " + ", ".join(wrong_arrows(graph))
    assert {room(n) for n in known} == set().union(*FLOORS)  # every room on a floor, no floor empty


def test_the_floors_find_a_wrong_arrow():
    """The check can fail: an arrow down passes; one up, one sideways and one from a room on no floor are named."""
    assert not wrong_arrows({"gpt2numba.model.forward": {"gpt2numba.cpu.kernels", "gpt2numba.model.kvcache"}})
    assert wrong_arrows({"gpt2numba.cpu.dispatch": {"gpt2numba.model.compact"}}) == [
        "gpt2numba.cpu.dispatch -> gpt2numba.model.compact"]
    assert wrong_arrows({"gpt2numba.serve.engine": {"gpt2numba.integrations.distributed"}})
    assert wrong_arrows({"gpt2numba.extra": {"gpt2numba.errors"}})


def test_documented_paths_of_moved_modules():
    """gpt2numba.distributed, which the README and docs give, is integrations/distributed.py's (gpt2numba.harness,
    also a command, is run by tests/test_harness.py)."""
    from gpt2numba import distributed
    from gpt2numba.integrations import distributed as moved

    assert distributed.score_dataset is moved.score_dataset and distributed.generate_dataset is moved.generate_dataset


def test_the_package_imports_its_modules_on_first_use():
    """`import gpt2numba` loads neither Numba nor NumPy (a command or a worker pays for what it calls); each
    public name is then found, in a room below the package's own, and dir() lists it."""
    code = ("import sys, gpt2numba; print(sorted({m.split('.')[0] for m in sys.modules} & {'numba', 'numpy', "
            "'llvmlite', 'scipy', 'safetensors', 'tiktoken'}), sorted(m for m in sys.modules if m.startswith('gpt2numba')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "['gpt2numba',", "'gpt2numba.errors']"], out
    floor = {r: level for level, rooms in enumerate(FLOORS) for r in rooms}
    assert set(gpt2numba._MODULE_OF) | {n for n in gpt2numba.__all__ if n.endswith("Error")} == set(gpt2numba.__all__)
    for name, module in gpt2numba._MODULE_OF.items():
        assert floor[room("gpt2numba" + module)] < floor["__init__"], module
        assert getattr(gpt2numba, name) is getattr(importlib.import_module("gpt2numba" + module), name)
    assert set(gpt2numba.__all__) <= set(dir(gpt2numba))
    with pytest.raises(AttributeError, match="no attribute 'prefil'"):
        gpt2numba.prefil


def test_a_short_top_level():
    """The top of the package holds rooms, and only a few modules beside them."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_the_walk_finds_a_circle():
    """The search can fail: a circle drawn by hand is found, and named."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_http_in_the_engine():
    source = (PACKAGE / "serve" / "engine.py").read_text()
    assert "starlette" not in source and "uvicorn" not in source
    assert "prometheus" not in source  # the metrics library is the [serve] extra's: metrics.py alone imports it


def test_bench_modules_import_no_private_names_of_each_other():
    for name, path in modules().items():
        if not name.startswith("gpt2numba.bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name} imports {private} from .{node.module or ''}"


def test_peers_and_the_worker_import_nothing_of_gpt2numba():
    """The benchmark's peers run in processes that never import gpt2numba (bench/peers/__init__.py): their
    modules and the worker that loads them import no module of the package, nor the package."""
    known = modules()
    names = [n for n in known if n.startswith("gpt2numba.bench.peers.")] + ["gpt2numba.bench.worker"]
    assert len(names) >= 4  # transformers, CTranslate2, llama.cpp and the worker
    for name in names:
        source = ast.parse(known[name].read_text())
        relative = [n.module for n in ast.walk(source) if isinstance(n, ast.ImportFrom) and n.level]
        assert not relative and not imports(name, known[name], known), f"{name} imports gpt2numba"


def test_module_sizes():
    lines = {name: len(path.read_text().splitlines()) for name, path in modules().items()
             if not name.startswith("gpt2numba.bench")}
    largest = max(lines, key=lines.get)
    assert lines[largest] < MAX_MODULE_LINES, f"{largest}: {lines[largest]} lines"


@pytest.mark.parametrize("room", ["serve", "bench"])
def test_function_sizes(room):
    longest = []
    for path in sorted((PACKAGE / room).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                longest.append((node.end_lineno - node.lineno + 1, f"{path.name}:{node.lineno} {node.name}"))
    size, where = max(longest)
    assert size <= MAX_FUNCTION_LINES, f"{where}: {size} lines"


# What reads the CPU's features: LLVM's and Numba's views of the host (and NUMBA_CPU_FEATURES), the probe of
# dispatch.py, NumPy's table, the platform module's CPU name, /proc/cpuinfo and the cpuinfo package
_CPU_PROBES = {"get_host_cpu_features", "get_host_cpu_name", "get_process_triple", "CPU_FEATURES", "CPU_NAME",
               "x86_features", "__cpu_features__"}


def cpu_reads(source: str) -> list[str]:
    """Where ``source`` reads the CPU's features: the probes above, called or named, by attribute or import,
    a string naming /proc/cpuinfo, an import of the cpuinfo package."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (node.attr in _CPU_PROBES or node.attr == "processor"
                                                and isinstance(node.value, ast.Name) and node.value.id == "platform"):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in _CPU_PROBES:
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found += [f"line {node.lineno}: import {n}" for n in names if n in _CPU_PROBES or n.split(".")[0] == "cpuinfo"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "/proc/cpuinfo" in node.value:
            found.append(f"line {node.lineno}: {node.value[:40]!r}")
    return found


def test_the_cpu_is_read_in_dispatch_only():
    """dispatch.py probes the CPU once and holds every choice made from it; no other module reads the CPU's
    features (pool.py's platform.machine() is the architecture the pool is built for, not a feature)."""
    readers = {name: reads for name, path in modules().items()
               if name != "gpt2numba.cpu.dispatch" and (reads := cpu_reads(path.read_text()))}
    assert not readers, f"modules that read the CPU besides dispatch.py: {readers}"
    assert cpu_reads((PACKAGE / "cpu" / "dispatch.py").read_text())  # the search sees dispatch's own probes


def test_the_search_finds_a_cpu_read():
    """The search can fail: each way of reading the CPU, written by hand, is found."""
    for source in ("from llvmlite import binding\nbinding.get_host_cpu_features()",
                   "from numba.core import config\nfeatures = config.CPU_FEATURES",
                   "from .dispatch import x86_features", "from . import dispatch\ndispatch.x86_features()",
                   "import platform\nplatform.processor()", "open('/proc/cpuinfo').read()", "import cpuinfo",
                   "from numpy._core._multiarray_umath import __cpu_features__"):
        assert cpu_reads(source), source
    assert not cpu_reads("import platform\nplatform.machine()\nfrom .dispatch import ROWS_MAX")
