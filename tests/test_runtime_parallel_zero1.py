"""zero1 in the runtime (issue 19): the optimizer state sharded over the data-parallel ranks with whole weights and
gradients on every rank (Megatron-LM's distributed optimizer; runtime/parallel/zero1.py).

- the losses of zero1 layouts (dp, with tensor parallelism, with a pipeline, with gradient accumulation, HSDP)
  equal the single-process run's over 8 steps, to the parity tests' 1e-4 relative (fp32, CPU, gloo);
- every rank's optimizer state, measured from the real tensors, is the byte count estimate/measured/rank.py
  predicts for the layout (what ``train --compare-plan`` checks), about 1/dp of zero0's, with zero0's whole
  weights and gradients;
- a checkpoint written at dp2,zero1 resumes at dp2,zero2, at dp2,zero3 and in one process, and one written at
  dp2,zero2 resumes at dp2,zero1, each continuing the uninterrupted run's losses (DCP reshards the optimizer
  state because zero1 names and places it as FSDP2 does).

Three torchrun jobs in all (world 2, 4, then 1: the single process resumes the world-2 checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _parity import run_layouts

from trainscale.estimate.measured.rank import ADAM_STEP_BYTES, rank_state_bytes
from trainscale.runtime.config import load_config
from trainscale.specs import Layout

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny.toml"
STEPS, SAVE_AT = 8, 4
TOL = 1e-4  # tests/test_runtime_parallel_parity.py's

# world size -> items of tests/_runtime_worker.py. Without mb a dp rank accumulates gradients over its 4 sequences
# one at a time (mb1); "state:" also reads every rank's state bytes; "save:"/"resume:" checkpoint at step 4.
JOBS: dict[int, list[str]] = {
    2: ["dp2,zero1", "state:dp2,zero1,mb4", "state:dp2,mb4", "save:dp2,zero1", "resume:dp2,zero1>dp2,zero2,mb4",
        "resume:dp2,zero1>fsdp2", "save:dp2,zero2,mb4", "resume:dp2,zero2,mb4>dp2,zero1"],
    4: ["state:dp2,tp2,zero1,mb4", "pp2,dp2,zero1", "state:dp4,hsdp2,zero1,mb2"],
    1: ["mb8", "resume:dp2,zero1>mb8"],  # after world 2, whose checkpoint the second item resumes
}
PARITY = ["dp2,zero1", "state:dp2,zero1,mb4", "state:dp2,tp2,zero1,mb4", "pp2,dp2,zero1", "state:dp4,hsdp2,zero1,mb2"]
STATES = [item for items in JOBS.values() for item in items if item.startswith("state:")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("zero1")
    got: dict[str, dict] = {}
    for world, items in JOBS.items():  # in this order: the world-1 job reads the world-2 job's checkpoint
        got.update(run_layouts(CONFIG, STEPS, world, items, out, save_at=SAVE_AT))
    return got


def _rel(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) and got
    return max(abs(x - y) / abs(y) for x, y in zip(got, want, strict=True))


@pytest.mark.parametrize("item", PARITY)
def test_zero1_losses_match_single_process(runs, item):
    ref, got = runs["mb8"]["losses"], runs[item]["losses"]
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.1  # it learns
    assert _rel(got, ref) < TOL, f"{item}: {got} vs single process {ref}"


@pytest.mark.parametrize("item", STATES)
def test_optimizer_state_bytes_are_the_rank_models(runs, item):
    """Parameters, gradients and AdamW state of every rank, from the real tensors, equal rank_state_bytes."""
    spec, layout = load_config(CONFIG).model, Layout.parse(item[6:])
    measured = runs[item]["state"]
    assert len(measured) == layout.world_size
    for rank, got in enumerate(measured):
        want = rank_state_bytes(spec, layout, rank).as_dict()
        assert {k: got[k] for k in want if k != "tensors"} == {k: v for k, v in want.items() if k != "tensors"}, rank


def test_zero1_optimizer_state_is_one_dp_th_of_zero0s(runs):
    zero0, zero1 = runs["state:dp2,mb4"]["state"], runs["state:dp2,zero1,mb4"]["state"]
    for r0, r1 in zip(zero0, zero1, strict=True):
        assert r1["parameters"] == r0["parameters"] and r1["gradients"] == r0["gradients"]  # whole on every rank
        moments0 = r0["optimizer"] - ADAM_STEP_BYTES * r0["tensors"]  # exp_avg + exp_avg_sq
        moments1 = r1["optimizer"] - ADAM_STEP_BYTES * r1["tensors"]
        assert moments0 == 2 * r0["parameters"]  # fp32 moments of every weight
        assert moments1 == pytest.approx(moments0 / 2, rel=0.01)
    # the two ranks' shards cover every weight's moments exactly once
    assert sum(r["optimizer"] - ADAM_STEP_BYTES * r["tensors"] for r in zero1) == \
        zero0[0]["optimizer"] - ADAM_STEP_BYTES * zero0[0]["tensors"]


@pytest.mark.parametrize("item", ["save:dp2,zero1", "resume:dp2,zero1>dp2,zero2,mb4", "resume:dp2,zero1>fsdp2",
                                  "resume:dp2,zero1>mb8", "save:dp2,zero2,mb4", "resume:dp2,zero2,mb4>dp2,zero1"])
def test_checkpoints_cross_zero1_and_fsdp(runs, item):
    ref = runs["mb8"]["losses"]
    want = ref[:SAVE_AT] if item.startswith("save:") else ref[SAVE_AT:]
    got = runs[item]["losses"]
    assert len(got) == len(want), f"{item}: {got}"
    assert _rel(got, want) < TOL, f"{item}: {got} vs uninterrupted {want}"
