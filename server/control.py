"""Control API for operators (start a run, status, nodes, stop, download a global model).

Every call needs the admin token (except on an ``--insecure`` loopback server).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc

from orchard import wire
from orchard.config import RunConfig
from orchard.errors import AuthError, ConfigError, UnknownRunError, UpdateSchemaError
from orchard.server import observe
from orchard.server.auth import Authenticator, bearer_token
from orchard.server.root import RootRunner
from orchard.server.runlog import RunLog
from orchard.server.servicer import mapped, mapped_stream
from orchard.server.validation import validate_run_config
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

MAX_INITIAL_MODEL_BYTES = 8 << 30


class ControlServicer(pbg.ControlServicer):
    def __init__(self, runner: RootRunner, auth: Authenticator, runlog: RunLog | None = None) -> None:
        self.runner = runner
        self.auth = auth
        self.runlog = runlog or RunLog(runner.data_dir)

    def _admin(self, context: grpc.aio.ServicerContext) -> None:
        if not self.auth.admin_ok(bearer_token(context.invocation_metadata())):
            raise AuthError("the control API needs the admin token (the root keeps it in DATA_DIR/admin.token, "
                            "owner-only); pass --admin-token or set ORCHARD_ADMIN_TOKEN")

    @mapped
    async def StartRun(self, request_iterator: AsyncIterator[pb.StartRunPart],
                       context: grpc.aio.ServicerContext) -> pb.StartRunReply:
        self._admin(context)
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("part") != "header":
            raise UpdateSchemaError("StartRun must begin with its header (config and model size)")
        h = first.header
        try:
            cfg = RunConfig.model_validate_json(h.config_json)
        except ValueError as err:
            raise ConfigError(f"run config is not valid: {err}") from None
        validate_run_config(cfg)
        asm = wire.ChunkAssembler(h.model_bytes, h.model_sha256, MAX_INITIAL_MODEL_BYTES)
        async for part in request_iterator:
            if part.WhichOneof("part") != "data":
                raise UpdateSchemaError("only data parts may follow the StartRun header")
            asm.add(part.data)
        run_id = await self.runner.start_run(cfg, asm.finish())
        return pb.StartRunReply(run_id=run_id)

    @mapped
    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        self._admin(context)
        return pb.StatusReply(status_json=json.dumps(observe.status(self.runner, request.run_id)))

    @mapped
    async def ListNodes(self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext) -> pb.ListNodesReply:
        self._admin(context)
        coord = self.runner.coord
        nodes = []
        for c in coord.children.values():
            nodes.append({"node_id": c.node_id, "role": c.role.value, "live": coord.live(c),
                          "pool_size": c.pool_size, "pool_eligible": c.pool_eligible,
                          "device": {k: v for k, v in vars(c.device).items() if v not in (None, {})}})
        return pb.ListNodesReply(nodes_json=json.dumps(nodes))

    @mapped
    async def StopRun(self, request: pb.StopRunRequest, context: grpc.aio.ServicerContext) -> pb.StopRunReply:
        self._admin(context)
        return pb.StopRunReply(stopped=self.runner.stop_run(request.run_id))

    @mapped_stream
    async def PullGlobal(self, request: pb.PullGlobalRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Chunk]:
        self._admin(context)
        blob = self.runner.global_blob(request.run_id, request.round)
        h = wire.sha256_hex(blob)
        for off, data in wire.iter_chunks(blob, self.runner.server_cfg.chunk_bytes):
            yield pb.Chunk(data=data, offset=off, total_bytes=len(blob), blob_sha256=h)

    @mapped
    async def ListRuns(self, request: pb.ListRunsRequest, context: grpc.aio.ServicerContext) -> pb.ListRunsReply:
        self._admin(context)
        runs = []
        for row in self.runner.store.list_runs(max(0, request.limit)):
            cfg = json.loads(row.config_json)
            runs.append({"run_id": row.run_id, "status": row.status, "task": cfg.get("task"),
                         "completed_rounds": row.completed_rounds, "target_rounds": cfg.get("rounds"),
                         "created": row.created, "updated": row.updated, "error": row.error, "config": cfg})
        return pb.ListRunsReply(runs_json=json.dumps(runs))

    @mapped
    async def RunLog(self, request: pb.RunLogRequest, context: grpc.aio.ServicerContext) -> pb.RunLogReply:
        self._admin(context)
        row = self.runner.store.get_run(request.run_id) if request.run_id else self.runner.store.latest_run()
        if row is None:
            raise UnknownRunError(f"no run {request.run_id!r} on this server; `orchard run list` shows its runs"
                                  if request.run_id else "this server has no run yet")
        max_bytes = request.max_lines * 512 if request.max_lines > 0 else 256 << 10
        lines, nxt = self.runlog.read(row.run_id, request.after, max_bytes)
        return pb.RunLogReply(lines=lines, next=nxt, run_status=row.status)
