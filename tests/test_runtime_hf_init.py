"""[model] init: a Hugging Face Llama folder (made here with transformers, nothing downloaded) loads into
any layout with each rank reading only its slices; the logits equal transformers' own; training from it
works under dp2,tp2; HF -> trainscale (0 steps) -> export --to hf gives the original's logits back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _parity import run_job

from trainscale.errors import TrainscaleError
from trainscale.runtime.hf_init import load_hf_init
from trainscale.runtime.init import resolved_config
from trainscale.runtime.model import build_model

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_hf_init_worker.py"
HF = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 4,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rope_theta": 500.0,
      "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
LAYOUTS = ["dp2,tp2", "fsdp2,tp2", "pp2,fsdp2", "fsdp4"]


def make_hf(folder: Path, shard: str | None = None, **over) -> torch.nn.Module:
    """A random LlamaForCausalLM (norm gains perturbed, so a swapped norm shows) saved as safetensors."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF, **over})).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn(p.shape))
    model.save_pretrained(str(folder), **({"max_shard_size": shard} if shard else {}))
    save_tokenizer(folder, model.config.vocab_size)
    return model


def save_tokenizer(folder: Path, vocab: int) -> None:
    """The folder's tokenizer.json: a byte-level BPE of ``vocab`` tokens on the plays (the token ids its embeddings
    stand for; ``[model] init`` refuses a folder without one)."""
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe

    train_bpe([corpus_text("train", max_chars=100_000)], vocab).save(str(Path(folder) / "tokenizer.json"))


def write_config(path: Path, init: Path | str, **model) -> Path:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in model.items())
    path.write_text(f'name = "hfinit"\n[model]\ninit = "{init}"\n{extra}'
                    "[train]\nsteps = 10\nlr = 1e-3\nwarmup = 2\nseq_len = 32\nglobal_batch = 8\n"
                    "[data]\nmax_chars = 200000\n[run]\neval_sequences = 0\nsave_final = false\n")
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> tuple[Path, Path, torch.nn.Module]:
    d = tmp_path_factory.mktemp("hf")
    model = make_hf(d / "sharded", shard="200KB")
    make_hf(d / "single")
    assert (d / "sharded" / "model.safetensors.index.json").exists() and (d / "single" / "model.safetensors").exists()
    return d / "sharded", d / "single", model


@pytest.mark.parametrize("which", [0, 1], ids=["sharded", "single-file"])
def test_logits_equal_transformers(hf_dirs, tmp_path, which):
    folder, hf = hf_dirs[which], hf_dirs[2]
    cfg = resolved_config(write_config(tmp_path / "c.toml", folder))
    assert (cfg.model.n_layers, cfg.model.n_kv_heads, cfg.model.rope_theta) == (4, 2, 500.0)
    model = build_model(cfg.model, "meta")
    model.to_empty(device="cpu")
    read = load_hf_init([model], cfg.init, cfg.model)
    assert read == sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(x).logits - model(x)).abs().max().item()
    assert diff < 1e-5


@pytest.mark.dist
def test_layouts_read_their_shards_train_and_round_trip(hf_dirs, tmp_path):
    folder, hf = hf_dirs[0], hf_dirs[2]
    config = write_config(tmp_path / "c.toml", folder)
    result, saved = tmp_path / "r.json", tmp_path / "saved"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(WORKER),
           "--config", str(config), "--layouts", ";".join(LAYOUTS), "--steps", "10", "--result", str(result),
           "--save", str(saved)]
    proc = run_job(cmd)
    assert proc.returncode == 0, proc.stderr[-5000:]
    got = json.loads(result.read_text())
    total = sum(p.numel() for p in hf.parameters())
    ref = got["fsdp4"]["losses"]
    for layout in LAYOUTS:
        r = got[layout]
        assert r["step0_max_diff"] == 0.0, layout  # the gathered shards are the folder's tensors, bit for bit
        for read, held in zip(r["read"], r["local_params"], strict=True):
            # each rank reads what it holds (plus, where FSDP cuts inside a head, the rest of that head's rows)
            assert held <= read <= held + 4 * 16 * 64, layout
            assert read < 0.6 * total, layout  # never the whole model
        losses = r["losses"]
        assert len(losses) == 10 and losses[-1] < losses[0] - 0.2, layout  # it trains
        assert max(abs(a - b) / b for a, b in zip(losses, ref, strict=True)) < 1e-4, layout

    # round trip: the dp2,tp2 step-0 weights, exported to HF, give the original's logits
    from trainscale.infer.export import export_hf

    export_hf(saved, tmp_path / "hf_again")
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf_again")).eval()
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (back(x).logits - hf(x).logits).abs().max().item() < 1e-5


@pytest.mark.slow
def test_bad_init_folders_are_one_line(hf_dirs, tmp_path):
    folder = hf_dirs[1]
    with pytest.raises(TrainscaleError, match="is not a folder"):
        resolved_config(write_config(tmp_path / "a.toml", tmp_path / "missing"))
    gpt = tmp_path / "gpt2"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (gpt / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(TrainscaleError, match="holds a 'gpt2' model; only Llama-family"):
        resolved_config(write_config(tmp_path / "b.toml", gpt))
    with pytest.raises(TrainscaleError, match=r"has shape \[512, 64\], but the model needs \[1024, 64\]"):
        resolved_config(write_config(tmp_path / "c.toml", folder, vocab_size=1024))
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(TrainscaleError, match="has no model.safetensors"):
        resolved_config(write_config(tmp_path / "d.toml", empty))
    # the command line: one line on stderr, exit 2, nothing launched
    proc = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(tmp_path / "b.toml"),
                           "--dry-run"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "only Llama-family" in proc.stderr


def test_init_defaults_to_the_folders_own_tokenizer(tmp_path):
    """#21: `[model] init` without `[data] tokenizer` takes the folder's tokenizer (its token ids are the ones the
    embeddings were trained on), not a new BPE; #33: a folder without one is refused in one sentence naming
    [data] tokenizer, and a tokenizer named there is taken."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from trainscale.runtime.data.tokenizer import load_tokenizer
    from trainscale.runtime.init import resolved_config

    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=64, vocab_size=320, max_position_embeddings=64)
    folder = tmp_path / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    toml = tmp_path / "c.toml"
    toml.write_text(f'name = "t"\n[model]\ninit = "{folder}"\n[train]\nsteps = 1\nseq_len = 16\nglobal_batch = 2\n')
    with pytest.raises(TrainscaleError, match=r"holds no tokenizer .*; name that tokenizer with \[data\] tokenizer") \
            as e:
        resolved_config(toml)  # no tokenizer in the folder: a new BPE would silently give its ids to other text
    assert "\n" not in str(e.value)
    named = tmp_path / "named.json"
    save_tokenizer(tmp_path, 320)
    (tmp_path / "tokenizer.json").rename(named)
    assert resolved_config(toml, {"data": {"tokenizer": str(named)}}).data.tokenizer == str(named)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["to be or not to be"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end_of_text|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end_of_text|>").save_pretrained(folder)
    got = resolved_config(toml).data.tokenizer
    assert got == str(folder)
    assert load_tokenizer(got).encode("to be").ids == tok.encode("to be").ids
