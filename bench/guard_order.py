"""Where the training step waits for its loss: before backward (the loop since round 12), after it, or never.

The loop's non-finite guard reads the loss back to the host once a step (a NaN step must not touch
the weights). Read *before* backward, the host waits for the forward, then queues the backward and,
while the GPU runs it, Adam and the next step's forward. Read *after* backward, the GPU idles while
the host queues Adam and the next forward. The difference is host latency, not kernels, so the two
are timed in one process on one prepared (compiled, graphed) model: the two variants of the
``train_step`` scenario (``read_loss``, :data:`bench.scenarios.READ_LOSS`) over the same model,
interleaved in blocks of CUDA-event-timed steps, so compilation, cuDNN autotuning and clocks are
shared and drift hits all alike. Each variant has its own Adam and guard. When the stack's Adam is
fused, a third variant, ``on_device``, uses ``fused_adam(guard=device)``'s guard, which never waits:
fused Adam skips a non-finite step's update on the GPU.

Usage::

    python -m bench.guard_order --out bench/results/h200/tuning/guard_order_SHA bench=train_step \\
        'recipe=[amp_bf16,...,compile_cudagraphs,fused_adam]' recipe.gather_upsample.forward=gather

Writes ``guard_order.json`` (each variant's :class:`bench.timing.Timings`, the block medians, the
stack's ``describe()``, env metadata) atomically and prints one line per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench.ladder import compose_job
from bench.scenarios import READ_LOSS, SCENARIOS, NonFiniteOutput, Parts, Step, prepared_parts
from bench.timing import summarize, time_fn
from med_ddpm.utils import atomic_write_text, env_info, resolve_device
from optim import DeviceFiniteGuard
from optim.amp import NonFiniteGuard

RESULT_FILE = "guard_order.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help=f"folder of {RESULT_FILE}")
    p.add_argument("--blocks", type=int, default=4, help="interleaved blocks per variant (default 4)")
    p.add_argument("--iters", type=int, default=20, help="timed steps per block (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each block (default 3)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of configs/bench.yaml (bench=train_step, 'recipe=[...]')")
    return p.parse_args(argv)


def compose_bench(overrides: list[str], out: Path) -> dict[str, Any]:
    """The resolved bench config of ``overrides`` (its scenario must be ``train_step``)."""
    cfg = compose_job(overrides, out)["config"]  # the config bench.ladder would hand a worker
    if cfg["bench"]["scenario"] != "train_step":
        raise SystemExit(f"bench.guard_order times the train step; got bench={cfg['bench']['scenario']}")
    return cfg


def variant_steps(parts: Parts, cfg: dict[str, Any]) -> dict[str, tuple[Step, Any]]:
    """Each variant's train step and its own guard: the host guard asked before and after backward, and
    (when the stack's Adam is fused) the device guard, which never waits."""
    steps = {where: (SCENARIOS["train_step"](*parts, cfg, read_loss=where, guard=(g := NonFiniteGuard())), g)
             for where in READ_LOSS}
    if parts[2].optimizer_options().get("fused"):
        steps["on_device"] = (SCENARIOS["train_step"](*parts, cfg, guard=(g := DeviceFiniteGuard())), g)
    return steps


def time_variants(cfg: dict[str, Any], blocks: int, iters: int, warmup: int) -> dict[str, Any]:
    """Every variant on one prepared model, interleaved block by block."""
    device = resolve_device(cfg.get("device", "auto"))
    with prepared_parts(cfg, device) as parts:
        steps = variant_steps(parts, cfg)
        for step, _ in steps.values():  # compile / capture once, outside the timed blocks
            step()
        samples: dict[str, list[float]] = {name: [] for name in steps}
        block_medians: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(blocks):
            for name, (step, _) in steps.items():
                block = time_fn(step, warmup=warmup, iters=iters, device=device).samples
                samples[name] += block
                block_medians[name].append(statistics.median(block))
        skipped = {name: guard.skipped for name, (_, guard) in steps.items()}
        if any(skipped.values()):
            raise NonFiniteOutput(f"steps skipped by the non-finite-loss guard while timing: {skipped}")
        describe = parts[2].describe()
    return {"variants": {name: summarize(s).as_dict() | {"block_medians_ms": block_medians[name]}
                         for name, s in samples.items()},
            "blocks": blocks, "iters_per_block": iters, "describe": describe, "env": env_info(device)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    result = {"overrides": args.overrides, **time_variants(compose_bench(args.overrides, out), args.blocks,
                                                            args.iters, args.warmup)}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / RESULT_FILE, json.dumps(result, indent=1))
    for where, t in result["variants"].items():
        print(f"{where}: median {t['median']:.2f} ms (p10 {t['p10']:.2f}, p90 {t['p90']:.2f}), n={len(t['samples'])}")


if __name__ == "__main__":
    main()
