"""The held-out loss: how a text is cut into scored windows (one rule, also ``trainscale evaluate``'s:
infer/evaluate.nll_sum), and the trainer's evaluator, which owns its cadence.

Windows: a text of T tokens is cut into windows of seq_len + 1 tokens, each starting where the previous one's
targets end, so every token after the first is a target once; the first ``limit`` of them (the trainer's
``[run] eval_sequences``; all of them for ``evaluate``); a text that ends before ``limit`` full windows adds its
remainder (2 tokens or more) as one shorter last window, so a short held-out split is scored whole. Batches hold
up to ``batch`` windows of one length.

The evaluator: every ``[train] eval_every`` steps and at the end of a run, the unsharded weights (gathered to
rank 0 by the trainer, a collective) are built into one whole model that scores the held-out windows; rank 0
broadcasts the value, so every rank of every layout holds the same number.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainscale.runtime.data.loader import document_batch, unigram_loss
from trainscale.runtime.job.faults import requeue_count, restart_count
from trainscale.runtime.model import IGNORE, build_model, lm_loss_sum
from trainscale.runtime.parallel.parallelize import autocast_for
from trainscale.specs import Layout

Span = tuple[int, int]  # [start, stop) token indices of one window (inputs and targets: stop - start - 1 each)


def window_spans(n_tokens: int, seq_len: int, limit: int | None = None) -> list[Span]:
    """The windows of a text of ``n_tokens`` tokens (the module docstring's rule), as [start, stop) spans."""
    full = max(0, (n_tokens - 1) // seq_len)
    n = full if limit is None else min(limit, full)
    spans = [(i * seq_len, i * seq_len + seq_len + 1) for i in range(n)]
    if n == full and (limit is None or n < limit) and n_tokens - n * seq_len > 1:
        spans.append((n * seq_len, n_tokens))
    return spans


def window_batches(n_tokens: int, seq_len: int, limit: int | None = None, batch: int = 8) -> list[list[Span]]:
    """``window_spans`` in forward passes: ``batch`` windows at a time, a group of mixed lengths one by one."""
    spans = window_spans(n_tokens, seq_len, limit)
    out: list[list[Span]] = []
    for i in range(0, len(spans), batch):
        group = spans[i:i + batch]
        out.extend([group] if len({b - a for a, b in group}) == 1 else [[s] for s in group])
    return out


def document_args(corpus: Any, split: str, documents: bool) -> dict[str, Any]:
    """What a loader needs to keep documents apart (``documents``): chat data's flags, or the end-of-text id."""
    if not documents:
        return {}
    return {"flags": corpus.flags(split), "eot": corpus.eot_id, "documents": True}


def _rows(tokens: Any, group: list[Span], flags: Any = None, eot: int | None = None,
          documents: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One batch of windows of ``tokens`` -> (inputs, targets, positions or None), as ``document_batch`` makes
    them when documents are kept apart."""
    base, stop, width = group[0][0], group[-1][1], group[0][1] - group[0][0]
    idx = np.asarray([a - base for a, _ in group])[:, None] + np.arange(width)[None, :]
    x = np.asarray(tokens[base:stop], dtype=np.int64)[idx]
    if documents or flags is not None:
        f = np.asarray(flags[base:stop], dtype=np.uint8)[idx] if flags is not None else None
        return document_batch(x, f, eot)
    return torch.from_numpy(np.ascontiguousarray(x[:, :-1])), torch.from_numpy(np.ascontiguousarray(x[:, 1:])), None


class Evaluator:
    """The held-out loss of a training run's weights (module docstring): ``due`` says when, ``periodic`` runs
    one on every rank and records it, ``final`` is the run's last one, ``loss`` scores given weights."""

    BATCH = 16

    def __init__(self, cfg: Any, corpus: Any, device: torch.device, precision: Any, log: Callable[[str], None]
                 ) -> None:
        self.cfg, self.corpus, self.device, self.precision, self.log = cfg, corpus, device, precision, log
        self.every = cfg.train.eval_every
        self.sequences = cfg.run.eval_sequences
        self.last: dict[str, Any] | None = None  # the latest periodic evaluation's row
        self._counts = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def unigram_counts(self) -> Any:
        """The training tokens' counts per token id (from the prepared data; counted once)."""
        if self._counts is None:
            self._counts = self.corpus.unigram_counts()
        return self._counts

    def loss(self, state: dict[str, torch.Tensor] | None) -> tuple[float | None, float | None]:
        """(held-out loss, the unigram baseline's) in nats/token of the unsharded weights ``state`` (rank 0's);
        (None, None) without weights, without ``eval_sequences``, or with no learned target (chat data whose
        held-out windows hold no assistant words)."""
        if not self.sequences or state is None:
            return None, None
        spec, seq = self.cfg.model, self.cfg.train.seq_len
        model = build_model(spec, "meta")
        model.load_state_dict(state, assign=True)
        model.to(self.device).eval()
        tokens = self.corpus.tokens("val")
        args = document_args(self.corpus, "val", self.cfg.data.documents_apart)
        total, count, targets = 0.0, 0, []
        with torch.no_grad(), autocast_for(self.precision, Layout(), self.device):
            for group in window_batches(len(tokens), seq, self.sequences, self.BATCH):
                x, y, pos = (t.to(self.device) if t is not None else None for t in _rows(tokens, group, **args))
                logits = model(x, positions=pos) if pos is not None else model(x)
                total += float(lm_loss_sum(logits, y))
                count += int((y != IGNORE).sum())
                targets.append(y.flatten().cpu())
        if not count:
            return None, None
        return total / count, unigram_loss(None, torch.cat(targets), self.corpus.vocab_size, self.unigram_counts())

    def periodic(self, step: int, gather: Callable[[], dict[str, torch.Tensor] | None], metrics: Any) -> None:
        """``[train] eval_every``, on every rank: the weights after ``step`` gathered (``gather``, a collective),
        scored on rank 0, broadcast; an ``eval`` row to ``metrics`` (runtime/job/metrics.MetricsLog) with its
        console line."""
        t0 = time.perf_counter()
        state = gather()
        got = list(self.loss(state)) if dist.get_rank() == 0 else [None, None]
        del state
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(got, src=0)
        val, uni = got
        if val is None:
            return
        row = {"event": "eval", "step": step, "val_loss": float(val), "unigram_loss": float(uni),
               "eval_sequences": self.sequences, "eval_s": time.perf_counter() - t0, "wall": time.time(),
               "attempt": restart_count(), "requeue": requeue_count()}
        self.last = row
        metrics.eval(row, f"eval  {step:5d}  held-out loss {val:.4f} nats/token (unigram baseline {uni:.4f}) on "
                          f"{self.sequences} sequences, {row['eval_s']:.1f} s")

    def at(self, step: int) -> tuple[float, float] | None:
        """(held-out loss, unigram loss) when ``periodic`` evaluated the weights after ``step`` already."""
        if self.last is None or self.last["step"] != step:
            return None
        return self.last["val_loss"], self.last["unigram_loss"]

    def final(self, step: int, state: dict[str, torch.Tensor] | None, metrics: Any
              ) -> tuple[float | None, float | None]:
        """Rank 0, the run's end: the held-out loss of the final weights ``state`` (None: not gathered) ->
        (loss, unigram loss); a new value is a row (as report/ reads it) and a console line."""
        done = self.at(step)
        if done is not None:  # eval_every evaluated these weights already
            return done
        val, uni = self.loss(state)
        if val is not None:
            metrics.record({"step": step, "val_loss": val, "unigram_loss": uni})
            self.log(f"held-out loss {val:.4f} nats/token (unigram baseline {uni:.4f}) on {self.sequences} "
                     "sequences")
        return val, uni
