import pytest

from orchard.errors import ConfigError
from orchard.tasks.baseline import RECIPES, format_baseline, run_baseline
from orchard.trainer import TrainConfig


def test_heart_baseline_beats_the_majority_class() -> None:
    result = run_baseline("heart")
    # About 55% of the pooled test rows are positive; logistic regression reaches ~83%.
    assert result["accuracy"] > 0.75 > result["initial_accuracy"]
    assert result["num_examples"] == 645 and result["num_steps"] == 100 * 21
    assert "heart: test accuracy" in format_baseline(result)


def test_baseline_takes_a_recipe_override_and_task_params() -> None:
    result = run_baseline("digits", train_config=TrainConfig(steps=5, batch_size=16), hidden=16)
    assert result["num_steps"] == 5 and result["params"]["hidden"] == 16
    # What `orchard baseline --task heart --epochs 2` passes.
    assert run_baseline("heart", epochs=2)["num_steps"] == 2 * 21


def test_every_task_has_a_recipe() -> None:
    from orchard.tasks import available_tasks

    # Orchard's own tasks with data; `flower` (a Flower app's own data) and a user's
    # registered tasks have none, and train with the default recipe.
    assert set(RECIPES) == {"digits", "heart", "mnist", "shakespeare"} <= set(available_tasks())
    with pytest.raises(ConfigError):
        run_baseline("nope")
