"""Attribute GPU time to kernel categories by name, and spot Tensor-Core kernels.

Profilers report kernels by (mangled or demangled) name only, so the breakdown is a list of
ordered regular expressions; the first that matches wins. Order matters: cuDNN's implicit-GEMM
convolutions contain "gemm" and must be caught as convolution before the GEMM rule, layout
transposes before generic copies, and a direct copy inside ``elementwise_kernel`` is a copy.
On CPU the same rules classify ``aten::`` operator names (``aten::convolution``, ...).

Tensor-Core heuristic (documented guess, not a hardware counter; use ``ncu`` for that):
a convolution or GEMM/attention kernel counts as Tensor-Core when its name carries an MMA
instruction family (``hmma``, ``wgmma``/``gmma``, ``imma``, CUTLASS ``tensorop``, the shape tags
``h884/h1688/h16816/s1688/s16816``), a flash/fused-MHA kernel, or a reduced-precision operand type
(``tf32``, ``bf16``, ``f16``/``fp16``/``half``). cuDNN ``xmma`` kernels appear in both FFMA and MMA
builds, so they count only with such a type tag (``..._f32f32_f32f32_...`` is plain FP32 FFMA);
``sgemm`` without ``tensorop`` is SIMT. Inductor/Triton templates (``triton_tem_*``, ``triton_mm``)
carry no type in their names and are not counted.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from med_ddpm.config_checks import ConfigError, read_json_option
from med_ddpm.utils import save_figure

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("layout conversion", r"nchwToNhwc|nhwcToNchw|ncdhw|ndhwc|transpose|permute|convert_?layout|channels_?last"),
    ("normalisation", r"(group|batch|layer|instance|rms)_?norm|GroupNorm|welford|RowwiseMoments|"
                      r"ComputeFusedParams|Compute1dBackwardFusedParams|GammaBetaBackward|ComputeInternalGradients"),
    ("convolution", r"conv|fprop|dgrad|wgrad|implicit_gemm|winograd|vol2col|im2col|col2vol|fft\d*d?_"),
    ("up/down-sampling", r"upsample|interpolate|trilinear|nearest|pool|grid_sampl"),
    ("GEMM and attention", r"nvjet|gemm|gemv|matmul|\bmm\b|aten::mm|bmm|addmm|cublas|flash|fmha|attention|softmax|"
                           r"scaled_dot_product"),
    ("memory copies", r"memcpy|memset|direct_copy|copy_kernel|aten::copy_|CatArrayBatchedCopy|aten::cat|to_copy"),
    ("elementwise / activation", r"elementwise|vectorized|silu|gelu|relu|sigmoid|tanh|triton_(poi|per|red)|"
                                 r"reduce_kernel|multi_tensor_apply|adam|fill|aten::(add|mul|sub|div|where|clamp|"
                                 r"exp|sum|mean|abs|neg|rsub|pow|sqrt)"),
)
# Inductor names a fused Triton kernel after every aten op it absorbed ("..._convolution_mul_silu_...":
# a conv's bias add, not a convolution); it never runs a conv or GEMM itself, so it is classified by
# these rules first, and what is left is elementwise.
INDUCTOR = re.compile(r"^triton_(poi|per|red)_", re.IGNORECASE)
INDUCTOR_RULES: tuple[tuple[str, str], ...] = (
    ("normalisation", r"group_norm|batch_norm|layer_norm|native_norm"),
    ("up/down-sampling", r"unsafe_index|upsample|interpolate"),
    ("elementwise / activation", r"."),
)
# Fused-attention kernels checked before the rules: cuDNN's are named like convolutions
# ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_...").
ATTENTION = re.compile(r"sdpa|fmha|flash_(fprop|bprop|fwd|bwd)|scaled_dot_product", re.IGNORECASE)
OTHER = "other"
CATEGORY_NAMES = tuple(c for c, _ in CATEGORIES) + (OTHER,)
_RULES = [(name, re.compile(rx, re.IGNORECASE)) for name, rx in CATEGORIES]
_INDUCTOR_RULES = [(name, re.compile(rx, re.IGNORECASE)) for name, rx in INDUCTOR_RULES]
TENSOR_CORE = re.compile(r"nvjet|hmma|wgmma|gmma|imma|tensorop|h884|h1688|h16816|s1688|s16816|flash|fmha|"
                         r"tf32|bf16|f16|fp16|half", re.IGNORECASE)
MATH_CATEGORIES = ("convolution", "GEMM and attention")


def categorise(name: str) -> str:
    """Category of one kernel (or CPU operator) name."""
    inductor = INDUCTOR.search(name)
    if ATTENTION.search(name) and not inductor:
        return "GEMM and attention"
    for category, rule in _INDUCTOR_RULES if inductor else _RULES:
        if rule.search(name):
            return category
    return OTHER


def is_tensor_core(name: str) -> bool:
    """Heuristic from the module docstring: an MMA-family conv/GEMM/attention kernel."""
    return categorise(name) in MATH_CATEGORIES and bool(TENSOR_CORE.search(name))


def breakdown(times_us: Mapping[str, float]) -> dict[str, float]:
    """Total time per category (same unit as the input), every category present."""
    out: dict[str, float] = dict.fromkeys(CATEGORY_NAMES, 0.0)
    for name, t in times_us.items():
        out[categorise(name)] += t
    return out


def tensor_core_share(times_us: Mapping[str, float]) -> float:
    """Fraction of all kernel time spent in Tensor-Core kernels (0 when nothing ran)."""
    total = sum(times_us.values())
    return sum(t for n, t in times_us.items() if is_tensor_core(n)) / total if total else 0.0


def top_kernels(times_us: Mapping[str, float], counts: Mapping[str, int], k: int = 20) -> list[dict]:
    """The ``k`` most expensive kernels with their category, share and call count (over all the steps that
    ``times_us`` and ``counts`` cover; :func:`markdown` shows it per step)."""
    total = sum(times_us.values()) or 1.0
    ranked = sorted(times_us.items(), key=lambda kv: -kv[1])[:k]
    return [{"name": n, "time_us": t, "share": t / total, "calls": int(counts.get(n, 0)),
             "category": categorise(n), "tensor_core": is_tensor_core(n)} for n, t in ranked]


def short_name(name: str, width: int = 90) -> str:
    """Kernel names are C++ templates hundreds of characters long: keep the head."""
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 1] + "…"


def load_profile(path: Path, key: str) -> dict:
    """One ``bench.profile`` JSON record, named by option ``key``; a file that cannot be read or is not a
    profile is a :class:`~med_ddpm.config_checks.ConfigError` naming the option and the file."""
    fix = "pass a JSON file that bench.profile wrote"
    record = read_json_option(key, path, fix)
    if not isinstance(record, dict) or "categories_ms" not in record:
        raise ConfigError(f"{key}={path}: not a bench.profile record (no categories_ms); {fix}")
    return record


def markdown(profiles: list[dict]) -> str:
    """Category table (ms per step, one column per stack) and each stack's top kernels (calls and ms per step)."""
    lines = ["# Kernel-level breakdown", "",
             "GPU (or, on CPU, operator self) time per step by kernel category; Tensor-Core share is a "
             "name heuristic (see bench/core/kernels.py).", ""]
    stacks = [p["label"] for p in profiles]
    lines += ["| category | " + " | ".join(stacks) + " |", "|---|" + "---|" * len(stacks)]
    for cat in CATEGORY_NAMES:
        lines.append(f"| {cat} | " + " | ".join(f"{p['categories_ms'][cat]:.3f}" for p in profiles) + " |")
    lines.append("| **total** | " + " | ".join(f"**{p['total_ms']:.3f}**" for p in profiles) + " |")
    lines.append("| Tensor-Core share | " + " | ".join(f"{p['tensor_core_share']:.1%}" for p in profiles) + " |")
    for p in profiles:
        launched = any(k.get("launched_by") for k in p["top"])
        lines += ["", f"## Top kernels: {p['label']} ({p['scenario']}, {p['activity']})", "",
                  "| # | kernel | category | TC | calls/step | ms/step | share |" + (" launched by |" if launched else ""),
                  "|---|---|---|---|---|---|---|" + ("---|" if launched else "")]
        for i, k in enumerate(p["top"], start=1):
            name = short_name(k["name"]).replace("|", "\\|")
            by = f" {short_name(k.get('launched_by') or '', 70).replace('|', '/')} |" if launched else ""
            lines.append(f"| {i} | `{name}` | {k['category']} | {'y' if k['tensor_core'] else ''} | "
                         f"{round(k['calls'] / p['steps'], 2):g} | {k['time_us'] / 1e3 / p['steps']:.3f} | "
                         f"{k['share']:.1%} |{by}")
    lines += timeline_markdown(profiles)
    notes = [f"- {p['label']}: {p['note']}" for p in profiles if p.get("note")]  # corrections made after a run
    return "\n".join(lines + (["", "Notes:", *notes] if notes else [])) + "\n"


def stacked_bar_png(profiles: list[dict], path) -> None:
    """One stacked bar per recipe stack: ms per step split by category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(profiles) + 3), 5))
    bottoms = [0.0] * len(profiles)
    for cat in CATEGORY_NAMES:
        heights = [p["categories_ms"][cat] for p in profiles]
        ax.bar(range(len(profiles)), heights, bottom=bottoms, label=cat)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(profiles)), [p["label"] for p in profiles], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


# A gap between two kernels shorter than this is the GPU's own launch latency (a graph's node-to-node
# step, about 1-3 µs on Hopper); a longer one means the stream waited for the host.
LAUNCH_GAP_US = 5.0


def timeline(intervals_us: list[tuple[float, float]], steps: int) -> dict[str, float]:
    """Where the profiled steps' GPU time went: kernels, or nothing.

    ``intervals_us``: (start, end) of every kernel/memcpy in the profiled window (``steps`` calls run
    back to back, no synchronise between them). Overlapping intervals (several streams) are merged,
    so ``busy`` is the time at least one kernel ran and ``idle`` the rest of the window's span; the
    idle time is split into gaps shorter than :data:`LAUNCH_GAP_US` (launch latency, reduced only
    by fewer kernels) and longer ones (the GPU waited for the host). Per step, in ms. The profiler
    slows the host, so an eager step's host-bound gaps read longer than in an unprofiled run.
    """
    if not intervals_us:
        raise ValueError("timeline needs at least one kernel interval")
    merged: list[list[float]] = []
    for start, end in sorted(intervals_us):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    short = [g for g in gaps if g < LAUNCH_GAP_US]
    long = [g for g in gaps if g >= LAUNCH_GAP_US]
    per_step = 1e3 * steps
    return {"span_ms": (merged[-1][1] - merged[0][0]) / per_step,
            "busy_ms": sum(e - s for s, e in merged) / per_step,
            "idle_ms": sum(gaps) / per_step,
            "launch_gap_ms": sum(short) / per_step, "launch_gaps": len(short) / steps,
            "host_wait_ms": sum(long) / per_step, "host_waits": len(long) / steps,
            "longest_gap_us": max(gaps, default=0.0),
            "kernels": len(intervals_us) / steps}


def timeline_markdown(profiles: list[dict]) -> list[str]:
    """The timeline rows of :func:`markdown` for the profiles that have one (GPU profiles)."""
    with_timeline = [p for p in profiles if p.get("timeline")]
    if not with_timeline:
        return []
    lines = ["", "## GPU timeline per step (kernels back to back, no synchronise between steps)", "",
             f"| stack | span ms | kernels busy ms | idle ms | launch gaps (< {LAUNCH_GAP_US:g} µs) | host waits "
             f"(≥ {LAUNCH_GAP_US:g} µs) "
             "| longest gap µs | kernels |", "|---|---|---|---|---|---|---|---|"]
    for p in with_timeline:
        t = p["timeline"]
        lines.append(f"| {p['label']} | {t['span_ms']:.3f} | {t['busy_ms']:.3f} | {t['idle_ms']:.3f} | "
                     f"{t['launch_gap_ms']:.3f} ms in {t['launch_gaps']:.0f} | {t['host_wait_ms']:.3f} ms in "
                     f"{t['host_waits']:.0f} | {t['longest_gap_us']:.0f} | {t['kernels']:.0f} |")
    return lines


def aggregate(events: list[tuple[str, float]]) -> tuple[dict[str, float], dict[str, int]]:
    """(name, duration) pairs, one per call (kernel launch, or operator call on CPU) -> total time and call count
    per name."""
    times: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for name, t in events:
        times[name] += t
        counts[name] += 1
    return dict(times), dict(counts)
