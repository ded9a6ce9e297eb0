"""What a model folder says about chat beyond its tokenizer.json, read once: the chat template, the named special
tokens, and every id that ends a reply. Every export writes it back in its own format (Hugging Face's
tokenizer_config.json / generation_config.json, PEFT's adapter folder, GGUF's ``tokenizer.*`` keys) and
``generate --chat`` stops at it, so a fine-tuned chat model answers and stops the same way everywhere.

Where the facts live in a Hugging Face folder (transformers' tokenization_utils_base and generation/configuration):
``tokenizer_config.json`` ``eos_token`` / ``bos_token`` (a string, or an AddedToken object with ``content``) and
``chat_template`` (or the ``chat_template.jinja`` file beside it, transformers >= 4.45); ``generation_config.json``
``eos_token_id`` (an id or a list: Llama 3.1 Instruct lists 128001, 128008, 128009, Qwen2.5 Instruct 151645 and
151643), which transformers' ``generate`` stops at, any of them. A folder trainscale trained from scratch has only
tokenizer.json: its end of text is GPT-2's ``<|endoftext|>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.safeio import read_json_object

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_END_IDS = 64  # published configs list 1-3 end ids


@dataclass(frozen=True)
class ChatFiles:
    template: str | None  # the Jinja chat template, None when the folder has none
    special: dict[str, str]  # bos_token, eos_token, ... as tokenizer_config.json names them
    end_ids: tuple[int, ...]  # every id that ends a reply, the eos_token's first
    bos_id: int | None

    @property
    def eos_id(self) -> int | None:
        return self.end_ids[0] if self.end_ids else None


def _settings(folder: Path, name: str) -> dict[str, Any]:
    p = folder / name
    return read_json_object(p, "tokenizer settings" if name == TOKENIZER_CONFIG else "generation settings") \
        if p.exists() or p.is_symlink() else {}


def _ids(value: Any, where: Path, vocab: int) -> list[int]:
    """generation_config.json's eos_token_id: an id or a list of ids, each in the vocabulary."""
    items = value if isinstance(value, list) else [value]
    if len(items) > MAX_END_IDS or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise TrainscaleError(f"{where}: 'eos_token_id' must be a token id or a list of at most {MAX_END_IDS} ids, "
                              f"not {str(value)[:60]}")
    bad = [i for i in items if not 0 <= i < vocab]
    if bad:
        raise TrainscaleError(f"{where}: 'eos_token_id' {bad[0]} is not a token of the tokenizer (0..{vocab - 1})")
    return items


def _usual_eot(tokenizer: Any, folder: Path) -> str | None:
    from trainscale.runtime.data.tokenizer import eot_of

    try:
        return eot_of(tokenizer, str(folder), None)
    except TrainscaleError:
        return None


def hf_tokenizer_files(chat: ChatFiles, model_max_length: int) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and special_tokens_map.json for a Hugging Face folder: the named special tokens and
    the chat template travel with the tokenizer (transformers' ``apply_chat_template`` reads them there)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False, **chat.special}
    if chat.template is not None:
        config["chat_template"] = chat.template
    return {TOKENIZER_CONFIG: config, "special_tokens_map.json": dict(chat.special)}


def generation_config(chat: ChatFiles) -> dict[str, Any]:
    """generation_config.json: every end id (transformers' generate stops at any of a list)."""
    ends = list(chat.end_ids)
    return {"bos_token_id": chat.bos_id if chat.bos_id is not None else chat.eos_id,
            "eos_token_id": ends if len(ends) > 1 else chat.eos_id, "do_sample": True, "temperature": 0.8}


def read_chat_files(folder: str | Path, tokenizer: Any) -> ChatFiles:
    """The folder's chat template, named special tokens and end ids (``tokenizer``: its tokenizers.Tokenizer).
    A named token the vocabulary does not hold is refused in one sentence (generation would never stop)."""
    from trainscale.runtime.data.chat import NoChatTemplate, _template_of
    from trainscale.runtime.data.tokenizer import tokenizer_settings

    folder = Path(folder)
    cfg, special, end_tokens = tokenizer_settings(folder, tokenizer)  # the schema; bos and end tokens in the vocab
    try:
        template = _template_of(folder, cfg)
    except NoChatTemplate:
        template = None
    if "eos_token" not in special:  # a folder trained from scratch: a usual end-of-text name, when it has one
        special.update({"eos_token": t} if (t := _usual_eot(tokenizer, folder)) else {})
    ends = [tokenizer.token_to_id(t) for t in end_tokens or (special.get("eos_token"),) if t is not None]
    gen = _settings(folder, GENERATION_CONFIG)
    if gen.get("eos_token_id") is not None:
        ends += _ids(gen["eos_token_id"], folder / GENERATION_CONFIG, tokenizer.get_vocab_size())
    bos = special.get("bos_token")
    return ChatFiles(template, special, tuple(dict.fromkeys(ends)),
                     tokenizer.token_to_id(bos) if bos is not None else None)
