"""The candidate layouts the step-time model scores at once: one numpy entry per layout, and the named integer
codes its arrays hold for the layout's choices.

The codes are positions in the ``specs`` literals (``specs.Schedule``, ``specs.Recompute``), so a name and its
number cannot drift apart: ``SCHEDULE[GPIPE] == "gpipe"``. A ZeRO stage is its own number (Rajbhandari et al.
2020 Sec. 5, ``specs.Layout.zero``) and needs no code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import numpy as np

from trainscale.errors import TrainscaleError
from trainscale.estimate.pipeline import layer_placement
from trainscale.specs import ModelSpec, Recompute, Schedule

SCHEDULE: tuple[str, ...] = get_args(Schedule)  # cfg["schedule"] holds an index into it
RECOMPUTE: tuple[str, ...] = get_args(Recompute)  # cfg["recompute"] holds an index into it
GPIPE, ONE_F_ONE_B, INTERLEAVED = (SCHEDULE.index(s) for s in ("gpipe", "1f1b", "interleaved"))
NO_RECOMPUTE, SELECTIVE, FULL = (RECOMPUTE.index(r) for r in ("none", "selective", "full"))


def per_mode(fn: Any, codes: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """Evaluate ``fn(name)`` once per discrete choice present and pick each row's value."""
    out = np.zeros(codes.shape, dtype=float)
    for i, name in enumerate(names):
        sel = codes == i
        if sel.any():
            out = np.where(sel, fn(name), out)
    return out


@dataclass(frozen=True)
class Candidates:
    """The layouts of ``cfg`` as int64 arrays (``sched`` and ``rc`` in the codes above), with what follows from
    them for one model, sequence length and global batch."""

    tp: np.ndarray
    cp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    mb: np.ndarray
    v: np.ndarray
    sched: np.ndarray
    rc: np.ndarray
    zero: np.ndarray
    hsdp: np.ndarray
    ep: np.ndarray
    sp: np.ndarray  # sequence parallelism, only where tp > 1
    world: np.ndarray  # tp x cp x pp x dp
    micro: np.ndarray  # micro-batches per step through each pipeline
    ve: np.ndarray  # chunks per pipeline rank: v under the interleaved schedule, else 1
    place: dict[str, Any]  # layers per pipeline rank (pipeline.layer_placement)
    tokens: np.ndarray  # tokens of its sequence shard a rank computes per micro-batch

    @property
    def full(self) -> np.ndarray:
        return self.rc == FULL


def candidates(m: ModelSpec, cfg: dict[str, Any], seq: int, global_seqs: int) -> Candidates:
    """``cfg``'s arrays (tp cp pp dp mb v schedule recompute zero hsdp sp, and ep for a MoE) read as ``Candidates``."""
    tp, cp, pp, dp, mb, v, sched, rc, zero, hsdp = (np.asarray(cfg[k], dtype=np.int64) for k in (
        "tp", "cp", "pp", "dp", "mb", "v", "schedule", "recompute", "zero", "hsdp"))
    ep = np.asarray(cfg["ep"], dtype=np.int64) if "ep" in cfg else np.ones_like(tp)
    if not m.is_moe and np.any(ep > 1):
        raise TrainscaleError(f"expert parallelism (ep{int(np.max(ep))}) needs a mixture-of-experts model, and "
                              f"{m.name} is dense")
    sp = np.asarray(cfg["sp"], dtype=bool) & (tp > 1)
    ve = np.where(sched == INTERLEAVED, v, 1)
    return Candidates(tp=tp, cp=cp, pp=pp, dp=dp, mb=mb, v=v, sched=sched, rc=rc, zero=zero, hsdp=hsdp, ep=ep, sp=sp,
                      world=tp * cp * pp * dp, micro=global_seqs // (dp * mb), ve=ve,
                      place=layer_placement(m.n_layers, pp, ve), tokens=mb * seq / cp)

