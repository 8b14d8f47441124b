"""Which of gRPC core's log lines are failed TLS handshakes, and why they failed."""

from __future__ import annotations

from orchard.server.corelog import handshake_reason

PREFIX = b"I1128 17:03:01.946923   11194 ssl_transport_security.cc:2563] "


def test_handshake_lines_and_their_reasons() -> None:
    ssl_line = PREFIX + (b"Handshake failed with error SSL_ERROR_SSL: error:100000b8:SSL routines:"
                         b"OPENSSL_internal:NO_SHARED_CIPHER: Invalid certificate verification context")
    assert handshake_reason(ssl_line) == "NO_SHARED_CIPHER"
    assert handshake_reason(PREFIX + b"Handshake failed with error SSL_ERROR_SYSCALL") == "SSL_ERROR_SYSCALL"
    assert handshake_reason(b"E1128 17:03:01.9 1 security_handshaker.cc:12] Security handshake failed: x") == \
        "unknown"


def test_other_lines_pass() -> None:
    assert handshake_reason(PREFIX + b"Some other event") is None
    # A Python log line that mentions a failed handshake is not gRPC core's.
    assert handshake_reason(b"2026-11-28 17:00:00,000 WARNING x: Handshake failed with error Y") is None
    assert handshake_reason(b"") is None
