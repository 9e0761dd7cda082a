"""The engine as a process, over HTTP: SGLang fields, 400s, pause modes and aborts.

These share one engine process; every test leaves it unpaused."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rlfleet.common.processes import eventually
from rlfleet.engine.testing import auth_headers
from rlfleet.engine.testing import generate_in_process as in_process
from rlfleet.engine.testing import http_call as call

pytestmark = pytest.mark.integration


async def load(url: str) -> dict:
    return (await call(url, "/server_info", method="GET"))[1]


LONG = {"max_new_tokens": 900, "ignore_eos": True, "sampling_seed": 77}


async def start_long(url: str, rid: str, **extra) -> asyncio.Task:
    body = {
        "input_ids": [1, 40, 41, 42],
        "sampling_params": {**LONG, **extra},
        "return_logprob": True,
        "rid": rid,
    }
    task = asyncio.create_task(call(url, "/generate", body))

    async def running():
        current = await load(url)
        return current["num_running_reqs"] >= 1 and current["generated_tokens"] > 0

    await eventually(running)
    return task


async def test_generate_answers_with_sglang_fields_for_a_single_request_and_a_batch(engine, runner):
    body = {
        "input_ids": [1, 5, 6, 7],
        "sampling_params": {"max_new_tokens": 12, "sampling_seed": 3, "top_k": 50},
        "return_logprob": True,
        "rid": "one",
    }
    status, reply = await call(engine.url, "/generate", body)
    assert status == 200
    meta = reply["meta_info"]
    assert meta["id"] == "one" and meta["prompt_tokens"] == 4 and meta["cached_tokens"] == 0
    assert meta["completion_tokens"] == len(reply["output_ids"]) == len(meta["output_token_logprobs"])
    assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert all(
        entry[1] == token and entry[2] is None
        for entry, token in zip(meta["output_token_logprobs"], reply["output_ids"], strict=True)
    )
    reference = in_process(runner, [1, 5, 6, 7], max_new_tokens=12, sampling_seed=3, top_k=50)
    assert reply["output_ids"] == reference.output_ids and reply["text"] == reference.text
    assert (
        max(
            abs(e[0] - r)
            for e, r in zip(meta["output_token_logprobs"], reference.output_logprobs, strict=True)
        )
        <= 1e-5
    )

    batch = {
        "input_ids": [[1, 5, 6, 7], [1, 9]],
        "sampling_params": {"max_new_tokens": 12, "sampling_seed": 3, "top_k": 50},
    }
    status, replies = await call(engine.url, "/generate", batch)
    assert status == 200 and isinstance(replies, list) and len(replies) == 2
    assert (
        replies[0]["output_ids"] == reply["output_ids"]
        and "output_token_logprobs" not in replies[0]["meta_info"]
    )


async def test_a_second_turn_reports_its_reused_prefix_as_cached_tokens_until_flush_cache(engine, runner):
    first = list(range(300, 330))  # tokens no other test sends
    sampling = {"max_new_tokens": 6, "sampling_seed": 9, "ignore_eos": True}
    _, one = await call(engine.url, "/generate", {"input_ids": first, "sampling_params": sampling})
    assert one["meta_info"]["cached_tokens"] == 0
    second = [*first, *one["output_ids"], 5, 6, 7]
    body = {"input_ids": second, "sampling_params": sampling, "return_logprob": True}
    _, two = await call(engine.url, "/generate", body)
    assert two["meta_info"]["cached_tokens"] == len(first) + len(one["output_ids"]) - 1
    reference = in_process(runner, second, **sampling)
    assert two["output_ids"] == reference.output_ids
    got = [entry[0] for entry in two["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, reference.output_logprobs, strict=True)) <= 1e-4
    current = await load(engine.url)
    assert current["prefix_cache_tokens"] >= len(second) and current["prefix_cache_hit_tokens"] >= 35
    assert (await call(engine.url, "/flush_cache"))[0] == 200
    assert (await load(engine.url))["prefix_cache_tokens"] == 0
    _, three = await call(engine.url, "/generate", body)
    assert three["meta_info"]["cached_tokens"] == 0 and three["output_ids"] == two["output_ids"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1, 10**6]}, "outside the vocabulary"),
        ({"input_ids": []}, "input_ids is empty"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens must be at least 0"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}, "maximum context length"),
        ({"input_ids": [1], "sampling_params": {"n": 4}}, "only n = 1"),
        ({"input_ids": [1], "sampling_params": {"top_p": 2}}, "top_p"),
    ],
)
async def test_bad_generate_requests_get_400_with_the_reason(engine, body, message):
    status, reply = await call(engine.url, "/generate", body)
    assert status == 400 and message in reply["error"]["message"]


async def test_malformed_json_and_bad_control_calls_get_400_and_the_engine_stays_healthy(engine):
    async with aiohttp.ClientSession() as session:
        async with session.post(engine.url + "/generate", data=b"{not json",
                                headers=auth_headers("/generate")) as response:
            assert response.status == 400 and "invalid JSON" in (await response.json())["error"]["message"]
    assert (await call(engine.url, "/pause_generation", {"mode": "sideways"}))[0] == 400
    assert (await call(engine.url, "/abort_request", {}))[0] == 400
    assert (await call(engine.url, "/update_weights_from_disk", {}))[0] == 400
    assert (await call(engine.url, "/health_generate", method="GET"))[0] == 200


async def test_deeply_nested_json_is_a_400_logged_once_per_peer(engine):
    deep = b"[" * 200_000 + b"]" * 200_000  # deeper than Python's stack: RecursionError in json.loads
    logged_before = engine.log().count("undecodable request body")
    async with aiohttp.ClientSession() as session:
        for path in ("/generate", "/update_weight_version", "/generate"):
            async with session.post(engine.url + path, data=deep, headers=auth_headers(path)) as response:
                assert response.status == 400, path
                assert "nested too deeply" in (await response.json())["error"]["message"]
    assert (await call(engine.url, "/health_generate", method="GET"))[0] == 200
    # at most one line for the three (one, if an earlier test's bad body was not logged this minute)
    assert engine.log().count("undecodable request body") - logged_before <= 1
    assert engine.log().count("undecodable request body") >= 1
    assert "RecursionError" not in engine.log()


async def test_an_error_never_echoes_a_large_input_whole(engine):
    huge = "x" * (4 << 20)
    status, reply = await call(engine.url, "/generate",
                               {"input_ids": [1], "sampling_params": {"top_p": huge}})
    assert status == 400 and len(reply["error"]["message"]) < 1000
    async with aiohttp.ClientSession() as session:
        async with session.post(engine.url + "/generate", data=b'{"rid": "' + huge.encode(),
                                headers=auth_headers("/generate")) as response:
            assert response.status == 400 and len(await response.read()) < 1000


async def test_health_model_info_and_weight_version_routes(engine):
    assert (await call(engine.url, "/health", method="GET"))[0] == 200
    assert (await call(engine.url, "/health_generate", method="GET"))[0] == 200
    status, info = await call(engine.url, "/model_info", method="GET")
    assert status == 200 and info["is_generation"] and info["model_path"] == str(engine.model_path)
    assert info["weight_version"] == "default" and info["eos_token_ids"] == [0, 2]
    status, reply = await call(engine.url, "/update_weight_version", {"new_version": "step-7"})
    assert status == 200 and reply["success"] and reply["new_version"] == "step-7"
    try:
        assert (await call(engine.url, "/model_info", method="GET"))[1]["weight_version"] == "step-7"
        # The routes SGLang 0.5.23 dropped are gone here too (a client still calling them is caught).
        for gone in ("/get_weight_version", "/get_load", "/get_model_info"):
            assert (await call(engine.url, gone, method="GET"))[0] == 404
        _, out = await call(
            engine.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        )
        assert out["meta_info"]["weight_version"] == "step-7"
    finally:
        await call(engine.url, "/update_weight_version", {"new_version": "default"})


async def test_paused_engine_aborts_in_flight_requests_in_abort_mode(engine):
    task = await start_long(engine.url, "in-flight")
    status, reply = await call(engine.url, "/pause_generation", {"mode": "abort"})
    assert status == 200 and reply["status"] == "ok"
    try:
        _, out = await task
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"]
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
        # While paused, new work waits; health still answers.
        waiting = asyncio.create_task(
            call(engine.url, "/generate",
                 {"input_ids": [1, 3], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        )
        await asyncio.sleep(0.3)
        assert not waiting.done()
        assert (await call(engine.url, "/health_generate", method="GET"))[0] == 200
    finally:
        assert (await call(engine.url, "/continue_generation", {}))[0] == 200
    status, out = await waiting
    assert status == 200 and out["meta_info"]["completion_tokens"] == 3


@pytest.mark.slow
async def test_retract_mode_requeues_running_requests_and_they_finish_as_if_uninterrupted(engine, runner):
    task = await start_long(engine.url, "retracted")
    await call(engine.url, "/pause_generation", {"mode": "retract"})
    try:
        current = await load(engine.url)
        assert (
            current["num_running_reqs"] == 0 and current["num_waiting_reqs"] == 1
            and current["paused"] == "retract"
        )
        status, _ = await call(engine.url, "/flush_cache")
        assert status == 200
    finally:
        await call(engine.url, "/continue_generation", {})
    _, out = await task
    reference = in_process(runner, [1, 40, 41, 42], **LONG)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": LONG["max_new_tokens"]}
    assert out["output_ids"] == reference.output_ids
    got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, reference.output_logprobs, strict=True)) <= 1e-4


@pytest.mark.slow
async def test_in_place_pause_keeps_requests_and_flush_cache_fails_while_they_run(engine, runner):
    task = await start_long(engine.url, "frozen")
    await call(engine.url, "/pause_generation", {"mode": "in_place"})
    try:
        before = await load(engine.url)
        await asyncio.sleep(0.2)
        after = await load(engine.url)
        assert after["num_running_reqs"] == 1 and after["generated_tokens"] == before["generated_tokens"]
        status, text = await call(engine.url, "/flush_cache")
        assert status == 400 and "hold KV" in text
    finally:
        await call(engine.url, "/continue_generation", {})
    _, out = await task
    assert out["output_ids"] == in_process(runner, [1, 40, 41, 42], **LONG).output_ids
    assert (await call(engine.url, "/flush_cache", method="GET"))[0] == 200


async def test_abort_request_ends_one_in_flight_request_with_its_partial_output(engine):
    task = await start_long(engine.url, "victim")
    assert (await call(engine.url, "/abort_request", {"rid": "victim"}))[0] == 200
    _, out = await task
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["id"] == "victim"
    assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"]


async def test_a_client_that_disconnects_frees_its_batch_slot(engine):
    body = {"input_ids": [1, 40], "sampling_params": LONG}
    with pytest.raises(TimeoutError):
        await call(engine.url, "/generate", body, within_s=0.2)  # 900 tokens take ~0.5 s when idle

    async def idle():
        return (await load(engine.url))["num_running_reqs"] == 0

    await eventually(idle, within_s=5)


async def test_oversize_text_and_bodies_are_refused_with_413_naming_the_limit_before_tokenizing(engine):
    status, reply = await call(engine.url, "/generate", {"text": "x" * (4 << 20)})
    assert status == 413, reply
    error = reply["error"]
    assert (error["field"], error["limit"], error["size"]) == ("text", 1_000_000, 4 << 20)
    assert "not tokenized" in error["message"]
    batch = {"text": ["y" * 600_000, "z" * 600_000]}  # the limit is on a request's text in total
    status, reply = await call(engine.url, "/generate", batch)
    assert status == 413 and reply["error"]["size"] == 1_200_000
    status, reply = await call(engine.url, "/generate", {"input_ids": [1] * 100_000})
    assert status == 400 and reply["error"]["limit"] < 100_000 and reply["error"]["field"] == "input_ids"
    # 16 MiB of JSON
    status, reply = await call(engine.url, "/generate", {"input_ids": [100_000] * (2 << 20)})
    assert status == 413 and reply["error"]["field"] == "body" and reply["error"]["limit"] == 8 << 20


async def test_health_answers_while_a_long_text_is_being_tokenized(engine):
    """Tokenizing happens off the event loop: a request that takes seconds to tokenize (just under
    the size limit) does not hold up /health or another request."""
    big = asyncio.create_task(call(engine.url, "/generate", {"text": "12 + 34 = 46, what is 7*8? " * 36_000}))
    await asyncio.sleep(0.3)  # it is being tokenized now (about 2-4 s on this tokenizer)
    status, _ = await call(engine.url, "/health", method="GET", within_s=30)
    small_status, small = await call(engine.url, "/generate", {"input_ids": [1, 5], "sampling_params": {
        "max_new_tokens": 2}})
    assert status == 200 and small_status == 200 and not big.done(), small
    status, reply = await big
    assert status == 400 and "context length" in reply["error"]["message"]  # tokenized, then too long
