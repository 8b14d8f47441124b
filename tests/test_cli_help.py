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


def test_the_cli_package_is_shipped() -> None:
    """pyproject lists packages one by one: a subpackage of orchard/ left out of the list
    is missing from the wheel (the editable install would not notice)."""
    import tomllib
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    subpackages = {f"orchard.{p.parent.name}" for p in (repo / "orchard").glob("*/__init__.py")}
    assert "orchard.cli" in subpackages and subpackages <= listed, subpackages - listed


def test_module_form_and_run_start_without_the_simulator(tmp_path) -> None:
    """`python -m orchard.cli` is the command; `run start` builds its config and initial
    model without importing the simulator (an unreachable root ends it with one line)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    helped = subprocess.run([sys.executable, "-m", "orchard.cli", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert helped.returncode == 0 and "simulate" in helped.stdout, helped.stderr
    script = (
        "import sys\n"
        "from orchard.cli import main\n"
        f"sys.argv = ['orchard', 'run', 'start', '--server', '127.0.0.1:{port}', '--insecure', '--detach',\n"
        "            '--task', 'digits', '--task-param', 'alpha=0.5']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    print('EXIT', e.code)\n"
        "print('SIM', sorted(m for m in sys.modules if m.startswith('orchard.simulation.')))\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "EXIT 1" in res.stdout and "UNAVAILABLE" in res.stderr and "Traceback" not in res.stderr, res
    loaded = res.stdout.split("SIM ", 1)[1]
    # Registering `simulate` loads its command module and the config it validates, nothing
    # that runs a simulation.
    assert "defaults" not in loaded and "runner" not in loaded and "engine" not in loaded, loaded
