"""trainscale.hf, the one Hugging Face bridge: its names are transformers' own, its RoPE permutations invert each
other, and a config.json it writes reads back to the same model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trainscale import hf
from trainscale.errors import TrainscaleError
from trainscale.runtime.model import build_model
from trainscale.specs import load_model

DENSE = {"name": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 160, "vocab_size": 96,
         "max_seq_len": 32, "rope_theta": 500.0}
MOE = {**DENSE, "n_experts": 4, "experts_per_token": 2, "d_ff_expert": 48, "aux_loss_coef": 0.02}


@pytest.mark.parametrize("bias", [False, True])
def test_llama_names_are_transformers_state_dict_keys(bias):
    transformers = pytest.importorskip("transformers")
    spec = load_model({**DENSE, "bias": bias})
    cfg = hf.hf_config(spec, "float32", None)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    ours = build_model(spec, "meta")
    family = hf.export_family(spec)
    mapped = {hf.hf_name(n, family): tuple(p.shape) for n, p in ours.named_parameters()}
    assert mapped == {n: tuple(p.shape) for n, p in theirs.state_dict().items()}
    assert len(mapped) == 3 + 2 * (2 + 7 * (2 if bias else 1))  # embed, norm, head; per layer 2 norms, 7 linears


def test_mixtral_expert_names_and_the_router():
    spec = load_model(MOE)
    family = hf.export_family(spec)
    assert family.architecture == "MixtralForCausalLM"
    assert hf.hf_name("layers.1.moe.router.weight", family) == "model.layers.1.block_sparse_moe.gate.weight"
    assert hf.expert_names("layers.1.moe.experts.w2", 4, family) == [
        f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight" for e in range(4)]
    assert hf.expert_names("layers.1.attention.wq.weight", 4, family) is None
    with pytest.raises(TrainscaleError, match="no name in a Hugging Face LlamaForCausalLM"):
        hf.hf_name("layers.0.moe.router.weight", hf.FAMILIES["llama"])


def test_rope_permutations_invert_each_other_on_torch_and_numpy():
    w = torch.randn(2 * 8, 5)
    half = hf.rope_interleaved_to_half(w, 2, 8)
    assert half[:4, 0].tolist() == w[[0, 2, 4, 6], 0].tolist()  # head 0's first half: the even rows
    assert torch.equal(hf.rope_half_to_interleaved(half, 2, 8), w)
    a = np.arange(16.0)
    assert np.array_equal(hf.rope_interleaved_to_half(a, 2, 8), half_order := np.array(
        [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15.0]))
    assert np.array_equal(hf.rope_half_to_interleaved(half_order, 2, 8), a)


@pytest.mark.parametrize("fields", [DENSE, MOE], ids=["llama", "mixtral"])
def test_written_config_reads_back_to_the_same_model(tmp_path, fields):
    spec = load_model(fields)
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config(spec, "bfloat16", 7)))
    back = load_model(tmp_path / "config.json")
    keep = ("n_layers", "d_model", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len", "rope_theta",
            "norm_eps", "tied_embeddings", "bias", "n_experts", "experts_per_token", "expert_width", "aux_loss_coef")
    assert {k: getattr(back, k) for k in keep} == {k: getattr(spec, k) for k in keep}


def test_rope_theta_under_rope_parameters_and_what_the_runtime_refuses(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 160, "vocab_size": 96, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert hf.spec_fields(cfg, tmp_path / "config.json")["rope_theta"] == 5e5  # transformers 5 keeps it there
    assert hf.check_loadable(cfg, "F") is hf.FAMILIES["llama"]
    for bad, words in (({"model_type": "mixtral"}, "holds a 'mixtral' model; only Llama-family"),
                       ({"hidden_act": "gelu"}, "is not Llama's SwiGLU"),
                       ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "RoPE scaling 'dynamic'"),
                       ({"mlp_bias": True}, "but not both")):
        with pytest.raises(TrainscaleError, match=words):
            hf.check_loadable({**cfg, **bad}, "F")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_size": "64"}))
    with pytest.raises(TrainscaleError, match="hidden_size must be a positive integer"):
        hf.read_config(tmp_path / "config.json")
