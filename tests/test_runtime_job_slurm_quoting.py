"""No value reaches the shell of the batch script `trainscale launch --slurm` writes (issue 23).

Shell text ($(...), backticks, ';', '|', '&&', quotes, blanks, $HOME) is put in every field a user controls
(--out, --python, --env values, the config's [run] out and name, the config's own path); the script is then RUN
with bash, with fake `srun`, `sbatch`, `scontrol` and `python` (small scripts that write their argv one per line),
and: no marker file appears, and the fake srun received each value byte-for-byte as one argument (or variable).
No real Slurm is needed (the real-Slurm tests are tests/test_runtime_job_slurm.py, marked `service`). --setup is the one
field that is shell by design: it runs, and cannot swallow the lines after it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainscale.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
BASE = ("launch", "--slurm", "--cpu", "--layout", "dp2", "--nodes", "1", "--gpus-per-node", "2", "--cpus-per-gpu", "1")

# {m} is the marker file each value would create if a shell ran it (relative: bash runs in the work folder)
NASTY = [
    "$(touch {m})", "`touch {m}`", "a; touch {m}", "a | touch {m}", "a && touch {m}", "a || touch {m}",
    "it's; touch {m}; '", 'say "hi"; touch {m}; "', "'$(touch {m})'", '"$(touch {m})"', "\\$(touch {m})",
    "with  two spaces", "$HOME/runs", "${{HOME}}x", "~/runs", "*", "a>b<c", "x #not a comment", "$((1+1))",
    "a\tb &", "!!", "runs/ok",
]
FAKE = {  # argv one per line into $FAKE_DIR/<name>.argv; scontrol answers `show hostnames` with one host
    "srun": 'printf "%s\\n" "$@" > "$FAKE_DIR/srun.argv"\nprintf "%s\\n" "$TRAINSCALE_SAVE_REQUEST" '
            '"$OMP_NUM_THREADS" "$TORCH_NCCL_ASYNC_ERROR_HANDLING" "$NCCL_DEBUG" "${TS_VALUE-unset}" '
            '"$PYTORCH_CUDA_ALLOC_CONF" > "$FAKE_DIR/srun.env"\n'
            # FAKE_STOP: leave the mark the trainer leaves after the early checkpoint; FAKE_RC: srun's exit code
            '[ -n "${FAKE_STOP:-}" ] && echo 8 > "$TRAINSCALE_STOPPED"\nexit "${FAKE_RC:-0}"\n',
    "sbatch": 'printf "%s\\n" "$@" > "$FAKE_DIR/sbatch.argv"\necho "Submitted batch job 42"\n',
    "scontrol": 'echo "$*" >> "$FAKE_DIR/scontrol.argv"\n[ "$1" = show ] && echo node7\nexit 0\n',
}
# the Python the script checks (`"$py" -c 'import trainscale'`) before srun: it answers yes
FAKE_PYTHON = '#!/bin/sh\nprintf "%s\\n" "$@" > "$FAKE_DIR/python.argv"\nexit 0\n'


def fake_python(path: Path, body: str = FAKE_PYTHON) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(0o755)
    return path


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A work folder (bash's cwd), a HOME, and a bin folder of fake Slurm commands."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    for name, body in FAKE.items():
        (fake / name).write_text("#!/bin/sh\n" + body)
        (fake / name).chmod(0o755)
    for sub in ("work", "home", "scripts", "configs"):
        (tmp_path / sub).mkdir()
    fake_python(tmp_path / "pybin" / "python")
    monkeypatch.setenv("TRAINSCALE_CRASH_LOG", str(tmp_path / "crash.log"))
    monkeypatch.chdir(tmp_path / "work")  # where `launch` runs: the script's --chdir
    return tmp_path


def ts(capsys, monkeypatch, *args: object) -> tuple[int, str, str]:
    """`trainscale ARGS` in this process -> (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["trainscale", *map(str, args)])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def config(env: Path, file_name: str, name: str, out: str) -> Path:
    """tiny.toml under FILE_NAME (its path is a value too) with [run] out = OUT and name = NAME."""
    text = TINY.read_text().replace('name = "tiny"\n', f"name = {json.dumps(name)}\n", 1)
    text = text.replace('out = "runs/tiny"', f"out = {json.dumps(out)}", 1)
    assert f"out = {json.dumps(out)}" in text
    path = env / "configs" / file_name.replace("/", "_")
    path.write_text(text)
    return path


def run_script(env: Path, script: Path, **extra: str) -> subprocess.CompletedProcess:
    """The batch script run by bash as Slurm would start it, the fake srun/scontrol first on PATH, from another
    folder than the one launch ran in (the script's own `cd` must take it there); TRAINSCALE_PYTHON is the fake
    python unless ``extra`` says otherwise."""
    for f in env.glob("fakebin/*.argv"):
        f.unlink()
    e = {"PATH": f"{env / 'fakebin'}:{os.environ['PATH']}", "HOME": str(env / "home"), "FAKE_DIR": str(env / "fakebin"),
         "SLURM_NNODES": "1", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[7]", "LC_ALL": "C",
         "TRAINSCALE_PYTHON": str(env / "pybin" / "python"), **extra}
    return subprocess.run(["bash", str(script)], cwd=env / "home", env=e, capture_output=True, text=True, timeout=60)


def srun_argv(env: Path) -> list[str]:
    return (env / "fakebin" / "srun.argv").read_text().split("\n")[:-1]


def markers(env: Path) -> list[Path]:
    return [p for p in env.rglob("M*") if re.fullmatch(r"M\d\d", p.name)]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(NASTY)))
def test_every_user_value_reaches_srun_as_one_argument(env, capsys, monkeypatch, i):
    value = NASTY[i].format(m=f"M{i:02d}")
    cfg = config(env, f"{value}.toml", name=value, out=value)
    # --python names a file whose path holds the value (the fake python made there answers the import check)
    python_at = fake_python(env / "pybin" / value / "python")
    for via_config in (False, True):  # --out, --python, --env and the config's path; then the config's [run] out
        script = env / "scripts" / f"run{int(via_config)}.sbatch"
        extra = () if via_config else (f"--out={value}", f"--python={python_at}", f"--env=TS_VALUE={value}")
        code, out, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--script", script, *extra)
        assert code == 0, err
        p = run_script(env, script)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "[slurm] training ended with exit code 0" in p.stdout
        assert markers(env) == [], script.read_text()
        argv = srun_argv(env)
        python = env / "pybin" / "python" if via_config else python_at  # $TRAINSCALE_PYTHON, or --python
        assert argv[:4] == ["--ntasks-per-node=1", "--cpus-per-task=2", "--kill-on-bad-exit=1", str(python)]
        assert (env / "fakebin" / "python.argv").read_text() == "-c\nimport trainscale\n"  # checked first
        assert argv[4:8] == ["-m", "torch.distributed.run", "--nnodes", "1"]
        assert f"--out={value}" in argv and f"--config={cfg.resolve()}" in argv and "--resume" in argv
        # the job's own rendezvous port: 20000 + 42 % 12768
        assert argv[argv.index("--rdzv-endpoint") + 1] == "node7:20042" and argv[argv.index("--rdzv-id") + 1] == "42"
        # the --env value arrives as it was given; the NCCL defaults are set
        assert (env / "fakebin" / "srun.env").read_text().split("\n")[:6] == [
            str(Path(value) / ".save-request"), "1", "1", "WARN", "unset" if via_config else value,
            "expandable_segments:True"]
        assert (env / "work" / value).is_dir()  # mkdir made the folder named by the value itself, unexpanded
        assert f"#SBATCH --chdir={env / 'work'}\n" in script.read_text()
        assert not (env / "home" / "runs").exists() and not (env / "work" / "x").exists()
        # the job name comes from the config's name, reduced to Slurm's name syntax
        assert re.search(r"^#SBATCH --job-name=[A-Za-z0-9._-]+$", script.read_text(), re.M)


def test_a_value_that_starts_with_a_dash(env, capsys, monkeypatch):
    cfg = config(env, "c.toml", "c", "runs/c")
    script = env / "scripts" / "dash.sbatch"
    code, _, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--script", script, "--out=-rf")
    assert code == 0, err
    assert run_script(env, script).returncode == 0 and "--out=-rf" in srun_argv(env)
    assert (env / "work" / "-rf").is_dir()  # mkdir -p -- '-rf'
    code, _, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--python=--pty")
    assert code == 2 and "--python '--pty' must be a path" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("field", ["--partition", "--account", "--time", "--mem", "--inject"])
def test_slurm_names_with_shell_text_are_refused(env, capsys, monkeypatch, field):
    cfg = config(env, "c.toml", "c", "runs/c")
    for i, raw in enumerate(NASTY):
        value = raw.format(m=f"M{i:02d}")
        code, out, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, f"{field}={value}")
        if code == 0:  # only a value in Slurm's own syntax passes, and it appears as it is
            assert field in ("--partition", "--account") and re.fullmatch(r"[A-Za-z0-9._-]+", value), value
            continue
        assert code == 2 and len(err.strip().splitlines()) == 1, (field, value, err)
    assert markers(env) == []


def test_a_script_folder_sbatch_would_misread_is_refused(env, capsys, monkeypatch):
    cfg = config(env, "c.toml", "c", "runs/c")
    folder = env / "scripts" / "my jobs"
    folder.mkdir()
    code, _, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--script", folder / "x.sbatch")
    assert code == 2 and "#SBATCH --output" in err and len(err.strip().splitlines()) == 1, err
    assert not (folder / "x.sbatch").exists()


def test_setup_is_the_one_shell_line_and_cannot_swallow_the_rest(env, capsys, monkeypatch):
    cfg = config(env, "c.toml", "c", "runs/c")
    script = env / "scripts" / "setup.sbatch"
    # by design: the user's own line runs on the node
    code, _, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--script", script, "--setup", "touch SETUP_RAN")
    assert code == 0, err
    assert run_script(env, script).returncode == 0 and (env / "work" / "SETUP_RAN").exists()
    # lines that, pasted raw, would swallow the srun line (an open here-document, a line continuation)
    for setup in ("cat <<EOF", "echo a \\", "echo '#'; # trailing comment"):
        code, _, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--script", script, "--setup", setup)
        assert code == 0, (setup, err)
        (env / "fakebin" / "srun.env").unlink(missing_ok=True)
        p = run_script(env, script)
        assert p.returncode == 0 and "--out=runs/c" in srun_argv(env), (setup, p.stdout, p.stderr)
    # a line bash cannot parse is the user's mistake: one sentence, exit 2
    for setup in ("if true; then", "echo $(", "source x; fi"):
        code, _, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--setup", setup)
        assert code == 2 and "--setup" in err and "bash can parse" in err, (setup, err)
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash -n needs bash")
def test_bash_n_catches_a_quoting_bug(env, capsys, monkeypatch):
    """The safety net: were a value ever written unquoted, `bash -n` on the written script says it is a bug
    (one sentence, exit 1) instead of handing Slurm a broken script."""
    import trainscale.runtime.job.slurm as slurm

    real = slurm.sh
    monkeypatch.setattr(slurm, "sh", lambda v: real(v) if isinstance(v, slurm.Var) else str(v))  # the old bug
    cfg = config(env, "c.toml", "c", "runs/c")
    code, out, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--out", "it's")
    assert code == 1 and "bug in trainscale" in err and "please report it" in err, err
    assert len(err.strip().splitlines()) == 1 and out == ""
    monkeypatch.setattr(slurm, "sh", real)
    with pytest.raises(slurm.JobFailed, match="does not parse"):
        slurm.check_script("#!/bin/bash\nif true; then\n")
    slurm.check_script("#!/bin/bash\necho ok\n")


def test_the_python_is_found_on_the_node_and_must_import_trainscale(env, capsys, monkeypatch):
    cfg = config(env, "c.toml", "c", "runs/c")
    script = env / "scripts" / "py.sbatch"
    code, _, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--script", script)
    assert code == 0, err
    assert sys.executable not in script.read_text()  # nothing of the generating machine's Python is written
    # no TRAINSCALE_PYTHON: python3 on the node's PATH
    fake_python(env / "fakebin" / "python3")
    p = run_script(env, script, TRAINSCALE_PYTHON="")
    assert p.returncode == 0 and srun_argv(env)[3] == str(env / "fakebin" / "python3"), p.stderr
    # a Python without trainscale: one line in the log, exit 1, nothing started
    bad = fake_python(env / "pybin" / "bare", "#!/bin/sh\nexit 1\n")
    p = run_script(env, script, TRAINSCALE_PYTHON=str(bad))
    assert p.returncode == 1 and not (env / "fakebin" / "srun.argv").exists()
    assert p.stderr.strip() == (f"[slurm] python {bad} on {os.uname().nodename} cannot import trainscale: give "
                                "--python to trainscale launch, set TRAINSCALE_PYTHON, or activate its environment "
                                "in --setup"), p.stderr


def test_the_job_requeues_itself_after_the_early_checkpoint(env, capsys, monkeypatch):
    """The shell's side of the requeue, with the fake srun playing the trainer: the trainer's mark (checkpointed
    before the time limit, steps left) and exit 0 -> `scontrol requeue` of the job itself, up to --max-resubmits;
    no mark (the run finished) or a failure -> no requeue."""
    cfg = config(env, "c.toml", "c", "runs/c")
    script = env / "scripts" / "rq.sbatch"
    code, _, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--script", script, "--max-resubmits", "2")
    assert code == 0, err
    scontrol = env / "fakebin" / "scontrol.argv"
    stopped = env / "work" / "runs" / "c" / ".stopped-for-requeue"
    for extra, rc, requeued, says in (
            ({"FAKE_STOP": "1"}, 0, True, "requeueing job 42 (resubmit 1 of 2)"),
            ({"FAKE_STOP": "1", "SLURM_RESTART_COUNT": "1"}, 0, True, "(resubmit 2 of 2)"),
            ({"FAKE_STOP": "1", "SLURM_RESTART_COUNT": "2"}, 75, False, "not requeueing: 2 of --max-resubmits 2"),
            ({}, 0, False, "training ended with exit code 0"),  # finished: never resubmits
            ({"FAKE_STOP": "1", "FAKE_RC": "3"}, 3, False, "training ended with exit code 3")):
        (env / "work" / "runs" / "c" / ".save-request").parent.mkdir(parents=True, exist_ok=True)
        (env / "work" / "runs" / "c" / ".save-request").write_text("")  # a stale request: removed before srun
        scontrol.unlink(missing_ok=True)
        p = run_script(env, script, **extra)
        assert p.returncode == rc and says in p.stdout, (extra, p.stdout, p.stderr)
        assert ("requeue 42" in scontrol.read_text().splitlines()) == requeued, extra
        assert not stopped.exists() or extra.get("FAKE_RC"), extra  # the mark is consumed
        assert not (env / "work" / "runs" / "c" / ".save-request").exists()
        stopped.unlink(missing_ok=True)


def test_env_and_signal_values_that_would_break_the_job_are_refused(env, capsys, monkeypatch):
    cfg = config(env, "c.toml", "c", "runs/c")
    for extra, msg in ((("--env", "NCCL_DEBUG"), "is not KEY=VALUE"),
                       (("--env", "A B=1"), "is not an environment variable name"),
                       (("--env", "$(touch M00)=1"), "is not an environment variable name"),
                       (("--env", "SLURM_JOB_ID=7"), "is set by Slurm or the batch script"),
                       (("--env", "TRAINSCALE_STOPPED=x"), "is set by Slurm or the batch script"),
                       (("--env", "X=a\nb"), "line break"),
                       (("--time", "1", "--signal-before", "60"), "is not below --time 1 (60 s)"),
                       (("--max-resubmits", "-1"), "--max-resubmits")):
        code, out, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, *extra)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, (extra, err)
    code, out, err = ts(capsys, monkeypatch, *BASE, "--config", cfg, "--env", "NCCL_DEBUG=INFO", "--env", "E=",
                        "--time", "1", "--signal-before", "59")
    assert code == 0 and "export NCCL_DEBUG=INFO\nexport E=\n" in out, err
    assert markers(env) == []
