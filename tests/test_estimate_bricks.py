"""The catalog and the seed's arithmetic (params, FLOPs, memory, comms, power), pinned to published figures (issue 2).

Seed: ../shared/seed/why-training-takes-a-data-center.md (kirupa.com, "Why Training Takes a Data Center").
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainscale.errors import TrainscaleError
from trainscale.estimate import flops, inference, memory, power
from trainscale.estimate.params import param_count
from trainscale.estimate.walkthrough import walkthrough
from trainscale.specs import Layout, catalog_names, load_cluster, load_gpu, load_model


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ------------------------------------------------------------------ parameter counts


def test_exact_parameter_counts():
    # Exact counts of the released checkpoints (HF meta-llama/Llama-3.1-8B: 8,030,261,248;
    # Llama-3.1-405B with untied embeddings: 405,853,388,800; Llama-3.1-70B: 70,553,706,496).
    assert param_count(load_model("llama3.1-8b")) == 8_030_261_248
    assert param_count(load_model("llama3.1-405b")) == 405_853_388_800
    assert param_count(load_model("llama3.1-70b")) == 70_553_706_496
    # GPT-3 "175B" (Brown et al. 2020 Table 2.1): 96 layers, d 12288, tied, learned positions.
    assert rel(param_count(load_model("gpt3-175b")), 175e9) < 0.005


def test_hf_config_json_gives_catalog_count(tmp_path):
    # Fields as in HF meta-llama/Llama-3.1-8B config.json.
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "vocab_size": 128256, "head_dim": 128, "attention_bias": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(tmp_path / "config.json")
    assert param_count(m) == param_count(load_model("llama3.1-8b")) == 8_030_261_248
    assert load_model(tmp_path) == m  # a folder holding config.json works too


def test_model_and_gpu_from_toml(tmp_path):
    (tmp_path / "m.toml").write_text(
        "n_layers = 2\nd_model = 64\nn_heads = 4\nn_kv_heads = 2\nd_ff = 128\nvocab_size = 100\nmax_seq_len = 32\n")
    m = load_model(tmp_path / "m.toml")
    # 100*64 embed + 2 x (q 64*64 + k,v 2*64*32 + o 64*64 + mlp 3*64*128 + norms 2*64) + norm 64 + out 100*64
    assert param_count(m) == 6400 + 2 * (4096 + 4096 + 4096 + 24576 + 128) + 64 + 6400
    (tmp_path / "g.toml").write_text("peak_bf16_flops = 1e12\nmemory_bytes = 8e9\nhbm_bandwidth = 1e11\n"
                                     "tdp_watts = 100\nscale_up_bandwidth = 1e10\n")
    assert load_gpu(tmp_path / "g.toml").peak_bf16_flops == 1e12


def test_unknown_names_and_bad_values_are_clear():
    with pytest.raises(TrainscaleError, match="unknown model 'llama9'.*llama3.1-8b"):
        load_model("llama9")
    with pytest.raises(TrainscaleError, match="unknown GPU"):
        load_gpu("h900")
    with pytest.raises(TrainscaleError, match="n_heads"):
        load_model({"n_layers": 1, "d_model": 64, "n_heads": 6, "n_kv_heads": 4, "d_ff": 1, "vocab_size": 1,
                    "max_seq_len": 1})
    with pytest.raises(TrainscaleError, match="d_model"):
        load_model({"n_layers": 1, "d_model": -1, "n_heads": 1, "n_kv_heads": 1, "d_ff": 1, "vocab_size": 1,
                    "max_seq_len": 1})


def test_catalog_entries_have_sources_and_dense_peaks():
    for kind in ("models", "gpus", "clusters"):
        for name in catalog_names(kind):
            entry = {"models": load_model, "gpus": load_gpu, "clusters": load_cluster}[kind](name)
            assert entry.source, f"{kind}/{name} has no source"
    # Dense, not 2:4-sparse, peaks (datasheets): H100 SXM 989, A100 312, RTX 4090 165.2 TFLOP/s.
    assert load_gpu("h100-sxm").peak_bf16_flops == 989e12
    assert load_gpu("a100-sxm-80gb").peak_bf16_flops == 312e12
    assert load_gpu("rtx4090").peak_bf16_flops == 165.2e12
    assert load_gpu("h100-sxm").memory_bytes == 80e9 and load_gpu("h100-sxm").tdp_watts == 700
    assert load_cluster("gb200-nvl72").scale_up_domain == 72
    assert load_cluster("meta-h100").network_bandwidth * 8 == 400e9  # 400 Gb/s per GPU


# ------------------------------------------------------------------ the seed's figures


@pytest.fixture(scope="module")
def seed():
    return walkthrough()


def test_seed_compute(seed):
    # Seed: 6 x 405B x 15.6T = ~3.8e25 FLOPs, "right on" Meta's reported 3.8e25 (arXiv 2407.21783): the 6ND rule.
    assert rel(seed["figures"]["rule_of_thumb_flops"], 3.8e25) < 0.01
    assert seed["figures"]["forward_flops_per_token"] == 2 * seed["params"]
    assert seed["figures"]["backward_flops_per_token"] == 4 * seed["params"]
    # trainscale's one convention (6N + 6LHQT): the matmul weights (all but the 128,256 x 16,384 embedding lookup)
    # + causal attention 6·126·128·128·8192 per token; 3.6 % over the rule of thumb, the attention 2.6 of it.
    per_token = 6 * (seed["params"] - 128_256 * 16_384) + 6.0 * 126 * 128 * 128 * 8192
    assert seed["training_flops"] == pytest.approx(per_token * 15.6e12, rel=1e-12)
    assert 1.03 < seed["training_flops"] / seed["figures"]["rule_of_thumb_flops"] < 1.04


def test_seed_one_gpu_and_cluster_time(seed):
    # Seed: one RTX 4090 at 165.2 TFLOP/s needs ~230 billion seconds, ~7,300 years; ~18,000 at 40% (for 6ND).
    six_nd_s = seed["figures"]["rule_of_thumb_flops"] / 165.2e12
    assert rel(six_nd_s, 230e9) < 0.01 and rel(six_nd_s / 31_557_600, 7300) < 0.01
    assert rel(six_nd_s / 31_557_600 / 0.4, 18000) < 0.02
    assert seed["figures"]["one_gpu_years_at_peak_6nd"] == pytest.approx(six_nd_s / 31_557_600)  # printed
    assert seed["figures"]["one_gpu_years_at_mfu_6nd"] == pytest.approx(six_nd_s / 31_557_600 / 0.4)
    # the figures printed count the one convention: the same arithmetic on its compute
    assert seed["figures"]["one_gpu_seconds_at_peak"] == pytest.approx(seed["training_flops"] / 165.2e12)
    assert seed["one_gpu_years_at_peak"] == pytest.approx(seed["training_flops"] / 165.2e12 / 31_557_600)
    assert seed["one_gpu_years_at_mfu"] == pytest.approx(seed["one_gpu_years_at_peak"] / 0.4)
    # Seed: 30.84M H100 GPU-hours on 16,384 GPUs -> about 78 days (Llama 3.1 model card).
    assert round(seed["cluster_days"]) == 78
    # Seed: an H100 is about six times an RTX 4090 (989 vs 165.2 TFLOP/s).
    assert round(seed["figures"]["cluster_gpu_vs_home"]) == 6


def test_seed_memory_wall(seed):
    st = seed["state_bytes"]
    # Seed / ZeRO: 810 GB weights + 810 GB grads + 4,860 GB Adam = ~6,480 GB (seed rounds N to 405e9).
    assert rel(st["weights"], 810e9) < 0.005
    assert rel(st["gradients"], 810e9) < 0.005
    assert rel(st["optimizer"], 4860e9) < 0.005
    assert rel(st["total"], 6480e9) < 0.005
    assert st["total"] == 16 * seed["params"]
    # Seed: ~270x an RTX 4090's 24 GB; 81 H100s of 80 GB.
    assert round(seed["figures"]["state_vs_home_gpu"], -1) == 270
    assert round(seed["figures"]["state_vs_gpu"]) == 81
    assert seed["gpus_to_hold_state"] == 82  # whole GPUs: 81.2 rounds up


def test_seed_racks_and_power(seed):
    # Seed: 16,384 GPUs = 1,024 racks of 16 (2 servers x 8, Llama 3 paper).
    assert seed["racks"] == 1024
    # Seed: 16,384 x 700 W = ~11.5 MW; PUE 1.56 (Uptime 2024) -> ~17.9 MW facility.
    assert rel(seed["gpu_power_watts"], 11.5e6) < 0.005
    assert rel(seed["facility_power_watts"], 11.5e6 * 1.56) < 0.005
    assert power.racks_for(16385, 16) == 1025


def test_seed_inference_at_home(seed):
    fig = seed["figures"]
    assert fig["inference_flops_per_token"] == 2 * seed["params"]
    # Seed: community Q4_K_M of Llama 3.1 8B is a 4.92 GB file (bartowski on HF); our tensor bytes
    # from llama.cpp's type mix, without the ~5 MB of tokenizer metadata, land within 0.5 %.
    assert rel(seed["quantized_bytes"]["gguf_q4_k_m"], 4.92e9) < 0.005
    assert fig["home_4bit_fits"] == 1.0
    # Llama 3.1 8B KV cache: 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token.
    assert fig["kv_cache_bytes_per_token"] == 131072


def test_gguf_type_sizes():
    m = load_model("llama3.1-8b")
    # ggml blocks: Q8_0 34 B / 32 weights = 8.5 bpw, Q4_0 4.5, Q4_K 4.5, Q6_K 6.5625.
    assert inference.bits_per_weight("Q8_0") == 8.5
    assert inference.bits_per_weight("Q4_K") == 4.5
    assert inference.bits_per_weight("Q6_K") == 6.5625
    types = inference.gguf_tensor_types(m, "q4_k_m")
    assert types["output.weight"] == "Q6_K" and types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.4.ffn_down.weight"] == "Q4_K"
    assert sum(t == "Q6_K" for k, t in types.items() if k.endswith("ffn_down.weight")) == 16
    # Published Q8_0 / Q4_0 files of Llama 3.1 8B (bartowski): 8.54 GB and 4.66 GB.
    assert rel(inference.gguf_tensor_bytes(m, "q8_0"), 8.54e9) < 0.005
    assert rel(inference.gguf_tensor_bytes(m, "q4_0"), 4.66e9) < 0.005


def test_group_quantized_bytes():
    # int4, groups of 32 with an fp16 scale: 4 + 16/32 = 4.5 bits per weight.
    assert inference.group_quant_bytes(1024, 4, 32) == 512 + 32 * 2
    assert inference.group_quant_bytes(1024, 4, 32, asymmetric=True) == 512 + 32 * 4
    m = load_model("llama3.1-8b")
    assert inference.quantized_model_bytes(m, "bf16") == 2 * param_count(m)


def test_growth_projection(seed):
    # Epoch AI: frontier training compute grows 4-5x per year.
    assert seed["figures"]["compute_in_2y_low"] == pytest.approx(16 * seed["training_flops"])
    assert seed["figures"]["compute_in_1y_high"] == pytest.approx(5 * seed["training_flops"])


def test_time_formulas():
    c = 3.8e25
    # GPUs x days x MFU for a target: 78.4 days on H100s at the implied utilization needs 16,384 GPUs.
    days = flops.days_from_gpu_hours(30.84e6, 16384)
    util = c / (16384 * 989e12 * days * 86400)
    assert flops.gpus_for_target(c, days, 989e12, util) == pytest.approx(16384)
    assert flops.gpu_hours(c, 989e12, util) == pytest.approx(30.84e6)
    # MFU: 430 TFLOP/s achieved of 989 peak is 43.5 % (Llama 3 Table 4's first row reads 43 %).
    n_tok = 430e12 / 1000.0
    assert flops.mfu(n_tok, 1000.0, 1, 989e12) == pytest.approx(0.4348, abs=1e-4)
    assert flops.hfu(n_tok, 1000.0, 500.0, 1, 989e12) == pytest.approx(1.5 * 0.4348, abs=1e-4)


def test_palm_attention_flops():
    # PaLM (arXiv 2204.02311) App. B: 6N + 12·L·H·Q·T; causal masking halves the attention term.
    m = load_model("llama3.1-405b")
    n = param_count(m)
    full = flops.model_flops_per_token(m, n, 8192)
    assert full - 6 * n == 12 * 126 * 128 * 128 * 8192
    assert flops.model_flops_per_token(m, n, 8192, causal=True) - 6 * n == 6 * 126 * 128 * 128 * 8192


# ------------------------------------------------------------------ memory formulas


def test_zero_paper_figure_1():
    # ZeRO (arXiv 1910.02054) Fig. 1: Psi = 7.5B, N_d = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
    psi, nd = 7.5e9, 64
    got = [memory.zero_state_bytes_per_gpu(psi, nd, z).total / 1e9 for z in (0, 1, 2, 3)]
    assert got[0] == pytest.approx(120)
    assert got[1] == pytest.approx(31.4, abs=0.05)
    assert got[2] == pytest.approx(16.6, abs=0.05)
    assert got[3] == pytest.approx(1.88, abs=0.005)


def test_korthikanti_table_2():
    # Korthikanti et al. 2022 (arXiv 2205.05198), Table 2 and Sec. 4, on GPT-3 175B: s 2048, h 12288,
    # a 96 -> the attention term 5as/h = 80 ("for GPT-3 ... 5as/h is 80"), so one layer without
    # parallelism keeps sbh(34 + 80) bytes.
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    assert 5 * a * s / h == 80
    assert memory.activation_bytes_per_layer(s, b, h, a) == sbh * 114
    assert memory.activation_bytes_per_layer(s, b, h, a, t=8) == sbh * (10 + 24 / 8 + 80 / 8)
    assert memory.activation_bytes_per_layer(s, b, h, a, t=8, sp=True) == sbh * 114 / 8
    assert memory.activation_bytes_per_layer(s, b, h, a, t=8, recompute="selective") == sbh * 13
    assert memory.activation_bytes_per_layer(s, b, h, a, t=8, sp=True, recompute="selective") == sbh * 34 / 8
    assert memory.activation_bytes_per_layer(s, b, h, a, t=8, recompute="full") == 2 * sbh
    # Sec. 6 / abstract: on the 530B model (h 20480, a 128, t 8), sequence parallelism + selective
    # recompute cut activation memory about 5x versus tensor parallelism alone.
    h5, a5 = 20480, 128
    ratio = memory.activation_bytes_per_layer(s, 1, h5, a5, t=8) / memory.activation_bytes_per_layer(
        s, 1, h5, a5, t=8, sp=True, recompute="selective")
    assert ratio == pytest.approx(5, rel=0.02)


def test_first_stage_activations_and_interleaving():
    m = load_model("llama3.1-405b")
    per_layer = memory.activation_bytes_per_layer(8192, 1, m.d_model, m.n_heads, 8, True, "none")
    # 1F1B: stage 1 holds p micro-batches of L/p layers = L layers' worth (Korthikanti Sec. 4.2.3).
    got = memory.first_stage_activation_bytes(m, 8192, 1, t=8, p=16, sp=True, n_microbatches=32)
    assert got == pytest.approx(per_layer * 126)
    # Interleaving with v virtual stages multiplies by 1 + (p-1)/(p v).
    assert memory.interleave_factor(16, 2) == pytest.approx(1 + 15 / 32)
    # GPipe keeps all m micro-batches.
    gp = memory.first_stage_activation_bytes(m, 8192, 1, t=8, p=16, sp=True, schedule="gpipe", n_microbatches=32)
    assert gp == pytest.approx(per_layer * 126 / 16 * 32)


def test_gpus_to_hold_and_kv_cache():
    assert memory.gpus_to_hold(6480e9, 80e9) == 81
    m = load_model("llama3.1-70b")
    assert memory.kv_cache_bytes(m, 1000, batch=2) == 2 * 80 * 8 * 128 * 2 * 1000 * 2


# ------------------------------------------------------------------ layout strings


def test_layout_roundtrip_and_errors():
    lay = Layout.parse("tp8,cp1,pp16,dp128,mb1")
    assert (lay.tp, lay.cp, lay.pp, lay.dp, lay.world_size) == (8, 1, 16, 128, 16384)
    assert Layout.parse(str(lay)) == lay
    f = Layout.parse("fsdp4,hsdp2,tp2")
    assert (f.zero, f.dp_replicate, f.dp_shard) == (3, 2, 2)
    assert Layout.parse("pp4,v2").schedule == "interleaved"
    assert Layout.parse(str(Layout.parse("pp4,v2,rc=full,zero1"))) == Layout.parse("pp4,v2,rc=full,zero1")
    with pytest.raises(TrainscaleError, match="not understood"):
        Layout.parse("tp8,xx3")
    with pytest.raises(TrainscaleError, match="hsdp3 must divide dp4"):
        Layout.parse("fsdp4,hsdp3")


# ------------------------------------------------------------------ CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscale", *args], capture_output=True, text=True)


def test_explain_json_keys():
    r = run_cli("explain", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("params", "training_flops", "one_gpu_years_at_peak", "one_gpu_years_at_mfu", "cluster_days",
                "state_bytes", "gpus_to_hold_state", "racks", "gpu_power_watts", "facility_power_watts",
                "quantized_bytes"):
        assert key in out
    assert set(out["state_bytes"]) >= {"weights", "gradients", "optimizer"}
    assert out["params"] == 405_853_388_800


def test_explain_other_model_and_human_output():
    r = run_cli("explain", "--model", "llama3.1-70b", "--gpus", "2048", "--gpu", "b200", "--tokens", "2e12")
    assert r.returncode == 0, r.stderr
    assert "70,553,706,496" in r.stdout and "The memory wall" in r.stdout
    w = walkthrough(model="llama3.1-70b", gpus=2048, gpu="b200", tokens=2e12)
    assert w["figures"]["rule_of_thumb_flops"] == 6 * 70_553_706_496 * 2e12
    # the convention: 6 x (all but the 128,256 x 8,192 embedding) + causal attention 6·80·64·128·8192, x D
    per_token = 6 * (70_553_706_496 - 128_256 * 8192) + 6.0 * 80 * 64 * 128 * 8192
    assert w["training_flops"] == pytest.approx(per_token * 2e12, rel=1e-12)
    # Without reported GPU-hours, days come from FLOPs at the given MFU.
    assert w["cluster_days"] == pytest.approx(w["training_flops"] / (2048 * 2.25e15 * 0.4) / 86400)


@pytest.mark.parametrize("args,needle", [
    (("explain", "--model", "gpt9"), "unknown model 'gpt9'"),
    (("explain", "--gpu", "h900"), "unknown GPU 'h900'"),
    (("explain", "--mfu", "1.5"), "--mfu must be in"),
    (("explain", "--gpus", "0"), "--gpus must be a positive integer"),
])
def test_bad_input_exits_2_with_one_line(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_kquant_file_sizes_match_llama_cpps_published_llama3_8b():
    """llama.cpp tools/perplexity/README.md, LLaMA 3 8B scoreboard, "Model size [GiB]": q4_K_M 4.58, q5_K_M 5.33,
    q6_K 6.14, q8_0 7.96 (also in tools/quantize/quantize.cpp's type list). Our tensor bytes, from llama.cpp's type
    mix and ggml's block layouts (Q4_K 144 B, Q5_K 176 B, Q6_K 210 B per 256 weights; Q8_0 34 B per 32), land
    within 0.5 % (the files add their tokenizer metadata)."""
    m = load_model("llama3.1-8b")
    assert inference.bits_per_weight("Q5_K") == 5.5
    for ftype, gib in (("q4_k_m", 4.58), ("q5_k_m", 5.33), ("q6_k", 6.14), ("q8_0", 7.96)):
        assert rel(inference.gguf_tensor_bytes(m, ftype) / 2**30, gib) < 0.005, ftype
    types = inference.gguf_tensor_types(m, "q6_k")
    assert set(types.values()) == {"Q6_K", "F32"}
    assert inference.gguf_tensor_types(m, "q8_0")["output.weight"] == "Q8_0"
