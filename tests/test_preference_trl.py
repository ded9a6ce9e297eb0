"""Preference losses against TRL 1.16 (the oracle, in the dev extra): on one tiny Llama, the same pairs and
settings, our loss, rewards and gradients equal TRL's within 1e-5 relative.

DPO and IPO: TRL's own DPOTrainer renders the pairs with the folder's chat template (transformers'
apply_chat_template), tokenizes and masks them, runs the policy and the reference model and computes the loss
(``compute_loss`` on one collated batch); ours reads the same pairs from JSONL (runtime/data/preference.py), runs
trainscale's model of the same folders and runtime/preference.py's loss. SimPO and ORPO: TRL's CPOTrainer /
ORPOTrainer loss functions (``get_batch_logps``, ``cpo_loss``, ``odds_ratio_loss``) on the transformers model's
logits of the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _pref import ROWS, llama_folder, write_jsonl

from trainscale import hf
from trainscale.infer.load import load_for_inference
from trainscale.infer.preference import batch_loss, reference_logps
from trainscale.runtime.data.chat import load_chat_tokenizer
from trainscale.runtime.data.preference import load_pairs
from trainscale.runtime.preference import PreferenceSettings, summarize

pytestmark = pytest.mark.slow
REL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    policy, ref = llama_folder(root / "policy", seed=0), llama_folder(root / "ref", seed=1)
    data = write_jsonl(root / "pairs.jsonl", ROWS)
    pairs = load_pairs(data, load_chat_tokenizer(policy), 384)
    return SimpleNamespace(policy=policy, ref=ref, data=data, pairs=pairs, root=root)


def _ours(setup, s: PreferenceSettings):
    """Our loss, summarized metrics and gradients (by HF tensor name, Q/K rows in HF's order)."""
    model, spec, _ = load_for_inference(setup.policy)
    for p in model.parameters():
        p.requires_grad_(True)
    ref = None
    if s.needs_reference:
        ref = reference_logps(load_for_inference(setup.ref)[0], setup.pairs, 256)
    model.train()
    loss, m = batch_loss(model, s, setup.pairs, ref, 256)
    loss.backward()
    fam = hf.export_family(spec)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if (heads := hf.rope_permuted_heads(name, spec)) is not None:
            g = hf.rope_interleaved_to_half(g, heads, spec.head_dim)
        grads[hf.hf_name(name, fam)] = g
    return loss.item(), summarize(m), grads


def _close(a: float, b: float, scale: float = 0.0) -> bool:
    """|a - b| within REL of b (of ``scale`` for a difference of two larger numbers: a margin)."""
    return abs(a - b) <= REL * max(abs(b), scale, 1e-30)


def _check_grads(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for name, g in theirs.items():
        err = (ours[name] - g).norm() / g.norm()
        assert err <= REL, (name, err.item())


def _tokenizer(setup):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(setup.policy))
    tok.pad_token = tok.eos_token
    return tok


def _hf_model(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def _trl_dpo(setup, loss_type: str):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok = _tokenizer(setup)
    args = DPOConfig(output_dir=str(setup.root / "trl"), beta=0.1, loss_type=[loss_type], report_to=[],
                     per_device_train_batch_size=len(ROWS), use_cpu=True, precompute_ref_log_probs=False, bf16=False,
                     max_length=None)
    trainer = DPOTrainer(model=str(setup.policy), ref_model=_hf_model(setup.ref), args=args,
                         train_dataset=Dataset.from_list(ROWS), processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.item(), metrics, {n: p.grad for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize(("ours_loss", "trl_loss"), [("dpo", "sigmoid"), ("ipo", "ipo")])
def test_dpo_and_ipo_equal_trl_dpo_trainer(setup, ours_loss, trl_loss):
    loss, metrics, grads = _trl_dpo(setup, trl_loss)
    s = PreferenceSettings(loss=ours_loss, beta=0.1)
    our_loss, our_metrics, our_grads = _ours(setup, s)
    assert _close(our_loss, loss), (our_loss, loss)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert _close(our_metrics[k], metrics[k]), (k, our_metrics[k], metrics[k])
    assert our_metrics["rewards/accuracies"] == metrics["rewards/accuracies"]
    assert abs(metrics["rewards/margins"]) > 1e-3  # the two models differ: a real margin is compared
    _check_grads(our_grads, grads)


def _hf_batch(setup):
    """The transformers policy and the pairs' rows as TRL's CPO / ORPO read them: full ids, labels -100 off the
    answers (chosen rows first)."""
    model = _hf_model(setup.policy)
    seqs = [p.chosen for p in setup.pairs] + [p.rejected for p in setup.pairs]
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    for r, (row, flags) in enumerate(seqs):
        ids[r, : len(row)] = torch.tensor(row)
        labels[r, : len(row)] = torch.where(torch.tensor(flags), torch.tensor(row), -100)
    return model, ids, labels


def _trl_reference_free(setup, kind: str, beta: float, gamma: float = 0.5, label_smoothing: float = 0.0):
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    model, ids, labels = _hf_batch(setup)
    model.train()
    logits = model(ids).logits
    n = len(setup.pairs)
    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    trainer = object.__new__(CPOTrainer if kind == "simpo" else ORPOTrainer)  # only the loss functions are used
    trainer.__dict__.update(beta=beta, alpha=0.0, loss_type="simpo", simpo_gamma=gamma,
                            label_smoothing=label_smoothing, accelerator=SimpleNamespace(device="cpu"))
    if kind == "simpo":
        losses, c, r = trainer.cpo_loss(logps[:n], logps[n:])
        loss = losses.mean()
    else:
        losses, c, r, _, _ = trainer.odds_ratio_loss(logps[:n], logps[n:])
        nll = torch.nn.functional.cross_entropy(logits[:n, :-1].reshape(-1, logits.shape[-1]),
                                                labels[:n, 1:].reshape(-1))
        loss = nll - losses.mean()
    loss.backward()
    metrics = {"rewards/chosen": c.mean().item(), "rewards/rejected": r.mean().item(),
               "rewards/margins": (c - r).mean().item(), "rewards/accuracies": (c > r).float().mean().item()}
    return loss.item(), metrics, {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize(("kind", "beta", "smoothing"), [("simpo", 2.0, 0.0), ("simpo", 2.0, 0.2), ("orpo", 0.1, 0.0)])
def test_simpo_and_orpo_equal_trl(setup, kind, beta, smoothing):
    loss, metrics, grads = _trl_reference_free(setup, kind, beta, gamma=0.5, label_smoothing=smoothing)
    s = PreferenceSettings(loss=kind, beta=beta, gamma=0.5, label_smoothing=smoothing)
    our_loss, our_metrics, our_grads = _ours(setup, s)
    assert _close(our_loss, loss), (our_loss, loss)
    for k in ("rewards/chosen", "rewards/rejected"):
        assert _close(our_metrics[k], metrics[k]), (k, our_metrics[k], metrics[k])
    scale = max(abs(metrics["rewards/chosen"]), abs(metrics["rewards/rejected"]))
    assert _close(our_metrics["rewards/margins"], metrics["rewards/margins"], scale)
    assert our_metrics["rewards/accuracies"] == metrics["rewards/accuracies"]
    _check_grads(our_grads, grads)


def test_dpo_label_smoothing_equals_trl_conservative_sigmoid(setup):
    """cDPO: TRL's CPO sigmoid loss with label smoothing, fed the pairs' log-ratios (policy - reference)."""
    from trl.experimental.cpo import CPOTrainer

    s = PreferenceSettings(loss="dpo", beta=0.1, label_smoothing=0.1)
    model = load_for_inference(setup.policy)[0]
    ref = reference_logps(load_for_inference(setup.ref)[0], setup.pairs, 256)
    pol = reference_logps(model, setup.pairs, 256)
    with torch.no_grad():
        ours, _ = batch_loss(model, s, setup.pairs, ref, 256)
    trainer = object.__new__(CPOTrainer)
    trainer.__dict__.update(beta=0.1, alpha=0.0, loss_type="sigmoid", label_smoothing=0.1,
                            accelerator=SimpleNamespace(device="cpu"))
    losses, _, _ = trainer.cpo_loss(pol[:, 0] - ref[:, 0], pol[:, 1] - ref[:, 1])
    assert _close(ours.item(), losses.mean().item())
    assert ours.item() != pytest.approx(batch_loss(model, PreferenceSettings(), setup.pairs, ref, 256)[0].item())


def test_scored_tokens_are_trl_completion_tokens(setup):
    """Our masks (the answer's tokens and its end of turn, from the rendered text) equal TRL's completion ids
    (the tokens after the rendered prompt with its generation prompt), and the sequences are prompt + completion."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok = _tokenizer(setup)
    args = DPOConfig(output_dir=str(setup.root / "trl-tok"), report_to=[], use_cpu=True, max_length=None)
    trainer = DPOTrainer(model=str(setup.policy), ref_model=_hf_model(setup.ref), args=args,
                         train_dataset=Dataset.from_list(ROWS), processing_class=tok)
    for i, pair in enumerate(setup.pairs):
        ex = trainer.train_dataset[i]
        for side, key in ((pair.chosen, "chosen_ids"), (pair.rejected, "rejected_ids")):
            ids, flags = side
            assert ids == ex["prompt_ids"] + ex[key]
            assert flags == [False] * len(ex["prompt_ids"]) + [True] * len(ex[key])
