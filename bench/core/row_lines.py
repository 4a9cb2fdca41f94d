"""How a results.jsonl line holds its row: whole, or as what differs from an earlier row of the same file.

The rows of one file repeat most of themselves: a job's resolved config, its stack's ``describe()`` and its
``env`` are near-identical across a run and from one run to the next. So a row may be stored as a *difference
line*, one JSON object::

    {"like": "<digest of an earlier row>", "set": {"<pointer>": value, ...}, "unset": ["<pointer>", ...]}

The row is the earlier row whose :func:`digest` is ``like`` (the first one, of the lines above it), with each
``set`` pointer given its value and each ``unset`` pointer removed (``unset`` is left out when empty). A pointer is
an RFC 6901 JSON pointer into nested objects (``/config/bench/scenario``; ``~1`` is a ``/`` of a key, ``~0`` a
``~``); a list is always set whole. ``set`` always holds ``/run_id`` when the row has one, so every line of a run
names it. Rebuilt rows have their keys sorted at every level, as a whole row's line has them.

A difference line is written only against a row already in the file: rows are appended, never changed, so the row
it names stays above it, whoever appends after. :func:`line_for` picks the shortest of the row whole and its
difference from each earlier row; a whole row is valid anywhere in a file. :func:`numbered_rows` reads a file: a
line cut short (a writer killed mid-line) is skipped and named; a line holding no row, or like a row no line above
holds (its line removed by hand), is refused. To drop rows, write the rows kept whole, then ``python -m
bench.compact`` the file (:func:`compacted`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from med_ddpm.config_checks import DataError

LIKE, SET, UNSET = "like", "set", "unset"
DIGEST_CHARS = 16  # hex digits of sha256: 64 bits, no collision among any file's rows


class StoredRowError(ValueError):
    """A difference line that names no earlier row, or a pointer its row does not hold."""


def canonical(row: Any) -> str:
    """The row as a whole row's line holds it: keys sorted at every level."""
    return json.dumps(row, sort_keys=True)


def digest(row: Mapping[str, Any]) -> str:
    """The name a difference line gives ``row``: a sha256 of its canonical text."""
    return hashlib.sha256(canonical(row).encode()).hexdigest()[:DIGEST_CHARS]


def same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` write the same JSON (``1``, ``1.0`` and ``true`` differ; NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b or (a != a and b != b)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _unescape(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def difference(base: Mapping[str, Any], row: Mapping[str, Any], at: str = "") -> tuple[dict[str, Any], list[str]]:
    """(``set``, ``unset``) that make ``base`` into ``row``: descends into objects both hold; sets anything else whole."""
    put: dict[str, Any] = {}
    gone = [at + "/" + _escape(key) for key in base if key not in row]
    for key, value in row.items():
        pointer, old = at + "/" + _escape(key), base.get(key)
        if key in base and isinstance(old, dict) and isinstance(value, dict):
            deeper, deeper_gone = difference(old, value, pointer)
            put.update(deeper)
            gone += deeper_gone
        elif key not in base or not same(old, value):
            put[pointer] = value
    return put, gone


def difference_line(base: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` as a difference line from ``base``."""
    put, gone = difference(base, row)
    if row.get("run_id") is not None:
        put = {"/run_id": row["run_id"], **put}
    return {LIKE: digest(base), SET: put, **({UNSET: gone} if gone else {})}


def line_for(row: Mapping[str, Any], earlier: Iterable[Mapping[str, Any]]) -> str:
    """The shortest line holding ``row``: whole, or its difference from one of the ``earlier`` rows of its file (the
    latest of equally short ones)."""
    best = canonical(row)
    for base in reversed(list(earlier)):
        line = canonical(difference_line(base, row))
        best = line if len(line) < len(best) else best
    return best


def is_difference(stored: Mapping[str, Any]) -> bool:
    """Whether a line's object is a difference line (no row has a ``like`` field)."""
    return LIKE in stored and stored.keys() <= {LIKE, SET, UNSET}


def _parent(row: dict[str, Any], pointer: str) -> tuple[dict[str, Any], str]:
    """The object holding ``pointer``'s last key, and that key."""
    *path, last = [_unescape(part) for part in pointer.split("/")[1:]] or [""]
    node: Any = row
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    if not pointer.startswith("/") or not isinstance(node, dict):
        raise StoredRowError(f"pointer {pointer!r} is not in the row it is like")
    return node, last


def restore(stored: dict[str, Any], earlier: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The row a line's object holds; ``earlier``: the file's rows above it, by :func:`digest`."""
    if not is_difference(stored):
        return stored
    base = earlier.get(stored[LIKE])
    if base is None:
        raise StoredRowError(f"stored as a difference from row {stored[LIKE]}, which no line above it holds")
    row = json.loads(canonical(base))
    for pointer in stored.get(UNSET, []):
        node, key = _parent(row, pointer)
        if key not in node:
            raise StoredRowError(f"pointer {pointer!r} is not in the row it is like")
        del node[key]
    for pointer, value in stored.get(SET, {}).items():
        node, key = _parent(row, pointer)
        node[key] = value
    return json.loads(canonical(row))


LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")


def cut_short(err: ValueError) -> bool:
    """Whether a line that is no JSON row is a row whose writer was killed mid-line: the text ends before the row
    does (inside a string, a number or a literal, or between two tokens)."""
    if not isinstance(err, json.JSONDecodeError) or err.msg.startswith("Extra data"):
        return False  # not UTF-8 (rows are written in ASCII), or text after a whole row
    rest = err.doc[err.pos:].strip()
    return (err.msg.startswith("Unterminated string") or re.fullmatch(r"[-+.eE0-9]*", rest) is not None
            or any(word.startswith(rest) for word in LITERALS))


def numbered_rows(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """(line number, row) of each row of the file ``path``, and ``<file name>:<line>`` of each line cut short; any
    other line that holds no row is refused in one line naming it."""
    rows: list[tuple[int, dict[str, Any]]] = []
    cut: list[str] = []
    earlier: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            stored = json.loads(line)
        except ValueError as err:  # not JSON, or not UTF-8
            if not cut_short(err):
                raise DataError(f"{path}:{n}: not a results row ({err}); each line is one JSON row: repair or "
                                f"remove line {n}") from err
            cut.append(f"{path.name}:{n}")
            continue
        try:
            row = restore(stored, earlier)
        except StoredRowError as err:
            raise DataError(f"{path}:{n}: {err}; put back the line that held it (git has it)") from err
        earlier.setdefault(digest(row), row)
        rows.append((n, row))
    return rows, cut


def compacted(path: Path) -> str:
    """The text of the file ``path`` with each row's line written afresh by :func:`line_for`: every row keeps its line
    number, and a line cut short or blank stays as it is."""
    rows, _ = numbered_rows(path)
    lines = [line.decode("utf-8") for line in path.read_bytes().splitlines()]  # as numbered_rows splits them
    for i, (n, row) in enumerate(rows):
        lines[n - 1] = line_for(row, [above for _, above in rows[:i]])
    return "".join(line + "\n" for line in lines)
