"""Proto <-> SGLang translation and version parsing, without any server."""

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.engine_client import GenerateResult, VersionRange, version_ranges
from rlfleet.gateway.engine_io import generate_response, sampling_params, span_version
from rlfleet.gateway.errors import InvalidGatewayRequest
from rlfleet.gateway.health import parse_version


def result(**overrides) -> GenerateResult:
    fields = dict(rid="r", output_ids=[5, 6], output_logprobs=[-0.5, -1.5], finish_reason="stop", matched=2,
                  finish_message=None, weight_version="7", weight_versions=[VersionRange("7", 0, 2)],
                  prompt_tokens=3, cached_tokens=0, latency=0.01, text="hi")
    return GenerateResult(**{**fields, **overrides})


def test_sampling_params_use_sglang_names_and_leave_unset_fields_to_the_engine():
    proto = common_pb2.SamplingParams(max_new_tokens=12, temperature=0.0, seed=42, top_k=0, stop=["</calc>"],
                                      stop_token_ids=[2], ignore_eos=True)
    assert sampling_params(proto) == {"max_new_tokens": 12, "temperature": 0.0,
                                      "sampling_seed": 42, "top_k": -1,
                                      "stop": ["</calc>"], "stop_token_ids": [2], "ignore_eos": True}
    assert sampling_params(common_pb2.SamplingParams(max_new_tokens=3)) == {"max_new_tokens": 3}


@pytest.mark.parametrize("max_new_tokens", [0, -4])
def test_sampling_without_a_positive_max_new_tokens_is_invalid(max_new_tokens):
    with pytest.raises(InvalidGatewayRequest, match="max_new_tokens must be > 0"):
        sampling_params(common_pb2.SamplingParams(max_new_tokens=max_new_tokens))


@pytest.mark.parametrize(("text", "version"), [("0", 0), ("12", 12), ("default", 0), ("", 0), ("v3", -1)])
def test_weight_versions_parse_as_integer_policy_versions(text, version):
    assert parse_version(text) == version


def test_a_reply_that_spans_a_weight_swap_carries_its_oldest_version_and_both_ranges():
    swapped = result(weight_version="5", weight_versions=[VersionRange("4", 0, 1), VersionRange("5", 1, 2)])
    assert span_version(swapped) == 4
    assert span_version(result(weight_version="5", weight_versions=[VersionRange("5", 0, 2)])) == 5
    reply = generate_response(swapped, "e", 0.1, False, "")
    assert reply.policy_version == 4
    assert [(r.policy_version, r.start, r.end) for r in reply.version_ranges] == [(4, 0, 1), (5, 1, 2)]
    # An unparseable version anywhere makes the reply's version unknown, never a younger one.
    assert span_version(result(weight_versions=[VersionRange("v3", 0, 1), VersionRange("5", 1, 2)])) == -1


def test_sglang_meta_info_weight_versions_are_read_and_older_replies_get_one_range():
    meta = {"weight_version": "5", "weight_versions": [{"version": "4", "start": 0, "end": 3},
                                                       {"version": "5", "start": 3, "end": 8}]}
    assert version_ranges(meta, 8) == [VersionRange("4", 0, 3), VersionRange("5", 3, 8)]
    assert version_ranges({"weight_version": "5"}, 8) == [VersionRange("5", 0, 8)]


def test_generate_response_maps_finish_reasons_and_keeps_the_reroute_reason():
    reply = generate_response(result(finish_reason="length"), "e1", 0.2, True, "engine e0 failed: refused")
    assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert list(reply.output_ids) == [5, 6] and list(reply.output_logprobs) == pytest.approx([-0.5, -1.5])
    assert (reply.engine_id, reply.policy_version, reply.rerouted) == ("e1", 7, True)
    assert reply.reroute_reason == "engine e0 failed: refused"
    assert generate_response(result(finish_reason="abort"), "e", 0, False, "").finish_reason == \
        common_pb2.FINISH_REASON_ABORT
