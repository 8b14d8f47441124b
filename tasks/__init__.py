"""Reference workloads: datasets shipped in ``data/`` with client partitions, models,
and train/eval steps.

```python
from orchard.tasks import get_task, available_tasks
task = get_task("digits", alpha=0.5)
arrays = task.initial_arrays(seed=0)
trainer = task.client_trainer(partition_id=3, num_partitions=10, seed=0)
print(task.evaluate(arrays))   # {"accuracy": ..., "loss": ...}
```
"""

from orchard.tasks.core import SupervisedTask, Task
from orchard.tasks.partition import LabelSkew, Partition
from orchard.tasks.registry import available_tasks, get_task, task_params

__all__ = [
    "LabelSkew",
    "Partition",
    "SupervisedTask",
    "Task",
    "available_tasks",
    "get_task",
    "task_params",
]
