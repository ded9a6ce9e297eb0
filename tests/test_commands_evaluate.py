"""`trainscale evaluate`: loss and perplexity of any model folder on a text, saying which text.

- on a Hugging Face folder, the loss equals transformers' own cross-entropy of the same windows (fp32);
- ``--split held-out`` is the trainer's held-out split token for token: the documents ``prepare`` (the training
  shards) puts in val.npy for the same file;
- without --data, a model with no held-out data of its own is one sentence asking for --data; a run's model is
  evaluated on its run's held-out split (the quantize command's text, through the same function).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from infer_fixtures import cli_error as fails
from infer_fixtures import cli_json as cli
from infer_fixtures import make_hf_llama32

transformers = pytest.importorskip("transformers")

VOCAB = 300


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer, a JSONL file of the plays' paragraphs, and a transformers Llama 3.2-shaped folder."""
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("evaluate")
    text = corpus_text("train", max_chars=80_000)
    train_bpe([text], VOCAB).save(str(d / "tokenizer.json"))
    paras = [p for p in text.split("\n\n") if p.strip()]
    (d / "data.jsonl").write_text("".join(json.dumps({"id": i, "body": p}) + "\n" for i, p in enumerate(paras)))
    return {"dir": d, "tokenizer": d / "tokenizer.json", "data": d / "data.jsonl",
            "hf": make_hf_llama32(d / "hf", d / "tokenizer.json", VOCAB)}


@pytest.mark.slow
def test_loss_on_an_hf_folder_equals_transformers(world):
    rep = cli("evaluate", str(world["hf"]), "--data", str(world["data"]), "--text-field", "body", "--max-tokens",
              "700", "--seq-len", "64")
    assert (rep["split"], rep["text_source"], rep["tokens"], rep["seq_len"]) == ("all", str(world["data"]), 700, 64)
    assert "data.jsonl (field 'body'): all" in rep["text"] and "700 tokens" in rep["text"]
    # the same 700 tokens, the same windows of 64 + 1, scored by transformers
    from trainscale.infer.lora import split_data
    from trainscale.runtime.data.tokenizer import load_tokenizer

    ids = split_data(str(world["data"]), load_tokenizer(world["tokenizer"]), "body", world["hf"], held_out=0.05,
                     max_tokens=700, keep="all").train
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(world["hf"]), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for a in range(0, len(ids) - 1, 64):
            w = torch.tensor([ids[a: a + 65]])
            total += F.cross_entropy(theirs(w[:, :-1]).logits[0], w[0, 1:], reduction="sum").item()
            count += w.shape[1] - 1
    assert rep["scored_tokens"] == count == 699
    assert rep["loss"] == pytest.approx(total / count, rel=1e-5)
    assert rep["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_held_out_split_is_the_trainers(world, tmp_path):
    """The trainer's prepare (runtime/data/shards.py, held_out 0.05) writes the held-out documents of the file to
    val.npy; ``evaluate --split held-out`` on the same file scores exactly those tokens."""
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.config import config_from_dict
    from trainscale.runtime.data.corpus import corpus_for
    from trainscale.runtime.data.tokenizer import load_tokenizer

    spec = {"name": "evaluate", "n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
            "vocab_size": 512, "max_seq_len": 64}
    cfg = config_from_dict({"name": "own", "model": spec, "train": {"seq_len": 64},
                            "data": {"files": [str(world["data"])], "text_field": "body",
                                     "prepared": str(tmp_path / "prepared"), "workers": 1}})
    corpus = corpus_for(cfg)
    stream = corpus.tokens("val")
    val = [int(i) for i in stream[0:len(stream)]]
    from trainscale.runtime.model import build_model

    model = save_model_dir(tmp_path / "m", build_model(cfg.model, seed=0).state_dict(), cfg.model,
                           corpus.tokenizer_path)  # a folder from no run: the trainer's default fraction, 0.05
    rep = cli("evaluate", str(model), "--data", str(world["data"]), "--text-field", "body", "--split", "held-out",
              "--max-tokens", "100000")
    assert rep["split"] == "held-out" and "the held-out documents" in rep["text"] and "5% held out" in rep["text"]
    assert 50 < rep["tokens"] == len(val)
    from trainscale.infer.lora import split_data

    got = split_data(str(world["data"]), load_tokenizer(corpus.tokenizer_path), "body", model, held_out=0.05)
    assert got.held == val and got.held_documents > 0


def test_without_data_it_asks_or_takes_the_runs_held_out_split(world, tmp_path):
    msg = fails("evaluate", str(world["hf"]))
    assert "has no held-out data of its own" in msg and "--data" in msg
    assert "--split must be all or held-out" in fails("evaluate", str(world["hf"]), "--data", str(world["data"]),
                                                      "--split", "val")
    assert "--split all needs --data" in fails("evaluate", str(world["hf"]), "--split", "all")
    # a run on the plays: its model is evaluated on the held-out plays, and says so
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.config import config_from_dict
    from trainscale.runtime.model import build_model

    spec = {"name": "run-eval", "n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
            "vocab_size": VOCAB, "max_seq_len": 64}
    cfg = config_from_dict({"name": "own", "model": spec, "train": {"seq_len": 64}})
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(cfg.to_toml())
    save_model_dir(run / "final", build_model(cfg.model, seed=0).state_dict(), cfg.model, world["tokenizer"])
    rep = cli("evaluate", str(run), "--max-tokens", "300")
    assert rep["text_kind"] == "run-plays" and str(run.resolve()) in rep["text"] and rep["tokens"] == 300
    assert rep["perplexity"] == pytest.approx(math.exp(rep["loss"]))
    q = cli("quantize", str(run), "--eval-tokens", "300", "-n", "0", "--out", str(tmp_path / "q"))
    assert q["perplexity"]["text"] == rep["text"]  # quantize says the same sentence, from the same function
