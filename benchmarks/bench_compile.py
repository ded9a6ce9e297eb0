"""What ``--compile`` (torch.compile of each transformer block) costs and buys on this machine.

For each config, one process, the Trainer's own step, eager then compiled, each in a fresh process group
state: the first step's time (for the compiled run: tracing + Inductor's code generation + the step; the
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


def timed(name: str, steps: int, compile: bool, precision: str, layout: str) -> dict:
    cfg = load_config(ROOT / "configs" / f"{name}.toml",
                      {"train": {"steps": steps + 1, "compile": compile, "precision": precision}})
    torch._dynamo.reset()  # no graph cached from an earlier run
    trainer = Trainer(cfg, Layout.parse(layout), out=None, log=lambda _m: None)
    rows = [trainer.train_step() for _ in range(steps + 1)]
    times = [r["step_time_s"] for r in rows]
    dist.barrier()
    return {"first_step_s": times[0], "median_step_s": statistics.median(times[1:]),
            "losses": [r["loss"] for r in rows],
            "tokens_per_step": cfg.train.global_batch * cfg.train.seq_len}


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
        eager = timed(name, args.steps, False, args.precision, args.layout)
        comp = timed(name, args.steps, True, args.precision, args.layout)
        diff = max(abs(a - b) for a, b in zip(eager["losses"], comp["losses"], strict=True))
        rows.append({"config": name, "eager": eager, "compiled": comp, "max_loss_diff": diff,
                     "compile_s": comp["first_step_s"] - eager["first_step_s"],
                     "speedup": eager["median_step_s"] / comp["median_step_s"]})
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {load:.1f}; precision {args.precision}, "
          f"layout {args.layout or 'single process'}, {args.steps} timed steps")
    print("| config | tokens/step | compile time | eager step | compiled step | speed-up | eager tok/s "
          "| compiled tok/s | max loss diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e, c, tok = r["eager"], r["compiled"], r["eager"]["tokens_per_step"]
        print(f"| {r['config']} | {tok:,} | {r['compile_s']:.1f} s | {e['median_step_s'] * 1e3:.1f} ms | "
              f"{c['median_step_s'] * 1e3:.1f} ms | {r['speedup']:.2f}x | {tok / e['median_step_s']:,.0f} | "
              f"{tok / c['median_step_s']:,.0f} | {r['max_loss_diff']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
