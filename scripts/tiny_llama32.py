"""Build a Hugging Face folder shaped like Llama 3.2 1B, only tiny: what `make demo` fine-tunes.

Llama 3.2's features, as its config.json on the Hub states them: RoPE theta 500,000 with `rope_type: llama3`
scaling (factor 32, low/high frequency factors 1 and 4, original context 8,192), tied input and output
embeddings, grouped-query attention, SwiGLU, and a chat template in Llama 3's header/end-of-turn format. The
weights are random (transformers' own init, seeded) and the byte-level BPE tokenizer is trained here on the
Shakespeare plays and the chat file, with Llama 3's special tokens: nothing is downloaded.

    python scripts/tiny_llama32.py OUT [--chat examples/chat.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from trainscale.runtime.data.sources import corpus_text

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's prompt format (the header / end-of-turn tokens above), written as a Jinja template.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def chat_texts(path: Path) -> list[str]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            out += [m["content"] for m in rec.get("messages", [])] + [rec.get("prompt", ""), rec.get("response", "")]
    return [t for t in out if t]


def tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--chat", type=Path, default=Path("examples/chat.jsonl"))
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    texts = corpus_text("train", 600_000).split("\n\n") + chat_texts(args.chat)
    tok = tokenizer(texts, args.vocab)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        bos_token_id=tok.token_to_id("<|begin_of_text|>"), eos_token_id=tok.token_to_id("<|eot_id|>"))
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(args.out, safe_serialization=True)
    print(f"{args.out}: Llama-3.2-shaped, {sum(p.numel() for p in LlamaForCausalLM(cfg).parameters()):,} "
          f"parameters, vocab {cfg.vocab_size}, rope llama3 x{cfg.rope_scaling['factor']:g}, tied embeddings")


if __name__ == "__main__":
    main()
