"""The scheduler driven step by step in-process: batching invariance, exact log-probs, stop
conditions, pause modes and weight swaps between steps."""

from __future__ import annotations

import pytest
import torch

from rlfleet.engine.model_runner import read_checkpoint
from rlfleet.engine.protocol import GenerateItem, SamplingSpec
from rlfleet.engine.testing import Harness, alone, item, prompt, sampled_items


def test_batched_continuous_decoding_matches_decoding_each_request_alone(runner):
    items = sampled_items(runner, 6)
    harness = Harness(runner)
    # Requests join at different steps, so rows enter and leave a batch with varying padding.
    for it in items:
        harness.submit(it)
        harness.steps(3)
    batched = harness.run(len(items))
    assert harness.scheduler.decode_steps < sum(it.sampling.max_new_tokens for it in items)
    for it in items:
        solo = alone(runner, it)
        assert batched[it.rid].output_ids == solo.output_ids, it.rid
        diff = max(
            abs(a - b) for a, b in zip(batched[it.rid].output_logprobs, solo.output_logprobs, strict=True)
        )
        assert diff <= 1e-5, (it.rid, diff)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_different_ones(runner):
    base = item("a", prompt(runner, "What is 1+1?"), max_new_tokens=24, sampling_seed=7, ignore_eos=True)
    again = alone(runner, base)
    assert again.output_ids == alone(runner, base).output_ids
    other = GenerateItem(
        "b", base.input_ids, SamplingSpec(max_new_tokens=24, sampling_seed=8, ignore_eos=True)
    )
    assert alone(runner, other).output_ids != again.output_ids


def test_logprobs_equal_a_full_forward_pass_over_prompt_and_output(runner):
    items = sampled_items(runner, 4)
    harness = Harness(runner)
    harness.submit(*items)
    outputs = harness.run(len(items))
    for it in items:
        out = outputs[it.rid]
        sequence = torch.tensor([it.input_ids + out.output_ids])
        with torch.inference_mode():
            logits = runner.model(input_ids=sequence).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)
        start = len(it.input_ids) - 1
        expected = [reference[start + j, token].item() for j, token in enumerate(out.output_ids)]
        assert max(abs(a - b) for a, b in zip(expected, out.output_logprobs, strict=True)) <= 1e-4
        if it.sampling.temperature == 0.0:
            greedy = reference[start : start + len(out.output_ids)].argmax(dim=-1).tolist()
            assert out.output_ids == greedy


def test_input_token_logprobs_follow_logprob_start_len_and_max_new_tokens_zero_generates_nothing(runner):
    ids = prompt(runner, "What is 2*3?")
    it = GenerateItem("p", ids, SamplingSpec(max_new_tokens=0), return_logprob=True, logprob_start_len=2)
    out = alone(runner, it)
    assert out.output_ids == [] and out.finish_reason == {"type": "length", "length": 0}
    with torch.inference_mode():
        reference = torch.log_softmax(runner.model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    assert [token for _, token in out.input_logprobs] == ids[2:]
    for position, (logprob, token) in enumerate(out.input_logprobs, start=2):
        assert abs(logprob - reference[position - 1, token].item()) <= 1e-4


def test_stop_token_ids_end_generation_with_the_matched_id_kept_in_output_ids(runner):
    ids = prompt(runner, "Compute 40+2.")
    free = alone(runner, item("free", ids, max_new_tokens=20, temperature=0.0, ignore_eos=True))
    stop_at = free.output_ids[5]
    first = free.output_ids.index(stop_at)
    out = alone(runner, item("stop", ids, max_new_tokens=20, temperature=0.0, stop_token_ids=[stop_at]))
    assert out.finish_reason == {"type": "stop", "matched": stop_at}
    assert out.output_ids == free.output_ids[: first + 1]
    assert out.text == runner.decode_text(free.output_ids[:first])  # the stop token is trimmed from text


def test_eos_ids_stop_by_default_and_ignore_eos_runs_to_max_new_tokens(runner):
    ids = prompt(runner, "Compute 40+2.")
    free = alone(runner, item("free", ids, max_new_tokens=16, temperature=0.0, ignore_eos=True))
    fake_eos = frozenset({free.output_ids[3]})
    stopped = alone(runner, item("eos", ids, max_new_tokens=16, temperature=0.0), eos=fake_eos)
    assert stopped.finish_reason["type"] == "stop" and len(stopped.output_ids) <= 4
    ignored = alone(
        runner, item("ign", ids, max_new_tokens=16, temperature=0.0, ignore_eos=True), eos=fake_eos
    )
    assert ignored.finish_reason == {"type": "length", "length": 16}
    assert ignored.output_ids == free.output_ids


def test_stop_string_ends_generation_reports_the_match_and_is_trimmed_from_text(runner):
    ids = prompt(runner, "Please evaluate 3*3")
    sampling = {"max_new_tokens": 30, "sampling_seed": 5, "ignore_eos": True}
    free = alone(runner, item("free", ids, **sampling))
    decode = runner.decode_text
    # A printable token whose text first shows up in the output when that token is generated.
    k, stop = next(
        (k, piece)
        for k in range(3, 30)
        if (piece := decode([free.output_ids[k]])).strip()
        and "\ufffd" not in piece
        and piece not in decode(free.output_ids[:k])
        and piece in decode(free.output_ids[: k + 1])
    )
    out = alone(runner, item("s", ids, stop=(stop,), **sampling))
    assert out.finish_reason == {"type": "stop", "matched": stop}
    assert out.output_ids == free.output_ids[: k + 1]
    full = decode(out.output_ids)
    assert out.text == full[: full.find(stop)]
    kept = alone(runner, item("k", ids, stop=(stop,), no_stop_trim=True, **sampling))
    assert kept.text == full and kept.output_ids == out.output_ids


def long_item(runner, rid: str, seed: int, new: int = 60) -> GenerateItem:
    return item(
        rid, prompt(runner, f"Count to {seed}"), max_new_tokens=new, sampling_seed=seed, ignore_eos=True
    )


def test_paused_engine_aborts_in_flight_requests_in_abort_mode(runner):
    harness = Harness(runner)
    harness.submit(long_item(runner, "a", 1), long_item(runner, "b", 2))
    harness.steps(10)
    harness.submit(long_item(runner, "queued", 3))
    harness.scheduler.pause("abort")
    outputs = harness.run(3)
    for rid in ("a", "b"):
        assert outputs[rid].finish_reason["type"] == "abort"
        assert 0 < len(outputs[rid].output_ids) < 60
        assert len(outputs[rid].output_logprobs) == len(outputs[rid].output_ids)
    assert outputs["queued"].finish_reason["type"] == "abort" and outputs["queued"].output_ids == []
    # Paused: a new request waits until continue.
    harness.submit(long_item(runner, "later", 4, new=5))
    harness.steps(5)
    assert "later" not in harness.outputs
    harness.scheduler.resume()
    assert harness.run(4)["later"].finish_reason["type"] == "length"


def test_retracted_requests_are_recomputed_and_finish_as_if_uninterrupted(runner):
    items = [long_item(runner, "a", 11), long_item(runner, "b", 12, new=45)]
    harness = Harness(runner)
    harness.submit(*items)
    harness.steps(15)
    harness.scheduler.pause("retract")
    assert harness.scheduler.running == [] and [r.rid for r in harness.scheduler.waiting] == ["a", "b"]
    assert harness.scheduler.flush_cache()[0]  # nothing holds KV any more
    harness.steps(5)
    assert not harness.outputs
    harness.scheduler.resume()
    outputs = harness.run(2)
    for it in items:
        solo = alone(runner, it)
        assert outputs[it.rid].retractions == 1
        assert outputs[it.rid].output_ids == solo.output_ids
        diff = max(
            abs(a - b) for a, b in zip(outputs[it.rid].output_logprobs, solo.output_logprobs, strict=True)
        )
        assert diff <= 1e-4


def test_in_place_pause_freezes_requests_with_their_kv_and_refuses_to_flush(runner):
    it = long_item(runner, "a", 21)
    harness = Harness(runner)
    harness.submit(it)
    harness.steps(10)
    harness.scheduler.pause("in_place")
    produced = len(harness.scheduler.running[0].output_ids)
    kv_length = harness.scheduler.cache.length
    harness.steps(10)
    assert (
        len(harness.scheduler.running[0].output_ids) == produced
        and harness.scheduler.cache.length == kv_length
    )
    ok, message = harness.scheduler.flush_cache()
    assert not ok and "hold KV" in message
    harness.scheduler.resume()
    out = harness.run(1)["a"]
    assert out.retractions == 0 and out.output_ids == alone(runner, it).output_ids


def test_abort_by_rid_ends_only_that_request(runner):
    harness = Harness(runner)
    harness.submit(long_item(runner, "a", 31), long_item(runner, "b", 32, new=20))
    harness.steps(5)
    assert harness.scheduler.abort(rid="a") == 1
    outputs = harness.run(2)
    assert outputs["a"].finish_reason["type"] == "abort"
    assert outputs["b"].finish_reason["type"] == "length" and len(outputs["b"].output_ids) == 20


def test_weight_swap_between_steps_is_recorded_in_version_spans(runner, model_dir, model_dir_v2):
    harness = Harness(runner, weight_version="v1")
    harness.submit(long_item(runner, "a", 41, new=30))
    harness.steps(10)
    try:
        ok, message = harness.scheduler.update_weights(read_checkpoint(model_dir_v2), "v2")
        assert ok, message
        out = harness.run(1)["a"]
    finally:
        assert harness.scheduler.update_weights(read_checkpoint(model_dir), "v1")[0]
    assert out.weight_version == "v2"
    (v1, s1, e1), (v2, s2, e2) = out.weight_version_spans
    assert (v1, s1, v2, e2) == ("v1", 0, "v2", 30) and e1 == s2


def test_weights_of_the_wrong_shape_are_refused_without_changing_anything(runner, tmp_path):
    from rlfleet.engine.testing import build_tiny_model

    other = build_tiny_model(tmp_path / "wide", seed=1, hidden_size=96)
    before = runner.parameter("model.norm.weight").clone()
    harness = Harness(runner, weight_version="v1")
    ok, message = harness.scheduler.update_weights(read_checkpoint(other), "v9")
    assert not ok and "shape mismatch" in message
    assert harness.scheduler.weight_version == "v1"
    assert torch.equal(runner.parameter("model.norm.weight"), before)


def test_admission_respects_max_running_requests_and_the_token_budget(runner):
    harness = Harness(runner, max_running_requests=2, max_total_tokens=200)
    items = [long_item(runner, f"r{i}", 50 + i, new=40) for i in range(4)]
    harness.submit(*items)
    harness.steps(1)
    assert len(harness.scheduler.running) == 2 and len(harness.scheduler.waiting) == 2
    outputs = harness.run(4)
    assert all(outputs[it.rid].finish_reason["type"] == "length" for it in items)


@pytest.mark.parametrize("leaving", [[0], [1], [0, 2]])
def test_cache_trims_shared_padding_when_the_longest_rows_leave(runner, leaving):
    harness = Harness(runner)
    lengths = [30, 5, 12]
    harness.submit(
        *[
            item(f"r{i}", list(range(3, 3 + n)), max_new_tokens=50, temperature=0.0, ignore_eos=True)
            for i, n in enumerate(lengths)
        ]
    )
    harness.steps(2)
    cache = harness.scheduler.cache
    keep = [row for row in range(3) if row not in leaving]
    cache.keep_rows(keep)
    assert int(cache.pad.min()) == 0
    # Each row holds its prompt plus one token per decode step; nothing else is left in front.
    assert cache.length == max(lengths[row] for row in keep) + harness.scheduler.decode_steps
