"""`trainscale validate`: the step-time model predicts published training runs it was never fitted to.

Each run in catalog/runs.toml is evaluated as the run itself was laid out (its own layout string and its
framework's software preset) with the catalog's per-GPU-generation constants, and its prediction is set
against the figure the source reported. One constant per GPU generation (sustained_clock_fraction) was fitted
once over this whole public set; every other constant comes from datasheets and published microbenchmarks
(catalog/planner.toml, catalog/gpus.toml), the knobs from the frameworks' code and papers (catalog/software.toml).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.estimate import plan
from trainscale.specs import Layout

FIGURES = {
    "tokens_per_s_per_gpu": "tokens/s per GPU",
    "step_time_s": "seconds per step",
    "tflops_per_gpu": "model TFLOP/s per GPU",
    "tflops_narayanan": "TFLOP/s per GPU (Narayanan Eq. 3)",
}


def narayanan_flops_per_token(n_layers: int, d_model: int, seq: int, vocab: int) -> float:
    """Narayanan et al. 2021 (arXiv 2104.04473) Eq. 3 divided by B·s tokens: 96·l·h²·(1 + s/6h + V/16lh), the
    FLOPs per token Megatron-family codebases report, counting the recomputed forward (full recompute)."""
    h, l_ = d_model, n_layers
    return 96.0 * l_ * h * h * (1 + seq / (6 * h) + vocab / (16 * l_ * h))


@dataclass
class Run:
    id: str
    source: str
    model: str
    cluster: str
    gpus: int
    layout: str
    software: str
    seq: int
    global_batch_tokens: int
    figure: str
    published: float
    note: str = ""
    published_memory_gib: float | None = None  # peak memory per GPU the source reports, GiB


def load_runs(path: str | Path | None = None) -> list[Run]:
    """The published runs: catalog/runs.toml, or a TOML file of [[run]] tables with the same keys."""
    try:
        text = Path(path).read_text() if path else \
            resources.files("trainscale.catalog").joinpath("runs.toml").read_text()
        data = tomllib.loads(text)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise TrainscaleError(f"runs file {path} cannot be read: {e}") from None
    runs = []
    for i, r in enumerate(data.get("run", [])):
        try:
            run = Run(**r)
        except TypeError as e:
            raise TrainscaleError(f"run {i + 1} in {path or 'catalog/runs.toml'} is malformed: {e}") from None
        if run.figure not in FIGURES:
            raise TrainscaleError(f"run {run.id}: figure must be one of {', '.join(FIGURES)}, not {run.figure!r}")
        runs.append(run)
    if not runs:
        raise TrainscaleError(f"no [[run]] tables in {path or 'catalog/runs.toml'}")
    return runs


def predict(run: Run, overrides: dict[str, float] | None = None) -> dict[str, Any]:
    """One run predicted from its own layout and software: the figure it published, and ours. ``overrides``
    replaces planner constants (``--set``), e.g. sustained_clock_fraction=1 for the unfitted model."""
    p = plan.problem(run.model, None, run.gpus, run.seq, run.global_batch_tokens, cluster=run.cluster,
                     software=run.software, overrides=overrides)
    row = p.evaluate_layout(Layout.parse(run.layout))
    tps_gpu = row["tokens_per_s"] / run.gpus
    m = p.model
    value = {
        "tokens_per_s_per_gpu": tps_gpu,
        "step_time_s": row["step_time_s"],
        "tflops_per_gpu": row["tflops_per_gpu"],
        "tflops_narayanan": tps_gpu * narayanan_flops_per_token(m.n_layers, m.d_model, run.seq, m.vocab_size) / 1e12,
    }[run.figure]
    return {
        "id": run.id, "source": run.source, "model": run.model, "gpu": p.gpu.name,
        "generation": p.gpu.generation, "gpus": run.gpus, "cluster": run.cluster, "layout": run.layout,
        "software": run.software, "figure": run.figure, "unit": FIGURES[run.figure],
        "published": run.published, "predicted": value,
        # as a throughput error for every figure: + means predicted faster than published
        "error": run.published / value - 1 if run.figure == "step_time_s" else value / run.published - 1,
        "mfu": row["mfu"], "hfu": row["hfu"], "fits": row["fits"],
        "memory_per_gpu_bytes": row["memory_per_gpu_bytes"]["total"], "note": run.note,
        "published_memory_gib": run.published_memory_gib,
        "memory_error": (row["memory_per_gpu_bytes"]["total"] / 2**30 / run.published_memory_gib - 1
                         if run.published_memory_gib else None),
    }


def validate(path: str | Path | None = None, overrides: dict[str, float] | None = None) -> dict[str, Any]:
    """Every run predicted, with the mean and worst |error| (error = predicted / published throughput - 1)."""
    rows = [predict(r, overrides) for r in load_runs(path)]
    errs = [abs(r["error"]) for r in rows]
    worst = max(range(len(rows)), key=lambda i: errs[i])
    mem = [abs(r["memory_error"]) for r in rows if r["memory_error"] is not None]
    return {"runs": rows, "mean_abs_error": sum(errs) / len(errs), "worst_abs_error": errs[worst],
            "worst_run": rows[worst]["id"], "overrides": overrides or {},
            "memory_mean_abs_error": sum(mem) / len(mem) if mem else None,
            "fitted": "one constant per GPU generation, sustained_clock_fraction, fitted once over this whole public "
                      "set; every other constant from datasheets and published microbenchmarks (catalog/planner.toml); "
                      "software knobs from the frameworks (catalog/software.toml)",
            "flop_convention": plan.FLOP_CONVENTION}
