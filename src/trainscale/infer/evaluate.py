"""Held-out perplexity: exp(mean next-token cross-entropy) over non-overlapping windows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trainscale.errors import TrainscaleError
from trainscale.runtime.data.sources import corpus_text


def eval_ids(tokenizer, text: str | None = None, max_tokens: int = 32768) -> list[int]:
    """Token ids of held-out text (default: the corpus's held-out plays), at most ``max_tokens``."""
    if text is None:
        text = corpus_text("val", max_chars=max_tokens * 8)
    ids = tokenizer.encode(text).ids[:max_tokens]
    if len(ids) < 2:
        raise TrainscaleError("the evaluation text is shorter than two tokens")
    return ids


@torch.no_grad()
def perplexity(model, ids: list[int], seq_len: int | None = None, batch: int = 8) -> float:
    """exp of the mean NLL of every token after the first in each window of ``seq_len`` + 1 tokens."""
    seq_len = min(seq_len or model.spec.max_seq_len, model.spec.max_seq_len)
    data = torch.tensor(ids)
    n = (len(ids) - 1) // seq_len
    windows = [data[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]
    rest = data[n * seq_len:]
    if len(rest) > 1:
        windows.append(rest)
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for i in range(0, len(windows), batch):
        group = windows[i:i + batch]
        for w in ([torch.stack(group)] if len({len(x) for x in group}) == 1 else [g[None] for g in group]):
            w = w.to(device)
            logits = model(w[:, :-1]).float()
            nll = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
            total += float(nll)
            count += w[:, 1:].numel()
    return math.exp(total / count)
