"""Every command shown in README.md and docs/**/*.md works as written.

The commands are the lines of the fenced code blocks (bash, sh, shell, console or no language) that run
``make``, ``python -m``, ``.venv/bin/python -m``, ``torchrun ... -m`` or a console script (``med-ddpm-train``, the
module pyproject.toml names). Each is checked without running it:

* a module with ``@hydra.main`` (``med_ddpm.train``, ``med_ddpm.sample``, ``bench.sweep`` ...) is composed
  in-process with the command's overrides, every job of a multirun sweep (``-m 'recipe=[],[tf32]'``) apart,
  so an unknown key, group option or a key missing from the selected data config fails here;
* ``make TARGET`` must exist in the Makefile (``make -n``, which runs nothing), and the project commands its
  recipe would run are checked in turn;
* any other module must exist and, where it has ``parse_args``, accept the arguments (a ``preset=`` must be
  one of its ``PRESETS``).

Placeholders (``DIR``, ``CKPT``) stay strings: composing a config opens no file. A search-path folder that an
earlier command on the page writes is stood in (:func:`stand_in_search_path`).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import shutil
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from med_ddpm.samplers import make_timesteps
from med_ddpm.samplers.search import sampler_snippet

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
HYDRA_MAIN = re.compile(r'@hydra\.main\([^)]*config_name="([^"]+)"')
PYTHONS = re.compile(r"^(\S*/)?python(3(\.\d+)?)?$")
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
HYDRA_FLAGS = {"-m", "--multirun", "--resolve", "--help", "-h", "--hydra-help"}
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i"}
SCRIPTS = {name: target.partition(":")[0]
           for name, target in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"].items()}
SCRIPT_PREFIX = "med-ddpm-"  # a command so named is checked, so a misspelt or dropped script fails


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str
    argv: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def shell_lines(markdown: str):
    """(line number, logical line) of every shell code block, backslash continuations joined."""
    for block in FENCE.finditer(markdown):
        if block.group(1).strip().lower() not in SHELL_LANGS:
            continue
        first = markdown.count("\n", 0, block.start(2)) + 1
        pending, start = "", first
        for offset, raw in enumerate(block.group(2).splitlines()):
            if not pending:
                start = first + offset
            line = raw.removeprefix("$ ")
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            yield start, pending + line
            pending = ""


def commands_in(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at ``&&``, ``||``, ``;`` and ``|``), comments dropped."""
    out, current = [], []
    for token in shlex.split(line, comments=True):
        if token in ("&&", "||", ";", "|"):
            out.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in [*out, current] if c]


def without_env(argv) -> list[str]:
    """The command after its leading ``VAR=value`` assignments."""
    argv = list(argv)
    while argv and ENV_ASSIGN.match(argv[0]):
        argv = argv[1:]
    return argv


def is_project_command(argv: list[str]) -> bool:
    argv = without_env(argv)
    if not argv:
        return False
    if argv[0] == "make" or argv[0].startswith(SCRIPT_PREFIX):
        return True
    return (bool(PYTHONS.match(argv[0])) or argv[0] == "torchrun") and "-m" in argv


def collect() -> list[Command]:
    found = []
    for page in PAGES:
        rel = page.relative_to(ROOT).as_posix()
        for number, line in shell_lines(page.read_text()):
            for argv in commands_in(line):
                if is_project_command(argv):
                    found.append(Command(rel, number, line.strip(), tuple(argv)))
    return found


COMMANDS = collect()


def as_param(command: Command):
    return pytest.param(command, id=command.id)


def split_module(argv: tuple[str, ...]) -> tuple[str, list[str]]:
    """``python -m MOD ARGS``, ``torchrun [OPTS] -m MOD ARGS`` or ``SCRIPT ARGS`` -> (MOD, ARGS)."""
    script, *args = without_env(argv)
    if script.startswith(SCRIPT_PREFIX):
        assert script in SCRIPTS, f"{script}: not a console script of pyproject.toml ({', '.join(SCRIPTS)})"
        return SCRIPTS[script], args
    at = argv.index("-m")
    return argv[at + 1], list(argv[at + 2:])


def hydra_config_name(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"no module {module}"
    match = HYDRA_MAIN.search(Path(spec.origin).read_text())
    return match.group(1) if match else None


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The job override lists of a multirun sweep (one list for a plain run)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def hydra_overrides(args: list[str]) -> list[str]:
    """The overrides of a Hydra command line, without Hydra's own flags (``-m``, ``--cfg job`` ...)."""
    overrides, skip = [], False
    for arg in args:
        if skip or arg in HYDRA_FLAGS:
            skip = False
        elif arg in HYDRA_FLAGS_WITH_VALUE:
            skip = True
        else:
            overrides.append(arg)
    return overrides


def has_submitit() -> bool:
    try:
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:
        return False


def without_slurm_launcher(overrides: list[str]) -> list[str]:
    """Without the submitit plugin (the ``sweep`` extra) Hydra cannot load the Slurm launcher: check that each
    ``hydra.launcher.<key>`` is a key of ``configs/hydra/launcher/slurm.yaml`` and compose the rest."""
    keys = OmegaConf.load(CONFIGS / "hydra" / "launcher" / "slurm.yaml")
    rest = []
    for override in overrides:
        key = override.partition("=")[0]
        if key.startswith("hydra.launcher."):
            assert key.removeprefix("hydra.launcher.") in keys, f"{key} is not in configs/hydra/launcher/slurm.yaml"
        elif key != "hydra/launcher":
            rest.append(override)
    return rest


def stand_in_search_path(overrides: list[str], folder: Path) -> list[str]:
    """A ``hydra.searchpath=[file://DIR]`` whose DIR does not exist is a folder an earlier command on the page
    writes: ``med_ddpm.step_search``'s output_dir, whose ``sampler/`` holds the searched grids. Stand it in with
    ``folder`` holding the sampler config that command writes for the selected ``sampler=`` and ``sampler.steps=``."""
    options = dict(o.split("=", 1) for o in overrides if "=" in o)
    search_path = options.get("hydra.searchpath", "")
    if not search_path or Path(search_path.strip("[]").removeprefix("file://")).exists():
        return overrides
    steps = int(options["sampler.steps"])
    grid = make_timesteps(250, steps, "trailing").tolist()
    (folder / "sampler").mkdir(parents=True, exist_ok=True)
    (folder / "sampler" / f"{options['sampler']}.yaml").write_text(sampler_snippet(grid, 2, "a stand-in", 0.0, 0.0))
    return [f"hydra.searchpath=[file://{folder}]" if o.startswith("hydra.searchpath=") else o for o in overrides]


def check_hydra(config_name: str, args: list[str]) -> int:
    overrides = hydra_overrides(args)
    if "hydra/launcher=slurm" in overrides and not has_submitit():
        overrides = without_slurm_launcher(overrides)
    with tempfile.TemporaryDirectory() as folder:
        jobs = sweep_jobs(stand_in_search_path(overrides, Path(folder)))
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            for job in jobs:
                compose(config_name=config_name, overrides=job, return_hydra_config=True)
    return len(jobs)


def check_module(module: str, args: list[str]) -> None:
    mod = importlib.import_module(module)
    if hasattr(mod, "parse_args"):
        parsed = mod.parse_args(args)
        preset = parsed.get("preset") if isinstance(parsed, dict) else getattr(parsed, "preset", None)
        if preset is not None and hasattr(mod, "PRESETS"):
            assert preset in mod.PRESETS, f"{module}: unknown preset {preset!r}"


def check_make(argv) -> list[list[str]]:
    """``make -n`` (print, run nothing) with the command's targets, variables and leading assignments; returns
    the project commands the recipe would run, so they are checked as well."""
    argv = list(argv)
    make_args = [*without_env(argv)[1:], *argv[:len(argv) - len(without_env(argv))]]
    done = subprocess.run(["make", "-n", *make_args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"make -n {' '.join(make_args)}: {done.stderr.strip()}"
    recipe = []
    for line in done.stdout.splitlines():
        try:
            recipe += [a for a in commands_in(line) if is_project_command(a) and without_env(a)[0] != "make"]
        except ValueError:  # shell syntax shlex does not read (braces, here-docs): not a project command
            continue
    return recipe


def check_python(argv) -> None:
    """A ``python -m``, ``torchrun -m`` or console-script command: compose it (Hydra) or parse its arguments."""
    module, args = split_module(tuple(argv))
    config_name = hydra_config_name(module)
    if config_name is None:
        check_module(module, args)
    else:
        assert check_hydra(config_name, args) >= 1


@pytest.mark.parametrize("command", [as_param(c) for c in COMMANDS])
def test_command_works_as_written(command: Command):
    if without_env(command.argv)[0] != "make":
        check_python(command.argv)
        return
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for argv in check_make(command.argv):
        check_python(argv)


def test_readme_shows_the_quick_start():
    """The README's quick start covers set-up, train, sample, evaluate and bench, in a fresh shell."""
    readme = [c for c in COMMANDS if c.page == "README.md"]
    shown = {split_module(c.argv)[0] if "-m" in c.argv or c.argv[0] in SCRIPTS else " ".join(without_env(c.argv))
             for c in readme}
    assert {"make demo", "make test", "med_ddpm.train", "med_ddpm.sample", "med_ddpm.evaluate"} <= shown
    assert any(m.startswith("bench.") for m in shown)
    pythons = {without_env(c.argv)[0] for c in readme if PYTHONS.match(without_env(c.argv)[0])}
    text = (ROOT / "README.md").read_text()
    assert pythons <= {".venv/bin/python"} or "source .venv/bin/activate" in text, pythons
    assert len(text.encode()) <= 10_000


def test_extraction_finds_every_kind_of_command():
    """The parser keeps continuations, sweeps, env prefixes and torchrun, and drops comments and other tools."""
    page = """
```bash
PY=python3.12 make test   # comment
.venv/bin/python -m bench.sweep -m 'recipe=[],[tf32]' \\
  bench=train_step
torchrun --standalone --nproc_per_node=2 -m med_ddpm.train train.max_steps=1
med-ddpm-sweep -m 'recipe=[],[tf32]'
ls results/  # not ours
```
```yaml
python -m not.a.shell.block
```
"""
    lines = list(shell_lines(page))
    argvs = [a for _, line in lines for a in commands_in(line) if is_project_command(a)]
    assert argvs == [["PY=python3.12", "make", "test"],
                     [".venv/bin/python", "-m", "bench.sweep", "-m", "recipe=[],[tf32]", "bench=train_step"],
                     ["torchrun", "--standalone", "--nproc_per_node=2", "-m", "med_ddpm.train", "train.max_steps=1"],
                     ["med-ddpm-sweep", "-m", "recipe=[],[tf32]"]]
    assert split_module(tuple(argvs[-1])) == ("bench.sweep", ["-m", "recipe=[],[tf32]"])
    assert [n for n, _ in lines][:2] == [3, 4]
    assert hydra_overrides(["-m", "a=1", "--cfg", "job", "b=[x,y]"]) == ["a=1", "b=[x,y]"]
    assert sweep_jobs(["recipe=[],[tf32]", "bench=train_step"]) == [["recipe=[]", "bench=train_step"],
                                                                      ["recipe=[tf32]", "bench=train_step"]]


def test_a_stale_command_fails():
    """The checks can fail: a key the config lacks, an unknown group option, a missing make target."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        check_hydra("train", ["experiment=smoke", "data.no_such_key=1"])
    with pytest.raises(ConfigCompositionException):
        check_hydra("train", ["recipe=[no_such_recipe]"])
    with pytest.raises(AssertionError, match="hydra.launcher.no_such_key"):
        without_slurm_launcher(["hydra/launcher=slurm", "hydra.launcher.no_such_key=1"])
    with pytest.raises(AssertionError, match="med-ddpm-trian: not a console script"):
        check_python(("med-ddpm-trian", "experiment=smoke"))
    if shutil.which("make"):
        with pytest.raises(AssertionError, match="no_such_target"):
            check_make(("make", "no_such_target"))
