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


def residuals() -> list[tuple[str, str, float]]:
    """(software, GPU generation, leave-one-out error) of every catalog validation row (cached)."""
    return [(r["software"], r["generation"], r["loo_error"]) for r in catalog_validation()["runs"]]


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
