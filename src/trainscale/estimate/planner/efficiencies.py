"""What fraction of the datasheet the planner's step-time model assumes: catalog/planner.toml's defaults, the GPU
generation's and the GPU's own constants, a measured profile, and the command line, in that order.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from trainscale.errors import TrainscaleError
from trainscale.estimate import comms
from trainscale.estimate.profile import check_profile, is_hardware_profile
from trainscale.safeio import parse_json, parse_toml, read_text
from trainscale.specs import ClusterSpec, GPUSpec, catalog_names, load_gpu


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
    fa_triton_speed: float
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("sources")
        return d


_EFF_KEYS = tuple(f.name for f in fields(Efficiencies) if f.name != "sources")


class Range(NamedTuple):
    """A knob's allowed values, from what it means: lo < x (or lo <= x when ``lo_in``) and x <= hi."""

    lo: float
    lo_in: bool
    hi: float
    what: str

    def text(self) -> str:
        return f"{self.what}: a finite number in {'[' if self.lo_in else '('}{self.lo:.12g}, {self.hi:.12g}]"


_RATE = Range(0, False, 1, "a fraction of a datasheet rate (0 would make the step take forever)")
_HIDDEN = Range(0, True, 1, "the fraction of the traffic hidden under compute")
_LATENCY = Range(0, False, 1, "a latency in seconds")
# One range per knob of catalog/planner.toml [defaults], read from the knob's comment and its use in the step model.
KNOB_RANGES: dict[str, Range] = {
    "matmul_efficiency": _RATE, "attention_efficiency": _RATE, "hbm_efficiency": _RATE,
    "sustained_clock_fraction": _RATE, "scale_up_bus_efficiency": _RATE, "network_bus_efficiency": _RATE,
    "fp8_matmul_efficiency": _RATE,
    # layer.py: rate x s / (s + half); a sequence length in tokens, at most --seq's bound of 2^24
    "attention_seq_half": Range(0, False, 1 << 24, "the sequence length in tokens at which attention runs at half "
                                "its plateau"),
    "launch_gap_s": _LATENCY, "scale_up_latency_s": _LATENCY,
    # derived 28 (Adam, bf16 grads); a measured figure (calibrate: seconds x bandwidth) may be a few times that
    "optimizer_bytes_per_param": Range(0, False, 1000, "the bytes the optimizer step reads and writes per parameter"),
    "cp_overlap": _HIDDEN, "p2p_overlap": _HIDDEN,
    # moe.py: the busiest expert-parallel rank's tokens over the mean, at least 1 by definition
    "moe_imbalance": Range(1, True, 1000, "the busiest expert rank's tokens over the mean"),
    # step.py: bytes kept back from each GPU's memory; no GPU in catalog/gpus.toml has 1 TB
    "memory_reserve_bytes": Range(0, True, 1e12, "bytes kept back per GPU"),
    # layer.attention_rate: a factor on the fa-triton kernel's catalog curve, as software.toml's attention_speed
    "fa_triton_speed": Range(0, False, 4, "a factor on the fa-triton kernel's curve"),
}
assert set(KNOB_RANGES) == set(_EFF_KEYS)


def _knob_field(r: Range) -> Any:
    return Field(gt=None if r.lo_in else r.lo, ge=r.lo if r.lo_in else None, le=r.hi)


_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", frozen=True)
# the settings the step model runs at: every knob, a finite number in its range
PlannerSettings: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "PlannerSettings", __config__=_STRICT, **{k: (float, _knob_field(r)) for k, r in KNOB_RANGES.items()})
# one table of catalog/planner.toml ([defaults], [generation.X], [gpu.X]): some knobs, each with its source
PlannerSection: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "PlannerSection", __config__=_STRICT,
    **{k: (Annotated[float, _knob_field(r)] | None, None) for k, r in KNOB_RANGES.items()},
    **{f"{k}_source": (str | None, None) for k in KNOB_RANGES})


def _knob_error(e: ValidationError, values: dict[str, Any], where: Any) -> TrainscaleError:
    """One sentence: the first bad knob, where it came from, its allowed range and the value given."""
    err = e.errors()[0]
    k = str(err["loc"][0]) if err.get("loc") else "?"
    origin = where(k) if callable(where) else where
    if k not in KNOB_RANGES:
        what = "must be a string" if k.endswith("_source") else f"is unknown; known: {', '.join(_EFF_KEYS)}"
        return TrainscaleError(f"planner setting {k} ({origin}) {what}")
    return TrainscaleError(f"planner setting {k} ({origin}) is {KNOB_RANGES[k].text()}, not {values.get(k)!r}")


def check_settings(values: dict[str, Any], where: Any = "given") -> None:
    """Every knob present and in range (PlannerSettings); ``where`` names the origin (or maps a knob to it)."""
    try:
        PlannerSettings(**values)
    except ValidationError as e:
        raise _knob_error(e, values, where) from None


def check_section(values: dict[str, Any], where: str) -> None:
    """One catalog/planner.toml table: only known knobs (and their ``_source`` strings), each in range."""
    try:
        PlannerSection(**values)
    except ValidationError as e:
        raise _knob_error(e, values, where) from None


@cache
def planner_catalog() -> dict[str, Any]:
    """catalog/planner.toml, each table of knobs checked against its schema (PlannerSettings, PlannerSection)."""
    cat = tomllib.loads(resources.files("trainscale.catalog").joinpath("planner.toml").read_text())
    check_settings({k: cat["defaults"].get(k) for k in _EFF_KEYS}, "catalog/planner.toml [defaults]")
    for kind in ("defaults", "generation", "gpu"):
        tables = {"": cat[kind]} if kind == "defaults" else cat.get(kind, {})
        for name, table in tables.items():
            check_section(table, f"catalog/planner.toml [{kind}{'.' + name if name else ''}]")
    return cat


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


def _datasheet(g: GPUSpec) -> dict[str, Any]:
    """A GPU's figures without its names and sources: what makes two GPU descriptions the same hardware."""
    return {k: v for k, v in g.model_dump().items() if k not in ("name", "source") and not k.endswith("_source")}


def _catalog_gpu(gpu: GPUSpec | str | None) -> tuple[str, str]:
    """-> (the GPU's architecture generation, the catalog GPU it is) for a catalog name, a GPU file or a spec.

    A GPU file is read for its own ``generation``; it is the catalog GPU whose datasheet figures it repeats
    (whatever its name), so a copy of ``h100-sxm`` gets h100-sxm's constants and a GPU of the user's own gets its
    generation's. ('', '') when the GPU is unknown."""
    if not gpu:
        return "", ""
    if not isinstance(gpu, GPUSpec):
        try:
            gpu = load_gpu(gpu)
        except TrainscaleError:
            return "", ""
    figures = _datasheet(gpu)
    same = [n for n in catalog_names("gpus") if _datasheet(load_gpu(n)) == figures]
    name = gpu.name if gpu.name in same else (same[0] if same else "")
    return gpu.generation, name


def load_efficiencies(gpu: GPUSpec | str | None = None, profile: str | Path | None = None,
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
    gen, name = _catalog_gpu(gpu)
    for k, x in cat.get("generation", {}).get(gen, {}).items():
        if k in vals:
            vals[k], sources[k] = x, cat["generation"][gen].get(f"{k}_source", f"catalog/planner.toml "
                                                                                 f"[generation.{gen}]")
    for k, x in cat.get("gpu", {}).get(name, {}).items():
        if k in vals:
            vals[k], sources[k] = x, f"catalog/planner.toml [gpu.{name}]"
    extra: dict[str, Any] = {}
    if profile is not None:
        path = Path(profile)
        try:
            text = read_text(path, "profile")
            extra = parse_json(text, f"profile {path}") if path.suffix == ".json" else \
                parse_toml(text, f"profile {path}")
        except ValueError as e:
            raise TrainscaleError(f"profile {path} cannot be read: {e}") from None
        if not isinstance(extra, dict):
            raise TrainscaleError(f"profile {path} is not a table of planner settings")
        if is_hardware_profile(extra):  # a `trainscale calibrate` hardware profile
            extra = profile_efficiencies(check_profile(extra, path), path, peak_flops, hbm_bandwidth,
                                         scale_up_bandwidth)
        if "matmul_flops" in extra:
            if not peak_flops:
                raise TrainscaleError("a profile's matmul_flops needs the GPU's peak to become an efficiency")
            extra.setdefault("matmul_efficiency", float(extra.pop("matmul_flops")) / peak_flops)
        unknown = sorted(k for k in extra if k not in vals and not k.endswith("_source") and k != "note")
        if unknown:  # a misspelt knob is never silently dropped
            raise TrainscaleError(f"profile {path}: unknown planner setting '{unknown[0]}'; known: "
                                  f"{', '.join(_EFF_KEYS)}")
        extra = {k: v for k, v in extra.items() if k in vals}
        sources.update({k: f"profile {path}" for k in extra})
    for k, x in {**extra, **(overrides or {})}.items():
        if k not in vals:
            raise TrainscaleError(f"unknown planner setting '{k}'; known: {', '.join(_EFF_KEYS)}")
        vals[k] = x
        if overrides and k in overrides:
            sources[k] = "set on the command line"
    check_settings(vals, lambda k: sources.get(k) or "catalog/planner.toml")
    vals.update({k: float(vals[k]) for k in {**extra, **(overrides or {})}})
    return Efficiencies(**vals, sources=sources)


@dataclass(frozen=True)
class AttentionCurve:
    """A fused attention kernel's published forward + backward TFLOP/s on one GPU (catalog/planner.toml
    [attention.KERNEL.GENERATION]), causal, at sequence lengths ``seq`` for head dims 64 and 128, counted as its
    source counts them (forward + backward = 3.5 x the forward)."""

    kernel: str
    generation: str
    seq: tuple[float, ...]
    hd64: tuple[float, ...]
    hd128: tuple[float, ...]
    peak: float  # the bf16 datasheet peak of the GPU it was measured on
    source: str
    fwd64: tuple[float, ...] | None = None  # its forward-only TFLOP/s at ``seq``, where published
    fwd128: tuple[float, ...] | None = None


ATTENTION_KERNELS = ("fa2", "fa1", "fa-triton", "fa3", "cudnn")  # the kernels catalog/planner.toml may tabulate


@cache
def attention_curve(kernel: str, generation: str) -> AttentionCurve | None:
    """The published curve of ``kernel`` on a GPU of ``generation``, None where catalog/planner.toml has none."""
    t = planner_catalog().get("attention", {}).get(kernel, {}).get(generation)
    if t is None:
        return None
    seq, hd64, hd128 = (tuple(float(x) for x in t[k]) for k in ("seq", "hd64", "hd128"))
    fwd64, fwd128 = (tuple(float(x) for x in t[k]) if k in t else None for k in ("fwd_hd64", "fwd_hd128"))
    fwd = (fwd64 or ()) + (fwd128 or ())
    if not (len(seq) == len(hd64) == len(hd128) >= 1 and list(seq) == sorted(set(seq))
            and min(hd64 + hd128) > 0 and (fwd64 is None) == (fwd128 is None)
            and (not fwd or (len(fwd) == 2 * len(seq) and min(fwd) > 0))):
        raise TrainscaleError(f"catalog/planner.toml [attention.{kernel}.{generation}]: seq must rise and hd64, hd128 "
                              "(and fwd_hd64, fwd_hd128 if given, both) be positive rates, one per seq")
    return AttentionCurve(kernel, generation, seq, hd64, hd128, load_gpu(str(t["gpu"])).peak_bf16_flops,
                          str(t.get("source", "")), fwd64, fwd128)


def cluster_topology(cluster: ClusterSpec, gpu: GPUSpec, eff: Efficiencies) -> comms.Topology:
    """The cluster's wires, with its pods and oversubscription (ClusterSpec)."""
    src = cluster.source + (f"; {cluster.pods_source}" if cluster.pods_source else "")
    return comms.topology(cluster, gpu, eff.scale_up_bus_efficiency, eff.network_bus_efficiency,
                          eff.scale_up_latency_s, cluster.pod_gpus, cluster.oversubscription, src)

