"""How sure the planner is: an interval on a prediction from the validation residuals of its software and GPU.

The residuals are the leave-one-out errors of `trainscale validate --loo` over catalog/runs.toml (e = predicted /
published throughput - 1, + = predicted faster), computed from the catalog at call time and cached per process.
A predicted time-like figure T (step time, days, GPU-hours) becomes [T x (1 + e_min), T x (1 + e_max)]: the
published time is the predicted one x (1 + e). The rule:

1. the rows that ran the same software preset on the same GPU generation, when there are at least MIN_ROWS of
   them: the range [min e, max e] of their leave-one-out errors. For n exchangeable rows a new row's error falls
   inside the range of n with probability (n - 1) / (n + 1) (order statistics; distribution-free), so the
   interval's stated coverage grows with the rows behind it;
2. else the rows of that GPU generation (any software), at least MIN_ROWS, their range widened WIDEN times
   about the point estimate (another software's residuals say less about this one);
3. else every row, widened WIDEN_ALL times.

The interval always contains the point estimate (lo <= 1 <= hi). No table is hard-coded: change the rows or the
model and the intervals follow.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from trainscale.errors import TrainscaleError
from trainscale.estimate.planner.validate import catalog_validation

MIN_ROWS = 5  # fewer rows of one (software, generation) than this and the interval pools wider rows
WIDEN = 1.5  # pooled over the GPU generation: another software's residuals, so a wider band
WIDEN_ALL = 2.0  # pooled over every row: neither the software nor the GPU generation matches


@dataclass(frozen=True)
class Interval:
    """Factors on a predicted time-like figure: the truth lies in [value x lo, value x hi] (coverage: see basis)."""

    lo: float
    hi: float
    n_rows: int
    basis: str

    def apply(self, value: float) -> tuple[float, float]:
        """The interval on a step time, days or GPU-hours figure."""
        return value * self.lo, value * self.hi

    def apply_throughput(self, value: float) -> tuple[float, float]:
        """The interval on a throughput figure (tokens/s, TFLOP/s, MFU): the time factors inverted."""
        return value / self.hi, value / self.lo


def interval_from_errors(errors: Iterable[float], basis: str, widen: float = 1.0) -> Interval:
    """The range of the throughput errors as time factors (1 + e), widened ``widen`` times about 1."""
    e = list(errors)
    if not e:
        raise TrainscaleError(f"no validation rows to build an interval from ({basis})")
    lo, hi = 1.0 + widen * min(min(e), 0.0), 1.0 + widen * max(max(e), 0.0)
    n = len(e)
    cover = f"a new row inside the range of {n} with probability {(n - 1) / (n + 1):.0%}" if n > 1 else "one row"
    return Interval(max(lo, 0.05), hi, n, f"{basis}: leave-one-out errors of {n} validate rows"
                    + (f", widened x{widen:g}" if widen != 1.0 else f" ({cover})"))


@cache
def model_fingerprint() -> str:
    """sha256 of everything a validation residual depends on: the catalog's TOML files and the planner's code
    (estimate/, specs, rules, hf). Change any of it and the cached residuals are recomputed."""
    import hashlib

    root = Path(__file__).resolve().parents[2]  # src/trainscale
    files = sorted([*(root / "catalog").glob("*.toml"), *(root / "estimate").rglob("*.py"),
                    root / "specs.py", root / "rules.py", root / "hf.py"])
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def cache_path() -> Path:
    """$TRAINSCALE_CACHE, else $XDG_CACHE_HOME/trainscale, else ~/.cache/trainscale: residuals-<fingerprint>.json."""
    import os

    base = os.environ.get("TRAINSCALE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "trainscale"
    return Path(base) / f"residuals-{model_fingerprint()[:32]}.json"


def _read_cached(path: Path) -> list[tuple[str, str, float]] | None:
    """The cached residuals, or None when absent or not exactly what ``_write_cached`` writes."""
    import math

    from trainscale.safeio import read_json_object

    try:
        got = read_json_object(path, "residual cache")
    except TrainscaleError:
        return None
    rows = got.get("rows")
    if got.get("fingerprint") != model_fingerprint() or not isinstance(rows, list):
        return None
    ok = all(isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and isinstance(r[1], str)
             and isinstance(r[2], (int, float)) and not isinstance(r[2], bool) and math.isfinite(r[2]) for r in rows)
    return [(r[0], r[1], float(r[2])) for r in rows] if ok and rows else None


@cache
def residuals() -> list[tuple[str, str, float]]:
    """(software, GPU generation, leave-one-out error) of every catalog validation row: computed by
    ``validate(loo=True)`` (seconds) once per model fingerprint, then read from the cache file."""
    from trainscale.safeio import atomic_write_json

    path = cache_path()
    got = _read_cached(path)
    if got is not None:
        return got
    rows = [(r["software"], r["generation"], r["loo_error"]) for r in catalog_validation()["runs"]]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"fingerprint": model_fingerprint(), "rows": [list(r) for r in rows]})
    except OSError:  # a read-only home: computed again next time, nothing lost
        pass
    return rows


def annotate(row: dict, software: str, gpu_generation: str) -> dict:
    """A planner row with its intervals: step_time_interval_s, days_interval, gpu_hours_interval (low, high) and
    interval_basis (which rows, how many)."""
    iv = interval_for(software, gpu_generation)
    out = {**row, "step_time_interval_s": iv.apply(row["step_time_s"]), "interval_basis": iv.basis}
    if row.get("days") is not None:
        out["days_interval"] = iv.apply(row["days"])
        out["gpu_hours_interval"] = iv.apply(row["gpu_hours"])
    return out


def interval_for(software: str, gpu_generation: str,
                 rows: list[tuple[str, str, float]] | None = None) -> Interval:
    """The interval for a prediction of ``software`` on a GPU of ``gpu_generation`` (module docstring's rule);
    ``rows`` replaces the catalog's residuals (software, generation, error)."""
    rows = residuals() if rows is None else rows
    own = [e for s, g, e in rows if s == software and g == gpu_generation]
    if len(own) >= MIN_ROWS:
        return interval_from_errors(own, f"{software} on {gpu_generation}")
    gen = [e for _, g, e in rows if g == gpu_generation]
    if len(gen) >= MIN_ROWS:
        return interval_from_errors(gen, f"{gpu_generation}, any software ({len(own)} rows of {software})", WIDEN)
    return interval_from_errors([e for *_, e in rows], f"every row ({len(own)} of {software} on {gpu_generation})",
                                WIDEN_ALL)
