"""The pictures. Each function draws one figure from estimator (or run) numbers and returns a
``Plot``: the files it wrote, a title, a caption, and the numbers it shows as a text table.

matplotlib runs headless (Agg); every figure has a title and labelled axes with units.
"""

from __future__ import annotations

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
    return {"tp": c["tp"], "cp": c["cp"], "pp": c["pp"], "dp": placement.flat_coord(layout, c, "dp")}


def layout_mesh(layout: Layout, cluster: ClusterSpec, out: Path, max_gpus: int = 256) -> Plot:
    """The layout drawn on the hardware: one square per GPU, a row per server, racks outlined;
    colour = pipeline stage, label = TP rank, the number under it = DP replica."""
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
        if per_server <= 16:
            ax.text(col + 0.46, -row + 0.43, f"t{c['tp']}\nd{c['dp']}", ha="center", va="center", fontsize=6)
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
    ax.set_title(f"Layout {layout} on {cluster.name}{shown}: colour = PP stage, t = TP rank, d = DP replica")
    tp_in_server = layout.tp <= per_server and per_server % layout.tp == 0
    table = [("world size", f"{layout.world_size:,}"), ("TP group", f"{layout.tp} consecutive GPUs"
              + (" inside one server (NVLink)" if tp_in_server else " spanning servers (network)")),
             ("CP group", f"{layout.cp} x stride {layout.tp}"), ("PP stages", f"{layout.pp} x stride "
              f"{layout.tp * layout.cp}"), ("DP replicas", f"{layout.dp} x stride {layout.tp * layout.cp * layout.pp}"),
             ("racks", f"{-(-layout.world_size // per_rack):,} of {per_rack} GPUs")]
    return Plot("layout_mesh", ax.get_title(), "Ranks are ordered [TP, CP, PP, DP] from inner to outer, as in Llama 3.",
                _save(fig, out, "layout_mesh"), table)


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
    table = [("pipeline ranks", str(len(tl))), ("makespan (units)", str(end)),
             ("idle fraction (bubble)", f"{bubble:.1%}"), ("bubble / useful time", f"{bubble / (1 - bubble):.3f}")]
    return Plot(key, title, "Blue: forward of a micro-batch (number = micro-batch), orange: its backward; "
                "white gaps are the bubble.", _save(fig, out, key), table)


def lines(key: str, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list[float], list[float]]],
          out: Path, caption: str = "", logy: bool = False, marks: dict[str, float] | None = None) -> Plot:
    """A generic line chart (loss curves, sweeps, traces), with optional vertical marks."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (label, (xs, ys)) in enumerate(series.items()):
        ax.plot(xs, ys, label=label, color=COLORS[i % len(COLORS)], lw=1.4)
    for i, (label, x) in enumerate((marks or {}).items()):
        ax.axvline(x, ls="--", color=COLORS[(i + 3) % len(COLORS)], label=label)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) + len(marks or {}) > 1:
        ax.legend(fontsize=8)
    table = []
    for label, (xs, ys) in series.items():
        if ys:
            table.append((label, f"first {ys[0]:.4g}, last {ys[-1]:.4g}, min {min(ys):.4g}, max {max(ys):.4g} "
                          f"over {xlabel} {xs[0]:.4g}..{xs[-1]:.4g}"))
    table += [(label, f"{x:.4g}") for label, x in (marks or {}).items()]
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
    table = [(f"{c}: {s}", f"{v:.4g}") for c, g in groups.items() for s, v in g.items()]
    return Plot(key, title, caption, _save(fig, out, key), table)
