"""A user's dataset as rows Orchard can partition: :class:`Arrays` and the sources that
load into it.

A source is a typed description (a path and which columns mean what); :func:`load_data`
turns any of them, or a pair ``(x, y)`` of tensors or numpy arrays, or a map-style
``torch.utils.data.Dataset`` of ``(x, y)`` items, into one :class:`Arrays`: ``x`` (N,
...) and ``y`` (N, ...) as numpy arrays plus named per-row ``columns`` (a hospital, a
user id) that a natural partition (:class:`orchard.tasks.partitioners.ByColumn`) reads.

Targets: integer ``y`` is a class label (or a token id per position for text); floating
``y`` is a regression target. A CSV or Parquet label column of strings becomes class ids
in sorted order of its values (``Arrays.classes`` keeps the names).
"""

from __future__ import annotations

import csv
import gzip
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orchard.errors import ConfigError


class DataError(ConfigError):
    """A dataset that cannot be read as the task says it should be."""


@dataclass(frozen=True)
class Arrays:
    """Rows in memory: inputs ``x``, targets ``y`` and named per-row ``columns``."""

    x: Any
    y: Any
    columns: dict[str, Any] = field(default_factory=dict)
    classes: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return int(np.shape(self.x)[0])


@dataclass(frozen=True)
class Table:
    """A table file's columns, as :class:`Csv` and :class:`Parquet` name them. ``label`` is
    the target column; ``features`` the input columns (default: every numeric column but
    the label and ``columns``); ``columns`` are kept per row (for a natural partition)."""

    path: str | Path
    label: str
    features: Sequence[str] | None = None
    columns: Sequence[str] = ()


@dataclass(frozen=True)
class Csv(Table):
    """A CSV file (``.csv`` or ``.csv.gz``) with a header row (fields: :class:`Table`)."""


@dataclass(frozen=True)
class Parquet(Table):
    """A Parquet file, read with pandas (which needs pyarrow or fastparquet); the same
    fields as :class:`Csv` (:class:`Table`)."""


@dataclass(frozen=True)
class Npz:
    """A numpy ``.npz`` archive: arrays ``x`` and ``y`` by name, and per-row ``columns``."""

    path: str | Path
    x: str = "x"
    y: str = "y"
    columns: Sequence[str] = ()


@dataclass(frozen=True)
class ImageFolder:
    """``root/<class name>/<image>``: one class per subfolder (sorted), images resized to
    ``size`` (width, height) and read in PIL ``mode`` ("L" grey, "RGB"), as float32
    (N, channels, height, width) in [0, 1]."""

    path: str | Path
    size: tuple[int, int] = (28, 28)
    mode: str = "L"


@dataclass(frozen=True)
class Text:
    """A text file as next-character windows of ``seq_len`` (``x``, ``y`` int64 (N,
    seq_len), ``y`` shifted by one), over its own character vocabulary."""

    path: str | Path
    seq_len: int = 64


DataSource = Arrays | Csv | Parquet | Npz | ImageFolder | Text
SOURCES = "Arrays, Csv, Parquet, Npz, ImageFolder, Text, a pair (x, y) of arrays or tensors, or a torch Dataset"


def _numpy(a: Any, what: str) -> np.ndarray:
    try:
        import torch

        if isinstance(a, torch.Tensor):
            return a.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    arr = np.asarray(a)
    if arr.dtype == object:
        raise DataError(f"{what}: expected a numeric array or tensor, got {type(a).__name__} of objects")
    return arr


def _normalise(arrays: Arrays, where: str) -> Arrays:
    x = _numpy(arrays.x, f"{where}.x")
    y = _numpy(arrays.y, f"{where}.y")
    problems = []
    if x.ndim < 1 or y.ndim < 1:
        problems.append(f"{where}: x and y need a first (row) axis, got shapes {x.shape} and {y.shape}")
    elif x.shape[0] != y.shape[0]:
        problems.append(f"{where}: x has {x.shape[0]} rows and y {y.shape[0]}; they must have one row per example")
    columns = {}
    for name, col in arrays.columns.items():
        c = np.asarray(col)
        if c.shape[:1] != x.shape[:1]:
            problems.append(f"{where}: column {name!r} has {c.shape[:1]} rows, x has {x.shape[0]}")
        columns[name] = c
    if problems:
        raise DataError(problems)
    if np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32, copy=False)
    if np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        y = y.astype(np.int64, copy=False)
    elif np.issubdtype(y.dtype, np.floating):
        y = y.astype(np.float32, copy=False)
    else:
        raise DataError(f"{where}.y: expected integer class labels or float targets, got dtype {y.dtype}")
    return Arrays(np.ascontiguousarray(x), np.ascontiguousarray(y), columns, arrays.classes)


def _labels(values: Sequence[str], where: str) -> tuple[np.ndarray, tuple[str, ...] | None]:
    try:
        nums = np.asarray([float(v) for v in values])
    except ValueError:
        names = tuple(sorted(set(values)))
        lookup = {n: i for i, n in enumerate(names)}
        return np.asarray([lookup[v] for v in values], np.int64), names
    if np.all(nums == np.round(nums)):
        return nums.astype(np.int64), None
    return nums.astype(np.float32), None


def _table(header: list[str], rows: dict[str, list[str]], spec: Table, where: str) -> Arrays:
    missing = [c for c in [spec.label, *(spec.features or ()), *spec.columns] if c not in header]
    if missing:
        raise DataError(f"{where}: no column {missing[0]!r}; the columns are {', '.join(header)}")
    if spec.features is not None:
        features = list(spec.features)
    else:
        features = []
        for c in header:
            if c == spec.label or c in spec.columns:
                continue
            try:
                [float(v) for v in rows[c]]
            except ValueError:
                continue
            features.append(c)
        if not features:
            raise DataError(f"{where}: no numeric feature column besides label {spec.label!r}; name them in features")
    try:
        x = np.asarray([[float(v) for v in rows[c]] for c in features], np.float32).T
    except ValueError as err:
        raise DataError(f"{where}: a feature column is not numeric ({err}); list the numeric ones in features") from None
    y, classes = _labels(rows[spec.label], where)
    return Arrays(x, y, {c: np.asarray(rows[c]) for c in spec.columns}, classes)


def _read_csv(spec: Csv) -> Arrays:
    path = Path(spec.path)
    where = f"Csv({str(path)!r})"
    if not path.is_file():
        raise DataError(f"{where}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:  # type: ignore[operator]
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        body = [r for r in reader if r]
    if not header or not body:
        raise DataError(f"{where}: expected a header row and at least one data row")
    bad = next((i for i, r in enumerate(body) if len(r) != len(header)), None)
    if bad is not None:
        raise DataError(f"{where}: data row {bad + 1} has {len(body[bad])} fields, the header {len(header)}")
    rows = {h: [r[i].strip() for r in body] for i, h in enumerate(header)}
    return _table(header, rows, spec, where)


def _read_parquet(spec: Parquet) -> Arrays:
    where = f"Parquet({str(spec.path)!r})"
    try:
        import pandas as pd

        frame = pd.read_parquet(spec.path)
    except ImportError as err:
        raise DataError(f"{where}: reading Parquet needs pandas with pyarrow (pip install pyarrow): {err}") from None
    except FileNotFoundError:
        raise DataError(f"{where}: no such file") from None
    header = [str(c) for c in frame.columns]
    rows = {str(c): [str(v) for v in frame[c].tolist()] for c in frame.columns}
    return _table(header, rows, spec, where)


def _read_npz(spec: Npz) -> Arrays:
    where = f"Npz({str(spec.path)!r})"
    try:
        with np.load(spec.path, allow_pickle=False) as z:
            names = list(z.files)
            missing = [k for k in [spec.x, spec.y, *spec.columns] if k not in names]
            if missing:
                raise DataError(f"{where}: no array {missing[0]!r}; it holds {', '.join(names)}")
            return Arrays(z[spec.x], z[spec.y], {c: z[c] for c in spec.columns})
    except FileNotFoundError:
        raise DataError(f"{where}: no such file") from None


def _read_images(spec: ImageFolder) -> Arrays:
    from PIL import Image

    root = Path(spec.path)
    where = f"ImageFolder({str(root)!r})"
    classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not classes:
        raise DataError(f"{where}: expected one subfolder of images per class")
    xs, ys = [], []
    for label, name in enumerate(classes):
        for img_path in sorted((root / name).iterdir()):
            if not img_path.is_file():
                continue
            try:
                with Image.open(img_path) as img:
                    a = np.asarray(img.convert(spec.mode).resize(spec.size), np.float32) / 255.0
            except OSError as err:
                raise DataError(f"{where}: {img_path.name} is not an image PIL reads: {err}") from None
            xs.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
            ys.append(label)
    if not xs:
        raise DataError(f"{where}: the class folders hold no images")
    return Arrays(np.stack(xs), np.asarray(ys, np.int64), {}, tuple(classes))


def _read_text(spec: Text) -> Arrays:
    from orchard.text import CharTokenizer

    path = Path(spec.path)
    where = f"Text({str(path)!r})"
    if not path.is_file():
        raise DataError(f"{where}: no such file")
    if spec.seq_len < 1:
        raise DataError(f"{where}: seq_len must be >= 1, got {spec.seq_len}")
    text = path.read_text(encoding="utf-8")
    tok = CharTokenizer.from_text(text)
    ids = tok.encode_array(text)
    n = (len(ids) - 1) // spec.seq_len
    if n < 2:
        raise DataError(f"{where}: {len(text)} characters make fewer than 2 windows of seq_len {spec.seq_len}")
    x = ids[: n * spec.seq_len].reshape(n, spec.seq_len).astype(np.int64)
    y = ids[1 : n * spec.seq_len + 1].reshape(n, spec.seq_len).astype(np.int64)
    return Arrays(x, y, {}, tuple(tok.chars))


def _read_dataset(ds: Any, where: str) -> Arrays:
    n = len(ds)
    if n == 0:
        raise DataError(f"{where}: the dataset is empty")
    xs, ys = [], []
    for i in range(n):
        item = ds[i]
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise DataError(f"{where}: item {i} is a {type(item).__name__}; expected an (x, y) pair")
        xs.append(_numpy(item[0], f"{where}[{i}].x"))
        ys.append(_numpy(item[1], f"{where}[{i}].y"))
    return Arrays(np.stack(xs), np.stack(ys))


def load_data(source: Any, where: str = "data") -> Arrays:
    """``source`` as :class:`Arrays` (see the module docstring for what it may be)."""
    if isinstance(source, Arrays):
        out = source
    elif isinstance(source, Csv):
        out = _read_csv(source)
    elif isinstance(source, Parquet):
        out = _read_parquet(source)
    elif isinstance(source, Npz):
        out = _read_npz(source)
    elif isinstance(source, ImageFolder):
        out = _read_images(source)
    elif isinstance(source, Text):
        out = _read_text(source)
    elif isinstance(source, tuple) and len(source) == 2:
        out = Arrays(source[0], source[1])
    elif hasattr(source, "__getitem__") and hasattr(source, "__len__") and not isinstance(source, str | bytes):
        out = _read_dataset(source, where)
    else:
        raise DataError(f"{where}: expected {SOURCES}; got {type(source).__name__}")
    return _normalise(out, where)


def take(data: Arrays, idx: np.ndarray) -> Arrays:
    """Rows ``idx`` of ``data``."""
    return Arrays(data.x[idx], data.y[idx], {k: v[idx] for k, v in data.columns.items()}, data.classes)
