"""Centralised baselines: the task's model trained on the pooled training data of all
clients and scored on the held-out test set. This is the number a federated run of
the same task is compared against (``orchard baseline --task NAME``).

Each task has a default recipe (below) sized to finish in about two minutes or less
on two CPU cores; pass ``train_config`` to change it.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from orchard.errors import ConfigError
from orchard.tasks.core import SupervisedTask
from orchard.tasks.registry import get_task
from orchard.trainer import TrainConfig

RECIPES: dict[str, TrainConfig] = {
    "digits": TrainConfig(
        epochs=30, batch_size=32, learning_rate=0.1, optimizer="sgd", momentum=0.9
    ),
    "mnist": TrainConfig(epochs=3, batch_size=64, learning_rate=1e-3, optimizer="adam"),
    "heart": TrainConfig(epochs=100, batch_size=32, learning_rate=0.05, optimizer="sgd"),
    "shakespeare": TrainConfig(steps=400, batch_size=32, learning_rate=1e-2, optimizer="adam"),
}


def run_baseline(
    task_name: str,
    *,
    seed: int = 0,
    train_config: TrainConfig | None = None,
    epochs: int | None = None,
    steps: int | None = None,
    **params: Any,
) -> dict[str, Any]:
    """Train task ``task_name`` (built with ``params``) centrally and evaluate it.

    ``epochs`` or ``steps`` override the recipe's (``steps`` wins, as in TrainConfig).
    Returns the test ``accuracy`` and ``loss``, the accuracy and loss of the initial
    model, the training metrics, examples, steps and wall-clock ``seconds``.
    """
    task = get_task(task_name, **params)
    if not isinstance(task, SupervisedTask):
        raise ConfigError(
            f"task {task_name!r} has no pooled training data to run a centralised baseline on"
        )
    config = train_config or RECIPES.get(task_name) or TrainConfig()
    overrides: dict[str, Any] = {"seed": seed}
    if epochs is not None:
        overrides.update(epochs=epochs, steps=None)
    if steps is not None:
        overrides["steps"] = steps
    config = TrainConfig(**{**asdict(config), **overrides})
    start = time.perf_counter()
    initial = task.initial_arrays(seed)
    before = task.evaluate(initial)
    result = task.pooled_trainer(seed).train(initial, config)
    after = task.evaluate(result.arrays)
    return {
        "task": task_name,
        "params": task.params,
        "config": asdict(config),
        # A regression task of a user's has a loss and its own metrics, no accuracy.
        "accuracy": after.get("accuracy"),
        "loss": after["loss"],
        "initial_accuracy": before.get("accuracy"),
        "initial_loss": before["loss"],
        "metrics": after,
        "train_metrics": result.metrics,
        "num_examples": result.num_examples,
        "num_steps": result.num_steps,
        "seconds": time.perf_counter() - start,
    }


def format_baseline(result: dict[str, Any]) -> str:
    if result["accuracy"] is None:
        return (f"{result['task']}: test loss {result['loss']:.4f} (initial {result['initial_loss']:.4f}) after "
                f"{result['num_steps']} steps on {result['num_examples']} examples in {result['seconds']:.1f} s")
    return (
        f"{result['task']}: test accuracy {result['accuracy']:.4f} (loss {result['loss']:.4f}; "
        f"initial {result['initial_accuracy']:.4f}) after {result['num_steps']} steps on "
        f"{result['num_examples']} examples in {result['seconds']:.1f} s"
    )


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or ["digits", "heart", "mnist", "shakespeare"]:
        print(format_baseline(run_baseline(name)), flush=True)
