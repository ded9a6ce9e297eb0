"""Export: transformers reproduces trainscale's logits; llama.cpp reproduces its greedy continuation."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from infer_fixtures import PROMPT, check_hf_export, check_llama_cpp_f16, gguf_state_dict, small_model_dir  # noqa: F401

from trainscale.estimate.inference import gguf_name, gguf_tensor_bytes
from trainscale.hf import rope_interleaved_to_half
from trainscale.infer.export import export_hf
from trainscale.infer.gguf import export_gguf
from trainscale.infer.load import load_for_inference, load_tokenizer_for

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed (pip install '.[infer]')")


def test_rope_permutation_maps_meta_pairs_to_rotate_half():
    # one head of dim 8: Meta rows (0,1) (2,3) (4,5) (6,7) are pairs; HF pairs rows (i, i+4)
    w = torch.arange(8.0)[:, None]
    assert rope_interleaved_to_half(w, 1, 8).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    two = rope_interleaved_to_half(torch.arange(8.0), 2, 4)  # biases too, head by head
    assert two.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.fixture(scope="module")
def gguf_files(small_model_dir, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("gguf")
    return {t: export_gguf(small_model_dir, d / f"small-{t}.gguf", t) for t in ("f16", "q8_0", "q4_0")}


@pytest.mark.slow
def test_hf_logits_equal_trainscale(small_model_dir, tmp_path):  # noqa: F811
    transformers = pytest.importorskip("transformers")
    rep = export_hf(small_model_dir, tmp_path / "hf")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / f).exists()
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    model, spec, folder = load_for_inference(small_model_dir)
    check_hf_export(hf, model, tmp_path / "hf", load_tokenizer_for(folder), spec.vocab_size, rep["tensor_bytes"],
                    tol=1e-4)


def test_hf_export_tied_embeddings_and_bias(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe
    from trainscale.runtime.model import build_model
    from trainscale.specs import load_model

    spec = load_model({"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 4, "d_ff": 96, "vocab_size": 300,
                       "max_seq_len": 64, "tied_embeddings": True, "bias": True, "rope_theta": 500.0})
    model = build_model(spec, seed=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn(p.shape) * 0.1)  # non-trivial biases and norm gains
    tok = train_bpe([corpus_text("train", max_chars=20000)], 300)
    tok.save(str(tmp_path / "tok.json"))
    save_model_dir(tmp_path / "m", model.state_dict(), spec, tmp_path / "tok.json")
    export_hf(tmp_path / "m", tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(x).logits - model.eval()(x)).abs().max().item() < 1e-4
    # llama.cpp's llama reads optional biases: the GGUF keeps them (logits: test_infer_gguf_families.py)
    assert export_gguf(tmp_path / "m", tmp_path / "x.gguf", "f16")["architecture"] == "llama"


@pytest.mark.slow
def test_gguf_tensor_bytes_and_metadata_equal_estimator(gguf_files, small_model_dir):  # noqa: F811
    import gguf

    _, spec, folder = load_for_inference(small_model_dir)
    for t, rep in gguf_files.items():
        assert rep["tensor_bytes"] == gguf_tensor_bytes(spec, t, llama_cpp_mix=False)
        assert rep["file_bytes"] == rep["header_bytes"] + rep["tensor_bytes"] + rep["padding_bytes"]
    r = gguf.GGUFReader(gguf_files["q4_0"]["out"])

    def field(key):
        f = r.fields[key]
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]]

    assert field("general.architecture") == "llama"
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    assert len(field("tokenizer.ggml.tokens")) == spec.vocab_size
    assert field("llama.attention.head_count_kv") == spec.n_kv_heads
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["token_embd.weight"] == "Q4_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert set(types) == {gguf_name(n) for n in load_for_inference(small_model_dir)[0].state_dict()}


@pytest.mark.slow
@needs_llama_cpp
def test_llama_cpp_f16_greedy_equals_trainscale(gguf_files, small_model_dir):  # noqa: F811
    model, spec, folder = load_for_inference(small_model_dir)
    tok = load_tokenizer_for(folder)
    ids = tok.encode(PROMPT).ids
    llm, ours = check_llama_cpp_f16(gguf_files["f16"]["out"], model, ids)
    assert llm.tokenize(PROMPT.encode(), add_bos=False, special=False) == ids  # same tokenizer in the file
    from trainscale.runtime.data.sources import corpus_text

    held = corpus_text("val", max_chars=5000)
    assert llm.tokenize(held.encode(), add_bos=False, special=False) == tok.encode(held).ids
    assert llm.detokenize(ours).decode() == tok.decode(ours)  # ours == llama.cpp's greedy tokens


@pytest.mark.slow
@needs_llama_cpp
@pytest.mark.parametrize("ftype", ["q8_0", "q4_0"])
def test_llama_cpp_loads_and_runs_quantized_gguf(gguf_files, small_model_dir, ftype):  # noqa: F811
    from llama_cpp import Llama

    from trainscale.infer.quantize import model_from_state_dict

    model, spec, folder = load_for_inference(small_model_dir)
    ids = load_tokenizer_for(folder).encode(PROMPT).ids
    llm = Llama(model_path=gguf_files[ftype]["out"], n_ctx=spec.max_seq_len, n_threads=2, verbose=False,
                logits_all=True)
    out = llm.create_completion(PROMPT, max_tokens=16, temperature=0.8, seed=1)
    assert out["usage"]["completion_tokens"] > 0 and out["choices"][0]["text"]
    # the blocks llama.cpp read are the blocks written: its logits equal trainscale's on the file's
    # dequantized weights, up to llama.cpp quantizing the activations to Q8 for the dot products
    sd = gguf_state_dict(gguf_files[ftype]["out"], model)
    with torch.no_grad():
        ref = model_from_state_dict(spec, sd)(torch.tensor([ids]))[0].numpy()
    llm.reset()
    llm.eval(ids)
    assert np.abs(np.array(llm.scores[:len(ids)]) - ref).max() < 0.15


@needs_llama_cpp
def test_llama_cpp_reads_f16_fallback_for_rows_that_are_not_whole_blocks(tmp_path):
    """d_ff = 80 is not a whole number of 32-weight blocks: ffn_down is written F16 inside a Q4_0 file,
    as gguf_tensor_types predicts, and llama.cpp computes the same logits as trainscale on those weights."""
    import gguf
    from llama_cpp import Llama

    from trainscale.infer.quantize import model_from_state_dict
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe
    from trainscale.runtime.model import build_model
    from trainscale.specs import load_model

    spec = load_model({"n_layers": 2, "d_model": 64, "n_heads": 2, "n_kv_heads": 1, "d_ff": 80, "vocab_size": 300,
                       "max_seq_len": 64})
    model = build_model(spec, seed=5)
    tok = train_bpe([corpus_text("train", max_chars=20000)], 300)
    tok.save(str(tmp_path / "tok.json"))
    save_model_dir(tmp_path / "m", model.state_dict(), spec, tmp_path / "tok.json")
    rep = export_gguf(tmp_path / "m", tmp_path / "m.gguf", "q4_0")
    assert rep["tensor_bytes"] == gguf_tensor_bytes(spec, "q4_0", llama_cpp_mix=False)
    by = {t.name: t for t in gguf.GGUFReader(rep["out"]).tensors}
    assert by["blk.0.ffn_down.weight"].tensor_type.name == "F16"
    assert by["blk.0.ffn_up.weight"].tensor_type.name == "Q4_0"
    sd = gguf_state_dict(rep["out"], model)
    ids = tok.encode("To be, or not to be, that is the question").ids
    with torch.no_grad():
        ref = model_from_state_dict(spec, sd)(torch.tensor([ids]))[0].numpy()
    llm = Llama(model_path=rep["out"], n_ctx=64, n_threads=2, verbose=False, logits_all=True)
    llm.eval(ids)
    assert np.abs(np.array(llm.scores[:len(ids)]) - ref).max() < 0.15
