"""Issue 30, item 4: the fast attention path. ``causal_attention`` hands SDPA the K/V heads of a GQA model as they
are (``enable_gqa=True``) where no mask is given, instead of copying them with repeat_interleave; the result equals
the repeated form to 1e-6 in fp32 (forward and gradients) in every case the model uses: causal, a sliding window,
packed documents, a KV cache's queries (several, or one). Multi-head latent attention is planner-only
(rules.check_model), so it has no runtime path to compare."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trainscale.runtime.model import causal_attention, document_mask

B, H, KV, D = 2, 8, 2, 16


def _qkv(s: int, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, s, D, generator=g)
    k, v = torch.randn(B, KV, t, D, generator=g), torch.randn(B, KV, t, D, generator=g)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def _repeated(q, k, v, mask=None, causal=False):
    """The former form: K/V heads copied for their query groups, then SDPA on equal head counts."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def _masks(s: int, t: int, window: int = 0) -> torch.Tensor:
    i = torch.arange(t - s, t)[:, None]
    j = torch.arange(t)[None, :]
    seen = j <= i
    return seen & (j > i - window) if window else seen


def _positions() -> torch.Tensor:  # two rows of packed documents (positions restart at 0)
    return torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7],
                         [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 0, 1]])


CASES = {
    "causal": (16, 16, {}, lambda s, t: (None, True)),
    "window": (16, 16, {"window": 5}, lambda s, t: (_masks(s, t, 5), False)),
    "documents": (16, 16, {"mask": document_mask(_positions())}, lambda s, t: (document_mask(_positions()), False)),
    "documents+window": (16, 16, {"mask": document_mask(_positions()), "window": 3},
                         lambda s, t: (document_mask(_positions()) & _masks(s, t, 3), False)),
    "cached": (4, 16, {}, lambda s, t: (_masks(s, t), False)),
    "cached+window": (4, 16, {"window": 6}, lambda s, t: (_masks(s, t, 6), False)),
    "one token": (1, 16, {}, lambda s, t: (None, False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gqa_attention_equals_the_repeated_form(case):
    s, t, kw, ref_args = CASES[case]
    q, k, v = _qkv(s, t)
    got = causal_attention(q, k, v, **kw)
    mask, causal = ref_args(s, t)
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    want = _repeated(q2, k2, v2, mask, causal)
    assert got.shape == want.shape == (B, H, s, D)
    assert (got - want).abs().max().item() <= 1e-6, case
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (got * w).sum().backward()
    (want * w).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):  # dK, dV: each K/V head sums its query group's gradients
        assert (a.grad - b.grad).abs().max().item() <= 1e-6, case


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_causal_path_copies_no_kv_heads():
    """Training's path (causal, no mask): one fused SDPA kernel reads the 2 K/V heads for the 8 query heads (the
    CPU's flash kernel here, which runtime/probe/compare.py counts); no repeat_interleave or index_select copies."""
    q, k, v = _qkv(16, 16)
    with _Ops() as ops:
        causal_attention(q, k, v).sum().backward()
    assert not [n for n in ops.names if "repeat" in n or "index_select" in n], ops.names
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops.names


def test_equal_head_counts_are_unchanged():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, 16, D, generator=g) for _ in range(3))
    assert torch.equal(causal_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))
