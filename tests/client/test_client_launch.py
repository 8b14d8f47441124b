"""orchard.client.launch: a client's options are checked before it joins, each refusal
with what to pass instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.client.launch import ClientOptions, load_policy, resolve_client, trainer_factory
from orchard.config import RunConfig
from orchard.errors import ConfigError, OrchardError


@pytest.mark.parametrize(("opts", "said"), [
    (ClientOptions(server="h:1", task="digits", runtime="jax"), "--runtime must be torch or executorch"),
    (ClientOptions(server="h:1", runtime="executorch"), "pass --bundle DIR"),
    (ClientOptions(task="digits"), "--server HOST:PORT is required"),
    (ClientOptions(server="h:1"), "pass --task NAME"),
])
def test_contradictory_or_missing_options_are_refused(opts: ClientOptions, said: str) -> None:
    with pytest.raises(OrchardError, match=said):
        resolve_client(opts)


def test_a_reference_task_client_refuses_a_run_of_another_task() -> None:
    setup = resolve_client(ClientOptions(server="h:1", task="digits", num_partitions=4, partition=1))
    assert setup.link_config().capabilities == (("task", "digits"),)
    make = trainer_factory(setup)
    assert make(RunConfig(task="digits")) is not None
    with pytest.raises(OrchardError, match="trains task 'digits', but the run is for 'heart'"):
        make(RunConfig(task="heart"))


def test_policy_errors_name_the_file_and_the_field(tmp_path: Path) -> None:
    p = tmp_path / "policy.toml"
    p.write_text("[policy]\nno_such_field = 1\n")
    with pytest.raises(ConfigError, match="policy.toml: policy.no_such_field"):
        load_policy(p)
