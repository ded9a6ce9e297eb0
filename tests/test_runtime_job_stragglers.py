"""Stragglers and hangs flagged against the plan (issue 35): real 2-rank `trainscale train` jobs (torchrun, gloo).

- ``slow@step=4,rank=1``: rank 1 sleeps 1.5 s before its step 4. Every rank's step time is the same (rank 0 waits
  in the gradient all-reduce), but rank 1's own time (runtime/job/ranks.py: its loop iteration up to the gradient
  synchronisation) is 1.5 s longer: the run names rank 1, with its measured and its predicted own time (on the
  hardware profile $TRAINSCALE_PROFILE points at), on the console and in metrics.jsonl; rank 0 is never named.
  Each rank's heartbeat file holds a line per step.
- ``hang@step=5,rank=1``: rank 1 stops; rank 0 waits in the all-reduce until the collective timeout ends the job.
  Before that, each rank's faulthandler alarm (hang_factor x the median step, at least hang_floor_s) wrote every
  thread's Python stack into RUN/stacks: rank 1's shows the hang, rank 0's the collective it waits in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainscale.estimate.profile import write_profile

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def _env(tmp: Path) -> dict[str, str]:
    profile = {"version": 1, "machine": {"device": "cpu"},
               "processes": {"2": {"matmul_flops": 5e9, "attention_flops": 2e9, "memory_bandwidth": 5e9,
                                   "optimizer_seconds_per_param": 2e-9}},
               "collectives": {"2": {op: {"latency_s": 1e-4, "bus_bandwidth": 1e9}
                                     for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")}}}
    write_profile(profile, tmp / "profile.toml")
    return {**os.environ, "TRAINSCALE_PROFILE": str(tmp / "profile.toml"), "TRAINSCALE_CPU_PEAK": "1e11",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _train(tmp: Path, out: Path, inject: str, *sets: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainscale", "train", "--config", str(TINY), "--layout", "dp2", "--out", str(out),
           "--steps", "8", "--max-restarts", "0", "--inject", inject, "--set", "run.log_every=1",
           "--set", "run.eval_sequences=0", "--set", "run.save_final=false", *[a for s in sets for a in ("--set", s)]]
    return subprocess.run(cmd, cwd=ROOT, env=_env(tmp), capture_output=True, text=True, timeout=timeout)


def test_a_slow_rank_is_named_with_its_measured_and_predicted_own_time(tmp_path):
    out = tmp_path / "run"
    proc = _train(tmp_path, out, "slow@step=4,rank=1,seconds=1.5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    named = [r for r in rows if r.get("event") == "straggler"]
    at4 = [r for r in named if r["steps"][0] <= 4 <= r["steps"][1]]
    assert [r["rank"] for r in at4] == [1], named  # rank 0 waited for it: not named for those steps
    v = at4[0]
    a, b = v["steps"]  # the steps every rank had reported when rank 0 judged: the mean over them holds the 1.5 s
    assert a <= 4 <= b and v["own_s"] * (b - a + 1) >= 1.5
    assert v["peers_s"] < 1.0 and isinstance(v["predicted_s"], float) and 0 < v["predicted_s"] < v["own_s"] / 1.5
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "[straggler] rank 1" in ln]
    assert said and "predicted for it" in said[0], proc.stdout[-3000:]
    beats = {}
    for r in (0, 1):  # the heartbeats: one line per step of each rank, own time and wall clock
        beats[r] = {b["step"]: b["own_s"] for b in map(json.loads, (out / "ranks" / f"rank{r:05d}.jsonl")
                                                        .read_text().splitlines())}
        assert sorted(beats[r]) == list(range(1, 9)) and all(t > 0 for t in beats[r].values())
    for x in named:  # any verdict (a busy host may really hold a rank up elsewhere) is what the heartbeats say
        a, b = x["steps"]
        own = [sum(beats[r][s] for s in range(a, b + 1)) / (b - a + 1) for r in (0, 1)]
        assert x["own_s"] == pytest.approx(own[x["rank"]]) and x["peers_s"] == pytest.approx(own[1 - x["rank"]])
        assert x["own_s"] > max(1.5 * x["peers_s"], x["peers_s"] + 0.25, 1.5 * x["predicted_s"])
    steps = [r for r in rows if "own_s" in r and "event" not in r]
    assert len(steps) == 8 and steps[3]["own_s"] < 1.0  # rank 0's own time of step 4: it did not wait


def test_a_hung_step_leaves_every_ranks_stacks_in_the_run_folder(tmp_path):
    out = tmp_path / "run"
    proc = _train(tmp_path, out, "hang@step=5,rank=1", "checkpoint.collective_timeout_s=10", "run.hang_floor_s=2",
                  "run.hang_factor=5")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    stacks = {r: (out / "stacks" / f"rank{r:05d}.txt").read_text() for r in (0, 1)}
    assert "faults.py" in stacks[1] and "at_step" in stacks[1], stacks[1]  # the hang itself
    assert "train.py" in stacks[0] and "train_step" in stacks[0], stacks[0]  # waiting for it in a collective
