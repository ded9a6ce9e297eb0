"""A small trained model folder for the infer/ tests (and benchmarks/bench_quant.py).

Built in-process: runtime.model.build_model, a byte-level BPE from runtime.data.tokenizer.train_bpe on
a slice of the training plays, a short AdamW run on runtime.data.sources.corpus_text, saved with
runtime.artifact.save_model_dir. Import the fixture explicitly: ``from infer_fixtures import small_model_dir``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

SMALL = {"name": "infer-small", "n_layers": 4, "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "d_ff": 352,
         "vocab_size": 512, "max_seq_len": 256}
PROMPT = "ROMEO:\nWhat light through yonder window breaks? It is the east"


def train_small_model(out: Path, steps: int = 250, spec_fields: dict | None = None, batch: int = 16,
                      seq_len: int = 128, lr: float = 3e-3, text_chars: int | None = 400_000, seed: int = 0,
                      log=None) -> Path:
    """Train a tiny Llama-style model for ``steps`` AdamW steps and save it as a model folder."""
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe
    from trainscale.runtime.model import build_model, lm_loss
    from trainscale.specs import load_model

    torch.manual_seed(seed)
    spec = load_model({**SMALL, **(spec_fields or {})})
    text = corpus_text("train", max_chars=text_chars)
    tok = train_bpe([text], spec.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    data = torch.tensor(tok.encode(text).ids)
    model = build_model(spec, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:  # linear warm-up, cosine decay
            g["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        chunk = torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()])
        loss = lm_loss(model(chunk[:, :-1]), chunk[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log is not None and (step % 50 == 0 or step == steps - 1):
            log(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)")
    save_model_dir(out, model.state_dict(), spec, out / "tokenizer.json")
    return out


_BUILT: dict[str, Path] = {}


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory) -> Path:
    """Trained once per test session: each test module imports this fixture, which pytest registers per
    module, so the folder is cached here (this module is imported once). Tests must not write into it.
    100 steps of 8 sequences (a fifth of train_small_model's default tokens, which benchmarks keep): the fast
    loop's one in-process training run, a trained model's text for the tests that read it."""
    if "small" not in _BUILT:
        _BUILT["small"] = train_small_model(tmp_path_factory.mktemp("infer") / "small", steps=100, batch=8)
    return _BUILT["small"]


# Mixtral's shape: every layer MoE, SwiGLU experts, no shared expert, top-k weights renormalised (what the HF
# and GGUF exports accept as a MoE). 300 steps (about a minute on 2 cores): its greedy text is not one token repeated.
MIXTRAL_SMALL = {"name": "infer-moe-small", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2,
                 "d_ff": 128, "n_experts": 4, "experts_per_token": 2, "d_ff_expert": 128, "router_norm_topk": True,
                 "first_dense_layers": 0, "max_seq_len": 128}


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory) -> Path:
    """A small trained Mixtral-shaped MoE model folder, built once per session (do not write into it)."""
    if "moe" not in _BUILT:
        _BUILT["moe"] = train_small_model(tmp_path_factory.mktemp("infer") / "moe", steps=300,
                                          spec_fields=MIXTRAL_SMALL, batch=16, seq_len=64, text_chars=200_000)
    return _BUILT["moe"]


def check_hf_export(hf: torch.nn.Module, model: torch.nn.Module, hf_dir: Path, tokenizer, vocab: int,
                    tensor_bytes: int, tol: float) -> float:
    """An exported folder as transformers loads it (``hf``) against our model: equal parameter counts, fp32
    bytes written, logits of two random sequences within ``tol``, and the same prompt tokenisation.
    Returns the largest logit difference."""
    import transformers

    n = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in hf.parameters()) == n and tensor_bytes == 4 * n
    x = torch.randint(0, vocab, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(x).logits.float() - model(x)).abs().max().item()
    assert diff < tol
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert hf_tok(PROMPT)["input_ids"] == tokenizer.encode(PROMPT).ids
    return diff


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    """llama-cpp-python's greedy continuation of ``ids``: its first ``n`` new tokens."""
    out: list[int] = []
    for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(t)
        if len(out) == n:
            break
    return out


def gguf_state_dict(path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a GGUF file holds, dequantized to fp32, under ``model``'s names and shapes."""
    import gguf
    import numpy as np

    from trainscale.estimate.inference import gguf_name

    by = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    return {k: torch.from_numpy(np.array(gguf.quants.dequantize(by[gguf_name(k)].data, by[gguf_name(k)].tensor_type),
                                         dtype=np.float32).reshape(v.shape)) for k, v in model.state_dict().items()}


def ggml_q8_0_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to ggml's Q8_0 along its last dim and back: per block of 32 values d = max|x| / 127, stored
    fp16, q = round(x * 127 / max|x|) (ggml-quants.c quantize_row_q8_0_ref; the x86 kernel quantize_row_q8_0
    rounds half to even, as torch.round does)."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    q = torch.round(b * torch.where(amax > 0, 127 / amax, 0))
    return (q * (amax / 127).half().float()).reshape(x.shape)


class GgmlQ8Activations(TorchFunctionMode):
    """Inside it, every matmul (``F.linear``, ``@``) whose weight operand is a view of one of ``weights`` first
    rounds its activations through Q8_0. That is llama.cpp's CPU arithmetic for Q8_0 and Q4_0 weights: ggml-cpu.c's
    type_traits_cpu gives both vec_dot_type GGML_TYPE_Q8_0, so ggml_compute_forward_mul_mat (dense layers) and
    ggml_compute_forward_mul_mat_id (the experts) quantize src1 with quantize_row_q8_0 before the dot products."""

    def __init__(self, weights) -> None:
        super().__init__()
        self.storages = {w.untyped_storage().data_ptr() for w in weights}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if getattr(func, "__name__", "") in ("linear", "matmul", "__matmul__") and isinstance(args[1], torch.Tensor) \
                and args[1].untyped_storage().data_ptr() in self.storages:
            args = (ggml_q8_0_round_trip(args[0]), *args[1:])
        return func(*args, **(kwargs or {}))


def llama_cpp_reference_logits(path, model: torch.nn.Module, ids: list[int]):
    """trainscale's logits on ``ids`` with the weights a GGUF file holds, computed as llama.cpp's CPU backend
    computes them: activations rounded through Q8_0 before each matmul with a Q8_0/Q4_0 weight (GgmlQ8Activations).
    F16 and F32 tensors (norms, the MoE router) multiply plain fp32 activations. -> numpy [len(ids), vocab]."""
    import gguf

    from trainscale.estimate.inference import gguf_name
    from trainscale.infer.quantize import model_from_state_dict

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    ref = model_from_state_dict(model.spec, gguf_state_dict(path, model))
    quantized = [w for k, w in ref.state_dict().items() if types[gguf_name(k)] in ("Q8_0", "Q4_0")]
    with torch.no_grad(), GgmlQ8Activations(quantized):
        return ref(torch.tensor([ids]))[0].numpy()


def check_llama_cpp_f16(path, model: torch.nn.Module, ids: list[int], n: int = 32):
    """llama.cpp on an f16 GGUF of ``model``: its logits on ``ids`` within 2e-2 of trainscale's on the file's
    weights (f16-rounded, computed in fp32; a MoE router stays F32, as the file keeps it) and its greedy
    continuation equal to trainscale's. -> (the Llama, the ``n`` greedy tokens). ``model`` is left f16-rounded."""
    import numpy as np
    from llama_cpp import Llama

    from trainscale.infer.generate import Sampling, generate_ids

    llm = Llama(model_path=str(path), n_ctx=model.spec.max_seq_len, n_threads=2, verbose=False, logits_all=True,
                seed=0)
    routers = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("router.weight")}
    m16 = model.half().float()
    m16.load_state_dict(routers, strict=False)
    ours = generate_ids(m16, ids, n, Sampling(temperature=0)).new_ids
    llm.reset()
    llm.eval(ids)
    with torch.no_grad():
        ref = m16(torch.tensor([ids]))[0].numpy()
    assert np.abs(np.array(llm.scores[:len(ids)]) - ref).max() < 2e-2
    assert llama_greedy(llm, ids, n) == ours
    return llm, ours


def make_hf_llama32(folder: Path, tokenizer_file: Path, vocab: int, shard: str | None = None):
    """A random Llama 3.2-shaped model built by transformers (llama3 RoPE scaling, tied embeddings, GQA), every
    weight perturbed, saved with save_pretrained (in shards of ``shard`` if given) with ``tokenizer_file`` as its
    tokenizer.json; -> the folder. Nothing downloaded."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    model.save_pretrained(str(folder), **({"max_shard_size": shard} if shard else {}))
    (folder / "tokenizer.json").write_bytes(Path(tokenizer_file).read_bytes())
    return folder


def cli_json(*args: str) -> dict:
    """A trainscale command run in-process with --json: it succeeds, and its one JSON object."""
    import json

    from typer.testing import CliRunner

    from trainscale.cli import app

    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def cli_error(*args: str) -> str:
    """The sentence of the TrainscaleError the command raises (cli.main prints it on one line, exit code 2)."""
    from typer.testing import CliRunner

    from trainscale.cli import app
    from trainscale.errors import TrainscaleError

    res = CliRunner().invoke(app, list(args))
    assert isinstance(res.exception, TrainscaleError), res.output
    return str(res.exception)
