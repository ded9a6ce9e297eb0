"""``trainscale ...`` in the test's own process, through the command line's error handling (cli.main): the exit
code and the words a person reads, without a new interpreter's start-up."""

from __future__ import annotations


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """-> (exit code, stdout + stderr, whitespace runs as one space)."""
    from trainscale.cli import main

    monkeypatch.setattr("sys.argv", ["trainscale", *args])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, " ".join((out.out + out.err).split())
