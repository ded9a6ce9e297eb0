"""Reliability: how often a big job is interrupted, how often to checkpoint, what fraction of time is useful.

Symbols follow Daly 2006 ("A higher order estimate of the optimum checkpoint interval for restart
dumps", Future Generation Computer Systems 22(3)): τ compute time between checkpoints, δ time to write
one checkpoint, R time to restart (detect, relaunch, load the last checkpoint), M mean time between
failures of the whole job. All times are seconds.

The model (the same in the formulas and in the simulation): failures are a Poisson process (exponential
gaps, mean M). Work proceeds in segments of τ compute + δ checkpoint; a failure anywhere in a segment
loses that segment's compute; after a failure the job spends R restarting, and a failure during the
restart starts it over. Planned interruptions (maintenance, configuration changes) are a second Poisson
process that loses no work: the job saves its state (δ) and restarts (R).

Effective-time ratio = useful (kept) compute time / wall-clock time, the quantity Meta reports as
"effective training time" (Llama 3, arXiv 2407.21783, Sec. 3.3.4: > 90%).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from math import inf, isfinite, sqrt
from typing import Any

import numpy as np

from trainscale.errors import FieldError, TrainscaleError
from trainscale.estimate.memory import training_state_bytes

HOUR = 3600.0
DAY = 86400.0

# States of a simulated timeline (``Timeline.state`` holds the index). "lost" is compute whose result
# was thrown away by a failure: the GPUs ran at full power, the work did not count.
STATES = ("compute", "checkpoint", "restart", "lost")
COMPUTE, CHECKPOINT, RESTART, LOST = range(4)


# --------------------------------------------------------------------------- catalog


@cache
def reliability_catalog() -> dict[str, Any]:
    """Interruption causes, storage and defaults, with sources, from ``catalog/reliability.toml``."""
    return tomllib.loads(resources.files("trainscale.catalog").joinpath("reliability.toml").read_text())


def meta_snapshot() -> dict[str, Any]:
    """Meta's 54-day Llama 3 interruption snapshot (facts.toml + reliability.toml), hours and counts."""
    from trainscale.specs import facts

    f = facts()["llama3_405b_training"]
    return {
        "gpus": f["gpus"],
        "hours": f["interruption_days"] * 24.0,
        "interruptions": f["interruptions"],
        "planned": f["planned_interruptions"],
        "unexpected": f["unexpected_interruptions"],
        "source": f["interruptions_source"],
    }


# --------------------------------------------------------------------------- failure rates


def per_gpu_hour_rate(interruptions: float, gpus: int, hours: float) -> float:
    """λ per GPU-hour = interruptions / (GPUs · hours): 419 / (16,384 · 54 · 24 h) (Llama 3 Sec. 3.3.4)."""
    return interruptions / (gpus * hours)


def job_mtbf_s(rate_per_gpu_hour: float, gpus: int) -> float:
    """Job MTBF = 1 / (λ_gpu · N): any one of N GPUs failing stops a synchronous job (Llama 3 Sec. 3.3.4)."""
    return inf if rate_per_gpu_hour == 0 else HOUR / (rate_per_gpu_hour * gpus)


def planned_mtbi_s(planned: float, hours: float) -> float:
    """Mean time between planned interruptions of one job: hours / count (47 in 54 days, Llama 3 Sec. 3.3.4)."""
    return inf if planned == 0 else hours * HOUR / planned


def expected_interruptions(seconds: float, mtbf_s: float) -> float:
    """Poisson process: E[failures] = T / M."""
    return 0.0 if not isfinite(mtbf_s) else seconds / mtbf_s


def expected_causes(unexpected: float) -> list[dict[str, Any]]:
    """Split ``unexpected`` failures by Llama 3's Table 5 root causes, in proportion to the published counts."""
    rows = reliability_catalog()["llama3_causes"]
    total = sum(r["count"] for r in rows)
    return [{"cause": r["cause"], "category": r["category"], "meta_count": r["count"],
             "share": r["count"] / total, "published_percent": r["published_percent"],
             "expected": unexpected * r["count"] / total} for r in rows]


# --------------------------------------------------------------------------- checkpoint interval


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """τ = √(2δM) (Young 1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9))."""
    return sqrt(2 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """τ_opt = √(2δM)·[1 + ⅓√(δ/2M) + ⅑(δ/2M)] − δ for δ < 2M, else M (Daly 2006, FGCS 22(3))."""
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    x = delta_s / (2 * mtbf_s)
    return sqrt(2 * delta_s * mtbf_s) * (1 + sqrt(x) / 3 + x / 9) - delta_s


def daly_wall_time(work_s: float, tau_s: Any, delta_s: float, mtbf_s: float, restart_s: float) -> Any:
    """T_w = M·e^{R/M}·(e^{(τ+δ)/M} − 1)·T_s/τ, failures during checkpoints and restarts included (Daly 2006)."""
    tau = np.asarray(tau_s, dtype=float)
    if not isfinite(mtbf_s):
        return work_s * (tau + delta_s) / tau
    return mtbf_s * np.exp(restart_s / mtbf_s) * np.expm1((tau + delta_s) / mtbf_s) * work_s / tau


def daly_efficiency(tau_s: Any, delta_s: float, mtbf_s: float, restart_s: float) -> Any:
    """Effective-time ratio T_s / T_w of Daly's expected wall time (Daly 2006), vectorised over τ."""
    return 1.0 / daly_wall_time(1.0, tau_s, delta_s, mtbf_s, restart_s)


def planned_efficiency(delta_s: float, restart_s: float, planned_mtbi: float) -> float:
    """Fraction left after planned stops, each a save (δ) and a restart (R): 1 − (δ + R)/M_planned (first order)."""
    return 1.0 if not isfinite(planned_mtbi) else max(0.0, 1.0 - (delta_s + restart_s) / planned_mtbi)


# --------------------------------------------------------------------------- checkpoint size


def checkpoint_bytes(n_params: float) -> float:
    """Checkpoint = bf16 weights + fp32 master, Adam m and v = (2 + 12)·Ψ bytes; no gradients (ZeRO Sec. 3.1)."""
    s = training_state_bytes(n_params)
    return s.weights + s.optimizer


def checkpoint_write_s(size_bytes: float, bandwidth: float) -> float:
    """Write time = size / storage bandwidth (Tectonic: 2 TB/s sustained, Llama 3 Sec. 3.3.1)."""
    return size_bytes / bandwidth


# --------------------------------------------------------------------------- Monte Carlo


@dataclass
class Timeline:
    """One simulated run as consecutive intervals [start, end) in seconds, each in one of ``STATES``."""

    start: np.ndarray
    end: np.ndarray
    state: np.ndarray
    interruption_times: np.ndarray
    interruption_planned: np.ndarray
    states: tuple[str, ...] = STATES

    @property
    def duration(self) -> np.ndarray:
        return self.end - self.start

    def totals(self) -> dict[str, float]:
        """Seconds spent in each state."""
        return {name: float(self.duration[self.state == i].sum()) for i, name in enumerate(self.states)}

    def state_at(self, t: Any) -> np.ndarray:
        """State index at times ``t`` (seconds); -1 outside the run. For sampling a power trace."""
        t = np.asarray(t, dtype=float)
        i = np.searchsorted(self.start, t, side="right") - 1
        ok = (i >= 0) & (t < self.end[np.clip(i, 0, None)])
        return np.where(ok, self.state[np.clip(i, 0, None)], -1)


@dataclass
class SimResult:
    """Monte Carlo of a whole run: the effective-time ratio per trial, its percentiles, mean counts and times."""

    interval_s: float
    ratio: np.ndarray
    failures: np.ndarray
    planned: np.ndarray
    checkpoints: np.ndarray
    seconds: dict[str, np.ndarray]
    horizon_s: float
    timeline: Timeline | None = field(default=None, repr=False)

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.ratio, q))

    @property
    def p5(self) -> float:
        return self.percentile(5)

    @property
    def p50(self) -> float:
        return self.percentile(50)

    @property
    def p95(self) -> float:
        return self.percentile(95)

    def summary(self) -> dict[str, Any]:
        return {
            "interval_s": self.interval_s,
            "trials": int(self.ratio.size),
            "effective_p5": self.p5, "effective_p50": self.p50, "effective_p95": self.p95,
            "effective_mean": float(self.ratio.mean()),
            "failures_mean": float(self.failures.mean()),
            "planned_mean": float(self.planned.mean()),
            "checkpoints_mean": float(self.checkpoints.mean()),
            "seconds_mean": {k: float(v.mean()) for k, v in self.seconds.items()},
        }


_MAX_CELLS = 2_000_000  # trials x interruptions drawn at once, per chunk (16 MB per float array)


def _draw_gaps(rng: np.random.Generator, n: int, horizon: float, mean_gap: float) -> np.ndarray:
    """Exponential gaps, enough columns that every row's sum passes the horizon."""
    if not isfinite(mean_gap):
        return np.full((n, 1), 2 * horizon)  # no interruptions: one cycle, cut by the horizon
    lam_t = horizon / mean_gap
    gaps = rng.exponential(mean_gap, size=(n, int(lam_t + 8 * sqrt(lam_t) + 16)))
    while gaps.sum(axis=1).min() < horizon:
        gaps = np.hstack([gaps, rng.exponential(mean_gap, size=(n, gaps.shape[1] // 2 + 16))])
    return gaps


def simulate(horizon_s: float, interval_s: float, ckpt_s: float, restart_s: float, mtbf_s: float,
             planned_mtbi: float = inf, trials: int = 1000, seed: int = 0, timeline: bool = False) -> SimResult:
    """Monte Carlo of ``trials`` runs of ``horizon_s`` wall-clock seconds, all trials at once (numpy).

    Between two interruptions the run is deterministic, so each interruption-to-interruption cycle is
    computed in closed form: R restarting (a cycle shorter than R is a failed restart), then ⌊a/(τ+δ)⌋
    whole segments (kept), then a partial segment that an unexpected failure throws away, a planned
    stop saves (one extra δ), and the horizon leaves running (counted as useful). The job's launch
    is not charged a restart. Same ``seed`` → same failures for every τ (common random numbers).
    """
    for name, v in (("horizon", horizon_s), ("interval", interval_s), ("MTBF", mtbf_s),
                    ("planned interval", planned_mtbi)):
        if not v > 0:
            raise TrainscaleError(f"{name} must be positive, not {v}")
    for name, v in (("checkpoint time", ckpt_s), ("restart time", restart_s)):
        if not (v >= 0 and isfinite(v)):
            raise TrainscaleError(f"{name} must be >= 0, not {v}")
    if trials < 1:
        raise TrainscaleError(f"trials must be >= 1, not {trials}")
    rng = np.random.default_rng(seed)
    rate = (0 if not isfinite(mtbf_s) else 1 / mtbf_s) + (0 if not isfinite(planned_mtbi) else 1 / planned_mtbi)
    mean_gap = inf if rate == 0 else 1 / rate
    p_planned = 0.0 if rate == 0 or not isfinite(planned_mtbi) else (1 / planned_mtbi) / rate
    tau, delta, r_s, seg = float(interval_s), float(ckpt_s), float(restart_s), float(interval_s + ckpt_s)
    cols = 1 if rate == 0 else int(horizon_s * rate + 8 * sqrt(horizon_s * rate) + 16)
    chunk = max(1, _MAX_CELLS // cols)
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("useful", "ckpt", "restart", "lost", "fail", "plan", "nck")}
    tl = None
    for lo in range(0, trials, chunk):
        n = min(chunk, trials - lo)
        g = _draw_gaps(rng, n, horizon_s, mean_gap)
        planned = rng.random(g.shape) < p_planned
        restart = np.full(g.shape, r_s)
        restart[:, 0] = 0.0
        extra = np.where(planned & (g > restart), delta, 0.0)
        length = g + extra
        start = np.cumsum(length, axis=1) - length
        active = start < horizon_s
        room = horizon_s - start
        trunc = active & (start + length > horizon_s)
        keep_planned = trunc & planned & (room > g)  # cut inside the final save: keep the save's first part
        cut = trunc & ~keep_planned
        extra = np.where(keep_planned, room - g, np.where(cut, 0.0, extra))
        g = np.where(cut, room, g)
        unexpected = active & ~planned & ~cut
        g, extra = np.where(active, g, 0.0), np.where(active, extra, 0.0)
        t_restart = np.minimum(g, restart)
        avail = np.maximum(g - restart, 0.0)
        k = np.floor(avail / seg)
        rem = avail - k * seg
        part_c, part_k = np.minimum(rem, tau), np.maximum(rem - tau, 0.0)
        out["useful"].append((k * tau + np.where(unexpected, 0.0, part_c)).sum(axis=1))
        out["lost"].append(np.where(unexpected, part_c, 0.0).sum(axis=1))
        out["ckpt"].append((k * delta + part_k + extra).sum(axis=1))
        out["restart"].append(t_restart.sum(axis=1))
        out["fail"].append(unexpected.sum(axis=1))
        out["plan"].append((active & planned & ~cut).sum(axis=1))
        out["nck"].append(k.sum(axis=1) + (extra > 0).sum(axis=1))
        if timeline and lo == 0:
            tl = _timeline(start[0], g[0], extra[0], t_restart[0], k[0], part_c[0], part_k[0],
                           unexpected[0], planned[0] & active[0] & ~cut[0], active[0], tau, delta)
    cat = {k: np.concatenate(v) for k, v in out.items()}
    return SimResult(
        interval_s=tau, ratio=cat["useful"] / horizon_s, failures=cat["fail"], planned=cat["plan"],
        checkpoints=cat["nck"], horizon_s=horizon_s, timeline=tl,
        seconds={"compute": cat["useful"], "checkpoint": cat["ckpt"], "restart": cat["restart"], "lost": cat["lost"]},
    )


def _timeline(start: np.ndarray, g: np.ndarray, extra: np.ndarray, t_restart: np.ndarray, k: np.ndarray,
              part_c: np.ndarray, part_k: np.ndarray, unexpected: np.ndarray, planned: np.ndarray,
              active: np.ndarray, tau: float, delta: float) -> Timeline:
    """Expand one trial's cycles into intervals: restart, k × (compute τ, checkpoint δ), the partial segment, save."""
    starts, ends, states = [], [], []

    def add(s: np.ndarray, d: np.ndarray, state: int) -> None:
        keep = d > 0
        starts.append(s[keep])
        ends.append(s[keep] + d[keep])
        states.append(np.full(int(keep.sum()), state, dtype=np.int8))

    for c in np.flatnonzero(active):
        t = start[c]
        add(np.array([t]), np.array([t_restart[c]]), RESTART)
        t += t_restart[c]
        n = int(k[c])
        if n:
            seg0 = t + np.arange(n) * (tau + delta)
            add(seg0, np.full(n, tau), COMPUTE)
            add(seg0 + tau, np.full(n, delta), CHECKPOINT)
            t += n * (tau + delta)
        add(np.array([t]), np.array([part_c[c]]), LOST if unexpected[c] else COMPUTE)
        t += part_c[c]
        add(np.array([t]), np.array([part_k[c] + extra[c]]), CHECKPOINT)
    s, e, st = np.concatenate(starts), np.concatenate(ends), np.concatenate(states)
    order = np.argsort(s, kind="stable")
    ends_of_cycles = start[active] + g[active] + extra[active]
    return Timeline(start=s[order], end=e[order], state=st[order],
                    interruption_times=ends_of_cycles[unexpected[active] | planned[active]],
                    interruption_planned=planned[active][unexpected[active] | planned[active]])


def sweep(intervals_s: Any, horizon_s: float, ckpt_s: float, restart_s: float, mtbf_s: float,
          planned_mtbi: float = inf, trials: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """Simulated and analytic effective-time ratio for each interval, the same failures for every interval."""
    rows = []
    for tau in sorted({float(t) for t in np.atleast_1d(intervals_s)}):
        r = simulate(horizon_s, tau, ckpt_s, restart_s, mtbf_s, planned_mtbi, trials=trials, seed=seed)
        analytic = float(daly_efficiency(tau, ckpt_s, mtbf_s, restart_s)) * planned_efficiency(
            ckpt_s, restart_s, planned_mtbi)
        rows.append({"interval_s": tau, "effective_p5": r.p5, "effective_p50": r.p50, "effective_p95": r.p95,
                     "effective_mean": float(r.ratio.mean()), "analytic": analytic,
                     "lost_s_mean": float(r.seconds["lost"].mean()),
                     "checkpoint_s_mean": float(r.seconds["checkpoint"].mean())})
    return rows


DEFAULT_SWEEP_MIN = (1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240)


# --------------------------------------------------------------------------- the whole report


def reliability_report(model: str = "llama3.1-405b", gpus: int | None = None, days: float | None = None,
                       interval_s: float | None = None, mtbf_s: float | None = None,
                       rate_per_gpu_hour: float | None = None, planned_per_day: float | None = None,
                       ckpt_write_s: float | None = None, storage_bw: float | None = None,
                       restart_s: float | None = None, trials: int = 1000, seed: int = 0,
                       sweep_intervals_s: Any = None, timeline: bool = False) -> dict[str, Any]:
    """Everything ``trainscale reliability`` prints: rates, causes, checkpoint, intervals, simulation, sweep.

    Defaults: Meta's Llama 3 snapshot (interruption rates per GPU-hour, 16,384 GPUs, 54 days), Tectonic's
    sustained bandwidth for the checkpoint write, a 10-minute restart (an assumption), Daly's interval.
    """
    from trainscale.estimate.params import param_count
    from trainscale.specs import load_model

    cat = reliability_catalog()
    meta = meta_snapshot()
    gpus = meta["gpus"] if gpus is None else gpus
    days = meta["hours"] / 24 if days is None else days
    _check_report_inputs(gpus=gpus, days=days, trials=trials, interval_s=interval_s, mtbf_s=mtbf_s,
                         rate_per_gpu_hour=rate_per_gpu_hour, planned_per_day=planned_per_day,
                         ckpt_write_s=ckpt_write_s, storage_bw=storage_bw, restart_s=restart_s)
    horizon = days * DAY
    failures = _failure_rates(meta, gpus, mtbf_s, rate_per_gpu_hour, planned_per_day)
    mtbf, p_mtbi = failures["job_mtbf_s"], failures["planned_mtbi_s"]
    m = load_model(model)
    n = param_count(m)
    checkpoint = _checkpoint(cat, n, ckpt_write_s, storage_bw, restart_s)
    delta, r_s = checkpoint["write_s"], checkpoint["restart_s"]

    young, daly = young_interval(delta, mtbf), daly_interval(delta, mtbf)
    if not isfinite(daly):
        daly = young = horizon
    tau = daly if interval_s is None else interval_s
    sim = simulate(horizon, tau, delta, r_s, mtbf, p_mtbi, trials=trials, seed=seed, timeline=timeline)
    analytic = float(daly_efficiency(tau, delta, mtbf, r_s)) * planned_efficiency(delta, r_s, p_mtbi)
    out: dict[str, Any] = {
        "inputs": {"model": m.name, "params": n, "gpus": gpus, "days": days, "horizon_s": horizon,
                   "interval_s": tau, "interval_from": "Daly" if interval_s is None else "given",
                   "trials": trials, "seed": seed},
        "failures": {**failures, **_expected_interruptions(cat, meta, horizon, mtbf, p_mtbi)},
        "checkpoint": checkpoint,
        "intervals": {"young_s": young, "daly_s": daly,
                      "young_source": "Young 1974, CACM 17(9): sqrt(2 delta M)",
                      "daly_source": "Daly 2006, FGCS 22(3): higher-order optimum"},
        "simulation": {**sim.summary(), "analytic": analytic,
                       "meta_effective_min": cat["llama3_interruptions"]["effective_training_time_min"],
                       "meta_effective_source": cat["llama3_interruptions"]["effective_source"]},
    }
    if sweep_intervals_s is not None:
        pts = [float(x) for x in np.atleast_1d(sweep_intervals_s)] + [young, daly, tau]
        out["sweep"] = sweep([p for p in pts if p > 0], horizon, delta, r_s, mtbf, p_mtbi, trials=trials, seed=seed)
    if timeline:
        out["_timeline"] = sim.timeline
    return out


def _check_report_inputs(gpus: int, days: float, trials: int, interval_s: float | None, mtbf_s: float | None,
                         rate_per_gpu_hour: float | None, planned_per_day: float | None, ckpt_write_s: float | None,
                         storage_bw: float | None, restart_s: float | None) -> None:
    """One sentence for the first input ``reliability_report`` cannot take."""
    _positive(gpus=gpus, days=days, trials=trials)
    if mtbf_s is not None and rate_per_gpu_hour is not None:
        raise TrainscaleError("give either --mtbf-h or --fail-rate-per-gpu-hour, not both")
    if ckpt_write_s is not None and storage_bw is not None:
        raise TrainscaleError("give either --ckpt-write-s or --storage-bw, not both")
    _positive(interval=interval_s, mtbf=mtbf_s, storage_bandwidth=storage_bw)
    _non_negative(fail_rate=rate_per_gpu_hour, planned_per_day=planned_per_day, checkpoint_write=ckpt_write_s,
                  restart=restart_s)


def _failure_rates(meta: dict[str, Any], gpus: int, mtbf_s: float | None, rate_per_gpu_hour: float | None,
                   planned_per_day: float | None) -> dict[str, Any]:
    """The job's unexpected-failure rate and MTBF (given, or from a rate per GPU-hour, Meta's by default) and its
    mean time between planned interruptions (given per day, or Meta's)."""
    meta_rate = per_gpu_hour_rate(meta["unexpected"], meta["gpus"], meta["hours"])
    if mtbf_s is None:
        rate = meta_rate if rate_per_gpu_hour is None else rate_per_gpu_hour
        mtbf = job_mtbf_s(rate, gpus)
        rate_from = "Meta" if rate_per_gpu_hour is None else "given rate"
    else:
        mtbf, rate, rate_from = mtbf_s, HOUR / (mtbf_s * gpus), "given MTBF"
    p_mtbi = planned_mtbi_s(meta["planned"], meta["hours"]) if planned_per_day is None else (
        inf if planned_per_day == 0 else DAY / planned_per_day)
    return {"rate_per_gpu_hour": rate, "rate_from": rate_from, "meta_rate_per_gpu_hour": meta_rate,
            "job_mtbf_s": mtbf, "planned_mtbi_s": p_mtbi}


def _expected_interruptions(cat: dict[str, Any], meta: dict[str, Any], horizon: float, mtbf: float,
                            p_mtbi: float) -> dict[str, Any]:
    """Interruptions expected over the horizon, unexpected and planned, and the unexpected ones by cause."""
    unexpected = expected_interruptions(horizon, mtbf)
    planned_n = expected_interruptions(horizon, p_mtbi)
    return {"expected_unexpected": unexpected, "expected_planned": planned_n,
            "expected_total": unexpected + planned_n,
            "mean_time_between_interruptions_s": horizon / (unexpected + planned_n) if unexpected + planned_n
            else inf,
            "source": meta["source"],
            "causes": expected_causes(unexpected),
            "causes_source": cat["llama3_causes_meta"]["source"]}


def _checkpoint(cat: dict[str, Any], n_params: float, ckpt_write_s: float | None, storage_bw: float | None,
                restart_s: float | None) -> dict[str, Any]:
    """The checkpoint's size, its write time (given, or size over the storage bandwidth, Tectonic's by default)
    and the restart time (given, or the catalog's assumption), each with where it comes from."""
    size = checkpoint_bytes(n_params)
    bw = cat["tectonic"]["sustained_bandwidth"] if storage_bw is None else storage_bw
    return {
        "bytes": size, "bytes_per_param": size / n_params, "contents": cat["defaults"]["checkpoint_contents"],
        "contents_source": cat["defaults"]["checkpoint_source"],
        "storage_bandwidth": None if ckpt_write_s is not None else bw,
        "bandwidth_from": "given write time" if ckpt_write_s is not None else (
            "Tectonic sustained" if storage_bw is None else "given bandwidth"),
        "storage_source": cat["tectonic"]["source"],
        "write_s": checkpoint_write_s(size, bw) if ckpt_write_s is None else ckpt_write_s,
        "restart_s": cat["defaults"]["restart_s"] if restart_s is None else restart_s,
        "restart_source": cat["defaults"]["restart_source"] if restart_s is None else "given",
    }


def _positive(**kw: float | None) -> None:
    for k, v in kw.items():
        if v is not None and not v > 0:
            raise FieldError(k, f"must be positive, not {v}")


def _non_negative(**kw: float | None) -> None:
    for k, v in kw.items():
        if v is not None and not (v >= 0 and isfinite(v)):
            raise FieldError(k, f"must be >= 0, not {v}")


__all__ = [
    "STATES", "SimResult", "Timeline", "checkpoint_bytes", "checkpoint_write_s", "daly_efficiency", "daly_interval",
    "daly_wall_time", "expected_causes", "expected_interruptions", "job_mtbf_s", "meta_snapshot", "per_gpu_hour_rate",
    "planned_efficiency", "planned_mtbi_s", "reliability_catalog", "reliability_report", "simulate", "sweep",
    "young_interval",
]
