"""Which K timesteps should a stochastic sampler visit on a given checkpoint? An Align-Your-Steps search.

Align Your Steps (Sabour et al. 2024) picks the grid t_0 > ... > t_{K−1} that minimises a KL upper bound
(KLUB) between the reverse SDE and its discretisation with x̂₀ frozen over each step (the first-order
stochastic solver, SDE-DPM-Solver-1). For the VP SDE in λ = log α − log σ, Girsanov's theorem with the
drift error g²·α·δ/σ² and g² = −2σ²·dλ/dt gives

    KLUB(grid) = Σ_k ∫_{λ(t_k)}^{λ(t_{k+1})} e^{2λ} · E‖x̂₀(x_λ, λ) − x̂₀(x_{t_k}, t_k)‖² dλ        (AYS, Thm. 3.1)

with, as in AYS, x_λ and x_{t_k} the same data x₀ noised with the same ε. On the trained discrete schedule
the integral is a sum over the training steps t' ∈ [t_{k+1}, t_k), each weighted by
w_{t'} = e^{2λ_{t'}}·(λ_{t'} − λ_{t'+1}); the last grid point covers t' ∈ [0, t_{K−1}). So the bound needs only
M[a, b] = E‖x̂₀(a) − x̂₀(b)‖² (mean over voxels and samples) for all training steps a, b: T model calls per
batch of data. Given M the best grid is an exact shortest path, found by dynamic programming over
(k, t_k) in O(K·T²), with t_0 = T − 1 where x_T ~ N(0, I) lives (AYS refines continuous times iteratively
instead; here the times are the T training steps, so the search is exhaustive).

x₀ are the first ``n`` volumes of the ``data`` config: held-out phantoms by default (the quality model's data),
the user's own scans with ``data=whole_head data.root=DATA`` (the bound is an expectation over the data the
sampler will meet, so a model trained on real heads should be searched on real heads). x̂₀ is clipped to
[−1, 1] as the samplers do, and each forward runs inside the ``recipe`` stack.

The commands that run it on a checkpoint and data: :mod:`med_ddpm.step_search`, :mod:`med_ddpm.tune`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from med_ddpm.checkpoint import Loaded
from med_ddpm.config_checks import ConfigError, DataError
from med_ddpm.data.datasets import build_dataset
from med_ddpm.data.masks import sampling_geometry
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers.base import SPACINGS, make_timesteps, model_input
from optim import RecipeStack

Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]  # (x0, cond), on the model's device and in its layout
GRAM_CHUNK = 1 << 18  # voxels per float64 slice of the x̂₀ rows: T x 2 MiB at a time


def log_snr_weights(schedule: NoiseSchedule) -> np.ndarray:
    """w_{t'} = e^{2λ_{t'}}·(λ_{t'} − λ_{t'+1}): the KLUB integral's share of training step t' (0 for t' = T−1,
    which no interval reaches)."""
    abar = schedule.alphas_cumprod.detach().double().cpu().numpy()
    lam = 0.5 * (np.log(abar) - np.log1p(-abar))
    w = np.zeros_like(lam)
    w[:-1] = np.exp(2 * lam[:-1]) * (lam[:-1] - lam[1:])
    return w


@torch.no_grad()
def denoised_distances(model: Model, schedule: NoiseSchedule, batches: Iterable[Batch], generator: torch.Generator,
                       progress: bool = False) -> np.ndarray:
    """M[a, b] = mean over voxels and samples of (x̂₀(x_a, a) − x̂₀(x_b, b))², x_t = α_t·x₀ + σ_t·ε with one ε
    per sample shared by every t (T model calls per batch).

    M = diag + diagᵀ − 2·G with the Gram matrix G of the flattened x̂₀ rows, accumulated in float64 (nearby t
    differ little, so float32 would cancel away the distances), a slice of voxels at a time."""
    T = schedule.num_train_timesteps
    gram, voxels = torch.zeros(T, T, dtype=torch.float64), 0
    for x0, cond in batches:
        eps = torch.randn(x0.shape, generator=generator).to(x0.device)
        rows = []
        for t in tqdm(range(T), desc="x̂0 at every t", disable=not progress, leave=False):
            tb = torch.full((x0.shape[0],), t, device=x0.device, dtype=torch.long)
            x_t = schedule.add_noise(x0, eps, tb)
            pred = model(model_input(x_t, cond), tb).float()
            rows.append(schedule.predict_x0(x_t, tb, pred).clamp(-1.0, 1.0).flatten())
        d = torch.stack(rows)
        for start in range(0, d.shape[1], GRAM_CHUNK):
            chunk = d[:, start:start + GRAM_CHUNK].double()
            gram += (chunk @ chunk.T).cpu()
        voxels += d.shape[1]
    gram /= voxels
    diag = gram.diagonal()
    return (diag[:, None] + diag[None, :] - 2 * gram).clamp_min(0).numpy()


def interval_costs(distances: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """S[a, b] = Σ_{t'=b}^{a−1} w_{t'}·M[t', a]: the bound's term for a step from grid point a to grid point b < a
    (x̂₀ frozen at a over the training steps it skips). Zero for b ≥ a."""
    T = len(weights)
    cum = np.vstack([np.zeros(T), np.cumsum(weights[:, None] * distances, axis=0)])  # cum[j, a] = Σ_{t'<j}
    s = np.diagonal(cum)[:T][:, None] - cum[:T].T
    return np.tril(s, k=-1)


def optimal_grid(costs: np.ndarray, steps: int) -> list[int]:
    """The ``steps`` strictly decreasing timesteps from T − 1 that minimise the bound (:func:`kl_bound`),
    exactly: dynamic programming over (position k, timestep), last point covering [0, t_{K−1})."""
    T = len(costs)
    if not 1 <= steps <= T:
        raise ValueError(f"steps={steps}: must be in [1, {T}]")
    to_go = costs[:, 0].copy()  # the last point at t: it covers the training steps below t
    choice = []
    for k in range(steps - 2, -1, -1):  # point k at t, point k+1 at u < t with room for the rest below u
        room = steps - 2 - k
        total = costs + to_go[None, :]
        total[:, :room] = np.inf
        total[np.triu_indices(T)] = np.inf
        choice.append(total.argmin(axis=1))
        to_go = total.min(axis=1)
    grid = [T - 1]
    for step_choice in reversed(choice):
        grid.append(int(step_choice[grid[-1]]))
    return grid


def kl_bound(costs: np.ndarray, grid: Sequence[int]) -> float:
    """KLUB of a descending grid: its steps' interval costs, the last point's down to t = 0."""
    return float(sum(costs[a, b] for a, b in zip(grid, [*grid[1:], 0])))


def sampler_snippet(grid: Sequence[int], order: int, source: str, bound: float, trailing: float) -> str:
    """A complete sampler config: SDE-DPM-Solver++ on the searched grid."""
    return (f"# Align-Your-Steps grid searched by med_ddpm.step_search on {source}:\n"
            f"# KL upper bound {bound:.4g}, trailing spacing {trailing:.4g} (same estimate, same K).\n"
            f"name: dpm_solver_pp\nsteps: {len(grid)}\norder: {order}\nvariant: sde\nspacing: trailing\n"
            f"timesteps: [{', '.join(str(t) for t in grid)}]\nclip_denoised: true\n")


def search(costs: np.ndarray, steps: Sequence[int]) -> dict[int, dict[str, object]]:
    """Per K: the searched grid and the bound of it and of every named spacing."""
    T = len(costs)
    out = {}
    for k in steps:
        grid = optimal_grid(costs, k)
        named = {sp: kl_bound(costs, make_timesteps(T, k, sp).tolist()) for sp in SPACINGS}
        out[k] = {"grid": grid, "bound": kl_bound(costs, grid), "spacings": named}
    return out


def table(result: dict[int, dict[str, object]]) -> str:
    lines = ["| K | searched | trailing | quadratic | searched grid |", "| --- | --- | --- | --- | --- |"]
    for k, r in result.items():
        lines.append(f"| {k} | {r['bound']:.4g} | {r['spacings']['trailing']:.4g} | {r['spacings']['quadratic']:.4g} "
                     f"| {r['grid']} |")
    return "\n".join(lines) + "\n"


def search_geometry(cfg: DictConfig, loaded: Loaded) -> list[int]:
    """The (D, H, W) to search at, after checking that the data are of the checkpoint's variant."""
    variant, size, _ = sampling_geometry(loaded, cfg)  # the same size rule as sampling
    data_variant = cfg.data.get("variant", cfg.data.name)
    if data_variant != variant:
        fix = f"data.variant={variant}" if cfg.data.name == "synthetic" else f"data={variant} data.root=DATA"
        raise ConfigError(f"data: {data_variant} volumes, but {cfg.checkpoint} is a {variant} network; pass {fix}")
    if size is None:
        raise ConfigError(f"image_size: not set, and {cfg.checkpoint} (an original Med-DDPM checkpoint) records no "
                          "training size; pass image_size=[D,H,W], e.g. image_size=[128,128,128]")
    return size


def describe_data(data: DictConfig) -> str:
    if data.name == "synthetic":
        return f"synthetic {data.variant} phantoms (seed {data.seed})"
    return f"{data.name} volumes of {data.root}"


def data_batches(cfg: DictConfig, size: Sequence[int], stack: RecipeStack, device: torch.device) -> Iterable[Batch]:
    """The first ``n`` volumes of the data, ``batch`` at a time, on the device in the recipes' layout."""
    dataset = build_dataset(cfg.data, size)
    if len(dataset) < cfg.n:
        more = "data.num_volumes=N" if cfg.data.name == "synthetic" else "a data.root with more cases"
        raise DataError(f"n={cfg.n}: {describe_data(cfg.data)} hold {len(dataset)} volume(s); pass n={len(dataset)} "
                        f"or {more}")
    for start in range(0, cfg.n, cfg.batch):
        items = [dataset[i] for i in range(start, min(start + cfg.batch, cfg.n))]
        x0, cond = (torch.stack([item[key] for item in items]).to(device) for key in ("image", "cond"))
        yield stack.prepare_input(x0), stack.prepare_input(cond)


def stack_distances(cfg: DictConfig, model: torch.nn.Module, schedule: NoiseSchedule, size: Sequence[int],
                    stack: RecipeStack, device: torch.device) -> np.ndarray:
    """M of ``model`` (prepared by the recipe stack, in place) on the first ``cfg.n`` volumes of ``cfg.data``,
    ``cfg.batch`` at a time, with the ε of noise seed ``cfg.seed``."""
    generator = torch.Generator().manual_seed(cfg.seed)
    with stack.session():
        prepared = stack.prepare_model(model.to(device).eval())

        def denoiser(inputs: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            with stack.forward_context():
                return prepared(inputs, t)

        return denoised_distances(denoiser, schedule.to(device), data_batches(cfg, size, stack, device), generator,
                                  progress=cfg.progress)
