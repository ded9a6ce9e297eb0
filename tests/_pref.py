"""Helpers of the preference tests: a tiny Llama-shaped model folder built by transformers with a chat tokenizer
(tests/_chat_fixtures.py, the llama3 layout), and preference pairs written as JSONL. Nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _chat_fixtures import chat_folder

ROWS = [  # TRL's conversational preference format with an explicit prompt
    {"prompt": [{"role": "user", "content": "What is the capital of France?"}],
     "chosen": [{"role": "assistant", "content": "The capital of France is Paris."}],
     "rejected": [{"role": "assistant", "content": "The sea."}]},
    {"prompt": [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
                {"role": "user", "content": "Two plus two?"}],
     "chosen": [{"role": "assistant", "content": "Two plus two is four."}],
     "rejected": [{"role": "assistant", "content": "Three times three is nine, and the quick brown fox."}]},
    {"prompt": [{"role": "user", "content": "How many legs does a spider have?"},
                {"role": "assistant", "content": "Eight."},
                {"role": "user", "content": "Thank you!"}],
     "chosen": [{"role": "assistant", "content": "You are welcome, have a nice day."}],
     "rejected": [{"role": "assistant", "content": "Rain falls on the hills."}]},
]


def llama_folder(folder: Path, seed: int = 0, vocab: int = 384, layers: int = 2, width: int = 32) -> Path:
    """A random Llama (GQA, untied head) saved by transformers with the llama3-style chat tokenizer; every weight
    perturbed by ``seed``."""
    import transformers

    chat_folder(folder, "llama3", vocab_size=vocab)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    model.save_pretrained(str(folder))
    return folder


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
