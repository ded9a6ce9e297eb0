"""The planner's model read from the kernels, papers and recipes it cites: each test holds one figure against a
count made by hand from the cited source (issue 20)."""

from __future__ import annotations

import tomllib
from importlib import resources

import numpy as np
import pytest

from trainscale.estimate.planner import layer, plan
from trainscale.estimate.planner.candidates import candidates
from trainscale.estimate.planner.efficiencies import attention_curve, load_efficiencies
from trainscale.estimate.planner.software import load_software
from trainscale.specs import Layout, load_gpu, load_model


def _cands(model: str, layout: str, seq: int, global_seqs: int):  # type: ignore[no-untyped-def]
    lay = Layout.parse(layout)
    cfg = {"tp": [lay.tp], "cp": [lay.cp], "pp": [lay.pp], "dp": [lay.dp], "mb": [lay.mb], "v": [lay.v],
           "schedule": [0], "recompute": [0], "zero": [lay.zero], "hsdp": [1], "sp": [True]}
    return candidates(load_model(model), {k: np.asarray(v) for k, v in cfg.items()}, seq, global_seqs)


def test_unfused_attention_moves_the_scores_beyond_its_gemms_as_megatrons_kernels_do():
    # BLOOM-176B (112 heads) at tp4, seq 2048, micro-batch 2: the score tensor on one rank is 2 x 28 x 2048 x 2048
    # bf16 = 469,762,048 bytes. Megatron's FusedScaleMaskSoftmax reads the scores and writes the probabilities
    # (2 passes); torch dropout reads them, writes the dropped ones and a 1-byte mask (2.5); the QK^T and AV
    # bmm's own reads and writes are in their GEMM rooflines. Backward: dropout (grad in, mask in, grad out: 2.5),
    # softmax backward (grad and saved probabilities in, grad out: 3).
    m = load_model("bloom-176b")
    c = _cands("bloom-176b", "tp4,pp1,dp1,mb2", 2048, 2)
    score = 2 * (112 // 4) * 2048 * 2048 * 2
    assert score == 469_762_048
    fwd, bwd = layer.unfused_score_bytes(m, c, 2048)
    assert float(fwd[0]) == pytest.approx(4.5 * score) and float(bwd[0]) == pytest.approx(5.5 * score)


def test_fits_is_judged_against_what_the_driver_reports_less_the_stated_reserve():
    # torch reports 81,082 MiB on an "80 GB" H100 (catalog/gpus.toml usable_bytes); the reserve is the CUDA context
    # with lazy loading (287,047,680 B, PyTorch PR #86509) + NCCL buffers (3 communicators x 16 channels x 2
    # connections x 4 MiB = 402,653,184 B): catalog/planner.toml.
    from trainscale.estimate.planner.efficiencies import load_efficiencies
    from trainscale.estimate.planner.step import memory_capacity
    from trainscale.specs import load_gpu
    gpu, eff = load_gpu("h100-sxm"), load_efficiencies("h100-sxm")
    assert gpu.capacity_bytes == 81_082 * 2**20
    assert eff.memory_reserve_bytes == 287_047_680 + 3 * 16 * 2 * 4 * 2**20
    assert memory_capacity(gpu, eff) == pytest.approx(85_020_639_232 - 689_700_864)
    p = _llama3_problem(8192)
    r = p.score(_cfg("tp8,cp1,pp16,dp64,mb1,v8,zero2"))
    total = float(r["mem_total"][0])
    assert 80e9 < total < memory_capacity(gpu, eff) and bool(r["fits"][0])  # over the datasheet's 80e9, and fits
    assert float(r["headroom"][0]) == pytest.approx(memory_capacity(gpu, eff) - total)


def _llama3_problem(gpus: int, seq: int = 8192):  # type: ignore[no-untyped-def]
    from trainscale.estimate.planner import plan
    return plan.problem(model="llama3.1-405b", gpu="h100-sxm", gpus=gpus, seq=seq, global_batch_tokens=2**24,
                        software="meta-llama3", cluster="meta-h100")


def _cfg(layout: str):  # type: ignore[no-untyped-def]
    from trainscale.estimate.planner import plan
    return plan._cfg([Layout.parse(layout)])


@pytest.mark.parametrize("gpus,layout,seq", [(8192, "tp8,cp1,pp16,dp64,mb1,v8", 8192),
                                             (16384, "tp8,cp1,pp16,dp128,mb1,v8", 8192),
                                             (16384, "tp8,cp16,pp16,dp8,mb1,v8", 131072)])
def test_llama3_table4_layouts_fit_an_80gb_h100_as_the_paper_shards_them(gpus: int, layout: str, seq: int):
    # Llama 3 (arXiv 2407.21783) Table 4's three layouts ran on 80 GB H100s without activation checkpointing
    # (Sec. 3.3.2). Counted from a Llama layer's tensors (GQA K/V, SwiGLU, no dropout), with one transformer layer
    # fewer on the first and last stage (Sec. 3.3.2), and the gradients sharded as Sec. 3.3.2 says FSDP does ("we
    # use FSDP to shard the optimizer states and gradients"; reduce-scattered in FP32, Sec. 3.3.4): ZeRO-2 here.
    # With the gradients held whole (zero1: 12.75 GB of fp32 gradients per GPU) the same layouts need 88-95 GB.
    r = _llama3_problem(gpus, seq).score(_cfg(layout + ",zero2"))
    assert bool(r["fits"][0]) and bool(r["balanced_ends"][0])
    assert float(r["mem_gradients"][0]) < 0.25e9  # 3.19e9 params per GPU x 4 B over dp >= 64
    r1 = _llama3_problem(gpus, seq).score(_cfg(layout + ",zero1"))
    assert float(r1["mem_gradients"][0]) == pytest.approx(4 * float(r1["params_per_gpu"][0]))


def test_a_llama_layer_keeps_its_own_tensors_not_a_gpt_layers():
    # Llama 3.1 405B at tp8 with sequence parallelism, one 8,192-token micro-batch, flash attention, no dropout:
    # per token on a rank the layer keeps the attention norm's input and output (2 x 2h/8), Q (2h/8), K and V
    # (2 x 2 x 1024/8: 8 KV heads of 128 over 8 ranks), the output O (2h/8) and fp32 log-sum-exp (4 x 128/8
    # heads), the FFN norm's input and output (2 x 2h/8), w1 and w3 outputs and w2's input (3 x 2 x 53,248/8).
    from trainscale.estimate.planner import stage_memory
    from trainscale.estimate.planner.efficiencies import load_efficiencies
    from trainscale.estimate.planner.software import load_software
    h, ff, kv = 16384, 53248, 1024
    per_token = (4 * h + 2 * h + 4 * kv + 2 * h + 4 * 128 + 4 * h + 6 * ff) / 8
    m = load_model("llama3.1-405b")
    c = _cands("llama3.1-405b", "tp8,pp16,dp64,mb1", 8192, 2048)
    lm = stage_memory.layer_activations(m, c, load_efficiencies("h100-sxm"), load_software("meta-llama3"), 8192)
    assert float(lm.korthikanti[0] + lm.moe[0]) == pytest.approx(8192 * per_token)


def test_fused_attention_runs_at_its_published_curve_in_its_own_flop_count():
    # Llama 3.1 8B (32 heads x 128) on one H100 SXM, one 8,192-token sequence, FlashAttention-2 (software
    # 'trainscale': SDPA's flash backend). Dao-AILab/flash-attention's H100 figure (flash2_h100_fwd_bwd_benchmark.png,
    # causal, head dim 128): 308 TFLOP/s at 8k, counted as benchmark_flash_attention.py flops() does: forward
    # 4·s²·heads·d / 2 (causal), forward + backward 3.5 x that. Per layer: 3.5 x 2 x 8192² x 32 x 128 FLOPs / 308e12.
    p = plan.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=8, seq=8192, global_batch_tokens=8 * 8192)
    c = _cands("llama3.1-8b", "dp8,mb1", 8192, 8)
    r = layer.rates(p.gpu, p.eff, p.software)
    assert r.attn is not None and (r.attn.kernel, r.attn.generation) == ("fa2", "hopper")
    t_attn, t_fwd = layer.attention_core(p.model, c, r, p.eff, p.software, 8192)
    assert t_attn[0] == pytest.approx(3.5 * 2 * 8192**2 * 32 * 128 / 308e12, rel=1e-12)  # 7.14 ms, the GPU's peak
    # (not the GEMMs' sustained clock) is the curve's own: it was measured on this GPU
    # a measured or user-set attention_efficiency rules over the published curve
    eff = load_efficiencies("h100-sxm", overrides={"attention_efficiency": 0.5})
    assert layer.rates(p.gpu, eff, p.software).attn is None


@pytest.mark.parametrize(("kernel", "gen", "seq", "head_dim", "tflops"), [
    ("fa2", "ampere", 2048, 128, 155),  # arXiv 2307.08691 Fig. 4 (d)
    ("fa2", "ampere", 16384, 64, 171),  # Fig. 4 (c)
    ("fa2", "ampere", 2**11.5, 128, (155 + 173) / 2),  # halfway between 2k and 4k in log2(seq)
    ("fa2", "ampere", 4096, 96, (156 + 173) / 2),  # halfway between head dims 64 and 128
    ("fa2", "ampere", 65536, 128, 189),  # the 16k value held beyond the last measured point
    ("fa1", "hopper", 1024, 128, 109),  # flash2_h100_fwd_bwd_benchmark.png (d), FlashAttention (v1) bars
    ("cudnn", "hopper", 8192, 128, 529 * 308 / 333),  # arXiv 2407.08608 Fig. 5 forward x FA2's fwd+bwd / fwd
])
def test_attention_curves_read_as_the_figures_print_them(kernel: str, gen: str, seq: float, head_dim: int,
                                                         tflops: float):
    curve = attention_curve(kernel, gen)
    assert curve is not None
    assert layer.curve_rate(curve, seq, head_dim) == pytest.approx(tflops, rel=2e-3)


def test_llm_foundrys_triton_kernel_runs_as_flashattention_v1_its_docstring_says():
    # llmfoundry/models/layers/flash_attn_triton.py (copied from HazyResearch flash_attn_triton.py): "Overall Triton
    # forward + backward is slightly slower than CUDA forward + backward" (FlashAttention v1). The FA2 paper's
    # "FlashAttention Triton" bars are OpenAI's triton.ops.flash_attention, another kernel. At head dim 128 it runs
    # v1's head-64 curve: the Triton kernel tiles 128 x 128 at both head dims (forward BLOCK = 128, every backward
    # config BLOCK_M = BLOCK_N = 128), where v1's CUDA kernels use 256-key blocks at 64 and 128-key ones at 128
    # (v1.0.9 fmha_fwd_hdim64.cu FMHA_kernel_traits<256, 64, ...>, fmha_fwd_hdim128.cu <128, 128, ...>), the reason
    # v1's head-128 curve lies below its head-64 one (A100 16k: 83 vs 97 TFLOP/s, arXiv 2307.08691 Fig. 4)
    for gen in ("ampere", "hopper"):
        tri, fa1 = attention_curve("fa-triton", gen), attention_curve("fa1", gen)
        assert tri is not None and fa1 is not None and tri.hd64 == fa1.hd64 == tri.hd128
        assert all(a < b for a, b in zip(fa1.hd128, fa1.hd64, strict=True))


def test_nemo_preset_knobs_each_cite_the_recipe_or_framework_code():
    raw = tomllib.loads(resources.files("trainscale.catalog").joinpath("software.toml").read_text())["nemo"]
    knobs = [k for k in raw if k != "source" and not k.endswith("_source")]
    # the 13 required knobs + attention_kernel, comm_sms, optimizer_state_bytes, tp_wgrad_overlap, dp_chunk_sync,
    # dp_chunk_gather
    assert len(knobs) == 19
    for k in knobs:  # every knob the preset sets has its own source line, naming a file or a derivation
        src = raw.get(f"{k}_source", "")
        assert len(src) > 30 and any(w in src for w in ("NeMo", "Megatron-Core", "Transformer Engine", "estimate",
                                                        "as megatron-core", "DERIVED")), k
    sw = load_software("nemo")
    # NeMo llama3_70b.py pretrain_performance_optimizations: grad_reduce_in_fp32 = False -> bf16 grads, reduced bf16
    assert (sw.grad_bytes, sw.grad_reduce_bytes, sw.state_bytes_per_param) == (2, 2, 16)
    # MegatronCommOverlapCallback(tp_comm_overlap=True): TP collectives hidden, paid in SMs
    assert sw.tp_overlap == 1.0 and sw.comm_sms == 2 and sw.dp_overlap == 1.0
    # NVTE_FUSED_ATTN=1 and TE's Hopper preference: cuDNN on an H100, FlashAttention-2 on an A100
    eff_h, eff_a = load_efficiencies("h100-sxm"), load_efficiencies("a100-sxm-80gb")
    assert layer.rates(load_gpu("h100-sxm"), eff_h, sw).attn.kernel == "cudnn"  # type: ignore[union-attr]
    assert layer.rates(load_gpu("a100-sxm-80gb"), eff_a, sw).attn.kernel == "fa2"  # type: ignore[union-attr]
    assert sw.zero == (0, 1) and sw.optimizer_state_bytes == 12.0
    assert sw.tp_wgrad_overlap  # Megatron-Core's column-parallel linears reduce the input gradient under wgrad
    # no align_grad_reduce in Megatron-Core's DDP config, so no grad_sync_func: each chunk reduced during its last
    # backward (DDP hooks); MegatronCommOverlapCallback's align_param_gather: each chunk gathered one chunk ahead
    assert sw.dp_chunk_sync == "during" and sw.dp_chunk_gather


def test_recomputed_attention_forward_is_the_kernels_published_forward_share() -> None:
    """Full recomputation redoes a fused attention kernel's forward: FlashAttention-2 on H100 at head dim 128 and
    16k runs forward + backward at 328 TFLOP/s and the forward alone at 335 (its count: backward = 2.5 x forward,
    FlashAttention-3 arXiv 2407.08608 Fig. 5 and the FA2 README H100 figure), so the forward takes
    328 / (3.5 x 335) = 0.280 of the time; a kernel with no published forward curve (the Triton kernel) 1 / 3.5."""
    forward_share = layer.forward_share
    assert float(forward_share(attention_curve("fa2", "hopper"), 16384, 128)) == pytest.approx(328 / (3.5 * 335))
    assert float(forward_share(attention_curve("fa2", "hopper"), 512, 64)) == pytest.approx(141 / (3.5 * 180))
    assert float(forward_share(attention_curve("fa-triton", "hopper"), 16384, 128)) == pytest.approx(1 / 3.5)
    assert float(forward_share(None, 2048, 128)) == pytest.approx(1 / 3.5)


def _gemm_shapes():  # type: ignore[no-untyped-def]
    """benchmarks/gemm_shapes.py, the candidate per-GEMM shape model and the device check's shape lists."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gemm_shapes.py"
    spec = importlib.util.spec_from_file_location("gemm_shapes", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_candidate_gemm_shape_model_counts_tiles_waves_and_the_mamf_ceiling_by_hand():
    gs = _gemm_shapes()
    h100, a100 = load_gpu("h100-sxm"), load_gpu("a100-sxm-80gb")
    c = gs.candidate(h100)
    # the MAMF best shape 6144 x 17920 x 2816 in 128 x 256 tiles: 48 x 70 = 3,360 tiles, 26 waves of 132 = 3,432
    assert c.q_mamf == pytest.approx(3360 / 3432)
    # MPT-1B's q/k/v projection at micro-batch 12 x 2048: 192 x 8 = 1,536 tiles (either orientation), 12 waves
    # of 132 = 1,584 slots: 0.96970 of the SMs' work, over the MAMF shape's 0.97902 = 0.99048 of MAMF
    eff = gs.shape_factor(24576.0, 2048.0, 2048.0, c) / c.q_mamf
    assert eff == pytest.approx((1536 / 1584) / (3360 / 3432)) and eff == pytest.approx(0.99048, abs=1e-5)
    # a large GEMM quantized no worse than the MAMF shape runs exactly at MAMF (16384^3: 8,192 tiles in 63 waves)
    f_mm = h100.peak_bf16_flops * load_efficiencies("h100-sxm").matmul_efficiency
    t = gs.candidate_time(16384, 16384, 16384, f_mm, h100.hbm_bandwidth * 0.8, c)
    assert 2.0 * 16384**3 / t == f_mm
    # an A100 dW GEMM of MPT-125M (768 x 768 output, 81,920 tokens of K): 3 x 6 = 18 tiles of 256 x 128 would leave
    # 90 of 108 SMs idle; split-K cuts K into 108 / 18 = 6 pieces and fills them. A short K cannot be split.
    a = gs.candidate(a100)
    assert a.q_mamf == 1.0  # 6912 x 16384 in 256 x 128 tiles: 27 x 128 = 3,456 = 32 waves of 108
    assert gs.shape_factor(768.0, 81920.0, 768.0, a) == 1.0
    assert gs.shape_factor(768.0, 256.0, 768.0, a) == pytest.approx(18 / 108)


def test_gemm_shape_lists_are_the_planners_sharded_gemms():
    gs = _gemm_shapes()
    rows = gs.row_gemms(load_model("llama3.1-405b"), 8192, 8)
    shapes = {name: (m, k, n) for name, m, k, n in rows}
    assert len(set(shapes.values())) == len(rows)  # each shape once, named by its first GEMM
    # Llama 3.1 405B at tp8: d 16384, 128 query heads of 128 -> 2048 per rank, 8 KV heads -> 1 per rank (128),
    # SwiGLU 53,248 / 8 = 6,656, vocabulary 128,256 / 8 = 16,032
    assert shapes["wq.fwd"] == (8192, 16384, 2048) and shapes["wk.fwd"] == (8192, 16384, 128)
    assert shapes["w1.fwd"] == (8192, 16384, 6656) and shapes["w1.dX"] == (8192, 6656, 16384)  # = w2's forward
    assert shapes["w1.dW"] == (16384, 8192, 6656) and shapes["head.fwd"] == (8192, 16384, 16032)


def test_h200_fp8_gemm_rate_is_hoppers_times_the_published_h200_over_h100_mamf():
    # ml-engineering compute/accelerator README (stas00/ml-engineering @744d01e), Maximum Achievable Matmul FLOPS, FP8
    # rows: H200 SXM 1453.4, H100 SXM 1402.6 TFLOPS of 1979; the BF16 row: 'H100 SXM 794.5 ... H200 is the same'
    h200, h100 = load_efficiencies("h200"), load_efficiencies("h100-sxm")
    assert h200.fp8_matmul_efficiency == pytest.approx(h100.fp8_matmul_efficiency * 1453.4 / 1402.6, abs=5e-4)
    assert h200.matmul_efficiency == h100.matmul_efficiency
    assert h200.sustained_clock_fraction == h100.sustained_clock_fraction  # the FITTED constant stays per generation
    # NVIDIA H200 datasheet (SXM): the H100's compute, HBM3e 141 GB at 4.8 TB/s, 700 W
    g, h = load_gpu("h200"), load_gpu("h100-sxm")
    assert (g.peak_bf16_flops, g.peak_fp8_flops, g.sm_count, g.tdp_watts) == (
        h.peak_bf16_flops, h.peak_fp8_flops, h.sm_count, h.tdp_watts)
    assert (g.memory_bytes, g.hbm_bandwidth) == (141e9, 4.8e12)


def test_mlperf_llama31_presets_take_sms_as_their_userbuffers_configs_say():
    # MLPerf Training v5.0 llama31_405b: TP4 (Nebius, conf/tp_overlap/h100tp4mbs1.yaml) keeps SMs from proj_fprop
    # (pipeline, num_sm 24, set_sm_margin 1) and fc2_fprop (ring_exchange, num_sm 1, set_sm_margin 1); TP8 (NVIDIA,
    # h100tp8mbs1.yaml) sets no margin and Transformer Engine's ring-exchange default is none
    m = load_model("llama3.1-405b")
    hd = m.d_model // m.n_heads
    qkv, wo = m.d_model * (m.n_heads + 2 * m.n_kv_heads) * hd, m.n_heads * hd * m.d_model
    w13, w2 = 2 * m.d_model * m.d_ff, m.d_ff * m.d_model
    total = qkv + wo + w13 + w2
    held = 24 * wo / total / 3 + 1 * w2 / total / 3  # each forward GEMM a third of its forward + backward
    assert held == pytest.approx(0.765, abs=0.001)
    tp4, tp8 = load_software("mlperf-nemo-llama31-tp4"), load_software("mlperf-nemo-llama31-tp8")
    assert (tp4.comm_sms, tp8.comm_sms) == (round(held), 0)
    # the same implementation otherwise (custom.yaml, pretrain.py, config_common.sh): every other knob equal
    same = {k: v for k, v in vars(tp4).items() if k not in ("name", "source", "sources", "comm_sms")}
    assert same == {k: v for k, v in vars(tp8).items() if k not in ("name", "source", "sources", "comm_sms")}
    assert tp4.precision == "fp8" and tp4.attention_kernel == "cudnn" and tp4.zero == (1,)
    # config_common.sh FP8_PARAMS=True -> pretrain.py DistributedDataParallelConfig(fp8_param_gather=True): the
    # distributed optimizer all-gathers the layers' FP8 weights at 1 byte, as the v4.0 / v4.1 GPT-3 presets say
    assert tp4.fp8_weights and tp8.fp8_weights and "fp8_param_gather" in tp8.sources["fp8_weights"]
    runs = tomllib.loads(resources.files("trainscale.catalog").joinpath("runs.toml").read_text())["run"]
    sw = {r["id"]: r["software"] for r in runs if r["id"].startswith("mlperf-v50-llama31-405b-")}
    assert len(sw) == 7 and all(v == ("mlperf-nemo-llama31-tp4" if "-h200x" in k else "mlperf-nemo-llama31-tp8")
                                for k, v in sw.items())
