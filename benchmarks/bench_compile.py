"""What ``--compile`` (torch.compile of each transformer block) costs and buys on this machine.

For each config, one process, the Trainer's own step, eager and compiled Trainers stepping alternately:
the first step's time (for the compiled run: tracing + Inductor's code generation + the step; the
compile time is that minus the eager first step) and the median of the steps after it (steady state).
Inductor's on-disk caches are off (a cold compile, as on a fresh machine) unless --warm-cache.

    .venv/bin/python benchmarks/bench_compile.py [--configs tiny,small] [--steps 20] [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

if "--warm-cache" not in sys.argv:
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # before torch reads its config

import torch  # noqa: E402
import torch.distributed as dist

from trainscale.runtime.config import load_config  # noqa: E402
from trainscale.runtime.train import Trainer  # noqa: E402
from trainscale.specs import Layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def bench(name: str, steps: int, precision: str, layout: str) -> dict:
    """Two Trainers in one process, eager and compiled, stepping alternately (so a busy machine slows both
    alike); the first step of each is timed apart (the compiled one compiles)."""
    torch._dynamo.reset()
    trainers = {}
    for compile in (False, True):
        cfg = load_config(ROOT / "configs" / f"{name}.toml",
                          {"train": {"steps": steps + 1, "compile": compile, "precision": precision}})
        trainers[compile] = Trainer(cfg, Layout.parse(layout), out=None, log=lambda _m: None)
    rows: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(steps + 1):
        for compile, trainer in trainers.items():
            rows[compile].append(trainer.train_step())
    dist.barrier()
    out = {}
    for compile, rs in rows.items():
        times = [r["step_time_s"] for r in rs]
        out["compiled" if compile else "eager"] = {
            "first_step_s": times[0], "median_step_s": statistics.median(times[1:]), "best_step_s": min(times[1:]),
            "losses": [r["loss"] for r in rs], "step_times_s": times,
            "tokens_per_step": cfg.train.global_batch * cfg.train.seq_len}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--layout", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--warm-cache", action="store_true", help="let Inductor reuse its on-disk caches")
    args = ap.parse_args()
    rows = []
    for name in args.configs.split(","):
        got = bench(name, args.steps, args.precision, args.layout)
        eager, comp = got["eager"], got["compiled"]
        diff = max(abs(a - b) for a, b in zip(eager["losses"], comp["losses"], strict=True))
        rows.append({"config": name, "eager": eager, "compiled": comp, "max_loss_diff": diff,
                     "compile_s": comp["first_step_s"] - eager["first_step_s"],
                     "speedup": eager["median_step_s"] / comp["median_step_s"],
                     "best_speedup": eager["best_step_s"] / comp["best_step_s"]})
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {load:.1f}; precision {args.precision}, "
          f"layout {args.layout or 'single process'}, {args.steps} timed steps")
    print("| config | tokens/step | compile time | eager step | compiled step | speed-up (median / best) "
          "| eager tok/s | compiled tok/s | max loss diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e, c, tok = r["eager"], r["compiled"], r["eager"]["tokens_per_step"]
        print(f"| {r['config']} | {tok:,} | {r['compile_s']:.1f} s | {e['median_step_s'] * 1e3:.1f} ms | "
              f"{c['median_step_s'] * 1e3:.1f} ms | {r['speedup']:.2f}x / {r['best_speedup']:.2f}x | "
              f"{tok / e['median_step_s']:,.0f} | "
              f"{tok / c['median_step_s']:,.0f} | {r['max_loss_diff']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
