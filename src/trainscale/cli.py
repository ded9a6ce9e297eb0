"""trainscale's one entry point. Each sub-command is a thin layer over estimate/, runtime/, infer/.

Bad input raises TrainscaleError anywhere below; ``main()`` turns it into one line on stderr and
exit code 2. A job that started and failed (JobFailed) is one line and exit code 1. Anything
unexpected is one line and exit code 1 too, its traceback written to a log file, never the screen.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import typer

from trainscale.errors import JobFailed, TrainscaleError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan and run large-language-model training, from one laptop to a data center.")


def _print_version(value: bool) -> None:
    if value:
        import importlib.metadata

        import trainscale

        try:
            installed = importlib.metadata.version("trainscale")
        except importlib.metadata.PackageNotFoundError:
            installed = trainscale.__version__
        print(f"trainscale {installed}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Plan and run large-language-model training, from one laptop to a data center."""


def _register_commands() -> None:
    """Each public module in trainscale/commands/ defines ``register(app)``; sorted for a stable --help."""
    import importlib
    import pkgutil

    import trainscale.commands as pkg

    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        importlib.import_module(f"trainscale.commands.{info.name}").register(app)
    for command in app.registered_commands:
        _help_as_written(command)


def _help_as_written(command: typer.models.CommandInfo) -> None:
    """A command's help as its module wrote it: square brackets are config sections ("[checkpoint]", "[train]"),
    not Rich markup to be swallowed (escaped once here); and every value's metavar where the module names none:
    its own name (--layout LAYOUT, CHECKPOINT), never the Python type ("<str>", "<int>")."""
    import inspect

    from rich.markup import escape

    callback = command.callback
    if command.help is None and callback.__doc__:
        command.help = escape(inspect.cleandoc(callback.__doc__))
    for name, p in inspect.signature(callback).parameters.items():
        info = p.default
        if not isinstance(info, typer.models.ParameterInfo):
            continue
        if isinstance(info.help, str) and not getattr(info, "_escaped", False):
            info.help = escape(info.help)
            info._escaped = True  # a module imported twice (tests) keeps its OptionInfo objects
        if info.metavar is None and p.annotation not in (bool, "bool"):
            info.metavar = name.upper()


def _flags_show_no_type() -> None:
    """A flag takes no value, so its help row shows no type: typer 0.29 prints "<bool>" for each, --help included
    (the one place its option rows are drawn; a value's row keeps its metavar); an argument's row shows its name
    (CHECKPOINT), not its Python type beside it ("<str>")."""
    shown = typer.core.TyperOption.display_type_rich

    def display_type_rich(self, ctx):
        return "" if self.is_flag else shown(self, ctx)

    typer.core.TyperOption.display_type_rich = display_type_rich
    typer.core.TyperArgument.display_type_rich = lambda self, ctx: ""


_flags_show_no_type()
_register_commands()


def crash_log_path() -> Path:
    """Where an unexpected error's traceback goes: $TRAINSCALE_CRASH_LOG, else the temp folder."""
    return Path(os.environ.get("TRAINSCALE_CRASH_LOG") or Path(tempfile.gettempdir()) / "trainscale-crash.log")


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return " ".join(lines)[:2000] if lines else ""


def report_unexpected(e: BaseException) -> str:
    """Append the traceback to the crash log; -> the one line for the screen."""
    path = crash_log_path()
    where = f"the traceback is in {path}"
    try:
        with open(path, "a", errors="backslashreplace") as f:  # argv may hold non-UTF-8 bytes (surrogates)
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} trainscale {' '.join(sys.argv[1:])}\n")
            f.write("".join(traceback.format_exception(e)))
    except OSError:
        where = "no traceback could be written"
    return f"unexpected {type(e).__name__}: {_one_line(str(e)) or 'no message'} ({where}; please report it)"


def main() -> None:
    try:
        app(standalone_mode=False)
    except JobFailed as e:
        print(f"trainscale: error: {_one_line(str(e))}", file=sys.stderr)
        sys.exit(1)
    except TrainscaleError as e:
        from trainscale.commands._common import user_message

        print(f"trainscale: error: {_one_line(user_message(e))}", file=sys.stderr)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        print("trainscale: aborted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001  (torch's CheckpointException is a BaseException)
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # click's usage errors: one line, exit 2
            print(f"trainscale: error: {_one_line(e.format_message())} (see --help)", file=sys.stderr)
            sys.exit(2)
        print(f"trainscale: error: {report_unexpected(e)}", file=sys.stderr)
        sys.exit(1)
