"""Leave-one-out errors of `trainscale validate` row by row (issue 20, item 4).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_validate_loo.py

It runs validate's own code (``trainscale.estimate.planner.validate.validate(loo=True)``): every constant
catalog/planner.toml marks FITTED is refit, a GPU generation's together, by validate's one rule (``FIT_RULE``) on every
row (in-sample) and on every row but the one predicted (leave-one-out). Per row: its catalog, in-sample and
leave-one-out error and the values its leave-one-out fold fitted; then the mean / worst of each, and the
leave-one-out mean |error| per software / generation (what `plan`'s intervals are made of). Only catalog/runs.toml
(the public set) is read.
"""

from __future__ import annotations

from trainscale.estimate.planner.validate import FIT_RULE, validate


def main() -> None:
    out = validate(loo=True)
    print(f"rule: {FIT_RULE}")
    print(f"{'run':<34} {'software/gen':<30} {'catalog':>8} {'in-smp':>7} {'LOO':>7}  LOO fit")
    for r in out["runs"]:
        fit = " ".join(f"{v:.3f}" for v in r.get("loo_fit", {}).values())
        print(f"{r['id']:<34} {r['software'] + '/' + r['generation']:<30} {r['error']:>+8.1%} "
              f"{r['in_sample_error']:>+7.1%} {r['loo_error']:>+7.1%}  {fit}")
    for name, s in (("catalog", out), ("in-sample", out["in_sample"]), ("leave-one-out", out["loo"])):
        print(f"{name}: mean {s['mean_abs_error']:.2%}, worst {s['worst_abs_error']:.1%} ({s['worst_run']})")
    by: dict[str, list[float]] = {}
    for r in out["runs"]:
        by.setdefault(f"{r['software']}/{r['generation']}", []).append(abs(r["loo_error"]))
    print("leave-one-out mean |error| by software/generation:")
    for k, v in sorted(by.items(), key=lambda kv: -len(kv[1])):
        print(f"  {k:<32} {sum(v) / len(v):>6.1%} ({len(v)} rows)")
    for f in out["fit"]:
        print(f"{f['key']} [{f['scope']}]: catalog {f['catalog']:g}, in-sample {f['fit_all_rows']:.4f}, "
              f"leave-one-out {f['loo_min']:.4f}-{f['loo_max']:.4f}")


if __name__ == "__main__":
    main()
