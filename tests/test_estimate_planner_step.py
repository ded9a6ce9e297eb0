"""The planner's step model as the composition of its named parts (estimate/planner/: candidates, layer, moe,
stages, dp, stage_memory, step): the codes are the specs literals, the step and the memory are the sums of the parts
``evaluate`` reports, and the parameters per GPU add up to the model's published count.

Published counts: Llama 3.1 8B 8,030,261,248 parameters (the safetensors of meta-llama/Llama-3.1-8B);
Mixtral 8x7B 46.7B total (arXiv 2401.04088 Sec. 2.1). That every output array of ``evaluate`` stayed the same
through the split is benchmarks/step_parity.py's job (record before, compare after).
"""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest

from trainscale.estimate.memory import GRAD_BYTES
from trainscale.estimate.params import expert_tensors, numel, param_count
from trainscale.estimate.planner import plan, stages, step
from trainscale.estimate.planner.candidates import (
    FULL,
    GPIPE,
    INTERLEAVED,
    NO_RECOMPUTE,
    ONE_F_ONE_B,
    RECOMPUTE,
    SCHEDULE,
    SELECTIVE,
    candidates,
)
from trainscale.estimate.planner.software import load_software
from trainscale.specs import Layout, Recompute, Schedule

STEP_PARTS = ("t_compute", "t_recompute", "t_tp_comm", "t_cp_comm", "t_ep_comm", "t_bubble", "t_pp_p2p", "t_dp_comm",
              "t_optimizer")
MEM_PARTS = ("mem_weights", "mem_gradients", "mem_optimizer", "mem_activations", "mem_buffers")


def cfg_of(*layouts: str) -> dict[str, np.ndarray]:
    lays = [Layout.parse(s) for s in layouts]
    cfg = {k: np.array([getattr(x, k) for x in lays]) for k in ("tp", "cp", "pp", "dp", "mb", "v", "zero", "hsdp",
                                                                   "ep", "sp")}
    cfg["schedule"] = np.array([SCHEDULE.index(x.schedule) for x in lays])
    cfg["recompute"] = np.array([RECOMPUTE.index(x.recompute) for x in lays])
    return cfg


def run(model: str, gpus: int, layouts: tuple[str, ...], software: str = "trainscale", seq: int = 8192,
        batch: int = 2**22) -> dict[str, np.ndarray]:
    p = plan.problem(model=model, gpu="h100-sxm", gpus=gpus, seq=seq, global_batch_tokens=batch, software=software)
    return step.evaluate(p.model, p.gpu, p.topo, p.eff, p.seq, p.global_seqs, cfg_of(*layouts), p.software)


def test_codes_are_the_specs_literals():
    assert SCHEDULE == get_args(Schedule) and RECOMPUTE == get_args(Recompute)
    assert (SCHEDULE[GPIPE], SCHEDULE[ONE_F_ONE_B], SCHEDULE[INTERLEAVED]) == ("gpipe", "1f1b", "interleaved")
    assert (RECOMPUTE[NO_RECOMPUTE], RECOMPUTE[SELECTIVE], RECOMPUTE[FULL]) == ("none", "selective", "full")
    assert plan.SCHEDULE is SCHEDULE and plan.RECOMPUTE is RECOMPUTE  # what plan.py imports


DENSE = ("tp8,pp4,dp2,mb1,v2,interleaved,zero1,rc=selective", "tp4,cp2,pp2,dp8,mb2,gpipe,zero3,rc=full",
         "tp2,dp32,mb4,zero2,nosp", "tp8,pp8,dp1,mb1,1f1b,zero0", "tp1,dp64,mb1,hsdp4,zero3")
MOE = ("tp1,dp64,ep8,mb1,zero1", "tp2,pp4,dp8,ep8,mb1,v2,interleaved,zero1,rc=full", "tp4,pp2,dp8,ep4,mb2,zero3")


@pytest.mark.parametrize("model,layouts,software", [
    ("llama3.1-8b", DENSE, "trainscale"), ("llama3.1-8b", DENSE, "megatron-lm-2021"),
    ("mixtral-8x7b", MOE, "trainscale"), ("mixtral-8x7b", MOE, "deepseek-v3")])
def test_step_and_memory_are_the_sums_of_their_parts(model, layouts, software):
    r = run(model, 64, layouts, software)
    assert r["step_time_s"] == pytest.approx(sum(r[k] for k in STEP_PARTS), rel=1e-12)
    assert r["mem_total"] == pytest.approx(sum(r[k] for k in MEM_PARTS), rel=1e-12)
    assert np.all(np.array([r[k] for k in STEP_PARTS]) >= 0)


def test_one_gpu_has_no_traffic_and_holds_the_whole_model():
    p = plan.problem(model="llama3.1-8b", gpu="h100-sxm", gpus=1, seq=8192, global_batch_tokens=2**17)
    r = step.evaluate(p.model, p.gpu, p.topo, p.eff, p.seq, p.global_seqs, cfg_of("tp1,dp1,mb1", "tp1,dp1,mb2"))
    for k in ("t_tp_comm", "t_cp_comm", "t_ep_comm", "t_bubble", "t_pp_p2p", "t_dp_comm"):
        assert np.all(r[k] == 0), k
    assert np.all(r["params_per_gpu"] == 8_030_261_248)
    sw = p.software
    hbm = p.gpu.hbm_bandwidth * p.eff.hbm_efficiency
    assert r["t_optimizer"] == pytest.approx(
        (p.eff.optimizer_bytes_per_param + sw.grad_bytes - GRAD_BYTES) * 8_030_261_248 / hbm, rel=1e-12)


def test_parameters_per_gpu_add_up_to_the_model():
    assert run("llama3.1-8b", 8, ("tp8,dp1,mb1",), batch=2**16)["params_per_gpu"][0] * 8 == \
        pytest.approx(8_030_261_248, rel=1e-12)
    m = plan.problem(model="mixtral-8x7b", gpu="h100-sxm", gpus=8, seq=4096, global_batch_tokens=2**16).model
    total, experts = param_count(m), sum(numel(expert_tensors(m, i)) for i in range(m.n_layers))
    assert total == pytest.approx(46.7e9, rel=1e-3)
    r = run("mixtral-8x7b", 8, ("tp1,dp8,ep1,mb1", "tp1,dp8,ep8,mb1", "tp8,dp1,ep1,mb1"), batch=2**16)
    assert r["params_per_gpu"] == pytest.approx([total, total - experts + experts / 8,
                                                 (total - experts) / 8 + experts], rel=1e-12)


def test_dualpipe_holds_every_stage_twice():
    """DeepSeek-V3 Table 2: DualPipe's parameters per rank are 2x those of a one-directional pipeline."""
    lay = ("tp1,pp4,dp16,ep8,mb1,zero1",)
    p = plan.problem(model="mixtral-8x7b", gpu="h100-sxm", gpus=64, seq=4096, global_batch_tokens=2**22,
                     software="deepseek-v3")
    c = candidates(p.model, cfg_of(*lay), p.seq, p.global_seqs)
    d = stages.dense_layers(p.model, c)
    one_way = stages.stage_params(p.model, c, d, load_software("trainscale"))
    dual = stages.stage_params(p.model, c, d, p.software)
    # DualPipe pairs stage r with stage pp-1-r (DeepSeek-V3 Sec. 2.2, Fig. 5): the heaviest pair is the first and
    # last stage, holding the embedding and the head + final norm, one d_model-wide norm less than twice the last
    assert dual.crit == 2 * one_way.crit - p.model.d_model and dual.e_crit == pytest.approx(2 * one_way.e_crit)


def test_recomputation_trades_time_for_memory():
    r = run("llama3.1-8b", 64, ("tp8,pp2,dp4,mb1", "tp8,pp2,dp4,mb1,rc=selective", "tp8,pp2,dp4,mb1,rc=full"))
    assert r["t_recompute"][0] == 0 < r["t_recompute"][1] < r["t_recompute"][2]
    assert r["mem_activations"][0] >= r["mem_activations"][1] > r["mem_activations"][2]
    # HFU / MFU = 1 + recomputed FLOPs / model FLOPs, whatever the speed: full recompute redoes more than selective
    hm = r["hfu"] / r["mfu"]
    assert hm[0] == pytest.approx(1.0, rel=1e-12) and hm[2] > hm[1] > 1
