"""Elastic training: when torchrun re-forms the job with fewer (or more) processes than the layout was
written for (``--nnodes MIN:MAX`` after a node is lost), pick the layout for the new world size.

The rule keeps every model-parallel degree (tp, cp, pp, virtual stages, schedule, recompute) and the
global batch — so the model is cut the same way and the optimizer sees the same batches — and changes
only the data-parallel degree: dp' = world / (tp x cp x pp). The checkpoint is resharded onto the new
layout by torch.distributed.checkpoint, and the data loader's position is a global batch index
(runtime/data.TokenLoader), so the job continues on exactly the sequences it would have seen. When the
rule gives no valid layout (the world is not a multiple of tp x cp x pp, or the global batch does not
split over dp' x mb), the user's fallback layout is used if its world size fits; otherwise the job stops
with one sentence.
"""

from __future__ import annotations

from trainscale.errors import TrainscaleError
from trainscale.runtime.config import TrainConfig, check_layout
from trainscale.specs import Layout


def _valid(cfg: TrainConfig, lay: Layout) -> str | None:
    try:
        check_layout(cfg, lay)
    except TrainscaleError as e:
        return str(e)
    return None


def layout_for_world(cfg: TrainConfig, layout: Layout, world: int, fallback: Layout | None = None
                     ) -> tuple[Layout, str]:
    """-> (the layout to run on ``world`` processes, why). ``layout`` itself when its world size matches."""
    if layout.world_size == world:
        return layout, "the layout's own world size"
    model_parallel = layout.tp * layout.cp * layout.pp
    reasons = []
    if world % model_parallel == 0:
        dp = world // model_parallel
        fields = layout.model_dump()
        fields["dp"] = dp
        if layout.hsdp > 1 and dp % layout.hsdp:
            fields["hsdp"] = 1
        if fields["zero"] and dp == 1:
            fields["zero"], fields["hsdp"] = 0, 1
        try:
            cand = Layout(**fields)
        except ValueError as e:
            cand, why = None, str(e)
        else:
            why = _valid(cfg, cand)
        if cand is not None and why is None:
            return cand, (f"world size {world} (the layout was written for {layout.world_size}): kept tp{layout.tp} "
                          f"cp{layout.cp} pp{layout.pp}, data parallelism dp{layout.dp} -> dp{dp}")
        reasons.append(f"dp{dp} does not work ({why})")
    else:
        reasons.append(f"{world} processes are not a multiple of tp x cp x pp = {model_parallel}")
    if fallback is not None:
        if fallback.world_size != world:
            reasons.append(f"the fallback layout {fallback} needs {fallback.world_size} processes")
        elif (why := _valid(cfg, fallback)) is not None:
            reasons.append(f"the fallback layout {fallback} does not fit the config ({why})")
        else:
            return fallback, f"world size {world}: the fallback layout (the layout's own rule failed: {reasons[0]})"
    raise TrainscaleError(f"no layout for the {world} processes left: {'; '.join(reasons)}"
                          + ("" if fallback else "; give --fallback-layout for this world size"))


def check_fallback(cfg: TrainConfig, layout: Layout, text: str, min_nodes: int, max_nodes: int) -> None:
    """``--fallback-layout`` (``text``), checked where it is given (not when a node is lost): the job is elastic
    (MIN < MAX machines), the fallback trains this config (every runtime rule, with its sentence: tp3 on 4 heads
    names the tp that trains), and its world size is one the re-formed job can have (fewer machines, the same
    processes per machine). One sentence (TrainscaleError) otherwise, naming the fallback as it was given."""
    fallback = Layout.parse(text)
    if min_nodes >= max_nodes:
        raise TrainscaleError(f"--fallback-layout {text} serves an elastic job re-formed on fewer machines; give "
                              "--nnodes MIN:MAX with MIN < MAX, or leave the fallback out")
    if (why := _valid(cfg, fallback)) is not None:
        raise TrainscaleError(f"--fallback-layout {text}: {why}")
    per_node = max(1, layout.world_size // max_nodes)
    worlds = [n * per_node for n in range(min_nodes, max_nodes)]
    if fallback.world_size not in worlds:
        shown = ", ".join(str(w) for w in worlds[:8]) + (", ..." if len(worlds) > 8 else "")
        raise TrainscaleError(f"--fallback-layout {text} runs {fallback.world_size} process(es), but this job "
                              f"re-forms with {shown} ({min_nodes}..{max_nodes - 1} machine(s) x {per_node} "
                              "process(es) each)")
