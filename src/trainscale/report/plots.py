"""The pictures. Each function draws one figure from estimator (or run) numbers and returns a
``Plot``: the files it wrote, a title, a caption, and the numbers it shows as a text table.

matplotlib runs headless (Agg); every figure has a title and labelled axes with units.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from trainscale import placement  # noqa: E402
from trainscale.estimate import flops, memory  # noqa: E402
from trainscale.estimate.params import param_count  # noqa: E402
from trainscale.specs import ClusterSpec, GPUSpec, Layout, ModelSpec  # noqa: E402

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
          "#CCB974", "#64B5CD"]


@dataclass
class Plot:
    key: str
    title: str
    caption: str
    files: list[str]
    table: list[tuple[str, str]] = field(default_factory=list)


def _save(fig: Any, out: Path, key: str) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for ext in ("png", "svg"):
        fig.savefig(out / f"{key}.{ext}", dpi=110, bbox_inches="tight")
        names.append(f"{key}.{ext}")
    plt.close(fig)
    return names


def training_state(m: ModelSpec, gpus: list[GPUSpec], out: Path, seq: int = 8192) -> Plot:
    """Stacked bar of bytes per model (weights / gradients / optimizer / activations) beside GPUs."""
    n = param_count(m)
    st = memory.training_state_bytes(n)
    act = memory.first_stage_activation_bytes(m, seq, 1, recompute="selective")
    parts = [("weights (bf16)", st.weights), ("gradients (bf16)", st.gradients),
             ("Adam optimizer (fp32)", st.optimizer), (f"activations (seq {seq}, selective recompute)", act)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = 0.0
    for i, (label, b) in enumerate(parts):
        ax.bar([m.name], [b / 1e9], bottom=bottom, color=COLORS[i], label=label)
        bottom += b / 1e9
    for j, g in enumerate(gpus):
        ax.bar([f"one {g.name}"], [g.memory_bytes / 1e9], color=COLORS[5 + j])
        ax.text(1 + j, g.memory_bytes / 1e9, f"{g.memory_bytes / 1e9:.0f} GB", ha="center", va="bottom")
    ax.set_ylabel("memory (GB, decimal)")
    ax.set_title(f"Training state of {m.name} vs one GPU's memory")
    ax.legend(loc="upper right", fontsize=8)
    table = [(label, f"{b / 1e9:,.0f} GB") for label, b in parts]
    table += [(f"x one {g.name} ({g.memory_bytes / 1e9:.0f} GB)", f"{(st.total) / g.memory_bytes:,.1f}x")
              for g in gpus]
    return Plot("training_state", fig.axes[0].get_title(),
                "ZeRO's 16 bytes/parameter (Rajbhandari et al. 2020) plus Korthikanti et al. 2022 activations.",
                _save(fig, out, "training_state"), table)


def time_to_train(m: ModelSpec, tokens: float, c: float, one: GPUSpec, cluster_gpu: GPUSpec, n_gpus: int, mfu: float,
                  out: Path) -> Plot:
    """One GPU vs the cluster: years vs days, log scale, for training compute ``c`` (``flops.training_compute``)."""
    rows = [
        (f"1 x {one.name} at peak", flops.seconds_on(c, 1, one.peak_bf16_flops)),
        (f"1 x {one.name} at {mfu:.0%} MFU", flops.seconds_on(c, 1, one.peak_bf16_flops, mfu)),
        (f"1 x {cluster_gpu.name} at {mfu:.0%} MFU", flops.seconds_on(c, 1, cluster_gpu.peak_bf16_flops, mfu)),
        (f"{n_gpus:,} x {cluster_gpu.name} at {mfu:.0%} MFU",
         flops.seconds_on(c, n_gpus, cluster_gpu.peak_bf16_flops, mfu)),
    ]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    days = [s / flops.SECONDS_PER_DAY for _, s in rows]
    ax.barh([r[0] for r in rows], days, color=COLORS[:4])
    ax.set_xscale("log")
    ax.set_xlabel("days (log scale)")
    ax.set_title(f"Time to train {m.name} on {tokens:.3g} tokens ({c:.2g} FLOPs)")
    for i, d in enumerate(days):
        ax.text(d, i, f" {d / 365.25:,.0f} years" if d > 3650 else f" {d:,.0f} days", va="center", fontsize=8)
    ax.invert_yaxis()
    table = [(label, f"{s / flops.SECONDS_PER_DAY:,.1f} days ({s / flops.SECONDS_PER_YEAR:,.1f} years)")
             for label, s in rows]
    return Plot("time_to_train", ax.get_title(), f"Training FLOPs ({flops.FLOP_CONVENTION_NAME}) divided by peak x "
                "MFU x GPUs.",
                _save(fig, out, "time_to_train"), table)


def compute_growth(flops_now: float, low: float, high: float, out: Path, years: int = 5,
                   start_year: int = 2024) -> Plot:
    """Projection of frontier training compute at low/high growth per year (Epoch AI)."""
    xs = list(range(years + 1))
    lo = [flops.compute_growth(flops_now, y, low) for y in xs]
    hi = [flops.compute_growth(flops_now, y, high) for y in xs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([start_year + x for x in xs], lo, "o-", color=COLORS[0], label=f"{low:.0f}x per year")
    ax.plot([start_year + x for x in xs], hi, "o-", color=COLORS[3], label=f"{high:.0f}x per year")
    ax.set_yscale("log")
    ax.set_xlabel("year")
    ax.set_ylabel("training compute (FLOPs, log scale)")
    ax.set_title("Frontier training compute, projected")
    ax.legend()
    table = [(str(start_year + x), f"{a:.2g} - {b:.2g} FLOPs") for x, a, b in zip(xs, lo, hi, strict=True)]
    return Plot("compute_growth", ax.get_title(),
                f"Starting from {flops_now:.2g} FLOPs in {start_year}; Epoch AI (2024): 4-5x per year.",
                _save(fig, out, "compute_growth"), table)


def rank_coords(layout: Layout, rank: int) -> dict[str, int]:
    """Rank -> (tp, cp, pp, dp) index as the runtime lays them out (``trainscale.placement``): TP innermost,
    then CP, PP, DP outermost, the order of Llama 3's 4D parallelism (arXiv 2407.21783 Sec. 3.3.2, Fig. 5)."""
    c = placement.coords(layout, rank)
    return {"tp": c["tp"], "cp": c["cp"], "pp": c["pp"], "ep": c["ep"], "dp": placement.flat_coord(layout, c, "dp")}


def gb(n: float) -> str:
    """Bytes as decimal gigabytes, labelled (the report's memory unit)."""
    return f"{n / 1e9:,.1f} GB"


def layout_mesh(layout: Layout, cluster: ClusterSpec, out: Path, max_gpus: int = 256,
                memory: tuple[float, float] | None = None, invalid: str | None = None, unit: str = "GPUs") -> Plot:
    """The layout drawn on the hardware: one square per GPU, a row per server, racks outlined;
    colour = pipeline stage, label = TP rank, the number under it = DP replica, and with expert parallelism
    the EP rank (e) and an edge colour per EP rank. ``memory`` = (the planner's bytes per GPU, the GPU's usable
    bytes): a layout that does not fit says so across the picture, as does one the rules refuse (``invalid``)."""
    n = min(layout.world_size, max_gpus)
    per_server, per_rack = cluster.gpus_per_server, cluster.gpus_per_rack
    servers = -(-n // per_server)
    fig_h = max(2.5, min(14, servers * 0.32 + 1.5))
    fig, ax = plt.subplots(figsize=(max(6, per_server * 0.6 + 2), fig_h))
    for r in range(n):
        c = rank_coords(layout, r)
        row, col = r // per_server, r % per_server
        ax.add_patch(Rectangle((col, -row), 0.92, 0.86, color=COLORS[c["pp"] % len(COLORS)], alpha=0.35 + 0.65 *
                               (1 - c["cp"] / max(layout.cp, 1))))
        if layout.ep > 1:  # the EP rank as the square's edge: the ranks of one colour hold the same experts
            ax.add_patch(Rectangle((col + 0.03, -row + 0.03), 0.86, 0.80, fill=False, lw=1.6,
                                   ec=COLORS[(c["ep"] + 3) % len(COLORS)]))
        if per_server <= 16:
            label = f"t{c['tp']}\nd{c['dp']}" + (f"\ne{c['ep']}" if layout.ep > 1 else "")
            ax.text(col + 0.46, -row + 0.43, label, ha="center", va="center", fontsize=6 if layout.ep == 1 else 5)
    rack_rows = per_rack // per_server
    for k in range(0, servers, max(rack_rows, 1)):
        h = min(rack_rows, servers - k)
        ax.add_patch(Rectangle((-0.1, -k - h + 0.96), per_server + 0.1, h, fill=False, lw=1.5, ec="black"))
        ax.text(per_server + 0.2, -k - h / 2 + 0.5, f"rack {k // max(rack_rows, 1)}", va="center", fontsize=7)
    ax.set_xlim(-0.3, per_server + 2)
    ax.set_ylim(-servers, 1.2)
    ax.set_xlabel(f"GPU within server ({per_server} per server, scale-up domain of {cluster.scale_up_domain})")
    ax.set_ylabel("server")
    ax.set_yticks([])
    shown = f" (first {n} of {layout.world_size:,})" if n < layout.world_size else ""
    ep = ", e = EP rank (edge colour)" if layout.ep > 1 else ""
    ax.set_title(f"Layout {layout} on {cluster.name}{shown}: colour = PP stage, t = TP rank, d = DP replica{ep}")
    tp_in_server = layout.tp <= per_server and per_server % layout.tp == 0
    inside = " inside one server (NVLink)" if unit == "GPUs" else " on one machine"
    table = [("world size", f"{layout.world_size:,} {unit}"), ("TP group", f"{layout.tp} consecutive {unit}"
              + (inside if tp_in_server else " spanning servers (network)")),
             ("CP group", f"{layout.cp} {unit}, rank stride {layout.tp}"),
             ("PP stages", f"{layout.pp} stages, rank stride {layout.tp * layout.cp * layout.ep}"),
             ("DP replicas", f"{layout.dp} replicas" + (f" ({layout.ep} of them inside the pipeline stage: EP), "
                                                        f"the rest at rank stride "
                                                        f"{layout.tp * layout.cp * layout.ep * layout.pp}"
                                                        if layout.ep > 1 else
                                                        f", rank stride {layout.tp * layout.cp * layout.pp}")),
             ("racks", f"{-(-layout.world_size // per_rack):,} racks of {per_rack} {unit}")]
    if layout.ep > 1:
        table.append(("EP group", f"{layout.ep} {unit} (a factor of the {layout.dp} DP ranks), rank stride "
                                  f"{layout.tp * layout.cp}: each holds 1/{layout.ep} of every MoE layer's experts"))
    verdict = _fit_verdict(memory, invalid)
    if verdict is not None:
        ok, text = verdict
        table.append(("fits in GPU memory" if memory else "layout rules", text))
        if not ok:
            ax.text(0.5, 0.5, textwrap.fill(text, 48), transform=ax.transAxes, ha="center", va="center", fontsize=13,
                    color="#B00020", bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": "#B00020", "lw": 2})
            ax.set_title("DOES NOT FIT - " + ax.get_title() if memory else "INVALID - " + ax.get_title())
    return Plot("layout_mesh", ax.get_title(), "Ranks are ordered [TP, CP, PP, EP, DP] from inner to outer, as in "
                "Llama 3 (EP a factor of DP).", _save(fig, out, "layout_mesh"), table)


def _fit_verdict(memory: tuple[float, float] | None, invalid: str | None) -> tuple[bool, str] | None:
    """(fits, the sentence) for the layout picture, from the planner's memory per GPU or the rules' refusal."""
    if invalid:
        return False, f"not a valid layout: {invalid}"
    if memory is None:
        return None
    need, cap = memory
    if need > cap:
        return False, f"does not fit: {gb(need)} per GPU > {gb(cap)} usable"
    return True, f"fits: {gb(need)} per GPU of {gb(cap)} usable"


def pipeline_gantt(tl: list[list[tuple[str, int, int, int]]], title: str, out: Path,
                   key: str = "pipeline_schedule") -> Plot:
    """Gantt chart of a pipeline schedule: ``tl[rank]`` lists (kind "F"/"B", micro-batch, start,
    duration) from report.schedule.timeline; the white gaps are the bubble."""
    end = max((s + d for rank in tl for _, _, s, d in rank), default=1)
    fig, ax = plt.subplots(figsize=(min(16, 2 + end * 0.16), 1 + 0.45 * len(tl)))
    busy = 0
    for r, actions in enumerate(tl):
        for kind, mb, start, dur in actions:
            busy += dur
            ax.add_patch(Rectangle((start, -r - 0.4), dur * 0.96, 0.8, color=COLORS[0] if kind == "F" else COLORS[1]))
            ax.text(start + dur / 2, -r, str(mb), ha="center", va="center", fontsize=6, color="white")
    ax.set_xlim(0, end)
    ax.set_ylim(-len(tl) + 0.4, 0.6)
    ax.set_yticks([-r for r in range(len(tl))], [f"rank {r}" for r in range(len(tl))])
    ax.set_xlabel("time (units of one micro-batch forward through one stage chunk; backward = 2 units)")
    ax.set_title(title)
    bubble = 1 - busy / (end * len(tl))
    ax.legend(handles=[Rectangle((0, 0), 1, 1, color=COLORS[0]), Rectangle((0, 0), 1, 1, color=COLORS[1])],
              labels=["forward", "backward"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    table = [("pipeline ranks", f"{len(tl)} ranks"), ("makespan", f"{end} units (one micro-batch forward)"),
             ("idle fraction (bubble)", f"{bubble:.1%} of rank time"),
             ("bubble / useful time", f"{bubble / (1 - bubble):.3f} (ratio)")]
    return Plot(key, title, "Blue: forward of a micro-batch (number = micro-batch), orange: its backward; "
                "white gaps are the bubble.", _save(fig, out, key), table)


def lines(key: str, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list[float], list[float]]],
          out: Path, caption: str = "", logy: bool = False, marks: dict[str, float] | None = None,
          unit: str = "", points: set[str] | frozenset[str] = frozenset(), levels: dict[str, float] | None = None
          ) -> Plot:
    """A generic line chart (loss curves, sweeps, traces), with optional vertical marks; the series named in
    ``points`` are drawn as markers joined by a thin line, ``levels`` as horizontal dotted lines; ``unit``
    follows every number of the table (``xlabel``'s unit is in its parentheses)."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (label, (xs, ys)) in enumerate(series.items()):
        style = {"marker": "o", "ms": 5, "lw": 0.8} if label in points else {"lw": 1.4}
        ax.plot(xs, ys, label=label, color=COLORS[i % len(COLORS)], **style)
    for i, (label, y) in enumerate((levels or {}).items()):
        ax.axhline(y, ls=":", lw=1.4, color=COLORS[(i + 6) % len(COLORS)], label=label)
    for i, (label, x) in enumerate((marks or {}).items()):
        ax.axvline(x, ls="--", color=COLORS[(i + 3) % len(COLORS)], label=label)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) + len(marks or {}) + len(levels or {}) > 1:
        ax.legend(fontsize=8)
    u = f" {unit}" if unit else ""
    table = []
    for label, (xs, ys) in series.items():
        if ys:
            table.append((label, f"first {ys[0]:.4g}{u}, last {ys[-1]:.4g}{u}, min {min(ys):.4g}{u}, max "
                          f"{max(ys):.4g}{u} over {xlabel} {xs[0]:.4g}..{xs[-1]:.4g}"))
    table += [(label, f"{y:.4g}{u}") for label, y in (levels or {}).items()]
    table += [(label, f"at {xlabel} {x:.4g}") for label, x in (marks or {}).items()]
    return Plot(key, title, caption, _save(fig, out, key), table)


def bars(key: str, title: str, ylabel: str, groups: dict[str, dict[str, float]], out: Path,
         caption: str = "") -> Plot:
    """Grouped bars: ``groups[category][series] = value`` (e.g. predicted vs measured)."""
    cats = list(groups)
    names = sorted({s for g in groups.values() for s in g})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) * len(names)), 4))
    w = 0.8 / max(len(names), 1)
    for j, s in enumerate(names):
        ax.bar([i + j * w for i in range(len(cats))], [groups[c].get(s, 0.0) for c in cats], w, label=s,
               color=COLORS[j % len(COLORS)])
    ax.set_xticks([i + w * (len(names) - 1) / 2 for i in range(len(cats))], cats, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    table = [(f"{c}: {s}", f"{v:.4g} {ylabel}") for c, g in groups.items() for s, v in g.items()]
    return Plot(key, title, caption, _save(fig, out, key), table)
