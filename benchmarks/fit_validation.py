"""The one fit behind `trainscale validate`: sustained_clock_fraction per GPU generation, over the whole public set.

    .venv/bin/python benchmarks/fit_validation.py

Every other constant comes from a datasheet or a published microbenchmark (catalog/planner.toml). This script
evaluates every run of catalog/runs.toml for each candidate fraction (0.60 to 1.00 in steps of 0.02) and keeps,
per generation, the one with the smallest mean |log(predicted / published throughput)| over that generation's
runs; the generations share no run, so this is the joint minimum over the whole set. Its result is written into
catalog/planner.toml [generation.*] by hand, with this script named as the source.
"""

from __future__ import annotations

import math

import numpy as np

from trainscale.estimate.validate import load_runs, predict


def main() -> None:
    runs = load_runs()
    grid = np.round(np.arange(0.60, 1.0001, 0.02), 2)
    by_gen: dict[str, dict[float, list[float]]] = {}
    for f in grid:
        for run in runs:
            r = predict(run, {"sustained_clock_fraction": float(f)})
            by_gen.setdefault(r["generation"], {}).setdefault(float(f), []).append(abs(math.log1p(r["error"])))
    for gen, scores in sorted(by_gen.items()):
        best = min(scores, key=lambda f: float(np.mean(scores[f])))
        print(f"{gen}: sustained_clock_fraction = {best:.2f} (mean |log error| {np.mean(scores[best]):.3f} over "
              f"{len(scores[best])} runs; at 1.00: {np.mean(scores[1.0]):.3f})")


if __name__ == "__main__":
    main()
