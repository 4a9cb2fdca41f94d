"""amp's fp32_modules: the named modules run outside autocast (float32 in and out), the island survives the
deepcopy an EMA makes after prepare_model, and a name the model lacks is refused with the name."""

import copy

import pytest
import torch

from med_ddpm.model import INPUT_CONV as FIRST_CONV
from med_ddpm.model import UNet3D
from optim import RecipeConflictError
from optim.amp import Amp


def tiny() -> UNet3D:
    torch.manual_seed(0)
    return UNet3D(in_channels=3, out_channels=1, model_channels=32, channel_mult=(1, 2), attention_ds=(2,)).eval()


def output_dtypes(model: UNet3D, amp: Amp) -> dict[str, torch.dtype]:
    seen = {}
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.dtype))
             for n in (FIRST_CONV, "input_blocks.1.0.in_layers.2")]
    with torch.no_grad(), amp.forward_context():
        model(torch.randn(1, 3, 8, 8, 8), torch.tensor([0]))
    for h in hooks:
        h.remove()
    return seen


def test_the_island_runs_in_float32_and_the_rest_under_autocast():
    plain = Amp("bfloat16")
    assert output_dtypes(plain.prepare_model(tiny()), plain)[FIRST_CONV] == torch.bfloat16
    amp = Amp("bfloat16", fp32_modules=[FIRST_CONV])
    dtypes = output_dtypes(amp.prepare_model(tiny()), amp)
    assert dtypes[FIRST_CONV] == torch.float32 and dtypes["input_blocks.1.0.in_layers.2"] == torch.bfloat16
    assert amp.options()["fp32_modules"] == [FIRST_CONV]


def test_an_ema_copy_keeps_its_own_island():
    amp = Amp("bfloat16", fp32_modules=[FIRST_CONV])
    model = amp.prepare_model(tiny())
    ema = copy.deepcopy(model)
    with torch.no_grad():
        ema.get_submodule(FIRST_CONV).weight.mul_(2)
    x = torch.randn(1, 3, 8, 8, 8)
    with torch.no_grad(), amp.forward_context():
        a, b = model.get_submodule(FIRST_CONV)(x), ema.get_submodule(FIRST_CONV)(x)
    assert a.dtype == b.dtype == torch.float32 and not torch.allclose(a, b)


def test_a_module_the_model_lacks_is_refused_by_name():
    with pytest.raises(RecipeConflictError, match="no module 'input_blocks.9'"):
        Amp("bfloat16", fp32_modules=["input_blocks.9"]).prepare_model(tiny())
