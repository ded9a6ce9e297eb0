"""The planner's mixture of experts: compute counted from the active parameters, state from the total, expert
parallelism in the plan and the search, FP8 GEMMs, and the DeepSeek-V3 validation row (issue 14, the planner side).

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
from trainscale.estimate.flops import matmul_params
from trainscale.estimate.planner import plan
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
    p = plan.problem(model="mixtral-8x7b", gpu=None, gpus=8, seq=4096, global_batch_tokens=8 * 4096, cluster="dgx-h100")
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
    p = plan.problem(model="deepseek-v3", gpu=None, gpus=2048, seq=4096, global_batch_tokens=15360 * 4096,
                     cluster="deepseek-h800", software="deepseek-v3")
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
    winner keeps its EP group on NVLink and says so."""
    p = plan.problem(model="mixtral-8x7b", gpu=None, gpus=64, seq=4096, global_batch_tokens=2**22, cluster="dgx-h100")
    s = p.search()
    b = s.best()
    best = p.row(s.cfg, s.res, b)
    assert int(s.cfg["ep"][b]) > 1 and best["ep_in_scale_up"]
    why = " ".join(s.why_best())
    assert "inside one 8-GPU NVLink domain" in why
    # EP ranks are neighbours (Megatron-Core's expert rank order): with TP2 fixed, EP8 is 8 neighbouring ranks, one
    # server, as TP2's pairs are (it spanned 16 GPUs when EP ranks sat tp x cp apart), so every EP of 8 experts stays
    # on NVLink
    p2 = plan.problem(model="mixtral-8x7b", gpu=None, gpus=64, seq=4096, global_batch_tokens=2**22, cluster="dgx-h100",
                      fix="tp=2")
    s2 = p2.search()
    assert bool(s2.res["ep_in_scale_up"].all()) and 8 in set(s2.cfg["ep"].tolist())
    # --fix ep and --forbid ep
    s3 = plan.problem(model="mixtral-8x7b", gpu=None, gpus=64, seq=4096, global_batch_tokens=2**22, cluster="dgx-h100",
                      fix="ep=2").search()
    assert set(s3.cfg["ep"].tolist()) == {2}
    s4 = plan.problem(model="mixtral-8x7b", gpu=None, gpus=64, seq=4096, global_batch_tokens=2**22, cluster="dgx-h100",
                      forbid="ep").search()
    assert set(s4.cfg["ep"].tolist()) == {1}


def test_dense_search_has_no_ep():
    s = plan.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=16, seq=4096, global_batch_tokens=2**20).search()
    assert set(s.cfg["ep"].tolist()) == {1}
    assert "ep_comm" not in plan.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=8, seq=4096,
                                         global_batch_tokens=2**20).evaluate_layout(
        Layout.parse("dp8,zero1"))["step_time_parts_s"]


def test_fp8_gemms_run_faster_and_keep_the_state():
    p16 = plan.problem(model="mixtral-8x7b", gpu=None, gpus=64, seq=4096, global_batch_tokens=2**22, cluster="dgx-h100")
    p8 = plan.problem(model="mixtral-8x7b", gpu=None, gpus=64, seq=4096, global_batch_tokens=2**22, cluster="dgx-h100",
                      precision="fp8")
    lay = Layout.parse("dp64,ep8,zero1,mb1")
    r16, r8 = p16.evaluate_layout(lay), p8.evaluate_layout(lay)
    assert r8["compute_parts_s"]["gemm"] < 0.75 * r16["compute_parts_s"]["gemm"]
    assert r8["memory_per_gpu_bytes"]["optimizer"] == r16["memory_per_gpu_bytes"]["optimizer"]
    assert r8["mfu"] > r16["mfu"]  # MFU stays over the bf16 peak


@pytest.mark.slow
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
        plan.problem(model="llama3.1-8b", gpu="a100-sxm-80gb", gpus=8, seq=4096, global_batch_tokens=2**20,
                     software=with_knobs(sw, precision="fp8"))


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
    The heaviest rank holds two 4-layer chunks (61 layers cut 3, 4 x 14, 2: Megatron-Core's
    --decoder-first/last-pipeline-num-layers 3 / 2, the last rank also running the MTP block) and DualPipe keeps
    PP + 1 = 17 micro-batches of a stage's layers (Table 2): 179,944 x 4096 x 4 x 17 = 50,119,442,432 B of
    activations, + 28.27 GB of weights (bf16, 2 copies), fp32 gradients and ZeRO-1 Adam = 78.39 GB < 80 GB. With
    placement's own cut (3, 4 x 13, 3, 3) the MTP block makes the last rank's 4 MoE layers + head + logits the
    heaviest, 90.0 GB: the uneven cut is what fits."""
    p = plan.problem(model="deepseek-v3", gpu=None, gpus=2048, seq=4096, global_batch_tokens=15360 * 4096,
                     cluster="deepseek-h800", software="deepseek-v3")
    policy = p.evaluate_layout(Layout.parse("pp16,dp128,ep64,zero1,mb1"))
    assert policy["heaviest_stage"] == 15 and not policy["fits"]
    row = p.evaluate_layout(Layout.parse("pp16,dp128,ep64,zero1,mb1,first3,last2"))
    assert row["layers_first_stage"] == 3 and row["layers_max_stage"] == 4 and row["heaviest_stage"] == 1
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
    p2 = plan.problem(model="deepseek-v3", gpu=None, gpus=2048, seq=4096, global_batch_tokens=15360 * 4096,
                      cluster="deepseek-h800", software=plain)
    assert not p2.evaluate_layout(Layout.parse("pp16,dp128,ep64,zero1,mb1,first3,last2"))["fits"]
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


# ----------------------------------------------------------------------------- issue 20 item 7: MoE as people run it


def test_deepseek_v3_ep64_tp2_evaluates_and_expert_bytes_match_a_hand_count():
    """EP across TP x DP ranks (Megatron-Core: world % (expert TP x EP x PP) == 0, parallel_state.py): DeepSeek-V3
    with tp4, pp16, dp32, ep64 on 2,048 H800 (ep64 does not divide dp32; it divides tp x dp = 128), software
    'trainscale' (bf16 weights, fp32 gradients, 12-byte Adam). Hand count, rank 1 (4 MoE layers of 61 on 16
    stages): 256 / 64 = 4 experts per MoE layer, each 3 x 2048 x 7168 = 44,040,192 parameters: 4 x 4 x 44,040,192 =
    704,643,072 expert parameters; their expert-data-parallel group is tp x dp / ep = 4 x 32 / 64 = 2 ranks, over
    which ZeRO-1 shards their Adam state: 1,409,286,144 B of weights, 2,818,572,288 B of gradients, 12 x 704,643,072
    / 2 = 4,227,858,432 B of optimizer state."""
    from trainscale.estimate.planner import dp as dp_mod
    from trainscale.estimate.planner import stages
    from trainscale.estimate.planner.candidates import candidates

    experts = 4 * 4 * 3 * 2048 * 7168
    assert experts == 704_643_072
    p = plan.problem(model="deepseek-v3", gpu=None, gpus=2048, seq=4096, global_batch_tokens=15360 * 4096,
                     cluster="deepseek-h800")
    lay = Layout.parse("tp4,pp16,dp32,ep64,zero1,mb1")
    row = p.evaluate_layout(lay)
    assert row["step_time_s"] > 0 and row["mfu"] > 0 and not row["runnable"]
    assert "ep64 must divide dp32 for this runtime" in p.why_not_runnable(lay)
    c = candidates(p.model, plan._cfg([lay]), 4096, 15360)
    sp = stages.stage_params(p.model, c, stages.dense_layers(p.model, c), p.software)
    assert float(sp.e_crit[0]) == experts and int(dp_mod.n_expert_dp(c)[0]) == 2
    assert row["heaviest_stage"] == 1 and float(sp.e_mid[0]) == experts
    rest = float(sp.mid[0])  # rank 1: attention, norms, router, shared expert of its 4 layers, over tp4
    mem = row["memory_per_gpu_bytes"]
    assert mem["weights"] == pytest.approx(2 * (rest + experts), rel=1e-12)
    assert mem["gradients"] == pytest.approx(4 * (rest + experts), rel=1e-12)
    assert mem["optimizer"] == pytest.approx(12 * (rest / 32 + experts / 2), rel=1e-12)
    assert 12 * experts / 2 == 4_227_858_432
    # and from the command line, tp2 x ep64 (the brief's EP64 x TP2): numbers, not a refusal
    r = CliRunner().invoke(app, ["plan", "--model", "deepseek-v3", "--gpus", "2048", "--cluster", "deepseek-h800",
                                 "--seq", "4096", "--global-batch-tokens", str(15360 * 4096), "--layout",
                                 "tp2,pp16,dp64,ep64,zero1,mb1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    got = out["layouts"][0] if "layouts" in out else out
    assert "ep64" in json.dumps(got) and "step_time_s" in json.dumps(got)


def test_ep_beyond_dp_is_planned_and_marked_not_runnable():
    """Mixtral on 8 GPUs: tp2, dp4, ep8 (ep8 divides tp x dp = 8, not dp4) is a layout the planner prices; the runtime
    refuses it with the ep_in_dp sentence; EP8's neighbouring ranks sit in one 8-GPU NVLink domain."""
    p = plan.problem(model="mixtral-8x7b", gpu=None, gpus=8, seq=4096, global_batch_tokens=8 * 4096, cluster="dgx-h100")
    lay = Layout.parse("tp2,dp4,ep8,zero1,mb1")
    assert p.why_invalid(lay) is None
    row = p.evaluate_layout(lay)
    assert not row["runnable"] and row["ep_in_scale_up"] and row["a2a_per_moe_layer_s"] > 0
    # the expert-data-parallel group is tp x dp / ep = 1: the 8 experts' Adam state is not sharded further
    e_layer = 8 * 3 * 14336 * 4096
    assert row["memory_per_gpu_bytes"]["optimizer"] > 12 * 32 * e_layer / 8 * 0.999
    s = p.search()
    cfg = s.cfg
    beyond = (cfg["dp"] % cfg["ep"]) != 0
    assert beyond.any() and not p.runnable_mask({k: a[beyond] for k, a in cfg.items()}).any()


def test_mtp_counts_apart_in_params_and_in_flops_as_megatron():
    """DeepSeek-V3's one MTP module (Sec. 2.2): a MoE block + M_k (7168 x 14336) + 3 RMSNorms = 11.61B parameters;
    with the checkpoint's copies of the shared embedding and head (2 x 129,280 x 7168) the 685B of the HF card
    (671B main model + 14B MTP). FLOPs per token add its active block, M_k and a second head pass, and one MLA
    attention layer (Megatron-Core training.py num_floating_point_operations)."""
    from trainscale.estimate import params

    m = load_model("deepseek-v3")
    assert m.mtp_layers == 1
    moe_layer = params.layer_params(m, 60)
    assert params.mtp_params(m) == moe_layer + 2 * 7168 * 7168 + 3 * 7168 == 11_610_067_968
    total = params.param_count(m) + params.mtp_params(m) + 2 * 129_280 * 7168
    assert abs(total / 685e9 - 1) < 0.005 and abs(params.param_count(m) / 671e9 - 1) < 0.005
    routed = 256 * 3 * 2048 * 7168
    mtp_active = moe_layer - routed + routed * 8 // 256 + 2 * 7168 * 7168 + 3 * 7168 + 129_280 * 7168
    assert flops.mtp_matmul_params(m) == mtp_active
    attn = 6.0 * 61 * 128 * (192 + 128) * 4096 / 2
    assert flops.training_flops_per_token(m, 4096) == pytest.approx(
        6 * (36_625_603_584 + mtp_active) + attn * 62 / 61, rel=1e-12)
    no_mtp = m.model_copy(update={"mtp_layers": 0})
    assert flops.training_flops_per_token(no_mtp, 4096) == pytest.approx(6 * 36_625_603_584 + attn, rel=1e-12)


def test_uneven_cut_counts_layers_memory_and_time_per_stage():
    """Megatron-Core's --decoder-first/last-pipeline-num-layers (transformer_block.get_num_layers_to_build): Llama
    3.1 70B's 80 layers on pp8 as first 8, last 9 leave 63 layers for 6 ranks (not whole): refused; first 9, last 5
    leave 66 = 6 x 11, so the middle ranks hold 11: the fullest rank, slower than placement's even 10."""
    p = plan.problem(model="llama3.1-70b", gpu="h100-sxm", gpus=64, seq=4096, global_batch_tokens=2**22)
    bad = Layout.parse("tp8,pp8,dp1,mb1,first8,last9")
    assert "leave 63 of 80 layers for 6 other pipeline rank(s)" in p.why_invalid(bad)
    lay = Layout.parse("tp8,pp8,dp1,mb1,first9,last5")
    assert str(Layout.parse(str(lay))) == str(lay) and "first9" in str(lay)
    row = p.evaluate_layout(lay)
    assert (row["layers_first_stage"], row["layers_max_stage"]) == (9, 11) and not row["runnable"]
    even = p.evaluate_layout(Layout.parse("tp8,pp8,dp1,mb1"))  # placement's cut: 10 on every rank
    assert even["layers_max_stage"] == 10
    # the fullest rank sets the pace: 11 layers instead of 10 make the step slower
    assert row["step_time_s"] > even["step_time_s"]
    assert "runtime cuts the pipeline by its own policy" in p.why_not_runnable(lay)
