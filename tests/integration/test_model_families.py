"""Every model family rlfleet builds (`rlfleet-build-model --family`), through the real services:
an engine serves it, the session server renders its own chat template and tokenizes with its own
tokenizer, the trainer recomputes the rollout's log-probs, and weights the trainer exports load back
into the engine. qwen2 (the default model) is what every other integration test runs on.

Each member is tiny (2 layers, width 64) and one is saved in bf16, so the matrix also shows a bf16
checkpoint loading into the fp32 engine and trainer."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2 as pb
from rlfleet.api.session.v1 import session_pb2_grpc
from rlfleet.common.families import FAMILIES
from rlfleet.common.grpc_server import channel
from rlfleet.common.testing import unique_run_id
from rlfleet.engine.testing import build_tiny_model, http_call
from rlfleet.session.testing import Rollout
from rlfleet.trainer.batching import TrainSample, pack_batch
from rlfleet.trainer.config import BatchConfig, LossConfig, TorchBackendConfig
from rlfleet.trainer.objectives import rl_step
from rlfleet.trainer.torch_backend import TorchBackend

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MEMBERS = [("qwen3", "float32"), ("llama", "bfloat16"), ("mistral", "float32")]
SYSTEM = "You are a calculator agent."
QUESTION = "What is 12*(3+4)?"


@pytest.fixture(scope="module", params=MEMBERS, ids=[f"{f}-{d}" for f, d in MEMBERS])
def member(request, nats_url, redis_url, tmp_path_factory):
    family, dtype = request.param
    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path_factory.mktemp(f"model-{family}") / family, seed=3,
                             family=family, dtype=dtype)
    stack = Rollout(tmp_path_factory.mktemp(f"rollout-{family}"), nats_url, redis_url, model,
                    unique_run_id(family)).start(engines=1)
    yield family, model, stack
    stack.stop()


def chat(*messages: tuple[str, str]) -> common_pb2.ChatMessages:
    return common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages])


def trainer_for(model_dir) -> TorchBackend:
    return TorchBackend(TorchBackendConfig(model_dir=str(model_dir), seed=0, optim={"lr": 1e-2},
                                           batch={"micro_batch_rows": 1, "pack_length": 512}))


def sample_of(trajectory: common_pb2.Trajectory, reward: float = 1.0) -> TrainSample:
    return TrainSample(trajectory.trajectory_id, "g", list(trajectory.token_ids),
                       list(trajectory.rollout_logprobs), list(trajectory.loss_mask), reward)


def max_logprob_gap(backend: TorchBackend, trajectory: common_pb2.Trajectory) -> float:
    sample = sample_of(trajectory)
    batch = pack_batch([sample], 512)
    (recomputed,) = batch.per_sample(backend.compute_logprobs(batch))
    mask = torch.tensor(sample.loss_mask).bool()
    assert int(mask.sum()) > 0
    return float((recomputed[mask] - torch.tensor(sample.rollout_logprobs)[mask]).abs().max())


async def episode(sessions, seed: int) -> common_pb2.Trajectory:
    """Two generated turns around a tool observation sent as chat messages, closed as completed."""
    opened = await sessions.OpenSession(pb.OpenSessionRequest(
        messages=chat(("system", SYSTEM), ("user", QUESTION)),
        sampling=common_pb2.SamplingParams(max_new_tokens=12, seed=seed, temperature=1.0, ignore_eos=True)))
    sid = opened.session_id
    await sessions.Generate(pb.GenerateRequest(session_id=sid))
    await sessions.AppendObservation(pb.AppendObservationRequest(
        session_id=sid, messages=chat(("tool", "84")), add_generation_prompt=True))
    await sessions.Generate(pb.GenerateRequest(session_id=sid))
    closed = await sessions.CloseSession(pb.CloseSessionRequest(
        session_id=sid, return_trajectory=True, status=common_pb2.TRAJECTORY_STATUS_COMPLETED))
    return closed.trajectory


async def test_the_prompt_is_the_family_template_and_the_trainer_matches_the_rollout_before_and_after_a_sync(
        member, tmp_path):
    name, model, stack = member
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    family = FAMILIES[name]
    async with channel(stack.session.address) as ch:
        sessions = session_pb2_grpc.SessionServiceStub(ch)
        # What an outside client learns from the protocol alone: the family's tokens and template.
        info = await sessions.GetModelInfo(pb.GetModelInfoRequest())
        assert info.model_type == family.model_type and info.chat_template == family.chat_template
        assert list(info.stop_token_ids) == sorted(family.special_tokens.index(t) for t in family.stop_tokens)
        assert [t.content for t in info.special_tokens] == list(family.special_tokens)
        assert (info.eos_token, info.bos_token) == (family.eos_token, family.bos_token or "")
        assert Tokenizer.from_str(info.tokenizer_json).encode(QUESTION).ids == tokenizer.encode(
            QUESTION, add_special_tokens=False)
        opened = await sessions.OpenSession(pb.OpenSessionRequest(
            messages=chat(("system", SYSTEM), ("user", QUESTION)),
            sampling=common_pb2.SamplingParams(max_new_tokens=4)))
        expected = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            tokenize=True, add_generation_prompt=True, return_dict=False)
        assert list(opened.prompt_token_ids) == list(expected)
        await sessions.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))

        trajectory = await episode(sessions, seed=7)
        assert [s.kind for s in trajectory.spans] == [
            common_pb2.SPAN_KIND_PROMPT, common_pb2.SPAN_KIND_GENERATED, common_pb2.SPAN_KIND_OBSERVATION,
            common_pb2.SPAN_KIND_GENERATED]
        backend = trainer_for(model)
        assert max_logprob_gap(backend, trajectory) <= 1e-4

        # One RL step, exported as the trainer exports every version, loaded by the engine from disk.
        rl_step(backend, [sample_of(trajectory, 1.0), sample_of(await episode(sessions, seed=8), 0.0)],
                LossConfig(), BatchConfig(micro_batch_rows=1, pack_length=512))
        exported = stack.workdir / "weights" / "v1"  # under the engine's weight store root
        backend.save_hf(exported)
        engine = stack.engines["e0"]
        status, body = await http_call(engine.url, "/update_weights_from_disk",
                                       {"model_path": str(exported), "weight_version": "1"})
        assert status == 200 and body["success"], body
        after = await episode(sessions, seed=9)
        assert {s.policy_version for s in after.spans if s.kind == common_pb2.SPAN_KIND_GENERATED} == {1}
        assert max_logprob_gap(backend, after) <= 1e-4
        # ... and the old weights no longer explain the new rollout (the sync did change something).
        assert max_logprob_gap(trainer_for(model), after) > 1e-3
