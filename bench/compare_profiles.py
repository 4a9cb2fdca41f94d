"""Kernel breakdowns of several profiles side by side: before and after a change, or across rounds.

``bench.profile`` writes one JSON per profiled stack, labelled by its recipes; the same stack
profiled at two commits has the same label. This names each profile on the command line and
writes the category table (one column per profile, plus the change from the first to the last),
each profile's top kernels, and the stacked-bar chart.

Usage:
    python -m bench.compare_profiles out=bench/results/h200/tuning/kernels_before_after \\
        "fp32=bench/results/h200/profile_denoise_step_fp32.json" \\
        "round 5=bench/results/h200/tuning/profile_channels_last_compiled_895b99e/denoise_step_....json"

Writes ``OUT/profile_compare.md`` and ``OUT/profile_compare.png`` atomically.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench import kernels
from med_ddpm.utils import atomic_write_text


def load(named: list[tuple[str, Path]]) -> list[dict]:
    """The profiles, each relabelled ``name`` (its recipes kept as ``stack``); a file that is not a
    profile is an error naming it."""
    profiles = []
    for name, path in named:
        record = kernels.load_profile(path, "bench.compare_profiles")
        profiles.append({**record, "label": name, "stack": record["label"], "file": str(path)})
    return profiles


def change_table(profiles: list[dict]) -> str:
    """Per category: ms/step of the first and last profile and the difference (last - first)."""
    first, last = profiles[0], profiles[-1]
    lines = [f"## Change from {first['label']} to {last['label']}", "",
             "| category | first ms | last ms | change ms |", "|---|---|---|---|"]
    for cat in kernels.CATEGORY_NAMES:
        a, b = first["categories_ms"][cat], last["categories_ms"][cat]
        lines.append(f"| {cat} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
    a, b = first["total_ms"], last["total_ms"]
    lines.append(f"| **total** | **{a:.3f}** | **{b:.3f}** | **{b - a:+.3f}** |")
    return "\n".join(lines) + "\n"


def write(out: Path, profiles: list[dict]) -> Path:
    legend = "".join(f"- **{p['label']}**: `{p['stack']}`, {p['scenario']}, batch {p['batch_size']} (`{p['file']}`)\n"
                     for p in profiles)
    text = (kernels.markdown(profiles) + "\nProfiles:\n" + legend + "\n" + change_table(profiles)
            + "\n![breakdown](profile_compare.png)\n")
    out.mkdir(parents=True, exist_ok=True)
    kernels.stacked_bar_png(profiles, out / "profile_compare.png")
    return atomic_write_text(out / "profile_compare.md", text)


def parse(argv: list[str]) -> tuple[Path, list[tuple[str, Path]]]:
    out, named = None, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key or not value:
            raise SystemExit(f"bench.compare_profiles: bad argument {arg!r}; expected out=DIR and NAME=PROFILE.json")
        if key == "out":
            out = Path(value)
        else:
            named.append((key, Path(value)))
    if out is None or len(named) < 2:
        raise SystemExit("usage: python -m bench.compare_profiles out=DIR NAME=PROFILE.json NAME=PROFILE.json [...]")
    return out, named


def main(argv: list[str]) -> int:
    out, named = parse(argv)
    print(write(out, load(named)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
