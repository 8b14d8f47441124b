"""Mask folding on worker processes: a server's unmasking without its own GIL (the
:class:`~orchard.secure_agg.prg.FoldWorkers` a tier gives its secure sessions).

Removing the masks is nearly all AES-CTR keystream and additions, and both release the
GIL, so :class:`~orchard.secure_agg.prg.MaskFolder` runs them on threads. But each
256 KiB step takes the GIL back twice, and every pairwise seed needs an X25519 agreement
that holds it for about 25 us: at n = 1,000, d = 1M with 10% dropout the two mask
threads of one process spend about a tenth of the unmasking waiting for each other.
:class:`MaskWorkers` are processes, one per core by default, each with its own
interpreter. A folder (``MaskFolder``) given them sends each batch of seeds (raw seeds, or picklable
derivations such as :class:`~orchard.secure_agg.crypto.PairwiseSeed`) to one worker in
turn; the worker folds it into its own accumulator with the folder's own loop
(:func:`~orchard.secure_agg.prg.fold_batch`), and
:meth:`MaskFolder.finish` receives each worker's accumulator and adds them up. Addition
modulo 2^w commutes, so the sum is the threads' sum to the bit.

Start them once per server process and close them at shutdown: they take a few tenths of
a second to start (each imports numpy and ``cryptography``), and then a session costs one
accumulator (4 bytes a coordinate) per worker and the seeds' bytes over a pipe. One
folder uses them at a time; a folder that finds them busy or closed folds on threads, as
it does without them. A worker that dies mid-session costs time, not the session: the
batches it held are folded again on the caller's thread. Workers that are dropped
without :meth:`MaskWorkers.close` exit when their pipe closes (or with the interpreter:
they are daemons). They live here, with the server, and not in the pure
``orchard.secure_agg``: they are processes that talk over pipes; what they compute is
the package's pure fold.

    with MaskWorkers() as workers:
        server = SecAggServer(config, workers=workers)   # one session after another
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

import numpy as np

from orchard.secure_agg.crypto import load_private_cached
from orchard.secure_agg.prg import Batch, available_cores, fold_batch

__all__ = ["MaskWorkers"]


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    alive: bool = True


class MaskWorkers:
    """``processes`` worker processes (None: one per core this process may use) that
    fold mask batches for :class:`~orchard.secure_agg.prg.MaskFolder`. Thread-safe: a
    folder takes them for its session with :meth:`open`, and a second folder meanwhile
    gets None (and folds on threads)."""

    def __init__(self, processes: int | None = None) -> None:
        count = processes if processes is not None else available_cores()
        if count < 1:
            raise ValueError(f"processes must be >= 1 (or None for every core), got {count}")
        # spawn, not fork: a server forking with gRPC's and asyncio's threads running
        # would hand the child their locks in whatever state they were.
        ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        self._sessions = 0  # sessions opened; each is numbered
        # The number of the last session given up: its workers skip the batches it still
        # has queued instead of folding them for nobody.
        self._cancelled = ctx.RawValue("q", 0)
        try:
            for i in range(count):
                ours, theirs = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_serve, args=(theirs, self._cancelled),
                                   name=f"orchard-mask-worker-{i}", daemon=True)
                proc.start()
                theirs.close()
                self._workers.append(_Worker(proc, ours))
        except BaseException:
            self.close()
            raise

    @property
    def processes(self) -> int:
        """How many worker processes are alive."""
        return sum(1 for w in self._workers if w.alive and w.process.is_alive())

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (for measuring their CPU time)."""
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    @property
    def closed(self) -> bool:
        return self._closed

    def open(self, words: int, dtype: np.dtype, chunk_words: int) -> WorkerSession | None:
        """Take the workers for one fold into an accumulator of ``words`` words of
        ``dtype``; None if another fold has them, or they are closed or all gone."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            live = [w for w in self._workers if w.alive] if not self._closed else []
            self._sessions += 1
            begin = ("begin", words, np.dtype(dtype).str, chunk_words, self._sessions)
            for w in live:
                _send(w, begin)
            live = [w for w in live if w.alive]
            if not live:
                self._lock.release()
                return None
            return WorkerSession(self, live, words, np.dtype(dtype), self._sessions)
        except BaseException:
            self._lock.release()
            raise

    def close(self) -> None:
        """Stop the workers (waiting briefly for each); idempotent. Waits up to 30 s for
        a fold that has them to finish first, then stops them all the same."""
        held = self._lock.acquire(timeout=30)
        try:
            self._closed = True
            for w in self._workers:
                if w.alive:
                    _send(w, ("stop",))
            for w in self._workers:
                w.process.join(timeout=5)
                if w.process.is_alive():
                    w.process.terminate()
                    w.process.join(timeout=5)
                w.conn.close()
                w.alive = False
        finally:
            if held:
                self._lock.release()

    def __enter__(self) -> MaskWorkers:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@dataclass
class WorkerSession:
    """One fold on the workers (from :meth:`MaskWorkers.open`): :meth:`submit` batches,
    then :meth:`collect` once (or :meth:`abort`)."""

    owner: MaskWorkers
    workers: list[_Worker]
    words: int
    dtype: np.dtype
    number: int
    sent: list[list[Batch]] = field(init=False)  # per worker, what it was sent
    _turn: int = 0
    _done: bool = False

    def __post_init__(self) -> None:
        self.sent = [[] for _ in self.workers]

    def submit(self, batch: Batch) -> bool:
        """Send ``batch`` to the next live worker; False if none took it or it does not
        pickle (fold it yourself)."""
        try:
            payload = pickle.dumps(("fold", batch), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError):
            return False  # a seed source that does not pickle (a closure): fold it here
        for _ in range(len(self.workers)):
            i = self._turn
            self._turn = (self._turn + 1) % len(self.workers)
            w = self.workers[i]
            if w.alive and _send_bytes(w, payload):
                self.sent[i].append(batch)
                return True
        return False

    def collect(self, acc: np.ndarray) -> list[Batch]:
        """Add every worker's sum into ``acc`` and give the workers back. Returns the
        batches of workers that died (fold them yourself); re-raises the first error a
        worker's fold raised (a bad seed, a derivation's refusal) once all have answered."""
        if self._done:
            raise RuntimeError("this worker session has already been collected")
        self._done = True
        lost: list[Batch] = []
        first_error: BaseException | None = None
        buf = np.empty(self.words, self.dtype)
        try:
            asked = []
            for i, w in enumerate(self.workers):
                if w.alive and _send(w, ("end",)):
                    asked.append(i)
                else:
                    lost.extend(self.sent[i])
            for i in asked:
                w = self.workers[i]
                try:
                    reply = w.conn.recv()
                    if reply[0] == "error":
                        first_error = first_error or reply[1]
                        continue
                    got = w.conn.recv_bytes_into(buf)
                except (EOFError, OSError):
                    w.alive = False
                    lost.extend(self.sent[i])
                    continue
                if got != buf.nbytes:  # pragma: no cover - a worker speaks only this protocol
                    raise RuntimeError(f"a mask worker sent {got} bytes for a {buf.nbytes}-byte sum")
                np.add(acc, buf, out=acc)
        finally:
            self.owner._lock.release()
        if first_error is not None:
            raise first_error
        return lost

    def abort(self) -> None:
        """Give the workers back without a result: they skip the batches still queued
        and drop what they folded."""
        if self._done:
            return
        self._done = True
        self.owner._cancelled.value = self.number
        try:
            for w in self.workers:
                if w.alive:
                    _send(w, ("drop",))
        finally:
            self.owner._lock.release()


def _send(w: _Worker, msg: tuple[object, ...]) -> bool:
    return _send_bytes(w, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _send_bytes(w: _Worker, payload: bytes) -> bool:
    try:
        w.conn.send_bytes(payload)
        return True
    except (OSError, ValueError):  # the worker is gone (broken pipe) or the pipe closed
        w.alive = False
        return False


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _serve(conn: Connection, cancelled: Any) -> None:
    """A worker's loop: begin, fold..., end (or drop), and so on until stop or EOF.
    ``cancelled.value`` is the number of the last session the parent gave up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    acc: np.ndarray | None = None
    zeros = b""
    chunk_words = 1
    session = 0
    error: BaseException | None = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "fold":
            if acc is not None and error is None and cancelled.value != session:
                try:
                    fold_batch(acc, msg[1], chunk_words, zeros)
                except Exception as exc:
                    error = exc
        elif kind == "begin":
            _, words, dtype, chunk_words, session = msg
            if acc is not None and acc.size == words and acc.dtype == np.dtype(dtype):
                acc.fill(0)
            else:
                acc = np.zeros(words, dtype)
            zeros = bytes(min(words, chunk_words) * acc.dtype.itemsize)
            error = None
        elif kind == "end":
            load_private_cached.cache_clear()  # the session's reconstructed mask keys go with it
            if error is not None or acc is None:
                conn.send(("error", _picklable(error or RuntimeError("a mask worker got "
                                                                     "'end' before 'begin'"))))
            else:
                conn.send(("sum",))
                conn.send_bytes(acc.data)
            error = None
        elif kind == "drop":
            load_private_cached.cache_clear()
            error = None
        elif kind == "stop":
            return
