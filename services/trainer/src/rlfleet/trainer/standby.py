"""What a standby trainer (`rlfleet-trainer --standby`, rlfleet.common.standby) does before it waits.

Most of a restarted trainer's time before it trains again is imports: torch, transformers' modeling
code (and through it torch._dynamo), torch.distributed's state-dict helpers, and the modeling module
of the model's architecture, which the first `from_pretrained` imports. A standby imports them all
and builds nothing: the model, the optimizer and the checkpoint are loaded after the promotion, from
the checkpoint the dead trainer left, exactly as in a cold start (so exactly-once rests on the same
checkpoint and ack discipline). Importable without torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlfleet.trainer.service_config import TrainerConfig


def warm_up(config: TrainerConfig) -> None:
    model_type = _model_type(config)
    if model_type is None:
        return  # no model: the trainer only serves status and never imports torch
    import torch  # noqa: F401
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import rlfleet.trainer.consumer
    import rlfleet.trainer.loop
    import rlfleet.trainer.objectives
    import rlfleet.trainer.torch_backend  # noqa: F401

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is not None:
        getattr(transformers, name)  # imports the modeling module of this architecture


def _model_type(config: TrainerConfig) -> str | None:
    """The model_type of the configured model directory; None without one (errors are left to the
    promoted trainer, which reports them as a start does)."""
    if not config.has_model:
        return None
    try:
        return json.loads((Path(config.model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
