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
