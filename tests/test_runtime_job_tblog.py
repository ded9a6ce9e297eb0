"""TensorBoard event files beside metrics.jsonl, read back with tensorboard's own reader (EventAccumulator):
every step's loss, learning rate, gradient norm, tokens/s, MFU and peak memory, and the job's goodput and
held-out loss at the end, equal to what metrics.jsonl and run.json say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6

pytest.importorskip("tensorboard")


def test_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainscale", "train", "--config", str(ROOT / "configs" / "tiny.toml"),
           "--steps", str(STEPS), "--out", str(run)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    events = list(run.glob("events.out.tfevents.*"))
    assert len(events) == 1  # rank 0 only, in the run folder beside metrics.jsonl
    acc = EventAccumulator(str(run))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "perf/step_time_s",
            "memory/peak_bytes", "job/goodput", "eval/val_loss", "eval/unigram_loss"} <= tags
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == STEPS
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("perf/tokens_per_s", "tokens_per_s"), ("perf/mfu", "mfu"), ("memory/peak_bytes", "memory_bytes")):
        got = acc.Scalars(tag)
        assert [e.step for e in got] == list(range(1, STEPS + 1)), tag
        for e, r in zip(got, steps, strict=True):
            assert e.value == pytest.approx(r[key], rel=1e-6), tag  # stored as float32
    assert all(e.value > 1e6 for e in acc.Scalars("memory/peak_bytes"))
    info = json.loads((run / "run.json").read_text())
    (goodput,) = acc.Scalars("job/goodput")
    assert goodput.step == STEPS and goodput.value == pytest.approx(info["goodput"], rel=1e-6)
    assert 0 < goodput.value <= 1
    (val,) = acc.Scalars("eval/val_loss")
    assert val.value == pytest.approx(info["eval_loss"], rel=1e-6)


def test_resume_purges_from_the_step_after_the_checkpoint(tmp_path):
    """A crashed attempt wrote steps 1..5 (flushed, never closed: as a kill leaves them); the run resumes from the
    step-3 checkpoint and writes 4..7. TensorBoard's own reader must then hold steps 1..7 once each, with the
    resumed attempt's values at 4 and 5 (purging at 3, the old behaviour, lost step 3's point on every resume)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainscale.runtime.job.tblog import TensorBoardLog

    first = TensorBoardLog(tmp_path)
    for s in range(1, 6):
        first.step({"step": s, "loss": 10.0 + s})
    first.writer.flush()  # what reached the disk before the kill
    second = TensorBoardLog(tmp_path, resume_step=3)
    for s in range(4, 8):
        second.step({"step": s, "loss": 20.0 + s})
    second.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert got == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0), (7, 27.0)]
