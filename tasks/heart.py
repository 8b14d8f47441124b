"""``heart``: UCI Heart Disease from four hospitals, the four natural clients.

Clients are Cleveland, Hungary, Switzerland and Long Beach VA (the split FLamby's
Fed-Heart-Disease uses); ``num_partitions`` must be 4. The target is ``num > 0``
(disease). Each hospital's rows are split once, stratified by label, into a local
train and test set (``test_fraction``, ``split_seed``); the central test set is the
union of the four local test sets.

Features (13 raw columns -> a fixed-width vector):

- ``?`` is missing, and so is ``chol == 0`` (every Swiss row, 49 VA rows: a serum
  cholesterol of 0 is not a measurement).
- Numeric columns (age, trestbps, chol, thalach, oldpeak, ca) are standardised;
  binary ones (sex, fbs, exang) are kept 0/1; categorical ones (cp, restecg, slope,
  thal) are one-hot. A missing numeric or binary value is imputed with the training
  mean; a missing categorical value is all-zero. Every column that has a missing value
  in the training data also gets a 0/1 missing indicator, because missingness is
  itself informative here (it tracks the hospital, and the hospital tracks the label).
- Means and standard deviations come from the *training* rows of all four hospitals,
  never from test rows. Pooling them is what a federated deployment gets from one
  round of summing per-site counts, sums and sums of squares.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from orchard.errors import ConfigError
from orchard.tasks.core import SupervisedTask, seeded_model
from orchard.tasks.partition import Partition, group_by_owner, label_skew, stratified_split

DATA_DIR = Path(__file__).parent / "data" / "heart"
HOSPITALS = ("cleveland", "hungarian", "switzerland", "va")
COLUMNS = (
    "age",
    "sex",
    "cp",
    "trestbps",
    "chol",
    "fbs",
    "restecg",
    "thalach",
    "exang",
    "oldpeak",
    "slope",
    "ca",
    "thal",
    "num",
)
NUMERIC = ("age", "trestbps", "chol", "thalach", "oldpeak", "ca")
BINARY = ("sex", "fbs", "exang")
CATEGORICAL = {"cp": (1, 2, 3, 4), "restecg": (0, 1, 2), "slope": (1, 2, 3), "thal": (3, 6, 7)}
NUM_CLASSES = 2


def load_hospital(name: str) -> np.ndarray:
    """Raw (rows, 14) float64 with NaN for missing (``?``, and ``chol == 0``)."""
    path = DATA_DIR / f"processed.{name}.data"
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append([float("nan") if v.strip() == "?" else float(v) for v in line.split(",")])
    raw = np.asarray(rows, dtype=np.float64)
    if raw.shape[1] != len(COLUMNS):
        raise ConfigError(f"{path.name}: expected {len(COLUMNS)} columns, found {raw.shape[1]}")
    chol = COLUMNS.index("chol")
    raw[raw[:, chol] == 0, chol] = np.nan
    return raw


class HeartFeatures:
    """The feature map, fitted on training rows only (see the module docstring)."""

    def __init__(self, train_rows: np.ndarray) -> None:
        col = {c: train_rows[:, i] for i, c in enumerate(COLUMNS)}
        self.means = {c: float(np.nanmean(col[c])) for c in NUMERIC + BINARY}
        self.stds = {c: float(np.nanstd(col[c])) or 1.0 for c in NUMERIC}
        self.indicators = [c for c in COLUMNS[:-1] if np.isnan(col[c]).any()]

    @property
    def names(self) -> list[str]:
        out = list(NUMERIC) + list(BINARY)
        out += [f"{c}={v}" for c, values in CATEGORICAL.items() for v in values]
        return out + [f"{c}_missing" for c in self.indicators]

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        col = {c: rows[:, i] for i, c in enumerate(COLUMNS)}
        parts = []
        for c in NUMERIC:
            v = np.where(np.isnan(col[c]), self.means[c], col[c])
            parts.append((v - self.means[c]) / self.stds[c])
        for c in BINARY:
            parts.append(np.where(np.isnan(col[c]), self.means[c], col[c]))
        for c, values in CATEGORICAL.items():
            parts.extend((col[c] == v).astype(np.float64) for v in values)  # NaN == v is False
        parts.extend(np.isnan(col[c]).astype(np.float64) for c in self.indicators)
        return np.stack(parts, axis=1).astype(np.float32)


def model_for(kind: str, num_features: int, hidden: int) -> nn.Module:
    if kind == "logreg":
        # Two-logit softmax regression: the same model as logistic regression, and the
        # same loss and accuracy code path as every other task.
        return nn.Linear(num_features, NUM_CLASSES)
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(num_features, hidden), nn.ReLU(), nn.Linear(hidden, NUM_CLASSES)
        )
    raise ConfigError(f"unknown heart model {kind!r}; expected 'logreg' or 'mlp'")


def build(
    *, model: str = "logreg", hidden: int = 16, test_fraction: float = 0.3, split_seed: int = 0
) -> SupervisedTask:
    """Build the heart task: 4 hospitals, ``model`` "logreg" (default) or "mlp"."""
    raws = [load_hospital(h) for h in HOSPITALS]
    train_rows, test_rows, train_site, test_site = [], [], [], []
    for site, raw in enumerate(raws):
        labels = (raw[:, -1] > 0).astype(np.int64)
        tr, te = stratified_split(labels, test_fraction, split_seed + site)
        train_rows.append(raw[tr])
        test_rows.append(raw[te])
        train_site.append(np.full(len(tr), site))
        test_site.append(np.full(len(te), site))
    train_raw, test_raw = np.concatenate(train_rows), np.concatenate(test_rows)
    train_owner, test_owner = np.concatenate(train_site), np.concatenate(test_site)
    features = HeartFeatures(train_raw)
    x_train, x_test = features(train_raw), features(test_raw)
    y_train, y_test = (
        (train_raw[:, -1] > 0).astype(np.int64),
        (test_raw[:, -1] > 0).astype(np.int64),
    )
    n_features = x_train.shape[1]

    def partition(num_partitions: int, seed: int) -> Partition:
        if num_partitions != len(HOSPITALS):
            raise ConfigError(
                f"heart has exactly {len(HOSPITALS)} natural clients, the hospitals {', '.join(HOSPITALS)}; "
                f"num_partitions must be 4, got {num_partitions}"
            )
        train_idx = group_by_owner(train_owner, len(HOSPITALS))
        return Partition(
            indices=train_idx,
            test_indices=group_by_owner(test_owner, len(HOSPITALS)),
            label_skew=label_skew(y_train, train_idx, NUM_CLASSES),
            scheme="natural(hospital)",
        )

    return SupervisedTask.from_labelled(
        "heart", x_train, y_train, x_test, y_test, NUM_CLASSES,
        model=lambda seed: seeded_model(lambda: model_for(model, n_features, hidden), seed),
        partitioner=partition,
        params=dict(model=model, hidden=hidden, test_fraction=test_fraction, split_seed=split_seed),
        info={"feature_names": features.names, "clients": list(HOSPITALS)},
    )
