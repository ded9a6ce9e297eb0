"""GGUF for every family trainscale's ModelSpec represents and llama.cpp runs: a random model built by transformers
(nothing downloaded) is loaded into trainscale's model, exported as GGUF, and llama.cpp (llama-cpp-python) computes
our logits on 64 tokens: Llama 3.1 and 3.2 (RoPE "llama3": rope_freqs.weight; 3.2 tied), a linearly scaled Llama, a
YaRN-scaled Llama and Qwen2 (llama.cpp's yarn keys),
a Llama with biases, Mistral (a window as long as its context), Qwen2 (Q/K/V biases; tied too), Qwen3 (per-head
Q/K norms, head_dim != d / heads), Gemma ((1 + w) norms, scaled tied embeddings, GeGLU) and Gemma 2 (output norms,
soft-capped scores and logits, a window of 16 on the even layers).

Measured on these tiny models (d 64, 2-3 layers, vocabulary 384), max |llama.cpp - trainscale| over 64 x 384 logits:
f32 files with an f32 KV cache 7e-7 to 1.1e-6 for the Llama and Qwen families with logits up to 2, 1.4e-5 for
Llama 3.2 (perturbed more, logits up to 7.2); Gemma 1.6e-4 and Gemma 2 6.7e-4, because ggml's CPU GELU rounds its
input to fp16 and reads an fp16 table (ggml-cpu vec.h, ggml_vec_gelu_f32 under GGML_GELU_FP16): with that GELU in
our model they are 9e-5 and 5e-5. f16 files with llama.cpp's default f16 KV cache, against our model on the
f16-rounded weights: 1.6e-3 (Qwen3), 1.9e-3 (Gemma 2), 2.2e-2 (Llama 3.2, logits up to 7.2). Anything llama.cpp
cannot compute as we do is refused in one sentence.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainscale.errors import TrainscaleError
from trainscale.estimate.inference import gguf_tensor_bytes
from trainscale.infer.gguf import check_gguf, export_gguf
from trainscale.infer.load import load_for_inference, load_tokenizer_for

transformers = pytest.importorskip("transformers")
llama_cpp = pytest.importorskip("llama_cpp")

VOCAB = 384
SEQ = 64
CTX = 128
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": CTX, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}
# original length 32 (< the 64 positions run): with theta 1e4 and head_dim 16 the first frequency is kept, the second
# blended, the other six divided by the factor
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# name -> (transformers config class, its fields, llama.cpp architecture)
FAMILIES = {
    "llama31": ("LlamaConfig", {"rope_scaling": LLAMA3, "rope_theta": 10000.0}, "llama"),
    "llama32": ("LlamaConfig", {"rope_scaling": LLAMA3, "rope_theta": 500000.0, "tie_word_embeddings": True}, "llama"),
    "llama_linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "llama"),
    # YaRN from original length 32 (< the 64 positions run), theta 1e4, head_dim 16: ramp over dims 0-2, so dim 0
    # kept, dim 1 blended, dims 2-7 divided by 4; cos / sin times 0.1 ln 4 + 1. Qwen2.5's form, the "type" key.
    "llama_yarn": ("LlamaConfig", {"rope_scaling": YARN}, "llama"),
    "qwen2_yarn": ("Qwen2Config", {"rope_scaling": {**YARN, "type": "yarn"}}, "qwen2"),
    "llama_bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}, "llama"),
    "mistral": ("MistralConfig", {"sliding_window": CTX}, "llama"),
    "qwen2": ("Qwen2Config", {}, "qwen2"),
    "qwen2_tied": ("Qwen2Config", {"tie_word_embeddings": True}, "qwen2"),
    "qwen3": ("Qwen3Config", {"head_dim": 32}, "qwen3"),
    "gemma": ("GemmaConfig", {"head_dim": 32, "tie_word_embeddings": True}, "gemma"),
    # query_pre_attn_scalar = head_dim: what llama.cpp's gemma2 scales by (a 24 is refused below)
    "gemma2": ("Gemma2Config", {"head_dim": 32, "tie_word_embeddings": True, "num_hidden_layers": 3,
                                "sliding_window": 16, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 2.0,
                                "final_logit_softcapping": 3.0}, "gemma2"),
}
# the perturbation added to every weight; Llama 3.2's larger one makes its greedy continuation more than one token
# repeated (the smallest top-1 / top-2 logit gap over its 32 greedy steps: 0.014, far above the f32 differences)
NOISE = {"llama32": 0.2}
F32_TOL = 1e-5  # f32 file, f32 KV cache, relative to the largest logit (at least 1)
GELU_TOL = 2e-4  # Gemma's, against our model with ggml's fp16-table GELU (measured <= 9e-5)
F16_TOL = 5e-3  # f16 file, llama.cpp's default f16 KV cache, against our f16-rounded weights, relative (measured 3e-3)
PROMPT = "ROMEO:\nWhat light through yonder window breaks? It is the east"


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok = train_bpe([corpus_text("train", max_chars=100_000)], VOCAB)
    tok.save(str(path))
    assert tok.get_vocab_size() == VOCAB
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer_file):
    """name -> a trainscale model folder of that family (the transformers model loaded by runtime/hf_init.py, with
    the test tokenizer), built once on first use."""
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.hf_init import hf_folder_spec, load_hf_init
    from trainscale.runtime.model import build_model

    root, built = tmp_path_factory.mktemp("gguf-families"), {}

    def get(name: str) -> Path:
        if name not in built:
            cls, fields, _ = FAMILIES[name]
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, **fields}))
            with torch.no_grad():
                for _, p in hf.named_parameters():
                    p.add_(NOISE.get(name, 0.05) * torch.randn(p.shape))  # biases and norm gains non-trivial
            hf.save_pretrained(str(root / name / "hf"))
            spec = hf_folder_spec(root / name / "hf")
            model = build_model(spec, "meta")
            model.to_empty(device="cpu")
            load_hf_init([model], root / name / "hf", spec)
            built[name] = save_model_dir(root / name / "model", model.state_dict(), spec, tokenizer_file)
        return built[name]

    return get


def tokens(seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(seed)).tolist()


def llama_cpp_logits(path: Path, ids: list[int], f32_cache: bool = True):
    """llama.cpp's logits for every position of ``ids`` -> (numpy [len, vocab], the Llama). GGML_TYPE_F32 = 0 for the
    KV cache, else llama.cpp's default (f16)."""
    cache = {"type_k": 0, "type_v": 0} if f32_cache else {}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=CTX, n_threads=2, verbose=False, logits_all=True, seed=0,
                          **cache)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)]), llm


def ours(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].numpy()


def ggml_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """ggml's CPU GELU (ggml-cpu vec.h ggml_vec_gelu_f32 with GGML_GELU_FP16): 0 below -10, x above 10, else the tanh
    GELU of x rounded to fp16, from a table of fp16 values."""
    y = _torch_gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


_torch_gelu = torch.nn.functional.gelu


@pytest.mark.parametrize("name", list(FAMILIES))
def test_llama_cpp_logits_equal_ours_f32(folder, tmp_path, name, monkeypatch):
    import gguf

    model, spec, _ = load_for_inference(folder(name))
    rep = export_gguf(folder(name), tmp_path / f"{name}.gguf", "f32")
    assert rep["architecture"] == FAMILIES[name][2]
    assert rep["tensor_bytes"] == gguf_tensor_bytes(spec, "f32", llama_cpp_mix=False)  # rope_freqs counted too
    ids = tokens()
    theirs, _ = llama_cpp_logits(rep["out"], ids)
    ref = ours(model, ids)
    diff, scale = float(np.abs(theirs - ref).max()), max(1.0, float(np.abs(ref).max()))
    print(f"{name} ({rep['architecture']}, f32): max |llama.cpp - ours| {diff:.2e} (max |logit| {scale:.1f})")
    if spec.gate_act == "gelu_tanh":  # Gemma: ggml's GELU goes through fp16
        assert diff < 2e-3
        monkeypatch.setattr(torch.nn.functional, "gelu", ggml_gelu)
        diff = float(np.abs(theirs - ours(model, ids)).max())
        print(f"{name}: with ggml's fp16 GELU in our model {diff:.2e}")
        assert diff < GELU_TOL
    else:
        assert diff < F32_TOL * scale
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(rep["out"]).tensors}
    assert ("output.weight" in types) == (not spec.tied_embeddings)  # tied: llama.cpp's head is token_embd
    assert {t for n, t in types.items() if n.endswith(("norm.weight", ".bias"))} <= {"F32"}


@pytest.mark.parametrize("name", ["llama32", "qwen3", "gemma2"])
def test_llama_cpp_logits_equal_ours_f16(folder, tmp_path, name):
    model, spec, _ = load_for_inference(folder(name))
    rep = export_gguf(folder(name), tmp_path / f"{name}.gguf", "f16")
    assert rep["tensor_bytes"] == gguf_tensor_bytes(spec, "f16", llama_cpp_mix=False)
    ids = tokens(2)
    theirs, _ = llama_cpp_logits(rep["out"], ids, f32_cache=False)
    ref = ours(model.half().float(), ids)
    diff, scale = float(np.abs(theirs - ref).max()), max(1.0, float(np.abs(ref).max()))
    print(f"{name} ({rep['architecture']}, f16, f16 KV cache): max |llama.cpp - ours| {diff:.2e} "
          f"(max |logit| {scale:.1f})")
    assert diff < F16_TOL * scale


def test_rope_freqs_are_llama_cpps_llama3_factors_and_gemma_norms_carry_the_one(folder, tmp_path):
    """rope_freqs.weight holds the divisors convert_hf_to_gguf.py's LlamaModel computes from the config (here
    recomputed from its formula: 1 for wavelengths below L / high_freq_factor, the factor above L / low_freq_factor,
    1 / ((1 - s) / factor + s) with s = (L / wavelength - low) / (high - low) between); Gemma's norm gains are 1 + w;
    Qwen3's Q rows and its per-head norm gain are in Hugging Face's rotate-half order."""
    import gguf

    from trainscale.hf import rope_interleaved_to_half

    def tensors(name: str) -> dict[str, np.ndarray]:
        rep = export_gguf(folder(name), tmp_path / f"{name}.gguf", "f32")
        return {t.name: np.array(t.data) for t in gguf.GGUFReader(rep["out"]).tensors}

    got = tensors("llama31")["rope_freqs.weight"]
    theta, dim, factor, lo, hi, old = 10000.0, 16, 32.0, 1.0, 4.0, 32
    want = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / dim))
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = 1 / ((1 - smooth) / factor + smooth)
        want.append(1.0 if wavelen < old / hi else factor if wavelen > old / lo else blended)
    assert got.shape == (dim // 2,) and np.allclose(got, want, rtol=1e-6)
    assert got[0] == 1.0 and 1.0 < got[1] < factor and (got[2:] == factor).all()  # all three regimes present

    gemma, (model, _, _) = tensors("gemma"), load_for_inference(folder("gemma"))
    sd = model.state_dict()
    assert np.array_equal(gemma["blk.0.attn_norm.weight"], (1.0 + sd["layers.0.attention_norm.weight"]).numpy())
    assert np.array_equal(gemma["output_norm.weight"], (1.0 + sd["norm.weight"]).numpy())

    qwen3, (model, spec, _) = tensors("qwen3"), load_for_inference(folder("qwen3"))
    sd = model.state_dict()
    wq = rope_interleaved_to_half(sd["layers.0.attention.wq.weight"], spec.n_heads, spec.head_dim).numpy()
    assert np.array_equal(qwen3["blk.0.attn_q.weight"], wq)
    assert not np.array_equal(qwen3["blk.0.attn_q.weight"], sd["layers.0.attention.wq.weight"].numpy())
    qn = rope_interleaved_to_half(sd["layers.0.attention.q_norm.weight"], 1, spec.head_dim).numpy()
    assert np.array_equal(qwen3["blk.0.attn_q_norm.weight"], qn)


@pytest.mark.slow
def test_tied_llama32_greedy_equals_trainscale_generate_and_tokenizer_agrees(folder, tmp_path):
    """A tied Llama 3.2-shaped model with llama3 RoPE: llama.cpp's greedy continuation of a prompt equals
    `trainscale generate --temperature 0`'s, token for token, and the file's tokenizer.ggml.* tokenize the prompt and
    a held-out page to our tokenizer's ids (and detokenize back)."""
    import gguf

    from trainscale.runtime.data.sources import corpus_text

    src = folder("llama32")
    rep = export_gguf(src, tmp_path / "llama32.gguf", "f32")
    n = 32
    r = subprocess.run([sys.executable, "-m", "trainscale", "generate", str(src), "-p", PROMPT, "-n", str(n),
                        "--temperature", "0", "--no-stop", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    ours_ids = json.loads(r.stdout)["token_ids"]
    tok = load_tokenizer_for(Path(src))
    ids = tok.encode(PROMPT).ids
    _, llm = llama_cpp_logits(rep["out"], ids)
    assert llm.tokenize(PROMPT.encode(), add_bos=False, special=False) == ids
    theirs: list[int] = []
    for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        theirs.append(t)
        if len(theirs) == n:
            break
    print(f"greedy: ours {ours_ids}\n        llama.cpp {theirs}")
    assert theirs == ours_ids and len(set(ours_ids)) > 3  # a continuation, not one token repeated
    held = corpus_text("val", max_chars=5000)
    held_ids = tok.encode(held).ids
    assert llm.tokenize(held.encode(), add_bos=False, special=False) == held_ids
    assert llm.detokenize(held_ids).decode() == tok.decode(held_ids) == held
    fields = gguf.GGUFReader(rep["out"]).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2" and fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert len(fields["tokenizer.ggml.tokens"].contents()) == VOCAB


def _spec(folder, name: str, **update):
    from trainscale.runtime.artifact import read_spec

    return read_spec(folder(name)).model_copy(update=update)


@pytest.mark.parametrize(("name", "update", "message"), [
    ("mistral", {"sliding_window": 16}, "a sliding window of 16 tokens, shorter than its context of 128"),
    ("qwen2", {"rope_scaling": "llama3", "rope_factor": 8.0}, "RoPE scaling 'llama3'"),
    ("gemma2", {"query_scale": 24.0}, "query_pre_attn_scalar 24 .*scales queries by 32"),
    ("gemma2", {"attn_softcap": 0.0}, "without its output norms and both soft-caps"),
    ("gemma2", {"window_layers": None}, r"a sliding window on layers \[0, 1, 2\]"),
    ("gemma", {"tied_embeddings": False}, "a Gemma without all of"),
    ("llama31", {"norm_offset": True}, "Gemma's \\(1 \\+ w\\) norms"),
    ("qwen3", {"n_experts": 4, "experts_per_token": 2}, "experts in a qwen3 model"),
    ("llama31", {"positions": "learned"}, "positions=learned"),
    ("llama_yarn", {"rope_attention_factor": 1.5}, "a YaRN attention factor other than 0.1 ln"),
    ("qwen2_yarn", {"rope_truncate": False}, "YaRN with truncate = false"),
])
def test_what_llama_cpp_cannot_compute_is_refused_in_one_sentence(folder, name, update, message):
    with pytest.raises(TrainscaleError, match=message) as e:
        check_gguf(_spec(folder, name, **update))
    assert "\n" not in str(e.value)


def test_gemma2_27b_shape_is_scaled_as_llama_cpp_scales_it(folder):
    """46 layers is llama.cpp's Gemma 2 27B, whose queries it scales by (d_model / n_heads)^-0.5: a model with that
    query_pre_attn_scalar passes, one with head_dim is refused."""
    spec = _spec(folder, "gemma2", n_layers=46, window_layers=tuple(range(0, 46, 2)))
    assert spec.d_model // spec.n_heads != spec.head_dim
    assert check_gguf(spec.model_copy(update={"query_scale": float(spec.d_model // spec.n_heads)})) == "gemma2"
    with pytest.raises(TrainscaleError, match="scales queries by 16"):
        check_gguf(spec.model_copy(update={"query_scale": float(spec.head_dim)}))


@pytest.mark.slow
def test_cli_exports_each_family_with_its_architecture_and_refuses_in_one_line(folder, tmp_path):
    from trainscale.runtime.artifact import save_model_dir

    r = subprocess.run([sys.executable, "-m", "trainscale", "export", str(folder("qwen3")), str(tmp_path / "q.gguf"),
                        "--to", "gguf", "--type", "f32", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["architecture"] == "qwen3" and rep["equal"] and rep["type"] == "f32"
    model, spec, src = load_for_inference(folder("mistral"))
    short = save_model_dir(tmp_path / "mistral16", model.state_dict(), spec.model_copy(update={"sliding_window": 16}),
                           src / "tokenizer.json")
    r = subprocess.run([sys.executable, "-m", "trainscale", "export", str(short), str(tmp_path / "m.gguf"),
                        "--to", "gguf"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "shorter than its context of 128" in r.stderr
    assert not (tmp_path / "m.gguf").exists()
