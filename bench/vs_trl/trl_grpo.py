"""TRL's GRPOTrainer on the calc agent task: one workload, one process, a results JSON.

    .venv/bin/python bench/vs_trl/trl_grpo.py --settings settings.json --out result.json

`run.py` starts this as a child process per workload (its peak RSS is then TRL's alone). The
settings file is `common.TrlJob` as JSON. What runs:

- the base policy directory rlfleet's warm start built (same weights, same tokenizer);
- TRL's own generation loop (transformers `generate` on CPU) with TRL's multi-turn tool support:
  the `calc` tool, the workload's extra latency slept inside it;
- the reward: rlfleet's verifier code on the completion's transcript (`calc_format.CalcScorer`);
- GRPO with the settings rlfleet uses (G, groups per step, lr, clip 0.2, token-mean loss, no KL,
  group-std advantages, AdamW, grad-norm 1.0, constant lr, one optimizer step per batch, bf16
  autocast as rlfleet's trainer, or fp32 for both: `Settings.bf16`);
- a callback that evaluates held-out success every `eval_every_steps` steps, and stops when the
  *training clock* (wall time minus evaluation time) reaches the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TrlJob


class Meter:
    """Time and token accounting around TRL's trainer, via its callback hooks and two wrapped methods."""

    def __init__(self) -> None:
        self.train_start = 0.0
        self.eval_s = 0.0
        self.rollout_s = 0.0  # generation + tool calls + rewards (`_generate_and_score_completions`)
        self.completions = 0
        self.trained_tokens = 0
        self.loss_tokens = 0
        self.steps = 0
        self.curve: list[dict] = []
        self.tools: dict = {}

    def train_clock(self) -> float:
        return time.monotonic() - self.train_start - self.eval_s if self.train_start else 0.0

    def wall(self) -> float:
        return time.monotonic() - self.train_start if self.train_start else 0.0

    def wrap(self, trainer) -> None:
        inner = trainer._generate_and_score_completions

        def timed(batch):
            started = time.monotonic()
            out = inner(batch)
            self.rollout_s += time.monotonic() - started
            # Trained tokens as rlfleet's trainer counts them (its step metric `tokens`): every token of
            # the trained sequences, prompt and tool results included; loss tokens (policy-generated) apart.
            completion = out["completion_mask"]
            loss = completion * out["tool_mask"] if "tool_mask" in out else completion
            self.completions += int(out["completion_ids"].shape[0])
            self.trained_tokens += int(out["prompt_mask"].sum().item() + completion.sum().item())
            self.loss_tokens += int(loss.sum().item())
            return out

        trainer._generate_and_score_completions = timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    job = TrlJob.model_validate_json(args.settings.read_text())
    result = run(job)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


def run(job: TrlJob) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(job.torch_threads))
    import torch

    torch.set_num_threads(job.torch_threads)
    from calc_format import (
        CalcScorer,
        completion_transcript,
        configure_tokenizer_for_trl,
        evaluate_success,
        make_calc_tool,
    )
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlfleet.cli.loop_parts import latency_sampler
    from rlfleet.cli.run_config import ToolLatencyConfig
    from rlfleet.envkit.suites import calc

    s = job.settings
    train = calc.generate_tasks("train", 2000, seed=s.seed, difficulty=s.difficulty)
    heldout = calc.generate_tasks("heldout", s.heldout, seed=s.seed, difficulty=s.difficulty)
    limits = train[0].limits
    tokenizer = AutoTokenizer.from_pretrained(job.policy_dir)
    configure_tokenizer_for_trl(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(job.policy_dir, dtype=torch.float32)
    torch.manual_seed(s.seed)

    meter = Meter()
    delay = latency_sampler(ToolLatencyConfig(**job.tool_latency), s.seed)
    tool = make_calc_tool(delay, time.sleep, meter.tools)
    scorer = CalcScorer(train)
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id}
    rewards_seen: list[float] = []

    def verifier_reward(prompts, completions, completion_ids, task_id, **_):
        scores = [scorer.score(tid, completion_transcript(tokenizer, ids),
                               truncated=not ids or ids[-1] not in eos)
                  for tid, ids in zip(task_id, completion_ids, strict=True)]
        rewards_seen.extend(sc.reward for sc in scores)
        return [sc.reward for sc in scores]

    dataset = Dataset.from_list([
        {"prompt": [m for m in t.chat_messages() if m["role"] != "system"],
         "task_id": t.task_id} for t in train])
    batch = s.group_size * s.groups_per_step
    config = GRPOConfig(
        output_dir=str(job.work_dir / "trl-output"), report_to="none", save_strategy="no", logging_steps=1,
        use_cpu=True, bf16=s.bf16, fp16=False, seed=s.seed, data_seed=s.seed, dataloader_num_workers=0,
        # one optimizer step per G * groups_per_step completions, as rlfleet's trainer
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=s.group_size,
        num_iterations=1, max_steps=100_000,
        # the loss: rlfleet's GRPO defaults (trainer/config.py LossConfig, OptimConfig)
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        epsilon=0.2, epsilon_high=0.2, beta=0.0, loss_type="dapo", scale_rewards="group",
        # sampling: the calc task's limits, per turn and in total
        temperature=s.temperature, top_p=1.0, top_k=0,
        generation_kwargs={"max_new_tokens": limits.max_new_tokens},
        max_completion_length=s.max_completion_tokens, max_tool_calling_iterations=limits.max_turns,
        log_completions=False, disable_tqdm=True, gradient_checkpointing=False,  # rlfleet trains without it
    )

    class BenchCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            meter.train_start = time.monotonic()

        def on_step_end(self, args, state, control, **kw):
            meter.steps = state.global_step
            if meter.train_clock() >= s.budget_s:
                control.should_training_stop = True
            elif state.global_step % s.eval_every_steps == 0:
                evaluate(state.global_step, "candidate")
            return control

    def evaluate(version: int, label: str) -> None:
        started = time.monotonic()
        success = evaluate_success(model, tokenizer, heldout, temperature=s.eval_temperature,
                                   seed=s.seed + version)
        spent = time.monotonic() - started
        if meter.train_start:
            meter.eval_s += spent
        meter.curve.append({"elapsed_s": round(meter.train_clock(), 2), "wall_s": round(meter.wall(), 2),
                            "version": version, "success": success, "label": label,
                            "eval_s": round(spent, 2)})
        print(f"[trl {meter.train_clock():6.1f}s] step {version:3d} held-out success {success:.3f} "
              f"({label}, eval {spent:.1f} s)", flush=True)

    evaluate(0, "baseline")
    trainer = GRPOTrainer(model=model, reward_funcs=[verifier_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, tools=[tool], callbacks=[BenchCallback()])
    trainer.remove_callback(PrinterCallback)  # our own progress lines instead of a dict per step
    meter.wrap(trainer)
    trainer.train()
    train_s, wall_s, eval_s = meter.train_clock(), meter.wall(), meter.eval_s
    evaluate(meter.steps, "final")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {
        "system": "trl", "wall_s": round(train_s, 2), "wall_with_eval_s": round(wall_s, 2),
        "eval_s": round(eval_s, 2), "steps": meter.steps, "completions": meter.completions,
        "trained_tokens": meter.trained_tokens, "loss_tokens": meter.loss_tokens,
        "loss_tokens_per_s": meter.loss_tokens / train_s if train_s else 0.0,
        "completions_per_s": meter.completions / train_s if train_s else 0.0,
        "trained_tokens_per_s": meter.trained_tokens / train_s if train_s else 0.0,
        "trainer_idle_fraction": min(1.0, meter.rollout_s / train_s) if train_s else 0.0,
        "rollout_s": round(meter.rollout_s, 2), "tool_calls": meter.tools.get("calls", 0),
        "tool_latency_s": round(meter.tools.get("latency_s", 0.0), 2),
        "reward_mean": sum(rewards_seen) / len(rewards_seen) if rewards_seen else 0.0,
        "peak_rss_mb": round(peak_rss_mb, 1), "heldout_curve": meter.curve,
        "versions": {"trl": _version("trl"), "transformers": _version("transformers"),
                     "torch": torch.__version__},
    }


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    raise SystemExit(main())
