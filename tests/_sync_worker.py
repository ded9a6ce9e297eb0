"""Count the host syncs of each training step (tests/test_runtime_host_syncs.py): every read of a tensor's value
on the host (``item``, ``tolist``, ``float()``, ``int()``, ``bool()``, ``.cpu()`` of a tensor off the CPU) made
while a step runs, attributed to the step (from the start of its loop iteration to the next one's). Run alone (a
one-process group) or under torchrun; each rank writes RESULT.rankN.json: {"syncs": {step: [caller, ...]},
"losses": [...], "grad_norms": [...], "rows": [...]}.

Not counted: the calls torch's own AdamW makes (``torch/optim``): its foreach path reads its CPU step counter
(``_get_value``); on CUDA the fused kernel keeps that counter on the device and reads nothing."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


class SyncCounter:
    """Patches torch.Tensor's host reads while active; ``syncs[step]`` lists the callers (file:line) of each."""

    def __init__(self) -> None:
        self.step = 0  # 0: before the loop (setup, resume) is not counted against a step
        self.syncs: dict[int, list[str]] = defaultdict(list)
        self.saved: dict[str, object] = {}

    def _note(self) -> None:
        frame = sys._getframe(2)
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        if "/torch/optim/" in where:
            return
        self.syncs[self.step].append(where)

    def __enter__(self) -> SyncCounter:
        counter = self
        for name in READS:
            orig = getattr(torch.Tensor, name)
            self.saved[name] = orig

            def patched(t, *a, _orig=orig, **k):
                counter._note()
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, patched)
        cpu = torch.Tensor.cpu
        self.saved["cpu"] = cpu

        def to_cpu(t, *a, **k):
            if t.device.type != "cpu":
                counter._note()
            return cpu(t, *a, **k)

        torch.Tensor.cpu = to_cpu
        return self

    def __exit__(self, *exc: object) -> None:
        for name, orig in self.saved.items():
            setattr(torch.Tensor, name, orig)


def count_run(config: str, layout: str, steps: int, log_every: int, out: Path | None) -> dict:
    """Train ``config`` under ``layout`` in this process group with ``[run] log_every``, counting host syncs."""
    from trainscale.runtime.config import load_config
    from trainscale.runtime.job import faults
    from trainscale.runtime.train import train

    cfg = load_config(config, {"train": {"steps": steps}, "run": {"log_every": log_every}})
    counter = SyncCounter()
    at_step = faults.at_step

    def marked(flist, step, rank, log=print):  # the loop's first call of each iteration
        counter.step = step
        return at_step(flist, step, rank, log)

    faults.at_step = marked
    try:
        with counter:
            res = train(cfg, layout, steps=steps, out=out, log=lambda _m: None)
    finally:
        faults.at_step = at_step
    return {"syncs": {str(k): v for k, v in counter.syncs.items() if k > 0}, "losses": res.losses,
            "grad_norms": [r["grad_norm"] for r in res.metrics], "rows": res.metrics}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--layout", default="")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    import torch.distributed as dist

    from trainscale.runtime.parallel.mesh import exit_rank

    got = count_run(args.config, args.layout, args.steps, args.log_every, Path(args.out) if args.out else None)
    Path(f"{args.result}.rank{dist.get_rank()}.json").write_text(json.dumps(got))
    exit_rank(0)


if __name__ == "__main__":
    main()
