"""Chat data: conversations read from JSONL, rendered with the model folder's own chat template, tokenized, and
a loss mask that learns only what the assistant says.

A record is ``{"messages": [{"role": ..., "content": ...}, ...]}`` or ``{"prompt": ..., "response": ...}`` (a
user message and the assistant's answer; an optional ``"system"`` string goes first). The template is the
folder's ``chat_template.jinja`` (the file transformers >= 4.45 saves beside the tokenizer), else the
``chat_template`` of its ``tokenizer_config.json``; it is rendered as transformers' ``apply_chat_template`` renders
it (jinja2's ImmutableSandboxedEnvironment, trim_blocks and lstrip_blocks, the loopcontrols extension,
``raise_exception``, ``tojson`` without HTML escaping, ``strftime_now``, the folder's named special tokens such as
``bos_token`` / ``eos_token`` passed in), and tokenized whole with the folder's tokenizer.json, without the
tokenizer's own added special tokens (the template writes them).

Which tokens are learned is found from the text, never from guessed token ids: the conversation up to and
including each assistant message is rendered (it must be a prefix of the whole), and the conversation before it
with the generation prompt (the assistant's header); the assistant's span runs from its content to the end of
what the template writes for that message (its end-of-turn token(s)). A token is learned when its characters
overlap a span.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.safeio import check_regular, read_json_object, read_text

ROLES = ("system", "user", "assistant")
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens apply_chat_template passes to the template
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_TEMPLATE_BYTES = 1 << 20  # published chat templates are a few kilobytes (the longest, with tools, ~20 KB)
MAX_LINE_BYTES = 16 << 20  # one conversation per line; 128K tokens of text is ~0.5 MB
MAX_MESSAGES = 10_000  # messages of one conversation: far beyond any context window's worth of turns


class NoChatTemplate(TrainscaleError):
    """A model folder without a chat template (callers that can look elsewhere, an adapter's base, catch it)."""


@dataclass
class ChatTokenizer:
    """A model folder's tokenizer, chat template and named special tokens."""

    folder: Path
    tokenizer: Any  # tokenizers.Tokenizer
    template: str  # the Jinja source
    special: dict[str, str]  # bos_token, eos_token, ... as the template sees them
    control: tuple[str, ...]  # the tokenizer's special added tokens: never allowed inside a message's text
    _compiled: Any = field(default=None, repr=False)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "chat example") -> str:
        """The conversation as the template writes it (transformers' ``apply_chat_template(tokenize=False)``)."""
        import jinja2

        if self._compiled is None:
            self._compiled = _compile(self.template, self.folder)
        try:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special)
        except jinja2.TemplateError as e:
            raise TrainscaleError(f"{where}: the chat template of {self.folder} refuses it ({_first_line(e)})"
                                  ) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as e:
            raise TrainscaleError(f"{where}: the chat template of {self.folder} fails on it ({_first_line(e)})"
                                  ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def _compile(source: str, folder: Path):
    """The template compiled in the sandbox transformers uses, with the same globals and filters."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing attribute names that start with '_' (CPython internals)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_' ({name!r})")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TrainscaleError(f"the chat template of {folder} is not valid Jinja ({_first_line(e)})") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object with 'content'."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_of(folder: Path, config: dict) -> str:
    jinja = folder / "chat_template.jinja"
    if jinja.exists() or jinja.is_symlink():
        return read_text(jinja, "chat template", MAX_TEMPLATE_BYTES)
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if not isinstance(tpl, str) or not tpl.strip():
        raise NoChatTemplate(f"model folder {folder} has no chat template (neither chat_template.jinja nor a "
                              "'chat_template' in tokenizer_config.json), so it cannot read chat data")
    if len(tpl.encode("utf-8")) > MAX_TEMPLATE_BYTES:
        raise TrainscaleError(f"the chat template of {folder} is longer than any real one ({MAX_TEMPLATE_BYTES:,} "
                              "bytes)")
    return tpl


def load_chat_tokenizer(folder: Path) -> ChatTokenizer:
    """A model folder's tokenizer.json, chat template and special tokens (from tokenizer_config.json)."""
    from trainscale.runtime.data.tokenizer import load_tokenizer

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise TrainscaleError(f"chat model folder {folder} is not a folder")
    cfg_path = folder / "tokenizer_config.json"
    config = read_json_object(cfg_path, "tokenizer settings") if cfg_path.exists() or cfg_path.is_symlink() else {}
    template = _template_of(folder, config)
    tok = load_tokenizer(folder)
    special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
    control = tuple(sorted({t.content for t in tok.get_added_tokens_decoder().values() if t.special and t.content},
                           key=lambda s: (-len(s), s)))
    chat = ChatTokenizer(folder, tok, template, special, control)
    chat._compiled = _compile(template, folder)
    return chat


# --------------------------------------------------------------------------- records


def _message(m: Any, j: int, where: str) -> dict:
    if not isinstance(m, dict):
        raise TrainscaleError(f"{where}: message {j} is not an object with 'role' and 'content'")
    role = m.get("role")
    if not isinstance(role, str):
        raise TrainscaleError(f"{where}: message {j} has no 'role' string")
    if role not in ROLES:
        raise TrainscaleError(f"{where}: message {j} has role {role[:40]!r}, not one of {', '.join(ROLES)}")
    if "content" not in m or m["content"] is None:
        raise TrainscaleError(f"{where}: message {j} ({role}) has no 'content'")
    if not isinstance(m["content"], str):
        raise TrainscaleError(f"{where}: message {j} ({role}) has a 'content' that is a "
                              f"{type(m['content']).__name__}, not a string")
    return {"role": role, "content": m["content"]}


def check_example(obj: Any, where: str = "chat example") -> dict:
    """A record as ``{"messages": [{"role", "content"}, ...]}`` (a prompt/response record turned into a user and
    an assistant message), or one sentence naming ``where`` and what is wrong."""
    if not isinstance(obj, dict):
        raise TrainscaleError(f"{where} is not a JSON object")
    if "messages" in obj and ("prompt" in obj or "response" in obj):
        raise TrainscaleError(f"{where} has both 'messages' and 'prompt'/'response'; give one form")
    if "messages" in obj:
        raw = obj["messages"]
        if not isinstance(raw, list):
            raise TrainscaleError(f"{where}: 'messages' is not a list")
    elif "prompt" in obj or "response" in obj:
        for key in ("prompt", "response"):
            if key not in obj or obj[key] is None:
                raise TrainscaleError(f"{where} has no '{key}'")
            if not isinstance(obj[key], str):
                raise TrainscaleError(f"{where}: '{key}' is a {type(obj[key]).__name__}, not a string")
        system = obj.get("system")
        if system is not None and not isinstance(system, str):
            raise TrainscaleError(f"{where}: 'system' is a {type(system).__name__}, not a string")
        raw = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["response"]}]
    else:
        raise TrainscaleError(f"{where} has neither 'messages' nor 'prompt' and 'response'")
    if not raw:
        raise TrainscaleError(f"{where} has no messages")
    if len(raw) > MAX_MESSAGES:
        raise TrainscaleError(f"{where} has {len(raw):,} messages, more than any conversation ({MAX_MESSAGES:,})")
    messages = [_message(m, j, where) for j, m in enumerate(raw, 1)]
    if not any(m["role"] == "assistant" for m in messages):
        raise TrainscaleError(f"{where} has no assistant message, so nothing in it would be learned")
    return {"messages": messages}


def read_chat_jsonl(path: Path) -> Iterator[dict]:
    """The conversations of a chat JSONL file, one per non-blank line, each checked (``check_example``) and
    normalised to ``{"messages": [...]}``; a regular file only, lines of at most MAX_LINE_BYTES; every fault one
    sentence naming the file and line."""
    p = check_regular(path, "chat data file")
    try:
        f = open(p, "rb")  # noqa: SIM115 (closed below; a generator holds it across yields)
    except OSError as e:
        raise TrainscaleError(f"chat data file {p} cannot be read: {e.strerror}") from None
    with f:
        n = 0
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            n += 1
            where = f"chat data file {p} line {n}"
            if len(line) > MAX_LINE_BYTES:
                raise TrainscaleError(f"{where} is longer than {MAX_LINE_BYTES:,} bytes, more than any conversation")
            if line.strip():
                yield parse_line(line, where)


def parse_line(line: bytes | str, where: str) -> dict:
    """One JSONL line as a checked conversation (``check_example``), or one sentence naming ``where``."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TrainscaleError(f"{where} is not UTF-8 text (an invalid byte at column {e.start + 1})") from None
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise TrainscaleError(f"{where} is not JSON ({_first_line(e)})") from None
    except RecursionError:
        raise TrainscaleError(f"{where} nests arrays or objects too deeply to be a conversation") from None
    return check_example(obj, where)


# --------------------------------------------------------------------------- encoding


def _prefix(tok: ChatTokenizer, messages: list[dict], full: str, where: str, gen: bool = False) -> str | None:
    """The rendering of ``messages`` (with the generation prompt if ``gen``) when it is a prefix of ``full``."""
    try:
        text = tok.render(messages, add_generation_prompt=gen, where=where)
    except TrainscaleError:
        return None
    return text if full.startswith(text) else None


def assistant_spans(tok: ChatTokenizer, messages: list[dict], full: str, where: str) -> list[tuple[int, int]]:
    """[start, end) character spans of ``full`` (the rendered conversation) to learn: each assistant message's
    content and what the template writes after it up to the next message."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        upto = _prefix(tok, messages[: i + 1], full, where)
        if upto is None:
            raise TrainscaleError(f"{where}: the chat template of {tok.folder} renders the conversation up to "
                                  f"message {i + 1} differently from the start of the whole, so its assistant "
                                  "turns cannot be found")
        end = len(upto)
        before = _prefix(tok, messages[:i], full, where) if i else ""
        prev = len(before) if before is not None else 0
        header = _prefix(tok, messages[:i], full, where, gen=True)
        content, k = m["content"], -1
        if header is not None and prev <= len(header) <= end:  # the assistant's header is known: content follows
            for c in (content, content.strip()):
                k = full.find(c, len(header), end)
                if k >= 0:
                    break
        else:  # no usable generation prompt: the content's last place in this message's text
            for c in (content, content.strip()):
                k = full.rfind(c, prev, end)
                if k >= 0:
                    break
        if k < 0:
            raise TrainscaleError(f"{where}: the chat template of {tok.folder} does not write assistant message "
                                  f"{i + 1}'s content as given, so what to learn cannot be found")
        spans.append((k, end))
    return spans


def encode_example(example: dict, tok: ChatTokenizer, where: str = "chat example") -> tuple[list[int], list[bool]]:
    """A conversation as (token ids, learned flags), the same length: the flags are True exactly on the tokens
    of the assistant's contents and the end-of-turn text the template writes after each."""
    messages = check_example(example, where)["messages"]
    for j, m in enumerate(messages, 1):
        for t in tok.control:
            if t in m["content"]:
                raise TrainscaleError(f"{where}: message {j} holds {t!r}, a control token of the tokenizer, "
                                      "which would be read as one; remove it from the text")
    full = tok.render(messages, where=where)
    spans = assistant_spans(tok, messages, full, where)
    enc = tok.tokenizer.encode(full, add_special_tokens=False)
    flags, s = [], 0
    for a, b in enc.offsets:  # offsets and spans are both in order: one pass
        while s < len(spans) and a >= spans[s][1]:
            s += 1
        flags.append(s < len(spans) and b > spans[s][0] and a < spans[s][1])
    return list(enc.ids), flags


def encode_prompt(tok: ChatTokenizer, messages: list[dict], where: str = "chat prompt") -> tuple[str, list[int]]:
    """A conversation to be answered (system / user messages) rendered with the generation prompt (the assistant's
    header: transformers' ``apply_chat_template(add_generation_prompt=True)``) and tokenized without the tokenizer's
    added special tokens (the template writes them) -> (text, token ids)."""
    messages = [_message(m, j, where) for j, m in enumerate(messages, 1)]
    for j, m in enumerate(messages, 1):
        if t := next((t for t in tok.control if t in m["content"]), None):
            raise TrainscaleError(f"{where}: message {j} ({m['role']}) holds {t!r}, a control token of the "
                                  "tokenizer; remove it")
    text = tok.render(messages, add_generation_prompt=True, where=where)
    return text, list(tok.tokenizer.encode(text, add_special_tokens=False).ids)


_HERE = "\x00where\x00"  # stands for a record's place until an error needs it (counting lines costs a read)


def encode_line(line: bytes, tok: ChatTokenizer, locate: Callable[[], str]) -> tuple[list[int], list[bool]]:
    """``encode_example`` of one JSONL line; ``locate()`` names its file and line, called only for an error."""
    try:
        return encode_example(parse_line(line, _HERE), tok, _HERE)
    except TrainscaleError as e:
        raise TrainscaleError(str(e).replace(_HERE, locate())) from None


_CHAT: tuple[str, ChatTokenizer] | None = None  # (folder, ChatTokenizer): loaded once per worker process


def cached_chat_tokenizer(folder: str) -> ChatTokenizer:
    """``load_chat_tokenizer(folder)``, loaded once per process (a prepare-data worker encodes many units)."""
    global _CHAT
    if _CHAT is None or _CHAT[0] != folder:
        _CHAT = (folder, load_chat_tokenizer(Path(folder)))
    return _CHAT[1]


def chat_folder_of(tokenizer: str | Path) -> Path:
    """The folder whose chat template goes with ``tokenizer`` (a folder, or the folder of a tokenizer.json)."""
    p = Path(tokenizer).expanduser()
    return p if p.is_dir() else p.parent


def template_key(tok: ChatTokenizer) -> str:
    """What of a ChatTokenizer changes the tokens it makes, beyond its tokenizer.json: a hash of the template
    and the special tokens it is given."""
    import hashlib

    return hashlib.sha256(json.dumps([tok.template, tok.special], sort_keys=True).encode()).hexdigest()
