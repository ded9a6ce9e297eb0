"""The planner's step time and memory from shapes (roofline GEMMs, in-flight micro-batches), software as an input,
and `trainscale validate` against published runs (issue 12)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import resources

import numpy as np
import pytest
from typer.testing import CliRunner

from trainscale.cli import app
from trainscale.errors import TrainscaleError
from trainscale.estimate import flops, memory
from trainscale.estimate.params import param_count
from trainscale.estimate.planner import efficiencies, layer, plan, stage_memory
from trainscale.estimate.planner.intervals import MIN_ROWS, interval_for
from trainscale.estimate.planner.software import load_software, software_names
from trainscale.estimate.planner.validate import (
    FIT_RULE,
    best_candidate,
    catalog_validation,
    convention_flops_per_token,
    fit,
    fitted_constants,
    load_runs,
    validate,
)
from trainscale.specs import Layout, load_gpu, load_model

# ------------------------------------------------------------------ the GEMM roofline


def test_gemm_rate_rises_with_shape_toward_the_roofline():
    g = load_gpu("h100-sxm")
    eff = efficiencies.load_efficiencies("h100-sxm")
    f_mm, hbm = g.peak_bf16_flops * eff.matmul_efficiency, g.hbm_bandwidth * eff.hbm_efficiency
    sizes = np.array([64, 256, 1024, 4096, 16384])
    t = layer.gemm_time(sizes, sizes, sizes, f_mm, hbm, g.sm_count, eff.launch_gap_s)
    rate = 2.0 * sizes**3 / t
    assert np.all(np.diff(rate) > 0)  # achieved FLOP/s grows with the shape...
    assert rate[-1] == pytest.approx(f_mm, rel=0.02) and rate[-1] <= f_mm  # ...up to the sustained ceiling
    assert rate[0] < 0.05 * f_mm  # a tiny GEMM is launch- and memory-bound
    # a partial wave idles SMs: 12 x 11 = 132 tiles fill 132 SMs once; one more column makes 144 tiles, two waves
    one = layer.gemm_time(128 * 12, 8192, 128 * 11, f_mm, hbm, 132)
    two = layer.gemm_time(128 * 12, 8192, 128 * 11 + 1, f_mm, hbm, 132)
    assert two / one == pytest.approx(2.0, rel=0.05)


# ------------------------------------------------------------------ memory on every stage


def test_405b_pp16_llama3_placement_is_judged_by_its_heaviest_stage():
    # 126 layers + embedding + head = 128 slots: stage 0 holds 7 layers, stages 1-14 hold 8. Under 1F1B stage 0
    # keeps 16 micro-batches (7 x 16 = 112 layer-loads), stage 1 keeps 15 (8 x 15 = 120): stage 1 is heavier.
    p = plan.problem(model="llama3.1-405b", gpu="h100-sxm", gpus=16384, seq=8192, global_batch_tokens=2**24,
                     cluster="meta-h100", software="megatron-core")
    r = p.evaluate_layout(Layout.parse("tp8,cp1,pp16,dp128,mb1,zero1"))
    assert r["layers_first_stage"] == 7 and r["layers_max_stage"] == 8
    assert r["heaviest_stage"] == 1
    assert r["memory_per_gpu_bytes"]["total"] > r["memory_first_stage_bytes"]
    assert r["fits"] == (r["memory_per_gpu_bytes"]["total"] <= r["memory_capacity_bytes"])
    # a Llama layer's tensors per token (tests/test_estimate_planner_facts.py): norms 8h, Q and O 4h, K and V 4 x 1024,
    # log-sum-exp 4 x 128, SwiGLU 6 x 53,248; all over tp8 with sequence parallelism
    per_layer = 8192 * (12 * 16384 + 4 * 1024 + 4 * 128 + 6 * 53248) / 8
    assert r["memory_per_gpu_bytes"]["activations"] == pytest.approx(8 * 15 * per_layer)


def test_in_flight_micro_batches_per_schedule():
    # 1F1B: p - r on stage r; interleaved: Megatron's warm-up (p - r - 1) x 2 + (v - 1) x p, + 1, in chunks of 1/v
    assert stage_memory.in_flight(1, 16, 1, 32, np.array([0, 1, 15])).tolist() == [16, 15, 1]
    assert stage_memory.in_flight(2, 16, 8, 32, 0) == pytest.approx((15 * 2 + 7 * 16 + 1) / 8)
    assert stage_memory.in_flight(0, 16, 1, 32, 3) == 32  # GPipe keeps every micro-batch


def test_fp32_main_grads_give_18_bytes_per_param():
    mc = load_software("megatron-core")
    assert mc.grad_bytes == 4 and mc.state_bytes_per_param == 18
    for d in (1, 8, 64):
        # Megatron's distributed optimizer (zero1) shards only Adam's 12 bytes: 6 + 12/d
        st = memory.zero_state_bytes_per_gpu(1.0, d, 1 if d > 1 else 0, grad_bytes=mc.grad_bytes)
        assert st.total == pytest.approx(6 + 12 / d if d > 1 else 18)
    # and the planner charges it: one GPU, no sharding
    m = load_model("llama3.1-8b")
    p = plan.problem(model="llama3.1-8b", gpu="h200", gpus=1, seq=2048, global_batch_tokens=2048,
                     software="megatron-core")
    r = p.evaluate_layout(Layout.parse("tp1,dp1,mb1,rc=full"))
    state = sum(r["memory_per_gpu_bytes"][k] for k in ("weights", "gradients", "optimizer"))
    assert state == pytest.approx(18 * param_count(m))


def test_flash_without_recompute_keeps_no_score_matrices():
    m = load_model("llama3.1-8b")
    s, b, h, a = 8192, 1, m.d_model, m.n_heads
    flash = plan.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=8, seq=s, global_batch_tokens=8 * s,
                         software="torchtitan")
    unfused = plan.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=8, seq=s, global_batch_tokens=8 * s,
                           software="megatron-lm-2021")
    lay = Layout.parse("tp8,dp1,mb1")
    fa, un = flash.evaluate_layout(lay), unfused.evaluate_layout(lay)
    no_scores = memory.activation_bytes_per_layer(s, b, h, a, 8, True, "selective")
    with_scores = memory.activation_bytes_per_layer(s, b, h, a, 8, True, "none")
    # the unfused layer keeps the score terms, and the two 1-byte dropout masks megatron-lm-2021 runs (sbh/t each)
    assert un["memory_per_gpu_bytes"]["activations"] - fa["memory_per_gpu_bytes"]["activations"] == pytest.approx(
        m.n_layers * (with_scores - no_scores + 2 * s * b * h / 8))
    assert with_scores - no_scores == pytest.approx(5 * a * s * s * b / 8)  # Korthikanti's 5as/h term, over t
    # and the unfused kernel is slower: its scores cross HBM and it computes the masked half
    assert un["compute_parts_s"]["attention"] > 2 * fa["compute_parts_s"]["attention"]


def test_tied_embeddings_count_their_lm_head_gemm_and_conventions_are_named():
    m = load_model("mpt-7b")
    assert m.tied_embeddings
    assert flops.matmul_params(m) == param_count(m)  # the embedding lookup is not counted, its GEMM as head is
    p = plan.problem(model="mpt-7b", gpu="h100-sxm", gpus=8, seq=2048, global_batch_tokens=48 * 2048,
                     cluster="dgx-h100", software="llm-foundry")
    r = p.evaluate_layout(Layout.parse("dp8,zero3,mb6"))
    conv = r["mfu_by_convention"]
    assert conv["6N+attention causal"] == pytest.approx(r["mfu"])
    assert conv["6N"] < conv["6N+attention causal"] < conv["6N+attention full"]


# ------------------------------------------------------------------ software and the search


def test_software_presets_are_sourced_and_limit_the_search():
    for name in software_names():
        sw = load_software(name)
        assert sw.source and all(sw.sources[k] for k in ("attention", "grad_bytes", "dp_overlap", "zero"))
    p = plan.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=64, seq=4096, global_batch_tokens=2**22,
                     software="llm-foundry", forbid="zero2",
                     max_v=1)
    s = p.search()
    assert set(s.cfg["zero"][s.cfg["cp"] * s.cfg["dp"] > 1]) == {3}  # FSDP FULL_SHARD only
    assert set(s.cfg["cp"]) == {1} and set(s.cfg["v"]) == {1}
    with pytest.raises(TrainscaleError, match="--forbid does not know"):
        plan.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=64, seq=4096, global_batch_tokens=2**22, forbid="nope")
    with pytest.raises(TrainscaleError, match="--fix takes"):
        plan.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=64, seq=4096, global_batch_tokens=2**22, fix="warp=2")


def test_no_dp_overlap_exposes_the_whole_reduction():
    lay = Layout.parse("tp1,dp64,mb1,zero1,rc=full")
    a = plan.problem(model="llama3.1-8b", gpu="a100-sxm-80gb", gpus=64, seq=4096, global_batch_tokens=64 * 4096,
                     cluster="dgx-a100",
                     software="megatron-lm-2021").evaluate_layout(lay.model_copy(update={"zero": 0}))
    b = plan.problem(model="llama3.1-8b", gpu="a100-sxm-80gb", gpus=64, seq=4096, global_batch_tokens=64 * 4096,
                     cluster="dgx-a100",
                     software="megatron-core").evaluate_layout(lay)
    assert a["step_time_parts_s"]["dp_comm"] > 2 * b["step_time_parts_s"]["dp_comm"]


# ------------------------------------------------------------------ validate


def test_validation_set_is_public_sourced_and_predicted():
    runs = load_runs()
    assert len(runs) >= 40 and len({r.id for r in runs}) == len(runs)
    held_out = ("2104.04473 Table 1", "Korthikanti", "MT-NLG", "DGX Cloud", "Megatron-Core benchmark")
    for r in runs:
        assert r.source and ("Table" in r.source or "table" in r.source or "Sec." in r.source or ".md" in r.source
                             or "README" in r.source), r.id
        assert r.flop_convention and (r.flop_convention_source or r.figure == "gpu_hours"), r.id
        assert not any(h in r.source for h in held_out)
        load_software(r.software)
    # llm-foundry's whole benchmark table, each row naming the README commit and table it comes from
    foundry = [r for r in runs if r.source.startswith("llm-foundry scripts/train/benchmarking/README.md @")]
    assert len(foundry) == 133 and all("table '" in r.source for r in foundry)
    out = validate()
    errs = [abs(r["error"]) for r in out["runs"]]
    assert out["mean_abs_error"] == pytest.approx(sum(errs) / len(errs))
    assert out["worst_abs_error"] == pytest.approx(max(errs))
    # recorded in benchmarks/RESULTS.md (148 rows, catalog constants, attention at the kernels' published curves,
    # the sustained clock on the GEMMs only, zero2's reduce-scatter under the pipeline's next chunks, full
    # recomputation redoing the attention kernel's forward at its published forward share, 1/3.5 at one rate, not
    # 1/3): mean 9.8% (10.2% with 1/3), worst 25.4% (MPT-1B on 512 H100s, predicted fast; MPT-7B at 65,536 tokens on
    # 8 H100s was the worst at -26.0%, now -23.7%). Since full recomputation stops before each block's w2 as torch's
    # non-reentrant checkpoint does (software recompute_early_stop, llm-foundry's and torchtitan's presets): mean 8.7%
    # (the 47 llm-foundry rows with activation checkpointing -14% -> -9%); worst now MPT-30B at 8,192 tokens on 8
    # A100s, predicted fast (+19.6% -> +27.6%; MPT-1B on 512 H100s, +25.4%, unchanged). With the 20 MLPerf Training rows
    # (issue 20; 168 rows): mean 9.4% (the 148 earlier rows unchanged), worst MLPerf v4.0 GPT-3 on 10,752 H100s, -33.8%.
    # With FSDP1's per-micro-batch passes over the parameters (llm-foundry presets: microbatch_grad_bytes 18,
    # microbatch_shard_bytes 32): 9.38% -> 9.46% at the catalog's clock fractions, leave-one-out 10.12% -> 9.24%
    # Since the Megatron-Core presets reduce and gather chunk by chunk under the interleaved schedule (software
    # dp_chunk_sync / dp_chunk_gather, dp.chunk_reduce / chunk_gather): mean 8.5% (the 13 MLPerf GPT-3 rows 17.6% ->
    # 7.2%, v4.0 on 10,752 H100s -33.8% -> -6.9%; the other presets' rows unchanged); worst MPT-30B again, +27.6%
    # Both together (FSDP1's passes and the chunked DP overlap): mean 8.6%, worst MPT-1B on 512 H100s, +23.2%
    # (MPT-30B at 8,192 tokens on 8 A100s, +27.6% before, gains from the per-micro-batch passes)
    # With the Triton kernel's H100 rate FITTED (fa_triton_speed 1.34 x FlashAttention v1's curve) jointly with the
    # hopper clock fraction (0.69 -> 0.65, the worst-|error| rule now bound by MPT-1B on 512 H100s and MLPerf v4.1 on
    # 256): mean 7.1% (the 65 llm-foundry-triton H100 rows 10.2% -> 6.2%), worst MPT-30B at 8,192 tokens on 8 A100s
    # With every FITTED constant fitted to the smallest MEAN |error| (validate.FIT_RULE; hopper clock 0.65 -> 0.71,
    # fa_triton_speed 1.34 -> 1.26, ampere clock 0.82 -> 0.90; benchmarks/RESULTS.md "Fit rule"): mean 7.1% -> 5.8%,
    # worst MPT-30B at 8,192 tokens on 8 A100s, +23.2% -> +31.5% (the ampere clock follows the 59 llm-foundry A100 rows)
    # torchtitan's op-level SAC saves the SDPA output (software recompute_attention_core = false): its four selective
    # H100 rows -1.8% / +1.1% / +1.5% / +4.2% -> +2.3% / +6.2% / +5.7% / +9.3%, the A100 8B +14.0% -> +18.8%, mean
    # 5.82% -> 5.94% (a fact from torchtitan's code, kept although it widens the errors)
    # FSDP2's per-micro-batch copies (torchtitan presets: microbatch_grad_bytes 14, microbatch_shard_bytes 32, counted
    # from torch's _fully_shard/_fsdp_collectives.py): the six torchtitan rows 2.3 to 3.5 points slower, mean 5.94% ->
    # 5.83%, leave-one-out 6.11% -> 6.00%
    # The Triton kernel at head dim 128 no slower than at 64 (it runs 128 x 128 tiles at both, where FlashAttention
    # v1's CUDA kernels halve their key block at 128: catalog/planner.toml [attention.fa-triton]), the FITTED constants
    # refit (hopper clock 0.71 -> 0.70, fa_triton_speed 1.26 -> 1.13, ampere clock 0.90 -> 0.87): mean 5.83% -> 4.93%
    # (the 59 llm-foundry A100 rows 6.3% -> 4.0%), leave-one-out 6.00% -> 5.08%, worst MPT-30B A100 s8192 +32.5%
    assert out["mean_abs_error"] == pytest.approx(0.0490, abs=0.003)
    assert out["worst_run"] == "foundry-30b-a100-s8192-g8-mb1" and out["worst_abs_error"] == pytest.approx(
        0.325, abs=0.005)
    # The MLPerf GPT-3 preset split by round (catalog/software.toml mlperf-nemo-gpt3-v31 / -v40 / -v41, each knob from
    # that round's mlcommons training_results files): v3.1's TE @09ba842 runs flash-attn 2.0.8 before cuDNN (fa2, not
    # cudnn), its NeMo r1.20 keeps 2-byte master remainders (optimizer state 10); v4.0 / v4.1 set FP8_PARAMS=True, so
    # NeMo's distributed Adam all-gathers the GEMM weights as uint8 (fp8_weights): v3.1 rows +3.2..+7.9% ->
    # +1.3..+6.6%, v4.0 on 10,752 H100s -6.2% -> +13.3% (its chunked weight all-gather 0.19 s -> 0.02 s exposed; a fact
    # kept although it widens the error), v4.1 -12.9 / -11.2% -> -12.8 / -11.0%; mean 4.93% -> 4.94%. The MLPerf v5.0
    # Llama 3.1 presets gather FP8 weights too (FP8_PARAMS=True -> fp8_param_gather), and the hopper constants refit
    # (clock 0.70 -> 0.69, fa_triton_speed 1.13 -> 1.14): mean 4.90%, leave-one-out 5.21%, v4.0 on 10,752 +11.9%
    assert by_id_error(out, "mlperf-v40-gpt3-h100x10752") == pytest.approx(0.119, abs=0.005)
    by_id = {r["id"]: r for r in out["runs"]}
    # DeepSeek-V3 with its MTP module on the last rank, cut first3,last2 (61 layers + embedding + MTP + loss = 16 x 4
    # units, as Megatron-Core splits DeepSeek-V3; catalog/runs.toml's note): +1.6%. placement's default cut would put
    # 90 GB on rank 15 (no fit) and predict -8.9%. -2.6% at the hopper clock fraction refit with fa_triton_speed;
    # +3.6% at the mean-|error| fit (0.71), +2.6% at 0.70
    # +1.6% at 0.69
    assert by_id["deepseek-v3-h800x2048"]["error"] == pytest.approx(0.016, abs=0.005)
    # MLPerf v5.0 Llama 3.1 405B on Nebius's H200s (TP4): -10.6% / -10.3% at the hopper constants; -7.7% / -7.3% with
    # the H200's FP8 GEMM rate over the H100's from one published MAMF table (catalog/planner.toml [gpu.h200]) and the
    # run's own TP4 userbuffers config (software mlperf-nemo-llama31-tp4, comm_sms 1); NVIDIA's five H100 rows (TP8)
    # -4.2% to +3.4%. What is left is not explained by a published figure (TP4's larger GEMMs are not modelled).
    # With the benchmark's own vocabulary (model llama3.1-405b-mlperf: the Mixtral 8x22B tokenizer, padded to 32,256
    # as every run log prints): -7.4% / -7.0% (the H100 rows' critical stage holds no output head: unchanged);
    # -8.5% / -8.0% at the hopper clock 0.69
    assert by_id["mlperf-v50-llama31-405b-h200x512"]["error"] == pytest.approx(-0.085, abs=0.005)
    assert by_id["mlperf-v50-llama31-405b-h200x1024"]["error"] == pytest.approx(-0.080, abs=0.005)
    assert {r["model"] for r in out["runs"] if r["id"].startswith("mlperf-v50-")} == {"llama3.1-405b-mlperf"}
    # torchtitan's A100 8B row (selective recompute redoes the attention core): +5.9% -> +6.6% since the recomputed
    # FlashAttention-2 forward costs 1/3.5 of the kernel's time, not 1/3 (layer.forward_share)
    # torchtitan's A100 rows +2.7% / +6.6% at the ampere clock 0.82; +11.1% / +14.0% at the mean-|error| fit (0.90),
    # which the 59 llm-foundry A100 rows set
    assert abs(by_id["deepseek-v3-h800x2048"]["error"]) < 0.06
    # torchtitan @157a12c5 wraps each block for full recompute in the non-reentrant checkpoint, so torch's early stop
    # applies (software recompute_early_stop, as the later torchtitan preset): the 70B row +11.1% -> +17.9%, the
    # leave-one-out mean 5.94% -> 5.99% (a fact from the code, kept although it widens the A100 split)
    # (+14.5% with FSDP2's copies; +11.4% at the ampere clock 0.87)
    assert by_id["titan-70b-a100x64"]["error"] == pytest.approx(0.114, abs=0.005)
    # -1.8% redoing the attention core; +2.3% saving it; -0.4% with FSDP2's copies (+9.3% -> +6.6% compiled, 128 GPUs);
    # -1.2% / +5.6% at the hopper clock 0.70
    # -2.0% / +4.5% at 0.69
    assert by_id["titan-8b-h100x8"]["error"] == pytest.approx(-0.020, abs=0.005)
    assert by_id["titan-8b-h100x128-compile"]["error"] == pytest.approx(0.045, abs=0.005)
    # MPT-7B on 8 H100s (llm-foundry's table, one micro-batch of 6): -5.3% -> -9.4% at the catalog's Hopper clock
    # fraction once each micro-batch pays FSDP1's 18 + 32 / 8 bytes per parameter in HBM (stages.param_pass_time); its
    # leave-one-out error, the clock refit on the other rows, -0.4% -> -3.3%; -4.1% at the mean-|error| fit (0.71);
    # -3.7% with the Triton kernel's head-128 rate at its head-64 curve (0.70, fa_triton_speed 1.13)
    # -4.5% at 0.69 / 1.14
    assert by_id["mpt-7b-h100x8"]["error"] == pytest.approx(-0.045, abs=0.005)
    # +14.0% redoing the attention core, +18.8% saving it, +15.2% with FSDP2's copies, +12.4% at the ampere clock 0.87
    assert by_id["titan-8b-a100x64"]["error"] == pytest.approx(0.124, abs=0.005)
    # Llama 3 Table 4 at 8K as the paper shards it (zero2, Sec. 3.3.2): -2.7% and -3.0%, each micro-batch's
    # gradients reduce-scattered on FSDP2's own stream under the stage's next forward and backward chunk
    # (dp.zero2_window); -21% while the model hid each only under its own micro-batch's backward; -7.1% and -7.2% at
    # the hopper clock fraction refit jointly with fa_triton_speed (0.69 -> 0.65); -0.6% and -1.0% at 0.71; -1.7% and
    # -2.0% at 0.70
    # -2.8% and -3.0% at 0.69
    assert by_id["llama3-405b-8k-8192"]["error"] == pytest.approx(-0.028, abs=0.005)
    assert by_id["llama3-405b-8k-16384"]["error"] == pytest.approx(-0.030, abs=0.005)
    # Llama 3 Table 4 at 128K: +6.8% read with torchtitan's convention, -23.8% with causal halving (the attention
    # kernel at a CP rank's shapes, seq / cp = 8K: layer.cp_kernel_seq; it was +10.5% / -21.2% at the 16K plateau);
    # +4.5% / -25.5% at the hopper clock fraction 0.65; +7.9% / -23.0% at 0.71; +7.4% / -23.4% at 0.70
    l128 = by_id["llama3-405b-128k-16384"]
    # +6.8% / -23.8% at 0.69
    assert l128["error"] == pytest.approx(0.068, abs=0.005)
    assert l128["alt_convention"]["flop_convention"] == "trainscale"
    assert l128["alt_convention"]["error"] == pytest.approx(-0.238, abs=0.005)
    gens = {r["generation"] for r in out["runs"]}
    assert gens == {"hopper", "ampere"}
    # peak memory where the source publishes it (torchtitan's H100 tables): the heaviest stage within 6%
    mem = [r for r in out["runs"] if r["published_memory_gib"]]
    assert len(mem) == 4 and all(abs(r["memory_error"]) < 0.06 for r in mem)


def by_id_error(out: dict, run_id: str) -> float:
    return next(r["error"] for r in out["runs"] if r["id"] == run_id)


def test_each_source_flop_convention_reproduces_its_own_mfu():
    # a published MFU recomputed from the published throughput with the source's own formula: torchtitan's A100
    # table (6N with embeddings + 12·L·H·Q·T: 58.2%, 51.7%), llm-foundry's (6·NumParams + 12·L·d·s, every BF16 row of
    # its H100 and A100 tables), BLOOM's 150 TFLOP/s (Narayanan Eq. 3 at 105 s per iteration), Llama 3's TFLOP/s vs MFU
    out = validate()
    checked = [r for r in out["runs"] if r["published_mfu"] is not None]
    assert len(checked) == 9 + 126  # + every BF16 row of llm-foundry's tables (its FP8 rows divide by the FP8 peak)
    for r in checked:
        assert r["mfu_from_convention"] == pytest.approx(r["published_mfu"], abs=0.006), r["id"]
    by_id = {r["id"]: r for r in out["runs"]}
    assert by_id["titan-8b-a100x64"]["mfu_from_convention"] == pytest.approx(0.582, abs=0.0005)
    assert by_id["mpt-7b-h100x8"]["mfu_from_convention"] == pytest.approx(0.4644, abs=0.0005)
    # llm-foundry A100 80GB, 30b at seq 8192: 574 T/s/GPU x (6 x 30,019,254,272 + 12·48·7168·8192) / 312e12 = 39.38%
    assert by_id["foundry-30b-a100-s8192-g8-mb1"]["mfu_from_convention"] == pytest.approx(0.3938, abs=0.0005)
    # the conventions differ where they should: no causal halving makes 128K attention count twice
    m = load_model("llama3.1-405b")
    tt, ts = (convention_flops_per_token(c, m, 131072) for c in ("torchtitan", "trainscale"))
    assert tt / ts == pytest.approx(1.40, abs=0.01)
    with pytest.raises(TrainscaleError, match="unknown flop_convention"):
        convention_flops_per_token("nope", m, 8192)


# ------------------------------------------------------------------ leave-one-out and intervals


def _runs_file(tmp_path, ids):
    """A runs file holding the catalog's [[run]] tables of ``ids`` (their text, unchanged)."""
    text = (resources.files("trainscale.catalog") / "runs.toml").read_text()
    blocks = ["[[run]]" + b for b in text.split("[[run]]")[1:]]
    keep = [b for b in blocks if any(f'id = "{i}"' in b for i in ids)]
    assert len(keep) == len(ids)
    path = tmp_path / "runs.toml"
    path.write_text("\n".join(b.split("\n# ----")[0] for b in keep))
    return path


FEW = ("titan-8b-h100x8", "titan-8b-h100x128", "mpt-7b-h100x8", "foundry-3b-h100-s2048-g16-mb10",
       "foundry-13b-h100-s4096-g8-mb10", "titan-8b-a100x64", "titan-70b-a100x64")


def test_loo_refits_the_fitted_constant_without_the_row(tmp_path):
    fitted = fitted_constants()
    # catalog/planner.toml: FITTED per generation; the Triton kernel's H100 factor on hopper only
    assert {(f.key, f.scope) for f in fitted} == {("sustained_clock_fraction", "hopper"), ("fa_triton_speed", "hopper"),
                                                  ("sustained_clock_fraction", "ampere")}
    out = validate(_runs_file(tmp_path, FEW), loo=True)
    rows = {r["id"]: r for r in out["runs"]}
    # the fit on every row differs from the fit without one, so the row's two errors differ
    assert any(abs(r["loo_error"] - r["in_sample_error"]) > 1e-4 for r in rows.values())
    assert out["loo"]["mean_abs_error"] >= out["in_sample"]["mean_abs_error"] - 1e-9
    # leaving a row out IS refitting on the others: the same fit as a file without that row
    rest = validate(_runs_file(tmp_path, [i for i in FEW if i != "mpt-7b-h100x8"]), loo=True)
    hopper = {f["key"]: f for f in rest["fit"] if f["scope"] == "hopper"}
    assert rows["mpt-7b-h100x8"]["loo_fit"] == {f"{k}[hopper]": f["fit_all_rows"] for k, f in hopper.items()}
    assert hopper["sustained_clock_fraction"]["rows"] == hopper["fa_triton_speed"]["rows"] == 4
    # the Triton kernel's factor moves the llm-foundry-triton rows only (not torchtitan's two)
    assert hopper["sustained_clock_fraction"]["rows_moved"] == 4 and hopper["fa_triton_speed"]["rows_moved"] == 2
    # ...and that fit is the one ``fit`` gives on those rows alone (one rule, the in-sample fit and every fold)
    again = fit(*_table_args(tmp_path, [i for i in FEW if i != "mpt-7b-h100x8"]))
    assert {f.key: v for f, v in again.items() if f.scope == "hopper"} == pytest.approx(
        {k: f["fit_all_rows"] for k, f in hopper.items()})


def test_fit_rule_is_the_smallest_mean_ties_to_the_smaller_worst():
    # candidates as columns, |error| per row: the smallest mean wins even with a larger worst (column 1 over 0); equal
    # means go to the smaller worst (column 2 over 1), and so do means within 1e-8 (column 0 over 1 below)
    err = np.array([[0.10, 0.20, 0.05], [0.10, 0.00, 0.05], [0.10, 0.00, 0.10]])
    assert best_candidate(err) == 2 and best_candidate(err[:, :2]) == 1
    assert best_candidate(np.array([[0.10, 0.20 - 2e-8], [0.10, 0.00]])) == 0


def test_joint_fit_beats_every_pair_of_the_grid_it_interpolates(tmp_path):
    # the hopper pair (sustained_clock_fraction, fa_triton_speed) fitted together: no pair of the nodes, predicted
    # exactly, has a smaller mean |error| on the same rows than the fitted pair, predicted exactly (the fit
    # interpolates between the nodes, so it may miss the true optimum by the interpolation's error, ~0.1%)
    from trainscale.estimate.planner.validate import FIT_NODES_JOINT, load_runs, predict
    ids = [i for i in FEW if "h100" in i]
    runs = load_runs(_runs_file(tmp_path, ids))
    pub = [predict(r)["published_tokens_per_s_per_gpu"] for r in runs]
    got = {f.key: v for f, v in fit(*_table_args(tmp_path, ids)).items() if f.scope == "hopper"}

    def mean(c: float, k: float) -> float:
        over = {"sustained_clock_fraction": c, "fa_triton_speed": k}
        return float(np.mean([abs(predict(r, over)["predicted_tokens_per_s_per_gpu"] / p - 1)
                              for r, p in zip(runs, pub, strict=True)]))

    best = mean(got["sustained_clock_fraction"], got["fa_triton_speed"])
    cat = {f.key: f.catalog_value for f in fitted_constants() if f.scope == "hopper"}
    grid = [mean(cat["sustained_clock_fraction"] * a, cat["fa_triton_speed"] * b)
            for a in FIT_NODES_JOINT for b in FIT_NODES_JOINT]
    assert best <= min(grid) + 0.002
    # and fitting the clock alone (the factor fixed at 1, FlashAttention v1's curve as it was) does worse
    alone = validate(_runs_file(tmp_path, ids), {"fa_triton_speed": 1.0}, loo=True)
    assert [(f["key"], f["scope"]) for f in alone["fit"]] == [("sustained_clock_fraction", "hopper"),
                                                              ("sustained_clock_fraction", "ampere")]
    assert best < alone["in_sample"]["mean_abs_error"]


def _table_args(tmp_path, ids):
    from trainscale.estimate.planner.validate import fit_table, load_runs, predict
    runs = load_runs(_runs_file(tmp_path, ids))
    rows = [predict(r) for r in runs]
    return runs, [r["published_tokens_per_s_per_gpu"] for r in rows], fit_table(runs, [r["generation"] for r in rows])


def test_loo_equals_in_sample_when_nothing_is_fitted(tmp_path):
    # a constant set on the command line is fixed, not fitted: nothing left to refit
    fixed = {"sustained_clock_fraction": 0.76, "fa_triton_speed": 1.0}
    assert fitted_constants(fixed) == []
    out = validate(_runs_file(tmp_path, FEW), fixed, loo=True)
    assert out["fit"] == []
    for r in out["runs"]:
        assert r["loo_error"] == r["in_sample_error"] == r["error"]
    assert out["loo"] == out["in_sample"]


@pytest.mark.slow
def test_intervals_contain_the_estimate_and_widen_with_fewer_rows():
    # the rule on known residuals: 5 rows of one software/generation -> their range, as time factors 1 + e
    rows = [("a", "hopper", e) for e in (-0.10, 0.05, 0.02, -0.03, 0.0)] + [("b", "hopper", 0.2), ("b", "ampere", -0.3)]
    iv = interval_for("a", "hopper", rows)
    assert (iv.lo, iv.hi, iv.n_rows) == (pytest.approx(0.90), pytest.approx(1.05), 5)
    assert iv.apply(100.0) == (pytest.approx(90.0), pytest.approx(105.0))
    assert iv.apply_throughput(100.0) == (pytest.approx(100 / 1.05), pytest.approx(100 / 0.90))
    # four rows of "a": pooled over the generation (5 hopper rows), widened 1.5x -> wider
    fewer = interval_for("a", "hopper", rows[1:])
    assert fewer.n_rows == 5 and "any software" in fewer.basis
    assert (fewer.lo, fewer.hi) == (pytest.approx(1 - 1.5 * 0.03), pytest.approx(1 + 1.5 * 0.2))
    assert fewer.hi - fewer.lo > iv.hi - iv.lo
    # no row of the generation: every row, widened 2x
    none = interval_for("a", "blackwell", rows)
    assert none.n_rows == 7 and (none.lo, none.hi) == (pytest.approx(1 - 2 * 0.3), pytest.approx(1 + 2 * 0.2))
    # from the catalog: the leave-one-out errors of the rows of that software and generation
    cat = interval_for("llm-foundry-triton", "hopper")
    loo = [r["loo_error"] for r in catalog_validation()["runs"]
           if (r["software"], r["generation"]) == ("llm-foundry-triton", "hopper")]
    assert cat.n_rows == len(loo) >= MIN_ROWS
    assert (cat.lo, cat.hi) == (pytest.approx(1 + min(loo)), pytest.approx(1 + max(loo)))
    lo, hi = cat.apply(3600.0)
    assert lo <= 3600.0 <= hi
    # a software with one catalog row falls back to its generation's rows, widened: wider than its own band
    bloom = interval_for("megatron-deepspeed", "ampere")
    assert bloom.n_rows > 1 and bloom.lo <= 1 <= bloom.hi and "any software" in bloom.basis


def test_kernel_and_norm_knobs_come_from_the_rows_software():
    # llm-foundry's attn_impl triton (the FA1-era Triton kernel, as fast as FlashAttention v1 by its docstring) against
    # attn_impl flash (flash-attn 2.4.2): at 2k tokens and head dim 128 on an H100 the published curves give FA2 265
    # and FA1 108 TFLOP/s (flash2_h100_fwd_bwd_benchmark.png (d)), and the Triton kernel runs at FA1's x the FITTED
    # fa_triton_speed (1.14 on hopper); the Triton kernel's head-128 column is v1's head-64 one (136 at 2k: it tiles
    # 128 x 128 at both head dims), so the Triton rows' attention takes 265 / (136 x 1.14) as long
    fa2, tri = (plan.problem(model="mpt-7b", gpu="h100-sxm", gpus=8, seq=2048, global_batch_tokens=48 * 2048,
                             cluster="dgx-h100", software=s)
                .evaluate_layout(Layout.parse("dp8,zero3,mb6")) for s in ("llm-foundry", "llm-foundry-triton"))
    assert tri["compute_parts_s"]["attention"] == pytest.approx(
        265 / (136 * 1.14) * fa2["compute_parts_s"]["attention"])
    # on an A100 the factor is 1 ([defaults]: not fitted there): FA2 155 at 2k, head dim 128 (Fig. 4 (d)) against FA1's
    # head-64 77 (Fig. 4 (c))
    fa2, tri = (plan.problem(model="mpt-7b", gpu="a100-sxm-80gb", gpus=8, seq=2048, global_batch_tokens=48 * 2048,
                             software=s)
                .evaluate_layout(Layout.parse("dp8,zero3,mb6")) for s in ("llm-foundry", "llm-foundry-triton"))
    assert tri["compute_parts_s"]["attention"] == pytest.approx(155 / 77 * fa2["compute_parts_s"]["attention"])
    assert tri["compute_parts_s"]["gemm"] == pytest.approx(fa2["compute_parts_s"]["gemm"])
    # torchtitan's April 2024 configs ran the Triton fused RMSNorm: 28 element-wise passes per layer, not 60
    assert load_software("torchtitan-2024-04").elementwise_passes == 28
    assert load_software("torchtitan").elementwise_passes == 60


@pytest.mark.slow
def test_cli_validate_json_and_bad_input(tmp_path):
    res = CliRunner().invoke(app, ["validate", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert {"runs", "mean_abs_error", "worst_abs_error", "fitted", "loo"} <= set(out)  # the catalog's: with its LOO
    res = CliRunner().invoke(app, ["validate"])  # #20: a FITTED constant is never shown without its LOO figure
    assert res.exit_code == 0 and "leave-one-out (fit without the row): mean |error|" in res.output
    line = " ".join(res.output.split())
    assert f"Fitted (rule: {FIT_RULE}): sustained_clock_fraction" in line and "LOO" not in line  # no per-row columns
    # the Triton kernel's H100 factor, fitted with the hopper clock: its in-sample and leave-one-out values, and the 65
    # llm-foundry-triton H100 rows it moves of hopper's 105
    assert re.search(r"fa_triton_speed \(hopper\) catalog 1\.14, refit on its 105 rows \(65 moved by it\) in-sample "
                     r"1\.1\d\d, leave-one-out 1\.\d{3}-1\.\d{3}", line), line
    tri = next(f for f in out["fit"] if f["key"] == "fa_triton_speed")
    assert tri["rows_moved"] == sum((r["software"], r["generation"]) == ("llm-foundry-triton", "hopper")
                                    for r in out["runs"])
    assert tri["loo_min"] <= tri["fit_all_rows"] <= tri["loo_max"]
    # the catalog holds the in-sample fit, rounded as catalog/planner.toml writes it (its source line says so)
    assert out["fit_rule"] == FIT_RULE and len(out["fit"]) == 3
    assert all(f["catalog"] == pytest.approx(round(f["fit_all_rows"], 2)) for f in out["fit"]), out["fit"]
    res = CliRunner().invoke(app, ["validate", "--loo", "--runs", str(_runs_file(tmp_path, FEW[:3]))])
    assert res.exit_code == 0, res.output
    assert "leave-one-out (fit without the row): mean |error|" in res.output and "LOO" in res.output
    r = subprocess.run([sys.executable, "-m", "trainscale", "plan", "--model", "llama3.1-8b", "--gpus", "8",
                        "--forbid", "warp"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


# ------------------------------------------------------------------ models from their own files


def test_hf_config_read_by_model_type(tmp_path):
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "vocab_size": 50257,
            "n_positions": 1024, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    m = load_model(tmp_path / "config.json")
    assert (m.mlp, m.norm, m.positions, m.tied_embeddings, m.bias, m.d_ff) == ("gelu", "layernorm", "learned",
                                                                              True, True, 3072)
    assert param_count(m) == 124_439_808  # GPT-2 small, as transformers counts it
    (tmp_path / "config.json").write_text(json.dumps({**gpt2, "model_type": "t5"}))
    with pytest.raises(TrainscaleError, match="model_type 't5'"):
        load_model(tmp_path / "config.json")
