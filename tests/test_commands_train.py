"""Issue 4, the command line: `trainscale train` (torchrun underneath, run folder, consolidated model)
(`launch --slurm` is tests/test_runtime_job_slurm.py); bad input is one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainscale.runtime.artifact import load_model_dir
from trainscale.runtime.config import load_config
from trainscale.runtime.data.corpus import corpus_for
from trainscale.runtime.data.loader import eval_windows
from trainscale.runtime.model import lm_loss

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def ts(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscale", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_train_writes_the_run_folder_and_a_loadable_model(tmp_path):
    out = tmp_path / "run"
    p = ts("train", "--config", str(TINY), "--layout", "pp2,gpipe", "--steps", "4", "--out", str(out), "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    info = json.loads(p.stdout)
    assert info["status"] == "done" and info["world_size"] == 2 and info["layout"].startswith("tp1,cp1,pp2")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for key in ("loss", "tokens_per_s", "flops_per_s", "mfu", "lr", "time"):
        assert all(r[key] > 0 for r in steps), key
    assert [r["val_loss"] for r in rows if "val_loss" in r] == [pytest.approx(info["eval_loss"])]
    assert (out / "config.toml").exists() and (out / "tokenizer.json").exists()
    # the consolidated model gives the held-out loss the run reported
    model, spec, _ = load_model_dir(out)
    cfg = load_config(out / "config.toml")
    corpus = corpus_for(cfg)
    x, y = eval_windows(corpus.tokens("val"), cfg.train.seq_len, cfg.run.eval_sequences)
    with torch.no_grad():
        loss = sum(float(lm_loss(model(x[i:i + 16]), y[i:i + 16])) * y[i:i + 16].numel()
                   for i in range(0, len(x), 16)) / y.numel()
    assert loss == pytest.approx(info["eval_loss"], rel=1e-5)
    assert spec == cfg.model


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    p = ts("train", "--config", str(tmp_path / "nope.toml"))
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "does not exist" in p.stderr
    p = ts("train", "--config", str(TINY), "--layout", "tp3", "--dry-run")
    assert p.returncode == 2 and "tp3 must divide" in p.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("lr = 3e-3", "lr = -1"))
    p = ts("train", "--config", str(bad), "--dry-run")
    assert p.returncode == 2 and "train.lr" in p.stderr and "Traceback" not in p.stderr


def test_plan_and_dry_run_on_this_machine():
    p = ts("train", "--config", str(TINY), "--plan", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    # one machine: torchrun through trainscale.runtime.job.launch (stores on 127.0.0.1, agent dies with the CLI)
    assert "trainscale.runtime.job.launch" in info["command"] and "trainscale.runtime.train" in info["command"]
    assert info["command"][info["command"].index("--local-addr") + 1] == "127.0.0.1"
    if not torch.cuda.is_available():
        assert info["world_size"] == 1 and "no GPU" in info["why"]
    p = ts("train", "--config", str(TINY), "--layout", "dp2,tp2,pp2", "--dry-run", "--json")
    cmd = json.loads(p.stdout)["command"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8" and "--standalone" in cmd
    p = ts("train", "--config", str(TINY), "--layout", "dp2,tp2", "--nnodes", "2", "--rdzv-endpoint", "n0:29500",
           "--dry-run", "--json")
    cmd = json.loads(p.stdout)["command"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--rdzv-endpoint") + 1] == "n0:29500"
