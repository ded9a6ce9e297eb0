"""Leave-one-out errors of `trainscale validate` row by row (issue 20, item 4).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_validate_loo.py [--markdown]

It runs validate's own code (``trainscale.estimate.planner.validate.validate(loo=True)``): every constant
catalog/planner.toml marks FITTED is refit, a GPU generation's together, by validate's one rule (``FIT_RULE``) on every
row (in-sample) and on every row but the one predicted (leave-one-out). Per row: its catalog, in-sample and
leave-one-out error and the values its leave-one-out fold fitted; then the mean / worst of each, and the
leave-one-out mean |error| per software / generation (what `plan`'s intervals are made of). Only catalog/runs.toml
(the public set) is read. --markdown prints the same as benchmarks/RESULTS.md tables (every row: its figure, the
published and predicted value, the catalog / in-sample / leave-one-out errors; then the summaries).
"""

from __future__ import annotations

import sys
from typing import Any

from trainscale.estimate.planner.validate import FIGURE_LABELS, FIT_RULE, loo_by_software, validate


def markdown(out: dict[str, Any]) -> None:
    print(f"Fit rule: {FIT_RULE}.\n")
    print("| run | software / GPU generation | GPUs | figure | published | predicted | catalog | in-sample | LOO |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for r in out["runs"]:
        print(f"| {r['id']} | {r['software']} / {r['generation']} | {r['gpus']:,} | {FIGURE_LABELS[r['figure']]} "
              f"| {r['published']:,.4g} "
              f"| {r['predicted']:,.4g} | {r['error']:+.1%} | {r['in_sample_error']:+.1%} | {r['loo_error']:+.1%} |")
    print("\n| | mean \\|error\\| | worst \\|error\\| | worst row |\n|---|---:|---:|---|")
    for name, s in (("catalog constants", out), ("in-sample", out["in_sample"]), ("leave-one-out", out["loo"])):
        print(f"| {name} | {s['mean_abs_error']:.2%} | {s['worst_abs_error']:.1%} | {s['worst_run']} |")
    print("\n| software / GPU generation | rows | leave-one-out mean \\|error\\| |\n|---|---:|---:|")
    for (sw, gen), v in sorted(loo_by_software(out["runs"]).items(), key=lambda kv: -len(kv[1])):
        print(f"| {sw} / {gen} | {len(v)} | {sum(v) / len(v):.1%} |")
    print("\n| FITTED constant | catalog | in-sample fit | leave-one-out fits |\n|---|---:|---:|---|")
    for f in out["fit"]:
        print(f"| {f['key']} ({f['scope']}) | {f['catalog']:g} | {f['fit_all_rows']:.4f} | "
              f"{f['loo_min']:.4f}-{f['loo_max']:.4f} |")


def main() -> None:
    out = validate(loo=True)
    if "--markdown" in sys.argv[1:]:
        markdown(out)
        return
    print(f"rule: {FIT_RULE}")
    print(f"{'run':<34} {'software/gen':<30} {'catalog':>8} {'in-smp':>7} {'LOO':>7}  LOO fit")
    for r in out["runs"]:
        fit = " ".join(f"{v:.3f}" for v in r.get("loo_fit", {}).values())
        print(f"{r['id']:<34} {r['software'] + '/' + r['generation']:<30} {r['error']:>+8.1%} "
              f"{r['in_sample_error']:>+7.1%} {r['loo_error']:>+7.1%}  {fit}")
    for name, s in (("catalog", out), ("in-sample", out["in_sample"]), ("leave-one-out", out["loo"])):
        print(f"{name}: mean {s['mean_abs_error']:.2%}, worst {s['worst_abs_error']:.1%} ({s['worst_run']})")
    print("leave-one-out mean |error| by software/generation:")
    for (sw, gen), v in sorted(loo_by_software(out["runs"]).items(), key=lambda kv: -len(kv[1])):
        print(f"  {sw + '/' + gen:<32} {sum(v) / len(v):>6.1%} ({len(v)} rows)")
    for f in out["fit"]:
        print(f"{f['key']} [{f['scope']}]: catalog {f['catalog']:g}, in-sample {f['fit_all_rows']:.4f}, "
              f"leave-one-out {f['loo_min']:.4f}-{f['loo_max']:.4f}")


if __name__ == "__main__":
    main()
