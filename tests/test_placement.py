"""One grammar and one placement (issue 12): a layout string means one thing to the planner and the runtime,
``str`` and ``Layout.parse`` round-trip to an equal, identically-behaving layout, and the planner
(estimate/pipeline.py, estimate/measured/rank.py) and the runtime (runtime/parallel/pipeline.py's split_model on a
real model, runtime/parallel/mesh.py's DeviceMesh, runtime/parallel/parallelize.py's DTensor plan) agree on every
rank's layers, coordinates and shards because they read the same torch-free module, trainscale.placement.

The runtime side runs in one process: models on the meta device (126 layers cost nothing), and torch's
"fake" process group, which gives a process any rank of any world so DeviceMesh and DTensor can be built
as that rank would build them.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainscale import placement as P
from trainscale.errors import TrainscaleError
from trainscale.estimate import pipeline
from trainscale.estimate.measured import rank as R
from trainscale.runtime.config import check_layout, config_from_dict
from trainscale.runtime.model import build_model
from trainscale.runtime.parallel.mesh import build_mesh
from trainscale.runtime.parallel.parallelize import apply_tensor_parallel
from trainscale.runtime.parallel.pipeline import split_model
from trainscale.specs import Layout, ModelSpec

TINY = {"d_model": 16, "n_heads": 4, "n_kv_heads": 2, "d_ff": 32, "vocab_size": 64, "max_seq_len": 32}


def tiny_spec(n_layers: int, **kw) -> ModelSpec:
    return ModelSpec(name=f"tiny{n_layers}", n_layers=n_layers, **{**TINY, **kw})


# ----------------------------------------------------------------------------- the grammar


def _layouts() -> list[Layout]:
    """Every valid combination of a spread of token values (a few thousand layouts)."""
    out = []
    for tp, cp, pp, dp, zero, hsdp, mb, v, sched, rc, sp in itertools.product(
            (1, 2, 8), (1, 2), (1, 2, 16), (1, 4), (0, 1, 2, 3), (1, 2), (1, 4), (1, 2),
            ("gpipe", "1f1b", "interleaved"), ("none", "selective", "full"), (True, False)):
        try:
            out.append(Layout(tp=tp, cp=cp, pp=pp, dp=dp, zero=zero, hsdp=hsdp, mb=mb, v=v, schedule=sched,
                              recompute=rc, sp=sp))
        except ValueError:
            continue
    return out


LAYOUTS = _layouts()


def _behaviour(cfg, lay: Layout) -> tuple:
    """What the runtime does with a layout: micro-batch, micro-batches per step, mesh, pipeline cut, and
    whether (and why) it refuses the layout."""
    try:
        check_layout(cfg, lay)
        refused = None
    except TrainscaleError as e:
        refused = str(e)
    mb = lay.mb
    return (mb, cfg.train.global_batch // (lay.dp * mb), P.mesh_sizes(lay), refused, lay.world_size,
            [P.rank_layers(cfg.model.n_layers, lay, r) for r in range(lay.pp)], P.tp_plan(lay.sp), lay.recompute,
            lay.schedule, lay.zero, lay.dp_replicate, lay.dp_shard)


@pytest.mark.slow
def test_str_parses_back_to_an_equal_layout_that_behaves_the_same():
    cfg = config_from_dict({"model": {**TINY, "n_layers": 32}, "train": {"seq_len": 32, "global_batch": 256}})
    assert len(LAYOUTS) > 2000
    for lay in LAYOUTS:
        back = Layout.parse(str(lay))
        assert back == lay, str(lay)
        assert str(back) == str(lay)
        assert _behaviour(cfg, back) == _behaviour(cfg, lay), str(lay)


def test_short_strings_mean_their_printed_form():
    """The issue's case: ``dp2`` and its printed form train with the same micro-batches (mb absent = 1,
    for the planner and the runtime alike)."""
    for short in ("dp2", "fsdp2", "pp2", "tp2,nosp", "pp4,v2", "fsdp4,hsdp2", "rc=full,cp2", "dp2,mb4"):
        lay = Layout.parse(short)
        printed = str(lay)
        assert Layout.parse(printed) == lay
        assert Layout.parse(printed).mb == lay.mb
    assert str(Layout.parse("dp2")) == "tp1,cp1,pp1,dp2,mb1,zero0"
    assert Layout.parse("dp2").mb == 1  # 4 micro-batches of 1 per rank, as the planner counts them
    assert Layout.parse("fsdp4") == Layout.parse("dp4,zero3")
    assert Layout.parse("pp4,v2").schedule == "interleaved"
    assert Layout.parse("nosp") == Layout.parse("")  # no tensor parallelism, no sequence parallelism


@pytest.mark.parametrize("text,match", [
    ("dp2,dp4", "sets dp twice"),
    ("fsdp4,zero2", "sets zero twice"),
    ("gpipe", "gpipe schedule needs pp > 1"),
    ("pp2,v2,1f1b", "needs the interleaved schedule"),
    ("zero4", "less than or equal to 3"),
    ("dp4,hsdp2", "hsdp needs a sharded"),
    ("ep4", "ep4 must divide tp1 x cp1 x dp1 = 1"),
    ("dp8,zero3,hsdp4,ep4", "with hsdp4 dividing the 2 ranks that hold the same experts"),
    ("moe4", "not understood"),
])
def test_bad_layouts_are_one_sentence(text, match):
    with pytest.raises(TrainscaleError, match=match) as e:
        Layout.parse(text)
    assert "\n" not in str(e.value)


def test_runtime_runs_every_zero_stage():
    """zero1 (whole gradients, sharded optimizer state) runs as runtime/parallel/zero1.py
    (tests/test_runtime_parallel_zero1.py)."""
    cfg = config_from_dict({"model": {**TINY, "n_layers": 4}, "train": {"seq_len": 32, "global_batch": 8}})
    for ok in ("dp2,zero0", "dp2,zero1", "dp2,zero2", "dp2,zero3"):
        check_layout(cfg, Layout.parse(ok))


# ----------------------------------------------------------------------------- the pipeline cut


def test_llama3_cut_of_126_layers_on_16_stages():
    """Llama 3 405B (126 layers) on 16 pipeline stages: "we reduce one Transformer layer each from the first
    and the last stages" (arXiv 2407.21783 Sec. 3.3.2): 7, 8 x 14, 7."""
    assert P.stage_sizes(126, 16) == [7] + [8] * 14 + [7]
    pl = pipeline.layer_placement(126, 16, 1)
    assert (int(pl["first"]), int(pl["max"]), int(pl["last"]), bool(pl["valid"])) == (7, 8, 7, True)
    # with 8 virtual stages per rank (128 stages, Table 4's interleaving): the first and the last stage hold
    # only the embedding and only the head, every other one layer; ranks 0 and 15 run 7 layers, the rest 8
    assert P.stage_sizes(126, 128) == [0] + [1] * 126 + [0]
    lay = Layout.parse("tp8,pp16,dp128,v8,zero2")
    assert [len(P.rank_layers(126, lay, r)) for r in range(16)] == [7] + [8] * 14 + [7]


def test_vectorised_counts_equal_the_per_rank_cut():
    """rank_layer_counts (the planner's arrays) against rank_layers (the runtime's lists), exhaustively."""
    for n_layers in (1, 2, 3, 4, 5, 7, 16, 32, 61, 80, 126):
        cases = [(p, v) for p in range(1, 18) for v in range(1, 10) if (p > 1 or v == 1) and p * v <= n_layers + 2]
        ps, vs = np.array([c[0] for c in cases]), np.array([c[1] for c in cases])
        got = P.rank_layer_counts(n_layers, ps, vs)
        table = P.layers_per_rank(n_layers, ps, vs)
        for i, (p, v) in enumerate(cases):
            lay = Layout(pp=p, v=v, schedule="interleaved" if v > 1 else "1f1b")
            per_rank = [len(P.rank_layers(n_layers, lay, r)) for r in range(p)]
            sizes = P.stage_sizes(n_layers, p * v)
            assert sum(per_rank) == n_layers and max(sizes) - min(sizes) <= 1
            assert sizes[-1] == min(sizes)  # the head's stage is never a longer one
            assert p * v <= 2 or sizes[0] <= max(sizes[1:-1])  # nor the embedding's, while a middle one is not
            assert (got["first"][i], got["last"][i], got["max"][i]) == (per_rank[0], per_rank[-1], max(per_rank)), \
                (n_layers, p, v)
            assert got["per_stage"][i] == max(sizes)
            assert table[i, :p].tolist() == per_rank and not table[i, p:].any()
            even = n_layers % (p * v) == 0
            llama = not even and p > 1 and (n_layers + 2) % (p * v) == 0
            assert (bool(got["even"][i]), bool(got["llama3"][i])) == (even, llama)


# (n_layers, layout): 405B-like, 70B-like and small, with interleaving, uneven and Llama 3 cuts, and
# embedding-only / head-only stages
AGREE = [
    (126, "tp8,pp16,dp128,zero2"), (126, "tp8,pp16,dp128,v8,zero2"), (126, "pp16,v4"), (126, "pp2"), (126, "pp3"),
    (126, "pp4"), (126, "pp7,v2"), (126, "pp8,v2"), (126, "pp9,v2"), (80, "tp2,cp4,pp4,dp2,v20,zero2"),
    (80, "pp8,v5"), (80, "pp16"), (80, "pp6"), (32, "pp4"), (32, "pp4,v2"), (32, "pp5"), (32, "pp2,v3"),
    (4, "pp2"), (4, "pp2,v2"), (4, "pp2,v3"), (4, "pp4"), (4, "pp3"), (5, "pp2"), (5, "pp2,v2"), (7, "pp3,v2"),
    (4, "dp2,tp2,pp2"), (6, "cp2,pp2,v2,fsdp2"), (4, "fsdp4,hsdp2,pp2"), (2, "pp2,v2"), (3, "pp1"),
]


@pytest.mark.parametrize("n_layers,text", AGREE)
def test_planner_and_runtime_agree_on_every_ranks_layers(n_layers, text):
    lay = Layout.parse(text)
    spec = tiny_spec(n_layers)
    model = build_model(spec, "meta")
    stages = lay.pp * lay.v
    # the runtime: the stage modules split_model gives each pipeline rank
    runtime: dict[int, list[int]] = {}
    for r in range(lay.pp):
        parts = split_model(model, lay, r)
        assert [s for s, _ in parts] == P.local_stage_ids(lay, r)
        for s, part in parts:
            assert (part.tok_embeddings is not None) == (s == 0)
            assert (part.output is not None) == part.has_head == (s == stages - 1)
        runtime[r] = [int(k) for _, part in parts for k in part.layers]
    assert sorted(i for ls in runtime.values() for i in ls) == list(range(n_layers))  # each layer once
    # the shared function and the planner's arrays
    assert runtime == {r: P.rank_layers(n_layers, lay, r) for r in range(lay.pp)}
    pl = pipeline.layer_placement(n_layers, np.array([lay.pp]), np.array([lay.v]))
    counts = [len(runtime[r]) for r in range(lay.pp)]
    assert (pl["first"][0], pl["last"][0], pl["max"][0]) == (counts[0], counts[-1], max(counts))
    # estimate/measured/rank.py, on every global rank (one per pipeline rank for the 16,384-GPU layouts)
    ranks = range(lay.world_size) if lay.world_size <= 64 else [P.rank_of(lay, {"pp": r}) for r in range(lay.pp)]
    for g in ranks:
        names = [n for n, _ in R.rank_tensors(spec, lay, g)]
        layers = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
        pp_rank = P.coords(lay, g)["pp"]
        assert layers == sorted(runtime[pp_rank])
        assert ("tok_embeddings.weight" in names) == (pp_rank == 0)
        assert ("output.weight" in names) == (pp_rank == lay.pp - 1)


def test_split_stages_chained_compute_the_whole_model():
    """A real (tiny, CPU) model cut by placement, embedding-only and head-only stages included: the stages run
    one after another give the unsplit model's logits."""
    spec = tiny_spec(4)
    model = build_model(spec, "cpu", seed=1)
    tokens = torch.randint(0, spec.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(tokens)
        for text in ("pp2,v3", "pp3", "pp2,v2", "pp4"):
            lay = Layout.parse(text)
            parts = dict(p for r in range(lay.pp) for p in split_model(model, lay, r))
            h = tokens
            for s in range(lay.pp * lay.v):
                h = parts[s](h)
            torch.testing.assert_close(h, whole, rtol=0, atol=0)


# ----------------------------------------------------------------------------- the mesh and the TP plan


def _fake_rank(world: int, rank: int) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


@pytest.mark.parametrize("text", ["pp2,dp2,cp2,tp2", "dp4,zero3,hsdp2,tp2", "fsdp2,cp2,pp2,v2", "tp2,pp4,dp2",
                                  "dp8", "fsdp8,hsdp4"])
def test_runtime_mesh_coordinates_are_placements(text):
    """Every rank's DeviceMesh coordinate and group members (runtime/parallel/mesh.py) are placement's."""
    lay = Layout.parse(text)
    for g in range(lay.world_size):
        c = P.coords(lay, g)
        assert P.rank_of(lay, c) == g
        _fake_rank(lay.world_size, g)
        try:
            mesh = build_mesh(lay)
            assert {d: mesh.coord(d) for d in P.MESH_DIMS} == c
            for name in P.FLAT_DIMS:
                assert mesh.coord(name) == P.flat_coord(lay, c, name)
            for dim in (*P.MESH_DIMS, *P.FLAT_DIMS):
                assert sorted(mesh[dim].mesh.flatten().tolist()) == P.group_ranks(lay, g, (dim,)), (dim, g)
        finally:
            dist.destroy_process_group()


def test_mesh_order_is_llama3s():
    """[TP, CP, PP, DP] from the inside out (arXiv 2407.21783 Sec. 3.3.2): TP neighbours, DP the largest stride."""
    lay = Layout.parse("tp8,cp2,pp16,dp128,zero2,hsdp8")
    assert P.group_ranks(lay, 0, ("tp",)) == list(range(8))
    assert P.group_ranks(lay, 0, ("cp",)) == [0, 8]
    assert P.group_ranks(lay, 0, ("pp",)) == list(range(0, 256, 16))
    assert P.group_ranks(lay, 0, ("dp",))[:2] == [0, 256]
    assert P.group_ranks(lay, 0, ("dp_shard",))[:2] == [0, 256]  # the shard group inside one replica group
    assert P.group_ranks(lay, 0, ("dp_replicate",))[:2] == [0, 256 * 16]


@pytest.mark.parametrize("variant,sp", [({}, True), ({}, False),
                                        ({"mlp": "gelu", "norm": "layernorm", "positions": "learned", "bias": True},
                                         True)])
def test_runtime_tp_shards_what_the_plan_says(variant, sp):
    """After runtime/parallel/parallelize.py applies the TP plan, each parameter is sharded on the dim placement's
    ``tp_shard_dim`` (the one estimate/measured/rank.py counts) and nowhere else."""
    spec = tiny_spec(2, **variant)
    lay = Layout(tp=2, sp=sp)
    _fake_rank(2, 0)
    try:
        model = build_model(spec, "cpu")
        apply_tensor_parallel(model, build_mesh(lay), sp=lay.sp)
        seen = 0
        for name, p in model.named_parameters():
            want = P.tp_shard_dim(name)
            got = None
            if isinstance(p, DTensor):
                shards = [pl.dim for pl in p.placements if pl.is_shard()]
                got = shards[0] if shards else None
                seen += 1
            assert got == want, name
        assert seen > 0
    finally:
        dist.destroy_process_group()


def test_placement_imports_no_torch():
    """The planner reads placement without loading torch (``trainscale plan`` starts fast)."""
    import subprocess
    import sys

    code = "import sys, trainscale.placement, trainscale.estimate.pipeline; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
