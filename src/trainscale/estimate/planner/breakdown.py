"""One layout's step, kernel by kernel (``plan --explain-step``): the GEMMs, the attention core, the element-wise
work, the output head, every collective with its bytes and what of it the compute hides, the pipeline bubble and
the optimizer, per micro-batch on the critical stage and per step, to hold against a profiler trace.

Every figure is read from the planner's own evaluation (``step.step_parts``: the same layer, stage, pipeline and
DP records ``step.evaluate`` adds up), never computed again beside it: the items' exposed times add up to the step
time ``plan`` prints (tests/test_commands_plan_explain.py holds them to 1e-9). Two readings use the planner's
functions a second time on the same inputs: a recomputation's GEMM, attention and element-wise parts are
``layer.recompute_time`` of the layer with only those kernels' times kept (it is linear in them), and a
collective's whole time (what is exposed plus what is hidden) is the planner's exposed time with its overlap set
to 0 (``layer.tp_cp_exposed``, ``stages.p2p_exposed``). Bytes are each call's input on this rank, as ``comms``'
ring formulas take them; GB/s is bytes over time (NCCL-tests' "algbw"), latency included.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from trainscale.estimate.planner import layer, moe, stages
from trainscale.estimate.planner.candidates import Candidates
from trainscale.estimate.planner.layer import LayerTime
from trainscale.estimate.planner.plan import Problem, _cfg, layout_at
from trainscale.estimate.planner.step import StepParts, step_parts
from trainscale.specs import Layout

STAGE, STEP = "per micro-batch", "per step"  # where an item is counted: each micro-batch on the critical stage, or once
DP_NAMES = {"ar": "DP all-reduce, gradients", "rs": "DP reduce-scatter, gradients",
            "ag": "DP all-gather, weights", "ar_rep": "HSDP all-reduce, replicas"}


@dataclass(frozen=True)
class Item:
    """One line of the step: ``time_s`` per step, of which ``exposed_s`` is on the critical path (all of it for
    compute); ``per_micro_s`` one micro-batch's share on the critical stage (None for what runs once a step);
    ``calls`` and ``bytes_per_call`` for a collective (bytes on this rank)."""

    name: str
    kind: str  # compute | collective | pipeline | optimizer
    counted: str  # STAGE or STEP
    time_s: float
    exposed_s: float
    per_micro_s: float | None = None
    calls: float | None = None
    bytes_per_call: float | None = None
    note: str = ""

    @property
    def hidden_s(self) -> float:
        return self.time_s - self.exposed_s

    @property
    def bytes(self) -> float | None:
        """Bytes per step (calls x bytes per call), None for what is not a collective."""
        return None if self.calls is None or self.bytes_per_call is None else self.calls * self.bytes_per_call

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hidden_s": self.hidden_s, "bytes": self.bytes,
                "algbw_bytes_per_s": self.bytes / self.time_s if self.bytes and self.time_s > 0 else None}


@dataclass(frozen=True)
class Breakdown:
    """A layout's step as ``Item``s; ``step_time_s`` is the planner's, ``total_s`` their exposed times added."""

    layout: str
    step_time_s: float
    micro_batches: int
    bubble_fraction: float
    stage_layers: int
    stage_dense: int
    stage_moe: int
    head_on_stage: bool
    items: tuple[Item, ...]

    @property
    def total_s(self) -> float:
        return float(sum(i.exposed_s for i in self.items))

    @property
    def hidden_s(self) -> float:
        return float(sum(i.hidden_s for i in self.items))

    def item(self, name: str) -> Item:
        for i in self.items:
            if i.name == name:
                return i
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "step_time_s": self.step_time_s, "total_s": self.total_s,
                "hidden_s": self.hidden_s, "micro_batches": self.micro_batches,
                "bubble_fraction": self.bubble_fraction,
                "critical_stage": {"layers": self.stage_layers, "dense_layers": self.stage_dense,
                                   "moe_layers": self.stage_moe, "output_head": self.head_on_stage},
                "items": [i.as_dict() for i in self.items]}


def _f(x: Any) -> float:
    """Entry 0 of an array over the candidates (or a scalar) as a float."""
    return float(np.asarray(x, dtype=float).reshape(-1)[0])


def recompute_split(c: Candidates, lay: LayerTime, sw: Any) -> dict[str, Any]:
    """A layer's recomputation by kernel: ``layer.recompute_time`` of the layer with only its GEMM, attention or
    element-wise times kept, and the memory-saving knobs (MLA up-projections, norms, a MoE SwiGLU's output) as
    what the layer's recomputation holds beyond them."""
    none = replace(lay, mm_f=0.0, attn_f=0.0, ew_f=0.0, sel=0.0, last_f=0.0)
    return {"gemm": layer.recompute_time(c, replace(none, mm_f=lay.mm_f, sel=lay.sel, last_f=lay.last_f), sw),
            "attention": layer.recompute_time(c, replace(none, attn_f=lay.attn_f), sw),
            "elementwise": layer.recompute_time(c, replace(none, ew_f=lay.ew_f), sw),
            "knobs": lay.rc - layer.recompute_time(c, lay, sw)}


def compute_items(s: StepParts, sw: Any) -> list[Item]:
    """The critical stage's kernels per micro-batch: its dense and MoE layers, the output head, the fixed cost."""
    c, k, micro = s.c, s.k, _f(s.c.micro)
    rd, rm = recompute_split(c, s.dense, sw), recompute_split(c, s.moe, sw)

    def layers(dense: Any, moe_: Any) -> float:
        return _f(k.n_dense * dense + k.n_moe * moe_)

    d, e = s.dense, s.moe
    per = [
        ("GEMM forward", layers(d.mm_f, e.mm_f), "the layers' linear layers (and a MoE's router and experts)"),
        ("GEMM backward", layers(d.mm_b, e.mm_b), "dgrad + wgrad"),
        ("GEMM recompute", layers(rd["gemm"], rm["gemm"]), ""),
        ("attention forward", layers(d.attn_f, e.attn_f), "the attention core (softmax(QK^T)V)"),
        ("attention backward", layers(d.attn - d.attn_f, e.attn - e.attn_f), ""),
        ("attention recompute", layers(rd["attention"], rm["attention"]), ""),
        ("element-wise forward", layers(d.ew_f, e.ew_f), "norms, residuals, RoPE, activation (MoE: permutes)"),
        ("element-wise backward", layers(d.ew - d.ew_f, e.ew - e.ew_f), ""),
        ("element-wise recompute", layers(rd["elementwise"], rm["elementwise"]), ""),
        ("recompute, saving knobs", layers(rd["knobs"], rm["knobs"]), "MLA up-projections, norms, SwiGLU output"),
        ("LM head + loss", _f(k.head), "output GEMM and cross-entropy, fwd + bwd (embedding lookup not modelled)"),
        ("micro-batch overhead", _f(stages.fixed_time(c, sw)), "the software's fixed cost per chunk pass"),
        ("parameter passes", _f(s.st.param_passes), "the software's gradient and shard copies per micro-batch, "
                                                     "HBM-bound (FSDP1: cast, divide, accumulate; FSDP2: copy, cast)"),
    ]
    return [Item(n, "compute", STAGE, t * micro, t * micro, t, note=note) for n, t, note in per]


def stage_collectives(p: Problem, s: StepParts) -> list[Item]:
    """TP, CP and EP traffic per micro-batch on the critical stage: whole (overlap 0) and exposed."""
    c, k, sw, micro = s.c, s.k, p.software, _f(s.c.micro)
    tp_all, cp_all = layer.tp_cp_exposed(p.model, c, p.topo, replace(p.eff, cp_overlap=0.0),
                                         replace(sw, tp_overlap=0.0, tp_wgrad_overlap=False), p.seq)
    n, n_moe = _f(k.layers), _f(k.n_moe)
    ways = 2 + _f(c.full)  # forward, backward, and the forward again under full recompute (layer.tp_cp_exposed)
    act, kv = _f(layer.layer_bytes(p.model, c)), _f(layer.cp_kv_bytes(p.model, c, p.seq))
    out: list[Item] = []

    def add(name: str, whole: float, exposed: float, calls: float, nbytes: float, note: str = "") -> None:
        out.append(Item(name, "collective", STAGE, whole * micro, exposed * micro, whole, calls * micro, nbytes, note))

    tp_w, tp_x = n * _f(tp_all), n * _f(s.tp_x)
    if _f(c.tp) > 1 and bool(np.asarray(c.sp).reshape(-1)[0]):  # 2 all-gathers + 2 reduce-scatters each way
        ag_x = tp_w / 2 * (1 - sw.tp_overlap)  # what weight gradients hide (tp_wgrad_overlap) is reduce-scatter
        add("TP all-gather (SP)", tp_w / 2, ag_x, 2 * ways * n, act, "sequence parallel, Korthikanti Sec. 4.2.2")
        add("TP reduce-scatter (SP)", tp_w / 2, tp_x - ag_x, 2 * ways * n, act)
    elif _f(c.tp) > 1:  # 2 all-reduces each way (Megatron's f and g operators, Shoeybi et al. 2019 Sec. 3)
        add("TP all-reduce", tp_w, tp_x, 2 * ways * n, act, "Megatron f/g operators, Shoeybi 2019 Sec. 3")
    if _f(c.cp) > 1:
        add("CP all-gather K,V + RS dK,dV", n * _f(cp_all), n * _f(s.cp_x), (ways + 1) * n, kv,
            f"{ways:g} all-gathers and 1 reduce-scatter per layer")
    if n_moe and _f(c.ep) > 1:
        disp, comb = (_f(b) for b in moe.a2a_bytes(p.model, c, p.eff, sw))
        add("EP all-to-all dispatch+combine", n_moe * _f(s.moe.a2a), n_moe * _f(s.moe.a2a_x), 2 * ways * n_moe,
            (disp + comb) / 2, f"dispatch {disp / 1e6:,.1f} MB + combine {comb / 1e6:,.1f} MB per call pair")
    return out


def step_items(p: Problem, s: StepParts) -> list[Item]:
    """What runs once a step: the bubble, the pipeline sends, each DP collective, the optimizer."""
    c, micro = s.c, _f(s.c.micro)
    bubble = _f(s.t_pipe) - micro * _f(s.st.total)
    out = [Item("pipeline bubble", "pipeline", STEP, bubble, bubble,
                note=f"{_f(stages.bubble(c, p.software)):.1%} of the stage's work idle")]
    if _f(c.pp) > 1:
        whole = _f(stages.p2p_exposed(p.model, c, p.topo, replace(p.eff, p2p_overlap=0.0)))
        hops, steady = (_f(x) for x in stages.p2p_sends(c))
        out.append(Item("PP send/recv", "collective", STEP, whole, _f(s.p2p_x), calls=hops + steady,
                        bytes_per_call=_f(stages.p2p_bytes(p.model, c)),
                        note=f"{hops:g} fill/drain sends exposed, {steady:g} steady-state ones overlapped"))
    for key, part in s.dp_parts.items():
        if _f(part.calls) > 0:
            out.append(Item(DP_NAMES[key], "collective", STEP, _f(part.total), _f(part.exposed), calls=_f(part.calls),
                            bytes_per_call=_f(part.bytes), note=f"ZeRO-{_f(c.zero):g}" + dp_chunk_note(c, p.software,
                                                                                                         key)))
    out.append(Item("optimizer step", "optimizer", STEP, _f(s.t_opt), _f(s.t_opt), note="Adam, memory-bound"))
    return out


def dp_chunk_note(c: Candidates, sw: Any, key: str) -> str:
    """How a DP collective follows the interleaved schedule's chunks (``dp.chunk_reduce``, ``dp.chunk_gather``), if
    it does."""
    v, zero = _f(c.ve), _f(c.zero)
    if v <= 1 or zero > 1:
        return ""
    if key == "ag" and sw.dp_chunk_gather:
        return f", {v:g} chunks, each gathered one chunk ahead"
    if key != "ag" and sw.dp_chunk_sync != "none":
        return f", {v:g} chunks, each reduced {sw.dp_chunk_sync} its last backward"
    return ""


def explain(p: Problem, cfg: dict[str, np.ndarray], i: int = 0) -> Breakdown:
    """The step of layout ``i`` of ``cfg`` (arrays as ``Problem.enumerate`` gives them), kernel by kernel."""
    one = {key: np.asarray(a)[i:i + 1] for key, a in cfg.items()}
    s = step_parts(p.model, p.gpu, p.topo, p.eff, p.seq, p.global_seqs, one, p.software)
    items = compute_items(s, p.software) + stage_collectives(p, s) + step_items(p, s)
    return Breakdown(str(layout_at(one, 0)), _f(s.step), int(_f(s.c.micro)), _f(stages.bubble(s.c, p.software)),
                     int(_f(s.k.layers)), int(_f(s.k.n_dense)), int(_f(s.k.n_moe)), _f(s.k.head) > 0, tuple(items))


def explain_layout(p: Problem, lay: Layout) -> Breakdown:
    """``explain`` of one layout given as such (``plan --layout``)."""
    return explain(p, _cfg([lay]))
