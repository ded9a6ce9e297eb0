"""Mixture-of-experts and MLA in the model of the world: the spec, Hugging Face configs, exact counting.

Published figures: DeepSeek-V3 671B total / 37B activated (arXiv 2412.19437 abstract; the 671B excludes the
14B multi-token-prediction module, Sec. 4.2 / the model card); Mixtral 8x7B 46.7B total / 12.9B active per
token (Mistral AI, "Mixtral of experts", 2023); Qwen3-30B-A3B 30.5B / 3.3B (Qwen3 technical report, arXiv
2505.09388 Table 2 / model card); Qwen1.5-MoE-A2.7B 14.3B / 2.7B (Qwen blog, 2024-03-28). Configs are written
here from the published config.json dimensions; nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest

from trainscale.errors import TrainscaleError
from trainscale.estimate.params import active_params, expert_params, numel, param_count, tensor_inventory
from trainscale.specs import Layout, ModelSpec, load_model

DEEPSEEK_V3 = dict(model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168, num_attention_heads=128,
                   num_key_value_heads=128, intermediate_size=18432, vocab_size=129280,
                   max_position_embeddings=163840, n_routed_experts=256, num_experts_per_tok=8,
                   moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_layer_freq=1,
                   norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu")
MIXTRAL = dict(model_type="mixtral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
               num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6)
QWEN3_30B = dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                 num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
                 norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
QWEN15_MOE = dict(model_type="qwen2_moe", num_hidden_layers=24, hidden_size=2048, num_attention_heads=16,
                  num_key_value_heads=16, intermediate_size=5632, moe_intermediate_size=1408,
                  shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4, vocab_size=151936,
                  max_position_embeddings=8192, tie_word_embeddings=False)


def _load(tmp_path, cfg: dict) -> ModelSpec:
    p = tmp_path / f"{cfg['model_type']}.json"
    p.write_text(json.dumps(cfg))
    return load_model(p)


@pytest.mark.parametrize("cfg,total,active,tol_total,tol_active", [
    (DEEPSEEK_V3, 671e9, 37e9, 0.005, 0.02),
    (MIXTRAL, 46.7e9, 12.9e9, 0.005, 0.005),
    (QWEN3_30B, 30.5e9, 3.3e9, 0.005, 0.02),
    (QWEN15_MOE, 14.3e9, 2.7e9, 0.005, 0.01),
])
def test_published_total_and_active(tmp_path, cfg, total, active, tol_total, tol_active):
    """Counting convention: active = all but the routed experts a token is not sent to, embedding table
    included (as DeepSeek's 37B and Mixtral's 12.9B count it)."""
    m = _load(tmp_path, cfg)
    assert abs(param_count(m) / total - 1) < tol_total, param_count(m)
    assert abs(active_params(m) / active - 1) < tol_active, active_params(m)


def test_deepseek_v3_exact_shape(tmp_path):
    m = _load(tmp_path, DEEPSEEK_V3)
    assert (m.attention, m.n_moe_layers, m.expert_width, m.d_ff_shared, m.qk_head_dim) == ("mla", 58, 2048, 2048, 192)
    assert param_count(m) == 671_026_404_352
    # the same count tensor by tensor, from the inventory the runtime names its parameters after
    assert numel(tensor_inventory(m)) == param_count(m)
    # 58 MoE layers x 256 experts x 3 x 2048 x 7168
    assert expert_params(m) == 58 * 256 * 3 * 2048 * 7168
    inv = dict(tensor_inventory(m))
    assert inv["layers.3.attention.wkv_a.weight"] == (512 + 64, 7168)
    assert inv["layers.3.attention.wq_b.weight"] == (128 * 192, 1536)
    assert inv["layers.3.moe.experts.w2"] == (256, 7168, 2048)
    assert "layers.2.feed_forward.w1.weight" in inv and "layers.2.moe.router.weight" not in inv


def test_mixtral_exact(tmp_path):
    m = _load(tmp_path, MIXTRAL)
    layer = 4096 * (4096 + 1024 + 1024 + 4096) + 2 * 4096 + 8 * 4096 + 8 * 3 * 14336 * 4096
    assert param_count(m) == 32 * layer + 2 * 32000 * 4096 + 4096
    assert active_params(m) == param_count(m) - 32 * 6 * 3 * 14336 * 4096


@pytest.mark.parametrize("fields,match", [
    (dict(n_experts=8), "experts_per_token"),
    (dict(n_experts=8, experts_per_token=9), "between 1 and n_experts"),
    (dict(experts_per_token=2), "need n_experts"),
    (dict(attention="mla"), "kv_lora_rank"),
    (dict(kv_lora_rank=64), "attention = 'mla'"),
])
def test_bad_moe_specs_are_one_sentence(fields, match):
    base = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=100, max_seq_len=32)
    with pytest.raises(TrainscaleError, match=match):
        load_model({**base, **fields})


def test_unmodelled_hf_moe_is_refused(tmp_path):
    with pytest.raises(TrainscaleError, match="interleaved among MoE layers"):
        _load(tmp_path, {**QWEN3_30B, "decoder_sparse_step": 2})
    with pytest.raises(TrainscaleError, match="num_experts must be a non-negative integer"):
        _load(tmp_path, {**QWEN3_30B, "num_experts": "many"})
    with pytest.raises(TrainscaleError, match="moe_intermediate_size .* must be a positive integer"):
        _load(tmp_path, {**QWEN3_30B, "moe_intermediate_size": 0})  # not silently the dense width
    with pytest.raises(TrainscaleError, match="auxiliary loss weight must be a number"):
        _load(tmp_path, {**QWEN3_30B, "router_aux_loss_coef": "big"})


def test_ep_in_the_layout():
    lo = Layout.parse("dp8,zero3,ep4")
    assert (lo.ep, lo.dp_shard, lo.dp_replicate, lo.world_size) == (4, 2, 1, 8)
    assert Layout.parse(str(lo)) == lo and "ep4" in str(lo)
    assert Layout.parse("dp8,ep2").dp_replicate == 4  # zero0: the dp ranks outside an EP group replicate


@pytest.mark.parametrize("cfg", [QWEN3_30B, MIXTRAL, QWEN15_MOE])
def test_counts_equal_transformers_on_the_meta_device(tmp_path, cfg):
    """Every parameter transformers builds for the config (on the meta device: no memory) is counted, Qwen3-MoE's
    per-head q/k norms included (48 layers x 2 x 128 = 12,288 were missing)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "hf"))
    theirs = sum(p.numel() for p in model.parameters())
    assert param_count(_load(tmp_path, cfg)) == theirs
