"""Tiny chat model folders for the chat-data tests: a byte-level BPE trained here (the ``tokenizers`` library)
on a few sentences, with a model family's control tokens as special added tokens, and a tokenizer_config.json
whose chat template writes that family's layout (written here, not copied):

- ``llama3``: ``<|begin_of_text|>`` then, per message, ``<|start_header_id|>ROLE<|end_header_id|>\\n\\n``, the
  trimmed content and ``<|eot_id|>`` (Meta's Llama 3 instruct format); the generation prompt is the assistant's
  header. The template is in tokenizer_config.json.
- ``chatml``: per message ``<|im_start|>ROLE\\n``, the content, ``<|im_end|>\\n`` (OpenAI's ChatML, as Qwen
  uses it), a default system message when the first is not one, and ``raise_exception`` on a system message that
  is not first. The template is a ``chat_template.jinja`` file beside tokenizer_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Please write a short poem about the sea and the wind.",
    "Two plus two is four, and three times three is nine.",
    "You are a helpful assistant who answers briefly.",
    "Rain falls on the hills; rivers carry it down to the sea.",
    "How many legs does a spider have? A spider has eight legs.",
    "Thank you! You are welcome, have a nice day.",
]

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "{{- message['content'] | trim }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}\n"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'system' and not loop.first %}\n"
    "{{- raise_exception('a system message must come first') }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def _tokenizer(special: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    return tok


def chat_folder(out: Path, style: str = "llama3", vocab_size: int = 384) -> Path:
    """A tokenizer folder (tokenizer.json + tokenizer_config.json [+ chat_template.jinja]) of ``style``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if style == "llama3":
        tok = _tokenizer(LLAMA3_SPECIAL, vocab_size)
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}
    elif style == "chatml":
        tok = _tokenizer(CHATML_SPECIAL, vocab_size)
        config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        (out / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    else:
        raise ValueError(style)
    tok.save(str(out / "tokenizer.json"))
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out
