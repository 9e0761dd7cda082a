"""RunControl over gRPC: requests to the RunControl component, its state to protos. Errors map at the
interceptor (unary calls); WatchRun is a stream of the run's progress lines."""

from __future__ import annotations

from rlfleet.api.controller.v1 import controller_pb2, controller_pb2_grpc
from rlfleet.controller.run_control import STOPPED_BY_REQUEST, RunControl


class RunControlServicer(controller_pb2_grpc.RunControlServicer):
    def __init__(self, control: RunControl) -> None:
        self.control = control

    async def StartRun(self, request: controller_pb2.StartRunRequest, context) -> controller_pb2.RunInfo:
        config = self.control.parse_config(request.config_json)
        await self.control.start(config, resume=request.resume, fresh=request.fresh)
        return self.control.info()

    async def GetRun(self, request: controller_pb2.GetRunRequest, context) -> controller_pb2.RunInfo:
        return self.control.info()

    async def StopRun(self, request: controller_pb2.StopRunRequest, context) -> controller_pb2.RunInfo:
        self.control.request_stop(request.reason or STOPPED_BY_REQUEST)
        return self.control.info()

    async def WatchRun(self, request: controller_pb2.WatchRunRequest, context):
        import grpc

        if self.control.run is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no run has been started here")
        progress = self.control.progress
        async for number, line in progress.follow(request.from_line):
            yield controller_pb2.RunEvent(line_number=number, line=line)
        yield controller_pb2.RunEvent(line_number=progress.count, ended=True, run=self.control.info())
