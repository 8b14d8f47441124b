"""Token shards and the training batch stream.

The tokenizer step writes the corpus as flat uint16 files (read back with ``np.memmap``,
so a rank maps only what it samples) plus ``index.json``. Batches are windows sampled by
a generator seeded with (seed, rank, step): batch ``s`` is a pure function of ``s``, so
the data position in a checkpoint is just the step number, and a resumed run sees the
same batches as an uninterrupted one. A loader thread builds batches ahead of time into
a bounded queue (in pinned memory on CUDA) so the accelerator does not wait on input.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from orchard.errors import OrchardError
from orchard.text import CharTokenizer

INDEX_FILE = "index.json"
SHIPPED_CORPUS = "data/shakespeare/tinyshakespeare_input.txt"  # package data of orchard.tasks


class DataError(OrchardError):
    """The corpus or token shards are missing, empty, or too short for the sequence length."""


def shipped_corpus() -> Path:
    """The tinyshakespeare text that ``orchard.tasks`` ships as package data."""
    path = Path(str(resources.files("orchard.tasks").joinpath(SHIPPED_CORPUS)))
    if not path.is_file():
        raise DataError(
            f"the shipped corpus orchard.tasks/{SHIPPED_CORPUS} is missing; "
            "reinstall the package or set data.corpus to your own text files"
        )
    return path


@dataclass(frozen=True)
class Shard:
    file: str  # relative to the shard directory
    split: str  # "train" | "val"
    tokens: int


@dataclass(frozen=True)
class ShardIndex:
    directory: Path
    tokenizer: CharTokenizer
    shards: tuple[Shard, ...]
    source_digest: str

    def split(self, name: str) -> list[Shard]:
        return [s for s in self.shards if s.split == name]

    def open(self, shard: Shard) -> np.ndarray:
        return np.memmap(
            self.directory / shard.file, dtype=np.uint16, mode="r", shape=(shard.tokens,)
        )

    @classmethod
    def load(cls, directory: Path) -> ShardIndex:
        p = directory / INDEX_FILE
        if not p.is_file():
            raise DataError(
                f"no token shards at {directory} ({INDEX_FILE} missing): build them first"
            )
        raw = json.loads(p.read_text())
        return cls(
            directory,
            CharTokenizer.from_dict(raw["tokenizer"]),
            tuple(Shard(**s) for s in raw["shards"]),
            raw["source_digest"],
        )


def _digest(chars: Sequence[str], texts: Sequence[str], n_shards: int, val_fraction: float) -> str:
    h = hashlib.sha256(f"{n_shards}:{val_fraction}".encode())
    h.update("".join(chars).encode("utf-8"))
    for text in texts:
        h.update(f"\0{len(text)}\0".encode())
        h.update(text.encode("utf-8"))
    return h.hexdigest()


def resolve_select(spec: str) -> Callable[[str], str]:
    """``"package.module:function"`` -> the function (a text -> text selection)."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise DataError(f"data.select = {spec!r}: cannot import it ({err})") from None
    if not callable(fn):
        raise DataError(f"data.select = {spec!r} is not a function")
    return fn  # type: ignore[no-any-return]


def build_shards(
    corpus: Sequence[Path],
    out_dir: Path,
    n_shards: int,
    val_fraction: float,
    select: Callable[[str], str] | None = None,
) -> ShardIndex:
    """Tokenize ``corpus`` into ``n_shards`` train shards and one val shard.

    ``select`` maps each file's text to the part to train and validate on. The
    vocabulary is every character of the whole files (selected or not, train and val
    alike: a held-out character must still have an id). Reuses existing shards built
    from the same text with the same settings.
    """
    files = [Path(f) for f in corpus]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise DataError(f"corpus files not found: {missing or '(none given)'}")
    whole = [f.read_text(encoding="utf-8") for f in files]
    tok = CharTokenizer.from_text("".join(whole))
    texts = [select(t) for t in whole] if select is not None else whole
    for f, text in zip(files, texts, strict=True):
        if not isinstance(text, str):
            raise DataError(f"data.select returned {type(text).__name__} for {f}, not text")
    digest = _digest(tok.chars, texts, n_shards, val_fraction)
    if (out_dir / INDEX_FILE).is_file():
        existing = ShardIndex.load(out_dir)
        if existing.source_digest == digest:
            return existing
    train_parts, val_parts = [], []
    for text in texts:
        ids = tok.encode_array(text)
        cut = int(len(ids) * (1.0 - val_fraction))
        train_parts.append(ids[:cut])
        val_parts.append(ids[cut:])
    train, val = np.concatenate(train_parts), np.concatenate(val_parts)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, part in enumerate(np.array_split(train, n_shards)):
        shards.append(_write(out_dir, f"train_{i:04d}.bin", "train", part))
    shards.append(_write(out_dir, "val_0000.bin", "val", val))
    index = ShardIndex(out_dir, tok, tuple(shards), digest)
    # The index is written last and atomically: its presence means the shards are whole.
    tmp = out_dir / (INDEX_FILE + ".tmp")
    tmp.write_text(
        json.dumps(
            {
                "tokenizer": tok.to_dict(),
                "shards": [s.__dict__ for s in shards],
                "source_digest": digest,
            },
            ensure_ascii=False,
        )
    )
    tmp.replace(out_dir / INDEX_FILE)
    return index


def _write(out_dir: Path, name: str, split: str, tokens: np.ndarray) -> Shard:
    mm = np.memmap(out_dir / name, dtype=np.uint16, mode="w+", shape=(len(tokens),))
    mm[:] = tokens
    mm.flush()
    del mm
    return Shard(name, split, len(tokens))


class WindowSampler:
    """Samples (x, y) windows of ``seq_len`` tokens, y shifted by one, from a rank's shards.

    With at least as many shards as ranks, rank r owns shards r, r+W, ...; with fewer,
    every rank samples all shards and the per-rank seed keeps their batches distinct.
    """

    def __init__(
        self,
        index: ShardIndex,
        split: str,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        shards = index.split(split)
        if len(shards) >= world_size:
            shards = shards[rank::world_size]
        self.arrays = [index.open(s) for s in shards if s.tokens > seq_len + 1]
        if not self.arrays:
            raise DataError(
                f"no {split} shard in {index.directory} holds more than seq_len + 1 = "
                f"{seq_len + 1} tokens; use a shorter model.seq_len or a larger corpus"
            )
        self.windows = np.array([len(a) - seq_len - 1 for a in self.arrays], dtype=np.int64)
        self.seq_len, self.batch_size, self.seed, self.rank = seq_len, batch_size, seed, rank

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows of optimizer step ``step``: (x, y) int64 of shape (batch_size, T)."""
        rng = np.random.default_rng([self.seed, self.rank, step])
        which = rng.choice(
            len(self.arrays), size=self.batch_size, p=self.windows / self.windows.sum()
        )
        starts = rng.integers(0, self.windows[which] + 1)
        t = self.seq_len
        rows = [self.arrays[w][s : s + t + 1] for w, s in zip(which, starts, strict=True)]
        buf = torch.from_numpy(np.stack(rows).astype(np.int64))
        return buf[:, :t], buf[:, 1:]


Batch = list[tuple[torch.Tensor, torch.Tensor]]  # one (x, y) per gradient-accumulation micro-step


class Prefetcher:
    """Builds the batches of steps ``start .. stop-1`` in a thread, ``depth`` steps ahead.

    Iterating yields one :data:`Batch` per step, already on ``device``: the step's
    windows cut into ``grad_accum`` equal micro-batches, so accumulating over k
    micro-batches of B sees the same data as one batch of k*B. Batches depend only on
    the step, so prefetching changes timing, never content.
    """

    def __init__(
        self,
        sampler: WindowSampler,
        start: int,
        stop: int,
        grad_accum: int,
        device: torch.device,
        depth: int,
    ) -> None:
        self.sampler, self.start, self.stop, self.grad_accum = sampler, start, stop, grad_accum
        self.device = device
        self.pin = device.type == "cuda"
        self.q: queue.Queue[Batch | BaseException] = queue.Queue(maxsize=depth)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._fill, name="pretrain-prefetch", daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        try:
            for step in range(self.start, self.stop):
                x, y = self.sampler.batch(step)
                if self.pin:
                    x, y = x.pin_memory(), y.pin_memory()
                batch = list(zip(x.chunk(self.grad_accum), y.chunk(self.grad_accum), strict=True))
                while not self.done.is_set():
                    try:
                        self.q.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.done.is_set():
                    return
        except BaseException as err:  # surfaced in the training thread
            self.q.put(err)

    def __iter__(self) -> Iterator[Batch]:
        for _ in range(self.start, self.stop):
            item = self.q.get()
            if isinstance(item, BaseException):
                raise item
            yield [
                (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                for x, y in item
            ]

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
