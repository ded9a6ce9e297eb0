"""``python -m trainscale`` = the ``trainscale`` command."""

from trainscale.cli import main

main()
