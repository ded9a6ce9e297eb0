"""A mixture-of-experts run (issue 14): a model (configs/moe-tiny.toml: 1 dense + 3 MoE layers of 8 experts,
top-2, a gated shared expert) trained 10 steps in fp32 on CPU (gloo) under expert-parallel layouts gives the
single-process losses to 1e-4 relative (as tests/test_runtime_parallel_parity.py for dense layouts); its metrics
carry the per-expert token counts and the all-to-all time; an EP checkpoint resumes at another EP size on
the uninterrupted run's losses; bad input is one sentence.

Real processes, one torchrun job per world size running its layouts one after another
(tests/_runtime_worker.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _parity import run_jobs

from trainscale.estimate.params import param_count
from trainscale.runtime.config import load_config
from trainscale.runtime.job.checkpoint import committed_steps, step_dir_name
from trainscale.runtime.job.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "moe-tiny.toml"
STEPS = 10
TOL = 1e-4

# world size -> layouts. EP with replicated (zero0) and sharded (zero2/3, HSDP) data parallelism, with TP for
# the attention (with and without sequence parallelism), CP, a pipeline (+ full recompute), micro-batches;
# tp2 alone runs the MoE layers un-split on each tp rank.
JOBS: dict[int, list[str]] = {
    1: ["mb8"],
    2: ["dp2,ep2", "fsdp2,ep2", "dp2,ep2,mb2", "tp2,mb8"],
    4: ["dp4,ep2", "dp4,zero3,ep4", "dp4,zero3,ep2", "dp4,ep4,mb2", "dp4,zero2,hsdp2,ep2", "dp2,ep2,tp2",
        "dp2,ep2,tp2,nosp", "dp2,ep2,cp2,mb4", "pp2,dp2,ep2,mb2", "pp2,fsdp2,ep2,rc=full"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    got = run_jobs(CONFIG, STEPS, JOBS, tmp_path_factory.mktemp("moe-parity"))
    return got


PARALLEL = [lay for lays in JOBS.values() for lay in lays if lay != "mb8"]


@pytest.mark.dist
@pytest.mark.parametrize("layout", PARALLEL)
def test_moe_loss_matches_single_process(runs, layout):
    ref, got = runs["mb8"]["losses"], runs[layout]["losses"]
    assert len(got) == len(ref) == STEPS
    rel = max(abs(x - y) / abs(y) for x, y in zip(got, ref, strict=True))
    assert rel < TOL, f"{layout}: {got} vs single process {ref}"


@pytest.mark.dist
def test_moe_learns_and_experts_split(runs):
    spec = load_config(CONFIG).model
    total = param_count(spec)
    ref = runs["mb8"]
    assert ref["local_params"] == total
    assert ref["losses"][-1] < ref["losses"][0] - 0.3
    experts = 3 * 3 * spec.n_experts * spec.expert_width * spec.d_model  # 3 MoE layers x (w1, w3, w2)
    # EP holds 1/ep of the routed experts and every dense weight; FSDP then shards both
    assert runs["dp2,ep2"]["local_params"] == total - experts // 2
    assert runs["dp4,ep4,mb2"]["local_params"] == total - experts * 3 // 4
    assert runs["dp4,zero3,ep4"]["local_params"] < total / 3


# ----------------------------------------------------------------------------- checkpoints, metrics, CLI

RUN_CONFIG = CONFIG.read_text().replace('layout = "dp2,ep2"', "eval_sequences = 0\nsave_final = false").replace(
    "eval_sequences = 64\n", "") + "\n[checkpoint]\nevery_steps = 4\nkeep = 3\n"


def _train(cfg: Path, layout: str, world: int, out: Path, resume: bool = False) -> str:
    p = subprocess.run(torchrun_command(cfg, layout, out, world, steps=8, resume=resume), capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def _rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): r for r in rows if "loss" in r and "step_time_s" in r}


@pytest.mark.dist
def test_ep_checkpoint_resumes_at_another_ep_size_and_metrics_count_experts(tmp_path):
    cfg = tmp_path / "moe.toml"
    cfg.write_text(RUN_CONFIG)
    spec = load_config(cfg).model
    ref = tmp_path / "ep4"
    _train(cfg, "dp4,zero3,ep4", 4, ref)  # uninterrupted, checkpoints at steps 4 and 8
    assert committed_steps(ref / "checkpoints") == [4, 8]
    want = _rows(ref)
    assert sorted(want) == list(range(1, 9))
    tokens = 8 * 32  # global_batch x seq_len
    for row in want.values():  # every routed (token, expert) pair counted once, per MoE layer
        assert sorted(row["expert_tokens"]) == ["1", "2", "3"]
        assert all(sum(c) == spec.experts_per_token * tokens and len(c) == 8 for c in row["expert_tokens"].values())
        assert row["a2a_s"] > 0 and 0 < row["a2a_share"] < 1 and row["a2a_bytes"] > 0
        assert 0 < row["moe_aux_loss"] < 3 * spec.aux_loss_coef * spec.n_experts
    for layout, world in (("dp4,ep2", 4), ("dp2,ep2,mb2", 2)):  # another EP size, with and without FSDP
        out = tmp_path / layout.replace(",", "-")
        shutil.copytree(ref, out)
        shutil.rmtree(out / "checkpoints" / step_dir_name(8))  # as if the ep4 job had stopped after step 4
        (out / "metrics.jsonl").unlink()
        log = _train(cfg, layout, world, out, resume=True)
        assert "at step 4" in log, log[-2000:]
        got = _rows(out)
        assert sorted(got) == [5, 6, 7, 8], layout
        for step, row in got.items():
            assert row["loss"] == pytest.approx(want[step]["loss"], rel=1e-4), (layout, step)
            # the same routing but for near-ties in a top-k that rounding under another layout flips (seen: 14 of 512)
            for layer, counts in row["expert_tokens"].items():
                moved = sum(abs(a - b) for a, b in zip(counts, want[step]["expert_tokens"][layer], strict=True))
                assert moved <= 0.05 * spec.experts_per_token * tokens, (layout, step, layer)


@pytest.mark.slow
@pytest.mark.parametrize(("config_edit", "layout", "says"), [
    (None, "dp2,ep2", "needs a mixture-of-experts model"),
    ("n_experts = 6", "dp4,ep4", "ep4 must divide the model's 6 experts"),
    ('attention = "mla"\nkv_lora_rank = 32\nqk_rope_head_dim = 8', "dp2,ep2", "multi-head latent attention"),
])
def test_cli_refuses_what_the_runtime_cannot_run(tmp_path, config_edit, layout, says):
    if config_edit is None:
        cfg = ROOT / "configs" / "tiny.toml"
    else:
        cfg = tmp_path / "bad.toml"
        key = config_edit.split(" ")[0]
        text = CONFIG.read_text()
        if key == "n_experts":
            text = text.replace("n_experts = 8", config_edit)
        else:
            text = text.replace("rope_theta = 10000.0", "rope_theta = 10000.0\n" + config_edit)
        cfg.write_text(text)
    p = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(cfg), "--layout", layout,
                        "--steps", "2", "--out", str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "Traceback" not in p.stderr, p.stderr


# ----------------------------------------------------------------------------- --compare-plan

COMPARE = {2: ["dp2,ep2,mb4", "fsdp2,ep2,mb4", "tp2,mb8"], 4: ["dp4,zero3,ep2,mb2"]}


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> dict[str, dict]:
    from trainscale.runtime.probe.compare import compare, compare_command
    from trainscale.specs import Layout

    tmp = tmp_path_factory.mktemp("moe-compare")
    cfg = load_config(CONFIG)
    got = {}
    for world, layouts in COMPARE.items():
        out = tmp / f"world{world}.json"
        proc = subprocess.run(compare_command(CONFIG, layouts, out, steps=1, warmup=0), capture_output=True, text=True,
                              timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        for layout, ranks in json.loads(out.read_text()).items():
            got[layout] = compare(cfg, Layout.parse(layout), ranks, None)
    return got


@pytest.mark.dist
@pytest.mark.parametrize("layout", [lay for lays in COMPARE.values() for lay in lays])
def test_compare_plan_moe_state_flops_and_all_to_all(compared, layout):
    """Each rank's parameter, gradient and AdamW bytes equal estimate/measured/rank.py's exactly (experts split over
    ep, sharded on dim 1 over expert_shard); FLOPs and all-to-all bytes are predicted for balanced routing,
    so each rank's figure is within the routing's imbalance and the ranks' sum is exact."""
    res = compared[layout]
    assert res["state_exact"], [r["state"] for r in res["ranks"]]
    flops = [r["flops"] for r in res["ranks"]]
    assert sum(f["measured"] for f in flops) == pytest.approx(sum(f["predicted"] for f in flops), rel=1e-9)
    assert all(f["measured"] == pytest.approx(f["predicted"], rel=0.2) for f in flops)
    if "ep" in layout:
        assert res["a2a_bytes_measured"] == res["a2a_bytes_predicted"] > 0
        assert res["a2a_max_error"] < 0.5
        assert all(r["a2a"]["seconds"]["measured"] > 0 for r in res["ranks"])
