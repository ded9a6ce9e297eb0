"""Chat data (issue 21 item 2): conversations rendered with the folder's own chat template exactly as
transformers renders them, tokenized as transformers tokenizes them, and a loss mask that learns the assistant's
words and end-of-turn tokens, nothing else; every bad record one sentence naming its file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _chat_fixtures import LLAMA3_TEMPLATE, chat_folder

from trainscale.errors import TrainscaleError
from trainscale.runtime.data.chat import encode_example, load_chat_tokenizer, read_chat_jsonl

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
     {"role": "user", "content": "How many legs does a spider have?"},
     {"role": "assistant", "content": " A spider has eight legs. "},  # spaces: the Llama template trims them
     {"role": "user", "content": "Thank you!"},
     {"role": "assistant", "content": "You are welcome, have a nice day."}],
    [{"role": "user", "content": "Please write a short poem about the sea."},
     {"role": "assistant", "content": "Rain falls on the hills;\nrivers carry it down to the sea."},
     {"role": "user", "content": "assistant"},  # a user turn that spells the assistant's role name
     {"role": "assistant", "content": "assistant"}],
]

END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>\n"}


@pytest.fixture(scope="module", params=["llama3", "chatml"])
def folder(request, tmp_path_factory) -> Path:
    return chat_folder(tmp_path_factory.mktemp("chat") / request.param, request.param)


def _hf(folder: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_render_and_ids_equal_transformers(folder, messages):
    tok, hf = load_chat_tokenizer(folder), _hf(folder)
    assert tok.render(messages) == hf.apply_chat_template(messages, tokenize=False)
    assert tok.render(messages[:1], add_generation_prompt=True) == \
        hf.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    ids, flags = encode_example({"messages": messages}, tok)
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert len(flags) == len(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_loss_mask_is_assistant_content_and_end_of_turn(folder, messages):
    tok = load_chat_tokenizer(folder)
    ids, flags = encode_example({"messages": messages}, tok)
    eot = END_OF_TURN[folder.name]
    trim = folder.name == "llama3"
    want = "".join((m["content"].strip() if trim else m["content"]) + eot for m in messages
                   if m["role"] == "assistant")
    learned = [i for i, f in zip(ids, flags, strict=True) if f]
    assert tok.tokenizer.decode(learned, skip_special_tokens=False) == want
    # token by token: each learned run is exactly one assistant turn's tokens, ending at its end-of-turn
    runs, run = [], []
    for i, f in zip(ids, flags, strict=True):
        if f:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    turns = [m for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(turns)
    for r, m in zip(runs, turns, strict=True):
        text = (m["content"].strip() if trim else m["content"]) + eot
        assert r == tok.tokenizer.encode(text, add_special_tokens=False).ids
    # nothing learned before the first assistant turn: the system and user turns and all headers
    first = next(k for k, f in enumerate(flags) if f)
    prompt = tok.render(messages[:next(k for k, m in enumerate(messages) if m["role"] == "assistant")],
                        add_generation_prompt=True)
    assert first == len(tok.tokenizer.encode(prompt, add_special_tokens=False).ids)


def test_mask_equals_transformers_generation_mask(tmp_path):
    """A template that marks the assistant's turn with {% generation %}: transformers' own assistant mask
    (return_assistant_tokens_mask) equals ours, found without the tag."""
    folder = chat_folder(tmp_path / "gen", "llama3")
    marked = LLAMA3_TEMPLATE.replace(
        "{{- message['content'] | trim }}\n{{- '<|eot_id|>' }}\n",
        "{%- if message['role'] == 'assistant' %}\n{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}\n{%- else %}\n{{- message['content'] | trim + '<|eot_id|>' }}\n{%- endif %}\n")
    assert marked != LLAMA3_TEMPLATE
    (folder / "chat_template.jinja").write_text(marked, encoding="utf-8")
    tok, hf = load_chat_tokenizer(folder), _hf(folder)
    assert tok.template == marked
    for messages in CONVERSATIONS:
        got = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, flags = encode_example({"messages": messages}, tok)
        assert ids == got["input_ids"]
        assert [int(f) for f in flags] == got["assistant_masks"]
        assert sum(flags) > 0


def test_prompt_response_is_a_user_and_an_assistant_message(tmp_path):
    tok = load_chat_tokenizer(chat_folder(tmp_path / "f", "llama3"))
    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": "What is two plus two?", "response": "Two plus two is four."},
            {"messages": CONVERSATIONS[1]},
            {"system": "Answer briefly.", "prompt": "Hi", "response": "Hello."}]
    data.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    got = list(read_chat_jsonl(data))
    assert got[0] == {"messages": [{"role": "user", "content": "What is two plus two?"},
                                   {"role": "assistant", "content": "Two plus two is four."}]}
    assert got[1] == {"messages": CONVERSATIONS[1]}
    assert [m["role"] for m in got[2]["messages"]] == ["system", "user", "assistant"]
    assert encode_example(rows[0], tok) == encode_example(got[0], tok)


BAD = [
    ('{"messages": [{"role": "bot", "content": "hi"}]}', "line 2: message 1 has role 'bot', not one of system, "
                                                          "user, assistant"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}', "line 2: message 1 (user) has no "
                                                                                "'content'"),
    ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}',
     "line 2: message 1 (user) has a 'content' that is a int, not a string"),
    ('{"messages": [{"role": 1, "content": "x"}]}', "line 2: message 1 has no 'role' string"),
    ('{"messages": []}', "line 2 has no messages"),
    ('{"messages": "hello"}', "line 2: 'messages' is not a list"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "line 2 has no assistant message, so nothing in it "
                                                          "would be learned"),
    ('{"prompt": "x"}', "line 2 has no 'response'"),
    ('{"prompt": "x", "response": ["y"]}', "line 2: 'response' is a list, not a string"),
    ('{"text": "x"}', "line 2 has neither 'messages' nor 'prompt' and 'response'"),
    ('[1, 2]', "line 2 is not a JSON object"),
    ('{"messages": [', "line 2 is not JSON"),
    ('{"prompt": "a", "response": "b", "messages": []}', "line 2 has both 'messages' and 'prompt'/'response'"),
]


@pytest.mark.parametrize(("line", "sentence"), BAD)
def test_bad_record_is_one_sentence_naming_file_and_line(tmp_path, line, sentence):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"prompt": "fine", "response": "fine"}\n' + line + "\n")
    with pytest.raises(TrainscaleError) as e:
        list(read_chat_jsonl(data))
    msg = str(e.value)
    assert msg == f"chat data file {data} {sentence}" or msg.startswith(f"chat data file {data} {sentence}")
    assert "\n" not in msg


def test_bad_files_and_folders(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff", "response": "b"}\n')
    with pytest.raises(TrainscaleError, match=r"line 2 is not UTF-8 text"):
        list(read_chat_jsonl(data))
    with pytest.raises(TrainscaleError, match="does not exist"):
        list(read_chat_jsonl(tmp_path / "none.jsonl"))
    with pytest.raises(TrainscaleError, match="is a folder, not a file"):
        list(read_chat_jsonl(tmp_path))
    folder = chat_folder(tmp_path / "plain", "llama3")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TrainscaleError, match=r"has no chat template \(neither chat_template.jinja nor"):
        load_chat_tokenizer(folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(TrainscaleError, match="is not valid Jinja"):
        load_chat_tokenizer(folder)


def test_template_refusals_and_control_tokens(tmp_path):
    tok = load_chat_tokenizer(chat_folder(tmp_path / "c", "chatml"))
    late_system = {"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"},
                                {"role": "assistant", "content": "ok"}]}
    with pytest.raises(TrainscaleError, match=r"refuses it \(a system message must come first\)"):
        encode_example(late_system, tok, where="chat data file x line 7")
    smuggled = {"prompt": "end here<|im_end|>", "response": "ok"}
    with pytest.raises(TrainscaleError, match=r"message 1 holds '<\|im_end\|>', a control token of the tokenizer"):
        encode_example(smuggled, tok)
    # the sandbox: a template reaching for Python internals is refused in one sentence
    folder = chat_folder(tmp_path / "evil", "llama3")
    (folder / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TrainscaleError, match="chat template of .* (refuses|fails on) it"):
        encode_example({"prompt": "a", "response": "b"}, load_chat_tokenizer(folder))
