"""The edge-box image and the compose file: they parse, and every command they run is an
existing `orchard` command with options it accepts. (No container engine runs here.)"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pytest
import typer
import yaml

from orchard.cli import app

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
REPO = DEPLOY.parent


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def check_orchard_argv(argv: list[str]) -> None:
    """Parse ``argv`` (after ``orchard``) with the real CLI, without running anything:
    unknown commands and options fail here as they would in the container."""
    cmd: click.Command = typer.main.get_command(app)
    args, name = list(argv), "orchard"
    while isinstance(cmd, click.Group):
        assert args, f"{argv}: no subcommand of {name}"
        name, args = args[0], args[1:]
        sub = cmd.get_command(click.Context(cmd), name)
        assert sub is not None, f"no command {name!r} in {argv}"
        cmd = sub
    cmd.make_context(name, args, resilient_parsing=False)


def orchard_commands_in_shell(script: str) -> list[list[str]]:
    """Every `orchard ...` invocation in a sh -c script (split on ; && || and pipes)."""
    found = []
    for part in re.split(r";|&&|\|\||\||\bdo\b|\bthen\b", script.replace("$$", "$")):
        words = shlex.split(part.replace(">", " > "), posix=True)
        while words and words[0] in ("exec", "set", "-e"):
            words = words[1:]
        if words and words[0] == "orchard":
            args = words[1:]
            if ">" in args:
                args = args[:args.index(">")]
            found.append(args)
    return found


def test_dockerfile() -> None:
    ins = dockerfile_instructions(DEPLOY / "Dockerfile")
    kinds = [k for k, _ in ins]
    assert kinds[0] in ("FROM", "ARG") and "FROM" in kinds
    users = [a for k, a in ins if k == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    # Every COPY source exists in the repository, and every package folder is copied.
    copied = {a.split()[0] for k, a in ins if k == "COPY"} | {s for k, a in ins if k == "COPY" for s in a.split()[:-1]}
    for src in copied:
        assert (REPO / src).exists(), f"COPY {src}: no such path"
    import tomllib

    pkg_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    assert set(pkg_dirs) <= copied, f"not copied: {set(pkg_dirs) - copied}"
    # CPU torch at the version constraints.txt pins.
    assert any(k == "RUN" and "constraints.txt" in a and "torch==" in a for k, a in ins)
    entry = json.loads(next(a for k, a in ins if k == "ENTRYPOINT"))
    cmd = json.loads(next(a for k, a in ins if k == "CMD"))
    assert entry == ["orchard"] and cmd[:3] == ["client", "start", "--bundle"]
    check_orchard_argv(cmd)
    health = next(a for k, a in ins if k == "HEALTHCHECK")
    probe = json.loads(health[health.index("CMD") + 3:].strip())
    assert probe[0] == "orchard"
    check_orchard_argv(probe[1:])


def test_compose() -> None:
    spec = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = spec["services"]
    clients = [n for n in services if n.startswith("client-")]
    assert {"root", "aggregator"} <= set(services) and len(clients) == 3
    checked = 0
    for name, svc in services.items():
        assert svc["image"] == "orchard-edge:latest" and svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (REPO / svc["build"]["dockerfile"]).is_file()
        entry = svc.get("entrypoint", ["orchard"])
        if entry == ["orchard"]:
            argvs = [svc["command"]]
        else:
            assert entry == ["sh", "-c"], name
            argvs = orchard_commands_in_shell(svc["command"][0])
        assert argvs, f"{name} runs no orchard command"
        for argv in argvs:
            check_orchard_argv(argv)
            checked += 1
        hc = svc.get("healthcheck", {})
        if "test" in hc:
            assert hc["test"][:2] == ["CMD", "orchard"]
            check_orchard_argv(hc["test"][2:])
    assert services["root"]["command"][:2] == ["server", "start"]
    for c in clients:
        assert services[c]["command"][:3] == ["client", "start", "--bundle"]
    assert checked >= 8


def test_the_checker_catches_a_bad_command() -> None:
    with pytest.raises(click.UsageError):
        check_orchard_argv(["client", "start", "--bundel", "/bundle"])
    with pytest.raises((click.UsageError, AssertionError)):
        check_orchard_argv(["clients", "start"])
