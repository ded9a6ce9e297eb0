"""Issue 14, the planner side: a mixture of experts counted (compute from the active parameters, state from the
total), expert parallelism in the plan and the search, FP8 GEMMs, and the DeepSeek-V3 validation row.

Published figures: DeepSeek-V3 671B total / 37B activated (arXiv 2412.19437 abstract), 2.664M H800 GPU-hours of
pre-training for 14.8T tokens (Table 1); Mixtral 8x7B 46.7B total / 12.9B active (arXiv 2401.04088).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.test_specs_moe import DEEPSEEK_V3, MIXTRAL
from trainscale.cli import app
from trainscale.errors import TrainscaleError
from trainscale.estimate import flops
from trainscale.estimate.planner import plan
from trainscale.estimate.planner.step import matmul_params
from trainscale.estimate.planner.validate import load_runs, predict
from trainscale.specs import Layout, load_model


def _explain(tmp_path, cfg: dict) -> dict:
    p = tmp_path / f"{cfg['model_type']}.json"
    p.write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["explain", "--model", str(p), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_explain_deepseek_v3_total_and_active(tmp_path):
    """Counting convention: embedding table in (as DeepSeek's 671B / 37B count it), MTP module apart."""
    out = _explain(tmp_path, DEEPSEEK_V3)
    fig = out["figures"]
    assert abs(fig["params"] / 671e9 - 1) < 0.005, fig["params"]
    assert abs(fig["active_params"] / 37e9 - 1) < 0.02, fig["active_params"]
    # memory follows the total, time the active
    assert fig["memory_follows_total"] == 16 * fig["params"]
    # time: 6 x active matmul weights (embedding out) + causal MLA attention at the walkthrough's seq (8,192)
    per_token = 6 * fig["active_params_no_embedding"] + 6.0 * 61 * 128 * (192 + 128) * 8192 / 2
    assert fig["time_follows_active"] == pytest.approx(per_token, rel=1e-12)
    assert fig["training_flops"] == pytest.approx(per_token * out["inputs"]["tokens"])
    labels = [f["label"] for s in out["sections"] for f in s["figures"]]
    assert "total parameters (embedding in)" in labels and "active per token (embedding in)" in labels


def test_explain_mixtral_total_and_active(tmp_path):
    fig = _explain(tmp_path, MIXTRAL)["figures"]
    assert abs(fig["params"] / 46.7e9 - 1) < 0.005 and abs(fig["active_params"] / 12.9e9 - 1) < 0.005


def test_flops_follow_active_parameters_and_mla_shapes():
    m = load_model("deepseek-v3")
    # 6 x active (matmul weights, no embedding lookup) + MLA attention: QK^T over 128 + 64, AV over 128
    assert matmul_params(m) == 36_625_603_584
    assert flops.attention_flops_per_token(m, 4096) == 6.0 * 61 * 128 * (192 + 128) * 4096
    dense = load_model("llama3.1-8b")
    assert flops.attention_flops_per_token(dense, 8192) == 12.0 * 32 * 32 * 128 * 8192  # unchanged for MHA


def test_mixtral_memory_per_gpu_against_a_hand_count():
    """Mixtral 8x7B on 8 H100, dp8, ep8, zero1, software 'trainscale' (bf16 weights, fp32 grads, Adam 12 B)."""
    # hand count (params.py inventory): per layer attention 4096 x (4096 + 1024 + 1024 + 4096) = 41,943,040, two
    # norms 8,192, router 8 x 4096 = 32,768; 8 experts x 3 x 14336 x 4096 = 1,409,286,144; embedding and head
    # 2 x 32000 x 4096 = 262,144,000, final norm 4,096
    experts = 32 * 1_409_286_144  # 45,097,156,608: split over ep8, one expert per GPU, not sharded further
    rest = 32 * (41_943_040 + 8_192 + 32_768) + 262_144_000 + 4_096  # 1,605,636,096: on every GPU
    assert experts + rest == 46_702_792_704
    per_gpu = rest + experts // 8  # 7,242,780,672 parameters held
    weights = 2 * per_gpu  # bf16: 14,485,561,344 B
    grads = 4 * per_gpu  # fp32 gradients (zero1 keeps them whole): 28,971,122,688 B
    # Adam (fp32 master + m + v, 12 B) sharded by zero1: the dense part over the 8 dp ranks, each expert over the
    # dp ranks that hold it (8 / ep8 = 1)
    adam = 12 * (rest // 8 + experts // 8)  # 70,054,189,056 B
    p = plan.problem("mixtral-8x7b", None, 8, 4096, 8 * 4096, cluster="dgx-h100")
    row = p.evaluate_layout(Layout.parse("dp8,ep8,zero1,mb1"))
    mem = row["memory_per_gpu_bytes"]
    assert mem["weights"] == pytest.approx(weights, rel=1e-12)
    assert mem["gradients"] == pytest.approx(grads, rel=1e-12)
    assert mem["optimizer"] == pytest.approx(adam, rel=1e-12)
    assert weights + grads + adam == 113_510_873_088  # 113.5 GB of state: does not fit one 80 GB H100
    assert not row["fits"]
    # EP halves the expert state per GPU when it doubles (ep4: two experts per GPU, Adam over 2 ranks)
    row4 = p.evaluate_layout(Layout.parse("dp8,ep4,zero1,mb1"))
    assert row4["memory_per_gpu_bytes"]["weights"] == pytest.approx(2 * (rest + experts // 4), rel=1e-12)
    assert row4["memory_per_gpu_bytes"]["optimizer"] == pytest.approx(12 * (rest // 8 + experts // 4 // 2),
                                                                      rel=1e-12)


def test_deepseek_v3_pipeline_stage_mixes_dense_and_moe_layers():
    p = plan.problem("deepseek-v3", None, 2048, 4096, 15360 * 4096, cluster="deepseek-h800", software="deepseek-v3")
    row = p.evaluate_layout(Layout.parse("pp16,dp128,ep64,zero1,mb1"))
    # 61 layers on 16 stages: 3 (the dense ones), 4 x 13, 3, 3; a 4-MoE-layer stage is the heaviest; DualPipe
    # holds it twice: 2 x 4 x 11.27B routed-expert params / ep64 + the rest
    assert row["layers_first_stage"] == 3 and row["layers_max_stage"] == 4
    assert row["heaviest_stage"] >= 1
    assert row["step_time_parts_s"]["ep_comm"] == 0.0  # DualPipe hides the all-to-all under compute
    assert row["a2a_per_moe_layer_s"] > 0 and not row["ep_in_scale_up"]


def test_deepseek_v3_validation_row_within_10_percent():
    run = next(r for r in load_runs() if r.id == "deepseek-v3-h800x2048")
    out = predict(run)
    assert run.published == 2_664_000 and run.tokens == 14.8e12
    assert abs(out["error"]) < 0.10, out["predicted"]


def test_search_puts_ep_inside_a_node_when_the_all_to_all_dominates():
    """Mixtral on 64 H100 (8-GPU NVLink servers, 50 GB/s per GPU between them), no all-to-all overlap: the
    winner keeps its EP group on NVLink and says what the cross-node alternative would cost."""
    p = plan.problem("mixtral-8x7b", None, 64, 4096, 2**22, cluster="dgx-h100")
    s = p.search()
    b = s.best()
    best = p.row(s.cfg, s.res, b)
    assert int(s.cfg["ep"][b]) > 1 and best["ep_in_scale_up"]
    why = " ".join(s.why_best())
    assert "inside one 8-GPU NVLink domain" in why and "with EP across nodes" in why and "slower" in why
    # with TP2 fixed, EP8 would span 16 GPUs: the search takes EP4 (2 x 4 = 8, one server) instead
    p2 = plan.problem("mixtral-8x7b", None, 64, 4096, 2**22, cluster="dgx-h100", fix="tp=2")
    s2 = p2.search()
    b2 = s2.best()
    assert int(s2.cfg["ep"][b2]) * 2 <= 8 and bool(s2.res["ep_in_scale_up"][b2])
    fast = s2.res["ep_in_scale_up"] & s2.res["fits"]
    slow = ~s2.res["ep_in_scale_up"] & s2.res["fits"]
    assert s2.res["t_ep_comm"][slow].min() > s2.res["t_ep_comm"][fast].min()
    # --fix ep and --forbid ep
    s3 = plan.problem("mixtral-8x7b", None, 64, 4096, 2**22, cluster="dgx-h100", fix="ep=2").search()
    assert set(s3.cfg["ep"].tolist()) == {2}
    s4 = plan.problem("mixtral-8x7b", None, 64, 4096, 2**22, cluster="dgx-h100", forbid="ep").search()
    assert set(s4.cfg["ep"].tolist()) == {1}


def test_dense_search_has_no_ep():
    s = plan.problem("llama3.1-8b", "h100-sxm", 16, 4096, 2**20).search()
    assert set(s.cfg["ep"].tolist()) == {1}
    assert "ep_comm" not in plan.problem("llama3.1-8b", "h100-sxm", 8, 4096, 2**20).evaluate_layout(
        Layout.parse("dp8,zero1"))["step_time_parts_s"]


def test_fp8_gemms_run_faster_and_keep_the_state():
    p16 = plan.problem("mixtral-8x7b", None, 64, 4096, 2**22, cluster="dgx-h100")
    p8 = plan.problem("mixtral-8x7b", None, 64, 4096, 2**22, cluster="dgx-h100", precision="fp8")
    lay = Layout.parse("dp64,ep8,zero1,mb1")
    r16, r8 = p16.evaluate_layout(lay), p8.evaluate_layout(lay)
    assert r8["compute_parts_s"]["gemm"] < 0.75 * r16["compute_parts_s"]["gemm"]
    assert r8["memory_per_gpu_bytes"]["optimizer"] == r16["memory_per_gpu_bytes"]["optimizer"]
    assert r8["mfu"] > r16["mfu"]  # MFU stays over the bf16 peak


@pytest.mark.parametrize("args,words", [
    (["--model", "llama3.1-8b", "--layout", "dp8,ep2,zero1"], "dense model"),
    (["--model", "mixtral-8x7b", "--layout", "dp12,ep3,zero1", "--global-batch-tokens", "96K", "--seq", "4096"],
     "ep3 must divide the model's 8 experts; use ep in [1, 2, 4]"),
    (["--model", "llama3.1-8b", "--gpu", "a100-sxm-80gb", "--gpus", "8", "--precision", "fp8"], "no FP8 tensor cores"),
    (["--model", "mixtral-8x7b", "--gpus", "8", "--precision", "fp4"], "--precision must be one of"),
    (["--model", "llama3.1-8b", "--gpus", "64", "--fix", "ep=2"], "needs a mixture-of-experts model"),
    (["--model", "mixtral-8x7b", "--gpus", "64", "--fix", "ep=3"], "must divide the model's 8 experts"),
    (["--model", "mixtral-8x7b", "--gpus", "64", "--fix", "ep=0"], "must be at least 1"),
])
def test_bad_moe_input_is_one_sentence_exit_2(args, words):
    r = subprocess.run([sys.executable, "-m", "trainscale", "plan", *args], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_moe_software_knobs_are_checked():
    from trainscale.estimate.planner.software import load_software, with_knobs

    sw = load_software("deepseek-v3")
    assert (sw.precision, sw.moe_node_limit, sw.pipeline, sw.comm_sms) == ("fp8", 4, "dualpipe", 20)
    assert all(sw.sources[k] for k in ("precision", "moe_node_limit", "a2a_overlap", "pipeline", "comm_sms"))
    with pytest.raises(TrainscaleError, match="no FP8 tensor cores"):
        plan.problem("llama3.1-8b", "a100-sxm-80gb", 8, 4096, 2**20, software=with_knobs(sw, precision="fp8"))


def test_deepseek_v3_row_fits_an_h800_by_a_hand_count():
    """pp16 DualPipe, dp128, ep64, zero1, mb1, seq 4096, software 'deepseek-v3' (arXiv 2412.19437 Sec. 3.2.3 and
    3.3.3: RMSNorm and MLA up-projections recomputed, Linear inputs cached in FP8 (1 + 4/128 B with the 1x128 tile's
    FP32 scale), the attention output in E5M6 (1.5 + 4/128 B), the MoE SwiGLU inputs in FP8 and its output
    recomputed; the gate applied on the expert side, DeepEP's combine a plain sum).

    Per token per MoE layer, bytes (busiest EP rank: top-8 x the planner's imbalance 1.25 = 10 routed rows):
      the two RMSNorm inputs, kept to recompute them         2 x 2 x 7168            =  28,672
      MLA: c_q 2 x 1536 + (c_kv + rope key) 2 x (512 + 64)   3,072 + 1,152           =   4,224
           attention output O, E5M6: 1.53125 x 128 x 128 + fp32 log-sum-exp 4 x 128  =  25,600
      MoE: per routed row the FP8 dispatched row 1.03125 x 7168 = 7,392, its fp32 gate weight 4, the FP8 SwiGLU
           inputs 1.03125 x 2 x 2048 = 4,224: 11,620 x 10                             = 116,200
           shared expert's FP8 SwiGLU inputs 4,224 + fp32 router scores 4 x 256       =   5,248
                                                                                total = 179,944
    The heaviest rank holds two 4-layer chunks (layers 61 on 16 stages: 3, 4 x 13, 3, 3) and DualPipe keeps PP + 1
    = 17 micro-batches of a stage's layers (Table 2): 179,944 x 4096 x 4 x 17 = 50,119,442,432 B of activations,
    + 28.27 GB of weights (bf16, 2 copies), fp32 gradients and ZeRO-1 Adam = 78.39 GB < 80 GB."""
    p = plan.problem("deepseek-v3", None, 2048, 4096, 15360 * 4096, cluster="deepseek-h800", software="deepseek-v3")
    row = p.evaluate_layout(Layout.parse("pp16,dp128,ep64,zero1,mb1"))
    mem = row["memory_per_gpu_bytes"]
    assert mem["activations"] == pytest.approx(179_944 * 4096 * 4 * 17, rel=1e-12)
    assert mem["total"] == pytest.approx(78_389_473_280, rel=1e-9) and mem["total"] < 80e9
    assert row["fits"]
    # the memory savings cost recompute time (MLA up-projection GEMMs, norms, SwiGLU outputs), a small share
    parts = row["step_time_parts_s"]
    assert 0 < parts["recompute"] < 0.03 * row["step_time_s"]
    # without the paper's techniques (bf16 caching, nothing recomputed, a weighting combine) it would not fit
    from trainscale.estimate.planner.software import load_software, with_knobs

    plain = with_knobs(load_software("deepseek-v3"), linear_act_bytes=2.0, attn_out_act_bytes=2.0,
                       swiglu_in_act_bytes=2.0, recompute_norms=False, recompute_mla_up=False,
                       recompute_swiglu_output=False, moe_weighted_combine=True)
    p2 = plan.problem("deepseek-v3", None, 2048, 4096, 15360 * 4096, cluster="deepseek-h800", software=plain)
    assert not p2.evaluate_layout(Layout.parse("pp16,dp128,ep64,zero1,mb1"))["fits"]
    sw = load_software("deepseek-v3")
    assert all(sw.sources[k] for k in ("linear_act_bytes", "attn_out_act_bytes", "swiglu_in_act_bytes",
                                       "recompute_norms", "recompute_mla_up", "recompute_swiglu_output",
                                       "moe_weighted_combine"))


@pytest.mark.parametrize("model,layout,software", [
    ("llama3.1-70b", "tp8,pp4,dp2,zero1,mb1", None),
    ("llama3.1-70b", "tp8,pp2,dp4,zero1,mb1,sp", "torchtitan"),
    ("llama3.1-8b", "dp8,zero1", None),
])
def test_dense_layers_are_counted_from_their_tensors_like_the_moe_mla_ones(model, layout, software):
    """A dense GQA/SwiGLU layer is counted from its tensors as the MoE/MLA ones are (no longer Korthikanti's GPT
    layer): per token on a TP rank, the two norms' inputs and outputs (8h bf16 bytes, sharded under sequence
    parallelism), Q and O (2h each), K and V at the KV width (replicated past the KV heads), the fp32 log-sum-exp
    per local head, and w1, w3 outputs and w2's input (6 d_ff), all /t; no dropout masks."""
    from trainscale.estimate.planner import stage_memory
    from trainscale.estimate.planner.candidates import candidates
    from trainscale.estimate.planner.efficiencies import load_efficiencies
    from trainscale.estimate.planner.software import load_software

    m, lay, seq = load_model(model), Layout.parse(layout), 4096
    t = lay.tp
    norms = 8 * m.d_model / (t if lay.sp and t > 1 else 1)
    kv = max(m.n_kv_heads / t, 1) * m.head_dim
    per_token = norms + (4 * m.d_model + 4 * kv * t + 4 * m.n_heads + 6 * m.d_ff) / t
    cfg = {"tp": [t], "cp": [1], "pp": [lay.pp], "dp": [lay.dp], "mb": [1], "v": [1], "schedule": [1],
           "recompute": [0], "zero": [1], "hsdp": [1], "sp": [lay.sp]}
    c = candidates(m, {k: np.asarray(v) for k, v in cfg.items()}, seq, 2**22 // seq)
    lm = stage_memory.layer_activations(m, c, load_efficiencies("h100-sxm"), load_software(software), seq)
    assert float(lm.korthikanti[0] + lm.moe[0]) == pytest.approx(seq * per_token, rel=1e-12)
