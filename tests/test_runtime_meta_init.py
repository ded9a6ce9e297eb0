"""Issue 30, item 3: the same weights however the model is built. A parameter's initial values depend on the seed
and its name only (runtime/model.normal_box), so the model built on the meta device (``[model] init`` folders,
models too big to build whole on one GPU; forced here with TRAINSCALE_META_INIT=1) and then initialised shard by
shard holds exactly the whole CPU build's weights: per pipeline stage (pp2, pp4, a tied embedding's copy on the last
stage), per TP / FSDP / EP shard (DTensor boxes), gathered from real processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _parity import run_job

import trainscale.runtime.model as model_mod
from trainscale.runtime.config import load_config
from trainscale.runtime.model import build_model, normal_box
from trainscale.runtime.parallel.pipeline import split_model
from trainscale.specs import Layout

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny.toml"
WORKER = ROOT / "tests" / "_meta_init_worker.py"
# world size -> items (tests/_meta_init_worker.py): the layouts of the issue, a tied embedding under a pipeline
# (the last stage's copy), a MoE's experts split by EP and sharded by FSDP, and FSDP over TP (a 2-D box: rows by
# FSDP, TP's rows or columns inside them)
JOBS = {2: ["pp2", "pp2,v2", "tp2,mb8", "fsdp2", "tied:pp2", "moe:fsdp2,ep2"], 4: ["pp4", "fsdp2,tp2"]}


@pytest.mark.parametrize("box", [(slice(0, 37), slice(0, 11)), (slice(5, 30), slice(3, 8)),
                                 (slice(9, 10), slice(0, 11)), (slice(36, 37), slice(10, 11))])
def test_a_box_is_the_whole_draw_sliced(monkeypatch, box):
    """Rows are drawn in blocks (9 rows of 11 here): any box, within a block or across blocks, is the whole
    tensor's draw sliced; another name or another seed draws other values."""
    monkeypatch.setattr(model_mod, "INIT_BLOCK", 100)
    whole = normal_box("layers.0.attention.wq.weight", (37, 11), 0.02, 7, (slice(0, 37), slice(0, 11)))
    assert torch.equal(normal_box("layers.0.attention.wq.weight", (37, 11), 0.02, 7, box), whole[box])
    assert not torch.equal(normal_box("layers.1.attention.wq.weight", (37, 11), 0.02, 7, box), whole[box])
    assert not torch.equal(normal_box("layers.0.attention.wq.weight", (37, 11), 0.02, 8, box), whole[box])


def test_a_3d_expert_tensor_box_is_sliced_too():
    whole = normal_box("layers.1.moe.experts.w1", (4, 6, 5), 1.0, 0, (slice(0, 4), slice(0, 6), slice(0, 5)))
    box = (slice(2, 4), slice(1, 4), slice(0, 5))  # EP's experts (dim 0), FSDP's rows inside them (dim 1)
    assert torch.equal(normal_box("layers.1.moe.experts.w1", (4, 6, 5), 1.0, 0, box), whole[box])


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("layout", ["pp2", "pp4", "pp2,v2"])
def test_stages_built_on_meta_hold_the_whole_builds_weights(layout, tied):
    """One process, no collective: every pipeline stage built on the meta device, materialised and initialised
    alone (as ``Trainer._build_parts`` does per part) holds the whole CPU build's values, layer 3 of stage 4 too
    (each stage used to replay stage 0's random stream)."""
    spec = load_config(CONFIG, {"model": {"tied_embeddings": tied}}).model
    whole = dict(build_model(spec, "cpu", seed=5).named_parameters())
    lo = Layout.parse(layout)
    seen = set()
    for rank in range(lo.pp):
        for _, part in split_model(build_model(spec, "meta"), lo, rank):
            part.to_empty(device="cpu")
            part.init_weights(5)
            for name, p in part.named_parameters():
                assert torch.equal(p, whole[name]), (layout, rank, name)
                seen.add(name)
    assert seen == set(whole)


@pytest.mark.dist
def test_meta_init_gathers_to_the_cpu_build_under_every_layout(tmp_path):
    got: dict[str, dict] = {}
    for world, items in JOBS.items():
        result = tmp_path / f"world{world}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(WORKER), "--config", str(CONFIG), "--layouts", ";".join(items), "--result", str(result)]
        proc = run_job(cmd)
        assert proc.returncode == 0, f"world {world}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        got.update(json.loads(result.read_text()))
    for item in (i for items in JOBS.values() for i in items):
        r = got[item]
        assert r["meta"], item  # the meta path was the one taken
        assert r["apart"] == [] and r["differ"] == [] and r["max_diff"] == 0.0, (item, r)
