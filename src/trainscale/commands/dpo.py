"""`trainscale dpo`: preference tuning (DPO, IPO, SimPO, ORPO) on JSONL pairs, full-parameter or LoRA, in one
process; the held-out preference accuracy before and after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from trainscale.commands._common import SEED, console, emit_json, number


def register(app: typer.Typer) -> None:
    app.command()(dpo)


def dpo(
    checkpoint: str = typer.Argument(..., help="the model to tune: model folder, run folder, checkpoint, or a Hugging "
                                      "Face model folder (with its tokenizer and chat template)"),
    data: Path = typer.Option(..., "--data", help="JSONL preference pairs: 'prompt', 'chosen', 'rejected' as "
                              "strings (a user prompt, assistant answers) or as chat messages; rendered with the "
                              "model folder's chat template, only the answers' tokens scored"),
    loss: str = typer.Option("dpo", "--loss", help="dpo (Rafailov et al. 2023), ipo (Azar et al. 2023), simpo "
                             "(Meng et al. 2024, no reference) or orpo (Hong et al. 2024, no reference)"),
    beta: float = typer.Option(0.1, "--beta", callback=number(gt=0, le=1e4),
                               help="beta (DPO, SimPO), tau (IPO) or lambda (ORPO), as TRL names them"),
    label_smoothing: float = typer.Option(0.0, "--label-smoothing", callback=number(ge=0, lt=0.5),
                                          help="conservative DPO / SimPO: the share of labels taken as flipped"),
    gamma: float = typer.Option(0.5, "--gamma", callback=number(ge=0, le=1e4), help="SimPO's target margin"),
    lora_rank: int = typer.Option(0, "--lora-rank", callback=number(ge=0, le=1 << 16),
                                  help="LoRA adapters of this rank on a frozen model (the reference: the model as "
                                       "loaded); 0: full-parameter"),
    lora_alpha: float = typer.Option(None, "--lora-alpha", callback=number(gt=0, le=1e6),
                                     help="LoRA alpha (default: 2 x rank)"),
    targets: str = typer.Option("all", help="LoRA: adapted projections: all, attn, mlp, or names wq,wk,..."),
    steps: int = typer.Option(20, callback=number(gt=0, le=1e7), help="optimizer steps"),
    batch: int = typer.Option(4, callback=number(gt=0, le=4096), help="pairs per step"),
    seq_len: int = typer.Option(256, callback=number(gt=0, le=1 << 20), help="tokens per conversation (cut)"),
    lr: float = typer.Option(1e-5, callback=number(gt=0, le=10), help="AdamW learning rate"),
    held_out: float = typer.Option(0.2, "--held-out", callback=number(ge=0, lt=1),
                                   help="fraction of the pairs held out to measure preference accuracy (the "
                                        "trainer's hash rule)"),
    seed: int = typer.Option(0, callback=SEED, help="seed for the batches (and the adapter init)"),
    out: Path = typer.Option(None, "--out", "-o", help="output folder (default: CHECKPOINT-LOSS beside it): a model "
                             "folder, or an adapter folder with --lora-rank"),
    layout: str = typer.Option(None, "--layout", help="run on this layout's processes (torchrun, this machine): "
                               "dp2, fsdp2, tp2, dp2,tp2 ... (full-parameter; the same steps as one process)"),
    save_every: int = typer.Option(0, "--save-every", callback=number(ge=0, le=1e7),
                                   help="steps between checkpoints (OUT/checkpoint: the trained weights, AdamW "
                                        "state, batch order and cached reference log-probs); 0: none"),
    resume: bool = typer.Option(False, "--resume", help="continue from OUT/checkpoint when there is one (the same "
                                "model, data and options; --steps may grow)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Preference-tune a model on chosen / rejected pairs; the reference log-probs computed once and kept."""
    from trainscale.infer.preference import DpoSettings
    from trainscale.infer.preference_dist import tune
    from trainscale.runtime.preference import PreferenceSettings

    settings = DpoSettings(data=str(data), loss=PreferenceSettings(loss, beta, label_smoothing, gamma),
                           lora_rank=lora_rank or None, lora_alpha=lora_alpha, targets=targets, steps=steps,
                           batch=batch, seq_len=seq_len, lr=lr, held_out=held_out, seed=seed, out=out,
                           layout=layout, save_every=save_every, resume=resume)
    with (_no_bar() if as_json else _bar(steps)) as progress:
        report = tune(checkpoint, settings, progress)
    if as_json:
        emit_json(report)
        return
    _print(report)


@contextmanager
def _bar(steps: int) -> Iterator[Callable[[int, float], None]]:
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("preference steps", total=steps)
        yield lambda s, loss: bar.update(task, completed=s, description=f"loss {loss:.4f}")


@contextmanager
def _no_bar() -> Iterator[None]:
    yield None


def _print(r: dict[str, Any]) -> None:
    from trainscale.commands._infer import kv_table, print_tables

    console.print(f"[bold]{r['loss'].upper()} (beta {r['beta']:g}), {r['mode']}[/bold]: {r['model']} -> {r['out']}"
                  + (f" (resumed at step {r['resumed_from_step']})" if r["resumed_from_step"] else "")
                  + (f" on {r['layout']}" if r.get("layout") else ""))
    first, last = r["first"], r["last"]
    took = f" ({r['seconds']:.1f} s)" if r["seconds"] is not None else ""
    rows = {"loss": f"{first['loss']:.4f} -> {last['loss']:.4f} in {r['steps']} steps{took}",
            "pairs": f"{r['pairs']['train']:,} training, {r['pairs']['held_out']:,} held out (the trainer's hash rule)"}
    if r["reference"] is not None:
        secs = r["reference"].get("seconds")
        rows["reference log-probs"] = f"{r['reference']['cached_pairs']:,} pairs, computed once" + (
            f" ({secs:.1f} s)" if secs is not None else "")
    for name, m in (("last step", last), ("held out, before", r["held_out_before"]),
                    ("held out, after", r["held_out_after"])):
        if m is not None:
            rows[name] = (f"rewards chosen {m['rewards/chosen']:+.4f}, rejected {m['rewards/rejected']:+.4f}, "
                          f"margin {m['rewards/margins']:+.4f}, accuracy {m['rewards/accuracies']:.0%}")
    print_tables(kv_table(rows))
