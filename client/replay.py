"""The device's experience-replay buffer: fixed-size samples under a byte budget, a small
hot set in memory and the rest in one owner-only, checksummed file in the device's data
directory.

What it keeps is the device's own: the buffer is read by the local trainer and by
nothing else. It is never part of a :class:`~orchard.trainer.TrainResult`, an upload or
a report.

Footprint. A sample is its input (``sample_shape`` float32) and its int64 label: a
record of ``record_bytes``. With capacity C and a hot set of H records,

    file   = HEADER_BYTES + C * record_bytes + DIGEST_BYTES     (at most)
    memory = H * record_bytes + C * 8                           (hot records, label index)

and :func:`capacity_for` picks the largest C with ``file + memory <= budget_bytes``. A
budget below one sample is refused (:class:`ReplayBudgetError`). A buffer may also be
held to a ``share`` of the samples offered to it: it then keeps at most
``floor(share * seen)`` of them (a simulated device's "10% of what it has seen"), below
its capacity; until the limit reaches 1 it keeps none, and where the limit grew the
next sample is appended before either rule replaces anything. A flush streams the
file through a copy in chunks of at most H records, so it adds no more than the hot set.

File (``replay.bin``)::

    b"ORRB" | u32 version | u32 header length | header JSON (padded, at most HEADER_BYTES
    in all with the three fields before it) | int64 labels[filled] |
    float32 inputs[filled, *sample_shape] | sha256 of everything before it

The header holds the sample shape, the capacity, the policy's name and the counters
the sampling rules need (samples offered, per class) and the stream cursor (how many
samples of the device's stream were consumed). A file whose digest, magic, version or
layout does not check out is discarded with a warning, never trained on; a file made
for another sample shape is discarded the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from orchard.client.replay_sampling import (
    SAMPLINGS,
    class_balanced_slot,
    draw_slots,
    reservoir_slot,
)
from orchard.errors import OrchardError
from orchard.files import FILE_MODE, private_dir

log = logging.getLogger("orchard.client.replay")

MAGIC = b"ORRB"
VERSION = 1
HEADER_BYTES = 512  # magic, version, length and the JSON header, padded
DIGEST_BYTES = 32
LABEL_BYTES = 8
FILE_NAME = "replay.bin"
_PREFIX = struct.Struct("<4sII")


class ReplayBudgetError(OrchardError):
    """A replay budget cannot hold one sample (with its hot set), or a setting is out of range."""


class ReplayFileError(OrchardError):
    """A replay file is damaged or was written for other samples (the buffer discards it)."""


def record_bytes(sample_shape: tuple[int, ...]) -> int:
    return int(np.prod(sample_shape, dtype=np.int64)) * 4 + LABEL_BYTES


def footprint_bytes(capacity: int, hot_samples: int, sample_shape: tuple[int, ...]) -> int:
    """The most a buffer of this capacity and hot set holds on disk and in memory."""
    r = record_bytes(sample_shape)
    return HEADER_BYTES + DIGEST_BYTES + capacity * (r + LABEL_BYTES) + max(1, min(hot_samples, capacity)) * r


def capacity_for(budget_bytes: int, hot_samples: int, sample_shape: tuple[int, ...]) -> int:
    """The most samples a buffer may keep within ``budget_bytes`` (see the module's footprint)."""
    if hot_samples < 1:
        raise ReplayBudgetError(f"hot_samples must be >= 1 (samples waiting in memory), got {hot_samples}")
    r = record_bytes(sample_shape)
    fixed = HEADER_BYTES + DIGEST_BYTES
    # The hot set never holds more than the capacity: try the full hot set, then a smaller one.
    cap = (budget_bytes - fixed - hot_samples * r) // (r + LABEL_BYTES)
    if cap < hot_samples:
        cap = (budget_bytes - fixed) // (2 * r + LABEL_BYTES)  # hot set as large as the capacity
        cap = max(cap, 0)
    if cap < 1:
        raise ReplayBudgetError(
            f"a replay budget of {budget_bytes} bytes holds no sample of shape {sample_shape}: one takes "
            f"{footprint_bytes(1, 1, sample_shape)} bytes with its header and hot copy; "
            "raise replay.budget_bytes in the device policy")
    return int(cap)


def budget_for(samples: int, hot_samples: int, sample_shape: tuple[int, ...]) -> int:
    """The smallest budget that keeps ``samples`` samples (the inverse of :func:`capacity_for`)."""
    return footprint_bytes(samples, hot_samples, sample_shape)


class ReplayBuffer:
    """A replay buffer at ``directory / replay.bin`` (see the module for the layout).

    ``offer`` admits a sample by the policy's rule, ``draw`` reads samples to replay,
    ``flush`` writes pending samples to the file; every random choice takes the caller's
    ``rng``. Pending samples (the hot set) are written when ``hot_samples`` of them are
    waiting, and on ``flush``.
    """

    def __init__(self, directory: str | Path, sample_shape: tuple[int, ...], budget_bytes: int, *,
                 sampling: str = "reservoir", hot_samples: int = 4, share: float | None = None) -> None:
        if sampling not in SAMPLINGS:
            raise ReplayBudgetError(f"unknown replay sampling {sampling!r}; expected one of {', '.join(SAMPLINGS)}")
        if share is not None and not 0.0 < share <= 1.0:
            raise ReplayBudgetError(f"a replay share must be in (0, 1] (the most of the samples seen kept), got {share}")
        self.share = share
        self.directory = Path(directory)
        self.path = self.directory / FILE_NAME
        self.sample_shape = tuple(int(s) for s in sample_shape)
        self.sampling = sampling
        self.budget_bytes = int(budget_bytes)
        self.capacity = capacity_for(self.budget_bytes, hot_samples, self.sample_shape)
        self.hot_samples = max(1, min(hot_samples, self.capacity))
        self._record = record_bytes(self.sample_shape)
        self._x_bytes = self._record - LABEL_BYTES
        self.labels = np.zeros(0, dtype=np.int64)  # the filled slots' classes
        self.seen = 0  # samples offered so far
        self.class_seen: dict[int, int] = {}
        self.cursor = 0  # samples of the device's stream consumed
        self._hot: dict[int, np.ndarray] = {}  # slot -> pending input (its label is in self.labels)
        self._on_file = 0  # slots the file holds
        self._load()

    # ------------------------------------------------------------------ sizes

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def file_bytes(self) -> int:
        return self.path.stat().st_size if self.path.is_file() else 0

    def limit(self) -> int:
        """The most samples the buffer may hold now: its capacity, and with a ``share`` at
        most ``floor(share * seen)`` of the samples offered so far (0 before 1 / share)."""
        if self.share is None:
            return self.capacity
        # The epsilon keeps products such as 0.1 * 30 = 3.0000000000000004 from rounding the wrong way.
        return min(self.capacity, int(math.floor(self.share * self.seen + 1e-9)))

    def memory_bytes(self) -> int:
        """The hot set's records and the label index, as held now."""
        return len(self._hot) * self._record + self.capacity * LABEL_BYTES

    # ------------------------------------------------------------------ admission and draws

    def offer(self, x: np.ndarray, label: int, rng: np.random.Generator) -> int | None:
        """Offer one sample; returns the slot it took (None: the policy dropped it)."""
        x = np.asarray(x, dtype=np.float32)
        if tuple(x.shape) != self.sample_shape:
            raise ReplayFileError(f"a sample of shape {tuple(x.shape)} offered to a buffer of {self.sample_shape}")
        label = int(label)
        self.class_seen[label] = self.class_seen.get(label, 0) + 1
        self.seen += 1
        cap = self.limit()
        if cap < 1:
            slot = None
        elif len(self) < cap:  # room (a share's limit grows with the samples seen): the sample is appended
            slot = len(self)
        elif self.sampling == "reservoir":
            slot = reservoir_slot(self.seen - 1, cap, rng)
        else:
            slot = class_balanced_slot(self.labels, label, self.class_seen, cap, rng)
        if slot is None:
            return None
        if slot == len(self):
            self.labels = np.append(self.labels, np.int64(label))
        else:
            self.labels[slot] = label
        self._hot[slot] = x.copy()
        if len(self._hot) >= self.hot_samples:
            self.flush()
        return slot

    def draw(self, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``k`` samples to replay (inputs float32 ``(k, *shape)``, labels int64 ``(k,)``)."""
        slots = draw_slots(self.sampling, self.labels, k, rng)
        xs = np.empty((slots.shape[0], *self.sample_shape), dtype=np.float32)
        for i, s in enumerate(slots.tolist()):
            xs[i] = self._read(s)
        return xs, self.labels[slots].copy()

    def _read(self, slot: int) -> np.ndarray:
        hot = self._hot.get(slot)
        if hot is not None:
            return hot
        off = self._x_offset(self._on_file) + slot * self._x_bytes
        with open(self.path, "rb") as f:
            raw = os.pread(f.fileno(), self._x_bytes, off)
        if len(raw) != self._x_bytes:
            raise ReplayFileError(f"{self.path} is shorter than its header says (slot {slot})")
        return np.frombuffer(raw, dtype=np.float32).reshape(self.sample_shape)

    # ------------------------------------------------------------------ the file

    @staticmethod
    def _x_offset(filled: int) -> int:
        return HEADER_BYTES + filled * LABEL_BYTES

    def _header(self) -> bytes:
        body = json.dumps({"shape": list(self.sample_shape), "capacity": self.capacity, "sampling": self.sampling,
                           "filled": len(self), "seen": self.seen, "cursor": self.cursor,
                           "class_seen": {str(k): v for k, v in sorted(self.class_seen.items())}},
                          separators=(",", ":")).encode()
        if _PREFIX.size + len(body) > HEADER_BYTES:
            raise ReplayBudgetError(f"the replay header needs {len(body)} bytes (too many classes); "
                                    f"at most {HEADER_BYTES - _PREFIX.size} fit")
        return (_PREFIX.pack(MAGIC, VERSION, len(body)) + body).ljust(HEADER_BYTES, b"\0")

    def _old_chunks(self, upto: int) -> Iterator[tuple[int, np.ndarray]]:
        """The file's inputs for slots ``[0, upto)`` in chunks of at most the hot set's size."""
        step = self.hot_samples
        if self._on_file == 0:
            return
        with open(self.path, "rb") as f:
            base = self._x_offset(self._on_file)
            for start in range(0, min(upto, self._on_file), step):
                n = min(step, self._on_file - start, upto - start)
                raw = os.pread(f.fileno(), n * self._x_bytes, base + start * self._x_bytes)
                yield start, np.frombuffer(raw, dtype=np.float32).reshape(n, *self.sample_shape).copy()

    def flush(self) -> None:
        """Write the pending samples and the counters: a copy streamed through a temporary
        file (owner-only), fsynced and renamed over the old one, so a crash leaves one whole
        file or the other."""
        private_dir(self.directory)
        filled = len(self)
        tmp = self.path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
        digest = hashlib.sha256()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
            with os.fdopen(fd, "wb") as out:
                def put(b: bytes) -> None:
                    digest.update(b)
                    out.write(b)

                put(self._header())
                put(self.labels.astype("<i8").tobytes())
                written = 0
                for start, chunk in self._old_chunks(filled):
                    for i in range(chunk.shape[0]):
                        hot = self._hot.get(start + i)
                        if hot is not None:
                            chunk[i] = hot
                    put(chunk.astype("<f4").tobytes())
                    written = start + chunk.shape[0]
                for slot in range(written, filled):  # slots the old file did not hold: all pending
                    put(self._hot[slot].astype("<f4").tobytes())
                out.write(digest.digest())
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._hot.clear()
        self._on_file = filled

    def _load(self) -> None:
        if not self.path.is_file():
            return
        try:
            self._check_and_read()
        except (ReplayFileError, OSError, ValueError) as err:
            log.warning("discarding the replay buffer %s: %s; it starts empty and nothing in it is trained on",
                        self.path, err)
            self.path.unlink(missing_ok=True)
            self.labels = np.zeros(0, dtype=np.int64)
            self.seen, self.class_seen, self.cursor, self._on_file = 0, {}, 0, 0
            self._hot.clear()

    def _check_and_read(self) -> None:
        size = self.path.stat().st_size
        if size < HEADER_BYTES + DIGEST_BYTES:
            raise ReplayFileError(f"{size} bytes is shorter than a header and digest")
        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            left = size - DIGEST_BYTES
            while left > 0:
                block = f.read(min(left, 1 << 16))
                if not block:
                    raise ReplayFileError("the file ended early")
                digest.update(block)
                left -= len(block)
            if f.read(DIGEST_BYTES) != digest.digest():
                raise ReplayFileError("its checksum does not match (damaged or altered)")
            f.seek(0)
            head = f.read(HEADER_BYTES)
        magic, version, length = _PREFIX.unpack_from(head)
        if magic != MAGIC or version != VERSION or length > HEADER_BYTES - _PREFIX.size:
            raise ReplayFileError(f"not a version-{VERSION} replay file (magic {magic!r}, version {version})")
        meta = json.loads(head[_PREFIX.size:_PREFIX.size + length])
        shape = tuple(int(s) for s in meta["shape"])
        if shape != self.sample_shape:
            raise ReplayFileError(f"it holds samples of shape {shape}, this buffer takes {self.sample_shape}")
        filled = int(meta["filled"])
        if filled < 0 or size != HEADER_BYTES + filled * self._record + DIGEST_BYTES:
            raise ReplayFileError(f"its size {size} does not match {filled} samples")
        with open(self.path, "rb") as f:
            labels = np.frombuffer(os.pread(f.fileno(), filled * LABEL_BYTES, HEADER_BYTES), dtype="<i8")
        self.seen = int(meta["seen"])
        self.cursor = int(meta["cursor"])
        self.class_seen = {int(k): int(v) for k, v in meta["class_seen"].items()}
        self._on_file = filled
        self.labels = labels.astype(np.int64)
        if filled > self.capacity:  # the budget shrank: keep the first slots
            self.labels = self.labels[:self.capacity].copy()
            self.flush()


__all__ = ["ReplayBudgetError", "ReplayBuffer", "ReplayFileError", "budget_for", "capacity_for",
           "footprint_bytes", "record_bytes"]
