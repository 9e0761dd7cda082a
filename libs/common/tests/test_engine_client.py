"""EngineClient against the real CPU engine process (SGLang HTTP API)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from rlfleet.common.engine_client import (
    EngineClient,
    EngineError,
    EngineRejected,
    EngineTimeouts,
    EngineUnavailable,
    GenerateResult,
    VersionRange,
)
from rlfleet.common.processes import eventually

testing = pytest.importorskip("rlfleet.engine.testing", reason="needs the rlfleet-cpu-engine package")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("client-models")
    return testing.build_tiny_model(root / "v1", seed=1), testing.build_tiny_model(root / "v2", seed=2)


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    process = testing.EngineProcess(models[0], tmp_path_factory.mktemp("client-engine")).start()
    yield process
    process.stop()


@pytest.fixture
async def client(engine):
    async with EngineClient(engine.url) as client:
        yield client
        await client.resume()  # never leave the shared engine paused


async def test_generate_returns_tokens_logprobs_finish_reason_and_version(client):
    result = await client.generate(
        [1, 5, 6, 7], {"max_new_tokens": 10, "sampling_seed": 4, "ignore_eos": True}, rid="c1"
    )
    assert isinstance(result, GenerateResult)
    assert result.rid == "c1" and len(result.output_ids) == 10 and len(result.output_logprobs) == 10
    assert result.finish_reason == "length" and result.matched is None
    assert result.weight_version == "default" and result.weight_versions == [VersionRange("default", 0, 10)]
    assert result.prompt_tokens == 4 and result.cached_tokens == 0 and result.latency > 0
    again = await client.generate(
        [1, 5, 6, 7], {"max_new_tokens": 10, "sampling_seed": 4, "ignore_eos": True}
    )
    assert again.output_ids == result.output_ids and again.output_logprobs == result.output_logprobs


async def test_a_stop_token_is_reported_as_matched(client):
    free = await client.generate([1, 5, 6, 7], {"max_new_tokens": 8, "sampling_seed": 4, "ignore_eos": True})
    stop = free.output_ids[2]
    result = await client.generate(
        [1, 5, 6, 7], {"max_new_tokens": 8, "sampling_seed": 4, "stop_token_ids": [stop]}
    )
    assert result.finish_reason == "stop" and result.matched == stop and result.output_ids[-1] == stop


async def test_a_batch_returns_one_result_per_prompt(client):
    results = await client.generate_batch([[1, 5], [1, 6, 7]], {"max_new_tokens": 3, "ignore_eos": True})
    assert [r.prompt_tokens for r in results] == [2, 3] and all(len(r.output_ids) == 3 for r in results)


async def test_bad_input_raises_engine_rejected_with_the_engines_message(client):
    with pytest.raises(EngineRejected) as error:
        await client.generate([1, 10**6], {"max_new_tokens": 2})
    assert error.value.status == 400 and "outside the vocabulary" in error.value.message
    assert isinstance(error.value, EngineError)


async def test_an_unreachable_engine_raises_engine_unavailable_and_is_unhealthy():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        async with EngineClient(
            f"http://127.0.0.1:{port}", timeouts=EngineTimeouts(connect_s=1, control_s=2)
        ) as client:
            with pytest.raises(EngineUnavailable):
                await client.model_info()
            assert not await client.health()


async def test_health_info_and_load(client, engine):
    assert await client.health() and await client.health(generate=True)
    info = await client.model_info()
    assert info["model_path"] == str(engine.model_path)
    load = await client.load()
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0


async def test_pause_in_place_blocks_flush_until_resume_and_abort_ends_the_request(client):
    long = {"max_new_tokens": 900, "ignore_eos": True, "sampling_seed": 1}
    task = asyncio.create_task(client.generate([1, 40], long, rid="long"))

    async def running():
        return (await client.load())["num_running_reqs"] == 1

    await eventually(running)
    await client.pause("in_place")
    with pytest.raises(EngineRejected, match="hold KV"):
        await client.flush_cache()
    await client.abort("long")
    result = await task
    assert result.finish_reason == "abort" and 0 < len(result.output_ids) < 900
    await client.flush_cache()  # nothing holds KV any more
    await client.resume()


async def test_weight_updates_from_disk_and_version_bumps(client, models):
    v1, v2 = models
    try:
        message = await client.update_weights_from_disk(str(v2), weight_version="v2")
        assert "Succeeded" in message
        assert await client.weight_version() == "v2"
        result = await client.generate([1, 2, 3], {"max_new_tokens": 2})
        assert result.weight_version == "v2"
        with pytest.raises(EngineRejected, match=r"no \*\.safetensors"):
            await client.update_weights_from_disk(str(v1 / "missing"), weight_version="v3")
        assert await client.weight_version() == "v2"
        await client.update_weight_version("v2.1")
        assert await client.weight_version() == "v2.1"
    finally:
        await client.update_weights_from_disk(str(v1), weight_version="default")


async def test_distributed_update_through_the_client(client, models, monkeypatch):
    from rlfleet.engine.model_runner import read_checkpoint
    from rlfleet.weights import broadcast as distributed

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    joining = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="g",
                                                                      backend="gloo"))
    group = await asyncio.to_thread(distributed.join_group, "127.0.0.1", port, 0, 2, "g", "gloo", 60.0)
    try:
        await joining
        named = read_checkpoint(models[1])
        spec = distributed.update_request(named)
        updating = asyncio.create_task(
            client.update_weights_from_distributed(
                spec["names"], spec["dtypes"], spec["shapes"], group_name="g", weight_version="d2"
            )
        )
        await asyncio.to_thread(distributed.send, group, [t for _, t in named])
        assert "Succeeded" in await updating
        assert await client.weight_version() == "d2"
        await client.destroy_weights_update_group("g")
    finally:
        distributed.leave_group(group)
        await client.update_weights_from_disk(str(models[0]), weight_version="default")


async def test_api_keys_go_as_bearer_tokens_the_admin_key_on_admin_routes(models, tmp_path):
    """The CPU engine checks keys as SGLang's --api-key / --admin-api-key do."""
    process = testing.EngineProcess(models[0], tmp_path, api_key="user-key",
                                    admin_api_key="admin-key").start()
    try:
        async with EngineClient(process.url) as anonymous:
            assert await anonymous.health()  # health routes are always open
            with pytest.raises(EngineRejected) as refused:
                await anonymous.generate([1, 2], {"max_new_tokens": 1})
            assert refused.value.status == 401
        async with EngineClient(process.url, api_key="user-key") as user:
            assert len((await user.generate([1, 2],
                                            {"max_new_tokens": 2, "ignore_eos": True})).output_ids) == 2
            assert (await user.load())["num_running_reqs"] == 0
            with pytest.raises(EngineRejected):  # an admin route wants the admin key
                await user.pause("abort")
        async with EngineClient(process.url, api_key="user-key", admin_api_key="admin-key") as admin:
            await admin.pause("abort")
            await admin.resume()
            assert await admin.weight_version() == "default"
    finally:
        process.stop()
