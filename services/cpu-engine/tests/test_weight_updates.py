"""Weight updates into a running engine process: from disk, and by torch.distributed broadcast over gloo
with the test process as the sender (rank 0)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlfleet.common.processes import free_port
from rlfleet.engine.model_runner import ModelRunner, read_checkpoint
from rlfleet.engine.testing import EngineProcess
from rlfleet.engine.testing import generate_in_process as in_process
from rlfleet.engine.testing import http_call as call
from rlfleet.weights import broadcast as distributed

STAGING_ROUTE = "/rlfleet/update_weights_from_staging"

pytestmark = pytest.mark.integration

PROMPT = [1, 11, 12, 13]
# Seeded sampling rather than greedy: a random tied-embedding model greedily repeats its last input
# token whatever its weights, sampled tokens do show the new weights.
SAMPLED = {"max_new_tokens": 16, "sampling_seed": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def weights_engine(model_dir, tmp_path_factory):
    process = EngineProcess(model_dir, tmp_path_factory.mktemp("weights-engine"), weight_version="v1").start()
    yield process
    process.stop()


@pytest.fixture
def restore_v1(weights_engine, model_dir):
    yield
    asyncio.run(
        call(
            weights_engine.url,
            "/update_weights_from_disk",
            {"model_path": str(model_dir), "weight_version": "v1"},
        )
    )


async def engine_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    weights = {}
    for name in names:
        status, values = await call(url, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20})
        assert status == 200, values
        weights[name] = torch.tensor(values, dtype=torch.float32)
    return weights


async def test_update_weights_from_disk_changes_outputs_and_the_reported_weight_version(
    weights_engine, model_dir_v2, restore_v1
):
    url = weights_engine.url
    _, before = await call(
        url, "/generate", {"input_ids": PROMPT, "sampling_params": SAMPLED, "return_logprob": True}
    )
    assert before["meta_info"]["weight_version"] == "v1"
    status, reply = await call(
        url,
        "/update_weights_from_disk",
        {"model_path": str(model_dir_v2), "weight_version": "v2", "flush_cache": True},
    )
    assert status == 200 and reply["success"], reply
    assert (await call(url, "/model_info", method="GET"))[1]["weight_version"] == "v2"
    _, after = await call(
        url, "/generate", {"input_ids": PROMPT, "sampling_params": SAMPLED, "return_logprob": True}
    )
    assert after["meta_info"]["weight_version"] == "v2"
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    assert after["output_ids"] == in_process(ModelRunner(model_dir_v2), PROMPT, **SAMPLED).output_ids


async def test_a_weight_update_empties_the_prefix_cache(weights_engine, model_dir_v2, restore_v1):
    url = weights_engine.url
    body = {"input_ids": list(range(200, 240)), "sampling_params": SAMPLED}
    await call(url, "/generate", body)
    assert (await call(url, "/generate", body))[1]["meta_info"]["cached_tokens"] == 39
    status, reply = await call(url, "/update_weights_from_disk", {"model_path": str(model_dir_v2)})
    assert status == 200 and reply["success"], reply
    assert (await call(url, "/generate", body))[1]["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("load_format", ["rlfleet_delta", "rlfleet_full", "not-a-format"])
async def test_a_load_format_sglang_does_not_have_is_refused_and_nothing_changes(
    weights_engine, model_dir_v2, load_format
):
    """SGLang raises on a value outside its LoadFormat enum; the stand-in must never accept one."""
    url = weights_engine.url
    status, reply = await call(url, "/update_weights_from_disk", {
        "model_path": str(model_dir_v2), "load_format": load_format, "weight_version": "v9"})
    assert status == 400 and not reply["success"] and repr(load_format) in reply["message"]
    assert (await call(url, "/model_info", method="GET"))[1]["weight_version"] == "v1"


async def test_a_failed_update_from_disk_leaves_weights_and_version_unchanged(weights_engine, tmp_path):
    url = weights_engine.url
    _, before = await call(
        url, "/generate", {"input_ids": PROMPT, "sampling_params": SAMPLED, "return_logprob": True}
    )
    status, reply = await call(
        url, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing"), "weight_version": "v9"}
    )
    assert status == 400 and not reply["success"] and "no *.safetensors" in reply["message"]
    assert (await call(url, "/model_info", method="GET"))[1]["weight_version"] == "v1"
    _, after = await call(
        url, "/generate", {"input_ids": PROMPT, "sampling_params": SAMPLED, "return_logprob": True}
    )
    assert after["output_ids"] == before["output_ids"]


async def test_distributed_update_over_gloo_gives_bit_identical_weights(
    weights_engine, model_dir_v2, monkeypatch, restore_v1
):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    url, port = weights_engine.url, free_port()
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "rl",
        "backend": "gloo",
    }
    # Both sides block in the rendezvous until the other arrives, as with SGLang.
    engine_side = asyncio.create_task(call(url, "/init_weights_update_group", init))
    group = await asyncio.to_thread(distributed.join_group, "127.0.0.1", port, 0, 2, "rl", "gloo", 60.0)
    try:
        status, reply = await engine_side
        assert status == 200 and reply["success"], reply
        named = read_checkpoint(model_dir_v2)
        body = distributed.update_request(named, group_name="rl", weight_version="v2-dist", flush_cache=True)
        engine_side = asyncio.create_task(call(url, "/update_weights_from_distributed", body))
        await asyncio.to_thread(distributed.send, group, [tensor for _, tensor in named])
        status, reply = await engine_side
        assert status == 200 and reply["success"], reply
        received = await engine_weights(url, [name for name, _ in named])
        for name, tensor in named:
            assert torch.equal(received[name], tensor), name
        assert (await call(url, "/model_info", method="GET"))[1]["weight_version"] == "v2-dist"
        _, out = await call(
            url, "/generate", {"input_ids": PROMPT, "sampling_params": SAMPLED, "return_logprob": True}
        )
        assert out["meta_info"]["weight_version"] == "v2-dist"
        status, reply = await call(url, "/destroy_weights_update_group", {"group_name": "rl"})
        assert status == 200 and reply["success"]
    finally:
        distributed.leave_group(group)


async def test_a_staged_broadcast_is_served_only_after_the_flip_and_a_corrupted_one_is_refused(
    weights_engine, model_dir_v2, monkeypatch, restore_v1
):
    """`staged=1`: the engine receives and hashes while it keeps serving v1; the flip
    (`/rlfleet/update_weights_from_staging`, source distributed) checks the trainer's checksums and is
    a pointer swap; a broadcast that arrived corrupted is refused there and nothing changes."""
    from rlfleet.weights.sent import tensor_checksums

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    url = weights_engine.url
    named = read_checkpoint(model_dir_v2)
    sums = tensor_checksums(named)
    flip = {"source": "distributed", "checksums": sums, "checksum_algorithm": "sha256",
            "pause_mode": "retract"}

    async def broadcast(tensors, version: str) -> dict:
        port = free_port()
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": "st", "backend": "gloo"}
        engine_side = asyncio.create_task(call(url, "/init_weights_update_group", init))
        group = await asyncio.to_thread(distributed.join_group, "127.0.0.1", port, 0, 2, "st", "gloo", 60.0)
        try:
            assert (await engine_side)[1]["success"]
            body = distributed.update_request(named, group_name="st", weight_version=version,
                                              flush_cache=True)
            engine_side = asyncio.create_task(call(url, "/update_weights_from_distributed?staged=1", body))
            await asyncio.to_thread(distributed.send, group, tensors)
            status, reply = await engine_side
            assert status == 200 and reply["success"] and reply["staged"], reply
            await call(url, "/destroy_weights_update_group", {"group_name": "st"})
            return reply
        finally:
            distributed.leave_group(group)

    status, reply = await call(url, STAGING_ROUTE, flip)
    assert status == 400 and "nothing is staged" in reply["message"], reply

    corrupted = [t.clone() for _, t in named]
    corrupted[0].view(-1)[0] += 1
    reply = await broadcast(corrupted, "v2-bad")
    assert reply["checksums"][named[0][0]] != sums[named[0][0]]
    assert (await call(url, "/model_info", method="GET"))[1]["weight_version"] == "v1"  # staged, not served
    status, reply = await call(url, STAGING_ROUTE, {**flip, "weight_version": "v2-bad"})
    assert status == 400 and "wrong checksum" in reply["message"], reply
    assert reply["mismatched"] == [named[0][0]], reply
    assert (await call(url, "/model_info", method="GET"))[1]["weight_version"] == "v1"

    await broadcast([t for _, t in named], "v2-staged")
    status, reply = await call(url, STAGING_ROUTE, {**flip, "weight_version": "v2-staged"})
    assert status == 200 and reply["success"] and reply["pause_mode"] == "retract", reply
    assert reply["pause_s"] < 0.5 and reply["checksums"] == sums
    received = await engine_weights(url, [name for name, _ in named])
    assert all(torch.equal(received[name], tensor) for name, tensor in named)
    assert (await call(url, "/model_info", method="GET"))[1]["weight_version"] == "v2-staged"
    status, reply = await call(url, STAGING_ROUTE, flip)  # flipped once: staging is empty again
    assert status == 400 and "nothing is staged" in reply["message"], reply


async def test_a_distributed_update_for_an_unknown_group_is_refused(weights_engine):
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "nope"}
    status, reply = await call(weights_engine.url, "/update_weights_from_distributed", body)
    assert status == 400 and not reply["success"] and "init_weights_update_group" in reply["message"]
