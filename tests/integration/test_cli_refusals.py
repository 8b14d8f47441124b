"""Every command meets a refusal with the reason on one line and a non-zero exit, never a
traceback: a live TLS root that refuses (a wrong admin token, a wrong enrollment token,
an aggregator's token used by a client, a run it never had) and, for the commands that
need no server, their own input refused. A command added to `orchard --help` without a
case here fails `test_every_command_has_a_refusal_case`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
import typer
from operator_harness import LiveRoot
from typer.testing import CliRunner

from orchard.cli import app


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def refused(res, code: int | None, *needles: str, one_line: bool = True) -> str:
    """``res`` exited non-zero (``code`` when given) saying every needle, with no traceback."""
    assert res.exit_code != 0, res.output
    if code is not None:
        assert res.exit_code == code, (res.exit_code, res.output)
    assert "Traceback" not in res.output, res.output
    # An exception the command let through is the traceback a user would see.
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    said = " ".join(res.output.split())  # rich wraps long lines
    for n in needles:
        assert n in said, (n, res.output)
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert errors, res.output
    if one_line:
        assert res.output.strip().startswith("error:"), res.output
    return said


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    r = LiveRoot(tmp_path_factory.mktemp("root"), clients=1, aggregators=1)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def wrong_admin(live) -> list[str]:
    return ["--server", live.address, "--admin-token", "orc_admin_wrong", "--ca-cert", str(live.ca)]


TESTED: set[tuple[str, ...]] = set()


def covers(*path: str) -> None:
    TESTED.add(path)


ADMIN_COMMANDS = [
    ("run", "start", "--task", "digits", "--rounds", "1"),
    ("run", "status"),
    ("run", "stop"),
    ("run", "list"),
    ("run", "logs", "latest"),
    ("run", "pull", "latest", "--out", "{tmp}/pulled"),
    ("nodes", "list"),
    ("client", "bundle", "--server", "{server}", "--out", "{tmp}/bundle", "--task", "shakespeare",
     "--no-training-program"),
]


@pytest.mark.parametrize("cmd", ADMIN_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_wrong_admin_token_is_the_roots_message(live, wrong_admin, tmp_path, cmd) -> None:
    args = [a.format(tmp=tmp_path, server=live.address) for a in cmd]
    if args[:2] == ["client", "bundle"]:  # its --server is the address devices dial
        wrong_admin = [a for a in wrong_admin if a not in ("--server", live.address)]
    refused(invoke(*args, *wrong_admin), 1, "UNAUTHENTICATED",
            "the control API needs the admin token", one_line=args[:2] != ["client", "bundle"])
    covers(*cmd[:2])


def test_join_refusals_are_the_roots_message(live) -> None:
    ca = ["--ca-cert", str(live.ca)]
    said = refused(invoke("client", "start", "--server", live.address, "--task", "digits", "--token", "orc_wrong",
                          *ca), 1, "join: unknown or revoked enrollment token", one_line=False)
    assert said.count("error:") == 1
    refused(invoke("aggregator", "start", "--upstream", live.address, "--token", "orc_wrong", *ca), 1,
            "unknown or revoked enrollment token", one_line=False)
    covers("client", "start")
    covers("aggregator", "start")


def test_an_aggregators_token_used_by_a_client_says_so(live) -> None:
    """Through an aggregator, as at the root: the token is valid, and an aggregator's."""
    res = invoke("tokens", "issue", "--data-dir", str(live.data_dir), "--role", "aggregator")
    assert res.exit_code == 0, res.output
    agg_token = res.output.strip()
    agg = live.fed.aggregators[0].address
    for server in (agg, live.address):
        said = refused(invoke("client", "start", "--server", server, "--task", "digits", "--token", agg_token,
                              "--ca-cert", str(live.ca)), 1,
                       "an aggregator's enrollment token, not a client's", "--role client", one_line=False)
        assert "unknown or revoked" not in said and "a aggregator" not in said


def test_run_commands_take_the_run_as_an_argument_and_fail_when_nothing_happened(live) -> None:
    ok = live.cli()
    for cmd in (("run", "status"), ("run", "stop"), ("run", "logs"), ("run", "pull")):
        extra = ("--out", str(live.data_dir.parent / "never")) if cmd[1] == "pull" else ()
        refused(invoke(*cmd, "run-nope", *extra, *ok), 1, "run-nope")
    # The old spelling of `run status` and `run stop` still works, with a note.
    res = invoke("run", "stop", "--run-id", "run-nope", *ok)
    refused(res, 1, "--run-id is deprecated", "run-nope", one_line=False)
    # `run start` follows its run and exits non-zero when the run does not complete: here
    # the operator stops it (a process of its own, so its output and exit code are its own).
    start = subprocess.Popen([sys.executable, "-m", "orchard.cli", "run", "start", *ok, "--task", "digits",
                              "--rounds", "1000", "--clients-per-round", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with live.control() as ctl:
            end = time.monotonic() + 120
            while ctl.status().get("status") != "running":
                assert time.monotonic() < end and start.poll() is None, "the run did not start"
                time.sleep(0.1)
            run_id = ctl.status()["run_id"]
        res = invoke("run", "stop", "latest", *ok)
        assert res.exit_code == 0 and "stopped" in res.output, res.output
        stdout, stderr = start.communicate(timeout=120)
    finally:
        if start.poll() is None:
            start.kill()
    assert start.returncode == 1, (stdout, stderr)
    assert f"started {run_id}" in stdout and "Traceback" not in stdout + stderr
    assert f"error: run {run_id} stopped" in " ".join(stderr.split()), stderr
    # Nothing left to stop: non-zero, saying what the run is.
    refused(invoke("run", "stop", run_id, *ok), 1, f"nothing to stop: run {run_id} is stopped, not running")
    res = invoke("run", "status", run_id, *ok, "--json")
    assert res.exit_code == 0 and '"stopped"' in res.output, res.output


def test_server_start_refuses_a_taken_port_and_a_public_insecure_bind(live, tmp_path) -> None:
    port = live.address.rsplit(":", 1)[1]
    refused(invoke("server", "start", "--data-dir", str(tmp_path / "r1"), "--port", port, "--insecure"), 2,
            f"cannot bind 127.0.0.1:{port}", one_line=False)
    refused(invoke("server", "start", "--data-dir", str(tmp_path / "r2"), "--insecure", "--host", "0.0.0.0"), 2,
            "may only bind a loopback address", one_line=False)
    (tmp_path / "bad.toml").write_text("[server]\nnope = 1\n")
    refused(invoke("server", "start", "--data-dir", str(tmp_path / "r3"), "--config", str(tmp_path / "bad.toml")),
            2, "server.nope: Extra inputs are not permitted", one_line=False)
    covers("server", "start")


def test_commands_without_a_server_refuse_their_input(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "bad.toml").write_text("[run]\nrounds = 0\n")
    cases = [
        (("tokens", "issue", "--data-dir", str(blocker / "x")), 2, "Not a directory"),
        (("tokens", "list", "--data-dir", str(tmp_path)), 2, "no root store"),
        (("tokens", "revoke", "nope", "--data-dir", str(tmp_path)), 2, "no root store"),
        (("certs", "init", "--out", str(blocker)), 2, "exists and is not a directory"),
        (("edge", "infer", "--bundle", str(tmp_path / "none"), "--text", "hi"), 2, "none"),
        (("tasks", "list", "--task", "nowhere_module:build"), 2, "cannot be imported"),
        (("validate", str(tmp_path / "bad.toml")), 1, "rounds"),
        (("baseline", "--task", "nowhere_module:build"), 2, "cannot be imported"),
        (("pretrain", "--config", str(tmp_path / "none.toml")), 2, "does not exist"),
        (("client", "health", "--bundle", str(tmp_path / "none")), 1, "unhealthy"),
        (("demo", "--secure-aggregation", "--codec", "qsgd", "--out", str(tmp_path / "demo")), 2,
         "codec 'qsgd' cannot run under secure aggregation"),
        (("simulate", "--secure-aggregation", "--codec", "qsgd", "--rounds", "1", "--out", str(tmp_path / "sim")),
         2, "codec 'qsgd' cannot run under secure aggregation"),
        (("tune", "--config", str(Path(__file__).resolve().parents[2] / "configs" / "sim.toml"), "--space",
          str(tmp_path / "bad.toml"), "--trials", "2", "--out", str(tmp_path / "tune")), 2, "no [tune] table"),
    ]
    for args, code, needle in cases:
        res = invoke(*args)
        assert res.exit_code == code, (args, res.exit_code, res.output)
        assert "Traceback" not in res.output and needle in " ".join(res.output.split()), (args, res.output)
        assert res.exception is None or isinstance(res.exception, SystemExit), (args, repr(res.exception))
        covers(*[a for a in args[:2] if not a.startswith("-") and "/" not in a][:2])
    assert not (tmp_path / "demo").exists()  # refused before it started anything


def _leaves(cmd: click.Command, path: tuple[str, ...] = ()):
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _leaves(sub, (*path, name))
    else:
        yield path


def test_every_command_has_a_refusal_case(request) -> None:
    """Runs last in this module: each command above registered itself with ``covers``."""
    if request.session.testsfailed or len(TESTED) < 5:
        pytest.skip("needs the other cases of this module to have run")
    leaves = set(_leaves(typer.main.get_command(app)))
    missing = [" ".join(p) for p in sorted(leaves) if not any(p[:len(t)] == t for t in TESTED)]
    assert not missing, f"commands with no refusal case here: {missing}"


def test_the_guard_wraps_every_command() -> None:
    for path in _leaves(typer.main.get_command(app)):
        cmd = typer.main.get_command(app)
        for name in path:
            cmd = cmd.commands[name]  # type: ignore[attr-defined]
        assert getattr(cmd.callback, "__orchard_guarded__", False), path


def test_a_bug_keeps_its_traceback(monkeypatch) -> None:
    """Only refusals are turned into a line: an unexpected exception is a bug, and its
    traceback is the report."""
    import orchard.tasks.registry as registry

    def boom(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(registry, "describe_tasks", boom)
    res = invoke("tasks", "list")
    assert isinstance(res.exception, ZeroDivisionError)
