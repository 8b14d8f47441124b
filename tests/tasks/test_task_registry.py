import numpy as np
import pytest

from orchard.errors import ConfigError
from orchard.tasks import Task, available_tasks, get_task, task_params
from orchard.trainer import Trainer


def test_available_tasks_lists_the_shipped_tasks() -> None:
    assert "digits" in available_tasks()


def test_unknown_task_names_the_available_ones() -> None:
    with pytest.raises(ConfigError) as err:
        get_task("cifar100")
    assert "digits" in str(err.value) and "cifar100" in str(err.value)


def test_unknown_parameter_lists_accepted_parameters() -> None:
    with pytest.raises(ConfigError) as err:
        get_task("digits", alhpa=0.1)
    assert "alhpa" in str(err.value) and "alpha" in str(err.value)


def test_task_params_reports_defaults() -> None:
    assert task_params("digits")["alpha"] == 0.5


def test_digits_satisfies_the_task_and_trainer_protocols() -> None:
    task = get_task("digits")
    assert isinstance(task, Task)
    assert task.name == "digits"
    assert isinstance(task.client_trainer(0, 4, seed=0), Trainer)
    arrays = task.initial_arrays(seed=0)
    assert all(a.dtype == np.float32 for a in arrays.values())
    assert set(task.evaluate(arrays)) == {"accuracy", "loss"}


# --- one way in: entry points and import paths --------------------------------------

BUILDER = '''
import numpy as np
from torch import nn
from orchard.tasks import make_task

def build(*, hidden: int = 8):
    """A toy task of a user's own."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    return make_task(name="toy", model=lambda: nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2)),
                     data=(x, (x[:, 0] > 0).astype(np.int64)), params={"hidden": hidden})

def not_a_task(*, hidden: int = 8):
    return {"hidden": hidden}

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_toy_task.py").write_text(BUILDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_toy_task"


def test_builtin_tasks_are_entry_points_of_orchards_own_distribution() -> None:
    from orchard.tasks.registry import describe_tasks, registered_tasks

    reg = registered_tasks()
    for name in ("digits", "heart", "mnist", "shakespeare"):
        assert reg[name] == f"orchard.tasks.{name}:build"
    entries = {e.name: e for e in describe_tasks()}
    assert entries["digits"].distribution == "orchard-fl"
    assert "alpha" in {p.name for p in entries["digits"].params}


def test_an_import_path_builds_a_users_task(user_module: str) -> None:
    task = get_task(f"{user_module}:build", hidden=4)
    assert isinstance(task, Task) and task.name == "toy"
    assert task_params(f"{user_module}:build") == {"hidden": 8}
    assert task.initial_arrays(0)["0.weight"].shape == (4, 4)


def test_a_module_that_does_not_import_is_named() -> None:
    from orchard.tasks import TaskNotFound

    with pytest.raises(TaskNotFound) as err:
        get_task("no_such_package_xyz.tasks:build")
    assert "no_such_package_xyz" in str(err.value) and "cannot be imported" in str(err.value)


def test_a_missing_attribute_and_a_non_callable_are_refused(user_module: str) -> None:
    from orchard.tasks import TaskNotFound, TaskTypeError

    with pytest.raises(TaskNotFound, match="no attribute 'missing'"):
        get_task(f"{user_module}:missing")
    with pytest.raises(TaskTypeError, match="not a function"):
        get_task(f"{user_module}:NOT_CALLABLE")


def test_a_builder_returning_the_wrong_type_is_refused(user_module: str) -> None:
    from orchard.tasks import TaskTypeError

    with pytest.raises(TaskTypeError) as err:
        get_task(f"{user_module}:not_a_task")
    assert "returned a builtins.dict" in str(err.value) and "initial_arrays" in str(err.value)


def test_a_parameter_the_task_does_not_accept_is_refused(user_module: str) -> None:
    from orchard.tasks import TaskParamError
    from orchard.tasks.registry import task_problems

    with pytest.raises(TaskParamError) as err:
        get_task(f"{user_module}:build", width=3)
    assert "'width'" in str(err.value) and "accepted: hidden" in str(err.value)
    assert task_problems(f"{user_module}:build", {"width": 3}) == [
        "task_params.width: task 'my_toy_task:build' has no parameter 'width'; accepted: hidden"]
    assert task_problems(f"{user_module}:build", {"hidden": 3}) == []
