"""The fit behind `trainscale validate`: every constant catalog/planner.toml marks FITTED, refit on the public set.

    PYTHONPATH=src .venv/bin/python benchmarks/fit_validation.py [--grid-check]

It runs validate's own code (``trainscale.estimate.planner.validate.validate(loo=True)``: its grid, its search and
its one rule, ``FIT_RULE``, the smallest mean |error| with ties to the smaller worst) and prints, per constant, the
value fitted on every row of its GPU generation (a generation's FITTED constants are fitted together), the range of
its leave-one-out refits, and the catalog's value; then the catalog, in-sample and leave-one-out mean / worst |error|.
The fitted values, rounded as catalog/planner.toml writes them (two decimals), are what the catalog holds; its
figures then equal the in-sample ones up to that rounding.

--grid-check refits with finer grids (more nodes, more candidates, no zoom) and prints the same figures for each,
so a minimum that only the shipped grid finds shows up as a difference.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import trainscale.estimate.planner.validate as V

# name -> (FIT_NODES, FIT_NODES_JOINT, FIT_FINE, FIT_FINE_JOINT, FIT_ZOOM); None: validate's own
GRIDS: dict[str, tuple | None] = {
    "shipped": None,
    "no zoom (the candidates alone)": (V.FIT_NODES, V.FIT_NODES_JOINT, V.FIT_FINE, V.FIT_FINE_JOINT, (21, 0)),
    "5 even joint nodes": (V.FIT_NODES, (0.6, 0.8, 1.0, 1.2, 1.4), V.FIT_FINE, V.FIT_FINE_JOINT, V.FIT_ZOOM),
    "9 even joint nodes": (V.FIT_NODES, tuple(round(0.6 + 0.1 * i, 1) for i in range(9)), V.FIT_FINE,
                           V.FIT_FINE_JOINT, V.FIT_ZOOM),
    "candidates 1281 / 321 x 321, no zoom": (V.FIT_NODES, V.FIT_NODES_JOINT, 1281, 321, (21, 0)),
    "nodes 33 / 17 x 17 (steps 0.025 / 0.05)": (tuple(round(0.6 + 0.025 * i, 3) for i in range(33)),
                                                tuple(round(0.6 + 0.05 * i, 2) for i in range(17)), V.FIT_FINE,
                                                V.FIT_FINE_JOINT, V.FIT_ZOOM),
}
_KNOBS = ("FIT_NODES", "FIT_NODES_JOINT", "FIT_FINE", "FIT_FINE_JOINT", "FIT_ZOOM")


@contextmanager
def grid(values: tuple | None):
    """validate's grid constants replaced for the duration (a benchmark's knob, never the CLI's)."""
    saved = tuple(getattr(V, k) for k in _KNOBS)
    for k, v in zip(_KNOBS, values or saved, strict=True):
        setattr(V, k, v)
    try:
        yield
    finally:
        for k, v in zip(_KNOBS, saved, strict=True):
            setattr(V, k, v)


def summary(out: dict) -> str:
    def mw(s: dict) -> str:
        return f"{s['mean_abs_error']:.2%} / {s['worst_abs_error']:.1%}"
    return (f"catalog {mw(out)}, in-sample {mw(out['in_sample'])}, leave-one-out {mw(out['loo'])} "
            f"(worst {out['loo']['worst_run']})")


def fits(out: dict) -> list[str]:
    return [f"{f['key']} [{f['scope']}] = {f['fit_all_rows']:.4f} -> {round(f['fit_all_rows'], 2):.2f} "
            f"(catalog {f['catalog']:g}; {f['rows']} rows, {f['rows_moved']} moved by it; leave-one-out "
            f"{f['loo_min']:.4f}-{f['loo_max']:.4f})" for f in out["fit"]]


def main() -> None:
    print(f"rule: {V.FIT_RULE}")
    for name, values in GRIDS.items() if "--grid-check" in sys.argv else [("shipped", None)]:
        with grid(values):
            t = time.process_time()
            out = V.validate(loo=True)
            cpu = time.process_time() - t
        print(f"{name} ({cpu:.1f} s CPU): {summary(out)}")
        for line in fits(out):
            print("  " + line)


if __name__ == "__main__":
    main()
