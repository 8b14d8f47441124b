"""What every command shares: the consoles, the option types, and how a failure reaches
the user (one line with its message, never a traceback)."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from orchard.errors import ConfigError, OrchardError

if TYPE_CHECKING:
    from orchard.config import ServerConfig
    from orchard.ops import ControlClient

console = Console(stderr=True)  # progress, notes and errors
out = Console()  # results a script may read

Insecure = Annotated[bool, typer.Option("--insecure", help="Loopback development: no TLS, open enrollment, no admin token.")]
CaCert = Annotated[Path | None, typer.Option("--ca-cert", help="CA certificate that signed the server's (TLS).")]
Token = Annotated[str | None, typer.Option("--token", envvar="ORCHARD_TOKEN", help="Enrollment token.")]
AdminToken = Annotated[str | None, typer.Option("--admin-token", help="Admin token (or ORCHARD_ADMIN_TOKEN).")]
DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="The root's data dir: admin token and CA are read from it.")]
ServerCfgOpt = Annotated[Path | None, typer.Option("--config", help="TOML with a \\[server] table (ServerConfig).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v")]

F = TypeVar("F", bound=Callable[..., Any])


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# Exit codes. A command exits 0 only when it did what it was asked (docs/operating.md,
# "Exit codes"); otherwise one line says why.
EXIT_FAILED = 1  # tried and it did not happen: a server refused, a run failed, nothing to stop
EXIT_INPUT = 2  # the command's own input (flags, a config, a task, a file) was refused; click's usage errors too
EXIT_INTERRUPTED = 130


def fail(err: Exception | str, code: int = EXIT_INPUT) -> NoReturn:
    """Print ``err`` as one ``error:`` line and exit with ``code``."""
    console.print("[bold red]error:[/]", escape(str(err)), soft_wrap=True)
    raise typer.Exit(code)


def stop_on_signal() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until_signal(handle: Any) -> None:
    await stop_on_signal().wait()
    await handle.stop(grace=2.0)


def serve_tier(config: Path | None, verbose: bool, start: Callable[[ServerConfig], Awaitable[Any]],
               announce: Callable[[Any], None]) -> None:
    """Run a server tier (the root or an aggregator) until a signal: owner-only files, the
    ``[server]`` config read (and a refusal said on the terminal) before the log moves,
    failed TLS handshakes aggregated, then ``start(config)``, ``announce(handle)`` and serve."""
    from orchard.files import restrict_umask
    from orchard.server.corelog import HandshakeLog
    from orchard.server.process import tune_server_process

    restrict_umask()  # whatever it writes is owner-only (orchard.files)
    scfg = server_config(config)
    handshakes = HandshakeLog().install()  # failed TLS handshakes: one line a minute, not one each
    setup_logging(verbose)

    async def main() -> None:
        h = await start(scfg)
        tune_server_process()
        announce(h)
        await serve_until_signal(h)

    try:
        asyncio.run(main())
    finally:
        handshakes.close()


def server_config(path: Path | None) -> ServerConfig:
    """The ``[server]`` table of ``path`` (defaults without one); a missing or malformed
    file is reported as the user's error."""
    from pydantic import ValidationError

    from orchard.config import ServerConfig, load_toml

    if path is None:
        return ServerConfig()
    try:
        return ServerConfig.model_validate(load_toml(path).get("server", {}))
    except ValidationError as err:
        fail(ConfigError([f"{path}: server.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]))


def control(server: str, admin_token: str | None, ca_cert: Path | None, insecure: bool,
            data_dir: Path | None) -> ControlClient:
    from orchard.runs import control_client

    return control_client(server, admin_token=admin_token, ca_cert=ca_cert, insecure=insecure, data_dir=data_dir)


def refusal(err: BaseException) -> tuple[str, int] | None:
    """What the user is told about ``err`` and the exit code, or None for an error that is
    a bug (its traceback is the report). A gRPC status is the server's refusal, given as
    its code and the server's own message; Orchard's named errors carry their own."""
    grpc = sys.modules.get("grpc")  # never imported: nothing raised can be a gRPC status
    if grpc is not None and isinstance(err, grpc.RpcError) and callable(getattr(err, "code", None)):
        code = err.code()
        details = err.details() if callable(getattr(err, "details", None)) else None
        name = getattr(code, "name", str(code))
        return (f"{name}: {details}" if details else name), EXIT_FAILED
    if isinstance(err, ConfigError):
        return str(err), EXIT_INPUT
    if isinstance(err, OrchardError):
        return str(err), EXIT_FAILED
    if isinstance(err, OSError):  # e.g. an unreadable --ca-cert
        return (f"{err.strerror or err}: {err.filename}" if err.filename else str(err)), EXIT_INPUT
    if isinstance(err, BaseExceptionGroup):  # tasks of one TaskGroup: every refusal, or it is a bug
        told = [refusal(e) for e in err.exceptions]
        if all(t is not None for t in told):
            return "; ".join(t[0] for t in told if t), max(t[1] for t in told if t)
    return None


def guarded(fn: F) -> F:
    """Run a command so that a failure reaches the user as one line and an exit code:
    a server's refusal (a gRPC status with its details), Orchard's named errors and the
    file system's, raised anywhere below the command (in its event loop, its threads'
    results, a library call), and an interrupt. ``app.build_app`` wraps every command in
    it, so no command handles these itself."""
    if getattr(fn, "__orchard_guarded__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        try:
            return fn(*a, **k)
        except KeyboardInterrupt:
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as err:  # noqa: BLE001 - sorted by refusal(); a bug is re-raised
            told = refusal(err)
            if told is None:
                raise
            fail(told[0], told[1])

    wrapper.__orchard_guarded__ = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
