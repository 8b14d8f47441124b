"""gRPC core's log lines, with failed TLS handshakes counted rather than written one by one.

gRPC core (C++, through absl) writes its log lines straight to file descriptor 2, and
one line per failed TLS handshake (``ssl_transport_security.cc:NNNN] Handshake failed
with error SSL_ERROR_SSL: ...: WRONG_VERSION_NUMBER``): anyone who opens 200 junk
connections to a server's port writes 200 lines into its log. Python has no hook into
those lines, so a server process (``orchard server start``, ``orchard aggregator start``)
routes descriptor 2 through a pipe: a thread passes every line through unchanged except
those, which it counts by reason, and at most one line per interval (and one at
shutdown) reports the count. Python's own ``sys.stderr`` is moved to the original
descriptor, so its writes do not pass through the thread.

A line gRPC core writes just before the process aborts may be lost with the thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections import Counter
from typing import TextIO

log = logging.getLogger("orchard.tls")

# "I1128 17:03:01.946923   11194 ssl_transport_security.cc:2563] Handshake failed with error
# SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: ..."
_CORE_LINE = re.compile(rb"^[IWE]\d{4} [\d:.]+\s+\d+ [\w./-]+\.cc:\d+\] ")
_HANDSHAKE = re.compile(rb"(?i)handshake failed")
_REASONS = (re.compile(rb"OPENSSL_internal:(\w+)"), re.compile(rb"with error (\w+)"))


def handshake_reason(line: bytes) -> str | None:
    """Why the handshake failed, if ``line`` is gRPC core's line about a failed one."""
    if not (_CORE_LINE.match(line) and _HANDSHAKE.search(line)):
        return None
    for pattern in _REASONS:  # the TLS library's reason, else gRPC's error code
        m = pattern.search(line)
        if m:
            return m.group(1).decode("ascii", "replace")
    return "unknown"


class HandshakeLog:
    """Descriptor 2 through a filter that counts failed TLS handshakes (see the module)."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._orig = -1
        self._threads: list[threading.Thread] = []

    def install(self) -> HandshakeLog:
        sys.stderr.flush()
        self._orig = os.dup(2)
        r, w = os.pipe()
        os.dup2(w, 2)
        os.close(w)
        self._stderr = sys.stderr
        sys.stderr = open(self._orig, "w", buffering=1, encoding="utf-8",  # noqa: SIM115 - lives with the process
                          errors="backslashreplace", closefd=False)
        self._threads = [threading.Thread(target=self._pump, args=(r,), name="orchard-corelog", daemon=True),
                         threading.Thread(target=self._tick, name="orchard-corelog-report", daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        """Report what is left, and give descriptor 2 back."""
        if self._orig < 0:
            return
        self._stop.set()
        os.dup2(self._orig, 2)  # closes the pipe's last writer: the pump drains it and ends
        for t in self._threads:
            t.join(timeout=5)
        self._report()
        current: TextIO = sys.stderr
        current.flush()
        sys.stderr = self._stderr
        self._orig = -1

    def _pump(self, r: int) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(r, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            passed = []
            for line in lines:
                reason = handshake_reason(line)
                if reason is None:
                    passed.append(line + b"\n")
                else:
                    with self._lock:
                        self._counts[reason] += 1
            if len(buf) > 1 << 16:  # a very long line without its end yet: let it through
                passed.append(buf)
                buf = b""
            if passed:
                self._write(b"".join(passed))
        if buf:
            self._write(buf)
        os.close(r)

    def _write(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # the original stderr is gone: nothing to tell anyone
            while data:
                data = data[os.write(self._orig, data):]

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._report()

    def _report(self) -> None:
        with self._lock:
            counts, self._counts = self._counts, Counter()
            since, self._since = self._since, time.monotonic()
        n = sum(counts.values())
        if n:
            reasons = ", ".join(f"{k} {v}" for k, v in counts.most_common())
            log.warning("%d TLS handshake%s failed in the last %.0f s (%s): callers that are not Orchard nodes, "
                        "or that offer TLS below 1.3 or distrust this server's certificate; counted here, not "
                        "logged one by one", n, "s" if n > 1 else "", time.monotonic() - since, reasons)
