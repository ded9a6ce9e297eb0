"""Every rule a (model, layout, software) must keep, written once, each with the one sentence that says it.

The planner searches with these rules over numpy arrays (one entry per candidate layout); ``specs.Layout``
checks the grammar ones for one layout; the runtime refuses what it cannot train with them. Nothing else
writes a layout rule. A rule reads layout fields (``tp cp pp dp mb v schedule zero hsdp ep sp first last``) and, where
it needs them, the model, the sequence length (``seq``), the global batch in sequences (``seqs``), the GPU
count (``gpus``) and whether the data keeps packed documents apart (``documents``: "" when not, or when the
caller, as the planner, does not know the data); a rule whose inputs a caller does not have is not evaluated
(``holds(partial=True)``).

The sets, by name:

- ``FRAMEWORK``: rules every training framework keeps (Megatron-Core, torchtitan, this runtime alike): a
  layout that breaks one runs nowhere.
- ``SEARCH``: what the planner leaves out of its search although a framework could run it, because its model
  does not cover it or it is never faster (uneven pipeline cuts, an interleaved pipeline short of micro-batches).
- ``RUNTIME``: what this runtime (torch.distributed, ``trainscale.runtime``) does not train.
- ``PLANNED = FRAMEWORK + SEARCH``: the planner's search space.
- ``RUNNABLE = PLANNED + RUNTIME``: the layouts of that space this runtime trains (``plan --runnable``,
  ``train --plan``).
- ``RUNTIME_CHECK = FRAMEWORK + RUNTIME``: what ``runtime.config.check_layout`` refuses; on the planner's
  space it refuses exactly what ``RUNNABLE`` leaves out.
- ``LAYOUT``: the rules on a layout's own fields (``specs.Layout`` keeps them at construction).

ZeRO stages 0-3 are all runnable: zero1 is optimizer-state sharding over the data-parallel mesh (Megatron's
distributed optimizer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from math import gcd, isqrt
from types import SimpleNamespace
from typing import Any

import numpy as np

from trainscale.errors import TrainscaleError

LAYOUT_FIELDS = ("tp", "cp", "pp", "dp", "mb", "v", "schedule", "zero", "hsdp", "ep", "sp", "first", "last")
_FIELD_DEFAULTS = {"first": 0, "last": 0}  # fields a layout-like object may lack (an explicit pipeline cut)


@dataclass(frozen=True)
class Case:
    """Layouts as arrays (``schedule`` as indices into ``schedules``; absent fields are not known here), with
    the model (a ``specs.ModelSpec``), sequence length, global batch in sequences and GPU count asked for, how
    the data keeps documents apart (``documents``: "", "document_mask" or "chat") and, for a sentence, the
    layouts as written (``labels``)."""

    arrays: dict[str, np.ndarray]
    schedules: tuple[str, ...] = ()
    model: Any = None
    seq: int | None = None
    seqs: int | None = None
    gpus: int | None = None
    documents: str = ""
    labels: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.arrays[name]
        except KeyError:
            raise AttributeError(name) from None

    def has(self, name: str) -> bool:
        if name in self.arrays:
            return True
        return name in ("model", "seq", "seqs", "gpus", "documents") and getattr(self, name) is not None

    def is_schedule(self, name: str) -> np.ndarray:
        """Where the schedule is ``name`` (a ``specs.Schedule`` word)."""
        if name not in self.schedules:
            return np.zeros(self.arrays["schedule"].shape, dtype=bool)
        return self.arrays["schedule"] == self.schedules.index(name)

    @property
    def micro(self) -> np.ndarray:
        """Micro-batches per step through each pipeline: global batch / (dp x mb)."""
        return self.seqs // (self.dp * self.mb)

    def row(self, i: int = 0) -> SimpleNamespace:
        """Layout ``i`` as plain Python values, for a sentence."""
        vals = {k: (bool(a[i]) if a.dtype == bool else int(a[i])) for k, a in self.arrays.items()}
        if "schedule" in vals:
            vals["schedule"] = self.schedules[vals["schedule"]]
        return SimpleNamespace(**vals, model=self.model, seq=self.seq, seqs=self.seqs, gpus=self.gpus,
                               documents=self.documents, label=self.labels[i] if self.labels else None)


def case_of(layouts: Iterable[Any], model: Any = None, seq: int | None = None, seqs: int | None = None,
            gpus: int | None = None, documents: str = "") -> Case:
    """A ``Case`` of ``specs.Layout`` objects (anything with the layout's fields; ``str`` of one is its label)."""
    lays = list(layouts)
    names = tuple(sorted({lay.schedule for lay in lays}))
    # int64, or Python ints (object) for a count past int64 that a later check refuses in its own words
    arrays = {k: np.asarray([getattr(lay, k, _FIELD_DEFAULTS.get(k)) for lay in lays])
              for k in LAYOUT_FIELDS if k != "schedule"}
    arrays["schedule"] = np.array([names.index(lay.schedule) for lay in lays], dtype=np.int64)
    return Case(arrays, names, model, seq, seqs, gpus, documents, tuple(str(lay) for lay in lays))


@dataclass(frozen=True)
class Rule:
    """One constraint: ``holds`` (vectorised, True = kept), the sentence ``says`` for one layout that breaks
    it, what it ``reads``, and where the framework behind it says so (``source``)."""

    name: str
    reads: tuple[str, ...]
    holds: Callable[[Case], np.ndarray]
    says: Callable[[SimpleNamespace], str]
    source: str = field(repr=False)


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending (O(sqrt n))."""
    small = [d for d in range(1, isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def _good_tp(r: SimpleNamespace) -> list[int]:
    """Every tensor-parallel degree that trains this model: it splits the heads, the KV heads, the MLP and (above
    tp1) the vocabulary. Not only those that divide this layout's process count: the other degrees (dp) change
    with tp, and the world rule speaks for the count."""
    m = r.model
    return [t for t in _divisors(gcd(m.n_heads, m.n_kv_heads, m.d_ff)) if t == 1 or m.vocab_size % t == 0]


def _tp_says(what: Callable[[Any], str]) -> Callable[[SimpleNamespace], str]:
    """The sentence of a rule on what tp must divide: ``what(model)`` names it."""
    return lambda r: f"tp{r.tp} must divide {r.model.name}'s {what(r.model)}; use tp in {_good_tp(r)}"


def _world_says(r: SimpleNamespace) -> str:
    mp, n = r.tp * r.cp * r.pp, r.gpus
    fix = f"dp{n // mp} would fill them" if n % mp == 0 else f"tp x cp x pp = {mp} must divide {n:,}"
    return (f"the layout uses tp x cp x pp x dp = {mp * r.dp:,} GPUs, not the {n:,} asked for; {fix}")


MAX_PROCESSES = 100_000_000  # more GPUs than any cluster has or will soon


def _processes(c: Case) -> np.ndarray:
    """The layout's world and each of its degrees within ``MAX_PROCESSES`` (in floats: a product of six-digit
    degrees passes int64)."""
    degrees = [np.asarray(getattr(c, k), dtype=float) for k in ("tp", "cp", "pp", "dp", "mb", "v", "hsdp")]
    world = degrees[0] * degrees[1] * degrees[2] * degrees[3]
    return (world <= MAX_PROCESSES) & np.all([d <= MAX_PROCESSES for d in degrees], axis=0)


def _ep_says(r: SimpleNamespace) -> str:
    ranks = getattr(r, "tp", 1) * getattr(r, "cp", 1) * r.dp  # a --fix ep check knows the GPU count only (as dp)
    good = [e for e in _divisors(r.model.n_experts) if ranks % (e * r.hsdp) == 0][-6:]
    return f"ep{r.ep} must divide the model's {r.model.n_experts} experts; use ep in {good}"


def _ep_divides_says(r: SimpleNamespace) -> str:
    n = r.tp * r.cp * r.dp
    return (f"ep{r.ep} must divide tp{r.tp} x cp{r.cp} x dp{r.dp} = {n}" +
            (f" with hsdp{r.hsdp} dividing the {n // r.ep if n % r.ep == 0 else n / r.ep:g} ranks that hold the same "
             "experts" if r.hsdp > 1 else "") + " (expert parallelism splits a stage's ranks)")


def _ep_in_dp_says(r: SimpleNamespace) -> str:
    of = f"dp{r.dp}" if r.hsdp == 1 else f"dp{r.dp} / hsdp{r.hsdp} = {r.dp // r.hsdp}"
    return (f"ep{r.ep} must divide {of} for this runtime, which splits experts over data-parallel ranks only "
            "(Megatron-Core also takes tensor- and context-parallel ranks)")


def _explicit(c: Case) -> np.ndarray:
    """Where the layout gives its own pipeline cut (firstN / lastN)."""
    return (c.first > 0) | (c.last > 0)


def _uneven_rest(c: Case) -> tuple[np.ndarray, np.ndarray]:
    """(layers left for the other pipeline ranks, how many ranks take them) of a firstN / lastN cut."""
    return c.model.n_layers - c.first - c.last, c.pp - (c.first > 0) - (c.last > 0)


def _uneven_holds(c: Case) -> np.ndarray:
    if not np.any(_explicit(c)):  # the search's own candidates: nothing to check
        return np.ones(np.shape(c.first), dtype=bool)
    rest, ranks = _uneven_rest(c)
    ve = np.where(c.is_schedule("interleaved"), c.v, 1)
    per = np.where(ranks > 0, rest // np.maximum(ranks, 1), 0)
    even = np.where(ranks > 0, (rest > 0) & (rest % np.maximum(ranks, 1) == 0), rest == 0)
    by_v = (c.first % ve == 0) & (c.last % ve == 0) & (per % ve == 0)
    return ~_explicit(c) | ((c.pp > 1) & (rest >= 0) & even & by_v)


def _uneven_says(r: SimpleNamespace) -> str:
    set_ = " and ".join(f"{k}{getattr(r, k)}" for k in ("first", "last") if getattr(r, k))
    if r.pp == 1:
        return f"{set_} cuts a pipeline, and the layout has pp1"
    ranks = r.pp - (r.first > 0) - (r.last > 0)
    rest = r.model.n_layers - r.first - r.last
    ve = r.v if r.schedule == "interleaved" else 1
    return (f"{set_} leave {rest} of {r.model.n_layers} layers for {ranks} other pipeline rank(s), which must take "
            f"a whole, equal number each" + (f", a multiple of v{ve} as every count must be" if ve > 1 else ""))


def _cut_says(r: SimpleNamespace) -> str:
    m, ve = r.model, r.v if r.schedule == "interleaved" else 1
    if m.is_moe:
        return (f"{m.n_layers} layers leave a pipeline stage without a layer over pp{r.pp} x v{ve} = {r.pp * ve} "
                f"stages; use pp x v of at most {m.n_layers}")
    chunks = sorted(set(_divisors(m.n_layers)) | {c for c in _divisors(m.n_layers + 2) if c > 1})
    return (f"{m.n_layers} layers do not split over pp{r.pp} x v{ve} = {r.pp * ve} pipeline chunks (evenly, or as "
            f"{m.n_layers + 2} slots with the embedding and head on the end stages); use pp x v in {chunks}")


def balanced_cut(n_layers: int, pp: Any, chunks: Any) -> np.ndarray:
    """The cuts the planner searches: the L layers split evenly over the pp x v chunks, or L + 2 slots do (the
    end stages give a slot each to the embedding and the head, Llama 3's cut: arXiv 2407.21783 Sec. 3.3.2), on
    at most L pipeline ranks (``placement``'s "balanced" cuts; the end stages are two only with pp > 1)."""
    pp, chunks = np.asarray(pp), np.asarray(chunks)
    return (pp <= n_layers) & ((n_layers % chunks == 0) | ((pp > 1) & ((n_layers + 2) % chunks == 0)))


def _cut(c: Case) -> np.ndarray:
    m = c.model
    chunks = c.pp * np.where(c.is_schedule("interleaved"), c.v, 1)
    # a MoE's layers are unequal (dense leading layers, MoE ones) so no cut balances them exactly: any cut that
    # leaves every stage a layer is searched, each judged by its slowest and its heaviest stage; a cut the layout
    # gives (firstN / lastN) is its own
    policy = chunks <= m.n_layers if m.is_moe else balanced_cut(m.n_layers, c.pp, chunks)
    return policy | _explicit(c)


_DOCUMENTS = {"chat": "chat data (data.format = \"chat\")", "document_mask": "data.document_mask"}


def _piped(c: Case, schedule: str) -> np.ndarray:
    return (c.pp > 1) & c.is_schedule(schedule)


_RULES = (
    Rule("world", ("tp", "cp", "pp", "dp", "gpus"), lambda c: c.tp * c.cp * c.pp * c.dp == c.gpus, _world_says,
         "the layout's ranks are the job's: world = tp x cp x pp x dp (every framework's device mesh)"),
    Rule("processes", ("tp", "cp", "pp", "dp", "mb", "v", "hsdp"), _processes,
         lambda r: (f"it asks for {float(r.tp * r.cp * r.pp * r.dp):.3g} processes; at most {MAX_PROCESSES:,} are "
                    "supported"),
         "no cluster has more than 10^8 GPUs (the largest published jobs use 10^4-10^5), so a larger count is a typo"),
    Rule("hsdp_divides", ("dp", "hsdp"), lambda c: c.dp % c.hsdp == 0,
         lambda r: f"hsdp{r.hsdp} must divide dp{r.dp}",
         "HSDP's replica groups each shard over dp / hsdp ranks (torch FSDP2's 2-D (replicate, shard) mesh)"),
    Rule("hsdp_sharded", ("hsdp", "zero"), lambda c: (c.hsdp == 1) | (c.zero > 0),
         lambda r: "hsdp needs a sharded data-parallel mode (zero1-3 or fsdp)",
         "hybrid sharding replicates shard groups: with zero0 there is nothing sharded (FSDP2 HSDP)"),
    Rule("ep_divides", ("tp", "cp", "dp", "hsdp", "ep"),
         lambda c: (c.tp * c.cp * c.dp) % (c.ep * np.maximum(c.hsdp, 1)) == 0, _ep_divides_says,
         "Megatron-Core (megatron/core/parallel_state.py initialize_model_parallel) lays the experts out on their own "
         "rank grid, expert TP x EP x expert DP x PP = world, and raises unless world_size % (expert_tensor x "
         "expert_model x pipeline parallel size) == 0: with expert TP 1, ep divides tp x cp x dp; its distributed "
         "optimizer instances (our hsdp) must divide expert_data_parallel_size (same file)"),
    Rule("ep_in_dp", ("dp", "hsdp", "ep"), lambda c: (c.dp // np.maximum(c.hsdp, 1)) % c.ep == 0, _ep_in_dp_says,
         "the runtime's mesh puts EP inside the data-parallel ranks (placement.mesh_sizes: dp = dp_replicate x "
         "dp_shard x ep)"),
    Rule("v_interleaved", ("v", "schedule"), lambda c: (c.v == 1) | c.is_schedule("interleaved"),
         lambda r: f"v{r.v} (virtual stages) needs the interleaved schedule",
         "virtual stages are the interleaved 1F1B schedule's (Narayanan et al. 2021, arXiv 2104.04473 Sec. 2.2.2)"),
    Rule("schedule_pp", ("pp", "schedule"), lambda c: (c.pp > 1) | c.is_schedule("1f1b"),
         lambda r: f"the {r.schedule} schedule needs pp > 1",
         "a pipeline schedule orders micro-batches between pipeline stages; without them there is none"),
    Rule("mla", ("model",), lambda c: np.asarray(c.model.attention != "mla"),
         lambda r: (f"model {r.model.name} uses multi-head latent attention, which trainscale plans but does not "
                    "train (the runtime has multi-head and grouped-query attention only)"),
         "runtime/model.py builds multi-head and grouped-query attention only"),
    Rule("capacity", ("model",), lambda c: np.asarray(not (c.model.is_moe and c.model.capacity_factor)),
         lambda r: (f"model {r.model.name} has capacity_factor {r.model.capacity_factor}: the runtime routes "
                    "dropless only (capacity_factor = 0)"),
         "runtime/moe.py routes every token to its top-k experts (dropless, as MegaBlocks, arXiv 2211.15841)"),
    Rule("mtp", ("model",), lambda c: np.asarray(c.model.mtp_layers == 0),
         lambda r: (f"model {r.model.name} has {r.model.mtp_layers} multi-token-prediction module(s), which trainscale "
                    "plans but does not train"),
         "runtime/model.py builds the main model only (no MTP module, DeepSeek-V3 Sec. 2.2)"),
    Rule("experts_dense", ("ep", "model"), lambda c: (c.ep == 1) | c.model.is_moe,
         lambda r: (f"ep{r.ep} (expert parallelism) needs a mixture-of-experts model, and {r.model.name} is a dense "
                    "model with no experts; drop the ep token"),
         "expert parallelism splits a MoE layer's experts; a dense model has none"),
    Rule("experts", ("ep", "model"), lambda c: (c.ep == 1) | (c.model.n_experts % np.maximum(c.ep, 1) == 0),
         _ep_says, "each EP rank holds n_experts / ep whole experts (Megatron-Core: num_moe_experts must be a "
         "multiple of expert_model_parallel_size; torchtitan shards experts with Shard(0) over ep)"),
    Rule("heads", ("tp", "model"), lambda c: c.model.n_heads % c.tp == 0,
         _tp_says(lambda m: f"{m.n_heads} attention heads"),
         "Megatron-Core: divide(num_attention_heads, tp) (megatron/core/transformer/attention.py); torchtitan: "
         "n_heads // tp"),
    # tp a multiple of the KV heads would replicate KV heads over TP ranks: no trainer does (inference engines such
    # as vLLM do); Megatron-Core asserts divide(num_query_groups, tp) and torchtitan shards n_kv_heads // tp
    Rule("kv_heads", ("tp", "model"), lambda c: c.model.n_kv_heads % c.tp == 0,
         _tp_says(lambda m: f"{m.n_kv_heads} KV heads"),
         "Megatron-Core: divide(num_query_groups, tp) asserts (megatron/core/transformer/attention.py); torchtitan "
         "and torch's TP tutorial shard n_kv_heads // tp"),
    Rule("ffn", ("tp", "model"), lambda c: c.model.d_ff % c.tp == 0,
         _tp_says(lambda m: f"MLP width of {m.d_ff:,}"),
         "Megatron-LM's ColumnParallelLinear: divide(output_size, tp) (Shoeybi et al. 2019, arXiv 1909.08053)"),
    Rule("vocab", ("tp", "model"), lambda c: (c.tp == 1) | (c.model.vocab_size % c.tp == 0),
         lambda r: (f"tp{r.tp} must divide {r.model.name}'s vocabulary of {r.model.vocab_size:,} (the runtime "
                    "does not pad it)"),
         "the runtime shards the embedding and head by vocabulary rows unpadded (Megatron pads the vocabulary to "
         "a multiple of 128 x tp, make_vocab_size_divisible_by, and runs any)"),
    Rule("stages", ("pp", "v", "model"), lambda c: c.pp * c.v <= c.model.n_layers + 2,
         lambda r: (f"pp{r.pp} x v{r.v} = {r.pp * r.v} stages leave a stage with no layer for the model's "
                    f"{r.model.n_layers} layers"),
         "every pipeline stage runs something: a layer, or the embedding (first) or head (last) "
         "(placement.empty_stages)"),
    Rule("uneven_cut", ("pp", "v", "schedule", "first", "last", "model"), _uneven_holds, _uneven_says,
         "Megatron-Core get_num_layers_to_build (megatron/core/transformer/transformer_block.py): with "
         "num_layers_in_first/last_pipeline_stage the left-over layers must divide the left-over stages; "
         "TransformerConfig requires each rank's count divisible by the virtual pipeline size"),
    Rule("cut", ("pp", "v", "schedule", "first", "last", "model"), _cut, _cut_says,
         "the planner searches balanced cuts only (placement's policy; Llama 3 Sec. 3.3.2), and prices a cut a "
         "layout gives"),
    Rule("runtime_cut", ("first", "last"), lambda c: ~_explicit(c),
         lambda r: ("this runtime cuts the pipeline by its own policy (placement.stage_sizes); drop the first/last "
                    "tokens to train it"),
         "runtime/parallel/pipeline.py builds its stages from placement.stage_layers"),
    Rule("seq", ("cp", "seq"), lambda c: (c.cp == 1) | (c.seq % (2 * c.cp) == 0),
         lambda r: (f"seq {r.seq:,} does not split into 2 x cp{r.cp} = {2 * r.cp} chunks; "
                    f"use a cp that divides {r.seq // 2:,}"),
         "load-balanced context parallelism gives each CP rank 2 of 2 x cp chunks (Llama 3 Sec. 3.3.2; torch's "
         "context_parallel round-robin)"),
    Rule("cp_window", ("cp", "seq", "model"),
         lambda c: (c.cp == 1) | np.logical_not((0 < c.model.sliding_window) & (c.model.sliding_window < c.seq)),
         lambda r: (f"context parallelism does not apply the model's sliding window of {r.model.sliding_window} "
                    f"tokens, shorter than the sequence ({r.seq}); use cp1"),
         "runtime/parallel/context.py's all-gather attention (Llama 3 Sec. 3.3.2) masks by global position, "
         "causal only: a window shorter than the sequence (Mistral, Gemma 2) is not applied across CP ranks"),
    Rule("cp_softcap", ("cp", "model"),
         lambda c: (c.cp == 1) | np.logical_not(c.model.attn_softcap or c.model.query_scale),
         lambda r: ("context parallelism's attention does not soft-cap or rescale the attention scores as this "
                    "model's do (Gemma 2); use cp1"),
         "runtime/parallel/context.py attends with torch's scaled_dot_product_attention (scores q k^T / "
         "sqrt(head_dim), no cap): Gemma 2's attn_logit_softcapping and query_pre_attn_scalar are not applied"),
    Rule("sp_split", ("tp", "cp", "sp", "seq"), lambda c: (c.tp == 1) | ~c.sp | ((c.seq // c.cp) % c.tp == 0),
         lambda r: (f"sequence parallelism needs the per-rank sequence ({r.seq // r.cp:,}) divisible by tp{r.tp}"),
         "sequence parallelism shards each rank's sequence over TP (Korthikanti et al. 2022, arXiv 2205.05198 "
         "Sec. 4.2.2); the runtime's DTensor Shard(1) needs an even split"),
    Rule("documents", ("cp", "pp", "documents"), lambda c: np.asarray(c.documents == "") | ((c.cp == 1) & (c.pp == 1)),
         lambda r: (f"{_DOCUMENTS[r.documents]} keeps packed documents apart, which this runtime does under data, "
                    f"tensor and fully sharded parallelism only, not under layout {r.label} (cp or pp)"),
         "runtime/data/loader.py's document_batch restarts positions at each document and the model masks "
         "attention by them (runtime/model.document_mask) in whole sequences on one rank; context parallelism's "
         "chunks and the pipeline's stages do not carry them"),
    Rule("batch", ("dp", "mb", "seqs"), lambda c: c.seqs % (c.dp * c.mb) == 0,
         lambda r: (f"the global batch of {r.seqs:,} sequences does not split into dp{r.dp} x mb{r.mb}; "
                    f"use dp x mb dividing {r.seqs:,}"),
         "every data-parallel rank runs the same whole number of micro-batches (Megatron's num_microbatches "
         "calculator asserts global_batch % (micro_batch x dp) == 0)"),
    Rule("interleave_fill", ("pp", "dp", "mb", "schedule", "seqs"),
         lambda c: ~_piped(c, "interleaved") | (c.micro >= c.pp),
         lambda r: (f"the interleaved schedule needs at least pp{r.pp} micro-batches, and dp{r.dp} x mb{r.mb} "
                    f"leaves {r.seqs // (r.dp * r.mb)}; use 1f1b, a smaller mb or fewer pipeline stages"),
         "interleaving only shortens the bubble once every stage has a micro-batch (Narayanan 2021 Sec. 2.2.2); "
         "Megatron-Core requires microbatch_group_size_per_vp_stage in [pp, m] "
         "(pipeline_parallel/schedules.py); torch runs fewer in one round, with a longer bubble"),
    Rule("one_f_one_b_fill", ("pp", "dp", "mb", "schedule", "seqs"),
         lambda c: ~_piped(c, "1f1b") | (c.micro >= c.pp),
         lambda r: (f"1F1B needs at least pp{r.pp} micro-batches per step, and global batch / (dp{r.dp} x "
                    f"mb{r.mb}) = {r.seqs // (r.dp * r.mb)}; use gpipe, a smaller mb or fewer pipeline stages"),
         "torch's Schedule1F1B raises when n_microbatches < num_stages (torch/distributed/pipelining/schedules.py); "
         "Megatron-Core runs it, with every micro-batch in the warm-up (min(pp - rank - 1, m)): GPipe's order"),
    Rule("interleave_rounds", ("pp", "dp", "mb", "schedule", "seqs"),
         lambda c: ~_piped(c, "interleaved") | (c.micro % np.maximum(1, c.micro // c.pp) == 0),
         lambda r: (f"the interleaved schedule runs its {r.seqs // (r.dp * r.mb)} micro-batches in "
                    f"{max(1, r.seqs // (r.dp * r.mb) // r.pp)} rounds, which must divide them; use a micro-batch "
                    f"count that is a multiple of pp{r.pp}"),
         "torch's ScheduleInterleaved1F1B: number_of_rounds = max(1, m // pp) must divide m "
         "(torch/distributed/pipelining/schedules.py)"),
)
RULES: dict[str, Rule] = {r.name: r for r in _RULES}

LAYOUT = ("processes", "hsdp_divides", "hsdp_sharded", "ep_divides", "v_interleaved", "schedule_pp")
FRAMEWORK = ("world", *LAYOUT, "experts_dense", "experts", "heads", "kv_heads", "ffn", "stages", "uneven_cut", "seq",
             "batch")
SEARCH = ("cut", "interleave_fill")
RUNTIME = ("ep_in_dp", "mla", "capacity", "mtp", "vocab", "cp_window", "cp_softcap", "sp_split", "documents",
           "one_f_one_b_fill", "interleave_rounds", "runtime_cut")
PLANNED = FRAMEWORK + SEARCH
RUNNABLE = PLANNED + RUNTIME
RUNTIME_CHECK = FRAMEWORK + RUNTIME
MODEL_ONLY = tuple(n for n in RUNTIME if RULES[n].reads == ("model",))


def _n(c: Case) -> int:
    """How many layouts the case holds (one when it holds no layout field: a model-only question)."""
    return next(iter(c.arrays.values())).shape[0] if c.arrays else 1


def _ordered(names: Sequence[str]) -> list[Rule]:
    """The rules named, in the one order their sentences are tried (``_RULES``)."""
    unknown = set(names) - set(RULES)
    if unknown:
        raise KeyError(f"no rule named {sorted(unknown)}")
    return [r for r in _RULES if r.name in names]


def check(case: Case, names: Sequence[str], partial: bool = False) -> dict[str, np.ndarray]:
    """Each named rule as a boolean array over the case's layouts (True = kept). ``partial``: skip the rules
    whose inputs the case lacks (a search narrowing its candidates before it knows every field)."""
    out = {}
    for rule in _ordered(names):
        if all(case.has(k) for k in rule.reads):
            out[rule.name] = np.broadcast_to(np.asarray(rule.holds(case), dtype=bool), (_n(case),))
        elif not partial:
            missing = [k for k in rule.reads if not case.has(k)]
            raise ValueError(f"rule {rule.name} reads {', '.join(missing)}, which this case lacks")
    return out


def holds(case: Case, names: Sequence[str], partial: bool = False) -> np.ndarray:
    """Where every named rule holds."""
    ok = np.ones(_n(case), dtype=bool)
    for a in check(case, names, partial).values():
        ok &= a
    return ok


def first_broken(case: Case, names: Sequence[str], i: int = 0) -> str | None:
    """The sentence of the first named rule layout ``i`` breaks (rules whose inputs are absent are skipped);
    None when it keeps them all."""
    for rule in _ordered(names):
        if all(case.has(k) for k in rule.reads):
            ok = np.broadcast_to(np.asarray(rule.holds(case), dtype=bool), (_n(case),))
            if not ok[i]:
                return rule.says(case.row(i))
    return None


def check_model(spec: Any) -> None:
    """What this runtime cannot build, refused in one sentence (``RUNTIME``'s model-only rules)."""
    why = first_broken(Case({}, model=spec), MODEL_ONLY)
    if why:
        raise TrainscaleError(why)


def check_layout(spec: Any, layout: Any, seq: int, seqs: int, documents: str = "") -> None:
    """What this runtime refuses to train (``RUNTIME_CHECK``), in one sentence: ``spec`` a ``specs.ModelSpec``,
    ``layout`` a ``specs.Layout``, ``seq`` tokens per sequence, ``seqs`` sequences per optimizer step,
    ``documents`` how the data keeps packed documents apart ("", "document_mask" or "chat")."""
    case = case_of([layout], spec, seq, seqs, gpus=layout.tp * layout.cp * layout.pp * layout.dp,
                   documents=documents)
    why = first_broken(case, RUNTIME_CHECK)
    if why:
        raise TrainscaleError(why)


def sources(names: Sequence[str] = RUNNABLE) -> dict[str, str]:
    """Each named rule's source, for a reader (and ``tests/test_rules.py``)."""
    return {r.name: r.source for r in _ordered(names)}
