"""Operator side of the Control API (synchronous; used by the CLI, the demo and tests)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from orchard import wire
from orchard.config import RunConfig
from orchard.errors import AuthError, IntegrityError
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg


def resolve_admin_token(token: str | None, data_dir: str | Path | None) -> str | None:
    if token:
        return token
    env = os.environ.get("ORCHARD_ADMIN_TOKEN")
    if env:
        return env
    if data_dir is not None:
        p = Path(data_dir) / "admin.token"
        if p.is_file():
            return p.read_text().strip()
    return None


class ControlClient:
    def __init__(self, target: str, *, admin_token: str | None = None, ca_cert: str | Path | None = None,
                 insecure: bool = False) -> None:
        if insecure:
            self._ch = grpc.insecure_channel(target, options=wire.GRPC_OPTIONS)
        else:
            if ca_cert is None:
                raise AuthError("TLS needs the CA certificate: pass --ca-cert (DATA_DIR/tls/ca.pem on the root), "
                                "or --insecure for a loopback development server")
            creds = grpc.ssl_channel_credentials(root_certificates=Path(ca_cert).read_bytes())
            self._ch = grpc.secure_channel(target, creds, options=wire.GRPC_OPTIONS)
        self._stub = pbg.ControlStub(self._ch)
        self._meta = (("authorization", f"Bearer {admin_token}"),) if admin_token else ()

    def close(self) -> None:
        self._ch.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_run(self, cfg: RunConfig, initial_blob: bytes, chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES) -> str:
        def parts() -> Iterator[pb.StartRunPart]:
            yield pb.StartRunPart(header=pb.StartRunHeader(config_json=cfg.model_dump_json(),
                                                           model_bytes=len(initial_blob),
                                                           model_sha256=wire.sha256_hex(initial_blob)))
            for _, d in wire.iter_chunks(initial_blob, chunk_bytes):
                yield pb.StartRunPart(data=d)

        return self._stub.StartRun(parts(), metadata=self._meta, timeout=120).run_id

    def status(self, run_id: str = "") -> dict[str, Any]:
        return json.loads(self._stub.Status(pb.StatusRequest(run_id=run_id), metadata=self._meta,
                                            timeout=30).status_json)

    def nodes(self) -> list[dict[str, Any]]:
        return json.loads(self._stub.ListNodes(pb.ListNodesRequest(), metadata=self._meta, timeout=30).nodes_json)

    def stop(self, run_id: str = "") -> bool:
        return self._stub.StopRun(pb.StopRunRequest(run_id=run_id), metadata=self._meta, timeout=30).stopped

    def pull_global(self, run_id: str = "", rnd: int = -1) -> bytes:
        parts, h = [], ""
        for ch in self._stub.PullGlobal(pb.PullGlobalRequest(run_id=run_id, round=rnd), metadata=self._meta,
                                        timeout=300):
            parts.append(ch.data)
            h = ch.blob_sha256
        blob = b"".join(parts)
        if h and wire.sha256_hex(blob) != h:
            raise IntegrityError("downloaded global model does not match its sha256")
        return blob

    def list_runs(self, limit: int = 0) -> list[dict[str, Any]]:
        return json.loads(self._stub.ListRuns(pb.ListRunsRequest(limit=limit), metadata=self._meta,
                                              timeout=30).runs_json)

    def run_log(self, run_id: str = "", after: int = 0) -> tuple[list[dict[str, Any]], int, str]:
        """(log records from byte offset ``after``, the offset to continue from, the run's status)."""
        r = self._stub.RunLog(pb.RunLogRequest(run_id=run_id, after=after), metadata=self._meta, timeout=30)
        return [json.loads(line) for line in r.lines], int(r.next), r.run_status
