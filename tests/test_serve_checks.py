"""serve's request checks without a server (the fast loop): every malformed body of tests/test_serve.py's list is
refused by ``check_body`` with its status and one sentence, a good body passes; the streamed text holds back half a
character and the start of a stop sequence."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from trainscale.infer.serve import ApiError, _held_back, check_body, request_models  # noqa: E402

CHAT, COMPLETION = request_models()
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("body", "status", "words"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "should be an object"),
    ({"messages": GOOD["messages"]}, 400, "model: Field required"),
    ({"model": "m"}, 400, "messages: Field required"),
    ({**GOOD, "messages": []}, 400, "at least 1 item"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({**GOOD, "n": 2}, 400, "n must be 1"),
    ({**GOOD, "temperature": -1}, 400, "temperature"),
    ({**GOOD, "top_p": 0}, 400, "top_p"),
    ({**GOOD, "max_tokens": 65}, 400, "cap of 64"),
    ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({**GOOD, "logit_bias": {"1": 5}}, 400, "logit_bias: Extra inputs are not permitted"),
    ({**GOOD, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({**GOOD, "model": "other"}, 404, "does not exist here"),
    ({**GOOD, "messages": [{"role": "user", "content": "caf\udce9"}]}, 400, "not valid JSON"),  # a lone surrogate
])
def test_check_body_refuses(body, status, words):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as e:
        check_body(CHAT, raw, "m", 64)
    assert e.value.status == status and words in e.value.message, e.value.message
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_check_body_passes_a_good_request():
    req = check_body(CHAT, json.dumps({**GOOD, "max_tokens": 64, "stop": "x", "stream": True}).encode(), "m", 64)
    assert req.stops() == ["x"] and req.limit() == 64
    text = check_body(COMPLETION, json.dumps({"model": "m", "prompt": ["once"]}).encode(), "m", 64)
    assert text.text() == "once"
    with pytest.raises(ApiError, match="one string"):
        check_body(COMPLETION, json.dumps({"model": "m", "prompt": ["a", "b"]}).encode(), "m", 64)


def test_held_back():
    assert _held_back("Paris", []) == 0
    assert _held_back("Par\ufffd", []) == 1  # half a character: wait for its other bytes
    assert _held_back("The end", ["end.", "###"]) == 3  # "end" may begin "end."
    assert _held_back("a ##", ["end.", "###"]) == 2
