"""The data-parallel reduction and weight gather chunk by chunk under the interleaved schedule (software knobs
dp_chunk_sync and dp_chunk_gather, estimate/planner/dp.py chunk_reduce and chunk_gather): the exposed time against a
hand count of the schedule's events (Megatron-Core's interleaved schedule runs the micro-batches in groups of pp per
chunk, the last group's backward through chunks v-1 ... 0; one reduction or gather at a time on the data-parallel
stream), the bytes and bandwidth of the collective counted by hand, and the presets without the knobs unchanged."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from trainscale.estimate.planner import breakdown, dp
from trainscale.estimate.planner import plan as planner
from trainscale.estimate.planner.candidates import candidates
from trainscale.estimate.planner.plan import _cfg
from trainscale.estimate.planner.software import load_software, software_names, with_knobs
from trainscale.estimate.planner.step import step_parts
from trainscale.specs import Layout, load_model

# Llama 3.1 8B on one 8-GPU H100 server: pp2 x v4 (4 layers a chunk), dp4, 8 micro-batches per step
MODEL, GPUS, SEQ, GBT = "llama3.1-8b", 8, 8192, 8192 * 4 * 8
LAYOUT = "tp1,cp1,pp2,dp4,mb1,interleaved,v4,zero1"


def _parts(software, layout: str = LAYOUT):
    p = planner.problem(model=MODEL, gpu="h100-sxm", gpus=GPUS, seq=SEQ, global_batch_tokens=GBT, software=software)
    cfg = _cfg([Layout.parse(layout)])
    return p, cfg, step_parts(p.model, p.gpu, p.topo, p.eff, p.seq, p.global_seqs, cfg, p.software)


def _f(x) -> float:
    return float(np.asarray(x, dtype=float).reshape(-1)[0])


def _windows(s):
    """(forward, backward) one micro-batch runs on the critical stage: the windows dp.dp_parts hides traffic under."""
    return (_f(s.k.n_dense * s.dense.fwd + s.k.n_moe * s.moe.fwd),
            _f(s.k.n_dense * s.dense.bwd + s.k.n_moe * s.moe.bwd + s.st.rc))


def _reduce_by_events(t: float, v: int, pp: int, b_c: float, mode: str, n_b: int) -> float:
    """Walk the first pipeline rank's last micro-batch group: chunk j's last backward ends j x pp chunk-backwards
    (b_c each) before the stage's last (time 0); its reduction (t / v) queues on the one DP stream at that moment,
    or ("during", chunk 0) in n_b buckets, each as its layers' backward ends. Returns what runs past time 0."""
    free = -np.inf
    for j in reversed(range(v)):
        end = -j * pp * b_c
        if mode == "during" and j == 0:
            for i in range(n_b):
                free = max(free, end - b_c + (i + 1) * b_c / n_b) + t / v / n_b
        else:
            free = max(free, end) + t / v
    return max(free, 0.0)


def _gather_by_events(t: float, v: int, pp: int, f_c: float) -> float:
    """Chunks 0 and 1 dispatched at time 0, chunk j+1 when chunk j's first forward starts; chunk j's first forward
    starts pp chunk-forwards (f_c each) after chunk j-1's, or when its gather is done. Returns the delay of the last
    chunk's first forward."""
    done = [t / v, 2 * t / v]  # chunk 1 queued behind chunk 0
    start = [done[0]]
    for j in range(1, v):
        start.append(max(start[-1] + pp * f_c, done[j]))
        if j + 1 < v:
            done.append(max(start[j], done[j]) + t / v)
    return start[-1] - (v - 1) * pp * f_c


@pytest.mark.parametrize("mode", ["after", "during"])
def test_chunk_reduce_is_the_schedules_event_count_on_chosen_numbers(mode):
    m = load_model(MODEL)
    c = candidates(m, _cfg([Layout.parse(LAYOUT)]), SEQ, GBT // SEQ)
    assert (_f(c.ve), _f(c.pp)) == (4, 2)
    # a backward of 4 s per micro-batch on the stage: 1 s a chunk, chunks' gradients final 2 s apart
    # 4 s of reduce-scatter (1 s a chunk) fits in those 2 s: "after" leaves chunk 0's 1 s; "during" the last of
    # its buckets (4 layers a chunk: 4 buckets of 0.25 s, made 0.25 s apart): 0.25 s
    hand = {"after": 1.0, "during": 0.25}[mode]
    assert _f(dp.chunk_reduce(4.0, c, 4.0, 16, mode)) == pytest.approx(hand)
    assert _reduce_by_events(4.0, 4, 2, 1.0, mode, 4) == pytest.approx(hand)
    # 12 s (3 s a chunk) does not: the queue grows 1 s per chunk; chunk 3 starts at -6, chunk 0 ends at 12 - 6 = +6
    assert _f(dp.chunk_reduce(12.0, c, 4.0, 16, mode)) == pytest.approx(6.0)
    assert _reduce_by_events(12.0, 4, 2, 1.0, mode, 4) == pytest.approx(6.0)
    # no overlap at all (dp_overlap 0: a window of 0): the whole reduction is exposed
    assert _f(dp.chunk_reduce(12.0, c, 0.0, 16, mode)) == pytest.approx(12.0)


def test_chunk_gather_is_the_schedules_event_count_on_chosen_numbers():
    m = load_model(MODEL)
    c = candidates(m, _cfg([Layout.parse(LAYOUT)]), SEQ, GBT // SEQ)
    # 8 s of all-gather (2 s a chunk), a forward of 2 s a micro-batch (0.5 s a chunk): chunk 0's 2 s exposed, then
    # each chunk's first micro-batch waits 2 - 2 x 0.5 = 1 s more: 2 + 3 x 1 = 5 s
    assert _f(dp.chunk_gather(8.0, c, 2.0)) == pytest.approx(5.0)
    assert _gather_by_events(8.0, 4, 2, 0.5) == pytest.approx(5.0)
    # a forward long enough (8 s: 4 s between chunks) hides all but chunk 0's
    assert _f(dp.chunk_gather(8.0, c, 8.0)) == pytest.approx(2.0)
    assert _gather_by_events(8.0, 4, 2, 2.0) == pytest.approx(2.0)


@pytest.mark.parametrize("software", ["nemo", "mlperf-nemo-gpt3-v31", "mlperf-nemo-gpt3-v40", "mlperf-nemo-gpt3-v41",
                                      "megatron-core"])
def test_planner_exposes_what_the_schedule_leaves_of_bytes_over_bandwidth(software):
    sw = load_software(software)
    p, _, s = _parts(sw)
    # the critical stage is the last (16 layers of 218,112,000 parameters, the 128,256 x 4,096 output head and the
    # final norm's 4,096), whole on each of the dp4 ranks (tp1)
    p_crit = 16 * 218_112_000 + 128_256 * 4_096 + 4_096
    assert _f(s.params.crit) == p_crit
    # the ZeRO-1 reduce-scatter over dp4 inside one NVLink server: a ring, (n-1)/n of the bytes at the bus bandwidth
    # plus n-1 latency steps (NCCL-tests); the bytes the preset reduces in (bf16: nemo, mlperf; fp32: megatron-core)
    topo = p.topo
    bw, lat = topo.scale_up_bandwidth * topo.scale_up_efficiency, topo.scale_up_latency_s
    rs = 3 / 4 * sw.grad_reduce_bytes * p_crit / bw + 3 * lat
    # the weights gathered back: bf16, or (mlperf v4.0 / v4.1: FP8_PARAMS=True) the decoder layers' GEMM weights in
    # FP8, 1 byte each (wq, wo 4,096 x 4,096, wk, wv 1,024 x 4,096, w1, w3 14,336 x 4,096, w2 4,096 x 14,336 =
    # 218,103,808 of the layer's 218,112,000; the two norms' 4,096 gains and the output head stay bf16)
    fp8 = 16 * 218_103_808 if sw.fp8_weights else 0
    assert sw.fp8_weights == (software in ("mlperf-nemo-gpt3-v40", "mlperf-nemo-gpt3-v41"))
    assert _f(s.params.gather_bytes) == 2 * p_crit - fp8
    ag = 3 / 4 * (2 * p_crit - fp8) / bw + 3 * lat
    part = s.dp_parts
    assert _f(part["rs"].total) == pytest.approx(rs, rel=1e-12)
    assert _f(part["ag"].total) == pytest.approx(ag, rel=1e-12)
    # what of it the compute hides: the events of the schedule, 4 chunks of 4 layers (buckets: one per layer)
    win_f, win_b = _windows(s)
    exp_rs = _reduce_by_events(rs, 4, 2, win_b / 4, sw.dp_chunk_sync, 4)
    exp_ag = _gather_by_events(ag, 4, 2, win_f / 4)
    assert _f(part["rs"].exposed) == pytest.approx(exp_rs, rel=1e-9)
    assert _f(part["ag"].exposed) == pytest.approx(exp_ag, rel=1e-9)
    assert 0 < exp_rs < rs and 0 < exp_ag < ag
    # --explain-step shows the same and its items still add up to the step
    bd = breakdown.explain_layout(p, Layout.parse(LAYOUT))
    assert bd.total_s == pytest.approx(_f(s.step), rel=1e-9)
    rs_item = bd.item("DP reduce-scatter, gradients")
    assert rs_item.exposed_s == pytest.approx(exp_rs, rel=1e-9)
    assert f"each reduced {sw.dp_chunk_sync} its last backward" in rs_item.note
    assert "gathered one chunk ahead" in bd.item("DP all-gather, weights").note


def test_presets_without_the_knobs_keep_the_stage_wide_overlap():
    knobbed = {"megatron-core": ("after", True), "nemo": ("during", True), "mlperf-nemo-gpt3-v31": ("after", True),
               "mlperf-nemo-gpt3-v40": ("after", True), "mlperf-nemo-gpt3-v41": ("after", True),
               "mlperf-nemo-llama31-tp4": ("during", True), "mlperf-nemo-llama31-tp8": ("during", True)}
    for name in software_names():
        sw = load_software(name)
        assert (sw.dp_chunk_sync, sw.dp_chunk_gather) == knobbed.get(name, ("none", False)), name
        if name in knobbed:
            assert "schedules.py" in sw.sources["dp_chunk_sync"] + sw.sources["dp_chunk_gather"]
            assert sw.sources["dp_chunk_sync"] and sw.sources["dp_chunk_gather"]
    # without them an interleaved layout hides the stage's whole reduction under one micro-batch's backward, one
    # layer's bucket left (and the gather under its forward): the model every preset had before the knobs
    for sw in (load_software("trainscale"), with_knobs(load_software("nemo"), dp_chunk_sync="none",
                                                       dp_chunk_gather=False)):
        _, _, s = _parts(sw)
        win_f, win_b = _windows(s)
        rs, ag, n = _f(s.dp_parts["rs"].total), _f(s.dp_parts["ag"].total), 16
        assert _f(s.dp_parts["rs"].exposed) == pytest.approx(max(rs / n, rs - sw.dp_overlap * win_b), rel=1e-12)
        assert _f(s.dp_parts["ag"].exposed) == pytest.approx(max(ag / n, ag - sw.dp_overlap * win_f), rel=1e-12)
    # and the knobs belong to the interleaved schedule: under 1F1B (one chunk) they change nothing
    one = "tp1,cp1,pp2,dp4,mb1,1f1b,zero1"
    nemo = load_software("nemo")
    on = _parts(nemo, one)[2]
    off = _parts(replace(nemo, dp_chunk_sync="none", dp_chunk_gather=False), one)[2]
    assert _f(on.step) == _f(off.step)
    # ...while under interleaving they do, and only the DP part of the step moves
    on_v, off_v = _parts(nemo)[2], _parts(replace(nemo, dp_chunk_sync="none", dp_chunk_gather=False))[2]
    assert _f(on_v.step) != _f(off_v.step)
    assert _f(on_v.step - on_v.dp_x) == pytest.approx(_f(off_v.step - off_v.dp_x), rel=1e-12)


def test_mlperf_gpt3_rounds_keep_what_each_ran():
    """The three MLPerf GPT-3 rounds' facts (catalog/software.toml, each from that round's mlcommons files): v3.1's
    TE @09ba842 runs flash-attn 2.0.8 first, v4.0's TE v1.6rc1 and later pick cuDNN on sm90; FP8_PARAMS from v4.0."""
    v31, v40, v41 = (load_software(f"mlperf-nemo-gpt3-v{r}") for r in (31, 40, 41))
    assert (v31.attention_kernel, v40.attention_kernel, v41.attention_kernel) == ("fa2", "cudnn", "cudnn")
    assert (v31.fp8_weights, v40.fp8_weights, v41.fp8_weights) == (False, True, True)
    assert (v31.optimizer_state_bytes, v40.optimizer_state_bytes) == (10.0, 12.0)  # store_param_remainders vs FP8
    assert "09ba842" in v31.sources["attention_kernel"] and "v1.6rc1" in v40.sources["attention_kernel"]
    # FP8 weights need an fp8 run (NeMo: cfg.fp8 and cfg.fp8_params): a bf16 plan of the v4.1 preset gathers bf16
    p = planner.problem(model=MODEL, gpu="h100-sxm", gpus=GPUS, seq=SEQ, global_batch_tokens=GBT,
                        software="mlperf-nemo-gpt3-v41", precision="bf16")
    assert not p.software.fp8_weights
    s = step_parts(p.model, p.gpu, p.topo, p.eff, p.seq, p.global_seqs, _cfg([Layout.parse(LAYOUT)]), p.software)
    assert _f(s.params.gather_bytes) == 2 * _f(s.params.crit)
