"""The CPU engine's trainer-sent weight routes, against a running engine process with this test as the
trainer: SGLang's `update_weights_from_tensor` (same-node shared-memory handles), and P2P through the
Mooncake staging buffer it publishes at `/remote_instance_transfer_engine_info`. Bad input answers
400 and changes nothing; a partial P2P transfer is refused by checksum."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from rlfleet.engine.model_runner import read_checkpoint
from rlfleet.engine.testing import EngineProcess
from rlfleet.engine.testing import http_call as call
from rlfleet.weights.p2p import Endpoint, P2PSender, TransferAgent
from rlfleet.weights.sent import served_named, tensor_checksums
from rlfleet.weights.tensor_ipc import SharedTensors

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    process = EngineProcess(model_dir, tmp_path_factory.mktemp("sent-engine"), weight_version="v1").start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def v2(model_dir_v2):
    return served_named(dict(read_checkpoint(model_dir_v2)))


async def weights_of(url: str, names) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        status, values = await call(url, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20})
        assert status == 200, values
        out[name] = torch.tensor(values, dtype=torch.float32)
    return out


async def held_version(url: str) -> str:
    return (await call(url, "/model_info", method="GET"))[1]["weight_version"]


async def test_update_weights_from_tensor_takes_shared_memory_handles_and_reports_checksums(engine, v2):
    shared = SharedTensors(v2)
    try:
        status, reply = await call(engine.url, "/update_weights_from_tensor?pause_mode=retract",
                                   {"serialized_named_tensors": [shared.payload], "weight_version": "t2"})
    finally:
        shared.close()
    assert status == 200 and reply["success"], reply
    assert reply["checksums"] == tensor_checksums(v2) and reply["pause_mode"] == "retract"
    assert await held_version(engine.url) == "t2"
    got = await weights_of(engine.url, [n for n, _ in v2])
    assert all(torch.equal(got[n], t.float()) for n, t in v2)


@pytest.mark.parametrize("body", [
    {},
    {"serialized_named_tensors": "not a list"},
    {"serialized_named_tensors": ["a", "b"]},  # two TP ranks' entries for a TP-1 engine
    {"serialized_named_tensors": ["%%% not base64"]},
    {"serialized_named_tensors": [base64.b64encode(pickle.dumps(os.system)).decode()]},  # code, not tensors
    {"serialized_named_tensors": [base64.b64encode(pickle.dumps([("x", 1)])).decode()]},
    {"serialized_named_tensors": ["AAAA"], "load_format": "flattened_bucket"},
])
async def test_update_weights_from_tensor_refuses_bad_payloads_and_changes_nothing(engine, body):
    before = await held_version(engine.url)
    status, reply = await call(engine.url, "/update_weights_from_tensor", body)
    assert status == 400, reply
    assert await held_version(engine.url) == before


async def test_p2p_staging_swaps_a_whole_transfer_and_refuses_a_partial_one(engine, v2, model_dir):
    status, bad = await call(engine.url, "/remote_instance_transfer_engine_info", method="GET")
    assert status == 400 and "rank" in bad["error"]["message"]
    status, info = await call(engine.url, "/remote_instance_transfer_engine_info?rank=0", method="GET")
    assert status == 200, info
    endpoint = Endpoint.from_json(info)
    assert info["rank"] == 0 and endpoint.session_id.startswith("127.0.0.1:")
    v1 = served_named(dict(read_checkpoint(model_dir)))
    by_name = dict(v1)
    sender = P2PSender(TransferAgent(), bucket_bytes=1 << 16)
    state = {n: by_name[n] for n in endpoint.tensors}
    sums = tensor_checksums(state.items())

    # Only half the tensors land: refused, the engine keeps what it had.
    before = await held_version(engine.url)
    sender.send(state, endpoint, only=set(list(state)[: len(state) // 2]))
    status, reply = await call(engine.url, "/rlfleet/update_weights_from_staging",
                               {"checksums": sums, "checksum_algorithm": "sha256", "weight_version": "p1"})
    assert status == 400 and "wrong checksum" in reply["message"] and reply["mismatched"], reply
    assert await held_version(engine.url) == before

    report = sender.send(state, endpoint)
    assert report.bytes_sent == sum(t.numel() * t.element_size() for t in state.values())
    status, reply = await call(engine.url, "/rlfleet/update_weights_from_staging",
                               {"checksums": sums, "checksum_algorithm": "sha256", "weight_version": "p1",
                                "pause_mode": "in_place"})  # fmt: skip
    assert status == 200 and reply["success"] and reply["bytes"] == report.bytes_sent, reply
    assert await held_version(engine.url) == "p1"
    got = await weights_of(engine.url, list(state))
    assert all(torch.equal(got[n], t.float()) for n, t in state.items())
    status, reply = await call(engine.url, "/rlfleet/update_weights_from_staging",
                               {"checksums": sums, "checksum_algorithm": "sha256", "pause_mode": "sideways"})
    assert status == 400, reply


async def test_a_p2p_flip_naming_the_stores_copy_holds_that_version_so_the_next_update_is_a_delta(
    engine, v2, model_dir, tmp_path
):
    """With `model_path` (the store's copy of the sent version) the engine checks the trainer's checksums
    against the store's index and, when they are the same, holds that store version: the version after
    it then loads as a delta (the fallback of a later failed transfer). Checksums that are not the
    store's leave it holding none (the flip itself still happens: the bytes were the trainer's)."""
    from rlfleet.weights import DirectoryWeightStore

    store = DirectoryWeightStore(tmp_path / "weights", "sent", full_every=10**6, max_delta_fraction=10.0)
    first = dict(read_checkpoint(model_dir))
    store.write_version(0, first)
    store.write_version(1, {n: t for n, t in v2})
    assert store.index(1).kind == "delta"
    _, info = await call(engine.url, "/remote_instance_transfer_engine_info?rank=0", method="GET")
    endpoint = Endpoint.from_json(info)
    sender = P2PSender(TransferAgent(), bucket_bytes=1 << 16)
    v1 = dict(served_named(first))

    # The trainer's bytes of version 1 flipped in, but named as the store's version 0: not held.
    state = {n: dict(v2)[n] for n in endpoint.tensors}
    sender.send(state, endpoint)
    status, reply = await call(engine.url, "/rlfleet/update_weights_from_staging",
                               {"checksums": tensor_checksums(state.items()), "checksum_algorithm": "sha256",
                                "weight_version": "x", "model_path": str(store.run_dir / "v000000")})
    assert status == 200 and reply["success"] and reply["weight_store_version"] is None, reply
    assert "not the store's version 0" in reply["weight_store_note"], reply

    state = {n: v1[n] for n in endpoint.tensors}
    sender.send(state, endpoint)
    status, reply = await call(engine.url, "/rlfleet/update_weights_from_staging",
                               {"checksums": tensor_checksums(state.items()), "checksum_algorithm": "sha256",
                                "weight_version": "0", "model_path": store.uri(0)})
    assert status == 200 and reply["success"] and reply["weight_store_version"] == 0, reply
    status, reply = await call(engine.url, "/rlfleet/update_weights_from_store",
                               {"model_path": store.uri(1), "kind": "delta", "weight_version": "1"})
    assert status == 200 and reply["success"], reply
    got = await weights_of(engine.url, [n for n, _ in v2])
    assert all(torch.equal(got[n], t.float()) for n, t in v2)

    status, reply = await call(engine.url, "/rlfleet/update_weights_from_staging",
                               {"checksums": {"x": "y"}, "checksum_algorithm": "sha256",
                                "model_path": str(tmp_path / "nowhere" / "v000001")})
    assert status == 400 and "not a version directory" in reply["error"]["message"], reply
    sender.close()
