"""Documents from files, as the score command reads them: a whole file, one a line, or JSON lines with
the text in a field. The in-process command and the Ray one (distributed.py) split files the same way."""

from __future__ import annotations

import json
import sys

from ..errors import GPT2NumbaError


def split(data: bytes, source: str, lines: bool = False, field: str | None = None):
    """(source, index, text) of each document in one file's bytes, in order.

    Without ``lines`` or ``field`` the whole file is one document (index 0); with ``lines`` each line is one,
    with ``field`` each line is a JSON object whose ``field`` holds the text. Blank lines (whitespace only) are
    no documents, as generate's --prompts-file skips them: a document's index is its place among the file's
    documents, from 0, in both. GPT2NumbaError naming the source and line for bytes that are not UTF-8 or a
    line that is not the JSON asked for.
    """
    if field is None and not lines:
        yield source, 0, utf8(data, source, 1)
        return
    index = 0
    for n, line in enumerate(data.split(b"\n")[: -1 if data.endswith(b"\n") else None]):
        text = utf8(line, source, n + 1)
        if not text.strip():
            continue
        if field is not None:
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise GPT2NumbaError(f"{source}, line {n + 1}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise GPT2NumbaError(f'{source}, line {n + 1}: no string field "{field}"')
            text = record[field]
        yield source, index, text
        index += 1


def read(name: str) -> bytes:
    """The bytes of the file ``name`` ("-": stdin), opened by the name as typed, so that an OSError names it so
    (pathlib's would say "corpus.txt" for "./corpus.txt")."""
    if name == "-":
        return sys.stdin.buffer.read()
    with open(name, "rb") as f:
        return f.read()


def field_of(name: str, field: str | None) -> str | None:
    """The JSON field to read from the file ``name``: ``field`` if given, "text" for a .jsonl file, else None."""
    return field or ("text" if name.endswith(".jsonl") else None)


def utf8(data: bytes, source: str, line: int) -> str:
    """``data`` decoded, or GPT2NumbaError naming the source and the line (``line``: where ``data`` starts)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line + data[: e.start].count(b"\n")
        raise GPT2NumbaError(f"{source}, line {at}: bytes that are not UTF-8 ({e.reason})") from None
