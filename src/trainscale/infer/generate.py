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

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainscale.errors import TrainscaleError
from trainscale.runtime.model import KVCache

__all__ = ["MAX_CHARS_PER_POSITION", "MAX_TEXT_CHARS", "MAX_TEMPERATURE", "MIN_TEMPERATURE", "MIN_TOP_P",
           "ChatPrompt", "ChatTemplate", "Generation", "KVCache", "Sampling", "chat_prompt", "check_text",
           "check_token_ids", "generate_ids", "load_chat_template", "new_cache", "sample_next", "stream_ids",
           "text_cap"]

# Sampling domains where float32 cannot underflow: logits / temperature stay finite for logits below 3e35, and a
# top-p below float32's resolution near 0 (1e-300 is 0.0 in float32) would drop every token.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0  # 0 is greedy; between 0 and 1e-3 is greedy in all but name
MIN_TOP_P = 1e-6
# Text bounds, checked before a prompt is rendered or tokenized: a token is ~4 characters of English (Llama 3's
# tokenizer: 3.9 on its docs), so 16 characters per position of the context is far more than any prompt that fits.
MAX_CHARS_PER_POSITION = 16
MAX_TEXT_CHARS = 1 << 22  # 4 Mi characters: 16 per position of a 256K context


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def check(self) -> Sampling:
        t = self.temperature
        if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):  # NaN fails both
            raise TrainscaleError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] "
                                  f"(smaller ones underflow float32), not {t:g}")
        if self.top_k < 0:
            raise TrainscaleError(f"top-k must be >= 0, not {self.top_k}")
        if not MIN_TOP_P <= self.top_p <= 1:
            raise TrainscaleError(f"top-p must be in [{MIN_TOP_P:g}, 1] (smaller ones underflow float32; for one "
                                  f"token use temperature 0), not {self.top_p:g}")
        return self


def text_cap(context: int) -> tuple[int, str]:
    """The most characters of prompt text (all messages together) for a model of ``context`` positions, and why."""
    cap = min(MAX_TEXT_CHARS, MAX_CHARS_PER_POSITION * context)
    return cap, f"{MAX_CHARS_PER_POSITION} per position of the model's {context:,}-token context"


def check_text(what: str, text: str, max_chars: int = MAX_TEXT_CHARS, why: str = "") -> str:
    """A prompt, system or message text: valid Unicode (a command-line byte that is not UTF-8 arrives as a lone
    surrogate, Python's surrogateescape) and at most ``max_chars`` characters, checked before any work on it."""
    if len(text) > max_chars:
        verb = "hold" if " and " in what else "holds"
        raise TrainscaleError(f"{what} {verb} {len(text):,} characters, more than the cap of {max_chars:,}"
                              + (f" ({why})" if why else ""))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"code point U+{ord(bad):04X}"
        raise TrainscaleError(f"{what} is not valid UTF-8 text ({byte} at character {e.start + 1})") from None
    return text


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
        drop[..., 0] = False
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


def new_cache(model, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
              kv_dtype: torch.dtype = torch.float32) -> KVCache:
    """The checks of a generation (sampling domains, the prompt's ids, the context) and its KV cache, sized for the
    prompt plus ``max_new_tokens``."""
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
    return KVCache(spec, 1, capacity, kv_dtype, next(model.parameters()).device)


@torch.no_grad()
def stream_ids(model, prompt_ids: list[int], cache: KVCache, sampling: Sampling = Sampling(),
               stop_id: int | Collection[int] | None = None, kept: list[torch.Tensor] | None = None,
               ) -> Iterator[int]:
    """Prefill the prompt into ``cache`` (from ``new_cache``), then yield new token ids one at a time until the cache
    is full or after a token of ``stop_id`` (an id, or every id that ends a reply: generation_config.json may list
    several); ``kept`` collects each step's logits."""
    stops = frozenset((stop_id,) if isinstance(stop_id, int) else stop_id or ())
    max_new_tokens = cache.capacity - len(prompt_ids)
    device = cache.k.device
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
    # the cache holds at most max_seq_len positions (new_cache checked it): learned positions never run out
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache)[:, -1]
    for n in range(1, max_new_tokens + 1):
        if kept is not None:
            kept.append(logits[0].float().cpu())
        if sampling.temperature == 0:  # greedy on the device: one host sync a token (the id and the finite check)
            nxt = logits.argmax(-1)
            token, finite = torch.stack((nxt[0], torch.isfinite(logits).all().long())).tolist()
        else:  # sampled on the host, whose seeded generator draws the same on every device
            row = logits.float().cpu()
            finite = bool(torch.isfinite(row).all())
            nxt = sample_next(row, sampling, gen) if finite else None
            token = int(nxt[0]) if finite else -1
        if not finite:
            raise TrainscaleError(f"the model's logits at new token {n} are NaN or infinite: its weights "
                                  "are finite but overflow in the forward pass")
        yield token
        if token in stops:
            return
        if n < max_new_tokens:
            logits = model(nxt[:, None].to(device), cache=cache)[:, -1]


def generate_ids(model, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 kv_dtype: torch.dtype = torch.float32, stop_id: int | Collection[int] | None = None,
                 keep_logits: bool = False) -> Generation:
    """Prefill the prompt into a KV cache, then sample ``max_new_tokens`` tokens one at a time, stopping after a
    token of ``stop_id`` (an id, or every id that ends a reply: generation_config.json may list several)."""
    cache = new_cache(model, prompt_ids, max_new_tokens, sampling, kv_dtype)
    kept: list[torch.Tensor] = []
    out = list(stream_ids(model, prompt_ids, cache, sampling, stop_id, kept if keep_logits else None))
    return Generation(list(prompt_ids), out, cache.nbytes, cache.capacity, str(kv_dtype).removeprefix("torch."),
                      kept)


@dataclass
class ChatPrompt:
    folder: Path  # the folder whose chat template and tokenizer rendered it (an adapter's base when it has none)
    text: str  # the rendered prompt, the assistant's header last
    ids: list[int]
    tokenizer: Any  # tokenizers.Tokenizer of ``folder``
    stop_id: int | None  # the folder's eos_token (its end of turn)
    stop_ids: tuple[int, ...] = ()  # every id that ends a reply (infer/chatfiles.py): the eos_token's first


@dataclass
class ChatTemplate:
    """A model folder's chat template, tokenizer and end ids, loaded once; ``render`` a conversation to answer."""
    folder: Path  # the folder that holds the template (an adapter's base when it has none)
    chat: Any  # runtime/data/chat.ChatTokenizer
    stop_ids: tuple[int, ...]  # every id that ends a reply (infer/chatfiles.py): the eos_token's first

    @property
    def tokenizer(self) -> Any:
        return self.chat.tokenizer

    def render(self, messages: list[dict], where: str = "chat prompt") -> ChatPrompt:
        from trainscale.runtime.data.chat import encode_prompt

        text, ids = encode_prompt(self.chat, messages, where)
        ends = self.stop_ids
        return ChatPrompt(self.folder, text, ids, self.chat.tokenizer, ends[0] if ends else None, ends)


def load_chat_template(folder: Path) -> ChatTemplate:
    """The chat template of ``folder``, else of its adapter base (an adapter folder keeps the base's tokenizer.json
    but not its tokenizer_config.json); one sentence when neither has a template."""
    from trainscale.infer.chatfiles import read_chat_files
    from trainscale.infer.load import MAX_ADAPTER_DEPTH, source_folder
    from trainscale.infer.lora import read_adapter_config
    from trainscale.runtime.data.chat import NoChatTemplate, load_chat_tokenizer

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
    ends = read_chat_files(here, tok.tokenizer).end_ids  # the folder's eos, else a usual end-of-text name (eot_of)
    return ChatTemplate(here, tok, tuple(ends))


def chat_prompt(folder: Path, prompt: str, system: str | None = None) -> ChatPrompt:
    """``prompt`` as a user message (after ``system`` as a system message when given) rendered with the chat template
    of ``folder`` (``load_chat_template``) with the generation prompt."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]
    return load_chat_template(folder).render(messages)
