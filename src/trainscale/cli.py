"""trainscale's one entry point. Each sub-command is a thin layer over estimate/, runtime/, infer/.

Bad input raises TrainscaleError anywhere below; ``main()`` turns it into one line on stderr and
exit code 2.
"""

from __future__ import annotations

import sys

import typer

from trainscale.commands._common import console, emit_json, short_source  # noqa: F401  (re-exported)
from trainscale.errors import TrainscaleError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan and run large-language-model training, from one laptop to a data center.")


@app.callback()
def _root() -> None:
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


_register_commands()


def main() -> None:
    try:
        app(standalone_mode=False)
    except TrainscaleError as e:
        print(f"trainscale: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        print("trainscale: aborted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # click's usage errors (typer vendors click): show them, exit 2
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            sys.exit(2)
        raise
