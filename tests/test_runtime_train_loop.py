"""The training loop stays a loop a reader holds in mind: ``Trainer.run`` is capped at 40 lines (its components own
their cadence), and the pieces it hands the cadence to keep their rules: the held-out windows (one rule for the
trainer and ``trainscale evaluate``), the ETA's window, the one exit-code table of a rank's ``main``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trainscale.errors import JobFailed, TrainscaleError
from trainscale.runtime.evaluator import window_batches, window_spans
from trainscale.runtime.job.metrics import Eta
from trainscale.runtime.job.runfolder import exit_code

SRC = Path(__file__).resolve().parents[1] / "src" / "trainscale"
RUN_CAP = 40


def _method(path: Path, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_trainer_run_is_at_most_40_lines():
    run = _method(SRC / "runtime" / "train.py", "Trainer", "run")
    lines = run.end_lineno - run.lineno + 1
    assert lines <= RUN_CAP, f"Trainer.run is {lines} lines (cap {RUN_CAP}): give the new cadence to its component"


def test_held_out_windows_cover_the_text_once():
    # every token after the first is a target once: windows of seq_len + 1 sharing one token, then the remainder
    assert window_spans(700, 64) == [(i * 64, i * 64 + 65) for i in range(10)] + [(640, 700)]
    assert sum(b - a - 1 for a, b in window_spans(700, 64)) == 699
    assert window_spans(641, 64)[-1] == (576, 641)  # no one-token remainder: nothing left to score
    assert window_spans(1, 64) == [] and window_spans(5, 64) == [(0, 5)]


def test_the_trainers_limit_takes_the_first_windows_and_a_short_text_whole():
    assert window_spans(10_000, 32, 4) == [(0, 33), (32, 65), (64, 97), (96, 129)]
    assert window_spans(100, 32, 3) == [(0, 33), (32, 65), (64, 97)]  # exactly 3 full windows: no remainder
    assert window_spans(100, 32, 4) == [(0, 33), (32, 65), (64, 97), (96, 100)]  # the text ends first


def test_window_batches_stack_windows_of_one_length():
    groups = window_batches(700, 64, batch=8)
    assert [len(g) for g in groups] == [8, 1, 1, 1]  # the group with the shorter remainder goes one by one
    assert [s for g in groups for s in g] == window_spans(700, 64)


def test_eta_is_the_mean_of_the_last_window_of_step_times_after_the_first():
    def reference(times: list[float], remaining: int, window: int = 20) -> float:
        kept = times[1:] if len(times) > 1 else times
        recent = kept[-window:]
        return sum(recent) / len(recent) * remaining

    eta, times = Eta(), []
    for i in range(45):
        t = 0.5 + (i * 37 % 11) / 10
        times.append(t)
        assert eta.add(t, 45 - i - 1) == reference(times, 45 - i - 1)


def test_one_exit_code_table_for_every_rank():
    assert exit_code(TrainscaleError("bad input")) == 2
    assert exit_code(JobFailed("disk full")) == 1
    assert exit_code(RuntimeError("a peer died")) == 1


@pytest.mark.parametrize("module", ["runtime/train.py", "runtime/probe/compare.py"])
def test_every_rank_main_goes_through_worker_main(module):
    text = (SRC / module).read_text()
    assert "worker_main(body)" in text and "rank_main" not in text
    # the functions come before the module's entry point
    tree = ast.parse(text)
    last = tree.body[-1]
    assert isinstance(last, ast.If) and "__main__" in ast.unparse(last.test)


class _Manager:
    """A CheckpointManager's surface as SaveCadence uses it, recording the saves."""

    def __init__(self) -> None:
        self.saved: list[int] = []

    def poll(self) -> None:
        pass

    def save(self, step: int, state: dict, extras: dict) -> None:
        self.saved.append(step)


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    from trainscale.runtime.parallel.mesh import init_distributed

    made = not dist.is_initialized()
    device = init_distributed()
    yield device
    if made:
        dist.destroy_process_group()


def test_save_cadence_saves_every_n_steps_and_on_the_schedulers_signal(one_rank, tmp_path, monkeypatch):
    from trainscale.runtime.job.checkpoint import SaveCadence
    from trainscale.runtime.job.slurm import SAVE_REQUEST_ENV, STOPPED_ENV

    said, records = [], []
    mgr = _Manager()
    cadence = SaveCadence(mgr, 4, None, one_rank, said.append)
    after = lambda step: cadence.after_step(step, 10, dict, dict, lambda s, sec: records.append(s))  # noqa: E731
    assert [after(s) for s in (1, 2, 3, 4)] == [False] * 4 and mgr.saved == records == [4]
    request = tmp_path / "save-request"
    request.touch()
    monkeypatch.setenv(SAVE_REQUEST_ENV, str(request))
    assert after(5) is False and mgr.saved == [4, 5] and not request.exists()  # saved, no requeue script: go on
    assert "[signal] checkpoint requested" in said[-1] and "stopping" not in said[-1]
    request.touch()
    monkeypatch.setenv(STOPPED_ENV, str(tmp_path / "stopped"))
    assert after(6) is True and mgr.saved == [4, 5, 6] and said[-1].endswith("then stopping for the requeue")
    assert after(7) is False and mgr.saved == [4, 5, 6]  # the request was taken: no save until the next due step


def test_the_rows_of_a_saved_step_are_written_before_its_save_begins(one_rank):
    """A kill between a checkpoint's commit and its step's row would resume past a step metrics.jsonl never holds
    (the chaos test saw it: step 3 committed, its row still pending on the device)."""
    from trainscale.runtime.job.checkpoint import SaveCadence

    order: list[str] = []

    class Manager(_Manager):
        def save(self, step, state, extras):
            order.append(f"save {step}")

    cadence = SaveCadence(Manager(), 2, None, one_rank, lambda _: None)
    for step in (1, 2, 3, 4):
        cadence.after_step(step, 4, dict, dict, lambda s, sec: order.append(f"record {s}"),
                           lambda s=step: order.append(f"flush {s}"))
    assert order == ["flush 2", "save 2", "record 2", "flush 4", "save 4", "record 4"]


def test_an_asynchronous_save_in_flight_is_polled_on_the_signal_steps_only(one_rank):
    """poll() is a collective read back on the host: a step that does not log must not wait for it."""
    from trainscale.runtime.job.checkpoint import SaveCadence

    polls: list[int] = []

    class Manager(_Manager):
        def poll(self):
            polls.append(step)

    cadence = SaveCadence(Manager(), 3, None, one_rank, lambda _: None, signal_every=5)
    for step in range(1, 13):
        cadence.after_step(step, 12, dict, dict, lambda s, sec: None)
    assert polls == [5, 10, 12]


def test_blocks_are_compiled_by_default_on_cuda_only_and_as_asked_otherwise():
    import torch

    from trainscale.runtime.config import load_config
    from trainscale.runtime.train import compiled_blocks

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
    assert load_config(TINY).train.compile is None  # unset in the shipped configs: the device decides
    assert [compiled_blocks(None, cuda), compiled_blocks(None, cpu)] == [True, False]
    assert [compiled_blocks(False, cuda), compiled_blocks(True, cpu)] == [False, True]
    cfg = load_config(TINY, {"train": {"compile": False}})
    assert "compile = false" in cfg.to_toml() and "compile" not in load_config(TINY).to_toml()


def test_a_local_launch_exports_the_nccl_and_allocator_defaults_the_slurm_script_does(monkeypatch):
    import trainscale.runtime.data.corpus as corpus
    import trainscale.runtime.measure as measure
    from trainscale.runtime.config import load_config
    from trainscale.runtime.job.local import job_env
    from trainscale.runtime.job.slurm import NCCL_DEFAULTS

    monkeypatch.setattr(corpus, "corpus_for", lambda cfg: None)
    monkeypatch.setattr(measure, "cpu_peak_flops", lambda remeasure=False: 1e9)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # what the environment sets wins
    env = job_env(load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"))
    assert env["NCCL_DEBUG"] == "INFO" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    defaults = dict(NCCL_DEFAULTS)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == defaults["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
