"""The package as users get it: committed stubs are fresh, the wheel's layout is right,
and the CLI's validation reports every problem at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchard.cli import app
from orchard.protogen import GENERATED, REPO, generate


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    generate(tmp_path)
    for rel in GENERATED:
        fresh = (tmp_path / rel).read_text()
        committed = (REPO / rel).read_text()
        assert fresh == committed, f"{rel} is stale: run `make proto` and commit the result"


def test_wheel_layout_and_imports_from_elsewhere(tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(REPO)], check=True, cwd=tmp_path)
    top = {p.name for p in target.iterdir()}
    for forbidden in ("server", "client", "aggregation", "compression", "secure_agg", "edge_runtime", "tasks"):
        assert forbidden not in top, f"{forbidden!r} landed at the top of site-packages"
    assert (target / "orchard" / "server" / "coordinator.py").is_file()
    assert (target / "orchard" / "py.typed").is_file()
    assert any((target / "orchard" / "tasks" / "data").rglob("*.csv.gz")), "task data not shipped"
    code = ("import orchard.server, orchard.client, orchard.aggregation, orchard.secure_agg, orchard.edge_runtime;"
            "print(orchard.server.__file__)")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env, capture_output=True,
                         text=True).stdout
    assert out.strip().startswith(str(target))


def test_validate_accepts_the_shipped_config() -> None:
    r = CliRunner().invoke(app, ["validate", str(REPO / "configs" / "run.toml")])
    assert r.exit_code == 0, r.output
    assert "OK" in r.output


@pytest.mark.parametrize(("config", "expected"), [
    pytest.param("""
[run]
task = "no-such-task"
rounds = 0
[run.cohort]
target = 0
[run.codec]
name = "topk"
[run.secure_aggregation]
enabled = true
""", ("rounds", "cohort.target"), id="every-problem-at-once"),
    pytest.param("""
[run]
task = "no-such-task"
[run.codec]
name = "topk"
[run.secure_aggregation]
enabled = true
""", ("secure_aggregation", "topk", "no-such-task", "available"), id="codec-and-secure-aggregation-together"),
])
def test_validate_reports_every_problem(tmp_path: Path, config: str, expected: tuple[str, ...]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(config)
    r = CliRunner().invoke(app, ["validate", str(bad)])
    assert r.exit_code == 1
    assert all(word in r.output for word in expected), r.output


@pytest.mark.parametrize("cmd", [["--help"], ["server", "start", "--help"], ["aggregator", "start", "--help"],
                                 ["client", "start", "--help"], ["run", "start", "--help"],
                                 ["run", "status", "--help"], ["demo", "--help"]])
def test_cli_help(cmd: list[str]) -> None:
    r = CliRunner().invoke(app, cmd)
    assert r.exit_code == 0, r.output
