"""Step-time prediction error after calibration: calibrate this machine, then run real layouts and compare
each measured step time with estimate/measured/rank.py's prediction from the profile (plus the per-rank state,
activation and FLOP checks, which must be exact or within their tolerances).

    .venv/bin/python benchmarks/bench_calibrate.py [--config configs/small.toml] [--steps 5] [--json out.json]

Prints a markdown table (recorded in benchmarks/RESULTS.md) and the median |error|; the target is < 20 %.
The calibration and the layouts run back to back, so the machine's state is the same for both; each
layout's step time is the median of ``--steps`` timed steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainscale.estimate.profile import write_profile
from trainscale.runtime.config import load_config
from trainscale.runtime.probe.calibrate import calibrate
from trainscale.runtime.probe.compare import compare, compare_command
from trainscale.specs import Layout

ROOT = Path(__file__).resolve().parents[1]


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) CPU ticks so far from /proc/stat: a VM's stolen time, when its host is busy."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_since(start: tuple[int, int]) -> float:
    now = cpu_ticks()
    return (now[0] - start[0]) / max(1, now[1] - start[1])
# configs/small.toml's 16 sequences per step: without a pipeline, mb = the whole local batch (no gradient
# accumulation; an absent mb means 1, issue 12)
LAYOUTS = ["mb16", "rc=full,mb16", "dp2,mb8", "dp2,zero3,mb8", "tp2,mb16", "tp2,nosp,mb16", "cp2,mb16", "pp2,mb4",
           "pp2,mb2,v2,interleaved", "dp2,tp2,mb8", "fsdp4,mb4", "tp2,pp2,mb4"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "small.toml"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layouts", default=";".join(LAYOUTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config(args.config)
    layouts = args.layouts.split(";")
    worlds = sorted({Layout.parse(x).world_size for x in layouts})
    t0, ticks = time.perf_counter(), cpu_ticks()
    profile = calibrate(cfg.model, cfg.train.seq_len, cfg.train.global_batch, sorted({1, 2, *worlds}))
    t_cal, steal_cal = time.perf_counter() - t0, steal_since(ticks)
    ticks = cpu_ticks()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    measured: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_profile(profile, Path(tmp) / "profile.toml")
        for world in worlds:
            group = [x for x in layouts if Layout.parse(x).world_size == world]
            out = Path(tmp) / f"w{world}.json"
            proc = subprocess.run(compare_command(args.config, group, out, steps=args.steps), env=env,
                                  capture_output=True, text=True, cwd=ROOT)
            if proc.returncode:
                sys.exit(f"world {world} failed:\n{proc.stderr[-3000:]}")
            measured.update(json.loads(out.read_text()))
    steal_run = steal_since(ticks)
    results = [compare(cfg, Layout.parse(x), measured[x], profile) for x in layouts]

    proc1 = profile["processes"]["1"]
    print(f"calibration ({t_cal:.0f} s): {proc1['matmul_flops'] / 1e9:.1f} GFLOP/s layer GEMMs, "
          f"{proc1['attention_flops'] / 1e9:.1f} GFLOP/s attention, {proc1['memory_bandwidth'] / 1e9:.1f} GB/s "
          f"copy, one process; model {cfg.model.name}, {cfg.train.global_batch} x {cfg.train.seq_len} tokens/step; "
          f"CPU time stolen by the VM host: {steal_cal:.0%} during calibration, {steal_run:.0%} during the runs\n")
    print("| layout | processes | predicted ms | measured ms | error | state bytes | activations | FLOPs |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    errs = []
    for x, r in zip(layouts, results, strict=True):
        errs.append(abs(r["step_time_error"]))
        print(f"| {x or 'single process'} | {r['world_size']} | {r['step_time_predicted_s'] * 1e3:.1f} | "
              f"{r['step_time_measured_s'] * 1e3:.1f} | {r['step_time_error']:+.1%} | "
              f"{'exact' if r['state_exact'] else 'DIFFERENT'} | {r['activation_max_error']:.2%} | "
              f"{r['flops_max_error']:.2%} |")
    print(f"\nmedian |step-time error| {statistics.median(errs):.1%} over {len(errs)} layouts "
          f"(max {max(errs):.1%}); target < 20 %")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": profile, "measured": measured, "results": results,
                                               "steal": [steal_cal, steal_run]}, indent=1))


if __name__ == "__main__":
    main()
