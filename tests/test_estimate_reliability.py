"""Reliability arithmetic: failure rates, Young/Daly checkpoint intervals, checkpoint size, Monte Carlo of a whole run
(issue 5, the model).

Sources: Meta, The Llama 3 Herd of Models (arXiv 2407.21783) Sec. 3.3.1, 3.3.4 and Table 5; Young 1974;
Daly 2006, FGCS 22(3).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from trainscale.errors import TrainscaleError
from trainscale.estimate import reliability as rel
from trainscale.estimate.params import param_count
from trainscale.specs import load_model

MIN, HOUR, DAY = 60.0, 3600.0, 86400.0


def meta_mtbf() -> float:
    m = rel.meta_snapshot()
    return rel.job_mtbf_s(rel.per_gpu_hour_rate(m["unexpected"], m["gpus"], m["hours"]), m["gpus"])


def meta_planned() -> float:
    m = rel.meta_snapshot()
    return rel.planned_mtbi_s(m["planned"], m["hours"])


# ------------------------------------------------------------------ intervals


@pytest.mark.parametrize("mtbf_h, expected_min, tol", [(24, 117, 0.5), (6, 57, 0.5), (0.25, 9.1, 0.05)])
def test_daly_worked_cases(mtbf_h, expected_min, tol):
    # delta = 5 min (restart 10 min, which does not enter tau_opt): 24 h -> ~117, 6 h -> ~57, 15 min -> ~9.1 min.
    assert rel.daly_interval(5 * MIN, mtbf_h * HOUR) / MIN == pytest.approx(expected_min, abs=tol)


def test_young_and_daly_limits():
    assert rel.young_interval(5 * MIN, 24 * HOUR) == pytest.approx(120 * MIN)  # sqrt(2 * 5 * 1440) = 120
    assert rel.young_interval(5 * MIN, 6 * HOUR) == pytest.approx(60 * MIN)
    # delta >= 2M: Daly says checkpoint every M.
    assert rel.daly_interval(3 * HOUR, 1 * HOUR) == 1 * HOUR
    # Daly's tau is the optimum of Daly's own expected wall time (to first order in delta/M).
    taus = np.linspace(20, 300, 2801) * MIN
    eff = rel.daly_efficiency(taus, 5 * MIN, 24 * HOUR, 10 * MIN)
    assert taus[np.argmax(eff)] / MIN == pytest.approx(rel.daly_interval(5 * MIN, 24 * HOUR) / MIN, rel=0.01)


def test_daly_wall_time_limits():
    # No failures: wall time is work plus one checkpoint per interval.
    assert rel.daly_wall_time(100.0, 10.0, 1.0, float("inf"), 5.0) == pytest.approx(110.0)
    # Rare failures: first order, T_w / T_s ~ 1 + delta/tau + (tau/2 + R)/M.
    m, tau, d, r = 1e7, 100.0, 1.0, 50.0
    assert rel.daly_wall_time(1.0, tau, d, m, r) == pytest.approx(1 + d / tau + (tau / 2 + d + r) / m, rel=1e-5)


# ------------------------------------------------------------------ Meta's rates and causes


def test_meta_rate_reproduces_466_interruptions():
    m = rel.meta_snapshot()
    lam = rel.per_gpu_hour_rate(m["unexpected"], m["gpus"], m["hours"])
    assert lam == pytest.approx(419 / (16384 * 54 * 24))
    horizon = 54 * DAY
    total = rel.expected_interruptions(horizon, rel.job_mtbf_s(lam, 16384)) + rel.expected_interruptions(
        horizon, meta_planned())
    assert total == pytest.approx(466)
    assert horizon / total / HOUR == pytest.approx(2.78, abs=0.01)  # "about one every 3 hours"
    # Twice the GPUs, half the MTBF.
    assert rel.job_mtbf_s(lam, 32768) == pytest.approx(rel.job_mtbf_s(lam, 16384) / 2)


def test_table5_causes_sum_and_shares():
    causes = rel.expected_causes(419)
    assert sum(c["meta_count"] for c in causes) == rel.meta_snapshot()["unexpected"] == 419
    assert sum(c["share"] for c in causes) == pytest.approx(1.0)
    by = {c["cause"]: c for c in causes}
    assert by["GPU HBM3 Memory"]["published_percent"] == 17.2 and by["Faulty GPU"]["meta_count"] == 148
    # Published percentages match count / 419 except Faulty GPU's (148 / 419 = 35.3%, printed 30.1%).
    for c in causes:
        if c["cause"] != "Faulty GPU":
            assert c["share"] * 100 == pytest.approx(c["published_percent"], abs=0.06), c["cause"]
    # Sec. 3.3.4's 58.7% "GPU issues" is the sum of the GPU-category published percentages.
    gpu = sum(c["published_percent"] for c in causes if c["category"] == "GPU")
    assert gpu == pytest.approx(rel.reliability_catalog()["llama3_interruptions"]["gpu_share_of_unexpected"] * 100)


# ------------------------------------------------------------------ checkpoint size


def test_checkpoint_size_405b():
    n = param_count(load_model("llama3.1-405b"))
    size = rel.checkpoint_bytes(n)
    assert size == 14 * n == pytest.approx(5.68e12, rel=1e-3)  # bf16 weights + fp32 master + Adam m, v
    tectonic = rel.reliability_catalog()["tectonic"]
    assert tectonic["sustained_bandwidth"] == 2e12 and tectonic["peak_bandwidth"] == 7e12
    assert tectonic["capacity_bytes"] == 240e15
    assert rel.checkpoint_write_s(size, tectonic["sustained_bandwidth"]) == pytest.approx(2.84, abs=0.01)


# ------------------------------------------------------------------ Monte Carlo


def test_simulation_matches_daly_without_planned_stops():
    # The simulation and Daly's expected wall time are the same model: exponential failures, failures
    # during checkpoints and restarts included.
    m, d, r = 3 * HOUR, 60.0, 10 * MIN
    for tau in (5 * MIN, 30 * MIN, 2 * HOUR):
        s = rel.simulate(200 * DAY, tau, d, r, m, trials=200, seed=1)
        assert s.ratio.mean() == pytest.approx(float(rel.daly_efficiency(tau, d, m, r)), abs=0.004), tau / MIN


def test_llama3_like_run():
    # 16,384 GPUs, 54 days, Meta's unexpected and planned rates; 2.84 s checkpoint (5.68 TB at 2 TB/s), 10 min restart.
    m, p = meta_mtbf(), meta_planned()
    d, r, horizon = 2.84, 10 * MIN, 54 * DAY
    res = {tau: rel.simulate(horizon, tau * MIN, d, r, m, p, trials=200, seed=0) for tau in (5, 60)}
    assert res[5].p5 > 0.90  # Meta: "higher than 90% effective training time"
    assert res[60].p95 < res[5].p5 - 0.05  # an hour between checkpoints is clearly worse
    assert res[5].failures.mean() == pytest.approx(419, rel=0.03)
    assert res[5].planned.mean() == pytest.approx(47, rel=0.1)
    for s in res.values():  # every second of the run is accounted for
        np.testing.assert_allclose(sum(s.seconds.values()), horizon)
        assert s.p5 <= s.p50 <= s.p95


def test_timeline_is_contiguous_and_matches_totals():
    horizon = 10 * DAY
    s = rel.simulate(horizon, 30 * MIN, 120.0, 10 * MIN, 4 * HOUR, 20 * HOUR, trials=5, seed=3, timeline=True)
    tl = s.timeline
    assert tl is not None and tl.start.dtype == np.float64 and tl.state.dtype == np.int8
    assert tl.start[0] == 0 and tl.end[-1] == pytest.approx(horizon)
    np.testing.assert_allclose(tl.start[1:], tl.end[:-1])
    assert (tl.duration > 0).all()
    tot = tl.totals()
    for name in rel.STATES:
        assert tot[name] == pytest.approx(s.seconds[name][0]), name
    assert len(tl.interruption_times) == s.failures[0] + s.planned[0]
    assert tl.interruption_planned.sum() == s.planned[0]
    assert tl.state_at([0.0, horizon + 1])[1] == -1


def test_no_failures_and_bad_values():
    s = rel.simulate(DAY, HOUR, 36.0, 600.0, float("inf"), trials=3)
    assert s.ratio == pytest.approx(1 / 1.01, rel=1e-3) and s.failures.sum() == 0
    with pytest.raises(TrainscaleError):
        rel.simulate(DAY, 0, 1.0, 1.0, HOUR)
    with pytest.raises(TrainscaleError):
        rel.simulate(DAY, HOUR, -1.0, 1.0, HOUR)


def test_sweep_has_optimum_near_daly():
    m, p = meta_mtbf(), meta_planned()
    d = 60.0
    rows = rel.sweep(np.array([2, 5, 10, 20, 40, 80]) * MIN, 54 * DAY, d, 10 * MIN, m, p, trials=50, seed=0)
    best = max(rows, key=lambda r: r["effective_p50"])
    assert best["interval_s"] == 20 * MIN  # Daly for delta = 60 s, M = 3.09 h: ~19 min
    assert rel.daly_interval(d, m) / MIN == pytest.approx(19.0, abs=0.5)


# ------------------------------------------------------------------ CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscale", "reliability", *args], capture_output=True, text=True)


def test_cli_json(tmp_path):
    png = tmp_path / "sweep.png"
    p = run_cli("--trials", "50", "--interval-min", "30", "--plot", str(png), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["inputs"]["gpus"] == 16384 and out["inputs"]["interval_s"] == 1800
    assert out["checkpoint"]["bytes"] == pytest.approx(5.68e12, rel=1e-3)
    assert out["failures"]["expected_total"] == pytest.approx(466)
    assert out["intervals"]["daly_s"] < out["intervals"]["young_s"]
    assert 0.8 < out["simulation"]["effective_p50"] < 0.9
    assert len(out["sweep"]) >= 10
    assert png.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (("--gpus", "0"), "--gpus"),
    (("--interval-min", "-5"), "--interval-min"),
    (("--mtbf-h", "2", "--fail-rate-per-gpu-hour", "1e-5"), "not both"),
    (("--model", "no-such-model"), "unknown model"),
    (("--plot", "x.jpg"), ".png"),
])
def test_cli_bad_value_exits_2(args, needle):
    p = run_cli("--trials", "10", *args)
    assert p.returncode == 2
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
