"""Every sub-command under property-based fuzzing ends in exit 0, or 2 / 1 with one line on stderr, never a traceback
(in-process: trainscale.cli.main with sys.argv; issue 16).

Layout strings, config TOML files, Hugging Face config.json files, model folders whose files lie,
numeric flags (negative, zero, NaN, inf, 1e400, 20-digit) and paths (missing, FIFO, device, folder
instead of file, file instead of folder, /proc, an output inside its own input) go to every
sub-command. Each case must end with exit 0, or exit 2 (bad input) / 1 (failed job) and exactly one
line on stderr — never a traceback, never an "unexpected" error, never longer than LIMIT_S seconds.
The cases run per sub-command are printed at the end (pytest -s) and asserted."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from trainscale.cli import app, main

# one fuzz campaign (its last test counts the cases of the others): make test runs it, make test-fast does not
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
LIMIT_S = 20.0
CASES: collections.Counter[str] = collections.Counter()
SLOW: list[tuple[float, list[str]]] = []
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None, print_blob=False,
                phases=[Phase.explicit, Phase.generate],  # no shrinking: the first failing case is shown as is
                suppress_health_check=list(HealthCheck))


class Hang(Exception):
    pass


HUNG: list[bool] = []


def _alarm(_sig, _frame):
    HUNG.append(True)
    raise Hang()


def cli(*args: str) -> tuple[int, str, str]:
    """Run `trainscale ARGS` in this process -> (exit code, stdout, stderr); asserts the promise."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    t0 = time.perf_counter()
    code = 0
    HUNG.clear()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "argv", ["trainscale", *argv])
            mp.chdir(Path(os.environ.get("FUZZ_TMP", "/tmp")) / "cwd")  # '' and '.' outputs land there
            mp.setenv("TRAINSCALE_CRASH_LOG", str(Path(os.environ.get("FUZZ_TMP", "/tmp")) / "fuzz-crash.log"))
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Hang:
        pytest.fail(f"trainscale {' '.join(argv)} ran over {LIMIT_S} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    seconds = time.perf_counter() - t0
    if HUNG:
        pytest.fail(f"trainscale {' '.join(argv)} ran over {LIMIT_S} s")
    if seconds > 5:
        SLOW.append((seconds, argv))
    CASES[argv[0] if argv else "-"] += 1
    o, e = out.getvalue(), err.getvalue()
    shown = f"trainscale {' '.join(repr(a) for a in argv)} -> exit {code}\n{e[-2000:]}"
    assert "Traceback" not in o + e, shown
    assert code in (0, 1, 2), shown
    if code:
        lines = [ln for ln in e.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("trainscale: error: "), shown
        assert "unexpected" not in lines[0], shown
    return code, o, e


# ------------------------------------------------------------------ strategies

NUMBERS = st.one_of(
    st.sampled_from(["-1", "0", "nan", "inf", "-inf", "1e400", "99999999999999999999", "-99999999999999999999",
                     "0.0", "1e-400", "", " ", "1,5", "0x10", "1_000", "١٢", "NaN", "+inf"]),
    st.integers(min_value=-10**22, max_value=10**22).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=8),
)
LAYOUT_TOKENS = st.sampled_from(["tp", "cp", "pp", "dp", "fsdp", "hsdp", "mb", "v", "zero", "gpipe", "1f1b",
                                 "interleaved", "rc=", "recompute=", "sp", "nosp", "selective", "full", "none", ""])
LAYOUTS = st.one_of(
    st.lists(st.tuples(LAYOUT_TOKENS, st.one_of(st.just(""), st.integers(-3, 10**20).map(str))).map("".join),
             max_size=6).map(",".join),
    st.text(max_size=30),
    st.sampled_from(["tp9999999999999999999999", ";;", "tp2;;tp1", ",,,", "tp0", "dp-1", "tp2 , pp2",
                     "pp4,v2", "fsdp4,hsdp2", "zero9", "rc=always"]),
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True),
                    st.text(max_size=10), st.just(1e400), st.just(-0.0))
HF_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "head_dim", "hidden_act",
           "tie_word_embeddings", "attention_bias", "_name_or_path", "model_type"]
GOOD_HF = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128, "model_type": "llama"}


def toml_value(v) -> str:
    if v is None:
        return '"null"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, int):
        return str(v)
    return json.dumps(v)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz")
    os.environ["FUZZ_TMP"] = str(d)
    (d / "cwd").mkdir()
    os.mkfifo(d / "fifo.toml")
    os.mkfifo(d / "fifo.json")
    (d / "folder.toml").mkdir()
    (d / "a-file").write_text("x")
    (d / "binary.toml").write_bytes(bytes(range(256)) * 4)
    return d


@pytest.fixture(scope="module")
def model_dir(tmp) -> Path:
    """A tiny (untrained) model folder with a real tokenizer: what train writes as RUN/final."""
    import torch

    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe
    from trainscale.runtime.model import build_model
    from trainscale.specs import load_model

    spec = load_model({"name": "fuzz", "n_layers": 2, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
                       "vocab_size": 512, "max_seq_len": 64})
    text = corpus_text("train", max_chars=60_000)
    tok = train_bpe([text], spec.vocab_size)
    run = tmp / "run"
    (run / "final").mkdir(parents=True)
    tok.save(str(tmp / "tokenizer.json"))
    torch.manual_seed(0)
    save_model_dir(run / "final", build_model(spec, seed=0).state_dict(), spec, tmp / "tokenizer.json")
    (tmp / "data.txt").write_text(text[:20_000])
    return run


def paths(tmp: Path) -> list[str]:
    """Paths an adversarial user gives where a file or a folder is meant."""
    return [str(tmp / "missing"), str(tmp / "fifo.toml"), str(tmp / "folder.toml"), str(tmp / "a-file"),
            str(tmp / "a-file" / "below"), "/dev/zero", "/proc/self/status", "/proc/nope/x", str(tmp / "binary.toml"),
            "", "a\nb", str(tmp / ("x" * 300))]


# ------------------------------------------------------------------ numeric flags, every sub-command

NUMERIC = {
    # sub-command: (fixed arguments, flags to fuzz); for commands that do real work the fixed arguments hold
    # one bad value that is checked after the flags, so a valid flag ends there instead of training
    "train": (["--config", str(TINY), "--dry-run"], ["--steps", "--nnodes", "--max-restarts"]),
    "launch": (["--config", str(TINY), "--slurm", "--layout", "dp2"], ["--nodes", "--gpus-per-node", "--steps",
                                                                       "--max-resubmits", "--signal-before",
                                                                       "--cpus-per-gpu", "--max-restarts"]),
    "calibrate": (["--processes", "0"], ["--seq-len", "--micro-batch"]),
    "explain": ([], ["--tokens", "--gpus", "--mfu", "--gpu-hours"]),
    "generate": (["MODEL", "--prompt", "hi", "--json", "--kv-dtype", "int3"],
                 ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed"]),
    "lora": (["MODEL", "--data", "DATA", "--json", "--targets", "none-such"],
             ["--rank", "--alpha", "--steps", "--batch", "--seq-len", "--lr", "--seed", "--held-out", "--base-bits",
              "--base-group-size"]),
    "evaluate": (["MODEL", "--data", "DATA", "--json", "--split", "none-such"], ["--max-tokens", "--seq-len"]),
    "dpo": (["MODEL", "--data", "DATA", "--json", "--loss", "none-such"],
            ["--beta", "--label-smoothing", "--gamma", "--lora-rank", "--lora-alpha", "--steps", "--batch", "--seq-len",
             "--lr", "--held-out", "--seed", "--save-every"]),
    "plan": (["--layout", "tp8,pp16,dp128", "--json"], ["--gpus", "--seq", "--top", "--global-batch-tokens",
                                                        "--tokens"]),
    "quantize": (["MODEL", "--json", "--format", "int3"], ["--group-size", "--eval-tokens",
                                                                          "--max-new-tokens", "--seed"]),
    "reliability": (["--plot", "not-a-png.txt"], ["--gpus", "--days", "--interval-min", "--mtbf-h",
                                                  "--fail-rate-per-gpu-hour", "--planned-per-day", "--ckpt-write-s",
                                                  "--storage-bw", "--restart-min", "--trials", "--seed"]),
    "report": (["--out", "/proc/nope"], ["--gpus", "--tokens", "--mfu"]),
    "export": (["MODEL", "OUT", "--to", "gguf"], ["--type"]),
}


@pytest.mark.parametrize("command", sorted(NUMERIC))
def test_numeric_flags(command, tmp, model_dir):
    fixed, flags = NUMERIC[command]
    fixed = [str(model_dir) if a == "MODEL" else str(tmp / "data.txt") if a == "DATA" else
             str(tmp / "out.gguf") if a == "OUT" else a for a in fixed]

    @FUZZ
    @given(flag=st.sampled_from(flags), value=NUMBERS)
    def case(flag, value):
        code, _, err = cli(command, *fixed, flag, value)
        if value.strip().lower() in ("nan", "inf", "-inf", "+inf", "1e400"):
            assert code == 2, f"{command} {flag} {value} accepted"

    case()


# ------------------------------------------------------------------ layouts

def test_layout_strings(tmp):
    @FUZZ
    @given(layout=LAYOUTS)
    def case(layout):
        cli("plan", "--layout", layout, "--json")
        cli("plan", "--layout", layout, "--explain-step")  # the per-kernel table of any layout the planner takes
        cli("train", "--config", str(TINY), "--layout", layout, "--dry-run", "--json")
        cli("train", "--config", str(TINY), "--layout", layout, "--compare-plan", "--profile", str(tmp / "missing"))
        cli("launch", "--slurm", "--config", str(TINY), "--layout", layout, "--nodes", "1")

    case()


# ------------------------------------------------------------------ config files

def test_config_toml_files(tmp):
    base = TINY.read_text()
    keys = {"train": ["steps", "lr", "min_lr_ratio", "warmup", "seq_len", "global_batch", "seed", "weight_decay",
                      "grad_clip", "betas"],
            "model": ["n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq_len",
                      "rope_theta", "norm_eps", "name"],
            "run": ["out", "log_every", "eval_sequences", "layout", "save_final"],
            "checkpoint": ["every_steps", "every_seconds", "keep", "collective_timeout_s", "dir", "async_save"],
            "data": ["max_chars", "tokenizer_vocab"]}

    @FUZZ
    @given(section=st.sampled_from(sorted(keys)), data=st.data(), value=SCALARS, garbage=st.binary(max_size=64),
           mode=st.sampled_from(["override", "garbage", "truncate"]))
    def case(section, data, value, garbage, mode):
        key = data.draw(st.sampled_from(keys[section]))
        path = tmp / "fuzz-config.toml"
        if mode == "override":
            path.write_text(_override(base, section, key, value))
        elif mode == "garbage":
            path.write_bytes(base.encode()[: len(base) // 2] + garbage)
        else:
            path.write_text(base[: data.draw(st.integers(0, len(base)))])
        cli("train", "--config", str(path), "--dry-run", "--json")
        cli("launch", "--slurm", "--config", str(path), "--nodes", "1", "--gpus-per-node", "1", "--layout", "")

    case()


def _override(base: str, section: str, key: str, value) -> str:
    """The tiny config with [section] key = value (added or replaced)."""
    lines, out, cur, done = base.splitlines(), [], None, False
    for ln in lines:
        s = ln.strip()
        if s.startswith("[") and s.endswith("]"):
            if cur == section and not done:
                out.append(f"{key} = {toml_value(value)}")
                done = True
            cur = s.strip("[]")
        elif cur == section and s.split("=")[0].strip() == key:
            continue
        out.append(ln)
    if not done:
        if cur != section:
            out.append(f"[{section}]")
        out.append(f"{key} = {toml_value(value)}")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ HF config.json and lying model folders

def test_hf_config_json(tmp):
    @FUZZ
    @given(drop=st.lists(st.sampled_from(HF_KEYS), max_size=3), key=st.sampled_from(HF_KEYS), value=SCALARS,
           raw=st.one_of(st.none(), st.binary(max_size=40)))
    def case(drop, key, value, raw):
        path = tmp / "hf" / "config.json"
        path.parent.mkdir(exist_ok=True)
        cfg = {k: v for k, v in {**GOOD_HF, key: value}.items() if k not in drop}
        if raw is not None:
            path.write_bytes(raw)
        else:
            path.write_text(json.dumps(cfg, allow_nan=True))
        cli("plan", "--model", str(path), "--layout", "tp1", "--gpus", "8", "--seq", "64", "--json")
        cli("explain", "--model", str(path), "--json")
        cli("calibrate", "--model", str(path.parent), "--processes", "0")

    case()


def _lying_copy(src: Path, folder: Path, which: str, damage: str, meta: str, lie: dict) -> Path:
    """``src`` copied to ``folder`` with its file ``which`` damaged: ``value`` writes ``lie`` into the metadata file
    ``meta`` (any other file is truncated instead), ``truncate`` keeps its first third, ``empty`` empties it, ``fifo``
    puts a FIFO in its place."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(src, folder)
    target = folder / which
    if damage == "value" and which == meta:
        target.write_text(json.dumps(lie, allow_nan=True))
    elif damage in ("truncate", "value"):
        target.write_bytes(target.read_bytes()[: max(1, target.stat().st_size // 3)])
    elif damage == "empty":
        target.write_bytes(b"")
    else:
        target.unlink()
        os.mkfifo(target)
    return folder


def test_lying_model_folders(tmp, model_dir):
    """A model folder whose model.json disagrees with its weights, or whose files are not what they say."""
    good = json.loads((model_dir / "final" / "model.json").read_text())
    fields = ["n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq_len", "head_dim"]

    @FUZZ
    @given(key=st.sampled_from(fields), value=SCALARS, which=st.sampled_from(["model.json", "model.safetensors",
                                                                            "tokenizer.json"]),
           damage=st.sampled_from(["value", "truncate", "empty", "fifo"]))
    def case(key, value, which, damage):
        folder = _lying_copy(model_dir / "final", tmp / "lying", which, damage, "model.json", {**good, key: value})
        cli("generate", str(folder), "--prompt", "to be", "-n", "2", "--json")
        cli("export", str(folder), str(tmp / "lying-out.gguf"), "--to", "gguf")
        cli("quantize", str(folder), "--eval-tokens", "64", "-n", "0", "--json", "--out", str(tmp / "lying-q"))

    case()


def test_lying_hf_folders(tmp, model_dir):
    """A Hugging Face folder given as a model (generate, evaluate, quantize, lora take one as it is) whose config.json
    disagrees with its weights, or whose files are not what they say."""

    good_dir = tmp / "hf-good"
    if not good_dir.exists():
        code, _, err = cli("export", str(model_dir), str(good_dir), "--to", "hf", "--json")
        assert code == 0, err
    good = json.loads((good_dir / "config.json").read_text())

    @FUZZ
    @given(key=st.sampled_from(HF_KEYS), value=SCALARS, which=st.sampled_from(["config.json", "model.safetensors",
                                                                             "tokenizer.json"]),
           damage=st.sampled_from(["value", "truncate", "empty", "fifo"]))
    def case(key, value, which, damage):
        folder = _lying_copy(good_dir, tmp / "lying-hf", which, damage, "config.json", {**good, key: value})
        cli("generate", str(folder), "--prompt", "to be", "-n", "2", "--json")
        cli("evaluate", str(folder), "--data", str(tmp / "data.txt"), "--max-tokens", "64", "--json")
        cli("quantize", str(folder), "--eval-tokens", "64", "-n", "0", "--json", "--out", str(tmp / "lying-hf-q"))
        cli("lora", str(folder), "--data", str(tmp / "data.txt"), "--steps", "1", "--batch", "1", "--seq-len", "8",
            "--json", "--out", str(tmp / "lying-hf-lora"))

    case()


# ------------------------------------------------------------------ paths, every sub-command

def test_paths(tmp, model_dir):
    m = str(model_dir)
    commands = {
        "train --config": lambda p: ["train", "--config", p, "--dry-run"],
        "train --out": lambda p: ["train", "--config", str(TINY), "--out", p, "--dry-run"],
        "train --profile": lambda p: ["train", "--config", str(TINY), "--compare-plan", "--profile", p],
        "launch --config": lambda p: ["launch", "--slurm", "--config", p, "--nodes", "1", "--layout", ""],
        "launch --script": lambda p: ["launch", "--slurm", "--config", str(TINY), "--nodes", "1", "--gpus-per-node",
                                      "1", "--layout", "", "--script", p],
        "launch --out": lambda p: ["launch", "--slurm", "--config", str(TINY), "--nodes", "1", "--gpus-per-node", "1",
                                   "--layout", "", "--out", p],
        "calibrate --config": lambda p: ["calibrate", "--config", p, "--processes", "0"],
        "calibrate --model": lambda p: ["calibrate", "--model", p, "--processes", "0"],
        "calibrate --out": lambda p: ["calibrate", "--out", p, "--processes", "0"],
        "plan --model": lambda p: ["plan", "--model", p, "--layout", "tp1", "--json"],
        "plan --gpu": lambda p: ["plan", "--gpu", p, "--layout", "tp8,pp16,dp128", "--json"],
        "plan --cluster": lambda p: ["plan", "--cluster", p, "--layout", "tp8,pp16,dp128", "--json"],
        "plan --profile": lambda p: ["plan", "--profile", p, "--layout", "tp8,pp16,dp128", "--json"],
        "explain --model": lambda p: ["explain", "--model", p, "--json"],
        "explain --gpu": lambda p: ["explain", "--gpu", p, "--json"],
        "reliability --model": lambda p: ["reliability", "--model", p, "--trials", "10", "--json"],
        "reliability --plot": lambda p: ["reliability", "--plot", p, "--trials", "10", "--json"],
        "report --out": lambda p: ["report", "--out", p, "--run", str(tmp / "missing")],
        "report --run": lambda p: ["report", "--out", str(tmp / "report"), "--run", p],
        "report --plan": lambda p: ["report", "--out", str(tmp / "report"), "--plan", p],
        "generate CHECKPOINT": lambda p: ["generate", p, "--prompt", "x", "-n", "1"],
        "quantize CHECKPOINT": lambda p: ["quantize", p, "--eval-tokens", "64", "-n", "0", "--json"],
        "quantize --out": lambda p: ["quantize", m, "--out", p, "--eval-tokens", "64", "-n", "0", "--json"],
        "quantize --eval-text": lambda p: ["quantize", m, "--eval-text", p, "--out", str(tmp / "q"), "-n", "0"],
        "lora CHECKPOINT": lambda p: ["lora", p, "--data", str(tmp / "data.txt"), "--steps", "1"],
        "lora --data": lambda p: ["lora", m, "--data", p, "--steps", "1", "--out", str(tmp / "l")],
        "lora --out": lambda p: ["lora", m, "--data", str(tmp / "data.txt"), "--steps", "1", "--batch", "2",
                                 "--seq-len", "16", "--out", p, "--json"],
        "evaluate MODEL": lambda p: ["evaluate", p, "--data", str(tmp / "data.txt"), "--max-tokens", "64"],
        "evaluate --data": lambda p: ["evaluate", m, "--data", p, "--max-tokens", "64", "--json"],
        "evaluate --tasks": lambda p: ["evaluate", m, "--tasks", p, "--json"],
        "export CHECKPOINT": lambda p: ["export", p, str(tmp / "e.gguf"), "--to", "gguf"],
        "export OUT hf": lambda p: ["export", m, p, "--to", "hf", "--json"],
        "export OUT gguf": lambda p: ["export", m, p, "--to", "gguf", "--json"],
    }
    failures = []
    for make in commands.values():
        for p in paths(tmp):
            try:
                cli(*make(p))
            except AssertionError as e:  # collect them all: one run shows every path bug
                failures.append(str(e).splitlines()[0][:300])
    assert not failures, "\n".join(failures)
    # outputs never overwrite their input
    for out in (m, str(model_dir / "final"), str(model_dir / "final" / "sub")):
        code, _, err = cli("export", m, out, "--to", "hf")
        assert code == 2 and "inside its own input" in err
    for cmd in (["quantize", m, "--out", str(model_dir / "final")],
                ["lora", m, "--data", str(tmp / "data.txt"), "--out", str(model_dir / "final" / "adapter")]):
        code, _, err = cli(*cmd)
        assert code == 2, err


# ------------------------------------------------------------------ text fields: Slurm, endpoints, faults

def test_text_fields(tmp):
    @FUZZ
    @given(text=st.one_of(st.text(max_size=20), st.sampled_from(["gpu\n#SBATCH --x", "a;rm -rf /", "$(id)", "`id`",
                                                                  "1:00:00\nid", "x y", "nohostport", "host:0",
                                                                  "host:99999", ":29500", "[::1]:29500",
                                                                  "crash@step=-1,rank=99", "hang@step=1e9"])))
    def case(text):
        base = ["launch", "--slurm", "--config", str(TINY), "--layout", "dp2", "--nodes", "1", "--gpus-per-node", "2"]
        for extra in (["--partition", text], ["--time", text]):
            code, out, _ = cli(*base, *extra)
            if code == 0:
                assert "\n#SBATCH" not in text and ";" not in text and "\n" not in text
        # --out reaches the script shell-quoted (runtime/job/slurm.py): any character but a line break is safe
        code, out, _ = cli(*base, "--out", text)
        if code == 0:
            assert "\n" not in text and "\r" not in text
        code, out, _ = cli("train", "--config", str(TINY), "--nnodes", "2", "--layout", "dp2", "--rdzv-endpoint",
                           text, "--dry-run")
        if code == 0:
            host, _, port = text.rpartition(":")
            assert host and port.isdigit() and 0 < int(port) < 65536
        cli("train", "--config", str(TINY), "--layout", "dp2", "--inject", text, "--dry-run")
        # --env KEY=VALUE, --python and --set reach the script quoted or are refused
        for extra in (["--env", text], ["--env", f"NCCL_X={text}"], ["--python", text], ["--mem", text],
                      ["--account", text], ["--set", text], ["--set", f"train.lr={text}"]):
            cli(*base, *extra, "--script", str(tmp / "fuzz-job.sbatch"))
        cli("train", "--config", str(TINY), "--set", text, "--dry-run")

    case()
    code, _, err = cli("train", "--config", str(TINY), "--inject", "crash@step=-1,rank=99", "--dry-run")
    assert code == 2, err


# ------------------------------------------------------------------ issue 23: the files and options added since

BAD_FLOATS = ("nan", "inf", "-inf", "+inf", "1e400", "NaN")


def _is_bad_number(value) -> bool:
    """A value no planner knob, published figure or size may take: NaN, an infinity, or not a number."""
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, (int, float)):
        return not math.isfinite(value)
    return str(value).strip().lower() in BAD_FLOATS


def _toml_doc(table: dict, key: str | None, value, mode: str, garbage: bytes, depth: int) -> bytes:
    """A TOML file of one kind, damaged one way: a key's value replaced or removed, an unknown key, garbage bytes
    after half of it, or an array nested ``depth`` deep (tomllib recurses)."""
    import tomli_w

    def clean(v):
        if v is None:
            return "null"
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    doc = dict(table)
    if mode == "value" and key is not None:
        doc[key] = value
    elif mode == "drop" and key is not None:
        doc.pop(key, None)
    elif mode == "unknown":
        doc["no_such_knob_" + str(abs(hash(str(value))) % 97)] = value
    text = tomli_w.dumps(clean(doc)).encode()
    if mode == "garbage":
        return text[: len(text) // 2] + garbage
    if mode == "nested":
        return text + f"deep = {'[' * depth}1{']' * depth}\n".encode()
    return text


FILE_MODES = st.sampled_from(["value", "value", "value", "drop", "unknown", "garbage", "nested"])


def _software_table() -> dict:
    import tomllib

    from trainscale.estimate.planner.software import software_names

    cat = tomllib.loads((ROOT / "src" / "trainscale" / "catalog" / "software.toml").read_text())
    return dict(cat[software_names()[0]])


def test_software_and_profile_files(tmp):
    """`plan --software FILE` and `plan --profile FILE`: every knob of each kind, damaged."""
    from trainscale.estimate.planner.efficiencies import KNOB_RANGES

    software = _software_table()
    profile = {k: 0.5 if r.hi <= 1 else (r.lo + 1) for k, r in KNOB_RANGES.items()}

    @FUZZ
    @given(kind=st.sampled_from(["software", "profile"]), data=st.data(), value=SCALARS, mode=FILE_MODES,
           garbage=st.binary(max_size=32), depth=st.sampled_from([3, 50, 5000]))
    def case(kind, data, value, mode, garbage, depth):
        table = software if kind == "software" else profile
        key = data.draw(st.sampled_from(sorted(table)))
        path = tmp / f"fuzz-{kind}.toml"
        path.write_bytes(_toml_doc(table, key, value, mode, garbage, depth))
        code, _, err = cli("plan", f"--{kind}", str(path), "--layout", "tp8,pp16,dp128", "--json")
        if mode == "value" and isinstance(table[key], (int, float)) and not isinstance(table[key], bool) \
                and _is_bad_number(value):
            assert code == 2, f"{kind} knob {key} = {value!r} accepted"
        if mode == "unknown":
            assert code == 2, f"an unknown {kind} knob accepted"
        cli("plan", f"--{kind}", str(path), "--model", "llama3.1-8b", "--gpus", "16", "--top", "1", "--json")

    case()


def test_planner_set_fix_forbid(tmp):
    """`plan --set/--fix/--forbid/--max-v/--precision` and `validate --set`."""
    from trainscale.estimate.planner.efficiencies import KNOB_RANGES

    keys = st.one_of(st.sampled_from(sorted(KNOB_RANGES)), st.text(max_size=12))
    fixes = st.one_of(LAYOUTS, st.lists(st.tuples(st.sampled_from(["tp", "pp", "cp", "dp", "ep", "mb", "v", "zero",
                                                                  "schedule", "recompute", "x", ""]),
                                                  NUMBERS).map(lambda t: f"{t[0]}={t[1]}"), max_size=3).map(",".join))

    @FUZZ
    @given(key=keys, value=NUMBERS, fix=fixes, forbid=fixes, max_v=NUMBERS,
           precision=st.one_of(st.text(max_size=6), st.sampled_from(["fp16", "bf16", "fp8", "FP16", "fp32"])))
    def case(key, value, fix, forbid, max_v, precision):
        code, _, _ = cli("plan", "--set", f"{key}={value}", "--layout", "tp8,pp16,dp128", "--json")
        if key in KNOB_RANGES and _is_bad_number(value):
            assert code == 2, f"--set {key}={value} accepted"
        code, _, _ = cli("validate", "--set", f"{key}={value}", "--json")
        if key in KNOB_RANGES and _is_bad_number(value):
            assert code == 2, f"validate --set {key}={value} accepted"
        cli("plan", "--model", "llama3.1-8b", "--gpus", "16", "--top", "1", "--fix", fix, "--json")
        cli("plan", "--model", "llama3.1-8b", "--gpus", "16", "--top", "1", "--forbid", forbid, "--json")
        cli("plan", "--model", "llama3.1-8b", "--gpus", "16", "--top", "1", "--max-v", max_v, "--json")
        cli("plan", "--model", "llama3.1-8b", "--gpus", "16", "--top", "1", "--precision", precision, "--json")
        cli("plan", "--model", "llama3.1-8b", "--gpus", "16", "--fix", fix, "--precision", precision, "--explain-step")

    case()


def test_runs_files(tmp):
    """`validate --runs FILE`: one published row, each field damaged; a published figure that is not a finite
    positive number is refused, never predicted."""
    import tomllib

    row = tomllib.loads((ROOT / "src" / "trainscale" / "catalog" / "runs.toml").read_text())["run"][0]

    @FUZZ
    @given(key=st.sampled_from(sorted(row)), value=SCALARS, mode=FILE_MODES, garbage=st.binary(max_size=32),
           depth=st.sampled_from([3, 50, 5000]), rows=st.sampled_from([0, 1, 2]))
    def case(key, value, mode, garbage, depth, rows):
        import tomli_w

        if mode in ("garbage", "nested"):
            raw = _toml_doc({"x": 1}, None, None, mode, garbage, depth)
        else:
            damaged = tomllib.loads(_toml_doc(row, key, value, mode, garbage, depth).decode())
            raw = tomli_w.dumps({"run": [damaged] * rows}).encode()
        path = tmp / "fuzz-runs.toml"
        path.write_bytes(raw)
        code, _, _ = cli("validate", "--runs", str(path), "--json")
        if mode == "value" and key in ("published", "gpus", "seq", "global_batch_tokens") and rows \
                and (_is_bad_number(value) or (isinstance(value, (int, float)) and value <= 0)):
            assert code == 2, f"a run with {key} = {value!r} accepted"

    case()


def test_prepare_data_configs(tmp):
    """`prepare-data`: [data] files globs, tokenizer paths and output folders an adversarial user gives."""
    (tmp / "corpus").mkdir(exist_ok=True)
    for i in range(20):  # enough documents for a held-out split
        (tmp / "corpus" / f"a{i}.txt").write_text(f"to be or not to be, said number {i}. " * 30)
    (tmp / "corpus" / "b.jsonl").write_text('{"text": "hello world"}\n{"text": 5}\n{"nope": 1}\n')
    (tmp / "victim").mkdir(exist_ok=True)
    (tmp / "victim" / "keep.txt").write_text("precious")
    files = st.one_of(st.sampled_from([str(tmp / "corpus" / "*.txt"), str(tmp / "corpus" / "**"), "/**/*.txt",
                                       str(tmp / "corpus"), str(tmp / "fifo.toml"), str(tmp / "binary.toml"),
                                       "/dev/zero", "/proc/self/status", str(tmp / "corpus" / "b.jsonl"), "",
                                       "[", "*" * 100]),
                      st.text(max_size=12))
    where = st.sampled_from([None, "victim", "a-file", "fifo.toml", "fresh", "/proc/nope", "/"])

    @FUZZ
    @given(data_files=st.lists(files, max_size=3), tokenizer=st.one_of(st.none(), st.sampled_from(paths(tmp))),
           prepared=where, workers=st.sampled_from(["0", "1", "-1", "99999999", "nan"]))
    def case(data_files, tokenizer, prepared, workers):
        import tomli_w

        data = {"files": data_files, "max_chars": 5000}
        if tokenizer is not None:
            data["tokenizer"] = tokenizer
        if prepared is not None:
            data["prepared"] = prepared if prepared.startswith("/") else str(tmp / prepared)
        cfg = {"name": "fuzz", "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
                                         "vocab_size": 300, "max_seq_len": 32},
               "train": {"steps": 1, "seq_len": 16, "global_batch": 2}, "data": data,
               "run": {"out": str(tmp / "prep-run")}}
        path = tmp / "fuzz-prep.toml"
        path.write_text(tomli_w.dumps(cfg))
        cli("prepare-data", "--config", str(path), "--workers", workers, "--json")
        assert (tmp / "victim" / "keep.txt").read_text() == "precious"
        assert sorted(p.name for p in (tmp / "victim").iterdir()) == ["keep.txt"]

    case()
    # the same config with sane values prepares (the cases above reach prepare-data's own checks)
    good = _tiny_cfg(tmp, "prep-good", {"files": [str(tmp / "corpus" / "*.txt")], "prepared": str(tmp / "prep-ok")})
    code, _, err = cli("prepare-data", "--config", good, "--workers", "0", "--json")
    assert code == 0, err


def test_catalog_shaped_files(tmp):
    """`plan --model/--gpu/--cluster FILE.toml` and `explain --model/--gpu`: a catalog entry written to a file,
    damaged field by field (the specs' pydantic models: strict, finite, in range)."""
    import tomllib

    cats = {kind: tomllib.loads((ROOT / "src" / "trainscale" / "catalog" / f"{kind}.toml").read_text())
            for kind in ("models", "gpus", "clusters")}
    bases = {"model": cats["models"]["llama3.1-8b"], "gpu": cats["gpus"]["h100-sxm"],
             "cluster": cats["clusters"]["dgx-h100"]}

    @FUZZ
    @given(kind=st.sampled_from(sorted(bases)), data=st.data(), value=SCALARS, mode=FILE_MODES,
           garbage=st.binary(max_size=32), depth=st.sampled_from([3, 50, 5000]))
    def case(kind, data, value, mode, garbage, depth):
        table = bases[kind]
        key = data.draw(st.sampled_from(sorted(table)))
        path = tmp / f"fuzz-{kind}.toml"
        path.write_bytes(_toml_doc(table, key, value, mode, garbage, depth))
        fixed = {"model": ["--gpu", "h100-sxm"], "gpu": ["--model", "llama3.1-8b"],
                 "cluster": ["--model", "llama3.1-8b"]}[kind]
        code, _, _ = cli("plan", f"--{kind}", str(path), *fixed, "--gpus", "16", "--top", "1", "--json")
        if mode == "value" and isinstance(table[key], (int, float)) and not isinstance(table[key], bool) \
                and _is_bad_number(value):
            assert code == 2, f"{kind} file with {key} = {value!r} accepted"
        if kind != "cluster":
            cli("explain", f"--{kind}", str(path), "--json")

    case()


def test_tokenizer_files(tmp, model_dir):
    """A tokenizer.json given as `[data] tokenizer`, damaged: JSON garbage, deep nesting, a missing model, an
    enormous token, wrong types; prepare-data refuses in one sentence or prepares."""
    good = json.loads((model_dir / "final" / "tokenizer.json").read_text())
    (tmp / "tok-corpus.txt").write_text("to be or not to be, that is the question " * 40)

    @FUZZ
    @given(key=st.sampled_from(sorted(good)), value=SCALARS, depth=st.sampled_from([50, 5000]),
           damage=st.sampled_from(["value", "drop", "garbage", "nested", "huge-token", "vocab-type", "empty"]))
    def case(key, value, depth, damage):
        import tomli_w

        tok = tmp / "fuzz-tokenizer.json"
        if damage == "value":
            tok.write_text(json.dumps({**good, key: value}, allow_nan=True))
        elif damage == "drop":
            tok.write_text(json.dumps({k: v for k, v in good.items() if k != key}))
        elif damage == "garbage":
            tok.write_bytes(json.dumps(good).encode()[:100] + bytes(range(128, 256)))
        elif damage == "nested":
            tok.write_text('{"x": ' + "[" * depth + "]" * depth + "}")
        elif damage == "huge-token":
            model = dict(good["model"])
            model["vocab"] = {**model["vocab"], "z" * 100_000: len(model["vocab"])}
            tok.write_text(json.dumps({**good, "model": model}))
        elif damage == "vocab-type":
            tok.write_text(json.dumps({**good, "model": {**good["model"], "vocab": [1, 2, 3]}}))
        else:
            tok.write_text("")
        cfg = {"name": "tok", "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
                                        "vocab_size": 512, "max_seq_len": 32},
               "train": {"steps": 1, "seq_len": 16, "global_batch": 2},
               "data": {"files": [str(tmp / "tok-corpus.txt")], "tokenizer": str(tok),
                        "prepared": str(tmp / "tok-prepared")},
               "run": {"out": str(tmp / "tok-run")}}
        path = tmp / "fuzz-tok.toml"
        path.write_text(tomli_w.dumps(cfg))
        import shutil

        shutil.rmtree(tmp / "tok-prepared", ignore_errors=True)
        cli("prepare-data", "--config", str(path), "--workers", "0", "--json")

    case()


@pytest.fixture(scope="module")
def hf_folder(tmp) -> Path:
    """A transformers-built random Llama folder with its tokenizer.json, as people download them."""
    import transformers

    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=512, max_position_embeddings=128)
    folder = tmp / "hf-llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    train_bpe([corpus_text("train", max_chars=50_000)], 512).save(str(folder / "tokenizer.json"))
    return folder


def test_model_init_folders(tmp, hf_folder):
    """`[model] init = FOLDER` (train --dry-run reads it) and `plan --model FOLDER/config.json`: a config.json
    damaged key by key, nested deep, an index whose names point anywhere, files that are FIFOs."""
    import shutil

    good = json.loads((hf_folder / "config.json").read_text())

    @FUZZ
    @given(key=st.sampled_from(HF_KEYS + ["rope_scaling", "torch_dtype", "sliding_window"]), value=SCALARS,
           damage=st.sampled_from(["value", "drop", "nested", "garbage", "fifo", "index", "index-fifo"]),
           depth=st.sampled_from([50, 2000, 100000]), target=st.sampled_from(["../escape.safetensors", "/etc/passwd",
                                                                              "model.safetensors", "", "x" * 300]))
    def case(key, value, damage, depth, target):
        folder = tmp / "init-folder"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(hf_folder, folder)
        cfg_path = folder / "config.json"
        if damage == "value":
            cfg_path.write_text(json.dumps({**good, key: value}, allow_nan=True))
        elif damage == "drop":
            cfg_path.write_text(json.dumps({k: v for k, v in good.items() if k != key}))
        elif damage == "nested":
            cfg_path.write_text(json.dumps(good)[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}")
        elif damage == "garbage":
            cfg_path.write_bytes(json.dumps(good).encode()[:40] + bytes(range(200, 256)))
        elif damage == "fifo":
            cfg_path.unlink()
            os.mkfifo(cfg_path)
        else:
            index = folder / "model.safetensors.index.json"
            if damage == "index-fifo":
                os.mkfifo(index)
            else:
                index.write_text(json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": target,
                                                                            key: value}}, allow_nan=True))
            (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        cfg = tmp / "fuzz-init.toml"
        cfg.write_text(f'name = "init"\n[model]\ninit = {json.dumps(str(folder))}\n[train]\nsteps = 1\nseq_len = 16\n'
                       f'global_batch = 2\n[run]\nout = {json.dumps(str(tmp / "init-run"))}\n')
        cli("train", "--config", str(cfg), "--dry-run", "--json")
        cli("plan", "--model", str(cfg_path), "--layout", "tp1", "--gpus", "8", "--seq", "16", "--json")
        if damage in ("value", "drop") and key in ("num_hidden_layers", "hidden_size", "vocab_size") and \
                (damage == "drop" or _is_bad_number(value) or not isinstance(value, int) or value <= 0):
            code, _, _ = cli("train", "--config", str(cfg), "--dry-run", "--json")
            assert code == 2, f"[model] init with config.json {key} = {value!r} ({damage}) accepted"

    case()


def test_train_and_compare_options(tmp):
    """`train --fallback-layout/--rdzv-endpoint`, `compare --layout/--steps/--profile` (a bad value is refused
    before any process starts; a good one stops at the missing profile)."""
    endpoints = st.one_of(st.text(max_size=24), st.sampled_from(["999.999.999.999:29500", "host:٢٩٥٠٠", "host:+1",
                                                                 "host:0x50", "[::1]:29500", "h" * 300 + ":1",
                                                                 "host:" + "9" * 5000]))

    @FUZZ
    @given(fallback=LAYOUTS, endpoint=endpoints, layout=LAYOUTS, steps=NUMBERS)
    def case(fallback, endpoint, layout, steps):
        cli("train", "--config", str(TINY), "--layout", "dp2", "--fallback-layout", fallback, "--dry-run")
        code, _, _ = cli("train", "--config", str(TINY), "--nnodes", "2", "--layout", "dp2", "--rdzv-endpoint",
                         endpoint, "--dry-run")
        if code == 0:
            host, _, port = endpoint.rpartition(":")
            assert port.isascii() and port.isdigit() and 0 < int(port) < 65536 and len(port) <= 5
            if host.replace(".", "").isdigit():
                assert all(0 <= int(p) <= 255 for p in host.split(".")), endpoint
        cli("compare", "--config", str(TINY), "--layout", layout, "--profile", str(tmp / "missing"))
        cli("compare", "--config", str(TINY), "--layout", "dp1", "--steps", steps, "--profile", str(tmp / "fifo.toml"))

    case()


def _fifo(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)
    return str(path)


def _tiny_cfg(tmp: Path, name: str, data: dict | None = None, model: dict | None = None) -> str:
    import tomli_w

    cfg = {"name": name, "model": model or {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
                                            "vocab_size": 512, "max_seq_len": 32},
           "train": {"steps": 1, "seq_len": 16, "global_batch": 2}, "run": {"out": str(tmp / f"{name}-run")}}
    if data:
        cfg["data"] = data
    path = tmp / f"{name}.toml"
    path.write_text(tomli_w.dumps(cfg))
    return str(path)


FIFO_KINDS = ["config", "software", "planner-profile", "hardware-profile", "runs", "model-toml", "gpu-toml",
              "cluster-toml", "hf-config", "hf-index", "tokenizer", "data-file", "model-json", "model-weights",
              "model-tokenizer", "metrics", "plan-json", "megatron-idx", "megatron-bin", "npy-tokens"]


@pytest.mark.parametrize("kind", FIFO_KINDS)
def test_fifo_inputs(kind, tmp, model_dir, hf_folder):
    """Every kind of file the tool reads, given as a FIFO (it would block a plain open() for ever): one sentence,
    exit 2, well inside LIMIT_S."""
    import shutil

    d = tmp / f"fifo-{kind}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    layout = ["--layout", "tp8,pp16,dp128", "--json"]
    if kind == "config":
        args = ["train", "--config", _fifo(d / "c.toml"), "--dry-run"]
    elif kind == "software":
        args = ["plan", "--software", _fifo(d / "s.toml"), *layout]
    elif kind == "planner-profile":
        args = ["plan", "--profile", _fifo(d / "p.toml"), *layout]
    elif kind == "hardware-profile":
        args = ["compare", "--config", str(TINY), "--layout", "dp1", "--profile", _fifo(d / "h.toml")]
    elif kind == "runs":
        args = ["validate", "--runs", _fifo(d / "r.toml")]
    elif kind in ("model-toml", "gpu-toml", "cluster-toml"):
        args = ["plan", f"--{kind.split('-')[0]}", _fifo(d / "x.toml"), *layout]
    elif kind in ("hf-config", "hf-index"):
        folder = d / "hf"
        shutil.copytree(hf_folder, folder)
        if kind == "hf-config":
            _fifo(folder / "config.json")
        else:
            _fifo(folder / "model.safetensors.index.json")
            (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        cfg = d / "init.toml"
        cfg.write_text(f'name = "i"\n[model]\ninit = {json.dumps(str(folder))}\n[train]\nsteps = 1\nseq_len = 16\n'
                       f'global_batch = 2\n[run]\nout = {json.dumps(str(d / "run"))}\n')
        args = ["train", "--config", str(cfg), "--dry-run"]
    elif kind == "tokenizer":
        (d / "t.txt").write_text("to be or not to be " * 20)
        args = ["prepare-data", "--config", _tiny_cfg(d, "tok", {"files": [str(d / "t.txt")],
                                                                "tokenizer": _fifo(d / "tokenizer.json")})]
    elif kind == "data-file":
        args = ["prepare-data", "--config", _tiny_cfg(d, "data", {"files": [_fifo(d / "corpus.txt")]})]
    elif kind in ("megatron-idx", "megatron-bin", "npy-tokens"):
        import numpy as np

        tok = str(model_dir / "final" / "tokenizer.json")
        if kind == "npy-tokens":
            files = [_fifo(d / "tokens.npy")]
        else:  # a real pair, one half of it a FIFO
            np.arange(10, dtype=np.uint16).tofile(d / "c.bin")
            (d / "c.idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(16))
            _fifo(d / ("c.idx" if kind == "megatron-idx" else "c.bin"))
            files = [str(d / "c.bin")]
        args = ["prepare-data", "--config", _tiny_cfg(d, "tok-files", {"files": files, "tokenizer": tok})]
    elif kind.startswith("model-"):
        folder = d / "m"
        shutil.copytree(model_dir / "final", folder)
        _fifo(folder / {"model-json": "model.json", "model-weights": "model.safetensors",
                        "model-tokenizer": "tokenizer.json"}[kind])
        args = ["generate", str(folder), "--prompt", "to be", "-n", "1"]
    elif kind == "metrics":
        run = d / "run"
        shutil.copytree(model_dir, run)
        _fifo(run / "metrics.jsonl")
        args = ["report", "--out", str(d / "report"), "--run", str(run)]
    else:
        args = ["report", "--out", str(d / "report"), "--plan", _fifo(d / "plan.json")]
    code, _, err = cli(*args)
    assert code == 2 and "not a regular file" in err, (kind, code, err)


def test_generate_chat_texts_and_templates(tmp, model_dir):
    """generate --chat / --system: any prompt and system text, on a folder whose tokenizer_config.json holds a chat
    template that is good, not Jinja, raises, reads what is not there, or is not a string; a folder without one."""
    import shutil

    folder = tmp / "chat-model"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(model_dir / "final", folder)
    good = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
    code, _, err = cli("generate", str(folder), "--chat", "-p", "hi", "-n", "1")
    assert code == 2 and "no chat template" in err, err

    @FUZZ
    @given(text=st.one_of(st.text(max_size=20), st.sampled_from(["", "<|endoftext|>", "{{ 7*7 }}", "{% raw %}",
                                                                  "\x00", "a" * 5000])),
           template=st.sampled_from([good, good, "{% for %}", "{{ raise_exception('no') }}",
                                     "{{ messages[5]['content'] }}", "{{ ''.__class__ }}", 7, None, ["x"]]),
           eos=st.sampled_from(["<|endoftext|>", "not-a-token", 3]), system=st.booleans())
    def case(text, template, eos, system):
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": eos}))
        extra = ["--system", text] if system else []
        code, out, _ = cli("generate", str(folder), "--chat", "-p", text, *extra, "-n", "2", "--json")
        if code == 0:
            assert template == good and json.loads(out)["prompt_tokens"] > 0

    case()


# ------------------------------------------------------------------ issue 35: fields, patterns, outputs, given values

FEW = settings(FUZZ, max_examples=10)
TOKENS = st.one_of(st.sampled_from(["<|endoftext|>", "not-a-token", "", "x" * 3000]), st.text(max_size=6))
TOKEN_VALUES = st.one_of(TOKENS, st.lists(TOKENS, max_size=3), st.fixed_dictionaries({"content": TOKENS}),
                         SCALARS, st.lists(st.integers(), max_size=2), st.just([{"content": "<|endoftext|>"}]))


def test_tokenizer_config_fields(tmp, model_dir):
    """tokenizer_config.json's fields with any value (eos_token a list, a token the vocabulary lacks, an object, a
    number; bos_token, pad_token, chat_template, add_bos_token, model_max_length): generate --chat answers and stops
    or refuses in one sentence (runtime/data/tokenizer.tokenizer_settings)."""
    import shutil

    folder = tmp / "tokcfg-model"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(model_dir / "final", folder)
    template = "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"

    @FUZZ
    @given(key=st.sampled_from(["eos_token", "eos_token", "bos_token", "pad_token", "chat_template", "add_bos_token",
                                "model_max_length", "additional_special_tokens", "unknown_field"]),
           value=TOKEN_VALUES)
    def case(key, value):
        cfg = {"chat_template": template, "eos_token": "<|endoftext|>", key: value}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, allow_nan=True))
        cli("generate", str(folder), "--chat", "-p", "to be", "-n", "2", "--json")

    case()


PATTERNS = st.sampled_from([r"(a+)+$", r"(?:a|aa)+$", r"((\s)*)*x", r"(\w+\s?)+$", r"(x(a*))*y", r"(a|a?)+",
                            r" ?\p{L}+| ?\p{N}+|\s+(?!\S)|\s+", r"\p{N}{1,3}", r"[(a+)]+", "(", "\\"])


def test_tokenizer_patterns(tmp, model_dir):
    """A tokenizer.json whose pre-tokenizer splits on a regex built for catastrophic backtracking (or a broken one):
    prepare-data refuses it in one sentence at load instead of a Rust panic; a published-style pattern prepares."""
    import shutil

    import tomli_w

    good = json.loads((model_dir / "final" / "tokenizer.json").read_text())
    (tmp / "pat-corpus.txt").write_text(("a" * 60 + "b to be or not to be\n\n") * 20)

    @FEW
    @given(pattern=PATTERNS, where=st.sampled_from(["pre_tokenizer", "normalizer"]))
    def case(pattern, where):
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        part = split if where == "pre_tokenizer" else {"type": "Replace", "pattern": {"Regex": pattern}, "content": ""}
        if where == "pre_tokenizer":
            part = {"type": "Sequence", "pretokenizers": [split, good["pre_tokenizer"]]}
        tok = tmp / "pat-tokenizer.json"
        tok.write_text(json.dumps({**good, where: part}))
        cfg = {"name": "pat", "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
                                        "vocab_size": 512, "max_seq_len": 32},
               "train": {"steps": 1, "seq_len": 16, "global_batch": 2},
               "data": {"files": [str(tmp / "pat-corpus.txt")], "tokenizer": str(tok),
                        "prepared": str(tmp / "pat-prepared")}}
        (tmp / "pat.toml").write_text(tomli_w.dumps(cfg))
        shutil.rmtree(tmp / "pat-prepared", ignore_errors=True)
        cli("prepare-data", "--config", str(tmp / "pat.toml"), "--workers", "1", "--json")

    case()


def test_output_paths_and_given_values(tmp):
    """Where a command writes, checked before anything is read: prepare-data's [data] prepared (NUL, /proc, /sys, a
    file, a FIFO, a read-only folder, a device) and every --out/--script/--plot; Slurm's --time, --fallback-layout
    and every --tokens checked where they are given."""
    import tomli_w

    (tmp / "ro").mkdir(exist_ok=True)
    os.chmod(tmp / "ro", 0o555)
    (tmp / "out-corpus.txt").write_text("to be or not to be\n\n" * 50)
    outs = st.sampled_from(["a\x00b", "/proc/x", "/proc/self/fd/0", "/sys/kernel/x", "/dev/null", "/dev/zero/x",
                            str(tmp / "a-file"), str(tmp / "fifo.json"), str(tmp / "ro" / "x"), "", " ",
                            str(tmp / ("y" * 300)), str(tmp / "folder.toml")])

    @FUZZ
    @given(out=outs, writer=st.sampled_from(["prepared", "cache", "report", "calibrate", "script", "plot", "train"]))
    def case(out, writer):
        if writer in ("prepared", "cache"):
            cfg = {"name": "outs", "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
                                             "vocab_size": 512, "max_seq_len": 32},
                   "data": {"files": [str(tmp / "out-corpus.txt")], writer: out}}
            (tmp / "outs.toml").write_text(tomli_w.dumps(cfg))
            code, _, err = cli("prepare-data", "--config", str(tmp / "outs.toml"), "--workers", "1", "--json")
        elif "\x00" in out:
            return  # a command line cannot carry a NUL byte; the config can (above)
        elif writer == "report":
            code, _, err = cli("report", "--out", out, "--run", str(tmp / "missing"))
        elif writer == "calibrate":
            code, _, err = cli("calibrate", "--out", out, "--processes", "0")
        elif writer == "script":
            code, _, err = cli("launch", "--slurm", "--script", out, "--config", str(TINY), "--layout", "dp2")
        elif writer == "plot":
            code, _, err = cli("reliability", "--plot", out, "--trials", "10", "--json")
        else:
            code, _, err = cli("train", "--out", out, "--config", str(TINY), "--dry-run")
        if out in ("a\x00b", "/proc/x", "/sys/kernel/x", str(tmp / "a-file"), str(tmp / "fifo.json")) and \
                writer in ("prepared", "cache", "report", "train"):
            assert code == 2, (writer, out, err)

    case()

    clock = st.one_of(st.sampled_from(["99:99", "1-25", "0", "00:60:00", "1:2:3:4", "-1", "UNLIMITED", "2-00:00:00"]),
                      st.tuples(st.integers(0, 120), st.integers(0, 120), st.integers(0, 120)).map(
                          lambda t: f"{t[0]}:{t[1]:02d}:{t[2]:02d}"), NUMBERS)

    @FUZZ
    @given(time_limit=clock, fallback=LAYOUTS, nnodes=st.sampled_from(["1", "1:2", "2:4", "2:1"]), tokens=NUMBERS)
    def given_values(time_limit, fallback, nnodes, tokens):
        code, out, err = cli("launch", "--slurm", "--time", time_limit, "--config", str(TINY), "--layout", "dp2",
                             "--nodes", "1", "--gpus-per-node", "2")
        if code == 0:
            parts = time_limit.rpartition("-")[2].split(":")
            assert all(int(x) < 60 for x in parts[1:]), time_limit
        cli("train", "--config", str(TINY), "--layout", "dp2", "--nnodes", nnodes, "--fallback-layout", fallback,
            "--rdzv-endpoint", "localhost:1", "--dry-run")
        for command in ("explain", "report"):
            cli(command, "--tokens", tokens, *(["--json"] if command == "explain" else
                                              ["--out", str(tmp / "report-tokens"), "--run", str(tmp / "missing")]))

    given_values()


def test_cases_per_sub_command():
    """Runs last (file order): every sub-command was fuzzed, and no case hung."""
    names = {c.name for c in app.registered_commands} | {c.callback.__name__ for c in app.registered_commands}
    print("\nfuzz cases per sub-command:", dict(sorted(CASES.items())), "total", sum(CASES.values()))
    if SLOW:
        print("slowest:", sorted(SLOW, reverse=True)[:3])
    for command in ("train", "launch", "calibrate", "explain", "generate", "lora", "plan", "quantize", "reliability",
                    "report", "export", "validate", "prepare-data", "compare", "evaluate"):
        assert command in names or command.replace("_", "-") in names
        assert CASES[command] >= 25, (command, CASES[command])
