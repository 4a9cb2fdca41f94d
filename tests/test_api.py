"""The public API the README promises: every name imports from the top-level package."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import med_ddpm

API = {
    "load_checkpoint": "med_ddpm.checkpoint", "save_medddpm_checkpoint": "med_ddpm.checkpoint",
    "UNet3D": "med_ddpm.model", "build_model": "med_ddpm.model",
    "NoiseSchedule": "med_ddpm.diffusion", "diffusion_loss": "med_ddpm.diffusion",
    "Sampler": "med_ddpm.samplers", "DDPMSampler": "med_ddpm.samplers", "DDIMSampler": "med_ddpm.samplers",
    "DPMSolverPPSampler": "med_ddpm.samplers", "DEISSampler": "med_ddpm.samplers",
    "RestartSampler": "med_ddpm.samplers", "SASolverSampler": "med_ddpm.samplers",
    "build_sampler": "med_ddpm.samplers",
}
ALIASES = {"generate": ("med_ddpm.samplers", "sample")}  # API name -> (module, its name there)


@pytest.mark.parametrize("name", sorted(API))
def test_each_name_is_the_implementation(name):
    assert getattr(med_ddpm, name) is getattr(importlib.import_module(API[name]), name)


def test_generate_is_the_sampling_loop():
    module, name = ALIASES["generate"]
    assert med_ddpm.generate is getattr(importlib.import_module(module), name)


def test_all_lists_exactly_the_api_and_every_sampler():
    from med_ddpm.samplers import SAMPLERS

    assert sorted(med_ddpm.__all__) == sorted([*API, *ALIASES])
    assert {cls.__name__ for cls in SAMPLERS.values()} <= set(med_ddpm.__all__)
    assert set(med_ddpm.__all__) <= set(dir(med_ddpm))


@pytest.mark.e2e
def test_from_import_and_attribute_access_in_a_fresh_interpreter():
    code = ("import med_ddpm; med_ddpm.load_checkpoint; "
            "from med_ddpm import UNet3D, NoiseSchedule, DDPMSampler, generate, distributed; "
            "print(UNet3D.__module__, distributed.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["med_ddpm.model", "med_ddpm.distributed"]


def test_the_package_is_a_plain_module_and_sample_is_the_command():
    import types

    from med_ddpm.sample import run  # the `python -m med_ddpm.sample` module, imported as tests and bench do

    assert type(med_ddpm) is types.ModuleType
    assert med_ddpm.sample is sys.modules["med_ddpm.sample"] and med_ddpm.sample.run is run


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'load_checkpiont'"):
        med_ddpm.load_checkpiont  # noqa: B018
