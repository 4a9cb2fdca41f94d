"""``python -m bench.compact FILE...``: rewrite results files (``results.jsonl``, ``counters.jsonl``) with every row
in its shortest line, whole or as its difference from an earlier row (:mod:`bench.core.row_lines`).

The rows read back as before, each at its line number; a line cut short or blank stays as it is. Run it on a file
holding rows written whole (by older code, or appended from elsewhere). Each file is replaced atomically.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.core.row_lines import compacted
from med_ddpm.config_checks import DataError
from med_ddpm.utils import atomic_write_text


def main(argv: list[str]) -> int:
    if not argv or any(arg.startswith("-") for arg in argv):
        print("usage: python -m bench.compact FILE...", file=sys.stderr)
        return 2
    for path in map(Path, argv):
        try:
            before, text = path.stat().st_size, compacted(path)
        except (OSError, DataError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        atomic_write_text(path, text)
        print(f"{path}: {before} -> {len(text.encode())} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
