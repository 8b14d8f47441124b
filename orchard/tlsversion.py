"""TLS 1.3 only, for every gRPC connection an Orchard process serves or dials.

gRPC Python has no setting for the lowest TLS version a server accepts (``grpc.
ssl_server_credentials`` takes none, up to grpcio 1.85 at least). Its TLS library,
BoringSSL, negotiates TLS 1.3 with a fixed set of cipher suites that no setting changes,
and TLS 1.2 with the suites named in the ``GRPC_SSL_CIPHER_SUITES`` environment variable,
which gRPC reads once, when it is imported. Orchard names one suite there that no
handshake can use: ``ECDHE-PSK-CHACHA20-POLY1305`` needs a pre-shared key, and gRPC never
installs one, so BoringSSL drops it. A TLS 1.2 ClientHello then finds no suite in common
and the handshake fails (``NO_SHARED_CIPHER``), whatever suites the client offers; TLS 1.3
is untouched. The channels such a process dials offer TLS 1.3 only, for the same reason.

This must happen before anything imports grpc: ``orchard/__init__`` calls ``pin()``, so
it holds in every process that imports orchard before grpc, every ``orchard`` command
among them. ``held()`` says whether it holds here; ``server_credentials`` warns when it
does not (grpc imported first, or ``GRPC_SSL_CIPHER_SUITES`` set by the operator, which
is left as it is).

The environment is inherited: processes this one starts get the same variable.
"""

from __future__ import annotations

import os
import sys

ENV = "GRPC_SSL_CIPHER_SUITES"
NO_TLS12_SUITE = "ECDHE-PSK-CHACHA20-POLY1305"

_held = False
_why_not = "orchard.tlsversion.pin() was never called"


def pin() -> None:
    """Leave TLS 1.2 no usable suite in gRPC (see the module's docstring); call before
    grpc is imported."""
    global _held, _why_not
    current = os.environ.get(ENV)
    if current not in (None, NO_TLS12_SUITE):
        _held, _why_not = False, f"{ENV} is set to {current!r} in the environment"
        return
    if "grpc" in sys.modules and current is None:
        _held, _why_not = False, "grpc was imported before orchard"
        return
    os.environ[ENV] = NO_TLS12_SUITE
    _held = True


def held() -> bool:
    """Whether gRPC in this process negotiates TLS 1.3 only."""
    return _held


def why_not() -> str:
    """Why ``held()`` is false (meaningless when it is true)."""
    return _why_not
