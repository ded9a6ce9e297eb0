"""Elastic training (issue 15): a job of 2 nodes x 2 processes (`--nnodes 1:2`, two torchrun agents on loopback)
loses one node mid-run; the survivor's agent re-forms the job on 2 processes, the layout is re-planned
(dp4 -> dp2, runtime/job/elastic.py), training resumes from the newest checkpoint by resharding, and the job
finishes. Its losses from the resume point equal a run started from that checkpoint on the smaller layout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainscale.errors import TrainscaleError
from trainscale.runtime.config import load_config
from trainscale.runtime.job.elastic import layout_for_world
from trainscale.runtime.parallel.mesh import free_port
from trainscale.specs import Layout

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
STEPS = 20



def _steps(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    if not f.exists():
        return []
    return [r for r in (json.loads(x) for x in f.read_text().splitlines() if x.strip()) if "loss" in r]


def _tree(pid: int) -> list[int]:
    """pid and all its descendants (torchrun starts its workers in sessions of their own, so killing the
    agent's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill_tree(pid: int) -> None:
    for p in _tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_layout_rule_for_a_smaller_world():
    cfg = load_config(TINY)
    lay, why = layout_for_world(cfg, Layout.parse("dp4"), 2)
    assert (lay.dp, lay.tp) == (2, 1) and "dp4 -> dp2" in why
    lay, _ = layout_for_world(cfg, Layout.parse("dp2,tp2,zero3"), 2)
    assert (lay.dp, lay.tp, lay.zero) == (1, 2, 0)  # ZeRO over one replica is no ZeRO
    lay, _ = layout_for_world(cfg, Layout.parse("dp4,pp2,mb1"), 4)
    assert (lay.dp, lay.pp) == (2, 2)
    with pytest.raises(TrainscaleError, match="not a multiple of tp x cp x pp = 4"):
        layout_for_world(cfg, Layout.parse("tp2,pp2"), 2)
    lay, why = layout_for_world(cfg, Layout.parse("tp2,pp2"), 2, Layout.parse("dp2"))
    assert lay.dp == 2 and "fallback" in why
    with pytest.raises(TrainscaleError, match="fallback layout .* needs 4 processes"):
        layout_for_world(cfg, Layout.parse("tp2,pp2"), 2, Layout.parse("dp4"))


def test_a_job_that_loses_a_node_finishes_on_the_other(tmp_path):
    cfg = tmp_path / "tiny-elastic.toml"
    cfg.write_text(TINY.read_text().replace("log_every = 5", "log_every = 1")
                   + "\n[checkpoint]\nevery_steps = 4\nkeep = 5\n")
    run = tmp_path / "run"
    port = free_port()
    # rank 0 stalls before step 11 (once per job), so the node is lost with step 8's checkpoint the newest
    cmd = [sys.executable, "-m", "trainscale", "train", "--config", str(cfg), "--layout", "dp4", "--steps",
           str(STEPS), "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "2",
           "--inject", "slow@step=11,rank=0,seconds=40", "--out", str(run), "--json"]
    a = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         start_new_session=True)
    deadline = time.time() + 120
    while not _listening(port):  # node A hosts the rendezvous store; node B joins it (and is the one lost)
        assert a.poll() is None and time.time() < deadline, a.communicate()
        time.sleep(0.2)
    b = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         start_new_session=True)
    try:
        deadline = time.time() + 240
        while not any(r["step"] >= 10 for r in _steps(run)):
            for p in (a, b):
                assert p.poll() is None, p.communicate()
            assert time.time() < deadline
            time.sleep(0.2)
        _kill_tree(b.pid)  # the node is gone: its CLI, its torchrun agent and both its ranks
        b.wait(timeout=30)
        out, err = a.communicate(timeout=300)
    finally:
        for p in (a, b):
            if p.poll() is None:
                _kill_tree(p.pid)
    assert a.returncode == 0, err[-3000:]
    assert "Traceback" not in out + err
    info = json.loads(out)
    assert info["status"] == "done" and info["world_size"] == 2 and info["layout"].startswith("tp1,cp1,pp1,dp2")
    logs = "".join(f.read_text() for f in run.glob("train-*.log"))
    assert "[elastic] layout tp1,cp1,pp1,dp2" in logs and "dp4 -> dp2" in logs
    assert "resumed from step 8 (the checkpoint at step 8, " in logs
    rows = _steps(run)
    assert [r["step"] for r in rows] == list(range(1, 11)) + list(range(9, STEPS + 1))
    resumed = {r["step"]: r["loss"] for r in rows[10:]}

    # the reference: the same checkpoint resumed on 2 processes under dp2 from the start
    ref = tmp_path / "ref"
    (ref / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step-00000008", ref / "checkpoints" / "step-00000008")
    shutil.copy(run / "identity.json", ref / "identity.json")  # the same run, continued elsewhere
    p = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(cfg), "--layout", "dp2",
                        "--steps", str(STEPS), "--resume", "--out", str(ref), "--json"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    expect = {r["step"]: r["loss"] for r in _steps(ref)}
    assert sorted(expect) == list(range(9, STEPS + 1))
    for s in range(9, STEPS + 1):
        assert resumed[s] == pytest.approx(expect[s], rel=1e-5, abs=1e-6), s
    assert info["restarts"] == 1 and info["lost_steps"] == 2
