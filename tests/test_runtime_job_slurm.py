"""The script `trainscale launch --slurm` writes, run by a real Slurm (slurm-wlm 22.05 + munge on localhost,
tests/slurm_cluster.py; issue 15): it is accepted, logs, trains and writes final/; a requeue mid-run resumes
from the newest good checkpoint, appends to the metrics and reproduces the uninterrupted run's losses, and
counts the restart in goodput; the early signal before the time limit makes the trainer checkpoint, end the
attempt cleanly and the job requeue itself. Issue 22: a job with a 1-minute time limit finishes a run that needs
several (it requeues itself before each limit) with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, slurm_missing

pytestmark = pytest.mark.service

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
STEPS = 24
NASTY_RUN = "run $(touch MARK); `touch MARK` 'q\" && touch MARK"


def ts(*args: str, timeout: int = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscale", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurm_missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        cluster.env["TRAINSCALE_PYTHON"] = sys.executable  # the job finds its Python on the node (sbatch passes it)
        yield cluster


def _config(tmp: Path, every_steps: int) -> Path:
    cfg = tmp / "tiny-slurm.toml"
    text = TINY.read_text().replace("log_every = 5", "log_every = 1")
    cfg.write_text(text + f"\n[checkpoint]\nevery_steps = {every_steps}\nkeep = 2\n")
    return cfg


def _script(tmp: Path, name: str, every_steps: int = 4, *extra: str) -> tuple[Path, Path]:
    """The script `launch --slurm` writes for tiny.toml under dp2 on 2 CPU processes (checkpoints every N steps)."""
    run, script = tmp / name, tmp / f"{name}.sbatch"
    p = ts("launch", "--slurm", "--cpu", "--config", str(_config(tmp, every_steps)), "--layout", "dp2",
           "--nodes", "1", "--gpus-per-node", "2", "--cpus-per-gpu", "1", "--steps", str(STEPS), "--time", "10",
           "--out", str(run), "--script", str(script), *extra)
    assert p.returncode == 0, p.stderr
    return run, script


def _steps(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    if not f.exists():
        return []
    return [r for r in (json.loads(x) for x in f.read_text().splitlines() if x.strip()) if "loss" in r]


def _log(script: Path, job: int) -> str:
    return (script.parent / f"tiny-{job}.out").read_text()


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """One job run to the end: the reference for the others. Its run folder's name is shell text (issue 23):
    the real Slurm's batch shell must pass it on unexpanded."""
    tmp = tmp_path_factory.mktemp("plain")
    run, script = _script(tmp, NASTY_RUN)
    job = slurm.sbatch(script, cwd=tmp)
    state = slurm.wait(job, timeout=300)
    return run, script, job, state


def test_the_generated_script_runs_under_slurm(slurm, uninterrupted):
    run, script, job, state = uninterrupted
    text = script.read_text()
    # the failures a new user met: log folder, srun CPUs, always --resume, requeueable, early signal
    assert f"#SBATCH --output={script.parent}/tiny-%j.out" in text and "#SBATCH --open-mode=append" in text
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@120" in text and "--resume" in text
    assert f"#SBATCH --chdir={ROOT}\n" in text and sys.executable not in text
    assert "srun --ntasks-per-node=1 --cpus-per-task=2" in text and "gpus-per-node" not in text
    assert state == "COMPLETED", _log(script, job) + slurm.logs()
    assert run.name == NASTY_RUN and not list(script.parent.rglob("MARK")) and not (ROOT / "MARK").exists()
    log = _log(script, job)
    assert f"[slurm] job {job}" in log and "no complete checkpoint to resume from: starting at step 0" in log
    assert f"rendezvous {slurm.host}:{20000 + job % 12768}, python {sys.executable}" in log  # the job's own port
    assert "[slurm] training ended with exit code 0" in log
    assert [r["step"] for r in _steps(run)] == list(range(1, STEPS + 1))
    assert (run / "final" / "model.safetensors").exists() or any((run / "final").iterdir())
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "done" and info["restarts"] == 0 and info["world_size"] == 2


def _wait_for_step(slurm, job: int, run: Path, script: Path, step: int) -> None:
    deadline = time.time() + 240
    while not any(r["step"] >= step for r in _steps(run)):
        assert time.time() < deadline and slurm.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), \
            _log(script, job) if (script.parent / f"tiny-{job}.out").exists() else slurm.logs()
        time.sleep(0.1)


def test_a_requeued_job_resumes_and_matches_the_uninterrupted_run(slurm, uninterrupted, tmp_path):
    ref_run = uninterrupted[0]
    # rank 0 stalls 60 s before step 11 (once per job: not again after the requeue), so the requeue lands
    # after step 10, with step 8's checkpoint the newest committed one
    run, script = _script(tmp_path, "run", 4, "--inject", "slow@step=11,rank=0,seconds=60")
    job = slurm.sbatch(script, cwd=tmp_path)
    _wait_for_step(slurm, job, run, script, 10)
    slurm.requeue(job)
    state = slurm.wait(job, timeout=300)
    log = _log(script, job)
    assert state == "COMPLETED", log + slurm.logs()
    assert "restart 1" in log and "DUE TO JOB REQUEUE" in log
    after = log.split("restart 1", 1)[1]
    assert "resumed from step 8 (the checkpoint at step 8, " in after and "at step 0" not in after
    rows = _steps(run)
    assert rows[0]["step"] == 1 and rows[0]["requeue"] == 0  # appended to, not overwritten
    assert [r["step"] for r in rows] == list(range(1, 11)) + list(range(9, STEPS + 1))
    assert [r["requeue"] for r in rows] == [0] * 10 + [1] * (STEPS - 8)
    # the requeued job reproduces the uninterrupted run (same sequences, same state)
    last = {r["step"]: r["loss"] for r in rows}
    ref = {r["step"]: r["loss"] for r in _steps(ref_run)}
    for s in range(1, STEPS + 1):
        assert last[s] == pytest.approx(ref[s], rel=1e-5, abs=1e-6), s
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "done" and info["restarts"] == 1 and info["lost_steps"] == 2
    assert 0 < info["goodput"] < 1 and info["restart_and_startup_s"] > 0
    # the report draws the restart and each step once
    from trainscale.report.build import run_timeline

    steps, restarts = run_timeline([json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()])
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert restarts == [(9, "restart 1: Slurm requeue, resumed after step 8")]


def test_the_early_signal_checkpoints_and_the_job_requeues_itself(slurm, uninterrupted, tmp_path):
    # no periodic checkpoints: only the signal makes one; rank 0 pauses 5 s before step 4 so the signal
    # lands in step 4
    run, script = _script(tmp_path, "run", 0, "--inject", "slow@step=4,rank=0,seconds=5")
    job = slurm.sbatch(script, cwd=tmp_path)
    _wait_for_step(slurm, job, run, script, 3)
    # what `#SBATCH --signal=B:USR1@120` does before the time limit: USR1 to the batch shell
    slurm.run("scancel", "--signal=USR1", "--batch", str(job))
    assert slurm.wait(job, timeout=300) == "COMPLETED", _log(script, job)
    log = _log(script, job)
    assert "[slurm] time limit near: asking for a checkpoint" in log
    assert ("[signal] checkpoint requested (Slurm's early signal): saving at step 4, then stopping for the requeue"
            in log)
    assert f"[slurm] checkpointed before the time limit: requeueing job {job} (resubmit 1 of 30)" in log
    assert "restart 1" in log and "resumed from step 4 (the checkpoint at step 4, " in log.split("restart 1", 1)[1]
    assert "Traceback" not in log and "SignalException" not in log  # the intended stop is a clean exit
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"checkpoint"' in x]
    assert [e["step"] for e in events] == [4]
    rows = _steps(run)  # the checkpoint was the attempt's last step: nothing is computed twice
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and [r["requeue"] for r in rows[3:5]] == [0, 1]
    ref = {r["step"]: r["loss"] for r in _steps(uninterrupted[0])}
    assert [r["loss"] for r in rows] == [ref[s] for s in range(1, STEPS + 1)]  # bit for bit
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "done" and info["restarts"] == 1 and info["lost_steps"] == 0


def test_launch_refuses_what_would_break_the_script(tmp_path):
    base = ("launch", "--slurm", "--config", str(TINY), "--layout", "dp2", "--nodes", "1", "--gpus-per-node", "2")
    for extra, msg in (((), None),
                       (("--partition", "gpu;rm -rf /"), "is not a Slurm name"),
                       (("--partition", "a\nb"), "is not a Slurm name"),
                       (("--time", "1:00\n#SBATCH --x"), "is not a Slurm time limit"),
                       (("--mem", "lots"), "is not a Slurm memory size"),
                       (("--setup", "source x\nrm y"), "line break"),
                       (("--out", "runs/a\nb"), "line break"),
                       (("--nodes", "2"), "needs 2 processes")):
        p = ts(*base, *extra)
        if msg is None:
            assert p.returncode == 0 and p.stdout.startswith("#!/bin/bash"), p.stderr
        else:
            assert p.returncode == 2 and msg in p.stderr and len(p.stderr.strip().splitlines()) == 1, (extra, p.stderr)
    p = ts(*base, "--layout", "dp4,tp2,pp2", "--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu",
           "--account", "proj1", "--mem", "480G", "--setup", "source /shared/venv/bin/activate", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    text = out["script"]
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text and "--nproc-per-node 8" in text
    assert "#SBATCH --cpus-per-task=64" in text and "#SBATCH --partition=gpu" in text
    assert "#SBATCH --account=proj1" in text and "#SBATCH --mem=480G" in text
    assert "source /shared/venv/bin/activate" in text and '--nnodes "$SLURM_NNODES"' in text
    assert out["processes"] == 16 and out["nodes"] == 2


def _long_run(tmp: Path, steps: int, out: str) -> list[dict]:
    """tiny.toml with 8x the tokens a step, no periodic checkpoints, trained here (not under Slurm) on dp2."""
    cfg = tmp / "tiny-long.toml"
    text = TINY.read_text().replace("global_batch = 8", "global_batch = 64").replace("seq_len = 32", "seq_len = 64")
    cfg.write_text(text.replace("log_every = 5", "log_every = 10") + "\n[checkpoint]\nevery_steps = 0\n")
    p = ts("train", "--config", str(cfg), "--layout", "dp2", "--steps", str(steps), "--out", str(tmp / out),
           timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return _steps(tmp / out)


def test_a_job_with_a_one_minute_limit_finishes_a_run_that_needs_several(slurm, tmp_path):
    """Issue 22: `--time 1`; the signal 5 s before the limit makes the trainer checkpoint and stop, the job
    requeues itself, and after several time limits the run ends with the losses of one uninterrupted run of the
    same config (not under Slurm). Launched in tmp_path with a relative --out, submitted from elsewhere: the
    run folder lands where launch ran (--chdir).

    Slurm checks time limits every 30 s (slurmctld's PERIODIC_TIMEOUT): the signal comes at the first check
    after limit - 5 s - 30 s, 25 to 55 s into an attempt, and the kill (KillWait) at the first check after the
    limit, one check later at least: an attempt trains at most ~45 s. The run is sized from this machine's
    measured step time to need ~140 s of steps, so it cannot finish in two attempts (were the machine 1.5x
    faster than when measured, still not)."""
    calib = _long_run(tmp_path, 12, "calib")
    step_s = sorted(r["step_time_s"] for r in calib[2:])[len(calib[2:]) // 2]  # the median, warm-up excluded
    steps = max(100, int(140 / step_s))
    t0 = time.time()
    ref_rows = _long_run(tmp_path, steps, "ref")
    ref_s = time.time() - t0
    script = tmp_path / "long.sbatch"
    p = ts("launch", "--slurm", "--cpu", "--config", str(tmp_path / "tiny-long.toml"), "--layout", "dp2", "--nodes",
           "1", "--gpus-per-node", "2", "--cpus-per-gpu", "1", "--steps", str(steps), "--time", "1",
           "--signal-before", "5", "--max-resubmits", "12", "--out", "run", "--script", str(script), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    t0 = time.time()
    job = slurm.sbatch(script)  # from the tests' folder, not tmp_path
    state = slurm.wait(job, timeout=1200)
    total = time.time() - t0
    log = _log(script, job)
    assert state == "COMPLETED", log + slurm.logs()
    run = tmp_path / "run"
    rows = _steps(run)
    attempts = sorted({r["requeue"] for r in rows})
    spans = [(min(r["wall"] - r["step_time_s"] for r in rows if r["requeue"] == a),
              max(r["wall"] for r in rows if r["requeue"] == a)) for a in attempts]
    print(f"\n{steps} steps at {step_s:.3f} s; reference (not Slurm) {ref_s:.0f} s; Slurm job {total:.0f} s from "
          f"sbatch to COMPLETED in {len(attempts)} attempts; steps per attempt "
          f"{[sum(r['requeue'] == a for r in rows) for a in attempts]}; each attempt's steps took "
          f"{[round(b - a) for a, b in spans]} s, starting at {[round(a - spans[0][0]) for a, _ in spans]} s")
    # outlived two time limits: at least three attempts, each within one limit, the whole over two limits
    assert len(attempts) >= 3 and attempts == list(range(len(attempts))) and total > 120
    assert all(b - a < 60 for a, b in spans)
    assert log.count("then stopping for the requeue") == len(attempts) - 1
    assert log.count(f"[slurm] checkpointed before the time limit: requeueing job {job}") == len(attempts) - 1
    assert "DUE TO TIME LIMIT" not in log and "Traceback" not in log and "SignalException" not in log
    # each step once (the checkpoint is each attempt's last step), the same losses as the uninterrupted run
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]  # bit for bit
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "done" and info["restarts"] == len(attempts) - 1 and info["lost_steps"] == 0
    assert not (ROOT / "run").exists()
