"""A mixture-of-experts feed-forward (what ``ModelSpec.is_moe_layer(i)`` layers run instead of the dense FFN).

    router     logits = x W_r^T [tokens, E]; p = softmax(logits); top-k of p per token (Shazeer et al. 2017,
               arXiv 1701.06538), renormalised to sum to 1 when ``router_norm_topk`` (Mixtral, DeepSeek-V3)
    experts    each token's k rows, sorted by expert, run through E SwiGLU/GELU FFNs held as stacked weights
               ``w1``/``w3`` [E, width, d], ``w2`` [E, d, width]; the outputs, weighted by p, are added back
               per token. Dropless: every routed token is computed (capacity_factor 0).
    shared     one dense FFN of width d_ff_shared on every token (DeepSeekMoE, arXiv 2401.06066), gated by
               sigmoid(x w_g) when ``shared_expert_gate`` (Qwen2-MoE)
    balance    Switch Transformer's load-balance loss (Fedus et al. 2021, arXiv 2101.03961 eq. 4-6) for top-k,
               aux = coef * E * sum_e f_e P_e with f_e = tokens sent to e / (k T) and P_e = mean router
               probability of e, taken per sequence and averaged over sequences (DeepSeek-V3's
               sequence-wise form, arXiv 2412.19437 eq. 17-20): a mean of per-sequence terms does not depend
               on how a batch is cut over data-parallel ranks and micro-batches, so every layout trains the
               same model. The loss is not added to the language-model loss (which a pipeline holds only on
               its last stage): ``_AuxLossGrad`` passes the layer's output through and adds aux's gradient
               in the backward pass (Megatron-LM's MoEAuxLossAutoScaler).

Expert parallelism (runtime/parallel/parallelize.py sets ``ep_group``): the ep ranks hold E/ep experts each (the
weights are DTensors sharded on dim 0 over the mesh's "ep" dim). The dispatch exchanges the per-expert
token counts (one all_to_all_single), then the tokens (all_to_all_single with uneven splits); the combine
sends the expert outputs back by the reverse splits. ``_AllToAll`` is the autograd function whose
backward is the reverse all-to-all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainscale.runtime.collectives import group_device
from trainscale.specs import ModelSpec


@dataclass
class MoEStats:
    """What a MoE layer records between two reads (runtime/train.py reads and resets it every step). The counts and
    the balance loss stay on the device (a step that does not log reads nothing back)."""

    tokens: torch.Tensor | None = None  # [E] routed (token, expert) pairs counted in the forward pass
    a2a_seconds: float = 0.0  # wall time in the all-to-alls (forward, backward, recompute)
    a2a_bytes: int = 0  # bytes this rank sent in them
    aux: torch.Tensor | float = 0.0  # sum of this rank's balance-loss values (float64, on the device)

    def reset(self) -> None:
        self.tokens, self.a2a_seconds, self.a2a_bytes, self.aux = None, 0.0, 0, 0.0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup,
         stats: MoEStats) -> torch.Tensor:
    """all_to_all_single over dim 0 with uneven splits (rows this rank sends to / receives from each rank)."""
    t0 = time.perf_counter()
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    stats.a2a_seconds += time.perf_counter() - t0
    stats.a2a_bytes += x.numel() * x.element_size()
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to ranks and back: the backward sends each gradient row back where its row came from."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, stats):  # noqa: ANN001, ANN205
        ctx.args = (out_splits, in_splits, group, stats)
        return _a2a(x, out_splits, in_splits, group, stats)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        out_splits, in_splits, group, stats = ctx.args
        return _a2a(grad, in_splits, out_splits, group, stats), None, None, None, None


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in the backward pass, d(aux)/d(aux) = ``scale`` starts aux's own backward (so the
    balance loss trains the router on every pipeline stage, not only where the LM loss lives)."""

    @staticmethod
    def forward(ctx, out, aux, scale):  # noqa: ANN001, ANN205
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class FFN(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (Shazeer 2020, arXiv 2002.05202); GELU: w2(gelu(w1 x))."""

    def __init__(self, spec: ModelSpec, width: int) -> None:
        super().__init__()
        self.gated = spec.mlp == "swiglu"
        self.w1 = nn.Linear(spec.d_model, width, bias=spec.bias)
        if self.gated:
            self.w3 = nn.Linear(spec.d_model, width, bias=spec.bias)
        self.w2 = nn.Linear(width, spec.d_model, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class GroupedExperts(nn.Module):
    """E FFNs as stacked weights; ``forward(x, counts)`` runs rows x[sum(counts[:e]) : +counts[e]] through
    (local) expert e. A loop of matmuls over the local experts (torch._grouped_mm's CPU backward wants
    16-byte-aligned strides, which small experts do not have)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        e, w, d = spec.n_experts, spec.expert_width, spec.d_model
        self.gated = spec.mlp == "swiglu"
        self.w1 = nn.Parameter(torch.empty(e, w, d))
        if self.gated:
            self.w3 = nn.Parameter(torch.empty(e, w, d))
        self.w2 = nn.Parameter(torch.empty(e, d, w))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2 = _local(self.w1), _local(self.w2)  # [E_local, width, d], [E_local, d, width]
        w3 = _local(self.w3) if self.gated else None
        outs = []
        for e, xe in enumerate(torch.split(x, counts)):  # xe [n_e, d]
            h = F.silu(xe @ w1[e].T) * (xe @ w3[e].T) if self.gated else F.gelu(xe @ w1[e].T, approximate="tanh")
            outs.append(h @ w2[e].T)  # [n_e, d]
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


class MoE(nn.Module):
    """Router + routed experts (+ shared expert): ``forward(x [b, s, d]) -> [b, s, d]``.

    Set from outside, none of them parameters: ``ep_group`` (expert parallelism; None: every expert here),
    ``seq_groups`` (the groups holding other parts of this rank's sequences: cp, and tp under sequence
    parallelism; the balance loss counts tokens per whole sequence), ``seq_split`` (tp under sequence
    parallelism, else 1: how many ranks share this rank's tokens of a sequence without averaging their
    gradients), ``aux_scale`` (the factor the LM loss's gradient carries: 1 / micro-batches)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.n_experts, self.top_k = spec.n_experts, spec.experts_per_token
        self.norm_topk, self.aux_coef = spec.router_norm_topk, spec.aux_loss_coef
        if spec.capacity_factor:
            raise ValueError("only dropless routing (capacity_factor 0) runs")  # rules.check_model says it first
        self.router = nn.Linear(spec.d_model, spec.n_experts, bias=False)
        self.experts = GroupedExperts(spec)
        self.shared = FFN(spec, spec.d_ff_shared) if spec.d_ff_shared else None
        self.shared_gate = nn.Linear(spec.d_model, 1, bias=False) if spec.d_ff_shared and spec.shared_expert_gate \
            else None
        self.ep_group: dist.ProcessGroup | None = None
        self.seq_groups: tuple[dist.ProcessGroup, ...] = ()
        self.seq_split = 1
        self.aux_scale = 1.0
        self.stats = MoEStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, d = x.shape
        flat = x.reshape(-1, d)  # [n, d]
        probs = self.router(flat).float().softmax(-1)  # [n, E]
        weights, idx = probs.topk(self.top_k, dim=-1)  # [n, k]
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        expert_of = idx.reshape(-1)  # [n k]
        order = expert_of.argsort(stable=True)  # the (token, slot) pairs grouped by expert
        token_of = order // self.top_k
        counts = torch.bincount(expert_of, minlength=self.n_experts)  # [E]
        if torch._C._current_graph_task_id() == -1:  # the forward pass itself, not a recompute in the backward
            self.stats.tokens = counts.detach() if self.stats.tokens is None else self.stats.tokens + counts.detach()
        rows = flat[token_of]  # [n k, d]
        y = self._experts(rows, counts) if self.ep_group is not None else self.experts(rows, counts.tolist())
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(flat).index_add_(0, token_of, y)  # [n, d]
        if self.shared is not None:
            s = self.shared(flat)
            out = out + (torch.sigmoid(self.shared_gate(flat)) * s if self.shared_gate is not None else s)
        if self.training and self.aux_coef > 0 and torch.is_grad_enabled():
            aux = self._balance_loss(probs.view(bsz, seq, -1), idx.view(bsz, seq, -1))
            out = _AuxLossGrad.apply(out, aux, self.aux_scale)
        return out.view(bsz, seq, d)

    def _balance_loss(self, probs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """coef * mean over sequences of E * sum_e f_e P_e, this rank's share: f_e from the whole sequence's
        counts (summed over ``seq_groups``), P_e from this rank's tokens over the tokens of the sequence
        its gradient stands for (seq * seq_split); cp ranks average their gradients like the LM loss's."""
        bsz, seq, e = probs.shape
        with torch.no_grad():
            hits = torch.zeros(bsz, e, device=probs.device).scatter_add_(
                1, idx.reshape(bsz, -1), torch.ones(bsz, idx.shape[1] * idx.shape[2], device=probs.device))
            parts = 1
            for g in self.seq_groups:
                dist.all_reduce(hits, group=g)
                parts *= dist.get_world_size(g)
            f = hits / (self.top_k * seq * parts)  # [b, E] share of the sequence's routed slots per expert
        p = probs.sum(1) / (seq * self.seq_split)  # [b, E]
        aux = self.aux_coef * e * (f * p).sum(-1).mean()
        self.stats.aux = self.stats.aux + aux.detach().double()  # float64, as the host sum of Python floats was
        return aux

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dispatch rows (grouped by global expert) to the ranks holding their experts, run the local
        experts, send the outputs back. -> rows' outputs, in the order of ``rows``."""
        group, stats = self.ep_group, self.stats
        ep = dist.get_world_size(group)
        local = self.n_experts // ep
        t0 = time.perf_counter()
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)  # got[s * local + j]: rank s's rows for my expert j
        stats.a2a_seconds += time.perf_counter() - t0
        send = counts.view(ep, local).sum(1).tolist()
        recv_by = got.view(ep, local)
        recv = recv_by.sum(1).tolist()
        x = _AllToAll.apply(rows, recv, send, group, stats)  # [received, d], by source rank, then expert
        expert_of = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(got)
        perm = expert_of.argsort(stable=True)  # received rows grouped by local expert
        y = self.experts(x[perm], recv_by.sum(0).tolist())
        y = y[perm.argsort()]  # back to the order they arrived in
        return _AllToAll.apply(y, send, recv, group, stats)


def step_metrics(parts: list[tuple[int, nn.Module]], spec: ModelSpec, layout, n_micro: int) -> dict[str, Any]:
    """A training step's routing and all-to-all numbers, the same on every rank (collectives over the world):
    ``expert_tokens`` {layer: [tokens routed to each expert, whole global batch]} (a token counts once per
    expert it is sent to, so a layer's counts add up to k x tokens); ``moe_aux_loss`` the balance loss summed
    over the MoE layers (mean over micro-batches); ``a2a_s`` the slowest rank's seconds in the expert-parallel
    all-to-alls (forward, backward and any recompute), ``a2a_share`` that over the step time (None here: the
    caller fills it in once the step time is known), ``a2a_bytes`` the bytes the busiest rank sent. ``parts``:
    this rank's (stage, model) pairs, each with ``layers`` by layer index. Under a pipeline, step 1 also counts
    the schedule's shape-inference forward pass.

    The values are reduced on the device and left there: each is (a device tensor, the function of its host
    value that gives the row's value: a float for one element, else nested lists), read back with the rest of the
    row at the next logging step (runtime/job/metrics.Deferred): this adds no host sync to the step."""
    lo = layout
    dev = group_device()
    counts = torch.zeros(spec.n_layers, spec.n_experts, dtype=torch.float64, device=dev)
    aux = torch.zeros((), dtype=torch.float64, device=dev)
    a2a = [0.0, 0.0]
    for _, part in parts:
        for name, block in part.layers.items():
            m = getattr(block, "moe", None)
            if m is None:
                continue
            if m.stats.tokens is not None:
                counts[int(name)] += m.stats.tokens.to(dev, torch.float64)
            aux = aux + (m.stats.aux.to(dev) if isinstance(m.stats.aux, torch.Tensor) else m.stats.aux)
            a2a[0] += m.stats.a2a_seconds
            a2a[1] += m.stats.a2a_bytes
    host = torch.tensor(a2a, dtype=torch.float64)  # host clocks and byte counts: uploaded without waiting
    a2a_t = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host
    aux = aux.reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t, op in ((counts, dist.ReduceOp.SUM), (aux, dist.ReduceOp.SUM), (a2a_t, dist.ReduceOp.MAX)):
            dist.all_reduce(t, op=op)
    copies = lo.tp // (lo.tp if lo.sp else 1)  # without SP the tp ranks route the same tokens
    counts = counts / copies
    moe_ids = [i for i in range(spec.n_layers) if spec.is_moe_layer(i)]
    aux_div = (lo.dp * lo.cp * lo.tp / (lo.tp // copies))
    return {"expert_tokens": (counts, lambda c: {str(i): [int(round(x)) for x in c[i]] for i in moe_ids}),
            "moe_aux_loss": (aux, lambda a: a / aux_div / n_micro),
            "a2a_s": (a2a_t[0], float), "a2a_share": None, "a2a_bytes": (a2a_t[1], int)}
