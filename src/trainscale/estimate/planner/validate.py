"""`trainscale validate`: the step-time model predicts published training runs, with in-sample and leave-one-out errors.

Each run in catalog/runs.toml is evaluated as the run itself was laid out (its own layout string and its
framework's software preset) with the catalog's per-GPU-generation constants, and its prediction is set
against the figure the source reported. A constant of catalog/planner.toml whose source string begins with
"FITTED" was fitted on this public set (``fitted_constants``); ``fit`` refits it from rows (jointly with the other
FITTED constants of its GPU generation, by ``FIT_RULE``, as its source says), and ``validate(loo=True)``
reports each row twice: predicted with the fit over every row (in-sample) and with the fit over every other row
(leave-one-out). With no fitted constant both equal the catalog's prediction. Every other constant comes from
datasheets and published microbenchmarks (catalog/planner.toml, catalog/gpus.toml), the knobs from the frameworks'
code and papers (catalog/software.toml).
A published TFLOP/s or MFU is read with the FLOP count of the source that published it (``CONVENTIONS``, named on
each row as ``flop_convention``), never with trainscale's own, and the source's MFU is recomputed as a check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from importlib import resources
from itertools import product
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainscale.errors import TrainscaleError
from trainscale.estimate import flops
from trainscale.estimate.params import embedding_params, param_count
from trainscale.estimate.planner import plan
from trainscale.estimate.planner.efficiencies import KNOB_RANGES, planner_catalog
from trainscale.safeio import parse_toml, read_text
from trainscale.specs import Layout, ModelSpec

FIGURES = {
    "tokens_per_s_per_gpu": "tokens/s per GPU",
    "step_time_s": "seconds per step",
    "tflops_per_gpu": "TFLOP/s per GPU (in the row's flop_convention)",
    "gpu_hours": "GPU-hours for the row's training tokens",
}
FIGURE_LABELS = {"tokens_per_s_per_gpu": "tok/s/GPU", "step_time_s": "s/step", "tflops_per_gpu": "TFLOP/s",
                 "gpu_hours": "GPU-hours"}  # the same, in a table's column

# short labels for the 80-column table
CONVENTION_LABELS = {"trainscale": "ours", "torchtitan-2024-04": "titan-24", "torchtitan": "titan",
                     "llm-foundry": "foundry", "narayanan-eq3": "eq3"}

# The FLOP count per trained token each source's own code or paper divides by: a published TFLOP/s or MFU is
# converted back to tokens/s with ITS formula, never with trainscale's (issue 12 item 6). name -> (formula, source)
CONVENTIONS = {
    "trainscale": ("6N (N: matmul weights, LM head included, input embedding not) + 6·L·H·Q·T (causal halving)",
                   "trainscale estimate/flops.py model_flops_per_token(causal=True)"),
    "torchtitan-2024-04": ("6N (N: every parameter, embeddings included) + 12·L·H·Q·T (no causal halving)",
                           "pytorch/torchtitan @157a12c5 (2024-04-24, the commit of docs/performance.md's A100 table)"
                           ": train.py get_num_params(model), utils.get_num_flop_per_token"),
    "torchtitan": ("6N (N: every parameter but the input embedding) + 12·L·H·Q·T (no causal halving)",
                   "pytorch/torchtitan from 2024-06: train.py get_num_params(model, exclude_embedding=True), "
                   "utils.get_num_flop_per_token = 6 * num_params + 12 * l * h * q * t"),
    "llm-foundry": ("6N (N: the n_params the run logs, every parameter) + 12·L·d·s (no causal halving)",
                    "mosaicml/llm-foundry scripts/train/benchmarking/collect_results.py: flops_per_token = 2 * "
                    "n_params, attn_flops_per_seq = n_layers * 2 * 2 * d_model * seq_len**2, MFU = 3 * (both)"),
    "narayanan-eq3": ("96·l·h²·(1 + s/6h + V/16lh) per token: 6N + full (unhalved) attention + LM head, and the "
                      "recomputed forward (x4/3)",
                      "Narayanan et al. 2021 (arXiv 2104.04473) Eq. 3; Megatron-LM / Megatron-DeepSpeed report "
                      "TFLOP/s with it"),
}


def narayanan_flops_per_token(n_layers: int, d_model: int, seq: int, vocab: int) -> float:
    """Narayanan et al. 2021 (arXiv 2104.04473) Eq. 3 divided by B·s tokens: 96·l·h²·(1 + s/6h + V/16lh), the
    FLOPs per token Megatron-family codebases report, counting the recomputed forward (full recompute)."""
    h, l_ = d_model, n_layers
    return 96.0 * l_ * h * h * (1 + seq / (6 * h) + vocab / (16 * l_ * h))


def convention_flops_per_token(convention: str, m: ModelSpec, seq: int, n_params: float | None = None) -> float:
    """FLOPs per trained token under a named convention (CONVENTIONS). ``n_params`` replaces the parameter
    count where the source logged its own (llm-foundry's NumParams column)."""
    attn_full = flops.attention_flops_per_token(m, seq, causal=False)  # 12·L·H·Q·T
    if convention == "trainscale":
        return flops.training_flops_per_token(m, seq)
    if convention == "torchtitan-2024-04":
        return 6.0 * (n_params or param_count(m)) + attn_full
    if convention == "torchtitan":
        return 6.0 * (n_params or param_count(m) - embedding_params(m)) + attn_full
    if convention == "llm-foundry":
        return 6.0 * (n_params or param_count(m)) + 12.0 * m.n_layers * m.d_model * seq
    if convention == "narayanan-eq3":
        return narayanan_flops_per_token(m.n_layers, m.d_model, seq, m.vocab_size)
    raise TrainscaleError(f"unknown flop_convention {convention!r}; known: {', '.join(CONVENTIONS)}")


_TEXT = Annotated[str, Field(min_length=1, max_length=4000)]
_POSITIVE = Annotated[float, Field(gt=0, le=1e30)]


class Run(BaseModel):
    """One published run, as a runs file holds it: strict types, finite numbers, each in its range (a NaN, negative
    or string figure is one sentence, never a prediction)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", frozen=True)
    id: _TEXT
    source: _TEXT
    model: _TEXT
    cluster: _TEXT
    gpus: Annotated[int, Field(gt=0, le=100_000_000)]
    layout: Annotated[str, Field(max_length=200)]
    software: _TEXT
    seq: Annotated[int, Field(gt=0, le=1 << 24)]
    global_batch_tokens: Annotated[int, Field(gt=0, le=10**15)]
    figure: Literal["tokens_per_s_per_gpu", "step_time_s", "tflops_per_gpu", "gpu_hours"]
    published: _POSITIVE
    flop_convention: _TEXT  # how the source counts FLOPs (CONVENTIONS), whatever its figure
    flop_convention_source: Annotated[str, Field(max_length=4000)] = ""
    convention_params: _POSITIVE | None = None  # the parameter count the source's formula used, where it printed it
    alt_flop_convention: _TEXT | None = None  # a second reading, where the source does not say which it used
    published_mfu: Annotated[float, Field(gt=0, le=1)] | None = None  # the source's own MFU (0-1)
    note: Annotated[str, Field(max_length=4000)] = ""
    published_memory_gib: _POSITIVE | None = None  # peak memory per GPU the source reports, GiB
    tokens: _POSITIVE | None = None  # training tokens, for a gpu_hours figure
    precision: Literal["bf16", "fp16", "fp8"] | None = None  # where the run differs from its software preset

    @field_validator("published", "convention_params", "published_memory_gib", "tokens", mode="before")
    @classmethod
    def _int_is_a_number(cls, v: Any) -> Any:  # strict floats take ints, never bools
        if isinstance(v, bool):
            raise ValueError("must be a number, not a boolean")
        return float(v) if isinstance(v, int) else v


def _run_error(e: ValidationError, i: int, r: Any, where: str) -> TrainscaleError:
    err = e.errors()[0]
    key = ".".join(str(x) for x in err.get("loc", ())) or "?"
    name = r.get("id") if isinstance(r, dict) and isinstance(r.get("id"), str) else f"run {i + 1}"
    value = r.get(key, "missing") if isinstance(r, dict) else r
    return TrainscaleError(f"{name} in {where}: {key} {err.get('msg', 'is invalid').lower()} "
                           f"(given {str(value)[:60]!r})")


def load_runs(path: str | Path | None = None) -> list[Run]:
    """The published runs: catalog/runs.toml, or a TOML file of [[run]] tables with the same keys."""
    where = str(path) if path else "catalog/runs.toml"
    text = read_text(path, "runs file") if path else \
        resources.files("trainscale.catalog").joinpath("runs.toml").read_text()
    data = parse_toml(text, f"runs file {where}")
    tables = data.get("run", [])
    if not isinstance(tables, list):
        raise TrainscaleError(f"runs file {where}: 'run' must be an array of tables ([[run]])")
    runs = []
    for i, r in enumerate(tables):
        if not isinstance(r, dict):
            raise TrainscaleError(f"run {i + 1} in {where} is not a table")
        try:
            run = Run(**r)
        except ValidationError as e:
            raise _run_error(e, i, r, where) from None
        if run.figure == "gpu_hours" and not (run.tokens and run.tokens > 0):
            raise TrainscaleError(f"run {run.id}: a gpu_hours figure needs the training tokens (tokens = ...)")
        for conv in (run.flop_convention, run.alt_flop_convention):
            if conv is not None and conv not in CONVENTIONS:
                raise TrainscaleError(f"run {run.id}: flop_convention must be one of {', '.join(CONVENTIONS)}, "
                                      f"not {conv!r}")
        runs.append(run)
    if not runs:
        raise TrainscaleError(f"no [[run]] tables in {path or 'catalog/runs.toml'}")
    return runs


def predict(run: Run, overrides: dict[str, float] | None = None) -> dict[str, Any]:
    """One run predicted from its own layout and software: the figure it published, and ours. ``overrides``
    replaces planner constants (``--set``), e.g. sustained_clock_fraction=1 for the unfitted model."""
    p = plan.problem(model=run.model, gpu=None, gpus=run.gpus, seq=run.seq, global_batch_tokens=run.global_batch_tokens,
                     cluster=run.cluster, software=run.software, overrides=overrides, precision=run.precision)
    row = p.evaluate_layout(Layout.parse(run.layout))
    tps_gpu = row["tokens_per_s"] / run.gpus
    m = p.model
    fpt = convention_flops_per_token(run.flop_convention, m, run.seq, run.convention_params)
    gpu_h = (run.tokens or 0.0) / tps_gpu / 3600.0
    value = {"tokens_per_s_per_gpu": tps_gpu, "step_time_s": row["step_time_s"],
             "tflops_per_gpu": tps_gpu * fpt / 1e12, "gpu_hours": gpu_h}[run.figure]
    # what the published figure says in tokens/s per GPU, read with the source's own convention
    published_tps = {"tokens_per_s_per_gpu": run.published,
                     "step_time_s": run.global_batch_tokens / run.published / run.gpus,
                     "tflops_per_gpu": run.published * 1e12 / fpt,
                     "gpu_hours": (run.tokens or 0.0) / (run.published * 3600.0)}[run.figure]
    # the source's own MFU recomputed from its throughput and its formula: a check that the convention is read right
    mfu_check = published_tps * fpt / p.gpu.peak_bf16_flops
    alt = None
    if run.alt_flop_convention and run.figure == "tflops_per_gpu":
        fpt_alt = convention_flops_per_token(run.alt_flop_convention, m, run.seq, run.convention_params)
        alt_tps = run.published * 1e12 / fpt_alt
        alt = {"flop_convention": run.alt_flop_convention, "published_tokens_per_s_per_gpu": alt_tps,
               "predicted": tps_gpu * fpt_alt / 1e12, "error": tps_gpu / alt_tps - 1,
               "predicted_mfu": tps_gpu * fpt_alt / p.gpu.peak_bf16_flops}
    return {
        "id": run.id, "source": run.source, "model": run.model, "gpu": p.gpu.name,
        "generation": p.gpu.generation, "gpus": run.gpus, "cluster": run.cluster, "layout": run.layout,
        "software": run.software, "figure": run.figure, "unit": FIGURES[run.figure],
        "published": run.published, "predicted": value, "flop_convention": run.flop_convention,
        "flop_convention_formula": CONVENTIONS[run.flop_convention][0],
        "flop_convention_source": run.flop_convention_source or CONVENTIONS[run.flop_convention][1],
        "published_tokens_per_s_per_gpu": published_tps, "predicted_tokens_per_s_per_gpu": tps_gpu,
        "published_mfu": run.published_mfu, "mfu_from_convention": mfu_check,
        "predicted_mfu_in_convention": tps_gpu * fpt / p.gpu.peak_bf16_flops, "alt_convention": alt,
        # as a throughput error for every figure: + means predicted faster than published
        "error": run.published / value - 1 if run.figure in ("step_time_s", "gpu_hours") else value / run.published - 1,
        "mfu": row["mfu"], "hfu": row["hfu"], "fits": row["fits"],
        "memory_per_gpu_bytes": row["memory_per_gpu_bytes"]["total"], "note": run.note,
        "published_memory_gib": run.published_memory_gib,
        "memory_error": (row["memory_per_gpu_bytes"]["total"] / 2**30 / run.published_memory_gib - 1
                         if run.published_memory_gib else None),
    }


# ------------------------------------------------------------------ the fitted constants, refit from rows

FIT_NODES = tuple(round(0.6 + 0.1 * i, 1) for i in range(9))  # x the catalog value: where each row is evaluated
# the same span, per constant, where a scope fits several together: denser near the catalog value, where the fit falls
# once the catalog holds it (the fits and errors equal 7 and 9 evenly spaced nodes'; benchmarks/RESULTS.md)
FIT_NODES_JOINT = (0.6, 0.9, 1.0, 1.1, 1.4)
FIT_FINE = 161  # candidate values between the first and last node (errors interpolated linearly between nodes)
FIT_FINE_JOINT = 81  # per constant, where a scope fits several together (81 x 81 candidates for two)
FIT_ZOOM = (21, 2)  # then, twice, 21 values per constant between the best candidate's neighbours (100x finer)
# The one rule of every fit (in-sample and each leave-one-out fold; ``best_candidate``). The mean, not the worst: the
# issue's targets are mean |error|, and a minimax rule lets the two most extreme rows set the constant for all others.
FIT_RULE = "the smallest mean |error|, ties (to 1e-6) to the smaller worst"  # error: predicted / published - 1


@dataclass(frozen=True)
class Fitted:
    """A planner constant catalog/planner.toml says was fitted on the public set (its source begins 'FITTED')."""

    key: str
    scope: str  # the GPU generation whose table holds it; "" = [defaults], every run
    catalog_value: float


def fitted_constants(overrides: dict[str, float] | None = None) -> list[Fitted]:
    """The constants of catalog/planner.toml marked FITTED ([defaults] and [generation.*]); one set on the command
    line (``overrides``) is fixed there, not fitted."""
    cat = planner_catalog()
    tables = {"": cat["defaults"], **cat.get("generation", {})}
    return [Fitted(k, scope, float(t[k])) for scope, t in tables.items() for k in KNOB_RANGES
            if k in t and str(t.get(f"{k}_source", "")).startswith("FITTED") and k not in (overrides or {})]


def _nodes(f: Fitted, joint: bool = False) -> np.ndarray:
    """The values a row is evaluated at: the catalog value x FIT_NODES (FIT_NODES_JOINT), kept inside the knob's
    range."""
    r = KNOB_RANGES[f.key]
    v = np.array([f.catalog_value * x for x in (FIT_NODES_JOINT if joint else FIT_NODES)])
    v = v[(v > r.lo) | ((v == r.lo) & r.lo_in)]
    return np.unique(np.append(v[v <= r.hi], r.hi) if (v > r.hi).any() else v)


def _in_scope(f: Fitted, generation: str) -> bool:
    return f.scope in ("", generation)


def _tps(run: Run, overrides: dict[str, float] | None) -> float:
    return predict(run, overrides)["predicted_tokens_per_s_per_gpu"]


@dataclass(frozen=True)
class FitGroup:
    """The FITTED constants of one scope (a GPU generation, or [defaults]), fitted together on the rows of that scope:
    their nodes, and per row (by index) its predicted tokens/s per GPU on the grid of those nodes, the other
    constants at their catalog values. An axis of length 1 is a constant the row does not depend on (broadcast)."""

    constants: tuple[Fitted, ...]
    nodes: tuple[np.ndarray, ...]
    rows: dict[int, np.ndarray]

    def candidates(self) -> tuple[np.ndarray, ...]:
        """The values tried per constant: evenly spaced across its nodes."""
        n = FIT_FINE if len(self.constants) == 1 else FIT_FINE_JOINT
        return tuple(np.linspace(x[0], x[-1], n) for x in self.nodes)

    def interpolate(self, values: tuple[np.ndarray, ...]) -> np.ndarray:
        """Each row's prediction at every combination of ``values`` (one array per constant, within its nodes; rows x
        combinations, flattened in C order), interpolated linearly between the nodes along each constant in turn
        (multilinear on the grid)."""
        grids = np.stack([np.broadcast_to(g, tuple(len(x) for x in self.nodes)) for g in self.rows.values()])
        for j, (x, c) in enumerate(zip(self.nodes, values, strict=True)):
            w = np.stack([np.interp(c, x, e) for e in np.eye(len(x))], axis=1)  # values x nodes
            grids = np.moveaxis(np.tensordot(grids, w, axes=([1 + j], [1])), -1, 1 + j)
        return grids.reshape(len(self.rows), -1)

    @cached_property
    def on_candidates(self) -> np.ndarray:
        """``interpolate`` at the candidates, computed once for every fold."""
        return self.interpolate(self.candidates())


def _row_grid(run: Run, consts: tuple[Fitted, ...], nodes: tuple[np.ndarray, ...],
              overrides: dict[str, float] | None) -> np.ndarray:
    """One row's predictions on the grid of ``nodes``, each point predicted once. A constant at whose end nodes
    the row predicts what it does at the catalog values does not move it (another kernel's factor, say): its axis
    is the catalog value alone."""
    memo: dict[tuple[float, ...], float] = {}

    def at(point: tuple[float, ...]) -> float:
        if point not in memo:
            memo[point] = _tps(run, {**(overrides or {}), **{f.key: v for f, v in zip(consts, point, strict=True)}})
        return memo[point]

    centre = tuple(f.catalog_value for f in consts)
    axes = []
    for j, x in enumerate(nodes):
        ends = [at(centre[:j] + (float(v),) + centre[j + 1:]) for v in (x[0], x[-1])]
        moves = len(consts) == 1 or any(abs(e / at(centre) - 1) > 1e-12 for e in ends)
        axes.append([float(v) for v in x] if moves else [centre[j]])
    return np.array([at(p) for p in product(*axes)]).reshape([len(a) for a in axes])


def fit_table(runs: list[Run], generations: list[str], overrides: dict[str, float] | None = None
              ) -> list[FitGroup]:
    """The fitted constants grouped by scope, each group with every in-scope row's predictions on its grid
    (``_row_grid``): one constant on FIT_NODES, several together on FIT_NODES_JOINT each."""
    scopes: dict[str, list[Fitted]] = {}
    for f in fitted_constants(overrides):
        scopes.setdefault(f.scope, []).append(f)
    out = []
    for fs in scopes.values():
        consts = tuple(fs)
        nodes = tuple(_nodes(f, joint=len(consts) > 1) for f in consts)
        out.append(FitGroup(consts, nodes, {i: _row_grid(r, consts, nodes, overrides) for i, r in enumerate(runs)
                                            if _in_scope(consts[0], generations[i])}))
    return out


def best_candidate(abs_errors: np.ndarray, weights: np.ndarray | None = None) -> int:
    """FIT_RULE: the column of ``abs_errors`` (rows x candidates, |predicted / published - 1|) with the smallest mean,
    ties to the smaller worst. ``weights`` (one per row, summing to 1) replaces the plain mean by a weighted one (an
    experiment's rule, benchmarks/fit_source_weighting.py; validate passes none)."""
    mean = abs_errors.mean(axis=0) if weights is None else weights @ abs_errors
    mean, worst = mean.round(6), abs_errors.max(axis=0)
    return int(np.lexsort((worst, mean))[0])


def fit(runs: list[Run], published_tps: list[float], table: list[FitGroup],
        leave_out: int | None = None,
        weigh: Callable[[list[Run]], np.ndarray] | None = None) -> dict[Fitted, float]:
    """The constants of each scope refit together on the runs of that scope, less ``leave_out``, by FIT_RULE (the
    rule catalog/planner.toml states). Candidates: every combination of FIT_FINE (one constant) or FIT_FINE_JOINT
    (several) values per constant across its nodes, each row's prediction interpolated linearly between them
    (``FitGroup.on_candidates``); then FIT_ZOOM: the search again between the best candidate's neighbours, finer. A
    scope left with no row keeps the catalog values. ``weigh``, given the scope's kept runs, returns their weights
    for ``best_candidate`` (none: every row once, FIT_RULE)."""
    values = {}
    for g in table:
        keep = np.array([i != leave_out for i in g.rows])
        if not keep.any():
            values.update({f: f.catalog_value for f in g.constants})
            continue
        pub = np.array([published_tps[i] for i in g.rows])[keep, None]
        w = weigh([runs[i] for i in g.rows if i != leave_out]) if weigh else None
        cands, pred = g.candidates(), g.on_candidates
        for zoom in range(FIT_ZOOM[1] + 1):
            best = np.unravel_index(best_candidate(np.abs(pred[keep] / pub - 1), w), tuple(len(c) for c in cands))
            if zoom < FIT_ZOOM[1]:
                cands = tuple(np.linspace(c[max(k - 1, 0)], c[min(k + 1, len(c) - 1)], FIT_ZOOM[0])
                              for c, k in zip(cands, best, strict=True))
                pred = g.interpolate(cands)
        values.update({f: float(c[k]) for f, c, k in zip(g.constants, cands, best, strict=True)})
    return values


def _with_fit(values: dict[Fitted, float], generation: str, overrides: dict[str, float] | None) -> dict[str, float]:
    return {**{f.key: v for f, v in values.items() if _in_scope(f, generation)}, **(overrides or {})}


def loo_by_software(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[float]]:
    """The rows' |leave-one-out error| grouped by (software, GPU generation), in row order (``validate(loo=True)``'s
    rows): what `plan`'s intervals and validate's summary line are made of."""
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        by.setdefault((r["software"], r["generation"]), []).append(abs(r["loo_error"]))
    return by


def _summary(errs: list[float], ids: list[str]) -> dict[str, Any]:
    a = [abs(e) for e in errs]
    w = int(np.argmax(a))
    return {"mean_abs_error": sum(a) / len(a), "worst_abs_error": a[w], "worst_run": ids[w]}


def _loo(runs: list[Run], rows: list[dict[str, Any]], overrides: dict[str, float] | None) -> dict[str, Any]:
    """In-sample (fit on every row) and leave-one-out (fit on every other row) errors; both the catalog's where
    nothing is fitted. Each fitted constant reports its fit on every row and the range of its leave-one-out refits."""
    gens = [r["generation"] for r in rows]
    pub = [r["published_tokens_per_s_per_gpu"] for r in rows]
    table = fit_table(runs, gens, overrides)
    if not table:
        for r in rows:
            r["in_sample_error"] = r["loo_error"] = r["error"]
        return {"fit": []}
    every = fit(runs, pub, table)
    folds: dict[Fitted, list[float]] = {f: [] for f in every}
    for i, (run, r) in enumerate(zip(runs, rows, strict=True)):
        r["in_sample_error"] = _tps(run, _with_fit(every, gens[i], overrides)) / pub[i] - 1
        own = fit(runs, pub, table, leave_out=i)
        r["loo_fit"] = {f"{f.key}[{f.scope or 'defaults'}]": v for f, v in own.items() if _in_scope(f, gens[i])}
        r["loo_error"] = _tps(run, _with_fit(own, gens[i], overrides)) / pub[i] - 1
        for f, v in own.items():
            if _in_scope(f, gens[i]):
                folds[f].append(v)
    depends = {f: sum(g.rows[i].shape[j] > 1 for i in g.rows) for g in table for j, f in enumerate(g.constants)}
    return {"fit": [{"key": f.key, "scope": f.scope or "defaults", "catalog": f.catalog_value, "fit_all_rows": v,
                     "rows": len(next(g for g in table if f in g.constants).rows), "rows_moved": depends[f],
                     "loo_min": min(folds[f], default=v), "loo_max": max(folds[f], default=v)}
                    for f, v in every.items()]}


def validate(path: str | Path | None = None, overrides: dict[str, float] | None = None,
             loo: bool = False) -> dict[str, Any]:
    """Every run predicted, with the mean and worst |error| (error = predicted / published throughput - 1);
    ``loo`` adds each row's in-sample and leave-one-out errors (``fit``) and their means."""
    runs = load_runs(path)
    rows = [predict(r, overrides) for r in runs]
    ids = [r["id"] for r in rows]
    errs = [abs(r["error"]) for r in rows]
    worst = max(range(len(rows)), key=lambda i: errs[i])
    mem = [abs(r["memory_error"]) for r in rows if r["memory_error"] is not None]
    fitted = fitted_constants(overrides)
    out = {"runs": rows, "mean_abs_error": sum(errs) / len(errs), "worst_abs_error": errs[worst],
           "worst_run": rows[worst]["id"], "overrides": overrides or {},
           "memory_mean_abs_error": sum(mem) / len(mem) if mem else None,
           "fitted": ("; ".join(f"{f.key} [{f.scope or 'defaults'}] = {f.catalog_value:g} fitted on this public set "
                                "(catalog/planner.toml)" for f in fitted) or "no constant fitted")
           + "; every other constant from datasheets and published microbenchmarks (catalog/planner.toml); "
             "software knobs from the frameworks (catalog/software.toml)",
           "fit_rule": FIT_RULE,
           "flop_convention": plan.FLOP_CONVENTION,  # of the "mfu"/"hfu" fields; each row's figure: its own
           "conventions": {k: {"formula": f, "source": src} for k, (f, src) in CONVENTIONS.items()}}
    if loo:
        out.update(_loo(runs, rows, overrides))
        out["in_sample"] = _summary([r["in_sample_error"] for r in rows], ids)
        out["loo"] = _summary([r["loo_error"] for r in rows], ids)
    return out


@cache
def catalog_validation() -> dict[str, Any]:
    """``validate(loo=True)`` on the catalog's runs and constants, computed once per process."""
    return validate(loo=True)
