"""Where everything of a Layout goes, without torch: one module the planner and the runtime both read.

- The device mesh: its dims, their order and sizes, a rank's coordinate on each and back.
- The pipeline cut: which layers each pipeline stage holds, where the embedding and the output head
  go, and which stages a pipeline rank runs.
- The tensor-parallel plan, as data: which module is column-, row- or sequence-parallel.

Words. The model is cut into ``pp * v`` *stages* (torch.distributed.pipelining's PipelineStage: one
contiguous run of layers each; ``v`` > 1 is interleaved 1F1B's virtual stages). A *pipeline rank*
(the ``pp`` coordinate) runs ``v`` of them. The planner's "first / last / fullest stage" are pipeline
ranks: what one GPU holds.

The mesh, outermost dim first, is Llama 3's order [TP, CP, PP, DP] read from the inside out (arXiv
2407.21783 Sec. 3.3.2, "Network-aware parallelism configuration"): tensor parallelism innermost, on
neighbouring GPUs of one server; data parallelism outermost, split into ``dp_replicate`` (HSDP's replica
groups) outside ``dp_shard`` (the ranks one shard group spans). A MoE's expert-parallel ranks (``ep``,
a factor of dp) sit between PP and CP (see ``mesh_sizes``). The planner (estimate/planner/) prices each
collective on the span of ranks this order gives it: TP over tp neighbouring ranks and CP over tp*cp
(``layer.tp_cp_exposed``), the DP/ZeRO groups over the ranks outside them (``dp.collectives``), PP's point to
point past lcm(tp*cp, ep)*pp ranks (``stages.p2p_exposed``); its EP groups are ep neighbouring ranks, Megatron-Core's
placement, where this runtime's sit tp*cp apart (estimate/planner/moe.py says why).
"""

from __future__ import annotations

from collections.abc import Mapping
from math import ceil
from typing import Any, Literal

import numpy as np

from trainscale.specs import Layout

# ----------------------------------------------------------------------------- the mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "pp", "ep", "cp", "tp")  # outermost first; row-major, tp innermost
# flattened dims (runtime/parallel/mesh.py builds them from the world mesh): name -> the mesh dims it joins
FLAT_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard", "ep"),  # which slice of the global batch a rank reads
    "dp_shard_cp": ("dp_shard", "ep", "cp"),  # the group FSDP shards dense weights over (CP ranks hold the same)
    "dp_cp": ("dp_replicate", "dp_shard", "ep", "cp"),  # the group dense gradients are averaged over
    # a MoE's routed experts: split over "ep"; the ranks holding the same experts are these
    "expert_shard": ("dp_shard", "cp"),  # the group FSDP shards one rank's experts over
    "expert_dp": ("dp_replicate", "dp_shard", "cp"),  # the group expert gradients are averaged over
}


def mesh_sizes(layout: Layout) -> dict[str, int]:
    """Size of each mesh dim, in MESH_DIMS order. With zero0 all of dp outside EP replicates; with ZeRO,
    ``hsdp`` replica groups each shard over dp / hsdp ranks (dp_shard x ep). The data-parallel ranks of an
    EP group sit inside the pipeline dim, next to CP and TP: an EP64 group with tp1, cp1 is 64 neighbouring
    ranks (8 servers of 8), as DeepSeek-V3 placed it (arXiv 2412.19437 Sec. 3.2: "64-way Expert Parallelism
    spanning 8 nodes"), where the all-to-all every MoE layer runs stays as close as it can."""
    return {"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "pp": layout.pp, "ep": layout.ep,
            "cp": layout.cp, "tp": layout.tp}


def mesh_shape(layout: Layout) -> tuple[int, ...]:
    sizes = mesh_sizes(layout)
    return tuple(sizes[d] for d in MESH_DIMS)


def coords(layout: Layout, rank: int) -> dict[str, int]:
    """A global rank's coordinate on each mesh dim (row-major over MESH_DIMS, tp innermost)."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside the world of {layout.world_size}")
    sizes = mesh_sizes(layout)
    out: dict[str, int] = {}
    for dim in reversed(MESH_DIMS):
        rank, out[dim] = divmod(rank, sizes[dim])
    return {d: out[d] for d in MESH_DIMS}


def rank_of(layout: Layout, coord: Mapping[str, int]) -> int:
    """The global rank at ``coord`` (every mesh dim; a missing one counts as 0): the inverse of ``coords``."""
    sizes = mesh_sizes(layout)
    rank = 0
    for dim in MESH_DIMS:
        c = coord.get(dim, 0)
        if not 0 <= c < sizes[dim]:
            raise ValueError(f"coordinate {dim}={c} is outside 0..{sizes[dim] - 1}")
        rank = rank * sizes[dim] + c
    return rank


def flat_coord(layout: Layout, coord: Mapping[str, int], name: str) -> int:
    """A rank's index on a flattened dim (FLAT_DIMS), row-major over the dims it joins."""
    sizes = mesh_sizes(layout)
    idx = 0
    for dim in FLAT_DIMS[name]:
        idx = idx * sizes[dim] + coord[dim]
    return idx


def group_ranks(layout: Layout, rank: int, dims: tuple[str, ...]) -> list[int]:
    """The ranks that differ from ``rank`` only on ``dims`` (mesh dims or a FLAT_DIMS name): its group."""
    dims = tuple(d for name in dims for d in FLAT_DIMS.get(name, (name,)))
    here = coords(layout, rank)
    sizes = mesh_sizes(layout)
    out = []
    for idx in np.ndindex(*(sizes[d] for d in dims)):
        out.append(rank_of(layout, {**here, **dict(zip(dims, idx, strict=True))}))
    return sorted(out)


# ----------------------------------------------------------------------------- the pipeline cut
#
# One policy. The L layers split into C = pp * v stages as evenly as possible (sizes differ by at most
# one); where the split is uneven, the longer stages are the middle ones, so the first stage (which also
# holds the embedding) and the last (which also holds the final norm and the output head) are the
# shorter ones. When L + 2 is a multiple of C this is Llama 3's placement: "we reduce one Transformer
# layer each from the first and the last stages" (arXiv 2407.21783 Sec. 3.3.2) -- 126 layers on 16
# stages: 7, 8 x 14, 7. Only when more than C - 2 stages must be longer does the first one take a layer
# too; the last stage is never longer. Even splits and Llama 3's are the "balanced" cuts the planner
# searches over; the runtime runs any cut this policy gives, refusing only stages left with neither a
# layer nor the embedding or the head.


def _extra_rank(c: int, n_stages: int) -> int:
    """The order in which stages receive the leftover layers: the middle ones, then the first, then the last."""
    if 0 < c < n_stages - 1:
        return c - 1
    return max(n_stages - 2, 0) if c == 0 else n_stages - 1


def stage_sizes(n_layers: int, n_stages: int) -> list[int]:
    """Layers on each of the ``n_stages`` pipeline stages (the policy above)."""
    if n_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, not {n_stages}")
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if _extra_rank(c, n_stages) < extra else 0) for c in range(n_stages)]


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """The layer indices of each pipeline stage: contiguous runs of ``stage_sizes``."""
    out, start = [], 0
    for n in stage_sizes(n_layers, n_stages):
        out.append(list(range(start, start + n)))
        start += n
    return out


def local_stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Stages pipeline rank ``pp_rank`` runs: r, r + pp, r + 2pp, ... (the "looped" placement of
    interleaved 1F1B, Narayanan et al. 2021, arXiv 2104.04473 Sec. 2.2.2). Stage 0 (the embedding) is on
    pipeline rank 0 and stage pp*v - 1 (the head) on pipeline rank pp - 1."""
    return [pp_rank + i * layout.pp for i in range(layout.v)]


def n_stages(layout: Layout) -> int:
    return layout.pp * layout.v


def rank_layers(n_layers: int, layout: Layout, pp_rank: int) -> list[int]:
    """Every layer pipeline rank ``pp_rank`` holds, over its stages."""
    cut = stage_layers(n_layers, n_stages(layout))
    return [i for s in local_stage_ids(layout, pp_rank) for i in cut[s]]


def holds_embedding(stage: int) -> bool:
    return stage == 0


def holds_head(layout: Layout, stage: int) -> bool:
    """The last stage holds the final norm and the output head."""
    return stage == n_stages(layout) - 1


def empty_stages(n_layers: int, layout: Layout) -> list[int]:
    """Stages with no layer and neither the embedding nor the head (nothing to run)."""
    sizes = stage_sizes(n_layers, n_stages(layout))
    return [s for s, n in enumerate(sizes) if n == 0 and not holds_embedding(s) and not holds_head(layout, s)]


def _count_in_residue(hi: Any, r: Any, p: Any) -> Any:
    """How many integers c in [1, hi] have c % p == r (0 <= r < p); arrays broadcast."""
    hi = np.maximum(hi, 0)
    return np.where(hi >= r, (hi - r) // p + (r > 0), 0)


def rank_layer_counts(n_layers: int, p: Any, v: Any) -> dict[str, Any]:
    """Layers per pipeline rank for ``p`` ranks of ``v`` stages each, vectorised over numpy arrays (the
    planner scores many layouts at once); the same numbers ``rank_layers`` gives one layout.

    Returns ``first`` (pipeline rank 0, with the embedding), ``last`` (rank p - 1, with the head), ``max``
    (the fullest rank), ``per_stage`` (the longest stage), ``base`` and ``extra`` (C = p·v stages of
    ``base`` layers, ``extra`` of them one longer), ``even`` (extra = 0) and ``llama3`` (an uneven cut
    with extra = C - 2: the first and the last stage one layer short)."""
    p, v = np.asarray(p), np.asarray(v)
    chunks = p * v
    base, extra = np.divmod(n_layers, chunks)
    # stages 1 .. M get the leftover layers first (the middle ones), then stage 0 when extra = C - 1
    middle = np.minimum(extra, chunks - 2)
    first_extra = (extra == chunks - 1) & (chunks > 1)
    # pipeline rank r runs stages r + i·p: count those in [1, M], plus stage 0 on rank 0
    n_first = _count_in_residue(middle, 0, p) + first_extra
    n_last = _count_in_residue(middle, p - 1, np.maximum(p, 1))
    n_max = np.where(p > 1, np.maximum(-(-np.maximum(middle, 0) // p), n_first), n_first)
    first = v * base + np.where(p > 1, n_first, extra)
    last = v * base + np.where(p > 1, n_last, extra)
    fullest = v * base + np.where(p > 1, n_max, extra)
    even = extra == 0
    return {"first": first, "last": last, "max": fullest, "per_stage": base + ~even, "base": base,
            "extra": extra, "even": even, "llama3": ~even & (extra == chunks - 2) & (p > 1)}


def layers_per_rank(n_layers: int, p: Any, v: Any) -> np.ndarray:
    """Layers on every pipeline rank, vectorised: shape ``p.shape + (max p,)``, entry [..., r] the layers of
    pipeline rank r (0 for r >= p). For a per-stage figure such as memory (rank r of 1F1B holds p - r
    micro-batches in flight), the same numbers ``rank_layers`` gives one layout."""
    p, v = np.asarray(p), np.asarray(v)
    base, extra = np.divmod(n_layers, p * v)
    middle = np.minimum(extra, p * v - 2)
    first_extra = (extra == p * v - 1) & (p * v > 1)
    r = np.arange(int(np.max(p)) if p.size else 1)
    pe, ve, be, me = (x[..., None] for x in (p, v, base, middle))
    counts = ve * be + _count_in_residue(me, r, pe) + ((r == 0) & first_extra[..., None])
    return np.where(r < pe, counts, 0)


# ----------------------------------------------------------------------------- the tensor-parallel plan
#
# Megatron-LM's split (Shoeybi et al. 2019, arXiv 1909.08053 Sec. 3): column-parallel Q/K/V and MLP
# up/gate, row-parallel attention out and MLP down, so each sub-layer needs one all-reduce; the
# embeddings and the output head split on the vocabulary. Sequence parallelism (Korthikanti et al. 2022,
# arXiv 2205.05198 Sec. 4.2.2) shards the norms' (and the residual stream's) tokens over the TP ranks.
#
#   colwise   Linear: weight [out, in] sharded on dim 0 (and its bias); input replicated, output sharded
#             on the features. On the head: input sequence-sharded (SP) or replicated, output gathered.
#   rowwise   Linear: weight sharded on dim 1 (its bias replicated); input sharded on the features, output
#             reduced to the sequence-sharded (SP) or replicated residual stream. On an Embedding: the
#             table sharded on dim 0 (vocabulary), its partial sums reduced the same way.
#   sequence  a norm that runs on this rank's sequence shard (SP only)
#   gather    a sub-layer whose input arrives sequence-sharded (SP) or replicated and is made replicated

TPStyle = Literal["colwise", "rowwise", "sequence", "gather"]

TP_MODEL_PLAN: dict[str, TPStyle] = {  # module names in the model (absent modules are skipped)
    "tok_embeddings": "rowwise",
    "pos_embeddings": "rowwise",
    "norm": "sequence",
    "output": "colwise",
}
TP_BLOCK_PLAN: dict[str, TPStyle] = {  # module names inside each decoder block
    "attention": "gather",
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "feed_forward": "gather",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
    "attention_norm": "sequence",
    "ffn_norm": "sequence",
}
EMBEDDINGS = ("tok_embeddings", "pos_embeddings")


def tp_plan(sp: bool) -> tuple[dict[str, TPStyle], dict[str, TPStyle]]:
    """(model plan, block plan) for tensor parallelism with (``sp``) or without sequence parallelism:
    without SP the norms run on the whole (replicated) sequence, so they have no entry."""
    keep = (lambda style: True) if sp else (lambda style: style != "sequence")
    return ({k: s for k, s in TP_MODEL_PLAN.items() if keep(s)}, {k: s for k, s in TP_BLOCK_PLAN.items() if keep(s)})


def _style_of(module: str) -> TPStyle | None:
    """The TP style of the module a parameter named ``...layers.3.attention.wq`` (or ``output``) belongs to."""
    if module in TP_MODEL_PLAN:
        return TP_MODEL_PLAN[module]
    parts = module.split(".")
    if len(parts) >= 3 and parts[0] == "layers":
        return TP_BLOCK_PLAN.get(".".join(parts[2:]))
    return None


def tp_shard_dim(name: str, spec: Any = None) -> int | None:
    """The dim tensor parallelism shards the parameter ``name`` on (None: replicated), from the plan:
    column-parallel weights and biases on dim 0, row-parallel weights on dim 1 (their biases
    replicated), row-parallel embeddings on the vocabulary dim 0; norms are replicated, but for a Q/K norm over the
    whole projection (OLMo-2, ``spec.qk_norm_whole``), whose gain is cut with the heads on dim 0
    (runtime/parallel/parallelize.py)."""
    module, kind = name.rsplit(".", 1)
    if getattr(spec, "qk_norm_whole", False) and module.rsplit(".", 1)[-1] in ("q_norm", "k_norm"):
        return 0
    style = _style_of(module)
    if style == "colwise":
        return 0
    if style == "rowwise":
        if module.rsplit(".", 1)[-1] in EMBEDDINGS:
            return 0
        return 1 if kind == "weight" else None
    return None


def chunk_len(n: int, parts: int, index: int) -> int:
    """Length of piece ``index`` of ``torch.chunk(range(n), parts)``: ceil(n/parts) each, the rest short
    (how DTensor's Shard and FSDP2 cut a dim)."""
    c = ceil(n / parts) if n else 0
    return max(0, min(c, n - index * c))
