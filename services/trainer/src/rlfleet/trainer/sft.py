"""Supervised fine-tuning on demonstrations, with the same backend as RL (baselines and warm starts).

Data: JSONL, one demonstration per line, either
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
rendered with the model's own chat template (tokenizer_config.json; rlfleet's ChatML when it has
none or has that one) and tokenized once with the model's `tokenizer.json` (loss on each assistant
turn's content and the tokens that close it: <|im_end|>, <|eot_id|>, </s>, ...), or
    {"token_ids": [...], "loss_mask": [...]}
taken as is.

    python -m rlfleet.trainer.sft --model-dir M --data demos.jsonl --out OUT [--epochs 1 --lr 1e-5 ...]

Under torchrun every rank reads the data and trains on its share of each batch. Heavy imports are
deferred so that `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.common.chat import IM_END, IM_START, render_messages


def encode_messages(messages: list[dict[str, str]], tokenizer: Any,
                    render=None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask that is 1 on assistant content + <|im_end|>
    (with `render(messages, add_generation_prompt)`, a model's own template: on what the template
    renders for each assistant turn after its generation prompt, closing tokens included, trailing
    newlines not).

    The whole conversation is tokenized in one go (as the engine's context would be) and the mask is
    derived from character offsets, so no token is split differently because of the mask.
    """
    spans = []
    if render is None:
        text = render_messages(messages, add_generation_prompt=False)
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                start = len(render_messages(messages[:i],
                                            add_generation_prompt=False)) + len(f"{IM_START}assistant\n")
                spans.append((start, start + len(message["content"]) + len(IM_END)))
    else:
        text = render(messages, False)
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                start = len(render(messages[:i], True))
                end = len(render(messages[:i + 1], False).rstrip("\n"))
                spans.append((start, end))
    encoding = tokenizer.encode(text, add_special_tokens=False)
    mask = [int(any(lo <= begin < hi for lo, hi in spans)) for begin, _ in encoding.offsets]
    if mask:
        mask[0] = 0
    return list(encoding.ids), mask


def model_template_renderer(model_dir: str | Path):
    """`render(messages, add_generation_prompt)` with the model's chat template, or None when it has
    none or has rlfleet's ChatML (rendered by rlfleet.common.chat, exactly as before)."""
    from rlfleet.common.chat import CHAT_TEMPLATE

    config_file = Path(model_dir) / "tokenizer_config.json"
    template = json.loads(config_file.read_text()).get("chat_template") if config_file.is_file() else None
    if not isinstance(template, str) or not template or template == CHAT_TEMPLATE:
        return None
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    return lambda messages, generation_prompt: hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt)


def load_demonstrations(path: str | Path, tokenizer: Any | None = None, render=None) -> list:
    from rlfleet.trainer.batching import TrainSample

    samples = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "messages" in record:
            if tokenizer is None:
                raise ValueError(f"{path}:{n}: chat messages need the model's tokenizer.json")
            token_ids, loss_mask = encode_messages(record["messages"], tokenizer, render)
        elif "token_ids" in record:
            token_ids = record["token_ids"]
            loss_mask = record.get("loss_mask") or [0] + [1] * (len(token_ids) - 1)
        else:
            raise ValueError(f"{path}:{n}: expected 'messages' or 'token_ids'")
        samples.append(TrainSample(trajectory_id=f"sft-{n}", group_id=f"sft-{n}", token_ids=list(token_ids),
                                   rollout_logprobs=[0.0] * len(token_ids),
                                   loss_mask=list(loss_mask), reward=0.0))
    if not samples:
        raise ValueError(f"{path}: no demonstrations")
    return samples


EVAL_SAMPLES = 512


def _eval_nll(backend, samples, pack_length: int | None) -> float:
    """Mean NLL per loss token of the data set's first EVAL_SAMPLES demonstrations under the current
    weights. Not the whole set: scoring all 2,000 of the repo warm start's before and after is two
    forward passes over it, about a fifth of its three epochs' compute by count (a forward pass is
    about a third of a training step). Inference only, no randomness: the weights trained are the same."""
    from rlfleet.trainer.batching import pack_batch

    samples = samples[:EVAL_SAMPLES]
    total, count = 0.0, 0.0
    for i in range(0, len(samples), 64):
        batch = pack_batch(samples[i:i + 64], pack_length)
        logprobs = backend.compute_logprobs(batch)
        total += float(-(logprobs * batch.loss_mask).sum())
        count += float(batch.loss_mask.sum())
    return total / max(count, 1.0)


def run_sft(model_dir: str, data_path: str, out_dir: str, epochs: int = 1, lr: float = 1e-5,
            batch_size: int = 8, seed: int = 0, pack_length: int | None = None, micro_batch_rows: int = 4,
            lora: dict[str, Any] | None = None,
            progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Trains on the demonstrations, saves an HF checkpoint to out_dir and returns the run's metrics.
    With `lora` (a [trainer.lora] table) only a LoRA adapter trains: out_dir gets the merged model,
    and out_dir/adapter peft's adapter directory. `progress` gets a record about every tenth of the
    steps and at each epoch's end (a warm start on a loaded machine can take most of an hour)."""
    from tokenizers import Tokenizer

    from rlfleet.trainer.batching import pack_batch
    from rlfleet.trainer.config import TorchBackendConfig
    from rlfleet.trainer.objectives import SFTObjective
    from rlfleet.trainer.torch_backend import TorchBackend

    tokenizer_file = Path(model_dir) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.is_file() else None
    samples = load_demonstrations(data_path, tokenizer, model_template_renderer(model_dir))
    steps_per_epoch = -(-len(samples) // batch_size)
    backend = TorchBackend(TorchBackendConfig(
        model_dir=model_dir, seed=seed,
        optim={"lr": lr, "total_steps": max(epochs * steps_per_epoch, 1)},
        batch={"pack_length": pack_length, "micro_batch_rows": micro_batch_rows},
        lora={"enabled": True, **lora} if lora else {}))
    objective = SFTObjective()
    start = time.perf_counter()
    eval_before = _eval_nll(backend, samples, pack_length)
    epoch_losses: list[float] = []
    tokens = 0.0  # a sum of the steps' "tokens" metrics, which are floats
    total_steps = epochs * steps_per_epoch
    every = max(total_steps // 10, 1)
    for epoch in range(epochs):
        order = list(range(len(samples)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        losses = []
        for i in range(0, len(order), batch_size):
            batch = pack_batch([samples[j] for j in order[i:i + batch_size]], pack_length)
            metrics = backend.train_step(batch, objective)
            losses.append(metrics["loss"])
            tokens += metrics["tokens"]
            last = i + batch_size >= len(order)
            if progress is not None and (backend.step % every == 0 or last):
                progress({"epoch": epoch + 1, "epochs": epochs, "step": backend.step, "steps": total_steps,
                          "loss": metrics["loss"], "elapsed_s": round(time.perf_counter() - start, 1)})
        epoch_losses.append(sum(losses) / len(losses))
    eval_after = _eval_nll(backend, samples, pack_length)
    backend.save_hf(out_dir)
    if backend.lora is not None:
        backend.save_adapter(Path(out_dir) / "adapter")
    wall = time.perf_counter() - start
    backend.close()
    return {"samples": len(samples), "steps": backend.step, "epochs": epochs, "epoch_losses": epoch_losses,
            "eval_loss_before": eval_before, "eval_loss_after": eval_after, "tokens": tokens,
            "tokens_per_s": tokens / wall, "wall_s": wall, "out_dir": str(out_dir)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.trainer.sft",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True,
                        help="HF directory of the starting model (+ tokenizer.json)")
    parser.add_argument("--data", required=True, help="demonstrations, JSONL")
    parser.add_argument("--out", required=True, help="where the fine-tuned HF checkpoint is written")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=8, help="demonstrations per optimizer step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pack-length", type=int, default=None,
                        help="tokens per packed row (default: the longest demonstration of each batch)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train a LoRA adapter of this rank (alpha = 2 x rank) "
                        "instead of the whole model")
    args = parser.parse_args(argv)
    lora = {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank} if args.lora_rank else None
    metrics = run_sft(args.model_dir, args.data, args.out, args.epochs, args.lr, args.batch_size, args.seed,
                      args.pack_length, lora=lora,
                      progress=lambda record: print(json.dumps({"progress": record}), flush=True))
    print(json.dumps(metrics))


if __name__ == "__main__":
    main()
