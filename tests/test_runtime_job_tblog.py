"""TensorBoard event files beside metrics.jsonl, read back with tensorboard's own reader (EventAccumulator):
every step's loss, learning rate, gradient norm, tokens/s, MFU and peak memory, and the job's goodput and
held-out loss at the end, equal to what metrics.jsonl and run.json say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
