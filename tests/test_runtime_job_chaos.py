"""Chaos (issue 16): real `trainscale train` jobs (2 ranks under torchrun) killed with SIGKILL at random
moments — a rank, the torchrun agent, the CLI itself, and each of the first two mid-save — and
continued with --resume after every kill. After each kill no process of the job survives, the
newest committed checkpoint verifies, and the finished run's losses equal an uninterrupted run's,
step by step, exactly. Also: the run folder's lock and identity, and a save that fills the disk."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from trainscale.runtime.job.checkpoint import committed_steps, latest_good, verify

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
ENV = {**os.environ, "TRAINSCALE_CPU_PEAK": "1e11", "PYTHONPATH": os.pathsep.join(
    [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}


def config(tmp: Path, steps: int = STEPS, every: int = 1, ckpt_dir: Path | None = None, lr: str = "3e-3") -> Path:
    text = (ROOT / "configs" / "tiny.toml").read_text().replace("steps = 40", f"steps = {steps}")
    text = text.replace("eval_sequences = 64", "eval_sequences = 0").replace("lr = 3e-3", f"lr = {lr}")
    text += f"save_final = false\n\n[checkpoint]\nevery_steps = {every}\nkeep = 2\ncollective_timeout_s = 60\n"
    if ckpt_dir is not None:
        text += f'dir = "{ckpt_dir}"\n'
    path = tmp / f"chaos-{steps}-{every}-{lr}.toml"
    path.write_text(text)
    return path


def start(cfg: Path, out: Path, *extra: str, tag: str = "job") -> subprocess.Popen:
    logs = out.parent / f"{out.name}-{tag}"
    cmd = [sys.executable, "-m", "trainscale", "train", "--config", str(cfg), "--layout", "dp2", "--out", str(out),
           "--max-restarts", "0", "--json", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=open(f"{logs}.out", "w"),  # noqa: SIM115
                            stderr=open(f"{logs}.err", "w"))  # noqa: SIM115


def finish(proc: subprocess.Popen, out: Path, tag: str = "job", timeout: float = 300) -> tuple[int, str]:
    code = proc.wait(timeout=timeout)
    return code, (out.parent / f"{out.name}-{tag}.err").read_text()


def train(cfg: Path, out: Path, *extra: str, tag: str = "job") -> tuple[int, str]:
    return finish(start(cfg, out, *extra, tag=tag), out, tag)


def children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(cond: Callable[[], bool], timeout: float, poll: float = 0.002) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(poll)
    return False


def loss_rows(out: Path) -> list[dict]:
    rows = []
    path = out / "metrics.jsonl"
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row and "step_time_s" in row:
            rows.append(row)
    return rows


def losses(out: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in loss_rows(out)}  # a step re-run replaces the first


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("trainscale: error: "), err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> tuple[Path, dict[int, float], int]:
    tmp = tmp_path_factory.mktemp("chaos-base")
    cfg = config(tmp)
    code, err = train(cfg, tmp / "base")
    assert code == 0, err[-3000:]
    step_dir = tmp / "base" / "checkpoints" / f"step-{STEPS:08d}"
    pages = sum(-(-p.stat().st_size // 4096) * 4096 for p in step_dir.iterdir())
    return cfg, losses(tmp / "base"), pages


def test_sigkill_rounds_then_resume_equal_an_uninterrupted_run(baseline, tmp_path):
    cfg, base, _ = baseline
    assert sorted(base) == list(range(1, STEPS + 1))
    out = tmp_path / "chaos"
    ckpt = out / "checkpoints"
    rng = random.Random(16)
    rounds = [("rank", False), ("agent", False), ("rank", True), ("agent", True), ("cli", False)]
    report = []
    for i, (target, mid_save) in enumerate(rounds):
        before = len(loss_rows(out))
        proc = start(cfg, out, *(["--resume"] if i else []), tag=f"round{i}")
        after = rng.randint(1, 2)
        assert wait_for(lambda b=before, a=after: len(loss_rows(out)) >= b + a, 240, poll=0.01), \
            (out.parent / f"chaos-round{i}.err").read_text()[-3000:]
        if mid_save:  # the next save: kill while its .tmp folder exists (written, not committed)
            caught = wait_for(lambda: any(ckpt.glob(".tmp-step-*")), 30, poll=0.0005)
        else:
            time.sleep(rng.uniform(0, 0.3))
            caught = bool(list(ckpt.glob(".tmp-step-*")))
        agent = next(iter(children(proc.pid)))
        ranks = children(agent)
        assert len(ranks) == 2
        if target == "cli":  # a second job on the same folder refuses while this one holds it
            code, err = train(cfg, out, "--resume", tag="second")
            line = one_line(err)
            # on a busy host the job may finish its last step while the second CLI starts: then that is its answer
            done = latest_good(ckpt) is not None and latest_good(ckpt)[0] == STEPS
            assert code == 2 and ("is in use by another trainscale job" in line
                                  or (done and f"already reached step {STEPS} of {STEPS}" in line)), line
        victim = {"rank": rng.choice(ranks), "agent": agent, "cli": proc.pid}[target]
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=120)
        survivors = [p for p in [agent, *ranks] if wait_for(lambda p=p: not alive(p), 60, poll=0.05) is False]
        assert not survivors, f"round {i}: {survivors} outlived the kill of the {target}"
        if target != "cli":
            err = (out.parent / f"chaos-round{i}.err").read_text()
            assert code == 1 and "training failed" in one_line(err), err[-3000:]
        steps = committed_steps(ckpt)
        assert steps and all(verify(ckpt / f"step-{s:08d}") is None for s in steps), \
            {s: verify(ckpt / f"step-{s:08d}") for s in steps}
        report.append(f"{target}{' mid-save' if caught else ''} after step {len(loss_rows(out))}: "
                      f"newest committed step {steps[-1]}")
    print("\n".join(report))
    if latest_good(ckpt)[0] < STEPS:
        code, err = train(cfg, out, "--resume", tag="final")
        assert code == 0, err[-3000:]
    # else the job finished its last step (and committed it) while the second CLI was being refused, before the
    # kill of the CLI landed: nothing is left to resume, and the losses below still hold every step
    assert losses(out) == base  # every step, bit for bit
    assert latest_good(ckpt)[0] == STEPS
    # the run folder is bound to this run: a new run is refused, so is --resume with another config
    # and --resume of the finished run
    code, err = train(cfg, out, tag="new")
    assert code == 2 and "holds the checkpoints of run" in one_line(err)
    code, err = train(config(tmp_path, lr="1e-3"), out, "--resume", tag="other")
    assert code == 2 and "trained with another config" in one_line(err)
    code, err = train(cfg, out, "--resume", tag="done")
    assert code == 2 and f"already reached step {STEPS} of {STEPS}" in one_line(err)


def test_a_save_that_fills_the_disk_fails_in_one_sentence_and_keeps_the_last_checkpoint(baseline, tmp_path):
    _, _, pages = baseline
    disk = tmp_path / "small-disk"
    disk.mkdir()
    size = pages * 3 // 2 // 4096 * 4096
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True,
                           text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a {size}-byte tmpfs here ({mount.stderr.strip()}): needs root or CAP_SYS_ADMIN")
    try:
        cfg = config(tmp_path, steps=6, every=2, ckpt_dir=disk)
        code, err = train(cfg, tmp_path / "full")
        line = one_line(err)
        assert code == 1 and "saving the step-4 checkpoint" in line and "No space left on device" in line, line
        assert "step-00000002" in line and "is intact" in line
        assert committed_steps(disk) == [2] and verify(disk / "step-00000002") is None
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
        shutil.rmtree(disk, ignore_errors=True)
