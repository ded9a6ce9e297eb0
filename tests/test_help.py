"""Help text as written and one number parser (issue 35): `train --help` keeps "[checkpoint]" and "[train]" (config
sections, not Rich markup), flags show no "<bool>" and values their own name, not "<str>"; every --tokens reads
2T the way `plan --tokens` always did."""

from __future__ import annotations

import json

import pytest
from _cli import run_cli

from trainscale.cli import app


def test_train_help_keeps_its_config_sections_and_shows_real_metavars(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    code, out = run_cli(monkeypatch, capsys, "train", "--help")
    assert code == 0
    assert "the config's [checkpoint] section" in out and "or [train] compile = true" in out
    assert "<bool>" not in out and "<str>" not in out and "<int>" not in out
    assert "--layout LAYOUT" in out and "--set SECTION.KEY=VALUE" in out
    assert "│ --plan ask the planner" in out or "--plan ask the planner" in out  # a flag: no metavar


def test_no_command_shows_a_python_type_for_a_parameter(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    for command in app.registered_commands:
        name = command.name or command.callback.__name__.replace("_", "-")
        code, out = run_cli(monkeypatch, capsys, name, "--help")
        assert code == 0 and "<bool>" not in out and "<str>" not in out and "<path>" not in out, (name, out[:600])


@pytest.mark.parametrize("command", ["plan", "explain", "report"])
def test_every_tokens_option_reads_2T(monkeypatch, capsys, tmp_path, command):
    extra = ["--out", str(tmp_path / "r")] if command == "report" else []
    code, out = run_cli(monkeypatch, capsys, command, "--tokens", "2Q", *extra)
    assert code == 2 and "--tokens '2Q' is not a number (suffixes K, M, G/B, T are allowed)" in out
    if command == "explain":
        code, out = run_cli(monkeypatch, capsys, command, "--tokens", "2T", "--json")
        assert code == 0 and json.loads(out)["inputs"]["tokens"] == 2e12
