"""One FLOP convention per printed number (issue 19 item 2). explain, plan, report and the runtime count a model's
training FLOPs with one function (estimate/flops.py training_flops_per_token / training_compute: 6N + 6LHQT, N the
matmul weights a token passes through, active ones for a MoE, attention halved for causal masking)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainscale.estimate import flops
from trainscale.estimate.params import active_params, param_count
from trainscale.estimate.planner import plan
from trainscale.estimate.walkthrough import walkthrough
from trainscale.runtime import measure
from trainscale.specs import Layout, load_model


def test_the_convention_by_hand_for_llama3_8b():
    m = load_model("llama3.1-8b")
    # matmul weights: all 8,030,261,248 parameters less the 128,256 x 4,096 input embedding (Llama 3.1 8B card)
    assert flops.matmul_params(m) == param_count(m) - 128_256 * 4096 == 7_504_924_672
    attn_causal = 6.0 * 32 * 32 * 128 * 8192  # 6·L·H·Q·T: PaLM App. B's 12·L·H·Q·T halved
    assert flops.training_flops_per_token(m, 8192) == 6.0 * 7_504_924_672 + attn_causal
    assert flops.training_compute(m, 1e12, 8192) == pytest.approx(1e12 * (6.0 * 7_504_924_672 + attn_causal))
    # the runtime used to count the attention unhalved: it read 12.5 % over the planner at seq 8192
    unhalved = flops.model_flops_per_token(m, flops.matmul_params(m), 8192, causal=False)
    assert unhalved / flops.training_flops_per_token(m, 8192) == pytest.approx(1.125, abs=5e-4)


@pytest.mark.parametrize("model,gpus,seq,layout", [
    ("llama3.1-8b", 8, 8192, "tp2,dp4,mb1"),
    ("llama3.1-70b", 64, 8192, "tp8,pp4,dp2,mb1,zero1"),
    ("mixtral-8x7b", 16, 4096, "tp2,dp8,ep8,mb1"),
])
def test_runtime_mfu_equals_the_planners(model, gpus, seq, layout):
    """The runtime's MFU (runtime/measure.py, what Trainer logs) and the planner's, same tokens/s and peak."""
    p = plan.problem(model=model, gpu="h100-sxm", gpus=gpus, seq=seq, global_batch_tokens=256 * seq, cluster="dgx-h100")
    r = p.evaluate_layout(Layout.parse(layout))
    peak = gpus * p.gpu.peak_bf16_flops  # the runtime's job peak: GPUs x the datasheet's bf16 figure
    ours = measure.mfu(r["tokens_per_s"], measure.flops_per_token(p.model, seq), peak)
    assert ours == pytest.approx(r["mfu"], rel=0.01)
    assert ours == pytest.approx(r["mfu"], rel=1e-12)  # in fact the same function
    assert measure.FLOP_CONVENTION == flops.FLOP_CONVENTION and flops.FLOP_CONVENTION in plan.FLOP_CONVENTION
    assert r["mfu_by_convention"]["6N+attention causal"] == pytest.approx(r["mfu"])


@pytest.mark.dist
def test_a_real_run_logs_the_planners_mfu(tmp_path):
    """A real `trainscale train` (one CPU process): its FLOPs per token are the planner's for its model and
    sequence, and every MFU it logs is tokens/s x those FLOPs / its peak, under the convention it names."""
    from pathlib import Path

    from trainscale.runtime.config import load_config

    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
    p = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(tiny), "--layout", "dp1",
                        "--steps", "2", "--out", str(tmp_path / "run"), "--json"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads(p.stdout)
    cfg = load_config(tiny)
    fpt = flops.model_flops_per_token(cfg.model, flops.matmul_params(cfg.model), cfg.train.seq_len, causal=True)
    assert info["flops_per_token"] == fpt and info["flop_convention"] == flops.FLOP_CONVENTION
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["flop_convention"] == flops.FLOP_CONVENTION_NAME
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / info["peak_flops"], rel=1e-9)


@pytest.mark.parametrize("model", ["deepseek-v3", "llama3.1-70b"])
def test_report_and_explain_count_the_same_training_flops(model, tmp_path):
    from trainscale.report.build import seed_sections

    w = walkthrough(model=model, tokens=14.8e12, gpus=2048, seq=4096)
    m = load_model(model)
    assert w["training_flops"] == flops.training_compute(m, 14.8e12, 4096)
    _, summary = seed_sections(tmp_path, model, "h100-sxm", 2048, "meta-h100", None, 14.8e12, 0.4, seq=4096)
    assert dict(summary)["training compute"].startswith(f"{w['training_flops']:.3g} FLOPs")
    if m.is_moe:
        # DeepSeek-V3 (arXiv 2412.19437): 671B total, 37B activated. The report's old 6 x total x D read 17.9x the
        # active 6ND and 15.6x this count (which adds MLA attention at seq 4096: 6·61·128·(192 + 128)·4096 / 2)
        assert flops.matmul_params(m) == active_params(m, embeddings=False) == 36_625_603_584
        # + its one MTP module (catalog mtp_layers = 1): the block's active weights, M_k, a second head pass, one more
        # attention layer, as Megatron-Core counts them (flops.mtp_matmul_params)
        per_token = 6 * (36_625_603_584 + 1_614_779_392) + 6.0 * 62 * 128 * (192 + 128) * 4096 / 2
        assert w["training_flops"] == pytest.approx(per_token * 14.8e12, rel=1e-12)
        assert 6 * param_count(m) * 14.8e12 / w["training_flops"] > 15  # 15.6x with the MTP module counted


@pytest.mark.slow
def test_report_from_a_plan_takes_its_tokens_and_sequence(tmp_path):
    from trainscale.report.build import build_report

    out = subprocess.run([sys.executable, "-m", "trainscale", "plan", "--model", "llama3.1-70b", "--gpu", "h100-sxm",
                          "--gpus", "1024", "--seq", "4096", "--global-batch-tokens", str(2**22), "--tokens", "15e12",
                          "--json"], capture_output=True, text=True, check=True).stdout
    (tmp_path / "plan.json").write_text(out)
    p = json.loads(out)
    build_report(tmp_path / "r", plan_file=tmp_path / "plan.json")
    summary = json.loads((tmp_path / "r" / "report.json").read_text())["summary"]
    days = next(v for k, v in summary.items() if k.startswith("days at"))
    assert days == f"{p['days']:,.1f}"  # the plan's days: tokens / tokens per second
    assert "4,096" in summary["training compute"] and "1.5e+13 tokens" in summary["training compute"]
