"""A LoRA task whose clients train through its ExecuTorch training program: what the
simulator runs for ``orchard simulate --runtime executorch``.

The wrapper exports the task's program once (as ``orchard client bundle`` would, into a
directory it owns) and hands out :class:`~orchard.edge_runtime.et_trainer.ExecuTorchTrainer`
clients on each partition's data, seeded as the task's own torch clients are
(``seed * 1_000_003 + partition``). Everything else (partitions, initial arrays,
evaluation) is the wrapped task's. A loaded program is stateful (its parameters and
planned memory), so each thread gets its own load; trainers of one thread run one at
a time, as the simulator's local backend runs them.

Needs torch (the task's data and the export); the device runtime itself does not.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

from orchard.errors import ConfigError

from .et_export import export_training_program
from .et_program import TrainingProgram, load_training_program
from .et_trainer import DeviceData, ExecuTorchTrainer


class ExecuTorchTask:
    def __init__(self, task: Any, *, micro_batch: int = 8) -> None:
        if not task.params.get("lora") or task.trainable is None or "vocab" not in task.info:
            raise ConfigError(
                f"runtime 'executorch' trains a LoRA text task's ExecuTorch program; task {task.name!r} with "
                f"these parameters is not one (use shakespeare with lora = true)"
            )
        self.task = task
        self._dir = Path(tempfile.mkdtemp(prefix="orchard-et-task-"))
        weakref.finalize(self, shutil.rmtree, self._dir, True)
        self.manifest = export_training_program(
            task.build_model(), task.trainable, self._dir, task=task.name,
            lora_variant=str(task.params["lora_variant"]), lora_rank=int(task.params["lora_rank"]),
            seq_len=int(task.params["seq_len"]), vocab_size=len(task.info["vocab"]), micro_batch=micro_batch,
        )
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:  # everything but the clients is the task's
        return getattr(self.task, name)

    def program(self) -> TrainingProgram:
        prog = getattr(self._local, "program", None)
        if prog is None:
            prog = self._local.program = load_training_program(self._dir)
        return prog

    def client_trainer(self, partition_id: int, num_partitions: int, seed: int) -> ExecuTorchTrainer:
        train, test = self.task.client_data(partition_id, num_partitions, seed)
        return ExecuTorchTrainer(
            self.program(), DeviceData(train.x.numpy(), train.y.numpy()),
            DeviceData(test.x.numpy(), test.y.numpy()), seed=seed * 1_000_003 + partition_id,
        )
