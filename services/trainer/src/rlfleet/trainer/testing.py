"""Tiny models, tokenizers and trajectories for tests, benchmarks and smoke runs (no downloads)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.common.chat import SPECIAL_TOKENS
from rlfleet.common.config import NatsConfig
from rlfleet.common.grpc_server import blocking_channel
from rlfleet.common.processes import ProcessNotReady, ServiceProcess, find_binary, wait_until
from rlfleet.common.streams import connect_nats, ensure_streams, publish
from rlfleet.trainer.batching import TrainSample


def tiny_qwen2_config(vocab_size: int = 64, hidden_size: int = 32, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, intermediate_size: int | None = None) -> dict[str, Any]:
    return dict(model_type="qwen2", vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=intermediate_size or 2 * hidden_size, max_position_embeddings=4096,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_samples(num_groups: int, group_size: int, lengths: tuple[int, int] = (6, 12), vocab_size: int = 64,
                 seed: int = 0, observation: bool = True) -> list[TrainSample]:
    """Random multi-turn-shaped trajectories: prompt, generated span, observation, generated span.

    Rewards alternate within a group so that group-normalised advantages are never all zero.
    """
    rng = random.Random(seed)
    samples = []
    for g in range(num_groups):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 4))]
        for k in range(group_size):
            n = rng.randint(*lengths)
            tokens = prompt + [rng.randrange(3, vocab_size) for _ in range(max(n - len(prompt), 2))]
            mask = [0] * len(prompt) + [1] * (len(tokens) - len(prompt))
            if observation and len(tokens) - len(prompt) >= 6:
                # Mark a tool observation in the middle: not generated, no loss.
                mid = len(prompt) + 2
                mask[mid:mid + 2] = [0, 0]
            logprobs = [-rng.uniform(0.5, 4.0) if m else 0.0 for m in mask]
            samples.append(TrainSample(trajectory_id=f"t{g}-{k}", group_id=f"g{g}", token_ids=tokens,
                                       rollout_logprobs=logprobs, loss_mask=mask, reward=float(k % 2),
                                       policy_version=0))
    return samples


def write_tiny_tokenizer(out_dir: str | Path, corpus: list[str], vocab_size: int = 300) -> Path:
    """Trains a byte-level BPE with the chat special tokens and writes tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    path = Path(out_dir) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def write_tiny_model(out_dir: str | Path, vocab_size: int = 320, seed: int = 0, **config: Any) -> Path:
    """A random tiny Qwen2 as an HF directory (config.json, model.safetensors, tokenizer.json): a
    `model_path` for the trainer service in tests and benchmarks."""
    import torch
    import transformers

    out = Path(out_dir)
    params = tiny_qwen2_config(vocab_size=vocab_size, **config)
    hf_config = transformers.AutoConfig.for_model(params.pop("model_type"), **params)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(out)
    corpus = [f"<|im_start|>user\nwhat is {a} * {a + 3}?<|im_end|>\n<|im_start|>assistant\n"
              f"<calc>{a}*{a + 3}</calc>"
              for a in range(200)]
    write_tiny_tokenizer(out, corpus, vocab_size=min(vocab_size, 300))
    return out


def trajectory_protos(num_groups: int, group_size: int, run_id: str, vocab_size: int = 320, seed: int = 0,
                      policy_version: int = 0, lengths: tuple[int, int] = (6, 12), prefix: str = "") -> list:
    """`Trajectory` protos shaped like make_samples' (prompt, generated, observation, generated),
    with spans, verdicts and status: what the session server publishes on TRAJECTORIES."""
    out = []
    for s in make_samples(num_groups, group_size, lengths=lengths, vocab_size=vocab_size, seed=seed):
        k = int(s.trajectory_id.rsplit("-", 1)[1])
        traj = common_pb2.Trajectory(
            schema_version=common_pb2.SCHEMA_VERSION_1, trajectory_id=f"{prefix}{run_id}-{s.trajectory_id}",
            run_id=run_id, task_id=f"task-{s.group_id}", group_id=f"{prefix}{run_id}-{s.group_id}",
            sample_index=k, group_size=group_size, token_ids=s.token_ids, rollout_logprobs=s.rollout_logprobs,
            loss_mask=s.loss_mask, status=common_pb2.TRAJECTORY_STATUS_COMPLETED,
            verdict=common_pb2.Verdict(schema_version=1, reward=s.reward, passed=s.reward > 0))
        traj.spans.extend(_spans(s.loss_mask, policy_version))
        out.append(traj)
    return out


def _spans(mask: list[int], policy_version: int) -> list:
    """Spans tiling the sequence: PROMPT first, then GENERATED runs (mask 1) and OBSERVATION runs (mask 0)."""
    spans, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            if mask[start]:
                kind, version = common_pb2.SPAN_KIND_GENERATED, policy_version
            else:
                kind = common_pb2.SPAN_KIND_PROMPT if start == 0 else common_pb2.SPAN_KIND_OBSERVATION
                version = -1
            spans.append(common_pb2.Span(kind=kind, start=start, end=i, policy_version=version))
            start = i
    return spans


async def publish_trajectories(js: Any, run_id: str, trajectories: list) -> None:
    """Publishes `Trajectory` protos on the run's TRAJECTORIES subject, as the session server does."""
    for traj in trajectories:
        await publish(js, "TRAJECTORIES", run_id, traj.SerializeToString(), msg_type="Trajectory",
                      msg_id=traj.trajectory_id)


async def publish_trajectories_to(nats_url: str, run_id: str, trajectories: list, name: str = "test") -> None:
    """publish_trajectories over a connection of its own (for tests that run no event loop of their own)."""
    nc = await connect_nats(NatsConfig(url=nats_url), name)
    js = nc.jetstream()
    await ensure_streams(js)
    await publish_trajectories(js, run_id, trajectories)
    await nc.close()


def run_torchrun(script: str | Path, args: list[str], nproc: int, timeout_s: float) -> None:
    """`torchrun --standalone` of a script with one thread per rank; raises with its log's
    tail if it fails."""
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.Popen([str(torchrun), "--standalone", f"--nproc-per-node={nproc}", str(script), *args],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # torchrun's workers live in sessions of their own; on SIGTERM torchrun stops them itself.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        finally:
            proc.kill()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {script} exited with {proc.returncode}:\n{log.decode()[-4000:]}")


class TrainerProcess(ServiceProcess):
    """The `rlfleet-trainer` console script as a subprocess (integration tests, benchmarks); stopped by PID.

    Its log and ready file keep their names across restarts in one `workdir`, so the log of a
    trainer restarted there holds every run of it."""

    def __init__(self, workdir: str | Path, nats_url: str, run_id: str, model_path: str | Path | None,
                 *args: str, name: str = "trainer", nproc: int = 1) -> None:
        workdir = Path(workdir)
        script = find_binary("rlfleet-trainer")
        # nproc > 1: under `torchrun --standalone`, rank 0 serving.
        launcher = [find_binary("torchrun"), "--standalone", f"--nproc-per-node={nproc}", "--no-python"] \
            if nproc > 1 else []
        flags = ["--nats.url", nats_url, "--run-id", run_id, "--torch-threads", "1", "--log.format", "text",
                 *args]
        if model_path is not None:
            flags += ["--model-path", str(model_path), "--weight-store", str(workdir / "weights")]
        super().__init__([*launcher, script], workdir, *flags, name=name, log_path=workdir / f"{name}.log",
                         ready_file=workdir / f"{name}.ready.json")
        self._same = (workdir, nats_url, run_id, model_path, args, name, nproc)

    def standby(self, timeout_s: float = 300.0) -> TrainerProcess:
        """A `--standby` twin (same directory, log and ready file), started and waiting, its imports
        done (rlfleet.common.standby); `promote` makes it the trainer. Starting it removes this
        one's ready file, which the promoted twin writes again."""
        from rlfleet.common import standby

        workdir, nats_url, run_id, model_path, args, name, nproc = self._same
        twin = TrainerProcess(workdir, nats_url, run_id, model_path, *args, standby.FLAG,
                              name=name, nproc=nproc)
        twin.spawn()
        wait_until(lambda: standby.waiting_pid(twin.ready_file) == twin.pid, timeout_s,
                   f"{name} standby", twin)
        return twin

    def promote(self, timeout_s: float = 300.0) -> TrainerProcess:
        """A standby told to take over, once it serves."""
        from rlfleet.common.standby import PROMOTE

        assert self.process is not None
        self.process.send_signal(PROMOTE)
        self.wait_ready(timeout_s)
        return self

    def start(self, timeout_s: float = 60.0) -> TrainerProcess:
        super().start(timeout_s)
        return self

    def call(self, method: str, timeout_s: float = 30.0):
        request = getattr(trainer_pb2, f"{method}Request", None) or trainer_pb2.GetStatusRequest
        with blocking_channel(self.address) as channel:
            return getattr(trainer_pb2_grpc.TrainerServiceStub(channel), method)(request(), timeout=timeout_s)

    def status(self):
        return self.call("GetStatus")

    def wait_for(self, predicate, timeout_s: float = 60.0, what: str = "condition"):
        """The trainer's status once `predicate(status)` holds; fails when the trainer exits first."""
        last: list = []

        def holds():
            try:
                last[:] = [self.status()]
            except grpc.RpcError as exc:
                # A trainer starved of CPU (two ranks on two cores) can drop a TLS handshake; the
                # next poll retries, and `wait_until` still fails at once when the process exits.
                if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
                return None
            return last[0] if predicate(last[0]) else None

        try:
            return wait_until(holds, timeout_s, f"{self.name} ({what})", self)
        except ProcessNotReady as exc:
            raise ProcessNotReady(f"{exc}\nlast status:\n{last[0] if last else None}") from None
