"""Translation between the gateway's protos and SGLang's `/generate` fields."""

from __future__ import annotations

from typing import Any

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.gateway.v1 import gateway_pb2
from rlfleet.common.engine_client import GenerateResult, PauseMode
from rlfleet.gateway.errors import InvalidGatewayRequest
from rlfleet.gateway.health import parse_version

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}

PAUSE_MODES: dict[int, PauseMode] = {
    gateway_pb2.PAUSE_MODE_UNSPECIFIED: "abort",  # SGLang's default
    gateway_pb2.PAUSE_MODE_ABORT: "abort",
    gateway_pb2.PAUSE_MODE_RETRACT: "retract",
    gateway_pb2.PAUSE_MODE_IN_PLACE: "in_place",
}


def sampling_params(sampling: common_pb2.SamplingParams) -> dict[str, Any]:
    """SGLang `sampling_params` for a proto SamplingParams; unset optional fields are left to the engine."""
    if sampling.max_new_tokens <= 0:
        raise InvalidGatewayRequest(
            f"sampling.max_new_tokens must be > 0, got {sampling.max_new_tokens}",
            field="sampling.max_new_tokens")
    params: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens}
    if sampling.HasField("temperature"):
        params["temperature"] = sampling.temperature
    if sampling.HasField("top_p"):
        params["top_p"] = sampling.top_p
    if sampling.HasField("top_k"):
        params["top_k"] = sampling.top_k if sampling.top_k > 0 else -1  # proto: 0 or -1 = off
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.HasField("seed"):
        params["sampling_seed"] = sampling.seed
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    return params


def validate_input_ids(input_ids: list[int] | Any) -> None:
    if not input_ids:
        raise InvalidGatewayRequest("input_ids is empty", field="input_ids")
    # Engines check the vocabulary; negative ids are wrong for any vocabulary.
    if min(input_ids) < 0:
        raise InvalidGatewayRequest(f"input_ids contains a negative token id ({min(input_ids)})",
                                    field="input_ids")


def version_ranges(result: GenerateResult) -> list[common_pb2.VersionRange]:
    """The reply's per-token versions (SGLang 0.5.23's meta_info.weight_versions) as policy versions."""
    return [common_pb2.VersionRange(policy_version=parse_version(r.version), start=r.start, end=r.end)
            for r in result.weight_versions]


def span_version(result: GenerateResult) -> int:
    """The policy version of a reply: the oldest version that produced any of its tokens.

    A request that ran across a weight swap (no pause, or an in-place pause) mixes versions; the
    oldest one is what bounds its staleness. An unparseable version (-1) makes the whole reply -1.
    """
    versions = [parse_version(r.version) for r in result.weight_versions]
    if not versions:
        return parse_version(result.weight_version)
    return -1 if min(versions) < 0 else min(versions)


def generate_response(result: GenerateResult, engine_id: str, latency_s: float, rerouted: bool,
                      reroute_reason: str) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        output_ids=result.output_ids, output_logprobs=result.output_logprobs or [],
        finish_reason=FINISH_REASONS.get(result.finish_reason, common_pb2.FINISH_REASON_ABORT),
        policy_version=span_version(result), engine_id=engine_id, prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens, latency_s=latency_s, text=result.text, rerouted=rerouted,
        reroute_reason=reroute_reason, version_ranges=version_ranges(result))
