"""The golden reference in tests/data/reference is the file its README names: every file's sha256 and size
match the README's table, and nothing in the folder is left out of it, so a damaged or replaced copy fails here
by name rather than as a parity mismatch."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROW = re.compile(r"^\| `([^`]+)` \| ([\d,]+) \| `([0-9a-f]{64})` \|$", re.MULTILINE)


def listed(folder: Path) -> dict[str, tuple[int, str]]:
    """{file: (bytes, sha256)} from the README's table."""
    return {name: (int(size.replace(",", "")), digest)
            for name, size, digest in ROW.findall((folder / "README.md").read_text(encoding="utf-8"))}


def test_every_reference_file_has_its_listed_sha256(reference_dir):
    table = listed(reference_dir)
    assert sorted(table) == sorted(p.name for p in reference_dir.iterdir() if p.name != "README.md")
    for name, (size, digest) in table.items():
        data = (reference_dir / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size, digest), f"{reference_dir / name} is damaged"


def test_a_damaged_copy_is_named(reference_dir, tmp_path):
    for path in reference_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    damaged = tmp_path / "wholehead_small_ref.pt"
    data = damaged.read_bytes()
    damaged.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # one bit
    try:
        test_every_reference_file_has_its_listed_sha256(tmp_path)
    except AssertionError as err:
        assert str(err).startswith(f"{damaged} is damaged"), err
    else:
        raise AssertionError("a damaged reference file passed")
