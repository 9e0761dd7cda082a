"""Request parsing: SGLang defaults and leniency, and a clear message for everything refused."""

from __future__ import annotations

import pytest

from rlfleet.engine.protocol import BadRequest, Limits, SamplingSpec, parse_generate

LIMITS = Limits(vocab_size=100, context_length=64, max_total_tokens=1000)


def parse(body):
    return parse_generate(body, LIMITS, encode=lambda text: [ord(c) % 100 for c in text])


def test_a_single_request_gets_sglang_defaults():
    (item,), is_batch = parse({"input_ids": [1, 2, 3], "sampling_params": {"temperature": None}})
    assert not is_batch
    # The default max_new_tokens (128) is capped to the room the context leaves.
    assert item.sampling == SamplingSpec(max_new_tokens=64 - 3)
    assert item.logprob_start_len == -1 and not item.return_logprob and len(item.rid) == 32
    (roomy,), _ = parse_generate({"input_ids": [1]}, Limits(100, 1024, 4096), encode=list)
    assert roomy.sampling.max_new_tokens == 128


def test_a_batch_shares_or_splits_parameters_and_prefixes_a_single_rid():
    items, is_batch = parse(
        {
            "input_ids": [[1, 2], [3]],
            "sampling_params": [{"max_new_tokens": 4, "sampling_seed": 9}, {"max_new_tokens": 5}],
            "return_logprob": True,
            "rid": "job",
        }
    )
    assert is_batch and [it.rid for it in items] == ["job_0", "job_1"]
    assert [it.sampling.max_new_tokens for it in items] == [4, 5] and items[0].sampling.sampling_seed == 9
    assert all(it.return_logprob for it in items)


def test_text_input_is_tokenized_and_unknown_top_level_fields_are_ignored():
    (item,), _ = parse(
        {"text": "ab", "sampling_params": {"max_new_tokens": 2}, "log_metrics": False, "priority": 3}
    )
    assert item.input_ids == [97 % 100, 98 % 100]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "must be a JSON object"),
        ({}, "exactly one of 'input_ids' or 'text'"),
        ({"input_ids": []}, "input_ids is empty"),
        ({"input_ids": [[1], []]}, "input_ids[1] is empty"),
        ({"input_ids": [1, 100]}, "input_ids[1] = 100 is outside the vocabulary [0, 100)"),
        ({"input_ids": [1, -1]}, "outside the vocabulary"),
        ({"input_ids": [1, "x"]}, "is not an integer token id"),
        ({"input_ids": [1, True]}, "is not an integer token id"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 64}}, "maximum context length of 64"),
        ({"input_ids": list(range(64))}, "longer than the model's context length"),
        ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature must be"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, "only n = 1"),
        ({"input_ids": [1], "sampling_params": {"seed": 1}}, "'sampling_seed'"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown sampling parameter 'bogus'"),
        (
            {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}},
            "'frequency_penalty' is not supported",
        ),
        ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "stop must be"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens must be an integer"),
        ({"input_ids": [1], "stream": True}, "'stream' is not supported"),
        ({"input_ids": [1], "top_logprobs_num": 5}, "'top_logprobs_num'"),
        ({"input_ids": [1, 2], "logprob_start_len": 2}, "logprob_start_len must be -1 or in [0, 2)"),
        (
            {"input_ids": [[1], [2]], "sampling_params": [{}]},
            "'sampling_params' has 1 entries for a batch of 2",
        ),
        ({"input_ids": [1], "rid": 5}, "'rid' must be a string"),
    ],
)
def test_bad_requests_are_refused_with_a_message_that_says_what_is_wrong(body, message):
    with pytest.raises(BadRequest) as error:
        parse(body)
    assert message in str(error.value)


def test_sglang_neutral_values_of_unsupported_parameters_are_accepted():
    (item,), _ = parse(
        {
            "input_ids": [1],
            "sampling_params": {
                "max_new_tokens": 3,
                "frequency_penalty": 0.0,
                "min_p": 0.0,
                "regex": None,
                "stream_interval": 4,
            },
        }
    )
    assert item.sampling.max_new_tokens == 3


def test_the_kv_budget_refuses_a_request_that_could_never_be_admitted():
    with pytest.raises(BadRequest, match="max_total_tokens"):
        parse_generate(
            {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 20}},
            Limits(100, 64, 25),
            encode=list,
        )


def test_oversize_text_is_refused_with_413_and_the_limit_before_it_is_tokenized():
    def never(text):
        raise AssertionError("tokenized an oversize text")

    small = Limits(vocab_size=100, context_length=64, max_total_tokens=1000, max_text_chars=10)
    with pytest.raises(BadRequest) as refused:
        parse_generate({"text": ["123456", "7890a"]}, small, encode=never)
    assert refused.value.status == 413 and refused.value.details == {"field": "text", "limit": 10, "size": 11}
    with pytest.raises(BadRequest) as long_ids:
        parse_generate({"input_ids": [[1], [1] * 64]}, small, encode=never)
    assert long_ids.value.status == 400 and long_ids.value.details["field"] == "input_ids[1]"
    (item,), _ = parse_generate({"text": "1234567890"}, small, encode=lambda t: [int(c) for c in t])
    assert len(item.input_ids) == 10
