"""The model folder a path names, and the model in it: ``find_model_folder`` is the one place that says a run
folder is accepted wherever a model folder is (its final/, else its newest committed checkpoint), and so is a
checkpoint RUN/checkpoints/step-N written under any layout (resharded into one model folder, cached inside it:
``model_from_checkpoint``). ``load_model_dir`` loads what it finds (runtime/artifact.py: the folder's format).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from trainscale.errors import TrainscaleError
from trainscale.runtime.artifact import (
    CHECKPOINT_MODEL,
    RUN_CONFIG,
    RUN_TOKENIZER,
    SOURCE_FILE,
    ST_DTYPES,
    STEP,
    TMP_STEP,
    check_finite,
    check_header,
    check_layer_count,
    check_model_file,
    holds_steps,
    is_step_name,
    read_spec,
    run_spec,
    run_toml,
    save_model_dir,
)
from trainscale.safeio import atomic_write_json, check_folder_files, read_bytes, read_json_object
from trainscale.specs import ModelSpec

_OURS = {"model.json", "model.safetensors", RUN_TOKENIZER, SOURCE_FILE}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def find_model_folder(path: str | Path, log: Callable[[str], None] | None = None) -> Path:
    """The model folder ``path`` names: itself; a run folder's final/ (else its newest committed checkpoint); a
    checkpoint RUN/checkpoints/step-N, resharded into a model folder beside it (``model_from_checkpoint``). It
    must hold model.json (beside model.safetensors, quantized.safetensors or adapter.json: infer/load.py tells
    them apart), and every model-folder file present must be a regular file. ``log`` hears which checkpoint was
    taken (default: one line on stderr)."""
    p = Path(path)
    say = log or _stderr
    try:
        present = p.exists()
    except (OSError, ValueError):  # a name too long, a NUL byte
        present = False
    if not present:
        raise TrainscaleError(f"checkpoint {str(path)[:200]} does not exist{_steps_there(p)}")
    if (p / "final" / "model.json").exists():
        p = p / "final"
    elif (p / "model.json").exists():
        pass
    elif is_step_name(p.name):
        p = model_from_checkpoint(p, log=say)
    elif p.is_dir() and ((p / RUN_CONFIG).exists() or holds_steps(p)):
        p = _newest_checkpoint_model(p, say)
    if not p.is_dir() or not (p / "model.json").exists():
        raise TrainscaleError(f"{path} is not a trainscale model folder (needs model.json with model.safetensors, "
                              "quantized.safetensors or adapter.json; or a run folder with final/ or checkpoints; "
                              "or a checkpoint RUN/checkpoints/step-N)")
    check_folder_files(p)
    return p


def _steps_there(p: Path) -> str:
    """For a missing RUN/checkpoints/step-N: the steps that do exist there, as a clause of the sentence."""
    if not STEP.match(p.name) or not p.parent.is_dir():
        return ""
    have = sorted(q.name for q in p.parent.iterdir() if STEP.match(q.name) and q.is_dir())
    if not have:
        return f" ({p.parent} holds no committed checkpoint)"
    more = f" and {len(have) - 6} more" if len(have) > 6 else ""
    return f" (the committed checkpoints in {p.parent}: {', '.join(have[-6:])}{more})"


# ------------------------------------------------------------------ a model out of a checkpoint
#
# A run that timed out, crashed, or has run.save_final = false leaves no final/, only DCP checkpoints
# (runtime/job/checkpoint.py): RUN/checkpoints/step-N, each tensor stored by name and global shape whatever the
# layout. ``model_from_checkpoint`` reads the model's weights whole in this one process (no process group) and
# writes them as a model folder, with the run's ModelSpec (RUN/config.toml) and tokenizer (RUN/tokenizer.json):
# RUN/checkpoints/step-N/model/ (a cache, reused while the checkpoint's manifest is unchanged), or, when the
# checkpoint folder is read-only, a folder in trainscale's cache named by the manifest's sha256.


def _checkpoint_root(run: Path) -> Path:
    """Where a run folder's checkpoints are (``runfolder.checkpoint_root``): [checkpoint] dir of its config, else
    RUN/checkpoints."""
    from trainscale.runtime.job.runfolder import checkpoint_root

    section = run_toml(run).get("checkpoint") if (run / RUN_CONFIG).exists() else None
    configured = section.get("dir") if isinstance(section, dict) else None
    return checkpoint_root(run, configured if isinstance(configured, str) else None)


def _newest_checkpoint_model(folder: Path, say: Callable[[str], None]) -> Path:
    """A run folder without final/ (or a checkpoint root): its newest committed checkpoint that verifies."""
    from trainscale.runtime.job.checkpoint import latest_good

    run = folder if (folder / RUN_CONFIG).exists() else None
    root = _checkpoint_root(folder) if run is not None else folder
    found = latest_good(root, log=say) if root.is_dir() else None
    if found is None:
        what = f"run folder {folder} has no final/ model (run.save_final = false, or the run did not finish) and" \
            if run is not None else f"{folder} has"
        raise TrainscaleError(f"{what} no complete checkpoint in {root}")
    step, ckpt = found
    say(f"{folder} has no final/ model: using its newest committed checkpoint {ckpt} (step {step})"
        if run is not None else f"using the newest committed checkpoint in {folder}: {ckpt} (step {step})")
    return model_from_checkpoint(ckpt, run=run, log=say)


def _run_of(ckpt: Path) -> Path:
    """The run folder a checkpoint RUN/checkpoints/step-N belongs to (it holds config.toml and tokenizer.json)."""
    run = ckpt.parent.parent
    if not (run / RUN_CONFIG).exists():
        raise TrainscaleError(f"checkpoint {ckpt} has no run folder around it ({run / RUN_CONFIG} does not exist): "
                              "name the run folder instead (RUN, whose config.toml says where its checkpoints are)")
    return run


def _check_same_run(ckpt: Path, manifest: dict, run: Path) -> None:
    """The run folder's identity (runtime/job/runfolder.py) must be the run the checkpoint's manifest names."""
    ident_path = run / "identity.json"
    if not ident_path.exists() or manifest.get("run_id") is None:
        return
    ident = read_json_object(ident_path, "run identity").get("run_id")
    if ident != manifest["run_id"]:
        raise TrainscaleError(f"checkpoint {ckpt} was written by run {manifest['run_id']}, but {run} belongs to run "
                              f"{ident}: its config.toml need not describe this checkpoint's model")


def model_from_checkpoint(ckpt: str | Path, run: Path | None = None, log: Callable[[str], None] = _stderr) -> Path:
    """A committed checkpoint (RUN/checkpoints/step-N, written under any layout) as a model folder: the cached one
    while the checkpoint's manifest is unchanged, else resharded now (``reshard_checkpoint``) and written."""
    from trainscale.runtime.job.checkpoint import MANIFEST, read_manifest, verify

    ckpt = Path(ckpt)
    if TMP_STEP.match(ckpt.name):
        raise TrainscaleError(f"checkpoint {ckpt} was never committed (its save did not finish); use a step-N folder")
    if not ckpt.is_dir() or not (ckpt / MANIFEST).exists():
        raise TrainscaleError(f"checkpoint {ckpt} is incomplete (no {MANIFEST}: its save was never committed)")
    manifest_bytes = read_bytes(ckpt / MANIFEST, "checkpoint manifest", 64 << 20, follow_links=False)
    digest = hashlib.sha256(manifest_bytes).hexdigest()
    for dest in _cache_places(ckpt, digest):
        if _cached(dest, digest):  # made from this very manifest, whose files were verified then
            log(f"{ckpt}: its model, resharded before, is {dest}")
            return dest
    why = verify(ckpt)
    if why is not None:
        raise TrainscaleError(f"checkpoint {ckpt} is incomplete or damaged ({why})")
    manifest = read_manifest(ckpt)
    run = _run_of(ckpt) if run is None else run
    _check_same_run(ckpt, manifest, run)
    spec = run_spec(run)
    state = reshard_checkpoint(ckpt, spec)
    tokenizer = run / RUN_TOKENIZER
    source = {"checkpoint": str(ckpt.resolve()), "manifest_sha256": digest, "run": str(run.resolve()),
              "step": manifest["step"], "layout": _run_layout(run)}
    dest = _write_cached(_cache_places(ckpt, digest), state, spec, tokenizer if tokenizer.exists() else None, source)
    log(f"{ckpt}: resharded the step-{manifest['step']} checkpoint into one model: {dest}")
    return dest


def _run_layout(run: Path) -> str | None:
    try:
        got = read_json_object(run / "run.json", "run record").get("layout")
    except TrainscaleError:
        return None
    return got if isinstance(got, str) else None


def reshard_checkpoint(ckpt: Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The model's full state dict (fp32, CPU, as train.py's final/ holds it) from a DCP checkpoint: the stored
    names and global shapes are checked against ``spec``'s model before a tensor is read, the weights finite after."""
    from trainscale.runtime.job.checkpoint import read_full_tensors, saved_tensors
    from trainscale.runtime.model import build_model

    saved = saved_tensors(ckpt)
    check_layer_count(ckpt, saved, spec, "its run's model (config.toml)")
    expected = build_model(spec, "meta").state_dict()  # tied embeddings: one tensor, no output.weight (model.py)
    header = {k: (shape, ST_DTYPES.get(dtype, str(dtype))) for k, (shape, dtype) in saved.items()}
    check_header(ckpt, header, {k: v.to(saved[k][1]) if k in saved else v for k, v in expected.items()},
                 "its run's model (config.toml)")
    state = {k: v.to(torch.float32) for k, v in read_full_tensors(ckpt, {k: saved[k] for k in expected}).items()}
    check_finite(ckpt, state)
    return state


def _cache_places(ckpt: Path, digest: str) -> list[Path]:
    """Where a checkpoint's model folder goes: inside the checkpoint, else (read-only) in trainscale's cache."""
    from trainscale.runtime.data.corpus import cache_root

    return [ckpt / CHECKPOINT_MODEL, cache_root() / "checkpoint-models" / digest[:32]]


def _cached(dest: Path, digest: str) -> bool:
    if not (dest / SOURCE_FILE).is_file() or not (dest / "model.safetensors").is_file():
        return False
    try:
        return read_json_object(dest / SOURCE_FILE, "model source").get("manifest_sha256") == digest
    except TrainscaleError:
        return False


def _write_cached(places: list[Path], state: dict[str, torch.Tensor], spec: ModelSpec, tokenizer: Path | None,
                  source: dict) -> Path:
    """Write the model folder aside and rename it into the first writable place (whole or not at all)."""
    errors = []
    for dest in places:
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            save_model_dir(tmp, state, spec, tokenizer)
            atomic_write_json(tmp / SOURCE_FILE, source)
            if dest.is_dir() and not dest.is_symlink() and not _cached(dest, source["manifest_sha256"]) \
                    and {q.name for q in dest.iterdir()} <= _OURS:
                shutil.rmtree(dest)  # a stale or half copy (never another process's finished one)
            os.rename(tmp, dest)
            return dest
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if _cached(dest, source["manifest_sha256"]):  # another process wrote it first
                return dest
            errors.append(f"{dest}: {e.strerror or e}")
    raise TrainscaleError(f"the model of checkpoint {source['checkpoint']} cannot be written ({'; '.join(errors)})")


def load_model_dir(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """-> (Transformer with the saved weights, ModelSpec, folder). The file is checked against model.json
    (check_model_file) before its tensors are read, and its weights are checked finite after."""
    from safetensors.torch import load_file

    p = find_model_folder(path)
    if not (p / "model.safetensors").exists():
        raise TrainscaleError(f"{path} has no model.safetensors (a quantized or adapter folder loads through "
                              "infer/load.py)")
    spec = read_spec(p)
    model = check_model_file(p / "model.safetensors", spec)
    try:
        sd = load_file(str(p / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"{p / 'model.safetensors'} is corrupt or unreadable: {str(e)[:200]}") from None
    check_finite(p / "model.safetensors", sd)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True)
    return model.to(device).eval(), spec, p
