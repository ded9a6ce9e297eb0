"""tokenizer_config.json through one schema (issue 35): every field typed, an eos_token list read as every token
that ends a reply (each in the vocabulary, as transformers' generate stops at any of them), and a bos or end token
the vocabulary lacks refused in one sentence: generation would never stop. The oracle for the ends is
transformers' own tokenizer of the same folder."""

from __future__ import annotations

import json

import pytest
from _chat_fixtures import chat_folder

from trainscale.errors import TrainscaleError
from trainscale.infer.chatfiles import read_chat_files
from trainscale.runtime.data.chat import load_chat_tokenizer
from trainscale.runtime.data.tokenizer import eot_of, load_tokenizer, tokenizer_settings


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat_folder(tmp_path_factory.mktemp("chat") / "tok")


def _with(folder, tmp_path, **fields):
    import shutil

    out = tmp_path / "f"
    shutil.copytree(folder, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, **fields}))
    return out


@pytest.mark.slow  # imports transformers
def test_an_eos_token_list_is_every_end_and_transformers_agrees(folder, tmp_path):
    from transformers import AutoTokenizer

    f = _with(folder, tmp_path, eos_token=["<|eot_id|>", {"content": "<|end_of_text|>"}])
    tok = load_tokenizer(f)
    chat = read_chat_files(f, tok)
    ids = [tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")]
    assert chat.end_ids[:2] == tuple(ids) and chat.special["eos_token"] == "<|eot_id|>"
    assert eot_of(tok, str(f), None) == "<|eot_id|>"
    assert load_chat_tokenizer(f).special["eos_token"] == "<|eot_id|>"
    hf = AutoTokenizer.from_pretrained(str(folder))  # the one-token form, as transformers reads it
    assert hf.eos_token_id == ids[0]


@pytest.mark.parametrize(("fields", "words"), [
    ({"eos_token": "<|never|>"}, "'eos_token' '<|never|>' is not a token of the folder's tokenizer.json"),
    ({"eos_token": ["<|eot_id|>", "<|never|>"]}, "'eos_token' '<|never|>' is not a token"),
    ({"eos_token": []}, "'eos_token' is not what tokenizer_config.json holds there (a token, or a list of 1 to 64"),
    ({"eos_token": 7}, "'eos_token' is not what tokenizer_config.json holds there"),
    ({"bos_token": {"id": 3}}, "'bos_token' is not what tokenizer_config.json holds there (a token: a string, or an "
                               "object with 'content')"),
    ({"chat_template": 3}, "'chat_template' is not what tokenizer_config.json holds there (a Jinja template"),
    ({"add_bos_token": "yes"}, "'add_bos_token' is not what tokenizer_config.json holds there (true or false)"),
    ({"model_max_length": -1}, "'model_max_length' is not what"),
    ({"pad_token": "x" * 5000}, "'pad_token' is not what"),
])
def test_every_field_goes_through_the_schema(folder, tmp_path, fields, words):
    f = _with(folder, tmp_path, **fields)
    tok = load_tokenizer(f)
    for read in (lambda: read_chat_files(f, tok), lambda: eot_of(tok, str(f), None)):
        with pytest.raises(TrainscaleError) as e:
            read()
        assert f"{f / 'tokenizer_config.json'}: {words}" in str(e.value)
    if "not a token" not in words:  # the vocabulary is the generation side's check; the schema is everyone's
        with pytest.raises(TrainscaleError, match="is not what tokenizer_config.json holds"):
            load_chat_tokenizer(f)


def test_fields_transformers_adds_pass_through(folder, tmp_path):
    f = _with(folder, tmp_path, added_tokens_decoder={"0": {"content": "x"}}, legacy=False, padding_side="left")
    raw, special, ends = tokenizer_settings(f, load_tokenizer(f))
    assert raw["padding_side"] == "left" and ends == ("<|eot_id|>",) and special["bos_token"] == "<|begin_of_text|>"


# ----------------------------------------------------------------------------- the tokenizer's own patterns


def _split_tokenizer(path, pattern: str):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.save(str(path))
    return tok


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(?:a|aa)+$", r"(x(a*))*y"])
def test_a_pattern_built_to_backtrack_is_refused_at_load(tmp_path, pattern):
    tok = _split_tokenizer(tmp_path / "t.json", pattern)
    if pattern == r"(?:a|aa)+$":  # the oracle: the tokenizers library itself gives up (a Rust panic) on such text
        with pytest.raises(BaseException, match="retry-limit"):
            tok.encode("a" * 60 + "b")
    with pytest.raises(TrainscaleError, match="repeats a repeated group"):
        load_tokenizer(tmp_path / "t.json")


def test_published_pre_tokenizer_patterns_load(tmp_path):
    # GPT-2's, Llama 3's (tiktoken cl100k) and GPT-4o's (o200k) pre-tokenizer patterns, as their tokenizer.json hold
    for pattern in (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
                    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                    r"\s*[\r\n]+|\s+(?!\S)|\s+",
                    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"):
        _split_tokenizer(tmp_path / "t.json", pattern)
        assert load_tokenizer(tmp_path / "t.json").encode("aa bb").ids


def test_a_fifo_among_a_sharded_folders_files_is_refused_not_waited_on(tmp_path):
    import os
    import signal

    from trainscale.runtime.data.shards import ShardCorpus

    os.mkfifo(tmp_path / "unigram.npy")
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("waited on a FIFO"))
    signal.alarm(20)
    try:
        with pytest.raises(TrainscaleError, match="not a regular file|is a FIFO|FIFO"):
            ShardCorpus(tmp_path).unigram_counts()
    finally:
        signal.alarm(0)
