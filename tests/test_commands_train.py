"""`trainscale train` on the command line: torchrun underneath, the run folder, a consolidated model, the memory
pre-flight and --dry-run; bad input is one line and exit code 2 (`launch --slurm` is tests/test_runtime_job_slurm.py;
issue 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainscale.runtime.config import load_config
from trainscale.runtime.data.corpus import corpus_for
from trainscale.runtime.data.loader import eval_windows
from trainscale.runtime.find_model import load_model_dir
from trainscale.runtime.model import lm_loss

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def ts(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscale", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.dist
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


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(tmp_path):
    p = ts("train", "--config", str(tmp_path / "nope.toml"))
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "does not exist" in p.stderr
    p = ts("train", "--config", str(TINY), "--layout", "tp3", "--dry-run")
    assert p.returncode == 2 and "tp3 must divide" in p.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("lr = 3e-3", "lr = -1"))
    p = ts("train", "--config", str(bad), "--dry-run")
    assert p.returncode == 2 and "train.lr" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
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


# ------------------------------------------------------------------ pre-flight (issue 22 item 4)

EIGHT_B = ROOT / "configs" / "llama3.1-8b.toml"


@pytest.mark.slow
def test_preflight_refuses_the_8b_config_on_a_small_machine_before_anything_starts(tmp_path):
    """Llama 3.1 8B's fp32 weights, gradients and AdamW state alone are 16 B x 8.03e9 parameters = 128 GB over its
    eight ranks: 8 GB of memory cannot hold them under any layout of eight processes."""
    out = tmp_path / "run"
    env = {**os.environ, "TRAINSCALE_DEVICE_MEMORY_BYTES": "8e9"}
    for extra in ([], ["--dry-run"]):
        p = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(EIGHT_B), "--out", str(out),
                            *extra], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        assert p.returncode == 2, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
        assert "does not fit" in p.stderr and "no layout this runtime trains on 8 process(es) fits" in p.stderr
        assert not out.exists()  # nothing started: no run folder, no log, no torchrun


@pytest.mark.slow
def test_preflight_names_a_layout_that_fits_and_that_layout_passes(tmp_path):
    env = {**os.environ, "TRAINSCALE_DEVICE_MEMORY_BYTES": "400e9"}

    def dry(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(EIGHT_B), "--dry-run",
                               "--json", *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)

    p = dry()
    assert p.returncode == 2 and " would fit (" in p.stderr
    named = p.stderr.split("; ")[-1].split(" would fit")[0]
    ok = dry("--layout", named)
    assert ok.returncode == 0, ok.stderr
    mem = json.loads(ok.stdout)["memory"]
    assert mem["fits"] and mem["predicted_this_machine_bytes"] <= 400e9


@pytest.mark.slow
def test_dry_run_prints_predicted_memory_from_the_real_model(tmp_path):
    """One process, zero0: fp32 weights + gradients + two AdamW moments = 16 bytes a parameter of the model the
    runtime builds, plus AdamW's 4-byte step counter per tensor (torch.optim.AdamW's state)."""
    from trainscale.runtime.model import build_model

    cfg = load_config(TINY)
    model = build_model(cfg.model)
    params = list(model.parameters())
    expected = 16 * sum(q.numel() for q in params) + 4 * len(params)
    env = {**os.environ, "TRAINSCALE_DEVICE_MEMORY_BYTES": "1e9"}
    p = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(TINY), "--layout", "dp1",
                        "--dry-run", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr
    mem = json.loads(p.stdout)["memory"]
    assert mem["predicted_state_bytes"] == expected and mem["capacity_bytes"] == 1e9
    p = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(TINY), "--dry-run"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("memory:"))
    assert "predicted" in line and "1.0 GB" in line and line.endswith("fits")
    bad = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(TINY), "--dry-run"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**env, "TRAINSCALE_DEVICE_MEMORY_BYTES": "lots"})
    assert bad.returncode == 2 and "TRAINSCALE_DEVICE_MEMORY_BYTES" in bad.stderr


# ------------------------------------------------------------------ runs continue correctly (issue 21 item 6)


def _short(tmp: Path) -> Path:
    text = TINY.read_text().replace("steps = 40", "steps = 4").replace("warmup = 5", "warmup = 2")
    path = tmp / "short.toml"
    path.write_text(text.replace("eval_sequences = 64", "eval_sequences = 0\nsave_final = false"))
    return path


def _snapshot(folder: Path) -> dict[str, str]:
    """Every path under ``folder`` (the lock file included) with the sha256 of its bytes."""
    import hashlib

    return {str(p.relative_to(folder)): "folder" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


@pytest.mark.dist
def test_a_refused_resume_is_one_sentence_and_changes_nothing_in_the_run_folder(tmp_path):
    """Main before this: `--resume` on a finished run without checkpoints printed "no complete checkpoint to resume
    from: starting at step 0" and trained from scratch over it; a refusal rewrote run.json to "running" and counted
    a restart. Now every refusal comes before the run folder is touched (its lock file included)."""
    cfg = _short(tmp_path)
    done, kept = tmp_path / "done", tmp_path / "kept"
    for out, extra in ((done, []), (kept, ["--set", "checkpoint.every_steps=2"])):
        p = subprocess.run([sys.executable, "-m", "trainscale.runtime.train", "--config", str(cfg), "--out", str(out),
                            *extra], capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert not (done / "checkpoints").exists() and (kept / "checkpoints" / "step-00000004").is_dir()
    cases = [
        (done, ["--steps", "30"], "the run in {out} finished at step 4 and kept no checkpoint to continue from"),
        (kept, [], "already reached step 4 of 4; train further with --resume --steps N --extend"),
        (kept, ["--steps", "8"], "was laid out for 4 steps and its learning-rate schedule ends at step 4; going "
                                 "past it is explicit: add --extend"),
        (kept, ["--set", "train.lr=1e-3"], "trained with another config"),
        (kept, ["--layout", "tp3"], "tp3 must divide"),
    ]
    for out, extra, said in cases:
        before = _snapshot(out)
        p = ts("train", "--config", str(cfg), "--out", str(out), "--resume", *extra)
        assert p.returncode == 2, (extra, p.stdout[-1000:], p.stderr)
        assert said.format(out=out) in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert _snapshot(out) == before, extra
    p = ts("train", "--config", str(cfg), "--out", str(tmp_path / "none"), "--resume")
    assert p.returncode == 2 and "holds no run to continue" in p.stderr and not (tmp_path / "none").exists()
    p = ts("train", "--config", str(cfg), "--out", str(kept), "--resume", "--steps", "8", "--extend", "--dry-run",
           "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["command"][-1] == "--extend"


@pytest.mark.slow
def test_set_is_typed_by_the_schema_and_reaches_the_ranks(tmp_path):
    p = ts("train", "--config", str(TINY), "--set", "train.lrr=1e-4", "--dry-run")
    assert p.returncode == 2 and p.stderr.strip() == "trainscale: error: --set train.lrr: [train] has no key 'lrr'; " \
        "did you mean train.lr?"
    p = ts("train", "--config", str(TINY), "--set", "trian.lr=1e-4", "--dry-run")
    assert p.returncode == 2 and "no config section 'trian'" in p.stderr
    p = ts("train", "--config", str(TINY), "--set", "train.lr=fast", "--dry-run")
    assert p.returncode == 2 and "train.lr: Input should be a valid number" in p.stderr
    assert "Traceback" not in p.stderr
    p = ts("train", "--config", str(TINY), "--extend", "--dry-run")
    assert p.returncode == 2 and "use it with --resume" in p.stderr
    p = ts("train", "--config", str(TINY), "--set", "train.lr=1e-4", "--set", "data.held_out=0.1", "--dry-run",
           "--json")
    cmd = json.loads(p.stdout)["command"]
    assert cmd[-4:] == ["--set", "train.lr=1e-4", "--set", "data.held_out=0.1"]
    cfg = load_config(TINY, sets=["train.lr=1e-4", "data.held_out=0.1", "train.betas=[0.9, 0.99]",
                                  'train.schedule="wsd"', "run.out=runs/x"])
    assert (cfg.train.lr, cfg.data.held_out, cfg.train.betas, cfg.train.schedule, cfg.run.out) == (
        1e-4, 0.1, (0.9, 0.99), "wsd", "runs/x")


@pytest.mark.slow
def test_launch_set_writes_the_overridden_config_beside_the_script(tmp_path):
    script = tmp_path / "job.sh"
    p = ts("launch", "--slurm", "--config", str(TINY), "--nodes", "1", "--cpu", "--gpus-per-node", "1",
           "--set", "train.lr=2e-3", "--set", "train.schedule=wsd", "--script", str(script))
    assert p.returncode == 0, p.stderr
    written = tmp_path / "job.sh.config.toml"
    assert f"--config={written}" in script.read_text()
    assert load_config(written) == load_config(TINY, sets=["train.lr=2e-3", "train.schedule=wsd"])
    p = ts("launch", "--slurm", "--config", str(TINY), "--nodes", "1", "--cpu", "--gpus-per-node", "1",
           "--set", "train.lr=2e-3")
    assert p.returncode == 2 and "--set needs --script" in p.stderr


@pytest.mark.dist
def test_set_overrides_are_the_runs_config_and_resume_sees_them(tmp_path):
    out = tmp_path / "run"
    cfg = _short(tmp_path)
    p = ts("train", "--config", str(cfg), "--out", str(out), "--steps", "2", "--set", "train.lr=2e-3",
           "--set", "data.held_out=0.1", "--set", "checkpoint.every_steps=2", "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    lrs = [json.loads(x)["lr"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert lrs == pytest.approx([1e-3, 2e-3])  # warmup 2 to the overridden lr
    saved = load_config(out / "config.toml")
    assert (saved.train.lr, saved.data.held_out, saved.checkpoint.every_steps) == (2e-3, 0.1, 2)
    p = ts("train", "--config", str(cfg), "--out", str(out), "--resume", "--steps", "4", "--extend", "--dry-run")
    assert p.returncode == 2 and "trained with another config" in p.stderr
    p = ts("train", "--config", str(out / "config.toml"), "--out", str(out), "--resume", "--steps", "4", "--extend",
           "--dry-run")
    assert p.returncode == 0, p.stderr
