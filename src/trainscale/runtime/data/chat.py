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
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.safeio import check_regular, read_text

ROLES = ("system", "user", "assistant")
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens apply_chat_template passes to the template
MAX_TEMPLATE_BYTES = 1 << 20  # published chat templates are a few kilobytes (the longest, with tools, ~20 KB)
MAX_LINE_BYTES = 16 << 20  # one conversation per line; 128K tokens of text is ~0.5 MB
MAX_MESSAGES = 10_000  # messages of one conversation: far beyond any context window's worth of turns
# A chat template is code that comes with a downloaded folder: each render runs under a budget. Published templates
# (Llama 3, Qwen2.5, Gemma, Mistral, Phi, DeepSeek; the longest, with tools, ~20 KB) take a few dozen loop steps and
# calls per message and write a few characters more than the messages hold.
MAX_RENDER_STEPS = 1_000_000  # loop iterations + calls (filters, macros, methods) in one render
MAX_RENDER_CHARS = 64 << 20  # characters of one render's text, or of any string it builds on the way
MAX_RENDER_SECONDS = 20.0  # wall-clock seconds of one render
MAX_TEMPLATE_NUMBER_DIGITS = 7  # a width, count or exponent a template writes or passes: at most 9,999,999


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
        budget = self._compiled.environment.budget
        budget.start()
        try:
            parts, size = [], 0
            for chunk in self._compiled.generate(messages=messages, tools=None, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **self.special):
                size += len(chunk)
                budget.check_size(size)
                parts.append(chunk)
            return "".join(parts)
        except OverBudget as e:
            raise TrainscaleError(f"{where}: the chat template of {self.folder} {e}, more than any chat template "
                                  "needs; refused (is the folder's chat_template from a source you trust?)") from None
        except (MemoryError, OverflowError) as e:
            raise TrainscaleError(f"{where}: the chat template of {self.folder} builds more than a chat template "
                                  f"needs ({_first_line(e)}); refused") from None
        except jinja2.TemplateError as e:
            raise TrainscaleError(f"{where}: the chat template of {self.folder} refuses it ({_first_line(e)})"
                                  ) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as e:
            raise TrainscaleError(f"{where}: the chat template of {self.folder} fails on it ({_first_line(e)})"
                                  ) from None
        finally:
            budget.stop()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


class OverBudget(Exception):  # noqa: N818 (a template's render stopped by its budget; says what it exceeded)
    pass


class RenderBudget(threading.local):
    """One render's budget (per thread: a server renders several at once): steps, characters, seconds."""

    steps = 0
    deadline = math.inf

    def start(self) -> None:
        self.steps, self.deadline = 0, time.monotonic() + MAX_RENDER_SECONDS

    def stop(self) -> None:
        self.steps, self.deadline = 0, math.inf

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_RENDER_STEPS:
            raise OverBudget(f"takes more than {MAX_RENDER_STEPS:,} loop steps and calls to render")
        if not self.steps & 1023 and time.monotonic() > self.deadline:
            raise OverBudget(f"takes more than {MAX_RENDER_SECONDS:g} s to render")

    @staticmethod
    def check_size(n: int) -> None:
        if n > MAX_RENDER_CHARS:
            raise OverBudget(f"writes more than {MAX_RENDER_CHARS:,} characters")


_BIG_NUMBER = re.compile(rf"\d{{{MAX_TEMPLATE_NUMBER_DIGITS},}}")
_SIZED = (str, bytes, list, tuple)


def _length(x: Any) -> int:
    return len(x) if isinstance(x, _SIZED) else 0


def _check_number(x: Any) -> None:
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) >= 10 ** MAX_TEMPLATE_NUMBER_DIGITS:
        raise OverBudget(f"asks for a number of {len(str(abs(x)))} digits (a width, count or exponent)")


def _check_format(fmt: Any) -> None:
    """A format string ('%9999999s', '{:>9999999}') asks for a width: bounded like any number it writes."""
    if isinstance(fmt, str) and _BIG_NUMBER.search(fmt):
        raise OverBudget("formats a field wider than any chat text")


def _check_binop(op: str, a: Any, b: Any) -> None:
    """Bounds an operator's result before it is computed: repeated text or lists, concatenation, powers."""
    RenderBudget.check_size(_length(a) + _length(b))
    if op == "*":
        n = b if isinstance(b, int) else a if isinstance(a, int) else None
        seq = a if isinstance(b, int) else b
        if n is not None and isinstance(seq, _SIZED):
            RenderBudget.check_size(_length(seq) * max(n, 0))
        elif isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > 1 << 16:
            raise OverBudget("multiplies numbers larger than any chat template needs")
    elif op == "**" and isinstance(a, int | float) and isinstance(b, int | float):
        if abs(a) > 1 and b > 0 and b * math.log2(abs(a)) > 1 << 16:
            raise OverBudget("raises a number to a power larger than any chat template needs")
    elif op == "%" and isinstance(a, str):
        _check_format(a)


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """Bounds the calls that can multiply text: any number argument, format widths, and the string methods and
    filters whose output can outgrow their input (join, replace, expandtabs, indent)."""
    for v in (*args, *kwargs.values()):
        _check_number(v)
    inner = getattr(obj, "__wrapped__", obj)
    name, owner = getattr(inner, "__name__", ""), getattr(inner, "__self__", None)
    if isinstance(owner, str):
        if name in ("format", "format_map"):
            _check_format(owner)
        elif name == "join" and args and isinstance(args[0], list | tuple):
            RenderBudget.check_size(sum(map(_length, args[0])) + len(owner) * len(args[0]))
        elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
            RenderBudget.check_size(len(owner) + (len(owner) + 1) * len(args[1]))
        elif name == "expandtabs":
            RenderBudget.check_size(len(owner) * max(1, *(a for a in args if isinstance(a, int)), 8))


def _budgeted_filter(name: str, f: Callable) -> Callable:
    """A filter whose number arguments are bounded and whose text result is measured."""
    import functools

    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # the context / environment jinja passes

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        for v in (*args[skip + 1:], *kwargs.values()):
            _check_number(v)
        value = args[skip] if len(args) > skip else None
        if name == "format":
            _check_format(value)
        elif name in ("replace", "indent") and isinstance(value, str):
            rest = (*args[skip + 1:], *kwargs.values())
            extra = next((a for a in rest[1:] if isinstance(a, str)), "") if name == "replace" else " " * max(
                [a for a in rest if isinstance(a, int) and not isinstance(a, bool)] or [4])
            RenderBudget.check_size(len(value) + (len(value) + 1) * len(extra))
        elif name == "join" and isinstance(value, list | tuple):
            RenderBudget.check_size(sum(map(_length, value)))
        out = f(*args, **kwargs)
        RenderBudget.check_size(_length(out))
        return out

    return run


def _compile(source: str, folder: Path):
    """The template compiled in the sandbox transformers uses, with the same globals and filters, under a budget
    (``RenderBudget``): every loop iteration and call counts a step, operators and calls that could multiply text
    are bounded before they run, and the text written is measured as it is written."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

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

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%", "//"})
        budget = RenderBudget()

        def call_binop(self, context, operator, left, right):
            self.budget.tick()
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            __self.budget.tick()
            _check_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    budget = BudgetedEnvironment.budget

    def budget_iter(iterable):
        """Each loop iteration of the template counts a step."""
        for item in iterable:
            budget.tick()
            yield item

    def budget_text(text):
        """Text joined with ``~`` is measured once it is built (it at most doubles per step)."""
        budget.check_size(_length(text))
        return text

    class Guard(NodeTransformer):
        """Routes every ``for`` loop's iterable through ``budget_iter`` and every ``~`` through ``budget_text``."""

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = nodes.Call(nodes.Name("__budget_iter", "load"), [node.iter], [], None, None)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            return nodes.Call(nodes.Name("__budget_text", "load"), [node], [], None, None)

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _budgeted_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    env.globals["__budget_iter"] = budget_iter
    env.globals["__budget_text"] = budget_text
    try:
        tree = Guard().visit(env.parse(source))
        return env.from_string(tree)
    except jinja2.TemplateError as e:
        raise TrainscaleError(f"the chat template of {folder} is not valid Jinja ({_first_line(e)})") from None
    except (OverBudget, MemoryError, OverflowError, RecursionError) as e:
        raise TrainscaleError(f"the chat template of {folder} cannot be compiled within a chat template's budget "
                              f"({_first_line(e)})") from None


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
    from trainscale.runtime.data.tokenizer import load_tokenizer, tokenizer_settings

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise TrainscaleError(f"chat model folder {folder} is not a folder")
    config, special, _ = tokenizer_settings(folder)  # tokenizer_config.json through its schema
    template = _template_of(folder, config)
    tok = load_tokenizer(folder)
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


def read_chat_jsonl(path: Path, check: Callable[[Any, str], dict] | None = None,
                    what: str = "chat data file") -> Iterator[dict]:
    """The conversations of a chat JSONL file, one per non-blank line, each checked (``check_example``, or
    ``check``: a preference pair's) and normalised to ``{"messages": [...]}``; a regular file only, lines of at
    most MAX_LINE_BYTES; every fault one sentence naming the file (as ``what``) and line."""
    p = check_regular(path, what)
    try:
        f = open(p, "rb")  # noqa: SIM115 (closed below; a generator holds it across yields)
    except OSError as e:
        raise TrainscaleError(f"{what} {p} cannot be read: {e.strerror}") from None
    with f:
        n = 0
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            n += 1
            where = f"{what} {p} line {n}"
            if len(line) > MAX_LINE_BYTES:
                raise TrainscaleError(f"{where} is longer than {MAX_LINE_BYTES:,} bytes, more than any conversation")
            if line.strip():
                yield parse_line(line, where, check)


def parse_line(line: bytes | str, where: str, check: Callable[[Any, str], dict] | None = None) -> dict:
    """One JSONL line as a checked conversation (``check_example``, or ``check``), or one sentence naming
    ``where``."""
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
    return (check or check_example)(obj, where)


# --------------------------------------------------------------------------- encoding


def _prefix(tok: ChatTokenizer, messages: list[dict], full: str, where: str, gen: bool = False) -> str | None:
    """The rendering of ``messages`` (with the generation prompt if ``gen``) when it is a prefix of ``full``."""
    try:
        text = tok.render(messages, add_generation_prompt=gen, where=where)
    except TrainscaleError:
        return None
    return text if full.startswith(text) else None


def assistant_spans(tok: ChatTokenizer, messages: list[dict], full: str, where: str,
                    first: int = 0) -> list[tuple[int, int]]:
    """[start, end) character spans of ``full`` (the rendered conversation) to learn: each assistant message's
    content and what the template writes after it up to the next message (from message ``first`` on)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < first:
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


def encode_example(example: dict, tok: ChatTokenizer, where: str = "chat example",
                   first: int = 0) -> tuple[list[int], list[bool]]:
    """A conversation as (token ids, learned flags), the same length: the flags are True exactly on the tokens
    of the assistant's contents and the end-of-turn text the template writes after each (the assistant messages
    from message ``first`` on: a preference pair learns its answer, not the turns of its prompt)."""
    messages = check_example(example, where)["messages"]
    for j, m in enumerate(messages, 1):
        for t in tok.control:
            if t in m["content"]:
                raise TrainscaleError(f"{where}: message {j} holds {t!r}, a control token of the tokenizer, "
                                      "which would be read as one; remove it from the text")
    full = tok.render(messages, where=where)
    spans = assistant_spans(tok, messages, full, where, first)
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
