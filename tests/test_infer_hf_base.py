"""A Hugging Face model folder (config.json + safetensors, one file or shards named by model.safetensors.index.json,
+ tokenizer.json) is a model for every infer/ command as it is: ``generate``, ``quantize``, ``export`` read it through
the one bridge (runtime/hf_init.py) into trainscale's model, with transformers' logits (fp32, 1e-5), and its own
tokenizer. The folder is a transformers-built Llama 3.2 shape (llama3 RoPE scaling, tied embeddings), sharded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from infer_fixtures import cli_error as fails
from infer_fixtures import cli_json as cli
from infer_fixtures import make_hf_llama32

transformers = pytest.importorskip("transformers")

VOCAB = 300


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("hfbase")
    train_bpe([corpus_text("train", max_chars=60_000)], VOCAB).save(str(d / "tokenizer.json"))
    return make_hf_llama32(d / "llama32", d / "tokenizer.json", VOCAB, shard="60KB")


def test_a_sharded_hf_folder_loads_with_transformers_logits_and_its_tokenizer(hf_base):
    from trainscale.infer.load import load_for_inference, load_tokenizer_for

    assert (hf_base / "model.safetensors.index.json").exists() and not (hf_base / "model.safetensors").exists()
    ours, spec, folder = load_for_inference(hf_base)
    assert folder == hf_base and (spec.family, spec.rope_scaling, spec.tied_embeddings) == ("llama", "llama3", True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(hf_base), dtype=torch.float32).eval()
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (ours(x) - theirs(x).logits).abs().max().item()
    assert diff < 1e-5
    tok = load_tokenizer_for(folder)
    assert tok.get_vocab_size() == VOCAB and tok.decode(tok.encode("ROMEO: speak").ids) == "ROMEO: speak"


def test_generate_quantize_export_take_the_hf_folder(hf_base, tmp_path):
    g = cli("generate", str(hf_base), "-p", "ROMEO:", "-n", "6", "--temperature", "0")
    assert g["kv_cache"]["equal"] and g["checkpoint"] == str(hf_base)
    q = cli("quantize", str(hf_base), "--format", "int8", "--out", str(tmp_path / "q8"), "--eval-tokens", "256",
            "-n", "4")
    assert q["file"]["equal"] and q["source"] == str(hf_base)
    assert abs(q["perplexity"]["int8"] / q["perplexity"]["source"] - 1) < 0.01  # int8 g32 barely moves a random model
    assert (tmp_path / "q8" / "tokenizer.json").read_bytes() == (hf_base / "tokenizer.json").read_bytes()
    e = cli("export", str(hf_base), str(tmp_path / "hf"), "--to", "hf")
    assert e["equal"]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    orig = transformers.AutoModelForCausalLM.from_pretrained(str(hf_base), dtype=torch.float32).eval()
    x = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (back(x).logits - orig(x).logits).abs().max().item() < 1e-5  # in through the bridge, out again
    # the llama3-scaled folder goes to GGUF too, its scaling as llama.cpp's rope_freqs tensor
    # (tests/test_infer_gguf_families.py checks llama.cpp's logits against ours)
    g = cli("export", str(hf_base), str(tmp_path / "m.gguf"), "--to", "gguf")
    assert g["file_bytes"] == (tmp_path / "m.gguf").stat().st_size and g["tensor_bytes"] == g["predicted_tensor_bytes"]


def test_hf_folders_infer_cannot_read_are_one_sentence(hf_base, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((hf_base / "config.json").read_text())
    assert "has no model.safetensors or model.safetensors.index.json" in fails("generate", str(bare), "-p", "x")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (bert / "model.safetensors").write_bytes(b"")
    msg = fails("quantize", str(bert), "--out", str(tmp_path / "q"))
    assert "the Hugging Face folder" in msg and "'bert'" in msg and "[model] init" not in msg
