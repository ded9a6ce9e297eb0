"""Real processes under torchrun crash, hang and die mid-save; the job restarts, resumes from the newest good
checkpoint and ends with the same losses as an uninterrupted run (issue 5)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from trainscale.runtime.job.checkpoint import committed_steps
from trainscale.runtime.job.launch import torchrun_command

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
CKPT = "\n[checkpoint]\nevery_steps = {every}\nkeep = 3\ncollective_timeout_s = {timeout}\n"


def config(tmp: Path, steps: int, every: int = 3, timeout: float = 60) -> Path:
    text = (ROOT / "configs" / "tiny.toml").read_text().replace("steps = 40", f"steps = {steps}")
    text = text.replace("eval_sequences = 64", "eval_sequences = 0")
    path = tmp / f"tiny-{steps}-{every}.toml"
    path.write_text(text + CKPT.format(every=every, timeout=timeout))
    return path


def run(cfg: Path, layout: str, world: int, out: Path, inject: str | None = None, resume: bool = False,
        restarts: int = 6, ok: bool = True) -> str:
    cmd = torchrun_command(cfg, layout, out, world, max_restarts=restarts, inject=inject, resume=resume)
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert (p.returncode == 0) == ok, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def losses(out: Path) -> dict[int, float]:
    """Loss per step, the last time each step ran (a step re-run after a restart replaces the first)."""
    got: dict[int, float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and "step_time_s" in row:
            got[int(row["step"])] = float(row["loss"])
    return got


def goodput(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "goodput" in r][-1]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("base")
    cfg = config(tmp, 10)
    run(cfg, "dp2", 2, tmp / "run")
    return cfg, losses(tmp / "run")


def test_crash_restart_resumes_exactly(baseline, tmp_path):
    cfg, base = baseline
    out = tmp_path / "crash"
    log = run(cfg, "dp2", 2, out, inject="crash@step=8,rank=1")
    assert "crashes now" in log and "resumed from" in log and "at step 6" in log
    assert losses(out) == base  # fp32 on CPU: the continued losses are bit-for-bit those of the uninterrupted run
    g = goodput(out)
    assert g["restarts"] >= 1 and 0 < g["goodput"] < 1 and g["lost_steps"] == 1  # step 7 ran twice


def test_kill_during_save_keeps_previous_checkpoint(baseline, tmp_path):
    cfg, base = baseline
    out = tmp_path / "kill"
    log = run(cfg, "dp2", 2, out, inject="kill-during-save@step=6,rank=0")
    assert "written but not committed" in log
    assert "resumed from" in log and "at step 3" in log  # step 6 never became visible; step 3 was intact
    assert losses(out) == base
    assert committed_steps(out / "checkpoints") == [3, 6, 9]
    assert goodput(out)["lost_steps"] == 3  # steps 4-6 ran twice


def test_hang_is_detected_by_timeout_and_restarted(tmp_path):
    cfg = config(tmp_path, 6, every=2, timeout=8)
    base = tmp_path / "base"
    run(cfg, "dp2", 2, base)
    out = tmp_path / "hang"
    log = run(cfg, "dp2", 2, out, inject="hang@step=4,rank=1")
    assert "hangs now" in log and "at step 2" in log
    assert losses(out) == losses(base)


def test_resharding_dp2tp2_to_pp2dp2_and_single_process(tmp_path):
    cfg = config(tmp_path, 8, every=4)
    ref = tmp_path / "ref"
    run(cfg, "", 1, ref)  # single process, uninterrupted
    saved = tmp_path / "resharded"
    # the dp2 x tp2 job dies at step 6 with no restarts left, after its step-4 checkpoint
    run(cfg, "dp2,tp2", 4, saved, inject="crash@step=6,rank=3", restarts=0, ok=False)
    assert committed_steps(saved / "checkpoints") == [4]
    pp = tmp_path / "pp"
    subprocess.run(["cp", "-r", str(saved), str(pp)], check=True)
    log = run(cfg, "pp2,dp2", 4, pp, resume=True)
    assert "at step 4" in log
    single = tmp_path / "single"
    subprocess.run(["cp", "-r", str(saved), str(single)], check=True)
    run(cfg, "", 1, single, resume=True)
    want = losses(ref)
    for out in (pp, single):
        got = losses(out)
        assert sorted(got) == list(range(1, 9))
        for step in range(5, 9):
            assert got[step] == pytest.approx(want[step], rel=1e-4)


def test_corrupt_checkpoint_falls_back(tmp_path):
    cfg = config(tmp_path, 6, every=2)
    out = tmp_path / "run"
    run(cfg, "", 1, out)
    assert committed_steps(out / "checkpoints") == [2, 4, 6]
    newest = out / "checkpoints" / "step-00000006"
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x55
    shard.write_bytes(bytes(data))
    log = run(cfg, "", 1, out, resume=True)
    assert "step-00000006 is damaged (" in log and "checksum mismatch" in log
    assert "resumed from" in log and "at step 4" in log
