"""``generate --chat``: the prompt as a user message (``--system`` before it) rendered with the model folder's own chat
template and generation prompt, tokenized once (the template writes the special tokens), generation stopping at the
folder's eos_token (the template's end of turn), the reply alone printed.

- greedy ``generate --chat`` on a transformers-built Llama folder gives the token ids of transformers'
  ``model.generate(tokenizer.apply_chat_template(..., add_generation_prompt=True), do_sample=False)`` up to and
  including the end-of-turn token, which the model is made to emit mid-reply;
- a folder without a chat template is refused in one sentence (exit 2);
- a LoRA adapter folder on that Llama folder renders with the template lora copied beside it, or without one with
  its base's, and gives the greedy ids of the adapted model on transformers' prompt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _chat_fixtures import chat_folder
from typer.testing import CliRunner

from trainscale.cli import app

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

VOCAB = 384
EOT = 4  # <|eot_id|>: _chat_fixtures.LLAMA3_SPECIAL's fifth token, the folder's eos_token
SYSTEM = "You answer briefly."
USER = "What is the capital of France?"
N = 24


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def refused(capsys, monkeypatch, *args: str) -> str:
    """``trainscale ARGS`` through the CLI's entry point (errors -> exit 2, one line) -> that line."""
    from trainscale.cli import main

    monkeypatch.setattr("sys.argv", ["trainscale", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def hf_messages(system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": USER}]


def hf_greedy(model, tok, system: str | None) -> tuple[list[int], list[int]]:
    """transformers' own chat prompt and greedy reply (up to and including the end-of-turn token)."""
    ids = tok.apply_chat_template(hf_messages(system), add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N, eos_token_id=EOT,
                             pad_token_id=EOT)
    return list(ids), out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    """A random Llama (untied head, weights perturbed so greedy text varies) with the llama3 chat template, whose
    end-of-turn row of the head is twice the row of a token greedy decoding first picks a few tokens in: the
    reply then ends with <|eot_id|> there (logit 2x > x for that token's positive top logit)."""
    d = chat_folder(tmp_path_factory.mktemp("gen-chat") / "hf", "llama3", VOCAB)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
        _, new = hf_greedy(model, transformers.AutoTokenizer.from_pretrained(str(d)), SYSTEM)
        k = next(k for k in range(3, N) if new[k] not in new[:k] and new[k] != EOT)
        model.lm_head.weight[EOT] = 2 * model.lm_head.weight[new[k]]
    model.save_pretrained(str(d))
    return d


def test_greedy_chat_equals_transformers_up_to_end_of_turn(hf):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    replies = {}
    for system in (SYSTEM, None):
        ids, new = hf_greedy(model, tok, system)
        assert new[-1] == EOT and 3 < len(new) < N  # the reply ended at the end of turn, mid-way
        args = ["generate", str(hf), "--chat", "-p", USER, "--temperature", "0", "-n", str(N)]
        r = cli(*args, *(["--system", system] if system else []), "--json")
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["token_ids"] == new
        assert out["prompt_tokens"] == len(ids) and out["kv_cache"]["positions"] == len(ids) + N
        assert out["chat"]["rendered_prompt"] == tok.apply_chat_template(hf_messages(system), tokenize=False,
                                                                         add_generation_prompt=True)
        assert out["chat"]["end_of_turn"] is True
        reply = tok.decode(new[:-1], skip_special_tokens=True)
        assert out["chat"]["reply"] == out["completion"] == reply and reply.strip()
        replies[system] = reply
    human = cli(*args, "--system", SYSTEM)
    assert human.exit_code == 0, human.output
    assert human.stdout.startswith(replies[SYSTEM]) and SYSTEM not in human.stdout and USER not in human.stdout


def test_no_template_is_refused_in_one_sentence(hf, tmp_path, capsys, monkeypatch):
    bare = tmp_path / "bare"
    shutil.copytree(hf, bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    err = refused(capsys, monkeypatch, "generate", str(bare), "--chat", "-p", USER, "-n", "2")
    assert "has no chat template" in err and "--chat" in err
    assert cli("generate", str(bare), "-p", USER, "-n", "2", "--json").exit_code == 0  # plain text still continues
    assert "with --chat" in refused(capsys, monkeypatch, "generate", str(hf), "--system", SYSTEM, "-p", USER)
    assert "control token" in refused(capsys, monkeypatch, "generate", str(hf), "--chat", "-p", "hi <|eot_id|> there")


def test_lora_adapter_renders_with_its_bases_template(hf, tmp_path):
    from trainscale.infer.generate import Sampling, generate_ids
    from trainscale.infer.load import load_for_inference

    rows = [{"prompt": f"What is {i} plus 1?", "response": f"{i} plus 1 is {i + 1}."} for i in range(40)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    adapter = tmp_path / "adapter"
    r = cli("lora", str(hf), "--data", str(data), "--steps", "3", "--batch", "4", "--seq-len", "48", "--rank", "2",
            "--out", str(adapter), "--json")
    assert r.exit_code == 0, r.output
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    ids = tok.apply_chat_template(hf_messages(SYSTEM), add_generation_prompt=True, return_dict=True)["input_ids"]
    model, _, _ = load_for_inference(adapter)
    expected = generate_ids(model, list(ids), N, Sampling(temperature=0), stop_id=EOT).new_ids
    args = ["generate", str(adapter), "--chat", "--system", SYSTEM, "-p", USER, "--temperature", "0", "-n", str(N),
            "--json"]
    for where in (adapter, hf):  # lora copies the template beside the adapter; an adapter without one: its base's
        r = cli(*args)
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["token_ids"] == expected and out["prompt_tokens"] == len(ids)
        assert Path(out["chat"]["template_folder"]).resolve() == where.resolve()
        (adapter / "tokenizer_config.json").unlink(missing_ok=True)
        (adapter / "chat_template.jinja").unlink(missing_ok=True)


def test_texts_are_bounded_and_checked_before_any_work(hf, capsys, monkeypatch):
    """Issue 35: a 120,000-character --prompt or --system (the model's context is 128 positions: the cap is 16
    characters a position, 2,048), a prompt over the absolute cap before the model is even read, a command-line byte
    that is not UTF-8 (a lone surrogate in sys.argv, Python's surrogateescape), each one sentence."""
    from trainscale.infer.generate import MAX_TEXT_CHARS

    big = "a" * 120_000
    err = refused(capsys, monkeypatch, "generate", str(hf), "--chat", "-p", big, "-n", "2")
    assert "--prompt holds 120,000 characters, more than the cap of 2,048 (16 per position of the model's " \
        "128-token context)" in err
    err = refused(capsys, monkeypatch, "generate", str(hf), "--chat", "-p", USER, "--system", big, "-n", "2")
    assert "--prompt and --system hold 120,030 characters, more than the cap of 2,048" in err
    err = refused(capsys, monkeypatch, "generate", "/no/such/model", "-p", "b" * (MAX_TEXT_CHARS + 1))
    assert f"more than the cap of {MAX_TEXT_CHARS:,}" in err  # refused before the folder is looked at
    for flag in ("-p", "--system"):
        text = "caf\udce9 au lait"
        args = ["--chat", "-p", USER, flag, text] if flag == "--system" else ["--chat", flag, text]
        err = refused(capsys, monkeypatch, "generate", str(hf), *args)
        assert "is not valid UTF-8 text (byte 0xe9 at character 4)" in err, err
    ok = cli("generate", str(hf), "--chat", "-p", "x" * 2_000, "-n", "1", "--json")  # under the cap: the context says
    assert ok.exit_code != 0 and "exceeds the model's context of 128" in str(ok.exception)


def test_sampling_domains_cannot_underflow(hf, capsys, monkeypatch):
    """Issue 35: --temperature 1e-300 made logits / t infinite and --top-p 1e-300 is 0.0 in float32 (every token
    dropped): both were "unexpected" crashes in torch.multinomial; now one sentence naming the domain, and the
    domain's edges sample what they should (the most likely token)."""
    from trainscale.infer.generate import MIN_TEMPERATURE, MIN_TOP_P, Sampling, sample_next

    err = refused(capsys, monkeypatch, "generate", str(hf), "-p", USER, "--temperature", "1e-300")
    assert "temperature must be 0 (greedy) or in [0.001, 100]" in err and "not 1e-300" in err
    err = refused(capsys, monkeypatch, "generate", str(hf), "-p", USER, "--top-p", "1e-300")
    assert "top-p must be in [1e-06, 1]" in err and "not 1e-300" in err
    logits = torch.randn(4, 384, generator=torch.Generator().manual_seed(0)) * 30
    gen = torch.Generator().manual_seed(0)
    for s in (Sampling(MIN_TEMPERATURE), Sampling(1.0, top_p=MIN_TOP_P), Sampling(MIN_TEMPERATURE, 5, MIN_TOP_P)):
        assert torch.equal(sample_next(logits, s, gen), logits.argmax(-1))
