"""Mask expansion: a seed becomes a uniform vector in Z_{2^b} (Bonawitz et al., 2017, §4:
"PRG(s)"; Bell et al., 2020, §3).

The PRG is AES-128 in counter mode keyed by a 16-byte seed: the keystream (the encryption of
zero bytes) is read as little-endian machine words. The words are uniform in Z_{2^w}
(w = 32 or 64) and therefore uniform in Z_{2^b} for every b <= w after reduction, because
2^b divides 2^w. Every seed is used for exactly one stream (seeds are derived per session
and per pair, see :mod:`orchard.secure_agg.crypto`), so a fixed counter block is safe.

There is no Python loop over coordinates: OpenSSL writes the keystream straight into a
preallocated buffer and numpy adds it to the accumulator. :class:`MaskFolder` folds many
masks at once the way a server needs to: a chunk of the accumulator at a time (so the
accumulator chunk and the keystream stay in cache, rather than 4 MB of sum streaming
through memory for every mask) and on several threads (OpenSSL runs with the GIL
released, so the threads expand masks in parallel).
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Protocol

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from orchard.secure_agg.errors import SecAggConfigError

SEED_BYTES = 16
_ZERO_IV = bytes(16)
_AES_BLOCK = 16
# 256 KiB of keystream per step: the accumulator chunk and the keystream (512 KiB
# together) stay in a core's L2 cache (1 MiB on current EPYC parts) instead of streaming
# 4 MB per mask from memory. On a 2-core EPYC with VAES, one thread's fold (keystream and
# add) ran at 9.5 GB/s with 128-256 KiB steps against 9.3 at 1 MiB and 8.9 at 64 KiB, and
# the n = 1,000, d = 1M session's server took 1.84-1.87x its keystream bound against
# 1.89-1.94x at 1 MiB (alternating runs). Each step costs two GIL round trips (after
# update_into, after the add): at ~22 us of AES a step those stay a small share.
DEFAULT_CHUNK_BYTES = 256 * 1024
# Seeds per task: enough that streaming a worker's accumulator from memory once per task
# is negligible next to the keystream (64 masks of 4 MB vs one 4 MB accumulator), few
# enough that the tail of a session (the last task on each thread) stays short.
DEFAULT_BATCH_SEEDS = 64

__all__ = [
    "DEFAULT_BATCH_SEEDS",
    "DEFAULT_CHUNK_BYTES",
    "SEED_BYTES",
    "ByteStream",
    "Batch",
    "FoldSession",
    "FoldWorkers",
    "MaskExpander",
    "MaskFolder",
    "SeedSource",
    "available_cores",
    "expand_mask",
    "fold_batch",
    "modulus_mask",
    "word_dtype",
]


def word_dtype(modulus_bits: int) -> np.dtype:
    """The machine word that holds Z_{2^b}: uint32 for b <= 32, uint64 for b <= 64."""
    if not 1 <= modulus_bits <= 64:
        raise SecAggConfigError(f"modulus_bits must be in 1..64, got {modulus_bits}")
    return np.dtype("<u4") if modulus_bits <= 32 else np.dtype("<u8")


def modulus_mask(modulus_bits: int) -> int:
    """2^b - 1: ``x & modulus_mask(b)`` reduces a word modulo 2^b."""
    return (1 << modulus_bits) - 1


def _check_seed(seed: bytes) -> None:
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed is {SEED_BYTES} bytes, got {len(seed)}")


class MaskExpander:
    """Expands seeds into masks of ``length`` words and folds them into an accumulator.

    Holds two buffers of ``length`` words (the zero plaintext and the keystream), so a
    stream of expansions allocates nothing. Not thread-safe: one per thread.
    """

    def __init__(self, length: int, modulus_bits: int) -> None:
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self.length = length
        self.modulus_bits = modulus_bits
        self.dtype = word_dtype(modulus_bits)
        nbytes = length * self.dtype.itemsize
        self._zeros = bytes(nbytes)
        # update_into wants room for one extra block minus one byte.
        self._out = bytearray(nbytes + _AES_BLOCK - 1)
        self._view = np.frombuffer(self._out, dtype=self.dtype, count=length)
        self.expansions = 0  # measurement: how many seeds were expanded

    def expand(self, seed: bytes) -> np.ndarray:
        """The mask of ``seed`` in full words (not yet reduced mod 2^b).

        The returned array is a view of an internal buffer, valid until the next call.
        """
        _check_seed(seed)
        enc = Cipher(algorithms.AES(seed), modes.CTR(_ZERO_IV)).encryptor()
        enc.update_into(self._zeros, self._out)
        self.expansions += 1
        return self._view

    def add_into(self, acc: np.ndarray, seed: bytes, sign: int = 1) -> None:
        """``acc += sign * PRG(seed)`` modulo the word size (in place)."""
        mask = self.expand(seed)
        if sign >= 0:
            np.add(acc, mask, out=acc)
        else:
            np.subtract(acc, mask, out=acc)


SeedSource = bytes | Callable[[], bytes]  # a seed, or a function that derives it
Batch = list[tuple[SeedSource, bool]]  # seeds and whether each mask is subtracted


class FoldSession(Protocol):
    """One fold handed to :class:`FoldWorkers`: batches go out with :meth:`submit`, the
    sums come back into the accumulator with :meth:`collect` (or are dropped, :meth:`abort`)."""

    def submit(self, batch: Batch) -> bool:
        """Take ``batch``; False if it must be folded by the caller."""
        ...

    def collect(self, acc: np.ndarray) -> list[Batch]:
        """Add the folded sums into ``acc``; return the batches that were lost (fold them)."""
        ...

    def abort(self) -> None:
        """Give up the fold: nothing comes back."""
        ...


class FoldWorkers(Protocol):
    """Something outside this thread that folds batches with :func:`fold_batch` (the
    server's mask worker processes, ``orchard.server.maskworkers.MaskWorkers``)."""

    def open(self, words: int, dtype: np.dtype, chunk_words: int) -> FoldSession | None:
        """A fold into an accumulator of ``words`` words of ``dtype``; None if unavailable."""
        ...


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not every OS has affinity masks
        return max(1, os.cpu_count() or 1)


class MaskFolder:
    """``acc += sum_i sign_i * PRG(seed_i)`` modulo the word size, for many seeds.

    Seeds are queued with :meth:`add` and folded in batches of ``batch`` seeds; with
    ``threads > 1`` the batches run on a thread pool as soon as they fill. Call
    :meth:`finish` once, after the last :meth:`add`: it waits for every batch and leaves
    the sum in ``acc``. Use it as a context manager (or call :meth:`close`) so an error
    part-way stops the threads.

    A seed may also be queued as a function that derives it (a key agreement, say): the
    folding thread calls it just before the seed's first chunk. Derivations that hold the
    GIL (X25519 does) then run between the thread's own AES calls, which release it, so
    they overlap the other threads' keystream instead of stalling them; the same work
    done up front on the caller's thread would keep every mask thread waiting for the GIL.

    A batch keeps one AES-CTR context per seed and walks the vector a chunk of
    ``chunk_bytes`` at a time, folding the next chunk of every seed's keystream into the
    same chunk of its accumulator: CTR is a stream, so consecutive ``update_into`` calls
    on one context continue the same keystream and the words are exactly those of
    :func:`expand_mask`, at any chunk size. Each thread adds into its own accumulator
    (the first one is ``acc``, the others are allocated when first used) and
    :meth:`finish` adds them up: addition modulo 2^w is commutative and associative, so
    the sum does not depend on how seeds were spread over threads.

    Given ``workers`` (:class:`FoldWorkers`: a server's mask worker processes), the
    batches go to them instead, each with its own interpreter, so no fold waits for
    another's GIL; the seed sources must then pickle (raw seeds and :class:`~orchard.secure_agg.crypto.PairwiseSeed`
    do). Workers busy with another folder, closed or gone mean threads, as without them.

    Not thread-safe itself: one caller drives it.
    """

    def __init__(self, acc: np.ndarray, *, threads: int = 1,
                 batch: int = DEFAULT_BATCH_SEEDS,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 workers: FoldWorkers | None = None) -> None:
        if not isinstance(acc, np.ndarray) or acc.ndim != 1 or not acc.flags.c_contiguous \
                or acc.dtype not in (np.dtype("<u4"), np.dtype("<u8")) or not acc.flags.writeable:
            raise ValueError("the accumulator must be a writable, contiguous 1-d array of "
                             "little-endian uint32 or uint64 words, got "
                             f"{getattr(acc, 'dtype', type(acc))} with shape "
                             f"{getattr(acc, 'shape', None)}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1 seed, got {batch}")
        if chunk_bytes < _AES_BLOCK:
            raise ValueError(f"chunk_bytes must be at least one AES block ({_AES_BLOCK}), "
                             f"got {chunk_bytes}")
        self._acc = acc
        self.threads = threads
        self.batch = batch
        itemsize = acc.dtype.itemsize
        # Whole AES blocks per chunk (not needed for correctness, CTR streams across any
        # split, but it keeps OpenSSL on its block-aligned fast path).
        self._chunk_words = max(1, (chunk_bytes // _AES_BLOCK) * _AES_BLOCK // itemsize)
        self._zeros = bytes(min(acc.size, self._chunk_words) * itemsize)
        self._pending: list[tuple[SeedSource, bool]] = []
        self._futures: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        # Accumulators not in use by a running batch; a batch takes one and gives it back.
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._free.put(acc)
        self._extra: list[np.ndarray] = []
        self._finished = False
        self._workers = workers
        self._session: FoldSession | None = None  # the workers, once the first batch goes out
        self.expansions = 0  # measurement: seeds expanded (each is one mask of acc.size words)
        self.batches_on_workers = 0  # measurement: batches folded by worker processes

    def add(self, seed: SeedSource, sign: int = 1) -> None:
        """Queue ``sign * PRG(seed)`` (sign +1 adds the mask, -1 subtracts it).

        ``seed`` is the 16-byte seed or a function of no arguments that returns it; its
        errors (and a seed of the wrong length) surface from :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("this MaskFolder has finished; make a new one")
        if not callable(seed):
            _check_seed(seed)
            seed = bytes(seed)
        self._pending.append((seed, sign < 0))
        self.expansions += 1
        if len(self._pending) >= self.batch:
            self._dispatch()

    def finish(self) -> np.ndarray:
        """Fold everything queued, wait for it, and return the accumulator (``acc``)."""
        if self._finished:
            raise RuntimeError("this MaskFolder has already finished")
        self._finished = True
        try:
            self._dispatch()
            for fut in self._futures:
                fut.result()  # re-raises a worker's error here
            if self._session is not None:
                session, self._session = self._session, None
                for batch in session.collect(self._acc):  # a dead worker's batches, again
                    self.batches_on_workers -= 1
                    fold_batch(self._acc, batch, self._chunk_words, self._zeros)
        finally:
            self.close()
        for extra in self._extra:
            np.add(self._acc, extra, out=self._acc)
        self._extra.clear()
        return self._acc

    def close(self) -> None:
        """Stop the threads (waiting for running batches); idempotent."""
        self._finished = True
        self._pending.clear()
        if self._session is not None:
            self._session.abort()
            self._session = None
        if self._pool is not None:
            for fut in self._futures:
                fut.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> MaskFolder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _dispatch(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        if self._workers is not None and self._acc.size:
            # Asked once: workers busy or closed now mean threads for the whole fold.
            workers, self._workers = self._workers, None
            self._session = workers.open(self._acc.size, self._acc.dtype, self._chunk_words)
        if self._session is not None and self._session.submit(batch):
            self.batches_on_workers += 1
            return
        if self.threads == 1:
            self._fold(batch)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="secagg-mask")
        self._futures.append(self._pool.submit(self._fold, batch))

    def _take_accumulator(self) -> np.ndarray:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        # At most `threads` batches run at once and each holds one accumulator, so a
        # free one is missing only while fewer than `threads` exist.
        extra = np.zeros_like(self._acc)
        self._extra.append(extra)
        return extra

    def _fold(self, batch: list[tuple[SeedSource, bool]]) -> None:
        acc = self._take_accumulator()
        try:
            fold_batch(acc, batch, self._chunk_words, self._zeros)
        finally:
            self._free.put(acc)


def _seed_of(source: SeedSource) -> bytes:
    seed = source() if callable(source) else source
    _check_seed(seed)
    return seed


def fold_batch(acc: np.ndarray, batch: Batch, chunk_words: int, zeros: bytes) -> None:
    """The inner loop of :class:`MaskFolder` (and of a mask worker process): chunk-major
    over one batch of seeds, ``chunk_words`` words at a time, ``zeros`` being at least one
    chunk of zero bytes. Seeds given as functions are derived during the first chunk, each
    just before its mask."""
    itemsize = acc.dtype.itemsize
    streams: list[tuple[Callable[..., int], bool]] = []
    if acc.size == 0:
        for source, _ in batch:
            _seed_of(source)  # nothing to fold, but a bad seed is still an error
        return
    buf = bytearray(min(acc.size, chunk_words) * itemsize + _AES_BLOCK - 1)
    keystream = np.frombuffer(buf, dtype=acc.dtype, count=min(acc.size, chunk_words))
    plain = memoryview(zeros)
    add, sub = np.add, np.subtract
    for lo in range(0, acc.size, chunk_words):
        part = acc[lo:lo + chunk_words]
        n = part.size
        ks, zin = (keystream, plain) if n == keystream.size else (keystream[:n], plain[:n * itemsize])
        if lo == 0:
            for source, neg in batch:
                update_into = Cipher(algorithms.AES(_seed_of(source)),
                                     modes.CTR(_ZERO_IV)).encryptor().update_into
                streams.append((update_into, neg))
                update_into(zin, buf)
                if neg:
                    sub(part, ks, out=part)
                else:
                    add(part, ks, out=part)
            continue
        for update_into, neg in streams:
            update_into(zin, buf)
            if neg:
                sub(part, ks, out=part)
            else:
                add(part, ks, out=part)


def expand_mask(seed: bytes, length: int, modulus_bits: int = 32) -> np.ndarray:
    """PRG(seed) as ``length`` elements of Z_{2^b} (a fresh array)."""
    exp = MaskExpander(length, modulus_bits)
    out = exp.expand(seed).copy()
    out &= np.asarray(modulus_mask(modulus_bits), dtype=out.dtype)
    return out


class ByteStream:
    """A deterministic stream of pseudorandom bytes (AES-256-CTR keyed by ``key``).

    Clients draw all their secrets (key pairs, self-mask seed, Shamir coefficients) from
    one of these, seeded with 32 bytes of entropy the caller provides, so the protocol is
    reproducible in tests and the package never touches a global RNG.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError(f"ByteStream needs a 32-byte key, got {len(key)}")
        self._enc = Cipher(algorithms.AES(key), modes.CTR(_ZERO_IV)).encryptor()

    def read(self, n: int) -> bytes:
        return self._enc.update(bytes(n))
