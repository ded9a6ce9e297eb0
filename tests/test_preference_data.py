"""Preference pairs read from JSONL (runtime/data/preference.py): plain and chat forms, the answer-only masks, and
one sentence naming the line for a malformed row. (That the masks equal TRL's completion tokens is in
test_preference_trl.py.)"""

from __future__ import annotations

import json

import pytest
from _chat_fixtures import chat_folder

from trainscale.errors import TrainscaleError
from trainscale.runtime.data.chat import load_chat_tokenizer
from trainscale.runtime.data.preference import load_pairs, read_pairs_jsonl


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_chat_tokenizer(chat_folder(tmp_path_factory.mktemp("tok"), "llama3"))


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_plain_pair_is_the_chat_pair_of_a_user_prompt(tmp_path, tok):
    plain = {"system": "You are brief.", "prompt": "Two plus two?", "chosen": "Four.", "rejected": "Nine."}
    chat = {"prompt": [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Two plus two?"}],
            "chosen": [{"role": "assistant", "content": "Four."}], "rejected": "Nine."}
    a, b = load_pairs(_write(tmp_path / "a.jsonl", [plain, "", chat]), tok)
    assert a == b
    text = tok.tokenizer.decode([i for i, f in zip(*a.chosen, strict=True) if f], skip_special_tokens=False)
    assert text == "Four.<|eot_id|>"  # the answer and its end of turn, nothing of the prompt or header
    assert tok.tokenizer.decode(a.chosen[0], skip_special_tokens=False).startswith("<|begin_of_text|>")


def test_prompt_turns_of_the_assistant_are_not_scored(tmp_path, tok):
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                        {"role": "user", "content": "Bye"}], "chosen": "Goodbye!", "rejected": "Rain."}
    (pair,) = load_pairs(_write(tmp_path / "p.jsonl", [row]), tok)
    for ids, flags in (pair.chosen, pair.rejected):
        scored = tok.tokenizer.decode([i for i, f in zip(ids, flags, strict=True) if f], skip_special_tokens=False)
        assert "Hello there" not in scored and scored.endswith("<|eot_id|>")


@pytest.mark.parametrize(("row", "says"), [
    ("{not json", "line 3 is not JSON"),
    ({"prompt": "Hi", "chosen": "A"}, "line 3 has no 'rejected'"),
    ({"prompt": "Hi", "chosen": "A", "rejected": "A"}, "line 3: 'chosen' and 'rejected' are the same answer"),
    ({"prompt": "Hi", "chosen": [{"role": "user", "content": "A"}], "rejected": "B"},
     "line 3: 'chosen' has no assistant message"),
    ({"prompt": "Hi", "chosen": 5, "rejected": "B"}, "line 3: 'chosen' is a int, not a string or a list"),
    ({"prompt": [{"role": "robot", "content": "x"}], "chosen": "A", "rejected": "B"}, "has role 'robot'"),
    ({"prompt": "Hi", "messages": [], "chosen": "A", "rejected": "B"}, "both 'messages' and 'prompt'"),
    ([1, 2], "line 3 is not a JSON object"),
])
def test_a_malformed_row_is_one_sentence_naming_its_line(tmp_path, tok, row, says):
    good = {"prompt": "Hi", "chosen": "Hello", "rejected": "Rain"}
    path = _write(tmp_path / "bad.jsonl", [good, good, row])
    with pytest.raises(TrainscaleError) as e:
        list(read_pairs_jsonl(path))
    msg = str(e.value)
    assert says in msg and f"preference data file {path}" in msg and "\n" not in msg


def test_empty_file_and_foreign_vocabulary_are_refused(tmp_path, tok):
    with pytest.raises(TrainscaleError, match="holds no pair"):
        load_pairs(_write(tmp_path / "e.jsonl", [""]), tok)
    path = _write(tmp_path / "v.jsonl", [{"prompt": "Hi", "chosen": "Hello", "rejected": "Rain"}])
    with pytest.raises(TrainscaleError, match="pair 1 holds token ids beyond the model's vocabulary"):
        load_pairs(path, tok, vocab=10)
