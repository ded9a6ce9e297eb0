"""The one rule set (``trainscale.rules``): the planner, ``specs.Layout`` and the runtime read the same rules.

- On 500+ layouts the planner calls valid (dense and MoE, several models, GPU counts and sequences), the
  planner's "runnable" mark and the runtime's own ``check_layout`` agree on every one.
- Every rule's sentence is what each entry point (Layout, check_layout, the planner, the runnable planner)
  says for a layout that breaks it, and a layout breaking a rule outside an entry point's set passes it.
- The rules match what they stand for: the stage rule is ``placement.empty_stages``, the cut rule
  ``placement``'s balanced cuts.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from trainscale import placement, rules
from trainscale.errors import TrainscaleError
from trainscale.estimate.planner import plan
from trainscale.runtime.config import check_layout, config_from_dict, load_config
from trainscale.specs import Layout, ModelSpec, load_model

ROOT = Path(__file__).resolve().parents[1]


# how a config's [data] keeps packed documents apart, for rules.Case's ``documents`` ("" : it does not)
DATA = {"": {}, "chat": {"format": "chat", "files": ["chat.jsonl"]},
        "document_mask": {"document_mask": True, "tokenizer": "tokenizer.json"}}


def train_config(model: ModelSpec, seq: int, seqs: int, documents: str = ""):
    """The runtime's config for this model, sequence length and global batch (sequences), and data that keeps
    documents apart as ``documents`` says (nothing is read: the config is data)."""
    return config_from_dict({"model": model.model_dump(by_alias=True, exclude_none=True),
                             "train": {"seq_len": seq, "global_batch": seqs}, "data": DATA[documents]})


# ----------------------------------------------------------------------------- planner and runtime agree

SMALL = load_config(ROOT / "configs" / "small.toml").model  # 4 layers, 8 heads, 4 KV heads, d_ff 688
# (model, GPUs, seq, global batch in tokens)
PROBLEMS = [
    ("llama3.1-8b", 64, 8192, 2**24),
    ("llama3.1-8b", 24, 4096, 3 * 2**20),
    ("llama3.1-70b", 256, 8192, 2**24),
    ("mixtral-8x7b", 64, 4096, 2**22),  # expert parallelism
    ("gpt3-175b", 1024, 2048, 2**21),  # a vocabulary of 50,257: much the runtime refuses
    (SMALL, 16, 24, 24 * 64),  # seq 24: the sequence-parallel split breaks where cp x tp does not divide 24
    (SMALL, 8, 128, 128 * 16),
]


def _sample(problem: tuple, per_side: int, rng: np.random.Generator) -> tuple[plan.Problem, list[int], np.ndarray]:
    model, gpus, seq, tokens = problem
    p = plan.problem(model=model, gpu="h100-sxm", gpus=gpus, seq=seq, global_batch_tokens=tokens)
    cfg, _ = p.enumerate()
    runnable = p.runnable_mask(cfg)
    pick = []
    for side in (runnable, ~runnable):
        idx = np.flatnonzero(side)
        pick += rng.choice(idx, size=min(per_side, idx.size), replace=False).tolist()
    return p, pick, runnable


def test_runtime_accepts_exactly_the_layouts_the_planner_marks_runnable():
    rng = np.random.default_rng(0)
    seen = {True: 0, False: 0}
    for prob in PROBLEMS:
        p, pick, runnable = _sample(prob, 60, rng)
        cfg, _ = p.enumerate()
        tc = train_config(p.model, p.seq, p.global_seqs)
        for i in pick:
            lay = plan.layout_at(cfg, i)
            try:
                check_layout(tc, lay)
                accepted, why = True, None
            except TrainscaleError as e:
                accepted, why = False, str(e)
            assert accepted == bool(runnable[i]), (p.model.name, str(lay), why)
            if not accepted:
                assert why == p.why_not_runnable(lay)  # the same rule, the same sentence
            seen[accepted] += 1
    assert sum(seen.values()) >= 500 and seen[True] >= 250 and seen[False] >= 150, seen


def test_planner_valid_layouts_the_runtime_refuses():
    """The issue's count, before and after (main at 8b7813e, seq 8192, 2^24 tokens a step, software
    'trainscale'): llama3.1-8b on 64 GPUs, 5,010 of 16,620 planner-valid layouts refused (3,825 zero1, 1,185
    tp16/tp32 over 8 KV heads), now 0 of 15,435; llama3.1-70b on 256, 14,244 of 35,502, now 48 of 28,392: 1F1B
    with fewer micro-batches than stages, which torch's Schedule1F1B refuses (the runnable search skips them)."""
    for model, gpus, valid, refused in (("llama3.1-8b", 64, 15_435, 0), ("llama3.1-70b", 256, 28_392, 48)):
        p = plan.problem(model=model, gpu="h100-sxm", gpus=gpus, seq=8192, global_batch_tokens=2**24)
        cfg, _ = p.enumerate()
        ok = rules.check(p.case(cfg), rules.RUNNABLE)
        not_runnable = ~np.logical_and.reduce(list(ok.values()))
        assert (cfg["tp"].size, int(not_runnable.sum())) == (valid, refused)
        assert not (p.model.n_kv_heads % cfg["tp"]).any()  # no tp replicates KV heads
        assert not ok["one_f_one_b_fill"][not_runnable].any()
        assert set(cfg["zero"].tolist()) == {0, 1, 2, 3}  # every ZeRO stage is runnable


def test_ep_beyond_dp_is_planned_and_refused_by_the_runtime_alone():
    """Megatron-Core's rule (ep divides tp x cp x dp, parallel_state.py) in the planner, the runtime's (ep divides
    dp) apart: Mixtral on 64 GPUs plans layouts whose EP group takes TP ranks, marks each not runnable, and the
    runtime's check_layout refuses each with the same sentence."""
    p = plan.problem(model="mixtral-8x7b", gpu="h100-sxm", gpus=64, seq=4096, global_batch_tokens=2**22)
    cfg, _ = p.enumerate()
    beyond = np.flatnonzero(cfg["dp"] % cfg["ep"] != 0)
    assert beyond.size > 0 and ((cfg["tp"] * cfg["cp"] * cfg["dp"])[beyond] % cfg["ep"][beyond] == 0).all()
    ok = rules.check(p.case(cfg), rules.RUNNABLE)
    assert not ok["ep_in_dp"][beyond].any() and not p.runnable_mask({k: a[beyond] for k, a in cfg.items()}).any()
    tc = train_config(p.model, p.seq, p.global_seqs)
    for i in beyond[:: max(1, beyond.size // 20)]:
        lay = plan.layout_at(cfg, int(i))
        with pytest.raises(TrainscaleError) as e:
            check_layout(tc, lay)
        assert str(e.value) == p.why_not_runnable(lay) and "for this runtime" in str(e.value)


def test_runnable_search_offers_only_what_runs():
    p = plan.problem(model="gpt3-175b", gpu="h100-sxm", gpus=1024, seq=2048, global_batch_tokens=2**21, runnable=True)
    s = p.search()
    assert s.n_valid > 0 and rules.holds(p.case(s.cfg), rules.RUNNABLE).all()
    # a vocabulary of 50,257 (odd): no tensor parallelism
    assert set(s.cfg["tp"].tolist()) == {1}
    best = plan.layout_at(s.cfg, s.best()) if s.best() is not None else None
    if best is not None:
        check_layout(train_config(p.model, 2048, 1024), best)
    planned = plan.problem(model="gpt3-175b", gpu="h100-sxm", gpus=1024, seq=2048, global_batch_tokens=2**21).search()
    assert planned.n_valid > s.n_valid


def test_context_parallel_attention_rules_are_known_to_the_runnable_search():
    """What the runtime's context-parallel attention does not compute (a sliding window shorter than the sequence,
    Gemma 2's soft-cap) is a rule, no longer a refusal a rank met after building its model: ``plan --runnable``
    offers no cp > 1 for such a model, where the plain search does."""
    for update in ({"sliding_window": 4096}, {"attn_softcap": 50.0}):
        model = L8.model_copy(update=update)
        kw = {"model": model, "gpu": "h100-sxm", "gpus": 64, "seq": 8192, "global_batch_tokens": 2**24}
        runnable = plan.problem(**kw, runnable=True).search()
        assert runnable.n_valid > 0 and set(runnable.cfg["cp"].tolist()) == {1}, update
        assert (plan.problem(**kw).search().cfg["cp"] > 1).any(), update


def test_documents_apart_is_refused_under_cp_or_pp_only():
    """data.document_mask / chat data: refused under cp or pp (the rule's sentence names the data and the layout
    as written), trained under dp, tp and fsdp."""
    model = ModelSpec(**CUSTOM)
    for documents in ("chat", "document_mask"):
        cfg = train_config(model, 32, 8, documents)
        what = 'chat data (data.format = "chat")' if documents == "chat" else "data.document_mask"
        for lay in map(Layout.parse, ("cp2", "pp2", "dp2,pp2")):
            with pytest.raises(TrainscaleError, match=rf"^{re.escape(what)} .* not under layout {re.escape(str(lay))} "
                               r"\(cp or pp\)$"):
                check_layout(cfg, lay)
        check_layout(cfg, Layout.parse("dp2,tp2"))
    check_layout(train_config(model, 32, 8), Layout.parse("cp2"))


def test_runnable_search_of_a_model_the_runtime_cannot_build_says_so():
    with pytest.raises(TrainscaleError, match="multi-head latent attention"):
        plan.problem(model="deepseek-v3", gpu="h100-sxm", gpus=2048, seq=4096, global_batch_tokens=2**24, runnable=True)


# ----------------------------------------------------------------------------- each rule, its sentence

L8 = load_model("llama3.1-8b")
MIXTRAL = load_model("mixtral-8x7b")
CUSTOM = {"n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 4, "d_ff": 128, "vocab_size": 512,
          "max_seq_len": 64}

# rule -> (model, layout fields, seq, global batch in sequences, GPUs (None: the layout's), words of its sentence)
CASES = {
    "world": (L8, dict(tp=8, dp=4), 8192, 64, 64, "not the 64 asked for; dp8 would fill them"),
    "processes": (L8, dict(tp=20_000, dp=20_000), 8192, 8, None, "asks for 4e+08 processes; at most 100,000,000"),
    "hsdp_divides": (L8, dict(dp=4, hsdp=3, zero=1), 8192, 8, None, "hsdp3 must divide dp4"),
    "hsdp_sharded": (L8, dict(dp=4, hsdp=2, zero=0), 8192, 8, None, "hsdp needs a sharded data-parallel mode"),
    "ep_divides": (MIXTRAL, dict(dp=4, ep=8), 4096, 8, None, "ep8 must divide tp1 x cp1 x dp4 = 4"),
    "ep_in_dp": (MIXTRAL, dict(tp=2, dp=2, ep=4), 4096, 8, None, "ep4 must divide dp2 for this runtime"),
    "mtp": (MIXTRAL.model_copy(update={"mtp_layers": 1}), dict(dp=2), 4096, 8, None,
            "has 1 multi-token-prediction module(s)"),
    "uneven_cut": (L8, dict(pp=4, first=7, last=8), 8192, 8, None, "first7 and last8 leave 17 of 32 layers for 2"),
    "runtime_cut": (L8, dict(pp=4, first=7, last=7), 8192, 8, None, "runtime cuts the pipeline by its own policy"),
    "v_interleaved": (L8, dict(pp=2, v=2, schedule="1f1b"), 8192, 8, None, "v2 (virtual stages) needs the "
                      "interleaved schedule"),
    "schedule_pp": (L8, dict(schedule="gpipe"), 8192, 8, None, "the gpipe schedule needs pp > 1"),
    "mla": (load_model("deepseek-v3"), dict(dp=2), 4096, 8, None, "uses multi-head latent attention"),
    "capacity": (MIXTRAL.model_copy(update={"capacity_factor": 1.25}), dict(dp=2), 4096, 8, None,
                 "has capacity_factor 1.25: the runtime routes dropless only"),
    "experts_dense": (L8, dict(dp=2, ep=2), 8192, 8, None, "needs a mixture-of-experts model, and llama3.1-8b is "
                      "a dense model"),
    "experts": (MIXTRAL, dict(dp=6, ep=3), 4096, 12, None, "ep3 must divide the model's 8 experts; use ep in [1, 2]"),
    "heads": (L8, dict(tp=3), 8192, 8, None,
              "tp3 must divide llama3.1-8b's 32 attention heads; use tp in [1, 2, 4, 8]"),
    "kv_heads": (L8, dict(tp=16), 8192, 8, None, "tp16 must divide llama3.1-8b's 8 KV heads; use tp in [1, 2, 4, 8]"),
    "ffn": (ModelSpec(**{**CUSTOM, "d_ff": 102}), dict(tp=4), 32, 8, None, "MLP width of 102; use tp in [1, 2]"),
    "vocab": (ModelSpec(**{**CUSTOM, "vocab_size": 1001}), dict(tp=2), 32, 8, None, "vocabulary of 1,001"),
    "stages": (L8, dict(pp=16, v=4, schedule="interleaved"), 8192, 64, None, "pp16 x v4 = 64 stages leave a stage "
               "with no layer for the model's 32 layers"),
    "cut": (L8, dict(pp=3), 8192, 8, None, "32 layers do not split over pp3 x v1 = 3 pipeline chunks"),
    "seq": (L8, dict(cp=3), 8192, 8, None, "seq 8,192 does not split into 2 x cp3 = 6 chunks"),
    "cp_window": (ModelSpec(**{**CUSTOM, "sliding_window": 16}), dict(cp=2), 32, 8, None,
                  "does not apply the model's sliding window of 16 tokens, shorter than the sequence (32); use cp1"),
    "cp_softcap": (ModelSpec(**{**CUSTOM, "attn_softcap": 50.0}), dict(cp=2), 32, 8, None,
                   "does not soft-cap or rescale the attention scores as this model's do (Gemma 2); use cp1"),
    "documents": (ModelSpec(**CUSTOM), dict(cp=2), 32, 8, None,
                  'chat data (data.format = "chat") keeps packed documents apart, which this runtime does under '
                  "data, tensor and fully sharded parallelism only"),
    "sp_split": (SMALL, dict(tp=4, cp=4), 24, 8, None, "per-rank sequence (6) divisible by tp4"),
    "batch": (L8, dict(dp=4, mb=3), 8192, 16, None, "16 sequences does not split into dp4 x mb3"),
    "interleave_fill": (L8, dict(pp=4, v=2, schedule="interleaved", mb=4), 8192, 8, None,
                        "needs at least pp4 micro-batches, and dp1 x mb4 leaves 2"),
    "one_f_one_b_fill": (L8, dict(pp=4, mb=4), 8192, 8, None, "1F1B needs at least pp4 micro-batches"),
    "interleave_rounds": (L8, dict(pp=4, v=2, schedule="interleaved"), 8192, 9, None,
                          "runs its 9 micro-batches in 2 rounds, which must divide them"),
}
DEFAULTS = dict(tp=1, cp=1, pp=1, dp=1, mb=1, v=1, schedule="1f1b", zero=0, hsdp=1, ep=1, sp=True, first=0, last=0)
DOCUMENTS = {"documents": "chat"}  # the cases whose data keeps documents apart (the planner does not know the data)


def test_every_rule_has_a_case_and_a_source():
    assert set(CASES) == set(rules.RULES)
    assert all(len(s) > 20 for s in rules.sources(tuple(rules.RULES)).values())
    assert set(rules.RUNNABLE) == set(rules.RULES)
    assert set(rules.PLANNED) | set(rules.RUNTIME_CHECK) == set(rules.RULES)


def _case(name: str) -> tuple[rules.Case, SimpleNamespace, str]:
    model, fields, seq, seqs, gpus, words = CASES[name]
    lay = SimpleNamespace(**{**DEFAULTS, **fields})
    world = lay.tp * lay.cp * lay.pp * lay.dp
    return rules.case_of([lay], model, seq, seqs, gpus or world, DOCUMENTS.get(name, "")), lay, words


@pytest.mark.parametrize("name", list(CASES))
def test_each_rule_says_its_sentence_where_it_applies(name):
    case, lay, words = _case(name)
    ok = rules.check(case, tuple(rules.RULES))
    assert not ok[name][0]
    first = [r for r in rules.RULES if not ok[r][0]][0]
    assert first == name  # the first rule this layout breaks, so every entry point names it
    says = rules.first_broken(case, tuple(rules.RULES))
    assert words in says and "\n" not in says, says
    model, seq, seqs = case.model, case.seq, case.seqs

    def outcome(run):
        try:
            run()
            return None
        except (TrainscaleError, ValueError) as e:
            return str(e)

    # each entry point refuses it with the rule's sentence when the rule is in its set, and otherwise does what
    # the rules of its set say
    if name in rules.LAYOUT:
        assert words in outcome(lambda: Layout(**vars(lay)))
        return
    layout = Layout(**vars(lay))
    # the runtime's world is the layout's own (torchrun starts as many ranks as it asks for)
    own = rules.case_of([layout], model, seq, seqs, layout.world_size, case.documents)
    entries = {rules.RUNTIME_CHECK: (own, lambda: check_layout(train_config(model, seq, seqs, case.documents),
                                                               layout))}
    blind = rules.case_of([lay], model, seq, seqs, case.gpus)  # the planner's: it does not know the data
    for runnable, names in ((False, rules.PLANNED), (True, rules.RUNNABLE)):
        def why(runnable=runnable):
            p = plan.problem(model=model, gpu="h100-sxm", gpus=case.gpus, seq=seq, global_batch_tokens=seqs * seq,
                             runnable=runnable)
            msg = p.why_invalid(layout)
            if msg:
                raise TrainscaleError(msg)
        entries[names] = (case if not case.documents else blind, why)
    for names, (c, run) in entries.items():
        got = outcome(run)
        assert got == rules.first_broken(c, names), names
        if name in names and c is case:
            assert got is not None and words in got, (names, got)


# ----------------------------------------------------------------------------- the rules stand for what they say


def test_stage_rule_is_placements_empty_stages():
    for n_layers, pp, v in itertools.product(range(1, 21), range(1, 9), range(1, 5)):
        lay = Layout(pp=pp, v=v, schedule="interleaved" if v > 1 else "1f1b") if pp > 1 or v == 1 else None
        if lay is None:
            continue
        case = rules.case_of([lay], ModelSpec(**{**CUSTOM, "n_layers": n_layers}))
        assert bool(rules.check(case, ["stages"])["stages"][0]) == (not placement.empty_stages(n_layers, lay))


def test_balanced_cut_is_placements_even_or_llama3_cut():
    p, v = (a.ravel() for a in np.meshgrid(np.arange(1, 17), np.arange(1, 9), indexing="ij"))
    for n_layers in (4, 32, 61, 80, 126):
        c = placement.rank_layer_counts(n_layers, p, v)
        assert (rules.balanced_cut(n_layers, p, p * v) == ((p <= n_layers) & (c["even"] | c["llama3"]))).all()
    # Llama 3 405B: 126 layers on pp16 x v8 (L + 2 = 128 slots) and on pp16 alone, not on pp10
    assert rules.balanced_cut(126, np.array([16, 16, 10]), np.array([128, 16, 10])).tolist() == [True, True, False]


def test_kv_heads_rule_follows_megatron_and_torchtitan():
    """tp must divide the KV heads (Megatron-Core's divide(num_query_groups, tp); torchtitan's n_kv_heads // tp):
    llama3.1-8b (8 KV heads) plans tp 1, 2, 4, 8 on 64 GPUs, never tp16 or tp32 with replicated KV heads."""
    s = plan.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=64, seq=8192, global_batch_tokens=2**24).search()
    assert sorted(set(s.cfg["tp"].tolist())) == [1, 2, 4, 8]


def test_partial_check_skips_what_it_cannot_read_and_full_check_refuses():
    case = rules.Case({"tp": np.array([1, 3])}, model=L8)
    assert rules.holds(case, rules.PLANNED, partial=True).tolist() == [True, False]
    with pytest.raises(ValueError, match="reads"):
        rules.check(case, rules.PLANNED)


# ----------------------------------------------------------------------------- train --plan and plan --runnable


def _gpus_here(monkeypatch, n: int, gpu: str = "h100-sxm") -> None:
    """As if this machine had ``n`` GPUs of catalog kind ``gpu`` (plan_layout reads torch.cuda and the catalog)."""
    import torch

    from trainscale.runtime import measure

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(measure, "gpu_peak_flops", lambda: (989e12, gpu))


def test_train_plan_takes_the_best_runnable_layout(monkeypatch):
    from trainscale.runtime.job.launch import plan_layout

    _gpus_here(monkeypatch, 8)
    cfg = train_config(load_model("mpt-7b").model_copy(update={"vocab_size": 50257}), 2048, 512)  # odd vocab: no tp
    text, why = plan_layout(cfg)
    lay = Layout.parse(text)
    check_layout(cfg, lay)
    s = plan.problem(model=cfg.model, gpu="h100-sxm", gpus=8, seq=2048, global_batch_tokens=512 * 2048,
                     runnable=True).search()
    assert text == str(plan.layout_at(s.cfg, s.best())) and lay.tp == 1
    assert "this runtime trains on 8 x h100-sxm" in why
    # the planner's own best for this model uses a layout the runtime does not train
    best = plan.problem(model=cfg.model, gpu="h100-sxm", gpus=8, seq=2048, global_batch_tokens=512 * 2048).search()
    assert best.n_valid > s.n_valid


def test_train_plan_says_why_nothing_runs_in_one_sentence(monkeypatch):
    from trainscale.runtime.job.launch import plan_layout

    _gpus_here(monkeypatch, 8)
    with pytest.raises(TrainscaleError, match="multi-head latent attention") as e:
        plan_layout(train_config(load_model("deepseek-v3"), 4096, 64))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_plan_cli_runnable_flag(tmp_path):
    import json
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trainscale", "plan", "--model", "gpt3-175b", "--gpus", "1024",
                               "--seq", "2048", "--global-batch-tokens", "2M", *args], capture_output=True, text=True)

    r = run("--runnable", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["inputs"]["runnable_only"] and all(row["runnable"] for row in out["top"])
    assert out["search"]["valid"] == 13920  # of the planner's 68,265: a vocabulary of 50,257 keeps tp1
    r = run("--runnable")
    assert r.returncode == 0 and "only layouts trainscale's runtime trains (--runnable)" in " ".join(r.stdout.split())
    r = run("--layout", "tp8,pp8,dp16,zero1", "--json")
    assert json.loads(r.stdout)["not_runnable_because"].startswith("tp8 must divide gpt3-175b's vocabulary of 50,257")
