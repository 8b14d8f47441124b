"""Tasks: what every Orchard command trains and evaluates.

A task is data with client partitions, a model, a client trainer and central
evaluation (:class:`Task`). Orchard's own tasks (digits, mnist, heart, shakespeare)
and a user's are found the same way (:mod:`orchard.tasks.registry`): by a name
registered as an entry point of group ``orchard.tasks``, or by an import path
``package.module:build``. :func:`make_task` builds one from a model factory, a dataset,
a loss and a partitioner (docs/your-task.md).

```python
from orchard.tasks import get_task, available_tasks
task = get_task("digits", alpha=0.5)
arrays = task.initial_arrays(seed=0)
trainer = task.client_trainer(partition_id=3, num_partitions=10, seed=0)
print(task.evaluate(arrays))   # {"accuracy": ..., "loss": ...}
```
"""

from orchard.tasks.core import SupervisedTask, Task
from orchard.tasks.data import Arrays, Csv, DataError, ImageFolder, Npz, Parquet, Text, load_data
from orchard.tasks.make import LoRA, TaskSpecError, make_task
from orchard.tasks.partition import LabelSkew, Partition
from orchard.tasks.partitioners import IID, ByColumn, Dirichlet, Shards
from orchard.tasks.registry import (
    TaskNotFound,
    TaskParamError,
    TaskTypeError,
    available_tasks,
    get_task,
    task_params,
    train_defaults,
    trains_with,
)

__all__ = [
    "IID",
    "Arrays",
    "ByColumn",
    "Csv",
    "DataError",
    "Dirichlet",
    "ImageFolder",
    "LabelSkew",
    "LoRA",
    "Npz",
    "Parquet",
    "Partition",
    "Shards",
    "SupervisedTask",
    "Task",
    "TaskNotFound",
    "TaskParamError",
    "TaskSpecError",
    "TaskTypeError",
    "Text",
    "available_tasks",
    "get_task",
    "load_data",
    "make_task",
    "task_params",
    "train_defaults",
    "trains_with",
]
