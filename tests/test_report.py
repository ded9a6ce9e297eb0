"""The HTML report renders, and a reader's browser (headless Chromium) sees every image and no console errors
(issue 7)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from trainscale.report.build import build_report
from trainscale.report.schedule import bubble_fraction, rank_orders, timeline

ARTIFACTS = Path(os.environ.get("TRAINSCALE_ARTIFACTS", Path(__file__).resolve().parents[1] / "runs" / "ci-artifacts"))


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
def test_schedule_bubble_matches_formula(schedule, v):
    # Bubble / useful time = (p-1)/m for GPipe and 1F1B, (p-1)/(v m) for interleaved 1F1B
    # (Narayanan et al. 2021, arXiv 2104.04473, Sec. 2.2); backward = 2 forward.
    p, m = 4, 8
    tl = timeline(rank_orders(schedule, p, m, v), p * v)
    b = bubble_fraction(tl)
    assert b / (1 - b) == pytest.approx((p - 1) / (v * m))


@pytest.mark.service
def test_seed_report_in_chromium(tmp_path):
    page = build_report(tmp_path / "seed")
    data = json.loads((tmp_path / "seed" / "report.json").read_text())
    keys = {f["key"] for f in data["figures"]}
    assert {"training_state", "time_to_train", "compute_growth", "layout_mesh", "pipeline_schedule",
            "reliability_sweep", "power_trace"} <= keys
    for f in data["figures"]:
        assert f["table"], f"figure {f['key']} shows no numbers as text"
        for name in f["files"]:
            assert (tmp_path / "seed" / name).stat().st_size > 1000
    # The seed's power: 16,384 x 700 W = 11.47 MW; at PUE 1.56 = 17.89 MW.
    assert data["summary"]["GPU power at TDP"].startswith("11.47 MW")
    assert data["summary"]["GPUs at PUE 1.56"] == "17.89 MW"
    # Meta (Llama 3 Sec. 3.3.4): the whole job pausing swings the data center by tens of megawatts.
    swing = float(data["summary"]["power swing on a pause"].split()[0])
    assert 10 < swing < 100
    if shutil.which("chromium") is None and os.environ.get("CI") != "true":
        pytest.skip("chromium not installed (make installs it)")
    from trainscale.report.browser import check_page

    shot = ARTIFACTS / "report-seed.png"
    res = check_page(page, shot)
    assert res["images"] == len(data["figures"]) and not res["broken_images"]
    assert res["console_errors"] == []
    assert shot.stat().st_size > 10_000


@pytest.mark.slow
def test_report_from_plan_json(tmp_path):
    import subprocess
    import sys

    plan = subprocess.run([sys.executable, "-m", "trainscale", "plan", "--model", "llama3.1-70b", "--gpu", "h100-sxm",
                           "--gpus", "1024", "--seq", "8192", "--global-batch-tokens", str(2**22), "--json"],
                          capture_output=True, text=True, check=True)
    (tmp_path / "plan.json").write_text(plan.stdout)
    build_report(tmp_path / "r", plan_file=tmp_path / "plan.json")
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["summary"]["planned layout"] == json.loads(plan.stdout)["layout"]
    assert {"plan_step_time", "plan_memory", "layout_mesh"} <= {f["key"] for f in data["figures"]}
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(Exception, match="not the output of 'trainscale plan --json'"):
        build_report(tmp_path / "r2", plan_file=tmp_path / "bad.json")


@pytest.mark.service
def test_report_of_a_real_tiny_run_in_chromium(tmp_path):
    import subprocess

    from trainscale.runtime.job.launch import torchrun_command

    root = Path(__file__).resolve().parents[1]
    cfg = tmp_path / "tiny.toml"
    cfg.write_text((root / "configs" / "tiny.toml").read_text().replace("steps = 40", "steps = 6")
                   .replace("eval_sequences = 64", "eval_sequences = 8")
                   + "\n[checkpoint]\nevery_steps = 3\n")
    run_dir = tmp_path / "run"
    p = subprocess.run(torchrun_command(cfg, "dp2", run_dir, 2), capture_output=True, text=True, cwd=root)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    page = build_report(tmp_path / "r", run_dir=run_dir)
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert {"run_loss", "run_throughput", "run_mfu"} <= {f["key"] for f in data["figures"]}
    assert data["summary"]["steps"] == "6 steps" and "goodput" in data["summary"]
    assert data["figures"][0]["key"] == "run_loss"  # the run leads; no walkthrough pages unless asked
    assert "training_state" not in {f["key"] for f in data["figures"]}
    assert data["summary"]["restarts"] == "0 restart(s)"
    if shutil.which("chromium") is None and os.environ.get("CI") != "true":
        pytest.skip("chromium not installed (make installs it)")
    from trainscale.report.browser import check_page

    res = check_page(page, ARTIFACTS / "report-tiny-run.png")
    assert res["images"] == len(data["figures"]) and not res["broken_images"] and res["console_errors"] == []


@pytest.mark.slow
def test_layout_that_does_not_fit_says_so_and_ep_is_drawn(tmp_path):
    """DeepSeek-V3 (671B) under pp16 with no sharding of weights or optimizer: the planner's memory per GPU is far
    above an H100's 80 GB, and the picture says so; its EP8 groups are drawn (table and labels)."""
    from trainscale.report.build import layout_fit
    from trainscale.report.plots import layout_mesh
    from trainscale.specs import Layout, load_cluster

    lay = Layout.parse("tp1,cp1,pp16,ep8,dp128")
    memory, invalid = layout_fit("deepseek-v3", "h100-sxm", 2048, "meta-h100", lay, 4096)
    # memory = (needed, capacity): an H100's usable 81,082 MiB less the reserve (catalog/gpus.toml, planner.toml)
    assert invalid is None and memory[0] > 3 * memory[1] and 80e9 < memory[1] < 85e9
    plot = layout_mesh(lay, load_cluster("meta-h100"), tmp_path, memory=memory)
    table = dict(plot.table)
    assert plot.title.startswith("DOES NOT FIT") and table["fits in GPU memory"].startswith("does not fit: ")
    assert table["EP group"].startswith("8 GPUs") and "e = EP rank" in plot.title
    ok = Layout.parse("tp8,pp16,dp128,zero1,rc=full")
    memory, invalid = layout_fit("llama3.1-405b", "h100-sxm", 16384, "meta-h100", ok, 8192)
    plot = layout_mesh(ok, load_cluster("meta-h100"), tmp_path, memory=memory)
    assert dict(plot.table)["fits in GPU memory"].startswith("fits: ") and not plot.title.startswith("DOES")
    assert "EP group" not in dict(plot.table)


def test_restarts_named_by_their_start_events():
    """Each attempt's start event (runfolder.start_event) says what restarted it: a new launch with the same counts
    is a person's --resume, a new torchrun attempt in one launch is torchrun's, a new requeue count is Slurm's."""
    from trainscale.report.build import run_timeline

    def start(launch, requeue=0, attempt=0):
        return {"event": "start", "wall": 0.0, "launch": launch, "requeue": requeue, "attempt": attempt}

    def step(s):
        return {"step": s, "loss": 1.0 / s}

    rows = [start("a"), step(1), step(2), step(3),
            start("a", attempt=1), {"event": "resumed", "step": 2}, step(3), step(4),
            start("b"), step(5),
            start("slurm-7", requeue=0), step(6), start("slurm-7", requeue=1), step(6), step(7)]
    steps, restarts = run_timeline(rows)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 7]
    assert restarts == [(3, "restart 1: torchrun restart, resumed after step 2"),
                        (5, "restart 2: resumed by hand (--resume), resumed after step 4"),
                        (6, "restart 3: resumed by hand (--resume), resumed after step 5"),
                        (6, "restart 4: Slurm requeue, resumed after step 5")]
