"""One tiny-model engine process for the gateway's tests (registered under several engine ids when a
test needs more than one engine), and an in-process gateway per test on real Redis."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from rlfleet.api.gateway.v1 import gateway_pb2_grpc
from rlfleet.common.config import MetricsConfig, RedisConfig
from rlfleet.common.grpc_server import GrpcServer, channel
from rlfleet.common.testing import unique_run_id, without_login
from rlfleet.engine.testing import EngineProcess, tiny_model
from rlfleet.gateway.app import RolloutGatewayApp, build
from rlfleet.gateway.config import EngineSpec, RolloutGatewayConfig


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp() / "models")


@pytest.fixture(scope="session")
def engine_url(model_dir, tmp_path_factory):
    process = EngineProcess(model_dir, tmp_path_factory.mktemp("gateway-engine"), weight_version="3").start()
    yield process.url
    process.stop()


@dataclass
class Gateway:
    stub: gateway_pb2_grpc.GatewayServiceStub
    app: RolloutGatewayApp
    redis: aioredis.Redis
    run_id: str
    address: str


GATEWAY_LOGIN: dict[str, str] = {}  # the gateway's own Redis user: its tests run with its key patterns


@pytest.fixture(scope="session", autouse=True)
def _gateway_login(infra_secrets):
    GATEWAY_LOGIN.update(infra_secrets.redis["rollout-gateway"].redis())


@contextlib.asynccontextmanager
async def running_gateway(redis_url: str, engines: dict[str, str], run_id: str | None = None, **overrides):
    redis = RedisConfig(url=without_login(redis_url), **GATEWAY_LOGIN)
    config = RolloutGatewayConfig(
        run_id=run_id or unique_run_id("gw"), redis=redis, metrics=MetricsConfig(enabled=False),
        engines=[EngineSpec(engine_id=e, url=url) for e, url in engines.items()], **overrides)
    app = build(config)
    server = GrpcServer(config.grpc)
    await app.start(server)
    port = await server.start()
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            yield Gateway(gateway_pb2_grpc.GatewayServiceStub(ch), app, app.redis, config.run_id,
                          f"127.0.0.1:{port}")
    finally:
        await server.stop()
        await app.stop()
