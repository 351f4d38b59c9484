"""Thresholds measured on this machine (gpt2numba tune): the file they live in, read once at import.

dispatch.choose() gives every CPU of a kind the same row thresholds; `gpt2numba tune` measures the
ones a pass reads at call time (TUNABLE) on the CPU it runs on and writes them here, under a key of
the CPU model, its features, the Numba version and the kernels' sources: another CPU, an upgrade or
an edited kernel finds no entry of its own and keeps the defaults. The constants compiled into the
kernels (dispatch.SERIAL_ROWS, ROW_CHUNKS, PREFETCH_BYTES) are not tuned: Numba's cache would serve
kernels compiled with other values.

The file, $XDG_CACHE_HOME/gpt2numba/tuning.json (~/.cache/...), holds one entry per key, so a home
directory shared by machines of several kinds keeps each one's. GPT2NUMBA_TUNING=off (or 0, false,
no, none) ignores it, GPT2NUMBA_TUNING=PATH reads and writes PATH instead. Whatever goes wrong with
the file (unreadable, malformed, an entry out of range, no home directory), the import goes on with
the defaults and a warning naming the file: the defaults are always a working choice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

from ..errors import ConfigError

FORMAT = 1  # the file's layout; another number is a file this version does not read
OFF = ("off", "0", "false", "no", "none")  # GPT2NUMBA_TUNING values that turn the file off

# The thresholds a tuning may set, and the range dispatch accepts for each (rows, inclusive)
TUNABLE = {"rows_max": (1, 64), "bf16_rows_max": (1, 64), "head_rows_max": (1, 64),
           "int_rows_max": (1, 64), "int4_rows_max": (1, 64), "bf16_dot_rows_max": (1, 64)}


class TuningWarning(UserWarning):
    """A tuning file could not be used; the defaults are."""


class Tuning(NamedTuple):
    """What dispatch found: the file looked at (None: tuning off or no file to look at), its values for this CPU
    ({} if none), how the entry was written (its "measured" figures, "written" time, ...), the key looked for,
    and why there are no values when there are none."""

    path: Path | None
    values: dict
    entry: dict
    key: dict
    why_not: str = ""


def path() -> Path | None:
    """The tuning file this process reads and writes, absolute; None when GPT2NUMBA_TUNING is off.
    RuntimeError where there is no home directory to find the default in."""
    setting = os.environ.get("GPT2NUMBA_TUNING", "").strip()
    if setting.lower() in OFF:
        return None
    if setting:
        return Path(setting).expanduser().absolute()
    return cache_home() / "tuning.json"


def cache_home() -> Path:
    """$XDG_CACHE_HOME/gpt2numba (~/.cache/gpt2numba): what this package writes for later processes (the tuning,
    tokenizers' tables). RuntimeError where there is no home directory to find the default in."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"  # (XDG: a relative one is ignored)
    return cache / "gpt2numba"


@contextlib.contextmanager
def replacing(file: Path, mode: str = "wb"):
    """A new file in ``file``'s folder, open for writing (``mode``), renamed over ``file`` when the block ends
    and deleted when it raises: a reader, or a process that maps ``file``, finds it whole or not at all. The
    package writes every file it keeps so (the tuning, the tokenizer's tables, stacked weights)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    part = tempfile.NamedTemporaryFile(mode, dir=file.parent, prefix=file.name, suffix=".partial", delete=False)
    try:
        with part:
            yield part
        os.replace(part.name, file)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(part.name)


def key(cpu: str, features: frozenset[str] | None) -> dict:
    """The machine and code a tuning holds for: the CPU's model and features, Numba, the kernels' sources."""
    import numba

    sources = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        sources.update(source.read_bytes())
    return {"cpu": cpu, "features": None if features is None else sorted(features),
            "numba": numba.__version__, "kernels": sources.hexdigest()[:16]}


def checked(values, where: str) -> dict:
    """values if it is a dict of TUNABLE names to integers in their ranges; else a ValueError naming ``where``."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: the values are not an object")
    for name, value in values.items():
        if name not in TUNABLE:
            raise ValueError(f"{where}: {name!r} is not a threshold gpt2numba tunes")
        low, high = TUNABLE[name]
        if type(value) is not int or not low <= value <= high:
            raise ValueError(f"{where}: {name} must be an integer in [{low}, {high}], got {value!r}")
    return values


def load(machine: dict) -> Tuning:
    """The tuning for ``machine`` (a key()) in the file; no values if there is none, or it is unusable (warned)."""
    file = None
    try:
        file = path()
        if file is None:
            return Tuning(None, {}, {}, machine, "GPT2NUMBA_TUNING=off")
        if not file.exists():
            return Tuning(file, {}, {}, machine, f"no tuning file at {file}")
        entry = next((e for e in _entries(file) if e.get("key") == machine), None)
        if entry is None:  # another machine's, or stale: not an error
            return Tuning(file, {}, {}, machine, f"no tuning for this CPU and code in {file}")
        return Tuning(file, checked(entry.get("values"), "this CPU's entry"), entry, machine)
    except (OSError, ValueError, RuntimeError) as e:
        where = f"the tuning file {file}" if file else "the tuning file"
        warnings.warn(f"ignoring {where}: {e}; the default thresholds apply "
                      "(run `gpt2numba tune` again, or set GPT2NUMBA_TUNING=off)", TuningWarning, stacklevel=2)
        return Tuning(file, {}, {}, machine, f"{where} is unusable: {e}")


def save(machine: dict, values: dict, measured: dict, when: str) -> Path:
    """Write the entry for ``machine``, replacing its old one and keeping other machines' (an exclusive lock
    held from reading the file to replacing it, so two machines tuning at once both keep theirs). The file is
    replaced at once, so a process reading it never sees half of it; a file unusable as it stands is replaced,
    with a warning. ConfigError when GPT2NUMBA_TUNING is off."""
    file = path()
    if file is None:
        raise ConfigError("GPT2NUMBA_TUNING is off: no tuning file to write (unset it, or set it to a path)")
    checked(values, "the measured values")
    file = file.resolve()  # (a link's target is the file replaced, not the link)
    file.parent.mkdir(parents=True, exist_ok=True)
    with _locked(file):
        entries = []
        if file.exists():
            try:
                entries = [e for e in _entries(file) if e.get("key") != machine]
            except (OSError, ValueError) as e:
                warnings.warn(f"replacing the tuning file {file}, which could not be used: {e}", TuningWarning,
                              stacklevel=2)
        entries.append({"key": machine, "values": values, "measured": measured, "written": when})
        mode = file.stat().st_mode & 0o777 if file.exists() else 0o644  # (a temporary file's is 0600)
        with replacing(file, "w") as f:
            json.dump({"gpt2numba_tuning": FORMAT, "entries": entries}, f, indent=1)
            f.flush()
            os.chmod(f.name, mode)
    return file


@contextlib.contextmanager
def _locked(file: Path):
    """An exclusive lock on ``file``'s lock file beside it, where the platform has flock."""
    try:
        import fcntl
    except ImportError:  # (Windows: writers are not serialised)
        yield
        return
    with open(file.with_name(file.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _entries(file: Path) -> list[dict]:
    data = json.loads(file.read_text())  # (a JSONDecodeError is a ValueError)
    if not isinstance(data, dict) or "gpt2numba_tuning" not in data:
        raise ValueError("not a gpt2numba tuning file")
    if data["gpt2numba_tuning"] != FORMAT:
        raise ValueError(f"format {data['gpt2numba_tuning']!r}; this version reads {FORMAT}")
    entries = data.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError("its entries are not a list of objects")
    return entries
