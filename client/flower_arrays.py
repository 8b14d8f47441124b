"""Arrays into and out of Flower's ``ArrayRecord``, at the cost of the bytes alone.

Flower stores an ``Array`` as the ``.npy`` file of it (``np.save`` into a buffer) and
reads one back with ``np.load``; both spend most of their time on the header (a Python
dict formatted, then parsed with ``ast.literal_eval``), not on the data. A simulated
round sends the same global arrays to every client and gets back arrays of the same few
shapes, so:

- :meth:`ArrayBytes.record` builds a record's ``.npy`` bytes once and hands every later
  message of the same arrays (equal names, dtypes, shapes and bytes: compared, never
  assumed) new ``Array`` objects over those bytes. ``bytes`` are immutable, and each
  message gets its own ``ArrayRecord`` and ``Array`` objects, so whatever an app does
  to the record it received (replace an entry, assign ``Array.data``, write into the
  result of ``Array.numpy()``, which is a fresh copy) no other message sees it.
- :meth:`ArrayBytes.numpy` reads an ``Array`` as ``Array.numpy()`` does, parsing each
  distinct ``.npy`` header once; anything but a plain ``.npy`` of a fixed-size
  dtype goes through ``Array.numpy()`` itself. The result is a writeable copy, as
  ``np.load`` returns.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from orchard.typing import NDArrays

_MAGIC = b"\x93NUMPY"
_NUMPY = "numpy.ndarray"  # Flower's SType.NUMPY


def _npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value, allow_pickle=False)  # as Array.from_numpy_ndarray writes it
    return buf.getvalue()


class ArrayBytes:
    """Arrays to and from ``ArrayRecord``s for the messages of one app (see the module
    docstring): one is shared by the trainers of a simulation's clients. Keeps the last
    ``.npy`` bytes of each name and the headers parsed; safe to share between threads
    (an entry is replaced whole)."""

    def __init__(self) -> None:
        # name -> (dtype, shape, raw bytes, .npy bytes)
        self._last: dict[str, tuple[np.dtype[Any], tuple[int, ...], bytes, bytes]] = {}
        self._headers = _Headers()

    def record(self, arrays: NDArrays) -> ArrayRecord:
        """An ``ArrayRecord`` of ``arrays`` (C order, as sent), its own objects over
        shared immutable bytes."""
        # Filled item by item: ArrayRecord(dict of Arrays) would build every Array again.
        record = ArrayRecord()
        for name, value in arrays.items():
            v = np.ascontiguousarray(value)
            raw = v.tobytes()
            got = self._last.get(name)
            if got is None or got[0] != v.dtype or got[1] != v.shape or got[2] != raw:
                got = (v.dtype, v.shape, raw, _npy(v))
                self._last[name] = got
            record[name] = Array(dtype=str(v.dtype), shape=tuple(v.shape), stype=_NUMPY, data=got[3])
        return record

    def numpy(self, array: Array) -> np.ndarray:
        """``array.numpy()``, without parsing a header seen before."""
        data = array.data
        if array.stype != _NUMPY or not isinstance(data, bytes) or data[:6] != _MAGIC or data[6] not in (1, 2):
            return array.numpy()
        major = data[6]
        start = 10 if major == 1 else 12
        size = int.from_bytes(data[8:start], "little")
        parsed = self._headers.get(data[:start + size], major)
        if parsed is None:
            return array.numpy()
        dtype, fortran, shape = parsed
        count = math.prod(shape)
        if len(data) - start - size != count * dtype.itemsize:
            return array.numpy()  # (np.load's error for a truncated or padded file)
        flat = np.frombuffer(data, dtype=dtype, count=count, offset=start + size)
        view = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
        return view.copy(order="K")


class _Headers:
    """``.npy`` headers already parsed: header bytes -> (dtype, Fortran order, shape)."""

    MAX = 256  # distinct headers kept (a model has a few dozen shapes)

    def __init__(self) -> None:
        self._parsed: dict[bytes, tuple[np.dtype[Any], bool, tuple[int, ...]] | None] = {}

    def get(self, header: bytes, major: int) -> tuple[np.dtype[Any], bool, tuple[int, ...]] | None:
        """The header's fields, or None for one left to ``Array.numpy()``."""
        if header in self._parsed:
            return self._parsed[header]
        fp = io.BytesIO(header)
        np.lib.format.read_magic(fp)
        try:
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(fp)
        except ValueError:
            parsed = None  # Array.numpy() says what is wrong with it
        else:
            parsed = None if dtype.hasobject else (dtype, bool(fortran), tuple(shape))
        if len(self._parsed) >= self.MAX:
            self._parsed.clear()
        self._parsed[header] = parsed
        return parsed


__all__ = ["ArrayBytes"]
