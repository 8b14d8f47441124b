"""What every command shares: the consoles, the option types, and how a failure reaches
the user (one line with its message, never a traceback)."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from orchard.errors import OrchardError

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


def fail(err: Exception) -> NoReturn:
    console.print(f"[bold red]error:[/] {err}", soft_wrap=True)
    raise typer.Exit(2)


def run_async(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except OrchardError as err:
        fail(err)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


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


def server_config(path: Path | None) -> ServerConfig:
    """The ``[server]`` table of ``path`` (defaults without one); a missing or malformed
    file is reported as the user's error."""
    from orchard.config import ServerConfig, load_toml

    try:
        return ServerConfig.model_validate(load_toml(path).get("server", {})) if path else ServerConfig()
    except OrchardError as err:
        fail(err)


def control(server: str, admin_token: str | None, ca_cert: Path | None, insecure: bool,
            data_dir: Path | None) -> ControlClient:
    from orchard.runs import control_client

    return control_client(server, admin_token=admin_token, ca_cert=ca_cert, insecure=insecure, data_dir=data_dir)


def grpc_guard(fn: F) -> F:
    """A command that talks to a root: the server's errors (a gRPC status with its
    details), Orchard's and the file system's reach the user as their message."""
    import grpc

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        try:
            return fn(*a, **k)
        except grpc.RpcError as err:
            console.print(f"[bold red]error:[/] {err.code().name}: {err.details()}",  # type: ignore[attr-defined]
                          soft_wrap=True)
            raise typer.Exit(1) from None
        except OrchardError as err:
            fail(err)
        except OSError as err:  # e.g. an unreadable --ca-cert
            fail(OrchardError(f"{err.strerror or err}: {err.filename}" if err.filename else str(err)))

    return wrapper  # type: ignore[return-value]
