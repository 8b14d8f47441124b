"""`orchard run list | logs | pull` against a live TLS root, and their refusals of bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from operator_harness import LiveRoot
from typer.testing import CliRunner

from orchard.cli import app
from orchard.tasks import get_task


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    r = LiveRoot(tmp_path_factory.mktemp("root"))
    r.run_id = r.start_run(rounds=2)
    r.wait(r.run_id, lambda st: st["status"] != "running")
    # The log's closing line follows within one observer interval.
    res = invoke("run", "logs", r.run_id, *r.cli(), "--follow")
    assert res.exit_code == 0 and "completed after 2 rounds" in res.output, res.output
    yield r
    r.stop()


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line_error(res, *needles: str) -> None:
    assert res.exit_code != 0, res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    for n in needles:
        assert n in lines[0], lines[0]


def test_run_list(live) -> None:
    res = invoke("run", "list", *live.cli(), "--json")
    assert res.exit_code == 0, res.output
    runs = json.loads(res.output)
    assert [r["run_id"] for r in runs] == [live.run_id]
    assert runs[0]["status"] == "completed" and runs[0]["completed_rounds"] == 2 and runs[0]["task"] == "digits"
    res = invoke("run", "list", *live.cli())
    assert res.exit_code == 0 and live.run_id in res.output and "completed" in res.output


def test_run_logs(live) -> None:
    res = invoke("run", "logs", live.run_id, *live.cli(), "--json")
    assert res.exit_code == 0, res.output
    msgs = [json.loads(line)["message"] for line in res.output.splitlines()]
    assert msgs[0].startswith(f"run {live.run_id} started: task digits, 2 rounds")
    assert any(m.startswith("round 1 attempt 0 opened: 3 selected") for m in msgs), msgs
    assert any(m.startswith("round 2 attempt 0 completed: 3 updates of 3 selected") for m in msgs), msgs
    assert msgs[-1] == f"run {live.run_id} completed after 2 rounds"
    # --follow on a finished run prints the same and returns.
    res = invoke("run", "logs", "latest", *live.cli(), "--follow")
    assert res.exit_code == 0 and "completed after 2 rounds" in res.output


def test_run_pull(live, tmp_path) -> None:
    res = invoke("run", "pull", live.run_id, "--out", str(tmp_path / "final"), *live.cli())
    assert res.exit_code == 0, res.output
    info = json.loads((tmp_path / "final" / "run.json").read_text())
    assert info["round"] == 2 and info["run_id"] == live.run_id and info["task"] == "digits"
    report = json.loads((tmp_path / "final" / "report.json").read_text())
    assert report["completed_rounds"] == 2
    from safetensors.torch import load_file

    model = get_task("digits").build_model(0)
    model.load_state_dict(load_file(str(tmp_path / "final" / "model.safetensors")))
    with live.control() as ctl:
        from orchard import wire

        want = wire.blob_to_arrays(ctl.pull_global(live.run_id, 2))
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want[k])
    # Round 0 is the initial model.
    res = invoke("run", "pull", live.run_id, "--round", "0", "--out", str(tmp_path / "r0"), *live.cli(), "--json")
    assert res.exit_code == 0, res.output
    from safetensors.numpy import load_file as np_load

    init = get_task("digits").initial_arrays(0)
    got = np_load(str(tmp_path / "r0" / "model.safetensors"))
    assert all(np.array_equal(got[k], init[k]) for k in init)


def test_unknown_run_is_refused(live, tmp_path) -> None:
    one_line_error(invoke("run", "logs", "run-nope", *live.cli()), "NOT_FOUND", "run-nope")
    one_line_error(invoke("run", "pull", "run-nope", "--out", str(tmp_path / "x"), *live.cli()), "run-nope",
                   "orchard run list")
    one_line_error(invoke("run", "status", "run-nope", *live.cli()), "run-nope")


@pytest.mark.parametrize("rnd", ["3", "-1"])
def test_round_out_of_range_is_refused(live, tmp_path, rnd: str) -> None:
    res = invoke("run", "pull", live.run_id, "--round", rnd, "--out", str(tmp_path / "x"), *live.cli())
    one_line_error(res, f"round {rnd} is out of range", "rounds 0 (the initial model) to 2")


def test_wrong_token_is_refused(live, tmp_path) -> None:
    bad = ["--server", live.address, "--admin-token", "orc_admin_wrong", "--ca-cert", str(live.ca)]
    for args in (["run", "list"], ["run", "logs", live.run_id], ["run", "pull", live.run_id, "--out", str(tmp_path)]):
        one_line_error(invoke(*args, *bad), "UNAUTHENTICATED", "admin token")


def test_unwritable_out_is_refused(live, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    one_line_error(invoke("run", "pull", live.run_id, "--out", str(blocker / "sub"), *live.cli()),
                   "cannot write to --out")
    one_line_error(invoke("run", "pull", live.run_id, "--out", str(blocker), *live.cli()), "is a file")


def test_missing_ca_is_refused(live, tmp_path) -> None:
    res = invoke("run", "list", "--server", live.address, "--admin-token", live.admin,
                 "--ca-cert", str(tmp_path / "nope.pem"))
    one_line_error(res, "nope.pem")


def test_run_start_takes_task_params(tmp_path) -> None:
    live = LiveRoot(tmp_path / "root")
    try:
        res = invoke("run", "start", *live.cli(), "--task", "digits", "--rounds", "1", "--clients-per-round", "3",
                     "--task-param", "alpha=0.3", "--task-param", "split_seed=2")
        assert res.exit_code == 0, res.output
        (run,) = json.loads(invoke("run", "list", *live.cli(), "--json").output)
        assert run["status"] == "completed"
        assert run["config"]["task_params"] == {"alpha": 0.3, "split_seed": 2}
        # Config problems keep the house format: every problem listed under "invalid configuration".
        for bad, why in (("nope", "KEY=VALUE"), ("nope=1", "has no parameter 'nope'")):
            res = invoke("run", "start", *live.cli(), "--task", "digits", "--task-param", bad)
            assert res.exit_code != 0 and "Traceback" not in res.output and why in res.output, res.output
            assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    finally:
        live.stop()
