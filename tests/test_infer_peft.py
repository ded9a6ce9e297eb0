"""LoRA adapters out in PEFT's format: a tiny model (Llama 3.2's shape: llama3 RoPE scaling, tied embeddings, GQA;
Qwen2's: Q/K/V biases) fine-tuned a few steps by ``trainscale lora`` on a JSONL file, its base exported with
``export --to hf`` and its adapters with ``export --to peft``; transformers + peft's
``PeftModel.from_pretrained`` give our logits (fp32, 1e-5), and not without the Q/K row permutation of B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from infer_fixtures import cli_json as cli
from infer_fixtures import make_hf_llama32
from safetensors.torch import load_file, save_file

from trainscale.hf import rope_half_to_interleaved

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 300
TINY = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "vocab_size": VOCAB,
        "max_seq_len": 64}
SHAPES = {
    "llama32": {"family": "llama", "rope_scaling": "llama3", "rope_factor": 32.0, "rope_original_max_len": 16,
                "rope_theta": 500000.0, "tied_embeddings": True},
    "qwen2": {"family": "qwen2", "qkv_bias": True},
}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe([corpus_text("train", max_chars=60_000)], VOCAB).save(str(path))
    return path


def make_base(folder: Path, shape: str, tokenizer_file: Path) -> Path:
    """A random model of the shape, every weight perturbed (biases and norm gains non-trivial), saved."""
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.model import build_model
    from trainscale.specs import load_model

    spec = load_model({**TINY, "name": f"tiny-{shape}", **SHAPES[shape]})
    model = build_model(spec, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    folder.mkdir(parents=True)
    save_model_dir(folder, model.state_dict(), spec, tokenizer_file)
    return folder


def jsonl_corpus(path: Path) -> Path:
    from trainscale.runtime.data.sources import corpus_text

    paras = [p for p in corpus_text("train", max_chars=30_000).split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({"id": i, "body": p}) + "\n" for i, p in enumerate(paras)))
    return path


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))


def peft_logits(hf_dir: Path, adapter_dir: Path, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(base logits, base + adapter logits) from transformers and peft."""
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(x).logits
    adapted = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        return plain, adapted(x).logits


@pytest.mark.parametrize("shape", list(SHAPES))
def test_peft_loads_our_adapter_with_our_logits(tmp_path, tokenizer_file, shape):
    from trainscale.infer.load import load_for_inference

    base = make_base(tmp_path / "base", shape, tokenizer_file)
    data = jsonl_corpus(tmp_path / "data.jsonl")
    ad = tmp_path / "ad"
    rep = cli("lora", str(base), "--data", str(data), "--text-field", "body", "--steps", "6", "--batch", "2",
              "--seq-len", "32", "--rank", "4", "--alpha", "16", "--lr", "2e-2", "-o", str(ad))
    assert rep["last_loss"] < rep["first_loss"]
    cli("export", str(base), str(tmp_path / "hf"), "--to", "hf")
    out = cli("export", str(ad), str(tmp_path / "peft"), "--to", "peft")
    assert out["equal"] and out["tensors"] == 2 * 7 * TINY["n_layers"]
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"], cfg["task_type"]) == (4, 16.0, "LORA", "CAUSAL_LM")
    assert cfg["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"])
    sd = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert sd["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (2 * 16, 4)
    assert sd["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, TINY["d_ff"])

    x = batch()
    ours, _, _ = load_for_inference(ad)  # the base with the adapters folded in
    with torch.no_grad():
        mine = ours(x)
    plain, adapted = peft_logits(tmp_path / "hf", tmp_path / "peft", x)
    diff = (adapted - mine).abs().max().item()
    moved = (plain - mine).abs().max().item()
    print(f"{shape}: |peft - trainscale| = {diff:.2e}; the adapters move the logits by {moved:.3f}")
    assert diff < 1e-5
    assert moved > 1e-2  # the adapters matter, so equality above is not the base's alone

    # the same adapter with B of Q and K in trainscale's interleaved row order: peft computes another model
    for name in sd:
        if name.endswith(("q_proj.lora_B.weight", "k_proj.lora_B.weight")):
            heads = TINY["n_heads"] if ".q_proj." in name else TINY["n_kv_heads"]
            sd[name] = rope_half_to_interleaved(sd[name], heads, TINY["d_model"] // TINY["n_heads"]).contiguous()
    save_file(sd, str(tmp_path / "peft" / "adapter_model.safetensors"), metadata={"format": "pt"})
    _, unpermuted = peft_logits(tmp_path / "hf", tmp_path / "peft", x)
    wrong = (unpermuted - mine).abs().max().item()
    print(f"{shape}: without the Q/K row permutation of B, |peft - trainscale| = {wrong:.3f}")
    assert wrong > 1e-4


def test_peft_export_refuses_what_is_not_a_lora_folder(tmp_path, tokenizer_file):
    from trainscale.errors import TrainscaleError
    from trainscale.infer.peft import export_peft

    base = make_base(tmp_path / "base", "qwen2", tokenizer_file)
    with pytest.raises(TrainscaleError, match="has no adapter.json"):
        export_peft(base, tmp_path / "out")


# ------------------------------------------------------------------ a Hugging Face folder as the base

def test_lora_on_a_hugging_face_folder_exports_to_peft_on_that_folder(tmp_path, tokenizer_file):
    """``lora`` takes the transformers folder itself as its base: adapter.json records it (format "hf"), the adapter
    folder loads again (base read from the folder, adapters folded in), and ``export --to peft`` gives adapters that
    peft loads onto transformers' model of that same folder, with our logits."""
    from trainscale.infer.load import load_for_inference

    base = make_hf_llama32(tmp_path / "hf-base", tokenizer_file, VOCAB)
    data = jsonl_corpus(tmp_path / "data.jsonl")
    ad = tmp_path / "ad"
    rep = cli("lora", str(base), "--data", str(data), "--text-field", "body", "--steps", "6", "--batch", "2",
              "--seq-len", "32", "--rank", "4", "--alpha", "16", "--lr", "2e-2", "-o", str(ad))
    assert rep["last_loss"] < rep["first_loss"] and rep["base"] == str(base)
    saved = json.loads((ad / "adapter.json").read_text())
    assert (saved["base"], saved["base_format"]) == (str(base.resolve()), "hf")
    assert (ad / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    out = cli("export", str(ad), str(tmp_path / "peft"), "--to", "peft")
    assert out["equal"] and out["base"] == str(base.resolve())

    x = batch()
    ours, spec, _ = load_for_inference(ad)
    assert (spec.rope_scaling, spec.tied_embeddings) == ("llama3", True)
    with torch.no_grad():
        mine = ours(x)
    plain, adapted = peft_logits(base, tmp_path / "peft", x)  # transformers' model of the HF folder itself
    diff = (adapted - mine).abs().max().item()
    moved = (plain - mine).abs().max().item()
    print(f"HF base: |peft - trainscale| = {diff:.2e}; the adapters move the logits by {moved:.3f}")
    assert diff < 1e-5 and moved > 1e-2
