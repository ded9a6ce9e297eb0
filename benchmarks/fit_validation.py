"""The one fit behind `trainscale validate`: sustained_clock_fraction per GPU generation, over the whole public set.

    .venv/bin/python benchmarks/fit_validation.py

Every other constant comes from a datasheet or a published microbenchmark (catalog/planner.toml). This script
evaluates every run of catalog/runs.toml for each candidate fraction (0.60 to 1.00 in steps of 0.01) and keeps,
per generation, the one with the smallest WORST |predicted / published throughput - 1| over that generation's
runs (ties: the smaller mean). The objective is the planner's promise — a bound on its error, not a good
average — so the constant is the one that minimises the worst case; the mean-minimising value is printed beside
it. The generations share no run, so this is the joint minimum over the whole set. Its result is written into
catalog/planner.toml [generation.*] by hand, with this script named as the source.
"""

from __future__ import annotations

import math

import numpy as np

from trainscale.estimate.planner.validate import load_runs, predict


def main() -> None:
    runs = load_runs()
    grid = np.round(np.arange(0.60, 1.0001, 0.01), 2)
    by_gen: dict[str, dict[float, list[float]]] = {}
    for f in grid:
        for run in runs:
            r = predict(run, {"sustained_clock_fraction": float(f)})
            by_gen.setdefault(r["generation"], {}).setdefault(float(f), []).append(abs(r["error"]))
    for gen, scores in sorted(by_gen.items()):
        best = min(scores, key=lambda f: (round(max(scores[f]), 6), float(np.mean(scores[f]))))
        by_mean = min(scores, key=lambda f: float(np.mean([abs(math.log1p(e)) for e in scores[f]])))
        print(f"{gen}: sustained_clock_fraction = {best:.2f} (worst |error| {max(scores[best]):.1%}, mean "
              f"{np.mean(scores[best]):.1%} over {len(scores[best])} runs; the mean-minimising {by_mean:.2f} gives "
              f"{max(scores[by_mean]):.1%} / {np.mean(scores[by_mean]):.1%}; at 1.00: {max(scores[1.0]):.1%} / "
              f"{np.mean(scores[1.0]):.1%})")


if __name__ == "__main__":
    main()
