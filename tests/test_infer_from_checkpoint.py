"""A model out of any checkpoint (issue 21 item 4). One torchrun job (tests/_ckpt_worker.py) trains configs/tiny.toml
4 steps under each layout into its own run folder, with final/ and a DCP checkpoint at steps 2 and 4; the model
resharded in one process from the step-4 checkpoint must be final/ (the weights train.py gathered), tensor for tensor
and byte for byte, whatever layout wrote it. Plus: the references every infer command accepts, ``[model] init`` from a
checkpoint, the one-sentence refusals, and quantize's held-out text (the run's own, and saying so)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainscale.errors import TrainscaleError
from trainscale.runtime.find_model import find_model_folder

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_ckpt_worker.py"
LAYOUTS = ["dp2", "tp2", "pp2", "fsdp2", "cp2", "pp2,v2,interleaved", "moe:dp2,ep2"]
INIT = "init:dp2>tp2"  # one step from dp2's step-2 checkpoint under tp2 at lr 1e-30
LAST, MID = "step-00000004", "step-00000002"


def ts(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscale", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def st_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """{name: (safetensors dtype, shape, raw bytes)} of a safetensors file."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            out[k] = (f.get_slice(k).get_dtype(), list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def max_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    return max(float((x[k].float() - y[k].float()).abs().max()) for k in x)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fromckpt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           "--config", str(ROOT / "configs" / "tiny.toml"), "--moe-config", str(ROOT / "configs" / "moe-tiny.toml"),
           "--layouts", ";".join([*LAYOUTS, INIT]), "--steps", "4", "--every", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "TRAINSCALE_CACHE": str(out / "cache")})
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def _copy_run(runs: Path, item: str, dest: Path, final: bool = False) -> Path:
    shutil.copytree(runs / item, dest, ignore=None if final else shutil.ignore_patterns("final"))
    for ckpt in (dest / "checkpoints").glob("step-*"):
        shutil.rmtree(ckpt / "model", ignore_errors=True)  # no resharded copy: this run's own
    return dest


@pytest.mark.parametrize("item", LAYOUTS)
def test_checkpoint_of_every_layout_reshards_to_final(runs, item):
    """The model read in one process from the step-4 checkpoint is final/ byte for byte (names, dtypes, shapes,
    every tensor's bytes), under dp, fsdp (zero3), tp, pp (1f1b and interleaved virtual stages), cp and ep."""
    run = runs / item
    said: list[str] = []
    folder = find_model_folder(run / "checkpoints" / LAST, log=said.append)
    assert folder == run / "checkpoints" / LAST / "model" and "resharded the step-4 checkpoint" in said[0]
    got, final = st_tensors(folder / "model.safetensors"), st_tensors(run / "final" / "model.safetensors")
    assert got.keys() == final.keys() and len(got) >= 39
    assert all(got[k] == final[k] for k in got), [k for k in got if got[k] != final[k]]
    assert max_diff(folder / "model.safetensors", run / "final" / "model.safetensors") == 0.0
    assert (folder / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    assert json.loads((folder / "model.json").read_text()) == json.loads((run / "final" / "model.json").read_text())
    src = json.loads((folder / "source.json").read_text())
    assert src["step"] == 4 and src["layout"] == json.loads((run / "run.json").read_text())["layout"]
    # the second time: the cached folder, no second reshard
    assert find_model_folder(run / "checkpoints" / LAST, log=said.append) == folder and "resharded before" in said[1]


def test_a_checkpoint_holds_its_own_steps_weights(runs):
    mid = find_model_folder(runs / "dp2" / "checkpoints" / MID, log=lambda _m: None)
    assert max_diff(mid / "model.safetensors", runs / "dp2" / "final" / "model.safetensors") > 1e-4


@pytest.mark.parametrize("item", ["dp2", "tp2", "pp2", "fsdp2"])
def test_export_of_a_checkpoint_is_the_export_of_final(runs, item, tmp_path):
    """`trainscale export RUN/checkpoints/step-N --to hf` writes the same Hugging Face tensors as exporting final/."""
    from trainscale.infer.export import export_hf

    run = _copy_run(runs, item, tmp_path / item, final=True)
    r = ts("export", str(run / "checkpoints" / LAST), "--to", "hf", str(tmp_path / "hf-ckpt"), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["equal"] and rep["from_checkpoint"]["step"] == 4 and "resharded the step-4" in r.stderr
    export_hf(run / "final", tmp_path / "hf-final", "float32")
    a = st_tensors(tmp_path / "hf-ckpt" / "model.safetensors")
    b = st_tensors(tmp_path / "hf-final" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def test_a_run_without_final_is_its_newest_checkpoint_for_every_command(runs, tmp_path):
    """generate, quantize and lora take RUN (no final/: its newest checkpoint, said on the console) and
    RUN/checkpoints/step-N; the outputs land in RUN, never inside the checkpoint."""
    from trainscale.infer.generate import Sampling, generate_ids
    from trainscale.infer.load import load_for_inference

    run = _copy_run(runs, "dp2", tmp_path / "run")
    r = ts("generate", str(run), "-p", "ROMEO:", "-n", "6", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert f"has no final/ model: using its newest committed checkpoint {run / 'checkpoints' / LAST}" in r.stderr
    g = json.loads(r.stdout)
    assert g["from_checkpoint"]["step"] == 4
    model, _, folder = load_for_inference(runs / "dp2" / "final")
    from trainscale.infer.load import load_tokenizer_for

    ids = load_tokenizer_for(folder).encode("ROMEO:").ids
    assert g["token_ids"] == generate_ids(model, ids, 6, Sampling(0.0, 0, 1.0, 0)).new_ids[:len(g["token_ids"])]

    r = ts("quantize", str(run / "checkpoints" / MID), "--eval-tokens", "1024", "-n", "0", "--json")
    assert r.returncode == 0, r.stderr
    q = json.loads(r.stdout)
    assert Path(q["out"]) == (run / f"{MID}-int4-g32").resolve() and q["from_checkpoint"]["step"] == 2
    assert q["perplexity"]["text_kind"] == "run-plays" and str(run.resolve()) in q["perplexity"]["text"]
    assert q["perplexity"]["tokens"] == 1024

    r = ts("lora", str(run / "checkpoints" / MID), "--rank", "2", "--data", "corpus:val", "--steps", "2", "--batch",
           "2", "--seq-len", "16", "--json")
    assert r.returncode == 0, r.stderr
    lo = json.loads(r.stdout)
    assert Path(lo["out"]) == (run / f"{MID}-lora-r2").resolve() and lo["from_checkpoint"]["step"] == 2
    assert (run / f"{MID}-lora-r2" / "adapter.json").exists()


def test_model_init_from_a_checkpoint_reads_its_weights(runs):
    """``[model] init = RUN/checkpoints/step-2`` under tp2: each rank reads its shards of the resharded model; one
    step at lr 1e-30 changes no fp32 weight, so final/ is the checkpoint's model byte for byte."""
    init_run = runs / INIT.replace(">", "-to-")
    mid = runs / "dp2" / "checkpoints" / MID / "model"
    got, want = st_tensors(init_run / "final" / "model.safetensors"), st_tensors(mid / "model.safetensors")
    assert got.keys() == want.keys() and all(got[k] == want[k] for k in got)
    config = (init_run / "config.toml").read_text()
    assert f'init = "{mid}"' in config and f'tokenizer = "{mid / "tokenizer.json"}"' in config


def _reseal(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    for p in folder.iterdir():
        if p.is_file() and p.name != "manifest.json":
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            manifest["files"][p.name] = {"bytes": p.stat().st_size, "sha256": digest}
    (folder / "manifest.json").write_text(json.dumps(manifest))


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_bad_references_are_one_sentence(runs, tmp_path):
    run = _copy_run(runs, "dp2", tmp_path / "run")
    ck = run / "checkpoints"

    def refused(path, *words):
        with pytest.raises(TrainscaleError) as e:
            find_model_folder(path, log=lambda _m: None)
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words), msg

    refused(ck / "step-00000003", "does not exist", f"{MID}, {LAST}")
    shutil.copytree(ck / MID, ck / ".tmp-step-00000006")
    refused(ck / ".tmp-step-00000006", "never committed")
    shutil.copytree(ck / MID, ck / "step-00000008")
    (ck / "step-00000008" / "manifest.json").unlink()
    refused(ck / "step-00000008", "incomplete", "no manifest.json")
    shard = next((ck / "step-00000008").glob("*.distcp"))
    shutil.rmtree(ck / "step-00000008")
    damaged = ck / "step-00000010"
    shutil.copytree(ck / MID, damaged)
    data = bytearray((damaged / shard.name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / shard.name).write_bytes(bytes(data))
    refused(damaged, "incomplete or damaged", "checksum mismatch")
    shutil.rmtree(damaged)
    (tmp_path / "neither").mkdir()
    refused(tmp_path / "neither", "is not a trainscale model folder")
    empty = tmp_path / "empty-run"
    empty.mkdir()
    shutil.copy(run / "config.toml", empty / "config.toml")
    refused(empty, "has no final/ model", "no complete checkpoint")
    other = _copy_run(runs, "tp2", tmp_path / "other")  # another run's identity around dp2's checkpoint
    shutil.copytree(ck / MID, other / "checkpoints" / "step-00000012")
    refused(other / "checkpoints" / "step-00000012", "was written by run", "belongs to run")
    # a crafted DCP metadata pickle, resealed: refused by the restricted unpickler, nothing runs
    marker = tmp_path / "pwned"
    crafted = ck / "step-00000014"
    shutil.copytree(ck / MID, crafted)
    (crafted / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _reseal(crafted)
    refused(crafted, "is refused", "system")
    assert not marker.exists()
    for args in (("export", str(ck / "step-00000003"), "--to", "hf", str(tmp_path / "x")),
                 ("generate", str(ck / ".tmp-step-00000006"), "-p", "hi")):
        r = ts(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("trainscale: error:"), r.stderr


def test_a_read_only_checkpoint_reshards_into_the_cache(runs, tmp_path, monkeypatch):
    """A checkpoint folder that cannot be written (another user's, a read-only mount): the model folder goes to
    $TRAINSCALE_CACHE/checkpoint-models/<manifest sha256>."""
    import trainscale.runtime.find_model as find_model

    run = _copy_run(runs, "tp2", tmp_path / "run")
    monkeypatch.setenv("TRAINSCALE_CACHE", str(tmp_path / "cache"))
    real = find_model.save_model_dir  # the model folder's writer, as find_model (the resharder) calls it

    def read_only_checkpoint(out, *a, **k):
        if Path(out).parent.name.startswith("step-"):
            raise PermissionError(13, "Permission denied", str(out))
        return real(out, *a, **k)

    monkeypatch.setattr(find_model, "save_model_dir", read_only_checkpoint)
    folder = find_model_folder(run / "checkpoints" / LAST, log=lambda _m: None)
    assert folder.parent == tmp_path / "cache" / "checkpoint-models"
    assert not (run / "checkpoints" / LAST / "model").exists()
    assert st_tensors(folder / "model.safetensors") == st_tensors(runs / "tp2" / "final" / "model.safetensors")
