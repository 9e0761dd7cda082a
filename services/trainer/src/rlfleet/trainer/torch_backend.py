"""The default training backend: a transformers causal LM trained with AdamW, FSDP2 at world size >= 2.

Launched plainly it trains in one process; launched by torchrun (WORLD_SIZE >= 2) it joins a
process group (gloo on CPU, NCCL on CUDA), shards every decoder layer and the root with
`fully_shard`, and each rank trains on its share of the rows of the global batch. The loss of a
micro-batch is its share of the *global* mean (see losses.LossNorm), times the world size because
FSDP averages gradients over ranks, so one step at any world size is the same step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlfleet.trainer import attention, checkpoint, lora
from rlfleet.trainer.backend import LossFn, MetricReducer, ModelOutputs, TrainingBackend
from rlfleet.trainer.batching import TrainBatch, shard_rows
from rlfleet.trainer.config import LoraConfig, OptimConfig, TorchBackendConfig
from rlfleet.trainer.losses import LossNorm, Metrics, logprobs_and_entropy

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")
LM_PREFIX = "lm."  # the policy module's LM; `value_head.*` beside it


def _full_options() -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


class PolicyModel(nn.Module):
    """The causal LM plus an optional value head on the final hidden state.

    One module so that FSDP's root is the thing whose forward we call; calling the LM's submodules
    from outside a sharded root would skip its unshard hooks.
    """

    def __init__(self, lm: PreTrainedModel | PeftModel, value_head: bool, values_only: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.values_only = values_only  # a critic: the LM head is never run
        head = lm.get_output_embeddings()
        if values_only and head.weight is not lm.get_input_embeddings().weight:
            # Never run, so never stepped: frozen, it has no optimizer state to save or miss on load.
            head.weight.requires_grad_(False)
        self.value_head = None
        if value_head:
            self.value_head = nn.Linear(lm.config.hidden_size, 1)
            # Start from V = 0 so that early advantages are the plain returns, not noise.
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None,
                with_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        hidden = self.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                       attention_mask=attention_mask, use_cache=False).last_hidden_state
        logits = None if self.values_only or not with_logits else self.lm.get_output_embeddings()(hidden)
        values = self.value_head(hidden).squeeze(-1) if self.value_head is not None else None
        return logits, values


def build_lm(cfg: TorchBackendConfig) -> PreTrainedModel:
    import transformers

    attn = attention.implementation(cfg.attn_implementation, cfg.bf16, cfg.device)
    if cfg.model_dir is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(
            cfg.model_dir, dtype=torch.float32, attn_implementation=attn)
    params = dict(cfg.model_config_dict or {})
    config = transformers.AutoConfig.for_model(params.pop("model_type", "qwen2"), **params)
    torch.manual_seed(cfg.seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak LR for the optimizer step with index `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min(max((step - cfg.warmup_steps) / span, 0.0), 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _init_distributed(device: str) -> tuple[int, int, bool]:
    """(rank, world size, whether we created the process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return 0, 1, False
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), True


class TorchBackend(TrainingBackend):
    def __init__(self, cfg: TorchBackendConfig) -> None:
        self.cfg = cfg
        self.device_type = "cuda" if cfg.device == "cuda" else "cpu"
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
            if self.device_type == "cuda" else torch.device("cpu")
        if self.device_type == "cuda":
            torch.cuda.set_device(self.device)  # before NCCL init, so that each rank owns its GPU
        self.rank, self.world_size, self._owns_group = _init_distributed(self.device_type)
        base = build_lm(cfg)
        lm: PreTrainedModel | PeftModel = base
        self.lora = cfg.lora if cfg.lora.enabled else None
        if self.lora is not None:
            # Base frozen, adapter (lora_B = 0) trainable: the optimizer below holds the adapter only.
            lm = lora.wrap(base, self.lora, cfg.model_dir or "")
        # Seeded after the LM so that the value head is identical on every rank and every run.
        torch.manual_seed(cfg.seed)
        self.model = PolicyModel(lm, cfg.value_head, cfg.values_only).to(self.device)
        if self.world_size > 1:
            self._shard()
        o = self.optim_cfg = cfg.optim
        self._trainable_names = {n for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(self._param_groups(o.lr), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda s: lr_factor(s, self.optim_cfg))
        self._step = 0

    def _param_groups(self, lr: float) -> list[dict[str, Any]]:
        """The trainable parameters; with LoRA+ (`lora.b_lr_ratio` > 1) lora_B in a group of its own
        at the larger learning rate (the scheduler scales both groups alike)."""
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        ratio = self.lora.b_lr_ratio if self.lora is not None else 1.0
        if ratio == 1.0:
            return [{"params": [p for _, p in trainable], "lr_ratio": 1.0}]
        b = [p for n, p in trainable if ".lora_B." in n]
        rest = [p for n, p in trainable if ".lora_B." not in n]
        return [{"params": rest, "lr_ratio": 1.0}, {"params": b, "lr": lr * ratio, "lr_ratio": ratio}]

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device_type, (self.world_size,))
        for layer in self.model.lm.get_decoder().layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    @property
    def step(self) -> int:
        return self._step

    @property
    def hf_model(self) -> nn.Module:
        """The transformers model itself (under peft: the wrapped one, adapters injected)."""
        return self._peft_model().get_base_model() if self.lora is not None else self.model.lm

    def _full_model_state(self) -> dict[str, torch.Tensor]:
        """The model's whole state dict (gathered from every rank, on the CPU): parameters and
        buffers, so tensors only; collective."""
        full: dict[str, torch.Tensor] = {}
        for name, value in get_model_state_dict(self.model, options=_full_options()).items():
            assert isinstance(value, torch.Tensor), name
            full[name] = value
        return full

    def _peft_model(self) -> PeftModel:
        """The LM as peft wrapped it (LoRA only)."""
        from peft import PeftModel  # imported already: lora.wrap made the model with it

        assert isinstance(self.model.lm, PeftModel), "this backend trains no LoRA adapter"
        return self.model.lm

    @property
    def lm_config(self):
        return self.hf_model.config

    # ------------------------------------------------------------ forward

    def _forward(self, mb: TrainBatch, with_values: bool, entropy_grad: bool, with_logprobs: bool = True,
                 with_entropy: bool = True) -> ModelOutputs:
        attention_mask = None if mb.attention_mask is None else mb.attention_mask.to(self.device)
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            logits, values = self.model(mb.input_ids.to(self.device),
                                        mb.position_ids.to(self.device), attention_mask,
                                        with_logits=with_logprobs)
        if logits is None:  # a critic, or values alone
            logprobs, entropy = torch.zeros(mb.input_ids.shape, device=self.device), None
        else:
            logprobs, entropy = logprobs_and_entropy(logits, mb.input_ids.to(self.device),
                                                     with_entropy, entropy_grad)
        if with_values:
            if values is None:
                raise ValueError("the loss needs values but the backend has no value head "
                                 "(set value_head=true)")
            # The value of the state before token t lives on the hidden state of position t - 1.
            values = nn.functional.pad(values[:, :-1].float(), (1, 0))
        return ModelOutputs(logprobs=logprobs, entropy=entropy, values=values if with_values else None)

    def _dummy_pass(self, backward: bool) -> None:
        """Keeps FSDP's collectives in step when this rank has fewer micro-batches than another."""
        ids = torch.full((1, 2), self.cfg.batch.pad_token_id, dtype=torch.long, device=self.device)
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            logits, values = self.model(ids, torch.arange(2, device=self.device)[None], None)
        if backward:
            zero = values.new_zeros(()) if logits is None else logits.float().sum() * 0.0
            if values is not None:
                zero = zero + values.float().sum() * 0.0
            zero.backward()

    def _my_chunks(self, batch: TrainBatch) -> tuple[list[list[int]], int]:
        rows = shard_rows(batch, self.rank, self.world_size)
        k = self.cfg.batch.micro_batch_rows
        chunks = [rows[i:i + k] for i in range(0, len(rows), k)]
        return chunks, self._max_over_ranks(len(chunks))

    def _max_over_ranks(self, n: int) -> int:
        if self.world_size == 1:
            return n
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def forward_inference(self, batch: TrainBatch, with_values: bool = False) -> ModelOutputs:
        return self._inference(batch, with_values)

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._inference(batch, with_values=False, with_entropy=False).logprobs

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        # No LM head and no softmax over the vocabulary: PPO's proximal log-probs come from the training pass.
        values = self._inference(batch, with_values=True, with_logprobs=False).values
        assert values is not None
        return values

    @torch.no_grad()
    def _inference(self, batch: TrainBatch, with_values: bool, with_logprobs: bool = True,
                   with_entropy: bool = True) -> ModelOutputs:
        self.model.eval()
        chunks, n = self._my_chunks(batch)
        # Filled on the device: NCCL reduces device tensors only.
        shape, dev = batch.input_ids.shape, self.device
        logprobs, entropy = torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)
        values = torch.zeros(shape, device=dev) if with_values else None
        for i in range(n):
            if i >= len(chunks):
                self._dummy_pass(backward=False)
                continue
            mb = batch.select_rows(chunks[i])
            out = self._forward(mb, with_values, entropy_grad=False, with_logprobs=with_logprobs,
                                with_entropy=with_entropy)
            idx, width = torch.tensor(chunks[i], device=dev), mb.input_ids.shape[1]
            # A sequence's first token has nothing to be predicted from (packed: it would be
            # the previous sample).
            valid = ((mb.seq_ids >= 0) & (mb.position_ids > 0)).float().to(dev)
            logprobs[idx, :width] = out.logprobs.float() * valid
            if out.entropy is not None:
                entropy[idx, :width] = out.entropy.float() * valid
            if values is not None:
                assert out.values is not None  # with_values: the value head ran
                values[idx, :width] = out.values.float() * valid
        if self.world_size > 1:
            # Every row was filled by exactly one rank and is zero elsewhere, so a sum is a gather.
            for t in (logprobs, entropy, values):
                if t is not None:
                    dist.all_reduce(t)
        self.model.train()
        return ModelOutputs(logprobs=logprobs.cpu(), entropy=entropy.cpu(),
                            values=None if values is None else values.cpu())

    # ------------------------------------------------------------ train

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> Metrics:
        start = time.perf_counter()
        self.model.train()
        norm = LossNorm(batch.num_loss_tokens, batch.num_seqs, batch.seq_num_loss_tokens.to(self.device))
        needs_values = getattr(loss_fn, "needs_values", False)
        entropy_grad = getattr(loss_fn, "needs_entropy_grad", False)
        chunks, n = self._my_chunks(batch)
        reducer = MetricReducer()
        for i in range(n):
            self._sync_gradients(last=i == n - 1)
            if i >= len(chunks):
                self._dummy_pass(backward=True)
                continue
            mb = _to_device(batch.select_rows(chunks[i]), self.device)
            loss, metrics = loss_fn(self._forward(mb, needs_values, entropy_grad), mb, norm)
            # FSDP averages gradients over ranks; the loss is already this micro-batch's
            # share of the global mean.
            (loss * self.world_size).backward()
            reducer.add(metrics, float(mb.loss_mask.sum()))
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = self._clip_grad_norm()
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
            self._step += 1
        self.optimizer.zero_grad(set_to_none=True)
        out = self._gather_metrics(reducer)
        tokens = int((batch.seq_ids >= 0).sum())
        elapsed = time.perf_counter() - start
        out.update(grad_norm=grad_norm, lr=lr, step=self._step, skipped=float(skipped), tokens=tokens,
                   loss_tokens=batch.num_loss_tokens, seqs=batch.num_seqs, step_time_s=elapsed,
                   tokens_per_s=tokens / elapsed)
        return out

    def _sync_gradients(self, last: bool) -> None:
        # FSDP: accumulate unsharded gradients locally and reduce-scatter once, after the last micro-batch
        # (one collective per step instead of one per micro-batch, for the memory of a full gradient).
        if self.world_size > 1:
            from torch.distributed.fsdp import FSDPModule

            assert isinstance(self.model, FSDPModule)  # _shard made it one
            self.model.set_requires_gradient_sync(last)

    def _clip_grad_norm(self) -> float:
        max_norm = self.optim_cfg.max_grad_norm or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        # Under FSDP2 the norm is a DTensor; its full value is the global norm.
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _gather_metrics(self, reducer: MetricReducer) -> Metrics:
        if self.world_size == 1:
            return reducer.result()
        everyone: list[MetricReducer | None] = [None] * self.world_size
        dist.all_gather_object(everyone, reducer)
        return MetricReducer.combine(r for r in everyone if r is not None).result()

    def set_lr(self, lr: float) -> None:
        groups = self.optimizer.param_groups
        self.scheduler.base_lrs = [lr * g.get("lr_ratio", 1.0) for g in groups]
        factor = lr_factor(self.scheduler.last_epoch, self.optim_cfg)
        for group, base in zip(groups, self.scheduler.base_lrs, strict=True):
            group["initial_lr"] = base
            group["lr"] = base * factor

    # ------------------------------------------------------------ state, export and checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Stateful (collective): the full model and optimizer state (on rank 0; empty elsewhere),
        the step and the LR schedule."""
        model, optimizer = get_state_dict(self.model, self.optimizer, options=_full_options())
        trainer = {"step": self._step, "scheduler": self.scheduler.state_dict()}
        if self.lora is not None:
            # The base is frozen and comes from model_dir: a checkpoint holds what trains (the adapter,
            # a value head) and the LoRA shape it was trained with.
            model = {k: v for k, v in model.items() if k in self._trainable_names}
            trainer["lora"] = self.lora.model_dump()
        return {"model": model, "optimizer": optimizer, "trainer": trainer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Stateful (collective): rank 0's model and optimizer state, broadcast to the other ranks."""
        saved_lora = state["trainer"].get("lora")
        if saved_lora is not None:  # with today's defaults for settings added since it was written
            saved_lora = {**LoraConfig().model_dump(), **saved_lora}
        mine = self.lora.model_dump() if self.lora is not None else None
        if saved_lora != mine:
            raise ValueError(f"the checkpoint was trained with lora = {saved_lora}, this "
                             f"trainer has lora = {mine}: "
                             "a LoRA checkpoint holds the adapter only and resumes only with "
                             "the same [trainer.lora]")
        # A LoRA checkpoint holds the trainable parameters only; the frozen base stays as loaded.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world_size > 1,
                                   strict=self.lora is None)
        # Two calls, not set_state_dict: that one treats an empty model dict (every rank but 0 when
        # broadcasting) as "optimizer only" and the ranks' collectives stop matching (torch 2.13).
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["trainer"]["scheduler"])
        self._step = int(state["trainer"]["step"])

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        """HF names (`model.layers.0...`, `lm_head.weight`), no value head; full tensors on rank 0 only."""
        full = self._full_model_state()
        if self.rank != 0:
            return {}
        if self.lora is not None:
            out = lora.merged_tensors(full, LM_PREFIX, self.lora)
        else:
            out = {k[len(LM_PREFIX):]: v.detach().to("cpu").contiguous().clone()
                   for k, v in full.items() if k.startswith(LM_PREFIX)}
        if getattr(self.lm_config, "tie_word_embeddings", False):
            # Tied heads are stored once, as HF does; transformers re-ties on load.
            out.pop("lm_head.weight", None)
        return out

    def base_state_for_export(self) -> dict[str, torch.Tensor]:
        """LoRA: the frozen base weights, HF-named (what every adapter version applies to); rank 0 only."""
        full = self._full_model_state()
        if self.rank != 0:
            return {}
        out = lora.base_tensors(full, LM_PREFIX) if self.lora is not None else \
            {k[len(LM_PREFIX):]: v.detach().to("cpu").contiguous().clone() for k, v in full.items()
             if k.startswith(LM_PREFIX)}
        if getattr(self.lm_config, "tie_word_embeddings", False):
            out.pop("lm_head.weight", None)
        return out

    def adapter_for_export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """LoRA: the adapter's tensors under peft's file names and its adapter_config.json (rank 0;
        empty elsewhere)."""
        if self.lora is None:
            raise ValueError("this backend trains no LoRA adapter ([trainer.lora] enabled = false)")
        full = self._full_model_state()
        if self.rank != 0:
            return {}, {}
        return lora.adapter_tensors(full, LM_PREFIX), lora.adapter_config(self._peft_model())

    def save_adapter(self, out_dir: str | Path) -> None:
        """LoRA: peft's adapter directory (adapter_config.json + adapter_model.safetensors)."""
        tensors, config = self.adapter_for_export()
        if self.rank == 0:
            out_dir = Path(out_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        self.barrier()

    def save_hf(self, out_dir: str | Path) -> None:
        out_dir = Path(out_dir)
        state = self.state_dict_for_export()
        if self.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            config = self.lm_config
            if not getattr(config, "architectures", None):
                # Engines (SGLang, vLLM) pick the model class from `architectures`; a model built from a
                # config has none until transformers' own save_pretrained would fill it in.
                config.architectures = [type(self.hf_model).__name__]
            config.dtype = "float32"
            config.save_pretrained(out_dir)
            save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
            source = self.cfg.model_dir
            for name in TOKENIZER_FILES:
                if source is not None and (Path(source) / name).is_file():
                    shutil.copyfile(Path(source) / name, out_dir / name)
        self.barrier()

    def save_checkpoint(self, ckpt_dir: str | Path) -> None:
        checkpoint.save_checkpoint(self, Path(ckpt_dir))

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        checkpoint.load_checkpoint(self, Path(ckpt_dir))

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


def _to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    if device.type == "cpu":
        return batch
    moved = {k: v.to(device) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    return batch.replace(**moved)
