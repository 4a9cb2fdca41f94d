"""``python -m bench.report publish=true``: the evidence pages, each from one run of one GPU folder.

Writes ``<docs>/<gpu>.md`` for each folder of ``gpus`` (:mod:`.gpu_page`), ``<docs>/gpus.md`` with them side by
side (:mod:`.gpus_page`) and the README's results table, from the run of ``readme_gpu``, between its
``<!-- results:begin -->`` and ``<!-- results:end -->`` lines. ``dir=FOLDER publish=true`` writes that folder's
page alone. Each folder's run is chosen (:func:`bench.reporting.evidence.choose_run`) and every page rendered
before the first is written, so a refusal leaves every page as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from bench.reporting.evidence import Run, choose_run, runs_note
from bench.reporting.gpu_page import gpu_page, readme_table
from bench.reporting.gpus_page import gpus_page
from bench.reporting.verdicts import Gates
from med_ddpm.errors import ConfigError, DataError
from med_ddpm.utils import atomic_write_text

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
GPUS_PAGE = "gpus.md"


def replace_block(text: str, block: str, path: Path) -> str:
    """``text`` with what stands between its two markers replaced by ``block``; refused without both, in order."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise DataError(f"{path}: needs one {BEGIN} line, then one {END} line, around its results table; put "
                        "them where the table goes")
    head, rest = text.split(BEGIN)
    return f"{head}{BEGIN}\n{block}{END}{rest.split(END)[1]}"


def choose_runs(folders: Sequence[Path], wanted: Sequence[str]) -> list[Run]:
    """One run per folder (:func:`choose_run`); a ``run=`` id that no folder holds is refused."""
    runs = [choose_run(folder, wanted) for folder in folders]
    unknown = sorted(set(wanted) - {r.run_id for r in runs})
    if unknown:
        raise ConfigError(f"run={','.join(unknown)}: no evidence run of that id in {', '.join(map(str, folders))}; "
                          "pass a run id of their results.jsonl (a row's run_id), or leave run= out for each "
                          "folder's newest complete run")
    return runs


def render(folders: Sequence[Path], docs: Path, readme: Path | None, readme_gpu: str | None,
           wanted: Sequence[str]) -> tuple[list[Run], dict[Path, str]]:
    """The runs and every page's text by path: each folder's page, and with ``readme`` gpus.md and the README."""
    runs = choose_runs(folders, wanted)
    gates = {r.gpu: Gates.read(r.folder) for r in runs}
    pages = {docs / f"{r.folder.name}.md": gpu_page(r, gates[r.gpu], docs) for r in runs}
    if readme is None:
        return runs, pages
    pages[docs / GPUS_PAGE] = gpus_page(runs, gates, docs)
    shown = next((r for r in runs if r.folder.name == readme_gpu), None)
    if shown is None:
        raise ConfigError(f"readme_gpu={readme_gpu}: not a folder of gpus ({', '.join(f.name for f in folders)}); "
                          "pass the name of the folder whose run the README shows")
    if not readme.is_file():
        raise DataError(f"{readme}: not found; pass readme=<the page holding the {BEGIN} markers>")
    table = readme_table(shown, gates[shown.gpu], readme.parent, docs / f"{shown.folder.name}.md")
    pages[readme] = replace_block(readme.read_text(encoding="utf-8"), table, readme)
    return runs, pages


def publish(folders: Sequence[Path], docs: Path, readme: Path | None = None, readme_gpu: str | None = None,
            wanted: Sequence[str] = ()) -> list[str]:
    """Render every page, then write them; returns the lines to print: each folder's run, each page written."""
    runs, pages = render(folders, docs, readme, readme_gpu, wanted)
    for path, text in pages.items():
        atomic_write_text(path, text if text.endswith("\n") else text + "\n")
    return [f"{r.folder}: {runs_note(r)}" for r in runs] + [f"wrote {path}" for path in pages]


def run_ids(value: object) -> list[str]:
    """``run=`` as a list: one id (``run=ID``), a list (``run=[ID1,ID2]``) or none (``run=[]``, ``run=null``)."""
    if value is None:
        return []
    if isinstance(value, ListConfig | list | tuple):
        return [str(v) for v in value]
    return [str(value)]


def from_config(cfg: DictConfig) -> list[str]:
    """``publish=true``: ``dir=FOLDER`` writes that folder's page; without ``dir``, every folder of ``gpus``, gpus.md
    and the README's table."""
    if not cfg.gpus:
        raise ConfigError("gpus: is empty; pass gpus=[bench/results/h100,...], the GPU folders to publish")
    one = not OmegaConf.is_missing(cfg, "dir") and cfg.dir is not None
    folders = [Path(cfg.dir)] if one else [Path(f) for f in cfg.gpus]
    readme = None if one else Path(cfg.readme)
    return publish(folders, Path(cfg.docs), readme, str(cfg.readme_gpu), run_ids(cfg.run))
