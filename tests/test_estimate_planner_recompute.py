"""Full activation recomputation as torch runs it: torch's non-reentrant checkpoint stops its recomputation early,
before a block's last GEMM, and the planner charges that (issue 20, the activation-checkpointing split)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from trainscale.estimate import flops
from trainscale.estimate.planner import layer
from trainscale.estimate.planner.candidates import FULL, SELECTIVE, candidates
from trainscale.estimate.planner.efficiencies import load_efficiencies
from trainscale.estimate.planner.software import load_software, with_knobs
from trainscale.estimate.planner.step import recompute_flops_per_token
from trainscale.specs import load_gpu, load_model

D = 16


class _MPTLikeBlock(nn.Module):
    """An MPT block's order of ops (llm-foundry blocks.py MPTBlock: x + attn(norm(x)), then x + ffn(norm(x)) with
    up_proj, GELU, down_proj; no biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.wqkv, self.out_proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.up_proj, self.down_proj = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(self.norm_1(x)).chunk(3, dim=-1)
        x = x + self.out_proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down_proj(nn.functional.gelu(self.up_proj(self.norm_2(x))))


class _GemmLog(TorchDispatchMode):
    """The (k, n) of every 2-D GEMM the dispatcher runs: x (m, k) @ W^T (k, n)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            a, b = args[-2], args[-1]
            self.shapes.append((int(a.shape[1]), int(b.shape[1])))
        return func(*args, **(kwargs or {}))


def _backward_gemms(block: nn.Module, x: torch.Tensor, ckpt: dict[str, bool] | None = None) -> list[tuple[int, int]]:
    """The GEMMs of the backward of ``block`` on ``x``, run plain (``ckpt`` None) or in torch's non-reentrant
    checkpoint with ``ckpt``'s options ({}: its defaults)."""
    y = block(x) if ckpt is None else checkpoint(block, x, use_reentrant=False, **ckpt)
    with _GemmLog() as log:
        y.sum().backward()
    return log.shapes


def test_non_reentrant_checkpoint_recomputes_the_block_but_its_last_gemm() -> None:
    """torch/utils/checkpoint.py: with early stop (the default, `_enable_checkpoint_early_stop = True` since torch 2.0)
    the recomputation's pack hook raises _StopRecomputationError once it has re-saved as many tensors as the forward
    saved; the last saved are the down-projection's inputs, packed before it runs, so it is never recomputed. Counted
    here on torch itself: 4 forward GEMMs of the block come back in the backward without early stop, 3 with it, and
    the one missing is down_proj's (k = 4 D, n = D)."""
    torch.manual_seed(0)
    block, x = _MPTLikeBlock(), torch.randn(2, 8, D, requires_grad=True)
    plain = _backward_gemms(block, x)
    full = _backward_gemms(block, x, {"early_stop": False})
    early = _backward_gemms(block, x, {"early_stop": True})
    assert len(full) - len(plain) == 4 and len(early) - len(plain) == 3
    missing = list(full)
    for s in early:
        missing.remove(s)
    assert missing == [(4 * D, D)]
    assert len(_backward_gemms(block, x, {})) == len(early)  # torch's default


def _one_layer(m, gpu, sw, mb: int, recompute: int, seq: int, global_seqs: int):  # type: ignore[no-untyped-def]
    """(candidates, efficiencies, rates, GEMMs, dense layer times) of one dp8, zero3 layout with ``mb`` sequences per
    micro-batch and ``recompute``, as the planner builds them (candidates, layer.rates, dense_gemms, dense_layer)."""
    cfg = {"tp": [1], "cp": [1], "pp": [1], "dp": [8], "mb": [mb], "v": [1], "schedule": [0], "recompute": [recompute],
           "zero": [3], "hsdp": [1], "sp": [False]}
    c = candidates(m, {k: np.asarray(v) for k, v in cfg.items()}, seq, global_seqs)
    eff = load_efficiencies(gpu)
    r = layer.rates(gpu, eff, sw)
    g = layer.dense_gemms(m, c, r, sw)
    return c, eff, r, g, layer.dense_layer(m, c, r, eff, sw, seq, g)


def test_full_recompute_with_early_stop_charges_the_forward_less_w2() -> None:
    """llm-foundry (Composer 0.17.2 wraps each MPTBlock with checkpoint_impl NO_REENTRANT, torch 2.1): MPT-7B at
    mb 16 x 2048 tokens on an H100, full recompute. The planner's recompute of one layer is its forward less the
    w2 GEMM's forward (2 x 32768 x 16384 x 4096 FLOPs at the layer's GEMM rate); HFU's recomputed FLOPs per token
    lose 2 x 16384 x 4096 per layer, 32 layers."""
    m, gpu = load_model("mpt-7b"), load_gpu("h100-sxm")
    sw = load_software("llm-foundry-triton")
    assert sw.recompute_early_stop
    c, _, r, g, lay = _one_layer(m, gpu, sw, 16, FULL, 2048, 128)
    w2_f, _ = layer.gemm_train_time(16 * 2048, 16384, 4096, r.f_lay, r.hbm, r.sms, r.gap)
    assert float(g.last[0]) == pytest.approx(float(w2_f))
    without = float(layer.recompute_time(c, lay, with_knobs(sw, recompute_early_stop=False))[0])
    assert without == pytest.approx(float((lay.mm_f + lay.attn_f + lay.ew_f)[0]))
    assert float(layer.recompute_time(c, lay, sw)[0]) == pytest.approx(without - float(w2_f))
    drop = (float(recompute_flops_per_token(m, c, with_knobs(sw, recompute_early_stop=False), 2048)[0])
            - float(recompute_flops_per_token(m, c, sw, 2048)[0]))
    assert drop == pytest.approx(2 * 16384 * 4096 * 32)


def test_megatron_recompute_keeps_its_whole_forward() -> None:
    """Megatron's own CheckpointFunction (reentrant) has no early stop: its presets leave the knob off."""
    for name in ("megatron-lm-2021", "megatron-core", "nemo"):
        assert not load_software(name).recompute_early_stop


def test_torchtitan_selective_saves_the_attention_core() -> None:
    """torchtitan's op-level selective AC (@157a12c5 parallelize_llama.py no_recompute_list; later
    distributed/activation_checkpoint.py _save_list) always saves aten._scaled_dot_product_flash_attention's output,
    so its backward does not rerun attention: Llama 3.1 8B at 2 x 8192 tokens on an H100 (torchtitan's docs/
    performance.md layout), rc=selective. The knob removes exactly the FlashAttention-2 forward, counted by hand:
    the causal attention FLOPs of one layer over the kernel's rate, times the forward's share of its time."""
    m, gpu = load_model("llama3.1-8b"), load_gpu("h100-sxm")
    sw = load_software("torchtitan")
    assert not sw.recompute_attention_core
    assert not load_software("torchtitan-2024-04").recompute_attention_core
    assert not load_software("torchtitan-compile").recompute_attention_core
    for name in ("megatron-lm-2021", "megatron-core", "llm-foundry"):
        assert load_software(name).recompute_attention_core  # Korthikanti's selective: the core redone
    c, eff, r, _, lay = _one_layer(m, gpu, sw, 2, SELECTIVE, 8192, 16)
    flops_fb = flops.attention_flops_per_token(m, 8192, causal=True) / m.n_layers * 2 * 8192
    rate = layer.attention_rate(m, 8192, r.peak_attn, eff, r.attn) * sw.attention_speed
    attn_f = flops_fb / rate * layer.forward_share(r.attn, 8192, m.qk_head_dim)
    assert 0 < attn_f < float(lay.attn[0])
    redo = float(layer.recompute_time(c, lay, with_knobs(sw, recompute_attention_core=True))[0])
    saved = float(layer.recompute_time(c, lay, sw)[0])
    assert redo - saved == pytest.approx(float(attn_f))
    assert saved == pytest.approx(float((lay.sel + lay.ew_f)[0]))  # every second GEMM and the ops between them
    # HFU: the recomputed FLOPs per token lose the attention core's forward (1/3 of its causal training FLOPs)
    drop = (float(recompute_flops_per_token(m, c, with_knobs(sw, recompute_attention_core=True), 8192)[0])
            - float(recompute_flops_per_token(m, c, sw, 8192)[0]))
    assert drop == pytest.approx(flops.attention_flops_per_token(m, 8192, causal=True) / 3)
