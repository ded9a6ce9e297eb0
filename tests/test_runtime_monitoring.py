"""Monitoring a long run: ``[train] eval_every`` held-out losses, TensorBoard after two
kill + ``--resume`` restarts, the console of a resumed run, the ETA, ``[profile]``, the optional sinks, and
``report --run`` of that run (the run first, each restart marked; issue 22, items 5 and 6).

The run under test is the tiny config for 8 steps (checkpoint every 3, eval every 2, 8 held-out sequences):
uninterrupted, and killed twice (an abrupt ``os._exit`` of the rank before step 5, then before step 8, each
followed by ``trainscale train --resume``, as a person restarts a killed job). One torchrun job (pp2) checks that
the held-out losses do not depend on the layout and writes the profiler's traces."""

from __future__ import annotations

import html
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, CKPT = 8, 2, 3


def _config(tmp: Path, extra: str = "") -> Path:
    text = (ROOT / "configs" / "tiny.toml").read_text()
    text = (text.replace("steps = 40", f"steps = {STEPS}").replace("eval_sequences = 64", "eval_sequences = 8")
            .replace("log_every = 5", "log_every = 1").replace("seed = 0", f"seed = 0\neval_every = {EVERY}"))
    cfg = tmp / "tiny.toml"
    cfg.write_text(text + f"\n[checkpoint]\nevery_steps = {CKPT}\n" + extra)
    return cfg


def _train(cfg: Path, out: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainscale", "train", "--config", str(cfg), "--out", str(out), "--max-restarts", "0",
           *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert (p.returncode == 0) == ok, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _evals(run: Path) -> dict[int, float]:
    """step -> held-out loss (the last evaluation of a step that ran twice)."""
    return {r["step"]: r["val_loss"] for r in _rows(run) if r.get("event") == "eval"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitor")
    cfg = _config(tmp)
    whole, killed = tmp / "whole", tmp / "killed"
    _train(cfg, whole)
    _train(cfg, killed, "--inject", "crash@step=5", ok=False)
    second = _train(cfg, killed, "--resume", "--inject", "crash@step=8", ok=False)
    third = _train(cfg, killed, "--resume")
    return {"cfg": cfg, "whole": whole, "killed": killed, "second": second, "third": third, "tmp": tmp}


@pytest.mark.dist
def test_eval_every_at_its_steps_and_equal_after_two_resumes(runs):
    whole, killed = _evals(runs["whole"]), _evals(runs["killed"])
    assert sorted(whole) == list(range(EVERY, STEPS + 1, EVERY))
    assert sorted(killed) == sorted(whole)
    for s in whole:
        assert killed[s] == pytest.approx(whole[s], abs=1e-6), s
    # step 4 was evaluated by the first attempt and again after the resume from step 3: the same value
    fours = [r["val_loss"] for r in _rows(runs["killed"]) if r.get("event") == "eval" and r["step"] == 4]
    assert len(fours) == 2 and fours[0] == pytest.approx(fours[1], abs=1e-6)
    # the final held-out loss of run.json is the eval_every value of the last step (evaluated once, not twice)
    info = json.loads((runs["whole"] / "run.json").read_text())
    assert info["eval_loss"] == pytest.approx(whole[STEPS], abs=1e-9)
    assert sum("val_loss" in r for r in _rows(runs["whole"])) == len(whole)
    # it is learning: the held-out loss falls at every evaluation
    losses = [whole[s] for s in sorted(whole)]
    assert losses == sorted(losses, reverse=True)


@pytest.mark.dist
def test_tensorboard_holds_every_step_once_after_two_resumes(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = runs["killed"]
    assert len(list(run.glob("events.out.tfevents.*"))) == 3  # one per attempt
    acc = EventAccumulator(str(run))
    acc.Reload()
    steps = {r["step"]: r for r in _rows(run) if "loss" in r}  # the last run of each step
    got = acc.Scalars("train/loss")
    assert [e.step for e in got] == list(range(1, STEPS + 1))
    for e in got:
        assert e.value == pytest.approx(steps[e.step]["loss"], rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/val_loss")] == list(range(EVERY, STEPS + 1, EVERY))


@pytest.mark.dist
def test_console_of_a_resumed_run_starts_with_the_resume_and_shows_only_new_steps(runs):
    for key, frm in (("second", CKPT), ("third", 2 * CKPT)):
        lines = [ln for ln in runs[key].stdout.splitlines() if ln.strip()]
        assert lines[0].startswith(f"resumed from step {frm}"), lines[:3]
        shown = [int(m.group(1)) for ln in lines if (m := re.match(r"step\s+(\d+)/", ln))]
        assert shown and min(shown) == frm + 1, shown
    # the ETA: measured step times x steps left, on every step row; nothing left at the last step
    rows = [r for r in _rows(runs["whole"]) if "loss" in r]
    assert all(r["eta_s"] >= 0 for r in rows) and rows[-1]["eta_s"] == 0
    mean = np.mean([r["step_time_s"] for r in rows[1:4]])
    assert rows[3]["eta_s"] == pytest.approx(mean * (STEPS - 4), rel=1e-9)
    assert "ETA " in runs["third"].stdout


@pytest.mark.dist
def test_unigram_entropy_is_the_training_tokens(runs):
    from trainscale.runtime.config import load_config
    from trainscale.runtime.data.corpus import corpus_for

    counts = np.asarray(corpus_for(load_config(runs["cfg"])).unigram_counts(), dtype=np.float64)
    p = counts[counts > 0] / counts.sum()
    info = json.loads((runs["whole"] / "run.json").read_text())
    assert info["unigram_entropy"] == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
    assert 0 < info["unigram_entropy"] < math.log(512)


@pytest.mark.dist
def test_report_leads_with_the_run_and_marks_each_restart(runs):
    out = runs["tmp"] / "report"
    p = subprocess.run([sys.executable, "-m", "trainscale", "report", "--run", str(runs["killed"]), "--out", str(out),
                        "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    data = json.loads((out / "report.json").read_text())
    keys = [f["key"] for f in data["figures"]]
    assert keys[0] == "run_loss" and "training_state" not in keys  # no walkthrough pages unless asked
    page = (out / "index.html").read_text()
    # the run named by its folder (report/build.run_label), not "Run killed"
    assert page.index(f"<h2>The run in {html.escape(str(runs['killed']))}</h2>") < page.index("<figure")
    assert "llama3.1-405b" not in page and "Training state" not in page
    loss = data["figures"][0]["table"]
    marks = {k: v for k, v in loss.items() if k.startswith("restart")}
    assert marks == {"restart 1: resumed by hand (--resume), resumed after step 3": "at step 4",
                     "restart 2: resumed by hand (--resume), resumed after step 6": "at step 7"}
    # one unigram baseline: the held-out loss of the unigram model, what the held-out loss is compared with
    assert "held-out loss" in loss and loss["unigram baseline: held-out loss of the unigram model"].endswith(
        "nats/token")
    for f in data["figures"]:  # every value of every table carries a unit (or is a sentence)
        for k, v in f["table"].items():
            assert re.search(r"[A-Za-z%]", v), (f["key"], k, v)
    with_walk = runs["tmp"] / "report-walk"
    from trainscale.report.build import build_report

    build_report(with_walk, run_dir=runs["killed"], walkthrough=True)
    keys = [f["key"] for f in json.loads((with_walk / "report.json").read_text())["figures"]]
    assert keys[0] == "run_loss" and keys.index("training_state") > keys.index("run_mfu")


@pytest.mark.dist
def test_pp2_eval_equals_one_process_and_profile_traces(runs, tmp_path):
    """One torchrun job (pp2, two processes): its eval_every held-out losses equal the one-process run's (the
    weights are gathered from both stages), and [profile] steps = [2, 3] writes a chrome trace per rank."""
    from trainscale.runtime.job.launch import torchrun_command

    cfg = _config(tmp_path, "\n[profile]\nsteps = [2, 3]\nranks = [0, 1]\n")
    run = tmp_path / "pp2"
    p = subprocess.run(torchrun_command(cfg, "pp2", run, 2), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    whole, got = _evals(runs["whole"]), _evals(run)
    assert sorted(got) == sorted(whole)
    for s in whole:
        assert got[s] == pytest.approx(whole[s], abs=2e-5), s
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"trace-rank{rank}-steps2-3.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any("aten::mm" in n or "aten::addmm" in n for n in names), rank  # the matmuls ran inside
        assert "Self CPU Mem" in (run / "profile" / f"memory-rank{rank}-steps2-3.txt").read_text()


def test_a_missing_sink_package_is_one_sentence():
    import importlib.util

    from trainscale.errors import TrainscaleError
    from trainscale.runtime.job.tblog import check_sinks

    for sink in ("mlflow", "wandb"):
        if importlib.util.find_spec(sink) is None:
            with pytest.raises(TrainscaleError, match=f"sinks names {sink}, but the {sink} package is not installed"):
                check_sinks((sink,))
        else:
            check_sinks((sink,))


@pytest.mark.dist
def test_mlflow_file_store_gets_every_step(tmp_path):
    pytest.importorskip("mlflow")
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    cfg = _config(tmp_path, "").read_text().replace("[run]", "[run]\nsinks = [\"mlflow\"]")
    (tmp_path / "m.toml").write_text(cfg)
    run = tmp_path / "m"
    _train(tmp_path / "m.toml", run, "--steps", "4")
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    hist = client.get_metric_history((run / "mlflow_run_id").read_text().strip(), "train_loss")
    rows = [r for r in _rows(run) if "loss" in r]
    assert [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)] == \
        [(r["step"], pytest.approx(r["loss"], rel=1e-9)) for r in rows]
