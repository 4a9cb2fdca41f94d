"""The processes that only read volumes import MONAI without the optional packages it would load and never use:
sample's masks' worker, its writers and the process that builds training's dataset. A fake ``transformers`` on the
path records each process that imports it: MONAI's own import does, those processes do not, and their items are
the ones read without them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from med_ddpm.data.datasets import MONAI_EXTRAS_UNUSED

ROOT = Path(__file__).resolve().parents[2]

FAKE_EXTRA = """
import os
with open(os.environ["EXTRA_IMPORTS"], "a") as log:
    log.write(f"{os.getpid()}\\n")
raise ImportError("a fake optional package: MONAI takes it for not installed")
"""

SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import torch
    from omegaconf import OmegaConf
    from med_ddpm.data.background import DatasetBuild
    from med_ddpm.data.phantoms import write_phantom_niftis
    from med_ddpm.sample import BackgroundWriter, MaskConditions, prepared_masks

    def imported():
        log = Path(os.environ["EXTRA_IMPORTS"])
        return log.read_text().split() if log.exists() else []

    root = Path(sys.argv[1])
    write_phantom_niftis(root, 2, (16, 16, 16))
    cfg = OmegaConf.create({"masks": str(root / "mask"), "seed": 0, "data": {}, "model": {"image_size": [16] * 3}})
    _, name, cond, _ = next(prepared_masks(MaskConditions(cfg, "whole_head", [16] * 3, "crop_or_pad", [1, 2]), 1))
    data = {"name": "whole_head", "root": str(root), "cache": "memory", "intensity": "volume_minmax",
            "resize_mode": "crop_or_pad"}
    items = DatasetBuild(data, (16, 16, 16)).result()
    writer = BackgroundWriter(workers=1)
    writer.submit(exec, "import monai.transforms")
    writer.close()
    assert "monai" not in sys.modules, "this process never imported MONAI"
    print("workers", len(imported()))
    import monai.transforms
    from med_ddpm.data.datasets import load_condition
    assert torch.equal(cond, load_condition(root / "mask" / f"{name}.nii.gz", "whole_head", [16] * 3)[0])
    assert torch.equal(items[0]["cond"], cond) and name == items[0]["name"]
    print("monai", "tried" if str(os.getpid()) in imported() else "not tried")
""")


def test_the_volume_readers_import_monai_without_its_unused_extras_and_read_the_same_items(tmp_path):
    assert "transformers" in MONAI_EXTRAS_UNUSED
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_EXTRA)
    env = {**os.environ, "EXTRA_IMPORTS": str(tmp_path / "imports.log"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "data")], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["workers", "0", "monai", "tried"], done.stdout
