"""Text generation with a KV cache: prefill the prompt once, then one token per step.

The cache (runtime/model.py's ``KVCache``) holds K and V of every layer for every position so far,
preallocated for the prompt plus the new tokens, so its bytes are exactly ``estimate.memory.kv_cache_bytes``.
The cached forward pass is runtime/model.py's own (``model(tokens, cache=cache)``): the same attention
block as training, its keys and values read from the cache.
A chat prompt (``chat_prompt``) is one user message (and an optional system message) rendered with the model
folder's own chat template and its generation prompt (runtime/data/chat.py), so the new tokens are the assistant's
reply; generation stops at the folder's eos_token, the template's end of turn.
Sampling: temperature, then top-k, then top-p (nucleus, Holtzman et al. 2019, arXiv 1904.09751);
temperature 0 is greedy.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainscale.errors import TrainscaleError
from trainscale.runtime.model import KVCache

__all__ = ["ChatPrompt", "Generation", "KVCache", "Sampling", "chat_prompt", "check_token_ids", "generate_ids",
           "sample_next"]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def check(self) -> Sampling:
        if self.temperature < 0:
            raise TrainscaleError(f"temperature must be >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise TrainscaleError(f"top-k must be >= 0, not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise TrainscaleError(f"top-p must be in (0, 1], not {self.top_p}")
        return self


def sample_next(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> torch.Tensor:
    """[b, vocab] logits -> [b] token ids."""
    logits = logits.float()
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first one always stays)
        drop = probs.cumsum(-1) - probs >= s.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """Every token id a valid row of the embedding: a tokenizer larger than model.json's vocabulary would
    otherwise index past it."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise TrainscaleError(f"token id {bad} is outside the model's vocabulary of {vocab_size} (its tokenizer.json "
                              "holds more tokens than model.json's vocab_size)")


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    kv_cache_bytes: int
    kv_capacity: int
    kv_dtype: str
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)


@torch.no_grad()
def generate_ids(model, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 kv_dtype: torch.dtype = torch.float32, stop_id: int | Collection[int] | None = None,
                 keep_logits: bool = False) -> Generation:
    """Prefill the prompt into a KV cache, then sample ``max_new_tokens`` tokens one at a time, stopping after a
    token of ``stop_id`` (an id, or every id that ends a reply: generation_config.json may list several)."""
    stops = frozenset((stop_id,) if isinstance(stop_id, int) else stop_id or ())
    sampling.check()
    if not prompt_ids:
        raise TrainscaleError("the prompt is empty (it tokenizes to no tokens)")
    if max_new_tokens < 0:
        raise TrainscaleError(f"max new tokens must be >= 0, not {max_new_tokens}")
    spec = model.spec
    check_token_ids(prompt_ids, spec.vocab_size)
    capacity = len(prompt_ids) + max_new_tokens
    if capacity > spec.max_seq_len:
        raise TrainscaleError(f"prompt ({len(prompt_ids)} tokens) + {max_new_tokens} new tokens exceeds the "
                              f"model's context of {spec.max_seq_len}")
    device = next(model.parameters()).device
    cache = KVCache(spec, 1, capacity, kv_dtype, device)
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
    # the cache holds at most max_seq_len positions (checked above): learned positions never run out
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache)[:, -1]
    out: list[int] = []
    kept: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        if keep_logits:
            kept.append(logits[0].float().cpu())
        if not bool(torch.isfinite(logits).all()):
            raise TrainscaleError(f"the model's logits at new token {len(out) + 1} are NaN or infinite: its weights "
                                  "are finite but overflow in the forward pass")
        nxt = sample_next(logits.cpu(), sampling, gen)
        out.append(int(nxt[0]))
        if out[-1] in stops:
            break
        if len(out) < max_new_tokens:
            logits = model(nxt[:, None].to(device), cache=cache)[:, -1]
    return Generation(list(prompt_ids), out, cache.nbytes, capacity, str(kv_dtype).removeprefix("torch."), kept)


@dataclass
class ChatPrompt:
    folder: Path  # the folder whose chat template and tokenizer rendered it (an adapter's base when it has none)
    text: str  # the rendered prompt, the assistant's header last
    ids: list[int]
    tokenizer: Any  # tokenizers.Tokenizer of ``folder``
    stop_id: int | None  # the folder's eos_token (its end of turn)
    stop_ids: tuple[int, ...] = ()  # every id that ends a reply (infer/chatfiles.py): the eos_token's first


def chat_prompt(folder: Path, prompt: str, system: str | None = None) -> ChatPrompt:
    """``prompt`` as a user message (after ``system`` as a system message when given) rendered with the chat template
    of ``folder``, else of its adapter base (an adapter folder keeps the base's tokenizer.json but not its
    tokenizer_config.json), with the generation prompt; one sentence when neither has a template."""
    from trainscale.infer.chatfiles import read_chat_files
    from trainscale.infer.load import MAX_ADAPTER_DEPTH, source_folder
    from trainscale.infer.lora import read_adapter_config
    from trainscale.runtime.data.chat import NoChatTemplate, encode_prompt, load_chat_tokenizer

    here = Path(folder)
    for _ in range(MAX_ADAPTER_DEPTH + 1):
        try:
            tok = load_chat_tokenizer(here)
            break
        except NoChatTemplate:
            if not (here / "adapter.json").exists():
                raise TrainscaleError(f"{folder} has no chat template (neither chat_template.jinja nor a "
                                      "'chat_template' in tokenizer_config.json, nor has its adapter base), so "
                                      "--chat cannot render a prompt; generate without --chat") from None
            here = source_folder(read_adapter_config(here).base)
    else:
        raise TrainscaleError(f"{folder}'s chain of adapter bases is deeper than {MAX_ADAPTER_DEPTH} levels")
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]
    text, ids = encode_prompt(tok, messages)
    ends = read_chat_files(here, tok.tokenizer).end_ids  # the folder's eos, else a usual end-of-text name (eot_of)
    return ChatPrompt(here, text, ids, tok.tokenizer, ends[0] if ends else None, ends)
