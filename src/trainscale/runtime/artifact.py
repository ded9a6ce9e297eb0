"""A trained model on disk, consolidated for inference and export: one folder with

  model.safetensors   full (unsharded) weights, trainscale tensor names, fp32 or bf16
  model.json          the ModelSpec (same fields as a catalog entry)
  tokenizer.json      the Hugging Face tokenizers file the run trained
  tokenizer_config.json, chat_template.jinja   when the run started from a model (or chat data) with a chat
                      template: copied, so LoRA and generation render conversations as training did

``trainscale train`` writes it at the end of a run as RUN_DIR/final; infer/ (generate, quantize,
lora, export) reads it, as well as the folders infer/ writes beside it (quantized.safetensors or adapter.json
instead of model.safetensors). A run directory is accepted wherever a model folder is (its final/, else its
newest committed checkpoint), and so is a checkpoint RUN/checkpoints/step-N written under any layout (resharded
into one model folder, cached inside it: ``model_from_checkpoint``): ``find_model_folder`` is the one place
that says so.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import torch

from trainscale.errors import TrainscaleError
from trainscale.safeio import (
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    check_folder_files,
    read_bytes,
    read_json_object,
    read_text,
)
from trainscale.specs import ModelSpec, load_model


def save_model_dir(out: str | Path, state_dict: dict[str, torch.Tensor], spec: ModelSpec,
                   tokenizer_json: str | Path | None) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    atomic_write(out / "model.safetensors",
                 lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "trainscale"}))
    atomic_write_json(out / "model.json", spec.model_dump(by_alias=True, exclude_none=True))
    if tokenizer_json is not None and Path(tokenizer_json).resolve() != (out / "tokenizer.json").resolve():
        atomic_write_bytes(out / "tokenizer.json", Path(tokenizer_json).read_bytes())
    return out


CHAT_FILES = ("tokenizer_config.json", "chat_template.jinja")  # what runtime/data/chat.py reads beside tokenizer.json


def copy_chat_files(src: str | Path, out: str | Path) -> list[str]:
    """Copy ``CHAT_FILES`` present in ``src`` into the model folder ``out`` (each read through safeio: a regular
    file of bounded size, tokenizer_config.json a JSON object) -> the names copied."""
    copied = []
    for name in CHAT_FILES:
        f = Path(src) / name
        if not f.is_file():
            continue
        if name.endswith(".json"):
            read_json_object(f, "tokenizer settings")
        atomic_write_bytes(Path(out) / name, read_bytes(f, "chat template file"))
        copied.append(name)
    return copied


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


# ------------------------------------------------------------------ a model out of a checkpoint
#
# A run that timed out, crashed, or has run.save_final = false leaves no final/, only DCP checkpoints
# (runtime/job/checkpoint.py): RUN/checkpoints/step-N, each tensor stored by name and global shape whatever the
# layout. ``model_from_checkpoint`` reads the model's weights whole in this one process (no process group) and
# writes them as a model folder, with the run's ModelSpec (RUN/config.toml) and tokenizer (RUN/tokenizer.json):
# RUN/checkpoints/step-N/model/ (a cache, reused while the checkpoint's manifest is unchanged), or, when the
# checkpoint folder is read-only, a folder in trainscale's cache named by the manifest's sha256.

RUN_CONFIG = "config.toml"  # what runtime/job/runfolder.py writes into every run folder, with tokenizer.json
RUN_TOKENIZER = "tokenizer.json"
CHECKPOINT_MODEL = "model"  # the model folder inside a checkpoint folder
SOURCE_FILE = "source.json"  # in that folder: the checkpoint, its manifest's sha256, the run, the step
_STEP = re.compile(r"^step-(\d{1,12})$")
_TMP_STEP = re.compile(r"^\.tmp-step-\d{1,12}$")
_OURS = {"model.json", "model.safetensors", RUN_TOKENIZER, SOURCE_FILE}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def is_step_name(name: str) -> bool:
    """Whether a folder name is a checkpoint's: step-N, or a save in progress .tmp-step-N."""
    return bool(_STEP.match(name) or _TMP_STEP.match(name))


def holds_steps(folder: Path) -> bool:
    """Whether ``folder`` holds step-N checkpoint folders (a checkpoint root)."""
    try:
        return any(_STEP.match(q.name) and q.is_dir() for q in folder.iterdir())
    except OSError:
        return False


def _steps_there(p: Path) -> str:
    """For a missing RUN/checkpoints/step-N: the steps that do exist there, as a clause of the sentence."""
    if not _STEP.match(p.name) or not p.parent.is_dir():
        return ""
    have = sorted(q.name for q in p.parent.iterdir() if _STEP.match(q.name) and q.is_dir())
    if not have:
        return f" ({p.parent} holds no committed checkpoint)"
    more = f" and {len(have) - 6} more" if len(have) > 6 else ""
    return f" (the committed checkpoints in {p.parent}: {', '.join(have[-6:])}{more})"


def run_toml(run: Path) -> dict:
    """A run folder's config.toml as a dict (runtime/config.py's TrainConfig.to_toml wrote it: every model field
    spelled out), ``[model] init`` dropped: the weights are the run's own now, and its source need not exist."""
    path = Path(run) / RUN_CONFIG
    try:
        data = tomllib.loads(read_text(path, "run config"))
    except tomllib.TOMLDecodeError as e:
        raise TrainscaleError(f"run config {path} is not TOML: {e}") from None
    if isinstance(data.get("model"), dict):
        data["model"] = {k: v for k, v in data["model"].items() if k != "init"}
    return data


def run_spec(run: Path) -> ModelSpec:
    """The ModelSpec a run trained (its config.toml's [model])."""
    model = run_toml(run).get("model")
    if not isinstance(model, dict):
        raise TrainscaleError(f"run config {Path(run) / RUN_CONFIG} has no [model] section")
    return load_model(model)


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
    if _TMP_STEP.match(ckpt.name):
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


# ------------------------------------------------------------------ the run a model folder came from


def run_folder_of(folder: Path) -> Path | None:
    """The run folder a model folder came from: RUN for RUN/final, the run source.json names for a model resharded
    from a checkpoint; None for any other folder."""
    folder = Path(folder)
    if (folder / SOURCE_FILE).is_file():
        try:
            run = read_json_object(folder / SOURCE_FILE, "model source").get("run")
        except TrainscaleError:
            return None
        return Path(run) if isinstance(run, str) and (Path(run) / RUN_CONFIG).is_file() else None
    parent = folder.resolve().parent
    return parent if folder.resolve().name == "final" and (parent / RUN_CONFIG).is_file() else None


def checkpoint_source(folder: Path) -> dict | None:
    """For a model folder resharded from a checkpoint: {checkpoint, step, run, layout, manifest_sha256}; else None."""
    try:
        return read_json_object(Path(folder) / SOURCE_FILE, "model source") if (Path(folder) / SOURCE_FILE).is_file() \
            else None
    except TrainscaleError:
        return None


def model_inputs(folder: Path) -> tuple[Path, ...]:
    """The folders a model folder's weights were read from (an output must not land in one): itself, and the
    checkpoint it was resharded from, if so."""
    origin = checkpoint_source(folder)
    ckpt = origin.get("checkpoint") if origin else None
    return (Path(folder), Path(ckpt)) if isinstance(ckpt, str) else (Path(folder),)


def beside(folder: Path, suffix: str) -> Path:
    """The default output folder for what is made from a model folder: FOLDER{suffix} beside it; for a model
    resharded from RUN/checkpoints/step-N, RUN/step-N{suffix} (never inside the checkpoint)."""
    folder = Path(folder).resolve()
    run = run_folder_of(folder) if (folder / SOURCE_FILE).is_file() else None
    if run is not None and folder.name == CHECKPOINT_MODEL and _STEP.match(folder.parent.name):
        return run / f"{folder.parent.name}{suffix}"
    return folder.with_name(f"{folder.name}{suffix}")


def read_spec(folder: Path) -> ModelSpec:
    """The ModelSpec of a model folder's model.json."""
    return load_model(read_json_object(folder / "model.json", "model description"))


# safetensors' dtype names (the header's "dtype" field, safetensors format spec: F32, BF16, F16, I8, U8, ...)
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8"}
_LAYER = re.compile(r"^layers\.(\d{1,9})\.")


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, safetensors dtype)} from a safetensors file's header alone: no tensor is read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"{path} is corrupt or unreadable: {str(e)[:200]}") from None


def check_layer_count(path: Path, names, spec: ModelSpec, against: str = "model.json") -> None:
    """The layers a file's tensor names hold against model.json's n_layers: checked before the model is built
    (building it costs time in proportion to n_layers, so a model.json claiming 100,000 layers is refused here)."""
    found = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    if len(found) != spec.n_layers:
        raise TrainscaleError(f"{path} does not match {against}: it holds weights for {len(found)} layers, "
                              f"{against} says n_layers = {spec.n_layers}")


def check_header(path: Path, header: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, torch.Tensor],
                 against: str = "model.json") -> None:
    """Names, shapes and dtypes of a file's header against the tensors the model expects (meta tensors do)."""
    where = f"{path} does not match {against}:"
    missing = [k for k in expected if k not in header]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise TrainscaleError(f"{where} it lacks tensor {missing[0]!r}{more}")
    extra = [k for k in header if k not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise TrainscaleError(f"{where} it holds tensor {extra[0][:200]!r}{more}, which the model does not have")
    for name, t in expected.items():
        shape, dtype = header[name]
        if shape != tuple(t.shape):
            raise TrainscaleError(f"{where} tensor {name!r} has shape {list(shape)}, the model expects "
                                  f"{list(t.shape)}")
        if dtype != ST_DTYPES.get(t.dtype):
            raise TrainscaleError(f"{path}: tensor {name!r} is {dtype}, expected {ST_DTYPES.get(t.dtype)} "
                                  "like the rest of the file")


def check_finite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every floating tensor finite: a NaN or infinite weight would make every output NaN."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise TrainscaleError(f"{path}: tensor {name!r} holds {bad} NaN or infinite values; refusing to load it")


def check_model_file(path: Path, spec: ModelSpec):
    """model.safetensors' header against ``spec`` before any tensor is loaded: layer count, then names, shapes
    and one dtype for the whole file (F32, or BF16 throughout). -> the meta model (built once, reused)."""
    from trainscale.runtime.model import build_model

    header = read_header(path)
    check_layer_count(path, header, spec)
    model = build_model(spec, "meta")
    dt = torch.bfloat16 if header and all(d == "BF16" for _, d in header.values()) else torch.float32
    check_header(path, header, {k: v.to(dt) for k, v in model.state_dict().items()})
    return model


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


# ------------------------------------------------------------------ a rank's slices of a model folder


def load_folder_into(parts: list[torch.nn.Module], folder: str | Path) -> int:
    """Fill every parameter of the (parallelized, materialised) parts with its slice of a model folder's
    model.safetensors, by trainscale name (no renaming, no permutation; runtime/weights.py): -> elements this
    rank read."""
    from trainscale.runtime.weights import Safetensors, fill

    path = Path(folder) / "model.safetensors"
    try:
        weights = Safetensors(folder, path.name, what=f"[model] init {path}")
        for part in parts:
            fill(part, weights.read)
    except TrainscaleError:
        raise
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"[model] init {path} cannot be read: {str(e)[:200]}") from None
    return weights.elements_read
