"""Preference pairs: a prompt, a chosen answer and a rejected one, read from JSONL and rendered with the model
folder's chat template (runtime/data/chat.py: the same renderer and the same assistant-only masks).

A record is ``{"prompt": ..., "chosen": ..., "rejected": ...}``:

- plain: three strings; the prompt is the user's message (an optional ``"system"`` string goes first) and each
  answer the assistant's reply;
- chat: ``"prompt"`` (or ``"messages"``) a list of ``{"role", "content"}`` messages, and ``"chosen"`` /
  ``"rejected"`` each a string or a list of messages holding the assistant's reply (TRL's conversational
  preference format with an explicit prompt).

Each side is encoded as one conversation, prompt + answer, tokenized whole; the tokens learned (scored) are
those of the answer's assistant messages and the end-of-turn text the template writes after each, never the
prompt's own assistant turns. That is what TRL's DPOTrainer scores: the tokens after the rendered prompt with
its generation prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.runtime.data.chat import ChatTokenizer, _message, check_example, encode_example, read_chat_jsonl

WHAT = "preference data file"
Sequence = tuple[list[int], list[bool]]  # token ids, scored flags (the answer's tokens)


@dataclass(frozen=True)
class Pair:
    """One encoded pair: the chosen and the rejected conversation, each (ids, scored flags)."""

    chosen: Sequence
    rejected: Sequence


def _messages(value: Any, key: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant" if key != "prompt" else "user", "content": value}]
    if not isinstance(value, list):
        raise TrainscaleError(f"{where}: '{key}' is a {type(value).__name__}, not a string or a list of messages")
    if not value:
        raise TrainscaleError(f"{where}: '{key}' has no messages")
    return [_message(m, j, f"{where} '{key}'") for j, m in enumerate(value, 1)]


def check_pair(obj: Any, where: str = "preference pair") -> dict:
    """A record as ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``, or one sentence naming
    ``where`` and what is wrong."""
    if not isinstance(obj, dict):
        raise TrainscaleError(f"{where} is not a JSON object")
    if "messages" in obj and "prompt" in obj:
        raise TrainscaleError(f"{where} has both 'messages' and 'prompt'; give the prompt once")
    key = "messages" if "messages" in obj else "prompt"
    for k in (key, "chosen", "rejected"):
        if obj.get(k) is None:
            raise TrainscaleError(f"{where} has no '{k}' (a preference pair is 'prompt', 'chosen' and 'rejected')")
    prompt = _messages(obj[key], "prompt", where)
    system = obj.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise TrainscaleError(f"{where}: 'system' is a {type(system).__name__}, not a string")
        prompt = [{"role": "system", "content": system}, *prompt]
    out = {"prompt": prompt}
    for k in ("chosen", "rejected"):
        answer = _messages(obj[k], k, where)
        if not any(m["role"] == "assistant" for m in answer):
            raise TrainscaleError(f"{where}: '{k}' has no assistant message, so it has nothing to score")
        check_example({"messages": prompt + answer}, where)  # the conversation's own checks (roles, sizes)
        out[k] = answer
    if out["chosen"] == out["rejected"]:
        raise TrainscaleError(f"{where}: 'chosen' and 'rejected' are the same answer, so nothing is preferred")
    return out


def read_pairs_jsonl(path: Path) -> Iterator[dict]:
    """The pairs of a JSONL file, one per non-blank line, each checked (``check_pair``); a regular file only,
    bounded lines (chat.read_chat_jsonl's reader); every fault one sentence naming the file and line."""
    return read_chat_jsonl(path, check=check_pair, what=WHAT)


def encode_pair(pair: dict, tok: ChatTokenizer, where: str = "preference pair") -> Pair:
    """A checked pair (``check_pair``) as two encoded conversations, prompt + answer, scored on the answer only."""
    first = len(pair["prompt"])
    sides = []
    for k in ("chosen", "rejected"):
        ids, flags = encode_example({"messages": pair["prompt"] + pair[k]}, tok, f"{where} ({k})", first=first)
        if not any(flags):
            raise TrainscaleError(f"{where}: the chat template of {tok.folder} writes no token of the {k} answer")
        sides.append((ids, flags))
    return Pair(*sides)


def load_pairs(path: Path, tok: ChatTokenizer, vocab: int | None = None) -> list[Pair]:
    """Every pair of a JSONL file, encoded; a token id outside ``vocab`` (the model's) refused in one sentence."""
    pairs = []
    for n, pair in enumerate(read_pairs_jsonl(path), 1):
        enc = encode_pair(pair, tok, f"{WHAT} {path} pair {n}")
        if vocab is not None and max(max(enc.chosen[0]), max(enc.rejected[0])) >= vocab:
            raise TrainscaleError(f"{WHAT} {path} pair {n} holds token ids beyond the model's vocabulary "
                                  f"({vocab:,}); is the tokenizer the model's?")
        pairs.append(enc)
    if not pairs:
        raise TrainscaleError(f"{WHAT} {path} holds no pair")
    return pairs
