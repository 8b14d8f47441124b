"""Where a tier's CPU work runs: one interface, two executors.

A tier served over gRPC (:class:`PooledExecutor`) keeps its event loop free: payloads
are checked and decoded on a pool of two threads, folds run one at a time on a fold
thread (the accumulator is not thread-safe; one job at a time also orders a buffer move
after the folds queued before it), a secure session's unmasking closes on a thread of
its own, sends upstream run as tasks of the loop, and a large session's masks are
expanded on mask worker processes.

An in-process tier (:class:`InlineExecutor`: the simulator, tests) does all of it on
the caller's thread: what it offloads is already done when awaited, so the tier's
coroutines finish without suspending and :func:`run_inline` drives them to the end.
The protocols above call the same methods either way; which executor a tier has is its
one difference.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from orchard.config import RunConfig, ServerConfig
from orchard.errors import OrchardError
from orchard.server.maskworkers import MaskWorkers
from orchard.server.secagg import MASK_WORKERS_MIN_BYTES, SecureCohort, mask_bytes
from orchard.typing import TensorSpec

T = TypeVar("T")
log = logging.getLogger("orchard.server.coordinator")


class _Ready:
    """An awaitable that is already done: an inline tier's offloaded work."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, Any]:
        return self.value
        yield  # a generator that returns at once: awaiting it never suspends


def run_inline(coro: Coroutine[Any, Any, T]) -> T:
    """Drive a coroutine of an inline coordinator to its end on this thread. It must not
    suspend (an inline coordinator's offloaded work is already done when awaited)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("an in-process coordinator call had to wait; only inline coordinators run in-process")


class Executor(Protocol):
    """How a tier runs its CPU work and its sends (see the module doc)."""

    defers_unmasking: bool  # a session's unmasking stage closes off the caller (unmask)

    def in_process(self, what: str) -> None:
        """Refuse ``what`` (an in-process call) unless this executor runs inline."""

    def decode(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Integrity check and decode, beside other decodes."""

    def fold(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """A fold, after every fold queued before it."""

    def after_folds(self, fn: Callable[..., None], *args: Any, then: Callable[[], None]) -> None:
        """``fn`` after the folds queued so far and before any queued later; ``then`` on
        the loop once it succeeded off it (not inline: ``fn`` ran at once, in the caller's
        step, which goes on to check the round itself)."""

    async def drain(self) -> None:
        """Return once the folds queued so far are done."""

    def spawn(self, coro: Coroutine[Any, Any, None], failed: Callable[[BaseException], None]) -> None:
        """Run a send upstream from a synchronous step; ``failed`` hears an error."""

    def unmask(self, sc: SecureCohort, then: Callable[[], None]) -> None:
        """Close a session's unmasking stage (``defers_unmasking``), then call ``then``."""

    def mask_workers(self, run: RunConfig, schema: tuple[TensorSpec, ...], n: int) -> MaskWorkers | None:
        """Mask worker processes for a session of ``n`` clients, or None (threads)."""

    def pool(self) -> ThreadPoolExecutor:
        """The decode pool, for other CPU work off the loop (downlink deltas)."""

    def shutdown(self) -> None: ...


class InlineExecutor:
    """Everything on the caller's thread (in-process tiers)."""

    defers_unmasking = False

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def in_process(self, what: str) -> None:
        return None

    def decode(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        return _Ready(fn(*args))

    fold = decode

    def after_folds(self, fn: Callable[..., None], *args: Any, then: Callable[[], None]) -> None:
        fn(*args)

    async def drain(self) -> None:
        return None

    def spawn(self, coro: Coroutine[Any, Any, None], failed: Callable[[BaseException], None]) -> None:
        try:
            run_inline(coro)
        except OrchardError as err:
            failed(err)

    def unmask(self, sc: SecureCohort, then: Callable[[], None]) -> None:
        raise RuntimeError("an inline tier closes the unmasking stage where it falls due")

    def mask_workers(self, run: RunConfig, schema: tuple[TensorSpec, ...], n: int) -> MaskWorkers | None:
        return None  # the simulator's sessions fold on threads

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-decode")
        return self._pool

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class PooledExecutor:
    """Work off the event loop (a tier served over gRPC); see the module doc."""

    defers_unmasking = True

    def __init__(self, name: str, cfg: ServerConfig) -> None:
        self.name, self.cfg = name, cfg
        # One fold at a time (the accumulator is not thread-safe); decoding runs beside it.
        self._fold_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-fold")
        self._decode_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="orchard-decode")
        self._unmask_pool: ThreadPoolExecutor | None = None  # a session's unmasking, off the loop
        self._workers: MaskWorkers | None = None  # started by a large secure session
        self._workers_failed = False  # they could not start: threads from then on
        self._tasks: set[asyncio.Task[None]] = set()  # sends and unmaskings in progress (held until done)

    def in_process(self, what: str) -> None:
        raise RuntimeError(f"{what} needs an inline coordinator (Coordinator(..., inline=True))")

    def decode(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        return asyncio.get_running_loop().run_in_executor(self._decode_pool, fn, *args)

    def fold(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        return asyncio.get_running_loop().run_in_executor(self._fold_pool, fn, *args)

    def after_folds(self, fn: Callable[..., None], *args: Any, then: Callable[[], None]) -> None:
        fut = asyncio.get_running_loop().run_in_executor(self._fold_pool, fn, *args)

        def done(f: asyncio.Future[None]) -> None:
            if not f.cancelled() and f.exception() is None:
                then()

        fut.add_done_callback(done)

    async def drain(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._fold_pool, lambda: None)

    def _hold(self, coro: Coroutine[Any, Any, None], failed: Callable[[BaseException], None] | None) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if failed is not None and not t.cancelled() and t.exception() is not None:
                failed(t.exception())  # type: ignore[arg-type]

        task.add_done_callback(done)

    def spawn(self, coro: Coroutine[Any, Any, None], failed: Callable[[BaseException], None]) -> None:
        self._hold(coro, failed)

    def unmask(self, sc: SecureCohort, then: Callable[[], None]) -> None:
        self._hold(self._unmask(sc, then), None)

    async def _unmask(self, sc: SecureCohort, then: Callable[[], None]) -> None:
        if self._unmask_pool is None:
            self._unmask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-unmask")
        try:
            await asyncio.get_running_loop().run_in_executor(self._unmask_pool, sc.close_due_stage)
        except Exception as err:  # a fault, not the protocol's abort (that is recorded by the session)
            sc.failure = f"unmasking failed: {type(err).__name__}: {err}"
        finally:
            sc.closing = False
        then()

    def mask_workers(self, run: RunConfig, schema: tuple[TensorSpec, ...], n: int) -> MaskWorkers | None:
        """Started with the first session large enough to gain from them; None (the
        session's threads) for smaller ones and ``server.mask_workers = 0``."""
        if self.cfg.mask_workers == 0 or self._workers_failed or mask_bytes(run, schema, n) < MASK_WORKERS_MIN_BYTES:
            return None
        if self._workers is None or self._workers.closed:
            try:
                self._workers = MaskWorkers(self.cfg.mask_workers)
            except (OSError, RuntimeError) as err:  # no processes to be had here: threads, for good
                self._workers_failed = True
                log.warning("%s: could not start mask worker processes (%s); secure sessions unmask on "
                            "threads", self.name, err)
                return None
        return self._workers

    def pool(self) -> ThreadPoolExecutor:
        return self._decode_pool

    def shutdown(self) -> None:
        self._fold_pool.shutdown(wait=False, cancel_futures=True)
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
        if self._unmask_pool is not None:
            self._unmask_pool.shutdown(wait=False, cancel_futures=True)
        if self._workers is not None:
            self._workers.close()


def executor_for(name: str, cfg: ServerConfig, inline: bool) -> Executor:
    """An in-process tier's executor (``inline``), or a served tier's."""
    return InlineExecutor() if inline else PooledExecutor(name, cfg)
