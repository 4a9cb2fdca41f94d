"""Bytecode for the run's commands, as a user's machine has it.

A user's Python reads compiled bytecode: pip compiles a package's modules when it installs it, and the interpreter
writes what is missing at the first import. A fresh GPU image may do neither: torch shipped without ``.pyc`` files
and ``PYTHONDONTWRITEBYTECODE=1`` set, so every process compiles thousands of modules from source (seconds of each
command's start-up that no user pays twice). So before its first job a run gives its commands a bytecode folder of
its own, ``PYTHONPYCACHEPREFIX=<out>/cache/pycache`` (unless the environment names one):

* ``written``: bytecode may be written, so the commands write it there as they import (the first pays, as a user's
  first run does);
* ``compiled``: the environment forbids writing it (``PYTHONDONTWRITEBYTECODE``), so one process compiles, once per
  run folder, every module of the packages the commands import (``compileall``, as pip's install would have), and
  the commands read it;
* ``environment``: ``PYTHONPYCACHEPREFIX`` was set already: left as it is.

:func:`prepare` returns what it did, for every row of the run (``bytecode``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# What the commands import, lazily ones included (MONAI in the workers, inductor and Dynamo in a compiled stack):
# the packages these come from are compiled whole, and every other module they import. With a prefix set, Python
# reads bytecode only there, the standard library's included.
IMPORTED = ("med_ddpm.sample", "med_ddpm.train", "med_ddpm.data.datasets", "bench.worker", "monai.transforms",
            "torch._inductor.compile_fx", "torch._dynamo", "triton")
DONE = ".compiled.json"  # in the prefix: what the compile took, so a rerun in the same folder skips it

COMPILE = """
import compileall, importlib, sys
from pathlib import Path
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # a package this machine lacks (triton on a CPU)
tops = [m.__file__ for n, m in list(sys.modules.items()) if "." not in n and (getattr(m, "__file__", None) or "").endswith(".py")]
for path in sorted(tops):
    if path.endswith("__init__.py"):
        compileall.compile_dir(Path(path).parent, quiet=2, workers=0)
    else:
        compileall.compile_file(path, quiet=2)
print(len(tops))
"""


def prepare(out: Path, modules: tuple[str, ...] = IMPORTED) -> dict[str, Any]:
    """Point the run's commands (this process's children) at a bytecode folder in ``out``; returns the row field."""
    if os.environ.get("PYTHONPYCACHEPREFIX"):
        return {"mode": "environment", "prefix": os.environ["PYTHONPYCACHEPREFIX"]}
    prefix = (out / "cache" / "pycache").resolve()
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return {"mode": "written", "prefix": str(prefix)}
    done = prefix / DONE
    if done.exists():
        return json.loads(done.read_text())
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    found = subprocess.run([sys.executable, "-c", COMPILE, *modules], env=env, capture_output=True, text=True,
                           check=False)
    record = {"mode": "compiled", "prefix": str(prefix), "seconds": round(time.monotonic() - start, 1),
              "packages": int(found.stdout.strip() or 0) if found.returncode == 0 else None}
    print(f"bytecode: compiled {record['packages']} packages and modules into {prefix} in {record['seconds']} s "
          "(PYTHONDONTWRITEBYTECODE is set; the commands read it)")
    prefix.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(record))
    return record
