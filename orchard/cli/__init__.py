"""The ``orchard`` command. Each command is a short recipe: validate, build, run, print.

One module per command group (``server``, ``aggregator``, ``client``, ``edge``, ``run``,
``nodes``, ``credentials`` for certs and tokens, ``local`` for validate, demo, baseline
and pretrain); ``app`` puts them together. The work itself is library code
(:mod:`orchard.runs`, :mod:`orchard.client.launch`, :mod:`orchard.tasks.params`, ...).

The CLI is the top of the dependency graph: it imports the subpackages lazily inside
each command so that ``orchard --help`` stays fast.
"""

from orchard.cli.app import app, main

__all__ = ["app", "main"]
