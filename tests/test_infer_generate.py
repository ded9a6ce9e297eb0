"""Generation with a KV cache: same logits as the full forward pass, bytes equal to the estimator."""

from __future__ import annotations

import pytest
import torch
from infer_fixtures import small_model_dir  # noqa: F401  (session fixture)

from trainscale.errors import TrainscaleError
from trainscale.estimate.memory import kv_cache_bytes, kv_cache_bytes_per_token
from trainscale.infer.generate import KVCache, Sampling, generate_ids, sample_next
from trainscale.runtime.model import build_model
from trainscale.specs import load_model

GQA = {"n_layers": 3, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "vocab_size": 97, "max_seq_len": 64}


@pytest.mark.parametrize("fields", [GQA, {**GQA, "n_kv_heads": 1, "tied_embeddings": True},
                                    {**GQA, "mlp": "gelu", "norm": "layernorm", "positions": "learned", "bias": True}])
def test_cached_forward_equals_full_forward(fields):
    """The prompt prefilled in one chunk then one token at a time, or chunks of several tokens after cached ones
    (the queries are the last s of t keys: the causal mask's offset), give the full forward pass's logits."""
    spec = load_model(fields)
    model = build_model(spec, seed=1).eval()
    tokens = torch.randint(0, spec.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        for cuts in ([0, *range(7, 21)], [0, 5, 11, 12, 20]):
            cache = KVCache(spec, 2, 20)
            parts = [model(tokens[:, a:b], cache=cache) for a, b in zip(cuts, cuts[1:], strict=False)]
            assert cache.length == 20
            assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5, rtol=0)
        with pytest.raises(TrainscaleError, match="holds 20 positions"):
            model(tokens[:, :1], cache=cache)


@pytest.mark.parametrize("fields", [GQA, {**GQA, "mlp": "gelu", "norm": "layernorm", "positions": "learned"}])
def test_generation_with_cache_equals_full_recompute(fields):
    """Greedy tokens and every step's logits (fp32, within 1e-5) of cached generation are those of running
    the whole sequence again each step; the cache goes through runtime/model.py's one attention block."""
    spec = load_model(fields)
    model = build_model(spec, seed=3).eval()
    calls = []
    for block in model.layers.values():  # count the shared attention kernel's calls with a cache
        core = block.attention.core
        block.attention.core = lambda q, k, v, core=core: calls.append(k.shape[2]) or core(q, k, v)
    prompt = [5, 17, 42, 8, 64, 3, 11]
    g = generate_ids(model, prompt, 16, Sampling(temperature=0), keep_logits=True)
    assert calls[:spec.n_layers] == [len(prompt)] * spec.n_layers  # prefill: the prompt's keys
    assert calls[-1] == len(prompt) + 15  # the last step: every cached key
    seq = list(prompt)
    with torch.no_grad():
        for step in range(16):
            full = model(torch.tensor([seq]))[0, -1]
            assert torch.allclose(g.logits[step], full, atol=1e-5, rtol=0), step
            seq.append(int(full.argmax()))
    assert g.new_ids == seq[len(prompt):]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_cache_bytes_equal_estimator(dtype):
    spec = load_model(GQA)
    cache = KVCache(spec, 3, 50, dtype)
    bpv = torch.empty((), dtype=dtype).element_size()
    # 2 (K, V) x 3 layers x 2 kv heads x 16 head_dim x bytes, per token
    assert kv_cache_bytes_per_token(spec, bpv) == 2 * 3 * 2 * 16 * bpv
    assert cache.nbytes == kv_cache_bytes(spec, 50, 3, bpv) == 2 * 3 * 2 * 16 * bpv * 50 * 3


@pytest.mark.slow
def test_greedy_generation_matches_uncached_argmax(small_model_dir):  # noqa: F811
    from trainscale.infer.load import load_for_inference, load_tokenizer_for

    model, spec, folder = load_for_inference(small_model_dir)
    ids = load_tokenizer_for(folder).encode("ROMEO:\nWhat light").ids
    g = generate_ids(model, ids, 24, Sampling(temperature=0))
    seq = list(ids)
    with torch.no_grad():
        for _ in range(24):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert g.new_ids == seq[len(ids):]
    assert g.kv_cache_bytes == kv_cache_bytes(spec, len(ids) + 24, 1, 4)
    g16 = generate_ids(model, ids, 24, Sampling(temperature=0), kv_dtype=torch.bfloat16)
    assert g16.kv_cache_bytes == kv_cache_bytes(spec, len(ids) + 24, 1, 2)


def test_sampling_seed_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    draw = lambda s, n=400: [int(sample_next(logits, s, torch.Generator().manual_seed(i))) for i in range(n)]  # noqa: E731
    assert set(draw(Sampling(1.0, top_k=1))) == {0}
    assert set(draw(Sampling(1.0, top_k=3))) <= {0, 1, 2}
    assert len(set(draw(Sampling(1.0, top_k=3)))) == 3
    # softmax = [.59, .22, .13, .08, ...]: top_p 0.7 keeps the two tokens whose predecessors sum below 0.7
    assert set(draw(Sampling(1.0, top_p=0.7))) == {0, 1}
    assert set(draw(Sampling(1.0, top_p=0.05))) == {0}
    assert set(draw(Sampling(0.0))) == {0}
    assert len(set(draw(Sampling(1.0)))) >= 5
    spec = load_model(GQA)
    model = build_model(spec).eval()
    a = generate_ids(model, [1, 2, 3], 20, Sampling(1.0, seed=7)).new_ids
    assert a == generate_ids(model, [1, 2, 3], 20, Sampling(1.0, seed=7)).new_ids
    assert a != generate_ids(model, [1, 2, 3], 20, Sampling(1.0, seed=8)).new_ids


def test_generation_errors():
    model = build_model(load_model(GQA)).eval()
    with pytest.raises(TrainscaleError, match="context"):
        generate_ids(model, [1] * 60, 10)
    with pytest.raises(TrainscaleError, match="empty"):
        generate_ids(model, [], 10)
    with pytest.raises(TrainscaleError, match="top-p"):
        generate_ids(model, [1], 4, Sampling(top_p=0))
