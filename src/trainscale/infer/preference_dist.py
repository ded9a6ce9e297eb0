"""`trainscale dpo --layout L`: the preference run on the layout's processes (torchrun, one machine), full-parameter,
laid out by the runtime (runtime/parallel: data parallelism replicated or FSDP2, tensor parallelism), with the same
steps as one process: every rank draws the same pairs, each data-parallel rank scores its share, the gradients are
averaged as the trainer averages them, and the losses and metrics are those of the whole batch.

The command writes OUT/dpo-job.json (the settings), starts ``python -m trainscale.runtime.job.launch ...
-m trainscale.infer.preference_dist``, and reads back OUT/report.json, which rank 0 writes with the model folder.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainscale.errors import JobFailed, TrainscaleError

JOB_FILE, REPORT_FILE = "dpo-job.json", "report.json"


def check_layout(text: str, d) -> Any:
    """The layout, refused in one sentence unless it is data parallelism (replicated or FSDP2) and / or tensor
    parallelism of a full-parameter run without checkpoints."""
    from trainscale.specs import Layout

    try:
        layout = Layout.parse(text)
    except (ValueError, TrainscaleError) as e:
        raise TrainscaleError(f"--layout {text!r}: {str(e).splitlines()[0]}") from None
    if layout.pp > 1 or layout.cp > 1 or layout.ep > 1:
        raise TrainscaleError(f"--layout {text}: preference tuning runs dp, fsdp and tp layouts, not pp, cp or ep")
    if d.lora_rank:
        raise TrainscaleError("--layout runs full-parameter preference tuning; LoRA (--lora-rank) runs in one process")
    if d.save_every or d.resume:
        raise TrainscaleError("--layout runs without checkpoints; --save-every and --resume run in one process")
    return layout


def tune(checkpoint: str, d, bar=None) -> dict[str, Any]:
    """``trainscale dpo``: infer/preference.preference_tune in this process, or with ``d.layout`` the job on that
    layout's processes (the output folder checked here first, as preference_tune checks it)."""
    from dataclasses import replace

    from trainscale.infer.load import source_folder
    from trainscale.infer.preference import preference_tune
    from trainscale.runtime.artifact import beside, model_inputs
    from trainscale.safeio import check_output

    if not d.layout:
        return preference_tune(checkpoint, d, bar)
    s = d.loss.check()
    src = source_folder(checkpoint).resolve()
    out = d.out or beside(src, f"-{s.loss}")
    if out.resolve() == src:
        raise TrainscaleError(f"the output folder cannot be the model folder {src}; pick another --out")
    check_output(out, "--out", folder=True, inputs=model_inputs(src), not_at=(checkpoint,))
    return run_job(checkpoint, replace(d, out=out), out, d.layout)


def run_job(checkpoint: str, d, out: Path, layout_text: str) -> dict[str, Any]:
    """Start the job on the layout's processes and return rank 0's report."""
    from trainscale.safeio import atomic_write_json, read_json_object

    layout = check_layout(layout_text, d)
    out.mkdir(parents=True, exist_ok=True)
    settings = {**asdict(d), "loss": asdict(d.loss), "out": str(out), "data": str(d.data)}
    atomic_write_json(out / JOB_FILE, {"checkpoint": checkpoint, "layout": layout_text, "settings": settings})
    (out / REPORT_FILE).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "trainscale.runtime.job.launch", "--standalone", "--local-addr", "127.0.0.1",
           "--nproc-per-node", str(layout.world_size), "-m", "trainscale.infer.preference_dist",
           "--job", str(out / JOB_FILE)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (out / REPORT_FILE).is_file():
        last = next((line for line in reversed(proc.stderr.splitlines()) if "Error" in line), "no report written")
        raise JobFailed(f"the preference job on {layout_text} failed ({last.strip()[:300]})")
    return read_json_object(out / REPORT_FILE, "preference job report")


@dataclass
class Parallel:
    """A rank's part in the steps: its share of each batch, the gradient average, the whole batch's metrics."""

    mesh: Any
    layout: Any

    def share(self, picks: list[int]) -> list[int]:
        dp, r = self.layout.dp, self.mesh.dp_rank
        if len(picks) % dp:
            raise TrainscaleError(f"--batch {len(picks)} does not split over the layout's {dp} data-parallel ranks")
        n = len(picks) // dp
        return picks[r * n: (r + 1) * n]

    def reduce(self, params: list) -> None:
        from trainscale.runtime.parallel.parallelize import (
            allreduce_gradients,
            gradient_group,
            settle_gradient_placements,
        )

        if (group := gradient_group(self.mesh)) is not None:  # replicated dp; FSDP2 reduces its own
            allreduce_gradients(params, group)
        settle_gradient_placements(params)

    def gather(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
        dp = self.layout.dp
        if dp == 1:
            return loss.item(), metrics
        group = self.mesh.group("dp")
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=group)
        out = {}
        for k, v in metrics.items():
            parts = [torch.empty_like(v) for _ in range(dp)]
            dist.all_gather(parts, v.contiguous(), group=group)
            out[k] = torch.cat(parts)
        return loss.item() / dp, out


def _rank_main(job: dict[str, Any], device: torch.device) -> None:
    from trainscale.infer.load import load_for_inference
    from trainscale.infer.preference import (
        DpoSettings,
        evaluate_pairs,
        reference_logps,
        split_pairs,
        train_pairs,
        write_outputs,
    )
    from trainscale.runtime.data.chat import load_chat_tokenizer
    from trainscale.runtime.data.preference import load_pairs
    from trainscale.runtime.parallel.mesh import build_mesh
    from trainscale.runtime.parallel.parallelize import parallelize
    from trainscale.runtime.preference import PreferenceSettings
    from trainscale.specs import Layout

    raw = job["settings"]
    d = DpoSettings(**{**raw, "loss": PreferenceSettings(**raw["loss"]), "out": Path(raw["out"])})
    s, layout = d.loss.check(), Layout.parse(job["layout"])
    mesh = build_mesh(layout)
    model, spec, src = load_for_inference(job["checkpoint"])
    model, src = model.to(device), src.resolve()
    pairs = load_pairs(Path(d.data), load_chat_tokenizer(src), spec.vocab_size)
    train, held = split_pairs(d.data, pairs, d.held_out)
    seq_len = min(d.seq_len, spec.max_seq_len)
    for p in model.parameters():
        p.requires_grad_(True)
    parallelize(model, mesh, layout, seq_len)
    model.positions = None  # rows as long as the batch's longest (cp = 1: positions 0..s-1 either way)
    m = layout.tp  # sequence parallelism splits the rows' length
    ref_train = reference_logps(model, train, seq_len, multiple=m) if s.needs_reference else None
    ref_held = reference_logps(model, held, seq_len, multiple=m) if s.needs_reference and held else None
    before = evaluate_pairs(model, s, held, ref_held, seq_len, m) if held else None
    t0 = time.perf_counter()
    rows = train_pairs(model, s, train, ref_train, d.steps, d.batch, seq_len, d.lr, d.seed,
                       par=Parallel(mesh, layout), multiple=m)
    secs = time.perf_counter() - t0
    after = evaluate_pairs(model, s, held, ref_held, seq_len, m) if held else None
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
             for k, v in model.state_dict().items()}
    if dist.get_rank() == 0:
        report = write_outputs(state, spec, src, d, s, rows, len(train), len(held), before, after)
        report |= {"layout": job["layout"], "seconds": secs}
        from trainscale.safeio import atomic_write_json

        atomic_write_json(d.out / REPORT_FILE, report)
    dist.barrier()


def main() -> None:
    from trainscale.runtime.parallel.mesh import exit_rank, init_distributed
    from trainscale.safeio import read_json_object

    ap = argparse.ArgumentParser()
    ap.add_argument("--job", type=Path, required=True)
    job = read_json_object(ap.parse_args().job, "preference job")
    device = init_distributed()
    try:
        _rank_main(job, device)
    except TrainscaleError as e:
        print(f"TrainscaleError: {e}", file=sys.stderr)
        exit_rank(1)
    exit_rank(0)


if __name__ == "__main__":
    main()
