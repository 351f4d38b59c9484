"""Thresholds measured on this machine (gpt2numba tune): the file they live in, read once at import.

dispatch.choose() gives every CPU of a kind the same row thresholds; `gpt2numba tune` measures the
ones a pass reads at call time (TUNABLE) on the CPU it runs on and writes them here, under a key of
the CPU model, its features, the Numba version and the kernels' sources: another CPU, an upgrade or
an edited kernel finds no entry of its own and keeps the defaults. The constants compiled into the
kernels (dispatch.SERIAL_ROWS, ROW_CHUNKS, PREFETCH_BYTES) are not tuned: Numba's cache would serve
kernels compiled with other values.

The file, $XDG_CACHE_HOME/gpt2numba/tuning.json (~/.cache/...), holds one entry per key, so a home
directory shared by machines of several kinds keeps each one's. GPT2NUMBA_TUNING=off ignores it,
GPT2NUMBA_TUNING=PATH reads and writes PATH instead. A file that cannot be read or an entry out of
range is ignored with a warning naming the file: the defaults are always a working choice.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

FORMAT = 1  # the file's layout; another number is a file this version does not read

# The thresholds a tuning may set, and the range dispatch accepts for each (rows, inclusive)
TUNABLE = {"rows_max": (1, 64), "bf16_rows_max": (1, 64), "head_rows_max": (1, 64),
           "int_rows_max": (1, 64), "int4_rows_max": (1, 64)}


class TuningWarning(UserWarning):
    """A tuning file could not be used; the defaults are."""


class Tuning(NamedTuple):
    """What dispatch found: the file looked at (None: tuning off), its values for this CPU ({} if none),
    how the entry was written (its "measured" figures, "written" time, ...) and the key looked for."""

    path: Path | None
    values: dict
    entry: dict
    key: dict


def path() -> Path | None:
    """The tuning file this process reads and writes; None when GPT2NUMBA_TUNING=off."""
    setting = os.environ.get("GPT2NUMBA_TUNING", "")
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "gpt2numba" / "tuning.json"


def key(cpu: str, features: frozenset[str] | None) -> dict:
    """The machine and code a tuning holds for: the CPU's model and features, Numba, the kernels' sources."""
    import numba

    sources = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        sources.update(source.read_bytes())
    return {"cpu": cpu, "features": None if features is None else sorted(features),
            "numba": numba.__version__, "kernels": sources.hexdigest()[:16]}


def checked(values, where: str) -> dict:
    """values if it is a dict of TUNABLE names to integers in their ranges; else TuningWarning's message in a
    ValueError naming ``where``."""
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
    file = path()
    if file is None or not file.exists():
        return Tuning(file, {}, {}, machine)
    try:
        entries = _entries(file)
        entry = next((e for e in entries if e.get("key") == machine), None)
        if entry is None:
            return Tuning(file, {}, {}, machine)  # another machine's, or stale: not an error
        return Tuning(file, checked(entry.get("values"), "this CPU's entry"), entry, machine)
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring the tuning file {file}: {e}; the default thresholds apply "
                      "(run `gpt2numba tune` again, or set GPT2NUMBA_TUNING=off)", TuningWarning, stacklevel=2)
        return Tuning(file, {}, {}, machine)


def save(machine: dict, values: dict, measured: dict, when: str) -> Path:
    """Write the entry for ``machine`` (replacing its old one, keeping other machines'); the file replaced at once,
    so a process reading it never sees half of it. A file unusable as it stands is replaced."""
    file = path()
    if file is None:
        raise ValueError("GPT2NUMBA_TUNING=off: no tuning file to write (unset it, or set it to a path)")
    checked(values, "the measured values")
    try:
        entries = [e for e in _entries(file) if e.get("key") != machine] if file.exists() else []
    except (OSError, ValueError):
        entries = []
    entries.append({"key": machine, "values": values, "measured": measured, "written": when})
    file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=file.parent, prefix=".tuning-", suffix=".json", delete=False) as f:
        try:
            json.dump({"gpt2numba_tuning": FORMAT, "entries": entries}, f, indent=1)
            f.close()
            os.replace(f.name, file)
        except BaseException:
            os.unlink(f.name)
            raise
    return file


def _entries(file: Path) -> list[dict]:
    data = json.loads(file.read_text())  # (a JSONDecodeError is a ValueError)
    if not isinstance(data, dict) or data.get("gpt2numba_tuning") != FORMAT:
        raise ValueError(f"not a gpt2numba tuning file of format {FORMAT}")
    entries = data.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError("its entries are not a list of objects")
    return entries
