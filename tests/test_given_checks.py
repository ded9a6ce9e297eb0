"""Values checked where they are given (issue 35): `--fallback-layout tp3` (which does not split 4 heads) is refused
by `train --dry-run`, not found when a machine is lost; `launch --slurm --time 99:99` is refused, not written
into the script (sbatch(1): minutes:seconds, seconds 0..59; a zero limit is no limit)."""

from __future__ import annotations

import pytest
from _cli import run_cli

from trainscale.errors import TrainscaleError
from trainscale.runtime.job.slurm import time_limit_s

CONFIG = ('[model]\nname = "t"\nn_layers = 2\nd_model = 64\nn_heads = 4\nn_kv_heads = 2\nd_ff = 128\n'
          'vocab_size = 512\nmax_seq_len = 64\n[train]\nsteps = 2\nseq_len = 32\nglobal_batch = 12\n')


@pytest.mark.parametrize(("args", "words"), [
    (["--layout", "dp2", "--nnodes", "1:2", "--fallback-layout", "tp3"],
     "--fallback-layout tp3: tp3 must divide t's 4 attention heads; use tp in [1, 2]"),
    (["--layout", "dp4", "--nnodes", "2:4", "--fallback-layout", "dp4"],
     "--fallback-layout dp4 runs 4 process(es), but this job re-forms with 2, 3 (2..3 machine(s) x 1 process(es) "
     "each)"),
    (["--layout", "dp2", "--fallback-layout", "dp1"], "--fallback-layout dp1 serves an elastic job"),
])
def test_a_fallback_layout_is_checked_by_the_dry_run(tmp_path, monkeypatch, capsys, args, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(CONFIG)
    code, out = run_cli(monkeypatch, capsys, "train", "--config", "c.toml", *args, "--dry-run")
    assert code == 2 and words in out, out


def test_a_fallback_the_reformed_job_can_run_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(CONFIG)
    code, out = run_cli(monkeypatch, capsys, "train", "--config", "c.toml", "--layout", "dp4", "--nnodes", "2:4",
                        "--fallback-layout", "dp3", "--rdzv-endpoint", "h:1", "--dry-run")
    assert code == 0 and "--fallback-layout dp3" in out, out


@pytest.mark.parametrize(("text", "seconds"), [("90", 5400), ("04:00:00", 14400), ("1:30", 90), ("2-00:00:00", 172800),
                                               ("1-12", 129600), ("0", None), ("UNLIMITED", None)])
def test_slurm_time_limits_as_sbatch_reads_them(text, seconds):
    assert time_limit_s(text) == seconds


@pytest.mark.parametrize(("text", "words"), [("99:99", "has 99 seconds; a Slurm time limit's seconds run 0..59"),
                                             ("1:75:00", "has 75 minutes"), ("1-25", "has 25 hours"),
                                             ("abc", "is not a Slurm time limit")])
def test_a_slurm_time_limit_out_of_its_clock_is_refused_where_given(tmp_path, monkeypatch, capsys, text, words):
    with pytest.raises(TrainscaleError, match=words):
        time_limit_s(text)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(CONFIG)
    code, out = run_cli(monkeypatch, capsys, "launch", "--slurm", "--time", text, "--config", "c.toml")
    assert code == 2 and f"--time '{text}' " in out and "#SBATCH" not in out, out


@pytest.mark.parametrize("into", ["base", "base/adapter"])
def test_a_peft_export_into_its_own_base_is_refused_before_writing(tmp_path, into):
    import json

    from trainscale.infer.peft import export_peft

    base, lora = tmp_path / "base", tmp_path / "lora"
    base.mkdir()
    (base / "tokenizer.json").write_text("{}")
    lora.mkdir()
    (lora / "adapter.json").write_text(json.dumps({"base": str(base), "rank": 4, "alpha": 8.0,
                                                   "targets": ["wq", "wv"]}))
    with pytest.raises(TrainscaleError, match="would write the adapter into .* its base model folder"):
        export_peft(lora, tmp_path / into)
    assert sorted(p.name for p in base.iterdir()) == ["tokenizer.json"]
    assert (base / "tokenizer.json").read_text() == "{}"
