"""Restart time: from a rank's failure to the first step after the job resumed, for 2 and 4 processes.

Each run trains configs/tiny.toml with a checkpoint every 4 steps and ``--inject crash@step=11,rank=1``
(the rank exits at the start of step 11). torchrun restarts the workers, which resume from step 8's
checkpoint. From metrics.jsonl (wall-clock ``wall`` on every step row):

  failure        the end of step 10 (the last step before the crash)
  restart time   the first step row of the restarted attempt - failure - that step's own step time
                 (so it is the time with no training: detect, tear down, start processes, rendezvous,
                 build the model, load and reshard the checkpoint)
  lost work      steps 9-10, run again

    .venv/bin/python benchmarks/bench_restart.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {2: "dp2", 4: "dp2,tp2"}


def one(world: int, tmp: Path) -> dict[str, float]:
    cfg = tmp / "tiny-restart.toml"
    cfg.write_text((ROOT / "configs" / "tiny.toml").read_text() + "\n[checkpoint]\nevery_steps = 4\nkeep = 2\n")
    run = tmp / f"run{world}"
    p = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(cfg), "--layout", LAYOUTS[world],
                        "--steps", "16", "--out", str(run), "--inject", "crash@step=11,rank=1", "--max-restarts", "1",
                        "--json"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    if p.returncode:
        raise SystemExit(p.stderr[-2000:])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    before = [r for r in steps if r["attempt"] == 0]
    after = [r for r in steps if r["attempt"] == 1]
    fail = before[-1]["wall"]
    first = after[0]
    return {"restart_s": first["wall"] - first["step_time_s"] - fail, "lost_steps": len(before) - after[0]["step"] + 1,
            "step_s": statistics.median(r["step_time_s"] for r in steps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{'processes':>9} {'layout':>8} {'restart s (median)':>19} {'min':>6} {'max':>6} {'lost steps':>10}")
    for world in (2, 4):
        got = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:
                got.append(one(world, Path(d)))
        rs = [g["restart_s"] for g in got]
        print(f"{world:>9} {LAYOUTS[world]:>8} {statistics.median(rs):>19.2f} {min(rs):>6.2f} {max(rs):>6.2f} "
              f"{got[0]['lost_steps']:>10}")


if __name__ == "__main__":
    main()
