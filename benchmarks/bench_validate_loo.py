"""Leave-one-out error of the one fitted constant behind `trainscale validate` (issue 20, item 4).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_validate_loo.py

sustained_clock_fraction is fitted per GPU generation on the public set (benchmarks/fit_validation.py: grid 0.60 to
1.00 in 0.01 steps, the smallest WORST |error|, ties by the mean). Here each run is left out in turn: the fraction
of its generation is re-fitted on the other runs of that generation, the left-out run predicted with it, and its
error recorded; the in-sample errors (the catalog's fraction) are printed beside. A run alone in its generation
has nothing to be fitted on and is predicted at the grid's 1.00 (no fit). Held-out sets never enter: only
catalog/runs.toml (the public set) is read.
"""

from __future__ import annotations

import numpy as np

from trainscale.estimate.planner.validate import load_runs, predict

GRID = np.round(np.arange(0.60, 1.0001, 0.01), 2)


def fit(errors: dict[float, list[float]]) -> float:
    """The fraction with the smallest worst |error| (ties: the smaller mean), as fit_validation.py."""
    return min(errors, key=lambda f: (round(max(errors[f]), 6), float(np.mean(errors[f]))))


def main() -> None:
    runs = load_runs()
    table = {float(f): [predict(run, {"sustained_clock_fraction": float(f)}) for run in runs] for f in GRID}
    in_sample = [predict(run) for run in runs]
    gens = [r["generation"] for r in table[1.0]]
    loo = []
    print(f"{'run':<28} {'gen':<8} {'in-sample':>9} {'LOO fit':>8} {'LOO':>7}")
    for i, run in enumerate(runs):
        others = [j for j in range(len(runs)) if j != i and gens[j] == gens[i]]
        f = fit({g: [abs(table[g][j]["error"]) for j in others] for g in table}) if others else 1.0
        e = table[f][i]["error"]
        loo.append(abs(e))
        print(f"{run.id:<28} {gens[i]:<8} {in_sample[i]['error']:>+9.1%} "
              f"{f:>8.2f} {e:>+7.1%}")
    ins = [abs(r["error"]) for r in in_sample]
    print(f"in-sample: mean {np.mean(ins):.1%}, worst {max(ins):.1%}; leave-one-out: mean {np.mean(loo):.1%}, "
          f"worst {max(loo):.1%} over {len(runs)} runs")


if __name__ == "__main__":
    main()
