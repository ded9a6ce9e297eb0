"""`trainscale serve` against the official openai client: a model folder (FastAPI over ``generate``) and its GGUF
(llama.cpp's own server) each started as ``trainscale serve`` in a subprocess on 127.0.0.1 and a free port.

- the client's greedy chat reply, non-streamed and streamed, is ``generate --chat``'s (and llama.cpp's on the GGUF),
  ending at the end of the turn; /v1/completions is ``generate``'s plain continuation;
- 50 concurrent requests (threads) all answer, each the same greedy reply;
- 20 malformed requests (raw httpx) each get a 4xx JSON error in OpenAI's shape, and the server still answers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_infer_chat_export import CONVERSATIONS, N, cli, source  # noqa: F401  (source: module fixture)

openai = pytest.importorskip("openai")
try:  # the openai client's own HTTP library: httpx, or its successor httpx2 (openai >= 3)
    import httpx
except ImportError:
    httpx = pytest.importorskip("httpx2")
pytest.importorskip("llama_cpp.server")
pytestmark = [pytest.mark.service, pytest.mark.slow]

SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """``trainscale serve MODEL`` in a subprocess; -> the process and its base URL once /v1/models answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "trainscale", "serve", str(model), "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("serve did not answer within 180 s")


def stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


@pytest.fixture(scope="module")
def folder_server(source):  # noqa: F811
    proc, url = start(source, "--max-tokens", "64", "--name", "tiny-chat")  # no --host: 127.0.0.1
    yield url
    out = stop(proc)
    assert "Traceback" not in out and "'tiny-chat' (trainscale (" in out and f"at {url} " in out, out


@pytest.fixture(scope="module")
def gguf_server(source, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("serve-gguf") / "tiny-chat.gguf"
    cli("export", str(source), str(path), "--to", "gguf", "--type", "f32")
    proc, url = start(path, "--max-tokens", "64", "--n-ctx", "256")  # llama.cpp's threads: its default (1 here)
    yield url
    out = stop(proc)
    assert "Traceback" not in out, out


def client(url: str):
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)


def ask(c, model: str, messages: list[dict], stream: bool = False) -> tuple[str, str]:
    """-> (reply, finish_reason), joined from the deltas when streamed."""
    r = c.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=N, stream=stream)
    if not stream:
        return r.choices[0].message.content, r.choices[0].finish_reason
    parts, finish = [], None
    for chunk in r:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


@pytest.fixture(scope="module")
def expected(source) -> dict:  # noqa: F811
    """``generate --chat``'s greedy replies (the first conversation, and one with a system message)."""
    user = CONVERSATIONS[0][0]["content"]
    plain = cli("generate", str(source), "--chat", "-p", user, "--temperature", "0", "-n", str(N))
    system = cli("generate", str(source), "--chat", "--system", "You answer briefly.", "-p", user, "--temperature",
                 "0", "-n", str(N))
    assert plain["chat"]["end_of_turn"] and system["chat"]["end_of_turn"]
    return {"plain": plain, "system": system}


def test_openai_client_gets_generate_chats_reply(folder_server, expected, source):  # noqa: F811
    c = client(folder_server)
    assert [m.id for m in c.models.list().data] == ["tiny-chat"]
    with_system = [{"role": "system", "content": "You answer briefly."}, CONVERSATIONS[0][0]]
    for stream in (False, True):
        assert ask(c, "tiny-chat", CONVERSATIONS[0], stream) == (expected["plain"]["chat"]["reply"], "stop")
        assert ask(c, "tiny-chat", with_system, stream) == (expected["system"]["chat"]["reply"], "stop")
    r = c.chat.completions.create(model="tiny-chat", messages=CONVERSATIONS[0], temperature=0, max_tokens=N)
    assert r.usage.completion_tokens == len(expected["plain"]["token_ids"]) - 1  # the end of turn not counted
    assert r.usage.prompt_tokens == expected["plain"]["prompt_tokens"]
    short = c.chat.completions.create(model="tiny-chat", messages=CONVERSATIONS[0], temperature=0, max_tokens=2)
    assert short.choices[0].finish_reason == "length"
    # /v1/completions: generate's plain continuation (no template)
    text = cli("generate", str(source), "-p", "The capital of France", "--temperature", "0", "-n", "12")
    done = c.completions.create(model="tiny-chat", prompt="The capital of France", temperature=0, max_tokens=12)
    assert done.choices[0].text == text["completion"]
    streamed = c.completions.create(model="tiny-chat", prompt="The capital of France", temperature=0, max_tokens=12,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == text["completion"]


def test_a_stop_sequence_cuts_the_reply(folder_server, expected):
    reply = expected["plain"]["chat"]["reply"]
    cut = reply[len(reply) // 2:][:2]
    c = client(folder_server)
    for stream in (False, True):
        r = c.chat.completions.create(model="tiny-chat", messages=CONVERSATIONS[0], temperature=0, max_tokens=N,
                                      stop=[cut], stream=stream)
        got = r.choices[0].message.content if not stream else \
            "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
        assert got == reply[:reply.index(cut)]


def _concurrent(url: str, model: str, reply: str, n: int = 50) -> None:
    """``n`` requests at once (every other one streamed): each gets the whole greedy reply, none is cut short."""
    c = client(url)

    def one(i: int) -> str:
        return ask(c, model, CONVERSATIONS[0], stream=bool(i % 2))[0]

    with ThreadPoolExecutor(n) as pool:
        replies = list(pool.map(one, range(n)))
    assert replies == [reply] * n


def test_fifty_concurrent_requests_all_answer(folder_server, expected):
    _concurrent(folder_server, "tiny-chat", expected["plain"]["chat"]["reply"])


MESSAGES = [{"role": "user", "content": "hi"}]
MALFORMED = [
    ("POST", "/chat/completions", b"{not json"),
    ("POST", "/chat/completions", b"[1, 2]"),
    ("POST", "/chat/completions", {"messages": MESSAGES}),  # no model
    ("POST", "/chat/completions", {"model": "MODEL"}),  # no messages
    ("POST", "/chat/completions", {"model": "MODEL", "messages": []}),
    ("POST", "/chat/completions", {"model": "MODEL", "messages": [{"role": "wizard", "content": "hi"}]}),
    ("POST", "/chat/completions", {"model": "MODEL", "messages": [{"role": "user", "content": 5}]}),
    ("POST", "/chat/completions", {"model": "MODEL", "messages": MESSAGES, "n": 2}),
    ("POST", "/chat/completions", {"model": "MODEL", "messages": MESSAGES, "temperature": -1}),
    ("POST", "/chat/completions", {"model": "MODEL", "messages": MESSAGES, "temperature": "hot"}),
    ("POST", "/chat/completions", {"model": "MODEL", "messages": MESSAGES, "top_p": 0}),
    ("POST", "/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": 0}),
    ("POST", "/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": 10**6}),
    ("POST", "/chat/completions", {"model": "MODEL", "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}),
    ("POST", "/chat/completions", {"model": "MODEL", "messages": MESSAGES, "logit_bias": {"1": 5}}),
    ("POST", "/chat/completions", {"model": "no-such-model", "messages": MESSAGES}),
    ("POST", "/chat/completions", b'{"model": "MODEL", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("POST", "/completions", {"model": "MODEL", "prompt": ["a", "b"]}),
    ("POST", "/completions", {"model": "MODEL", "prompt": "x" * (9 << 20)}),  # over the body cap: 413
    ("GET", "/no/such/route", None),
]


def _malformed(url: str, model: str) -> list[int]:
    statuses = []
    with httpx.Client(timeout=60) as h:
        for method, path, body in MALFORMED:
            if isinstance(body, dict):
                body = json.dumps(body).encode()
            body = body and body.replace(b'"MODEL"', json.dumps(model).encode())
            r = h.request(method, url + path, content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (path, body and body[:200], r.status_code, r.text)
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
            statuses.append(r.status_code)
        assert h.get(f"{url}/models").status_code == 200
    return statuses


def test_twenty_malformed_requests_get_4xx_json(folder_server, expected):
    statuses = _malformed(folder_server, "tiny-chat")
    assert len(statuses) == 20 and statuses.count(404) == 2 and 413 in statuses, statuses
    assert ask(client(folder_server), "tiny-chat", CONVERSATIONS[0]) == (expected["plain"]["chat"]["reply"], "stop")


def test_the_gguf_through_llama_cpps_server_answers_the_same(gguf_server, expected):
    c = client(gguf_server)
    name = c.models.list().data[0].id
    assert name == "tiny-chat.gguf"
    for stream in (False, True):
        assert ask(c, name, CONVERSATIONS[0], stream) == (expected["plain"]["chat"]["reply"], "stop")
    # llama.cpp queues them itself (its server's lock) once serve turns off interrupt_requests
    _concurrent(gguf_server, name, expected["plain"]["chat"]["reply"])
    statuses = _malformed(gguf_server, name)
    assert len(statuses) == 20 and 413 in statuses
    assert ask(c, name, CONVERSATIONS[0]) == (expected["plain"]["chat"]["reply"], "stop")
