"""LoRA on chat data (``lora --data X.jsonl``, detected, or ``--format chat``): each conversation rendered with the base
folder's chat template (runtime/data/chat.py), the loss on the assistant's tokens only, one conversation per row.

- the mask: changing the logits where a target is not learned leaves lora_loss unchanged; changing one learned
  target's logit changes it;
- a padded batch scores each conversation exactly as alone (causal attention, positions from 0);
- the held-out conversations are the trainer's (prepare with [data] format = "chat": its val tokens and flags);
- training on a tiny transformers Llama folder lowers the held-out loss on the assistant's tokens, and ``evaluate``
  of the adapter folder measures the same conversations to the same perplexity.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _chat_fixtures import chat_folder
from infer_fixtures import cli_json as cli
from typer.testing import CliRunner

from trainscale.cli import app

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

VOCAB = 384


def conversations(path: Path, n: int = 120) -> Path:
    """Arithmetic questions with a fixed answer pattern (learnable in a few steps); every 3rd a two-turn chat."""
    rows = []
    for i in range(n):
        a, b = i % 7 + 1, i % 5 + 2
        if i % 3:
            rows.append({"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."})
        else:
            rows.append({"messages": [{"role": "system", "content": "You answer briefly."},
                                      {"role": "user", "content": f"Two times {a}?"},
                                      {"role": "assistant", "content": f"Two times {a} is {2 * a}."},
                                      {"role": "user", "content": "Thank you!"},
                                      {"role": "assistant", "content": "You are welcome."}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("lora-chat")
    hf = chat_folder(d / "hf", "llama3", VOCAB)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(hf))
    return {"hf": hf, "data": conversations(d / "chat.jsonl")}


def test_the_loss_counts_only_learned_tokens_and_padding_changes_nothing(world):
    from trainscale.infer.load import load_for_inference
    from trainscale.infer.lora import IGNORE, chat_rows, lora_loss, split_chat

    model, spec, folder = load_for_inference(world["hf"])
    split = split_chat(str(world["data"]), folder, 0.1, spec.vocab_size)
    convs = split.train[:4]
    ids, flags = convs[0]
    assert any(flags) and not all(flags) and len(ids) == len(flags)
    inputs, targets = chat_rows(convs, 64)
    assert ((targets != IGNORE).sum(1) == torch.tensor([sum(f[1:65]) for _, f in convs])).all()
    with torch.no_grad():
        base, n = lora_loss(model, inputs, targets)
        masked = targets == IGNORE
        bump = torch.zeros(*targets.shape, spec.vocab_size)
        bump[masked] = 5.0 * torch.randn(int(masked.sum()), spec.vocab_size)  # any change where nothing is learned

        class Shifted(torch.nn.Module):
            def __init__(self, delta):
                super().__init__()
                self.delta = delta

            def forward(self, x):
                return model(x) + self.delta

        same, m = lora_loss(Shifted(bump), inputs, targets)
        assert m == n and float(same) == pytest.approx(float(base), rel=1e-6)
        learned = (~masked).nonzero()[0]
        poke = torch.zeros_like(bump)
        poke[learned[0], learned[1], targets[learned[0], learned[1]]] = -3.0  # the learned target's own logit
        assert float(lora_loss(Shifted(poke), inputs, targets)[0]) > float(base) + 1.0
        # each conversation alone (no padding) sums to the padded batch
        alone = sum(float(lora_loss(model, *chat_rows([c], 64))[0]) for c in convs)
    assert alone == pytest.approx(float(base), rel=1e-5)


def test_held_out_conversations_are_the_trainers(world, tmp_path):
    """prepare with [data] format = "chat", held_out 0.1, the folder's tokenizer: its val tokens and learned flags
    are the held-out conversations split_chat gives, in order."""
    import numpy as np

    from trainscale.infer.lora import split_chat
    from trainscale.runtime.config import config_from_dict
    from trainscale.runtime.data.corpus import corpus_for
    from trainscale.runtime.data.shards import LEARNED

    spec = {"name": "chat", "n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
            "vocab_size": VOCAB, "max_seq_len": 64}
    cfg = config_from_dict({"name": "chat", "model": spec, "train": {"seq_len": 64},
                            "data": {"files": [str(world["data"])], "format": "chat", "held_out": 0.1, "workers": 1,
                                     "tokenizer": str(world["hf"]), "prepared": str(tmp_path / "prepared")}})
    corpus = corpus_for(cfg)
    tokens, flags = corpus.tokens("val"), corpus.flags("val")
    split = split_chat(str(world["data"]), world["hf"], 0.1, VOCAB)
    assert 0 < split.held_documents < split.documents == 120
    assert [int(t) for t in tokens[0:len(tokens)]] == [i for ids, _ in split.held for i in ids]
    learned = (np.asarray(flags[0:len(flags)]) & LEARNED) > 0
    assert learned.tolist() == [f for _, fl in split.held for f in fl]


def test_lora_on_chat_lowers_held_out_loss_on_assistant_tokens(world, tmp_path):
    rep = cli("lora", str(world["hf"]), "--data", str(world["data"]), "--steps", "40", "--batch", "8", "--seq-len",
              "127", "--lr", "1e-2", "--rank", "8", "--out", str(tmp_path / "ad"))
    assert rep["format"] == "chat" and rep["chat"]["longer_than_seq_len"] == 0
    held = rep["held_out"]
    assert "(chat): the held-out conversations" in held["text"] and held["conversations"] == held["documents"] > 0
    assert 0 < held["learned_tokens"] < held["tokens"]
    print(f"held-out loss on assistant tokens: {held['loss_before']:.3f} -> {held['loss_after']:.3f}")
    assert held["loss_after"] < held["loss_before"] - 0.5  # 5.946 -> 4.927 when written
    saved = json.loads((tmp_path / "ad" / "adapter.json").read_text())
    assert saved["format"] == "chat" and saved["held_out"] == 0.1
    ev = cli("evaluate", str(tmp_path / "ad"), "--seq-len", "127")
    assert (ev["format"], ev["text_kind"], ev["scored_tokens"]) == ("chat", "adapter-data", held["learned_tokens"])
    assert ev["perplexity"] == pytest.approx(held["perplexity_after"], rel=1e-4)
    # the same file read as text (its 'text' field absent) is refused in one sentence, not trained on as JSON
    res = CliRunner().invoke(app, ["lora", str(world["hf"]), "--data", str(world["data"]), "--format", "text",
                                   "--steps", "1", "--out", str(tmp_path / "t")])
    assert "has no 'text' field" in str(res.exception)
    for command in ("lora", "evaluate"):
        res = CliRunner().invoke(app, [command, str(world["hf"]), "--data", str(world["data"]), "--format", "xml",
                                       "--out" if command == "lora" else "--json", *([str(tmp_path / "x")]
                                                                                     if command == "lora" else [])])
        assert "--format must be auto, text or chat, not 'xml'" in str(res.exception)
