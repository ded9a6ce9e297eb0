"""The chat travels with the model: a Llama-3-style chat folder (its template, eos <|eot_id|>, a
generation_config.json that lists two end ids) exported to Hugging Face renders every conversation exactly as the
source folder does under transformers' ``apply_chat_template`` and keeps every end id; exported to GGUF, llama.cpp's
own chat completion (its template from the file, its stop) gives the same greedy reply as ``generate --chat`` and
transformers, ending at the end of the turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _chat_fixtures import chat_folder
from typer.testing import CliRunner

from trainscale.cli import app
from trainscale.errors import TrainscaleError

transformers = pytest.importorskip("transformers")
llama_cpp = pytest.importorskip("llama_cpp")

VOCAB = 384
END_OF_TEXT, EOT = 1, 4  # _chat_fixtures.LLAMA3_SPECIAL: <|end_of_text|>, <|eot_id|> (the folder's eos_token)
N = 24
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Two plus two?"},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three times three?"}],
]


def cli(*args: str) -> dict:
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N, eos_token_id=[EOT, END_OF_TEXT],
                             pad_token_id=EOT)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A random Llama with the llama3 chat template and generation_config.json's two end ids; the head's
    end-of-turn row is made twice the row of a token the greedy reply reaches a few tokens in, so every reply ends
    with <|eot_id|> mid-way."""
    d = chat_folder(tmp_path_factory.mktemp("chat-export") / "src", "llama3", VOCAB)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    ids = tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, return_dict=True)["input_ids"]
    for seed in range(100):  # a reply of whole characters (a byte-level BPE can stop mid-character)
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape))
            new = _greedy(model, list(ids))
        k = next((k for k in range(3, N) if new[k] not in new[:k] and new[k] not in (EOT, END_OF_TEXT)), None)
        if k is not None and "\ufffd" not in tok.decode(new[:k]) and tok.decode(new[:k]).strip():
            break
    with torch.no_grad():
        model.lm_head.weight[EOT] = 2 * model.lm_head.weight[new[k]]
    model.save_pretrained(str(d))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [EOT, END_OF_TEXT]}))
    return d


def test_the_hf_export_renders_and_ends_as_its_source(source, tmp_path):
    out = tmp_path / "hf"
    rep = cli("export", str(source), str(out), "--to", "hf")
    assert rep["end_ids"] == [EOT, END_OF_TEXT] and rep["chat_template"] is True
    theirs, ours = (transformers.AutoTokenizer.from_pretrained(str(p)) for p in (source, out))
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
                theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.eos_token == "<|eot_id|>" and ours.bos_token == "<|begin_of_text|>"
    gen_cfg = transformers.GenerationConfig.from_pretrained(str(out))
    assert gen_cfg.eos_token_id == [EOT, END_OF_TEXT]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = ours.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():  # transformers stops the exported model at the end of the turn by itself
        new = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N)[0, len(ids):].tolist()
    assert new[-1] == EOT and len(new) < N


def test_llama_cpp_chat_completion_on_the_gguf_answers_as_generate_chat(source, tmp_path):
    path = tmp_path / "model.gguf"
    cli("export", str(source), str(path), "--to", "gguf", "--type", "f32")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, seed=0)
    assert llm.metadata["tokenizer.chat_template"] == json.loads((source / "tokenizer_config.json").read_text())[
        "chat_template"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(source))
    user = CONVERSATIONS[0][0]["content"]
    ours = cli("generate", str(source), "--chat", "-p", user, "--temperature", "0", "-n", str(N))
    ids = tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, return_dict=True)["input_ids"]
    new = _greedy(model, list(ids))
    assert new[-1] == EOT and ours["token_ids"] == new and ours["chat"]["end_of_turn"] is True
    reply = llm.create_chat_completion(messages=CONVERSATIONS[0], temperature=0.0, max_tokens=N)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"  # llama.cpp stopped at the end of the turn, not at max_tokens
    assert choice["message"]["content"] == ours["chat"]["reply"] == tok.decode(new[:-1], skip_special_tokens=True)


def test_generate_chat_stops_at_every_end_id_of_the_folder(source, tmp_path):
    """A folder whose eos_token is <|end_of_text|> and whose generation_config.json also lists <|eot_id|> (as Llama
    3.1 Instruct's lists three ids): the reply stops at <|eot_id|>, which only generation_config.json names."""
    import shutil

    folder = tmp_path / "two-ends"
    shutil.copytree(source, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|end_of_text|>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [END_OF_TEXT, EOT]}))
    user = CONVERSATIONS[0][0]["content"]
    out = cli("generate", str(folder), "--chat", "-p", user, "--temperature", "0", "-n", str(N))
    assert out["token_ids"][-1] == EOT and len(out["token_ids"]) < N and out["chat"]["end_of_turn"] is True
    assert out["chat"]["reply"] == cli("generate", str(source), "--chat", "-p", user, "--temperature", "0", "-n",
                                       str(N))["chat"]["reply"]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [END_OF_TEXT, 99999]}))
    r = CliRunner().invoke(app, ["generate", str(folder), "--chat", "-p", user, "-n", "2"])
    assert isinstance(r.exception, TrainscaleError) and "not a token of the tokenizer" in str(r.exception)
