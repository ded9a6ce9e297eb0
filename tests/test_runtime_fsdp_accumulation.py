"""Gradient accumulation under FSDP2 holds what the memory model counts (issue 30): runtime/train.py lets FSDP2
reduce-scatter after every micro-batch, so between micro-batches a rank holds only its shard of the fp32 gradients
(estimate/measured/rank.rank_state_bytes counts numel of the rank's shards x 4). Turning the sync off until the
last micro-batch, as before, kept the whole unsharded fp32 gradient of every unit on every rank (+4 bytes per
parameter of the model: 30 GiB per GPU at 8B). Two real processes, fsdp2 with four micro-batches."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
WORKER = ROOT / "tests" / "_accum_worker.py"


@pytest.mark.dist
def test_fsdp2_accumulation_holds_only_each_ranks_gradient_shard(tmp_path):
    from _parity import run_job

    from trainscale.estimate.measured.rank import rank_state_bytes
    from trainscale.runtime.config import load_config
    from trainscale.specs import Layout

    result = tmp_path / "accum"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           "--config", str(TINY), "--layout", "fsdp2,mb2", "--result", str(result)]
    proc = run_job(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    cfg = load_config(TINY)
    for r in range(2):
        got = json.loads(Path(f"{result}.rank{r}.json").read_text())
        micro = cfg.train.global_batch // 2 // 2
        assert len(got["held"]) == 2 * (micro - 1)  # two steps, every micro-batch after the first
        counted = rank_state_bytes(cfg.model, Layout.parse("fsdp2,mb2"), r).gradients
        assert counted == got["local_params"]  # the model counts this rank's shards
        # after the first micro-batch: exactly the rank's gradient shards, never the unsharded model's
        assert all(h == counted for h in got["held"]), (got["held"], counted)
