"""``python -m bench.stamp`` (``make stamp``): record git's commit in ``.provenance.json`` for a copy of this tree
without ``.git`` (a GPU machine), so that every row measured there carries the commit (:mod:`bench.core.records`).
"""

from __future__ import annotations

import sys

from bench.core.records import STAMP_FILE, write_stamp


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python -m bench.stamp", file=sys.stderr)
        return 2
    stamp = write_stamp()
    print(f"{STAMP_FILE.name}: {stamp['git_sha'][:12]}{' (dirty)' if stamp['dirty'] else ''}, "
          f"{len(stamp['files'])} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
