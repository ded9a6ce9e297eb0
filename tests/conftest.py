"""What the fast loop leaves out, and its guard: a test not marked ``dist`` or ``service`` starts no training process.

The marks are at the tests (``pytestmark = pytest.mark.dist`` at the top of a file, ``@pytest.mark.dist`` on one
test; the markers are registered in pyproject.toml): ``dist`` for a test that starts real training processes
(torchrun, the train CLI, multi-process workers), ``service`` for one that needs a real service started for it
(Slurm's daemons, headless Chromium). ``pytest -m "not dist and not service"`` (``make test-fast``) leaves both out.

Every other test runs guarded, its fixtures' setup and teardown included (tests/_guard/sitecustomize.py, also on
the PYTHONPATH of every process it starts, so a ``trainscale train`` subprocess that launches torchrun is caught
too): starting a training process (torchrun, ``trainscale.runtime.train``, the torchrun wrapper
``trainscale.runtime.job.launch``, the probe ``trainscale.runtime.probe.compare``, any ``multiprocessing``
process) fails the test, naming what it started.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

GUARD_DIR = Path(__file__).parent / "_guard"
_spec = importlib.util.spec_from_file_location("trainscale_test_guard", GUARD_DIR / "sitecustomize.py")
guard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(guard)


def unguarded(item: pytest.Item) -> bool:
    """A test allowed to start training processes: marked ``dist`` or ``service``."""
    return any(item.get_closest_marker(m) for m in ("dist", "service"))


@contextmanager
def no_training_processes(report: Path) -> Iterator[None]:
    """Refuse training processes here and in the children started meanwhile; fail if one was started, even if the
    code under test swallowed the refusal (a child reports through ``report``)."""
    saved = {k: os.environ.get(k) for k in (guard.GUARD_ENV, "PYTHONPATH")}
    os.environ[guard.GUARD_ENV] = str(report)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(GUARD_DIR), *filter(None, [saved["PYTHONPATH"]])])
    undo = guard.install(str(report))
    try:
        yield
    finally:
        undo()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        started = report.read_text().splitlines() if report.exists() else []
        report.unlink(missing_ok=True)
        if started:
            pytest.fail(f"not marked dist (or service), yet it started a training process: {started[0]}. Mark the "
                        "test @pytest.mark.dist, or keep its work in this process.", pytrace=False)


def _phase(item: pytest.Item) -> Iterator[None]:
    if unguarded(item):
        return (yield)
    report = Path(tempfile.gettempdir()) / f"trainscale-training-guard-{os.getpid()}.txt"
    with no_training_processes(report):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    return (yield from _phase(item))
