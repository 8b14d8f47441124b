"""Every command's --help says what its source says: rich reads ``[word]`` in a help text
as a style tag and drops it, so ``TOML with a [server] table`` printed as ``TOML with a
table``. Brackets meant literally are escaped (``\\[server]``); this walks every command
and option and checks each bracketed text reaches the rendered help."""

from __future__ import annotations

import re

import click
import typer
from typer.testing import CliRunner

from orchard.cli import app

BRACKETED = re.compile(r"(?<!\\)\[([^\]\[]+)\]")


def _commands(cmd: click.Command, path: tuple[str, ...] = ()):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*path, name))


def _texts(cmd: click.Command) -> list[str]:
    texts = [cmd.help or "", cmd.short_help or ""]
    texts += [getattr(p, "help", None) or "" for p in cmd.params]
    return texts


def test_every_bracketed_help_text_is_printed() -> None:
    root = typer.main.get_command(app)
    runner = CliRunner()
    checked = 0
    for path, cmd in _commands(root):
        wanted = [m.group(0) for t in _texts(cmd) for m in BRACKETED.finditer(t)]
        escaped = [m.group(0)[1:] for t in _texts(cmd) for m in re.finditer(r"\\\[[^\]\[]+\]", t)]
        if not wanted and not escaped:
            continue
        result = runner.invoke(app, [*path, "--help"], terminal_width=400)
        assert result.exit_code == 0, result.output
        flat = " ".join(result.output.split())
        # An unescaped tag that rich accepted vanishes from the output: it must not exist.
        assert not wanted, f"`orchard {' '.join(path)}`: escape {wanted} in its help (rich drops them)"
        for text in escaped:
            assert text in flat, f"`orchard {' '.join(path)} --help` lost {text!r}"
            checked += 1
    assert checked >= 3  # the --config options of server start, aggregator start and simulate
