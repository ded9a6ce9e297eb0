"""Preference tuning in one process (``trainscale dpo``): DPO, IPO, SimPO or ORPO on JSONL pairs, full-parameter or
LoRA adapters.

The pairs are rendered with the model folder's chat template and scored on their answers only
(runtime/data/preference.py); each batch is the chosen rows then the rejected rows, one conversation per row,
right-padded (infer/lora.chat_rows: each row computed exactly as alone). The reference model's log-probs are
computed once, before the first step, for every pair (the model as loaded: with LoRA, the base with adapters that
start at zero, so exactly the base), and kept: no second model is held. The losses and metrics are
runtime/preference.py's (TRL 1.16's conventions); pairs are held out by the trainer's hash rule and the held-out
preference accuracy is measured before and after. Every step's metrics go to OUT/metrics.jsonl; ``--save-every``
writes OUT/checkpoint (``Checkpoint``) and ``--resume`` continues from it, the cached reference log-probs included.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from trainscale.errors import TrainscaleError
from trainscale.runtime.data.preference import Pair
from trainscale.runtime.preference import PreferenceSettings, preference_loss, sequence_logps, summarize

Progress = Callable[[int, float], None]  # (step, loss) after each optimizer step
EVAL_BATCH = 8


@dataclass(frozen=True)
class DpoSettings:
    """What the preference run is asked for (the command's options, by their field names)."""

    data: str = ""
    loss: PreferenceSettings = PreferenceSettings()
    lora_rank: int | None = None  # None: full-parameter
    lora_alpha: float | None = None
    targets: str = "all"
    steps: int = 20
    batch: int = 4
    seq_len: int = 256
    lr: float = 1e-5
    held_out: float = 0.2
    seed: int = 0
    out: Path | None = None
    layout: str | None = None  # dp / fsdp / tp layout on that many processes (infer/preference_dist.py)
    save_every: int = 0  # steps between checkpoints (OUT/checkpoint: weights, AdamW state, batches, reference)
    resume: bool = False  # continue from OUT/checkpoint when there is one


def pair_rows(pairs: list[Pair], seq_len: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``pairs`` as TRL concatenates it: the chosen conversations' rows, then the rejected ones' (each
    cut to ``seq_len`` + 1 tokens) -> inputs [2b, s] and targets [2b, s] (IGNORE outside the answers), s padded to
    a ``multiple`` (sequence parallelism splits it; causal attention keeps the padding out of every score)."""
    from trainscale.infer.lora import chat_rows
    from trainscale.runtime.model import IGNORE

    inputs, targets = chat_rows([p.chosen for p in pairs] + [p.rejected for p in pairs], seq_len)
    extra = -inputs.shape[1] % multiple
    if extra:
        inputs = torch.nn.functional.pad(inputs, (0, extra))
        targets = torch.nn.functional.pad(targets, (0, extra), value=IGNORE)
    return inputs, targets


def pair_logps(model, pairs: list[Pair], seq_len: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sums [2b], scored-token counts [2b]) of ``model`` on ``pair_rows(pairs)``: chosen first, then rejected."""
    inputs, targets = pair_rows(pairs, seq_len, multiple)
    dev = next(model.parameters()).device  # a laid-out model's rank device (NCCL wants every tensor there)
    return sequence_logps(model(inputs.to(dev)), targets.to(dev))


def reference_logps(model, pairs: list[Pair], seq_len: int, batch: int = EVAL_BATCH,
                    multiple: int = 1) -> torch.Tensor:
    """The reference log-probs of every pair, computed once: [n, 2] (chosen, rejected)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(pairs), batch):
            part = pairs[i: i + batch]
            sums, _ = pair_logps(model, part, seq_len, multiple)
            out.append(torch.stack(sums.chunk(2), dim=1))
    return torch.cat(out) if out else torch.zeros(0, 2)


def batch_loss(model, s: PreferenceSettings, pairs: list[Pair], ref: torch.Tensor | None, seq_len: int,
               multiple: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one batch of pairs (``ref`` [b, 2]: their reference log-probs; None for SimPO / ORPO) and its
    per-pair metrics (runtime/preference.preference_loss)."""
    sums, counts = pair_logps(model, pairs, seq_len, multiple)
    (chosen, rejected), (n_c, n_r) = sums.chunk(2), counts.chunk(2)
    nll = -chosen.sum() / n_c.sum().clamp_min(1) if s.loss == "orpo" else None
    ref_c, ref_r = (ref[:, 0], ref[:, 1]) if ref is not None else (None, None)
    return preference_loss(s, chosen, rejected, n_c, n_r, ref_c, ref_r, nll)


def evaluate_pairs(model, s: PreferenceSettings, pairs: list[Pair], ref: torch.Tensor | None,
                   seq_len: int, multiple: int = 1) -> dict[str, float]:
    """The loss and TRL's reward metrics over ``pairs`` (rewards/accuracies: the held-out preference accuracy)."""
    was = model.training
    model.eval()
    parts, losses = [], []
    with torch.no_grad():
        for i in range(0, len(pairs), EVAL_BATCH):
            part = pairs[i: i + EVAL_BATCH]
            loss, m = batch_loss(model, s, part, ref[i: i + EVAL_BATCH] if ref is not None else None, seq_len,
                                 multiple)
            parts.append(m)
            losses.append(loss.item() * len(part))
    model.train(was)
    merged = {k: torch.cat([m[k] for m in parts]) for k in parts[0]}
    return {"loss": sum(losses) / len(pairs), **summarize(merged)}


@dataclass
class Hooks:
    """A run's checkpointing: ``resume(opt, gen)`` restores the state and returns the steps' rows so far;
    ``after(step, opt, gen, rows)`` runs after each optimizer step."""

    resume: Callable[[torch.optim.Optimizer, torch.Generator], list[dict[str, float]]]
    after: Callable[[int, torch.optim.Optimizer, torch.Generator, list[dict[str, float]]], None]


def train_pairs(model, s: PreferenceSettings, pairs: list[Pair], ref: torch.Tensor | None, steps: int, batch: int,
                seq_len: int, lr: float, seed: int = 0, progress: Progress | None = None,
                hooks: Hooks | None = None, par=None, multiple: int = 1) -> list[dict[str, float]]:
    """AdamW on the model's trainable parameters, ``batch`` random pairs a step -> each step's loss and metrics.
    ``par`` (infer/preference_dist.Parallel): this rank's share of each batch, the gradients averaged, the whole
    batch's loss and metrics."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainscaleError("the model has no trainable parameters")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    rows = hooks.resume(opt, gen) if hooks is not None else []
    for step in range(len(rows), steps):
        pick = torch.randint(0, len(pairs), (batch,), generator=gen).tolist()
        pick = par.share(pick) if par is not None else pick
        loss, m = batch_loss(model, s, [pairs[i] for i in pick], ref[pick] if ref is not None else None,
                             seq_len, multiple)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if par is not None:
            par.reduce(params)
        opt.step()
        value, m = par.gather(loss, m) if par is not None else (loss.item(), m)
        rows.append({"step": step + 1, "loss": value, **summarize(m)})
        if hooks is not None:
            hooks.after(step + 1, opt, gen, rows)
        if progress is not None:
            progress(step + 1, rows[-1]["loss"])
    model.eval()
    return rows


def split_pairs(data: str, pairs: list[Pair], held_out: float) -> tuple[list[Pair], list[Pair]]:
    """(training, held-out) pairs: the trainer's hash rule (runtime/data/sources.py Settings.held_mask) on each
    pair's number in the file, keyed by the file's name (the split stays when the file moves)."""
    from trainscale.runtime.data.sources import Settings

    key = Path(data).name
    held = Settings(held_out=held_out).held_mask(key, len(pairs)).tolist() if held_out else [False] * len(pairs)
    train = [p for p, h in zip(pairs, held, strict=True) if not h]
    return train, [p for p, h in zip(pairs, held, strict=True) if h]


def preference_tune(checkpoint: str, d: DpoSettings, bar=None) -> dict[str, Any]:
    """Tune ``checkpoint`` (any folder infer/ loads, a Hugging Face folder included) on ``d.data``'s pairs; save
    the model folder (full-parameter) or the adapter folder (LoRA) -> the run's report (``--json``)."""
    from trainscale.infer.load import load_for_inference
    from trainscale.runtime.artifact import beside, model_inputs
    from trainscale.runtime.data.chat import load_chat_tokenizer
    from trainscale.runtime.data.preference import load_pairs
    from trainscale.safeio import check_output

    s = d.loss.check()
    model, spec, src = load_for_inference(checkpoint)
    src = src.resolve()
    out = d.out or beside(src, f"-{s.loss}")
    if out.resolve() == src:
        raise TrainscaleError(f"the output folder cannot be the model folder {src}; pick another --out")
    check_output(out, "--out", folder=True, inputs=model_inputs(src), not_at=(checkpoint,))
    d = replace(d, out=out)
    names = _targets(spec, d)  # checked before any work
    pairs = load_pairs(Path(d.data), load_chat_tokenizer(src), spec.vocab_size)
    train, held = split_pairs(d.data, pairs, d.held_out)
    if not train:
        raise TrainscaleError(f"data {d.data} leaves no pair to train on ({len(pairs)} pairs, {len(held)} held out)")
    seq_len = min(d.seq_len, spec.max_seq_len)
    ckpt = Checkpoint(out / CHECKPOINT, _fingerprint(d, s, src, seq_len), d.save_every)
    saved = ckpt.read_state() if d.resume else None
    t0 = time.perf_counter()
    if saved is not None and s.needs_reference:  # the reference log-probs, as cached at the start
        ref_train, ref_held = ckpt.reference(len(train), len(held))
    else:
        ref_train = reference_logps(model, train, seq_len) if s.needs_reference else None
        ref_held = reference_logps(model, held, seq_len) if s.needs_reference and held else None
    ref_secs = time.perf_counter() - t0
    _trainable(model, names, d)
    ckpt.attach(model, ref_train, ref_held, saved)
    before = evaluate_pairs(model, s, held, ref_held, seq_len) if held else None
    t0 = time.perf_counter()
    rows = train_pairs(model, s, train, ref_train, d.steps, d.batch, seq_len, d.lr, d.seed,
                       bar if callable(bar) else None, Hooks(ckpt.resume, ckpt.after))
    secs = time.perf_counter() - t0
    after = evaluate_pairs(model, s, held, ref_held, seq_len) if held else None
    _save(model, spec, src, out, d, s, names, rows)
    report = _report(src, d, s, rows, len(train), len(held), before, after)
    report["seconds"] = secs
    if report["reference"] is not None:
        report["reference"] |= {"seconds": ref_secs, "from_checkpoint": saved is not None}
    report["resumed_from_step"] = saved["step"] if saved is not None else None
    return report


def _report(src: Path, d: DpoSettings, s: PreferenceSettings, rows: list, n_train: int, n_held: int,
            before: dict | None, after: dict | None) -> dict[str, Any]:
    return {"model": str(src), "out": str(d.out), "loss": s.loss, "beta": s.beta,
            "label_smoothing": s.label_smoothing, **({"gamma": s.gamma} if s.loss == "simpo" else {}),
            "mode": f"lora r={d.lora_rank}" if d.lora_rank else "full-parameter", "steps": d.steps,
            "batch": d.batch, "lr": d.lr, "seconds": None,
            "pairs": {"train": n_train, "held_out": n_held, "rule": "runtime/data/sources.py Settings.held_mask"},
            "reference": ({"cached_pairs": n_train + n_held,
                           "model": "the model as loaded (LoRA: the base, adapters at zero)"}
                          if s.needs_reference else None),
            "resumed_from_step": None, "first": rows[0], "last": rows[-1], "held_out_before": before,
            "held_out_after": after, "steps_log": rows}


def write_outputs(state: dict[str, torch.Tensor], spec, src: Path, d: DpoSettings, s: PreferenceSettings,
                  rows: list, n_train: int, n_held: int, before: dict | None, after: dict | None) -> dict[str, Any]:
    """A distributed run's rank 0: the model folder from the whole ``state`` (full-parameter), metrics.jsonl, and
    the report."""
    _save(SimpleNamespace(state_dict=lambda: state), spec, src, d.out, d, s, (), rows)
    return _report(src, d, s, rows, n_train, n_held, before, after)


def _targets(spec, d: DpoSettings) -> tuple[str, ...]:
    """LoRA's adapted projections (estimate/lora.lora_targets); () for a full-parameter run."""
    if not d.lora_rank:
        return ()
    from trainscale.estimate.lora import lora_targets

    try:
        return lora_targets(spec, d.targets)
    except ValueError as e:
        raise TrainscaleError(str(e)) from None


def _trainable(model, names: tuple[str, ...], d: DpoSettings) -> None:
    """Full-parameter: every weight trains; LoRA: adapters on ``names`` (infer/lora.apply_lora), base frozen."""
    if not d.lora_rank:
        for p in model.parameters():
            p.requires_grad_(True)
        return
    from trainscale.infer.lora import apply_lora

    apply_lora(model, d.lora_rank, _alpha(d), names, d.seed)


def _alpha(d: DpoSettings) -> float:
    return 2.0 * d.lora_rank if d.lora_alpha is None else d.lora_alpha


def _save(model, spec, src: Path, out: Path, d: DpoSettings, s: PreferenceSettings, names, rows) -> None:
    """The model folder (full-parameter: model.safetensors, model.json, the tokenizer and chat files,
    preference.json) or the adapter folder (LoRA), and metrics.jsonl: each step's loss and TRL's reward metrics."""
    import json

    from trainscale.infer.lora import data_record, save_adapter_folder
    from trainscale.runtime.artifact import copy_chat_files, save_model_dir
    from trainscale.safeio import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))

    record = {"preference": {"loss": s.loss, "beta": s.beta, "label_smoothing": s.label_smoothing,
                             "gamma": s.gamma, "data": data_record(d.data), "steps": d.steps, "lr": d.lr,
                             "losses": [r["loss"] for r in rows]}}
    if d.lora_rank:
        save_adapter_folder(out, model, spec, src, {"rank": d.lora_rank, "alpha": _alpha(d), "targets": list(names),
                                                    "steps": d.steps, "lr": d.lr, "data": data_record(d.data),
                                                    "format": "chat", "held_out": d.held_out,
                                                    "losses": [r["loss"] for r in rows], **record})
        return
    tok = src / "tokenizer.json"
    save_model_dir(out, model.state_dict(), spec, tok if tok.exists() else None)
    copy_chat_files(src, out)
    atomic_write_json(out / "preference.json", record["preference"])



CHECKPOINT = "checkpoint"
STATE_FILE, TENSORS_FILE = "state.json", "state.safetensors"


def _fingerprint(d: DpoSettings, s: PreferenceSettings, src: Path, seq_len: int) -> dict[str, Any]:
    """What a checkpoint must have been made with to be resumed (the steps may grow)."""
    from trainscale.infer.lora import data_record

    return {"model": str(src), "data": data_record(d.data), "loss": s.loss, "beta": s.beta, "gamma": s.gamma,
            "label_smoothing": s.label_smoothing, "lora_rank": d.lora_rank, "lora_alpha": d.lora_alpha,
            "targets": d.targets, "batch": d.batch, "seq_len": seq_len, "lr": d.lr, "held_out": d.held_out,
            "seed": d.seed}


class Checkpoint:
    """OUT/checkpoint: state.json (the step, the rows so far, the run's fingerprint) and state.safetensors (the
    trainable weights, AdamW's moments and step per weight, the batch generator's state, the cached reference
    log-probs), written to a fresh folder then renamed over the last; read back with every tensor's name, shape
    and dtype checked against this run's from the header first."""

    def __init__(self, folder: Path, fingerprint: dict[str, Any], every: int) -> None:
        self.folder, self.fingerprint, self.every = folder, fingerprint, every
        self.model, self.refs, self.saved = None, {}, None

    def read_state(self) -> dict[str, Any] | None:
        from trainscale.safeio import read_json_object

        path = self.folder / STATE_FILE
        if not path.exists():
            return None
        state = read_json_object(path, "preference checkpoint state")
        if state.get("fingerprint") != self.fingerprint:
            raise TrainscaleError(f"{self.folder} was made by another run (model, data or settings differ); "
                                  "resume with the same options, or pick another --out")
        step, rows = state.get("step"), state.get("rows")
        if not isinstance(step, int) or not isinstance(rows, list) or len(rows) != step or step < 1:
            raise TrainscaleError(f"{path} does not hold a step and its rows")
        return state

    def _tensors(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        from trainscale.runtime.artifact import check_finite, check_header, read_header

        path = self.folder / TENSORS_FILE
        if not path.is_file():
            raise TrainscaleError(f"{self.folder} has no {TENSORS_FILE}")
        header = read_header(path)
        if self.model is not None:
            check_header(path, header, self._expected(), against="this run's model and settings")
        tensors = load_file(str(path))
        check_finite(path, tensors)
        return tensors

    def reference(self, n_train: int, n_held: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = self._tensors()
        got = t.get("reference/train"), t.get("reference/held")
        if got[0] is None or tuple(got[0].shape) != (n_train, 2) or (n_held and (
                got[1] is None or tuple(got[1].shape) != (n_held, 2))):
            raise TrainscaleError(f"{self.folder}: the cached reference log-probs do not match the pairs")
        return got[0], got[1] if n_held else None

    def attach(self, model, ref_train, ref_held, saved) -> None:
        self.model, self.saved = model, saved
        self.refs = {k: v for k, v in (("reference/train", ref_train), ("reference/held", ref_held)) if v is not None}

    def _trainable(self):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _expected(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, p in self._trainable():
            out |= {f"param/{n}": p, f"exp_avg/{n}": p, f"exp_avg_sq/{n}": p, f"step/{n}": torch.zeros(1)}
        out["generator"] = torch.Generator().get_state()
        return out | self.refs

    def resume(self, opt: torch.optim.Optimizer, gen: torch.Generator) -> list[dict[str, float]]:
        if self.saved is None:
            return []
        t = self._tensors()
        with torch.no_grad():
            for n, p in self._trainable():
                p.copy_(t[f"param/{n}"])
                opt.state[p] = {"step": t[f"step/{n}"].reshape(()), "exp_avg": t[f"exp_avg/{n}"],
                                "exp_avg_sq": t[f"exp_avg_sq/{n}"]}
        gen.set_state(t["generator"])
        return list(self.saved["rows"])

    def after(self, step: int, opt: torch.optim.Optimizer, gen: torch.Generator, rows: list) -> None:
        if not self.every or step % self.every:
            return
        import shutil

        from safetensors.torch import save_file

        from trainscale.safeio import atomic_write_json

        tensors = {"generator": gen.get_state(), **{k: v.contiguous() for k, v in self.refs.items()}}
        for n, p in self._trainable():
            st = opt.state[p]
            tensors |= {f"param/{n}": p.detach().contiguous(), f"exp_avg/{n}": st["exp_avg"].contiguous(),
                        f"exp_avg_sq/{n}": st["exp_avg_sq"].contiguous(),
                        f"step/{n}": st["step"].detach().float().reshape(1)}
        fresh = self.folder.with_name(self.folder.name + ".new")
        shutil.rmtree(fresh, ignore_errors=True)
        fresh.mkdir(parents=True)
        save_file(tensors, str(fresh / TENSORS_FILE), metadata={"producer": "trainscale", "kind": "preference"})
        atomic_write_json(fresh / STATE_FILE, {"step": step, "rows": rows, "fingerprint": self.fingerprint})
        old = self.folder.with_name(self.folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if self.folder.exists():
            self.folder.rename(old)
        fresh.rename(self.folder)
        shutil.rmtree(old, ignore_errors=True)
