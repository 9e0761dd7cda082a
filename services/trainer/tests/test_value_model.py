"""PPO with a separate critic: its own weights (from the policy's or its own model), its own
optimizer, its own checkpoint inside the trainer's; the shared head stays as an option."""

from pathlib import Path

import pytest
import torch

from rlfleet.trainer.batching import pack_batch
from rlfleet.trainer.config import BatchConfig, LossConfig
from rlfleet.trainer.learner import LearnerCore
from rlfleet.trainer.objectives import rl_step, with_advantages
from rlfleet.trainer.service_config import TrainerConfig
from rlfleet.trainer.testing import make_samples, write_tiny_model
from rlfleet.trainer.torch_backend import TorchBackend
from rlfleet.trainer.value_model import VALUE_MODEL_DIR, TorchValueModel

torch.set_num_threads(1)
PPO = LossConfig(algorithm="ppo", gamma=1.0, gae_lambda=0.95)
BATCH = BatchConfig(pack_length=64, micro_batch_rows=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "m", vocab_size=64)


def trainer_config(model_dir: Path, **loss) -> TrainerConfig:
    return TrainerConfig(model_path=str(model_dir), loss=PPO.model_copy(update=loss), batch=BATCH,
                         optim={"lr": 1e-3}, value_model={"optim": {"lr": 1e-2}}, backend={"seed": 0})


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_the_critic_starts_from_the_policy_trunk_with_a_zero_head_and_its_own_optimizer(model_dir):
    core = LearnerCore(trainer_config(model_dir))
    core.load()
    policy, critic = core.backend, core.value_model
    assert isinstance(critic, TorchValueModel)
    assert policy.model.value_head is None  # no shared head on the policy
    p, c = params(policy.model), params(critic.backend.model)
    assert {k for k in c if k.startswith("lm.")} == set(p)
    assert all(torch.equal(c[k], p[k]) for k in p)
    assert float(c["value_head.weight"].abs().sum()) == 0.0
    assert critic.backend.optimizer is not policy.optimizer
    assert critic.backend.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    samples = make_samples(2, 4, seed=3, vocab_size=64)
    assert float(critic.values(pack_batch(samples, 64)).abs().max()) == 0.0  # V = 0 before training

    first = core.train(samples)
    for _ in range(5):
        last = core.train(samples)
    assert {"value_loss", "value_clip_frac", "value_mean", "critic_grad_norm", "critic_lr",
            "clip_frac"} <= set(last)
    assert last["value_loss"] < first["value_loss"]
    assert policy.step == critic.step == 6
    # Each moved its own weights only: the trunks diverge from each other.
    p2, c2 = params(policy.model), params(critic.backend.model)
    key = "lm.model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(p2[key], p[key]) and not torch.equal(c2[key], c[key])
    assert not torch.equal(p2[key], c2[key])
    core.close()


def test_the_critic_can_start_from_a_model_of_its_own(model_dir, tmp_path):
    other = write_tiny_model(tmp_path / "critic", vocab_size=64, seed=5)
    cfg = TrainerConfig.model_validate({**trainer_config(model_dir).model_dump(),
                                        "value_model": {"model_path": str(other)}})
    critic = TorchValueModel(cfg.value_model_config())
    fresh = TorchBackend(TrainerConfig.model_validate({**cfg.model_dump(), "model_path": str(other)})
                         .torch_backend_config())
    key = "lm.model.layers.0.mlp.up_proj.weight"
    assert torch.equal(params(critic.backend.model)[key], params(fresh.model)[key])


def test_the_critic_is_saved_and_restored_with_the_trainer_checkpoint(model_dir, tmp_path):
    steps = [make_samples(2, 4, seed=s, vocab_size=64) for s in (4, 5)]
    core = LearnerCore(trainer_config(model_dir))
    core.load()
    core.train(steps[0])
    core.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / VALUE_MODEL_DIR / "model.safetensors").is_file()
    assert (tmp_path / "ckpt" / VALUE_MODEL_DIR / "optimizer.pt").is_file()
    after = core.train(steps[1])
    want = params(core.value_model.backend.model), params(core.backend.model)
    core.close()

    resumed = LearnerCore(trainer_config(model_dir))
    resumed.load()
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.value_model.step == 1
    again = resumed.train(steps[1])
    got = params(resumed.value_model.backend.model), params(resumed.backend.model)
    for w, g in zip(want, got, strict=True):
        assert set(w) == set(g) and all(torch.equal(w[k], g[k]) for k in w)
    for key in ("value_loss", "critic_grad_norm", "pg_loss", "grad_norm"):
        assert again[key] == after[key], key
    resumed.close()


def test_advantages_come_from_the_critic_values_before_its_update(model_dir):
    core = LearnerCore(trainer_config(model_dir))
    core.load()
    samples = make_samples(2, 4, seed=6, vocab_size=64)
    core.train(samples)  # the critic is no longer zero
    batch = pack_batch(samples, 64)
    values = core.value_model.values(batch)
    want = with_advantages(batch, core.config.loss, values)
    assert float(values.abs().max()) > 0
    # rl_step hands the critic exactly these returns and old values.
    seen = {}
    original = core.value_model.train_step

    def spy(b, cfg):
        seen["returns"], seen["old_values"] = b.returns, b.old_values
        return original(b, cfg)

    core.value_model.train_step = spy
    rl_step(core.backend, samples, core.config.loss, BATCH, value_model=core.value_model)
    assert torch.allclose(seen["returns"], want.returns)
    assert torch.allclose(seen["old_values"], want.old_values)
    core.close()


def test_a_separate_critic_needs_a_value_model_and_the_megatron_backend_a_shared_one(model_dir):
    policy = TorchBackend(trainer_config(model_dir).torch_backend_config())
    with pytest.raises(ValueError, match="needs a value model"):
        rl_step(policy, make_samples(1, 2, vocab_size=64), PPO, BATCH)
    with pytest.raises(ValueError, match='critic = \\\\?"shared'):
        TrainerConfig(model_path=str(model_dir), loss={"algorithm": "ppo"}, backend={"name": "megatron"})
    shared = TrainerConfig(model_path=str(model_dir), loss={"algorithm": "ppo", "critic": "shared"})
    assert shared.torch_backend_config().value_head and not shared.uses_value_model
