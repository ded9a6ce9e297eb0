"""Lying model folders through the real CLI: a model.json that disagrees with its safetensors (a renamed tensor,
a wrong shape, a stray bf16 tensor, 100,000 claimed layers beside two layers of weights), NaN weights, a tokenizer
larger than the vocabulary, adapter chains that loop. Each is refused in one sentence (exit 2), quickly, with no
"unexpected" error; the untouched folder still generates. Tiny folders written with the project's own writers
(runtime.artifact.save_model_dir, infer.lora.save_adapter_folder, `trainscale quantize`), untrained: no torchrun."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

TINY = {"name": "tiny", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "vocab_size": 300,
        "max_seq_len": 64}
TEXT = "the quick brown fox jumps over the lazy dog; hello world. " * 40
VARIED = " ".join(f"alpha{i} beta{i * 7} gamma{i % 13}" for i in range(400))  # enough pairs for 600 merges


def ts(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "trainscale", *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    return r, time.perf_counter() - t0


def refused(*args: str, says: str) -> str:
    """The command exits 2 with one line that contains ``says``, no 'unexpected', in well under a minute."""
    r, secs = ts(*args)
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 2, out[-2000:]
    assert len(out.splitlines()) == 1, out
    assert "unexpected" not in out and "please report" not in out and "Traceback" not in out
    assert says in out, out
    assert secs < 30, secs  # a couple of seconds alone; 2 shared cores here
    return out


def write_folder(out: Path, spec_fields: dict | None = None, tok_vocab: int = 300) -> Path:
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.data.tokenizer import train_bpe
    from trainscale.runtime.model import build_model
    from trainscale.specs import load_model

    out.mkdir(parents=True)
    train_bpe([TEXT, VARIED], tok_vocab).save(str(out / "tokenizer.json"))
    spec = load_model({**TINY, **(spec_fields or {})})
    return save_model_dir(out, build_model(spec, seed=0).state_dict(), spec, out / "tokenizer.json")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("mf") / "good")


def copy(good: Path, tmp_path: Path, name: str = "lying") -> Path:
    return Path(shutil.copytree(good, tmp_path / name))


def retensor(folder: Path, change, file: str = "model.safetensors") -> None:
    sd = load_file(str(folder / file))
    change(sd)
    save_file(sd, str(folder / file), metadata={"format": "pt"})


def edit_spec(folder: Path, **fields) -> None:
    spec = json.loads((folder / "model.json").read_text())
    (folder / "model.json").write_text(json.dumps({**spec, **fields}))


@pytest.mark.slow
def test_untouched_folder_generates(good):
    r, _ = ts("generate", good, "--prompt", "hello", "-n", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["new_tokens"] == 4


@pytest.mark.slow
def test_renamed_tensor(good, tmp_path):
    f = copy(good, tmp_path)
    name = "layers.0.attention.wq.weight"
    retensor(f, lambda sd: sd.__setitem__(name + "_renamed", sd.pop(name)))
    refused("generate", f, "--prompt", "x", says="lacks tensor 'layers.0.attention.wq.weight'")


@pytest.mark.slow
def test_extra_tensor(good, tmp_path):
    f = copy(good, tmp_path)
    retensor(f, lambda sd: sd.__setitem__("layers.0.stray", torch.zeros(3)))
    refused("export", f, tmp_path / "hf", "--to", "hf", says="holds tensor 'layers.0.stray'")


@pytest.mark.slow
def test_shape_disagrees_with_model_json(good, tmp_path):
    f = copy(good, tmp_path)
    edit_spec(f, d_ff=96)  # the file's MLP matrices are 64 wide
    out = refused("generate", f, "--prompt", "x", says="has shape [64, 32], the model expects [96, 32]")
    assert "feed_forward" in out


@pytest.mark.slow
def test_stray_bf16_tensor(good, tmp_path):
    f = copy(good, tmp_path)
    retensor(f, lambda sd: sd.__setitem__("norm.weight", sd["norm.weight"].bfloat16()))
    refused("quantize", f, "--format", "int8", "--out", tmp_path / "q", says="'norm.weight' is BF16, expected F32")


@pytest.mark.slow
def test_all_bf16_folder_loads(good, tmp_path):
    """A folder in bf16 throughout is one the docstring allows: accepted."""
    f = copy(good, tmp_path)
    retensor(f, lambda sd: sd.update({k: v.bfloat16() for k, v in sd.items()}))
    r, _ = ts("generate", f, "--prompt", "hello", "-n", "2", "--json")
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight(good, tmp_path, value):
    f = copy(good, tmp_path)
    retensor(f, lambda sd: sd["layers.1.attention.wo.weight"].__setitem__((3, 5), value))
    for cmd in (("generate", f, "--prompt", "x"), ("quantize", f, "--format", "int4", "--out", tmp_path / "q"),
                ("export", f, tmp_path / "hf", "--to", "hf")):
        refused(*cmd, says="'layers.1.attention.wo.weight' holds 1 NaN or infinite values")


@pytest.mark.slow
def test_huge_model_json_beside_small_weights(good, tmp_path):
    f = copy(good, tmp_path)
    edit_spec(f, n_layers=100_000, d_model=1 << 20, n_heads=1 << 10, n_kv_heads=1 << 10, d_ff=1 << 22)
    refused("generate", f, "--prompt", "x", says="holds weights for 2 layers, model.json says n_layers = 100000")
    f2 = copy(good, tmp_path, "wide")
    edit_spec(f2, d_model=1 << 20, n_heads=1 << 10, n_kv_heads=1 << 9, d_ff=1 << 22, vocab_size=1 << 24)
    refused("generate", f2, "--prompt", "x", says="does not match model.json")


@pytest.mark.slow
def test_token_id_beyond_vocabulary(good, tmp_path):
    from tokenizers import Tokenizer

    f = copy(good, tmp_path)
    big = write_folder(tmp_path / "big", tok_vocab=600)
    shutil.copy(big / "tokenizer.json", f / "tokenizer.json")
    ids = Tokenizer.from_file(str(f / "tokenizer.json")).encode(VARIED[:200]).ids
    assert max(ids) >= TINY["vocab_size"]  # the 600-token tokenizer merges past the model's 300 rows
    refused("generate", f, "--prompt", VARIED[:200], says="outside the model's vocabulary of 300")


def write_adapter(out: Path, base: Path) -> Path:
    """A rank-2 adapter on wq and wv of ``base`` (its B nonzero, so folding it changes the weights)."""
    from trainscale.estimate.lora import lora_targets
    from trainscale.infer.lora import apply_lora, save_adapter_folder
    from trainscale.runtime.artifact import read_spec
    from trainscale.runtime.model import build_model

    spec = read_spec(base)
    model = build_model(spec, "cpu")
    apply_lora(model, 2, 4.0, lora_targets(spec, ("wq", "wv")))
    return save_adapter_folder(out, model, spec, base, {"rank": 2, "alpha": 4.0, "targets": ["wq", "wv"]})


def set_base(adapter: Path, base: Path) -> None:
    cfg = json.loads((adapter / "adapter.json").read_text())
    (adapter / "adapter.json").write_text(json.dumps({**cfg, "base": str(base)}))


@pytest.mark.slow
def test_adapter_loads_and_chains_are_bounded(good, tmp_path):
    a = write_adapter(tmp_path / "a", good)
    r, _ = ts("generate", a, "--prompt", "hello", "-n", "2", "--json")
    assert r.returncode == 0, r.stderr
    set_base(a, a)  # itself
    refused("generate", a, "--prompt", "x", says="must be another model folder")
    b = write_adapter(tmp_path / "b", good)
    set_base(a, b)
    set_base(b, a)  # a -> b -> a
    refused("generate", a, "--prompt", "x", says="loops back to")
    chain = [good]
    for i in range(6):  # a chain deeper than MAX_ADAPTER_DEPTH, no loop
        chain.append(write_adapter(tmp_path / f"c{i}", chain[-1]))
    refused("generate", chain[-1], "--prompt", "x", says="levels deep")


@pytest.mark.slow
def test_lying_adapter_file(good, tmp_path):
    a = write_adapter(tmp_path / "a", good)
    retensor(a, lambda sd: sd.__setitem__("layers.0.attention.wq.lora_a", torch.zeros(3, 32)),
             file="adapter.safetensors")
    refused("generate", a, "--prompt", "x", says="'layers.0.attention.wq.lora_a' has shape [3, 32]")
    retensor(a, lambda sd: sd.__setitem__("layers.0.attention.wq.lora_a", torch.full((2, 32), float("nan"))),
             file="adapter.safetensors")
    refused("generate", a, "--prompt", "x", says="NaN or infinite")


@pytest.mark.slow
def test_lying_quantized_folder(good, tmp_path):
    q = tmp_path / "q"
    r, _ = ts("quantize", good, "--format", "int8", "--out", q)
    assert r.returncode == 0, r.stderr
    r, _ = ts("generate", q, "--prompt", "hello", "-n", "2", "--json")
    assert r.returncode == 0, r.stderr
    qsd = load_file(str(q / "quantized.safetensors"))
    meta = {"producer": "trainscale", "format": "int8", "bits": "8", "group_size": "32", "scheme": "symmetric"}
    scales = qsd["output.weight.scales"].clone()
    qsd["output.weight.scales"][7, 0] = float("nan")
    save_file(qsd, str(q / "quantized.safetensors"), metadata=meta)
    refused("generate", q, "--prompt", "x", says="'output.weight.scales' holds 1 NaN or infinite values")
    qsd["output.weight.scales"] = scales[:, :0]
    save_file(qsd, str(q / "quantized.safetensors"), metadata=meta)
    refused("export", q, tmp_path / "hf", "--to", "hf", says="'output.weight.scales' has shape [300, 0]")
