"""The fast loop's guard (tests/conftest.py): an unmarked test that starts a training process fails, naming it.

Each case runs inside ``no_training_processes``, the guard every unmarked test runs in: torchrun started here, a
``trainscale.runtime.train`` started by a child Python process, and a torch.multiprocessing worker are each refused
with one message; a plain subprocess is not."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.multiprocessing as mp
from conftest import no_training_processes


def _worker(rank: int) -> None:
    pass


def test_torchrun_started_here_fails_the_test(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"started a training process: a subprocess `.*torch\.distributed"
                                                    r"\.run --standalone"):
        with no_training_processes(tmp_path / "report"):
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "trainscale.runtime.train"], capture_output=True)


def test_training_started_by_a_child_process_fails_the_test(tmp_path):
    """The child (a plain Python process, as ``trainscale train`` is) is allowed; the training it starts is not,
    even when the child swallows the refusal (the module's name is put together in the child, out of the parent's
    sight)."""
    child = ("import subprocess, sys\n"
             "try:\n    subprocess.run([sys.executable, '-m', 'trainscale.runtime.' + 'train', '--help'])\n"
             "except BaseException:\n    print('swallowed')\n")
    with pytest.raises(pytest.fail.Exception, match=r"a subprocess `.* -m trainscale\.runtime\.train --help` "
                                                    r"\(in process \d+\)"):
        with no_training_processes(tmp_path / "report"):
            r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env={"PATH": "/usr/bin"})
            assert r.returncode == 0 and r.stdout == "swallowed\n"


def test_multiprocessing_workers_fail_the_test(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="a multiprocessing process"):
        with no_training_processes(tmp_path / "report"):
            mp.start_processes(_worker, nprocs=2, start_method="spawn")


def test_other_processes_pass(tmp_path):
    with no_training_processes(tmp_path / "report"):
        r = subprocess.run([sys.executable, "-c", "print('not training')"], capture_output=True, text=True)
    assert r.stdout == "not training\n"
    assert not (tmp_path / "report").exists()
