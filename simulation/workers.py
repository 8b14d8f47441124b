"""Worker processes the engine talks to over its own pipes, from its own thread.

``concurrent.futures.ProcessPoolExecutor`` moves each call through two helper threads
of the calling process (a manager that queues it, a feeder that pickles and writes it)
and reads each result on the manager thread. The round engine's thread runs Python
without pause, so every one of those hops waits for the GIL: a batch of device models
submitted while devices were handed out reached the idle worker 80 ms later, and a
finished one was seen as done as late. Here the engine's thread does it all itself:
a call is pickled and written at once, and results are read whenever the engine asks
whether one is done (:meth:`Call.done`) or waits for one (:meth:`Call.result`). The
pipes are non-blocking on the engine's side: what does not fit waits in an outbox and
goes out as results are read, so neither side can block the other for good.

Calls to one worker run in order. A call cancelled before its worker starts it is
skipped there (the cancel travels behind it, and a worker reads everything waiting
before it starts a call); one it already runs finishes, and settles with its result.
``result`` and ``exception`` wait for the call whatever their ``timeout`` (the engine
only ever waits for one it needs).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import pickle
import select
import struct
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from orchard.errors import OrchardError

_LEN = struct.Struct("<Q")  # a message's length, before it
_PIPE_BYTES = 1 << 20  # pipe capacity asked for (Linux; the default is 64 KiB)
_PUMP_EVERY_S = 100e-6  # the engine reads its pipes at most this often unless it waits


class WorkerError(OrchardError):
    """A worker process could not start or stopped while it had calls."""


class Call(Future[Any]):
    """The result of one call on a worker: a Future whose state moves on when the engine
    looks at it (``done``, ``result``, ``exception``), since no other thread reads the
    workers. Cancelling one asks its worker to skip it; it is settled (cancelled, or with
    its result if it was already running) once the worker has answered, so whatever
    its callbacks release is no longer in use by the worker."""

    def __init__(self, pool: WorkerPool, worker: _Worker, call_id: int) -> None:
        super().__init__()
        self._pool, self._worker, self.call_id = pool, worker, call_id
        self.withdrawn = False
        self.settled = False  # set by _settle, the one place a call's state changes

    def done(self) -> bool:
        # Asked thousands of times a round: a flag, not Future.done's lock, and a pump
        # that returns at once unless it is time to look at the pipes.
        if not self.settled:
            self._pool.pump()
        return self.settled

    def result(self, timeout: float | None = None) -> Any:
        self._wait()
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait()
        return super().exception(0)

    def _wait(self) -> None:
        while not super().done():
            self._pool.pump(wait=True)

    def cancel(self) -> bool:
        if super().done():
            return False
        if not self.withdrawn:
            self.withdrawn = True
            self._worker.send(("cancel", self.call_id))
        return True


class _Worker:
    """One worker process and the engine's ends of its two pipes (non-blocking)."""

    def __init__(self, ctx: Any, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
        calls_r, calls_w = ctx.Pipe(duplex=False)
        results_r, results_w = ctx.Pipe(duplex=False)
        # The child's ends go to it as arguments (spawn hands their descriptors over).
        self.proc = ctx.Process(target=_serve, args=(calls_r, results_w, initializer, initargs), daemon=True,
                                name="orchard-sim-worker")
        self.proc.start()
        calls_r.close()
        results_w.close()
        self._conns = (calls_w, results_r)  # they own the descriptors below
        self.calls_fd, self.results_fd = calls_w.fileno(), results_r.fileno()
        for fd in (self.calls_fd, self.results_fd):
            _widen(fd)
            os.set_blocking(fd, False)
        self.outbox = bytearray()  # calls written that did not fit in the pipe yet
        self.inbox = bytearray()  # result bytes read, not yet a whole message
        self.calls: dict[int, Call] = {}  # sent, not settled
        self.gone = False

    def send(self, message: tuple[Any, ...]) -> None:
        if self.gone:
            return
        body = pickle.dumps(message, protocol=5)
        self.outbox += _LEN.pack(len(body))
        self.outbox += body
        self.flush()

    def flush(self) -> None:
        while self.outbox and not self.gone:
            try:
                n = os.write(self.calls_fd, self.outbox)
            except BlockingIOError:
                return
            except BrokenPipeError:  # the worker is gone: read() sees the end of its results
                self.outbox.clear()
                return
            del self.outbox[:n]

    def read(self) -> list[tuple[Any, ...]]:
        """The messages that arrived (none if none did); marks the worker gone at end of file."""
        while not self.gone:
            try:
                chunk = os.read(self.results_fd, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                self.gone = True
                break
            self.inbox += chunk
            if len(chunk) < 1 << 20:  # the pipe is empty now
                break
        return _messages(self.inbox)

    def close(self) -> None:
        for conn in self._conns:
            conn.close()


class WorkerPool:
    """``workers`` spawned processes, each set up by ``initializer(*initargs)``, that run
    module-level functions for the engine (``submit``). A call goes to the worker with
    the fewest calls unsettled."""

    def __init__(self, workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
        import multiprocessing as mp

        if os.name != "posix" or not hasattr(select, "poll"):
            raise WorkerError("worker processes need a POSIX system (non-blocking pipes and poll); "
                              "use backend = 'local' here")
        ctx = mp.get_context("spawn")  # no torch state shared by fork
        self._workers = [_Worker(ctx, initializer, initargs) for _ in range(workers)]
        self._poll = select.poll()
        for w in self._workers:
            self._poll.register(w.results_fd, select.POLLIN)  # (hang-up and errors are always reported)
        self._pumped = -math.inf
        self._ids = itertools.count()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Call:
        return self.submit_to(None, fn, *args)

    def submit_to(self, index: int | None, fn: Callable[..., Any], *args: Any) -> Call:
        """``submit`` to worker ``index`` (one that keeps state for the caller), or with
        None to the worker with the fewest calls unsettled."""
        if self._closed:
            raise RuntimeError("this worker pool is closed")
        self.pump()
        pick = self._workers if index is None else [self._workers[index]]
        live = [w for w in pick if not w.gone]
        if not live:
            which = "every simulation worker process" if index is None else f"simulation worker {index}"
            raise WorkerError(f"{which} has stopped ("
                              + "; ".join(_why_stopped(w.proc.exitcode) for w in pick) + ")" + _AGAIN)
        worker = min(live, key=lambda w: len(w.calls))
        call = Call(self, worker, next(self._ids))
        worker.calls[call.call_id] = call
        worker.send(("call", call.call_id, fn, args))
        return call

    def pump(self, wait: bool = False) -> None:
        """Write what waits in the outboxes and settle the calls whose results arrived;
        with ``wait``, first block until a pipe is ready (a caller waits on a result).

        Without ``wait`` the engine asks often (each time it looks at a call): one
        ``poll`` says which pipes have bytes, and it is asked at most every
        ``_PUMP_EVERY_S`` unless something waits to be written."""
        live = [w for w in self._workers if not w.gone]
        now = time.perf_counter()
        if wait and live:
            _wait_ready([w.results_fd for w in live], [w.calls_fd for w in live if w.outbox])
        elif now - self._pumped < _PUMP_EVERY_S and not any(w.outbox for w in live):
            return
        self._pumped = now
        ready = {fd for fd, _ in self._poll.poll(0)}
        for w in live:
            w.flush()
            if w.results_fd not in ready:
                continue
            for message in w.read():
                _settle(w, message)
            if w.gone:
                w.proc.join(timeout=1.0)
                _fail(w, WorkerError(f"a simulation worker process stopped ({_why_stopped(w.proc.exitcode)}) "
                                     f"with {len(w.calls)} calls unfinished" + _AGAIN))

    def close(self) -> None:
        """Stop the workers and wait for them; calls still waiting are skipped, and every
        call is settled (a cancelled one once its worker is done with it)."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            for call in list(w.calls.values()):
                call.cancel()
            w.send(("stop", -1))
        deadline = time.monotonic() + 30.0
        while any(not w.gone for w in self._workers) and time.monotonic() < deadline:
            self.pump(wait=True)
        for w in self._workers:
            if w.proc.is_alive():
                w.proc.terminate()
            w.proc.join()
            w.gone = True
            _fail(w, WorkerError("the worker pool closed before this call ran"))
            w.close()


_AGAIN = ("; start the simulation again (if the machine ran short of memory: fewer workers, "
          "a smaller chunk_size, or backend = 'local')")


def _why_stopped(exitcode: int | None) -> str:
    if exitcode is None:
        return "its pipe closed"
    if exitcode < 0:
        return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _wait_ready(readable: list[int], writable: list[int]) -> None:
    """Block until a result pipe has bytes or an outbox's pipe has room (at most a second)."""
    select.select(readable, writable, [], 1.0)


def _messages(buf: bytearray) -> list[tuple[Any, ...]]:
    """The whole messages at the front of ``buf`` (taken out of it), in order."""
    out = []
    while len(buf) >= _LEN.size:
        (size,) = _LEN.unpack_from(buf)
        if len(buf) < _LEN.size + size:
            break
        with memoryview(buf) as view:
            out.append(pickle.loads(view[_LEN.size:_LEN.size + size]))
        del buf[:_LEN.size + size]
    return out


def _fail(w: _Worker, err: WorkerError) -> None:
    """Settle every call still on ``w`` with ``err``."""
    for call_id in list(w.calls):
        _settle(w, ("error", call_id, err))


def _settle(w: _Worker, message: tuple[Any, ...]) -> None:
    kind, call_id, value = message
    call = w.calls.pop(call_id, None)
    if call is None:
        return
    call.settled = True
    if kind == "skipped":  # cancelled before it ran
        Future.cancel(call)
    elif kind == "ok":
        call.set_result(value)
    else:
        call.set_exception(value)


def _widen(fd: int) -> None:
    """Ask for a larger pipe buffer where the platform allows it (Linux's F_SETPIPE_SZ):
    a call's message then goes through in one write instead of waiting on the reader."""
    import fcntl

    setsize = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setsize is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, setsize, _PIPE_BYTES)


def _serve(calls: Any, results: Any, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
    """A worker's loop: read calls, run each in order (skipping those cancelled before
    their turn), write each result. Ends at "stop" or when the engine's end closes."""
    initializer(*initargs)
    calls_fd, results_fd = calls.fileno(), results.fileno()
    waiting: deque[tuple[Any, ...]] = deque()
    cancelled: set[int] = set()
    pending = bytearray()
    open_ = True

    def take(block: bool) -> bool:
        """Read the messages waiting (blocking for some if ``block``); False at end of file."""
        os.set_blocking(calls_fd, block)
        try:
            chunk = os.read(calls_fd, 1 << 20)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        pending.extend(chunk)
        for msg in _messages(pending):
            if msg[0] == "cancel":
                cancelled.add(msg[1])
            else:
                waiting.append(msg)
        return True

    def reply(message: tuple[Any, ...]) -> None:
        body = pickle.dumps(message, protocol=5)
        data = memoryview(_LEN.pack(len(body)) + body)
        while data:
            n = os.write(results_fd, data)
            data = data[n:]

    while True:
        while open_ and not waiting:
            open_ = take(block=True)
        if open_:
            open_ = take(block=False)  # cancels sent after the next call
        if not waiting:
            return
        msg = waiting.popleft()
        if msg[0] == "stop":
            return
        _, call_id, fn, args = msg
        if call_id in cancelled:
            cancelled.discard(call_id)
            reply(("skipped", call_id, None))
            continue
        try:
            value = fn(*args)
        except BaseException as err:  # the engine's Future raises it
            try:
                reply(("error", call_id, err))
            except Exception:  # not picklable: its text
                reply(("error", call_id, WorkerError(f"{type(err).__name__}: {err}")))
            continue
        try:
            reply(("ok", call_id, value))
        except (pickle.PicklingError, TypeError, AttributeError) as err:  # nothing was written
            reply(("error", call_id, WorkerError(f"the result could not be sent back: {err}")))
