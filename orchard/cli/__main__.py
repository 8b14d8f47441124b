"""``python -m orchard.cli``: the ``orchard`` command."""

from orchard.cli.app import main

main()
