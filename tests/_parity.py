"""Shared by the parity tests: run tests/_runtime_worker.py on ``world`` real processes (torchrun) for a set of
layouts and read back its per-layout losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_runtime_worker.py"


def run_layouts(config: Path, steps: int, world: int, layouts: list[str], out: Path) -> dict:
    """{layout: the worker's result} for ``layouts`` trained ``steps`` steps on ``world`` processes."""
    result = out / f"world{world}.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if world == 1:
        cmd = [sys.executable, str(WORKER)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(WORKER)]
    cmd += ["--config", str(config), "--steps", str(steps), "--result", str(result), "--layouts", ";".join(layouts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        # a rank of a multi-layout gloo job sometimes aborts in C++ (std::terminate, no Python error) on this
        # 2-core machine: 2 of 6 full runs of this session; not a wrong number. Said in the closing note of
        # stop 18 as a known flake under investigation; the job runs once more, and a second abort fails.
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"world {world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(result.read_text())


def run_jobs(config: Path, steps: int, jobs: dict[int, list[str]], out: Path) -> dict:
    """Every world size's layouts, one torchrun job per world size: {layout: result}."""
    got: dict[str, dict] = {}
    for world, layouts in jobs.items():
        got.update(run_layouts(config, steps, world, layouts, out))
    return got
