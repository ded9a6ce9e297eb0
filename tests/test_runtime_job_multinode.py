"""Many nodes (issue 15): two torchrun agents on loopback (`trainscale train --nnodes 2 --rdzv-endpoint`),
each as a separate "node" with one process, training dp2 together — with a shared run folder and with a
run folder per node. Only the node that runs rank 0 writes the run folder's files, every node writes its
own log, no node ends in a traceback, and the losses equal a one-node dp2 run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainscale.runtime.parallel.mesh import free_port

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
STEPS = 6



def _two_nodes(out_a: Path, out_b: Path) -> list[subprocess.CompletedProcess]:
    port = free_port()
    cmd = [sys.executable, "-m", "trainscale", "train", "--config", str(TINY), "--layout", "dp2", "--steps",
           str(STEPS), "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--json"]
    procs = [subprocess.Popen([*cmd, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT) for out in (out_a, out_b)]
    done = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return done


def _losses(run: Path) -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("one") / "run"
    p = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(TINY), "--layout", "dp2",
                        "--steps", str(STEPS), "--out", str(out), "--json"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    return _losses(out)


def _clean(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout


def test_two_nodes_sharing_the_run_folder(tmp_path, one_node):
    run = tmp_path / "shared"
    a, b = _two_nodes(run, run)
    _clean(a)
    _clean(b)
    logs = sorted(run.glob("train-*.log"))
    assert len(logs) == 2 and not (run / "train.log").exists()  # one log per node, none overwritten
    assert sum("training tiny-llama" in f.read_text() for f in logs) == 1  # rank 0 speaks in one of them
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "done" and info["world_size"] == 2
    assert json.loads(a.stdout)["status"] == json.loads(b.stdout)["status"] == "done"
    assert _losses(run) == pytest.approx(one_node, rel=1e-6)
    assert (run / "final").is_dir()


def test_two_nodes_each_with_its_own_run_folder(tmp_path, one_node):
    a_dir, b_dir = tmp_path / "node-a", tmp_path / "node-b"
    a, b = _two_nodes(a_dir, b_dir)
    _clean(a)
    _clean(b)
    owner, other = (a_dir, b_dir) if (a_dir / "run.json").exists() else (b_dir, a_dir)
    # the node that ran rank 0 holds the run's files; the other holds only its own log and its rank's heartbeat
    # and stack-dump files (runtime/job/ranks.py: a hang's stacks land on the node where the rank ran)
    assert {"run.json", "metrics.jsonl", "config.toml", "final"} <= {p.name for p in owner.iterdir()}
    assert sorted(p.name for p in other.iterdir() if not p.name.startswith("train-")) == ["ranks", "stacks"]
    assert [p.name for p in (other / "ranks").iterdir()] == ["rank00001.jsonl"]
    assert [p.name for p in (owner / "ranks").iterdir()] == ["rank00000.jsonl"]
    assert [p.name for p in (other / "stacks").iterdir()] == ["rank00001.txt"]
    assert len(list(other.glob("train-*.log"))) == 1 and len(list(owner.glob("train-*.log"))) == 1
    notes = [json.loads(x.stdout) for x in (a, b)]
    assert sorted(n.get("rank0_here", True) for n in notes) == [False, True]
    assert _losses(owner) == pytest.approx(one_node, rel=1e-6)


def test_a_node_left_alone_stops_with_one_sentence(tmp_path):
    # the other machine never comes: the rendezvous wait is bounded (--rdzv-timeout), the answer one line
    p = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(TINY), "--layout", "dp2",
                        "--steps", "2", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                        "--rdzv-timeout", "5", "--out", str(tmp_path / "run")], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not join the rendezvous in time" in lines[0], p.stderr
