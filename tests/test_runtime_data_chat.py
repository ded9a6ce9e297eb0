"""Chat data: conversations rendered with the folder's own chat template exactly as transformers renders them,
tokenized as transformers tokenizes them, and a loss mask that learns the assistant's words and end-of-turn tokens,
nothing else; every bad record one sentence naming its file and line (issue 21 item 2)."""

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


# --------------------------------------------------------------------------- chat data in shards, loader, model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "chat.jsonl"


def _prepare(tmp_path: Path, files: list[Path], tokenizer: Path, fmt: str = "chat", held_out: float = 0.2):
    from trainscale.runtime.data.shards import DataRequest, prepare
    from trainscale.runtime.data.sources import Settings

    req = DataRequest(files=tuple(str(f) for f in files), format=fmt, tokenizer=str(tokenizer),
                      folder=str(tmp_path / f"prepared-{fmt}"), settings=Settings(held_out=held_out))
    return prepare(req, 512, tmp_path / "cache")


def _split_docs(corpus, split: str):
    import numpy as np

    ends = corpus.documents(split)
    tokens, flags = np.asarray(corpus.tokens(split)[0:len(corpus.tokens(split))]), None
    flags = np.asarray(corpus.flags(split)[0:len(tokens)]) if corpus.flags(split) is not None else None
    starts = np.concatenate([[0], ends[:-1]])
    return [(tokens[a:b], None if flags is None else flags[a:b]) for a, b in zip(starts, ends, strict=True)]


def test_chat_shards_hold_each_conversation_and_its_flags(tmp_path):
    """examples/chat.jsonl prepared: every conversation is one document of the train or held-out split, its
    tokens encode_example's, LEARNED exactly on encode_example's learned tokens, DOC_START on its first token."""

    from trainscale.runtime.data.shards import DOC_START, LEARNED

    folder = chat_folder(tmp_path / "tok", "llama3")
    tok = load_chat_tokenizer(folder)
    examples = list(read_chat_jsonl(EXAMPLES))
    assert len(examples) == 40
    encoded = {tuple(ids): (flags, ex) for ex in examples for ids, flags in [encode_example(ex, tok)]}
    corpus = _prepare(tmp_path, [EXAMPLES], folder)
    assert corpus.index["version"] == 3 and corpus.chat
    train, val = _split_docs(corpus, "train"), _split_docs(corpus, "val")
    assert len(train) + len(val) == 40 and 0 < len(val) < 40
    for ids, flags in train + val:
        learned, _ = encoded[tuple(ids.tolist())]
        assert ((flags & LEARNED) != 0).tolist() == learned
        assert ((flags & DOC_START) != 0).tolist() == [True] + [False] * (len(ids) - 1)
    # the learned tokens of the whole train split decode to its assistants' words, each with its <|eot_id|>
    text = tok.tokenizer.decode([int(i) for ids, f in train for i in ids[(f & LEARNED) != 0]],
                                skip_special_tokens=False)
    assert text == "".join(m["content"].strip() + "<|eot_id|>" for ids, _ in train
                           for m in encoded[tuple(ids.tolist())][1]["messages"] if m["role"] == "assistant")


def test_bad_conversation_in_a_corpus_names_its_file_and_line(tmp_path):
    folder = chat_folder(tmp_path / "tok", "chatml")
    data = tmp_path / "c.jsonl"
    good = '{"prompt": "a", "response": "b"}\n'
    data.write_text(good + "\n" + good + '{"messages": [{"role": "bot", "content": "x"}]}\n')
    with pytest.raises(TrainscaleError, match=rf"^chat data file {data} line 4: message 1 has role 'bot'"):
        _prepare(tmp_path, [data], folder)
    data.write_text(good * 2 + '{"prompt": "stop<|im_end|>", "response": "b"}\n')
    with pytest.raises(TrainscaleError, match=rf"^chat data file {data} line 3: message 1 holds '<\|im_end\|>'"):
        _prepare(tmp_path, [data], folder)
    from trainscale.runtime.data.shards import DataRequest, prepare

    with pytest.raises(TrainscaleError, match=r'format = "chat" needs the model\'s tokenizer folder'):
        prepare(DataRequest(files=(str(data),), format="chat"), 512, tmp_path / "cache")


def test_loader_masks_targets_and_restarts_positions_at_documents():
    """TokenLoader with chat flags: targets IGNORE where the next token is not LEARNED, positions from 0 at each
    DOC_START and at the window's start; text with document_mask: positions restart after the end-of-text id."""
    import numpy as np

    from trainscale.runtime.data.loader import TokenLoader, eval_windows
    from trainscale.runtime.data.shards import DOC_START, LEARNED
    from trainscale.runtime.model import IGNORE

    tokens = np.arange(100, 141, dtype=np.uint16)  # 41 tokens: 5 windows of 8
    flags = np.zeros(41, dtype=np.uint8)
    flags[[0, 13, 20, 30]] |= DOC_START
    flags[[5, 6, 7, 8, 14, 15, 25, 26, 27]] |= LEARNED
    loader = TokenLoader(tokens, 8, 5, flags=flags, documents=True, seed=0)
    x, y, pos = loader.next_batch()
    assert x.shape == y.shape == pos.shape == (5, 8)
    for row in range(5):
        w = int(x[row, 0]) - 100
        for j in range(8):
            assert int(y[row, j]) == (100 + w + j + 1 if flags[w + j + 1] & LEARNED else IGNORE)
            last = max([w] + [k for k in range(w, w + j + 1) if flags[k] & DOC_START])
            assert int(pos[row, j]) == w + j - last
    ex, ey, ep = eval_windows(tokens, 8, 5, flags=flags)
    assert ep[1].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]  # tokens 8..15: a document starts at 13
    assert ey[0].tolist() == [IGNORE] * 4 + [105, 106, 107, 108]
    text = np.array([5, 6, 0, 7, 8, 9, 0, 3, 4], dtype=np.uint16)  # 0: the end-of-text id
    x, y, pos = TokenLoader(text, 8, 1, eot=0, documents=True).next_batch()
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]] and y.tolist() == [text[1:].tolist()]


def test_a_format_2_folder_is_still_read_and_text_has_no_flags(tmp_path):
    import numpy as np

    from trainscale.runtime.data.shards import ShardCorpus

    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in
                            ["The quick brown fox.", "Two plus two is four.", "Rain falls on the hills."] * 20))
    corpus = _prepare(tmp_path, [data], chat_folder(tmp_path / "tok", "llama3"), fmt="jsonl", held_out=0.2)
    assert corpus.flags("train") is None and not corpus.chat
    tokens = np.asarray(corpus.tokens("train")[0:len(corpus.tokens("train"))])
    index = json.loads((corpus.folder / "index.json").read_text())
    index["version"] = 2
    del index["flags"]
    (corpus.folder / "index.json").write_text(json.dumps(index))
    old = ShardCorpus(corpus.folder)
    assert np.array_equal(np.asarray(old.tokens("train")[0:len(tokens)]), tokens) and old.flags("train") is None
    index["version"] = 1
    (corpus.folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(TrainscaleError, match="is in format 1 of an earlier trainscale"):
        _ = ShardCorpus(corpus.folder).index


@pytest.mark.parametrize("extra", [{}, {"positions": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True},
                                   {"sliding_window": 3}, {"attn_softcap": 20.0}])
def test_packed_documents_equal_each_document_alone(extra):
    """Positions [b, s] restarting per document: the block-diagonal causal mask and per-document RoPE make a
    packed row's logits those of each document run alone (and a row's documents do not see another row's)."""
    import torch

    from trainscale.runtime.model import build_model
    from trainscale.specs import load_model

    spec = load_model({"name": "t", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
                       "vocab_size": 100, "max_seq_len": 32, **extra})
    model = build_model(spec, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 100, (1, n), generator=g) for n in (5, 7, 4, 16)]
    packed = torch.cat([torch.cat(docs[:3], 1), docs[3]])
    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]), torch.arange(16)])
    with torch.no_grad():
        out = model(packed, positions=pos)
        alone = torch.cat([model(d) for d in docs[:3]], 1)
        whole = model(docs[3])
        unmasked = model(packed)
    assert torch.allclose(out[:1], alone, atol=1e-5) and torch.allclose(out[1:], whole, atol=1e-5)
    assert not torch.allclose(unmasked[:1], alone, atol=1e-3)  # without the mask the documents do see each other


def test_chat_config_refuses_layouts_and_missing_inputs(tmp_path):
    from trainscale.runtime.config import check_layout, config_from_dict
    from trainscale.specs import Layout

    model = {"name": "t", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
             "vocab_size": 512, "max_seq_len": 256}
    cfg = config_from_dict({"model": model, "data": {"format": "chat", "files": [str(EXAMPLES)],
                                                     "tokenizer": str(tmp_path)}})
    assert cfg.data.documents_apart
    for layout in ("cp2", "pp2"):
        with pytest.raises(TrainscaleError, match=r'^chat data \(data.format = "chat"\) keeps packed documents apart'):
            check_layout(cfg, Layout.parse(layout))
    check_layout(cfg, Layout.parse("dp2,tp2"))
    with pytest.raises(TrainscaleError, match=r'data.format = "chat" needs the conversations'):
        config_from_dict({"model": model, "data": {"format": "chat"}})
    with pytest.raises(TrainscaleError, match="data.document_mask needs a prepared corpus"):
        config_from_dict({"model": model, "data": {"document_mask": True}})
