import numpy as np
import pytest

from orchard.errors import ConfigError
from orchard.tasks import get_task
from orchard.tasks.heart import HOSPITALS, HeartFeatures, load_hospital
from orchard.trainer import TrainConfig


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    return get_task("heart")


def test_hospital_files_and_missing_values() -> None:
    rows = {h: load_hospital(h) for h in HOSPITALS}
    assert [len(r) for r in rows.values()] == [303, 294, 123, 200]
    chol = 4
    assert np.isnan(rows["switzerland"][:, chol]).all()  # chol == 0 is missing
    assert np.isnan(rows["va"][:, chol]).sum() >= 49
    positive = {h: float((r[:, -1] > 0).mean()) for h, r in rows.items()}
    assert positive["switzerland"] > 0.9 and positive["hungarian"] < 0.4


def test_features_are_finite_and_use_training_statistics_only() -> None:
    train = load_hospital("cleveland")
    feats = HeartFeatures(train)
    x = feats(load_hospital("switzerland"))
    assert np.isfinite(x).all() and x.shape[1] == len(feats.names)
    # Standardised on the training rows: mean 0 there, whatever the test rows hold.
    xt = feats(train)
    age = feats.names.index("age")
    assert abs(float(xt[:, age].mean())) < 1e-5
    shifted = load_hospital("switzerland")
    shifted[:, 0] += 100.0
    assert feats(shifted)[:, age].mean() > 5  # test rows do not move the statistics


def test_four_natural_clients(task) -> None:  # type: ignore[no-untyped-def]
    p = task.partition(4, seed=0)
    assert sum(p.sizes) == len(task.train_data)
    assert sum(len(i) for i in p.test_indices) == len(task.test_data)
    assert p.label_skew.mean_tv_distance > 0.1  # Switzerland is 93% positive
    with pytest.raises(ConfigError, match="4"):
        task.partition(10, seed=0)


def test_logistic_regression_trains(task) -> None:  # type: ignore[no-untyped-def]
    trainer = task.client_trainer(0, 4, seed=0)
    result = trainer.train(task.initial_arrays(0), TrainConfig(epochs=30, learning_rate=0.1))
    assert list(result.arrays) == ["weight", "bias"]
    assert trainer.evaluate(result.arrays, TrainConfig()).metrics["accuracy"] > 0.7
