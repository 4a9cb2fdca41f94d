"""The speed-vs-quality verdict: a candidate run against the strict-FP32 reference run, check by check.

Four kinds of check (``configs/quality/default.yaml``):

* ``bias``: a *systematic* denoiser error on identical inputs x_t (probes at t = 0, T/4, T/2, 3T/4,
  T−1, every one of the N samples): the per-sample least-squares slope of candidate ε on reference
  ε (a scale error ε·(1+δ) gives slope 1+δ) and the per-sample mean error (an offset). Also the
  per-sample mean error of the paired final samples. Judged by effect size *and* significance at
  every probed timestep: the mean deviation over samples, its sign-flip p-value
  (:func:`med_ddpm.quality.stats.bias_test`) Holm-corrected over the timesteps tested; fail when at any
  timestep it exceeds ``fail`` and the corrected p < ``alpha.bias``, warn above ``pass``. Rounding
  noise has no preferred sign, so it does not trip these however large it is. An N or ``n_perm``
  at which the test cannot reach its corrected level is refused (:class:`ConfigError`).
* ``limit``: a lower-is-better magnitude against fixed limits (``pass``, ``warn``): the random part
  of the ε error (RMS of the residual after the slope, in ε units), the paired sample distances
  (normalised RMSE, 1 − SSIM, max error) and the non-finite count.
* ``paired`` limits run only when both runs share the sampler and the noise (x_T and every
  step's noise); a candidate with another seed or sampler is judged by the distribution checks.
* ``distribution``: a two-sample permutation test of the candidate's N samples against the
  reference's N (KID on extractor features, linear MMD on voxels, intensity-histogram W1,
  the diversity gap), the null from shuffling arm labels within each mask (the reference sampler
  against itself at the same N). fail when p < ``alpha.fail``, warn when p < ``alpha.warn``.

The worst status wins. Every check reports its value and the numbers that decided it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from med_ddpm.config_checks import ConfigError
from med_ddpm.quality.features import FeatureExtractor, RandomConv3dFeatures
from med_ddpm.quality.metrics import MSSSIM, PSNR, SSIM, MaxAbsError, frechet_distance, region_mask
from med_ddpm.quality.stats import (
    BiasResult,
    bias_test,
    histogram_w1,
    holm,
    intensity_histograms,
    linear_kernel,
    mmd2_unbiased,
    pair_mean_gap,
    per_sample_fit,
    permutation_test,
    polynomial_kernel,
    smallest_bias_p,
)
from med_ddpm.utils import json_safe

VERDICTS = ("pass", "warn", "fail")
KINDS = ("bias", "limit", "paired", "distribution")
REGIONS = ("brain", "tumour")
HIST_BINS = 256


@dataclass
class TrajectoryRun:
    """What the gate compares: final samples (None for a probe-only run), ε at probe inputs, and those
    inputs (all CPU float32), the sampler's identity and the seed of its noise."""

    samples: torch.Tensor | None
    cond: torch.Tensor
    eps_probe: dict[int, torch.Tensor]
    probe_inputs: dict[int, torch.Tensor]
    sampler: dict[str, Any] = field(default_factory=dict)
    noise_seed: int | None = None


def mask_strata(cond: torch.Tensor) -> np.ndarray:
    """Index of each sample's conditioning mask (samples with identical masks share an index)."""
    return torch.unique(cond.flatten(1), dim=0, return_inverse=True)[1].numpy()


class QualityGate:
    """Judges a candidate :class:`TrajectoryRun` against the strict-FP32 reference run.

    Args:
        config: the ``quality`` config (``configs/quality/default.yaml``): ``checks``, ``alpha``,
            ``n_perm``, ``data_range``, ``ssim_kernel``, ``cond_layout``.
        extractor: features for KID / FID (default: the fixed-seed random 3-D CNN, relative only).
        device: where features and MS-SSIM pairs are computed (samples stay on the CPU).
    """

    def __init__(self, config: Mapping[str, Any], extractor: FeatureExtractor | None = None,
                 device: torch.device | str = "cpu"):
        self.checks = {k: dict(v) for k, v in config["checks"].items()}
        for name, c in self.checks.items():
            if c.get("kind") not in KINDS:
                raise ValueError(f"quality check {name!r}: kind must be one of {KINDS}, got {c.get('kind')!r}")
        self.alpha = dict(config["alpha"])
        self.n_perm = int(config.get("n_perm", 1000))
        self.cond_layout = config.get("cond_layout", "whole_head")
        self.data_range, ks = float(config.get("data_range", 2.0)), int(config.get("ssim_kernel", 7))
        self.paired = {"psnr": PSNR(self.data_range), "ssim": SSIM(self.data_range, kernel_size=ks),
                       "ms_ssim": MSSSIM(self.data_range, kernel_size=ks), "max_error": MaxAbsError()}
        self.in_mask = {"psnr": PSNR(self.data_range), "max_error": MaxAbsError()}
        self.ms_ssim = MSSSIM(self.data_range, kernel_size=ks)
        self.extractor = extractor or RandomConv3dFeatures()
        self.device = torch.device(device)

    # -- numbers ------------------------------------------------------------------------
    def measure(self, ref: TrajectoryRun, cand: TrajectoryRun) -> dict[str, dict[str, Any]]:
        """Every check's numbers (value and what decides it), keyed by check name."""
        self.check_bias_power(len(ref.cond), len(ref.eps_probe))
        out = self._drift(ref, cand)
        if cand.samples is None:
            return out
        if ref.samples.shape != cand.samples.shape:
            raise ValueError(f"reference samples {tuple(ref.samples.shape)} and candidate "
                             f"{tuple(cand.samples.shape)} differ in shape; use the same masks and N")
        out["x0_nonfinite"] = {"value": float((~torch.isfinite(cand.samples)).sum())}
        if self.is_paired(ref, cand):
            out.update(self._paired(ref, cand))
        out.update(self._distribution(ref, cand))
        return out

    @staticmethod
    def is_paired(ref: TrajectoryRun, cand: TrajectoryRun) -> bool:
        """Same sampler and same noise: the two final samples should agree voxel for voxel."""
        return ref.sampler == cand.sampler and ref.noise_seed == cand.noise_seed

    def _drift(self, ref: TrajectoryRun, cand: TrajectoryRun) -> dict[str, dict[str, Any]]:
        if set(ref.eps_probe) != set(cand.eps_probe):
            raise ValueError(f"probe timesteps differ: reference {sorted(ref.eps_probe)}, "
                             f"candidate {sorted(cand.eps_probe)}; pass probe_inputs=reference.probe_inputs")
        scale, offset, noise, rel = {}, {}, {}, {}
        for t, e_ref in ref.eps_probe.items():
            slope, mean, residual = per_sample_fit(cand.eps_probe[t], e_ref)
            scale[t], offset[t] = self._bias_test(slope - 1, len(ref.eps_probe)), self._bias_test(mean, len(ref.eps_probe))
            noise[t] = float(residual.mean())
            diff = cand.eps_probe[t].double() - e_ref.double()
            rel[t] = float(diff.norm() / e_ref.double().norm().clamp_min(1e-30))
        return {"eps_scale_bias": bias_over(scale), "eps_mean_bias": bias_over(offset),
                "eps_noise": {"value": _nanmax(noise.values()), "per_t": noise},
                "eps_rel_l2": {"value": _nanmax(rel.values()), "per_t": rel}}

    def _bias_test(self, deviations: torch.Tensor, tests: int) -> BiasResult:
        """:func:`bias_test` of one of ``tests`` tests Holm-corrected together: its ``detectable`` at alpha / tests,
        the level the first Holm step asks of the most significant one."""
        return bias_test(deviations, n_perm=self.n_perm, alpha=self.alpha["bias"] / tests)

    def check_bias_power(self, n: int, timesteps: int) -> None:
        """Refuse an N (or ``n_perm``) at which a bias check could never fail: the sign-flip test's smallest p-value
        (:func:`smallest_bias_p`) must be below ``alpha.bias`` / the timesteps tested, Holm's first step."""
        alpha = float(self.alpha["bias"])
        level = alpha / timesteps
        if not any(c["kind"] == "bias" for c in self.checks.values()) or smallest_bias_p(n, self.n_perm) < level:
            return
        exact_n = next(k for k in range(2, 64) if 2.0 ** (1 - k) < level)
        what, fix = ((f"quality.n_samples={n}", f"quality.n_samples>={exact_n}") if n < exact_n else
                     (f"quality.n_perm={self.n_perm}", f"quality.n_perm>={math.ceil(1 / level)}"))
        raise ConfigError(f"{what}: the bias checks' sign-flip test cannot reach p < {level:.3g} (alpha.bias {alpha} "
                          f"over {timesteps} probed timesteps, Holm), so they could never fail; pass {fix}")

    def _paired(self, ref: TrajectoryRun, cand: TrajectoryRun) -> dict[str, dict[str, Any]]:
        pred, target = cand.samples, ref.samples
        m = {k: _metric_value(metric, pred, target) for k, metric in self.paired.items()}
        out = {"x0_nrmse": 10 ** (-m["psnr"] / 20), "x0_dssim": 1 - m["ssim"], "x0_dms_ssim": 1 - m["ms_ssim"],
               "x0_max_error": m["max_error"]}
        for region in REGIONS:
            try:
                mask = region_mask(ref.cond, region, self.cond_layout)
            except ValueError:  # cond has no such channel (e.g. an unconditional toy)
                continue
            if mask.any():
                out[f"x0_{region}_nrmse"] = 10 ** (-_metric_value(self.in_mask["psnr"], pred, target, mask=mask) / 20)
                out[f"x0_{region}_max_error"] = _metric_value(self.in_mask["max_error"], pred, target, mask=mask)
        result = {k: {"value": float(v)} for k, v in out.items()}
        _, mean, _ = per_sample_fit(pred, target)
        result["x0_mean_bias"] = bias_over({"x0": self._bias_test(mean, 1)})
        return result

    def _distribution(self, ref: TrajectoryRun, cand: TrajectoryRun) -> dict[str, dict[str, Any]]:
        pooled = torch.cat([ref.samples, cand.samples])
        if not torch.isfinite(pooled).all():
            return {k: {"value": math.nan, "p_value": 0.0} for k, c in self.checks.items() if c["kind"] == "distribution"}
        is_b = np.r_[np.zeros(len(ref.samples), bool), np.ones(len(cand.samples), bool)]
        strata = mask_strata(torch.cat([ref.cond, cand.cond]))  # one index per mask across both arms
        feats = self._features(pooled)
        k_feat, k_vox = polynomial_kernel(feats), linear_kernel(pooled)
        hists = intensity_histograms(pooled, HIST_BINS, (-1.0, 1.0))
        similarity = self._pair_similarity(pooled, strata)
        tests = {
            "kid_vs_ref": (lambda b: mmd2_unbiased(k_feat, b), False),
            "mmd_vs_ref": (lambda b: mmd2_unbiased(k_vox, b), False),
            "histogram_w1_vs_ref": (lambda b: histogram_w1(hists, b, 2.0 / HIST_BINS), False),
            "diversity_gap": (lambda b: pair_mean_gap(similarity, b, strata), True),
        }
        out = {name: permutation_test(stat, is_b, strata, n_perm=self.n_perm, two_sided=two).to_dict()
               for name, (stat, two) in tests.items()}
        out["fid_vs_ref"] = {"value": float(frechet_distance(feats[~is_b], feats[is_b]))}
        return out

    def _features(self, volumes: torch.Tensor) -> torch.Tensor:
        ext = self.extractor.to(self.device)
        return torch.cat([ext(v.to(self.device)).cpu() for v in volumes.split(16)])

    def _pair_similarity(self, volumes: torch.Tensor, strata: np.ndarray) -> np.ndarray:
        """MS-SSIM of every pair of pooled samples that share a mask (NaN elsewhere)."""
        sim = np.full((len(volumes),) * 2, np.nan)
        pairs = [(i, j) for i in range(len(volumes)) for j in range(i + 1, len(volumes)) if strata[i] == strata[j]]
        for chunk in range(0, len(pairs), 32):
            i, j = map(list, zip(*pairs[chunk:chunk + 32]))
            self.ms_ssim.reset()
            self.ms_ssim.update(volumes[i].to(self.device), volumes[j].to(self.device))
            sim[i, j] = sim[j, i] = self.ms_ssim.per_sample().numpy()
        return sim

    # -- verdict ------------------------------------------------------------------------
    def run(self, reference: TrajectoryRun, candidate: TrajectoryRun) -> QualityReport:
        """Measure, judge every measured check, and combine: the worst status wins."""
        measured = self.measure(reference, candidate)
        checks, reasons = {}, []
        for name, spec in self.checks.items():
            if name not in measured:
                reasons.append(f"{name}: not gated ({self._why_not(spec, reference, candidate)})")
                continue
            checks[name] = {**measured[name], "kind": spec["kind"], **self._judge(spec, measured[name])}
            if checks[name]["status"] != "pass":
                reasons.append(f"{name}={checks[name]['value']:.4g} -> {checks[name]['status']} ({checks[name]['why']})")
        verdict = max((c["status"] for c in checks.values()), key=VERDICTS.index, default="pass")
        if verdict == "pass" and not any(c["kind"] in ("paired", "distribution") for c in checks.values()):
            verdict = "warn"
            reasons.append("no final samples were compared (probe-only run): the denoiser alone cannot show the "
                           "samples are as good")
        reported = {k: v for k, v in measured.items() if k not in checks}
        context = {"reference_sampler": reference.sampler, "candidate_sampler": candidate.sampler,
                   "paired": candidate.samples is not None and self.is_paired(reference, candidate),
                   "n_samples": len(reference.cond), "n_masks": int(len(np.unique(mask_strata(reference.cond)))),
                   "noise_seeds": [reference.noise_seed, candidate.noise_seed],
                   "extractor": self.extractor.describe(), "min_detectable_eps_bias": self.min_detectable_bias(checks),
                   "min_detectable_eps_noise": self.min_detectable_noise()}
        return QualityReport(verdict, checks, reported, reasons, context)

    def min_detectable_bias(self, checks: Mapping[str, Mapping[str, Any]]) -> float | None:
        """The smallest ε scale error δ this gate fails: above the ``fail`` effect size and beyond what this N can
        tell from noise at the timestep where it tells the most (the null's detectable mean at alpha / the
        timesteps tested, Holm's first step)."""
        spec, check = self.checks.get("eps_scale_bias"), checks.get("eps_scale_bias")
        if spec is None or check is None:
            return None
        return max(float(spec["fail"]), min(r["detectable"] for r in check["per_t"].values()))

    def min_detectable_noise(self) -> float | None:
        """The smallest random ε error σ (ε + N(0, σ²)) this gate fails: its residual RMS is σ, which fails above
        ``eps_noise``'s warn limit."""
        spec = self.checks.get("eps_noise")
        return None if spec is None else float(spec["warn"])

    def _judge(self, spec: Mapping[str, Any], m: Mapping[str, Any]) -> dict[str, Any]:
        if spec["kind"] == "bias":
            return self._judge_bias(spec, m)
        value = m["value"]
        if not math.isfinite(value):
            return {"status": "fail", "why": "not finite"}
        if spec["kind"] == "distribution":
            p = m["p_value"]
            status = "fail" if p < self.alpha["fail"] else "warn" if p < self.alpha["warn"] else "pass"
            return {"status": status, "why": f"p={p:.3g} against the permutation null"}
        status = "pass" if value <= spec["pass"] else "warn" if value <= spec["warn"] else "fail"
        return {"status": status, "pass_limit": spec["pass"], "warn_limit": spec["warn"],
                "why": f"limits pass {spec['pass']}, warn {spec['warn']}"}

    def _judge_bias(self, spec: Mapping[str, Any], m: Mapping[str, Any]) -> dict[str, Any]:
        """Each tested timestep on its own: fail when its Holm-corrected p < ``alpha.bias`` and |mean| > ``fail``,
        warn when significant and above ``pass``; the check is its worst timestep's status, reported with that
        timestep's numbers (the largest |mean| among ties)."""
        def status(r: Mapping[str, Any]) -> str:
            size, significant = abs(r["value"]), r["p_value"] < self.alpha["bias"]
            if not math.isfinite(size):
                return "fail"
            return ("fail" if significant and size > spec["fail"] else
                    "warn" if significant and size > spec["pass"] else "pass")

        def rank(t: Any) -> tuple[int, float]:
            size = abs(m["per_t"][t]["value"])
            return VERDICTS.index(status(m["per_t"][t])), size if math.isfinite(size) else math.inf

        t = max(m["per_t"], key=rank)
        r = m["per_t"][t]
        return {"status": status(r), "value": r["value"], "p_value": r["p_value"], "t": t,
                "pass_limit": spec["pass"], "fail_limit": spec["fail"],
                "why": f"|{r['value']:.3g}| at t={t} vs pass {spec['pass']}, fail {spec['fail']}, Holm-corrected "
                       f"p={r['p_value']:.3g} over {len(m['per_t'])} timestep(s)"}

    def _why_not(self, spec: Mapping[str, Any], ref: TrajectoryRun, cand: TrajectoryRun) -> str:
        if cand.samples is None:
            return "probe-only run: no final samples"
        if spec["kind"] in ("paired", "bias"):
            return "different sampler or noise seed: paths differ by design, judged by the distribution checks"
        return "not measured (empty region)"


def bias_over(per_t: Mapping[Any, BiasResult]) -> dict[str, Any]:
    """One bias check's numbers over its tested timesteps (or the one x0 test): per timestep its mean deviation,
    its p-value Holm-corrected over the timesteps (:func:`med_ddpm.quality.stats.holm`) and its detectable mean; the check's
    value is the largest |mean| (the gate judges every timestep, :meth:`QualityGate._judge_bias`)."""
    adjusted = holm([r.p_value for r in per_t.values()])
    rows = {t: {"value": r.value, "p_value": p, "detectable": r.detectable} for (t, r), p in zip(per_t.items(), adjusted)}
    t = max(rows, key=lambda k: abs(rows[k]["value"]) if math.isfinite(rows[k]["value"]) else math.inf)
    return {"value": rows[t]["value"], "t": t, "p_value": rows[t]["p_value"],
            "n_perm": next(iter(per_t.values())).n_perm, "per_t": rows}


def _metric_value(metric, pred, target=None, **kw) -> float:
    metric.reset()
    metric.update(pred, target, **kw)
    return metric.compute()


def _nanmax(values) -> float:
    """Max that propagates NaN (a NaN probe is a failure, not something to skip)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


@dataclass
class QualityReport:
    """The gate's answer: ``verdict`` in pass|warn|fail, the judged checks, the reported-only numbers, why."""

    verdict: str
    checks: dict[str, dict[str, Any]]
    reported: dict[str, dict[str, Any]]
    reasons: list[str]
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def metrics(self) -> dict[str, float]:
        """Every number's value, judged or not (flat, for tables and the Pareto objective)."""
        return {k: v["value"] for k, v in {**self.reported, **self.checks}.items()}

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON form for a bench row's ``quality`` field (inf/nan become strings)."""
        return json_safe({"verdict": self.verdict, "reasons": self.reasons, "metrics": self.metrics,
                          "checks": self.checks, "reported": self.reported, **self.context})

