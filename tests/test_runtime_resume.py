"""Runs continue correctly (issue 21 item 6). The learning-rate schedules against their formulas; a resumed run
keeps its schedule whatever --steps says (its losses are the uninterrupted run's, bit for bit: fp32 on CPU);
going past the run's total is explicit (--extend), and a WSD run extended in its stable phase is the longer run;
a refused resume writes nothing. One-process runs of the tiny config (python -m trainscale.runtime.train)."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainscale.errors import TrainscaleError
from trainscale.runtime.config import config_from_dict
from trainscale.runtime.schedule import Horizon, continuation, fixed_steps, lr_at

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the schedules (no training)


def _train(schedule: str, steps: int = 100, warmup: int = 10, fraction: float = 0.2):
    return config_from_dict({"model": {"name": "llama3.1-8b"}, "train": {
        "steps": steps, "lr": 1.0, "warmup": warmup, "min_lr_ratio": 0.1, "seq_len": 16, "schedule": schedule,
        "decay_fraction": fraction}})


def test_every_schedule_is_its_formula_at_every_step():
    """Update s (0-based), lr 1, warmup W = 10, floor r = 0.1, horizon H = 100; past H the final value.
    cosine: r + (1-r)(1 + cos(pi (s-W)/(H-W)))/2 (SGDR eq. 5); linear: r + (1-r)(1 - (s-W)/(H-W));
    wsd (MiniCPM, arXiv 2404.06395): 1 until D = H - 0.2 H = 80, then r + (1-r)(1 - (s-D)/(H-D)); constant: 1."""
    W, H, r, D = 10, 100, 0.1, 80
    want = {
        "cosine": lambda s: r + (1 - r) * (1 + math.cos(math.pi * min(1, (s - W) / (H - W)))) / 2,
        "linear": lambda s: r + (1 - r) * (1 - min(1, (s - W) / (H - W))),
        "wsd": lambda s: 1.0 if s < D else r + (1 - r) * (1 - min(1, (s - D) / (H - D))),
        "constant": lambda s: 1.0,
    }
    for kind, f in want.items():
        cfg = _train(kind)
        for s in range(0, 130):
            expected = (s + 1) / W if s < W else f(s)
            assert lr_at(s, cfg) == pytest.approx(expected, abs=1e-12), (kind, s)
    wsd = _train("wsd")
    assert [lr_at(s, wsd) for s in (79, 80, 90, 99, 100)] == pytest.approx([1.0, 1.0, 0.55, 0.145, 0.1])
    assert lr_at(55, _train("cosine")) == pytest.approx(0.55)  # the middle of the cosine: halfway to the floor
    assert lr_at(55, _train("linear")) == pytest.approx(0.55)
    # the horizon is an argument: the run's recorded one, not train.steps
    assert lr_at(90, _train("wsd"), horizon=200) == 1.0 and lr_at(90, _train("cosine"), horizon=90) == 0.1


def test_a_new_horizon_is_taken_only_where_the_steps_so_far_keep_their_learning_rates():
    """The continuity property, brute force: whenever --extend lays the schedule out again for N steps, every
    update already run had the same learning rate under N as under the recorded horizon H."""
    adopted = 0
    for kind in ("cosine", "linear", "wsd", "constant"):
        for warmup in (0, 3):
            t = _train(kind, steps=20, warmup=warmup, fraction=0.25).train
            for H in (8, 12, 20):
                for N in (H + 1, H + 7, 3 * H):
                    for k in range(0, H):
                        got, stop = continuation(t, k, Horizon(H, H), N, True, "RUN")
                        assert stop == N and got.total == N and got.schedule_steps in (H, N)
                        if got.schedule_steps == N:
                            adopted += 1
                            assert all(lr_at(s, t, H) == lr_at(s, t, N) for s in range(k)), (kind, H, N, k)
                        else:  # kept: the recorded schedule runs on, then its final learning rate
                            assert k > min(fixed_steps(t, H), fixed_steps(t, N))
                            assert lr_at(N - 1, t, H) == lr_at(H, t, H)
    assert adopted > 100


def test_continuation_keeps_the_schedule_and_refuses_in_one_sentence():
    t = _train("cosine", steps=20, warmup=2).train
    assert continuation(t, 10, Horizon(20, 20), 15, False, "RUN") == (Horizon(20, 20), 15)  # stops early, same lr
    assert continuation(t, 10, Horizon(20, 20), None, False, "RUN") == (Horizon(20, 20), 20)
    assert continuation(t, 10, Horizon(20, 20), 30, True, "RUN") == (Horizon(20, 30), 30)
    assert continuation(t, 21, Horizon(20, 30), None, False, "RUN") == (Horizon(20, 30), 30)  # extended before
    with pytest.raises(TrainscaleError, match=r"^--steps 30: the run in RUN was laid out for 20 steps .* add "
                       r"--extend \(steps 21\.\.30 train at the schedule's final learning rate, 0\.1\)"):
        continuation(t, 10, Horizon(20, 20), 30, False, "RUN")
    with pytest.raises(TrainscaleError, match="already reached step 20 of 20; train further with --resume "
                       "--steps N --extend"):
        continuation(t, 20, Horizon(20, 20), None, False, "RUN")
    with pytest.raises(TrainscaleError, match="already reached step 12, past --steps 10"):
        continuation(t, 12, Horizon(20, 20), 10, False, "RUN")
    w = _train("wsd", steps=20, warmup=2, fraction=0.25).train
    with pytest.raises(TrainscaleError, match="add --extend \\(the schedule is laid out again for 40 steps"):
        continuation(w, 10, Horizon(20, 20), 40, False, "RUN")
    assert continuation(w, 16, Horizon(20, 20), 40, True, "RUN")[0] == Horizon(40, 40)  # updates 0..15: peak
    assert continuation(w, 17, Horizon(20, 20), 40, True, "RUN")[0] == Horizon(20, 40)  # decaying already: kept


# ------------------------------------------------------------------ real one-process runs


def config(tmp: Path, steps: int, schedule: str = "cosine", every: int = 4) -> Path:
    text = (ROOT / "configs" / "tiny.toml").read_text()
    text = text.replace("steps = 40", f"steps = {steps}").replace("warmup = 5", "warmup = 2")
    text = text.replace("eval_sequences = 64", "eval_sequences = 0\nsave_final = false")
    text = text.replace("seed = 0", f'seed = 0\nschedule = "{schedule}"\ndecay_fraction = 0.25')
    path = tmp / f"tiny-{schedule}-{steps}.toml"
    path.write_text(text + f"\n[checkpoint]\nevery_steps = {every}\nkeep = 2\n")
    return path


def worker(cfg: Path, out: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "trainscale.runtime.train", "--config", str(cfg), "--out", str(out),
                        *args], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert (p.returncode == 0) == ok, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def steps_of(out: Path, key: str = "loss") -> dict[int, float]:
    """Per step, the last time it ran (a step re-run after a resume replaces the first)."""
    got: dict[int, float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and "step_time_s" in row:
            got[int(row["step"])] = float(row[key])
    return got


def snapshot(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every path under ``folder`` with the sha256 of its bytes (folders as such)."""
    return {str(p.relative_to(folder)): "folder" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if str(p.relative_to(folder)) not in skip}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    cfg = config(tmp, 12)
    worker(cfg, tmp / "base")
    return cfg, tmp / "base"


@pytest.mark.dist
def test_resume_with_fewer_steps_or_none_keeps_the_uninterrupted_schedule(uninterrupted, tmp_path):
    """Main before this: `--resume --steps 8` laid the cosine out again for 8 steps, so steps 5-8 had other
    learning rates and losses than the 12-step run's."""
    cfg, base = uninterrupted
    out = tmp_path / "run"
    worker(cfg, out, "--inject", "crash@step=6", ok=False)  # dies before step 6; its checkpoint is step 4
    p = worker(cfg, out, "--resume", "--steps", "8")
    assert "resumed from step 4" in p.stdout and "steps 5..8 follow, the learning-rate schedule laid out for 12" \
        in p.stdout
    assert sorted(steps_of(out)) == list(range(1, 9))
    assert steps_of(out) == {s: v for s, v in steps_of(base).items() if s <= 8}
    assert steps_of(out, "lr") == {s: v for s, v in steps_of(base, "lr").items() if s <= 8}
    worker(cfg, out, "--resume")  # no --steps: on to the run's recorded total, 12
    assert steps_of(out) == steps_of(base) and steps_of(out, "lr") == steps_of(base, "lr")
    assert json.loads((out / "run.json").read_text())["steps"] == 12


@pytest.mark.dist
def test_going_past_the_total_is_explicit_and_a_refusal_writes_nothing(uninterrupted, tmp_path):
    cfg, base = uninterrupted
    out = tmp_path / "run"
    shutil.copytree(base, out)
    before = snapshot(out, skip=(".lock",))  # run directly, the rank takes the lock (its pid) before it reads
    for args, said in ((["--steps", "16"], "add --extend (steps 13..16 train at the schedule's final learning rate"),
                       ([], "already reached step 12 of 12; train further")):
        p = worker(cfg, out, "--resume", *args, ok=False)
        assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr
        assert snapshot(out, skip=(".lock",)) == before  # run.json not "running", no start event, no restart
    worker(cfg, out, "--resume", "--steps", "16", "--extend")
    lr = steps_of(out, "lr")
    floor = 3e-3 * 0.1
    assert [lr[s] for s in range(13, 17)] == pytest.approx([floor] * 4, rel=1e-12)  # cosine's final lr
    assert {s: v for s, v in steps_of(out).items() if s <= 12} == steps_of(base)
    extras = json.loads((out / "checkpoints" / "step-00000016" / "extras-rank00000.json").read_text())
    assert (extras["horizon"], extras["total"]) == (12, 16)


@pytest.mark.dist
def test_wsd_extended_in_its_stable_phase_is_the_longer_run(tmp_path):
    """WSD, decay_fraction 0.25: a 12-step run decays from update 9; stopped at step 4 (stable) and extended to
    16, it decays from update 12 as a run started for 16 steps does, with that run's losses."""
    longer = config(tmp_path, 16, schedule="wsd")
    worker(longer, tmp_path / "long")
    out = tmp_path / "run"
    worker(longer, out, "--steps", "12", "--inject", "crash@step=6", ok=False)
    p = worker(longer, out, "--resume", "--steps", "16", ok=False)
    assert "add --extend (the schedule is laid out again for 16 steps" in p.stderr
    worker(longer, out, "--resume", "--steps", "16", "--extend")
    assert steps_of(out) == steps_of(tmp_path / "long")
    assert steps_of(out, "lr") == steps_of(tmp_path / "long", "lr")
    lr = steps_of(out, "lr")
    assert lr[13] == pytest.approx(3e-3) and lr[14] == pytest.approx(3e-3 * (0.1 + 0.9 * 0.75))  # steps are 1-based
