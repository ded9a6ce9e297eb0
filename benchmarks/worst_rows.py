"""The rows `trainscale validate` misses by more than 10 %, set against their own tables (issue 20's worst row).

    PYTHONPATH=src .venv/bin/python benchmarks/worst_rows.py

Only catalog/runs.toml (the public set) and validate's own predictions at the catalog constants are read; nothing
is fitted. Three views:

1. Sequence series: the rows of one table that share model, GPU generation, software and GPU count, sorted by
   sequence length. Between neighbours the planner's error moves only where the published row moves differently
   from what the model's own structure implies (the attention share of a token's work, s / 6d for a GPT block).
   Printed: each step's published and predicted throughput ratio and the change of error in points; a step of more
   than 15 points is marked; then the count of steps, their mean |change| and the largest within 15 points.
2. Scale series: rows that share model, generation, software, sequence and micro-batch but not GPU count (a fixed
   per-GPU batch). Printed: published and predicted tokens/s/GPU against the series' smallest GPU count.
3. MLPerf GPT-3 175B on the same Eos H100 cluster, round by round: seconds per million tokens per GPU (step time x
   GPUs / global batch tokens), published and predicted, at 256-512 GPUs and at 10,240-11,616.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from trainscale.estimate.planner.validate import Run, load_runs, validate
from trainscale.specs import Layout


def _series(rows: list[dict[str, Any]], runs: dict[str, Run],
            key: Callable[[dict[str, Any], Run], tuple]) -> dict[tuple, list[dict[str, Any]]]:
    """The tokens/s/GPU rows grouped by ``key(row, run)``."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["figure"] == "tokens_per_s_per_gpu":
            groups[key(r, runs[r["id"]])].append(r)
    return groups


def sequence_series(rows: list[dict[str, Any]], runs: dict[str, Run]) -> tuple[list[tuple[str, int]], list[float]]:
    """Print each sequence step; return the steps above 15 points and every step's change of error (points)."""
    groups = _series(rows, runs, lambda r, run: (run.model, r["generation"], r["software"], r["gpus"], run.precision))
    marked, steps = [], []
    print("1. Sequence series (same model, generation, software, GPUs): published vs predicted ratio per step")
    print(f"   {'series':<44} {'seq':>13} {'published':>9} {'predicted':>9} {'error':>15} {'step':>7}")
    for key, g in sorted(groups.items(), key=lambda kv: str(kv[0])):
        g.sort(key=lambda r: runs[r["id"]].seq)
        if len(g) < 2:
            continue
        name = f"{key[0]} {key[1]} {key[2]} x{key[3]}" + (f" {key[4]}" if key[4] else "")
        for a, b in zip(g, g[1:], strict=False):
            sa, sb = runs[a["id"]].seq, runs[b["id"]].seq
            if sa == sb:
                continue
            pub, pred = b["published"] / a["published"], b["predicted"] / a["predicted"]
            step = (b["error"] - a["error"]) * 100
            steps.append(step)
            flag = " <<" if abs(step) > 15 else ""
            if flag:
                marked.append((name, sb))
            print(f"   {name:<44} {sa:>6}>{sb:<6} {pub:>9.3f} {pred:>9.3f} {a['error']:>+7.1%}>{b['error']:<+7.1%}"
                  f" {step:>+6.1f}{flag}")
    return marked, steps


def scale_series(rows: list[dict[str, Any]], runs: dict[str, Run]) -> None:
    groups = _series(rows, runs,
                     lambda r, run: (run.model, r["generation"], r["software"], run.seq, Layout.parse(run.layout).mb))
    print("\n2. Scale series (same model, generation, software, sequence, micro-batch): tokens/s/GPU against the "
          "smallest GPU count")
    print(f"   {'series':<52} {'GPUs':>6} {'published':>10} {'predicted':>10} {'error':>7}")
    for key, g in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if len({r["gpus"] for r in g}) < 3:
            continue
        g.sort(key=lambda r: r["gpus"])
        base = g[0]
        name = f"{key[0]} {key[1]} {key[2]} s{key[3]} mb{key[4]}"
        for r in g:
            print(f"   {name:<52} {r['gpus']:>6} {r['published'] / base['published']:>10.3f} "
                  f"{r['predicted'] / base['predicted']:>10.3f} {r['error']:>+7.1%}")


def mlperf_rounds(rows: list[dict[str, Any]], runs: dict[str, Run]) -> None:
    print("\n3. MLPerf GPT-3 175B on Eos (H100), GPU-seconds per million tokens (step time x GPUs / batch tokens)")
    print(f"   {'row':<36} {'preset':<22} {'GPUs':>6} {'published':>10} {'predicted':>10} {'error':>7}")
    for r in rows:
        run = runs[r["id"]]
        if run.model != "gpt3-175b" or run.cluster != "eos-h100":
            continue
        k = run.gpus / run.global_batch_tokens * 1e6
        print(f"   {r['id']:<36} {r['software']:<22} {r['gpus']:>6} {r['published'] * k:>10.1f} "
              f"{r['predicted'] * k:>10.1f} {r['error']:>+7.1%}")


def main() -> None:
    out = validate()
    rows = out["runs"]
    runs = {r.id: r for r in load_runs()}
    worst = [r for r in rows if abs(r["error"]) > 0.10]
    print(f"{len(rows)} rows; mean |error| {out['mean_abs_error']:.2%}; {len(worst)} rows above 10 %:")
    for r in sorted(worst, key=lambda r: -abs(r["error"])):
        print(f"   {r['id']:<40} {r['software'] + ' / ' + r['generation']:<36} {r['error']:>+7.1%}")
    print()
    marked, steps = sequence_series(rows, runs)
    within = [abs(s) for s in steps if abs(s) <= 15]
    print(f"   {len(steps)} steps, mean |step| {sum(abs(s) for s in steps) / len(steps):.1f} points; "
          f"{len(within)} within 15 points (largest {max(within):.1f})")
    print(f"   steps above 15 points: {', '.join(f'{n} at {s}' for n, s in marked) or 'none'}")
    scale_series(rows, runs)
    mlperf_rounds(rows, runs)


if __name__ == "__main__":
    main()
