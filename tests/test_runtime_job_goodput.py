"""Goodput that tells the truth across restarts (issue 15): inside one launch (a CLI invocation, a Slurm job
across its requeues) the time from a failure to the restarted attempt is the job's, lost; between two
launches (a run resumed by hand later) the idle time is not the job's."""

from __future__ import annotations

import json

import pytest

from trainscale.runtime.job.runfolder import RunFolder, launch_wall

pytestmark = pytest.mark.dist


def _rows(*spec):
    rows = []
    for kind, launch, attempt, wall in spec:
        if kind == "start":
            rows.append({"event": "start", "wall": wall, "launch": launch, "requeue": 0, "attempt": attempt})
        else:
            rows.append({"step": len(rows), "loss": 1.0, "step_time_s": 1.0, "wall": wall, "attempt": attempt})
    return rows


def test_a_restart_inside_a_launch_is_lost_time_and_idle_time_between_launches_is_not():
    rows = _rows(("start", "a", 0, 100.0), ("step", "a", 0, 110.0), ("step", "a", 0, 120.0),
                 # the rank crashes at 120; torchrun restarts it, the new attempt starts at 150
                 ("start", "a", 1, 150.0), ("step", "a", 1, 160.0),
                 # the job dies at 160; a person resumes it by hand a day later
                 ("start", "b", 0, 86_560.0), ("step", "b", 0, 86_570.0))
    wall, attempts = launch_wall(rows, now=86_580.0)
    assert attempts == 3
    assert wall == pytest.approx((160 - 100) + (86_580 - 86_560))


def test_goodput_of_a_run_folder(tmp_path, monkeypatch):
    rows = _rows(("start", "a", 0, 0.0), ("step", "a", 0, 10.0), ("step", "a", 0, 20.0),
                 ("start", "b", 0, 10_000.0), ("step", "b", 0, 10_010.0))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.json").write_text("{}")
    folder = RunFolder(tmp_path, resume=True)
    import trainscale.runtime.job.runfolder as rf

    monkeypatch.setattr(rf.time, "time", lambda: 10_020.0)
    g = folder.goodput(lambda _m: None)
    assert g["wall_s"] == pytest.approx(20 + 20) and g["restarts"] == 1
    assert g["useful_step_s"] == pytest.approx(3.0) and g["goodput"] == pytest.approx(3 / 40)
    assert json.loads((tmp_path / "run.json").read_text())["restarts"] == 1
