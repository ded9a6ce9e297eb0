"""`trainscale plan --explain-step`, a layout's step kernel by kernel (issue 20). Its items come from the planner's own
evaluation (estimate/planner/breakdown.py reads step.step_parts), so their exposed times must add up to the step
time `plan` prints, for every kind of layout; a collective's bytes are checked against a hand count and against
the time the planner gives it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from trainscale.cli import app
from trainscale.estimate import comms
from trainscale.estimate.planner import breakdown
from trainscale.estimate.planner import plan as planner
from trainscale.estimate.planner.plan import _cfg
from trainscale.estimate.planner.software import load_software, software_names, with_knobs
from trainscale.specs import Layout

# (model, GPUs, seq, software, layout): dense 8B (ZeRO-3; TP without SP under full recompute; hsdp), 70B with
# pp + interleaving, 405B with context parallelism, Mixtral (EP, full recompute), DeepSeek-V3 (EP64, DualPipe, MLA)
LAYOUTS = [
    ("llama3.1-8b", 64, 8192, "trainscale", "tp1,cp1,pp1,dp64,mb1,zero3"),
    ("llama3.1-8b", 64, 8192, "trainscale", "tp2,cp1,pp1,dp32,mb2,zero1,hsdp2,rc=full,nosp"),
    ("llama3.1-8b", 64, 8192, "megatron-core", "tp4,cp1,pp2,dp8,mb1,zero0,rc=selective"),
    ("llama3.1-70b", 1024, 8192, "trainscale", "tp8,cp1,pp8,dp16,mb1,interleaved,v5,zero1,rc=selective"),
    ("llama3.1-405b", 16384, 131072, "trainscale", "tp8,cp16,pp16,dp8,mb1,interleaved,v4,zero1"),
    ("mixtral-8x7b", 256, 4096, "trainscale", "tp2,cp1,pp4,dp32,ep8,mb1,zero1,rc=full"),
    ("deepseek-v3", 2048, 4096, "deepseek-v3", "tp1,cp1,pp16,dp128,ep64,mb1,zero1"),
]
IDS = [f"{m}-{lay.split(',')[0]}-{lay.split(',')[2]}" for m, _, _, _, lay in LAYOUTS]


def _explain(model: str, gpus: int, seq: int, software: str, layout: str) -> tuple[planner.Problem, dict, Any]:
    p = planner.problem(model=model, gpu="h100-sxm", gpus=gpus, seq=seq, global_batch_tokens=2**24, software=software)
    lay = Layout.parse(layout)
    return p, p.evaluate_layout(lay), breakdown.explain_layout(p, lay)



@pytest.mark.parametrize("case", LAYOUTS, ids=IDS)
def test_items_add_up_to_the_step_time_plan_prints(case):
    p, row, bd = _explain(*case)
    step = row["step_time_s"]
    assert bd.total_s == pytest.approx(step, rel=1e-9, abs=0)
    assert bd.step_time_s == pytest.approx(step, rel=1e-12, abs=0)
    # each group of items is the plan's own part of the step (estimate/planner/plan.py STEP_PARTS)
    parts, kinds = row["step_time_parts_s"], {}
    for it in bd.items:
        key = ("tp_comm" if it.name.startswith("TP ") else "cp_comm" if it.name.startswith("CP ")
               else "ep_comm" if it.name.startswith("EP ") else "pipeline_p2p" if it.name.startswith("PP ")
               else "dp_comm" if it.name.startswith(("DP ", "HSDP ")) else "pipeline_bubble" if it.kind == "pipeline"
               else "optimizer" if it.kind == "optimizer" else "compute")
        kinds[key] = kinds.get(key, 0.0) + it.exposed_s
    kinds["compute"] -= parts["recompute"]  # plan prints recomputation apart from the rest of the compute
    for key, v in kinds.items():
        assert v == pytest.approx(parts[key], rel=1e-9, abs=1e-12), key
    cp = row["compute_parts_s"]
    assert bd.item("GEMM forward").time_s + bd.item("GEMM backward").time_s == pytest.approx(cp["gemm"], rel=1e-9)
    assert bd.item("attention forward").time_s + bd.item("attention backward").time_s == \
        pytest.approx(cp["attention"], rel=1e-9)
    recompute = sum(bd.item(n).time_s for n in ("GEMM recompute", "attention recompute", "element-wise recompute",
                                                 "recompute, saving knobs"))
    assert recompute == pytest.approx(parts["recompute"], rel=1e-9, abs=1e-12)
    assert bd.item("GEMM backward").time_s > bd.item("GEMM forward").time_s > 0  # dgrad + wgrad: two GEMMs
    assert bd.item("attention backward").time_s > bd.item("attention forward").time_s > 0
    # FSDP1's (llm-foundry's presets) and FSDP2's (torchtitan's) passes over the parameters only
    assert (bd.item("parameter passes").time_s > 0) == case[3].startswith(("llm-foundry", "torchtitan"))


def test_the_searched_winner_is_explained_as_plan_prints_it():
    p = planner.problem()  # 405B on 16,384 H100s, Llama 3's batch
    res = p.search()
    b = res.best()
    row = p.row(res.cfg, res.res, b)
    bd = breakdown.explain(p, res.cfg, b)
    assert bd.layout == row["layout"]
    assert bd.total_s == pytest.approx(row["step_time_s"], rel=1e-9, abs=0)
    assert bd.micro_batches == row["micro_batches"]


@pytest.mark.parametrize("case", LAYOUTS, ids=IDS)
def test_each_collective_is_exposed_plus_hidden_and_dp_adds_up_to_the_planners_traffic(case):
    p, row, bd = _explain(*case)
    res = p.score(_cfg([Layout.parse(case[4])]))
    coll = [it for it in bd.items if it.kind == "collective"]
    assert coll
    for it in coll:
        assert -1e-12 <= it.exposed_s <= it.time_s * (1 + 1e-12), it.name
        d = it.as_dict()
        assert d["exposed_s"] + d["hidden_s"] == pytest.approx(d["time_s"], rel=1e-12)
        assert it.calls > 0 and it.bytes_per_call > 0, it.name
    dp = [it for it in coll if it.name.startswith(("DP ", "HSDP "))]
    assert sum(it.time_s for it in dp) == pytest.approx(float(res["dp_traffic_s"][0]), rel=1e-9)


def test_tp_all_reduce_bytes_per_layer_are_2bsh_each_way():
    """Megatron TP without SP: an all-reduce after the attention and one after the MLP in the forward (the g
    operator), two more in the backward (f), each of the micro-batch's b x s x h activations (Shoeybi et al. 2019,
    arXiv 1909.08053 Sec. 3 Fig. 3; Korthikanti et al. 2022, arXiv 2205.05198 Sec. 4.2.2: "2 all-reduces in the
    forward pass and 2 all-reduces in the backward pass" per layer). Llama 3.1 8B, h = 4096, s = 8192, b = 2, bf16:
    2 x 2 x 8192 x 4096 x 2 = 268,435,456 bytes per layer per micro-batch forward."""
    lay = "tp8,cp1,pp1,dp8,mb2,zero1,nosp"
    p, row, bd = _explain("llama3.1-8b", 64, 8192, "trainscale", lay)
    tp = bd.item("TP all-reduce")
    micro, layers = row["micro_batches"], 32
    assert micro == 2**24 // 8192 // (8 * 2) == 128
    assert tp.bytes_per_call == 2 * 8192 * 4096 * 2
    per_layer_forward = tp.bytes / (micro * layers) / 2  # forward and backward move the same
    assert per_layer_forward == 2 * 2 * 8192 * 4096 * 2 == 268_435_456
    # and they are the bytes the planner times: ring all-reduces on the 8-GPU NVLink domain
    t = p.topo
    one = comms.all_reduce_time(tp.bytes_per_call, 8, t.scale_up_bandwidth * t.scale_up_efficiency,
                                t.scale_up_latency_s)
    assert tp.time_s == pytest.approx(tp.calls * float(one), rel=1e-9)
    assert tp.hidden_s == pytest.approx(0.0, abs=1e-12)  # the trainscale preset overlaps no TP traffic (eager)


def test_zero1_gradient_reduce_scatter_moves_the_models_fp32_gradients():
    """Llama 3.1 8B has 8,030,261,248 parameters (its Hugging Face safetensors index); without TP or PP each rank
    reduce-scatters all their gradients once a step, in fp32 under the trainscale preset (FSDP2 reduce_dtype)."""
    _, _, bd = _explain("llama3.1-8b", 64, 8192, "trainscale", "tp1,cp1,pp1,dp64,mb1,zero1")
    rs = bd.item("DP reduce-scatter, gradients")
    assert rs.calls == 1 and rs.bytes_per_call == 4 * 8_030_261_248
    assert bd.item("DP all-gather, weights").bytes_per_call == 2 * 8_030_261_248


def test_overlap_moves_time_from_exposed_to_hidden_and_not_the_whole():
    """Half the TP traffic overlapped (a preset's tp_overlap): the collective's whole time is unchanged, half of it
    is hidden, and the step shortens by that half."""
    lay = Layout.parse("tp8,cp1,pp1,dp8,mb2,zero1,nosp")
    p = planner.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=64, seq=8192, global_batch_tokens=2**24)
    half = planner.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=64, seq=8192, global_batch_tokens=2**24,
                           software=with_knobs(load_software("trainscale"), tp_overlap=0.5))
    a, b = breakdown.explain_layout(p, lay), breakdown.explain_layout(half, lay)
    ta, tb = a.item("TP all-reduce"), b.item("TP all-reduce")
    assert tb.time_s == pytest.approx(ta.time_s, rel=1e-12)
    assert tb.hidden_s == pytest.approx(tb.exposed_s, rel=1e-9) == pytest.approx(ta.time_s / 2, rel=1e-9)
    assert a.total_s - b.total_s == pytest.approx(ta.time_s / 2, rel=1e-9)


# ------------------------------------------------------------------ the command


def run(*args: str, columns: int = 80) -> str:
    res = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    return res.output


def test_cli_prints_the_breakdown_at_80_columns_and_its_total_is_the_step():
    out = run("--explain-step")
    assert max(len(line) for line in out.splitlines()) <= 80
    lines = out.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("Step, kernel by kernel"))
    total = next(ln for ln in lines[i:] if ln.strip().startswith("total"))
    exposed = float(total.split()[1].replace(",", ""))
    p = planner.problem()
    res = p.search()
    step = p.row(res.cfg, res.res, res.best())["step_time_s"]
    assert exposed == pytest.approx(step, abs=0.0005)
    assert re.search(rf"step time, {step:,.3f} s", " ".join(lines[i:]))
    for name in ("GEMM forward", "GEMM backward", "attention forward", "TP all-gather (SP)", "pipeline bubble",
                 "PP send/recv", "DP reduce-scatter, gradients", "optimizer step"):
        assert any(ln.startswith(f"  {name}") for ln in lines[i:]), name


def test_cli_json_parses_and_carries_the_breakdown_only_when_asked():
    lay = "tp8,cp1,pp4,dp2,mb1,interleaved,v2,zero1"
    data = json.loads(run("--model", "llama3.1-70b", "--layout", lay, "--explain-step", "--json"))
    ex = data["explain_step"]
    assert ex["layout"] == data["layout"]
    assert ex["total_s"] == pytest.approx(data["step_time_s"], rel=1e-9)
    assert sum(it["exposed_s"] for it in ex["items"]) == pytest.approx(data["step_time_s"], rel=1e-9)
    pp = next(it for it in ex["items"] if it["name"] == "PP send/recv")
    assert pp["bytes"] == pp["calls"] * pp["bytes_per_call"]
    assert pp["algbw_bytes_per_s"] == pytest.approx(pp["bytes"] / pp["time_s"])
    assert "explain_step" not in json.loads(run("--model", "llama3.1-70b", "--layout", lay, "--json"))
    searched = json.loads(run("--model", "llama3.1-8b", "--gpus", "64", "--explain-step", "--json"))
    assert searched["explain_step"]["total_s"] == pytest.approx(searched["step_time_s"], rel=1e-9)


def test_cli_refuses_explain_step_with_a_backwards_question():
    r = subprocess.run([sys.executable, "-m", "trainscale", "plan", "--days", "30", "--tokens", "1T",
                        "--explain-step"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("trainscale: error: --explain-step explains the searched layout")
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_the_breakdown_costs_nothing_unless_asked(monkeypatch):
    """`plan` without --explain-step never builds one (the 405B search stays within its second)."""
    calls = []
    real = breakdown.step_parts
    monkeypatch.setattr(breakdown, "step_parts", lambda *a, **k: calls.append(1) or real(*a, **k))
    run("--gpus", "64", "--model", "llama3.1-8b")
    assert not calls
    run("--gpus", "64", "--model", "llama3.1-8b", "--explain-step")
    assert calls == [1]


@pytest.mark.parametrize("sp", [False, True], ids=["allreduce", "sequence-parallel"])
def test_megatron_hides_each_column_parallel_input_gradient_reduction_under_its_weight_gradient(sp):
    """#20 item 2 (Megatron 2022's linear layers overlap the backward TP collectives): megatron/core/tensor_parallel/
    layers.py LinearWithGradAccumulationAndAsyncCommunication.backward launches the input-gradient all-reduce (or
    reduce-scatter under SP) with async_op=True after the dgrad GEMM and waits after the wgrad GEMM. Per layer and
    micro-batch the backward hides min(collective, dW of Q/K/V) + min(collective, dW of w1/w3), counted here by hand
    from the planner's own GEMM and ring-collective prices; the forward and the other backward collectives stay."""
    from trainscale.estimate.planner import layer

    lay = "tp8,cp1,pp1,dp8,mb2,zero1" + ("" if sp else ",nosp")
    on, row_on, bd_on = _explain("llama3.1-8b", 64, 8192, "megatron-core", lay)
    assert on.software.tp_wgrad_overlap
    off = planner.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=64, seq=8192, global_batch_tokens=2**24,
                          software=with_knobs(load_software("megatron-core"), tp_wgrad_overlap=False))
    row_off, bd_off = off.evaluate_layout(Layout.parse(lay)), breakdown.explain_layout(off, Layout.parse(lay))
    r = layer.rates(on.gpu, on.eff, on.software)
    tokens, d, t = 2 * 8192, 4096, on.topo
    bw, lat = t.scale_up_bandwidth * t.scale_up_efficiency, t.scale_up_latency_s
    act = tokens * d * 2
    one = float(comms.reduce_scatter_time(act, 8, bw, lat) if sp else comms.all_reduce_time(act, 8, bw, lat))

    def dw(k_in: float, n_out: float) -> float:  # dW = X^T dY: (k_in x tokens) @ (tokens x n_out)
        return float(layer.gemm_time(k_in, tokens, n_out, r.f_lay, r.hbm, r.sms, r.gap))

    qkv = dw(d, 4096 / 8) + 2 * dw(d, 128)  # Q sharded 8 ways; 8 K/V heads of 128: one per rank
    up = 2 * dw(d, 14336 / 8)  # w1 and w3
    hidden = min(one, qkv) + min(one, up)
    assert 0 < hidden <= 2 * one
    name = "TP reduce-scatter (SP)" if sp else "TP all-reduce"
    micro_layers = row_on["micro_batches"] * 32
    assert bd_on.item(name).hidden_s == pytest.approx(hidden * micro_layers, rel=1e-9)
    assert bd_off.item(name).hidden_s == pytest.approx(0.0, abs=1e-12)
    assert bd_on.item(name).time_s == pytest.approx(bd_off.item(name).time_s, rel=1e-12)  # the same traffic
    assert row_off["step_time_s"] - row_on["step_time_s"] == pytest.approx(hidden * micro_layers, rel=1e-9)
    assert bd_on.total_s == pytest.approx(row_on["step_time_s"], rel=1e-9)


def test_fsdp1_parameter_passes_cost_each_micro_batch_its_bytes_over_hbm():
    """llm-foundry's FSDP1 (torch 2.1, Composer's mixed_precision DEFAULT: bf16 parameters, fp32 reduction, fp32
    shards) moves, every micro-batch, 18 bytes per unsharded parameter (the flat gradient's concat 2 + 2, its cast to
    fp32 2 + 4, the in-place pre-divide 4 + 4) and 32 per parameter of the rank's shard (the fp32 -> bf16 shard copy
    before the forward's and the backward's all-gather, 2 x (4 + 2); the post-divide 4 + 4; the accumulation 4 + 4 + 4):
    catalog/software.toml's derivation. MPT-125M (12 layers of d 768: 12 d^2 in the linears and two LayerNorms of
    weight + bias, 4 d, each; 50,368 x 768 tied embedding; a final LayerNorm 2 d) on 8 H100s, dp8 zero3, two
    micro-batches of 4: that many bytes at the H100's 3.35 TB/s (catalog/gpus.toml) x the planner's HBM efficiency,
    on each micro-batch of the critical stage."""
    d, layers, vocab, dp, micro = 768, 12, 50368, 8, 2
    params = layers * (12 * d * d + 4 * d) + vocab * d + 2 * d
    assert params == 123_655_680
    per_micro_bytes = (2 + 2 + 2 + 4 + 4 + 4) * params + (2 * (4 + 2) + (4 + 4) + (4 + 4 + 4)) * params / dp
    sw = load_software("llm-foundry-triton")
    assert (sw.microbatch_grad_bytes, sw.microbatch_shard_bytes) == (18, 32)
    lay = Layout.parse("dp8,zero3,mb4")
    on = planner.problem(model="mpt-125m", gpu="h100-sxm", gpus=dp, seq=2048, global_batch_tokens=dp * 4 * 2048 * micro,
                         cluster="dgx-h100", software=sw)
    off = planner.problem(model="mpt-125m", gpu="h100-sxm", gpus=dp, seq=2048,
                          global_batch_tokens=dp * 4 * 2048 * micro, cluster="dgx-h100",
                          software=with_knobs(sw, microbatch_grad_bytes=0.0, microbatch_shard_bytes=0.0))
    hbm = 3.35e12 * on.eff.hbm_efficiency
    assert on.gpu.hbm_bandwidth == 3.35e12
    bd, row = breakdown.explain_layout(on, lay), on.evaluate_layout(lay)
    it = bd.item("parameter passes")
    assert bd.micro_batches == micro and it.counted == breakdown.STAGE
    assert it.per_micro_s == pytest.approx(per_micro_bytes / hbm, rel=1e-12)
    assert it.exposed_s == it.time_s == pytest.approx(micro * per_micro_bytes / hbm, rel=1e-12)
    assert bd.total_s == pytest.approx(row["step_time_s"], rel=1e-9)  # still the step plan prints
    # the whole difference the knobs make to the step (no pipeline: nothing else scales with the stage's time)
    assert row["step_time_s"] - off.evaluate_layout(lay)["step_time_s"] == pytest.approx(
        micro * per_micro_bytes / hbm, rel=1e-9)
    assert breakdown.explain_layout(off, lay).item("parameter passes").time_s == 0.0
    # only llm-foundry's presets (FSDP1 through Composer) and torchtitan's (FSDP2) set them; every other preset's step
    # is as before
    for name in software_names():
        other = load_software(name)
        knobs = (other.microbatch_grad_bytes, other.microbatch_shard_bytes)
        want = (18, 32) if name.startswith("llm-foundry") else (14, 32) if name.startswith("torchtitan") else (0, 0)
        assert knobs == want, name


@pytest.mark.parametrize("preset", ["torchtitan", "torchtitan-2024-04", "torchtitan-compile"])
def test_fsdp2_parameter_copies_cost_each_micro_batch_its_bytes_over_hbm(preset):
    """torchtitan's FSDP2 (fully_shard, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), resharded after
    the forward) moves, every micro-batch, 14 bytes per unsharded parameter (the all-gather copy-out of the bf16
    parameters, 2 + 2, in the forward and again in the backward; the chunk_cat of the bf16 gradients into the fp32
    reduce-scatter input, 2 + 4) and 32 per parameter of the rank's shard (the fp32 -> bf16 cast, 4 + 2, and the copy
    into the all-gather input, 2 + 2, before each of the two all-gathers; the fp32 accumulation 4 + 4 + 4; no divide,
    the fp32 reduce-scatter averages): catalog/software.toml's count from torch's
    _fully_shard/_fsdp_collectives.py.
    Llama 3.1 8B (8,030,261,248 parameters, Meta's model card) on 8 H100s, dp8 zero3, two micro-batches of 1 x 8192
    tokens: that many bytes at the H100's 3.35 TB/s (catalog/gpus.toml) x the planner's HBM efficiency, on each."""
    d, layers, ffn, kv, vocab, dp, micro = 4096, 32, 14336, 1024, 128256, 8, 2
    params = layers * (2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d) + 2 * vocab * d + d
    assert params == 8_030_261_248
    per_micro_bytes = (2 * (2 + 2) + (2 + 4)) * params + (2 * ((4 + 2) + (2 + 2)) + (4 + 4 + 4)) * params / dp
    sw = load_software(preset)
    assert (sw.microbatch_grad_bytes, sw.microbatch_shard_bytes) == (14, 32)
    lay = Layout.parse("tp1,cp1,pp1,dp8,mb1,zero3,rc=selective")
    on = planner.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=dp, seq=8192, global_batch_tokens=dp * 8192 * micro,
                         cluster="dgx-h100", software=sw)
    off = planner.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=dp, seq=8192, global_batch_tokens=dp * 8192 * micro,
                          cluster="dgx-h100",
                          software=with_knobs(sw, microbatch_grad_bytes=0.0, microbatch_shard_bytes=0.0))
    hbm = 3.35e12 * on.eff.hbm_efficiency
    bd, row = breakdown.explain_layout(on, lay), on.evaluate_layout(lay)
    it = bd.item("parameter passes")
    assert bd.micro_batches == micro and it.counted == breakdown.STAGE
    assert it.per_micro_s == pytest.approx(per_micro_bytes / hbm, rel=1e-12)
    assert bd.total_s == pytest.approx(row["step_time_s"], rel=1e-9)
    assert row["step_time_s"] - off.evaluate_layout(lay)["step_time_s"] == pytest.approx(
        micro * per_micro_bytes / hbm, rel=1e-9)


def test_torchtitan_selective_explains_no_attention_recompute():
    """torchtitan's op-level SAC saves the SDPA output (software recompute_attention_core = false): its layout's
    items still add up to the step, with no attention recompute, and the same layout redoing the core (Korthikanti's
    selective) adds exactly that item's time, one attention forward per layer and micro-batch."""
    case = ("llama3.1-8b", 8, 8192, "torchtitan", "tp1,cp1,pp1,dp8,mb2,zero3,rc=selective")
    test_items_add_up_to_the_step_time_plan_prints(case)
    _, _, bd = _explain(*case)
    assert bd.item("attention recompute").time_s == 0.0
    assert bd.item("GEMM recompute").time_s > 0 and bd.item("element-wise recompute").time_s > 0
    p = planner.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=8, seq=8192, global_batch_tokens=2**24,
                        software=with_knobs(load_software("torchtitan"), recompute_attention_core=True))
    redo = breakdown.explain_layout(p, Layout.parse(case[4]))
    assert redo.item("attention recompute").time_s == pytest.approx(bd.item("attention forward").time_s, rel=1e-9)
