"""Compute measurements at a model's shapes: the FLOPs each one divides by (GEMMs, causal attention), the
achieved FLOP/s of the layer GEMMs, the lm-head GEMM and attention, memory bandwidth, AdamW's step, one
real decoder layer (alone, and under tensor parallelism), and what of that layer no FLOP count sees."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from trainscale.estimate.measured.machine import machine_from_profile
from trainscale.estimate.measured.rank import layer_step_time
from trainscale.estimate.params import layer_tensors
from trainscale.runtime.model import Block, build_model, rope_angles
from trainscale.runtime.parallel.parallelize import apply_tensor_parallel
from trainscale.runtime.probe.calibrate.timing import best_seconds, compute_dtype, device, median_seconds, sync
from trainscale.specs import Layout, ModelSpec


def layer_linear_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """(in_features k, out_features n) of every nn.Linear in one decoder layer of runtime/model.py:
    wq, wk, wv, wo, then the MLP (SwiGLU: w1, w3, w2; GELU: w1, w2)."""
    d = spec.d_model
    shapes = [(d, spec.q_dim), (d, spec.kv_dim), (d, spec.kv_dim), (spec.q_dim, d)]
    shapes += [(d, spec.d_ff)] * (2 if spec.mlp == "swiglu" else 1)
    return shapes + [(spec.d_ff, d)]


def linear_train_flops(shapes: list[tuple[int, int]], tokens: int) -> int:
    """FLOPs of forward + backward of linears (k, n) on ``tokens`` rows: forward [m,k]x[k,n], input
    gradient [m,n]x[n,k], weight gradient [k,m]x[m,n] = 3 x 2mkn each (Kaplan et al. 2020, 6N per token)."""
    return sum(6 * tokens * k * n for k, n in shapes)


def layer_matmul_flop_count(spec: ModelSpec, tokens: int) -> int:
    """FLOPs of one decoder layer's GEMMs, forward and backward, for ``tokens`` tokens."""
    return linear_train_flops(layer_linear_shapes(spec), tokens)


def attention_flop_count(spec: ModelSpec, micro_batch: int, seq_len: int) -> int:
    """Causal attention forward + backward: forward QK^T and PV = 4·b·h·s²·d, halved by the causal mask;
    backward twice the forward (Dao 2023, FlashAttention-2 §4 FLOP count), so 3 x 2·b·h·s²·d."""
    return 3 * 2 * micro_batch * spec.n_heads * seq_len**2 * spec.head_dim


def gemm_train_flops(shapes: list[tuple[int, int]], tokens: int, budget_s: float = 1.0, min_repeat: int = 3,
                     dtype: torch.dtype | None = None) -> float:
    """Achieved FLOP/s of the forward and backward GEMMs of linears (k, n) at ``tokens`` rows, laid out as
    nn.Linear runs them (weight [n, k]): y = x w^T, dx = dy w, dw = dy^T x."""
    dev, dtype = device(), dtype or compute_dtype()
    mats = []
    for k, n in shapes:
        x = torch.randn(tokens, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype) / math.sqrt(k)
        dy = torch.randn(tokens, n, device=dev, dtype=dtype)
        mats.append((x, w, dy, torch.empty_like(dy), torch.empty_like(x), torch.empty_like(w)))

    def run():
        for x, w, dy, y, dx, dw in mats:
            torch.mm(x, w.t(), out=y)
            torch.mm(dy, w, out=dx)
            torch.mm(dy.t(), x, out=dw)
        sync()

    return linear_train_flops(shapes, tokens) / median_seconds(run, budget_s, min_repeat)


def attention_flops(spec: ModelSpec, micro_batch: int, seq_len: int, budget_s: float = 1.0, min_repeat: int = 3,
                    dtype: torch.dtype | None = None) -> float:
    """Achieved FLOP/s of causal scaled_dot_product_attention forward + backward on [b, n_heads, s, head_dim]."""
    dev, dtype = device(), dtype or compute_dtype()
    shape = (micro_batch, spec.n_heads, seq_len, spec.head_dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device=dev, dtype=dtype)

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), dout)
        sync()

    return attention_flop_count(spec, micro_batch, seq_len) / median_seconds(run, budget_s, min_repeat)


def memory_bandwidth(nbytes: int = 256 * 2**20, repeat: int = 5, budget_s: float | None = None) -> float:
    """Bytes/s of a large copy: read + write = 2 x bytes moved. Best of ``repeat``, or the median over
    ``budget_s`` seconds when given."""
    dev = device()
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)

    def run():
        dst.copy_(src)
        sync()

    t = best_seconds(run, repeat) if budget_s is None else median_seconds(run, budget_s)
    return 2.0 * nbytes / t


def tensor_parallel_overhead(profile: dict[str, Any], n: int, spec: ModelSpec, seq_len: int, micro_batch: int,
                             layer_seconds: float) -> dict[str, float]:
    """The measured tensor-parallel layer against the same layer composed from this profile's figures
    (estimate/measured/rank.py: GEMMs, attention, elementwise work, the TP collectives): what is left per token is
    DTensor's own cost (dispatch, redistribution copies), which no FLOP or byte count sees."""

    mach = replace(machine_from_profile(profile, n), tensor_parallel={})
    composed = layer_step_time(spec, Layout(tp=n), micro_batch, seq_len, mach)["total"]
    return {"layer_seconds": layer_seconds, "composed_seconds": composed,
            "overhead_seconds_per_token": max(0.0, layer_seconds - composed) / (micro_batch * seq_len),
            "matmul_flops": profile["processes"][str(n)]["matmul_flops"]}


def layer_fixed_seconds(layer_seconds: float, layer_seconds_one: float, micro_batch: int,
                        kernels: float = 0.0) -> float:
    """The part of one layer's forward + backward that does not grow with the micro-batch: the intercept of
    the line through the layer measured at one sequence and at ``micro_batch`` sequences,
    t(b) = fixed + b x per-sequence, so fixed = (micro_batch x t(1) - t(micro_batch)) / (micro_batch - 1).
    It is what every extra micro-batch costs beyond its tokens (operator dispatch, autograd, GEMMs too small
    to run at the large shapes' rate). 0 when only one size was measured or noise makes it negative; at
    most the layer less its GEMM and attention kernels (``kernels``, at their measured rates), so that the
    parts still add up to the measured layer where the fixed part is nearly all of it (tiny shapes)."""
    if micro_batch <= 1:
        return 0.0
    intercept = (micro_batch * layer_seconds_one - layer_seconds) / (micro_batch - 1)
    return max(0.0, min(intercept, layer_seconds - kernels))


def elementwise_seconds_per_token(spec: ModelSpec, micro_batch: int, seq_len: int, fig: dict[str, float]) -> float:
    """A real layer's time less its GEMMs and attention kernel (at their measured rates) and its fixed cost
    per call (``layer_fixed_seconds``), per token: the memory-bound work between the matmuls, which no FLOP
    count sees."""
    return max(0.0, fig["layer_seconds"] - fig.get("layer_fixed_seconds", 0.0)
               - layer_kernel_seconds(spec, micro_batch, seq_len, fig)) / (micro_batch * seq_len)


def layer_kernel_seconds(spec: ModelSpec, micro_batch: int, seq_len: int, fig: dict[str, float]) -> float:
    """A layer's GEMMs and attention kernel at the profile's measured rates."""
    return (layer_matmul_flop_count(spec, micro_batch * seq_len) / fig["matmul_flops"]
            + attention_flop_count(spec, micro_batch, seq_len) / fig["attention_flops"])


def _block_seconds(block: torch.nn.Module, spec: ModelSpec, micro_batch: int, rows: int, seq_len: int,
                   dev: torch.device, budget_s: float, min_repeat: int, collective: bool = False) -> float:
    """Median seconds of ``block`` forward + backward on [micro_batch, rows, d_model] (rows: this rank's share
    of the sequence), RoPE angles for the whole ``seq_len``."""
    dtype = compute_dtype()
    x = torch.randn(micro_batch, rows, spec.d_model, device=dev, dtype=dtype, requires_grad=True)
    dout = torch.randn_like(x)
    cos, sin = rope_angles(torch.arange(seq_len, device=dev), spec.head_dim, spec.rope_theta)

    def run():
        out = block(x, cos, sin)
        out.backward(dout)
        sync()

    return median_seconds(run, budget_s, min_repeat, collective=collective)


def block_seconds(spec: ModelSpec, micro_batch: int, seq_len: int, budget_s: float = 1.0, min_repeat: int = 3) -> float:
    """Median seconds of one real decoder layer (runtime/model.py's Block) forward + backward on
    [micro_batch, seq_len, d_model]: its GEMMs and attention kernel and everything between them (norms,
    RoPE, head repeats, activation function, residual adds) as the runtime runs them."""
    dev, dtype = device(), compute_dtype()
    with torch.device(dev):
        block = Block(spec).to(dtype)
    return _block_seconds(block, spec, micro_batch, seq_len, seq_len, dev, budget_s, min_repeat)


def tp_block_seconds(spec: ModelSpec, micro_batch: int, seq_len: int, world: int, dev: torch.device,
                     budget_s: float = 1.0, min_repeat: int = 3) -> float | None:
    """Median seconds of one real decoder layer under the runtime's tensor (+ sequence) parallel plan over
    all ``world`` processes of the current group (runtime/parallel/parallelize.py: DTensor column/row-parallel
    projections, sequence-sharded norms), forward + backward; None when ``world`` does not divide the heads,
    d_ff or the sequence. Every rank runs it at the same time."""
    if spec.n_heads % world or spec.n_kv_heads % world or spec.d_ff % world or seq_len % world:
        return None
    dtype = compute_dtype()
    model = build_model(spec.model_copy(update={"n_layers": 1}), dev).to(dtype)
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, {"tp": mesh}, sp=True)
    block = model.layers["0"]
    dist.barrier()
    return _block_seconds(block, spec, micro_batch, seq_len // world, seq_len, dev, budget_s, min_repeat,
                          collective=True)


def optimizer_shapes(spec: ModelSpec, target_params: int) -> list[tuple[int, ...]]:
    """Tensors shaped like one decoder layer's (repeated, or with fewer rows when a layer is larger than
    ``target_params``) adding up to about ``target_params`` parameters."""
    shapes = [shape for _, shape in layer_tensors(spec, 0)]
    per_layer = sum(math.prod(s) for s in shapes)
    if per_layer > target_params:
        f = target_params / per_layer
        return [(max(1, round(s[0] * f)), *s[1:]) if len(s) == 2 else s for s in shapes]
    return shapes * max(1, round(target_params / per_layer))


def optimizer_seconds_per_param(spec: ModelSpec, target_params: int = 2_000_000, budget_s: float = 1.0,
                                min_repeat: int = 3) -> float:
    """Seconds per parameter of one torch.optim.AdamW step (default implementation: foreach) over fp32
    parameters shaped like the model's layers."""
    dev = device()
    params = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in optimizer_shapes(spec, target_params)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    opt.step()  # the first step allocates exp_avg / exp_avg_sq; not part of the steady state

    def run():
        opt.step()
        sync()

    return median_seconds(run, budget_s, min_repeat) / sum(p.numel() for p in params)
