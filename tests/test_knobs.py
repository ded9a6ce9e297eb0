"""Every planner knob (catalog/planner.toml, --profile, --set) and every software knob (catalog/software.toml,
--software FILE) goes through one strict schema per file kind (issue 23); numbers in layout
strings and --fix are bounded before conversion. Bad values reach the real CLI (in this process) and must end
with exit 2 and one sentence naming the knob and what it allows; good values still plan."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from trainscale.cli import main
from trainscale.errors import TrainscaleError
from trainscale.estimate.planner.efficiencies import (
    KNOB_RANGES,
    PlannerSettings,
    check_section,
    check_settings,
    load_efficiencies,
)
from trainscale.estimate.planner.plan import parse_fix
from trainscale.estimate.planner.software import KNOB_ALLOWED, SoftwareKnobs, check_knobs, load_software
from trainscale.specs import Layout

BASE = ["plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--layout", "tp8", "--seq", "4096"]
BIG = "1" * 5000


def cli(*args: str) -> tuple[int, str, str]:
    """`trainscale ARGS` in this process -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["trainscale", *args])
        mp.setenv("COLUMNS", "200")
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def refused(*args: str) -> str:
    """The CLI refuses ARGS as bad input: exit 2, one line, not the crash net; returns that line."""
    code, _, err = cli(*args)
    assert code == 2, (args, code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "unexpected" not in err and "please report it" not in err, err
    return lines[0]


def planned(*args: str) -> dict:
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    return json.loads(out)


# ---- planner settings: --set ----

@pytest.mark.parametrize("pair, knob, allowed", [
    ("launch_gap_s=nan", "launch_gap_s", "(0, 1]"),
    ("launch_gap_s=inf", "launch_gap_s", "(0, 1]"),
    ("launch_gap_s=-inf", "launch_gap_s", "(0, 1]"),
    ("memory_reserve_bytes=-1e30", "memory_reserve_bytes", "[0, 1e+12]"),
    ("cp_overlap=5", "cp_overlap", "[0, 1]"),
    ("p2p_overlap=-0.1", "p2p_overlap", "[0, 1]"),
    ("optimizer_bytes_per_param=-16", "optimizer_bytes_per_param", "(0, 1000]"),
    ("attention_seq_half=0", "attention_seq_half", "(0, 16777216]"),
    ("matmul_efficiency=0", "matmul_efficiency", "(0, 1]"),
    ("hbm_efficiency=1.5", "hbm_efficiency", "(0, 1]"),
    ("scale_up_latency_s=0", "scale_up_latency_s", "(0, 1]"),
    ("fa_triton_speed=0", "fa_triton_speed", "(0, 4]"),
    ("fa_triton_speed=5", "fa_triton_speed", "(0, 4]"),
    ("moe_imbalance=0.5", "moe_imbalance", "[1, 1000]"),
    (f"network_bus_efficiency={BIG}", "network_bus_efficiency", "(0, 1]"),  # 5000 digits read as inf
])
def test_set_out_of_range_is_refused_naming_knob_and_range(pair: str, knob: str, allowed: str) -> None:
    line = refused(*BASE, "--set", pair)
    assert f"planner setting {knob} (set on the command line)" in line
    assert allowed in line


def test_set_inf_no_longer_reaches_the_search() -> None:
    """Issue 23: `--set launch_gap_s=inf` in a search raised ZeroDivisionError (the crash net)."""
    line = refused("plan", "--model", "llama3.1-8b", "--gpus", "8", "--set", "launch_gap_s=inf")
    assert "launch_gap_s" in line


@pytest.mark.parametrize("pair", ["launch_gap_s=abc", "nokey=1", "launch_gap_s"])
def test_set_malformed_is_refused(pair: str) -> None:
    refused(*BASE, "--set", pair)


def test_set_good_values_change_the_plan() -> None:
    """A valid override is applied: a reserve of 10 GB takes exactly 10e9 from the 81,082 MiB torch reports on an
    H100 (catalog/gpus.toml usable_bytes), in place of the catalog's 689,700,864-byte reserve (planner.toml)."""
    base = planned(*BASE)
    res = planned(*BASE, "--set", "memory_reserve_bytes=1e10", "--set", "launch_gap_s=5e-6",
                  "--set", "cp_overlap=0.5")
    assert base["memory_capacity_bytes"] == 81_082 * 2**20 - 689_700_864
    assert res["memory_capacity_bytes"] == 81_082 * 2**20 - 1e10
    assert res["efficiencies"]["launch_gap_s"] == 5e-6
    assert res["efficiency_sources"]["cp_overlap"] == "set on the command line"


# ---- planner settings: --profile (flat profile of planner keys) ----

@pytest.mark.parametrize("line, knob", [
    ('launch_gap_s = "4e-6"', "launch_gap_s"),  # a string: strict types
    ("moe_imbalance = true", "moe_imbalance"),  # a bool is not a number
    ("cp_overlap = nan", "cp_overlap"),
    ("memory_reserve_bytes = -1e30", "memory_reserve_bytes"),
    ("optimizer_bytes_per_param = -16", "optimizer_bytes_per_param"),
    ("attention_seq_half = 0", "attention_seq_half"),
    ("scale_up_latency_s = inf", "scale_up_latency_s"),
])
def test_profile_bad_knob_is_refused(tmp_path: Path, line: str, knob: str) -> None:
    prof = tmp_path / "prof.toml"
    prof.write_text(line + "\n")
    msg = refused(*BASE, "--profile", str(prof))
    assert f"planner setting {knob} (profile {prof})" in msg


def test_profile_good_knob_is_applied(tmp_path: Path) -> None:
    prof = tmp_path / "prof.toml"
    prof.write_text("optimizer_bytes_per_param = 30\nhbm_efficiency = 0.9\n")
    res = planned(*BASE, "--profile", str(prof))
    assert res["efficiencies"]["optimizer_bytes_per_param"] == 30.0
    assert res["efficiencies"]["hbm_efficiency"] == 0.9


# ---- the planner catalog is valid against its own schema ----

def _planner_toml() -> dict:
    return tomllib.loads(resources.files("trainscale.catalog").joinpath("planner.toml").read_text())


def test_every_planner_catalog_table_passes_its_schema() -> None:
    cat = _planner_toml()
    defaults = {k: cat["defaults"][k] for k in KNOB_RANGES}
    check_settings(defaults, "catalog")
    tables = {"defaults": cat["defaults"], **{f"generation.{g}": t for g, t in cat["generation"].items()},
              **{f"gpu.{g}": t for g, t in cat.get("gpu", {}).items()}}
    for name, table in tables.items():
        check_section(table, name)
        knobs = {k: v for k, v in table.items() if k in KNOB_RANGES}
        PlannerSettings(**{**defaults, **knobs})  # the settings that generation/GPU plans at
    assert set(KNOB_RANGES) == {k for k in cat["defaults"] if not k.endswith("_source")}
    # published values read through the schema unchanged: H100 BF16 MAMF 792.1 / 989 (ml-engineering table)
    assert load_efficiencies("h100-sxm").matmul_efficiency == 0.801


def test_planner_schema_refuses_an_unknown_or_mistyped_catalog_key() -> None:
    with pytest.raises(TrainscaleError, match="planner setting matmul_efficency .* is unknown"):
        check_section({"matmul_efficency": 0.8}, "x")
    with pytest.raises(TrainscaleError, match="planner setting hbm_efficiency_source .* must be a string"):
        check_section({"hbm_efficiency_source": 3}, "x")
    with pytest.raises(TrainscaleError, match=r"hbm_efficiency \(x\) is .* \(0, 1\], not 0"):
        check_section({"hbm_efficiency": 0}, "x")


# ---- software knobs: --software FILE ----

def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return repr(v)


def software_file(tmp_path: Path, **changes: object) -> Path:
    """The 'trainscale' preset's knobs as a TOML file, with ``changes``."""
    knobs = {**load_software("trainscale").as_dict(), **changes}
    knobs.pop("name")
    knobs.pop("source")
    path = tmp_path / "sw.toml"
    path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in knobs.items()))
    return path


@pytest.mark.parametrize("knob, value", [
    ("dp_overlap", float("nan")), ("tp_overlap", 5.0), ("a2a_overlap", -0.5),
    ("dp_overlap", "0.5"),  # a string where a number belongs (issue 23: TypeError)
    ("elementwise_passes", "60"), ("elementwise_passes", -1.0), ("mlp_act_passes", float("inf")),
    ("microbatch_overhead_s", 0.0), ("microbatch_overhead_s", float("inf")), ("microbatch_overhead_s", -1e-4),
    ("attention_speed", 0.0), ("attention_speed", float("nan")),
    ("grad_bytes", 3), ("grad_bytes", "4"), ("grad_bytes", True), ("grad_reduce_bytes", 2.0),
    ("attention", "fast"), ("precision", "fp4"), ("pipeline", "zb"),
    ("attention_kernel", "fa9"), ("attention_kernel", 2),
    ("zero", []), ("zero", [4]), ("zero", ["3"]), ("zero", [1.0]), ("zero", [True]),
    ("schedules", ["zb-v"]), ("schedules", []),
    ("selective_gemms", ["wx"]), ("selective_gemms", "wk"),
    ("cp", "yes"), ("cp", 1), ("max_v", 0), ("max_v", 8.0), ("max_v", True),
    ("moe_node_limit", -1), ("comm_sms", 1.5), ("comm_sms", 5000),
    ("linear_act_bytes", 0.1), ("attn_out_act_bytes", "2"), ("recompute_norms", "false"),
    ("microbatch_grad_bytes", -1.0), ("microbatch_grad_bytes", "18"), ("microbatch_shard_bytes", 300.0),
    ("dp_chunk_sync", "before"), ("dp_chunk_sync", True), ("dp_chunk_gather", "yes"),
    ("recompute_attention_core", "no"), ("recompute_attention_core", 0),
    ("fp8_weights", "yes"), ("fp8_weights", 1), ("fp8_weights", float("nan")),
])
def test_software_file_bad_knob_is_refused(tmp_path: Path, knob: str, value: object) -> None:
    path = software_file(tmp_path, **{knob: value})
    line = refused(*BASE, "--software", str(path))
    assert f"software file {path}: {knob} must be {KNOB_ALLOWED[knob]}" in line


def test_software_file_good_values_are_used(tmp_path: Path) -> None:
    path = software_file(tmp_path, tp_overlap=0.5, elementwise_passes=30, zero=[1, 3], max_v=4)
    sw = load_software(str(path))
    assert (sw.tp_overlap, sw.elementwise_passes, sw.zero, sw.max_v) == (0.5, 30, (1, 3), 4)
    res = planned(*BASE, "--software", str(path))
    assert res["software"]["tp_overlap"] == 0.5


def test_every_software_preset_passes_its_schema() -> None:
    cat = tomllib.loads(resources.files("trainscale.catalog").joinpath("software.toml").read_text())
    assert len(cat) >= 10
    for name, data in cat.items():
        sw = load_software(name)  # every knob through check_knobs
        knobs = {k: v for k, v in sw.as_dict().items() if k not in ("name", "source")}
        assert set(knobs) == set(SoftwareKnobs.model_fields) == set(KNOB_ALLOWED)
        for k, v in data.items():  # what the preset wrote is what the planner runs at
            if k in knobs:
                assert knobs[k] == v, (name, k)
        check_knobs(knobs, name)
    assert load_software("deepseek-v3").linear_act_bytes == 1 + 4 / 128  # DeepSeek-V3 Sec. 3.3.3: FP8 + scale


# ---- numbers in layout strings and --fix/--forbid ----

@pytest.mark.parametrize("layout", [f"tp{BIG}", f"dp{BIG},tp8", f"fsdp{BIG}", "pp1234567", "tp١", "tp٨"])
def test_layout_numbers_bounded_before_conversion(layout: str) -> None:
    line = refused(*BASE[:-4], "--layout", layout)
    assert "layout token" in line
    with pytest.raises(TrainscaleError, match="more than 6 digits|not understood"):
        Layout.parse(layout)


def test_layout_six_digit_numbers_still_parse() -> None:
    assert Layout.parse("tp8,dp999999").dp == 999999
    assert Layout.parse("tp000008").tp == 8


@pytest.mark.parametrize("fix, expect", [
    ("tp=8,tp=4", "sets tp twice"), ("tp=8,tp=8", "sets tp twice"), ("rc=full,recompute=none", "recompute twice"),
    (f"tp={BIG}", "at most 6 digits"), ("pp=1234567", "at most 6 digits"), ("tp=+8", "at most 6 digits"),
    ("tp=1_0", "at most 6 digits"), ("tp=٨", "at most 6 digits"), ("dp=", "at most 6 digits"),
])
def test_fix_refused(fix: str, expect: str) -> None:
    line = refused("plan", "--model", "llama3.1-8b", "--gpus", "8", "--fix", fix)
    assert expect in line
    assert BIG not in line  # the user's 5000 digits are not echoed back


def test_forbid_long_token_is_clipped() -> None:
    line = refused("plan", "--model", "llama3.1-8b", "--gpus", "8", "--forbid", "x" * 5000)
    assert len(line) < 400


def test_fix_good_values() -> None:
    assert parse_fix("tp=8,pp=16,schedule=interleaved,rc=full") == {"tp": 8, "pp": 16, "schedule": 2,
                                                                      "recompute": 2}
    res = planned("plan", "--model", "llama3.1-8b", "--gpus", "8", "--fix", "tp=8")
    assert res["layout"].startswith("tp8,")


@pytest.mark.parametrize("args", [
    ["plan", "--model", "llama3.1-8b", "--gpus", "8", "--software", "{fifo}"],
    ["plan", "--model", "llama3.1-8b", "--gpus", "8", "--profile", "{fifo}"],
    ["validate", "--runs", "{fifo}"],
])
def test_a_fifo_given_as_a_planner_file_is_refused_not_read(tmp_path: Path, args: list[str]) -> None:
    """Issue 23: a FIFO given as --software / --profile / --runs hung (an open() that waits for a writer); the safe
    opener refuses anything but a regular file before opening it."""
    fifo = tmp_path / "knobs.toml"
    os.mkfifo(fifo)
    msg = refused(*[a.format(fifo=fifo) for a in args])
    assert "not a regular file" in msg


def test_fp16_keeps_the_gradients_the_framework_keeps_in_fp16() -> None:
    """#20 item 2: gradient dtype follows the run's precision. Megatron-LM forces fp32 gradient accumulation and
    all-reduce for bf16 only (megatron/arguments.py: "bfloat16 requires gradient accumulation and all-reduce to be
    done in fp32"; --accumulate-allreduce-grads-in-fp32 is off by default), so an fp16 run keeps 2-byte gradients
    and all-reduces 2 bytes per element; a framework without the knob keeps its grad_bytes in fp16 too."""
    from trainscale.estimate.planner.plan import problem

    kw = dict(model="gpt3-175b", gpu="a100-sxm-80gb", gpus=1024, seq=2048, global_batch_tokens=1536 * 2048,
              software="megatron-lm-2021")
    bf16, fp16 = problem(**kw, precision="bf16"), problem(**kw, precision="fp16")
    assert (bf16.software.grad_bytes, bf16.software.grad_reduce_bytes) == (4, 4)
    assert (fp16.software.grad_bytes, fp16.software.grad_reduce_bytes) == (2, 2)
    assert (fp16.software.state_bytes_per_param, bf16.software.state_bytes_per_param) == (16, 18)  # ZeRO Sec. 3.1
    titan = problem(**{**kw, "software": "torchtitan"}, precision="fp16").software
    assert (titan.grad_bytes, titan.grad_reduce_bytes) == (4, 4)  # no fp16_* knobs: as its preset says
    # the same layout, same GEMM rate: the fp16 run moves half the gradient bytes after the flush (dp_overlap 0)
    lay = Layout.parse("tp8,pp8,dp16,mb1,rc=full")
    a, b = bf16.evaluate_layout(lay), fp16.evaluate_layout(lay)
    assert b["step_time_s"] < a["step_time_s"]
    with pytest.raises(TrainscaleError, match="fp16_grad_bytes must be 0"):
        check_knobs({**load_software("megatron-lm-2021").as_dict(), "fp16_grad_bytes": 3}, "'x'")
