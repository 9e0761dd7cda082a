"""The prefix cache: its bookkeeping on its own, and the scheduler reusing finished requests' KV --
with the same tokens and log-probs as without it, and never across a weight change."""

from __future__ import annotations

import threading

import pytest
import torch

from rlfleet.common.chat import render_messages
from rlfleet.engine.model_runner import read_checkpoint
from rlfleet.engine.prefix_cache import PrefixCache
from rlfleet.engine.protocol import GenerateItem, SamplingSpec
from rlfleet.engine.scheduler import Request, RequestOutput, Scheduler
from rlfleet.engine.testing import SYSTEM

# --- PrefixCache on its own -----------------------------------------------------------------------


def kv(tokens: list[int], layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Fake KV whose column j holds token j (keys) and -token j (values), so slices are checkable."""
    column = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(1, 2, len(tokens), 4)
    return [column + layer for layer in range(layers)], [-column - layer for layer in range(layers)]


def store(cache: PrefixCache, tokens: list[int]) -> bool:
    return cache.insert(tokens, *kv(tokens))


A = list(range(100, 140))  # 40 tokens: two whole blocks of 16 and 8 more


def test_entries_belong_to_their_namespace_the_lora_adapter_that_computed_them():
    cache = PrefixCache(1000, block_size=16)
    assert cache.insert(A, *kv(A), namespace="lora-a")
    assert cache.lookup([*A, 1]) is None and cache.lookup([*A, 1], "lora-b") is None
    assert cache.lookup([*A, 1], "lora-a").length == 40
    # The same tokens under the base model are a separate entry, and extending one namespace's
    # sequence never drops another namespace's entry.
    assert store(cache, A)
    assert cache.insert([*A, 1, 2], *kv([*A, 1, 2]), namespace="lora-a")
    assert cache.entries == 2 and cache.lookup([*A, 9]).length == 40
    assert cache.drop("lora-a") == 1 and cache.lookup([*A, 1, 2, 3], "lora-a") is None
    assert cache.lookup([*A, 9]).length == 40


def test_a_lookup_reuses_the_longest_match_including_a_partial_last_block():
    cache = PrefixCache(1000, block_size=16)
    assert store(cache, A)
    assert store(cache, A[:20] + list(range(500, 520)))
    hit = cache.lookup([*A, 7, 8])
    assert hit.length == 40
    assert torch.equal(hit.keys[1], kv(A)[0][1]) and torch.equal(hit.values[0], kv(A)[1][0])
    # Diverging after 35 tokens: whole blocks find the entry, the match then goes token by token.
    hit = cache.lookup([*A[:35], 1, 2, 3])
    assert hit.length == 35 and hit.keys[0].shape == (1, 2, 35, 4)
    assert torch.equal(hit.keys[0], kv(A[:35])[0][0])
    assert cache.lookup(A[:20] + list(range(500, 530))).length == 40
    assert (cache.lookups, cache.hits, cache.hit_tokens) == (3, 3, 40 + 35 + 40)


def test_entries_are_compact_copies_not_views_into_the_batch_buffer():
    cache = PrefixCache(1000, block_size=16)
    buffer = torch.randn(3, 2, 128, 4)  # a running batch: 3 rows, spare capacity
    cache.insert(A, [buffer[1:2, :, 10:50]], [buffer[1:2, :, 10:50]])
    buffer.zero_()
    hit = cache.lookup([*A, 0])
    assert hit.keys[0].untyped_storage().nbytes() == 40 * 2 * 4 * 4
    assert hit.keys[0].abs().sum() > 0


def test_a_different_prefix_misses():
    cache = PrefixCache(1000, block_size=16)
    store(cache, A)
    assert cache.lookup([1, *A[1:]]) is None
    assert cache.lookup([*A[:5], 0, *A[6:]]) is None  # no whole block matches
    assert cache.lookup(A[:15] + [0] * 20) is None  # shares less than one block
    assert cache.lookups == 3 and cache.hits == 0


def test_at_least_one_input_token_is_left_to_prefill():
    cache = PrefixCache(1000, block_size=16)
    store(cache, A)
    assert cache.lookup(A).length == 39  # equal to the entry: all but the last
    assert cache.lookup(A[:17]).length == 16
    assert cache.lookup(A[:16]) is None  # 15 usable tokens: not one whole block


def test_storing_held_tokens_refreshes_and_an_extension_replaces_its_prefix():
    cache = PrefixCache(1000, block_size=16)
    assert store(cache, A)
    assert not store(cache, A) and not store(cache, A[:32])
    assert (cache.entries, cache.tokens) == (1, 40)
    longer = A + list(range(600, 620))  # the next turn of the same episode
    assert store(cache, longer)
    assert (cache.entries, cache.tokens) == (1, 60)
    assert cache.lookup([*A, 1]).length == 40
    assert not store(cache, list(range(16 - 1)))  # shorter than a block: could never be found


def test_least_recently_used_entries_go_first_when_the_token_budget_is_full():
    cache = PrefixCache(100, block_size=16)
    x, y, z = (list(range(base, base + 40)) for base in (1000, 2000, 3000))
    store(cache, x)
    store(cache, y)
    assert cache.lookup([*x, 0]) is not None  # x is now more recent than y
    store(cache, z)
    assert (cache.entries, cache.tokens) == (2, 80)
    assert cache.lookup([*y, 0]) is None
    assert cache.lookup([*x, 0]).length == 40 and cache.lookup([*z, 0]).length == 40
    assert not store(cache, list(range(101)))  # larger than the whole budget


def test_evicting_an_entry_keeps_shared_blocks_that_lead_to_another():
    cache = PrefixCache(80, block_size=16)
    system = list(range(16))
    first, second = system + list(range(200, 224)), system + list(range(300, 324))
    store(cache, first)
    store(cache, second)
    store(cache, list(range(900, 940)))  # evicts `first`, whose first block now leads to `second`
    assert cache.entries == 2
    assert cache.lookup([*system, 5, 6]).length == 16
    assert cache.lookup([*first, 0]).length == 16


def test_clear_empties_the_cache_and_zero_tokens_turns_it_off():
    cache = PrefixCache(1000, block_size=16)
    store(cache, A)
    cache.clear()
    assert (cache.entries, cache.tokens) == (0, 0)
    assert cache.lookup(A) is None
    off = PrefixCache(0)
    assert not off.enabled and not store(off, A)
    assert off.lookup(A) is None and off.lookups == 0


# --- the scheduler with the cache -----------------------------------------------------------------


def first_turn(runner) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12*(3+4)?"}]
    return runner.encode(render_messages(messages, add_generation_prompt=True))


def observation(runner, value: str) -> list[int]:
    return runner.encode(f"<|im_end|>\n<|im_start|>tool\n{value}<|im_end|>\n<|im_start|>assistant\n")


def run(scheduler: Scheduler, *items: GenerateItem, max_steps: int = 3000) -> dict[str, RequestOutput]:
    outputs: dict[str, RequestOutput] = {}
    for it in items:
        scheduler.submit(Request(it, frozenset(), lambda out: outputs.__setitem__(out.rid, out)))
    for _ in range(max_steps):
        if len(outputs) == len(items):
            return outputs
        scheduler.step()
    raise AssertionError(f"only {len(outputs)} of {len(items)} requests finished")


def turn(rid: str, ids: list[int], seed: int, new: int = 12, **extra) -> GenerateItem:
    temperature = 0.0 if seed < 0 else 1.0
    sampling = SamplingSpec(max_new_tokens=new, temperature=temperature, sampling_seed=max(seed, 0))
    return GenerateItem(rid, ids, sampling, return_logprob=True, **extra)


def assert_same(got: RequestOutput, want: RequestOutput) -> None:
    assert got.output_ids == want.output_ids
    diff = max(abs(a - b) for a, b in zip(got.output_logprobs, want.output_logprobs, strict=True))
    assert diff <= 1e-4, diff


def two_turns(runner, scheduler: Scheduler, seed: int) -> tuple[RequestOutput, RequestOutput, list[int]]:
    prompt = first_turn(runner)
    one = run(scheduler, turn("t1", prompt, seed))["t1"]
    second = prompt + one.output_ids + observation(runner, "84")
    return one, run(scheduler, turn("t2", second, seed + 1 if seed >= 0 else seed))["t2"], second


@pytest.mark.parametrize("seed", [-1, 7], ids=["greedy", "seeded"])
def test_a_second_turn_reuses_the_first_and_generates_exactly_what_it_would_without(runner, seed):
    cached = Scheduler(runner)
    one, two, second = two_turns(runner, cached, seed)
    plain = Scheduler(runner, max_prefix_cache_tokens=0)
    plain_one, plain_two, plain_second = two_turns(runner, plain, seed)
    assert_same(one, plain_one)
    assert second == plain_second
    assert_same(two, plain_two)
    # All of turn 1 but its last token, which was sampled and never fed.
    assert one.cached_tokens == 0 and two.cached_tokens == len(first_turn(runner)) + len(one.output_ids) - 1
    assert plain_two.cached_tokens == 0
    load = cached.load()
    assert load["prefix_cache_hits"] == 1 and load["prefix_cache_hit_tokens"] == two.cached_tokens
    # Turn 2 covers turn 1, which is dropped: one entry, prompt + output but the last token.
    assert load["prefix_cache_tokens"] == len(second) + len(two.output_ids) - 1
    assert plain.load()["prefix_cache_tokens"] == 0


def test_hits_of_different_lengths_decode_together_as_they_would_alone(runner):
    prompt = first_turn(runner)
    cached, plain = Scheduler(runner), Scheduler(runner, max_prefix_cache_tokens=0)
    firsts = [turn(f"a{i}", prompt + [60 + i] * 3 * i, seed=20 + i, new=6 + 4 * i) for i in range(3)]
    outs = run(cached, *firsts)
    seconds = [
        turn(f"b{i}", it.input_ids + outs[it.rid].output_ids + observation(runner, str(i)), seed=30 + i)
        for i, it in enumerate(firsts)
    ] + [turn("fresh", prompt[:10] + [77] * 30, seed=40)]
    got = run(cached, *seconds)
    want = {it.rid: run(plain, it)[it.rid] for it in seconds}
    for it in seconds:
        assert_same(got[it.rid], want[it.rid])
    assert [got[it.rid].cached_tokens > 0 for it in seconds] == [True, True, True, False]


def test_requests_that_want_input_logprobs_prefill_everything(runner):
    scheduler = Scheduler(runner)
    _, _, second = two_turns(runner, scheduler, seed=3)
    out = run(scheduler, turn("in", second, seed=5, logprob_start_len=0))["in"]
    assert out.cached_tokens == 0
    with torch.inference_mode():
        logits = runner.model(input_ids=torch.tensor([second])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    assert [token for _, token in out.input_logprobs] == second
    for position, (logprob, token) in enumerate(out.input_logprobs[1:], start=1):
        assert abs(logprob - reference[position - 1, token].item()) <= 1e-4
    assert_same(out, run(Scheduler(runner, max_prefix_cache_tokens=0), turn("in", second, seed=5))["in"])


def test_a_weight_update_empties_the_cache(runner, model_dir, model_dir_v2):
    scheduler = Scheduler(runner)
    prompt = first_turn(runner)
    run(scheduler, turn("t1", prompt, seed=1))
    assert scheduler.prefix_cache.tokens > 0
    try:
        assert scheduler.update_weights(read_checkpoint(model_dir_v2), "v2")[0]
        assert scheduler.prefix_cache.tokens == 0
        out = run(scheduler, turn("t2", prompt, seed=1))["t2"]
        assert out.cached_tokens == 0
        assert_same(out, run(Scheduler(runner, max_prefix_cache_tokens=0), turn("t2", prompt, seed=1))["t2"])
    finally:
        assert scheduler.update_weights(read_checkpoint(model_dir), "v1")[0]
    assert scheduler.prefix_cache.tokens == 0


def test_weights_written_by_a_store_swap_empty_it_too_and_kv_that_spans_a_swap_is_not_kept(runner):
    scheduler = Scheduler(runner)
    prompt = first_turn(runner)
    run(scheduler, turn("t1", prompt, seed=1))
    outputs: dict[str, RequestOutput] = {}
    it = turn("t2", prompt + [9] * 20, seed=2, new=30)
    scheduler.submit(Request(it, frozenset(), lambda out: outputs.__setitem__(out.rid, out)))
    for _ in range(5):
        scheduler.step()
    assert scheduler.running and scheduler.prefix_cache.tokens > 0
    runner.weights_changed()  # what the weight store's swaps call (the weights themselves stay here)
    scheduler.step()
    assert scheduler.prefix_cache.tokens == 0
    while not outputs:
        scheduler.step()
    assert scheduler.prefix_cache.tokens == 0  # t2's KV was begun under the weights before
    assert run(scheduler, turn("t3", prompt, seed=1))["t3"].cached_tokens == 0
    assert scheduler.prefix_cache.tokens > 0


def test_flush_cache_empties_it_and_a_retracted_hit_finishes_as_if_uninterrupted(runner):
    scheduler = Scheduler(runner)
    _, _, second = two_turns(runner, scheduler, seed=11)
    assert scheduler.flush_cache()[0] and scheduler.prefix_cache.tokens == 0
    run(scheduler, turn("again", second, seed=12, new=4))
    outputs: dict[str, RequestOutput] = {}
    it = turn("r", [*second, 5, 6, 7], seed=13, new=30)
    scheduler.submit(Request(it, frozenset(), lambda out: outputs.__setitem__(out.rid, out)))
    for _ in range(8):
        scheduler.step()
    scheduler.pause("retract")
    scheduler.resume()
    while not outputs:
        scheduler.step()
    out = outputs["r"]
    assert out.retractions == 1 and out.cached_tokens > 0
    assert_same(out, run(Scheduler(runner, max_prefix_cache_tokens=0), it)["r"])


def test_requests_admitted_together_prefill_in_one_pass_and_generate_what_each_would_alone(runner):
    """Hits and misses of different lengths, a row shorter than the longest suffix (left-padded), and
    a request that ends at its first token, all in one prefill pass."""
    prompt = first_turn(runner)
    cached = Scheduler(runner)
    warm = run(cached, turn("w", prompt, seed=3, new=9))["w"]
    items = [
        turn("hit", prompt + warm.output_ids + observation(runner, "7"), seed=11),
        turn("miss-long", prompt[:12] + [70] * 40, seed=12),
        turn("miss-short", [5, 6, 7], seed=13, new=8),
        turn("one-token", prompt, seed=-1, new=1),
        turn("greedy-hit", [*prompt, 71, 72], seed=-1),
    ]
    passes = cached.prefill_passes
    got = run(cached, *items)
    assert cached.prefill_passes == passes + 1
    for it in items:
        alone = run(Scheduler(runner, max_prefix_cache_tokens=0), it)[it.rid]
        assert_same(got[it.rid], alone)
    # Every row feeds the batch's longest uncached suffix (miss-long's 52 tokens): a hit keeps only
    # the cached columns before that, a sequence no longer than it keeps none.
    fed = len(items[1].input_ids)
    assert got["hit"].cached_tokens == len(items[0].input_ids) - fed > 0
    assert got["greedy-hit"].cached_tokens == max(0, len(items[4].input_ids) - fed)
    assert got["miss-long"].cached_tokens == got["miss-short"].cached_tokens == 0
    assert len(got["one-token"].output_ids) == 1


def test_a_group_of_one_prompt_admitted_together_prefills_it_once_and_samples_each_on_its_own(runner):
    """GRPO's samples of a task start from the same tokens: one row of the batched pass computes
    them, and each request still generates what it would alone, with its own seed."""
    prompt = first_turn(runner)
    scheduler = Scheduler(runner, max_prefix_cache_tokens=0)
    group = [turn(f"s{i}", prompt, seed=20 + i) for i in range(6)]
    other = turn("other", [*prompt[:-1], 70], seed=30)
    got = run(scheduler, *group, other)
    assert scheduler.prefill_passes == 1 and scheduler.prefill_rows_shared == 5
    for it in [*group, other]:
        assert_same(got[it.rid], run(Scheduler(runner, max_prefix_cache_tokens=0), it)[it.rid])
    assert len({tuple(got[it.rid].output_ids) for it in group}) > 1  # sampled apart, not copied


def test_a_prefill_pass_that_raises_fails_its_requests_instead_of_leaving_them_waiting(runner, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(runner, "prefill_rows", broken)
    scheduler = Scheduler(runner)
    outputs: dict[str, RequestOutput] = {}
    done = threading.Event()

    def deliver(out: RequestOutput) -> None:
        outputs[out.rid] = out
        if len(outputs) == 2:
            done.set()

    for rid in ("a", "b"):  # submitted before the loop starts: admitted together, prefilled as one batch
        scheduler.submit(Request(turn(rid, first_turn(runner), seed=1), frozenset(), deliver))
    scheduler.start()
    try:
        assert done.wait(10), outputs
    finally:
        scheduler.stop()
    assert {out.finish_reason["type"] for out in outputs.values()} == {"abort"}
    assert all("out of memory" in out.finish_reason["message"] for out in outputs.values())
