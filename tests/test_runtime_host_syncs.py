"""No host sync on a training step that does not log (issue 30, DESIGN.md "On the GPU"): a tiny dense model
trained with ``log_every = 5`` reads nothing back on steps 1-4, 6-9, 11 (tests/_sync_worker.py counts every
``item``/``tolist``/``float()``/``int()``/``bool()``/``__index__`` and every ``.cpu()`` of a tensor off the CPU,
by step), and one transfer's reads on a logging step; the values it logs are those of a run that reads every step
(``log_every = 1``), bit for bit. A dense model: a MoE layer reads its routing counts (the expert matmuls' and
all-to-alls' split sizes are host integers), which this does not count against it."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from trainscale.runtime.job.metrics import Deferred, MetricsLog, read_deferred
from trainscale.runtime.parallel.parallelize import clip_grad_norm

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
WORKER = ROOT / "tests" / "_sync_worker.py"
STEPS, LOG_EVERY = 12, 5
LOGGING = {5, 10, 12}  # every log_every-th step and the last


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The worker's counting, in this process (a one-process gloo group), with log_every 5 and 1."""
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tests"))
    from _sync_worker import count_run

    made = not dist.is_initialized()
    tmp = tmp_path_factory.mktemp("syncs")
    try:
        got = {every: count_run(str(TINY), "", STEPS, every, tmp / f"every{every}") for every in (LOG_EVERY, 1)}
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()
    return got, tmp


def _check_counts(syncs: dict[str, list[str]]) -> None:
    quiet = {s: syncs.get(str(s), []) for s in range(1, STEPS + 1) if s not in LOGGING}
    assert all(not v for v in quiet.values()), f"host reads on steps that do not log: {quiet}"
    for s in LOGGING - {STEPS}:  # the last step also evaluates the held-out loss and writes final/
        assert syncs.get(str(s)), f"step {s} logs: its rows are read back there"
        assert all("job/metrics.py" in w for w in syncs[str(s)]), syncs[str(s)]
        assert len(syncs[str(s)]) == 1, f"one read of one transfer on a logging step: {syncs[str(s)]}"


def test_no_host_sync_on_a_step_that_does_not_log(one_process):
    got, _ = one_process
    _check_counts(got[LOG_EVERY]["syncs"])
    assert all(len(got[1]["syncs"].get(str(s), [])) >= 1 for s in range(1, STEPS + 1))  # log_every 1 reads each


def test_deferred_rows_are_the_rows_read_every_step(one_process):
    got, tmp = one_process
    late, each = got[LOG_EVERY], got[1]
    assert late["losses"] == each["losses"] and late["grad_norms"] == each["grad_norms"]
    assert len(late["rows"]) == STEPS and [r["step"] for r in late["rows"]] == list(range(1, STEPS + 1))
    keys = list(each["rows"][0])
    for r in late["rows"]:
        assert list(r) == keys
        assert all(isinstance(r[k], float) for k in ("loss", "grad_norm", "step_time_s", "tokens_per_s", "mfu"))
        assert r["tokens_per_s"] == 8 * 32 / r["step_time_s"] and r["eta_s"] >= 0
    # metrics.jsonl: one row per step, in order, and the same values as the run's result
    lines = [json.loads(x) for x in (tmp / f"every{LOG_EVERY}" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "event" not in x and "tokens_per_s" in x]
    assert [x["step"] for x in steps] == list(range(1, STEPS + 1))
    assert [x["loss"] for x in steps] == late["losses"] and [x["grad_norm"] for x in steps] == late["grad_norms"]


def test_metrics_log_writes_pending_rows_in_order_before_other_rows():
    class Folder:
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def log(self, row: dict) -> None:
            self.rows.append(row)

    folder, said = Folder(), []
    done = lambda row: row.update(tokens_per_s=1.0, flops_per_s=1.0, mfu=0.0)  # noqa: E731
    m = MetricsLog(folder, None, said.append, log_every=4, total=6, complete=done)
    for step in (1, 2, 3):
        m.step({"step": step, "loss": Deferred(torch.tensor([0.5 * step])), "grad_norm": Deferred(
            torch.tensor(1.0, dtype=torch.float64)), "step_time_s": 0.25, "lr": 1e-3, "flop_convention": "x"})
    assert folder.rows == [] and m.losses == []  # nothing read yet
    m.record({"event": "eval", "step": 3})  # another row: the pending steps first, in order
    assert [r.get("event", r["step"]) for r in folder.rows] == [1, 2, 3, "eval"]
    assert m.losses == [0.5, 1.0, 1.5] and folder.rows[0]["grad_norm"] == 1.0 and said == []
    m.step({"step": 4, "loss": Deferred(torch.tensor([2.0])), "grad_norm": 0.0, "step_time_s": 0.25, "lr": 1e-3,
            "flop_convention": "x"})
    assert folder.rows[-1]["step"] == 4 and said and said[-1].startswith("step     4/6")


def test_deferred_values_read_back_as_their_tensors_would():
    counts = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    got = read_deferred([Deferred(torch.tensor([1.25], dtype=torch.float32)), Deferred(counts, lambda c: c),
                         Deferred(None, lambda: 7.0), Deferred(torch.tensor(3), int)])
    assert got == [1.25, counts.tolist(), 7.0, 3]


def test_clipping_on_the_device_is_torchs_and_returns_the_norm_as_a_tensor(tmp_path):
    """clip_grad_norm scales by clamp(max / (norm + 1e-6), max=1) on the device, as torch's clip_grad_norm_."""
    import torch.distributed as dist

    from trainscale.runtime.parallel.mesh import init_distributed
    from trainscale.specs import Layout

    made = not dist.is_initialized()
    init_distributed()
    try:
        class Mesh:
            layout = Layout.parse("")

        for max_norm in (0.5, 100.0):
            gen = torch.Generator().manual_seed(3)
            ours = [torch.nn.Parameter(torch.zeros(5, 7)) for _ in range(3)]
            theirs = [torch.nn.Parameter(torch.zeros(5, 7)) for _ in range(3)]
            for a, b in zip(ours, theirs, strict=True):
                a.grad = torch.randn(5, 7, generator=gen)
                b.grad = a.grad.clone()
            norm = clip_grad_norm(ours, max_norm, Mesh())
            ref = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
            assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float64
            assert math.isclose(float(norm), float(ref), rel_tol=1e-6)
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    finally:
        if made:
            dist.destroy_process_group()


@pytest.mark.dist
def test_dp2_reads_nothing_on_a_step_that_does_not_log(tmp_path):
    """Two processes (gloo), dp2: every rank reads nothing back on the steps that do not log."""
    from _parity import run_job

    result = tmp_path / "syncs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           "--config", str(TINY), "--layout", "dp2", "--steps", str(STEPS), "--log-every", str(LOG_EVERY),
           "--result", str(result)]
    proc = run_job(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads(Path(f"{result}.rank{r}.json").read_text()) for r in range(2)]
    for got in ranks:
        _check_counts(got["syncs"])
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == STEPS
