"""What fraction of the datasheet the planner's step-time model assumes: catalog/planner.toml's defaults, the GPU
generation's and the GPU's own constants, a measured profile, and the command line, in that order.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.estimate import comms
from trainscale.estimate.profile import check_profile, is_hardware_profile
from trainscale.specs import ClusterSpec, GPUSpec, load_gpu


@dataclass(frozen=True)
class Efficiencies:
    """What fraction of the datasheet the step-time model assumes; defaults from catalog/planner.toml."""

    matmul_efficiency: float
    attention_efficiency: float
    attention_seq_half: float
    hbm_efficiency: float
    launch_gap_s: float
    sustained_clock_fraction: float
    scale_up_bus_efficiency: float
    network_bus_efficiency: float
    scale_up_latency_s: float
    optimizer_bytes_per_param: float
    cp_overlap: float
    p2p_overlap: float
    fp8_matmul_efficiency: float
    moe_imbalance: float
    memory_reserve_bytes: float
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("sources")
        return d


_EFF_KEYS = tuple(f.name for f in fields(Efficiencies) if f.name != "sources")


@cache
def planner_catalog() -> dict[str, Any]:
    return tomllib.loads(resources.files("trainscale.catalog").joinpath("planner.toml").read_text())


def profile_efficiencies(prof: dict[str, Any], path: Path, peak_flops: float | None, hbm_bandwidth: float | None,
                         scale_up_bandwidth: float | None) -> dict[str, float]:
    """The planner settings a ``trainscale calibrate`` hardware profile implies for one GPU: its one-process
    figures over the datasheet (matmul and attention FLOP/s over the bf16 peak, copy bandwidth over HBM), the
    measured AdamW bytes per parameter, and from the largest all-reduce group the bus efficiency over the
    per-direction scale-up link and the latency per ring step (2(n-1) steps, NCCL-tests' ring)."""
    machine = prof.get("machine", {})
    if machine.get("device") != "cuda":
        raise TrainscaleError(f"profile {path} was measured on a {machine.get('device', 'unknown')} device "
                              f"({machine.get('device_name', '?')}); the planner's GPUs need one calibrated on "
                              "the GPU (run trainscale calibrate there)")
    if not peak_flops or not hbm_bandwidth:
        raise TrainscaleError("a calibrated profile needs the GPU's peak and HBM bandwidth to become efficiencies")
    one = prof.get("processes", {}).get("1")
    if not one:
        raise TrainscaleError(f"profile {path} has no one-process figures ([processes.1])")
    try:
        out = {"matmul_efficiency": min(1.0, float(one["matmul_flops"]) / peak_flops),
               "attention_efficiency": min(1.0, float(one["attention_flops"]) / peak_flops),
               "hbm_efficiency": min(1.0, float(one["memory_bandwidth"]) / hbm_bandwidth),
               "optimizer_bytes_per_param": float(one["optimizer_bytes_per_param"])}
        groups = {int(n): v for n, v in prof.get("collectives", {}).items() if "all_reduce" in v}
        if groups and scale_up_bandwidth:
            n = max(groups)
            ar = groups[n]["all_reduce"]
            out["scale_up_bus_efficiency"] = min(1.0, float(ar["bus_bandwidth"]) / (scale_up_bandwidth / 2))
            out["scale_up_latency_s"] = float(ar["latency_s"]) / (2 * (n - 1))
    except (KeyError, TypeError, ValueError) as e:
        raise TrainscaleError(f"profile {path} is malformed ({e}); run trainscale calibrate again") from None
    return out


def _generation(gpu: str | None) -> str:
    """The GPU's architecture generation (catalog/gpus.toml), '' when unknown."""
    if not gpu:
        return ""
    try:
        return load_gpu(gpu).generation
    except TrainscaleError:
        return ""


def load_efficiencies(gpu: str | None = None, profile: str | Path | None = None,
                      overrides: dict[str, float] | None = None, peak_flops: float | None = None,
                      hbm_bandwidth: float | None = None, scale_up_bandwidth: float | None = None) -> Efficiencies:
    """Catalog defaults, then the GPU generation's constants, then the GPU's overrides, then a measured profile
    (TOML/JSON), then ``overrides``.

    A profile is either flat planner settings (the keys of catalog/planner.toml [defaults]; ``matmul_flops``
    may stand for ``matmul_efficiency`` and is divided by the GPU's peak) or a hardware profile written by
    ``trainscale calibrate`` on the GPU (``profile_efficiencies``).
    """
    cat = planner_catalog()
    vals: dict[str, Any] = {k: cat["defaults"][k] for k in _EFF_KEYS}
    sources = {k: cat["defaults"].get(f"{k}_source", "") for k in _EFF_KEYS}
    gen = _generation(gpu)
    for k, x in cat.get("generation", {}).get(gen, {}).items():
        if k in vals:
            vals[k], sources[k] = x, cat["generation"][gen].get(f"{k}_source", f"catalog/planner.toml "
                                                                                 f"[generation.{gen}]")
    for k, x in cat.get("gpu", {}).get(gpu or "", {}).items():
        if k in vals:
            vals[k], sources[k] = x, f"catalog/planner.toml [gpu.{gpu}]"
    extra: dict[str, Any] = {}
    if profile is not None:
        path = Path(profile)
        try:
            text = path.read_text()
            extra = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (OSError, ValueError) as e:
            raise TrainscaleError(f"profile {path} cannot be read: {e}") from None
        if is_hardware_profile(extra):  # a `trainscale calibrate` hardware profile
            extra = profile_efficiencies(check_profile(extra, path), path, peak_flops, hbm_bandwidth,
                                         scale_up_bandwidth)
        if "matmul_flops" in extra:
            if not peak_flops:
                raise TrainscaleError("a profile's matmul_flops needs the GPU's peak to become an efficiency")
            extra.setdefault("matmul_efficiency", float(extra.pop("matmul_flops")) / peak_flops)
        extra = {k: v for k, v in extra.items() if k in vals}
        sources.update({k: f"profile {path}" for k in extra})
    for k, x in {**extra, **(overrides or {})}.items():
        if k not in vals:
            raise TrainscaleError(f"unknown planner setting '{k}'; known: {', '.join(_EFF_KEYS)}")
        try:
            vals[k] = float(x)
        except (TypeError, ValueError):
            raise TrainscaleError(f"planner setting {k} must be a number, not {x!r}") from None
        if overrides and k in overrides:
            sources[k] = "set on the command line"
    for k in ("matmul_efficiency", "attention_efficiency", "hbm_efficiency", "scale_up_bus_efficiency",
              "network_bus_efficiency", "sustained_clock_fraction", "fp8_matmul_efficiency"):
        if not 0 < vals[k] <= 1:
            raise TrainscaleError(f"planner setting {k} must be in (0, 1], not {vals[k]}")
    if not 1 <= vals["moe_imbalance"] <= 1e3:
        raise TrainscaleError(f"planner setting moe_imbalance must be at least 1 (the busiest rank over the mean), "
                              f"not {vals['moe_imbalance']}")
    return Efficiencies(**vals, sources=sources)


def cluster_topology(cluster: ClusterSpec, gpu: GPUSpec, eff: Efficiencies) -> comms.Topology:
    """The cluster's wires, with its pods and oversubscription (ClusterSpec)."""
    src = cluster.source + (f"; {cluster.pods_source}" if cluster.pods_source else "")
    return comms.topology(cluster, gpu, eff.scale_up_bus_efficiency, eff.network_bus_efficiency,
                          eff.scale_up_latency_s, cluster.pod_gpus, cluster.oversubscription, src)


def with_overrides(eff: Efficiencies, **kw: float) -> Efficiencies:
    return replace(eff, **kw)

