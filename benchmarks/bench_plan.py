"""Time the planner's full search: Llama 3.1 405B on 16,384 H100s, seq 8192, 2^24-token batches.

    .venv/bin/python benchmarks/bench_plan.py [--repeat 5]

Prints the search time (best and median of --repeat runs, each enumerating and scoring the whole
space), the size of the space, the winner, and — for scale — what scoring layouts one at a time
through the same model costs per layout, extrapolated to the whole space.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from trainscale.estimate.planner import plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--one-by-one", type=int, default=200, help="layouts to score one at a time for comparison")
    args = ap.parse_args()

    p = plan.problem(model="llama3.1-405b", gpu="h100-sxm", gpus=16384, seq=8192, global_batch_tokens=2**24,
                     software="trainscale")
    p.search()  # warm caches (catalog parsing, numpy)
    times, res = [], None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        res = p.search()
        times.append(time.perf_counter() - t0)
    assert res is not None
    b = res.best()
    best = p.row(res.cfg, res.res, b)

    idx = res.order[: args.one_by_one]
    t0 = time.perf_counter()
    for i in idx:
        p.evaluate_layout(plan.layout_at(res.cfg, int(i)))
    per_layout = (time.perf_counter() - t0) / len(idx)

    print(f"machine: {platform.machine()} {platform.processor() or ''} python {platform.python_version()}")
    print(f"space: {res.generated:,} candidates, {res.n_valid:,} valid, {res.n_fit:,} fit")
    print(f"search (enumerate + score + rank): best {min(times):.3f} s, median {statistics.median(times):.3f} s "
          f"over {args.repeat} runs")
    print(f"one layout at a time: {per_layout * 1e3:.2f} ms each -> {per_layout * res.n_valid:,.0f} s for the space "
          f"({per_layout * res.n_valid / min(times):,.0f}x slower)")
    print(f"best: {best['layout']}  MFU {best['mfu']:.1%}  {best['memory_per_gpu_bytes']['total'] / 1e9:.1f} GB")


if __name__ == "__main__":
    main()
