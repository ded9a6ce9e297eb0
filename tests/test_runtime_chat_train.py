"""The real trainer on chat data (examples/chat.jsonl, a Llama-3-style chat template; issue 21 item 2). The loss
is the mean over the learned targets of the whole global batch, so real processes under dp2, tp2 and fsdp2 give
the single process's losses; a run started from a Hugging Face folder uses its tokenizer and chat template and
leaves them in final/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _chat_fixtures import chat_folder
from _parity import run_layouts

from trainscale.runtime.data.chat import load_chat_tokenizer
from trainscale.runtime.data.corpus import corpus_for
from trainscale.runtime.data.loader import TokenLoader
from trainscale.runtime.init import resolved_config
from trainscale.runtime.model import IGNORE, build_model, lm_loss

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "chat.jsonl"
STEPS = 6
TOL = 1e-5
MODEL = """
[model]
name = "tiny-chat"
n_layers = 2
d_model = 64
n_heads = 4
n_kv_heads = 2
d_ff = 192
vocab_size = 512
max_seq_len = 64
"""


def chat_config(tmp: Path, tokenizer: Path | None, model: str = MODEL, steps: int = STEPS) -> Path:
    tok = f'tokenizer = "{tokenizer}"\n' if tokenizer is not None else ""
    path = tmp / "chat.toml"
    path.write_text(f'name = "chat"\n{model}\n[train]\nsteps = {steps}\nlr = 3e-3\nwarmup = 2\nseq_len = 64\n'
                    f'global_batch = 4\nseed = 0\n[data]\nformat = "chat"\nfiles = ["{EXAMPLES}"]\n{tok}'
                    f'held_out = 0.2\nprepared = "{tmp / "prepared"}"\n[run]\nout = "{tmp / "run"}"\n'
                    'eval_sequences = 8\n')
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("chat")
    config = chat_config(tmp, chat_folder(tmp / "tok", "llama3"))
    got = run_layouts(config, STEPS, 1, ["mb4", "mb1"], tmp)
    got.update(run_layouts(config, STEPS, 2, ["dp2", "tp2,mb4", "fsdp2,mb2"], tmp))
    return config, got


def test_first_step_loss_is_the_mean_over_the_global_batchs_learned_targets(runs):
    config, got = runs
    cfg = resolved_config(config)
    corpus = corpus_for(cfg)
    loader = TokenLoader(corpus.tokens("train"), 64, 4, flags=corpus.flags("train"), eot=corpus.eot_id,
                         documents=True)
    x, y, pos = loader.next_batch()
    assert 0 < int((y != IGNORE).sum()) < y.numel() // 2  # most targets are prompts and template
    model = build_model(cfg.model, seed=cfg.train.seed)
    with torch.no_grad():
        want = float(lm_loss(model(x, positions=pos), y))
    assert got["mb4"]["losses"][0] == pytest.approx(want, rel=TOL)
    with torch.no_grad():  # what a mean per sequence (or per rank) would give instead: a different number
        rows = [float(lm_loss(model(x[r:r + 1], positions=pos[r:r + 1]), y[r:r + 1])) for r in range(len(x))
                if (y[r] != IGNORE).any()]
    # the alternative sits at least ten tolerances away, so the equality above tells the two apart (with the
    # per-parameter initialisation of runtime/model.normal_box the gap is 13 tolerances at seed 0)
    assert abs(sum(rows) / len(rows) - want) > 10 * TOL * want
    assert got["mb4"]["losses"][-1] < got["mb4"]["losses"][0] - 0.3  # it learns


@pytest.mark.parametrize("layout", ["mb1", "dp2", "tp2,mb4", "fsdp2,mb2"])
def test_chat_losses_equal_the_single_process(runs, layout):
    """Ranks and micro-batches hold different numbers of learned targets; the loss still is the global mean."""
    _, got = runs
    ref, mine = got["mb4"]["losses"], got[layout]["losses"]
    assert len(mine) == len(ref) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(mine, ref, strict=True)) < TOL, (layout, mine, ref)


def _hf_chat_folder(folder: Path) -> Path:
    """A random tiny LlamaForCausalLM saved with the fixture's Llama-3-style tokenizer and chat template."""
    transformers = pytest.importorskip("transformers")
    chat_folder(folder, "llama3")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


def test_train_chat_from_a_hugging_face_folder_keeps_its_template_in_final(tmp_path):
    hf = _hf_chat_folder(tmp_path / "hf")
    config = chat_config(tmp_path, None, model=f'[model]\ninit = "{hf}"\n', steps=3)
    cfg = resolved_config(config)
    assert cfg.data.tokenizer == str(hf) and cfg.data.documents_apart
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "trainscale", "train", "--config", str(config), "--layout", "dp2",
                        "--out", str(out), "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    info = json.loads(p.stdout)
    assert info["status"] == "done" and info["eval_loss"] > 0
    final = out / "final"
    assert (final / "tokenizer_config.json").read_bytes() == (hf / "tokenizer_config.json").read_bytes()
    messages = [{"role": "user", "content": "What is 7 plus 8?"}, {"role": "assistant", "content": "15."}]
    mine, theirs = load_chat_tokenizer(final), load_chat_tokenizer(hf)
    assert mine.render(messages) == theirs.render(messages)
    from trainscale.runtime.data.chat import encode_example

    assert encode_example({"messages": messages}, mine) == encode_example({"messages": messages}, theirs)
    # the run started from the folder's weights: step 1's loss is the HF model's on that batch
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf)).eval()
    corpus = corpus_for(cfg)
    x, y, pos = TokenLoader(corpus.tokens("train"), 64, 4, flags=corpus.flags("train"), documents=True).next_batch()
    with torch.no_grad():  # one conversation at a time through transformers (no packing there)
        total, count = 0.0, 0
        for row in range(len(x)):
            starts = (pos[row] == 0).nonzero().flatten().tolist() + [x.shape[1]]
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                logits = model(x[row:row + 1, a:b]).logits
                t = y[row:row + 1, a:b]
                total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten(),
                                                                  ignore_index=IGNORE, reduction="sum"))
                count += int((t != IGNORE).sum())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 1 and "loss" in r)
    assert first["loss"] == pytest.approx(total / count, rel=1e-4)
