"""`trainscale serve`: an OpenAI-compatible HTTP server on this machine, one API for both kinds of model.

- A ``.gguf`` file is served by llama.cpp's own server (llama-cpp-python's ``server`` extra: its FastAPI app, run by
  uvicorn), not rewritten: only its settings are chosen here (the model id, the chat template from the file,
  requests queued rather than interrupting each other) and its malformed-body errors are put in OpenAI's shape.
- A model folder (full, merged LoRA, LoRA adapter, our int4/int8) is served by a FastAPI app over ``generate``
  (infer/generate.py): the model folder's chat template renders the messages, the reply stops at every end id of the
  folder (infer/chatfiles.py), so a greedy reply is ``trainscale generate --chat``'s.

Both answer ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as server-sent
events, ``data: {...}`` then ``data: [DONE]``), in the shapes of OpenAI's API reference
(https://platform.openai.com/docs/api-reference/chat). A bad request gets a 4xx JSON body
``{"error": {"message", "type", "param", "code"}}``, never a traceback. The one model serves one request at a time:
concurrent requests wait in a queue (one worker thread), up to ``MAX_QUEUED``; then 429.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainscale.errors import TrainscaleError

__all__ = ["MAX_BODY_BYTES", "MAX_QUEUED", "MAX_STOPS", "Engine", "folder_app", "gguf_app", "open_socket", "serve"]

MAX_BODY_BYTES = 8 << 20  # one request's JSON: 16 characters per position of a 256K context is 4 Mi characters
MAX_QUEUED = 256  # requests waiting for the model; more get 429
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI's API takes up to 4 stop sequences
LOOPBACK = ("127.0.0.1", "::1", "localhost")


# ------------------------------------------------------------------ errors in OpenAI's shape


class ApiError(Exception):
    """A request refused: HTTP ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _response(e: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """FastAPI's validation errors -> one sentence and the first field's name."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    where = ".".join(loc) or "the request body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'is invalid')}{more}", ".".join(loc) or None


def add_error_handlers(app: Any, unexpected: bool = True) -> None:
    """Every error a JSON body in OpenAI's shape: FastAPI's validation errors (its default is a 422 ``detail`` list)
    as 400, HTTP errors (404, 405, 413) with their status, anything unexpected as a 500 with no traceback."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    async def invalid(_request: Any, exc: RequestValidationError):
        message, param = _validation_message(list(exc.errors()))
        return _response(ApiError(400, message, param=param))

    async def http(_request: Any, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return _response(ApiError(exc.status_code, str(exc.detail), code=code))

    async def api(_request: Any, exc: ApiError):
        return _response(exc)

    async def failed(_request: Any, exc: Exception):
        print(f"trainscale serve: unexpected {type(exc).__name__}: {exc}", file=sys.stderr)
        return _response(ApiError(500, f"the server failed on this request ({type(exc).__name__})", "server_error"))

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http)
    app.add_exception_handler(ApiError, api)
    if unexpected:
        app.add_exception_handler(Exception, failed)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 (by its Content-Length, else as it arrives)."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        from starlette.exceptions import HTTPException

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = HTTPException(413, f"the request body is larger than {self.limit:,} bytes")
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _send_error(send, ApiError(413, too_large.detail, code="request_too_large"))
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise too_large  # FastAPI re-raises HTTPException from the body's parsing: the 413 handler answers
            return message

        await self.app(scope, limited, send)


async def _send_error(send: Any, e: ApiError) -> None:
    import json

    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# ------------------------------------------------------------------ requests (OpenAI's fields)


def request_models() -> tuple[type, type]:
    """The pydantic models of a chat and a text completion request (built on first use: pydantic is imported with
    fastapi). Unknown fields are refused, so an option the server does not implement is never silently ignored."""
    from pydantic import BaseModel, ConfigDict, Field

    class TextPart(BaseModel):
        model_config = ConfigDict(extra="forbid")
        type: Literal["text"]
        text: str

    class Message(BaseModel):
        model_config = ConfigDict(extra="forbid")
        role: Literal["system", "developer", "user", "assistant"]
        content: str | list[TextPart]
        name: str | None = None

        def text(self) -> str:
            return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    class Common(BaseModel):
        model_config = ConfigDict(extra="forbid")
        model: str
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's domain and default
        top_p: float = Field(1.0, gt=0, le=1)
        stream: bool = False
        stop: str | list[str] | None = None
        seed: int | None = Field(None, ge=0, lt=2**63)
        n: int = 1
        user: str | None = None
        frequency_penalty: float = Field(0.0, ge=0, le=0)  # not implemented: only the neutral value
        presence_penalty: float = Field(0.0, ge=0, le=0)
        stream_options: dict[str, bool] | None = None

        def stops(self) -> list[str]:
            stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
            if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
                raise ApiError(400, f"stop takes at most {MAX_STOPS} sequences of 1 to {MAX_STOP_CHARS} characters",
                               param="stop")
            return stops

        def limit(self) -> int | None:
            return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    class ChatRequest(Common):
        messages: list[Message] = Field(min_length=1)

    class CompletionRequest(Common):
        prompt: str | list[str]
        echo: bool = Field(False, le=False)

        def text(self) -> str:
            if isinstance(self.prompt, str):
                return self.prompt
            if len(self.prompt) != 1:
                raise ApiError(400, "prompt takes one string here (a list of several would be several completions)",
                               param="prompt")
            return self.prompt[0]

    return ChatRequest, CompletionRequest


# ------------------------------------------------------------------ the engine: one model, one request at a time


@dataclass
class Job:
    """One request's work and where its events go (an asyncio queue fed from the worker thread)."""
    kind: Literal["chat", "text"]
    messages: list[dict] | None
    prompt: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def put(self, *event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` not to send yet: an incomplete UTF-8 character (decoded as U+FFFD) or the
    start of a stop sequence."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        hold = max(hold, next((k for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), 0))
    return hold


class Engine:
    """A model folder loaded once (``load_for_inference``), its chat template and tokenizer, and the one worker
    thread that runs requests in their order of arrival."""

    def __init__(self, path: str | Path, max_tokens: int, name: str | None = None) -> None:
        from trainscale.infer.load import load_for_inference, load_tokenizer_for, stop_token_id

        self.model, self.spec, self.folder = load_for_inference(path)
        self.name = name or Path(path).expanduser().resolve().name
        self.max_tokens = max_tokens
        self.tokenizer = load_tokenizer_for(self.folder)
        self.text_stops = tuple(i for i in (stop_token_id(self.tokenizer, self.folder),) if i is not None)
        self.template, self.no_template = self._template()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainscale-serve")
        self.waiting = 0  # jobs submitted and not finished (read and written on the event loop only)
        self.created = int(time.time())

    def _template(self) -> tuple[Any, str | None]:
        from trainscale.infer.generate import load_chat_template

        try:
            return load_chat_template(self.folder), None
        except TrainscaleError as e:
            return None, f"{self.name} has no chat template, so it answers /v1/completions only ({e})"

    async def run(self, job: Job) -> None:
        if self.waiting >= MAX_QUEUED:
            raise ApiError(429, f"{MAX_QUEUED} requests are already waiting for the model; retry later",
                           "rate_limit_error", "queue_full")
        self.waiting += 1
        future = asyncio.wrap_future(self.worker.submit(self._work, job))
        future.add_done_callback(lambda _f: setattr(self, "waiting", self.waiting - 1))

    def _prompt(self, job: Job) -> tuple[list[int], tuple[int, ...]]:
        """The job's prompt ids and the ids that end its reply; texts checked before they are rendered."""
        from trainscale.infer.generate import check_text, text_cap

        cap, why = text_cap(self.spec.max_seq_len)
        if job.kind == "text":
            check_text("the prompt", job.prompt or "", cap, why)
            return list(self.tokenizer.encode(job.prompt, add_special_tokens=False).ids), self.text_stops
        if self.template is None:
            raise TrainscaleError(self.no_template)
        for j, m in enumerate(job.messages or [], 1):
            check_text(f"message {j}", m["content"])
        check_text("the messages", "".join(m["content"] for m in job.messages or []), cap, why)
        return self.template.render(job.messages, "the messages").ids, self.template.stop_ids

    def _work(self, job: Job) -> None:
        """On the worker thread: prepare (errors here are the request's: 400), then decode token by token."""
        from trainscale.infer.generate import Sampling, new_cache, stream_ids

        try:
            ids, ends = self._prompt(job)
            room = self.spec.max_seq_len - len(ids)
            if job.max_tokens is not None and job.max_tokens > self.max_tokens:
                raise TrainscaleError(f"max_tokens {job.max_tokens} is more than this server's cap of "
                                      f"{self.max_tokens} (trainscale serve --max-tokens)")
            n = job.max_tokens if job.max_tokens is not None else max(1, min(self.max_tokens, room))
            sampling = Sampling(job.temperature, 0, job.top_p, job.seed)
            cache = new_cache(self.model, ids, n, sampling)
        except TrainscaleError as e:
            return job.put("error", ApiError(400, str(e), code="context_length_exceeded" if "context" in str(e)
                                             else None))
        job.put("start", len(ids))
        try:
            self._decode(job, stream_ids(self.model, ids, cache, sampling, ends), ends, n)
        except Exception as e:  # noqa: BLE001  (the client gets one line; the server keeps serving)
            job.put("failed", f"{type(e).__name__}: {e}")

    def _decode(self, job: Job, tokens: Any, ends: tuple[int, ...], n: int) -> None:
        """Text deltas as the tokens come: never half a character, never a stop sequence or its beginning."""
        new: list[int] = []
        text, sent, finish, count = "", 0, "length", 0
        for token in tokens:
            if job.cancelled.is_set():
                return
            if token in ends:  # not counted, as llama.cpp's server counts
                finish = "stop"
                break
            count += 1
            new.append(token)
            text = self.tokenizer.decode(new)
            cut = min((i for s in job.stops if (i := text.find(s)) >= 0), default=-1)
            if cut >= 0:
                text, finish = text[:cut], "stop"
                break
            end = len(text) - _held_back(text, job.stops)
            if end > sent:
                job.put("delta", text[sent:end])
                sent = end
        if len(text) > sent:
            job.put("delta", text[sent:])
        job.put("end", finish, count)


# ------------------------------------------------------------------ the folder's app


def _chunk(kind: str, rid: str, created: int, model: str, delta: str | None, finish: str | None,
           first: bool = False) -> dict:
    if kind == "chat":
        d = ({"role": "assistant", "content": ""} if first else {}) | ({"content": delta} if delta else {})
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def folder_app(engine: Engine) -> Any:
    """The FastAPI app over ``engine``: the three routes, errors in OpenAI's shape, bodies capped."""
    import json

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    chat_request, completion_request = request_models()
    app = FastAPI(title=f"trainscale serve: {engine.name}", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": engine.created,
                                            "owned_by": "trainscale"}]}

    async def answer(req: Any, kind: Literal["chat", "text"]):
        check_request(req, engine.name)
        job = Job(kind, [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                         for m in req.messages] if kind == "chat" else None,
                  req.text() if kind == "text" else None, req.limit(), req.temperature, req.top_p,
                  req.seed if req.seed is not None else secrets.randbelow(2**63), req.stops(),
                  asyncio.get_running_loop())
        await engine.run(job)
        event = await job.events.get()
        if event[0] == "error":
            raise event[1]
        prompt_tokens = event[1]
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}", int(time.time())
        usage_wanted = bool((req.stream_options or {}).get("include_usage"))

        def usage(n: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

        if req.stream:
            async def events():
                try:
                    yield f"data: {json.dumps(_chunk(kind, rid, created, engine.name, None, None, True))}\n\n"
                    while (event := await job.events.get())[0] == "delta":
                        yield f"data: {json.dumps(_chunk(kind, rid, created, engine.name, event[1], None))}\n\n"
                    if event[0] == "failed":
                        yield f"data: {json.dumps(ApiError(500, event[1], 'server_error').body())}\n\n"
                        return
                    yield f"data: {json.dumps(_chunk(kind, rid, created, engine.name, None, event[1]))}\n\n"
                    if usage_wanted:
                        last = {"id": rid, "object": _chunk(kind, rid, created, engine.name, None, None)["object"],
                                "created": created, "model": engine.name, "choices": [], "usage": usage(event[2])}
                        yield f"data: {json.dumps(last)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    job.cancelled.set()  # a client gone mid-stream frees the model at the next token

            return StreamingResponse(events(), media_type="text/event-stream")
        parts = []
        while (event := await job.events.get())[0] == "delta":
            parts.append(event[1])
        if event[0] == "failed":
            raise ApiError(500, event[1], "server_error")
        text, finish, n = "".join(parts), event[1], event[2]
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return {"id": rid, "object": "chat.completion", "created": created, "model": engine.name,
                    "choices": [choice], "usage": usage(n)}
        return {"id": rid, "object": "text_completion", "created": created, "model": engine.name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": usage(n)}

    async def chat(req):  # noqa: ANN001  (annotated below: FastAPI reads the body's model from the annotation)
        return await answer(req, "chat")

    async def completions(req):  # noqa: ANN001
        return await answer(req, "text")

    chat.__annotations__["req"] = chat_request  # the class itself: this module's annotations are strings
    completions.__annotations__["req"] = completion_request
    app.post("/v1/chat/completions")(chat)
    app.post("/v1/completions")(completions)

    return BodyLimit(app)


# ------------------------------------------------------------------ the GGUF's app: llama.cpp's own server


def gguf_has_template(path: Path) -> bool:
    """Whether the GGUF file holds ``tokenizer.chat_template`` (gguf's reader maps the file; nothing is loaded)."""
    import gguf

    from trainscale.safeio import check_regular

    check_regular(path, "GGUF file")
    try:
        return "tokenizer.chat_template" in gguf.GGUFReader(str(path)).fields
    except (ValueError, OSError) as e:
        raise TrainscaleError(f"{path} is not a GGUF file gguf can read ({e})") from None


def gguf_app(path: str | Path, host: str, port: int, name: str | None = None, n_ctx: int = 0,
             threads: int | None = None, max_tokens: int = 512) -> Any:
    """llama.cpp's server app (``llama_cpp.server.app.create_app``) for the file: the model id is ``name`` (else the
    file's name), the chat format is the file's own template when it has one (not a guess from known templates),
    requests queue instead of interrupting the one streaming; a completion request is checked first (``Checked``)."""
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    path = Path(path).expanduser()
    template = gguf_has_template(path)
    model = ModelSettings(model=str(path), model_alias=name or path.name, n_ctx=n_ctx, verbose=False,
                          chat_format="chat_template.default" if template else None,
                          **({"n_threads": threads, "n_threads_batch": threads} if threads else {}))
    try:
        app = create_app(server_settings=ServerSettings(host=host, port=port, interrupt_requests=False),
                         model_settings=[model])
    except ValueError as e:  # llama_cpp's "Failed to load model from file"
        raise TrainscaleError(f"llama.cpp cannot load {path}: {e}") from None

    add_error_handlers(app, unexpected=False)  # llama.cpp's routes answer their own errors
    return BodyLimit(Checked(app, name or path.name, max_tokens))


class Checked:
    """ASGI middleware in front of llama.cpp's app: a completion request's body is read and checked against the
    same request models as a model folder's (``check_body``); a bad one gets the 4xx here (llama.cpp's own app
    answers a malformed body with a 500 that quotes a stack frame, and takes n > 1, an empty conversation or a
    negative temperature), a good one goes on unchanged."""

    def __init__(self, app: Any, name: str, max_tokens: int) -> None:
        self.app, self.name, self.max_tokens = app, name, max_tokens
        self.models = dict(zip(("/v1/chat/completions", "/v1/completions"), request_models(), strict=True))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        model = self.models.get(scope.get("path", "")) if scope["type"] == "http" else None
        if model is None or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, chunks)) > MAX_BODY_BYTES:
                return await _send_error(send, ApiError(413, f"the request body is larger than {MAX_BODY_BYTES:,} "
                                                        "bytes", code="request_too_large"))
        body = b"".join(chunks)
        try:
            check_body(model, body, self.name, self.max_tokens)
        except ApiError as e:
            return await _send_error(send, e)
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def check_body(model: Any, body: bytes, name: str, max_tokens: int) -> Any:
    """A completion request's JSON body validated (pydantic) and checked as ``answer`` checks it -> the request."""
    from pydantic import ValidationError

    from trainscale.infer.generate import MAX_TEXT_CHARS, check_text

    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        message, param = _validation_message([dict(x) for x in e.errors()])
        raise ApiError(400, message, param=param) from None
    check_request(req, name)
    if (n := req.limit()) is not None and n > max_tokens:
        raise ApiError(400, f"max_tokens {n} is more than this server's cap of {max_tokens} (trainscale serve "
                       "--max-tokens)", param="max_tokens")
    texts = [m.text() for m in req.messages] if hasattr(req, "messages") else [req.text()]
    try:
        for j, t in enumerate(texts, 1):
            check_text(f"message {j}" if hasattr(req, "messages") else "the prompt", t, MAX_TEXT_CHARS)
    except TrainscaleError as e:
        raise ApiError(400, str(e)) from None
    return req


def check_request(req: Any, name: str) -> None:
    """What pydantic's field bounds do not say: the model is the one served, one choice, at most 4 stops."""
    if req.model != name:
        raise ApiError(404, f"the model {req.model!r} does not exist here; this server serves {name!r}",
                       code="model_not_found", param="model")
    if req.n != 1:
        raise ApiError(400, f"n must be 1 here (one model answers one choice at a time), not {req.n}", param="n")
    req.stops()


# ------------------------------------------------------------------ running it


def open_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so a port in use or an unknown host is one sentence."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise TrainscaleError(f"--host {host!r} is not an address of this machine ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise TrainscaleError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(model: str | Path, host: str = "127.0.0.1", port: int = 8000, max_tokens: int = 512,
          name: str | None = None, n_ctx: int = 4096, threads: int | None = None,
          announce: Any = print) -> dict[str, Any]:
    """Load ``model`` (a .gguf file or a model folder), listen on host:port and serve until interrupted; ->
    what was served."""
    import uvicorn

    path = Path(model).expanduser()
    is_gguf = path.suffix.lower() == ".gguf"
    if not is_gguf and not path.is_dir():
        raise TrainscaleError(f"{model} is neither a .gguf file nor a model folder")
    sock = open_socket(host, port)
    try:
        if is_gguf:
            app = gguf_app(path, host, port, name, n_ctx, threads, max_tokens)
            engine_name, kind = name or path.name, "llama.cpp"
        else:
            engine = Engine(path, max_tokens, name)
            app, engine_name, kind = folder_app(engine), engine.name, f"trainscale ({engine.spec.name})"
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        announce(f"serving {engine_name!r} ({kind}) at http://{shown}:{bound}/v1 — OpenAI API: /v1/models, "
                 "/v1/chat/completions, /v1/completions; Ctrl-C stops it")
        if host not in LOOPBACK:
            announce(f"warning: {host} is reachable from other machines and the API asks no key")
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        server.run(sockets=[sock])
    finally:
        sock.close()
    return {"model": engine_name, "kind": kind, "url": f"http://{host}:{port}/v1"}
