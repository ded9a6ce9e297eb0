"""The hardware profile: the one description of what ``trainscale calibrate`` writes and what the planner
(estimate/planner/step.py) and the rank-by-rank model (estimate/measured/machine.py) read -- its tables, their
figures, its version, the TOML it is stored as, and reading and checking it. No torch, so ``trainscale plan``
reads it.

Tables (process counts as strings):

- ``version``: ``PROFILE_VERSION``; a profile without one is version 1 (written before it was recorded).
- ``[machine]``: where and how it was measured (device, device_name, host, cores, torch, dtype, model, ...).
- ``[processes.N]``: what ONE process achieves while N run the same measurement at once (``COMPUTE_KEYS``).
- ``[collectives.N.op]`` for N >= 2 and op in ``COLLECTIVES``: latency_s, bus_bandwidth, algbw and the
  raw times per message size.
- ``[tensor_parallel.N]``: one layer under tensor parallelism over N processes, measured and composed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.safeio import atomic_write_text, parse_toml, read_text, toml_text

PROFILE_VERSION = 1

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")

# every figure of a [processes.N] table calibrate writes
COMPUTE_KEYS = ("matmul_flops", "head_matmul_flops", "attention_flops", "memory_bandwidth",
                "optimizer_seconds_per_param", "optimizer_bytes_per_param", "layer_seconds", "layer_seconds_one",
                "layer_fixed_seconds", "elementwise_seconds_per_token")
# what is left of a measurement once its parts are taken out: 0 is a real value
DERIVED_COMPUTE_KEYS = ("layer_fixed_seconds", "elementwise_seconds_per_token")
# the ones a step-time prediction cannot do without (the others came later and have fallbacks)
REQUIRED_COMPUTE_KEYS = ("matmul_flops", "attention_flops", "memory_bandwidth", "optimizer_seconds_per_param")

TABLES = ("machine", "processes")  # what makes a file a hardware profile


def is_hardware_profile(data: dict[str, Any]) -> bool:
    """A calibrated hardware profile (rather than flat planner settings)?"""
    return "processes" in data


def check_profile(data: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """``data`` if it is a hardware profile this version of trainscale reads; else one-sentence TrainscaleError."""
    for table in TABLES:
        if not isinstance(data.get(table), dict):
            raise TrainscaleError(f"hardware profile {path} has no [{table}] table; is it a trainscale profile?")
    version = data.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TrainscaleError(f"hardware profile {path} has version {version!r}, not a positive integer")
    if version > PROFILE_VERSION:
        raise TrainscaleError(f"hardware profile {path} is version {version}; this trainscale reads up to version "
                              f"{PROFILE_VERSION} (update trainscale or run trainscale calibrate again)")
    for n, row in data["processes"].items():
        for key in COMPUTE_KEYS:
            if isinstance(row, dict) and key in row:
                _check_figure(row[key], f"[processes.{n}] {key}", path, zero_ok=key in DERIVED_COMPUTE_KEYS)
    for n, ops in (data.get("collectives") or {}).items():
        for op, f in (ops.items() if isinstance(ops, dict) else ()):
            for key, zero_ok in (("latency_s", True), ("bus_bandwidth", False)):
                if isinstance(f, dict) and key in f:
                    _check_figure(f[key], f"[collectives.{n}.{op}] {key}", path, zero_ok)
    return data


def _check_figure(v: Any, where: str, path: str | Path, zero_ok: bool) -> None:
    """A measured figure the step-time model multiplies or divides by: a finite number, positive (or, for a
    derived remainder, non-negative); one sentence otherwise (a hand-edited nan would predict nan)."""
    number = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if not number or v < 0 or (v == 0 and not zero_ok):
        kind = "non-negative" if zero_ok else "positive"
        raise TrainscaleError(f"hardware profile {path}: {where} must be a finite {kind} number, not {v!r}")


def read_profile(path: str | Path) -> dict[str, Any]:
    """Read and check a hardware profile written by ``write_profile``."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise TrainscaleError(f"hardware profile {path} does not exist; `trainscale calibrate` writes one")
    data = parse_toml(read_text(path, "hardware profile"), f"hardware profile {path}")
    return check_profile(data, path)


def write_profile(profile: dict[str, Any], path: str | Path) -> Path:
    """Write ``profile`` as TOML to ``path`` (directories created, replaced atomically)."""
    path = Path(path)
    text = to_toml(profile)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    except OSError as e:
        raise TrainscaleError(f"cannot write the profile to {path}: {e.strerror or e}") from None
    return path


def to_toml(profile: dict[str, Any]) -> str:
    """The profile as TOML (floats in shortest round-trip form, so reading it back gives the same numbers)."""
    return toml_text(profile, header="trainscale hardware profile, written by `trainscale calibrate`")
