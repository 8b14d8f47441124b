"""The client link's retry loop: it rejoins when the server says the node must Join, and
only then, and gives up instead of looping when the server forgets it after every join."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orchard.errors import JOIN_FIRST, UnknownNodeError
from orchard.link import MAX_REJOINS, FleetLink, LinkConfig
from orchard.typing import Role


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


async def _run(errors: list[grpc.aio.AioRpcError]) -> tuple[object, int, int]:
    """Call through ``_retry`` with ``fn`` raising ``errors`` in turn, then succeeding;
    returns the outcome (the result or the exception), the calls and the joins."""
    link = FleetLink(LinkConfig(target="127.0.0.1:1", role=Role.CLIENT, insecure=True, node_id="c0"))
    calls = joins = 0

    async def join(device: object = None) -> str:
        nonlocal joins
        joins += 1
        link.joined = True
        return "c0"

    link.join = join  # type: ignore[method-assign]

    async def fn() -> str:
        nonlocal calls
        calls += 1
        if errors:
            raise errors.pop(0)
        return "ok"

    try:
        out: object = await link._retry("poll", fn)
    except Exception as err:  # noqa: BLE001 - the outcome under test
        out = err
    finally:
        await link.close()
    return out, calls, joins


def test_a_forgotten_node_rejoins_and_the_call_goes_on() -> None:
    forgot = _error(grpc.StatusCode.NOT_FOUND, f"node 'c0' has not joined this server (or expired); {JOIN_FIRST}")
    out, calls, joins = asyncio.run(_run([forgot, forgot]))
    assert out == "ok" and calls == 3 and joins == 2


def test_a_server_that_forgets_after_every_join_is_given_up_on() -> None:
    forgot = _error(grpc.StatusCode.NOT_FOUND, f"node 'c0' has not joined this server (or expired); {JOIN_FIRST}")
    out, calls, joins = asyncio.run(_run([forgot] * (MAX_REJOINS + 5)))
    assert isinstance(out, UnknownNodeError) and "node_timeout_s" in str(out)
    assert joins == MAX_REJOINS and calls == MAX_REJOINS + 1


@pytest.mark.parametrize("details", [
    "unknown run 'r9'",  # UnknownRunError: another NOT_FOUND
    "model version 4 is not held; Join the next round",  # names Join, but is not the rejoin request
    "node id 'c0' is registered with another token; pick another id",
])
def test_other_not_found_errors_do_not_rejoin(details: str) -> None:
    out, calls, joins = asyncio.run(_run([_error(grpc.StatusCode.NOT_FOUND, details)]))
    assert isinstance(out, grpc.aio.AioRpcError) and out.code() == grpc.StatusCode.NOT_FOUND
    assert calls == 1 and joins == 0
