"""`trainscale calibrate`: real measurements of this machine (quick mode, tiny shapes), the FLOP counts the
figures divide by, the profile TOML round trip, and the CLI (file written, one-line errors, exit code 2)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from torch import nn

from trainscale.errors import TrainscaleError
from trainscale.estimate.params import layer_tensors
from trainscale.estimate.profile import PROFILE_VERSION
from trainscale.runtime.config import load_config
from trainscale.runtime.model import Block
from trainscale.runtime.probe import calibrate as cal
from trainscale.specs import ModelSpec, load_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelSpec(name="calib-tiny", n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128,
                 max_seq_len=32)
SEQ, MB = 16, 2


def ts(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscale", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def profile() -> dict:
    return cal.calibrate(TINY, SEQ, MB, [2, 1], quick=True)


@pytest.mark.dist
def test_profile_has_every_figure(profile):
    m = profile["machine"]
    assert m["device"] == "cpu" and m["dtype"] == "float32" and m["threads_per_process"] == 1
    assert m["model"] == "calib-tiny" and m["tokens"] == SEQ * MB and m["cores"] >= 1
    assert m["host"] and m["device_name"] and m["torch"] and m["measured_at"]
    assert list(profile["processes"]) == ["1", "2"] and list(profile["collectives"]) == ["2"]
    for fig in profile["processes"].values():
        assert set(fig) == set(cal.COMPUTE_KEYS)
        # at these tiny shapes a layer is nearly all fixed cost, so the two derived parts may be 0
        derived = ("layer_fixed_seconds", "elementwise_seconds_per_token")
        assert all(math.isfinite(x) and (x >= 0 if k in derived else x > 0) for k, x in fig.items())
        # the layer measured at one sequence and at MB: the line through them, its intercept the fixed part;
        # with the kernels at their measured rates and the work between them, the parts add up to the layer
        kernels = cal.layer_kernel_seconds(TINY, MB, SEQ, fig)
        assert fig["layer_fixed_seconds"] == cal.layer_fixed_seconds(fig["layer_seconds"], fig["layer_seconds_one"],
                                                                     MB, kernels)
        parts = kernels + fig["layer_fixed_seconds"] + fig["elementwise_seconds_per_token"] * MB * SEQ
        assert parts == pytest.approx(fig["layer_seconds"], rel=1e-9) or parts > fig["layer_seconds"]
        assert fig["optimizer_bytes_per_param"] == fig["optimizer_seconds_per_param"] * fig["memory_bandwidth"]
    ops = profile["collectives"]["2"]
    assert set(ops) == set(cal.COLLECTIVE_OPS)
    sizes = {str(b) for b in cal.message_sizes(TINY, SEQ * MB, quick=True)}
    for f in ops.values():
        assert set(f["times"]) == sizes
        assert all(math.isfinite(x) and x > 0 for x in (f["latency_s"], f["bus_bandwidth"], f["algbw"]))


@pytest.mark.dist
def test_bus_bandwidth_from_raw_times(profile):
    n = 2
    for op, f in profile["collectives"][str(n)].items():
        times = {int(b): t for b, t in f["times"].items()}
        small, big = min(times), max(times)
        assert f["latency_s"] == times[small]
        alg = (big - small) / (times[big] - times[small]) if times[big] > times[small] else big / times[big]
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
                  "send_recv": 1.0}[op]
        assert f["algbw"] == pytest.approx(alg, rel=1e-12)
        assert f["bus_bandwidth"] == pytest.approx(alg * factor, rel=1e-12)
    assert cal.BUS_FACTOR["all_reduce"](4) == 1.5 and cal.BUS_FACTOR["all_gather"](4) == 0.75


def test_message_sizes_include_activations_and_a_bucket():
    spec = load_config(ROOT / "configs/small.toml").model
    assert cal.message_sizes(spec, 2048) == [4096, 2048 * 256 * 4, 25 * 2**20]


GPT = ModelSpec(n_layers=2, d_model=48, n_heads=6, n_kv_heads=6, d_ff=192, vocab_size=64, max_seq_len=64, mlp="gelu",
                norm="layernorm", bias=True, positions="learned")


@pytest.mark.parametrize("spec", [TINY, load_config(ROOT / "configs/small.toml").model, load_model("llama3.1-8b"), GPT],
                         ids=["tiny", "small", "llama3.1-8b", "gpt-gelu"])
def test_layer_flops_are_six_times_matmul_params(spec):
    weights = [shape for _, shape in layer_tensors(spec, 0) if len(shape) == 2]
    tokens = 2048
    assert cal.layer_matmul_flop_count(spec, tokens) == 6 * sum(math.prod(s) for s in weights) * tokens
    # the shapes are the runtime model's own nn.Linear, in module order (weight is [out, in])
    block = Block(spec)
    linears = [(m.in_features, m.out_features) for m in block.modules() if isinstance(m, nn.Linear)]
    assert cal.layer_linear_shapes(spec) == linears
    assert sorted((n, k) for k, n in linears) == sorted(weights)


def test_attention_flops_count_causal_forward_and_backward():
    b, s = 3, 64
    fwd = 4 * b * TINY.n_heads * s**2 * TINY.head_dim / 2
    assert cal.attention_flop_count(TINY, b, s) == fwd + 2 * fwd


def test_optimizer_tensors_are_layer_shaped():
    spec = load_config(ROOT / "configs/small.toml").model
    shapes = cal.optimizer_shapes(spec, 2_000_000)
    layer = [s for _, s in layer_tensors(spec, 0)]
    assert shapes == layer * 3 and 1.5e6 < sum(math.prod(s) for s in shapes) < 2.5e6
    big = cal.optimizer_shapes(load_model("llama3.1-8b"), 2_000_000)
    assert len(big) == len(layer_tensors(load_model("llama3.1-8b"), 0))
    assert 1.5e6 < sum(math.prod(s) for s in big) < 2.5e6


@pytest.mark.dist
def test_profile_round_trip(profile, tmp_path):
    assert profile["version"] == PROFILE_VERSION  # a profile without one (older) reads as version 1
    odd = {**profile, "machine": {**profile["machine"], "device_name": 'Ryzen "X" \\ 9\tµ\n'}}
    for p in (profile, odd, {"machine": {"device": "cpu"}, "processes": {"1": {"matmul_flops": 1e10}},
                             "collectives": {}}):
        path = cal.write_profile(p, tmp_path / "sub" / "profile.toml")
        assert cal.read_profile(path) == p == tomllib.loads(path.read_text())
    assert path.read_text().startswith("# trainscale hardware profile")
    assert "[processes.1]" in path.read_text()


def test_read_profile_errors(tmp_path):
    (tmp_path / "bad.toml").write_text("machine = [1,\n")
    (tmp_path / "other.toml").write_text("[machine]\ndevice = 'cpu'\n")
    (tmp_path / "newer.toml").write_text(f"version = {PROFILE_VERSION + 1}\n[machine]\n[processes.1]\n")
    (tmp_path / "odd.toml").write_text("version = 'one'\n[machine]\n[processes.1]\n")
    (tmp_path / "nan.toml").write_text("[machine]\n[processes.1]\nlayer_fixed_seconds = nan\n")
    (tmp_path / "neg.toml").write_text("[machine]\n[processes.1]\nmatmul_flops = -1.0\n")
    (tmp_path / "zero.toml").write_text("[machine]\n[processes.2]\n[collectives.2.all_gather]\nbus_bandwidth = 0\n")
    for name, words in (("missing.toml", "does not exist"), ("bad.toml", "not valid TOML"),
                        ("other.toml", "no [processes] table"), ("newer.toml", f"is version {PROFILE_VERSION + 1}"),
                        ("odd.toml", "not a positive integer"),
                        ("nan.toml", "[processes.1] layer_fixed_seconds must be a finite non-negative number, not nan"),
                        ("neg.toml", "[processes.1] matmul_flops must be a finite positive number, not -1.0"),
                        ("zero.toml", "[collectives.2.all_gather] bus_bandwidth must be a finite positive number")):
        with pytest.raises(TrainscaleError, match=words.replace("[", r"\[")) as e:
            cal.read_profile(tmp_path / name)
        assert "\n" not in str(e.value)


def test_default_profile_path(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINSCALE_CACHE", str(tmp_path))
    assert cal.default_profile_path() == tmp_path / "profile.toml"


def test_bad_inputs_to_calibrate():
    for args, words in (((TINY, SEQ, MB, []), "at least one"), ((TINY, SEQ, MB, [0]), "positive"),
                        ((TINY, 0, MB, [1]), "seq_len"), ((TINY, SEQ, -1, [1]), "micro_batch"),
                        ((load_model("llama3.1-405b"), 8192, 64, [4]), "GB per process")):
        with pytest.raises(TrainscaleError, match=words):
            cal.calibrate(*args, quick=True)


@pytest.mark.dist
def test_cli_writes_a_profile(tmp_path):
    out = tmp_path / "p.toml"
    r = ts("calibrate", "--config", "configs/tiny.toml", "--micro-batch", "2", "--processes", "1", "--quick",
           "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "layer GEMMs" in r.stdout and "wrote" in r.stdout
    prof = tomllib.loads(out.read_text())
    assert prof["machine"]["model"] == "tiny-llama" and prof["machine"]["tokens"] == 2 * 32
    assert prof["processes"]["1"]["matmul_flops"] > 0 and prof == cal.read_profile(out)

    model = tmp_path / "m.toml"
    model.write_text("n_layers = 1\nd_model = 32\nn_heads = 2\nn_kv_heads = 1\nd_ff = 64\nvocab_size = 64\n"
                     "max_seq_len = 16\n")
    r = ts("calibrate", "--model", str(model), "--processes", "2", "--quick", "--out", str(tmp_path / "q.toml"),
           "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["path"] == str(tmp_path / "q.toml") and rep["profile"]["machine"]["tokens"] == 16
    assert tomllib.loads((tmp_path / "q.toml").read_text()) == rep["profile"]
    assert set(rep["profile"]["collectives"]["2"]) == set(cal.COLLECTIVE_OPS)


@pytest.mark.slow
def test_cli_errors_are_one_line_exit_2(tmp_path):
    cases = [
        (("--processes", "0"), "at least 1"),
        (("--processes", "a,b"), "comma-separated positive integers"),
        (("--processes", ","), "at least one"),
        (("--seq-len", "0"), "--seq-len must be a positive integer"),
        (("--micro-batch", "0"), "--micro-batch must be a positive integer"),
        (("--model", "no-such-model"), "unknown model"),
        (("--config", str(tmp_path / "none.toml")), "does not exist"),
        (("--config", "configs/tiny.toml", "--model", "llama3.1-8b"), "not both"),
        (("--config", "configs/tiny.toml", "--seq-len", "4096"), "max_seq_len"),
    ]
    for args, words in cases:
        r = ts("calibrate", "--quick", "--out", str(tmp_path / "x.toml"), *args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and words in r.stderr, (args, r.stderr)
    assert not (tmp_path / "x.toml").exists()


def test_layer_fixed_seconds_is_the_intercept():
    # t(b) = fixed + b x per-sequence through t(1) = 3 ms and t(4) = 9 ms: per sequence 2 ms, fixed 1 ms
    assert cal.layer_fixed_seconds(9e-3, 3e-3, 4) == pytest.approx(1e-3)
    assert cal.layer_fixed_seconds(9e-3, 3e-3, 1) == 0.0  # one size measured: no line
    assert cal.layer_fixed_seconds(9e-3, 2e-3, 4) == 0.0  # noise (super-linear) never makes it negative
    assert cal.layer_fixed_seconds(9e-3, 8e-3, 4, kernels=5e-3) == pytest.approx(4e-3)  # at most layer - kernels
    fig = {"layer_seconds": 9e-3, "layer_fixed_seconds": 1e-3, "matmul_flops": 1e12, "attention_flops": 1e12}
    per_token = cal.elementwise_seconds_per_token(TINY, MB, SEQ, fig)
    gemm = cal.layer_matmul_flop_count(TINY, MB * SEQ) / 1e12
    attn = cal.attention_flop_count(TINY, MB, SEQ) / 1e12
    assert per_token * MB * SEQ + gemm + attn + 1e-3 == pytest.approx(9e-3)  # the parts add up to the layer
