"""runtime/job/local.py without a training process: the follower hands each new metrics row to the command's
callback (rows already in the file before the job are not news), keeps the rows with a loss, and turns a rank's
recorded error into its one sentence with the exit code it asked for."""

from __future__ import annotations

import json

import pytest

from trainscale.errors import JobFailed, TrainscaleError
from trainscale.runtime.job.local import follow, raise_failure


class FakeJob:
    """A process whose first poll writes two rows (one a half-written line) and whose second has ended."""

    def __init__(self, metrics):
        self.metrics, self.polls = metrics, 0

    def poll(self):
        self.polls += 1
        if self.polls == 1:
            with open(self.metrics, "a") as f:
                f.write(json.dumps({"step": 1, "loss": 2.5}) + "\n" + json.dumps({"val_loss": 2.4}) + "\n{\"step\"")
            return None
        return 0


def test_follow_gives_new_rows_to_the_callback_and_keeps_those_with_a_loss(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 9, "loss": 1.0}) + "\n")  # a resumed run's earlier line
    seen = []
    rows = follow(FakeJob(metrics), metrics, seen.append)
    assert seen == [{"step": 1, "loss": 2.5}, {"val_loss": 2.4}]
    assert rows == [{"step": 1, "loss": 2.5}]


def test_a_recorded_error_is_its_sentence_with_its_exit_code(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("")
    err = tmp_path / "error.json"
    err.write_text(json.dumps({"error": "checkpoint step-4 is not this run's", "exit": 2}))
    with pytest.raises(TrainscaleError, match="not this run's") as e:
        raise_failure(err, log, 1)
    assert not isinstance(e.value, JobFailed)
    err.write_text(json.dumps({"error": "the disk is full", "exit": 1}))
    with pytest.raises(JobFailed, match="the disk is full"):
        raise_failure(err, log, 1)
    err.unlink()
    log.write_text("trainscale: rank 1 failed: CUDA out of memory\n")
    with pytest.raises(JobFailed, match=r"training failed \(exit 1; CUDA out of memory\)"):
        raise_failure(err, log, 1)
